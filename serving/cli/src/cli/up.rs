//! `kvfabric up`: everything in one process. The OpenAI-compatible frontend, one engine
//! (the real model by default, or the mock) or `--workers N` of them behind KV routing, each
//! with its tiered block store (host memory over a disk tier under the data directory), and
//! the embedded control plane (discovery and the event bus, where workers register and
//! publish their KV events and load).
//!
//! The engine options ([`EngineOpts`]) and the worker stack ([`start_stack`]) are shared with
//! `kvfabric worker`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::contract::Message;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus, Instance, Registration};
use kvfabric::events::{ChannelSink, TierKind};
use kvfabric::layout::KvDtype;
use kvfabric::transfer::TransportKind;
use kvfabric_router::{Load, RoutingMode};
use kvfabric_serving::backend::{Backend, LocalBackend};
use kvfabric_serving::disagg::{run_prefill_service, DecodeBackend, DisaggConfig, PrefillStats};
use kvfabric_serving::engine::llama::{LlamaEngine, LlamaOptions, Weights};
use kvfabric_serving::engine::mock::{MockConfig, MockEngine};
use kvfabric_serving::engine::{Engine, Scheduler, SchedulerConfig};
use kvfabric_serving::http::{self, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use kvfabric_serving::worker::{CodecSpec, Role, WorkerMetadata, PREFILL_KIND, WORKER_KIND};
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::publish::StorePublisher;
use kvfabric_tiers::remote::RemoteTier;
use kvfabric_tiers::{StoreConfig, TieredStore};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// A llama-architecture GGUF model on CPU (candle).
    Llama,
    /// A timing model with synthetic KV (no model file).
    Mock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightsArg {
    /// Dequantize to f32 at load (exact, reproducible greedy output).
    F32,
    /// Keep the GGUF's quantized weights (faster, approximate).
    Quantized,
}

/// What runs in a worker: the engine, its model and its block store.
#[derive(Debug, Clone, Args)]
pub struct EngineOpts {
    /// The engine.
    #[arg(long, env = "KVFABRIC_ENGINE", value_enum, default_value = "llama")]
    pub engine: EngineKind,
    /// A GGUF model file (default: the model scripts/fetch-model.sh caches).
    #[arg(long, env = "KVFABRIC_MODEL")]
    pub model: Option<PathBuf>,
    /// A tokenizer.json to use instead of the GGUF's vocabulary.
    #[arg(long, env = "KVFABRIC_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// The id the model is served under (default: the file name; `mock` for the mock).
    #[arg(long, env = "KVFABRIC_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Weights of the llama engine.
    #[arg(long, env = "KVFABRIC_WEIGHTS", value_enum, default_value = "f32")]
    pub weights: WeightsArg,
    /// Directory of the disk tier (default: ~/.cache/kvfabric/data).
    #[arg(long, env = "KVFABRIC_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Host tier capacity per worker, blocks.
    #[arg(long, env = "KVFABRIC_HOST_BLOCKS", default_value_t = 512)]
    pub host_blocks: u32,
    /// Disk tier capacity per worker, blocks (0: no disk tier). The file grows as blocks
    /// arrive.
    #[arg(long, env = "KVFABRIC_DISK_BLOCKS", default_value_t = 4096)]
    pub disk_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16)]
    pub block_tokens: u32,
    /// Context length cap, tokens.
    #[arg(long, env = "KVFABRIC_CONTEXT", default_value_t = 8192)]
    pub context: usize,
    /// Sequences batched together at most.
    #[arg(long, env = "KVFABRIC_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,
    /// Requests waiting at most; more are refused (429).
    #[arg(long, env = "KVFABRIC_MAX_WAITING", default_value_t = 128)]
    pub max_waiting: usize,
    /// Prompt tokens computed per step at most.
    #[arg(long, env = "KVFABRIC_STEP_TOKENS", default_value_t = 256)]
    pub step_tokens: usize,
    /// Shared secret of the transfer engine's handshake (prefill and decode workers must
    /// agree; default: random, which suits aggregated workers).
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// Decode workers: prefill remotely when at least this many prompt tokens are uncached.
    #[arg(long, env = "KVFABRIC_PREFILL_THRESHOLD", default_value_t = 256)]
    pub prefill_threshold: usize,
    /// Decode workers: remote prefills pending at most (beyond, prefill locally).
    #[arg(long, env = "KVFABRIC_MAX_PREFILL_QUEUE", default_value_t = 8)]
    pub max_prefill_queue: usize,
    /// Decode workers: give up on a remote prefill after this long and prefill locally.
    #[arg(long, env = "KVFABRIC_PREFILL_DEADLINE_MS", default_value_t = 30_000)]
    pub prefill_deadline_ms: u64,
    /// Decode workers: the transport prefill workers write KV with (auto: shm on one host,
    /// tcp across hosts).
    #[arg(long, env = "KVFABRIC_KV_TRANSPORT", value_enum, default_value = "auto")]
    pub kv_transport: KvTransport,
    /// Use the KV fabric's nodes found in discovery (`kvfabric fabric`) as a remote tier
    /// (G4): cached blocks no local tier holds are fetched from them.
    #[arg(long, env = "KVFABRIC_REMOTE_TIER", default_value_t = true, action = clap::ArgAction::Set)]
    pub remote_tier: bool,
    /// Mock: prefill cost per uncached prompt token, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_PREFILL_US", default_value_t = 40.0)]
    pub mock_prefill_us: f64,
    /// Mock: fixed cost of a decode step, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_DECODE_US", default_value_t = 8000.0)]
    pub mock_decode_us: f64,
    /// Mock: decode cost per token of active KV, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_DECODE_KV_US", default_value_t = 0.2)]
    pub mock_decode_kv_us: f64,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    engine: EngineOpts,
    /// Address to listen on.
    #[arg(long, env = "KVFABRIC_HOST", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, env = "KVFABRIC_PORT", default_value_t = 8000)]
    port: u16,
    /// Workers (engines) in this process; more than one puts KV routing in front of them.
    #[arg(long, env = "KVFABRIC_WORKERS", default_value_t = 1)]
    workers: usize,
    /// Disaggregated serving: this many prefill workers (with --decode-workers).
    #[arg(long, env = "KVFABRIC_PREFILL_WORKERS", default_value_t = 0)]
    prefill_workers: usize,
    /// Disaggregated serving: this many decode workers (with --prefill-workers).
    #[arg(long, env = "KVFABRIC_DECODE_WORKERS", default_value_t = 0)]
    decode_workers: usize,
    /// Put the routing frontend and the worker transport in front of a single worker too
    /// (to measure their overhead).
    #[arg(long, hide = true)]
    via_frontend: bool,
    /// Routing with several workers: kv, round-robin, random, least-loaded.
    #[arg(long, env = "KVFABRIC_ROUTER", default_value = "kv", value_parser = parse_mode)]
    router: RoutingMode,
    /// Request deadline, seconds.
    #[arg(long, env = "KVFABRIC_REQUEST_TIMEOUT_S", default_value_t = 300)]
    request_timeout_s: u64,
    /// Worker name in discovery (with several workers, the prefix of their names).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "worker")]
    name: String,
}

