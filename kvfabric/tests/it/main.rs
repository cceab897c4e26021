//! The integration tests of `kvfabric`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod cuda;
mod gpu_memory;
mod layouts;
mod rdma;
mod transfer;
