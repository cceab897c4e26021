//! Every metric the serving layer exposes, named here and nowhere else, encoded with
//! `prometheus-client` (OpenMetrics text: counters end in `_total`, units are part of the
//! names: `_seconds`, `_bytes`).
//!
//! Two kinds of metrics:
//! - the HTTP frontend's own, live ([`HttpMetrics`]: requests by outcome, latency
//!   histograms, tokens), registered in the frontend's registry;
//! - the components' counters, read at scrape time: each component fills its part of a
//!   [`Snapshot`] (engine and store, routed backend, remote prefill, prefill service), and
//!   [`Components`] encodes every family once, with a `worker` label per in-process worker
//!   (`kvfabric up` shows its workers' counters beside the frontend's).
//!
//! Label values are escaped here ([`LabelValue`]): the encoder writes them verbatim.

pub mod class;
pub mod tls;

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

pub use kvfabric_planner::live::{PlannerSnapshot, PoolSnapshot};
pub use kvfabric_planner::window::{LoadSource, LoadWindow, WINDOW_SAMPLES_MAX};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelValue, LabelValueEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use kvfabric_tiers::metrics::{HistogramSnapshot, MetricsSnapshot, LATENCY_BUCKETS_S};

/// Buckets for time to first token and end-to-end latency, seconds.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Buckets for inter-token latency, seconds.
pub const ITL_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28];

/// The content type of [`Components::render`] and the frontend's `/metrics`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A label value, escaped as the exposition format requires (`\\`, `\"`, `\n`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LabelValue(pub String);

impl EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

impl From<&str> for LabelValue {
    fn from(s: &str) -> Self {
        LabelValue(s.to_string())
    }
}

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

type Labels = Vec<(&'static str, LabelValue)>;

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

/// What a worker reports of itself in its load reports ([`kvfabric::contract::WorkerStats`])
/// from its metrics snapshot.
pub fn worker_stats(snap: &Snapshot, draining: bool) -> kvfabric::contract::WorkerStats {
    use kvfabric::contract::WorkerStats;
    let mut out = WorkerStats { draining, ..WorkerStats::default() };
    if let Some(e) = &snap.engine {
        out.running = e.running;
        out.waiting = e.waiting;
        out.prefill_tokens = e.prefill_tokens;
        out.steps = e.steps;
        // The engine counts hits from host, disk and remote; a device-tier hit is none of
        // these.
        out.hit_tokens = [0, e.hit_tokens[0], e.hit_tokens[1], e.hit_tokens[2]];
        if let Some(m) = &e.store {
            out.tiers = tier_use(m);
        }
    }
    out.transfers = transport_totals(&snap.transfers);
    if let Some(p) = &snap.peers {
        out.links = p
            .links
            .iter()
            .filter(|(_, _, r)| *r > 0.0)
            .map(|(n, _, r)| kvfabric::contract::LinkRate {
                peer: n.clone(),
                bytes_per_s: *r as u64,
            })
            .collect();
        out.pulled_bytes = p.pulled_bytes;
    }
    if let Some(r) = &snap.remote_prefill {
        out.remote_prefills = r.remote;
        out.local_prefills = r.local;
        out.prefill_fallbacks = r.fallbacks;
    }
    out.sent_at_ms = now_ms();
    out
}

/// What a KV fabric node (`kvfabric fabric`) reports of itself: role `fabric`, its store's
/// tiers, its agent's transfers.
pub fn fabric_stats(
    store: &kvfabric_tiers::metrics::MetricsSnapshot,
    transfers: &[kvfabric::transfer::TransferCount],
) -> kvfabric::contract::WorkerStats {
    kvfabric::contract::WorkerStats {
        role: "fabric".into(),
        tiers: tier_use(store),
        transfers: transport_totals(transfers),
        sent_at_ms: now_ms(),
        ..Default::default()
    }
}

/// Occupancy per tier (G1–G3; a store holds no G4 of its own).
fn tier_use(m: &kvfabric_tiers::metrics::MetricsSnapshot) -> [kvfabric::contract::TierUse; 4] {
    let t = |used: u32, capacity: u32| kvfabric::contract::TierUse {
        used: u64::from(used),
        capacity: u64::from(capacity),
    };
    [
        t(m.device_used_blocks, m.device_capacity_blocks),
        t(m.host_used_blocks, m.host_capacity_blocks),
        t(m.disk_used_blocks, m.disk_capacity_blocks),
        Default::default(),
    ]
}

/// The transports an agent used, with their totals.
fn transport_totals(
    counts: &[kvfabric::transfer::TransferCount],
) -> Vec<kvfabric::contract::TransportTotals> {
    counts
        .iter()
        .filter(|c| c.done + c.failed + c.timed_out + c.cancelled > 0)
        .map(|c| kvfabric::contract::TransportTotals {
            transport: c.transport.name().to_string(),
            bytes: c.bytes,
            done: c.done,
            failed: c.failed + c.timed_out + c.cancelled,
        })
        .collect()
}

fn now_ms() -> u64 {
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

/// An engine's and its store's counters.
#[derive(Debug, Clone, Default)]
pub struct EngineSnapshot {
    /// Prompt tokens served from host, disk and remote blocks.
    pub hit_tokens: [u64; 3],
    /// Prompt tokens computed.
    pub prefill_tokens: u64,
    /// Blocks stored by the engine.
    pub stored_blocks: u64,
    /// Blocks held in engine memory for want of a host slot.
    pub engine_memory_blocks: u64,
    /// Requests waiting for a batch slot.
    pub waiting: u64,
    /// Requests in the batch.
    pub running: u64,
    /// Engine steps.
    pub steps: u64,
    /// Prompts whose fabric (G4) blocks were computed instead: the link measured too slow.
    pub remote_declined: u64,
    /// Requests whose prefill yielded its batch slot to a more urgent class.
    pub preempted: u64,
    /// Requests whose decode paused, yielding its batch slot to a latency class's request.
    pub preempted_decode: u64,
    /// Requests refused or dropped from the queue as overloaded.
    pub shed: u64,
    /// Requests answered at once because their class's `expire` passed.
    pub expired: u64,
    /// Blocks removed from the store because their tenant was past its quota.
    pub quota_removed: u64,
    /// Blocks moved from host memory to disk because their tenant was past its host quota.
    pub quota_demoted: u64,
    /// Per request: arrival at the engine to the start of its first step.
    pub queue_time: HistogramSnapshot,
    /// Per request: the start of its first step to its first token.
    pub prefill_time: HistogramSnapshot,
    /// The store.
    pub store: Option<MetricsSnapshot>,
}

/// Counters of one class's requests in the queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingClassStats {
    /// The class (`none` for requests without one).
    pub class: String,
    /// Waiting now.
    pub waiting: u64,
    /// Requests that waited before they were sent.
    pub queued: u64,
    /// Refused because the class's queue was full.
    pub shed: u64,
    /// Answered while waiting because their class's `expire` (or their timeout) passed.
    pub expired: u64,
}

/// A routed backend's counters.
#[derive(Debug, Clone, Default)]
pub struct RoutedSnapshot {
    /// Requests routed (attempts).
    pub routed: u64,
    /// Attempts retried on another worker.
    pub retries: u64,
    /// Requests failed after tokens were sent.
    pub failed_mid_stream: u64,
    /// Requests no worker could serve.
    pub no_worker: u64,
    /// Requests refused (429) because every worker tried was overloaded.
    pub overloaded: u64,
    /// Attempts abandoned: no connection, handshake or first token in time.
    pub slow_workers: u64,
    /// Attempts refused by a worker's handshake on the secret.
    pub auth_failures: u64,
    /// Attempts that waited past the first-token limit for a worker still stepping.
    pub long_first_token_waits: u64,
    /// Streams that waited past the inter-token deadline for a worker still stepping.
    pub paused_streams: u64,
    /// Streams ended because the worker sent nothing for the inter-token deadline.
    pub stalled_streams: u64,
    /// Attempts abandoned because their worker left discovery and went silent.
    pub lost_workers: u64,
    /// Requests that waited for a worker of their model to join.
    pub held_for_worker: u64,
    /// Streams moved to another worker after theirs stalled or broke mid-stream.
    pub migrations: u64,
    /// KV events applied to the prefix index.
    pub kv_events: u64,
    /// Gaps in a source's KV event ids.
    pub kv_event_gaps: u64,
    /// KV dumps applied.
    pub kv_dumps: u64,
    /// KV event messages dropped as malformed or of another contract version.
    pub kv_events_malformed: u64,
    /// KV events of workers not in discovery, dropped.
    pub kv_events_unknown_worker: u64,
    /// Requests sent to each worker.
    pub worker_requests: Vec<(String, u64)>,
    /// Requests routed per path their prefix took (compute, local, fabric, pull).
    pub paths: Vec<(&'static str, u64)>,
    /// Each decode worker's prefills as it last reported them: on a prefill worker, on
    /// itself, and remote ones that failed or timed out (then done on itself).
    pub worker_prefills: Vec<(String, [u64; 3])>,
    /// Workers in discovery per model, for every model seen since the frontend started.
    pub model_workers: Vec<(String, u64)>,
    /// The frontend's pending queue, per class.
    pub pending: Vec<PendingClassStats>,
}

/// A decode worker's remote prefill counters.
#[derive(Debug, Clone, Default)]
pub struct RemotePrefillSnapshot {
    /// Prefills done remotely.
    pub remote: u64,
    /// Prefills done locally.
    pub local: u64,
    /// Remote prefills that failed or timed out.
    pub fallbacks: u64,
    /// Prefills of a latency class done locally because that was estimated faster.
    pub latency_local: u64,
    /// KV bytes received from prefill workers.
    pub bytes: u64,
    /// Time waiting for remote prefills, seconds.
    pub wait_seconds: f64,
    /// Remote prefills pending now.
    pub pending: u64,
}

/// A prefill worker's job counters.
#[derive(Debug, Clone, Default)]
pub struct PrefillServiceSnapshot {
    /// Jobs whose blocks were written.
    pub done: u64,
    /// Jobs failed or expired.
    pub failed: u64,
    /// KV bytes written to decode workers.
    pub bytes: u64,
    /// Time in KV writes, seconds.
    pub transfer_seconds: f64,
}

/// An engine attached by `kvfabric attach` (its KV events and health): the attach crate's.
pub use kvfabric_attach::AttachSnapshot;

impl Source for kvfabric_attach::AttachStats {
    fn snapshot(&self, out: &mut Snapshot) {
        out.attach = Some(kvfabric_attach::AttachStats::snapshot(self));
    }
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.attach = Some(kvfabric_attach::AttachStats::health(self));
    }
}

/// What one component shows at scrape time; each fills its part.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// An attached engine.
    pub attach: Option<AttachSnapshot>,
    /// Engine and store.
    pub engine: Option<EngineSnapshot>,
    /// Routed backend.
    pub routed: Option<RoutedSnapshot>,
    /// Remote prefill (decode workers).
    pub remote_prefill: Option<RemotePrefillSnapshot>,
    /// Prefill service (prefill workers).
    pub prefill_service: Option<PrefillServiceSnapshot>,
    /// How the transfers of the component's agent ended, per transport.
    pub transfers: Vec<kvfabric::transfer::TransferCount>,
    /// The agent's RDMA transport: `off`, `unavailable`, `up` or `failed` (None: no agent).
    pub rdma: Option<&'static str>,
    /// Authenticated ports (the agent's, a worker's request port): connections refused or
    /// closed by cause, and open now.
    pub ports: Vec<kvfabric::session::admission::PortSnapshot>,
    /// Peers the agent refused because their metadata named another process's shared memory.
    pub foreign_memory: Option<u64>,
    /// The planner.
    pub planner: Option<PlannerSnapshot>,
    /// The control-plane backends (etcd, NATS) this process uses.
    pub control: Vec<kvfabric::control::ControlStatus>,
    /// Pulls from other workers' stores, and those it served them.
    pub peers: Option<kvfabric_tiers::remote::peers::PeerSnapshot>,
    /// The process's TLS (None: no certificates).
    pub tls: Option<tls::TlsSnapshot>,
}