pub fn parse_mode(s: &str) -> Result<RoutingMode, String> {
    s.parse()
}

/// The transport of KV writes from prefill to decode workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvTransport {
    /// Shared memory on one host, TCP across hosts.
    Auto,
    /// Shared memory (same host only).
    Shm,
    /// Striped TCP.
    Tcp,
}

impl EngineOpts {
    /// The decode side's disaggregation settings.
    pub fn disagg(&self) -> DisaggConfig {
        DisaggConfig {
            threshold_tokens: self.prefill_threshold,
            max_queue: self.max_prefill_queue,
            deadline: Duration::from_millis(self.prefill_deadline_ms.max(1)),
            transport: match self.kv_transport {
                KvTransport::Auto => None,
                KvTransport::Shm => Some(TransportKind::Shm),
                KvTransport::Tcp => Some(TransportKind::Tcp),
            },
            ..DisaggConfig::default()
        }
    }
}

/// Where scripts/fetch-model.sh caches the default model.
pub fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("KVFABRIC_MODEL_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| ".".into());
        home.join(".cache/kvfabric/models")
    });
    dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// One worker's engine, store and agent, publishing its KV events, load and dumps on a bus.
pub struct Stack {
    pub sched: Scheduler,
    pub store: TieredStore,
    pub agent: Agent,
    pub describe: String,
    pub codec: CodecSpec,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    publisher: StorePublisher,
}

impl Stack {
    /// The metadata a worker registers, with its request port.
    pub fn metadata(&self, addr: SocketAddr) -> WorkerMetadata {
        WorkerMetadata {
            model: self.sched.info().clone(),
            codec: self.codec.clone(),
            addr,
            role: Default::default(),
        }
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
        self.agent.shutdown();
    }
}

/// Starts a scheduler over the store it is given.
type StartFn = Box<dyn FnOnce(TieredStore) -> anyhow::Result<Scheduler> + Send>;

