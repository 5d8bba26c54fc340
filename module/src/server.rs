//! The keyspace of the server the module runs in: the string keys through the
//! module API's keys (no command parsed), the rest through `RedisModule_Call`;
//! every write replicated as the command that makes it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis_module::{raw::KeyType, Context, RedisString, RedisValue};

use crate::keyspace::{Error, Got, Keyspace, Value};

pub struct Server<'a> {
    pub ctx: &'a Context,
}

impl Server<'_> {
    /// A key's name as the server's string: any bytes (`create_string` refuses a NUL).
    fn string(&self, bytes: &[u8]) -> RedisString {
        RedisString::create_from_slice(self.ctx.get_raw(), bytes)
    }
}

impl Keyspace for Server<'_> {
    fn now(&mut self) -> i64 {
        // The server's wall clock, as TIME reads it.
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
    }

    fn get(&mut self, key: &[u8]) -> Got {
        let key = self.ctx.open_key(&self.string(key));
        match key.key_type() {
            KeyType::Empty => Got::Missing,
            KeyType::String => match key.read() {
                Ok(Some(value)) => Got::Value(value.to_vec()),
                _ => Got::Missing,
            },
            _ => Got::WrongType,
        }
    }

    fn set(&mut self, key: &[u8], value: &str, ttl_ms: Option<u64>) {
        let name = self.string(key);
        let writable = self.ctx.open_key_writable(&name);
        // Errors here would mean a key not open for writing: it always is.
        let _ = writable.write(value);
        if let Some(ms) = ttl_ms {
            let _ = writable.set_expire(Duration::from_millis(ms));
            let ms = ms.to_string();
            self.ctx
                .replicate("SET", &[key, value.as_bytes(), b"PX", ms.as_bytes()][..]);
        } else {
            self.ctx.replicate("SET", &[key, value.as_bytes()][..]);
        }
    }

    fn del(&mut self, key: &[u8]) -> bool {
        let name = self.string(key);
        let writable = self.ctx.open_key_writable(&name);
        if writable.is_empty() {
            return false;
        }
        let _ = writable.delete();
        self.ctx.replicate("DEL", &[key][..]);
        true
    }

    fn call(&mut self, command: &str, args: &[&[u8]]) -> Result<Value, Error> {
        match self.ctx.call(command, args) {
            Ok(value) => Ok(value_of(value)),
            Err(error) => {
                let message = error.to_string();
                if message.starts_with("WRONGTYPE") {
                    Err(Error::WrongType)
                } else {
                    Err(Error::Reply(message))
                }
            }
        }
    }

    fn write(&mut self, command: &str, args: &[&[u8]]) -> Result<Value, Error> {
        let value = self.call(command, args)?;
        self.ctx.replicate(command, args);
        Ok(value)
    }
}

fn value_of(value: RedisValue) -> Value {
    match value {
        RedisValue::Integer(i) => Value::Int(i),
        RedisValue::SimpleString(s) | RedisValue::BulkString(s) => Value::Bulk(s.into_bytes()),
        RedisValue::SimpleStringStatic(s) => Value::Bulk(s.as_bytes().to_vec()),
        RedisValue::BulkRedisString(s) => Value::Bulk(s.as_slice().to_vec()),
        RedisValue::StringBuffer(bytes) => Value::Bulk(bytes),
        RedisValue::Array(items) => Value::Array(items.into_iter().map(value_of).collect()),
        RedisValue::Float(f) => Value::Bulk(f.to_string().into_bytes()),
        _ => Value::Nil,
    }
}
