//! The HTTP frontend's own metrics, live: requests by outcome, latency histograms, tokens,
//! per-class counters, the load windows the live planner reads; the listener's connections.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::*;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Answered.
    Ok,
    /// Refused for the client's doing (4xx).
    ClientError,
    /// Failed on our side (5xx).
    ServerError,
    /// The client went away.
    Cancelled,
}

/// The frontend's live metrics.
#[derive(Debug, Clone)]
pub struct HttpMetrics {
    requests: Family<Labels, Counter>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    /// Per tier ([`CACHE_TIERS`]), over the same requests as `prompt_tokens`.
    cached_prompt_tokens: Family<Labels, Counter>,
    /// The TTFT and ITL histograms' bucket counts again, readable (the dashboard's
    /// percentiles); bucket `i` counts observations at most `LATENCY_BUCKETS[i]` (ITL:
    /// `ITL_BUCKETS[i]`) and above the bucket before, the last one those above all bounds.
    ttft_buckets: Arc<[AtomicU64]>,
    itl_buckets: Arc<[AtomicU64]>,
    window: Arc<parking_lot::Mutex<Window>>,
    /// Set by the first [`HttpMetrics::take_window`]: until someone reads windows, none is
    /// filled (no lock taken per token).
    window_on: Arc<std::sync::atomic::AtomicBool>,
    /// Per service class.
    pub class: class::ClassMetrics,
}

/// The window being filled: since when, what, and the latency samples offered to it.
#[derive(Debug)]
struct Window {
    since: std::time::Instant,
    load: LoadWindow,
    ttft_seen: u64,
    itl_seen: u64,
    prompt_seen: u64,
}

impl Window {
    fn new() -> Self {
        Window {
            since: std::time::Instant::now(),
            load: LoadWindow::default(),
            ttft_seen: 0,
            itl_seen: 0,
            prompt_seen: 0,
        }
    }
}

/// The tiers of `kvfabric_cached_prompt_tokens_total{tier}`, fastest first: an engine's own
/// memory, host memory, disk, a remote fabric node (the dashboard's G1 to G4).
pub const CACHE_TIERS: [&str; 4] = ["device", "host", "disk", "remote"];

/// The frontend's cumulative counts ([`HttpMetrics::totals`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct HttpTotals {
    /// Requests answered.
    pub ok: u64,
    /// Requests refused for the client's doing (4xx).
    pub client_errors: u64,
    /// Requests failed on the server's side (5xx).
    pub server_errors: u64,
    /// Requests whose client went away.
    pub cancelled: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generated_tokens: u64,
    /// Prompt tokens whose KV came from a cache (the sum of `cached_by_tier`).
    pub cached_prompt_tokens: u64,
    /// Those per tier, in [`CACHE_TIERS`] order.
    pub cached_by_tier: [u64; 4],
    /// TTFT observations per bucket of [`LATENCY_BUCKETS`] (not cumulative), and above.
    pub ttft_buckets: Vec<u64>,
    /// ITL observations per bucket of [`ITL_BUCKETS`] (not cumulative), and above.
    pub itl_buckets: Vec<u64>,
}

fn bucket(counts: &[AtomicU64], bounds: &[f64], x: f64) {
    let i = bounds.iter().position(|&b| x <= b).unwrap_or(bounds.len());
    if let Some(c) = counts.get(i) {
        c.fetch_add(1, Relaxed);
    }
}

/// The `q` quantile of observations counted per bucket (`counts[i]` in `(bounds[i-1],
/// bounds[i]]`, the last above every bound), interpolated linearly within its bucket as
/// Prometheus's `histogram_quantile` does; None without observations. Past the last bound,
/// the last bound.
pub fn bucket_quantile(counts: &[u64], bounds: &[f64], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 || bounds.is_empty() {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0u64;
    for (i, &c) in counts.iter().enumerate() {
        if c > 0 && (below + c) as f64 >= rank {
            let Some(&hi) = bounds.get(i) else { return bounds.last().copied() };
            let lo = if i == 0 { 0.0 } else { bounds[i - 1] };
            return Some(lo + (hi - lo) * ((rank - below as f64) / c as f64).clamp(0.0, 1.0));
        }
        below += c;
    }
    bounds.last().copied()
}

pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Reservoir sampling: the `seen`-th sample replaces a random kept one with probability
/// `cap / seen`, so that the kept ones stay a uniform sample of all.
fn keep_sample(v: &mut Vec<f64>, x: f64, seen: &mut u64) {
    *seen += 1;
    if v.len() < WINDOW_SAMPLES_MAX {
        v.push(x);
        return;
    }
    // A SplitMix64 step of the count: random enough to pick a slot.
    let mut z = seen.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    let i = (z ^ (z >> 31)) % *seen;
    if let Some(slot) = v.get_mut(i as usize) {
        *slot = x;
    }
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics {
            requests: Family::default(),
            ttft: Histogram::new(LATENCY_BUCKETS.iter().copied()),
            itl: Histogram::new(ITL_BUCKETS.iter().copied()),
            e2e: Histogram::new(LATENCY_BUCKETS.iter().copied()),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            cached_prompt_tokens: {
                let f = Family::<Labels, Counter>::default();
                // Every tier has a sample from the start, 0 until a hit.
                for t in CACHE_TIERS {
                    drop(f.get_or_create(&vec![("tier", t.into())]));
                }
                f
            },
            ttft_buckets: (0..=LATENCY_BUCKETS.len()).map(|_| AtomicU64::new(0)).collect(),
            itl_buckets: (0..=ITL_BUCKETS.len()).map(|_| AtomicU64::new(0)).collect(),
            window: Arc::new(parking_lot::Mutex::new(Window::new())),
            window_on: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            class: Default::default(),
        }
    }
}

