//! The binding of the limiter: `TokenBucketLimiter`'s methods and the
//! module's functions. Types are checked here (`TypeError`, with the
//! conversions of `py_types`); values are checked by the core (`ValueError`).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use pyo3::PyTraverseError;

use crate::bucket::{Report, Wait};
use crate::py_checks::parse_checks;
use crate::py_reserve;
use crate::py_types::{
    self, clock_arg, clock_micros, count, integer, max_keys_arg, number, Cost, Decision, Key, Per,
    TokenBucketLimiter,
};
use crate::rate::{Config, Number};
use crate::registry::Registry;

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
        let clock = clock_arg(clock)?;
        let max_keys = max_keys_arg(max_keys)?;
        let per_seconds = match per.0 {
            Number::Int(i) => i as f64,
            Number::Float(x) => x,
        };
        let config = Config::new(capacity, rate, per.0)?;
        Ok(TokenBucketLimiter {
            registry: Registry::new(config, max_keys),
            clock,
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
        let max_wait = py_types::max_wait(max_wait, "max_wait")?;
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
        let timeout = py_types::max_wait(timeout, "timeout")?;
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
        py_reserve::acquiring(slf, key, cost.0, timeout)
    }

    /// Records use that already happened: any cost >= 1 (above capacity
    /// too), debt allowed. Returns the bucket's state after it.
    fn charge(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<Decision> {
        let now = self.now(py)?;
        let decision = self.registry.charge(key.as_str()?, cost.0, now)?;
        Ok(Decision::of(decision, self.degraded))
    }

    /// Applies what an upstream reported for the key: its balance becomes at most
    /// what the upstream says remains (never raised), ordered by the report's
    /// time `at` on the limiter's clock. Answers the bucket after it.
    #[pyo3(signature = (key, remaining, *, limit = None, reset_after = None, retry_after = None, at = None))]
    #[pyo3(
        text_signature = "($self, key, remaining, *, limit=None, reset_after=None, retry_after=None, at=None)"
    )]
    #[allow(clippy::too_many_arguments)] // the method's keyword arguments
    fn observe(
        &self,
        py: Python<'_>,
        key: Key<'_, '_>,
        remaining: &Bound<'_, PyAny>,
        limit: Option<&Bound<'_, PyAny>>,
        reset_after: Option<&Bound<'_, PyAny>>,
        retry_after: Option<&Bound<'_, PyAny>>,
        at: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Decision> {
        let words = Words::new(remaining, limit, reset_after, retry_after)?;
        let now = self.now(py)?;
        let at = match at.filter(|a| !a.is_none()) {
            None => now,
            // A reading of the clock; the built-in one is read as time.monotonic().
            Some(at) if self.clock().is_some() => at_micros(at)?,
            Some(at) => {
                let at = at_micros(at)?;
                let monotonic = py.import("time")?.getattr("monotonic")?.call0()?;
                now.saturating_sub(clock_micros(&monotonic)?.saturating_sub(at))
            }
        };
        let report = words.report(self.config(), at);
        let decision = self.registry.observe(key.as_str()?, &report, now)?;
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
/// of them allow. With concurrency limiters among the checks it also takes
/// their permits, all or nothing, and answers the `Reservation` holding them
/// (its `cancel`/`settle` release them); else the `Decision`.
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1)), text_signature = "(checks, cost=1)")]
pub fn allow_all(py: Python<'_>, checks: &Bound<'_, PyAny>, cost: Cost) -> PyResult<Py<PyAny>> {
    let parsed = parse_checks(checks, cost.0, "allow_all")?;
    if parsed.permits.is_empty() {
        let reservation = py_reserve::reserve_checks(py, &parsed.buckets, Some(0))?;
        let decision = reservation.decision_of(py);
        return Ok(Py::new(py, decision)?.into_any());
    }
    let reservation = py_reserve::reserve_with_permits(py, &parsed, Some(0))?;
    Ok(Py::new(py, reservation)?.into_any())
}

/// Reserves each check's cost from every bucket at once, all or nothing
/// (and the permits of concurrency limiters, free now).
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1), *, max_wait = None))]
#[pyo3(text_signature = "(checks, cost=1, *, max_wait=None)")]
pub fn reserve_all(
    py: Python<'_>,
    checks: &Bound<'_, PyAny>,
    cost: Cost,
    max_wait: Option<&Bound<'_, PyAny>>,
) -> PyResult<py_reserve::Reservation> {
    let max_wait = py_types::max_wait(max_wait, "max_wait")?;
    let parsed = parse_checks(checks, cost.0, "reserve_all")?;
    if parsed.permits.is_empty() {
        return py_reserve::reserve_checks(py, &parsed.buckets, max_wait);
    }
    py_reserve::reserve_with_permits(py, &parsed, max_wait)
}

/// `reserve_all`, then blocks for the longest delay (or refuses at once).
/// With concurrency limiters: waits for their permits first (in arrival
/// order), then for the tokens, and answers the `Reservation`.
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1), *, timeout = None))]
#[pyo3(text_signature = "(checks, cost=1, *, timeout=None)")]
pub fn acquire_all(
    py: Python<'_>,
    checks: &Bound<'_, PyAny>,
    cost: Cost,
    timeout: Option<&Bound<'_, PyAny>>,
) -> PyResult<Py<PyAny>> {
    let timeout = py_types::max_wait(timeout, "timeout")?;
    let parsed = parse_checks(checks, cost.0, "acquire_all")?;
    if parsed.permits.is_empty() {
        let reservation = py_reserve::reserve_checks(py, &parsed.buckets, timeout)?;
        return Ok(py_reserve::wait(py, &reservation)?.into_any());
    }
    let reservation = py_reserve::acquire_with_permits(py, &parsed, timeout)?;
    Ok(Py::new(py, reservation)?.into_any())
}

