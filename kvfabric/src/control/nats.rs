//! The event bus on NATS (feature `nats`): topic `T` of namespace `N` is the subject
//! `kvfabric.N.T`; work queue `Q` is a JetStream stream `KVFABRIC_N_Q` with work-queue
//! retention on the subject `kvfabric.N.queue.Q`, consumed through one durable pull consumer
//! with explicit acknowledgements (at least once). The client reconnects by itself after a
//! server restart and re-establishes its subscriptions; the streams live in the server's
//! store directory and survive the restart.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use tokio::sync::mpsc;

use super::{check_name, Acker, ControlError, ControlFuture, EventBus, WorkItem};

fn backend(e: impl std::fmt::Display) -> ControlError {
    ControlError::Backend { backend: "nats", message: e.to_string() }
}

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the client pings its server.
const PING_INTERVAL: Duration = Duration::from_secs(3);

/// The event bus backed by a NATS server with JetStream.
#[derive(Clone)]
pub struct NatsBus {
    client: async_nats::Client,
    js: jetstream::Context,
    namespace: String,
    connections: tokio::sync::watch::Receiver<u64>,
    health: std::sync::Arc<super::health::BackendHealth>,
    /// The servers, without the credentials a URL carried (what may be logged).
    servers: String,
    /// Whether it connected with credentials.
    authenticated: bool,
    /// Copies of each work queue (None: as many as the cluster has servers, at most 3).
    replicas: Option<usize>,
    /// How many servers were named (a cluster's size before the servers gossip it).
    named: usize,
    /// Work queues whose stream this process made sure of (their replicas included).
    ensured: std::sync::Arc<parking_lot::Mutex<std::collections::HashSet<String>>>,
}

/// Replicas of a work queue when not configured: one per server of the cluster, at most 3.
pub const DEFAULT_REPLICAS_MAX: usize = 3;

impl std::fmt::Debug for NatsBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBus")
            .field("servers", &self.servers)
            .field("namespace", &self.namespace)
            .finish()
    }
}

/// How a client proves who it is to the NATS servers. Its `Debug` never shows a secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A user name and password (`nats://user:password@host`, or given apart).
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: crate::secret::Secret,
    },
    /// A token (`nats://token@host`, or given apart).
    Token(crate::secret::Secret),
    /// A credentials file (`.creds`: a user JWT and its NKey seed, as `nsc` writes them).
    CredsFile(std::path::PathBuf),
    /// An NKey seed (`SU...`): the client signs the server's nonce with it.
    NKey(crate::secret::Secret),
}

/// TLS to the NATS servers: the CA that signed their certificates, and this client's
/// certificate when the servers verify clients (`verify: true`). With a CA, TLS is required:
/// a server that does not offer it is refused, never used in the clear.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// The CA (PEM).
    pub ca: Option<std::path::PathBuf>,
    /// The client certificate and its key (PEM).
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::UserPassword { user, .. } => write!(f, "UserPassword({user:?}, ***)"),
            NatsAuth::Token(_) => f.write_str("Token(***)"),
            NatsAuth::CredsFile(p) => write!(f, "CredsFile({})", p.display()),
            NatsAuth::NKey(_) => f.write_str("NKey(***)"),
        }
    }
}

