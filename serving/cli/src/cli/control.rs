//! Where the control plane is, as the commands that join one (`fabric`, `worker`,
//! `frontend`) take it, and connecting to it. What flows over it is the contract of
//! `kvfabric::contract`; a store's events and dumps are published by
//! `kvfabric_tiers::publish`.

use std::sync::Arc;

use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::NatsBus;
use kvfabric::control::{Discovery, EventBus};

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
