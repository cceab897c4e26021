//! The API's request types, its errors in OpenAI's shape, and the parsing and validation
//! that turn a request body into what the engine is asked for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::backend::ModelEntry;
use crate::classes::{ClassError, ClassHint, Tenant, Tenants};
use crate::engine::{ChatMessage, EngineError, SamplingParams};

use super::AppState;

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
    /// Seconds, sent as `Retry-After` (429).
    retry_after_s: Option<u64>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>, kind: &'static str) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// The request was shed (429) to keep a more urgent class within its targets, or the
    /// queues are full.
    pub(super) fn is_shed(&self) -> bool {
        self.status == StatusCode::TOO_MANY_REQUESTS
    }

    /// The request's deadline passed (504).
    pub(super) fn is_expired(&self) -> bool {
        self.status == StatusCode::GATEWAY_TIMEOUT
    }

    pub(super) fn invalid(message: impl Into<String>, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            ..Self::new(StatusCode::BAD_REQUEST, message, "invalid_request_error")
        }
    }

    pub(super) fn body(&self) -> Value {
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
            EngineError::Overloaded { retry_after_ms, .. } => ApiError {
                code: Some("rate_limit_exceeded"),
                // Whole seconds, at least 1 (a client retrying at once would be shed again).
                retry_after_s: Some(retry_after_ms.unwrap_or(1000).div_ceil(1000).clamp(1, 3600)),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, msg, "rate_limit_error")
            },
            EngineError::Deadline { .. } => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, msg, "timeout")
            }
            // Only ever an event of a stream already under way (its status was sent).
            EngineError::SlowReader { .. } => {
                ApiError::new(StatusCode::REQUEST_TIMEOUT, msg, "timeout")
            }
            EngineError::Stopped | EngineError::Unavailable { .. } => ApiError {
                code: Some("service_unavailable"),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, msg, "server_error")
            },
            EngineError::Model { .. } => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg, "server_error")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

impl From<ClassError> for ApiError {
    fn from(e: ClassError) -> Self {
        let status = if matches!(e, ClassError::NotAllowed { .. }) {
            StatusCode::FORBIDDEN
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError {
            param: Some(e.param()),
            code: Some(match e {
                ClassError::Unknown { .. } => "unknown_service_class",
                ClassError::NotAllowed { .. } => "service_class_not_allowed",
                _ => "invalid_service_class",
            }),
            ..ApiError::new(status, e.to_string(), "invalid_request_error")
        }
    }
}

/// A `/v1/` request without the configured API key: 401.
pub(super) fn wrong_api_key() -> ApiError {
    ApiError {
        code: Some("invalid_api_key"),
        ..ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key (Authorization: Bearer ...)",
            "invalid_request_error",
        )
    }
}

/// No model is served now (no worker, or none registered yet): 503, retry later.
pub(super) fn no_model_served() -> ApiError {
    ApiError {
        code: Some("service_unavailable"),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no model is served now: no worker is available",
            "server_error",
        )
    }
}

