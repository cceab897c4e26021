//! kvfabric-planner — capacity planning, with no model runtime and no serving stack: what a
//! deployment needs for a workload and latency targets, and the live planner that scales it.
//!
//! - [`plan`]: the KV arithmetic of a model (bytes per token and per sequence, tier sizes,
//!   transfer times over links): `kvfabric plan`.
//! - [`sla`]: workers needed for a workload and TTFT/ITL targets from a measured engine
//!   profile, aggregated against disaggregated, with the reasons: `kvfabric plan --sla`.
//! - [`live`]: the live planner's decisions ([`live::Brain`], pure: the caller passes each
//!   interval's [`window::LoadWindow`]) and its loop over a [`window::LoadSource`] and a
//!   [`live::Scaler`] per pool.
//! - [`trace`]: public production traces (Mooncake FAST'25 JSONL) read as a stream, expanded
//!   into token ids, their infinite-cache limit and LRU reuse-vs-capacity curve.
//! - [`sim`]: a whole deployment in simulated time over kvfabric's real router and tier
//!   policies, replaying a trace or a synthetic workload ([`sim::conversations`]);
//!   [`sim::sizing`] and [`sim::capacity`] size deployments by replaying: `kvfabric plan
//!   --trace`, `kvfabric bench trace` and `kvfabric bench router`.
//! - [`window`]: what a frontend saw of its load over an interval; [`stats`]: quantiles.
//!
//! It depends on `kvfabric`, and on the router's and the tiers' policies (which the simulator
//! runs), only: a gateway or an operator's tool embeds it without candle,
//! tokenizers or an HTTP server. It reads no environment variables and installs no tracing
//! subscriber.

pub mod live;
pub mod plan;
pub mod sim;
pub mod sla;
pub mod stats;
pub mod trace;
pub mod window;
