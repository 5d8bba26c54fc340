//! Concurrency permits (docs/design.md §4 "Permits", §6): `scripts.lua`'s
//! permit modes, on the same keys and values, so either may serve a key.
//!
//! A permit key is a hash: fields `t` (the last token), `s` (the last arrival),
//! `x` (the horizon: every key of the permit is kept until `x + ttl`), `w`
//! (waiters queued, never fewer than there are), `e` (at most the earliest
//! expiry of the permits held, empty for none), `g` (the earliest time a grant
//! record may be dropped, empty for none), and one field per waiter (`d
//! deadline` while it waits, `g token remaining reset` once handed a permit).
//! Beside it: `:h` the permits held (member `token`, or `token name` for one
//! handed to a waiter, scored by expiry), `:q` the queue (scored by arrival),
//! `:g` the grant records (scored by when they may be dropped).

use crate::keyspace::{suffixed, Error, Keyspace, Value};
use crate::reply::Reply;

/// What a permit call does (the script's modes in capitals).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PermitOp {
    /// A permit now, or a refusal.
    Take,
    /// A permit now, or a place in the queue.
    Queue,
    /// A waiter's poll: its grant, or its place (its lease renewed).
    Poll,
    /// A waiter's timeout ended: its grant, or refused (it leaves).
    GiveUp,
    /// A waiter cancelled: it leaves, releasing a grant handed to it.
    Abandon,
    Release,
    Renew,
    /// Whether a permit is held (a read).
    Valid,
    /// The permits held now.
    InFlight,
}

/// A permit call's values (after its key).
#[derive(Clone, Debug)]
pub struct PermitArgs<'a> {
    pub key: &'a [u8],
    pub now: Option<i64>,
    pub limit: i64,
    pub ttl: i64,
    pub lease: i64,
    /// A permit's member (release, renew, valid); empty for none.
    pub member: &'a [u8],
    /// A waiter's name (queue, poll, give up, abandon); empty for none.
    pub name: &'a [u8],
    /// µs added to a permit's ttl (take, renew).
    pub extra: i64,
}

/// Times beyond this answer it (as the script does: 2^53 - 1 µs).
const LAST: i64 = (1 << 53) - 1;

struct State<'a> {
    key: &'a [u8],
    now: i64,
    limit: i64,
    ttl: i64,
    lease: i64,
    member: Option<&'a [u8]>,
    name: Option<&'a [u8]>,
    extra: i64,
    t: i64,
    s: i64,
    x: i64,
    w: i64,
    e: Option<i64>,
    g: Option<i64>,
    count: i64,
    horizon: i64,
    dirty: bool,
    /// The keys this call made ("", ":h", ":q", ":g"), which get a TTL.
    new: Vec<&'static str>,
}

fn fmt(v: i64) -> Vec<u8> {
    v.to_string().into_bytes()
}

fn int(value: &Value) -> Option<i64> {
    value.int()
}

/// A field read as a number: missing is `default`, empty (for `e`, `g`) is
/// `None`; `Err` when it is something else.
fn field(value: &Value, default: Option<i64>) -> Result<Option<i64>, ()> {
    match value {
        Value::Nil => Ok(default),
        Value::Bulk(bytes) if bytes.is_empty() => Ok(None),
        other => int(other).map(Some).ok_or(()),
    }
}

