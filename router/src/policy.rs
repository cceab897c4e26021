//! Worker selection: the cost of sending a request to each worker, and the choice.
//!
//! `cost(w) = overlap_weight × (request blocks − Σ tier weight of w's leading cached blocks)
//!          + active_blocks(w) / block_load_scale + queued_prefill_tokens(w) / block_tokens`
//!
//! i.e. the prefill blocks left after a tier-weighted credit for what `w` already caches
//! (device > host > disk > remote), plus its decode load and its prefill queue. With
//! temperature 0 the cheapest worker wins (ties: the lowest id); above 0 a worker is sampled
//! with probability ∝ exp(−cost / temperature). The router tracks the requests it routed
//! (added at routing, prefill done, freed) so load is right between load reports: a worker
//! that numbers the requests it accepts says in each report how many it counts, and the
//! router adds on top only those the report does not count yet (the ones still on their way,
//! or accepted after it was measured); a report without that number replaces every tracked
//! request of its worker. In approximate mode the router predicts cache contents from its own
//! decisions, each for a TTL.
//!
//! Free of I/O and clock: the caller passes `now` (seconds, any epoch) and the random draw.

use std::collections::HashMap;

use kvfabric::events::TierKind;
use kvfabric::hash::SequenceHash;
use kvfabric::units::Blocks;

use crate::index::{Overlap, PrefixIndex, Run, WorkerId};

/// How to pick a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingMode {
    /// Cache overlap against load (the default).
    #[default]
    Kv,
    /// Each worker in turn.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// The fewest active blocks plus queued prefill.
    LeastLoaded,
}

impl std::str::FromStr for RoutingMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kv" => RoutingMode::Kv,
            "round-robin" => RoutingMode::RoundRobin,
            "random" => RoutingMode::Random,
            "least-loaded" => RoutingMode::LeastLoaded,
            other => {
                return Err(format!(
                    "unknown routing mode {other:?} (kv, round-robin, random, least-loaded)"
                ))
            }
        })
    }
}

/// Router settings.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RouterConfig {
    /// The mode.
    pub mode: RoutingMode,
    /// Credit for a cached block per tier (device, host, disk, remote), 0..=1.
    pub tier_weights: [f64; 4],
    /// Weight of the prefill term against the load terms.
    pub overlap_weight: f64,
    /// Softmax temperature; 0 picks the cheapest.
    pub temperature: f64,
    /// Tokens per block (prefill queue tokens are converted to blocks).
    pub block_tokens: kvfabric::units::BlockTokens,
    /// Active decode blocks that count as one block of prefill.
    pub block_load_scale: f64,
    /// Approximate mode: predict cache contents from routing decisions, for this long.
    pub approx_ttl_s: Option<f64>,
    /// A request routed and never freed (its caller vanished, or the worker's load reports
    /// that would replace it stopped coming) stops counting as load after this long, seconds.
    #[serde(default = "default_tracked_ttl_s")]
    pub tracked_ttl_s: f64,
    /// Price pulls from other workers' stores against computing (None: a worker's own cache
    /// only, as before one pool across workers).
    #[serde(default)]
    pub pull: Option<PullPricing>,
}

/// What the router prices a pull from a peer's store at, against computing the blocks.
///
/// For worker `w` whose cached run is `r_w` blocks, and peer `h` holding `r_h > r_w`: pulling
/// the `k = r_h − r_w` blocks takes `overhead_s + k × block_bytes / rate(h→w)` (the rate `w`
/// measured pulling from `h`, else `link_bytes_per_s`); computing them takes
/// `k × block_tokens / prefill_tokens_per_s(w)` (the rate `w` reports, else this default).
/// When the pull is faster, `w`'s prefill term is credited with the blocks' worth of time it
/// saves, `k − pull_s / block_compute_s`, and the cheapest worker is told to pull from `h`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PullPricing {
    /// Bytes of one KV block.
    pub block_bytes: u64,
    /// The rate of a link no pull has measured yet, bytes per second (the planner's link
    /// table).
    pub link_bytes_per_s: f64,
    /// The fixed cost of a pull, seconds (round trips, the holder pinning its blocks).
    pub overhead_s: f64,
    /// Prompt tokens a worker computes per second, until it reports its own rate.
    pub prefill_tokens_per_s: f64,
}

/// The path a request's prefix took, as the router chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Nothing cached anywhere the router priced: computed.
    Compute,
    /// The chosen worker's own cache (host, disk, device).
    Local,
    /// Part of the chosen worker's run is on the fabric's nodes (G4).
    Fabric,
    /// Pulled from another worker's store.
    Pull,
}