/// The live planner reads the frontend's load from its metrics.
impl LoadSource for HttpMetrics {
    fn take_window(&self) -> LoadWindow {
        HttpMetrics::take_window(self)
    }
}

/// The live planner's state in `/metrics` (and `/health`).
impl Source for kvfabric_planner::live::PlannerState {
    fn snapshot(&self, out: &mut Snapshot) {
        out.planner = Some(kvfabric_planner::live::PlannerState::snapshot(self));
    }
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.planner = Some(kvfabric_planner::live::PlannerState::health(self));
    }
}

/// A component whose counters are read at scrape time, and whose state is a part of
/// `/health`.
pub trait Source: Send + Sync + std::fmt::Debug {
    /// Fills its part of the snapshot.
    fn snapshot(&self, out: &mut Snapshot);
    /// Fills its part of the health document (none by default).
    fn health(&self, _out: &mut kvfabric::health::Health) {}
}

/// The components of a process, each with its `worker` label (none for the process's own).
#[derive(Debug, Clone, Default)]
pub struct Components {
    parts: Vec<(Option<String>, Arc<dyn Source>)>,
}

impl Components {
    /// No components.
    pub fn new() -> Self {
        Components::default()
    }

    /// Adds a component, labelled `worker="name"` when a name is given.
    pub fn with(mut self, worker: Option<String>, source: Arc<dyn Source>) -> Self {
        self.parts.push((worker, source));
        self
    }

    /// OpenMetrics text of these components alone (a worker's own `/metrics`).
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self.clone()));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

enum Value {
    Int(u64),
    Float(f64),
    Histogram(HistogramSnapshot),
}

/// Encodes one family with the samples of every snapshot; nothing when none has any.
fn family(
    enc: &mut DescriptorEncoder<'_>,
    snaps: &[(Option<LabelValue>, Snapshot)],
    name: &str,
    help: &str,
    unit: Option<Unit>,
    kind: MetricType,
    get: impl Fn(&Snapshot, &mut Vec<(Labels, Value)>),
) -> Result<(), std::fmt::Error> {
    let mut samples = Vec::new();
    for (worker, s) in snaps {
        let mut own = Vec::new();
        get(s, &mut own);
        for (mut labels, v) in own {
            if let Some(w) = worker {
                labels.insert(0, ("worker", w.clone()));
            }
            samples.push((labels, v));
        }
    }
    if samples.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, unit.as_ref(), kind)?;
    for (labels, v) in &samples {
        // A sample without labels is written bare (`name 1`, not `name{} 1`).
        if labels.is_empty() {
            sample(&mut m, kind, v)?;
        } else {
            sample(&mut m.encode_family(labels)?, kind, v)?;
        }
    }
    Ok(())
}

