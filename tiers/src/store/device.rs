//! G1, the device tier: block slots in GPU memory above the host tier.
//!
//! - **Store**: [`TieredStore::allocate_device`] reserves a G1 slot (invisible until commit);
//!   the engine fills it on the GPU, then [`DeviceWriteSlot::commit`] makes it visible and
//!   emits `Stored{device}`.
//! - **Offload**: when G1 is full, its least recently used unpinned block moves down: copied
//!   device → host (D2H) into a new G2 slot (`Stored{host}`) unless G2 holds it already, then
//!   its G1 slot is freed (`Removed{device}`). If the copy fails the block stays in G1.
//! - **Onboard**: [`TieredStore::get_device`] pins the leading run of cached blocks in G1,
//!   bringing blocks up from G2 (and, through G2, from disk and the fabric) with H2D copies
//!   into new G1 slots (`Stored{device}`).
//!
//! Every copy between G1 and G2 is a local transfer of the store's agent, so it runs on the
//! `cuda` transport when the G1 region is GPU memory. The G1 region comes from the config:
//! allocated on a CUDA device by the store, or a region registered with the agent — an
//! engine's GPU KV buffer, or, in tests on machines without a GPU, host memory standing in
//! for it (the local transport then copies with memcpy; the accounting, the events and the
//! order of copies are the same, which is what such tests prove).

use std::sync::Arc;

use kvfabric::events::TierKind;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::Region;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest};
use parking_lot::Mutex;

use crate::disk::format::align_up;
use crate::pool::{EvictOutcome, PoolError, SlotPool, Victim};

use super::{to_completion, BlockRef, Inner, StoreError, TieredStore};

/// Where G1's slots live.
#[derive(Debug, Clone)]
pub enum DeviceSlots {
    /// The store allocates them on this CUDA device (feature `cuda` of `kvfabric`).
    Allocate {
        /// The device's ordinal in this process.
        ordinal: usize,
    },
    /// A region registered with the store's agent, at least `blocks × stride` bytes: an
    /// engine's GPU KV buffer, or host memory standing in for GPU memory.
    Region(Arc<Region>),
}

/// The device tier's configuration.
#[derive(Debug, Clone)]
pub struct DeviceTierConfig {
    /// G1 slots.
    pub blocks: u32,
    /// Where they live.
    pub slots: DeviceSlots,
}

#[derive(Debug)]
pub(super) struct DeviceTier {
    pub(super) region: Arc<Region>,
    pub(super) pool: Mutex<SlotPool>,
    /// Whether an eviction round that frees slots ahead is running (one at a time).
    evicting_ahead: std::sync::atomic::AtomicBool,
    /// Wakes the reservers that wait for that round.
    ahead_done: tokio::sync::Notify,
    /// The host tier page-locked for the copies between G1 and G2 (asynchronous DMA instead
    /// of the driver staging pageable memory), while G1 is GPU memory.
    #[cfg(feature = "cuda")]
    _pinned_host: Option<kvfabric::cuda::HostRegistration>,
}

impl DeviceTier {
    /// Ends an eviction round that freed slots ahead, and wakes who waited for it.
    fn end_round(&self) {
        self.evicting_ahead.store(false, std::sync::atomic::Ordering::Release);
        self.ahead_done.notify_waiters();
    }

