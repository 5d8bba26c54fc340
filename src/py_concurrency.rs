//! The binding of concurrency permits (docs/design.md §2, "Concurrency"):
//! `ConcurrencyLimiter`'s and `Permit`'s methods, waiting for permits, and
//! the `*_all` calls whose checks include concurrency limiters. Types are
//! checked here; the rules are `concurrency.rs`'s.
//!
//! Waiting is written once: [`Waits`] is the procedure, free of I/O (each
//! [`Waits::round`] reads the clocks, asks the core, and says how long to
//! sleep), driven by a thread ([`wait_sync`]) or by a task
//! ([`AcquiringPermit`]). A waiter sleeps until a permit is handed to it (the
//! releasing call wakes it: a lock of its own, or a future of its own) or
//! until the time a slot is sure to be its; never polls.

use pyo3::exceptions::{PyRuntimeError, PyStopIteration};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyFloat, PyString};
use pyo3::PyTraverseError;

use crate::bucket::Wait;
use crate::concurrency::{self, Config, Enqueued, PermitCheck, Polled};
use crate::error::check_key;
use crate::py_reserve::{
    self, forward, max_wait, start_sleep, thrown_error, Checks, Forwarded, OwnedChecks,
    ParsedPermit, Reservation,
};
use crate::py_types::{
    clock_arg, integer, key_str, max_keys_arg, number, read_clock, repr, resolver,
    ConcurrencyLimiter, Decision, Key, Permit, Waker,
};
use crate::rate::Number;

static ALLOCATE_LOCK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static TIMEOUT_MAX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The `ttl` argument: seconds, an int or float (never a bool).
pub struct Ttl(Number);

