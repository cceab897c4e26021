//! Where the control plane is, as the commands that join one (`fabric`, `worker`,
//! `frontend`) take it, and connecting to it. What flows over it is the contract of
//! `kvfabric::contract`; a store's events and dumps are published by
//! `kvfabric_tiers::publish`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

use kvfabric::control::advertise::Reach;
use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::{NatsAuth, NatsBus};
use kvfabric::control::{Discovery, EventBus};

/// Where the control plane is, as every command that joins one takes it.
#[derive(Debug, Clone, clap::Args)]
pub struct ControlArgs {
    /// etcd endpoints, comma-separated (without: embedded discovery, this process only).
    #[arg(long, env = "KVFABRIC_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// NATS URLs, comma-separated (without: embedded event bus, this process only). They may
    /// carry credentials (`nats://user:password@host:4222`, `nats://token@host`), but a
    /// command line is seen by every user of the machine: prefer the files below.
    #[arg(long, env = "KVFABRIC_NATS")]
    pub nats: Option<String>,
    /// NATS user name (its password from --nats-password-file).
    #[arg(long, env = "KVFABRIC_NATS_USER", requires = "nats_password_file")]
    pub nats_user: Option<String>,
    /// A file holding the NATS user's password (one line).
    #[arg(long, env = "KVFABRIC_NATS_PASSWORD_FILE", requires = "nats_user")]
    pub nats_password_file: Option<PathBuf>,
    /// A file holding a NATS token (one line).
    #[arg(long, env = "KVFABRIC_NATS_TOKEN_FILE", conflicts_with_all = ["nats_user", "nats_creds"])]
    pub nats_token_file: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed, as `nsc` writes them).
    #[arg(long, env = "KVFABRIC_NATS_CREDS", conflicts_with = "nats_user")]
    pub nats_creds: Option<PathBuf>,
    /// Copies of the prefill work queue that JetStream keeps, on as many servers (default:
    /// the servers of the NATS cluster, at most 3; 1 without a cluster).
    #[arg(long, env = "KVFABRIC_NATS_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub nats_replicas: Option<u8>,
    /// Namespace of keys and subjects.
    #[arg(long, env = "KVFABRIC_NAMESPACE", default_value = "default")]
    pub namespace: String,
}

impl ControlArgs {
    /// Connects as [`connect`] does.
    pub async fn connect(&self) -> anyhow::Result<(Arc<dyn Discovery>, Arc<dyn EventBus>)> {
        let auth = self.nats_auth()?;
        let replicas = self.nats_replicas.map(usize::from);
        connect(&self.etcd, self.nats.as_deref(), auth, replicas, &self.namespace).await
    }

    /// Where the control plane is: on this host only (embedded, or every endpoint on
    /// loopback), or on others, which must be able to dial what this process registers.
    pub fn reach(&self) -> Reach {
        let etcd = self.etcd.iter().map(|e| (e.as_str(), 2379));
        let nats = self.nats.iter().flat_map(|n| n.split(',')).map(|n| (n, 4222));
        Reach::of(etcd.chain(nats))
    }

    /// The NATS credentials of the flags (read from their files), if any.
    pub fn nats_auth(&self) -> anyhow::Result<NatsAuth> {
        let secret = |path: &PathBuf, what: &str| -> anyhow::Result<String> {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the NATS {what} file {}", path.display()))?;
            let line = text.trim_end_matches(['\n', '\r']).to_string();
            anyhow::ensure!(!line.is_empty(), "the NATS {what} file {} is empty", path.display());
            Ok(line)
        };
        let given =
            (&self.nats_user, &self.nats_password_file, &self.nats_token_file, &self.nats_creds);
        Ok(match given {
            (Some(user), Some(p), None, None) => {
                NatsAuth::UserPassword { user: user.clone(), password: secret(p, "password")? }
            }
            (None, None, Some(t), None) => NatsAuth::Token(secret(t, "token")?),
            (None, None, None, Some(c)) => NatsAuth::CredsFile(c.clone()),
            (None, None, None, None) => NatsAuth::None,
            _ => anyhow::bail!(
                "give one kind of NATS credentials: --nats-user with --nats-password-file, \
                 --nats-token-file, or --nats-creds"
            ),
        })
    }

    /// The environment that gives a child process this control plane (the planner's
    /// workers): the same servers and namespace, the same credential files. Credentials in
    /// the NATS URL go as they are (in the environment, which only this user can read).
    pub fn child_env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("KVFABRIC_ETCD".to_string(), self.etcd.join(",")),
            ("KVFABRIC_NAMESPACE".to_string(), self.namespace.clone()),
        ];
        env.extend(self.nats.clone().map(|n| ("KVFABRIC_NATS".to_string(), n)));
        env.extend(
            self.nats_replicas.map(|r| ("KVFABRIC_NATS_REPLICAS".to_string(), r.to_string())),
        );
        env.extend(self.nats_user.clone().map(|u| ("KVFABRIC_NATS_USER".to_string(), u)));
        for (var, path) in [
            ("KVFABRIC_NATS_PASSWORD_FILE", &self.nats_password_file),
            ("KVFABRIC_NATS_TOKEN_FILE", &self.nats_token_file),
            ("KVFABRIC_NATS_CREDS", &self.nats_creds),
        ] {
            env.extend(path.as_ref().map(|p| (var.to_string(), p.display().to_string())));
        }
        env
    }
}

/// etcd discovery when endpoints are given (else embedded, this process only), and the NATS
/// bus when a URL is given (else embedded).
pub async fn connect(
    etcd: &[String],
    nats: Option<&str>,
    auth: NatsAuth,
    replicas: Option<usize>,
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
        Some(urls) => {
            let mut b = NatsBus::connect_with(urls, auth, namespace).await?;
            if let Some(r) = replicas {
                b = b.with_replicas(r);
            }
            // Logged without the credentials a URL may carry.
            let (servers, authenticated) = (b.servers(), b.authenticated());
            tracing::info!(%servers, namespace, authenticated, queue_replicas = b.replicas(),
                "event bus: NATS");
            Arc::new(b)
        }
        None => {
            tracing::info!("event bus: embedded (this process only)");
            Arc::new(MemoryBus::new())
        }
    };
    Ok((discovery, bus))
}