/// Runs a permit call on one key.
///
/// # Errors
/// A permit key whose fields are not numbers (`BUCKETLIMIT corrupt ...`), a
/// key of another type.
pub fn run(ks: &mut dyn Keyspace, op: PermitOp, args: &PermitArgs<'_>) -> Result<Reply, Error> {
    let mut server_now = None;
    let given = args.now.is_some();
    let now = match args.now {
        Some(now) => now,
        None => *server_now.get_or_insert_with(|| ks.now()),
    };
    let meta = ks.call("HMGET", &[args.key, b"t", b"s", b"x", b"w", b"e", b"g"])?;
    let meta = meta.items();
    let corrupt = || Error::corrupt(1, 1);
    let at = |i: usize| meta.get(i).cloned().unwrap_or(Value::Nil);
    let number = |i: usize, default: i64| -> Result<i64, Error> {
        field(&at(i), Some(default))
            .map_err(|()| corrupt())?
            .ok_or_else(corrupt)
    };
    let mut st = State {
        key: args.key,
        now,
        limit: args.limit,
        ttl: args.ttl,
        lease: args.lease,
        member: (!args.member.is_empty()).then_some(args.member),
        name: (!args.name.is_empty()).then_some(args.name),
        extra: args.extra,
        t: number(0, 0)?,
        s: number(1, 0)?,
        x: number(2, now)?,
        w: number(3, 0)?,
        e: field(&at(4), None).map_err(|()| corrupt())?,
        g: field(&at(5), None).map_err(|()| corrupt())?,
        count: 0,
        horizon: now,
        dirty: false,
        new: Vec::new(),
    };
    if at(0) == Value::Nil {
        st.new.push("");
        if given {
            // A clock given to the limiter may stand still or start again where
            // it was (a ManualClock): a counter the store lost restarts from the
            // server's time, which only grows, so no token is granted twice.
            let server = *server_now.get_or_insert_with(|| ks.now());
            st.t = st.t.max(server - 1);
        }
    }
    if op == PermitOp::Valid {
        // Held and not expired; a read, nothing settled or written.
        let held = match st.member {
            Some(member) => score(ks, &suffixed(st.key, ":h"), member)?.is_some_and(|e| e > now),
            None => false,
        };
        return Ok(Reply::ints([i128::from(held)]));
    }
    settle(ks, &mut st)?;
    let reply = match op {
        PermitOp::Take | PermitOp::Queue => take(ks, &mut st, op == PermitOp::Queue)?,
        PermitOp::Poll | PermitOp::GiveUp => poll(ks, &mut st, op == PermitOp::Poll)?,
        PermitOp::Abandon => {
            let (handed, record) = pick_up(ks, &mut st)?;
            if let Some(token) = handed.as_ref().map(|h| h.1) {
                let mut member = fmt(token);
                member.push(b' ');
                member.extend_from_slice(st.name.unwrap_or_default());
                free(ks, &mut st, &member)?;
            } else if record.is_some() {
                let name = st.name.unwrap_or_default();
                if ks.write("ZREM", &[&suffixed(st.key, ":q"), name])?.int() == Some(1) {
                    st.w -= 1;
                    st.dirty = true;
                }
                ks.write("HDEL", &[st.key, name])?;
            }
            Reply::ints([i128::from(handed.is_some())])
        }
        PermitOp::Release => {
            let freed = match st.member {
                Some(member) => free(ks, &mut st, member)?,
                None => false,
            };
            Reply::ints([i128::from(freed)])
        }
        PermitOp::Renew => {
            // To ttl after now + extra, only while held (never brought back).
            let mut expiry = 0;
            if let Some(member) = st.member {
                let held = suffixed(st.key, ":h");
                if score(ks, &held, member)?.is_some() {
                    expiry = st.now + st.extra + st.ttl;
                    ks.write("ZADD", &[&held, b"XX", &fmt(expiry), member])?;
                    st.horizon = st.horizon.max(expiry);
                    st.dirty = true;
                }
            }
            Reply::ints([i128::from(expiry > 0), i128::from(expiry)])
        }
        PermitOp::InFlight => Reply::ints([i128::from(st.count)]),
        PermitOp::Valid => unreachable!("answered above"),
    };
    keep(ks, &mut st)?;
    Ok(reply)
}

/// A member's score (its expiry), if it is in the sorted set.
fn score(ks: &mut dyn Keyspace, set: &[u8], member: &[u8]) -> Result<Option<i64>, Error> {
    Ok(int(&ks.call("ZSCORE", &[set, member])?))
}

/// The expiries of the permits held, earliest first.
fn expiries(ks: &mut dyn Keyspace, st: &State<'_>) -> Result<Vec<i64>, Error> {
    let flat = ks.call(
        "ZRANGE",
        &[&suffixed(st.key, ":h"), b"0", b"-1", b"WITHSCORES"],
    )?;
    Ok(flat
        .items()
        .iter()
        .skip(1)
        .step_by(2)
        .filter_map(int)
        .collect())
}

/// The first (`0`) or last (`-1`) score of a sorted set.
fn edge(ks: &mut dyn Keyspace, set: &[u8], at: &[u8]) -> Result<Option<i64>, Error> {
    let flat = ks.call("ZRANGE", &[set, at, at, b"WITHSCORES"])?;
    Ok(flat.items().get(1).and_then(int))
}

fn card(ks: &mut dyn Keyspace, set: &[u8]) -> Result<i64, Error> {
    Ok(ks.call("ZCARD", &[set])?.int().unwrap_or(0))
}

