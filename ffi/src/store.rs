//! `kvf_store`: a tiered block store (host, optional disk, optional remote fabric nodes) on
//! an agent, addressed by token prefixes; blocks move between the store and the caller's
//! registered memory in the caller's own paged layout.
//!
//! Over 1,000 lines because it is the store's C ABI in one place: each `extern "C"` function
//! beside the Rust method it calls, with its safety contract, so that the ABI (and
//! `kvfabric.h`, generated from it) is read in one file.

use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvfabric::control::Registration;
use kvfabric::events::{ChannelSink, KvEvent, KvEventData, KvEventSink, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric::layout::ModelSpec;
use kvfabric::memory::{copy_between, MemoryKind, Region, RegionId};
use kvfabric::transfer::{Desc, TransferOp, TransferRequest};
use kvfabric::units::BlockTokens;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::fabric::FabricNode;
use kvfabric_tiers::publish::StorePublisher;
use kvfabric_tiers::remote::protocol::NodeInfo;
use kvfabric_tiers::remote::RemoteTier;
use kvfabric_tiers::{StoreConfig, StoreError, TieredStore};
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::agent::{copy_bytes, kvf_agent, Ctx};
use crate::config::kvf_config;
use crate::error::{guard, kvf_result, recorded, FfiError, LastError, Recorded};
use crate::op::kvf_op;
use crate::ptr::{self, Out, OutBuf};

/// Tier code: accelerator memory (G1; the engine's own blocks).
pub const KVF_TIER_DEVICE: u8 = 0;
/// Tier code: host memory (G2).
pub const KVF_TIER_HOST: u8 = 1;
/// Tier code: local disk (G3).
pub const KVF_TIER_DISK: u8 = 2;
/// Tier code: a remote fabric node (G4).
pub const KVF_TIER_REMOTE: u8 = 3;

fn tier_code(t: TierKind) -> u8 {
    match t {
        TierKind::Device => KVF_TIER_DEVICE,
        TierKind::Host => KVF_TIER_HOST,
        TierKind::Disk => KVF_TIER_DISK,
        TierKind::Remote => KVF_TIER_REMOTE,
    }
}

fn tier_of(code: u32) -> Result<TierKind, FfiError> {
    match code {
        0 => Ok(TierKind::Device),
        1 => Ok(TierKind::Host),
        2 => Ok(TierKind::Disk),
        3 => Ok(TierKind::Remote),
        c => Err(FfiError::invalid(format!("unknown tier {c}"))),
    }
}

/// One piece of a block in the caller's memory. Block `b` of the caller's cache has this
/// piece at `offset + b * block_stride` in `region`, `bytes` long. A block is its segments
/// in order; their `bytes` add up to the store's block size. For a paged cache with one
/// tensor per layer of shape [2][blocks][block_tokens][heads][head_dim] (vLLM's layout),
/// that is two segments per layer: K at offset 0 and V at offset `blocks * block_stride`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvf_segment {
    /// Region id from `kvf_agent_register`.
    pub region: u64,
    /// Offset of block 0's piece in the region.
    pub offset: u64,
    /// Bytes from one block's piece to the next block's.
    pub block_stride: u64,
    /// Bytes of the piece.
    pub bytes: u64,
}

/// A handle on a store: the store, and the hash seed this handle names its blocks with.
/// `kvf_store_new` opens a store; `kvf_store_salted` gives another handle on the same store
/// under a salted seed (a tenant's own namespace). The store closes when its last handle is
/// freed. All functions taking a `const kvf_store *` are thread-safe.
#[derive(Debug)]
pub struct kvf_store {
    core: Arc<StoreCore>,
    hasher: TokenBlockHasher,
    last_error: LastError,
}

impl std::ops::Deref for kvf_store {
    type Target = StoreCore;

    fn deref(&self) -> &StoreCore {
        &self.core
    }
}

/// What every handle on a store shares.
#[derive(Debug)]
pub struct StoreCore {
    ctx: Arc<Ctx>,
    store: TieredStore,
    remote: Option<RemoteTier>,
    node: Option<Arc<FabricNode>>,
    sink: Arc<ChannelSink>,
    registration: Mutex<Option<Registration>>,
    publisher: Option<StorePublisher>,
    tasks: Vec<JoinHandle<()>>,
    /// Nodes that answer this store's lookups (`kvf_store_add_lookup_node`): an engine's
    /// scheduler process asks the store of its worker process(es).
    lookup_nodes: Mutex<Vec<String>>,
    /// Put every stored block to the fabric too (config key `share`).
    share: bool,
    counters: Arc<Counters>,
}

/// What the store's callers cannot see in the tiers' own metrics: lookups answered by other
/// nodes, and blocks shared with the fabric.
#[derive(Debug, Default)]
struct Counters {
    node_lookups: AtomicU64,
    node_lookup_errors: AtomicU64,
    shared_blocks: AtomicU64,
    share_errors: AtomicU64,
    /// Whether the last node lookup or share failed (logged once per change).
    lookup_failing: AtomicBool,
    share_failing: AtomicBool,
}

impl Recorded for kvf_store {
    fn last_error(&self) -> &LastError {
        &self.last_error
    }
}

