//! The scheduler's side of the tiered store: a request's cached prefix looked up (its own
//! tiers, then the fabric's and peers', priced against computing it), pulls from peers, the
//! import of cached blocks into the engine, and the engine's full blocks stored as they fill.
//! The engine thread waits on the store here (`block_on`, each wait bounded by the
//! request's deadline): the engine computes on a thread of its own, and these are its only
//! waits on I/O.

use super::*;

impl<E: Engine> Loop<E> {
    /// The sequence takes part in steps from now on: its cached blocks are in the engine.
    pub(super) fn start(&self, seq: &mut Seq) {
        let bt = self.hasher.block_tokens().as_usize();
        seq.computed = seq.imported * bt;
        seq.stored = seq.imported;
        seq.started = true;
        if seq.preempted {
            // Resumed: the client was told where its prompt's KV came from the first time.
            return;
        }
        bump(&self.stats.cached_tokens[0], seq.hits.host_tokens as u64);
        bump(&self.stats.cached_tokens[1], seq.hits.disk_tokens as u64);
        bump(&self.stats.cached_tokens[2], (seq.hits.remote_tokens + seq.hits.peer_tokens) as u64);
        let _ = seq.tx.send(GenEvent::Started {
            prompt_tokens: seq.req.prompt.len(),
            cached: seq.hits,
            worker: None,
            remote_prefill: None,
        });
    }

    /// The tiers of the longest run of the prompt's full blocks that the store holds,
    /// leaving at least one prompt token to compute (for its logits).
    pub(super) fn cached_prefix(&self, seq: &Seq) -> Vec<TierKind> {
        let bt = self.hasher.block_tokens().as_usize();
        let reusable = seq.hashes.len().min(seq.tokens.len().saturating_sub(1) / bt);
        if reusable == 0 {
            return Vec::new();
        }
        let hashes = &seq.hashes[..reusable];
        let local = self.store.lookup_prefix(hashes);
        if local.len() == reusable || !self.store.has_remote() {
            return local;
        }
        // The fabric (G4) may hold what follows: one lookup round, bounded in time.
        let limit = seq.deadline.saturating_duration_since(Instant::now()).min(REMOTE_LOOKUP_MAX);
        let store = self.store.clone();
        let tiers = match self.runtime.block_on(async {
            tokio::time::timeout(limit, store.extend_with_remote(hashes, local.clone())).await
        }) {
            Ok(tiers) => tiers,
            Err(_) => {
                tracing::debug!(seq = seq.id, "remote tier lookup timed out; local blocks only");
                return local;
            }
        };
        self.price_remote(tiers, local.len())
    }

    /// Keeps the fabric's (G4) blocks of a cached run only if fetching them, at the rate the
    /// store measured over its link (queueing included), beats computing them at the rate
    /// the engine's steps measured: on a slow or saturated link they are computed. One
    /// declined run in [`REMOTE_PROBE_EVERY`] is fetched anyway, so that the rate is
    /// measured again when the link frees up.
    pub(super) fn price_remote(&self, mut tiers: Vec<TierKind>, local: usize) -> Vec<TierKind> {
        let remote = tiers[local.min(tiers.len())..].len();
        let (Some(rate), Some(us)) = (self.store.remote_rate(), self.cost.prefill_us_per_token)
        else {
            return tiers;
        };
        if remote == 0 || rate <= 0.0 {
            return tiers;
        }
        let fetch_s = (remote as u64 * self.store.block_bytes()) as f64 / rate;
        let compute_s = (remote * self.hasher.block_tokens().as_usize()) as f64 * us / 1e6;
        if fetch_s > compute_s {
            let n = self.stats.remote_declined.fetch_add(1, Ordering::Relaxed);
            if n % REMOTE_PROBE_EVERY != REMOTE_PROBE_EVERY - 1 {
                tiers.truncate(local);
            }
        }
        tiers
    }

