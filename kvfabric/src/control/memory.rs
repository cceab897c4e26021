//! The embedded control plane: discovery and an event bus inside one process, for
//! `kvfabric up` and tests. Same semantics as etcd and NATS: leases expire after their TTL
//! without keep-alive, watches see joins and leaves, work-queue items are redelivered until
//! acknowledged.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use super::{
    check_name, Acker, ControlFuture, Discovery, DiscoveryEvent, EventBus, Held, Instance,
    Registration, WorkItem,
};

/// Channel capacity of watches and subscriptions; a subscriber that falls this far behind
/// loses events (and, for KV events, sees a gap in ids).
pub const SUBSCRIBER_BUFFER: usize = 4096;

#[derive(Debug)]
struct Entry {
    instance: Instance,
    lease: u64,
    expires: Instant,
}

#[derive(Debug, Default)]
struct DiscState {
    entries: HashMap<(String, String), Entry>,
    watchers: Vec<(String, mpsc::Sender<DiscoveryEvent>)>,
    next_lease: u64,
}

impl DiscState {
    fn notify(&mut self, kind: &str, ev: DiscoveryEvent) {
        self.watchers
            .retain(|(k, tx)| k != kind || tx.try_send(ev.clone()).is_ok() || !tx.is_closed());
    }

    fn expire(&mut self, now: Instant) {
        let dead: Vec<(String, String)> =
            self.entries.iter().filter(|(_, e)| e.expires <= now).map(|(k, _)| k.clone()).collect();
        for (kind, id) in dead {
            self.entries.remove(&(kind.clone(), id.clone()));
            self.notify(&kind.clone(), DiscoveryEvent::Left { kind, id });
        }
    }
}

/// In-process discovery with leases.
#[derive(Debug, Clone)]
pub struct MemoryDiscovery {
    state: Arc<Mutex<DiscState>>,
    _reaper: Arc<ReaperGuard>,
}

#[derive(Debug)]
struct ReaperGuard(tokio::task::JoinHandle<()>);

impl Drop for ReaperGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryDiscovery {
    /// A discovery service; must be created inside a tokio runtime (it runs a lease reaper).
    pub fn new() -> Self {
        let state = Arc::new(Mutex::new(DiscState::default()));
        let weak = Arc::downgrade(&state);
        let reaper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                s.lock().expire(Instant::now());
            }
        });
        MemoryDiscovery { state, _reaper: Arc::new(ReaperGuard(reaper)) }
    }
}

