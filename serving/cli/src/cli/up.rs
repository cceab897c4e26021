//! `kvfabric up`: everything in one process. The OpenAI-compatible frontend, one engine
//! (the real model by default, or the mock) or `--workers N` of them behind KV routing, each
//! with its tiered block store (host memory over a disk tier under the data directory), and
//! the embedded control plane (discovery and the event bus, where workers register and
//! publish their KV events and load).
//!
//! The engine options ([`EngineOpts`]) and [`start_stack`] are shared with `kvfabric worker`;
//! the worker itself is `kvfabric_serving::worker::WorkerStack`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::at_least_one;
use clap::{Args, ValueEnum};
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus};
use kvfabric::transfer::TransportKind;
use kvfabric_router::RoutingMode;
use kvfabric_serving::backend::{Backend, LocalBackend};
use kvfabric_serving::disagg::DisaggConfig;
use kvfabric_serving::engine::llama::{LlamaOptions, Weights};
use kvfabric_serving::engine::mock::{MockConfig, MockKv};
use kvfabric_serving::engine::SchedulerConfig;
use kvfabric_serving::http::{self, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use kvfabric_serving::worker::{EngineSpec, Role, WorkerConfig, WorkerStack};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineKind {
    /// A llama-architecture GGUF model on CPU (candle).
    Llama,
    /// A timing model with synthetic KV (no model file).
    Mock,
}

/// How much KV the mock materialises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MockKvArg {
    /// Each block's tokens and chained seed only (tiers and transfers still move, and
    /// checksum, every byte).
    Header,
    /// Every byte of every block, written and checked (tests of the data path).
    Full,
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
    #[arg(long, env = "KVFABRIC_HOST_BLOCKS", default_value_t = 512,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub host_blocks: u32,
    /// Disk tier capacity per worker, blocks (0: no disk tier). The file grows as blocks
    /// arrive.
    #[arg(long, env = "KVFABRIC_DISK_BLOCKS", default_value_t = 4096)]
    pub disk_blocks: u32,
    /// Reuses a block needs before an eviction writes it to the disk tier (0: every block;
    /// 1: blocks reused at least once, so that one-off prompts cost no disk write).
    #[arg(long, env = "KVFABRIC_DISK_ADMIT_MIN_HITS", default_value_t = 1)]
    pub disk_admit_min_hits: u32,
    /// Tokens per KV block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub block_tokens: u32,
    /// Context length cap, tokens.
    #[arg(long, env = "KVFABRIC_CONTEXT", default_value_t = 8192)]
    pub context: usize,
    /// Sequences batched together at most.
    #[arg(long, env = "KVFABRIC_MAX_BATCH", default_value_t = 8, value_parser = at_least_one)]
    pub max_batch: usize,
    /// Requests waiting at most; more are refused (429).
    #[arg(long, env = "KVFABRIC_MAX_WAITING", default_value_t = 128)]
    pub max_waiting: usize,
    /// Prompt tokens computed per step at most.
    #[arg(long, env = "KVFABRIC_STEP_TOKENS", default_value_t = 256, value_parser = at_least_one)]
    pub step_tokens: usize,
    /// Shared secret of the handshakes of the transfer engine and the workers' request ports
    /// (every process of a deployment agrees on it; `up`: random when none is given).
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
    /// Mock: mirror the model of this Hugging Face directory (its tokenizer.json, chat
    /// template and config.json's KV layout), as Dynamo's mocker does; without it, one token
    /// per byte over SmolLM2-135M's KV in f32.
    /// (`KVFABRIC_MODEL_DIR` is where scripts/fetch-model.sh caches the default model.)
    #[arg(long, env = "KVFABRIC_MOCK_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
    /// Mock: how much of each KV block is materialised.
    #[arg(long, env = "KVFABRIC_MOCK_KV", value_enum, default_value = "header")]
    pub mock_kv: MockKvArg,
    /// Mock: prefill cost per uncached prompt token, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_PREFILL_US", default_value_t = 40.0)]
    pub mock_prefill_us: f64,
    /// Mock: fixed cost of a decode step, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_DECODE_US", default_value_t = 8000.0)]
    pub mock_decode_us: f64,
    /// Mock: decode cost per token of active KV, microseconds.
    #[arg(long, env = "KVFABRIC_MOCK_DECODE_KV_US", default_value_t = 0.2)]
    pub mock_decode_kv_us: f64,
    /// Mock, fault injection: the engine panics in this step (tests of supervision).
    #[arg(long, hide = true)]
    pub mock_panic_at_step: Option<u64>,
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
    #[arg(long, env = "KVFABRIC_WORKERS", default_value_t = 1, value_parser = at_least_one)]
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
    #[command(flatten)]
    routing: super::RoutingArgs,
    #[command(flatten)]
    http: super::HttpArgs,
    /// Worker name in discovery (with several workers, the prefix of their names).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "worker")]
    name: String,
    #[command(flatten)]
    planner: super::planning::PlannerArgs,
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

/// The directory of the disk tier (`--data-dir`, or ~/.cache/kvfabric/data).
pub fn data_dir(opts: &EngineOpts) -> PathBuf {
    opts.data_dir.clone().unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| ".".into());
        home.join(".cache/kvfabric/data")
    })
}

