//! The frontend↔worker protocol's port: how a worker appears in discovery ([`WorkerMetadata`]
//! under [`WORKER_KIND`] or [`PREFILL_KIND`]), and the request transport over TCP, in the
//! versioned frames of [`kvfabric::contract::worker`] (`u32` length, a version byte, JSON of at
//! most [`MAX_FRAME`] bytes).
//!
//! Every connection starts with the agents' authenticated handshake
//! ([`kvfabric::session::handshake`]: shared secret, HMAC challenge): no secret, no frames.
//! Then the frontend sends a [`WorkerRequest`]; the worker answers with [`GenEvent`] frames
//! (`accepted` with the request's number, `started`, `token`…, then `done` or `error`). A
//! frontend that closes the connection cancels the generation: the worker notices at once
//! and drops its receiver, which frees the sequence's KV. Malformed, oversize or late
//! frames, and frames of another protocol version, get an `error` frame and the connection
//! is closed; nothing a peer sends can panic the worker. A worker bounds its connections
//! ([`ServeLimits`], [`kvfabric::session::admission`]): in all, in the handshake (where a
//! newer connection evicts the oldest, so silent strangers cannot hold the port), per source,
//! per authenticated peer; a request must arrive within a deadline, and its body is
//! read as it arrives (no allocation of the announced size up front). After `done` a connection
//! may carry the frontend's next request: frontends keep their connections
//! ([`ConnectionPool`]) instead of authenticating again per request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvfabric::secret::Secret;
use kvfabric::session::admission::{Admission, AdmissionLimits, Admitted, PortStats};
use kvfabric::session::handshake::{self, HandshakeError};
use kvfabric::session::proto::{ClientParams, ServerParams};
use kvfabric::tls::{Stream, Tls};
use kvfabric::wire::WireLimits;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::backend::Backend;
use crate::engine::{EngineError, GenEvent};