    pub(super) fn open(
        cfg: &DeviceTierConfig,
        agent: &kvfabric::agent::Agent,
        block_bytes: u64,
        host: &Arc<Region>,
    ) -> Result<Self, StoreError> {
        if cfg.blocks == 0 {
            return Err(StoreError::Invalid("the device tier needs at least one block".into()));
        }
        let bytes = align_up(block_bytes)
            .checked_mul(u64::from(cfg.blocks))
            .filter(|&b| b <= usize::MAX as u64)
            .ok_or_else(|| StoreError::Invalid("device tier too large".into()))?;
        let region = match &cfg.slots {
            DeviceSlots::Region(r) => {
                if (r.len() as u64) < bytes {
                    return Err(StoreError::Invalid(format!(
                        "the device region holds {} bytes; {} blocks need {bytes}",
                        r.len(),
                        cfg.blocks
                    )));
                }
                r.clone()
            }
            #[cfg(feature = "cuda")]
            DeviceSlots::Allocate { ordinal } => {
                agent.alloc_device_region(*ordinal, bytes as usize, true)?
            }
            #[cfg(not(feature = "cuda"))]
            DeviceSlots::Allocate { .. } => {
                let _ = agent;
                return Err(StoreError::Invalid(
                    kvfabric::cuda::CudaUnavailable::NotBuilt.to_string(),
                ));
            }
        };
        tracing::info!(blocks = cfg.blocks, kind = ?region.kind(), "block store: device tier");
        #[cfg(feature = "cuda")]
        let _pinned_host = match region.kind() {
            kvfabric::memory::MemoryKind::Device(ordinal) => {
                let device = kvfabric::cuda::probe()
                    .map_err(|e| StoreError::Invalid(e.to_string()))?
                    .device(ordinal as usize)
                    .map_err(|e| StoreError::Invalid(e.to_string()))?;
                let ptr = host
                    .ptr_at(0, host.len() as u64)
                    .map_err(|e| StoreError::Invalid(e.to_string()))?;
                // SAFETY: the host region stays mapped while the store lives: the store holds
                // it, and the registration (in the store's device tier, dropped before the
                // host region: see `Inner`) is undone first.
                match unsafe { device.register_host(ptr, host.len()) } {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::warn!(error = %e, "host tier not page-locked: G1 copies go through the driver's staging");
                        None
                    }
                }
            }
            kvfabric::memory::MemoryKind::Host => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = host;
        Ok(DeviceTier {
            region,
            pool: Mutex::new(SlotPool::new(cfg.blocks, crate::policy::PolicyKind::Lru)),
            evicting_ahead: std::sync::atomic::AtomicBool::new(false),
            ahead_done: tokio::sync::Notify::new(),
            #[cfg(feature = "cuda")]
            _pinned_host,
        })
    }
}

/// A reserved G1 slot being filled on the GPU. Invisible until committed; dropped
/// uncommitted, the slot is freed.
#[derive(Debug)]
pub struct DeviceWriteSlot {
    store: Arc<Inner>,
    slot: u32,
    hash: SequenceHash,
    parent: Option<SequenceHash>,
    done: bool,
}

impl DeviceWriteSlot {
    /// The G1 region.
    pub fn region(&self) -> &Arc<Region> {
        &self.store.device().region
    }

    /// Byte offset of the slot in the region.
    pub fn offset(&self) -> u64 {
        self.store.slot_offset(self.slot)
    }

    /// Makes the block visible (`Stored{device}`), pinned: the returned ref unpins it.
    pub fn commit(mut self) -> DeviceBlockRef {
        self.done = true;
        let _ = self.store.device().pool.lock().commit(self.slot, 1);
        self.store.events.stored(self.hash, self.parent, TierKind::Device);
        DeviceBlockRef { store: self.store.clone(), slot: self.slot, hash: self.hash }
    }
}

impl Drop for DeviceWriteSlot {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.store.device().pool.lock().abort(self.slot);
        }
    }
}

/// A block pinned in G1: never evicted while held.
#[derive(Debug)]
pub struct DeviceBlockRef {
    store: Arc<Inner>,
    slot: u32,
    hash: SequenceHash,
}

impl DeviceBlockRef {
    /// Its key.
    pub fn hash(&self) -> SequenceHash {
        self.hash
    }
    /// The G1 region.
    pub fn region(&self) -> &Arc<Region> {
        &self.store.device().region
    }
    /// Byte offset of the block in the region.
    pub fn offset(&self) -> u64 {
        self.store.slot_offset(self.slot)
    }
}

impl Drop for DeviceBlockRef {
    fn drop(&mut self) {
        let _ = self.store.device().pool.lock().unpin(self.slot);
    }
}

impl TieredStore {
    /// Whether the store has a device tier.
    pub fn has_device(&self) -> bool {
        self.inner.device.is_some()
    }

