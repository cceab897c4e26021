//! Eviction and admission policies: plain data structures, no I/O, no clock.
//!
//! An [`EvictionPolicy`] sees only *evictable* blocks (stored and unpinned), by slot index:
//! the pool inserts a slot when it becomes evictable, removes it when it is pinned or freed,
//! touches it on use, and asks for a victim under pressure. [`Lru`] (the default) and
//! [`Fifo`] implement it in O(1) with an index-linked list over the slots.
//!
//! A [`FrequencyFilter`] decides which blocks deserve a slower tier: it counts hits per
//! sequence hash (bounded, with halving to forget the past) and admits a block once it was hit
//! `min_hits` times — so that one-off blocks never wear the SSD (Dynamo KVBM's rule).

use std::collections::HashMap;

use kvfabric::hash::SequenceHash;

/// Which blocks go first when a tier is full.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// `slot` became evictable.
    fn insert(&mut self, slot: u32);
    /// An evictable `slot` was used.
    fn touch(&mut self, slot: u32);
    /// `slot` is no longer evictable (pinned or freed); no-op if it was not.
    fn remove(&mut self, slot: u32);
    /// Picks a victim and removes it from the candidates.
    fn pop_victim(&mut self) -> Option<u32>;
    /// Evictable slots.
    fn len(&self) -> usize;
    /// `slot` holds a block that latency-sensitive requests use (`keep`), or no longer
    /// (its block left): a policy that weighs classes evicts such blocks last. Others ignore
    /// it.
    fn mark(&mut self, _slot: u32, _keep: bool) {}
    /// Whether no slot is evictable.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which policy a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Least recently used first.
    #[default]
    Lru,
    /// First stored first, uses ignored.
    Fifo,
}

impl PolicyKind {
    /// A policy for `slots` slots: this kind's order, with the blocks of latency-sensitive
    /// requests kept apart and evicted last ([`Kept`]).
    pub fn build(self, slots: u32) -> Box<dyn EvictionPolicy> {
        Box::new(Kept::new(self.plain(slots), self.plain(slots), slots))
    }

    fn plain(self, slots: u32) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::new(slots)),
            PolicyKind::Fifo => Box::new(Fifo(Lru::new(slots))),
        }
    }
}

const NIL: u32 = u32::MAX;

