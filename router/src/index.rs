//! The prefix index: which worker holds which KV block, in which tier, fed by KV events.
//!
//! Blocks are keyed by sequence hash, which already encodes the whole prefix before a block
//! (`docs/hashing.md`), so no tree is needed to match prefixes: a request's leading blocks are
//! matched by looking its sequence hashes up in order and keeping, per worker, the run of
//! consecutive hits. The index is sharded (a read-write lock per shard) so that many threads
//! ingest and query at once; it does no I/O and reads no clock.
//!
//! Event handling per worker: duplicates (an id at or below the last applied) are dropped;
//! a gap in ids is reported ([`Ingest::Gap`]) so that the caller asks the source for a dump,
//! and the event is applied anyway; events of workers the index does not know (never added,
//! or already removed) are refused, so a departed worker cannot come back through stale
//! events; a `Stored` whose parent is unknown is applied (the sequence hash alone is the key).

use std::collections::HashMap;

use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::SequenceHash;
use parking_lot::RwLock;

use crate::table::{mix, random_seed, Table};

/// A worker (or fabric node) id: the contract's.
pub use kvfabric::contract::discovery::WorkerId;

const SHARDS: usize = 64;

/// A worker's block log is compacted when it holds more than twice its live blocks plus
/// this. (Tiny in unit tests, so that the reference tests compact often.)
const LOG_SLACK: usize = if cfg!(test) { 1 } else { 64 };

/// How many blocks ahead a query prefetches.
const PREFETCH_AHEAD: usize = 8;

/// The tiers a block is held in on one worker: bit i = `TierKind::ALL[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierMask(pub u8);

fn bit(t: TierKind) -> u8 {
    1 << (t as u8)
}

impl TierMask {
    /// The fastest tier in the mask.
    pub fn best(self) -> Option<TierKind> {
        TierKind::ALL.into_iter().find(|&t| self.0 & bit(t) != 0)
    }

    /// Whether no tier is set.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// What ingesting an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingest {
    /// Applied in order.
    Applied,
    /// Already applied (id at or below the last one): ignored.
    Duplicate,
    /// Applied, but ids `expected..got` were never seen: ask the source for a dump.
    Gap {
        /// The id that was due.
        expected: u64,
        /// The id received.
        got: u64,
    },
    /// The worker is not in the index: ignored.
    UnknownWorker,
}

/// What the index keeps per worker besides its blocks' holder entries.
///
/// The worker's tiers per block live only in the holder lists; the worker keeps a log of the
/// blocks it came to hold, so that a clear or a departure can find them. A removal does not
/// touch the log (an append per new block and nothing per removal keep ingestion at one
/// table lookup per block); the log is compacted when it outgrows twice the blocks held.
#[derive(Debug, Default)]
struct WorkerState {
    last_event_id: u64,
    /// Blocks the worker holds now.
    live: usize,
    /// Every block the worker held at some point since the last compaction (a superset of
    /// what it holds; may repeat a block that was removed and stored again).
    log: Vec<SequenceHash>,
}

/// A worker's dense slot in the index (its position in [`Workers::slots`]): holder lists
/// name workers by slot, four bytes instead of eight, so that a node takes 32 bytes and a
/// big index touches (and the kernel zeroes) less memory as it grows.
type Slot = u32;

/// The holders of one block, sorted by worker slot; one or two inline (most blocks have few
/// holders), so a lookup touches one cache line.
type Holders = smallvec::SmallVec<[(Slot, TierMask); 2]>;

/// One block's holders and a digest of them (workers and masks), so that a query can tell
/// in O(1) that a block has exactly the holders of the block before it.
#[derive(Debug, Default)]
struct Node {
    digest: u64,
    holders: Holders,
}

/// One holder's share of a node digest; the digest is the XOR of all shares, so adding,
/// changing or removing a holder updates it in O(1).
fn share(w: Slot, m: TierMask) -> u64 {
    if m.is_empty() {
        return 0;
    }
    mix(u64::from(w) ^ (u64::from(m.0) << 56), 0x9e37_79b9_7f4a_7c15)
}

