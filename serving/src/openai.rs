//! The client side of an engine's OpenAI-compatible API (vLLM, SGLang, `trtllm-serve`): a
//! routed request goes to `/v1/completions` with the prompt as token ids, so that the engine
//! computes exactly the tokens the router hashed, streamed back as server-sent events and
//! turned into kvfabric's generation events. Everything read from the engine is bounded (an
//! event line, an error body) and every wait has the caller's deadline.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use crate::engine::{CacheHits, FinishReason, GenerateRequest};

/// Longest server-sent event (and line) accepted from an engine.
const MAX_EVENT: usize = crate::sse::MAX_EVENT_BYTES;
/// Longest error body read from an engine.
const MAX_ERROR_BODY: usize = 64 << 10;

/// Why a request to an engine failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenAiError {
    /// No connection (refused, timed out).
    #[error("connecting to {addr}: {why}")]
    Connect {
        /// The engine.
        addr: SocketAddr,
        /// Why.
        why: String,
    },
    /// The engine answered with an error status.
    #[error("the engine answered {status}: {message}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// Its message.
        message: String,
    },
    /// The stream broke or is not what the API promises.
    #[error("the engine's stream: {0}")]
    Stream(String),
}

impl OpenAiError {
    /// Whether another engine may serve the request (nothing was generated yet): the engine
    /// could not be reached, is overloaded or unavailable.
    pub fn retryable(&self) -> bool {
        match self {
            OpenAiError::Connect { .. } | OpenAiError::Stream(_) => true,
            OpenAiError::Status { status, .. } => matches!(*status, 429 | 502 | 503 | 504),
        }
    }
}

/// What one event of the stream says.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// New text (one engine step, usually one token).
    Text {
        /// The text.
        text: String,
        /// Its token ids, when the engine sends them.
        token_ids: Vec<u32>,
    },
    /// The end of the choice.
    Finish(FinishReason),
    /// The usage, at the end.
    Usage {
        /// Tokens generated.
        completion_tokens: usize,
        /// Prompt tokens served from the engine's prefix cache, when it reports them.
        cached: Option<CacheHits>,
    },
}

/// The request body for `req` on `model`; with `priority`, the engine schedules by it and
/// is told the request's class as vLLM's `priority` (lower first).
pub fn completion_body(model: &str, req: &GenerateRequest, priority: bool) -> Value {
    let mut body = json!({
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    if req.sampling.temperature > 0.0 {
        body["seed"] = json!(req.sampling.seed);
    }
    if !req.stop.is_empty() {
        body["stop"] = json!(req.stop);
    }
    if req.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    if let Some(c) = req.class.as_ref().filter(|_| priority) {
        body["priority"] = json!(c.priority);
    }
    if let Some(salt) = &req.cache_salt {
        // vLLM namespaces its own prefix cache by it (an engine that does not know the
        // field ignores it, as OpenAI's server does).
        body["cache_salt"] = json!(salt);
    }
    body
}

/// A streaming completion in progress.
#[derive(Debug)]
pub struct CompletionStream {
    body: Incoming,
    sse: crate::sse::SseParser,
    pending: std::collections::VecDeque<Chunk>,
    done: bool,
    conn: tokio::task::JoinHandle<()>,
}

impl Drop for CompletionStream {
    fn drop(&mut self) {
        // Closing the connection cancels the request in the engine.
        self.conn.abort();
    }
}

/// Sends `body` to the engine at `addr` and waits for the response's head (the engine
/// admitted the request), within `timeout`.
pub async fn start(
    addr: SocketAddr,
    body: &Value,
    timeout: Duration,
) -> Result<CompletionStream, OpenAiError> {
    let connect = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())
    };
    let (mut sender, conn) = match tokio::time::timeout(timeout, connect).await {
        Ok(Ok(x)) => x,
        Ok(Err(why)) => return Err(OpenAiError::Connect { addr, why }),
        Err(_) => {
            return Err(OpenAiError::Connect { addr, why: format!("no answer within {timeout:?}") })
        }
    };
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/v1/completions")
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::ACCEPT, "text/event-stream")
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .map_err(|e| OpenAiError::Stream(e.to_string()))?;
    let resp = match tokio::time::timeout(timeout, sender.send_request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            conn.abort();
            return Err(OpenAiError::Connect { addr, why: e.to_string() });
        }
        Err(_) => {
            conn.abort();
            return Err(OpenAiError::Connect {
                addr,
                why: format!("no answer within {timeout:?}"),
            });
        }
    };
    let status = resp.status().as_u16();
    let mut stream = CompletionStream {
        body: resp.into_body(),
        sse: crate::sse::SseParser::new(MAX_EVENT),
        pending: Default::default(),
        done: false,
        conn,
    };
    if status != 200 {
        let mut text = Vec::new();
        while text.len() < MAX_ERROR_BODY {
            match tokio::time::timeout(timeout, stream.body.frame()).await {
                Ok(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        text.extend_from_slice(&d[..d.len().min(MAX_ERROR_BODY)]);
                    }
                }
                _ => break,
            }
        }
        let v: Value = serde_json::from_slice(&text).unwrap_or(Value::Null);
        let message = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| String::from_utf8_lossy(&text).into_owned());
        return Err(OpenAiError::Status { status, message });
    }
    Ok(stream)
}

