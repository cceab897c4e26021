//! `kvfabric bench router`: (a) the prefix index's event ingestion rate and query latency for
//! 8, 64 and 256 workers holding 10k or 100k blocks each; (b) the routing simulation
//! (multi-turn conversations over shared system prompts) comparing kv, round-robin and
//! random routing: hit rate, TTFT p50/p99, throughput.

use std::time::Instant;

use clap::Args;
use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::SequenceHash;
use kvfabric::rng::SplitMix64;
use kvfabric_planner::sim::conversations::{floor_ttft_p50_s, Conversations};
use kvfabric_planner::sim::{simulate, SimConfig};
use kvfabric_planner::stats::Percentiles;
use kvfabric_planner::trace::Reshape;
use kvfabric_router::{PrefixIndex, RouterConfig, RoutingMode, WorkerId};

#[derive(Debug, Args)]
pub struct RouterArgs {
    /// Worker counts for the index benchmark.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256")]
    workers: Vec<usize>,
    /// Blocks per worker for the index benchmark.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000")]
    blocks: Vec<usize>,
    /// Blocks per query (a 1024-token prompt at 16 tokens per block).
    #[arg(long, default_value_t = 64)]
    query_blocks: usize,
    /// Queries per index configuration.
    #[arg(long, default_value_t = 50_000)]
    queries: usize,
    /// Skip the index benchmark (a) and run only the simulation (b).
    #[arg(long)]
    sim_only: bool,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    sim_workers: usize,
    /// Simulated conversations.
    #[arg(long, default_value_t = 400)]
    conversations: usize,
    /// New conversations per second.
    #[arg(long, default_value_t = 4.0)]
    arrival_rate: f64,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Tokens of each shared system prompt.
    #[arg(long, default_value_t = 1024)]
    system_prompt_tokens: u32,
    /// The kv mode's `block_load_scale`: active decode blocks per prefill-block equivalent
    /// (the router's default is 8; the simulation has no decode contention, so larger values
    /// suit it).
    #[arg(long)]
    block_load_scale: Option<f64>,
    /// Workload seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Plot the simulation's TTFT p50 and p99 per routing mode, with the workload's floor
    /// (dashed), to this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Print JSON objects instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
struct IndexRow {
    workers: usize,
    blocks_per_worker: usize,
    indexed_blocks: usize,
    events: u64,
    events_per_s: f64,
    query_blocks: usize,
    query_p50_us: f64,
    query_p99_us: f64,
}

/// Each worker's blocks: chains of 64 blocks; half the chains start with one of 16 shared
/// 32-block prefixes (system prompts), so workers overlap as real fleets do.
fn worker_chains(
    w: usize,
    blocks: usize,
    rng: &mut SplitMix64,
    shared: &[Vec<SequenceHash>],
) -> Vec<Vec<SequenceHash>> {
    let mut chains = Vec::new();
    let mut n = 0;
    while n < blocks {
        let mut c: Vec<SequenceHash> = Vec::with_capacity(64);
        if chains.len() % 2 == 0 {
            c.extend_from_slice(&shared[(w + chains.len()) % shared.len()]);
        }
        while c.len() < 64 {
            c.push(SequenceHash(rng.next_u64()));
        }
        n += c.len();
        chains.push(c);
    }
    chains
}

fn index_bench(workers: usize, blocks: usize, query_blocks: usize, queries: usize) -> IndexRow {
    let mut rng = SplitMix64(7);
    let shared: Vec<Vec<SequenceHash>> =
        (0..16).map(|_| (0..32).map(|_| SequenceHash(rng.next_u64())).collect()).collect();
    let per_worker: Vec<Vec<Vec<SequenceHash>>> =
        (0..workers).map(|w| worker_chains(w, blocks, &mut rng, &shared)).collect();
    // Events: one block per Stored event, the worst case for the ingestion rate.
    let events: Vec<(WorkerId, KvEvent)> = per_worker
        .iter()
        .enumerate()
        .flat_map(|(w, chains)| {
            chains.iter().flatten().enumerate().map(move |(i, &h)| {
                (
                    WorkerId(w as u64),
                    KvEvent {
                        event_id: i as u64 + 1,
                        data: KvEventData::Stored {
                            sequence_hashes: vec![h],
                            parent: None,
                            tier: TierKind::Host,
                        },
                    },
                )
            })
        })
        .collect();
    let index = PrefixIndex::new();
    for w in (0..workers as u64).map(WorkerId) {
        index.add_worker(w);
    }
    let start = Instant::now();
    for (w, e) in &events {
        index.ingest(*w, e);
    }
    let ingest = start.elapsed();
    // Queries: a chain of some worker (a hit of up to 64 blocks) extended with fresh blocks.
    let mut lat = Vec::with_capacity(queries);
    let mut q: Vec<SequenceHash> = Vec::with_capacity(query_blocks);
    for _ in 0..queries {
        let w = (rng.next_u64() % workers as u64) as usize;
        let chains = &per_worker[w];
        let c = &chains[(rng.next_u64() % chains.len() as u64) as usize];
        q.clear();
        q.extend(c.iter().take(query_blocks));
        while q.len() < query_blocks {
            q.push(SequenceHash(rng.next_u64()));
        }
        let t = Instant::now();
        let o = index.overlap(&q);
        lat.push(t.elapsed());
        std::hint::black_box(o);
    }
    let p = Percentiles::of(&lat);
    IndexRow {
        workers,
        blocks_per_worker: blocks,
        indexed_blocks: index.len(),
        events: events.len() as u64,
        events_per_s: events.len() as f64 / ingest.as_secs_f64().max(1e-9),
        query_blocks,
        query_p50_us: p.p50_us,
        query_p99_us: p.p99_us,
    }
}

#[derive(Debug, serde::Serialize)]
struct SimRow {
    mode: &'static str,
    requests: u64,
    hit_rate: f64,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    throughput_tok_s: f64,
    throughput_req_s: f64,
}

pub fn run(args: RouterArgs) -> crate::Result<()> {
    if !args.sim_only {
        let mut rows = Vec::new();
        for &w in &args.workers {
            for &b in &args.blocks {
                eprintln!("index: {w} workers × {b} blocks");
                rows.push(index_bench(
                    w.max(1),
                    b.max(1),
                    args.query_blocks.max(1),
                    args.queries.max(1),
                ));
            }
        }
        if args.json {
            for r in &rows {
                println!("{}", serde_json::to_string(r)?);
            }
        } else {
            println!(
                "{:>7} {:>13} {:>9} {:>11} {:>12} {:>13} {:>10} {:>10}",
                "workers",
                "blocks/worker",
                "indexed",
                "events",
                "events/s",
                "query blocks",
                "q p50",
                "q p99"
            );
            for r in &rows {
                println!(
                    "{:>7} {:>13} {:>9} {:>11} {:>11.2}M {:>13} {:>8.2}µs {:>8.2}µs",
                    r.workers,
                    r.blocks_per_worker,
                    r.indexed_blocks,
                    r.events,
                    r.events_per_s / 1e6,
                    r.query_blocks,
                    r.query_p50_us,
                    r.query_p99_us
                );
            }
            println!("(one block per Stored event, one thread; queries on precomputed sequence hashes)\n");
        }
    }
    // The workload, as a trace, and the deployment that replays it: workers with a linear
    // engine model (5,000 prompt tokens/s, 20 ms decode steps, continuous batching) and a
    // 4,096-block device cache each, the index fed only by their KV events, load tracked
    // exactly by the router (no periodic reports).
    let workload = Conversations {
        conversations: args.conversations.max(1),
        arrival_rate: args.arrival_rate,
        turns: args.turns.max(1),
        system_prompt_tokens: u64::from(args.system_prompt_tokens),
        seed: args.seed,
        ..Conversations::default()
    };
    let trace = workload.requests();
    let output_tokens: u64 = trace.iter().map(|r| r.output_length).sum();
    let base = SimConfig {
        workers: args.sim_workers.max(1),
        block_tokens: workload.block_tokens,
        block_load_scale: args.block_load_scale,
        reshape: Reshape::none(workload.block_tokens.get()),
        tier_blocks: [4096, 0, 0],
        prefill_tokens_per_s: 5_000.0,
        decode_step_ms: 20.0,
        load_report_s: 0.0,
        seed: args.seed,
        ..SimConfig::default()
    };
    let floor_ms = floor_ttft_p50_s(&trace, workload.block_tokens, base.prefill_tokens_per_s) * 1e3;
    let mut rows = Vec::new();
    for (name, mode) in [
        ("kv", RoutingMode::Kv),
        ("round-robin", RoutingMode::RoundRobin),
        ("random", RoutingMode::Random),
    ] {
        let start = Instant::now();
        let cfg = SimConfig { mode, ..base.clone() };
        let r = simulate(trace.iter().cloned().map(Ok), &cfg)
            .map_err(|e| crate::failed!("simulating {name}: {e}"))?;
        eprintln!("simulated {name} in {:?}", start.elapsed());
        let span = r.span_s.max(1e-9);
        rows.push(SimRow {
            mode: name,
            requests: r.requests,
            hit_rate: r.reuse(),
            ttft_p50_ms: r.ttft_s[0] * 1e3,
            ttft_p99_ms: r.ttft_s[2] * 1e3,
            throughput_tok_s: output_tokens as f64 / span,
            throughput_req_s: r.requests as f64 / span,
        });
    }
    if let Some(path) = &args.plot {
        use crate::plot::{render, Chart, Series};
        let mut series: Vec<Series> = rows
            .iter()
            .map(|r| Series::line(r.mode, vec![(50.0, r.ttft_p50_ms), (99.0, r.ttft_p99_ms)]))
            .collect();
        series.push(Series {
            dashed: true,
            ..Series::line("floor (p50)", vec![(50.0, floor_ms), (99.0, floor_ms)])
        });
        let chart = Chart {
            title: "Simulated TTFT by routing mode".into(),
            x_label: format!(
                "percentile ({} workers, {} conversations)",
                base.workers, workload.conversations
            ),
            y_label: "TTFT, ms".into(),
            x_log2: false,
            x_bytes: false,
            series,
        };
        std::fs::write(path, render(&[chart], 1))
            .map_err(|e| crate::failed!("writing {}: {e}", path.display()))?;
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "workload": workload, "simulation": base, "floor_ttft_p50_ms": floor_ms, "results": rows })
        );
        return Ok(());
    }
    println!(
        "simulation: {} workers, {} conversations × {} turns, {} system prompts of {} tokens, {} new conversations/s (seed {}), kv block_load_scale {}",
        base.workers, workload.conversations, workload.turns, workload.system_prompts, workload.system_prompt_tokens, workload.arrival_rate, workload.seed,
        args.block_load_scale.unwrap_or(RouterConfig::default().block_load_scale)
    );
    println!(
        "{:>12} {:>8} {:>8} {:>11} {:>11} {:>10} {:>8}",
        "mode", "requests", "hit rate", "TTFT p50", "TTFT p99", "tok/s", "req/s"
    );
    for r in &rows {
        println!(
            "{:>12} {:>8} {:>7.1}% {:>9.1}ms {:>9.1}ms {:>10.0} {:>8.2}",
            r.mode,
            r.requests,
            r.hit_rate * 100.0,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.throughput_tok_s,
            r.throughput_req_s
        );
    }
    println!(
        "{:>12} {:>8} {:>8} {:>9.1}ms   (only blocks no earlier prompt had, never queued: no router does better)",
        "floor", "", "", floor_ms
    );
    if let (Some(kv), Some(rr)) = (rows.first(), rows.get(1)) {
        println!(
            "kv vs round-robin: TTFT p50 {:.2}× better (the floor bounds it at {:.2}×); kv is {:.2}× the floor",
            rr.ttft_p50_ms / kv.ttft_p50_ms.max(1e-9),
            rr.ttft_p50_ms / floor_ms.max(1e-9),
            kv.ttft_p50_ms / floor_ms.max(1e-9)
        );
    }
    Ok(())
}