/// When the `k`-th slot to free from now (0: the next) is sure to free, if no
/// holder releases or renews and every waiter handed one holds it its whole
/// ttl (`Entry::frees_at` in the core: the same binary search). Needs a permit
/// held; beyond 2^53 - 1 µs it answers that.
fn frees_at(e: &[i64], k: i64, ttl: i64) -> i64 {
    let m = e.len() as i64;
    let (first, last) = (e[0], e[e.len() - 1]);
    if last - first <= ttl {
        let i = (k % m) as usize;
        return e[i].saturating_add((k / m).saturating_mul(ttl)).min(LAST);
    }
    let wanted = k + 1;
    let (mut lo, mut hi) = (first, last.saturating_add(k.saturating_mul(ttl)).min(LAST));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let mut count = 0;
        for &expiry in e {
            if mid < expiry {
                break;
            }
            count += (mid - expiry) / ttl + 1;
            if count >= wanted {
                break;
            }
        }
        if count >= wanted {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// The key as it stands: the permits free, and the µs until every permit,
/// the `w` waiters' included, is sure to be free.
fn describe(st: &State<'_>, e: &[i64], w: i64) -> (i64, i64) {
    let mut drained = st.now;
    if let Some(&last) = e.last() {
        drained = last;
        if w > 0 {
            drained = drained.max(frees_at(e, w - 1, st.ttl) + st.ttl);
        }
    }
    (
        (st.limit - e.len() as i64).max(0),
        (drained - st.now).max(0),
    )
}

/// A new permit held by member `token` or, handed to a waiter, `token name`,
/// expiring at `expiry`; its token is the key's last one + 1, and at least now.
fn grant(
    ks: &mut dyn Keyspace,
    st: &mut State<'_>,
    expiry: i64,
    name: Option<&[u8]>,
) -> Result<i64, Error> {
    let token = (st.t + 1).max(st.now);
    st.t = token;
    let mut member = fmt(token);
    if let Some(name) = name {
        member.push(b' ');
        member.extend_from_slice(name);
    }
    ks.write("ZADD", &[&suffixed(st.key, ":h"), &fmt(expiry), &member])?;
    if st.count == 0 {
        st.new.push(":h");
    }
    st.count += 1;
    st.e = Some(st.e.map_or(expiry, |e| e.min(expiry)));
    st.horizon = st.horizon.max(expiry);
    st.dirty = true;
    Ok(token)
}

/// Applies time: drops the permits expired by now and the grant records never
/// picked up, then hands the free slots on.
fn settle(ks: &mut dyn Keyspace, st: &mut State<'_>) -> Result<(), Error> {
    let held = suffixed(st.key, ":h");
    let now = fmt(st.now);
    if st.e.is_some_and(|e| st.now >= e) {
        ks.write("ZREMRANGEBYSCORE", &[&held, b"-inf", &now])?;
        st.e = edge(ks, &held, b"0")?;
        st.dirty = true;
    }
    if st.g.is_some_and(|g| st.now >= g) {
        let records = suffixed(st.key, ":g");
        let stale = ks.call("ZRANGEBYSCORE", &[&records, b"-inf", &now])?;
        let stale: Vec<&[u8]> = stale.items().iter().filter_map(Value::bytes).collect();
        if !stale.is_empty() {
            let mut args = vec![st.key];
            args.extend(stale);
            ks.write("HDEL", &args)?;
            ks.write("ZREMRANGEBYSCORE", &[&records, b"-inf", &now])?;
        }
        st.g = edge(ks, &records, b"0")?;
        st.dirty = true;
    }
    st.count = card(ks, &held)?;
    hand_off(ks, st)
}

/// Hands the free slots to the first waiters, in arrival order (a waiter whose
/// lease lapsed is dropped). Each is told by a message on its channel, `name
/// token remaining reset_after_us`, and its record keeps the grant until it
/// picks it up.
fn hand_off(ks: &mut dyn Keyspace, st: &mut State<'_>) -> Result<(), Error> {
    let queue = suffixed(st.key, ":q");
    while st.count < st.limit && st.w > 0 {
        let first = ks.call("ZRANGE", &[&queue, b"0", b"0"])?;
        let Some(first) = first
            .items()
            .first()
            .and_then(Value::bytes)
            .map(<[u8]>::to_vec)
        else {
            st.w = 0;
            st.dirty = true;
            break;
        };
        ks.write("ZREM", &[&queue, &first])?;
        st.w -= 1;
        st.dirty = true;
        let record = ks.call("HGET", &[st.key, &first])?;
        let deadline = record
            .bytes()
            .and_then(|r| r.strip_prefix(b"d "))
            .and_then(crate::stored::signed)
            .and_then(|d| i64::try_from(d).ok());
        if deadline.is_some_and(|d| d > st.now) {
            let token = grant(ks, st, st.now + st.ttl, Some(&first))?;
            let e = expiries(ks, st)?;
            let waiting = card(ks, &queue)?;
            let (remaining, reset) = describe(st, &e, waiting);
            let told = format!("{token} {remaining} {reset}");
            ks.write("HSET", &[st.key, &first, format!("g {told}").as_bytes()])?;
            if st.g.is_none() {
                st.new.push(":g");
            }
            let until = st.now + st.lease;
            ks.write("ZADD", &[&suffixed(st.key, ":g"), &fmt(until), &first])?;
            st.g = Some(st.g.map_or(until, |g| g.min(until)));
            st.horizon = st.horizon.max(until);
            let mut message = first.clone();
            message.push(b' ');
            message.extend_from_slice(told.as_bytes());
            ks.write("PUBLISH", &[channel(&first), &message])?;
        } else {
            ks.write("HDEL", &[st.key, &first])?;
        }
    }
    Ok(())
}

/// A waiter's channel: its name less a trailing `#digits`.
fn channel(name: &[u8]) -> &[u8] {
    if let Some(at) = name.iter().rposition(|&c| c == b'#') {
        let digits = &name[at + 1..];
        if !digits.is_empty() && digits.iter().all(u8::is_ascii_digit) {
            return &name[..at];
        }
    }
    name
}

fn answer(state: i64, token: i64, remaining: i64, reset: i64, retry: i64) -> Reply {
    Reply::ints([state, token, remaining, reset, retry].map(i128::from))
}

/// A permit now if one is free, else a refusal, or with `queue` a place at the
/// back of the queue: `{state, token, remaining, reset_after_us,
/// retry_after_us}`, state 1 granted, 0 refused, 2 queued.
fn take(ks: &mut dyn Keyspace, st: &mut State<'_>, queue: bool) -> Result<Reply, Error> {
    let held = suffixed(st.key, ":h");
    if st.count < st.limit {
        let token = grant(ks, st, st.now + st.extra + st.ttl, None)?;
        let last = edge(ks, &held, b"-1")?.unwrap_or(st.now);
        return Ok(answer(
            1,
            token,
            st.limit - st.count,
            (last - st.now).max(0),
            0,
        ));
    }
    let e = expiries(ks, st)?;
    let queued = suffixed(st.key, ":q");
    let w = card(ks, &queued)?;
    let (_, reset) = describe(st, &e, w);
    let wait = if e.is_empty() {
        0
    } else {
        (frees_at(&e, w, st.ttl) - st.now).max(0)
    };
    if !queue {
        return Ok(answer(0, 0, 0, reset, wait));
    }
    let name = st.name.unwrap_or_default();
    st.s += 1;
    ks.write("ZADD", &[&queued, &fmt(st.s), name])?;
    ks.write(
        "HSET",
        &[st.key, name, format!("d {}", st.now + st.lease).as_bytes()],
    )?;
    if w == 0 {
        st.new.push(":q");
    }
    st.w = st.w.max(w) + 1;
    st.horizon = st.horizon.max(st.now + st.lease);
    st.dirty = true;
    Ok(answer(2, 0, 0, reset, wait))
}

/// A waiter's grant picked up (its reply and token), and its record as it was.
type PickedUp = (Option<(Reply, i64)>, Option<Vec<u8>>);

/// The waiter's grant, picked up (`{3, token, remaining, reset, 0}`), and its
/// record as it was (`None`: it has none).
fn pick_up(ks: &mut dyn Keyspace, st: &mut State<'_>) -> Result<PickedUp, Error> {
    let name = st.name.unwrap_or_default();
    let record = ks
        .call("HGET", &[st.key, name])?
        .bytes()
        .map(<[u8]>::to_vec);
    let granted = record
        .as_deref()
        .and_then(|r| r.strip_prefix(b"g "))
        .and_then(|told| {
            let mut fields = told.split(|&c| c == b' ');
            let mut next =
                || crate::stored::unsigned(fields.next()?).and_then(|v| i64::try_from(v).ok());
            let told = (next()?, next()?, next()?);
            fields.next().is_none().then_some(told)
        });
    let Some((token, remaining, reset)) = granted else {
        return Ok((None, record));
    };
    ks.write("HDEL", &[st.key, name])?;
    ks.write("ZREM", &[&suffixed(st.key, ":g"), name])?;
    Ok((Some((answer(3, token, remaining, reset, 0), token)), record))
}

/// A waiter's poll (`poll`: its grant, or its place, its lease renewed) or its
/// timeout's end (its grant, or it leaves the queue, refused). A waiter no
/// longer queued takes a permit or queues again (`poll`), or takes one or is
/// refused.
fn poll(ks: &mut dyn Keyspace, st: &mut State<'_>, poll: bool) -> Result<Reply, Error> {
    let (picked, record) = pick_up(ks, st)?;
    if let Some((reply, _)) = picked {
        return Ok(reply);
    }
    let name = st.name.unwrap_or_default();
    let queue = suffixed(st.key, ":q");
    if record.as_deref().is_some_and(|r| r.starts_with(b"d ")) {
        if let Some(k) = ks.call("ZRANK", &[&queue, name])?.int() {
            let e = expiries(ks, st)?;
            if poll {
                let until = st.now + st.lease;
                ks.write("HSET", &[st.key, name, format!("d {until}").as_bytes()])?;
                st.horizon = st.horizon.max(until);
                st.dirty = true;
                let wait = if e.is_empty() {
                    0
                } else {
                    (frees_at(&e, k, st.ttl) - st.now).max(0)
                };
                return Ok(answer(2, 0, 0, 0, wait));
            }
            ks.write("ZREM", &[&queue, name])?;
            ks.write("HDEL", &[st.key, name])?;
            st.w -= 1;
            st.dirty = true;
            let w = card(ks, &queue)?;
            let (_, reset) = describe(st, &e, w);
            let wait = if e.is_empty() {
                0
            } else {
                (frees_at(&e, w, st.ttl) - st.now).max(0)
            };
            return Ok(answer(0, 0, 0, reset, wait));
        }
    }
    ks.write("HDEL", &[st.key, name])?;
    take(ks, st, poll)
}

/// Releases a permit by its member, then hands its slot on; false when it is
/// not held (released, or expired).
fn free(ks: &mut dyn Keyspace, st: &mut State<'_>, member: &[u8]) -> Result<bool, Error> {
    if ks.write("ZREM", &[&suffixed(st.key, ":h"), member])?.int() == Some(0) {
        return Ok(false);
    }
    st.count -= 1;
    // A waiter's permit, "token name": its grant record goes too.
    if let Some(space) = member.iter().position(|&c| c == b' ') {
        let (token, name) = (&member[..space], &member[space + 1..]);
        if !token.is_empty() && token.iter().all(u8::is_ascii_digit) && !name.is_empty() {
            ks.write("HDEL", &[st.key, name])?;
            ks.write("ZREM", &[&suffixed(st.key, ":g"), name])?;
        }
    }
    hand_off(ks, st)?;
    Ok(true)
}

/// After the call's writes: the counters, and every key of the permit kept
/// until its horizon (the latest expiry or lease it holds) and one ttl more.
/// The horizon grows a ttl at a time, so most calls set no TTL; a key's TTL
/// is only ever lengthened.
fn keep(ks: &mut dyn Keyspace, st: &mut State<'_>) -> Result<(), Error> {
    let grew = st.horizon > st.x;
    if grew {
        st.x = st.horizon + st.ttl;
        st.dirty = true;
    }
    if !st.dirty {
        return Ok(());
    }
    let optional = |v: Option<i64>| v.map(fmt).unwrap_or_default();
    let (token, arrival, horizon, waiters, earliest, grants) = (
        fmt(st.t),
        fmt(st.s),
        fmt(st.x),
        fmt(st.w),
        optional(st.e),
        optional(st.g),
    );
    ks.write(
        "HSET",
        &[
            st.key, b"t", &token, b"s", &arrival, b"x", &horizon, b"w", &waiters, b"e", &earliest,
            b"g", &grants,
        ],
    )?;
    let ms = fmt(((st.x - st.now + st.ttl + 999).div_euclid(1000)).max(1));
    for suffix in ["", ":h", ":q", ":g"] {
        if grew || st.new.contains(&suffix) {
            ks.write("PEXPIRE", &[&suffixed(st.key, suffix), &ms])?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_free_at_each_expiry_then_every_ttl() {
        // Expiries within one ttl: periodic.
        assert_eq!(frees_at(&[10, 15], 0, 100), 10);
        assert_eq!(frees_at(&[10, 15], 3, 100), 115);
        // Spread wider: the binary search counts them.
        let e = [10, 500];
        assert_eq!(frees_at(&e, 0, 100), 10);
        assert_eq!(frees_at(&e, 1, 100), 110);
        assert_eq!(frees_at(&e, 5, 100), 500);
    }

    #[test]
    fn a_waiters_channel_drops_its_number() {
        assert_eq!(channel(b"bucketlimit:w:abc#12"), b"bucketlimit:w:abc");
        assert_eq!(channel(b"plain"), b"plain");
        assert_eq!(channel(b"x#"), b"x#");
    }
}
