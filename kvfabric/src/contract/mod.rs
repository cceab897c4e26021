//! The control-plane contract: the topics kvfabric's processes talk on and the messages they
//! send there, in one typed, versioned place. Every publisher (stores, fabric nodes, workers,
//! the C ABI) and every consumer (routers, frontends) encodes and decodes through
//! [`Message`], so that a topic name or a field is never spelled twice.
//!
//! | topic | messages | who publishes | who listens |
//! | --- | --- | --- | --- |
//! | [`KV_EVENTS`] | [`Message::KvEvent`], [`Message::KvDump`] | every block store | routers |
//! | [`LOAD`] | [`Message::Load`] | serving workers | routers |
//! | [`KV_DUMP_REQUEST`] | [`Message::DumpRequest`] | routers that saw a gap | block stores |
//! | [`prefill_failed`]`(decode)` | the prefill protocol's own payload | prefill workers | a decode worker |
//!
//! The work queue [`prefill_queue`]`(worker)` carries a prefill worker's jobs.
//!
//! On the wire a message is one JSON object: `{"v": 1, "type": "kv_event", ...}`. The
//! version [`VERSION`] changes whenever a message changes incompatibly; a consumer refuses
//! (with [`ContractError::Version`]) what it cannot read rather than misreading it.

use crate::events::{KvEvent, TierKind};
use crate::hash::SequenceHash;

pub mod discovery;
pub mod generate;
pub mod prefill;
pub mod worker;

/// The version of the messages this build writes and reads.
pub const VERSION: u32 = 1;

/// Block stores' KV events and dumps.
pub const KV_EVENTS: &str = "kv-events";
/// Serving workers' load reports.
pub const LOAD: &str = "load";
/// Requests for a full dump of a store's blocks.
pub const KV_DUMP_REQUEST: &str = "kv-dump-request";

/// The durable work queue of prefill worker `worker`.
pub fn prefill_queue(worker: &str) -> String {
    format!("prefill-{worker}")
}

/// The topic on which decode worker `decode` hears of prefills that failed.
pub fn prefill_failed(decode: &str) -> String {
    format!("prefill-failed-{decode}")
}

/// A worker's load, as routers weigh it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Load {
    /// KV blocks of requests being decoded.
    pub active_blocks: u64,
    /// Prompt tokens waiting for prefill.
    pub queued_prefill_tokens: u64,
    /// How many requests the worker had accepted when it measured this load (each request
    /// learns its number from [`GenEvent::Accepted`](generate::GenEvent::Accepted)): a router
    /// stops adding a request it sent there on top of the report once the report counts it,
    /// and keeps adding the ones still on their way. None: the reporter numbers no requests,
    /// and its report replaces what routers tracked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted: Option<u64>,
}

/// One tier's occupancy, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TierUse {
    /// Blocks held.
    pub used: u64,
    /// Blocks it can hold (0: the worker has no such tier).
    pub capacity: u64,
}

/// One transport's totals in a worker's agent.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportTotals {
    /// The transport's name (`shm`, `tcp`, `rdma`, `cuda`).
    pub transport: String,
    /// Bytes of completed transfers.
    pub bytes: u64,
    /// Transfers completed.
    pub done: u64,
    /// Transfers that failed, timed out or were cancelled.
    pub failed: u64,
}

/// What a worker reports of itself beside its load, for dashboards: cumulative counters
/// (a reader takes differences) and occupancy now. Optional in [`Message::Load`]: engines
/// attached by `kvfabric attach` report load only.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct WorkerStats {
    /// Its role (`aggregated`, `prefill`, `decode`); empty before it serves.
    pub role: String,
    /// Sequences in the batch.
    pub running: u64,
    /// Requests waiting for a batch slot.
    pub waiting: u64,
    /// The worker is draining: it takes no new requests and finishes those it has.
    pub draining: bool,
    /// Occupancy per tier, indexed like [`TierKind::ALL`] (G1 device, G2 host, G3 disk, G4
    /// remote).
    pub tiers: [TierUse; 4],
    /// Prompt tokens computed.
    pub prefill_tokens: u64,
    /// Prompt tokens found cached, per tier they came from (indexed like [`TierKind::ALL`]).
    pub hit_tokens: [u64; 4],
    /// Its agent's transfers per transport.
    pub transfers: Vec<TransportTotals>,
    /// Prefills a prefill worker did for it (a decode worker), and those it did itself.
    pub remote_prefills: u64,
    /// Prefills it did itself while remote prefill was configured.
    pub local_prefills: u64,
    /// Remote prefills that failed or timed out and were done locally instead.
    pub prefill_fallbacks: u64,
    /// Engine steps run: a worker whose steps advance is working through its queue, however
    /// long (a frontend waits past its first-token limit for a request queued there).
    pub steps: u64,
    /// When the report was sent, milliseconds since the Unix epoch (the bus's lag).
    pub sent_at_ms: u64,
    /// The links it pulled blocks over from other workers' stores, with the rate measured:
    /// routers price pulls from those peers at it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkRate>,
    /// Bytes it pulled from other workers' stores.
    #[serde(default)]
    pub pulled_bytes: u64,
    /// Prompt tokens it computes per second, as measured (0: not measured yet): routers
    /// price computing a prefix against pulling it at this rate.
    #[serde(default)]
    pub prefill_tokens_per_s: u64,
}

/// A link a worker pulled over, as it measured it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkRate {
    /// The peer pulled from.
    pub peer: String,
    /// Bytes per second.
    pub bytes_per_s: u64,
}

/// One block of a dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DumpBlock {
    /// The tier it is held in.
    pub tier: TierKind,
    /// The block.
    pub hash: SequenceHash,
    /// The block before it, None at the start of a sequence.
    pub parent: Option<SequenceHash>,
}

