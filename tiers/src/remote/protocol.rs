//! The fabric's protocol: what a node answers over the agents' authenticated RPC (bodies are
//! JSON), and what it publishes in discovery. Shared by the node ([`crate::fabric`]) and its
//! client, the G4 tier ([`crate::remote`]).
//!
//! - `HELLO {metadata}`: the client's agent metadata, so the node can move bytes to and from
//!   the client's registered memory;
//! - `LOOKUP {hashes}` → which blocks it holds;
//! - `GET {blocks: [(hash, region, offset)]}` → it WRITEs each block it holds straight into
//!   the client's region (checksummed) and says which it served;
//! - `PUT {blocks: [(hash, parent, region, offset)]}` → it READs each block it lacks
//!   straight out of the client's region into a new slot (checksummed) and commits it.

use kvfabric::agent::AgentMetadata;
use kvfabric::hash::SequenceHash;
use kvfabric::memory::RegionId;

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
pub(crate) struct Hello {
    pub(crate) metadata: AgentMetadata,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Lookup {
    pub(crate) hashes: Vec<SequenceHash>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Present {
    pub(crate) present: Vec<bool>,
}

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub(crate) struct BlockLoc {
    pub(crate) hash: SequenceHash,
    pub(crate) parent: Option<SequenceHash>,
    pub(crate) region: RegionId,
    pub(crate) offset: u64,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Blocks {
    pub(crate) blocks: Vec<BlockLoc>,
}

/// Most blocks in one GET or PUT.
pub const BLOCKS_PER_CALL_MAX: usize = 1024;

pub(crate) fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("malformed request: {e}"))
}

pub(crate) fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Plain data with string keys always serializes.
    serde_json::to_vec(v).unwrap_or_default()
}
