//! The integration tests of `kvfabric-tiers`, one binary: each file below is a module,
//! so the crate's tests link once (docs/architecture.md, "Tests").

mod device_tier;
mod fabric_hostile;
mod fabric_two_way;
mod publish;
mod store;
