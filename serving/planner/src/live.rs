//! The live planner (`kvfabric frontend --planner`, `kvfabric up --planner`): every interval
//! it reads what the frontend saw ([`LoadWindow`]: request rate, prompt and answer lengths,
//! hit rate, TTFT and ITL), predicts the next interval's load, plans the workers that load
//! needs from the engine's measured profile ([`crate::sla::plan`]), and scales the workers
//! through a [`Scaler`] between a minimum and a maximum.
//!
//! - **Prediction**: the request rate from a [`Predictor`] over the observed rates (the last
//!   one; an exponential average; or a trend, Holt's linear smoothing); prompt and answer
//!   lengths and the hit rate as exponential averages of the intervals that saw requests.
//! - **Correction**: the profile can be wrong for the live mix. When the interval's TTFT at
//!   the target's quantile, or its mean ITL (the model's ITL is steady), is above the target
//!   and the plan would not add a worker,
//!   one worker more than the current number is asked for (the reason says so). The planner
//!   remembers it: while the predicted rate is at least 90% of that load's, it asks for at
//!   least that many workers, until 12 calm intervals (latencies under half their targets)
//!   have passed. Without the memory, a load just past what the profile says one worker
//!   holds makes the planner add a worker, then drain it two intervals later, again and
//!   again. (Dynamo's planner scales its predicted load by the ratio of observed to expected
//!   latency instead; a factor near 1 changes nothing where the plan's step is coarse, which
//!   is where the flapping is.)
//! - **Hysteresis**: scaling up happens at once; scaling down only after the plan asked for
//!   fewer workers `scale_down_after` intervals in a row, to the largest of those asks, each
//!   planned for the predicted rate plus `scale_down_headroom`, so that noise does not drain
//!   and restart workers.
//! - **Draining** is the scaler's: a worker scaled down leaves discovery first (the routers
//!   stop sending to it) and finishes what it has.
//!
//! - **Pools**: the layout scaled is one pool of aggregated workers, or two pools, prefill and
//!   decode workers ([`Pool`]). Each pool has a [`Brain`] of its own, fed the same window: it
//!   takes its pool's number from the plan's disaggregated layout, is corrected by the
//!   latency its pool governs (TTFT the prefill pool, ITL the decode pool; both the
//!   aggregated one), and keeps its own hysteresis and memory.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::sla::{
    plan, plan_class_pools, plan_classes, tightest_itl, ClassLoad, LengthDist, Profile, Targets,
    Workload, DIST_POINTS,
};
use crate::window::{ClassWindow, LoadSource, LoadWindow};

/// A class's TTFT at quantile `q` (None: the mean).
fn class_quantile(c: &ClassWindow, q: Option<f64>) -> Option<f64> {
    if c.ttft_s.is_empty() {
        return None;
    }
    Some(match q {
        None => c.ttft_s.iter().sum::<f64>() / c.ttft_s.len() as f64,
        Some(q) => {
            let mut v = c.ttft_s.clone();
            v.sort_by(f64::total_cmp);
            crate::stats::quantile(&v, q)
        }
    })
}

/// A future of the scaler.
pub type ScaleFuture<'a> = Pin<Box<dyn Future<Output = Result<u32, ScaleError>> + Send + 'a>>;

/// Why a scaling action failed.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// A worker did not start.
    #[error("starting a worker: {0}")]
    Start(String),
    /// A worker could not be told to stop.
    #[error("stopping a worker: {0}")]
    Stop(String),
}

/// Starts and drains workers. Implementations: local `kvfabric worker` processes (the
/// binary's); a Kubernetes one would patch a Deployment's replicas.
pub trait Scaler: Send + Sync + std::fmt::Debug + 'static {
    /// Workers serving now (started and not draining).
    fn workers(&self) -> u32;
    /// Workers draining now.
    fn draining(&self) -> u32;
    /// Starts or drains workers until `n` serve, replacing any that died on their own;
    /// returns how many serve after it. The planner calls it every interval.
    fn scale_to(&self, n: u32) -> ScaleFuture<'_>;
}

