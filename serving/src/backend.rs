//! What the HTTP frontend serves from: one engine in this process ([`LocalBackend`]), or the
//! workers that discovery knows (`crate::routed::RoutedBackend`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvfabric_tiers::TieredStore;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{EngineError, GenEvent, GenerateRequest, ModelInfo, Scheduler, TextCodec};
use crate::metrics;

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
    /// Appends the backend's own metrics (Prometheus text).
    fn render_metrics(&self, out: &mut String);
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
        json!({
            "status": "ok",
            "model": self.entry.info.id,
            "running": s.running.load(Ordering::Relaxed),
            "waiting": s.waiting.load(Ordering::Relaxed),
        })
    }

    fn render_metrics(&self, out: &mut String) {
        render_engine_metrics(out, &self.sched, &self.store);
    }
}

/// The engine's and the store's metrics.
pub fn render_engine_metrics(out: &mut String, sched: &Scheduler, store: &TieredStore) {
    let s = sched.stats();
    let t = store.metrics();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    metrics::labelled(
        out,
        "kvfabric_kv_hit_tokens_total",
        "counter",
        "Prompt tokens served from KV blocks, per tier.",
        "tier",
        &[
            ("host", ld(&s.cached_tokens[0])),
            ("disk", ld(&s.cached_tokens[1])),
            ("remote", ld(&s.cached_tokens[2])),
        ],
    );
    metrics::sample(
        out,
        "kvfabric_prefill_tokens_total",
        "counter",
        "Prompt tokens computed.",
        ld(&s.prefill_tokens),
    );
    metrics::labelled(
        out,
        "kvfabric_kv_block_hits_total",
        "counter",
        "Block lookups that hit, per tier.",
        "tier",
        &[("host", t.host_hits), ("disk", t.disk_hits)],
    );
    metrics::labelled(
        out,
        "kvfabric_kv_block_misses_total",
        "counter",
        "Block lookups that missed, per tier.",
        "tier",
        &[("host", t.host_misses), ("disk", t.disk_misses)],
    );
    metrics::labelled(
        out,
        "kvfabric_kv_blocks",
        "gauge",
        "Blocks held, per tier.",
        "tier",
        &[("host", u64::from(t.host_used_blocks)), ("disk", u64::from(t.disk_used_blocks))],
    );
    metrics::labelled(
        out,
        "kvfabric_kv_capacity_blocks",
        "gauge",
        "Block capacity, per tier.",
        "tier",
        &[("host", u64::from(t.host_capacity_blocks)), ("disk", u64::from(t.disk_capacity_blocks))],
    );
    metrics::sample(
        out,
        "kvfabric_kv_stored_blocks_total",
        "counter",
        "Blocks stored by the engine.",
        ld(&s.stored_blocks),
    );
    metrics::sample(
        out,
        "kvfabric_kv_offload_bytes_total",
        "counter",
        "Bytes offloaded host to disk.",
        t.offload_bytes,
    );
    metrics::sample(
        out,
        "kvfabric_kv_onboard_bytes_total",
        "counter",
        "Bytes onboarded disk to host.",
        t.onboard_bytes,
    );
    metrics::sample(
        out,
        "kvfabric_queue_depth",
        "gauge",
        "Requests waiting for a batch slot.",
        ld(&s.waiting),
    );
    metrics::sample(
        out,
        "kvfabric_running_requests",
        "gauge",
        "Requests in the batch.",
        ld(&s.running),
    );
    metrics::sample(out, "kvfabric_engine_steps_total", "counter", "Engine steps.", ld(&s.steps));
}