/// Loads the engine, opens the store and starts the publishers of `name`'s KV events, load
/// and (on request) dumps on `bus`.
pub async fn start_stack(
    opts: &EngineOpts,
    name: &str,
    discovery: &Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
    show_progress: bool,
) -> anyhow::Result<Stack> {
    let sched_cfg = SchedulerConfig {
        max_batch: opts.max_batch.max(1),
        max_waiting: opts.max_waiting,
        step_tokens: opts.step_tokens.max(1),
        ..SchedulerConfig::default()
    };
    let rt = tokio::runtime::Handle::current();
    let (start, block_bytes, describe, codec): (StartFn, u64, String, CodecSpec) = match opts.engine
    {
        EngineKind::Llama => {
            let path = opts.model.clone().unwrap_or_else(default_model_path);
            anyhow::ensure!(
                path.is_file(),
                "model file {} not found (scripts/fetch-model.sh fetches the default model; --model takes any llama GGUF)",
                path.display()
            );
            let lopts = LlamaOptions {
                weights: match opts.weights {
                    WeightsArg::F32 => Weights::F32,
                    WeightsArg::Quantized => Weights::Quantized,
                },
                block_tokens: opts.block_tokens,
                max_context: opts.context,
                tokenizer_json: opts.tokenizer.clone(),
                name: opts.served_model_name.clone(),
            };
            let bar = if show_progress {
                indicatif::ProgressBar::new(1)
            } else {
                indicatif::ProgressBar::hidden()
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "loading {msg} [{bar:40}] {pos}/{len} tensors {elapsed}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_message(
                path.file_name().and_then(|s| s.to_str()).unwrap_or("model").to_string(),
            );
            let (b, p) = (bar.clone(), path.clone());
            let llama = tokio::task::spawn_blocking(move || {
                LlamaEngine::load(&p, &lopts, |done, total| {
                    b.set_length(total as u64);
                    b.set_position(done as u64);
                })
            })
            .await??;
            bar.finish_and_clear();
            let info = llama.info().clone();
            let describe = format!(
                "{} (llama, {} weights, {} layers of KV in {} B blocks)",
                info.id,
                if opts.weights == WeightsArg::F32 { "f32" } else { "quantized" },
                info.layout.kv.num_layers,
                info.layout.bytes_per_block(),
            );
            let codec = CodecSpec::Gguf {
                path: std::fs::canonicalize(&path).unwrap_or(path),
                tokenizer: opts.tokenizer.clone(),
            };
            let cfg = sched_cfg.clone();
            (
                Box::new(move |store| Ok(Scheduler::start(llama, store, cfg, rt)?)),
                info.layout.bytes_per_block(),
                describe,
                codec,
            )
        }
        EngineKind::Mock => {
            let spec =
                kvfabric_serving::plan::resolve_model("smollm2-135m")?.with_dtype(KvDtype::F32);
            let layout = spec.block_layout(opts.block_tokens)?;
            let mock_cfg = MockConfig {
                prefill_us_per_token: opts.mock_prefill_us,
                decode_step_us: opts.mock_decode_us,
                decode_us_per_kv_token: opts.mock_decode_kv_us,
                context_len: opts.context,
            };
            let model = opts.served_model_name.clone().unwrap_or_else(|| "mock".into());
            let mock = MockEngine::new(&model, layout, mock_cfg)?;
            let bytes = layout.bytes_per_block();
            let cfg = sched_cfg.clone();
            (
                Box::new(move |store| Ok(Scheduler::start(mock, store, cfg, rt)?)),
                bytes,
                format!("{model} (mock engine, {bytes} B blocks)"),
                CodecSpec::Bytes,
            )
        }
    };

    // The data plane: an agent owning the store's host region.
    let secret = match &opts.secret {
        Some(s) => s.clone().into_bytes(),
        None => {
            let mut b = [0u8; 32];
            getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("random secret: {e}"))?;
            b.to_vec()
        }
    };
    let agent = Agent::start(AgentConfig::new(name.to_string(), secret)).await?;
    let (sink, events) = ChannelSink::new(65_536);
    let mut tasks = Vec::new();
    let mut store_cfg = StoreConfig::new(block_bytes, opts.host_blocks.max(1));
    store_cfg.disk_admit_min_hits = 0;
    if opts.disk_blocks > 0 {
        let dir = opts.data_dir.clone().unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| ".".into());
            home.join(".cache/kvfabric/data")
        });
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // One file per worker and block size: a restart with another model reads no
        // foreign blocks.
        store_cfg.disk = Some(DiskConfig::new(
            dir.join(format!("{name}-{block_bytes}.slots")),
            opts.disk_blocks,
        ));
        // A quarter of the host tier stays free, written back to disk in the background:
        // new blocks (computed, or written by a prefill worker) seldom wait for the disk.
        store_cfg.host_free_target = store_cfg.host_blocks / 4;
    }
    // G4: the fabric nodes in discovery, followed for as long as the worker runs.
    let remote = opts.remote_tier.then(|| RemoteTier::new(agent.clone(), Duration::from_secs(10)));
    store_cfg.remote = remote.clone();
    let store =
        TieredStore::open(store_cfg, &agent, sink).await.context("opening the block store")?;
    let sched = start(store.clone())?;
    if let Some(remote) = remote {
        tasks.push(remote.follow(&**discovery, block_bytes, None).await?);
    }

    // Load reports for the routers, a few times a second.
    {
        let (bus, name, sched) = (bus.clone(), name.to_string(), sched.clone());
        let bt = u64::from(opts.block_tokens.max(1));
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                let s = sched.stats();
                let load = Load {
                    active_blocks: s.active_tokens.load(Ordering::Relaxed).div_ceil(bt),
                    queued_prefill_tokens: s.queued_prefill_tokens.load(Ordering::Relaxed),
                };
                let msg = Message::Load { source: name.clone(), load };
                let _ = bus.publish(msg.topic(), msg.encode()).await;
            }
        }));
    }
    let publisher = StorePublisher::start(bus, name.to_string(), store.clone(), events).await?;
    Ok(Stack { sched, store, agent, describe, codec, tasks, publisher })
}

