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
//! - [`feed::IndexFeed`]: the thin async part — a task that keeps an index current from the
//!   KV events and dumps on the control plane (`kvfabric::contract`) and asks a source for a
//!   dump when its event ids show a gap; the routing frontend runs it.
//! - [`membership::Membership`]: the router service's state — workers and fabric nodes
//!   joining and leaving discovery, their load reports, the workers avoided, one policy per
//!   model — and the choice of a worker for a request. Model-agnostic: a frontend that sends
//!   requests (`kvfabric-serving`) says what it prepares for a worker through
//!   [`membership::Admission`].
//!
//! Engines' own KV events (vLLM, SGLang over ZeroMQ) are decoded by `kvfabric-attach`, which
//! relays them onto the control plane as any worker's events.
//!
//! The index and the policy are free of I/O and clock — the caller passes `now` and random draws — so they are
//! tested exhaustively (the index against a brute-force reference over random event streams).
//! The router depends on nothing but the `kvfabric` crate (hashes, KV events, the
//! control-plane contract).

pub mod feed;
pub mod index;
pub mod membership;
pub mod policy;
mod table;

pub use index::{Ingest, Overlap, PrefixIndex, Run, WorkerId};
pub use policy::{Decision, Load, Path, PullPlan, PullPricing, Router, RouterConfig, RoutingMode};