fn sample(
    f: &mut prometheus_client::encoding::MetricEncoder<'_>,
    kind: MetricType,
    v: &Value,
) -> Result<(), std::fmt::Error> {
    match v {
        Value::Int(n) if matches!(kind, MetricType::Counter) => {
            f.encode_counter::<NoLabelSet, _, u64>(n, None)
        }
        Value::Float(x) if matches!(kind, MetricType::Counter) => {
            f.encode_counter::<NoLabelSet, _, f64>(x, None)
        }
        Value::Int(n) => f.encode_gauge(&i64::try_from(*n).unwrap_or(i64::MAX)),
        Value::Float(x) => f.encode_gauge(x),
        Value::Histogram(h) => {
            // Per-bucket counts (the encoder accumulates); f64::MAX is +Inf.
            let mut prev = 0;
            let mut buckets: Vec<(f64, u64)> = LATENCY_BUCKETS_S
                .iter()
                .zip(&h.cumulative)
                .map(|(&b, &c)| {
                    let n = c.saturating_sub(prev);
                    prev = c;
                    (b, n)
                })
                .collect();
            buckets.push((f64::MAX, h.count.saturating_sub(prev)));
            f.encode_histogram::<NoLabelSet>(h.sum_s, h.count, &buckets, None)
        }
    }
}

