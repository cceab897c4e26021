//! `kvfabric bench trace FILE`: a public production trace (Mooncake FAST'25 JSONL) replayed
//! offline through a simulated deployment that runs kvfabric's real router and tier policies
//! ([`sim`]), with the same run under round-robin routing beside it, against the trace's
//! limit (what an infinite cache would reuse).

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use crate::Context;
use kvfabric::events::TierKind;
use kvfabric::layout::ModelSpec;
use kvfabric_planner::plan::Link;
use kvfabric_planner::trace::Reshape;
use kvfabric_router::RoutingMode;

use kvfabric_planner::sim::{self, SimConfig, SimResult};

/// How a trace's ids become prompts (`bench trace` and `bench serve --trace` alike).
#[derive(Debug, Clone, Args)]
pub struct ShapeArgs {
    /// Tokens per hash id of the trace.
    #[arg(long, default_value_t = 512)]
    pub trace_block_tokens: u32,
    /// Replay each id as this many tokens instead (default: as the trace says): the trace's
    /// sharing on prompts that many times shorter, for small engines and quick runs.
    #[arg(long)]
    pub replay_block_tokens: Option<u32>,
    /// Cut answers at this many tokens.
    #[arg(long)]
    pub output_tokens_max: Option<u64>,
    /// Refuse a trace line whose prompt is longer than this many tokens (with its line
    /// number); at most 16777216. Replays hold each request in flight, so this bounds
    /// their memory.
    #[arg(long, default_value_t = kvfabric_planner::trace::PROMPT_TOKENS_MAX,
        value_parser = clap::value_parser!(u64).range(1..=kvfabric_planner::trace::LENGTH_MAX))]
    pub max_prompt_tokens: u64,
}

impl ShapeArgs {
    /// The reshaping these flags ask for.
    pub fn reshape(&self) -> crate::Result<Reshape> {
        let to = self.replay_block_tokens.unwrap_or(self.trace_block_tokens);
        crate::ensure!(
            self.trace_block_tokens >= 1 && to >= 1,
            "--trace-block-tokens and --replay-block-tokens must be at least 1"
        );
        Ok(Reshape {
            from: self.trace_block_tokens,
            to,
            output_max: self.output_tokens_max.unwrap_or(u64::MAX),
        })
    }
}

