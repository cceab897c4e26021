//! `kvfabric profile`: measures an engine for capacity planning — in this process (the
//! engine options of `kvfabric up`), or any OpenAI-compatible server (`--url`: a running
//! `kvfabric up`, a vLLM server) by timing requests — and writes the profile that
//! `kvfabric plan --sla` and the planner read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::{Discovery, EventBus};
use kvfabric_serving::backend::{Backend, LocalBackend};
use kvfabric_serving::profile::{
    measure, measure_restore, EngineProfile, LocalProbe, Probe, ProfileError, Settings, Step, Trace,
};
use serde_json::json;

use super::stack::EngineOpts;
use kvfabric_benches::plot::{Chart, Series};
use kvfabric_benches::serve::{first_model, one_request, Target};

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  kvfabric profile --engine mock --out mock.json --plot mock.svg\n  \
kvfabric profile --url http://127.0.0.1:8000 --prompts 64,256,512 --batches 1,2,4 \
--contexts 256 --out up.json"
)]
pub struct ProfileArgs {
    #[command(flatten)]
    engine: EngineOpts,
    /// Profile this OpenAI-compatible server (`http://HOST:PORT`) by timing requests, instead
    /// of an engine in this process.
    #[arg(long)]
    url: Option<String>,
    /// Prompt lengths of the prefill measurements, tokens.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,2048")]
    prompts: Vec<usize>,
    /// Shares of the prompt served from cache in a second set of prefill measurements.
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    cached_shares: Vec<f64>,
    /// Decode batch sizes (at most the engine's --max-batch in process).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    batches: Vec<usize>,
    /// Context lengths of the decode measurements, tokens.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    contexts: Vec<usize>,
    /// Tokens each sequence generates in a decode measurement.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Repetitions of each prefill and restore measurement (medians are kept).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Tiers to time restores from, in process: host, disk, fabric (none: skip).
    #[arg(long, value_delimiter = ',', default_value = "host,disk,fabric")]
    tiers: Vec<String>,
    /// Context lengths of the restore measurements (default: --contexts).
    #[arg(long, value_delimiter = ',')]
    restore_contexts: Vec<usize>,
    /// Prompts are random token ids in FIRST..LAST (exclusive), ordinary tokens of the
    /// model's vocabulary.
    #[arg(long, default_value = "40..250")]
    token_ids: String,
    /// With --url: the server's KV bytes per token (for the KV bandwidth of a plan).
    #[arg(long, default_value_t = 0)]
    kv_bytes_per_token: u64,
    /// With --url: the server's largest decode batch (default: the largest of --batches).
    #[arg(long)]
    batch_max: Option<usize>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Where to write the profile.
    #[arg(long, default_value = "profile.json")]
    out: std::path::PathBuf,
    /// Also an SVG plot of the curves.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Measure nothing: read this profile (written before) and show it, with `--plot` drawn
    /// from it.
    #[arg(long, value_name = "PROFILE.json")]
    from: Option<std::path::PathBuf>,
    /// Print the profile as JSON on stdout instead of tables.
    #[arg(long)]
    json: bool,
}

/// A server, timed from outside.
struct HttpProbe {
    target: Target,
    model: String,
    timeout: Duration,
}

impl Probe for HttpProbe {
    async fn generate(&self, prompt: Vec<u32>, max_tokens: usize) -> Result<Trace, ProfileError> {
        let body = json!({
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let start = Instant::now();
        let o = one_request(&self.target, body, self.timeout).await;
        if let Some(e) = o.error {
            return Err(ProfileError::Request(e));
        }
        // Tokens whose text is empty (a partial character, a special token) send no event:
        // the usage's count is the truth. Without a text event at all, the end of the stream
        // is when the tokens had come.
        let n = o.completion_tokens as usize;
        if n == 0 {
            return Err(ProfileError::NoTokens { prompt: prompt.len() });
        }
        let first = start + o.ttft.unwrap_or(o.e2e);
        let last = first + o.gaps.iter().sum::<Duration>();
        let tokens = if o.gaps.len() + 1 == n {
            let mut at = first;
            std::iter::once(first)
                .chain(o.gaps.iter().map(|g| {
                    at += *g;
                    at
                }))
                .collect()
        } else {
            // Spread evenly between the first and the last text event.
            let step =
                (last - first) / u32::try_from(n.saturating_sub(1).max(1)).unwrap_or(u32::MAX);
            (0..n as u32).map(|i| first + step * i).collect()
        };
        Ok(Trace { start, tokens, cached: o.cached_tokens as usize })
    }
}

fn parse_ids(s: &str) -> anyhow::Result<(u32, u32)> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| anyhow::anyhow!("--token-ids must be FIRST..LAST, got {s:?}"))?;
    let (a, b): (u32, u32) = (a.trim().parse()?, b.trim().parse()?);
    anyhow::ensure!(a < b, "--token-ids {s:?}: empty range");
    Ok((a, b))
}

