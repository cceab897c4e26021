//! An offline simulator of a whole deployment replaying a trace, in simulated time, over
//! kvfabric's *real* policies: the router's [`PrefixIndex`] and [`Router`], fed only by the KV
//! events the simulated workers' tiers emit, and the tiers' own [`SlotPool`] (LRU eviction,
//! pins) and [`FrequencyFilter`] (admission to disk) per worker.
//!
//! Per worker: G1 (device), G2 (host), G3 (disk) pools, in blocks of `block_tokens`; one G4
//! pool shared by every worker (fabric nodes). A request's prompt is expanded into tokens
//! ([`Expander`]) and hashed as kvfabric hashes it; its worker is the router's choice at its
//! arrival; its leading cached run is looked up G1, then G2, G3, G4, at arrival.
//!
//! Timing, stated plainly (the linear engine model):
//! - prefills run one at a time per worker, first come first served; one takes the restore
//!   of its hits below G1 (bytes over each tier's link, one after the other), then its uncached
//!   tokens at `prefill_tokens_per_s`; its end is the first token (TTFT from arrival);
//! - decoding runs `batch_max` sequences at a time per worker, each step `decode_step_ms`; a
//!   sequence waits for a free place after its prefill (that wait shows in its ITL, the mean
//!   gap between its tokens).
//!
//! Blocks move as the tiered store moves them: a prefill's blocks enter G1 at its end, pinned
//! until the request finishes, then evictable (LRU); G1's victims go to G2 (unless there
//! already), G2's to G3 when the frequency filter admits them (hit at least `g3_min_hits`
//! times), G3's are dropped; blocks a prefill computed are written through to G4 (as
//! Mooncake's store puts every prefill's KV), whose LRU victims are dropped. Hits onboard
//! into G1 and stay where they were. Every change is a KV event to the index.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric::rng::SplitMix64;
use kvfabric_planner::trace::{Expander, Limit, ReuseCurve, TraceError, TraceRequest};
use kvfabric_router::{PrefixIndex, Router, RouterConfig, RoutingMode, WorkerId};
use kvfabric_tiers::policy::{FrequencyFilter, PolicyKind};
use kvfabric_tiers::pool::SlotPool;

/// The simulated deployment.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimConfig {
    /// Workers.
    pub workers: usize,
    /// Routing.
    pub mode: RoutingMode,
    /// kvfabric's tokens per KV block.
    pub block_tokens: u32,
    /// Tokens per hash id of the trace.
    pub trace_block_tokens: u32,
    /// G1, G2, G3 blocks per worker (0: no such tier).
    pub tier_blocks: [u64; 3],
    /// G4 blocks shared by all workers (0: none).
    pub g4_blocks: u64,
    /// Hits a block needs before G2 may write it to G3.
    pub g3_min_hits: u32,
    /// KV bytes per token (of the model).
    pub bytes_per_token: u64,
    /// GB/s of the links a hit in G2, G3, G4 crosses to reach G1.
    pub link_gbps: [f64; 3],
    /// Uncached prompt tokens a worker prefills per second.
    pub prefill_tokens_per_s: f64,
    /// One decode step, ms.
    pub decode_step_ms: f64,
    /// Sequences a worker decodes at once.
    pub batch_max: usize,
    /// Arrival times divided by this.
    pub speedup: f64,
    /// Requests replayed at most.
    pub requests_max: u64,
    /// Seed of the expansion and of routing draws.
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 8,
            mode: RoutingMode::Kv,
            block_tokens: 16,
            trace_block_tokens: 512,
            tier_blocks: [1 << 16, 0, 0],
            g4_blocks: 0,
            g3_min_hits: 2,
            bytes_per_token: 327_680,
            link_gbps: [64.0, 7.0, 50.0],
            prefill_tokens_per_s: 20_000.0,
            decode_step_ms: 20.0,
            batch_max: 64,
            speedup: 1.0,
            requests_max: u64::MAX,
            seed: 1,
        }
    }
}

/// What a replay measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SimResult {
    /// Requests replayed.
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens found cached, per tier (G1..G4).
    pub reused_tokens: [u64; 4],
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
}

impl Moved {
    fn fields(&mut self) -> [&mut u64; 6] {
        [
            &mut self.onboard_g2,
            &mut self.onboard_g3,
            &mut self.onboard_g4,
            &mut self.offload_g2,
            &mut self.offload_g3,
            &mut self.write_g4,
        ]
    }
}