/// A message of the control plane.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// One KV event of a store (topic [`KV_EVENTS`]).
    KvEvent {
        /// The store's name (its instance id).
        source: String,
        /// The event.
        event: KvEvent,
    },
    /// Every block of a store, current as of an event id (topic [`KV_EVENTS`]): a consumer
    /// that lost events replaces what it knew of `source` with it.
    KvDump {
        /// The store's name.
        source: String,
        /// Its blocks.
        blocks: Vec<DumpBlock>,
        /// The id of the last event the dump includes.
        last_event_id: u64,
    },
    /// A worker's load (topic [`LOAD`]).
    Load {
        /// The worker's name.
        source: String,
        /// Its load.
        load: Load,
        /// The rest of what it reports (none from older workers and attached engines).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stats: Option<Box<WorkerStats>>,
    },
    /// Asks `worker` for a dump (topic [`KV_DUMP_REQUEST`]).
    DumpRequest {
        /// Who asks.
        from: String,
        /// The store whose events were lost.
        worker: String,
    },
}

/// Why bytes are not a message of this contract.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// Written by a version this build cannot read.
    #[error("control-plane message version {got}, this build reads version {VERSION}")]
    Version {
        /// The version on the wire (0: none).
        got: u32,
    },
    /// Not a message at all.
    #[error("malformed control-plane message: {0}")]
    Malformed(String),
}

#[derive(serde::Serialize)]
struct Out<'a> {
    v: u32,
    #[serde(flatten)]
    msg: &'a Message,
}

#[derive(serde::Deserialize)]
struct Version {
    #[serde(default)]
    v: u32,
}

impl Message {
    /// The message as it goes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        // A derived Serialize over strings, integers and enums cannot fail.
        serde_json::to_vec(&Out { v: VERSION, msg: self }).unwrap_or_default()
    }

    /// A message read off the wire.
    pub fn decode(bytes: &[u8]) -> Result<Message, ContractError> {
        let v: Version =
            serde_json::from_slice(bytes).map_err(|e| ContractError::Malformed(e.to_string()))?;
        if v.v != VERSION {
            return Err(ContractError::Version { got: v.v });
        }
        serde_json::from_slice(bytes).map_err(|e| ContractError::Malformed(e.to_string()))
    }

    /// The topic this message is published on.
    pub fn topic(&self) -> &'static str {
        match self {
            Message::KvEvent { .. } | Message::KvDump { .. } => KV_EVENTS,
            Message::Load { .. } => LOAD,
            Message::DumpRequest { .. } => KV_DUMP_REQUEST,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvEventData;

    fn all() -> Vec<Message> {
        vec![
            Message::KvEvent {
                source: "w-0".into(),
                event: KvEvent {
                    event_id: 7,
                    data: KvEventData::Stored {
                        sequence_hashes: vec![SequenceHash(1), SequenceHash(u64::MAX)],
                        parent: None,
                        tier: TierKind::Disk,
                    },
                },
            },
            Message::KvDump {
                source: "fabric-1".into(),
                blocks: vec![DumpBlock {
                    tier: TierKind::Host,
                    hash: SequenceHash(5),
                    parent: Some(SequenceHash(4)),
                }],
                last_event_id: 9,
            },
            Message::Load {
                source: "w-1".into(),
                load: Load { active_blocks: 3, queued_prefill_tokens: 100, accepted: Some(7) },
                stats: None,
            },
            Message::Load {
                source: "w-2".into(),
                load: Load::default(),
                stats: Some(Box::new(WorkerStats {
                    running: 2,
                    draining: true,
                    tiers: [TierUse { used: 1, capacity: 4 }; 4],
                    transfers: vec![TransportTotals {
                        transport: "tcp".into(),
                        bytes: 9,
                        done: 1,
                        failed: 0,
                    }],
                    sent_at_ms: 1,
                    ..WorkerStats::default()
                })),
            },
            Message::DumpRequest { from: "frontend-0".into(), worker: "w-0".into() },
        ]
    }

    #[test]
    fn every_message_round_trips_and_carries_the_version() {
        for m in all() {
            let bytes = m.encode();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(v["v"], VERSION);
            assert_eq!(Message::decode(&bytes).unwrap(), m);
        }
    }

    #[test]
    fn other_versions_and_garbage_are_refused_by_kind() {
        let mut v: serde_json::Value = serde_json::from_slice(&all()[3].encode()).unwrap();
        v["v"] = 2.into();
        assert_eq!(
            Message::decode(v.to_string().as_bytes()),
            Err(ContractError::Version { got: 2 })
        );
        // The unversioned envelopes of earlier builds.
        let old = br#"{"source":"w","event":{"event_id":1,"data":{"type":"cleared"}}}"#;
        assert_eq!(Message::decode(old), Err(ContractError::Version { got: 0 }));
        for bad in [&b""[..], b"null", b"[1]", b"{\"v\":1}", b"{\"v\":1,\"type\":\"nope\"}"] {
            assert!(
                matches!(Message::decode(bad), Err(ContractError::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // A number out of range is an error, not a wrapped value.
        let big = br#"{"v":1,"type":"load","source":"w","load":{"active_blocks":-1,"queued_prefill_tokens":0}}"#;
        assert!(Message::decode(big).is_err());
    }

    #[test]
    fn topics_are_spelled_once() {
        assert_eq!(all()[0].topic(), "kv-events");
        assert_eq!(all()[2].topic(), "load");
        assert_eq!(all()[4].topic(), "kv-dump-request");
        assert_eq!(prefill_queue("p-0"), "prefill-p-0");
        assert_eq!(prefill_failed("d-0"), "prefill-failed-d-0");
    }
}