impl Path {
    /// Every path, in metrics order.
    pub const ALL: [Path; 4] = [Path::Compute, Path::Local, Path::Fabric, Path::Pull];

    /// Its label.
    pub fn name(self) -> &'static str {
        match self {
            Path::Compute => "compute",
            Path::Local => "local",
            Path::Fabric => "fabric",
            Path::Pull => "pull",
        }
    }
}

/// A pull the router chose: the chosen worker reads `blocks` leading blocks (counted from the
/// prompt's start; those past its own run) from `from`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PullPlan {
    /// The holder.
    pub from: WorkerId,
    /// The holder's leading run.
    pub blocks: u32,
    /// Blocks pulled (past the chosen worker's own run).
    pub pulled: u32,
    /// The pull's price, seconds.
    pub seconds: f64,
}

fn default_tracked_ttl_s() -> f64 {
    300.0
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            mode: RoutingMode::Kv,
            tier_weights: [1.0, 0.9, 0.6, 0.4],
            overlap_weight: 1.0,
            temperature: 0.0,
            block_tokens: kvfabric::units::BlockTokens::DEFAULT,
            block_load_scale: 8.0,
            approx_ttl_s: None,
            tracked_ttl_s: default_tracked_ttl_s(),
            pull: None,
        }
    }
}

/// Links remembered at most (a pair of workers each).
const LINKS_MAX: usize = 65_536;

/// A worker's load (its report on the control plane).
pub use kvfabric::contract::Load;

#[derive(Debug, Clone, Copy)]
struct Tracked {
    worker: WorkerId,
    blocks: u64,
    prefill_tokens: u64,
    prefilled: bool,
    /// Its number at the worker, once the worker said it (see [`Load::accepted`]).
    accepted: Option<u64>,
    /// When it stops counting (`now` of [`Router::route`] plus the tracked TTL).
    expires: f64,
}

/// The decision for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The chosen worker.
    pub worker: WorkerId,
    /// Its leading cached blocks, by tier.
    pub cached: Run,
    /// Its cost.
    pub cost: f64,
    /// The pull it is told to do, if pulling beats computing.
    pub pull: Option<PullPlan>,
    /// The path the prefix takes.
    pub path: Path,
}

/// The routing policy over an index.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    workers: Vec<WorkerId>,
    reported: HashMap<WorkerId, Load>,
    tracked: HashMap<u64, Tracked>,
    /// The earliest `expires` among `tracked` (or later).
    next_expiry: f64,
    next_rr: usize,
    approx: HashMap<(WorkerId, SequenceHash), f64>,
    /// Rates measured pulling, bytes per second, by (puller, holder).
    links: HashMap<(WorkerId, WorkerId), f64>,
    /// Prompt tokens per second each worker reported computing.
    prefill_rates: HashMap<WorkerId, f64>,
    /// Requests routed per [`Path::ALL`].
    paths: [u64; 4],
    /// Workers whose stores take part in the pool (they pull and serve pulls).
    pooled: std::collections::HashSet<WorkerId>,
}

impl Router {
    /// A router with no workers.
    pub fn new(config: RouterConfig) -> Self {
        Router {
            config,
            workers: Vec::new(),
            reported: HashMap::new(),
            tracked: HashMap::new(),
            next_expiry: f64::INFINITY,
            next_rr: 0,
            approx: HashMap::new(),
            links: HashMap::new(),
            prefill_rates: HashMap::new(),
            paths: [0; 4],
            pooled: Default::default(),
        }
    }

    /// Worker `w`'s store pulls from and serves its peers (it registered its store).
    pub fn pool(&mut self, w: WorkerId) {
        if self.workers.contains(&w) {
            self.pooled.insert(w);
        }
    }

    /// Worker `to` measured `bytes_per_s` pulling from `from`.
    pub fn report_link(&mut self, to: WorkerId, from: WorkerId, bytes_per_s: f64) {
        let known = self.links.contains_key(&(to, from));
        if bytes_per_s.is_finite() && bytes_per_s > 0.0 && (known || self.links.len() < LINKS_MAX) {
            self.links.insert((to, from), bytes_per_s);
        }
    }

    /// Worker `w` computes `tokens_per_s` prompt tokens per second.
    pub fn report_prefill_rate(&mut self, w: WorkerId, tokens_per_s: f64) {
        if tokens_per_s.is_finite() && tokens_per_s > 0.0 && self.workers.contains(&w) {
            self.prefill_rates.insert(w, tokens_per_s);
        }
    }

