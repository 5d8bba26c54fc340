//! The binding of concurrency permits (docs/design.md §2, "Concurrency"):
//! `ConcurrencyLimiter`'s and `Permit`'s methods. Types are checked here;
//! the rules are `concurrency.rs`'s, waiting is `py_waits.rs`'s, and the
//! coroutine of `acquire_async` is `py_reserve.rs`'s `Acquiring`.

use pyo3::exceptions::PyStopIteration;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyString};
use pyo3::PyTraverseError;

use crate::concurrency::{self, Config};
use crate::error::check_key;
use crate::py_reserve::{Acquiring, Goal};
use crate::py_types::{
    clock_arg, integer, key_str, max_keys_arg, max_wait, number, repr, ConcurrencyLimiter,
    Decision, Key, Permit,
};
use crate::py_waits::{wait_sync, Waits};
use crate::rate::Number;

/// The `ttl` argument: seconds, an int or float (never a bool).
pub struct Ttl(Number);

impl<'a, 'py> FromPyObject<'a, 'py> for Ttl {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Ttl> {
        number(&obj, "ttl").map(Ttl)
    }
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
    ) -> PyResult<Acquiring> {
        let py = slf.py();
        let timeout = max_wait(timeout, "timeout")?;
        let key = key.0.to_owned();
        check_key(key_str(&key)?)?;
        let permits = [(slf.clone(), key)];
        let waits = Waits::new(py, &permits, slf.get().clock.as_ref(), timeout)?;
        Ok(Acquiring::queued(waits, Goal::Permit))
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
