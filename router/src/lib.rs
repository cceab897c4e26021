//! kvfabric-router — KV-aware routing over a prefix index fed by KV events.
//!
//! Not built yet: the router issue fills this crate. Its index and policy will be free of
//! I/O and clock, so that they can be tested exhaustively and deterministically.
