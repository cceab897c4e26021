//! The health document: what `/health` serves, what the dashboard shows, what the C ABI's
//! `kvf_store_health` returns. One typed shape for every process (its JSON schema is
//! `docs/health.schema.json`, checked against these types by a test).
//!
//! The document is a vocabulary, as [`crate::contract`] is: its parts are defined here so
//! that every crate and the C ABI speak them, and each is *filled* by the crate that owns
//! what it describes:
//!
//! | part | filled by |
//! |---|---|
//! | [`EngineHealth`] | `kvfabric_engine::scheduler::Scheduler::health` |
//! | [`StoreHealth`] | `kvfabric_tiers::TieredStore::health` |
//! | [`TransferHealth`] | [`crate::agent::Agent::health`] |
//! | [`ControlHealth`] | [`crate::control::Discovery::status`], [`crate::control::EventBus::status`] |
//! | [`TlsHealth`] | [`crate::tls::Tls::health`] |
//! | [`RoutingHealth`] | `kvfabric_serving::routed` (the frontend's workers) |
//! | [`PlannerHealth`] | `kvfabric_planner::live::PlannerState::health` |
//! | [`PrefillHealth`] | `kvfabric_serving::disagg` (a decode worker's remote prefills) |
//! | [`AttachHealth`] | `kvfabric_attach::AttachStats::health` |
//!
//! A process assembles the parts it has and calls [`Health::finish`], which derives the
//! status and the reasons from the parts: nothing patches the document by string keys.

use serde::{Deserialize, Serialize};

/// Whether to send traffic here. `ok` and `degraded` serve (HTTP 200); the others do not
/// (503), so load balancers need not parse the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub enum Status {
    /// Everything works.
    #[default]
    #[serde(rename = "ok")]
    Ok,
    /// Serving, with something wrong: see the reasons.
    #[serde(rename = "degraded")]
    Degraded,
    /// The attached engine does not answer its health checks.
    #[serde(rename = "engine not answering")]
    EngineNotAnswering,
    /// Every known worker refuses connections now.
    #[serde(rename = "no usable workers")]
    NoUsableWorkers,
    /// No worker has joined.
    #[serde(rename = "no workers")]
    NoWorkers,
    /// The engine failed and does not serve.
    #[serde(rename = "failed")]
    Failed,
}

impl Status {
    /// Whether this status takes traffic (HTTP 200).
    pub fn serving(self) -> bool {
        matches!(self, Status::Ok | Status::Degraded)
    }
}

/// One process's health.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Health {
    /// Derived by [`Health::finish`] from the parts.
    pub status: Status,
    /// One sentence per thing wrong, each saying what still works; derived by
    /// [`Health::finish`] from the parts.
    pub reasons: Vec<String>,
    /// The model served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A worker's name (`kvfabric worker`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// A fabric node's name (`kvfabric fabric-node`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The engine's scheduler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineHealth>,
    /// The tiered store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreHealth>,
    /// The transfer agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferHealth>,
    /// etcd and NATS as this process sees them (embedded backends are left out: always up).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub control_plane: Vec<ControlHealth>,
    /// The certificate this process serves with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsHealth>,
    /// A frontend's workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingHealth>,
    /// A planner beside the frontend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerHealth>,
    /// A decode worker's remote prefills.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillHealth>,
    /// An attachment to an outside engine (`kvfabric attach`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attach: Option<AttachHealth>,
}

impl Health {
    /// Takes every part `other` has (a component's parts into the process's document).
    pub fn merge(&mut self, other: Health) {
        let Health {
            status: _,
            reasons: _,
            model,
            worker,
            node,
            engine,
            store,
            transfer,
            control_plane,
            tls,
            routing,
            planner,
            prefill,
            attach,
        } = other;
        fn take<T>(into: &mut Option<T>, from: Option<T>) {
            if from.is_some() {
                *into = from;
            }
        }
        take(&mut self.model, model);
        take(&mut self.worker, worker);
        take(&mut self.node, node);
        take(&mut self.engine, engine);
        take(&mut self.store, store);
        take(&mut self.transfer, transfer);
        self.control_plane.extend(control_plane);
        take(&mut self.tls, tls);
        take(&mut self.routing, routing);
        take(&mut self.planner, planner);
        take(&mut self.prefill, prefill);
        take(&mut self.attach, attach);
    }

