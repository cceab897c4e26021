//! What `up`, `worker`, `profile` and the planner's scaler share: the engine options
//! ([`EngineOpts`]), the worker configuration they make, [`start_stack`] (a worker's engine,
//! store and publishers), and the shutdown signal. The worker itself is
//! `kvfabric_serving::worker::WorkerStack`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use kvfabric::agent::AgentConfig;
use kvfabric::control::advertise::Advertise;
use kvfabric::control::{Discovery, EventBus};
use kvfabric::transfer::TransportKind;
use kvfabric::transport::rdma::RdmaConfig;
use kvfabric_serving::disagg::DisaggConfig;
use kvfabric_serving::engine::llama::{LlamaOptions, Weights};
use kvfabric_serving::engine::mock::{MockConfig, MockKv};
use kvfabric_serving::engine::SchedulerConfig;
use kvfabric_serving::worker::{EngineSpec, PeerConfig, WorkerConfig, WorkerStack};

use super::at_least_one;

/// A drained worker has had nothing in flight for this long (longer than routers take to see
/// it leave discovery).
pub(super) const DRAIN_QUIET: Duration = Duration::from_millis(1000);

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
    /// Weights of the llama engine: `f32` (dequantized at load: exact, reproducible greedy
    /// output) or `quantized` (as the GGUF stores them: faster, approximate).
    #[arg(long, env = "KVFABRIC_WEIGHTS", default_value = "f32")]
    pub weights: Weights,
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
    /// How waiting requests are ordered: `edf` (earliest deadline first, by their service
    /// class's TTFT target; a more urgent class displaces and preempts a less urgent one) or
    /// `fcfs` (first come first served, whatever the class).
    #[arg(long, env = "KVFABRIC_QUEUE_POLICY", value_enum, default_value = "edf")]
    pub queue_policy: QueuePolicyArg,
    /// Shared secret of the handshakes of the transfer engine and the workers' request ports
    /// (every process of a deployment agrees on it; `up`: random when none is given).
    /// (Or from a file: KVFABRIC_SECRET_FILE.)
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    pub secret: Option<kvfabric::secret::Secret>,
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
    /// One KV pool across workers: pull prefix blocks from another worker's store where a
    /// router says that beats computing them, and serve this worker's to its peers (needs a
    /// shared secret).
    #[arg(long, env = "KVFABRIC_PEER_PULLS", default_value_t = true, action = clap::ArgAction::Set)]
    pub peer_pulls: bool,
    /// The share (0..1) of this worker's host tier that peers' pulls may pin at once, and of
    /// its link (`--peer-link`) they may take.
    #[arg(long, env = "KVFABRIC_PEER_SHARE", default_value_t = 0.25)]
    pub peer_share: f64,
    /// This worker's link, that `--peer-share` paces the pulls it serves to (a name of the
    /// planner's link table, `1g`, `10g`, `25g`, `100g`…, or NAME=GB/s; none: unpaced).
    #[arg(long, env = "KVFABRIC_PEER_LINK")]
    pub peer_link: Option<String>,
    /// With the fabric as the lowest tier (no disk): an allocation that must evict waits on
    /// writing its victim to the fabric only while those writes measure at least this many
    /// megabits per second; below it the victim is dropped (evictions still go to the fabric
    /// in the background, at the link's pace). 0: always wait.
    #[arg(long, env = "KVFABRIC_FABRIC_WRITE_MIN_MBPS", default_value_t = 800.0)]
    pub fabric_write_min_mbps: f64,
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

/// `--queue-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueuePolicyArg {
    /// Earliest deadline first.
    Edf,
    /// First come first served.
    Fcfs,
}

impl QueuePolicyArg {
    /// The policy.
    pub fn policy(self) -> kvfabric_serving::engine::QueuePolicy {
        match self {
            QueuePolicyArg::Edf => kvfabric_serving::engine::QueuePolicy::Edf,
            QueuePolicyArg::Fcfs => kvfabric_serving::engine::QueuePolicy::Fcfs,
        }
    }
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
            queue_max: self.max_prefill_queue,
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
/// Where a worker's transfer agent listens, and the address it registers for peers.
#[derive(Debug, Clone)]
pub struct TransferAt {
    /// The TCP listen address.
    pub listen: SocketAddr,
    /// What peers dial (None: the address bound).
    pub advertise: Option<Advertise>,
    /// Mutual TLS with peers, on the agent and the request port (None: plaintext).
    pub tls: Option<Arc<kvfabric::tls::Tls>>,
}

impl TransferAt {
    /// Loopback, any port: for processes whose peers are on this host only.
    pub const LOOPBACK: TransferAt = TransferAt {
        listen: SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0),
        advertise: None,
        tls: None,
    };
}

