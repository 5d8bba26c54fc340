//! Key -> bucket table behind one lock: lookup, incremental eviction,
//! `max_keys`, stats, and `allow_all` across several tables. No Python.
//!
//! Layout: buckets live in a dense `Vec<Entry>`; an [`Index`] maps a key's hash
//! to its position. The dense vector makes eviction incremental (a cursor walks
//! it a few entries per call) and keeps an entry at 64 bytes with short keys
//! stored inline. The index is split in [`SHARDS`] tables that grow on their
//! own, so no call rehashes every key (docs/design.md §5: no call is slow; the
//! vector's own growth is a `realloc`, which moves pages rather than copying
//! them once it is large).

use std::hash::BuildHasher;

use compact_str::CompactString;
use hashbrown::{DefaultHashBuilder, HashTable};
use parking_lot::{Mutex, MutexGuard};

use crate::bucket::{Bucket, Decision, Line, Report, Reserved, Wait};
use crate::error::{check_key, Error};
use crate::rate::Config;

/// Entries examined for eviction by each call that may add or spend, while
/// none of them is evictable: cheap when every held bucket is in use.
const SWEEP_PER_CALL: usize = 2;
/// Entries examined at most by one call once it has found one to evict: idle
/// buckets tend to come in runs, and a million of them go in 125,000 calls.
const SWEEP_WHILE_EVICTING: usize = 8;
/// Entries examined at most by a call that added a bucket, until it has found
/// one to evict: insertions and evictions then keep pace, so the buckets held
/// follow the ones in use even under a flood of new keys.
const SWEEP_ON_INSERT: usize = 16;
/// Entries examined for a full (evictable) bucket when `max_keys` is reached.
const ROOM_SEARCH: usize = 64;

/// The index is split in this many tables, by the top bits of a key's hash.
const SHARD_BITS: u32 = 8;
const SHARDS: usize = 1 << SHARD_BITS;

struct Entry {
    key: CompactString,
    bucket: Bucket,
}

// One cache line: a 24-byte key (inline up to 24 bytes) and a 40-byte bucket.
const _: () = assert!(std::mem::size_of::<Entry>() == 64);

/// An entry's place in the index: its position, and the low 32 bits of its key's
/// hash, from which a shard rehashes it when it grows without reading the key.
#[derive(Clone, Copy)]
struct Place {
    position: u32,
    tag: u32,
}

/// Key hash -> position, in [`SHARDS`] tables chosen by the hash's top bits: a
/// table grows by rehashing only its own share of the keys, from the tags it
/// holds, so the call that makes it grow stays short.
struct Index {
    shards: Vec<HashTable<Place>>,
}

impl Index {
    fn new() -> Index {
        Index {
            shards: (0..SHARDS).map(|_| HashTable::new()).collect(),
        }
    }

    /// The shard of a hash, and the hash its tag is known by there.
    #[inline]
    fn locate(hash: u64) -> (usize, u32, u64) {
        let tag = hash as u32;
        (
            (hash >> (64 - SHARD_BITS)) as usize,
            tag,
            Index::inner_hash(tag),
        )
    }

    /// A tag spread over 64 bits (hashbrown reads the top bits as well as the low).
    #[inline]
    fn inner_hash(tag: u32) -> u64 {
        u64::from(tag).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    #[inline(always)]
    fn find(&self, hash: u64, is_key: impl Fn(usize) -> bool) -> Option<usize> {
        let (shard, tag, inner) = Index::locate(hash);
        self.shards[shard]
            .find(inner, |s| s.tag == tag && is_key(s.position as usize))
            .map(|s| s.position as usize)
    }

    fn insert(&mut self, hash: u64, position: u32) {
        let (shard, tag, inner) = Index::locate(hash);
        self.shards[shard]
            .insert_unique(inner, Place { position, tag }, |s| Index::inner_hash(s.tag));
    }

    fn remove(&mut self, hash: u64, position: usize) {
        let (shard, _, inner) = Index::locate(hash);
        let Ok(found) = self.shards[shard].find_entry(inner, |s| s.position as usize == position)
        else {
            unreachable!("every entry is indexed");
        };
        found.remove();
    }

    fn moved(&mut self, hash: u64, from: usize, to: usize) {
        let (shard, _, inner) = Index::locate(hash);
        let slot = self.shards[shard]
            .find_mut(inner, |s| s.position as usize == from)
            .expect("every entry is indexed");
        slot.position = to as u32;
    }
}

/// `a == b`, with keys of 4 to 32 bytes compared as two overlapping words
/// each (no call to `memcmp`: it was a tenth of a lookup).
#[inline(always)]
fn same_key(a: &[u8], b: &[u8]) -> bool {
    // The first and the last `W` bytes: together they cover `W..=2W` bytes.
    fn ends<const W: usize>(s: &[u8]) -> ([u8; W], [u8; W]) {
        let first = s[..W].try_into().expect("W bytes");
        let last = s[s.len() - W..].try_into().expect("W bytes");
        (first, last)
    }
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        4..=8 => ends::<4>(a) == ends::<4>(b),
        9..=16 => ends::<8>(a) == ends::<8>(b),
        17..=32 => ends::<16>(a) == ends::<16>(b),
        _ => a == b,
    }
}

