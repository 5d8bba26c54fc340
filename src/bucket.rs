//! One bucket's state and arithmetic (docs/design.md §4). No locks, no Python.
//!
//! Must match `python/bucketlimit/_redis/scripts.lua`: same units, same
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

/// A bucket: its balance in units, the microsecond it was last refilled to,
/// and its headroom: how many units may still be given back (docs/design.md
/// §4, "Giving back"). The balance may never exceed `balance + headroom`,
/// the bucket's cap line, which refills with it; headroom `full - balance`
/// means no constraint but the capacity.
///
/// The balance (an `i128`, negative while reservations wait: a debt) and
/// the headroom (a `u128`, at most `full - balance`) are kept as `u64`
/// halves so that a table entry packs into 64 bytes with short keys inline
/// (128-bit fields would force 16-byte alignment and padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    balance_lo: u64,
    balance_hi: u64,
    last: i64,
    headroom_lo: u64,
    headroom_hi: u64,
}

/// Where a waiting reservation left its bucket's cap line: the bucket's time
/// and `balance + headroom` right after it, the headroom before it and its
/// cost. A give-back that finds the line where this reservation left it
/// (only refilled since) comes from the last waiter and is undone exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Line {
    pub last: i64,
    pub cap: i128,
    pub headroom_before: u128,
    pub cost: u64,
}

impl Bucket {
    /// A full bucket, as of `now`. A missing bucket answers exactly like this.
    #[must_use]
    pub fn full(config: &Config, now: i64) -> Bucket {
        Bucket::new(config.full as i128, now, 0)
    }

    /// A bucket of `balance` units at `last`; `headroom` is kept within
    /// `0..=full - balance` by every operation (the caller's to respect here).
    #[must_use]
    #[inline]
    pub fn new(balance: i128, last: i64, headroom: u128) -> Bucket {
        let bits = balance as u128;
        Bucket {
            balance_lo: bits as u64,
            balance_hi: (bits >> 64) as u64,
            last,
            headroom_lo: headroom as u64,
            headroom_hi: (headroom >> 64) as u64,
        }
    }

    /// `balance` at the same time, with headroom `min(headroom, full - balance)`.
    #[inline(always)]
    fn with_balance(self, config: &Config, balance: i128, headroom: u128) -> Bucket {
        let room = (config.full as i128 - balance) as u128;
        Bucket::new(balance, self.last, headroom.min(room))
    }

    /// Units that may still be given back.
    #[must_use]
    #[inline]
    pub fn headroom(&self) -> u128 {
        (u128::from(self.headroom_hi) << 64) | u128::from(self.headroom_lo)
    }

    /// The line a reservation of `cost` that turned `before` into this
    /// bucket keeps for its give-back: `None` unless it waited (left the
    /// bucket in debt).
    #[must_use]
    pub fn waiting_line(&self, before: &Bucket, cost: u64) -> Option<Line> {
        (self.balance() < 0).then(|| Line {
            last: self.last,
            cap: self.cap(),
            headroom_before: before.headroom(),
            cost,
        })
    }

