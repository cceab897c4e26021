//! The integration tests of `kvfabric-ffi`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod affinity;
mod c_abi;
mod control_plane;
mod header;
