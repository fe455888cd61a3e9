//! Retention: what keeping a cached session's KV is worth.
//!
//! While an agent waits on a tool, its prefix occupies KV that other
//! sessions need. Whether that is worth it depends on whether the session
//! comes back before the engine evicts it, and on what recomputing its
//! prefix would cost. This module learns, per harness and tenant, how long
//! sessions stay away between a call's answer and their next call (a
//! histogram of return gaps, and of sessions idle so long they are counted
//! gone: no prompt data), and prices each cached session on each worker:
//!
//! ```text
//! value(s) = p_return(s) · held_tokens(s)
//! p_return = 0                          the session said it is final, or moved away
//!          = 1                          within the horizon the client declared
//!          = P(return | idle so far)    learned, else
//! ```
//!
//! The router's eviction term reads `evicted_value`: the value of the
//! sessions a placement would push out of a worker, oldest first, as an
//! engine's LRU cache would evict them. The report reads the histograms.
//!
//! Engines evict least recently used blocks, so a worker's residents are
//! kept in the order of their last call; a resident whose blocks newer
//! ones have pushed out of the worker's capacity is dropped (its KV is gone
//! whatever it is worth). Nothing here walks all sessions: a pick touches
//! its own session, prices the few oldest residents of each worker that
//! overflows, and checks the sessions whose gone-deadline passed (the
//! `SessionStore`'s ordered index, exactly one deadline per followed
//! session, so it never needs a walk to drop stale ones). What it follows
//! of a session is a part of the session's record in the store, which ends
//! it with the session.

use hashbrown::HashMap;
use kvmesh_vocab::Harness;

use crate::WorkerId;
use crate::lru::LruMap;
use crate::sessions::{SessionId, SessionStore};

/// Return-gap buckets: bucket `i` holds gaps below `FIRST_BUCKET_MS · 2^i`
/// (the last one everything longer): 250 ms to about 36 hours.
pub const GAP_BUCKETS: usize = 20;
const FIRST_BUCKET_MS: u64 = 250;

/// Observations a class needs before its own histogram is used instead of
/// its harness's (and a harness's before the fleet's).
const MIN_CLASS_OBSERVATIONS: f64 = 16.0;
/// Counts are halved once a histogram holds this many, so it follows a
/// fleet whose habits change (about the last few thousand gaps weigh).
const DECAY_AT_OBSERVATIONS: f64 = 4096.0;
/// A session idle this many times its class's 99th-percentile return gap
/// is counted gone (it may still come back; then the count is undone).
const GONE_AFTER_P99_GAPS: f64 = 2.0;
/// Bounds of that horizon: never sooner than this, never later than the
/// session TTL.
const MIN_GONE_AFTER_MS: u64 = 30_000;
/// Classes (harness, tenant) remembered; the least recently seen go first.
const MAX_CLASSES: usize = 1024;

/// The upper bound of bucket `i` in ms (`u64::MAX` for the last).
pub fn bucket_upper_ms(i: usize) -> u64 {
    if i + 1 >= GAP_BUCKETS {
        u64::MAX
    } else {
        FIRST_BUCKET_MS << i
    }
}

fn bucket_lower_ms(i: usize) -> u64 {
    if i == 0 { 0 } else { FIRST_BUCKET_MS << (i - 1) }
}

/// The bucket a gap falls in.
pub fn bucket_of(gap_ms: u64) -> usize {
    (0..GAP_BUCKETS)
        .find(|&i| gap_ms < bucket_upper_ms(i))
        .unwrap_or(GAP_BUCKETS - 1)
}

/// How long sessions of one class stay away: gaps after which they came
/// back, and idle times after which they were counted gone.
#[derive(Debug, Clone, Default)]
pub struct GapHistogram {
    pub returns: [f64; GAP_BUCKETS],
    pub gone: [f64; GAP_BUCKETS],
    /// The sum of both, kept as they change: every priced resident asks
    /// for it (`histogram`) and every observation (`decay`), and summing
    /// the 40 counts each time was most of pricing an overflowing worker.
    /// Summed afresh at each decay, so it never drifts from the counts by
    /// more than the rounding of a few additions.
    observations: f64,
}