/// Counters reported by `stats()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub allowed: u64,
    pub refused: u64,
    pub keys: u64,
    pub evicted: u64,
    pub refused_new_keys: u64,
}

struct Table {
    index: Index,
    entries: Vec<Entry>,
    /// Next entry the sweeper looks at.
    cursor: usize,
    /// The latest time any call has seen: the table's time never goes back,
    /// so a full bucket may be dropped without changing any later answer.
    latest: i64,
    stats: Stats,
    /// Set while new keys are being refused, so the warning is logged once
    /// per episode and not per call.
    refusing_new: bool,
    /// Set when a bucket was added since the last sweep, which then looks further.
    inserted: bool,
}

/// Where a key's bucket is, or what happens if it is new.
enum Slot {
    Held(usize),
    New,
    /// New, but the table is full of buckets that are not full.
    NoRoom(Wait),
}

impl Table {
    fn new() -> Table {
        Table {
            index: Index::new(),
            entries: Vec::new(),
            cursor: 0,
            latest: i64::MIN,
            stats: Stats::default(),
            refusing_new: false,
            inserted: false,
        }
    }

    /// Records a clock reading and returns the table's time.
    #[inline(always)]
    fn observe(&mut self, now: i64) -> i64 {
        self.latest = self.latest.max(now);
        self.latest
    }

    #[inline(always)]
    fn find(&self, hash: u64, key: &str) -> Option<usize> {
        let entries = &self.entries;
        self.index.find(hash, |position| {
            same_key(entries[position].key.as_bytes(), key.as_bytes())
        })
    }

    fn insert(&mut self, hash: u64, key: &str, bucket: Bucket) {
        let position = u32::try_from(self.entries.len()).expect("at most u32::MAX keys are held");
        self.entries.push(Entry {
            key: CompactString::new(key),
            bucket,
        });
        self.index.insert(hash, position);
        self.inserted = true;
    }

    /// Removes the entry at `position`; the last entry takes its place.
    fn remove_at(&mut self, hasher: &DefaultHashBuilder, position: usize) {
        let hash = hasher.hash_one(self.entries[position].key.as_str());
        self.index.remove(hash, position);
        let last = self.entries.len() - 1;
        self.entries.swap_remove(position);
        if position != last {
            let moved = hasher.hash_one(self.entries[position].key.as_str());
            self.index.moved(moved, last, position);
        }
    }

    /// Looks at [`SWEEP_PER_CALL`] entries from the cursor (up to
    /// [`SWEEP_ON_INSERT`] when this call added a bucket, until one is dropped),
    /// or up to [`SWEEP_WHILE_EVICTING`] once one is full, and drops the full ones.
    #[inline(always)]
    fn sweep(&mut self, config: &Config, hasher: &DefaultHashBuilder) {
        let inserted = std::mem::take(&mut self.inserted);
        let mut budget = if inserted {
            SWEEP_ON_INSERT
        } else {
            SWEEP_PER_CALL
        };
        let mut examined = 0;
        while examined < budget.min(self.entries.len()) {
            if self.cursor >= self.entries.len() {
                self.cursor = 0;
            }
            if self.entries[self.cursor]
                .bucket
                .is_full_at(config, self.latest)
            {
                self.remove_at(hasher, self.cursor);
                self.stats.evicted += 1;
                budget = SWEEP_WHILE_EVICTING.max(examined + 1);
            } else {
                self.cursor += 1;
            }
            examined += 1;
        }
    }

    /// Finds a bucket full at `now` among the next [`ROOM_SEARCH`] entries.
    /// With `evict`, drops it and returns `Ok`; without, only says whether
    /// there is one. `Err` carries the soonest time to full among those
    /// examined.
    fn find_room(
        &mut self,
        config: &Config,
        hasher: &DefaultHashBuilder,
        now: i64,
        evict: bool,
    ) -> Result<(), Wait> {
        let len = self.entries.len();
        let mut soonest: Wait = None;
        for step in 0..ROOM_SEARCH.min(len) {
            let position = (self.cursor + step) % len;
            let bucket = self.entries[position].bucket.refilled(config, now);
            if bucket.is_full(config) {
                if evict {
                    self.remove_at(hasher, position);
                    self.stats.evicted += 1;
                }
                return Ok(());
            }
            if let Some(wait) = bucket.until_full(config) {
                soonest = Some(soonest.map_or(wait, |s| s.min(wait)));
            }
        }
        Err(soonest)
    }

    /// Where `key`'s bucket is as of `now`; with `evict`, may drop a full
    /// bucket to make room for it.
    #[allow(clippy::too_many_arguments)] // one call site per public method
    fn slot(
        &mut self,
        config: &Config,
        hasher: &DefaultHashBuilder,
        max_keys: usize,
        hash: u64,
        key: &str,
        now: i64,
        evict: bool,
    ) -> Slot {
        if let Some(position) = self.find(hash, key) {
            return Slot::Held(position);
        }
        match self.room(config, hasher, max_keys, now, evict) {
            Ok(()) => Slot::New,
            Err(wait) => Slot::NoRoom(wait),
        }
    }

