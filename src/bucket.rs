//! One bucket's state and arithmetic (docs/design.md §4). No locks, no Python.
//!
//! Must match `python/bucketlimit/_redis/bucket.lua`: same units, same
//! rounding, so both backends answer identically on the same trace.

use crate::rate::Config;

/// A wait in whole microseconds; `None` means it never comes (rate 0).
pub type Wait = Option<u128>;

/// The outcome of asking a bucket for `cost` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// Until the same request would pass if nobody else spends; 0 when allowed.
    pub retry_after: Wait,
    /// Whole tokens left after this decision.
    pub remaining: u64,
    /// Until the bucket is full.
    pub reset_after: Wait,
    /// The capacity.
    pub limit: u64,
}

/// How far below zero a balance may go, in capacities: a bucket may owe at
/// most `MAX_DEBT_CAPACITIES * capacity` tokens (docs/design.md §4). 1,000
/// lets 10,000 one-token reservations queue on a capacity-10 bucket; every
/// balance stays within `-1000 * 2^100 ..= 2^100`, far inside i128.
pub const MAX_DEBT_CAPACITIES: u128 = 1000;

/// The answer to a reservation: granted or not, and the wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserved {
    /// Allowed when granted; a refusal's `retry_after` is the time until a
    /// reservation with the same `max_wait` would be granted.
    pub decision: Decision,
    /// Until the tokens are the caller's (0 when available now); for a
    /// refusal the wait it would have needed; `None` when never.
    pub delay: Wait,
}

/// A bucket: its balance in units and the microsecond it was last refilled to.
///
/// The balance is kept as two `u64` halves of an `i128` (negative while
/// reservations wait: a debt) so that a table entry packs into 48 bytes (a
/// 128-bit field would force 16-byte alignment and 64 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    balance_lo: u64,
    balance_hi: u64,
    last: i64,
}

impl Bucket {
    /// A full bucket, as of `now`. A missing bucket answers exactly like this.
    #[must_use]
    pub fn full(config: &Config, now: i64) -> Bucket {
        Bucket::new(config.full as i128, now)
    }

    #[must_use]
    pub fn new(balance: i128, last: i64) -> Bucket {
        let bits = balance as u128;
        Bucket {
            balance_lo: bits as u64,
            balance_hi: (bits >> 64) as u64,
            last,
        }
    }

    /// The balance in units (`unit` units per token); negative in debt.
    #[must_use]
    #[inline]
    pub fn balance(&self) -> i128 {
        ((u128::from(self.balance_hi) << 64) | u128::from(self.balance_lo)) as i128
    }

    /// The microsecond this bucket was last refilled to.
    #[must_use]
    pub fn last(&self) -> i64 {
        self.last
    }

    /// Units missing to full: `full - balance`, never negative.
    #[inline]
    fn missing(&self, config: &Config) -> u128 {
        (config.full as i128 - self.balance()) as u128
    }

    /// Refilled up to `now`. A clock that went backwards adds nothing and
    /// never moves the bucket's time back.
    #[must_use]
    #[inline]
    pub fn refilled(self, config: &Config, now: i64) -> Bucket {
        if now <= self.last {
            return self;
        }
        let elapsed = u128::from(now.abs_diff(self.last));
        let missing = self.missing(config);
        // Cap before adding: `elapsed * p` is only used when below `missing`.
        let balance = match elapsed.checked_mul(config.per_micro) {
            Some(added) if added < missing => self.balance() + added as i128,
            _ => config.full as i128,
        };
        Bucket::new(balance, now)
    }

    /// True when the bucket holds `capacity` tokens: it then answers exactly
    /// like a missing one and may be forgotten. A bucket in debt never is.
    #[must_use]
    #[inline]
    pub fn is_full(&self, config: &Config) -> bool {
        self.balance() == config.full as i128
    }

    /// Microseconds until this bucket is full; `None` when it never will be.
    #[must_use]
    pub fn until_full(&self, config: &Config) -> Wait {
        wait_for(config, self.missing(config))
    }

    /// What this (already refilled) bucket answers to `cost`, and the bucket
    /// after it: spent when allowed, unchanged when refused.
    /// `cost` must have passed [`Config::check_cost`].
    #[must_use]
    #[inline]
    pub fn decide(self, config: &Config, cost: u64) -> (Decision, Bucket) {
        let need = (u128::from(cost) * config.unit) as i128;
        let balance = self.balance();
        let (allowed, retry_after, after) = if balance >= need {
            (true, Some(0), Bucket::new(balance - need, self.last))
        } else if config.per_micro == 0 {
            (false, None, self)
        } else {
            (
                false,
                Some(
                    config
                        .per_micro_div
                        .div_ceil((need - balance) as u128, config.per_micro),
                ),
                self,
            )
        };
        (after.describe(config, allowed, retry_after), after)
    }