fn tiered(values: &[(&'static str, u64)]) -> Vec<(Labels, Value)> {
    values.iter().map(|(t, v)| (vec![("tier", LabelValue::from(*t))], Value::Int(*v))).collect()
}

fn plain(v: u64) -> (Labels, Value) {
    (Vec::new(), Value::Int(v))
}

impl Collector for Components {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let snaps: Vec<(Option<LabelValue>, Snapshot)> = self
            .parts
            .iter()
            .map(|(w, src)| {
                let mut s = Snapshot::default();
                src.snapshot(&mut s);
                (w.as_deref().map(LabelValue::from), s)
            })
            .collect();
        let e = &mut enc;
        let s = &snaps;

        engine_and_store(e, s)?;
        transfers(e, s)?;
        attached_engine(e, s)?;
        planner(e, s)?;
        routed(e, s)?;
        remote_prefill(e, s)?;
        prefill_service(e, s)?;
        peer_pulls(e, s)?;
        tls::encode(e, s)?;
        Ok(())
    }
}

/// The engine and its store.
fn engine_and_store(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G, Histogram as H};
    family(
        e,
        s,
        "kvfabric_kv_hit_tokens",
        "Prompt tokens served from KV blocks, per tier.",
        None,
        C,
        |s, o| {
            if let Some(x) = &s.engine {
                let [h, d, r] = x.hit_tokens;
                o.extend(tiered(&[("host", h), ("disk", d), ("remote", r)]));
            }
        },
    )?;
    family(e, s, "kvfabric_prefill_tokens", "Prompt tokens computed.", None, C, |s, o| {
        o.extend(s.engine.as_ref().map(|x| plain(x.prefill_tokens)))
    })?;
    family(e, s, "kvfabric_kv_stored_blocks", "Blocks stored by the engine.", None, C, |s, o| {
        o.extend(s.engine.as_ref().map(|x| plain(x.stored_blocks)))
    })?;
    family(
        e,
        s,
        "kvfabric_kv_engine_memory_blocks",
        "KV blocks held in engine memory because the host tier had no slot to spare (a host tier too small for the running batch).",
        None,
        C,
        |s, o| o.extend(s.engine.as_ref().map(|x| plain(x.engine_memory_blocks))),
    )?;
    family(e, s, "kvfabric_queue_depth", "Requests waiting for a batch slot.", None, G, |s, o| {
        o.extend(s.engine.as_ref().map(|x| plain(x.waiting)))
    })?;
    family(e, s, "kvfabric_running_requests", "Requests in the batch.", None, G, |s, o| {
        o.extend(s.engine.as_ref().map(|x| plain(x.running)))
    })?;
    family(e, s, "kvfabric_engine_steps", "Engine steps.", None, C, |s, o| {
        o.extend(s.engine.as_ref().map(|x| plain(x.steps)))
    })?;
    family(
        e,
        s,
        "kvfabric_remote_tier_declined",
        "Prompts whose blocks on the fabric (G4) were computed instead of fetched: over the link, at the rate measured, they would have come later.",
        None,
        C,
        |s, o| o.extend(s.engine.as_ref().map(|x| plain(x.remote_declined))),
    )?;
    family(
        e,
        s,
        "kvfabric_engine_preempted",
        "Requests that yielded their batch slot to a more urgent service class, by what they were doing (phase: prefill, or decode, paused for a latency class that would miss its TTFT target); they resume from their stored blocks.",
        None,
        C,
        |s, o| {
            if let Some(x) = &s.engine {
                for (phase, n) in [("prefill", x.preempted), ("decode", x.preempted_decode)] {
                    o.push((vec![("phase", LabelValue::from(phase))], Value::Int(n)));
                }
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_engine_shed",
        "Requests the engine refused or dropped from its queue as overloaded (429): the queue was full, or a more urgent class needed the place.",
        None,
        C,
        |s, o| o.extend(s.engine.as_ref().map(|x| plain(x.shed))),
    )?;
    family(
        e,
        s,
        "kvfabric_engine_expired",
        "Requests answered at once, not computed, because their service class's expire passed while they waited.",
        None,
        C,
        |s, o| o.extend(s.engine.as_ref().map(|x| plain(x.expired))),
    )?;
    family(
        e,
        s,
        "kvfabric_engine_tenant_quota_removed_blocks",
        "KV blocks removed from the store because their tenant was past its store or disk quota (its own least recently used; past its host quota where there is no disk).",
        None,
        C,
        |s, o| o.extend(s.engine.as_ref().map(|x| plain(x.quota_removed))),
    )?;
    family(
        e,
        s,
        "kvfabric_engine_tenant_quota_demoted_blocks",
        "KV blocks moved from host memory to disk because their tenant was past its host quota (its own least recently used).",
        None,
        C,
        |s, o| o.extend(s.engine.as_ref().map(|x| plain(x.quota_demoted))),
    )?;
    family(
        e,
        s,
        "kvfabric_engine_queue_time",
        "Per request, from its arrival at the engine to the start of its first step: a batch slot, its cached blocks' import, and the step in flight.",
        Some(Unit::Seconds),
        H,
        |s, o| {
            o.extend(s.engine.as_ref().map(|x| (Vec::new(), Value::Histogram(x.queue_time.clone()))))
        },
    )?;
    family(
        e,
        s,
        "kvfabric_engine_prefill_time",
        "Per request, from the start of its first step to its first token.",
        Some(Unit::Seconds),
        H,
        |s, o| {
            o.extend(
                s.engine.as_ref().map(|x| (Vec::new(), Value::Histogram(x.prefill_time.clone()))),
            )
        },
    )?;
    let store = |s: &Snapshot| s.engine.as_ref().and_then(|x| x.store.clone());
    family(
        e,
        s,
        "kvfabric_kv_block_hits",
        "Block lookups that hit, per tier.",
        None,
        C,
        |s, o| {
            if let Some(t) = store(s) {
                o.extend(tiered(&[("host", t.host_hits), ("disk", t.disk_hits)]));
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_kv_block_misses",
        "Block lookups that missed, per tier.",
        None,
        C,
        |s, o| {
            if let Some(t) = store(s) {
                o.extend(tiered(&[("host", t.host_misses), ("disk", t.disk_misses)]));
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_kv_evicted_blocks",
        "Blocks evicted to make room, per tier (host: moved down, or dropped with nothing below).",
        None,
        C,
        |s, o| {
            if let Some(t) = store(s) {
                o.extend(tiered(&[
                    ("host", t.host_evicted_blocks),
                    ("disk", t.disk_evicted_blocks),
                ]));
            }
        },
    )?;
    family(e, s, "kvfabric_kv_blocks", "Blocks held, per tier.", None, G, |s, o| {
        if let Some(t) = store(s) {
            let (h, d) = (t.host_used_blocks.into(), t.disk_used_blocks.into());
            o.extend(tiered(&[("host", h), ("disk", d)]));
            if t.device_capacity_blocks > 0 {
                o.extend(tiered(&[("device", t.device_used_blocks.into())]));
            }
        }
    })?;
    family(e, s, "kvfabric_kv_capacity_blocks", "Block capacity, per tier.", None, G, |s, o| {
        if let Some(t) = store(s) {
            let (h, d) = (t.host_capacity_blocks.into(), t.disk_capacity_blocks.into());
            o.extend(tiered(&[("host", h), ("disk", d)]));
            if t.device_capacity_blocks > 0 {
                o.extend(tiered(&[("device", t.device_capacity_blocks.into())]));
            }
        }
    })?;
    family(
        e,
        s,
        "kvfabric_kv_offload",
        "Bytes offloaded host to disk.",
        Some(Unit::Bytes),
        C,
        |s, o| o.extend(store(s).map(|t| plain(t.offload_bytes))),
    )?;
    family(
        e,
        s,
        "kvfabric_kv_onboard",
        "Bytes onboarded disk to host.",
        Some(Unit::Bytes),
        C,
        |s, o| o.extend(store(s).map(|t| plain(t.onboard_bytes))),
    )?;
    family(
        e,
        s,
        "kvfabric_kv_offload_errors",
        "Offloads that failed (disk full, I/O error); the block stayed in host memory.",
        None,
        C,
        |s, o| o.extend(store(s).map(|t| plain(t.offload_errors))),
    )?;
    family(
        e,
        s,
        "kvfabric_kv_disk_corrupt_blocks",
        "Blocks found corrupt on disk and dropped.",
        None,
        C,
        |s, o| o.extend(store(s).map(|t| plain(t.disk_corrupt_blocks))),
    )?;
    family(
        e,
        s,
        "kvfabric_kv_disk_io_backend",
        "The disk tier's I/O backend now (1 for the one in use: io_uring, or pread after a fallback).",
        None,
        G,
        |s, o| {
            if let Some(b) = store(s).and_then(|t| t.disk_io_backend) {
                o.push((vec![("backend", b.into())], Value::Int(1)));
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_kv_offload_duration",
        "Time to write one block host to disk.",
        Some(Unit::Seconds),
        H,
        |s, o| o.extend(store(s).map(|t| (Vec::new(), Value::Histogram(t.offload_latency)))),
    )?;
    family(
        e,
        s,
        "kvfabric_kv_onboard_duration",
        "Time to read one block disk to host.",
        Some(Unit::Seconds),
        H,
        |s, o| o.extend(store(s).map(|t| (Vec::new(), Value::Histogram(t.onboard_latency)))),
    )?;
    Ok(())
}

/// The agent's transfers and ports.
fn transfers(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    family(
        e,
        s,
        "kvfabric_transfers",
        "Transfers ended, per transport and outcome (done, failed, timed_out, cancelled).",
        None,
        C,
        |s, o| {
            for c in &s.transfers {
                for (outcome, n) in [
                    ("done", c.done),
                    ("failed", c.failed),
                    ("timed_out", c.timed_out),
                    ("cancelled", c.cancelled),
                ] {
                    let labels = vec![
                        ("transport", LabelValue::from(c.transport.name())),
                        ("outcome", LabelValue::from(outcome)),
                    ];
                    o.push((labels, Value::Int(n)));
                }
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_transfer",
        "Bytes of completed transfers, per transport.",
        Some(Unit::Bytes),
        C,
        |s, o| {
            for c in &s.transfers {
                let labels = vec![("transport", LabelValue::from(c.transport.name()))];
                o.push((labels, Value::Int(c.bytes)));
            }
        },
    )?;

    family(
        e,
        s,
        "kvfabric_port_connections_closed",
        "Connections an authenticated port (agent, request) refused or closed, by reason: \
         busy (at its limit), evicted (a newer connection took a handshake's place), \
         handshake (failed: wrong secret, garbage, timeout), peer_limit, idle.",
        None,
        C,
        |s, o| {
            for p in &s.ports {
                for cause in kvfabric::session::admission::Cause::ALL {
                    let labels = vec![
                        ("port", LabelValue::from(p.port)),
                        ("reason", LabelValue::from(cause.label())),
                    ];
                    o.push((labels, Value::Int(p.count(cause))));
                }
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_port_connections",
        "Connections open on an authenticated port, in the handshake or authenticated.",
        None,
        G,
        |s, o| {
            for p in &s.ports {
                for (state, n) in [("handshake", p.pending), ("authenticated", p.admitted)] {
                    let labels = vec![
                        ("port", LabelValue::from(p.port)),
                        ("state", LabelValue::from(state)),
                    ];
                    o.push((labels, Value::Int(n)));
                }
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_agent_peers_refused",
        "Peers refused because their metadata named shared memory that is not theirs \
         (another deployment's, another agent's).",
        None,
        C,
        |s, o| o.extend(s.foreign_memory.map(plain)),
    )?;
    family(
        e,
        s,
        "kvfabric_rdma_state",
        "The agent's RDMA transport (1 on its state): off, unavailable (no device), up, or \
         failed (its device went away: transfers between hosts go over TCP).",
        None,
        G,
        |s, o| {
            if let Some(now) = s.rdma {
                for state in ["off", "unavailable", "up", "failed"] {
                    let labels = vec![("state", LabelValue::from(state))];
                    o.push((labels, Value::Int(u64::from(state == now))));
                }
            }
        },
    )?;
    control_plane(e, s)
}

/// The control-plane backends a process uses, by `component` (etcd, nats).
fn control_plane(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> Result<(), std::fmt::Error> {
    type Get = fn(&kvfabric::control::ControlStatus) -> Value;
    let families: [(&str, &str, Option<Unit>, MetricType, Get); 6] = [
        (
            "kvfabric_control_plane_up",
            "Whether the backend answered the last time this process asked (1) or not (0).",
            None,
            MetricType::Gauge,
            |c| Value::Int(u64::from(c.connected)),
        ),
        (
            "kvfabric_control_plane_contact_age",
            "Time since the backend last answered this process.",
            Some(Unit::Seconds),
            MetricType::Gauge,
            |c| Value::Float(c.since_contact_s),
        ),
        (
            "kvfabric_control_plane_reconnects",
            "Times the backend came back after an outage.",
            None,
            MetricType::Counter,
            |c| Value::Int(c.reconnects),
        ),
        (
            "kvfabric_control_plane_lease_renewals_failed",
            "Lease keep-alives that failed (etcd): past the lease's TTL the instance leaves \
             discovery.",
            None,
            MetricType::Counter,
            |c| Value::Int(c.lease_renewals_failed),
        ),
        (
            "kvfabric_control_plane_events_behind",
            "Events received from the bus (NATS) that this process has not read yet.",
            None,
            MetricType::Gauge,
            |c| Value::Int(c.events_behind),
        ),
        (
            "kvfabric_control_plane_events_dropped",
            "Events the bus client (NATS) dropped because this process read them too slowly.",
            None,
            MetricType::Counter,
            |c| Value::Int(c.events_dropped),
        ),
    ];
    for (name, help, unit, kind, get) in families {
        family(e, s, name, help, unit, kind, |s, o| {
            for c in s.control.iter().filter(|c| c.is_remote()) {
                o.push((vec![("component", LabelValue::from(c.backend))], get(c)));
            }
        })?;
    }
    Ok(())
}

/// The control-plane backends a process uses, for its `/metrics` and `/health`.
#[derive(Clone)]
pub struct ControlSource {
    discovery: Arc<dyn kvfabric::control::Discovery>,
    bus: Arc<dyn kvfabric::control::EventBus>,
}

impl std::fmt::Debug for ControlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlSource").finish_non_exhaustive()
    }
}

impl ControlSource {
    /// The process's discovery and event bus.
    pub fn new(
        discovery: Arc<dyn kvfabric::control::Discovery>,
        bus: Arc<dyn kvfabric::control::EventBus>,
    ) -> Self {
        ControlSource { discovery, bus }
    }

    /// Their state now: discovery's, then the bus's.
    pub fn statuses(&self) -> Vec<kvfabric::control::ControlStatus> {
        vec![self.discovery.status(), self.bus.status()]
    }
}

impl Source for ControlSource {
    fn snapshot(&self, out: &mut Snapshot) {
        out.control.extend(self.statuses());
    }
    /// The backends outside this process (embedded ones are always up and left out).
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.control_plane.extend(
            self.statuses()
                .iter()
                .filter(|c| c.is_remote())
                .map(kvfabric::health::ControlHealth::from),
        );
    }
}

/// An attached engine.
fn attached_engine(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    let at = |s: &Snapshot| s.attach.clone();
    for (name, help, kind, get) in [
        (
            "kvfabric_attach_event_batches",
            "The engine's KV event batches applied.",
            C,
            (|a: &AttachSnapshot| a.batches) as fn(&AttachSnapshot) -> u64,
        ),
        ("kvfabric_attach_kv_events", "KV events published for the engine.", C, |a| a.events),
        (
            "kvfabric_attach_events_malformed",
            "Engine event payloads or messages that are not the engine's shape.",
            C,
            |a| a.malformed,
        ),
        (
            "kvfabric_attach_replay_failures",
            "Replays of the engine's lost events that failed (refused, timed out, broken off).",
            C,
            |a| a.replay_failures,
        ),
        (
            "kvfabric_attach_resets",
            "Times the engine's blocks were dropped because its events were lost for good.",
            C,
            |a| a.resets,
        ),
        ("kvfabric_attach_dumps", "Dumps of the engine's blocks published.", C, |a| a.dumps),
        (
            "kvfabric_attach_failed_health_checks",
            "Health checks of the engine that failed.",
            C,
            |a| a.failed_polls,
        ),
        ("kvfabric_attach_registered", "1 while the engine is registered in discovery.", G, |a| {
            a.registered
        }),
        ("kvfabric_attach_engine_blocks", "Blocks the engine holds, as its events say.", G, |a| {
            a.blocks
        }),
    ] {
        family(e, s, name, help, None, kind, |s, o| o.extend(at(s).map(|a| plain(get(&a)))))?;
    }
    family(
        e,
        s,
        "kvfabric_attach_skipped_blocks",
        "Engine blocks the router cannot key, by reason.",
        None,
        C,
        |s, o| {
            if let Some(a) = at(s) {
                for (reason, n) in a.skipped {
                    o.push((vec![("reason", LabelValue::from(reason))], Value::Int(n)));
                }
            }
        },
    )?;
    Ok(())
}

/// The planner.
fn planner(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    let pl = |s: &Snapshot| s.planner.clone();
    for (name, help, get) in [
        (
            "kvfabric_planner_workers",
            "Workers serving (not draining).",
            (|p: &PlannerSnapshot| p.workers) as fn(&PlannerSnapshot) -> u64,
        ),
        ("kvfabric_planner_desired_workers", "Workers the last decision asked for.", |p| p.desired),
        ("kvfabric_planner_draining_workers", "Workers draining.", |p| p.draining),
    ] {
        family(e, s, name, help, None, G, |s, o| o.extend(pl(s).map(|p| plain(get(&p)))))?;
    }
    for (name, help, get) in [
        (
            "kvfabric_planner_observed_request_rate",
            "Requests per second over the last interval.",
            (|p: &PlannerSnapshot| p.observed_rate) as fn(&PlannerSnapshot) -> f64,
        ),
        (
            "kvfabric_planner_predicted_request_rate",
            "Requests per second predicted for the next interval.",
            |p| p.predicted_rate,
        ),
        (
            "kvfabric_planner_observed_ttft_seconds",
            "Time to first token at the target's quantile over the last interval.",
            |p| p.observed_ttft_s,
        ),
        (
            "kvfabric_planner_observed_itl_seconds",
            "Inter-token latency at the target's quantile over the last interval.",
            |p| p.observed_itl_s,
        ),
    ] {
        family(e, s, name, help, None, G, |s, o| {
            o.extend(pl(s).map(|p| (Vec::new(), Value::Float(get(&p)))))
        })?;
    }
    family(e, s, "kvfabric_planner_decisions", "Planner decisions by action.", None, C, |s, o| {
        if let Some(p) = pl(s) {
            for (action, n) in ["up", "down", "hold"].iter().zip(p.decisions) {
                o.push((vec![("action", LabelValue::from(*action))], Value::Int(n)));
            }
        }
    })?;
    family(
        e,
        s,
        "kvfabric_planner_pool_workers",
        "Workers of each of the planner's pools: serving, desired by the last decision, draining.",
        None,
        G,
        |s, o| {
            for p in pl(s).map(|p| p.pools).unwrap_or_default() {
                for (state, n) in
                    [("serving", p.workers), ("desired", p.desired), ("draining", p.draining)]
                {
                    let labels = vec![
                        ("pool", LabelValue::from(p.pool)),
                        ("state", LabelValue::from(state)),
                    ];
                    o.push((labels, Value::Int(n)));
                }
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_planner_scale_failures",
        "Scaling actions that failed (a worker that did not start or stop).",
        None,
        C,
        |s, o| o.extend(pl(s).map(|p| plain(p.scale_failures))),
    )?;
    Ok(())
}

/// The routed backend.
fn routed(e: &mut DescriptorEncoder<'_>, s: &[(Option<LabelValue>, Snapshot)]) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    let routed = |s: &Snapshot| s.routed.clone();
    for (name, help, get) in [
        (
            "kvfabric_frontend_routed",
            "Requests routed to workers (attempts).",
            (|r: &RoutedSnapshot| r.routed) as fn(&RoutedSnapshot) -> u64,
        ),
        ("kvfabric_frontend_retries", "Attempts retried on another worker.", |r| r.retries),
        (
            "kvfabric_frontend_lost_worker_attempts",
            "Attempts abandoned because their worker left discovery and went silent (a dead or cut-off host): retried, or the stream moved.",
            |r| r.lost_workers,
        ),
        (
            "kvfabric_frontend_held_for_worker",
            "Requests that waited for a worker of their model to join (every worker of it had left lately: a restart).",
            |r| r.held_for_worker,
        ),
        ("kvfabric_frontend_failed_mid_stream", "Requests failed after tokens were sent.", |r| {
            r.failed_mid_stream
        }),
        ("kvfabric_frontend_no_worker", "Requests no worker could serve.", |r| r.no_worker),
        (
            "kvfabric_frontend_overloaded",
            "Requests refused with 429 and Retry-After: every worker tried was overloaded.",
            |r| r.overloaded,
        ),
        (
            "kvfabric_frontend_unresponsive_workers",
            "Attempts abandoned: no connection, handshake or first token in time.",
            |r| r.slow_workers,
        ),
        (
            "kvfabric_frontend_long_first_token_waits",
            "Attempts that waited past the first-token limit for a worker whose engine kept \
             stepping (a long queue there, not a frozen worker).",
            |r| r.long_first_token_waits,
        ),
        (
            "kvfabric_frontend_paused_streams",
            "Streams that sent nothing for the inter-token deadline while their worker's \
             engine kept stepping (preempted for a more urgent class, not stalled): waited for.",
            |r| r.paused_streams,
        ),
        (
            "kvfabric_frontend_worker_auth_failures",
            "Attempts whose worker refused the frontend's secret (or proved another).",
            |r| r.auth_failures,
        ),
        (
            "kvfabric_frontend_stalled_streams",
            "Streams ended because their worker sent nothing for the inter-token deadline.",
            |r| r.stalled_streams,
        ),
        (
            "kvfabric_frontend_stream_migrations",
            "Streams moved to another worker after theirs stalled or broke mid-stream.",
            |r| r.migrations,
        ),
        ("kvfabric_frontend_kv_events", "KV events applied to the prefix index.", |r| r.kv_events),
        ("kvfabric_frontend_kv_event_gaps", "Gaps in a source's KV event ids.", |r| {
            r.kv_event_gaps
        }),
        ("kvfabric_frontend_kv_dumps", "KV dumps applied to the prefix index.", |r| r.kv_dumps),
        (
            "kvfabric_frontend_kv_events_malformed",
            "KV event messages dropped: malformed, or of another contract version.",
            |r| r.kv_events_malformed,
        ),
        (
            "kvfabric_frontend_kv_events_unknown_worker",
            "KV events of workers not in discovery, dropped.",
            |r| r.kv_events_unknown_worker,
        ),
    ] {
        family(e, s, name, help, None, C, |s, o| o.extend(routed(s).map(|r| plain(get(&r)))))?;
    }
    family(
        e,
        s,
        "kvfabric_router_path",
        "Requests routed, by the path the router chose for their prefix: computed, the worker's own cache, the fabric, or pulled from another worker's store.",
        None,
        C,
        |s, o| {
            if let Some(r) = &s.routed {
                o.extend(r.paths.iter().map(|(p, n)| (vec![("path", (*p).into())], Value::Int(*n))));
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_frontend_worker_requests",
        "Requests sent to each worker.",
        None,
        C,
        |s, o| {
            if let Some(r) = &s.routed {
                o.extend(
                    r.worker_requests
                        .iter()
                        .map(|(w, n)| (vec![("to_worker", LabelValue(w.clone()))], Value::Int(*n))),
                );
            }
        },
    )?;
    type PendingOf = fn(&PendingClassStats) -> u64;
    for (name, help, kind, get) in [
        (
            "kvfabric_frontend_pending",
            "Requests per service class waiting in the frontend's queue for a worker slot.",
            G,
            (|p| p.waiting) as PendingOf,
        ),
        (
            "kvfabric_frontend_pending_queued",
            "Requests per service class that waited in the frontend's queue before they were sent.",
            C,
            |p| p.queued,
        ),
        (
            "kvfabric_frontend_pending_shed",
            "Requests per service class refused (429) because the class's queue was full.",
            C,
            |p| p.shed,
        ),
        (
            "kvfabric_frontend_pending_expired",
            "Requests per service class answered while they waited: their expire or timeout passed.",
            C,
            |p| p.expired,
        ),
    ] {
        family(e, s, name, help, None, kind, |s, o| {
            if let Some(r) = &s.routed {
                o.extend(r.pending.iter().map(|p| {
                    (vec![("class", LabelValue(p.class.clone()))], Value::Int(get(p)))
                }));
            }
        })?;
    }
    family(
        e,
        s,
        "kvfabric_frontend_worker_prefills",
        "Prefills of each decode worker by where they ran, as it reports them.",
        None,
        C,
        |s, o| {
            for (w, [remote, local, _]) in s.routed.iter().flat_map(|r| &r.worker_prefills) {
                for (at, n) in [("remote", remote), ("local", local)] {
                    let labels = vec![("to_worker", LabelValue(w.clone())), ("where", at.into())];
                    o.push((labels, Value::Int(*n)));
                }
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_frontend_worker_prefill_fallbacks",
        "Remote prefills of each decode worker that failed or timed out (then prefilled on the decode worker), as it reports them.",
        None,
        C,
        |s, o| {
            for (w, [.., fallbacks]) in s.routed.iter().flat_map(|r| &r.worker_prefills) {
                o.push((vec![("to_worker", LabelValue(w.clone()))], Value::Int(*fallbacks)));
            }
        },
    )?;
    family(e, s, "kvfabric_frontend_workers", "Workers known.", None, G, |s, o| {
        o.extend(s.routed.as_ref().map(|r| plain(r.worker_requests.len() as u64)))
    })?;
    family(
        e,
        s,
        "kvfabric_frontend_model_workers",
        "Workers serving each model seen since the frontend started (0: none left).",
        None,
        G,
        |s, o| {
            if let Some(r) = &s.routed {
                o.extend(
                    r.model_workers
                        .iter()
                        .map(|(m, n)| (vec![("model", LabelValue(m.clone()))], Value::Int(*n))),
                );
            }
        },
    )?;
    Ok(())
}

/// Remote prefill, decode side.
fn remote_prefill(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    let rp = |s: &Snapshot| s.remote_prefill.clone();
    family(e, s, "kvfabric_prefills", "Prefills by where they ran.", None, C, |s, o| {
        if let Some(p) = rp(s) {
            o.push((vec![("where", "remote".into())], Value::Int(p.remote)));
            o.push((vec![("where", "local".into())], Value::Int(p.local)));
        }
    })?;
    family(
        e,
        s,
        "kvfabric_remote_prefill_fallbacks",
        "Remote prefills that failed or timed out.",
        None,
        C,
        |s, o| o.extend(rp(s).map(|p| plain(p.fallbacks))),
    )?;
    family(
        e,
        s,
        "kvfabric_prefill_latency_local",
        "Prefills of a latency class done on the decode worker because that was estimated faster than the prefill pool.",
        None,
        C,
        |s, o| o.extend(rp(s).map(|p| plain(p.latency_local))),
    )?;
    family(
        e,
        s,
        "kvfabric_remote_prefill",
        "KV bytes written by prefill workers.",
        Some(Unit::Bytes),
        C,
        |s, o| o.extend(rp(s).map(|p| plain(p.bytes))),
    )?;
    family(
        e,
        s,
        "kvfabric_remote_prefill_wait",
        "Time waiting for remote prefills.",
        Some(Unit::Seconds),
        C,
        |s, o| o.extend(rp(s).map(|p| (Vec::new(), Value::Float(p.wait_seconds)))),
    )?;
    family(e, s, "kvfabric_prefill_queue_depth", "Remote prefills pending.", None, G, |s, o| {
        o.extend(rp(s).map(|p| plain(p.pending)))
    })?;
    Ok(())
}

/// Pulls from peers' stores (one KV pool across workers), and the pulls served to them.
fn peer_pulls(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    let ps = |s: &Snapshot| s.peers.clone();
    family(
        e,
        s,
        "kvfabric_peer_pulls",
        "Pulls of prefix blocks from another worker's store.",
        None,
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.pulls))),
    )?;
    family(
        e,
        s,
        "kvfabric_peer_pulled_blocks",
        "Blocks pulled from other workers' stores.",
        None,
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.pulled_blocks))),
    )?;
    family(
        e,
        s,
        "kvfabric_peer_pulled",
        "Bytes pulled from other workers' stores, per peer.",
        Some(Unit::Bytes),
        C,
        |s, o| {
            if let Some(p) = ps(s) {
                o.extend(
                    p.links
                        .iter()
                        .map(|(n, b, _)| (vec![("peer", LabelValue(n.clone()))], Value::Int(*b))),
                );
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_peer_link_rate",
        "The rate measured pulling from a peer, bytes per second (what routers price pulls at).",
        None,
        G,
        |s, o| {
            if let Some(p) = ps(s) {
                o.extend(
                    p.links
                        .iter()
                        .map(|(n, _, r)| (vec![("peer", LabelValue(n.clone()))], Value::Float(*r))),
                );
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_peer_pull_failures",
        "Pulls that brought fewer blocks than asked (the rest was computed), by reason.",
        None,
        C,
        |s, o| {
            if let Some(p) = ps(s) {
                o.extend(
                    p.failures.iter().map(|(r, n)| (vec![("reason", (*r).into())], Value::Int(*n))),
                );
            }
        },
    )?;
    family(
        e,
        s,
        "kvfabric_peers_known",
        "Other workers' stores this worker can pull from.",
        None,
        G,
        |s, o| o.extend(ps(s).map(|p| plain(p.known))),
    )?;
    family(
        e,
        s,
        "kvfabric_peer_served_blocks",
        "Blocks this worker's store served to peers' pulls.",
        None,
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.served_blocks))),
    )?;
    family(
        e,
        s,
        "kvfabric_peer_served",
        "Bytes this worker's store served to peers' pulls.",
        Some(Unit::Bytes),
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.served_bytes))),
    )?;
    family(
        e,
        s,
        "kvfabric_peer_served_busy",
        "Peers' pulls served in part or refused: over this worker's serving share.",
        None,
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.served_busy))),
    )?;
    Ok(())
}

/// The prefill service, prefill side.
fn prefill_service(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::Counter as C;
    let ps = |s: &Snapshot| s.prefill_service.clone();
    family(
        e,
        s,
        "kvfabric_prefill_jobs_done",
        "Prefill jobs whose blocks were written.",
        None,
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.done))),
    )?;
    family(
        e,
        s,
        "kvfabric_prefill_jobs_failed",
        "Prefill jobs failed or expired.",
        None,
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.failed))),
    )?;
    family(
        e,
        s,
        "kvfabric_prefill_sent",
        "KV bytes written to decode workers.",
        Some(Unit::Bytes),
        C,
        |s, o| o.extend(ps(s).map(|p| plain(p.bytes))),
    )?;
    family(
        e,
        s,
        "kvfabric_prefill_transfer",
        "Time in KV writes.",
        Some(Unit::Seconds),
        C,
        |s, o| o.extend(ps(s).map(|p| (Vec::new(), Value::Float(p.transfer_seconds)))),
    )?;
    Ok(())
}

/// The registry of an HTTP frontend: its own metrics and its components'.
pub fn registry(http: &HttpMetrics, components: Components) -> Registry {
    let mut r = Registry::default();
    http.register(&mut r);
    r.register_collector(Box::new(components));
    r
}

/// OpenMetrics text of a registry.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(Snapshot);

    impl Source for Fixed {
        fn snapshot(&self, out: &mut Snapshot) {
            *out = self.0.clone();
        }
    }

    fn engine(hit: u64) -> Snapshot {
        Snapshot {
            engine: Some(EngineSnapshot { hit_tokens: [hit, 0, 0], ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn every_family_once_with_a_label_per_worker_escaped() {
        let c = Components::new()
            .with(
                None,
                Arc::new(Fixed(Snapshot {
                    routed: Some(RoutedSnapshot::default()),
                    ..Default::default()
                })),
            )
            .with(Some("w-0".into()), Arc::new(Fixed(engine(5))))
            .with(Some("evil\"\\\nname".into()), Arc::new(Fixed(engine(7))));
        let text = c.render();
        assert_eq!(text.matches("# TYPE kvfabric_kv_hit_tokens counter").count(), 1, "{text}");
        assert!(
            text.contains("kvfabric_kv_hit_tokens_total{worker=\"w-0\",tier=\"host\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "kvfabric_kv_hit_tokens_total{worker=\"evil\\\"\\\\\\nname\",tier=\"host\"} 7\n"
            ),
            "{text}"
        );
        assert!(text.contains("kvfabric_frontend_routed_total 0\n"), "{text}");
        assert!(!text.contains("kvfabric_prefill_jobs_done"), "no prefill service: no family");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn units_and_histograms_follow_the_conventions() {
        let h = HttpMetrics::default();
        h.first_token(Duration::from_millis(5));
        h.first_token(Duration::from_millis(50));
        h.first_token(Duration::from_secs(100));
        h.tokens(10, 3, [0, 3, 1, 0]);
        h.duration(Duration::from_millis(20));
        h.request(Outcome::Ok);
        let store = MetricsSnapshot {
            offload_bytes: 4096,
            device_used_blocks: 3,
            device_capacity_blocks: 8,
            ..Default::default()
        };
        let snap = Snapshot {
            engine: Some(EngineSnapshot { store: Some(store), ..Default::default() }),
            prefill_service: Some(PrefillServiceSnapshot {
                transfer_seconds: 1.5,
                ..Default::default()
            }),
            transfers: vec![kvfabric::transfer::TransferCount {
                transport: kvfabric::transfer::TransportKind::Cuda,
                done: 3,
                failed: 1,
                timed_out: 0,
                cancelled: 0,
                bytes: 1 << 20,
            }],
            rdma: Some("failed"),
            ..Default::default()
        };
        let text = encode(&registry(&h, Components::new().with(None, Arc::new(Fixed(snap)))));
        for line in [
            "kvfabric_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n",
            "kvfabric_time_to_first_token_seconds_bucket{le=\"0.05\"} 2\n",
            "kvfabric_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n",
            "kvfabric_time_to_first_token_seconds_count 3\n",
            "kvfabric_requests_total{outcome=\"ok\"} 1\n",
            "kvfabric_prompt_tokens_total 10\n",
            "kvfabric_cached_prompt_tokens_total{tier=\"device\"} 0\n",
            "kvfabric_cached_prompt_tokens_total{tier=\"host\"} 3\n",
            "kvfabric_cached_prompt_tokens_total{tier=\"disk\"} 1\n",
            "kvfabric_cached_prompt_tokens_total{tier=\"remote\"} 0\n",
            "kvfabric_kv_offload_bytes_total 4096\n",
            "kvfabric_prefill_transfer_seconds_total 1.5\n",
            "# UNIT kvfabric_kv_offload_bytes bytes\n",
            "kvfabric_kv_onboard_duration_seconds_bucket{le=\"+Inf\"} 0\n",
            "kvfabric_kv_blocks{tier=\"device\"} 3\n",
            "kvfabric_kv_capacity_blocks{tier=\"device\"} 8\n",
            "kvfabric_transfers_total{transport=\"cuda\",outcome=\"done\"} 3\n",
            "kvfabric_transfers_total{transport=\"cuda\",outcome=\"failed\"} 1\n",
            "kvfabric_transfer_bytes_total{transport=\"cuda\"} 1048576\n",
            "kvfabric_rdma_state{state=\"up\"} 0\n",
            "kvfabric_rdma_state{state=\"failed\"} 1\n",
        ] {
            assert!(text.contains(line), "{line:?} missing in\n{text}");
        }
    }

    /// Quantiles from bucket counts, computed by hand: 10 observations in (0, 1], 30 in
    /// (1, 2], none in (2, 4], 10 above 4.
    #[test]
    fn bucket_quantiles_interpolate_within_their_bucket() {
        let bounds = [1.0, 2.0, 4.0];
        let counts = [10, 30, 0, 10];
        // Rank 25 of 50: 15 into the (1, 2] bucket of 30.
        assert_eq!(bucket_quantile(&counts, &bounds, 0.5), Some(1.5));
        // Rank 5: half of the first bucket.
        assert_eq!(bucket_quantile(&counts, &bounds, 0.1), Some(0.5));
        // Rank 40 ends the second bucket exactly.
        assert_eq!(bucket_quantile(&counts, &bounds, 0.8), Some(2.0));
        // Above every bound: the last bound.
        assert_eq!(bucket_quantile(&counts, &bounds, 0.99), Some(4.0));
        assert_eq!(bucket_quantile(&[0, 0, 0, 0], &bounds, 0.5), None);
        // The same observations through HttpMetrics.
        let m = HttpMetrics::default();
        for ms in [0.5, 0.7, 3.0, 40.0] {
            m.first_token(Duration::from_secs_f64(ms / 1e3));
        }
        let t = m.totals();
        assert_eq!(t.ttft_buckets.iter().sum::<u64>(), 4);
        assert_eq!(t.ttft_buckets[0], 2, "two at most 1 ms");
        assert_eq!(t.ttft_buckets[1], 1, "one in (1, 5] ms");
        assert_eq!(t.ttft_buckets[4], 1, "one in (25, 50] ms");
        assert_eq!(bucket_quantile(&t.ttft_buckets, LATENCY_BUCKETS, 0.5), Some(0.001));
    }

    /// The planner's window: what was counted since the last take, then a fresh one; past
    /// the sample cap, a uniform sample of all latencies (the quantiles of a window of a
    /// million ITLs, half of 1 ms and half of 9 ms, stay at 1 and 9 ms).
    #[test]
    fn load_windows() {
        let m = HttpMetrics::default();
        m.request(Outcome::Ok);
        assert_eq!(m.take_window().requests, 0, "nothing is windowed before the first take");
        m.arrival();
        m.arrival();
        m.no_first_token(Duration::from_millis(700));
        m.request(Outcome::Ok);
        m.request(Outcome::ServerError);
        m.request(Outcome::ClientError);
        m.tokens(100, 10, [0, 30, 0, 10]);
        m.first_token(Duration::from_millis(5));
        for i in 0..1_000_000u64 {
            m.inter_token(Duration::from_millis(if i < 500_000 { 1 } else { 9 }));
        }
        let w = m.take_window();
        assert_eq!((w.requests, w.errors), (2, 1), "client errors are not load");
        assert_eq!((w.prompt_tokens, w.generated_tokens, w.cached_tokens), (100, 10, 40));
        assert_eq!(w.ttft_s, vec![0.7, 0.005]);
        assert_eq!((w.arrivals, w.counted), (2, 1));
        assert_eq!(w.itl_s.len(), WINDOW_SAMPLES_MAX);
        let late = w.itl_s.iter().filter(|&&x| x > 0.005).count() as f64;
        let share = late / WINDOW_SAMPLES_MAX as f64;
        assert!((share - 0.5).abs() < 0.02, "{share}: the kept samples favour one half");
        let again = m.take_window();
        assert_eq!((again.requests, again.itl_s.len()), (0, 0));
        assert!(again.duration < w.duration + Duration::from_secs(1));
        assert!(again.classes.is_empty(), "no classes configured");
        // With classes: each configured class has its part of the window, with its targets,
        // also when it saw nothing.
        let ms = |n: u64| Some(Duration::from_millis(n));
        m.class.set([
            ("interactive".to_string(), ms(300), ms(50)),
            ("batch".to_string(), ms(30_000), None),
        ]);
        m.class_arrival(0);
        m.class_ttft(0, Duration::from_millis(20));
        m.class_tokens(0, 400, 32, 360);
        let w = m.take_window();
        assert_eq!(w.classes.len(), 2);
        let (i, b) = (&w.classes[0], &w.classes[1]);
        assert_eq!(
            (i.name.as_str(), i.ttft_target_s, i.itl_target_s),
            ("interactive", Some(0.3), Some(0.05))
        );
        assert_eq!(
            (i.arrivals, i.counted, i.prompt_tokens, i.generated_tokens, i.cached_tokens),
            (1, 1, 400, 32, 360)
        );
        assert_eq!(i.ttft_s, vec![0.02]);
        assert_eq!((b.name.as_str(), b.ttft_target_s, b.arrivals), ("batch", Some(30.0), 0));
    }
}
