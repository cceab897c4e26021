//! What a serving worker is to the rest of the system: its kinds in discovery, its role, and
//! the metadata it registers there (model, tokenizer, request address, role), which routing
//! frontends and decode workers read.

use std::net::SocketAddr;

use crate::engine::{EngineError, ModelInfo, TextCodec};

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
}

impl CodecSpec {
    /// Loads the codec (reads the GGUF's metadata, not its weights).
    pub fn load(&self) -> Result<TextCodec, EngineError> {
        match self {
            CodecSpec::Bytes => Ok(TextCodec::bytes()),
            CodecSpec::Gguf { path, tokenizer } => {
                TextCodec::from_gguf_path(path, tokenizer.as_deref())
            }
        }
    }
}
