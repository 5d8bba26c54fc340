//! bucketlimit's token buckets and permits as a Redis/Valkey module: the same
//! core (`bucketlimit::bucket`) as the Python extension, on the values
//! `scripts.lua` stores, so either may serve a key (docs/redis.md, "The
//! module"; the commands and their replies are tabled there).
//!
//! Every command names its keys in its key spec (a key, or several each
//! followed by its values, as `MSET` does), so a cluster routes it by its keys
//! and refuses keys of different slots (`CROSSSLOT`); the keys it derives
//! (`<key>:leases`, a permit's `<key>:h`, `:q`, `:g`) share the named key's
//! hash tag. Each command is atomic and replicated by its effects (the `SET`,
//! `DEL`, `HSET`... it made), never as itself: it reads the clock.

mod args;
mod buckets;
mod keyspace;
mod permits;
mod reply;
mod server;
mod stored;

use std::sync::atomic::{AtomicI64, Ordering};

use redis_module::configuration::ConfigurationFlags;
use redis_module::{redis_module, Context, RedisError, RedisResult, RedisString, RedisValue};

use crate::args::Args;
use crate::buckets::{LeaseArgs, Op, Part};
use crate::keyspace::Error;
use crate::permits::{PermitArgs, PermitOp};
use crate::reply::Reply;
use crate::server::Server;

/// The shortest TTL, in ms, a bucket's key gets (`scripts.lua`'s `MIN_TTL_MS`):
/// config `bucketlimit.min-ttl-ms`. Tests that hold an injected clock still
/// while real time runs raise it, so that keys outlive the pause.
static MIN_TTL_MS: AtomicI64 = AtomicI64::new(1);

fn min_ttl_ms() -> u64 {
    MIN_TTL_MS.load(Ordering::Relaxed).max(1).unsigned_abs()
}

/// A reply in the server's types: integers beyond i64 as decimal strings.
fn value(reply: Reply) -> RedisValue {
    match reply {
        Reply::Int(i) => i64::try_from(i).map_or_else(
            |_| RedisValue::BulkString(i.to_string()),
            RedisValue::Integer,
        ),
        Reply::Nil => RedisValue::Null,
        Reply::Array(items) => RedisValue::Array(items.into_iter().map(value).collect()),
        Reply::Error(message) => RedisValue::StaticError(message),
    }
}

fn error(error: Error) -> RedisError {
    match error {
        Error::WrongType => RedisError::WrongType,
        Error::Reply(message) => RedisError::String(message),
    }
}

/// A bucket command: `NAME key value... [key value...]`, `group` arguments per
/// key (the key and its values).
fn buckets(
    ctx: &Context,
    args: &[RedisString],
    name: &'static str,
    op: Op,
    group: usize,
) -> RedisResult {
    let values: Vec<&[u8]> = args[1..].iter().map(RedisString::as_slice).collect();
    if values.is_empty() || values.len() % group != 0 || (op == Op::Lease && values.len() != group)
    {
        return Err(RedisError::WrongArity);
    }
    let mut parts = Vec::with_capacity(values.len() / group);
    for chunk in values.chunks(group) {
        parts.push(part(Args::new(name, chunk), op).map_err(error)?);
    }
    if parts.len() > 1 {
        distinct(name, &parts.iter().map(|part| part.key).collect::<Vec<_>>())?;
    }
    let reply = buckets::run(&mut Server { ctx }, op, &parts, min_ttl_ms()).map_err(error)?;
    Ok(value(reply))
}

