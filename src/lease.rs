//! Leases held by this process: tokens a Redis limiter took from its shared
//! bucket ahead of use (`lease=True`, docs/design.md §6, "Hot keys: leases"),
//! answered here, in process, until they are spent or past their deadline. No
//! Python; time is a parameter (integer microseconds of the caller's clock), as
//! in `registry`.
//!
//! The store charged every leased token when it granted the lease, so answering
//! from it spends nothing more there: this table only has to make sure that a
//! token is handed out once, inside the lease's window (`start <= now <
//! deadline`, a window the store's record outlives), and that one caller at a
//! time renews a key's lease (`begin` marks the key busy; a second caller is
//! told so and asks the shared bucket itself). It also keeps the demand the
//! sizing policy reads: the tokens asked of a key since its last renewal.

use compact_str::CompactString;
use hashbrown::HashMap;
use parking_lot::Mutex;

/// A lease as the store granted it, on this process's clock (µs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    /// Tokens left in it.
    pub tokens: u64,
    /// From when they may be used: a lease that waited its turn in the shared
    /// bucket starts when the store said, measured from its reply.
    pub start: i64,
    /// Until when (exclusive): the store keeps its record longer.
    pub deadline: i64,
    /// When the store said the shared bucket would be full again (`i64::MAX`:
    /// never, at rate 0).
    pub reset_at: i64,
}

/// What a lease answers to a call, without the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Spent from the lease: the tokens left in it, and µs until the store's
    /// bucket said it would be full (`u64::MAX`: never).
    Hit { remaining: u64, reset_after: u64 },
    /// The lease waits its turn in the shared bucket: µs until it starts.
    Waiting { wait: u64, reset_after: u64 },
    /// No lease answers: none, spent (fewer tokens than the cost), or past its
    /// deadline. The caller renews (`begin`).
    Miss,
}

/// What a caller that found no lease does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Begin {
    /// A lease answers after all (another caller renewed it meanwhile).
    Answered(Take),
    /// Another caller is renewing or giving back this key's lease now: this
    /// caller asks the shared bucket itself (its exact answer), so that two
    /// renewals of one key never race in the store.
    Busy,
    /// This caller renews. `unused`: the tokens the old lease leaves (to give
    /// back); `asked`: tokens asked of the key since the last renewal, over
    /// `elapsed` µs (`None`: the key had no lease yet); `holders`: the leases
    /// of the key the store counted at the last renewal.
    Renew {
        unused: u64,
        asked: u64,
        elapsed: Option<i64>,
        holders: u32,
    },
}

#[derive(Default)]
struct Entry {
    lease: Lease,
    /// Tokens asked since `since` (spent from the lease, refused while it
    /// waited, asked of the shared bucket).
    asked: u64,
    since: i64,
    holders: u32,
    /// A renewal or a give-back of this key is on its way to the store.
    busy: bool,
    /// The store keeps a record of the lease (it granted more than the call's
    /// cost, or made it wait): spent or not, `drain` ends it, so that closing
    /// leaves nothing out that lowers the shared bucket's cap.
    recorded: bool,
}

struct Table {
    entries: HashMap<CompactString, Entry>,
    /// No lease with tokens is past its deadline before this µs (`due`'s
    /// fast answer), and no idle entry is forgotten before `next_sweep`.
    next_due: i64,
    next_sweep: i64,
    hits: u64,
    waits: u64,
}

/// The leases of one limiter in this process, behind one lock.
pub struct Ledger {
    table: Mutex<Table>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new()
    }
}

impl Ledger {
    #[must_use]
    pub fn new() -> Ledger {
        Ledger {
            table: Mutex::new(Table {
                entries: HashMap::new(),
                next_due: i64::MAX,
                next_sweep: i64::MIN,
                hits: 0,
                waits: 0,
            }),
        }
    }

    /// Answers `cost` tokens of `key` from its lease, if it can: spends them
    /// when the lease is in its window and holds that many; says how long to
    /// wait when it has not started. Anything else is a [`Take::Miss`] and
    /// changes nothing.
    pub fn take(&self, key: &str, cost: u64, now: i64) -> Take {
        let mut guard = self.table.lock();
        let table = &mut *guard;
        let Some(entry) = table.entries.get_mut(key) else {
            return Take::Miss;
        };
        let answer = answer(entry, cost, now);
        match answer {
            Take::Hit { .. } => table.hits += 1,
            Take::Waiting { .. } => table.waits += 1,
            Take::Miss => {}
        }
        answer
    }

