//! SLA planning arithmetic: from an engine's measured times, a workload and latency targets,
//! how many workers each layout needs — disaggregated (prefill and decode workers) or
//! aggregated — and which needs fewer, with the reasons. `kvfabric profile` produces the
//! [`Profile`] (`kvfabric_serving::profile` measures one); `kvfabric plan --sla` and the live planner
//! ([`crate::live`]) call [`plan`].
//!
//! The model, per worker, with requests spread evenly:
//! - **Prefill** of one request takes `S = prefill(uncached prompt tokens)` plus the restore
//!   of its cached ones; `S` varies with the prompt length ([`LengthDist`]). A prefill worker
//!   is an M/G/1 queue: at utilisation ρ a request waits `λE[S²] / 2(1−ρ)` on average
//!   (`ρS / 2(1−ρ)` when every prompt has the mean length), and a quantile of the wait comes
//!   from the queue's exponential tail (Cramér–Lundberg). TTFT ≈ the request's own `S` plus
//!   its wait; workers = `⌈λE[S] / ρ⌉` at the highest ρ that meets the target.
//! - **Decode**: the largest batch `b` whose inter-token latency at the workload's mean
//!   context (prompt + half the answer) meets the ITL target; a worker then makes `b / itl(b)`
//!   tokens per second; workers = `⌈λ · OSL / (b / itl(b))⌉`.
//! - **Aggregated**: a worker spends the share `λ_w S` of its time on prefill; decode steps
//!   stretch by `1 / (1 − λ_w S)`, and a new request also waits for half a step in flight.
//!   The fewest workers whose stretched ITL and TTFT both meet the targets.
//!
//! Where it differs from Dynamo's SLA planner (its profiled-curve version): Dynamo sizes
//! prefill at full utilisation, `⌈λ · ISL / (ISL / ttft(ISL))⌉ = ⌈λS⌉`, and leaves queueing
//! to a correction factor observed at run time; here queueing is in the model, so the first
//! plan already meets the TTFT target. Decode is sized the same way in both (the test says
//! so). Dynamo does not choose between layouts; this does.

mod classes;

pub use classes::{
    plan_class_pools, plan_classes, tightest_itl, ClassEstimate, ClassLoad, ClassPlan, ClassPools,
};

/// A measured curve: `y` against `x`, interpolated linearly between points, extended along
/// the last segment past the ends (and never below zero).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "CurvePoints")]
pub struct Curve {
    /// Points, `x` ascending, finite, at least one.
    points: Vec<(f64, f64)>,
}

/// A curve as written, checked by [`Curve::new`] when read.
#[derive(serde::Deserialize)]
struct CurvePoints {
    points: Vec<(f64, f64)>,
}

impl TryFrom<CurvePoints> for Curve {
    type Error = String;

    fn try_from(c: CurvePoints) -> Result<Self, String> {
        Curve::new(c.points).ok_or_else(|| "a curve needs finite points, at least one".into())
    }
}

