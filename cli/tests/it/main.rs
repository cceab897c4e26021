//! The integration tests of `kvfabric-cli`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod attach;
mod cli;
mod common;
mod control_plane;
mod dashboard;
mod disagg;
mod distributed;
mod fabric;
mod hostile;
mod hosts;
mod logging;
mod planner;
mod prometheus;
mod serve_llama;
mod tier_crash;
mod trace_agreement;
mod transfer_processes;
