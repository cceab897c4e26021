//! The tiered block store: G2 host slots in a registered, shareable region, backed by an
//! optional G3 disk tier, with KV events and metrics.
//!
//! - **Store**: [`TieredStore::allocate`] reserves a host slot (invisible until commit),
//!   the caller fills it, [`WriteSlot::commit`] makes it visible and emits `Stored{host}`.
//! - **Offload** (write-back): when the host tier is full, its least recently used unpinned
//!   block is written to disk — if the frequency filter admits it (hit at least
//!   `disk_admit_min_hits` times) and it is not there already — then freed (`Stored{disk}`,
//!   `Removed{host}`). With `write_through`, every committed block is also written to disk
//!   in the background. If the disk cannot take it, the block stays in host memory and the
//!   error is returned.
//! - **Lookup**: [`TieredStore::lookup_prefix`] returns, for the leading run of cached
//!   blocks, the tier of each; disk hits start a background prefetch into host memory.
//! - **Onboard**: [`TieredStore::get`] pins the leading run of cached blocks in host memory,
//!   reading disk blocks (checksum-verified) into host slots.
//!
//! Pinned blocks ([`BlockRef`], [`WriteSlot`]) are never evicted; their `Drop` unpins.

use std::sync::Arc;
use std::time::Instant;

use kvfabric::agent::{Agent, AgentError};
use kvfabric::events::{KvEvent, KvEventData, KvEventSink, TierKind};
use kvfabric::hash::SequenceHash;
use kvfabric::memory::{Region, RegionLease, RegionOptions};
use parking_lot::Mutex;

use crate::disk::format::align_up;
use crate::disk::io::IoBuf;
use crate::disk::{DiskConfig, DiskError, DiskTier, ReadOutcome};
use crate::metrics::{add, get, MetricsSnapshot, StoreMetrics};
use crate::policy::{FrequencyFilter, PolicyKind};
use crate::pool::{PoolError, SlotPool, Victim};

/// How to build a store.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Bytes of one KV block (`BlockLayout::bytes_per_block`).
    pub block_bytes: u64,
    /// Host (G2) slots.
    pub host_blocks: u32,
    /// Host eviction policy.
    pub host_policy: PolicyKind,
    /// The disk (G3) tier, if any.
    pub disk: Option<DiskConfig>,
    /// A block evicted from host memory goes to disk only after this many lookup hits
    /// (0: always).
    pub disk_admit_min_hits: u32,
    /// Write every committed block to disk too, in the background.
    pub write_through: bool,
    /// Disk blocks found by a lookup are prefetched into host memory, at most this many.
    pub prefetch_blocks: u32,
    /// Put host slots in a `/dev/shm` region that same-host peers can map.
    pub shared_host: bool,
    /// Host slots kept free by evicting (and offloading) least recently used blocks in the
    /// background after commits, so that allocations seldom wait for a disk write (0: evict
    /// only when an allocation needs a slot). Only with a disk or remote tier to evict to.
    pub host_free_target: u32,
    /// G4: fabric nodes. Host evictions go there when no disk tier takes them, and `get`
    /// fetches blocks no local tier holds straight into host slots. Its agent must be the one
    /// the store is opened with.
    pub remote: Option<crate::remote::RemoteTier>,
}

impl StoreConfig {
    /// A host-only store of `host_blocks` blocks of `block_bytes`.
    pub fn new(block_bytes: u64, host_blocks: u32) -> Self {
        StoreConfig {
            block_bytes,
            host_blocks,
            host_policy: PolicyKind::Lru,
            disk: None,
            disk_admit_min_hits: 2,
            write_through: false,
            prefetch_blocks: 32,
            shared_host: true,
            host_free_target: 0,
            remote: None,
        }
    }