impl PartialEq for GapHistogram {
    fn eq(&self, other: &Self) -> bool {
        self.returns == other.returns && self.gone == other.gone
    }
}

impl GapHistogram {
    pub fn observations(&self) -> f64 {
        self.observations
    }

    fn sum_observations(&self) -> f64 {
        self.returns.iter().sum::<f64>() + self.gone.iter().sum::<f64>()
    }

    pub fn returns_total(&self) -> f64 {
        self.returns.iter().sum()
    }

    pub fn observe_return(&mut self, gap_ms: u64) {
        self.returns[bucket_of(gap_ms)] += 1.0;
        self.observations += 1.0;
        self.decay();
    }

    pub fn observe_gone(&mut self, idle_ms: u64) {
        self.gone[bucket_of(idle_ms)] += 1.0;
        self.observations += 1.0;
        self.decay();
    }

    /// A session counted gone after `idle_ms` came back after all.
    fn undo_gone(&mut self, idle_ms: u64) {
        let slot = &mut self.gone[bucket_of(idle_ms)];
        let before = *slot;
        *slot = (before - 1.0).max(0.0);
        self.observations -= before - *slot;
    }

    fn decay(&mut self) {
        if self.observations >= DECAY_AT_OBSERVATIONS {
            for c in self.returns.iter_mut().chain(self.gone.iter_mut()) {
                *c *= 0.5;
            }
            self.observations = self.sum_observations();
        }
    }

    /// Counts of `counts` beyond `idle_ms`, the bucket holding it counted
    /// in proportion to the part of it past `idle_ms`.
    fn beyond(counts: &[f64; GAP_BUCKETS], idle_ms: u64) -> f64 {
        let b = bucket_of(idle_ms);
        let (lower, upper) = (bucket_lower_ms(b), bucket_upper_ms(b));
        let part = if upper == u64::MAX {
            1.0
        } else {
            (upper - idle_ms.max(lower)) as f64 / (upper - lower) as f64
        };
        counts[b] * part + counts[b + 1..].iter().sum::<f64>()
    }

    /// The chance a session idle for `idle_ms` comes back: of the idle
    /// periods that lasted that long, the share that ended in a return. A
    /// session counted gone never returned, so it lasted every length (its
    /// bucket only says when it was given up on). One pseudo-return keeps
    /// the chance at 1 before anything is learned: every cached token then
    /// counts, as without retention.
    pub fn p_return(&self, idle_ms: u64) -> f64 {
        let returns = Self::beyond(&self.returns, idle_ms) + 1.0;
        let gone: f64 = self.gone.iter().sum();
        returns / (returns + gone)
    }

    /// The `q` quantile of return gaps (upper bound of its bucket), when
    /// any were seen.
    pub fn return_quantile_ms(&self, q: f64) -> Option<u64> {
        let total = self.returns_total();
        if total <= 0.0 {
            return None;
        }
        let mut seen = 0.0;
        for (i, c) in self.returns.iter().enumerate() {
            seen += c;
            if seen >= q * total {
                return Some(bucket_upper_ms(i));
            }
        }
        Some(bucket_upper_ms(GAP_BUCKETS - 1))
    }

    fn add(&mut self, other: &Self) {
        for (a, b) in self.returns.iter_mut().zip(other.returns.iter()) {
            *a += b;
        }
        for (a, b) in self.gone.iter_mut().zip(other.gone.iter()) {
            *a += b;
        }
        self.observations = self.sum_observations();
    }
}

/// What a session is learned as: its harness and tenant.
pub type Class = (Harness, String);

/// One cached session on one worker.
#[derive(Debug, Clone)]
struct Resident {
    /// Blocks only it holds there: what its calls added beyond the prefix
    /// the worker already had (a shared system prompt is not its to lose).
    blocks: usize,
    last_seen_ms: u64,
    /// It holds its value until then, whatever was learned.
    declared_until_ms: u64,
    /// Final, or its latest call went to another worker: nobody will reuse
    /// these blocks.
    dead: bool,
    class: Class,
}

