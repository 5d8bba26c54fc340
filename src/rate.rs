//! The exact configuration of a limiter: capacity and rate as integers.
//!
//! A rate is a reduced fraction `p/q` tokens per second, taken from the
//! shortest decimal form of each number (`0.1` is 1/10, never
//! 0.1000000000000000055...). One token is `U = q * 1_000_000` units, so one
//! microsecond refills exactly `p` units and no arithmetic ever rounds.
//! The Redis script gets the same numbers from here, not from a copy: the
//! Redis limiter calls `_core.exact_units` (`py.rs`).

use crate::error::Error;

/// Microseconds in a second.
pub const MICROS: u128 = 1_000_000;

/// Upper bound for `capacity * U` and for `p`. Sums and comparisons of such
/// values stay far inside u128, and refill multiplies only after checking.
pub const MAX_UNITS: u128 = 1 << 100;

/// A number as Python gave it: an integer, or a float read by its shortest
/// decimal form.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Number {
    Int(i128),
    Float(f64),
}

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Number::Int(n) => write!(f, "{n}"),
            Number::Float(x) => write!(f, "{x:?}"),
        }
    }
}

/// A non-negative fraction `num / den`, not necessarily reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fraction {
    num: u128,
    den: u128,
}

/// Reads a non-negative finite number exactly. `None` when it is negative,
/// not finite, or does not fit the exact range.
fn exact_fraction(n: Number) -> Option<Fraction> {
    match n {
        Number::Int(i) => Some(Fraction {
            num: u128::try_from(i).ok()?,
            den: 1,
        }),
        Number::Float(x) => {
            if !x.is_finite() || x < 0.0 {
                return None;
            }
            if x == 0.0 {
                // Also -0.0, which equals 0 but prints as "-0e0".
                return Some(Fraction { num: 0, den: 1 });
            }
            decimal_fraction(x)
        }
    }
}

