//! Concurrency permits (docs/design.md §2 "Concurrency", §4 "Permits"): at
//! most `limit` permits held per key, each expiring `ttl` after it was
//! granted or last renewed; callers that wait queue per key and are granted
//! in arrival order; every grant carries a fencing token. Time is a
//! parameter (µs), as in the token bucket; no Python, no clock.
//!
//! Expiry is lazy: every call that looks at a key first drops its permits
//! expired by the call's time and hands the slots they free to the key's
//! first waiters ([`State::settle`]). A waiter handed a permit is told by id
//! ([`Woken`]): the caller wakes it once it holds no lock (§5).
//!
//! Fencing tokens come from one counter per limiter, so they increase with
//! every grant of a key (and are unique across keys): a key's entry can be
//! forgotten when nothing is held or waiting, and a later grant still gets a
//! larger token than any before it.

use std::collections::VecDeque;

use compact_str::CompactString;
use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};

use crate::bucket::{Decision, Wait};
use crate::clock::MAX_MICROS;
use crate::error::{check_key, Error};
use crate::rate::Number;

/// Entries a call that added a key looks at, dropping the idle ones: the keys
/// held follow the keys in use (and shrink back after a burst of new keys).
const SWEEP_ON_INSERT: usize = 16;
/// Entries examined for an idle one when `max_keys` is reached.
const ROOM_SEARCH: usize = 64;

/// A limiter's configuration: permits per key and their lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Permits a key may hold at once: 1 ..= `u32::MAX`.
    pub limit: u32,
    /// Microseconds a permit lives without a renewal: 1 ..= 2^62.
    pub ttl: i64,
}

impl Config {
    /// # Errors
    /// [`Error::Limit`] for a limit outside 1 ..= 2^32 − 1, [`Error::Ttl`]
    /// for a ttl that is not a finite number of seconds of at least a
    /// microsecond (after rounding, docs/design.md §4) within ±2^62 µs.
    pub fn new(limit: i128, ttl: Number) -> Result<Config, Error> {
        let limit = u32::try_from(limit)
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| Error::Limit(limit.to_string()))?;
        let micros = match ttl {
            Number::Float(x) if x.is_finite() => Some((x * 1_000_000.0).round_ties_even())
                .filter(|&m| m >= 1.0 && m <= MAX_MICROS as f64)
                .map(|m| m as i64),
            Number::Float(_) => None,
            Number::Int(i) => i
                .checked_mul(1_000_000)
                .filter(|&m| m >= 1 && m <= i128::from(MAX_MICROS))
                .map(|m| m as i64),
        };
        let ttl = micros.ok_or_else(|| Error::Ttl(ttl.to_string()))?;
        Ok(Config { limit, ttl })
    }
}

/// A permit granted: its fencing token, the µs it expires at, and the
/// decision reported for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub token: u64,
    pub expires: i64,
    pub decision: Decision,
}

/// The answer of a call that does not wait: a grant, or the refusal.
pub type Answer = Result<Grant, Decision>;

/// Waiters handed a permit by a call, by id: wake them once no lock is held.
pub type Woken = Vec<u64>;

/// What [`Limiter::enqueue`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enqueued {
    Granted(Grant),
    /// Queued under this waiter id: [`Limiter::poll`] it.
    Queued(u64),
    /// A new key with no room under `max_keys`: it cannot even queue.
    Refused(Decision),
}

/// A queued waiter, as [`Limiter::poll`] finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Polled {
    Granted(Grant),
    /// Still queued: if no holder releases or renews, and every waiter ahead
    /// holds its permit its whole ttl, a slot is its at `until` (µs).
    Waiting {
        until: i64,
    },
}

/// Counters and gauges reported by `stats()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Permits granted (at once, or handed to a waiter).
    pub granted: u64,
    /// Requests refused: no slot (`try_acquire`, a timeout, an `*_all`
    /// call), or a new key with no room under `max_keys`.
    pub refused: u64,
    /// Permits released by their holder before they expired.
    pub released: u64,
    /// Permits freed by their ttl.
    pub expired: u64,
    /// Waits given up by a cancellation or an exception.
    pub abandoned: u64,
    /// New keys refused because `max_keys` keys were all in use.
    pub refused_new_keys: u64,
    /// Keys held in memory now.
    pub keys: u64,
    /// Permits held now (not expired).
    pub in_flight: u64,
    /// Waiters queued now.
    pub waiting: u64,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    token: u64,
    expires: i64,
}

struct Entry {
    key: CompactString,
    /// In grant order, hence by token.
    held: Vec<Held>,
    /// The smallest `expires` of `held` (`i64::MAX` when none): nothing
    /// expires before it, so most calls skip the scan.
    earliest: i64,
    /// Waiter ids in arrival order.
    queue: VecDeque<u64>,
}

impl Entry {
    fn new(key: &str) -> Entry {
        Entry {
            key: CompactString::new(key),
            held: Vec::new(),
            earliest: i64::MAX,
            queue: VecDeque::new(),
        }
    }

    /// Nothing held, nobody waiting: answers exactly as a missing entry.
    fn is_idle(&self) -> bool {
        self.held.is_empty() && self.queue.is_empty()
    }

    /// A newcomer may have a permit now (nobody waits ahead of it).
    fn has_room(&self, config: &Config) -> bool {
        self.queue.is_empty() && self.held.len() < config.limit as usize
    }

    fn recompute_earliest(&mut self) {
        self.earliest = self
            .held
            .iter()
            .map(|h| h.expires)
            .min()
            .unwrap_or(i64::MAX);
    }

