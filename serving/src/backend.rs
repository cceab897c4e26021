//! What the HTTP frontend serves from: one engine in this process ([`LocalBackend`]), or the
//! workers that discovery knows (`crate::routed::RoutedBackend`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvfabric_tiers::TieredStore;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{EngineError, GenEvent, GenerateRequest, ModelInfo, Scheduler, TextCodec};
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
    fn submit(
        &self,
        model: &str,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<GenEvent>, EngineError>;
    /// A JSON summary for `/health`.
    fn health(&self) -> Value;
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

    fn submit(
        &self,
        _model: &str,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<GenEvent>, EngineError> {
        self.sched.submit(req)
    }

    fn health(&self) -> Value {
        let s = self.sched.stats();
        if let Some(reason) = self.sched.failure() {
            return json!({ "status": "failed", "reason": reason, "model": self.entry.info.id });
        }
        let degraded = self.store.degraded();
        let failed: u64 = self.store.agent().transfer_counts().iter().map(|c| c.failed).sum();
        let cuda = match kvfabric::cuda::device_names() {
            Ok(names) => json!({ "available": true, "devices": names }),
            Err(why) => json!({ "available": false, "reason": why.to_string() }),
        };
        json!({
            "status": if degraded.is_empty() { "ok" } else { "degraded" },
            "reasons": degraded,
            "model": self.entry.info.id,
            "running": s.running.load(Ordering::Relaxed),
            "waiting": s.waiting.load(Ordering::Relaxed),
            "transfers_failed": failed,
            "cuda": cuda,
            "rdma": self.store.agent().rdma_status(),
        })
    }

    fn metrics(&self, out: &mut Snapshot) {
        out.engine = Some(engine_snapshot(&self.sched, &self.store));
        out.transfers = self.store.agent().transfer_counts();
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
        store: Some(store.metrics()),
    }
}
