//! The frontend↔worker frames from a hostile peer: a worker decodes `WorkerRequest`s, a
//! frontend decodes `GenEvent`s. Whatever the bytes: a typed error or a value, never a panic;
//! a decoded value encodes, and what it encodes to decodes again (one whole frame).
#![no_main]

use kvfabric::contract::worker::{encode_header, HEADER_BYTES};
use kvfabric_serving::engine::GenEvent;
use kvfabric_serving::protocol::{decode_frame, WorkerRequest, MAX_FRAME};
use libfuzzer_sys::fuzz_target;

fn round_trip<T: serde::Serialize + serde::de::DeserializeOwned>(data: &[u8]) {
    if let Ok(Some((value, used))) = decode_frame::<T>(data) {
        assert!(used >= HEADER_BYTES && used <= data.len() && used - HEADER_BYTES <= MAX_FRAME);
        let json = serde_json::to_vec(&value).expect("a decoded value encodes");
        let mut frame = encode_header(json.len()).expect("under the limit").to_vec();
        frame.extend_from_slice(&json);
        let (_, n) = decode_frame::<T>(&frame).expect("re-decodes").expect("whole frame");
        assert_eq!(n, frame.len());
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<WorkerRequest>(data);
    round_trip::<GenEvent>(data);
    // The JSON body alone, framed honestly: the parser sees every input.
    if let Ok(header) = encode_header(data.len()) {
        let mut framed = header.to_vec();
        framed.extend_from_slice(data);
        round_trip::<WorkerRequest>(&framed);
        round_trip::<GenEvent>(&framed);
    }
});
