//! Waiting, for a thread or a task: the procedure of a call waiting for
//! permits ([`Waits`]: each [`Waits::round`] reads the clocks, asks the core,
//! and says how long to sleep), its thread driver ([`wait_sync`]; the task's
//! is the coroutine `Acquiring`), how either sleeps (on the limiter's clock
//! when it has its own `sleep` / `sleep_async`, else `time.sleep` /
//! `asyncio.sleep`), and how a coroutine forwards what it awaits (`yield
//! from`). A waiter sleeps until a permit is handed to it (the releasing call
//! wakes it: a lock of its own, or a future of its own) or until the time a
//! slot is sure to be its; never polls.

use pyo3::exceptions::{PyBaseException, PyStopIteration};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;
use pyo3::PyTraverseError;

use crate::bucket::{Decision, Wait};
use crate::concurrency::{self, Enqueued, PermitCheck, Polled};
use crate::py_checks::ParsedPermit;
use crate::py_types::{key_str, read_clock, resolver, seconds, ConcurrencyLimiter, Permit, Waker};

static TIME_SLEEP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ASYNCIO_SLEEP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ALLOCATE_LOCK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static TIMEOUT_MAX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A clock's own `sleep` / `sleep_async`, when it has one (a `ManualClock`
/// advances itself).
fn clock_sleeper<'py>(
    py: Python<'py>,
    clock: Option<&Py<PyAny>>,
    r#async: bool,
) -> Option<Bound<'py, PyAny>> {
    let name = if r#async { "sleep_async" } else { "sleep" };
    let sleep = clock?.bind(py).getattr(name).ok()?;
    sleep.is_callable().then_some(sleep)
}

/// What a limiter waits with: its clock's `sleep` / `sleep_async` when the
/// clock has one, else `time.sleep` / `asyncio.sleep`.
pub fn sleeper<'py>(
    py: Python<'py>,
    clock: Option<&Py<PyAny>>,
    r#async: bool,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(sleep) = clock_sleeper(py, clock, r#async) {
        return Ok(sleep);
    }
    let cell = if r#async { &ASYNCIO_SLEEP } else { &TIME_SLEEP };
    let module = if r#async { "asyncio" } else { "time" };
    Ok(cell.import(py, module, "sleep")?.clone())
}

/// The iterator of an asyncio sleep of `left` on `clock` (its `sleep_async`,
/// else `asyncio.sleep`), to forward as `yield from` would.
pub fn start_sleep(py: Python<'_>, clock: Option<&Py<PyAny>>, left: Wait) -> PyResult<Py<PyAny>> {
    let sleep = sleeper(py, clock, true)?.call1((seconds(left),))?;
    Ok(sleep.call_method0("__await__")?.unbind())
}

/// A new `_thread.lock`, locked: a waiting thread blocks on it until a
/// releasing call releases it (or its timeout passes).
fn locked_lock(py: Python<'_>) -> PyResult<Py<PyAny>> {
    let lock = ALLOCATE_LOCK
        .import(py, "_thread", "allocate_lock")?
        .call0()?;
    lock.call_method0("acquire")?;
    Ok(lock.unbind())
}

/// The longest timeout a lock's `acquire` takes (`_thread.TIMEOUT_MAX`).
fn longest_lock_wait(py: Python<'_>) -> PyResult<f64> {
    TIMEOUT_MAX.import(py, "_thread", "TIMEOUT_MAX")?.extract()
}

/// How a driver sleeps, and how it is woken early when handed a permit.
pub enum Wake<'py> {
    /// With the clock's own `sleep` / `sleep_async` (a `ManualClock`, which
    /// advances itself at once): a hand-off is seen when it returns.
    Clock(Bound<'py, PyAny>),
    /// A thread blocked on a lock of its own (made when first needed).
    Thread(Option<Py<PyAny>>),
    /// A task awaiting a future made for each round on its running loop:
    /// `(loop, future)`.
    Task(Option<(Py<PyAny>, Py<PyAny>)>),
}

