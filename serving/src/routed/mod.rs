//! The routed backend behind a distributed frontend: workers found in discovery, routed by
//! the router crate ([`RoutedBackend`]).
//!
//! Discovery (`worker` instances) tells which workers exist, what model each serves, where
//! its request port is and how to tokenize for it; a model appears with its first worker and
//! disappears with its last. KV events feed one prefix index shared by all models (the
//! router's [`kvfabric_router::feed::IndexFeed`]); load reports (`load`) and the requests this frontend routed feed each model's
//! routing policy. A request is routed (kv, round-robin, random or least-loaded), sent to the
//! worker over the framed TCP protocol ([`crate::protocol`]) and its events relayed. When the
//! worker cannot be reached or fails before any token was sent, the request is retried on
//! another worker; after a token it fails with a clear error. Every wait has the request's
//! deadline.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::control::{Discovery, EventBus};
use kvfabric_router::feed::{worker_id, FeedStats};
use kvfabric_router::membership::{
    Membership, MembershipConfig, Refusal, RouteOptions, Scored, Scores, WorkerEntry,
    REPORTS_STOPPED,
};
use kvfabric_router::{RouterConfig, RoutingMode, WorkerId};
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::backend::{Backend, ModelEntry};
use crate::engine::{
    EngineError, EventRx, EventTx, GenEvent, GenerateRequest, ModelInfo, TextCodec,
};
use crate::metrics::{RoutedSnapshot, Snapshot};
use crate::openai;
use crate::protocol::{
    self, Auth, CodecSpec, WorkerApi, WorkerMetadata, WorkerRequest, WORKER_KIND,
};

mod admission;
pub mod pending;
mod relay;
mod view;

pub use pending::{Pending, PendingClassStats, PendingConfig};

/// Frontend settings.
#[derive(Debug, Clone)]
pub struct RoutedConfig {
    /// Routing policy settings (the mode among them); `block_tokens` is taken from each model.
    pub router: RouterConfig,
    /// Connecting to a worker gives up after this long (then the next worker is tried).
    pub connect_timeout: Duration,
    /// Workers tried per request at most.
    pub attempts_max: usize,
    /// This frontend's name (in dump requests).
    pub name: String,
    /// The discovery kind of the workers it routes to.
    pub kind: String,
    /// The workers' shared secret: every request connection authenticates with it.
    pub secret: kvfabric::secret::Secret,
    /// Mutual TLS to the workers' request ports (when the process has a deployment CA).
    pub tls: Option<Arc<kvfabric::tls::Tls>>,
    /// A worker that sends no first token within this is skipped: the request is retried on
    /// another worker (if its deadline allows), and the slow worker is avoided for
    /// `slow_penalty`, or until it answers in time again.
    pub first_token_timeout: Duration,
    /// How long a worker that did not answer in time is avoided (while others exist).
    pub slow_penalty: Duration,
    /// A stream whose worker sends nothing for this long after its first token has stalled
    /// (a frozen or dead process): the frontend stops waiting for it.
    pub stall_timeout: Duration,
    /// A stream that stalls or breaks after its first token moves to another worker this
    /// many times at most: the new worker continues from the prompt and the tokens already
    /// sent (as Dynamo's request migration does), and the client sees one stream. 0: such a
    /// stream ends with an error.
    pub migrations_max: u32,
    /// A request for a model whose every worker left within this long (a restart of a
    /// one-worker pool) waits, within its deadline, for one to join instead of failing with
    /// 503 (at most [`kvfabric_router::membership::VACATED_KEEP`]; zero: it fails at once).
    pub restart_wait: Duration,
    /// The weight of cache reuse against queue delay when routing a request of a latency
    /// class (one with an ITL target), 0..=1: below 1, such a request goes to a less loaded
    /// worker sooner than to one that holds more of its prompt.
    pub latency_reuse_weight: f64,
    /// The frontend's own queue: how many requests each worker may have in flight before
    /// the next wait here, ordered by deadline, bounded per class.
    pub pending: PendingConfig,
}