    /// A reservation of `cost` tokens from this (already refilled) bucket:
    /// taken now, the balance going below zero if need be; the delay is the
    /// time until the refill covers it (docs/design.md §4). Refused, spending
    /// nothing, when the delay would exceed `max_wait` (`None`: no limit),
    /// when the debt would pass its bound, or at rate 0 without the tokens.
    /// `cost` must have passed [`Config::check_cost`].
    #[must_use]
    #[inline]
    pub fn reserve(self, config: &Config, cost: u64, max_wait: Wait) -> (Reserved, Bucket) {
        let need = (u128::from(cost) * config.unit) as i128;
        let after = self.balance() - need;
        if after >= 0 {
            let bucket = Bucket::new(after, self.last);
            let decision = bucket.describe(config, true, Some(0));
            return (
                Reserved {
                    decision,
                    delay: Some(0),
                },
                bucket,
            );
        }
        let Some(delay) = wait_for(config, after.unsigned_abs()) else {
            let decision = self.describe(config, false, None);
            return (
                Reserved {
                    decision,
                    delay: None,
                },
                self,
            );
        };
        // Past the bound: refused until the refill brings it back within.
        let beyond = (-after) as u128;
        let bound = MAX_DEBT_CAPACITIES * config.full;
        let over_bound = wait_for(config, beyond.saturating_sub(bound)).unwrap_or(0);
        // Delays shrink one for one with time: ceil((x - t*p)/p) = ceil(x/p) - t.
        let over_wait = max_wait.map_or(0, |limit| delay.saturating_sub(limit));
        let refused_for = over_bound.max(over_wait);
        if refused_for == 0 {
            let bucket = Bucket::new(after, self.last);
            let decision = bucket.describe(config, true, Some(0));
            (
                Reserved {
                    decision,
                    delay: Some(delay),
                },
                bucket,
            )
        } else {
            let decision = self.describe(config, false, Some(refused_for));
            (
                Reserved {
                    decision,
                    delay: Some(delay),
                },
                self,
            )
        }
    }

    /// Records `cost` tokens of use that already happened (any number of
    /// tokens, even above capacity): debt allowed, down to its bound, where
    /// it stops. Reports the bucket after it: allowed when it is not in
    /// debt, else `retry_after` = the time until the debt is paid.
    #[must_use]
    pub fn charged(self, config: &Config, cost: u64) -> (Decision, Bucket) {
        let floor = -((MAX_DEBT_CAPACITIES * config.full) as i128);
        let after = u128::from(cost)
            .checked_mul(config.unit)
            .and_then(|need| i128::try_from(need).ok())
            .map_or(floor, |need| (self.balance() - need).max(floor));
        let bucket = Bucket::new(after, self.last);
        let decision = if after >= 0 {
            bucket.describe(config, true, Some(0))
        } else {
            bucket.describe(config, false, wait_for(config, after.unsigned_abs()))
        };
        (decision, bucket)
    }

    /// A decision reporting this bucket's state as it stands.
    #[must_use]
    pub fn describe(&self, config: &Config, allowed: bool, retry_after: Wait) -> Decision {
        let held = self.balance().max(0) as u128;
        Decision {
            allowed,
            retry_after,
            remaining: config.unit_div.div_floor(held, config.unit) as u64,
            reset_after: self.until_full(config),
            limit: config.capacity,
        }
    }

    /// Gives `cost` tokens back, never above capacity.
    #[must_use]
    pub fn refunded(self, config: &Config, cost: u64) -> Bucket {
        let back = (u128::from(cost) * config.unit) as i128;
        let balance = (self.balance() + back).min(config.full as i128);
        Bucket::new(balance, self.last)
    }
}

