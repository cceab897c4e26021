//! `kvfabric up`: everything in one process. The OpenAI-compatible frontend, one engine
//! (the real model by default, or the mock) or `--workers N` of them behind KV routing, each
//! with its tiered block store (host memory over a disk tier under the data directory), and
//! the embedded control plane (discovery and the event bus, where workers register and
//! publish their KV events and load).
//!
//! The engine options and `start_stack` are shared with `kvfabric worker` (`stack.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::at_least_one;
use super::stack::{shutdown_signal, start_stack, EngineKind, EngineOpts, TransferAt};
use clap::Args;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus};
use kvfabric_serving::backend::{Backend, LocalBackend};
use kvfabric_serving::http::{self, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use kvfabric_serving::worker::Role;

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
    /// HTTPS on the API (with /metrics and /health). The in-process workers talk over
    /// loopback in the clear, so --tls-ca does not apply here.
    #[command(flatten)]
    tls: super::tls::TlsArgs,
    /// Worker name in discovery (with several workers, the prefix of their names).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "worker")]
    name: String,
    #[command(flatten)]
    planner: super::planning::PlannerArgs,
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
        restart_wait: Duration::from_secs(args.http.restart_wait_s),
        pending: args.http.pending(),
        ..RoutedConfig::new(engine.secret.clone().unwrap_or_default())
    };
    Ok(RoutedBackend::start(discovery.clone(), bus.clone(), cfg).await?)
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let (classes, tenants) = args.http.classes()?;
    let mut server_cfg = ServerConfig {
        classes,
        tenants,
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
        engine.secret = Some(b.iter().map(|x| format!("{x:02x}")).collect::<String>().into());
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
        let stack =
            start_stack(&engine, &args.name, &discovery, bus.clone(), TransferAt::LOOPBACK, true)
                .await?;
        let backend = Arc::new(LocalBackend::new(stack.sched.clone(), stack.store.clone()));
        let describe = stack.describe.clone();
        stacks.push(stack);
        (backend, describe)
    } else {
        for (i, (name, role)) in roles.iter().enumerate() {
            let stack =
                start_stack(&engine, name, &discovery, bus.clone(), TransferAt::LOOPBACK, i == 0)
                    .await?;
            let served = stack
                .serve(
                    name,
                    *role,
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    None,
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
    anyhow::ensure!(
        args.tls.tls_ca.is_none(),
        "--tls-ca is for connections between kvfabric processes; `up` has none (its workers \
         are in this process): give --tls-cert and --tls-key for HTTPS"
    );
    let tls = args.tls.load()?;
    if let Some(t) = &tls {
        server_cfg.sources.push(Arc::new(kvfabric_serving::metrics::tls::TlsSource(t.clone())));
    }
    let id = backend.models().first().map(|m| m.id.clone()).unwrap_or_default();
    // One /metrics for the whole process: the frontend's, and each worker's labelled.
    let app = http::router_with(backend, server_cfg, worker_metrics);
    let listener = http::listen::bind(SocketAddr::new(args.host, args.port))
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    tracing::info!("control plane: embedded discovery and event bus (this process only)");
    tracing::info!(%addr, "listening: kvfabric is serving {describe}");
    let scheme = super::tls::scheme(&tls);
    super::say!("kvfabric is serving {describe} at {scheme}://{addr}/v1");
    super::say!(
        "try:\n  curl {scheme}://{addr}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 64}}'"
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
    let served =
        http::listen::serve(listener, app, args.http.limits(), listen_stats, tls, stop).await;
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
