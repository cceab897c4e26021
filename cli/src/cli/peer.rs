//! `kvfabric peer`: a transfer peer in its own process. It starts an agent, allocates one
//! shareable exported region filled with a seeded pattern, prints its metadata as one JSON
//! line, and answers line commands on stdin until `exit` or end of input:
//!
//! - `sum OFFSET LEN` → `{"sum": XXH3-64 of those bytes}`
//! - `fill SEED` → refills the region with the pattern of SEED → `{"ok": true}`
//!
//! Every notification it receives is printed as `{"notified": TEXT, "from": NAME, "sum": S}`,
//! where S is the XXH3-64 of the range `OFFSET LEN` named by a `sum OFFSET LEN` text, computed
//! the moment the notification arrives (null for other texts). `kvfabric bench transfer` and
//! the two-process tests drive it.

use std::io::Write;
use std::net::SocketAddr;

use anyhow::Context;
use clap::Args;
use kvfabric::agent::Agent;
use kvfabric::memory::{Region, RegionOptions};
use tokio::io::AsyncBufReadExt;

#[derive(Debug, Args)]
pub struct PeerArgs {
    /// Agent name.
    #[arg(long, default_value = "peer")]
    name: String,
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Shared secret of the transfer handshake.
    #[arg(long, env = "KVFABRIC_SECRET", hide_env_values = true)]
    secret: kvfabric::secret::Secret,
    #[command(flatten)]
    tls: super::tls::TlsArgs,
    /// Bytes of the exported region.
    #[arg(long, default_value_t = 64 << 20)]
    region_bytes: usize,
    /// Seed of the region's fill pattern.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also export a region of this many bytes of GPU memory on CUDA device 0 (peers on this
    /// host reach it through CUDA IPC); 0: none.
    #[arg(long, default_value_t = 0)]
    device_bytes: usize,
}

/// The byte at `i` of the pattern of `seed`; the tests recompute it.
pub fn pattern_byte(seed: u64, i: u64) -> u8 {
    (i.wrapping_mul(0x9e37_79b9).wrapping_add(seed.wrapping_mul(131)) >> 7) as u8
}

fn fill(region: &Region, seed: u64) -> anyhow::Result<()> {
    const CHUNK: usize = 1 << 20;
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0usize;
    while off < region.len() {
        let n = CHUNK.min(region.len() - off);
        for (j, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern_byte(seed, (off + j) as u64);
        }
        region.write_at(off as u64, &buf[..n])?;
        off += n;
    }
    Ok(())
}

fn sum_of(region: &Region, text: &str) -> Option<u64> {
    let mut it = text.split_whitespace();
    if it.next()? != "sum" {
        return None;
    }
    let off: u64 = it.next()?.parse().ok()?;
    let len: u64 = it.next()?.parse().ok()?;
    region.checksum(off, len).ok()
}

fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

pub async fn run(args: PeerArgs) -> anyhow::Result<()> {
    let mut cfg = super::stack::agent_config(args.name, args.secret);
    cfg.tls = args.tls.load()?;
    cfg.listen = args.listen;
    let agent = Agent::start(cfg).await?;
    let region = agent
        .alloc_region(
            args.region_bytes,
            RegionOptions { shared: true, export: true, huge_pages: false },
        )
        .context("allocating the peer region")?;
    fill(&region, args.seed)?;
    let _gpu = (args.device_bytes > 0)
        .then(|| agent.alloc_device_region(0, args.device_bytes, true))
        .transpose()
        .context("allocating the peer's GPU region")?;
    emit(serde_json::json!({ "metadata": agent.metadata() }));

    let watcher = {
        let (agent, region) = (agent.clone(), region.clone());
        tokio::spawn(async move {
            while let Some(n) = agent.next_notification().await {
                let text = String::from_utf8_lossy(&n.message).to_string();
                let sum = sum_of(&region, &text);
                emit(serde_json::json!({ "notified": text, "from": n.from, "sum": sum }));
            }
        })
    };
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let line = line.trim();
        if line == "exit" {
            break;
        }
        if let Some(seed) = line.strip_prefix("fill ") {
            let seed: u64 = seed.trim().parse().context("fill SEED")?;
            fill(&region, seed)?;
            emit(serde_json::json!({ "ok": true }));
        } else if line.starts_with("sum ") {
            emit(serde_json::json!({ "sum": sum_of(&region, line) }));
        } else if !line.is_empty() {
            emit(serde_json::json!({ "error": format!("unknown command {line:?}") }));
        }
    }
    watcher.abort();
    agent.shutdown();
    Ok(())
}