    /// G1 blocks held and G1 capacity.
    pub fn device_occupancy(&self) -> (u32, u32) {
        self.inner.device.as_ref().map_or((0, 0), |d| {
            let p = d.pool.lock();
            (p.used(), p.capacity())
        })
    }

    /// Reserves a G1 slot for a new block; fill it on the GPU, then commit. Moves least
    /// recently used G1 blocks down to host memory under pressure.
    pub async fn allocate_device(
        &self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<DeviceWriteSlot, StoreError> {
        let slot = self.inner.reserve_device(hash, parent).await?;
        Ok(DeviceWriteSlot { store: self.inner.clone(), slot, hash, parent, done: false })
    }

    /// Pins the leading run of `hashes` that some tier holds, in G1: blocks already there
    /// are pinned, the others come up from host memory (and through it from disk and the
    /// fabric) with host → device copies. Stops at the first block no tier holds.
    pub async fn get_device(
        &self,
        hashes: &[SequenceHash],
    ) -> Result<Vec<DeviceBlockRef>, StoreError> {
        let inner = &self.inner;
        let dev =
            inner.device.as_ref().ok_or_else(|| StoreError::Invalid("no device tier".into()))?;
        let mut refs = Vec::with_capacity(hashes.len());
        let mut i = 0;
        while i < hashes.len() {
            // The run already in G1: pinned.
            {
                let mut pool = dev.pool.lock();
                while let Some(slot) = hashes.get(i).and_then(|&h| pool.lookup(h)) {
                    let _ = pool.pin(slot);
                    pool.touch(slot);
                    refs.push(DeviceBlockRef { store: inner.clone(), slot, hash: hashes[i] });
                    i += 1;
                }
            }
            if i == hashes.len() {
                break;
            }
            // The next run not in G1: pinned in host memory first, then copied up.
            let end = {
                let pool = dev.pool.lock();
                (i..hashes.len())
                    .find(|&j| pool.lookup(hashes[j]).is_some())
                    .unwrap_or(hashes.len())
            };
            let host = self.get(&hashes[i..end]).await?;
            let (want, got) = (end - i, host.len());
            let blocks: Vec<(SequenceHash, Option<SequenceHash>)> = host
                .iter()
                .enumerate()
                .map(|(k, r)| (r.hash(), (i + k > 0).then(|| hashes[i + k - 1])))
                .collect();
            let (done, stop) = inner.onboard_devices(&host, &blocks).await;
            let n = done.len();
            i += n;
            refs.extend(done);
            if let Some(e) = stop {
                return if refs.is_empty() { Err(e) } else { Ok(refs) };
            }
            if n < got {
                return Ok(refs);
            }
            if got < want {
                break; // the run stopped below G1: nothing after it counts
            }
        }
        Ok(refs)
    }
}

/// Blocks one eviction round moves down at least, for a G1 of `capacity` slots: a
/// sixteenth, at most 16 (none extra below 32 slots).
fn evict_ahead(capacity: u32) -> usize {
    (capacity as usize / 16).min(16)
}

impl Inner {
    pub(super) fn device(&self) -> &DeviceTier {
        // Only reachable through handles made by a store with a device tier.
        self.device.as_ref().unwrap_or_else(|| unreachable!("no device tier"))
    }

