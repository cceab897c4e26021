//! The onboard path, from disk (G3) and the fabric (G4) back into host memory: lookups (which
//! start prefetches), remote-tier extension of a lookup, and `get`, which onboards blocks.

use std::sync::Arc;
use std::time::Instant;

use kvfabric::events::TierKind;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionLease;

use crate::disk::ReadOutcome;
use crate::metrics::add;
use crate::remote::peers::PullFailure;

use super::{to_completion, BlockRef, Inner, StoreError, TieredStore};

/// The longest an onboard waits for another task that is writing the same block into host
/// memory; past it, the block counts as a miss.
const ONBOARD_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);

impl TieredStore {
    /// The blocks of `hashes` held in host memory are used by latency-sensitive requests (a
    /// service class with an ITL target): evicted from the host tier after every other
    /// evictable block, so that batch prompts do not push them out while colder blocks exist
    /// (at most half the tier is kept so).
    pub fn keep(&self, hashes: &[SequenceHash]) {
        let mut host = self.inner.host.lock();
        for &h in hashes {
            if let Some(slot) = host.pool.lookup(h) {
                host.pool.keep(slot);
            }
        }
    }

    /// For the leading run of `hashes` held in some tier, the fastest tier holding each.
    /// Counts hits and misses; disk hits are prefetched into host memory in the background.
    pub fn lookup_prefix(&self, hashes: &[SequenceHash]) -> Vec<TierKind> {
        let inner = &self.inner;
        let mut tiers = Vec::new();
        let mut to_prefetch = Vec::new();
        {
            let mut device = inner.device.as_ref().map(|d| d.pool.lock());
            let mut host = inner.host.lock();
            for &h in hashes {
                if let Some(slot) = device.as_mut().and_then(|d| d.lookup(h).map(|s| (s, d))) {
                    let (slot, pool) = slot;
                    pool.touch(slot);
                    tiers.push(TierKind::Device);
                } else if let Some(slot) = host.pool.lookup(h) {
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

    /// Pulls `hashes` (a chain after `first_parent`, none of them held here) from peer `from`
    /// into host memory, pinned, within `deadline` (through the peers the store was opened
    /// with, [`StoreConfig::peers`]): the leading run it brought, and why it brought fewer
    /// than asked. A holder that died, was cut off or evicted the blocks makes it shorter;
    /// never a wrong block (each is checksummed) and never past the deadline.
    pub async fn pull(
        &self,
        from: &str,
        first_parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        deadline: std::time::Duration,
    ) -> (Vec<BlockRef>, Option<PullFailure>) {
        let inner = self.inner.clone();
        let (from, hashes) = (from.to_string(), hashes.to_vec());
        // Reservations and the commit run to completion even if the caller goes away.
        to_completion(&self.inner.runtime, async move {
            inner.pull_from_peer(&from, first_parent, &hashes, deadline).await
        })
        .await
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
        if self.inner.device.as_ref().is_some_and(|d| d.pool.lock().lookup(h).is_some()) {
            Some(TierKind::Device)
        } else if self.inner.host.lock().pool.lookup(h).is_some() {
            Some(TierKind::Host)
        } else if self.inner.disk.as_ref().is_some_and(|d| d.has(h)) {
            Some(TierKind::Disk)
        } else {
            None
        }
    }
}

impl Inner {
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
            let wait = tokio::time::Instant::from_std(start + ONBOARD_WAIT_MAX);
            match self.reserve_host(hash, parent, wait).await {
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
                self.commit_host(&mut host, slot, (hash, parent), Some(checksum), 1);
                add(&self.metrics.onboard_blocks, 1);
                add(&self.metrics.onboard_bytes, self.cfg.block_bytes);
                self.metrics.onboard_latency.observe(start.elapsed());
                Ok(Some(BlockRef { store: self.clone(), slot, hash }))
            }
            Ok(ReadOutcome::Miss) => {
                self.abort_host(&mut host, slot);
                Ok(None)
            }
            Ok(ReadOutcome::Corrupt) => {
                self.abort_host(&mut host, slot);
                add(&self.metrics.disk_corrupt_blocks, 1);
                self.metrics
                    .disk_corrupt_last_ms
                    .store(crate::metrics::unix_ms(), std::sync::atomic::Ordering::Relaxed);
                self.events.removed(vec![hash], TierKind::Disk);
                tracing::warn!(%hash, "corrupt block on disk dropped");
                Ok(None)
            }
            Err(e) => {
                self.abort_host(&mut host, slot);
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
        let quarantine = remote.deadline() * 4;
        let started = Instant::now();
        let fetched = self
            .fetch_into_host(first_parent, hashes, quarantine, |hashes, locs| async move {
                remote.get(&hashes, &locs).await.map_err(|_| ())
            })
            .await;
        let refs = fetched.map(|(refs, _)| refs).unwrap_or_default();
        let bytes = refs.len() as u64 * self.cfg.block_bytes;
        if bytes >= crate::metrics::Rate::BATCH_BYTES_MIN {
            self.remote_rate.lock().observe(bytes, started.elapsed());
        }
        Ok(refs)
    }

    /// Pulls the leading run of `hashes` that peer `from` holds into new host slots, pinned,
    /// within `deadline`: the blocks it brought, and why it brought fewer than asked.
    pub(super) async fn pull_from_peer(
        self: &Arc<Self>,
        from: &str,
        first_parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        deadline: std::time::Duration,
    ) -> (Vec<BlockRef>, Option<PullFailure>) {
        let Some(peers) = &self.cfg.peers else {
            return (Vec::new(), Some(PullFailure::Unknown));
        };
        // A holder cut off mid-pull may still write into the slots once it is back: they stay
        // reserved well past its transfer deadline.
        let quarantine = peers.deadline() * 4;
        let mut why = None;
        let fetched = self
            .fetch_into_host(first_parent, hashes, quarantine, |hashes, locs| {
                let why = &mut why;
                async move {
                    let (served, failure) = peers.pull(from, &hashes, &locs, deadline).await;
                    *why = failure;
                    match failure {
                        Some(PullFailure::Timeout | PullFailure::Unreachable) => Err(()),
                        _ => Ok(served),
                    }
                }
            })
            .await;
        match fetched {
            Some((refs, reserved)) => {
                if reserved < hashes.len() && why.is_none() && refs.len() == reserved {
                    peers.stats().failed(PullFailure::NoRoom);
                    why = Some(PullFailure::NoRoom);
                }
                (refs, why)
            }
            None => (Vec::new(), why),
        }
    }

    /// Reserves host slots for the leading `hashes` (a chain after `first_parent`), has
    /// `fetch` fill them (it says which it filled), and commits the leading run filled. The
    /// refs (pinned) and how many slots were reserved; None when `fetch` failed, whose slots
    /// stay reserved for `quarantine` (a peer may still be writing into them).
    async fn fetch_into_host<F, Fut>(
        self: &Arc<Self>,
        first_parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        quarantine: std::time::Duration,
        fetch: F,
    ) -> Option<(Vec<BlockRef>, usize)>
    where
        F: FnOnce(Vec<SequenceHash>, Vec<(kvfabric::memory::RegionId, u64)>) -> Fut,
        Fut: std::future::Future<Output = Result<Vec<bool>, ()>>,
    {
        let mut slots = Vec::new();
        let parent_of = |i: usize| if i == 0 { first_parent } else { Some(hashes[i - 1]) };
        let wait = tokio::time::Instant::now() + super::offload::RESERVE_WAIT;
        for (i, &h) in hashes.iter().take(crate::remote::protocol::BLOCKS_PER_CALL_MAX).enumerate()
        {
            match self.reserve_host(h, parent_of(i), wait).await {
                Ok(slot) => slots.push(slot),
                Err(_) => break,
            }
        }
        let n = slots.len();
        if n == 0 {
            return Some((Vec::new(), 0));
        }
        let locs: Vec<_> = slots.iter().map(|&s| (self.region.id(), self.slot_offset(s))).collect();
        let served = match fetch(hashes[..n].to_vec(), locs).await {
            Ok(served) => served,
            Err(()) => {
                let inner = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(quarantine).await;
                    let mut host = inner.host.lock();
                    for s in slots {
                        let _ = host.pool.abort(s);
                    }
                    inner.written.notify_waiters();
                    inner.released.notify_waiters();
                });
                return None;
            }
        };
        let run = served.iter().take_while(|&&s| s).count();
        let mut refs = Vec::with_capacity(run);
        for (i, &slot) in slots.iter().enumerate() {
            if i < run {
                self.commit_host(&mut self.host.lock(), slot, (hashes[i], parent_of(i)), None, 1);
                refs.push(BlockRef { store: self.clone(), slot, hash: hashes[i] });
            } else {
                self.abort_host(&mut self.host.lock(), slot);
            }
        }
        Some((refs, n))
    }
}
