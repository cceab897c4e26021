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
mod tests {
    use super::*;
    use crate::sla::Curve;

    fn mock_profile() -> Profile {
        let itl = |ctx: f64| {
            Curve::new(
                (1..=8).map(|b| (f64::from(b), 8e-3 + 0.2e-6 * ctx * f64::from(b))).collect(),
            )
            .unwrap()
        };
        Profile {
            prefill_s: Curve::new(vec![(0.0, 0.0), (4096.0, 4096.0 * 40e-6)]).unwrap(),
            itl_s: vec![(512.0, itl(512.0)), (2048.0, itl(2048.0))],
            batch_max: 8,
            kv_bytes_per_token: 8192,
            restore_s_per_token: 0.0,
        }
    }

    fn cfg() -> PlannerConfig {
        PlannerConfig {
            interval: Duration::from_secs(10),
            min_workers: 1,
            workers_max: 8,
            targets: Targets::at_quantile(0.3, 0.05, 0.99),
            predictor: Predictor::Constant,
            profile: mock_profile(),
            scale_down_after: 2,
            scale_down_headroom: 0.0,
            history: 8,
        }
    }

    fn window(rate: f64, ttft: f64) -> LoadWindow {
        let n = (rate * 10.0) as u64;
        LoadWindow {
            duration: Duration::from_secs(10),
            arrivals: n,
            requests: n,
            counted: n,
            errors: 0,
            prompt_tokens: n * 512,
            generated_tokens: n * 64,
            cached_tokens: 0,
            ttft_s: vec![ttft; n as usize],
            itl_s: vec![0.009; n as usize * 63],
            prompt_lens: vec![512.0; n as usize],
            classes: Vec::new(),
        }
    }

    /// One class's part of a window: `rate` req/s of `isl`-token prompts (`hit` cached) and
    /// 16-token answers, at TTFT `ttft`.
    fn class_window(
        name: &str,
        target: f64,
        rate: f64,
        isl: u64,
        hit: f64,
        ttft: f64,
    ) -> ClassWindow {
        let n = (rate * 10.0) as u64;
        ClassWindow {
            name: name.into(),
            ttft_target_s: Some(target),
            itl_target_s: None,
            arrivals: n,
            counted: n,
            prompt_tokens: n * isl,
            generated_tokens: n * 16,
            cached_tokens: (n as f64 * isl as f64 * hit) as u64,
            ttft_s: vec![ttft; n as usize],
        }
    }

    /// With classes in the window, an aggregated pool is planned so that each class meets
    /// its own target served by urgency: the workers `plan_classes` names for the predicted
    /// mix (not the one set of targets); a class over its own target adds a worker and says
    /// which.
    #[test]
    fn classes_plan_each_class_to_its_own_target() {
        let interactive = class_window("interactive", 0.3, 2.0, 440, 0.9, 0.05);
        let batch = class_window("batch", 30.0, 8.0, 4096, 0.0, 2.0);
        let mut w = window(10.0, 0.5);
        w.classes = vec![interactive.clone(), batch.clone()];
        let mut tight = cfg();
        tight.targets = Targets::at_quantile(0.3, 0.05, 0.99);
        tight.workers_max = 64;
        let d = Brain::new(tight.clone()).decide(&w, 1);
        let loads = [
            ClassLoad {
                name: "batch".into(),
                load: Workload {
                    rate: 8.0,
                    isl: 4096.0,
                    osl: 16.0,
                    hit_rate: 0.0,
                    isl_dist: LengthDist::Fixed,
                },
                targets: Targets::at_quantile(30.0, f64::INFINITY, 0.99),
            },
            ClassLoad {
                name: "interactive".into(),
                load: Workload {
                    rate: 2.0,
                    isl: 440.0,
                    osl: 16.0,
                    hit_rate: 0.9,
                    isl_dist: LengthDist::Fixed,
                },
                targets: Targets::at_quantile(0.3, f64::INFINITY, 0.99),
            },
        ];
        let want = plan_classes(&tight.profile, &loads).with_classes.unwrap().0;
        assert_eq!(d.planned, Some(want), "{:#?}", d.reasons);
        assert!(d.reasons.iter().any(|r| r.starts_with("with classes")), "{:#?}", d.reasons);
        // The interactive class over its own target: one worker more, and the reason names it.
        let mut late = w.clone();
        late.classes[0].ttft_s = vec![0.5; 20];
        let d = Brain::new(tight).decide(&late, want);
        assert_eq!(d.desired, want + 1, "{:#?}", d.reasons);
        assert!(d.reasons.iter().any(|r| r.contains("interactive p99 TTFT")), "{:#?}", d.reasons);
    }

