//! TLS on kvfabric's TCP ports: rustls with the *ring* provider (pure Rust and assembly, built
//! by `cc` with no system library: nothing to install on a fresh machine, and the provider
//! the NATS client already links, so the build carries one TLS stack, not two).
//!
//! One [`Tls`] per process, built from PEM files:
//! - **API and metrics ports** ([`Tls::accept_api`]): HTTPS with the process's certificate
//!   chain, HTTP/1.1 and HTTP/2 by ALPN, client certificates when a client CA is given.
//! - **Between processes** ([`Tls::accept_peer`], [`Tls::connect_peer`]): mutual TLS with the
//!   deployment CA, on when one is given. Each side verifies the other's chain to that CA; a
//!   client also checks that the server's certificate names the address it dialled. The
//!   shared-secret handshake runs inside, as the second factor.
//!
//! [`Tls::reload`] re-reads the files (SIGHUP): new connections get the new certificates,
//! open ones keep theirs; a reload that fails keeps the old configuration.
//!
//! The protocols behind the peer ports (agents, request ports) have the server speak first,
//! so a plaintext client waits silently for a challenge. A TLS server that hears nothing for
//! [`PLAINTEXT_SILENCE`] treats the peer as plaintext, tells it so in its own protocol's
//! error frame (the caller's part), and counts it ([`counters`]).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::RwLock;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A TLS server that hears nothing from a new peer for this long takes it for a plaintext
/// client waiting for the challenge (a TLS client sends its hello as soon as it connects).
pub const PLAINTEXT_SILENCE: Duration = Duration::from_millis(1000);

/// The first byte of a TLS record that carries a handshake (a ClientHello starts with it).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Why TLS could not be set up, or a TLS connection failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading the {what} {path}: {source}")]
    Read {
        /// What the file holds.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file's contents are unusable.
    #[error("the {what} {path}: {message}")]
    Invalid {
        /// What the file holds.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The files do not make a configuration (a key that is not the certificate's).
    #[error("TLS configuration: {0}")]
    Config(String),
    /// The handshake with a peer failed.
    #[error("TLS with {peer}: {message}")]
    Handshake {
        /// Who.
        peer: String,
        /// Why, in words an operator can act on.
        message: String,
    },
    /// The handshake did not finish in time.
    #[error("TLS with {peer}: no handshake within {timeout:?}")]
    Timeout {
        /// Who.
        peer: String,
        /// The bound.
        timeout: Duration,
    },
    /// A peer connected without TLS to a port that requires it.
    #[error("{peer} connected without TLS; this port requires mutual TLS (--tls-ca)")]
    PlaintextPeer {
        /// Who.
        peer: String,
        /// Whether it sent nothing (a plaintext client of a server-speaks-first protocol,
        /// which can be told in its own protocol), rather than bytes that are not TLS.
        silent: bool,
    },
}

/// The files of a process's TLS configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain (PEM, leaf first).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The deployment CA (PEM): mutual TLS between kvfabric processes, on when given.
    pub ca: Option<PathBuf>,
    /// The CA of API clients' certificates (PEM): the API and metrics ports then require one.
    pub client_ca: Option<PathBuf>,
}

/// Process-wide TLS counters (one home for every port's TLS outcomes).
#[derive(Debug, Default)]
pub struct TlsCounters {
    /// Handshakes completed, as server and as client.
    pub handshakes: AtomicU64,
    /// Handshakes that failed (a wrong CA, an expired certificate, a peer that went away).
    pub handshake_failures: AtomicU64,
    /// Plaintext peers refused by a port that requires TLS.
    pub plaintext_refused: AtomicU64,
    /// Certificate reloads that succeeded.
    pub reloads: AtomicU64,
    /// Certificate reloads that failed (the old certificates stay).
    pub reload_failures: AtomicU64,
}

static COUNTERS: TlsCounters = TlsCounters {
    handshakes: AtomicU64::new(0),
    handshake_failures: AtomicU64::new(0),
    plaintext_refused: AtomicU64::new(0),
    reloads: AtomicU64::new(0),
    reload_failures: AtomicU64::new(0),
};

/// This process's TLS counters.
pub fn counters() -> &'static TlsCounters {
    &COUNTERS
}

/// The configurations built from the files at one time.
struct Built {
    api: Arc<ServerConfig>,
    peer_server: Option<Arc<ServerConfig>>,
    peer_client: Option<Arc<ClientConfig>>,
    /// The leaf certificate's end of validity, seconds since the Unix epoch.
    not_after: i64,
}

