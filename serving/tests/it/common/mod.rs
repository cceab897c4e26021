//! Helpers of the serving tests: the HTTP client and waits of `kvfabric::testkit::http`,
//! shared with the binary's tests (`cli/tests/it/common`).

pub use kvfabric::testkit::http::*;
