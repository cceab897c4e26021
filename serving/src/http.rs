//! The OpenAI-compatible HTTP frontend (axum): `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions` (streaming and not), `/health` and `/metrics`.
//!
//! Errors use OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with
//! the matching status: 400 for malformed JSON and bad parameters, 404 for an unknown model
//! or route, 413 for an oversize body, 429 when the engine's queue is full, 503 when it is
//! not running, 504 past the request deadline. A streaming client that disconnects drops its
//! event receiver, which cancels the generation and frees its KV.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::backend::{Backend, ModelEntry};
use crate::engine::{
    CacheHits, ChatMessage, EngineError, FinishReason, GenEvent, GenerateRequest, SamplingParams,
};
use crate::metrics::{self, Histogram};

/// Frontend limits.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A request fails after this long (504), streaming or not.
    pub request_timeout: Duration,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// `max_tokens` of a chat completion that sets none (capped by the context left).
    pub default_chat_max_tokens: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            request_timeout: Duration::from_secs(300),
            max_body_bytes: 4 << 20,
            default_chat_max_tokens: 1024,
        }
    }
}

/// Counters and histograms of the frontend.
#[derive(Debug)]
pub struct HttpMetrics {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    requests_ok: AtomicU64,
    requests_client_error: AtomicU64,
    requests_server_error: AtomicU64,
    requests_cancelled: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cached_tokens: AtomicU64,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics {
            ttft: Histogram::new(metrics::LATENCY_BUCKETS),
            itl: Histogram::new(metrics::ITL_BUCKETS),
            e2e: Histogram::new(metrics::LATENCY_BUCKETS),
            requests_ok: AtomicU64::new(0),
            requests_client_error: AtomicU64::new(0),
            requests_server_error: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
        }
    }
}

#[derive(Debug)]
struct AppState {
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
    metrics: HttpMetrics,
    created: u64,
}

/// The frontend's routes over a backend (a local engine, or remote workers).
pub fn router(backend: Arc<dyn Backend>, cfg: ServerConfig) -> Router {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let limit = cfg.max_body_bytes;
    let state = Arc::new(AppState { backend, cfg, metrics: HttpMetrics::default(), created });
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route", "not_found") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "invalid_request_error",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>, kind: &'static str) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    fn invalid(message: impl Into<String>, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            ..Self::new(StatusCode::BAD_REQUEST, message, "invalid_request_error")
        }
    }

    fn body(&self) -> Value {
        json!({ "error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code
        }})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let msg = e.to_string();
        match e {
            EngineError::Invalid { .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, msg, "invalid_request_error")
            }
            EngineError::ContextLength { .. } => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::new(StatusCode::BAD_REQUEST, msg, "invalid_request_error")
            },
            EngineError::Overloaded { .. } => ApiError {
                code: Some("rate_limit_exceeded"),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, msg, "rate_limit_error")
            },
            EngineError::Deadline { .. } => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, msg, "timeout")
            }
            EngineError::Stopped | EngineError::Unavailable { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, msg, "server_error")
            }
            EngineError::Model { .. } => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg, "server_error")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = st.backend.models().iter().map(|m| model_card(&st, m)).collect();
    Json(json!({ "object": "list", "data": data }))
}

async fn model(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    match st.backend.model(&id) {
        Some(m) => Ok(Json(model_card(&st, &m.info))),
        None => Err(unknown_model(&id)),
    }
}

fn model_card(st: &AppState, info: &crate::engine::ModelInfo) -> Value {
    json!({
        "id": info.id, "object": "model", "created": st.created, "owned_by": "kvfabric",
        "max_model_len": info.context_len,
    })
}

fn unknown_model(id: &str) -> ApiError {
    ApiError {
        code: Some("model_not_found"),
        param: Some("model"),
        ..ApiError::new(
            StatusCode::NOT_FOUND,
            format!("the model {id:?} does not exist"),
            "invalid_request_error",
        )
    }
}

async fn health(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(st.backend.health())
}