    /// Whether a new key's bucket fits under `max_keys` as of `now`; with
    /// `evict`, may drop a full bucket to make room. `Err` as [`Table::find_room`].
    fn room(
        &mut self,
        config: &Config,
        hasher: &DefaultHashBuilder,
        max_keys: usize,
        now: i64,
        evict: bool,
    ) -> Result<(), Wait> {
        if self.entries.len() < max_keys {
            return Ok(());
        }
        self.find_room(config, hasher, now, evict)
    }

    /// Takes `cost` for a reservation already granted (by `reserve_all`'s
    /// checks); returns the line a waiter keeps. Found again: making room may
    /// have moved entries. At the table's latest time the wait can only be
    /// shorter: still granted.
    fn take(&mut self, config: &Config, hash: u64, key: &str, cost: u64) -> Option<Line> {
        let now = self.latest;
        if let Some(position) = self.find(hash, key) {
            let before = self.entries[position].bucket.refilled(config, now);
            let (_, after) = before.reserve(config, cost, None);
            self.entries[position].bucket = after;
            after.waiting_line(&before, cost)
        } else {
            let before = Bucket::full(config, now);
            let (_, after) = before.reserve(config, cost, None);
            self.insert(hash, key, after);
            self.refusing_new = false;
            after.waiting_line(&before, cost)
        }
    }

    #[inline(always)]
    fn count(&mut self, allowed: bool) {
        if allowed {
            self.stats.allowed += 1;
        } else {
            self.stats.refused += 1;
        }
    }

    /// Counts a refused new key; true when this starts an episode to log.
    fn count_no_room(&mut self) -> bool {
        self.stats.refused_new_keys += 1;
        !std::mem::replace(&mut self.refusing_new, true)
    }
}

/// The refusal given to a new key when there is no room for its bucket.
fn no_room(config: &Config, wait: Wait) -> Decision {
    Decision {
        allowed: false,
        retry_after: wait,
        remaining: 0,
        reset_after: wait,
        limit: config.capacity,
    }
}

/// One limiter's buckets.
pub struct Registry {
    config: Config,
    max_keys: usize,
    hasher: DefaultHashBuilder,
    table: Mutex<Table>,
}

/// One `(limiter, key, cost)` of an [`allow_all`] or [`reserve_all`], with
/// the time read from that limiter's clock.
#[derive(Clone, Copy)]
pub struct Check<'a> {
    pub registry: &'a Registry,
    pub key: &'a str,
    pub cost: i128,
    pub now: i64,
}

impl Registry {
    /// `max_keys`: `None` for no bound (besides `u32::MAX`).
    #[must_use]
    pub fn new(config: Config, max_keys: Option<usize>) -> Registry {
        Registry {
            config,
            max_keys: max_keys.unwrap_or(u32::MAX as usize).min(u32::MAX as usize),
            hasher: DefaultHashBuilder::default(),
            table: Mutex::new(Table::new()),
        }
    }

    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Validates a call's key and cost; returns the key's hash and the cost.
    #[inline(always)]
    fn check(&self, key: &str, cost: i128) -> Result<(u64, u64), Error> {
        let cost = self.config.check_cost(cost)?;
        check_key(key)?;
        Ok((self.hasher.hash_one(key), cost))
    }

    /// Refills the key's bucket to `now` and spends `cost` if it holds that much.
    ///
    /// # Errors
    /// A bad key or cost; nothing changes then.
    pub fn allow(&self, key: &str, cost: i128, now: i64) -> Result<Decision, Error> {
        let (hash, cost) = self.check(key, cost)?;
        let config = &self.config;
        let mut table = self.table.lock();
        let now = table.observe(now);
        // The common case first: a held bucket, decided in place.
        if let Some(position) = table.find(hash, key) {
            let decision = table.entries[position].bucket.allow(config, now, cost);
            table.count(decision.allowed);
            table.sweep(config, &self.hasher);
            return Ok(decision);
        }
        Ok(self.allow_new(table, hash, key, cost, now))
    }

    /// [`Registry::allow`] for a key without a bucket.
    #[inline(never)]
    fn allow_new(
        &self,
        mut table: MutexGuard<'_, Table>,
        hash: u64,
        key: &str,
        cost: u64,
        now: i64,
    ) -> Decision {
        let config = &self.config;
        let mut log_no_room = false;
        let decision = match table.room(config, &self.hasher, self.max_keys, now, true) {
            Ok(()) => {
                let (decision, after) = Bucket::full(config, now).decide(config, cost);
                table.insert(hash, key, after);
                table.refusing_new = false;
                decision
            }
            Err(wait) => {
                log_no_room = table.count_no_room();
                no_room(config, wait)
            }
        };
        table.count(decision.allowed);
        table.sweep(config, &self.hasher);
        drop(table);
        if log_no_room {
            self.log_no_room();
        }
        decision
    }