impl Curve {
    /// A curve through `points` (sorted here); None without any point or with a non-finite
    /// one.
    pub fn new(mut points: Vec<(f64, f64)>) -> Option<Curve> {
        if points.is_empty() || points.iter().any(|(x, y)| !x.is_finite() || !y.is_finite()) {
            return None;
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points.dedup_by(|a, b| a.0 == b.0);
        Some(Curve { points })
    }

    /// Its points, `x` ascending.
    pub fn points(&self) -> &[(f64, f64)] {
        &self.points
    }

    /// `y` at `x`.
    pub fn at(&self, x: f64) -> f64 {
        let p = &self.points;
        if p.len() <= 1 {
            return p.first().map_or(0.0, |q| q.1.max(0.0));
        }
        let i = p.partition_point(|q| q.0 < x).clamp(1, p.len() - 1);
        let ((x0, y0), (x1, y1)) = (p[i - 1], p[i]);
        (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
    }
}

/// What an engine takes, measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Profile {
    /// Prefill time of one request, seconds, against the prompt tokens it computes.
    pub prefill_s: Curve,
    /// Inter-token latency, seconds, against the decode batch, per context length (tokens).
    /// Between two context lengths measured it is interpolated linearly; past the longest,
    /// extrapolated along the two longest when it rises with the context (a decode step reads
    /// every token's KV), else the longest's; below the shortest, the shortest's.
    pub itl_s: Vec<(f64, Curve)>,
    /// Largest decode batch a worker holds (at most [`BATCH_MAX`]).
    pub batch_max: u32,
    /// KV bytes per token (what a disaggregated prefill sends its decode worker).
    pub kv_bytes_per_token: u64,
    /// Seconds a cached prompt token adds to a prefill (restoring its KV instead of computing
    /// it); 0 when unmeasured.
    #[serde(default)]
    pub restore_s_per_token: f64,
}

impl Profile {
    /// Inter-token latency, seconds, of a decode batch of `batch` sequences at `context`
    /// tokens (None without any decode measurement).
    pub fn itl(&self, context: f64, batch: f64) -> Option<f64> {
        let by_context = |a: &&(f64, Curve), b: &&(f64, Curve)| a.0.total_cmp(&b.0);
        let below = self.itl_s.iter().filter(|(c, _)| *c <= context).max_by(by_context);
        let above = self.itl_s.iter().filter(|(c, _)| *c >= context).min_by(by_context);
        let line = |(x0, y0): (f64, f64), (x1, y1): (f64, f64), x: f64| {
            (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
        };
        Some(match (below, above) {
            (Some(b), Some(a)) if a.0 > b.0 => {
                line((b.0, b.1.at(batch)), (a.0, a.1.at(batch)), context)
            }
            (Some((_, c)), Some(_)) | (None, Some((_, c))) => c.at(batch),
            (Some(last), None) => {
                let y1 = last.1.at(batch);
                let before = self.itl_s.iter().filter(|(c, _)| *c < last.0).max_by(by_context);
                match before.map(|(x0, c)| (*x0, c.at(batch))) {
                    Some((x0, y0)) if y1 > y0 => line((x0, y0), (last.0, y1), context),
                    _ => y1,
                }
            }
            (None, None) => return None,
        })
    }

    /// The largest batch whose ITL at `context` meets `itl_target`, and that ITL.
    fn best_batch(&self, context: f64, itl_target: f64) -> Option<(u32, f64)> {
        (1..=self.batch_max.clamp(1, BATCH_MAX))
            .rev()
            .filter_map(|b| self.itl(context, f64::from(b)).map(|t| (b, t)))
            .find(|&(_, t)| t > 0.0 && t <= itl_target)
    }
}

/// The load to plan for.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    /// Requests per second.
    pub rate: f64,
    /// Mean prompt tokens.
    pub isl: f64,
    /// Mean answer tokens (the decode model needs only the mean: Little's law).
    pub osl: f64,
    /// Share of prompt tokens found cached (0..1).
    pub hit_rate: f64,
    /// How prompt lengths spread around `isl` (prefill queueing depends on it).
    #[serde(default)]
    pub isl_dist: LengthDist,
}

/// A distribution of lengths.
// The empirical shape is inline (256 bytes) so that a workload stays a plain `Copy` value; a
// plan copies a few of them per decision.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LengthDist {
    /// Every one at the mean.
    #[default]
    Fixed,
    /// Uniform between two lengths (their middle is the mean).
    Uniform {
        /// Shortest.
        lo: f64,
        /// Longest.
        hi: f64,
    },
    /// Exponential around the mean (many short, a few long).
    Exponential,
    /// Lengths as observed: the [`DIST_POINTS`] quantile midpoints of a sample, over its
    /// mean (so that the shape's mean is 1).
    Empirical {
        /// The quantile midpoints, divided by the sample's mean, ascending.
        shape: [f64; DIST_POINTS],
    },
}

/// Points a distribution is discretised into (quantile midpoints).
pub const DIST_POINTS: usize = 32;

