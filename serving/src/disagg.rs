//! Disaggregated prefill and decode.
//!
//! A decode worker ([`DecodeBackend`]) takes requests from frontends. For each, it counts the
//! prompt's full blocks its own store already holds; when the rest reaches
//! [`DisaggConfig::threshold_tokens`] and fewer than [`DisaggConfig::queue_max`] remote
//! prefills are pending, it reserves host slots for the missing blocks, picks a prefill worker
//! by KV routing among the prefill workers (so that their prefix caches help too), and
//! enqueues a [`PrefillRequest`] on that worker's durable queue (`prefill-NAME`) with its
//! agent's metadata and the slots' descriptors. The prefill worker ([`run_prefill_service`])
//! computes the prompt's KV with its own engine (reusing its own cached blocks), WRITEs the
//! requested blocks with the transfer engine straight into the decode worker's slots,
//! checksummed per block, and notifies. The decode worker commits the slots, which makes them
//! ordinary cached blocks, and serves the request as a cache hit: its engine imports the
//! blocks and computes only the last partial block and the first token. Blocks the decode side
//! already holds are never sent.
//!
//! Failures: a prefill worker that dies, errs or misses the deadline leaves the decode worker
//! to prefill locally; the request completes either way. Reserved slots whose transfer did not
//! complete are held for [`DisaggConfig::grace`] before they are reused, so that a write
//! arriving late cannot land in another block.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvfabric::agent::{Agent, AgentMetadata};
use kvfabric::contract;
use kvfabric::contract::prefill::PrefillHead;
use kvfabric::control::EventBus;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest, TransportKind};
use kvfabric_tiers::{StoreError, TieredStore};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::backend::{Backend, LocalBackend, ModelEntry};
use crate::engine::{
    EngineError, EventRx, EventTx, GenEvent, GenerateRequest, ModelInfo, QueuePolicy,
    RemotePrefill, SamplingParams, Scheduler,
};
use crate::metrics::{PrefillServiceSnapshot, RemotePrefillSnapshot, Snapshot};
use crate::routed::RoutedBackend;

pub use kvfabric::contract::prefill::{BlockTarget, PrefillRequest, PrefillResult};

/// Decode-side settings.
#[derive(Debug, Clone)]
pub struct DisaggConfig {
    /// Remote prefill when at least this many prompt tokens are not cached locally.
    pub threshold_tokens: usize,
    /// Remote prefills pending at most; beyond, prefill locally.
    pub queue_max: usize,
    /// Wait this long for a remote prefill, then prefill locally.
    pub deadline: Duration,
    /// Keep slots of an unfinished transfer reserved this long after giving up on it.
    pub grace: Duration,
    /// Force a transport for the KV writes.
    pub transport: Option<TransportKind>,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            threshold_tokens: 256,
            queue_max: 8,
            deadline: Duration::from_secs(30),
            grace: Duration::from_secs(10),
            transport: None,
        }
    }
}

/// Counters of a decode worker.
#[derive(Debug, Default)]
pub struct DisaggStats {
    /// Prefills done remotely.
    pub remote: AtomicU64,
    /// Prefills done locally (short prompts, full queue, no prefill worker, or fallback).
    pub local: AtomicU64,
    /// Remote prefills that failed or timed out (then done locally).
    pub fallbacks: AtomicU64,
    /// KV bytes received from prefill workers.
    pub bytes: AtomicU64,
    /// Remote prefills pending now.
    pub pending: AtomicU64,
    /// Sum of remote prefill waits (enqueue to notification), microseconds.
    pub wait_us: AtomicU64,
    /// Prefills of a latency class done locally because that was estimated faster than the
    /// prefill pool.
    pub latency_local: AtomicU64,
}

/// What the recent remote prefills cost (moving averages): what a remote prefill of a given
/// prompt is expected to take, against computing it here.
#[derive(Debug, Default, Clone, Copy)]
struct RemoteCost {
    /// Microseconds per prompt token computed on the prefill worker.
    us_per_token: Option<f64>,
    /// Microseconds of a remote prefill that are not its computation: the queue on the
    /// prefill worker, the transfer and the notification.
    overhead_us: Option<f64>,
}

/// A remote prefill is given up (and done locally) after this many times the time the ones
/// before it took (their queue, computation and transfer), plus [`LOST_JOB_FLOOR`].
const LOST_JOB_FACTOR: f64 = 8.0;

/// The least a remote prefill is waited for, once others were seen.
const LOST_JOB_FLOOR: Duration = Duration::from_secs(2);