impl<'a, 'py> FromPyObject<'a, 'py> for Ttl {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Ttl> {
        number(&obj, "ttl").map(Ttl)
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

#[pymethods]
impl ConcurrencyLimiter {
    #[new]
    #[pyo3(signature = (limit, *, ttl = Ttl(Number::Float(60.0)), clock = None, max_keys = None))]
    #[pyo3(text_signature = "(limit, *, ttl=60.0, clock=None, max_keys=None)")]
    fn py_new(
        limit: &Bound<'_, PyAny>,
        ttl: Ttl,
        clock: Option<Bound<'_, PyAny>>,
        max_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<ConcurrencyLimiter> {
        let limit = integer(limit, "limit")?;
        let clock = clock_arg(clock)?;
        let max_keys = max_keys_arg(max_keys)?;
        let config = Config::new(limit, ttl.0)?;
        let seconds = match ttl.0 {
            Number::Int(i) => i as f64,
            Number::Float(x) => x,
        };
        Ok(ConcurrencyLimiter::new(
            concurrency::Limiter::new(config, max_keys),
            clock,
            seconds,
            max_keys,
        ))
    }

    /// A permit now, or a refusal (falsy); never waits, never jumps the queue.
    fn try_acquire(slf: &Bound<'_, Self>, key: Key<'_, '_>) -> PyResult<Permit> {
        let py = slf.py();
        let this = slf.get();
        let now = this.now(py)?;
        let (answer, woken) = this.core.try_acquire(key.as_str()?, now)?;
        this.wake(py, woken);
        Ok(Permit::new(
            slf.clone().unbind(),
            key.0.to_owned().unbind(),
            answer,
        ))
    }

    /// Blocks (the GIL released) until a permit is handed to it, in arrival
    /// order, or until `timeout` seconds have passed: then a refusal.
    #[pyo3(signature = (key, *, timeout = None), text_signature = "($self, key, *, timeout=None)")]
    fn acquire(
        slf: &Bound<'_, Self>,
        key: Key<'_, '_>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<Permit>> {
        let py = slf.py();
        let timeout = max_wait(timeout, "timeout")?;
        let key = key.0.to_owned();
        check_key(key_str(&key)?)?;
        let permits = [(slf.clone(), key)];
        let mut waits = Waits::new(py, &permits, slf.get().clock.as_ref(), timeout)?;
        let (Ok(mut got) | Err(mut got)) = wait_sync(py, &mut waits)?;
        Ok(got.pop().expect("one permit asked"))
    }

    /// `acquire` for asyncio: a coroutine answering the `Permit`; cancelled
    /// while it waits, it leaves the queue and holds nothing.
    #[pyo3(signature = (key, *, timeout = None), text_signature = "($self, key, *, timeout=None)")]
    fn acquire_async(
        slf: &Bound<'_, Self>,
        key: Key<'_, '_>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<AcquiringPermit> {
        let py = slf.py();
        let timeout = max_wait(timeout, "timeout")?;
        let key = key.0.to_owned();
        check_key(key_str(&key)?)?;
        let permits = [(slf.clone(), key)];
        let waits = Waits::new(py, &permits, slf.get().clock.as_ref(), timeout)?;
        Ok(AcquiringPermit::new(waits, Goal::Permit))
    }

    /// Permits of `key` held now.
    fn in_flight(&self, py: Python<'_>, key: Key<'_, '_>) -> PyResult<u64> {
        let now = self.now(py)?;
        let (held, woken) = self.core.in_flight(key.as_str()?, now)?;
        self.wake(py, woken);
        Ok(held)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats(self.now(py)?);
        let dict = PyDict::new(py);
        dict.set_item("granted", s.granted)?;
        dict.set_item("refused", s.refused)?;
        dict.set_item("released", s.released)?;
        dict.set_item("expired", s.expired)?;
        dict.set_item("abandoned", s.abandoned)?;
        dict.set_item("refused_new_keys", s.refused_new_keys)?;
        dict.set_item("keys", s.keys)?;
        dict.set_item("in_flight", s.in_flight)?;
        dict.set_item("waiting", s.waiting)?;
        Ok(dict)
    }

    #[getter]
    fn limit(&self) -> u32 {
        self.core.config().limit
    }

    /// Seconds a permit lives without a renewal.
    #[getter]
    fn ttl(&self) -> f64 {
        self.ttl
    }

    #[getter(max_keys)]
    fn get_max_keys(&self) -> Option<usize> {
        self.max_keys
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ConcurrencyLimiter(limit={}, ttl={}, max_keys={})",
            self.core.config().limit,
            repr(PyFloat::new(py, self.ttl).as_any()),
            self.max_keys
                .map_or_else(|| "None".to_owned(), |n| n.to_string())
        )
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.visit(&visit)
    }
}

#[pymethods]
impl Permit {
    #[getter(key)]
    fn get_key(&self, py: Python<'_>) -> Py<PyString> {
        self.key.clone_ref(py)
    }

    /// The fencing token: larger for every later grant of the key; 0 for a
    /// refusal.
    #[getter(token)]
    fn get_token(&self) -> u64 {
        self.token
    }

    #[getter(decision)]
    fn get_decision(&self) -> Decision {
        Decision::of(self.decision, false)
    }

    fn __bool__(&self) -> bool {
        self.granted()
    }

    /// Frees its slot for the key's first waiter. Once: later calls, and a
    /// call on a refusal or on a permit that expired, free nothing.
    #[pyo3(name = "release")]
    fn py_release(&self, py: Python<'_>) -> PyResult<()> {
        self.release(py)
    }

    /// Extends it to `ttl` seconds from now; False when it expired (or was
    /// released, or refused): a renewal never brings a permit back.
    fn renew(&self, py: Python<'_>) -> PyResult<bool> {
        if self.released() {
            return Ok(false);
        }
        let limiter = self.limiter.get();
        let now = limiter.now(py)?;
        let key = self.key.bind(py).to_str()?;
        let (renewed, woken) = limiter.core.renew(key, self.token, now, 0)?;
        limiter.wake(py, woken);
        Ok(renewed.is_some())
    }

    /// Whether it is held now: granted, not released, not expired.
    fn valid(&self, py: Python<'_>) -> PyResult<bool> {
        if self.released() {
            return Ok(false);
        }
        let limiter = self.limiter.get();
        let now = limiter.now(py)?;
        Ok(limiter
            .core
            .valid(self.key.bind(py).to_str()?, self.token, now)?)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Releases it; exceptions go on.
    #[pyo3(signature = (_kind, _error, _traceback, /))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _kind: &Bound<'_, PyAny>,
        _error: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.release(py)
    }

    fn __aenter__(slf: Bound<'_, Self>) -> Ready {
        Ready(slf.into_any().unbind())
    }

    #[pyo3(signature = (_kind, _error, _traceback, /))]
    fn __aexit__(
        &self,
        py: Python<'_>,
        _kind: &Bound<'_, PyAny>,
        _error: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<Ready> {
        self.release(py)?;
        Ok(Ready(py.None()))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let title = |b: bool| if b { "True" } else { "False" };
        format!(
            "Permit(key={}, token={}, granted={}, released={})",
            repr(self.key.bind(py).as_any()),
            self.token,
            title(self.granted()),
            title(self.granted() && self.released())
        )
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.limiter)
    }
}

/// An awaitable that is done at once: what `Permit.__aenter__` / `__aexit__`
/// answer (nothing to wait for: the permit is held already).
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct Ready(Py<PyAny>);

#[pymethods]
impl Ready {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Done at once: raises `StopIteration(value)`.
    fn __next__(&self, py: Python<'_>) -> PyResult<()> {
        Err(PyStopIteration::new_err((self.0.clone_ref(py),)))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.0)
    }
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
enum Wake {
    /// With the clock's own `sleep` / `sleep_async` (a `ManualClock`, which
    /// advances itself at once): a hand-off is seen when it returns.
    Clock,
    /// A thread blocked on a lock of its own (made when first needed).
    Thread(Option<Py<PyAny>>),
    /// A task awaiting a future made for each round on its running loop:
    /// `(loop, future)`.
    Task(Option<(Py<PyAny>, Py<PyAny>)>),
}

impl Wake {
    /// The waker to register for a waiter about to sleep.
    fn waker(&mut self, py: Python<'_>) -> PyResult<Option<Waker>> {
        match self {
            Wake::Clock => Ok(None),
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
}

/// What a round of [`Waits`] ends with.
enum Round {
    /// Every permit, in the order of the checks.
    Granted(Vec<Py<Permit>>),
    /// Refused (the timeout passed, or a new key had no room): one unheld
    /// permit per check, in their order; the ones it held are released.
    Refused(Vec<Py<Permit>>),
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
type Outcome = Result<Vec<Py<Permit>>, Vec<Py<Permit>>>;

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
    fn new(
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

    fn clock(&self) -> Option<&Py<PyAny>> {
        self.clock.as_ref()
    }

    /// What is left of the timeout now (`None`: no timeout).
    fn left(&self, py: Python<'_>) -> PyResult<Wait> {
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
    fn round(&mut self, py: Python<'_>, wake: &mut Wake) -> PyResult<Round> {
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
        Ok(Round::Granted(self.in_check_order(taken)))
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
    fn refuse(&mut self, py: Python<'_>, decision: crate::bucket::Decision) -> PyResult<Round> {
        for held in self.held.drain(..).rev() {
            held.get().release_quietly(py);
        }
        let unheld = self
            .wanted
            .iter()
            .map(|(_, limiter, key)| permit(py, limiter, key, Err(decision)))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Round::Refused(self.in_check_order(unheld)))
    }

    /// The call stops (an exception, a cancellation): it leaves the queue
    /// (giving back a permit handed to it meanwhile) and releases the
    /// permits it holds. Never fails.
    fn abandon(&mut self, py: Python<'_>) {
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

    fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
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
/// has one, else blocks on a lock of its own (the GIL released; Ctrl-C still
/// interrupts it). `Ok` holds every permit, `Err` a refusal's; an exception
/// abandons the wait before it propagates.
fn wait_sync(py: Python<'_>, waits: &mut Waits) -> PyResult<Outcome> {
    let sleep = py_reserve::clock_sleeper(py, waits.clock(), false);
    let mut wake = if sleep.is_some() {
        Wake::Clock
    } else {
        Wake::Thread(None)
    };
    loop {
        let seconds = match waits.round(py, &mut wake) {
            Ok(Round::Granted(permits)) => return Ok(Ok(permits)),
            Ok(Round::Refused(permits)) => return Ok(Err(permits)),
            Ok(Round::Sleep(seconds)) => seconds,
            Err(error) => {
                waits.abandon(py);
                return Err(error);
            }
        };
        let slept = match (&sleep, &wake) {
            (Some(sleep), _) => sleep.call1((seconds,)).map(drop),
            (None, Wake::Thread(Some(lock))) => longest_lock_wait(py)
                .and_then(|most| {
                    lock.bind(py)
                        .call_method1("acquire", (true, seconds.min(most)))
                })
                .map(drop),
            (None, _) => py_reserve::sleeper(py, None, false)
                .and_then(|sleep| sleep.call1((seconds,)))
                .map(drop),
        };
        if let Err(error) = slept {
            waits.abandon(py);
            return Err(error);
        }
    }
}

/// The checks' clock readings and core checks for [`concurrency::take_all`].
fn permit_checks<'a>(
    py: Python<'_>,
    permits: &'a [ParsedPermit<'_>],
) -> PyResult<(Vec<PermitCheck<'a>>, Vec<i64>)> {
    let mut checks = Vec::with_capacity(permits.len());
    let mut nows = Vec::with_capacity(permits.len());
    for (limiter, key) in permits {
        let this = limiter.get();
        let now = this.now(py)?;
        nows.push(now);
        checks.push(PermitCheck {
            limiter: &this.core,
            key: key_str(key)?,
            now,
        });
    }
    concurrency::check_all(&checks)?;
    Ok((checks, nows))
}

/// `allow_all` / `reserve_all` over checks with concurrency limiters: every
/// permit free now and every bucket within `max_wait`, all or nothing, at one
/// moment under every lock (the buckets' tables, then the permits'). The
/// permits live `ttl` from when the tokens are ready.
pub fn reserve_with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    max_wait: Wait,
) -> PyResult<Reservation> {
    let (permit_checks, nows) = permit_checks(py, &checks.permits)?;
    let (tokens, taken) = if checks.buckets.is_empty() {
        (None, concurrency::take_all(&permit_checks, true, Some(0)))
    } else {
        let mut taken = None;
        let tokens =
            py_reserve::reserve_tokens_gated(py, &checks.buckets, max_wait, |go, delay| {
                let t = concurrency::take_all(&permit_checks, go, delay);
                let allowed = t.allowed;
                taken = Some(t);
                allowed
            })?;
        (
            Some(tokens),
            taken.expect("the gate runs once the checks pass"),
        )
    };
    let mut permits = Vec::with_capacity(checks.permits.len());
    for (((limiter, key), answer), (woken, log)) in checks
        .permits
        .iter()
        .zip(taken.answers)
        .zip(taken.woken.into_iter().zip(taken.log_no_room))
    {
        let this = limiter.get();
        this.wake(py, woken);
        if log {
            this.core.log_refusing_new_keys();
        }
        permits.push(Py::new(
            py,
            Permit::new(limiter.clone().unbind(), key.clone().unbind(), answer),
        )?);
    }
    let made = if checks.order[0] {
        nows[0]
    } else {
        tokens.as_ref().map_or(nows[0], |t| t.made)
    };
    py_reserve::with_permits(py, checks, tokens, permits, made)
}

/// After the permits of an `acquire_all` are held: reserves the tokens
/// within what is left of the timeout, and extends the permits to live `ttl`
/// from when the tokens are ready (a refusal releases them). Never leaves a
/// permit held on an error.
fn after_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    permits: Vec<Py<Permit>>,
    left: PyResult<Wait>,
) -> PyResult<Reservation> {
    let release = |permits: &[Py<Permit>]| {
        for held in permits {
            held.get().release_quietly(py);
        }
    };
    let tokens = match left.and_then(|left| {
        if checks.buckets.is_empty() {
            return Ok(None);
        }
        py_reserve::reserve_tokens_gated(py, &checks.buckets, left, |go, _| go).map(Some)
    }) {
        Ok(tokens) => tokens,
        Err(error) => {
            release(&permits);
            return Err(error);
        }
    };
    let granted = tokens.as_ref().is_none_or(|t| t.reserved.decision.allowed);
    if !granted {
        release(&permits);
    }
    let extra = tokens.as_ref().and_then(|t| t.reserved.delay).unwrap_or(0);
    let mut made = None;
    for held in &permits {
        let held = held.get();
        let limiter = held.limiter.get();
        let now = limiter.now(py).unwrap_or(i64::MIN);
        made.get_or_insert(now);
        if granted && extra > 0 {
            let key = held.key.bind(py).to_str()?;
            let extra = i64::try_from(extra).unwrap_or(i64::MAX);
            let (_, woken) = limiter.core.renew(key, held.token, now, extra)?;
            limiter.wake(py, woken);
        }
    }
    let made = match (&tokens, checks.order[0]) {
        (Some(t), false) => t.made,
        _ => made.unwrap_or(0),
    };
    py_reserve::with_permits(py, checks, tokens, permits, made)
}

/// `acquire_all` over checks with concurrency limiters, in this thread: waits
/// for the permits (in order, FIFO each), then for the tokens.
pub fn acquire_with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    timeout: Wait,
) -> PyResult<Reservation> {
    if timeout == Some(0) {
        return reserve_with_permits(py, checks, timeout);
    }
    py_reserve::check_buckets(&checks.buckets)?;
    let mut waits = Waits::new(
        py,
        &checks.permits,
        checks.first_clock(py).as_ref(),
        timeout,
    )?;
    let permits = match wait_sync(py, &mut waits)? {
        Ok(permits) => permits,
        Err(unheld) => return py_reserve::with_permits(py, checks, None, unheld, 0),
    };
    let reservation = after_permits(py, checks, permits, waits.left(py))?;
    py_reserve::wait(py, &reservation)?;
    Ok(reservation)
}

/// `acquire_all_async` over checks with concurrency limiters: its coroutine.
pub fn acquiring_with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    timeout: Wait,
) -> PyResult<AcquiringPermit> {
    py_reserve::check_buckets(&checks.buckets)?;
    let waits = Waits::new(
        py,
        &checks.permits,
        checks.first_clock(py).as_ref(),
        timeout,
    )?;
    Ok(AcquiringPermit::new(waits, Goal::All(checks.owned())))
}

/// What an [`AcquiringPermit`] answers once its permits are held.
enum Goal {
    /// `acquire_async`: the permit.
    Permit,
    /// `acquire_all_async`: the reservation, after the tokens of these checks.
    All(OwnedChecks),
}

enum State {
    Start(Waits, Goal),
    /// Waiting for a permit: the awaitable forwarded, and the timer that
    /// resolves its future when the wait is over (none with a clock's sleep).
    Waiting {
        waits: Waits,
        goal: Goal,
        awaiting: Py<PyAny>,
        timer: Option<Py<PyAny>>,
    },
    /// The permits held, sleeping until the tokens are ready.
    Sleeping {
        reservation: Py<Reservation>,
        awaiting: Py<PyAny>,
    },
    Done,
}

fn cancel_timer(py: Python<'_>, timer: Option<Py<PyAny>>) {
    if let Some(timer) = timer {
        let _ = timer.call_method0(py, "cancel");
    }
}

/// The coroutine of `ConcurrencyLimiter.acquire_async` and of
/// `acquire_all_async` with concurrency limiters; it answers the `Permit`
/// (or the `Reservation`).
///
/// Cancel-safe as the token bucket's `Acquiring`: a permit is taken at a step
/// that ends by answering it or by holding it in this object, so no
/// cancellation point lies between taking and holding; cancelled (or closed,
/// or collected) while it waits, it leaves the queue, gives back a permit
/// handed to it meanwhile and releases the ones it holds.
#[pyclass(module = "bucketlimit._core")]
pub struct AcquiringPermit {
    state: State,
}

impl AcquiringPermit {
    fn new(waits: Waits, goal: Goal) -> AcquiringPermit {
        AcquiringPermit {
            state: State::Start(waits, goal),
        }
    }

    fn step(
        &mut self,
        py: Python<'_>,
        value: Py<PyAny>,
        thrown: Option<PyErr>,
    ) -> PyResult<Py<PyAny>> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Done => Err(thrown.unwrap_or_else(|| {
                PyRuntimeError::new_err("cannot reuse an already awaited acquire_async()")
            })),
            State::Start(waits, goal) => match thrown {
                Some(error) => Err(error), // cancelled before it took anything
                None => self.advance(py, waits, goal),
            },
            State::Waiting {
                mut waits,
                goal,
                awaiting,
                timer,
            } => match forward(py, &awaiting, value, thrown) {
                Forwarded::Yielded(yielded) => {
                    self.state = State::Waiting {
                        waits,
                        goal,
                        awaiting,
                        timer,
                    };
                    Ok(yielded)
                }
                Forwarded::Finished => {
                    cancel_timer(py, timer);
                    self.advance(py, waits, goal)
                }
                Forwarded::Failed(error) => {
                    cancel_timer(py, timer);
                    waits.abandon(py);
                    Err(error)
                }
            },
            State::Sleeping {
                reservation,
                awaiting,
            } => match forward(py, &awaiting, value, thrown) {
                Forwarded::Yielded(yielded) => {
                    self.state = State::Sleeping {
                        reservation,
                        awaiting,
                    };
                    Ok(yielded)
                }
                Forwarded::Finished => Err(PyStopIteration::new_err((reservation,))),
                Forwarded::Failed(error) => {
                    reservation.get().cancel_quietly(py);
                    Err(error)
                }
            },
        }
    }

