//! The binding of reservations (docs/design.md §2): `Reservation`, the
//! checks of `allow_all` / `reserve_all` / `acquire_all`, waiting on the
//! limiter's clock, and `Acquiring`, the coroutine of `acquire_async`.
//! Types are checked here; the arithmetic is `bucket.rs` and `registry.rs`.
//! A reservation may also hold concurrency permits (`py_concurrency.rs`
//! takes them): its `cancel` and `settle` release them.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyFloat, PyList, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::bucket::{self, Line, Reserved, Wait};
use crate::clock;
use crate::error::Error;
use crate::py_types::{
    integer, key_str, read_clock, repr, seconds, type_name, ConcurrencyLimiter, Decision, Key,
    Permit, TokenBucketLimiter,
};
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
    pub buckets: Vec<(Py<TokenBucketLimiter>, Py<PyString>, i128)>,
    pub permits: Vec<(Py<ConcurrencyLimiter>, Py<PyString>)>,
    pub order: Vec<bool>,
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

/// Tokens of one bucket of a reservation.
pub struct Tokens {
    limiter: Py<TokenBucketLimiter>,
    key: Py<PyString>,
    cost: u64,
    /// Where this reservation left the bucket's cap line, when it waited.
    line: Option<Line>,
}

/// One check of a reservation.
enum Part {
    Tokens(Tokens),
    /// A concurrency permit: released by `cancel` and `settle`.
    Permit(Py<Permit>),
}

impl Part {
    fn key(&self, py: Python<'_>) -> Py<PyString> {
        match self {
            Part::Tokens(t) => t.key.clone_ref(py),
            Part::Permit(p) => p.get().key.clone_ref(py),
        }
    }

    fn cost(&self) -> u64 {
        match self {
            Part::Tokens(t) => t.cost,
            Part::Permit(_) => 1,
        }
    }

    fn limiter(&self, py: Python<'_>) -> Py<PyAny> {
        match self {
            Part::Tokens(t) => t.limiter.clone_ref(py).into_any(),
            Part::Permit(p) => p.get().limiter.clone_ref(py).into_any(),
        }
    }

    fn clock(&self) -> Option<&Py<PyAny>> {
        match self {
            Part::Tokens(t) => t.limiter.get().clock(),
            Part::Permit(p) => p.get().limiter.get().clock.as_ref(),
        }
    }

    /// Gives it back: `cost` tokens (capped as §4 says), or the permit.
    fn give_back(&self, py: Python<'_>, cost: u64) -> PyResult<()> {
        match self {
            Part::Tokens(t) => refund(py, t, cost),
            Part::Permit(p) => p.get().release(py),
        }
    }
}

/// Tokens taken from one or more buckets, to use after `delay` seconds, and
/// the permits of any concurrency limiters among its checks.
#[pyclass(frozen, module = "bucketlimit._core")]
pub struct Reservation {
    /// Every check, in the order given.
    parts: Vec<Part>,
    delay: Wait,
    /// The first check's clock when it was made, in µs: `wait` sleeps until
    /// `made + delay` on that clock.
    made: i64,
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

    pub fn is_granted(&self, py: Python<'_>) -> bool {
        self.granted(py)
    }

    /// Its delay, as made (all of it is left when it was made just now).
    pub fn delay_left(&self) -> Wait {
        self.delay
    }

    /// `cancel` on a path that must not fail (an error already on its way).
    pub fn cancel_quietly(&self, py: Python<'_>) {
        let _ = self.cancel(py);
    }