/// The workers a [`Brain`] plans for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    /// Aggregated workers (prefill and decode in one): the plan's aggregated layout, both
    /// latencies.
    Aggregated,
    /// Prefill workers of a disaggregated layout: the plan's prefill number, TTFT.
    Prefill,
    /// Decode workers of a disaggregated layout: the plan's decode number, ITL.
    Decode,
}

impl Pool {
    /// Its name in logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Pool::Aggregated => "aggregated",
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }

    /// Its number of workers in `plan`.
    fn workers(self, plan: &crate::sla::Plan) -> Option<u32> {
        match (self, &plan.disaggregated) {
            (Pool::Aggregated, _) => plan.aggregated.workers(),
            (Pool::Prefill, crate::sla::Need::Disaggregated { prefill, .. }) => Some(*prefill),
            (Pool::Decode, crate::sla::Need::Disaggregated { decode, .. }) => Some(*decode),
            _ => None,
        }
    }

    /// Whether a missed TTFT (`ttft`) or ITL target (`!ttft`) is this pool's to correct.
    fn governs(self, ttft: bool) -> bool {
        match self {
            Pool::Aggregated => true,
            Pool::Prefill => ttft,
            Pool::Decode => !ttft,
        }
    }
}

/// How the next interval's request rate is predicted from the observed ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Predictor {
    /// The last interval's.
    Constant,
    /// An exponential average with weight `alpha` on the newest.
    Ewma {
        /// Weight of the newest observation (0..1].
        alpha: f64,
    },
    /// Holt's linear smoothing: level and trend, extrapolated one interval.
    Trend {
        /// Weight of the newest observation in the level.
        alpha: f64,
        /// Weight of the newest change in the trend.
        beta: f64,
    },
}

impl Predictor {
    /// Parses `constant`, `ewma`, `ewma:0.5`, `trend`, `trend:0.5:0.3`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        let nums: Result<Vec<f64>, _> = parts.map(str::parse::<f64>).collect();
        let nums = nums.map_err(|_| format!("predictor {s:?}: the weights must be numbers"))?;
        if nums.iter().any(|w| !(*w > 0.0 && *w <= 1.0)) {
            return Err(format!("predictor {s:?}: weights must be in (0, 1]"));
        }
        match (name, nums.as_slice()) {
            ("constant", []) => Ok(Predictor::Constant),
            ("ewma", []) => Ok(Predictor::Ewma { alpha: 0.5 }),
            ("ewma", [a]) => Ok(Predictor::Ewma { alpha: *a }),
            ("trend", []) => Ok(Predictor::Trend { alpha: 0.6, beta: 0.4 }),
            ("trend", [a, b]) => Ok(Predictor::Trend { alpha: *a, beta: *b }),
            _ => {
                Err(format!("unknown predictor {s:?} (constant, ewma[:ALPHA], trend[:ALPHA:BETA])"))
            }
        }
    }

    /// The next value after `history` (oldest first); 0 without history; never negative.
    pub fn predict(&self, history: &[f64]) -> f64 {
        let Some(&last) = history.last() else { return 0.0 };
        let next = match *self {
            Predictor::Constant => last,
            Predictor::Ewma { alpha } => {
                history[1..].iter().fold(history[0], |avg, &x| alpha * x + (1.0 - alpha) * avg)
            }
            Predictor::Trend { alpha, beta } => {
                if history.len() < 2 {
                    last
                } else {
                    let (mut level, mut trend) = (history[0], history[1] - history[0]);
                    for &x in &history[1..] {
                        let prev = level;
                        level = alpha * x + (1.0 - alpha) * (level + trend);
                        trend = beta * (level - prev) + (1.0 - beta) * trend;
                    }
                    level + trend
                }
            }
        };
        next.max(0.0)
    }
}

