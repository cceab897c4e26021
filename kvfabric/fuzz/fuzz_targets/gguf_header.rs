//! Fuzzes the GGUF header reader and the model-shape extraction on top of it.
#![no_main]

use kvfabric::gguf::{GgufHeader, GgufLimits};
use kvfabric::layout::ModelSpec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = GgufHeader::read(&mut &data[..], GgufLimits::default()) {
        let _ = ModelSpec::from_gguf(&h);
    }
});
