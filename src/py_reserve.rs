//! The binding of reservations (docs/design.md §2): `Reservation`, the
//! checks of `allow_all` / `reserve_all` / `acquire_all`, waiting on the
//! limiter's clock, and `Acquiring`, the coroutine of `acquire_async`.
//! Types are checked here; the arithmetic is `bucket.rs` and `registry.rs`.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyFloat, PyList, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::bucket::{Line, Reserved, Wait};
use crate::clock;
use crate::py::{integer, key_str, repr, seconds, type_name, Decision, Key, TokenBucketLimiter};
use crate::registry::{self, Check};

static TIME_SLEEP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ASYNCIO_SLEEP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A `max_wait` / `timeout`: `None` or `inf` for no limit, else seconds >= 0
/// as an int or float, in microseconds by the clock's rounding (§4).
pub fn max_wait(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Wait> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let bad = || {
        PyValueError::new_err(format!(
            "{name} must be a number of seconds >= 0 or None, got {}",
            repr(obj)
        ))
    };
    if let Ok(float) = obj.cast::<PyFloat>() {
        let x = float.value();
        if x.is_nan() || x < 0.0 {
            return Err(bad());
        }
        // Beyond the clock's range is as good as no limit.
        return Ok(clock::float_seconds_to_micros(x)
            .ok()
            .map(|micros| micros as u128));
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, float or None, got bool"
        )));
    }
    let whole = integer(obj, name).map_err(|e| {
        if e.is_instance_of::<PyTypeError>(obj.py()) {
            PyTypeError::new_err(format!(
                "{name} must be an int, float or None, got {}",
                type_name(obj)
            ))
        } else {
            e
        }
    })?;
    if whole < 0 {
        return Err(bad());
    }
    Ok(clock::int_seconds_to_micros(whole)
        .ok()
        .map(|micros| micros as u128))
}

/// A parsed check: `(limiter, key, cost)`.
pub type Parsed<'py> = (Bound<'py, TokenBucketLimiter>, Bound<'py, PyString>, i128);

/// One bucket of a reservation.
struct Part {
    limiter: Py<TokenBucketLimiter>,
    key: Py<PyString>,
    cost: u64,
    /// Where this reservation left the bucket's cap line, when it waited.
    line: Option<Line>,
}

/// Tokens taken from one or more buckets, to use after `delay` seconds.
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct Reservation {
    parts: Vec<Part>,
    delay: Wait,
    decision: Py<Decision>,
    /// Set once cancelled or settled (a refused reservation starts settled).
    settled: AtomicBool,
}

impl Reservation {
    /// The decision, copied out (for `allow_all`).
    pub fn decision_of(&self, py: Python<'_>) -> Decision {
        let d = self.decision.bind(py).get();
        d.copy()
    }

    fn granted(&self, py: Python<'_>) -> bool {
        self.decision.bind(py).get().allowed()
    }

    /// The `used` of `settle`: one int for every bucket, or one per bucket.
    fn used_per_part(&self, used: &Bound<'_, PyAny>) -> PyResult<Vec<i128>> {
        let one = |obj: &Bound<'_, PyAny>| -> PyResult<i128> {
            let n = integer(obj, "used")?;
            if n < 0 {
                return Err(PyValueError::new_err(format!("used must be >= 0, got {n}")));
            }
            Ok(n)
        };
        if used.is_instance_of::<PyTuple>() || used.is_instance_of::<PyList>() {
            let values = used
                .try_iter()?
                .map(|item| one(&item?))
                .collect::<PyResult<Vec<_>>>()?;
            if values.len() != self.parts.len() {
                return Err(PyValueError::new_err(format!(
                    "settle got {} used values for a reservation of {} buckets",
                    values.len(),
                    self.parts.len()
                )));
            }
            return Ok(values);
        }
        let n = one(used)?;
        Ok(vec![n; self.parts.len()])
    }
}

#[pymethods]
impl Reservation {
    /// Seconds until the tokens are the caller's; 0.0 when available now. For
    /// a refusal, the wait it would have needed (`inf` when never).
    #[getter]
    fn delay(&self) -> f64 {
        seconds(self.delay)
    }

    /// The tokens reserved (of the first bucket, for `reserve_all`).
    #[getter]
    fn cost(&self) -> u64 {
        self.parts[0].cost
    }

    /// The key (of the first bucket, for `reserve_all`).
    #[getter]
    fn key(&self, py: Python<'_>) -> Py<PyString> {
        self.parts[0].key.clone_ref(py)
    }