    /// Derives the status and the reasons from the parts. The worst part decides: a failed
    /// engine, then no workers, no usable workers, an engine not answering; else any reason
    /// makes it `degraded`.
    pub fn finish(mut self) -> Self {
        let mut reasons = Vec::new();
        let mut status = Status::Ok;
        if let Some(e) = &self.engine {
            if let Some(why) = &e.failure {
                status = status.max(Status::Failed);
                reasons.push(format!("the engine failed: {why}"));
            }
        }
        if let Some(s) = &self.store {
            reasons.extend(s.reasons());
        }
        if let Some(t) = &self.transfer {
            reasons.extend(t.reasons());
        }
        reasons.extend(self.control_plane.iter().filter_map(ControlHealth::reason));
        if let Some(t) = &self.tls {
            reasons.extend(t.reasons());
        }
        if let Some(r) = &self.routing {
            if r.workers.is_empty() {
                status = status.max(Status::NoWorkers);
            } else if r.unreachable.len() >= r.workers.len() {
                status = status.max(Status::NoUsableWorkers);
            }
            reasons.extend(
                r.unreachable
                    .iter()
                    .map(|u| format!("worker {} cannot be reached: it {}", u.worker, u.why)),
            );
        }
        if let Some(p) = &self.planner {
            if p.workers < p.desired {
                reasons.push(format!(
                    "planner: {} of {} workers serving (a worker did not start)",
                    p.workers, p.desired
                ));
            }
        }
        if let Some(a) = &self.attach {
            if !a.registered {
                status = status.max(Status::EngineNotAnswering);
                reasons.push(
                    "the engine does not answer its health checks (its blocks are withdrawn \
                     from routing)"
                        .into(),
                );
            }
        }
        if status == Status::Ok && !reasons.is_empty() {
            status = Status::Degraded;
        }
        self.status = status;
        self.reasons = reasons;
        self
    }
}

/// The engine's scheduler.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineHealth {
    /// Sequences running.
    pub running: u64,
    /// Requests waiting for admission.
    pub waiting: u64,
    /// Why the engine stopped, when it did (`failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// The tiered store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreHealth {
    /// The disk tier's slots usable now, when the filesystem under it is full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_full: Option<DiskFull>,
    /// Blocks found corrupt on disk lately (dropped, never served).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_corrupt: Option<DiskCorrupt>,
}

/// A disk tier on a full filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskFull {
    /// Slots usable.
    pub usable: u64,
    /// Slots configured.
    pub configured: u64,
}

/// Corruption found on the disk tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCorrupt {
    /// Blocks found corrupt since the start.
    pub blocks: u64,
    /// Seconds since the last.
    pub last_s_ago: u64,
}

impl StoreHealth {
    /// What is wrong.
    pub fn reasons(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(d) = &self.disk_full {
            out.push(format!(
                "the disk tier's filesystem is full: {} of {} slots usable",
                d.usable, d.configured
            ));
        }
        if let Some(c) = &self.disk_corrupt {
            out.push(format!(
                "{} block(s) found corrupt on disk and dropped, never served (the last {} s \
                 ago): check the device",
                c.blocks, c.last_s_ago
            ));
        }
        out
    }
}

/// The transfer agent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferHealth {
    /// Transfers that failed since the start, every transport.
    pub failed: u64,
    /// CUDA devices this process can use.
    pub cuda: CudaHealth,
    /// RDMA as configured at start.
    pub rdma: crate::endpoint::RdmaStatus,
    /// Why RDMA stopped working since (transfers between hosts go over TCP), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_failure: Option<String>,
}

impl TransferHealth {
    /// What is wrong.
    pub fn reasons(&self) -> Vec<String> {
        self.rdma_failure
            .iter()
            .map(|why| format!("RDMA failed, transfers between hosts go over TCP: {why}"))
            .collect()
    }
}

/// CUDA devices.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaHealth {
    /// Whether the driver loaded and found devices.
    pub available: bool,
    /// Their names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// Why not, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl CudaHealth {
    /// This process's CUDA devices now.
    pub fn probe() -> Self {
        match crate::cuda::device_names() {
            Ok(devices) => CudaHealth { available: true, devices, reason: None },
            Err(why) => {
                CudaHealth { available: false, devices: Vec::new(), reason: Some(why.to_string()) }
            }
        }
    }
}

