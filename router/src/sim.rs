//! A deterministic routing simulation: simulated workers with a simple timing model, fed a
//! seeded workload of multi-turn conversations over shared system prompts, routed by the
//! real [`Router`] over the real [`PrefixIndex`], which learns the workers' caches only
//! through the KV events their simulated caches emit (stores and LRU evictions).
//!
//! Timing model per worker: prefills run one at a time, FIFO, taking
//! `uncached prompt tokens × prefill_s_per_token`; TTFT is the wait plus that. Decoding runs
//! alongside at `decode_s_per_token` per output token. After its prefill a request's prompt
//! blocks enter the worker's LRU cache; when it finishes, its output blocks too, and the
//! conversation's next turn arrives after a think time.
//!
//! Simulated time only: no clock, no threads; the same seed gives the same numbers.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use kvfabric::events::{KvEvent, KvEventData, TierKind};
use kvfabric::hash::{HashSeed, SequenceHash, TokenBlockHasher};
use kvfabric::rng::SplitMix64;

use crate::index::{PrefixIndex, WorkerId};
use crate::policy::{Router, RouterConfig};

/// The workload and the workers.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts shared by the conversations.
    pub system_prompts: usize,
    /// Tokens of a system prompt.
    pub system_prompt_tokens: u32,
    /// User message tokens, uniform in this range.
    pub user_tokens: (u32, u32),
    /// Output tokens, uniform in this range.
    pub output_tokens: (u32, u32),
    /// New conversations per second (Poisson).
    pub arrival_rate: f64,
    /// Seconds between a reply and the next turn.
    pub think_time_s: f64,
    /// Prefill seconds per uncached prompt token.
    pub prefill_s_per_token: f64,
    /// Decode seconds per output token.
    pub decode_s_per_token: f64,
    /// KV blocks each worker caches.
    pub cache_blocks: usize,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Seed of the workload.
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 8,
            conversations: 400,
            turns: 4,
            system_prompts: 8,
            system_prompt_tokens: 1024,
            user_tokens: (64, 256),
            output_tokens: (64, 256),
            arrival_rate: 4.0,
            think_time_s: 2.0,
            prefill_s_per_token: 0.000_2,
            decode_s_per_token: 0.02,
            cache_blocks: 4096,
            block_tokens: 16,
            seed: 42,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SimResult {
    /// Requests served.
    pub requests: usize,
    /// Prompt tokens found cached on the chosen worker / all prompt tokens.
    pub hit_rate: f64,
    /// Median time to first token, seconds.
    pub ttft_p50_s: f64,
    /// 99th percentile time to first token, seconds.
    pub ttft_p99_s: f64,
    /// The same workload's floor, the same for every router: median TTFT if every block a
    /// request shares with an earlier one (its conversation so far, its system prompt) were
    /// cached where it runs and it never queued, i.e. only its new user tokens and the
    /// partial last block before them are prefilled.
    pub floor_ttft_p50_s: f64,
    /// Output tokens per second over the run.
    pub throughput_tok_s: f64,
    /// Requests per second over the run.
    pub throughput_req_s: f64,
}

#[derive(Debug, Default)]
struct SimWorker {
    lru: HashMap<SequenceHash, u64>,
    order: BTreeMap<u64, SequenceHash>,
    tick: u64,
    busy_until: f64,
    event_id: u64,
}

impl SimWorker {
    fn cached_prefix(&self, hashes: &[SequenceHash]) -> usize {
        hashes.iter().take_while(|h| self.lru.contains_key(h)).count()
    }

    /// Inserts (or touches) blocks; returns (new blocks, evicted blocks).
    fn insert(
        &mut self,
        hashes: &[SequenceHash],
        capacity: usize,
    ) -> (Vec<SequenceHash>, Vec<SequenceHash>) {
        let (mut new, mut evicted) = (Vec::new(), Vec::new());
        for &h in hashes {
            self.tick += 1;
            if let Some(old) = self.lru.insert(h, self.tick) {
                self.order.remove(&old);
            } else {
                new.push(h);
            }
            self.order.insert(self.tick, h);
            while self.lru.len() > capacity {
                let Some((_, victim)) = self.order.pop_first() else { break };
                self.lru.remove(&victim);
                evicted.push(victim);
            }
        }
        // A block stored and evicted in the same step never existed for the router.
        new.retain(|h| self.lru.contains_key(h));
        (new, evicted)
    }
}