    /// What is left of the wait now, on the first check's clock: 0 once
    /// the tokens are there (and for a refusal, which holds nothing).
    fn left(&self, py: Python<'_>) -> PyResult<Wait> {
        if !self.granted(py) || self.delay == Some(0) {
            return Ok(Some(0));
        }
        let now = read_clock(py, self.parts[0].clock())?;
        let elapsed = u128::try_from(i128::from(now) - i128::from(self.made)).unwrap_or(0);
        Ok(self.delay.map(|delay| delay.saturating_sub(elapsed)))
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

    /// The tokens reserved (of the first check, for `reserve_all`; 1 for a permit).
    #[getter]
    fn cost(&self) -> u64 {
        self.parts[0].cost()
    }

    /// The key (of the first check, for `reserve_all`).
    #[getter]
    fn key(&self, py: Python<'_>) -> Py<PyString> {
        self.parts[0].key(py)
    }

    /// Every check of the reservation: `(limiter, key, cost)`, a permit's cost 1.
    #[getter]
    fn checks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items = self
            .parts
            .iter()
            .map(|p| (p.limiter(py), p.key(py), p.cost()))
            .collect::<Vec<_>>();
        PyTuple::new(py, items)
    }

    /// The permits a granted reservation holds, in the order of its checks
    /// (their fencing tokens); empty for a refusal.
    #[getter]
    fn permits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let held = self
            .parts
            .iter()
            .filter_map(|p| match p {
                Part::Permit(permit) if self.granted(py) => Some(permit.clone_ref(py)),
                _ => None,
            })
            .collect::<Vec<_>>();
        PyTuple::new(py, held)
    }

    #[getter]
    fn decision(&self, py: Python<'_>) -> Py<Decision> {
        self.decision.clone_ref(py)
    }

    fn __bool__(&self, py: Python<'_>) -> bool {
        self.granted(py)
    }

    /// Blocks until the tokens are the caller's (`delay` after the reservation
    /// was made, on its limiter's clock; the sleep releases the GIL) and
    /// returns `decision`; at once for a refusal. An exception while waiting
    /// (`KeyboardInterrupt`) cancels it before it propagates.
    fn wait(slf: &Bound<'_, Self>) -> PyResult<Py<Decision>> {
        let py = slf.py();
        let this = slf.get();
        sleep_for(py, this, this.left(py)?)?;
        Ok(this.decision.clone_ref(py))
    }

    /// `wait` for asyncio: a coroutine answering `decision`; cancelled while
    /// it sleeps, it cancels the reservation (the tokens go back).
    fn wait_async(slf: &Bound<'_, Self>) -> Acquiring {
        Acquiring::new(Request::Held(slf.clone().unbind()))
    }

    /// Gives every token back (capped at capacity); later waits do not move,
    /// and what a reservation still waiting behind this one would have to
    /// share is not given back (docs/design.md §4, "Giving back"). Releases
    /// its permits. Once: a second call, or one after `settle`, does nothing.
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        if self.settled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        for part in &self.parts {
            part.give_back(py, part.cost())?;
        }
        Ok(())
    }

    /// The actual use: gives back `cost - used` when less, charges `used -
    /// cost` more when more (debt allowed); releases its permits (a permit's
    /// `used` is checked, and otherwise ignored). Once; nothing for a refusal.
    fn settle(&self, py: Python<'_>, used: &Bound<'_, PyAny>) -> PyResult<()> {
        let used = self.used_per_part(used)?;
        // Every overage is checked before anything acts: a rejected settle
        // changes nothing, and the reservation can still be settled or cancelled.
        for (part, used) in self.parts.iter().zip(&used) {
            if let Part::Tokens(tokens) = part {
                if *used > i128::from(tokens.cost) {
                    crate::rate::check_charge(used - i128::from(tokens.cost))?;
                }
            }
        }
        if self.settled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        for (part, used) in self.parts.iter().zip(used) {
            let Part::Tokens(tokens) = part else {
                part.give_back(py, 1)?;
                continue;
            };
            let cost = i128::from(tokens.cost);
            if used < cost {
                refund(py, tokens, (cost - used) as u64)?;
            } else if used > cost {
                let limiter = tokens.limiter.get();
                let now = limiter.now(py)?;
                let key = tokens.key.bind(py).to_str()?;
                limiter.registry.charge(key, used - cost, now)?;
            }
        }
        Ok(())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let permits = self
            .parts
            .iter()
            .filter(|p| matches!(p, Part::Permit(_)))
            .count();
        let buckets = self.parts.len() - permits;
        format!(
            "Reservation(key={}, cost={}, delay={}, granted={}, buckets={buckets}{})",
            repr(self.parts[0].key(py).bind(py).as_any()),
            self.parts[0].cost(),
            repr(PyFloat::new(py, seconds(self.delay)).as_any()),
            if self.granted(py) { "True" } else { "False" },
            if permits > 0 {
                format!(", permits={permits}")
            } else {
                String::new()
            }
        )
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for part in &self.parts {
            match part {
                Part::Tokens(t) => visit.call(&t.limiter)?,
                Part::Permit(p) => visit.call(p)?,
            }
        }
        Ok(())
    }
}