pub fn worker_config(
    opts: &EngineOpts,
    name: &str,
    transfer: TransferAt,
) -> anyhow::Result<WorkerConfig> {
    let engine = match opts.engine {
        EngineKind::Llama => {
            let path = opts.model.clone().unwrap_or_else(default_model_path);
            anyhow::ensure!(
                path.is_file(),
                "model file {} not found (scripts/fetch-model.sh fetches the default model; --model takes any llama GGUF)",
                path.display()
            );
            let options = LlamaOptions {
                weights: opts.weights,
                block_tokens: opts.block_tokens,
                context_max: opts.context,
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
            batch_max: opts.max_batch.max(1),
            waiting_max: opts.max_waiting,
            step_tokens: opts.step_tokens.max(1),
            policy: opts.queue_policy.policy(),
            ..SchedulerConfig::default()
        },
        secret: opts.secret.clone(),
        tls: transfer.tls.clone(),
        host_blocks: opts.host_blocks,
        disk: (opts.disk_blocks > 0).then_some((data_dir, opts.disk_blocks)),
        disk_admit_min_hits: opts.disk_admit_min_hits,
        remote_tier: opts.remote_tier,
        rdma: rdma(),
        transfer_listen: transfer.listen,
        transfer_advertise: transfer.advertise,
        remote_write_min_bytes_per_s: opts.fabric_write_min_mbps.max(0.0) * 1e6 / 8.0,
        peers: match opts.peer_pulls {
            false => None,
            true => Some(PeerConfig {
                share: opts.peer_share,
                link_bytes_per_s: match &opts.peer_link {
                    Some(l) => Some(kvfabric_planner::plan::Link::parse(l)?.gbps * 1e9),
                    None => None,
                },
                ..PeerConfig::default()
            }),
        },
    })
}

/// The RDMA settings operators give every agent of the process in the environment
/// (`KVFABRIC_RDMA` = `auto`, `off` or a device; `KVFABRIC_RDMA_GID_INDEX`,
/// `KVFABRIC_RDMA_TRAFFIC_CLASS`, `KVFABRIC_RDMA_SERVICE_LEVEL`): the binary reads them, the
/// library never does.
pub fn rdma() -> Option<RdmaConfig> {
    RdmaConfig::from_settings(|key| std::env::var(key).ok())
}

/// An agent's settings for `name`, with the process's RDMA settings.
pub fn agent_config(
    name: impl Into<String>,
    secret: impl Into<kvfabric::secret::Secret>,
) -> AgentConfig {
    let mut cfg = AgentConfig::new(name, secret);
    cfg.rdma = rdma();
    cfg
}

/// Loads the engine (with a progress bar when `show_progress`), opens the store and starts
/// the publishers of `name`'s KV events, load and dumps on `bus`.
pub async fn start_stack(
    opts: &EngineOpts,
    name: &str,
    discovery: &Arc<dyn Discovery>,
    bus: Arc<dyn EventBus>,
    transfer: TransferAt,
    show_progress: bool,
) -> anyhow::Result<WorkerStack> {
    let cfg = worker_config(opts, name, transfer)?;
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

/// Serves `/metrics` (`own`'s counters, the control plane's state, TLS's) and `/health` (the
/// health document: `identity`, then the parts of `own`, the control plane and TLS; `degraded`
/// while etcd or NATS does not answer) on `at`, with the bounds of every kvfabric HTTP
/// listener. Its address and task.
pub(super) async fn metrics_port(
    at: std::net::SocketAddr,
    tls: Option<Arc<kvfabric::tls::Tls>>,
    own: Option<Arc<dyn kvfabric_serving::metrics::Source>>,
    discovery: &Arc<dyn Discovery>,
    bus: &Arc<dyn EventBus>,
    identity: kvfabric::health::Health,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    use kvfabric_serving::metrics::{Components, ControlSource, ListenStats, Source, CONTENT_TYPE};
    let mut sources: Vec<Arc<dyn Source>> = own.into_iter().collect();
    sources.push(Arc::new(ControlSource::new(discovery.clone(), bus.clone())));
    if let Some(t) = &tls {
        sources.push(Arc::new(kvfabric_serving::metrics::tls::TlsSource(t.clone())));
    }
    let components = sources.iter().fold(Components::new(), |c, s| c.with(None, s.clone()));
    let listener = kvfabric_serving::http::listen::bind(at)
        .map_err(|e| anyhow::anyhow!("--metrics-listen {at}: {e}"))?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let text = components.render();
                async move { ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)], text) }
            }),
        )
        .route(
            "/health",
            axum::routing::get(move || {
                let h = kvfabric_serving::metrics::health(identity.clone(), &sources);
                async move { kvfabric_serving::http::health_response(h) }
            }),
        );
    let task = tokio::spawn(async move {
        let limits = kvfabric_serving::http::listen::HttpLimits::default();
        let forever = std::future::pending::<()>();
        let _ = kvfabric_serving::http::listen::serve(
            listener,
            app,
            limits,
            ListenStats::default(),
            tls,
            forever,
        )
        .await;
    });
    Ok((addr, task))
}
