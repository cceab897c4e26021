//! An offline simulator of a whole deployment replaying a trace, in simulated time, over
//! kvfabric's *real* policies: the router's [`PrefixIndex`] and [`Router`], fed only by the KV
//! events the simulated workers' tiers emit, and the tiers' own [`SlotPool`] (LRU eviction,
//! pins) and [`FrequencyFilter`] (admission to disk) per worker.
//!
//! Per worker: G1 (device), G2 (host), G3 (disk) pools, in blocks of `block_tokens`; one G4
//! pool shared by every worker (fabric nodes). A request's prompt is expanded into tokens
//! ([`Expander`]) and hashed as kvfabric hashes it; its worker is the router's choice at its
//! arrival; its leading cached run is looked up G1, then G2, G3, G4, at its admission.
//!
//! Timing: each worker runs steps, as a continuous-batching engine does. A step admits
//! waiting requests while the batch has room (their leading cached run looked up then, at
//! least one prompt token left to compute; hits below G1 onboard into G1), computes every
//! admitted prompt's next chunk within `step_tokens` and one token of every decoding sequence.
//! It takes the restore of its admissions' hits (bytes over each tier's link), plus either
//! the linear model (prefill tokens at `prefill_tokens_per_s`; when it decodes,
//! `decode_step_ms` and `decode_us_per_kv_token` per token of KV held: the mock engine's
//! model) or a measured [`Profile`] (prefill time of its tokens, ITL of its batch). A prompt's
//! last chunk ends at its first token (TTFT from arrival); ITL is a request's mean gap.
//!
//! Blocks move as the tiered store moves them: a prompt's blocks enter G1 at its first
//! token, pinned until the request finishes, then evictable (LRU), and its answer's full
//! blocks at its end; G1's victims go to G2 (unless there already, or straight on down when
//! there is no G2), G2's to G3 when the frequency filter admits them (reused at least
//! `g3_min_hits` times), G3's are dropped; blocks a prefill computed are written through to G4
//! (as Mooncake's store puts every prefill's KV), whose LRU victims are dropped. Hits onboard
//! into G1 and stay where they were. Every change is a KV event to the index.

mod blocks;
pub mod capacity;
pub mod conversations;
mod report;
pub mod sizing;

use blocks::{prompt_hashes, store_blocks, write_g4};
pub use report::{Moved, SimResult, Timeline, MOVES};
use report::{HANDOFF, OFFLOAD_G2, OFFLOAD_G3, ONBOARD, PULL, WRITE_G4};

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use crate::sla::Profile;
use crate::trace::{Expander, Limit, LimitCounter, Reshape, TraceError, TraceRequest};
use kvfabric::contract::Load;
use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric::rng::SplitMix64;
use kvfabric::units::{BlockTokens, Bytes, Tokens};
use kvfabric_router::{PrefixIndex, PullPricing, Router, RouterConfig, RoutingMode, WorkerId};
use kvfabric_tiers::policy::{FrequencyFilter, PolicyKind};
use kvfabric_tiers::pool::SlotPool;

/// The shortest period of load reports simulated (1 ms): a whole trace's reports stay few.
pub const LOAD_REPORT_MIN_S: f64 = 1e-3;