/// The servers of a NATS URL list (comma-separated, `nats://[user[:password]@]host[:port]`)
/// without their credentials, and the credentials they carried (percent-decoded): the URLs
/// that the client library, logs and child processes see hold no secret. Every URL that
/// carries credentials must carry the same.
pub fn split_credentials(urls: &str) -> Result<(String, NatsAuth), ControlError> {
    let bad = |why: &str| ControlError::Backend { backend: "nats", message: why.to_string() };
    let mut servers = Vec::new();
    let mut auth = NatsAuth::None;
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let (scheme, rest) = match url.split_once("://") {
            Some((scheme, rest)) => (Some(scheme), rest),
            None => (None, url),
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        let (userinfo, host) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        if host.is_empty() {
            return Err(bad("a NATS URL without a host"));
        }
        let this = match userinfo {
            None => NatsAuth::None,
            Some(u) => match u.split_once(':') {
                Some((user, password)) => NatsAuth::UserPassword {
                    user: percent_decode(user).map_err(bad)?,
                    password: percent_decode(password).map_err(bad)?.into(),
                },
                None => NatsAuth::Token(percent_decode(u).map_err(bad)?.into()),
            },
        };
        match (&auth, &this) {
            (_, NatsAuth::None) => {}
            (NatsAuth::None, _) => auth = this,
            (a, b) if a == b => {}
            _ => return Err(bad("the NATS URLs carry different credentials")),
        }
        servers.push(match scheme {
            Some(scheme) => format!("{scheme}://{host}{path}"),
            None => format!("{host}{path}"),
        });
    }
    if servers.is_empty() {
        return Err(bad("no NATS server URL"));
    }
    Ok((servers.join(","), auth))
}

/// `%XX` escapes decoded (URL userinfo).
fn percent_decode(s: &str) -> Result<String, &'static str> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let b = hex
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or("a malformed %-escape in the NATS URL's credentials")?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "the NATS URL's credentials are not UTF-8")
}

impl NatsBus {
    /// Connects to `url` (such as `nats://127.0.0.1:4222`, or with credentials,
    /// `nats://user:password@host:4222`).
    pub async fn connect(url: &str, namespace: &str) -> Result<Self, ControlError> {
        Self::connect_with(url, NatsAuth::None, namespace).await
    }

    /// [`Self::connect_secure`] without TLS.
    pub async fn connect_with(
        urls: &str,
        auth: NatsAuth,
        namespace: &str,
    ) -> Result<Self, ControlError> {
        Self::connect_secure(urls, auth, NatsTls::default(), namespace).await
    }