    /// When the `k`-th slot to free from now (0: the next) is sure to free if
    /// no holder releases or renews early and every waiter handed one holds
    /// it its whole ttl: each slot frees at its permit's expiry, then every
    /// ttl after. Needs a permit held.
    fn frees_at(&self, config: &Config, k: usize) -> i128 {
        let ttl = i128::from(config.ttl);
        let wanted = k as i128 + 1;
        // How many freeings happen by `t`, capped at `wanted`.
        let count = |t: i128| {
            let mut n: i128 = 0;
            for h in &self.held {
                let e = i128::from(h.expires);
                if t >= e {
                    n += (t - e) / ttl + 1;
                    if n >= wanted {
                        break;
                    }
                }
            }
            n
        };
        let first = self
            .held
            .iter()
            .map(|h| h.expires)
            .min()
            .expect("a permit is held");
        let last = self
            .held
            .iter()
            .map(|h| h.expires)
            .max()
            .expect("a permit is held");
        let (mut lo, mut hi) = (i128::from(first), i128::from(last) + k as i128 * ttl);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if count(mid) >= wanted {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }

    /// When every permit of the key is sure to be free (as [`Entry::frees_at`]:
    /// the waiters queued now served, nobody asking for more).
    fn drained_at(&self, config: &Config, now: i64) -> i128 {
        let last = self.held.iter().map(|h| i128::from(h.expires)).max();
        match (last, self.queue.len()) {
            (None, _) => i128::from(now),
            (Some(last), 0) => last,
            (Some(last), w) => last.max(self.frees_at(config, w - 1) + i128::from(config.ttl)),
        }
    }
}

/// Microseconds from `now` until `at`, never negative.
fn until(at: i128, now: i64) -> u128 {
    u128::try_from(at - i128::from(now)).unwrap_or(0)
}

struct Waiter {
    key: CompactString,
    /// Set when a slot was handed to it: the waiter holds the permit from
    /// then on, picked up or not.
    grant: Option<Grant>,
}

struct State {
    index: HashMap<CompactString, usize>,
    entries: Vec<Entry>,
    /// Next entry the sweep looks at.
    cursor: usize,
    waiters: HashMap<u64, Waiter>,
    next_token: u64,
    next_waiter: u64,
    /// The latest time any call has seen: the limiter's time never goes back.
    latest: i64,
    stats: Stats,
    /// Set while new keys are being refused (one warning per episode).
    refusing_new: bool,
    /// Waiters handed a permit by the call under way.
    woken: Woken,
}

impl State {
    fn new() -> State {
        State {
            index: HashMap::new(),
            entries: Vec::new(),
            cursor: 0,
            waiters: HashMap::new(),
            next_token: 1,
            next_waiter: 0,
            latest: i64::MIN,
            stats: Stats::default(),
            refusing_new: false,
            woken: Vec::new(),
        }
    }

    /// Records a clock reading and returns the limiter's time (`i64::MIN`:
    /// no reading, the latest time).
    fn observe(&mut self, now: i64) -> i64 {
        self.latest = self.latest.max(now);
        self.latest
    }

    fn find(&self, key: &str) -> Option<usize> {
        self.index.get(key).copied()
    }

    fn insert(&mut self, key: &str) -> usize {
        let position = self.entries.len();
        self.entries.push(Entry::new(key));
        self.index.insert(CompactString::new(key), position);
        self.refusing_new = false;
        position
    }

    /// Removes the entry at `position`; the last entry takes its place.
    fn remove_at(&mut self, position: usize) {
        let entry = self.entries.swap_remove(position);
        self.index.remove(entry.key.as_str());
        if let Some(moved) = self.entries.get(position) {
            *self
                .index
                .get_mut(moved.key.as_str())
                .expect("every entry is indexed") = position;
        }
    }

    /// Applies time to an entry: drops the permits expired by `now` and hands
    /// the freed slots to its first waiters.
    fn settle(&mut self, config: &Config, position: usize, now: i64) {
        let entry = &mut self.entries[position];
        if now >= entry.earliest {
            let before = entry.held.len();
            entry.held.retain(|h| h.expires > now);
            self.stats.expired += (before - entry.held.len()) as u64;
            entry.recompute_earliest();
        }
        self.hand_off(config, position, now);
    }

    /// Hands free slots to the entry's first waiters, in arrival order.
    fn hand_off(&mut self, config: &Config, position: usize, now: i64) {
        while self.entries[position].held.len() < config.limit as usize {
            let Some(id) = self.entries[position].queue.pop_front() else {
                break;
            };
            let grant = self.grant(config, position, now, 0);
            self.waiters
                .get_mut(&id)
                .expect("every queued waiter is known")
                .grant = Some(grant);
            self.woken.push(id);
        }
    }

    /// A new permit of the entry, expiring `ttl` after `now + extra`.
    fn grant(&mut self, config: &Config, position: usize, now: i64, extra: i64) -> Grant {
        let token = self.next_token;
        self.next_token += 1;
        let expires = now.saturating_add(extra).saturating_add(config.ttl);
        let entry = &mut self.entries[position];
        entry.held.push(Held { token, expires });
        entry.earliest = entry.earliest.min(expires);
        self.stats.granted += 1;
        Grant {
            token,
            expires,
            decision: self.describe(config, position, now),
        }
    }

    /// The entry as it stands: allowed, with the permits free and the time
    /// until every one is sure to be free.
    fn describe(&self, config: &Config, position: usize, now: i64) -> Decision {
        let entry = &self.entries[position];
        Decision {
            allowed: true,
            retry_after: Some(0),
            remaining: u64::from(config.limit).saturating_sub(entry.held.len() as u64),
            reset_after: Some(until(entry.drained_at(config, now), now)),
            limit: u64::from(config.limit),
        }
    }

    /// A refusal for a newcomer behind every waiter queued now: a slot is
    /// sure to be its when the slot after theirs frees.
    fn refusal(&self, config: &Config, position: usize, now: i64) -> Decision {
        let entry = &self.entries[position];
        Decision {
            allowed: false,
            retry_after: Some(until(entry.frees_at(config, entry.queue.len()), now)),
            remaining: 0,
            ..self.describe(config, position, now)
        }
    }

