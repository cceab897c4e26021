//! The frontend's pending queue: when every worker of a model has as many of this
//! frontend's requests in flight as it is allowed ([`PendingConfig::per_worker`]), a request
//! waits here, in the order of its deadline (arrival plus its class's TTFT target, earliest
//! first; or its arrival, first come first served), until one finishes. Each class has its
//! own bound: a request of a class whose queue is full is refused at once (429 with
//! `Retry-After`), and one whose class's `expire` (or its own timeout) passes while it waits is
//! answered then, never sent. A class with a share of capacity holds at most that share of
//! the slots while requests of other classes wait. A latency-class request (its class has an
//! ITL target) that finds every slot taken takes a burst slot, one per worker, rather than
//! wait for a batch request to finish: the frontend cannot preempt what an engine computes
//! (edf only; fcfs serves in arrival order whatever the class).
//!
//! This is what puts classes in front of engines that do not order by them (an attached
//! engine scheduling first come first served): the frontend decides which request an engine
//! gets next.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use kvfabric::contract::generate::ClassHint;
use kvfabric::queue::{Meta, Place, Queue, Slots};

use crate::engine::{EngineError, QueuePolicy};
pub use crate::metrics::PendingClassStats;

/// How the frontend holds requests back while its workers are busy.
#[derive(Debug, Clone, Copy)]
pub struct PendingConfig {
    /// Requests of this frontend each worker of a model may have in flight; more wait in
    /// the frontend's queue. 0: no queue (every request goes to a worker at once, and the
    /// engines queue).
    pub per_worker: usize,
    /// Requests of one class (per model) that may wait; more are refused with 429.
    pub bound: usize,
    /// The order of the waiting requests.
    pub policy: QueuePolicy,
}

impl Default for PendingConfig {
    fn default() -> Self {
        PendingConfig { per_worker: 0, bound: 256, policy: QueuePolicy::Edf }
    }
}

/// The class counted for requests without one (classes are off).
pub use kvfabric::queue::NO_CLASS;

/// Classes (and the class-less) a frontend counts at most; further names share the last
/// row's counters under "other".
const CLASSES_COUNTED_MAX: usize = 32;

/// The queue of a routed frontend. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Pending {
    cfg: PendingConfig,
    st: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    lanes: HashMap<String, Lane>,
    stats: BTreeMap<String, PendingClassStats>,
}

/// One model's slots and waiting requests.
#[derive(Debug)]
struct Lane {
    capacity: usize,
    /// Slots past `capacity` that only latency-class requests may take (one per worker): an
    /// urgent request does not wait for a batch request's slot to free.
    burst: usize,
    in_flight: usize,
    /// Slots held per class.
    held: HashMap<String, usize>,
    /// The requests that wait (the one admission queue: order, class counts, shares,
    /// bursts).
    waiting: Queue<Waiter, Instant>,
    /// How long a slot is held, smoothed (for `Retry-After`).
    hold_ms: f64,
}

#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<Instant>,
}

impl Lane {
    fn new(policy: QueuePolicy) -> Self {
        Lane {
            capacity: 0,
            burst: 0,
            in_flight: 0,
            held: HashMap::new(),
            waiting: Queue::new(policy),
            hold_ms: 0.0,
        }
    }
}

/// A slot of a model's capacity: released when dropped.
#[derive(Debug)]
pub struct Permit {
    held: Option<Held>,
}

#[derive(Debug)]
struct Held {
    st: Arc<Mutex<State>>,
    model: String,
    class: String,
    since: Instant,
}

/// What became of a request in the queue.
#[derive(Debug)]
pub enum Admitted {
    /// It may be sent; `waited` is how long it was held back.
    Go { permit: Permit, waited: Duration },
    /// Refused or expired: the client's answer.
    Refused(EngineError),
    /// The client went away while it waited.
    Gone,
}

impl Pending {
    /// A queue with these settings.
    pub fn new(cfg: PendingConfig) -> Self {
        Pending { cfg, st: Arc::default() }
    }

    /// Whether requests are ever held back.
    pub fn enabled(&self) -> bool {
        self.cfg.per_worker > 0
    }

    /// The slots of a model with `workers` workers.
    pub fn capacity(&self, workers: usize) -> usize {
        workers.saturating_mul(self.cfg.per_worker)
    }