    /// With a disk tier.
    pub fn with_disk(mut self, disk: DiskConfig) -> Self {
        self.disk = Some(disk);
        self
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The block is already stored.
    #[error("block {0} is already stored")]
    AlreadyStored(SequenceHash),
    /// Another writer is storing the block.
    #[error("block {0} is being written")]
    BeingWritten(SequenceHash),
    /// Every block of the tier is pinned: nothing can be evicted.
    #[error("{0} tier is full and every block in it is pinned")]
    Full(TierKind),
    /// The disk tier failed; the block stayed where it was.
    #[error(transparent)]
    Disk(#[from] DiskError),
    /// Registering host memory failed.
    #[error(transparent)]
    Memory(#[from] AgentError),
    /// The remote tier (fabric) failed; the block stayed where it was.
    #[error("remote tier: {0}")]
    Remote(String),
    /// Bad input.
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug)]
struct HostState {
    pool: SlotPool,
    filter: FrequencyFilter,
    /// XXH3-64 of each ready slot's bytes, computed once at commit (or known from disk), so
    /// that offloads write without hashing on their critical path. Committed blocks are
    /// immutable.
    checksums: Vec<u64>,
}

#[derive(Debug)]
struct EventLog {
    sink: Arc<dyn KvEventSink>,
    next: Mutex<u64>,
}

impl EventLog {
    fn emit(&self, data: KvEventData) {
        let mut n = self.next.lock();
        *n += 1;
        self.sink.publish(KvEvent { event_id: *n, data });
    }

    fn stored(&self, hash: SequenceHash, parent: Option<SequenceHash>, tier: TierKind) {
        self.emit(KvEventData::Stored { sequence_hashes: vec![hash], parent, tier });
    }

    fn removed(&self, hashes: Vec<SequenceHash>, tier: TierKind) {
        if !hashes.is_empty() {
            self.emit(KvEventData::Removed { sequence_hashes: hashes, tier });
        }
    }
}

/// The longest an onboard waits for another task that is writing the same block into host
/// memory; past it, the block counts as a miss.
const ONBOARD_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug)]
struct Inner {
    cfg: StoreConfig,
    region: HostRegion,
    stride: u64,
    host: Mutex<HostState>,
    disk: Option<DiskTier>,
    events: EventLog,
    metrics: StoreMetrics,
    runtime: tokio::runtime::Handle,
    /// A background eviction (toward `host_free_target`) is running.
    freeing: std::sync::atomic::AtomicBool,
    /// Notified whenever a host slot being written is committed or aborted (onboards that
    /// found their block being written wait on it).
    written: tokio::sync::Notify,
}

/// The host tier's region, registered with the agent for as long as the store lives.
#[derive(Debug)]
struct HostRegion {
    region: Option<Arc<Region>>,
    agent: Agent,
}

impl std::ops::Deref for HostRegion {
    type Target = Arc<Region>;
    fn deref(&self) -> &Arc<Region> {
        // Only `drop` takes it out.
        self.region.as_ref().unwrap_or_else(|| unreachable!("the host region is taken on drop"))
    }
}

impl Drop for HostRegion {
    /// Deregisters the region when the store goes away (else every store opened and dropped
    /// in a process would keep its whole host tier allocated). A handle still held elsewhere
    /// (a caller's clone, a peer's in-flight transfer lease) keeps it registered; it is then
    /// freed with the agent.
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            let id = region.id();
            drop(region);
            if let Err(e) = self.agent.deregister(id) {
                tracing::debug!(error = %e, "host region still in use; left registered");
            }
        }
    }
}

/// The tiered store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TieredStore {
    inner: Arc<Inner>,
}

impl TieredStore {
    /// Builds a store: registers its host region with `agent`, opens (and rebuilds) the
    /// disk tier, and emits `Stored{disk}` for every block found on disk.
    pub async fn open(
        cfg: StoreConfig,
        agent: &Agent,
        sink: Arc<dyn KvEventSink>,
    ) -> Result<Self, StoreError> {
        if cfg.block_bytes == 0 || cfg.host_blocks == 0 {
            return Err(StoreError::Invalid("block bytes and host blocks must be >= 1".into()));
        }
        let stride = align_up(cfg.block_bytes);
        let bytes = stride
            .checked_mul(u64::from(cfg.host_blocks))
            .filter(|&b| b <= usize::MAX as u64)
            .ok_or_else(|| StoreError::Invalid("host tier too large".into()))?;
        let region = agent.alloc_region(
            bytes as usize,
            RegionOptions { shared: cfg.shared_host, export: true, huge_pages: false },
        )?;
        tracing::info!(
            block_bytes = cfg.block_bytes,
            host_blocks = cfg.host_blocks,
            host_bytes = bytes,
            "block store: host tier allocated"
        );
        let events = EventLog { sink, next: Mutex::new(0) };
        let disk = match &cfg.disk {
            Some(d) => {
                let (tier, recovered) = DiskTier::open(d, cfg.block_bytes).await?;
                tracing::info!(
                    path = %d.path.display(),
                    capacity = d.capacity_blocks,
                    recovered = recovered.blocks.len(),
                    "disk tier open"
                );
                for (hash, parent) in recovered.blocks {
                    events.stored(hash, parent, TierKind::Disk);
                }
                if recovered.discarded > 0 {
                    tracing::info!(
                        discarded = recovered.discarded,
                        "disk tier: unreadable or stale slots discarded"
                    );
                }
                Some(tier)
            }
            None => None,
        };
        let inner = Inner {
            host: Mutex::new(HostState {
                pool: SlotPool::new(cfg.host_blocks, cfg.host_policy),
                filter: FrequencyFilter::new(
                    cfg.disk_admit_min_hits,
                    (cfg.host_blocks as usize * 4).max(1024),
                ),
                checksums: vec![0; cfg.host_blocks as usize],
            }),
            region: HostRegion { region: Some(region), agent: agent.clone() },
            stride,
            disk,
            events,
            metrics: StoreMetrics::default(),
            runtime: tokio::runtime::Handle::current(),
            freeing: std::sync::atomic::AtomicBool::new(false),
            written: tokio::sync::Notify::new(),
            cfg,
        };
        Ok(TieredStore { inner: Arc::new(inner) })
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.inner.cfg.block_bytes
    }

