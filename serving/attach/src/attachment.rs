//! An engine that is not kvfabric's (vLLM, SGLang) as a worker of kvfabric's routers:
//! `kvfabric attach` runs one [`Attachment`] beside each engine instance.
//!
//! - It registers the engine in discovery under a lease, as a worker whose requests go to the
//!   engine's OpenAI-compatible API ([`WorkerApi::OpenAi`]), once the engine answers, and
//!   withdraws it when the engine stops answering (`down_after` failed polls in a row).
//! - It subscribes to the engine's own KV events over ZeroMQ (with replay), maps them to
//!   kvfabric's block hashes and tiers ([`EngineMirror`]), and publishes them on the bus as
//!   this worker's KV events, numbered in one sequence; it answers dump requests from its
//!   mirror, and publishes a dump after each registration.
//! - It reports the engine's load from the engine's own Prometheus metrics (running and
//!   waiting requests, KV cache usage).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvfabric::contract::discovery::{
    CodecSpec, ModelInfo, Role, WorkerApi, WorkerMetadata, WORKER_KIND,
};
use kvfabric::contract::{self, Load, Message};
use kvfabric::control::{ControlError, Discovery, EventBus, Instance, Registration};
use kvfabric::events::{KvEvent, KvEventData};
use parking_lot::Mutex;

use crate::engine::{
    decode_batch, EngineMirror, FeedItem, Flavor, MirrorStats, Subscriber, SubscriberConfig,
};
use crate::http;

/// What to attach.
#[derive(Debug, Clone)]
pub struct AttachConfig {
    /// The worker's name in discovery (and the source of its KV events).
    pub name: String,
    /// The engine's HTTP address (its OpenAI-compatible API, `/health`, `/metrics`).
    pub engine: SocketAddr,
    /// The model name the engine serves.
    pub engine_model: String,
    /// The engine schedules by `priority` (vLLM `--scheduling-policy priority`): requests'
    /// classes are forwarded to it as their priority.
    pub priority: bool,
    /// The model as the frontend serves it (id, context, KV layout with the engine's block
    /// size).
    pub model: ModelInfo,
    /// How the frontend tokenizes for it.
    pub codec: CodecSpec,
    /// Which engine publishes the events.
    pub flavor: Flavor,
    /// Where its KV events come from.
    pub events: SubscriberConfig,
    /// The discovery lease.
    pub lease_ttl: Duration,
    /// How often the engine's health and metrics are read.
    pub poll: Duration,
    /// Failed polls in a row after which the engine is withdrawn from discovery.
    pub down_after: u32,
}

/// Counters of an attachment.
#[derive(Debug, Default)]
pub struct AttachStats {
    /// Event batches applied.
    pub batches: AtomicU64,
    /// kvfabric KV events published.
    pub events: AtomicU64,
    /// Payloads that could not be decoded, and messages that are not the engine's shape.
    pub malformed: AtomicU64,
    /// Replays of lost events that could not be asked for or broke off (refused, timed out).
    pub replay_failures: AtomicU64,
    /// Times the engine's blocks were dropped because events were lost for good.
    pub resets: AtomicU64,
    /// Dumps published.
    pub dumps: AtomicU64,
    /// Polls of the engine that failed.
    pub failed_polls: AtomicU64,
    /// 1 while registered in discovery.
    pub registered: AtomicU64,
    /// The mirror's counters (skipped blocks and why).
    pub mirror: Mutex<MirrorStats>,
    /// Blocks the engine holds, as its events say.
    pub blocks: AtomicU64,
}

impl AttachStats {
    /// The attachment's part of `/health`: registered while the engine answers (else the
    /// process is `engine not answering`), with the counts of what went wrong.
    pub fn health(&self) -> kvfabric::health::AttachHealth {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        kvfabric::health::AttachHealth {
            registered: ld(&self.registered) == 1,
            engine_blocks: ld(&self.blocks),
            failed_health_checks: ld(&self.failed_polls),
            events_malformed: ld(&self.malformed),
            replay_failures: ld(&self.replay_failures),
            resets: ld(&self.resets),
        }
    }

