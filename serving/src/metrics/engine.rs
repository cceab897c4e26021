//! The engine's and its store's families (owner: `kvfabric-engine`'s scheduler and
//! `kvfabric-tiers`' store, whose snapshots they encode), and the load reports built from them.

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use kvfabric_tiers::metrics::{HistogramSnapshot, MetricsSnapshot};

use super::http::now_ms;
use super::*;

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

/// The engine and its store.
pub(super) fn engine_and_store(
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
    families::<EngineSnapshot>(
        e,
        s,
        |s| s.engine.as_ref(),
        &[
            ("kvfabric_prefill_tokens", "Prompt tokens computed.", None, C, |p| Value::Int(p.prefill_tokens)),
            ("kvfabric_kv_stored_blocks", "Blocks stored by the engine.", None, C, |p| Value::Int(p.stored_blocks)),
            ("kvfabric_kv_engine_memory_blocks", "KV blocks held in engine memory because the host tier had no slot to spare (a host tier too small for the running batch).", None, C, |p| Value::Int(p.engine_memory_blocks)),
            ("kvfabric_queue_depth", "Requests waiting for a batch slot.", None, G, |p| Value::Int(p.waiting)),
            ("kvfabric_running_requests", "Requests in the batch.", None, G, |p| Value::Int(p.running)),
            ("kvfabric_engine_steps", "Engine steps.", None, C, |p| Value::Int(p.steps)),
            ("kvfabric_remote_tier_declined", "Prompts whose blocks on the fabric (G4) were computed instead of fetched: over the link, at the rate measured, they would have come later.", None, C, |p| Value::Int(p.remote_declined)),
            ("kvfabric_engine_shed", "Requests the engine refused or dropped from its queue as overloaded (429): the queue was full, or a more urgent class needed the place.", None, C, |p| Value::Int(p.shed)),
            ("kvfabric_engine_expired", "Requests answered at once, not computed, because their service class's expire passed while they waited.", None, C, |p| Value::Int(p.expired)),
            ("kvfabric_engine_tenant_quota_removed_blocks", "KV blocks removed from the store because their tenant was past its store or disk quota (its own least recently used; past its host quota where there is no disk).", None, C, |p| Value::Int(p.quota_removed)),
            ("kvfabric_engine_tenant_quota_demoted_blocks", "KV blocks moved from host memory to disk because their tenant was past its host quota (its own least recently used).", None, C, |p| Value::Int(p.quota_demoted)),
        ],
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
    families::<MetricsSnapshot>(
        e,
        s,
        |s| s.engine.as_ref().and_then(|x| x.store.as_ref()),
        &[
            ("kvfabric_kv_offload", "Bytes offloaded host to disk.", Some(Unit::Bytes), C, |p| {
                Value::Int(p.offload_bytes)
            }),
            ("kvfabric_kv_onboard", "Bytes onboarded disk to host.", Some(Unit::Bytes), C, |p| {
                Value::Int(p.onboard_bytes)
            }),
            (
                "kvfabric_kv_offload_errors",
                "Offloads that failed (disk full, I/O error); the block stayed in host memory.",
                None,
                C,
                |p| Value::Int(p.offload_errors),
            ),
            (
                "kvfabric_kv_disk_corrupt_blocks",
                "Blocks found corrupt on disk and dropped.",
                None,
                C,
                |p| Value::Int(p.disk_corrupt_blocks),
            ),
        ],
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
