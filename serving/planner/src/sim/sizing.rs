//! Sizing workers from a trace and a measured engine (`kvfabric plan --trace --sla
//! --profile`): the trace's own workload (its arrival rate, prompt-length distribution,
//! answer lengths, and the reuse kv-routed caches of the given size attain on it) planned
//! with the queueing model of `plan --sla` ([`crate::sla::plan`]: aggregated
//! against disaggregated workers), then checked by replaying the trace through the simulator
//! with that many aggregated workers timed by the profile: workers added until a replay meets
//! the targets, then the fewest that do found by bisection.
//!
//! The replay's percentiles are the simulator's p50, p90 and p99 (a target for another
//! quantile is checked at the next one above it); ITL is a request's mean gap between its
//! tokens. The simulator runs aggregated workers only: a disaggregated plan's figures are the
//! model's.

use std::path::Path;

use crate::sla::{plan, LengthDist, Plan, Profile, Targets, Workload};
use crate::trace::{Reshape, TraceError};

use super::{self as sim, simulate, SimConfig, SimResult};

/// Most workers a replay simulates (each holds its own pools; more workers than requests
/// would sit idle anyway).
pub const REPLAY_WORKERS_MAX: usize = 1024;

/// What to size for.
#[derive(Debug, Clone)]
pub struct SizingConfig {
    /// Tokens per id of the trace.
    pub trace_block_tokens: u32,
    /// Workers of the replay that measures the reuse (and where the search starts when the
    /// model finds no plan); replays simulate [`REPLAY_WORKERS_MAX`] at most.
    pub workers: usize,
    /// Each worker's cache (G1), tokens.
    pub per_worker_tokens: u64,
    /// The engine, measured.
    pub profile: Profile,
    /// The latency targets.
    pub targets: Targets,
    /// The simulator's settings otherwise (block size, seed).
    pub sim: SimConfig,
    /// Replays the search runs at most.
    pub replays_max: usize,
}

/// One replay of the search.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizingReplay {
    /// Aggregated workers.
    pub workers: usize,
    /// Prompt tokens reused.
    pub reuse: f64,
    /// TTFT and ITL at the targets' quantile (see the module), seconds.
    pub ttft_s: f64,
    /// ITL at the targets' quantile, seconds.
    pub itl_s: f64,
    /// Both within the targets.
    pub meets: bool,
}

/// The sizing.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizingReport {
    /// The trace's workload.
    pub workload: Workload,
    /// Requests in the trace.
    pub requests: u64,
    /// The model's plan for it.
    pub plan: Plan,
    /// The replays, in the order they ran.
    pub replays: Vec<SizingReplay>,
    /// The fewest aggregated workers whose replay met the targets (None: none tried did).
    pub workers: Option<usize>,
}

/// The replay percentile that checks targets for quantile `q`: the index into the
/// simulator's p50/p90/p99 and its name (the next at or above `q`; the median stands for the
/// mean).
pub fn replay_percentile(q: Option<f64>) -> (usize, &'static str) {
    match q {
        Some(q) if q > 0.9 => (2, "p99"),
        Some(q) if q > 0.5 => (1, "p90"),
        _ => (0, "p50"),
    }
}

/// The replay's figure for quantile `q`.
fn at(v: [f64; 3], q: Option<f64>) -> f64 {
    v[replay_percentile(q).0]
}

/// Sizes workers for the trace at `path`.
pub fn size(path: &Path, cfg: &SizingConfig) -> Result<SizingReport, TraceError> {
    let (mut lens, mut outs) = (Vec::new(), Vec::new());
    let (mut first, mut last) = (None, 0u64);
    for r in sim::open(path, cfg.trace_block_tokens, &cfg.sim)? {
        let r = r?;
        first.get_or_insert(r.timestamp);
        last = r.timestamp;
        lens.push(r.input_length as f64);
        outs.push(r.output_length.max(1) as f64);
    }
    let n = lens.len().max(1) as f64;
    let span_s = (last.saturating_sub(first.unwrap_or(0)) as f64 / 1e3).max(1e-3);
    let bt = cfg.sim.block_tokens.as_u64();
    let cap = REPLAY_WORKERS_MAX.min(lens.len()).max(1);
    let sim_for = |workers: usize| SimConfig {
        workers: workers.clamp(1, cap),
        tier_blocks: [cfg.per_worker_tokens / bt, 0, 0],
        g4_blocks: 0,
        reshape: Reshape::none(cfg.trace_block_tokens),
        profile: Some(cfg.profile.clone()),
        batch_max: cfg.profile.batch_max.max(1) as usize,
        ..cfg.sim.clone()
    };
    let replay = |workers: usize| -> Result<SimResult, TraceError> {
        simulate(sim::open(path, cfg.trace_block_tokens, &cfg.sim)?, &sim_for(workers))
    };
    let first_replay = replay(cfg.workers)?;
    let workload = Workload {
        rate: lens.len() as f64 / span_s,
        isl: lens.iter().sum::<f64>() / n,
        osl: outs.iter().sum::<f64>() / n,
        hit_rate: first_replay.reuse().clamp(0.0, 0.999),
        isl_dist: LengthDist::empirical(&lens).unwrap_or_default(),
    };
    let plan = plan(&cfg.profile, &workload, &cfg.targets);
    let q = cfg.targets.quantile;
    let check = |workers: usize, r: &SimResult| {
        let (ttft, itl) = (at(r.ttft_s, q), at(r.itl_s, q));
        SizingReplay {
            workers,
            reuse: r.reuse(),
            ttft_s: ttft,
            itl_s: itl,
            meets: ttft <= cfg.targets.ttft_s && itl <= cfg.targets.itl_s,
        }
    };
    let mut replays = vec![check(cfg.workers.clamp(1, cap), &first_replay)];
    let budget = cfg.replays_max.max(2);
    let run = |w: usize, replays: &mut Vec<SizingReplay>| -> Result<bool, TraceError> {
        if let Some(r) = replays.iter().find(|r| r.workers == w) {
            return Ok(r.meets);
        }
        let r = check(w, &replay(w)?);
        replays.push(r.clone());
        Ok(r.meets)
    };
    // Up from the model's count (half as many again each time) until a replay meets them.
    let mut w = plan.aggregated.workers().map_or(cfg.workers, |w| w as usize).clamp(1, cap);
    while replays.len() < budget && !run(w, &mut replays)? {
        if w == cap {
            break;
        }
        w = (w + (w / 2).max(1)).min(cap);
    }
    // Then the fewest: halving below the fewest that meet while none below is known to fail,
    // bisecting between the two once one is.
    while replays.len() < budget {
        let Some(hi) = replays.iter().filter(|r| r.meets).map(|r| r.workers).min() else { break };
        let lo = replays.iter().filter(|r| !r.meets && r.workers < hi).map(|r| r.workers).max();
        let mid = match lo {
            Some(lo) if hi - lo <= 1 => break,
            Some(lo) => (lo + hi) / 2,
            None if hi <= 1 => break,
            None => hi / 2,
        };
        run(mid, &mut replays)?;
    }
    let workers = replays.iter().filter(|r| r.meets).map(|r| r.workers).min();
    Ok(SizingReport { workload, requests: lens.len() as u64, plan, replays, workers })
}
