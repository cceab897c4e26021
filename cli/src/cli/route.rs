//! `kvfabric router`: the KV-aware routing decision as a service, for gateways that send the
//! requests themselves. It follows discovery and the KV events like a frontend and answers
//! `POST /v1/route` (token ids, a prompt or chat messages → the chosen worker, each worker's
//! cached blocks per tier, load and cost), `/v1/route/release`, `/health` and `/metrics`.
//! Prints `kvfabric router at http://ADDR/v1` when ready.

use clap::Args;
use kvfabric_serving::http;
use kvfabric_serving::routed::{RoutedBackend, RoutedConfig};
use std::net::SocketAddr;
use std::sync::Arc;

use super::stack::shutdown_signal;

#[derive(Debug, Args)]
pub struct RouterArgs {
    /// Address to listen on.
    #[arg(long, env = "KVFABRIC_HOST", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on (0: any free port).
    #[arg(long, env = "KVFABRIC_PORT", default_value_t = 8001)]
    port: u16,
    #[command(flatten)]
    routing: super::RoutingArgs,
    #[command(flatten)]
    control: super::control::ControlArgs,
    #[command(flatten)]
    http: super::HttpArgs,
    /// HTTPS for `/v1/route` and `/metrics` (give --tls-client-ca, the deployment CA, to
    /// accept only gateways with a certificate).
    #[command(flatten)]
    tls: super::tls::TlsArgs,
    /// Router name (in dump requests).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "router-0")]
    name: String,
}

pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    let stop_signal = shutdown_signal();
    let tls = args.tls.load()?;
    let (discovery, bus) = args.control.connect().await?;
    // The router sends no requests: the secret only satisfies the routed backend's check.
    let cfg = RoutedConfig {
        router: args.routing.config(),
        name: args.name.clone(),
        ..RoutedConfig::new(b"kvfabric-router-sends-no-requests")
    };
    let control = kvfabric_serving::metrics::ControlSource::new(discovery.clone(), bus.clone());
    let backend = Arc::new(RoutedBackend::start(discovery, bus, cfg).await?);
    let addr = SocketAddr::new(args.host, args.port);
    let b = backend.clone();
    super::frontend::serve_routed(
        "router",
        &args.name,
        addr,
        &args.http,
        tls,
        Default::default(),
        vec![Arc::new(control)],
        stop_signal,
        |c| http::routing_router(b, c),
    )
    .await?;
    backend.stop();
    Ok(())
}