    /// Connects to the servers of `urls` with `auth`, or with the credentials the URLs carry
    /// (not both). Neither the client library nor kvfabric's logs see a secret in a URL.
    pub async fn connect_secure(
        urls: &str,
        auth: NatsAuth,
        tls: NatsTls,
        namespace: &str,
    ) -> Result<Self, ControlError> {
        check_name(namespace)?;
        let (servers, in_url) = split_credentials(urls)?;
        let auth = match (auth, in_url) {
            (a, NatsAuth::None) => a,
            (NatsAuth::None, u) => u,
            _ => {
                return Err(ControlError::Backend {
                    backend: "nats",
                    message: "credentials both in the NATS URL and given apart: give them once"
                        .into(),
                })
            }
        };
        let (tx, connections) = tokio::sync::watch::channel(0u64);
        let tx = std::sync::Arc::new(tx);
        let health = std::sync::Arc::new(super::health::BackendHealth::new("nats"));
        let h = health.clone();
        // A server cut off the network sends no FIN: only unanswered pings tell. The client
        // gives up after two, so a dead server is left within about twice this (60 s by
        // default, minutes of lost events), for another of the cluster.
        let options = async_nats::ConnectOptions::new().ping_interval(PING_INTERVAL);
        let options = options.event_callback(move |event| {
            let (tx, health) = (tx.clone(), h.clone());
            async move {
                match event {
                    async_nats::Event::Connected => {
                        // The first connection is the caller's to report; later ones are
                        // recoveries (logged and counted by `health`).
                        health.reached();
                        tx.send_modify(|n| *n += 1);
                    }
                    async_nats::Event::Disconnected => {
                        health.lost("NATS connection lost; reconnecting");
                    }
                    async_nats::Event::SlowConsumer(_) => {
                        // The client dropped a message for a subscription this process did
                        // not read fast enough.
                        health.events_dropped(1);
                    }
                    async_nats::Event::ServerError(e) => {
                        tracing::warn!(error = %e, "NATS server error");
                    }
                    async_nats::Event::ClientError(e) => {
                        tracing::warn!(error = %e, "NATS client error");
                    }
                    _ => {}
                }
            }
        });
        let authenticated = auth != NatsAuth::None;
        let text = |s: &crate::secret::Secret, what: &str| {
            s.expose_str().map(str::to_string).ok_or_else(|| ControlError::Backend {
                backend: "nats",
                message: format!("the NATS {what} is not UTF-8"),
            })
        };
        let options = match auth {
            NatsAuth::None => options,
            NatsAuth::UserPassword { user, password } => {
                options.user_and_password(user, text(&password, "password")?)
            }
            NatsAuth::Token(token) => options.token(text(&token, "token")?),
            NatsAuth::NKey(seed) => options.nkey(text(&seed, "NKey seed")?),
            NatsAuth::CredsFile(path) => {
                options.credentials_file(&path).await.map_err(|e| ControlError::Backend {
                    backend: "nats",
                    message: format!("the NATS credentials file {}: {e}", path.display()),
                })?
            }
        };
        let options = match &tls.ca {
            None => {
                if tls.identity.is_some() {
                    return Err(ControlError::Backend {
                        backend: "nats",
                        message: "a NATS client certificate needs the CA of the servers too \
                                  (--nats-ca)"
                            .into(),
                    });
                }
                options
            }
            Some(ca) => {
                // Checked here, so that a missing file or an expired certificate is a clear
                // error at start rather than the client library's retries.
                crate::tls::client_config(
                    ca,
                    tls.identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
                )
                .map_err(|e| ControlError::Backend { backend: "nats", message: e.to_string() })?;
                let options = options.require_tls(true).add_root_certificates(ca.clone());
                match &tls.identity {
                    Some((cert, key)) => options.add_client_certificate(cert.clone(), key.clone()),
                    None => options,
                }
            }
        };
        // A list, not the joined string: the client library parses a string as one URL.
        let list: Vec<&str> = servers.split(',').collect();
        let client = tokio::time::timeout(CALL_TIMEOUT, options.connect(list.as_slice()))
            .await
            .map_err(|_| ControlError::Timeout("nats connect"))?
            .map_err(backend)?;
        let js = jetstream::new(client.clone());
        tracing::debug!(%servers, "connected to NATS");
        let namespace = namespace.to_string();
        let named = servers.split(',').filter(|s| !s.trim().is_empty()).count();
        Ok(NatsBus {
            client,
            js,
            namespace,
            connections,
            health,
            servers,
            authenticated,
            replicas: None,
            named,
            ensured: Default::default(),
        })
    }

    /// Keeps `n` copies of each work queue, on as many servers (JetStream refuses more
    /// than the cluster has).
    pub fn with_replicas(mut self, n: usize) -> Self {
        self.replicas = Some(n.max(1));
        self
    }

    /// Copies of each work queue it creates: as configured, else one per server of the NATS
    /// cluster (the servers named, or as many as the server says the cluster has), at most
    /// [`DEFAULT_REPLICAS_MAX`]; 1 for a server that is not in a cluster.
    pub fn replicas(&self) -> usize {
        if let Some(n) = self.replicas {
            return n;
        }
        let info = self.client.server_info();
        if info.cluster.is_none() {
            return 1;
        }
        let gossiped: std::collections::HashSet<_> = info.connect_urls.iter().collect();
        gossiped.len().max(self.named).clamp(1, DEFAULT_REPLICAS_MAX)
    }

    /// The servers it connected to, without the credentials a URL carried.
    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// Whether it connected with credentials (a user, a token or a credentials file).
    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    fn subject(&self, topic: &str) -> String {
        format!("kvfabric.{}.{}", self.namespace, topic)
    }

