//! The OpenAI-compatible HTTP frontend (axum): `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions` (streaming and not), `/health` and `/metrics`.
//!
//! Errors use OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with
//! the matching status: 400 for malformed JSON and bad parameters, 404 for an unknown model
//! or route, 413 for an oversize body, 429 when the engine's queue is full, 503 when it is
//! not running, 504 past the request deadline. A streaming client that disconnects drops its
//! event receiver, which cancels the generation and frees its KV.
//!
//! This file holds the configuration, the metrics, the shared state, the routes and the small
//! handlers; `api.rs` the request and error types with parsing and validation, `generate.rs`
//! the driving of a generation and whole responses, `sse.rs` streamed (SSE) responses.

mod api;
mod body;
mod dashboard;
mod generate;
pub mod listen;
mod sse;

pub use api::ApiError;
pub use body::BodyLimits;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::backend::Backend;
use crate::metrics::{self, Components, Outcome, Source};
use kvfabric::health::Health;

pub use crate::metrics::HttpMetrics;
use prometheus_client::registry::Registry;

use api::{
    check_content_type, parse_chat, parse_completion, read_body, unknown_model, Body, Endpoint,
};

/// Frontend limits.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A request fails after this long (504), streaming or not.
    pub request_timeout: Duration,
    /// Request bodies: the largest accepted (413 before reading past it), and how fast they
    /// must arrive (408 otherwise).
    pub body: BodyLimits,
    /// `max_tokens` of a chat completion that sets none (capped by the context left).
    pub default_chat_max_tokens: usize,
    /// The counters of the listener that serves these routes ([`listen::serve`]), shown in
    /// their `/metrics`.
    pub listen: metrics::ListenStats,
    /// When set, every `/v1/` request must carry `Authorization: Bearer <key>` (401
    /// otherwise, before its body is read); `/health` and `/metrics` stay open.
    pub api_key: Option<kvfabric::secret::Secret>,
    /// The frontend's live metrics (a clone shares them: the planner reads its load here).
    pub metrics: HttpMetrics,
    /// More components shown in `/metrics`, unlabelled (the planner's).
    pub sources: Vec<Arc<dyn Source>>,
    /// The server's name, as `/dashboard` shows it.
    pub name: String,
    /// Service classes (none: every request first come first served).
    pub classes: crate::classes::Classes,
    /// Tenants, by API key: each key is accepted as `api_key` is, pins the tenant's classes
    /// and namespaces its cache.
    pub tenants: crate::classes::Tenants,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            request_timeout: Duration::from_secs(300),
            body: BodyLimits::default(),
            default_chat_max_tokens: 1024,
            listen: metrics::ListenStats::default(),
            api_key: None,
            metrics: HttpMetrics::default(),
            sources: Vec::new(),
            name: "kvfabric".into(),
            classes: Default::default(),
            tenants: Default::default(),
        }
    }
}

impl ServerConfig {
    /// How `/v1/` requests are authenticated, in words: `open` (anyone who reaches the
    /// port), `API key`, `N tenants`, or both keys. Logged once as a server starts.
    pub fn authentication(&self) -> String {
        match (self.api_key.is_some(), self.tenants.len()) {
            (false, 0) => {
                "open (no API key, no tenants: /v1/ answers anyone who reaches it)".into()
            }
            (true, 0) => "API key".into(),
            (false, n) => format!("{n} tenants (each by its API key)"),
            (true, n) => format!("API key and {n} tenants (each by its API key)"),
        }
    }
}

struct AppState {
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
    metrics: HttpMetrics,
    registry: Registry,
    created: u64,
    started: Instant,
    history: dashboard::History,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").field("backend", &self.backend).finish()
    }
}

/// The frontend's routes over a backend (a local engine, or remote workers).
pub fn router(backend: Arc<dyn Backend>, cfg: ServerConfig) -> Router {
    router_with(backend, cfg, Vec::new())
}

