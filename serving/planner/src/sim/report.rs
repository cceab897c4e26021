//! What a replay measured: reuse per tier, latencies, KV bytes moved (in all, per second),
//! per worker; and the timeline that plots read.

use super::*;

/// What a replay measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SimResult {
    /// Requests replayed.
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens found cached, per tier (G1..G4).
    pub reused_tokens: [u64; 4],
    /// Prompt tokens pulled from another worker's tiers (counted in [`SimResult::reuse`]).
    pub pulled_tokens: u64,
    /// Requests whose prefix was pulled.
    pub pulls: u64,
    /// Prompt tokens prefilled.
    pub prefill_tokens: u64,
    /// What an infinite cache would reuse (counted exactly over the ids).
    pub limit: Limit,
    /// TTFT seconds p50, p90, p99.
    pub ttft_s: [f64; 3],
    /// Mean inter-token gap per request, seconds, p50, p90, p99.
    pub itl_s: [f64; 3],
    /// End to end seconds p50, p90, p99.
    pub e2e_s: [f64; 3],
    /// KV bytes moved: onboarded from G2, G3, G4; offloaded G1→G2, G2→G3; written to G4.
    pub bytes: Moved,
    /// The peak of each over any 1 s of simulated time, bytes.
    pub peak_bytes_per_s: Moved,
    /// The 99th percentile of each over the seconds of the replay, bytes.
    pub p99_bytes_per_s: Moved,
    /// Bytes a request restores from below G1 (G2, G3, G4 hits), p50, p90, p99 over requests.
    pub restore_bytes: [f64; 3],
    /// Requests each worker served.
    pub per_worker: Vec<u64>,
    /// KV events the index ingested (blocks).
    pub events: u64,
    /// Seconds the index spent ingesting them (wall clock, not simulated).
    pub ingest_s: f64,
    /// Distinct blocks the index held at the end.
    pub index_blocks: u64,
    /// Blocks not cached because G1 was full of pinned blocks.
    pub g1_full: u64,
    /// Simulated seconds from the first arrival to the last finish.
    pub span_s: f64,
    /// Second by second, for plots (not in the JSON).
    #[serde(skip)]
    pub timeline: Timeline,
}

/// A replay second by second (by arrival for prompts, by transfer for bytes).
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Prompt tokens of the requests that arrived in each second.
    pub prompt_tokens: Vec<u64>,
    /// Of them, found cached.
    pub reused_tokens: Vec<u64>,
    /// KV bytes moved in each second: onboarded from G2, G3, G4; offloaded G1→G2, G2→G3;
    /// written to G4; handed off from prefill to decode workers.
    pub bytes: Vec<[u64; MOVES]>,
    /// (arrival, TTFT) of every request, seconds.
    pub ttft: Vec<(f64, f64)>,
}

impl Timeline {
    pub(super) fn add(v: &mut Vec<u64>, t: f64, n: u64) {
        let s = t.max(0.0) as usize;
        if v.len() <= s {
            v.resize(s + 1, 0);
        }
        v[s] += n;
    }
}

/// KV bytes per movement.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Moved {
    /// G2 → G1.
    pub onboard_g2: u64,
    /// G3 → G1.
    pub onboard_g3: u64,
    /// G4 → G1.
    pub onboard_g4: u64,
    /// G1 → G2.
    pub offload_g2: u64,
    /// G2 → G3.
    pub offload_g3: u64,
    /// Prefills → G4.
    pub write_g4: u64,
    /// Prefill workers → decode workers (a disaggregated layout's handoffs).
    pub handoff: u64,
    /// A worker's tiers → another worker's G1 (pulls).
    pub pull: u64,
}

impl Moved {
    pub(super) fn fields(&mut self) -> [&mut u64; MOVES] {
        [
            &mut self.onboard_g2,
            &mut self.onboard_g3,
            &mut self.onboard_g4,
            &mut self.offload_g2,
            &mut self.offload_g3,
            &mut self.write_g4,
            &mut self.handoff,
            &mut self.pull,
        ]
    }
}

impl SimResult {
    /// Reused prompt tokens over prompt tokens.
    pub fn reuse(&self) -> f64 {
        (self.reused_tokens.iter().sum::<u64>() + self.pulled_tokens) as f64
            / self.prompt_tokens.max(1) as f64
    }
}

pub(super) const ONBOARD: [usize; 3] = [0, 1, 2];

pub(super) const OFFLOAD_G2: usize = 3;

pub(super) const OFFLOAD_G3: usize = 4;

pub(super) const WRITE_G4: usize = 5;

pub(super) const HANDOFF: usize = 6;

pub(super) const PULL: usize = 7;

/// Kinds of KV movement counted.
pub const MOVES: usize = 8;