/// Whether a control-plane backend is reachable now, and what its outages cost this process
/// (`/health`'s `control_plane`, `/metrics`, the dashboard, the C ABI's store metrics;
/// `kvfabric::control::health::BackendHealth` keeps it). In JSON the backend is `component`
/// and whether it answers `up`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ControlHealth {
    /// The backend: `etcd`, `nats`, `file`, or `embedded` (in this process).
    #[serde(rename = "component")]
    pub backend: String,
    /// It answered the last time it was asked (an embedded one always does).
    #[serde(rename = "up")]
    pub connected: bool,
    /// Why not, when not.
    #[serde(default)]
    pub error: Option<String>,
    /// Seconds since it last answered.
    pub since_contact_s: f64,
    /// Times the connection came back after an outage.
    pub reconnects: u64,
    /// Lease renewals (keep-alives) that failed.
    pub lease_renewals_failed: u64,
    /// Events received but not yet read by this process.
    pub events_behind: u64,
    /// Events dropped before this process read them.
    pub events_dropped: u64,
}

impl ControlHealth {
    /// An in-process backend: always there.
    pub fn embedded() -> Self {
        ControlHealth { backend: "embedded".into(), connected: true, ..ControlHealth::default() }
    }

    /// Whether it is a backend outside this process (etcd or NATS), whose outages matter.
    pub fn is_remote(&self) -> bool {
        matches!(self.backend.as_str(), "etcd" | "nats")
    }

    /// Why the process is degraded by this backend, if it is, saying what still works.
    pub fn reason(&self) -> Option<String> {
        if self.connected || !self.is_remote() {
            return None;
        }
        let still = match self.backend.as_str() {
            "etcd" => {
                "discovery is frozen (no instance joins or leaves here; requests still go to \
                 the workers known before; this process's lease lapses after its TTL)"
            }
            _ => {
                "KV events, load reports and dumps are not delivered (routing uses what it \
                 last knew; requests are still served)"
            }
        };
        Some(format!(
            "{} unreachable for {:.0} s ({}): {still}",
            self.backend,
            self.since_contact_s,
            self.error.as_deref().unwrap_or("no answer")
        ))
    }
}

/// Days before a certificate's end that `/health` turns `degraded` (the alert
/// `KvfabricCertificateExpiresSoon` fires at the same point).
pub const CERT_EXPIRY_WARN_DAYS: i64 = 14;

/// The certificate this process serves with, and its handshakes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TlsHealth {
    /// The certificate's end of validity, Unix seconds.
    pub not_after: i64,
    /// Seconds left until then (negative: expired).
    pub expires_in_s: i64,
    /// Handshakes that failed since the start.
    pub handshake_failures: u64,
    /// Plaintext peers refused since the start.
    pub plaintext_refused: u64,
    /// Whether the last certificate reload failed (the certificates in use stay).
    pub last_reload_failed: bool,
}

impl TlsHealth {
    /// What is wrong: a certificate within [`CERT_EXPIRY_WARN_DAYS`] of its end or past it,
    /// a reload that failed.
    pub fn reasons(&self) -> Vec<String> {
        let mut out = Vec::new();
        let days = self.expires_in_s.div_euclid(86_400);
        if self.expires_in_s <= 0 {
            out.push(
                "the certificate this process serves with has expired: peers refuse it \
                 (replace the files and send SIGHUP)"
                    .to_string(),
            );
        } else if days < CERT_EXPIRY_WARN_DAYS {
            out.push(format!(
                "the certificate this process serves with expires in {days} day(s): replace \
                 the files and send SIGHUP"
            ));
        }
        if self.last_reload_failed {
            out.push(
                "the last certificate reload failed (the certificates in use stay; the log \
                 says why)"
                    .to_string(),
            );
        }
        out
    }
}

/// A frontend's workers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingHealth {
    /// Workers known (discovery), by name.
    pub workers: Vec<String>,
    /// Models they serve.
    pub models: Vec<String>,
    /// Workers that refuse connections now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<Unreachable>,
}

/// A worker that cannot be reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unreachable {
    /// Its name.
    pub worker: String,
    /// What it does: "refused N connections in a row", ...
    pub why: String,
}

/// The live planner.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannerHealth {
    /// Workers serving.
    pub workers: u64,
    /// Workers the planner wants.
    pub desired: u64,
    /// Workers draining.
    pub draining: u64,
    /// Scale operations that failed.
    pub scale_failures: u64,
}

/// A decode worker's remote prefills.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillHealth {
    /// The worker's role (`decode`).
    pub role: String,
    /// Remote prefills waiting.
    pub pending: u64,
}