    /// The cap line's value now: `balance + headroom`.
    #[inline]
    fn cap(&self) -> i128 {
        self.balance() + self.headroom() as i128
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
    #[inline(always)]
    pub fn refilled(self, config: &Config, now: i64) -> Bucket {
        if now <= self.last {
            return self;
        }
        let missing = self.missing(config);
        // Cap before adding: `elapsed * p` is only used when below `missing`.
        match refill(config, now.abs_diff(self.last)) {
            Some(added) if added < missing => {
                let balance = self.balance() + added as i128;
                Bucket::new(balance, now, self.headroom().min(missing - added))
            }
            _ => Bucket::full(config, now),
        }
    }

    /// True when this bucket is full at `now`: `refilled(now).is_full()`,
    /// without building the refilled bucket (the sweep asks it of every entry
    /// it passes).
    #[must_use]
    #[inline]
    pub fn is_full_at(&self, config: &Config, now: i64) -> bool {
        let missing = self.missing(config);
        missing == 0
            || (now > self.last
                && refill(config, now.abs_diff(self.last)).is_none_or(|added| added >= missing))
    }

    /// `refilled(now)`, then `decide(cost)`, in place: what `allow` does to a
    /// held bucket. Same answer and same bucket after, without copying the
    /// bucket through temporaries. `cost` must have passed [`Config::check_cost`].
    #[inline(always)]
    pub fn allow(&mut self, config: &Config, now: i64, cost: u64) -> Decision {
        let (decision, after) = self.refilled(config, now).decide(config, cost);
        *self = after;
        decision
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
    #[inline(always)]
    pub fn until_full(&self, config: &Config) -> Wait {
        wait_for(config, self.missing(config))
    }

    /// What this (already refilled) bucket answers to `cost`, and the bucket
    /// after it: spent when allowed, unchanged when refused.
    /// `cost` must have passed [`Config::check_cost`].
    #[must_use]
    #[inline(always)]
    pub fn decide(self, config: &Config, cost: u64) -> (Decision, Bucket) {
        let need = (u128::from(cost) * config.unit) as i128;
        let balance = self.balance();
        let (allowed, retry_after, after) = if balance >= need {
            (true, Some(0), self.spent(config, need))
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
            let bucket = self.spent(config, need);
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
        let bound = config.max_debt;
        let over_bound = wait_for(config, beyond.saturating_sub(bound)).unwrap_or(0);
        // Delays shrink one for one with time: ceil((x - t*p)/p) = ceil(x/p) - t.
        let over_wait = max_wait.map_or(0, |limit| delay.saturating_sub(limit));
        let refused_for = over_bound.max(over_wait);
        if refused_for == 0 {
            // A waiter: the cap line drops to its balance, so nothing given
            // back by those before it can be used alongside or before it.
            let bucket = Bucket::new(after, self.last, 0);
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
        let floor = -(config.max_debt as i128);
        let after = u128::from(cost)
            .checked_mul(config.unit)
            .and_then(|need| i128::try_from(need).ok())
            .map_or(floor, |need| (self.balance() - need).max(floor));
        let charged = (self.balance() - after) as u128;
        let bucket = self.with_balance(config, after, self.headroom() + charged);
        let decision = if after >= 0 {
            bucket.describe(config, true, Some(0))
        } else {
            bucket.describe(config, false, wait_for(config, after.unsigned_abs()))
        };
        (decision, bucket)
    }

    /// This (already refilled) bucket after an upstream's report, at `now`
    /// (docs/design.md §4, "Following the upstream"): its balance becomes at most
    /// the report's bound, never more than it was, down to the debt bound. The
    /// cap line stays, as for a charge (the upstream spent those tokens; a
    /// reservation's give-back still comes back). Answers the bucket as it
    /// stands: allowed when it holds a token, `retry_after` the wait for one.
    #[must_use]
    pub fn observed(self, config: &Config, report: &Report, now: i64) -> (Decision, Bucket) {
        let bucket = match report.bound(config, now) {
            Some(bound) if bound < self.balance() => {
                let removed = (self.balance() - bound) as u128;
                self.with_balance(config, bound, self.headroom() + removed)
            }
            _ => self,
        };
        let unit = config.unit as i128;
        let missing = (unit - bucket.balance()).max(0) as u128;
        let decision = bucket.describe(config, missing == 0, wait_for(config, missing));
        (decision, bucket)
    }

    /// A decision reporting this bucket's state as it stands.
    #[must_use]
    #[inline(always)]
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

    /// Spends `need` units (the balance stays >= 0): the cap line does not
    /// move, so the headroom grows by what was spent.
    #[inline(always)]
    fn spent(self, config: &Config, need: i128) -> Bucket {
        self.with_balance(
            config,
            self.balance() - need,
            self.headroom() + need as u128,
        )
    }

    /// Gives `cost` tokens back to this (already refilled) bucket, never above
    /// capacity and never above the cap line (docs/design.md §4, "Giving
    /// back"). `line` is where a waiting reservation left the line: found
    /// there, the give-back comes from the last waiter and is undone exactly
    /// (the line rises with the balance); otherwise it takes headroom, and a
    /// give-back ahead of a reservation still waiting adds nothing.
    #[must_use]
    pub fn given_back(self, config: &Config, cost: u64, line: Option<Line>) -> Bucket {
        let back = u128::from(cost) * config.unit;
        if let Some(line) = line.filter(|line| self.is_on(config, *line)) {
            let balance = (self.balance() + back as i128).min(config.full as i128);
            // All of it: as if it had never been made. Part: the line rises
            // with the balance.
            let headroom = if cost >= line.cost {
                line.headroom_before
            } else {
                self.headroom()
            };
            return self.with_balance(config, balance, headroom);
        }
        let back = back.min(self.headroom());
        Bucket::new(
            self.balance() + back as i128,
            self.last,
            self.headroom() - back,
        )
    }

    /// True when this bucket's cap line is `line`, refilled since.
    fn is_on(&self, config: &Config, line: Line) -> bool {
        let Some(elapsed) = u128::try_from(i128::from(self.last) - i128::from(line.last)).ok()
        else {
            return false;
        };
        elapsed
            .checked_mul(config.per_micro)
            .and_then(|added| i128::try_from(added).ok())
            .and_then(|added| line.cap.checked_add(added))
            == Some(self.cap())
    }
}

/// What an upstream reported about a key, as one bound on the bucket
/// (docs/design.md §4, "Following the upstream"): the bucket may hold at most
/// `cap` units at the microsecond `at`, and at most `cap` plus its own refill
/// since then at any later time. `cap` is at least the debt bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report {
    pub cap: i128,
    pub at: i64,
}

impl Report {
    /// The bound an upstream's words set at `at`: `remaining` tokens left; its
    /// `limit` (the limiter's capacity when not said); `reset_after`, the µs
    /// after `at` until it is full again, refilling steadily (`Some(None)`:
    /// never); `retry_after`, the µs after `at` before it accepts anything (a
    /// 429's hold; `Some(None)`: never). Each bound is a point on the bucket's
    /// own refill line:
    /// - the bucket holds at most `min(remaining, limit)` tokens at `at`;
    /// - it reaches `m = min(capacity, limit)` tokens no sooner than the
    ///   upstream does (`reset_after` said): `m` less its own refill until then;
    ///
    /// the lower of the two is kept, unless a hold is said: then less than a
    /// token until the hold's end and one token at it, whatever the others say.
    #[must_use]
    pub fn new(
        config: &Config,
        remaining: u64,
        limit: Option<u64>,
        reset_after: Option<Wait>,
        retry_after: Option<Wait>,
        at: i64,
    ) -> Report {
        let unit = config.unit as i128;
        let floor = -(config.max_debt as i128);
        let limit_given = limit.unwrap_or(config.capacity);
        let left = remaining.min(limit_given);
        let mut cap = i128::from(left.min(config.capacity)) * unit;
        if config.per_micro == 0 {
            // A quota never refills: a reset or a hold, which are about refill,
            // bound nothing; the report can only lower it to what remains.
            return Report { cap, at };
        }
        // `level` tokens less the refill of `wait` µs (`None`: never, the debt
        // bound): the bucket's line through the point (at + wait, level).
        let line = |level: u64, wait: Wait| -> i128 {
            wait.and_then(|w| w.checked_mul(config.per_micro))
                .and_then(|units| i128::try_from(units).ok())
                .map_or(floor, |units| (i128::from(level) * unit - units).max(floor))
        };
        if let Some(hold) = retry_after {
            // The upstream names when it takes a request again: that settles it.
            // What remains would put the token later (a 429's "0 left" at 100 an
            // hour is a token 36 s on, whatever the hold).
            return Report {
                cap: line(1, hold),
                at,
            };
        }
        if let Some(reset) = reset_after {
            let m = config.capacity.min(limit_given);
            if left < m {
                // The upstream goes from `left` to `limit` in `reset` µs: it holds
                // `m` after ceil((m - left) * reset / (limit - left)) µs.
                let until_m = reset.and_then(|reset| {
                    u128::from(m - left)
                        .checked_mul(reset)
                        .map(|x| x.div_ceil(u128::from(limit_given - left)))
                });
                cap = cap.min(line(m, until_m));
            }
        }
        Report {
            cap: cap.max(floor),
            at,
        }
    }

    /// The most units the bucket may hold at `now`: `cap` refilled since `at` at
    /// the limiter's rate (a report from the future counts as now); `None` when
    /// that is a full bucket or more, which bounds nothing.
    #[must_use]
    pub fn bound(&self, config: &Config, now: i64) -> Option<i128> {
        let full = config.full as i128;
        let missing = (full - self.cap) as u128; // cap <= full
        let elapsed = u64::try_from(i128::from(now) - i128::from(self.at)).unwrap_or(0);
        match refill(config, elapsed) {
            Some(added) if added < missing => Some(self.cap + added as i128),
            _ => None,
        }
    }
}

/// Units refilled in `elapsed` microseconds; `None` beyond u128. One
/// widening multiply when the rate's numerator fits in u64 (always, but for
/// absurd rates), instead of a checked 128-bit one.
#[inline(always)]
fn refill(config: &Config, elapsed: u64) -> Option<u128> {
    match u64::try_from(config.per_micro) {
        Ok(p) => Some(u128::from(elapsed) * u128::from(p)),
        Err(_) => u128::from(elapsed).checked_mul(config.per_micro),
    }
}

/// Microseconds until `units` have refilled: ceil(units / p); `None` at rate 0
/// (unless nothing is missing).
#[inline(always)]
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
        assert_eq!(b.given_back(&c, 10, None).balance(), 7 * c.unit as i128);
        assert!(b
            .given_back(&c, 10, None)
            .given_back(&c, 10, None)
            .is_full(&c));
    }

    #[test]
    fn a_give_back_ahead_of_a_waiter_is_not_used_alongside_it() {
        // Capacity 1, 1 token/s: r1 now, r2 at 1 s, r3 at 2 s. Cancelling r2
        // must not let r4 be ready at 2 s with r3: it comes at 3 s.
        let c = config(1, 1.0);
        let (_, b1) = Bucket::full(&c, 0).reserve(&c, 1, None);
        let (r2, b2) = b1.reserve(&c, 1, None);
        let line2 = b2.waiting_line(&b1, 1);
        let (r3, b) = b2.reserve(&c, 1, None);
        let s = |n: u128| Some(n * 1_000_000);
        assert_eq!((r2.delay, r3.delay), (s(1), s(2)));
        let after = b.refilled(&c, 500_000);
        assert_eq!(
            after.given_back(&c, 1, line2),
            after,
            "nothing to give back"
        );
        let (r4, _) = after.reserve(&c, 1, None);
        assert_eq!(r4.delay, Some(2_500_000)); // ready at 3 s
                                               // allow() is refused until r3 is served, and then waits its turn.
        let (d, _) = after.decide(&c, 1);
        assert_eq!(d.retry_after, Some(2_500_000));
    }

    #[test]
    fn the_last_waiter_gives_back_exactly() {
        let c = config(2, 1.0);
        let (_, b0) = Bucket::full(&c, 0).decide(&c, 2);
        let (_, b1) = b0.reserve(&c, 1, None);
        let line1 = b1.waiting_line(&b0, 1);
        let (_, b2) = b1.reserve(&c, 2, None);
        let line2 = b2.waiting_line(&b1, 2);
        assert!(line1.is_some() && line2.is_some());
        // r2 is the last waiter: undone exactly, and r1 is last again.
        let t = 300_000;
        let back2 = b2.refilled(&c, t).given_back(&c, 2, line2);
        assert_eq!(back2, b1.refilled(&c, t));
        let back1 = back2.given_back(&c, 1, line1);
        assert_eq!(back1, b0.refilled(&c, t));
        // r1 given back while r2 still waits: nothing comes back.
        let ahead = b2.refilled(&c, t).given_back(&c, 1, line1);
        assert_eq!(ahead, b2.refilled(&c, t));
    }

    #[test]
    fn spends_with_no_waiter_come_back_as_before() {
        let c = config(10, 1.0);
        let (_, b) = Bucket::full(&c, 0).decide(&c, 4);
        let (_, b) = b.reserve(&c, 3, None);
        let b = b.given_back(&c, 3, None).given_back(&c, 4, None);
        assert!(b.is_full(&c));
        // Never above capacity.
        let (_, b) = Bucket::full(&c, 0).decide(&c, 1);
        assert!(b.given_back(&c, 5, None).is_full(&c));
    }

    const S: u128 = 1_000_000;

    fn report(c: &Config, remaining: u64, at: i64) -> Report {
        Report::new(c, remaining, None, None, None, at)
    }

    #[test]
    fn a_report_lowers_the_bucket_and_never_raises_it() {
        let c = config(100, 10.0);
        let (d, b) = Bucket::full(&c, 0).observed(&c, &report(&c, 30, 0), 0);
        assert_eq!(b.balance(), 30 * c.unit as i128);
        assert!(d.allowed);
        assert_eq!((d.remaining, d.reset_after), (30, Some(7 * S)));
        let (d, same) = b.observed(&c, &report(&c, 80, 0), 0);
        assert_eq!((same, d.remaining), (b, 30));
        // More than the capacity bounds nothing.
        let (_, full) = Bucket::full(&c, 0).observed(&c, &report(&c, u64::MAX, 0), 0);
        assert!(full.is_full(&c));
    }

    #[test]
    fn a_stale_report_is_refilled_to_now() {
        // "0 left" 5 s ago at 10 tokens/s bounds the bucket at 50 now.
        let c = config(100, 10.0);
        let (d, b) = Bucket::full(&c, 5 * S as i64).observed(&c, &report(&c, 0, 0), 5 * S as i64);
        assert_eq!((d.remaining, b.balance()), (50, 50 * c.unit as i128));
        // A report from the future counts as now.
        let (d, _) = Bucket::full(&c, 0).observed(&c, &report(&c, 20, 9 * S as i64), 0);
        assert_eq!(d.remaining, 20);
    }

    #[test]
    fn the_bucket_reaches_the_upstreams_limit_no_sooner_than_the_upstream() {
        // Configured 10 % above the upstream: capacity 110 at 11/s, the upstream's
        // limit 100 at 10/s. Empty upstream (full in 10 s): the bucket must not hold
        // 100 before 10 s, so now it owes 10 tokens.
        let c = config(110, 11.0);
        let r = Report::new(&c, 0, Some(100), Some(Some(10 * S)), None, 0);
        assert_eq!(r.cap, -10 * c.unit as i128);
        let (d, b) = Bucket::full(&c, 0).observed(&c, &r, 0);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(S)); // 11 tokens at 11/s
        assert_eq!(
            b.refilled(&c, 10 * S as i64).balance(),
            100 * c.unit as i128
        );
        // Half full (50 of 100, full in 5 s): 100 - 11 * 5 = 45 now.
        let r = Report::new(&c, 50, Some(100), Some(Some(5 * S)), None, 0);
        assert_eq!(r.cap, 45 * c.unit as i128);
        // Without a limit it is the capacity: 110 - 11 * 2 at 2 s to full.
        let r = Report::new(&c, 88, None, Some(Some(2 * S)), None, 0);
        assert_eq!(r.cap, 88 * c.unit as i128);
        // A limiter below the upstream (capacity 10 of 100, same rate): only what
        // remains matters, once it covers the capacity.
        let small = config(10, 10.0);
        let r = Report::new(&small, 20, Some(100), Some(Some(8 * S)), None, 0);
        assert_eq!(r.cap, 10 * small.unit as i128);
    }

