//! A call over token buckets and concurrency permits at once: the `*_all`
//! calls with `(conc, key)` checks (docs/design.md §2 "Permits with tokens",
//! §4 "Permits"). All or nothing, answered as one decision by the rule of
//! `allow_all`. `registry` and `concurrency` do not know each other: this
//! module composes them. Time is a parameter (µs); no Python, no clock.

use crate::bucket::{Decision, Line, Reserved, Wait};
use crate::concurrency::{self, PermitCheck, Taken, Woken};
use crate::error::Error;
use crate::registry::{self, Check};

/// What [`reserve`] did.
pub struct Reservation {
    /// The call's answer: every check's decision combined ([`answer`]), and
    /// the delay until its tokens are ready.
    pub reserved: Reserved,
    /// Per bucket check: where its reservation left the bucket's cap line.
    pub lines: Vec<Option<Line>>,
    /// The permits' part: per permit check, its grant or its decision.
    pub permits: Taken,
}

/// Every bucket's cost within `max_wait` and every permit free now, all or
/// nothing, at one moment under every lock (the buckets' tables, then the
/// permits'). The permits of a granted call live `ttl` from when its tokens
/// are ready: a reservation never queues for a permit (when it frees is not
/// known).
///
/// # Errors
/// A bad key or cost, the same (limiter, key) twice; nothing changes then.
///
/// # Panics
/// Never: the gate runs once the checks pass.
pub fn reserve(
    buckets: &[Check<'_>],
    permits: &[PermitCheck<'_>],
    max_wait: Wait,
) -> Result<Reservation, Error> {
    concurrency::check_all(permits)?;
    if buckets.is_empty() {
        let taken = concurrency::take_all(permits, true, Some(0));
        return Ok(Reservation {
            reserved: answer(None, &held_decisions(&taken)),
            lines: Vec::new(),
            permits: taken,
        });
    }
    let mut taken = None;
    let (tokens, lines) = registry::reserve_all_gated(buckets, max_wait, |go, delay| {
        let t = concurrency::take_all(permits, go, delay);
        let allowed = t.allowed;
        taken = Some(t);
        allowed
    })?;
    let taken = taken.expect("the gate runs once the checks pass");
    Ok(Reservation {
        reserved: answer(Some(tokens), &held_decisions(&taken)),
        lines,
        permits: taken,
    })
}

/// Each permit's decision, and whether it was granted.
fn held_decisions(taken: &Taken) -> Vec<(Decision, bool)> {
    taken
        .answers
        .iter()
        .map(|answer| match answer {
            Ok(grant) => (grant.decision, true),
            Err(decision) => (*decision, false),
        })
        .collect()
}

/// A permit a waiting call holds, with the time read from its limiter's clock.
pub struct Held<'a> {
    pub limiter: &'a concurrency::Limiter,
    pub key: &'a str,
    pub token: u64,
    /// The decision of its grant.
    pub decision: Decision,
    pub now: i64,
}

/// What [`after_permits`] did.
pub struct AfterPermits {
    /// The call's answer: the tokens' decision and the permits' combined.
    pub reserved: Reserved,
    /// Per bucket check: where its reservation left the bucket's cap line.
    pub lines: Vec<Option<Line>>,
    /// Per permit held: the waiters its limiter handed a permit meanwhile.
    pub woken: Vec<Woken>,
}

/// The rest of a waiting `acquire_all` once it holds every permit: reserves
/// the buckets' costs within `left` (what is left of its timeout), and when
/// they are granted with a delay, extends every permit to live `ttl` from
/// when the tokens are ready. A refusal changes no permit: the caller
/// releases them.
///
/// # Errors
/// A bad key or cost, the same (limiter, key) twice; nothing changes then.
pub fn after_permits(
    buckets: &[Check<'_>],
    held: &[Held<'_>],
    left: Wait,
) -> Result<AfterPermits, Error> {
    let (tokens, lines) = if buckets.is_empty() {
        (None, Vec::new())
    } else {
        let (tokens, lines) = registry::reserve_all(buckets, left)?;
        (Some(tokens), lines)
    };
    let permits: Vec<(Decision, bool)> = held.iter().map(|h| (h.decision, true)).collect();
    let reserved = answer(tokens, &permits);
    let extra = tokens.and_then(|t| t.delay).unwrap_or(0);
    let mut woken = Vec::with_capacity(held.len());
    for permit in held {
        if reserved.decision.allowed && extra > 0 {
            let extra = i64::try_from(extra).unwrap_or(i64::MAX);
            let (_, handed) = permit
                .limiter
                .renew(permit.key, permit.token, permit.now, extra)?;
            woken.push(handed);
        } else {
            woken.push(Woken::new());
        }
    }
    Ok(AfterPermits {
        reserved,
        lines,
        woken,
    })
}

/// The answer of a call over buckets and permits: its tokens' reservation
/// (`None` when nothing was reserved: no bucket among the checks, or a
/// refusal by a permit first) and each permit's decision and whether it is
/// held. Granted only if every part is (a permit not held refuses the call
/// even when its own decision allows); the decision combines every part's by
/// the rule of `allow_all` (the tokens' first); a refusal's delay is the
/// longest wait it knows of (a permit's: until a slot is sure to be free).
#[must_use]
pub fn answer(tokens: Option<Reserved>, permits: &[(Decision, bool)]) -> Reserved {
    let mut decisions: Vec<Decision> = Vec::with_capacity(permits.len() + 1);
    let delay = match tokens {
        Some(tokens) => {
            decisions.push(tokens.decision);
            tokens.delay
        }
        None => Some(0),
    };
    decisions.extend(permits.iter().map(|&(decision, _)| decision));
    let mut decision = registry::combine(&decisions);
    decision.allowed &= permits.iter().all(|&(_, held)| held);
    let delay = if decision.allowed {
        delay
    } else {
        decisions
            .iter()
            .filter(|d| !d.allowed)
            .fold(delay, |longest, d| Some(longest?.max(d.retry_after?)))
    };
    Reserved { decision, delay }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::concurrency::Limiter;
    use crate::rate::{Config, Number};
    use crate::registry::Registry;

    const S: i64 = 1_000_000;

    fn bucket(capacity: i128, rate: i128) -> Registry {
        Registry::new(
            Config::new(capacity, Number::Int(rate), Number::Int(1)).unwrap(),
            None,
        )
    }

    fn permits(limit: i128, ttl: i128) -> Limiter {
        Limiter::new(
            concurrency::Config::new(limit, Number::Int(ttl)).unwrap(),
            None,
        )
    }

    fn tokens(registry: &Registry, cost: i128, now: i64) -> Check<'_> {
        Check {
            registry,
            key: "k",
            cost,
            now,
        }
    }

    fn permit(limiter: &Limiter, now: i64) -> PermitCheck<'_> {
        PermitCheck {
            limiter,
            key: "k",
            now,
        }
    }

    #[test]
    fn reserve_is_all_or_nothing() {
        let (rpm, inflight) = (bucket(2, 1), permits(1, 60));
        let call = |cost, now| reserve(&[tokens(&rpm, cost, now)], &[permit(&inflight, now)], None);
        let first = call(2, 0).unwrap();
        assert!(first.reserved.decision.allowed);
        assert_eq!(first.reserved.delay, Some(0));
        // The permit is busy: the tokens are not spent.
        let busy = call(1, 0).unwrap();
        assert!(!busy.reserved.decision.allowed);
        assert_eq!(
            busy.reserved.delay,
            Some(60 * S as u128),
            "a refusal waits until a slot is sure to be free"
        );
        assert!(busy.permits.answers[0].is_err());
        assert!(busy.lines.iter().all(Option::is_none));
        let grant = first.permits.answers[0].unwrap();
        inflight.release("k", grant.token, S).unwrap();
        // The bucket refuses (max_wait 0): the free permit is not taken.
        let refused = reserve(&[tokens(&rpm, 2, S)], &[permit(&inflight, S)], Some(0)).unwrap();
        assert!(!refused.reserved.decision.allowed);
        assert_eq!(refused.reserved.decision.retry_after, Some(S as u128));
        assert_eq!(inflight.in_flight("k", S).unwrap().0, 0, "nothing taken");
    }

    #[test]
    fn reserved_permits_live_ttl_from_when_the_tokens_are_ready() {
        let (rpm, inflight) = (bucket(1, 1), permits(1, 60));
        assert!(rpm.allow("k", 1, 0).unwrap().allowed);
        let waited = reserve(&[tokens(&rpm, 1, 0)], &[permit(&inflight, 0)], None).unwrap();
        assert_eq!(waited.reserved.delay, Some(S as u128));
        assert_eq!(waited.permits.answers[0].unwrap().expires, 61 * S);
    }

    #[test]
    fn reserve_over_permits_alone() {
        let (a, b) = (permits(1, 60), permits(2, 60));
        let both = [permit(&a, 0), permit(&b, 0)];
        assert!(reserve(&[], &both, None).unwrap().reserved.decision.allowed);
        let again = reserve(&[], &both, None).unwrap();
        assert!(!again.reserved.decision.allowed);
        assert_eq!(again.reserved.decision.remaining, 0, "the busy limiter's");
        assert_eq!(b.in_flight("k", 0).unwrap().0, 1, "nothing taken");
        assert!(matches!(
            reserve(&[], &[both[0], both[0]], None),
            Err(Error::DuplicateCheck(_))
        ));
    }

    #[test]
    fn after_permits_extends_them_to_the_tokens_or_leaves_them_to_release() {
        let (rpm, inflight) = (bucket(1, 1), permits(1, 60));
        assert!(rpm.allow("k", 1, 0).unwrap().allowed);
        let grant = inflight.try_acquire("k", 0).unwrap().0.unwrap();
        let held = [Held {
            limiter: &inflight,
            key: "k",
            token: grant.token,
            decision: grant.decision,
            now: 0,
        }];
        // Within the timeout: the permit lives ttl from when the tokens are ready.
        let done = after_permits(&[tokens(&rpm, 1, 0)], &held, Some(2 * S as u128)).unwrap();
        assert!(done.reserved.decision.allowed);
        assert_eq!(done.reserved.delay, Some(S as u128));
        assert!(inflight.valid("k", grant.token, 60 * S + S / 2).unwrap());
        // Beyond it: refused, the permit unchanged (its holder releases it).
        let late = after_permits(&[tokens(&rpm, 1, 0)], &held, Some(S as u128)).unwrap();
        assert!(!late.reserved.decision.allowed);
        assert_eq!(late.reserved.delay, Some(2 * S as u128));
        assert_eq!(late.woken, vec![Woken::new()]);
        // No bucket: the permits' grants answer.
        let alone = after_permits(&[], &held, None).unwrap();
        assert_eq!(alone.reserved.decision, grant.decision);
    }

    #[test]
    fn a_permit_not_held_refuses_the_call() {
        let free = Decision {
            allowed: true,
            retry_after: Some(0),
            remaining: 3,
            reset_after: Some(0),
            limit: 3,
        };
        let busy = Decision {
            allowed: false,
            retry_after: Some(5),
            remaining: 0,
            reset_after: Some(9),
            limit: 1,
        };
        let held = answer(None, &[(free, true)]);
        assert!(held.decision.allowed);
        assert_eq!(held.delay, Some(0));
        let not_held = answer(None, &[(free, false)]);
        assert!(!not_held.decision.allowed, "free, but not taken");
        let tokens = Reserved {
            decision: free,
            delay: Some(2),
        };
        let refused = answer(Some(tokens), &[(free, true), (busy, false)]);
        assert_eq!(refused.decision, busy);
        assert_eq!(refused.delay, Some(5), "the longest wait it knows of");
    }
}
