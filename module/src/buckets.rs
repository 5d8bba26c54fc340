//! The token-bucket commands: `scripts.lua`'s modes on the core's arithmetic
//! (`bucketlimit::bucket`), over the same stored values (docs/design.md §6).
//!
//! Each call reads every bucket it names before it writes any, so a call over
//! several (all or nothing: allow, peek, reserve) decides on what they hold
//! together and a bad value refuses the call before anything changes. With
//! leases out (the five-field form) a bucket's cap is lowered to the units not
//! leased, and its records are read once the earliest has expired, as the
//! script reads them; the core then decides under that cap
//! ([`Config::capped`]).

use bucketlimit::bucket::{Bucket, Line, Report};
use bucketlimit::rate::Config;

use crate::keyspace::{suffixed, Error, Got, Keyspace};
use crate::reply::Reply;
use crate::stored::{format_bucket, parse_bucket, parse_lease};

/// What a call does to its buckets (the script's modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Allow,
    Peek,
    Reserve,
    Charge,
    GiveBack,
    Observe,
    Lease,
}

/// A lease call's own values (`BUCKETLIMIT.LEASE`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseArgs {
    /// Tokens asked for (0: only give the previous lease back).
    pub want: u64,
    /// The caller: one lease per caller and key.
    pub name: Vec<u8>,
    /// The lease's period in µs: its record expires two periods after it starts.
    pub period: i64,
    /// Tokens the caller's previous lease left unused.
    pub unused: u64,
    /// The longest wait in µs.
    pub max_wait: u128,
}

/// One bucket of a call: its key, configuration, the call's `now` (`None`: the
/// server's clock) and cost, and what the operation adds.
#[derive(Clone, Debug)]
pub struct Part<'a> {
    pub key: &'a [u8],
    pub now: Option<i64>,
    pub config: Config,
    /// Tokens; for an observe the report's cap in units (may be negative).
    pub cost: i128,
    /// A reservation's longest wait in µs (`None`: no limit).
    pub max_wait: Option<u128>,
    /// A give-back's line, where its reservation waited.
    pub line: Option<Line>,
    /// An observe's age in µs.
    pub age: u64,
    pub lease: Option<LeaseArgs>,
}

impl<'a> Part<'a> {
    #[must_use]
    pub fn new(key: &'a [u8], now: Option<i64>, config: Config, cost: i128) -> Part<'a> {
        Part {
            key,
            now,
            config,
            cost,
            max_wait: None,
            line: None,
            age: 0,
            lease: None,
        }
    }
}

/// One bucket as read and refilled to the call's `now`.
struct Read {
    present: bool,
    now: i64,
    b: i128,
    l: i64,
    /// `None`: no constraint but the cap.
    h: Option<u128>,
    /// Units leased out (their records live), and the earliest expiry.
    c: u128,
    xmin: Option<i64>,
    /// The cap: `full - c`.
    top: i128,
    /// Fields of the expired lease records, deleted by a call that writes.
    gone: Vec<Vec<u8>>,
    /// Live lease records after the call, and the caller's own (a lease call).
    holders: i128,
    mine: Option<u128>,
}

impl Read {
    /// The core's bucket under this cap.
    fn bucket(&self) -> Bucket {
        Bucket::new(
            self.b,
            self.l,
            self.h.unwrap_or((self.top - self.b) as u128),
        )
    }