/// The simulated deployment.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimConfig {
    /// Workers (with `prefill_workers`, the decode workers).
    pub workers: usize,
    /// A disaggregated layout: this many prefill workers beside the decode workers (0:
    /// aggregated). Prompts are routed over the prefill workers, their KV handed to the
    /// least-loaded decode worker over `kv_link_gbps`.
    pub prefill_workers: usize,
    /// GB/s of the link a handoff crosses.
    pub kv_link_gbps: f64,
    /// Routing.
    pub mode: RoutingMode,
    /// The kv mode's weight on decode blocks (`RouterConfig::block_load_scale`; none: the
    /// router's default).
    pub block_load_scale: Option<f64>,
    /// kvfabric's tokens per KV block.
    pub block_tokens: BlockTokens,
    /// How the trace's ids become prompts (block size, a replayed scale, answers cut).
    pub reshape: Reshape,
    /// G1, G2, G3 blocks per worker (0: no such tier).
    pub tier_blocks: [u64; 3],
    /// The memory G1 is: the device's (a GPU engine), or the host's (an engine computing on
    /// the CPU, as kvfabric's own engines and its mock do: their KV lives in the store's host
    /// tier). KV events name it, and routers credit its blocks by that tier's weight.
    pub g1_tier: TierKind,
    /// G4 blocks shared by all workers (0: none).
    pub g4_blocks: u64,
    /// Reuses a block needs before its eviction writes it to G3 (the store's
    /// `disk_admit_min_hits`: 0 every block, 1 blocks reused at least once).
    pub g3_min_hits: u32,
    /// KV bytes per token (of the model).
    pub bytes_per_token: u64,
    /// GB/s of the links a hit in G2, G3, G4 crosses to reach G1.
    pub link_gbps: [f64; 3],
    /// Linear engine model: uncached prompt tokens a worker prefills per second.
    pub prefill_tokens_per_s: f64,
    /// Linear engine model: one decode step, ms.
    pub decode_step_ms: f64,
    /// Linear engine model: decode cost per token of KV the decoding sequences hold, µs.
    pub decode_us_per_kv_token: f64,
    /// Prompt tokens a step computes at most (longer prompts are chunked over steps).
    pub step_tokens: u64,
    /// Prompt chunks and decodes share a step (an engine whose mixed steps amortize, as a
    /// GPU's do); false: while both wait, steps alternate between them, as kvfabric's
    /// scheduler runs an engine whose mixed steps cost the sum of their parts (the mock).
    pub mixed_steps: bool,
    /// A measured engine (`kvfabric profile`) instead of the linear model: prefill time
    /// against the tokens computed, ITL against the decode batch and context.
    pub profile: Option<Profile>,
    /// Sequences a worker decodes at once.
    pub batch_max: usize,
    /// Seconds between a worker's load reports to the router, as kvfabric's workers send
    /// them (0: none, the router's own tracking is exact). Each report says what the worker
    /// holds and queues at that moment and how many requests it has accepted; the router
    /// adds on top only the requests routed since (as the real one does). Each worker
    /// reports at its own phase of the period, drawn from the seed (real workers start at
    /// random moments). The workers of a disaggregated layout's decode router do not report
    /// (its tracking is exact). Periods under [`LOAD_REPORT_MIN_S`] count as that.
    pub load_report_s: f64,
    /// Arrival times divided by this.
    pub speedup: f64,
    /// Requests replayed at most.
    pub requests_max: u64,
    /// A trace line whose prompt is longer is refused (`--max-prompt-tokens`).
    pub prompt_tokens_max: u64,
    /// Seed of the expansion and of routing draws.
    pub seed: u64,
    /// One pool across workers: the router prices pulling a prefix from another worker's
    /// G1–G3 against computing it, and the chosen worker pulls it over `peer_link_gbps` (as
    /// kvfabric's workers do from each other's stores). Aggregated layouts only.
    pub peer_pulls: bool,
    /// GB/s of the link a pull crosses.
    pub peer_link_gbps: f64,
    /// The fixed cost of a pull, seconds.
    pub pull_overhead_s: f64,
    /// G4 takes the blocks that fall off a worker's lowest tier (as kvfabric's workers
    /// without a disk tier send their host evictions to the fabric nodes) instead of every
    /// prefill's blocks written through (as Mooncake's store puts them).
    pub g4_on_evict: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 8,
            prefill_workers: 0,
            kv_link_gbps: 50.0,
            mode: RoutingMode::Kv,
            block_load_scale: None,
            block_tokens: BlockTokens::DEFAULT,
            reshape: Reshape::none(512),
            tier_blocks: [1 << 16, 0, 0],
            g1_tier: TierKind::Device,
            g4_blocks: 0,
            g3_min_hits: 1,
            bytes_per_token: 327_680,
            link_gbps: [64.0, 7.0, 50.0],
            prefill_tokens_per_s: 20_000.0,
            decode_step_ms: 20.0,
            decode_us_per_kv_token: 0.0,
            step_tokens: 8192,
            mixed_steps: true,
            profile: None,
            batch_max: 64,
            load_report_s: 0.2,
            speedup: 1.0,
            requests_max: u64::MAX,
            prompt_tokens_max: crate::trace::PROMPT_TOKENS_MAX,
            seed: 1,
            peer_pulls: false,
            peer_link_gbps: 3.125,
            pull_overhead_s: 2e-3,
            g4_on_evict: false,
        }
    }
}

/// One tier of one worker (or the shared G4).
#[derive(Debug)]
struct Tier {
    pool: SlotPool,
    kind: TierKind,
}

#[derive(Debug)]
struct SimWorker {
    id: WorkerId,
    /// A prefill worker of a disaggregated layout (its requests leave at their first chunk's
    /// end); otherwise it decodes (aggregated, or a decode worker).
    prefill_only: bool,
    tiers: [Option<Tier>; 3],
    filter: FrequencyFilter,
    event_id: u64,
    /// Requests routed here, not yet admitted (arrival order).
    waiting: VecDeque<usize>,
    /// Requests admitted (prefilling or decoding), admission order.
    running: Vec<usize>,
    /// The step in flight: each prefill chunk (request, tokens) and the requests decoding.
    step: Option<Step>,
    /// Alternating steps: the last one left the decodes out.
    decodes_deferred: bool,
    served: u64,
    /// Requests routed here, ever (each one's number, as a worker's `accepted`).
    accepted: u64,
    /// Collect what falls off its lowest tier (for G4, [`SimConfig::g4_on_evict`]).
    keep_fallen: bool,
    /// Blocks fallen off its lowest tier, not yet written to G4.
    fallen: Vec<SequenceHash>,
}