/// Simulated seconds, totally ordered.
#[derive(Debug, Clone, Copy)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrival { conv: usize },
    PrefillDone { req: usize },
    DecodeDone { req: usize },
}

struct Req {
    conv: usize,
    worker: WorkerId,
    hashes: Vec<SequenceHash>,
    arrival: f64,
    output: u32,
}

/// Runs the workload through a router configured by `router_cfg`.
pub fn simulate(cfg: &SimConfig, router_cfg: RouterConfig) -> SimResult {
    let mut rng = SplitMix64(cfg.seed);
    let hasher = TokenBlockHasher::new(cfg.block_tokens.max(1) as usize, HashSeed::DEFAULT)
        .unwrap_or_else(|_| unreachable!("block_tokens is at least 1"));
    let prompts: Vec<Vec<u32>> = (0..cfg.system_prompts.max(1))
        .map(|_| (0..cfg.system_prompt_tokens).map(|_| (rng.next_u64() % 49_152) as u32).collect())
        .collect();
    let mut history: Vec<Vec<u32>> = Vec::with_capacity(cfg.conversations);
    let mut turns_left = vec![cfg.turns; cfg.conversations];
    let mut queue: BinaryHeap<Reverse<(Time, Ev)>> = BinaryHeap::new();
    let mut t = 0.0;
    for c in 0..cfg.conversations {
        history.push(prompts[c % prompts.len()].clone());
        // Poisson arrivals of new conversations.
        t += -(1.0 - rng.next_f64()).ln() / cfg.arrival_rate.max(1e-9);
        queue.push(Reverse((Time(t), Ev::Arrival { conv: c })));
    }
    // Each conversation draws its messages from its own generator, and routing from another,
    // so that every router sees the same workload whatever order its events come in.
    let mut conv_rng: Vec<SplitMix64> =
        (0..cfg.conversations).map(|c| SplitMix64(rng.next_u64() ^ c as u64)).collect();
    let mut route_rng = SplitMix64(rng.next_u64());
    let index = PrefixIndex::new();
    let mut router = Router::new(router_cfg);
    let mut workers: Vec<SimWorker> =
        (0..cfg.workers.max(1)).map(|_| SimWorker::default()).collect();
    for w in (0..workers.len() as u64).map(WorkerId) {
        index.add_worker(w);
        router.add_worker(w);
    }
    let mut reqs: Vec<Req> = Vec::new();
    let (mut ttfts, mut prompt_tokens, mut cached_tokens, mut out_tokens) =
        (Vec::new(), 0u64, 0u64, 0u64);
    let mut floors = Vec::new();
    let block = u64::from(cfg.block_tokens.max(1));
    let (mut first, mut last) = (f64::INFINITY, 0.0f64);
    let publish = |index: &PrefixIndex,
                   w: &mut SimWorker,
                   id: WorkerId,
                   stored: Vec<SequenceHash>,
                   removed: Vec<SequenceHash>| {
        for (data, go) in [
            (
                KvEventData::Stored {
                    sequence_hashes: stored.clone(),
                    parent: None,
                    tier: TierKind::Device,
                },
                !stored.is_empty(),
            ),
            (
                KvEventData::Removed { sequence_hashes: removed.clone(), tier: TierKind::Device },
                !removed.is_empty(),
            ),
        ] {
            if go {
                w.event_id += 1;
                index.ingest(id, &KvEvent { event_id: w.event_id, data });
            }
        }
    };
    while let Some(Reverse((Time(now), ev))) = queue.pop() {
        router.expire(now);
        match ev {
            Ev::Arrival { conv } => {
                let rng = &mut conv_rng[conv];
                let user = rng.range_u32(cfg.user_tokens.0, cfg.user_tokens.1);
                let reusable = history[conv].len() as u64 / block * block;
                history[conv].extend((0..user).map(|_| (rng.next_u64() % 49_152) as u32));
                let prompt = &history[conv];
                floors.push((prompt.len() as u64 - reusable) as f64 * cfg.prefill_s_per_token);
                let hashes = hasher.sequence_hashes(prompt);
                let id = reqs.len();
                let d = router
                    .route(
                        &index,
                        id as u64,
                        &hashes,
                        prompt.len() as u64,
                        now,
                        route_rng.next_f64(),
                    )
                    .unwrap_or_else(|| unreachable!("the router has workers"));
                let w = &mut workers[d.worker.0 as usize];
                let cached = w.cached_prefix(&hashes) as u64 * u64::from(cfg.block_tokens);
                let uncached = prompt.len() as u64 - cached.min(prompt.len() as u64);
                prompt_tokens += prompt.len() as u64;
                cached_tokens += cached.min(prompt.len() as u64);
                let start = now.max(w.busy_until);
                let end = start + uncached as f64 * cfg.prefill_s_per_token;
                w.busy_until = end;
                first = first.min(now);
                let output = conv_rng[conv].range_u32(cfg.output_tokens.0, cfg.output_tokens.1);
                reqs.push(Req { conv, worker: d.worker, hashes, arrival: now, output });
                queue.push(Reverse((Time(end), Ev::PrefillDone { req: id })));
            }
            Ev::PrefillDone { req } => {
                let r = &reqs[req];
                ttfts.push(now - r.arrival);
                let w = &mut workers[r.worker.0 as usize];
                let (stored, removed) = w.insert(&r.hashes, cfg.cache_blocks);
                publish(&index, w, r.worker, stored, removed);
                router.prefill_done(req as u64);
                let done = now + f64::from(r.output) * cfg.decode_s_per_token;
                queue.push(Reverse((Time(done), Ev::DecodeDone { req })));
            }
            Ev::DecodeDone { req } => {
                let (conv, worker, output) = (reqs[req].conv, reqs[req].worker, reqs[req].output);
                router.free(req as u64);
                out_tokens += u64::from(output);
                last = last.max(now);
                let rng = &mut conv_rng[conv];
                history[conv].extend((0..output).map(|_| (rng.next_u64() % 49_152) as u32));
                let hashes = hasher.sequence_hashes(&history[conv]);
                let w = &mut workers[worker.0 as usize];
                let (stored, removed) = w.insert(&hashes, cfg.cache_blocks);
                publish(&index, w, worker, stored, removed);
                turns_left[conv] -= 1;
                if turns_left[conv] > 0 {
                    queue.push(Reverse((Time(now + cfg.think_time_s), Ev::Arrival { conv })));
                }
            }
        }
    }
    ttfts.sort_by(f64::total_cmp);
    floors.sort_by(f64::total_cmp);
    let quantile = |v: &[f64], p: f64| {
        v.get(((p * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1)) - 1)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let q = |p: f64| quantile(&ttfts, p);
    let span = (last - first).max(1e-9);
    SimResult {
        requests: reqs.len(),
        hit_rate: cached_tokens as f64 / prompt_tokens.max(1) as f64,
        ttft_p50_s: q(0.5),
        ttft_p99_s: q(0.99),
        floor_ttft_p50_s: quantile(&floors, 0.5),
        throughput_tok_s: out_tokens as f64 / span,
        throughput_req_s: reqs.len() as f64 / span,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RoutingMode;

    fn small() -> SimConfig {
        SimConfig { conversations: 60, workers: 4, ..SimConfig::default() }
    }

    #[test]
    fn deterministic_for_a_seed() {
        let a = simulate(&small(), RouterConfig::default());
        let b = simulate(&small(), RouterConfig::default());
        assert_eq!(a.ttft_p50_s, b.ttft_p50_s);
        assert_eq!(a.requests, 60 * 4);
    }

    #[test]
    fn kv_routing_hits_the_cache_more_than_round_robin() {
        let kv = simulate(&small(), RouterConfig::default());
        let rr = simulate(
            &small(),
            RouterConfig { mode: RoutingMode::RoundRobin, ..RouterConfig::default() },
        );
        assert!(kv.hit_rate > rr.hit_rate + 0.2, "kv {} rr {}", kv.hit_rate, rr.hit_rate);
        assert!(kv.ttft_p50_s < rr.ttft_p50_s, "kv {} rr {}", kv.ttft_p50_s, rr.ttft_p50_s);
        assert_eq!(kv.floor_ttft_p50_s, rr.floor_ttft_p50_s, "the floor is the workload's");
        assert!(kv.floor_ttft_p50_s > 0.0 && kv.floor_ttft_p50_s <= kv.ttft_p50_s);
    }
}