/// The planner's settings.
#[derive(Debug, Clone)]
pub struct PlannerConfig {
    /// How often it decides.
    pub interval: Duration,
    /// Fewest workers.
    pub min_workers: u32,
    /// Most workers.
    pub workers_max: u32,
    /// The latency targets.
    pub targets: Targets,
    /// The rate predictor.
    pub predictor: Predictor,
    /// The engine's measured curves.
    pub profile: Profile,
    /// Intervals in a row the plan must ask for fewer workers before any drains.
    pub scale_down_after: u32,
    /// A scale-down plans for this much more than the predicted rate (0.25: 25%), so that
    /// the noise of one interval's rate does not drain a worker the next one needs.
    pub scale_down_headroom: f64,
    /// Observed intervals kept for prediction.
    pub history: usize,
}

/// What the planner saw in one interval.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Observed {
    /// Requests finished.
    pub requests: u64,
    /// Of them, failed.
    pub errors: u64,
    /// Requests arriving per second.
    pub rate: f64,
    /// Mean prompt tokens (None: no request finished).
    pub isl: Option<f64>,
    /// Mean answer tokens.
    pub osl: Option<f64>,
    /// Share of prompt tokens found cached.
    pub hit_rate: Option<f64>,
    /// TTFT at the target's quantile (or mean), seconds.
    pub ttft_s: Option<f64>,
    /// ITL at the target's quantile (or mean), seconds.
    pub itl_s: Option<f64>,
    /// Mean ITL, seconds: what the model plans (its ITL is steady; a quantile of observed
    /// gaps also holds the steps that carried another request's prefill).
    pub itl_mean_s: Option<f64>,
}

impl Observed {
    /// Summarises a window at quantile `q` (None: means).
    pub fn of(w: &LoadWindow, q: Option<f64>) -> Self {
        let secs = w.duration.as_secs_f64().max(1e-3);
        let per = |x: u64| (w.counted > 0).then(|| x as f64 / w.counted as f64);
        let stat = |v: &[f64]| -> Option<f64> {
            if v.is_empty() {
                return None;
            }
            match q {
                None => Some(v.iter().sum::<f64>() / v.len() as f64),
                Some(q) => {
                    let mut s = v.to_vec();
                    s.sort_by(f64::total_cmp);
                    Some(crate::stats::quantile(&s, q))
                }
            }
        };
        Observed {
            requests: w.requests,
            errors: w.errors,
            rate: w.arrivals as f64 / secs,
            isl: per(w.prompt_tokens),
            osl: per(w.generated_tokens),
            hit_rate: (w.prompt_tokens > 0)
                .then(|| w.cached_tokens as f64 / w.prompt_tokens as f64),
            ttft_s: stat(&w.ttft_s),
            itl_s: stat(&w.itl_s),
            itl_mean_s: (!w.itl_s.is_empty())
                .then(|| w.itl_s.iter().sum::<f64>() / w.itl_s.len() as f64),
        }
    }
}

/// Which way a decision went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// More workers.
    Up,
    /// Fewer.
    Down,
    /// As many.
    Hold,
}

/// One interval's decision, with its reasons (logged, kept for `/metrics`, and written as a
/// JSON line to the planner's log when one is given).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Decision {
    /// The pool decided for.
    pub pool: Pool,
    /// Interval number, from 1.
    pub interval: u64,
    /// When, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// What the interval showed.
    pub observed: Observed,
    /// The load planned for.
    pub predicted: Workload,
    /// Workers of this pool the plan asks for (None: no number meets the targets).
    pub planned: Option<u32>,
    /// Workers a missed target taught this load needs (None: nothing learned, or forgotten).
    pub learned_workers: Option<u32>,
    /// Workers asked for after the correction, the bounds and the hysteresis.
    pub desired: u32,
    /// Workers serving before the action.
    pub before: u32,
    /// Workers serving after it.
    pub after: u32,
    /// Workers draining after it.
    pub draining: u32,
    /// The action.
    pub action: Action,
    /// Why, one line each.
    pub reasons: Vec<String>,
}

