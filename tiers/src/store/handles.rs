//! The handles on host slots: [`WriteSlot`], a slot being filled, [`ScratchSlot`], a slot
//! being filled whose block has no hash yet, and [`BlockRef`], a block pinned in host memory;
//! dropping any of them releases its slot.

use std::sync::Arc;

use kvfabric::hash::SequenceHash;
use kvfabric::memory::Region;

use crate::metrics::add;
use crate::pool::PoolError;

use super::{Inner, StoreError};

/// A reserved host slot being filled. Invisible until committed; dropped uncommitted, the
/// slot is freed.
#[derive(Debug)]
pub struct WriteSlot {
    pub(super) store: Arc<Inner>,
    pub(super) slot: u32,
    pub(super) hash: SequenceHash,
    pub(super) parent: Option<SequenceHash>,
    pub(super) done: bool,
}

impl WriteSlot {
    /// The host region.
    pub fn region(&self) -> &Arc<Region> {
        &self.store.region
    }

    /// Byte offset of the slot in the region.
    pub fn offset(&self) -> u64 {
        self.store.slot_offset(self.slot)
    }

    /// Bytes of the block.
    pub fn len(&self) -> u64 {
        self.store.cfg.block_bytes
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The slot's bytes, to be written in place (an engine computing KV straight into the
    /// block it will store).
    ///
    /// # Safety
    /// No transfer may write or read the slot while the slice lives: the holder must not
    /// have handed the slot's descriptor (`region`, `offset`) to a transfer still running.
    pub unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        let (offset, len) = (self.offset(), self.len());
        // SAFETY: a reserved slot is invisible to lookups, onboards and evictions: only its
        // holder (`&mut self`) reaches it, and the caller excludes transfers. The range is a
        // slot of the region, so in bounds.
        unsafe { self.store.region.view_mut(offset, len) }.unwrap_or_default()
    }

    /// The slot's bytes.
    ///
    /// # Safety
    /// As for [`WriteSlot::bytes_mut`]: no transfer may write the slot while the slice lives.
    pub unsafe fn bytes(&self) -> &[u8] {
        let (offset, len) = (self.offset(), self.len());
        // SAFETY: only the holder reaches a reserved slot, `&self` excludes its own writes,
        // and the caller excludes transfers. The range is a slot of the region.
        unsafe { self.store.region.view(offset, len) }.unwrap_or_default()
    }

    /// Copies `bytes` into the block at `at`.
    pub fn write(&self, at: u64, bytes: &[u8]) -> Result<(), StoreError> {
        if at.checked_add(bytes.len() as u64).is_none_or(|end| end > self.len()) {
            return Err(StoreError::Invalid("write past the end of the block".into()));
        }
        self.store
            .region
            .write_at(self.offset() + at, bytes)
            .map_err(|e| StoreError::Invalid(e.to_string()))
    }

    fn finish(mut self, pins: u32) -> u32 {
        self.done = true;
        let inner = &self.store;
        let write_through = inner.cfg.write_through && inner.disk.is_some();
        {
            let mut host = inner.host.lock();
            // The background write-through holds a pin of its own, taken in the same critical
            // section as the commit so that the block cannot be evicted in between.
            let pins = pins + u32::from(write_through);
            inner.commit_host(&mut host, self.slot, (self.hash, self.parent), None, pins);
            host.writing_through += u32::from(write_through);
            add(&inner.metrics.stored_blocks, 1);
        }
        if write_through {
            let (inner, slot, hash, parent) = (inner.clone(), self.slot, self.hash, self.parent);
            // Ends the write-through however the task ends: a panic, or a runtime going
            // (even before the task first runs).
            let done = WriteThroughDone { inner: inner.clone(), slot };
            inner.runtime.clone().spawn(async move {
                let _ = inner.offload_slot(slot, hash, parent).await;
                drop(done);
            });
        }
        inner.keep_free();
        self.slot
    }

    /// Makes the block visible and returns it pinned.
    pub fn commit(self) -> BlockRef {
        let (store, hash) = (self.store.clone(), self.hash);
        let slot = self.finish(1);
        BlockRef { store, slot, hash }
    }

    /// Makes the block visible, unpinned.
    pub fn commit_unpinned(self) {
        self.finish(0);
    }
}

impl Drop for WriteSlot {
    fn drop(&mut self) {
        if !self.done {
            self.store.abort_host(&mut self.store.host.lock(), self.slot);
        }
    }
}