    /// The rate the router prices a pull from `from` to `to` at, bytes per second.
    pub fn link_rate(&self, to: WorkerId, from: WorkerId) -> Option<f64> {
        let p = self.config.pull.as_ref()?;
        Some(self.links.get(&(to, from)).copied().unwrap_or(p.link_bytes_per_s))
    }

    /// Requests routed per path, in [`Path::ALL`] order.
    pub fn paths(&self) -> [u64; 4] {
        self.paths
    }

    /// The best pull for worker `w` whose own run is `own` blocks: from the peer whose run
    /// saves the most time over computing, and the blocks' worth of time it saves.
    fn best_pull(&self, w: WorkerId, own: u32, overlap: &Overlap) -> Option<(PullPlan, f64)> {
        let p = self.config.pull.as_ref()?;
        let bt = f64::from(self.config.block_tokens.get());
        let rate = self.prefill_rates.get(&w).copied().unwrap_or(p.prefill_tokens_per_s);
        let block_s = bt / rate.max(1e-9);
        if !self.pooled.contains(&w) {
            return None;
        }
        let mut best: Option<(PullPlan, f64)> = None;
        for &(h, run) in &overlap.workers {
            if h == w || run.blocks <= own || !self.pooled.contains(&h) {
                continue;
            }
            let k = run.blocks - own;
            let link = self.link_rate(w, h).unwrap_or(p.link_bytes_per_s).max(1.0);
            let seconds = p.overhead_s + f64::from(k) * p.block_bytes as f64 / link;
            let saved = f64::from(k) - seconds / block_s;
            if saved > 0.0 && best.as_ref().is_none_or(|b| saved > b.1) {
                best = Some((PullPlan { from: h, blocks: run.blocks, pulled: k, seconds }, saved));
            }
        }
        best
    }

    /// Its config.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// A worker joined.
    pub fn add_worker(&mut self, w: WorkerId) {
        if let Err(i) = self.workers.binary_search(&w) {
            self.workers.insert(i, w);
        }
    }

    /// A worker left: it is never chosen again, and its tracked requests are forgotten.
    pub fn remove_worker(&mut self, w: WorkerId) {
        self.workers.retain(|&x| x != w);
        self.links.retain(|(to, from), _| *to != w && *from != w);
        self.pooled.remove(&w);
        self.prefill_rates.remove(&w);
        self.reported.remove(&w);
        self.tracked.retain(|_, t| t.worker != w);
        self.approx.retain(|(x, _), _| *x != w);
    }

    /// Workers.
    pub fn workers(&self) -> &[WorkerId] {
        &self.workers
    }

    /// A load report from a worker replaces what the router assumed of the requests it
    /// counts: those numbered up to its `accepted`, or all when it numbers none.
    pub fn report_load(&mut self, w: WorkerId, load: Load) {
        self.reported.insert(w, load);
        // Requests the worker already counts are no longer added on top.
        self.tracked.retain(|_, t| {
            t.worker != w
                || match (load.accepted, t.accepted) {
                    (Some(counted), Some(seq)) => seq > counted,
                    (Some(_), None) => true,
                    (None, _) => false,
                }
        });
    }

    /// The worker accepted request `request_id` as its `seq`-th: a report that counts that
    /// many counts it.
    pub fn accepted(&mut self, request_id: u64, seq: u64) {
        if let Some(t) = self.tracked.get_mut(&request_id) {
            t.accepted = Some(seq);
        }
    }

    /// The load the router assumes for a worker: its last report plus what was routed since.
    pub fn load(&self, w: WorkerId) -> Load {
        let mut l = self.reported.get(&w).copied().unwrap_or_default();
        for t in self.tracked.values().filter(|t| t.worker == w) {
            l.active_blocks += t.blocks;
            if !t.prefilled {
                l.queued_prefill_tokens += t.prefill_tokens;
            }
        }
        l
    }

    fn weight(&self, t: TierKind) -> f64 {
        self.config.tier_weights[t as usize]
    }

    fn cost(&self, w: WorkerId, request_blocks: usize, cached: Run) -> f64 {
        self.cost_terms(w, request_blocks, cached).iter().sum()
    }

    /// The three terms of a worker's cost in kv mode, which [`Router::scores`] sums: the
    /// blocks it would prefill (the request's blocks less its cached run, each cached block
    /// credited by its tier's weight, times the overlap weight), its decode load (active
    /// blocks over the load scale), and the prefill queued on it (in blocks).
    pub fn cost_terms(&self, w: WorkerId, request_blocks: usize, cached: Run) -> [f64; 3] {
        let credit: f64 = TierKind::ALL
            .iter()
            .map(|&t| f64::from(cached.per_tier[t as usize]) * self.weight(t))
            .sum();
        let load = self.load(w);
        [
            self.config.overlap_weight * (request_blocks as f64 - credit).max(0.0),
            load.active_blocks as f64 / self.config.block_load_scale.max(1e-9),
            load.queued_prefill_tokens as f64 / f64::from(self.config.block_tokens.get()),
        ]
    }