type Shard = Table<Node>;

/// A worker's leading run of cached blocks: how many, and how many of them are held in each
/// tier at best (device, host, disk, remote).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Run {
    /// Leading blocks held.
    pub blocks: u32,
    /// Of those, how many have each tier as their fastest, indexed like `TierKind::ALL`.
    pub per_tier: [u32; 4],
}

impl Run {
    fn push(&mut self, t: TierKind) {
        self.blocks += 1;
        self.per_tier[t as usize] += 1;
    }

    /// A run of `n` blocks all in tier `t`.
    pub fn uniform(n: u32, t: TierKind) -> Self {
        let mut r = Run { blocks: n, per_tier: [0; 4] };
        r.per_tier[t as usize] = n;
        r
    }
}

/// Per worker, the leading blocks of a query it holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Overlap {
    /// Each matched worker's run, sorted by worker id.
    pub workers: Vec<(WorkerId, Run)>,
}

impl Overlap {
    /// The leading blocks a worker holds (0 if none).
    pub fn blocks(&self, w: WorkerId) -> usize {
        self.run(w).blocks as usize
    }

    /// A worker's run (empty if none).
    pub fn run(&self, w: WorkerId) -> Run {
        self.workers
            .binary_search_by_key(&w, |(id, _)| *id)
            .map_or(Run::default(), |i| self.workers[i].1)
    }
}

/// The workers: ids to slots, and each slot's worker. A departing worker keeps its slot
/// (out of `by_id`, so no event reaches it) until its blocks are unlinked; only then is the
/// slot free for a new worker, so a slot read from a holder list always names the worker
/// that stored the block.
#[derive(Debug, Default)]
struct Workers {
    by_id: HashMap<WorkerId, Slot>,
    slots: Vec<Option<parking_lot::Mutex<WorkerState>>>,
    /// Each slot's worker id, packed: a query translates every matched slot.
    ids: Vec<WorkerId>,
    free: Vec<Slot>,
}

impl Workers {
    fn get(&self, w: WorkerId) -> Option<(Slot, &parking_lot::Mutex<WorkerState>)> {
        let s = *self.by_id.get(&w)?;
        self.slots[s as usize].as_ref().map(|e| (s, e))
    }

    /// The id of the worker in slot `s` (which a holder list names, so it is occupied).
    fn id(&self, s: Slot) -> WorkerId {
        self.ids[s as usize]
    }
}

