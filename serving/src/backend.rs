//! What the HTTP frontend serves from: one engine in this process ([`LocalBackend`]), or the
//! workers that discovery knows (`crate::routed::RoutedBackend`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvfabric::health::Health;
use kvfabric_tiers::TieredStore;
use serde_json::{json, Value};

use crate::engine::{EngineError, EventRx, GenerateRequest, ModelInfo, Scheduler, TextCodec};
use crate::metrics::{EngineSnapshot, Snapshot, Source};

/// A served model: what it is and how to turn text into its tokens.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    /// The model.
    pub info: ModelInfo,
    /// Its tokenizer and chat template.
    pub codec: Arc<TextCodec>,
}

/// A source of generations for the frontend.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// The models served now.
    fn models(&self) -> Vec<ModelInfo>;
    /// One model, if served.
    fn model(&self, id: &str) -> Option<ModelEntry>;
    /// Starts a generation. Events follow on the channel: `Started` (or `Error`) first.
    /// Dropping the receiver cancels the generation.
    fn submit(&self, model: &str, req: GenerateRequest) -> Result<EventRx, EngineError>;
    /// [`Backend::submit`], and the request's number among those the engine accepted, when
    /// the engine numbers them (its load reports then say which requests they count).
    fn submit_numbered(
        &self,
        model: &str,
        req: GenerateRequest,
    ) -> Result<(EventRx, Option<u64>), EngineError> {
        self.submit(model, req).map(|rx| (rx, None))
    }
    /// Whether [`Backend::submit_numbered`] numbers every request, in the order of the
    /// engine's [`SchedulerStats::accepted`](crate::engine::SchedulerStats::accepted).
    fn numbers_requests(&self) -> bool {
        false
    }
    /// The backend's parts of `/health` (its engine, store and transfers; or its workers),
    /// before [`Health::finish`](kvfabric::health::Health::finish).
    fn health(&self) -> Health;
    /// Fills the backend's part of a metrics snapshot (read at scrape time).
    fn metrics(&self, out: &mut Snapshot);
    /// Where a request of `prompt` for `model` would go and why (each worker's cached blocks
    /// per tier, load and cost), without sending it; with `track`, the request counts as the
    /// chosen worker's load until [`Backend::release`]. Only routing backends route.
    fn explain(&self, _model: &str, _prompt: &[u32], _track: bool) -> Result<Value, EngineError> {
        Err(EngineError::invalid("this server serves one engine: it does not route"))
    }
    /// Ends the tracking of a request that [`Backend::explain`] tracked.
    fn release(&self, _model: &str, _request_id: u64) {}
    /// Its workers and control plane, as `/dashboard` shows them.
    fn dashboard(&self) -> crate::dashboard::BackendView {
        crate::dashboard::BackendView::default()
    }
}

impl Source for Arc<dyn Backend> {
    fn snapshot(&self, out: &mut Snapshot) {
        self.metrics(out);
    }
}

/// One engine and its block store in this process.
#[derive(Debug, Clone)]
pub struct LocalBackend {
    sched: Scheduler,
    store: TieredStore,
    entry: ModelEntry,
}

impl LocalBackend {
    /// Serves `sched`, whose blocks live in `store`.
    pub fn new(sched: Scheduler, store: TieredStore) -> Self {
        let entry =
            ModelEntry { info: sched.info().clone(), codec: Arc::new(sched.codec().clone()) };
        LocalBackend { sched, store, entry }
    }

    /// The scheduler.
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }
}

impl Backend for LocalBackend {
    fn models(&self) -> Vec<ModelInfo> {
        vec![self.entry.info.clone()]
    }

    fn model(&self, id: &str) -> Option<ModelEntry> {
        (id == self.entry.info.id).then(|| self.entry.clone())
    }

    fn submit(&self, _model: &str, req: GenerateRequest) -> Result<EventRx, EngineError> {
        self.sched.submit(req)
    }

    fn submit_numbered(
        &self,
        _model: &str,
        req: GenerateRequest,
    ) -> Result<(EventRx, Option<u64>), EngineError> {
        self.sched.submit_numbered(req).map(|(rx, seq)| (rx, Some(seq)))
    }

    fn numbers_requests(&self) -> bool {
        true
    }

    fn health(&self) -> Health {
        Health {
            model: Some(self.entry.info.id.clone()),
            engine: Some(self.sched.health()),
            store: Some(self.store.health()),
            transfer: Some(self.store.agent().health()),
            ..Health::default()
        }
    }

    fn metrics(&self, out: &mut Snapshot) {
        out.engine = Some(engine_snapshot(&self.sched, &self.store));
        out.transfers = self.store.agent().transfer_counts();
        out.rdma = Some(rdma_state(self.store.agent()));
        out.ports.push(self.store.agent().connection_stats());
        out.foreign_memory = Some(self.store.agent().foreign_memory_refusals());
        out.peers = self.store.peers().map(|p| p.snapshot());
    }