    /// Waits for a slot of `model`'s `capacity` for a request of `class` that arrived at
    /// `arrival` and must be answered by `deadline`; `closed` resolves when its client went
    /// away.
    pub async fn admit(
        &self,
        model: &str,
        class: Option<&ClassHint>,
        arrival: Instant,
        deadline: Instant,
        capacity: usize,
        closed: impl std::future::Future<Output = ()>,
    ) -> Admitted {
        if !self.enabled() || capacity == 0 {
            // No queue, or no worker now: the request goes on and meets what routing says.
            return Admitted::Go { permit: Permit { held: None }, waited: Duration::ZERO };
        }
        // The one rule of the admission queue: arrival plus the class's TTFT target, or the
        // request's own deadline without one (first come first served: the arrival).
        let meta =
            Meta::new(self.cfg.policy, class, arrival, deadline.saturating_duration_since(arrival));
        let name = meta.class.clone();
        let expire = class.and_then(|c| c.expire);
        let give_up = expire.map_or(deadline, |e| (arrival + e).min(deadline));
        let (tx, mut rx) = oneshot::channel();
        let key = {
            let mut st = self.st.lock();
            let policy = self.cfg.policy;
            let lane = st.lanes.entry(model.to_string()).or_insert_with(|| Lane::new(policy));
            lane.capacity = capacity;
            lane.burst = capacity / self.cfg.per_worker.max(1);
            if lane.waiting.class_full(&name, self.cfg.bound) {
                let waiting = lane.waiting.len();
                let per_slot = if lane.hold_ms > 0.0 { lane.hold_ms } else { 1000.0 };
                let retry_ms = (per_slot * (waiting + 1) as f64 / capacity as f64).ceil() as u64;
                st.count(&name).shed += 1;
                return Admitted::Refused(EngineError::Overloaded {
                    waiting,
                    retry_after_ms: Some(retry_ms.clamp(1, 3_600_000)),
                });
            }
            let key = lane.waiting.push(meta, Waiter { tx });
            lane.dispatch();
            key
        };
        let granted = tokio::select! {
            r = &mut rx => r.ok(),
            () = tokio::time::sleep_until(give_up) => None,
            () = closed => None,
        };
        let granted = match granted {
            Some(at) => Some(at),
            None => {
                // Out of the queue, unless a slot was granted in the meantime.
                let mut st = self.st.lock();
                let lane = st.lanes.get_mut(model);
                let removed = lane.and_then(|l| l.waiting.remove(key)).is_some();
                if removed {
                    let ended_by_time = Instant::now() >= give_up;
                    if ended_by_time {
                        st.count(&name).expired += 1;
                    }
                    st.tidy(model);
                    drop(st);
                    if !ended_by_time {
                        return Admitted::Gone;
                    }
                    let timeout = match expire {
                        Some(e) if arrival + e <= deadline => e,
                        _ => deadline.saturating_duration_since(arrival),
                    };
                    return Admitted::Refused(EngineError::Deadline { timeout });
                }
                drop(st);
                rx.try_recv().ok()
            }
        };
        let Some(at) = granted else {
            // The sender went away without a slot: the queue is gone.
            return Admitted::Refused(EngineError::Stopped);
        };
        let waited = at.saturating_duration_since(arrival);
        if waited > Duration::from_millis(1) {
            self.st.lock().count(&name).queued += 1;
        }
        let held = Held { st: self.st.clone(), model: model.to_string(), class: name, since: at };
        Admitted::Go { permit: Permit { held: Some(held) }, waited }
    }

    /// Each class's counters (classes ordered by name).
    pub fn stats(&self) -> Vec<PendingClassStats> {
        let st = self.st.lock();
        let mut out = st.stats.clone();
        for lane in st.lanes.values() {
            for (class, n) in lane.waiting.classes() {
                let key = if out.contains_key(class) || out.len() < CLASSES_COUNTED_MAX {
                    class.to_string()
                } else {
                    "other".to_string()
                };
                let row = out
                    .entry(key.clone())
                    .or_insert_with(|| PendingClassStats { class: key, ..Default::default() });
                row.waiting += n as u64;
            }
        }
        out.into_values().collect()
    }
}

impl State {
    fn count(&mut self, class: &str) -> &mut PendingClassStats {
        let key = if self.stats.contains_key(class) || self.stats.len() < CLASSES_COUNTED_MAX {
            class
        } else {
            "other"
        };
        self.stats
            .entry(key.to_string())
            .or_insert_with(|| PendingClassStats { class: key.to_string(), ..Default::default() })
    }

    /// Forgets a model's lane with nothing in it.
    fn tidy(&mut self, model: &str) {
        if self.lanes.get(model).is_some_and(|l| l.in_flight == 0 && l.waiting.is_empty()) {
            self.lanes.remove(model);
        }
    }
}