/// The planner's pure part: from observations to the number of workers to run.
#[derive(Debug)]
pub struct Brain {
    cfg: PlannerConfig,
    pool: Pool,
    rates: Vec<f64>,
    isl: Option<f64>,
    /// How prompt lengths spread (an empirical shape of mean 1), averaged like the lengths.
    isl_shape: Option<[f64; DIST_POINTS]>,
    osl: Option<f64>,
    hit: Option<f64>,
    fewer_asks: Vec<u32>,
    interval: u64,
    learned: Option<Learned>,
    /// Per service class (when the frontend has classes): its rates and averages.
    classes: std::collections::BTreeMap<String, ClassState>,
}

/// What a [`Brain`] keeps of one service class.
#[derive(Debug, Clone, Default)]
struct ClassState {
    rates: Vec<f64>,
    isl: Option<f64>,
    osl: Option<f64>,
    hit: Option<f64>,
    ttft_target_s: Option<f64>,
    itl_target_s: Option<f64>,
}

/// Classes a [`Brain`] follows at most (a frontend has at most 16).
const CLASSES_FOLLOWED_MAX: usize = 32;

/// What a missed target taught: at this rate, this many workers were needed.
#[derive(Debug, Clone, Copy)]
struct Learned {
    rate: f64,
    workers: u32,
    /// Calm intervals left before it is forgotten.
    calm_left: u32,
}

/// Weight of the newest interval in the averages of lengths and hit rate.
const MIX_ALPHA: f64 = 0.5;
/// An interval whose latencies were all under this share of their targets is calm.
const CALM: f64 = 0.5;
/// Calm intervals after which what a missed target taught is forgotten.
const LEARNED_CALM: u32 = 12;
/// A missed target in an interval whose rate fell under this share of the one before is the
/// backlog of that busier interval: it is acted on but not learned.
const BACKLOG_DROP: f64 = 0.5;

impl Brain {
    /// A planner of aggregated workers that has seen nothing.
    pub fn new(cfg: PlannerConfig) -> Self {
        Self::for_pool(cfg, Pool::Aggregated)
    }

    /// A planner of `pool` that has seen nothing.
    pub fn for_pool(cfg: PlannerConfig, pool: Pool) -> Self {
        Brain {
            cfg,
            pool,
            rates: Vec::new(),
            isl: None,
            isl_shape: None,
            osl: None,
            hit: None,
            fewer_asks: Vec::new(),
            interval: 0,
            learned: None,
            classes: Default::default(),
        }
    }

    /// Follows each class of `window` and predicts its load: one [`ClassLoad`] per class
    /// with a TTFT target that has seen requests (empty when the window has no classes).
    fn class_loads(&mut self, window: &LoadWindow) -> Vec<ClassLoad> {
        if window.classes.is_empty() {
            return Vec::new();
        }
        let secs = window.duration.as_secs_f64().max(1e-3);
        let keep = self.cfg.history.max(2);
        let mix = |avg: Option<f64>, x: Option<f64>| match (avg, x) {
            (Some(a), Some(x)) => Some(MIX_ALPHA * x + (1.0 - MIX_ALPHA) * a),
            (a, x) => x.or(a),
        };
        for c in &window.classes {
            if !self.classes.contains_key(&c.name) && self.classes.len() >= CLASSES_FOLLOWED_MAX {
                continue;
            }
            let st = self.classes.entry(c.name.clone()).or_default();
            st.rates.push(c.arrivals as f64 / secs);
            if st.rates.len() > keep {
                st.rates.remove(0);
            }
            let per = |x: u64| (c.counted > 0).then(|| x as f64 / c.counted as f64);
            st.isl = mix(st.isl, per(c.prompt_tokens));
            st.osl = mix(st.osl, per(c.generated_tokens));
            st.hit = mix(
                st.hit,
                (c.prompt_tokens > 0).then(|| c.cached_tokens as f64 / c.prompt_tokens as f64),
            );
            st.ttft_target_s = c.ttft_target_s;
            st.itl_target_s = c.itl_target_s;
        }
        let q = self.cfg.targets.quantile;
        self.classes
            .iter()
            .filter_map(|(name, st)| {
                let ttft = st.ttft_target_s?;
                let rate = self.cfg.predictor.predict(&st.rates);
                (rate > 0.0 && st.isl.is_some()).then(|| ClassLoad {
                    name: name.clone(),
                    load: Workload {
                        rate,
                        isl: st.isl.unwrap_or(1.0).max(1.0),
                        osl: st.osl.unwrap_or(1.0).max(1.0),
                        hit_rate: st.hit.unwrap_or(0.0).clamp(0.0, 0.99),
                        isl_dist: LengthDist::Fixed,
                    },
                    targets: Targets {
                        ttft_s: ttft,
                        itl_s: st.itl_target_s.unwrap_or(f64::INFINITY),
                        quantile: q,
                    },
                })
            })
            .collect()
    }