async fn prometheus(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    let m = &st.metrics;
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let mut out = String::new();
    metrics::labelled(
        &mut out,
        "kvfabric_requests_total",
        "counter",
        "Requests by outcome.",
        "outcome",
        &[
            ("ok", ld(&m.requests_ok)),
            ("client_error", ld(&m.requests_client_error)),
            ("server_error", ld(&m.requests_server_error)),
            ("cancelled", ld(&m.requests_cancelled)),
        ],
    );
    m.ttft.render(&mut out, "kvfabric_time_to_first_token_seconds", "Time to first token.");
    m.itl.render(&mut out, "kvfabric_inter_token_latency_seconds", "Time between tokens.");
    m.e2e.render(&mut out, "kvfabric_request_duration_seconds", "End-to-end request latency.");
    metrics::sample(
        &mut out,
        "kvfabric_prompt_tokens_total",
        "counter",
        "Prompt tokens.",
        ld(&m.prompt_tokens),
    );
    metrics::sample(
        &mut out,
        "kvfabric_generation_tokens_total",
        "counter",
        "Generated tokens.",
        ld(&m.completion_tokens),
    );
    metrics::sample(
        &mut out,
        "kvfabric_cached_prompt_tokens_total",
        "counter",
        "Prompt tokens whose KV came from the block store.",
        ld(&m.cached_tokens),
    );
    st.backend.render_metrics(&mut out);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

// ---- requests ----

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields common to both endpoints. Unknown fields are ignored, as OpenAI's own server
/// does; fields that would change the answer and are not supported are refused.
#[derive(Debug, Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    n: Option<i64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: bool,
    logprobs: Option<Value>,
    best_of: Option<i64>,
    #[serde(default)]
    echo: bool,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Option<Prompt>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct MessageIn {
    role: String,
    content: Option<Content>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Option<Vec<MessageIn>>,
    #[serde(flatten)]
    common: Common,
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() { "invalid JSON" } else { "invalid request" };
        ApiError::invalid(format!("{what}: {e}"), "body")
    })
}

/// What a request asks the engine for, checked.
struct Checked {
    entry: ModelEntry,
    max_tokens: Option<usize>,
    sampling: SamplingParams,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
}

fn check_common(st: &AppState, c: &Common) -> Result<Checked, ApiError> {
    let entry = match &c.model {
        None => return Err(ApiError::invalid("you must provide a model parameter", "model")),
        Some(m) => st.backend.model(m).ok_or_else(|| unknown_model(m))?,
    };
    if c.n.is_some_and(|n| n != 1) || c.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", "n"));
    }
    if c.logprobs.as_ref().is_some_and(|v| !v.is_null() && *v != json!(false)) {
        return Err(ApiError::invalid("logprobs are not supported", "logprobs"));
    }
    if c.echo {
        return Err(ApiError::invalid("echo is not supported", "echo"));
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        Some(n) if n < 1 => {
            return Err(ApiError::invalid("max_tokens must be at least 1", "max_tokens"))
        }
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature must be between 0 and 2", "temperature"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]", "top_p"));
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    if stop.len() > 4 {
        return Err(ApiError::invalid("at most 4 stop sequences", "stop"));
    }
    let seed = c.seed.unwrap_or_else(|| {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
            ^ NEXT_ID.fetch_add(1, Ordering::Relaxed).rotate_left(32)
    });
    Ok(Checked {
        entry,
        max_tokens,
        sampling: SamplingParams { temperature, top_p, seed },
        stop,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        ignore_eos: c.ignore_eos,
    })
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn request_id(prefix: &str) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    format!("{prefix}-{t:x}{n:04x}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

type Parsed = (Vec<u32>, usize, Checked);

type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// An unreadable or oversize body, in OpenAI's shape.
fn read_body(body: Body) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError {
        param: Some("body"),
        ..ApiError::new(e.status(), e.body_text(), "invalid_request_error")
    })
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let started = Instant::now();
    let r = read_body(body).and_then(|b| parse_completion(&st, &b));
    run(st, Endpoint::Completions, r, started).await
}

fn parse_completion(st: &AppState, body: &Bytes) -> Result<Parsed, ApiError> {
    {
        let req: CompletionRequest = parse(body)?;
        let checked = check_common(st, &req.common)?;
        let codec = checked.entry.codec.clone();
        let prompt = match req.prompt {
            None => return Err(ApiError::invalid("you must provide a prompt", "prompt")),
            Some(Prompt::Text(s)) => codec.encode(&s)?,
            Some(Prompt::Texts(v)) if v.len() == 1 => codec.encode(&v[0])?,
            Some(Prompt::Tokens(t)) => t,
            Some(Prompt::TokenLists(v)) if v.len() == 1 => v.into_iter().next().unwrap_or_default(),
            Some(_) => {
                return Err(ApiError::invalid("batched prompts are not supported", "prompt"))
            }
        };
        // OpenAI's default for completions.
        let max_tokens = checked.max_tokens.unwrap_or(16);
        Ok((prompt, max_tokens, checked))
    }
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let started = Instant::now();
    let r = read_body(body).and_then(|b| parse_chat(&st, &b));
    run(st, Endpoint::Chat, r, started).await
}

fn parse_chat(st: &AppState, body: &Bytes) -> Result<Parsed, ApiError> {
    {
        let req: ChatRequest = parse(body)?;
        let checked = check_common(st, &req.common)?;
        let Some(messages) = req.messages.filter(|m| !m.is_empty()) else {
            return Err(ApiError::invalid("messages must be a non-empty array", "messages"));
        };
        let mut msgs = Vec::with_capacity(messages.len());
        for m in messages {
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                return Err(ApiError::invalid(format!("unknown role {:?}", m.role), "messages"));
            }
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(s)) => s,
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => s.push_str(&t),
                            (k, _) => {
                                return Err(ApiError::invalid(
                                    format!("content parts of type {k:?} are not supported"),
                                    "messages",
                                ))
                            }
                        }
                    }
                    s
                }
            };
            let role = if m.role == "developer" { "system".into() } else { m.role };
            msgs.push(ChatMessage { role, content });
        }
        let codec = &checked.entry.codec;
        let text = codec.render_chat(&msgs)?;
        let prompt = codec.encode(&text)?;
        let left = checked.entry.info.context_len.saturating_sub(prompt.len());
        let max_tokens =
            checked.max_tokens.unwrap_or(st.cfg.default_chat_max_tokens.min(left.max(1)));
        Ok((prompt, max_tokens, checked))
    }
}