impl CompletionStream {
    /// The next chunk; None at the end of the stream (`[DONE]`, or the body's end).
    pub async fn next(&mut self) -> Result<Option<Chunk>, OpenAiError> {
        loop {
            if let Some(c) = self.pending.pop_front() {
                return Ok(Some(c));
            }
            if self.done {
                return Ok(None);
            }
            let frame = match self.body.frame().await {
                None => {
                    self.done = true;
                    continue;
                }
                Some(Err(e)) => return Err(OpenAiError::Stream(e.to_string())),
                Some(Ok(f)) => f,
            };
            let Ok(data) = frame.into_data() else { continue };
            let events =
                self.sse.push_data(&data).map_err(|e| OpenAiError::Stream(e.to_string()))?;
            for data in events {
                if !self.done {
                    self.event(&data)?;
                }
            }
        }
    }

    /// One event's data: a chunk, an error, or the end (`[DONE]`).
    fn event(&mut self, data: &str) -> Result<(), OpenAiError> {
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| OpenAiError::Stream(format!("an event that is not JSON: {e}")))?;
        if let Some(e) = v.get("error") {
            let message = e.get("message").and_then(Value::as_str).unwrap_or("error").to_string();
            let status = e.get("code").and_then(Value::as_u64).unwrap_or(500) as u16;
            return Err(OpenAiError::Status { status, message });
        }
        parse_chunk(&v, &mut self.pending);
        Ok(())
    }
}

/// The chunks of one streamed completion event.
pub fn parse_chunk(v: &Value, out: &mut std::collections::VecDeque<Chunk>) {
    if let Some(choice) = v.get("choices").and_then(Value::as_array).and_then(|c| c.first()) {
        let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
        let token_ids: Vec<u32> = choice
            .get("token_ids")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(|t| t.as_u64()).map(|t| t as u32).collect())
            .unwrap_or_default();
        if !text.is_empty() || !token_ids.is_empty() {
            out.push_back(Chunk::Text { text: text.to_string(), token_ids });
        }
        match choice.get("finish_reason").and_then(Value::as_str) {
            Some("length") => out.push_back(Chunk::Finish(FinishReason::Length)),
            Some(_) => out.push_back(Chunk::Finish(FinishReason::Stop)),
            None => {}
        }
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let completion_tokens =
            u.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
        let cached = u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .map(|n| CacheHits { device_tokens: n as usize, ..CacheHits::default() });
        out.push_back(Chunk::Usage { completion_tokens, cached });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_chunks_become_text_finish_and_usage() {
        let mut out = Default::default();
        let c: Value = serde_json::from_str(
            r#"{"choices":[{"index":0,"text":" hi","finish_reason":null}],"usage":null}"#,
        )
        .unwrap();
        parse_chunk(&c, &mut out);
        let end: Value =
            serde_json::from_str(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#).unwrap();
        parse_chunk(&end, &mut out);
        let usage: Value = serde_json::from_str(
            r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#,
        )
        .unwrap();
        parse_chunk(&usage, &mut out);
        let got: Vec<Chunk> = out.into_iter().collect();
        assert_eq!(got[0], Chunk::Text { text: " hi".into(), token_ids: vec![] });
        assert_eq!(got[1], Chunk::Finish(FinishReason::Length));
        let Chunk::Usage { completion_tokens: 2, cached: Some(c) } = got[2] else {
            panic!("{got:?}")
        };
        assert_eq!(c.total(), 32);
    }
}
