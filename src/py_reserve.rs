//! The binding of reservations (docs/design.md §2): `Reservation`, made by
//! `reserve`, by the `*_all` calls (over token buckets, and with concurrency
//! permits: `combined.rs` decides, this module builds the reservation that
//! holds them), waited for in a thread or by `Acquiring`, the one coroutine
//! of every `acquire_async`, token buckets' and permits'. Types are checked
//! here; the arithmetic is `bucket.rs`, `registry.rs` and `combined.rs`.
//! A reservation's `cancel` and `settle` release its permits.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyList, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::bucket::{Line, Reserved, Wait};
use crate::combined;
use crate::py_checks::{self, Checks, OwnedChecks, Parsed};
use crate::py_types::{
    integer, key_str, max_wait, read_clock, repr, seconds, Decision, Permit, TokenBucketLimiter,
};
use crate::py_waits::{
    cancel_timer, forward, sleeper, start_sleep, thrown_error, wait_sync, Forwarded, Outcome,
    Round, Waits, Wake,
};
use crate::registry;

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

    /// `cancel` on a path that must not fail (an error already on its way).
    fn cancel_quietly(&self, py: Python<'_>) {
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

/// A reservation over a call's checks with concurrency permits, as the core
/// answered it: the tokens' cap lines (one per bucket; none when nothing was
/// reserved), one permit per concurrency check (granted, or unheld for a
/// refusal), in the order of the checks.
fn with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    reserved: Reserved,
    lines: Vec<Option<Line>>,
    degraded: bool,
    permits: Vec<Py<Permit>>,
    made: i64,
) -> PyResult<Reservation> {
    let mut buckets = tokens_of(&checks.buckets, lines).into_iter();
    let mut permits = permits.into_iter();
    let parts = checks
        .order
        .iter()
        .map(|&is_permit| {
            if is_permit {
                Part::Permit(permits.next().expect("one permit per concurrency check"))
            } else {
                Part::Tokens(buckets.next().expect("one part per token bucket check"))
            }
        })
        .collect();
    reservation(py, parts, reserved, made, degraded)
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

/// The tokens of each bucket check, with the cap line its reservation left
/// (`lines` is empty when nothing was reserved: the buckets are named, never
/// given back to).
fn tokens_of(parsed: &[Parsed<'_>], lines: Vec<Option<Line>>) -> Vec<Tokens> {
    let lines = lines.into_iter().chain(std::iter::repeat(None));
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

/// `reserve_all` over token buckets: every clock is read before any lock.
pub fn reserve_checks(
    py: Python<'_>,
    parsed: &[Parsed<'_>],
    max_wait: Wait,
) -> PyResult<Reservation> {
    let (checks, degraded) = py_checks::bucket_checks(py, parsed)?;
    let (reserved, lines) = registry::reserve_all(&checks, max_wait)?;
    let parts = tokens_of(parsed, lines)
        .into_iter()
        .map(Part::Tokens)
        .collect();
    let made = checks.first().map_or(0, |check| check.now);
    reservation(py, parts, reserved, made, degraded)
}

/// `allow_all` / `reserve_all` over checks with concurrency limiters
/// (`combined::reserve`): every permit free now and every bucket within
/// `max_wait`, all or nothing. Every clock is read before any lock.
pub fn reserve_with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    max_wait: Wait,
) -> PyResult<Reservation> {
    let permit_checks = py_checks::permit_checks(py, &checks.permits)?;
    let (bucket_checks, degraded) = py_checks::bucket_checks(py, &checks.buckets)?;
    let done = combined::reserve(&bucket_checks, &permit_checks, max_wait)?;
    let taken = done.permits;
    let mut permits = Vec::with_capacity(checks.permits.len());
    for (((limiter, key), answer), (woken, log)) in checks
        .permits
        .iter()
        .zip(taken.answers)
        .zip(taken.woken.into_iter().zip(taken.log_no_room))
    {
        let this = limiter.get();
        this.wake(py, woken);
        if log {
            this.core.log_refusing_new_keys();
        }
        permits.push(Py::new(
            py,
            Permit::new(limiter.clone().unbind(), key.clone().unbind(), answer),
        )?);
    }
    let made = if checks.order[0] {
        permit_checks[0].now
    } else {
        bucket_checks[0].now
    };
    with_permits(
        py,
        checks,
        done.reserved,
        done.lines,
        degraded,
        permits,
        made,
    )
}

/// The reservation of an `acquire_all` with permits once its wait for them
/// is over: a refusal's (`Err`: one unheld permit per check), or the tokens
/// reserved within what is left of the timeout, the permits extended to live
/// `ttl` from when the tokens are ready (`combined::after_permits`; a refusal
/// releases them). Never leaves a permit held on an error.
fn after_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    outcome: Outcome,
    waits: &Waits,
) -> PyResult<Reservation> {
    let held = match outcome {
        Ok(held) => held,
        Err(unheld) => {
            let answers: Vec<_> = unheld
                .iter()
                .map(|p| (p.get().decision, p.get().granted()))
                .collect();
            let refused = combined::answer(None, &answers);
            return with_permits(py, checks, refused, Vec::new(), false, unheld, 0);
        }
    };
    let release = || {
        for permit in &held {
            permit.get().release_quietly(py);
        }
    };
    let done = waits.left(py).and_then(|left| {
        let (buckets, degraded) = py_checks::bucket_checks(py, &checks.buckets)?;
        let permits = py_checks::held_permits(py, &held)?;
        let done = combined::after_permits(&buckets, &permits, left)?;
        let made = if checks.order[0] {
            permits[0].now
        } else {
            buckets[0].now
        };
        Ok((done, degraded, made))
    });
    let (done, degraded, made) = match done {
        Ok(done) => done,
        Err(error) => {
            release();
            return Err(error);
        }
    };
    for (permit, woken) in held.iter().zip(done.woken) {
        permit.get().limiter.get().wake(py, woken);
    }
    if !done.reserved.decision.allowed {
        release();
    }
    with_permits(py, checks, done.reserved, done.lines, degraded, held, made)
}

/// `acquire_all` over checks with concurrency limiters, in this thread: waits
/// for the permits (in order, FIFO each), then for the tokens.
pub fn acquire_with_permits(
    py: Python<'_>,
    checks: &Checks<'_>,
    timeout: Wait,
) -> PyResult<Reservation> {
    if timeout == Some(0) {
        return reserve_with_permits(py, checks, timeout);
    }
    py_checks::check_buckets(&checks.buckets)?;
    let mut waits = Waits::new(
        py,
        &checks.permits,
        checks.first_clock(py).as_ref(),
        timeout,
    )?;
    let outcome = wait_sync(py, &mut waits)?;
    let reservation = after_permits(py, checks, outcome, &waits)?;
    wait(py, &reservation)?;
    Ok(reservation)
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
    Ok(Acquiring::new(Request::Tokens {
        limiter: limiter.clone().unbind(),
        key: key.clone().unbind(),
        cost,
        max_wait,
    }))
}

/// `acquire_all_async(checks, timeout=...)`: the checks are checked now,
/// the permits and tokens taken when awaited.
pub fn acquiring_all(py: Python<'_>, checks: &Checks<'_>, timeout: Wait) -> PyResult<Acquiring> {
    if checks.permits.is_empty() {
        return Ok(Acquiring::new(Request::All {
            checks: Box::new(checks.owned()),
            max_wait: timeout,
        }));
    }
    py_checks::check_buckets(&checks.buckets)?;
    let waits = Waits::new(
        py,
        &checks.permits,
        checks.first_clock(py).as_ref(),
        timeout,
    )?;
    Ok(Acquiring::queued(waits, Goal::All(checks.owned())))
}

/// What an [`Acquiring`] takes at its first step. Its large parts are boxed:
/// the coroutine of a token bucket stays small (moved at every step).
enum Request {
    /// `acquire_async`: one bucket's tokens.
    Tokens {
        limiter: Py<TokenBucketLimiter>,
        key: Py<PyString>,
        cost: i128,
        max_wait: Wait,
    },
    /// `acquire_all_async` over token buckets alone.
    All {
        checks: Box<OwnedChecks>,
        max_wait: Wait,
    },
    /// `Reservation.wait_async`: a reservation already made, nothing to take.
    Held(Py<Reservation>),
    /// Permits, each in its turn; then the goal.
    Permits(Box<Queue>),
}

/// What an [`Acquiring`] does once its wait for permits is over.
pub enum Goal {
    /// `ConcurrencyLimiter.acquire_async`: answers the permit.
    Permit,
    /// `acquire_all_async` with permits: reserves these checks' tokens,
    /// sleeps until they are ready and answers the reservation.
    All(OwnedChecks),
}

/// A wait for permits, and what follows it.
struct Queue {
    waits: Waits,
    goal: Goal,
}

impl Queue {
    fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.waits.visit(visit)?;
        match &self.goal {
            Goal::Permit => Ok(()),
            Goal::All(checks) => checks.visit(visit),
        }
    }
}

/// What an [`Acquiring`] answers once its reservation's tokens are ready.
#[derive(Clone, Copy)]
enum Answer {
    /// Its decision (token buckets alone).
    Decision,
    /// The reservation (with permits: they are released through it).
    Reservation,
}

/// What a waiting [`Acquiring`] holds or waits for.
enum Holding {
    /// A place in the queue for a permit (and the permits taken before it),
    /// and the timer that resolves its future when the wait is over (none
    /// with a clock's sleep).
    Queue {
        queue: Box<Queue>,
        timer: Option<Py<PyAny>>,
    },
    /// A reservation, until its tokens are ready.
    Reservation {
        reservation: Py<Reservation>,
        answer: Answer,
    },
}

impl Holding {
    /// The one rule for a wait that stops early (cancelled, failing, closed,
    /// collected or dropped): it leaves the queue (giving back a permit
    /// handed to it meanwhile), releases the permits it holds, and cancels
    /// its reservation. Never fails.
    fn give_back(self, py: Python<'_>) {
        match self {
            Holding::Queue { mut queue, timer } => {
                cancel_timer(py, timer);
                queue.waits.abandon(py);
            }
            Holding::Reservation { reservation, .. } => reservation.get().cancel_quietly(py),
        }
    }

    fn visit(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        match self {
            Holding::Queue { queue, timer } => {
                queue.visit(visit)?;
                match timer {
                    Some(timer) => visit.call(timer),
                    None => Ok(()),
                }
            }
            Holding::Reservation { reservation, .. } => visit.call(reservation),
        }
    }
}

enum State {
    Start(Request),
    /// Awaiting a sleep (or a future a releasing call resolves), forwarded.
    Waiting {
        awaiting: Py<PyAny>,
        holding: Holding,
    },
    Done,
}

/// The coroutine of every `acquire_async`: `TokenBucketLimiter`'s and
/// `acquire_all_async` (answering the `Decision`, or with concurrency
/// limiters the `Reservation`), `Reservation.wait_async` (its `decision`) and
/// `ConcurrencyLimiter`'s (the `Permit`). Token waits are its case without
/// permits.
///
/// Cancel-safe: whatever it takes (tokens, a permit) is taken at a step that
/// ends by answering it or by holding it in this object, and the step that
/// takes tokens also starts the sleep it then forwards (as `yield from`
/// would), so no cancellation point lies between taking and holding. One
/// rule for giving back: cancelled, failing, closed, collected or dropped
/// while it waits, it leaves the queue (giving back a permit handed to it
/// meanwhile), releases the permits it holds and cancels its reservation.
#[pyclass(module = "bucketlimit._core")]
pub struct Acquiring {
    state: State,
}

impl Acquiring {
    fn new(request: Request) -> Acquiring {
        Acquiring {
            state: State::Start(request),
        }
    }

    /// The coroutine of a wait for permits (`ConcurrencyLimiter.acquire_async`,
    /// `acquire_all_async` with permits), then `goal`.
    pub fn queued(waits: Waits, goal: Goal) -> Acquiring {
        Acquiring::new(Request::Permits(Box::new(Queue { waits, goal })))
    }

    /// One step: `send(value)` when `thrown` is `None`, else `throw`.
    fn step(
        &mut self,
        py: Python<'_>,
        value: Py<PyAny>,
        thrown: Option<PyErr>,
    ) -> PyResult<Py<PyAny>> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Done => Err(thrown.unwrap_or_else(|| {
                PyRuntimeError::new_err("cannot reuse an already awaited acquire_async()")
            })),
            State::Start(request) => match thrown {
                Some(error) => Err(error), // cancelled before it took anything
                None => self.start(py, request),
            },
            State::Waiting { awaiting, holding } => {
                let forwarded = forward(py, &awaiting, value, thrown);
                self.hold(py, forwarded, awaiting, holding)
            }
        }
    }

    /// The first step: takes what the request asks for.
    fn start(&mut self, py: Python<'_>, request: Request) -> PyResult<Py<PyAny>> {
        let made = match request {
            Request::Permits(queue) => return self.queue(py, queue),
            Request::Held(reservation) => {
                let left = reservation.get().left(py)?;
                return self.sleep(py, reservation, left, Answer::Decision);
            }
            Request::Tokens {
                limiter,
                key,
                cost,
                max_wait,
            } => reserve_one(py, limiter.bind(py), key.bind(py), cost, max_wait)?,
            Request::All { checks, max_wait } => {
                reserve_checks(py, &checks.bind(py).buckets, max_wait)?
            }
        };
        // Made just now: all of its delay is left.
        let left = made.delay;
        self.sleep(py, Py::new(py, made)?, left, Answer::Decision)
    }

    /// What became of a step of the awaitable it waits on: yields on (still
    /// holding what it holds), goes on once the wait is over, gives back on
    /// a failure or a cancellation.
    fn hold(
        &mut self,
        py: Python<'_>,
        forwarded: Forwarded,
        awaiting: Py<PyAny>,
        holding: Holding,
    ) -> PyResult<Py<PyAny>> {
        match forwarded {
            Forwarded::Yielded(yielded) => {
                self.state = State::Waiting { awaiting, holding };
                Ok(yielded)
            }
            Forwarded::Failed(error) => {
                holding.give_back(py);
                Err(error)
            }
            Forwarded::Finished => match holding {
                Holding::Queue { queue, timer } => {
                    cancel_timer(py, timer);
                    self.queue(py, queue)
                }
                Holding::Reservation {
                    reservation,
                    answer,
                } => Err(answered(py, reservation, answer)),
            },
        }
    }

    /// Runs rounds of the wait for permits until one sleeps (then yields what
    /// its sleep yields) or the wait is over.
    fn queue(&mut self, py: Python<'_>, mut queue: Box<Queue>) -> PyResult<Py<PyAny>> {
        let waits = &mut queue.waits;
        loop {
            let mut wake = Wake::task(py, waits.clock());
            let seconds = match waits.round(py, &mut wake) {
                Ok(Round::Sleep(seconds)) => seconds,
                Ok(Round::Done(outcome)) => return self.after_wait(py, &queue, outcome),
                Err(error) => {
                    waits.abandon(py);
                    return Err(error);
                }
            };
            let (awaiting, timer) = match wake.start_task_sleep(py, seconds) {
                Ok(started) => started,
                Err(error) => {
                    waits.abandon(py);
                    return Err(error);
                }
            };
            match forward(py, &awaiting, py.None(), None) {
                Forwarded::Finished => cancel_timer(py, timer), // woken already: look again
                forwarded => {
                    let holding = Holding::Queue { queue, timer };
                    return self.hold(py, forwarded, awaiting, holding);
                }
            }
        }
    }

    /// The wait for permits is over: answers the permit (or its refusal), or
    /// goes on to the tokens.
    fn after_wait(
        &mut self,
        py: Python<'_>,
        queue: &Queue,
        outcome: Outcome,
    ) -> PyResult<Py<PyAny>> {
        let checks = match &queue.goal {
            Goal::Permit => {
                let (Ok(mut permit) | Err(mut permit)) = outcome;
                return Err(PyStopIteration::new_err((permit.pop(),)));
            }
            Goal::All(checks) => checks.bind(py),
        };
        let reservation = after_permits(py, &checks, outcome, &queue.waits)?;
        let left = reservation.delay;
        self.sleep(py, Py::new(py, reservation)?, left, Answer::Reservation)
    }

    /// Holds the reservation until its tokens are ready (`left`), sleeping
    /// on its first check's clock; answers at once when there is no wait (or
    /// it is a refusal, which holds nothing).
    fn sleep(
        &mut self,
        py: Python<'_>,
        reservation: Py<Reservation>,
        left: Wait,
        answer: Answer,
    ) -> PyResult<Py<PyAny>> {
        if left == Some(0) || !reservation.get().granted(py) {
            return Err(answered(py, reservation, answer));
        }
        let started = start_sleep(py, reservation.get().parts[0].clock(), left);
        let holding = Holding::Reservation {
            reservation,
            answer,
        };
        match started {
            Ok(awaiting) => {
                let forwarded = forward(py, &awaiting, py.None(), None);
                self.hold(py, forwarded, awaiting, holding)
            }
            Err(error) => {
                holding.give_back(py);
                Err(error)
            }
        }
    }

    /// Stops waiting (closed, collected, dropped): gives back what it holds
    /// or waits for, as a cancellation does.
    fn stop(&mut self, py: Python<'_>) {
        if let State::Waiting { awaiting, holding } =
            std::mem::replace(&mut self.state, State::Done)
        {
            let _ = awaiting.call_method0(py, "close");
            holding.give_back(py);
        }
    }
}