    /// Overlap from the approximate (predicted) index at `now`.
    fn approx_overlap(&self, hashes: &[SequenceHash], now: f64) -> Overlap {
        let mut workers = Vec::new();
        for &w in &self.workers {
            let n = hashes
                .iter()
                .take_while(|&&h| self.approx.get(&(w, h)).is_some_and(|&exp| exp > now))
                .count();
            if n > 0 {
                workers.push((w, Run::uniform(n as u32, TierKind::Host)));
            }
        }
        Overlap { workers }
    }

    /// Picks a worker for a request of `hashes` (its full blocks) and `prompt_tokens`, and
    /// tracks it as `request_id`. `draw` is a uniform random number in [0, 1) (used by the
    /// random mode and softmax sampling). None when there is no worker.
    pub fn route(
        &mut self,
        index: &PrefixIndex,
        request_id: u64,
        hashes: &[SequenceHash],
        prompt_tokens: u64,
        now: f64,
        draw: f64,
    ) -> Option<Decision> {
        self.route_weighted(index, request_id, hashes, prompt_tokens, now, draw, 1.0)
    }

    /// [`Router::route`] with the prefill term of kv mode scaled by `reuse` (below 1 for a
    /// latency class: queue delay weighs more than reuse).
    #[allow(clippy::too_many_arguments)]
    pub fn route_weighted(
        &mut self,
        index: &PrefixIndex,
        request_id: u64,
        hashes: &[SequenceHash],
        prompt_tokens: u64,
        now: f64,
        draw: f64,
        reuse: f64,
    ) -> Option<Decision> {
        if self.workers.is_empty() {
            return None;
        }
        self.expire_tracked(now);
        let overlap = match self.config.approx_ttl_s {
            Some(_) => self.approx_overlap(hashes, now),
            None => index.overlap(hashes),
        };
        let n = hashes.len();
        let reuse = if reuse.is_finite() { reuse.clamp(0.0, 1.0) } else { 1.0 };
        let pricing = self.config.mode == RoutingMode::Kv && self.config.pull.is_some();
        let mut pulls: Vec<Option<PullPlan>> = Vec::with_capacity(self.workers.len());
        let costs: Vec<(WorkerId, f64)> = self
            .workers
            .iter()
            .map(|&w| {
                let run = overlap.run(w);
                let [mut prefill, decode, queued] = self.cost_terms(w, n, run);
                let pull = pricing.then(|| self.best_pull(w, run.blocks, &overlap)).flatten();
                if let Some((_, saved)) = &pull {
                    prefill = (prefill - self.config.overlap_weight * saved).max(0.0);
                }
                pulls.push(pull.map(|p| p.0));
                (w, reuse * prefill + decode + queued)
            })
            .collect();
        let worker = match self.config.mode {
            RoutingMode::RoundRobin => {
                let w = self.workers[self.next_rr % self.workers.len()];
                self.next_rr = self.next_rr.wrapping_add(1);
                w
            }
            RoutingMode::Random => {
                let i = ((draw.clamp(0.0, 0.999_999_999)) * self.workers.len() as f64) as usize;
                self.workers[i.min(self.workers.len() - 1)]
            }
            RoutingMode::LeastLoaded => {
                let score = |w: WorkerId| {
                    let l = self.load(w);
                    l.active_blocks as f64
                        + l.queued_prefill_tokens as f64 / f64::from(self.config.block_tokens.get())
                };
                *self
                    .workers
                    .iter()
                    .min_by(|a, b| score(**a).total_cmp(&score(**b)).then(a.cmp(b)))
                    .unwrap_or(&self.workers[0])
            }
            RoutingMode::Kv => {
                select(&costs, self.config.temperature, draw).unwrap_or(self.workers[0])
            }
        };
        let at = costs.iter().position(|(w, _)| *w == worker);
        let cost = at.map_or(0.0, |i| costs[i].1);
        let cached = overlap.run(worker);
        let pull = match self.config.mode {
            RoutingMode::Kv => at.and_then(|i| pulls.get(i).copied().flatten()),
            _ => None,
        };
        let path = if pull.is_some() {
            Path::Pull
        } else if cached.blocks == 0 {
            Path::Compute
        } else if cached.per_tier[TierKind::Remote as usize] > 0 {
            Path::Fabric
        } else {
            Path::Local
        };
        self.paths[Path::ALL.iter().position(|&p| p == path).unwrap_or(0)] += 1;
        let held = pull.map_or(cached.blocks, |p| p.blocks);
        let uncached_tokens = prompt_tokens
            .saturating_sub(self.config.block_tokens.tokens_of(Blocks(u64::from(held))).0);
        self.tracked.insert(
            request_id,
            Tracked {
                worker,
                blocks: n as u64,
                prefill_tokens: uncached_tokens,
                prefilled: false,
                accepted: None,
                expires: now + self.config.tracked_ttl_s.max(0.0),
            },
        );
        self.next_expiry = self.next_expiry.min(now + self.config.tracked_ttl_s.max(0.0));
        if let Some(ttl) = self.config.approx_ttl_s {
            for &h in hashes {
                self.approx.insert((worker, h), now + ttl);
            }
        }
        Some(Decision { worker, cached, cost, pull, path })
    }

