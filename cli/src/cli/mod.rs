//! Command-line definitions and dispatch. Options come from flags, then `KVFABRIC_*`
//! environment variables.

use anyhow::Context;
use clap::{Parser, Subcommand};

/// Prints a line on stdout for whoever started the process; a closed or broken stdout (the
/// reader went away) is not a reason for a server to die.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
pub(crate) use say;

mod attach;
mod bench;
mod control;
mod fabric;
mod frontend;
mod hash;
mod model_dir;
pub mod peer;
mod plan;
mod planning;

mod profile;
mod route;
mod scaler;
mod soak;
mod stack;
pub mod tls;
mod up;
mod worker;

/// kvfabric — a KV-cache data plane for LLM inference.
#[derive(Debug, Parser)]
#[command(name = "kvfabric", version, about, propagate_version = true)]
pub struct Cli {
    /// A TOML file of options (`host_blocks = 4096`, `etcd = ["http://10.0.0.1:2379"]`,
    /// ...), keyed like the `KVFABRIC_*` variables without the prefix. Flags win over
    /// environment variables, which win over the file.
    #[arg(long, global = true, env = "KVFABRIC_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// What to log to stderr: a level (`error`, `warn`, `info`, `debug`, `trace`) or
    /// per-module directives (`info,kvfabric_tiers=debug`). Without it, `RUST_LOG` decides,
    /// and `info` without that.
    #[arg(long, global = true, env = "KVFABRIC_LOG_LEVEL")]
    log_level: Option<String>,
    /// How log lines look: `text` for people, `json` (one object a line) for log collectors.
    #[arg(long, global = true, env = "KVFABRIC_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model in one process: OpenAI-compatible API, engine, tiered KV store,
    /// embedded control plane.
    Up(up::UpArgs),
    /// A worker process: an engine and its block store, registered in discovery (etcd, or
    /// embedded), publishing KV events and load (NATS, or embedded), serving frontends.
    Worker(worker::WorkerArgs),
    /// The OpenAI-compatible frontend in front of the workers in discovery, with KV routing.
    Frontend(frontend::FrontendArgs),
    /// A sidecar beside an engine kvfabric did not start (vLLM, SGLang): registers it as a
    /// worker reached over its OpenAI API, relays its own KV events (ZeroMQ) to the routers,
    /// reports its load.
    Attach(attach::AttachArgs),
    /// The KV-aware routing decision as a service (`POST /v1/route`) for gateways that send
    /// requests themselves, fed by discovery and the KV events like a frontend.
    Router(route::RouterArgs),
    /// Capacity planning: KV bytes per token and per sequence, tier sizes, transfer times;
    /// with --sla, workers for a workload and latency targets from a measured profile.
    Plan(plan::PlanArgs),
    /// Measures an engine (in this process, or a server by URL) for planning: prefill and
    /// decode curves, KV restore per tier; writes a profile (JSON) and a plot (SVG).
    Profile(profile::ProfileArgs),
    /// Block and sequence hashes of a token sequence (Dynamo-compatible XXH3).
    Hash(hash::HashArgs),
    /// Writes a model directory (tokenizer, chat template, config.json with a KV shape of
    /// your choice) for `up --engine mock --model-dir`.
    ModelDir(model_dir::ModelDirArgs),
    /// Benchmarks (transfer, tier, router, fabric, engine, serve) with percentiles and ratios
    /// to this machine's limits measured in the same run.
    Bench(bench::BenchArgs),
    /// A standalone KV fabric node: a tiered block store behind the transfer engine,
    /// registered in discovery (etcd, or embedded), publishing KV events (NATS, or embedded).
    Fabric(fabric::FabricArgs),
    /// A transfer peer in its own process (for benchmarks and tests): prints its metadata,
    /// serves transfers, answers `sum OFFSET LEN` on stdin.
    Peer(peer::PeerArgs),
    /// Stores blocks into a disk tier forever (crash tests kill it with -9).
    #[command(hide = true)]
    TierSoak(soak::SoakArgs),
}

/// The format of log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line.
    Json,
}