    /// One engine: where the prompt's leading blocks are held in its store.
    fn explain(&self, model: &str, prompt: &[u32], _track: bool) -> Result<Value, EngineError> {
        use kvfabric::events::TierKind;
        if model != self.entry.info.id {
            return Err(EngineError::invalid(format!("the model {model:?} is not served here")));
        }
        let hashes = self.sched.sequence_hashes(prompt);
        let mut held = std::collections::HashMap::new();
        for (tier, hash, _) in self.store.snapshot() {
            let best: &mut TierKind = held.entry(hash).or_insert(tier);
            if (tier as usize) < (*best as usize) {
                *best = tier;
            }
        }
        let mut per_tier = [0u64; 4];
        let mut run = 0u64;
        for h in &hashes {
            let Some(t) = held.get(h) else { break };
            per_tier[*t as usize] += 1;
            run += 1;
        }
        let block_tokens = self.entry.info.layout.block_tokens.as_u64();
        let tiers: serde_json::Map<String, Value> = TierKind::ALL
            .iter()
            .map(|t| (t.name().to_string(), json!(per_tier[*t as usize])))
            .collect();
        let uncached = hashes.len() as f64 - run as f64;
        Ok(json!({
            "model": model,
            "worker": self.entry.info.id,
            "reason": format!(
                "one engine in this process: {run} of {} blocks cached, {} to prefill",
                hashes.len(), uncached
            ),
            "request_id": null,
            "prompt_tokens": prompt.len(),
            "blocks": hashes.len(),
            "block_tokens": block_tokens,
            "mode": "local",
            "workers": [{
                "worker": self.entry.info.id,
                "cached_blocks": run,
                "cached_tokens": run * block_tokens,
                "cached_blocks_per_tier": tiers,
                "active_blocks": 0,
                "queued_prefill_tokens": self.sched.stats().prefill_load(),
                "cost": uncached,
                "cost_terms": { "prefill_blocks": uncached, "decode_load": 0.0, "queued_prefill": 0.0 },
            }],
        }))
    }

    fn dashboard(&self) -> crate::dashboard::BackendView {
        let mut snap = Snapshot::default();
        self.metrics(&mut snap);
        let s = self.sched.stats();
        let draining = s.draining.load(Ordering::Relaxed);
        let stats = crate::metrics::worker_stats(&snap, draining);
        let block_tokens = self.entry.info.layout.block_tokens.as_u64();
        let worker = crate::dashboard::WorkerView {
            name: self.entry.info.id.clone(),
            model: self.entry.info.id.clone(),
            role: "aggregated",
            state: if draining { "draining" } else { "serving" },
            load: kvfabric::contract::Load {
                active_blocks: s.active_tokens.load(Ordering::Relaxed).div_ceil(block_tokens),
                queued_prefill_tokens: s.prefill_load(),
                accepted: None,
            },
            stats: Some(stats),
            ..Default::default()
        };
        crate::dashboard::BackendView { workers: vec![worker], ..Default::default() }
    }
}

/// The engine's and the store's counters now.
pub fn engine_snapshot(sched: &Scheduler, store: &TieredStore) -> EngineSnapshot {
    let s = sched.stats();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    EngineSnapshot {
        hit_tokens: [ld(&s.cached_tokens[0]), ld(&s.cached_tokens[1]), ld(&s.cached_tokens[2])],
        prefill_tokens: ld(&s.prefill_tokens),
        stored_blocks: ld(&s.stored_blocks),
        engine_memory_blocks: ld(&s.engine_memory_blocks),
        waiting: ld(&s.waiting),
        running: ld(&s.running),
        steps: ld(&s.steps),
        remote_declined: ld(&s.remote_declined),
        preempted: ld(&s.preempted),
        preempted_decode: ld(&s.preempted_decode),
        shed: ld(&s.shed),
        expired: ld(&s.expired),
        quota_removed: ld(&s.quota_removed),
        quota_demoted: ld(&s.quota_demoted),
        queue_time: s.queue_time.snapshot(),
        prefill_time: s.prefill_time.snapshot(),
        store: Some(store.metrics()),
    }
}

/// The agent's RDMA transport, for `kvfabric_rdma_state`.
pub(crate) fn rdma_state(agent: &kvfabric::agent::Agent) -> &'static str {
    use kvfabric::endpoint::RdmaStatus;
    match agent.rdma_status() {
        RdmaStatus::Off => "off",
        RdmaStatus::Unavailable { .. } => "unavailable",
        RdmaStatus::Device { .. } if agent.rdma_failure().is_some() => "failed",
        RdmaStatus::Device { .. } => "up",
    }
}