    /// Each worker's leading cached run and its cost for a request of `hashes`, as
    /// [`Router::route`] weighs them in kv mode, without routing anything.
    pub fn scores(
        &self,
        index: &PrefixIndex,
        hashes: &[SequenceHash],
        now: f64,
    ) -> Vec<(WorkerId, Run, f64)> {
        let overlap = match self.config.approx_ttl_s {
            Some(_) => self.approx_overlap(hashes, now),
            None => index.overlap(hashes),
        };
        let n = hashes.len();
        self.workers
            .iter()
            .map(|&w| {
                let run = overlap.run(w);
                (w, run, self.cost(w, n, run))
            })
            .collect()
    }

    /// The request's prefill finished (its tokens leave the prefill queue).
    pub fn prefill_done(&mut self, request_id: u64) {
        if let Some(t) = self.tracked.get_mut(&request_id) {
            t.prefilled = true;
        }
    }

    /// The request finished (its blocks leave the decode load).
    pub fn free(&mut self, request_id: u64) {
        self.tracked.remove(&request_id);
    }

    /// Forgets predictions (approximate mode) and tracked requests that expired at `now`.
    pub fn expire(&mut self, now: f64) {
        self.approx.retain(|_, &mut exp| exp > now);
        self.expire_tracked(now);
    }

    /// Forgets tracked requests past their TTL: with no load report to replace them (the bus
    /// is down, the caller never released them) they would count as load for ever.
    fn expire_tracked(&mut self, now: f64) {
        // Scanned only once the earliest expiry has passed.
        if now < self.next_expiry {
            return;
        }
        self.tracked.retain(|_, t| t.expires > now);
        self.next_expiry = self.tracked.values().map(|t| t.expires).fold(f64::INFINITY, f64::min);
    }

    /// Requests tracked.
    pub fn tracked(&self) -> usize {
        self.tracked.len()
    }
}

