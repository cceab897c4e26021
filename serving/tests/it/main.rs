//! The integration tests of `kvfabric-serving`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod classes;
mod common;
mod control_plane;
mod pool;
mod profile;
mod serve_mock;
mod worker;
