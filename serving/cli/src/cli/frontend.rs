//! `kvfabric frontend`: the OpenAI-compatible HTTP API in front of the workers that discovery
//! knows, routing each request with the router crate and relaying its tokens. Prints
//! `kvfabric frontend at http://ADDR/v1` when ready.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfabric_router::{RouterConfig, RoutingMode};
use kvfabric_serving::http::{self, ServerConfig};
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};

use super::up::{parse_mode, shutdown_signal};

#[derive(Debug, Args)]
pub struct FrontendArgs {
    /// Address to listen on.
    #[arg(long, env = "KVFABRIC_HOST", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, env = "KVFABRIC_PORT", default_value_t = 8000)]
    port: u16,
    /// Routing: kv, round-robin, random, least-loaded.
    #[arg(long, env = "KVFABRIC_ROUTER", default_value = "kv", value_parser = parse_mode)]
    router: RoutingMode,
    /// Softmax temperature of kv routing (0: always the cheapest worker).
    #[arg(long, env = "KVFABRIC_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    router_temperature: f64,
    #[command(flatten)]
    control: super::control::ControlArgs,
    /// The workers' shared secret: every request connection to a worker authenticates with
    /// it (`kvfabric worker --secret`).
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    secret: String,
    #[command(flatten)]
    http: super::HttpArgs,
    /// Workers tried per request at most (a failed one before any token is retried).
    #[arg(long, env = "KVFABRIC_MAX_ATTEMPTS", default_value_t = 3)]
    max_attempts: usize,
    /// Frontend name.
    #[arg(long, env = "KVFABRIC_NAME", default_value = "frontend-0")]
    name: String,
}

pub async fn run(args: FrontendArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    let (discovery, bus) = args.control.connect().await?;
    let cfg = RoutedConfig {
        router: RouterConfig {
            mode: args.router,
            temperature: args.router_temperature,
            ..RouterConfig::default()
        },
        max_attempts: args.max_attempts.max(1),
        name: args.name.clone(),
        first_token_timeout: Duration::from_secs(args.http.first_token_timeout_s),
        ..RoutedConfig::new(args.secret.clone().into_bytes())
    };
    let backend = Arc::new(RoutedBackend::start(discovery, bus, cfg).await?);
    let server_cfg = ServerConfig {
        request_timeout: Duration::from_secs(args.http.request_timeout_s.max(1)),
        api_key: args.http.api_key.clone().filter(|k| !k.is_empty()),
        ..ServerConfig::default()
    };
    let listen_stats = server_cfg.listen.clone();
    let app = http::router(backend.clone(), server_cfg);
    let listener = http::listen::bind(SocketAddr::new(args.host, args.port))
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    tracing::info!(frontend = %args.name, %addr, "frontend listening");
    super::say!("kvfabric frontend at http://{addr}/v1");
    http::listen::serve(listener, app, args.http.limits(), listen_stats, stop_signal).await?;
    backend.stop();
    tracing::info!(frontend = %args.name, "frontend stopped");
    Ok(())
}
