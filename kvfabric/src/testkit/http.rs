//! A minimal HTTP/1.1 client over real sockets for integration tests (no client library: the
//! tests also send what a library would refuse to, and hang up mid-stream), reading metrics
//! and streams, and waiting on a condition. Every crate's tests that speak HTTP use it. Its
//! helpers panic on what a test treats as a failure.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body))
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent event stream.
    pub fn sse(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")).map(str::to_string))
            .collect()
    }
}

/// Sends raw request bytes and reads the whole response (the server closes).
pub async fn raw(addr: SocketAddr, request: &[u8]) -> Response {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(300), s.read_to_end(&mut buf))
        .await
        .expect("response within 300 s")
        .expect("read");
    parse_response(&buf)
}

/// Sends raw request bytes over TLS (trusting `ca`, presenting `identity` — a certificate
/// and its key — when given) and reads the whole response; the TLS error if the handshake or
/// the exchange fails.
pub async fn raw_tls(
    addr: SocketAddr,
    ca: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
    request: &[u8],
) -> std::io::Result<Response> {
    let config = crate::tls::client_config(ca, identity).map_err(std::io::Error::other)?;
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    let mut s = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
    s.write_all(request).await?;
    s.flush().await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(300), s.read_to_end(&mut buf))
        .await
        .map_err(|_| std::io::Error::other("no response within 300 s"))??;
    Ok(parse_response(&buf))
}

pub fn request_bytes(method: &str, path: &str, body: Option<&str>) -> Vec<u8> {
    let body = body.unwrap_or("");
    format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub async fn get(addr: SocketAddr, path: &str) -> Response {
    raw(addr, &request_bytes("GET", path, None)).await
}

pub async fn post(addr: SocketAddr, path: &str, body: &str) -> Response {
    raw(addr, &request_bytes("POST", path, Some(body))).await
}

pub async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Response {
    post(addr, path, &body.to_string()).await
}

pub fn parse_response(buf: &[u8]) -> Response {
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n").expect("end of headers");
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = buf[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Response { status, headers, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&b[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok())
            .expect("chunk size");
        b = &b[eol + 2..];
        if size == 0 || b.len() < size {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[(size + 2).min(b.len())..];
    }
    out
}

/// The value of a Prometheus sample (`name{labels}` exactly as exposed).
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {sample} in metrics"))
}

/// The sum of every sample of the family `name` (with any labels).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    let samples: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse().ok()
        })
        .collect();
    assert!(!samples.is_empty(), "no sample of {name} in metrics");
    samples.iter().sum()
}

/// The streamed text of an SSE response (chat deltas or completion texts), and the chunks.
pub fn streamed_text(r: &Response) -> (String, Vec<Value>) {
    let mut text = String::new();
    let mut chunks = Vec::new();
    for d in r.sse() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).expect("chunk is JSON");
        if let Some(c) = v["choices"].get(0) {
            if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
                text.push_str(t);
            }
        }
        chunks.push(v);
    }
    (text, chunks)
}

/// Polls `cond` until it holds; panics after `limit` (a test waits on a condition, never on
/// a guessed sleep).
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "condition not met within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