fn bar(hidden: bool) -> indicatif::ProgressBar {
    let bar =
        if hidden { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(1) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("profile [{bar:30}] {pos}/{len} {msg} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}

fn on_step(bar: &indicatif::ProgressBar) -> impl FnMut(Step) + '_ {
    move |s| match s {
        Step::Total(n) => {
            bar.set_length(n);
            bar.set_position(0);
        }
        Step::Done(what) => {
            bar.inc(1);
            bar.set_message(what);
        }
    }
}

pub async fn run(args: ProfileArgs) -> anyhow::Result<()> {
    if let Some(from) = &args.from {
        let profile = EngineProfile::read(from).with_context(|| from.display().to_string())?;
        if let Some(path) = &args.plot {
            std::fs::write(path, plot(&profile))
                .with_context(|| format!("writing {}", path.display()))?;
        }
        print!("{}", render(&profile));
        return Ok(());
    }
    anyhow::ensure!(!args.prompts.is_empty(), "--prompts: at least one length");
    anyhow::ensure!(
        !args.batches.is_empty() && !args.contexts.is_empty(),
        "--batches and --contexts: at least one each"
    );
    anyhow::ensure!(
        args.cached_shares.iter().all(|h| *h > 0.0 && *h < 1.0),
        "--cached-shares must be between 0 and 1"
    );
    let settings = Settings {
        prompts: args.prompts.clone(),
        cached_shares: args.cached_shares.clone(),
        batches: args.batches.clone(),
        contexts: args.contexts.clone(),
        decode_tokens: args.decode_tokens,
        reps: args.reps,
        token_ids: parse_ids(&args.token_ids)?,
        block_tokens: args.engine.block_tokens as usize,
        seed: 1,
    };
    let timeout = Duration::from_secs(args.timeout_s.max(1));
    let bar = bar(args.json);
    let profile = match &args.url {
        Some(url) => {
            let target = kvfabric_benches::serve::target(url).await?;
            let model = match &args.engine.served_model_name {
                Some(m) => m.clone(),
                None => first_model(&target).await.with_context(|| format!("GET {url}/models"))?,
            };
            let probe = HttpProbe { target, model: model.clone(), timeout };
            let batch_max =
                args.batch_max.unwrap_or_else(|| args.batches.iter().copied().max().unwrap_or(1));
            let (prefill, decode) = measure(&probe, &settings, batch_max, on_step(&bar)).await?;
            EngineProfile::new(
                url.clone(),
                model,
                settings.block_tokens,
                args.kv_bytes_per_token,
                batch_max,
                prefill,
                decode,
                Vec::new(),
            )
        }
        None => {
            let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
            let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
            let stack = super::stack::start_stack(
                &args.engine,
                "profile",
                &discovery,
                bus,
                super::stack::TransferAt::LOOPBACK,
                !args.json,
            )
            .await?;
            let model = stack.sched.info().id.clone();
            let block_bytes = stack.store.block_bytes();
            let backend: Arc<dyn Backend> =
                Arc::new(LocalBackend::new(stack.sched.clone(), stack.store.clone()));
            let probe = LocalProbe::new(backend, &model, timeout);
            let batch_max = args.engine.max_batch.max(1);
            let (prefill, decode) = measure(&probe, &settings, batch_max, on_step(&bar)).await?;
            let tiers: Vec<&str> =
                args.tiers.iter().map(String::as_str).filter(|t| *t != "none").collect();
            let contexts = if args.restore_contexts.is_empty() {
                &args.contexts
            } else {
                &args.restore_contexts
            };
            let restore = if tiers.is_empty() {
                Vec::new()
            } else {
                let dir = super::stack::data_dir(&args.engine);
                measure_restore(
                    block_bytes,
                    settings.block_tokens,
                    contexts,
                    &tiers,
                    &dir,
                    args.reps,
                    on_step(&bar),
                )
                .await?
            };
            let describe = stack.describe.clone();
            stack.shutdown().await;
            EngineProfile::new(
                format!("in process: {describe}"),
                model,
                settings.block_tokens,
                block_bytes / u64::from(args.engine.block_tokens.max(1)),
                batch_max,
                prefill,
                decode,
                restore,
            )
        }
    };
    bar.finish_and_clear();
    let text = serde_json::to_string_pretty(&profile)?;
    std::fs::write(&args.out, format!("{text}\n"))
        .with_context(|| format!("writing {}", args.out.display()))?;
    if let Some(path) = &args.plot {
        std::fs::write(path, plot(&profile))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{text}");
    } else {
        print!("{}", render(&profile));
        println!("profile written to {}", args.out.display());
        if let Some(path) = &args.plot {
            println!("plot written to {}", path.display());
        }
    }
    Ok(())
}

/// The profile as tables.
fn render(p: &EngineProfile) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "{} — {}", p.model, p.source);
    let _ = writeln!(s, "\nprefill     prompt  cached  TTFT ms");
    for r in &p.prefill {
        let _ = writeln!(
            s,
            "         {:>9} {:>7} {:>8.2}",
            r.prompt_tokens,
            r.cached_tokens,
            r.ttft_s * 1e3
        );
    }
    let _ = writeln!(s, "\ndecode      batch  context   ITL ms   tokens/s");
    for r in &p.decode {
        let _ = writeln!(
            s,
            "         {:>8} {:>8} {:>8.2} {:>10.1}",
            r.batch,
            r.context,
            r.itl_s * 1e3,
            r.tokens_per_s
        );
    }
    if !p.restore.is_empty() {
        let _ = writeln!(s, "\nrestore     tier  context   blocks       MiB       ms    GB/s");
        for r in &p.restore {
            let _ = writeln!(
                s,
                "         {:>7} {:>8} {:>8} {:>9.1} {:>8.2} {:>7.2}",
                r.tier,
                r.context,
                r.blocks,
                r.bytes as f64 / (1 << 20) as f64,
                r.seconds * 1e3,
                r.gbps
            );
        }
    }
    let f = &p.fit;
    let _ = writeln!(
        s,
        "\nfit: prefill {:.2} µs/token + {:.2} ms; decode step {:.2} ms + {:.4} µs per KV token in the batch; a cached token adds {:.2} µs",
        f.prefill_s_per_token * 1e6,
        f.prefill_s_fixed * 1e3,
        f.decode_step_s * 1e3,
        f.decode_s_per_kv_token * 1e6,
        f.restore_s_per_cached_token * 1e6
    );
    s
}

