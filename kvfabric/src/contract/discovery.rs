//! What kvfabric's processes are in discovery: every kind, and what each registers. A serving
//! worker: the model it serves, how to tokenize for it, where and how requests reach it, its
//! role. A fabric node: its transfer agent and the size of the blocks it stores. Frontends,
//! routers, planners, `kvfabric attach` and the C ABI read and write these; none of them needs
//! an engine to do so.

use std::net::SocketAddr;

use crate::endpoint::AgentMetadata;
use crate::layout::BlockLayout;

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
    #[serde(default)]
    pub api: WorkerApi,
}

/// How a frontend sends a worker its requests.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerApi {
    /// kvfabric's request protocol on `addr` (authenticated, framed JSON).
    #[default]
    Kvfabric,
    /// An OpenAI-compatible server on `addr` (vLLM, SGLang, TensorRT-LLM's `trtllm-serve`):
    /// requests go to `/v1/completions` as token ids.
    OpenAi {
        /// The model name the engine serves (its `--served-model-name`).
        model: String,
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
