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
//!
//! What it guarantees:
//! - Decoders of untrusted input (GGUF files, `config.json`) return typed errors and never
//!   panic, whatever the bytes.
//! - Hashes are stable across platforms and releases: they are specified byte for byte.
//!
//! What it does not do: it installs no tracing subscriber, reads no environment variables and
//! spawns no threads on its own.

pub mod gguf;
pub mod hash;
pub mod layout;

pub use hash::{BlockHash, HashSeed, SequenceHash, TokenBlockHasher};
pub use layout::{AttentionKind, BlockLayout, KvDtype, KvShape, ModelSpec};