    /// Whether a new key fits under `max_keys` (counting `pending` new keys
    /// of the same call): may drop an idle entry to make room. `Err` carries
    /// the soonest time one of the entries examined is sure to be idle.
    fn room(
        &mut self,
        config: &Config,
        max_keys: usize,
        pending: usize,
        now: i64,
    ) -> Result<(), Wait> {
        if self.entries.len() + pending < max_keys {
            return Ok(());
        }
        let mut soonest: Option<i128> = None;
        for _ in 0..ROOM_SEARCH.min(self.entries.len()) {
            if self.cursor >= self.entries.len() {
                self.cursor = 0;
            }
            let position = self.cursor;
            self.settle(config, position, now);
            if self.entries[position].is_idle() {
                self.remove_at(position);
                if self.entries.len() + pending < max_keys {
                    return Ok(());
                }
                continue;
            }
            let drained = self.entries[position].drained_at(config, now);
            soonest = Some(soonest.map_or(drained, |s| s.min(drained)));
            self.cursor += 1;
        }
        Err(soonest.map(|s| until(s, now)))
    }

    /// After a key was added: looks at up to [`SWEEP_ON_INSERT`] entries from
    /// the cursor, applying time to each, and drops the idle ones (an idle
    /// entry answers exactly as a missing one).
    fn sweep(&mut self, config: &Config, now: i64) {
        for _ in 0..SWEEP_ON_INSERT.min(self.entries.len()) {
            if self.cursor >= self.entries.len() {
                self.cursor = 0;
            }
            let position = self.cursor;
            self.settle(config, position, now);
            if self.entries[position].is_idle() {
                self.remove_at(position); // the last entry moves here: look at it next
            } else {
                self.cursor += 1;
            }
        }
    }

    /// Counts a refused new key; true when this starts an episode to log.
    fn count_no_room(&mut self) -> bool {
        self.stats.refused += 1;
        self.stats.refused_new_keys += 1;
        !std::mem::replace(&mut self.refusing_new, true)
    }

    /// The entry of a held key (settled at `now`), or a new one when there
    /// is room for it (then `true`); `Err` when there is none.
    fn entry_for(
        &mut self,
        config: &Config,
        max_keys: usize,
        key: &str,
        now: i64,
    ) -> Result<(usize, bool), Wait> {
        if let Some(position) = self.find(key) {
            self.settle(config, position, now);
            return Ok((position, false));
        }
        self.room(config, max_keys, 0, now)?;
        Ok((self.insert(key), true))
    }

    /// Drops one permit of the entry by token; hands its slot on. False when
    /// the entry holds no such permit (released, or expired and dropped).
    fn drop_permit(&mut self, config: &Config, position: usize, token: u64, now: i64) -> bool {
        let entry = &mut self.entries[position];
        let Ok(at) = entry.held.binary_search_by_key(&token, |h| h.token) else {
            return false;
        };
        let gone = entry.held.remove(at);
        if gone.expires == entry.earliest {
            entry.recompute_earliest();
        }
        self.hand_off(config, position, now);
        true
    }
}

/// A refusal for a new key when `max_keys` keys are all in use.
fn no_room(config: &Config, wait: Wait) -> Decision {
    Decision {
        allowed: false,
        retry_after: wait,
        remaining: 0,
        reset_after: wait,
        limit: u64::from(config.limit),
    }
}

/// One limiter's permits: every key's, behind one lock.
pub struct Limiter {
    config: Config,
    max_keys: usize,
    state: Mutex<State>,
}

/// One `(limiter, key)` of [`take_all`], with the time read from that
/// limiter's clock.
#[derive(Clone, Copy)]
pub struct PermitCheck<'a> {
    pub limiter: &'a Limiter,
    pub key: &'a str,
    pub now: i64,
}

/// What [`take_all`] did.
pub struct Taken {
    /// True when every permit was free and the call went ahead: then every
    /// answer is a grant.
    pub allowed: bool,
    /// Per check: the grant, or the permit's state as it stands (allowed)
    /// or its refusal (not allowed).
    pub answers: Vec<Answer>,
    /// Per check: waiters its limiter handed a permit meanwhile (all of a
    /// limiter's under its first check).
    pub woken: Vec<Woken>,
    /// Per check: its limiter starts refusing new keys (log it, unlocked).
    pub log_no_room: Vec<bool>,
}

impl Limiter {
    /// `max_keys`: `None` for no bound.
    #[must_use]
    pub fn new(config: Config, max_keys: Option<usize>) -> Limiter {
        Limiter {
            config,
            max_keys: max_keys.unwrap_or(usize::MAX),
            state: Mutex::new(State::new()),
        }
    }

    #[must_use]
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Ends a call: the waiters it handed a permit, and the warning to log
    /// (after the lock is released).
    fn finish(&self, mut state: MutexGuard<'_, State>, log_no_room: bool) -> Woken {
        let woken = std::mem::take(&mut state.woken);
        drop(state);
        if log_no_room {
            self.log_no_room();
        }
        woken
    }

    /// A permit now, or a refusal; never queues, never jumps the queue.
    ///
    /// # Errors
    /// A bad key; nothing changes then.
    pub fn try_acquire(&self, key: &str, now: i64) -> Result<(Answer, Woken), Error> {
        check_key(key)?;
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let mut log_no_room = false;
        let answer = match state.entry_for(config, self.max_keys, key, now) {
            Ok((position, inserted)) if state.entries[position].has_room(config) => {
                let grant = state.grant(config, position, now, 0);
                if inserted {
                    state.sweep(config, now);
                }
                Ok(grant)
            }
            Ok((position, _)) => {
                state.stats.refused += 1;
                Err(state.refusal(config, position, now))
            }
            Err(wait) => {
                log_no_room = state.count_no_room();
                Err(no_room(config, wait))
            }
        };
        Ok((answer, self.finish(state, log_no_room)))
    }

