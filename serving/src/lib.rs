//! kvfabric-serving — the serving layer and the `kvfabric` command-line binary.
//!
//! So far it holds capacity planning ([`plan`]) and benchmark statistics ([`stats`]); the
//! OpenAI-compatible frontend, the engines and the workers come with the serving issues. Like
//! every library crate of kvfabric, it installs no tracing subscriber and reads no
//! environment variables: the binary does.

pub mod plan;
pub mod stats;
