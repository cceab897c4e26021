//! `/dashboard`: one live page over a JSON endpoint that is usable on its own.
//!
//! - `GET /dashboard` the page, `GET /dashboard/app.js` and `/dashboard/style.css` its
//!   script and style: static files compiled into the binary (no build step, no library).
//! - `GET /dashboard/state` the data, polled by the page every second: the frontend's own
//!   totals (what `/metrics` shows), the backend's workers (role, load, queue, state, tier
//!   occupancy G1–G4) and those that left, the control plane, the planner, and a history of
//!   the last five minutes sampled every [`SAMPLE_PERIOD`] (request rate, TTFT and ITL
//!   percentiles, hit rate per tier, KV bytes per second per transport, remote prefills and
//!   fallbacks). Documented in `docs/dashboard.md`.
//! - The cache map is `POST /v1/route` (where a prompt would go and why), which the page
//!   calls with the API key when one is configured.
//!
//! Like `/health` and `/metrics`, the page and its data need no API key: they carry counts
//! and worker names, no prompts.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use parking_lot::Mutex;
use serde_json::{json, Value};

use super::AppState;
use crate::dashboard::{BackendView, WorkerView};
use crate::metrics::{self, bucket_quantile, HttpTotals, Snapshot};

/// The history is sampled this often.
pub const SAMPLE_PERIOD: Duration = Duration::from_secs(2);
/// Samples kept: five minutes.
const HISTORY: usize = 150;
/// The JSON's version: a reader refuses another.
pub const STATE_VERSION: u32 = 1;

const PAGE: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/app.js");
const STYLE: &str = include_str!("dashboard/style.css");

/// What the history keeps of one moment: cumulative counts, each worker's apart (a rate is
/// the sum of each worker's own increase: a worker that joins, leaves or re-registers adds
/// no spike).
#[derive(Debug, Clone)]
struct Sample {
    /// Unix time (what the page shows) and a monotonic clock (what rates divide by).
    at: f64,
    mono: std::time::Instant,
    http: HttpTotals,
    work: BTreeMap<String, WorkTotals>,
}

/// The workers' cumulative counters, summed.
#[derive(Debug, Clone, Default)]
struct WorkTotals {
    prefill_tokens: u64,
    transfer_bytes: BTreeMap<String, u64>,
    remote_prefills: u64,
    prefill_fallbacks: u64,
}

impl WorkTotals {
    /// What `b` added since `a`, per counter (a counter that went down adds nothing).
    fn since(b: &WorkTotals, a: &WorkTotals) -> WorkTotals {
        let d = |x: u64, y: u64| y.saturating_sub(x);
        WorkTotals {
            prefill_tokens: d(a.prefill_tokens, b.prefill_tokens),
            transfer_bytes: b
                .transfer_bytes
                .iter()
                .map(|(k, v)| (k.clone(), d(a.transfer_bytes.get(k).copied().unwrap_or(0), *v)))
                .collect(),
            remote_prefills: d(a.remote_prefills, b.remote_prefills),
            prefill_fallbacks: d(a.prefill_fallbacks, b.prefill_fallbacks),
        }
    }

    /// Each worker's totals, by name.
    fn per_worker(workers: &[&WorkerView]) -> BTreeMap<String, WorkTotals> {
        workers.iter().map(|w| (w.name.clone(), WorkTotals::of(std::slice::from_ref(w)))).collect()
    }

    fn of(workers: &[&WorkerView]) -> Self {
        let mut t = WorkTotals::default();
        // Reports come off the bus: sums saturate rather than trust their magnitudes.
        for s in workers.iter().filter_map(|w| w.stats.as_ref()) {
            t.prefill_tokens = t.prefill_tokens.saturating_add(s.prefill_tokens);
            for x in &s.transfers {
                let b = t.transfer_bytes.entry(x.transport.clone()).or_default();
                *b = b.saturating_add(x.bytes);
            }
            t.remote_prefills = t.remote_prefills.saturating_add(s.remote_prefills);
            t.prefill_fallbacks = t.prefill_fallbacks.saturating_add(s.prefill_fallbacks);
        }
        t
    }
}

/// The dashboard's history, filled by a task while the routes live.
#[derive(Debug, Default)]
pub(super) struct History {
    samples: Mutex<VecDeque<Sample>>,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl History {
    /// Samples `st` every [`SAMPLE_PERIOD`] until it is dropped (when a runtime runs).
    pub(super) fn start(st: &Arc<AppState>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let weak: Weak<AppState> = Arc::downgrade(st);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(st) = weak.upgrade() else { return };
                let view = st.backend.dashboard();
                st.history.push(sample(&st, &view));
            }
        });
    }

    fn push(&self, s: Sample) {
        let mut h = self.samples.lock();
        if h.len() >= HISTORY {
            h.pop_front();
        }
        h.push_back(s);
    }

    /// One point per pair of consecutive samples.
    fn series(&self) -> Vec<Value> {
        let h = self.samples.lock();
        h.iter().zip(h.iter().skip(1)).map(|(a, b)| point(a, b)).collect()
    }
}

