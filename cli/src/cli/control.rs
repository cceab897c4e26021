//! Where the control plane is, as the commands that join one (`fabric`, `worker`,
//! `frontend`) take it, and connecting to it. What flows over it is the contract of
//! `kvfabric::contract`; a store's events and dumps are published by
//! `kvfabric_tiers::publish`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;

use kvfabric::control::advertise::Reach;
use kvfabric::control::etcd::{EtcdDiscovery, EtcdSecurity};
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::{NatsAuth, NatsBus, NatsTls};
use kvfabric::control::{Discovery, EventBus};
use kvfabric::secret::Secret;

/// Where the control plane is, as every command that joins one takes it.
#[derive(Debug, Clone, clap::Args)]
pub struct ControlArgs {
    /// etcd endpoints, comma-separated (without: embedded discovery, this process only);
    /// `https://` ones need --etcd-ca.
    #[arg(long, env = "KVFABRIC_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// The CA that signed etcd's certificates (PEM), for `https://` endpoints.
    #[arg(long, env = "KVFABRIC_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// A client certificate for etcd (PEM; etcd's `--client-cert-auth`).
    #[arg(long, env = "KVFABRIC_ETCD_CERT", requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "KVFABRIC_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// An etcd user (etcd's authentication; its password from --etcd-password-file).
    #[arg(long, env = "KVFABRIC_ETCD_USER", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// A file holding the etcd user's password (one line).
    #[arg(long, env = "KVFABRIC_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
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
    /// A file holding a NATS NKey seed (`SU…`, one line).
    #[arg(long, env = "KVFABRIC_NATS_NKEY_FILE", conflicts_with_all = ["nats_user", "nats_creds", "nats_token_file"])]
    pub nats_nkey_file: Option<PathBuf>,
    /// The CA that signed the NATS servers' certificates (PEM): TLS to NATS, required.
    #[arg(long, env = "KVFABRIC_NATS_CA")]
    pub nats_ca: Option<PathBuf>,
    /// A client certificate for NATS (PEM; servers with `verify: true`).
    #[arg(long, env = "KVFABRIC_NATS_CERT", requires_all = ["nats_key", "nats_ca"])]
    pub nats_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "KVFABRIC_NATS_KEY", requires = "nats_cert")]
    pub nats_key: Option<PathBuf>,
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
        let nats_tls = NatsTls {
            ca: self.nats_ca.clone(),
            identity: self.nats_cert.clone().zip(self.nats_key.clone()),
        };
        let etcd = self.etcd_security()?;
        connect(&self.etcd, etcd, self.nats.as_deref(), auth, nats_tls, replicas, &self.namespace)
            .await
    }

    /// etcd's TLS and user of the flags (the files read, the certificates checked).
    pub fn etcd_security(&self) -> anyhow::Result<EtcdSecurity> {
        let tls = match &self.etcd_ca {
            Some(ca) => Some(kvfabric::tls::client_config(
                ca,
                self.etcd_cert.as_deref().zip(self.etcd_key.as_deref()),
            )?),
            None => None,
        };
        let user = match (&self.etcd_user, &self.etcd_password_file) {
            (Some(u), Some(p)) => Some((
                u.clone(),
                Secret::from_file(p)
                    .with_context(|| format!("reading the etcd password file {}", p.display()))?,
            )),
            _ => None,
        };
        Ok(EtcdSecurity { tls, user })
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
        let secret = |path: &PathBuf, what: &str| -> anyhow::Result<Secret> {
            Secret::from_file(path)
                .with_context(|| format!("reading the NATS {what} file {}", path.display()))
        };
        let given =
            (&self.nats_user, &self.nats_password_file, &self.nats_token_file, &self.nats_creds);
        Ok(match (given, &self.nats_nkey_file) {
            ((Some(user), Some(p), None, None), None) => {
                NatsAuth::UserPassword { user: user.clone(), password: secret(p, "password")? }
            }
            ((None, None, Some(t), None), None) => NatsAuth::Token(secret(t, "token")?),
            ((None, None, None, Some(c)), None) => NatsAuth::CredsFile(c.clone()),
            ((None, None, None, None), Some(k)) => NatsAuth::NKey(secret(k, "NKey seed")?),
            ((None, None, None, None), None) => NatsAuth::None,
            _ => anyhow::bail!(
                "give one kind of NATS credentials: --nats-user with --nats-password-file, \
                 --nats-token-file, --nats-creds or --nats-nkey-file"
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
        env.extend(self.etcd_user.clone().map(|u| ("KVFABRIC_ETCD_USER".to_string(), u)));
        for (var, path) in [
            ("KVFABRIC_NATS_PASSWORD_FILE", &self.nats_password_file),
            ("KVFABRIC_NATS_TOKEN_FILE", &self.nats_token_file),
            ("KVFABRIC_NATS_CREDS", &self.nats_creds),
            ("KVFABRIC_NATS_NKEY_FILE", &self.nats_nkey_file),
            ("KVFABRIC_NATS_CA", &self.nats_ca),
            ("KVFABRIC_NATS_CERT", &self.nats_cert),
            ("KVFABRIC_NATS_KEY", &self.nats_key),
            ("KVFABRIC_ETCD_CA", &self.etcd_ca),
            ("KVFABRIC_ETCD_CERT", &self.etcd_cert),
            ("KVFABRIC_ETCD_KEY", &self.etcd_key),
            ("KVFABRIC_ETCD_PASSWORD_FILE", &self.etcd_password_file),
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
    etcd_security: EtcdSecurity,
    nats: Option<&str>,
    auth: NatsAuth,
    nats_tls: NatsTls,
    replicas: Option<usize>,
    namespace: &str,
) -> anyhow::Result<(Arc<dyn Discovery>, Arc<dyn EventBus>)> {
    let discovery: Arc<dyn Discovery> = if etcd.is_empty() {
        tracing::info!("discovery: embedded (this process only)");
        Arc::new(MemoryDiscovery::new())
    } else {
        let (tls, user) = (etcd_security.tls.is_some(), etcd_security.user.is_some());
        let d = EtcdDiscovery::connect_with(etcd, namespace, etcd_security).await?;
        tracing::info!(endpoints = ?etcd, namespace, tls, authenticated = user, "discovery: etcd");
        Arc::new(d)
    };
    let bus: Arc<dyn EventBus> = match nats {
        Some(urls) => {
            let tls = nats_tls.ca.is_some();
            let mut b = NatsBus::connect_secure(urls, auth, nats_tls, namespace).await?;
            if let Some(r) = replicas {
                b = b.with_replicas(r);
            }
            // Logged without the credentials a URL may carry.
            let (servers, authenticated) = (b.servers(), b.authenticated());
            tracing::info!(%servers, namespace, authenticated, tls, queue_replicas = b.replicas(),
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
