//! What the binding's modules share: Python values converted to core values
//! (and core errors to exceptions, in one `match`), the `Decision` class, the
//! `TokenBucketLimiter` class's state, and the `ConcurrencyLimiter` and
//! `Permit` classes' state (a reservation releases its permits too).
//! The other binding modules import it (docs/design.md §8 has their order).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};

use hashbrown::HashMap;
use parking_lot::Mutex;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyCFunction, PyFloat, PyInt, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::bucket::{self, Wait};
use crate::clock;
use crate::concurrency::{self, Answer, Woken};
use crate::error::Error;
use crate::rate::{Config, Number};
use crate::registry::{self, Combinable, Registry};

impl From<Error> for PyErr {
    fn from(error: Error) -> PyErr {
        match error {
            Error::Capacity(_)
            | Error::Rate(_)
            | Error::Per(_)
            | Error::OutOfRange { .. }
            | Error::Cost(_)
            | Error::CostAboveCapacity { .. }
            | Error::ChargeTooLarge(_)
            | Error::EmptyKey
            | Error::KeyTooLong(_)
            | Error::Clock(_)
            | Error::DuplicateCheck(_)
            | Error::NoChecks
            | Error::Limit(_)
            | Error::Ttl(_)
            | Error::Permits(_) => PyValueError::new_err(error.to_string()),
        }
    }
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

pub(crate) fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map_or_else(|_| "?".to_owned(), |r| r.to_string())
}

/// An integer as the bad-input table defines it: an `int` or anything with
/// `__index__`, never a `bool` or a `float`. Values beyond i128 are a
/// `ValueError` (never `PyO3`'s `OverflowError`).
pub(crate) fn integer(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i128> {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {} {}",
            type_name(obj),
            repr(obj)
        )));
    }
    match obj.extract::<i64>() {
        Ok(i) => Ok(i128::from(i)),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            obj.extract::<i128>().map_err(|_| {
                PyValueError::new_err(format!(
                    "{name} {} is beyond the exact range of the limiter",
                    repr(obj)
                ))
            })
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            type_name(obj)
        ))),
    }
}

/// A rate or `per`: an int (or `__index__`) or a float, never a `bool`.
pub(crate) fn number(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Number> {
    if let Ok(float) = obj.cast::<PyFloat>() {
        return Ok(Number::Float(float.value()));
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int or float, got bool"
        )));
    }
    match integer(obj, name) {
        Ok(i) => Ok(Number::Int(i)),
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => Err(PyTypeError::new_err(format!(
            "{name} must be an int or float, got {}",
            type_name(obj)
        ))),
        Err(e) => Err(e),
    }
}

/// A clock's reading, converted to microseconds.
pub(crate) fn clock_micros(value: &Bound<'_, PyAny>) -> PyResult<i64> {
    if let Ok(float) = value.cast::<PyFloat>() {
        return Ok(clock::float_seconds_to_micros(float.value())?);
    }
    match integer(value, "clock") {
        Ok(seconds) => Ok(clock::int_seconds_to_micros(seconds)?),
        Err(e) if e.is_instance_of::<PyTypeError>(value.py()) => {
            Err(PyTypeError::new_err(format!(
                "clock must return seconds as an int or float, got {}",
                type_name(value)
            )))
        }
        Err(_) => Err(Error::Clock(repr(value)).into()),
    }
}

/// A `clock` argument: `None`, or a callable (`TypeError` otherwise).
pub(crate) fn clock_arg(clock: Option<Bound<'_, PyAny>>) -> PyResult<Option<Py<PyAny>>> {
    if let Some(clock) = &clock {
        if !clock.is_callable() {
            return Err(PyTypeError::new_err(format!(
                "clock must be a zero-argument callable returning seconds, got {}",
                type_name(clock)
            )));
        }
    }
    Ok(clock.map(Bound::unbind))
}

/// A `max_keys` argument: `None`, or an int >= 1.
pub(crate) fn max_keys_arg(max_keys: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(obj) = max_keys else {
        return Ok(None);
    };
    let n = integer(obj, "max_keys")?;
    if n < 1 {
        return Err(PyValueError::new_err(format!(
            "max_keys must be >= 1 or None, got {n}"
        )));
    }
    Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)))
}