impl RemoteCost {
    const ALPHA: f64 = 0.2;

    fn observe(&mut self, tokens: usize, wait_us: u64, compute_us: u64) {
        let ewma = |v: &mut Option<f64>, x: f64| {
            *v = Some(v.map_or(x, |v| v + Self::ALPHA * (x - v)));
        };
        if tokens > 0 {
            ewma(&mut self.us_per_token, compute_us as f64 / tokens as f64);
        }
        ewma(&mut self.overhead_us, wait_us.saturating_sub(compute_us) as f64);
    }

    /// Expected microseconds of a remote prefill of `tokens` uncached tokens; None until
    /// one was seen.
    fn estimate_us(&self, tokens: usize) -> Option<f64> {
        Some(self.overhead_us? + tokens as f64 * self.us_per_token?)
    }
}

/// A decode worker: its engine, plus remote prefill.
#[derive(Debug, Clone)]
pub struct DecodeBackend {
    inner: Arc<DecodeInner>,
}

#[derive(Debug)]
struct DecodeInner {
    local: LocalBackend,
    store: TieredStore,
    agent: Agent,
    bus: Arc<dyn EventBus>,
    prefill: RoutedBackend,
    cfg: DisaggConfig,
    stats: DisaggStats,
    remote_cost: Mutex<RemoteCost>,
    waiters: Mutex<HashMap<u64, oneshot::Sender<PrefillResult>>>,
    next_id: AtomicU64,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for DecodeInner {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl DecodeBackend {
    /// A decode worker over `local` (whose store is `store`, owned by `agent`), choosing
    /// prefill workers through `prefill` (a [`RoutedBackend`] of kind [`crate::protocol::PREFILL_KIND`]).
    pub async fn start(
        local: LocalBackend,
        store: TieredStore,
        agent: Agent,
        bus: Arc<dyn EventBus>,
        prefill: RoutedBackend,
        cfg: DisaggConfig,
    ) -> Result<Self, EngineError> {
        let failures = bus
            .subscribe(&contract::prefill_failed(agent.name()))
            .await
            .map_err(|e| EngineError::model(format!("control plane: {e}")))?;
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<DecodeInner>| {
            let mut tasks = Vec::new();
            // Successes arrive as transfer notifications (after the last byte, verified);
            // failures as bus messages. Either completes the waiter.
            let (w1, a1) = (weak.clone(), agent.clone());
            tasks.push(tokio::spawn(async move {
                while let Some(n) = a1.next_notification().await {
                    let Ok(r) = serde_json::from_slice::<PrefillResult>(&n.message) else {
                        continue;
                    };
                    let Some(me) = w1.upgrade() else { return };
                    let waiter = me.waiters.lock().remove(&r.id);
                    if let Some(tx) = waiter {
                        let _ = tx.send(r);
                    }
                }
            }));
            let w2 = weak.clone();
            let mut failures = failures;
            tasks.push(tokio::spawn(async move {
                while let Some(m) = failures.recv().await {
                    let Ok(r) = serde_json::from_slice::<PrefillResult>(&m) else { continue };
                    let Some(me) = w2.upgrade() else { return };
                    let waiter = me.waiters.lock().remove(&r.id);
                    if let Some(tx) = waiter {
                        let _ = tx.send(r);
                    }
                }
            }));
            DecodeInner {
                local,
                store,
                agent,
                bus,
                prefill,
                cfg,
                stats: DisaggStats::default(),
                remote_cost: Mutex::default(),
                waiters: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
                tasks,
            }
        });
        Ok(DecodeBackend { inner })
    }

    /// The counters.
    pub fn stats(&self) -> &DisaggStats {
        &self.inner.stats
    }
}

impl DecodeInner {
    /// Prefills the prompt's missing full blocks on a prefill worker, if worth it; returns
    /// what was done remotely, or None when the engine should prefill (the rest) itself.
    /// Has a prefill worker compute the prompt's missing blocks into this store. The blocks
    /// come back pinned: held until the sequence is admitted (and pins them itself), no
    /// eviction can drop them in between.
    async fn remote_prefill(
        &self,
        model: &str,
        req: &GenerateRequest,
    ) -> Option<(RemotePrefill, Vec<kvfabric_tiers::BlockRef>)> {
        // The blocks' names as the local engine gives them: with the request's salt.
        let hasher = self.local.scheduler().hasher(req.cache_salt.as_deref());
        let bt = hasher.block_tokens().as_usize();
        let prompt = &req.prompt;
        let hashes = hasher.sequence_hashes(prompt);
        let reusable = hashes.len().min(prompt.len().saturating_sub(1) / bt);
        let held = self.store.held_prefix(&hashes[..reusable]);
        let uncached = prompt.len() - held * bt;
        if uncached < self.cfg.threshold_tokens || held == reusable {
            return None;
        }
        if self.faster_here(req, uncached) {
            self.stats.latency_local.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if self.stats.pending.load(Ordering::Relaxed) as usize >= self.cfg.queue_max {
            return None;
        }
        let (rid, worker) = self.prefill.pick(model, &prompt[..reusable * bt])?;
        let release = |outcome| self.prefill.release(model, rid, outcome);
        // Reserve the missing blocks' slots (invisible until committed).
        let mut slots = Vec::with_capacity(reusable - held);
        for i in held..reusable {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            match self.store.allocate(hashes[i], parent).await {
                Ok(s) => slots.push(s),
                Err(e) => {
                    if !matches!(e, StoreError::AlreadyStored(_) | StoreError::BeingWritten(_)) {
                        tracing::warn!(error = %e, "no slots for a remote prefill");
                    }
                    release(false);
                    return None;
                }
            }
        }
        let blocks: Vec<BlockTarget> = slots
            .iter()
            .enumerate()
            .map(|(k, s)| BlockTarget {
                index: held + k,
                at: Desc::new(s.region().id(), s.offset(), s.len()),
            })
            .collect();
        // How long to wait: the configured deadline, or less once remote prefills were
        // seen, [`LOST_JOB_FACTOR`] times what this one should take: a job that the queue
        // lost (a server crash, a partition) or a prefill worker that died with it costs
        // about that, then a local prefill, not the whole deadline.
        let wait = self.remote_cost.lock().estimate_us(uncached).map_or(self.cfg.deadline, |us| {
            let expected = Duration::from_secs_f64(us.max(0.0) * LOST_JOB_FACTOR / 1e6);
            (expected + LOST_JOB_FLOOR).min(self.cfg.deadline)
        });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().insert(id, tx);
        let item = PrefillRequest {
            v: contract::prefill::PREFILL_VERSION,
            id,
            decode: self.agent.metadata(),
            model: model.to_string(),
            tokens: prompt[..reusable * bt].to_vec(),
            blocks,
            transport: self.cfg.transport,
            deadline_unix_ms: unix_ms() + wait.as_millis() as u64,
            cache_salt: req.cache_salt.clone(),
            class: req.class.clone(),
        };
        let started = Instant::now();
        self.stats.pending.fetch_add(1, Ordering::Relaxed);
        let payload = serde_json::to_vec(&item).unwrap_or_default();
        let queued = self.bus.enqueue(&contract::prefill_queue(&worker), payload).await;
        let result = match queued {
            Ok(()) => tokio::time::timeout(wait, rx).await.ok().and_then(Result::ok),
            Err(e) => {
                tracing::warn!(error = %e, "enqueueing a remote prefill failed");
                None
            }
        };
        self.waiters.lock().remove(&id);
        self.stats.pending.fetch_sub(1, Ordering::Relaxed);
        match result {
            Some(r) if r.ok => {
                let n = slots.len();
                let pins: Vec<_> = slots.into_iter().map(|s| s.commit()).collect();
                let wait_us = started.elapsed().as_micros() as u64;
                let bytes = n as u64 * self.store.block_bytes();
                self.stats.remote.fetch_add(1, Ordering::Relaxed);
                self.stats.bytes.fetch_add(bytes, Ordering::Relaxed);
                self.stats.wait_us.fetch_add(wait_us, Ordering::Relaxed);
                self.remote_cost.lock().observe(n * bt, wait_us, r.compute_us);
                release(true);
                let prefill = RemotePrefill {
                    worker,
                    blocks: n,
                    tokens: n * bt,
                    bytes,
                    wait_us,
                    compute_us: r.compute_us,
                };
                Some((prefill, pins))
            }
            other => {
                if let Some(r) = other {
                    tracing::warn!(worker = %worker, error = ?r.error, "remote prefill failed; prefilling locally");
                } else {
                    tracing::warn!(worker = %worker, ?wait, "remote prefill timed out (lost, or far slower than the ones before); prefilling locally");
                }
                self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                release(false);
                // A late write must not land in a reused slot: hold them a while.
                let grace = self.cfg.grace;
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    drop(slots);
                });
                None
            }
        }
    }

