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

/// A bucket: its balance in units and the microsecond it was last refilled to.
///
/// The balance is kept as two `u64` halves so that a table entry packs into
/// 48 bytes (a `u128` field would force 16-byte alignment and 64 bytes).
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
        Bucket::new(config.full, now)
    }

    #[must_use]
    pub fn new(balance: u128, last: i64) -> Bucket {
        Bucket {
            balance_lo: balance as u64,
            balance_hi: (balance >> 64) as u64,
            last,
        }
    }

    /// The balance in units (`unit` units per token).
    #[must_use]
    #[inline]
    pub fn balance(&self) -> u128 {
        (u128::from(self.balance_hi) << 64) | u128::from(self.balance_lo)
    }

    /// The microsecond this bucket was last refilled to.
    #[must_use]
    pub fn last(&self) -> i64 {
        self.last
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
        let balance = self.balance();
        let missing = config.full - balance;
        // Cap before adding: `elapsed * p` is only used when below `missing`.
        let balance = match elapsed.checked_mul(config.per_micro) {
            Some(added) if added < missing => balance + added,
            _ => config.full,
        };
        Bucket::new(balance, now)
    }

    /// True when the bucket holds `capacity` tokens: it then answers exactly
    /// like a missing one and may be forgotten.
    #[must_use]
    #[inline]
    pub fn is_full(&self, config: &Config) -> bool {
        self.balance() == config.full
    }

    /// Microseconds until this bucket is full; `None` when it never will be.
    #[must_use]
    pub fn until_full(&self, config: &Config) -> Wait {
        let missing = config.full - self.balance();
        if missing == 0 {
            Some(0)
        } else if config.per_micro == 0 {
            None
        } else {
            Some(config.per_micro_div.div_ceil(missing, config.per_micro))
        }
    }

    /// What this (already refilled) bucket answers to `cost`, and the bucket
    /// after it: spent when allowed, unchanged when refused.
    /// `cost` must have passed [`Config::check_cost`].
    #[must_use]
    #[inline]
    pub fn decide(self, config: &Config, cost: u64) -> (Decision, Bucket) {
        let need = u128::from(cost) * config.unit;
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
                        .div_ceil(need - balance, config.per_micro),
                ),
                self,
            )
        };
        (after.describe(config, allowed, retry_after), after)
    }

    /// A decision reporting this bucket's state as it stands.
    #[must_use]
    pub fn describe(&self, config: &Config, allowed: bool, retry_after: Wait) -> Decision {
        Decision {
            allowed,
            retry_after,
            remaining: config.unit_div.div_floor(self.balance(), config.unit) as u64,
            reset_after: self.until_full(config),
            limit: config.capacity,
        }
    }

    /// Gives `cost` tokens back, never above capacity.
    #[must_use]
    pub fn refunded(self, config: &Config, cost: u64) -> Bucket {
        let back = u128::from(cost) * config.unit;
        let balance = (self.balance() + back).min(config.full);
        Bucket::new(balance, self.last)
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
                prop_assert!(next.balance() <= c.full);
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