/// Least recently used: a doubly linked list threaded through per-slot arrays; the head is
/// the oldest.
#[derive(Debug, Clone)]
pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    /// An empty list over `slots` slots.
    pub fn new(slots: u32) -> Self {
        let n = slots as usize;
        Lru {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            linked: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn unlink(&mut self, s: u32) {
        let i = s as usize;
        if !self.linked.get(i).copied().unwrap_or(false) {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i] = false;
        self.len -= 1;
    }

    fn push_back(&mut self, s: u32) {
        let i = s as usize;
        if i >= self.linked.len() || self.linked[i] {
            return;
        }
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
        self.linked[i] = true;
        self.len += 1;
    }
}

impl EvictionPolicy for Lru {
    fn insert(&mut self, slot: u32) {
        self.push_back(slot);
    }
    fn touch(&mut self, slot: u32) {
        if self.linked.get(slot as usize).copied().unwrap_or(false) {
            self.unlink(slot);
            self.push_back(slot);
        }
    }
    fn remove(&mut self, slot: u32) {
        self.unlink(slot);
    }
    fn pop_victim(&mut self) -> Option<u32> {
        let h = self.head;
        if h == NIL {
            return None;
        }
        self.unlink(h);
        Some(h)
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// First in, first out: LRU that ignores uses.
#[derive(Debug, Clone)]
pub struct Fifo(Lru);

impl EvictionPolicy for Fifo {
    fn insert(&mut self, slot: u32) {
        self.0.insert(slot);
    }
    fn touch(&mut self, _slot: u32) {}
    fn remove(&mut self, slot: u32) {
        self.0.remove(slot);
    }
    fn pop_victim(&mut self) -> Option<u32> {
        self.0.pop_victim()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Two lists of one order: blocks that latency-sensitive requests use ([`EvictionPolicy::mark`])
/// are victims only when no other block is evictable, so that batch prefixes never push them
/// out while colder blocks exist. They may hold at most half the slots: past it, the oldest
/// kept block is kept no more (it joins the others as their newest).
#[derive(Debug)]
pub struct Kept {
    others: Box<dyn EvictionPolicy>,
    kept: Box<dyn EvictionPolicy>,
    keep: Vec<bool>,
    kept_max: usize,
}

impl Kept {
    /// Over `slots` slots, each list in its policy's order.
    pub fn new(others: Box<dyn EvictionPolicy>, kept: Box<dyn EvictionPolicy>, slots: u32) -> Self {
        Kept {
            others,
            kept,
            keep: vec![false; slots as usize],
            kept_max: (slots as usize / 2).max(1),
        }
    }

    fn kept(&self, slot: u32) -> bool {
        self.keep.get(slot as usize).copied().unwrap_or(false)
    }

    fn bound(&mut self) {
        while self.kept.len() > self.kept_max {
            let Some(v) = self.kept.pop_victim() else { break };
            self.keep[v as usize] = false;
            self.others.insert(v);
        }
    }
}

impl EvictionPolicy for Kept {
    fn insert(&mut self, slot: u32) {
        if self.kept(slot) {
            self.kept.insert(slot);
            self.bound();
        } else {
            self.others.insert(slot);
        }
    }
    fn touch(&mut self, slot: u32) {
        if self.kept(slot) {
            self.kept.touch(slot);
        } else {
            self.others.touch(slot);
        }
    }
    fn remove(&mut self, slot: u32) {
        self.others.remove(slot);
        self.kept.remove(slot);
    }
    fn pop_victim(&mut self) -> Option<u32> {
        let v = self.others.pop_victim().or_else(|| self.kept.pop_victim())?;
        if let Some(k) = self.keep.get_mut(v as usize) {
            *k = false;
        }
        Some(v)
    }
    fn len(&self) -> usize {
        self.others.len() + self.kept.len()
    }
    fn mark(&mut self, slot: u32, keep: bool) {
        if slot as usize >= self.keep.len() || self.keep[slot as usize] == keep {
            return;
        }
        let before = self.len();
        self.remove(slot);
        let evictable = self.len() < before;
        self.keep[slot as usize] = keep;
        if evictable {
            self.insert(slot);
        }
    }
}

/// Admits a block to a slower tier once it was hit `min_hits` times.
#[derive(Debug, Clone)]
pub struct FrequencyFilter {
    min_hits: u32,
    counts: HashMap<SequenceHash, u32>,
    tracked_max: usize,
}

impl FrequencyFilter {
    /// Admits after `min_hits` hits (0 or 1 admit blocks never or once hit alike: 0 admits
    /// everything), remembering at most `tracked_max` blocks.
    pub fn new(min_hits: u32, tracked_max: usize) -> Self {
        FrequencyFilter { min_hits, counts: HashMap::new(), tracked_max: tracked_max.max(1) }
    }

    /// Records a hit.
    pub fn hit(&mut self, hash: SequenceHash) {
        if self.min_hits == 0 {
            return;
        }
        if self.counts.len() >= self.tracked_max && !self.counts.contains_key(&hash) {
            // Age: halve every count and forget the zeros, so the table stays bounded and
            // old popularity fades.
            self.counts.retain(|_, c| {
                *c /= 2;
                *c > 0
            });
            if self.counts.len() >= self.tracked_max {
                return;
            }
        }
        let c = self.counts.entry(hash).or_insert(0);
        *c = c.saturating_add(1);
    }

    /// Hits recorded for `hash`.
    pub fn hits(&self, hash: SequenceHash) -> u32 {
        self.counts.get(&hash).copied().unwrap_or(0)
    }

    /// Whether `hash` may go to the slower tier.
    pub fn admits(&self, hash: SequenceHash) -> bool {
        self.hits(hash) >= self.min_hits
    }

    /// Forgets a block.
    pub fn forget(&mut self, hash: SequenceHash) {
        self.counts.remove(&hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lru_order_and_touch() {
        let mut l = Lru::new(8);
        for s in [3, 1, 4, 5] {
            l.insert(s);
        }
        l.touch(3);
        l.remove(4);
        assert_eq!(l.len(), 3);
        assert_eq!(
            (l.pop_victim(), l.pop_victim(), l.pop_victim(), l.pop_victim()),
            (Some(1), Some(5), Some(3), None)
        );
        l.insert(9); // out of range: ignored, never a panic
        assert!(l.is_empty());
    }

    #[test]
    fn kept_blocks_go_last_and_hold_half_the_slots_at_most() {
        let mut p = PolicyKind::Lru.build(8);
        for s in 0..6 {
            p.insert(s);
        }
        // Slots 0 and 1 hold an interactive prefix: the batch blocks 2..6 go first, newer or
        // not.
        p.mark(0, true);
        p.mark(1, true);
        p.touch(2);
        let order: Vec<u32> = std::iter::from_fn(|| p.pop_victim()).collect();
        assert_eq!(order, [3, 4, 5, 2, 0, 1]);
        // A kept slot that was evicted is kept no more when it holds another block.
        p.insert(0);
        p.insert(7);
        assert_eq!(p.pop_victim(), Some(0));
        // Marked while pinned (not evictable): kept from when it is evictable again.
        p.mark(6, true);
        p.insert(6);
        p.insert(5);
        assert_eq!((p.pop_victim(), p.pop_victim(), p.pop_victim()), (Some(7), Some(5), Some(6)));
        // At most half the slots: a fifth kept block makes the oldest kept an ordinary one.
        for s in 0..5 {
            p.mark(s, true);
            p.insert(s);
        }
        p.insert(5);
        assert_eq!(p.len(), 6);
        assert_eq!(p.pop_victim(), Some(0), "the oldest kept block became an ordinary one");
        assert_eq!(p.pop_victim(), Some(5));
        p.mark(1, false);
        assert_eq!(p.pop_victim(), Some(1));
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn fifo_ignores_touches() {
        let mut f = PolicyKind::Fifo.build(4);
        f.insert(0);
        f.insert(1);
        f.touch(0);
        assert_eq!(f.pop_victim(), Some(0));
    }

    #[test]
    fn frequency_filter_admits_after_min_hits_and_stays_bounded() {
        let mut f = FrequencyFilter::new(2, 4);
        let h = SequenceHash(1);
        assert!(!f.admits(h));
        f.hit(h);
        assert!(!f.admits(h));
        f.hit(h);
        assert!(f.admits(h));
        for i in 10..100 {
            f.hit(SequenceHash(i));
            assert!(f.counts.len() <= 4);
        }
        assert!(FrequencyFilter::new(0, 1).admits(SequenceHash(5)));
    }

    proptest! {
        /// LRU against a reference Vec: same victims in the same order.
        #[test]
        fn lru_matches_a_reference(ops in proptest::collection::vec((0u8..4, 0u32..16), 0..200)) {
            let mut l = Lru::new(16);
            let mut reference: Vec<u32> = Vec::new();
            for (op, s) in ops {
                match op {
                    0 => { l.insert(s); if !reference.contains(&s) { reference.push(s); } }
                    1 => { l.touch(s); if let Some(i) = reference.iter().position(|&x| x == s) { reference.remove(i); reference.push(s); } }
                    2 => { l.remove(s); reference.retain(|&x| x != s); }
                    _ => { let v = l.pop_victim(); let r = if reference.is_empty() { None } else { Some(reference.remove(0)) }; prop_assert_eq!(v, r); }
                }
                prop_assert_eq!(l.len(), reference.len());
            }
        }
    }
}