impl Drop for StoreCore {
    fn drop(&mut self) {
        let _entered = self.ctx.rt().enter();
        if self.node.take().is_some() {
            // The node holds the agent and is held by it: break the cycle.
            self.ctx.agent.clear_rpc_handler();
        }
        for t in &self.tasks {
            t.abort();
        }
        self.publisher.take();
        if let Some(r) = self.registration.lock().take() {
            self.ctx.rt().block_on(r.revoke());
        }
    }
}

/// Puts freshly stored blocks (pinned until the put ends) to the fabric; failures are
/// counted and logged once per run of failures.
async fn share_blocks(
    remote: RemoteTier,
    blocks: Vec<(SequenceHash, Option<SequenceHash>, kvfabric_tiers::BlockRef)>,
    c: Arc<Counters>,
) {
    let hs: Vec<SequenceHash> = blocks.iter().map(|b| b.0).collect();
    let parents: Vec<Option<SequenceHash>> = blocks.iter().map(|b| b.1).collect();
    let locs: Vec<_> = blocks.iter().map(|(_, _, r)| (r.region().id(), r.offset())).collect();
    match remote.put(&hs, &parents, &locs).await {
        Ok(done) => {
            let n = done.iter().filter(|&&d| d).count() as u64;
            c.shared_blocks.fetch_add(n, Ordering::Relaxed);
            if c.share_failing.swap(false, Ordering::Relaxed) {
                tracing::info!("sharing blocks with the fabric works again");
            }
        }
        Err(e) => {
            c.share_errors.fetch_add(hs.len() as u64, Ordering::Relaxed);
            if !c.share_failing.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "sharing blocks with the fabric failed");
            }
        }
    }
    drop(blocks); // the pins end with the put
}

fn config_error(m: impl Into<String>) -> FfiError {
    FfiError::new(kvf_result::KVF_INVALID_CONFIG, m)
}

/// Bytes per block: `block_bytes`, or the layout of `model` (a preset, config.json or GGUF).
fn block_bytes(cfg: &kvf_config, block_tokens: u32) -> Result<u64, FfiError> {
    if let Some(b) = cfg.str("block_bytes") {
        let b: u64 = b.parse().map_err(|_| config_error("block_bytes"))?;
        return if b == 0 { Err(config_error("block_bytes must be at least 1")) } else { Ok(b) };
    }
    let model = cfg.str("model").ok_or_else(|| {
        config_error("set \"block_bytes\" or \"model\" to size the store's blocks")
    })?;
    let path = std::path::Path::new(model);
    let spec = if path.is_file() {
        let gguf =
            std::fs::read(path).ok().is_some_and(|b| b.starts_with(&kvfabric::gguf::GGUF_MAGIC));
        if gguf {
            ModelSpec::from_gguf_path(path)
        } else {
            ModelSpec::from_hf_config_path(path)
        }
    } else {
        ModelSpec::preset(model)
    }
    .map_err(|e| config_error(format!("model {model:?}: {e}")))?;
    let layout = spec.block_layout(block_tokens).map_err(|e| config_error(e.to_string()))?;
    Ok(layout.bytes_per_block())
}

impl kvf_store {
    /// Opens a store on `agent` (Rust entry point of `kvf_store_new`).
    pub fn new(agent: &kvf_agent, cfg: &kvf_config) -> Result<kvf_store, FfiError> {
        let ctx = agent.ctx.clone();
        let Some(block_tokens) = BlockTokens::new(cfg.num::<u32>("block_tokens", 16)) else {
            return Err(config_error("block_tokens must be at least 1"));
        };
        let bytes = block_bytes(cfg, block_tokens.get())?;
        let seed = HashSeed::new(cfg.str("lora"), cfg.str("salt"));
        let hasher = TokenBlockHasher::new(block_tokens, seed);
        let mut scfg = StoreConfig::new(bytes, cfg.num::<u32>("host_blocks", 1024));
        scfg.shared_host = cfg.bool("shared_host", true);
        scfg.disk_admit_min_hits = cfg.num::<u32>("disk_admit_min_hits", 0);
        scfg.write_through = cfg.bool("write_through", false);
        if let Some(path) = cfg.str("disk_path") {
            scfg.disk = Some(DiskConfig::new(path, cfg.num::<u32>("disk_blocks", 4096)));
        }
        let remote =
            cfg.bool("remote", false).then(|| RemoteTier::new(ctx.agent.clone(), ctx.deadline));
        scfg.remote = remote.clone();
        // The fabric takes this store's evictions only when it shares its blocks with it:
        // a store that only reads other engines' stores drops what it evicts (those blocks
        // came from there, and pushing them back pushed out what those engines served next).
        let share = cfg.bool("share", false);
        scfg.evict_to_remote = share;
        // Evicting ahead in the background is opt-in: with a host tier sized to one prompt,
        // keeping an eighth free made loads from disk lose their own blocks (measured: the
        // disk row's median went from 0.09 s to 0.23 s).
        scfg.host_free_target = cfg.num::<u32>("host_free_target", 0);
        let name = ctx.agent.name().to_string();
        let (sink, events) = ChannelSink::new(65_536);
        let rt = ctx.rt();
        // Opened on the runtime, not on the calling thread: threads the store starts (its
        // disk I/O thread) inherit the runtime's CPUs, not the engine's pinned cores.
        let (agent_c, sink_c) = (ctx.agent.clone(), sink.clone());
        let store = rt
            .block_on(rt.spawn(async move { TieredStore::open(scfg, &agent_c, sink_c).await }))
            .map_err(|e| FfiError::new(kvf_result::KVF_PANIC, e.to_string()))??;
        let tasks: Vec<JoinHandle<()>> = Vec::new();
        // One id sequence for the store's own events and those the engine publishes; dumps
        // for routers that lost some.
        let publisher = rt.block_on(StorePublisher::start(
            ctx.bus.clone(),
            name.clone(),
            store.clone(),
            events,
        ))?;
        // From here on, a failure drops `this`, whose Drop undoes what was set up.
        let mut this = StoreCore {
            ctx: ctx.clone(),
            store: store.clone(),
            remote: remote.clone(),
            node: None,
            sink,
            registration: Mutex::new(None),
            publisher: Some(publisher),
            tasks,
            lookup_nodes: Mutex::new(Vec::new()),
            share,
            counters: Arc::default(),
        };
        if this.share && remote.is_none() {
            return Err(config_error("\"share\" needs a remote tier (config key \"remote\")"));
        }
        if cfg.bool("serve", false) {
            let node = FabricNode::serve(ctx.agent.clone(), store.clone(), ctx.deadline);
            this.node = Some(node.clone());
            if cfg.bool("advertise", true) {
                *this.registration.lock() =
                    Some(rt.block_on(node.register(&*ctx.discovery, &name, ctx.lease_ttl))?);
            }
        }
        if let Some(remote) = remote {
            let own = this.node.is_some().then(|| name.clone());
            this.tasks.push(rt.block_on(remote.follow(&*ctx.discovery, bytes, own))?);
        }
        Ok(kvf_store { core: Arc::new(this), hasher, last_error: LastError::default() })
    }