    /// A permit now, or a place in the key's queue.
    ///
    /// # Errors
    /// A bad key; nothing changes then.
    pub fn enqueue(&self, key: &str, now: i64) -> Result<(Enqueued, Woken), Error> {
        check_key(key)?;
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let mut log_no_room = false;
        let enqueued = match state.entry_for(config, self.max_keys, key, now) {
            Ok((position, inserted)) if state.entries[position].has_room(config) => {
                let grant = state.grant(config, position, now, 0);
                if inserted {
                    state.sweep(config, now);
                }
                Enqueued::Granted(grant)
            }
            Ok((position, _)) => {
                let id = state.next_waiter;
                state.next_waiter += 1;
                state.entries[position].queue.push_back(id);
                state.waiters.insert(
                    id,
                    Waiter {
                        key: CompactString::new(key),
                        grant: None,
                    },
                );
                Enqueued::Queued(id)
            }
            Err(wait) => {
                log_no_room = state.count_no_room();
                Enqueued::Refused(no_room(config, wait))
            }
        };
        Ok((enqueued, self.finish(state, log_no_room)))
    }

    /// A queued waiter at `now`: granted (it then holds the permit and is
    /// forgotten here), or how long it may have to wait.
    ///
    /// # Panics
    /// For an id that is not waiting: a waiter is polled only between its
    /// `enqueue` and its grant, `give_up` or `abandon`.
    pub fn poll(&self, id: u64, now: i64) -> (Polled, Woken) {
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let key = state.waiters[&id].key.clone();
        let position = state.find(&key);
        if let Some(position) = position {
            state.settle(config, position, now);
        }
        let polled = if let Some(grant) = state.waiters[&id].grant {
            state.waiters.remove(&id);
            Polled::Granted(grant)
        } else {
            let entry = &state.entries[position.expect("a waiting key has an entry")];
            let k = entry
                .queue
                .iter()
                .position(|&w| w == id)
                .expect("a waiter is queued");
            let until = entry.frees_at(config, k);
            Polled::Waiting {
                until: i64::try_from(until).unwrap_or(i64::MAX),
            }
        };
        (polled, self.finish(state, false))
    }

    /// A waiter's deadline came at `now`: the permit if it was handed one
    /// (by then), else it leaves the queue, refused.
    ///
    /// # Panics
    /// As [`Limiter::poll`].
    pub fn give_up(&self, id: u64, now: i64) -> (Answer, Woken) {
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let key = state.waiters[&id].key.clone();
        let position = state.find(&key);
        if let Some(position) = position {
            state.settle(config, position, now);
        }
        let waiter = state.waiters.remove(&id).expect("a waiter gives up once");
        let answer = if let Some(grant) = waiter.grant {
            Ok(grant)
        } else {
            let position = position.expect("a waiting key has an entry");
            state.entries[position].queue.retain(|&w| w != id);
            state.stats.refused += 1;
            Err(state.refusal(config, position, now))
        };
        (answer, self.finish(state, false))
    }

    /// A waiter is cancelled (or its caller failed) at `now`: it leaves the
    /// queue, or gives back at once the permit it was handed. `now` may be
    /// `i64::MIN` (the limiter's latest time) when no clock can be read.
    ///
    /// # Panics
    /// As [`Limiter::poll`].
    pub fn abandon(&self, id: u64, now: i64) -> Woken {
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let key = state.waiters[&id].key.clone();
        let position = state.find(&key);
        if let Some(position) = position {
            state.settle(config, position, now); // it may be handed a slot at this moment
        }
        let waiter = state
            .waiters
            .remove(&id)
            .expect("a waiter is abandoned once");
        state.stats.abandoned += 1;
        if let Some(position) = position {
            match waiter.grant {
                Some(grant) => {
                    state.drop_permit(config, position, grant.token, now);
                }
                None => state.entries[position].queue.retain(|&w| w != id),
            }
        }
        self.finish(state, false)
    }

    /// Releases the permit `token` of `key`: its slot goes to the first
    /// waiter. False when it is not held: released already, or expired (an
    /// expired permit's release frees nothing of anyone else's).
    ///
    /// # Errors
    /// A bad key.
    pub fn release(&self, key: &str, token: u64, now: i64) -> Result<(bool, Woken), Error> {
        check_key(key)?;
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let Some(position) = state.find(key) else {
            return Ok((false, self.finish(state, false)));
        };
        state.settle(config, position, now);
        let released = state.drop_permit(config, position, token, now);
        if released {
            state.stats.released += 1;
        }
        Ok((released, self.finish(state, false)))
    }

    /// Extends the permit `token` of `key` to `ttl` after `now + extra`;
    /// returns its new expiry, or `None` when it is not held (expired or
    /// released): a renewal never brings a permit back.
    ///
    /// # Errors
    /// A bad key.
    pub fn renew(
        &self,
        key: &str,
        token: u64,
        now: i64,
        extra: i64,
    ) -> Result<(Option<i64>, Woken), Error> {
        check_key(key)?;
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let Some(position) = state.find(key) else {
            return Ok((None, self.finish(state, false)));
        };
        state.settle(config, position, now);
        let entry = &mut state.entries[position];
        let renewed = match entry.held.binary_search_by_key(&token, |h| h.token) {
            Ok(at) => {
                let expires = now.saturating_add(extra).saturating_add(config.ttl);
                entry.held[at].expires = expires;
                entry.recompute_earliest();
                Some(expires)
            }
            Err(_) => None,
        };
        Ok((renewed, self.finish(state, false)))
    }

    /// Whether the permit `token` of `key` is held and not expired at `now`.
    /// Changes nothing.
    ///
    /// # Errors
    /// A bad key.
    pub fn valid(&self, key: &str, token: u64, now: i64) -> Result<bool, Error> {
        check_key(key)?;
        let state = self.state.lock();
        let now = now.max(state.latest);
        Ok(state.find(key).is_some_and(|position| {
            state.entries[position]
                .held
                .iter()
                .any(|h| h.token == token && h.expires > now)
        }))
    }