    /// With classes, the pools of a disaggregated layout plan for each class too: the
    /// prefill pool to `plan_class_pools`' prefill workers (each class's TTFT by urgency),
    /// the decode pool to its decode workers at the tightest class ITL; a class over its own
    /// TTFT adds a prefill worker, never a decode one.
    #[test]
    fn classes_plan_the_prefill_and_decode_pools_each_to_its_part() {
        let mut interactive = class_window("interactive", 0.3, 2.0, 440, 0.9, 0.05);
        interactive.itl_target_s = Some(0.03);
        let batch = class_window("batch", 30.0, 8.0, 4096, 0.0, 2.0);
        let mut w = window(10.0, 0.5);
        w.classes = vec![interactive, batch];
        let mut c = cfg();
        c.targets = Targets::at_quantile(0.3, 0.05, 0.99);
        c.workers_max = 64;
        let loads: Vec<ClassLoad> = {
            let mut b = Brain::for_pool(c.clone(), Pool::Prefill);
            b.class_loads(&w)
        };
        assert_eq!(loads.len(), 2);
        let want = plan_class_pools(&c.profile, &loads, c.targets.itl_s);
        let dp = Brain::for_pool(c.clone(), Pool::Prefill).decide(&w, 1);
        let dd = Brain::for_pool(c.clone(), Pool::Decode).decide(&w, 1);
        assert_eq!(dp.planned, want.prefill.as_ref().map(|p| p.0), "{:#?}", dp.reasons);
        assert_eq!(dd.planned, want.decode, "{:#?}", dd.reasons);
        assert!(
            dp.reasons.iter().any(|r| r.starts_with("prefill workers by urgency")),
            "{:#?}",
            dp.reasons
        );
        assert!(dd.reasons.iter().any(|r| r.contains("ITL 30.0 ms")), "{:#?}", dd.reasons);
        // The interactive prompts late: the prefill pool grows, the decode pool does not.
        let mut late = w.clone();
        late.classes[0].ttft_s = vec![0.5; 20];
        let n = want.prefill.map_or(1, |p| p.0);
        let dp = Brain::for_pool(c.clone(), Pool::Prefill).decide(&late, n);
        assert_eq!(dp.desired, n + 1, "{:#?}", dp.reasons);
        assert!(dp.reasons.iter().any(|r| r.contains("interactive p99 TTFT")), "{:#?}", dp.reasons);
        let m = want.decode.unwrap_or(1);
        let dd = Brain::for_pool(c, Pool::Decode).decide(&late, m);
        assert!(dd.desired <= m, "{:#?}", dd.reasons);
    }

    #[test]
    fn predictors() {
        let h = [10.0, 20.0, 30.0, 40.0];
        assert_eq!(Predictor::Constant.predict(&h), 40.0);
        assert_eq!(Predictor::Ewma { alpha: 1.0 }.predict(&h), 40.0);
        assert_eq!(Predictor::Ewma { alpha: 0.5 }.predict(&[0.0, 8.0]), 4.0);
        // A straight line is extrapolated exactly.
        let t = Predictor::Trend { alpha: 0.6, beta: 0.4 }.predict(&h);
        assert!((t - 50.0).abs() < 1e-9, "{t}");
        assert_eq!(Predictor::Trend { alpha: 0.5, beta: 0.5 }.predict(&[10.0, 0.0, 0.0]), 0.0);
        assert_eq!(Predictor::Constant.predict(&[]), 0.0);
        assert_eq!(Predictor::parse("ewma:0.3"), Ok(Predictor::Ewma { alpha: 0.3 }));
        assert!(Predictor::parse("trend:2:0.1").is_err());
        assert!(Predictor::parse("prophet").is_err());
    }

    #[test]
    fn scales_up_at_once_and_down_after_two_intervals_within_bounds() {
        let mut b = Brain::new(cfg());
        let idle =
            b.decide(&LoadWindow { duration: Duration::from_secs(10), ..Default::default() }, 1);
        assert_eq!((idle.action, idle.desired), (Action::Hold, 1), "{:?}", idle.reasons);
        // 40 req/s of 512+64 tokens: prefill 20 ms each, 0.8 busy in prefill; decode batches
        // of ~8 at ~9 ms: 4 workers or so.
        let busy = b.decide(&window(40.0, 0.05), 1);
        assert_eq!(busy.action, Action::Up, "{:?}", busy.reasons);
        let n = busy.desired;
        assert!((2..=8).contains(&n), "{n}: {:?}", busy.reasons);
        assert_eq!(busy.planned, Some(n));
        // The load halves: the first ask for fewer is held, the second acted on.
        let first = b.decide(&window(10.0, 0.05), n);
        assert_eq!((first.action, first.desired), (Action::Hold, n), "{:?}", first.reasons);
        let second = b.decide(&window(10.0, 0.05), n);
        assert_eq!(second.action, Action::Down, "{:?}", second.reasons);
        assert!(second.desired < n);
        // Far more than the bound allows.
        let huge = b.decide(&window(2000.0, 0.05), second.desired);
        assert_eq!(huge.desired, 8, "{:?}", huge.reasons);
        assert!(huge.reasons.iter().any(|r| r.contains("bounded")), "{:?}", huge.reasons);
    }

