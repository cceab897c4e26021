//! A pool of fixed-size block slots keyed by sequence hash: the bookkeeping of one tier, with
//! no I/O and no clock, so that it can be tested exhaustively.
//!
//! A slot's life: `Free → Writing → Ready{pins} → (Evicting) → Free`.
//! - `reserve` takes a free slot for a hash; the block is invisible to lookups until
//!   `commit` (a block still being written cannot be looked up).
//! - `pin`/`unpin` count users; only `Ready` blocks with no pins are eviction candidates.
//! - `begin_evict` picks the policy's victim and marks it `Evicting`: it stays visible and
//!   pinnable while its bytes are copied to a slower tier; `finish_evict` frees it, unless
//!   someone pinned it meanwhile or the copy failed (then it stays).
//! - `clear` forgets every block; pinned ones become orphans, freed at their last unpin.
//! - `reserve_scratch` takes a free slot with no hash yet (an engine computing a block whose
//!   tokens are not all known); `name` gives it its hash once they are (`Scratch → Writing`).

use std::collections::HashMap;

use kvfabric::hash::SequenceHash;

use crate::policy::{EvictionPolicy, PolicyKind};

/// Why a pool operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The block is already stored (in this slot).
    #[error("block already stored")]
    Present(u32),
    /// Another writer is storing this block right now.
    #[error("block is being written")]
    BeingWritten,
    /// No free slot: evict first.
    #[error("no free slot")]
    Full,
    /// The block is pinned.
    #[error("block is pinned")]
    Pinned,
    /// No such block, or the slot is not in the state the operation needs.
    #[error("no such block")]
    NotFound,
}

/// The state of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Unused.
    Free,
    /// Reserved for `hash`, bytes arriving; invisible.
    Writing {
        /// The block.
        hash: SequenceHash,
        /// Its parent.
        parent: Option<SequenceHash>,
    },
    /// Stored and visible.
    Ready {
        /// The block.
        hash: SequenceHash,
        /// Its parent.
        parent: Option<SequenceHash>,
        /// Users holding it.
        pins: u32,
        /// Being copied out for eviction.
        evicting: bool,
    },
    /// Forgotten by `clear` while pinned or being evicted; freed once neither holds.
    Orphan {
        /// Users still holding it.
        pins: u32,
        /// An eviction is still copying it out.
        evicting: bool,
    },
    /// Taken out of use (its backing store could not grow); never reserved again.
    Retired,
    /// Reserved with no hash yet; invisible, private to its holder.
    Scratch,
}

/// A block chosen for eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Victim {
    /// Its slot.
    pub slot: u32,
    /// The block.
    pub hash: SequenceHash,
    /// Its parent.
    pub parent: Option<SequenceHash>,
}

/// What `finish_evict` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictOutcome {
    /// The slot is free; the block left this tier.
    Freed,
    /// The block stays (pinned meanwhile, or the copy failed).
    Kept,
}

/// Slots of one tier.
#[derive(Debug)]
pub struct SlotPool {
    slots: Vec<SlotState>,
    index: HashMap<SequenceHash, u32>,
    writing: HashMap<SequenceHash, u32>,
    free: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    /// Slots marked evicting (begun, not finished).
    evicting: u32,
    /// Blocks that left the tier by eviction, since it was made.
    evicted: u64,
}

impl SlotPool {
    /// A pool of `capacity` free slots.
    pub fn new(capacity: u32, policy: PolicyKind) -> Self {
        SlotPool {
            slots: vec![SlotState::Free; capacity as usize],
            index: HashMap::with_capacity(capacity as usize),
            writing: HashMap::new(),
            // Lowest slot first: a growing disk file stays compact.
            free: (0..capacity).rev().collect(),
            policy: policy.build(capacity),
            evicting: 0,
            evicted: 0,
        }
    }

    /// Slots in all.
    pub fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Slots holding or reserved for a block (writing, ready, orphaned).
    pub fn used(&self) -> u32 {
        self.slots.iter().filter(|s| !matches!(s, SlotState::Free | SlotState::Retired)).count()
            as u32
    }

    /// Free slots (O(1): the free list).
    pub fn free_slots(&self) -> u32 {
        self.free.len() as u32
    }

    /// Visible blocks.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no block is visible.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// A slot's state.
    pub fn state(&self, slot: u32) -> SlotState {
        self.slots.get(slot as usize).copied().unwrap_or(SlotState::Free)
    }

