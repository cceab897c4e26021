//! A serving worker's assembly ([`WorkerStack`]: engine, tiered store, agent, publishers;
//! serving and registration), shared by `kvfabric up` and `kvfabric worker`. What a worker
//! is to the rest of the system (its kinds in discovery, its role, the metadata it registers
//! there) is part of the frontend↔worker protocol, re-exported here.

use kvfabric::transport::rdma::RdmaConfig;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig, AgentError};
use kvfabric::contract::{Load, Message};
use kvfabric::control::advertise::Advertise;
use kvfabric::control::{ControlError, Discovery, EventBus, Instance, Registration};
use kvfabric::events::{ChannelSink, TierKind};
use kvfabric::layout::KvDtype;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::fabric::{FabricNode, PeerLimits};
use kvfabric_tiers::publish::StorePublisher;
use kvfabric_tiers::remote::peers::Peers;
use kvfabric_tiers::remote::RemoteTier;
use kvfabric_tiers::{StoreConfig, StoreError, TieredStore};

use crate::backend::{Backend, LocalBackend};
use crate::disagg::{run_prefill_service, DecodeBackend, DisaggConfig, PrefillStats};
use crate::engine::llama::{LlamaEngine, LlamaOptions, Weights};
use crate::engine::mock::{MockConfig, MockEngine};
use crate::engine::{Engine, EngineError, Scheduler, SchedulerConfig};
use crate::metrics::{worker_stats, Components, Snapshot, Source};
use crate::routed::{RoutedBackend, RoutedConfig};

use crate::protocol::{Auth, ServeLimits, ServeStats};
pub use crate::protocol::{CodecSpec, Role, WorkerMetadata, PREFILL_KIND, WORKER_KIND};

/// The engine a worker runs.
#[derive(Debug, Clone)]
pub enum EngineSpec {
    /// A llama-architecture GGUF model on CPU.
    Llama {
        /// The GGUF file.
        path: PathBuf,
        /// Its options (weights, block size, context, tokenizer, served name).
        options: LlamaOptions,
    },
    /// The mock engine (a timing model over SmolLM2-135M's KV layout in f32, or over the
    /// tokenizer and KV layout of a model directory).
    Mock {
        /// The id it is served under.
        name: String,
        /// Tokens per block.
        block_tokens: u32,
        /// A Hugging Face model directory to mirror (None: one token per byte).
        model_dir: Option<PathBuf>,
        /// Its timings.
        config: MockConfig,
    },
}

/// Everything a worker is made of, without its control plane.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Its name in discovery (and its agent's).
    pub name: String,
    /// The engine.
    pub engine: EngineSpec,
    /// The batching loop's settings.
    pub scheduler: SchedulerConfig,
    /// The shared secret of the transfer engine and the request port (None: random, for a
    /// worker that only this process talks to — then nothing else can reach it; moves no KV to
    /// others).
    pub secret: Option<kvfabric::secret::Secret>,
    /// Mutual TLS on its request port and its agent's connections (when the process has
    /// certificates and a deployment CA).
    pub tls: Option<Arc<kvfabric::tls::Tls>>,
    /// Host tier capacity, blocks.
    pub host_blocks: u32,
    /// The disk tier: a directory and a capacity in blocks (None: no disk tier).
    pub disk: Option<(PathBuf, u32)>,
    /// Hits a block needs before an eviction writes it to disk (0: every block; 1: blocks
    /// reused at least once, so one-off prompts never cost a disk write).
    pub disk_admit_min_hits: u32,
    /// Use the fabric nodes in discovery as a remote tier (G4).
    pub remote_tier: bool,
    /// RDMA between hosts (None: never); the binary reads it from `KVFABRIC_RDMA*`.
    pub rdma: Option<RdmaConfig>,
    /// Where its transfer agent listens (TCP; `127.0.0.1:0`: loopback, any port).
    pub transfer_listen: SocketAddr,
    /// The address its agent registers for peers (None: the one bound; required when it
    /// listens on `0.0.0.0`).
    pub transfer_advertise: Option<Advertise>,
    /// One KV pool across workers: it pulls prefix blocks from other workers' stores where
    /// a router says so, and serves theirs (None: neither).
    pub peers: Option<PeerConfig>,
    /// With the fabric as its lowest tier: an allocation that must evict waits on writing its
    /// victim there only while those writes measure at least this many bytes per second
    /// (0: always; `kvfabric worker` gives 800 Mbit/s): over a slower link, waiting would
    /// hold the engine to the link's rate.
    pub remote_write_min_bytes_per_s: f64,
}