    /// A prompt of a latency class (its class has an ITL target) is prefilled here when that
    /// is estimated faster than the prefill pool: here, under deadline order, it goes ahead of
    /// batch prompts and costs its own uncached tokens (first come first served, the queued
    /// prompt tokens too); remotely, the pool's recent overhead (its queue, the transfer) and
    /// its tokens at the pool's measured speed. Without measurements of both: remotely.
    fn faster_here(&self, req: &GenerateRequest, uncached: usize) -> bool {
        if req.class.as_ref().is_none_or(|c| c.itl.is_none()) {
            return false;
        }
        let sched = self.local.scheduler();
        let ns = sched.stats().prefill_ns_per_token.load(Ordering::Relaxed) as f64;
        if ns <= 0.0 {
            return false;
        }
        let mut tokens = uncached as f64;
        if sched.policy() == QueuePolicy::Fcfs {
            tokens += sched.stats().prefill_load() as f64;
        }
        let here_us = tokens * ns / 1e3;
        self.remote_cost.lock().estimate_us(uncached).is_some_and(|remote| here_us <= remote)
    }

    async fn drive(self: Arc<Self>, model: String, req: GenerateRequest, tx: EventTx) {
        let (remote, mut pins) = match tokio::select! {
            r = self.remote_prefill(&model, &req) => r,
            _ = tx.closed() => return,
        } {
            Some((r, pins)) => (Some(r), pins),
            None => (None, Vec::new()),
        };
        if remote.is_none() {
            self.stats.local.fetch_add(1, Ordering::Relaxed);
        }
        let mut rx = match self.local.submit(&model, req) {
            Ok(rx) => rx,
            Err(e) => {
                let _ = tx.send(GenEvent::Error(e));
                return;
            }
        };
        let mut remote = remote;
        loop {
            tokio::select! {
                ev = rx.recv() => {
                    let Some(mut ev) = ev else { return };
                    if let GenEvent::Started { remote_prefill, .. } = &mut ev {
                        *remote_prefill = remote.take();
                        // Admitted: the sequence holds the blocks now.
                        pins.clear();
                    }
                    let last = matches!(ev, GenEvent::Done { .. } | GenEvent::Error(_));
                    if tx.send(ev).is_err() || last {
                        return;
                    }
                }
                // The client left: dropping `rx` cancels the generation.
                _ = tx.closed() => return,
            }
        }
    }
}

