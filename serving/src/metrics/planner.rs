//! The live planner's families (owner: `kvfabric-planner`'s `PlannerState`).

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::*;

/// The live planner's state in `/metrics` (and `/health`).
impl Source for kvfabric_planner::live::PlannerState {
    fn snapshot(&self, out: &mut Snapshot) {
        out.planner = Some(kvfabric_planner::live::PlannerState::snapshot(self));
    }
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.planner = Some(kvfabric_planner::live::PlannerState::health(self));
    }
}

/// The planner.
pub(super) fn planner(
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
