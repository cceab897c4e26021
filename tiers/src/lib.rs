//! kvfabric-tiers — the tiered KV block store: G1 device, G2 host, G3 disk, G4 remote.
//!
//! Core concepts:
//! - [`pool::SlotPool`]: the bookkeeping of one tier (fixed-size slots keyed by sequence
//!   hash, pins, eviction), pure and property-tested.
//! - [`policy`]: pluggable eviction ([`policy::Lru`] by default) and the frequency filter
//!   that keeps one-off blocks off the SSD.
//! - [`disk`]: G3, a file of checksummed slots on O_DIRECT io_uring (pread fallback), whose
//!   index is rebuilt from disk on restart.
//! - [`store::TieredStore`]: G2 host slots in a registered, shareable region (so the
//!   transfer engine moves blocks straight out of and into them) over G3 and G4, with offload
//!   under pressure or write-through, onboard with prefetch, KV events and [`metrics`]; and
//!   G1, an optional tier of device slots ([`store::DeviceTierConfig`]: a
//!   [`pool::SlotPool`] over a device region, filled and drained with the CUDA transport).
//! - [`remote::RemoteTier`]: G4, a client of the KV fabric's nodes, which it follows through
//!   discovery and spreads blocks over by consistent hashing.
//! - [`fabric::FabricNode`]: a fabric node, a store served to peers over the transfer
//!   engine and registered in discovery.
//! - [`publish::StorePublisher`]: a store's KV events and dumps on the control plane.
//!
//! Guarantees: a pinned block is never evicted; a looked-up block's bytes are what was
//! stored; a torn or corrupt block on disk is dropped, never served; a block that the disk
//! cannot take stays in host memory; every store and removal in every tier emits a KV event
//! with a monotonic id.

pub mod disk;
pub mod fabric;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod publish;
pub mod remote;
pub mod store;
pub mod synthetic;

pub use store::{BlockRef, Demoted, ScratchSlot, StoreConfig, StoreError, TieredStore, WriteSlot};