impl RoutedConfig {
    /// Defaults, with the workers' shared secret.
    pub fn new(secret: impl Into<kvfabric::secret::Secret>) -> Self {
        RoutedConfig {
            router: RouterConfig::default(),
            connect_timeout: Duration::from_secs(2),
            attempts_max: 3,
            name: "frontend".into(),
            kind: WORKER_KIND.into(),
            secret: secret.into(),
            tls: None,
            first_token_timeout: Duration::from_secs(30),
            slow_penalty: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(10),
            migrations_max: 1,
            restart_wait: Duration::from_secs(30),
            latency_reuse_weight: 0.5,
            pending: PendingConfig::default(),
        }
    }
}

/// Counters of the frontend.
#[derive(Debug, Default)]
pub struct RoutedStats {
    /// Requests routed (attempts).
    pub routed: AtomicU64,
    /// Attempts retried on another worker.
    pub retries: AtomicU64,
    /// Requests that failed after tokens were sent.
    pub failed_mid_stream: AtomicU64,
    /// Requests for which no worker was available.
    pub no_worker: AtomicU64,
    /// Requests refused (429) because every worker tried was overloaded.
    pub overloaded: AtomicU64,
    /// Attempts abandoned because the worker did not answer in time (connection, handshake,
    /// first token); the worker is then avoided for a while.
    pub slow_workers: AtomicU64,
    /// Attempts that waited past the first-token limit for a worker whose engine kept
    /// stepping (a long queue, not a frozen worker).
    pub long_first_token_waits: AtomicU64,
    /// Streams that sent nothing for the inter-token deadline while their worker's engine
    /// kept stepping (paused: preempted for a more urgent class), waited for.
    pub paused_streams: AtomicU64,
    /// Attempts refused by the worker's handshake on the secret.
    pub auth_failures: AtomicU64,
    /// Streams ended because their worker sent nothing for the inter-token deadline.
    pub stalled_streams: AtomicU64,
    /// Attempts abandoned because their worker left discovery and went silent (its host
    /// died or was cut off): retried, or the stream moved.
    pub lost_workers: AtomicU64,
    /// Requests that waited for a worker of their model to join (every worker of it had
    /// left lately: a restart).
    pub held_for_worker: AtomicU64,
    /// Streams moved to another worker after their first worker stalled or broke.
    pub migrations: AtomicU64,
    /// Requests routed per path their prefix took ([`kvfabric_router::Path::ALL`]).
    pub paths: [AtomicU64; 4],
}

#[derive(Debug)]
struct Inner {
    cfg: RoutedConfig,
    discovery: Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
    /// Who can be routed to, and the routing itself (the router crate's service state).
    members: Membership,
    /// Tokenizers, by how workers registered them.
    codecs: Mutex<HashMap<CodecSpec, Arc<TextCodec>>>,
    next_id: AtomicU64,
    stats: RoutedStats,
    /// Authenticated connections to workers, kept between requests.
    pool: protocol::ConnectionPool,
    /// Requests held back while the workers are busy.
    pending: Pending,
    /// Every model a worker in discovery served since this frontend started (at most
    /// [`MODELS_REMEMBERED_MAX`]): `/metrics` says 0 workers for one whose workers all left.
    models_seen: Mutex<std::collections::BTreeSet<String>>,
}

/// Models remembered for `kvfabric_frontend_model_workers`.
const MODELS_REMEMBERED_MAX: usize = 1024;

/// Workers in discovery behind one routing frontend. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RoutedBackend {
    inner: Arc<Inner>,
    task: Arc<tokio::task::JoinHandle<()>>,
}

