//! kvfabric-attach — an engine that kvfabric did not start (vLLM, SGLang) as a worker of
//! kvfabric's routers.
//!
//! - [`engine`]: the engines' own KV events over ZeroMQ (ZMTP, msgpack, the vLLM and SGLang
//!   batch shapes, replay in sequence order), mapped to kvfabric's block hashes and tiers.
//! - [`attachment`]: what `kvfabric attach` runs beside one engine instance: its registration
//!   in discovery (as a worker reached over its OpenAI-compatible API), its KV events relayed
//!   onto the bus as kvfabric events, its load from its own Prometheus metrics.
//! - [`http`]: the bounded `GET` of the engine's `/health` and `/metrics`.
//!
//! It depends on the `kvfabric` crate only: no model runtime, no tokenizer, no HTTP server,
//! so a gateway can embed it beside the router crate.

pub mod attachment;
pub mod engine;
pub mod http;

pub use attachment::{
    engine_load, AttachConfig, AttachError, AttachSnapshot, AttachStats, Attachment,
};