    /// Permits of `key` held at `now` (the expired ones gone, their slots
    /// handed on).
    ///
    /// # Errors
    /// A bad key.
    pub fn in_flight(&self, key: &str, now: i64) -> Result<(u64, Woken), Error> {
        check_key(key)?;
        let config = &self.config;
        let mut state = self.state.lock();
        let now = state.observe(now);
        let held = match state.find(key) {
            Some(position) => {
                state.settle(config, position, now);
                state.entries[position].held.len() as u64
            }
            None => 0,
        };
        Ok((held, self.finish(state, false)))
    }

    /// The counters, and the keys, permits and waiters held at `now`.
    /// Changes nothing (an expired permit not yet dropped is not counted).
    #[must_use]
    pub fn stats(&self, now: i64) -> Stats {
        let state = self.state.lock();
        let now = now.max(state.latest);
        let held = state
            .entries
            .iter()
            .flat_map(|e| &e.held)
            .filter(|h| h.expires > now)
            .count();
        let waiting: usize = state.entries.iter().map(|e| e.queue.len()).sum();
        Stats {
            keys: state.entries.len() as u64,
            in_flight: held as u64,
            waiting: waiting as u64,
            ..state.stats
        }
    }

    fn log_no_room(&self) {
        // Target "bucketlimit": pyo3-log maps it to the Python logger of that name.
        log::warn!(
            target: "bucketlimit",
            "ConcurrencyLimiter max_keys={} reached and every key holds a permit or a \
             waiter: refusing new keys until one is free",
            self.max_keys
        );
    }

    /// Logs the `max_keys` warning a [`take_all`] reported (call it unlocked).
    pub fn log_refusing_new_keys(&self) {
        self.log_no_room();
    }
}