impl<'py> Wake<'py> {
    /// How a thread waits on `clock`: with its `sleep`, else on a lock of
    /// its own.
    pub fn thread(py: Python<'py>, clock: Option<&Py<PyAny>>) -> Wake<'py> {
        clock_sleeper(py, clock, false).map_or(Wake::Thread(None), Wake::Clock)
    }

    /// How a task waits on `clock` for one round: with its `sleep_async`,
    /// else on a future of its own.
    pub fn task(py: Python<'py>, clock: Option<&Py<PyAny>>) -> Wake<'py> {
        clock_sleeper(py, clock, true).map_or(Wake::Task(None), Wake::Clock)
    }

    /// The waker to register for a waiter about to sleep.
    fn waker(&mut self, py: Python<'_>) -> PyResult<Option<Waker>> {
        match self {
            Wake::Clock(_) => Ok(None),
            Wake::Thread(lock) => {
                let lock = match lock {
                    Some(lock) => lock.clone_ref(py),
                    None => lock.insert(locked_lock(py)?).clone_ref(py),
                };
                Ok(Some(Waker::Thread(lock)))
            }
            Wake::Task(made) => {
                let event_loop = GET_RUNNING_LOOP
                    .import(py, "asyncio", "get_running_loop")?
                    .call0()?;
                let future = event_loop.call_method0("create_future")?;
                *made = Some((event_loop.clone().unbind(), future.clone().unbind()));
                Ok(Some(Waker::Task {
                    event_loop: event_loop.unbind(),
                    future: future.unbind(),
                }))
            }
        }
    }

    /// Sleeps this thread `seconds`, or until it is woken (the GIL released;
    /// Ctrl-C still interrupts it).
    fn sleep_thread(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        match self {
            Wake::Clock(sleep) => sleep.call1((seconds,)).map(drop),
            Wake::Thread(Some(lock)) => longest_lock_wait(py)
                .and_then(|most| {
                    lock.bind(py)
                        .call_method1("acquire", (true, seconds.min(most)))
                })
                .map(drop),
            _ => sleeper(py, None, false)
                .and_then(|sleep| sleep.call1((seconds,)))
                .map(drop),
        }
    }

    /// A task's sleep of `seconds`, or until it is woken: the awaitable to
    /// forward, and the timer that resolves its future when the time is up
    /// (none with a clock's sleep).
    pub fn start_task_sleep(
        self,
        py: Python<'_>,
        seconds: f64,
    ) -> PyResult<(Py<PyAny>, Option<Py<PyAny>>)> {
        match self {
            Wake::Clock(sleep) => {
                let awaiting = sleep.call1((seconds,))?.call_method0("__await__")?;
                Ok((awaiting.unbind(), None))
            }
            Wake::Task(Some((event_loop, future))) => {
                let resolve = resolver(py)?;
                let timer =
                    event_loop.call_method1(py, "call_later", (seconds, resolve, &future))?;
                let awaiting = future.call_method0(py, "__await__")?;
                Ok((awaiting, Some(timer)))
            }
            _ => Ok((start_sleep(py, None, Some((seconds * 1e6) as u128))?, None)),
        }
    }
}

/// Cancels a task's timer, once its sleep is over.
pub fn cancel_timer(py: Python<'_>, timer: Option<Py<PyAny>>) {
    if let Some(timer) = timer {
        let _ = timer.call_method0(py, "cancel");
    }
}

fn permit(
    py: Python<'_>,
    limiter: &Py<ConcurrencyLimiter>,
    key: &Py<PyString>,
    answer: concurrency::Answer,
) -> PyResult<Py<Permit>> {
    Py::new(
        py,
        Permit::new(limiter.clone_ref(py), key.clone_ref(py), answer),
    )
}

/// What a round of [`Waits`] ends with.
pub enum Round {
    /// Every permit, or a refusal (the timeout passed, or a new key had no
    /// room): one unheld permit per check, the ones it held released.
    Done(Outcome),
    /// Sleep this many seconds (or until woken), then run the next round.
    Sleep(f64),
}

/// One call waiting for permits: `acquire`, `acquire_async`, and the permits
/// of `acquire_all(_async)`, taken in a fixed order (limiter, then key:
/// docs/design.md §4, "Permits"), each held while it waits for the next.
pub struct Waits {
    /// `(position among the checks, limiter, key)`, in the order taken.
    wanted: Vec<(usize, Py<ConcurrencyLimiter>, Py<PyString>)>,
    /// The clock the timeout counts on and the sleeps use: the first check's.
    clock: Option<Py<PyAny>>,
    timeout: Wait,
    /// `start + timeout` on `clock`, set at the first round.
    deadline: Deadline,
    /// The permits taken so far, in the order taken.
    held: Vec<Py<Permit>>,
    /// The waiter queued for `wanted[held.len()]`.
    waiter: Option<u64>,
}

/// When a wait's timeout ends.
#[derive(Clone, Copy)]
enum Deadline {
    /// Not yet known: the first round reads the clock.
    Unset,
    Never,
    At(i64),
}

/// Every permit (in the order of the checks), or a refusal's unheld ones.
pub type Outcome = Result<Vec<Py<Permit>>, Vec<Py<Permit>>>;

/// Whether two limiters read the same clock (one reading serves both).
fn same_clock(a: Option<&Py<PyAny>>, b: Option<&Py<PyAny>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.is(b),
        _ => false,
    }
}

impl Waits {
    /// Checks the keys (and that none comes twice) now: a waiting call
    /// raises before it waits.
    pub fn new(
        py: Python<'_>,
        permits: &[ParsedPermit<'_>],
        clock: Option<&Py<PyAny>>,
        timeout: Wait,
    ) -> PyResult<Waits> {
        let keys = permits
            .iter()
            .map(|(_, key)| key_str(key))
            .collect::<PyResult<Vec<_>>>()?;
        let checks = permits
            .iter()
            .zip(&keys)
            .map(|((limiter, _), key)| PermitCheck {
                limiter: &limiter.get().core,
                key,
                now: 0,
            })
            .collect::<Vec<_>>();
        concurrency::check_all(&checks)?;
        let mut order: Vec<usize> = (0..permits.len()).collect();
        order.sort_by(|&a, &b| {
            let address = |i: usize| permits[i].0.as_ptr() as usize;
            (address(a), keys[a]).cmp(&(address(b), keys[b]))
        });
        Ok(Waits {
            wanted: order
                .into_iter()
                .map(|i| {
                    let (limiter, key) = &permits[i];
                    (i, limiter.clone().unbind(), key.clone().unbind())
                })
                .collect(),
            clock: clock.map(|c| c.clone_ref(py)),
            timeout,
            deadline: Deadline::Unset,
            held: Vec::new(),
            waiter: None,
        })
    }

    pub fn clock(&self) -> Option<&Py<PyAny>> {
        self.clock.as_ref()
    }

    /// What is left of the timeout now (`None`: no timeout).
    pub fn left(&self, py: Python<'_>) -> PyResult<Wait> {
        let Deadline::At(deadline) = self.deadline else {
            return Ok(None);
        };
        let now = read_clock(py, self.clock())?;
        Ok(Some(
            u128::try_from(deadline.saturating_sub(now)).unwrap_or(0),
        ))
    }

    /// Takes what it can now: every permit (in the order of the checks), a
    /// refusal, or how long to sleep. `wake` registers the waker of a waiter
    /// about to sleep, before the poll that finds it must: a hand-off after
    /// that poll finds the waker, one before it is what the poll sees.
    pub fn round(&mut self, py: Python<'_>, wake: &mut Wake<'_>) -> PyResult<Round> {
        let start = read_clock(py, self.clock())?;
        let timeout = self.timeout;
        if let Deadline::Unset = self.deadline {
            self.deadline = timeout.map_or(Deadline::Never, |t| {
                Deadline::At(start.saturating_add(i64::try_from(t).unwrap_or(i64::MAX)))
            });
        }
        let deadline = match self.deadline {
            Deadline::At(at) => Some(at),
            Deadline::Unset | Deadline::Never => None,
        };
        while self.held.len() < self.wanted.len() {
            let (_, limiter, key) = &self.wanted[self.held.len()];
            let (limiter, key) = (limiter.clone_ref(py), key.clone_ref(py));
            let conc = limiter.get();
            let now = if same_clock(conc.clock.as_ref(), self.clock()) {
                start
            } else {
                conc.now(py)?
            };
            let name = key.bind(py).to_str()?;
            let id = if let Some(id) = self.waiter {
                id
            } else {
                let enqueued = if timeout == Some(0) {
                    let (answer, woken) = conc.core.try_acquire(name, now)?;
                    conc.wake(py, woken);
                    answer.map_or_else(Enqueued::Refused, Enqueued::Granted)
                } else {
                    let (enqueued, woken) = conc.core.enqueue(name, now)?;
                    conc.wake(py, woken);
                    enqueued
                };
                match enqueued {
                    Enqueued::Granted(grant) => {
                        self.held.push(permit(py, &limiter, &key, Ok(grant))?);
                        continue;
                    }
                    Enqueued::Refused(decision) => return self.refuse(py, decision),
                    Enqueued::Queued(id) => {
                        self.waiter = Some(id);
                        id
                    }
                }
            };
            if let Some(waker) = wake.waker(py)? {
                conc.register(id, waker);
            }
            let (polled, woken) = conc.core.poll(id, now);
            conc.wake(py, woken);
            let until = match polled {
                Polled::Granted(grant) => {
                    conc.unregister(id);
                    self.waiter = None;
                    self.held.push(permit(py, &limiter, &key, Ok(grant))?);
                    continue;
                }
                Polled::Waiting { until } => until,
            };
            let left = deadline.map(|d| d.saturating_sub(start));
            if left.is_some_and(|left| left <= 0) {
                conc.unregister(id);
                self.waiter = None;
                let (answer, woken) = conc.core.give_up(id, now);
                conc.wake(py, woken);
                match answer {
                    Ok(grant) => {
                        self.held.push(permit(py, &limiter, &key, Ok(grant))?);
                        continue;
                    }
                    Err(decision) => return self.refuse(py, decision),
                }
            }
            let micros = until
                .saturating_sub(now)
                .min(left.unwrap_or(i64::MAX))
                .max(1);
            return Ok(Round::Sleep(micros as f64 / 1_000_000.0));
        }
        let taken = std::mem::take(&mut self.held);
        Ok(Round::Done(Ok(self.in_check_order(taken))))
    }

    /// `taken` (in the order taken, one per check) in the order of the checks.
    fn in_check_order(&self, taken: Vec<Py<Permit>>) -> Vec<Py<Permit>> {
        let mut placed: Vec<(usize, Py<Permit>)> =
            self.wanted.iter().map(|(i, _, _)| *i).zip(taken).collect();
        placed.sort_by_key(|(i, _)| *i);
        placed.into_iter().map(|(_, p)| p).collect()
    }

    /// A refusal by the permit being waited for: releases the ones held, and
    /// answers an unheld permit per check (the refusing one's decision).
    fn refuse(&mut self, py: Python<'_>, decision: Decision) -> PyResult<Round> {
        for held in self.held.drain(..).rev() {
            held.get().release_quietly(py);
        }
        let unheld = self
            .wanted
            .iter()
            .map(|(_, limiter, key)| permit(py, limiter, key, Err(decision)))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Round::Done(Err(self.in_check_order(unheld))))
    }