async fn run(
    st: Arc<AppState>,
    endpoint: Endpoint,
    parsed: Result<Parsed, ApiError>,
    started: Instant,
) -> Response {
    let submitted = parsed.and_then(|(prompt, max_tokens, c)| {
        let req = GenerateRequest {
            prompt,
            max_tokens,
            sampling: c.sampling,
            stop: c.stop.clone(),
            ignore_eos: c.ignore_eos,
            timeout: st.cfg.request_timeout,
        };
        let rx = st.backend.submit(&c.entry.info.id, req)?;
        Ok((rx, c))
    });
    let (rx, c) = match submitted {
        Ok(x) => x,
        Err(e) => return st.fail(e),
    };
    let mut gen = Generation {
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
        gen.finish(false);
        return st.fail(e);
    }
    let worker = gen.worker.clone();
    let mut response =
        if c.stream { stream_response(gen, c.include_usage) } else { whole_response(gen).await };
    if let Some(w) = worker.and_then(|w| axum::http::HeaderValue::from_str(&w).ok()) {
        response.headers_mut().insert("x-kvfabric-worker", w);
    }
    response
}

impl AppState {
    /// Counts a failed request by the side at fault.
    fn count_failure(&self, e: &ApiError) {
        let counter = if e.status.is_client_error() {
            &self.metrics.requests_client_error
        } else {
            &self.metrics.requests_server_error
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn fail(&self, e: ApiError) -> Response {
        self.count_failure(&e);
        e.into_response()
    }
}

/// One generation as the frontend follows it: events, timing, usage.
struct Generation {
    st: Arc<AppState>,
    rx: UnboundedReceiver<GenEvent>,
    model: String,
    /// The worker that serves it (remote backends).
    worker: Option<String>,
    /// Its prompt's remote prefill, if any.
    remote_prefill: Option<crate::engine::RemotePrefill>,
    id: String,
    endpoint: Endpoint,
    started: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    cached: CacheHits,
    completion_tokens: usize,
    deadline: tokio::time::Instant,
    finished: bool,
}

/// What the next engine event means for the client.
enum Next {
    Text(String),
    Done(FinishReason, String),
    Failed(ApiError),
}

impl Generation {
    /// Waits for the backend to admit the request.
    async fn admitted(&mut self) -> Result<(), ApiError> {
        let ev = match tokio::time::timeout_at(self.deadline, self.rx.recv()).await {
            Err(_) => {
                return Err(EngineError::Deadline { timeout: self.st.cfg.request_timeout }.into())
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

    async fn next(&mut self) -> Next {
        loop {
            let ev = match tokio::time::timeout_at(self.deadline, self.rx.recv()).await {
                Err(_) => {
                    return Next::Failed(
                        EngineError::Deadline { timeout: self.st.cfg.request_timeout }.into(),
                    )
                }
                Ok(None) => return Next::Failed(EngineError::Stopped.into()),
                Ok(Some(ev)) => ev,
            };
            match ev {
                GenEvent::Started { .. } => {}
                GenEvent::Token { text, .. } => {
                    let now = Instant::now();
                    let m = &self.st.metrics;
                    match self.last_token {
                        None => m.ttft.observe(now - self.started),
                        Some(t) => m.itl.observe(now - t),
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
                GenEvent::Error(e) => return Next::Failed(e.into()),
            }
        }
    }

    fn usage(&self) -> Value {
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
    fn details(&self) -> Value {
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
    fn finish(&mut self, ok: bool) {
        self.finished = true;
        let m = &self.st.metrics;
        if ok {
            m.requests_ok.fetch_add(1, Ordering::Relaxed);
            m.e2e.observe(self.started.elapsed());
        }
        m.prompt_tokens.fetch_add(self.prompt_tokens as u64, Ordering::Relaxed);
        m.completion_tokens.fetch_add(self.completion_tokens as u64, Ordering::Relaxed);
        m.cached_tokens.fetch_add(self.cached_tokens() as u64, Ordering::Relaxed);
    }

    fn chunk(&self, delta: Value, finish: Option<FinishReason>, include_usage: bool) -> Value {
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
            // cancels the engine's work.
            self.st.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
            self.finished = true;
        }
    }
}

impl AppState {
    fn created_now(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(self.created, |d| d.as_secs())
    }
}

async fn whole_response(mut g: Generation) -> Response {
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

fn stream_response(g: Generation, include_usage: bool) -> Response {
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
