//! Fuzzes the wire-frame decoder: any bytes must decode to a frame or a typed error, and a
//! decoded frame must re-encode to the same bytes.
#![no_main]

use kvfabric::wire::{Message, WireLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = WireLimits::default();
    if let Ok((header, msg)) = Message::decode_frame(data, &limits) {
        assert_eq!(msg.encode(header.request_id), data, "decode/encode round trip");
    }
    // Bodies of every kind, without a header.
    if let Some((&kind, body)) = data.split_first() {
        let _ = Message::decode(kind, body, &limits);
    }
});
