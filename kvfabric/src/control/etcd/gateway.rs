//! A minimal client of etcd's v3 API over its HTTP/JSON gateway (`POST /v3/...`), which every
//! etcd server since 3.4 serves on its client port next to gRPC.
//!
//! Why not gRPC: the gRPC client crates generate their code from etcd's `.proto` files at
//! build time, which needs `protoc` and protobuf's well-known types installed on the building
//! machine. kvfabric uses six unary calls and one stream; over HTTP/1.1 with hyper (already in
//! the tree) they need no system package to build.
//!
//! The JSON mapping is protobuf's: `bytes` fields are base64, 64-bit integers are strings,
//! fields holding their default value are omitted. A server stream (`/v3/watch`,
//! `/v3/lease/keepalive`) is a sequence of `{"result": ...}` objects.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

use crate::control::ControlError;

/// The most bytes one response (or one message of a stream) may hold.
const MAX_MESSAGE: usize = 32 << 20;

fn backend(message: impl Into<String>) -> ControlError {
    ControlError::Backend { backend: "etcd", message: message.into() }
}

fn malformed(message: impl std::fmt::Display) -> ControlError {
    ControlError::Malformed { what: "etcd response", message: message.to_string() }
}

/// Base64, as protobuf's JSON mapping writes `bytes`.
pub(crate) fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The key just past every key that starts with `prefix` (etcd's `range_end` for a prefix).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

/// An int64 field: protobuf's JSON mapping writes it as a string, but accepts a number.
fn de_i64<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int {
        S(String),
        N(i64),
    }
    match Int::deserialize(d)? {
        Int::N(n) => Ok(n),
        Int::S(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

/// A `bytes` field, base64.
fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    base64::engine::general_purpose::STANDARD.decode(s).map_err(serde::de::Error::custom)
}

/// The header of every response.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "de_i64")]
    pub revision: i64,
}

/// A key and its value.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct KeyValue {
    #[serde(default, deserialize_with = "de_bytes")]
    pub key: Vec<u8>,
    #[serde(default, deserialize_with = "de_bytes")]
    pub value: Vec<u8>,
    #[serde(default, deserialize_with = "de_i64")]
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    #[serde(default, deserialize_with = "de_i64")]
    pub lease: i64,
}

/// One answer of a transaction's branch.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ResponseOp {
    #[serde(default, alias = "responseRange")]
    pub response_range: Option<RangeResponse>,
}

/// `/v3/kv/txn`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct TxnResponse {
    #[serde(default)]
    pub succeeded: bool,
    #[serde(default)]
    pub responses: Vec<ResponseOp>,
}

/// `/v3/kv/range`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct RangeResponse {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub kvs: Vec<KeyValue>,
}

/// `/v3/lease/grant` and `/v3/lease/keepalive`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LeaseResponse {
    #[serde(default, rename = "ID", deserialize_with = "de_i64")]
    pub id: i64,
    /// Seconds left; 0 or less when the lease does not exist.
    #[serde(default, rename = "TTL", deserialize_with = "de_i64")]
    pub ttl: i64,
    /// Set by a grant the server refused.
    #[serde(default)]
    pub error: String,
}

/// One event of a watch.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchEvent {
    /// `DELETE`, or absent (the default, `PUT`).
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub kv: KeyValue,
}

/// One message of `/v3/watch`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct WatchResponse {
    #[serde(default)]
    pub canceled: bool,
    #[serde(default, deserialize_with = "de_i64")]
    pub compact_revision: i64,
    #[serde(default)]
    pub events: Vec<WatchEvent>,
}

/// `/v3/maintenance/status`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct StatusResponse {
    #[serde(default)]
    pub version: String,
}

/// A stream's envelope: a result, or the error that ended it.
#[derive(Debug, Deserialize)]
struct StreamItem<T> {
    result: Option<T>,
    error: Option<serde_json::Value>,
}

/// The error body of a failed call.
#[derive(Debug, Deserialize)]
struct ErrorBody {
    #[serde(default)]
    message: String,
    #[serde(default)]
    error: String,
}