    /// What [`Registry::allow`] would answer at `now`, changing nothing.
    ///
    /// # Errors
    /// A bad key or cost.
    pub fn peek(&self, key: &str, cost: i128, now: i64) -> Result<Decision, Error> {
        let (hash, cost) = self.check(key, cost)?;
        let config = &self.config;
        let mut table = self.table.lock();
        let now = now.max(table.latest);
        let slot = table.slot(config, &self.hasher, self.max_keys, hash, key, now, false);
        Ok(match slot {
            Slot::Held(position) => {
                table.entries[position]
                    .bucket
                    .refilled(config, now)
                    .decide(config, cost)
                    .0
            }
            Slot::New => Bucket::full(config, now).decide(config, cost).0,
            Slot::NoRoom(wait) => no_room(config, wait),
        })
    }

    /// Takes `cost` tokens now, going into debt if need be, and says how long
    /// until they are the caller's (docs/design.md §4): refused, spending
    /// nothing, when that wait would exceed `max_wait` (`None`: no limit) or
    /// the debt its bound. With `max_wait = Some(0)` it answers as `allow`.
    ///
    /// # Errors
    /// A bad key or cost; nothing changes then.
    pub fn reserve(
        &self,
        key: &str,
        cost: i128,
        now: i64,
        max_wait: Wait,
    ) -> Result<(Reserved, Option<Line>), Error> {
        let (hash, cost) = self.check(key, cost)?;
        let config = &self.config;
        let mut table = self.table.lock();
        let now = table.observe(now);
        let mut log_no_room = false;
        let mut line = None;
        let reserved = match table.slot(config, &self.hasher, self.max_keys, hash, key, now, true) {
            Slot::Held(position) => {
                let before = table.entries[position].bucket.refilled(config, now);
                let (reserved, after) = before.reserve(config, cost, max_wait);
                table.entries[position].bucket = after;
                line = after.waiting_line(&before, cost);
                reserved
            }
            Slot::New => {
                let before = Bucket::full(config, now);
                let (reserved, after) = before.reserve(config, cost, max_wait);
                if reserved.decision.allowed {
                    line = after.waiting_line(&before, cost);
                    table.insert(hash, key, after);
                    table.refusing_new = false;
                }
                reserved
            }
            Slot::NoRoom(wait) => {
                log_no_room = table.count_no_room();
                Reserved {
                    decision: no_room(config, wait),
                    delay: wait,
                }
            }
        };
        table.count(reserved.decision.allowed);
        table.sweep(config, &self.hasher);
        drop(table);
        if log_no_room {
            self.log_no_room();
        }
        Ok((reserved, line))
    }

    /// Records `cost` tokens of use that already happened: any cost >= 1,
    /// above capacity too, debt allowed down to its bound (docs/design.md §4).
    /// A new key with no room under `max_keys` records nothing.
    ///
    /// # Errors
    /// A bad key, or a cost below 1 or beyond u64; nothing changes then.
    pub fn charge(&self, key: &str, cost: i128, now: i64) -> Result<Decision, Error> {
        let cost = crate::rate::check_charge(cost)?;
        check_key(key)?;
        let hash = self.hasher.hash_one(key);
        let config = &self.config;
        let mut table = self.table.lock();
        let now = table.observe(now);
        let decision = match table.slot(config, &self.hasher, self.max_keys, hash, key, now, true) {
            Slot::Held(position) => {
                let (decision, after) = table.entries[position]
                    .bucket
                    .refilled(config, now)
                    .charged(config, cost);
                table.entries[position].bucket = after;
                decision
            }
            Slot::New => {
                let (decision, after) = Bucket::full(config, now).charged(config, cost);
                table.insert(hash, key, after);
                table.refusing_new = false;
                decision
            }
            Slot::NoRoom(wait) => no_room(config, wait),
        };
        table.sweep(config, &self.hasher);
        Ok(decision)
    }

    /// Gives back `cost` tokens taken earlier, never above capacity nor the
    /// bucket's cap line (docs/design.md §4, "Giving back"); `line` is where
    /// the reservation giving them back left it, when it waited.
    ///
    /// # Errors
    /// A bad key or cost; nothing changes then.
    pub fn refund(&self, key: &str, cost: i128, now: i64, line: Option<Line>) -> Result<(), Error> {
        let (hash, cost) = self.check(key, cost)?;
        let config = &self.config;
        let mut table = self.table.lock();
        let now = table.observe(now);
        // A missing bucket is full: there is nothing to give back.
        if let Some(position) = table.find(hash, key) {
            let bucket = &mut table.entries[position].bucket;
            *bucket = bucket.refilled(config, now).given_back(config, cost, line);
        }
        Ok(())
    }