    /// What [`Ledger::take`] would answer now, changing nothing (not even the
    /// demand or the counts): `peek` on a leasing limiter.
    pub fn peek(&self, key: &str, cost: u64, now: i64) -> Take {
        match self.table.lock().entries.get(key) {
            Some(entry) if !entry.busy => look(&entry.lease, cost, now),
            _ => Take::Miss,
        }
    }

    /// Counts `cost` tokens asked of `key` that no lease answered (a refusal
    /// the caller remembered), for the demand the next renewal reads.
    pub fn ask(&self, key: &str, cost: u64) {
        if let Some(entry) = self.table.lock().entries.get_mut(key) {
            entry.asked = entry.asked.saturating_add(cost);
        }
    }

    /// A caller that got [`Take::Miss`]: answered from a lease after all, told
    /// that another caller is renewing, or made the one that renews (the key
    /// is busy until [`Ledger::grant`] or [`Ledger::end`]; its old lease's
    /// tokens are taken out, to be given back, and its demand window restarts,
    /// with this call's cost in it).
    pub fn begin(&self, key: &str, cost: u64, now: i64) -> Begin {
        let mut guard = self.table.lock();
        let table = &mut *guard;
        if !table.entries.contains_key(key) {
            let entry = Entry {
                since: now,
                busy: true,
                asked: cost, // this call opens the key's first window
                ..Entry::default()
            };
            table.entries.insert(CompactString::new(key), entry);
            return Begin::Renew {
                unused: 0,
                asked: 0,
                elapsed: None,
                holders: 0,
            };
        }
        let Some(entry) = table.entries.get_mut(key) else {
            return Begin::Busy; // just looked up: not reached
        };
        if entry.busy {
            entry.asked = entry.asked.saturating_add(cost);
            return Begin::Busy;
        }
        let answer = answer(entry, cost, now);
        match answer {
            Take::Hit { .. } => table.hits += 1,
            Take::Waiting { .. } => table.waits += 1,
            Take::Miss => {
                let unused = entry.lease.tokens;
                let renew = Begin::Renew {
                    unused,
                    asked: entry.asked,
                    elapsed: Some(now.saturating_sub(entry.since)),
                    holders: entry.holders,
                };
                entry.lease.tokens = 0;
                entry.asked = cost; // this call opens the next window
                entry.since = now;
                entry.busy = true;
                entry.recorded = false; // the renewal ends the old record
                return renew;
            }
        }
        Begin::Answered(answer)
    }

    /// The store granted `key` a lease (its renewal is over); `holders`: the
    /// leases of the key it counts now. A lease with tokens left after its
    /// first call is one the store recorded (a `lease` call of the limiter's
    /// script, python/bucketlimit/_redis/scripts.md).
    pub fn grant(&self, key: &str, lease: Lease, holders: u32) {
        let mut guard = self.table.lock();
        let table = &mut *guard;
        let entry = table.entries.entry(CompactString::new(key)).or_default();
        entry.lease = lease;
        entry.holders = holders;
        entry.busy = false;
        entry.recorded = lease.tokens > 0;
        if lease.tokens > 0 {
            table.next_due = table.next_due.min(lease.deadline);
        }
    }

    /// The renewal or give-back of `key` ended without a lease (refused, the
    /// store unreachable, or only giving back): the key is free again.
    pub fn end(&self, key: &str) {
        let mut guard = self.table.lock();
        if let Some(entry) = guard.entries.get_mut(key) {
            entry.lease.tokens = 0;
            entry.busy = false;
            entry.recorded = false;
        }
    }