    /// Decides from one interval's window with `current` workers serving.
    pub fn decide(&mut self, window: &LoadWindow, current: u32) -> Decision {
        self.interval += 1;
        let q = self.cfg.targets.quantile;
        let seen = Observed::of(window, q);
        let rate_before = self.rates.last().copied();
        self.rates.push(seen.rate);
        let keep = self.cfg.history.max(2);
        if self.rates.len() > keep {
            self.rates.remove(0);
        }
        let mix = |avg: Option<f64>, x: Option<f64>| match (avg, x) {
            (Some(a), Some(x)) => Some(MIX_ALPHA * x + (1.0 - MIX_ALPHA) * a),
            (a, x) => x.or(a),
        };
        self.isl = mix(self.isl, seen.isl);
        if let Some(LengthDist::Empirical { shape }) = LengthDist::empirical(&window.prompt_lens) {
            let old = self.isl_shape.unwrap_or(shape);
            let mut avg = [0.0; DIST_POINTS];
            for (a, (n, o)) in avg.iter_mut().zip(shape.iter().zip(&old)) {
                *a = MIX_ALPHA * n + (1.0 - MIX_ALPHA) * o;
            }
            self.isl_shape = Some(avg);
        }
        self.osl = mix(self.osl, seen.osl);
        self.hit = mix(self.hit, seen.hit_rate);
        let predicted = Workload {
            rate: self.cfg.predictor.predict(&self.rates),
            isl: self.isl.unwrap_or(1.0).max(1.0),
            osl: self.osl.unwrap_or(1.0).max(1.0),
            hit_rate: self.hit.unwrap_or(0.0).clamp(0.0, 0.99),
            // Until a window has seen enough prompts: as if every prompt had the mean length.
            isl_dist: self
                .isl_shape
                .map_or(LengthDist::Fixed, |shape| LengthDist::Empirical { shape }),
        };
        let mut reasons = vec![format!(
            "{}: observed {:.2} req/s ({} requests, {} failed); predicted {:.2} req/s of {:.0} prompt + {:.0} answer tokens, {:.0}% cached",
            self.pool.name(),
            seen.rate,
            seen.requests,
            seen.errors,
            predicted.rate,
            predicted.isl,
            predicted.osl,
            predicted.hit_rate * 100.0
        )];
        if let Some(shape) = self.isl_shape {
            // Quantile midpoints 3 and 28 of 32: p11 and p89.
            reasons.push(format!(
                "prompts spread over {:.0}–{:.0} tokens (p11–p89 of those seen)",
                shape[3] * predicted.isl,
                shape[28] * predicted.isl
            ));
        }
        let (lo, hi) =
            (self.cfg.min_workers.max(1), self.cfg.workers_max.max(self.cfg.min_workers.max(1)));
        // With classes, each class's load and targets: the workers at which every class
        // meets its own when served by urgency.
        let class_loads = self.class_loads(window);
        let plan_for = |scale: f64| -> (Option<u32>, Vec<String>) {
            if class_loads.is_empty() {
                let load = Workload { rate: predicted.rate * scale, ..predicted };
                let p = plan(&self.cfg.profile, &load, &self.cfg.targets);
                (self.pool.workers(&p), p.reasons.into_iter().skip(1).collect())
            } else {
                let scaled: Vec<ClassLoad> = class_loads
                    .iter()
                    .map(|c| ClassLoad {
                        load: Workload { rate: c.load.rate * scale, ..c.load },
                        ..c.clone()
                    })
                    .collect();
                match self.pool {
                    Pool::Aggregated => {
                        let p = plan_classes(&self.cfg.profile, &scaled);
                        (p.with_classes.map(|(n, _)| n), p.reasons)
                    }
                    Pool::Prefill | Pool::Decode => {
                        let p =
                            plan_class_pools(&self.cfg.profile, &scaled, self.cfg.targets.itl_s);
                        let n = match self.pool {
                            Pool::Prefill => p.prefill.map(|(n, _)| n),
                            _ => p.decode,
                        };
                        (n, p.reasons)
                    }
                }
            }
        };
        let planned = if predicted.rate <= 0.0 {
            reasons.push("no load predicted".into());
            Some(lo)
        } else {
            let (n, why) = plan_for(1.0);
            reasons.extend(why);
            n
        };
        let mut desired = match planned {
            Some(n) => n,
            None => {
                reasons.push(format!(
                    "no number of workers meets the targets: asking for the most ({hi})"
                ));
                hi
            }
        };
        // Correction from what was measured.
        let label = q.map_or("mean".to_string(), |q| format!("p{}", q * 100.0));
        let t = &self.cfg.targets;
        let ttft_label = format!("{label} TTFT");
        let pool = self.pool;
        // With classes, a decode batch holds every class: the tightest ITL target among them
        // (as `plan_class_pools` plans it), the one set of targets' when none has one.
        let itl_target = tightest_itl(&class_loads, t.itl_s);
        let mut governed = [
            (true, ttft_label.clone(), seen.ttft_s, t.ttft_s),
            (false, "mean ITL".to_string(), seen.itl_mean_s, itl_target),
        ]
        .into_iter()
        .filter(|(ttft, ..)| pool.governs(*ttft))
        .map(|(_, what, got, target)| (what, got, target))
        .collect::<Vec<_>>();
        if !class_loads.is_empty() && pool.governs(true) {
            // Each class against its own TTFT target instead of the one set of targets.
            governed.retain(|(what, ..)| *what != ttft_label);
            for c in window.classes.iter().filter(|c| !c.ttft_s.is_empty()) {
                if let Some(target) = c.ttft_target_s {
                    let got = class_quantile(c, q);
                    governed.push((format!("{} {ttft_label}", c.name), got, target));
                }
            }
        }
        let over = governed
            .iter()
            .filter_map(|(what, got, target)| {
                got.filter(|g| g > target).map(|g| (what.as_str(), g, *target))
            })
            .collect::<Vec<_>>();
        let calm = seen.requests >= 3
            && governed.iter().all(|(_, got, target)| got.is_none_or(|g| g <= target * CALM));
        if let Some(l) = self.learned.as_mut().filter(|_| calm) {
            l.calm_left = l.calm_left.saturating_sub(1);
            if l.calm_left == 0 {
                reasons.push(format!(
                    "calm for {LEARNED_CALM} intervals: forgetting that {:.1} req/s needed {} workers",
                    l.rate, l.workers
                ));
                self.learned = None;
            }
        }
        if let Some(l) =
            self.learned.filter(|l| predicted.rate >= l.rate * 0.9 && desired < l.workers)
        {
            reasons.push(format!(
                "{:.1} req/s missed the targets with fewer than {} workers before: {} (the profile is optimistic under this load)",
                l.rate, l.workers, l.workers
            ));
            desired = l.workers;
        }
        if !over.is_empty() && seen.requests >= 3 && desired <= current {
            desired = current + 1;
            for (what, got, target) in over {
                reasons.push(format!(
                    "observed {what} {:.1} ms is above the target {:.1} ms: one worker more than now",
                    got * 1e3,
                    target * 1e3
                ));
            }
            if rate_before.is_some_and(|r| seen.rate < r * BACKLOG_DROP) {
                // The load fell: these latencies are the queue the busier interval left,
                // not what this rate needs. Learning them would hold (or bring back) workers
                // at this rate long after the queue is gone.
                reasons.push(format!(
                    "the rate fell from {:.1} req/s: the backlog of the busier interval, not \
                     learned",
                    rate_before.unwrap_or_default()
                ));
            } else {
                // The profile was optimistic here: remember it, so that the worker added is
                // not drained as soon as latencies recover under the same load.
                self.learned =
                    Some(Learned { rate: seen.rate, workers: desired, calm_left: LEARNED_CALM });
            }
        }
        let bounded = desired.clamp(lo, hi);
        if bounded != desired {
            reasons.push(format!("{desired} workers bounded to {lo}..={hi}"));
        }
        desired = bounded;
        // Hysteresis on the way down: plan again with headroom, then wait for the asks.
        if desired < current && predicted.rate > 0.0 && self.cfg.scale_down_headroom > 0.0 {
            let with = plan_for(1.0 + self.cfg.scale_down_headroom).0.unwrap_or(hi);
            if with > desired {
                reasons.push(format!(
                    "with {:.0}% headroom on the rate: {with} workers",
                    self.cfg.scale_down_headroom * 100.0
                ));
                desired = with.clamp(lo, hi).min(current);
            }
        }
        if desired < current {
            self.fewer_asks.push(desired);
            let after = self.cfg.scale_down_after.max(1) as usize;
            if self.fewer_asks.len() < after {
                reasons.push(format!(
                    "fewer workers asked for {} of {after} intervals in a row: holding {current}",
                    self.fewer_asks.len()
                ));
                desired = current;
            } else {
                let most = self.fewer_asks.iter().copied().max().unwrap_or(desired);
                reasons.push(format!(
                    "fewer workers asked for {after} intervals in a row: down to {most}"
                ));
                desired = most;
                self.fewer_asks.clear();
            }
        } else {
            self.fewer_asks.clear();
        }
        let action = match desired.cmp(&current) {
            std::cmp::Ordering::Greater => Action::Up,
            std::cmp::Ordering::Less => Action::Down,
            std::cmp::Ordering::Equal => Action::Hold,
        };
        Decision {
            pool: self.pool,
            interval: self.interval,
            at_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            observed: seen,
            predicted,
            planned,
            learned_workers: self.learned.map(|l| l.workers),
            desired,
            before: current,
            after: current,
            draining: 0,
            action,
            reasons,
        }
    }
}