    /// Runs rounds until one sleeps (then yields what its sleep yields) or
    /// the permits are settled.
    fn advance(&mut self, py: Python<'_>, mut waits: Waits, goal: Goal) -> PyResult<Py<PyAny>> {
        loop {
            let sleep = py_reserve::clock_sleeper(py, waits.clock(), true);
            let mut wake = if sleep.is_some() {
                Wake::Clock
            } else {
                Wake::Task(None)
            };
            let seconds = match waits.round(py, &mut wake) {
                Ok(Round::Sleep(seconds)) => seconds,
                Ok(Round::Granted(permits)) => return self.finish(py, &waits, permits, goal),
                Ok(Round::Refused(mut unheld)) => {
                    return Err(match goal {
                        Goal::Permit => PyStopIteration::new_err((unheld.pop(),)),
                        Goal::All(checks) => {
                            let checks = checks.bind(py);
                            let refused = py_reserve::with_permits(py, &checks, None, unheld, 0)?;
                            PyStopIteration::new_err((Py::new(py, refused)?,))
                        }
                    })
                }
                Err(error) => {
                    waits.abandon(py);
                    return Err(error);
                }
            };
            let started = match (&sleep, wake) {
                (Some(sleep), _) => sleep
                    .call1((seconds,))
                    .and_then(|a| a.call_method0("__await__"))
                    .map(|a| (a.unbind(), None)),
                (None, Wake::Task(Some((event_loop, future)))) => resolver(py)
                    .and_then(|resolve| {
                        event_loop.call_method1(py, "call_later", (seconds, resolve, &future))
                    })
                    .and_then(|timer| {
                        let awaiting = future.call_method0(py, "__await__")?;
                        Ok((awaiting, Some(timer)))
                    }),
                (None, _) => {
                    start_sleep(py, None, Some((seconds * 1e6) as u128)).map(|a| (a, None))
                }
            };
            let (awaiting, timer) = match started {
                Ok(started) => started,
                Err(error) => {
                    waits.abandon(py);
                    return Err(error);
                }
            };
            match forward(py, &awaiting, py.None(), None) {
                Forwarded::Yielded(yielded) => {
                    self.state = State::Waiting {
                        waits,
                        goal,
                        awaiting,
                        timer,
                    };
                    return Ok(yielded);
                }
                Forwarded::Finished => cancel_timer(py, timer), // woken already: look again
                Forwarded::Failed(error) => {
                    cancel_timer(py, timer);
                    waits.abandon(py);
                    return Err(error);
                }
            }
        }
    }