impl Backend for DecodeBackend {
    fn models(&self) -> Vec<ModelInfo> {
        self.inner.local.models()
    }

    fn model(&self, id: &str) -> Option<ModelEntry> {
        self.inner.local.model(id)
    }

    fn submit(&self, model: &str, req: GenerateRequest) -> Result<EventRx, EngineError> {
        if self.inner.local.model(model).is_none() {
            return Err(EngineError::invalid(format!("this worker does not serve {model:?}")));
        }
        let (tx, rx) = crate::engine::stream::channel();
        tokio::spawn(self.inner.clone().drive(model.to_string(), req, tx));
        Ok(rx)
    }

    fn health(&self) -> kvfabric::health::Health {
        kvfabric::health::Health {
            prefill: Some(kvfabric::health::PrefillHealth {
                role: "decode".into(),
                pending: self.inner.stats.pending.load(Ordering::Relaxed),
            }),
            ..self.inner.local.health()
        }
    }

    fn metrics(&self, out: &mut Snapshot) {
        self.inner.local.metrics(out);
        let s = &self.inner.stats;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.remote_prefill = Some(RemotePrefillSnapshot {
            remote: ld(&s.remote),
            local: ld(&s.local),
            fallbacks: ld(&s.fallbacks),
            latency_local: ld(&s.latency_local),
            bytes: ld(&s.bytes),
            wait_seconds: ld(&s.wait_us) as f64 / 1e6,
            pending: ld(&s.pending),
        });
    }
}

/// Counters of a prefill worker.
#[derive(Debug, Default)]
pub struct PrefillStats {
    /// Jobs done (blocks written).
    pub done: AtomicU64,
    /// Jobs failed or expired.
    pub failed: AtomicU64,
    /// Bytes written to decode workers.
    pub bytes: AtomicU64,
    /// Sum of transfer times, microseconds.
    pub transfer_us: AtomicU64,
}

