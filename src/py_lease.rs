//! The binding of `lease::Ledger`: `Leases`, the in-process half of a Redis
//! limiter's leases (`bucketlimit._redis.leases` drives it). Its `take` is the
//! leased `allow()`'s whole fast path, one native call; the rest is called on
//! the slow path, around a round trip.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pyo3::PyTraverseError;

use crate::bucket;
use crate::clock;
use crate::lease::{Begin, Lease, Ledger, Take};
use crate::py_types::{clock_micros, integer, Cost, Decision, Key};

/// The leases one Redis limiter holds in this process (docs/design.md §6, "Hot
/// keys: leases"), on its clock: the built-in monotonic clock, or the one given.
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct Leases {
    ledger: Ledger,
    clock: Option<Py<PyAny>>,
    capacity: u64,
}

impl Leases {
    /// Reads the clock, always before the ledger's lock is taken.
    #[inline(always)]
    fn now(&self, py: Python<'_>) -> PyResult<i64> {
        match &self.clock {
            None => Ok(clock::monotonic_micros()),
            Some(clock) => clock_micros(&clock.bind(py).call0()?),
        }
    }

    fn decision(&self, take: Take) -> Option<Decision> {
        let (allowed, wait, remaining, reset_after) = match take {
            Take::Hit {
                remaining,
                reset_after,
            } => (true, 0, remaining, reset_after),
            Take::Waiting { wait, reset_after } => (false, wait, 0, reset_after),
            Take::Miss => return None,
        };
        let reset_after = (reset_after != u64::MAX).then_some(u128::from(reset_after));
        Some(Decision::of(
            bucket::Decision {
                allowed,
                retry_after: Some(u128::from(wait)),
                remaining,
                reset_after,
                limit: self.capacity,
            },
            false,
        ))
    }
}

/// A cost the lease may answer: 1 to the capacity (anything else goes to the
/// slow path, which raises the core's error).
#[inline]
fn leasable(cost: &Cost, capacity: u64) -> Option<u64> {
    u64::try_from(cost.0)
        .ok()
        .filter(|&c| c >= 1 && c <= capacity)
}

#[pymethods]
impl Leases {
    #[new]
    #[pyo3(signature = (capacity, clock = None), text_signature = "(capacity, clock=None)")]
    fn new(capacity: &Bound<'_, PyAny>, clock: Option<Bound<'_, PyAny>>) -> PyResult<Leases> {
        let capacity = integer(capacity, "capacity")?;
        let capacity = u64::try_from(capacity)
            .ok()
            .filter(|&c| c >= 1)
            .ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "capacity must be an int from 1 to 2**64 - 1, got {capacity}"
                ))
            })?;
        Ok(Leases {
            ledger: Ledger::new(),
            clock: clock.map(Bound::unbind),
            capacity,
        })
    }

    /// The lease's answer to `allow(key, cost)`: allowed (spent from it),
    /// refused while it waits its turn, or `None` when no lease answers.
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn take(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<Option<Decision>> {
        let Some(cost) = leasable(&cost, self.capacity) else {
            return Ok(None);
        };
        let Ok(key) = key.as_str() else {
            return Ok(None);
        };
        let now = self.now(py)?;
        Ok(self.decision(self.ledger.take(key, cost, now)))
    }

    /// What `take` would answer now, changing nothing: `peek` on a leasing limiter.
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn peek(&self, py: Python<'_>, key: Key<'_, '_>, cost: Cost) -> PyResult<Option<Decision>> {
        let Some(cost) = leasable(&cost, self.capacity) else {
            return Ok(None);
        };
        let Ok(key) = key.as_str() else {
            return Ok(None);
        };
        let now = self.now(py)?;
        Ok(self.decision(self.ledger.peek(key, cost, now)))
    }

    /// After `take` answered `None`: a `Decision` (a lease answers after all),
    /// `None` (another caller renews this key: ask the shared bucket), or
    /// `(unused, asked, elapsed, holders)` to renew (`elapsed` is -1 for a key
    /// without a lease yet); see `lease::Begin`.
    fn begin<'py>(
        &self,
        py: Python<'py>,
        key: Key<'_, 'py>,
        cost: Cost,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let cost = leasable(&cost, self.capacity).unwrap_or(1);
        let now = self.now(py)?;
        Ok(match self.ledger.begin(key.as_str()?, cost, now) {
            Begin::Answered(take) => self
                .decision(take)
                .map(|d| Bound::new(py, d))
                .transpose()?
                .map(Bound::into_any),
            Begin::Busy => None,
            Begin::Renew {
                unused,
                asked,
                elapsed,
                holders,
            } => Some(
                PyTuple::new(
                    py,
                    [
                        unused.into_pyobject(py)?.into_any(),
                        asked.into_pyobject(py)?.into_any(),
                        elapsed.unwrap_or(-1).into_pyobject(py)?.into_any(),
                        holders.into_pyobject(py)?.into_any(),
                    ],
                )?
                .into_any(),
            ),
        })
    }

    /// The store granted a lease: `tokens` usable from `start` until `deadline`
    /// (µs of this object's clock); the bucket full at `reset_at`.
    #[pyo3(signature = (key, tokens, start, deadline, reset_at, holders))]
    fn grant(
        &self,
        key: Key<'_, '_>,
        tokens: u64,
        start: i64,
        deadline: i64,
        reset_at: i64,
        holders: u32,
    ) -> PyResult<()> {
        let lease = Lease {
            tokens,
            start,
            deadline,
            reset_at,
        };
        self.ledger.grant(key.as_str()?, lease, holders);
        Ok(())
    }

    /// Counts `cost` tokens asked of `key` that no lease answered.
    fn ask(&self, key: Key<'_, '_>, cost: u64) -> PyResult<()> {
        self.ledger.ask(key.as_str()?, cost);
        Ok(())
    }

    /// The key's renewal or give-back ended without a lease.
    fn end(&self, key: Key<'_, '_>) -> PyResult<()> {
        self.ledger.end(key.as_str()?);
        Ok(())
    }

    /// Up to `most` `(key, unused)` leases past their deadline, taken out to be
    /// given back; keys idle `idle` µs are forgotten.
    fn due(&self, py: Python<'_>, most: usize, idle: i64) -> PyResult<Vec<(String, u64)>> {
        let now = self.now(py)?;
        Ok(self.ledger.due(now, most, idle))
    }

    /// Every `(key, unused)` lease holding tokens or recorded in the store (a
    /// spent one: unused 0), taken out to be given back.
    fn drain(&self) -> Vec<(String, u64)> {
        self.ledger.drain()
    }

    /// Forgets every lease and count (a forked child).
    fn clear(&self) {
        self.ledger.clear();
    }

    /// This object's clock, in µs.
    #[pyo3(name = "now")]
    fn now_micros(&self, py: Python<'_>) -> PyResult<i64> {
        self.now(py)
    }

    /// Calls answered from a lease.
    #[getter]
    fn hits(&self) -> u64 {
        self.ledger.counts().0
    }

    /// Calls refused while a lease waited its turn.
    #[getter]
    fn waits(&self) -> u64 {
        self.ledger.counts().1
    }

    fn __len__(&self) -> usize {
        self.ledger.len()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(clock) = &self.clock {
            visit.call(clock)?;
        }
        Ok(())
    }
}