    /// Every bucket of the reservation: `(limiter, key, cost)`.
    #[getter]
    fn checks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items = self
            .parts
            .iter()
            .map(|p| (p.limiter.clone_ref(py), p.key.clone_ref(py), p.cost))
            .collect::<Vec<_>>();
        PyTuple::new(py, items)
    }

    #[getter]
    fn decision(&self, py: Python<'_>) -> Py<Decision> {
        self.decision.clone_ref(py)
    }

    fn __bool__(&self, py: Python<'_>) -> bool {
        self.granted(py)
    }

    /// Gives every token back (capped at capacity); later waits do not move,
    /// and what a reservation still waiting behind this one would have to
    /// share is not given back (docs/design.md §4, "Giving back").
    /// Once: a second call, or one after `settle`, does nothing.
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        if self.settled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        for part in &self.parts {
            refund(py, part, part.cost)?;
        }
        Ok(())
    }

    /// The actual use: gives back `cost - used` when less, charges `used -
    /// cost` more when more (debt allowed). Once; nothing for a refusal.
    fn settle(&self, py: Python<'_>, used: &Bound<'_, PyAny>) -> PyResult<()> {
        let used = self.used_per_part(used)?;
        if self.settled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        for (part, used) in self.parts.iter().zip(used) {
            let cost = i128::from(part.cost);
            if used < cost {
                refund(py, part, (cost - used) as u64)?;
            } else if used > cost {
                let limiter = part.limiter.get();
                let now = limiter.now(py)?;
                let key = part.key.bind(py).to_str()?;
                limiter.registry.charge(key, used - cost, now)?;
            }
        }
        Ok(())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Reservation(key={}, cost={}, delay={}, granted={}, buckets={})",
            repr(self.parts[0].key.bind(py).as_any()),
            self.parts[0].cost,
            repr(PyFloat::new(py, seconds(self.delay)).as_any()),
            if self.granted(py) { "True" } else { "False" },
            self.parts.len()
        )
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for part in &self.parts {
            visit.call(&part.limiter)?;
        }
        Ok(())
    }
}

fn refund(py: Python<'_>, part: &Part, cost: u64) -> PyResult<()> {
    let limiter = part.limiter.get();
    let now = limiter.now(py)?;
    let key = part.key.bind(py).to_str()?;
    Ok(limiter
        .registry
        .refund(key, i128::from(cost), now, part.line)?)
}

/// A reservation as the core answered it.
fn reservation(
    py: Python<'_>,
    parts: Vec<Part>,
    reserved: Reserved,
    degraded: bool,
) -> PyResult<Reservation> {
    let granted = reserved.decision.allowed;
    Ok(Reservation {
        parts,
        delay: reserved.delay,
        decision: Py::new(py, Decision::of(reserved.decision, degraded))?,
        settled: AtomicBool::new(!granted),
    })
}

/// `limiter.reserve(key, cost, max_wait=...)`.
pub fn reserve_one(
    py: Python<'_>,
    limiter: &Bound<'_, TokenBucketLimiter>,
    key: &Bound<'_, PyString>,
    cost: i128,
    max_wait: Wait,
) -> PyResult<Reservation> {
    let this = limiter.get();
    let now = this.now(py)?;
    let (reserved, line) = this.registry.reserve(key_str(key)?, cost, now, max_wait)?;
    let part = Part {
        limiter: limiter.clone().unbind(),
        key: key.clone().unbind(),
        // A granted cost passed the cost rule: it is in 1..=capacity.
        cost: u64::try_from(cost).unwrap_or(0),
        line,
    };
    reservation(py, vec![part], reserved, this.degraded())
}

/// The checks of `allow_all` and friends: `(limiter, key)` pairs with the
/// call's `cost`, or `(limiter, key, cost)` triples.
pub fn parse_checks<'py>(
    checks: &Bound<'py, PyAny>,
    cost: i128,
    what: &str,
) -> PyResult<Vec<Parsed<'py>>> {
    let mut parsed = Vec::new();
    for item in checks.try_iter()? {
        let item = item?;
        let not_a_check = || {
            PyTypeError::new_err(format!(
                "{what} takes a sequence of (limiter, key) pairs or (limiter, key, cost) \
                 triples, got {}",
                type_name(&item)
            ))
        };
        let tuple = item.cast::<PyTuple>().map_err(|_| not_a_check())?;
        let own_cost = match tuple.len() {
            2 => cost,
            3 => integer(&tuple.get_item(2)?, "cost")?,
            _ => return Err(not_a_check()),
        };
        let limiter = tuple
            .get_item(0)?
            .cast_into::<TokenBucketLimiter>()
            .map_err(|e| {
                PyTypeError::new_err(format!(
                    "{what} takes TokenBucketLimiter instances here, got {}",
                    type_name(e.into_inner().as_any())
                ))
            })?;
        let key = tuple.get_item(1)?;
        let key = Key::extract(key.as_borrowed())?.0.to_owned();
        parsed.push((limiter, key, own_cost));
    }
    Ok(parsed)
}

