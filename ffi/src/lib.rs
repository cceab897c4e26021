//! kvfabric-ffi — the C ABI of kvfabric (`libkvfabric`).
//!
//! Not built yet: the C ABI issue fills this crate, in the conventions of rustls-ffi (opaque
//! handles, result codes, a panic boundary on every export).
