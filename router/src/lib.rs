//! kvfabric-router — KV-aware routing over a prefix index fed by KV events.
//!
//! - [`index::PrefixIndex`]: which worker holds which block in which tier; concurrent
//!   (sharded read-write locks), fed by `Stored`/`Removed`/`Cleared` events, robust to
//!   duplicates, gaps (reported, so the caller asks for a dump), unknown workers and missing
//!   parents. Queried with a request's sequence hashes, it returns each worker's leading run
//!   of cached blocks and their tiers.
//! - [`policy::Router`]: the cost of each worker (prefill left after a tier-weighted overlap
//!   credit, plus decode load and queued prefill), softmax selection with a temperature
//!   (0 = argmin with a deterministic tie-break), the modes kv, round-robin, random and
//!   least-loaded, request tracking between load reports, and an approximate mode that
//!   predicts cache contents from its own decisions with a TTL.
//!
//! - [`service::RouterService`]: the thin async wrapper — a task that feeds the index from a
//!   stream of KV events and membership changes (a worker leaves the index the moment its
//!   `Left` arrives) and asks sources for a dump on gaps.
//! - [`sim`]: a deterministic routing simulation used by `kvfabric bench router`.
//!
//! The index and the policy are free of I/O and clock — the caller passes `now` and random draws — so they are
//! tested exhaustively (the index against a brute-force reference over random event streams).
//! The router depends on nothing but the `kvfabric` crate's hashes and KV event types.

pub mod index;
pub mod policy;
pub mod service;
pub mod sim;
mod table;

pub use index::{Ingest, Overlap, PrefixIndex, Run, WorkerId};
pub use policy::{Decision, Load, Router, RouterConfig, RoutingMode};