impl SimWorker {
    /// Unpins G1 `slots` (evictable from now on).
    ///
    /// From the end of the run, as the engine's block table lets its blocks go (`KvTable`'s
    /// drop): a block becomes evictable after its children, so the LRU evicts a run from its
    /// tail and what stays cached is a prefix that lookups find. Unpinned from the head (as
    /// this simulator did before), a run's head went first and orphaned the rest: on the
    /// synthetic trace with 16 workers of 65,536 tokens, kv routing reused 0.090 instead of
    /// 0.120.
    fn unpin(&mut self, slots: impl DoubleEndedIterator<Item = u32>) {
        if let Some(g1) = self.tiers[0].as_mut() {
            for s in slots.rev() {
                let _ = g1.pool.unpin(s);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Step {
    chunks: Vec<(usize, u64)>,
    decoding: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// What happens at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Worker `0`'s step ends.
    StepEnd(usize),
    /// Request `rid`'s KV reaches decode worker `to`.
    Handoff { rid: usize, to: usize },
}

/// One request's state.
struct Request {
    arrival: f64,
    input: u64,
    output: u64,
    /// Its trace ids (one per trace block): its block hashes are derived from them when
    /// needed ([`Sim::hashes`]), 32 times smaller to hold than the hashes themselves.
    ids: Box<[u64]>,
    /// Full blocks of its answer.
    answer_blocks: u64,
    /// G1 slots it pins.
    pinned: Vec<u32>,
    /// Leading prompt blocks found cached at admission.
    cached_blocks: u64,
    /// Prompt tokens still to compute (set at admission).
    to_compute: u64,
    /// Its first token, once out.
    first_token: Option<f64>,
    /// Tokens out so far.
    generated: u64,
    /// Disaggregated: the decode worker it goes to after its prefill.
    decode_worker: Option<usize>,
    /// The worker the router said to pull its prefix from, and that worker's run (blocks).
    pull: Option<(usize, u32)>,
}

/// Emits events to the index on behalf of one source.
struct Events<'a> {
    index: &'a PrefixIndex,
    count: u64,
    /// Time spent in the index's ingestion.
    ingest: std::time::Duration,
}

impl Events<'_> {
    fn emit(&mut self, id: WorkerId, event_id: &mut u64, data: KvEventData) {
        let n = match &data {
            KvEventData::Stored { sequence_hashes, .. }
            | KvEventData::Removed { sequence_hashes, .. } => sequence_hashes.len(),
            KvEventData::Cleared => 1,
        };
        if n == 0 {
            return;
        }
        *event_id += 1;
        self.count += n as u64;
        let event = KvEvent { event_id: *event_id, data };
        let start = std::time::Instant::now();
        self.index.ingest(id, &event);
        self.ingest += start.elapsed();
    }
}

/// Per-second byte counters, for the peak over any 1 s window.
#[derive(Default)]
struct Rates {
    per_s: Vec<[u64; MOVES]>,
}

impl Rates {
    fn add(&mut self, t: f64, what: usize, bytes: u64) {
        let s = t.max(0.0) as usize;
        if self.per_s.len() <= s {
            self.per_s.resize(s + 1, [0; MOVES]);
        }
        self.per_s[s][what] += bytes;
    }
}

/// The requests in flight, by id: a request's state lives from its arrival to its last
/// token, so that a replay holds what its deployment holds, whatever the trace's length.
#[derive(Default)]
struct InFlight {
    by_id: HashMap<usize, Request>,
    next: usize,
}

impl InFlight {
    /// Adds a request; its id.
    fn push(&mut self, r: Request) -> usize {
        let rid = self.next;
        self.next += 1;
        self.by_id.insert(rid, r);
        rid
    }

    fn remove(&mut self, rid: usize) {
        self.by_id.remove(&rid);
    }
}

impl std::ops::Index<usize> for InFlight {
    type Output = Request;
    fn index(&self, rid: usize) -> &Request {
        self.by_id.get(&rid).unwrap_or_else(|| unreachable!("request {rid} is not in flight"))
    }
}

impl std::ops::IndexMut<usize> for InFlight {
    fn index_mut(&mut self, rid: usize) -> &mut Request {
        self.by_id.get_mut(&rid).unwrap_or_else(|| unreachable!("request {rid} is not in flight"))
    }
}

/// Hashes the memo holds in each of its two generations: 8 MiB of hashes (with a trace block
/// of 512 tokens and kvfabric blocks of 16, 32 768 trace blocks).
pub const HASH_MEMO_MAX: usize = 1 << 20;

/// Each trace block's sequence hashes by (parent, id), computed once and reused wherever the
/// block appears again. Bounded: two generations of at most [`HASH_MEMO_MAX`] hashes; when
/// the newer fills, the older is dropped (a block used since moved to the newer).
#[derive(Default)]
struct HashMemo {
    new: HashMap<(Option<SequenceHash>, u64), Box<[SequenceHash]>>,
    old: HashMap<(Option<SequenceHash>, u64), Box<[SequenceHash]>>,
    held: usize,
}

impl HashMemo {
    fn get(
        &mut self,
        key: (Option<SequenceHash>, u64),
        compute: impl FnOnce() -> Box<[SequenceHash]>,
    ) -> &[SequenceHash] {
        if !self.new.contains_key(&key) {
            let v = self.old.remove(&key).unwrap_or_else(compute);
            if self.held + v.len() > HASH_MEMO_MAX {
                self.old = std::mem::take(&mut self.new);
                self.held = 0;
            }
            self.held += v.len();
            self.new.insert(key, v);
        }
        &self.new[&key]
    }
}

/// The deployment during a replay.
struct Sim<'a> {
    cfg: &'a SimConfig,
    block_bytes: u64,
    /// G4 hits are fetched only when their link moves a block faster than a worker computes
    /// it (as kvfabric's workers price their fabric fetches); else they are computed.
    g4_worth_it: bool,
    events: Events<'a>,
    router: Router,
    workers: Vec<SimWorker>,
    g4: Option<Tier>,
    g4_event_id: u64,
    requests: InFlight,
    /// Each trace block's sequence hashes.
    memo: HashMemo,
    /// How trace ids become tokens, and tokens block hashes.
    expander: Expander,
    hasher: TokenBlockHasher,
    /// Ends of the steps in flight, and handoffs arriving at decode workers.
    steps: BinaryHeap<Reverse<(Time, Ev)>>,
    /// Routes over the decode workers of a disaggregated layout (least loaded).
    decode_router: Option<Router>,
    rates: Rates,
    r: SimResult,
    itl: Vec<f64>,
    e2e: Vec<f64>,
    restores: Vec<f64>,
    last_finish: f64,
    /// The workers' next load reports.
    reports: BinaryHeap<Reverse<(Time, usize)>>,
}

impl Sim<'_> {
    /// The sequence hashes of request `rid`'s full prompt blocks.
    fn hashes(&mut self, rid: usize) -> Vec<SequenceHash> {
        let q = &self.requests[rid];
        prompt_hashes(&q.ids, q.input, &self.expander, &self.hasher, &mut self.memo)
    }

