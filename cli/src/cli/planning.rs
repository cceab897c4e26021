//! `--planner` of `kvfabric frontend`: the live planner over local `kvfabric worker`
//! processes (`super::scaler`), its settings, and its decision log.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvfabric_planner::live::{self, PlannerConfig, PlannerState, Pool, Predictor, Scaler};
use kvfabric_planner::sla::Targets;
use kvfabric_serving::metrics::HttpMetrics;
use kvfabric_serving::profile::EngineProfile;
use kvfabric_serving::worker::Role;

use super::scaler::{InProcess, Kind, Processes, WorkerTemplate, Workers};

/// The layout of the workers the planner runs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannerLayout {
    /// One pool of aggregated workers.
    Aggregated,
    /// A pool of prefill workers and one of decode workers.
    Disaggregated,
}

impl PlannerLayout {
    /// Its pools, in the order they start (prefill before the decode workers that use it).
    fn pools(self) -> &'static [Pool] {
        match self {
            PlannerLayout::Aggregated => &[Pool::Aggregated],
            PlannerLayout::Disaggregated => &[Pool::Prefill, Pool::Decode],
        }
    }
}

/// The role of a pool's workers.
fn role_of(pool: Pool) -> Role {
    match pool {
        Pool::Aggregated => Role::Aggregated,
        Pool::Prefill => Role::Prefill,
        Pool::Decode => Role::Decode,
    }
}

/// The planner's options.
#[derive(clap::Args, Debug, Clone)]
pub struct PlannerArgs {
    /// Scale local `kvfabric worker` processes with the planner, planning from this engine
    /// profile (`kvfabric profile --out`).
    #[arg(long = "planner", env = "KVFABRIC_PLANNER", value_name = "PROFILE")]
    pub profile: Option<PathBuf>,
    /// The workers it runs: aggregated (one pool), or disaggregated (prefill workers and
    /// decode workers, each pool scaled on its own: prefill for TTFT, decode for ITL).
    #[arg(long, env = "KVFABRIC_PLANNER_LAYOUT", value_enum, default_value = "aggregated")]
    pub planner_layout: PlannerLayout,
    /// Fewest workers (of each pool).
    #[arg(long, env = "KVFABRIC_PLANNER_MIN_WORKERS", default_value_t = 1)]
    pub planner_min_workers: u32,
    /// Most workers (of each pool).
    #[arg(long, env = "KVFABRIC_PLANNER_MAX_WORKERS", default_value_t = 4)]
    pub planner_max_workers: u32,
    /// Seconds between decisions.
    #[arg(long, env = "KVFABRIC_PLANNER_INTERVAL_S", default_value_t = 10.0)]
    pub planner_interval_s: f64,
    /// Time-to-first-token target, ms.
    #[arg(long, env = "KVFABRIC_PLANNER_TTFT_MS", default_value_t = 500.0)]
    pub planner_ttft_ms: f64,
    /// Inter-token latency target, ms.
    #[arg(long, env = "KVFABRIC_PLANNER_ITL_MS", default_value_t = 50.0)]
    pub planner_itl_ms: f64,
    /// What the targets bound: mean, or a percentile (p50, p90, p99).
    #[arg(long, env = "KVFABRIC_PLANNER_PERCENTILE", default_value = "p99")]
    pub planner_percentile: String,
    /// How the next interval's rate is predicted: constant, ewma[:ALPHA], trend[:ALPHA:BETA].
    #[arg(long, env = "KVFABRIC_PLANNER_PREDICTOR", default_value = "constant",
        value_parser = Predictor::parse)]
    pub planner_predictor: Predictor,
    /// Intervals in a row the plan must ask for fewer workers before one drains.
    #[arg(long, env = "KVFABRIC_PLANNER_SCALE_DOWN_AFTER", default_value_t = 2)]
    pub planner_scale_down_after: u32,
    /// A scale-down plans for this share more than the predicted rate (0.25: 25%).
    #[arg(long, env = "KVFABRIC_PLANNER_SCALE_DOWN_HEADROOM", default_value_t = 0.25)]
    pub planner_scale_down_headroom: f64,
    /// Arguments of the workers it starts (`kvfabric worker ARGS`), split at whitespace: the
    /// engine and its options. The secret and the control plane are the frontend's.
    #[arg(
        long,
        env = "KVFABRIC_PLANNER_WORKER_ARGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub planner_worker_args: String,
    /// Seconds a worker may take to start.
    #[arg(long, env = "KVFABRIC_PLANNER_START_TIMEOUT_S", default_value_t = 120)]
    pub planner_start_timeout_s: u64,
    /// Seconds a draining worker may take to finish its requests.
    #[arg(long, env = "KVFABRIC_PLANNER_DRAIN_TIMEOUT_S", default_value_t = 60)]
    pub planner_drain_timeout_s: u64,
    /// Append each decision as a JSON line to this file.
    #[arg(long, env = "KVFABRIC_PLANNER_LOG")]
    pub planner_log: Option<PathBuf>,
}

