//! Command-line definitions and dispatch. Options come from flags, then `KVFABRIC_*`
//! environment variables.

use clap::{Parser, Subcommand};

mod bench;
mod fabric;
mod hash;
pub mod peer;
mod plan;
mod soak;

/// kvfabric — a KV-cache data plane for LLM inference.
#[derive(Debug, Parser)]
#[command(name = "kvfabric", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Capacity planning: KV bytes per token and per sequence, tier sizes, transfer times.
    Plan(plan::PlanArgs),
    /// Block and sequence hashes of a token sequence (Dynamo-compatible XXH3).
    Hash(hash::HashArgs),
    /// Benchmarks (transfer, tier, router) with percentiles and ratios to this machine's limits.
    Bench(bench::BenchArgs),
    /// A standalone KV fabric node: a tiered block store behind the transfer engine,
    /// registered in discovery (etcd, or embedded), publishing KV events (NATS, or embedded).
    Fabric(fabric::FabricArgs),
    /// A transfer peer in its own process (for benchmarks and tests): prints its metadata,
    /// serves transfers, answers `sum OFFSET LEN` on stdin.
    Peer(peer::PeerArgs),
    /// Stores blocks into a disk tier forever (crash tests kill it with -9).
    #[command(hide = true)]
    TierSoak(soak::SoakArgs),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Plan(args) => plan::run(args),
        Command::Hash(args) => hash::run(args),
        Command::Bench(args) => runtime()?.block_on(bench::run(args)),
        Command::Peer(args) => runtime()?.block_on(peer::run(args)),
        Command::Fabric(args) => runtime()?.block_on(fabric::run(args)),
        Command::TierSoak(args) => runtime()?.block_on(soak::run(args)),
    }
}

/// The tokio runtime of commands that do I/O.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// An error chain on one line.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string().replace('\n', " ");
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}