impl PrefillStats {
    /// The counters now.
    pub fn snapshot(&self) -> PrefillServiceSnapshot {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PrefillServiceSnapshot {
            done: ld(&self.done),
            failed: ld(&self.failed),
            bytes: ld(&self.bytes),
            transfer_seconds: ld(&self.transfer_us) as f64 / 1e6,
        }
    }
}

/// Serves the queue `prefill-NAME` of a prefill worker until aborted: at most `parallel`
/// jobs at once.
pub fn run_prefill_service(
    agent: Agent,
    sched: Scheduler,
    store: TieredStore,
    bus: Arc<dyn EventBus>,
    parallel: usize,
    stats: Arc<PrefillStats>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let queue = contract::prefill_queue(agent.name());
        let sem = Arc::new(tokio::sync::Semaphore::new(parallel.max(1)));
        let peers: Arc<Mutex<HashMap<String, AgentMetadata>>> = Arc::default();
        loop {
            let Ok(permit) = sem.clone().acquire_owned().await else { return };
            let item =
                match bus.dequeue(&queue, Duration::from_secs(1), Duration::from_secs(60)).await {
                    Ok(Some(item)) => item,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "prefill queue");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
            let (agent, sched, store, bus, stats, peers) = (
                agent.clone(),
                sched.clone(),
                store.clone(),
                bus.clone(),
                stats.clone(),
                peers.clone(),
            );
            tokio::spawn(async move {
                let head = serde_json::from_slice::<PrefillHead>(&item.payload);
                let parsed = serde_json::from_slice::<PrefillRequest>(&item.payload);
                // Acknowledged whatever happens: a job is never redone after a crash of this
                // worker, because its decode worker has long fallen back by then.
                let _ = item.ack().await;
                // A job of another version is answered as such, so that its decode worker
                // falls back at once, knowing why.
                if let Some((head, why)) =
                    head.ok().and_then(|h| h.version_error().map(|why| (h, why)))
                {
                    tracing::warn!(decode = %head.decode.name, reason = %why, "refusing a prefill job");
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    let msg = serde_json::to_vec(&PrefillResult::failed(head.id, 0, why));
                    let topic = contract::prefill_failed(&head.decode.name);
                    let _ = bus.publish(&topic, msg.unwrap_or_default()).await;
                    return;
                }
                let req = match parsed {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "dropping a malformed prefill job");
                        stats.failed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                };
                let decode = req.decode.name.clone();
                let (id, started) = (req.id, Instant::now());
                let r = prefill_job(&agent, &sched, &store, &peers, req, &stats).await;
                drop(permit);
                if let Err(e) = r {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    let msg = PrefillResult::failed(id, started.elapsed().as_micros() as u64, e);
                    let _ = bus
                        .publish(
                            &contract::prefill_failed(&decode),
                            serde_json::to_vec(&msg).unwrap_or_default(),
                        )
                        .await;
                }
            });
        }
    })
}

/// How often a prefill job looks for newly stored blocks to stream.
const STREAM_POLL: Duration = Duration::from_millis(2);
/// Blocks streamed per early transfer at least (fewer wait for the next poll).
const STREAM_MIN_BLOCKS: usize = 8;

/// Posts one WRITE of the requested blocks whose index is in `range` (pinned until the
/// transfer ends) into the decode worker's slots, with checksums and an optional
/// notification. None when no requested block is in the range.
async fn send_blocks(
    agent: &Agent,
    store: &TieredStore,
    req: &PrefillRequest,
    hashes: &[kvfabric::hash::SequenceHash],
    range: std::ops::Range<usize>,
    notify: Option<Vec<u8>>,
) -> Result<Option<(kvfabric::transfer::TransferHandle, u64, Vec<kvfabric_tiers::BlockRef>)>, String>
{
    let wanted: Vec<_> = req.blocks.iter().filter(|b| range.contains(&b.index)).collect();
    if wanted.is_empty() {
        return Ok(None);
    }
    let refs = store.get(&hashes[range.clone()]).await.map_err(|e| e.to_string())?;
    let (mut local, mut remote) = (Vec::new(), Vec::new());
    for b in &wanted {
        let r = refs
            .get(b.index - range.start)
            .ok_or("a computed block was evicted before it was sent")?;
        local.push(Desc::new(r.region().id(), r.offset(), r.len()));
        remote.push(b.at);
    }
    let left = Duration::from_millis(req.deadline_unix_ms.saturating_sub(unix_ms()));
    let mut t = TransferRequest::new(TransferOp::Write, req.decode.name.clone(), local, remote)
        .with_checksum()
        .with_deadline(left.max(Duration::from_millis(1)));
    if let Some(note) = notify {
        t = t.with_notify(note);
    }
    if let Some(kind) = req.transport {
        t = t.with_transport(kind);
    }
    let bytes = t.bytes();
    let handle = agent.post(t).map_err(|e| e.to_string())?;
    Ok(Some((handle, bytes, refs)))
}

