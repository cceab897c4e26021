//! Fuzzes the disk tier's slot header, what a restart reads back from a file that may be torn
//! or foreign: any page decodes to a header or to nothing, never a panic. A second pass seals
//! the fuzzer's bytes with a valid magic and checksum, so that the field checks behind the
//! checksum are reached too; whatever decodes re-encodes to the same 64 bytes.
#![no_main]

use kvfabric_tiers::disk::format::{SlotHeader, MAGIC_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = SlotHeader::decode(data);
    if data.len() < 48 {
        return;
    }
    // Fields from the fuzzer, framed as a writer would frame them.
    let mut page = vec![0u8; 4096];
    page[..8].copy_from_slice(&MAGIC_BYTES);
    page[8..56].copy_from_slice(&data[..48]);
    let sum = xxhash_rust::xxh3::xxh3_64(&page[..56]);
    page[56..64].copy_from_slice(&sum.to_le_bytes());
    if let Some(h) = SlotHeader::decode(&page) {
        let mut again = vec![0u8; 4096];
        h.encode(&mut again);
        assert_eq!(again[..64], page[..64], "decode/encode round trip");
    }
});