/// The planner's state and decisions.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PlannerSnapshot {
    /// Workers serving (not counting draining ones), every pool.
    pub workers: u64,
    /// Workers the last decision asked for.
    pub desired: u64,
    /// Workers draining.
    pub draining: u64,
    /// Request rate observed over the last interval, requests/s.
    pub observed_rate: f64,
    /// Request rate predicted for the next interval, requests/s.
    pub predicted_rate: f64,
    /// TTFT at the target's quantile over the last interval, seconds.
    pub observed_ttft_s: f64,
    /// ITL at the target's quantile over the last interval, seconds.
    pub observed_itl_s: f64,
    /// Decisions by action: scale up, scale down, hold.
    pub decisions: [u64; 3],
    /// Scaling actions that failed.
    pub scale_failures: u64,
    /// Per pool (`aggregated`; or `prefill` and `decode`).
    pub pools: Vec<PoolSnapshot>,
}

/// One pool of the planner's workers.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PoolSnapshot {
    /// `aggregated`, `prefill` or `decode`.
    pub pool: &'static str,
    /// Workers serving.
    pub workers: u64,
    /// Workers the last decision asked for.
    pub desired: u64,
    /// Workers draining.
    pub draining: u64,
}

/// The planner's state for `/metrics`.
#[derive(Debug, Default)]
pub struct PlannerState {
    snapshot: Mutex<PlannerSnapshot>,
}

