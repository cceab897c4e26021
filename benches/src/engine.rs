//! `kvfabric bench engine`: decode speed of the llama engine against a plain candle
//! generation loop on the same model and weights, in the same run, rounds interleaved.
//!
//! Three paths decode the same prompt greedily: `candle loop` (batch 1, tensor KV cache grown
//! by concatenation, attention by matmul; [`ReferenceLoop`]), `engine step` (the engine's own
//! step function: KV rows in the store's block layout), and `serving` (the whole serving loop:
//! the scheduler's batching, sampling and detokenization, and storing every full block into
//! the tiered store). The ratio is each path's tokens/s over the candle loop's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use kvfabric::agent::Agent;
use kvfabric::events::NullSink;
use kvfabric_planner::stats::Percentiles;
use kvfabric_serving::engine::llama::{LlamaEngine, LlamaOptions, ReferenceLoop, Weights};
use kvfabric_serving::engine::sampling::argmax;
use kvfabric_serving::engine::{
    Engine, GenEvent, GenerateRequest, SamplingParams, Scheduler, SchedulerConfig, StepInput,
};
use kvfabric_tiers::{StoreConfig, TieredStore};
use parking_lot::Mutex;

use crate::Host;

#[derive(Debug, Args)]
pub struct EngineArgs {
    /// A llama GGUF (default: the fetched SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Weights: `f32` or `quantized`.
    #[arg(long, default_value = "f32")]
    weights: Weights,
    /// Prompt tokens.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens decoded per round.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Rounds per path (the median round is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON rows.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    path: &'static str,
    tokens_per_s: f64,
    ms_per_token_p50: f64,
    ms_per_token_p99: f64,
    ratio_to_candle_loop: f64,
    same_tokens_as_candle_loop: bool,
}

struct Round {
    tokens: Vec<u32>,
    /// Time of each decoded token after the first.
    gaps: Vec<Duration>,
}

impl Round {
    fn tokens_per_s(&self) -> f64 {
        self.gaps.len() as f64 / self.gaps.iter().sum::<Duration>().as_secs_f64()
    }
}

fn candle_loop(e: &LlamaEngine, prompt: &[u32], n: usize) -> crate::Result<Round> {
    let mut r = ReferenceLoop::new(e);
    let mut tokens = vec![argmax(&r.forward(prompt)?)];
    let mut gaps = Vec::with_capacity(n);
    while tokens.len() < n {
        let t = Instant::now();
        let l = r.forward(&tokens[tokens.len() - 1..])?;
        tokens.push(argmax(&l));
        gaps.push(t.elapsed());
    }
    Ok(Round { tokens, gaps })
}

fn engine_step(e: &mut LlamaEngine, prompt: &[u32], n: usize) -> crate::Result<Round> {
    e.add_sequence(u64::MAX);
    let seq = u64::MAX;
    let first = e.step(&[StepInput { seq, start: 0, tokens: prompt, logits: true }])?;
    let mut tokens = vec![argmax(&first[0])];
    let mut gaps = Vec::with_capacity(n);
    while tokens.len() < n {
        let t = Instant::now();
        let start = prompt.len() + tokens.len() - 1;
        let l =
            e.step(&[StepInput { seq, start, tokens: &tokens[tokens.len() - 1..], logits: true }])?;
        tokens.push(argmax(&l[0]));
        gaps.push(t.elapsed());
    }
    e.remove_sequence(seq);
    Ok(Round { tokens, gaps })
}

async fn serving(s: &Scheduler, prompt: &[u32], n: usize) -> crate::Result<Round> {
    let mut rx = s.submit(GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        ignore_eos: true,
        timeout: Duration::from_secs(600),
        class: None,
        cache_salt: None,
        tenant: None,
        pull: None,
    })?;
    let mut tokens = Vec::new();
    let mut gaps = Vec::new();
    let mut last: Option<Instant> = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token { id, .. } => {
                let now = Instant::now();
                if let Some(l) = last {
                    gaps.push(now - l);
                }
                last = Some(now);
                tokens.push(id);
            }
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => return Err(e.into()),
            GenEvent::Started { .. } | GenEvent::Cached(_) | GenEvent::Accepted { .. } => {}
        }
    }
    Ok(Round { tokens, gaps })
}

