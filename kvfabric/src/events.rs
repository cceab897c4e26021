//! KV events: what every worker and fabric node tells routers about the blocks it holds.
//!
//! `Stored{sequence hashes, parent, tier}` says a chain of blocks (each the child of the one
//! before, the first a child of `parent`) is now held in `tier`; `Removed{sequence hashes,
//! tier}` says they are gone from that tier; `Cleared` says everything is gone. Each event
//! carries a monotonic id per source, so that a consumer can detect gaps and ask for a dump.
//! The shape follows NVIDIA Dynamo's `KvCacheEvent` (Stored/Removed/Cleared with an event id),
//! with the tier added so that routers see the whole hierarchy.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::hash::SequenceHash;

/// The tiers of the hierarchy.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    /// G1: accelerator memory.
    Device,
    /// G2: host memory.
    Host,
    /// G3: local disk.
    Disk,
    /// G4: a remote fabric node.
    Remote,
}

impl TierKind {
    /// All tiers, fastest first.
    pub const ALL: [TierKind; 4] =
        [TierKind::Device, TierKind::Host, TierKind::Disk, TierKind::Remote];

    /// Its name.
    pub const fn name(self) -> &'static str {
        match self {
            TierKind::Device => "device",
            TierKind::Host => "host",
            TierKind::Disk => "disk",
            TierKind::Remote => "remote",
        }
    }
}

impl std::fmt::Display for TierKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEventData {
    /// A chain of blocks is now held in `tier`.
    Stored {
        /// The blocks, parent first.
        sequence_hashes: Vec<SequenceHash>,
        /// The block before the first one, None at the start of a sequence.
        parent: Option<SequenceHash>,
        /// Where they are held.
        tier: TierKind,
    },
    /// Blocks are no longer held in `tier`.
    Removed {
        /// The blocks.
        sequence_hashes: Vec<SequenceHash>,
        /// Where they were held.
        tier: TierKind,
    },
    /// Every block of the source is gone, in every tier.
    Cleared,
}

/// One event with its id (monotonic per source, starting at 1).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvEvent {
    /// Monotonic id.
    pub event_id: u64,
    /// What happened.
    #[serde(flatten)]
    pub data: KvEventData,
}

/// Where a store sends its events. `publish` is called with the store's lock held, in event
/// id order: it must not block (buffer, or hand off to a task).
pub trait KvEventSink: Send + Sync + std::fmt::Debug {
    /// Takes one event.
    fn publish(&self, event: KvEvent);
}

/// Drops every event.
#[derive(Debug, Default)]
pub struct NullSink;

impl KvEventSink for NullSink {
    fn publish(&self, _event: KvEvent) {}
}

/// Keeps every event in memory (tests, embedded tools).
#[derive(Debug, Default)]
pub struct RecordingSink {
    events: Mutex<Vec<KvEvent>>,
}

impl RecordingSink {
    /// An empty sink.
    pub fn new() -> Arc<Self> {
        Arc::new(RecordingSink::default())
    }

    /// Takes the events recorded so far.
    pub fn take(&self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events.lock())
    }

    /// A copy of the events recorded so far.
    pub fn snapshot(&self) -> Vec<KvEvent> {
        self.events.lock().clone()
    }
}

impl KvEventSink for RecordingSink {
    fn publish(&self, event: KvEvent) {
        self.events.lock().push(event);
    }
}

/// Sends events into a bounded tokio channel; when the channel is full the event is dropped
/// and counted, and the consumer sees a gap in event ids (and asks for a dump).
#[derive(Debug)]
pub struct ChannelSink {
    tx: tokio::sync::mpsc::Sender<KvEvent>,
    dropped: std::sync::atomic::AtomicU64,
}

impl ChannelSink {
    /// A sink and the receiving end, holding at most `capacity` events.
    pub fn new(capacity: usize) -> (Arc<Self>, tokio::sync::mpsc::Receiver<KvEvent>) {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        (Arc::new(ChannelSink { tx, dropped: Default::default() }), rx)
    }

    /// Events dropped because the channel was full or closed.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl KvEventSink for ChannelSink {
    fn publish(&self, event: KvEvent) {
        if self.tx.try_send(event).is_err() {
            self.dropped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_in_a_stable_shape() {
        let e = KvEvent {
            event_id: 7,
            data: KvEventData::Stored {
                sequence_hashes: vec![SequenceHash(1), SequenceHash(2)],
                parent: None,
                tier: TierKind::Disk,
            },
        };
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"event_id":7,"type":"stored","sequence_hashes":[1,2],"parent":null,"tier":"disk"}"#
        );
        assert_eq!(serde_json::from_str::<KvEvent>(&json).unwrap(), e);
        let c = KvEvent { event_id: 8, data: KvEventData::Cleared };
        assert_eq!(serde_json::to_string(&c).unwrap(), r#"{"event_id":8,"type":"cleared"}"#);
    }

    #[test]
    fn channel_sink_counts_what_it_drops() {
        let (sink, mut rx) = ChannelSink::new(1);
        sink.publish(KvEvent { event_id: 1, data: KvEventData::Cleared });
        sink.publish(KvEvent { event_id: 2, data: KvEventData::Cleared });
        assert_eq!(sink.dropped(), 1);
        assert_eq!(rx.try_recv().unwrap().event_id, 1);
    }
}