    /// The slot of a visible block.
    pub fn lookup(&self, hash: SequenceHash) -> Option<u32> {
        self.index.get(&hash).copied()
    }

    /// The parent of a visible block (None if unknown or it has none).
    pub fn parent_of(&self, hash: SequenceHash) -> Option<SequenceHash> {
        match self.state(self.lookup(hash)?) {
            SlotState::Ready { parent, .. } => parent,
            _ => None,
        }
    }

    /// Whether `hash` is visible or being written.
    pub fn knows(&self, hash: SequenceHash) -> bool {
        self.index.contains_key(&hash) || self.writing.contains_key(&hash)
    }

    /// Every visible block with its parent.
    pub fn blocks(&self) -> Vec<(SequenceHash, Option<SequenceHash>)> {
        let mut v: Vec<_> = self
            .index
            .values()
            .filter_map(|&s| match self.slots[s as usize] {
                SlotState::Ready { hash, parent, .. } => Some((hash, parent)),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// Reserves a free slot for a new block.
    pub fn reserve(
        &mut self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<u32, PoolError> {
        if let Some(&slot) = self.index.get(&hash) {
            return Err(PoolError::Present(slot));
        }
        if self.writing.contains_key(&hash) {
            return Err(PoolError::BeingWritten);
        }
        let slot = self.free.pop().ok_or(PoolError::Full)?;
        self.slots[slot as usize] = SlotState::Writing { hash, parent };
        self.writing.insert(hash, slot);
        Ok(slot)
    }

    /// Reserves a free slot for a block whose hash is not known yet.
    pub fn reserve_scratch(&mut self) -> Result<u32, PoolError> {
        let slot = self.free.pop().ok_or(PoolError::Full)?;
        self.slots[slot as usize] = SlotState::Scratch;
        Ok(slot)
    }

    /// Names a scratch slot: it becomes a reservation for `hash` (then `commit` or `abort`).
    /// Refused, the slot stays scratch, if the block is stored or being written already.
    pub fn name(
        &mut self,
        slot: u32,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<(), PoolError> {
        if self.state(slot) != SlotState::Scratch {
            return Err(PoolError::NotFound);
        }
        if let Some(&present) = self.index.get(&hash) {
            return Err(PoolError::Present(present));
        }
        if self.writing.contains_key(&hash) {
            return Err(PoolError::BeingWritten);
        }
        self.slots[slot as usize] = SlotState::Writing { hash, parent };
        self.writing.insert(hash, slot);
        Ok(())
    }

    /// Restores visible blocks at given slots into an empty pool (rebuilding an index from
    /// disk). Entries whose slot is out of range or taken, or whose hash is already restored,
    /// are skipped and returned.
    pub fn restore(
        &mut self,
        entries: impl IntoIterator<Item = (u32, SequenceHash, Option<SequenceHash>)>,
    ) -> Vec<(u32, SequenceHash)> {
        let mut skipped = Vec::new();
        for (slot, hash, parent) in entries {
            let free = matches!(self.slots.get(slot as usize), Some(SlotState::Free));
            if !free || self.knows(hash) {
                skipped.push((slot, hash));
                continue;
            }
            self.slots[slot as usize] = SlotState::Ready { hash, parent, pins: 0, evicting: false };
            self.index.insert(hash, slot);
            self.policy.insert(slot);
        }
        let slots = &self.slots;
        self.free.retain(|&s| matches!(slots[s as usize], SlotState::Free));
        skipped
    }

    /// Makes a written block visible, with `pins` users already holding it.
    pub fn commit(&mut self, slot: u32, pins: u32) -> Result<SequenceHash, PoolError> {
        let SlotState::Writing { hash, parent } = self.state(slot) else {
            return Err(PoolError::NotFound);
        };
        self.writing.remove(&hash);
        self.slots[slot as usize] = SlotState::Ready { hash, parent, pins, evicting: false };
        self.index.insert(hash, slot);
        if pins == 0 {
            self.policy.insert(slot);
        }
        Ok(hash)
    }

    /// Gives up a reservation (named or scratch).
    pub fn abort(&mut self, slot: u32) -> Result<(), PoolError> {
        match self.state(slot) {
            SlotState::Writing { hash, .. } => {
                self.writing.remove(&hash);
            }
            SlotState::Scratch => {}
            _ => return Err(PoolError::NotFound),
        }
        self.free_slot(slot);
        Ok(())
    }

    fn free_slot(&mut self, slot: u32) {
        self.slots[slot as usize] = SlotState::Free;
        self.policy.remove(slot);
        self.policy.mark(slot, false);
        self.free.push(slot);
    }

    /// Adds a user to a visible (or orphaned) block.
    pub fn pin(&mut self, slot: u32) -> Result<(), PoolError> {
        match &mut self.slots.get_mut(slot as usize).ok_or(PoolError::NotFound)? {
            SlotState::Ready { pins, evicting, .. } => {
                *pins += 1;
                if *pins == 1 && !*evicting {
                    self.policy.remove(slot);
                }
                Ok(())
            }
            _ => Err(PoolError::NotFound),
        }
    }

    /// Removes a user; the last unpin makes the block evictable (or frees an orphan).
    pub fn unpin(&mut self, slot: u32) -> Result<(), PoolError> {
        match self.slots.get_mut(slot as usize).ok_or(PoolError::NotFound)? {
            SlotState::Ready { pins, evicting, .. } if *pins > 0 => {
                *pins -= 1;
                if *pins == 0 && !*evicting {
                    self.policy.insert(slot);
                }
                Ok(())
            }
            SlotState::Orphan { pins, evicting } if *pins > 0 => {
                *pins -= 1;
                if *pins == 0 && !*evicting {
                    self.free_slot(slot);
                }
                Ok(())
            }
            _ => Err(PoolError::NotFound),
        }
    }

    /// The block in `slot` is used by latency-sensitive requests: evicted after every
    /// other evictable block (see [`crate::policy::Kept`]).
    pub fn keep(&mut self, slot: u32) {
        if matches!(self.state(slot), SlotState::Ready { .. }) {
            self.policy.mark(slot, true);
        }
    }

    /// Records a use of an evictable block.
    pub fn touch(&mut self, slot: u32) {
        if let SlotState::Ready { pins: 0, evicting: false, .. } = self.state(slot) {
            self.policy.touch(slot);
        }
    }

    /// Picks the next victim (an unpinned visible block) and marks it evicting.
    pub fn begin_evict(&mut self) -> Option<Victim> {
        let slot = self.policy.pop_victim()?;
        match &mut self.slots[slot as usize] {
            SlotState::Ready { hash, parent, pins: 0, evicting } if !*evicting => {
                *evicting = true;
                self.evicting += 1;
                Some(Victim { slot, hash: *hash, parent: *parent })
            }
            // The policy only ever holds unpinned, non-evicting ready slots.
            _ => None,
        }
    }

    /// Ends an eviction: frees the slot if `copied` and nobody pinned it meanwhile.
    pub fn finish_evict(&mut self, slot: u32, copied: bool) -> Result<EvictOutcome, PoolError> {
        if let SlotState::Orphan { pins, evicting: true } = self.state(slot) {
            self.evicting -= 1;
            // Cleared while its copy ran: free it now unless someone still holds it.
            if pins == 0 {
                self.free_slot(slot);
            } else {
                self.slots[slot as usize] = SlotState::Orphan { pins, evicting: false };
            }
            return Ok(EvictOutcome::Freed);
        }
        let SlotState::Ready { hash, pins, evicting: true, .. } = self.state(slot) else {
            return Err(PoolError::NotFound);
        };
        self.evicting -= 1;
        if copied && pins == 0 {
            self.index.remove(&hash);
            self.free_slot(slot);
            self.evicted += 1;
            return Ok(EvictOutcome::Freed);
        }
        if let SlotState::Ready { evicting, .. } = &mut self.slots[slot as usize] {
            *evicting = false;
        }
        if pins == 0 {
            self.policy.insert(slot);
        }
        Ok(EvictOutcome::Kept)
    }

    /// Blocks that left the tier by eviction (moved down or dropped), since it was made.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Evictions begun and not finished: slots that will be free or evictable again soon.
    pub fn evictions_in_flight(&self) -> u32 {
        self.evicting
    }

    /// Takes every free slot at or above `first` out of use (a disk that cannot grow past it).
    pub fn retire_free_from(&mut self, first: u32) {
        let slots = &mut self.slots;
        self.free.retain(|&s| {
            if s >= first {
                slots[s as usize] = SlotState::Retired;
                false
            } else {
                true
            }
        });
    }

    /// Slots not retired.
    pub fn usable(&self) -> u32 {
        self.slots.iter().filter(|s| !matches!(s, SlotState::Retired)).count() as u32
    }

    /// Removes an unpinned visible block.
    pub fn remove(&mut self, hash: SequenceHash) -> Result<u32, PoolError> {
        let slot = self.lookup(hash).ok_or(PoolError::NotFound)?;
        match self.state(slot) {
            SlotState::Ready { pins: 0, evicting: false, .. } => {
                self.index.remove(&hash);
                self.free_slot(slot);
                Ok(slot)
            }
            _ => Err(PoolError::Pinned),
        }
    }

    /// Forgets every visible block; pinned ones are freed at their last unpin. Returns the
    /// hashes that were visible.
    pub fn clear(&mut self) -> Vec<SequenceHash> {
        let hashes: Vec<SequenceHash> = self.index.keys().copied().collect();
        for (_, slot) in std::mem::take(&mut self.index) {
            match self.state(slot) {
                SlotState::Ready { pins: 0, evicting: false, .. } => self.free_slot(slot),
                SlotState::Ready { pins, evicting, .. } => {
                    self.policy.remove(slot);
                    self.slots[slot as usize] = SlotState::Orphan { pins, evicting };
                }
                _ => {}
            }
        }
        hashes
    }

    /// Checks every internal invariant (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut free = vec![false; self.slots.len()];
        for &s in &self.free {
            if free[s as usize] {
                return Err(format!("slot {s} twice in the free list"));
            }
            free[s as usize] = true;
        }
        let (mut evictable, mut evicting) = (0, 0);
        for (i, st) in self.slots.iter().enumerate() {
            if matches!(
                st,
                SlotState::Ready { evicting: true, .. } | SlotState::Orphan { evicting: true, .. }
            ) {
                evicting += 1;
            }
            let is_free = matches!(st, SlotState::Free);
            if is_free != free[i] {
                return Err(format!("slot {i}: state {st:?} but free-list says {}", free[i]));
            }
            match *st {
                SlotState::Ready { hash, pins, evicting, .. } => {
                    if self.index.get(&hash) != Some(&(i as u32)) {
                        return Err(format!("slot {i} ready but not indexed"));
                    }
                    if pins == 0 && !evicting {
                        evictable += 1;
                    }
                }
                SlotState::Writing { hash, .. }
                    if self.writing.get(&hash) != Some(&(i as u32))
                        || self.index.contains_key(&hash) =>
                {
                    return Err(format!("slot {i} writing but mis-indexed"));
                }
                _ => {}
            }
        }
        if evicting != self.evicting {
            return Err(format!("{evicting} slots evicting, counted {}", self.evicting));
        }
        if evictable != self.policy.len() {
            return Err(format!("{evictable} evictable slots, policy holds {}", self.policy.len()));
        }
        if self.index.len() + self.writing.len() > self.slots.len() {
            return Err("more blocks than slots".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(i)
    }

    #[test]
    fn writing_blocks_are_invisible_until_commit() {
        let mut p = SlotPool::new(2, PolicyKind::Lru);
        let s = p.reserve(h(1), None).unwrap();
        assert_eq!(p.lookup(h(1)), None);
        assert_eq!(p.reserve(h(1), None), Err(PoolError::BeingWritten));
        p.commit(s, 0).unwrap();
        assert_eq!(p.lookup(h(1)), Some(s));
        assert_eq!(p.reserve(h(1), None), Err(PoolError::Present(s)));
        p.check_invariants().unwrap();
    }

    #[test]
    fn pinned_blocks_are_never_victims_and_orphans_free_at_unpin() {
        let mut p = SlotPool::new(2, PolicyKind::Lru);
        let a = p.reserve(h(1), None).unwrap();
        p.commit(a, 1).unwrap();
        let b = p.reserve(h(2), Some(h(1))).unwrap();
        p.commit(b, 0).unwrap();
        assert_eq!(p.reserve(h(3), None), Err(PoolError::Full));
        let v = p.begin_evict().unwrap();
        assert_eq!(v.hash, h(2));
        assert_eq!(p.begin_evict(), None, "the pinned block is not a candidate");
        // Pinned during its eviction: kept.
        p.pin(b).unwrap();
        assert_eq!(p.finish_evict(b, true), Ok(EvictOutcome::Kept));
        p.unpin(b).unwrap();
        p.check_invariants().unwrap();
        assert_eq!(p.clear().len(), 2);
        assert_eq!(p.state(a), SlotState::Orphan { pins: 1, evicting: false });
        assert_eq!(p.used(), 1);
        p.unpin(a).unwrap();
        assert_eq!(p.used(), 0);
        p.check_invariants().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(u64),
        Commit(usize, u32),
        Abort(usize),
        Pin(u64),
        Unpin(usize),
        Evict(bool),
        Remove(u64),
        Clear,
        Scratch,
        Name(usize, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..24).prop_map(Op::Reserve),
            4 => (any::<usize>(), 0u32..2).prop_map(|(i, p)| Op::Commit(i, p)),
            1 => any::<usize>().prop_map(Op::Abort),
            3 => (0u64..24).prop_map(Op::Pin),
            3 => any::<usize>().prop_map(Op::Unpin),
            2 => any::<bool>().prop_map(Op::Evict),
            1 => (0u64..24).prop_map(Op::Remove),
            1 => Just(Op::Clear),
            2 => Just(Op::Scratch),
            2 => (any::<usize>(), 0u64..24).prop_map(|(i, x)| Op::Name(i, x)),
        ]
    }

    proptest! {
        /// Random operation sequences: a pinned block is never evicted or removed, capacity
        /// is never exceeded, lookups see only committed blocks, and the books balance.
        #[test]
        fn random_operations_keep_the_invariants(ops in proptest::collection::vec(op(), 1..300)) {
            let mut p = SlotPool::new(8, PolicyKind::Lru);
            let mut writing: Vec<u32> = Vec::new();
            let mut pins: Vec<u32> = Vec::new(); // one entry per pin we hold
            let mut scratch: Vec<u32> = Vec::new();
            for o in ops {
                match o {
                    Op::Reserve(x) => if let Ok(s) = p.reserve(h(x), None) { writing.push(s) },
                    Op::Commit(i, n) => if !writing.is_empty() {
                        let s = writing.swap_remove(i % writing.len());
                        p.commit(s, n).unwrap();
                        pins.extend(std::iter::repeat_n(s, n as usize));
                    },
                    Op::Abort(i) => if !writing.is_empty() {
                        let s = writing.swap_remove(i % writing.len());
                        p.abort(s).unwrap();
                    },
                    Op::Pin(x) => if let Some(s) = p.lookup(h(x)) { p.pin(s).unwrap(); pins.push(s); },
                    Op::Unpin(i) => if !pins.is_empty() { let s = pins.swap_remove(i % pins.len()); p.unpin(s).unwrap(); },
                    Op::Evict(ok) => if let Some(v) = p.begin_evict() {
                        prop_assert!(!pins.contains(&v.slot), "victim {} is pinned", v.slot);
                        p.finish_evict(v.slot, ok).unwrap();
                    },
                    Op::Remove(x) => {
                        let slot = p.lookup(h(x));
                        let r = p.remove(h(x));
                        if let Some(s) = slot { prop_assert_eq!(r.is_ok(), !pins.contains(&s)); }
                    }
                    Op::Clear => { p.clear(); }
                    Op::Scratch => if let Ok(s) = p.reserve_scratch() { scratch.push(s) },
                    Op::Name(i, x) => if !scratch.is_empty() {
                        let s = scratch[i % scratch.len()];
                        let known = p.lookup(h(x)).is_some() || p.writing.contains_key(&h(x));
                        let r = p.name(s, h(x), None);
                        prop_assert_eq!(r.is_ok(), !known);
                        if r.is_ok() {
                            scratch.retain(|&t| t != s);
                            writing.push(s);
                        }
                    },
                }
                p.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert!(p.used() <= p.capacity());
                for &s in &pins {
                    let live = !matches!(p.state(s), SlotState::Free | SlotState::Writing { .. });
                    prop_assert!(live, "pinned slot {} was freed", s);
                }
                for &s in &writing {
                    let writing = matches!(p.state(s), SlotState::Writing { .. });
                    prop_assert!(writing, "reserved slot {} left the writing state", s);
                }
                for &s in &scratch {
                    prop_assert_eq!(p.state(s), SlotState::Scratch, "scratch slot {} changed", s);
                    prop_assert!(!p.free.contains(&s), "scratch slot {} is in the free list", s);
                }
            }
        }
    }
}