impl Lane {
    /// Hands free slots to waiting requests, as the admission queue chooses
    /// ([`Queue::next_for_slot`]): the first in order whose class is within its share
    /// (while other classes wait), else the first; with every slot taken, a burst slot to
    /// the first latency-class request.
    fn dispatch(&mut self) {
        loop {
            let slots = Slots {
                capacity: self.capacity,
                burst: self.burst,
                in_flight: self.in_flight,
                held: &self.held,
            };
            let Some(place): Option<Place<Instant>> = self.waiting.next_for_slot(&slots) else {
                break;
            };
            let Some((meta, w)) = self.waiting.remove(place) else { break };
            if w.tx.send(Instant::now()).is_ok() {
                self.in_flight += 1;
                *self.held.entry(meta.class).or_default() += 1;
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(h) = self.held.take() else { return };
        let mut st = h.st.lock();
        if let Some(lane) = st.lanes.get_mut(&h.model) {
            lane.in_flight = lane.in_flight.saturating_sub(1);
            if let Some(n) = lane.held.get_mut(&h.class) {
                *n -= 1;
                if *n == 0 {
                    lane.held.remove(&h.class);
                }
            }
            let ms = h.since.elapsed().as_secs_f64() * 1000.0;
            lane.hold_ms = if lane.hold_ms == 0.0 { ms } else { 0.9 * lane.hold_ms + 0.1 * ms };
            lane.dispatch();
        }
        st.tidy(&h.model);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(name: &str, ttft_ms: u64) -> ClassHint {
        ClassHint {
            name: name.into(),
            rank: 0,
            priority: 0,
            ttft: Some(Duration::from_millis(ttft_ms)),
            itl: None,
            expire: None,
            share: None,
        }
    }

    fn queue(per_worker: usize, bound: usize, policy: QueuePolicy) -> Pending {
        Pending::new(PendingConfig { per_worker, bound, policy })
    }

    async fn go(a: Admitted) -> Permit {
        match a {
            Admitted::Go { permit, .. } => permit,
            other => panic!("not admitted: {other:?}"),
        }
    }

    /// Requests that wait are sent earliest deadline first (a later interactive request
    /// before an earlier batch one); under fcfs, in arrival order.
    #[tokio::test]
    async fn waiting_requests_go_by_deadline() {
        for (policy, want) in [
            (QueuePolicy::Edf, vec!["interactive", "batch-1", "batch-2"]),
            (QueuePolicy::Fcfs, vec!["batch-1", "batch-2", "interactive"]),
        ] {
            let q = queue(1, 8, policy);
            let far = Instant::now() + Duration::from_secs(60);
            let now = Instant::now();
            let first = go(q.admit("m", None, now, far, 1, std::future::pending()).await).await;
            let order = Arc::new(Mutex::new(Vec::new()));
            let mut tasks = Vec::new();
            for (name, ttft) in [("batch-1", 30_000), ("batch-2", 30_000), ("interactive", 300)] {
                let (q, order) = (q.clone(), order.clone());
                let arrival = Instant::now();
                tasks.push(tokio::spawn(async move {
                    let c = class(name.split('-').next().unwrap(), ttft);
                    let p =
                        go(q.admit("m", Some(&c), arrival, far, 1, std::future::pending()).await)
                            .await;
                    order.lock().push(name);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    drop(p);
                }));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(q.stats().iter().map(|s| s.waiting).sum::<u64>(), 3);
            drop(first);
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(*order.lock(), want, "{policy:?}");
            assert!(q.st.lock().lanes.is_empty(), "nothing left held");
        }
    }

    /// A class's queue is bounded: one more is refused with a retry time; other classes
    /// still queue.
    #[tokio::test]
    async fn a_full_class_queue_refuses_with_retry_after() {
        let q = queue(1, 1, QueuePolicy::Edf);
        let far = Instant::now() + Duration::from_secs(60);
        let _held = go(q.admit("m", None, Instant::now(), far, 1, std::future::pending()).await);
        let batch = class("batch", 30_000);
        let q2 = q.clone();
        let b2 = batch.clone();
        let waiter = tokio::spawn(async move {
            q2.admit("m", Some(&b2), Instant::now(), far, 1, std::future::pending()).await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        match q.admit("m", Some(&batch), Instant::now(), far, 1, std::future::pending()).await {
            Admitted::Refused(EngineError::Overloaded { waiting, retry_after_ms }) => {
                assert_eq!(waiting, 1);
                assert!(retry_after_ms.is_some_and(|ms| ms > 0));
            }
            other => panic!("not refused: {other:?}"),
        }
        let s = q.stats();
        let b = s.iter().find(|s| s.class == "batch").unwrap();
        assert_eq!((b.shed, b.waiting), (1, 1));
        waiter.abort();
    }

    /// A request whose class's expire passes while it waits is answered then (504), counted,
    /// and never takes a slot; one whose client left goes quietly.
    #[tokio::test]
    async fn a_request_expires_in_the_queue_and_a_gone_client_leaves_it() {
        let q = queue(1, 8, QueuePolicy::Edf);
        let far = Instant::now() + Duration::from_secs(60);
        let held = go(q.admit("m", None, Instant::now(), far, 1, std::future::pending()).await);
        let short = ClassHint { expire: Some(Duration::from_millis(30)), ..class("batch", 1000) };
        let t0 = Instant::now();
        match q.admit("m", Some(&short), t0, far, 1, std::future::pending()).await {
            Admitted::Refused(EngineError::Deadline { timeout }) => {
                assert_eq!(timeout, Duration::from_millis(30));
            }
            other => panic!("not expired: {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        let gone = q
            .admit("m", Some(&class("batch", 1000)), Instant::now(), far, 1, async {
                tokio::time::sleep(Duration::from_millis(10)).await
            })
            .await;
        assert!(matches!(gone, Admitted::Gone), "{gone:?}");
        let s = q.stats();
        let b = s.iter().find(|s| s.class == "batch").unwrap();
        assert_eq!((b.expired, b.waiting, b.queued), (1, 0, 0));
        drop(held);
        assert!(q.st.lock().lanes.is_empty());
    }

    /// With every slot taken, a latency-class request (one with an ITL target) takes a burst
    /// slot at once (one per worker), and a second one waits; batch requests never burst.
    #[tokio::test]
    async fn a_latency_request_takes_a_burst_slot_and_batch_waits() {
        let q = queue(1, 8, QueuePolicy::Edf);
        let far = Instant::now() + Duration::from_secs(60);
        let batch = class("batch", 30_000);
        let held =
            go(q.admit("m", Some(&batch), Instant::now(), far, 1, std::future::pending()).await)
                .await;
        let (q2, b2) = (q.clone(), batch.clone());
        let waiting = tokio::spawn(async move {
            go(q2.admit("m", Some(&b2), Instant::now(), far, 1, std::future::pending()).await).await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let chat = ClassHint { itl: Some(Duration::from_millis(50)), ..class("interactive", 300) };
        let t0 = Instant::now();
        let burst =
            go(q.admit("m", Some(&chat), Instant::now(), far, 1, std::future::pending()).await)
                .await;
        assert!(t0.elapsed() < Duration::from_millis(50), "admitted at once");
        assert!(!waiting.is_finished(), "the batch request still waits");
        let (q3, c3) = (q.clone(), chat.clone());
        let second = tokio::spawn(async move {
            go(q3.admit("m", Some(&c3), Instant::now(), far, 1, std::future::pending()).await).await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!second.is_finished(), "one burst slot per worker");
        drop(held);
        drop(burst);
        // Two slots freed (one of them the burst): the interactive request first.
        drop(second.await.unwrap());
        drop(waiting.await.unwrap());
        assert!(q.st.lock().lanes.is_empty());
    }

    /// A class with a share holds at most that share of the slots while another class
    /// waits; alone, it may use them all.
    #[tokio::test]
    async fn a_class_holds_its_share_while_others_wait() {
        let q = queue(1, 16, QueuePolicy::Fcfs);
        let far = Instant::now() + Duration::from_secs(60);
        let batch = ClassHint { share: Some(0.5), ..class("batch", 30_000) };
        let mut permits = Vec::new();
        // Alone, batch takes all four slots.
        for _ in 0..4 {
            let a = q.admit("m", Some(&batch), Instant::now(), far, 4, std::future::pending());
            permits.push(go(a.await).await);
        }
        // Two more batch requests, then one interactive, wait.
        let mut tasks = Vec::new();
        let order = Arc::new(Mutex::new(Vec::new()));
        for c in [batch.clone(), batch.clone(), class("interactive", 300)] {
            let (q, order) = (q.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let p = go(q
                    .admit("m", Some(&c), Instant::now(), far, 4, std::future::pending())
                    .await)
                .await;
                order.lock().push(c.name.clone());
                p
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The first slot freed goes to the interactive request (batch holds 3 of 4, over its
        // share of 2) although two batch requests came first; the next, with only batch
        // waiting, to batch.
        permits.drain(..2);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(*order.lock(), vec!["interactive", "batch"]);
        permits.clear();
        for t in tasks {
            drop(t.await.unwrap());
        }
    }
}