    /// The counters now, for a scrape.
    pub fn snapshot(&self) -> AttachSnapshot {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let m = *self.mirror.lock();
        AttachSnapshot {
            batches: ld(&self.batches),
            events: ld(&self.events),
            malformed: ld(&self.malformed),
            replay_failures: ld(&self.replay_failures),
            resets: ld(&self.resets),
            dumps: ld(&self.dumps),
            failed_polls: ld(&self.failed_polls),
            registered: ld(&self.registered),
            blocks: ld(&self.blocks),
            skipped: vec![
                ("block_size", m.skipped_block_size),
                ("lora", m.skipped_lora),
                ("extra_keys", m.skipped_unkeyable),
                ("group", m.skipped_group),
                ("orphan", m.orphans),
                ("medium", m.unknown_medium),
                ("invalid", m.invalid),
            ],
        }
    }
}

/// An attached engine as a scrape shows it (its KV events and health).
#[derive(Debug, Clone, Default)]
pub struct AttachSnapshot {
    /// Engine event batches applied.
    pub batches: u64,
    /// kvfabric KV events published for the engine.
    pub events: u64,
    /// Payloads or messages that are not the engine's shape.
    pub malformed: u64,
    /// Replays of lost events that failed.
    pub replay_failures: u64,
    /// Times the engine's blocks were dropped because its events were lost for good.
    pub resets: u64,
    /// Dumps published.
    pub dumps: u64,
    /// Failed health checks of the engine.
    pub failed_polls: u64,
    /// 1 while the engine is registered in discovery.
    pub registered: u64,
    /// Blocks the engine holds, as its events say.
    pub blocks: u64,
    /// Blocks skipped, by reason (block size, LoRA, extra keys, group, orphan, medium).
    pub skipped: Vec<(&'static str, u64)>,
}

/// Why an attachment could not start.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The control plane refused.
    #[error("control plane: {0}")]
    Control(#[from] ControlError),
    /// The events endpoint could not be opened.
    #[error("KV events: {0}")]
    Events(#[from] crate::engine::zmtp::ZmtpError),
    /// A setting is wrong.
    #[error("{0}")]
    Invalid(String),
}

/// A running attachment; dropping it stops it (and its registration's lease then expires).
#[derive(Debug)]
pub struct Attachment {
    stats: Arc<AttachStats>,
    bound: Option<SocketAddr>,
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Attachment {
    /// Starts following the engine.
    pub async fn start(
        cfg: AttachConfig,
        discovery: Arc<dyn Discovery>,
        bus: Arc<dyn EventBus>,
    ) -> Result<Attachment, AttachError> {
        kvfabric::control::check_name(&cfg.name)?;
        let mirror = EngineMirror::new(cfg.model.layout.block_tokens);
        let sub = Subscriber::start(cfg.events.clone()).await?;
        let bound = sub.bound();
        let requests = bus.subscribe(contract::KV_DUMP_REQUEST).await?;
        let stats = Arc::new(AttachStats::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let run = Run {
            cfg,
            discovery,
            bus,
            stats: stats.clone(),
            mirror,
            next_id: 1,
            registration: None,
            fails: 0,
            dump_due: false,
            out: Vec::new(),
            warned: 0,
        };
        let task = tokio::spawn(run.go(sub, requests, stopped));
        Ok(Attachment { stats, bound, task, stop })
    }

    /// The counters.
    pub fn stats(&self) -> &AttachStats {
        &self.stats
    }

    /// The counters, shared (a metrics source).
    pub fn stats_source(&self) -> Arc<AttachStats> {
        self.stats.clone()
    }

    /// The address the events endpoint is bound to (an engine that connects).
    pub fn bound(&self) -> Option<SocketAddr> {
        self.bound
    }

    /// Withdraws the engine from discovery and stops.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        let task = std::mem::replace(&mut self.task, tokio::spawn(async {}));
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
}

struct Run {
    cfg: AttachConfig,
    discovery: Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
    stats: Arc<AttachStats>,
    mirror: EngineMirror,
    next_id: u64,
    registration: Option<Registration>,
    fails: u32,
    dump_due: bool,
    out: Vec<KvEventData>,
    /// Malformed payloads logged so far (logged at the 1st, 2nd, 4th, 8th...).
    warned: u64,
}

impl Run {
    async fn go(
        mut self,
        mut sub: Subscriber,
        mut requests: tokio::sync::mpsc::Receiver<Vec<u8>>,
        mut stopped: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                item = sub.recv() => match item {
                    Some(item) => self.on_item(item).await,
                    None => break,
                },
                r = requests.recv() => match r {
                    Some(bytes) => {
                        if let Ok(Message::DumpRequest { worker, .. }) = Message::decode(&bytes) {
                            if worker == self.cfg.name {
                                self.dump().await;
                            }
                        }
                    }
                    None => break,
                },
                _ = tick.tick() => self.poll().await,
                _ = stopped.changed() => break,
            }
        }
        if let Some(r) = self.registration.take() {
            r.revoke().await;
            tracing::info!(worker = %self.cfg.name, "engine withdrawn from discovery");
        }
    }

    async fn publish(&mut self, data: KvEventData) {
        let event = KvEvent { event_id: self.next_id, data };
        self.next_id += 1;
        let msg = Message::KvEvent { source: self.cfg.name.clone(), event };
        // A failed publish is a gap for routers: they ask for a dump.
        let _ = self.bus.publish(msg.topic(), msg.encode()).await;
        self.stats.events.fetch_add(1, Ordering::Relaxed);
    }

    async fn dump(&mut self) {
        let msg = Message::KvDump {
            source: self.cfg.name.clone(),
            blocks: self.mirror.dump(),
            last_event_id: self.next_id - 1,
        };
        if self.bus.publish(msg.topic(), msg.encode()).await.is_ok() {
            self.stats.dumps.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn malformed(&mut self, what: std::fmt::Arguments<'_>) {
        let n = self.stats.malformed.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() && n > self.warned {
            self.warned = n;
            tracing::warn!(worker = %self.cfg.name, count = n, "engine KV events: {what}");
        }
    }

    async fn on_item(&mut self, item: FeedItem) {
        match item {
            FeedItem::Batch { seq, payload } => match decode_batch(&payload, self.cfg.flavor) {
                Ok(batch) => {
                    self.stats.batches.fetch_add(1, Ordering::Relaxed);
                    let mut out = std::mem::take(&mut self.out);
                    self.mirror.apply(&batch, &mut out);
                    *self.stats.mirror.lock() = self.mirror.stats();
                    self.stats.blocks.store(self.mirror.len() as u64, Ordering::Relaxed);
                    for data in out.drain(..) {
                        self.publish(data).await;
                    }
                    self.out = out;
                }
                Err(e) => self.malformed(format_args!("batch {seq} is malformed: {e}")),
            },
            FeedItem::Reset { reason } => {
                self.stats.resets.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(worker = %self.cfg.name, %reason, "engine KV events lost: its blocks are dropped and rebuilt from new events");
                let cleared = self.mirror.clear();
                self.stats.blocks.store(0, Ordering::Relaxed);
                self.publish(cleared).await;
            }
            FeedItem::Connected { peer } => {
                tracing::info!(worker = %self.cfg.name, %peer, "engine KV events connected");
            }
            FeedItem::Disconnected { reason } => {
                tracing::info!(worker = %self.cfg.name, %reason, "engine KV events disconnected");
            }
            FeedItem::Malformed { reason } => self.malformed(format_args!("{reason}")),
            FeedItem::ReplayFailed { reason } => {
                let n = self.stats.replay_failures.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(worker = %self.cfg.name, count = n, %reason, "engine KV events: a replay failed");
                }
            }
        }
    }

    async fn poll(&mut self) {
        if self.dump_due {
            self.dump_due = false;
            self.dump().await;
        }
        let timeout = self.cfg.poll.max(Duration::from_millis(200));
        let health = http::get(self.cfg.engine, "/health", timeout).await;
        let ok = matches!(health, Ok((200, _)));
        if !ok {
            self.stats.failed_polls.fetch_add(1, Ordering::Relaxed);
            self.fails += 1;
            if self.fails >= self.cfg.down_after {
                if let Some(r) = self.registration.take() {
                    let why = match health {
                        Ok((s, _)) => format!("/health answered {s}"),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(worker = %self.cfg.name, engine = %self.cfg.engine, %why, "the engine stopped answering: withdrawn from discovery, its blocks forgotten");
                    self.stats.registered.store(0, Ordering::Relaxed);
                    r.revoke().await;
                    // An engine that comes back has restarted with an empty cache, as far as
                    // anyone can tell: routers must not credit it with the old blocks. What
                    // it holds then comes in its new events.
                    let cleared = self.mirror.clear();
                    self.stats.blocks.store(0, Ordering::Relaxed);
                    self.publish(cleared).await;
                }
            }
            return;
        }
        self.fails = 0;
        if self.registration.is_none() {
            self.register().await;
        }
        if let Ok((200, text)) = http::get(self.cfg.engine, "/metrics", timeout).await {
            if let Some(load) = engine_load(
                &String::from_utf8_lossy(&text),
                self.cfg.model.layout.block_tokens.get(),
            ) {
                let msg = Message::Load { source: self.cfg.name.clone(), load, stats: None };
                let _ = self.bus.publish(msg.topic(), msg.encode()).await;
            }
        }
    }

    async fn register(&mut self) {
        let md = WorkerMetadata {
            model: self.cfg.model.clone(),
            codec: self.cfg.codec.clone(),
            addr: self.cfg.engine,
            role: Role::Aggregated,
            api: WorkerApi::OpenAi {
                model: self.cfg.engine_model.clone(),
                priority: self.cfg.priority,
            },
            store: None,
        };
        let Ok(metadata) = serde_json::to_value(&md) else { return };
        let instance = Instance { kind: WORKER_KIND.into(), id: self.cfg.name.clone(), metadata };
        match self.discovery.register(instance, self.cfg.lease_ttl).await {
            Ok(r) => {
                tracing::info!(worker = %self.cfg.name, engine = %self.cfg.engine, model = %self.cfg.model.id, "engine registered in discovery");
                self.registration = Some(r);
                self.stats.registered.store(1, Ordering::Relaxed);
                self.dump_due = true;
            }
            Err(e) => {
                tracing::warn!(worker = %self.cfg.name, error = %e, "registering the engine failed (retried)");
            }
        }
    }
}

/// The load an engine reports in its Prometheus metrics (vLLM's `vllm:` or SGLang's
/// `sglang:` families): blocks of the requests it runs (KV cache usage × its blocks, or
/// running requests × the mean prompt length), and prompt tokens waiting (waiting requests ×
/// the mean prompt length). None when the text has neither family.
pub fn engine_load(text: &str, block_tokens: u32) -> Option<Load> {
    let mut sums: HashMap<&str, f64> = HashMap::new();
    let mut gpu_blocks: Option<f64> = None;
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l),
            None => (series, ""),
        };
        if name == "vllm:cache_config_info" {
            if let Some(i) = labels.find("num_gpu_blocks=\"") {
                let rest = &labels[i + 16..];
                gpu_blocks = rest.split('"').next().and_then(|n| n.parse().ok());
            }
        }
        if v.is_finite() {
            *sums.entry(name).or_insert(0.0) += v;
        }
    }
    let get = |names: &[&str]| names.iter().find_map(|n| sums.get(n).copied());
    let running = get(&["vllm:num_requests_running", "sglang:num_running_reqs"])?;
    let waiting = get(&["vllm:num_requests_waiting", "sglang:num_queue_reqs"]).unwrap_or(0.0);
    let mean_prompt = match (
        get(&["vllm:request_prompt_tokens_sum", "sglang:prompt_tokens_histogram_sum"]),
        get(&["vllm:request_prompt_tokens_count", "sglang:prompt_tokens_histogram_count"]),
    ) {
        (Some(s), Some(c)) if c > 0.0 => s / c,
        _ => 512.0,
    };
    let usage =
        get(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"]);
    let bt = f64::from(block_tokens.max(1));
    let active = match (usage, gpu_blocks) {
        (Some(u), Some(b)) => u.clamp(0.0, 1.0) * b,
        _ => running * mean_prompt / bt,
    };
    Some(Load {
        active_blocks: active.clamp(0.0, 1e12) as u64,
        queued_prefill_tokens: (waiting * mean_prompt).clamp(0.0, 1e15) as u64,
        // The engine numbers no requests: each report replaces what routers tracked.
        accepted: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_from_vllm_and_sglang_metrics() {
        let vllm = "# HELP vllm:num_requests_running x\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1.0\n\
            vllm:request_prompt_tokens_sum{engine=\"0\"} 3000.0\n\
            vllm:request_prompt_tokens_count{engine=\"0\"} 10.0\n";
        let l = engine_load(vllm, 16).unwrap();
        assert_eq!((l.active_blocks, l.queued_prefill_tokens), (250, 600));
        let sglang = "sglang:num_running_reqs{tp_rank=\"0\"} 4\nsglang:num_queue_reqs 1\n";
        let l = engine_load(sglang, 16).unwrap();
        assert_eq!((l.active_blocks, l.queued_prefill_tokens), (128, 512));
        assert!(engine_load("other_metric 1\n", 16).is_none());
    }
}