/// A live session as retention follows it: a part of its record in the
/// `SessionStore`, which ends it with the session.
#[derive(Debug, Clone)]
pub(crate) struct Follow {
    home: WorkerId,
    class: Class,
    /// When its latest call was answered (else placed).
    idle_since_ms: u64,
    /// It was counted gone after this much idle time.
    counted_gone_ms: Option<u64>,
    /// Its deadline in the store's deadline index, if it has one: one per
    /// session, however many calls it makes (none once it was counted gone).
    pub(crate) deadline_ms: Option<u64>,
}

/// The value placing a request's new blocks would push out of a worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Eviction {
    /// Blocks pushed out.
    pub blocks: usize,
    /// Those blocks weighted by the chance their session comes back.
    pub valued_blocks: f64,
}

/// What kept KV is worth: the learned gaps and each worker's residents.
/// What it follows of each live session is a part of the session's record
/// (`SessionStore`), handed in with each call.
#[derive(Debug, Clone)]
pub struct RetentionValues {
    classes: LruMap<Class, GapHistogram>,
    by_harness: HashMap<Harness, GapHistogram>,
    fleet: GapHistogram,
    /// Each worker's residents, by the id of the session whose calls put
    /// them there: the engine's cache, which outlives the session's record
    /// (the engine evicts them, not the TTL); an ended session's id finds
    /// no record.
    residents: Vec<LruMap<SessionId, Resident>>,
    /// Blocks of each worker's residents.
    resident_blocks: Vec<usize>,
    session_ttl_ms: u64,
    max_sessions: usize,
}

impl RetentionValues {
    pub fn new(max_sessions: usize, session_ttl_ms: u64) -> Self {
        Self {
            classes: LruMap::new(MAX_CLASSES),
            by_harness: HashMap::new(),
            fleet: GapHistogram::default(),
            residents: Vec::new(),
            resident_blocks: Vec::new(),
            session_ttl_ms,
            max_sessions,
        }
    }

    fn learn(&mut self, class: &Class, f: impl Fn(&mut GapHistogram)) {
        f(&mut self.fleet);
        f(self.by_harness.entry(class.0).or_default());
        match self.classes.get_mut(class) {
            Some(h) => f(h),
            None => {
                let mut h = GapHistogram::default();
                f(&mut h);
                self.classes.insert(class.clone(), h);
            }
        }
    }

    /// The histogram a class is judged by: its own once it has enough
    /// observations, else its harness's, else the fleet's.
    pub fn histogram(&self, class: &Class) -> &GapHistogram {
        if let Some(h) = self
            .classes
            .get(class)
            .filter(|h| h.observations() >= MIN_CLASS_OBSERVATIONS)
        {
            return h;
        }
        if let Some(h) = self
            .by_harness
            .get(&class.0)
            .filter(|h| h.observations() >= MIN_CLASS_OBSERVATIONS)
        {
            return h;
        }
        &self.fleet
    }

    /// Each harness's histogram, for the report.
    pub fn harness_histograms(&self) -> impl Iterator<Item = (Harness, &GapHistogram)> {
        self.by_harness.iter().map(|(h, g)| (*h, g))
    }

    /// The fleet's histogram.
    pub fn fleet_histogram(&self) -> GapHistogram {
        let mut all = GapHistogram::default();
        for h in self.by_harness.values() {
            all.add(h);
        }
        all
    }

    /// After how long idle a session of `class` is counted gone.
    pub fn gone_after_ms(&self, class: &Class) -> u64 {
        let p99 = self.histogram(class).return_quantile_ms(0.99).unwrap_or(0);
        ((p99 as f64 * GONE_AFTER_P99_GAPS) as u64)
            .max(MIN_GONE_AFTER_MS)
            .min(self.session_ttl_ms.max(MIN_GONE_AFTER_MS))
    }

    /// The chance a resident comes back to its blocks, at `now_ms`.
    fn p_return(&self, r: &Resident, now_ms: u64) -> f64 {
        self.p_return_by(r, now_ms, |class| self.histogram(class))
    }

    /// `p_return`, with the resident's class's histogram from `histogram`
    /// (asked only when the learned chance is what decides).
    fn p_return_by<'a>(
        &'a self,
        r: &'a Resident,
        now_ms: u64,
        histogram: impl FnOnce(&'a Class) -> &'a GapHistogram,
    ) -> f64 {
        if r.dead {
            0.0
        } else if now_ms < r.declared_until_ms {
            1.0
        } else {
            histogram(&r.class).p_return(now_ms.saturating_sub(r.last_seen_ms))
        }
    }