impl SimResult {
    /// Reused prompt tokens over prompt tokens.
    pub fn reuse(&self) -> f64 {
        self.reused_tokens.iter().sum::<u64>() as f64 / self.prompt_tokens.max(1) as f64
    }
}

const ONBOARD: [usize; 3] = [0, 1, 2];
const OFFLOAD_G2: usize = 3;
const OFFLOAD_G3: usize = 4;
const WRITE_G4: usize = 5;

/// One tier of one worker (or the shared G4).
#[derive(Debug)]
struct Tier {
    pool: SlotPool,
    kind: TierKind,
}

#[derive(Debug)]
struct SimWorker {
    id: WorkerId,
    tiers: [Option<Tier>; 3],
    filter: FrequencyFilter,
    event_id: u64,
    prefill_free_at: f64,
    /// When each decode place frees, earliest first.
    decode_free: BinaryHeap<Reverse<Time>>,
    served: u64,
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

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Prefill ended: the prompt's blocks enter G1, pinned.
    Prefilled { req: usize },
    /// The request finished: its blocks unpinned.
    Finished { req: usize },
}

struct Running {
    worker: usize,
    hashes: Vec<SequenceHash>,
    /// G1 slots it pins.
    pinned: Vec<u32>,
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
    per_s: Vec<[u64; 6]>,
}

impl Rates {
    fn add(&mut self, t: f64, what: usize, bytes: u64) {
        let s = t.max(0.0) as usize;
        if self.per_s.len() <= s {
            self.per_s.resize(s + 1, [0; 6]);
        }
        self.per_s[s][what] += bytes;
    }
}

