//! Control-plane plumbing shared by the commands that own a block store (`fabric`, `worker`,
//! `up`) and those that only follow one (`frontend`): connecting to discovery and the bus,
//! publishing a store's KV events, and publishing full dumps for consumers that lost events.

use std::sync::Arc;

use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::NatsBus;
use kvfabric::control::{Discovery, EventBus};
use kvfabric::events::KvEvent;
use kvfabric_tiers::TieredStore;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Where the control plane is, as every command that joins one takes it.
#[derive(Debug, Clone, clap::Args)]
pub struct ControlArgs {
    /// etcd endpoints, comma-separated (without: embedded discovery, this process only).
    #[arg(long, env = "KVFABRIC_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// NATS URL (without: embedded event bus, this process only).
    #[arg(long, env = "KVFABRIC_NATS")]
    pub nats: Option<String>,
    /// Namespace of keys and subjects.
    #[arg(long, env = "KVFABRIC_NAMESPACE", default_value = "default")]
    pub namespace: String,
}

impl ControlArgs {
    /// Connects as [`connect`] does.
    pub async fn connect(&self) -> anyhow::Result<(Arc<dyn Discovery>, Arc<dyn EventBus>)> {
        connect(&self.etcd, self.nats.as_deref(), &self.namespace).await
    }
}

/// etcd discovery when endpoints are given (else embedded, this process only), and the NATS
/// bus when a URL is given (else embedded).
pub async fn connect(
    etcd: &[String],
    nats: Option<&str>,
    namespace: &str,
) -> anyhow::Result<(Arc<dyn Discovery>, Arc<dyn EventBus>)> {
    let discovery: Arc<dyn Discovery> = if etcd.is_empty() {
        tracing::info!("discovery: embedded (this process only)");
        Arc::new(MemoryDiscovery::new())
    } else {
        let d = EtcdDiscovery::connect(etcd, namespace).await?;
        tracing::info!(endpoints = ?etcd, namespace, "discovery: etcd");
        Arc::new(d)
    };
    let bus: Arc<dyn EventBus> = match nats {
        Some(url) => {
            let b = NatsBus::connect(url, namespace).await?;
            tracing::info!(url, namespace, "event bus: NATS");
            Arc::new(b)
        }
        None => {
            tracing::info!("event bus: embedded (this process only)");
            Arc::new(MemoryBus::new())
        }
    };
    Ok((discovery, bus))
}

/// Publishes the events of a store's sink on `kv-events` as `{"source": NAME, "event": ...}`.
pub fn publish_events(
    bus: Arc<dyn EventBus>,
    name: String,
    mut events: mpsc::Receiver<KvEvent>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(e) = events.recv().await {
            let msg = serde_json::json!({ "source": name, "event": e });
            let _ = bus.publish("kv-events", msg.to_string().into_bytes()).await;
        }
    })
}

/// Consumers that missed events (a gap in ids, or the bus restarted) resynchronize from a
/// full dump of the store's blocks, current as of an event id, published on `kv-events`
/// after each reconnection of the bus and on any message on `kv-dump-request`.
pub async fn serve_dumps(
    bus: Arc<dyn EventBus>,
    store: TieredStore,
    name: String,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let dump = {
        let bus = bus.clone();
        move || {
            let (bus, store, name) = (bus.clone(), store.clone(), name.clone());
            async move {
                let last_event_id = store.last_event_id();
                let blocks: Vec<_> = store
                    .snapshot()
                    .into_iter()
                    .map(|(tier, hash, parent)| serde_json::json!({ "tier": tier, "hash": hash, "parent": parent }))
                    .collect();
                let msg = serde_json::json!({ "source": name, "dump": blocks, "last_event_id": last_event_id });
                let _ = bus.publish("kv-events", msg.to_string().into_bytes()).await;
            }
        }
    };
    let mut tasks = Vec::new();
    if let Some(mut conns) = bus.connections() {
        let dump = dump.clone();
        tasks.push(tokio::spawn(async move {
            conns.borrow_and_update();
            while conns.changed().await.is_ok() {
                dump().await;
            }
        }));
    }
    let mut requests = bus.subscribe("kv-dump-request").await?;
    tasks.push(tokio::spawn(async move {
        while requests.recv().await.is_some() {
            dump().await;
        }
    }));
    Ok(tasks)
}
