//! Streamed responses: a generation's events as server-sent events, in OpenAI's chunk
//! format, ending with `[DONE]`.

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::api::Endpoint;
use super::generate::{Generation, Next};

pub(super) fn stream_response(g: Generation, include_usage: bool) -> Response {
    /// Where a stream is.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Phase {
        /// Chat: the chunk with the assistant's role is not sent yet.
        Role,
        /// Text chunks as the engine makes them.
        Streaming,
        /// The final chunks are out (or queued in `pending`); `[DONE]` is next.
        Done,
        /// Over.
        Closed,
    }
    struct S {
        g: Generation,
        phase: Phase,
        /// Chunks to send before moving on, last first.
        pending: Vec<Value>,
    }
    let first_phase = if g.endpoint == Endpoint::Chat { Phase::Role } else { Phase::Streaming };
    let init = S { g, phase: first_phase, pending: Vec::new() };
    let stream = futures_util::stream::unfold(init, move |mut s| async move {
        loop {
            if let Some(v) = s.pending.pop() {
                return Some((Ok::<_, Infallible>(Event::default().data(v.to_string())), s));
            }
            match s.phase {
                Phase::Role => {
                    s.phase = Phase::Streaming;
                    let v = s.g.chunk(
                        json!({ "role": "assistant", "content": "" }),
                        None,
                        include_usage,
                    );
                    return Some((Ok(Event::default().data(v.to_string())), s));
                }
                Phase::Streaming => match s.g.next().await {
                    Next::Text(t) => {
                        let v = s.g.chunk(json!({ "content": t }), None, include_usage);
                        return Some((Ok(Event::default().data(v.to_string())), s));
                    }
                    Next::Done(reason, tail) => {
                        s.g.finish(true);
                        s.phase = Phase::Done;
                        // Pushed in reverse: popped from the end.
                        if include_usage {
                            let mut u = s.g.chunk(json!({}), None, false);
                            u["choices"] = json!([]);
                            u["usage"] = s.g.usage();
                            u["kvfabric"] = s.g.details();
                            s.pending.push(u);
                        }
                        s.pending.push(s.g.chunk(json!({}), Some(reason), include_usage));
                        if !tail.is_empty() {
                            s.pending.push(s.g.chunk(
                                json!({ "content": tail }),
                                None,
                                include_usage,
                            ));
                        }
                    }
                    Next::Failed(e) => {
                        s.g.finish(false);
                        s.g.st.count_failure(&e);
                        s.phase = Phase::Done;
                        return Some((Ok(Event::default().data(e.body().to_string())), s));
                    }
                },
                Phase::Done => {
                    s.phase = Phase::Closed;
                    return Some((Ok(Event::default().data("[DONE]")), s));
                }
                Phase::Closed => return None,
            }
        }
    });
    Sse::new(stream).into_response()
}