/// Replays `trace` through the simulated deployment.
pub fn simulate(
    trace: impl Iterator<Item = Result<TraceRequest, TraceError>>,
    cfg: &SimConfig,
) -> Result<SimResult, TraceError> {
    let bt = cfg.block_tokens.max(1) as usize;
    let hasher = TokenBlockHasher::new(bt, HashSeed::default())
        .unwrap_or_else(|_| unreachable!("block_tokens is at least 1"));
    let expander =
        Expander { block_tokens: cfg.trace_block_tokens.max(1), ..Expander::new(cfg.seed) };
    let block_bytes = cfg.bytes_per_token * bt as u64;
    let index = PrefixIndex::new();
    let mut events = Events { index: &index, count: 0, ingest: std::time::Duration::ZERO };
    let mut router = Router::new(RouterConfig {
        mode: cfg.mode,
        block_tokens: cfg.block_tokens,
        ..RouterConfig::default()
    });
    let kinds = [TierKind::Device, TierKind::Host, TierKind::Disk];
    let mut workers: Vec<SimWorker> = (0..cfg.workers.max(1))
        .map(|i| {
            let id = WorkerId(i as u64 + 1);
            index.add_worker(id);
            router.add_worker(id);
            SimWorker {
                id,
                tiers: std::array::from_fn(|t| {
                    let blocks = cfg.tier_blocks[t].min(u64::from(u32::MAX - 1)) as u32;
                    (blocks > 0 || t == 0).then(|| Tier {
                        pool: SlotPool::new(blocks.max(1), PolicyKind::Lru),
                        kind: kinds[t],
                    })
                }),
                filter: FrequencyFilter::new(cfg.g3_min_hits, 1 << 22),
                event_id: 0,
                prefill_free_at: 0.0,
                decode_free: (0..cfg.batch_max.max(1)).map(|_| Reverse(Time(0.0))).collect(),
                served: 0,
            }
        })
        .collect();
    let g4_id = WorkerId(0);
    let mut g4 = (cfg.g4_blocks > 0).then(|| {
        index.add_worker(g4_id);
        Tier {
            pool: SlotPool::new(cfg.g4_blocks.min(u64::from(u32::MAX - 1)) as u32, PolicyKind::Lru),
            kind: TierKind::Remote,
        }
    });
    let mut g4_event_id = 0u64;
    let mut curve = ReuseCurve::new(cfg.trace_block_tokens);
    let mut memo: HashMap<(Option<SequenceHash>, u64), Box<[SequenceHash]>> = HashMap::new();
    let mut queue: BinaryHeap<Reverse<(Time, Ev)>> = BinaryHeap::new();
    let mut running: Vec<Option<Running>> = Vec::new();
    let mut rng = SplitMix64(cfg.seed ^ 0x5EED);
    let mut rates = Rates::default();
    let mut r = SimResult::default();
    let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let mut restores = Vec::new();
    let mut tokens = Vec::new();
    let mut last_finish = 0.0f64;
    let speedup = if cfg.speedup > 0.0 { cfg.speedup } else { 1.0 };

    // Applies every completion up to `until`.
    let drain = |until: f64,
                 queue: &mut BinaryHeap<Reverse<(Time, Ev)>>,
                 running: &mut Vec<Option<Running>>,
                 workers: &mut Vec<SimWorker>,
                 g4: &mut Option<Tier>,
                 g4_event_id: &mut u64,
                 events: &mut Events<'_>,
                 rates: &mut Rates,
                 router: &mut Router,
                 r: &mut SimResult| {
        while let Some(Reverse((Time(t), _))) = queue.peek() {
            if *t > until {
                break;
            }
            let Some(Reverse((Time(t), ev))) = queue.pop() else { break };
            match ev {
                Ev::Prefilled { req } => {
                    let Some(run) = running[req].as_mut() else { continue };
                    router.prefill_done(req as u64);
                    let w = &mut workers[run.worker];
                    let (pinned, computed) =
                        store_prompt(w, &run.hashes, events, rates, t, block_bytes, r);
                    run.pinned = pinned;
                    if let Some(g4) = g4.as_mut() {
                        r.bytes.write_g4 +=
                            write_g4(g4, &computed, events, g4_event_id, rates, t, block_bytes);
                    }
                }
                Ev::Finished { req } => {
                    let Some(run) = running[req].take() else { continue };
                    router.free(req as u64);
                    let w = &mut workers[run.worker];
                    if let Some(g1) = w.tiers[0].as_mut() {
                        for s in run.pinned {
                            let _ = g1.pool.unpin(s);
                        }
                    }
                }
            }
        }
    };

    for (i, req) in trace.enumerate() {
        let req = req?;
        if i as u64 >= cfg.requests_max {
            break;
        }
        curve.push(&req);
        let now = req.timestamp as f64 / 1000.0 / speedup;
        drain(
            now,
            &mut queue,
            &mut running,
            &mut workers,
            &mut g4,
            &mut g4_event_id,
            &mut events,
            &mut rates,
            &mut router,
            &mut r,
        );
        router.expire(now);
        // The prompt's block hashes, as kvfabric computes them, memoized per trace block.
        let hashes = prompt_hashes(&req, &expander, &hasher, &mut memo, &mut tokens);
        let rid = running.len();
        let d = router
            .route(&index, rid as u64, &hashes, req.input_length, now, rng.next_f64())
            .unwrap_or_else(|| unreachable!("the router has workers"));
        let wi = (d.worker.0 - 1) as usize;
        let w = &mut workers[wi];
        w.served += 1;
        // The leading run, tier by tier.
        let mut per_tier = [0u64; 4];
        for h in &hashes {
            let tier = (0..3)
                .find(|&t| w.tiers[t].as_ref().is_some_and(|x| x.pool.lookup(*h).is_some()))
                .or_else(|| g4.as_ref().filter(|g| g.pool.lookup(*h).is_some()).map(|_| 3));
            let Some(t) = tier else { break };
            per_tier[t] += 1;
            w.filter.hit(*h);
        }
        let block = bt as u64;
        let mut restore_s = 0.0;
        for t in 1..4 {
            let bytes = per_tier[t] * block_bytes;
            restore_s += bytes as f64 / (cfg.link_gbps[t - 1].max(1e-9) * 1e9);
            *r.bytes.fields()[ONBOARD[t - 1]] += bytes;
            rates.add(now, ONBOARD[t - 1], bytes);
        }
        restores.push((per_tier[1] + per_tier[2] + per_tier[3]) as f64 * block_bytes as f64);
        let reused: u64 = per_tier.iter().sum::<u64>() * block;
        for (t, n) in per_tier.iter().enumerate() {
            r.reused_tokens[t] += n * block;
        }
        let compute = req.input_length.saturating_sub(reused);
        r.prefill_tokens += compute;
        r.prompt_tokens += req.input_length;
        r.requests += 1;
        let start = now.max(w.prefill_free_at);
        let end = start + restore_s + compute as f64 / cfg.prefill_tokens_per_s.max(1e-9);
        w.prefill_free_at = end;
        let Reverse(Time(place)) = w.decode_free.pop().unwrap_or(Reverse(Time(0.0)));
        let steps = req.output_length.saturating_sub(1) as f64;
        let decode_start = end.max(place);
        let finish = decode_start + steps * cfg.decode_step_ms / 1000.0;
        w.decode_free.push(Reverse(Time(finish)));
        ttft.push(end - now);
        if req.output_length > 1 {
            itl.push((finish - end) / steps);
        }
        e2e.push(finish - now);
        last_finish = last_finish.max(finish);
        running.push(Some(Running { worker: wi, hashes, pinned: Vec::new() }));
        queue.push(Reverse((Time(end), Ev::Prefilled { req: rid })));
        queue.push(Reverse((Time(finish), Ev::Finished { req: rid })));
    }
    drain(
        f64::INFINITY,
        &mut queue,
        &mut running,
        &mut workers,
        &mut g4,
        &mut g4_event_id,
        &mut events,
        &mut rates,
        &mut router,
        &mut r,
    );
    let q = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        [0.5, 0.9, 0.99].map(|p| kvfabric_planner::stats::quantile(v, p))
    };
    r.ttft_s = q(&mut ttft);
    r.itl_s = q(&mut itl);
    r.e2e_s = q(&mut e2e);
    r.restore_bytes = q(&mut restores);
    r.limit = curve.limit();
    r.per_worker = workers.iter().map(|w| w.served).collect();
    r.events = events.count;
    r.ingest_s = events.ingest.as_secs_f64();
    r.index_blocks = index.len() as u64;
    r.span_s = last_finish;
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
    Ok(r)
}