/// Chooses among `(worker, cost)`: argmin (lowest id on ties) at temperature 0, else softmax
/// sampling of −cost/temperature with the uniform `draw`. None when `costs` is empty.
pub fn select(costs: &[(WorkerId, f64)], temperature: f64, draw: f64) -> Option<WorkerId> {
    let argmin =
        || costs.iter().min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0))).map(|c| c.0);
    if temperature <= 0.0 || costs.len() < 2 {
        return argmin();
    }
    let min = costs.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
    let weights: Vec<f64> = costs.iter().map(|c| (-(c.1 - min) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    if !total.is_finite() || total <= 0.0 {
        return argmin();
    }
    let mut target = draw.clamp(0.0, 1.0) * total;
    for (c, w) in costs.iter().zip(&weights) {
        if target < *w {
            return Some(c.0);
        }
        target -= w;
    }
    costs.last().map(|c| c.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfabric::events::{KvEvent, KvEventData};

    fn ix_with(w: &[(WorkerId, &[u64], TierKind)]) -> PrefixIndex {
        let ix = PrefixIndex::new();
        for (i, (worker, hashes, tier)) in w.iter().enumerate() {
            ix.add_worker(*worker);
            ix.ingest(
                *worker,
                &KvEvent {
                    event_id: i as u64 + 1,
                    data: KvEventData::Stored {
                        sequence_hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
                        parent: None,
                        tier: *tier,
                    },
                },
            );
        }
        ix
    }

    fn hs(n: u64) -> Vec<SequenceHash> {
        (1..=n).map(SequenceHash).collect()
    }

    #[test]
    fn kv_mode_prefers_overlap_then_faster_tiers_then_lower_load() {
        let ix = ix_with(&[
            (WorkerId(1), &[1, 2, 3, 4], TierKind::Host),
            (WorkerId(2), &[1, 2, 3, 4], TierKind::Disk),
            (WorkerId(3), &[1], TierKind::Host),
        ]);
        let mut r = Router::new(RouterConfig::default());
        for w in [1, 2, 3].map(WorkerId) {
            r.add_worker(w);
        }
        let d = r.route(&ix, 1, &hs(8), 128, 0.0, 0.5).unwrap();
        assert_eq!(d.worker, WorkerId(1), "host beats disk for the same overlap");
        assert_eq!(d.cached, Run::uniform(4, TierKind::Host));
        // Worker 1 is now loaded with the request (8 blocks + 64 uncached tokens queued):
        // the next identical request goes to worker 2 (disk copy, no load).
        let d2 = r.route(&ix, 2, &hs(8), 128, 0.0, 0.5).unwrap();
        assert_eq!(d2.worker, WorkerId(2));
        // Freeing requests brings worker 1 back.
        r.free(1);
        r.free(2);
        assert_eq!(r.route(&ix, 3, &hs(8), 128, 0.0, 0.5).unwrap().worker, WorkerId(1));
        assert_eq!(r.load(WorkerId(1)).active_blocks, 8);
        r.prefill_done(3);
        assert_eq!(r.load(WorkerId(1)).queued_prefill_tokens, 0);
        r.report_load(WorkerId(1), Load { active_blocks: 1000, ..Load::default() });
        assert_eq!(r.load(WorkerId(1)).active_blocks, 1000, "a report replaces tracked load");
        assert_eq!(r.route(&ix, 4, &hs(8), 128, 0.0, 0.5).unwrap().worker, WorkerId(2));
        r.remove_worker(WorkerId(2));
        assert!(r.route(&ix, 5, &hs(8), 128, 0.0, 0.5).unwrap().worker != WorkerId(2));
    }

    #[test]
    fn a_numbered_report_replaces_only_the_requests_it_counts() {
        let ix = PrefixIndex::new();
        let mut r = Router::new(RouterConfig::default());
        let w = WorkerId(1);
        r.add_worker(w);
        // Three requests of 2 blocks, 32 tokens each: the worker numbered the first two; the
        // third is still on its way.
        for rid in 1..=3 {
            r.route(&ix, rid, &hs(2), 32, 0.0, 0.5).unwrap();
        }
        r.accepted(1, 41);
        r.accepted(2, 42);
        let report = |accepted| Load { active_blocks: 100, queued_prefill_tokens: 0, accepted };
        // Measured when it had accepted 41: request 2 (42) and 3 (unnumbered) come on top.
        r.report_load(w, report(Some(41)));
        assert_eq!(
            r.load(w),
            Load { active_blocks: 104, queued_prefill_tokens: 64, accepted: Some(41) }
        );
        assert_eq!(r.tracked(), 2);
        r.accepted(3, 43);
        r.report_load(w, report(Some(43)));
        assert_eq!(r.load(w).active_blocks, 100, "the report counts all three");
        assert_eq!(r.load(w).queued_prefill_tokens, 0);
        assert_eq!(r.tracked(), 0);
        // A report that numbers nothing (an engine behind its OpenAI API) replaces them all.
        r.route(&ix, 4, &hs(2), 32, 0.0, 0.5).unwrap();
        r.report_load(w, report(None));
        assert_eq!(r.load(w).active_blocks, 100);
        // A request the router no longer tracks ignores its number.
        r.accepted(4, 44);
        assert_eq!(r.tracked(), 0);
    }

    #[test]
    fn other_modes() {
        let ix = PrefixIndex::new();
        let mut cfg = RouterConfig { mode: RoutingMode::RoundRobin, ..RouterConfig::default() };
        let mut r = Router::new(cfg.clone());
        for w in [10, 20, 30].map(WorkerId) {
            r.add_worker(w);
        }
        let picks: Vec<_> =
            (0..6).map(|i| r.route(&ix, i, &hs(2), 32, 0.0, 0.0).unwrap().worker).collect();
        assert_eq!(picks, [10, 20, 30, 10, 20, 30].map(WorkerId));
        cfg.mode = RoutingMode::Random;
        let mut r = Router::new(cfg.clone());
        for w in [10, 20, 30].map(WorkerId) {
            r.add_worker(w);
        }
        assert_eq!(r.route(&ix, 1, &hs(2), 32, 0.0, 0.0).unwrap().worker, WorkerId(10));
        assert_eq!(r.route(&ix, 2, &hs(2), 32, 0.0, 0.99).unwrap().worker, WorkerId(30));
        cfg.mode = RoutingMode::LeastLoaded;
        let mut r = Router::new(cfg);
        for w in [10, 20].map(WorkerId) {
            r.add_worker(w);
        }
        r.report_load(WorkerId(10), Load { active_blocks: 5, ..Load::default() });
        assert_eq!(r.route(&ix, 1, &hs(2), 32, 0.0, 0.0).unwrap().worker, WorkerId(20));
        assert!(Router::new(RouterConfig::default()).route(&ix, 1, &hs(1), 16, 0.0, 0.0).is_none());
        assert!("warp".parse::<RoutingMode>().is_err());
    }

    #[test]
    fn softmax_temperature() {
        let costs = [(WorkerId(1), 0.0), (WorkerId(2), 1.0), (WorkerId(3), 50.0)];
        assert_eq!(select(&costs, 0.0, 0.99), Some(WorkerId(1)));
        assert_eq!(
            select(&[(WorkerId(5), 1.0), (WorkerId(4), 1.0)], 0.0, 0.0),
            Some(WorkerId(4)),
            "deterministic tie-break"
        );
        // At temperature 1: weights 1, e^-1, ~0 → draw 0.8 of 1.37 lands on worker 2.
        assert_eq!(select(&costs, 1.0, 0.1), Some(WorkerId(1)));
        assert_eq!(select(&costs, 1.0, 0.8), Some(WorkerId(2)));
        let mut counts = HashMap::new();
        for i in 0..1000 {
            *counts.entry(select(&costs, 1.0, i as f64 / 1000.0)).or_insert(0) += 1;
        }
        assert!((700..760).contains(&counts[&Some(WorkerId(1))]), "{counts:?}");
        assert!(!counts.contains_key(&Some(WorkerId(3))));
    }

    #[test]
    fn tracked_requests_stop_counting_after_their_ttl_without_any_report() {
        let ix = PrefixIndex::new();
        let mut r = Router::new(RouterConfig { tracked_ttl_s: 60.0, ..RouterConfig::default() });
        r.add_worker(WorkerId(1));
        for id in 0..100 {
            r.route(&ix, id, &hs(3), 48, 10.0, 0.0).unwrap();
        }
        assert_eq!((r.tracked(), r.load(WorkerId(1)).active_blocks), (100, 300));
        // No release, no load report (the bus is down): still counted within the TTL...
        r.route(&ix, 100, &hs(1), 16, 69.0, 0.0).unwrap();
        assert_eq!(r.tracked(), 101);
        // ... and gone after it; the newer one stays.
        r.expire(70.5);
        assert_eq!((r.tracked(), r.load(WorkerId(1)).active_blocks), (1, 1));
        r.route(&ix, 101, &hs(1), 16, 200.0, 0.0).unwrap();
        assert_eq!(r.tracked(), 1, "expired on the next route too");
    }

    #[test]
    fn approximate_mode_predicts_from_its_own_decisions_until_the_ttl() {
        let ix = PrefixIndex::new(); // no events at all
        let mut r =
            Router::new(RouterConfig { approx_ttl_s: Some(10.0), ..RouterConfig::default() });
        for w in [1, 2].map(WorkerId) {
            r.add_worker(w);
        }
        let first = r.route(&ix, 1, &hs(8), 128, 0.0, 0.0).unwrap();
        r.free(1);
        let again = r.route(&ix, 2, &hs(8), 128, 5.0, 0.0).unwrap();
        assert_eq!(again.worker, first.worker);
        assert_eq!(again.cached.blocks, 8);
        r.free(2);
        r.expire(20.0);
        let later = r.route(&ix, 3, &hs(8), 128, 20.0, 0.0).unwrap();
        assert_eq!(later.cached.blocks, 0, "predictions expire");
    }

    /// A router pricing pulls of SmolLM2-135M f32 blocks (737,280 B per 16 tokens) at a
    /// default `link` (bytes per second), a 2 ms fixed cost, and a compute rate of `rate`
    /// tokens per second; worker 1 holds the whole of `hs(64)` in host memory and is busy
    /// (a deep prefill queue); worker 2 holds nothing and is idle.
    fn pricing(link: f64, rate: f64) -> (PrefixIndex, Router) {
        let all: Vec<u64> = (1..=64).collect();
        let ix = ix_with(&[(WorkerId(1), &all, TierKind::Host)]);
        let mut r = Router::new(RouterConfig {
            pull: Some(PullPricing {
                block_bytes: 737_280,
                link_bytes_per_s: link,
                overhead_s: 2e-3,
                prefill_tokens_per_s: rate,
            }),
            ..RouterConfig::default()
        });
        for w in [1, 2].map(WorkerId) {
            r.add_worker(w);
            r.pool(w);
        }
        r.report_load(
            WorkerId(1),
            Load { active_blocks: 0, queued_prefill_tokens: 100_000, accepted: None },
        );
        (ix, r)
    }

    #[test]
    fn a_fast_link_pulls_long_prefixes_from_a_busy_holder_and_computes_short_ones() {
        // 25 Gbit/s: a block moves in 0.24 ms, and computes in 0.64 ms at 25k tokens/s.
        let (ix, mut r) = pricing(3.125e9, 25_000.0);
        let d = r.route(&ix, 1, &hs(40), 40 * 16 + 1, 0.0, 0.0).unwrap();
        assert_eq!(d.worker, WorkerId(2), "the busy holder is passed over");
        let pull = d.pull.expect("40 blocks: pulling saves more than the fixed cost");
        assert_eq!((pull.from, pull.blocks, pull.pulled), (WorkerId(1), 40, 40));
        assert_eq!(d.path, Path::Pull);
        assert!((pull.seconds - (2e-3 + 40.0 * 737_280.0 / 3.125e9)).abs() < 1e-9);
        // Two blocks save less than the pull's fixed cost: computed.
        let d = r.route(&ix, 2, &hs(2), 2 * 16 + 1, 0.0, 0.0).unwrap();
        assert_eq!((d.worker, d.pull, d.path), (WorkerId(2), None, Path::Compute));
        assert_eq!(r.paths(), [1, 0, 0, 1]);
    }

    #[test]
    fn the_choice_follows_the_link_rate_measured_between_the_two_workers() {
        // 1 Gbit/s: 5.9 ms a block against 0.64 ms to compute it: never pulled...
        let (ix, mut r) = pricing(0.125e9, 25_000.0);
        let d = r.route(&ix, 1, &hs(40), 641, 0.0, 0.0).unwrap();
        assert_eq!((d.worker, d.pull), (WorkerId(2), None));
        r.free(1);
        // ...until worker 2 measures 10 GB/s pulling from worker 1.
        r.report_link(WorkerId(2), WorkerId(1), 10e9);
        let d = r.route(&ix, 2, &hs(40), 641, 0.0, 0.0).unwrap();
        assert_eq!(d.pull.map(|p| p.from), Some(WorkerId(1)));
        r.free(2);
        // A slower engine (2,300 tokens per second: 7 ms a block) pulls over 1 Gbit/s, but
        // only prefixes long enough to repay the pull's fixed cost.
        let (ix, mut r) = pricing(0.125e9, 2_300.0);
        let long = r.route(&ix, 3, &hs(40), 641, 0.0, 0.0).unwrap();
        assert!(long.pull.is_some(), "{long:?}");
        let short = r.route(&ix, 4, &hs(1), 17, 0.0, 0.0).unwrap();
        assert_eq!(short.pull, None, "{short:?}");
        // A worker that reports its own rate is priced at it: 100k tokens per second makes
        // computing the cheaper path again.
        r.report_prefill_rate(WorkerId(2), 100_000.0);
        let d = r.route(&ix, 5, &hs(40), 641, 0.0, 0.0).unwrap();
        assert_eq!(d.pull, None, "{d:?}");
    }

    #[test]
    fn pulls_are_priced_only_between_workers_that_pool_their_stores() {
        let (ix, mut r) = pricing(3.125e9, 25_000.0);
        r.add_worker(WorkerId(3)); // not pooled: an attached engine, or pulls turned off
        r.remove_worker(WorkerId(2));
        let d = r.route(&ix, 1, &hs(40), 641, 0.0, 0.0).unwrap();
        assert_eq!((d.worker, d.pull), (WorkerId(3), None));
        // Without pricing, the busy holder's idle peer computes.
        let mut plain = Router::new(RouterConfig::default());
        for w in [1, 2].map(WorkerId) {
            plain.add_worker(w);
            plain.pool(w);
        }
        plain.report_load(
            WorkerId(1),
            Load { active_blocks: 0, queued_prefill_tokens: 100_000, accepted: None },
        );
        let d = plain.route(&ix, 1, &hs(40), 641, 0.0, 0.0).unwrap();
        assert_eq!((d.worker, d.pull, d.path), (WorkerId(2), None, Path::Compute));
    }
}
