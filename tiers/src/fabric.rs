//! The KV fabric: standalone nodes (`kvfabric fabric`) that hold blocks in a tiered store
//! behind the transfer engine, and the G4 remote tier, their client.
//!
//! A node answers four RPCs from authenticated peers (bodies are JSON):
//! - `HELLO {metadata}`: the client's agent metadata, so the node can move bytes to and from
//!   the client's registered memory;
//! - `LOOKUP {hashes}` → which blocks it holds;
//! - `GET {blocks: [(hash, region, offset)]}` → it WRITEs each block it holds straight into
//!   the client's region (checksummed) and says which it served;
//! - `PUT {blocks: [(hash, parent, region, offset)]}` → it READs each block it lacks
//!   straight out of the client's region into a new slot (checksummed) and commits it.
//!
//! The client ([`RemoteTier`]) follows the nodes through discovery and places each block on
//! a node by consistent hashing (64 virtual points per node on a 64-bit ring). A node that
//! leaves is dropped from the ring at once; its blocks count as misses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::{Agent, AgentMetadata, RpcHandler};
use kvfabric::events::TierKind;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionId;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest};
use parking_lot::RwLock;
use xxhash_rust::xxh3::xxh3_64;

use crate::store::{StoreError, TieredStore};

/// RPC method numbers of a fabric node.
pub mod method {
    /// Client metadata.
    pub const HELLO: u16 = 1;
    /// Which blocks the node holds.
    pub const LOOKUP: u16 = 2;
    /// Write blocks into the client's memory.
    pub const GET: u16 = 3;
    /// Read blocks out of the client's memory.
    pub const PUT: u16 = 4;
}

/// Kind of fabric nodes in discovery.
pub const FABRIC_KIND: &str = "fabric";

/// What a fabric node publishes in discovery.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeInfo {
    /// The node's agent metadata (transfer address, exported regions).
    pub agent: AgentMetadata,
    /// Bytes per block it stores.
    pub block_bytes: u64,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Hello {
    metadata: AgentMetadata,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Lookup {
    hashes: Vec<SequenceHash>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Present {
    present: Vec<bool>,
}

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct BlockLoc {
    hash: SequenceHash,
    parent: Option<SequenceHash>,
    region: RegionId,
    offset: u64,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Blocks {
    blocks: Vec<BlockLoc>,
}

/// Most blocks in one GET or PUT.
pub const BLOCKS_PER_CALL_MAX: usize = 1024;

fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("malformed request: {e}"))
}

fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Plain data with string keys always serializes.
    serde_json::to_vec(v).unwrap_or_default()
}

/// The server side: a store behind an agent.
#[derive(Debug, Clone)]
pub struct FabricNode {
    agent: Agent,
    store: TieredStore,
    transfer_deadline: Duration,
}

impl FabricNode {
    /// Serves `store` to peers of `agent` (installs itself as the agent's RPC handler).
    pub fn serve(agent: Agent, store: TieredStore, transfer_deadline: Duration) -> Arc<Self> {
        let node = Arc::new(FabricNode { agent: agent.clone(), store, transfer_deadline });
        agent.set_rpc_handler(node.clone());
        node
    }

    /// What to publish in discovery.
    pub fn info(&self) -> NodeInfo {
        NodeInfo { agent: self.agent.metadata(), block_bytes: self.store.block_bytes() }
    }

    /// The store.
    pub fn store(&self) -> &TieredStore {
        &self.store
    }

