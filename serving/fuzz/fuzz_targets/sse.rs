//! The server-sent-event reader against arbitrary bytes cut at arbitrary places: it returns
//! events or a bounded-size error, never panics, and the cut never changes the result.
#![no_main]

use kvfabric_serving::sse::SseParser;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&cut, bytes)) = input.split_first() else { return };
    let whole = SseParser::new(256).push(bytes);
    let mut p = SseParser::new(256);
    let mut pieces = Vec::new();
    let mut err = None;
    for c in bytes.chunks(usize::from(cut).max(1)) {
        match p.push(c) {
            Ok(e) => pieces.extend(e),
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    match whole {
        Ok(events) => {
            assert!(err.is_none());
            assert_eq!(events, pieces);
            assert!(events.iter().all(|e| e.data.len() <= 256));
        }
        Err(e) => assert_eq!(err, Some(e)),
    }
});