/// Installs the process's log subscriber: every `tracing` event of the libraries, filtered by
/// `--log-level` (or `RUST_LOG`, or `info`), to stderr. The NATS client library's events are
/// kept at `info` and above whatever the level: at `trace` it writes its connect options,
/// credentials included.
fn init_logging(level: Option<&str>, format: LogFormat) -> anyhow::Result<()> {
    use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt};
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = match level {
        Some(l) => EnvFilter::try_new(l).with_context(|| format!("--log-level {l:?}"))?,
        None => match std::env::var("RUST_LOG") {
            Ok(v) if !v.trim().is_empty() => {
                EnvFilter::try_new(&v).with_context(|| format!("RUST_LOG={v:?}"))?
            }
            _ => EnvFilter::new("info"),
        },
    };
    let no_secrets =
        filter_fn(|m| !(m.target().starts_with("async_nats") && *m.level() > tracing::Level::INFO));
    let filter = filter.and(no_secrets);
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let layer = match format {
        LogFormat::Text => {
            use std::io::IsTerminal;
            layer.with_ansi(std::io::stderr().is_terminal()).with_filter(filter).boxed()
        }
        LogFormat::Json => layer.json().with_current_span(false).with_filter(filter).boxed(),
    };
    tracing_subscriber::registry()
        .with(layer)
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    init_logging(cli.log_level.as_deref(), cli.log_format)?;
    tls::warn_secrets_on_command_line();
    // A panic on any thread is logged once with its cause and place, in the log's format,
    // before the default report.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let cause = kvfabric_serving::engine::panic_message(info.payload());
        let at = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
        let thread = std::thread::current().name().unwrap_or("unnamed").to_string();
        tracing::error!(%cause, %at, %thread, "panic");
        default_hook(info);
    }));
    match cli.command {
        Command::Up(args) => runtime()?.block_on(up::run(args)),
        Command::Worker(args) => runtime()?.block_on(worker::run(args)),
        Command::Frontend(args) => runtime()?.block_on(frontend::run(args)),
        Command::Attach(args) => runtime()?.block_on(attach::run(args)),
        Command::Router(args) => runtime()?.block_on(route::run(args)),
        Command::Plan(args) => plan::run(args),
        Command::Profile(args) => runtime()?.block_on(profile::run(args)),
        Command::Hash(args) => hash::run(args),
        Command::ModelDir(args) => model_dir::run(args),
        Command::Bench(args) => runtime()?.block_on(bench::run(args)),
        Command::Peer(args) => runtime()?.block_on(peer::run(args)),
        Command::Fabric(args) => runtime()?.block_on(fabric::run(args)),
        Command::TierSoak(args) => runtime()?.block_on(soak::run(args)),
    }
}

/// Applies the TOML config file named by `--config` (or `KVFABRIC_CONFIG`) as the lowest
/// layer: each key `k` of the file (top level, or in a table named after the command) sets
/// `KVFABRIC_K` unless the environment already has it; flags still win over both. Unknown
/// keys are an error, so that a typo is never silently ignored. Must run before parsing, on
/// the main thread, before any other thread exists.
pub fn apply_config_file() -> anyhow::Result<()> {
    use clap::CommandFactory;
    let args: Vec<String> = std::env::args().collect();
    let from_flag = args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix("--config=")
            .map(str::to_string)
            .or_else(|| (a == "--config").then(|| args.get(i + 1).cloned()).flatten())
    });
    let Some(path) = from_flag.or_else(|| std::env::var("KVFABRIC_CONFIG").ok()) else {
        return Ok(());
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading config file {path}"))?;
    let table: toml::Table = text.parse().with_context(|| format!("config file {path}"))?;
    let command = Cli::command();
    let sub = args.get(1).and_then(|name| command.find_subcommand(name));
    let known: Vec<String> = sub
        .into_iter()
        .flat_map(|c| c.get_arguments())
        .chain(command.get_arguments())
        .filter_map(|a| a.get_env().and_then(|e| e.to_str()).map(str::to_string))
        .collect();
    let mut entries: Vec<(String, toml::Value)> = Vec::new();
    for (k, v) in table {
        match (v, sub) {
            (toml::Value::Table(t), Some(c)) if c.get_name() == k => entries.extend(t),
            (toml::Value::Table(_), _) => {}
            (v, _) => entries.push((k, v)),
        }
    }
    for (k, v) in entries {
        let env = format!("KVFABRIC_{}", k.to_ascii_uppercase().replace('-', "_"));
        anyhow::ensure!(
            known.contains(&env),
            "config file {path}: unknown key {k:?} for this command"
        );
        if std::env::var_os(&env).is_some() {
            continue;
        }
        let value = match &v {
            toml::Value::Array(items) => {
                items.iter().map(scalar).collect::<anyhow::Result<Vec<_>>>()?.join(",")
            }
            other => scalar(other)?,
        };
        // Single-threaded here (before the runtime starts): nothing reads the environment
        // concurrently.
        std::env::set_var(&env, value);
    }
    Ok(())
}

