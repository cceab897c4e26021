//! `kvfabric bench`: end-to-end benchmarks that print percentiles and the ratio to this
//! machine's own limits, measured in the same run.

use clap::{Args, Subcommand};

mod cuda;
mod engine;
mod fabric;
mod measure;
mod router;
pub(crate) mod serve;
mod sse;
mod tier;
mod transfer;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Debug, Subcommand)]
enum Which {
    /// READ and WRITE over shm and tcp against a peer process, with memcpy and a plain TCP
    /// socket as the limits; H2D, D2H and D2D copies with `--transports cuda`.
    Transfer(transfer::TransferArgs),
    /// Offload and onboard throughput of the tiered store against plain O_DIRECT I/O.
    Tier(tier::TierArgs),
    /// Prefix-index ingestion and query latency, and a routing simulation.
    Router(router::RouterArgs),
    /// Remote get throughput from a fabric node against a plain transfer of the same bytes.
    Fabric(fabric::FabricArgs),
    /// Decode speed of the llama engine and of the whole serving loop against a plain candle
    /// generation loop on the same weights.
    Engine(engine::EngineArgs),
    /// Load on any OpenAI-compatible endpoint: TTFT, ITL, latency and throughput per
    /// concurrency level.
    Serve(serve::ServeArgs),
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.which {
        Which::Transfer(a) => transfer::run(a).await,
        Which::Tier(a) => tier::run(a).await,
        Which::Router(a) => router::run(a),
        Which::Fabric(a) => fabric::run(a).await,
        Which::Engine(a) => engine::run(a).await,
        Which::Serve(a) => serve::run(a).await,
    }
}

/// Parses sizes such as `4K`, `16KiB`, `1M`, `64MiB`, `4096`.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let (num, mult) = [
        ("kib", 1u64 << 10),
        ("mib", 1 << 20),
        ("gib", 1 << 30),
        ("k", 1 << 10),
        ("m", 1 << 20),
        ("g", 1 << 30),
    ]
    .iter()
    .find_map(|(suf, m)| lower.strip_suffix(suf).map(|n| (n.to_string(), *m)))
    .unwrap_or((lower.clone(), 1));
    let v: u64 = num
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!("invalid size {t:?} (use e.g. 4K, 16MiB)"))?;
    anyhow::ensure!(v > 0, "size must be > 0, got {t:?}");
    v.checked_mul(mult).ok_or_else(|| anyhow::anyhow!("size {t:?} overflows"))
}

/// Formats a byte size compactly (4K, 16M).
pub fn short_size(b: u64) -> String {
    if b >= 1 << 20 && b % (1 << 20) == 0 {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b % (1 << 10) == 0 {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("16KiB").unwrap(), 16384);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("0").is_err() && parse_size("x").is_err() && parse_size("-4K").is_err());
        assert_eq!(short_size(16 << 20), "16M");
        assert_eq!(short_size(4096), "4K");
        assert_eq!(short_size(1000), "1000");
    }
}