    #[test]
    fn a_missed_target_adds_a_worker_the_model_did_not_ask_for() {
        let mut b = Brain::new(cfg());
        // A light load the plan serves with one worker, but TTFT p99 is 900 ms.
        let d = b.decide(&window(2.0, 0.9), 1);
        assert_eq!(d.planned, Some(1));
        assert_eq!((d.action, d.desired), (Action::Up, 2), "{:?}", d.reasons);
        assert!(d.reasons.iter().any(|r| r.contains("above the target")), "{:?}", d.reasons);
    }

    /// Once a load missed the target with the workers the plan asked for, the planner does
    /// not drain the worker it added as soon as latencies recover at the same load.
    #[test]
    fn a_missed_target_is_learned_and_does_not_flap() {
        let mut b = Brain::new(cfg());
        let d = b.decide(&window(2.0, 0.9), 1);
        assert_eq!(d.desired, 2);
        for _ in 0..4 {
            let d = b.decide(&window(2.0, 0.2), 2);
            assert_eq!(d.desired, 2, "{:?}", d.reasons);
            assert_eq!(d.learned_workers, Some(2));
        }
        // A lower load is not held to it.
        let lower = b.decide(&window(1.0, 0.2), 2);
        assert_eq!(lower.learned_workers, Some(2));
        assert!(!lower.reasons.iter().any(|r| r.contains("optimistic")), "{:?}", lower.reasons);
        // Calm intervals (under half the target) make it forget.
        let mut b = Brain::new(cfg());
        b.decide(&window(2.0, 0.9), 1);
        let mut n = 2;
        let mut forgot_at = None;
        for i in 0..20 {
            let d = b.decide(&window(2.0, 0.05), n);
            n = d.desired;
            if d.learned_workers.is_none() && forgot_at.is_none() {
                forgot_at = Some(i + 1);
            }
        }
        assert_eq!(forgot_at, Some(LEARNED_CALM as usize));
        assert_eq!(n, 1, "back to what the profile says");
    }

    /// Latencies over the target right after the load fell are the queue the busier interval
    /// left: the planner adds a worker for it but does not learn that the lower rate needs
    /// that many, so it drains them when the queue is gone (the live test once flapped: a
    /// light load brought back the workers it had just drained).
    #[test]
    fn a_backlog_after_the_load_fell_is_not_learned() {
        let mut b = Brain::new(cfg());
        let busy = b.decide(&window(40.0, 0.05), 1);
        let n = busy.desired;
        assert!(n >= 2, "{:?}", busy.reasons);
        let backlog = b.decide(&window(4.0, 0.9), n);
        assert_eq!(backlog.desired, n + 1, "{:?}", backlog.reasons);
        assert_eq!(backlog.learned_workers, None, "{:?}", backlog.reasons);
        assert!(backlog.reasons.iter().any(|r| r.contains("backlog")), "{:?}", backlog.reasons);
        // The queue is gone at the same light load: down after two asks, and it stays down.
        let mut now = n + 1;
        for _ in 0..4 {
            now = b.decide(&window(4.0, 0.1), now).desired;
        }
        assert_eq!(now, 1, "the light load kept workers a backlog brought");
        for _ in 0..3 {
            let d = b.decide(&window(4.4, 0.1), now);
            assert_eq!(d.desired, 1, "{:?}", d.reasons);
        }
    }