    fn residents_of(&mut self, w: WorkerId) -> &mut LruMap<SessionId, Resident> {
        if self.residents.len() <= w.0 {
            let cap = self.max_sessions;
            self.residents.resize_with(w.0 + 1, || LruMap::new(cap));
            self.resident_blocks.resize(w.0 + 1, 0);
        }
        &mut self.residents[w.0]
    }

    /// A call of `session` was placed on `worker`, adding `new_blocks` to
    /// what the worker held of it: learn its return gap, move its
    /// residency. Its follow is read from and put back in `store`; a
    /// final call's is not put back (its record ends with it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_pick(
        &mut self,
        store: &mut SessionStore,
        session: SessionId,
        class: Class,
        worker: WorkerId,
        new_blocks: usize,
        declared_horizon_ms: Option<u64>,
        session_final: bool,
        capacity_blocks: usize,
        now_ms: u64,
    ) {
        self.check_gone(store, now_ms);
        let previous = store.take_follow(session);
        if let Some(f) = &previous {
            let gap = now_ms.saturating_sub(f.idle_since_ms);
            if let Some(idle) = f.counted_gone_ms {
                self.learn(&f.class, |h| h.undo_gone(idle));
            }
            self.learn(&f.class, |h| h.observe_return(gap));
            if f.home != worker
                && let Some(r) = self.residents_of(f.home).get_mut(&session)
            {
                r.dead = true;
            }
        }
        // One look-up of the worker's residents for the session's old
        // blocks and its new entry (it was three).
        let residents = self.residents_of(worker);
        let old_blocks = residents.get(&session).map_or(0, |r| r.blocks);
        let blocks = old_blocks + new_blocks;
        let resident = Resident {
            blocks,
            last_seen_ms: now_ms,
            declared_until_ms: declared_horizon_ms.map_or(0, |h| now_ms.saturating_add(h)),
            dead: session_final,
            class: class.clone(),
        };
        let (_, dropped) = residents.insert(session, resident);
        let dropped_blocks: usize = dropped.iter().map(|(_, r)| r.blocks).sum();
        if let Some(total) = self.resident_blocks.get_mut(worker.0) {
            *total = (*total + blocks).saturating_sub(old_blocks + dropped_blocks);
        }
        self.trim(worker, capacity_blocks);
        if session_final {
            return;
        }
        let deadline_ms = previous
            .and_then(|f| f.deadline_ms)
            .unwrap_or_else(|| now_ms.saturating_add(self.gone_after_ms(&class)));
        store.put_follow(
            session,
            Follow {
                home: worker,
                class,
                idle_since_ms: now_ms,
                counted_gone_ms: None,
                deadline_ms: Some(deadline_ms),
            },
        );
    }

    /// The store ended a session, idle past the session TTL, and handed
    /// back its follow: a follow no Pick has yet counted gone is counted
    /// now (idle past the TTL, it is past its class's horizon,
    /// `gone_after_ms`). Its blocks stay among the worker's residents: the
    /// engine evicts them, not the TTL. (Retention's follows were a table
    /// of their own, kept until `max_sessions` pushed them out: an expired
    /// wave's follows shared it with the next wave's, and that churn at the
    /// bound doubled it, 14 to 28 MiB at 100,000 sessions,
    /// `tests/session_memory.rs`.)
    pub(crate) fn end_session(&mut self, follow: Follow, now_ms: u64) {
        if follow.deadline_ms.is_some() {
            let idle = now_ms.saturating_sub(follow.idle_since_ms);
            self.learn(&follow.class, |h| h.observe_gone(idle));
        }
    }

    /// The call of `session` was answered at `now_ms`: its idle time
    /// starts there.
    pub(crate) fn on_answer(&mut self, store: &mut SessionStore, session: SessionId, now_ms: u64) {
        let Some(f) = store.follow_mut(session) else {
            return;
        };
        f.idle_since_ms = f.idle_since_ms.max(now_ms);
        let home = f.home;
        if let Some(r) = self.residents.get_mut(home.0).and_then(|m| m.get_mut(&session)) {
            r.last_seen_ms = r.last_seen_ms.max(now_ms);
        }
    }

    /// Drops the oldest residents of `worker` whose blocks no longer fit
    /// its capacity: the engine has evicted them.
    fn trim(&mut self, worker: WorkerId, capacity_blocks: usize) {
        let Some(residents) = self.residents.get_mut(worker.0) else {
            return;
        };
        let Some(total) = self.resident_blocks.get_mut(worker.0) else {
            return;
        };
        while *total > capacity_blocks {
            let Some((_, r)) = residents.pop_oldest() else {
                break;
            };
            *total = total.saturating_sub(r.blocks);
        }
    }

    /// Counts as gone the sessions idle past their class's horizon.
    fn check_gone(&mut self, store: &mut SessionStore, now_ms: u64) {
        while let Some((session, mut follow)) = store.pop_due(now_ms) {
            let idle = now_ms.saturating_sub(follow.idle_since_ms);
            let horizon = self.gone_after_ms(&follow.class);
            if idle >= horizon {
                self.learn(&follow.class, |h| h.observe_gone(idle));
                follow.counted_gone_ms = Some(idle);
            } else {
                follow.deadline_ms = Some(follow.idle_since_ms.saturating_add(horizon).max(now_ms + 1));
            }
            store.put_follow(session, follow);
        }
    }

    /// What placing `new_blocks` on `worker` (holding `cached_blocks` of
    /// `capacity_blocks`) would push out, oldest residents first, by the
    /// chance each comes back; `session`'s own blocks are not counted (its
    /// call refreshes them). Blocks of no known resident count in full.
    pub(crate) fn evicted(
        &self,
        worker: WorkerId,
        session: Option<SessionId>,
        overflow_blocks: usize,
        now_ms: u64,
    ) -> Eviction {
        let mut left = overflow_blocks;
        let mut valued = 0.0;
        if let Some(residents) = self.residents.get(worker.0) {
            for (id, r) in residents.iter_oldest() {
                if left == 0 {
                    break;
                }
                if Some(*id) == session {
                    continue;
                }
                let taken = r.blocks.min(left);
                valued += taken as f64 * self.p_return(r, now_ms);
                left -= taken;
            }
        }
        Eviction {
            blocks: overflow_blocks,
            valued_blocks: valued + left as f64,
        }
    }

    /// (resident blocks, blocks weighted by their chance of return) of a
    /// worker, for `/debug/workers`.
    pub fn worker_value(&self, worker: WorkerId, now_ms: u64) -> (usize, f64) {
        let Some(residents) = self.residents.get(worker.0) else {
            return (0, 0.0);
        };
        // Residents of one class follow each other: its histogram is looked
        // up once per run of them, not per resident (this walk holds the
        // router's lock, one worker at a time).
        let mut last: Option<(&Class, &GapHistogram)> = None;
        let valued = residents
            .iter()
            .map(|(_, r)| {
                let p = self.p_return_by(r, now_ms, |class| match last {
                    Some((seen, h)) if seen == class => h,
                    _ => {
                        let h = self.histogram(class);
                        last = Some((class, h));
                        h
                    }
                });
                r.blocks as f64 * p
            })
            .sum();
        (self.resident_blocks.get(worker.0).copied().unwrap_or(0), valued)
    }

    /// Every worker's residents together (see `crate::tests::Footprint`).
    #[cfg(test)]
    pub(crate) fn footprints(&self) -> crate::tests::Footprints {
        let residents =
            self.residents
                .iter()
                .map(LruMap::footprint)
                .fold(crate::tests::Footprint::default(), |sum, f| crate::tests::Footprint {
                    len: sum.len + f.len,
                    table_bytes: sum.table_bytes + f.table_bytes,
                    queue_bytes: sum.queue_bytes + f.queue_bytes,
                });
        vec![("retention residents", residents)]
    }

    /// The worker was removed or restarted: its residents are gone.
    pub fn clear_worker(&mut self, worker: WorkerId) {
        if let Some(r) = self.residents.get_mut(worker.0) {
            r.clear();
        }
        if let Some(t) = self.resident_blocks.get_mut(worker.0) {
            *t = 0;
        }
    }
}