/// How long a connection to one endpoint may take before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How a client reaches etcd securely: TLS (a CA, and a client certificate when etcd asks
/// for one) for `https://` endpoints, and etcd's user/password authentication.
#[derive(Debug, Clone, Default)]
pub struct EtcdSecurity {
    /// The client configuration of `https://` endpoints (trusting the CA that signed etcd's
    /// certificates; presenting a client certificate if given one).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// A user and password of etcd's authentication (`etcdctl auth enable`).
    pub user: Option<(String, crate::secret::Secret)>,
}

/// Client endpoints (`host:port` authorities), tried in turn from the last that answered.
#[derive(Debug, Clone)]
pub(crate) struct Gateway {
    endpoints: Arc<[String]>,
    current: Arc<AtomicUsize>,
    timeout: Duration,
    /// Whether etcd answers, shared by every clone (the process's view of it).
    health: Arc<crate::control::health::BackendHealth>,
    /// TLS to every endpoint (all `https://`), or none (all `http://`).
    tls: Option<Arc<rustls::ClientConfig>>,
    user: Option<Arc<(String, crate::secret::Secret)>>,
    /// The authentication token in use (etcd's simple tokens expire when unused for five
    /// minutes by default: a call refused for its token authenticates again once).
    token: Arc<parking_lot::RwLock<Option<crate::secret::Secret>>>,
}

impl Gateway {
    /// `endpoints` as `http://host:port`, `https://host:port` or `host:port` (http); https
    /// needs `security.tls`, and every endpoint must use the same scheme.
    pub fn new(
        endpoints: &[String],
        timeout: Duration,
        security: EtcdSecurity,
    ) -> Result<Self, ControlError> {
        let mut out = Vec::new();
        let mut schemes = std::collections::HashSet::new();
        for e in endpoints {
            let e = e.trim();
            let (https, authority) = match e.strip_prefix("https://") {
                Some(rest) => (true, rest),
                None => (false, e.strip_prefix("http://").unwrap_or(e)),
            };
            let authority = authority.trim_end_matches('/');
            if authority.is_empty() || authority.contains('/') || authority.contains('@') {
                return Err(backend(format!(
                    "{e:?} is not an etcd endpoint (http[s]://host:port)"
                )));
            }
            schemes.insert(https);
            out.push(authority.to_string());
        }
        if out.is_empty() {
            return Err(backend("no etcd endpoint given"));
        }
        if schemes.len() > 1 {
            return Err(backend("etcd endpoints mix http:// and https://: give one scheme"));
        }
        let https = schemes.contains(&true);
        let tls =
            match (https, security.tls) {
                (true, None) => return Err(backend(
                    "https etcd endpoints need the CA that signed etcd's certificate (--etcd-ca)",
                )),
                (false, Some(_)) => {
                    return Err(backend(
                        "etcd TLS options given, but the endpoints are http://: use https:// to \
                     reach etcd over TLS (never in the clear by mistake)",
                    ))
                }
                (_, t) => t,
            };
        Ok(Gateway {
            endpoints: out.into(),
            current: Arc::new(AtomicUsize::new(0)),
            timeout,
            health: Arc::new(crate::control::health::BackendHealth::new("etcd")),
            tls,
            user: security.user.map(Arc::new),
            token: Arc::default(),
        })
    }

    /// Authenticates with etcd's user/password (when configured), keeping the token for the
    /// calls that follow. A wrong password is a clear error.
    pub async fn authenticate(&self) -> Result<(), ControlError> {
        let Some(user) = self.user.clone() else { return Ok(()) };
        let password =
            user.1.expose_str().ok_or_else(|| backend("the etcd password is not UTF-8"))?;
        let req = serde_json::json!({ "name": user.0, "password": password });
        #[derive(Deserialize)]
        struct Auth {
            #[serde(default)]
            token: String,
        }
        *self.token.write() = None;
        let auth: Auth = tokio::time::timeout(self.timeout, async {
            let (resp, conn) = self
                .open("/v3/auth/authenticate", &req)
                .await
                .map_err(|e| backend(format!("authenticating to etcd as {:?}: {e}", user.0)))?;
            let bytes = read_limited(resp.into_body()).await;
            conn.abort();
            serde_json::from_slice::<Auth>(&bytes?).map_err(malformed)
        })
        .await
        .map_err(|_| self.timed_out("etcd authenticate"))??;
        if auth.token.is_empty() {
            return Err(backend(format!(
                "etcd gave no token to {:?}: is authentication enabled (etcdctl auth enable)?",
                user.0
            )));
        }
        *self.token.write() = Some(crate::secret::Secret::from(auth.token));
        Ok(())
    }