fn scalar(v: &toml::Value) -> anyhow::Result<String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Datetime(d) => d.to_string(),
        toml::Value::Array(_) | toml::Value::Table(_) => {
            anyhow::bail!("config values must be scalars or lists of scalars")
        }
    })
}

/// The tokio runtime of commands that do I/O.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    raise_descriptor_limit();
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// Raises the soft limit of open files to the hard one (as Go's runtime does): servers hold a
/// descriptor per connection, and the ports size their connection budget from this limit,
/// keeping a reserve for the control plane (`kvfabric::session::admission`). An operator's
/// hard limit (`ulimit -Hn`, `prlimit`) still bounds it.
fn raise_descriptor_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write one rlimit struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
                tracing::debug!(soft = lim.rlim_cur, "could not raise the open-files limit");
            }
        }
    }
}

/// An error chain on one line.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string().replace('\n', " ");
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}

/// How a routing frontend picks workers (`up`, `frontend`, `router`).
#[derive(clap::Args, Debug, Clone)]
pub struct RoutingArgs {
    /// Routing with several workers: kv, round-robin, random, least-loaded.
    #[arg(long, env = "KVFABRIC_ROUTER", default_value = "kv", value_parser = parse_mode)]
    pub router: kvfabric_router::RoutingMode,
    /// Softmax temperature of kv routing (0: always the cheapest worker).
    #[arg(long, env = "KVFABRIC_ROUTER_TEMPERATURE", default_value_t = 0.0,
        value_parser = finite_non_negative)]
    pub router_temperature: f64,
    /// Weight of kv routing's prefill term (blocks the worker would have to compute) against
    /// its load terms.
    #[arg(long, env = "KVFABRIC_ROUTER_OVERLAP_WEIGHT",
        default_value_t = kvfabric_router::RouterConfig::default().overlap_weight,
        value_parser = finite_non_negative)]
    pub router_overlap_weight: f64,
    /// Active decode blocks on a worker that kv routing counts as one block of prefill
    /// (larger: cache locality wins over spreading the decode load).
    #[arg(long, env = "KVFABRIC_ROUTER_LOAD_SCALE",
        default_value_t = kvfabric_router::RouterConfig::default().block_load_scale,
        value_parser = finite_positive)]
    pub router_load_scale: f64,
    /// Kv routing prices pulling a prefix from another worker's store against computing it,
    /// and tells the chosen worker where to pull from (one KV pool across workers).
    #[arg(long, env = "KVFABRIC_ROUTER_PULLS", default_value_t = true, action = clap::ArgAction::Set)]
    pub router_pulls: bool,
    /// The link rate pulls are priced at until workers have measured their own (a name of
    /// the planner's link table: `1g`, `10g`, `25g`, `100g`…, or NAME=GB/s).
    #[arg(long, env = "KVFABRIC_ROUTER_PULL_LINK", default_value = "10g", value_parser = link_bytes_per_s)]
    pub router_pull_link: f64,
    /// The fixed cost of a pull, milliseconds (round trips, the holder pinning its blocks).
    #[arg(long, env = "KVFABRIC_ROUTER_PULL_OVERHEAD_MS", default_value_t = 2.0,
        value_parser = finite_non_negative)]
    pub router_pull_overhead_ms: f64,
    /// Prompt tokens a worker computes per second, until it reports its measured rate.
    #[arg(long, env = "KVFABRIC_ROUTER_PREFILL_TOKENS_PER_S", default_value_t = 25_000.0,
        value_parser = finite_positive)]
    pub router_prefill_tokens_per_s: f64,
}