fn refund(py: Python<'_>, part: &Tokens, cost: u64) -> PyResult<()> {
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
    made: i64,
    degraded: bool,
) -> PyResult<Reservation> {
    let granted = reserved.decision.allowed;
    Ok(Reservation {
        parts,
        delay: reserved.delay,
        made,
        decision: Py::new(py, Decision::of(reserved.decision, degraded))?,
        settled: AtomicBool::new(!granted),
    })
}

/// The token part of a call with permits, as the core answered it.
pub struct TokenPart {
    pub reserved: Reserved,
    pub tokens: Vec<Tokens>,
    pub degraded: bool,
    /// The first bucket's clock when it was made.
    pub made: i64,
}

/// A reservation over a call's checks: its token part (`None` when none was
/// reserved: no token bucket, or a refusal by a permit first) and one permit
/// per concurrency check (granted, or unheld for a refusal), in the order of
/// the checks. Its decision combines every check's by the rule of
/// `allow_all` (docs/design.md §2).
pub fn with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    tokens: Option<TokenPart>,
    permits: Vec<Py<Permit>>,
    made: i64,
) -> PyResult<Reservation> {
    let mut decisions: Vec<bucket::Decision> = Vec::with_capacity(permits.len() + 1);
    let (delay, degraded, mut buckets) = match tokens {
        Some(part) => {
            decisions.push(part.reserved.decision);
            (part.reserved.delay, part.degraded, part.tokens)
        }
        // Nothing reserved: the buckets are named, never given back to.
        None => (
            Some(0),
            false,
            tokens_of(&checks.buckets, vec![None; checks.buckets.len()]),
        ),
    };
    decisions.extend(permits.iter().map(|p| p.get().decision));
    let mut decision = registry::combine(&decisions);
    // Granted only if every part was; a permit not held refuses the call.
    decision.allowed =
        decisions.iter().all(|d| d.allowed) && permits.iter().all(|p| p.get().granted());
    // A refusal's delay: the longest wait it knows of (a permit's: until a
    // slot is sure to be free, docs/design.md §4 "Permits").
    let delay = if decision.allowed {
        delay
    } else {
        decisions
            .iter()
            .filter(|d| !d.allowed)
            .map(|d| d.retry_after)
            .fold(delay, |a, b| Some(a?.max(b?)))
    };
    buckets.reverse();
    let mut permits = permits.into_iter();
    let parts = checks
        .order
        .iter()
        .map(|&is_permit| {
            if is_permit {
                Part::Permit(permits.next().expect("one permit per concurrency check"))
            } else {
                Part::Tokens(buckets.pop().expect("one part per token bucket check"))
            }
        })
        .collect();
    reservation(py, parts, Reserved { decision, delay }, made, degraded)
}