fn part(mut a: Args<'_>, op: Op) -> Result<Part<'_>, Error> {
    let key = a.key();
    let now = a.now()?;
    let config = a.config()?;
    let cost = match op {
        Op::Allow | Op::Peek | Op::Reserve | Op::Lease => a.cost(&config)?,
        Op::Charge | Op::GiveBack => a.charge()?,
        Op::Observe => a.units("cap")?,
    };
    let mut part = Part::new(key, now, config, cost);
    match op {
        Op::Reserve => part.max_wait = a.micros("max_wait")?,
        Op::GiveBack => part.line = a.line()?,
        Op::Observe => {
            part.age = a
                .micros("age")?
                .map_or(0, |age| u64::try_from(age).unwrap_or(u64::MAX));
        }
        Op::Lease => {
            let want = a.count("want")?;
            let name = a.bytes().to_vec();
            let period = a.micros("period")?.unwrap_or(0);
            part.lease = Some(LeaseArgs {
                want,
                name,
                period: i64::try_from(period).unwrap_or(i64::MAX / 4),
                unused: a.count("unused")?,
                max_wait: a.micros("max_wait")?.unwrap_or(0),
            });
        }
        _ => {}
    }
    Ok(part)
}

/// A call naming one key twice would read it twice and write it once. (A call
/// names a few keys: compared pairwise, nothing allocated for the common one.)
fn distinct(name: &str, keys: &[&[u8]]) -> Result<(), RedisError> {
    for (i, key) in keys.iter().enumerate() {
        if keys[..i].contains(key) {
            return Err(RedisError::String(format!(
                "ERR {name}: the call names the key '{}' twice",
                String::from_utf8_lossy(key)
            )));
        }
    }
    Ok(())
}

/// The bucket commands: `NAME key value... [key value...]`, a fixed number
/// of arguments per key (the key and its values).
macro_rules! bucket_commands {
    ($($fn:ident: $name:literal, $op:expr, $group:literal;)*) => {
        $(fn $fn(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
            buckets(ctx, &args, $name, $op, $group)
        })*
    };
}

bucket_commands! {
    allow: "bucketlimit.allow", Op::Allow, 6;
    peek: "bucketlimit.peek", Op::Peek, 6;
    reserve: "bucketlimit.reserve", Op::Reserve, 7;
    charge: "bucketlimit.charge", Op::Charge, 6;
    give_back: "bucketlimit.giveback", Op::GiveBack, 10;
    observe: "bucketlimit.observe", Op::Observe, 7;
    lease: "bucketlimit.lease", Op::Lease, 11;
}

/// A permit command: `NAME key now limit ttl lease member name extra`.
fn permit(ctx: &Context, args: &[RedisString], name: &'static str, op: PermitOp) -> RedisResult {
    let values: Vec<&[u8]> = args[1..].iter().map(RedisString::as_slice).collect();
    if values.len() != 8 {
        return Err(RedisError::WrongArity);
    }
    let mut a = Args::new(name, &values);
    let key = a.key();
    let now = a.now().map_err(error)?;
    let mut positive = |what| match a.micros(what) {
        Ok(Some(v)) if v >= 1 => i64::try_from(v).map_err(|_| ()),
        _ => Err(()),
    };
    let (limit, ttl, lease) = (positive("limit"), positive("ttl"), positive("lease"));
    let (Ok(limit), Ok(ttl), Ok(lease)) = (limit, ttl, lease) else {
        return Err(RedisError::String(format!(
            "ERR {name}: limit, ttl and lease must be integers >= 1, got '{}' '{}' '{}'",
            String::from_utf8_lossy(values[2]),
            String::from_utf8_lossy(values[3]),
            String::from_utf8_lossy(values[4]),
        )));
    };
    let member = a.bytes();
    let waiter = a.bytes();
    let extra = a.micros("extra").map_err(error)?.unwrap_or(0);
    let permit = PermitArgs {
        key,
        now,
        limit,
        ttl,
        lease,
        member,
        name: waiter,
        extra: i64::try_from(extra).unwrap_or(i64::MAX / 4),
    };
    let reply = permits::run(&mut Server { ctx }, op, &permit).map_err(error)?;
    Ok(value(reply))
}

macro_rules! permit_commands {
    ($($fn:ident: $name:literal, $op:expr;)*) => {
        $(fn $fn(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
            permit(ctx, &args, $name, $op)
        })*
    };
}

permit_commands! {
    take: "bucketlimit.take", PermitOp::Take;
    queue: "bucketlimit.queue", PermitOp::Queue;
    poll: "bucketlimit.poll", PermitOp::Poll;
    give_up: "bucketlimit.giveup", PermitOp::GiveUp;
    abandon: "bucketlimit.abandon", PermitOp::Abandon;
    release: "bucketlimit.release", PermitOp::Release;
    renew: "bucketlimit.renew", PermitOp::Renew;
    valid: "bucketlimit.valid", PermitOp::Valid;
    in_flight: "bucketlimit.inflight", PermitOp::InFlight;
}

/// `BUCKETLIMIT.MANY now capacity unit p key cost [key cost ...]`: a batch of
/// allows of one configuration (a cost may be empty: 1).
fn many(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let values: Vec<&[u8]> = args[1..].iter().map(RedisString::as_slice).collect();
    if values.len() < 6 || values.len() % 2 != 0 {
        return Err(RedisError::WrongArity);
    }
    let name = "bucketlimit.many";
    let mut a = Args::new(name, &values[..4]);
    let now = a.now().map_err(error)?;
    let config = a.config().map_err(error)?;
    let mut keys = Vec::with_capacity(values.len() / 2 - 2);
    let mut costs = Vec::with_capacity(keys.capacity());
    for pair in values[4..].chunks(2) {
        keys.push(pair[0]);
        costs.push(Args::new(name, &pair[1..]).cost(&config).map_err(error)?);
    }
    let reply = buckets::many(
        &mut Server { ctx },
        &keys,
        now,
        &config,
        &costs,
        min_ttl_ms(),
    );
    Ok(value(reply))
}

/// `BUCKETLIMIT.RESET key [key ...]`: the buckets are full again (their keys
/// deleted). Replies how many held a bucket.
#[allow(clippy::unnecessary_wraps)] // the server's command signature
fn reset(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    use crate::keyspace::Keyspace;
    let mut server = Server { ctx };
    let deleted = args[1..]
        .iter()
        .filter(|key| server.del(key.as_slice()))
        .count();
    Ok(RedisValue::Integer(deleted as i64))
}

// The server's allocator (its memory counted as the server's); the tests run
// outside a server, on the system's.
#[cfg(not(test))]
type Allocator = redis_module::alloc::RedisAlloc;
#[cfg(not(test))]
const ALLOCATOR: Allocator = redis_module::alloc::RedisAlloc;
#[cfg(test)]
type Allocator = std::alloc::System;
#[cfg(test)]
const ALLOCATOR: Allocator = std::alloc::System;

redis_module! {
    name: "bucketlimit",
    version: 1,
    allocator: (Allocator, ALLOCATOR),
    data_types: [],
    // [name, handler, flags, first key, last key (-1: the last argument), step,
    // ACL categories]: the keys of a call over several buckets are every
    // `step`-th argument, as MSET's are; the server derives the key spec.
    commands: [
        ["bucketlimit.allow", allow, "write deny-oom fast", 1, -1, 6, ""],
        ["bucketlimit.peek", peek, "readonly fast", 1, -1, 6, ""],
        ["bucketlimit.reserve", reserve, "write deny-oom fast", 1, -1, 7, ""],
        ["bucketlimit.charge", charge, "write deny-oom fast", 1, -1, 6, ""],
        ["bucketlimit.giveback", give_back, "write fast", 1, -1, 10, ""],
        ["bucketlimit.observe", observe, "write deny-oom fast", 1, -1, 7, ""],
        ["bucketlimit.lease", lease, "write deny-oom fast", 1, 1, 1, ""],
        ["bucketlimit.many", many, "write deny-oom fast", 5, -1, 2, ""],
        ["bucketlimit.reset", reset, "write fast", 1, -1, 1, ""],
        ["bucketlimit.take", take, "write deny-oom", 1, 1, 1, ""],
        ["bucketlimit.queue", queue, "write deny-oom", 1, 1, 1, ""],
        ["bucketlimit.poll", poll, "write deny-oom", 1, 1, 1, ""],
        ["bucketlimit.giveup", give_up, "write", 1, 1, 1, ""],
        ["bucketlimit.abandon", abandon, "write", 1, 1, 1, ""],
        ["bucketlimit.release", release, "write", 1, 1, 1, ""],
        ["bucketlimit.renew", renew, "write deny-oom", 1, 1, 1, ""],
        ["bucketlimit.valid", valid, "readonly fast", 1, 1, 1, ""],
        ["bucketlimit.inflight", in_flight, "write", 1, 1, 1, ""],
    ],
    configurations: [
        i64: [
            ["min-ttl-ms", &MIN_TTL_MS, 1, 1, 1 << 40, ConfigurationFlags::DEFAULT, None],
        ],
        string: [],
        bool: [],
        enum: [],
        module_args_as_configuration: true,
    ]
}