/// Reads a limiter's clock (`None`: the built-in one) in microseconds.
pub(crate) fn read_clock(py: Python<'_>, clock: Option<&Py<PyAny>>) -> PyResult<i64> {
    match clock {
        None => Ok(clock::monotonic_micros()),
        Some(clock) => clock_micros(&clock.bind(py).call0()?),
    }
}

/// A `max_wait` / `timeout`: `None` or `inf` for no limit, else seconds >= 0
/// as an int or float, in microseconds by the clock's rounding (§4).
pub(crate) fn max_wait(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Wait> {
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

/// A cost argument: checked for type here, for value by the core.
pub struct Cost(pub(crate) i128);

impl<'a, 'py> FromPyObject<'a, 'py> for Cost {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Cost> {
        integer(&obj, "cost").map(Cost)
    }
}

/// The `per` argument.
pub struct Per(pub(crate) Number);

impl<'a, 'py> FromPyObject<'a, 'py> for Per {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Per> {
        number(&obj, "per").map(Per)
    }
}

/// A key argument: a `str` (checked here) that encodes as UTF-8.
pub struct Key<'a, 'py>(pub(crate) Borrowed<'a, 'py, PyString>);

impl<'a, 'py> FromPyObject<'a, 'py> for Key<'a, 'py> {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Key<'a, 'py>> {
        match obj.cast::<PyString>() {
            Ok(key) => Ok(Key(key)),
            Err(_) => Err(PyTypeError::new_err(format!(
                "key must be a str, got {}",
                type_name(&obj)
            ))),
        }
    }
}

impl Key<'_, '_> {
    #[inline]
    pub(crate) fn as_str(&self) -> PyResult<&str> {
        self.0
            .to_str()
            .map_err(|e| PyValueError::new_err(format!("key is not encodable as UTF-8: {e}")))
    }
}

/// A key already checked to be a `str`, as UTF-8.
pub(crate) fn key_str<'a>(key: &'a Bound<'_, PyString>) -> PyResult<&'a str> {
    key.to_str()
        .map_err(|e| PyValueError::new_err(format!("key is not encodable as UTF-8: {e}")))
}

/// Seconds as a float; `inf` when the wait never ends.
#[inline]
pub(crate) fn seconds(wait: Wait) -> f64 {
    wait.map_or(f64::INFINITY, |micros| {
        // `u128 as f64` is a slow software routine; real waits fit in u64,
        // whose conversion is one instruction. Longer ones (a deep debt at a
        // tiny rate) take the routine: correctly rounded, as Python's float().
        // The routine stays out of line: inlined, LLVM merges both branches
        // back into the routine (measured: two calls per `allow`).
        let micros = u64::try_from(micros).map_or_else(|_| wide_to_f64(micros), |m| m as f64);
        micros / 1_000_000.0
    })
}

#[cold]
#[inline(never)]
fn wide_to_f64(micros: u128) -> f64 {
    micros as f64
}

// The fields of a `Decision` built from Python, checked like every other input
// (docs/design.md §3): `TypeError` for the wrong type, `ValueError` for the wrong
// value, never PyO3's `OverflowError`.

fn flag(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    obj.cast::<PyBool>()
        .map(PyBoolMethods::is_true)
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a bool, got {}", type_name(obj))))
}

/// Seconds of a wait: an int or float, >= 0 (`inf`: never), not NaN.
fn wait_seconds(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    if let Ok(float) = obj.cast_exact::<PyFloat>() {
        let seconds = float.value();
        if seconds >= 0.0 {
            return Ok(seconds); // the common case, in a few instructions
        }
    }
    let seconds = match number(obj, name)? {
        Number::Float(x) => x,
        Number::Int(i) => i as f64,
    };
    if seconds >= 0.0 {
        Ok(seconds)
    } else {
        Err(PyValueError::new_err(format!(
            "{name} must be >= 0 seconds (inf: never), got {}",
            repr(obj)
        )))
    }
}

/// A count of tokens: an int from 0 to 2**64 - 1.
pub(crate) fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(n) = obj.extract::<u64>() {
            return Ok(n); // the common case
        }
    }
    let n = integer(obj, name)?;
    u64::try_from(n).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be an int from 0 to 2**64 - 1, got {}",
            repr(obj)
        ))
    })
}