    /// The registered host region (peers address host slots through it).
    pub fn host_region(&self) -> &Arc<Region> {
        &self.inner.region
    }

    /// Reserves a host slot for a new block; fill it, then [`WriteSlot::commit`]. Evicts
    /// (and offloads) under pressure.
    pub async fn allocate(
        &self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<WriteSlot, StoreError> {
        let slot = self.inner.reserve_host(hash, parent).await?;
        Ok(WriteSlot { store: self.inner.clone(), slot, hash, parent, done: false })
    }

    /// Stores a block by copying `bytes` (exactly one block) into a new host slot.
    pub async fn put(
        &self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        if bytes.len() as u64 != self.inner.cfg.block_bytes {
            return Err(StoreError::Invalid(format!(
                "block is {} bytes, store blocks are {}",
                bytes.len(),
                self.inner.cfg.block_bytes
            )));
        }
        let w = self.allocate(hash, parent).await?;
        w.write(0, bytes)?;
        w.commit_unpinned();
        Ok(())
    }

    /// For the leading run of `hashes` held in some tier, the fastest tier holding each.
    /// Counts hits and misses; disk hits are prefetched into host memory in the background.
    pub fn lookup_prefix(&self, hashes: &[SequenceHash]) -> Vec<TierKind> {
        let inner = &self.inner;
        let mut tiers = Vec::new();
        let mut to_prefetch = Vec::new();
        {
            let mut host = inner.host.lock();
            for &h in hashes {
                if let Some(slot) = host.pool.lookup(h) {
                    host.pool.touch(slot);
                    host.filter.hit(h);
                    add(&inner.metrics.host.hits, 1);
                    tiers.push(TierKind::Host);
                } else if inner.disk.as_ref().is_some_and(|d| d.has(h)) {
                    host.filter.hit(h);
                    add(&inner.metrics.disk.hits, 1);
                    tiers.push(TierKind::Disk);
                    // Prefetch no more than half the host tier, so prefetches never evict each other.
                    let limit = (inner.cfg.prefetch_blocks as usize)
                        .min(inner.cfg.host_blocks as usize / 2);
                    if to_prefetch.len() < limit {
                        to_prefetch.push(h);
                    }
                } else {
                    add(&inner.metrics.host.misses, 1);
                    if inner.disk.is_some() {
                        add(&inner.metrics.disk.misses, 1);
                    }
                    break;
                }
            }
        }
        if !to_prefetch.is_empty() {
            let inner = self.inner.clone();
            self.inner.runtime.spawn(async move {
                for h in to_prefetch {
                    // Onboard and release: the block stays resident in host memory.
                    // Onboarded and released at once (the ref drops).
                    let _ = inner.onboard(h).await;
                }
            });
        }
        tiers
    }

    /// Pins the leading run of `hashes` that some tier holds, in host memory, reading disk
    /// blocks in (concurrently); stops at the first block no tier holds (or that was found
    /// corrupt).
    pub async fn get(&self, hashes: &[SequenceHash]) -> Result<Vec<BlockRef>, StoreError> {
        let inner = &self.inner;
        // Pins are owned by BlockRefs from the moment they are taken: a caller that drops
        // this future leaks none.
        let mut plan: Vec<Option<BlockRef>> = Vec::new();
        {
            let mut host = inner.host.lock();
            for &h in hashes {
                if let Some(slot) = host.pool.lookup(h) {
                    let _ = host.pool.pin(slot);
                    plan.push(Some(BlockRef { store: inner.clone(), slot, hash: h }));
                } else if inner.disk.as_ref().is_some_and(|d| d.has(h)) {
                    plan.push(None);
                } else {
                    break;
                }
            }
        }
        let loads = plan.into_iter().zip(hashes).map(|(p, &h)| async move {
            match p {
                Some(r) => Ok(Some(r)),
                None => inner.onboard(h).await,
            }
        });
        let results = futures_util::future::join_all(loads).await;
        let mut refs = Vec::with_capacity(results.len());
        let mut first_err = None;
        let mut broken = false;
        for r in results {
            match r {
                Ok(Some(r)) => {
                    if !broken {
                        refs.push(r);
                    }
                }
                Ok(None) => broken = true,
                Err(e) => {
                    broken = true;
                    first_err.get_or_insert(e);
                }
            }
        }
        // G4: what no local tier holds, fetched from the fabric straight into host slots.
        if !broken && first_err.is_none() && refs.len() < hashes.len() && inner.cfg.remote.is_some()
        {
            // `hashes` is a chain: each block's parent is the one before it.
            let parent = refs.len().checked_sub(1).map(|i| hashes[i]);
            refs.extend(inner.onboard_remote(parent, &hashes[refs.len()..]).await?);
        }
        match (refs.is_empty(), first_err) {
            (true, Some(e)) => Err(e),
            _ => Ok(refs),
        }
    }

    /// Like [`TieredStore::lookup_prefix`], then asks the fabric (G4) about the blocks that
    /// follow the local run (no call when the store has no remote tier or it knows no node).
    pub async fn lookup_prefix_with_remote(&self, hashes: &[SequenceHash]) -> Vec<TierKind> {
        let local = self.lookup_prefix(hashes);
        self.extend_with_remote(hashes, local).await
    }

    /// Extends `tiers`, the result of [`TieredStore::lookup_prefix`] on `hashes`, with what
    /// the fabric (G4) holds after the local run. For callers that bound the remote round
    /// trip and keep the local run when it runs out: the local lookup (which counts hits and
    /// starts prefetches) is done once.
    pub async fn extend_with_remote(
        &self,
        hashes: &[SequenceHash],
        mut tiers: Vec<TierKind>,
    ) -> Vec<TierKind> {
        if let Some(remote) = self.inner.cfg.remote.as_ref().filter(|r| !r.is_empty()) {
            let rest = &hashes[tiers.len()..];
            let present = remote.lookup(rest).await.unwrap_or_else(|_| vec![false; rest.len()]);
            for (h, remote_has) in rest.iter().zip(present) {
                match self.local_tier(*h) {
                    Some(t) => tiers.push(t),
                    None if remote_has => tiers.push(TierKind::Remote),
                    None => break,
                }
            }
        }
        tiers
    }

    /// How many leading blocks of `hashes` some local tier holds, without counting hits or
    /// prefetching (for planning, not serving).
    pub fn held_prefix(&self, hashes: &[SequenceHash]) -> usize {
        hashes.iter().take_while(|&&h| self.local_tier(h).is_some()).count()
    }

    /// The fastest local tier holding a block, without counting a hit.
    fn local_tier(&self, h: SequenceHash) -> Option<TierKind> {
        if self.inner.host.lock().pool.lookup(h).is_some() {
            Some(TierKind::Host)
        } else if self.inner.disk.as_ref().is_some_and(|d| d.has(h)) {
            Some(TierKind::Disk)
        } else {
            None
        }
    }

    /// Writes blocks held in host memory to disk now (for example before a planned
    /// shutdown), skipping those already there. On error the blocks stay in host memory.
    pub async fn offload(&self, hashes: &[SequenceHash]) -> Result<usize, StoreError> {
        let mut written = 0;
        for &h in hashes {
            let (pinned, parent) = {
                let mut host = self.inner.host.lock();
                let Some(slot) = host.pool.lookup(h) else { continue };
                let _ = host.pool.pin(slot);
                let parent = match host.pool.state(slot) {
                    crate::pool::SlotState::Ready { parent, .. } => parent,
                    _ => None,
                };
                // Owned by a BlockRef: unpinned even if this future is dropped.
                (BlockRef { store: self.inner.clone(), slot, hash: h }, parent)
            };
            // The write and its bookkeeping run to completion even if this future is dropped.
            let inner = self.inner.clone();
            let r = to_completion(&self.inner.runtime, async move {
                let r = inner.offload_slot(pinned.slot, h, parent).await;
                drop(pinned);
                r
            })
            .await;
            if r? {
                written += 1;
            }
        }
        Ok(written)
    }

    /// Removes a block from every tier (pinned copies stay until unpinned).
    pub async fn remove(&self, hash: SequenceHash) -> bool {
        let inner = &self.inner;
        let mut any = false;
        if inner.host.lock().pool.remove(hash).is_ok() {
            inner.events.removed(vec![hash], TierKind::Host);
            any = true;
        }
        if let Some(d) = &inner.disk {
            if d.remove(hash).await {
                inner.events.removed(vec![hash], TierKind::Disk);
                any = true;
            }
        }
        any
    }

    /// Forgets every block in every tier (the disk file is emptied) and emits `Cleared`.
    pub async fn clear(&self) -> Result<(), StoreError> {
        self.inner.host.lock().pool.clear();
        if let Some(d) = &self.inner.disk {
            d.clear().await?;
        }
        self.inner.events.emit(KvEventData::Cleared);
        Ok(())
    }

    /// Every block held, per tier (for dumps to consumers that lost events).
    pub fn snapshot(&self) -> Vec<(TierKind, SequenceHash, Option<SequenceHash>)> {
        let mut out: Vec<_> = self
            .inner
            .host
            .lock()
            .pool
            .blocks()
            .into_iter()
            .map(|(h, p)| (TierKind::Host, h, p))
            .collect();
        if let Some(d) = &self.inner.disk {
            out.extend(d.blocks().into_iter().map(|(h, p)| (TierKind::Disk, h, p)));
        }
        out
    }

    /// Whether the store has a remote tier (G4) that knows at least one fabric node.
    pub fn has_remote(&self) -> bool {
        self.inner.cfg.remote.as_ref().is_some_and(|r| !r.is_empty())
    }

    /// The id of the last KV event emitted (a dump taken now is current as of this id).
    pub fn last_event_id(&self) -> u64 {
        *self.inner.events.next.lock()
    }

    /// Metrics and occupancy.
    pub fn metrics(&self) -> MetricsSnapshot {
        let m = &self.inner.metrics;
        let (host_used, host_cap) = {
            let h = self.inner.host.lock();
            (h.pool.used(), h.pool.capacity())
        };
        let (disk_used, disk_cap) = self.inner.disk.as_ref().map_or((0, 0), |d| d.occupancy());
        MetricsSnapshot {
            host_used_blocks: host_used,
            host_capacity_blocks: host_cap,
            disk_used_blocks: disk_used,
            disk_capacity_blocks: disk_cap,
            host_hits: get(&m.host.hits),
            host_misses: get(&m.host.misses),
            disk_hits: get(&m.disk.hits),
            disk_misses: get(&m.disk.misses),
            offload_blocks: get(&m.offload_blocks),
            offload_bytes: get(&m.offload_bytes),
            offload_errors: get(&m.offload_errors),
            offload_latency: m.offload_latency.snapshot(),
            onboard_blocks: get(&m.onboard_blocks),
            onboard_bytes: get(&m.onboard_bytes),
            onboard_latency: m.onboard_latency.snapshot(),
            disk_corrupt_blocks: get(&m.disk_corrupt_blocks),
            stored_blocks: get(&m.stored_blocks),
            disk_io_backend: self.inner.disk.as_ref().map(|d| d.backend().name()),
        }
    }

    /// The disk tier, if any (tests and benchmarks).
    pub fn disk(&self) -> Option<&DiskTier> {
        self.inner.disk.as_ref()
    }
}

impl Inner {
    fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.stride
    }