/// The coroutine's result, as `StopIteration`.
fn answered(py: Python<'_>, reservation: Py<Reservation>, answer: Answer) -> PyErr {
    match answer {
        Answer::Decision => PyStopIteration::new_err((reservation.get().decision.clone_ref(py),)),
        Answer::Reservation => PyStopIteration::new_err((reservation,)),
    }
}

impl Drop for Acquiring {
    fn drop(&mut self) {
        if matches!(self.state, State::Waiting { .. }) {
            Python::attach(|py| self.stop(py));
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

    /// Stops waiting: it gives back what it holds or waits for.
    fn close(&mut self, py: Python<'_>) {
        self.stop(py);
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        match &self.state {
            State::Start(Request::Tokens { limiter, .. }) => visit.call(limiter),
            State::Start(Request::All { checks, .. }) => checks.visit(&visit),
            State::Start(Request::Held(reservation)) => visit.call(reservation),
            State::Start(Request::Permits(queue)) => queue.visit(&visit),
            State::Waiting { awaiting, holding } => {
                visit.call(awaiting)?;
                holding.visit(&visit)
            }
            State::Done => Ok(()),
        }
    }

    /// Collected in a cycle: stops waiting first (nothing left held or queued).
    fn __clear__(&mut self) {
        Python::attach(|py| self.stop(py));
    }
}
