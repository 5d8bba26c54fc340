//! Time in integer microseconds: the built-in monotonic clock, and the rule
//! that turns a clock's seconds into microseconds (docs/design.md §4).
//!
//! The rule is `round(seconds * 1_000_000)` with Python's round-half-to-even.
//! The Redis limiter does not copy it: it calls this code through
//! `_core.clock_to_micros` (`py.rs`), so both backends read a clock alike.

use std::sync::OnceLock;

use crate::error::Error;

/// Clock readings beyond ±2^62 µs are out of range.
pub const MAX_MICROS: i64 = 1 << 62;

/// The built-in clock and its raw reading at the start.
static MONOTONIC: OnceLock<(quanta::Clock, u64)> = OnceLock::new();

/// Calibrates the built-in clock (about a millisecond, once): call it at
/// module import so that no `allow()` pays for it.
pub fn start_monotonic() {
    let _ = monotonic_micros();
}

/// Microseconds on a monotonic clock; no Python call.
///
/// `quanta` reads the time-stamp counter when the CPU's is invariant and
/// falls back to the OS's monotonic clock otherwise. Should two threads ever
/// see readings a hair apart out of order, the registry's rule for a clock
/// that steps back (no refill, time never moves back) covers it.
#[must_use]
#[inline]
pub fn monotonic_micros() -> i64 {
    let (clock, origin) = MONOTONIC.get_or_init(|| {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        (clock, origin)
    });
    // Raw counter to nanoseconds in one multiply-shift, then one division by
    // a constant: no `Instant`/`Duration` round trip (seconds and nanoseconds
    // split apart and joined again). 2^62 µs is 146,000 years of uptime: the
    // cast cannot wrap.
    (clock.delta_as_nanos(*origin, clock.raw()) / 1_000) as i64
}

/// `round(seconds * 1_000_000)`, half to even, as Python computes it.
///
/// # Errors
/// [`Error::Clock`] for NaN, infinities and values beyond ±2^62 µs.
pub fn float_seconds_to_micros(seconds: f64) -> Result<i64, Error> {
    let micros = (seconds * 1_000_000.0).round_ties_even();
    if micros.is_finite() && micros.abs() <= MAX_MICROS as f64 {
        Ok(micros as i64)
    } else {
        Err(Error::Clock(format!("{seconds:?}")))
    }
}

/// Whole seconds to microseconds.
///
/// # Errors
/// [`Error::Clock`] beyond ±2^62 µs.
pub fn int_seconds_to_micros(seconds: i128) -> Result<i64, Error> {
    seconds
        .checked_mul(1_000_000)
        .filter(|m| m.abs() <= i128::from(MAX_MICROS))
        .map(|m| m as i64)
        .ok_or_else(|| Error::Clock(seconds.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_like_python() {
        assert_eq!(float_seconds_to_micros(0.1), Ok(100_000));
        assert_eq!(float_seconds_to_micros(0.000_000_5), Ok(0));
        assert_eq!(float_seconds_to_micros(0.000_001_5), Ok(2));
        assert_eq!(float_seconds_to_micros(-1.25), Ok(-1_250_000));
        assert!(float_seconds_to_micros(f64::NAN).is_err());
        assert!(float_seconds_to_micros(1e300).is_err());
        assert_eq!(int_seconds_to_micros(3), Ok(3_000_000));
        assert!(int_seconds_to_micros(1 << 62).is_err());
    }

    #[test]
    fn monotonic_never_goes_back() {
        let a = monotonic_micros();
        let b = monotonic_micros();
        assert!(b >= a);
    }
}