pub use kvfabric::contract::discovery::{
    CodecSpec, Role, WorkerApi, WorkerMetadata, PREFILL_KIND, WORKER_KIND,
};
pub use kvfabric::contract::worker::{
    FrameHeaderError, WorkerRequest, FRAME_MAX as MAX_FRAME, HEADER_BYTES, PROTOCOL,
};

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// A frame over [`MAX_FRAME`], or of another protocol version.
    #[error("{0}")]
    Header(#[from] FrameHeaderError),
    /// Not the JSON expected.
    #[error("malformed frame: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The handshake failed (wrong secret, wrong worker, timeout).
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// TLS failed (a certificate not trusted or expired, or one side without TLS).
    #[error("{0}")]
    Tls(#[from] kvfabric::tls::TlsError),
}

impl FrameError {
    /// Whether the handshake failed on the secret (ours refused, or theirs wrong): no retry
    /// can succeed until an operator fixes it.
    pub fn is_auth(&self) -> bool {
        use kvfabric::session::proto::SessionError;
        use kvfabric::tls::TlsError;
        use kvfabric::wire::ErrorCode;
        matches!(
            self,
            FrameError::Handshake(HandshakeError::Session(
                SessionError::Auth
                    | SessionError::Refused { code: ErrorCode::TlsRequired, .. }
                    | SessionError::Wire(kvfabric::wire::WireError::Tls)
            )) | FrameError::Tls(TlsError::Handshake { .. } | TlsError::PlaintextPeer { .. })
        )
    }

    /// Whether the peer speaks another version of the protocol: no retry can succeed until
    /// both sides run the same release.
    pub fn is_version(&self) -> bool {
        matches!(self, FrameError::Header(FrameHeaderError::Version { .. }))
    }
}

/// Who may speak the protocol: this side's name and the shared secret, and the process's
/// certificates when connections between processes use mutual TLS.
#[derive(Debug, Clone)]
pub struct Auth {
    /// This side's name: a worker's is the name it registers; a frontend's any name.
    pub name: String,
    /// The shared secret (non-empty).
    pub secret: Secret,
    /// Mutual TLS (when its CA is configured): a worker's port then refuses plaintext
    /// frontends, and a frontend dials workers over TLS only.
    pub tls: Option<Arc<Tls>>,
}

impl Auth {
    fn server(&self) -> ServerParams {
        ServerParams {
            name: self.name.clone(),
            secret: self.secret.clone(),
            limits: WireLimits::default(),
        }
    }

    fn client(&self, worker: &str) -> ClientParams {
        ClientParams {
            me: self.name.clone(),
            peer: worker.to_string(),
            secret: self.secret.clone(),
            limits: WireLimits::default(),
        }
    }
}

/// Limits of a worker's request port.
#[derive(Debug, Clone)]
pub struct ServeLimits {
    /// Who gets a connection: pending (pre-auth) and admitted caps, per source and per peer,
    /// the handshake deadline, and how long an idle kept connection stays open
    /// ([`AdmissionLimits`]).
    pub connections: AdmissionLimits,
    /// Time for the first request frame to arrive after the handshake.
    pub request_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            connections: AdmissionLimits {
                // Kept connections of frontends come back for their next request well
                // within this (they reuse a connection only while idle less than
                // `POOL_IDLE_MAX`).
                idle_timeout: Duration::from_secs(60),
                ..AdmissionLimits::default()
            },
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// What a worker's request port counts.
#[derive(Debug)]
pub struct ServeStats {
    /// Connections refused or closed, by cause, and those open now.
    pub port: Arc<PortStats>,
    /// Requests refused after the handshake (malformed, late, over a limit).
    pub bad_requests: AtomicU64,
    /// Requests being answered now (a draining worker waits for 0).
    pub in_flight: AtomicU64,
}

impl Default for ServeStats {
    fn default() -> Self {
        ServeStats {
            port: Arc::new(PortStats::new("request")),
            bad_requests: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
        }
    }
}

/// Counts a request in flight while it lives.
struct InFlight<'a>(&'a ServeStats);

impl<'a> InFlight<'a> {
    fn new(stats: &'a ServeStats) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(stats)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWriteExt + Unpin, T: serde::Serialize>(
    w: &mut W,
    value: &T,
) -> Result<(), FrameError> {
    let body = serde_json::to_vec(value)?;
    let header = kvfabric::contract::worker::encode_header(body.len())?;
    let mut buf = Vec::with_capacity(HEADER_BYTES + body.len());
    buf.extend_from_slice(&header);
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    // Through TLS, the bytes may wait in the session until flushed.
    w.flush().await?;
    Ok(())
}

/// Decodes one frame from the front of `buf`: the value and the bytes the frame took, or
/// `None` while the frame is incomplete. The same checks as [`read_frame`], without a socket
/// (for tests and fuzzing).
pub fn decode_frame<T: serde::de::DeserializeOwned>(
    buf: &[u8],
) -> Result<Option<(T, usize)>, FrameError> {
    let Some(header) = buf.first_chunk::<HEADER_BYTES>() else { return Ok(None) };
    let n = kvfabric::contract::worker::decode_header(*header)?;
    let Some(body) = buf.get(HEADER_BYTES..HEADER_BYTES + n) else { return Ok(None) };
    Ok(Some((serde_json::from_slice(body)?, HEADER_BYTES + n)))
}

/// Reads one frame; `None` at a clean end of stream.
pub async fn read_frame<R: AsyncReadExt + Unpin, T: serde::de::DeserializeOwned>(
    r: &mut R,
) -> Result<Option<T>, FrameError> {
    match read_frame_bytes(r, None).await? {
        Some((body, _)) => Ok(Some(serde_json::from_slice(&body)?)),
        None => Ok(None),
    }
}

/// Reads one frame's body; with a `budget` (KiB), its announced length is reserved there
/// before the body is read, and held until the returned share drops.
async fn read_frame_bytes<R: AsyncReadExt + Unpin>(
    r: &mut R,
    budget: Option<&'static Semaphore>,
) -> Result<Option<(Vec<u8>, Option<tokio::sync::SemaphorePermit<'static>>)>, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    match r.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = kvfabric::contract::worker::decode_header(header)?;
    let share = match budget {
        // Bounded by MAX_FRAME (16 MiB): at most 16,384 KiB.
        Some(b) => Some(
            b.acquire_many(n.div_ceil(1024).max(1) as u32)
                .await
                .map_err(|_| std::io::Error::other("the request budget is closed"))?,
        ),
        None => None,
    };
    // Grown as bytes arrive: a peer that announces a large frame and sends it slowly holds
    // only what it sent.
    let mut body = Vec::with_capacity(n.min(64 << 10));
    (&mut *r).take(n as u64).read_to_end(&mut body).await?;
    if body.len() != n {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok(Some((body, share)))
}

/// Request bytes that every request port of this process may be reading at once (frames are
/// up to [`MAX_FRAME`] each); a frame waits for its share before its body is read, within its
/// connection's request deadline.
pub const REQUEST_BYTES_IN_FLIGHT_MAX: usize = 64 << 20;

/// The process's budget of request bytes being read, in KiB.
static REQUEST_BYTES: std::sync::LazyLock<Semaphore> =
    std::sync::LazyLock::new(|| Semaphore::new(REQUEST_BYTES_IN_FLIGHT_MAX >> 10));

/// Reads a request frame within the process's budget of request bytes in flight: its
/// announced length is reserved before the body is read, and given back once it is parsed.
async fn read_request<R: AsyncReadExt + Unpin>(
    r: &mut R,
) -> Result<Option<WorkerRequest>, FrameError> {
    match read_frame_bytes(r, Some(&REQUEST_BYTES)).await? {
        Some((body, _share)) => Ok(Some(serde_json::from_slice(&body)?)),
        None => Ok(None),
    }
}

/// Serves generation requests from frontends on `listener`, until the task is aborted.
/// A connection carries one request at a time, and may carry more, one after the other: after
/// `done` (or `error`) the worker waits for the frontend's next request, up to the idle
/// timeout.
pub fn serve(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    auth: Auth,
    limits: ServeLimits,
    stats: Arc<ServeStats>,
) -> tokio::task::JoinHandle<()> {
    let admission = Admission::new(limits.connections.clone(), stats.port.clone());
    tokio::spawn(async move {
        loop {
            let (conn, from) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a frontend connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(pending) = admission.admit(from.ip()) else { continue };
            let (backend, auth, limits, stats) =
                (backend.clone(), auth.clone(), limits.clone(), stats.clone());
            tokio::spawn(async move {
                let _ = conn.set_nodelay(true);
                let timeout = limits.connections.handshake_timeout;
                let handshake = async {
                    let mut conn = handshake::accept_tls(auth.tls.as_deref(), conn, from, timeout)
                        .await
                        .map_err(|e| e.to_string())?;
                    handshake::server(&mut conn, auth.server(), handshake::nonce(), timeout)
                        .await
                        .map(|peer| (peer, conn))
                        .map_err(|e| e.to_string())
                };
                let Some((admitted, conn)) = pending.authenticate_with(handshake).await else {
                    return;
                };
                if let Err(e) = handle(conn, backend, &limits, &stats, &admitted).await {
                    stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(peer = %admitted.peer(), error = %e, "frontend connection ended");
                }
            });
        }
    })
}

/// Answers the requests of one authenticated connection, one after the other.
async fn handle(
    conn: Stream,
    backend: Arc<dyn Backend>,
    limits: &ServeLimits,
    stats: &ServeStats,
    admitted: &Admitted,
) -> Result<(), FrameError> {
    let (mut rd, mut wr) = tokio::io::split(conn);
    // The first request must arrive promptly; a kept connection may wait longer for its next.
    let mut wait = limits.request_timeout;
    loop {
        let req: WorkerRequest = match tokio::time::timeout(wait, read_request(&mut rd)).await {
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => {
                let e2 = EngineError::invalid(e.to_string());
                let _ = write_frame(&mut wr, &GenEvent::Error(e2)).await;
                return Err(e);
            }
            Err(_) if wait == limits.request_timeout => {
                let e = EngineError::invalid(format!("no request within {wait:?}"));
                let _ = write_frame(&mut wr, &GenEvent::Error(e)).await;
                return Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
            }
            Err(_) => {
                admitted.idle_closed();
                return Ok(());
            }
        };
        let _counted = InFlight::new(stats);
        if !answer(req, &backend, &mut rd, &mut wr).await? {
            return Ok(());
        }
        wait = admitted.idle_timeout();
    }
}

/// Answers one request; false when the frontend hung up (the connection is over).
async fn answer(
    req: WorkerRequest,
    backend: &Arc<dyn Backend>,
    rd: &mut tokio::io::ReadHalf<Stream>,
    wr: &mut tokio::io::WriteHalf<Stream>,
) -> Result<bool, FrameError> {
    if backend.model(&req.model).is_none() {
        let e = EngineError::invalid(format!("this worker does not serve {:?}", req.model));
        write_frame(wr, &GenEvent::Error(e)).await?;
        return Ok(true);
    }
    let mut rx = match backend.submit_numbered(&req.model, req.request) {
        Ok((rx, seq)) => {
            // Its number first: the frontend's router counts it on top of this worker's
            // load reports until one counts it.
            if let Some(seq) = seq {
                write_frame(wr, &GenEvent::Accepted { seq }).await?;
            }
            rx
        }
        Err(e) => {
            write_frame(wr, &GenEvent::Error(e)).await?;
            return Ok(true);
        }
    };
    let mut probe = [0u8; 1];
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else {
                    write_frame(wr, &GenEvent::Error(EngineError::Stopped)).await?;
                    return Ok(true);
                };
                let last = matches!(ev, GenEvent::Done { .. } | GenEvent::Error(_));
                write_frame(wr, &ev).await?;
                if last {
                    return Ok(true);
                }
            }
            // The frontend sends nothing while a request runs: any read result means it hung
            // up (or broke the protocol). Either way the generation is cancelled by dropping
            // `rx`.
            _ = rd.read(&mut probe) => return Ok(false),
        }
    }
}

