//! kvfabric-serving — the serving layer (the `kvfabric` binary is `serving/cli`).
//!
//! - [`engine`]: the engines (a real llama model on CPU, a mock) and the continuous batching
//!   loop that serves them from the tiered block store.
//! - [`backend`]: what the HTTP frontend serves from — a [`backend::LocalBackend`] (an
//!   engine in this process), a [`routed::RoutedBackend`] (workers in discovery, KV-aware
//!   routing), a [`disagg::DecodeBackend`] (remote prefill, local decode).
//! - [`http`]: the OpenAI-compatible HTTP frontend over any backend.
//! - [`worker`]: what a worker registers in discovery (kinds, role, model, tokenizer);
//!   [`protocol`]: the framed TCP protocol between a routing frontend and a worker.
//! - [`disagg`]: disaggregated prefill and decode; [`plan`]: capacity planning; [`stats`]:
//!   benchmark statistics; [`metrics`]: Prometheus text.
//!
//! Like every library crate of kvfabric, it installs no tracing subscriber and reads no
//! environment variables: the binary does.

pub mod attach;
pub mod backend;
pub mod dashboard;
pub mod disagg;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod profile;
pub mod protocol;
pub mod routed;
pub mod worker;