    /// Another handle on this store whose block hashes have `salt` folded into this
    /// handle's seed (`kvf_store_salted`); an empty salt gives this handle's seed.
    pub fn salted(&self, salt: &str) -> Result<kvf_store, FfiError> {
        let seed = self.hasher.seed().salted(salt);
        let hasher = TokenBlockHasher::new(self.hasher.block_tokens(), seed);
        Ok(kvf_store { core: self.core.clone(), hasher, last_error: LastError::default() })
    }

    /// The store (Rust tests and benchmarks).
    pub fn store(&self) -> &TieredStore {
        &self.store
    }

    fn hashes(&self, tokens: &[u32], blocks: usize) -> Vec<SequenceHash> {
        let bt = self.hasher.block_tokens().as_usize();
        self.hasher.sequence_hashes(&tokens[..(blocks * bt).min(tokens.len())])
    }

    /// The leading run of `tokens`' full blocks held in some tier, with the tier of each.
    /// With lookup nodes, the run every one of them can provide; a node that fails to answer
    /// is an error (counted; the caller treats the blocks as not cached).
    pub fn lookup(&self, tokens: &[u32]) -> Result<Vec<TierKind>, FfiError> {
        let hashes = self.hasher.sequence_hashes(tokens);
        let nodes = self.lookup_nodes.lock().clone();
        if !nodes.is_empty() {
            return self.lookup_at(&nodes, &hashes);
        }
        Ok(match &self.remote {
            None => self.store.lookup_prefix(&hashes),
            Some(_) => {
                let fut = self.store.lookup_prefix_with_remote(&hashes);
                let d = self.ctx.deadline;
                self.ctx
                    .rt()
                    .block_on(async { tokio::time::timeout(d, fut).await })
                    .unwrap_or_else(|_| self.store.lookup_prefix(&hashes))
            }
        })
    }

