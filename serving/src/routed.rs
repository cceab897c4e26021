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

    /// Where a request of `prompt` would go, and why: the chosen worker, and every worker's
    /// leading cached blocks per tier, reported load and cost. With `track`, the request is
    /// routed (it counts as the worker's load until [`RoutedBackend::release`]).
    pub fn explain(&self, model: &str, prompt: &[u32], track: bool) -> Result<Value, EngineError> {
        let unknown =
            || EngineError::Unavailable { message: format!("no worker serves {model:?} now") };
        let now = self.inner.epoch.elapsed().as_secs_f64();
        let (hashes, block_tokens, scores) = {
            let st = self.inner.state.lock();
            let m = st.models.get(model).ok_or_else(unknown)?;
            let hashes = m.hasher.sequence_hashes(prompt);
            let scores = m.router.scores(&self.inner.index, &hashes, now);
            let named: Vec<Scored> = scores
                .into_iter()
                .filter_map(|(w, run, cost)| {
                    let terms = m.router.cost_terms(w, hashes.len(), run);
                    st.by_id.get(&w).map(|n| (n.clone(), run, cost, m.router.load(w), terms))
                })
                .collect();
            (hashes, m.router.config().block_tokens, named)
        };
        let (request_id, chosen) = if track {
            match self.pick(model, prompt) {
                Some((rid, name)) => (Some(rid), Some(name)),
                None => (None, None),
            }
        } else {
            // The router's own choice at temperature 0 ([`kvfabric_router::policy::select`]):
            // the lowest cost, and on a tie the lowest worker id, as a request would go.
            let best = scores.iter().min_by(|a, b| by_choice(a, b)).map(|s| s.0.clone());
            (None, best)
        };
        let chosen = chosen.ok_or_else(unknown)?;
        let workers: Vec<Value> = scores
            .iter()
            .map(|(name, run, cost, load, terms)| {
                let tiers: serde_json::Map<String, Value> = kvfabric::events::TierKind::ALL
                    .iter()
                    .map(|t| (t.name().to_string(), json!(run.per_tier[*t as usize])))
                    .collect();
                json!({
                    "worker": name,
                    "cached_blocks": run.blocks,
                    "cached_tokens": u64::from(run.blocks) * u64::from(block_tokens),
                    "cached_blocks_per_tier": tiers,
                    "active_blocks": load.active_blocks,
                    "queued_prefill_tokens": load.queued_prefill_tokens,
                    "cost": cost,
                    "cost_terms": {
                        "prefill_blocks": terms[0],
                        "decode_load": terms[1],
                        "queued_prefill": terms[2],
                    },
                })
            })
            .collect();
        let mode = self.inner.mode_name();
        let reason = explain_reason(&mode, &chosen, &scores, hashes.len(), track);
        Ok(json!({
            "model": model,
            "worker": chosen,
            "reason": reason,
            "request_id": request_id,
            "prompt_tokens": prompt.len(),
            "blocks": hashes.len(),
            "block_tokens": block_tokens,
            "mode": mode,
            "workers": workers,
        }))
    }

    /// Ends the tracking of a request from [`RoutedBackend::pick`].
    pub fn release(&self, model: &str, rid: u64, _completed: bool) {
        self.inner.with_router(model, |r| r.free(rid));
    }

    /// Its workers, those that left lately, and the control plane, for a dashboard.
    pub fn dashboard(&self) -> crate::dashboard::BackendView {
        use crate::dashboard::{BackendView, ControlView, WorkerView};
        let now = Instant::now();
        let view =
            |name: &str, w: &WorkerEntry, state: &'static str, left: Option<Instant>| WorkerView {
                name: name.to_string(),
                model: w.model.clone(),
                role: w.role,
                state,
                addr: Some(w.addr.to_string()),
                requests: w.served,
                load: w.load,
                stats: w.stats.as_deref().cloned(),
                indexed_blocks: self.inner.index.worker_blocks(w.wid) as u64,
                report_age_s: w
                    .reported
                    .map(|(at, _)| now.saturating_duration_since(at).as_secs_f64()),
                left_s_ago: left.map(|l| now.saturating_duration_since(l).as_secs_f64()),
                note: w
                    .refused
                    .as_ref()
                    .filter(|(t, _)| *t > now)
                    .map(|(_, why)| format!("cannot be reached: {why} (wrong secret?)")),
            };
        let mut st = self.inner.state.lock();
        st.departed.retain(|d| now.saturating_duration_since(d.left) < DEPARTED_KEEP);
        let mut workers: Vec<WorkerView> = st
            .workers
            .iter()
            .map(|(name, w)| {
                let avoided = w.penalty_until.is_some_and(|t| t > now);
                let refused = w.refused.as_ref().is_some_and(|(t, _)| *t > now);
                let draining = w.stats.as_ref().is_some_and(|s| s.draining);
                let state = match (refused, draining, avoided) {
                    (true, _, _) => "refused",
                    (false, true, _) => "draining",
                    (false, false, true) => "avoided",
                    (false, false, false) => "serving",
                };
                view(name, w, state, None)
            })
            .collect();
        st.reporters.retain(|_, r| now.saturating_duration_since(r.at) < REPORTER_KEEP);
        workers.extend(st.reporters.iter().map(|(name, r)| WorkerView {
            name: name.clone(),
            role: "prefill",
            state: if r.stats.draining { "draining" } else { "serving" },
            load: r.load,
            stats: Some((*r.stats).clone()),
            report_age_s: Some(now.saturating_duration_since(r.at).as_secs_f64()),
            ..WorkerView::default()
        }));
        workers.sort_by(|a, b| a.name.cmp(&b.name));
        let departed = st
            .departed
            .iter()
            .rev()
            .map(|d| {
                let w = &d.entry;
                let reporting = w
                    .reported
                    .is_some_and(|(at, _)| now.saturating_duration_since(at) < REPORTS_STOPPED);
                // A worker that drains says so, and keeps reporting after it left; one that
                // was killed or lost its lease left with its reports already stopped.
                let drains = w.stats.as_ref().is_some_and(|s| s.draining)
                    || w.reported.is_some_and(|(at, _)| at > d.left);
                let state = match drains {
                    true if reporting => "draining",
                    true => "drained",
                    false => "lost",
                };
                // Its blocks left the index with it: `indexed_blocks` reads 0.
                view(&d.name, w, state, Some(d.left))
            })
            .collect();
        let bus_lag_ms =
            st.workers.values().filter_map(|w| w.reported.and_then(|r| r.1)).reduce(f64::max);
        // The block sizes of the models served: a node of none of them serves no worker.
        let sizes: Vec<u64> =
            st.models.values().map(|m| m.entry.info.layout.bytes_per_block()).collect();
        let mut fabric: Vec<WorkerView> = st
            .fabric
            .iter()
            .map(|(name, f)| WorkerView {
                name: name.clone(),
                role: "fabric",
                state: if sizes.is_empty() || sizes.contains(&f.block_bytes) {
                    "serving"
                } else {
                    "ignored"
                },
                note: (!sizes.is_empty() && !sizes.contains(&f.block_bytes)).then(|| {
                    format!(
                        "stores blocks of {} bytes; the workers' are {}: no worker uses it",
                        f.block_bytes,
                        sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
                    )
                }),
                addr: Some(f.addr.to_string()),
                stats: f.stats.as_deref().cloned(),
                indexed_blocks: self.inner.index.worker_blocks(f.wid) as u64,
                report_age_s: f.reported.map(|at| now.saturating_duration_since(at).as_secs_f64()),
                ..WorkerView::default()
            })
            .collect();
        fabric.sort_by(|a, b| a.name.cmp(&b.name));
        drop(st);
        let f = self.inner.feed.stats();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BackendView {
            workers,
            departed,
            fabric,
            control: Some(ControlView {
                discovery: self.inner.discovery.status(),
                bus: self.inner.bus.status(),
                kv_events: ld(&f.applied),
                kv_event_gaps: ld(&f.gaps),
                kv_dumps: ld(&f.dumps),
                dump_requests: ld(&f.dump_requests),
                kv_events_malformed: ld(&f.malformed),
                kv_events_unknown_worker: ld(&f.unknown),
                bus_lag_ms,
                routing: self.inner.mode_name(),
            }),
        }
    }

    /// Stops following the control plane.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Inner {
    /// The routing mode, as `explain` and dashboards name it.
    fn mode_name(&self) -> String {
        format!("{:?}", self.cfg.router.mode).to_lowercase()
    }

    async fn join(self: &Arc<Self>, inst: Instance) {
        let md: WorkerMetadata = match serde_json::from_value(inst.metadata.clone()) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(worker = %inst.id, error = %e, "ignoring a worker with unreadable metadata");
                return;
            }
        };
        let cached = self.codecs.lock().get(&md.codec).cloned();
        let codec = match cached {
            Some(c) => c,
            None => {
                let spec = md.codec.clone();
                match tokio::task::spawn_blocking(move || TextCodec::from_spec(&spec)).await {
                    Ok(Ok(c)) => {
                        let c = Arc::new(c);
                        self.codecs.lock().insert(md.codec.clone(), c.clone());
                        c
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(worker = %inst.id, error = %e, "ignoring a worker whose tokenizer cannot be loaded");
                        return;
                    }
                    Err(_) => return,
                }
            }
        };
        let wid = worker_id(&inst.id);
        self.index.add_worker(wid);
        self.feed.follow(&inst.id);
        let mut st = self.state.lock();
        // What a dashboard knows of it (its last report, the requests sent to it) carries
        // over a re-registration or a return.
        let mut before = None;
        if let Some(old) = st.workers.remove(&inst.id) {
            // Re-registered (new address or model): forget the old routing entry.
            if let Some(m) = st.models.get_mut(&old.model) {
                m.router.remove_worker(old.wid);
                m.workers -= 1;
            }
            before = Some(old);
        }
        if let Some(i) = st.departed.iter().position(|d| d.name == inst.id) {
            let gone = st.departed.remove(i).map(|d| d.entry);
            before = before.or(gone);
        }
        let bt = md.model.layout.block_tokens;
        let Ok(hasher) = TokenBlockHasher::new(bt as usize, HashSeed::default()) else {
            tracing::warn!(worker = %inst.id, "ignoring a worker with 0 tokens per block");
            return;
        };
        let model = st.models.entry(md.model.id.clone()).or_insert_with(|| {
            let cfg = RouterConfig { block_tokens: bt, ..self.cfg.router.clone() };
            ModelState {
                entry: ModelEntry { info: md.model.clone(), codec },
                router: Router::new(cfg),
                hasher,
                workers: 0,
            }
        });
        model.router.add_worker(wid);
        model.workers += 1;
        tracing::info!(worker = %inst.id, addr = %md.addr, model = %md.model.id, role = ?md.role, "worker joined");
        // A worker of another protocol version could not read our frames: known at join,
        // shown, never routed to.
        let incompatible = match md.api {
            WorkerApi::Kvfabric { protocol: v } if v != protocol::PROTOCOL => {
                let why = format!(
                    "speaks worker protocol {v}, this frontend speaks {} (run one release on \
                     frontends and workers)",
                    protocol::PROTOCOL
                );
                tracing::warn!(worker = %inst.id, reason = %why, "a worker this frontend cannot talk to joined; left out of routing");
                Some((Instant::now() + INCOMPATIBLE_FOR, why))
            }
            WorkerApi::Kvfabric { .. } => {
                self.probe(inst.id.clone(), md.addr);
                None
            }
            WorkerApi::OpenAi { .. } => None,
        };
        st.by_id.insert(wid, inst.id.clone());
        let role = match (&md.api, md.role) {
            (WorkerApi::OpenAi { .. }, _) => "engine",
            (_, protocol::Role::Aggregated) => "aggregated",
            (_, protocol::Role::Prefill) => "prefill",
            (_, protocol::Role::Decode) => "decode",
        };
        st.workers.insert(
            inst.id,
            WorkerEntry {
                wid,
                addr: md.addr,
                api: md.api,
                model: md.model.id,
                served: before.as_ref().map_or(0, |b| b.served),
                penalty_until: None,
                refused: incompatible,
                role,
                load: before.as_ref().map_or_else(contract::Load::default, |b| b.load),
                stats: before.as_mut().and_then(|b| b.stats.take()),
                reported: before.as_ref().and_then(|b| b.reported),
            },
        );
    }

    /// A fabric node joined discovery: its events go to the index from now on.
    fn join_fabric(&self, inst: Instance) {
        let info: NodeInfo = match serde_json::from_value(inst.metadata) {
            Ok(i) if inst.id.len() <= NAME_MAX => i,
            Ok(_) => {
                tracing::warn!(node = %inst.id.chars().take(64).collect::<String>(), "ignoring a fabric node with an overlong name");
                return;
            }
            Err(e) => {
                tracing::warn!(node = %inst.id, error = %e, "ignoring a fabric node whose metadata cannot be read");
                return;
            }
        };
        let wid = worker_id(&inst.id);
        let mut st = self.state.lock();
        if st.by_id.contains_key(&wid) {
            tracing::warn!(node = %inst.id, "ignoring a fabric node named as a worker is");
            return;
        }
        if !st.fabric.contains_key(&inst.id) && st.fabric.len() >= FABRIC_MAX {
            tracing::warn!(node = %inst.id, max = FABRIC_MAX, "ignoring a fabric node: too many");
            return;
        }
        self.index.add_worker(wid);
        self.feed.follow(&inst.id);
        let before = st.fabric.remove(&inst.id);
        tracing::info!(node = %inst.id, addr = %info.agent.tcp_addr, "fabric node joined");
        let (stats, reported) = before.map_or((None, None), |b| (b.stats, b.reported));
        let entry = FabricEntry {
            wid,
            addr: info.agent.tcp_addr,
            block_bytes: info.block_bytes,
            stats,
            reported,
        };
        st.fabric.insert(inst.id, entry);
    }

    fn leave_fabric(&self, name: &str) {
        let Some(f) = self.state.lock().fabric.remove(name) else { return };
        self.index.remove_worker(f.wid);
        self.feed.unfollow(name);
        tracing::info!(node = %name, "fabric node left");
    }

    fn leave(&self, name: &str) {
        let mut st = self.state.lock();
        let Some(w) = st.workers.remove(name) else { return };
        tracing::info!(worker = %name, "worker left");
        self.pool.forget(w.addr, name);
        self.feed.unfollow(name);
        let (wid, model) = (w.wid, w.model.clone());
        if st.departed.len() >= DEPARTED_MAX {
            st.departed.pop_front();
        }
        st.departed.push_back(Departed { name: name.to_string(), left: Instant::now(), entry: w });
        st.by_id.remove(&wid);
        self.index.remove_worker(wid);
        let gone = match st.models.get_mut(&model) {
            Some(m) => {
                m.router.remove_worker(wid);
                m.workers -= 1;
                m.workers == 0
            }
            None => false,
        };
        if gone {
            st.models.remove(&model);
        }
    }

    fn on_load(&self, bytes: &[u8]) {
        let Ok(Message::Load { source, load, stats }) = Message::decode(bytes) else { return };
        // A lag beyond an hour is a clock, not the bus: not shown.
        let lag_ms = stats.as_ref().and_then(|s| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
            Some((now.as_millis() as f64 - s.sent_at_ms as f64).max(0.0))
                .filter(|l| *l <= 3_600_000.0)
        });
        let mut st = self.state.lock();
        let st = &mut *st;
        if let Some(f) = st.fabric.get_mut(&source) {
            f.stats = stats.map(bounded);
            f.reported = Some(Instant::now());
            return;
        }
        let entry = match st.workers.get_mut(&source) {
            Some(w) => Some(w),
            // A draining worker keeps reporting after it left discovery.
            None => st.departed.iter_mut().find(|d| d.name == source).map(|d| &mut d.entry),
        };
        let Some(w) = entry else {
            // Prefill workers serve no requests of this frontend, but a dashboard shows them.
            let named = source.len() <= NAME_MAX;
            if let Some(stats) = stats.filter(|s| named && s.role == "prefill").map(bounded) {
                if st.reporters.len() < REPORTERS_MAX || st.reporters.contains_key(&source) {
                    st.reporters.insert(source, Reporter { load, stats, at: Instant::now() });
                }
            }
            return;
        };
        w.load = load;
        w.stats = stats.map(bounded);
        w.reported = Some((Instant::now(), lag_ms));
        if let Some(m) = st.models.get_mut(&w.model).filter(|_| st.by_id.contains_key(&w.wid)) {
            m.router.report_load(w.wid, load);
        }
    }

    /// Picks a worker for a request, avoiding `tried`.
    fn route(
        &self,
        model: &str,
        request_id: u64,
        prompt: &[u32],
        tried: &[WorkerId],
    ) -> Option<(String, SocketAddr, WorkerApi)> {
        let draw = self.rng.lock().next_f64();
        let now = self.epoch.elapsed().as_secs_f64();
        let mut st = self.state.lock();
        let st = &mut *st;
        let m = st.models.get_mut(model)?;
        let hashes = m.hasher.sequence_hashes(prompt);
        let d = m.router.route(&self.index, request_id, &hashes, prompt.len() as u64, now, draw)?;
        let mut wid = d.worker;
        // Avoid what failed for this request, and workers that are penalised for being slow
        // unless every other worker failed already.
        let clock = Instant::now();
        let penalised = |w: &WorkerId| {
            st.by_id
                .get(w)
                .and_then(|n| st.workers.get(n))
                .and_then(|e| e.penalty_until)
                .is_some_and(|t| t > clock)
        };
        // A worker that refused our secret cannot serve anything: never chosen.
        let refused = |w: &WorkerId| {
            st.by_id
                .get(w)
                .and_then(|n| st.workers.get(n))
                .and_then(|e| e.refused.as_ref())
                .is_some_and(|(t, _)| *t > clock)
        };
        let workers: Vec<WorkerId> = m.router.workers().to_vec();
        let usable = |w: &WorkerId| !tried.contains(w) && !refused(w);
        let fresh = |w: &WorkerId| usable(w) && !penalised(w);
        let avoid_slow = workers.iter().any(fresh);
        if !usable(&wid) || (avoid_slow && penalised(&wid)) {
            m.router.free(request_id);
            wid = if avoid_slow {
                *workers.iter().find(|w| fresh(w))?
            } else {
                *workers.iter().find(|w| usable(w))?
            };
        }
        let name = st.by_id.get(&wid)?.clone();
        let w = st.workers.get_mut(&name)?;
        w.served += 1;
        Some((name, w.addr, w.api.clone()))
    }

    /// A worker did not answer (no connection, no handshake or no first token in time):
    /// avoid it for a while.
    fn penalise(&self, name: &str) {
        self.stats.slow_workers.fetch_add(1, Ordering::Relaxed);
        if let Some(w) = self.state.lock().workers.get_mut(name) {
            w.penalty_until = Some(Instant::now() + self.cfg.slow_penalty);
        }
    }

    /// Checks in the background that a worker that joined accepts this frontend's secret.
    fn probe(self: &Arc<Self>, name: String, addr: SocketAddr) {
        let this = Arc::downgrade(self);
        let auth = Auth { name: self.cfg.name.clone(), secret: self.cfg.secret.clone() };
        let timeout = self.cfg.connect_timeout;
        tokio::spawn(async move {
            if let Err(e) = protocol::probe(addr, &name, &auth, timeout).await {
                if let Some(this) = this.upgrade().filter(|_| e.is_auth()) {
                    this.refuse(&name, &e);
                }
            }
        });
    }

    /// A worker's handshake failed on the secret, or it answered in another protocol version:
    /// out of routing (for [`REFUSED_RETRY`], or [`INCOMPATIBLE_FOR`]), counted, logged once
    /// per worker until it serves again.
    fn refuse(&self, name: &str, e: &protocol::FrameError) {
        let (why, until) = if e.is_version() {
            (e.to_string(), Instant::now() + INCOMPATIBLE_FOR)
        } else {
            self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            (format!("refused this frontend's secret ({e})"), Instant::now() + REFUSED_RETRY)
        };
        if let Some(w) = self.state.lock().workers.get_mut(name) {
            if w.refused.is_none() {
                tracing::warn!(worker = %name, reason = %why, "no request can reach a worker; \
                    left out of routing");
            }
            w.refused = Some((until, why));
        }
    }

    /// A worker answered in time: it is no longer avoided.
    fn forgive(&self, name: &str) {
        if let Some(w) = self.state.lock().workers.get_mut(name) {
            w.penalty_until = None;
            w.refused = None;
        }
    }

    fn with_router(&self, model: &str, f: impl FnOnce(&mut Router)) {
        if let Some(m) = self.state.lock().models.get_mut(model) {
            f(&mut m.router);
        }
    }

    async fn drive(self: Arc<Self>, model: String, req: GenerateRequest, tx: EventTx) {
        let deadline = tokio::time::Instant::now() + req.timeout;
        let mut tried: Vec<WorkerId> = Vec::new();
        let mut last_err: Option<String> = None;
        let (prompt, max_tokens) = (req.prompt.clone(), req.max_tokens);
        let mut wreq = WorkerRequest { model: model.clone(), request: req };
        let mut progress = Progress { ids_known: true, ..Progress::default() };
        let mut migrations = 0u32;
        for attempt in 0..self.cfg.attempts_max.max(1) {
            let rid = self.next_id.fetch_add(1, Ordering::Relaxed);
            let Some((name, addr, api)) = self.route(&model, rid, &wreq.request.prompt, &tried)
            else {
                break;
            };
            self.stats.routed.fetch_add(1, Ordering::Relaxed);
            if attempt > 0 {
                self.stats.retries.fetch_add(1, Ordering::Relaxed);
            }
            let target = Target { model: &model, rid, name: &name, addr };
            let outcome = match &api {
                WorkerApi::Kvfabric { .. } => {
                    self.relay(target, &wreq, &tx, deadline, &mut progress).await
                }
                WorkerApi::OpenAi { model: engine_model } => {
                    self.relay_openai(
                        target,
                        engine_model,
                        &wreq.request,
                        &tx,
                        deadline,
                        &mut progress,
                    )
                    .await
                }
            };
            self.with_router(&model, |r| r.free(rid));
            match outcome {
                Relay::Finished => return,
                Relay::Retry(why) => {
                    tracing::info!(worker = %name, reason = %why, "retrying on another worker");
                    tried.push(worker_id(&name));
                    last_err = Some(format!("worker {name}: {why}"));
                }
                Relay::Failed(why) => {
                    tried.push(worker_id(&name));
                    let left = max_tokens.saturating_sub(progress.generated.len());
                    let can_move = migrations < self.cfg.migrations_max
                        && progress.ids_known
                        && tokio::time::Instant::now() < deadline;
                    if can_move && left == 0 {
                        let _ = tx.send(GenEvent::Done {
                            reason: crate::engine::FinishReason::Length,
                            completion_tokens: progress.generated.len(),
                            text: String::new(),
                        });
                        return;
                    }
                    if !can_move {
                        self.stats.failed_mid_stream.fetch_add(1, Ordering::Relaxed);
                        let e = EngineError::model(format!(
                            "worker {name} failed after streaming had started: {why}"
                        ));
                        let _ = tx.send(GenEvent::Error(e));
                        return;
                    }
                    // The next worker continues from the prompt and the tokens sent.
                    migrations += 1;
                    self.stats.migrations.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(worker = %name, reason = %why, tokens = progress.generated.len(),
                        "a stream broke after its first token: moving it to another worker");
                    wreq.request.prompt = [&prompt[..], &progress.generated[..]].concat();
                    wreq.request.max_tokens = left;
                    progress.moved = true;
                    progress.counted_before = progress.generated.len();
                    last_err = Some(format!("worker {name}: {why}"));
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                let _ = tx
                    .send(GenEvent::Error(EngineError::Deadline { timeout: wreq.request.timeout }));
                return;
            }
            wreq.request.timeout = deadline - now;
        }
        self.stats.no_worker.fetch_add(1, Ordering::Relaxed);
        let refused: Vec<String> = {
            let st = self.state.lock();
            let now = Instant::now();
            let mut v: Vec<String> = st
                .workers
                .iter()
                .filter(|(_, w)| w.model == model)
                .filter_map(|(n, w)| {
                    w.refused
                        .as_ref()
                        .filter(|(t, _)| *t > now)
                        .map(|(_, why)| format!("{n} {why}"))
                })
                .collect();
            v.sort();
            v
        };
        let msg = match last_err {
            Some(e) => format!("no worker could serve {model:?} ({e})"),
            None if !refused.is_empty() => {
                format!("no worker can serve {model:?}: {}", refused.join("; "))
            }
            None => format!("no worker serves {model:?} now"),
        };
        let _ = tx.send(GenEvent::Error(EngineError::Unavailable { message: msg }));
    }

    async fn relay(
        &self,
        t: Target<'_>,
        wreq: &WorkerRequest,
        tx: &EventTx,
        deadline: tokio::time::Instant,
        progress: &mut Progress,
    ) -> Relay {
        let Target { model, rid, name, addr } = t;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let auth = Auth { name: self.cfg.name.clone(), secret: self.cfg.secret.clone() };
        let timeout = self.cfg.connect_timeout.min(left);
        let mut conn = match self.pool.request(addr, name, &auth, wreq, timeout).await {
            Ok(c) => c,
            Err(e) if e.is_auth() || e.is_version() => {
                self.refuse(name, &e);
                return Relay::Retry(e.to_string());
            }
            Err(e) => {
                // Refused, or no handshake in time (a frozen process): avoid it too.
                self.penalise(name);
                return Relay::Retry(e.to_string());
            }
        };
        // Whether any event came back on this connection yet.
        let mut answered = false;
        let mut sent_token = false;
        let first_token_by =
            (tokio::time::Instant::now() + self.cfg.first_token_timeout).min(deadline);
        // `Started` is held until the first token: a request retried elsewhere reports the
        // worker that answered it.
        let mut started: Option<GenEvent> = None;
        let mut stall_by = deadline;
        loop {
            let until = if sent_token { stall_by.min(deadline) } else { first_token_by };
            let frame = tokio::select! {
                f = tokio::time::timeout_at(until, conn.next()) => f,
                // The client went away: closing the connection cancels the worker's work.
                _ = tx.closed() => return Relay::Finished,
            };
            // A kept connection that the worker closed before it read the request (it
            // restarted, or closed it idle just then): the same request on a new one.
            if conn.reused && !answered && matches!(frame, Ok(Ok(None) | Err(_))) {
                match self.pool.fresh(addr, name, &auth, wreq, timeout).await {
                    Ok(c) => conn = c,
                    Err(e) => {
                        self.penalise(name);
                        return Relay::Retry(e.to_string());
                    }
                }
                continue;
            }
            answered |= matches!(frame, Ok(Ok(Some(_))));
            let ev = match frame {
                Err(_) if !sent_token && until < deadline => {
                    self.penalise(name);
                    return Relay::Retry(format!(
                        "no first token within {:?}",
                        self.cfg.first_token_timeout
                    ));
                }
                Err(_) if until < deadline => {
                    self.penalise(name);
                    self.stats.stalled_streams.fetch_add(1, Ordering::Relaxed);
                    return Relay::Failed(format!("no token for {:?}", self.cfg.stall_timeout));
                }
                Err(_) => {
                    tracing::warn!(worker = %name, first_token = sent_token, "request deadline reached waiting for the worker's next event");
                    let _ = tx.send(GenEvent::Error(EngineError::Deadline {
                        timeout: wreq.request.timeout,
                    }));
                    return Relay::Finished;
                }
                Ok(Ok(Some(ev))) => ev,
                Ok(Ok(None)) => {
                    let why = "the worker closed the connection".to_string();
                    return if sent_token { Relay::Failed(why) } else { Relay::Retry(why) };
                }
                Ok(Err(e)) => {
                    if e.is_version() {
                        self.refuse(name, &e);
                    }
                    return if sent_token {
                        Relay::Failed(e.to_string())
                    } else {
                        Relay::Retry(e.to_string())
                    };
                }
            };
            match ev {
                GenEvent::Started { prompt_tokens, cached, remote_prefill, .. } => {
                    // A stream that moved here has told its client how it started already.
                    if !progress.started_sent {
                        started = Some(GenEvent::Started {
                            prompt_tokens,
                            cached,
                            worker: Some(name.to_string()),
                            remote_prefill,
                        });
                    }
                }
                GenEvent::Token { id, .. } => {
                    stall_by = tokio::time::Instant::now() + self.cfg.stall_timeout;
                    if !sent_token {
                        sent_token = true;
                        self.with_router(model, |r| r.prefill_done(rid));
                        self.forgive(name);
                        progress.send_started(tx, started.take());
                    }
                    progress.generated.push(id);
                    if tx.send(ev).is_err() {
                        return Relay::Finished;
                    }
                }
                GenEvent::Done { reason, text, completion_tokens } => {
                    self.pool.give_back(conn);
                    progress.send_started(tx, started.take());
                    // Counted over every worker the stream had.
                    let completion_tokens = progress.counted_before + completion_tokens;
                    let _ = tx.send(GenEvent::Done { reason, completion_tokens, text });
                    return Relay::Finished;
                }
                GenEvent::Cached(c) => match started.as_mut() {
                    Some(GenEvent::Started { cached: sc, .. }) => *sc = c,
                    _ if progress.started_sent && progress.moved => {}
                    _ => {
                        let _ = tx.send(GenEvent::Cached(c));
                    }
                },
                GenEvent::Error(e) => {
                    // The worker is done with the request; the connection is clean.
                    self.pool.give_back(conn);
                    let retryable =
                        matches!(e, EngineError::Overloaded { .. } | EngineError::Stopped);
                    if retryable && !sent_token {
                        return Relay::Retry(e.to_string());
                    }
                    progress.send_started(tx, started.take());
                    let _ = tx.send(GenEvent::Error(e));
                    return Relay::Finished;
                }
            }
        }
    }
}

