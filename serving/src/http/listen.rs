//! Serving HTTP on a listener with bounds: hyper's HTTP/1 server with a header-read timeout
//! that also closes idle keep-alive connections (the timer runs whenever the server waits for
//! a request head), and a cap on connections.
//!
//! Past the cap, a small reserve of connections is still served, one request each with a
//! short timeout and only for `/health` and `/metrics` (503 for anything else), so that health
//! checks and scrapes keep answering while idle or slow clients hold the main pool; past the
//! reserve, connections are closed at once. Every refusal is counted, and the first of each
//! saturation episode is logged. Request bodies are bounded by the routes
//! ([`super::BodyLimits`]).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use kvfabric::tls::{Stream, Tls};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

pub use crate::metrics::ListenStats;

/// Serves a hyper connection (HTTP/1 or HTTP/2: the two types share no trait) until it ends,
/// or until `stop` turns true: then asks it to finish its requests and waits for it.
macro_rules! serve_until_stopped {
    ($conn:expr, $stop:expr) => {{
        let conn = $conn;
        tokio::pin!(conn);
        let stopping = tokio::select! {
            _ = conn.as_mut() => false,
            r = $stop.wait_for(|s| *s) => r.is_ok(),
        };
        if stopping {
            conn.as_mut().graceful_shutdown();
            let _ = conn.as_mut().await;
        }
    }};
}

/// Streams one HTTP/2 connection may have open at once.
const H2_STREAMS_MAX: u32 = 256;

/// Bounds of an HTTP listener.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// Connections served at once (the main pool).
    pub connections_max: usize,
    /// Connections served past the cap, one request each, with `reserve_timeout`.
    pub reserve: usize,
    /// A request head must arrive within this, and an idle keep-alive connection is closed
    /// after it.
    pub header_read_timeout: Duration,
    /// The header timeout of reserve connections.
    pub reserve_timeout: Duration,
    /// At shutdown, connections get this long to finish their requests.
    pub shutdown_grace: Duration,
    /// The only paths that reserve connections serve (503 for any other).
    pub reserve_paths: &'static [&'static str],
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            connections_max: 1024,
            reserve: 32,
            header_read_timeout: Duration::from_secs(10),
            reserve_timeout: Duration::from_secs(2),
            shutdown_grace: Duration::from_secs(10),
            reserve_paths: &["/health", "/metrics"],
        }
    }
}

/// The answer of a reserve connection to anything but its paths: 503 in OpenAI's shape, and
/// the connection closes.
fn busy() -> axum::response::Response {
    use axum::response::IntoResponse;
    let e = super::ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "the server is at its connection limit; retry later",
        "server_error",
    );
    let mut r = e.into_response();
    r.headers_mut()
        .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    r
}

/// Binds an HTTP listener with a deep accept queue (4096, the kernel caps it at
/// `net.core.somaxconn`): a burst of connections waits in the kernel instead of retrying SYNs.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(4096)
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes; then stops
/// accepting, asks open connections to finish, and waits for them up to the grace period.
///
/// With `tls`, every connection is HTTPS (the TLS handshake bounded by the header timeout,
/// its failure counted in `kvfabric_tls_handshake_failures_total`), and HTTP/2 is served to
/// clients that ask for it by ALPN; HTTP/1.1 otherwise. The certificates in use are the
/// latest loaded ([`Tls::reload`]): open connections keep theirs.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    stats: ListenStats,
    tls: Option<Arc<Tls>>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let main = Arc::new(Semaphore::new(limits.connections_max.max(1)));
    let reserve = Arc::new(Semaphore::new(limits.reserve));
    let saturated = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, from) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or similar: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Reap finished connection tasks as we go.
        while tasks.try_join_next().is_some() {}
        let (permit, timeout, keep_alive) = match main.clone().try_acquire_owned() {
            Ok(p) => {
                saturated.store(false, Ordering::Relaxed);
                (p, limits.header_read_timeout, true)
            }
            Err(_) => {
                if !saturated.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        connections_max = limits.connections_max,
                        "HTTP listener at its connection cap: serving from the reserve"
                    );
                }
                match reserve.clone().try_acquire_owned() {
                    Ok(p) => {
                        stats.reserve.inc();
                        (p, limits.reserve_timeout, false)
                    }
                    Err(_) => {
                        stats.refused.inc();
                        tracing::debug!(%from, "HTTP connection refused: pool and reserve full");
                        continue;
                    }
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let (app, stats, mut stop) = (app.clone(), stats.clone(), stop_rx.clone());
        let reserve_paths = limits.reserve_paths;
        let tls = tls.clone();
        tasks.spawn(async move {
            stats.open.inc();
            let stream = match &tls {
                None => Some(Stream::Plain(stream)),
                Some(tls) => match tls.accept_api(stream, from, timeout).await {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::debug!(%from, error = %e, "HTTPS handshake failed");
                        None
                    }
                },
            };
            if let Some(stream) = stream {
                // A reserve connection answers only what an operator needs while the pool
                // is full (health checks, scrapes); anything else gets 503 without its body
                // read.
                let app = TowerToHyperService::new(app);
                let service = hyper::service::service_fn(move |req: hyper::Request<_>| {
                    let refused = !keep_alive && !reserve_paths.contains(&req.uri().path());
                    let app = app.clone();
                    async move {
                        if refused {
                            return Ok(busy());
                        }
                        hyper::service::Service::call(&app, req).await
                    }
                });
                if stream.alpn() == Some(b"h2") {
                    let mut builder = http2::Builder::new(TokioExecutor::new());
                    // Pings bound a silent peer; streams per connection are bounded.
                    builder
                        .timer(TokioTimer::new())
                        .keep_alive_interval(Some(timeout))
                        .keep_alive_timeout(timeout)
                        .max_concurrent_streams(H2_STREAMS_MAX);
                    serve_until_stopped!(
                        builder.serve_connection(TokioIo::new(stream), service),
                        stop
                    );
                } else {
                    let mut builder = http1::Builder::new();
                    builder
                        .timer(TokioTimer::new())
                        .header_read_timeout(timeout)
                        .keep_alive(keep_alive);
                    serve_until_stopped!(
                        builder.serve_connection(TokioIo::new(stream), service),
                        stop
                    );
                }
            }
            // The permit goes back before the gauge drops, so that a caller who sees no open
            // connection finds the whole pool free.
            drop(permit);
            stats.open.dec();
        });
    }
    // Closed before the drain: a connection made now is refused (the client, or its load
    // balancer, goes to another server) rather than left in the backlog and reset when the
    // process exits.
    drop(listener);
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(limits.shutdown_grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}