    /// Every permit is held: answers it, or reserves the tokens and sleeps
    /// until they are ready.
    fn finish(
        &mut self,
        py: Python<'_>,
        waits: &Waits,
        mut permits: Vec<Py<Permit>>,
        goal: Goal,
    ) -> PyResult<Py<PyAny>> {
        let checks = match goal {
            Goal::Permit => return Err(PyStopIteration::new_err((permits.pop(),))),
            Goal::All(checks) => checks,
        };
        let checks = checks.bind(py);
        let reservation = after_permits(py, &checks, permits, waits.left(py))?;
        let left = reservation.delay_left();
        let reservation = Py::new(py, reservation)?;
        if left == Some(0) || !reservation.get().is_granted(py) {
            return Err(PyStopIteration::new_err((reservation,)));
        }
        let clock = checks.first_clock(py);
        let awaiting = match start_sleep(py, clock.as_ref(), left) {
            Ok(awaiting) => awaiting,
            Err(error) => {
                reservation.get().cancel_quietly(py);
                return Err(error);
            }
        };
        match forward(py, &awaiting, py.None(), None) {
            Forwarded::Yielded(yielded) => {
                self.state = State::Sleeping {
                    reservation,
                    awaiting,
                };
                Ok(yielded)
            }
            Forwarded::Finished => Err(PyStopIteration::new_err((reservation,))),
            Forwarded::Failed(error) => {
                reservation.get().cancel_quietly(py);
                Err(error)
            }
        }
    }