/// Why `chosen` is where a request of `blocks` full blocks goes, in words.
fn explain_reason(
    mode: &str,
    chosen: &str,
    scores: &[Scored],
    blocks: usize,
    track: bool,
) -> String {
    let mut by_cost: Vec<&Scored> = scores.iter().collect();
    by_cost.sort_by(|a, b| by_choice(a, b));
    let Some(best) = by_cost.iter().find(|s| s.0 == chosen) else {
        return format!("{mode} routing picked {chosen}");
    };
    let (_, run, cost, _, t) = best;
    let tiers: Vec<String> = kvfabric::events::TierKind::ALL
        .iter()
        .filter(|k| run.per_tier[**k as usize] > 0)
        .map(|k| format!("{} in {}", run.per_tier[*k as usize], k.name()))
        .collect();
    let cached = if tiers.is_empty() { String::new() } else { format!(": {}", tiers.join(", ")) };
    let why = format!(
        "{} of {blocks} blocks cached{cached}; cost {cost:.1} = {:.1} to prefill + {:.1} decode load + {:.1} queued prefill",
        run.blocks, t[0], t[1], t[2]
    );
    let next = by_cost.iter().find(|s| s.0 != chosen);
    match (mode, next) {
        ("kv", Some(n)) if n.2 == *cost && (!track || by_cost.first().is_some_and(|b| b.0 == chosen)) => format!(
            "{chosen}: a tie at the lowest cost with {} ({} blocks cached), broken by worker id as \
             every request's is. {why}",
            n.0, n.1.blocks
        ),
        ("kv", Some(n)) if !track || n.2 >= *cost => format!(
            "{chosen}: the lowest cost. {why}. Next: {} at {:.1} ({} blocks cached)",
            n.0, n.2, n.1.blocks
        ),
        ("kv", None) => format!("{chosen}: the only worker. {why}"),
        ("kv", Some(_)) => format!(
            "{chosen}: cheaper workers were passed over (avoided after not answering in time, or the temperature's draw). {why}"
        ),
        (_, _) if track => format!("{chosen}: {mode} routing does not weigh cached blocks. {why}"),
        (_, _) => format!(
            "{mode} routing does not weigh cached blocks; by cost (kv routing) it would be {chosen}. {why}"
        ),
    }
}

