//! Capacity planning from a trace (`kvfabric plan --trace`): how much prompt reuse caches of
//! each size give on real traffic, per-worker caches behind kv routing against one pool that
//! every worker reads, the sizes that reach 50%, 90% and 99% of the trace's limit, and the
//! restore bandwidth the pool's hits need.
//!
//! - The **pooled** curve is exact: one LRU cache over the whole trace, every capacity from one
//!   pass ([`ReuseCurve`], at the trace's block size).
//! - The **local** curve is `workers` caches of a capacity each, requests routed by kvfabric's
//!   kv router over the index their KV events build: the simulator ([`super::sim`]) with G1
//!   only, at each capacity asked; and the same behind round-robin routing, caches that know
//!   nothing of each other's traffic.
//! - The **restore** needs come from one more replay: local caches of the first capacity and
//!   a G4 pool of the size that reaches 99% of the limit; its onboarding from the pool per
//!   second (p99, peak) and per request (p99) over each link.

use std::path::Path;

use crate::plan::Link;
use crate::trace::{Limit, Reshape, ReuseCurve, TraceError};

use super::{self as sim, simulate, SimConfig};

/// What to plan for.
#[derive(Debug, Clone)]
pub struct CapacityConfig {
    /// Workers (nodes) the traffic is spread over.
    pub workers: usize,
    /// Tokens per id of the trace.
    pub trace_block_tokens: u32,
    /// The restore replay replays each id as this many tokens (as `bench serve --trace
    /// --replay-block-tokens` does; the trace's own size when equal): its capacities and
    /// bandwidths are at that scale.
    pub replay_block_tokens: u32,
    /// Per-worker cache capacities to evaluate, tokens.
    pub per_worker_tokens: Vec<u64>,
    /// KV bytes per token of the model.
    pub bytes_per_token: u64,
    /// Links to time restores over.
    pub links: Vec<Link>,
    /// The simulator's settings otherwise (its block size, engine model, seed).
    pub sim: SimConfig,
}

/// One capacity.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CapacityPoint {
    /// Each worker's cache, tokens.
    pub per_worker_tokens: u64,
    /// The same capacity pooled: `workers` times that.
    pub pooled_tokens: u64,
    /// Prompt tokens reused with per-worker caches behind kv routing.
    pub local_reuse: f64,
    /// ... behind round-robin routing (caches that know nothing of each other's traffic).
    pub local_round_robin_reuse: f64,
    /// ... with one pool every worker reads.
    pub pooled_reuse: f64,
}

/// The restore a link must carry for the pool's hits.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LinkNeed {
    /// The link.
    pub link: String,
    /// Its rate, GB/s.
    pub gbps: f64,
    /// The pool's onboarding, GB/s, p99 over the replay's seconds, and its peak over any
    /// second, as shares of the link.
    pub p99_share: f64,
    /// The peak, as a share of the link.
    pub peak_share: f64,
    /// A request's restore time over it at p99, ms (what its hits add to its TTFT).
    pub request_p99_ms: f64,
}

/// The plan.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CapacityReport {
    /// What an infinite cache reuses.
    pub limit: Limit,
    /// Reuse at each capacity.
    pub points: Vec<CapacityPoint>,
    /// The pooled (or single) cache's exact LRU curve: (tokens, reuse) at capacities a
    /// quarter-octave apart, from 64 K tokens up to the first that reaches the limit.
    pub pooled_curve: Vec<(u64, f64)>,
    /// The pooled capacity (tokens) that reuses 50%, 90%, 99% of the limit's tokens.
    pub pooled_for: [Option<u64>; 3],
    /// The smallest per-worker capacity evaluated that reaches those shares locally.
    pub local_for: [Option<u64>; 3],
    /// The pool's onboarding (G4 → G1), GB/s: p99 over seconds and peak.
    pub pool_onboard_gbps: [f64; 2],
    /// Per link.
    pub links: Vec<LinkNeed>,
    /// The pool of the restore replay, tokens, and its reuse.
    pub restore_pool_tokens: u64,
    /// Reuse in that replay (local caches of the first capacity plus the pool).
    pub restore_pool_reuse: f64,
}

/// Shares of the limit the report sizes for.
pub const SHARES: [f64; 3] = [0.5, 0.9, 0.99];