/// A reserved host slot whose block has no hash yet (its tokens are still being computed):
/// private memory of its holder until [`ScratchSlot::name`] turns it into a [`WriteSlot`].
/// Dropped unnamed, the slot is freed.
#[derive(Debug)]
pub struct ScratchSlot {
    pub(super) store: Arc<Inner>,
    pub(super) slot: u32,
    pub(super) done: bool,
}

impl ScratchSlot {
    /// Bytes of the block.
    pub fn len(&self) -> u64 {
        self.store.cfg.block_bytes
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The slot's bytes, written in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let (offset, len) = (self.store.slot_offset(self.slot), self.len());
        // SAFETY: a scratch slot is invisible to lookups, onboards and evictions and has no
        // hash, so no descriptor of it is ever handed out: only its holder (`&mut self`)
        // reaches it. The range is a slot of the region, so in bounds.
        unsafe { self.store.region.view_mut(offset, len) }.unwrap_or_default()
    }

    /// The slot's bytes.
    pub fn bytes(&self) -> &[u8] {
        let (offset, len) = (self.store.slot_offset(self.slot), self.len());
        // SAFETY: as in `bytes_mut`: nothing but this handle reaches the slot, and `&self`
        // excludes its own writes while the view lives.
        unsafe { self.store.region.view(offset, len) }.unwrap_or_default()
    }

    /// Gives the block its hash: it becomes a reservation for it, to be committed. Refused
    /// (the scratch slot comes back) when the store holds the block or another writer is
    /// storing it.
    pub fn name(
        mut self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<WriteSlot, (ScratchSlot, StoreError)> {
        let named = self.store.host.lock().pool.name(self.slot, hash, parent);
        match named {
            Ok(()) => {
                self.done = true;
                Ok(WriteSlot {
                    store: self.store.clone(),
                    slot: self.slot,
                    hash,
                    parent,
                    done: false,
                })
            }
            Err(PoolError::BeingWritten) => Err((self, StoreError::BeingWritten(hash))),
            Err(_) => Err((self, StoreError::AlreadyStored(hash))),
        }
    }
}

impl Drop for ScratchSlot {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.store.host.lock().pool.abort(self.slot);
        }
    }
}

/// A block pinned in host memory; dropping it unpins.
#[derive(Debug)]
pub struct BlockRef {
    pub(super) store: Arc<Inner>,
    pub(super) slot: u32,
    pub(super) hash: SequenceHash,
}

impl BlockRef {
    /// The block's sequence hash.
    pub fn hash(&self) -> SequenceHash {
        self.hash
    }

    /// The host region holding it.
    pub fn region(&self) -> &Arc<Region> {
        &self.store.region
    }

    /// Its byte offset in the region.
    pub fn offset(&self) -> u64 {
        self.store.slot_offset(self.slot)
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.store.cfg.block_bytes
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Its bytes, read in place (an engine's attention over cached KV).
    pub fn bytes(&self) -> &[u8] {
        let (offset, len) = (self.offset(), self.len());
        // SAFETY: a committed block is immutable while pinned: the store never reserves,
        // evicts or frees a pinned slot, and hands out descriptors of committed blocks only
        // for reading (onboards to peers, offloads). The range is a slot of the region.
        unsafe { self.store.region.view(offset, len) }.unwrap_or_default()
    }

    /// Copies its bytes out.
    pub fn read(&self, dst: &mut [u8]) -> Result<(), StoreError> {
        if dst.len() as u64 > self.len() {
            return Err(StoreError::Invalid("read past the end of the block".into()));
        }
        self.store
            .region
            .read_at(self.offset(), dst)
            .map_err(|e| StoreError::Invalid(e.to_string()))
    }

    /// Its bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len() as usize];
        // In bounds by construction.
        let _ = self.read(&mut v);
        v
    }
}

impl Drop for BlockRef {
    fn drop(&mut self) {
        self.store.unpin(self.slot);
    }
}

/// Drops the write-through's pin of `slot` and its count, and wakes reservations waiting for
/// a slot.
struct WriteThroughDone {
    inner: Arc<Inner>,
    slot: u32,
}

impl Drop for WriteThroughDone {
    fn drop(&mut self) {
        {
            let mut host = self.inner.host.lock();
            let _ = host.pool.unpin(self.slot);
            host.writing_through -= 1;
        }
        self.inner.released.notify_waiters();
    }
}