/// Microseconds until `units` have refilled: ceil(units / p); `None` at rate 0
/// (unless nothing is missing).
#[inline]
fn wait_for(config: &Config, units: u128) -> Wait {
    if units == 0 {
        Some(0)
    } else if config.per_micro == 0 {
        None
    } else {
        Some(config.per_micro_div.div_ceil(units, config.per_micro))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::Number;
    use proptest::prelude::*;

    fn config(capacity: i128, rate: f64) -> Config {
        Config::new(capacity, Number::Float(rate), Number::Int(1)).unwrap()
    }

    #[test]
    fn capacity_two_rate_one() {
        let c = config(2, 1.0);
        let b = Bucket::full(&c, 0);
        let (d, b) = b.decide(&c, 1);
        assert!(d.allowed);
        assert_eq!(d.remaining, 1);
        let (d, b) = b.decide(&c, 1);
        assert!(d.allowed);
        let (d, b) = b.decide(&c, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(1_000_000));
        let (d, b) = b.refilled(&c, 500_000).decide(&c, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(500_000));
        let (d, b) = b.refilled(&c, 1_000_000).decide(&c, 1);
        assert!(d.allowed);
        let (d, _) = b.decide(&c, 1);
        assert!(!d.allowed);
        assert_eq!(d.reset_after, Some(2_000_000));
    }

    #[test]
    fn tenth_second_steps_refill_exactly() {
        let c = config(1, 10.0);
        let mut b = Bucket::full(&c, 0);
        for k in 1..=100_000i64 {
            let (d, next) = b.refilled(&c, k * 100_000).decide(&c, 1);
            assert!(d.allowed, "step {k}");
            let (d, next) = next.decide(&c, 1);
            assert!(!d.allowed, "step {k}");
            b = next;
        }
    }

    #[test]
    fn rate_zero_never_refills() {
        let c = config(3, 0.0);
        let (_, b) = Bucket::full(&c, 0).decide(&c, 3);
        let (d, _) = b.refilled(&c, i64::MAX).decide(&c, 1);
        assert!(!d.allowed);
        assert_eq!((d.retry_after, d.reset_after), (None, None));
    }

    #[test]
    fn backwards_clock_adds_nothing() {
        let c = config(5, 1.0);
        let (_, b) = Bucket::full(&c, 10_000_000).decide(&c, 5);
        let back = b.refilled(&c, 0);
        assert_eq!(back, b);
        assert_eq!(back.last(), 10_000_000);
    }

    #[test]
    fn huge_elapsed_time_does_not_overflow() {
        let c = Config::new(1, Number::Float(1e20), Number::Int(1)).unwrap();
        let (_, b) = Bucket::full(&c, -(1 << 62)).decide(&c, 1);
        assert!(b.refilled(&c, 1 << 62).is_full(&c));
    }

    #[test]
    fn reservations_go_into_debt_in_order() {
        let c = config(2, 1.0);
        let mut b = Bucket::full(&c, 0);
        let mut delays = Vec::new();
        for _ in 0..5 {
            let (r, next) = b.reserve(&c, 1, None);
            assert!(r.decision.allowed);
            delays.push(r.delay);
            b = next;
        }
        let s = |n: u128| Some(n * 1_000_000);
        assert_eq!(delays, vec![s(0), s(0), s(1), s(2), s(3)]);
        // allow() sees the debt: refused until every waiter is served.
        let (d, _) = b.decide(&c, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, s(4));
        assert_eq!(d.remaining, 0);
        assert_eq!(d.reset_after, s(5));
        assert!(!b.is_full(&c));
    }

    #[test]
    fn a_reservation_past_max_wait_spends_nothing() {
        let c = config(1, 1.0);
        let (_, b) = Bucket::full(&c, 0).decide(&c, 1);
        let (r, after) = b.reserve(&c, 1, Some(400_000));
        assert!(!r.decision.allowed);
        assert_eq!(r.delay, Some(1_000_000));
        assert_eq!(r.decision.retry_after, Some(600_000));
        assert_eq!(after, b);
        let (r, _) = b.refilled(&c, 600_000).reserve(&c, 1, Some(400_000));
        assert!(r.decision.allowed);
        assert_eq!(r.delay, Some(400_000));
        // max_wait 0 is allow.
        let (r, _) = b.reserve(&c, 1, Some(0));
        assert_eq!(r.decision, b.decide(&c, 1).0);
    }

    #[test]
    fn debt_is_bounded() {
        let c = config(10, 1.0);
        let mut b = Bucket::full(&c, 0);
        for k in 0..10_010u128 {
            let (r, next) = b.reserve(&c, 1, None);
            assert!(r.decision.allowed, "reservation {k}");
            b = next;
        }
        let (r, after) = b.reserve(&c, 1, None);
        assert!(!r.decision.allowed);
        assert_eq!(r.decision.retry_after, Some(1_000_000));
        assert_eq!(after, b);
        // A charge stops at the bound.
        let (d, deep) = Bucket::full(&c, 0).charged(&c, u64::MAX);
        assert!(!d.allowed);
        assert_eq!(deep.balance(), -(1000 * c.full as i128));
        assert_eq!(d.retry_after, Some(10_000 * 1_000_000));
    }

    #[test]
    fn rate_zero_reserves_only_what_is_there() {
        let c = config(3, 0.0);
        let (r, b) = Bucket::full(&c, 0).reserve(&c, 3, None);
        assert!(r.decision.allowed);
        let (r, after) = b.reserve(&c, 1, None);
        assert!(!r.decision.allowed);
        assert_eq!((r.delay, r.decision.retry_after), (None, None));
        assert_eq!(after, b);
    }

    #[test]
    fn refund_and_charge_settle_an_estimate() {
        let c = config(10, 1.0);
        let (_, b) = Bucket::full(&c, 0).reserve(&c, 8, None);
        let (d, b) = b.charged(&c, 5); // used 13 of an estimate of 8
        assert!(!d.allowed);
        assert_eq!(b.balance(), -3 * c.unit as i128);
        assert_eq!(d.retry_after, Some(3_000_000));
        assert_eq!(b.refunded(&c, 10).balance(), 7 * c.unit as i128);
        assert!(b.refunded(&c, 10).refunded(&c, 10).is_full(&c));
    }

    fn arb_config() -> impl Strategy<Value = Config> {
        (1i128..1000, 0u32..5000, 0u32..4, 1u32..100).prop_map(|(cap, rate, dec, per)| {
            let rate = f64::from(rate) / 10f64.powi(dec as i32);
            Config::new(cap, Number::Float(rate), Number::Int(i128::from(per))).unwrap()
        })
    }

    proptest! {
        #[test]
        fn balance_stays_within_zero_and_capacity(
            c in arb_config(),
            steps in prop::collection::vec((0i64..5_000_000, 1u64..1000), 1..60),
        ) {
            let mut b = Bucket::full(&c, 0);
            let mut now = 0;
            for (dt, cost) in steps {
                now += dt;
                let cost = cost.min(c.capacity);
                let (d, next) = b.refilled(&c, now).decide(&c, cost);
                prop_assert!(next.balance() <= c.full as i128);
                prop_assert!(d.remaining <= c.capacity);
                b = next;
            }
        }

        #[test]
        fn a_refusal_changes_nothing(
            c in arb_config(),
            spent in 0u64..1000,
            dt in 0i64..10_000_000,
            cost in 1u64..1000,
        ) {
            let cost = cost.min(c.capacity);
            let spent = spent.min(c.capacity);
            let (_, b) = Bucket::full(&c, 0).decide(&c, spent);
            let refilled = b.refilled(&c, dt);
            let (d, after) = refilled.decide(&c, cost);
            if !d.allowed {
                prop_assert_eq!(after, refilled);
            }
        }

        #[test]
        fn refill_is_monotone_and_composes(
            c in arb_config(),
            spent in 1u64..1000,
            t1 in 0i64..10_000_000,
            t2 in 0i64..10_000_000,
        ) {
            let spent = spent.min(c.capacity);
            let (_, b) = Bucket::full(&c, 0).decide(&c, spent);
            let (early, late) = (t1.min(t2), t1.max(t2));
            let a = b.refilled(&c, early);
            let z = b.refilled(&c, late);
            prop_assert!(a.balance() <= z.balance());
            prop_assert_eq!(a.refilled(&c, late), z);
        }

        #[test]
        fn waiting_the_delay_repays_the_debt_and_one_less_does_not(
            c in arb_config(),
            costs in prop::collection::vec(1u64..1000, 1..20),
        ) {
            prop_assume!(c.per_micro > 0);
            let mut b = Bucket::full(&c, 0);
            let mut last = 0;
            for cost in costs {
                let (r, next) = b.reserve(&c, cost.min(c.capacity), None);
                prop_assert!(r.decision.allowed);
                let delay = r.delay.unwrap() as i64;
                prop_assert!(delay >= last, "FIFO");
                last = delay;
                prop_assert!(next.refilled(&c, delay).balance() >= 0);
                if delay > 0 {
                    prop_assert!(next.refilled(&c, delay - 1).balance() < 0);
                }
                b = next;
            }
        }

        #[test]
        fn waiting_retry_after_passes_and_one_less_does_not(
            c in arb_config(),
            spent in 1u64..1000,
            cost in 1u64..1000,
        ) {
            prop_assume!(c.per_micro > 0);
            let spent = spent.min(c.capacity);
            let cost = cost.min(c.capacity);
            let (_, b) = Bucket::full(&c, 0).decide(&c, spent);
            let (d, b) = b.decide(&c, cost);
            if let Some(wait) = d.retry_after.filter(|_| !d.allowed) {
                let wait = wait as i64;
                prop_assert!(b.refilled(&c, wait).decide(&c, cost).0.allowed);
                prop_assert!(!b.refilled(&c, wait - 1).decide(&c, cost).0.allowed);
            }
        }
    }
}
