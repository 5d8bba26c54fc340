//! The one error type of the core. `py.rs` maps it to Python exceptions in
//! one exhaustive `match`; every variant is a wrong *value* (`ValueError`):
//! wrong *types* are caught in the binding before the core sees them.

use std::fmt;

/// The longest key accepted, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// Capacity below 1.
    Capacity(String),
    /// Rate negative, NaN or infinite.
    Rate(String),
    /// `per` zero, negative, NaN or infinite.
    Per(String),
    /// A value whose exact integer form would not fit.
    OutOfRange { what: &'static str, value: String },
    /// Cost below 1.
    Cost(String),
    /// Cost above capacity: the request could never pass.
    CostAboveCapacity { cost: i128, capacity: u64 },
    /// A charge (use that already happened) beyond 2^64 - 1 tokens.
    ChargeTooLarge(String),
    /// An empty key (a missing user id would share one bucket).
    EmptyKey,
    /// A key longer than [`MAX_KEY_BYTES`].
    KeyTooLong(usize),
    /// A clock reading that is NaN, infinite or beyond ±2^62 µs.
    Clock(String),
    /// The same (limiter, key) twice in one `allow_all`.
    DuplicateCheck(String),
    /// An `allow_all` with nothing to check.
    NoChecks,
    /// A concurrency limit outside 1 ..= 2^32 − 1.
    Limit(String),
    /// A permit's ttl that is not a finite number of seconds of at least a
    /// microsecond.
    Ttl(String),
    /// A concurrency check asking for other than one permit.
    Permits(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Capacity(v) => write!(f, "capacity must be >= 1, got {v}"),
            Error::Rate(v) => write!(f, "rate must be a finite number >= 0, got {v}"),
            Error::Per(v) => write!(f, "per must be a finite number > 0, got {v}"),
            Error::OutOfRange { what, value } => write!(
                f,
                "{what} {value} is beyond the exact range of the limiter \
                 (capacity * units per token and the refill per microsecond must stay below 2**100)"
            ),
            Error::Cost(v) => write!(f, "cost must be >= 1, got {v}"),
            Error::CostAboveCapacity { cost, capacity } => write!(
                f,
                "cost {cost} exceeds capacity {capacity}: the request could never pass"
            ),
            Error::ChargeTooLarge(v) => write!(
                f,
                "the cost of a charge must be at most 2**64 - 1 tokens, got {v}"
            ),
            Error::EmptyKey => write!(
                f,
                "key must not be empty (a missing id would share one bucket)"
            ),
            Error::KeyTooLong(n) => write!(
                f,
                "key is {n} bytes of UTF-8; at most {MAX_KEY_BYTES} are allowed"
            ),
            Error::Clock(v) => write!(
                f,
                "clock returned {v}: seconds must be finite and within +/-2**62 microseconds"
            ),
            Error::DuplicateCheck(key) => write!(
                f,
                "allow_all got the same (limiter, key) twice: key {key:?}"
            ),
            Error::NoChecks => write!(f, "allow_all needs at least one (limiter, key)"),
            Error::Limit(v) => write!(f, "limit must be an int from 1 to 4294967295, got {v}"),
            Error::Ttl(v) => write!(
                f,
                "ttl must be a finite number of seconds >= 0.000001 (and within +/-2**62 \
                 microseconds), got {v}"
            ),
            Error::Permits(v) => write!(
                f,
                "a concurrency limiter's check takes one permit: its cost must be 1, got {v}"
            ),
        }
    }
}

impl std::error::Error for Error {}

/// Checks a key: not empty, at most [`MAX_KEY_BYTES`] bytes.
///
/// # Errors
/// [`Error::EmptyKey`] or [`Error::KeyTooLong`].
pub fn check_key(key: &str) -> Result<(), Error> {
    if key.is_empty() {
        Err(Error::EmptyKey)
    } else if key.len() > MAX_KEY_BYTES {
        Err(Error::KeyTooLong(key.len()))
    } else {
        Ok(())
    }
}