    /// Starts pulling, from the peer a router named, the blocks of the prompt it holds past
    /// the cached run found here (in the background: the batch goes on meanwhile).
    pub(super) fn start_pull(&self, seq: &Seq) -> Option<PendingPull> {
        let hint = seq.req.pull.as_ref()?;
        let peers = self.store.peers()?;
        let bt = self.hasher.block_tokens().as_usize();
        let reusable = seq.hashes.len().min(seq.tokens.len().saturating_sub(1) / bt);
        let at = seq.import_tiers.len();
        // Pinned until the sequence starts: at most half the host tier, one call's worth.
        let cap =
            (self.host_capacity / 2).min(kvfabric_tiers::remote::protocol::BLOCKS_PER_CALL_MAX);
        let end = reusable.min(hint.blocks as usize).min(at + cap);
        if end <= at || hint.from.is_empty() {
            return None;
        }
        let left = seq.deadline.saturating_duration_since(Instant::now());
        let deadline = peers.deadline().min(left);
        let (store, from) = (self.store.clone(), hint.from.clone());
        let parent = at.checked_sub(1).map(|i| seq.hashes[i]);
        let hashes = seq.hashes[at..end].to_vec();
        tracing::debug!(seq = seq.id, from = %from, blocks = hashes.len(), at, "pulling from a peer");
        let task = self.runtime.spawn(async move {
            let (refs, why) = store.pull(&from, parent, &hashes, deadline).await;
            if let Some(why) = why {
                tracing::debug!(from = %from, asked = hashes.len(), got = refs.len(),
                    why = why.name(), "a pull from a peer came back short; computing the rest");
            }
            refs
        });
        Some(PendingPull { at, task })
    }

    /// The engine refused a cached block (it may hold part of it): the sequence starts over,
    /// computing its whole prompt.
    pub(super) fn compute_from_scratch(&mut self, seq: &mut Seq) {
        self.engine.remove_sequence(seq.id);
        self.engine.add_sequence(seq.id);
        seq.imported = 0;
        seq.hits = CacheHits::default();
        seq.import_tiers.clear();
    }

    /// A finished pull's blocks join the sequence's imported run (when they still follow it).
    pub(super) fn finish_pull(&mut self, seq: &mut Seq) {
        let Some(p) = seq.pull.take() else { return };
        let refs = self.runtime.block_on(p.task).unwrap_or_default();
        if seq.imported != p.at || seq.import_tiers.len() != p.at {
            // The cached run came back shorter than looked up: the pulled blocks do not
            // follow it (they stay in the store, unpinned).
            return;
        }
        for r in refs {
            if let Err(e) = self.engine.push_cached(seq.id, KvBlock::Cached(r)) {
                tracing::warn!(error = %e, "a pulled block was refused; computing the prompt");
                self.compute_from_scratch(seq);
                return;
            }
            seq.import_tiers.push(TierKind::Remote);
            seq.hits.peer_tokens += self.hasher.block_tokens().as_usize();
            seq.imported += 1;
        }
    }

    /// Whether some admitted sequence waits only for a pull (the loop then waits a moment
    /// for it, or for a submission, instead of spinning).
    pub(super) fn waiting_for_pulls(&self) -> bool {
        !self.running.iter().any(|s| s.started)
            && self.running.iter().any(|s| s.pull.as_ref().is_some_and(|p| !p.task.is_finished()))
    }

    /// Imports cached blocks of admitted sequences. Blocks in host memory are only pinned
    /// (the engine reads them in place), so they cost nothing and are all taken at once;
    /// blocks that must be read (disk, the fabric) count against a prompt chunk's worth
    /// (`step_tokens / block_tokens`) per iteration in all, so that a long cached (or
    /// remotely prefilled) prompt never stalls the batch's decodes for longer than a prompt
    /// chunk would. A sequence starts once its blocks are in.
    pub(super) fn import_some(&mut self) {
        let bt = self.hasher.block_tokens().as_usize();
        let mut budget = (self.cfg.step_tokens / bt).max(1);
        for i in 0..self.running.len() {
            if self.running[i].started {
                continue;
            }
            // Out of the batch while it is worked on (the batch is small: the shift is cheap).
            let mut seq = self.running.remove(i);
            while seq.imported < seq.import_tiers.len() {
                let (tried, cost) = self.import_blocks(&mut seq, budget);
                budget -= cost;
                if tried == 0 {
                    break;
                }
            }
            if seq.imported >= seq.import_tiers.len() {
                match &seq.pull {
                    Some(p) if !p.task.is_finished() => {}
                    Some(_) => {
                        self.finish_pull(&mut seq);
                        self.start(&mut seq);
                    }
                    None => self.start(&mut seq),
                }
            }
            self.running.insert(i, seq);
        }
    }