    /// This process's view of etcd's health.
    pub fn health(&self) -> &crate::control::health::BackendHealth {
        &self.health
    }

    fn reached(&self, outcome: Result<(), &ControlError>) {
        match outcome {
            Ok(()) => self.health.reached(),
            Err(e) => self.health.lost(e),
        }
    }

    async fn send(
        &self,
        authority: &str,
        path: &str,
        body: Bytes,
    ) -> Result<(hyper::Response<Incoming>, tokio::task::JoinHandle<()>), ControlError> {
        // A member on a host that is cut off answers no SYN: without a bound, the kernel
        // retries for about two minutes before the next endpoint is tried (and a lease of a
        // few seconds runs out meanwhile).
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(authority))
            .await
            .map_err(|_| backend(format!("{authority}: no connection within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| backend(format!("{authority}: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let stream = match &self.tls {
            None => crate::tls::Stream::Plain(tcp),
            Some(config) => {
                let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let name = rustls::pki_types::ServerName::try_from(host.to_string())
                    .map_err(|e| backend(format!("{authority}: {e}")))?;
                let connect = tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp);
                match tokio::time::timeout(CONNECT_TIMEOUT.max(self.timeout / 2), connect).await {
                    Ok(Ok(s)) => crate::tls::Stream::Client(Box::new(s)),
                    Ok(Err(e)) => {
                        return Err(backend(format!(
                            "TLS with etcd at {authority}: {}",
                            crate::tls::explain(&e)
                        )))
                    }
                    Err(_) => {
                        return Err(backend(format!("TLS with etcd at {authority}: timed out")))
                    }
                }
            }
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| backend(format!("{authority}: {e}")))?;
        // The connection's own error says why a request was cancelled (a TLS alert).
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel();
        let conn = tokio::spawn(async move {
            if let Err(e) = conn.await {
                let _ = failed_tx.send(e);
            }
        });
        let mut req = hyper::Request::post(path)
            .header(hyper::header::HOST, authority)
            .header(hyper::header::CONTENT_TYPE, "application/json");
        if let Some(token) = self.token.read().as_ref().and_then(|t| t.expose_str()) {
            let mut value = hyper::header::HeaderValue::from_str(token)
                .map_err(|_| backend("etcd gave a token that is not a header value"))?;
            value.set_sensitive(true);
            req = req.header(hyper::header::AUTHORIZATION, value);
        }
        let req = req.body(Full::new(body)).map_err(|e| backend(e.to_string()))?;
        match sender.send_request(req).await {
            Ok(resp) => Ok((resp, conn)),
            Err(e) => {
                let failed = tokio::time::timeout(Duration::from_millis(200), failed_rx)
                    .await
                    .ok()
                    .and_then(Result::ok);
                conn.abort();
                let cause = tls_cause(&e).or_else(|| failed.as_ref().and_then(|f| tls_cause(f)));
                Err(backend(match cause {
                    // TLS 1.3 servers refuse a client's certificate after the handshake.
                    Some(why) => format!("TLS with etcd at {authority}: {why}"),
                    // Closed with no cause to read: over TLS, most likely a refusal too.
                    None if self.tls.is_some()
                        && (e.is_canceled() || e.is_closed() || e.is_incomplete_message()) =>
                    {
                        format!(
                            "TLS with etcd at {authority}: the connection closed before an \
                             answer ({e}): etcd may have refused this client's certificate"
                        )
                    }
                    None => format!("{authority}{path}: {e}"),
                }))
            }
        }
    }

    /// Posts `req` to `path` on the first endpoint that answers; a response that is not 200
    /// becomes the server's error message.
    async fn open(
        &self,
        path: &str,
        req: &impl Serialize,
    ) -> Result<(hyper::Response<Incoming>, tokio::task::JoinHandle<()>), ControlError> {
        let body = Bytes::from(serde_json::to_vec(req).map_err(|e| backend(e.to_string()))?);
        let n = self.endpoints.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut last = backend("no etcd endpoint");
        for i in 0..n {
            let at = (first + i) % n;
            match self.send(&self.endpoints[at], path, body.clone()).await {
                Ok((resp, conn)) => {
                    self.current.store(at, Ordering::Relaxed);
                    self.reached(Ok(()));
                    if resp.status() != hyper::StatusCode::OK {
                        let status = resp.status();
                        let bytes = read_limited(resp.into_body()).await;
                        conn.abort();
                        let text = match bytes {
                            Ok(b) => match serde_json::from_slice::<ErrorBody>(&b) {
                                Ok(e) if e.message.is_empty() => e.error,
                                Ok(e) => e.message,
                                // Some refusals are plain text (bounded here).
                                Err(_) => String::from_utf8_lossy(&b[..b.len().min(300)])
                                    .trim()
                                    .to_string(),
                            },
                            Err(_) => String::new(),
                        };
                        let hint = if text.contains("user name is empty") {
                            " (etcd's authentication is on: give a user and its password, \
                             --etcd-user and --etcd-password-file)"
                        } else if text.contains("CommonName") {
                            " (with authentication on, etcd's HTTP gateway refuses client \
                             certificates that carry a Common Name: issue kvfabric's without one, \
                             names in the subject alternative names only)"
                        } else {
                            ""
                        };
                        return Err(backend(format!("{path}: {status} {text}{hint}")));
                    }
                    return Ok((resp, conn));
                }
                Err(e) => last = e,
            }
        }
        self.reached(Err(&last));
        Err(last)
    }

    /// [`Self::open`] with the authentication token; a call refused for its token (expired,
    /// or etcd restarted) authenticates again and is sent once more.
    async fn open_authenticated(
        &self,
        path: &str,
        req: &impl Serialize,
    ) -> Result<(hyper::Response<Incoming>, tokio::task::JoinHandle<()>), ControlError> {
        if self.user.is_some() && self.token.read().is_none() {
            self.authenticate().await?;
        }
        match self.open(path, req).await {
            Err(ControlError::Backend { message, .. })
                if self.user.is_some()
                    && (message.contains("invalid auth token")
                        || message.contains("user name is empty")) =>
            {
                self.authenticate().await?;
                self.open(path, req).await
            }
            other => other,
        }
    }

    /// A unary call, bounded by the gateway's timeout.
    pub async fn call<T: DeserializeOwned>(
        &self,
        what: &'static str,
        path: &str,
        req: &impl Serialize,
    ) -> Result<T, ControlError> {
        tokio::time::timeout(self.timeout, async {
            let (resp, conn) = self.open_authenticated(path, req).await?;
            let bytes = read_limited(resp.into_body()).await;
            conn.abort();
            serde_json::from_slice(&bytes?).map_err(malformed)
        })
        .await
        .map_err(|_| self.timed_out(what))?
    }

    fn timed_out(&self, what: &'static str) -> ControlError {
        let e = ControlError::Timeout(what);
        self.reached(Err(&e));
        e
    }

    /// Opens a server stream; the first message is awaited by the caller.
    pub async fn stream(
        &self,
        what: &'static str,
        path: &str,
        req: &impl Serialize,
    ) -> Result<JsonStream, ControlError> {
        let (resp, conn) = tokio::time::timeout(self.timeout, self.open_authenticated(path, req))
            .await
            .map_err(|_| self.timed_out(what))??;
        Ok(JsonStream { body: resp.into_body(), buf: Vec::new(), conn })
    }
}

/// The TLS failure beneath an HTTP error, in words, if there is one.
fn tls_cause(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cause = e.source();
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.get_ref().is_some_and(|i| i.is::<rustls::Error>()) {
                return Some(crate::tls::explain(io));
            }
        }
        cause = c.source();
    }
    None
}