impl HttpMetrics {
    /// Counts a finished request.
    pub fn request(&self, outcome: Outcome) {
        let v = match outcome {
            Outcome::Ok => "ok",
            Outcome::ClientError => "client_error",
            Outcome::ServerError => "server_error",
            Outcome::Cancelled => "cancelled",
        };
        self.requests.get_or_create(&vec![("outcome", v.into())]).inc();
        if outcome != Outcome::ClientError && self.windowed() {
            let mut w = self.window.lock();
            w.load.requests += 1;
            w.load.errors += u64::from(outcome == Outcome::ServerError);
        }
    }

    /// Time to the first token.
    pub fn first_token(&self, d: Duration) {
        self.ttft.observe(d.as_secs_f64());
        bucket(&self.ttft_buckets, LATENCY_BUCKETS, d.as_secs_f64());
        self.window_ttft(d);
    }

    /// A request that failed before its first token, `d` after it arrived: its wait counts
    /// in the window's TTFT (not in the histogram of first tokens).
    pub fn no_first_token(&self, d: Duration) {
        self.window_ttft(d);
    }

    fn window_ttft(&self, d: Duration) {
        if self.windowed() {
            let w = &mut *self.window.lock();
            keep_sample(&mut w.load.ttft_s, d.as_secs_f64(), &mut w.ttft_seen);
        }
    }

    /// A request submitted to the backend.
    pub fn arrival(&self) {
        if self.windowed() {
            self.window.lock().load.arrivals += 1;
        }
    }

