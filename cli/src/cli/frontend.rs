//! `kvfabric frontend`: the OpenAI-compatible HTTP API in front of the workers that discovery
//! knows, routing each request with the router crate and relaying its tokens. Prints
//! `kvfabric frontend at http://ADDR/v1` when ready.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfabric_serving::http::{self, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};

use super::stack::shutdown_signal;

#[derive(Debug, Args)]
pub struct FrontendArgs {
    /// Address to listen on.
    #[arg(long, env = "KVFABRIC_HOST", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, env = "KVFABRIC_PORT", default_value_t = 8000)]
    port: u16,
    #[command(flatten)]
    routing: super::RoutingArgs,
    #[command(flatten)]
    control: super::control::ControlArgs,
    /// The workers' shared secret: every request connection to a worker authenticates with
    /// it (`kvfabric worker --secret`; or from a file: KVFABRIC_SECRET_FILE).
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    secret: kvfabric::secret::Secret,
    #[command(flatten)]
    http: super::HttpArgs,
    #[command(flatten)]
    tls: super::tls::TlsArgs,
    /// Workers tried per request at most (a failed one before any token is retried).
    #[arg(long, env = "KVFABRIC_MAX_ATTEMPTS", default_value_t = 3)]
    max_attempts: usize,
    /// Frontend name.
    #[arg(long, env = "KVFABRIC_NAME", default_value = "frontend-0")]
    name: String,
    #[command(flatten)]
    planner: super::planning::PlannerArgs,
}

pub async fn run(args: FrontendArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    let tls = args.tls.load()?;
    let (discovery, bus) = args.control.connect().await?;
    let cfg = RoutedConfig {
        tls: tls.clone(),
        router: args.routing.config(),
        attempts_max: args.max_attempts.max(1),
        name: args.name.clone(),
        first_token_timeout: Duration::from_secs(args.http.first_token_timeout_s),
        stall_timeout: Duration::from_secs(args.http.stall_timeout_s),
        migrations_max: args.http.stream_migrations,
        restart_wait: Duration::from_secs(args.http.restart_wait_s),
        pending: args.http.pending(),
        ..RoutedConfig::new(args.secret.clone())
    };
    let control = kvfabric_serving::metrics::ControlSource::new(discovery.clone(), bus.clone());
    let backend = Arc::new(RoutedBackend::start(discovery, bus, cfg).await?);
    let metrics = kvfabric_serving::metrics::HttpMetrics::default();
    let planner = match &args.planner.profile {
        Some(profile) => {
            let c = &args.control;
            anyhow::ensure!(
                !c.etcd.is_empty() && c.nats.is_some(),
                "--planner starts worker processes that must find this frontend: it needs --etcd and --nats"
            );
            let secret = args.secret.expose_str().context("the shared secret is not UTF-8")?;
            let mut env = vec![("KVFABRIC_SECRET".to_string(), secret.to_string())];
            env.extend(c.child_env());
            env.extend(args.tls.child_env());
            let running = args.planner.start(profile, &args.name, env, metrics.clone()).await?;
            // Its first workers are registered; take requests once this frontend sees them.
            let min = args.planner.planner_min_workers;
            let wait = Duration::from_secs(args.planner.planner_start_timeout_s.max(1));
            if !backend.wait_for_workers(min as usize, wait).await {
                tracing::warn!(min, "planner: the first workers are registered but this frontend does not see them yet");
            }
            Some(running)
        }
        None => None,
    };
    let mut sources: Vec<Arc<dyn kvfabric_serving::metrics::Source>> = planner
        .iter()
        .map(|p| p.state.clone() as Arc<dyn kvfabric_serving::metrics::Source>)
        .collect();
    sources.push(Arc::new(control));
    let addr = SocketAddr::new(args.host, args.port);
    let b = backend.clone();
    let served = serve_routed(
        "frontend",
        &args.name,
        addr,
        &args.http,
        tls,
        metrics,
        sources,
        stop_signal,
        |c| http::router(b, c),
    )
    .await;
    if let Some(p) = planner {
        p.stop().await;
    }
    backend.stop();
    served
}

/// Serves the routes `app` builds over a routed backend on `addr` until `stop`, announcing
/// `kvfabric {what} at http://ADDR/v1` on stdout once listening (`frontend`, `router`).
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve_routed(
    what: &str,
    name: &str,
    addr: SocketAddr,
    args: &super::HttpArgs,
    tls: Option<Arc<kvfabric::tls::Tls>>,
    metrics: kvfabric_serving::metrics::HttpMetrics,
    mut sources: Vec<Arc<dyn kvfabric_serving::metrics::Source>>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    app: impl FnOnce(ServerConfig) -> axum::Router,
) -> anyhow::Result<()> {
    let (classes, tenants) = args.classes()?;
    if let Some(t) = &tls {
        sources.push(Arc::new(kvfabric_serving::metrics::tls::TlsSource(t.clone())));
    }
    let server_cfg = ServerConfig {
        classes,
        tenants,
        request_timeout: Duration::from_secs(args.request_timeout_s.max(1)),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        metrics,
        sources,
        name: format!("{what} {name}"),
        ..ServerConfig::default()
    };
    let listen_stats = server_cfg.listen.clone();
    let app = app(server_cfg);
    let listener = http::listen::bind(addr).with_context(|| format!("listening on {addr}"))?;
    let addr = listener.local_addr()?;
    tracing::info!(%what, %name, %addr, "listening");
    super::say!("kvfabric {what} at {}://{addr}/v1", super::tls::scheme(&tls));
    http::listen::serve(listener, app, args.limits(), listen_stats, tls, stop).await?;
    tracing::info!(%what, %name, "stopped");
    Ok(())
}