    #[test]
    fn a_hold_lets_no_token_pass_before_its_end() {
        let c = config(10, 2.0);
        let r = Report::new(&c, 0, None, None, Some(Some(3 * S)), 0);
        let (d, b) = Bucket::full(&c, 0).observed(&c, &r, 0);
        assert_eq!(d.retry_after, Some(3 * S));
        let end = 3 * S as i64;
        assert!(!b.refilled(&c, end - 1).decide(&c, 1).0.allowed);
        assert!(b.refilled(&c, end).decide(&c, 1).0.allowed);
        // Never: the debt bound.
        let r = Report::new(&c, 0, None, None, Some(None), 0);
        assert_eq!(r.cap, -((MAX_DEBT_CAPACITIES * c.full) as i128));
    }

    #[test]
    fn a_holds_end_makes_a_token_whatever_else_the_report_says() {
        // 100 an hour: a token every 36 s. "Nothing left" and a reset an hour away
        // would put the next token 36 s on; the 1 s hold puts it at 1 s.
        let c = Config::new(100, Number::Int(100), Number::Int(3600)).unwrap();
        let r = Report::new(&c, 0, Some(100), Some(Some(3600 * S)), Some(Some(S)), 0);
        let (d, held) = Bucket::full(&c, 0).observed(&c, &r, 0);
        assert_eq!(d.retry_after, Some(S));
        assert!(!held.refilled(&c, S as i64 - 1).decide(&c, 1).0.allowed);
        assert!(held.refilled(&c, S as i64).decide(&c, 1).0.allowed);
    }