/// A running planner and its workers.
pub struct Running {
    /// What `/metrics` shows of it.
    pub state: Arc<PlannerState>,
    task: tokio::task::JoinHandle<()>,
    /// Drains every worker (not started until awaited).
    shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

impl Running {
    /// Stops deciding, then drains every worker.
    pub async fn stop(self) {
        self.task.abort();
        self.shutdown.await;
    }
}

impl PlannerArgs {
    /// Starts the planner over `kvfabric worker` processes (`kvfabric frontend`); `env` is
    /// what each worker needs to join (the secret, the control plane).
    pub async fn start(
        &self,
        profile: &std::path::Path,
        name: &str,
        env: Vec<(String, String)>,
        metrics: HttpMetrics,
    ) -> anyhow::Result<Running> {
        let cfg = self.config(profile)?;
        let args: Vec<String> =
            self.planner_worker_args.split_whitespace().map(str::to_string).collect();
        anyhow::ensure!(
            !args.iter().any(|a| a == "--role" || a.starts_with("--role=")),
            "--planner-worker-args cannot set --role: the planner gives each pool its role (--planner-layout)"
        );
        let exe = std::env::current_exe().context("finding the kvfabric binary")?;
        let kinds = self
            .planner_layout
            .pools()
            .iter()
            .map(|&pool| {
                let mut args = args.clone();
                let prefix = match pool {
                    Pool::Aggregated => format!("{name}-w"),
                    Pool::Prefill => format!("{name}-p"),
                    Pool::Decode => format!("{name}-d"),
                };
                if pool != Pool::Aggregated {
                    args.extend(["--role".to_string(), pool.name().to_string()]);
                }
                let kind = Processes(WorkerTemplate {
                    exe: exe.clone(),
                    args,
                    env: env.clone(),
                    prefix,
                    start_timeout: Duration::from_secs(self.planner_start_timeout_s.max(1)),
                    drain_timeout: Duration::from_secs(self.planner_drain_timeout_s),
                });
                (pool, kind)
            })
            .collect();
        self.run(cfg, kinds, metrics).await
    }

    /// Starts the planner over worker stacks in this process (`kvfabric up`), registered in
    /// `discovery`.
    pub async fn start_in_process(
        &self,
        profile: &std::path::Path,
        name: &str,
        engine: super::stack::EngineOpts,
        discovery: Arc<dyn kvfabric::control::Discovery>,
        bus: Arc<dyn kvfabric::control::EventBus>,
        metrics: HttpMetrics,
    ) -> anyhow::Result<Running> {
        anyhow::ensure!(
            self.planner_worker_args.trim().is_empty(),
            "--planner-worker-args is for `kvfabric frontend`: `kvfabric up` runs its workers with its own engine options"
        );
        let cfg = self.config(profile)?;
        let kinds = self
            .planner_layout
            .pools()
            .iter()
            .map(|&pool| {
                let prefix = match pool {
                    Pool::Aggregated => name.to_string(),
                    p => format!("{name}-{}", p.name()),
                };
                let kind = InProcess {
                    engine: engine.clone(),
                    discovery: discovery.clone(),
                    bus: bus.clone(),
                    prefix,
                    role: role_of(pool),
                    drain_timeout: Duration::from_secs(self.planner_drain_timeout_s),
                };
                (pool, kind)
            })
            .collect();
        self.run(cfg, kinds, metrics).await
    }