    /// Applies an upstream's report to the key's bucket at `now` (docs/design.md
    /// §4, "Following the upstream"): its balance becomes at most the report's
    /// bound, never higher. Answers the bucket as it stands after it. A new key
    /// with no room under `max_keys` records nothing.
    ///
    /// # Errors
    /// A bad key; nothing changes then.
    pub fn observe(&self, key: &str, report: &Report, now: i64) -> Result<Decision, Error> {
        check_key(key)?;
        let hash = self.hasher.hash_one(key);
        let config = &self.config;
        let mut table = self.table.lock();
        let now = table.observe(now);
        let decision = match table.slot(config, &self.hasher, self.max_keys, hash, key, now, true) {
            Slot::Held(position) => {
                let bucket = table.entries[position].bucket.refilled(config, now);
                let (decision, after) = bucket.observed(config, report, now);
                table.entries[position].bucket = after;
                decision
            }
            Slot::New => {
                let (decision, after) = Bucket::full(config, now).observed(config, report, now);
                if !after.is_full(config) {
                    table.insert(hash, key, after);
                    table.refusing_new = false;
                }
                decision
            }
            Slot::NoRoom(wait) => no_room(config, wait),
        };
        table.sweep(config, &self.hasher);
        Ok(decision)
    }

    /// Makes the key's bucket full again (by forgetting it).
    ///
    /// # Errors
    /// A bad key.
    pub fn reset(&self, key: &str) -> Result<(), Error> {
        check_key(key)?;
        let hash = self.hasher.hash_one(key);
        let mut table = self.table.lock();
        if let Some(position) = table.find(hash, key) {
            table.remove_at(&self.hasher, position);
        }
        Ok(())
    }