    /// At most `most` leases past their deadline that still hold tokens, taken
    /// out to be given back (their keys busy until [`Ledger::end`]). Entries
    /// holding nothing whose window began more than `idle` µs ago are
    /// forgotten, at most once an `idle`. Answers at once while nothing is due.
    pub fn due(&self, now: i64, most: usize, idle: i64) -> Vec<(String, u64)> {
        let mut guard = self.table.lock();
        let table = &mut *guard;
        if now < table.next_due && now < table.next_sweep {
            return Vec::new();
        }
        if now >= table.next_sweep {
            table.next_sweep = now.saturating_add(idle);
            let before = now.saturating_sub(idle);
            // A spent lease is kept while its record may live (it outlives the
            // deadline by less than `idle`), for `drain`.
            table.entries.retain(|_, entry| {
                entry.busy
                    || entry.lease.tokens > 0
                    || entry.since > before
                    || (entry.recorded && entry.lease.deadline > before)
            });
        }
        let mut out = Vec::new();
        let mut next_due = i64::MAX;
        for (key, entry) in &mut table.entries {
            if entry.busy || entry.lease.tokens == 0 {
                continue;
            }
            if entry.lease.deadline <= now && out.len() < most {
                out.push((key.to_string(), entry.lease.tokens));
                entry.lease.tokens = 0;
                entry.busy = true;
            } else {
                next_due = next_due.min(entry.lease.deadline);
            }
        }
        table.next_due = next_due;
        out
    }

    /// Every lease holding tokens or recorded in the store (a spent one goes
    /// back with nothing, which ends its record), taken out to be given back
    /// (closing the limiter, the interpreter exiting); their keys busy until
    /// [`Ledger::end`].
    pub fn drain(&self) -> Vec<(String, u64)> {
        let mut guard = self.table.lock();
        let mut out = Vec::new();
        for (key, entry) in &mut guard.entries {
            if !entry.busy && (entry.lease.tokens > 0 || entry.recorded) {
                out.push((key.to_string(), entry.lease.tokens));
                entry.lease.tokens = 0;
                entry.busy = true;
            }
        }
        guard.next_due = i64::MAX;
        out
    }

    /// Forgets every lease (a forked child: its parent's leases stay its
    /// parent's) and the counts.
    pub fn clear(&self) {
        let mut guard = self.table.lock();
        guard.entries = HashMap::new();
        guard.next_due = i64::MAX;
        guard.next_sweep = i64::MIN;
        guard.hits = 0;
        guard.waits = 0;
    }

    /// Calls answered from a lease (`hits`) and refused while one waited its
    /// turn (`waits`).
    pub fn counts(&self) -> (u64, u64) {
        let guard = self.table.lock();
        (guard.hits, guard.waits)
    }

