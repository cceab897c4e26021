//! The integration tests of `kvfabric-planner`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod sim;
mod trace;
