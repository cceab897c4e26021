//! kvfabric-serving — the serving layer (the `kvfabric` binary is `cli/`). The engines
//! live in `kvfabric-engine` (re-exported as [`engine`]) and capacity planning in
//! `kvfabric-planner`.
//!
//! - [`backend`]: what the HTTP frontend serves from — a [`backend::LocalBackend`] (an
//!   engine in this process), a [`routed::RoutedBackend`] (workers in discovery, KV-aware
//!   routing, streams that move when a worker stalls), a [`disagg::DecodeBackend`] (remote
//!   prefill, local decode).
//! - [`http`]: the OpenAI-compatible HTTP frontend over any backend, with its bounded
//!   listener and request bodies; [`dashboard`]: what its `/dashboard` shows.
//! - [`worker`]: a worker assembled (engine, store, publishers) and registered;
//!   [`protocol`]: what it registers and the framed TCP protocol between a routing frontend
//!   and a worker, with the frontend's pool of connections.
//! - [`disagg`]: disaggregated prefill and decode.
//! - [`openai`]: the client of an engine's OpenAI-compatible API, through which a routed
//!   frontend serves an engine that `kvfabric attach` (the `kvfabric-attach` crate) joined.
//! - [`profile`]: measuring an engine's prefill and decode times for planning.
//! - [`metrics`]: every component's metrics in Prometheus text.
//!
//! Like every library crate of kvfabric, it installs no tracing subscriber and reads no
//! environment variables: the binary does.

/// The engines and their scheduler (the `kvfabric-engine` crate, the one with a model
/// runtime), under the name the serving layer has always used for them.
pub use kvfabric_engine as engine;

pub mod backend;
pub mod classes;
pub mod dashboard;
pub mod disagg;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod profile;
pub mod protocol;
pub mod routed;
pub mod sse;
pub mod worker;