    /// Reserves a G1 slot, evicting (D2H into host memory) until one is free.
    async fn reserve_device(
        self: &Arc<Self>,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<u32, StoreError> {
        self.reserve_devices(&[(hash, parent)])
            .await
            .pop()
            .unwrap_or(Err(StoreError::Full(TierKind::Device)))
    }

    /// Reserves G1 slots for `blocks` in order, evicting until each has one: as many
    /// victims at a time as slots are missing, moved down with one D2H transfer. A block
    /// present or being written gets that error and the next one is tried; any other
    /// failure ends the list (its error is the last entry).
    async fn reserve_devices(
        self: &Arc<Self>,
        blocks: &[(SequenceHash, Option<SequenceHash>)],
    ) -> Vec<Result<u32, StoreError>> {
        let dev = self.device();
        let mut out = Vec::with_capacity(blocks.len());
        loop {
            // Registered before the flag is read, so the end of a round is never missed.
            let round_done = dev.ahead_done.notified();
            tokio::pin!(round_done);
            round_done.as_mut().enable();
            let (victims, ahead, wait): (Vec<Victim>, bool, bool) = {
                let mut pool = dev.pool.lock();
                while let Some(&(hash, parent)) = blocks.get(out.len()) {
                    match pool.reserve(hash, parent) {
                        Ok(slot) => out.push(Ok(slot)),
                        Err(PoolError::Present(_)) => {
                            out.push(Err(StoreError::AlreadyStored(hash)))
                        }
                        Err(PoolError::BeingWritten) => {
                            out.push(Err(StoreError::BeingWritten(hash)))
                        }
                        Err(_) => break,
                    }
                }
                let missing = blocks.len() - out.len();
                // One round at a time frees slots ahead of need: a G1 under pressure moves
                // blocks down a batch per transfer, not one per transfer.
                let ahead = missing > 0
                    && !dev.evicting_ahead.swap(true, std::sync::atomic::Ordering::AcqRel);
                let batch = evict_ahead(pool.capacity());
                // Another round is freeing a batch: wait for it rather than move blocks down
                // one transfer each.
                let wait = !ahead && batch > 0 && missing > 0;
                let take = match (ahead, wait) {
                    (true, _) => missing.max(batch),
                    (false, true) => 0,
                    (false, false) => missing,
                };
                let victims = std::iter::from_fn(|| pool.begin_evict()).take(take).collect();
                (victims, ahead, wait)
            };
            if out.len() == blocks.len() {
                return out;
            }
            if wait {
                round_done.await;
                continue;
            }
            if victims.is_empty() {
                if ahead {
                    dev.end_round();
                }
                out.push(Err(StoreError::Full(TierKind::Device)));
                return out;
            }
            let inner = self.clone();
            let evicted = to_completion(&self.runtime, async move {
                /// Ends the round however the eviction ends.
                struct Round<'a>(&'a DeviceTier, bool);
                impl Drop for Round<'_> {
                    fn drop(&mut self) {
                        if self.1 {
                            self.0.end_round();
                        }
                    }
                }
                let _round = Round(inner.device(), ahead);
                inner.evict_devices(victims).await
            });
            if let Err(e) = evicted.await {
                out.push(Err(e));
                return out;
            }
        }
    }

    /// Copies blocks within the store's agent, one transfer for all: from `src` to `dst`
    /// at each (source offset, destination offset) pair (D2H or H2D when one side is GPU
    /// memory).
    async fn copy_blocks(
        &self,
        src: &Arc<Region>,
        dst: &Arc<Region>,
        offsets: &[(u64, u64)],
    ) -> Result<(), StoreError> {
        let agent = &self.region.agent;
        let len = self.cfg.block_bytes;
        let req = TransferRequest::new(
            TransferOp::Write,
            agent.name(),
            offsets.iter().map(|&(s, _)| Desc::new(src.id(), s, len)).collect(),
            offsets.iter().map(|&(_, d)| Desc::new(dst.id(), d, len)).collect(),
        );
        let r = match agent.post(req) {
            Ok(h) => h.wait().await,
            Err(e) => Err(e),
        };
        r.map_err(|e| StoreError::Invalid(format!("copy between G1 and G2: {e}")))
    }