impl PlannerState {
    /// Its part of `/health`: workers serving against those wanted (short of them is
    /// degraded), draining, scale operations that failed.
    pub fn health(&self) -> kvfabric::health::PlannerHealth {
        let s = self.snapshot.lock();
        kvfabric::health::PlannerHealth {
            workers: s.workers,
            desired: s.desired,
            draining: s.draining,
            scale_failures: s.scale_failures,
        }
    }

    /// The state before the first decision: `workers` serving in each pool.
    pub fn starting(pools: &[(Pool, u32)]) -> Self {
        let pools: Vec<PoolSnapshot> = pools
            .iter()
            .map(|&(p, n)| PoolSnapshot {
                pool: p.name(),
                workers: u64::from(n),
                desired: u64::from(n),
                draining: 0,
            })
            .collect();
        let snapshot = PlannerSnapshot {
            workers: pools.iter().map(|p| p.workers).sum(),
            desired: pools.iter().map(|p| p.desired).sum(),
            pools,
            ..PlannerSnapshot::default()
        };
        PlannerState { snapshot: Mutex::new(snapshot) }
    }
}

impl PlannerState {
    /// Its state now (for `/metrics`, `/health` and dashboards).
    pub fn snapshot(&self) -> PlannerSnapshot {
        self.snapshot.lock().clone()
    }
}

