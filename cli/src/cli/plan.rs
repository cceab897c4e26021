//! `kvfabric plan`.

use anyhow::Context;
use clap::Args;
use kvfabric::layout::KvDtype;
use kvfabric_planner::plan::{plan, resolve_model, Link, PlanInput};
use kvfabric_planner::sla::LengthDist;

#[derive(Debug, Args)]
#[command(after_help = "Presets: smollm2-135m, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, \
llama-3.1-405b, mistral-7b, qwen3-8b, qwen3-32b, deepseek-r1.\n\
Links (GB/s, one direction): pcie4 32, pcie5 64, pcie6 128, nvlink4 450, nvlink5 900, \
25g 3.125, 100g 12.5, 200g 25, 400g 50, 800g 100; or NAME=GBPS.\n\
Example: kvfabric plan --model llama-3.1-70b --context 8192,131072 --link pcie5,400g
With a measured profile (kvfabric profile): kvfabric plan --sla --profile profile.json --rate 20 --isl 1024 --osl 128 --hit-rate 0.3 --ttft-ms 300 --itl-ms 25 --percentile p99")]
pub struct PlanArgs {
    /// A preset name, a Hugging Face config.json (or its directory), or a GGUF file.
    #[arg(long, short, env = "KVFABRIC_MODEL", default_value = "smollm2-135m")]
    model: String,
    /// KV cache dtype, overriding the model's (f32, f16, bf16, fp8, int8).
    #[arg(long)]
    dtype: Option<String>,
    /// Tokens per KV block.
    #[arg(long, env = "KVFABRIC_BLOCK_TOKENS", default_value_t = 16)]
    block_tokens: u32,
    /// Context lengths in tokens, comma-separated (default: 4096, 32768 and the model's
    /// maximum).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    context: Vec<String>,
    /// Concurrent sequences.
    #[arg(long, default_value = "64", allow_negative_numbers = true)]
    concurrency: String,
    /// KV budget of the GPU tier (G1), GB.
    #[arg(long, default_value = "40", allow_negative_numbers = true)]
    gpu_gb: f64,
    /// KV budget of the host tier (G2), GB.
    #[arg(long, default_value = "256", allow_negative_numbers = true)]
    host_gb: f64,
    /// KV budget of the disk tier (G3), GB.
    #[arg(long, default_value = "2000", allow_negative_numbers = true)]
    disk_gb: f64,
    /// Links to time transfers over: names or NAME=GBPS, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "pcie5,nvlink4,100g,400g")]
    link: Vec<String>,
    /// Effective prefill compute rate, TFLOP/s (what one recompute would run at).
    #[arg(long, default_value_t = 400.0, allow_negative_numbers = true)]
    compute_tflops: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Plan workers for a workload and latency targets from a measured --profile instead:
    /// prefill and decode workers (disaggregated) against aggregated workers, the KV
    /// bandwidth of the split, the choice, its reasons and what would change it.
    #[arg(long, requires = "profile")]
    sla: bool,
    /// The profile (`kvfabric profile --out`).
    #[arg(long)]
    profile: Option<std::path::PathBuf>,
    /// --sla: requests per second.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// --sla: prompt tokens: a mean (`512`, every prompt that long), a uniform range
    /// (`128..1024`), or exponentially spread around a mean (`exp:512`).
    #[arg(long, default_value = "512")]
    isl: String,
    /// --sla: answer tokens, as --isl (the decode model uses their mean).
    #[arg(long, default_value = "128")]
    osl: String,
    /// --sla: share of prompt tokens found cached (0..1).
    #[arg(long, default_value_t = 0.0)]
    hit_rate: f64,
    /// --sla: time-to-first-token target, ms.
    #[arg(long, default_value_t = 500.0)]
    ttft_ms: f64,
    /// --sla: inter-token latency target, ms.
    #[arg(long, default_value_t = 50.0)]
    itl_ms: f64,
    /// --sla: what the targets bound: mean, or a percentile (p50, p90, p99, p99.9).
    #[arg(long, default_value = "p99")]
    percentile: String,
    /// --sla: plan for service classes instead of one workload: a class's load and targets,
    /// `NAME:rate=R,isl=LEN,osl=LEN,hit=F,ttft=DUR,itl=DUR` (lengths as --isl; itl optional),
    /// repeated per class. Prints the aggregated workers at which every class meets its own
    /// targets when served by urgency (kvfabric's EDF scheduler), against first come first
    /// served, and what each class sees. Example: --class-load
    /// interactive:rate=2,isl=440,osl=32,hit=0.9,ttft=300ms,itl=50ms --class-load
    /// batch:rate=17,isl=2000..8000,osl=16,ttft=30s
    #[arg(long, requires = "sla")]
    class_load: Vec<String>,
    /// Plan cache capacity from a trace (Mooncake FAST'25 JSONL) instead: reuse against
    /// capacity per worker behind kv routing and pooled, the sizes that reach 50/90/99% of the
    /// trace's limit, the restore bandwidth of the pool's hits per --link (KV bytes of
    /// --model).
    /// With --sla and --profile: the workers that meet the targets on this trace (its rate,
    /// lengths and the reuse kv-routed caches of the first --cache-tokens attain), from the
    /// model and then from replays of the trace timed by the profile.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// --trace: tokens per hash id of the trace.
    #[arg(long, default_value_t = 512)]
    trace_block_tokens: u32,
    /// --trace: refuse a trace line whose prompt is longer than this many tokens (with its
    /// line number); at most 16777216. The replays hold each request in flight, so this
    /// bounds their memory.
    #[arg(long, default_value_t = kvfabric_planner::trace::PROMPT_TOKENS_MAX,
        value_parser = clap::value_parser!(u64).range(1..=kvfabric_planner::trace::LENGTH_MAX))]
    max_prompt_tokens: u64,
    /// --trace: workers (nodes) the traffic is spread over.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// --trace: per-worker cache capacities to evaluate, tokens, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "262144,524288,1048576,2097152,4194304,8388608,16777216"
    )]
    cache_tokens: Vec<u64>,
    /// --trace: draw reuse against cache size (local behind kv and round-robin routing,
    /// pooled, the limit) to this SVG file.
    #[arg(long, requires = "trace")]
    plot: Option<std::path::PathBuf>,
    /// --trace: the restore replay replays each id as this many tokens (prompts shorter by
    /// the ratio, as `bench serve --trace --replay-block-tokens` sends them; its capacities and
    /// bandwidths at that scale).
    #[arg(long, requires = "trace")]
    replay_block_tokens: Option<u32>,
    /// --trace: the restore replay cuts answers to this many tokens.
    #[arg(long, requires = "trace")]
    output_tokens_max: Option<u64>,
    /// --trace: arrivals this many times faster than the trace's timestamps (the restore
    /// bandwidth scales with it), as `bench serve --trace --speedup` replays them.
    #[arg(long, default_value_t = 1.0, requires = "trace")]
    speedup: f64,
    /// --trace: the pool takes what falls off each worker's cache, as kvfabric's workers
    /// without a disk tier send their host evictions to the fabric nodes (default: every
    /// prefill's blocks are written through to it, as Mooncake's store puts them).
    #[arg(long, requires = "trace")]
    g4_on_evict: bool,
}

