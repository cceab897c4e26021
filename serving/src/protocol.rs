//! The frontend↔worker protocol: how a worker appears in discovery ([`WorkerMetadata`] under
//! [`WORKER_KIND`] or [`PREFILL_KIND`]), and the request transport: TCP, one connection per request,
//! length-prefixed JSON frames (`u32` little-endian length, then the JSON, at most
//! [`MAX_FRAME`] bytes).
//!
//! Every connection starts with the agents' authenticated handshake
//! ([`kvfabric::session::handshake`]: shared secret, HMAC challenge): no secret, no frames.
//! Then the frontend sends one [`WorkerRequest`]; the worker answers with [`GenEvent`] frames
//! (`started`, `token`…, then `done` or `error`) and closes. A frontend that closes the
//! connection cancels the generation: the worker notices at once and drops its receiver,
//! which frees the sequence's KV. Malformed, oversize or late frames get an `error` frame
//! and the connection is closed; nothing a peer sends can panic the worker. A worker bounds its
//! connections ([`ServeLimits`]): in all, in the handshake, per authenticated peer; a request
//! must arrive within a deadline, and its body is read as it arrives (no allocation of the
//! announced size up front).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvfabric::session::handshake::{self, HandshakeError};
use kvfabric::session::proto::{ClientParams, ServerParams};
use kvfabric::wire::WireLimits;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::backend::Backend;
use crate::engine::{EngineError, GenEvent, GenerateRequest, ModelInfo, TextCodec};

/// The discovery kind of workers.
pub const WORKER_KIND: &str = "worker";

/// The discovery kind of prefill workers.
pub const PREFILL_KIND: &str = "prefill";

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode (the default).
    #[default]
    Aggregated,
    /// Computes prompts' KV for decode workers.
    Prefill,
    /// Serves requests, prefilling long prompts remotely.
    Decode,
}

/// What a worker registers in discovery.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WorkerMetadata {
    /// The model it serves.
    pub model: ModelInfo,
    /// How to tokenize for it.
    pub codec: CodecSpec,
    /// Its request port.
    pub addr: SocketAddr,
    /// Its role.
    #[serde(default)]
    pub role: Role,
    /// How requests reach it: kvfabric's framed protocol (its own workers), or an engine's
    /// OpenAI-compatible HTTP API (an engine behind `kvfabric attach`).
    #[serde(default)]
    pub api: WorkerApi,
}

/// How a frontend sends a worker its requests.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerApi {
    /// kvfabric's request protocol on `addr` (authenticated, framed JSON).
    #[default]
    Kvfabric,
    /// An OpenAI-compatible server on `addr` (vLLM, SGLang, TensorRT-LLM's `trtllm-serve`):
    /// requests go to `/v1/completions` as token ids.
    OpenAi {
        /// The model name the engine serves (its `--served-model-name`).
        model: String,
    },
}

/// How a worker's prompts are tokenized, as it registers it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CodecSpec {
    /// The vocabulary and chat template of a GGUF file (a path the frontend can read), or a
    /// tokenizer.json next to it.
    Gguf {
        /// The GGUF file.
        path: std::path::PathBuf,
        /// A tokenizer.json overriding the GGUF's vocabulary.
        tokenizer: Option<std::path::PathBuf>,
    },
    /// One token per byte (the mock engine).
    Bytes,
    /// A Hugging Face model directory's tokenizer.json and tokenizer_config.json (a path the
    /// frontend can read; the mock mirroring a model).
    ModelDir {
        /// The directory.
        path: std::path::PathBuf,
    },
}

impl CodecSpec {
    /// Loads the codec (reads the GGUF's metadata, not its weights).
    pub fn load(&self) -> Result<TextCodec, EngineError> {
        match self {
            CodecSpec::Bytes => Ok(TextCodec::bytes()),
            CodecSpec::ModelDir { path } => TextCodec::from_model_dir(path),
            CodecSpec::Gguf { path, tokenizer } => {
                TextCodec::from_gguf_path(path, tokenizer.as_deref())
            }
        }
    }
}

/// Largest frame accepted (a 1M-token prompt as JSON fits).
pub const MAX_FRAME: usize = 16 << 20;