    /// The call stops (an exception, a cancellation): it leaves the queue
    /// (giving back a permit handed to it meanwhile) and releases the
    /// permits it holds. Never fails.
    pub fn abandon(&mut self, py: Python<'_>) {
        if let Some(id) = self.waiter.take() {
            let conc = self.wanted[self.held.len()].1.get();
            conc.unregister(id);
            let now = conc.now(py).unwrap_or(i64::MIN);
            let woken = conc.core.abandon(id, now);
            conc.wake(py, woken);
        }
        for held in self.held.drain(..).rev() {
            held.get().release_quietly(py);
        }
    }

    pub fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (_, limiter, _) in &self.wanted {
            visit.call(limiter)?;
        }
        for held in &self.held {
            visit.call(held)?;
        }
        if let Some(clock) = &self.clock {
            visit.call(clock)?;
        }
        Ok(())
    }
}

/// Drives [`Waits`] in this thread: sleeps with the clock's `sleep` when it
/// has one, else blocks on a lock of its own. An exception abandons the wait
/// before it propagates.
pub fn wait_sync(py: Python<'_>, waits: &mut Waits) -> PyResult<Outcome> {
    let mut wake = Wake::thread(py, waits.clock());
    loop {
        let seconds = match waits.round(py, &mut wake) {
            Ok(Round::Done(outcome)) => return Ok(outcome),
            Ok(Round::Sleep(seconds)) => seconds,
            Err(error) => {
                waits.abandon(py);
                return Err(error);
            }
        };
        if let Err(error) = wake.sleep_thread(py, seconds) {
            waits.abandon(py);
            return Err(error);
        }
    }
}

