//! `kvfabric bench serve --trace FILE`: a trace replayed online against any OpenAI-compatible
//! server. Each request's prompt is the trace's expansion into token ids ([`Expander`]), sent
//! to `/v1/completions` with `max_tokens` = its `output_length` and `ignore_eos`, streamed, at
//! its timestamp (divided by `speedup`). The report: TTFT, ITL and end-to-end percentiles, the
//! prompt tokens the server says it found cached (`usage.prompt_tokens_details`, and per tier
//! where it is kvfabric), against the limit of the requests sent.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric_planner::trace::{Expander, Limit, Reshape, ReuseCurve, TraceReader};
use serde_json::json;

use super::{one_request, summarize, Outcome, Target};

/// What to replay, and how.
#[derive(Debug, Clone)]
pub struct OnlineConfig {
    /// The trace.
    pub file: PathBuf,
    /// How its ids become prompts.
    pub reshape: Reshape,
    /// A trace line whose prompt is longer is refused (`--max-prompt-tokens`).
    pub prompt_tokens_max: u64,
    /// Arrivals this many times faster than the trace's timestamps.
    pub speedup: f64,
    /// Requests sent at most.
    pub requests_max: u64,
    /// Requests in flight at most (a request held back counts its wait as latency).
    pub in_flight_max: usize,
    /// Token ids are drawn below this (the server's vocabulary must hold them).
    pub vocab: u32,
    /// Seed of the expansion.
    pub seed: u64,
    /// Per-request timeout.
    pub timeout: Duration,
}

/// What the replay measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OnlineResult {
    /// Requests sent.
    pub requests: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Prompt tokens of the requests that succeeded (the server's count).
    pub prompt_tokens: u64,
    /// Of them, found cached (the server's count).
    pub cached_tokens: u64,
    /// Found cached per tier (device, host, disk, remote), where the server is kvfabric.
    pub cached_per_tier: [u64; 4],
    /// Of the remote ones, pulled from another worker's store.
    pub cached_peer: u64,
    /// `cached_tokens / prompt_tokens`.
    pub reuse: f64,
    /// What an infinite cache would reuse of the requests sent.
    pub limit: Limit,
    /// TTFT ms p50, p90, p99.
    pub ttft_ms: [f64; 3],
    /// ITL ms p50, p90, p99 (every gap between tokens).
    pub itl_ms: [f64; 3],
    /// End to end ms p50, p90, p99.
    pub e2e_ms: [f64; 3],
    /// Seconds from the first request to the last answer.
    pub duration_s: f64,
}

/// Replays the trace against `target` serving `model`.
pub async fn replay(
    target: Target,
    model: &str,
    cfg: &OnlineConfig,
) -> crate::Result<OnlineResult> {
    crate::ensure!(cfg.speedup > 0.0, "--speedup must be above 0");
    crate::ensure!(cfg.in_flight_max >= 1, "--in-flight-max must be at least 1");
    let expander = Expander {
        block_tokens: cfg.reshape.to.max(1),
        vocab: cfg.vocab.max(2),
        ..Expander::new(cfg.seed)
    };
    let target = Arc::new(target);
    let sem = Arc::new(tokio::sync::Semaphore::new(cfg.in_flight_max));
    let mut curve = ReuseCurve::new(cfg.reshape.to);
    let mut tasks = Vec::new();
    let start = Instant::now();
    for (i, req) in TraceReader::open(&cfg.file, cfg.reshape.from)?
        .max_prompt_tokens(cfg.prompt_tokens_max)
        .enumerate()
    {
        if i as u64 >= cfg.requests_max {
            break;
        }
        let req = cfg.reshape.apply(req?);
        curve.push(&req);
        let due = Duration::from_secs_f64(req.timestamp as f64 / 1000.0 / cfg.speedup);
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + due)).await;
        let permit = sem.clone().acquire_owned().await?;
        let body = json!({
            "model": model,
            "prompt": expander.tokens(&req),
            "max_tokens": req.output_length.max(1),
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let (t, timeout) = (target.clone(), cfg.timeout);
        tasks.push(tokio::spawn(async move {
            let sent = start.elapsed();
            let mut o = one_request(&t, body, timeout).await;
            // Held back by the in-flight cap: the wait is the request's too.
            let late = sent.saturating_sub(due);
            o.ttft = o.ttft.map(|x| x + late);
            o.e2e += late;
            o.sent = due;
            drop(permit);
            o
        }));
    }
    let mut outs: Vec<Outcome> = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await?);
    }
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.error.is_none()).collect();
    let sum = summarize(&ok);
    let (prompt, cached) = (sum.prompt, sum.cached);
    let mut per_tier = [0u64; 4];
    for o in &ok {
        for (t, n) in per_tier.iter_mut().zip(o.cached_per_tier) {
            *t += n;
        }
    }
    if let Some(e) = outs.iter().find_map(|o| o.error.as_ref()) {
        let n = outs.len() - ok.len();
        eprintln!("{n} of {} requests failed; first error: {e}", outs.len());
    }
    Ok(OnlineResult {
        requests: outs.len() as u64,
        errors: (outs.len() - ok.len()) as u64,
        prompt_tokens: prompt,
        cached_tokens: cached,
        cached_per_tier: per_tier,
        cached_peer: ok.iter().map(|o| o.cached_peer).sum(),
        reuse: cached as f64 / prompt.max(1) as f64,
        limit: curve.limit(),
        ttft_ms: sum.ttft_ms,
        itl_ms: sum.itl_ms,
        e2e_ms: sum.e2e_ms,
        duration_s: start.elapsed().as_secs_f64(),
    })
}

/// Prints a replay's result.
pub fn print(model: &str, url: &str, cfg: &OnlineConfig, r: &OnlineResult) {
    let f = |x: [f64; 3]| format!("{:.1}/{:.1}/{:.1}", x[0], x[1], x[2]);
    println!(
        "{model} at {url} — trace {} ({} requests sent, {}x speed-up, {} in flight at most)",
        cfg.file.display(),
        r.requests,
        cfg.speedup,
        cfg.in_flight_max
    );
    println!(
        "errors {}; reuse {:.3} of prompt tokens (device {}, host {}, disk {}, remote {} tokens, \
         {} of them pulled from peers); limit {:.3}; {:.1} s",
        r.errors,
        r.reuse,
        r.cached_per_tier[0],
        r.cached_per_tier[1],
        r.cached_per_tier[2],
        r.cached_per_tier[3],
        r.cached_peer,
        r.limit.token_ratio(),
        r.duration_s
    );
    println!(
        "TTFT ms p50/p90/p99 {}; ITL ms {}; e2e ms {}",
        f(r.ttft_ms),
        f(r.itl_ms),
        f(r.e2e_ms)
    );
}