/// `kvfabric bench trace`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// The trace (one JSON request per line: timestamp, input_length, output_length,
    /// hash_ids).
    file: PathBuf,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Workers (with --prefill-workers, the decode workers).
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// A disaggregated layout: this many prefill workers beside --workers decode workers
    /// (0: aggregated). Prompts are routed over the prefill workers; each prompt's KV then
    /// crosses --kv-link to the least-loaded decode worker, whose first step gives its first
    /// token.
    #[arg(long, default_value_t = 0)]
    prefill_workers: usize,
    /// The link a disaggregated handoff crosses (a name or GB/s).
    #[arg(long, default_value = "400g")]
    kv_link: String,
    /// Routing: kv, round-robin, random, least-loaded (round-robin runs beside it).
    #[arg(long, default_value = "kv")]
    routing: String,
    /// One pool across workers: kv routing prices pulling a prefix from another worker's
    /// tiers against computing it, and the chosen worker pulls it over --peer-link.
    #[arg(long)]
    peer_pulls: bool,
    /// The link a pull between workers crosses (a name or GB/s).
    #[arg(long, default_value = "25g")]
    peer_link: String,
    /// G4 takes what falls off each worker's lowest tier, as kvfabric's workers without a
    /// disk tier send their host evictions to the fabric nodes (default: every prefill's
    /// blocks are written through to G4, as Mooncake's store puts them).
    #[arg(long)]
    g4_on_evict: bool,
    /// kvfabric's tokens per KV block.
    #[arg(long, default_value_t = kvfabric::units::BlockTokens::DEFAULT)]
    block_tokens: kvfabric::units::BlockTokens,
    /// G1 (device) capacity per worker, tokens.
    #[arg(long, default_value_t = 1 << 20)]
    g1_tokens: u64,
    /// The memory G1 is: device (a GPU engine's), or host (an engine computing on the CPU, as
    /// kvfabric's own engines and the mock do: their KV lives in the store's host tier, and
    /// routers credit it as host blocks).
    #[arg(long, default_value = "device")]
    g1_tier: String,
    /// G2 (host) capacity per worker, tokens (0: none).
    #[arg(long, default_value_t = 0)]
    g2_tokens: u64,
    /// G3 (disk) capacity per worker, tokens (0: none).
    #[arg(long, default_value_t = 0)]
    g3_tokens: u64,
    /// G4 capacity shared by every worker (fabric nodes), tokens (0: none).
    #[arg(long, default_value_t = 0)]
    g4_tokens: u64,
    /// Reuses a block needs before its eviction writes it to G3 (as a worker's
    /// --disk-admit-min-hits: 0 every block, 1 blocks reused at least once).
    #[arg(long, default_value_t = 1)]
    g3_min_hits: u32,
    /// The model whose KV bytes per token the transfers move (a preset, a config.json or a
    /// GGUF).
    #[arg(long, default_value = "llama-3.1-70b")]
    model: String,
    /// KV dtype, overriding the model's (f32, f16, bf16, fp8, int8): the mock engine's KV is
    /// SmolLM2-135M's in f32.
    #[arg(long)]
    dtype: Option<String>,
    /// The link a G2 hit crosses to G1 (a name or GB/s).
    #[arg(long, default_value = "pcie5")]
    g2_link: String,
    /// The link a G3 hit crosses to G1.
    #[arg(long, default_value = "7")]
    g3_link: String,
    /// The link a G4 hit crosses to G1.
    #[arg(long, default_value = "400g")]
    g4_link: String,
    /// Linear engine model: uncached prompt tokens a worker prefills per second.
    #[arg(long, default_value_t = 20_000.0)]
    prefill_tokens_per_s: f64,
    /// Linear engine model: one decode step, ms.
    #[arg(long, default_value_t = 20.0)]
    decode_step_ms: f64,
    /// Linear engine model: decode cost per token of KV the decoding sequences hold, µs.
    #[arg(long, default_value_t = 0.0)]
    decode_kv_us: f64,
    /// Prompt tokens a step computes at most (longer prompts are chunked over steps).
    #[arg(long, default_value_t = 8192)]
    step_tokens: u64,
    /// While prompts and decodes both wait, steps alternate between them instead of sharing
    /// one, as kvfabric's scheduler runs an engine whose mixed steps cost the sum of their
    /// parts (the mock engine with decode costs).
    #[arg(long)]
    split_steps: bool,
    /// A `kvfabric profile` JSON of the engine: prefill time and ITL from its measurements
    /// instead of the linear model (its batch limit, unless --batch-max is given).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Sequences a worker decodes at once (default 64; with --profile, the profile's).
    #[arg(long)]
    batch_max: Option<usize>,
    /// Replay this many times faster than the trace's timestamps.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Milliseconds between a worker's load reports to the router (kvfabric's workers send
    /// one every 200); the router adds the requests it routed since each report on top of
    /// it. 0: no reports, the router tracks every request exactly; else at least 1.
    #[arg(long, default_value_t = 200.0)]
    load_report_ms: f64,
    /// Replay the first N requests only.
    #[arg(long)]
    max_requests: Option<u64>,
    /// Seed of the expansion into tokens and of routing draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw the replay over time to this SVG file: reuse, TTFT p50/p99 and the KV moved per
    /// window, each routing beside the other.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Width of the plot's windows, seconds of the trace (after --speedup).
    #[arg(long, default_value_t = 60.0)]
    window_s: f64,
}

/// One replay and how long the simulator took.
#[derive(Debug, serde::Serialize)]
struct Run {
    routing: String,
    #[serde(flatten)]
    result: SimResult,
    reuse: f64,
    reuse_of_limit: f64,
    wall_s: f64,
    ingest_events_per_s: f64,
}