    async fn stream(&self, queue: &str) -> Result<stream::Stream, ControlError> {
        let replicas = self.replicas();
        let cfg = stream::Config {
            name: format!("KVFABRIC_{}_{}", self.namespace, queue),
            subjects: vec![format!("kvfabric.{}.queue.{}", self.namespace, queue)],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        };
        let name = cfg.name.clone();
        let stream = tokio::time::timeout(CALL_TIMEOUT, self.js.get_or_create_stream(cfg.clone()))
            .await
            .map_err(|_| ControlError::Timeout("nats stream"))?
            .map_err(backend)?;
        if self.ensured.lock().contains(&name) {
            return Ok(stream);
        }
        // A queue made by an older process (or before the cluster grew) may have fewer
        // copies than asked for: losing one server would lose it. Scale it up, once.
        let had = stream.cached_info().config.num_replicas;
        if had < replicas {
            tokio::time::timeout(CALL_TIMEOUT, self.js.update_stream(cfg))
                .await
                .map_err(|_| ControlError::Timeout("nats stream update"))?
                .map_err(|e| backend(format!("raising {name} to {replicas} replicas: {e}")))?;
            tracing::info!(stream = %name, from = had, to = replicas, "work queue replicas raised");
        }
        self.ensured.lock().insert(name);
        Ok(stream)
    }

    /// The replicas the stream of `queue` has now (None: no such stream).
    pub async fn queue_replicas(&self, queue: &str) -> Result<Option<usize>, ControlError> {
        let name = format!("KVFABRIC_{}_{}", self.namespace, queue);
        match tokio::time::timeout(CALL_TIMEOUT, self.js.get_stream(&name)).await {
            Err(_) => Err(ControlError::Timeout("nats stream info")),
            Ok(Ok(mut s)) => {
                let info = tokio::time::timeout(CALL_TIMEOUT, s.info())
                    .await
                    .map_err(|_| ControlError::Timeout("nats stream info"))?
                    .map_err(backend)?;
                Ok(Some(info.config.num_replicas))
            }
            Ok(Err(e))
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                Ok(None)
            }
            Ok(Err(e)) => Err(backend(e)),
        }
    }
}

#[derive(Debug)]
struct NatsAck(jetstream::Message);

impl Acker for NatsAck {
    fn ack(self: Box<Self>) -> ControlFuture<'static, ()> {
        // Acknowledged by the server before returning: an ack lost on the way would mean a
        // redelivery of work that was done.
        Box::pin(async move {
            tokio::time::timeout(CALL_TIMEOUT, self.0.double_ack())
                .await
                .map_err(|_| ControlError::Timeout("nats ack"))?
                .map_err(backend)
        })
    }
}