/// `mean` or `pNN`: None for the mean, else the quantile.
pub fn parse_percentile(s: &str) -> anyhow::Result<Option<f64>> {
    if s == "mean" {
        return Ok(None);
    }
    let q: f64 = s
        .strip_prefix('p')
        .and_then(|n| n.parse().ok())
        .filter(|q: &f64| *q > 0.0 && *q < 100.0)
        .ok_or_else(|| anyhow::anyhow!("--percentile must be mean or p1..p99.99, got {s:?}"))?;
    Ok(Some(q / 100.0))
}

/// `512`, `128..1024` or `exp:512`: the mean and the distribution.
pub fn parse_lengths(what: &str, s: &str) -> anyhow::Result<(f64, LengthDist)> {
    let num = |x: &str| -> anyhow::Result<f64> {
        let v: f64 = x
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("{what} {s:?}: expected N, LO..HI or exp:N (tokens)"))?;
        positive(what, v)
    };
    if let Some(m) = s.strip_prefix("exp:") {
        return Ok((num(m)?, LengthDist::Exponential));
    }
    if let Some((lo, hi)) = s.split_once("..") {
        let (lo, hi) = (num(lo)?, num(hi)?);
        anyhow::ensure!(lo < hi, "{what} {s:?}: LO must be below HI");
        return Ok(((lo + hi) / 2.0, LengthDist::Uniform { lo, hi }));
    }
    Ok((num(s)?, LengthDist::Fixed))
}