/// The answer to one request: immutable, truthy when allowed.
///
/// No `freelist`: `PyO3` 0.30's takes a `std` mutex to allocate and again to
/// free, which costs more than `CPython`'s own allocator (the benchmark floor's
/// no-op call: 70 ns with one, 57 ns without, same run).
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct Decision {
    #[pyo3(get)]
    allowed: bool,
    #[pyo3(get)]
    retry_after: f64,
    #[pyo3(get)]
    remaining: u64,
    #[pyo3(get)]
    reset_after: f64,
    #[pyo3(get)]
    limit: u64,
    #[pyo3(get)]
    degraded: bool,
}

impl Decision {
    #[inline]
    pub(crate) fn of(d: bucket::Decision, degraded: bool) -> Decision {
        Decision {
            allowed: d.allowed,
            retry_after: seconds(d.retry_after),
            remaining: d.remaining,
            reset_after: seconds(d.reset_after),
            limit: d.limit,
            degraded,
        }
    }
}

impl Decision {
    pub(crate) fn copy(&self) -> Decision {
        Decision { ..*self }
    }

    pub(crate) fn allowed(&self) -> bool {
        self.allowed
    }

    /// Several decisions as one, by the rule of `allow_all`; degraded if any is.
    pub(crate) fn combined(decisions: &[Decision]) -> Decision {
        let degraded = decisions.iter().any(|d| d.degraded);
        Decision {
            degraded,
            ..registry::combine(decisions)
        }
    }

    fn fields(&self) -> (bool, f64, u64, f64, u64, bool) {
        (
            self.allowed,
            self.retry_after,
            self.remaining,
            self.reset_after,
            self.limit,
            self.degraded,
        )
    }
}

/// The binding's decisions follow the rule of `allow_all` too (`_core.combine`).
impl Combinable for Decision {
    type Wait = f64;
    const NO_WAIT: f64 = 0.0;

    fn allowed(&self) -> bool {
        self.allowed
    }

    fn remaining(&self) -> u64 {
        self.remaining
    }

    fn retry_after(&self) -> f64 {
        self.retry_after
    }

    /// Never NaN (checked when built): `inf`, never, is the longest.
    fn longer(a: f64, b: f64) -> f64 {
        a.max(b)
    }

    fn answering(&self, allowed: bool, retry_after: f64) -> Decision {
        Decision {
            allowed,
            retry_after,
            ..*self
        }
    }
}

#[pymethods]
impl Decision {
    #[new]
    #[pyo3(signature = (allowed, retry_after, remaining, reset_after, limit, degraded = None))]
    #[pyo3(
        text_signature = "(allowed, retry_after, remaining, reset_after, limit, degraded=False)"
    )]
    fn new(
        allowed: &Bound<'_, PyAny>,
        retry_after: &Bound<'_, PyAny>,
        remaining: &Bound<'_, PyAny>,
        reset_after: &Bound<'_, PyAny>,
        limit: &Bound<'_, PyAny>,
        degraded: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Decision> {
        Ok(Decision {
            allowed: flag(allowed, "allowed")?,
            retry_after: wait_seconds(retry_after, "retry_after")?,
            remaining: count(remaining, "remaining")?,
            reset_after: wait_seconds(reset_after, "reset_after")?,
            limit: count(limit, "limit")?,
            degraded: degraded.map_or(Ok(false), |d| flag(d, "degraded"))?,
        })
    }

    fn __bool__(&self) -> bool {
        self.allowed
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let float = |x: f64| repr(PyFloat::new(py, x).as_any());
        let title = |b: bool| if b { "True" } else { "False" };
        format!(
            "Decision(allowed={}, retry_after={}, remaining={}, reset_after={}, limit={}, degraded={})",
            title(self.allowed),
            float(self.retry_after),
            self.remaining,
            float(self.reset_after),
            self.limit,
            title(self.degraded)
        )
    }

    fn __eq__(&self, other: &Bound<'_, Decision>) -> bool {
        self.fields() == other.get().fields()
    }

    fn __hash__(&self) -> u64 {
        let mut h = DefaultHasher::new();
        (
            self.allowed,
            self.retry_after.to_bits(),
            self.remaining,
            self.reset_after.to_bits(),
            self.limit,
            self.degraded,
        )
            .hash(&mut h);
        // Python reserves -1; keep the hash in the positive range.
        h.finish() >> 1
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Decision>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let args = slf.get().fields().into_pyobject(slf.py())?;
        Ok((slf.get_type().into_any(), args))
    }
}

