//! The offload path, from host memory to disk (G3) or the fabric (G4): slot reservation that
//! evicts under pressure (write-back, admitted by the frequency filter), background eviction
//! toward `host_free_target`, the disk write behind write-through, and explicit offloads.

use std::sync::Arc;
use std::time::Instant;

use kvfabric::events::TierKind;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionLease;

use crate::metrics::add;
use crate::pool::{PoolError, Victim};

use super::{to_completion, BlockRef, Inner, StoreError, TieredStore};

impl TieredStore {
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
}

/// Blocks the background write-back evicts (and writes to disk) at once.
const WRITE_BACK_DEPTH: usize = 8;

/// How long a reservation waits, at most, for host slots held by evictions and
/// write-throughs in flight (disk writes) before the tier counts as full. Callers that
/// reserve several slots give one deadline to all of them.
pub(super) const RESERVE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// What a reservation does next.
enum Next {
    Evict(Victim, bool),
    /// Every slot is pinned or being evicted, some by disk writes in flight: wait for one.
    Wait,
}

impl Inner {
    /// Reserves a host slot, evicting (and offloading) victims until one is free; waits for
    /// slots held by disk writes in flight until `deadline`.
    pub(super) async fn reserve_host(
        self: &Arc<Self>,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
        deadline: tokio::time::Instant,
    ) -> Result<u32, StoreError> {
        self.reserve_with(deadline, |pool| match pool.reserve(hash, parent) {
            Err(PoolError::Present(_)) => Err(Some(StoreError::AlreadyStored(hash))),
            Err(PoolError::BeingWritten) => Err(Some(StoreError::BeingWritten(hash))),
            Err(_) => Err(None),
            Ok(slot) => Ok(slot),
        })
        .await
    }

    /// Reserves a host slot with no hash yet, evicting victims until one is free.
    pub(super) async fn reserve_scratch(
        self: &Arc<Self>,
        deadline: tokio::time::Instant,
    ) -> Result<u32, StoreError> {
        self.reserve_with(deadline, |pool| pool.reserve_scratch().map_err(|_| None)).await
    }

