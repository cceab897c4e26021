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
//!
//! This file holds the configuration, the errors, the state the other files share and the
//! store's general API; `offload.rs` the path from host memory to disk and fabric,
//! `onboard.rs` lookups and the path back into host memory, `handles.rs` [`WriteSlot`] and
//! [`BlockRef`].

mod device;
mod handles;
mod offload;
mod onboard;

pub use device::{DeviceBlockRef, DeviceSlots, DeviceTierConfig, DeviceWriteSlot};
pub use handles::{BlockRef, ScratchSlot, WriteSlot};

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvfabric::agent::{Agent, AgentError};
use kvfabric::events::{KvEvent, KvEventData, KvEventSink, TierKind};
use kvfabric::hash::SequenceHash;
use kvfabric::health::{DiskCorrupt, DiskFull, StoreHealth};
use kvfabric::memory::{Region, RegionOptions};
use parking_lot::Mutex;

use crate::disk::format::align_up;
use crate::disk::io::IoBuf;
use crate::disk::{DiskConfig, DiskError, DiskTier};
use crate::metrics::{get, MetricsSnapshot, StoreMetrics};
use crate::policy::{FrequencyFilter, PolicyKind};
use crate::pool::SlotPool;
use crate::pool::SlotState;

/// Corrupt blocks found on disk keep the store degraded for this long after the last one.
const CORRUPTION_RECENT_S: u64 = 600;

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
    /// Put host slots in a shared-memory region (a memfd) that same-host peers can map.
    pub shared_host: bool,
    /// Host slots kept free by evicting (and offloading) least recently used blocks in the
    /// background after commits, so that allocations seldom wait for a disk write (0: evict
    /// only when an allocation needs a slot). Only with a disk or remote tier to evict to.
    pub host_free_target: u32,
    /// G4: fabric nodes. Host evictions go there when no disk tier takes them, and `get`
    /// fetches blocks no local tier holds straight into host slots. Its agent must be the one
    /// the store is opened with.
    pub remote: Option<crate::remote::RemoteTier>,
    /// Host evictions go to `remote` when there is no disk tier (true, the default). False:
    /// the fabric is only read from, and an evicted block is dropped. A worker store inside an
    /// engine that reads other engines' stores does not push its evictions into theirs: they
    /// came from there, and they would push out the blocks those engines are about to serve.
    pub evict_to_remote: bool,
    /// G1: slots in GPU memory above the host tier (see [`DeviceTierConfig`]).
    pub device: Option<DeviceTierConfig>,
    /// An allocation that must evict waits on writing its victim to the fabric only while
    /// such writes measure at least this many bytes per second; below it the victim is
    /// dropped (the background eviction toward `host_free_target` still writes to the fabric).
    /// 0: always waits, as a store without a free reserve must.
    pub remote_write_min_bytes_per_s: f64,
    /// Other workers' stores, which [`TieredStore::pull`] reads from. Its agent must be the
    /// one the store is opened with.
    pub peers: Option<crate::remote::peers::Peers>,
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
            evict_to_remote: true,
            device: None,
            peers: None,
            remote_write_min_bytes_per_s: 0.0,
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
    /// XXH3-64 of each ready slot's bytes when known (read from disk with it); otherwise the
    /// offload computes it, off the committing engine's path (committed blocks are immutable,
    /// and most blocks evicted from a busy tier are never written to disk at all).
    checksums: Vec<Option<u64>>,
    /// Committed blocks whose write-through to disk is in flight (each holds a pin).
    writing_through: u32,
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

