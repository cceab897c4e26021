//! The frontend↔worker protocol: how a worker appears in discovery ([`WorkerMetadata`] under
//! [`WORKER_KIND`] or [`PREFILL_KIND`]), and the request transport: TCP, one connection per request,
//! length-prefixed JSON frames (`u32` little-endian length, then the JSON, at most
//! [`MAX_FRAME`] bytes).
//!
//! The frontend sends one [`WorkerRequest`]; the worker answers with [`GenEvent`] frames
//! (`started`, `token`…, then `done` or `error`) and closes. A frontend that closes the
//! connection cancels the generation: the worker notices at once and drops its receiver,
//! which frees the sequence's KV. Malformed, oversize or late frames get an `error` frame
//! and the connection is closed; nothing a peer sends can panic the worker.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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
}

impl CodecSpec {
    /// Loads the codec (reads the GGUF's metadata, not its weights).
    pub fn load(&self) -> Result<TextCodec, EngineError> {
        match self {
            CodecSpec::Bytes => Ok(TextCodec::bytes()),
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
    let mut body = vec![0u8; n];
    r.read_exact(&mut body).await?;
    Ok(Some(serde_json::from_slice(&body)?))
}

/// Serves generation requests from frontends on `listener`, until the task is aborted.
pub fn serve(listener: TcpListener, backend: Arc<dyn Backend>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let (conn, _) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a frontend connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let backend = backend.clone();
            tokio::spawn(async move {
                if let Err(e) = handle(conn, backend).await {
                    tracing::debug!(error = %e, "frontend connection ended");
                }
            });
        }
    })
}

async fn handle(conn: TcpStream, backend: Arc<dyn Backend>) -> Result<(), FrameError> {
    conn.set_nodelay(true)?;
    let (mut rd, mut wr) = conn.into_split();
    // The request must arrive promptly; a silent peer does not hold a task forever.
    let req: WorkerRequest =
        match tokio::time::timeout(Duration::from_secs(10), read_frame(&mut rd)).await {
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => {
                let _ = write_frame(&mut wr, &GenEvent::Error(EngineError::invalid(e.to_string())))
                    .await;
                return Err(e);
            }
            Err(_) => {
                let e = EngineError::invalid("no request within 10 s");
                let _ = write_frame(&mut wr, &GenEvent::Error(e)).await;
                return Ok(());
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

/// Connects to a worker and sends a request; events are read with [`read_frame`].
pub async fn connect(
    addr: SocketAddr,
    req: &WorkerRequest,
    timeout: Duration,
) -> Result<TcpStream, FrameError> {
    let mut s = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    s.set_nodelay(true)?;
    write_frame(&mut s, req).await?;
    Ok(s)
}