    /// Runs `take` (`Err(None)`: no free slot) until it gets a slot, evicting one victim
    /// after each miss.
    async fn reserve_with(
        self: &Arc<Self>,
        deadline: tokio::time::Instant,
        mut take: impl FnMut(&mut crate::pool::SlotPool) -> Result<u32, Option<StoreError>>,
    ) -> Result<u32, StoreError> {
        loop {
            // Armed before looking: a release after the look wakes the wait below.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let next = {
                let mut host = self.host.lock();
                match take(&mut host.pool) {
                    Ok(slot) => return Ok(slot),
                    Err(Some(e)) => return Err(e),
                    Err(None) => match host.pool.begin_evict() {
                        Some(v) => {
                            let admitted = host.filter.admits(v.hash);
                            Next::Evict(v, admitted)
                        }
                        // Pinned by users only: nothing says when they let go.
                        None if host.pool.evictions_in_flight() == 0
                            && host.writing_through == 0 =>
                        {
                            return Err(StoreError::Full(TierKind::Host))
                        }
                        None => Next::Wait,
                    },
                }
            };
            match next {
                Next::Evict(victim, admitted) => {
                    // The eviction (an offload, then freeing the slot) completes even if this
                    // future is dropped, so no slot stays marked evicting.
                    let inner = self.clone();
                    // An allocation waits on a write to the fabric only over a link that
                    // measured at least `remote_write_min_bytes_per_s` (or has not been
                    // measured yet); over a slower one what it evicts is dropped, and the
                    // background eviction toward `host_free_target` writes to the fabric at
                    // the link's pace.
                    let to_fabric = self
                        .remote_put_rate
                        .lock()
                        .get()
                        .is_none_or(|r| r >= self.cfg.remote_write_min_bytes_per_s);
                    to_completion(&self.runtime, async move {
                        inner.evict_host(victim, admitted, to_fabric).await
                    })
                    .await?;
                }
                Next::Wait => {
                    if tokio::time::timeout_at(deadline, released).await.is_err() {
                        return Err(StoreError::Full(TierKind::Host));
                    }
                }
            }
        }
    }

    /// Ends an eviction of host `slot` and wakes reservations waiting for one.
    fn end_eviction(
        &self,
        slot: u32,
        copied: bool,
    ) -> Result<crate::pool::EvictOutcome, PoolError> {
        let r = self.host.lock().pool.finish_evict(slot, copied);
        self.released.notify_waiters();
        r
    }

    /// Starts a background eviction when fewer than `host_free_target` host slots are free
    /// (up to [`WRITE_BACK_DEPTH`] at a time; it stops at the target, when nothing is
    /// evictable, or on an error).
    pub(super) fn keep_free(self: &Arc<Self>) {
        let target = self.cfg.host_free_target;
        if target == 0 || (self.disk.is_none() && self.evicts_to().is_none()) {
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
                // Several victims at a time: their writes are in flight together, so the
                // disk sees a queue (and the kernel one submission) instead of one block at
                // a time.
                let victims: Vec<(Victim, bool)> = {
                    let mut host = inner.host.lock();
                    let short = target.saturating_sub(host.pool.free_slots()) as usize;
                    let mut v = Vec::new();
                    while v.len() < short.min(WRITE_BACK_DEPTH) {
                        match host.pool.begin_evict() {
                            Some(victim) => {
                                let admitted = host.filter.admits(victim.hash);
                                v.push((victim, admitted));
                            }
                            None => break,
                        }
                    }
                    v
                };
                if victims.is_empty() {
                    break;
                }
                let evictions =
                    victims.into_iter().map(|(v, admitted)| inner.evict_host(v, admitted, true));
                let results = futures_util::future::join_all(evictions).await;
                if results.iter().any(Result::is_err) {
                    break;
                }
            }
            inner.freeing.store(false, Ordering::Release);
        });
    }

    /// The fabric that takes host evictions when there is no disk tier: the remote tier,
    /// unless it is only read from (`evict_to_remote`).
    fn evicts_to(&self) -> Option<&crate::remote::RemoteTier> {
        self.cfg.remote.as_ref().filter(|_| self.cfg.evict_to_remote)
    }

    /// Completes an eviction begun under the lock: offloads when admitted (to the fabric only
    /// when `to_fabric`: a background eviction, not an allocation's), then frees.
    async fn evict_host(
        &self,
        v: Victim,
        admitted: bool,
        to_fabric: bool,
    ) -> Result<(), StoreError> {
        // Only a block readable on disk counts as there: one still being written may fail.
        let offload = match &self.disk {
            Some(d) => admitted && !d.has(v.hash),
            None => false,
        };
        if offload {
            if let Err(e) = self.offload_slot(v.slot, v.hash, v.parent).await {
                let _ = self.end_eviction(v.slot, false);
                return Err(e);
            }
        } else if let (None, Some(remote), true) = (&self.disk, self.evicts_to(), to_fabric) {
            // No disk tier: the fabric (G4) takes the block, straight out of its host slot.
            // The admission filter guards the disk (its writes wear it and cost the serving
            // rate); the fabric is other machines' memory and takes every evicted block.
            // With no fabric node known there is nowhere to put it: it is dropped, as without
            // a remote tier (refusing the eviction would leave a full host tier unable to take
            // any new block).
            if !remote.is_empty() {
                let loc = [(self.region.id(), self.slot_offset(v.slot))];
                let started = Instant::now();
                let stored = remote.put(&[v.hash], &[v.parent], &loc).await;
                if matches!(stored.as_deref(), Ok([true])) {
                    self.remote_put_rate.lock().observe(self.cfg.block_bytes, started.elapsed());
                }
                if !matches!(stored.as_deref(), Ok([true])) {
                    let _ = self.end_eviction(v.slot, false);
                    return Err(StoreError::Remote(match stored {
                        Err(e) => e.to_string(),
                        Ok(_) => "the fabric did not take the block".into(),
                    }));
                }
            }
        }
        {
            // The event goes out under the lock: a new copy of the block stored in the freed
            // slot cannot be announced before this one's removal.
            let mut host = self.host.lock();
            if host.pool.finish_evict(v.slot, true) == Ok(crate::pool::EvictOutcome::Freed) {
                self.events.removed(vec![v.hash], TierKind::Host);
            }
        }
        self.released.notify_waiters();
        Ok(())
    }

    /// Writes the block in host `slot` (pinned or evicting) to disk; Ok(true) if written.
    pub(super) async fn offload_slot(
        &self,
        slot: u32,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
    ) -> Result<bool, StoreError> {
        let Some(disk) = &self.disk else { return Ok(false) };
        let start = Instant::now();
        let lease = RegionLease::new(self.region.clone());
        let checksum = self.host.lock().checksums.get(slot as usize).copied().flatten();
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
                // Logged at the 1st, 2nd, 4th, 8th… failure: visible, never a flood.
                let n =
                    self.metrics.offload_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        + 1;
                if n.is_power_of_two() {
                    tracing::warn!(%hash, error = %e, failures = n, "offload to disk failed: the block stays in host memory");
                }
                Err(e.into())
            }
        }
    }
}