impl LengthDist {
    /// The shape of observed lengths; None for fewer than [`DIST_POINTS`] of them, or for
    /// lengths that are not finite and positive on average.
    pub fn empirical(lens: &[f64]) -> Option<Self> {
        if lens.len() < DIST_POINTS || lens.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return None;
        }
        let mut s = lens.to_vec();
        s.sort_by(f64::total_cmp);
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        if mean <= 0.0 {
            return None;
        }
        let mut shape = [0.0; DIST_POINTS];
        for (i, x) in shape.iter_mut().enumerate() {
            *x = crate::stats::quantile(&s, (i as f64 + 0.5) / DIST_POINTS as f64) / mean;
        }
        // The midpoints' mean is the sample's up to the discretisation: made exact.
        let m = shape.iter().sum::<f64>() / DIST_POINTS as f64;
        if m > 0.0 {
            shape.iter_mut().for_each(|x| *x /= m);
        }
        Some(LengthDist::Empirical { shape })
    }

    /// Lengths standing for the distribution of mean `mean`, equally likely.
    pub fn points(&self, mean: f64) -> Vec<f64> {
        let mid = |i: usize| (i as f64 + 0.5) / DIST_POINTS as f64;
        match *self {
            LengthDist::Fixed => vec![mean],
            LengthDist::Uniform { lo, hi } => {
                (0..DIST_POINTS).map(|i| lo + (hi - lo) * mid(i)).collect()
            }
            LengthDist::Exponential => {
                (0..DIST_POINTS).map(|i| -mean * (1.0 - mid(i)).ln()).collect()
            }
            LengthDist::Empirical { shape } => shape.iter().map(|x| x * mean).collect(),
        }
    }

    /// The same shape scaled by `k` (a uniform's ends move with the mean).
    pub fn scaled(self, k: f64) -> Self {
        match self {
            LengthDist::Uniform { lo, hi } => LengthDist::Uniform { lo: lo * k, hi: hi * k },
            other => other,
        }
    }
}

/// Prefill service times, equally likely.
#[derive(Debug, Clone)]
struct Service {
    times: Vec<f64>,
}

impl Service {
    /// The prefill times of `load`'s requests: each prompt length's uncached tokens
    /// computed, its cached ones restored.
    fn of(profile: &Profile, load: &Workload) -> Self {
        let hit = load.hit_rate.clamp(0.0, 1.0);
        Service {
            times: load
                .isl_dist
                .points(load.isl)
                .into_iter()
                .map(|x| {
                    profile.prefill_s.at(x * (1.0 - hit)) + profile.restore_s_per_token * x * hit
                })
                .collect(),
        }
    }

    fn mean(&self) -> f64 {
        self.times.iter().sum::<f64>() / self.times.len().max(1) as f64
    }

    fn moment2(&self) -> f64 {
        self.times.iter().map(|s| s * s).sum::<f64>() / self.times.len().max(1) as f64
    }

    /// E[e^(θS)] and E[S e^(θS)].
    fn mgf(&self, theta: f64) -> (f64, f64) {
        let n = self.times.len().max(1) as f64;
        let e: f64 = self.times.iter().map(|s| (theta * s).exp()).sum::<f64>() / n;
        let se: f64 = self.times.iter().map(|s| s * (theta * s).exp()).sum::<f64>() / n;
        (e, se)
    }

    /// The service time a request counts in its own TTFT: the mean, or the quantile.
    fn own(&self, q: Option<f64>) -> f64 {
        match q {
            None => self.mean(),
            Some(q) => {
                let mut t = self.times.clone();
                t.sort_by(f64::total_cmp);
                crate::stats::quantile(&t, q)
            }
        }
    }
}

/// Latency targets, seconds: means, or a quantile (p50, p99) of each.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Targets {
    /// Time to first token.
    pub ttft_s: f64,
    /// Inter-token latency.
    pub itl_s: f64,
    /// The quantile the targets are for (0.5, 0.99); None: means.
    #[serde(default)]
    pub quantile: Option<f64>,
}

impl Targets {
    /// Targets for the means.
    pub fn means(ttft_s: f64, itl_s: f64) -> Self {
        Targets { ttft_s, itl_s, quantile: None }
    }

    /// Targets for quantile `q` (0 < q < 1) of TTFT and ITL.
    pub fn at_quantile(ttft_s: f64, itl_s: f64, q: f64) -> Self {
        Targets { ttft_s, itl_s, quantile: Some(q.clamp(0.01, 0.9999)) }
    }

