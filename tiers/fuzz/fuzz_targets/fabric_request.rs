//! Fuzzes the fabric node's request decoder: any method and body from an authenticated but
//! hostile peer decodes to a checked request or a typed error, never a panic, and an accepted
//! GET or PUT is within the per-call bound.
#![no_main]

use kvfabric_tiers::remote::protocol::{Request, BLOCKS_PER_CALL_MAX, LOOKUP_HASHES_MAX};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&m, body)) = data.split_first() else { return };
    // Methods 0..=6: the five known ones and unknown neighbours.
    match Request::decode(u16::from(m % 7), body) {
        Ok(Request::Get(b) | Request::Put(b)) => assert!(b.blocks.len() <= BLOCKS_PER_CALL_MAX),
        Ok(Request::Lookup(l) | Request::Prefix(l)) => {
            assert!(l.hashes.len() <= LOOKUP_HASHES_MAX)
        }
        Ok(Request::Hello(_)) | Err(_) => {}
    }
});
