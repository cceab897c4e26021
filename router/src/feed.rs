//! The index's feed from the control plane: one task that applies the KV events and dumps
//! published on [`contract::KV_EVENTS`] to a [`PrefixIndex`], and asks a source for a dump
//! ([`Message::DumpRequest`]) when its event ids show a gap. The routing frontend runs it for
//! its index; anything else that routes (a planner, a second frontend) runs its own.
//!
//! Membership is the caller's: it adds a worker to the index when discovery says it joined
//! and removes it when it left (at once: routing never waits for a lease to expire), and
//! tells the feed to [`IndexFeed::follow`] it: the feed asks it for a dump then (a feed that
//! starts, or restarts, learns what was stored before it listened) and again whenever the bus
//! reconnects. Events of workers the index does not know are dropped and counted.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::contract::{self, Message};
use kvfabric::control::{ControlError, EventBus};

use crate::index::{Ingest, PrefixIndex, WorkerId};

/// A source is asked for a dump at most this often (a burst of events after a gap would
/// otherwise ask once per event).
const DUMP_REQUEST_INTERVAL: Duration = Duration::from_secs(1);

/// Counters of a feed.
#[derive(Debug, Default)]
pub struct FeedStats {
    /// Events applied (those after a gap included).
    pub applied: AtomicU64,
    /// Duplicates dropped.
    pub duplicates: AtomicU64,
    /// Gaps seen.
    pub gaps: AtomicU64,
    /// Events of workers the index does not know, dropped.
    pub unknown: AtomicU64,
    /// Dumps applied.
    pub dumps: AtomicU64,
    /// Dump requests published.
    pub dump_requests: AtomicU64,
    /// Messages that are not of this contract (malformed, or another version), dropped.
    pub malformed: AtomicU64,
}

/// Keeps an index current from the control plane, until dropped.
#[derive(Debug)]
pub struct IndexFeed {
    stats: Arc<FeedStats>,
    task: tokio::task::JoinHandle<()>,
    follows: Arc<Follows>,
}

/// Changes of the sources a feed follows, not yet applied: the latest per source (followed
/// or not), so that what waits is bounded by the sources discovery knows, whatever the rate
/// of joins and leaves.
#[derive(Debug, Default)]
struct Follows {
    pending: parking_lot::Mutex<HashMap<String, bool>>,
    changed: tokio::sync::Notify,
}

impl Follows {
    fn set(&self, source: &str, follow: bool) {
        self.pending.lock().insert(source.to_string(), follow);
        self.changed.notify_one();
    }
}

impl Drop for IndexFeed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl IndexFeed {
    /// Subscribes to KV events on `bus` and applies them to `index`; dump requests go out
    /// as coming from `requester`.
    pub async fn start(
        bus: Arc<dyn EventBus>,
        index: Arc<PrefixIndex>,
        requester: String,
    ) -> Result<Self, ControlError> {
        let mut sub = bus.subscribe(contract::KV_EVENTS).await?;
        let mut connections = bus.connections();
        if let Some(c) = connections.as_mut() {
            c.borrow_and_update();
        }
        let stats = Arc::new(FeedStats::default());
        let st = stats.clone();
        let follows = Arc::new(Follows::default());
        let changes = follows.clone();
        let task = tokio::spawn(async move {
            let mut asked: HashMap<WorkerId, Instant> = HashMap::new();
            let mut followed: HashSet<String> = HashSet::new();
            let mut warned_malformed = false;
            let count = |c: &AtomicU64| {
                c.fetch_add(1, Ordering::Relaxed);
            };
            let ask = |source: String| {
                let req = Message::DumpRequest { from: requester.clone(), worker: source };
                let (bus, st) = (bus.clone(), st.clone());
                async move {
                    if bus.publish(req.topic(), req.encode()).await.is_ok() {
                        st.dump_requests.fetch_add(1, Ordering::Relaxed);
                    }
                }
            };
            loop {
                // Membership changes first, so that a reconnection asks exactly the sources
                // followed by then; then reconnections; then the stream.
                let bytes = tokio::select! {
                    biased;
                    () = changes.changed.notified() => {
                        let pending = std::mem::take(&mut *changes.pending.lock());
                        for (source, follow) in pending {
                            if follow {
                                // What it stored before we listened comes in its dump.
                                asked.insert(worker_id(&source), Instant::now());
                                followed.insert(source.clone());
                                ask(source).await;
                            } else {
                                asked.remove(&worker_id(&source));
                                followed.remove(&source);
                            }
                        }
                        continue;
                    }
                    changed = async {
                        match connections.as_mut() {
                            Some(c) => c.changed().await,
                            None => std::future::pending().await,
                        }
                    } => {
                        // The bus reconnected: what was published meanwhile is lost.
                        if changed.is_err() {
                            connections = None;
                            continue;
                        }
                        for source in &followed {
                            asked.insert(worker_id(source), Instant::now());
                            ask(source.clone()).await;
                        }
                        continue;
                    }
                    b = sub.recv() => match b {
                        Some(b) => b,
                        None => return,
                    },
                };
                match Message::decode(&bytes) {
                    Ok(Message::KvEvent { source, event }) => {
                        let w = worker_id(&source);
                        match index.ingest(w, &event) {
                            Ingest::Applied => count(&st.applied),
                            Ingest::Duplicate => count(&st.duplicates),
                            Ingest::UnknownWorker => count(&st.unknown),
                            Ingest::Gap { .. } => {
                                count(&st.applied);
                                count(&st.gaps);
                                let now = Instant::now();
                                if asked.get(&w).is_some_and(|t| now - *t < DUMP_REQUEST_INTERVAL) {
                                    continue;
                                }
                                asked.insert(w, now);
                                ask(source).await;
                            }
                        }
                    }
                    Ok(Message::KvDump { source, blocks, last_event_id }) => {
                        let w = worker_id(&source);
                        let list: Vec<_> = blocks.iter().map(|b| (b.hash, b.tier)).collect();
                        index.reset_worker(w, &list, last_event_id);
                        asked.remove(&w);
                        count(&st.dumps);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        count(&st.malformed);
                        if !warned_malformed {
                            tracing::warn!(error = %e, "dropping KV event messages this build cannot read");
                            warned_malformed = true;
                        }
                    }
                }
            }
        });
        Ok(IndexFeed { stats, task, follows })
    }

