//! The one HTTP call an attachment makes of its engine: a bounded `GET` (`/health`,
//! `/metrics`) with a deadline.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::net::TcpStream;

/// Why a `GET` of the engine failed: no connection, no answer in time, a broken or oversize
/// body.
#[derive(Debug, Clone, thiserror::Error)]
#[error("asking the engine at {addr}: {why}")]
pub struct GetError {
    /// The engine.
    pub addr: SocketAddr,
    /// Why.
    pub why: String,
}

/// Longest body [`get`] reads (an engine's `/metrics`).
const MAX_GET_BODY: usize = 8 << 20;

/// `GET path` on the engine at `addr`: the status and the body (at most 8 MiB), all within
/// `timeout`.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), GetError> {
    let run = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = hyper::Request::builder()
            .method("GET")
            .uri(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(http_body_util::Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let result = async {
            let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let mut body = resp.into_body();
            let mut out = Vec::new();
            while let Some(f) = body.frame().await {
                if let Ok(d) = f.map_err(|e| e.to_string())?.into_data() {
                    if out.len() + d.len() > MAX_GET_BODY {
                        return Err(format!("a body over {MAX_GET_BODY} bytes"));
                    }
                    out.extend_from_slice(&d);
                }
            }
            Ok((status, out))
        }
        .await;
        conn.abort();
        result
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(Ok(x)) => Ok(x),
        Ok(Err(why)) => Err(GetError { addr, why }),
        Err(_) => Err(GetError { addr, why: format!("no answer within {timeout:?}") }),
    }
}