    fn slot_buf(&self, slot: u32) -> IoBuf {
        let ptr = self
            .region
            .ptr_at(self.slot_offset(slot), self.stride)
            // Slots are < host_blocks and the region is host_blocks × stride bytes.
            .unwrap_or(std::ptr::null_mut());
        IoBuf { ptr, len: self.stride as usize }
    }

    /// Reserves a host slot, evicting (and offloading) victims until one is free.
    async fn reserve_host(
        self: &Arc<Self>,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<u32, StoreError> {
        loop {
            let (victim, admitted) = {
                let mut host = self.host.lock();
                match host.pool.reserve(hash, parent) {
                    Ok(slot) => return Ok(slot),
                    Err(PoolError::Present(_)) => return Err(StoreError::AlreadyStored(hash)),
                    Err(PoolError::BeingWritten) => return Err(StoreError::BeingWritten(hash)),
                    Err(_) => match host.pool.begin_evict() {
                        Some(v) => {
                            let admitted = host.filter.admits(v.hash);
                            (v, admitted)
                        }
                        None => return Err(StoreError::Full(TierKind::Host)),
                    },
                }
            };
            // The eviction (an offload, then freeing the slot) completes even if this future
            // is dropped, so no slot stays marked evicting.
            let inner = self.clone();
            to_completion(&self.runtime, async move { inner.evict_host(victim, admitted).await })
                .await?;
        }
    }

    /// Starts a background eviction when fewer than `host_free_target` host slots are free
    /// (one at a time; it stops at the target, when nothing is evictable, or on an error).
    fn keep_free(self: &Arc<Self>) {
        let target = self.cfg.host_free_target;
        if target == 0 || (self.disk.is_none() && self.cfg.remote.is_none()) {
            return;
        }
        if self.host.lock().pool.free_slots() >= target {
            return;
        }
        use std::sync::atomic::Ordering;
        if self.freeing.swap(true, Ordering::AcqRel) {
            return;
        }
        let inner = self.clone();
        self.runtime.spawn(async move {
            loop {
                let (victim, admitted) = {
                    let mut host = inner.host.lock();
                    if host.pool.free_slots() >= target {
                        break;
                    }
                    match host.pool.begin_evict() {
                        Some(v) => {
                            let admitted = host.filter.admits(v.hash);
                            (v, admitted)
                        }
                        None => break,
                    }
                };
                if inner.evict_host(victim, admitted).await.is_err() {
                    break;
                }
            }
            inner.freeing.store(false, Ordering::Release);
        });
    }

    /// Completes an eviction begun under the lock: offloads when admitted, then frees.
    async fn evict_host(&self, v: Victim, admitted: bool) -> Result<(), StoreError> {
        // Only a block readable on disk counts as there: one still being written may fail.
        let offload = match &self.disk {
            Some(d) => admitted && !d.has(v.hash),
            None => false,
        };
        if offload {
            if let Err(e) = self.offload_slot(v.slot, v.hash, v.parent).await {
                let _ = self.host.lock().pool.finish_evict(v.slot, false);
                return Err(e);
            }
        } else if let (None, true, Some(remote)) = (&self.disk, admitted, &self.cfg.remote) {
            // No disk tier: the fabric (G4) takes the block, straight out of its host slot.
            let loc = [(self.region.id(), self.slot_offset(v.slot))];
            let stored = remote.put(&[v.hash], &[v.parent], &loc).await;
            if !matches!(stored.as_deref(), Ok([true])) {
                let _ = self.host.lock().pool.finish_evict(v.slot, false);
                return Err(StoreError::Remote(match stored {
                    Err(e) => e.to_string(),
                    Ok(_) => "the fabric did not take the block".into(),
                }));
            }
        }
        let mut host = self.host.lock();
        if host.pool.finish_evict(v.slot, true) == Ok(crate::pool::EvictOutcome::Freed) {
            self.events.removed(vec![v.hash], TierKind::Host);
        }
        Ok(())
    }

    /// Writes the block in host `slot` (pinned or evicting) to disk; Ok(true) if written.
    async fn offload_slot(
        &self,
        slot: u32,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<bool, StoreError> {
        let Some(disk) = &self.disk else { return Ok(false) };
        let start = Instant::now();
        let lease = RegionLease::new(self.region.clone());
        let checksum = self.host.lock().checksums.get(slot as usize).copied();
        // SAFETY: the slot lies inside the host region, which the lease keeps alive; the slot
        // is pinned or evicting, so nothing reuses it during the write.
        let r = unsafe { disk.write(hash, parent, self.slot_buf(slot), checksum, Box::new(lease)) }
            .await;
        match r {
            Ok(out) => {
                self.events.removed(out.evicted, TierKind::Disk);
                if out.already_present {
                    return Ok(false);
                }
                self.events.stored(hash, parent, TierKind::Disk);
                add(&self.metrics.offload_blocks, 1);
                add(&self.metrics.offload_bytes, self.cfg.block_bytes);
                self.metrics.offload_latency.observe(start.elapsed());
                Ok(true)
            }
            Err(e) => {
                add(&self.metrics.offload_errors, 1);
                Err(e.into())
            }
        }
    }

    /// Reads a disk block into a new host slot and pins it. Ok(None) if no tier has it (or
    /// it was corrupt and dropped).
    async fn onboard(self: &Arc<Self>, hash: SequenceHash) -> Result<Option<BlockRef>, StoreError> {
        // The read and its bookkeeping (the reserved host slot, the disk pin) run to
        // completion even if the caller drops this future; an unclaimed result just unpins.
        let inner = self.clone();
        to_completion(&self.runtime, async move { inner.onboard_task(hash).await }).await
    }

    async fn onboard_task(
        self: Arc<Self>,
        hash: SequenceHash,
    ) -> Result<Option<BlockRef>, StoreError> {
        let Some(disk) = &self.disk else { return Ok(None) };
        let start = Instant::now();
        let parent = disk.blocks_parent(hash);
        // Someone else may store, onboard or evict the same block meanwhile: retry until we
        // either pin it in host memory or hold a reservation to read it into (bounded).
        let slot = loop {
            if start.elapsed() > ONBOARD_WAIT_MAX {
                return Ok(None);
            }
            // Armed before the attempt, so that a commit or abort in between is not missed.
            let written = self.written.notified();
            tokio::pin!(written);
            written.as_mut().enable();
            match self.reserve_host(hash, parent).await {
                Ok(slot) => break slot,
                Err(StoreError::AlreadyStored(_)) => {
                    let mut host = self.host.lock();
                    if let Some(slot) = host.pool.lookup(hash) {
                        let _ = host.pool.pin(slot);
                        return Ok(Some(BlockRef { store: self.clone(), slot, hash }));
                    }
                }
                Err(StoreError::BeingWritten(_)) => {
                    // Woken when the writer commits or aborts a slot; the timeout only bounds
                    // a writer that is itself stuck.
                    let _ = tokio::time::timeout(ONBOARD_WAIT_MAX, written).await;
                }
                Err(e) => return Err(e),
            }
            if !disk.has(hash) && !self.host.lock().pool.knows(hash) {
                return Ok(None);
            }
        };
        let lease = RegionLease::new(self.region.clone());
        // SAFETY: the reserved slot lies inside the host region kept alive by the lease; it is
        // invisible (writing) until committed, so no one else touches it.
        let outcome = unsafe { disk.read(hash, self.slot_buf(slot), Arc::new(lease)) }.await;
        let mut host = self.host.lock();
        match outcome {
            Ok(ReadOutcome::Hit { parent, checksum }) => {
                host.checksums[slot as usize] = checksum;
                let _ = host.pool.commit(slot, 1);
                self.written.notify_waiters();
                self.events.stored(hash, parent, TierKind::Host);
                add(&self.metrics.onboard_blocks, 1);
                add(&self.metrics.onboard_bytes, self.cfg.block_bytes);
                self.metrics.onboard_latency.observe(start.elapsed());
                Ok(Some(BlockRef { store: self.clone(), slot, hash }))
            }
            Ok(ReadOutcome::Miss) => {
                let _ = host.pool.abort(slot);
                self.written.notify_waiters();
                Ok(None)
            }
            Ok(ReadOutcome::Corrupt) => {
                let _ = host.pool.abort(slot);
                self.written.notify_waiters();
                add(&self.metrics.disk_corrupt_blocks, 1);
                self.events.removed(vec![hash], TierKind::Disk);
                tracing::warn!(%hash, "corrupt block on disk dropped");
                Ok(None)
            }
            Err(e) => {
                let _ = host.pool.abort(slot);
                self.written.notify_waiters();
                Err(e.into())
            }
        }
    }

    /// Fetches the leading run of `hashes` that the fabric holds into new host slots, pinned.
    async fn onboard_remote(
        self: &Arc<Self>,
        first_parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
    ) -> Result<Vec<BlockRef>, StoreError> {
        let Some(remote) = &self.cfg.remote else { return Ok(Vec::new()) };
        if remote.is_empty() {
            return Ok(Vec::new());
        }
        let mut slots = Vec::new();
        let parent_of = |i: usize| if i == 0 { first_parent } else { Some(hashes[i - 1]) };
        for (i, &h) in hashes.iter().take(crate::remote::protocol::BLOCKS_PER_CALL_MAX).enumerate()
        {
            match self.reserve_host(h, parent_of(i)).await {
                Ok(slot) => slots.push(slot),
                Err(_) => break,
            }
        }
        let n = slots.len();
        let locs: Vec<_> = slots.iter().map(|&s| (self.region.id(), self.slot_offset(s))).collect();
        let served = match remote.get(&hashes[..n], &locs).await {
            Ok(served) => served,
            Err(_) => {
                // The node may still be writing into these slots (a timed-out call): keep
                // them reserved well past its transfer deadline before reusing them.
                let (inner, quarantine) = (self.clone(), remote.deadline() * 4);
                tokio::spawn(async move {
                    tokio::time::sleep(quarantine).await;
                    let mut host = inner.host.lock();
                    for s in slots {
                        let _ = host.pool.abort(s);
                    }
                    inner.written.notify_waiters();
                });
                return Ok(Vec::new());
            }
        };
        let run = served.iter().take_while(|&&s| s).count();
        let mut refs = Vec::with_capacity(run);
        for (i, &slot) in slots.iter().enumerate() {
            if i < run {
                let checksum =
                    self.region.checksum(self.slot_offset(slot), self.cfg.block_bytes).unwrap_or(0);
                let mut host = self.host.lock();
                host.checksums[slot as usize] = checksum;
                let _ = host.pool.commit(slot, 1);
                self.written.notify_waiters();
                self.events.stored(hashes[i], parent_of(i), TierKind::Host);
                drop(host);
                refs.push(BlockRef { store: self.clone(), slot, hash: hashes[i] });
            } else {
                let _ = self.host.lock().pool.abort(slot);
                self.written.notify_waiters();
            }
        }
        Ok(refs)
    }

    fn unpin(&self, slot: u32) {
        let _ = self.host.lock().pool.unpin(slot);
    }
}

/// Runs `fut` inline, in the caller's task (no spawn, no cross-thread wake on the data path);
/// if the caller drops the returned future before `fut` finished, the rest of `fut` runs to
/// completion in a task on `runtime`, so that its bookkeeping (a reserved slot, a pin, an
/// eviction in progress) is never left half-done.
async fn to_completion<T: Send + 'static>(
    runtime: &tokio::runtime::Handle,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    type Task<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;
    struct Finish<T: Send + 'static> {
        fut: Option<Task<T>>,
        runtime: tokio::runtime::Handle,
    }
    impl<T: Send + 'static> Drop for Finish<T> {
        fn drop(&mut self) {
            // A future that panicked while polled cannot be resumed.
            if std::thread::panicking() {
                return;
            }
            if let Some(fut) = self.fut.take() {
                // After a runtime shutdown the task is dropped unrun: its reservation stays
                // (the store is going away with the runtime anyway).
                self.runtime.spawn(async move {
                    let _ = fut.await;
                });
            }
        }
    }
    let mut guard = Finish { fut: Some(Box::pin(fut)), runtime: runtime.clone() };
    let out = std::future::poll_fn(|cx| match guard.fut.as_mut() {
        Some(f) => f.as_mut().poll(cx),
        None => std::task::Poll::Pending,
    })
    .await;
    guard.fut = None;
    out
}