async fn prefill_job(
    agent: &Agent,
    sched: &Scheduler,
    store: &TieredStore,
    peers: &Mutex<HashMap<String, AgentMetadata>>,
    req: PrefillRequest,
    stats: &PrefillStats,
) -> Result<(), String> {
    let left = Duration::from_millis(req.deadline_unix_ms.saturating_sub(unix_ms()));
    if left.is_zero() {
        return Err("the job expired in the queue".into());
    }
    if sched.info().id != req.model {
        return Err(format!(
            "this prefill worker serves {:?}, not {:?}",
            sched.info().id,
            req.model
        ));
    }
    let bt = sched.info().layout.block_tokens.as_usize();
    if req.tokens.is_empty() || req.tokens.len() % bt != 0 {
        return Err("the job's tokens are not whole blocks".into());
    }
    let n = req.tokens.len() / bt;
    if req.blocks.iter().any(|b| b.index >= n || b.at.len != store.block_bytes()) {
        return Err("a block target is out of range".into());
    }
    let last_wanted = req.blocks.iter().map(|b| b.index).max().ok_or("no block requested")?;
    {
        let mut known = peers.lock();
        if known.get(&req.decode.name) != Some(&req.decode) {
            agent.load_peer(req.decode.clone()).map_err(|e| e.to_string())?;
            known.insert(req.decode.name.clone(), req.decode.clone());
        }
    }
    // Compute the KV (the engine reuses this worker's own cached blocks and stores the new
    // ones). Blocks are streamed to the decode worker as the engine stores them, chunk by
    // chunk, while the rest of the prompt computes; the last transfer carries the
    // notification, posted once every earlier one has landed.
    let compute = Instant::now();
    let hasher = sched.hasher(req.cache_salt.as_deref());
    let hashes = hasher.sequence_hashes(&req.tokens);
    let mut rx = sched
        .submit(GenerateRequest {
            prompt: req.tokens.clone(),
            max_tokens: 1,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: true,
            timeout: left,
            class: req.class.clone(),
            cache_salt: req.cache_salt.clone(),
            tenant: None,
            pull: None,
        })
        .map_err(|e| e.to_string())?;
    let mut early = Vec::new();
    let (mut sent, mut bytes) = (0usize, 0u64);
    let mut tick = tokio::time::interval(STREAM_POLL);
    loop {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(GenEvent::Done { .. }) => break,
                Some(GenEvent::Error(e)) => return Err(e.to_string()),
                Some(_) => {}
                None => return Err("the engine stopped".into()),
            },
            _ = tick.tick() => {
                // Blocks before `sent` are stored already: look only past them. The last
                // requested block is kept for the final transfer, which carries the
                // notification (a transfer needs at least one byte).
                let held = (sent + store.held_prefix(&hashes[sent..])).min(last_wanted);
                if held >= sent + STREAM_MIN_BLOCKS {
                    if let Some(t) = send_blocks(agent, store, &req, &hashes, sent..held, None).await? {
                        bytes += t.1;
                        early.push(t);
                    }
                    sent = held;
                }
            }
        }
    }
    let compute_us = compute.elapsed().as_micros() as u64;
    let sent_at = Instant::now();
    for (handle, _, refs) in early {
        handle.wait().await.map_err(|e| e.to_string())?;
        drop(refs);
    }
    let note = PrefillResult::done(req.id, compute_us);
    let note = serde_json::to_vec(&note).unwrap_or_default();
    match send_blocks(agent, store, &req, &hashes, sent..n, Some(note)).await? {
        Some((handle, b, refs)) => {
            bytes += b;
            handle.wait().await.map_err(|e| e.to_string())?;
            drop(refs);
        }
        None => return Err("nothing left to notify with".into()),
    }
    stats.done.fetch_add(1, Ordering::Relaxed);
    stats.bytes.fetch_add(bytes, Ordering::Relaxed);
    // The part of the transfer that compute did not hide.
    stats.transfer_us.fetch_add(sent_at.elapsed().as_micros() as u64, Ordering::Relaxed);
    Ok(())
}