pub(super) fn unknown_model(id: &str) -> ApiError {
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

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A completion's prompt: text, or token ids, one or a batch. A value of neither shape is
/// refused with where it went wrong (the token id and its position), not with serde's
/// untagged-enum message.
#[derive(Debug)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        fn token(v: &Value, at: &str) -> Result<u32, String> {
            v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| {
                format!("{at} is {v}, not a token id (an integer from 0 to {})", u32::MAX)
            })
        }
        fn tokens(list: &[Value], at: &str) -> Result<Vec<u32>, String> {
            list.iter().enumerate().map(|(i, v)| token(v, &format!("{at}[{i}]"))).collect()
        }
        let shape = "prompt must be a string, an array of strings, an array of token ids or \
                     an array of arrays of token ids";
        let list = match Value::deserialize(d)? {
            Value::String(s) => return Ok(Prompt::Text(s)),
            Value::Array(list) => list,
            _ => return Err(D::Error::custom(shape)),
        };
        let prompt = match list.first() {
            None => Prompt::Tokens(Vec::new()),
            Some(Value::String(_)) => Prompt::Texts(
                list.into_iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok(s),
                        other => Err(format!("prompt[{i}] is {other}, not a string")),
                    })
                    .collect::<Result<_, _>>()
                    .map_err(D::Error::custom)?,
            ),
            Some(Value::Array(_)) => Prompt::TokenLists(
                list.iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::Array(l) => tokens(l, &format!("prompt[{i}]")),
                        other => Err(format!("prompt[{i}] is {other}, not an array of token ids")),
                    })
                    .collect::<Result<_, _>>()
                    .map_err(D::Error::custom)?,
            ),
            Some(Value::Number(_)) => {
                Prompt::Tokens(tokens(&list, "prompt").map_err(D::Error::custom)?)
            }
            Some(_) => return Err(D::Error::custom(shape)),
        };
        Ok(prompt)
    }
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
    /// Any integer: a negative one (clients send -1) asks for a random seed.
    seed: Option<serde_json::Number>,
    stop: Option<OneOrMany>,
    n: Option<i64>,
    #[serde(default)]
    stream: bool,
    /// `{"include_usage": bool}` (checked in [`check_common`]: serde would take `[]` for it).
    stream_options: Option<Value>,
    #[serde(default)]
    ignore_eos: bool,
    logprobs: Option<Value>,
    best_of: Option<i64>,
    #[serde(default)]
    echo: bool,
    /// vLLM's: folded into the prompt's block hashes.
    cache_salt: Option<Value>,
    /// The spellings of a service class (`crate::classes`).
    service_tier: Option<Value>,
    priority: Option<Value>,
    nvext: Option<Value>,
    kvfabric: Option<Value>,
}

/// Longest `cache_salt` accepted.
const CACHE_SALT_MAX: usize = 1024;

/// What the frontend knows of a request besides its body: its headers and the tenant its API
/// key names.
#[derive(Clone, Copy)]
pub(super) struct Ctx<'a> {
    pub(super) headers: &'a axum::http::HeaderMap,
    pub(super) tenant: Option<&'a Tenant>,
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
        // serde_json reports a lone surrogate escape as a broken hex escape: say what it is.
        let text = e.to_string();
        let hint = if text.contains("hex escape") || text.contains("surrogate") {
            " (a \\u escape of a lone UTF-16 surrogate, D800-DFFF, is not a character: pair it, \
             or send the character as UTF-8)"
        } else {
            ""
        };
        ApiError::invalid(format!("{what}: {text}{hint}"), "body")
    })
}

/// What a request asks the engine for, checked.
pub(super) struct Checked {
    pub(super) entry: ModelEntry,
    max_tokens: Option<usize>,
    pub(super) sampling: SamplingParams,
    pub(super) stop: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) ignore_eos: bool,
    /// Its service class (index into the server's classes) and what the engine is told.
    pub(super) class: Class,
    /// The salt of its blocks: the tenant's namespace and the client's `cache_salt`.
    pub(super) cache_salt: Option<String>,
    /// The tenant of its API key, as workers are told.
    pub(super) tenant: Option<kvfabric::contract::generate::TenantHint>,
}

/// A request's class: its index in the server's classes, and what the engine is told.
type Class = Option<(usize, ClassHint)>;

/// The class and cache salt of a request.
fn class_and_salt(
    st: &AppState,
    ctx: Ctx<'_>,
    c: &Common,
) -> Result<(Class, Option<String>), ApiError> {
    let fields = crate::classes::ClassFields {
        kvfabric: c.kvfabric.as_ref(),
        nvext: c.nvext.as_ref(),
        service_tier: c.service_tier.as_ref(),
        priority: c.priority.as_ref(),
    };
    let classes = &st.cfg.classes;
    let named = classes.named(ctx.headers, fields)?;
    let index = match ctx.tenant {
        Some(t) => Tenants::class_for(t, classes, named)?,
        None => named.or(classes.enabled().then_some(classes.default_index())),
    };
    let class = index.and_then(|i| Some((i, classes.hint(i)?)));
    let client_salt = match &c.cache_salt {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.len() <= CACHE_SALT_MAX => Some(s.as_str()),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid(
                format!("cache_salt is longer than {CACHE_SALT_MAX} bytes"),
                "cache_salt",
            ))
        }
        Some(_) => return Err(ApiError::invalid("cache_salt must be a string", "cache_salt")),
    };
    let salt = match (ctx.tenant.map(Tenant::cache_salt), client_salt) {
        (Some(t), Some(c)) => Some(format!("{t}\u{0}{c}")),
        (Some(t), None) => Some(t),
        // Apart from every tenant's namespace: no client salt names a tenant's.
        (None, c) => c.filter(|c| !c.is_empty()).map(|c| format!("client\u{0}{c}")),
    };
    Ok((class, salt))
}