fn sample(st: &AppState, view: &BackendView) -> Sample {
    let all: Vec<&WorkerView> = view.workers.iter().chain(&view.departed).collect();
    Sample {
        at: unix_now(),
        mono: std::time::Instant::now(),
        http: st.metrics.totals(),
        work: WorkTotals::per_worker(&all),
    }
}

/// Rates and percentiles between two samples: the frontend's own increases, and the sum of
/// each worker's (a worker in only one of the two adds nothing). Reports come off the bus, so
/// sums saturate and shares are clamped to [0, 1].
fn point(a: &Sample, b: &Sample) -> Value {
    let dt = b.mono.saturating_duration_since(a.mono).as_secs_f64().max(1e-3);
    let d = |x: u64, y: u64| y.saturating_sub(x);
    let diff = |x: &[u64], y: &[u64]| -> Vec<u64> {
        x.iter().zip(y).map(|(p, q)| q.saturating_sub(*p)).collect()
    };
    let ttft = diff(&a.http.ttft_buckets, &b.http.ttft_buckets);
    let itl = diff(&a.http.itl_buckets, &b.http.itl_buckets);
    let q = |c: &[u64], bounds: &[f64], p: f64| bucket_quantile(c, bounds, p);
    let (ha, hb) = (&a.http, &b.http);
    let finished = d(ha.ok, hb.ok).saturating_add(d(ha.server_errors, hb.server_errors));
    let mut work = WorkTotals::default();
    for (name, now) in &b.work {
        let Some(before) = a.work.get(name) else { continue };
        let inc = WorkTotals::since(now, before);
        work.prefill_tokens = work.prefill_tokens.saturating_add(inc.prefill_tokens);
        for (k, v) in inc.transfer_bytes {
            let e = work.transfer_bytes.entry(k).or_default();
            *e = e.saturating_add(v);
        }
        work.remote_prefills = work.remote_prefills.saturating_add(inc.remote_prefills);
        work.prefill_fallbacks = work.prefill_fallbacks.saturating_add(inc.prefill_fallbacks);
    }
    // Prompt tokens from cache per tier, over the prompt tokens of the same requests: the
    // frontend's own counts (what `/metrics` says), not the workers' (theirs include other
    // frontends' requests).
    let prompt = d(ha.prompt_tokens, hb.prompt_tokens) as f64;
    let hit_rate: Vec<Option<f64>> = (0..4)
        .map(|i| {
            let h = d(ha.cached_by_tier[i], hb.cached_by_tier[i]) as f64;
            (prompt > 0.0).then(|| (h / prompt).clamp(0.0, 1.0))
        })
        .collect();
    let bytes: BTreeMap<&String, f64> =
        work.transfer_bytes.iter().map(|(k, v)| (k, *v as f64 / dt)).collect();
    json!({
        "t": b.at,
        "requests_per_s": finished as f64 / dt,
        "errors_per_s": d(ha.server_errors, hb.server_errors) as f64 / dt,
        "prompt_tokens_per_s": d(ha.prompt_tokens, hb.prompt_tokens) as f64 / dt,
        "generated_tokens_per_s": d(ha.generated_tokens, hb.generated_tokens) as f64 / dt,
        "ttft_s": { "p50": q(&ttft, metrics::LATENCY_BUCKETS, 0.5), "p90": q(&ttft, metrics::LATENCY_BUCKETS, 0.9),
                    "p99": q(&ttft, metrics::LATENCY_BUCKETS, 0.99) },
        "itl_s": { "p50": q(&itl, metrics::ITL_BUCKETS, 0.5), "p90": q(&itl, metrics::ITL_BUCKETS, 0.9),
                   "p99": q(&itl, metrics::ITL_BUCKETS, 0.99) },
        "hit_rate": { "G1": hit_rate[0], "G2": hit_rate[1], "G3": hit_rate[2], "G4": hit_rate[3] },
        "kv_bytes_per_s": bytes,
        "remote_prefills_per_s": work.remote_prefills as f64 / dt,
        "prefill_fallbacks_per_s": work.prefill_fallbacks as f64 / dt,
    })
}