/// Checks the keys of a [`take_all`] and that no `(limiter, key)` comes twice.
///
/// # Errors
/// A bad key, or [`Error::DuplicateCheck`].
pub fn check_all(checks: &[PermitCheck<'_>]) -> Result<(), Error> {
    for (i, check) in checks.iter().enumerate() {
        check_key(check.key)?;
        if checks[..i]
            .iter()
            .any(|c| std::ptr::eq(c.limiter, check.limiter) && c.key == check.key)
        {
            return Err(Error::DuplicateCheck(check.key.to_owned()));
        }
    }
    Ok(())
}

/// One permit of every check, all or nothing, at the same moment: granted
/// only if every permit is free now and `go` (the rest of the call, e.g. its
/// token buckets, allows too). Each grant expires `ttl` after `now + extra`
/// (a reservation's permits live `ttl` from when its tokens are ready).
/// Limiters are locked in address order, so concurrent calls cannot
/// deadlock. The checks must have passed [`check_all`].
///
/// # Panics
/// Never: every limiter named in `checks` is locked before it is looked up.
#[must_use]
pub fn take_all(checks: &[PermitCheck<'_>], go: bool, extra: Wait) -> Taken {
    let extra = extra.map_or(i64::MAX, |e| i64::try_from(e).unwrap_or(i64::MAX));
    let mut locked = Locked::new(checks);
    // Look at every permit before granting any.
    let mut log_no_room = vec![false; checks.len()];
    let mut pending = vec![0; locked.limiters.len()];
    let mut room = Vec::with_capacity(checks.len());
    for (i, check) in checks.iter().enumerate() {
        let index = locked.index(check.limiter);
        let (state, config) = (&mut locked.states[index], &check.limiter.config);
        let now = state.observe(check.now);
        room.push(match state.find(check.key) {
            Some(position) => {
                state.settle(config, position, now);
                Ok(())
            }
            None => state
                .room(config, check.limiter.max_keys, pending[index], now)
                .map(|()| pending[index] += 1)
                .inspect_err(|_| log_no_room[i] = state.count_no_room()),
        });
    }
    // Found again: making room may have moved entries.
    let free: Vec<bool> = checks
        .iter()
        .zip(&room)
        .map(|(check, room)| {
            let state = locked.state(check.limiter);
            room.is_ok()
                && state
                    .find(check.key)
                    .is_none_or(|p| state.entries[p].has_room(&check.limiter.config))
        })
        .collect();
    let allowed = go && free.iter().all(|&f| f);
    let mut answers = Vec::with_capacity(checks.len());
    for ((check, room), &free) in checks.iter().zip(room).zip(&free) {
        let config = &check.limiter.config;
        let state = locked.state(check.limiter);
        let now = state.latest;
        let position = state.find(check.key);
        answers.push(match room {
            Err(wait) => Err(no_room(config, wait)),
            Ok(()) if allowed => {
                let position = position.unwrap_or_else(|| state.insert(check.key));
                Ok(state.grant(config, position, now, extra))
            }
            Ok(()) => {
                state.stats.refused += 1;
                Err(match position {
                    Some(position) if free => state.describe(config, position, now),
                    Some(position) => state.refusal(config, position, now),
                    None => Decision {
                        allowed: true,
                        retry_after: Some(0),
                        remaining: u64::from(config.limit),
                        reset_after: Some(0),
                        limit: u64::from(config.limit),
                    },
                })
            }
        });
    }
    if allowed {
        for (limiter, state) in locked.limiters.iter().zip(locked.states.iter_mut()) {
            let now = state.latest;
            state.sweep(&limiter.config, now);
        }
    }
    // Each limiter's woken waiters go with its first check.
    let mut woken = vec![Vec::new(); checks.len()];
    for (i, check) in checks.iter().enumerate() {
        if checks
            .iter()
            .position(|c| std::ptr::eq(c.limiter, check.limiter))
            == Some(i)
        {
            woken[i] = std::mem::take(&mut locked.state(check.limiter).woken);
        }
    }
    drop(locked);
    Taken {
        allowed,
        answers,
        woken,
        log_no_room,
    }
}

/// The states of several limiters, locked in address order.
struct Locked<'a> {
    limiters: Vec<&'a Limiter>,
    states: Vec<MutexGuard<'a, State>>,
}

impl<'a> Locked<'a> {
    fn new(checks: &[PermitCheck<'a>]) -> Locked<'a> {
        let mut limiters: Vec<&Limiter> = checks.iter().map(|c| c.limiter).collect();
        limiters.sort_by_key(|l| std::ptr::from_ref(*l) as usize);
        limiters.dedup_by_key(|l| std::ptr::from_ref(*l) as usize);
        let states = limiters.iter().map(|l| l.state.lock()).collect();
        Locked { limiters, states }
    }

    fn index(&self, limiter: &Limiter) -> usize {
        self.limiters
            .iter()
            .position(|l| std::ptr::eq(*l, limiter))
            .expect("every limiter was locked")
    }

    fn state(&mut self, limiter: &Limiter) -> &mut State {
        let index = self.index(limiter);
        &mut self.states[index]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;

    fn limiter(limit: i128, ttl_seconds: i128) -> Limiter {
        Limiter::new(Config::new(limit, Number::Int(ttl_seconds)).unwrap(), None)
    }

    fn granted(answer: Answer) -> Grant {
        answer.expect("granted")
    }

    #[test]
    fn config_checks_limit_and_ttl() {
        assert_eq!(
            Config::new(5, Number::Float(0.5)),
            Ok(Config {
                limit: 5,
                ttl: 500_000
            })
        );
        assert_eq!(
            Config::new(0, Number::Int(1)),
            Err(Error::Limit("0".into()))
        );
        assert_eq!(
            Config::new(1 << 32, Number::Int(1)),
            Err(Error::Limit("4294967296".into()))
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 4e-7, 1e300] {
            assert!(
                matches!(Config::new(1, Number::Float(bad)), Err(Error::Ttl(_))),
                "{bad}"
            );
        }
        assert!(matches!(Config::new(1, Number::Int(0)), Err(Error::Ttl(_))));
        assert!(Config::new(1, Number::Float(5e-7)).is_err()); // rounds to 0 µs (half to even)
        assert_eq!(Config::new(1, Number::Float(1.5e-6)).unwrap().ttl, 2);
    }

    #[test]
    fn at_most_limit_per_key_and_keys_are_independent() {
        let l = limiter(2, 60);
        let a = granted(l.try_acquire("a", 0).unwrap().0);
        let b = granted(l.try_acquire("a", 0).unwrap().0);
        assert_eq!((a.token, b.token), (1, 2));
        assert_eq!(a.decision.remaining, 1);
        assert_eq!(b.decision.remaining, 0);
        let refused = l.try_acquire("a", 0).unwrap().0.unwrap_err();
        assert!(!refused.allowed);
        assert_eq!(refused.retry_after, Some(60 * S as u128)); // the earliest expiry
        assert!(l.try_acquire("b", 0).unwrap().0.is_ok());
        assert!(l.release("a", a.token, 1).unwrap().0);
        assert!(
            !l.release("a", a.token, 1).unwrap().0,
            "a permit is released once"
        );
        assert!(l.try_acquire("a", 2).unwrap().0.is_ok());
    }

    #[test]
    fn an_expired_permit_frees_its_slot_and_its_release_frees_nothing_else() {
        let l = limiter(1, 10);
        let old = granted(l.try_acquire("k", 0).unwrap().0);
        assert!(l.try_acquire("k", 10 * S - 1).unwrap().0.is_err());
        assert!(l.valid("k", old.token, 10 * S - 1).unwrap());
        assert!(!l.valid("k", old.token, 10 * S).unwrap());
        let new = granted(l.try_acquire("k", 10 * S).unwrap().0);
        assert!(new.token > old.token);
        assert!(!l.release("k", old.token, 11 * S).unwrap().0);
        assert_eq!(l.in_flight("k", 11 * S).unwrap().0, 1);
        assert!(l.valid("k", new.token, 11 * S).unwrap());
        assert_eq!(l.renew("k", old.token, 11 * S, 0).unwrap().0, None);
        assert_eq!(l.stats(11 * S).expired, 1);
    }

    #[test]
    fn renew_extends_by_ttl_from_now() {
        let l = limiter(1, 10);
        let p = granted(l.try_acquire("k", 0).unwrap().0);
        assert_eq!(l.renew("k", p.token, 8 * S, 0).unwrap().0, Some(18 * S));
        assert!(l.try_acquire("k", 17 * S).unwrap().0.is_err());
        assert!(l.try_acquire("k", 18 * S).unwrap().0.is_ok());
    }

    #[test]
    fn waiters_are_granted_in_arrival_order_by_release_and_by_expiry() {
        let l = limiter(1, 10);
        let first = granted(l.try_acquire("k", 0).unwrap().0);
        let ids: Vec<u64> = (0..3)
            .map(|_| match l.enqueue("k", 0).unwrap().0 {
                Enqueued::Queued(id) => id,
                other => panic!("{other:?}"),
            })
            .collect();
        // Nobody jumps the queue, even after a slot frees.
        assert_eq!(
            l.poll(ids[1], S).0,
            Polled::Waiting { until: 20 * S },
            "behind one waiter: the second slot to free"
        );
        let (released, woken) = l.release("k", first.token, S).unwrap();
        assert!(released);
        assert_eq!(woken, vec![ids[0]]);
        assert!(l.try_acquire("k", S).unwrap().0.is_err());
        let Polled::Granted(g0) = l.poll(ids[0], S).0 else {
            panic!()
        };
        assert_eq!(g0.expires, 11 * S);
        // At 11 s the permit handed to the first waiter expires: the next one gets it.
        let (polled, woken) = l.poll(ids[2], 11 * S);
        assert_eq!(woken, vec![ids[1]]);
        assert_eq!(polled, Polled::Waiting { until: 21 * S });
        let Polled::Granted(g1) = l.poll(ids[1], 11 * S).0 else {
            panic!()
        };
        assert!(g1.token > g0.token && g0.token > first.token);
        let (answer, _) = l.give_up(ids[2], 12 * S);
        let refused = answer.unwrap_err();
        assert_eq!(refused.retry_after, Some(9 * S as u128));
        assert_eq!(l.stats(12 * S).waiting, 0);
    }

    #[test]
    fn a_waiter_handed_a_permit_and_abandoned_gives_it_back_to_the_next() {
        let l = limiter(1, 10);
        let held = granted(l.try_acquire("k", 0).unwrap().0);
        let Enqueued::Queued(first) = l.enqueue("k", 0).unwrap().0 else {
            panic!()
        };
        let Enqueued::Queued(second) = l.enqueue("k", 0).unwrap().0 else {
            panic!()
        };
        assert_eq!(l.release("k", held.token, S).unwrap().1, vec![first]);
        assert_eq!(l.abandon(first, S), vec![second]);
        let Polled::Granted(grant) = l.poll(second, S).0 else {
            panic!()
        };
        assert_eq!(grant.expires, 11 * S);
        let s = l.stats(S);
        assert_eq!((s.in_flight, s.waiting, s.abandoned), (1, 0, 1));
    }

    #[test]
    fn a_deadline_reached_as_the_slot_frees_is_granted() {
        let l = limiter(1, 10);
        granted(l.try_acquire("k", 0).unwrap().0);
        let Enqueued::Queued(id) = l.enqueue("k", 0).unwrap().0 else {
            panic!()
        };
        assert!(l.give_up(id, 10 * S).0.is_ok());
    }

    #[test]
    fn frees_at_counts_renewed_and_handed_permits() {
        let l = limiter(2, 10);
        let a = granted(l.try_acquire("k", 0).unwrap().0);
        granted(l.try_acquire("k", 0).unwrap().0);
        l.renew("k", a.token, 0, 25 * S).unwrap();
        // Slots free at 10 s (then 20, 30...) and at 35 s.
        let ids: Vec<u64> = (0..4)
            .map(|_| match l.enqueue("k", S).unwrap().0 {
                Enqueued::Queued(id) => id,
                other => panic!("{other:?}"),
            })
            .collect();
        let untils: Vec<Polled> = ids.iter().map(|&id| l.poll(id, S).0).collect();
        let at = |s: i64| Polled::Waiting { until: s * S };
        assert_eq!(untils, vec![at(10), at(20), at(30), at(35)]);
    }

    #[test]
    fn idle_keys_are_forgotten_as_new_keys_come() {
        let l = limiter(1, 10);
        for i in 0..1000 {
            let key = format!("k{i}");
            let p = granted(l.try_acquire(&key, 0).unwrap().0);
            l.release(&key, p.token, 0).unwrap();
        }
        assert!(l.stats(0).keys <= 2, "{:?}", l.stats(0));
        // Leaked permits: forgotten once expired, as new keys come.
        for i in 0..1000 {
            granted(l.try_acquire(&format!("x{i}"), 0).unwrap().0);
        }
        for i in 0..200 {
            let key = format!("y{i}");
            let p = granted(l.try_acquire(&key, 10 * S).unwrap().0);
            l.release(&key, p.token, 10 * S).unwrap();
        }
        assert!(l.stats(10 * S).keys <= 2, "{:?}", l.stats(10 * S));
    }

    #[test]
    fn max_keys_refuses_new_keys_until_one_is_idle() {
        let l = Limiter::new(Config::new(1, Number::Int(10)).unwrap(), Some(2));
        let a = granted(l.try_acquire("a", 0).unwrap().0);
        granted(l.try_acquire("b", 0).unwrap().0);
        let refused = l.try_acquire("c", S).unwrap().0.unwrap_err();
        assert_eq!(refused.retry_after, Some(9 * S as u128));
        assert!(matches!(l.enqueue("c", S).unwrap().0, Enqueued::Refused(_)));
        assert_eq!(l.stats(S).refused_new_keys, 2);
        l.release("a", a.token, S).unwrap();
        assert!(l.try_acquire("c", S).unwrap().0.is_ok());
        assert!(
            l.try_acquire("d", 10 * S).unwrap().0.is_ok(),
            "b expired: room"
        );
    }

    #[test]
    fn take_all_is_all_or_nothing() {
        let org = limiter(1, 10);
        let global = limiter(2, 10);
        let checks = |key| {
            [
                PermitCheck {
                    limiter: &org,
                    key,
                    now: 0,
                },
                PermitCheck {
                    limiter: &global,
                    key: "all",
                    now: 0,
                },
            ]
        };
        let t = take_all(&checks("o1"), true, Some(0));
        assert!(t.allowed && t.answers.iter().all(Result::is_ok));
        let t = take_all(&checks("o1"), true, Some(0));
        assert!(!t.allowed);
        assert!(t.answers[0].unwrap_err().retry_after > Some(0));
        assert!(t.answers[1].unwrap_err().allowed, "free, as it stands");
        assert_eq!(global.in_flight("all", 0).unwrap().0, 1, "nothing taken");
        // Refused by the rest of the call: nothing taken either.
        assert!(!take_all(&checks("o2"), false, Some(0)).allowed);
        assert_eq!(global.in_flight("all", 0).unwrap().0, 1);
        let t = take_all(&checks("o2"), true, Some(5 * S as u128));
        assert_eq!(t.answers[0].unwrap().expires, 15 * S);
        assert_eq!(
            check_all(&[checks("x")[0], checks("x")[0]]),
            Err(Error::DuplicateCheck("x".into()))
        );
    }

    /// A random trace of one key against a model: never more than `limit`
    /// held, waiters handed a slot in arrival order, tokens strictly
    /// increasing in grant order, an expired permit's release frees nothing.
    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Advance(i64),
            Try,
            Enqueue,
            Poll(usize),
            GiveUp(usize),
            Abandon(usize),
            Release(usize),
            Renew(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0i64..4 * S).prop_map(Op::Advance),
                Just(Op::Try),
                Just(Op::Enqueue),
                any::<usize>().prop_map(Op::Poll),
                any::<usize>().prop_map(Op::GiveUp),
                any::<usize>().prop_map(Op::Abandon),
                any::<usize>().prop_map(Op::Release),
                any::<usize>().prop_map(Op::Renew),
            ]
        }

        #[derive(Default)]
        struct Model {
            /// Permits picked up by their caller: (token, expiry), released ones removed.
            permits: Vec<(u64, i64)>,
            /// Waiters in arrival order, with the time a slot was handed to them.
            queue: Vec<(u64, Option<i64>)>,
            /// Tokens by the moment they were granted: (op, order within it).
            grants: Vec<((usize, usize), u64)>,
            /// When each waiter was handed its slot: (op, order within it).
            handed_at: HashMap<u64, (usize, usize)>,
        }

        impl Model {
            fn live(&self, now: i64, ttl: i64) -> u64 {
                let picked = self.permits.iter().filter(|p| p.1 > now).count();
                let handed = self
                    .queue
                    .iter()
                    .filter(|q| q.1.is_some_and(|at| at + ttl > now))
                    .count();
                (picked + handed) as u64
            }
        }

        proptest! {
            #[test]
            fn permits_follow_the_rules(
                limit in 1i128..4,
                ttl in 1i128..5,
                ops in prop::collection::vec(op(), 1..150),
            ) {
                let l = limiter(limit, ttl);
                let ttl = ttl as i64 * S;
                let mut now = 0;
                let mut m = Model::default();
                for (step, op) in ops.into_iter().enumerate() {
                    let mut woken = Vec::new();
                    let mut direct = None;
                    let mut picked = None;
                    let mut abandoned = None;
                    match op {
                        Op::Advance(dt) => now += dt,
                        Op::Try => {
                            let (answer, w) = l.try_acquire("k", now).unwrap();
                            woken = w;
                            direct = answer.ok();
                        }
                        Op::Enqueue => {
                            let (e, w) = l.enqueue("k", now).unwrap();
                            woken = w;
                            match e {
                                Enqueued::Granted(g) => direct = Some(g),
                                Enqueued::Queued(id) => m.queue.push((id, None)),
                                Enqueued::Refused(_) => prop_assert!(false, "no max_keys here"),
                            }
                        }
                        Op::Poll(i) | Op::GiveUp(i) | Op::Abandon(i) if !m.queue.is_empty() => {
                            let id = m.queue[i % m.queue.len()].0;
                            match op {
                                Op::Poll(_) => {
                                    let (p, w) = l.poll(id, now);
                                    woken = w;
                                    match p {
                                        Polled::Granted(g) => picked = Some((id, g)),
                                        Polled::Waiting { until } => prop_assert!(until > now),
                                    }
                                }
                                Op::GiveUp(_) => {
                                    let (a, w) = l.give_up(id, now);
                                    woken = w;
                                    match a {
                                        Ok(g) => picked = Some((id, g)),
                                        Err(d) => {
                                            prop_assert!(!d.allowed && d.retry_after > Some(0));
                                            m.queue.retain(|q| q.0 != id);
                                        }
                                    }
                                }
                                _ => {
                                    woken = l.abandon(id, now);
                                    abandoned = Some(id);
                                }
                            }
                        }
                        Op::Release(i) | Op::Renew(i) if !m.permits.is_empty() => {
                            let at = i % m.permits.len();
                            let (token, expires) = m.permits[at];
                            let (before, w) = l.in_flight("k", now).unwrap();
                            woken.extend(w);
                            if matches!(op, Op::Release(_)) {
                                let (released, w) = l.release("k", token, now).unwrap();
                                woken.extend(w);
                                prop_assert_eq!(released, expires > now);
                                let (after, w) = l.in_flight("k", now).unwrap();
                                woken.extend(w);
                                if !released {
                                    prop_assert_eq!(after, before, "an expired release frees nothing");
                                }
                                m.permits.remove(at);
                            } else {
                                let (renewed, w) = l.renew("k", token, now, 0).unwrap();
                                woken.extend(w);
                                prop_assert_eq!(renewed, (expires > now).then_some(now + ttl));
                                if let Some(e) = renewed {
                                    m.permits[at].1 = e;
                                }
                            }
                        }
                        _ => {}
                    }
                    // Slots go to the waiters in arrival order, before this call's own grant.
                    for (order, id) in woken.into_iter().enumerate() {
                        let first = m.queue.iter_mut().find(|q| q.1.is_none());
                        prop_assert_eq!(first.as_ref().map(|q| q.0), Some(id), "FIFO");
                        first.expect("checked").1 = Some(now);
                        m.handed_at.insert(id, (step, order));
                    }
                    if let Some(id) = abandoned {
                        m.queue.retain(|q| q.0 != id);
                    }
                    if let Some(g) = direct {
                        prop_assert!(m.queue.iter().all(|q| q.1.is_some()), "no queue jumping");
                        prop_assert_eq!(g.expires, now + ttl);
                        m.permits.push((g.token, g.expires));
                        m.grants.push(((step, usize::MAX), g.token));
                    }
                    if let Some((id, g)) = picked {
                        let handed = m.queue.iter().find(|q| q.0 == id).and_then(|q| q.1);
                        prop_assert_eq!(handed.map(|at| at + ttl), Some(g.expires), "granted once handed");
                        m.queue.retain(|q| q.0 != id);
                        m.permits.push((g.token, g.expires));
                        m.grants.push((m.handed_at[&id], g.token));
                    }
                    let s = l.stats(now);
                    prop_assert!(s.in_flight <= limit as u64);
                    prop_assert_eq!(s.in_flight, m.live(now, ttl));
                    prop_assert_eq!(s.waiting, m.queue.iter().filter(|q| q.1.is_none()).count() as u64);
                }
                m.grants.sort_unstable();
                prop_assert!(m.grants.windows(2).all(|w| w[0].1 < w[1].1), "tokens increase");
            }
        }
    }
}