/// A process's TLS: the server and client configurations of its certificate, rebuilt by
/// [`Tls::reload`].
pub struct Tls {
    files: TlsFiles,
    built: RwLock<Arc<Built>>,
    /// The last reload failed (for `/health`).
    reload_failed: AtomicBool,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("files", &self.files)
            .field("not_after", &self.not_after())
            .finish()
    }
}

impl Tls {
    /// Loads the files; a certificate that is expired, or a key that is not its own, is an
    /// error here rather than at the first handshake.
    pub fn load(files: TlsFiles) -> Result<Arc<Tls>, TlsError> {
        let built = build(&files)?;
        Ok(Arc::new(Tls {
            files,
            built: RwLock::new(Arc::new(built)),
            reload_failed: AtomicBool::new(false),
        }))
    }

    /// Re-reads the files. On error the configuration in use stays, and the error says why.
    pub fn reload(&self) -> Result<(), TlsError> {
        match build(&self.files) {
            Ok(b) => {
                *self.built.write() = Arc::new(b);
                self.reload_failed.store(false, Ordering::Relaxed);
                COUNTERS.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.reload_failed.store(true, Ordering::Relaxed);
                COUNTERS.reload_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// The files it was loaded from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Whether connections between kvfabric processes use mutual TLS (a CA was given).
    pub fn mutual(&self) -> bool {
        self.built.read().peer_client.is_some()
    }

    /// The end of validity of the certificate in use, seconds since the Unix epoch.
    pub fn not_after(&self) -> i64 {
        self.built.read().not_after
    }

    /// Its part of `/health`: the certificate's end, the handshakes refused, the last reload.
    pub fn health(&self) -> crate::health::TlsHealth {
        let not_after = self.not_after();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        crate::health::TlsHealth {
            not_after,
            expires_in_s: not_after.saturating_sub(now),
            handshake_failures: COUNTERS.handshake_failures.load(Ordering::Relaxed),
            plaintext_refused: COUNTERS.plaintext_refused.load(Ordering::Relaxed),
            last_reload_failed: self.reload_failed.load(Ordering::Relaxed),
        }
    }

    /// Accepts an HTTPS client on the API or metrics port within `timeout`.
    pub async fn accept_api(
        &self,
        tcp: TcpStream,
        from: SocketAddr,
        timeout: Duration,
    ) -> Result<Stream, TlsError> {
        let config = self.built.read().api.clone();
        handshake(tokio_rustls::TlsAcceptor::from(config).accept(tcp), from.to_string(), timeout)
            .await
            .map(|s| Stream::Server(Box::new(s)))
    }

    /// Accepts a kvfabric peer: mutual TLS when a CA is configured (a plaintext peer is
    /// refused), else the connection as it is.
    pub async fn accept_peer(
        &self,
        tcp: TcpStream,
        from: SocketAddr,
        timeout: Duration,
    ) -> Result<Stream, (TlsError, Option<TcpStream>)> {
        let Some(config) = self.built.read().peer_server.clone() else {
            return Ok(Stream::Plain(tcp));
        };
        let peer = from.to_string();
        let mut first = [0u8; 1];
        match tokio::time::timeout(PLAINTEXT_SILENCE.min(timeout), tcp.peek(&mut first)).await {
            Err(_) => {
                COUNTERS.plaintext_refused.fetch_add(1, Ordering::Relaxed);
                return Err((TlsError::PlaintextPeer { peer, silent: true }, Some(tcp)));
            }
            Ok(Ok(0)) => {
                let message = "closed before its hello".to_string();
                return Err((TlsError::Handshake { peer, message }, None));
            }
            Ok(Err(e)) => {
                return Err((TlsError::Handshake { peer, message: e.to_string() }, None));
            }
            Ok(Ok(_)) if first[0] != TLS_HANDSHAKE_RECORD => {
                COUNTERS.plaintext_refused.fetch_add(1, Ordering::Relaxed);
                return Err((TlsError::PlaintextPeer { peer, silent: false }, None));
            }
            Ok(Ok(_)) => {}
        }
        handshake(tokio_rustls::TlsAcceptor::from(config).accept(tcp), peer, timeout)
            .await
            .map(|s| Stream::Server(Box::new(s)))
            .map_err(|e| (e, None))
    }

    /// Opens TLS to the kvfabric peer at `addr` when mutual TLS is configured (its
    /// certificate must chain to the CA and name `addr`'s IP address), else leaves the
    /// connection as it is.
    pub async fn connect_peer(
        &self,
        tcp: TcpStream,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Stream, TlsError> {
        let Some(config) = self.built.read().peer_client.clone() else {
            return Ok(Stream::Plain(tcp));
        };
        let name = ServerName::IpAddress(addr.ip().into());
        let connect = tokio_rustls::TlsConnector::from(config).connect(name, tcp);
        handshake(connect, addr.to_string(), timeout).await.map(|s| Stream::Client(Box::new(s)))
    }
}

/// Accepts on `tls` when given (mutual TLS between processes), else the plain connection.
pub async fn accept_peer(
    tls: Option<&Tls>,
    tcp: TcpStream,
    from: SocketAddr,
    timeout: Duration,
) -> Result<Stream, (TlsError, Option<TcpStream>)> {
    match tls {
        Some(t) => t.accept_peer(tcp, from, timeout).await,
        None => Ok(Stream::Plain(tcp)),
    }
}

/// Connects on `tls` when given, else the plain connection.
pub async fn connect_peer(
    tls: Option<&Tls>,
    tcp: TcpStream,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Stream, TlsError> {
    match tls {
        Some(t) => t.connect_peer(tcp, addr, timeout).await,
        None => Ok(Stream::Plain(tcp)),
    }
}

/// Runs a handshake within `timeout`, counting it and putting its failure in words.
async fn handshake<S>(
    fut: impl std::future::Future<Output = io::Result<S>>,
    peer: String,
    timeout: Duration,
) -> Result<S, TlsError> {
    let outcome = match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(TlsError::Handshake { peer, message: explain(&e) }),
        Err(_) => Err(TlsError::Timeout { peer, timeout }),
    };
    let counter = if outcome.is_ok() { &COUNTERS.handshakes } else { &COUNTERS.handshake_failures };
    counter.fetch_add(1, Ordering::Relaxed);
    outcome
}

/// A handshake's failure in words an operator can act on.
pub fn explain(e: &io::Error) -> String {
    use rustls::{CertificateError, Error as E};
    let Some(inner) = e.get_ref().and_then(|i| i.downcast_ref::<E>()) else {
        return match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => format!(
                "the peer closed the connection during the handshake ({e}): it may run \
                 without TLS, or have refused this certificate"
            ),
            _ => e.to_string(),
        };
    };
    match inner {
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => format!(
            "the peer does not speak TLS ({inner}): it runs without certificates \
             (--tls-ca), or this is not a kvfabric TLS port"
        ),
        E::InvalidCertificate(CertificateError::UnknownIssuer) => format!(
            "its certificate is not signed by the CA this process trusts ({inner}): a wrong \
             --tls-ca, or a certificate of another deployment"
        ),
        E::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        ) => format!("its certificate has expired ({inner})"),
        E::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "its certificate does not name the address dialled ({inner}): give each process \
             a certificate with its advertised IP address as a subject alternative name"
        ),
        E::AlertReceived(alert) => format!(
            "the peer refused the handshake ({alert:?}): it does not trust this process's \
             certificate (another CA, expired, or none given)"
        ),
        E::NoCertificatesPresented => {
            "the peer sent no certificate: mutual TLS needs one on both sides".to_string()
        }
        other => other.to_string(),
    }
}

/// A connection: plain TCP, or TLS over it (as client or as server).
#[derive(Debug)]
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS, this side the client.
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// TLS, this side the server.
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Stream {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Client(s) => s.get_ref().0,
            Stream::Server(s) => s.get_ref().0,
        }
    }

    /// The TCP connection when there is no TLS over it (bytes may go straight to it).
    pub fn plain(&self) -> Option<&TcpStream> {
        match self {
            Stream::Plain(s) => Some(s),
            _ => None,
        }
    }

    /// Whether TLS protects it.
    pub fn is_tls(&self) -> bool {
        !matches!(self, Stream::Plain(_))
    }

    /// The protocol the TLS handshake agreed on (ALPN), if any.
    pub fn alpn(&self) -> Option<&[u8]> {
        match self {
            Stream::Plain(_) => None,
            Stream::Client(s) => s.get_ref().1.alpn_protocol(),
            Stream::Server(s) => s.get_ref().1.alpn_protocol(),
        }
    }

    /// Whether the peer has closed it or sent something unasked (for protocols where the
    /// peer sends nothing between requests: either way the connection is not reusable). Does
    /// not consume bytes.
    pub fn closed_or_unasked(&self) -> bool {
        let mut probe = [0u8; 1];
        let tcp = self.tcp();
        let peeked =
            tcp.try_io(tokio::io::Interest::READABLE, || peek_nonblocking(tcp, &mut probe));
        !matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

fn peek_nonblocking(tcp: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: recv writes at most `buf.len()` bytes into `buf`, which we own.
    let n = unsafe {
        libc::recv(
            tcp.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

/// Writes may stay buffered in the TLS session until flushed: callers flush after each
/// message they expect an answer to (the protocols here do).
impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Client(s) => s.is_write_vectored(),
            Stream::Server(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The certificates of a PEM file (at least one).
pub fn read_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let certs =
        CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>().map_err(|e| {
            TlsError::Invalid { what, path: path.to_path_buf(), message: e.to_string() }
        })?;
    if certs.is_empty() {
        let message = "no CERTIFICATE in it (PEM expected)".to_string();
        return Err(TlsError::Invalid { what, path: path.to_path_buf(), message });
    }
    Ok(certs)
}

/// A trust store of the certificates of a PEM file.
pub fn read_roots(path: &Path, what: &'static str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path, what)? {
        roots.add(cert).map_err(|e| TlsError::Invalid {
            what,
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    }
    Ok(roots)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let what = "TLS private key";
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        message: format!("no private key in it (PEM: PKCS#8, PKCS#1 or SEC1): {e}"),
    })
}

/// The *ring* provider. rustls 0.23.48 deprecates it for lacking post-quantum key exchange
/// (X25519MLKEM768 comes with aws-lc-rs, whose C library takes minutes to build here and
/// cmake or NASM on some targets); kvfabric keeps *ring* for now: one TLS stack with the NATS
/// client's, nothing to install. The key exchange is X25519 (or P-256/P-384).
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_error(e: rustls::Error) -> TlsError {
    TlsError::Config(e.to_string())
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn build(files: &TlsFiles) -> Result<Built, TlsError> {
    let chain = read_certs(&files.cert, "TLS certificate")?;
    let key = read_key(&files.key)?;
    let validity = validity(&chain[0]).map_err(|message| TlsError::Invalid {
        what: "TLS certificate",
        path: files.cert.clone(),
        message,
    })?;
    let now = now_unix();
    if validity.1 < now {
        return Err(TlsError::Invalid {
            what: "TLS certificate",
            path: files.cert.clone(),
            message: format!("expired on {}", utc(validity.1)),
        });
    }
    if validity.0 > now + 300 {
        return Err(TlsError::Invalid {
            what: "TLS certificate",
            path: files.cert.clone(),
            message: format!(
                "not valid before {} (is this machine's clock right?)",
                utc(validity.0)
            ),
        });
    }
    let versions = rustls::DEFAULT_VERSIONS;
    let api = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .map_err(config_error)?;
    let api = match &files.client_ca {
        Some(path) => {
            let roots = Arc::new(read_roots(path, "TLS client CA")?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            api.with_client_cert_verifier(verifier)
        }
        None => api.with_no_client_auth(),
    };
    let mut api = api.with_single_cert(chain.clone(), key.clone_key()).map_err(|e| {
        TlsError::Config(format!("{} and {}: {e}", files.cert.display(), files.key.display()))
    })?;
    api.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let (peer_server, peer_client) = match &files.ca {
        None => (None, None),
        Some(path) => {
            let roots = Arc::new(read_roots(path, "TLS CA")?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            let server = ServerConfig::builder_with_provider(provider())
                .with_protocol_versions(versions)
                .map_err(config_error)?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(config_error)?;
            let client = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(versions)
                .map_err(config_error)?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(config_error)?;
            (Some(Arc::new(server)), Some(Arc::new(client)))
        }
    };
    Ok(Built { api: Arc::new(api), peer_server, peer_client, not_after: validity.1 })
}

/// A client configuration for a control-plane server (etcd): trusting `ca` (else nothing is
/// trusted: a CA is required), presenting `identity` (a certificate and its key) when given.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = read_roots(ca, "CA")?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(rustls::DEFAULT_VERSIONS)
        .map_err(config_error)?
        .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => {
            let chain = read_certs(cert, "client certificate")?;
            let (from, to) = validity(&chain[0]).map_err(|message| TlsError::Invalid {
                what: "client certificate",
                path: cert.to_path_buf(),
                message,
            })?;
            if to < now_unix() || from > now_unix() + 300 {
                return Err(TlsError::Invalid {
                    what: "client certificate",
                    path: cert.to_path_buf(),
                    message: format!("valid only from {} to {}", utc(from), utc(to)),
                });
            }
            builder.with_client_auth_cert(chain, read_key(key)?).map_err(config_error)?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// The validity of a DER certificate: not before and not after, seconds since the Unix
/// epoch. A small reader of exactly the fields on the way (RFC 5280 §4.1), bounded by the
/// buffer: every length is checked before it is used.
pub fn validity(cert: &[u8]) -> Result<(i64, i64), String> {
    fn next(buf: &[u8]) -> Result<(u8, &[u8], &[u8]), String> {
        let bad = || "not a DER certificate".to_string();
        let (&tag, rest) = buf.split_first().ok_or_else(bad)?;
        let (&first, rest) = rest.split_first().ok_or_else(bad)?;
        let (len, rest) = if first < 0x80 {
            (first as usize, rest)
        } else {
            let n = (first & 0x7f) as usize;
            if n == 0 || n > 4 || rest.len() < n {
                return Err(bad());
            }
            let len = rest[..n].iter().fold(0usize, |a, &b| (a << 8) | b as usize);
            (len, &rest[n..])
        };
        if rest.len() < len {
            return Err(bad());
        }
        Ok((tag, &rest[..len], &rest[len..]))
    }
    let (_, cert, _) = next(cert)?;
    let (_, tbs, _) = next(cert)?;
    let (tag, _, mut rest) = next(tbs)?;
    if tag == 0xa0 {
        // The explicit version; then the serial number.
        rest = next(rest)?.2;
    }
    let rest = next(rest)?.2; // signature algorithm
    let rest = next(rest)?.2; // issuer
    let (_, validity, _) = next(rest)?;
    let (t1, from, rest) = next(validity)?;
    let (t2, to, _) = next(rest)?;
    Ok((time(t1, from)?, time(t2, to)?))
}

/// An ASN.1 UTCTime (0x17, `YYMMDDHHMMSSZ`) or GeneralizedTime (0x18, `YYYYMMDDHHMMSSZ`).
fn time(tag: u8, v: &[u8]) -> Result<i64, String> {
    let s = std::str::from_utf8(v).map_err(|_| "a certificate time is not text".to_string())?;
    let digits = s.strip_suffix('Z').ok_or_else(|| format!("certificate time {s:?}"))?;
    let (year, rest) = match (tag, digits.len()) {
        (0x17, 12) => {
            let yy: i64 = digits[..2].parse().map_err(|_| format!("time {s:?}"))?;
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &digits[2..])
        }
        (0x18, 14) => (digits[..4].parse().map_err(|_| format!("time {s:?}"))?, &digits[4..]),
        _ => return Err(format!("certificate time {s:?}")),
    };
    let field = |i: usize| -> Result<i64, String> {
        rest.get(i..i + 2).and_then(|d| d.parse().ok()).ok_or_else(|| format!("time {s:?}"))
    };
    let (month, day, h, m, sec) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || sec > 60 {
        return Err(format!("certificate time {s:?}"));
    }
    Ok(days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + sec)
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(t: i64) -> String {
    let (days, secs) = (t.div_euclid(86_400), t.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_through_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400 + 3661), "2000-02-29 01:01:01 UTC");
        assert_eq!(time(0x17, b"491231235959Z").unwrap(), 2_524_607_999);
        assert_eq!(time(0x18, b"20500101000000Z").unwrap(), 2_524_608_000);
    }

    #[test]
    fn hostile_certificate_bytes_are_an_error_not_a_panic() {
        for bytes in [&b""[..], b"\x30", b"\x30\x84\xff\xff\xff\xff", b"\x30\x02\x30\x00"] {
            assert!(validity(bytes).is_err());
        }
        let mut rng = crate::rng::SplitMix64(7);
        for _ in 0..2000 {
            let len = (rng.next_u64() % 64) as usize;
            let v: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            let _ = validity(&v);
        }
        assert!(time(0x17, b"991332000000Z").is_err());
        assert!(time(0x18, b"2050010100000").is_err());
    }
}