#[derive(Debug)]
struct Inner {
    cfg: StoreConfig,
    /// Declared (so dropped) before the host region: it may hold the host region's
    /// page-locking, undone before the region goes.
    device: Option<device::DeviceTier>,
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
    /// Notified whenever an eviction or a write-through ends: a reservation that found every
    /// host slot held by them waits for it.
    released: tokio::sync::Notify,
    /// The rate measured fetching blocks from the fabric (G4), bytes per second: an EWMA over
    /// fetches of at least a MiB (None before one).
    remote_rate: Mutex<crate::metrics::Rate>,
    /// The rate measured writing evicted blocks to the fabric, bytes per second (an EWMA).
    remote_put_rate: Mutex<crate::metrics::Rate>,
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
                if recovered.first_layout {
                    tracing::warn!(
                        path = %d.path.display(),
                        "disk tier: the slot file is in the layout of an earlier kvfabric (a \
                         header before each block): none of its blocks is read; its slots are \
                         rewritten as they are reused"
                    );
                } else if recovered.discarded > 0 {
                    tracing::info!(
                        discarded = recovered.discarded,
                        "disk tier: unreadable or stale slots discarded"
                    );
                }
                Some(tier)
            }
            None => None,
        };
        let device = match &cfg.device {
            Some(d) => Some(device::DeviceTier::open(d, agent, cfg.block_bytes, &region)?),
            None => None,
        };
        let inner = Inner {
            device,
            host: Mutex::new(HostState {
                pool: SlotPool::new(cfg.host_blocks, cfg.host_policy),
                filter: FrequencyFilter::new(
                    cfg.disk_admit_min_hits,
                    (cfg.host_blocks as usize * 4).max(1024),
                ),
                checksums: vec![None; cfg.host_blocks as usize],
                writing_through: 0,
            }),
            region: HostRegion { region: Some(region), agent: agent.clone() },
            stride,
            disk,
            events,
            metrics: StoreMetrics::default(),
            runtime: tokio::runtime::Handle::current(),
            freeing: std::sync::atomic::AtomicBool::new(false),
            written: tokio::sync::Notify::new(),
            released: tokio::sync::Notify::new(),
            remote_rate: Mutex::default(),
            remote_put_rate: Mutex::default(),
            cfg,
        };
        Ok(TieredStore { inner: Arc::new(inner) })
    }

    /// Host slots free right now.
    pub fn host_free_slots(&self) -> u32 {
        self.inner.host.lock().pool.free_slots()
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
        let wait = tokio::time::Instant::now() + offload::RESERVE_WAIT;
        let slot = self.inner.reserve_host(hash, parent, wait).await?;
        Ok(WriteSlot { store: self.inner.clone(), slot, hash, parent, done: false })
    }

    /// Reserves a host slot for a block whose hash is not known yet (see [`ScratchSlot`]).
    /// Evicts (and offloads) under pressure.
    pub async fn allocate_scratch(&self) -> Result<ScratchSlot, StoreError> {
        let slot =
            self.inner.reserve_scratch(tokio::time::Instant::now() + offload::RESERVE_WAIT).await?;
        Ok(ScratchSlot { store: self.inner.clone(), slot, done: false })
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

    /// Removes a block from every tier (pinned copies stay until unpinned). A host block on
    /// its way to disk is removed from disk once it lands there (waiting at most a second).
    pub async fn remove(&self, hash: SequenceHash) -> bool {
        let inner = &self.inner;
        let mut any = false;
        if inner.device.as_ref().is_some_and(|d| d.pool.lock().remove(hash).is_ok()) {
            inner.events.removed(vec![hash], TierKind::Device);
            any = true;
        }
        any |= self.remove_host(hash).await;
        if let Some(d) = &inner.disk {
            if d.remove(hash).await {
                inner.events.removed(vec![hash], TierKind::Disk);
                any = true;
            }
        }
        any
    }

    /// Moves a block out of host memory onto disk, writing it there unless it is already
    /// (a tenant past its host quota); where the store has no disk tier the block leaves the
    /// store. A pinned block stays where it is.
    pub async fn demote(&self, hash: SequenceHash) -> Result<Demoted, StoreError> {
        if self.inner.host.lock().pool.lookup(hash).is_none() {
            return Ok(Demoted::NotInHost);
        }
        let to_disk = self.inner.disk.is_some();
        if to_disk {
            self.offload(&[hash]).await?;
        }
        Ok(match (self.remove_host(hash).await, to_disk) {
            (false, _) => Demoted::NotInHost,
            (true, true) => Demoted::ToDisk,
            (true, false) => Demoted::Dropped,
        })
    }

    /// Removes a block from host memory (not pinned). One on its way to disk is waited for
    /// (at most a second), then removed from host memory.
    async fn remove_host(&self, hash: SequenceHash) -> bool {
        let inner = &self.inner;
        let mut any = false;
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        loop {
            let released = inner.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let (removed, evicting) = {
                let mut host = inner.host.lock();
                let removed = host.pool.remove(hash).is_ok();
                let evicting = !removed
                    && host.pool.lookup(hash).is_some_and(|slot| {
                        matches!(host.pool.state(slot), SlotState::Ready { evicting: true, .. })
                    });
                (removed, evicting)
            };
            if removed {
                inner.events.removed(vec![hash], TierKind::Host);
                any = true;
            }
            if !evicting || tokio::time::timeout_at(until, released).await.is_err() {
                break;
            }
        }
        any
    }

    /// Forgets every block in every tier (the disk file is emptied) and emits `Cleared`.
    pub async fn clear(&self) -> Result<(), StoreError> {
        if let Some(d) = &self.inner.device {
            d.pool.lock().clear();
        }
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
        if let Some(d) = &self.inner.device {
            out.extend(d.pool.lock().blocks().into_iter().map(|(h, p)| (TierKind::Device, h, p)));
        }
        out
    }

    /// Whether the store has a remote tier (G4) that knows at least one fabric node.
    pub fn has_remote(&self) -> bool {
        self.inner.cfg.remote.as_ref().is_some_and(|r| !r.is_empty())
    }

    /// The rate measured fetching blocks from the fabric (G4), bytes per second, including
    /// any queueing on the way (a saturated link reads slow): None before a fetch of a MiB.
    pub fn remote_rate(&self) -> Option<f64> {
        self.inner.remote_rate.lock().get()
    }

    /// The peers it pulls from, if any ([`StoreConfig::peers`]).
    pub fn peers(&self) -> Option<&crate::remote::peers::Peers> {
        self.inner.cfg.peers.as_ref()
    }

    /// The id of the last KV event emitted (a dump taken now is current as of this id).
    pub fn last_event_id(&self) -> u64 {
        *self.inner.events.next.lock()
    }

    /// The agent the store moves blocks with (its transfers, its regions).
    pub fn agent(&self) -> &Agent {
        &self.inner.region.agent
    }

    /// Metrics and occupancy.
    pub fn metrics(&self) -> MetricsSnapshot {
        let m = &self.inner.metrics;
        let (host_used, host_cap, host_evicted) = {
            let h = self.inner.host.lock();
            (h.pool.used(), h.pool.capacity(), h.pool.evicted())
        };
        let (disk_used, disk_cap) = self.inner.disk.as_ref().map_or((0, 0), |d| d.occupancy());
        let (device_used, device_cap) = self.device_occupancy();
        MetricsSnapshot {
            device_used_blocks: device_used,
            device_capacity_blocks: device_cap,
            host_used_blocks: host_used,
            host_capacity_blocks: host_cap,
            disk_used_blocks: disk_used,
            disk_capacity_blocks: disk_cap,
            host_hits: get(&m.host.hits),
            host_misses: get(&m.host.misses),
            disk_hits: get(&m.disk.hits),
            disk_misses: get(&m.disk.misses),
            host_evicted_blocks: host_evicted,
            disk_evicted_blocks: self.inner.disk.as_ref().map_or(0, |d| d.evicted()),
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

    /// Its part of `/health`: a full filesystem under the disk tier, corruption found lately
    /// (the blocks were dropped, never served, but the device, or something writing to the
    /// slot file, needs looking at). Each makes the process degraded (serving, with less than
    /// it was configured for); [`StoreHealth::reasons`] says them.
    pub fn health(&self) -> StoreHealth {
        let mut h = StoreHealth::default();
        if let Some(d) = &self.inner.disk {
            let (_, usable) = d.occupancy();
            if usable < d.configured_blocks() {
                h.disk_full = Some(DiskFull {
                    usable: u64::from(usable),
                    configured: u64::from(d.configured_blocks()),
                });
            }
        }
        let m = &self.inner.metrics;
        let blocks = m.disk_corrupt_blocks.load(Ordering::Relaxed);
        let last_ms = m.disk_corrupt_last_ms.load(Ordering::Relaxed);
        let last_s_ago = crate::metrics::unix_ms().saturating_sub(last_ms) / 1000;
        if blocks > 0 && last_s_ago < CORRUPTION_RECENT_S {
            h.disk_corrupt = Some(DiskCorrupt { blocks, last_s_ago });
        }
        h
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

    fn unpin(&self, slot: u32) {
        let _ = self.host.lock().pool.unpin(slot);
        // It may be evictable now: a reservation waiting for a slot looks again.
        self.released.notify_waiters();
    }

    /// Makes the block in reserved host `slot` visible with `pins` pins (`Stored{host}`) and
    /// wakes onboards waiting for it; `checksum` is the XXH3 of its bytes when known.
    fn commit_host(
        &self,
        host: &mut HostState,
        slot: u32,
        (hash, parent): (SequenceHash, Option<SequenceHash>),
        checksum: Option<u64>,
        pins: u32,
    ) {
        host.checksums[slot as usize] = checksum;
        let _ = host.pool.commit(slot, pins);
        self.written.notify_waiters();
        // Committed unpinned, it is evictable: a reservation waiting for a slot looks again.
        self.released.notify_waiters();
        self.events.stored(hash, parent, TierKind::Host);
    }

    /// Frees reserved host `slot`, whose block never arrived, and wakes onboards waiting
    /// for it.
    fn abort_host(&self, host: &mut HostState, slot: u32) {
        let _ = host.pool.abort(slot);
        self.written.notify_waiters();
        self.released.notify_waiters();
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

/// Where [`TieredStore::demote`] left a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Demoted {
    /// Out of host memory, on disk.
    ToDisk,
    /// Out of host memory and, the store having no disk tier, out of the store.
    Dropped,
    /// Not in host memory (already out, or never there), or pinned there: left as it is.
    NotInHost,
}