impl RoutedBackend {
    /// Watches discovery and subscribes to KV events and loads; returns once the workers
    /// registered now are known.
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        bus: Arc<dyn EventBus>,
        cfg: RoutedConfig,
    ) -> Result<Self, EngineError> {
        if cfg.secret.is_empty() {
            return Err(EngineError::invalid(
                "a routed backend needs the workers' shared secret (no secret, no requests)",
            ));
        }
        let ctl =
            |e: kvfabric::control::ControlError| EngineError::model(format!("control plane: {e}"));
        let members = Membership::new(
            bus.clone(),
            MembershipConfig {
                router: cfg.router.clone(),
                name: cfg.name.clone(),
                kind: cfg.kind.clone(),
                slow_penalty: cfg.slow_penalty,
            },
        )
        .await
        .map_err(ctl)?;
        let pending = Pending::new(cfg.pending);
        let inner = Arc::new(Inner {
            pending,
            cfg,
            discovery: discovery.clone(),
            bus,
            members,
            codecs: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stats: RoutedStats::default(),
            pool: protocol::ConnectionPool::default(),
            models_seen: Mutex::new(Default::default()),
        });
        let admit = admission::Admit(Arc::downgrade(&inner));
        let task = inner.members.follow(discovery, admit).await.map_err(ctl)?;
        Ok(RoutedBackend { inner, task: Arc::new(task) })
    }

    /// Waits until at least `n` workers are known (joined through discovery), up to
    /// `timeout`; returns whether they are. A frontend that has just started its own workers
    /// waits here before it takes requests: a worker registered in discovery reaches this
    /// frontend through its watch a little later.
    pub async fn wait_for_workers(&self, n: usize, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.inner.members.read(|m| m.workers.len()) >= n {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// The counters.
    pub fn stats(&self) -> &RoutedStats {
        &self.inner.stats
    }

    /// The engine steps worker `name` had run at its last report (None before one).
    pub fn worker_steps(&self, name: &str) -> Option<u64> {
        self.inner.members.steps(name).map(|(_, steps)| steps)
    }

    /// The counters of the index's feed (KV events applied, gaps, dumps).
    pub fn feed_stats(&self) -> &FeedStats {
        self.inner.members.feed_stats()
    }

    /// Workers in discovery per model, for every model seen (at a metrics scrape) since the
    /// frontend started.
    pub fn model_workers(&self) -> Vec<(String, u64)> {
        let mut now: BTreeMap<String, u64> = BTreeMap::new();
        self.inner.members.read(|m| {
            for w in m.workers.values() {
                *now.entry(w.model.clone()).or_default() += 1;
            }
        });
        let mut seen = self.inner.models_seen.lock();
        for model in now.keys() {
            if seen.len() < MODELS_REMEMBERED_MAX {
                seen.insert(model.clone());
            }
        }
        seen.iter().map(|m| (m.clone(), now.get(m).copied().unwrap_or(0))).collect()
    }

    /// Requests sent to each worker in discovery.
    pub fn served(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self
            .inner
            .members
            .read(|m| m.workers.iter().map(|(n, w)| (n.clone(), w.served)).collect());
        v.sort();
        v
    }

    /// Each decode worker's prefills as it last reported them (remote, local, fallbacks).
    pub fn prefills(&self) -> Vec<(String, [u64; 3])> {
        let mut v: Vec<_> = self.inner.members.read(|m| {
            m.workers
                .iter()
                .filter_map(|(n, w)| {
                    let s = w.stats.as_ref().filter(|s| s.role == "decode")?;
                    Some((n.clone(), [s.remote_prefills, s.local_prefills, s.prefill_fallbacks]))
                })
                .collect()
        });
        v.sort();
        v
    }

    /// Routes a request of `prompt` for `model` without sending it: the chosen worker's name,
    /// and the id to [`RoutedBackend::release`] when its work is done.
    pub fn pick(&self, model: &str, prompt: &[u32]) -> Option<(u64, String)> {
        let rid = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let pick = self.inner.members.route(model, rid, prompt, &[])?;
        self.inner.stats.routed.fetch_add(1, Ordering::Relaxed);
        Some((rid, pick.name))
    }

    /// Ends the tracking of a request from [`RoutedBackend::pick`].
    pub fn release(&self, model: &str, rid: u64, _completed: bool) {
        self.inner.members.free(model, rid);
    }

    /// Stops following the control plane.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Backend for RoutedBackend {
    fn models(&self) -> Vec<ModelInfo> {
        self.inner.members.models()
    }

    fn model(&self, id: &str) -> Option<ModelEntry> {
        let (info, spec) = self.inner.members.model(id)?;
        let codec = self.inner.codecs.lock().get(&spec).cloned()?;
        Some(ModelEntry { info, codec })
    }

    fn submit(&self, model: &str, req: GenerateRequest) -> Result<EventRx, EngineError> {
        let (tx, rx) = crate::engine::stream::channel();
        tokio::spawn(self.inner.clone().drive(model.to_string(), req, tx));
        Ok(rx)
    }

    fn health(&self) -> kvfabric::health::Health {
        use kvfabric::health::{Health, RoutingHealth, Unreachable};
        let now = Instant::now();
        self.inner.members.read(|st| {
            let mut workers: Vec<String> = st.workers.keys().cloned().collect();
            workers.sort();
            let mut unreachable: Vec<Unreachable> = st
                .workers
                .iter()
                .filter_map(|(n, w)| w.refused_now(now).map(|why| (n, why)))
                .map(|(n, why)| Unreachable { worker: n.clone(), why: why.to_string() })
                .collect();
            unreachable.sort_by(|a, b| a.worker.cmp(&b.worker));
            let mut models: Vec<String> = st.models.keys().cloned().collect();
            models.sort();
            Health {
                routing: Some(RoutingHealth { workers, models, unreachable }),
                ..Health::default()
            }
        })
    }

    fn explain(&self, model: &str, prompt: &[u32], track: bool) -> Result<Value, EngineError> {
        RoutedBackend::explain(self, model, prompt, track)
    }

    fn release(&self, model: &str, request_id: u64) {
        RoutedBackend::release(self, model, request_id, true);
    }

    fn dashboard(&self) -> crate::dashboard::BackendView {
        RoutedBackend::dashboard(self)
    }

    fn metrics(&self, out: &mut Snapshot) {
        let s = &self.inner.stats;
        let f = self.inner.members.feed_stats();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.routed = Some(RoutedSnapshot {
            routed: ld(&s.routed),
            retries: ld(&s.retries),
            failed_mid_stream: ld(&s.failed_mid_stream),
            no_worker: ld(&s.no_worker),
            overloaded: ld(&s.overloaded),
            slow_workers: ld(&s.slow_workers),
            auth_failures: ld(&s.auth_failures),
            long_first_token_waits: ld(&s.long_first_token_waits),
            paused_streams: ld(&s.paused_streams),
            stalled_streams: ld(&s.stalled_streams),
            lost_workers: ld(&s.lost_workers),
            held_for_worker: ld(&s.held_for_worker),
            migrations: ld(&s.migrations),
            paths: kvfabric_router::Path::ALL
                .iter()
                .zip(&s.paths)
                .map(|(p, n)| (p.name(), ld(n)))
                .collect(),
            kv_events: ld(&f.applied),
            kv_event_gaps: ld(&f.gaps),
            kv_dumps: ld(&f.dumps),
            kv_events_malformed: ld(&f.malformed),
            kv_events_unknown_worker: ld(&f.unknown),
            worker_requests: self.served(),
            worker_prefills: self.prefills(),
            model_workers: self.model_workers(),
            pending: self.inner.pending.stats(),
        });
    }
}

/// The routing mode from its name.
pub fn parse_mode(s: &str) -> Result<RoutingMode, String> {
    s.parse()
}