/// `GET /dashboard/state`.
pub(super) async fn state(State(st): State<Arc<AppState>>) -> Json<Value> {
    let view = st.backend.dashboard();
    let http = st.metrics.totals();
    let all: Vec<&WorkerView> = view.workers.iter().chain(&view.departed).collect();
    let work = WorkTotals::of(&all);
    let serving: Vec<&WorkerView> = view.workers.iter().collect();
    let mut occupancy = [(0u64, 0u64); 4];
    for s in serving.iter().filter_map(|w| w.stats.as_ref()) {
        for (o, t) in occupancy.iter_mut().zip(&s.tiers) {
            o.0 = o.0.saturating_add(t.used);
            o.1 = o.1.saturating_add(t.capacity);
        }
    }
    let mut planner = None;
    for source in &st.cfg.sources {
        let mut snap = Snapshot::default();
        source.snapshot(&mut snap);
        planner = planner.or(snap.planner);
    }
    let quantiles = |c: &[u64], bounds: &[f64]| {
        json!({ "count": c.iter().sum::<u64>(), "p50": bucket_quantile(c, bounds, 0.5),
                "p90": bucket_quantile(c, bounds, 0.9), "p99": bucket_quantile(c, bounds, 0.99) })
    };
    let tiers: Vec<Value> = ["G1", "G2", "G3", "G4"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            json!({ "tier": name, "used_blocks": occupancy[i].0,
                    "capacity_blocks": occupancy[i].1, "hit_tokens": http.cached_by_tier[i] })
        })
        .collect();
    let health = super::health_of(st.backend.as_ref(), &st.cfg.sources);
    Json(json!({
        "version": STATE_VERSION,
        "now_s": unix_now(),
        "uptime_s": st.started.elapsed().as_secs_f64(),
        "server": { "name": st.cfg.name, "status": health.status,
                    "models": st.backend.models().iter().map(|m| m.id.clone()).collect::<Vec<_>>() },
        "requests": {
            "ok": http.ok, "client_errors": http.client_errors, "server_errors": http.server_errors,
            "cancelled": http.cancelled, "prompt_tokens": http.prompt_tokens,
            "generated_tokens": http.generated_tokens, "cached_prompt_tokens": http.cached_prompt_tokens,
            "ttft_s": quantiles(&http.ttft_buckets, metrics::LATENCY_BUCKETS),
            "itl_s": quantiles(&http.itl_buckets, metrics::ITL_BUCKETS),
        },
        "health": health,
        "tiers": tiers,
        "classes": st.metrics.class.totals(),
        "prefill_tokens": work.prefill_tokens,
        "transfers": {
            "bytes": work.transfer_bytes,
            "remote_prefills": work.remote_prefills,
            "prefill_fallbacks": work.prefill_fallbacks,
        },
        "workers": view.workers,
        "departed": view.departed,
        "fabric": view.fabric,
        "control": view.control,
        "planner": planner,
        "series": { "period_s": SAMPLE_PERIOD.as_secs_f64(), "points": st.history.series() },
    }))
}

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body)
}

/// `GET /dashboard`.
pub(super) async fn page() -> impl IntoResponse {
    asset("text/html; charset=utf-8", PAGE)
}

/// `GET /dashboard/app.js`.
pub(super) async fn script() -> impl IntoResponse {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

/// `GET /dashboard/style.css`.
pub(super) async fn style() -> impl IntoResponse {
    asset("text/css; charset=utf-8", STYLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample: the frontend's answered requests, prompt tokens and tokens from cache per
    /// tier, and each worker's remote prefills.
    fn sample(after_s: u64, http: (u64, u64, [u64; 4]), workers: &[(&str, u64)]) -> Sample {
        let work = workers
            .iter()
            .map(|(name, n)| {
                (name.to_string(), WorkTotals { remote_prefills: *n, ..Default::default() })
            })
            .collect();
        let mono = std::time::Instant::now() + Duration::from_secs(after_s);
        let (ok, prompt_tokens, cached_by_tier) = http;
        let http = HttpTotals { ok, prompt_tokens, cached_by_tier, ..HttpTotals::default() };
        Sample { at: after_s as f64, mono, http, work }
    }

    /// Worker rates sum each worker's increase: one that joins adds nothing in its first
    /// interval, one that restarts (counters down) adds nothing. Tokens from cache are the
    /// frontend's, over its own prompt tokens; absurd counters saturate and clamp.
    #[test]
    fn rates_sum_each_workers_increase_and_hits_are_the_frontends_own() {
        let a = sample(0, (10, 300, [0, 100, 0, 0]), &[("w-0", 100), ("w-1", 50)]);
        let b = sample(2, (30, 600, [0, 300, 0, 0]), &[("w-0", 110), ("w-1", 0), ("w-2", 9000)]);
        let p = point(&a, &b);
        assert!((p["requests_per_s"].as_f64().unwrap() - 10.0).abs() < 0.1, "{p}");
        // w-0 made 10; w-1 restarted; w-2 is new.
        assert!((p["remote_prefills_per_s"].as_f64().unwrap() - 5.0).abs() < 0.1, "{p}");
        // 200 of the 300 prompt tokens came from host memory.
        assert!((p["hit_rate"]["G2"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9, "{p}");
        assert_eq!(p["hit_rate"]["G1"], 0.0);
        let evil = sample(4, (30, 601, [u64::MAX; 4]), &[("w-0", u64::MAX)]);
        let p = point(&b, &evil);
        for t in ["G1", "G2", "G3", "G4"] {
            let h = p["hit_rate"][t].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&h), "{p}");
        }
    }
}
