//! `kvfabric worker`: one engine with its block store, registered in discovery (etcd, or
//! embedded) under a lease, publishing its KV events and load on the event bus (NATS, or
//! embedded), serving generation requests from frontends on its request port. Prints one
//! JSON line (`{"worker": NAME, "addr": ..., "model": ...}`) on stdout when ready. On
//! SIGINT/SIGTERM it leaves discovery, drains (finishes the requests it has, within
//! `--drain-timeout-s`), stops and keeps its host blocks on disk.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use kvfabric_serving::worker::Role;

use kvfabric::control::advertise::Advertise;

use super::stack::{shutdown_signal, start_stack, EngineOpts, TransferAt, DRAIN_QUIET};
use kvfabric_serving::worker::Served;

fn parse_role(s: &str) -> Result<Role, String> {
    match s {
        "aggregated" => Ok(Role::Aggregated),
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        other => Err(format!("unknown role {other:?} (aggregated, prefill, decode)")),
    }
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    engine: EngineOpts,
    /// Role: aggregated (prefill and decode), prefill (serves decode workers' prefill queue)
    /// or decode (serves frontends, prefilling long prompts on prefill workers).
    #[arg(long, env = "KVFABRIC_ROLE", default_value = "aggregated", value_parser = parse_role)]
    role: Role,
    /// Worker name (unique in the namespace).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "worker-0")]
    name: String,
    /// Request port for frontends (a prefill worker has none: its transfer agent listens
    /// here).
    #[arg(long, env = "KVFABRIC_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The address other hosts dial, registered in discovery: `HOST` (every port of this
    /// worker, each its own port number) or `HOST:PORT` (the request port; a NAT's). Default:
    /// the address of `--listen`, or with `0.0.0.0`/`::` that of the interface that routes
    /// to the control plane. A loopback address with a control plane on another host is
    /// refused at start.
    #[arg(long, env = "KVFABRIC_ADVERTISE")]
    advertise: Option<Advertise>,
    /// Where the transfer agent listens (TCP; KV to and from peers). Default: the host of
    /// `--listen`, any port.
    #[arg(long, env = "KVFABRIC_TRANSFER_LISTEN")]
    transfer_listen: Option<SocketAddr>,
    /// The transfer agent's address for peers, as `--advertise` (default: its host).
    #[arg(long, env = "KVFABRIC_TRANSFER_ADVERTISE")]
    transfer_advertise: Option<Advertise>,
    #[command(flatten)]
    control: super::control::ControlArgs,
    #[command(flatten)]
    tls: super::tls::TlsArgs,
    /// Serve `/metrics` (Prometheus) and `/health` (JSON: `ok`, or `degraded` while etcd or
    /// NATS does not answer) on this address.
    #[arg(long, env = "KVFABRIC_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Discovery lease TTL, seconds.
    #[arg(long, env = "KVFABRIC_LEASE_TTL_S", default_value_t = 10)]
    lease_ttl_s: u64,
    /// On SIGTERM/SIGINT the worker leaves discovery, then finishes the requests it has for
    /// at most this many seconds before it stops (a second signal stops it at once).
    #[arg(long, env = "KVFABRIC_DRAIN_TIMEOUT_S", default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(0..=86_400))]
    drain_timeout_s: u64,
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    anyhow::ensure!(
        args.engine.secret.as_ref().is_some_and(|s| !s.is_empty()),
        "a worker needs the shared --secret (KVFABRIC_SECRET) of its frontends and peers: \
         its request port and its transfer agent authenticate with it"
    );
    // What others dial: checked before the control plane is even contacted.
    let reach = args.control.reach();
    let host = args.advertise.map(|a| Advertise { port: None, ..a });
    let request_port = match args.role {
        Role::Prefill => None,
        _ => Some(Advertise::resolve("the request port", args.listen, args.advertise, &reach)?),
    };
    let transfer_listen = args.transfer_listen.unwrap_or(match args.role {
        Role::Prefill => args.listen,
        _ => SocketAddr::new(args.listen.ip(), 0),
    });
    let transfer_advertise = args.transfer_advertise.or(host);
    let tls = args.tls.load()?;
    let transfer = TransferAt {
        tls: tls.clone(),
        listen: transfer_listen,
        advertise: Some(Advertise::resolve(
            "the transfer agent",
            transfer_listen,
            transfer_advertise,
            &reach,
        )?),
    };
    let (discovery, bus) = args.control.connect().await?;
    let ttl = Duration::from_secs(args.lease_ttl_s.max(1));
    kvfabric_serving::worker::ensure_name_free(&*discovery, &args.name, ttl).await?;
    let stack =
        start_stack(&args.engine, &args.name, &discovery, bus.clone(), transfer, false).await?;
    let Served { addr, registration, server, metrics: source, stats } = stack
        .serve(
            &args.name,
            args.role,
            args.listen,
            request_port,
            &discovery,
            &bus,
            args.engine.max_batch,
            args.engine.disagg(),
            ttl,
        )
        .await?;
    let mut metrics_addr = None;
    let metrics = match args.metrics_listen {
        Some(at) => {
            // Its own counters and the control plane's state; /health its engine, store and
            // transfers, and whether the control plane answers (a worker keeps serving
            // without it).
            let health =
                kvfabric::health::Health { worker: Some(args.name.clone()), ..Default::default() };
            let own = Arc::new(source.clone());
            let (addr, task) =
                super::stack::metrics_port(at, tls.clone(), Some(own), &discovery, &bus, health)
                    .await?;
            // Printed as others reach it; nothing registers it (Prometheus is told), so a
            // port on loopback is fine: shown as it is bound.
            let shown = Advertise::resolve("the metrics port", at, host, &reach);
            metrics_addr = Some(shown.map_or(addr, |a| a.addr(addr)));
            Some(task)
        }
        None => None,
    };
    super::say!(
        "{}",
        serde_json::json!({
            "worker": args.name, "addr": addr, "model": stack.sched.info().id, "role": args.role,
            "metrics": metrics_addr, "transfer": stack.agent.advertised_addr(),
        })
    );
    tracing::info!(worker = %args.name, %addr, metrics = ?metrics_addr, "worker listening");
    // A dead engine takes the worker out of service: it leaves discovery and the process
    // exits non-zero, for its supervisor (systemd, Kubernetes) to restart it.
    let failure = tokio::select! {
        _ = stop_signal => None,
        reason = stack.sched.failed() => Some(reason),
    };
    match &failure {
        None => tracing::info!(worker = %args.name, "shutting down: leaving discovery"),
        Some(reason) => {
            tracing::error!(worker = %args.name, %reason, "engine failed: leaving discovery and exiting")
        }
    }
    if failure.is_none() {
        // Its reports say so from now on (dashboards show it draining).
        stack.sched.stats().draining.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    registration.revoke().await;
    if failure.is_none() {
        // Drain: routers saw the worker leave; finish what was sent before they did.
        let deadline = Duration::from_secs(args.drain_timeout_s);
        tracing::info!(worker = %args.name, ?deadline, "draining: finishing the requests in flight");
        let again = shutdown_signal();
        let drained = tokio::select! {
            d = kvfabric_serving::worker::drain(
                stats.as_deref(), &stack.sched, DRAIN_QUIET, deadline) => d,
            _ = again => false,
        };
        if drained {
            tracing::info!(worker = %args.name, "drained");
        } else {
            let left = stats
                .as_ref()
                .map_or(0, |s| s.in_flight.load(std::sync::atomic::Ordering::Relaxed));
            tracing::warn!(worker = %args.name, in_flight = left, "stopping before the requests in flight finished (drain deadline or a second signal)");
        }
    }
    server.abort();
    if let Some(m) = metrics {
        m.abort();
    }
    stack.shutdown().await;
    if let Some(reason) = failure {
        anyhow::bail!("worker {} out of service: {reason}", args.name);
    }
    tracing::info!(worker = %args.name, "worker stopped");
    Ok(())
}