/// Checks token-bucket checks (keys, costs, duplicates) as `reserve_all`
/// does, without reading a clock or locking: a call that waits for permits
/// first rejects bad input before it takes any.
pub fn check_buckets(parsed: &[Parsed<'_>]) -> PyResult<()> {
    if parsed.is_empty() {
        return Ok(());
    }
    let keys = parsed
        .iter()
        .map(|(_, key, _)| key_str(key))
        .collect::<PyResult<Vec<_>>>()?;
    let checks: Vec<Check<'_>> = parsed
        .iter()
        .zip(&keys)
        .map(|((limiter, _, cost), key)| Check {
            registry: &limiter.get().registry,
            key,
            cost: *cost,
            now: 0,
        })
        .collect();
    Ok(registry::check_all(&checks)?)
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
    let part = Part::Tokens(Tokens {
        limiter: limiter.clone().unbind(),
        key: key.clone().unbind(),
        // A granted cost passed the cost rule: it is in 1..=capacity.
        cost: u64::try_from(cost).unwrap_or(0),
        line,
    });
    reservation(py, vec![part], reserved, now, this.degraded())
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

/// A token-bucket check with its clock's reading.
type Resolved<'a> = (&'a TokenBucketLimiter, &'a str, i128, i64);

/// The clock readings of token-bucket checks (every clock is read before any
/// lock), and whether any limiter is a degraded fallback.
fn read_checks<'a>(
    py: Python<'_>,
    parsed: &'a [Parsed<'_>],
) -> PyResult<(Vec<Resolved<'a>>, bool)> {
    let mut resolved = Vec::with_capacity(parsed.len());
    let mut degraded = false;
    for (limiter, key, cost) in parsed {
        let this = limiter.get();
        degraded |= this.degraded();
        resolved.push((this, key_str(key)?, *cost, this.now(py)?));
    }
    Ok((resolved, degraded))
}

fn core_checks<'a>(resolved: &[Resolved<'a>]) -> Vec<Check<'a>> {
    resolved
        .iter()
        .map(|&(limiter, key, cost, now)| Check {
            registry: &limiter.registry,
            key,
            cost,
            now,
        })
        .collect()
}

fn tokens_of(parsed: &[Parsed<'_>], lines: Vec<Option<Line>>) -> Vec<Tokens> {
    parsed
        .iter()
        .zip(lines)
        .map(|((limiter, key, cost), line)| Tokens {
            limiter: limiter.clone().unbind(),
            key: key.clone().unbind(),
            cost: u64::try_from(*cost).unwrap_or(0),
            line,
        })
        .collect()
}

/// `reserve_all` over parsed checks: every clock is read before any lock.
pub fn reserve_checks(
    py: Python<'_>,
    parsed: &[Parsed<'_>],
    max_wait: Wait,
) -> PyResult<Reservation> {
    let (resolved, degraded) = read_checks(py, parsed)?;
    let (reserved, lines) = registry::reserve_all(&core_checks(&resolved), max_wait)?;
    let parts = tokens_of(parsed, lines)
        .into_iter()
        .map(Part::Tokens)
        .collect();
    let made = resolved.first().map_or(0, |&(_, _, _, now)| now);
    reservation(py, parts, reserved, made, degraded)
}

/// The token part of a call with permits, all or nothing with them: `gate`
/// takes the permits under the tables' locks (`registry::reserve_all_gated`).
/// Every clock is read before any lock.
///
/// # Errors
/// A bad key or cost, a duplicate check; nothing changes then.
pub fn reserve_tokens_gated(
    py: Python<'_>,
    parsed: &[Parsed<'_>],
    max_wait: Wait,
    gate: impl FnOnce(bool, Wait) -> bool,
) -> PyResult<TokenPart> {
    let (resolved, degraded) = read_checks(py, parsed)?;
    let (reserved, lines) = registry::reserve_all_gated(&core_checks(&resolved), max_wait, gate)?;
    Ok(TokenPart {
        reserved,
        tokens: tokens_of(parsed, lines),
        degraded,
        made: resolved.first().map_or(0, |&(_, _, _, now)| now),
    })
}

/// A clock's own `sleep` / `sleep_async`, when it has one (a `ManualClock`
/// advances itself).
pub fn clock_sleeper<'py>(
    py: Python<'py>,
    clock: Option<&Py<PyAny>>,
    r#async: bool,
) -> Option<Bound<'py, PyAny>> {
    let name = if r#async { "sleep_async" } else { "sleep" };
    let sleep = clock?.bind(py).getattr(name).ok()?;
    sleep.is_callable().then_some(sleep)
}

/// What a limiter waits with: its clock's `sleep` / `sleep_async` when the
/// clock has one, else `time.sleep` / `asyncio.sleep`.
pub fn sleeper<'py>(
    py: Python<'py>,
    clock: Option<&Py<PyAny>>,
    r#async: bool,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(sleep) = clock_sleeper(py, clock, r#async) {
        return Ok(sleep);
    }
    let cell = if r#async { &ASYNCIO_SLEEP } else { &TIME_SLEEP };
    let module = if r#async { "asyncio" } else { "time" };
    Ok(cell.import(py, module, "sleep")?.clone())
}