    /// Imports the sequence's next cached blocks: those in host memory, and up to `max` that
    /// must be read; returns how many it tried and how many of those had to be read. A block
    /// the store no longer has ends the imports (the rest is computed); a block the engine
    /// refuses restarts the sequence from scratch.
    pub(super) fn import_blocks(&mut self, seq: &mut Seq, max: usize) -> (usize, usize) {
        // In chunks that leave room in the host tier for the blocks read in.
        let chunk = (self.host_capacity / 4).clamp(1, 64);
        let (mut n, mut cost) = (0, 0);
        for t in &seq.import_tiers[seq.imported..] {
            if n == chunk {
                break;
            }
            if *t != TierKind::Host {
                if cost == max {
                    break;
                }
                cost += 1;
            }
            n += 1;
        }
        if n == 0 {
            return (0, 0);
        }
        let part = &seq.hashes[seq.imported..seq.imported + n];
        let refs = loop {
            let left = seq.deadline.saturating_duration_since(Instant::now());
            let store = self.store.clone();
            match self.runtime.block_on(async { tokio::time::timeout(left, store.get(part)).await })
            {
                // The host tier is full of pinned blocks, this sequence's among them (a
                // fetch from the fabric then brings nothing, a disk read fails): one of them
                // moves to engine memory, then retry.
                Ok(Ok(refs))
                    if refs.is_empty()
                        && self.store.host_free_slots() == 0
                        && self.engine.table_mut(seq.id).is_some_and(|t| t.spill_one()) =>
                {
                    Self::engine_memory(&self.stats, &StoreError::Full(TierKind::Host));
                }
                Ok(Ok(refs)) => break refs,
                Ok(Err(e @ StoreError::Full(_)))
                    if self.engine.table_mut(seq.id).is_some_and(|t| t.spill_one()) =>
                {
                    Self::engine_memory(&self.stats, &e);
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "prefix reuse stopped early; computing the rest");
                    break Vec::new();
                }
                Err(_) => {
                    tracing::debug!(
                        seq = seq.id,
                        "request deadline passed while importing cached blocks"
                    );
                    break Vec::new();
                }
            }
        };
        tracing::debug!(
            seq = seq.id,
            asked = n,
            got = refs.len(),
            from_block = seq.imported,
            "cached blocks onboarded from the store"
        );
        let got = refs.len();
        for r in refs {
            // Read in place from now on: pinned until the sequence ends.
            if let Err(e) = self.engine.push_cached(seq.id, KvBlock::Cached(r)) {
                // The engine may hold part of the block: recompute from the start.
                tracing::warn!(error = %e, "a cached block was refused; computing the prompt");
                self.compute_from_scratch(seq);
                return (n, cost);
            }
            match seq.import_tiers[seq.imported] {
                TierKind::Disk => seq.hits.disk_tokens += self.hasher.block_tokens().as_usize(),
                TierKind::Remote => seq.hits.remote_tokens += self.hasher.block_tokens().as_usize(),
                _ => seq.hits.host_tokens += self.hasher.block_tokens().as_usize(),
            }
            seq.imported += 1;
        }
        if got < n {
            seq.import_tiers.truncate(seq.imported);
        }
        (n, cost)
    }

    /// Counts a block held in engine memory for want of a host slot; logged at the 1st, 2nd,
    /// 4th, 8th… time (visible, never a flood).
    pub(super) fn engine_memory(stats: &SchedulerStats, cause: &StoreError) {
        let n = stats.engine_memory_blocks.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(blocks = n, %cause, "KV blocks held in engine memory: the host tier has no slot to spare for the running batch (--host-blocks)");
        }
    }

    /// Gives each planned input memory for the blocks its step computes: a store slot
    /// reserved for the block's hash when its tokens are all known (prompt blocks), a scratch
    /// slot named once they are, engine memory when the store cannot spare a slot.
    pub(super) fn provide_blocks(&mut self, plan: &[(usize, usize, usize)]) {
        let bt = self.hasher.block_tokens().as_usize();
        for &(i, start, n) in plan {
            let s = &self.running[i];
            let Some(table) = self.engine.table_mut(s.id) else { continue };
            let need = (start + n).div_ceil(bt);
            while table.blocks.len() < need {
                let b = table.blocks.len();
                let block = if !self.cfg.store_blocks || s.store_off {
                    KvBlock::owned(self.block_bytes)
                } else {
                    let hash = s.hashes.get(b).map(|&h| (h, b.checked_sub(1).map(|p| s.hashes[p])));
                    let store = self.store.clone();
                    let slot = self.runtime.block_on(async move {
                        if let Some((hash, parent)) = hash {
                            if let Ok(w) = store.allocate(hash, parent).await {
                                return Ok(KvBlock::Writing(w));
                            }
                        }
                        store.allocate_scratch().await.map(KvBlock::Scratch)
                    });
                    slot.unwrap_or_else(|e| {
                        Self::engine_memory(&self.stats, &e);
                        KvBlock::owned(self.block_bytes)
                    })
                };
                table.blocks.push(block);
            }
        }
    }

    /// Stores every block whose KV is now complete and that the store does not have yet: a
    /// slot reserved for it is committed in place (and stays pinned for the sequence), a
    /// scratch slot is named then committed, engine memory is copied into a new slot.
    pub(super) fn store_full_blocks(&mut self) {
        if !self.cfg.store_blocks {
            return;
        }
        let bt = self.hasher.block_tokens().as_usize();
        for s in &mut self.running {
            // Hashes of blocks completed by generated tokens.
            let full = s.tokens.len() / bt;
            if full > s.hashes.len() {
                let parent = s.hashes.last().copied();
                let more = s.hasher.extend(parent, &s.tokens[s.hashes.len() * bt..full * bt]);
                s.hashes.extend(more);
            }
            let Some(table) = self.engine.table_mut(s.id) else { continue };
            while s.stored < s.computed / bt {
                let b = s.stored;
                s.stored += 1;
                let hash = s.hashes[b];
                let parent = b.checked_sub(1).map(|p| s.hashes[p]);
                let Some(slot) = table.blocks.get_mut(b) else { break };
                let block = std::mem::replace(slot, KvBlock::owned(0));
                let block = match block {
                    KvBlock::Writing(w) => {
                        bump(&self.stats.stored_blocks, 1);
                        KvBlock::Cached(w.commit())
                    }
                    KvBlock::Scratch(sc) => match sc.name(hash, parent) {
                        Ok(w) => {
                            bump(&self.stats.stored_blocks, 1);
                            KvBlock::Cached(w.commit())
                        }
                        // Stored meanwhile by another sequence: this copy stays private.
                        Err((sc, _)) => KvBlock::Scratch(sc),
                    },
                    owned @ KvBlock::Owned { .. } if !s.store_off => loop {
                        let store = self.store.clone();
                        let stored = self.runtime.block_on(async {
                            let w = store.allocate(hash, parent).await?;
                            w.write(0, owned.bytes())?;
                            Ok::<_, StoreError>(w.commit())
                        });
                        match stored {
                            Ok(r) => {
                                bump(&self.stats.stored_blocks, 1);
                                break KvBlock::Cached(r);
                            }
                            // The host tier is full of pinned blocks, this sequence's among
                            // them (a sequence longer than the tier): one of its stored
                            // blocks moves to engine memory, so that its slot can be written
                            // back to disk and reused. Then retry.
                            Err(e @ StoreError::Full(_)) => {
                                if !table.spill_one() {
                                    break owned;
                                }
                                Self::engine_memory(&self.stats, &e);
                            }
                            Err(StoreError::AlreadyStored(_) | StoreError::BeingWritten(_)) => {
                                break owned
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "storing a block failed; this sequence stores no more");
                                s.store_off = true;
                                break owned;
                            }
                        }
                    },
                    other => other,
                };
                table.blocks[b] = block;
            }
        }
    }
}
