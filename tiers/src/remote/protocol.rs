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
//!   straight out of the client's region into a new slot (checksummed) and commits it;
//! - `PREFIX {hashes}` → the tiers of the leading run of a sequence's blocks that the node
//!   can provide, its own tiers first and then what its remote tier adds (one hop: it asks
//!   other nodes with `LOOKUP`, which never goes further). An engine's scheduler process
//!   asks the store of its worker process this way.

use kvfabric::agent::AgentMetadata;
use kvfabric::events::TierKind;
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
    /// The tiers of the leading run of blocks the node can provide.
    pub const PREFIX: u16 = 5;
}

pub use kvfabric::contract::discovery::{NodeInfo, FABRIC_KIND};

/// `HELLO`: the client's agent metadata.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    /// The client's metadata.
    pub metadata: AgentMetadata,
}

/// `LOOKUP`: which of these blocks the node holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Lookup {
    /// The blocks.
    pub hashes: Vec<SequenceHash>,
}

/// The answer to `LOOKUP`, `GET` and `PUT`: one flag per block asked for.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Present {
    /// Per block asked for.
    pub present: Vec<bool>,
    /// `GET` from a worker's store: it served fewer blocks than it holds, or none, because
    /// serving them would exceed its share of its link or its reads.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub busy: bool,
}

/// The answer to `PREFIX`: the tier of each block of the leading run the node can provide
/// (no longer than the blocks asked for).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Tiers {
    /// Per block of the run.
    pub tiers: Vec<TierKind>,
}

/// A block and where it is (or goes) in the client's registered memory.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct BlockLoc {
    /// The block.
    pub hash: SequenceHash,
    /// Its parent (PUT).
    pub parent: Option<SequenceHash>,
    /// The client's region.
    pub region: RegionId,
    /// Where in it.
    pub offset: u64,
}

/// `GET` and `PUT`: the blocks and their places.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Blocks {
    /// The blocks.
    pub blocks: Vec<BlockLoc>,
}

/// Most blocks in one GET or PUT.
pub const BLOCKS_PER_CALL_MAX: usize = 1024;

/// Most blocks in one LOOKUP (a prompt of a million tokens in blocks of 16).
pub const LOOKUP_HASHES_MAX: usize = 65_536;

/// A request to a fabric node, decoded and checked: a known method, a well-formed body,
/// counts within bounds. The node acts only on what this accepts.
#[derive(Debug)]
pub enum Request {
    /// `HELLO`.
    Hello(Hello),
    /// `LOOKUP`.
    Lookup(Lookup),
    /// `GET`.
    Get(Blocks),
    /// `PUT`.
    Put(Blocks),
    /// `PREFIX`.
    Prefix(Lookup),
}

impl Request {
    /// Decodes the body of `method`.
    pub fn decode(method: u16, body: &[u8]) -> Result<Request, String> {
        let blocks = |b: Blocks| {
            if b.blocks.len() > BLOCKS_PER_CALL_MAX {
                return Err(format!("at most {BLOCKS_PER_CALL_MAX} blocks per call"));
            }
            Ok(b)
        };
        match method {
            method::HELLO => Ok(Request::Hello(decode(body)?)),
            method::LOOKUP | method::PREFIX => {
                let l: Lookup = decode(body)?;
                if l.hashes.len() > LOOKUP_HASHES_MAX {
                    return Err(format!("at most {LOOKUP_HASHES_MAX} blocks per lookup"));
                }
                Ok(if method == method::LOOKUP { Request::Lookup(l) } else { Request::Prefix(l) })
            }
            method::GET => Ok(Request::Get(blocks(decode(body)?)?)),
            method::PUT => Ok(Request::Put(blocks(decode(body)?)?)),
            other => Err(format!("unknown fabric method {other}")),
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| format!("malformed request: {e}"))
}

pub(crate) fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Plain data with string keys always serializes.
    serde_json::to_vec(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_before_the_node_acts() {
        let loc = |i: u64| BlockLoc {
            hash: SequenceHash(i),
            parent: None,
            region: RegionId(1),
            offset: 0,
        };
        let ok = encode(&Blocks { blocks: (0..BLOCKS_PER_CALL_MAX as u64).map(loc).collect() });
        assert!(matches!(Request::decode(method::GET, &ok), Ok(Request::Get(_))));
        assert!(matches!(Request::decode(method::PUT, &ok), Ok(Request::Put(_))));
        let over = encode(&Blocks { blocks: (0..=BLOCKS_PER_CALL_MAX as u64).map(loc).collect() });
        assert!(Request::decode(method::GET, &over).unwrap_err().contains("at most"));
        let many = encode(&Lookup { hashes: vec![SequenceHash(1); LOOKUP_HASHES_MAX + 1] });
        assert!(Request::decode(method::LOOKUP, &many).is_err());
        assert!(Request::decode(method::PREFIX, &many).unwrap_err().contains("at most"));
        let one = encode(&Lookup { hashes: vec![SequenceHash(1)] });
        assert!(matches!(Request::decode(method::PREFIX, &one), Ok(Request::Prefix(_))));
        for (m, body) in [
            (method::HELLO, &b"{}"[..]),
            (method::LOOKUP, b"[1,2]"),
            (method::PREFIX, b"{\"hashes\": \"x\"}"),
            (9, b"{}"),
            (method::GET, b""),
        ] {
            assert!(Request::decode(m, body).is_err(), "method {m} body {body:?}");
        }
    }
}