    fn label(&self) -> String {
        match self.quantile {
            None => "mean".into(),
            Some(q) => format!("p{}", (q * 100.0 * 100.0).round() / 100.0),
        }
    }
}

/// Waiting before service in an M/G/1 queue at utilisation `rho` with service times `svc`:
/// the mean `λE[S²] / 2(1−ρ)` (Pollaczek–Khinchine, exact), or its quantile `q` from the
/// queue's exponential tail `P(W > t) ≈ C e^(−θt)` (Cramér–Lundberg: `θ` solves
/// `λ(E[e^(θS)] − 1) = θ`, and `C = (1−ρ) / (λE[S e^(θS)] − 1)`; exact in the limit of high
/// quantiles, and within a few percent of a simulated queue at the p90–p99 targets the tests
/// try). With one service time this is M/D/1.
fn queue_wait(rho: f64, svc: &Service, q: Option<f64>) -> f64 {
    if rho <= 0.0 {
        return 0.0;
    }
    if rho >= 1.0 {
        return f64::INFINITY;
    }
    let lambda = rho / svc.mean().max(1e-12);
    let Some(q) = q else {
        return lambda * svc.moment2() / (2.0 * (1.0 - rho));
    };
    if rho <= 1.0 - q {
        // A request waits at all with probability ρ.
        return 0.0;
    }
    // θ > 0 solves λ(E[e^(θS)] − 1) = θ: bisect between 0 and an upper bound where the left
    // side is ahead.
    let f = |theta: f64| lambda * (svc.mgf(theta).0 - 1.0) - theta;
    let smax = svc.times.iter().copied().fold(0.0, f64::max).max(1e-12);
    let mut hi = 1.0 / smax;
    while f(hi) < 0.0 && hi * smax < 700.0 {
        hi *= 2.0;
    }
    let mut lo = 0.0f64;
    for _ in 0..100 {
        let mid = (lo + hi) / 2.0;
        if f(mid) < 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let theta = hi;
    let c = (1.0 - rho) / (lambda * svc.mgf(theta).1 - 1.0);
    if c.is_nan() || c <= 1.0 - q {
        return 0.0;
    }
    (c / (1.0 - q)).ln() / theta
}

/// The highest utilisation at which a request's own prefill plus its wait stays within
/// `ttft`.
fn max_utilisation(svc: &Service, ttft: f64, q: Option<f64>) -> f64 {
    let own = svc.own(q);
    if q.is_none() {
        // E[S] + ρ a / (1−ρ) ≤ T with a = E[S²] / 2E[S].
        let a = svc.moment2() / (2.0 * svc.mean().max(1e-12));
        return ((ttft - own) / (ttft - own + a)).max(0.0);
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if own + queue_wait(mid, svc, q) <= ttft {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// A layout's requirement, or why it cannot meet the targets.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Need {
    /// Disaggregated: prefill and decode workers, and the KV bandwidth between them.
    Disaggregated {
        /// Prefill workers.
        prefill: u32,
        /// Decode workers.
        decode: u32,
        /// KV bytes per second from prefill to decode workers.
        kv_bytes_per_s: f64,
    },
    /// Aggregated workers.
    Aggregated {
        /// Workers.
        workers: u32,
    },
    /// No number of workers meets the targets (why).
    Infeasible(String),
}

impl Need {
    /// Workers in all (None when infeasible).
    pub fn workers(&self) -> Option<u32> {
        match self {
            Need::Disaggregated { prefill, decode, .. } => Some(prefill + decode),
            Need::Aggregated { workers } => Some(*workers),
            Need::Infeasible(_) => None,
        }
    }
}

/// Both layouts, the choice, and the reasoning.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    /// What disaggregation needs.
    pub disaggregated: Need,
    /// What aggregation needs.
    pub aggregated: Need,
    /// true when disaggregation needs fewer workers (ties: aggregated, which moves no KV).
    pub choose_disaggregated: bool,
    /// How the numbers came about, one line each.
    pub reasons: Vec<String>,
}

/// Most workers a plan considers.
const WORKERS_MAX: u32 = 100_000;

/// Largest decode batch a profile may give (plans try every batch up to it).
pub const BATCH_MAX: u32 = 65_536;

/// Plans `load` on an engine like `profile` for `targets`.
pub fn plan(profile: &Profile, load: &Workload, targets: &Targets) -> Plan {
    let mut reasons = Vec::new();
    let hit = load.hit_rate.clamp(0.0, 1.0);
    let computed = load.isl * (1.0 - hit);
    let svc = Service::of(profile, load);
    let s = svc.mean();
    let context = load.isl + load.osl / 2.0;
    reasons.push(format!(
        "targets ({}): TTFT {:.0} ms, ITL {:.1} ms",
        targets.label(),
        targets.ttft_s * 1e3,
        targets.itl_s * 1e3
    ));
    reasons.push(format!(
        "prefill of {computed:.0} uncached tokens ({:.0}% of {:.0} cached) takes {:.1} ms{}",
        hit * 100.0,
        load.isl,
        s * 1e3,
        match load.isl_dist {
            LengthDist::Fixed => String::new(),
            _ => format!(
                " on average ({} prompts; {} {:.1} ms)",
                match load.isl_dist {
                    LengthDist::Uniform { lo, hi } => format!("{lo:.0}..{hi:.0}-token"),
                    _ => "exponentially spread".into(),
                },
                targets.label(),
                svc.own(targets.quantile.or(Some(0.5))) * 1e3
            ),
        }
    ));
    let disaggregated = disaggregated(profile, load, targets, &svc, context, &mut reasons);
    let aggregated = aggregated(profile, load, targets, &svc, context, &mut reasons);
    let choose_disaggregated = match (disaggregated.workers(), aggregated.workers()) {
        (Some(d), Some(a)) => d < a,
        (Some(_), None) => true,
        _ => false,
    };
    reasons.push(match (disaggregated.workers(), aggregated.workers()) {
        (Some(d), Some(a)) if choose_disaggregated => {
            format!("disaggregated: {d} workers against {a} aggregated")
        }
        (Some(d), Some(a)) => format!("aggregated: {a} workers against {d} disaggregated"),
        (None, Some(a)) => {
            format!("aggregated: {a} workers; disaggregation cannot meet the targets")
        }
        (Some(d), None) => {
            format!("disaggregated: {d} workers; aggregation cannot meet the targets")
        }
        (None, None) => "neither layout meets the targets".into(),
    });
    Plan { disaggregated, aggregated, choose_disaggregated, reasons }
}

/// The layout a plan picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Prefill and decode workers.
    Disaggregated,
    /// Aggregated workers.
    Aggregated,
    /// Neither meets the targets.
    Neither,
}

impl Plan {
    /// The layout chosen.
    pub fn layout(&self) -> Layout {
        if self.choose_disaggregated {
            Layout::Disaggregated
        } else if self.aggregated.workers().is_some() {
            Layout::Aggregated
        } else {
            Layout::Neither
        }
    }

    /// Workers of the chosen layout.
    pub fn workers(&self) -> Option<u32> {
        match self.layout() {
            Layout::Disaggregated => self.disaggregated.workers(),
            Layout::Aggregated => self.aggregated.workers(),
            Layout::Neither => None,
        }
    }

    fn summary(&self) -> String {
        match (self.layout(), self.disaggregated.workers(), self.aggregated.workers()) {
            (Layout::Disaggregated, Some(d), Some(a)) => {
                format!("disaggregated wins ({d} workers against {a})")
            }
            (Layout::Aggregated, Some(d), Some(a)) => {
                format!("aggregated wins ({a} workers against {d})")
            }
            (Layout::Disaggregated, Some(d), _) => {
                format!("only disaggregation meets the targets ({d} workers)")
            }
            (Layout::Aggregated, _, Some(a)) => {
                format!("only aggregation meets the targets ({a} workers)")
            }
            _ => "neither layout meets the targets".into(),
        }
    }
}

/// What would change the decision: for the prompt length, the answer length, the request
/// rate and the hit rate in turn (the rest held), the nearest values below and above the
/// workload's at which the plan picks another layout; one sentence each.
pub fn what_changes(profile: &Profile, load: &Workload, targets: &Targets) -> Vec<String> {
    let base = plan(profile, load, targets).layout();
    let scale = |v: f64, up: bool| -> Vec<f64> {
        (1..=24).map(|k| v * 2f64.powf(if up { k } else { -k } as f64 / 4.0)).collect()
    };
    let hits = |up: bool| -> Vec<f64> {
        let mut v: Vec<f64> = (0..=19)
            .map(|k| f64::from(k) * 0.05)
            .filter(|&h| if up { h > load.hit_rate + 1e-9 } else { h < load.hit_rate - 1e-9 })
            .collect();
        if !up {
            v.reverse();
        }
        v
    };
    type Set = fn(Workload, f64) -> Workload;
    let params: [(&str, &str, f64, Set, bool); 4] = [
        (
            "prompts of",
            "tokens",
            load.isl,
            |w, v| {
                let isl = v.round().max(1.0);
                Workload { isl, isl_dist: w.isl_dist.scaled(isl / w.isl.max(1.0)), ..w }
            },
            true,
        ),
        ("answers of", "tokens", load.osl, |w, v| Workload { osl: v.round().max(1.0), ..w }, true),
        ("a rate of", "requests/s", load.rate, |w, v| Workload { rate: v, ..w }, true),
        ("a hit rate of", "", load.hit_rate, |w, v| Workload { hit_rate: v, ..w }, false),
    ];
    let mut out = Vec::new();
    for (what, unit, now, set, geometric) in params {
        for up in [false, true] {
            let values = if geometric { scale(now, up) } else { hits(up) };
            for v in values {
                let p = plan(profile, &set(*load, v), targets);
                if p.layout() != base {
                    let shown = if geometric {
                        format!("{} {unit}", significant(v))
                    } else {
                        format!("{:.0}%", v * 100.0)
                    };
                    let side = if up { "or more" } else { "or less" };
                    out.push(format!("at {what} {shown} {side}, {}", p.summary()));
                    break;
                }
            }
        }
    }
    if out.is_empty() {
        out.push(format!(
            "nothing within 1/64× to 64× of the prompt and answer lengths and the rate, nor any hit rate, changes it: {}",
            plan(profile, load, targets).summary()
        ));
    }
    out
}

/// Two significant digits (1234 → 1200, 0.0123 → 0.012).
fn significant(v: f64) -> String {
    if v <= 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = v.log10().floor() as i32;
    let unit = 10f64.powi(digits - 1);
    let r = (v / unit).round() * unit;
    if digits >= 1 {
        format!("{r:.0}")
    } else {
        format!("{r:.*}", (1 - digits) as usize)
    }
}

fn disaggregated(
    profile: &Profile,
    load: &Workload,
    targets: &Targets,
    svc: &Service,
    context: f64,
    reasons: &mut Vec<String>,
) -> Need {
    let s = svc.mean();
    if svc.own(targets.quantile) >= targets.ttft_s {
        return Need::Infeasible(format!(
            "a prefill alone ({:.1} ms) exceeds the TTFT target ({:.1} ms)",
            s * 1e3,
            targets.ttft_s * 1e3
        ));
    }
    let rho = max_utilisation(svc, targets.ttft_s, targets.quantile);
    if rho <= 0.0 {
        return Need::Infeasible(format!(
            "a prefill ({:.1} ms) leaves no room for queueing within the TTFT target",
            s * 1e3
        ));
    }
    let prefill = ((load.rate * s / rho).ceil() as u32).clamp(1, WORKERS_MAX);
    reasons.push(format!(
        "prefill workers: {:.2} busy at most {:.0}% each (M/G/1 waiting keeps the {} TTFT under {:.0} ms) → {prefill}",
        load.rate * s,
        rho * 100.0,
        targets.label(),
        targets.ttft_s * 1e3
    ));
    let decode = match decode_workers(profile, load.rate * load.osl, context, targets.itl_s) {
        Ok((decode, why)) => {
            reasons.push(why);
            decode
        }
        Err(why) => return Need::Infeasible(why),
    };
    let kv_bytes_per_s = load.rate * load.isl * profile.kv_bytes_per_token as f64;
    Need::Disaggregated { prefill, decode, kv_bytes_per_s }
}

/// The fewest workers for which `at` has an answer, and that answer; None when even
/// [`WORKERS_MAX`] has none. Feasibility only grows with the count (each worker's share of
/// the load falls), so a doubling search then a bisection find it.
fn fewest<T>(at: impl Fn(u32) -> Option<T>) -> Option<(u32, T)> {
    let (mut lo, mut hi) = (0u32, 1u32);
    while at(hi).is_none() {
        if hi >= WORKERS_MAX {
            return None;
        }
        lo = hi;
        hi = hi.saturating_mul(2).min(WORKERS_MAX);
    }
    // at(lo) fails (or lo = 0), at(hi) holds.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if at(mid).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    at(hi).map(|e| (hi, e))
}

/// Decode workers for `tokens_per_s` generated tokens at `context` tokens of context, each
/// running the largest batch within the ITL target; and why, in one line.
fn decode_workers(
    profile: &Profile,
    tokens_per_s: f64,
    context: f64,
    itl_target: f64,
) -> Result<(u32, String), String> {
    let Some((b, itl)) = profile.best_batch(context, itl_target) else {
        return Err(format!(
            "no decode batch meets the ITL target ({:.1} ms) at {context:.0} tokens of context",
            itl_target * 1e3
        ));
    };
    let per_worker = f64::from(b) / itl;
    let decode = ((tokens_per_s / per_worker).ceil() as u32).clamp(1, WORKERS_MAX);
    Ok((
        decode,
        format!(
            "decode workers: batch {b} at {:.1} ms per token makes {per_worker:.0} tokens/s each; {tokens_per_s:.0} tokens/s needed → {decode}",
            itl * 1e3
        ),
    ))
}

fn aggregated(
    profile: &Profile,
    load: &Workload,
    targets: &Targets,
    svc: &Service,
    context: f64,
    reasons: &mut Vec<String>,
) -> Need {
    let s = svc.mean();
    if profile.itl_s.is_empty() {
        return Need::Infeasible("the profile has no decode curve".into());
    }
    // What `n` workers give: None when they cannot meet the targets. Feasibility only grows
    // with n (each worker's prefill share, batch and so ITL and TTFT all fall), so the
    // fewest feasible workers are found by bisection.
    // A request's own prefill in its TTFT: the same for every n.
    let own = svc.own(targets.quantile);
    let at = |n: u32| -> Option<(f64, f64, f64, f64)> {
        let per_worker = load.rate / f64::from(n);
        let prefill_share = per_worker * s;
        if prefill_share >= 1.0 {
            return None;
        }
        // Sequences decoding on a worker at once (Little's law), at the stretched ITL.
        let mut batch = 1.0f64;
        let mut itl = 0.0;
        for _ in 0..20 {
            let base = profile.itl(context, batch.ceil().max(1.0))?;
            itl = base / (1.0 - prefill_share);
            batch = (per_worker * load.osl * itl).max(1.0);
        }
        if batch > f64::from(profile.batch_max.max(1)) || itl > targets.itl_s {
            return None;
        }
        // A new prompt waits for the step in flight (uniform over a step: half of one on
        // average, the quantile's share of one), then queues behind the worker's other
        // prefills (M/G/1 on the prefill share).
        let step_wait = itl * targets.quantile.unwrap_or(0.5);
        let ttft = own + step_wait + queue_wait(prefill_share, svc, targets.quantile);
        (ttft <= targets.ttft_s).then_some((prefill_share, batch, itl, ttft))
    };
    if let Some((hi, (prefill_share, batch, itl, ttft))) = fewest(at) {
        reasons.push(format!(
            "aggregated workers: {hi}, each {:.0}% prefill, decoding {batch:.1} sequences at {:.1} ms per token, {} TTFT ≈ {:.1} ms",
            prefill_share * 100.0,
            itl * 1e3,
            targets.label(),
            ttft * 1e3
        ));
        return Need::Aggregated { workers: hi };
    }
    Need::Infeasible("no number of aggregated workers meets both targets".into())
}

#[cfg(test)]
mod tests;
