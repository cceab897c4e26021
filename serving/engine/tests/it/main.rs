//! The integration tests of `kvfabric-engine`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod block_table;
mod classes;
mod common;
mod llama_engine;
mod scheduler_input;
mod step_plan;
