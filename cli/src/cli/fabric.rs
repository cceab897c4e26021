//! `kvfabric fabric`: a standalone KV fabric node. It runs a tiered store (host + disk)
//! behind the transfer engine, registers in discovery with its transfer metadata under a
//! lease, publishes its KV events, and serves lookups, gets and puts to authenticated
//! clients. Prints its node info as one JSON line on stdout when ready. On SIGINT/SIGTERM it
//! drains (stops accepting connections), revokes its lease and exits.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfabric::agent::Agent;
use kvfabric::contract::{Load, Message};
use kvfabric::events::ChannelSink;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::fabric::FabricNode;
use kvfabric_tiers::publish::StorePublisher;
use kvfabric_tiers::{StoreConfig, TieredStore};

#[derive(Debug, Args)]
pub struct FabricArgs {
    /// Node name (unique in the namespace).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "fabric-0")]
    name: String,
    /// Transfer engine listen address.
    #[arg(long, env = "KVFABRIC_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The address other hosts dial, registered in discovery (`HOST` or `HOST:PORT`).
    /// Default: the address of `--listen`, or with `0.0.0.0`/`::` that of the interface
    /// that routes to the control plane; a loopback address with a control plane on another
    /// host is refused at start.
    #[arg(long, env = "KVFABRIC_ADVERTISE")]
    advertise: Option<kvfabric::control::advertise::Advertise>,
    /// Shared secret of the transfer handshake (or from a file: KVFABRIC_SECRET_FILE).
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    secret: kvfabric::secret::Secret,
    #[command(flatten)]
    control: super::control::ControlArgs,
    #[command(flatten)]
    tls: super::tls::TlsArgs,
    /// Model whose block size to store (preset, config.json or GGUF).
    #[arg(long, env = "KVFABRIC_MODEL", default_value = "smollm2-135m")]
    model: String,
    /// KV dtype, overriding the model's (f32, f16, bf16, fp8, int8): the blocks of the
    /// workers it serves must be of the same size.
    #[arg(long, env = "KVFABRIC_DTYPE")]
    dtype: Option<String>,
    /// Tokens per block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16)]
    block_tokens: u32,
    /// Host tier capacity, blocks.
    #[arg(long, env = "KVFABRIC_HOST_BLOCKS", default_value_t = 1024,
        value_parser = clap::value_parser!(u32).range(1..))]
    host_blocks: u32,
    /// Disk tier capacity, blocks (0: no disk tier).
    #[arg(long, env = "KVFABRIC_DISK_BLOCKS", default_value_t = 0)]
    disk_blocks: u32,
    /// Directory of the disk tier.
    #[arg(long, env = "KVFABRIC_DATA_DIR", default_value = "kvfabric-data")]
    data_dir: std::path::PathBuf,
    /// Discovery lease TTL, seconds.
    #[arg(long, env = "KVFABRIC_LEASE_TTL_S", default_value_t = 10)]
    lease_ttl_s: u64,
    /// Serve `/metrics` (Prometheus: the control plane's state) and `/health` (JSON: `ok`,
    /// or `degraded` while etcd or NATS does not answer) on this address.
    #[arg(long, env = "KVFABRIC_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

/// How often a fabric node reports its tiers.
const REPORT_PERIOD: Duration = Duration::from_secs(1);

pub async fn run(args: FabricArgs) -> anyhow::Result<()> {
    let stop_signal = super::stack::shutdown_signal();
    let mut spec = kvfabric_planner::plan::resolve_model(&args.model)
        .with_context(|| format!("model {:?}", args.model))?;
    if let Some(d) = &args.dtype {
        spec = spec.with_dtype(kvfabric::layout::KvDtype::parse(d)?);
    }
    let block_bytes = spec.block_layout(args.block_tokens)?.bytes_per_block();
    let tls = args.tls.load()?;
    let mut cfg = super::stack::agent_config(args.name.clone(), args.secret.clone());
    cfg.tls = tls.clone();
    cfg.listen = args.listen;
    let reach = args.control.reach();
    let host = args.advertise.map(|a| kvfabric::control::advertise::Advertise { port: None, ..a });
    cfg.advertise = Some(kvfabric::control::advertise::Advertise::resolve(
        "the fabric node",
        args.listen,
        args.advertise,
        &reach,
    )?);
    let agent = Agent::start(cfg).await?;

    let (discovery, bus) = args.control.connect().await?;

    // KV events: the store's sink feeds a task that publishes them on the bus.
    let (sink, events) = ChannelSink::new(65_536);

    let mut store_cfg = StoreConfig::new(block_bytes, args.host_blocks);
    store_cfg.disk_admit_min_hits = 0;
    if args.disk_blocks > 0 {
        store_cfg.disk = Some(DiskConfig::new(
            args.data_dir.join(format!("{}.slots", args.name)),
            args.disk_blocks,
        ));
    }
    let store = TieredStore::open(store_cfg, &agent, sink).await?;
    let node = FabricNode::serve(agent.clone(), store, Duration::from_secs(30));
    let ttl = Duration::from_secs(args.lease_ttl_s.max(1));
    let registration = node.register(&*discovery, &args.name, ttl).await?;
    let mut metrics_addr = None;
    let metrics = match args.metrics_listen {
        Some(at) => {
            let health =
                kvfabric::health::Health { node: Some(args.name.clone()), ..Default::default() };
            let (addr, task) =
                super::stack::metrics_port(at, tls.clone(), None, &discovery, &bus, health).await?;
            // Shown as others reach it; nothing registers it, so loopback is fine.
            let shown = kvfabric::control::advertise::Advertise::resolve(
                "the metrics port",
                at,
                host,
                &reach,
            );
            metrics_addr = Some(shown.map_or(addr, |a| a.addr(addr)));
            Some(task)
        }
        None => None,
    };
    super::say!("{}", serde_json::json!({ "fabric": node.info(), "metrics": metrics_addr }));

    let publisher =
        StorePublisher::start(bus.clone(), args.name.clone(), node.store().clone(), events).await?;
    // Load reports (role `fabric`: its tiers and transfers), for dashboards.
    let reports = {
        let (bus, name, store) = (bus.clone(), args.name.clone(), node.store().clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REPORT_PERIOD);
            loop {
                tick.tick().await;
                let transfers = store.agent().transfer_counts();
                let stats = kvfabric_serving::metrics::fabric_stats(&store.metrics(), &transfers);
                let msg = Message::Load {
                    source: name.clone(),
                    load: Load::default(),
                    stats: Some(Box::new(stats)),
                };
                let _ = bus.publish(msg.topic(), msg.encode()).await;
            }
        })
    };

    stop_signal.await;
    // Graceful shutdown: no new connections, leave discovery at once.
    agent.shutdown();
    registration.revoke().await;
    reports.abort();
    if let Some(m) = metrics {
        m.abort();
    }
    drop(publisher);
    tracing::info!(node = %args.name, "fabric node stopped");
    Ok(())
}