/// Blocks until a granted reservation's tokens are there (the sleep releases
/// the GIL); an exception while waiting cancels it before it propagates.
pub fn wait(py: Python<'_>, reservation: &Reservation) -> PyResult<Py<Decision>> {
    sleep_for(py, reservation, reservation.delay)?;
    Ok(reservation.decision.clone_ref(py))
}

/// Sleeps `left` on the reservation's first limiter's clock (nothing when 0);
/// an exception while sleeping cancels the reservation before it propagates.
fn sleep_for(py: Python<'_>, reservation: &Reservation, left: Wait) -> PyResult<()> {
    if reservation.granted(py) && left != Some(0) {
        let clock = reservation.parts[0].clock();
        let slept = sleeper(py, clock, false).and_then(|sleep| sleep.call1((seconds(left),)));
        if let Err(error) = slept {
            reservation.cancel(py)?;
            return Err(error);
        }
    }
    Ok(())
}

/// `limiter.acquire_async(key, cost, timeout=...)`: the key and cost are
/// checked now, the tokens taken when awaited.
pub fn acquiring(
    limiter: &Bound<'_, TokenBucketLimiter>,
    key: &Bound<'_, PyString>,
    cost: i128,
    timeout: Option<&Bound<'_, PyAny>>,
) -> PyResult<Acquiring> {
    let max_wait = max_wait(timeout, "timeout")?;
    crate::error::check_key(key_str(key)?)?;
    limiter.get().config().check_cost(cost)?;
    Ok(Acquiring::new(Request::One {
        limiter: limiter.clone().unbind(),
        key: key.clone().unbind(),
        cost,
        max_wait,
    }))
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
    /// A reservation already made (`Reservation.wait_async`): nothing to take.
    Held(Py<Reservation>),
}

impl Request {
    /// The reservation, and what is left of its wait.
    fn reserve(&self, py: Python<'_>) -> PyResult<(Py<Reservation>, Wait)> {
        let made = match self {
            Request::One {
                limiter,
                key,
                cost,
                max_wait,
            } => reserve_one(py, limiter.bind(py), key.bind(py), *cost, *max_wait)?,
            Request::All { checks, max_wait } => {
                let parsed = checks
                    .iter()
                    .map(|(l, k, c)| (l.bind(py).clone(), k.bind(py).clone(), *c))
                    .collect::<Vec<_>>();
                reserve_checks(py, &parsed, *max_wait)?
            }
            Request::Held(reservation) => {
                let left = reservation.get().left(py)?;
                return Ok((reservation.clone_ref(py), left));
            }
        };
        // Made just now: all of its delay is left.
        let left = if made.granted(py) {
            made.delay
        } else {
            Some(0)
        };
        Ok((Py::new(py, made)?, left))
    }
}