/// What a frontend asks of a worker.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WorkerRequest {
    /// The model (the worker refuses others).
    pub model: String,
    /// The generation.
    pub request: GenerateRequest,
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The socket failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// A frame over [`MAX_FRAME`].
    #[error("frame of {0} bytes is over the limit of {MAX_FRAME}")]
    TooLarge(usize),
    /// Not the JSON expected.
    #[error("malformed frame: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The handshake failed (wrong secret, wrong worker, timeout).
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
}

/// Who may speak the protocol: this side's name and the shared secret.
#[derive(Clone)]
pub struct Auth {
    /// This side's name: a worker's is the name it registers; a frontend's any name.
    pub name: String,
    /// The shared secret (non-empty).
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth").field("name", &self.name).finish_non_exhaustive()
    }
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
    /// Connections at once, in all; beyond, new ones are closed at once (and counted).
    pub connections_max: usize,
    /// Connections still in the handshake at once.
    pub handshakes_max: usize,
    /// Connections of one authenticated peer at once.
    pub per_peer_max: usize,
    /// Time to complete the handshake.
    pub handshake_timeout: Duration,
    /// Time for the request frame to arrive after the handshake.
    pub request_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            connections_max: 4096,
            handshakes_max: 128,
            per_peer_max: 2048,
            handshake_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// What a worker's request port refused, by reason.
#[derive(Debug, Default)]
pub struct ServeStats {
    /// Connections refused because too many were open (in all, or in the handshake).
    pub refused_busy: AtomicU64,
    /// Connections refused because their peer had too many open.
    pub refused_peer: AtomicU64,
    /// Handshakes that failed (wrong secret, timeout, garbage).
    pub handshake_failed: AtomicU64,
    /// Requests refused after the handshake (malformed, late, over a limit).
    pub bad_requests: AtomicU64,
    /// Connections accepted and not yet done: in the handshake, reading their request, or
    /// streaming its answer (a draining worker waits for 0).
    pub in_flight: AtomicU64,
}

/// Counts a connection in flight while it lives.
struct InFlight(Arc<ServeStats>);

impl InFlight {
    fn new(stats: Arc<ServeStats>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(stats)
    }
}

impl Drop for InFlight {
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
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    Ok(())
}

/// The body length a frame header announces, bounded by [`MAX_FRAME`].
pub fn frame_len(header: [u8; 4]) -> Result<usize, FrameError> {
    let n = u32::from_le_bytes(header) as usize;
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    Ok(n)
}

/// Decodes one frame from the front of `buf`: the value and the bytes the frame took, or
/// `None` while the frame is incomplete. The same checks as [`read_frame`], without a socket
/// (for tests and fuzzing).
pub fn decode_frame<T: serde::de::DeserializeOwned>(
    buf: &[u8],
) -> Result<Option<(T, usize)>, FrameError> {
    let Some(header) = buf.get(..4) else { return Ok(None) };
    let n = frame_len([header[0], header[1], header[2], header[3]])?;
    let Some(body) = buf.get(4..4 + n) else { return Ok(None) };
    Ok(Some((serde_json::from_slice(body)?, 4 + n)))
}

/// Reads one frame; `None` at a clean end of stream.
pub async fn read_frame<R: AsyncReadExt + Unpin, T: serde::de::DeserializeOwned>(
    r: &mut R,
) -> Result<Option<T>, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = frame_len(len)?;
    // Grown as bytes arrive: a peer that announces a large frame and sends it slowly holds
    // only what it sent.
    let mut body = Vec::with_capacity(n.min(64 << 10));
    (&mut *r).take(n as u64).read_to_end(&mut body).await?;
    if body.len() != n {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok(Some(serde_json::from_slice(&body)?))
}