fn check_common(st: &AppState, ctx: Ctx<'_>, c: &Common) -> Result<Checked, ApiError> {
    let entry = match &c.model {
        None => return Err(ApiError::invalid("you must provide a model parameter", "model")),
        Some(m) => match st.backend.model(m) {
            Some(e) => e,
            // Nothing served at all is an outage, not the client's mistake.
            None if st.backend.models().is_empty() => return Err(no_model_served()),
            None => return Err(unknown_model(m)),
        },
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
    let seed = match &c.seed {
        Some(n) if n.as_u64().is_some() => n.as_u64(),
        Some(n) if n.as_i64().is_some() => None, // negative: random
        Some(n) => {
            return Err(ApiError::invalid(format!("seed must be an integer, got {n}"), "seed"))
        }
        None => None,
    };
    let seed = seed.unwrap_or_else(|| {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
            ^ NEXT_ID.fetch_add(1, Ordering::Relaxed).rotate_left(32)
    });
    let (class, cache_salt) = class_and_salt(st, ctx, c)?;
    Ok(Checked {
        class,
        cache_salt,
        tenant: ctx.tenant.map(Tenant::hint),
        entry,
        max_tokens,
        sampling: SamplingParams { temperature, top_p, seed },
        stop,
        stream: c.stream,
        include_usage: include_usage(&c.stream_options)?,
        ignore_eos: c.ignore_eos,
    })
}

/// `stream_options.include_usage`: an object's boolean, absent or null as false.
fn include_usage(options: &Option<Value>) -> Result<bool, ApiError> {
    let field = "stream_options";
    match options {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(ApiError::invalid(
                format!("stream_options.include_usage must be a boolean, got {other}"),
                field,
            )),
        },
        Some(other) => {
            Err(ApiError::invalid(format!("stream_options must be an object, got {other}"), field))
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn request_id(prefix: &str) -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    format!("{prefix}-{t:x}{n:04x}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completions,
    Chat,
}

pub(super) type Parsed = (Vec<u32>, usize, Checked);

pub(super) type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// An unreadable or oversize body, in OpenAI's shape.
/// Requests carry JSON: a `Content-Type` other than `application/json` (parameters allowed)
/// is refused with 415; none at all is accepted.
pub(super) fn check_content_type(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let Some(v) = headers.get(axum::http::header::CONTENT_TYPE) else { return Ok(()) };
    let essence = v.to_str().unwrap_or("").split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    Err(ApiError {
        param: Some("Content-Type"),
        ..ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("Content-Type must be application/json, not {:?}", essence),
            "invalid_request_error",
        )
    })
}

pub(super) fn read_body(body: Body) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError {
        param: Some("body"),
        ..ApiError::new(e.status(), e.body_text(), "invalid_request_error")
    })
}

pub(super) fn parse_completion(
    st: &AppState,
    ctx: Ctx<'_>,
    body: &Bytes,
) -> Result<Parsed, ApiError> {
    {
        let req: CompletionRequest = parse(body)?;
        let checked = check_common(st, ctx, &req.common)?;
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
        crate::engine::check_prompt(&checked.entry.info, &checked.entry.codec, &prompt)?;
        // OpenAI's default for completions.
        let max_tokens = checked.max_tokens.unwrap_or(16);
        Ok((prompt, max_tokens, checked))
    }
}

pub(super) fn parse_chat(st: &AppState, ctx: Ctx<'_>, body: &Bytes) -> Result<Parsed, ApiError> {
    {
        let req: ChatRequest = parse(body)?;
        let checked = check_common(st, ctx, &req.common)?;
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
                            ("text", None) => {
                                return Err(ApiError::invalid(
                                    "a content part of type \"text\" needs a \"text\" string",
                                    "messages",
                                ))
                            }
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
        crate::engine::check_prompt(&checked.entry.info, codec, &prompt)?;
        let left = checked.entry.info.context_len.saturating_sub(prompt.len());
        let max_tokens =
            checked.max_tokens.unwrap_or(st.cfg.default_chat_max_tokens.min(left.max(1)));
        Ok((prompt, max_tokens, checked))
    }
}