    fn lookup_at(
        &self,
        nodes: &[String],
        hashes: &[SequenceHash],
    ) -> Result<Vec<TierKind>, FfiError> {
        let c = &self.counters;
        c.node_lookups.fetch_add(1, Ordering::Relaxed);
        let (agent, d) = (&self.ctx.agent, self.ctx.deadline);
        let asked = async {
            let mut run: Option<Vec<TierKind>> = None;
            for node in nodes {
                let mut tiers = RemoteTier::prefix_at(agent, node, hashes, d).await?;
                if let Some(r) = &run {
                    tiers.truncate(r.len());
                }
                run = Some(tiers);
            }
            Ok::<_, kvfabric_tiers::remote::RemoteError>(run.unwrap_or_default())
        };
        let outcome =
            self.ctx.rt().block_on(async { tokio::time::timeout(d, asked).await }).unwrap_or_else(
                |_| {
                    Err(kvfabric_tiers::remote::RemoteError::Node {
                        node: nodes.join(","),
                        message: "lookup timed out".into(),
                    })
                },
            );
        match outcome {
            Ok(tiers) => {
                if c.lookup_failing.swap(false, Ordering::Relaxed) {
                    tracing::info!("lookups answered again by {}", nodes.join(","));
                }
                Ok(tiers)
            }
            Err(e) => {
                c.node_lookup_errors.fetch_add(1, Ordering::Relaxed);
                if !c.lookup_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "lookup failed: counted as not cached");
                }
                Err(FfiError::new(kvf_result::KVF_TRANSFER, format!("lookup: {e}")))
            }
        }
    }

    /// The store's metrics and this handle's counters (`kvf_store_metrics`).
    pub fn metrics_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self.store.metrics()).unwrap_or_default();
        let c = &self.counters;
        if let Some(m) = v.as_object_mut() {
            for (k, a) in [
                ("node_lookups", &c.node_lookups),
                ("node_lookup_errors", &c.node_lookup_errors),
                ("shared_blocks", &c.shared_blocks),
                ("share_errors", &c.share_errors),
            ] {
                m.insert(k.into(), a.load(Ordering::Relaxed).into());
            }
            let nodes = self.remote.as_ref().map(RemoteTier::nodes).unwrap_or_default();
            m.insert("fabric_nodes".into(), nodes.into());
            // etcd's and NATS's state as this process sees it (embedded ones are always up
            // and left out), as `/metrics` says it for kvfabric's own processes.
            let control = serde_json::to_value(self.control_health()).unwrap_or_default();
            m.insert("control_plane".into(), control);
        }
        v
    }

    /// etcd's and NATS's state as this process sees them (embedded ones are always up and
    /// left out).
    fn control_health(&self) -> Vec<kvfabric::health::ControlHealth> {
        kvfabric::control::remote_statuses(&*self.ctx.discovery, &*self.ctx.bus)
    }

    /// The health document of this store (`kvf_store_health`): its tiers, its agent's
    /// transfers and the control plane, finished (status and reasons).
    pub fn health(&self) -> kvfabric::health::Health {
        kvfabric::health::Health {
            store: Some(self.store.health()),
            transfer: Some(self.store.agent().health()),
            control_plane: self.control_health(),
            ..Default::default()
        }
        .finish()
    }

    /// Checks a block range and the caller's segments; returns the regions of the segments.
    fn plan(
        &self,
        tokens: &[u32],
        first_block: usize,
        block_ids: &[u32],
        segments: &[kvf_segment],
    ) -> Result<Vec<Arc<Region>>, FfiError> {
        let full = tokens.len() / self.hasher.block_tokens().as_usize();
        if block_ids.is_empty() {
            return Err(FfiError::invalid("no blocks given"));
        }
        if first_block.checked_add(block_ids.len()).is_none_or(|end| end > full) {
            return Err(FfiError::invalid(format!(
                "blocks {first_block}..{} asked, the tokens hold {full} full blocks",
                first_block.saturating_add(block_ids.len())
            )));
        }
        if segments.is_empty() {
            return Err(FfiError::invalid("no segments given"));
        }
        let total = segments.iter().try_fold(0u64, |acc, s| acc.checked_add(s.bytes));
        if total != Some(self.store.block_bytes()) {
            return Err(FfiError::invalid(format!(
                "segments add up to {:?} bytes, store blocks are {}",
                total,
                self.store.block_bytes()
            )));
        }
        let max_id = u64::from(*block_ids.iter().max().unwrap_or(&0));
        let mut regions = Vec::with_capacity(segments.len());
        for (i, s) in segments.iter().enumerate() {
            let region = self.ctx.agent.region(RegionId(s.region))?;
            // The highest block's piece in bounds means every piece is (strides are >= 0).
            let end = max_id
                .checked_mul(s.block_stride)
                .and_then(|o| o.checked_add(s.offset))
                .ok_or_else(|| {
                    FfiError::new(
                        kvf_result::KVF_OUT_OF_BOUNDS,
                        format!("segment {i}: address overflows"),
                    )
                })?;
            region.check(end, s.bytes)?;
            region.check(s.offset, s.bytes)?;
            regions.push(region);
        }
        Ok(regions)
    }

    /// Starts storing blocks `first_block..` of `tokens` from the caller's blocks `block_ids`.
    pub fn save(
        &self,
        tokens: &[u32],
        first_block: usize,
        block_ids: &[u32],
        segments: &[kvf_segment],
    ) -> Result<kvf_op, FfiError> {
        let regions = self.plan(tokens, first_block, block_ids, segments)?;
        let hashes = self.hashes(tokens, first_block + block_ids.len());
        let (store, segs, ids, regs) =
            (self.store.clone(), segments.to_vec(), block_ids.to_vec(), regions.clone());
        let share = self.remote.clone().filter(|_| self.share);
        let counters = self.counters.clone();
        let agent = self.ctx.agent.clone();
        let fut = async move {
            // Reserve every slot first: a save larger than what the host tier can free
            // fails whole (KVF_FULL) instead of evicting its own first blocks.
            let mut slots = Vec::with_capacity(ids.len());
            for (k, i) in (first_block..first_block + ids.len()).enumerate() {
                let parent = i.checked_sub(1).map(|p| hashes[p]);
                match store.allocate(hashes[i], parent).await {
                    Ok(slot) => slots.push((k, slot)),
                    Err(StoreError::AlreadyStored(_) | StoreError::BeingWritten(_)) => {}
                    Err(e) => return Err(FfiError::from(e)),
                }
            }
            let stored = slots.len() as u64;
            // Every piece: (engine region, offset) -> (store slot, offset).
            let mut pieces = Vec::new();
            for (k, slot) in &slots {
                let mut at = 0;
                for (s, region) in segs.iter().zip(&regs) {
                    let src = s.offset + u64::from(ids[*k]) * s.block_stride;
                    pieces.push((
                        (region.clone(), src),
                        (slot.region().clone(), slot.offset() + at),
                        s.bytes,
                    ));
                    at += s.bytes;
                }
            }
            copy_pieces(&agent, pieces).await?;
            let mut committed = Vec::new();
            for (k, slot) in slots {
                match &share {
                    Some(_) => {
                        let i = first_block + k;
                        let parent = i.checked_sub(1).map(|p| hashes[p]);
                        committed.push((hashes[i], parent, slot.commit()));
                    }
                    None => slot.commit_unpinned(),
                }
            }
            if let Some(remote) = share.filter(|r| !r.is_empty() && !committed.is_empty()) {
                // The fabric gets its copy after the save completes: the engine's blocks are
                // free again, and other engines find the blocks soon after.
                tokio::spawn(share_blocks(remote, committed, counters));
            }
            Ok(stored)
        };
        Ok(kvf_op::spawn(self.ctx.rt().handle(), regions, fut))
    }

    /// Starts loading blocks `first_block..` of `tokens` into the caller's blocks `block_ids`.
    pub fn load(
        &self,
        tokens: &[u32],
        first_block: usize,
        block_ids: &[u32],
        segments: &[kvf_segment],
    ) -> Result<kvf_op, FfiError> {
        let regions = self.plan(tokens, first_block, block_ids, segments)?;
        let hashes = self.hashes(tokens, first_block + block_ids.len());
        let (store, segs, ids, regs) =
            (self.store.clone(), segments.to_vec(), block_ids.to_vec(), regions.clone());
        let deadline = self.ctx.deadline;
        let agent = self.ctx.agent.clone();
        let fut = async move {
            let refs = tokio::time::timeout(deadline, store.get(&hashes))
                .await
                .map_err(|_| FfiError::new(kvf_result::KVF_TIMED_OUT, "load timed out"))??;
            let loaded = refs.len().saturating_sub(first_block).min(ids.len());
            let mut pieces = Vec::new();
            for (k, r) in refs.iter().skip(first_block).take(loaded).enumerate() {
                let mut at = 0;
                for (s, region) in segs.iter().zip(&regs) {
                    let dst = s.offset + u64::from(ids[k]) * s.block_stride;
                    pieces.push((
                        (r.region().clone(), r.offset() + at),
                        (region.clone(), dst),
                        s.bytes,
                    ));
                    at += s.bytes;
                }
            }
            copy_pieces(&agent, pieces).await?;
            Ok(loaded as u64)
        };
        Ok(kvf_op::spawn(self.ctx.rt().handle(), regions, fut))
    }
}

