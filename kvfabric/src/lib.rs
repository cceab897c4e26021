//! kvfabric — the data plane of a KV-cache transfer engine for LLM inference.
//!
//! This crate is the bottom of the stack: everything else (the tiered store, the router, the
//! serving layer, the C ABI) is built on the vocabulary defined here.
//!
//! What it provides:
//! - [`layout`]: the shape of a model's KV cache (layers, heads, dtype, MLA) and the canonical
//!   block layout, one contiguous byte range per block, built from presets, Hugging Face
//!   `config.json` files or GGUF metadata.
//! - [`hash`]: Dynamo-compatible token-block and chained sequence hashes, the key of a KV
//!   block everywhere in kvfabric (the full spec with test vectors is in `docs/hashing.md`).
//! - [`gguf`]: a bounds-checked reader of GGUF headers (metadata and tensor infos).
//! - [`memory`]: registered regions (owned, shareable, external), leases, bounds checks.
//! - [`agent`], [`transfer`], [`transport`]: the transfer engine — one agent per process,
//!   READ/WRITE of descriptor lists with peers over `local`, `shm` and `tcp`, deadlines,
//!   cancellation, checksums and notifications. Beneath the transports: [`session`] (the
//!   authenticated connections between agents; handshake and request sequencing as sans-IO
//!   state machines in [`session::proto`]), [`endpoint`] (what transports see of their agent,
//!   and every descriptor check) and [`peer`] (a loaded peer).
//! - [`cuda`]: GPUs through the CUDA driver API, loaded at run time (feature `cuda`): device
//!   and pinned memory, copies on streams with events, IPC exports; without a driver, a typed
//!   reason instead of a panic.
//! - [`control`]: control-plane traits (`Discovery`, `EventBus`) with in-memory, etcd and
//!   NATS implementations.
//! - [`events`]: KV events (`Stored`/`Removed`/`Cleared` per tier, with monotonic ids) and
//!   the sink trait stores publish them to.
//! - [`contract`]: the control plane's topics and typed, versioned messages (KV events and
//!   dumps, loads, dump requests) that every publisher and consumer uses.
//! - [`queue`]: the one admission queue (earliest deadline first, class bounds, shares,
//!   expiry, preemption; sans IO), used by the engine's scheduler and the frontend's queue.
//! - [`health`]: the health document every process serves, each part filled by its owner.
//! - [`wire`]: the authenticated, length-prefixed binary protocol between agents.
//! - [`units`]: tokens per block (never zero), tokens, blocks, bytes, and the conversions
//!   between them.
//! - [`rng`]: the reproducible generator of every seeded draw.
//! - [`tls`]: TLS on every TCP port (rustls with *ring*): a process's certificates, reloaded
//!   on SIGHUP; mutual TLS between processes, HTTPS for the HTTP ports, TLS to etcd.
//! - [`secret`]: the one type of every secret (redacted, zeroed on drop).
//!
//! What it guarantees:
//! - Decoders of untrusted input (GGUF files, `config.json`) return typed errors and never
//!   panic, whatever the bytes.
//! - Hashes are stable across platforms and releases: they are specified byte for byte.
//! - A peer can never read or write outside the regions an agent exported to it: remote
//!   descriptors are checked on the side that owns the memory.
//! - No transfer hangs: each has a deadline, and a dead peer fails it with a typed error.
//! - Memory a transfer may still write stays alive and registered until the transfer ends.
//!
//! What it does not do: it installs no tracing subscriber and reads no environment variables.
//! The agent runs on the caller's tokio runtime and spawns tasks there, no threads of its own.
//! `unsafe` lives in [`memory`], the session's socket I/O and the transports, each block with
//! its `SAFETY` argument.

pub mod affinity;
pub mod agent;
pub mod contract;
pub mod control;
pub mod cuda;
pub mod endpoint;
pub mod events;
pub mod gguf;
pub mod hash;
pub mod health;
pub mod layout;
pub mod lockfile;
pub mod memory;
pub mod peer;
pub mod queue;
pub mod rng;
pub mod secret;
pub mod session;
pub mod tls;
pub mod transfer;
pub mod transport;
pub mod units;
pub mod wire;

/// Real etcd and NATS servers for integration tests (reads `PATH` to find them).
#[cfg(feature = "testkit")]
pub mod testkit;

pub use agent::{Agent, AgentConfig, AgentError, AgentLimits, AgentMetadata, Notification};
pub use hash::{BlockHash, HashSeed, SequenceHash, TokenBlockHasher};
pub use layout::{AttentionKind, BlockLayout, KvDtype, KvShape, ModelSpec};
pub use memory::{Region, RegionId, RegionOptions};
pub use transfer::{
    Desc, TransferError, TransferHandle, TransferOp, TransferRequest, TransferStatus, TransportKind,
};