/// Runs the replay under the chosen routing and under round-robin.
pub async fn run(args: TraceArgs) -> crate::Result<()> {
    let mode: RoutingMode =
        args.routing.parse().map_err(|e: String| crate::failed!("--routing: {e}"))?;
    let most = kvfabric_planner::sim::sizing::REPLAY_WORKERS_MAX;
    crate::ensure!(
        (1..=most).contains(&args.workers) && args.prefill_workers <= most,
        "--workers must be within 1..={most}, --prefill-workers at most {most}"
    );
    crate::ensure!(
        args.prefill_tokens_per_s > 0.0
            && args.decode_step_ms >= 0.0
            && args.decode_kv_us >= 0.0
            && args.speedup > 0.0,
        "--prefill-tokens-per-s and --speedup must be above 0, --decode-step-ms and \
         --decode-kv-us at least 0"
    );
    crate::ensure!(
        args.load_report_ms == 0.0
            || (args.load_report_ms >= sim::LOAD_REPORT_MIN_S * 1e3
                && args.load_report_ms <= 3_600_000.0),
        "--load-report-ms must be 0 (no reports) or within 1..=3600000"
    );
    let mut spec = kvfabric_planner::plan::resolve_model(&args.model)?;
    if let Some(d) = &args.dtype {
        let dtype =
            kvfabric::layout::KvDtype::parse(d).map_err(|e| crate::failed!("--dtype: {e}"))?;
        spec = spec.with_dtype(dtype);
    }
    let bytes_per_token = spec.block_layout(1)?.bytes_per_block();
    let link = |s: &str| Link::parse(s).map(|l| l.gbps);
    let bt = args.block_tokens.as_u64();
    let profile = match &args.profile {
        Some(path) => {
            let p = kvfabric_serving::profile::EngineProfile::read(path)
                .with_context(|| path.display().to_string())?;
            Some(p.planning().with_context(|| path.display().to_string())?)
        }
        None => None,
    };
    crate::ensure!(args.batch_max != Some(0), "--batch-max must be at least 1");
    let batch_max = args.batch_max.or(profile.as_ref().map(|p| p.batch_max as usize)).unwrap_or(64);
    let cfg = SimConfig {
        workers: args.workers,
        prefill_workers: args.prefill_workers,
        kv_link_gbps: link(&args.kv_link)?,
        mode,
        block_load_scale: None,
        block_tokens: args.block_tokens,
        reshape: args.shape.reshape()?,
        tier_blocks: [args.g1_tokens / bt, args.g2_tokens / bt, args.g3_tokens / bt],
        g1_tier: match args.g1_tier.as_str() {
            "device" => TierKind::Device,
            "host" => TierKind::Host,
            other => crate::bail!("--g1-tier {other:?}: device or host"),
        },
        g4_blocks: args.g4_tokens / bt,
        g3_min_hits: args.g3_min_hits,
        bytes_per_token,
        link_gbps: [link(&args.g2_link)?, link(&args.g3_link)?, link(&args.g4_link)?],
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_step_ms: args.decode_step_ms,
        decode_us_per_kv_token: args.decode_kv_us,
        step_tokens: args.step_tokens.max(1),
        mixed_steps: !args.split_steps,
        profile,
        batch_max: batch_max.max(1),
        load_report_s: args.load_report_ms / 1e3,
        speedup: args.speedup,
        requests_max: args.max_requests.unwrap_or(u64::MAX),
        prompt_tokens_max: args.shape.max_prompt_tokens,
        seed: args.seed,
        peer_pulls: args.peer_pulls,
        peer_link_gbps: link(&args.peer_link)?,
        pull_overhead_s: 2e-3,
        g4_on_evict: args.g4_on_evict,
    };
    let mut modes = vec![mode];
    if mode != RoutingMode::RoundRobin {
        modes.push(RoutingMode::RoundRobin);
    }
    let mut runs = Vec::new();
    for m in modes {
        let cfg = SimConfig { mode: m, ..cfg.clone() };
        let file = args.file.clone();
        let trace_bt = args.shape.trace_block_tokens;
        let start = Instant::now();
        let result = tokio::task::spawn_blocking(move || {
            let reader = sim::open(&file, trace_bt, &cfg)?;
            sim::simulate(reader, &cfg)
        })
        .await??;
        let wall_s = start.elapsed().as_secs_f64();
        let reuse = result.reuse();
        runs.push(Run {
            routing: format!("{m:?}").to_lowercase(),
            reuse_of_limit: reuse / result.limit.token_ratio().max(1e-12),
            ingest_events_per_s: result.events as f64 / result.ingest_s.max(1e-9),
            result,
            reuse,
            wall_s,
        });
    }
    if let Some(path) = &args.plot {
        crate::ensure!(args.window_s > 0.0, "--window-s must be above 0");
        std::fs::write(path, plot(&runs, args.window_s))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "config": cfg, "runs": runs }))?
        );
        return Ok(());
    }
    print_runs(&args, &spec, &cfg, &runs);
    Ok(())
}