/// Serves generation requests from frontends on `listener`, until the task is aborted.
pub fn serve(
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    auth: Auth,
    limits: ServeLimits,
    stats: Arc<ServeStats>,
) -> tokio::task::JoinHandle<()> {
    let connections = Arc::new(Semaphore::new(limits.connections_max.max(1)));
    let handshakes = Arc::new(Semaphore::new(limits.handshakes_max.max(1)));
    let peers: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
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
            let (Ok(slot), Ok(handshake)) =
                (connections.clone().try_acquire_owned(), handshakes.clone().try_acquire_owned())
            else {
                if stats.refused_busy.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(%from, "worker port at its connection limit: refusing");
                }
                continue;
            };
            let (backend, auth, limits, stats, peers) =
                (backend.clone(), auth.clone(), limits.clone(), stats.clone(), peers.clone());
            let counted = InFlight::new(stats.clone());
            tokio::spawn(async move {
                let _slot = slot;
                let _counted = counted;
                let mut conn = conn;
                let _ = conn.set_nodelay(true);
                let peer = match handshake::server(
                    &mut conn,
                    auth.server(),
                    handshake::nonce(),
                    limits.handshake_timeout,
                )
                .await
                {
                    Ok(p) => p,
                    Err(e) => {
                        stats.handshake_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%from, error = %e, "frontend handshake failed");
                        return;
                    }
                };
                drop(handshake);
                let Some(_peer_slot) = PeerSlot::take(&peers, &peer, limits.per_peer_max) else {
                    stats.refused_peer.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%from, %peer, "peer at its connection limit: refusing");
                    return;
                };
                if let Err(e) = handle(conn, backend, &limits).await {
                    stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, error = %e, "frontend connection ended");
                }
            });
        }
    })
}

/// One of a peer's connections, counted while it lives.
struct PeerSlot {
    peers: Arc<Mutex<HashMap<String, usize>>>,
    peer: String,
}

impl PeerSlot {
    fn take(peers: &Arc<Mutex<HashMap<String, usize>>>, peer: &str, max: usize) -> Option<Self> {
        let mut map = peers.lock();
        let n = map.entry(peer.to_string()).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(PeerSlot { peers: peers.clone(), peer: peer.to_string() })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut map = self.peers.lock();
        if let Some(n) = map.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.peer);
            }
        }
    }
}

async fn handle(
    conn: TcpStream,
    backend: Arc<dyn Backend>,
    limits: &ServeLimits,
) -> Result<(), FrameError> {
    let (mut rd, mut wr) = conn.into_split();
    // The request must arrive promptly; a silent peer does not hold a task forever.
    let req: WorkerRequest = match tokio::time::timeout(limits.request_timeout, read_frame(&mut rd))
        .await
    {
        Ok(Ok(Some(r))) => r,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => {
            let _ =
                write_frame(&mut wr, &GenEvent::Error(EngineError::invalid(e.to_string()))).await;
            return Err(e);
        }
        Err(_) => {
            let e = EngineError::invalid(format!("no request within {:?}", limits.request_timeout));
            let _ = write_frame(&mut wr, &GenEvent::Error(e)).await;
            return Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
        }
    };
    if backend.model(&req.model).is_none() {
        let e = EngineError::invalid(format!("this worker does not serve {:?}", req.model));
        return write_frame(&mut wr, &GenEvent::Error(e)).await;
    }
    let mut rx = match backend.submit(&req.model, req.request) {
        Ok(rx) => rx,
        Err(e) => return write_frame(&mut wr, &GenEvent::Error(e)).await,
    };
    let mut probe = [0u8; 1];
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else {
                    return write_frame(&mut wr, &GenEvent::Error(EngineError::Stopped)).await;
                };
                let last = matches!(ev, GenEvent::Done { .. } | GenEvent::Error(_));
                write_frame(&mut wr, &ev).await?;
                if last {
                    return Ok(());
                }
            }
            // The frontend sends nothing more: any read result means it hung up (or broke
            // the protocol). Either way the generation is cancelled by dropping `rx`.
            _ = rd.read(&mut probe) => return Ok(()),
        }
    }
}

/// Connects to the worker `worker`, authenticates, and sends a request; events are read
/// with [`read_frame`]. `timeout` bounds the connect and the handshake.
pub async fn connect(
    addr: SocketAddr,
    worker: &str,
    auth: &Auth,
    req: &WorkerRequest,
    timeout: Duration,
) -> Result<TcpStream, FrameError> {
    let mut s = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    s.set_nodelay(true)?;
    handshake::client(&mut s, auth.client(worker), handshake::nonce(), timeout).await?;
    write_frame(&mut s, req).await?;
    Ok(s)
}
