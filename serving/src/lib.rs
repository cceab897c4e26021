//! kvfabric-serving — the serving layer and the `kvfabric` command-line binary.
//!
//! [`engine`] holds the engines (a real llama model on CPU, a mock) and the continuous
//! batching loop that serves them from the tiered block store; [`http`] the OpenAI-compatible
//! frontend; [`plan`] capacity planning; [`stats`] benchmark statistics. Like every library
//! crate of kvfabric, it installs no tracing subscriber and reads no environment variables:
//! the binary does.

pub mod backend;
pub mod disagg;
pub mod engine;
pub mod frontend;
pub mod http;
pub mod metrics;
pub mod plan;
pub mod stats;
pub mod worker;
