//! The transfer agent's families (owner: `kvfabric`'s agent): transfers per transport and
//! outcome, RDMA, authenticated ports, and the pulls between workers' stores
//! (`kvfabric-tiers`' peers).

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use super::*;

/// The agent's transfers and ports.
pub(super) fn transfers(
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

/// Pulls from peers' stores (one KV pool across workers), and the pulls served to them.
pub(super) fn peer_pulls(
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