/// The concurrent prefix index.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Mixes sequence hashes into shard and slot positions.
    seed: u64,
    shards: Vec<RwLock<Shard>>,
    workers: RwLock<Workers>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        let seed = random_seed();
        PrefixIndex {
            seed,
            shards: (0..SHARDS).map(|_| RwLock::new(Table::with_seed(seed))).collect(),
            workers: RwLock::new(Workers::default()),
        }
    }

    /// The shard of a block: the top bits of its mixed hash (the table slot uses the low ones).
    fn shard(&self, h: SequenceHash) -> &RwLock<Shard> {
        &self.shards[(mix(h.0, self.seed) >> (64 - SHARDS.trailing_zeros())) as usize]
    }

    /// Adds a worker (discovery said it joined). Idempotent.
    pub fn add_worker(&self, w: WorkerId) {
        let mut ws = self.workers.write();
        if ws.by_id.contains_key(&w) {
            return;
        }
        let entry = Default::default();
        let s = match ws.free.pop() {
            Some(s) => {
                ws.slots[s as usize] = Some(entry);
                ws.ids[s as usize] = w;
                s
            }
            None => {
                // More than 2^32 workers at once cannot be: each holds memory of its own.
                let s = Slot::try_from(ws.slots.len()).expect("fewer than 2^32 workers");
                ws.slots.push(Some(entry));
                ws.ids.push(w);
                s
            }
        };
        ws.by_id.insert(w, s);
    }

    /// Removes a worker and every block it held (discovery said it left).
    pub fn remove_worker(&self, w: WorkerId) -> bool {
        let (s, log) = {
            let mut ws = self.workers.write();
            let Some(s) = ws.by_id.remove(&w) else { return false };
            let log = ws.slots[s as usize]
                .as_ref()
                .map(|state| std::mem::take(&mut state.lock().log))
                .unwrap_or_default();
            (s, log)
        };
        for h in log {
            self.unlink(h, s, TierMask(0xff));
        }
        let mut ws = self.workers.write();
        ws.slots[s as usize] = None;
        ws.free.push(s);
        true
    }

    /// Known workers.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut v: Vec<_> = self.workers.read().by_id.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Blocks a worker holds.
    pub fn worker_blocks(&self, w: WorkerId) -> usize {
        self.workers.read().get(w).map_or(0, |(_, state)| state.lock().live)
    }

    /// Adds tiers of block `h` to worker `w`; true if `w` did not hold `h` before.
    fn link(&self, h: SequenceHash, w: Slot, mask: TierMask) -> bool {
        let mut shard = self.shard(h).write();
        let node = shard.entry(h.0);
        match node.holders.binary_search_by_key(&w, |(id, _)| *id) {
            Ok(i) => {
                let old = node.holders[i].1;
                node.holders[i].1 .0 |= mask.0;
                node.digest ^= share(w, old) ^ share(w, node.holders[i].1);
                false
            }
            Err(i) => {
                node.holders.insert(i, (w, mask));
                node.digest ^= share(w, mask);
                true
            }
        }
    }

    /// Takes tiers of block `h` from worker `w`; true if `w` held `h` and now holds it in no
    /// tier.
    fn unlink(&self, h: SequenceHash, w: Slot, mask: TierMask) -> bool {
        let mut shard = self.shard(h).write();
        let Some(node) = shard.get_mut(h.0) else { return false };
        let Ok(i) = node.holders.binary_search_by_key(&w, |(id, _)| *id) else { return false };
        let old = node.holders[i].1;
        node.holders[i].1 .0 &= !mask.0;
        node.digest ^= share(w, old) ^ share(w, node.holders[i].1);
        if !node.holders[i].1.is_empty() {
            return false;
        }
        node.holders.remove(i);
        if node.holders.is_empty() {
            shard.remove(h.0);
        }
        true
    }

    /// Whether worker `w` holds block `h` in some tier.
    fn holds(&self, h: SequenceHash, w: Slot) -> bool {
        self.shard(h)
            .read()
            .get(h.0)
            .is_some_and(|n| n.holders.binary_search_by_key(&w, |(id, _)| *id).is_ok())
    }

    fn store(&self, st: &mut WorkerState, w: Slot, h: SequenceHash, mask: TierMask) {
        if self.link(h, w, mask) {
            st.live += 1;
            st.log.push(h);
        }
    }

    /// Drops every block of `w`.
    fn clear(&self, st: &mut WorkerState, w: Slot) {
        for h in std::mem::take(&mut st.log) {
            self.unlink(h, w, TierMask(0xff));
        }
        st.live = 0;
    }

    /// Applies one event from worker `w`.
    pub fn ingest(&self, id: WorkerId, event: &KvEvent) -> Ingest {
        let workers = self.workers.read();
        let Some((w, state)) = workers.get(id) else { return Ingest::UnknownWorker };
        let mut st = state.lock();
        if event.event_id <= st.last_event_id && st.last_event_id != 0 {
            return Ingest::Duplicate;
        }
        let expected = st.last_event_id + 1;
        let outcome = if st.last_event_id != 0 && event.event_id != expected {
            Ingest::Gap { expected, got: event.event_id }
        } else {
            Ingest::Applied
        };
        st.last_event_id = event.event_id;
        match &event.data {
            KvEventData::Stored { sequence_hashes, tier, .. } => {
                let m = TierMask(bit(*tier));
                for &h in sequence_hashes {
                    self.store(&mut st, w, h, m);
                }
            }
            KvEventData::Removed { sequence_hashes, tier } => {
                let m = TierMask(bit(*tier));
                for &h in sequence_hashes {
                    if self.unlink(h, w, m) {
                        st.live -= 1;
                    }
                }
                if st.log.len() > 2 * st.live + LOG_SLACK {
                    // Amortized: the log grew by at least `live + LOG_SLACK` appends since
                    // the last compaction.
                    st.log.sort_unstable();
                    st.log.dedup();
                    st.log.retain(|&h| self.holds(h, w));
                }
            }
            KvEventData::Cleared => self.clear(&mut st, w),
        }
        outcome
    }

    /// Replaces everything known about `w` with a dump of its blocks (after a gap), and sets
    /// its last event id.
    pub fn reset_worker(
        &self,
        id: WorkerId,
        blocks: &[(SequenceHash, TierKind)],
        last_event_id: u64,
    ) -> Ingest {
        let workers = self.workers.read();
        let Some((w, state)) = workers.get(id) else { return Ingest::UnknownWorker };
        let mut st = state.lock();
        self.clear(&mut st, w);
        for &(h, t) in blocks {
            self.store(&mut st, w, h, TierMask(bit(t)));
        }
        st.last_event_id = last_event_id;
        Ingest::Applied
    }

    /// For a request's sequence hashes, each worker's leading run of held blocks, with the
    /// fastest tier of each block.
    ///
    /// Cost: one hash lookup per block of the matched prefix (prefetched a few blocks ahead),
    /// and a merge of two sorted worker lists (the workers still matching, the block's
    /// holders) wherever the holders change from one block to the next.
    pub fn overlap(&self, hashes: &[SequenceHash]) -> Overlap {
        // Held until the slots are translated to ids: a departing worker's slot is not
        // reused while a query may have read it from a holder list.
        let workers = self.workers.read();
        // `runs[..live]` are the workers still matching, sorted by slot; the rest ended.
        let mut runs: Vec<(Slot, Run)> = Vec::new();
        // The tier each live run added last (same order as `runs`).
        let mut last: Vec<TierKind> = Vec::new();
        let mut live = 0;
        // The previous block's holder digest and count: consecutive blocks of a shared prefix
        // mostly have the same holders (and tiers), and then every live run grows by the tier
        // it added last. Such steps are only counted (`pending`) and added to the live runs
        // when their holders change or the query ends, so a long shared prefix held by many
        // workers costs O(1) per block.
        let mut prev: Option<(u64, usize)> = None;
        let mut pending = 0u32;
        let flush = |runs: &mut [(Slot, Run)], last: &[TierKind], pending: u32| {
            if pending > 0 {
                for (r, &t) in runs.iter_mut().zip(last) {
                    r.1.blocks += pending;
                    r.1.per_tier[t as usize] += pending;
                }
            }
        };
        // The lookups of a prefix are independent: prefetching the slots of the blocks a few
        // places ahead overlaps their cache misses (most of a query's time on a large index).
        for &h in hashes.iter().take(PREFETCH_AHEAD) {
            self.shard(h).read().prefetch(h.0);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(&ahead) = hashes.get(i + PREFETCH_AHEAD) {
                self.shard(ahead).read().prefetch(ahead.0);
            }
            let shard = self.shard(h).read();
            let Some(node) = shard.get(h.0) else { break };
            let holders = &node.holders;
            if i == 0 {
                runs.reserve(holders.len());
                last.reserve(holders.len());
                for &(w, m) in holders.iter() {
                    if let Some(t) = m.best() {
                        let mut r = Run::default();
                        r.push(t);
                        runs.push((w, r));
                        last.push(t);
                    }
                }
                live = runs.len();
            } else if prev == Some((node.digest, holders.len())) && live == holders.len() {
                pending += 1;
            } else {
                flush(&mut runs[..live], &last, pending);
                pending = 0;
                // Merge join of two sorted lists, compacting the live prefix in place.
                let (mut j, mut k) = (0, 0);
                for idx in 0..live {
                    let w = runs[idx].0;
                    while j < holders.len() && holders[j].0 < w {
                        j += 1;
                    }
                    if let Some(t) =
                        holders.get(j).filter(|(id, _)| *id == w).and_then(|(_, m)| m.best())
                    {
                        runs[idx].1.push(t);
                        runs.swap(k, idx);
                        last[idx] = t;
                        last.swap(k, idx);
                        k += 1;
                    }
                }
                live = k;
            }
            if live == 0 {
                break;
            }
            prev = Some((node.digest, holders.len()));
        }
        flush(&mut runs[..live], &last, pending);
        let mut out: Vec<(WorkerId, Run)> =
            runs.into_iter().map(|(s, r)| (workers.id(s), r)).collect();
        drop(workers);
        out.sort_unstable_by_key(|(w, _)| *w);
        Overlap { workers: out }
    }

    /// Distinct blocks indexed (diagnostics).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn stored(id: u64, hashes: &[u64], tier: TierKind) -> KvEvent {
        KvEvent {
            event_id: id,
            data: KvEventData::Stored {
                sequence_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
                parent: None,
                tier,
            },
        }
    }

    fn removed(id: u64, hashes: &[u64], tier: TierKind) -> KvEvent {
        KvEvent {
            event_id: id,
            data: KvEventData::Removed {
                sequence_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
                tier,
            },
        }
    }

    fn hs(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().map(|&h| SequenceHash(h)).collect()
    }

    #[test]
    fn leading_runs_per_worker_and_tier() {
        let ix = PrefixIndex::new();
        let (w1, w2) = (WorkerId(1), WorkerId(2));
        ix.add_worker(w1);
        ix.add_worker(w2);
        assert_eq!(ix.ingest(w1, &stored(1, &[10, 11, 12], TierKind::Host)), Ingest::Applied);
        assert_eq!(ix.ingest(w2, &stored(1, &[10, 11], TierKind::Disk)), Ingest::Applied);
        assert_eq!(ix.ingest(w2, &stored(2, &[10], TierKind::Device)), Ingest::Applied);
        let o = ix.overlap(&hs(&[10, 11, 12, 13]));
        assert_eq!(o.run(w1), Run::uniform(3, TierKind::Host));
        assert_eq!(o.run(w2), Run { blocks: 2, per_tier: [1, 0, 1, 0] }, "device and disk");
        // A hole ends a run: worker 1 loses block 11.
        ix.ingest(w1, &removed(2, &[11], TierKind::Host));
        assert_eq!(ix.overlap(&hs(&[10, 11, 12])).blocks(w1), 1);
        // Leaving removes everything at once.
        assert!(ix.remove_worker(w2));
        assert_eq!(ix.overlap(&hs(&[10])).blocks(w2), 0);
        assert_eq!(ix.ingest(w2, &stored(3, &[10], TierKind::Host)), Ingest::UnknownWorker);
        assert_eq!(ix.overlap(&hs(&[10])).blocks(w2), 0, "stale events cannot resurrect a worker");
    }

    #[test]
    fn duplicates_gaps_and_dumps() {
        let ix = PrefixIndex::new();
        let w7 = WorkerId(7);
        ix.add_worker(w7);
        assert_eq!(ix.ingest(w7, &stored(1, &[1], TierKind::Host)), Ingest::Applied);
        assert_eq!(ix.ingest(w7, &stored(1, &[1], TierKind::Host)), Ingest::Duplicate);
        assert_eq!(
            ix.ingest(w7, &stored(4, &[2], TierKind::Host)),
            Ingest::Gap { expected: 2, got: 4 }
        );
        assert_eq!(
            ix.ingest(w7, &stored(3, &[3], TierKind::Host)),
            Ingest::Duplicate,
            "late event after a gap"
        );
        ix.reset_worker(
            w7,
            &[(SequenceHash(1), TierKind::Host), (SequenceHash(3), TierKind::Disk)],
            9,
        );
        assert_eq!(ix.worker_blocks(w7), 2);
        assert_eq!(ix.overlap(&hs(&[2])).blocks(w7), 0);
        assert_eq!(ix.ingest(w7, &stored(10, &[5], TierKind::Host)), Ingest::Applied);
        ix.ingest(w7, &KvEvent { event_id: 11, data: KvEventData::Cleared });
        assert_eq!(ix.worker_blocks(w7), 0);
        assert!(ix.is_empty());
    }

    /// The brute-force reference: per worker, a map block → tiers.
    fn reference_overlap(
        model: &BTreeMap<WorkerId, BTreeMap<u64, u8>>,
        q: &[u64],
    ) -> Vec<(WorkerId, Run)> {
        let mut out = Vec::new();
        for (&w, blocks) in model {
            let mut run = Run::default();
            for h in q {
                match blocks.get(h).and_then(|&m| TierMask(m).best()) {
                    Some(t) => run.push(t),
                    None => break,
                }
            }
            if run.blocks > 0 {
                out.push((w, run));
            }
        }
        out
    }

    #[derive(Debug, Clone)]
    enum Ev {
        Store(WorkerId, Vec<u64>, u8),
        Remove(WorkerId, Vec<u64>, u8),
        Clear(WorkerId),
        Leave(WorkerId),
        Join(WorkerId),
    }

    /// Worker ids whose order is not the order in which they take slots, so that results
    /// sorted by id differ from results sorted by slot.
    const IDS: [WorkerId; 4] = [WorkerId(900), WorkerId(5), WorkerId(u64::MAX - 1), WorkerId(77)];

    fn ev() -> impl Strategy<Value = Ev> {
        let hashes = proptest::collection::vec(0u64..12, 1..5);
        let w = || proptest::sample::select(IDS.to_vec());
        prop_oneof![
            6 => (w(), hashes.clone(), 0u8..4).prop_map(|(w, h, t)| Ev::Store(w, h, t)),
            3 => (w(), hashes, 0u8..4).prop_map(|(w, h, t)| Ev::Remove(w, h, t)),
            1 => w().prop_map(Ev::Clear),
            1 => w().prop_map(Ev::Leave),
            2 => w().prop_map(Ev::Join),
        ]
    }

    proptest! {
        /// The index answers exactly as a brute-force reference over random event streams
        /// (stores, removals per tier, clears, workers leaving and joining).
        #[test]
        fn matches_a_brute_force_reference(
            events in proptest::collection::vec(ev(), 1..120),
            queries in proptest::collection::vec(proptest::collection::vec(0u64..12, 1..6), 1..8),
        ) {
            let ix = PrefixIndex::new();
            let mut model: BTreeMap<WorkerId, BTreeMap<u64, u8>> = BTreeMap::new();
            let mut ids: HashMap<WorkerId, u64> = HashMap::new();
            for w in IDS { ix.add_worker(w); model.insert(w, BTreeMap::new()); }
            for e in events {
                let mut next = |w: WorkerId| { let i = ids.entry(w).or_insert(0); *i += 1; *i };
                match e {
                    Ev::Store(w, h, t) => {
                        let tier = TierKind::ALL[t as usize];
                        let known = model.contains_key(&w);
                        let r = ix.ingest(w, &stored(next(w), &h, tier));
                        prop_assert_eq!(r == Ingest::UnknownWorker, !known);
                        if let Some(m) = model.get_mut(&w) { for x in h { *m.entry(x).or_insert(0) |= bit(tier); } }
                    }
                    Ev::Remove(w, h, t) => {
                        let tier = TierKind::ALL[t as usize];
                        ix.ingest(w, &removed(next(w), &h, tier));
                        if let Some(m) = model.get_mut(&w) {
                            for x in h { if let Some(v) = m.get_mut(&x) { *v &= !bit(tier); if *v == 0 { m.remove(&x); } } }
                        }
                    }
                    Ev::Clear(w) => {
                        ix.ingest(w, &KvEvent { event_id: next(w), data: KvEventData::Cleared });
                        if let Some(m) = model.get_mut(&w) { m.clear(); }
                    }
                    Ev::Leave(w) => { ix.remove_worker(w); model.remove(&w); ids.remove(&w); }
                    Ev::Join(w) => { ix.add_worker(w); model.entry(w).or_default(); }
                }
                for q in &queries {
                    let got = ix.overlap(&hs(q)).workers;
                    prop_assert_eq!(got, reference_overlap(&model, q));
                }
            }
        }
    }
}
