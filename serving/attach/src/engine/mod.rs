//! Engines' own KV events (vLLM, SGLang) over ZeroMQ, in kvfabric's terms.
//!
//! - [`zmtp`]: the ZeroMQ wire protocol, bounded (SUB and DEALER over TCP);
//! - [`subscriber`]: the engine's PUB stream and its replay endpoint, in sequence order;
//! - [`sequence`]: the ordering and replay rules, as a pure state machine;
//! - [`decode`]: the msgpack batches as vLLM and SGLang publish them ([`msgpack`]);
//! - [`mirror`]: an engine's blocks keyed by kvfabric's sequence hashes, turning engine
//!   events into kvfabric's [`kvfabric::events::KvEventData`] and answering dumps.
//!
//! `kvfabric attach` puts these together for one engine instance and relays the result onto
//! the control plane, where every router reads it like any worker's events.

pub mod decode;
pub mod mirror;
pub mod msgpack;
pub mod sequence;
pub mod subscriber;
pub mod zmtp;

pub use decode::{decode_batch, DecodeError, EngineBatch, EngineEvent, EngineHash, Flavor};
/// The mirror's block size (`kvfabric::units`), for callers that do not depend on `kvfabric`.
pub use kvfabric::units::BlockTokens;
pub use mirror::{EngineMirror, MirrorStats};
pub use subscriber::{EventsEndpoint, FeedItem, Subscriber, SubscriberConfig};