/// The worker's configuration from the command line: the engine (the model file must exist),
/// the store under the data directory, the scheduler's settings.
pub fn worker_config(opts: &EngineOpts, name: &str) -> anyhow::Result<WorkerConfig> {
    let engine = match opts.engine {
        EngineKind::Llama => {
            let path = opts.model.clone().unwrap_or_else(default_model_path);
            anyhow::ensure!(
                path.is_file(),
                "model file {} not found (scripts/fetch-model.sh fetches the default model; --model takes any llama GGUF)",
                path.display()
            );
            let options = LlamaOptions {
                weights: match opts.weights {
                    WeightsArg::F32 => Weights::F32,
                    WeightsArg::Quantized => Weights::Quantized,
                },
                block_tokens: opts.block_tokens,
                max_context: opts.context,
                tokenizer_json: opts.tokenizer.clone(),
                name: opts.served_model_name.clone(),
            };
            EngineSpec::Llama { path, options }
        }
        EngineKind::Mock => EngineSpec::Mock {
            name: opts.served_model_name.clone().unwrap_or_else(|| "mock".into()),
            block_tokens: opts.block_tokens,
            model_dir: opts.model_dir.clone(),
            config: MockConfig {
                prefill_us_per_token: opts.mock_prefill_us,
                decode_step_us: opts.mock_decode_us,
                decode_us_per_kv_token: opts.mock_decode_kv_us,
                context_len: opts.context,
                kv: match opts.mock_kv {
                    MockKvArg::Header => MockKv::Header,
                    MockKvArg::Full => MockKv::Full,
                },
                panic_at_step: opts.mock_panic_at_step,
            },
        },
    };
    let data_dir = data_dir(opts);
    Ok(WorkerConfig {
        name: name.to_string(),
        engine,
        scheduler: SchedulerConfig {
            max_batch: opts.max_batch.max(1),
            max_waiting: opts.max_waiting,
            step_tokens: opts.step_tokens.max(1),
            ..SchedulerConfig::default()
        },
        secret: opts.secret.clone().map(String::into_bytes),
        host_blocks: opts.host_blocks,
        disk: (opts.disk_blocks > 0).then_some((data_dir, opts.disk_blocks)),
        disk_admit_min_hits: opts.disk_admit_min_hits,
        remote_tier: opts.remote_tier,
    })
}

/// Loads the engine (with a progress bar when `show_progress`), opens the store and starts
/// the publishers of `name`'s KV events, load and dumps on `bus`.
pub async fn start_stack(
    opts: &EngineOpts,
    name: &str,
    discovery: &Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
    show_progress: bool,
) -> anyhow::Result<WorkerStack> {
    let cfg = worker_config(opts, name)?;
    let bar = if show_progress {
        indicatif::ProgressBar::new(1)
    } else {
        indicatif::ProgressBar::hidden()
    };
    if let EngineSpec::Llama { path, .. } = &cfg.engine {
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "loading {msg} [{bar:40}] {pos}/{len} tensors {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(path.file_name().and_then(|s| s.to_str()).unwrap_or("model").to_string());
    }
    let b = bar.clone();
    let stack = WorkerStack::start(&cfg, discovery, bus, move |done, total| {
        b.set_length(total as u64);
        b.set_position(done as u64);
    })
    .await;
    bar.finish_and_clear();
    Ok(stack?)
}