/// `acquire_all` for asyncio: a coroutine.
#[pyfunction]
#[pyo3(signature = (checks, cost = Cost(1), *, timeout = None))]
#[pyo3(text_signature = "(checks, cost=1, *, timeout=None)")]
pub fn acquire_all_async(
    py: Python<'_>,
    checks: &Bound<'_, PyAny>,
    cost: Cost,
    timeout: Option<&Bound<'_, PyAny>>,
) -> PyResult<py_reserve::Acquiring> {
    let max_wait = py_types::max_wait(timeout, "timeout")?;
    let parsed = parse_checks(checks, cost.0, "acquire_all_async")?;
    py_reserve::acquiring_all(py, &parsed, max_wait)
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

/// A report's time `at`, in µs: a clock reading, by the clock's rule.
fn at_micros(at: &Bound<'_, PyAny>) -> PyResult<i64> {
    clock_micros(at).map_err(|e| {
        let kind = if e.is_instance_of::<PyTypeError>(at.py()) {
            PyTypeError::new_err
        } else {
            PyValueError::new_err
        };
        kind(format!(
            "at must be a reading of the limiter's clock (finite seconds as an int or \
             float), got {}",
            crate::py_types::repr(at)
        ))
    })
}

/// An upstream's words about a key, checked: `TypeError` for a wrong type,
/// `ValueError` for a wrong value, before anything is read or changed.
struct Words {
    remaining: u64,
    limit: Option<u64>,
    reset_after: Option<Wait>,
    retry_after: Option<Wait>,
}

impl Words {
    fn new(
        remaining: &Bound<'_, PyAny>,
        limit: Option<&Bound<'_, PyAny>>,
        reset_after: Option<&Bound<'_, PyAny>>,
        retry_after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Words> {
        let given = |obj: Option<&Bound<'_, PyAny>>, name: &str| {
            obj.filter(|o| !o.is_none())
                .map(|o| py_types::max_wait(Some(o), name))
                .transpose()
        };
        Ok(Words {
            remaining: count(remaining, "remaining")?,
            limit: limit
                .filter(|l| !l.is_none())
                .map(|l| count(l, "limit"))
                .transpose()?,
            reset_after: given(reset_after, "reset_after")?,
            retry_after: given(retry_after, "retry_after")?,
        })
    }

    fn report(&self, config: &Config, at: i64) -> Report {
        Report::new(
            config,
            self.remaining,
            self.limit,
            self.reset_after,
            self.retry_after,
            at,
        )
    }
}

/// The bound an upstream's report sets, in the Redis script's units: what
/// `observe` reduces a report to (`Report::new`), for a limiter of `capacity`
/// refilling `per_micro` units a microsecond, `unit` units a token (the numbers
/// of `exact_units`). The Redis limiter sends it; one rule, one place.
#[pyfunction]
#[pyo3(signature = (capacity, per_micro, unit, remaining, *, limit = None, reset_after = None, retry_after = None))]
#[pyo3(
    text_signature = "(capacity, per_micro, unit, remaining, *, limit=None, reset_after=None, retry_after=None)"
)]
pub fn observation_cap(
    capacity: &Bound<'_, PyAny>,
    per_micro: &Bound<'_, PyAny>,
    unit: &Bound<'_, PyAny>,
    remaining: &Bound<'_, PyAny>,
    limit: Option<&Bound<'_, PyAny>>,
    reset_after: Option<&Bound<'_, PyAny>>,
    retry_after: Option<&Bound<'_, PyAny>>,
) -> PyResult<i128> {
    let words = Words::new(remaining, limit, reset_after, retry_after)?;
    // p units a µs at q * 10**6 units a token is p tokens per q seconds.
    let seconds = integer(unit, "unit")? / 1_000_000;
    let config = Config::new(
        integer(capacity, "capacity")?,
        Number::Int(integer(per_micro, "per_micro")?),
        Number::Int(seconds),
    )?;
    Ok(words.report(&config, 0).cap)
}

/// One decision for several, by the rule of `allow_all` (`registry::combine`):
/// what a Redis `*_all` answers; degraded if any of them is.
#[pyfunction]
pub fn combine(decisions: &Bound<'_, PyAny>) -> PyResult<Decision> {
    let decisions = decisions
        .try_iter()?
        .map(|item| {
            let item = item?;
            let decision = item.cast::<Decision>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "combine takes a sequence of Decision, got {}",
                    crate::py_types::type_name(&item)
                ))
            })?;
            Ok(decision.get().copy())
        })
        .collect::<PyResult<Vec<Decision>>>()?;
    if decisions.is_empty() {
        return Err(PyValueError::new_err(
            "combine takes at least one Decision, got none",
        ));
    }
    Ok(Decision::combined(&decisions))
}

/// Checks a cost as the limiter does (type, then value) and returns it.
#[pyfunction]
pub fn check_cost(cost: &Bound<'_, PyAny>, capacity: u64) -> PyResult<u64> {
    Ok(crate::rate::check_cost(integer(cost, "cost")?, capacity)?)
}

/// Checks a charge's cost as the limiter does (1 to 2**64 - 1) and returns it.
#[pyfunction]
pub fn check_charge(cost: &Bound<'_, PyAny>) -> PyResult<u64> {
    Ok(crate::rate::check_charge(integer(cost, "cost")?)?)
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
