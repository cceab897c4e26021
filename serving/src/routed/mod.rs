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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::contract::{self, Message};
use kvfabric::control::{Discovery, DiscoveryEvent, EventBus, Instance};
use kvfabric::hash::{HashSeed, TokenBlockHasher};
use kvfabric_router::feed::{worker_id, FeedStats, IndexFeed};
use kvfabric_router::{PrefixIndex, Router, RouterConfig, RoutingMode, WorkerId};
use kvfabric_tiers::remote::protocol::{NodeInfo, FABRIC_KIND};
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::backend::{Backend, ModelEntry};
use crate::engine::sampling::SplitMix64;
use crate::engine::{
    EngineError, EventRx, EventTx, GenEvent, GenerateRequest, ModelInfo, TextCodec,
};
use crate::metrics::{RoutedSnapshot, Snapshot};
use crate::openai;
use crate::protocol::{
    self, Auth, CodecSpec, WorkerApi, WorkerMetadata, WorkerRequest, WORKER_KIND,
};

mod membership;
mod relay;
mod view;

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
    pub secret: Vec<u8>,
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
}

impl RoutedConfig {
    /// Defaults, with the workers' shared secret.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        RoutedConfig {
            router: RouterConfig::default(),
            connect_timeout: Duration::from_secs(2),
            attempts_max: 3,
            name: "frontend".into(),
            kind: WORKER_KIND.into(),
            secret: secret.into(),
            first_token_timeout: Duration::from_secs(30),
            slow_penalty: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(10),
            migrations_max: 1,
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
    /// Attempts abandoned because the worker did not answer in time (connection, handshake,
    /// first token); the worker is then avoided for a while.
    pub slow_workers: AtomicU64,
    /// Attempts refused by the worker's handshake on the secret.
    pub auth_failures: AtomicU64,
    /// Streams ended because their worker sent nothing for the inter-token deadline.
    pub stalled_streams: AtomicU64,
    /// Streams moved to another worker after their first worker stalled or broke.
    pub migrations: AtomicU64,
}

#[derive(Debug)]
struct WorkerEntry {
    wid: WorkerId,
    addr: SocketAddr,
    api: WorkerApi,
    model: String,
    /// Requests sent to it.
    served: u64,
    /// Avoided until then: it did not answer in time (connection, handshake, first token).
    penalty_until: Option<Instant>,
    /// Not routed to until then, and why: it refused our secret (or we refused its), so no
    /// request can reach it; tried again after [`REFUSED_RETRY`].
    refused: Option<(Instant, String)>,
    /// Its role, as a dashboard names it.
    role: &'static str,
    /// Its last load report, when it came, and how old it was on arrival (ms).
    load: contract::Load,
    stats: Option<Box<contract::WorkerStats>>,
    reported: Option<(Instant, Option<f64>)>,
}

/// A worker whose handshake failed on the secret is left out of routing this long, then
/// tried again (its operator may have fixed the secret).
const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// How long a worker of another protocol version stays out of routing: until it registers
/// again (a re-registration is a new join).
const INCOMPATIBLE_FOR: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// A worker that left discovery, kept a few minutes for dashboards.
#[derive(Debug)]
struct Departed {
    name: String,
    left: Instant,
    entry: WorkerEntry,
}

/// Departed workers are kept this long, and this many at most.
const DEPARTED_KEEP: Duration = Duration::from_secs(300);
const DEPARTED_MAX: usize = 64;
/// A draining worker whose reports stopped this long ago has drained.
const REPORTS_STOPPED: Duration = Duration::from_secs(2);

#[derive(Debug)]
struct ModelState {
    entry: ModelEntry,
    router: Router,
    hasher: TokenBlockHasher,
    workers: usize,
}

/// A worker this frontend does not route to but hears report (a prefill worker), for
/// dashboards; forgotten when its reports stop.
#[derive(Debug)]
struct Reporter {
    load: contract::Load,
    stats: Box<contract::WorkerStats>,
    at: Instant,
}

