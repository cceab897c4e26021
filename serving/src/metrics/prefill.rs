//! Disaggregated prefill: a decode worker's remote prefills, a prefill worker's jobs.

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use super::*;

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

/// Remote prefill, decode side.
pub(super) fn remote_prefill(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    family(e, s, "kvfabric_prefills", "Prefills by where they ran.", None, C, |s, o| {
        if let Some(p) = &s.remote_prefill {
            o.push((vec![("where", "remote".into())], Value::Int(p.remote)));
            o.push((vec![("where", "local".into())], Value::Int(p.local)));
        }
    })?;
    let rows: [Row<RemotePrefillSnapshot>; 5] = [
        ("kvfabric_remote_prefill_fallbacks", "Remote prefills that failed or timed out.", None, C, |p| Value::Int(p.fallbacks)),
        ("kvfabric_prefill_latency_local", "Prefills of a latency class done on the decode worker because that was estimated faster than the prefill pool.", None, C, |p| Value::Int(p.latency_local)),
        ("kvfabric_remote_prefill", "KV bytes written by prefill workers.", Some(Unit::Bytes), C, |p| Value::Int(p.bytes)),
        ("kvfabric_remote_prefill_wait", "Time waiting for remote prefills.", Some(Unit::Seconds), C, |p| Value::Float(p.wait_seconds)),
        ("kvfabric_prefill_queue_depth", "Remote prefills pending.", None, G, |p| Value::Int(p.pending)),
    ];
    families(e, s, |s| s.remote_prefill.as_ref(), &rows)
}

/// The prefill service, prefill side.
pub(super) fn prefill_service(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::Counter as C;
    let rows: [Row<PrefillServiceSnapshot>; 4] = [
        ("kvfabric_prefill_jobs_done", "Prefill jobs whose blocks were written.", None, C, |p| {
            Value::Int(p.done)
        }),
        ("kvfabric_prefill_jobs_failed", "Prefill jobs failed or expired.", None, C, |p| {
            Value::Int(p.failed)
        }),
        (
            "kvfabric_prefill_sent",
            "KV bytes written to decode workers.",
            Some(Unit::Bytes),
            C,
            |p| Value::Int(p.bytes),
        ),
        ("kvfabric_prefill_transfer", "Time in KV writes.", Some(Unit::Seconds), C, |p| {
            Value::Float(p.transfer_seconds)
        }),
    ];
    families(e, s, |s| s.prefill_service.as_ref(), &rows)
}