/// A reserved host slot being filled. Invisible until committed; dropped uncommitted, the
/// slot is freed.
#[derive(Debug)]
pub struct WriteSlot {
    store: Arc<Inner>,
    slot: u32,
    hash: SequenceHash,
    parent: Option<SequenceHash>,
    done: bool,
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
        // Hashed once here, outside the lock; offloads reuse it.
        let checksum = if inner.disk.is_some() {
            inner.region.checksum(self.offset(), self.len()).unwrap_or(0)
        } else {
            0
        };
        let write_through = inner.cfg.write_through && inner.disk.is_some();
        {
            let mut host = inner.host.lock();
            host.checksums[self.slot as usize] = checksum;
            // The background write-through holds a pin of its own, taken in the same critical
            // section as the commit so that the block cannot be evicted in between.
            let _ = host.pool.commit(self.slot, pins + u32::from(write_through));
            inner.written.notify_waiters();
            add(&inner.metrics.stored_blocks, 1);
            inner.events.stored(self.hash, self.parent, TierKind::Host);
        }
        if write_through {
            let (inner, slot, hash, parent) = (inner.clone(), self.slot, self.hash, self.parent);
            inner.runtime.clone().spawn(async move {
                let _ = inner.offload_slot(slot, hash, parent).await;
                inner.unpin(slot);
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
            let _ = self.store.host.lock().pool.abort(self.slot);
            self.store.written.notify_waiters();
        }
    }
}

/// A block pinned in host memory; dropping it unpins.
#[derive(Debug)]
pub struct BlockRef {
    store: Arc<Inner>,
    slot: u32,
    hash: SequenceHash,
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