/// Reporters kept at most (names come from the bus), and their names' length at most.
const REPORTERS_MAX: usize = 256;
const NAME_MAX: usize = 128;
/// A reporter whose reports stopped this long ago is forgotten.
const REPORTER_KEEP: Duration = Duration::from_secs(10);

/// A KV fabric node in discovery (`kvfabric fabric`): never routed to. Its KV events fill the
/// index (so they are not "unknown", and the cache map sees what it holds), and its load
/// reports (role `fabric`: tier occupancy, transfers) show on dashboards.
#[derive(Debug)]
struct FabricEntry {
    wid: WorkerId,
    addr: SocketAddr,
    /// Bytes per block it stores: workers of another block size ignore it.
    block_bytes: u64,
    stats: Option<Box<contract::WorkerStats>>,
    reported: Option<Instant>,
}

/// Fabric nodes kept at most (names come from discovery).
const FABRIC_MAX: usize = 256;

#[derive(Debug, Default)]
struct State {
    workers: HashMap<String, WorkerEntry>,
    fabric: HashMap<String, FabricEntry>,
    reporters: HashMap<String, Reporter>,
    departed: std::collections::VecDeque<Departed>,
    by_id: HashMap<WorkerId, String>,
    models: HashMap<String, ModelState>,
}

#[derive(Debug)]
struct Inner {
    cfg: RoutedConfig,
    discovery: Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
    index: Arc<PrefixIndex>,
    state: Mutex<State>,
    codecs: Mutex<HashMap<CodecSpec, Arc<TextCodec>>>,
    next_id: AtomicU64,
    rng: Mutex<SplitMix64>,
    stats: RoutedStats,
    epoch: Instant,
    /// Authenticated connections to workers, kept between requests.
    pool: protocol::ConnectionPool,
    /// Keeps `index` current from the bus; follows every worker and node that joins.
    feed: IndexFeed,
}

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
        let mut loads = bus.subscribe(contract::LOAD).await.map_err(ctl)?;
        let (initial, mut watch) = discovery.watch(&cfg.kind).await.map_err(ctl)?;
        let (nodes, mut fabric_watch) = discovery.watch(FABRIC_KIND).await.map_err(ctl)?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let index = Arc::new(PrefixIndex::new());
        let feed =
            IndexFeed::start(bus.clone(), index.clone(), cfg.name.clone()).await.map_err(ctl)?;
        let inner = Arc::new(Inner {
            cfg,
            discovery: discovery.clone(),
            bus: bus.clone(),
            index,
            state: Mutex::new(State::default()),
            codecs: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            rng: Mutex::new(SplitMix64(seed)),
            stats: RoutedStats::default(),
            epoch: Instant::now(),
            pool: protocol::ConnectionPool::default(),
            feed,
        });
        for inst in initial {
            inner.join(inst).await;
        }
        for inst in nodes {
            inner.join_fabric(inst);
        }
        let i = inner.clone();
        let task = tokio::spawn(async move {
            let (mut load_open, mut watch_open, mut fabric_open) = (true, true, true);
            while load_open || watch_open || fabric_open {
                tokio::select! {
                    biased;
                    d = watch.recv(), if watch_open => match d {
                        Some(DiscoveryEvent::Joined(inst)) => i.join(inst).await,
                        Some(DiscoveryEvent::Left { id, .. }) => i.leave(&id),
                        None => watch_open = false,
                    },
                    d = fabric_watch.recv(), if fabric_open => match d {
                        Some(DiscoveryEvent::Joined(inst)) => i.join_fabric(inst),
                        Some(DiscoveryEvent::Left { id, .. }) => i.leave_fabric(&id),
                        None => fabric_open = false,
                    },
                    m = loads.recv(), if load_open => match m {
                        Some(bytes) => i.on_load(&bytes),
                        None => load_open = false,
                    },
                }
            }
        });
        Ok(RoutedBackend { inner, task: Arc::new(task) })
    }

    /// Waits until at least `n` workers are known (joined through discovery), up to
    /// `timeout`; returns whether they are. A frontend that has just started its own workers
    /// waits here before it takes requests: a worker registered in discovery reaches this
    /// frontend through its watch a little later.
    pub async fn wait_for_workers(&self, n: usize, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.inner.state.lock().workers.len() >= n {
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

    /// The counters of the index's feed (KV events applied, gaps, dumps).
    pub fn feed_stats(&self) -> &FeedStats {
        self.inner.feed.stats()
    }

    /// Requests sent to each worker so far.
    pub fn served(&self) -> Vec<(String, u64)> {
        let st = self.inner.state.lock();
        let mut v: Vec<_> = st.workers.iter().map(|(n, w)| (n.clone(), w.served)).collect();
        v.sort();
        v
    }

    /// Routes a request of `prompt` for `model` without sending it: the chosen worker's name,
    /// and the id to [`RoutedBackend::release`] when its work is done.
    pub fn pick(&self, model: &str, prompt: &[u32]) -> Option<(u64, String)> {
        let rid = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (name, _, _) = self.inner.route(model, rid, prompt, &[])?;
        self.inner.stats.routed.fetch_add(1, Ordering::Relaxed);
        Some((rid, name))
    }

    /// Ends the tracking of a request from [`RoutedBackend::pick`].
    pub fn release(&self, model: &str, rid: u64, _completed: bool) {
        self.inner.with_router(model, |r| r.free(rid));
    }

    /// Stops following the control plane.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Backend for RoutedBackend {
    fn models(&self) -> Vec<ModelInfo> {
        let st = self.inner.state.lock();
        let mut v: Vec<ModelInfo> = st.models.values().map(|m| m.entry.info.clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    fn model(&self, id: &str) -> Option<ModelEntry> {
        self.inner.state.lock().models.get(id).map(|m| m.entry.clone())
    }

    fn submit(&self, model: &str, req: GenerateRequest) -> Result<EventRx, EngineError> {
        let (tx, rx) = crate::engine::stream::channel();
        tokio::spawn(self.inner.clone().drive(model.to_string(), req, tx));
        Ok(rx)
    }

    fn health(&self) -> Value {
        let st = self.inner.state.lock();
        let mut workers: Vec<&String> = st.workers.keys().collect();
        workers.sort();
        let now = Instant::now();
        let mut reasons: Vec<String> = st
            .workers
            .iter()
            .filter_map(|(n, w)| {
                w.refused.as_ref().filter(|(t, _)| *t > now).map(|(_, why)| (n, why))
            })
            .map(|(n, why)| format!("worker {n} cannot be reached: it {why}"))
            .collect();
        reasons.sort();
        let status = if st.workers.is_empty() {
            "no workers"
        } else if reasons.len() == st.workers.len() {
            "no usable workers"
        } else if reasons.is_empty() {
            "ok"
        } else {
            "degraded"
        };
        json!({
            "status": status,
            "reasons": reasons,
            "workers": workers,
            "models": st.models.keys().collect::<Vec<_>>(),
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
        let f = self.inner.feed.stats();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.routed = Some(RoutedSnapshot {
            routed: ld(&s.routed),
            retries: ld(&s.retries),
            failed_mid_stream: ld(&s.failed_mid_stream),
            no_worker: ld(&s.no_worker),
            slow_workers: ld(&s.slow_workers),
            auth_failures: ld(&s.auth_failures),
            stalled_streams: ld(&s.stalled_streams),
            migrations: ld(&s.migrations),
            kv_events: ld(&f.applied),
            kv_event_gaps: ld(&f.gaps),
            kv_dumps: ld(&f.dumps),
            kv_events_malformed: ld(&f.malformed),
            kv_events_unknown_worker: ld(&f.unknown),
            worker_requests: self.served(),
        });
    }
}

/// The routing mode from its name.
pub fn parse_mode(s: &str) -> Result<RoutingMode, String> {
    s.parse()
}
