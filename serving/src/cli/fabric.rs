//! `kvfabric fabric`: a standalone KV fabric node. It runs a tiered store (host + disk)
//! behind the transfer engine, registers in discovery with its transfer metadata under a
//! lease, publishes its KV events, and serves lookups, gets and puts to authenticated
//! clients. Prints its node info as one JSON line on stdout when ready. On SIGINT/SIGTERM it
//! drains (stops accepting connections), revokes its lease and exits.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::control::Instance;
use kvfabric::events::ChannelSink;
use kvfabric_tiers::disk::DiskConfig;
use kvfabric_tiers::fabric::{FabricNode, FABRIC_KIND};
use kvfabric_tiers::{StoreConfig, TieredStore};

#[derive(Debug, Args)]
pub struct FabricArgs {
    /// Node name (unique in the namespace).
    #[arg(long, env = "KVFABRIC_NAME", default_value = "fabric-0")]
    name: String,
    /// Transfer engine listen address.
    #[arg(long, env = "KVFABRIC_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Shared secret of the transfer handshake.
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    secret: String,
    #[command(flatten)]
    control: super::publish::ControlArgs,
    /// Model whose block size to store (preset, config.json or GGUF).
    #[arg(long, env = "KVFABRIC_MODEL", default_value = "smollm2-135m")]
    model: String,
    /// Tokens per block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16)]
    block_tokens: u32,
    /// Host tier capacity, blocks.
    #[arg(long, env = "KVFABRIC_HOST_BLOCKS", default_value_t = 1024)]
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
}

pub async fn run(args: FabricArgs) -> anyhow::Result<()> {
    let spec = kvfabric_serving::plan::resolve_model(&args.model)
        .with_context(|| format!("model {:?}", args.model))?;
    let block_bytes = spec.block_layout(args.block_tokens)?.bytes_per_block();
    let mut cfg = AgentConfig::new(args.name.clone(), args.secret.into_bytes());
    cfg.listen = args.listen;
    let agent = Agent::start(cfg).await?;

    let (discovery, bus) = args.control.connect().await?;

    // KV events: the store's sink feeds a task that publishes them on the bus.
    let (sink, events) = ChannelSink::new(65_536);
    let publisher = super::publish::publish_events(bus.clone(), args.name.clone(), events);

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
    let info = node.info();
    let registration = discovery
        .register(
            Instance {
                kind: FABRIC_KIND.into(),
                id: args.name.clone(),
                metadata: serde_json::to_value(&info)?,
            },
            Duration::from_secs(args.lease_ttl_s.max(1)),
        )
        .await?;
    tracing::info!(node = %args.name, addr = %agent.listen_addr(), "fabric node listening and registered in discovery");
    println!("{}", serde_json::json!({ "fabric": info }));

    let resync =
        super::publish::serve_dumps(bus.clone(), node.store().clone(), args.name.clone()).await?;

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    // Graceful shutdown: no new connections, leave discovery at once.
    agent.shutdown();
    registration.revoke().await;
    publisher.abort();
    for t in resync {
        t.abort();
    }
    tracing::info!(node = %args.name, "fabric node stopped");
    Ok(())
}
