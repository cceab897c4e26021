//! kvfabric-tiers — the tiered KV block store (G1 device, G2 host, G3 disk, G4 remote).
//!
//! Not built yet: the tiered-store issue fills this crate. It will guarantee that a pinned
//! block is never evicted, that a looked-up block's bytes are what was stored, and that a
//! corrupt block on disk is dropped, never served.