/// `x` by its shortest round-trip decimal digits: Rust's `{:e}` prints the
/// same shortest digits as Python's `repr`, e.g. `2.5e0`, `1e-1`.
fn decimal_fraction(x: f64) -> Option<Fraction> {
    let text = format!("{x:e}");
    let (mantissa, exponent) = text.split_once('e')?;
    let exponent: i32 = exponent.parse().ok()?;
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits: u128 = format!("{int_part}{frac_part}").parse().ok()?;
    let scale = exponent - i32::try_from(frac_part.len()).ok()?;
    let power = 10u128.checked_pow(scale.unsigned_abs())?;
    if scale >= 0 {
        Some(Fraction {
            num: digits.checked_mul(power)?,
            den: 1,
        })
    } else {
        Some(Fraction {
            num: digits,
            den: power,
        })
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A validated limiter configuration, in integer units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Tokens the bucket holds when full.
    pub capacity: u64,
    /// Units refilled per microsecond (the rate's numerator).
    pub per_micro: u128,
    /// Units in one token: the rate's denominator times 1,000,000.
    pub unit: u128,
    /// `capacity * unit`: the balance of a full bucket.
    pub full: u128,
    /// The most units a bucket may owe: `MAX_DEBT_CAPACITIES * full`
    /// (docs/design.md §4). Kept apart from `full` so that a bucket whose cap
    /// is lowered (the Redis module's leased buckets) keeps the bound of its
    /// capacity.
    pub max_debt: u128,
    /// The rate's reduced denominator `q` (tokens per second = `per_micro / q`).
    pub rate_den: u128,
    /// `unit` and `per_micro` with precomputed reciprocals, for the two
    /// divisions every decision makes (a hardware division costs more).
    pub unit_div: Divisor,
    pub per_micro_div: Divisor,
}

/// A divisor with its reciprocal precomputed when it fits in u64 and is not 0.
#[derive(Clone, Copy, Debug)]
pub struct Divisor(Option<strength_reduce::StrengthReducedU64>);

impl Divisor {
    fn new(d: u128) -> Divisor {
        Divisor(
            u64::try_from(d)
                .ok()
                .filter(|&d| d > 0)
                .map(strength_reduce::StrengthReducedU64::new),
        )
    }

    /// `floor(a / d)` by multiplication when both fit in u64.
    #[inline]
    #[must_use]
    pub fn div_floor(self, a: u128, d: u128) -> u128 {
        match (u64::try_from(a), self.0) {
            (Ok(a), Some(reduced)) => u128::from(a / reduced),
            _ => a / d,
        }
    }

    /// `ceil(a / d)`, the same way.
    #[inline]
    #[must_use]
    pub fn div_ceil(self, a: u128, d: u128) -> u128 {
        match (u64::try_from(a), self.0) {
            (Ok(a), Some(reduced)) => {
                let q = a / reduced;
                u128::from(q + u64::from(q * reduced.get() < a))
            }
            _ => a.div_ceil(d),
        }
    }
}

impl PartialEq for Divisor {
    fn eq(&self, other: &Divisor) -> bool {
        self.0.map(|d| d.get()) == other.0.map(|d| d.get())
    }
}

impl Eq for Divisor {}

impl Config {
    /// Builds the exact configuration, or says which value is wrong.
    ///
    /// # Errors
    /// [`Error::Capacity`], [`Error::Rate`], [`Error::Per`] for values out of
    /// their domain; [`Error::OutOfRange`] when the exact units would not fit.
    pub fn new(capacity: i128, rate: Number, per: Number) -> Result<Config, Error> {
        if capacity < 1 {
            return Err(Error::Capacity(capacity.to_string()));
        }
        let capacity = u64::try_from(capacity).map_err(|_| Error::OutOfRange {
            what: "capacity",
            value: capacity.to_string(),
        })?;
        let rate_f = exact_fraction(rate).ok_or_else(|| match rate {
            Number::Float(x) if x.is_finite() && x >= 0.0 => Error::OutOfRange {
                what: "rate",
                value: rate.to_string(),
            },
            _ => Error::Rate(rate.to_string()),
        })?;
        let per_f = exact_fraction(per)
            .filter(|f| f.num > 0)
            .ok_or_else(|| match per {
                Number::Float(x) if x.is_finite() && x > 0.0 => Error::OutOfRange {
                    what: "per",
                    value: per.to_string(),
                },
                _ => Error::Per(per.to_string()),
            })?;
        let out_of_range = || Error::OutOfRange {
            what: "rate/per",
            value: format!("{rate}/{per}"),
        };
        // (a/b) / (c/d) = (a*d) / (b*c), reduced.
        let (mut p, mut q) = if rate_f.num == 0 {
            (0, 1)
        } else {
            let g1 = gcd(rate_f.num, per_f.num);
            let g2 = gcd(per_f.den, rate_f.den);
            (
                (rate_f.num / g1)
                    .checked_mul(per_f.den / g2)
                    .ok_or_else(out_of_range)?,
                (rate_f.den / g2)
                    .checked_mul(per_f.num / g1)
                    .ok_or_else(out_of_range)?,
            )
        };
        let g = gcd(p, q);
        if g > 1 {
            (p, q) = (p / g, q / g);
        }
        let unit = q.checked_mul(MICROS).ok_or_else(out_of_range)?;
        let full = unit
            .checked_mul(u128::from(capacity))
            .filter(|&full| full <= MAX_UNITS)
            .ok_or_else(|| Error::OutOfRange {
                what: "capacity",
                value: format!("{capacity} with rate {rate}/{per}"),
            })?;
        if p > MAX_UNITS {
            return Err(out_of_range());
        }
        Ok(Config {
            capacity,
            per_micro: p,
            unit,
            full,
            max_debt: crate::bucket::MAX_DEBT_CAPACITIES * full,
            rate_den: q,
            unit_div: Divisor::new(unit),
            per_micro_div: Divisor::new(p),
        })
    }

    /// The configuration of a limiter from its exact units, as the Python layer
    /// sends them to the Redis module (`_core.exact_units`): `capacity` tokens of
    /// `unit` units each (a whole number of millionths of a token per µs), `p`
    /// units refilled per microsecond.
    ///
    /// # Errors
    /// [`Error::Capacity`] below 1; [`Error::OutOfRange`] for a unit that is not
    /// a positive multiple of 1,000,000, or units beyond the exact range.
    pub fn from_units(capacity: u64, unit: u128, p: u128) -> Result<Config, Error> {
        if capacity < 1 {
            return Err(Error::Capacity(capacity.to_string()));
        }
        let out_of_range = |what, value: String| Error::OutOfRange { what, value };
        if unit == 0 || unit % MICROS != 0 {
            return Err(out_of_range("unit", unit.to_string()));
        }
        let full = unit
            .checked_mul(u128::from(capacity))
            .filter(|&full| full <= MAX_UNITS)
            .ok_or_else(|| out_of_range("capacity", format!("{capacity} of {unit} units")))?;
        if p > MAX_UNITS {
            return Err(out_of_range("p", p.to_string()));
        }
        Ok(Config {
            capacity,
            per_micro: p,
            unit,
            full,
            max_debt: crate::bucket::MAX_DEBT_CAPACITIES * full,
            rate_den: unit / MICROS,
            unit_div: Divisor::new(unit),
            per_micro_div: Divisor::new(p),
        })
    }

    /// This configuration with its bucket's cap lowered to `top` units
    /// (`top <= full`): what refills and spends see while the Redis module's
    /// leases hold the rest (docs/design.md §6, "Hot keys: leases"). The debt
    /// bound stays the capacity's.
    #[must_use]
    pub fn capped(&self, top: u128) -> Config {
        Config {
            full: top.min(self.full),
            ..*self
        }
    }

    /// Tokens per second, as a float (for display only).
    #[must_use]
    pub fn rate_per_second(&self) -> f64 {
        self.per_micro as f64 / self.rate_den as f64
    }

    /// Checks that `cost` could ever pass, and returns it.
    ///
    /// # Errors
    /// See [`check_cost`].
    pub fn check_cost(&self, cost: i128) -> Result<u64, Error> {
        check_cost(cost, self.capacity)
    }
}

/// Checks the cost of a charge (use that already happened, so any number of
/// tokens from 1 to 2^64 - 1, above capacity too), and returns it. The Redis
/// limiter calls this too (`_core.check_charge`).
///
/// # Errors
/// [`Error::Cost`] below 1; [`Error::ChargeTooLarge`] beyond 2^64 - 1.
pub fn check_charge(cost: i128) -> Result<u64, Error> {
    if cost < 1 {
        return Err(Error::Cost(cost.to_string()));
    }
    u64::try_from(cost).map_err(|_| Error::ChargeTooLarge(cost.to_string()))
}

/// Checks that `cost` could ever pass a bucket of `capacity`, and returns it.
/// The Redis limiter calls this too (`_core.check_cost`): one rule, one message.
///
/// # Errors
/// [`Error::Cost`] below 1; [`Error::CostAboveCapacity`] above capacity.
pub fn check_cost(cost: i128, capacity: u64) -> Result<u64, Error> {
    if cost < 1 {
        return Err(Error::Cost(cost.to_string()));
    }
    match u64::try_from(cost) {
        Ok(c) if c <= capacity => Ok(c),
        _ => Err(Error::CostAboveCapacity { cost, capacity }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(capacity: i128, rate: Number, per: Number) -> Config {
        Config::new(capacity, rate, per).unwrap()
    }

    #[test]
    fn floats_read_by_shortest_decimal_form() {
        assert_eq!(decimal_fraction(0.1), Some(Fraction { num: 1, den: 10 }));
        assert_eq!(decimal_fraction(2.5), Some(Fraction { num: 25, den: 10 }));
        assert_eq!(
            decimal_fraction(1e20),
            Some(Fraction {
                num: 100_000_000_000_000_000_000,
                den: 1
            })
        );
        assert_eq!(decimal_fraction(1e-300), None);
    }

    #[test]
    fn rate_is_reduced_fraction_over_per() {
        let c = cfg(10, Number::Float(2.5), Number::Int(1));
        assert_eq!((c.per_micro, c.rate_den), (5, 2));
        let c = cfg(10, Number::Int(100), Number::Int(60));
        assert_eq!((c.per_micro, c.rate_den), (5, 3));
        let c = cfg(10, Number::Float(0.1), Number::Float(0.5));
        assert_eq!((c.per_micro, c.rate_den), (1, 5));
        let c = cfg(3, Number::Float(-0.0), Number::Int(1));
        assert_eq!((c.per_micro, c.rate_den), (0, 1));
        let c = cfg(3, Number::Int(0), Number::Float(7.0));
        assert_eq!((c.per_micro, c.rate_den, c.unit), (0, 1, 1_000_000));
        assert_eq!(c.full, 3_000_000);
    }

    #[test]
    fn bad_values_are_rejected() {
        let one = Number::Int(1);
        assert_eq!(Config::new(0, one, one), Err(Error::Capacity("0".into())));
        assert!(matches!(
            Config::new(1, Number::Float(-1.0), one),
            Err(Error::Rate(_))
        ));
        assert!(matches!(
            Config::new(1, Number::Float(f64::NAN), one),
            Err(Error::Rate(_))
        ));
        assert!(matches!(
            Config::new(1, one, Number::Int(0)),
            Err(Error::Per(_))
        ));
        assert!(matches!(
            Config::new(1, one, Number::Float(f64::INFINITY)),
            Err(Error::Per(_))
        ));
        assert!(matches!(
            Config::new(1, Number::Float(1e-300), one),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            Config::new(1, Number::Float(1e300), one),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            Config::new(i128::from(u64::MAX), Number::Float(0.000_01), one),
            Err(Error::OutOfRange { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn precomputed_division_is_exact(
            a in proptest::prop_oneof![0u128..1_000_000_000, 0u128..(1 << 64), 0u128..(1 << 70)],
            d in proptest::prop_oneof![1u128..1000, 1u128..(1 << 64), 1u128..(1 << 66)],
        ) {
            let div = Divisor::new(d);
            proptest::prop_assert_eq!(div.div_floor(a, d), a / d);
            proptest::prop_assert_eq!(div.div_ceil(a, d), a.div_ceil(d));
        }
    }

    #[test]
    fn from_units_is_what_new_computes() {
        let c = cfg(10, Number::Float(2.5), Number::Int(3));
        assert_eq!(Config::from_units(10, c.unit, c.per_micro), Ok(c));
        assert!(Config::from_units(0, 1_000_000, 1).is_err());
        assert!(Config::from_units(1, 999_999, 1).is_err());
        assert!(Config::from_units(u64::MAX, 1 << 60, 1).is_err());
        assert!(Config::from_units(1, 1_000_000, MAX_UNITS + 1).is_err());
        let top = c.capped(4 * c.unit);
        assert_eq!((top.full, top.max_debt), (4 * c.unit, c.max_debt));
    }

    #[test]
    fn cost_checks() {
        let c = cfg(3, Number::Int(1), Number::Int(1));
        assert_eq!(c.check_cost(3), Ok(3));
        assert_eq!(
            c.check_cost(4),
            Err(Error::CostAboveCapacity {
                cost: 4,
                capacity: 3
            })
        );
        assert!(c.check_cost(0).is_err());
    }
}
