//! Baselines for bucketlimit's benchmarks, built exactly like bucketlimit
//! (PyO3 0.30, fat LTO, one codegen unit):
//!
//! - `Floor.allow(key, cost=1)`: the same signature and argument extraction
//!   as `bucketlimit.TokenBucketLimiter.allow`, returning the same six-field
//!   frozen `Decision`, and doing nothing else. No limiter can be faster
//!   through PyO3's calling convention; every ratio is taken against it.
//! - `NaiveLimiter.allow(key, cost=1)`: the first thing anyone would write,
//!   a `std::sync::Mutex<HashMap<String, _>>` float token bucket (SipHash, an
//!   owned `String` per key), so "better than the naive Rust map" is measured
//!   in the same run rather than quoted.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// The same fields and flags as `bucketlimit._core.Decision` (no freelist
/// either: allocated the same way).
#[pyclass(frozen, module = "bucketlimit_floor")]
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

#[pymethods]
impl Decision {
    fn __bool__(&self) -> bool {
        self.allowed
    }
}

/// Borrows a key as UTF-8, as bucketlimit's binding does.
fn key_str<'a>(key: &'a Bound<'_, PyString>) -> PyResult<&'a str> {
    key.to_str()
        .map_err(|e| PyValueError::new_err(format!("key is not encodable as UTF-8: {e}")))
}

/// Does no work but extract the arguments and build the result.
#[pyclass(frozen, module = "bucketlimit_floor")]
pub struct Floor {}

#[pymethods]
impl Floor {
    #[new]
    fn new() -> Floor {
        Floor {}
    }

    #[pyo3(signature = (key, cost = 1))]
    fn allow(&self, key: &Bound<'_, PyString>, cost: i64) -> PyResult<Decision> {
        let key = key_str(key)?;
        Ok(Decision {
            allowed: true,
            retry_after: 0.0,
            remaining: key.len() as u64,
            reset_after: 0.0,
            limit: cost as u64,
            degraded: false,
        })
    }
}

struct NaiveBucket {
    tokens: f64,
    last: Instant,
}

/// A float token bucket per key behind one `std` mutex. Never forgets a key.
#[pyclass(frozen, module = "bucketlimit_floor")]
pub struct NaiveLimiter {
    capacity: f64,
    rate: f64,
    buckets: Mutex<HashMap<String, NaiveBucket>>,
}

#[pymethods]
impl NaiveLimiter {
    #[new]
    fn new(capacity: u64, rate: f64) -> NaiveLimiter {
        NaiveLimiter {
            capacity: capacity as f64,
            rate,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    #[pyo3(signature = (key, cost = 1))]
    fn allow(&self, key: &Bound<'_, PyString>, cost: i64) -> PyResult<Decision> {
        let key = key_str(key)?;
        let cost = cost as f64;
        let now = Instant::now();
        let mut buckets = self.buckets.lock().expect("no panics under this lock");
        let bucket = match buckets.get_mut(key) {
            Some(bucket) => bucket,
            None => buckets.entry(key.to_owned()).or_insert(NaiveBucket {
                tokens: self.capacity,
                last: now,
            }),
        };
        let elapsed = now.saturating_duration_since(bucket.last).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.rate).min(self.capacity);
        bucket.last = now;
        let allowed = bucket.tokens >= cost;
        if allowed {
            bucket.tokens -= cost;
        }
        let wait = |need: f64| {
            if need <= 0.0 {
                0.0
            } else {
                need / self.rate
            }
        };
        Ok(Decision {
            allowed,
            retry_after: if allowed {
                0.0
            } else {
                wait(cost - bucket.tokens)
            },
            remaining: bucket.tokens as u64,
            reset_after: wait(self.capacity - bucket.tokens),
            limit: self.capacity as u64,
            degraded: false,
        })
    }

    fn __len__(&self) -> usize {
        self.buckets
            .lock()
            .expect("no panics under this lock")
            .len()
    }
}

#[pymodule(gil_used = false)]
fn bucketlimit_floor(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Decision>()?;
    m.add_class::<Floor>()?;
    m.add_class::<NaiveLimiter>()?;
    Ok(())
}