impl Discovery for MemoryDiscovery {
    fn register(&self, instance: Instance, ttl: Duration) -> ControlFuture<'_, Registration> {
        Box::pin(async move {
            check_name(&instance.kind)?;
            check_name(&instance.id)?;
            let key = (instance.kind.clone(), instance.id.clone());
            let lease = super::claim(&instance.kind, &instance.id, || {
                let mut s = self.state.lock();
                let now = Instant::now();
                s.expire(now);
                if let Some(e) = s.entries.get(&key) {
                    let held = Held {
                        lease: e.lease as i64,
                        left: e.expires.saturating_duration_since(now),
                    };
                    return std::future::ready(Ok(Err(held)));
                }
                s.next_lease += 1;
                let lease = s.next_lease;
                s.entries.insert(
                    key.clone(),
                    Entry { instance: instance.clone(), lease, expires: now + ttl },
                );
                let kind = instance.kind.clone();
                s.notify(&kind, DiscoveryEvent::Joined(instance.clone()));
                std::future::ready(Ok(Ok(lease)))
            })
            .await?;
            let (revoke_tx, mut revoke_rx) =
                tokio::sync::oneshot::channel::<tokio::sync::oneshot::Sender<()>>();
            let weak = Arc::downgrade(&self.state);
            let keepalive = tokio::spawn(async move {
                loop {
                    tokio::select! {
                        done = &mut revoke_rx => {
                            if let Some(s) = weak.upgrade() {
                                let mut s = s.lock();
                                if s.entries.get(&key).is_some_and(|e| e.lease == lease) {
                                    s.entries.remove(&key);
                                    let (kind, id) = key.clone();
                                    s.notify(&kind.clone(), DiscoveryEvent::Left { kind, id });
                                }
                            }
                            if let Ok(done) = done {
                                let _ = done.send(());
                            }
                            return;
                        }
                        _ = tokio::time::sleep(ttl / 3) => {
                            let Some(s) = weak.upgrade() else { return };
                            let mut s = s.lock();
                            match s.entries.get_mut(&key) {
                                Some(e) if e.lease == lease => e.expires = Instant::now() + ttl,
                                // Lost (expired while we were starved): the lease is gone.
                                _ => return,
                            }
                        }
                    }
                }
            });
            Ok(Registration { revoke: Some(revoke_tx), keepalive })
        })
    }

    fn list<'a>(&'a self, kind: &'a str) -> ControlFuture<'a, Vec<Instance>> {
        Box::pin(async move {
            let mut s = self.state.lock();
            s.expire(Instant::now());
            let mut v: Vec<Instance> = s
                .entries
                .values()
                .filter(|e| e.instance.kind == kind)
                .map(|e| e.instance.clone())
                .collect();
            v.sort_by(|a, b| a.id.cmp(&b.id));
            Ok(v)
        })
    }

    fn watch<'a>(
        &'a self,
        kind: &'a str,
    ) -> ControlFuture<'a, (Vec<Instance>, mpsc::Receiver<DiscoveryEvent>)> {
        Box::pin(async move {
            let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
            let mut s = self.state.lock();
            s.expire(Instant::now());
            let mut now: Vec<Instance> = s
                .entries
                .values()
                .filter(|e| e.instance.kind == kind)
                .map(|e| e.instance.clone())
                .collect();
            now.sort_by(|a, b| a.id.cmp(&b.id));
            s.watchers.push((kind.to_string(), tx));
            Ok((now, rx))
        })
    }
}

#[derive(Debug, Default)]
struct Queue {
    ready: VecDeque<(u64, Vec<u8>, u64)>,
    in_flight: HashMap<u64, (Vec<u8>, u64, Instant)>,
    next_id: u64,
}

#[derive(Debug, Default)]
struct BusState {
    topics: HashMap<String, Vec<mpsc::Sender<Vec<u8>>>>,
    queues: HashMap<String, Queue>,
}

/// In-process publish/subscribe and work queues.
#[derive(Debug, Clone, Default)]
pub struct MemoryBus {
    state: Arc<Mutex<BusState>>,
    ready: Arc<Notify>,
}

impl MemoryBus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }
}

#[derive(Debug)]
struct MemoryAck {
    state: Arc<Mutex<BusState>>,
    queue: String,
    id: u64,
}

impl Acker for MemoryAck {
    fn ack(self: Box<Self>) -> ControlFuture<'static, ()> {
        Box::pin(async move {
            if let Some(q) = self.state.lock().queues.get_mut(&self.queue) {
                q.in_flight.remove(&self.id);
            }
            Ok(())
        })
    }
}

impl EventBus for MemoryBus {
    fn publish<'a>(&'a self, topic: &'a str, payload: Vec<u8>) -> ControlFuture<'a, ()> {
        Box::pin(async move {
            check_name(topic)?;
            let mut s = self.state.lock();
            if let Some(subs) = s.topics.get_mut(topic) {
                subs.retain(|tx| !tx.is_closed());
                for tx in subs.iter() {
                    let _ = tx.try_send(payload.clone());
                }
            }
            Ok(())
        })
    }

    fn subscribe<'a>(&'a self, topic: &'a str) -> ControlFuture<'a, mpsc::Receiver<Vec<u8>>> {
        Box::pin(async move {
            check_name(topic)?;
            let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
            self.state.lock().topics.entry(topic.to_string()).or_default().push(tx);
            Ok(rx)
        })
    }

    fn enqueue<'a>(&'a self, queue: &'a str, payload: Vec<u8>) -> ControlFuture<'a, ()> {
        Box::pin(async move {
            check_name(queue)?;
            {
                let mut s = self.state.lock();
                let q = s.queues.entry(queue.to_string()).or_default();
                q.next_id += 1;
                let id = q.next_id;
                q.ready.push_back((id, payload, 0));
            }
            self.ready.notify_waiters();
            Ok(())
        })
    }