fn print_runs(args: &TraceArgs, spec: &ModelSpec, cfg: &SimConfig, runs: &[Run]) {
    let Some(first) = runs.first() else { return };
    let l = first.result.limit;
    println!(
        "trace {}: {} requests, {} prompt tokens; limit (an infinite cache): {:.3} of tokens, {:.3} of blocks",
        args.file.display(),
        l.requests,
        l.tokens,
        l.token_ratio(),
        l.block_ratio()
    );
    let layout = match cfg.prefill_workers {
        0 => format!("{} workers", cfg.workers),
        p => format!(
            "{p} prefill + {} decode workers (handoffs over {:.1} GB/s)",
            cfg.workers, cfg.kv_link_gbps
        ),
    };
    println!(
        "{}; per worker G1 {} G2 {} G3 {} tokens; shared G4 {} tokens; {} KV ({} KiB/token); \
         engine: {} prefill tokens/s, {} ms/step, batch {}",
        layout,
        args.g1_tokens,
        args.g2_tokens,
        args.g3_tokens,
        args.g4_tokens,
        spec.name,
        cfg.bytes_per_token / 1024,
        cfg.prefill_tokens_per_s,
        cfg.decode_step_ms,
        cfg.batch_max
    );
    println!(
        "{:>12} {:>7} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>11} {:>7}",
        "routing",
        "reuse",
        "of lim",
        "G1",
        "G2",
        "G3",
        "G4",
        "pulled",
        "prefill",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "workers",
        "wall s"
    );
    for run in runs {
        let r = &run.result;
        let share = |t: usize| r.reused_tokens[t] as f64 / r.prompt_tokens.max(1) as f64;
        let (lo, hi) = (
            r.per_worker.iter().min().copied().unwrap_or(0),
            r.per_worker.iter().max().copied().unwrap_or(0),
        );
        println!(
            "{:>12} {:>7.3} {:>7.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>6.3} {:>10} {:>8.2}s {:>8.2}s {:>7.1}ms {:>7.1}ms {:>11} {:>7.1}",
            run.routing,
            run.reuse,
            run.reuse_of_limit,
            share(0),
            share(1),
            share(2),
            share(3),
            r.pulled_tokens as f64 / r.prompt_tokens.max(1) as f64,
            r.prefill_tokens,
            r.ttft_s[0],
            r.ttft_s[2],
            r.itl_s[0] * 1e3,
            r.itl_s[2] * 1e3,
            format!("{lo}..{hi}"),
            run.wall_s
        );
    }
    let gb = |b: u64| b as f64 / 1e9;
    for run in runs {
        let (m, p) = (&run.result.bytes, &run.result.peak_bytes_per_s);
        println!(
            "{:>12} KV moved, GB (peak GB/s over 1 s): onboard G2 {:.1} ({:.2}), G3 {:.1} ({:.2}), \
             G4 {:.1} ({:.2}); offload G1→G2 {:.1} ({:.2}), G2→G3 {:.1} ({:.2}); written to G4 {:.1} ({:.2}); \
             handed off {:.1} ({:.2}); pulled between workers {:.1} ({:.2}) in {} pulls; \
             index: {} block events ingested at {:.2} M/s (ingestion alone), {} blocks held at the end",
            run.routing,
            gb(m.onboard_g2),
            gb(p.onboard_g2),
            gb(m.onboard_g3),
            gb(p.onboard_g3),
            gb(m.onboard_g4),
            gb(p.onboard_g4),
            gb(m.offload_g2),
            gb(p.offload_g2),
            gb(m.offload_g3),
            gb(p.offload_g3),
            gb(m.write_g4),
            gb(p.write_g4),
            gb(m.handoff),
            gb(p.handoff),
            gb(m.pull),
            gb(p.pull),
            run.result.pulls,
            run.result.events,
            run.result.events as f64 / run.result.ingest_s.max(1e-9) / 1e6,
            run.result.index_blocks
        );
    }
    match &args.profile {
        Some(path) => println!(
            "timing: steps of admitted prompts' chunks (at most {} tokens) and one token of every \
             decoding sequence ({} at most); a step takes its admissions' restores over their \
             links, then the engine measured in {} (prefill time of its prompt tokens, ITL of its \
             decode batch at its mean context)",
            cfg.step_tokens,
            cfg.batch_max,
            path.display()
        ),
        None => println!(
            "timing: steps of admitted prompts' chunks (at most {} tokens) and one token of every \
             decoding sequence ({} at most); a step takes its admissions' restores over their \
             links, its prefill tokens at {} tokens/s, and {} ms (+ {} µs per KV token held) \
             when it decodes (the linear engine model)",
            cfg.step_tokens,
            cfg.batch_max,
            cfg.prefill_tokens_per_s,
            cfg.decode_step_ms,
            cfg.decode_us_per_kv_token
        ),
    }
}