fn positive(what: &str, v: f64) -> anyhow::Result<f64> {
    anyhow::ensure!(v.is_finite() && v > 0.0, "{what} must be a number > 0, got {v}");
    Ok(v)
}

/// The profile and targets of `--sla`.
fn sla_inputs(
    args: &PlanArgs,
) -> anyhow::Result<(
    kvfabric_serving::profile::EngineProfile,
    kvfabric_planner::sla::Profile,
    kvfabric_planner::sla::Targets,
)> {
    use kvfabric_planner::sla::Targets;
    use kvfabric_serving::profile::EngineProfile;

    let path = args.profile.as_ref().context("--sla needs --profile")?;
    let profile = EngineProfile::read(path).with_context(|| path.display().to_string())?;
    let curves = profile.planning()?;
    let (ttft, itl) =
        (positive("--ttft-ms", args.ttft_ms)? / 1e3, positive("--itl-ms", args.itl_ms)? / 1e3);
    let targets = match parse_percentile(&args.percentile)? {
        None => Targets::means(ttft, itl),
        Some(q) => Targets::at_quantile(ttft, itl, q),
    };
    Ok((profile, curves, targets))
}

fn run_trace_sla(args: &PlanArgs, trace: &std::path::Path) -> anyhow::Result<()> {
    use kvfabric_planner::sim::sizing::{size, SizingConfig};
    use kvfabric_planner::sim::SimConfig;

    let (profile, curves, targets) = sla_inputs(args)?;
    let most = kvfabric_planner::sim::sizing::REPLAY_WORKERS_MAX;
    anyhow::ensure!((1..=most).contains(&args.workers), "--workers must be within 1..={most}");
    let per_worker_tokens = args.cache_tokens.iter().copied().min().unwrap_or(1 << 20).max(1);
    let cfg = SizingConfig {
        trace_block_tokens: args.trace_block_tokens,
        workers: args.workers,
        per_worker_tokens,
        profile: curves,
        targets,
        // 64-token blocks, as the capacity plan: four times coarser than serving's, for speed.
        sim: SimConfig {
            block_tokens: kvfabric::units::BlockTokens::of(64),
            prompt_tokens_max: args.max_prompt_tokens,
            ..SimConfig::default()
        },
        replays_max: 10,
    };
    let r = size(trace, &cfg).with_context(|| trace.display().to_string())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let w = &r.workload;
    let at = targets.quantile.map_or("mean".to_string(), |q| format!("p{}", q * 100.0));
    println!(
        "trace {}: {} requests, {:.2} req/s, {:.0} prompt + {:.0} answer tokens on average; \
         {:.1}% of prompt tokens cached ({} workers, {} tokens each, kv routing)",
        trace.display(),
        r.requests,
        w.rate,
        w.isl,
        w.osl,
        w.hit_rate * 100.0,
        args.workers,
        per_worker_tokens
    );
    println!(
        "engine {} ({}); targets: TTFT {:.0} ms, ITL {:.0} ms at {at}",
        profile.model,
        args.profile.as_ref().map_or(String::new(), |p| p.display().to_string()),
        targets.ttft_s * 1e3,
        targets.itl_s * 1e3
    );
    let need = |n| describe_need(n, profile.kv_bytes_per_token > 0);
    println!("the model (plan --sla on the trace's workload):");
    println!("  disaggregated: {}", need(&r.plan.disaggregated));
    println!("  aggregated:    {}", need(&r.plan.aggregated));
    println!("  choice: {:?}", r.plan.layout());
    println!("replays of the trace, aggregated workers timed by the profile:");
    println!("{:>9} {:>7} {:>12} {:>12} {:>6}", "workers", "reuse", "TTFT", "ITL", "meets");
    for p in &r.replays {
        println!(
            "{:>9} {:>7.3} {:>10.1}ms {:>10.1}ms {:>6}",
            p.workers,
            p.reuse,
            p.ttft_s * 1e3,
            p.itl_s * 1e3,
            if p.meets { "yes" } else { "no" }
        );
    }
    match r.workers {
        Some(n) => println!(
            "{n} aggregated workers meet the targets on this trace's replay (TTFT and ITL at {})",
            kvfabric_planner::sim::sizing::replay_percentile(targets.quantile).1
        ),
        None => println!("no replay tried met the targets"),
    }
    Ok(())
}

