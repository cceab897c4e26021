//! A block store's part in the control plane: it tells routers what it holds.
//!
//! [`StorePublisher`] takes the KV events of a store's sink (and any the engine adds, such as
//! blocks it holds in device memory), numbers them in one sequence per source, and publishes
//! them on [`contract::KV_EVENTS`]. A router that sees a gap in the ids asks for a dump
//! ([`contract::Message::DumpRequest`] naming this source); the publisher answers with every
//! block the store holds, current as of the id of the last event it published, and it also
//! publishes one after each reconnection of the bus (the events sent while it was down are
//! lost). The dump is taken by the same task that publishes events, after it has published
//! everything already emitted, so the id it carries is exact: a consumer that replaces what it
//! knew with the dump and then applies the following events ends in the store's state.

use std::collections::HashMap;
use std::sync::Arc;

use kvfabric::contract::{self, DumpBlock, Message};
use kvfabric::control::{ControlError, EventBus};
use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::SequenceHash;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::TieredStore;

/// Publishes a store's KV events and answers dump requests, until dropped.
#[derive(Debug)]
pub struct StorePublisher {
    task: JoinHandle<()>,
}

impl Drop for StorePublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Blocks in tiers the store does not manage (the engine's device memory), known from the
/// events that went through the publisher, so that dumps include them.
#[derive(Debug, Default)]
struct Outside {
    blocks: HashMap<(TierKind, SequenceHash), Option<SequenceHash>>,
}

impl Outside {
    fn apply(&mut self, data: &KvEventData) {
        match data {
            KvEventData::Stored { sequence_hashes, parent, tier } if *tier == TierKind::Device => {
                let mut parent = *parent;
                for &h in sequence_hashes {
                    self.blocks.insert((*tier, h), parent);
                    parent = Some(h);
                }
            }
            KvEventData::Removed { sequence_hashes, tier } if *tier == TierKind::Device => {
                for h in sequence_hashes {
                    self.blocks.remove(&(*tier, *h));
                }
            }
            KvEventData::Cleared => self.blocks.clear(),
            _ => {}
        }
    }
}

struct State {
    bus: Arc<dyn EventBus>,
    source: String,
    store: TieredStore,
    next_id: u64,
    outside: Outside,
}

impl State {
    async fn publish_event(&mut self, mut event: KvEvent) {
        self.next_id += 1;
        event.event_id = self.next_id;
        self.outside.apply(&event.data);
        let msg = Message::KvEvent { source: self.source.clone(), event };
        if let Err(e) = self.bus.publish(msg.topic(), msg.encode()).await {
            // Consumers see the gap in ids and ask for a dump.
            tracing::debug!(source = %self.source, error = %e, "publishing a KV event failed");
        }
    }

    async fn dump(&mut self, events: &mut mpsc::Receiver<KvEvent>) {
        // Everything emitted so far goes out first: the dump is current as of `next_id`.
        while let Ok(e) = events.try_recv() {
            self.publish_event(e).await;
        }
        let mut blocks: Vec<DumpBlock> = self
            .store
            .snapshot()
            .into_iter()
            .map(|(tier, hash, parent)| DumpBlock { tier, hash, parent })
            .collect();
        blocks.extend(self.outside.blocks.iter().map(|(&(tier, hash), &parent)| DumpBlock {
            tier,
            hash,
            parent,
        }));
        let n = blocks.len();
        let msg =
            Message::KvDump { source: self.source.clone(), blocks, last_event_id: self.next_id };
        match self.bus.publish(msg.topic(), msg.encode()).await {
            Ok(()) => {
                tracing::debug!(source = %self.source, blocks = n, last_event_id = self.next_id, "published a KV dump")
            }
            Err(e) => {
                tracing::warn!(source = %self.source, error = %e, "publishing a KV dump failed")
            }
        }
    }
}

impl StorePublisher {
    /// Starts publishing `events` (the receiving end of the store's sink) as `source` on
    /// `bus`, and answering dump requests for `source` with `store`'s blocks.
    pub async fn start(
        bus: Arc<dyn EventBus>,
        source: String,
        store: TieredStore,
        mut events: mpsc::Receiver<KvEvent>,
    ) -> Result<Self, ControlError> {
        let mut requests = bus.subscribe(contract::KV_DUMP_REQUEST).await?;
        let mut connections = bus.connections();
        if let Some(c) = connections.as_mut() {
            c.borrow_and_update();
        }
        let mut state = State { bus, source, store, next_id: 0, outside: Outside::default() };
        let task = tokio::spawn(async move {
            let (mut events_open, mut requests_open) = (true, true);
            while events_open {
                tokio::select! {
                    e = events.recv() => match e {
                        Some(e) => state.publish_event(e).await,
                        None => events_open = false,
                    },
                    r = requests.recv(), if requests_open => match r {
                        Some(bytes) => match Message::decode(&bytes) {
                            Ok(Message::DumpRequest { worker, .. }) if worker == state.source => {
                                state.dump(&mut events).await;
                            }
                            Ok(_) => {}
                            Err(e) => tracing::debug!(error = %e, "ignoring a malformed dump request"),
                        },
                        None => requests_open = false,
                    },
                    changed = async {
                        match connections.as_mut() {
                            Some(c) => c.changed().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        if changed.is_ok() {
                            state.dump(&mut events).await;
                        } else {
                            connections = None;
                        }
                    }
                }
            }
        });
        Ok(StorePublisher { task })
    }
}