/// The frontend's routes, with the metrics of in-process workers in its `/metrics`, each
/// labelled `worker="name"`.
pub fn router_with(
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
    workers: Vec<(String, Arc<dyn Source>)>,
) -> Router {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let limit = cfg.body;
    // Every deadline below is computed from it: bounded before any clock arithmetic.
    let mut cfg = cfg;
    cfg.request_timeout =
        cfg.request_timeout.clamp(Duration::from_millis(1), crate::engine::REQUEST_TIMEOUT_MAX);
    let metrics = cfg.metrics.clone();
    let mut components = Components::new().with(None, Arc::new(backend.clone()));
    for source in &cfg.sources {
        components = components.with(None, source.clone());
    }
    for (name, source) in workers {
        components = components.with(Some(name), source);
    }
    let mut registry = metrics::registry(&metrics, components);
    cfg.listen.register(&mut registry);
    metrics.classes(cfg.classes.list().iter().map(|c| (c.name.clone(), c.ttft, c.itl)));
    let state = AppState::new(backend, cfg, metrics, registry, created);
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/route", post(route_request))
        .route("/v1/route/release", post(route_release))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_api_key));
    finish(api, state, limit)
}

/// The routing decision alone (`kvfabric router`): `POST /v1/route` (and
/// `/v1/route/release`), `/v1/models`, `/health`, `/metrics`; no generation.
pub fn routing_router(backend: Arc<dyn Backend>, cfg: ServerConfig) -> Router {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let limit = cfg.body;
    let metrics = cfg.metrics.clone();
    let mut components = Components::new().with(None, Arc::new(backend.clone()));
    for source in &cfg.sources {
        components = components.with(None, source.clone());
    }
    let mut registry = metrics::registry(&metrics, components);
    cfg.listen.register(&mut registry);
    let state = AppState::new(backend, cfg, metrics, registry, created);
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/route", post(route_request))
        .route("/v1/route/release", post(route_release))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_api_key));
    finish(api, state, limit)
}

fn finish(api: Router<Arc<AppState>>, state: Arc<AppState>, limit: BodyLimits) -> Router {
    dashboard::History::start(&state);
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/", get(dashboard::page))
        .route("/dashboard/app.js", get(dashboard::script))
        .route("/dashboard/style.css", get(dashboard::style))
        .route("/dashboard/state", get(dashboard::state))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route", "not_found") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
                "invalid_request_error",
            )
        })
        .layer(axum::middleware::from_fn_with_state(limit, body::bounded))
        // Read once by `body::bounded`, within the same limit.
        .layer(DefaultBodyLimit::max(limit.bytes_max))
        .with_state(state)
}

/// The tenant a request's API key named (a request extension).
#[derive(Clone)]
struct TenantOf(Option<Arc<crate::classes::Tenant>>);

/// Checks the API key of a `/v1/` request, if one is configured (constant-time compare): the
/// server's key, or a tenant's (which the request then carries).
async fn require_api_key(
    State(st): State<Arc<AppState>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if st.cfg.api_key.is_some() || st.cfg.tenants.enabled() {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer)
            .unwrap_or("");
        let server = st.cfg.api_key.as_ref().is_some_and(|key| key.matches(given.as_bytes()));
        let tenant = st.cfg.tenants.by_key(given).cloned().map(Arc::new);
        if !server && tenant.is_none() {
            let e = api::wrong_api_key();
            st.count_failure(&e);
            return e.into_response();
        }
        req.extensions_mut().insert(TenantOf(tenant));
    }
    next.run(req).await
}

/// The token of an `Authorization: Bearer TOKEN` header value. The scheme is matched
/// without regard to case (`bearer`, `BEARER`: RFC 9110 section 11.1), with any spaces
/// around the token.
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start_matches(' ').split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim_matches(' '))
}

/// The tenant of a request (set by [`require_api_key`]).
fn tenant_of(ext: &axum::http::Extensions) -> Option<Arc<crate::classes::Tenant>> {
    ext.get::<TenantOf>().and_then(|t| t.0.clone())
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

/// The process's health document: the backend's parts, then each source's (a planner
/// beside it, the control plane, TLS), finished (status and reasons derived from the parts).
pub fn health_of(backend: &dyn Backend, sources: &[Arc<dyn metrics::Source>]) -> Health {
    metrics::health(backend.health(), sources)
}

/// A health document as `/health` answers it: the HTTP status says whether to send traffic
/// here, 200 for `ok` and `degraded`, 503 for anything else (no workers, failed), so load
/// balancers need not parse the body.
pub fn health_response(h: Health) -> Response {
    let code = if h.status.serving() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(h)).into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    health_response(health_of(st.backend.as_ref(), &st.cfg.sources))
}

async fn prometheus(State(st): State<Arc<AppState>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], metrics::encode(&st.registry))
}