/// One layout's need in words (`kv_known`: the profile knows the KV size).
fn describe_need(n: &kvfabric_planner::sla::Need, kv_known: bool) -> String {
    use kvfabric_planner::sla::Need;
    match n {
        Need::Disaggregated { prefill, decode, kv_bytes_per_s } => format!(
            "{prefill} prefill + {decode} decode workers, {} of KV between them{}",
            if *kv_bytes_per_s >= 1e9 {
                format!("{:.2} GB/s", kv_bytes_per_s / 1e9)
            } else {
                format!("{:.1} MB/s", kv_bytes_per_s / 1e6)
            },
            if kv_known { "" } else { " (KV size unknown: --kv-bytes-per-token)" }
        ),
        Need::Aggregated { workers } => format!("{workers} workers"),
        Need::Infeasible(why) => format!("cannot meet the targets: {why}"),
    }
}

fn run_sla(args: &PlanArgs) -> anyhow::Result<()> {
    use kvfabric_planner::sla::{plan, what_changes, Workload};

    let (profile, curves, targets) = sla_inputs(args)?;
    let path = args.profile.as_ref().context("--sla needs --profile")?;
    anyhow::ensure!(
        args.hit_rate.is_finite() && (0.0..1.0).contains(&args.hit_rate),
        "--hit-rate must be in 0..1"
    );
    let (isl, isl_dist) = parse_lengths("--isl", &args.isl)?;
    let (osl, _) = parse_lengths("--osl", &args.osl)?;
    let load = Workload {
        rate: positive("--rate", args.rate)?,
        isl,
        osl,
        hit_rate: args.hit_rate,
        isl_dist,
    };
    let p = plan(&curves, &load, &targets);
    let changes = what_changes(&curves, &load, &targets);
    if args.json {
        let v = serde_json::json!({
            "profile": path, "model": profile.model, "workload": load, "targets": targets,
            "plan": p, "layout": p.layout(), "workers": p.workers(), "what_changes": changes,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{} ({}): {} req/s, {} prompt + {} answer tokens, {:.0}% cached",
        profile.model,
        path.display(),
        load.rate,
        load.isl,
        load.osl,
        load.hit_rate * 100.0
    );
    let need = |n| describe_need(n, profile.kv_bytes_per_token > 0);
    println!("  disaggregated: {}", need(&p.disaggregated));
    println!("  aggregated:    {}", need(&p.aggregated));
    println!("why:");
    for r in &p.reasons {
        println!("  - {r}");
    }
    println!("what changes the decision:");
    for c in &changes {
        println!("  - {c}");
    }
    Ok(())
}

/// `NAME:rate=R,isl=LEN,osl=LEN,hit=F,ttft=DUR,itl=DUR`.
fn parse_class_load(s: &str, q: Option<f64>) -> anyhow::Result<kvfabric_planner::sla::ClassLoad> {
    use kvfabric_planner::sla::{ClassLoad, Targets, Workload};
    use kvfabric_serving::classes::parse_duration;
    let (name, rest) = s.split_once(':').unwrap_or((s, ""));
    anyhow::ensure!(!name.is_empty(), "--class-load {s:?}: a class needs a name");
    let (mut rate, mut isl, mut osl, mut hit) = (None, None, None, 0.0);
    let (mut ttft, mut itl) = (None, f64::INFINITY);
    for part in rest.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--class-load {s:?}: {part:?} is not KEY=VALUE"))?;
        let secs = |v: &str| -> anyhow::Result<f64> {
            let d = parse_duration(v).map_err(|e| anyhow::anyhow!("--class-load {s:?}: {e}"))?;
            positive(&format!("--class-load {k}"), d.as_secs_f64())
        };
        match k {
            "rate" => {
                let r: f64 =
                    v.parse().map_err(|_| anyhow::anyhow!("--class-load {s:?}: rate {v:?}"))?;
                rate = Some(positive("--class-load rate", r)?);
            }
            "isl" => isl = Some(parse_lengths("--class-load isl", v)?),
            "osl" => osl = Some(parse_lengths("--class-load osl", v)?.0),
            "hit" => {
                let h: f64 =
                    v.parse().map_err(|_| anyhow::anyhow!("--class-load {s:?}: hit {v:?}"))?;
                anyhow::ensure!(
                    h.is_finite() && (0.0..1.0).contains(&h),
                    "--class-load {s:?}: hit must be in 0..1"
                );
                hit = h;
            }
            "ttft" => ttft = Some(secs(v)?),
            "itl" => itl = secs(v)?,
            _ => anyhow::bail!(
                "--class-load {s:?}: unknown key {k:?} (rate, isl, osl, hit, ttft, itl)"
            ),
        }
    }
    let missing = |what: &str| anyhow::anyhow!("--class-load {s:?}: {what} is required");
    let (isl, isl_dist) = isl.ok_or_else(|| missing("isl"))?;
    let load = Workload {
        rate: rate.ok_or_else(|| missing("rate"))?,
        isl,
        osl: osl.ok_or_else(|| missing("osl"))?,
        hit_rate: hit,
        isl_dist,
    };
    let ttft = ttft.ok_or_else(|| missing("ttft"))?;
    let targets = match q {
        None => Targets::means(ttft, itl),
        Some(q) => Targets::at_quantile(ttft, itl, q),
    };
    Ok(ClassLoad { name: name.to_string(), load, targets })
}

/// `plan --sla --class-load ...`.
fn run_class_sla(args: &PlanArgs) -> anyhow::Result<()> {
    let (profile, curves, _) = sla_inputs(args)?;
    let q = parse_percentile(&args.percentile)?;
    let classes: Vec<_> =
        args.class_load.iter().map(|s| parse_class_load(s, q)).collect::<anyhow::Result<_>>()?;
    let p = kvfabric_planner::sla::plan_classes(&curves, &classes);
    // The same mix in a disaggregated layout (a class without an ITL target leaves the
    // decode batch unbounded by it).
    let pools = kvfabric_planner::sla::plan_class_pools(&curves, &classes, f64::INFINITY);
    if args.json {
        let v = serde_json::json!({
            "model": profile.model, "classes": classes, "plan": p, "pools": pools,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("{} ({} targets):", profile.model, args.percentile);
    for r in &p.reasons {
        println!("  - {r}");
    }
    println!("disaggregated:");
    for r in &pools.reasons {
        println!("  - {r}");
    }
    Ok(())
}

fn parse_count(what: &str, s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let v: u64 = s
        .parse()
        .with_context(|| format!("{what} must be a whole number of tokens >= 1, got {s:?}"))?;
    anyhow::ensure!(v >= 1, "{what} must be at least 1, got {v}");
    Ok(v)
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    // Every plan counts KV in blocks (the trace's too: its model's bytes per block).
    anyhow::ensure!(args.block_tokens >= 1, "--block-tokens (block_tokens) must be at least 1");
    if let (true, Some(trace)) = (args.sla, &args.trace) {
        return run_trace_sla(&args, trace);
    }
    if args.sla && !args.class_load.is_empty() {
        return run_class_sla(&args);
    }
    if args.sla {
        return run_sla(&args);
    }
    if let Some(trace) = &args.trace {
        return run_trace(&args, trace);
    }
    let model = resolve_model(&args.model).with_context(|| format!("model {:?}", args.model))?;
    let dtype = args.dtype.as_deref().map(KvDtype::parse).transpose()?;
    let mut contexts = args
        .context
        .iter()
        .map(|c| parse_count("--context", c))
        .collect::<anyhow::Result<Vec<u64>>>()?;
    if contexts.is_empty() {
        contexts = vec![4096, 32768];
        if let Some(max) = model.context_length.filter(|&m| m > 32768) {
            contexts.push(max);
        }
    }
    let links = args.link.iter().map(|l| Link::parse(l)).collect::<Result<Vec<_>, _>>()?;
    let input = PlanInput {
        model,
        dtype,
        block_tokens: args.block_tokens,
        contexts,
        concurrency: parse_count("--concurrency", &args.concurrency)?,
        gpu_gb: args.gpu_gb,
        host_gb: args.host_gb,
        disk_gb: args.disk_gb,
        links,
        compute_tflops: args.compute_tflops,
    };
    let plan = plan(&input)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", plan.render());
    }
    Ok(())
}

fn run_trace(args: &PlanArgs, trace: &std::path::Path) -> anyhow::Result<()> {
    use kvfabric_planner::sim::capacity::{capacity, CapacityConfig, SHARES};
    use kvfabric_planner::sim::SimConfig;

    let mut model =
        resolve_model(&args.model).with_context(|| format!("model {:?}", args.model))?;
    // The KV dtype asked for, as the plan without --trace takes it (it was ignored here).
    if let Some(d) = args.dtype.as_deref().map(KvDtype::parse).transpose()? {
        model = model.with_dtype(d);
    }
    let bytes_per_token = model.block_layout(1)?.bytes_per_block();
    let links = args.link.iter().map(|l| Link::parse(l)).collect::<Result<Vec<_>, _>>()?;
    let most = kvfabric_planner::sim::sizing::REPLAY_WORKERS_MAX;
    anyhow::ensure!((1..=most).contains(&args.workers), "--workers must be within 1..={most}");
    anyhow::ensure!(
        !args.cache_tokens.is_empty() && args.cache_tokens.iter().all(|&c| c > 0),
        "--cache-tokens must name capacities above 0"
    );
    let mut sizes = args.cache_tokens.clone();
    sizes.sort_unstable();
    let mut cfg = CapacityConfig {
        workers: args.workers,
        trace_block_tokens: args.trace_block_tokens,
        replay_block_tokens: args.replay_block_tokens.unwrap_or(args.trace_block_tokens).max(1),
        per_worker_tokens: sizes,
        bytes_per_token,
        links,
        // 64-token blocks: a planning granularity four times coarser than serving's, for speed.
        sim: SimConfig {
            block_tokens: kvfabric::units::BlockTokens::of(64),
            bytes_per_token,
            prompt_tokens_max: args.max_prompt_tokens,
            speedup: args.speedup,
            g4_on_evict: args.g4_on_evict,
            // Timed by the engine measured, where given (as `bench trace --profile`): the
            // queueing it shows moves kv routing, and with it what the pool serves.
            profile: match &args.profile {
                Some(path) => Some(
                    kvfabric_serving::profile::EngineProfile::read(path)
                        .and_then(|p| p.planning())
                        .with_context(|| path.display().to_string())?,
                ),
                None => None,
            },
            reshape: kvfabric_planner::trace::Reshape {
                output_max: args.output_tokens_max.unwrap_or(u64::MAX),
                ..kvfabric_planner::trace::Reshape::none(args.trace_block_tokens)
            },
            ..SimConfig::default()
        },
    };
    anyhow::ensure!(args.speedup > 0.0 && args.speedup.is_finite(), "--speedup must be above 0");
    // The measured engine's batch too, as `bench trace --profile` takes it.
    if let Some(p) = &cfg.sim.profile {
        cfg.sim.batch_max = (p.batch_max as usize).max(1);
    }
    let report = capacity(trace, &cfg).with_context(|| trace.display().to_string())?;
    if let Some(path) = &args.plot {
        std::fs::write(path, capacity_plot(&report, cfg.workers))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let l = report.limit;
    let gb = |tokens: u64| tokens as f64 * bytes_per_token as f64 / 1e9;
    println!(
        "trace {}: {} requests, {} prompt tokens; limit (an infinite cache): {:.3} of tokens",
        trace.display(),
        l.requests,
        l.tokens,
        l.token_ratio()
    );
    println!(
        "{} workers, kv routing; {} KV, {} KiB per token",
        cfg.workers,
        model.name,
        bytes_per_token / 1024
    );
    println!(
        "{:>14} {:>10} {:>8} {:>8} {:>14} {:>10} {:>8} {:>8} {:>8}",
        "per worker", "GB", "local kv", "local rr", "pooled", "GB", "pooled", "/ kv", "/ rr"
    );
    for p in &report.points {
        println!(
            "{:>14} {:>10.1} {:>8.3} {:>8.3} {:>14} {:>10.1} {:>8.3} {:>7.2}× {:>7.2}×",
            p.per_worker_tokens,
            gb(p.per_worker_tokens),
            p.local_reuse,
            p.local_round_robin_reuse,
            p.pooled_tokens,
            gb(p.pooled_tokens),
            p.pooled_reuse,
            p.pooled_reuse / p.local_reuse.max(1e-9),
            p.pooled_reuse / p.local_round_robin_reuse.max(1e-9)
        );
    }
    for (i, s) in SHARES.iter().enumerate() {
        let pooled = report.pooled_for[i]
            .map_or("not reached".to_string(), |t| format!("{t} tokens ({:.0} GB)", gb(t)));
        let most = cfg.per_worker_tokens.last().copied().unwrap_or(0);
        let local = report.local_for[i].map_or_else(
            || format!("not reached up to {most} tokens per worker"),
            |t| format!("{t} tokens per worker ({:.0} GB)", gb(t)),
        );
        println!("{:.0}% of the limit: pooled {pooled}; local {local}", s * 100.0);
    }
    println!(
        "the pool's hits (pool of {} tokens, local caches of {} tokens; reuse {:.3}) onboard {:.3} GB/s at p99 over seconds, {:.3} GB/s at peak:",
        report.restore_pool_tokens,
        cfg.per_worker_tokens[0],
        report.restore_pool_reuse,
        report.pool_onboard_gbps[0],
        report.pool_onboard_gbps[1]
    );
    for n in &report.links {
        println!(
            "  {:>8} ({:>6.1} GB/s): {:>5.1}% of it at p99, {:>5.1}% at peak; a request's restore at p99 {:.1} ms",
            n.link,
            n.gbps,
            n.p99_share * 100.0,
            n.peak_share * 100.0,
            n.request_p99_ms
        );
    }
    Ok(())
}

/// Reuse against the cache's total size (every worker's together): per-worker caches behind
/// kv and round-robin routing, one pool, and the limit (Mooncake FAST'25's figures 9 and 10).
fn capacity_plot(r: &kvfabric_planner::sim::capacity::CapacityReport, workers: usize) -> String {
    use kvfabric_benches::plot::{render, Chart, Series};
    let total = |p: &kvfabric_planner::sim::capacity::CapacityPoint| p.pooled_tokens as f64;
    let pooled: Vec<(f64, f64)> = r.pooled_curve.iter().map(|&(t, u)| (t as f64, u)).collect();
    let (lo, hi) = (
        pooled.first().map_or(1.0, |p| p.0).min(r.points.first().map_or(f64::MAX, total)),
        pooled.last().map_or(1.0, |p| p.0).max(r.points.last().map_or(0.0, total)),
    );
    let limit = r.limit.token_ratio();
    let series = vec![
        Series::line("pooled (one cache)", pooled),
        Series::line(
            format!("{workers} local caches, kv routing"),
            r.points.iter().map(|p| (total(p), p.local_reuse)).collect(),
        ),
        Series::line(
            format!("{workers} local caches, round-robin"),
            r.points.iter().map(|p| (total(p), p.local_round_robin_reuse)).collect(),
        ),
        Series { dashed: true, ..Series::line("limit", vec![(lo, limit), (hi, limit)]) },
    ];
    let chart = Chart {
        title: "Prompt tokens reused against cache size".into(),
        x_label: "cache, tokens (all workers together; K, M: 2^10, 2^20)".into(),
        y_label: "share of prompt tokens reused".into(),
        x_log2: true,
        x_bytes: true,
        series,
    };
    render(&[chart], 1)
}