    /// Runs every step that ends by `until`, and the steps they start.
    fn advance(&mut self, until: f64) {
        while let Some(&Reverse((Time(t), ev))) = self.steps.peek() {
            if t > until {
                break;
            }
            self.steps.pop();
            match ev {
                Ev::StepEnd(wi) => {
                    self.end_step(wi, t);
                    self.start_step(wi, t);
                }
                Ev::Handoff { rid, to } => self.arrive(to, rid, t),
            }
        }
    }

    /// Worker `wi` reports its load now: what a scheduler counts (the KV its admitted
    /// requests hold, the prompt tokens they and the waiting ones have left) and how many
    /// requests it has accepted.
    fn report(&mut self, wi: usize) {
        let w = &self.workers[wi];
        let (mut held, mut queued) = (0u64, 0u64);
        for &rid in &w.running {
            let q = &self.requests[rid];
            held += q.input.saturating_sub(q.to_compute) + q.generated.saturating_sub(1);
            queued += q.to_compute;
        }
        queued += w.waiting.iter().map(|&rid| self.requests[rid].input).sum::<u64>();
        let load = Load {
            active_blocks: self.cfg.block_tokens.blocks_for(Tokens(held)).0,
            queued_prefill_tokens: queued,
            accepted: Some(w.accepted),
        };
        self.router.report_load(w.id, load);
    }

    /// The load reports due by `until` (each worker every `load_report_s`), each after the
    /// steps that end before it.
    fn reports_until(&mut self, until: f64) {
        let period = self.cfg.load_report_s.max(LOAD_REPORT_MIN_S);
        while let Some(&Reverse((Time(t), wi))) = self.reports.peek() {
            if t > until {
                break;
            }
            self.reports.pop();
            self.advance(t);
            self.report(wi);
            self.reports.push(Reverse((Time(t + period), wi)));
        }
    }

    /// A request routed to worker `wi` at `now`: it waits for admission; an idle worker
    /// starts a step at once.
    fn arrive(&mut self, wi: usize, rid: usize, now: f64) {
        let w = &mut self.workers[wi];
        w.waiting.push_back(rid);
        if w.step.is_none() {
            self.start_step(wi, now);
        }
    }

    /// Admits what fits the batch, then starts a step of every admitted prompt's next chunk
    /// (within the step's token budget, first admitted first) and one token of every
    /// decoding sequence. Idle when there is nothing to compute.
    fn start_step(&mut self, wi: usize, t: f64) {
        let mut restore_s = 0.0;
        while self.workers[wi].running.len() < self.cfg.batch_max.max(1) {
            let Some(rid) = self.workers[wi].waiting.pop_front() else { break };
            restore_s += self.admit(wi, rid, t);
            self.workers[wi].running.push(rid);
        }
        let mut step = Step::default();
        let mut budget = self.cfg.step_tokens.max(1);
        let mut kv_tokens = 0u64;
        let w = &self.workers[wi];
        let pending = |prompt: bool| {
            w.running.iter().any(|&rid| (self.requests[rid].to_compute > 0) == prompt)
        };
        let split = !self.cfg.mixed_steps && pending(true) && pending(false);
        let (decodes, prompts) = match (split, w.decodes_deferred) {
            (false, _) => (true, true),
            (true, false) => (false, true),
            (true, true) => (true, false),
        };
        for &rid in &w.running {
            let q = &self.requests[rid];
            if q.to_compute > 0 {
                if prompts && budget > 0 {
                    let c = q.to_compute.min(budget);
                    budget -= c;
                    step.chunks.push((rid, c));
                }
            } else if decodes {
                step.decoding.push(rid);
                kv_tokens += q.input + q.generated;
            }
        }
        self.workers[wi].decodes_deferred = !decodes;
        if step.chunks.is_empty() && step.decoding.is_empty() {
            self.workers[wi].step = None;
            return;
        }
        let prefill: u64 = step.chunks.iter().map(|c| c.1).sum();
        let d = restore_s + self.step_s(prefill, step.decoding.len(), kv_tokens);
        self.workers[wi].step = Some(step);
        self.steps.push(Reverse((Time(t + d), Ev::StepEnd(wi))));
    }