/// `reserve_all` over parsed checks: every clock is read before any lock.
pub fn reserve_checks(
    py: Python<'_>,
    parsed: &[Parsed<'_>],
    max_wait: Wait,
) -> PyResult<Reservation> {
    let mut resolved = Vec::with_capacity(parsed.len());
    let mut degraded = false;
    for (limiter, key, cost) in parsed {
        let this = limiter.get();
        degraded |= this.degraded();
        resolved.push((this, key_str(key)?, *cost, this.now(py)?));
    }
    let checks: Vec<Check<'_>> = resolved
        .iter()
        .map(|&(limiter, key, cost, now)| Check {
            registry: &limiter.registry,
            key,
            cost,
            now,
        })
        .collect();
    let (reserved, lines) = registry::reserve_all(&checks, max_wait)?;
    let parts = parsed
        .iter()
        .zip(lines)
        .map(|((limiter, key, cost), line)| Part {
            limiter: limiter.clone().unbind(),
            key: key.clone().unbind(),
            cost: u64::try_from(*cost).unwrap_or(0),
            line,
        })
        .collect();
    reservation(py, parts, reserved, degraded)
}

/// What a limiter waits with: its clock's `sleep` / `sleep_async` when the
/// clock has one (a `ManualClock` advances itself), else `time.sleep` /
/// `asyncio.sleep`.
fn sleeper<'py>(
    py: Python<'py>,
    limiter: &TokenBucketLimiter,
    r#async: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let name = if r#async { "sleep_async" } else { "sleep" };
    if let Some(clock) = limiter.clock() {
        if let Ok(sleep) = clock.bind(py).getattr(name) {
            if sleep.is_callable() {
                return Ok(sleep);
            }
        }
    }
    let cell = if r#async { &ASYNCIO_SLEEP } else { &TIME_SLEEP };
    let module = if r#async { "asyncio" } else { "time" };
    Ok(cell.import(py, module, "sleep")?.clone())
}

/// Blocks until a granted reservation's tokens are there (the sleep releases
/// the GIL); an exception while waiting cancels it before it propagates.
pub fn wait(py: Python<'_>, reservation: &Reservation) -> PyResult<Py<Decision>> {
    sleep_for(py, reservation)?;
    Ok(reservation.decision.clone_ref(py))
}

/// [`wait`], answering with the reservation itself (to settle it later).
pub fn wait_held(py: Python<'_>, reservation: Reservation) -> PyResult<Py<Reservation>> {
    sleep_for(py, &reservation)?;
    Py::new(py, reservation)
}

fn sleep_for(py: Python<'_>, reservation: &Reservation) -> PyResult<()> {
    if reservation.granted(py) && reservation.delay != Some(0) {
        let limiter = reservation.parts[0].limiter.get();
        let slept = sleeper(py, limiter, false)
            .and_then(|sleep| sleep.call1((seconds(reservation.delay),)));
        if let Err(error) = slept {
            reservation.cancel(py)?;
            return Err(error);
        }
    }
    Ok(())
}

/// `limiter.acquire_async(key, cost, timeout=...)`: the key and cost are
/// checked now, the tokens taken when awaited. `held`: it answers with the
/// reservation rather than its decision.
pub fn acquiring(
    limiter: &Bound<'_, TokenBucketLimiter>,
    key: &Bound<'_, PyString>,
    cost: i128,
    timeout: Option<&Bound<'_, PyAny>>,
    held: bool,
) -> PyResult<Acquiring> {
    let max_wait = max_wait(timeout, "timeout")?;
    crate::error::check_key(key_str(key)?)?;
    limiter.get().config().check_cost(cost)?;
    let mut acquiring = Acquiring::new(Request::One {
        limiter: limiter.clone().unbind(),
        key: key.clone().unbind(),
        cost,
        max_wait,
    });
    acquiring.held = held;
    Ok(acquiring)
}

/// What an `Acquiring` reserves at its first step.
pub enum Request {
    One {
        limiter: Py<TokenBucketLimiter>,
        key: Py<PyString>,
        cost: i128,
        max_wait: Wait,
    },
    All {
        checks: Vec<(Py<TokenBucketLimiter>, Py<PyString>, i128)>,
        max_wait: Wait,
    },
}