/// The iterator of an asyncio sleep of `left` on `clock` (its `sleep_async`,
/// else `asyncio.sleep`), to forward as `yield from` would.
pub fn start_sleep(py: Python<'_>, clock: Option<&Py<PyAny>>, left: Wait) -> PyResult<Py<PyAny>> {
    let sleep = sleeper(py, clock, true)?.call1((seconds(left),))?;
    Ok(sleep.call_method0("__await__")?.unbind())
}

/// What became of a value sent (or an error thrown) into an awaited iterator.
pub enum Forwarded {
    /// It yielded this to the event loop: yield it on.
    Yielded(Py<PyAny>),
    /// It is done (`StopIteration`).
    Finished,
    Failed(PyErr),
}

/// One step of `yield from awaiting`: `send(value)`, or `throw(thrown)`.
pub fn forward(
    py: Python<'_>,
    awaiting: &Py<PyAny>,
    value: Py<PyAny>,
    thrown: Option<PyErr>,
) -> Forwarded {
    let bound = awaiting.bind(py);
    let answer = match thrown {
        None => bound.call_method1("send", (value,)),
        Some(error) => bound.call_method1("throw", (error.into_value(py),)),
    };
    match answer {
        Ok(yielded) => Forwarded::Yielded(yielded.unbind()),
        Err(error) if error.is_instance_of::<PyStopIteration>(py) => Forwarded::Finished,
        Err(error) => Forwarded::Failed(error),
    }
}

/// `throw(type, value, traceback)` arguments as one error, as a generator
/// takes them.
pub fn thrown_error(error: Bound<'_, PyAny>, value: Option<Bound<'_, PyAny>>) -> PyResult<PyErr> {
    Ok(match value.filter(|v| !v.is_none()) {
        Some(value) if !error.is_instance_of::<pyo3::exceptions::PyBaseException>() => {
            PyErr::from_value(error.call1((value,))?)
        }
        _ => PyErr::from_value(error),
    })
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

/// The coroutine of `acquire_async` / `acquire_all_async` /
/// `Reservation.wait_async`; it answers the reservation's `decision`.
///
/// The tokens are taken at its first step, and the same step starts the
/// sleep it then forwards (as `yield from` would): there is no point at
/// which the task can be cancelled between taking them and holding them.
/// Cancelled (or closed, or failing) while it sleeps, it gives them back.
#[pyclass(module = "bucketlimit._core")]
pub struct Acquiring {
    state: State,
}

impl Acquiring {
    pub fn new(request: Request) -> Acquiring {
        Acquiring {
            state: State::Start(request),
        }
    }

    /// The coroutine's result: the reservation's decision.
    fn answer(py: Python<'_>, reservation: &Py<Reservation>) -> PyErr {
        PyStopIteration::new_err((reservation.get().decision.clone_ref(py),))
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
                let (reservation, left) = request.reserve(py)?;
                if left == Some(0) {
                    return Err(Acquiring::answer(py, &reservation));
                }
                let clock = reservation.get().parts[0].clock();
                let sleep = match start_sleep(py, clock, left) {
                    Ok(sleep) => sleep,
                    Err(error) => {
                        reservation.get().cancel(py)?;
                        return Err(error);
                    }
                };
                (reservation, sleep)
            }
            State::Waiting { reservation, sleep } => (reservation, sleep),
        };
        match forward(py, &sleep, value, thrown) {
            Forwarded::Yielded(yielded) => {
                self.state = State::Waiting { reservation, sleep };
                Ok(yielded)
            }
            Forwarded::Finished => Err(Acquiring::answer(py, &reservation)),
            Forwarded::Failed(error) => {
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
        let error = thrown_error(error, value)?;
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
            State::Start(Request::Held(reservation)) => visit.call(reservation)?,
            State::Done => {}
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.state = State::Done;
    }
}
