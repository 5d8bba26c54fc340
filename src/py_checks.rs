//! The checks of `allow_all`, `reserve_all`, `acquire_all` and
//! `acquire_all_async` (docs/design.md §2): parsed from Python, and read into
//! the core's checks (every clock read before any lock, §5), as are the
//! permits a waiting call holds. What a call does with them is the core's
//! (`registry`, `combined`).

use pyo3::exceptions::PyTypeError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::combined::Held;
use crate::concurrency::PermitCheck;
use crate::error::Error;
use crate::py_types::{
    integer, key_str, type_name, ConcurrencyLimiter, Key, Permit, TokenBucketLimiter,
};
use crate::registry::{self, Check};

/// A parsed check of a token bucket: `(limiter, key, cost)`.
pub type Parsed<'py> = (Bound<'py, TokenBucketLimiter>, Bound<'py, PyString>, i128);

/// A parsed check of a concurrency limiter: `(limiter, key)`, one permit.
pub type ParsedPermit<'py> = (Bound<'py, ConcurrencyLimiter>, Bound<'py, PyString>);

/// The checks of an `*_all` call: the token buckets', the permits', and for
/// each check in the order given whether it is a permit.
pub struct Checks<'py> {
    pub buckets: Vec<Parsed<'py>>,
    pub permits: Vec<ParsedPermit<'py>>,
    pub order: Vec<bool>,
}

/// [`Checks`] held past the call (by a coroutine).
pub struct OwnedChecks {
    buckets: Vec<(Py<TokenBucketLimiter>, Py<PyString>, i128)>,
    permits: Vec<(Py<ConcurrencyLimiter>, Py<PyString>)>,
    order: Vec<bool>,
}

/// The checks of `allow_all` and friends: `(limiter, key)` pairs with the
/// call's `cost`, or `(limiter, key, cost)` triples; a concurrency limiter's
/// check is one permit (`(conc, key)` or `(conc, key, 1)`).
pub fn parse_checks<'py>(
    checks: &Bound<'py, PyAny>,
    cost: i128,
    what: &str,
) -> PyResult<Checks<'py>> {
    let mut parsed = Checks {
        buckets: Vec::new(),
        permits: Vec::new(),
        order: Vec::new(),
    };
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
            2 => None,
            3 => Some(integer(&tuple.get_item(2)?, "cost")?),
            _ => return Err(not_a_check()),
        };
        let limiter = tuple.get_item(0)?;
        let key = tuple.get_item(1)?;
        let key = Key::extract(key.as_borrowed())?.0.to_owned();
        if let Ok(conc) = limiter.cast::<ConcurrencyLimiter>() {
            if let Some(n) = own_cost.filter(|&n| n != 1) {
                return Err(Error::Permits(n.to_string()).into());
            }
            parsed.permits.push((conc.clone(), key));
            parsed.order.push(true);
            continue;
        }
        let limiter = limiter.cast_into::<TokenBucketLimiter>().map_err(|e| {
            PyTypeError::new_err(format!(
                "{what} takes TokenBucketLimiter or ConcurrencyLimiter instances here, got {}",
                type_name(e.into_inner().as_any())
            ))
        })?;
        parsed
            .buckets
            .push((limiter, key, own_cost.unwrap_or(cost)));
        parsed.order.push(false);
    }
    Ok(parsed)
}

impl Checks<'_> {
    pub fn owned(&self) -> OwnedChecks {
        OwnedChecks {
            buckets: self
                .buckets
                .iter()
                .map(|(l, k, c)| (l.clone().unbind(), k.clone().unbind(), *c))
                .collect(),
            permits: self
                .permits
                .iter()
                .map(|(l, k)| (l.clone().unbind(), k.clone().unbind()))
                .collect(),
            order: self.order.clone(),
        }
    }

    /// The clock of the first check: a call's timeout counts on it, and its
    /// waits sleep with it (docs/design.md §2). Needs a check.
    pub fn first_clock(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let clock = if self.order[0] {
            self.permits[0].0.get().clock.as_ref()
        } else {
            self.buckets[0].0.get().clock()
        };
        clock.map(|c| c.clone_ref(py))
    }
}

impl OwnedChecks {
    pub fn bind<'py>(&self, py: Python<'py>) -> Checks<'py> {
        Checks {
            buckets: self
                .buckets
                .iter()
                .map(|(l, k, c)| (l.bind(py).clone(), k.bind(py).clone(), *c))
                .collect(),
            permits: self
                .permits
                .iter()
                .map(|(l, k)| (l.bind(py).clone(), k.bind(py).clone()))
                .collect(),
            order: self.order.clone(),
        }
    }

    pub fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (limiter, _, _) in &self.buckets {
            visit.call(limiter)?;
        }
        for (limiter, _) in &self.permits {
            visit.call(limiter)?;
        }
        Ok(())
    }
}

/// The core's checks of token buckets, each with its clock's reading (every
/// clock is read before any lock), and whether any limiter is a degraded
/// fallback.
pub fn bucket_checks<'a>(
    py: Python<'_>,
    parsed: &'a [Parsed<'_>],
) -> PyResult<(Vec<Check<'a>>, bool)> {
    let mut checks = Vec::with_capacity(parsed.len());
    let mut degraded = false;
    for (limiter, key, cost) in parsed {
        let this = limiter.get();
        degraded |= this.degraded();
        checks.push(Check {
            registry: &this.registry,
            key: key_str(key)?,
            cost: *cost,
            now: this.now(py)?,
        });
    }
    Ok((checks, degraded))
}

/// The core's checks of permits, each with its clock's reading.
pub fn permit_checks<'a>(
    py: Python<'_>,
    parsed: &'a [ParsedPermit<'_>],
) -> PyResult<Vec<PermitCheck<'a>>> {
    parsed
        .iter()
        .map(|(limiter, key)| {
            let this = limiter.get();
            let now = this.now(py)?;
            Ok(PermitCheck {
                limiter: &this.core,
                key: key_str(key)?,
                now,
            })
        })
        .collect()
}

/// The core's view of the permits a waiting call holds, each with its
/// clock's reading (read quietly: a clock that raises now only leaves a
/// permit unrenewed).
pub fn held_permits<'a>(py: Python<'a>, held: &'a [Py<Permit>]) -> PyResult<Vec<Held<'a>>> {
    held.iter()
        .map(|permit| {
            let permit = permit.get();
            let limiter = permit.limiter.get();
            Ok(Held {
                limiter: &limiter.core,
                key: key_str(permit.key.bind(py))?,
                token: permit.token,
                decision: permit.decision,
                now: limiter.now(py).unwrap_or(i64::MIN),
            })
        })
        .collect()
}

/// Checks token-bucket checks (keys, costs, duplicates) as `reserve_all`
/// does, without reading a clock or locking: a call that waits for permits
/// first rejects bad input before it takes any.
pub fn check_buckets(parsed: &[Parsed<'_>]) -> PyResult<()> {
    if parsed.is_empty() {
        return Ok(());
    }
    let checks = parsed
        .iter()
        .map(|(limiter, key, cost)| {
            Ok(Check {
                registry: &limiter.get().registry,
                key: key_str(key)?,
                cost: *cost,
                now: 0,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(registry::check_all(&checks)?)
}
