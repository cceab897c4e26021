//! Engine KV event payloads (vLLM's and SGLang's msgpack) from arbitrary bytes: the decoder
//! never panics, and whatever it accepts the mirror applies without panicking.
#![no_main]

use kvfabric_attach::engine::{decode_batch, BlockTokens, EngineMirror, Flavor};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut mirror = EngineMirror::new(BlockTokens::of(16));
    let mut out = Vec::new();
    for flavor in [Flavor::Vllm, Flavor::Sglang] {
        if let Ok(batch) = decode_batch(data, flavor) {
            mirror.apply(&batch, &mut out);
            let _ = mirror.dump();
        }
    }
});
