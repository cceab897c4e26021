//! Disaggregated prefill: the job a decode worker puts on a prefill worker's queue
//! ([`super::prefill_queue`]) and the result that comes back, as the transfer's notification
//! on success or on [`super::prefill_failed`] otherwise.
//!
//! Both are JSON carrying [`PREFILL_VERSION`] in `v` (absent means 1, the form before the
//! field). A prefill worker answers a job of another version with a failed result that says
//! so ([`PrefillHead::version_error`]), so the decode worker falls back to prefilling itself
//! and its log names the cause.

use crate::endpoint::AgentMetadata;
use crate::transfer::{Desc, TransportKind};

/// The version of the prefill messages this build writes and reads. 2: a job carries its
/// request's cache salt (a prefill worker of version 1 would name the blocks unsalted, and a
/// tenant's prompt would be cached where another's finds it).
pub const PREFILL_VERSION: u32 = 2;

fn v1() -> u32 {
    1
}

/// Where one block goes in the decode worker: its index in the prompt, and a descriptor of
/// the decode agent's memory (a reserved slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockTarget {
    /// Index of the block in the prompt.
    pub index: usize,
    /// The slot, in the decode worker's region.
    #[serde(flatten)]
    pub at: Desc,
}

/// A prefill job on a prefill worker's queue.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PrefillRequest {
    /// The message's version.
    #[serde(default = "v1")]
    pub v: u32,
    /// Unique per decode worker.
    pub id: u64,
    /// The decode worker's agent (the WRITE's peer).
    pub decode: AgentMetadata,
    /// The model.
    pub model: String,
    /// The prompt's full blocks' tokens.
    pub tokens: Vec<u32>,
    /// The blocks to send and where.
    pub blocks: Vec<BlockTarget>,
    /// Force a transport (else the agent chooses: shm on one host, tcp across).
    pub transport: Option<TransportKind>,
    /// Give up after this time (Unix milliseconds).
    pub deadline_unix_ms: u64,
    /// The request's cache salt ([`super::generate::GenerateRequest::cache_salt`]): the
    /// prefill worker names, finds and stores the blocks with it.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The request's service class ([`super::generate::GenerateRequest::class`]), its TTFT
    /// target counted from when the decode worker sent the job: the prefill worker's engine
    /// orders the jobs it holds by deadline, so a latency class's prompt is not queued
    /// behind batch prompts there either. Absent (older decode workers, or no class):
    /// first come first served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<super::generate::ClassHint>,
}

/// The message of the transfer's notification and of a failure report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefillResult {
    /// The message's version.
    #[serde(default = "v1")]
    pub v: u32,
    /// The request.
    pub id: u64,
    /// Whether the blocks were written.
    pub ok: bool,
    /// Time computing the prompt's KV (prefill worker), microseconds.
    pub compute_us: u64,
    /// Why it failed.
    pub error: Option<String>,
}

impl PrefillResult {
    /// A success.
    pub fn done(id: u64, compute_us: u64) -> Self {
        PrefillResult { v: PREFILL_VERSION, id, ok: true, compute_us, error: None }
    }

    /// A failure, and why.
    pub fn failed(id: u64, compute_us: u64, error: String) -> Self {
        PrefillResult { v: PREFILL_VERSION, id, ok: false, compute_us, error: Some(error) }
    }
}

/// What every version of a job has: enough to tell its decode worker that it cannot be read.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct PrefillHead {
    /// The message's version.
    #[serde(default = "v1")]
    pub v: u32,
    /// The request.
    pub id: u64,
    /// The decode worker.
    pub decode: DecodeName,
}

/// The decode worker's name in a job.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct DecodeName {
    /// Its agent's name.
    pub name: String,
}

impl PrefillHead {
    /// Why a job of this head cannot be served here, if its version is not ours.
    pub fn version_error(&self) -> Option<String> {
        (self.v != PREFILL_VERSION).then(|| {
            format!(
                "the job is prefill protocol version {}, this prefill worker speaks \
                 {PREFILL_VERSION}: run one release on decode and prefill workers",
                self.v
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegionId;

    #[test]
    fn a_block_target_is_an_index_and_a_descriptor_and_reads_the_unversioned_form() {
        let b = BlockTarget { index: 3, at: Desc::new(RegionId(7), 4096, 1024) };
        let j = serde_json::to_value(b).unwrap();
        assert_eq!(j, serde_json::json!({"index": 3, "region": 7, "offset": 4096, "len": 1024}));
        assert_eq!(serde_json::from_value::<BlockTarget>(j).unwrap(), b);
        // A result from before `v` is version 1.
        let r: PrefillResult =
            serde_json::from_str(r#"{"id": 1, "ok": true, "compute_us": 5, "error": null}"#)
                .unwrap();
        assert_eq!(r, PrefillResult { v: 1, ..PrefillResult::done(1, 5) });
    }

    #[test]
    fn a_job_of_another_version_is_named_as_such() {
        let head: PrefillHead =
            serde_json::from_str(r#"{"v": 9, "id": 4, "decode": {"name": "d1"}, "new": []}"#)
                .unwrap();
        let why = head.version_error().unwrap();
        assert!(why.contains("version 9"), "{why}");
        assert!(why.contains(&format!("speaks {PREFILL_VERSION}")), "{why}");
        let ours: PrefillHead = serde_json::from_value(
            serde_json::json!({"v": PREFILL_VERSION, "id": 4, "decode": {"name": "d1"}}),
        )
        .unwrap();
        assert!(ours.version_error().is_none());
        // A job from before `v` (version 1, no cache salt) is refused: it would name its
        // blocks unsalted.
        let old: PrefillHead =
            serde_json::from_str(r#"{"id": 4, "decode": {"name": "d1"}}"#).unwrap();
        assert!(old.version_error().is_some_and(|why| why.contains("version 1")));
    }
}