/// What became of a value sent (or an error thrown) into an awaited iterator.
pub enum Forwarded {
    /// It yielded this to the event loop: yield it on.
    Yielded(Py<PyAny>),
    /// It is done (`StopIteration`).
    Finished,
    Failed(PyErr),
}

/// One step of `yield from awaiting`: `send(value)`, or `throw(thrown)`.
pub fn forward(
    py: Python<'_>,
    awaiting: &Py<PyAny>,
    value: Py<PyAny>,
    thrown: Option<PyErr>,
) -> Forwarded {
    let bound = awaiting.bind(py);
    let answer = match thrown {
        None => bound.call_method1("send", (value,)),
        Some(error) => bound.call_method1("throw", (error.into_value(py),)),
    };
    match answer {
        Ok(yielded) => Forwarded::Yielded(yielded.unbind()),
        Err(error) if error.is_instance_of::<PyStopIteration>(py) => Forwarded::Finished,
        Err(error) => Forwarded::Failed(error),
    }
}

/// `throw(type, value, traceback)` arguments as one error, as a generator
/// takes them.
pub fn thrown_error(error: Bound<'_, PyAny>, value: Option<Bound<'_, PyAny>>) -> PyResult<PyErr> {
    Ok(match value.filter(|v| !v.is_none()) {
        Some(value) if !error.is_instance_of::<PyBaseException>() => {
            PyErr::from_value(error.call1((value,))?)
        }
        _ => PyErr::from_value(error),
    })
}