    /// Takes the core's bucket back (its headroom at the cap reads as none).
    fn set(&mut self, bucket: Bucket) {
        self.b = bucket.balance();
        self.l = bucket.last();
        let room = (self.top - self.b) as u128;
        self.h = (bucket.headroom() < room).then(|| bucket.headroom());
    }
}

/// The first pass of a call over its buckets: whether every bucket grants
/// its part (all or nothing), the longest wait among refusals (-1: never),
/// and for a reservation its delay and each bucket after it.
struct Checked {
    all_allowed: bool,
    longest: i128,
    delay: i128,
    reserved: Vec<Bucket>,
}

/// What a call answers besides each bucket: the longest wait, the tightest
/// bucket (remaining, µs to full, capacity), a reservation's lines, a lease.
struct Answer {
    longest: i128,
    delay: i128,
    fewest: Option<(i128, i128, u64)>,
    lines: Option<Vec<Reply>>,
    leased: Leased,
}

/// Runs `op` over `parts` (distinct keys, checked by the caller). `min_ttl_ms`
/// is the shortest TTL a bucket's key gets.
///
/// # Errors
/// A key of another type, or a value that is not a bucket: nothing is written.
pub fn run(
    ks: &mut dyn Keyspace,
    op: Op,
    parts: &[Part<'_>],
    min_ttl_ms: u64,
) -> Result<Reply, Error> {
    let n = parts.len();
    let mut server_now = None;
    let mut reads = Vec::with_capacity(n);
    for (i, part) in parts.iter().enumerate() {
        reads.push(read(ks, op, part, i + 1, n, &mut server_now)?);
    }
    let checked = check(op, parts, &reads);
    let mut answer = Answer {
        longest: checked.longest,
        delay: checked.delay,
        fewest: None,
        lines: None,
        leased: Leased::default(),
    };
    for (i, (part, r)) in parts.iter().zip(reads.iter_mut()).enumerate() {
        apply(ks, op, part, r, i, n, &checked, &mut answer, min_ttl_ms);
    }
    let Answer {
        longest,
        delay,
        fewest,
        lines,
        leased,
    } = answer;
    let Some((fewest, reset, limit)) = fewest else {
        return Err(Error::Reply("ERR the call names no bucket".to_owned()));
    };
    let limit = i128::from(limit);
    Ok(match op {
        Op::Reserve => {
            let mut reply = vec![
                Reply::Int(longest),
                Reply::Int(fewest),
                Reply::Int(reset),
                Reply::Int(limit),
                Reply::Int(delay),
            ];
            reply.extend(lines.unwrap_or_default());
            Reply::Array(reply)
        }
        Op::Lease => Reply::ints([
            longest,
            fewest,
            reset,
            leased.granted,
            delay,
            leased.returned,
            reads[0].holders,
        ]),
        _ if n == 1 => Reply::ints([longest, fewest, reset]),
        _ => Reply::ints([longest, fewest, reset, limit]),
    })
}

/// The first pass: is every bucket's part granted?
fn check(op: Op, parts: &[Part<'_>], reads: &[Read]) -> Checked {
    let mut checked = Checked {
        all_allowed: true,
        longest: 0,
        delay: 0,
        reserved: Vec::new(),
    };
    for (part, r) in parts.iter().zip(reads) {
        let config = &part.config;
        match op {
            Op::Allow | Op::Peek => {
                let need = part.cost * config.unit as i128;
                if r.b < need {
                    checked.all_allowed = false;
                    checked.longest = combine(checked.longest, wait(config, (need - r.b) as u128));
                }
            }
            Op::Reserve => {
                let top = config.capped(r.top.max(0) as u128);
                let (answer, after) = r.bucket().reserve(&top, part.cost as u64, part.max_wait);
                let wait = wait_reply(answer.delay);
                if checked.delay != -1 {
                    checked.delay = if wait == -1 {
                        -1
                    } else {
                        checked.delay.max(wait)
                    };
                }
                if !answer.decision.allowed {
                    checked.all_allowed = false;
                    checked.longest =
                        combine(checked.longest, wait_reply(answer.decision.retry_after));
                }
                checked.reserved.push(after);
            }
            _ => {}
        }
    }
    checked
}

/// The second pass, for bucket `i` of `n`: spend (or give back, charge,
/// observe, lease), write, and count it in the answer.
#[allow(clippy::too_many_arguments)]
fn apply(
    ks: &mut dyn Keyspace,
    op: Op,
    part: &Part<'_>,
    r: &mut Read,
    i: usize,
    n: usize,
    checked: &Checked,
    answer: &mut Answer,
    min_ttl_ms: u64,
) {
    let config = &part.config;
    let leases = suffixed(part.key, ":leases");
    let mut write = false;
    if !r.gone.is_empty() && op != Op::Peek {
        for field in &r.gone {
            ks.hdel(&leases, field);
        }
        write = true;
    }
    let top = config.capped(r.top.max(0) as u128);
    match op {
        Op::Allow | Op::Peek => {
            if checked.all_allowed {
                let (_, after) = r.bucket().decide(&top, part.cost as u64);
                r.set(after);
                write = op == Op::Allow;
            }
        }
        Op::Reserve => {
            if checked.all_allowed {
                let before = r.h.unwrap_or((r.top - r.b) as u128);
                let l = r.l;
                r.set(checked.reserved[i]);
                if r.b < 0 {
                    // A waiter: its line, for its give-back.
                    let lines = answer.lines.get_or_insert_with(|| vec![Reply::Nil; n]);
                    lines[i] = Reply::Array(vec![
                        Reply::Int(i128::from(l)),
                        Reply::Int(r.b),
                        Reply::Int(before as i128),
                    ]);
                }
                write = true;
            }
        }
        Op::Charge => {
            let (decision, after) = r.bucket().charged(&top, part.cost as u64);
            r.set(after);
            if r.b < 0 {
                answer.longest = wait_reply(decision.retry_after);
            }
            write = true;
        }
        Op::GiveBack => {
            // A missing bucket is full: there is nothing to give back.
            write = r.present;
            let after = r.bucket().given_back(&top, part.cost as u64, part.line);
            r.set(after);
        }
        Op::Observe => {
            let report = Report {
                cap: part.cost.max(-(config.max_debt as i128)),
                at: r
                    .now
                    .saturating_sub(i64::try_from(part.age).unwrap_or(i64::MAX)),
            };
            let before = r.b;
            let (decision, after) = r.bucket().observed(&top, &report, r.now);
            r.set(after);
            write = write || r.b != before;
            answer.longest = wait_reply(decision.retry_after);
        }
        Op::Lease => {
            if let Some(args) = &part.lease {
                answer.leased = lease(ks, r, part, args, &leases);
                (answer.longest, answer.delay) = (answer.leased.retry_after, answer.leased.delay);
            }
            write = true;
        }
    }
    // Microseconds until full (the capacity, leases or not); -1: never.
    let full = config.full as i128;
    let until_full = if r.b < full {
        wait(config, (full - r.b) as u128)
    } else {
        0
    };
    if write {
        store(ks, part.key, &leases, r, until_full, min_ttl_ms);
    }
    let remaining = if r.b > 0 {
        r.b / config.unit as i128
    } else {
        0
    };
    if answer.fewest.is_none_or(|(least, _, _)| remaining < least) {
        answer.fewest = Some((remaining, until_full, config.capacity));
    }
}

/// Writes a bucket: deleted when full (it then answers like a missing one),
/// kept without a TTL at rate 0 (a quota), else until it is full again, and
/// with leases out until its last record expires too.
fn store(
    ks: &mut dyn Keyspace,
    key: &[u8],
    leases: &[u8],
    r: &Read,
    until_full: i128,
    min_ttl_ms: u64,
) {
    let value = format_bucket(r.b, r.l, r.h, r.c, r.xmin);
    if until_full == 0 {
        ks.del(key);
    } else if until_full == -1 {
        // SET also clears a TTL left by another configuration.
        ks.set(key, &value, None);
    } else {
        let mut ttl = (until_full as u128)
            .div_ceil(1000)
            .max(u128::from(min_ttl_ms));
        if r.c > 0 {
            ttl += u128::from(ks.pttl(leases).max(0).unsigned_abs());
        }
        // Beyond what an expiry can say (centuries): kept, as a quota is.
        ks.set(
            key,
            &value,
            u64::try_from(ttl).ok().filter(|&t| t < MAX_TTL_MS),
        );
    }
}

/// A batch of allows on one configuration (`BUCKETLIMIT.MANY`), one per key in
/// order, each decided as the one-key allow would decide it alone, all at one
/// instant: three values per allow, and an error in place of the first for a
/// key that holds no bucket (the others go on).
pub fn many(
    ks: &mut dyn Keyspace,
    keys: &[&[u8]],
    now: Option<i64>,
    config: &Config,
    costs: &[i128],
    min_ttl_ms: u64,
) -> Reply {
    let now = Some(now.unwrap_or_else(|| ks.now()));
    let mut reply = Vec::with_capacity(3 * keys.len());
    for (key, &cost) in keys.iter().zip(costs) {
        let part = Part::new(key, now, *config, cost);
        match run(ks, Op::Allow, std::slice::from_ref(&part), min_ttl_ms) {
            Ok(Reply::Array(values)) => reply.extend(values),
            Ok(other) => reply.push(other),
            Err(error) => {
                let message = match error {
                    Error::WrongType => WRONGTYPE,
                    Error::Reply(_) => CORRUPT_ONE,
                };
                reply.extend([Reply::Error(message), Reply::Int(0), Reply::Int(0)]);
            }
        }
    }
    Reply::Array(reply)
}

/// The server's words for a key of another type.
pub const WRONGTYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";

/// The one-key call's error for a value that is not a bucket.
pub const CORRUPT_ONE: &str = "BUCKETLIMIT corrupt bucket value in key 1 of 1";

/// TTLs from this many ms on are not set (the key is kept, as a quota's is).
const MAX_TTL_MS: u64 = 1 << 50;

/// A lease call's answer: the wait for its cost (0: granted now), the delay
/// of a lease that waits its turn, the tokens granted and given back.
#[derive(Clone, Copy, Debug, Default)]
struct Leased {
    retry_after: i128,
    delay: i128,
    granted: i128,
    returned: i128,
}

/// Reads one bucket (key `i` of `n`) and refills it to the call's now, through
/// the expiries of its lease records.
fn read(
    ks: &mut dyn Keyspace,
    op: Op,
    part: &Part<'_>,
    i: usize,
    n: usize,
    server_now: &mut Option<i64>,
) -> Result<Read, Error> {
    let now = match part.now {
        Some(now) => now,
        None => *server_now.get_or_insert_with(|| ks.now()),
    };
    let config = &part.config;
    let full = config.full as i128;
    let mut r = Read {
        present: false,
        now,
        b: full,
        l: now,
        h: None,
        c: 0,
        xmin: None,
        top: full,
        gone: Vec::new(),
        holders: 0,
        mine: None,
    };
    match ks.get(part.key) {
        Got::Missing => {}
        Got::WrongType => return Err(Error::WrongType),
        Got::Value(value) => {
            let stored = parse_bucket(&value).ok_or_else(|| Error::corrupt(i, n))?;
            r.present = true;
            (r.b, r.l, r.h) = (stored.balance, stored.last, stored.headroom);
            (r.c, r.xmin) = (stored.leased, stored.earliest);
        }
    }
    // A lease call reads the records; any call does once the earliest expired.
    // Expired records leave in order of expiry: the bucket refills to each
    // under the cap it had until then, so expiring adds nothing the refill
    // would not.
    let mut gone: Vec<(i64, u128, Vec<u8>)> = Vec::new();
    if op == Op::Lease || (r.c > 0 && r.xmin.is_some_and(|x| now >= x)) {
        let records = ks.hgetall(&suffixed(part.key, ":leases"))?;
        let (mut c, mut live) = (0u128, 0u128);
        r.xmin = None;
        let name = part.lease.as_ref().map(|lease| lease.name.as_slice());
        for (field, value) in records {
            let (amount, expiry) = parse_lease(&value).ok_or_else(|| Error::corrupt(i, n))?;
            c += amount;
            if expiry <= now {
                gone.push((expiry, amount, field));
            } else {
                live += amount;
                r.holders += 1;
                if name == Some(field.as_slice()) {
                    r.mine = Some(amount);
                }
                r.xmin = Some(r.xmin.map_or(expiry, |x: i64| x.min(expiry)));
            }
        }
        gone.sort_by_key(|record| record.0);
        r.c = c;
        if !r.present {
            // A missing bucket is full: all its live leases leave it.
            r.c = live;
            gone.clear();
        }
    }
    r.top = full - r.c as i128;
    if r.present {
        // More than its cap: written under a larger capacity (or before leases
        // were known).
        r.b = r.b.min(r.top);
        let mut records = gone.iter();
        loop {
            let next = records.next();
            let stop = next.map_or(now, |record| record.0);
            // Refill; a clock that went back adds nothing and never moves l back.
            if stop > r.l {
                let elapsed = (i128::from(stop) - i128::from(r.l)) as u128;
                match elapsed.checked_mul(config.per_micro) {
                    Some(added) if added < (r.top - r.b) as u128 => r.b += added as i128,
                    _ => (r.b, r.h) = (r.top, None),
                }
                r.l = stop;
            }
            let Some((_, back, _)) = next else { break };
            r.c -= back;
            r.top += *back as i128;
        }
        // The cap line never passes the cap.
        if r.h.is_some_and(|h| h >= (r.top - r.b) as u128) {
            r.h = None;
        }
    } else {
        r.b = r.top;
    }
    r.gone = gone.into_iter().map(|record| record.2).collect();
    Ok(r)
}

/// A lease (docs/design.md §6, "Hot keys: leases"): first the caller's previous
/// lease ends (what it did not use comes back within the headroom), then the
/// new one: as many tokens as the bucket holds, up to `want`, if that covers
/// the call's cost and half of `want`; else as many as it will hold within
/// `max_wait`, waiting its turn as a reservation does; else none.
fn lease(
    ks: &mut dyn Keyspace,
    r: &mut Read,
    part: &Part<'_>,
    args: &LeaseArgs,
    leases: &[u8],
) -> Leased {
    let config = &part.config;
    let unit = config.unit as i128;
    let p = config.per_micro as i128;
    let need = part.cost * unit;
    let mut returned = 0;
    if let Some(mine) = r.mine {
        r.c -= mine;
        r.top += mine as i128;
        r.holders -= 1;
        let room = r.h.map_or(r.top - r.b, |h| h as i128);
        returned = i128::from(args.unused).min(room / unit);
        r.b += returned * unit;
        if let Some(h) = r.h.as_mut() {
            *h -= (returned * unit) as u128;
        }
        ks.hdel(leases, &args.name);
    }
    let (mut granted, mut delay, longest);
    (granted, delay) = (0i128, 0i128);
    if args.want == 0 {
        return Leased {
            returned,
            ..Leased::default()
        };
    }
    let want = i128::from(args.want);
    if r.b >= need && r.b >= (want + 1) / 2 * unit {
        granted = want.min(r.b / unit);
        r.b -= granted * unit;
        if let Some(h) = r.h {
            let h = h + (granted * unit) as u128;
            r.h = (h < (r.top - r.b) as u128).then_some(h);
        }
    } else if p > 0 {
        let debt = config.max_debt as i128;
        let reach = args
            .max_wait
            .checked_mul(config.per_micro)
            .map_or(debt, |reach| (reach as i128).min(debt));
        let most = (r.b + reach).div_euclid(unit);
        if most >= part.cost {
            granted = want.min(most);
            r.b -= granted * unit;
            r.h = Some(0);
            // Never below 0: a lease that leaves tokens in the bucket is ready now.
            delay = (-r.b).max(0).div_ceil_pos(p);
        }
    }
    if granted == 0 {
        longest = if p == 0 {
            -1
        } else {
            (need - r.b).div_ceil_pos(p)
        };
    } else {
        longest = delay;
        if granted > part.cost || delay > 0 {
            // More than this call spends at once: recorded until it expires on
            // the call's clock, twice the period after it starts.
            let lasts = delay as i64 + 2 * args.period;
            let expiry = r.now + lasts;
            r.c += (granted * unit) as u128;
            r.top -= granted * unit;
            r.holders += 1;
            ks.hset(
                leases,
                &args.name,
                format!("{} {expiry}", granted * unit).as_bytes(),
            );
            r.xmin = Some(r.xmin.map_or(expiry, |x| x.min(expiry)));
            let ttl = (lasts.max(0) as u64).div_ceil(1000);
            if ks.pttl(leases) < ttl as i64 {
                ks.pexpire(leases, ttl);
            }
        }
    }
    Leased {
        retry_after: longest,
        delay,
        granted,
        returned,
    }
}

/// Microseconds until `units` have refilled; -1 at rate 0.
fn wait(config: &Config, units: u128) -> i128 {
    if units == 0 {
        0
    } else if config.per_micro == 0 {
        -1
    } else {
        i128::try_from(units.div_ceil(config.per_micro)).unwrap_or(i128::MAX)
    }
}

fn wait_reply(wait: Option<u128>) -> i128 {
    wait.map_or(-1, |w| i128::try_from(w).unwrap_or(i128::MAX))
}

/// The longest of two waits, -1 (never) the longest of all.
fn combine(longest: i128, wait: i128) -> i128 {
    if longest == -1 || wait == -1 {
        -1
    } else {
        longest.max(wait)
    }
}

trait DivCeilPos {
    fn div_ceil_pos(self, d: i128) -> i128;
}

impl DivCeilPos for i128 {
    /// `ceil(self / d)` for `d > 0`.
    fn div_ceil_pos(self, d: i128) -> i128 {
        -((-self).div_euclid(d))
    }
}
