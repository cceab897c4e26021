//! The thin async wrapper: a task that feeds the index from a stream of KV events and
//! membership changes, and asks sources for a dump when their event ids show a gap.
//!
//! The streams are plain bounded channels, so that any transport can feed them: the embedded
//! control plane directly, the NATS subscription and the etcd discovery watch through small
//! adapters. A worker that leaves is removed from the index (and from routing) as soon as
//! its `Left` arrives.

use std::sync::Arc;

use kvfabric::events::KvEvent;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::index::{Ingest, PrefixIndex, WorkerId};
use crate::policy::Router;

/// A membership change from discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// A worker joined.
    Joined(WorkerId),
    /// A worker left (its lease expired or it deregistered).
    Left(WorkerId),
}

/// What the service tells the outside world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceNotice {
    /// Events of this worker were lost: ask it for a dump of its blocks.
    DumpNeeded {
        /// The worker.
        worker: WorkerId,
        /// The first missing event id.
        from_event_id: u64,
    },
}

/// Counters of the service.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ServiceStats {
    /// Events applied.
    pub applied: u64,
    /// Duplicates dropped.
    pub duplicates: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Events from unknown workers dropped.
    pub unknown: u64,
}

/// The index, the routing policy and the task that keeps them current.
#[derive(Debug)]
pub struct RouterService {
    /// The index (shared with queries).
    pub index: Arc<PrefixIndex>,
    /// The policy.
    pub router: Arc<Mutex<Router>>,
    stats: Arc<Mutex<ServiceStats>>,
    task: tokio::task::JoinHandle<()>,
}

impl RouterService {
    /// Spawns the task on the current runtime. It ends when both streams are closed.
    pub fn spawn(
        router: Router,
        mut events: mpsc::Receiver<(WorkerId, KvEvent)>,
        mut membership: mpsc::Receiver<Membership>,
        notices: mpsc::Sender<ServiceNotice>,
    ) -> Self {
        let index = Arc::new(PrefixIndex::new());
        let router = Arc::new(Mutex::new(router));
        let stats = Arc::new(Mutex::new(ServiceStats::default()));
        let (ix, r, st) = (index.clone(), router.clone(), stats.clone());
        let task = tokio::spawn(async move {
            let (mut events_open, mut members_open) = (true, true);
            while events_open || members_open {
                tokio::select! {
                    // Membership first: a Left must win over that worker's late events.
                    biased;
                    m = membership.recv(), if members_open => match m {
                        Some(Membership::Joined(w)) => {
                            ix.add_worker(w);
                            r.lock().add_worker(w);
                        }
                        Some(Membership::Left(w)) => {
                            ix.remove_worker(w);
                            r.lock().remove_worker(w);
                        }
                        None => members_open = false,
                    },
                    e = events.recv(), if events_open => match e {
                        Some((w, event)) => {
                            let outcome = ix.ingest(w, &event);
                            let mut s = st.lock();
                            match outcome {
                                Ingest::Applied => s.applied += 1,
                                Ingest::Duplicate => s.duplicates += 1,
                                Ingest::UnknownWorker => s.unknown += 1,
                                Ingest::Gap { expected, .. } => {
                                    s.applied += 1;
                                    s.gaps += 1;
                                    drop(s);
                                    // Never block ingestion on a slow consumer of notices.
                                    let _ = notices.try_send(ServiceNotice::DumpNeeded { worker: w, from_event_id: expected });
                                }
                            }
                        }
                        None => events_open = false,
                    },
                }
            }
        });
        RouterService { index, router, stats, task }
    }

    /// Counters so far.
    pub fn stats(&self) -> ServiceStats {
        *self.stats.lock()
    }