    /// Seconds a step takes: its prefill tokens, and a decode of `decoding` sequences holding
    /// `kv_tokens` tokens of KV.
    fn step_s(&self, prefill: u64, decoding: usize, kv_tokens: u64) -> f64 {
        let cfg = self.cfg;
        match &cfg.profile {
            Some(p) => {
                let pre = if prefill > 0 { p.prefill_s.at(prefill as f64) } else { 0.0 };
                let dec = if decoding > 0 {
                    let context = kv_tokens as f64 / decoding as f64;
                    p.itl(context, decoding as f64).unwrap_or(cfg.decode_step_ms / 1e3)
                } else {
                    0.0
                };
                pre + dec
            }
            None => {
                let pre = prefill as f64 / cfg.prefill_tokens_per_s.max(1e-9);
                let dec = if decoding > 0 {
                    cfg.decode_step_ms / 1e3 + cfg.decode_us_per_kv_token * kv_tokens as f64 / 1e6
                } else {
                    0.0
                };
                pre + dec
            }
        }
    }

    /// Admits a request: its leading cached run, tier by tier (at least one prompt token is
    /// left to compute, for its logits, as engines do); hits below G1 onboard into G1, every
    /// hit pinned. Returns the seconds their restore takes over their links.
    fn admit(&mut self, wi: usize, rid: usize, t: f64) -> f64 {
        let bt = self.cfg.block_tokens.as_u64();
        let hashes = self.hashes(rid);
        let q = &mut self.requests[rid];
        let mut restore_s = 0.0;
        let held = if q.decode_worker.is_some() {
            // Its KV came from a prefill worker: held here for its decode, cached after.
            hashes.len()
        } else {
            let reusable = (q.input.saturating_sub(1) / bt) as usize;
            let mut per_tier = [0u64; 4];
            let w = &mut self.workers[wi];
            for h in hashes.iter().take(reusable) {
                let tier = (0..3)
                    .find(|&k| w.tiers[k].as_ref().is_some_and(|x| x.pool.lookup(*h).is_some()))
                    .or_else(|| {
                        self.g4
                            .as_ref()
                            .filter(|g| self.g4_worth_it && g.pool.lookup(*h).is_some())
                            .map(|_| 3)
                    });
                let Some(k) = tier else { break };
                per_tier[k] += 1;
                w.filter.hit(*h);
            }
            // What the router said a peer holds past this run, pulled from wherever the peer
            // still holds it (it may have evicted some since).
            let own = per_tier.iter().sum::<u64>() as usize;
            let mut pulled = 0u64;
            if let Some((hi, n)) = q.pull.filter(|&(hi, _)| hi != wi) {
                let holder = &self.workers[hi];
                for h in hashes.iter().take(reusable.min(n as usize)).skip(own) {
                    let held = (0..3).any(|k| {
                        holder.tiers[k].as_ref().is_some_and(|x| x.pool.lookup(*h).is_some())
                    });
                    if !held {
                        break;
                    }
                    pulled += 1;
                }
                if pulled > 0 {
                    let bytes = pulled * self.block_bytes;
                    restore_s += self.cfg.pull_overhead_s
                        + bytes as f64 / (self.cfg.peer_link_gbps.max(1e-9) * 1e9);
                    self.r.bytes.pull += bytes;
                    self.rates.add(t, PULL, bytes);
                    self.r.pulled_tokens += pulled * bt;
                    self.r.pulls += 1;
                }
            }
            for k in 1..4 {
                let bytes = per_tier[k] * self.block_bytes;
                restore_s += bytes as f64 / (self.cfg.link_gbps[k - 1].max(1e-9) * 1e9);
                *self.r.bytes.fields()[ONBOARD[k - 1]] += bytes;
                self.rates.add(t, ONBOARD[k - 1], bytes);
            }
            self.restores.push(
                (per_tier[1] + per_tier[2] + per_tier[3] + pulled) as f64 * self.block_bytes as f64,
            );
            let hit_blocks = per_tier.iter().sum::<u64>() + pulled;
            Timeline::add(&mut self.r.timeline.reused_tokens, q.arrival, hit_blocks * bt);
            for (k, n) in per_tier.iter().enumerate() {
                self.r.reused_tokens[k] += n * bt;
            }
            q.cached_blocks = hit_blocks;
            q.to_compute = q.input - hit_blocks * bt;
            self.r.prefill_tokens += q.to_compute;
            hit_blocks as usize
        };
        let (pinned, _) = store_blocks(
            &mut self.workers[wi],
            &hashes[..held],
            None,
            &mut self.events,
            &mut self.rates,
            t,
            self.block_bytes,
            &mut self.r,
        );
        q.pinned = pinned;
        self.spill(wi, t);
        restore_s
    }

