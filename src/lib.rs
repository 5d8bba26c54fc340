//! bucketlimit's native core: an exact token-bucket limiter.
//!
//! `rate`, `bucket`, `registry`, `concurrency`, `combined`, `lease`, `clock`
//! and `error` are plain Rust with their own tests; `py`, `py_checks`,
//! `py_reserve`, `py_waits`, `py_concurrency`, `py_lease` and `py_types` (what
//! they share) are the thin `PyO3` layer, built with the `python` feature (on by
//! default; the Redis module in `module/` links the core without it); this file
//! registers the Python module.

pub mod bucket;
pub mod clock;
pub mod combined;
pub mod concurrency;
pub mod error;
pub mod lease;
#[cfg(feature = "python")]
mod py;
#[cfg(feature = "python")]
mod py_checks;
#[cfg(feature = "python")]
mod py_concurrency;
#[cfg(feature = "python")]
mod py_lease;
#[cfg(feature = "python")]
mod py_reserve;
#[cfg(feature = "python")]
mod py_types;
#[cfg(feature = "python")]
mod py_waits;
pub mod rate;
pub mod registry;

#[cfg(feature = "python")]
use pyo3::prelude::*;

#[cfg(feature = "python")]
#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust `log` records go to the Python logger "bucketlimit". Nothing is
    // logged per decision, so levels are looked up each time (no cache to
    // go stale when the application configures logging after import).
    // Installing fails only if this module's logger is already set; ignore.
    let _ = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::Nothing)?.install();
    clock::start_monotonic();
    m.add_class::<py_types::Decision>()?;
    m.add_class::<py_types::TokenBucketLimiter>()?;
    m.add_class::<py_reserve::Reservation>()?;
    m.add_class::<py_reserve::Acquiring>()?;
    m.add_class::<py_types::ConcurrencyLimiter>()?;
    m.add_class::<py_types::Permit>()?;
    m.add_class::<py_lease::Leases>()?;
    m.add_function(wrap_pyfunction!(py::allow_all, m)?)?;
    m.add_function(wrap_pyfunction!(py::reserve_all, m)?)?;
    m.add_function(wrap_pyfunction!(py::acquire_all, m)?)?;
    m.add_function(wrap_pyfunction!(py::acquire_all_async, m)?)?;
    m.add("MAX_DEBT_CAPACITIES", bucket::MAX_DEBT_CAPACITIES)?;
    // For the Python layer (Redis limiter): the same rules, not a copy.
    m.add_function(wrap_pyfunction!(py::exact_units, m)?)?;
    m.add_function(wrap_pyfunction!(py::observation_cap, m)?)?;
    m.add_function(wrap_pyfunction!(py::clock_to_micros, m)?)?;
    m.add_function(wrap_pyfunction!(py::check_key, m)?)?;
    m.add_function(wrap_pyfunction!(py::check_cost, m)?)?;
    m.add_function(wrap_pyfunction!(py::check_charge, m)?)?;
    m.add_function(wrap_pyfunction!(py::combine, m)?)?;
    m.add("MAX_KEY_BYTES", error::MAX_KEY_BYTES)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
