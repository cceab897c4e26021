//! Request bodies, bounded before any handler sees them: a body that announces more than the
//! limit is refused with 413 before a byte of it is read (and before `100 Continue` is sent to
//! a client that asked with `Expect`); a body is read within a deadline that grows with what
//! arrived — a grace period plus the time the bytes received so far take at a minimum rate —
//! so a request whose body stops, or drips, is answered 408 and its connection closed. With
//! the head's own timeout ([`super::listen::HttpLimits::header_read_timeout`]) this bounds a
//! whole request.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use super::api::ApiError;

/// How request bodies are read.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// Largest body accepted, bytes.
    pub bytes_max: usize,
    /// Time a body may take beyond what its size needs at the minimum rate.
    pub grace: Duration,
    /// Slowest rate a body may arrive at, bytes per second, once its grace is spent.
    pub bytes_per_s_min: u64,
}

impl Default for BodyLimits {
    fn default() -> Self {
        BodyLimits { bytes_max: 4 << 20, grace: Duration::from_secs(10), bytes_per_s_min: 64 << 10 }
    }
}

fn too_large(max: usize) -> Response {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request body is over the limit of {max} bytes"),
        "invalid_request_error",
    )
    .into_response()
}

/// The middleware: reads the body within `limits`, then hands the request on with its body
/// in memory.
pub(super) async fn bounded(
    State(limits): State<BodyLimits>,
    req: Request,
    next: Next,
) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if announced.is_some_and(|n| n > limits.bytes_max as u64) {
        return too_large(limits.bytes_max);
    }
    let (parts, body) = req.into_parts();
    match read(body, limits).await {
        Ok(bytes) => next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Err(r) => r,
    }
}

async fn read(body: Body, limits: BodyLimits) -> Result<Bytes, Response> {
    let start = tokio::time::Instant::now();
    let rate = limits.bytes_per_s_min.max(1);
    let mut body = body;
    let mut buf = bytes::BytesMut::new();
    loop {
        // Bounded first: at most `bytes_max` (4 MiB by default) over the rate, in seconds.
        let allowed = limits.grace + Duration::from_secs_f64(buf.len() as f64 / rate as f64);
        let frame = match tokio::time::timeout_at(start + allowed, body.frame()).await {
            Err(_) => {
                let message = format!(
                    "the request body did not arrive in time: {} bytes in {:.1} s (at least {} \
                     bytes/s after {:?})",
                    buf.len(),
                    start.elapsed().as_secs_f64(),
                    rate,
                    limits.grace
                );
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    message,
                    "invalid_request_error",
                )
                .into_response());
            }
            Ok(None) => return Ok(buf.freeze()),
            Ok(Some(Err(e))) => {
                return Err(ApiError::invalid(format!("reading the request body: {e}"), "body")
                    .into_response())
            }
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limits.bytes_max {
                return Err(too_large(limits.bytes_max));
            }
            buf.extend_from_slice(&data);
        }
    }
}
