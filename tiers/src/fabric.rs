//! A KV fabric node (`kvfabric fabric`): a tiered store behind the transfer engine, serving
//! the fabric's protocol ([`crate::remote::protocol`]) to authenticated peers, registered in
//! discovery for the G4 tiers ([`crate::remote::RemoteTier`]) of other processes to find.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::{Agent, RpcHandler};
use kvfabric::control::{ControlError, Discovery, Instance, Registration};
use kvfabric::hash::SequenceHash;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest};

use crate::remote::peers::PeerStats;
use crate::remote::protocol::{encode, BlockLoc, NodeInfo, Present, Request, Tiers, FABRIC_KIND};
use crate::store::{StoreError, TieredStore};

/// The server side: a store behind an agent.
#[derive(Debug, Clone)]
pub struct FabricNode {
    agent: Agent,
    store: TieredStore,
    transfer_deadline: Duration,
    /// A worker's store serving its peers' pulls (None: a fabric node).
    peer: Option<Arc<PeerServing>>,
}

/// How much of a worker's link and reads its peers' pulls may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeerLimits {
    /// Bytes per second sent to peers at most (None: as fast as the link goes).
    pub bytes_per_s: Option<f64>,
    /// Blocks pinned for peers at once at most (blocks read from disk count: each is read
    /// into a host slot first). A pull past it is served in part, or refused as busy.
    pub blocks_max: u32,
}

impl PeerLimits {
    /// At most `share` (0..=1) of a host tier of `host_blocks` pinned for peers, and of a link
    /// of `link_bytes_per_s` (None: unpaced).
    pub fn share(share: f64, host_blocks: u32, link_bytes_per_s: Option<f64>) -> Self {
        let share = if share.is_finite() { share.clamp(0.0, 1.0) } else { 0.0 };
        PeerLimits {
            bytes_per_s: link_bytes_per_s.filter(|r| *r > 0.0).map(|r| r * share.max(1e-3)),
            blocks_max: ((f64::from(host_blocks) * share) as u32).max(1),
        }
    }
}

#[derive(Debug)]
struct PeerServing {
    limits: PeerLimits,
    pins: Arc<tokio::sync::Semaphore>,
    /// When the link is next free for peers (pacing at `bytes_per_s`).
    next_free: parking_lot::Mutex<tokio::time::Instant>,
    stats: Arc<PeerStats>,
}

/// A pull paced to start later than this is refused as busy (the puller computes instead).
const PACE_WAIT_MAX: Duration = Duration::from_millis(500);

/// A GET that takes longer than this is logged (with where its time went).
const SLOW_GET: Duration = Duration::from_secs(1);

impl FabricNode {
    /// Serves `store` to peers of `agent` (installs itself as the agent's RPC handler).
    pub fn serve(agent: Agent, store: TieredStore, transfer_deadline: Duration) -> Arc<Self> {
        let node =
            Arc::new(FabricNode { agent: agent.clone(), store, transfer_deadline, peer: None });
        agent.set_rpc_handler(node.clone());
        node
    }

    /// Serves a worker's `store` to its peers' pulls (installs itself as the agent's RPC
    /// handler): read-only (`PUT` is refused), within `limits`, counted in `stats`. Remove it
    /// with [`Agent::clear_rpc_handler`] before the agent is dropped.
    pub fn serve_peers(
        agent: Agent,
        store: TieredStore,
        transfer_deadline: Duration,
        limits: PeerLimits,
        stats: Arc<PeerStats>,
    ) -> Arc<Self> {
        let peer = PeerServing {
            limits,
            pins: Arc::new(tokio::sync::Semaphore::new(limits.blocks_max.max(1) as usize)),
            next_free: parking_lot::Mutex::new(tokio::time::Instant::now()),
            stats,
        };
        let node = Arc::new(FabricNode {
            agent: agent.clone(),
            store,
            transfer_deadline,
            peer: Some(Arc::new(peer)),
        });
        agent.set_rpc_handler(node.clone());
        node
    }

