//! The routed backend's families (a frontend's workers, its queue, its routing).

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::*;

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

/// The routed backend.
pub(super) fn routed(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
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
