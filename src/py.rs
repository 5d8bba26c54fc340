//! The binding: converts Python values to core values and core errors to
//! Python exceptions, and nothing else. Types are checked here (`TypeError`);
//! values are checked by the core (`ValueError`, via one `From` impl).

use std::hash::{DefaultHasher, Hash, Hasher};

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::bucket::{self, Wait};
use crate::clock;
use crate::error::Error;
use crate::py_reserve;
use crate::rate::{Config, Number};
use crate::registry::Registry;

impl From<Error> for PyErr {
    fn from(error: Error) -> PyErr {
        match error {
            Error::Capacity(_)
            | Error::Rate(_)
            | Error::Per(_)
            | Error::OutOfRange { .. }
            | Error::Cost(_)
            | Error::CostAboveCapacity { .. }
            | Error::EmptyKey
            | Error::KeyTooLong(_)
            | Error::Clock(_)
            | Error::DuplicateCheck(_)
            | Error::NoChecks => PyValueError::new_err(error.to_string()),
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
fn number(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Number> {
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
fn clock_micros(value: &Bound<'_, PyAny>) -> PyResult<i64> {
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

/// A cost argument: checked for type here, for value by the core.
pub struct Cost(i128);

impl<'a, 'py> FromPyObject<'a, 'py> for Cost {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Cost> {
        integer(&obj, "cost").map(Cost)
    }
}

/// The `per` argument.
pub struct Per(Number);

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
pub(crate) fn seconds(wait: Wait) -> f64 {
    wait.map_or(f64::INFINITY, |micros| {
        // `u128 as f64` is a slow software routine; real waits fit in u64,
        // whose conversion is one instruction. Longer ones (a deep debt at a
        // tiny rate) take the routine: correctly rounded, as Python's float().
        let high = (micros >> 64) as u64;
        let micros = if high == 0 {
            micros as u64 as f64
        } else {
            micros as f64
        };
        micros / 1_000_000.0
    })
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
fn count(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
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
#[pyclass(frozen, freelist = 64, module = "bucketlimit._core")]
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
    clock: Option<Py<PyAny>>,
    per: f64,
    max_keys: Option<usize>,
    /// Every answer is marked degraded: a distributed limiter's local fallback.
    degraded: bool,
}

impl TokenBucketLimiter {
    /// Reads the clock. Always before the registry lock is taken: the clock
    /// may be Python code, which must never run under the lock.
    #[inline]
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

#[pymethods]
impl TokenBucketLimiter {
    #[new]
    #[pyo3(signature = (capacity, rate, clock = None, *, per = Per(Number::Int(1)), max_keys = None))]
    #[pyo3(text_signature = "(capacity, rate, clock=None, *, per=1, max_keys=None)")]
    fn new(
        capacity: &Bound<'_, PyAny>,
        rate: &Bound<'_, PyAny>,
        clock: Option<Bound<'_, PyAny>>,
        per: Per,
        max_keys: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<TokenBucketLimiter> {
        let capacity = integer(capacity, "capacity")?;
        let rate = number(rate, "rate")?;
        if let Some(clock) = &clock {
            if !clock.is_callable() {
                return Err(PyTypeError::new_err(format!(
                    "clock must be a zero-argument callable returning seconds, got {}",
                    type_name(clock)
                )));
            }
        }
        let max_keys = match max_keys {
            None => None,
            Some(obj) => {
                let n = integer(obj, "max_keys")?;
                if n < 1 {
                    return Err(PyValueError::new_err(format!(
                        "max_keys must be >= 1 or None, got {n}"
                    )));
                }
                Some(usize::try_from(n).unwrap_or(usize::MAX))
            }
        };
        let per_seconds = match per.0 {
            Number::Int(i) => i as f64,
            Number::Float(x) => x,
        };
        let config = Config::new(capacity, rate, per.0)?;
        Ok(TokenBucketLimiter {
            registry: Registry::new(config, max_keys),
            clock: clock.map(Bound::unbind),
            per: per_seconds,
            max_keys,
            degraded: false,
        })
    }

    /// A limiter whose every answer says `degraded=True`: the local fallback of a
    /// distributed limiter (`bucketlimit._redis`), so that a degraded answer is
    /// one native call (a flag read here, not a second copy of `allow`).
    #[staticmethod]
    #[pyo3(name = "_fallback", signature = (capacity, rate, clock = None, *, per = Per(Number::Int(1))))]
    #[pyo3(text_signature = "(capacity, rate, clock=None, *, per=1)")]
    fn fallback(
        capacity: &Bound<'_, PyAny>,
        rate: &Bound<'_, PyAny>,
        clock: Option<Bound<'_, PyAny>>,
        per: Per,
    ) -> PyResult<TokenBucketLimiter> {
        let limiter = TokenBucketLimiter::new(capacity, rate, clock, per, None)?;
        Ok(TokenBucketLimiter {
            degraded: true,
            ..limiter
        })
    }

    /// Decides and spends.
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn allow(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<Decision> {
        let now = self.now(py)?;
        let decision = self.registry.allow(key.as_str()?, cost.0, now)?;
        Ok(Decision::of(decision, self.degraded))
    }

    /// What `allow` would answer now; changes nothing.
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn peek(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<Decision> {
        let now = self.now(py)?;
        let decision = self.registry.peek(key.as_str()?, cost.0, now)?;
        Ok(Decision::of(decision, self.degraded))
    }

    /// Gives back tokens reserved but not used; never above capacity.
    fn refund(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<()> {
        let now = self.now(py)?;
        Ok(self.registry.refund(key.as_str()?, cost.0, now, None)?)
    }

    /// Takes `cost` tokens now, in debt if need be; `delay` says when they
    /// are the caller's. Refused at once (spending nothing) when the wait
    /// would exceed `max_wait` seconds or the debt its bound (docs/design.md §4).
    #[pyo3(signature = (key, cost = Cost(1), *, max_wait = None))]
    #[pyo3(text_signature = "($self, key, cost=1, *, max_wait=None)")]
    fn reserve(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyString>,
        cost: Cost,
        max_wait: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<py_reserve::Reservation> {
        let max_wait = py_reserve::max_wait(max_wait, "max_wait")?;
        py_reserve::reserve_one(slf.py(), slf, key, cost.0, max_wait)
    }

    /// Blocks until the tokens are the caller's, or refuses at once when the
    /// wait would exceed `timeout` seconds.
    #[pyo3(signature = (key, cost = Cost(1), *, timeout = None))]
    #[pyo3(text_signature = "($self, key, cost=1, *, timeout=None)")]
    fn acquire(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyString>,
        cost: Cost,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<Decision>> {
        let timeout = py_reserve::max_wait(timeout, "timeout")?;
        let reservation = py_reserve::reserve_one(slf.py(), slf, key, cost.0, timeout)?;
        py_reserve::wait(slf.py(), &reservation)
    }

    /// `acquire` for asyncio: a coroutine; a cancelled waiter gives its tokens back.
    #[pyo3(signature = (key, cost = Cost(1), *, timeout = None))]
    #[pyo3(text_signature = "($self, key, cost=1, *, timeout=None)")]
    fn acquire_async(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyString>,
        cost: Cost,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<py_reserve::Acquiring> {
        py_reserve::acquiring(slf, key, cost.0, timeout, false)
    }

    /// `acquire`, answering with the reservation (granted or refused), for
    /// callers that settle it later: the web adapters' `max_wait`.
    #[pyo3(signature = (key, cost = Cost(1), *, timeout = None))]
    fn _acquire_reservation(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyString>,
        cost: Cost,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<py_reserve::Reservation>> {
        let timeout = py_reserve::max_wait(timeout, "timeout")?;
        let reservation = py_reserve::reserve_one(slf.py(), slf, key, cost.0, timeout)?;
        py_reserve::wait_held(slf.py(), reservation)
    }

    /// `acquire_async`, answering with the reservation (see `_acquire_reservation`).
    #[pyo3(signature = (key, cost = Cost(1), *, timeout = None))]
    fn _acquire_reservation_async(
        slf: &Bound<'_, Self>,
        key: &Bound<'_, PyString>,
        cost: Cost,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<py_reserve::Acquiring> {
        py_reserve::acquiring(slf, key, cost.0, timeout, true)
    }

    /// Records use that already happened: any cost >= 1 (above capacity
    /// too), debt allowed. Returns the bucket's state after it.
    fn charge(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<Decision> {
        let now = self.now(py)?;
        let decision = self.registry.charge(key.as_str()?, cost.0, now)?;
        Ok(Decision::of(decision, self.degraded))
    }

    /// Makes the key's bucket full again.
    fn reset(&self, key: Key<'_, '_>) -> PyResult<()> {
        Ok(self.registry.reset(key.as_str()?)?)
    }

    /// Forgets every bucket.
    fn clear(&self) {
        self.registry.clear();
    }

    fn __len__(&self) -> usize {
        self.registry.len()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.registry.stats();
        let dict = PyDict::new(py);
        dict.set_item("allowed", s.allowed)?;
        dict.set_item("refused", s.refused)?;
        dict.set_item("keys", s.keys)?;
        dict.set_item("evicted", s.evicted)?;
        dict.set_item("refused_new_keys", s.refused_new_keys)?;
        Ok(dict)
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.config().capacity
    }

    /// Tokens per second.
    #[getter]
    fn rate(&self) -> f64 {
        self.config().rate_per_second()
    }

    #[getter]
    fn per(&self) -> f64 {
        self.per
    }

    #[getter]
    fn max_keys(&self) -> Option<usize> {
        self.max_keys
    }

    /// The clock is the one Python object a limiter holds: shown to the
    /// garbage collector, so a clock that refers back to its limiter (a
    /// method of an object holding it) does not leak the pair.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(clock) = &self.clock {
            visit.call(clock)?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "TokenBucketLimiter(capacity={}, rate={:?}, per={:?}, max_keys={})",
            self.config().capacity,
            self.rate() * self.per,
            self.per,
            self.max_keys
                .map_or_else(|| "None".to_owned(), |n| n.to_string())
        )
    }
}

/// Spends each check's cost from every `(limiter, key[, cost])` only if all
/// of them allow.
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1)), text_signature = "(checks, cost=1)")]
pub fn allow_all(py: Python<'_>, checks: &Bound<'_, PyAny>, cost: Cost) -> PyResult<Decision> {
    let parsed = py_reserve::parse_checks(checks, cost.0, "allow_all")?;
    let reservation = py_reserve::reserve_checks(py, &parsed, Some(0))?;
    let decision = reservation.decision_of(py);
    Ok(decision)
}

/// Reserves each check's cost from every bucket at once, all or nothing.
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1), *, max_wait = None))]
#[pyo3(text_signature = "(checks, cost=1, *, max_wait=None)")]
pub fn reserve_all(
    py: Python<'_>,
    checks: &Bound<'_, PyAny>,
    cost: Cost,
    max_wait: Option<&Bound<'_, PyAny>>,
) -> PyResult<py_reserve::Reservation> {
    let max_wait = py_reserve::max_wait(max_wait, "max_wait")?;
    let parsed = py_reserve::parse_checks(checks, cost.0, "reserve_all")?;
    py_reserve::reserve_checks(py, &parsed, max_wait)
}

/// `reserve_all`, then blocks for the longest delay (or refuses at once).
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1), *, timeout = None))]
#[pyo3(text_signature = "(checks, cost=1, *, timeout=None)")]
pub fn acquire_all(
    py: Python<'_>,
    checks: &Bound<'_, PyAny>,
    cost: Cost,
    timeout: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<Decision>> {
    let timeout = py_reserve::max_wait(timeout, "timeout")?;
    let parsed = py_reserve::parse_checks(checks, cost.0, "acquire_all")?;
    let reservation = py_reserve::reserve_checks(py, &parsed, timeout)?;
    py_reserve::wait(py, &reservation)
}

/// `acquire_all` for asyncio: a coroutine.
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1), *, timeout = None))]
#[pyo3(text_signature = "(checks, cost=1, *, timeout=None)")]
pub fn acquire_all_async(
    checks: &Bound<'_, PyAny>,
    cost: Cost,
    timeout: Option<&Bound<'_, PyAny>>,
) -> PyResult<py_reserve::Acquiring> {
    let max_wait = py_reserve::max_wait(timeout, "timeout")?;
    let parsed = py_reserve::parse_checks(checks, cost.0, "acquire_all_async")?;
    Ok(py_reserve::Acquiring::new(py_reserve::Request::All {
        checks: parsed
            .into_iter()
            .map(|(l, k, c)| (l.unbind(), k.unbind(), c))
            .collect(),
        max_wait,
    }))
}

/// The exact integer configuration the Redis script uses:
/// `(capacity, units refilled per microsecond, units per token)`.
/// Validates exactly as `TokenBucketLimiter` does; one source of truth.
#[pyfunction]
#[pyo3(signature = (capacity, rate, *, per = Per(Number::Int(1))), text_signature = "(capacity, rate, *, per=1)")]
pub fn exact_units(
    capacity: &Bound<'_, PyAny>,
    rate: &Bound<'_, PyAny>,
    per: Per,
) -> PyResult<(u64, u128, u128)> {
    let config = Config::new(integer(capacity, "capacity")?, number(rate, "rate")?, per.0)?;
    Ok((config.capacity, config.per_micro, config.unit))
}

/// Checks a cost as the limiter does (type, then value) and returns it.
#[pyfunction]
pub fn check_cost(cost: &Bound<'_, PyAny>, capacity: u64) -> PyResult<u64> {
    Ok(crate::rate::check_cost(integer(cost, "cost")?, capacity)?)
}

/// A clock reading in whole microseconds, by the limiter's own rule.
#[pyfunction]
pub fn clock_to_micros(seconds: &Bound<'_, PyAny>) -> PyResult<i64> {
    clock_micros(seconds)
}

/// Checks a key as the limiter does and returns it.
#[pyfunction]
pub fn check_key<'py>(key: Key<'_, 'py>) -> PyResult<Bound<'py, PyString>> {
    crate::error::check_key(key.as_str()?)?;
    Ok(key.0.to_owned())
}