/// How a worker takes part in the pool of workers' stores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeerConfig {
    /// The share (0..=1) of its host tier that peers' pulls may pin at once, and of its link
    /// (`link_bytes_per_s`) they may take.
    pub share: f64,
    /// Its link's rate, bytes per second, that the share paces peers' pulls to (None: not
    /// paced; only the pins bound them).
    pub link_bytes_per_s: Option<f64>,
    /// The longest a pull may take (and its request's deadline, if sooner).
    pub deadline: Duration,
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig { share: 0.25, link_bytes_per_s: None, deadline: Duration::from_secs(5) }
    }
}

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The engine could not be loaded or started.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The block store could not be opened.
    #[error("opening the block store: {0}")]
    Store(#[from] StoreError),
    /// The transfer agent could not start.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The control plane refused.
    #[error("control plane: {0}")]
    Control(#[from] ControlError),
    /// A file or socket.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> WorkerError {
    move |source| WorkerError::Io { what: what.into(), source }
}

/// One worker's engine, store and agent, publishing its KV events, load and dumps on a bus.
#[derive(Debug)]
pub struct WorkerStack {
    /// The batching loop over the engine.
    pub sched: Scheduler,
    /// The tiered block store.
    pub store: TieredStore,
    /// The transfer agent owning the store's host region.
    pub agent: Agent,
    /// One line saying what it serves.
    pub describe: String,
    /// How to tokenize for it.
    pub codec: CodecSpec,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    publisher: StorePublisher,
    /// What its load reports say of it once it serves (its backend's counters); until
    /// then, its engine's and store's.
    report: Arc<parking_lot::Mutex<Option<(MetricsSource, &'static str)>>>,
    /// The shared secret of its agent and its request port.
    secret: kvfabric::secret::Secret,
    /// Its TLS between processes, if any.
    tls: Option<Arc<kvfabric::tls::Tls>>,
    /// Its store as peers pull from it (None: it serves no pulls).
    serving_peers: Option<kvfabric::contract::discovery::NodeInfo>,
}

/// A worker serving requests (or prefill jobs) and registered in discovery.
#[derive(Debug)]
pub struct Served {
    /// Its request address (a prefill worker's: its agent's).
    pub addr: SocketAddr,
    /// Its registration; revoke it to leave discovery at once.
    pub registration: Registration,
    /// The task serving requests or jobs.
    pub server: tokio::task::JoinHandle<()>,
    /// What its `/metrics` shows.
    pub metrics: MetricsSource,
    /// Its request port's counters (None for a prefill worker, which has none).
    pub stats: Option<Arc<ServeStats>>,
}

/// A worker's drain, after it left discovery: waits until nothing is in flight — no request on
/// its port (`stats`), no sequence in its engine — for `quiet` in a row (requests a router
/// sent just before it saw the worker leave still arrive), or until `deadline`. True when it
/// drained.
pub async fn drain(
    stats: Option<&ServeStats>,
    sched: &Scheduler,
    quiet: Duration,
    deadline: Duration,
) -> bool {
    sched.stats().draining.store(true, Ordering::Relaxed);
    let start = tokio::time::Instant::now();
    let mut idle_since: Option<tokio::time::Instant> = None;
    loop {
        let s = sched.stats();
        let busy = stats.map_or(0, |st| st.in_flight.load(Ordering::Relaxed))
            + s.running.load(Ordering::Relaxed)
            + s.waiting.load(Ordering::Relaxed);
        let now = tokio::time::Instant::now();
        if busy == 0 {
            let since = *idle_since.get_or_insert(now);
            if now - since >= quiet {
                return true;
            }
        } else {
            idle_since = None;
        }
        if now - start >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until no worker (of any role) is registered as `name`, for at most `ttl` and a
/// second (a dead process's registration expires within its lease TTL); fails with
/// [`ControlError::Taken`] if one stays. Run before a worker starts publishing under its name:
/// a second process under a name in use must not speak for the first (its KV events and
/// dumps would stand for the first's blocks). Registration itself never overwrites another
/// live instance either ([`Discovery::register`]), which settles two that start at once.
pub async fn ensure_name_free(
    discovery: &dyn Discovery,
    name: &str,
    ttl: Duration,
) -> Result<(), ControlError> {
    let deadline = tokio::time::Instant::now() + ttl + Duration::from_secs(1);
    let mut logged = false;
    loop {
        let mut held = None;
        for kind in [WORKER_KIND, PREFILL_KIND] {
            if discovery.list(kind).await?.iter().any(|i| i.id == name) {
                held = Some(kind);
            }
        }
        let Some(kind) = held else { return Ok(()) };
        if tokio::time::Instant::now() >= deadline {
            return Err(ControlError::Taken { kind: kind.into(), id: name.into() });
        }
        if !logged {
            tracing::warn!(worker = %name, kind, "a worker of this name is registered: waiting for \
                its lease to expire (a dead process's) before starting, or refusing (a live one's)");
            logged = true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The worker's load reports: this often.
const LOAD_PERIOD: Duration = Duration::from_millis(200);

impl WorkerStack {
    /// Loads the engine (`progress(done, total)` as tensors load), opens the store, follows
    /// the fabric nodes in `discovery` when asked, and starts publishing the store's KV
    /// events and dumps and the worker's load on `bus`.
    pub async fn start(
        cfg: &WorkerConfig,
        discovery: &Arc<dyn Discovery>,
        bus: Arc<dyn EventBus>,
        progress: impl FnMut(usize, usize) + Send + 'static,
    ) -> Result<Self, WorkerError> {
        type StartFn = Box<dyn FnOnce(TieredStore) -> Result<Scheduler, EngineError> + Send>;
        let rt = tokio::runtime::Handle::current();
        let sched_cfg = cfg.scheduler.clone();
        let (start, block_bytes, block_tokens, describe, codec): (
            StartFn,
            u64,
            u32,
            String,
            CodecSpec,
        ) = match &cfg.engine {
            EngineSpec::Llama { path, options } => {
                let (p, o) = (path.clone(), options.clone());
                let llama =
                    tokio::task::spawn_blocking(move || LlamaEngine::load(&p, &o, progress))
                        .await
                        .map_err(|e| EngineError::model(format!("loading the model: {e}")))??;
                let info = llama.info().clone();
                let describe = format!(
                    "{} (llama, {} weights, {} layers of KV in {} B blocks)",
                    info.id,
                    if options.weights == Weights::F32 { "f32" } else { "quantized" },
                    info.layout.kv.num_layers,
                    info.layout.bytes_per_block(),
                );
                let codec = CodecSpec::Gguf {
                    path: std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()),
                    tokenizer: options.tokenizer_json.clone(),
                };
                (
                    Box::new(move |store| Scheduler::start(llama, store, sched_cfg, rt)),
                    info.layout.bytes_per_block(),
                    options.block_tokens,
                    describe,
                    codec,
                )
            }
            EngineSpec::Mock { name, block_tokens, model_dir, config } => {
                let (mock, codec) = match model_dir {
                    Some(dir) => {
                        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
                        let mock = MockEngine::from_model_dir(name, &dir, *block_tokens, *config)?;
                        (mock, CodecSpec::ModelDir { path: dir })
                    }
                    None => {
                        let layout = kvfabric_planner::plan::resolve_model("smollm2-135m")
                            .and_then(|s| {
                                Ok(s.with_dtype(KvDtype::F32).block_layout(*block_tokens)?)
                            })
                            .map_err(|e| EngineError::model(e.to_string()))?;
                        (MockEngine::new(name, layout, *config)?, CodecSpec::Bytes)
                    }
                };
                let bytes = mock.info().layout.bytes_per_block();
                (
                    Box::new(move |store| Scheduler::start(mock, store, sched_cfg, rt)),
                    bytes,
                    *block_tokens,
                    format!("{name} (mock engine, {bytes} B blocks)"),
                    codec,
                )
            }
        };

        // The data plane: an agent owning the store's host region.
        let secret = match &cfg.secret {
            Some(s) => s.clone(),
            None => {
                let mut b = [0u8; 32];
                getrandom::fill(&mut b).map_err(|e| WorkerError::Io {
                    what: "drawing a random secret".into(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                kvfabric::secret::Secret::new(b.to_vec())
            }
        };
        let mut agent_cfg = AgentConfig::new(cfg.name.clone(), secret.clone());
        agent_cfg.tls = cfg.tls.clone();
        agent_cfg.rdma = cfg.rdma.clone();
        agent_cfg.listen = cfg.transfer_listen;
        agent_cfg.advertise = cfg.transfer_advertise;
        let agent = Agent::start(agent_cfg).await?;
        let (sink, events) = ChannelSink::new(65_536);
        let mut tasks = Vec::new();
        let mut store_cfg = StoreConfig::new(block_bytes, cfg.host_blocks.max(1));
        store_cfg.disk_admit_min_hits = cfg.disk_admit_min_hits;
        if let Some((dir, blocks)) = cfg.disk.as_ref().filter(|(_, b)| *b > 0) {
            std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
            // One file per worker and block size: a restart with another model reads no
            // foreign blocks.
            store_cfg.disk = Some(DiskConfig::new(
                dir.join(format!("{}-{block_bytes}.slots", cfg.name)),
                *blocks,
            ));
            // A quarter of the host tier stays free, written back to disk in the background:
            // new blocks (computed, or written by a prefill worker) seldom wait for the disk.
            store_cfg.host_free_target = store_cfg.host_blocks / 4;
        }
        // G4: the fabric nodes in discovery, followed for as long as the worker runs.
        let remote =
            cfg.remote_tier.then(|| RemoteTier::new(agent.clone(), Duration::from_secs(10)));
        if remote.is_some() && store_cfg.disk.is_none() {
            // Evictions go to the fabric in the background, at the link's pace, keeping a
            // sixteenth of the host tier free (a quarter, as with a disk, cost a slow link's
            // workers 5 points of reuse: what they keep free they do not cache, and there
            // the fabric is not read); an allocation that finds none waits on the
            // fabric only over a link of 800 Mbit/s or more, and drops its victim over a
            // slower one rather than stall the engine at the link's rate.
            store_cfg.host_free_target = store_cfg.host_blocks / 16;
            store_cfg.remote_write_min_bytes_per_s = cfg.remote_write_min_bytes_per_s;
        }
        store_cfg.remote = remote.clone();
        // One pool across workers: only with a shared secret (a random one reaches no peer).
        let peer_cfg = cfg.peers.filter(|_| cfg.secret.is_some());
        let peers = peer_cfg.map(|p| Peers::new(agent.clone(), block_bytes, p.deadline));
        store_cfg.peers = peers.clone();
        let host_blocks = store_cfg.host_blocks;
        let store = TieredStore::open(store_cfg, &agent, sink).await?;
        let sched = start(store.clone())?;
        if let Some(remote) = remote {
            tasks.push(remote.follow(&**discovery, block_bytes, None).await?);
        }
        let mut serving_peers = None;
        if let (Some(p), Some(peers)) = (peer_cfg, &peers) {
            let limits = PeerLimits::share(p.share, host_blocks, p.link_bytes_per_s);
            FabricNode::serve_peers(
                agent.clone(),
                store.clone(),
                p.deadline,
                limits,
                peers.stats().clone(),
            );
            tasks.push(peers.follow(&**discovery, WORKER_KIND, cfg.name.clone()).await?);
            serving_peers = Some(kvfabric::contract::discovery::NodeInfo {
                agent: agent.metadata(),
                block_bytes,
            });
        }

        // Load reports for the routers, a few times a second, with what dashboards show.
        let report: Arc<parking_lot::Mutex<Option<(MetricsSource, &'static str)>>> = Arc::default();
        {
            let (bus, name, sched) = (bus.clone(), cfg.name.clone(), sched.clone());
            let (store, report) = (store.clone(), report.clone());
            let bt = u64::from(block_tokens.max(1));
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(LOAD_PERIOD);
                loop {
                    tick.tick().await;
                    let s = sched.stats();
                    // Read first: every request up to it counts in what follows.
                    let accepted = s.accepted.load(Ordering::SeqCst);
                    let source = report.lock().clone();
                    let load = Load {
                        active_blocks: s.active_tokens.load(Ordering::Relaxed).div_ceil(bt),
                        queued_prefill_tokens: s.prefill_load(),
                        // A backend that numbers no requests (a decode worker's: they reach
                        // its engine after their remote prefill) reports no count, and its
                        // report replaces what routers tracked.
                        accepted: source
                            .as_ref()
                            .is_none_or(|(s, _)| s.numbers_requests())
                            .then_some(accepted),
                    };
                    let mut snap = Snapshot::default();
                    let role = match source {
                        Some((source, role)) => {
                            source.snapshot(&mut snap);
                            role
                        }
                        None => {
                            snap.engine = Some(crate::backend::engine_snapshot(&sched, &store));
                            snap.transfers = store.agent().transfer_counts();
                            ""
                        }
                    };
                    let mut stats = worker_stats(&snap, s.draining.load(Ordering::Relaxed));
                    stats.prefill_tokens_per_s = s.prefill_tokens_per_s.load(Ordering::Relaxed);
                    stats.role = role.to_string();
                    let msg =
                        Message::Load { source: name.clone(), load, stats: Some(Box::new(stats)) };
                    let _ = bus.publish(msg.topic(), msg.encode()).await;
                }
            }));
        }
        let publisher = StorePublisher::start(bus, cfg.name.clone(), store.clone(), events).await?;
        Ok(WorkerStack {
            sched,
            store,
            agent,
            describe,
            codec,
            tasks,
            publisher,
            report,
            secret,
            tls: cfg.tls.clone(),
            serving_peers,
        })
    }

    /// The metadata a worker registers, with its request port.
    pub fn metadata(&self, addr: SocketAddr) -> WorkerMetadata {
        WorkerMetadata {
            model: self.sched.info().clone(),
            codec: self.codec.clone(),
            addr,
            role: Default::default(),
            api: Default::default(),
            store: self.serving_peers.clone(),
        }
    }

    /// Serves requests from frontends on `listen` (a prefill worker: jobs from its queue,
    /// `parallel` at once) and registers the worker in discovery as `name` under a lease of
    /// `lease_ttl`, at `advertise` (None: the address bound; a prefill worker registers its
    /// agent's). A decode worker prefills long prompts remotely as `disagg` says.
    #[allow(clippy::too_many_arguments)]
    pub async fn serve(
        &self,
        name: &str,
        role: Role,
        listen: SocketAddr,
        advertise: Option<Advertise>,
        discovery: &Arc<dyn Discovery>,
        bus: &Arc<dyn EventBus>,
        parallel: usize,
        disagg: DisaggConfig,
        lease_ttl: Duration,
    ) -> Result<Served, WorkerError> {
        let local = LocalBackend::new(self.sched.clone(), self.store.clone());
        let (addr, server, kind, metrics, stats) = match role {
            Role::Prefill => {
                // No request port: jobs come from its queue; KV goes out through its agent.
                let stats = Arc::new(PrefillStats::default());
                let server = run_prefill_service(
                    self.agent.clone(),
                    self.sched.clone(),
                    self.store.clone(),
                    bus.clone(),
                    parallel.max(1),
                    stats.clone(),
                );
                let metrics = MetricsSource::Prefill(Arc::new(local), stats);
                (self.agent.advertised_addr(), server, PREFILL_KIND, metrics, None)
            }
            Role::Aggregated | Role::Decode => {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .map_err(io_err(format!("listening on {listen}")))?;
                let bound = listener.local_addr().map_err(io_err("the listener's address"))?;
                if bound.ip().is_unspecified() && advertise.is_none() {
                    return Err(WorkerError::Io {
                        what: format!("listening on {bound}"),
                        source: std::io::Error::other(
                            "no address to register: frontends cannot dial 0.0.0.0 (give one to advertise)",
                        ),
                    });
                }
                let addr = advertise.map_or(bound, |a| a.addr(bound));
                let backend: Arc<dyn Backend> = if role == Role::Decode {
                    let cfg = RoutedConfig {
                        kind: PREFILL_KIND.into(),
                        name: format!("{name}-prefill-router"),
                        tls: self.tls.clone(),
                        ..RoutedConfig::new(self.secret.clone())
                    };
                    let prefill = RoutedBackend::start(discovery.clone(), bus.clone(), cfg).await?;
                    Arc::new(
                        DecodeBackend::start(
                            local,
                            self.store.clone(),
                            self.agent.clone(),
                            bus.clone(),
                            prefill,
                            disagg,
                        )
                        .await?,
                    )
                } else {
                    Arc::new(local)
                };
                let auth = Auth {
                    name: name.to_string(),
                    secret: self.secret.clone(),
                    tls: self.tls.clone(),
                };
                let stats = Arc::new(ServeStats::default());
                let server = crate::protocol::serve(
                    listener,
                    backend.clone(),
                    auth,
                    ServeLimits::default(),
                    stats.clone(),
                );
                let metrics = MetricsSource::Backend(backend, stats.port.clone());
                (addr, server, WORKER_KIND, metrics, Some(stats))
            }
        };
        let role_name = match role {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        };
        *self.report.lock() = Some((metrics.clone(), role_name));
        let mut md = self.metadata(addr);
        md.role = role;
        let metadata = serde_json::to_value(md).map_err(|e| ControlError::Malformed {
            what: "worker metadata",
            message: e.to_string(),
        })?;
        let instance = Instance { kind: kind.into(), id: name.to_string(), metadata };
        let registration = discovery.register(instance, lease_ttl).await?;
        tracing::info!(worker = %name, %addr, transfer = %self.agent.advertised_addr(), ?role, kind,
            "worker registered in discovery");
        Ok(Served { addr, registration, server, metrics, stats })
    }

    /// Stops publishing; keeps host blocks across restarts by writing them to disk (bounded
    /// in time).
    pub async fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        drop(self.publisher);
        if self.store.disk().is_some() {
            let hosted: Vec<_> = self
                .store
                .snapshot()
                .into_iter()
                .filter(|(t, _, _)| *t == TierKind::Host)
                .map(|(_, h, _)| h)
                .collect();
            let _ =
                tokio::time::timeout(Duration::from_secs(10), self.store.offload(&hosted)).await;
        }
        // The peers' service holds the agent (and the store).
        self.agent.clear_rpc_handler();
        self.agent.shutdown();
    }
}

/// What a worker's `/metrics` shows.
#[derive(Debug, Clone)]
pub enum MetricsSource {
    /// A serving backend (aggregated or decode), and its request port.
    Backend(Arc<dyn Backend>, Arc<kvfabric::session::admission::PortStats>),
    /// A prefill worker: its engine and its job counters.
    Prefill(Arc<LocalBackend>, Arc<PrefillStats>),
}

impl Source for MetricsSource {
    fn snapshot(&self, out: &mut Snapshot) {
        match self {
            MetricsSource::Backend(b, port) => {
                b.metrics(out);
                out.ports.push(port.snapshot());
            }
            MetricsSource::Prefill(b, s) => {
                b.metrics(out);
                out.prefill_service = Some(s.snapshot());
            }
        }
    }
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.merge(match self {
            MetricsSource::Backend(b, _) => Backend::health(b.as_ref()),
            MetricsSource::Prefill(b, _) => Backend::health(b.as_ref()),
        });
    }
}

impl MetricsSource {
    /// Whether the requests it serves are numbered as its engine accepts them (a prefill
    /// worker's jobs reach no router: its count is harmless).
    fn numbers_requests(&self) -> bool {
        match self {
            MetricsSource::Backend(b, _) => b.numbers_requests(),
            MetricsSource::Prefill(..) => true,
        }
    }

    /// OpenMetrics text of this worker alone (its own `/metrics`).
    pub fn render(&self) -> String {
        Components::new().with(None, Arc::new(self.clone())).render()
    }
}