    /// A peer's `GET`, within the worker's serving share: how many of `n` blocks it may serve
    /// now (0: busy), the pins it holds while it does, and where it paced.
    async fn admit_peer(
        &self,
        peer: &PeerServing,
        n: usize,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let free = peer.pins.available_permits().min(n);
        if free == 0 {
            return None;
        }
        let permit = peer.pins.clone().try_acquire_many_owned(free as u32).ok()?;
        if let Some(rate) = peer.limits.bytes_per_s {
            let bytes = free as f64 * self.store.block_bytes() as f64;
            let start = {
                let now = tokio::time::Instant::now();
                let mut next = peer.next_free.lock();
                let start = (*next).max(now);
                if start - now > PACE_WAIT_MAX {
                    return None;
                }
                *next = start + Duration::from_secs_f64(bytes / rate);
                start
            };
            tokio::time::sleep_until(start).await;
        }
        Some(permit)
    }

    /// What to publish in discovery.
    pub fn info(&self) -> NodeInfo {
        NodeInfo { agent: self.agent.metadata(), block_bytes: self.store.block_bytes() }
    }

    /// The store.
    pub fn store(&self) -> &TieredStore {
        &self.store
    }

    /// Registers the node in discovery as `name` (kind [`FABRIC_KIND`]), under a lease of
    /// `ttl` kept alive until the registration is dropped or revoked.
    pub async fn register(
        &self,
        discovery: &dyn Discovery,
        name: &str,
        ttl: Duration,
    ) -> Result<Registration, ControlError> {
        let metadata = serde_json::to_value(self.info()).map_err(|e| ControlError::Malformed {
            what: "fabric node info",
            message: e.to_string(),
        })?;
        let instance = Instance { kind: FABRIC_KIND.into(), id: name.to_string(), metadata };
        let registration = discovery.register(instance, ttl).await?;
        tracing::info!(node = %name, addr = %self.agent.advertised_addr(), "fabric node registered in discovery");
        Ok(registration)
    }

    async fn get(&self, from: &str, mut blocks: Vec<BlockLoc>) -> Result<Present, String> {
        let asked = blocks.len();
        let mut permit = None;
        if let Some(peer) = &self.peer {
            match self.admit_peer(peer, blocks.len()).await {
                Some(p) => {
                    blocks.truncate(p.num_permits());
                    permit = Some(p);
                }
                None => {
                    peer.stats.served_busy.fetch_add(1, Ordering::Relaxed);
                    return Ok(Present { present: vec![false; asked], busy: true });
                }
            }
        }
        let mut present = self.get_blocks(from, blocks).await?;
        drop(permit);
        let busy = present.len() < asked;
        if let Some(peer) = &self.peer {
            let n = present.iter().filter(|&&s| s).count() as u64;
            peer.stats.served.fetch_add(1, Ordering::Relaxed);
            peer.stats.served_blocks.fetch_add(n, Ordering::Relaxed);
            peer.stats.served_bytes.fetch_add(n * self.store.block_bytes(), Ordering::Relaxed);
            if busy {
                peer.stats.served_busy.fetch_add(1, Ordering::Relaxed);
            }
        }
        present.resize(asked, false);
        Ok(Present { present, busy })
    }

    async fn get_blocks(&self, from: &str, blocks: Vec<BlockLoc>) -> Result<Vec<bool>, String> {
        let mut served = vec![false; blocks.len()];
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        // One pinning call for the leading run (the common case: every block held), then
        // one per block after the first miss.
        let started = std::time::Instant::now();
        let all: Vec<SequenceHash> = blocks.iter().map(|b| b.hash).collect();
        let mut refs: Vec<crate::store::BlockRef> = self.store.get(&all).await.unwrap_or_default();
        let run = refs.len();
        for b in &blocks[run..] {
            if let Ok(mut r) = self.store.get(&[b.hash]).await {
                refs.extend(r.pop());
            }
        }
        // Pair refs with their blocks: refs are in block order, misses skipped.
        let mut k = 0;
        for (i, b) in blocks.iter().enumerate() {
            let Some(r) = refs.get(k) else { break };
            if r.hash() != b.hash {
                continue;
            }
            local.push(Desc::new(r.region().id(), r.offset(), r.len()));
            remote.push(Desc::new(b.region, b.offset, r.len()));
            served[i] = true;
            k += 1;
        }
        if !local.is_empty() {
            let req = TransferRequest::new(TransferOp::Write, from, local, remote)
                .with_checksum()
                .with_deadline(self.transfer_deadline);
            let h = self.agent.post(req).map_err(|e| e.to_string())?;
            // The source blocks stay pinned until no byte of the transfer can be read any
            // more, even if this handler is dropped while it runs.
            let pinned = started.elapsed();
            let mut guard = Quarantine { handle: Some(h.clone()), slots: refs };
            let outcome = h.wait().await;
            let (n, took) = (served.iter().filter(|&&s| s).count(), started.elapsed());
            if let Err(e) = &outcome {
                tracing::warn!(peer = from, blocks = n, ?pinned, ?took, error = %e,
                    "fabric node: sending blocks to a peer failed");
            } else if took > SLOW_GET {
                tracing::warn!(
                    peer = from,
                    blocks = n,
                    ?pinned,
                    ?took,
                    "fabric node: sending blocks to a peer was slow"
                );
            }
            outcome.map_err(|e| e.to_string())?;
            guard.handle = None;
        }
        Ok(served)
    }