/// An attachment to an outside engine.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachHealth {
    /// The engine answers and is registered (routed to).
    pub registered: bool,
    /// Blocks the engine holds, as its events say.
    pub engine_blocks: u64,
    /// Health checks the engine failed.
    pub failed_health_checks: u64,
    /// Event batches that did not parse.
    pub events_malformed: u64,
    /// Replays that failed.
    pub replay_failures: u64,
    /// Times the mirror was reset.
    pub resets: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_part_decides_and_reasons_come_from_the_parts() {
        assert_eq!(Health::default().finish().status, Status::Ok);
        let h = Health {
            store: Some(StoreHealth {
                disk_full: Some(DiskFull { usable: 3, configured: 8 }),
                ..StoreHealth::default()
            }),
            ..Health::default()
        }
        .finish();
        assert_eq!(h.status, Status::Degraded);
        assert_eq!(h.reasons, ["the disk tier's filesystem is full: 3 of 8 slots usable"]);
        let h = Health {
            engine: Some(EngineHealth {
                failure: Some("out of memory".into()),
                ..Default::default()
            }),
            routing: Some(RoutingHealth::default()),
            ..h
        }
        .finish();
        assert_eq!(h.status, Status::Failed, "failed outranks no workers");
        assert_eq!(h.reasons.len(), 2, "finish derives the reasons anew: {:?}", h.reasons);
        let one = |unreachable: usize| {
            Health {
                routing: Some(RoutingHealth {
                    workers: vec!["a".into(), "b".into()],
                    models: vec![],
                    unreachable: (0..unreachable)
                        .map(|i| Unreachable { worker: format!("w{i}"), why: "refused".into() })
                        .collect(),
                }),
                ..Health::default()
            }
            .finish()
            .status
        };
        assert_eq!(
            [one(0), one(1), one(2)],
            [Status::Ok, Status::Degraded, Status::NoUsableWorkers]
        );
        assert!(Status::Degraded.serving() && !Status::NoWorkers.serving());
    }

    #[test]
    fn a_certificate_near_its_end_or_past_it_degrades() {
        let t = |s: i64| TlsHealth { expires_in_s: s, ..TlsHealth::default() }.reasons();
        assert!(t(30 * 86_400).is_empty());
        assert!(t(13 * 86_400)[0].contains("expires in 13 day(s)"), "{:?}", t(13 * 86_400));
        assert!(t(-5)[0].contains("has expired"));
    }

    #[test]
    fn the_document_round_trips_through_json() {
        let h = Health {
            model: Some("m".into()),
            engine: Some(EngineHealth { running: 2, waiting: 1, failure: None }),
            control_plane: vec![ControlHealth {
                backend: "etcd".into(),
                connected: false,
                error: Some("connection refused".into()),
                ..ControlHealth::default()
            }],
            ..Health::default()
        }
        .finish();
        let json = serde_json::to_value(&h).unwrap();
        assert_eq!(json["status"], "degraded");
        assert_eq!(json["engine"]["running"], 2);
        assert!(json.get("routing").is_none(), "absent parts are left out: {json}");
        let back: Health = serde_json::from_value(json).unwrap();
        assert_eq!(back, h);
    }

    /// A small JSON Schema check (the keywords docs/health.schema.json uses); the paths of
    /// the schema's properties that `value` used are added to `seen`.
    fn check(
        schema: &serde_json::Value,
        value: &serde_json::Value,
        at: &str,
        seen: &mut Vec<String>,
    ) {
        use serde_json::Value as V;
        if let Some(types) = schema.get("type") {
            let ok = |t: &str| match t {
                "object" => value.is_object(),
                "array" => value.is_array(),
                "string" => value.is_string(),
                "integer" => value.is_i64() || value.is_u64(),
                "number" => value.is_number(),
                "boolean" => value.is_boolean(),
                "null" => value.is_null(),
                other => panic!("{at}: the check knows no type {other}"),
            };
            let fits = match types {
                V::String(t) => ok(t),
                V::Array(ts) => ts.iter().any(|t| ok(t.as_str().unwrap())),
                _ => panic!("{at}: type is {types}"),
            };
            assert!(fits, "{at}: {value} is not of type {types}");
        }
        if let Some(e) = schema.get("enum") {
            assert!(e.as_array().unwrap().contains(value), "{at}: {value} is not one of {e}");
        }
        if let Some(min) = schema.get("minimum") {
            assert!(value.as_f64().unwrap() >= min.as_f64().unwrap(), "{at}: {value} < {min}");
        }
        if let Some(items) = schema.get("items") {
            for (i, v) in value.as_array().unwrap().iter().enumerate() {
                check(items, v, &format!("{at}[{i}]"), seen);
            }
        }
        let Some(obj) = value.as_object() else { return };
        let props = schema.get("properties").and_then(V::as_object);
        for r in schema.get("required").and_then(V::as_array).into_iter().flatten() {
            assert!(obj.contains_key(r.as_str().unwrap()), "{at}: {r} is required: {value}");
        }
        for (k, v) in obj {
            let path = format!("{at}.{k}");
            match props.and_then(|p| p.get(k)) {
                Some(sub) => {
                    seen.push(path.clone());
                    check(sub, v, &path, seen);
                }
                None => assert!(
                    schema.get("additionalProperties") != Some(&V::Bool(false)),
                    "{path} is not in the schema"
                ),
            }
        }
    }

    /// Every property path of `schema`.
    fn paths(schema: &serde_json::Value, at: &str, out: &mut Vec<String>) {
        if let Some(items) = schema.get("items") {
            paths(items, &format!("{at}[]"), out);
        }
        for (k, sub) in schema.get("properties").and_then(|p| p.as_object()).into_iter().flatten() {
            out.push(format!("{at}.{k}"));
            paths(sub, &format!("{at}.{k}"), out);
        }
    }

    /// The schema in the docs and the types agree both ways: documents with every part
    /// (each RDMA state) validate, and every property the schema names is one they fill.
    #[test]
    fn the_schema_in_the_docs_describes_the_document() {
        use crate::endpoint::RdmaStatus;
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../docs/health.schema.json")).unwrap();
        let full = |rdma: RdmaStatus| {
            Health {
                model: Some("m".into()),
                worker: Some("w".into()),
                node: Some("n".into()),
                engine: Some(EngineHealth { running: 1, waiting: 2, failure: Some("oom".into()) }),
                store: Some(StoreHealth {
                    disk_full: Some(DiskFull { usable: 1, configured: 4 }),
                    disk_corrupt: Some(DiskCorrupt { blocks: 1, last_s_ago: 3 }),
                }),
                transfer: Some(TransferHealth {
                    failed: 1,
                    cuda: CudaHealth {
                        available: false,
                        devices: vec!["H100".into()],
                        reason: Some("no CUDA driver".into()),
                    },
                    rdma,
                    rdma_failure: Some("CQ error".into()),
                }),
                control_plane: vec![
                    ControlHealth {
                        backend: "etcd".into(),
                        error: Some("refused".into()),
                        ..Default::default()
                    },
                    ControlHealth { backend: "nats".into(), connected: true, ..Default::default() },
                ],
                tls: Some(TlsHealth {
                    not_after: 1,
                    expires_in_s: -1,
                    last_reload_failed: true,
                    ..Default::default()
                }),
                routing: Some(RoutingHealth {
                    workers: vec!["a".into()],
                    models: vec!["m".into()],
                    unreachable: vec![Unreachable { worker: "a".into(), why: "refused".into() }],
                }),
                planner: Some(PlannerHealth {
                    workers: 1,
                    desired: 2,
                    draining: 0,
                    scale_failures: 1,
                }),
                prefill: Some(PrefillHealth { role: "decode".into(), pending: 3 }),
                attach: Some(AttachHealth { registered: false, ..Default::default() }),
                ..Health::default()
            }
            .finish()
        };
        let mut seen = Vec::new();
        for rdma in [
            RdmaStatus::Off,
            RdmaStatus::Unavailable { reason: "no device".into() },
            RdmaStatus::Device {
                device: "mlx5_0".into(),
                port: 1,
                link_layer: "ethernet".into(),
                gpu: Some("dma-buf".into()),
            },
        ] {
            let doc = serde_json::to_value(full(rdma)).unwrap();
            check(&schema, &doc, "", &mut seen);
        }
        check(&schema, &serde_json::to_value(Health::default().finish()).unwrap(), "", &mut seen);
        let seen: Vec<String> = seen.iter().map(|p| strip_indices(p)).collect();
        let mut all = Vec::new();
        paths(&schema, "", &mut all);
        let unfilled: Vec<&String> = all.iter().filter(|p| !seen.contains(p)).collect();
        assert!(unfilled.is_empty(), "the schema names what no document has: {unfilled:?}");
    }

    fn strip_indices(path: &str) -> String {
        let mut out = String::new();
        let mut skip = false;
        for c in path.chars() {
            match c {
                '[' => {
                    skip = true;
                    out.push_str("[]");
                }
                ']' => skip = false,
                c if !skip => out.push(c),
                _ => {}
            }
        }
        out
    }
}
