//! Every metric kvfabric's processes expose, named here and nowhere else, encoded with
//! `prometheus-client` (OpenMetrics text: counters end in `_total`, units are part of the
//! names: `_seconds`, `_bytes`).
//!
//! Two kinds of metrics:
//! - the HTTP frontend's own, live ([`HttpMetrics`]: requests by outcome, latency
//!   histograms, tokens), registered in the frontend's registry;
//! - the components' counters, read at scrape time: each component fills its part of a
//!   [`Snapshot`] with the snapshot type its own crate defines, and [`Components`] encodes
//!   every family once, with a `worker` label per in-process worker (`kvfabric up` shows its
//!   workers' counters beside the frontend's).
//!
//! One file per owner, each its families and nothing else: [`http`] (the frontend), `engine`
//! (the engine and its store), `transfer` (the agent, peer pulls), `control` (etcd, NATS),
//! `routed` (a frontend's workers), `prefill` (disaggregated prefill), `planner`, `attach`,
//! [`tls`], [`class`] (per service class). This module holds what they share: the snapshot,
//! the [`Source`] trait (which also fills the owner's part of `/health`), and the encoder.
//! The counters themselves stay in their crates (which need no Prometheus library): the
//! encoding to OpenMetrics is this crate's one concern of it.
//!
//! Label values are escaped here ([`LabelValue`]): the encoder writes them verbatim.

mod attach;
pub mod class;
mod control;
mod engine;
pub mod http;
mod planner;
mod prefill;
mod routed;
pub mod tls;
mod transfer;

use attach::attached_engine;
pub use attach::AttachSnapshot;
use control::control_plane;
pub use control::ControlSource;
use engine::engine_and_store;
pub use engine::{fabric_stats, worker_stats, EngineSnapshot};
pub use http::{bucket_quantile, HttpMetrics, HttpTotals, ListenStats, Outcome, CACHE_TIERS};
use planner::planner;
use prefill::{prefill_service, remote_prefill};
pub use prefill::{PrefillServiceSnapshot, RemotePrefillSnapshot};
use routed::routed;
pub use routed::{PendingClassStats, RoutedSnapshot};
use transfer::{peer_pulls, transfers};

use std::fmt::Write as _;
use std::sync::Arc;

pub use kvfabric_planner::live::{PlannerSnapshot, PoolSnapshot};
pub use kvfabric_planner::window::{LoadSource, LoadWindow, WINDOW_SAMPLES_MAX};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelValue, LabelValueEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use kvfabric_tiers::metrics::{HistogramSnapshot, LATENCY_BUCKETS_S};

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

type Labels = Vec<(&'static str, LabelValue)>;

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
    pub control: Vec<kvfabric::health::ControlHealth>,
    /// Pulls from other workers' stores, and those it served them.
    pub peers: Option<kvfabric_tiers::remote::peers::PeerSnapshot>,
    /// The process's TLS (None: no certificates).
    pub tls: Option<tls::TlsSnapshot>,
}

/// A component whose counters are read at scrape time, and whose state is a part of
/// `/health`.
pub trait Source: Send + Sync + std::fmt::Debug {
    /// Fills its part of the snapshot.
    fn snapshot(&self, out: &mut Snapshot);
    /// Fills its part of the health document (none by default).
    fn health(&self, _out: &mut kvfabric::health::Health) {}
}

/// The health document of `parts` (a backend's, or a process's identity) with each source's
/// part added, finished: status and reasons derived from the parts.
pub fn health(
    parts: kvfabric::health::Health,
    sources: &[Arc<dyn Source>],
) -> kvfabric::health::Health {
    let mut h = parts;
    for source in sources {
        source.health(&mut h);
    }
    h.finish()
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

/// A family read from one part `P` of a snapshot: its name, help, unit, type, and value.
type Row<P> = (&'static str, &'static str, Option<Unit>, MetricType, fn(&P) -> Value);

/// Encodes one family per row, each with one unlabelled sample per snapshot that has the
/// part `part` gives.
fn families<P>(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
    part: impl Fn(&Snapshot) -> Option<&P>,
    rows: &[Row<P>],
) -> std::fmt::Result {
    for (name, help, unit, kind, get) in rows {
        family(e, s, name, help, unit.clone(), *kind, |s, o| {
            o.extend(part(s).map(|p| (Vec::new(), get(p))))
        })?;
    }
    Ok(())
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
    use kvfabric_tiers::metrics::MetricsSnapshot;
    use std::time::Duration;

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