/// One copy of a save or load: (source region, offset) → (destination region, offset), bytes.
type CopyPiece = ((Arc<Region>, u64), (Arc<Region>, u64), u64);

/// Copies the pieces of a save or a load between an engine's KV buffers and store slots:
/// with memcpy when every region is host memory, else as one local transfer of the agent
/// (its `cuda` transport: a D2H or H2D copy per piece on a stream, one completion event), so
/// that an engine's GPU KV buffers registered with `KVF_MEM_DEVICE` save and load directly.
async fn copy_pieces(
    agent: &kvfabric::agent::Agent,
    pieces: Vec<CopyPiece>,
) -> Result<(), FfiError> {
    let gpu = pieces
        .iter()
        .any(|((s, _), (d, _), _)| s.kind() != MemoryKind::Host || d.kind() != MemoryKind::Host);
    if !gpu {
        for ((s, so), (d, dof), n) in &pieces {
            copy_between(s, *so, d, *dof, *n)?;
        }
        return Ok(());
    }
    let (local, remote) = pieces
        .iter()
        .map(|((s, so), (d, dof), n)| (Desc::new(s.id(), *so, *n), Desc::new(d.id(), *dof, *n)))
        .unzip();
    let req = TransferRequest::new(TransferOp::Write, agent.name(), local, remote);
    Ok(agent.post(req)?.wait().await?)
}

/// Opens a block store on `agent` into `*store_out`. Reads: block_tokens, block_bytes or
/// model, host_blocks, shared_host, disk_path, disk_blocks, disk_admit_min_hits,
/// write_through, host_free_target, lora, salt, serve, advertise, remote, share. With `serve`, the store
/// answers peers as a fabric node (and registers in discovery unless `advertise` is false);
/// with `remote`, fabric nodes found in discovery or added with `kvf_store_add_node` are its
/// remote tier, and with `share` every block it stores is put to them too. Errors are also recorded as the
/// config's last error.
///
/// # Safety
/// `agent` is a live agent; `config` a live config; `store_out` valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_new(
    agent: *const kvf_agent,
    config: *const kvf_config,
    store_out: *mut *mut kvf_store,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let cfg = unsafe { ptr::handle(config, "config") }?;
        let r = (|| {
            // SAFETY: as above.
            let agent = unsafe { ptr::handle(agent, "agent") }?;
            // SAFETY: as above.
            let out = unsafe { Out::new(store_out, "store_out") }?;
            out.set(ptr::into_raw(kvf_store::new(agent, cfg)?));
            Ok(())
        })();
        if let Err(e) = &r {
            cfg.last_error_set(e);
        }
        r
    })
}