    /// Two pools of one disaggregated layout: each takes its own number from the plan's
    /// disaggregated layout, and only the latency it governs corrects it.
    #[test]
    fn prefill_and_decode_pools_plan_and_correct_on_their_own() {
        let (mut p, mut d) =
            (Brain::for_pool(cfg(), Pool::Prefill), Brain::for_pool(cfg(), Pool::Decode));
        let w = window(40.0, 0.05);
        let plan = crate::sla::plan(
            &cfg().profile,
            &Workload {
                rate: 40.0,
                isl: 512.0,
                osl: 64.0,
                hit_rate: 0.0,
                isl_dist: Default::default(),
            },
            &cfg().targets,
        );
        let crate::sla::Need::Disaggregated { prefill, decode, .. } = plan.disaggregated else {
            panic!("{:?}", plan.reasons)
        };
        let (dp, dd) = (p.decide(&w, 1), d.decide(&w, 1));
        assert_eq!((dp.pool, dp.planned), (Pool::Prefill, Some(prefill)), "{:?}", dp.reasons);
        assert_eq!((dd.pool, dd.planned), (Pool::Decode, Some(decode)), "{:?}", dd.reasons);
        assert!(dp.reasons[0].starts_with("prefill: "), "{:?}", dp.reasons);
        // TTFT missed at a light load: the prefill pool grows; the decode pool does not.
        let (mut p, mut d) =
            (Brain::for_pool(cfg(), Pool::Prefill), Brain::for_pool(cfg(), Pool::Decode));
        let slow_first = window(2.0, 0.9);
        let (dp, dd) = (p.decide(&slow_first, 1), d.decide(&slow_first, 1));
        assert_eq!((dp.action, dp.desired), (Action::Up, 2), "{:?}", dp.reasons);
        assert_eq!(dp.learned_workers, Some(2));
        assert_eq!((dd.action, dd.desired), (Action::Hold, 1), "{:?}", dd.reasons);
        assert!(!dd.reasons.iter().any(|r| r.contains("above the target")), "{:?}", dd.reasons);
        // ITL missed: the decode pool grows; the prefill pool does not.
        let (mut p, mut d) =
            (Brain::for_pool(cfg(), Pool::Prefill), Brain::for_pool(cfg(), Pool::Decode));
        let mut slow_steps = window(2.0, 0.05);
        slow_steps.itl_s.iter_mut().for_each(|x| *x = 0.08);
        let (dp, dd) = (p.decide(&slow_steps, 1), d.decide(&slow_steps, 1));
        assert_eq!((dd.action, dd.desired), (Action::Up, 2), "{:?}", dd.reasons);
        assert!(dd.reasons.iter().any(|r| r.contains("mean ITL")), "{:?}", dd.reasons);
        assert_eq!((dp.action, dp.desired), (Action::Hold, 1), "{:?}", dp.reasons);
    }

    /// Prompt lengths as the window saw them: one in eight 7× the mean, the rest short (the
    /// same mean) queue behind the long ones, and the plan needs more prefill workers than
    /// for prompts all of the mean length.
    #[test]
    fn spread_prompts_plan_more_prefill_than_prompts_of_their_mean() {
        let fixed = window(40.0, 0.05);
        let mut spread = window(40.0, 0.05);
        let short = (4096.0 - 3584.0) / 7.0;
        spread.prompt_lens = (0..spread.prompt_lens.len())
            .map(|i| if i % 8 == 0 { 3584.0 } else { short })
            .collect();
        let a = Brain::for_pool(cfg(), Pool::Prefill).decide(&fixed, 1);
        let b = Brain::for_pool(cfg(), Pool::Prefill).decide(&spread, 1);
        assert_eq!(a.predicted.isl, b.predicted.isl);
        assert!(b.planned > a.planned, "{:?} against {:?}: {:?}", b.planned, a.planned, b.reasons);
        assert!(b.reasons.iter().any(|r| r.contains("prompts spread over")), "{:?}", b.reasons);
        // Too few prompts to see a shape: planned as prompts of the mean length.
        let mut few = window(2.0, 0.05);
        few.prompt_lens.truncate(DIST_POINTS - 1);
        let c = Brain::for_pool(cfg(), Pool::Prefill).decide(&few, 1);
        assert_eq!(c.predicted.isl_dist, LengthDist::Fixed);
    }

    #[test]
    fn observations_of_a_window() {
        let w = LoadWindow {
            duration: Duration::from_secs(2),
            arrivals: 4,
            requests: 4,
            counted: 4,
            errors: 1,
            prompt_tokens: 400,
            generated_tokens: 40,
            cached_tokens: 100,
            ttft_s: vec![0.1, 0.2, 0.3, 0.4],
            itl_s: vec![],
            prompt_lens: vec![100.0; 4],
            classes: Vec::new(),
        };
        let o = Observed::of(&w, Some(0.5));
        assert_eq!((o.rate, o.isl, o.osl, o.hit_rate), (2.0, Some(100.0), Some(10.0), Some(0.25)));
        assert_eq!((o.ttft_s, o.itl_s), (Some(0.2), None));
        assert!((Observed::of(&w, None).ttft_s.unwrap() - 0.25).abs() < 1e-12);
    }
}
