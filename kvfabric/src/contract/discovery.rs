//! What kvfabric's processes are in discovery: every kind, and what each registers. A serving
//! worker: the model it serves, how to tokenize for it, where and how requests reach it, its
//! role. A fabric node: its transfer agent and the size of the blocks it stores. Frontends,
//! routers, planners, `kvfabric attach` and the C ABI read and write these; none of them needs
//! an engine to do so.

use std::net::SocketAddr;

use crate::endpoint::AgentMetadata;
use crate::layout::BlockLayout;

/// A worker's (or a fabric node's) id in routing: stable across processes, the XXH3-64 of its
/// instance name, so every router and frontend that sees the same name derives the same id.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct WorkerId(pub u64);

impl WorkerId {
    /// The id of the instance `name`.
    pub fn of_name(name: &str) -> Self {
        WorkerId(xxhash_rust::xxh3::xxh3_64(name.as_bytes()))
    }
}

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The discovery kind of KV fabric nodes (`kvfabric fabric`).
pub const FABRIC_KIND: &str = "fabric";

/// What a fabric node registers in discovery.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeInfo {
    /// The node's agent metadata (transfer address, exported regions).
    pub agent: AgentMetadata,
    /// Bytes per block it stores.
    pub block_bytes: u64,
}

/// What a model is, as a worker registers it and the frontend shows it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ModelInfo {
    /// The served model's id.
    pub id: String,
    /// Context length, tokens.
    pub context_len: usize,
    /// The layout of its KV blocks in the store.
    pub layout: BlockLayout,
}

/// The discovery kind of workers.
pub const WORKER_KIND: &str = "worker";

/// The discovery kind of prefill workers.
pub const PREFILL_KIND: &str = "prefill";

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode (the default).
    #[default]
    Aggregated,
    /// Computes prompts' KV for decode workers.
    Prefill,
    /// Serves requests, prefilling long prompts remotely.
    Decode,
}

/// What a worker registers in discovery.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WorkerMetadata {
    /// The model it serves.
    pub model: ModelInfo,
    /// How to tokenize for it.
    pub codec: CodecSpec,
    /// Its request port.
    pub addr: SocketAddr,
    /// Its role.
    #[serde(default)]
    pub role: Role,
    /// How requests reach it: kvfabric's framed protocol (its own workers), or an engine's
    /// OpenAI-compatible HTTP API (an engine behind `kvfabric attach`).
    #[serde(default = "WorkerApi::registered_before_versions")]
    pub api: WorkerApi,
    /// Its store as other workers pull from it: its transfer agent and block size (None: it
    /// serves no pulls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<NodeInfo>,
}

/// How a frontend sends a worker its requests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerApi {
    /// kvfabric's request protocol on `addr` (authenticated, framed JSON; [`super::worker`]).
    Kvfabric {
        /// The version of the protocol it speaks (1 when a worker registered none).
        #[serde(default = "protocol_v1")]
        protocol: u8,
    },
    /// An OpenAI-compatible server on `addr` (vLLM, SGLang, TensorRT-LLM's `trtllm-serve`):
    /// requests go to `/v1/completions` as token ids.
    OpenAi {
        /// The model name the engine serves (its `--served-model-name`).
        model: String,
        /// The engine schedules by the `priority` field (vLLM with `--scheduling-policy
        /// priority`): a request's class is forwarded as its priority. Without it the field is
        /// not sent (vLLM refuses a priority it does not schedule by).
        #[serde(default)]
        priority: bool,
    },
}

/// How a worker's prompts are tokenized, as it registers it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CodecSpec {
    /// The vocabulary and chat template of a GGUF file (a path the frontend can read), or a
    /// tokenizer.json next to it.
    Gguf {
        /// The GGUF file.
        path: std::path::PathBuf,
        /// A tokenizer.json overriding the GGUF's vocabulary.
        tokenizer: Option<std::path::PathBuf>,
    },
    /// One token per byte (the mock engine).
    Bytes,
    /// A Hugging Face model directory's tokenizer.json and tokenizer_config.json (a path the
    /// frontend can read; the mock mirroring a model).
    ModelDir {
        /// The directory.
        path: std::path::PathBuf,
    },
}

impl Default for WorkerApi {
    /// kvfabric's request protocol, in this build's version.
    fn default() -> Self {
        WorkerApi::Kvfabric { protocol: super::worker::PROTOCOL }
    }
}

impl WorkerApi {
    /// What a registration without `api` means: a kvfabric worker from before the field, which
    /// spoke version 1.
    fn registered_before_versions() -> Self {
        WorkerApi::Kvfabric { protocol: 1 }
    }
}

fn protocol_v1() -> u8 {
    1
}