    /// Stops waiting (closed, collected): nothing is left held or queued.
    fn stop(&mut self, py: Python<'_>) {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Waiting {
                mut waits,
                awaiting,
                timer,
                ..
            } => {
                let _ = awaiting.call_method0(py, "close");
                cancel_timer(py, timer);
                waits.abandon(py);
            }
            State::Sleeping {
                reservation,
                awaiting,
            } => {
                let _ = awaiting.call_method0(py, "close");
                reservation.get().cancel_quietly(py);
            }
            State::Start(..) | State::Done => {}
        }
    }
}

impl Drop for AcquiringPermit {
    fn drop(&mut self) {
        if matches!(self.state, State::Waiting { .. } | State::Sleeping { .. }) {
            Python::attach(|py| self.stop(py));
        }
    }
}

#[pymethods]
impl AcquiringPermit {
    fn __await__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.step(py, py.None(), None)
    }

    #[pyo3(signature = (value, /))]
    fn send(&mut self, py: Python<'_>, value: Py<PyAny>) -> PyResult<Py<PyAny>> {
        self.step(py, value, None)
    }

    #[pyo3(signature = (error, value = None, traceback = None, /))]
    fn throw(
        &mut self,
        py: Python<'_>,
        error: Bound<'_, PyAny>,
        value: Option<Bound<'_, PyAny>>,
        traceback: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _ = traceback;
        let error = thrown_error(error, value)?;
        self.step(py, py.None(), Some(error))
    }

    /// Stops waiting: it leaves the queue and holds nothing.
    fn close(&mut self, py: Python<'_>) {
        self.stop(py);
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        match &self.state {
            State::Start(waits, goal) | State::Waiting { waits, goal, .. } => {
                waits.visit(&visit)?;
                if let Goal::All(checks) = goal {
                    checks.visit(&visit)?;
                }
                if let State::Waiting {
                    awaiting, timer, ..
                } = &self.state
                {
                    visit.call(awaiting)?;
                    if let Some(timer) = timer {
                        visit.call(timer)?;
                    }
                }
            }
            State::Sleeping {
                reservation,
                awaiting,
            } => {
                visit.call(reservation)?;
                visit.call(awaiting)?;
            }
            State::Done => {}
        }
        Ok(())
    }

    /// Collected in a cycle: stops waiting first (nothing left queued).
    fn __clear__(&mut self) {
        Python::attach(|py| self.stop(py));
    }
}