/// Another handle on `store` into `*store_out`, naming blocks with `salt` (NUL-terminated
/// UTF-8) folded into `store`'s hash seed, as kvfabric's serving layer folds a request's
/// `cache_salt`: blocks saved through it are found only through handles with the same salt,
/// and its KV events carry the salted hashes. The handle shares the store's tiers, nodes
/// and events; free it with `kvf_store_free` (the store closes with its last handle). An
/// empty salt gives `store`'s own seed. An engine keeps one handle per tenant.
///
/// # Safety
/// `store` is a live store; `salt` a NUL-terminated string; `store_out` valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_salted(
    store: *const kvf_store,
    salt: *const c_char,
    store_out: *mut *mut kvf_store,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let salt = unsafe { ptr::cstr(salt, "salt") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(store_out, "store_out") }?;
        out.set(ptr::into_raw(s.salted(salt)?));
        Ok(())
    })
}

/// Frees a store handle; NULL is allowed. With its last handle the store leaves discovery;
/// operations still running finish.
///
/// # Safety
/// `store` is NULL or a live store, not used again after this call by any thread.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_free(store: *mut kvf_store) {
    // SAFETY: the caller gives the handle back once.
    crate::error::guard_void(|| unsafe { ptr::free(store) })
}

/// Copies the text of the last failed call on `store` (NUL-terminated, truncated to fit).
///
/// # Safety
/// `store` is a live store; `buf` is valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_last_error(
    store: *const kvf_store,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { ptr::handle(store, "store") }?;
        // SAFETY: the caller's contract.
        unsafe { crate::ptr::write_text(&h.last_error.get(), buf, cap, len_out) }
    })
}

/// Writes the store's tokens per block and bytes per block.
///
/// # Safety
/// `store` is a live store; the out-parameters are valid for one write each.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_block_info(
    store: *const kvf_store,
    block_tokens_out: *mut u32,
    block_bytes_out: *mut u64,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let s = unsafe { ptr::handle(store, "store") }?;
        // SAFETY: as above.
        let t = unsafe { Out::new(block_tokens_out, "block_tokens_out") }?;
        // SAFETY: as above.
        let b = unsafe { Out::new(block_bytes_out, "block_bytes_out") }?;
        t.set(s.hasher.block_tokens().get());
        b.set(s.store.block_bytes());
        Ok(())
    })
}

/// The sequence hashes of the full blocks of `tokens` (what KV events and the router use)
/// into `hashes` (`cap` entries); their count into `*n_out`. `KVF_BUFFER_TOO_SMALL` writes
/// the count needed.
///
/// # Safety
/// `store` is a live store; `tokens` valid for `n_tokens` reads; `hashes` for `cap` writes;
/// `n_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_hashes(
    store: *const kvf_store,
    tokens: *const u32,
    n_tokens: usize,
    hashes: *mut u64,
    cap: usize,
    n_out: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let tokens = unsafe { ptr::slice(tokens, n_tokens, "tokens") }?;
        // SAFETY: as above.
        let buf = unsafe { OutBuf::new(hashes, cap, "hashes") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(n_out, "n_out") }?;
        let h: Vec<u64> = s.hasher.sequence_hashes(tokens).into_iter().map(|h| h.0).collect();
        out.set(h.len());
        if h.len() > buf.cap() {
            return Err(FfiError::new(
                kvf_result::KVF_BUFFER_TOO_SMALL,
                format!("{} hashes, room for {}", h.len(), buf.cap()),
            ));
        }
        buf.write(&h);
        Ok(())
    })
}

/// Looks up the full blocks of `tokens` (hashed here, as the store hashes them): the length
/// of the leading run held in some tier into `*hits_out`, and the tier of each (`KVF_TIER_*`)
/// into `tiers` (at most `tiers_cap`; NULL with 0 to get the count only). Asks the remote
/// tier too when configured (within the deadline). Counts hits and prefetches disk blocks
/// into host memory.
///
/// # Safety
/// `store` is a live store; `tokens` valid for `n_tokens` reads; `tiers` for `tiers_cap`
/// writes; `hits_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_lookup(
    store: *const kvf_store,
    tokens: *const u32,
    n_tokens: usize,
    tiers: *mut u8,
    tiers_cap: usize,
    hits_out: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let tokens = unsafe { ptr::slice(tokens, n_tokens, "tokens") }?;
        // SAFETY: as above.
        let buf = unsafe { OutBuf::new(tiers, tiers_cap, "tiers") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(hits_out, "hits_out") }?;
        let found: Vec<u8> = s.lookup(tokens)?.into_iter().map(tier_code).collect();
        buf.write(&found[..found.len().min(buf.cap())]);
        out.set(found.len());
        Ok(())
    })
}

type Move = fn(&kvf_store, &[u32], usize, &[u32], &[kvf_segment]) -> Result<kvf_op, FfiError>;