/// Plans capacity for the trace at `path`.
pub fn capacity(path: &Path, cfg: &CapacityConfig) -> Result<CapacityReport, TraceError> {
    let tb = u64::from(cfg.trace_block_tokens.max(1));
    let mut curve = ReuseCurve::new(cfg.trace_block_tokens);
    for r in sim::open(path, cfg.trace_block_tokens, &cfg.sim)? {
        curve.push(&r?);
    }
    let limit = curve.limit();
    let tokens = limit.tokens.max(1) as f64;
    let bt = cfg.sim.block_tokens.as_u64();
    let workers = cfg.workers.max(1) as u64;
    let mut points = Vec::new();
    for &c in &cfg.per_worker_tokens {
        let sim = SimConfig {
            workers: workers as usize,
            tier_blocks: [c / bt, 0, 0],
            g4_blocks: 0,
            reshape: Reshape::none(cfg.trace_block_tokens),
            ..cfg.sim.clone()
        };
        let local = simulate(sim::open(path, cfg.trace_block_tokens, &cfg.sim)?, &sim)?;
        let rr = SimConfig { mode: kvfabric_router::RoutingMode::RoundRobin, ..sim };
        let local_rr = simulate(sim::open(path, cfg.trace_block_tokens, &cfg.sim)?, &rr)?;
        let pooled = c * workers;
        points.push(CapacityPoint {
            per_worker_tokens: c,
            pooled_tokens: pooled,
            local_reuse: local.reuse(),
            local_round_robin_reuse: local_rr.reuse(),
            pooled_reuse: curve.reused_tokens(pooled / tb) as f64 / tokens,
        });
    }
    let pooled_for = SHARES.map(|s| curve.capacity_for(s).map(|b| b * tb));
    let mut pooled_curve = Vec::new();
    let mut cap = 65_536.0f64;
    loop {
        let blocks = (cap as u64) / tb;
        let reused = curve.reused_tokens(blocks);
        pooled_curve.push((blocks * tb, reused as f64 / tokens));
        if reused >= limit.reused_tokens || pooled_curve.len() >= 200 {
            break;
        }
        cap *= 2f64.powf(0.25);
    }
    let goal = |s: f64| s * limit.token_ratio();
    let local_for = SHARES
        .map(|s| points.iter().find(|p| p.local_reuse >= goal(s)).map(|p| p.per_worker_tokens));
    // The restore replay: the smallest local caches, and a pool reaching 99% of the limit.
    let pool = pooled_for[2].unwrap_or(limit.tokens);
    let first = cfg.per_worker_tokens.first().copied().unwrap_or(1 << 20);
    // At the replayed scale: the same ids, each `replay_block_tokens` long.
    let rb = u64::from(cfg.replay_block_tokens.max(1));
    let scaled = |tokens: u64| (tokens as u128 * u128::from(rb) / u128::from(tb)) as u64;
    // Blocks no longer than an id (a block spanning ids would share less than the ids do).
    let bt = bt.min(rb);
    let sim = SimConfig {
        workers: workers as usize,
        block_tokens: kvfabric::units::BlockTokens::new(bt as u32).unwrap_or(cfg.sim.block_tokens),
        tier_blocks: [scaled(first) / bt, 0, 0],
        g4_blocks: scaled(pool) / bt,
        reshape: Reshape {
            from: cfg.trace_block_tokens,
            to: cfg.replay_block_tokens.max(1),
            output_max: cfg.sim.reshape.output_max,
        },
        bytes_per_token: cfg.bytes_per_token,
        ..cfg.sim.clone()
    };
    let replay = simulate(sim::open(path, cfg.trace_block_tokens, &cfg.sim)?, &sim)?;
    let p99 = replay.p99_bytes_per_s.onboard_g4 as f64 / 1e9;
    let peak = replay.peak_bytes_per_s.onboard_g4 as f64 / 1e9;
    let links = cfg
        .links
        .iter()
        .map(|l| LinkNeed {
            link: l.name.clone(),
            gbps: l.gbps,
            p99_share: p99 / l.gbps,
            peak_share: peak / l.gbps,
            request_p99_ms: replay.restore_bytes[2] / (l.gbps * 1e9) * 1e3,
        })
        .collect();
    Ok(CapacityReport {
        limit,
        points,
        pooled_curve,
        pooled_for,
        local_for,
        pool_onboard_gbps: [p99, peak],
        links,
        restore_pool_tokens: pool,
        restore_pool_reuse: replay.reuse(),
    })
}