    #[test]
    fn a_quota_is_only_lowered_to_what_remains() {
        let c = config(10, 0.0);
        let r = Report::new(&c, 4, Some(10), Some(Some(S)), Some(Some(S)), 0);
        assert_eq!(r.cap, 4 * c.unit as i128);
        assert_eq!(r.bound(&c, i64::MAX), Some(r.cap));
    }

    #[test]
    fn a_waiters_cancel_still_comes_back_after_a_report() {
        // The report takes what the upstream spent; the waiter's tokens never
        // reached it, so its cancel gives them back.
        let c = config(10, 1.0);
        let before = Bucket::full(&c, 0);
        let (_, b) = before.reserve(&c, 10, None);
        let (_, waiting) = b.reserve(&c, 5, None);
        let line = waiting.waiting_line(&b, 5);
        let r = Report::new(&c, 0, None, None, Some(Some(8 * S)), 0);
        let (_, observed) = waiting.observed(&c, &r, 0);
        assert_eq!(observed.balance(), -7 * c.unit as i128);
        let back = observed.given_back(&c, 5, line);
        assert_eq!(back.balance(), -2 * c.unit as i128);
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

        /// At the times the tokens are used, every window of T µs holds at
        /// most `full + p*(T + 1)` units (1 µs: delays round up), with
        /// allows, reservations and cancels of waiting reservations mixed;
        /// and nobody is served before a reservation made earlier (FIFO).
        #[test]
        fn uses_obey_the_bound_with_cancels(
            c in arb_config(),
            steps in prop::collection::vec((0i64..400_000, 1u64..1000, 0u8..4, any::<prop::sample::Index>()), 1..80),
        ) {
            prop_assume!(c.per_micro > 0);
            let mut b = Bucket::full(&c, 0);
            let mut now = 0i64;
            // (use time, units, line, cancelled)
            let mut uses: Vec<(i64, u128, Option<Line>, bool)> = Vec::new();
            for (dt, cost, op, pick) in steps {
                now += dt;
                b = b.refilled(&c, now);
                let cost = cost.min(c.capacity);
                let units = u128::from(cost) * c.unit;
                match op {
                    0 => {
                        let (d, next) = b.decide(&c, cost);
                        if d.allowed {
                            prop_assert!(uses.iter().all(|u| u.3 || u.0 <= now), "FIFO");
                            uses.push((now, units, None, false));
                        }
                        b = next;
                    }
                    1 | 2 => {
                        let (r, next) = b.reserve(&c, cost, None);
                        if r.decision.allowed {
                            let ready = now + r.delay.unwrap() as i64;
                            prop_assert!(uses.iter().all(|u| u.3 || u.0 <= ready), "FIFO");
                            uses.push((ready, units, next.waiting_line(&b, cost), false));
                        }
                        b = next;
                    }
                    _ => {
                        let waiting: Vec<usize> = (0..uses.len())
                            .filter(|&i| !uses[i].3 && uses[i].0 > now)
                            .collect();
                        if !waiting.is_empty() {
                            let i = waiting[pick.index(waiting.len())];
                            let cost = (uses[i].1 / c.unit) as u64;
                            b = b.given_back(&c, cost, uses[i].2);
                            uses[i].3 = true;
                        }
                    }
                }
                prop_assert!(b.balance() <= c.full as i128);
            }
            let mut used: Vec<(i64, u128)> =
                uses.iter().filter(|u| !u.3).map(|u| (u.0, u.1)).collect();
            used.sort_unstable();
            for i in 0..used.len() {
                let mut total = 0u128;
                for j in i..used.len() {
                    total += used[j].1;
                    let span = (used[j].0 - used[i].0) as u128 + 1;
                    prop_assert!(
                        total <= c.full + c.per_micro * span,
                        "window {}..{} µs holds {} units", used[i].0, used[j].0, total
                    );
                }
            }
        }

        /// A report never raises the bucket, leaves it within the report's bound
        /// and the debt bound, and two reports give one bucket in either order.
        #[test]
        fn reports_only_lower_and_commute(
            c in arb_config(),
            spent in 0u64..2000,
            words in prop::collection::vec(
                (0u64..1500, prop::option::of(0u64..1500), prop::option::of(0u128..20_000_000),
                 prop::option::of(0u128..5_000_000), 0i64..10_000_000),
                2..3),
            now in 0i64..10_000_000,
        ) {
            let (_, b) = Bucket::full(&c, 0).charged(&c, spent.max(1));
            let b = b.refilled(&c, now);
            let reports: Vec<Report> = words
                .iter()
                .map(|&(r, l, reset, hold, at)| Report::new(&c, r, l, reset.map(Some), hold.map(Some), at))
                .collect();
            let (_, one) = b.observed(&c, &reports[0], now);
            prop_assert!(one.balance() <= b.balance(), "never raised");
            prop_assert!(one.balance() >= -((MAX_DEBT_CAPACITIES * c.full) as i128));
            if let Some(bound) = reports[0].bound(&c, now) {
                prop_assert!(one.balance() <= bound.max(-((MAX_DEBT_CAPACITIES * c.full) as i128)));
            }
            let (_, ab) = one.observed(&c, &reports[1], now);
            let (_, ba) = b.observed(&c, &reports[1], now).1.observed(&c, &reports[0], now);
            prop_assert_eq!(ab.balance(), ba.balance());
            prop_assert!(ab.headroom() <= (c.full as i128 - ab.balance()) as u128);
        }

        /// After a hold of `h` µs nothing passes before its end, whatever the
        /// bucket held; one token passes at it, whatever else the report says,
        /// when the bucket held that much (a report never raises it).
        #[test]
        fn nothing_passes_during_a_hold(
            c in arb_config(),
            spent in 0u64..1000,
            hold in 1u128..5_000_000,
            cost in 1u64..1000,
            remaining in prop::option::of(0u64..1500),
            reset in prop::option::of(0u128..20_000_000),
        ) {
            prop_assume!(c.per_micro > 0);
            let (_, b) = Bucket::full(&c, 0).decide(&c, spent.min(c.capacity));
            let left = remaining.unwrap_or(u64::MAX);
            let r = Report::new(&c, left, None, reset.map(Some), Some(Some(hold)), 0);
            let (d, held) = b.observed(&c, &r, 0);
            prop_assert!(d.retry_after >= Some(hold));
            let end = hold as i64;
            prop_assert!(!held.refilled(&c, end - 1).decide(&c, cost.min(c.capacity)).0.allowed);
            if r.cap > -((MAX_DEBT_CAPACITIES * c.full) as i128) && b.balance() >= r.cap {
                prop_assert!(held.refilled(&c, end).decide(&c, 1).0.allowed);
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