    fn dequeue<'a>(
        &'a self,
        queue: &'a str,
        wait: Duration,
        ack_wait: Duration,
    ) -> ControlFuture<'a, Option<WorkItem>> {
        Box::pin(async move {
            check_name(queue)?;
            let deadline = Instant::now() + wait;
            loop {
                let notified = self.ready.notified();
                {
                    let now = Instant::now();
                    let mut s = self.state.lock();
                    let q = s.queues.entry(queue.to_string()).or_default();
                    // Unacknowledged past their deadline: back to the front.
                    let expired: Vec<u64> = q
                        .in_flight
                        .iter()
                        .filter(|(_, (_, _, d))| *d <= now)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in expired {
                        if let Some((p, n, _)) = q.in_flight.remove(&id) {
                            q.ready.push_front((id, p, n));
                        }
                    }
                    if let Some((id, payload, n)) = q.ready.pop_front() {
                        q.in_flight.insert(id, (payload.clone(), n + 1, now + ack_wait));
                        let acker = Box::new(MemoryAck {
                            state: self.state.clone(),
                            queue: queue.to_string(),
                            id,
                        });
                        return Ok(Some(WorkItem { payload, deliveries: n + 1, acker }));
                    }
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(None);
                }
                // Wake on a new item, or soon enough to redeliver an expired one.
                let _ = tokio::time::timeout(left.min(Duration::from_millis(50)), notified).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(id: &str) -> Instance {
        Instance {
            kind: "worker".into(),
            id: id.into(),
            metadata: serde_json::json!({ "addr": id }),
        }
    }

    #[tokio::test]
    async fn leases_watches_and_expiry() {
        let d = MemoryDiscovery::new();
        let (now, mut watch) = d.watch("worker").await.unwrap();
        assert!(now.is_empty());
        let a = d.register(inst("a"), Duration::from_millis(300)).await.unwrap();
        let b = d.register(inst("b"), Duration::from_millis(300)).await.unwrap();
        assert_eq!(watch.recv().await, Some(DiscoveryEvent::Joined(inst("a"))));
        assert_eq!(watch.recv().await, Some(DiscoveryEvent::Joined(inst("b"))));
        // Keep-alive holds a past its TTL.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(d.list("worker").await.unwrap().len(), 2);
        // b dies without revoking: it leaves within the TTL.
        drop(b);
        let left = tokio::time::timeout(Duration::from_secs(2), watch.recv()).await.unwrap();
        assert_eq!(left, Some(DiscoveryEvent::Left { kind: "worker".into(), id: "b".into() }));
        a.revoke().await;
        assert_eq!(
            watch.recv().await,
            Some(DiscoveryEvent::Left { kind: "worker".into(), id: "a".into() })
        );
        assert!(d.list("worker").await.unwrap().is_empty());
        assert!(d.register(inst("bad id"), Duration::from_secs(1)).await.is_err());
    }

    #[tokio::test]
    async fn pubsub_and_at_least_once_queue() {
        let bus = MemoryBus::new();
        let mut s1 = bus.subscribe("kv-events").await.unwrap();
        let mut s2 = bus.subscribe("kv-events").await.unwrap();
        bus.publish("kv-events", b"e1".to_vec()).await.unwrap();
        assert_eq!(s1.recv().await.unwrap(), b"e1");
        assert_eq!(s2.recv().await.unwrap(), b"e1");
        bus.enqueue("prefill", b"job".to_vec()).await.unwrap();
        let w = Duration::from_millis(500);
        let first = bus.dequeue("prefill", w, Duration::from_millis(100)).await.unwrap().unwrap();
        assert_eq!((first.payload.as_slice(), first.deliveries), (&b"job"[..], 1));
        drop(first); // never acknowledged: delivered again
        let again = bus.dequeue("prefill", w, Duration::from_millis(100)).await.unwrap().unwrap();
        assert_eq!(again.deliveries, 2);
        again.ack().await.unwrap();
        assert!(bus
            .dequeue("prefill", Duration::from_millis(300), Duration::from_millis(100))
            .await
            .unwrap()
            .is_none());
    }
}