    /// Keys held (with a lease, or with demand being measured).
    pub fn len(&self) -> usize {
        self.table.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A lease's answer to `cost` tokens at `now` (the entry's demand counted).
#[inline]
fn answer(entry: &mut Entry, cost: u64, now: i64) -> Take {
    let answer = look(&entry.lease, cost, now);
    match answer {
        Take::Hit { remaining, .. } => entry.lease.tokens = remaining,
        Take::Waiting { .. } => {}
        Take::Miss => return answer,
    }
    entry.asked = entry.asked.saturating_add(cost);
    answer
}

/// What `lease` would answer to `cost` tokens at `now`, changing nothing.
#[inline]
fn look(lease: &Lease, cost: u64, now: i64) -> Take {
    // A lease that has not started answers "wait" to any cost: renewing now would
    // give back nothing (it waits in the queue; docs/design.md §4, "Giving back").
    if now >= lease.deadline || (lease.tokens < cost && now >= lease.start) || lease.tokens == 0 {
        return Take::Miss;
    }
    // `i64::MAX`: the bucket never fills (rate 0), read as an endless wait.
    let reset_after = if lease.reset_at == i64::MAX {
        u64::MAX
    } else {
        lease.reset_at.saturating_sub(now).max(0) as u64
    };
    if now < lease.start {
        let wait = (lease.start - now) as u64;
        return Take::Waiting {
            wait,
            reset_after: reset_after.max(wait),
        };
    }
    Take::Hit {
        remaining: lease.tokens - cost,
        reset_after,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(tokens: u64, start: i64, deadline: i64) -> Lease {
        Lease {
            tokens,
            start,
            deadline,
            reset_at: deadline,
        }
    }

    /// A lease of `key` granted `tokens` (until `deadline`) and spent to its
    /// last token at `now`.
    fn spend_a_lease(ledger: &Ledger, key: &str, tokens: u64, deadline: i64, now: i64) {
        renew(ledger, key, 1, 0);
        ledger.grant(key, lease(tokens, 0, deadline), 1);
        assert!(matches!(
            ledger.take(key, tokens, now),
            Take::Hit { remaining: 0, .. }
        ));
    }

    fn renew(ledger: &Ledger, key: &str, cost: u64, now: i64) -> (u64, u64, Option<i64>) {
        match ledger.begin(key, cost, now) {
            Begin::Renew {
                unused,
                asked,
                elapsed,
                ..
            } => (unused, asked, elapsed),
            other => panic!("expected a renewal, got {other:?}"),
        }
    }

    #[test]
    fn a_lease_answers_inside_its_window_and_never_hands_a_token_out_twice() {
        let ledger = Ledger::new();
        assert_eq!(ledger.take("k", 1, 0), Take::Miss);
        assert_eq!(renew(&ledger, "k", 1, 0), (0, 0, None));
        ledger.grant("k", lease(3, 10, 100), 1);
        assert!(matches!(
            ledger.take("k", 1, 5),
            Take::Waiting { wait: 5, .. }
        ));
        // Not started: any cost waits for it (a renewal now would give nothing back).
        assert!(matches!(
            ledger.take("k", 4, 9),
            Take::Waiting { wait: 1, .. }
        ));
        assert_eq!(ledger.take("k", 4, 10), Take::Miss);
        assert!(matches!(
            ledger.take("k", 2, 10),
            Take::Hit { remaining: 1, .. }
        ));
        assert_eq!(ledger.take("k", 2, 11), Take::Miss, "one token left");
        assert!(matches!(
            ledger.take("k", 1, 99),
            Take::Hit { remaining: 0, .. }
        ));
        assert_eq!(ledger.take("k", 1, 99), Take::Miss);
        assert_eq!(ledger.counts(), (2, 2));
    }

    #[test]
    fn peek_changes_nothing() {
        let ledger = Ledger::new();
        renew(&ledger, "k", 1, 0);
        ledger.grant("k", lease(2, 10, 100), 1);
        assert!(matches!(
            ledger.peek("k", 1, 5),
            Take::Waiting { wait: 5, .. }
        ));
        for _ in 0..3 {
            assert!(matches!(
                ledger.peek("k", 2, 10),
                Take::Hit { remaining: 0, .. }
            ));
        }
        assert_eq!(ledger.peek("k", 3, 10), Take::Miss);
        assert_eq!(ledger.peek("other", 1, 10), Take::Miss);
        assert_eq!(ledger.counts(), (0, 0));
        assert!(matches!(
            ledger.take("k", 2, 10),
            Take::Hit { remaining: 0, .. }
        ));
        assert_eq!(renew(&ledger, "k", 1, 20), (0, 1 + 2, Some(20)));
    }

    #[test]
    fn nothing_is_answered_at_or_after_the_deadline() {
        let ledger = Ledger::new();
        renew(&ledger, "k", 1, 0);
        ledger.grant("k", lease(10, 0, 100), 1);
        assert_eq!(ledger.take("k", 1, 100), Take::Miss);
        // The renewal takes the old lease's tokens out, to be given back.
        assert_eq!(renew(&ledger, "k", 1, 100), (10, 1, Some(100)));
        assert_eq!(ledger.take("k", 1, 100), Take::Miss);
    }

    #[test]
    fn one_caller_renews_a_key_at_a_time() {
        let ledger = Ledger::new();
        renew(&ledger, "k", 1, 0);
        assert_eq!(ledger.begin("k", 1, 1), Begin::Busy);
        assert_eq!(ledger.begin("k", 2, 2), Begin::Busy);
        ledger.grant("k", lease(5, 3, 100), 2);
        // Another caller's renewal landed: answered from it.
        assert!(matches!(
            ledger.begin("k", 1, 3),
            Begin::Answered(Take::Hit { remaining: 4, .. })
        ));
        // The renewing call and the demand asked while busy count for the next one.
        ledger.take("k", 4, 4);
        let (unused, asked, elapsed) = renew(&ledger, "k", 1, 10);
        assert_eq!((unused, asked, elapsed), (0, 1 + 3 + 1 + 4, Some(10)));
        ledger.end("k");
        assert!(matches!(ledger.begin("k", 1, 11), Begin::Renew { .. }));
    }

    #[test]
    fn due_takes_out_leases_past_their_deadline_and_forgets_idle_keys() {
        let ledger = Ledger::new();
        for (key, deadline) in [("a", 100), ("b", 200), ("c", 300)] {
            renew(&ledger, key, 1, 0);
            ledger.grant(key, lease(7, 0, deadline), 1);
        }
        renew(&ledger, "idle", 1, 0);
        ledger.end("idle");
        assert_eq!(ledger.due(50, 8, 1_000), Vec::new());
        assert_eq!(ledger.due(250, 1, 1_000).len(), 1);
        let mut later = ledger.due(250, 8, 1_000);
        later.sort();
        assert_eq!(later.len(), 1);
        assert_eq!(
            ledger.take("c", 1, 260),
            Take::Hit {
                remaining: 6,
                reset_after: 40
            }
        );
        assert_eq!(ledger.len(), 4);
        for key in ["a", "b"] {
            ledger.end(key);
        }
        assert_eq!(ledger.due(2_000, 8, 1_000), vec![("c".to_owned(), 6)]);
        ledger.end("c");
        // Idle entries are forgotten at most once an `idle`: the next sweep.
        assert_eq!(ledger.due(3_001, 8, 1_000), Vec::new());
        assert!(ledger.is_empty());
    }

    #[test]
    fn a_spent_lease_is_remembered_while_its_record_may_live() {
        let ledger = Ledger::new();
        spend_a_lease(&ledger, "k", 1, 1_000, 10);
        // Idle past `idle`, but its deadline is not `idle` behind: kept.
        assert_eq!(ledger.due(1_500, 8, 1_000), Vec::new());
        assert_eq!(ledger.drain(), vec![("k".to_owned(), 0)]);
        ledger.end("k");
        spend_a_lease(&ledger, "j", 1, 1_000, 10);
        ledger.due(2_500, 8, 1_000); // the record has expired by now: forgotten
        assert!(ledger.drain().iter().all(|(key, _)| key != "j"));
    }

    #[test]
    fn drain_and_clear() {
        let ledger = Ledger::new();
        renew(&ledger, "a", 1, 0);
        ledger.grant("a", lease(4, 0, 100), 1);
        renew(&ledger, "b", 1, 0);
        ledger.grant("b", lease(0, 0, 100), 1);
        // A lease spent to its last token is still recorded in the store: it
        // goes back too, with nothing, so that its record ends.
        spend_a_lease(&ledger, "c", 2, 100, 1);
        let mut drained = ledger.drain();
        drained.sort();
        assert_eq!(drained, vec![("a".to_owned(), 4), ("c".to_owned(), 0)]);
        assert_eq!(ledger.drain(), Vec::new());
        assert_eq!(ledger.begin("a", 1, 1), Begin::Busy);
        // Given back (or its renewal ended): no record left to end.
        ledger.end("c");
        assert_eq!(ledger.drain(), Vec::new());
        ledger.clear();
        assert!(ledger.is_empty());
        assert_eq!(ledger.counts(), (0, 0));
    }

    proptest::proptest! {
        /// Whatever the calls and times, a lease hands out at most its tokens,
        /// and only inside its window.
        #[test]
        fn a_lease_never_hands_out_more_than_it_holds(
            tokens in 0u64..50,
            start in 0i64..20,
            length in 0i64..40,
            calls in proptest::collection::vec((1u64..5, 0i64..80), 0..100),
        ) {
            let ledger = Ledger::new();
            renew(&ledger, "k", 1, 0);
            ledger.grant("k", lease(tokens, start, start + length), 1);
            let mut spent = 0;
            let mut calls = calls;
            calls.sort_by_key(|&(_, now)| now);
            for (cost, now) in calls {
                if let Take::Hit { remaining, .. } = ledger.take("k", cost, now) {
                    proptest::prop_assert!(start <= now && now < start + length);
                    spent += cost;
                    proptest::prop_assert_eq!(remaining, tokens - spent);
                }
            }
            proptest::prop_assert!(spent <= tokens);
        }
    }
}