/// Serves `stack`'s requests from frontends on `listen` and registers it in discovery.
#[allow(clippy::too_many_arguments)]
pub async fn serve_worker(
    stack: &Stack,
    name: &str,
    role: Role,
    listen: SocketAddr,
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
    opts: &EngineOpts,
    lease_ttl: Duration,
) -> anyhow::Result<(SocketAddr, Registration, tokio::task::JoinHandle<()>, MetricsSource)> {
    let local = LocalBackend::new(stack.sched.clone(), stack.store.clone());
    let (addr, server, kind, source) = match role {
        Role::Prefill => {
            // No request port: jobs come from its queue; KV goes out through its agent.
            let stats = Arc::new(PrefillStats::default());
            let server = run_prefill_service(
                stack.agent.clone(),
                stack.sched.clone(),
                stack.store.clone(),
                bus.clone(),
                opts.max_batch.max(1),
                stats.clone(),
            );
            let source = MetricsSource::Prefill(Arc::new(local), stats);
            (stack.agent.listen_addr(), server, PREFILL_KIND, source)
        }
        Role::Aggregated | Role::Decode => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("listening on {listen}"))?;
            let addr = listener.local_addr()?;
            let backend: Arc<dyn Backend> = if role == Role::Decode {
                let cfg = RoutedConfig {
                    kind: PREFILL_KIND.into(),
                    name: format!("{name}-prefill-router"),
                    ..RoutedConfig::default()
                };
                let prefill = RoutedBackend::start(discovery.clone(), bus.clone(), cfg).await?;
                Arc::new(
                    DecodeBackend::start(
                        local,
                        stack.store.clone(),
                        stack.agent.clone(),
                        bus.clone(),
                        prefill,
                        opts.disagg(),
                    )
                    .await?,
                )
            } else {
                Arc::new(local)
            };
            let server = kvfabric_serving::protocol::serve(listener, backend.clone());
            (addr, server, WORKER_KIND, MetricsSource::Backend(backend))
        }
    };
    let mut md = stack.metadata(addr);
    md.role = role;
    let registration = discovery
        .register(
            Instance {
                kind: kind.into(),
                id: name.to_string(),
                metadata: serde_json::to_value(md)?,
            },
            lease_ttl,
        )
        .await?;
    tracing::info!(worker = %name, %addr, ?role, kind, "worker registered in discovery");
    Ok((addr, registration, server, source))
}

/// What a worker's `/metrics` shows.
#[derive(Clone)]
pub enum MetricsSource {
    /// A serving backend (aggregated or decode).
    Backend(Arc<dyn Backend>),
    /// A prefill worker: its engine and its job counters.
    Prefill(Arc<LocalBackend>, Arc<PrefillStats>),
}