    async fn get(&self, from: &str, blocks: Vec<BlockLoc>) -> Result<Vec<bool>, String> {
        if blocks.len() > BLOCKS_PER_CALL_MAX {
            return Err(format!("at most {BLOCKS_PER_CALL_MAX} blocks per call"));
        }
        let mut served = vec![false; blocks.len()];
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        // One pinning call for the leading run (the common case: every block held), then
        // one per block after the first miss.
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
            let mut guard = Quarantine { handle: Some(h.clone()), slots: refs };
            h.wait().await.map_err(|e| e.to_string())?;
            guard.handle = None;
        }
        Ok(served)
    }

    async fn put(&self, from: &str, blocks: Vec<BlockLoc>) -> Result<Vec<bool>, String> {
        if blocks.len() > BLOCKS_PER_CALL_MAX {
            return Err(format!("at most {BLOCKS_PER_CALL_MAX} blocks per call"));
        }
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
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, String>> + Send + 'a>>
    {
        Box::pin(async move {
            match method {
                method::HELLO => {
                    let h: Hello = decode(&body)?;
                    if h.metadata.name != from {
                        return Err(format!("metadata of {:?} sent by {from:?}", h.metadata.name));
                    }
                    self.agent.load_peer(h.metadata).map_err(|e| e.to_string())?;
                    Ok(Vec::new())
                }
                method::LOOKUP => {
                    let l: Lookup = decode(&body)?;
                    let present = l
                        .hashes
                        .iter()
                        .map(|h| !self.store.lookup_prefix(&[*h]).is_empty())
                        .collect();
                    Ok(encode(&Present { present }))
                }
                method::GET => {
                    let b: Blocks = decode(&body)?;
                    Ok(encode(&Present { present: self.get(from, b.blocks).await? }))
                }
                method::PUT => {
                    let b: Blocks = decode(&body)?;
                    Ok(encode(&Present { present: self.put(from, b.blocks).await? }))
                }
                other => Err(format!("unknown fabric method {other}")),
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

/// Why a remote-tier operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// No fabric node is known.
    #[error("no fabric node available")]
    NoNode,
    /// A node failed the call (dead, slow, or refused).
    #[error("fabric node {node}: {message}")]
    Node {
        /// The node.
        node: String,
        /// What went wrong.
        message: String,
    },
    /// A node's answer is not what it should be.
    #[error("malformed answer from {0}")]
    Malformed(String),
}

const VIRTUAL_POINTS: u32 = 64;

/// The G4 remote tier: a client of the fabric nodes.
#[derive(Debug, Clone)]
pub struct RemoteTier {
    agent: Agent,
    ring: Arc<RwLock<BTreeMap<u64, String>>>,
    deadline: Duration,
    /// Per node, a digest of the metadata we last introduced ourselves with: regions
    /// registered later are announced again before the node must address them.
    announced: Arc<RwLock<std::collections::HashMap<String, u64>>>,
}

impl RemoteTier {
    /// A client with no nodes yet; `deadline` bounds every call.
    pub fn new(agent: Agent, deadline: Duration) -> Self {
        RemoteTier {
            agent,
            ring: Arc::new(RwLock::new(BTreeMap::new())),
            deadline,
            announced: Arc::new(RwLock::new(std::collections::HashMap::new())),
        }
    }

    /// Adds a node (discovery said it joined): loads its metadata and introduces ourselves.
    pub async fn add_node(&self, info: &NodeInfo) -> Result<(), RemoteError> {
        let name = info.agent.name.clone();
        let err = |m: String| RemoteError::Node { node: name.clone(), message: m };
        self.agent.load_peer(info.agent.clone()).map_err(|e| err(e.to_string()))?;
        let hello = encode(&Hello { metadata: self.agent.metadata() });
        self.agent
            .call(&name, method::HELLO, hello, self.deadline)
            .await
            .map_err(|e| err(e.to_string()))?;
        let mut ring = self.ring.write();
        for i in 0..VIRTUAL_POINTS {
            ring.insert(xxh3_64(format!("{name}#{i}").as_bytes()), name.clone());
        }
        Ok(())
    }

    /// Introduces this agent (its current metadata) to a node, if not done since its last
    /// change.
    async fn hello(&self, node: &str) -> Result<(), RemoteError> {
        let metadata = self.agent.metadata();
        let digest = xxh3_64(&serde_json::to_vec(&metadata.regions).unwrap_or_default());
        if self.announced.read().get(node) == Some(&digest) {
            return Ok(());
        }
        let hello = encode(&Hello { metadata });
        self.agent
            .call(node, method::HELLO, hello, self.deadline)
            .await
            .map_err(|e| RemoteError::Node { node: node.to_string(), message: e.to_string() })?;
        self.announced.write().insert(node.to_string(), digest);
        Ok(())
    }

    /// Drops a node (discovery said it left): its blocks count as misses from now on.
    pub fn remove_node(&self, name: &str) {
        self.announced.write().remove(name);
        self.ring.write().retain(|_, n| n != name);
        self.agent.remove_peer(name);
    }

    /// The nodes on the ring.
    pub fn nodes(&self) -> Vec<String> {
        let mut v: Vec<String> = self.ring.read().values().cloned().collect();
        v.sort();
        v.dedup();
        v
    }

    /// The node responsible for a block: the first ring point at or after the block's
    /// position (its sequence hash, mixed once more so that any key pattern spreads).
    pub fn node_for(&self, hash: SequenceHash) -> Option<String> {
        let pos = xxh3_64(&hash.0.to_le_bytes());
        let ring = self.ring.read();
        ring.range(pos..).next().or_else(|| ring.iter().next()).map(|(_, n)| n.clone())
    }

    fn group(
        &self,
        hashes: impl Iterator<Item = (usize, SequenceHash)>,
    ) -> Result<BTreeMap<String, Vec<usize>>, RemoteError> {
        let mut by_node: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, h) in hashes {
            by_node.entry(self.node_for(h).ok_or(RemoteError::NoNode)?).or_default().push(i);
        }
        Ok(by_node)
    }

    async fn call(
        &self,
        node: &str,
        method: u16,
        body: Vec<u8>,
        n: usize,
    ) -> Result<Vec<bool>, RemoteError> {
        let reply =
            self.agent.call(node, method, body, self.deadline).await.map_err(|e| {
                RemoteError::Node { node: node.to_string(), message: e.to_string() }
            })?;
        let p: Present =
            serde_json::from_slice(&reply).map_err(|_| RemoteError::Malformed(node.to_string()))?;
        if p.present.len() != n {
            return Err(RemoteError::Malformed(node.to_string()));
        }
        Ok(p.present)
    }

    /// Which blocks the fabric holds (a dead node's blocks are misses).
    pub async fn lookup(&self, hashes: &[SequenceHash]) -> Result<Vec<bool>, RemoteError> {
        let mut out = vec![false; hashes.len()];
        for (node, idx) in self.group(hashes.iter().copied().enumerate())? {
            let body = encode(&Lookup { hashes: idx.iter().map(|&i| hashes[i]).collect() });
            if let Ok(present) = self.call(&node, method::LOOKUP, body, idx.len()).await {
                for (k, &i) in idx.iter().enumerate() {
                    out[i] = present[k];
                }
            }
        }
        Ok(out)
    }

    /// Fetches blocks into `dst` (this agent's region, offsets per block); says which were
    /// served. A node that fails makes its blocks misses and reports the error if nothing
    /// else was served.
    pub async fn get(
        &self,
        hashes: &[SequenceHash],
        dst: &[(RegionId, u64)],
    ) -> Result<Vec<bool>, RemoteError> {
        self.move_blocks(method::GET, hashes, None, dst).await
    }

    /// Stores blocks from `src` (this agent's region, offsets per block) with their parents;
    /// says which the fabric now holds.
    pub async fn put(
        &self,
        hashes: &[SequenceHash],
        parents: &[Option<SequenceHash>],
        src: &[(RegionId, u64)],
    ) -> Result<Vec<bool>, RemoteError> {
        self.move_blocks(method::PUT, hashes, Some(parents), src).await
    }

    async fn move_blocks(
        &self,
        method: u16,
        hashes: &[SequenceHash],
        parents: Option<&[Option<SequenceHash>]>,
        locs: &[(RegionId, u64)],
    ) -> Result<Vec<bool>, RemoteError> {
        if locs.len() != hashes.len() || parents.is_some_and(|p| p.len() != hashes.len()) {
            return Err(RemoteError::Malformed("caller: lengths differ".into()));
        }
        let mut out = vec![false; hashes.len()];
        let mut first_err = None;
        for (node, idx) in self.group(hashes.iter().copied().enumerate())? {
            if let Err(e) = self.hello(&node).await {
                first_err.get_or_insert(e);
                continue;
            }
            for chunk in idx.chunks(BLOCKS_PER_CALL_MAX) {
                let blocks: Vec<BlockLoc> = chunk
                    .iter()
                    .map(|&i| BlockLoc {
                        hash: hashes[i],
                        parent: parents.and_then(|p| p[i]),
                        region: locs[i].0,
                        offset: locs[i].1,
                    })
                    .collect();
                match self.call(&node, method, encode(&Blocks { blocks }), chunk.len()).await {
                    Ok(done) => {
                        for (k, &i) in chunk.iter().enumerate() {
                            out[i] = done[k];
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) if !out.iter().any(|&b| b) => Err(e),
            _ => Ok(out),
        }
    }

    /// The deadline of each call.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The tier this client is.
    pub fn tier(&self) -> TierKind {
        TierKind::Remote
    }
}