/// Runs the planner until the task is aborted: every interval, a window of `load`, a
/// decision per pool, the scaling (the pools concurrently), `on_decision` for each (logging,
/// a JSON-lines file).
pub fn spawn(
    cfg: PlannerConfig,
    load: impl LoadSource,
    pools: Vec<(Pool, Arc<dyn Scaler>)>,
    state: Arc<PlannerState>,
    mut on_decision: impl FnMut(&Decision) + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    let interval = cfg.interval.max(Duration::from_millis(100));
    let mut pools: Vec<(Brain, Arc<dyn Scaler>)> =
        pools.into_iter().map(|(p, s)| (Brain::for_pool(cfg.clone(), p), s)).collect();
    tokio::spawn(async move {
        // Start the window now: what came before the planner is not this interval's.
        let _ = load.take_window();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let window = load.take_window();
            let decided: Vec<Decision> = pools
                .iter_mut()
                .map(|(brain, scaler)| brain.decide(&window, scaler.workers()))
                .collect();
            // Every interval, also when holding: a worker that died on its own is replaced.
            let scaled = futures_util::future::join_all(
                pools.iter().zip(&decided).map(|((_, s), d)| s.scale_to(d.desired)),
            )
            .await;
            let mut snap = state.snapshot.lock().clone();
            snap.pools.clear();
            for (((_, scaler), mut d), r) in pools.iter().zip(decided).zip(scaled) {
                let failed = match r {
                    Ok(n) => {
                        d.after = n;
                        false
                    }
                    Err(e) => {
                        d.after = scaler.workers();
                        d.reasons.push(format!("scaling failed: {e}"));
                        tracing::warn!(pool = d.pool.name(), error = %e, desired = d.desired, "planner: scaling failed");
                        true
                    }
                };
                d.draining = scaler.draining();
                snap.pools.push(PoolSnapshot {
                    pool: d.pool.name(),
                    workers: u64::from(d.after),
                    desired: u64::from(d.desired),
                    draining: u64::from(d.draining),
                });
                snap.observed_rate = d.observed.rate;
                snap.predicted_rate = d.predicted.rate;
                snap.observed_ttft_s = d.observed.ttft_s.unwrap_or(0.0);
                snap.observed_itl_s = d.observed.itl_s.unwrap_or(0.0);
                snap.decisions[match d.action {
                    Action::Up => 0,
                    Action::Down => 1,
                    Action::Hold => 2,
                }] += 1;
                snap.scale_failures += u64::from(failed);
                if d.action == Action::Hold {
                    tracing::debug!(pool = d.pool.name(), workers = d.after, reasons = ?d.reasons, "planner: hold");
                } else {
                    tracing::info!(
                        pool = d.pool.name(), action = ?d.action, before = d.before, after = d.after,
                        desired = d.desired, reasons = ?d.reasons, "planner: scaling"
                    );
                }
                on_decision(&d);
            }
            snap.workers = snap.pools.iter().map(|p| p.workers).sum();
            snap.desired = snap.pools.iter().map(|p| p.desired).sum();
            snap.draining = snap.pools.iter().map(|p| p.draining).sum();
            *state.snapshot.lock() = snap;
        }
    })
}

#[cfg(test)]
mod tests;