/// A kept connection idle longer than this is closed, not reused (workers close theirs
/// after their idle timeout, 60 s by default).
pub const POOL_IDLE_MAX: Duration = Duration::from_secs(30);

/// Kept connections per worker, at most.
const POOL_PER_WORKER_MAX: usize = 64;

/// A frontend's authenticated connections to its workers, kept for reuse: a request takes
/// one (or opens one), and gives it back after a clean end (`done` or `error`). A flood of
/// strangers on a worker's port then cannot keep the frontend out: its connections are
/// already in.
#[derive(Debug, Default)]
pub struct ConnectionPool {
    idle: Mutex<HashMap<(SocketAddr, String), Vec<Kept>>>,
}

/// A kept connection and since when it is idle.
type Kept = (Stream, std::time::Instant);

/// A connection to a worker with a request sent on it.
#[derive(Debug)]
pub struct PooledConn {
    stream: Stream,
    key: (SocketAddr, String),
    /// Whether it was kept from an earlier request (it may have been closed meanwhile).
    pub reused: bool,
}

impl PooledConn {
    /// Reads the next event.
    pub async fn next(&mut self) -> Result<Option<GenEvent>, FrameError> {
        read_frame(&mut self.stream).await
    }
}

impl ConnectionPool {
    /// Sends `req` to the worker `worker` at `addr` on a kept connection, or on a new one
    /// (connected and authenticated within `timeout`).
    pub async fn request(
        &self,
        addr: SocketAddr,
        worker: &str,
        auth: &Auth,
        req: &WorkerRequest,
        timeout: Duration,
    ) -> Result<PooledConn, FrameError> {
        let key = (addr, worker.to_string());
        while let Some(mut stream) = self.take(&key) {
            if write_frame(&mut stream, req).await.is_ok() {
                return Ok(PooledConn { stream, key, reused: true });
            }
        }
        self.fresh(addr, worker, auth, req, timeout).await
    }