/// The order in which the router chooses at temperature 0: the lowest cost, then the lowest
/// worker id (the XXH3-64 of its name), as [`kvfabric_router::policy::select`] does.
fn by_choice(a: &Scored, b: &Scored) -> std::cmp::Ordering {
    a.2.total_cmp(&b.2).then_with(|| worker_id(&a.0).cmp(&worker_id(&b.0)))
}

/// A report off the bus, cut to what a dashboard shows: a transport per kind, short names.
fn bounded(mut s: Box<contract::WorkerStats>) -> Box<contract::WorkerStats> {
    let short = |x: &mut String| {
        if x.len() > 32 {
            *x = x.chars().take(32).collect();
        }
    };
    s.transfers.truncate(kvfabric::transfer::TransportKind::ALL.len());
    for t in &mut s.transfers {
        short(&mut t.transport);
    }
    short(&mut s.role);
    s
}

/// A worker's name, leading cached run, cost, load and cost terms (`explain`).
type Scored = (String, kvfabric_router::Run, f64, kvfabric::contract::Load, [f64; 3]);

/// The worker a request attempt goes to.
struct Target<'a> {
    model: &'a str,
    rid: u64,
    name: &'a str,
    addr: SocketAddr,
}

impl Inner {
    /// Serves an attempt on an engine behind its OpenAI-compatible API: the prompt goes as
    /// token ids to `/v1/completions`, streamed; the chunks become generation events. The
    /// same rules as for kvfabric's workers: no first token in time, or an error before it,
    /// and the request is retried elsewhere; after it, the request fails. Token ids are those
    /// the engine sends (`token_ids`), else 0: the text is what the client gets.
    async fn relay_openai(
        &self,
        t: Target<'_>,
        engine_model: &str,
        req: &GenerateRequest,
        tx: &EventTx,
        deadline: tokio::time::Instant,
        progress: &mut Progress,
    ) -> Relay {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let first_token_by =
            (tokio::time::Instant::now() + self.cfg.first_token_timeout).min(deadline);
        let body = openai::completion_body(engine_model, req);
        let head_within = self.cfg.first_token_timeout.min(left);
        let started = tokio::select! {
            s = openai::start(t.addr, &body, head_within) => s,
            _ = tx.closed() => return Relay::Finished,
        };
        let mut stream = match started {
            Ok(s) => s,
            Err(e) => {
                if matches!(e, openai::OpenAiError::Connect { .. }) {
                    self.penalise(t.name);
                }
                if e.retryable() {
                    return Relay::Retry(e.to_string());
                }
                let _ = tx.send(GenEvent::Error(EngineError::invalid(e.to_string())));
                return Relay::Finished;
            }
        };
        let mut started = (!progress.started_sent).then(|| GenEvent::Started {
            prompt_tokens: req.prompt.len(),
            cached: Default::default(),
            worker: Some(t.name.to_string()),
            remote_prefill: None,
        });
        let (mut sent_token, mut reason, mut chunks) = (false, None, 0usize);
        let mut stall_by = deadline;
        loop {
            let until = if sent_token { stall_by.min(deadline) } else { first_token_by };
            let chunk = tokio::select! {
                c = tokio::time::timeout_at(until, stream.next()) => c,
                _ = tx.closed() => return Relay::Finished,
            };
            let chunk = match chunk {
                Err(_) if !sent_token && until < deadline => {
                    self.penalise(t.name);
                    return Relay::Retry(format!(
                        "no first token within {:?}",
                        self.cfg.first_token_timeout
                    ));
                }
                Err(_) if until < deadline => {
                    self.penalise(t.name);
                    self.stats.stalled_streams.fetch_add(1, Ordering::Relaxed);
                    return Relay::Failed(format!("no token for {:?}", self.cfg.stall_timeout));
                }
                Err(_) => {
                    let _ =
                        tx.send(GenEvent::Error(EngineError::Deadline { timeout: req.timeout }));
                    return Relay::Finished;
                }
                Ok(Err(e)) if sent_token => return Relay::Failed(e.to_string()),
                Ok(Err(e)) => return Relay::Retry(e.to_string()),
                Ok(Ok(c)) => c,
            };
            match chunk {
                Some(openai::Chunk::Text { text, token_ids }) => {
                    stall_by = tokio::time::Instant::now() + self.cfg.stall_timeout;
                    if !sent_token {
                        sent_token = true;
                        self.with_router(t.model, |r| r.prefill_done(t.rid));
                        self.forgive(t.name);
                        progress.send_started(tx, started.take());
                    }
                    // An engine that does not return token ids: the stream cannot move.
                    progress.ids_known &= !token_ids.is_empty();
                    progress.generated.extend_from_slice(&token_ids);
                    chunks += token_ids.len().max(1);
                    let id = token_ids.last().copied().unwrap_or(0);
                    if tx.send(GenEvent::Token { id, text }).is_err() {
                        return Relay::Finished;
                    }
                }
                Some(openai::Chunk::Finish(r)) => reason = Some(r),
                Some(openai::Chunk::Usage { completion_tokens, cached }) => {
                    // Counted over every worker the stream had.
                    progress.counted = progress.counted_before + completion_tokens;
                    if let Some(c) = cached.filter(|_| !progress.moved) {
                        match started.as_mut() {
                            Some(GenEvent::Started { cached: sc, .. }) => *sc = c,
                            _ => {
                                let _ = tx.send(GenEvent::Cached(c));
                            }
                        }
                    }
                }
                None => {
                    progress.send_started(tx, started.take());
                    let Some(reason) = reason else {
                        let why = "the engine ended the stream without a finish reason".to_string();
                        return if sent_token { Relay::Failed(why) } else { Relay::Retry(why) };
                    };
                    let completion_tokens = progress.counted.max(progress.counted_before + chunks);
                    let _ =
                        tx.send(GenEvent::Done { reason, completion_tokens, text: String::new() });
                    return Relay::Finished;
                }
            }
        }
    }
}

enum Relay {
    Finished,
    Retry(String),
    Failed(String),
}

/// What the client was sent of a request so far, over every worker that served it.
#[derive(Debug, Default)]
struct Progress {
    /// `Started` was sent (a stream that moves does not start again).
    started_sent: bool,
    /// The stream moved to another worker at least once.
    moved: bool,
    /// The tokens sent, in order.
    generated: Vec<u32>,
    /// Every token's id is known (an OpenAI engine may not return them): the stream can move.
    ids_known: bool,
    /// Completion tokens the engines reported (OpenAI usage), this attempt's included.
    counted: usize,
    /// ... before this attempt.
    counted_before: usize,
}

impl Progress {
    /// Sends `started` if the client has not had one.
    fn send_started(&mut self, tx: &EventTx, started: Option<GenEvent>) {
        if let Some(s) = started.filter(|_| !self.started_sent) {
            let _ = tx.send(s);
        }
        self.started_sent = true;
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