impl EventBus for NatsBus {
    fn connections(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.connections.clone())
    }

    fn status(&self) -> crate::health::ControlHealth {
        let state = self.client.connection_state();
        if state == async_nats::connection::State::Connected {
            // A live connection is contact now (the client pings the server to keep it so).
            self.health.reached();
        } else {
            self.health.lost(format!("NATS connection {state}"));
        }
        self.health.status()
    }

    fn publish<'a>(&'a self, topic: &'a str, payload: Vec<u8>) -> ControlFuture<'a, ()> {
        Box::pin(async move {
            check_name(topic)?;
            self.client.publish(self.subject(topic), payload.into()).await.map_err(backend)
        })
    }

    fn subscribe<'a>(&'a self, topic: &'a str) -> ControlFuture<'a, mpsc::Receiver<Vec<u8>>> {
        Box::pin(async move {
            check_name(topic)?;
            let mut sub = self.client.subscribe(self.subject(topic)).await.map_err(backend)?;
            // Make sure the server registered the subscription before returning, so that
            // a publish right after `subscribe` is seen.
            tokio::time::timeout(CALL_TIMEOUT, self.client.flush())
                .await
                .map_err(|_| ControlError::Timeout("nats flush"))?
                .map_err(backend)?;
            let (tx, rx) = mpsc::channel(super::memory::SUBSCRIBER_BUFFER);
            self.health.track_subscription(&tx);
            tokio::spawn(async move {
                while let Some(msg) = sub.next().await {
                    if tx.send(msg.payload.to_vec()).await.is_err() {
                        return;
                    }
                }
            });
            Ok(rx)
        })
    }

    fn enqueue<'a>(&'a self, queue: &'a str, payload: Vec<u8>) -> ControlFuture<'a, ()> {
        Box::pin(async move {
            check_name(queue)?;
            self.stream(queue).await?;
            let subject = format!("kvfabric.{}.queue.{}", self.namespace, queue);
            let ack = self.js.publish(subject, payload.into()).await.map_err(backend)?;
            tokio::time::timeout(CALL_TIMEOUT, ack)
                .await
                .map_err(|_| ControlError::Timeout("nats publish ack"))?
                .map_err(backend)?;
            Ok(())
        })
    }

    fn dequeue<'a>(
        &'a self,
        queue: &'a str,
        wait: Duration,
        ack_wait: Duration,
    ) -> ControlFuture<'a, Option<WorkItem>> {
        Box::pin(async move {
            check_name(queue)?;
            let stream = self.stream(queue).await?;
            // One durable consumer per acknowledgement deadline: an existing consumer keeps
            // the ack_wait it was created with.
            let name = format!("workers-{}ms", ack_wait.as_millis());
            let consumer: consumer::PullConsumer = stream
                .get_or_create_consumer(
                    &name,
                    consumer::pull::Config {
                        durable_name: Some(name.clone()),
                        ack_policy: consumer::AckPolicy::Explicit,
                        ack_wait,
                        ..Default::default()
                    },
                )
                .await
                .map_err(backend)?;
            let mut batch = consumer
                .fetch()
                .max_messages(1)
                .expires(wait.max(Duration::from_millis(100)))
                .messages()
                .await
                .map_err(backend)?;
            match tokio::time::timeout(wait + CALL_TIMEOUT, batch.next()).await {
                Ok(Some(Ok(msg))) => {
                    let deliveries = msg.info().map(|i| i.delivered.max(1) as u64).unwrap_or(1);
                    let payload = msg.payload.to_vec();
                    Ok(Some(WorkItem { payload, deliveries, acker: Box::new(NatsAck(msg)) }))
                }
                Ok(Some(Err(e))) => Err(backend(e)),
                Ok(None) | Err(_) => Ok(None),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_out_of_the_urls() {
        let (servers, auth) = split_credentials("nats://127.0.0.1:4222").unwrap();
        assert_eq!((servers.as_str(), auth), ("nats://127.0.0.1:4222", NatsAuth::None));
        let (servers, auth) =
            split_credentials("nats://kv%40fabric:p%3Ass@a:4222, nats://kv%40fabric:p%3Ass@b")
                .unwrap();
        assert_eq!(servers, "nats://a:4222,nats://b");
        let want = NatsAuth::UserPassword { user: "kv@fabric".into(), password: "p:ss".into() };
        assert_eq!(auth, want);
        assert!(!format!("{auth:?}").contains("p:ss"), "{auth:?}");
        let (servers, auth) = split_credentials("tls://s3cr3t@h:4443/x").unwrap();
        assert_eq!((servers.as_str(), auth), ("tls://h:4443/x", NatsAuth::Token("s3cr3t".into())));
        assert_eq!(format!("{:?}", NatsAuth::Token("s3cr3t".into())), "Token(***)");
        // Without a scheme, and one URL with credentials among others without.
        let (servers, auth) = split_credentials("u:p@h:1,h2:2").unwrap();
        assert_eq!(servers, "h:1,h2:2");
        assert!(matches!(auth, NatsAuth::UserPassword { .. }));
        for bad in ["nats://a:b@h,nats://c:d@h", "nats://u:%zz@h", "nats://u:p@", ""] {
            assert!(split_credentials(bad).is_err(), "{bad}");
        }
    }
}