pub async fn run(args: EngineArgs, host: &Host) -> crate::Result<()> {
    let path = args.model.clone().unwrap_or_else(|| host.model.clone());
    let opts = LlamaOptions { weights: args.weights, ..LlamaOptions::default() };
    let p = path.clone();
    let engine =
        tokio::task::spawn_blocking(move || LlamaEngine::load(&p, &opts, |_, _| {})).await??;
    let n = args.tokens.max(2);
    // A fixed English prompt, cut to length; a unique first token per round keeps the
    // serving path from reusing the previous round's blocks.
    let text = "The history of the printing press begins with movable type in East Asia and continues in Europe, where it changed how knowledge spread. ".repeat(64);
    let base = engine.codec().encode(&text)?;
    crate::ensure!(base.len() >= args.prompt_tokens, "prompt text too short");
    let info = engine.info().clone();
    // The scheduler's engine shares the weights of the one the direct rounds use.
    let served = engine.share_weights();
    let shared = Arc::new(Mutex::new(engine));

    let agent = Agent::start(host.agent_config("bench-engine", b"bench".to_vec())).await?;
    let blocks = (args.prompt_tokens + n) / info.layout.block_tokens.as_usize() + 8;
    let store = TieredStore::open(
        StoreConfig::new(info.layout.bytes_per_block(), (blocks * 2) as u32),
        &agent,
        Arc::new(NullSink),
    )
    .await?;
    let sched = Scheduler::start(
        served,
        store,
        SchedulerConfig::default(),
        tokio::runtime::Handle::current(),
    )?;

    let mut rounds: [Vec<Round>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..args.rounds.max(1) {
        let mut prompt = base[..args.prompt_tokens].to_vec();
        prompt[0] = (round as u32 * 7 + 11) % (info.layout.block_tokens.get() * 1000);
        let (r0, r1) = {
            let (sh, pr) = (shared.clone(), prompt.clone());
            tokio::task::spawn_blocking(move || -> crate::Result<(Round, Round)> {
                let mut e = sh.lock();
                Ok((candle_loop(&e, &pr, n)?, engine_step(&mut e, &pr, n)?))
            })
            .await??
        };
        rounds[0].push(r0);
        rounds[1].push(r1);
        rounds[2].push(serving(&sched, &prompt, n).await?);
        if !args.json {
            eprintln!("round {}/{} done", round + 1, args.rounds.max(1));
        }
    }
    let names = ["candle loop", "engine step", "serving"];
    let median = |rs: &[Round]| -> usize {
        let mut idx: Vec<usize> = (0..rs.len()).collect();
        idx.sort_by(|&a, &b| rs[a].tokens_per_s().total_cmp(&rs[b].tokens_per_s()));
        idx[idx.len() / 2]
    };
    let base_tps = rounds[0][median(&rounds[0])].tokens_per_s();
    let mut rows = Vec::new();
    for (i, rs) in rounds.iter().enumerate() {
        let m = &rs[median(rs)];
        let all_gaps: Vec<Duration> = rs.iter().flat_map(|r| r.gaps.iter().copied()).collect();
        let pct = Percentiles::of(&all_gaps);
        let same = rs.iter().zip(&rounds[0]).all(|(a, b)| a.tokens == b.tokens);
        rows.push(Row {
            path: names[i],
            tokens_per_s: m.tokens_per_s(),
            ms_per_token_p50: pct.p50_us / 1e3,
            ms_per_token_p99: pct.p99_us / 1e3,
            ratio_to_candle_loop: m.tokens_per_s() / base_tps,
            same_tokens_as_candle_loop: same,
        });
    }
    if args.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "decode, {} ({:?} weights), prompt {} tokens, {} tokens per round, median of {} rounds",
        info.id,
        args.weights,
        args.prompt_tokens,
        n,
        args.rounds.max(1)
    );
    println!(
        "{:<12} {:>9} {:>12} {:>12} {:>8} {:>12}",
        "path", "tok/s", "ms/tok p50", "ms/tok p99", "ratio", "same tokens"
    );
    for r in &rows {
        println!(
            "{:<12} {:>9.2} {:>12.2} {:>12.2} {:>8.3} {:>12}",
            r.path,
            r.tokens_per_s,
            r.ms_per_token_p50,
            r.ms_per_token_p99,
            r.ratio_to_candle_loop,
            r.same_tokens_as_candle_loop
        );
    }
    Ok(())
}