impl RoutingArgs {
    /// The router's settings from these arguments (the rest default).
    pub fn config(&self) -> kvfabric_router::RouterConfig {
        kvfabric_router::RouterConfig {
            mode: self.router,
            temperature: self.router_temperature,
            overlap_weight: self.router_overlap_weight,
            block_load_scale: self.router_load_scale,
            pull: self.router_pulls.then_some(kvfabric_router::PullPricing {
                // Each model's own, set when its first worker joins.
                block_bytes: 0,
                link_bytes_per_s: self.router_pull_link,
                overhead_s: self.router_pull_overhead_ms / 1e3,
                prefill_tokens_per_s: self.router_prefill_tokens_per_s,
            }),
            ..Default::default()
        }
    }
}

fn link_bytes_per_s(s: &str) -> Result<f64, String> {
    kvfabric_planner::plan::Link::parse(s).map(|l| l.gbps * 1e9).map_err(|e| e.to_string())
}

fn finite_non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite number >= 0")),
    }
}

fn finite_positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite number > 0")),
    }
}

/// The HTTP frontend's bounds (`up`, `frontend`): its listener and its requests' deadlines.
/// A routing mode by name.
pub fn parse_mode(s: &str) -> Result<kvfabric_router::RoutingMode, String> {
    s.parse()
}

/// A count that must be at least 1 (0 would serve nothing, or nothing at once).
pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// An API key: never empty (an empty key would leave the API open while seeming to guard
/// it; leave the option out to run without one).
fn api_key(s: &str) -> Result<kvfabric::secret::Secret, String> {
    if s.trim().is_empty() {
        return Err("an empty API key would leave the API open; leave --api-key (and \
                    KVFABRIC_API_KEY) out to run without one"
            .into());
    }
    Ok(s.into())
}