/// The curves: TTFT against prompt length (cold and cached), ITL against batch per context,
/// restore time against context per tier.
pub fn plot(p: &EngineProfile) -> String {
    let mut shares: Vec<Option<usize>> = Vec::new();
    let mut prefill = Vec::new();
    for r in &p.prefill {
        let share = (r.cached_share > 0.0).then(|| (r.cached_share * 100.0).round() as usize);
        if !shares.contains(&share) {
            shares.push(share);
        }
    }
    for share in shares {
        let pts = p
            .prefill
            .iter()
            .filter(|r| {
                let s = (r.cached_share > 0.0).then(|| (r.cached_share * 100.0).round() as usize);
                s == share
            })
            .map(|r| (r.prompt_tokens as f64, r.ttft_s * 1e3))
            .collect();
        let name = match share {
            None => "cold".to_string(),
            Some(s) => format!("{s}% cached"),
        };
        prefill.push(Series::line(name, pts));
    }
    let mut contexts: Vec<usize> = p.decode.iter().map(|d| d.context).collect();
    contexts.sort_unstable();
    contexts.dedup();
    let decode = contexts
        .iter()
        .map(|&c| {
            Series::line(
                format!("context {c}"),
                p.decode
                    .iter()
                    .filter(|d| d.context == c)
                    .map(|d| (d.batch as f64, d.itl_s * 1e3))
                    .collect(),
            )
        })
        .collect();
    let mut charts = vec![
        Chart {
            x_log2: false,
            x_bytes: false,
            title: format!("Prefill: time to first token ({})", p.model),
            x_label: "prompt tokens".into(),
            y_label: "TTFT, ms".into(),
            series: prefill,
        },
        Chart {
            x_log2: false,
            x_bytes: false,
            title: "Decode: inter-token latency".into(),
            x_label: "sequences in the batch".into(),
            y_label: "ITL, ms".into(),
            series: decode,
        },
    ];
    if !p.restore.is_empty() {
        let tiers = kvfabric_benches::plot::distinct(p.restore.iter().map(|r| r.tier.as_str()));
        charts.push(Chart {
            x_log2: false,
            x_bytes: false,
            title: "Restore a context's KV".into(),
            x_label: "context tokens".into(),
            y_label: "ms".into(),
            series: tiers
                .iter()
                .map(|t| {
                    Series::line(
                        *t,
                        p.restore
                            .iter()
                            .filter(|r| r.tier == *t)
                            .map(|r| (r.context as f64, r.seconds * 1e3))
                            .collect(),
                    )
                })
                .collect(),
        });
    }
    kvfabric_benches::plot::render(&charts, 3)
}