    /// Stops the task.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for RouterService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Feeds a [`RouterService`]'s channels from the control plane: KV events published on the
/// bus topic `topic` as `{"source": NAME, "event": KvEvent}` (what workers and fabric nodes
/// publish) and membership from a discovery watch of `kind`. Worker ids are derived from
/// instance names (`worker_id`), so events and membership agree. Dumps
/// (`{"source", "dump": [...], "last_event_id"}`) reset the source's blocks in `index`.
/// Returns the feeding task; it ends when the bus subscription or the watch ends.
pub async fn feed_from_control_plane(
    bus: Arc<dyn kvfabric::control::EventBus>,
    discovery: Arc<dyn kvfabric::control::Discovery>,
    topic: &str,
    kind: &str,
    index: Arc<PrefixIndex>,
    events: mpsc::Sender<(WorkerId, KvEvent)>,
    membership: mpsc::Sender<Membership>,
) -> Result<tokio::task::JoinHandle<()>, kvfabric::control::ControlError> {
    use kvfabric::control::DiscoveryEvent;
    use kvfabric::events::TierKind;
    use kvfabric::hash::SequenceHash;

    let mut sub = bus.subscribe(topic).await?;
    let (initial, mut watch) = discovery.watch(kind).await?;
    for inst in initial {
        let _ = membership.send(Membership::Joined(worker_id(&inst.id))).await;
    }
    Ok(tokio::spawn(async move {
        #[derive(serde::Deserialize)]
        struct DumpBlock {
            tier: TierKind,
            hash: SequenceHash,
        }
        let (mut bus_open, mut watch_open) = (true, true);
        while bus_open || watch_open {
            tokio::select! {
                m = sub.recv(), if bus_open => match m {
                    Some(bytes) => {
                        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else { continue };
                        let Some(source) = v["source"].as_str() else { continue };
                        let w = worker_id(source);
                        if let Some(blocks) = v.get("dump") {
                            let Ok(blocks) = serde_json::from_value::<Vec<DumpBlock>>(blocks.clone()) else { continue };
                            let last = v["last_event_id"].as_u64().unwrap_or(0);
                            let list: Vec<_> = blocks.into_iter().map(|b| (b.hash, b.tier)).collect();
                            index.reset_worker(w, &list, last);
                        } else if let Ok(e) = serde_json::from_value::<KvEvent>(v["event"].clone()) {
                            if events.send((w, e)).await.is_err() {
                                return;
                            }
                        }
                    }
                    None => bus_open = false,
                },
                d = watch.recv(), if watch_open => match d {
                    Some(DiscoveryEvent::Joined(inst)) => {
                        let _ = membership.send(Membership::Joined(worker_id(&inst.id))).await;
                    }
                    Some(DiscoveryEvent::Left { id, .. }) => {
                        let _ = membership.send(Membership::Left(worker_id(&id))).await;
                    }
                    None => watch_open = false,
                },
            }
        }
    }))
}

/// The worker id of an instance name: stable across processes (XXH3-64 of the name).
pub fn worker_id(name: &str) -> WorkerId {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RouterConfig;
    use kvfabric::events::{KvEventData, TierKind};
    use kvfabric::hash::SequenceHash;
    use std::time::Duration;

    fn stored(id: u64, h: u64) -> KvEvent {
        KvEvent {
            event_id: id,
            data: KvEventData::Stored {
                sequence_hashes: vec![SequenceHash(h)],
                parent: None,
                tier: TierKind::Host,
            },
        }
    }

    async fn until(mut f: impl FnMut() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("condition not reached");
    }

    #[tokio::test]
    async fn events_feed_the_index_leaves_apply_at_once_and_gaps_ask_for_dumps() {
        let (etx, erx) = mpsc::channel(64);
        let (mtx, mrx) = mpsc::channel(8);
        let (ntx, mut nrx) = mpsc::channel(8);
        let svc = RouterService::spawn(Router::new(RouterConfig::default()), erx, mrx, ntx);
        mtx.send(Membership::Joined(1)).await.unwrap();
        mtx.send(Membership::Joined(2)).await.unwrap();
        until(|| svc.router.lock().workers().len() == 2).await;
        etx.send((1, stored(1, 100))).await.unwrap();
        etx.send((2, stored(1, 100))).await.unwrap();
        etx.send((2, stored(5, 101))).await.unwrap(); // ids 2..4 lost
        etx.send((9, stored(1, 100))).await.unwrap(); // unknown worker
        until(|| svc.stats().applied == 3 && svc.stats().unknown == 1).await;
        assert_eq!(
            nrx.recv().await,
            Some(ServiceNotice::DumpNeeded { worker: 2, from_event_id: 2 })
        );
        assert_eq!(svc.index.overlap(&[SequenceHash(100)]).workers.len(), 2);
        mtx.send(Membership::Left(2)).await.unwrap();
        until(|| svc.index.overlap(&[SequenceHash(100)]).workers.len() == 1).await;
        assert_eq!(svc.router.lock().workers(), &[1]);
        // Late events of the departed worker change nothing.
        etx.send((2, stored(6, 102))).await.unwrap();
        until(|| svc.stats().unknown == 2).await;
        assert_eq!(svc.index.worker_blocks(2), 0);
    }
}
