//! The control plane's families and source (owner: `kvfabric::control`: etcd, NATS).

use std::sync::Arc;

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use super::*;

/// The control-plane backends a process uses, by `component` (etcd, nats).
pub(super) fn control_plane(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> Result<(), std::fmt::Error> {
    type Get = fn(&kvfabric::health::ControlHealth) -> Value;
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
                o.push((vec![("component", LabelValue::from(c.backend.as_str()))], get(c)));
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
    pub fn statuses(&self) -> Vec<kvfabric::health::ControlHealth> {
        vec![self.discovery.status(), self.bus.status()]
    }
}

impl Source for ControlSource {
    fn snapshot(&self, out: &mut Snapshot) {
        out.control.extend(self.statuses());
    }
    /// The backends outside this process (embedded ones are always up and left out).
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.control_plane.extend(kvfabric::control::remote_statuses(&*self.discovery, &*self.bus));
    }
}