    /// The planner's settings, with the curves of `profile`.
    fn config(&self, profile: &std::path::Path) -> anyhow::Result<PlannerConfig> {
        let curves = EngineProfile::read(profile)
            .and_then(|p| p.planning())
            .with_context(|| profile.display().to_string())?;
        anyhow::ensure!(
            self.planner_min_workers >= 1 && self.planner_max_workers >= self.planner_min_workers,
            "--planner-min-workers must be at least 1 and at most --planner-max-workers"
        );
        anyhow::ensure!(
            self.planner_interval_s.is_finite()
                && (0.1..=3600.0).contains(&self.planner_interval_s),
            "--planner-interval-s must be between 0.1 and 3600"
        );
        anyhow::ensure!(
            self.planner_drain_timeout_s <= 86_400 && self.planner_start_timeout_s <= 86_400,
            "--planner-drain-timeout-s and --planner-start-timeout-s must be at most 86400"
        );
        anyhow::ensure!(
            self.planner_scale_down_headroom.is_finite()
                && (0.0..=10.0).contains(&self.planner_scale_down_headroom),
            "--planner-scale-down-headroom must be between 0 and 10"
        );
        for (what, v) in
            [("--planner-ttft-ms", self.planner_ttft_ms), ("--planner-itl-ms", self.planner_itl_ms)]
        {
            anyhow::ensure!(v.is_finite() && v > 0.0, "{what} must be > 0");
        }
        let (ttft, itl) = (self.planner_ttft_ms / 1e3, self.planner_itl_ms / 1e3);
        let targets = match super::plan::parse_percentile(&self.planner_percentile)? {
            None => Targets::means(ttft, itl),
            Some(q) => Targets::at_quantile(ttft, itl, q),
        };
        Ok(PlannerConfig {
            interval: Duration::from_secs_f64(self.planner_interval_s),
            min_workers: self.planner_min_workers,
            workers_max: self.planner_max_workers,
            targets,
            predictor: self.planner_predictor,
            profile: curves,
            scale_down_after: self.planner_scale_down_after,
            scale_down_headroom: self.planner_scale_down_headroom,
            history: 16,
        })
    }

    async fn run<K: Kind>(
        &self,
        cfg: PlannerConfig,
        kinds: Vec<(Pool, K)>,
        metrics: HttpMetrics,
    ) -> anyhow::Result<Running> {
        let mut pools: Vec<(Pool, Arc<Workers<K>>)> = Vec::new();
        let mut started = Vec::new();
        for (pool, kind) in kinds {
            let workers = Arc::new(Workers::new(kind));
            let n = match workers.scale_to(self.planner_min_workers).await {
                Ok(n) => n,
                Err(e) => {
                    // The pools already started are drained, not left running.
                    workers.shutdown().await;
                    for (_, w) in pools.iter().rev() {
                        w.shutdown().await;
                    }
                    return Err(e).with_context(|| {
                        format!("planner: starting the first {} workers", pool.name())
                    });
                }
            };
            started.push((pool, n));
            pools.push((pool, workers));
        }
        tracing::info!(
            layout = ?self.planner_layout,
            workers = ?started,
            min = self.planner_min_workers,
            max = self.planner_max_workers,
            interval_s = self.planner_interval_s,
            "planner: started"
        );
        let mut log = match &self.planner_log {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?,
            ),
            None => None,
        };
        let state = Arc::new(PlannerState::starting(&started));
        let scalers: Vec<(Pool, Arc<dyn Scaler>)> =
            pools.iter().map(|(p, w)| (*p, w.clone() as Arc<dyn Scaler>)).collect();
        let task = live::spawn(cfg, metrics, scalers, state.clone(), move |d| {
            if let Some(f) = log.as_mut() {
                if let Ok(line) = serde_json::to_string(d) {
                    if let Err(e) = writeln!(f, "{line}") {
                        tracing::warn!(error = %e, "planner: writing the decision log; no more lines");
                        log = None;
                    }
                }
            }
        });
        // Decode workers drain first: their requests may still need the prefill workers.
        let shutdown = Box::pin(async move {
            for (_, w) in pools.iter().rev() {
                w.shutdown().await;
            }
        });
        Ok(Running { state, task, shutdown })
    }
}