/// The sequence hashes of `req`'s full blocks: each trace block's are computed once per
/// (parent, id) and reused wherever that block appears.
fn prompt_hashes(
    req: &TraceRequest,
    expander: &Expander,
    hasher: &TokenBlockHasher,
    memo: &mut HashMap<(Option<SequenceHash>, u64), Box<[SequenceHash]>>,
    tokens: &mut Vec<u32>,
) -> Vec<SequenceHash> {
    let tb = u64::from(expander.block_tokens);
    let mut out = Vec::with_capacity((req.input_length / hasher.block_tokens() as u64) as usize);
    let mut parent: Option<SequenceHash> = None;
    for (k, &id) in req.hash_ids.iter().enumerate() {
        let take = tb.min(req.input_length - k as u64 * tb) as usize;
        let full = take == tb as usize;
        let hashes: &[SequenceHash] = if full {
            memo.entry((parent, id)).or_insert_with(|| {
                tokens.clear();
                expander.block(id, take, tokens);
                hasher.extend(parent, tokens).into_boxed_slice()
            })
        } else {
            tokens.clear();
            expander.block(id, take, tokens);
            let v = hasher.extend(parent, tokens);
            out.extend_from_slice(&v);
            break;
        };
        out.extend_from_slice(hashes);
        parent = hashes.last().copied().or(parent);
    }
    out
}

/// Puts a prefill's blocks in G1, pinned (evicting what must go down a tier); returns the
/// pinned slots and the blocks that no tier held (computed by this prefill).
fn store_prompt(
    w: &mut SimWorker,
    hashes: &[SequenceHash],
    events: &mut Events<'_>,
    rates: &mut Rates,
    t: f64,
    block_bytes: u64,
    r: &mut SimResult,
) -> (Vec<u32>, Vec<SequenceHash>) {
    let mut pinned = Vec::with_capacity(hashes.len());
    let mut stored = Vec::new();
    let mut computed = Vec::new();
    let mut removed = Vec::new();
    let mut offloads: Vec<(SequenceHash, Option<SequenceHash>)> = Vec::new();
    {
        let Some(g1) = w.tiers[0].as_mut() else { return (pinned, computed) };
        for (k, &h) in hashes.iter().enumerate() {
            if let Some(s) = g1.pool.lookup(h) {
                g1.pool.touch(s);
                if g1.pool.pin(s).is_ok() {
                    pinned.push(s);
                }
                continue;
            }
            let parent = k.checked_sub(1).map(|p| hashes[p]);
            let slot = match g1.pool.reserve(h, parent) {
                Ok(s) => Some(s),
                Err(_) => match g1.pool.begin_evict() {
                    Some(v) => {
                        let _ = g1.pool.finish_evict(v.slot, true);
                        removed.push(v.hash);
                        offloads.push((v.hash, v.parent));
                        g1.pool.reserve(h, parent).ok()
                    }
                    None => None,
                },
            };
            let Some(slot) = slot else {
                r.g1_full += 1;
                continue;
            };
            if g1.pool.commit(slot, 1).is_ok() {
                pinned.push(slot);
                stored.push(h);
            }
        }
    }
    let id = w.id;
    events.emit(
        id,
        &mut w.event_id,
        KvEventData::Removed { sequence_hashes: removed, tier: TierKind::Device },
    );
    events.emit(
        id,
        &mut w.event_id,
        KvEventData::Stored {
            sequence_hashes: stored.clone(),
            parent: None,
            tier: TierKind::Device,
        },
    );
    // Blocks that no lower tier holds were computed here.
    for &h in &stored {
        let below = w.tiers[1..].iter().flatten().any(|t| t.pool.lookup(h).is_some());
        if !below {
            computed.push(h);
        }
        w.filter.hit(h);
    }
    offload(w, 1, offloads, events, rates, t, block_bytes, r);
    (pinned, computed)
}