/// An in-process token-bucket limiter: one bucket per key.
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct TokenBucketLimiter {
    pub(crate) registry: Registry,
    pub(crate) clock: Option<Py<PyAny>>,
    pub(crate) per: f64,
    pub(crate) max_keys: Option<usize>,
    /// Every answer is marked degraded: a distributed limiter's local fallback.
    pub(crate) degraded: bool,
}

impl TokenBucketLimiter {
    /// Reads the clock. Always before the registry lock is taken: the clock
    /// may be Python code, which must never run under the lock.
    #[inline(always)]
    pub(crate) fn now(&self, py: Python<'_>) -> PyResult<i64> {
        match &self.clock {
            None => Ok(clock::monotonic_micros()),
            Some(clock) => clock_micros(&clock.bind(py).call0()?),
        }
    }

    pub(crate) fn config(&self) -> &Config {
        self.registry.config()
    }

    pub(crate) fn clock(&self) -> Option<&Py<PyAny>> {
        self.clock.as_ref()
    }

    pub(crate) fn degraded(&self) -> bool {
        self.degraded
    }
}

/// How to wake a waiter that is asleep for real when a permit is handed to it.
pub(crate) enum Waker {
    /// A locked `_thread.lock` its thread blocks on (the GIL released): released.
    Thread(Py<PyAny>),
    /// A future its task awaits: resolved on its event loop.
    Task {
        event_loop: Py<PyAny>,
        future: Py<PyAny>,
    },
}

static RESOLVE: PyOnceLock<Py<PyCFunction>> = PyOnceLock::new();

/// Resolves a waiter's future unless it is done (cancelled, or resolved
/// already by its timer).
#[pyfunction]
fn resolve(future: &Bound<'_, PyAny>) -> PyResult<()> {
    if !future.call_method0("done")?.is_truthy()? {
        future.call_method1("set_result", (future.py().None(),))?;
    }
    Ok(())
}

/// `resolve` as a callable for `call_soon_threadsafe` / `call_later`.
pub(crate) fn resolver(py: Python<'_>) -> PyResult<&Bound<'_, PyCFunction>> {
    RESOLVE
        .get_or_try_init(py, || Ok(wrap_pyfunction!(resolve, py)?.unbind()))
        .map(|f| f.bind(py))
}

impl Waker {
    fn wake(&self, py: Python<'_>) {
        // Errors are dropped on purpose: a lock already released means its
        // thread has a wake-up pending anyway, and a closed event loop has no
        // task left to wake (its coroutine gives the permit back when it is
        // closed or collected).
        let _ = match self {
            Waker::Thread(lock) => lock.call_method0(py, "release"),
            Waker::Task { event_loop, future } => resolver(py).and_then(|resolve| {
                event_loop.call_method1(py, "call_soon_threadsafe", (resolve, future))
            }),
        };
    }

    fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        match self {
            Waker::Thread(lock) => visit.call(lock),
            Waker::Task { event_loop, future } => {
                visit.call(event_loop)?;
                visit.call(future)
            }
        }
    }
}

/// An in-process concurrency limiter: at most `limit` permits held per key.
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct ConcurrencyLimiter {
    pub(crate) core: concurrency::Limiter,
    pub(crate) clock: Option<Py<PyAny>>,
    /// Seconds, as given.
    pub(crate) ttl: f64,
    pub(crate) max_keys: Option<usize>,
    /// The waiters asleep for real, by id: how to wake each when the core
    /// hands it a permit. Python objects, so only ever called unlocked.
    wakers: Mutex<HashMap<u64, Waker>>,
}