/// The runs over time, in windows of `window_s`: reuse (with the whole trace's limit), TTFT
/// p50 and p99 by arrival, and the first run's KV traffic per tier.
fn plot(runs: &[Run], window_s: f64) -> String {
    use crate::plot::{render, Chart, Series};
    let w = window_s.max(1e-3);
    let at = |i: usize| (i as f64 + 0.5) * w;
    // Per-second counts summed into windows.
    let windows = |v: &[u64]| -> Vec<u64> {
        let mut out = Vec::new();
        for (s, &n) in v.iter().enumerate() {
            let i = (s as f64 / w) as usize;
            if out.len() <= i {
                out.resize(i + 1, 0);
            }
            out[i] += n;
        }
        out
    };
    let mut reuse = Vec::new();
    let mut ttft = Vec::new();
    for (k, run) in runs.iter().enumerate() {
        let t = &run.result.timeline;
        let (prompt, reused) = (windows(&t.prompt_tokens), windows(&t.reused_tokens));
        let points = prompt
            .iter()
            .enumerate()
            .filter(|(_, &p)| p > 0)
            .map(|(i, &p)| (at(i), reused.get(i).copied().unwrap_or(0) as f64 / p as f64))
            .collect();
        reuse.push(Series::line(run.routing.clone(), points));
        let mut by_window: Vec<Vec<f64>> = Vec::new();
        for &(arrival, x) in &t.ttft {
            let i = (arrival / w) as usize;
            if by_window.len() <= i {
                by_window.resize(i + 1, Vec::new());
            }
            by_window[i].push(x);
        }
        let mut p50 = Vec::new();
        let mut p99 = Vec::new();
        for (i, v) in by_window.iter_mut().enumerate().filter(|(_, v)| !v.is_empty()) {
            v.sort_by(f64::total_cmp);
            p50.push((at(i), kvfabric_planner::stats::quantile(v, 0.5)));
            p99.push((at(i), kvfabric_planner::stats::quantile(v, 0.99)));
        }
        ttft.push(Series::line(format!("{} p50", run.routing), p50));
        ttft.push(Series {
            dashed: true,
            color_of: Some(2 * k),
            ..Series::line(format!("{} p99", run.routing), p99)
        });
    }
    if let Some(first) = runs.first() {
        let limit = first.result.limit.token_ratio();
        let end = first.result.timeline.prompt_tokens.len() as f64;
        reuse.push(Series {
            dashed: true,
            ..Series::line("limit", vec![(0.0, limit), (end, limit)])
        });
    }
    let mut traffic = Vec::new();
    if let Some(first) = runs.first() {
        let names = [
            "onboard G2",
            "onboard G3",
            "onboard G4",
            "offload G1→G2",
            "offload G2→G3",
            "written to G4",
            "handed off",
        ];
        for (k, name) in names.iter().enumerate() {
            let per_s: Vec<u64> = first.result.timeline.bytes.iter().map(|b| b[k]).collect();
            if per_s.iter().all(|&b| b == 0) {
                continue;
            }
            let points = windows(&per_s)
                .iter()
                .enumerate()
                .map(|(i, &b)| (at(i), b as f64 / w / 1e9))
                .collect();
            traffic.push(Series::line(*name, points));
        }
    }
    let x_label = format!("trace time, s (windows of {w} s)");
    let mut charts = vec![
        Chart {
            title: "Prompt tokens reused".into(),
            x_label: x_label.clone(),
            y_label: "share of the window's prompt tokens".into(),
            series: reuse,
            ..Chart::default()
        },
        Chart {
            title: "TTFT by arrival".into(),
            x_label: x_label.clone(),
            y_label: "TTFT, s".into(),
            series: ttft,
            ..Chart::default()
        },
    ];
    if !traffic.is_empty() {
        charts.push(Chart {
            title: format!("KV moved ({})", runs.first().map_or("", |r| r.routing.as_str())),
            x_label,
            y_label: "GB/s over the window".into(),
            series: traffic,
            ..Chart::default()
        });
    }
    render(&charts, charts.len().min(3))
}