/// Moves victims of tier `to - 1` into tier `to` (G2, or G3 if the filter admits them);
/// cascades that tier's own victims.
#[allow(clippy::too_many_arguments)]
fn offload(
    w: &mut SimWorker,
    to: usize,
    blocks: Vec<(SequenceHash, Option<SequenceHash>)>,
    events: &mut Events<'_>,
    rates: &mut Rates,
    t: f64,
    block_bytes: u64,
    r: &mut SimResult,
) {
    if blocks.is_empty() || to > 2 {
        return;
    }
    let filter = &w.filter;
    let Some(tier) = w.tiers[to].as_mut() else { return };
    let (mut stored, mut removed, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for (h, parent) in blocks {
        if to == 2 && !filter.admits(h) {
            continue;
        }
        if let Some(s) = tier.pool.lookup(h) {
            tier.pool.touch(s);
            continue;
        }
        let slot = match tier.pool.reserve(h, parent) {
            Ok(s) => Some(s),
            Err(_) => tier.pool.begin_evict().and_then(|v| {
                let _ = tier.pool.finish_evict(v.slot, true);
                removed.push(v.hash);
                next.push((v.hash, v.parent));
                tier.pool.reserve(h, parent).ok()
            }),
        };
        if let Some(s) = slot {
            if tier.pool.commit(s, 0).is_ok() {
                stored.push(h);
            }
        }
    }
    let kind = tier.kind;
    let bytes = stored.len() as u64 * block_bytes;
    let what = if to == 1 { OFFLOAD_G2 } else { OFFLOAD_G3 };
    *r.bytes.fields()[what] += bytes;
    rates.add(t, what, bytes);
    let id = w.id;
    events.emit(id, &mut w.event_id, KvEventData::Removed { sequence_hashes: removed, tier: kind });
    events.emit(
        id,
        &mut w.event_id,
        KvEventData::Stored { sequence_hashes: stored, parent: None, tier: kind },
    );
    offload(w, to + 1, next, events, rates, t, block_bytes, r);
}

/// Writes a prefill's computed blocks through to the shared G4 pool (LRU; victims dropped).
fn write_g4(
    g4: &mut Tier,
    blocks: &[SequenceHash],
    events: &mut Events<'_>,
    event_id: &mut u64,
    rates: &mut Rates,
    t: f64,
    block_bytes: u64,
) -> u64 {
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for &h in blocks {
        if let Some(s) = g4.pool.lookup(h) {
            g4.pool.touch(s);
            continue;
        }
        let slot = match g4.pool.reserve(h, None) {
            Ok(s) => Some(s),
            Err(_) => g4.pool.begin_evict().and_then(|v| {
                let _ = g4.pool.finish_evict(v.slot, true);
                removed.push(v.hash);
                g4.pool.reserve(h, None).ok()
            }),
        };
        if let Some(s) = slot {
            if g4.pool.commit(s, 0).is_ok() {
                stored.push(h);
            }
        }
    }
    let bytes = stored.len() as u64 * block_bytes;
    rates.add(t, WRITE_G4, bytes);
    let id = WorkerId(0);
    events.emit(
        id,
        event_id,
        KvEventData::Removed { sequence_hashes: removed, tier: TierKind::Remote },
    );
    events.emit(
        id,
        event_id,
        KvEventData::Stored { sequence_hashes: stored, parent: None, tier: TierKind::Remote },
    );
    bytes
}
