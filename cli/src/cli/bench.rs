//! `kvfabric bench`: the end-to-end benchmarks of `kvfabric-benches`, which print
//! percentiles and the ratio to this machine's own limits, measured in the same run. This
//! module parses their arguments and says where this binary is and how agents reach RDMA.

use clap::{Args, Subcommand};
use kvfabric_benches::{engine, fabric, router, serve, tier, trace, transfer, Host};

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
    /// A public production trace (Mooncake FAST'25 JSONL) replayed offline through a
    /// simulated deployment running kvfabric's router and tier policies: reuse per tier
    /// against the trace's limit, TTFT and ITL, KV moved, kv routing beside round-robin.
    Trace(trace::TraceArgs),
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let host = Host {
        exe: std::env::current_exe()
            .map_err(|e| anyhow::anyhow!("locating the kvfabric binary: {e}"))?,
        rdma: super::stack::rdma(),
        model: super::stack::default_model_path(),
    };
    match args.which {
        Which::Transfer(a) => transfer::run(a, &host).await?,
        Which::Tier(a) => tier::run(a, &host).await?,
        Which::Router(a) => router::run(a)?,
        Which::Fabric(a) => fabric::run(a, &host).await?,
        Which::Engine(a) => engine::run(a, &host).await?,
        Which::Serve(a) => serve::run(a).await?,
        Which::Trace(a) => trace::run(a).await?,
    }
    Ok(())
}
