//! What `/dashboard` shows, as data: each backend's view of its workers and control plane
//! ([`BackendView`], from [`crate::backend::Backend::dashboard`]). The HTTP side
//! (`http::dashboard`) adds the frontend's own counters, a history of them, and the page.

use kvfabric::contract::{Load, WorkerStats};
use kvfabric::health::ControlHealth;

/// A worker as a dashboard shows it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct WorkerView {
    /// Its name (discovery id).
    pub name: String,
    /// The model it serves.
    pub model: String,
    /// `aggregated`, `prefill`, `decode`, or `engine` (an engine attached by `kvfabric
    /// attach`, reached over its OpenAI-compatible API).
    pub role: &'static str,
    /// `serving`; `avoided` (it did not answer in time lately, so requests go elsewhere);
    /// `draining` (it left discovery and finishes its requests); `drained`; `lost` (it left
    /// without draining: killed, or its lease expired).
    pub state: &'static str,
    /// Its request address.
    pub addr: Option<String>,
    /// Requests this frontend sent it.
    pub requests: u64,
    /// Its last reported load.
    pub load: Load,
    /// The rest of its last report (none from attached engines).
    pub stats: Option<WorkerStats>,
    /// Blocks the router's index holds for it.
    pub indexed_blocks: u64,
    /// Seconds since its last report.
    pub report_age_s: Option<f64>,
    /// Seconds since it left discovery (departed workers only).
    pub left_s_ago: Option<f64>,
    /// Something an operator should know of it (a fabric node whose blocks no worker can
    /// use).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The control plane a routing backend follows.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ControlView {
    /// Discovery (etcd, or embedded).
    pub discovery: ControlHealth,
    /// The event bus (NATS, or embedded).
    pub bus: ControlHealth,
    /// KV events applied to the prefix index.
    pub kv_events: u64,
    /// Gaps seen in a source's event ids.
    pub kv_event_gaps: u64,
    /// Dumps applied.
    pub kv_dumps: u64,
    /// Dump requests sent after gaps.
    pub dump_requests: u64,
    /// Event messages dropped as malformed or of another contract version.
    pub kv_events_malformed: u64,
    /// Events of workers not in discovery.
    pub kv_events_unknown_worker: u64,
    /// The bus's lag: the largest age of the workers' latest load reports when they
    /// arrived, milliseconds (the same path as their KV events; clocks of other hosts
    /// add their skew).
    pub bus_lag_ms: Option<f64>,
    /// The routing mode.
    pub routing: String,
}

/// A backend's part of the dashboard.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct BackendView {
    /// Workers serving now.
    pub workers: Vec<WorkerView>,
    /// Workers that left in the last minutes.
    pub departed: Vec<WorkerView>,
    /// KV fabric nodes in discovery (`kvfabric fabric`, role `fabric`): the G4 tier of the
    /// workers that use it. Their tier occupancy is their own host and disk tiers.
    pub fabric: Vec<WorkerView>,
    /// The control plane, for a routing backend.
    pub control: Option<ControlView>,
}