    /// Moves G1 victims down: each into a new host slot unless host memory holds it
    /// already (all with one D2H transfer), then frees their G1 slots. Victims whose copy
    /// failed stay in G1.
    async fn evict_devices(self: &Arc<Self>, victims: Vec<Victim>) -> Result<(), StoreError> {
        let dev = self.device();
        let (mut moves, mut drops, mut failed) = (Vec::new(), Vec::new(), None);
        // One wait for all of them: the G1 victims are held meanwhile.
        let wait = tokio::time::Instant::now() + super::offload::RESERVE_WAIT;
        for v in victims {
            if failed.is_some() {
                let _ = dev.pool.lock().finish_evict(v.slot, false);
                continue;
            }
            if self.host.lock().pool.lookup(v.hash).is_some() {
                drops.push(v);
                continue;
            }
            match self.reserve_host(v.hash, v.parent, wait).await {
                Ok(hslot) => moves.push((v, hslot)),
                // Another task is putting it in host memory (or did): G1 may drop it.
                Err(StoreError::AlreadyStored(_) | StoreError::BeingWritten(_)) => drops.push(v),
                Err(e) => {
                    let _ = dev.pool.lock().finish_evict(v.slot, false);
                    failed = Some(e);
                }
            }
        }
        let offsets: Vec<(u64, u64)> =
            moves.iter().map(|(v, h)| (self.slot_offset(v.slot), self.slot_offset(*h))).collect();
        let copied = match offsets.is_empty() {
            true => Ok(()),
            false => self.copy_blocks(&dev.region, &self.region, &offsets).await,
        };
        {
            let mut host = self.host.lock();
            for (v, hslot) in &moves {
                match copied {
                    Ok(()) => self.commit_host(&mut host, *hslot, (v.hash, v.parent), None, 0),
                    Err(_) => self.abort_host(&mut host, *hslot),
                }
            }
        }
        let mut removed = Vec::new();
        {
            let mut pool = dev.pool.lock();
            let ok = copied.is_ok();
            let ends = moves.iter().map(|(v, _)| (v, ok)).chain(drops.iter().map(|v| (v, true)));
            for (v, copied) in ends {
                if pool.finish_evict(v.slot, copied) == Ok(EvictOutcome::Freed) && copied {
                    removed.push(v.hash);
                }
            }
        }
        if !removed.is_empty() {
            self.events.removed(removed, TierKind::Device);
        }
        match (failed, copied) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(())) => Ok(()),
        }
    }

    /// Copies blocks pinned in host memory into new G1 slots, pinned, with one H2D
    /// transfer. Returns the G1 refs of the leading blocks brought up (or found already
    /// brought up by another task) and what stopped it before the end, if an error did.
    async fn onboard_devices(
        self: &Arc<Self>,
        host: &[BlockRef],
        blocks: &[(SequenceHash, Option<SequenceHash>)],
    ) -> (Vec<DeviceBlockRef>, Option<StoreError>) {
        let dev = self.device();
        let mut reserved = self.reserve_devices(blocks).await;
        let stop = match reserved.last() {
            Some(Err(StoreError::AlreadyStored(_) | StoreError::BeingWritten(_)))
            | Some(Ok(_))
            | None => None,
            Some(Err(_)) => reserved.pop().and_then(Result::err),
        };
        let offsets: Vec<(u64, u64)> = reserved
            .iter()
            .zip(host)
            .filter_map(|(r, h)| {
                r.as_ref().ok().map(|&s| (self.slot_offset(h.slot), self.slot_offset(s)))
            })
            .collect();
        let copied = match offsets.is_empty() {
            true => Ok(()),
            false => self.copy_blocks(&self.region, &dev.region, &offsets).await,
        };
        let (mut refs, mut stored, mut ended) = (Vec::new(), Vec::new(), false);
        {
            let mut pool = dev.pool.lock();
            for (r, &(hash, parent)) in reserved.into_iter().zip(blocks) {
                let slot = match r {
                    Ok(slot) if copied.is_err() => {
                        let _ = pool.abort(slot);
                        ended = true;
                        continue;
                    }
                    Ok(slot) => {
                        // Pinned for the ref, unless an earlier block ended the run.
                        let _ = pool.commit(slot, u32::from(!ended));
                        stored.push((hash, parent));
                        slot
                    }
                    // Another task brought it up meanwhile: take that copy.
                    Err(_) => match pool.lookup(hash) {
                        Some(slot) if !ended => {
                            let _ = pool.pin(slot);
                            slot
                        }
                        _ => {
                            ended = true;
                            continue;
                        }
                    },
                };
                if !ended {
                    refs.push(DeviceBlockRef { store: self.clone(), slot, hash });
                }
            }
        }
        for (hash, parent) in stored {
            self.events.stored(hash, parent, TierKind::Device);
        }
        match copied {
            Ok(()) => (refs, stop),
            Err(e) => (refs, Some(e)),
        }
    }
}