async fn read_limited(body: Incoming) -> Result<Bytes, ControlError> {
    let limited = http_body_util::Limited::new(body, MAX_MESSAGE);
    Ok(limited.collect().await.map_err(|e| backend(e.to_string()))?.to_bytes())
}

/// The messages of a server stream: JSON objects one after another.
#[derive(Debug)]
pub(crate) struct JsonStream {
    body: Incoming,
    buf: Vec<u8>,
    conn: tokio::task::JoinHandle<()>,
}

impl Drop for JsonStream {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl JsonStream {
    /// The next result; None when the server ended the stream.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ControlError> {
        loop {
            if let Some(item) = next_value::<StreamItem<T>>(&mut self.buf)? {
                if let Some(err) = item.error {
                    return Err(backend(format!("stream ended: {err}")));
                }
                return item
                    .result
                    .map(Some)
                    .ok_or_else(|| malformed("stream item without result"));
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(backend(e.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if self.buf.len() + data.len() > MAX_MESSAGE {
                            return Err(malformed(format!(
                                "a stream message over {MAX_MESSAGE} bytes"
                            )));
                        }
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// Takes the first complete JSON value off `buf`; None while it is incomplete.
fn next_value<T: DeserializeOwned>(buf: &mut Vec<u8>) -> Result<Option<T>, ControlError> {
    let mut values = serde_json::Deserializer::from_slice(buf).into_iter::<T>();
    match values.next() {
        None => {
            buf.clear(); // whitespace only
            Ok(None)
        }
        Some(Err(e)) if e.is_eof() => Ok(None),
        Some(Err(e)) => Err(malformed(e)),
        Some(Ok(v)) => {
            let used = values.byte_offset();
            buf.drain(..used);
            Ok(Some(v))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn stream_values_are_split_whatever_the_chunking() {
        let text = br#"{"result":{"created":true}}
{"result":{"events":[{"kv":{"key":"L2EveA==","mod_revision":"2","value":"aGk="}},{"type":"DELETE","kv":{"key":"L2EveA==","mod_revision":"3"}}]}}
{"result":{"canceled":true,"compact_revision":"7"}}"#;
        for chunk in [1, 2, 7, 64, text.len()] {
            let mut buf = Vec::new();
            let mut got: Vec<WatchResponse> = Vec::new();
            for piece in text.chunks(chunk) {
                buf.extend_from_slice(piece);
                while let Some(item) = next_value::<StreamItem<WatchResponse>>(&mut buf).unwrap() {
                    got.push(item.result.unwrap());
                }
            }
            assert_eq!(got.len(), 3, "chunk {chunk}");
            assert_eq!(got[1].events[0].kv.key, b"/a/x");
            assert_eq!(got[1].events[0].kv.value, b"hi");
            assert_eq!(got[1].events[0].kv.mod_revision, 2);
            assert_eq!(got[1].events[0].kind, "");
            assert_eq!(got[1].events[1].kind, "DELETE");
            assert!(got[2].canceled);
            assert_eq!(got[2].compact_revision, 7);
        }
    }

    #[test]
    fn hostile_values_are_typed_errors() {
        let mut buf = b"{\"result\": nope}".to_vec();
        assert!(matches!(
            next_value::<StreamItem<WatchResponse>>(&mut buf),
            Err(ControlError::Malformed { .. })
        ));
        let mut buf = br#"{"result":{"events":[{"kv":{"key":"***"}}]}}"#.to_vec();
        assert!(next_value::<StreamItem<WatchResponse>>(&mut buf).is_err());
        let mut buf = br#"{"header":{"revision":"99999999999999999999"}}"#.to_vec();
        assert!(next_value::<RangeResponse>(&mut buf).is_err());
        let mut buf = br#"{"ID":"12","TTL":5}"#.to_vec();
        let lease = next_value::<LeaseResponse>(&mut buf).unwrap().unwrap();
        assert_eq!((lease.id, lease.ttl), (12, 5));
    }

    #[test]
    fn endpoints_are_checked() {
        assert!(Gateway::new(
            &["http://127.0.0.1:2379".into()],
            Duration::from_secs(1),
            Default::default()
        )
        .is_ok());
        assert!(Gateway::new(
            &["127.0.0.1:2379".into()],
            Duration::from_secs(1),
            Default::default()
        )
        .is_ok());
        assert!(Gateway::new(
            &["https://etcd:2379".into()],
            Duration::from_secs(1),
            Default::default()
        )
        .is_err());
        assert!(Gateway::new(
            &["http://etcd:2379/v3".into()],
            Duration::from_secs(1),
            Default::default()
        )
        .is_err());
        assert!(Gateway::new(&[], Duration::from_secs(1), Default::default()).is_err());
    }
}
