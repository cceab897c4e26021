//! What the transfer benchmarks share (`bench transfer`, its CUDA rows): the stopping rule,
//! the timed loops, the rows they print, the peer process they measure against.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::Context;
use kvfabric::agent::{Agent, AgentMetadata};
use kvfabric::transfer::TransferRequest;
use kvfabric_planner::stats::{gbps, Percentiles};

/// The stopping rule of every measurement: at least 5 iterations and `min_time`, at most
/// 2000 iterations or 4 × `min_time`.
pub(crate) fn keep_measuring(done: usize, start: Instant, min_time: Duration) -> bool {
    (done < 5 || start.elapsed() < min_time) && done < 2000 && start.elapsed() < 4 * min_time
}

/// Runs `f` (one iteration) until `min_time` and at least 5 iterations (at most 2000 or
/// 4 × min_time), after one warm-up; returns the per-iteration latencies.
pub(crate) fn measure_sync(
    min_time: Duration,
    mut f: impl FnMut() -> crate::Result<()>,
) -> crate::Result<Vec<Duration>> {
    f()?;
    let mut lat = Vec::new();
    let start = Instant::now();
    while keep_measuring(lat.len(), start, min_time) {
        let t = Instant::now();
        f()?;
        lat.push(t.elapsed());
    }
    Ok(lat)
}

/// Posts `req` once to warm up, then until the stopping rule of [`keep_measuring`]; the
/// latency of each transfer.
pub(crate) async fn measure_posts(
    agent: &Agent,
    req: &TransferRequest,
    min_time: Duration,
) -> crate::Result<Vec<Duration>> {
    agent.post(req.clone())?.wait().await?;
    let mut lat = Vec::new();
    let start = Instant::now();
    while keep_measuring(lat.len(), start, min_time) {
        let t = Instant::now();
        agent.post(req.clone())?.wait().await?;
        lat.push(t.elapsed());
    }
    Ok(lat)
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct Row {
    pub(crate) transport: &'static str,
    pub(crate) op: &'static str,
    pub(crate) desc_bytes: u64,
    pub(crate) batch: usize,
    pub(crate) bytes: u64,
    pub(crate) iterations: usize,
    pub(crate) gbps: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) limit: &'static str,
    pub(crate) limit_gbps: f64,
    pub(crate) ratio_to_limit: f64,
    pub(crate) memcpy_gbps: f64,
    pub(crate) tcp_socket_gbps: f64,
    pub(crate) checksum: bool,
}

/// The `(descriptor size, batch)` pairs whose transfer fits in `max_bytes`, sizes outer.
pub(crate) fn combos(sizes: &[u64], batches: &[usize], max_bytes: u64) -> Vec<(u64, usize)> {
    sizes
        .iter()
        .flat_map(|&s| batches.iter().map(move |&b| (s, b)))
        .filter(|&(s, b)| s.saturating_mul(b as u64) <= max_bytes)
        .collect()
}

impl Row {
    /// A row of `batch` descriptors of `desc` bytes whose transfers took `lat` each, against
    /// `limit` measured at `limit_gbps`; no checksums, no memcpy or socket limit.
    pub(crate) fn measured(
        (transport, op): (&'static str, &'static str),
        (desc, batch): (u64, usize),
        lat: &[Duration],
        (limit, limit_gbps): (&'static str, f64),
    ) -> Row {
        let bytes = desc * batch as u64;
        let p = Percentiles::of(lat);
        let rate = gbps(bytes * lat.len() as u64, lat.iter().sum());
        Row {
            transport,
            op,
            desc_bytes: desc,
            batch,
            bytes,
            iterations: lat.len(),
            gbps: rate,
            p50_us: p.p50_us,
            p99_us: p.p99_us,
            limit,
            limit_gbps,
            ratio_to_limit: rate / limit_gbps,
            memcpy_gbps: f64::NAN,
            tcp_socket_gbps: f64::NAN,
            checksum: false,
        }
    }
}

pub(crate) async fn spawn_peer(
    host: &crate::Host,
    secret: &str,
    region_bytes: usize,
    extra: &[&str],
) -> crate::Result<(tokio::process::Child, AgentMetadata)> {
    let mut child = tokio::process::Command::new(&host.exe)
        .args([
            "peer",
            "--name",
            "bench-peer",
            "--region-bytes",
            &region_bytes.to_string(),
            "--seed",
            "1",
        ])
        .args(extra)
        .env("KVFABRIC_SECRET", secret)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the peer process")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("peer did not start within 30 s")??
        .context("peer exited before printing its metadata")?;
    let v: serde_json::Value = serde_json::from_str(&line)?;
    let md: AgentMetadata =
        serde_json::from_value(v["metadata"].clone()).context("peer metadata")?;
    // Keep draining the peer's stdout so that it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, md))
}

pub(crate) fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}