impl ConcurrencyLimiter {
    pub(crate) fn new(
        core: concurrency::Limiter,
        clock: Option<Py<PyAny>>,
        ttl: f64,
        max_keys: Option<usize>,
    ) -> ConcurrencyLimiter {
        ConcurrencyLimiter {
            core,
            clock,
            ttl,
            max_keys,
            wakers: Mutex::new(HashMap::new()),
        }
    }

    /// Reads the clock: always before the core's lock is taken (§5).
    pub(crate) fn now(&self, py: Python<'_>) -> PyResult<i64> {
        read_clock(py, self.clock.as_ref())
    }

    /// Wakes the waiters a core call handed a permit. Call it with no lock held.
    pub(crate) fn wake(&self, py: Python<'_>, woken: Woken) {
        if woken.is_empty() {
            return;
        }
        let wakers: Vec<Waker> = {
            let mut table = self.wakers.lock();
            woken.iter().filter_map(|id| table.remove(id)).collect()
        };
        for waker in &wakers {
            waker.wake(py);
        }
    }

    /// The waiter `id` is asleep for real: wake it with `waker` when it is
    /// handed a permit (a waker it had before is replaced).
    pub(crate) fn register(&self, id: u64, waker: Waker) {
        let replaced = self.wakers.lock().insert(id, waker);
        drop(replaced); // a Python object: dropped with the lock released
    }

    pub(crate) fn unregister(&self, id: u64) {
        let removed = self.wakers.lock().remove(&id);
        drop(removed);
    }

    /// Shows the clock and the sleeping waiters' locks and futures to the
    /// garbage collector (a waiter's task refers back to this limiter).
    pub(crate) fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(clock) = &self.clock {
            visit.call(clock)?;
        }
        // Another thread may hold the table for an instant: then this pass
        // reports fewer references, which only keeps the objects alive.
        if let Some(table) = self.wakers.try_lock() {
            for waker in table.values() {
                waker.visit(visit)?;
            }
        }
        Ok(())
    }
}

/// A concurrency permit, or a refusal (falsy; holds nothing).
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct Permit {
    pub(crate) limiter: Py<ConcurrencyLimiter>,
    pub(crate) key: Py<PyString>,
    /// The fencing token; 0 for a refusal (tokens start at 1).
    pub(crate) token: u64,
    pub(crate) decision: bucket::Decision,
    /// Set once released (a refusal starts released).
    released: AtomicBool,
}

impl Permit {
    pub(crate) fn new(
        limiter: Py<ConcurrencyLimiter>,
        key: Py<PyString>,
        answer: Answer,
    ) -> Permit {
        let (token, decision) = match answer {
            Ok(grant) => (grant.token, grant.decision),
            Err(decision) => (0, decision),
        };
        Permit {
            limiter,
            key,
            token,
            decision,
            released: AtomicBool::new(token == 0),
        }
    }

    pub(crate) fn granted(&self) -> bool {
        self.token != 0
    }

    /// True once released (or never granted).
    pub(crate) fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Releases it, once: its slot goes to the key's first waiter. Reads the
    /// clock first: if the clock raises, nothing is released.
    pub(crate) fn release(&self, py: Python<'_>) -> PyResult<()> {
        if self.released() {
            return Ok(());
        }
        let now = self.limiter.get().now(py)?;
        self.release_at(py, now)
    }

    /// [`Permit::release`] on a path that must not fail (a cancellation, an
    /// error already on its way): at the limiter's latest time when the clock
    /// cannot be read.
    pub(crate) fn release_quietly(&self, py: Python<'_>) {
        let now = self.limiter.get().now(py).unwrap_or(i64::MIN);
        let _ = self.release_at(py, now);
    }

    fn release_at(&self, py: Python<'_>, now: i64) -> PyResult<()> {
        if self.released.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let limiter = self.limiter.get();
        let key = self.key.bind(py).to_str()?;
        let (_, woken) = limiter.core.release(key, self.token, now)?;
        limiter.wake(py, woken);
        Ok(())
    }
}