    fn windowed(&self) -> bool {
        self.window_on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Time between two tokens.
    pub fn inter_token(&self, d: Duration) {
        self.itl.observe(d.as_secs_f64());
        bucket(&self.itl_buckets, ITL_BUCKETS, d.as_secs_f64());
        if self.windowed() {
            let w = &mut *self.window.lock();
            keep_sample(&mut w.load.itl_s, d.as_secs_f64(), &mut w.itl_seen);
        }
    }

    /// The token counts of a request an engine admitted, once it ends (answered, failed or
    /// cancelled): its prompt, what it generated, and its prompt tokens from cache per tier
    /// ([`CACHE_TIERS`] order).
    pub fn tokens(&self, prompt: u64, generated: u64, cached_by_tier: [u64; 4]) {
        self.prompt_tokens.inc_by(prompt);
        self.generation_tokens.inc_by(generated);
        for (t, n) in CACHE_TIERS.iter().zip(cached_by_tier) {
            self.cached_prompt_tokens.get_or_create(&vec![("tier", (*t).into())]).inc_by(n);
        }
        let cached: u64 = cached_by_tier.iter().sum();
        if !self.windowed() {
            return;
        }
        let w = &mut *self.window.lock();
        w.load.counted += 1;
        keep_sample(&mut w.load.prompt_lens, prompt as f64, &mut w.prompt_seen);
        w.load.prompt_tokens += prompt;
        w.load.generated_tokens += generated;
        w.load.cached_tokens += cached;
    }

    /// A request of class `i` submitted to the backend (besides [`Self::arrival`]).
    pub fn class_arrival(&self, i: usize) {
        self.class_window(i, |c| c.arrivals += 1);
    }

    /// Its time to first token, or the time it failed after without one.
    pub fn class_ttft(&self, i: usize, d: Duration) {
        self.class_window(i, |c| {
            if c.ttft_s.len() < WINDOW_SAMPLES_MAX {
                c.ttft_s.push(d.as_secs_f64());
            }
        });
    }

    /// Its token counts (besides [`Self::tokens`]).
    pub fn class_tokens(&self, i: usize, prompt: u64, generated: u64, cached: u64) {
        self.class_window(i, |c| {
            c.counted += 1;
            c.prompt_tokens += prompt;
            c.generated_tokens += generated;
            c.cached_tokens += cached;
        });
    }

    fn class_window(&self, i: usize, f: impl FnOnce(&mut kvfabric_planner::window::ClassWindow)) {
        if !self.windowed() || i >= crate::classes::CLASSES_MAX {
            return;
        }
        let w = &mut *self.window.lock();
        if w.load.classes.len() <= i {
            w.load.classes.resize_with(i + 1, Default::default);
        }
        f(&mut w.load.classes[i]);
    }

    /// What was seen since the last call, and a new window. The first call starts the
    /// windows (and returns an empty one).
    pub fn take_window(&self) -> LoadWindow {
        self.window_on.store(true, std::sync::atomic::Ordering::Relaxed);
        let old = std::mem::replace(&mut *self.window.lock(), Window::new());
        let mut load = LoadWindow { duration: old.since.elapsed(), ..old.load };
        // Every class configured, named, with its targets (those that saw nothing at 0).
        let targets = self.class.targets();
        load.classes.resize_with(targets.len(), Default::default);
        for (c, (name, ttft, itl)) in load.classes.iter_mut().zip(targets) {
            (c.name, c.ttft_target_s, c.itl_target_s) = (name, ttft, itl);
        }
        load
    }

    /// The cumulative counts now (what `/metrics` shows, readable).
    pub fn totals(&self) -> HttpTotals {
        let outcome = |v: &str| self.requests.get_or_create(&vec![("outcome", v.into())]).get();
        let ld = |b: &[AtomicU64]| b.iter().map(|a| a.load(Relaxed)).collect();
        let cached_by_tier = CACHE_TIERS
            .map(|t| self.cached_prompt_tokens.get_or_create(&vec![("tier", t.into())]).get());
        HttpTotals {
            ok: outcome("ok"),
            client_errors: outcome("client_error"),
            server_errors: outcome("server_error"),
            cancelled: outcome("cancelled"),
            prompt_tokens: self.prompt_tokens.get(),
            generated_tokens: self.generation_tokens.get(),
            cached_prompt_tokens: cached_by_tier.iter().sum(),
            cached_by_tier,
            ttft_buckets: ld(&self.ttft_buckets),
            itl_buckets: ld(&self.itl_buckets),
        }
    }

    /// A request's end-to-end duration.
    pub fn duration(&self, d: Duration) {
        self.e2e.observe(d.as_secs_f64());
    }

    /// The service classes (name, TTFT and ITL targets), in their index order.
    pub fn classes(
        &self,
        classes: impl IntoIterator<Item = (String, Option<Duration>, Option<Duration>)>,
    ) {
        self.class.set(classes);
    }

    /// Registers every metric of the frontend.
    pub fn register(&self, r: &mut Registry) {
        self.class.register(r);
        r.register("kvfabric_requests", "Requests by outcome.", self.requests.clone());
        r.register_with_unit(
            "kvfabric_time_to_first_token",
            "Time to first token.",
            Unit::Seconds,
            self.ttft.clone(),
        );
        r.register_with_unit(
            "kvfabric_inter_token_latency",
            "Time between tokens.",
            Unit::Seconds,
            self.itl.clone(),
        );
        r.register_with_unit(
            "kvfabric_request_duration",
            "End-to-end request latency.",
            Unit::Seconds,
            self.e2e.clone(),
        );
        r.register("kvfabric_prompt_tokens", "Prompt tokens.", self.prompt_tokens.clone());
        r.register(
            "kvfabric_generation_tokens",
            "Generated tokens.",
            self.generation_tokens.clone(),
        );
        r.register(
            "kvfabric_cached_prompt_tokens",
            "Prompt tokens whose KV came from a cache, per tier (the same requests as kvfabric_prompt_tokens).",
            self.cached_prompt_tokens.clone(),
        );
    }
}

/// What an HTTP listener did (see `http::listen`).
#[derive(Debug, Clone, Default)]
pub struct ListenStats {
    /// Connections open now (main pool and reserve).
    pub open: Gauge,
    /// Connections accepted into the reserve (the main pool was full).
    pub reserve: Counter,
    /// Connections closed at once (main pool and reserve full).
    pub refused: Counter,
}

impl ListenStats {
    /// Registers the listener's metrics.
    pub fn register(&self, r: &mut Registry) {
        r.register("kvfabric_http_connections", "HTTP connections open.", self.open.clone());
        r.register(
            "kvfabric_http_connections_reserve",
            "HTTP connections served from the reserve: the connection cap was reached.",
            self.reserve.clone(),
        );
        r.register(
            "kvfabric_http_connections_refused",
            "HTTP connections closed at once: the cap and the reserve were full.",
            self.refused.clone(),
        );
    }
}

/// The live planner reads the frontend's load from its metrics.
impl LoadSource for HttpMetrics {
    fn take_window(&self) -> LoadWindow {
        HttpMetrics::take_window(self)
    }
}