impl MetricsSource {
    /// Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        match self {
            MetricsSource::Backend(b) => b.render_metrics(&mut out),
            MetricsSource::Prefill(b, s) => {
                b.render_metrics(&mut out);
                let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
                use kvfabric_serving::metrics::sample;
                sample(
                    &mut out,
                    "kvfabric_prefill_jobs_done_total",
                    "counter",
                    "Prefill jobs whose blocks were written.",
                    ld(&s.done),
                );
                sample(
                    &mut out,
                    "kvfabric_prefill_jobs_failed_total",
                    "counter",
                    "Prefill jobs failed or expired.",
                    ld(&s.failed),
                );
                sample(
                    &mut out,
                    "kvfabric_prefill_sent_bytes_total",
                    "counter",
                    "KV bytes written to decode workers.",
                    ld(&s.bytes),
                );
                sample(
                    &mut out,
                    "kvfabric_prefill_transfer_seconds_total",
                    "counter",
                    "Time in KV writes.",
                    ld(&s.transfer_us) as f64 / 1e6,
                );
            }
        }
        out
    }
}

pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(t) => t,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let server_cfg = ServerConfig {
        request_timeout: Duration::from_secs(args.request_timeout_s.max(1)),
        ..ServerConfig::default()
    };
    let disagg = args.prefill_workers > 0 || args.decode_workers > 0;
    anyhow::ensure!(
        !disagg || (args.prefill_workers > 0 && args.decode_workers > 0),
        "disaggregated serving needs --prefill-workers and --decode-workers, both at least 1"
    );
    let mut engine = args.engine.clone();
    if disagg && engine.secret.is_none() {
        let mut b = [0u8; 16];
        getrandom::fill(&mut b).map_err(|e| anyhow::anyhow!("random secret: {e}"))?;
        engine.secret = Some(b.iter().map(|x| format!("{x:02x}")).collect());
    }
    let roles: Vec<(String, Role)> = if disagg {
        (0..args.prefill_workers)
            .map(|i| (format!("{}-prefill-{i}", args.name), Role::Prefill))
            .chain(
                (0..args.decode_workers)
                    .map(|i| (format!("{}-decode-{i}", args.name), Role::Decode)),
            )
            .collect()
    } else {
        (0..args.workers.max(1)).map(|i| (format!("{}-{i}", args.name), Role::Aggregated)).collect()
    };
    let n = roles.len();
    let mut stacks = Vec::new();
    let mut registrations = Vec::new();
    let mut servers = Vec::new();
    let (backend, describe): (Arc<dyn Backend>, String) = if n == 1 && !args.via_frontend {
        let stack = start_stack(&engine, &args.name, &discovery, bus.clone(), true).await?;
        let backend = Arc::new(LocalBackend::new(stack.sched.clone(), stack.store.clone()));
        let describe = stack.describe.clone();
        stacks.push(stack);
        (backend, describe)
    } else {
        for (i, (name, role)) in roles.iter().enumerate() {
            let stack = start_stack(&engine, name, &discovery, bus.clone(), i == 0).await?;
            let (_, reg, server, _) = serve_worker(
                &stack,
                name,
                *role,
                SocketAddr::from(([127, 0, 0, 1], 0)),
                &discovery,
                &bus,
                &engine,
                Duration::from_secs(10),
            )
            .await?;
            registrations.push(reg);
            servers.push(server);
            stacks.push(stack);
        }
        let cfg = RoutedConfig {
            router: kvfabric_router::RouterConfig { mode: args.router, ..Default::default() },
            name: format!("{}-frontend", args.name),
            ..RoutedConfig::default()
        };
        let remote = RoutedBackend::start(discovery.clone(), bus.clone(), cfg).await?;
        let describe = if disagg {
            format!(
                "{} on {} prefill + {} decode workers, {:?} routing",
                stacks[0].describe, args.prefill_workers, args.decode_workers, args.router
            )
        } else {
            format!("{} on {n} workers, {:?} routing", stacks[0].describe, args.router)
        };
        (Arc::new(remote), describe)
    };
    let id = backend.models().first().map(|m| m.id.clone()).unwrap_or_default();
    let app = http::router(backend, server_cfg);
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    tracing::info!("control plane: embedded discovery and event bus (this process only)");
    tracing::info!(%addr, "listening: kvfabric is serving {describe}");
    println!("kvfabric is serving {describe} at http://{addr}/v1");
    println!(
        "try:\n  curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 64}}'"
    );
    axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await?;
    for r in registrations {
        r.revoke().await;
    }
    for s in servers {
        s.abort();
    }
    for s in stacks {
        s.shutdown().await;
    }
    tracing::info!("kvfabric stopped");
    Ok(())
}
