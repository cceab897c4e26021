//! An engine attached by `kvfabric attach` (owner: `kvfabric-attach`, whose snapshot these
//! families encode).

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::*;

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

/// An attached engine.
pub(super) fn attached_engine(
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