    async fn put(&self, from: &str, blocks: Vec<BlockLoc>) -> Result<Vec<bool>, String> {
        let mut stored = vec![false; blocks.len()];
        let mut slots = Vec::new();
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        for (i, b) in blocks.iter().enumerate() {
            match self.store.allocate(b.hash, b.parent).await {
                Ok(w) => {
                    local.push(Desc::new(w.region().id(), w.offset(), w.len()));
                    remote.push(Desc::new(b.region, b.offset, w.len()));
                    slots.push((i, w));
                }
                Err(StoreError::AlreadyStored(_)) => stored[i] = true,
                Err(StoreError::BeingWritten(_)) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        if !local.is_empty() {
            let req = TransferRequest::new(TransferOp::Read, from, local, remote)
                .with_checksum()
                .with_deadline(self.transfer_deadline);
            let h = self.agent.post(req).map_err(|e| e.to_string())?;
            // The reservations are released only once no byte can land in them any more,
            // even if this handler is dropped (its deadline) while the transfer runs.
            let mut guard =
                Quarantine { handle: Some(h.clone()), slots: std::mem::take(&mut slots) };
            let outcome = h.wait().await;
            slots = std::mem::take(&mut guard.slots);
            if let Err(e) = outcome {
                guard.slots = slots;
                return Err(e.to_string());
            }
            guard.handle = None;
        }
        for (i, w) in slots {
            w.commit_unpinned();
            stored[i] = true;
        }
        Ok(stored)
    }
}

impl RpcHandler for FabricNode {
    fn handle<'a>(
        &'a self,
        from: &'a str,
        method: u16,
        body: Vec<u8>,
    ) -> kvfabric::agent::RpcReply<'a> {
        Box::pin(async move {
            match Request::decode(method, &body)? {
                Request::Hello(h) => {
                    if h.metadata.name != from {
                        return Err(format!("metadata of {:?} sent by {from:?}", h.metadata.name));
                    }
                    self.agent.load_peer(h.metadata).map_err(|e| e.to_string())?;
                    Ok(Vec::new())
                }
                Request::Lookup(l) => {
                    let present = l
                        .hashes
                        .iter()
                        .map(|h| !self.store.lookup_prefix(&[*h]).is_empty())
                        .collect();
                    Ok(encode(&Present { present, busy: false }))
                }
                Request::Prefix(l) => {
                    // The node's own tiers, then what its remote tier adds (other nodes
                    // answer with LOOKUP: one hop, never a loop).
                    let tiers = self.store.lookup_prefix_with_remote(&l.hashes).await;
                    Ok(encode(&Tiers { tiers }))
                }
                Request::Get(b) => Ok(encode(&self.get(from, b.blocks).await?)),
                Request::Put(_) if self.peer.is_some() => {
                    Err("a worker's store takes no blocks from its peers".into())
                }
                Request::Put(b) => {
                    Ok(encode(&Present { present: self.put(from, b.blocks).await?, busy: false }))
                }
            }
        })
    }
}

/// Holds reservations a transfer targets until the transfer is quiesced: dropped early
/// (an error, or the handler's future dropped), it cancels the transfer and releases them
/// only after no byte of it can land.
struct Quarantine<T: Send + 'static> {
    handle: Option<kvfabric::transfer::TransferHandle>,
    slots: Vec<T>,
}

impl<T: Send + 'static> Drop for Quarantine<T> {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        match self.handle.take() {
            Some(h) if !slots.is_empty() => {
                h.cancel();
                tokio::spawn(async move {
                    h.quiesced().await;
                    drop(slots);
                });
            }
            _ => drop(slots),
        }
    }
}