    /// Writes what fell off worker `wi`'s lowest tier to G4 ([`SimConfig::g4_on_evict`]).
    fn spill(&mut self, wi: usize, t: f64) {
        let fallen = std::mem::take(&mut self.workers[wi].fallen);
        if let Some(g4) = self.g4.as_mut().filter(|_| !fallen.is_empty()) {
            self.r.bytes.write_g4 += write_g4(
                g4,
                &fallen,
                &mut self.events,
                &mut self.g4_event_id,
                &mut self.rates,
                t,
                self.block_bytes,
            );
        }
    }

    /// The end of worker `wi`'s step at `t`: chunks computed (a prompt done is a first
    /// token, its blocks stored), a token for every decoding sequence (the last one finishes
    /// it).
    fn end_step(&mut self, wi: usize, t: f64) {
        let Some(step) = self.workers[wi].step.take() else { return };
        for (rid, c) in step.chunks {
            let q = &mut self.requests[rid];
            q.to_compute -= c;
            if q.to_compute > 0 {
                continue;
            }
            let prefill_only = self.workers[wi].prefill_only;
            if !prefill_only {
                q.first_token = Some(t);
                q.generated = 1;
                self.r.timeline.ttft.push((q.arrival, t - q.arrival));
            }
            self.router.prefill_done(rid as u64);
            let hashes = self.hashes(rid);
            let q = &mut self.requests[rid];
            let done = q.cached_blocks as usize;
            let w = &mut self.workers[wi];
            let parent = done.checked_sub(1).map(|i| hashes[i]);
            let rest = &hashes[done.min(hashes.len())..];
            let (pinned, computed) = store_blocks(
                w,
                rest,
                parent,
                &mut self.events,
                &mut self.rates,
                t,
                self.block_bytes,
                &mut self.r,
            );
            q.pinned.extend(pinned);
            let done = q.generated >= q.output;
            self.spill(wi, t);
            if let Some(g4) = self.g4.as_mut().filter(|_| !self.cfg.g4_on_evict) {
                self.r.bytes.write_g4 += write_g4(
                    g4,
                    &computed,
                    &mut self.events,
                    &mut self.g4_event_id,
                    &mut self.rates,
                    t,
                    self.block_bytes,
                );
            }
            if prefill_only {
                self.hand_off(wi, rid, t);
            } else if done {
                self.finish(wi, rid, t);
            }
        }
        for rid in step.decoding {
            let q = &mut self.requests[rid];
            if q.first_token.is_none() {
                // A handed-off request's first token, from its decode worker's first step.
                q.first_token = Some(t);
                self.r.timeline.ttft.push((q.arrival, t - q.arrival));
                if let Some(r) = self.decode_router.as_mut() {
                    r.prefill_done(rid as u64);
                }
            }
            q.generated += 1;
            if q.generated >= q.output {
                self.finish(wi, rid, t);
            }
        }
    }

    /// A prefill worker's prompt is done: its blocks stay cached there (unpinned), its KV
    /// crosses the KV link to the least-loaded decode worker, where it waits for admission.
    fn hand_off(&mut self, wi: usize, rid: usize, t: f64) {
        self.router.free(rid as u64);
        let hashes = self.hashes(rid);
        let q = &mut self.requests[rid];
        let w = &mut self.workers[wi];
        w.running.retain(|&x| x != rid);
        w.unpin(q.pinned.drain(..));
        let Some(router) = self.decode_router.as_mut() else { return };
        let Some(d) = router.route(self.events.index, rid as u64, &hashes, q.input, t, 0.5) else {
            return;
        };
        let to = (d.worker.0 - 1) as usize;
        q.decode_worker = Some(to);
        self.workers[to].served += 1;
        let bytes = q.input * self.cfg.bytes_per_token;
        self.r.bytes.handoff += bytes;
        self.rates.add(t, HANDOFF, bytes);
        let transfer = bytes as f64 / (self.cfg.kv_link_gbps.max(1e-9) * 1e9);
        self.steps.push(Reverse((Time(t + transfer), Ev::Handoff { rid, to })));
    }

