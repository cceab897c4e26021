//! The G4 remote tier: a client of the KV fabric's nodes ([`crate::fabric::FabricNode`]).
//!
//! It follows the nodes through discovery ([`RemoteTier::follow`]) and places each block on a
//! node by consistent hashing (64 virtual points per node on a 64-bit ring). A node that
//! leaves is dropped from the ring at once; its blocks count as misses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::Agent;
use kvfabric::control::{ControlError, Discovery, DiscoveryEvent, Instance};
use kvfabric::events::TierKind;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionId;
use parking_lot::RwLock;
use xxhash_rust::xxh3::xxh3_64;

pub mod peers;
pub mod protocol;

use protocol::{
    encode, method, BlockLoc, Blocks, Hello, Lookup, NodeInfo, Present, Tiers, BLOCKS_PER_CALL_MAX,
    FABRIC_KIND, LOOKUP_HASHES_MAX,
};

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

    /// Whether no node is known (every block is a miss).
    pub fn is_empty(&self) -> bool {
        self.ring.read().is_empty()
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
            for chunk in idx.chunks(LOOKUP_HASHES_MAX) {
                let body = encode(&Lookup { hashes: chunk.iter().map(|&i| hashes[i]).collect() });
                if let Ok(present) = self.call(&node, method::LOOKUP, body, chunk.len()).await {
                    for (k, &i) in chunk.iter().enumerate() {
                        out[i] = present[k];
                    }
                }
            }
        }
        Ok(out)
    }

    /// Asks one node (known to the agent, on the ring or not) which leading run of `hashes`
    /// it can provide, and from which tier each (its own tiers, then its remote tier).
    pub async fn prefix_at(
        agent: &Agent,
        node: &str,
        hashes: &[SequenceHash],
        deadline: Duration,
    ) -> Result<Vec<TierKind>, RemoteError> {
        let mut out = Vec::with_capacity(hashes.len());
        for chunk in hashes.chunks(LOOKUP_HASHES_MAX) {
            let body = encode(&Lookup { hashes: chunk.to_vec() });
            let reply = agent.call(node, method::PREFIX, body, deadline).await.map_err(|e| {
                RemoteError::Node { node: node.to_string(), message: e.to_string() }
            })?;
            let t: Tiers = serde_json::from_slice(&reply)
                .map_err(|_| RemoteError::Malformed(node.to_string()))?;
            if t.tiers.len() > chunk.len() {
                return Err(RemoteError::Malformed(node.to_string()));
            }
            let whole = t.tiers.len() == chunk.len();
            out.extend(t.tiers);
            if !whole {
                break;
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

    /// Follows the fabric nodes in `discovery`: adds those there now and those that join
    /// (when they store blocks of this tier's size, `block_bytes`), drops those that leave.
    /// `own` is this process's own node name, if it serves one, never added. The task ends
    /// when the watch does; abort it to stop following.
    pub async fn follow(
        &self,
        discovery: &dyn Discovery,
        block_bytes: u64,
        own: Option<String>,
    ) -> Result<tokio::task::JoinHandle<()>, ControlError> {
        let (now, mut changes) = discovery.watch(FABRIC_KIND).await?;
        let this = self.clone();
        let join = move |inst: Instance| {
            let (this, own) = (this.clone(), own.clone());
            async move {
                if own.as_deref() == Some(inst.id.as_str()) {
                    return;
                }
                let info = match serde_json::from_value::<NodeInfo>(inst.metadata) {
                    Ok(info) => info,
                    Err(e) => {
                        tracing::warn!(node = %inst.id, error = %e, "ignoring a fabric node with unreadable metadata");
                        return;
                    }
                };
                if info.block_bytes != block_bytes {
                    tracing::info!(node = %inst.id, theirs = info.block_bytes, ours = block_bytes,
                        "ignoring a fabric node of another block size (another model, dtype or \
                         --block-tokens): it cannot hold this worker's blocks");
                    return;
                }
                match this.add_node(&info).await {
                    Ok(()) => tracing::info!(node = %inst.id, "fabric node joined"),
                    Err(e) => {
                        tracing::warn!(node = %inst.id, error = %e, "cannot reach a fabric node")
                    }
                }
            }
        };
        for inst in now {
            join(inst).await;
        }
        let this = self.clone();
        Ok(tokio::spawn(async move {
            while let Some(change) = changes.recv().await {
                match change {
                    DiscoveryEvent::Joined(inst) => join(inst).await,
                    DiscoveryEvent::Left { id, .. } => {
                        if this.nodes().contains(&id) {
                            tracing::info!(node = %id, "fabric node left");
                        }
                        this.remove_node(&id);
                    }
                }
            }
        }))
    }

    /// Forgets that this agent introduced itself to `node` (a new process under its name).
    pub(crate) fn forget(&self, node: &str) {
        self.announced.write().remove(node);
    }

    /// Loads a peer's metadata into the agent unless it holds exactly that already.
    pub(crate) fn ensure_peer(
        &self,
        md: &kvfabric::agent::AgentMetadata,
    ) -> Result<(), RemoteError> {
        if self.agent.peer_metadata(&md.name).as_ref() == Some(md) {
            return Ok(());
        }
        self.forget(&md.name);
        self.agent
            .load_peer(md.clone())
            .map_err(|e| RemoteError::Node { node: md.name.clone(), message: e.to_string() })
    }

    /// Fetches blocks from one named node (a peer worker's store, not the ring's choice) into
    /// `dst`, within `deadline` in all: which were served, and whether the node said it was
    /// too busy to serve (some of) them.
    pub(crate) async fn get_from(
        &self,
        node: &str,
        hashes: &[SequenceHash],
        dst: &[(RegionId, u64)],
        deadline: Duration,
    ) -> Result<(Vec<bool>, bool), RemoteError> {
        if dst.len() != hashes.len() {
            return Err(RemoteError::Malformed("caller: lengths differ".into()));
        }
        let timed_out =
            || RemoteError::Node { node: node.to_string(), message: "timed out".into() };
        let until = tokio::time::Instant::now() + deadline;
        tokio::time::timeout_at(until, self.hello(node)).await.map_err(|_| timed_out())??;
        let mut out = vec![false; hashes.len()];
        let mut busy = false;
        for (c, chunk) in hashes.chunks(BLOCKS_PER_CALL_MAX).enumerate() {
            let base = c * BLOCKS_PER_CALL_MAX;
            let blocks: Vec<BlockLoc> = chunk
                .iter()
                .enumerate()
                .map(|(k, &hash)| BlockLoc {
                    hash,
                    parent: None,
                    region: dst[base + k].0,
                    offset: dst[base + k].1,
                })
                .collect();
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let reply = self
                .agent
                .call(node, method::GET, encode(&Blocks { blocks }), left)
                .await
                .map_err(|e| match e {
                    kvfabric::transfer::TransferError::TimedOut(_) => timed_out(),
                    e => RemoteError::Node { node: node.to_string(), message: e.to_string() },
                })?;
            let p: Present = serde_json::from_slice(&reply)
                .map_err(|_| RemoteError::Malformed(node.to_string()))?;
            if p.present.len() != chunk.len() {
                return Err(RemoteError::Malformed(node.to_string()));
            }
            busy |= p.busy;
            let whole = p.present.iter().all(|&s| s);
            out[base..base + chunk.len()].copy_from_slice(&p.present);
            if !whole {
                break;
            }
        }
        Ok((out, busy))
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