    /// Forgets every bucket and releases the table's memory.
    pub fn clear(&self) {
        let mut table = self.table.lock();
        table.index = Index::new();
        table.entries = Vec::new();
        table.cursor = 0;
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.table.lock().entries.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[must_use]
    pub fn stats(&self) -> Stats {
        let table = self.table.lock();
        Stats {
            keys: table.entries.len() as u64,
            ..table.stats
        }
    }

    fn log_no_room(&self) {
        // Target "bucketlimit": pyo3-log maps it to the Python logger of that name.
        log::warn!(
            target: "bucketlimit",
            "max_keys={} reached and no bucket is full: refusing new keys until one is",
            self.max_keys
        );
    }
}

/// Checks every bucket first and spends each check's cost from all of them
/// only if all allow: [`reserve_all`] with no wait.
///
/// # Errors
/// As [`reserve_all`].
pub fn allow_all(checks: &[Check<'_>]) -> Result<Decision, Error> {
    reserve_all(checks, Some(0)).map(|(reserved, _)| reserved.decision)
}

/// Checks the keys and costs of a [`reserve_all`] and that no `(limiter, key)`
/// comes twice, as it does before it locks anything (a call that waits for
/// something else first checks its buckets with this).
///
/// # Errors
/// A bad key or cost, the same (limiter, key) twice, or no check at all.
pub fn check_all(checks: &[Check<'_>]) -> Result<(), Error> {
    checked(checks).map(drop)
}

/// [`check_all`], with each check's key hash and cost.
fn checked(checks: &[Check<'_>]) -> Result<(Vec<u64>, Vec<u64>), Error> {
    if checks.is_empty() {
        return Err(Error::NoChecks);
    }
    let mut hashes = Vec::with_capacity(checks.len());
    let mut costs = Vec::with_capacity(checks.len());
    for (i, check) in checks.iter().enumerate() {
        let (hash, cost) = check.registry.check(check.key, check.cost)?;
        hashes.push(hash);
        costs.push(cost);
        if checks[..i]
            .iter()
            .any(|c| std::ptr::eq(c.registry, check.registry) && c.key == check.key)
        {
            return Err(Error::DuplicateCheck(check.key.to_owned()));
        }
    }
    Ok((hashes, costs))
}

/// Reserves each check's cost from every bucket at the same moment, all or
/// nothing: granted only if every bucket grants within `max_wait`; the delay
/// is the longest. Tables are locked in address order, so concurrent calls
/// naming the same limiters in any order cannot deadlock.
///
/// # Errors
/// A bad key or cost, or the same (limiter, key) twice; nothing changes then.
///
/// # Panics
/// Never: every registry named in `checks` is locked before it is looked up.
pub fn reserve_all(
    checks: &[Check<'_>],
    max_wait: Wait,
) -> Result<(Reserved, Vec<Option<Line>>), Error> {
    reserve_all_gated(checks, max_wait, |allowed, _| allowed)
}

/// [`reserve_all`], with the rest of a call decided at the same moment: once
/// every bucket is looked at (the tables still locked), `gate(allowed,
/// delay)` is told whether they all grant and the longest delay, and returns
/// whether the call goes ahead (the concurrency permits of `*_all`, taken in
/// it, all or nothing: docs/design.md §4, "Permits"). It runs under the
/// tables' locks: it must not call Python or lock a table.
///
/// # Errors
/// As [`reserve_all`]; `gate` is not called then.
///
/// # Panics
/// As [`reserve_all`].
pub fn reserve_all_gated(
    checks: &[Check<'_>],
    max_wait: Wait,
    gate: impl FnOnce(bool, Wait) -> bool,
) -> Result<(Reserved, Vec<Option<Line>>), Error> {
    let (hashes, costs) = checked(checks)?;
    let mut registries: Vec<&Registry> = checks.iter().map(|c| c.registry).collect();
    registries.sort_by_key(|r| std::ptr::from_ref(*r) as usize);
    registries.dedup_by_key(|r| std::ptr::from_ref(*r) as usize);
    let mut tables: Vec<MutexGuard<'_, Table>> =
        registries.iter().map(|r| r.table.lock()).collect();
    let table_of = |registry: &Registry| {
        registries
            .iter()
            .position(|r| std::ptr::eq(*r, registry))
            .expect("every registry was locked")
    };

    // Check every bucket before spending from any.
    let mut log_no_room = Vec::new();
    let mut decisions = Vec::with_capacity(checks.len());
    let mut buckets = Vec::with_capacity(checks.len());
    let mut delay: Wait = Some(0);
    // New keys of this call, per table: they count against max_keys too.
    let mut pending = vec![0; tables.len()];
    for ((check, &hash), &cost) in checks.iter().zip(&hashes).zip(&costs) {
        let registry = check.registry;
        let config = &registry.config;
        let index = table_of(registry);
        let table = &mut tables[index];
        let now = table.observe(check.now);
        let room = registry.max_keys.saturating_sub(pending[index]);
        let bucket = match table.slot(config, &registry.hasher, room, hash, check.key, now, true) {
            Slot::Held(position) => table.entries[position].bucket.refilled(config, now),
            Slot::New => {
                pending[index] += 1;
                Bucket::full(config, now)
            }
            Slot::NoRoom(wait) => {
                if table.count_no_room() {
                    log_no_room.push(registry);
                }
                decisions.push(no_room(config, wait));
                buckets.push(None);
                delay = longest(delay, wait);
                continue;
            }
        };
        let reserved = bucket.reserve(config, cost, max_wait).0;
        delay = longest(delay, reserved.delay);
        decisions.push(reserved.decision);
        buckets.push(Some(bucket));
    }
    let allowed = gate(decisions.iter().all(|d| d.allowed), delay);
    if !allowed {
        // Nothing is spent: report the buckets that would have allowed as
        // they stand, not as if they had been charged.
        for ((decision, bucket), check) in decisions.iter_mut().zip(&buckets).zip(checks) {
            if let (true, Some(bucket)) = (decision.allowed, bucket) {
                *decision = bucket.describe(&check.registry.config, true, Some(0));
            }
        }
    }
    let mut lines = vec![None; checks.len()];
    for (((check, &hash), &cost), line) in checks.iter().zip(&hashes).zip(&costs).zip(&mut lines) {
        let registry = check.registry;
        let config = &registry.config;
        let table = &mut tables[table_of(registry)];
        table.count(allowed);
        if !allowed {
            continue;
        }
        *line = table.take(config, hash, check.key, cost);
    }
    for (registry, table) in registries.iter().zip(tables.iter_mut()) {
        table.sweep(&registry.config, &registry.hasher);
    }
    drop(tables);
    for registry in log_no_room {
        registry.log_no_room();
    }
    let reserved = Reserved {
        decision: Decision {
            allowed, // false also when the gate refused
            ..combine(&decisions)
        },
        delay,
    };
    Ok((reserved, lines))
}

/// The longer of two waits; `None` (never) is the longest.
fn longest(a: Wait, b: Wait) -> Wait {
    Some(a?.max(b?))
}

/// A decision as the rule of `allow_all` ([`combine`]) sees it: the core's
/// (waits in µs) and the binding's (waits in seconds, as Python holds them)
/// follow the one rule.
pub trait Combinable {
    /// A wait; the longest is never.
    type Wait: Copy;
    /// The wait of a call that is allowed.
    const NO_WAIT: Self::Wait;
    fn allowed(&self) -> bool;
    fn remaining(&self) -> u64;
    fn retry_after(&self) -> Self::Wait;
    /// The longer of two waits.
    fn longer(a: Self::Wait, b: Self::Wait) -> Self::Wait;
    /// This decision, answering for the whole call: its own fields but these two.
    #[must_use]
    fn answering(&self, allowed: bool, retry_after: Self::Wait) -> Self;
}

impl Combinable for Decision {
    type Wait = Wait;
    const NO_WAIT: Wait = Some(0);

    fn allowed(&self) -> bool {
        self.allowed
    }

    fn remaining(&self) -> u64 {
        self.remaining
    }

    fn retry_after(&self) -> Wait {
        self.retry_after
    }

    fn longer(a: Wait, b: Wait) -> Wait {
        longest(a, b)
    }

    fn answering(&self, allowed: bool, retry_after: Wait) -> Decision {
        Decision {
            allowed,
            retry_after,
            ..*self
        }
    }
}

/// One decision for several checks, the rule of `allow_all` (docs/design.md
/// §2): allowed if all allow; `retry_after` the longest among the refusals;
/// the rest from the one with the fewest remaining (the first on a tie).
/// `_core.combine` answers by it for the Redis limiters.
///
/// # Panics
/// Given no decision.
#[must_use]
pub fn combine<D: Combinable>(decisions: &[D]) -> D {
    let allowed = decisions.iter().all(D::allowed);
    // min_by_key keeps the first of equal minima.
    let tightest = decisions
        .iter()
        .min_by_key(|d| d.remaining())
        .expect("a call checks at least one limiter");
    let retry_after = decisions
        .iter()
        .filter(|d| !d.allowed())
        .fold(D::NO_WAIT, |longest, d| D::longer(longest, d.retry_after()));
    tightest.answering(allowed, retry_after)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::Number;

    fn registry(capacity: i128, rate: f64, max_keys: Option<usize>) -> Registry {
        let config = Config::new(capacity, Number::Float(rate), Number::Int(1)).unwrap();
        Registry::new(config, max_keys)
    }

    proptest::proptest! {
        #[test]
        fn keys_compare_as_bytes(
            a in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
            flip in proptest::option::of((proptest::num::usize::ANY, 1u8..=255)),
            extra in proptest::option::of(proptest::num::u8::ANY),
        ) {
            let mut b = a.clone();
            if let Some((at, bits)) = flip.filter(|_| !a.is_empty()) {
                b[at % a.len()] ^= bits;
            }
            if let Some(byte) = extra {
                b.push(byte);
            }
            proptest::prop_assert_eq!(same_key(&a, &b), a == b);
            proptest::prop_assert!(same_key(&a, &a));
        }
    }

    #[test]
    fn combine_takes_the_fewest_remaining_and_the_longest_refusal() {
        let decision = |allowed, retry_after, remaining, limit| Decision {
            allowed,
            retry_after,
            remaining,
            reset_after: Some(7),
            limit,
        };
        let first = decision(true, Some(0), 1, 4);
        let refused = decision(false, Some(9), 1, 8);
        let never = decision(false, None, 5, 5);
        assert_eq!(combine(&[first, refused]), decision(false, Some(9), 1, 4));
        assert_eq!(
            combine(&[refused, never]).retry_after,
            None,
            "never is the longest"
        );
        assert_eq!(combine(&[first, never]).limit, 4, "the fewest remaining");
        assert_eq!(combine(&[first]), first);
    }

    #[test]
    fn keys_are_independent() {
        let r = registry(3, 1.0, None);
        for _ in 0..3 {
            assert!(r.allow("a", 1, 0).unwrap().allowed);
        }
        assert!(!r.allow("a", 1, 0).unwrap().allowed);
        assert!(r.allow("b", 3, 0).unwrap().allowed);
    }

    #[test]
    fn full_buckets_are_swept_without_changing_answers() {
        let r = registry(2, 1.0, None);
        for i in 0..1000 {
            r.allow(&format!("k{i}"), 1, 0).unwrap();
        }
        assert_eq!(r.len(), 1000);
        // One second later every bucket is full again.
        for _ in 0..300 {
            r.allow("hot", 1, 10_000_000).unwrap();
        }
        // Only the bucket still being spent is held.
        assert_eq!(r.len(), 1);
        assert_eq!(r.stats().evicted, 1000);
    }

    #[test]
    fn the_index_finds_every_key_through_growth_and_eviction() {
        let r = registry(1, 0.0, None);
        for i in 0..50_000 {
            assert!(r.allow(&format!("k{i}"), 1, 0).unwrap().allowed);
        }
        for i in (0..50_000).step_by(3) {
            r.reset(&format!("k{i}")).unwrap(); // removed: the last entry moves in
        }
        for i in 0..50_000 {
            let spent = i % 3 != 0;
            assert_eq!(
                r.peek(&format!("k{i}"), 1, 0).unwrap().allowed,
                !spent,
                "k{i}"
            );
        }
        assert_eq!(r.len(), 50_000 - 50_000_usize.div_ceil(3));
    }

    #[test]
    fn the_sweep_keeps_pace_with_a_flood_of_new_keys() {
        // Two entries a call let 1,000,000 new keys a simulated second, each full
        // again a second later, leave 1.94 M held. Here 20,000 a second for 5 s: at
        // any time about 20,000 are in use, and no more than a few percent beyond
        // that may be held.
        let r = registry(1, 1.0, None);
        let per_second: usize = 20_000;
        let mut most = 0;
        for i in 0..5 * per_second {
            let now = (i * 1_000_000 / per_second) as i64;
            assert!(r.allow(&format!("k{i}"), 1, now).unwrap().allowed);
            most = most.max(r.len());
        }
        assert!(most <= per_second * 11 / 10, "held {most} buckets");
    }

    #[test]
    fn max_keys_refuses_new_keys_and_never_resets_a_drained_one() {
        let r = registry(2, 0.0, Some(2));
        assert!(r.allow("a", 2, 0).unwrap().allowed);
        assert!(r.allow("b", 2, 0).unwrap().allowed);
        let d = r.allow("c", 1, 0).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after, None);
        assert!(!r.allow("a", 1, 10).unwrap().allowed);
        assert_eq!(r.stats().refused_new_keys, 1);
    }

    #[test]
    fn max_keys_makes_room_from_full_buckets() {
        let r = registry(1, 1.0, Some(2));
        assert!(r.allow("a", 1, 0).unwrap().allowed);
        assert!(r.allow("b", 1, 0).unwrap().allowed);
        let d = r.allow("c", 1, 500_000).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(500_000));
        assert!(r.peek("c", 1, 1_000_000).unwrap().allowed);
        assert!(r.allow("c", 1, 1_000_000).unwrap().allowed);
    }

    #[test]
    fn allow_all_counts_its_own_new_keys_against_max_keys() {
        let r = registry(1, 0.0, Some(2));
        assert!(r.allow("a", 1, 0).unwrap().allowed);
        let d = allow_all(&[
            Check {
                registry: &r,
                key: "b",
                cost: 1,
                now: 0,
            },
            Check {
                registry: &r,
                key: "c",
                cost: 1,
                now: 0,
            },
        ])
        .unwrap();
        assert!(!d.allowed);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn allow_all_spends_nothing_unless_all_allow() {
        let user = registry(2, 0.0, None);
        let global = registry(3, 0.0, None);
        let checks = |key, cost| {
            [
                Check {
                    registry: &user,
                    key,
                    cost,
                    now: 0,
                },
                Check {
                    registry: &global,
                    key: "all",
                    cost,
                    now: 0,
                },
            ]
        };
        assert!(allow_all(&checks("u1", 2)).unwrap().allowed);
        let d = allow_all(&checks("u2", 2)).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.remaining, 1);
        assert!(user.peek("u2", 2, 0).unwrap().allowed, "u2 was not charged");
        assert!(allow_all(&checks("u2", 1)).unwrap().allowed);
        assert_eq!(
            allow_all(&[checks("x", 1)[0], checks("x", 1)[0]]),
            Err(Error::DuplicateCheck("x".into()))
        );
    }

    #[test]
    fn reserve_all_takes_per_bucket_costs_and_waits_for_the_longest() {
        let rpm = registry(2, 1.0, None);
        let tpm = registry(100, 10.0, None);
        let checks = |requests, tokens| {
            [
                Check {
                    registry: &rpm,
                    key: "org",
                    cost: requests,
                    now: 0,
                },
                Check {
                    registry: &tpm,
                    key: "org",
                    cost: tokens,
                    now: 0,
                },
            ]
        };
        let r = reserve_all(&checks(1, 100), None).unwrap().0;
        assert!(r.decision.allowed);
        assert_eq!(r.delay, Some(0));
        // The tokens bucket is empty: 50 tokens take 5 s, the request 0 s.
        let r = reserve_all(&checks(1, 50), None).unwrap().0;
        assert!(r.decision.allowed);
        assert_eq!(r.delay, Some(5_000_000));
        // Past max_wait: refused, and neither bucket is charged.
        let r = reserve_all(&checks(1, 50), Some(1_000_000)).unwrap().0;
        assert!(!r.decision.allowed);
        assert_eq!(r.delay, Some(10_000_000));
        assert_eq!(r.decision.retry_after, Some(9_000_000));
        assert_eq!(rpm.peek("org", 1, 0).unwrap().retry_after, Some(1_000_000));
        assert_eq!(tpm.peek("org", 1, 0).unwrap().retry_after, Some(5_100_000));
    }

    #[test]
    fn observe_keeps_a_bucket_only_when_a_report_lowers_it() {
        let r = registry(10, 1.0, Some(1));
        let config = *r.config();
        let plenty = Report::new(&config, 10, None, None, None, 0);
        assert_eq!(r.observe("a", &plenty, 0).unwrap().remaining, 10);
        assert_eq!(r.len(), 0, "a full bucket is not kept");
        let low = Report::new(&config, 3, None, None, None, 0);
        assert_eq!(r.observe("a", &low, 0).unwrap().remaining, 3);
        assert!(!r.allow("a", 4, 0).unwrap().allowed);
        // No room for another key: nothing recorded.
        let d = r.observe("b", &low, 0).unwrap();
        assert!(!d.allowed);
        assert_eq!(r.len(), 1);
        assert_eq!(r.observe("", &low, 0), Err(Error::EmptyKey));
    }

    #[test]
    fn a_bucket_in_debt_is_never_evicted_and_reset_fills_it() {
        let r = registry(1, 1.0, Some(1));
        assert_eq!(r.reserve("a", 1, 0, None).unwrap().0.delay, Some(0));
        assert_eq!(r.reserve("a", 1, 0, None).unwrap().0.delay, Some(1_000_000));
        // At 1.5 s "a" is still owed half a token: no room for "b".
        assert!(!r.allow("b", 1, 1_500_000).unwrap().allowed);
        assert_eq!(r.len(), 1);
        r.reset("a").unwrap();
        assert!(r.allow("a", 1, 1_500_000).unwrap().allowed);
        let d = r.charge("a", 5, 1_500_000).unwrap();
        assert!(!d.allowed);
        assert_eq!(d.retry_after, Some(5_000_000));
    }
}