    /// Follows `source` (a worker or fabric node the caller added to the index): asks it for
    /// a dump now — what it stored before this feed listened — and again whenever the bus
    /// reconnects (what it published meanwhile was lost).
    pub fn follow(&self, source: &str) {
        self.follows.set(source, true);
    }

    /// Stops following `source` (it left).
    pub fn unfollow(&self, source: &str) {
        self.follows.set(source, false);
    }

    /// The counters.
    pub fn stats(&self) -> &FeedStats {
        &self.stats
    }
}

/// The worker id of an instance name: stable across processes (XXH3-64 of the name).
pub fn worker_id(name: &str) -> WorkerId {
    WorkerId::of_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric::contract::DumpBlock;
    use kvfabric::control::memory::MemoryBus;
    use kvfabric::events::{KvEvent, KvEventData, TierKind};
    use kvfabric::hash::SequenceHash;

    fn stored(source: &str, id: u64, h: u64) -> Vec<u8> {
        Message::KvEvent {
            source: source.into(),
            event: KvEvent {
                event_id: id,
                data: KvEventData::Stored {
                    sequence_hashes: vec![SequenceHash(h)],
                    parent: None,
                    tier: TierKind::Host,
                },
            },
        }
        .encode()
    }

    async fn until(mut f: impl FnMut() -> bool) {
        let start = Instant::now();
        while !f() {
            assert!(start.elapsed() < Duration::from_secs(5), "condition not reached");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_feed_the_index_gaps_ask_for_one_dump_and_dumps_reset_a_source() {
        let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
        let index = Arc::new(PrefixIndex::new());
        let (a, b) = (worker_id("w-a"), worker_id("w-b"));
        index.add_worker(a);
        index.add_worker(b);
        let mut requests = bus.subscribe(contract::KV_DUMP_REQUEST).await.unwrap();
        let feed = IndexFeed::start(bus.clone(), index.clone(), "router-0".into()).await.unwrap();
        let s = feed.stats();
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        for m in [stored("w-a", 1, 100), stored("w-b", 1, 100), stored("w-b", 1, 100)] {
            bus.publish(contract::KV_EVENTS, m).await.unwrap();
        }
        // Ids 2..4 of w-b lost, twice over: one dump request.
        bus.publish(contract::KV_EVENTS, stored("w-b", 5, 101)).await.unwrap();
        bus.publish(contract::KV_EVENTS, stored("w-b", 9, 102)).await.unwrap();
        bus.publish(contract::KV_EVENTS, stored("w-x", 1, 100)).await.unwrap();
        bus.publish(contract::KV_EVENTS, b"{broken".to_vec()).await.unwrap();
        let old = br#"{"source":"w-a","event":{"event_id":2,"data":{"type":"cleared"}}}"#;
        bus.publish(contract::KV_EVENTS, old.to_vec()).await.unwrap();
        until(|| n(&s.unknown) == 1 && n(&s.malformed) == 2).await;
        assert_eq!((n(&s.applied), n(&s.duplicates), n(&s.gaps)), (4, 1, 2));
        assert_eq!(n(&s.dump_requests), 1);
        let req = Message::decode(&requests.recv().await.unwrap()).unwrap();
        assert_eq!(req, Message::DumpRequest { from: "router-0".into(), worker: "w-b".into() });
        assert_eq!(index.overlap(&[SequenceHash(100)]).workers.len(), 2);
        assert_eq!(index.worker_blocks(worker_id("w-x")), 0);

        // w-b's dump replaces what was known of it.
        let dump = Message::KvDump {
            source: "w-b".into(),
            blocks: vec![DumpBlock { tier: TierKind::Disk, hash: SequenceHash(600), parent: None }],
            last_event_id: 9,
        };
        bus.publish(contract::KV_EVENTS, dump.encode()).await.unwrap();
        until(|| n(&s.dumps) == 1).await;
        assert_eq!(index.worker_blocks(b), 1);
        assert_eq!(index.overlap(&[SequenceHash(600)]).run(b).per_tier[2], 1, "on disk");
        assert_eq!(index.overlap(&[SequenceHash(100)]).workers.len(), 1);
        // The next event continues from the dump's id without a gap.
        bus.publish(contract::KV_EVENTS, stored("w-b", 10, 601)).await.unwrap();
        until(|| n(&s.applied) == 5).await;
        assert_eq!(n(&s.gaps), 2);
        // A worker that left is removed by its owner: its late events change nothing.
        index.remove_worker(b);
        bus.publish(contract::KV_EVENTS, stored("w-b", 11, 602)).await.unwrap();
        until(|| n(&s.unknown) == 2).await;
        assert_eq!(index.worker_blocks(b), 0);
    }

    /// A bus whose reconnections the test makes.
    #[derive(Debug)]
    struct Reconnecting {
        bus: MemoryBus,
        connections: tokio::sync::watch::Sender<u64>,
    }

    impl EventBus for Reconnecting {
        fn publish<'a>(
            &'a self,
            topic: &'a str,
            payload: Vec<u8>,
        ) -> kvfabric::control::ControlFuture<'a, ()> {
            self.bus.publish(topic, payload)
        }
        fn subscribe<'a>(
            &'a self,
            topic: &'a str,
        ) -> kvfabric::control::ControlFuture<'a, tokio::sync::mpsc::Receiver<Vec<u8>>> {
            self.bus.subscribe(topic)
        }
        fn enqueue<'a>(
            &'a self,
            queue: &'a str,
            payload: Vec<u8>,
        ) -> kvfabric::control::ControlFuture<'a, ()> {
            self.bus.enqueue(queue, payload)
        }
        fn dequeue<'a>(
            &'a self,
            queue: &'a str,
            wait: Duration,
            ack_wait: Duration,
        ) -> kvfabric::control::ControlFuture<'a, Option<kvfabric::control::WorkItem>> {
            self.bus.dequeue(queue, wait, ack_wait)
        }
        fn connections(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
            Some(self.connections.subscribe())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_followed_source_is_asked_for_a_dump_at_once_and_after_every_reconnection() {
        let (tx, _) = tokio::sync::watch::channel(1);
        let bus = Arc::new(Reconnecting { bus: MemoryBus::new(), connections: tx });
        let dyn_bus: Arc<dyn EventBus> = bus.clone();
        let index = Arc::new(PrefixIndex::new());
        let mut requests = dyn_bus.subscribe(contract::KV_DUMP_REQUEST).await.unwrap();
        let feed =
            IndexFeed::start(dyn_bus.clone(), index.clone(), "frontend-1".into()).await.unwrap();
        let next = |r: &mut tokio::sync::mpsc::Receiver<Vec<u8>>| {
            r.try_recv().ok().map(|b| Message::decode(&b).unwrap())
        };
        let asked = |w: &str| Message::DumpRequest { from: "frontend-1".into(), worker: w.into() };
        // A frontend that starts knows nothing of what w-a stored before: it asks.
        index.add_worker(worker_id("w-a"));
        feed.follow("w-a");
        until(|| feed.stats().dump_requests.load(Ordering::Relaxed) == 1).await;
        assert_eq!(next(&mut requests), Some(asked("w-a")));
        // Its dump fills the index.
        let dump = Message::KvDump {
            source: "w-a".into(),
            blocks: vec![DumpBlock { tier: TierKind::Host, hash: SequenceHash(7), parent: None }],
            last_event_id: 15,
        };
        dyn_bus.publish(contract::KV_EVENTS, dump.encode()).await.unwrap();
        until(|| index.worker_blocks(worker_id("w-a")) == 1).await;
        // The bus reconnects: whatever was published meanwhile is lost, so it asks again.
        index.add_worker(worker_id("w-b"));
        feed.follow("w-b");
        until(|| feed.stats().dump_requests.load(Ordering::Relaxed) == 2).await;
        assert_eq!(next(&mut requests), Some(asked("w-b")));
        feed.unfollow("w-b");
        bus.connections.send_replace(2);
        until(|| feed.stats().dump_requests.load(Ordering::Relaxed) == 3).await;
        assert_eq!(next(&mut requests), Some(asked("w-a")), "followed sources only");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(next(&mut requests), None);
    }

    #[test]
    fn changes_waiting_for_the_feed_are_one_per_source_whatever_the_churn() {
        let f = Follows::default();
        for i in 0..10_000 {
            f.set("w-a", i % 2 == 0);
            f.set("w-b", true);
        }
        f.set("w-c", false);
        let pending = f.pending.lock().clone();
        assert_eq!(pending.len(), 3, "bounded by the sources");
        assert!(!pending["w-a"], "the latest change wins");
        assert!(pending["w-b"] && !pending["w-c"]);
    }
}