/// The body of `kvf_store_save` and `kvf_store_load`.
///
/// # Safety
/// As `kvf_store_save`.
#[allow(clippy::too_many_arguments)]
unsafe fn start_move(
    store: *const kvf_store,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    block_ids: *const u32,
    n_blocks: usize,
    segments: *const kvf_segment,
    n_segments: usize,
    op_out: *mut *mut kvf_op,
    start: Move,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let out = unsafe { Out::new(op_out, "op_out") }?;
        // SAFETY: as above.
        let tokens = unsafe { ptr::slice(tokens, n_tokens, "tokens") }?;
        // SAFETY: as above.
        let ids = unsafe { ptr::slice(block_ids, n_blocks, "block_ids") }?;
        // SAFETY: as above.
        let segs = unsafe { ptr::slice(segments, n_segments, "segments") }?;
        out.set(ptr::into_raw(start(s, tokens, first_block, ids, segs)?));
        Ok(())
    })
}

/// Starts storing the full blocks `first_block .. first_block + n_blocks` of `tokens` from
/// the caller's blocks `block_ids[0..n_blocks]`, laid out as `segments` describe. Blocks
/// already stored are skipped; the op's count is the blocks newly stored. Their addresses
/// are checked now (`KVF_NOT_FOUND`, `KVF_OUT_OF_BOUNDS`, `KVF_INVALID_ARGUMENT`); more
/// blocks than the host tier can free fails with `KVF_FULL` and stores none. The caller's
/// blocks must not change until the op finished.
///
/// # Safety
/// `store` is a live store; `tokens` valid for `n_tokens` reads, `block_ids` for `n_blocks`,
/// `segments` for `n_segments`; `op_out` for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_save(
    store: *const kvf_store,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    block_ids: *const u32,
    n_blocks: usize,
    segments: *const kvf_segment,
    n_segments: usize,
    op_out: *mut *mut kvf_op,
) -> kvf_result {
    // SAFETY: forwarded contract.
    unsafe {
        start_move(
            store,
            tokens,
            n_tokens,
            first_block,
            block_ids,
            n_blocks,
            segments,
            n_segments,
            op_out,
            kvf_store::save,
        )
    }
}

/// Starts loading the full blocks `first_block .. first_block + n_blocks` of `tokens` into
/// the caller's blocks `block_ids[0..n_blocks]`, laid out as `segments` describe, from
/// whichever tier holds them (disk and remote blocks pass through host memory). The op's
/// count is the blocks loaded: the leading run found, which is fewer than `n_blocks` when
/// some were evicted since the lookup. Addresses are checked now.
///
/// # Safety
/// As `kvf_store_save`.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_load(
    store: *const kvf_store,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    block_ids: *const u32,
    n_blocks: usize,
    segments: *const kvf_segment,
    n_segments: usize,
    op_out: *mut *mut kvf_op,
) -> kvf_result {
    // SAFETY: forwarded contract.
    unsafe {
        start_move(
            store,
            tokens,
            n_tokens,
            first_block,
            block_ids,
            n_blocks,
            segments,
            n_segments,
            op_out,
            kvf_store::load,
        )
    }
}

/// Publishes a `Stored` KV event for blocks the engine holds itself (in `tier`, usually
/// `KVF_TIER_DEVICE`): the full blocks `first_block .. first_block + n_blocks` of `tokens`,
/// with their parent. Events go to the bus (`kv-events`) under the agent's name, in one id
/// sequence with the store's own events, so routers index the engine's blocks too.
///
/// # Safety
/// `store` is a live store; `tokens` valid for `n_tokens` reads.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_publish_stored(
    store: *const kvf_store,
    tokens: *const u32,
    n_tokens: usize,
    first_block: usize,
    n_blocks: usize,
    tier: u32,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let tokens = unsafe { ptr::slice(tokens, n_tokens, "tokens") }?;
        let tier = tier_of(tier)?;
        let full = tokens.len() / s.hasher.block_tokens().as_usize();
        let end = first_block.saturating_add(n_blocks);
        if n_blocks == 0 || end > full {
            return Err(FfiError::invalid(format!(
                "blocks {first_block}..{end} asked, the tokens hold {full} full blocks"
            )));
        }
        let hashes = s.hashes(tokens, end);
        let parent = first_block.checked_sub(1).map(|p| hashes[p]);
        s.sink.publish(KvEvent {
            event_id: 0,
            data: KvEventData::Stored {
                sequence_hashes: hashes[first_block..].to_vec(),
                parent,
                tier,
            },
        });
        Ok(())
    })
}

/// Publishes a `Removed` KV event for blocks (by sequence hash, see `kvf_store_hashes`) the
/// engine no longer holds in `tier`.
///
/// # Safety
/// `store` is a live store; `hashes` valid for `n` reads.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_publish_removed(
    store: *const kvf_store,
    hashes: *const u64,
    n: usize,
    tier: u32,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let hashes = unsafe { ptr::slice(hashes, n, "hashes") }?;
        let tier = tier_of(tier)?;
        if hashes.is_empty() {
            return Err(FfiError::invalid("no hashes given"));
        }
        s.sink.publish(KvEvent {
            event_id: 0,
            data: KvEventData::Removed {
                sequence_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
                tier,
            },
        });
        Ok(())
    })
}