    /// Sends `req` on a new connection.
    pub async fn fresh(
        &self,
        addr: SocketAddr,
        worker: &str,
        auth: &Auth,
        req: &WorkerRequest,
        timeout: Duration,
    ) -> Result<PooledConn, FrameError> {
        let stream = connect(addr, worker, auth, req, timeout).await?;
        Ok(PooledConn { stream, key: (addr, worker.to_string()), reused: false })
    }

    /// A kept connection that is still open, newest first.
    fn take(&self, key: &(SocketAddr, String)) -> Option<Stream> {
        let mut idle = self.idle.lock();
        let conns = idle.get_mut(key)?;
        while let Some((stream, since)) = conns.pop() {
            // A worker sends nothing unasked: anything readable (its end of stream above
            // all) means the connection is over.
            let open = !stream.closed_or_unasked();
            if open && since.elapsed() < POOL_IDLE_MAX {
                return Some(stream);
            }
        }
        idle.remove(key);
        None
    }

    /// Gives back a connection whose request ended cleanly (its last event was `done` or
    /// `error`).
    pub fn give_back(&self, conn: PooledConn) {
        let mut idle = self.idle.lock();
        let conns = idle.entry(conn.key).or_default();
        conns.retain(|(_, since)| since.elapsed() < POOL_IDLE_MAX);
        if conns.len() < POOL_PER_WORKER_MAX {
            conns.push((conn.stream, std::time::Instant::now()));
        }
    }

    /// Closes the kept connections to a worker (it left).
    pub fn forget(&self, addr: SocketAddr, worker: &str) {
        self.idle.lock().remove(&(addr, worker.to_string()));
    }
}

/// Connects to the worker `worker` and authenticates, then hangs up: whether this side and the
/// worker share the secret (a frontend asks when a worker joins, so that a worker it cannot
/// reach is known before a request needs it).
pub async fn probe(
    addr: SocketAddr,
    worker: &str,
    auth: &Auth,
    timeout: Duration,
) -> Result<(), FrameError> {
    let mut s = dial(addr, auth, timeout).await?;
    handshake::client(&mut s, auth.client(worker), handshake::nonce(), timeout).await?;
    Ok(())
}

/// A connection to `addr` within `timeout`, over TLS when `auth` has it.
async fn dial(addr: SocketAddr, auth: &Auth, timeout: Duration) -> Result<Stream, FrameError> {
    let tcp = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    tcp.set_nodelay(true)?;
    Ok(kvfabric::tls::connect_peer(auth.tls.as_deref(), tcp, addr, timeout).await?)
}

/// Connects to the worker `worker`, authenticates, and sends a request; events are read
/// with [`read_frame`]. `timeout` bounds the connect and the handshake.
pub async fn connect(
    addr: SocketAddr,
    worker: &str,
    auth: &Auth,
    req: &WorkerRequest,
    timeout: Duration,
) -> Result<Stream, FrameError> {
    let mut s = dial(addr, auth, timeout).await?;
    handshake::client(&mut s, auth.client(worker), handshake::nonce(), timeout).await?;
    write_frame(&mut s, req).await?;
    Ok(s)
}