/// `POST /v1/route`: a completion-shaped body (`prompt` as text or token ids) or a
/// chat-shaped one (`messages`), plus `"track": true` to count the request as the chosen
/// worker's load until `/v1/route/release`; answers where it would go and why.
async fn route_request(
    State(st): State<Arc<AppState>>,
    ext: axum::http::Extensions,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    let tenant = tenant_of(&ext);
    let ctx = api::Ctx { headers: &headers, tenant: tenant.as_deref() };
    let r = check_content_type(&headers).and_then(|()| read_body(body)).and_then(|b| {
        let v: Value = serde_json::from_slice(&b)
            .map_err(|e| ApiError::invalid(format!("malformed JSON: {e}"), "body"))?;
        let track = match v.get("track") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(t)) => *t,
            Some(_) => return Err(ApiError::invalid("track must be a boolean", "track")),
        };
        let parsed = if v.get("messages").is_some() {
            parse_chat(&st, ctx, &b)
        } else {
            parse_completion(&st, ctx, &b)
        }?;
        let (prompt, _, checked) = parsed;
        Ok(st.backend.explain(&checked.entry.info.id, &prompt, track)?)
    });
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => st.fail(e),
    }
}

/// `POST /v1/route/release` with `{"model", "request_id"}`: a tracked request is done.
async fn route_release(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    let r = check_content_type(&headers).and_then(|()| read_body(body)).and_then(|b| {
        let v: Value = serde_json::from_slice(&b)
            .map_err(|e| ApiError::invalid(format!("malformed JSON: {e}"), "body"))?;
        let model = v.get("model").and_then(Value::as_str).unwrap_or("");
        let Some(id) = v.get("request_id").and_then(Value::as_u64) else {
            return Err(ApiError::invalid("request_id must be an integer", "request_id"));
        };
        st.backend.release(model, id);
        Ok(json!({ "released": id }))
    });
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => st.fail(e),
    }
}

async fn completions(
    State(st): State<Arc<AppState>>,
    ext: axum::http::Extensions,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    generate_from(st, &ext, &headers, body, Endpoint::Completions, parse_completion).await
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    ext: axum::http::Extensions,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    generate_from(st, &ext, &headers, body, Endpoint::Chat, parse_chat).await
}

/// Checks and parses a generation request of `endpoint`, then runs it.
async fn generate_from(
    st: Arc<AppState>,
    ext: &axum::http::Extensions,
    headers: &axum::http::HeaderMap,
    body: Body,
    endpoint: Endpoint,
    parse: fn(&AppState, api::Ctx<'_>, &axum::body::Bytes) -> Result<api::Parsed, ApiError>,
) -> Response {
    let started = Instant::now();
    let tenant = tenant_of(ext);
    let ctx = api::Ctx { headers, tenant: tenant.as_deref() };
    let r = check_content_type(headers)
        .and_then(|()| read_body(body))
        .and_then(|b| parse(&st, ctx, &b));
    run(st, endpoint, r, started).await
}

impl AppState {
    fn new(
        backend: Arc<dyn Backend>,
        cfg: ServerConfig,
        metrics: HttpMetrics,
        registry: Registry,
        created: u64,
    ) -> Arc<Self> {
        tracing::info!(server = %cfg.name, "API authentication: {}", cfg.authentication());
        let history = dashboard::History::default();
        let started = Instant::now();
        Arc::new(AppState { backend, cfg, metrics, registry, created, started, history })
    }

    /// Counts a failed request by the side at fault.
    fn count_failure(&self, e: &ApiError) {
        self.metrics.request(if e.status.is_client_error() {
            Outcome::ClientError
        } else {
            Outcome::ServerError
        });
    }

    fn fail(&self, e: ApiError) -> Response {
        self.count_failure(&e);
        e.into_response()
    }

    fn created_now(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(self.created, |d| d.as_secs())
    }
}

/// Runs a parsed request: starts the generation, then answers streamed or whole.
async fn run(
    st: Arc<AppState>,
    endpoint: Endpoint,
    parsed: Result<api::Parsed, ApiError>,
    started: Instant,
) -> Response {
    let (gen, answer) = match generate::start(st, endpoint, parsed, started).await {
        Ok(x) => x,
        Err(response) => return response,
    };
    let worker = gen.worker().and_then(|w| axum::http::HeaderValue::from_str(w).ok());
    let mut response = if answer.stream {
        sse::stream_response(gen, answer.include_usage)
    } else {
        generate::whole_response(gen).await
    };
    if let Some(w) = worker {
        response.headers_mut().insert("x-kvfabric-worker", w);
    }
    response
}
