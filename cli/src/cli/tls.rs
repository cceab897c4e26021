//! TLS and secrets as the commands take them: the certificate flags every serving command
//! shares, their reload on SIGHUP, and the secrets read from files (`…_FILE`) or warned
//! about when given on the command line.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use kvfabric::tls::{Tls, TlsFiles};

/// The process's certificates. With `--tls-cert` and `--tls-key`, its API and metrics ports
/// serve HTTPS only; with `--tls-ca` as well, every connection between kvfabric processes
/// (request ports, transfer stripes, fabric nodes, peer pulls) is mutual TLS with that CA,
/// and plaintext peers are refused.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// This process's certificate chain (PEM, leaf first). Reloaded on SIGHUP.
    #[arg(long, env = "KVFABRIC_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "KVFABRIC_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The deployment CA (PEM): mutual TLS between kvfabric processes. Each process's
    /// certificate must name the IP address it advertises (a subject alternative name).
    #[arg(long, env = "KVFABRIC_TLS_CA", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// API and metrics clients must present a certificate signed by this CA (PEM).
    #[arg(long, env = "KVFABRIC_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The process's TLS, loaded and reloaded on SIGHUP (None: no certificates given). An
    /// expired certificate, a key that is not its own or an unreadable file is an error here.
    pub fn load(&self) -> anyhow::Result<Option<Arc<Tls>>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(None) };
        let tls = Tls::load(TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: self.tls_ca.clone(),
            client_ca: self.tls_client_ca.clone(),
        })
        .context("--tls-cert/--tls-key")?;
        tracing::info!(cert = %cert.display(), mutual = tls.mutual(),
            valid_until = %kvfabric::tls::utc(tls.not_after()),
            "TLS: HTTPS on the API and metrics ports{}",
            if tls.mutual() { ", mutual TLS between processes" } else { "" });
        reload_on_hangup(tls.clone());
        Ok(Some(tls))
    }

    /// The environment that gives a child process (the planner's workers) these files.
    pub fn child_env(&self) -> Vec<(String, String)> {
        [
            ("KVFABRIC_TLS_CERT", &self.tls_cert),
            ("KVFABRIC_TLS_KEY", &self.tls_key),
            ("KVFABRIC_TLS_CA", &self.tls_ca),
            ("KVFABRIC_TLS_CLIENT_CA", &self.tls_client_ca),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|p| (k.to_string(), p.display().to_string())))
        .collect()
    }
}

/// `http` or `https`, as the process serves.
pub fn scheme(tls: &Option<Arc<Tls>>) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

/// Reloads the certificates on each SIGHUP: new connections get them, open ones keep theirs;
/// a reload that fails keeps the certificates in use, and says why.
fn reload_on_hangup(tls: Arc<Tls>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP: certificates are not reloaded");
        return;
    };
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            match tls.reload() {
                Ok(()) => tracing::info!(valid_until = %kvfabric::tls::utc(tls.not_after()),
                    "TLS certificates reloaded"),
                Err(e) => tracing::warn!(error = %e,
                    "TLS certificates not reloaded; the ones in use stay"),
            }
        }
    });
}

/// The secrets that may come from a file: `VAR_FILE` names a file whose text (without its
/// trailing line break) is the value of `VAR`, unless the flag or `VAR` gives it.
const SECRET_VARS: [(&str, &str); 2] =
    [("KVFABRIC_SECRET", "--secret"), ("KVFABRIC_API_KEY", "--api-key")];

/// Applies `KVFABRIC_SECRET_FILE` and `KVFABRIC_API_KEY_FILE` (a container secret such as
/// `/run/secrets/kvfabric`, so that it is in no process listing or environment dump of the
/// orchestrator). An empty or unreadable file is an error. Must run before parsing, on the
/// main thread, before any other thread exists.
pub fn apply_secret_files() -> anyhow::Result<()> {
    for (var, flag) in SECRET_VARS {
        let file_var = format!("{var}_FILE");
        let Some(path) = std::env::var_os(&file_var) else { continue };
        let on_command_line =
            std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        if on_command_line || std::env::var_os(var).is_some() {
            continue;
        }
        let path = PathBuf::from(path);
        let secret = kvfabric::secret::Secret::from_file(&path)
            .with_context(|| format!("reading {file_var} {}", path.display()))?;
        let text = secret
            .expose_str()
            .with_context(|| format!("{file_var} {}: not UTF-8", path.display()))?;
        // Single-threaded here (before the runtime starts): nothing reads the environment
        // concurrently.
        std::env::set_var(var, text);
    }
    Ok(())
}

/// Warns once, at start, about secrets given on the command line, which every local user
/// can read (`ps`): the flags, not their values.
pub fn warn_secrets_on_command_line() {
    let args: Vec<String> = std::env::args().collect();
    let mut given: Vec<&str> = SECRET_VARS
        .iter()
        .map(|(_, flag)| *flag)
        .filter(|flag| args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}="))))
        .collect();
    let nats_with_credentials = args.iter().enumerate().any(|(i, a)| {
        let value = a
            .strip_prefix("--nats=")
            .or_else(|| (a == "--nats").then(|| args.get(i + 1).map(String::as_str)).flatten());
        value.is_some_and(|v| v.contains('@'))
    });
    if nats_with_credentials {
        given.push("--nats (credentials in the URL)");
    }
    if !given.is_empty() {
        tracing::warn!(flags = ?given,
            "secrets on the command line can be read by every user of this machine (ps); \
             give them in files instead (KVFABRIC_SECRET_FILE, KVFABRIC_API_KEY_FILE, \
             --nats-password-file, --etcd-password-file)");
    }
}