/// Registers for SIGTERM and SIGINT at once, and resolves on the first of them. Call it
/// before the process says it is ready: a signal that arrives before the returned future is
/// polled is kept, instead of killing the process with its default action (no cleanup).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, Signal, SignalKind};
    let term = signal(SignalKind::terminate()).ok();
    let int = signal(SignalKind::interrupt()).ok();
    async fn recv(s: Option<Signal>) {
        match s {
            Some(mut s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
    async move {
        tokio::select! {
            _ = recv(term) => {}
            _ = recv(int) => {}
        }
    }
}

/// The routing frontend over the workers in `discovery`.
async fn routed_frontend(
    args: &UpArgs,
    engine: &EngineOpts,
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
) -> anyhow::Result<RoutedBackend> {
    let cfg = RoutedConfig {
        router: args.routing.config(),
        name: format!("{}-frontend", args.name),
        first_token_timeout: Duration::from_secs(args.http.first_token_timeout_s),
        stall_timeout: Duration::from_secs(args.http.stall_timeout_s),
        migrations_max: args.http.stream_migrations,
        ..RoutedConfig::new(engine.secret.clone().unwrap_or_default().into_bytes())
    };
    Ok(RoutedBackend::start(discovery.clone(), bus.clone(), cfg).await?)
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let mut server_cfg = ServerConfig {
        request_timeout: Duration::from_secs(args.http.request_timeout_s.max(1)),
        api_key: args.http.api_key.clone().filter(|k| !k.is_empty()),
        name: format!("up {}", args.name),
        ..ServerConfig::default()
    };
    let listen_stats = server_cfg.listen.clone();
    let disagg = args.prefill_workers > 0 || args.decode_workers > 0;
    anyhow::ensure!(
        args.planner.profile.is_none() || (!disagg && args.workers <= 1),
        "with --planner the planner runs the workers (of --planner-layout, from \
         --planner-min-workers): --workers, --prefill-workers and --decode-workers do not apply"
    );
    anyhow::ensure!(
        !disagg || (args.prefill_workers > 0 && args.decode_workers > 0),
        "disaggregated serving needs --prefill-workers and --decode-workers, both at least 1"
    );
    let mut engine = args.engine.clone();
    // In-process workers and frontend share a secret drawn here unless one is given.
    if engine.secret.is_none() {
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
    let mut worker_metrics: Vec<(String, Arc<dyn kvfabric_serving::metrics::Source>)> = Vec::new();
    let mut planner = None;
    let (backend, describe): (Arc<dyn Backend>, String) = if let Some(profile) =
        &args.planner.profile
    {
        let running = args
            .planner
            .start_in_process(
                profile,
                &args.name,
                engine.clone(),
                discovery.clone(),
                bus.clone(),
                server_cfg.metrics.clone(),
            )
            .await?;
        server_cfg.sources.push(running.state.clone());
        planner = Some(running);
        let remote = routed_frontend(&args, &engine, &discovery, &bus).await?;
        let describe = format!(
            "{} {}..={} planned workers, {:?} routing",
            match engine.engine {
                EngineKind::Llama => "the llama engine on",
                EngineKind::Mock => "the mock engine on",
            },
            args.planner.planner_min_workers,
            args.planner.planner_max_workers,
            args.routing.router
        );
        (Arc::new(remote), describe)
    } else if n == 1 && !args.via_frontend {
        let stack = start_stack(&engine, &args.name, &discovery, bus.clone(), true).await?;
        let backend = Arc::new(LocalBackend::new(stack.sched.clone(), stack.store.clone()));
        let describe = stack.describe.clone();
        stacks.push(stack);
        (backend, describe)
    } else {
        for (i, (name, role)) in roles.iter().enumerate() {
            let stack = start_stack(&engine, name, &discovery, bus.clone(), i == 0).await?;
            let served = stack
                .serve(
                    name,
                    *role,
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    &discovery,
                    &bus,
                    engine.max_batch,
                    engine.disagg(),
                    Duration::from_secs(10),
                )
                .await?;
            registrations.push(served.registration);
            servers.push(served.server);
            worker_metrics.push((name.clone(), Arc::new(served.metrics)));
            stacks.push(stack);
        }
        let remote = routed_frontend(&args, &engine, &discovery, &bus).await?;
        let describe = if disagg {
            format!(
                "{} on {} prefill + {} decode workers, {:?} routing",
                stacks[0].describe, args.prefill_workers, args.decode_workers, args.routing.router
            )
        } else {
            format!("{} on {n} workers, {:?} routing", stacks[0].describe, args.routing.router)
        };
        (Arc::new(remote), describe)
    };
    let id = backend.models().first().map(|m| m.id.clone()).unwrap_or_default();
    // One /metrics for the whole process: the frontend's, and each worker's labelled.
    let app = http::router_with(backend, server_cfg, worker_metrics);
    let listener = http::listen::bind(SocketAddr::new(args.host, args.port))
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    tracing::info!("control plane: embedded discovery and event bus (this process only)");
    tracing::info!(%addr, "listening: kvfabric is serving {describe}");
    super::say!("kvfabric is serving {describe} at http://{addr}/v1");
    super::say!(
        "try:\n  curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 64}}'"
    );
    // A dead engine takes the process down (non-zero, for a supervisor to restart it): its
    // frontend would otherwise keep answering with nothing behind it.
    let scheds: Vec<_> = stacks.iter().map(|s| s.sched.clone()).collect();
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    let watchdog = tokio::spawn(async move {
        if scheds.is_empty() {
            // The planner's workers: it replaces one whose engine died. Holding the sender
            // keeps the server up.
            let _keep = failed_tx;
            return std::future::pending().await;
        }
        let waits = scheds.iter().map(|s| Box::pin(s.failed()));
        let (reason, _, _) = futures_util::future::select_all(waits).await;
        let _ = failed_tx.send(reason);
    });
    let failure = Arc::new(parking_lot::Mutex::new(None));
    let failure_slot = failure.clone();
    let stop = async move {
        tokio::select! {
            _ = stop_signal => {}
            reason = failed_rx => {
                if let Ok(r) = reason {
                    tracing::error!(reason = %r, "engine failed: stopping");
                    *failure_slot.lock() = Some(r);
                }
            }
        }
    };
    let served = http::listen::serve(listener, app, args.http.limits(), listen_stats, stop).await;
    watchdog.abort();
    if let Some(p) = planner {
        p.stop().await;
    }
    served?;
    for r in registrations {
        r.revoke().await;
    }
    for s in servers {
        s.abort();
    }
    for s in stacks {
        s.shutdown().await;
    }
    if let Some(reason) = failure.lock().take() {
        anyhow::bail!("out of service: {reason}");
    }
    tracing::info!("kvfabric stopped");
    Ok(())
}