#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    /// Request deadline, seconds.
    #[arg(long, env = "KVFABRIC_REQUEST_TIMEOUT_S", default_value_t = 300,
        value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub request_timeout_s: u64,
    /// A worker that sends no first token within this many seconds is skipped: the request
    /// is retried on another worker and the slow one avoided for a while.
    #[arg(long, env = "KVFABRIC_FIRST_TOKEN_TIMEOUT_S", default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub first_token_timeout_s: u64,
    /// A stream whose worker sends nothing for this many seconds after its first token has
    /// stalled (a frozen or dead worker): it moves to another worker, which continues from the
    /// prompt and the tokens already sent (at most --stream-migrations times), or ends with an
    /// error.
    #[arg(long, env = "KVFABRIC_STALL_TIMEOUT_S", default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub stall_timeout_s: u64,
    /// A request for a model whose every worker left within this many seconds (a restart of
    /// a one-worker pool) waits, within its deadline, for one to join instead of getting
    /// 503 (0: 503 at once; at most 60).
    #[arg(long, env = "KVFABRIC_RESTART_WAIT_S", default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(0..=60))]
    pub restart_wait_s: u64,
    /// Times a stream that stalls or breaks mid-way may move to another worker (0: never).
    #[arg(long, env = "KVFABRIC_STREAM_MIGRATIONS", default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(0..=16))]
    pub stream_migrations: u32,
    /// The frontend's own queue: requests each worker may have in flight from this frontend;
    /// more wait at the frontend, ordered by deadline (--frontend-queue-policy), and go to
    /// the workers as theirs finish. 0: no queue (every request is sent at once and the
    /// engines queue). Set it where the engines do not order by class (attached engines).
    #[arg(long, env = "KVFABRIC_FRONTEND_QUEUE_DEPTH", default_value_t = 0,
        value_parser = clap::value_parser!(u32).range(0..=65_536))]
    pub frontend_queue_depth: u32,
    /// Requests of one class that may wait in the frontend's queue; more are refused with 429
    /// and `Retry-After`.
    #[arg(long, env = "KVFABRIC_FRONTEND_QUEUE_BOUND", default_value_t = 256,
        value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub frontend_queue_bound: u32,
    /// How the frontend's queue orders waiting requests: `edf` (arrival plus the class's TTFT
    /// target) or `fcfs`.
    #[arg(long, env = "KVFABRIC_FRONTEND_QUEUE_POLICY", value_enum, default_value = "edf")]
    pub frontend_queue_policy: stack::QueuePolicyArg,
    /// Require `Authorization: Bearer <key>` on every `/v1/` request (`/health` and
    /// `/metrics` stay open). Without it the API is open: bind it to loopback, or put it
    /// behind a proxy that authenticates.
    /// (Or from a file: KVFABRIC_API_KEY_FILE.)
    #[arg(long, env = "KVFABRIC_API_KEY", hide_env_values = true, value_parser = api_key)]
    pub api_key: Option<kvfabric::secret::Secret>,
    /// HTTP connections served at once; past it a small reserve answers one request each
    /// (so `/health` keeps answering), then connections are refused.
    #[arg(long, env = "KVFABRIC_MAX_CONNECTIONS", default_value_t = 1024,
        value_parser = at_least_one)]
    max_connections: usize,
    /// Seconds for a request head to arrive; an idle keep-alive connection is closed after it.
    #[arg(long, env = "KVFABRIC_HEADER_TIMEOUT_S", default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..=300))]
    header_timeout_s: u64,
    /// A service class: `NAME:ttft=300ms,itl=50ms[,expire=60s][,share=25%][,default]`
    /// (repeat for more). Requests name theirs with `x-kvfabric-class` or `kvfabric.class`
    /// (or OpenAI's `service_tier`, vLLM's `priority`, Dynamo's priority); waiting work is
    /// served earliest deadline first and a less urgent class yields to a more urgent one.
    #[arg(long = "class", env = "KVFABRIC_CLASSES", value_delimiter = ';')]
    pub classes: Vec<String>,
    /// A file of service classes, one per line in --class's syntax (`#` comments).
    #[arg(long, env = "KVFABRIC_CLASSES_FILE")]
    pub classes_file: Option<std::path::PathBuf>,
    /// Tenants (JSON: `{"tenants": [{"name", "key", "classes": [...], "cache_namespace"}]}`):
    /// each key is accepted as --api-key is, pins the classes the tenant may use (the first
    /// is its default) and gives it a cache namespace of its own (tenants that name the same
    /// `cache_namespace` share cached prompts).
    #[arg(long, env = "KVFABRIC_TENANTS")]
    pub tenants: Option<std::path::PathBuf>,
}

impl HttpArgs {
    /// The frontend's queue of these flags.
    pub fn pending(&self) -> kvfabric_serving::routed::PendingConfig {
        kvfabric_serving::routed::PendingConfig {
            per_worker: self.frontend_queue_depth as usize,
            bound: self.frontend_queue_bound as usize,
            policy: self.frontend_queue_policy.policy(),
        }
    }

    /// The service classes and tenants of these flags.
    pub fn classes(
        &self,
    ) -> anyhow::Result<(kvfabric_serving::classes::Classes, kvfabric_serving::classes::Tenants)>
    {
        use kvfabric_serving::classes::{Classes, Tenants};
        let classes = Classes::from_specs_and_file(&self.classes, self.classes_file.as_deref())?;
        let tenants = match &self.tenants {
            Some(path) => Tenants::from_file(path, &classes).map_err(anyhow::Error::msg)?,
            None => Tenants::default(),
        };
        Ok((classes, tenants))
    }

    fn limits(&self) -> kvfabric_serving::http::listen::HttpLimits {
        kvfabric_serving::http::listen::HttpLimits {
            connections_max: self.max_connections.max(1),
            header_read_timeout: std::time::Duration::from_secs(self.header_timeout_s),
            ..Default::default()
        }
    }
}