/// Copies the fabric-node info of a store opened with `serve` (what another store passes to
/// `kvf_store_add_node`; opaque bytes) into `buf`. `KVF_BUFFER_TOO_SMALL` writes the size
/// needed; a store that does not serve: `KVF_INVALID_ARGUMENT`.
///
/// # Safety
/// `store` is a live store; `buf` valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_node_info(
    store: *const kvf_store,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        json_out(store, buf, cap, len_out, |s| {
            let node = s.node.as_ref().ok_or_else(|| {
                FfiError::invalid("this store does not serve peers (config key \"serve\")")
            })?;
            serde_json::to_value(node.info())
                .map_err(|e| FfiError::new(kvf_result::KVF_IO, e.to_string()))
        })
    }
}

/// Copies the JSON of what `value` makes of the store into a caller buffer.
///
/// # Safety
/// `store` is NULL or a live store; `buf` valid for `cap` writes; `len_out` for one.
unsafe fn json_out(
    store: *const kvf_store,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
    value: impl FnOnce(&kvf_store) -> Result<serde_json::Value, FfiError>,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let buf = unsafe { OutBuf::new(buf, cap, "buf") }?;
        // SAFETY: as above.
        let out = unsafe { Out::new(len_out, "len_out") }?;
        let bytes = serde_json::to_vec(&value(s)?)
            .map_err(|e| FfiError::new(kvf_result::KVF_IO, e.to_string()))?;
        copy_bytes(&bytes, buf, out)
    })
}

/// Adds a fabric node (bytes from its `kvf_store_node_info`) to a store opened with `remote`
/// (without discovery, or before discovery reports it). Malformed info or another block
/// size: `KVF_INVALID_ARGUMENT`; an unreachable node: `KVF_TRANSFER`.
///
/// # Safety
/// `store` is a live store; `info` valid for `len` reads.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_add_node(
    store: *const kvf_store,
    info: *const u8,
    len: usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        let remote = s.remote.as_ref().ok_or_else(|| {
            FfiError::invalid("this store has no remote tier (config key \"remote\")")
        })?;
        // SAFETY: as above.
        let info = unsafe { node_info_arg(info, len) }?;
        if info.block_bytes != s.store.block_bytes() {
            return Err(FfiError::invalid(format!(
                "node stores {}-byte blocks, this store {}",
                info.block_bytes,
                s.store.block_bytes()
            )));
        }
        let d = s.ctx.deadline;
        s.ctx
            .rt()
            .block_on(async { tokio::time::timeout(d, remote.add_node(&info)).await })
            .map_err(|_| FfiError::new(kvf_result::KVF_TIMED_OUT, "adding the node timed out"))??;
        Ok(())
    })
}

/// Node info bytes (from `kvf_store_node_info`) passed by a caller.
///
/// # Safety
/// `info` valid for `len` reads.
unsafe fn node_info_arg(info: *const u8, len: usize) -> Result<NodeInfo, FfiError> {
    // SAFETY: the caller's contract.
    let bytes = unsafe { ptr::slice(info, len, "info") }?;
    serde_json::from_slice(bytes)
        .map_err(|e| FfiError::invalid(format!("malformed node info: {e}")))
}

/// Makes `store`'s lookups ask the store whose node info this is (bytes from its
/// `kvf_store_node_info`; it may be opened with `advertise` false): the leading run it can
/// provide from its own tiers and its fabric. Called once per node; with several (one per
/// tensor-parallel rank), a block counts only when every node provides it. For an engine
/// whose scheduler runs in another process than the worker that holds the store. A node
/// that fails to answer makes `kvf_store_lookup` fail with `KVF_TRANSFER` (counted in
/// `kvf_store_metrics`): the caller treats the prompt as not cached.
///
/// # Safety
/// `store` is a live store; `info` valid for `len` reads.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_add_lookup_node(
    store: *const kvf_store,
    info: *const u8,
    len: usize,
) -> kvf_result {
    // SAFETY: the caller's contract.
    let store = unsafe { store.as_ref() };
    recorded(store, "store", |s| {
        // SAFETY: as above.
        let info = unsafe { node_info_arg(info, len) }?;
        let name = info.agent.name.clone();
        s.ctx.agent.load_peer(info.agent)?;
        let mut nodes = s.lookup_nodes.lock();
        if !nodes.contains(&name) {
            nodes.push(name);
        }
        Ok(())
    })
}

/// The store's metrics as a JSON object (NUL-free UTF-8) into `buf`: the tiers' occupancy,
/// hits, misses, offloads and onboards, and the lookups answered by lookup nodes and blocks
/// shared with the fabric, with their failures. `KVF_BUFFER_TOO_SMALL` writes the size
/// needed.
///
/// # Safety
/// `store` is a live store; `buf` valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_metrics(
    store: *const kvf_store,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract, passed on.
    unsafe { json_out(store, buf, cap, len_out, |s| Ok(s.metrics_json())) }
}

/// The store's health as a JSON object (NUL-free UTF-8) into `buf`: the health document that
/// `/health` serves (docs/health.schema.json) with this store's parts, `store` (a full disk,
/// corruption found), `transfer` (transfers failed, CUDA, RDMA) and `control_plane`, and the
/// `status` and `reasons` they give. `KVF_BUFFER_TOO_SMALL` writes the size needed.
///
/// # Safety
/// `store` is a live store; `buf` valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_store_health(
    store: *const kvf_store,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        json_out(store, buf, cap, len_out, |s| {
            serde_json::to_value(s.health())
                .map_err(|e| FfiError::invalid(format!("encoding the health document: {e}")))
        })
    }
}