impl Request {
    fn reserve(&self, py: Python<'_>) -> PyResult<Reservation> {
        match self {
            Request::One {
                limiter,
                key,
                cost,
                max_wait,
            } => reserve_one(py, limiter.bind(py), key.bind(py), *cost, *max_wait),
            Request::All { checks, max_wait } => {
                let parsed = checks
                    .iter()
                    .map(|(l, k, c)| (l.bind(py).clone(), k.bind(py).clone(), *c))
                    .collect::<Vec<_>>();
                reserve_checks(py, &parsed, *max_wait)
            }
        }
    }
}

enum State {
    Start(Request),
    Waiting {
        reservation: Py<Reservation>,
        /// The iterator of the sleep being awaited.
        sleep: Py<PyAny>,
    },
    Done,
}

/// The coroutine of `acquire_async` / `acquire_all_async`.
///
/// The tokens are taken at its first step, and the same step starts the
/// sleep it then forwards (as `yield from` would): there is no point at
/// which the task can be cancelled between taking them and holding them.
/// Cancelled (or closed, or failing) while it sleeps, it gives them back.
#[pyclass(module = "bucketlimit._core")]
pub struct Acquiring {
    state: State,
    /// Answer with the reservation rather than its decision.
    held: bool,
}

impl Acquiring {
    pub fn new(request: Request) -> Acquiring {
        Acquiring {
            state: State::Start(request),
            held: false,
        }
    }

    /// The coroutine's result: the decision, or the reservation when held.
    fn answer(&self, py: Python<'_>, reservation: Py<Reservation>) -> PyErr {
        if self.held {
            PyStopIteration::new_err((reservation,))
        } else {
            PyStopIteration::new_err((reservation.get().decision.clone_ref(py),))
        }
    }

    /// One step: `send(value)` when `thrown` is `None`, else `throw`.
    fn step(
        &mut self,
        py: Python<'_>,
        value: Py<PyAny>,
        thrown: Option<PyErr>,
    ) -> PyResult<Py<PyAny>> {
        let (reservation, sleep) = match std::mem::replace(&mut self.state, State::Done) {
            State::Done => {
                return Err(thrown.unwrap_or_else(|| {
                    PyRuntimeError::new_err("cannot reuse an already awaited acquire_async()")
                }))
            }
            State::Start(request) => {
                if let Some(error) = thrown {
                    return Err(error); // cancelled before it took anything
                }
                let reservation = request.reserve(py)?;
                if !reservation.granted(py) || reservation.delay == Some(0) {
                    return Err(self.answer(py, Py::new(py, reservation)?));
                }
                let limiter = reservation.parts[0].limiter.get();
                let started = sleeper(py, limiter, true)
                    .and_then(|sleep| sleep.call1((seconds(reservation.delay),)))
                    .and_then(|awaitable| awaitable.call_method0("__await__"));
                let sleep = match started {
                    Ok(sleep) => sleep.unbind(),
                    Err(error) => {
                        reservation.cancel(py)?;
                        return Err(error);
                    }
                };
                (Py::new(py, reservation)?, sleep)
            }
            State::Waiting { reservation, sleep } => (reservation, sleep),
        };
        let bound = sleep.bind(py);
        let answer = match thrown {
            None => bound.call_method1("send", (value,)),
            Some(error) => bound.call_method1("throw", (error.into_value(py),)),
        };
        match answer {
            Ok(yielded) => {
                self.state = State::Waiting { reservation, sleep };
                Ok(yielded.unbind())
            }
            Err(error) if error.is_instance_of::<PyStopIteration>(py) => {
                Err(self.answer(py, reservation))
            }
            Err(error) => {
                reservation.get().cancel(py)?;
                Err(error)
            }
        }
    }
}

#[pymethods]
impl Acquiring {
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
        let error = match value.filter(|v| !v.is_none()) {
            Some(value) if !error.is_instance_of::<pyo3::exceptions::PyBaseException>() => {
                PyErr::from_value(error.call1((value,))?)
            }
            _ => PyErr::from_value(error),
        };
        self.step(py, py.None(), Some(error))
    }

    /// Stops waiting: the tokens go back, as for a cancellation.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        if let State::Waiting { reservation, sleep } =
            std::mem::replace(&mut self.state, State::Done)
        {
            let _ = sleep.bind(py).call_method0("close");
            reservation.get().cancel(py)?;
        }
        Ok(())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        match &self.state {
            State::Waiting { reservation, sleep } => {
                visit.call(reservation)?;
                visit.call(sleep)?;
            }
            State::Start(Request::One { limiter, .. }) => visit.call(limiter)?,
            State::Start(Request::All { checks, .. }) => {
                for (limiter, _, _) in checks {
                    visit.call(limiter)?;
                }
            }
            State::Done => {}
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.state = State::Done;
    }
}
