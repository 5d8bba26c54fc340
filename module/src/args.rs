//! A command's arguments, read strictly: a bad one is an error reply naming it
//! and the value, never a guess.

use bucketlimit::bucket::Line;
use bucketlimit::rate::{check_charge, check_cost, Config};

use crate::keyspace::Error;
use crate::stored::{signed, unsigned};

/// An error reply for argument `what` of `command`.
fn bad(command: &str, what: &str, value: &[u8], expected: &str) -> Error {
    Error::Reply(format!(
        "ERR {command}: {what} must be {expected}, got '{}'",
        String::from_utf8_lossy(value)
    ))
}

/// The arguments of one command, read in order.
pub struct Args<'a> {
    pub command: &'static str,
    values: &'a [&'a [u8]],
    at: usize,
}

impl<'a> Args<'a> {
    #[must_use]
    pub fn new(command: &'static str, values: &'a [&'a [u8]]) -> Args<'a> {
        Args {
            command,
            values,
            at: 0,
        }
    }

    fn next(&mut self) -> &'a [u8] {
        let value = self.values.get(self.at).copied().unwrap_or_default();
        self.at += 1;
        value
    }

    pub fn key(&mut self) -> &'a [u8] {
        self.next()
    }

    /// Any bytes (a caller's name, a permit's member); empty for none.
    pub fn bytes(&mut self) -> &'a [u8] {
        self.next()
    }

    /// `now` in µs, or empty for the server's clock.
    pub fn now(&mut self) -> Result<Option<i64>, Error> {
        let value = self.next();
        if value.is_empty() {
            return Ok(None);
        }
        signed(value)
            .and_then(|v| i64::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| {
                bad(
                    self.command,
                    "now",
                    value,
                    "microseconds as an integer, or empty for the server's clock",
                )
            })
    }

    /// `capacity unit p`: a bucket's configuration in the core's units.
    pub fn config(&mut self) -> Result<Config, Error> {
        let capacity = self.next();
        let unit = self.next();
        let p = self.next();
        let capacity_n = unsigned(capacity)
            .and_then(|c| u64::try_from(c).ok())
            .ok_or_else(|| {
                bad(
                    self.command,
                    "capacity",
                    capacity,
                    "an integer from 1 to 2**64 - 1",
                )
            })?;
        let unit_n = unsigned(unit)
            .ok_or_else(|| bad(self.command, "unit", unit, "a positive multiple of 1000000"))?;
        let p_n = unsigned(p).ok_or_else(|| bad(self.command, "p", p, "an integer >= 0"))?;
        Config::from_units(capacity_n, unit_n, p_n)
            .map_err(|e| Error::Reply(format!("ERR {}: {e}", self.command)))
    }

    /// A cost in tokens, from 1 to the capacity (an allow, a reservation).
    pub fn cost(&mut self, config: &Config) -> Result<i128, Error> {
        let value = self.next();
        let cost = if value.is_empty() {
            Some(1)
        } else {
            signed(value)
        };
        cost.and_then(|c| check_cost(c, config.capacity).ok())
            .map(i128::from)
            .ok_or_else(|| {
                bad(
                    self.command,
                    "cost",
                    value,
                    &format!("an integer from 1 to the capacity {}", config.capacity),
                )
            })
    }

    /// A charge's or a give-back's tokens: from 1 to 2**64 - 1.
    pub fn charge(&mut self) -> Result<i128, Error> {
        let value = self.next();
        signed(value)
            .and_then(|c| check_charge(c).ok())
            .map(i128::from)
            .ok_or_else(|| {
                bad(
                    self.command,
                    "cost",
                    value,
                    "an integer from 1 to 2**64 - 1",
                )
            })
    }

    /// An integer of any sign within i128 (an observe's cap in units).
    pub fn units(&mut self, what: &str) -> Result<i128, Error> {
        let value = self.next();
        signed(value).ok_or_else(|| bad(self.command, what, value, "an integer"))
    }

    /// A wait or an age in µs; empty for `None`.
    pub fn micros(&mut self, what: &str) -> Result<Option<u128>, Error> {
        let value = self.next();
        if value.is_empty() {
            return Ok(None);
        }
        unsigned(value)
            .map(Some)
            .ok_or_else(|| bad(self.command, what, value, "microseconds >= 0, or empty"))
    }

    /// A count >= 0 (tokens asked for, tokens unused).
    pub fn count(&mut self, what: &str) -> Result<u64, Error> {
        let value = self.next();
        if value.is_empty() {
            return Ok(0);
        }
        unsigned(value)
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| bad(self.command, what, value, "an integer >= 0"))
    }

    /// A give-back's line and its reservation's cost, four values, all empty
    /// for none.
    pub fn line(&mut self) -> Result<Option<Line>, Error> {
        let values = [self.next(), self.next(), self.next(), self.next()];
        if values.iter().all(|v| v.is_empty()) {
            return Ok(None);
        }
        let last = signed(values[0]).and_then(|v| i64::try_from(v).ok());
        let cap = signed(values[1]);
        let headroom = unsigned(values[2]);
        let cost = unsigned(values[3]).and_then(|v| u64::try_from(v).ok());
        match (last, cap, headroom, cost) {
            (Some(last), Some(cap), Some(headroom_before), Some(cost)) => Ok(Some(Line {
                last,
                cap,
                headroom_before,
                cost,
            })),
            _ => Err(bad(
                self.command,
                "the line",
                &values.join(&b' '),
                "four integers (l, cap, headroom, the reservation's cost), or four empty values",
            )),
        }
    }
}
