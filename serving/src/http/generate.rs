//! Driving a generation: submitting a checked request to the backend, following its events
//! (timing, usage, cancellation on drop) and answering in one piece when not streaming.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::engine::{CacheHits, EngineError, EventRx, FinishReason, GenEvent, GenerateRequest};
use crate::metrics::class::ClassOutcome;
use crate::metrics::Outcome;

use super::api::{request_id, ApiError, Endpoint, Parsed};
use super::AppState;

/// How the answer goes out: streamed (with a usage chunk or not) or whole.
pub(super) struct Answer {
    pub(super) stream: bool,
    pub(super) include_usage: bool,
}

/// Submits a checked request and waits for its admission; a refusal is the error response.
pub(super) async fn start(
    st: Arc<AppState>,
    endpoint: Endpoint,
    parsed: Result<Parsed, ApiError>,
    started: Instant,
) -> Result<(Generation, Answer), Response> {
    // A request refused at submission (a full queue) still counts in its class.
    let class = parsed.as_ref().ok().and_then(|(_, _, c)| c.class.as_ref().map(|(i, _)| *i));
    let submitted = parsed.and_then(|(prompt, max_tokens, c)| {
        let req = GenerateRequest {
            prompt,
            max_tokens,
            sampling: c.sampling,
            stop: c.stop.clone(),
            ignore_eos: c.ignore_eos,
            timeout: st.cfg.request_timeout,
            class: c.class.as_ref().map(|(_, h)| h.clone()),
            cache_salt: c.cache_salt.clone(),
            tenant: c.tenant.clone(),
            pull: None,
        };
        let rx = st.backend.submit(&c.entry.info.id, req)?;
        Ok((rx, c))
    });
    let (rx, c) = match submitted {
        Ok(x) => x,
        Err(e) => {
            // The client's mistakes (400) are not the class's misses.
            if let Some(i) = class.filter(|_| e.is_shed() || !e.status.is_client_error()) {
                st.metrics.class.submitted(i);
                st.metrics.class.finished(i, ClassOutcome::of(&e), None, None);
            }
            return Err(st.fail(e));
        }
    };
    st.metrics.arrival();
    if let Some(i) = class {
        st.metrics.class_arrival(i);
        st.metrics.class.submitted(i);
    }
    let mut gen = Generation {
        class,
        first_token_at: None,
        gaps: Duration::ZERO,
        class_outcome: None,
        st: st.clone(),
        rx,
        model: c.entry.info.id.clone(),
        worker: None,
        remote_prefill: None,
        id: request_id(if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" }),
        endpoint,
        started,
        last_token: None,
        prompt_tokens: 0,
        cached: CacheHits::default(),
        completion_tokens: 0,
        deadline: tokio::time::Instant::from_std(started + st.cfg.request_timeout),
        finished: false,
    };
    // The status is decided by the first event: admitted, or refused (429, 400, ...).
    if let Err(e) = gen.admitted().await {
        gen.class_outcome = Some(ClassOutcome::of(&e));
        gen.finish(false);
        return Err(st.fail(e));
    }
    Ok((gen, Answer { stream: c.stream, include_usage: c.include_usage }))
}

/// One generation as the frontend follows it: events, timing, usage.
pub(super) struct Generation {
    pub(super) st: Arc<AppState>,
    rx: EventRx,
    model: String,
    /// The worker that serves it (remote backends).
    worker: Option<String>,
    /// Its prompt's remote prefill, if any.
    remote_prefill: Option<crate::engine::RemotePrefill>,
    id: String,
    pub(super) endpoint: Endpoint,
    started: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    cached: CacheHits,
    completion_tokens: usize,
    deadline: tokio::time::Instant,
    finished: bool,
    /// Its service class (index into the server's classes).
    class: Option<usize>,
    /// Its first token's time after arrival, and the sum of the gaps after it.
    first_token_at: Option<Duration>,
    gaps: Duration,
    /// How it ended, for its class's metrics (set on a failure; Ok otherwise).
    class_outcome: Option<ClassOutcome>,
}

impl ClassOutcome {
    fn of(e: &ApiError) -> Self {
        if e.is_shed() {
            ClassOutcome::Shed
        } else if e.is_expired() {
            ClassOutcome::Expired
        } else {
            ClassOutcome::Failed
        }
    }
}

/// What the next engine event means for the client.
pub(super) enum Next {
    Text(String),
    Done(FinishReason, String),
    Failed(ApiError),
}

impl Generation {
    /// The worker that serves it (remote backends).
    pub(super) fn worker(&self) -> Option<&str> {
        self.worker.as_deref()
    }

    /// Waits for the backend to admit the request.
    async fn admitted(&mut self) -> Result<(), ApiError> {
        let ev = match tokio::time::timeout_at(self.deadline, self.rx.recv()).await {
            Err(_) => {
                tracing::warn!(timeout = ?self.st.cfg.request_timeout, "request deadline reached before the backend admitted it (no first token)");
                return Err(EngineError::Deadline { timeout: self.st.cfg.request_timeout }.into());
            }
            Ok(None) => return Err(EngineError::Stopped.into()),
            Ok(Some(ev)) => ev,
        };
        match ev {
            GenEvent::Started { prompt_tokens, cached, worker, remote_prefill } => {
                self.prompt_tokens = prompt_tokens;
                self.cached = cached;
                self.worker = worker;
                self.remote_prefill = remote_prefill;
                Ok(())
            }
            GenEvent::Error(e) => Err(e.into()),
            other => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("backend sent {other:?} before admitting the request"),
                "server_error",
            )),
        }
    }

    pub(super) async fn next(&mut self) -> Next {
        loop {
            let ev = match tokio::time::timeout_at(self.deadline, self.rx.recv()).await {
                Err(_) => {
                    tracing::warn!(worker = ?self.worker, timeout = ?self.st.cfg.request_timeout, "request deadline reached while streaming");
                    return Next::Failed(
                        EngineError::Deadline { timeout: self.st.cfg.request_timeout }.into(),
                    );
                }
                Ok(None) => return Next::Failed(EngineError::Stopped.into()),
                Ok(Some(ev)) => ev,
            };
            match ev {
                GenEvent::Started { .. } | GenEvent::Accepted { .. } => {}
                GenEvent::Token { text, .. } => {
                    let now = Instant::now();
                    let m = &self.st.metrics;
                    match self.last_token {
                        None => {
                            let d = now - self.started;
                            m.first_token(d);
                            self.first_token_at = Some(d);
                            if let Some(i) = self.class {
                                m.class_ttft(i, d);
                                m.class.first_token(i, d);
                            }
                        }
                        Some(t) => {
                            m.inter_token(now - t);
                            self.gaps += now - t;
                            if let Some(i) = self.class {
                                m.class.inter_token(i, now - t);
                            }
                        }
                    }
                    self.last_token = Some(now);
                    self.completion_tokens += 1;
                    if !text.is_empty() {
                        return Next::Text(text);
                    }
                }
                GenEvent::Done { reason, completion_tokens, text } => {
                    self.completion_tokens = completion_tokens;
                    return Next::Done(reason, text);
                }
                GenEvent::Cached(c) => self.cached = c,
                GenEvent::Error(e) => {
                    let e: ApiError = e.into();
                    self.class_outcome = Some(ClassOutcome::of(&e));
                    return Next::Failed(e);
                }
            }
        }
    }

    /// Counts the request in its class: how it ended, its TTFT and its mean time per output
    /// token.
    fn count_class(&self, outcome: ClassOutcome) {
        let Some(i) = self.class else { return };
        let tpot = (self.completion_tokens > 1)
            .then(|| self.gaps / (self.completion_tokens as u32 - 1).max(1));
        self.st.metrics.class.finished(i, outcome, self.first_token_at, tpot);
    }

    pub(super) fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens() },
        })
    }

    /// Prompt tokens whose KV was reused, not counting those a prefill worker computed for
    /// this request.
    fn cached_tokens(&self) -> usize {
        let remote = self.remote_prefill.as_ref().map_or(0, |r| r.tokens);
        self.cached.total().saturating_sub(remote)
    }

    /// kvfabric's own details: where the prompt's KV came from and who served it.
    pub(super) fn details(&self) -> Value {
        json!({
            "worker": self.worker,
            "cached_tokens": self.cached,
            "remote_prefill": self.remote_prefill,
        })
    }

    fn model(&self) -> &str {
        &self.model
    }

    /// Counts a finished request.
    pub(super) fn finish(&mut self, ok: bool) {
        self.finished = true;
        let m = &self.st.metrics;
        if ok {
            m.request(Outcome::Ok);
            m.duration(self.started.elapsed());
        } else if self.last_token.is_none() {
            m.no_first_token(self.started.elapsed());
            if let Some(i) = self.class {
                m.class_ttft(i, self.started.elapsed());
            }
        }
        let outcome =
            if ok { ClassOutcome::Ok } else { self.class_outcome.unwrap_or(ClassOutcome::Failed) };
        self.count_class(outcome);
        self.count_tokens();
    }

    /// Counts the request's tokens: every request an engine admitted, whatever its end, so
    /// that prompt tokens and tokens from cache are over the same requests.
    fn count_tokens(&self) {
        let c = self.cached_by_tier();
        let (p, g) = (self.prompt_tokens as u64, self.completion_tokens as u64);
        self.st.metrics.tokens(p, g, c);
        if let Some(i) = self.class {
            self.st.metrics.class_tokens(i, p, g, c.iter().sum());
        }
    }

    /// [`Self::cached_tokens`] per tier (`metrics::CACHE_TIERS` order). The blocks a prefill
    /// worker wrote for this request are onboarded from host memory: they are taken off the
    /// host tier (then off the others, should there be fewer there).
    fn cached_by_tier(&self) -> [u64; 4] {
        let c = &self.cached;
        // Pulled from a peer's store: from another machine, as the fabric's hits are.
        let mut tiers =
            [c.device_tokens, c.host_tokens, c.disk_tokens, c.remote_tokens + c.peer_tokens];
        let mut computed = self.remote_prefill.as_ref().map_or(0, |r| r.tokens);
        for i in [1, 3, 2, 0] {
            let take = computed.min(tiers[i]);
            tiers[i] -= take;
            computed -= take;
        }
        tiers.map(|n| n as u64)
    }

    pub(super) fn chunk(
        &self,
        delta: Value,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": null })
            }
            Endpoint::Completions => json!({
                "index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                "finish_reason": finish, "logprobs": null,
            }),
        };
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut v = json!({
            "id": self.id, "object": object, "created": self.st.created_now(),
            "model": self.model(), "choices": [choice],
        });
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.finished {
            // The client went away mid-generation: the receiver drops with us, which
            // cancels the engine's work. Its tokens count as those of any other end.
            self.st.metrics.request(Outcome::Cancelled);
            self.count_class(ClassOutcome::Cancelled);
            self.count_tokens();
            self.finished = true;
        }
    }
}

pub(super) async fn whole_response(mut g: Generation) -> Response {
    let mut text = String::new();
    let (reason, tail) = loop {
        match g.next().await {
            Next::Text(t) => text.push_str(&t),
            Next::Done(r, t) => break (r, t),
            Next::Failed(e) => {
                g.finish(false);
                return g.st.fail(e);
            }
        }
    };
    text.push_str(&tail);
    g.finish(true);
    let choice = match g.endpoint {
        Endpoint::Chat => json!({
            "index": 0, "message": { "role": "assistant", "content": text },
            "finish_reason": reason, "logprobs": null,
        }),
        Endpoint::Completions => json!({
            "index": 0, "text": text, "finish_reason": reason, "logprobs": null,
        }),
    };
    let object = if g.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
    Json(json!({
        "id": g.id, "object": object, "created": g.st.created_now(), "model": g.model(),
        "choices": [choice], "usage": g.usage(), "kvfabric": g.details(),
    }))
    .into_response()
}