    /// A request's last token at `t`: its blocks unpinned, its answer's full blocks stored (an
    /// engine caches what it generates; no later prompt of a trace holds them).
    fn finish(&mut self, wi: usize, rid: usize, t: f64) {
        let q = &mut self.requests[rid];
        let first = q.first_token.unwrap_or(t);
        if q.output > 1 {
            self.itl.push((t - first) / (q.output - 1) as f64);
        }
        self.e2e.push(t - q.arrival);
        self.last_finish = self.last_finish.max(t);
        match self.decode_router.as_mut() {
            Some(r) => r.free(rid as u64),
            None => self.router.free(rid as u64),
        }
        let w = &mut self.workers[wi];
        w.running.retain(|&x| x != rid);
        w.unpin(q.pinned.drain(..));
        let mut mix = SplitMix64(self.cfg.seed ^ (rid as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let answer: Vec<SequenceHash> =
            (0..q.answer_blocks).map(|_| SequenceHash(mix.next_u64())).collect();
        let (pinned, _) = store_blocks(
            w,
            &answer,
            None,
            &mut self.events,
            &mut self.rates,
            t,
            self.block_bytes,
            &mut self.r,
        );
        w.unpin(pinned.into_iter());
        self.requests.remove(rid);
        self.spill(wi, t);
    }
}

/// Opens the trace at `path` (ids of `block_tokens` tokens) as `cfg` replays it: lines
/// whose prompt is longer than its `prompt_tokens_max` are refused.
pub fn open(
    path: &std::path::Path,
    block_tokens: u32,
    cfg: &SimConfig,
) -> Result<crate::trace::TraceReader<std::io::BufReader<std::fs::File>>, TraceError> {
    Ok(crate::trace::TraceReader::open(path, block_tokens)?
        .max_prompt_tokens(cfg.prompt_tokens_max))
}

/// Replays `trace` through the simulated deployment.
pub fn simulate(
    trace: impl Iterator<Item = Result<TraceRequest, TraceError>>,
    cfg: &SimConfig,
) -> Result<SimResult, TraceError> {
    let bt = cfg.block_tokens.as_usize();
    let hasher = TokenBlockHasher::new(cfg.block_tokens, HashSeed::default());
    let expander = Expander { block_tokens: cfg.reshape.to.max(1), ..Expander::new(cfg.seed) };
    let index = PrefixIndex::new();
    let prefill = cfg.prefill_workers;
    let pulls = cfg.peer_pulls && prefill == 0;
    let prefill_rate = match &cfg.profile {
        // The profile's rate at a step's worth of prompt.
        Some(p) => {
            let n = cfg.step_tokens.clamp(1, 8192) as f64;
            n / p.prefill_s.at(n).max(1e-9)
        }
        None => cfg.prefill_tokens_per_s,
    };
    let block_bytes = cfg.bytes_per_token * bt as u64;
    let g4_worth_it = block_bytes as f64 / (cfg.link_gbps[2].max(1e-9) * 1e9)
        <= bt as f64 / prefill_rate.max(1e-9);
    let defaults = RouterConfig::default();
    let mut router = Router::new(RouterConfig {
        mode: cfg.mode,
        block_tokens: cfg.block_tokens,
        block_load_scale: cfg.block_load_scale.unwrap_or(defaults.block_load_scale),
        pull: pulls.then(|| PullPricing {
            block_bytes: cfg.block_tokens.block_bytes(Bytes(cfg.bytes_per_token)).0,
            link_bytes_per_s: cfg.peer_link_gbps * 1e9,
            overhead_s: cfg.pull_overhead_s,
            prefill_tokens_per_s: prefill_rate,
        }),
        ..defaults
    });
    let kinds = [cfg.g1_tier, TierKind::Host, TierKind::Disk];
    let mut decode_router = (prefill > 0).then(|| {
        Router::new(RouterConfig {
            mode: RoutingMode::LeastLoaded,
            block_tokens: cfg.block_tokens,
            ..RouterConfig::default()
        })
    });
    // Prefill workers first (ids 1..=P), then the (decode) workers.
    let workers: Vec<SimWorker> = (0..prefill + cfg.workers.max(1))
        .map(|i| {
            let id = WorkerId(i as u64 + 1);
            index.add_worker(id);
            match decode_router.as_mut() {
                Some(d) if i >= prefill => d.add_worker(id),
                _ => {
                    router.add_worker(id);
                    if pulls {
                        router.pool(id);
                    }
                }
            }
            SimWorker {
                id,
                prefill_only: i < prefill,
                tiers: std::array::from_fn(|t| {
                    let blocks = cfg.tier_blocks[t].min(u64::from(u32::MAX - 1)) as u32;
                    (blocks > 0 || t == 0).then(|| Tier {
                        pool: SlotPool::new(blocks.max(1), PolicyKind::Lru),
                        kind: kinds[t],
                    })
                }),
                filter: FrequencyFilter::new(cfg.g3_min_hits, 1 << 22),
                event_id: 0,
                waiting: VecDeque::new(),
                running: Vec::new(),
                step: None,
                decodes_deferred: false,
                served: 0,
                accepted: 0,
                keep_fallen: cfg.g4_on_evict && cfg.g4_blocks > 0,
                fallen: Vec::new(),
            }
        })
        .collect();
    let g4 = (cfg.g4_blocks > 0).then(|| {
        index.add_worker(WorkerId(0));
        Tier {
            pool: SlotPool::new(cfg.g4_blocks.min(u64::from(u32::MAX - 1)) as u32, PolicyKind::Lru),
            kind: TierKind::Remote,
        }
    });
    let mut sim = Sim {
        cfg,
        memo: HashMemo::default(),
        expander,
        hasher,
        block_bytes,
        g4_worth_it,
        events: Events { index: &index, count: 0, ingest: std::time::Duration::ZERO },
        router,
        workers,
        g4,
        g4_event_id: 0,
        requests: InFlight::default(),
        steps: BinaryHeap::new(),
        decode_router,
        rates: Rates::default(),
        r: SimResult::default(),
        itl: Vec::new(),
        e2e: Vec::new(),
        restores: Vec::new(),
        last_finish: 0.0,
        reports: BinaryHeap::new(),
    };
    if cfg.load_report_s > 0.0 && cfg.load_report_s.is_finite() {
        // The workers the router routes over (the first ones: prefill workers come first).
        let mut phase = SplitMix64(cfg.seed ^ 0x10AD);
        for wi in 0..sim.router.workers().len() {
            let first = cfg.load_report_s.max(LOAD_REPORT_MIN_S) * phase.next_f64();
            sim.reports.push(Reverse((Time(first), wi)));
        }
    }
    // The trace's limit (an infinite cache): the one state that grows with the trace, by
    // its distinct ids (8 bytes each, 1/64 of a byte a token at 512 tokens an id).
    let mut curve = LimitCounter::new(cfg.reshape.to);
    let mut rng = SplitMix64(cfg.seed ^ 0x5EED);
    let speedup = if cfg.speedup > 0.0 { cfg.speedup } else { 1.0 };
    for (i, req) in trace.enumerate() {
        if i as u64 >= cfg.requests_max {
            break;
        }
        let req = cfg.reshape.apply(req?);
        curve.push(&req);
        let now = req.timestamp as f64 / 1000.0 / speedup;
        sim.reports_until(now);
        sim.advance(now);
        sim.router.expire(now);
        // The prompt's block hashes, as kvfabric computes them, memoized per trace block.
        let hashes =
            prompt_hashes(&req.hash_ids, req.input_length, &expander, &hasher, &mut sim.memo);
        let rid = sim.requests.next;
        let d = sim
            .router
            .route(&index, rid as u64, &hashes, req.input_length, now, rng.next_f64())
            .unwrap_or_else(|| unreachable!("the router has workers"));
        let wi = (d.worker.0 - 1) as usize;
        sim.workers[wi].served += 1;
        sim.workers[wi].accepted += 1;
        sim.router.accepted(rid as u64, sim.workers[wi].accepted);
        sim.r.prompt_tokens += req.input_length;
        Timeline::add(&mut sim.r.timeline.prompt_tokens, now, req.input_length);
        sim.r.requests += 1;
        let output = req.output_length.max(1);
        let block = bt as u64;
        let kv_tokens = req.input_length + output - 1;
        drop(hashes);
        let rid = sim.requests.push(Request {
            arrival: now,
            input: req.input_length,
            output,
            ids: req.hash_ids.into_boxed_slice(),
            answer_blocks: kv_tokens / block - req.input_length / block,
            pinned: Vec::new(),
            cached_blocks: 0,
            to_compute: 0,
            first_token: None,
            generated: 0,
            decode_worker: None,
            pull: d.pull.map(|p| ((p.from.0 - 1) as usize, p.blocks)),
        });
        sim.arrive(wi, rid, now);
    }
    sim.advance(f64::INFINITY);
    let q = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        [0.5, 0.9, 0.99].map(|p| crate::stats::quantile(v, p))
    };
    let mut r = std::mem::take(&mut sim.r);
    let mut ttft: Vec<f64> = r.timeline.ttft.iter().map(|&(_, x)| x).collect();
    r.ttft_s = q(&mut ttft);
    r.itl_s = q(&mut sim.itl);
    r.e2e_s = q(&mut sim.e2e);
    r.restore_bytes = q(&mut sim.restores);
    r.limit = curve.limit();
    r.per_worker = sim.workers.iter().map(|w| w.served).collect();
    r.events = sim.events.count;
    r.ingest_s = sim.events.ingest.as_secs_f64();
    r.index_blocks = index.len() as u64;
    r.span_s = sim.last_finish;
    let rates = &sim.rates;
    let mut peak = Moved::default();
    for s in &rates.per_s {
        for (k, f) in peak.fields().into_iter().enumerate() {
            *f = (*f).max(s[k]);
        }
    }
    r.peak_bytes_per_s = peak;
    let mut p99 = Moved::default();
    for (k, f) in p99.fields().into_iter().enumerate() {
        let mut v: Vec<f64> = rates.per_s.iter().map(|s| s[k] as f64).collect();
        *f = q(&mut v)[2] as u64;
    }
    r.p99_bytes_per_s = p99;
    r.timeline.bytes = std::mem::take(&mut sim.rates.per_s);
    Ok(r)
}
