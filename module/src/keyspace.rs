//! What the commands need of the server's keyspace, as a trait: the server
//! (`server.rs`) in the module, a map in the tests.

/// A string key's value as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Got {
    Missing,
    Value(Vec<u8>),
    /// The key holds another type (a list, a hash): `WRONGTYPE`.
    WrongType,
}

/// An error the command replies with, as the script would word it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// `WRONGTYPE ...`: a key holds another type.
    WrongType,
    /// A reply of the caller's choosing (`BUCKETLIMIT corrupt ...`, bad arguments).
    Reply(String),
}

impl Error {
    /// The script's error for a value that is not a bucket at key `i` of `n`.
    #[must_use]
    pub fn corrupt(i: usize, n: usize) -> Error {
        Error::Reply(format!(
            "BUCKETLIMIT corrupt bucket value in key {i} of {n}"
        ))
    }
}

/// A reply of a command the module runs (`RedisModule_Call`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    Nil,
    Int(i64),
    Bulk(Vec<u8>),
    Array(Vec<Value>),
}

impl Value {
    #[must_use]
    pub fn int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            // A sorted set's score: an integer, or (past 10^17) a double's digits.
            Value::Bulk(bytes) => {
                let text = std::str::from_utf8(bytes).ok()?;
                text.parse().ok().or_else(|| {
                    let float: f64 = text.parse().ok()?;
                    (float.is_finite() && float.fract() == 0.0).then_some(float as i64)
                })
            }
            _ => None,
        }
    }

    #[must_use]
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bulk(bytes) => Some(bytes),
            _ => None,
        }
    }

    #[must_use]
    pub fn items(&self) -> &[Value] {
        match self {
            Value::Array(items) => items,
            _ => &[],
        }
    }
}

/// A hash's fields and values.
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// The keyspace, as the commands use it. Every write is replicated by its
/// effect (the command and its arguments), never by the module's command,
/// which reads the clock.
pub trait Keyspace {
    /// The server's clock in microseconds (Unix time, as `TIME` reads it).
    fn now(&mut self) -> i64;
    fn get(&mut self, key: &[u8]) -> Got;
    /// `SET key value [PX ttl_ms]`.
    fn set(&mut self, key: &[u8], value: &str, ttl_ms: Option<u64>);
    /// `DEL key`: whether it held something.
    fn del(&mut self, key: &[u8]) -> bool;
    /// A command that reads.
    ///
    /// # Errors
    /// The server's error reply ([`Error::WrongType`] for a key of another type).
    fn call(&mut self, command: &str, args: &[&[u8]]) -> Result<Value, Error>;
    /// A command that writes, replicated as it is.
    ///
    /// # Errors
    /// As [`Keyspace::call`].
    fn write(&mut self, command: &str, args: &[&[u8]]) -> Result<Value, Error>;

    /// The fields and values of a hash (none when it is missing).
    ///
    /// # Errors
    /// [`Error::WrongType`] for a key of another type.
    fn hgetall(&mut self, key: &[u8]) -> Result<Fields, Error> {
        let flat = self.call("HGETALL", &[key])?;
        Ok(flat
            .items()
            .chunks(2)
            .filter_map(|pair| {
                Some((
                    pair.first()?.bytes()?.to_vec(),
                    pair.get(1)?.bytes()?.to_vec(),
                ))
            })
            .collect())
    }

    fn hset(&mut self, key: &[u8], field: &[u8], value: &[u8]) {
        let _ = self.write("HSET", &[key, field, value]);
    }

    fn hdel(&mut self, key: &[u8], field: &[u8]) {
        let _ = self.write("HDEL", &[key, field]);
    }

    /// Milliseconds to live; -1 without a TTL, -2 for a missing key.
    fn pttl(&mut self, key: &[u8]) -> i64 {
        self.call("PTTL", &[key])
            .ok()
            .and_then(|v| v.int())
            .unwrap_or(-2)
    }

    fn pexpire(&mut self, key: &[u8], ms: u64) {
        let _ = self.write("PEXPIRE", &[key, ms.to_string().as_bytes()]);
    }
}

/// `key` followed by `suffix` (the lease hash `<bucket key>:leases`, a permit's
/// `:h`, `:q`, `:g`): the same hash tag, so the same slot.
#[must_use]
pub fn suffixed(key: &[u8], suffix: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + suffix.len());
    out.extend_from_slice(key);
    out.extend_from_slice(suffix.as_bytes());
    out
}
