//! The HTTP API v1 (axum). Handlers are thin: extract, check the input at
//! the edge ([`aviary_control::validate`]), build the operation's context
//! ([`op_context`]: caller, request id, lease token) and its one request
//! value, call one [`ControlPlane`] operation, map the error (in
//! `error.rs`). The OpenAPI document is generated from the handler
//! annotations.
//!
//! Every `/v1` route authenticates with a bearer API key ([`Auth`]), which
//! also takes one request from the key's rate-limit bucket
//! ([`crate::edge::RateLimiter`]). JSON bodies must be JSON objects of the
//! route's type ([`ApiJson`]). Cluster-wide views (`/v1/pools`, `/v1/nodes`,
//! `/v1/keys`) are admin-only; `/metrics` takes the metrics token or an
//! admin key.

use crate::edge::RateLimiter;
use crate::error::ApiError;
use aviary_control::ops::{Caller, ControlPlane, Readiness};
use aviary_control::requests::{
    AllocationQuery, CheckpointRequest, EventQuery, FileRequest, FileUpload, KeyRef,
    ManifestRequest, OnSandbox, PoolUpdate, RemoveFileRequest, ResetRequest, SandboxQuery,
    SandboxRef, SnapshotQuery, TemplateImport,
};
use aviary_control::{OpContext, OpError};
use aviary_core::api::*;
use aviary_core::{ErrorBody, LeaseToken};
use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use futures_util::{Stream, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use tracing::Instrument;
use utoipa::OpenApi;

/// What every handler gets: the control plane and the HTTP limits.
#[derive(Clone)]
pub struct AppState {
    pub cp: Arc<ControlPlane>,
    pub server: Arc<ServerSettings>,
}

impl std::ops::Deref for AppState {
    type Target = ControlPlane;
    fn deref(&self) -> &ControlPlane {
        &self.cp
    }
}

/// The HTTP surface's own settings (the control plane's are in its config).
#[derive(Clone, Debug)]
pub struct ServerSettings {
    /// Largest JSON body accepted.
    pub max_json_bytes: usize,
    /// Largest file upload accepted.
    pub max_upload_bytes: u64,
    /// Largest template archive accepted.
    pub max_archive_bytes: u64,
    /// Where uploads and template archives are spooled.
    pub spool_dir: std::path::PathBuf,
}

pub const LEASE_TOKEN_HEADER: &str = "x-aviary-lease-token";

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// The authenticated caller, within its key's rate limit.
pub struct Auth(pub Caller);

impl FromRequestParts<AppState> for Auth {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, cp: &AppState) -> Result<Self, ApiError> {
        let key = bearer(&parts.headers);
        let limiter = parts.extensions.get::<Arc<RateLimiter>>().cloned();
        let limited = |retry_after_s, message: &str| {
            cp.metrics.inc_rate_limited();
            OpError::RateLimited {
                message: message.into(),
                retry_after_s,
            }
        };
        // Failed authentications are limited per client address, before the
        // registry is asked, so key guessing costs the server little; keys
        // already known (cached) still pass from a throttled address.
        let failures = parts
            .extensions
            .get::<crate::edge::ClientAddr>()
            .map(|a| format!("unauthenticated {}", a.0.ip()));
        let hash = key.map(aviary_control::ops::hash_key);
        let now = std::time::Instant::now();
        if let (Some(l), Some(f)) = (&limiter, &failures) {
            if let Err(s) = l.check(f, now) {
                if hash.as_deref().and_then(|h| cp.key_cache.get(h)).is_none() {
                    return Err(limited(s, "too many requests without a valid API key").into());
                }
            }
        }
        let caller = match cp
            .authenticate(key)
            .instrument(tracing::trace_span!("http.auth"))
            .await
        {
            Err(OpError::Unauthorized) => {
                if let (Some(l), Some(f)) = (&limiter, &failures) {
                    let _ = l.take(f, now);
                }
                return Err(OpError::Unauthorized.into());
            }
            other => other?,
        };
        if let (Some(l), Some(h)) = (&limiter, &hash) {
            l.take(h, now)
                .map_err(|s| limited(s, "too many requests for this API key"))?;
        }
        // keys made before tenant names were checked may name a path
        if aviary_control::validate::identifier("tenant", &caller.tenant).is_err() {
            return Err(OpError::Forbidden(
                "this key's tenant name is not valid; create a key for a valid tenant".into(),
            )
            .into());
        }
        Ok(Auth(caller))
    }
}

fn require_admin(c: &Caller, what: &str) -> Result<(), ApiError> {
    if c.admin {
        Ok(())
    } else {
        Err(OpError::Forbidden(format!("{what} needs an admin key")).into())
    }
}

/// A JSON object body of type `T`, with our error mapping: 413
/// `payload_too_large` over the route's limit, 400 `invalid_request` for a
/// wrong content type, a body that is not a JSON object (`[]` is not `{}`),
/// unknown fields or wrong types, or a body that stalled.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !json_content_type(req.headers()) {
            return Err(OpError::InvalidRequest(
                "expected a JSON body (Content-Type: application/json)".into(),
            )
            .into());
        }
        let bytes = match bytes::Bytes::from_request(req, state).await {
            Ok(b) => b,
            Err(rej) if rej.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(OpError::PayloadTooLarge(
                    "request body is larger than the limit for this route".into(),
                )
                .into())
            }
            Err(rej) => return Err(OpError::InvalidRequest(rej.body_text()).into()),
        };
        json_object(&bytes).map(ApiJson)
    }
}

fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Deserializes `bytes` as `T`, which must be written as a JSON object: serde
/// reads a struct from an array too (`[]` would be `{}` with all defaults).
fn json_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(
            OpError::InvalidRequest("the request body must be a JSON object".into()).into(),
        );
    }
    Json::<T>::from_bytes(bytes)
        .map(|Json(v)| v)
        .map_err(|rej| ApiError::from(OpError::InvalidRequest(rej.body_text())))
}

/// Query string with our error mapping.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|rej| ApiError::from(OpError::InvalidRequest(rej.body_text())))
    }
}

pub(crate) fn request_id(headers: &HeaderMap) -> String {
    usable_request_id(headers.get("x-request-id").and_then(|v| v.to_str().ok()))
        .map(str::to_owned)
        .unwrap_or_else(|| aviary_core::new_id("req"))
}

/// Where a route's operation takes its lease token from.
pub(crate) enum TokenFrom {
    /// Nowhere: the operation is not fenced, the header is not read.
    Unfenced,
    /// The lease token header.
    Header,
    /// The request body's token when it has one, else the header's (which
    /// is then the only one read).
    Body(Option<LeaseToken>),
}

/// The context of the request's operation: the authenticated caller, the
/// request id (the client's `x-request-id`, else a new one) and the lease
/// token (from where `token` says; a malformed header is `invalid_request`).
pub(crate) fn op_context(
    Auth(caller): Auth,
    headers: &HeaderMap,
    token: TokenFrom,
) -> Result<OpContext, ApiError> {
    let token = match token {
        TokenFrom::Unfenced => None,
        TokenFrom::Body(Some(t)) => Some(t),
        TokenFrom::Header | TokenFrom::Body(None) => header_token(headers)?,
    };
    Ok(OpContext::new(caller)
        .with_request_id(request_id(headers))
        .with_token(token))
}

pub(crate) fn header_token(headers: &HeaderMap) -> Result<Option<LeaseToken>, ApiError> {
    match headers.get(LEASE_TOKEN_HEADER) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.parse::<LeaseToken>().ok())
            .map(Some)
            .ok_or_else(|| {
                OpError::InvalidRequest(format!(
                    "{LEASE_TOKEN_HEADER} must be a lease token FENCE.SECRET as the grant returned it"
                ))
                .into()
            }),
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Include terminated sandboxes.
    #[serde(default)]
    all: bool,
    /// Only sandboxes whose metadata has every pair: `k=v&k2=v2`, each key
    /// and value form-urlencoded (so the whole value is encoded twice in
    /// the URL, as the E2B and OpenSandbox SDKs send it).
    #[serde(default)]
    metadata: Option<String>,
    /// Only sandboxes in this state (e.g. `Idle`, `Hibernating`; `Terminated` lists ended ones).
    #[serde(default)]
    #[param(value_type = Option<String>)]
    state: Option<aviary_core::SandboxState>,
    /// Only sandboxes working for this end user.
    #[serde(default)]
    user_id: Option<String>,
    /// Only sandboxes of this session.
    #[serde(default)]
    session_id: Option<String>,
    /// Every tenant's sandboxes (each names its `tenant`): admin keys
    /// only; any other key is refused with 403 `forbidden`.
    #[serde(default)]
    all_tenants: bool,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Absolute path inside the sandbox (no `..` component, no NUL).
    #[param(pattern = "^/", max_length = 4096)]
    path: String,
    /// Delete: a directory with its content. List: every entry below the
    /// directory (at most 10,000; `truncated` says when there were more).
    #[serde(default)]
    recursive: bool,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    sandbox: Option<String>,
    /// Only events with a larger id (for following).
    after: Option<i64>,
    /// How many (1-1000, default 100).
    limit: Option<u32>,
    /// The last `limit` events instead of the first (still oldest first).
    newest: Option<bool>,
    /// Every tenant's events (and `sandbox` may name any tenant's
    /// sandbox): admin keys only; any other key is refused with 403
    /// `forbidden`.
    #[serde(default)]
    all_tenants: bool,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventStreamQuery {
    sandbox: Option<String>,
    /// Start after this event id; absent: from the newest event on (only
    /// what happens from now).
    after: Option<i64>,
    /// Every tenant's events: admin keys only; any other key is refused
    /// with 403 `forbidden` (before the stream starts).
    #[serde(default)]
    all_tenants: bool,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SandboxEventsQuery {
    after: Option<i64>,
    /// How many (1-1000, default 100).
    limit: Option<u32>,
    /// The last `limit` events instead of the first (still oldest first).
    newest: Option<bool>,
}

#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "process is up")))]
async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

#[utoipa::path(get, path = "/readyz", responses((status = 200, description = "ready to run sandboxes"), (status = 503, description = "not ready yet", body = ErrorBody)))]
async fn readyz(State(cp): State<AppState>) -> Response {
    match cp.readiness() {
        Readiness::Ready => Json(serde_json::json!({"status": "ready"})).into_response(),
        Readiness::Preparing(w) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "preparing", "detail": w})),
        )
            .into_response(),
        Readiness::Failed(w) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "failed", "detail": w})),
        )
            .into_response(),
    }
}

/// Prometheus metrics. Needs `Authorization: Bearer` with the metrics token
/// (the variable named by `server.metrics_token_env`) or an admin API key.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "OpenMetrics text format (version 1.0.0)", content_type = "application/openmetrics-text"), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn metrics(State(cp): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize_metrics(&cp, &headers).await?;
    let by_state = cp.sandbox_counts_by_state().await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        cp.metrics.render(cp.live_count(), &by_state),
    )
        .into_response())
}

/// A route that takes no query parameters (any is refused with 400).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoQuery {}

/// The metrics token or an admin API key, for `/metrics` and its history.
async fn authorize_metrics(cp: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let presented = bearer(headers).ok_or(OpError::Unauthorized)?;
    let is_token = cp
        .cfg
        .settings
        .server
        .edge
        .metrics_token()
        .is_some_and(|t| constant_time_eq(t.as_bytes(), presented.as_bytes()));
    if !is_token {
        require_admin(&cp.authenticate(Some(presented)).await?, "reading metrics")?;
    }
    Ok(())
}

/// The server's own metrics over the last hour, sampled every
/// `metrics_history_interval_ms` (10 s): sandboxes by state, live compute,
/// creates served and their latency, warm-pool hits and misses. Oldest
/// first; counters are totals since start. Same auth as `/metrics`.
#[utoipa::path(get, path = "/v1/metrics/history", responses((status = 200, body = aviary_control::metrics::MetricsHistory), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn metrics_history(
    State(cp): State<AppState>,
    headers: HeaderMap,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> Result<Json<aviary_control::metrics::MetricsHistory>, ApiError> {
    authorize_metrics(&cp, &headers).await?;
    Ok(Json(aviary_control::metrics::MetricsHistory {
        interval_ms: cp.cfg.metrics_history_interval_ms,
        samples: cp.metrics.history(),
    }))
}

/// Records each matched request's latency (to the answer's head: a
/// streamed body's lifetime is the client's) under its route template.
async fn observe_latency(
    State(cp): State<Arc<ControlPlane>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().as_str().to_owned();
    let started = std::time::Instant::now();
    let resp = next.run(req).await;
    cp.metrics.observe_request(
        &method,
        &route,
        resp.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    resp
}

/// Compares secrets in time independent of where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandboxRequest,
    responses((status = 201, body = CreateSandboxResponse), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody, description = "`from_snapshot` names no snapshot of this tenant"), (status = 503, body = ErrorBody)),
    security(("api_key" = [])))]
async fn create_sandbox(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Result<(StatusCode, Json<CreateSandboxResponse>), ApiError> {
    aviary_control::validate::create_request(&req)?;
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok((StatusCode::CREATED, Json(cp.create(&cx, req).await?)))
}

/// The caller's sandboxes; with `all_tenants=true` (admin keys only)
/// every tenant's.
#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery), responses((status = 200, body = SandboxList), (status = 400, description = "a malformed query parameter", body = ErrorBody), (status = 403, description = "`all_tenants` with a key that is not an admin key", body = ErrorBody)), security(("api_key" = [])))]
async fn list_sandboxes(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<SandboxList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = SandboxQuery {
        include_terminated: q.all,
        metadata: match &q.metadata {
            Some(m) => aviary_control::requests::parse_label_filter(m)?,
            None => Default::default(),
        },
        state: q.state,
        user_id: q.user_id,
        session_id: q.session_id,
        all_tenants: q.all_tenants,
    };
    Ok(Json(SandboxList {
        sandboxes: cp.list(&cx, req).await?,
    }))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct GetSandboxQuery {
    /// Find the sandbox in any tenant (read only): admin keys only; any
    /// other key is refused with 403 `forbidden`.
    #[serde(default)]
    all_tenants: bool,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(GetSandboxQuery), responses((status = 200, body = Sandbox), (status = 400, description = "a malformed query parameter", body = ErrorBody), (status = 403, description = "`all_tenants` with a key that is not an admin key", body = ErrorBody), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn get_sandbox(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<GetSandboxQuery>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(if q.all_tenants {
        cp.get_any_tenant(&cx, SandboxRef::new(id)).await?
    } else {
        cp.get(&cx, SandboxRef::new(id)).await?
    }))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")),
    responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn delete_sandbox(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    Ok(Json(cp.delete(&cx, SandboxRef::new(id)).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", request_body = ExecRequest,
    responses((status = 200, body = ExecResult), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, description = "the command (argv, cwd, env) is too large", body = ErrorBody)), security(("api_key" = [])))]
async fn exec(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<Json<ExecResult>, ApiError> {
    aviary_control::validate::exec_request(&req)?;
    let cx = op_context(auth, &headers, TokenFrom::Body(req.token))?;
    Ok(Json(cp.exec(&cx, OnSandbox::new(id, req)).await?))
}

/// Streaming exec: `text/event-stream`; each event's data is an `ExecEvent`
/// (stdout/stderr chunks base64-encoded), the last one `exit`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", request_body = ExecRequest,
    responses((status = 200, description = "server-sent events: `event:` stdout, stderr, exit or error, `data:` the ExecEvent as JSON", content_type = "text/event-stream", body = SseItem), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, description = "the command (argv, cwd, env) is too large", body = ErrorBody)), security(("api_key" = [])))]
async fn exec_stream(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    aviary_control::validate::exec_request(&req)?;
    let cx = op_context(auth, &headers, TokenFrom::Body(req.token))?;
    let run = cp.exec_start(&cx, OnSandbox::new(id, req)).await?;
    Ok(exec_events(cp, run))
}

/// The SSE answer of a started exec: output chunks as they come, then the
/// exit (or an error), each an `ExecEvent`.
fn exec_events(
    cp: AppState,
    run: aviary_control::ops::ExecRun,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let stream = futures_util::stream::unfold(Some((cp, run)), move |st| async move {
        let (cp, mut run) = st?;
        let got = run.stream.next().await;
        let oom = match &got {
            Ok(aviary_envd_proto::ExecEvent::Exit(exit)) => cp.exec_finish(&run, exit).await,
            _ => false,
        };
        let (mut ev, last) = api_exec_event(got);
        if let ExecEvent::Exit { result } = &mut ev {
            result.oom_killed = oom;
        }
        Some((Ok(exec_event_sse(&ev)), (!last).then_some((cp, run))))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// One envd exec event as the API's [`ExecEvent`] (output base64, an exit
/// with `oom_killed` false: the caller sets what it checked) and whether it
/// ends the stream. Shared by `exec/stream`, `exec/stdin` and a background
/// command's followed output.
pub(crate) fn api_exec_event<E: Into<OpError>>(
    ev: Result<aviary_envd_proto::ExecEvent, E>,
) -> (ExecEvent, bool) {
    let b64 = base64::engine::general_purpose::STANDARD;
    match ev {
        Ok(aviary_envd_proto::ExecEvent::Stdout(d)) => (
            ExecEvent::Stdout {
                data: b64.encode(d),
            },
            false,
        ),
        Ok(aviary_envd_proto::ExecEvent::Stderr(d)) => (
            ExecEvent::Stderr {
                data: b64.encode(d),
            },
            false,
        ),
        Ok(aviary_envd_proto::ExecEvent::Exit(exit)) => (
            ExecEvent::Exit {
                result: ExecResult {
                    exit_code: exit.exit_code,
                    stdout: String::new(),
                    stderr: String::new(),
                    duration_ms: exit.duration.as_secs_f64() * 1000.0,
                    timed_out: exit.timed_out,
                    oom_killed: false,
                    truncated: false,
                },
            },
            true,
        ),
        Err(e) => {
            let e: OpError = e.into();
            (
                ExecEvent::Error {
                    code: e.code(),
                    message: e.public_message(),
                },
                true,
            )
        }
    }
}

/// An [`ExecEvent`] as a server-sent event named after its type.
pub(crate) fn exec_event_sse(ev: &ExecEvent) -> SseEvent {
    let name = match ev {
        ExecEvent::Stdout { .. } => "stdout",
        ExecEvent::Stderr { .. } => "stderr",
        ExecEvent::Exit { .. } => "exit",
        ExecEvent::Error { .. } => "error",
    };
    SseEvent::default()
        .event(name)
        .json_data(ev)
        .unwrap_or_else(|_| SseEvent::default().event("error"))
}

/// Streaming exec with stdin streamed too: a `multipart/form-data` body
/// whose first part, `request`, is the `ExecRequest` (JSON) and whose second
/// part, `stdin`, is the process's stdin: bytes, forwarded as they arrive,
/// closed when the part ends. The answer is the event stream of
/// `exec/stream`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stdin",
    request_body(content = ExecStdinForm, content_type = "multipart/form-data"),
    params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased (or `token` in the request part)")),
    responses((status = 200, description = "server-sent events, as exec/stream", content_type = "text/event-stream", body = SseItem), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody)), security(("api_key" = [])))]
async fn exec_piped(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let bad = |m: String| ApiError::from(OpError::InvalidRequest(m));
    let boundary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| multer::parse_boundary(ct).ok())
        .ok_or_else(|| {
            bad(
                "exec/stdin takes multipart/form-data: a `request` part (JSON) then a `stdin` part"
                    .into(),
            )
        })?;
    let limits = multer::Constraints::new()
        .size_limit(multer::SizeLimit::new().for_field("request", cp.server.max_json_bytes as u64));
    let mut parts = multer::Multipart::with_constraints(body.into_data_stream(), boundary, limits);
    let part_err = |e: multer::Error| match e {
        multer::Error::FieldSizeExceeded { .. } | multer::Error::StreamSizeExceeded { .. } => {
            ApiError::from(OpError::PayloadTooLarge(
                "the request part is larger than the JSON body limit".into(),
            ))
        }
        e => ApiError::from(OpError::InvalidRequest(format!(
            "malformed multipart body: {e}"
        ))),
    };
    let first = parts
        .next_field()
        .await
        .map_err(part_err)?
        .ok_or_else(|| bad("the body has no `request` part".into()))?;
    if first.name() != Some("request") {
        return Err(bad(
            "the first part must be `request` (the ExecRequest as JSON)".into(),
        ));
    }
    let json = first.bytes().await.map_err(part_err)?;
    let req: ExecRequest = serde_json::from_slice(&json)
        .map_err(|e| bad(format!("the request part is not a valid ExecRequest: {e}")))?;
    aviary_control::validate::exec_request(&req)?;
    let stdin = parts
        .next_field()
        .await
        .map_err(part_err)?
        .ok_or_else(|| bad("the body has no `stdin` part after `request`".into()))?;
    if stdin.name() != Some("stdin") {
        return Err(bad("the second part must be `stdin`".into()));
    }
    let reader = tokio_util::io::StreamReader::new(stdin.map_err(std::io::Error::other));
    let cx = op_context(auth, &headers, TokenFrom::Body(req.token))?;
    let run = cp
        .exec_start_piped(&cx, OnSandbox::new(id, req), Box::pin(reader))
        .await?;
    Ok(exec_events(cp, run))
}

/// The body of `POST /v1/sandboxes/{id}/exec/stdin`.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct ExecStdinForm {
    /// The command, as for `exec/stream` (JSON).
    request: ExecRequest,
    /// The process's stdin.
    #[schema(value_type = String, format = Binary)]
    stdin: Vec<u8>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(PathQuery), responses((status = 200, description = "file content (streamed)", content_type = "application/octet-stream"), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn read_file(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let reader = cp.read_file(&cx, FileRequest::new(id, q.path)).await?;
    let body = Body::from_stream(tokio_util::io::ReaderStream::new(reader));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(PathQuery, ("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, description = "{\"bytes\": N}"), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody)), security(("api_key" = [])))]
async fn write_file(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let max = cp.server.max_upload_bytes;
    check_content_length(&headers, max)?;
    let (reader, exceeded) = limited_reader(body, max);
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    let upload = FileUpload {
        id,
        path: q.path,
        body: reader,
    };
    let res = cp.write_file(&cx, upload).await;
    if exceeded.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(OpError::PayloadTooLarge(format!("upload larger than {max} bytes")).into());
    }
    Ok(Json(serde_json::json!({"bytes": res?})))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", params(PathQuery, ("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn remove_file(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<StatusCode, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    let req = RemoveFileRequest {
        id,
        path: q.path,
        recursive: q.recursive,
    };
    cp.remove(&cx, req).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(PathQuery), responses((status = 200, body = FileList), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn list_files(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<FileList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = FileRequest::new(id, q.path);
    Ok(Json(if q.recursive {
        cp.list_tree(&cx, req).await?
    } else {
        cp.list_files(&cx, req).await?
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", params(PathQuery), responses((status = 200, body = FileInfo), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn stat_file(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<FileInfo>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.stat(&cx, FileRequest::new(id, q.path)).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", request_body = MkdirRequest, responses((status = 204), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn mkdir(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<MkdirRequest>,
) -> Result<StatusCode, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Body(req.token))?;
    cp.mkdir(&cx, FileRequest::new(id, req.path)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/lease", request_body = AcquireLeaseRequest, responses((status = 201, body = Lease), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn lease_acquire(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<AcquireLeaseRequest>,
) -> Result<(StatusCode, Json<Lease>), ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok((
        StatusCode::CREATED,
        Json(cp.lease_acquire(&cx, OnSandbox::new(id, req)).await?),
    ))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/lease", request_body = RenewLeaseRequest, responses((status = 200, body = Lease), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn lease_renew(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<RenewLeaseRequest>,
) -> Result<Json<Lease>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.lease_renew(&cx, OnSandbox::new(id, req)).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/lease", request_body = ReleaseLeaseRequest, responses((status = 204), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn lease_release(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ReleaseLeaseRequest>,
) -> Result<StatusCode, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    cp.lease_release(&cx, OnSandbox::new(id, req)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/events", params(EventsQuery), responses((status = 200, body = EventList), (status = 400, description = "a malformed query parameter", body = ErrorBody), (status = 403, description = "`all_tenants` with a key that is not an admin key", body = ErrorBody), (status = 404, description = "`sandbox` names no sandbox of this tenant", body = ErrorBody)), security(("api_key" = [])))]
async fn events(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Json<EventList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = EventQuery {
        sandbox: q.sandbox,
        after: q.after,
        limit: q.limit,
        newest: q.newest.unwrap_or(false),
        all_tenants: q.all_tenants,
    };
    Ok(Json(EventList {
        events: cp.events(&cx, req).await?,
    }))
}

/// One server-sent event as it travels (the `text/event-stream` framing):
/// what the streaming routes' items look like on the wire.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // documentation only: the server writes the framing itself
pub struct SseItem {
    /// The event's name (`event`, `stdout`, `exit`, ...).
    event: String,
    /// The event's id, where it has one.
    id: Option<String>,
    /// The payload, a JSON document (an `Event`, an `ExecEvent`).
    data: String,
}

/// How often the event stream looks for new events (the registry is the
/// only place every replica's events meet).
const EVENT_STREAM_POLL: std::time::Duration = std::time::Duration::from_millis(250);

#[utoipa::path(get, path = "/v1/events/stream", params(EventStreamQuery),
    responses((status = 200, description = "server-sent events, one per recorded event: `event: event`, `id:` its id, `data:` the Event as JSON", content_type = "text/event-stream", body = SseItem), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, description = "`all_tenants` with a key that is not an admin key", body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
async fn event_stream(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventStreamQuery>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let query = |after: Option<i64>, newest: bool| EventQuery {
        sandbox: q.sandbox.clone(),
        after,
        limit: Some(if newest { 1 } else { 500 }),
        newest,
        all_tenants: q.all_tenants,
    };
    // checks the caller may see the sandbox (before the stream starts: a
    // refusal is an HTTP error, not an event), and finds where "now" is
    let newest = cp.events(&cx, query(None, true)).await?;
    let after = q.after.unwrap_or_else(|| newest.last().map_or(0, |e| e.id));
    let state = Some((cp, cx, query(None, false), after, VecDeque::<Event>::new()));
    let stream = futures_util::stream::unfold(state, |state| async move {
        let (cp, cx, mut q, mut after, mut queue) = state?;
        loop {
            if let Some(ev) = queue.pop_front() {
                after = ev.id;
                let sse = SseEvent::default()
                    .event("event")
                    .id(ev.id.to_string())
                    .json_data(&ev)
                    .unwrap_or_else(|_| SseEvent::default().event("error"));
                return Some((Ok(sse), Some((cp, cx, q, after, queue))));
            }
            q.after = Some(after);
            match cp.events(&cx, q.clone()).await {
                Ok(events) if !events.is_empty() => queue.extend(events),
                Ok(_) => tokio::time::sleep(EVENT_STREAM_POLL).await,
                // the registry is down for a moment: keep the stream, retry
                Err(OpError::Unavailable(_)) => tokio::time::sleep(EVENT_STREAM_POLL).await,
                Err(e) => {
                    // the caller could read the events when the stream
                    // began; whatever broke since ends the stream (every
                    // item of it is an Event, as documented)
                    tracing::info!(error = %e, "event stream ended");
                    return None;
                }
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", params(SandboxEventsQuery), responses((status = 200, body = EventList), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn sandbox_events(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<SandboxEventsQuery>,
) -> Result<Json<EventList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = EventQuery {
        sandbox: Some(id),
        after: q.after,
        limit: q.limit,
        newest: q.newest.unwrap_or(false),
        all_tenants: false,
    };
    Ok(Json(EventList {
        events: cp.events(&cx, req).await?,
    }))
}

#[utoipa::path(get, path = "/v1/templates", responses((status = 200, body = TemplateList)), security(("api_key" = [])))]
async fn templates(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
) -> Result<Json<TemplateList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(TemplateList {
        templates: cp.templates(&cx).await?,
    }))
}

/// Imports a `docker save` or OCI image-layout tarball (admin only).
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ImportQuery {
    /// Replace a template of that name (otherwise an existing name is 409).
    #[serde(default)]
    force: bool,
}

#[utoipa::path(post, path = "/v1/templates/{name}", params(ImportQuery), request_body(content = Vec<u8>, content_type = "application/x-tar"),
    responses((status = 201, body = Template), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, description = "a template of that name exists (use force)", body = ErrorBody), (status = 413, body = ErrorBody)), security(("api_key" = [])))]
async fn import_template(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(name): Path<String>,
    ApiQuery(q): ApiQuery<ImportQuery>,
    body: Body,
) -> Result<(StatusCode, Json<Template>), ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    // refused before the upload is spooled (the operation checks it again)
    if !cx.caller.admin {
        return Err(OpError::Forbidden("importing templates needs an admin key".into()).into());
    }
    let max = cp.server.max_archive_bytes;
    check_content_length(&headers, max)?;
    let dir = cp.server.spool_dir.clone();
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(OpError::internal)?;
    let path = dir.join(aviary_core::new_id("upload"));
    let (mut reader, exceeded) = limited_reader(body, max);
    let copy = async {
        let mut f = tokio::fs::File::create(&path).await?;
        tokio::io::copy(&mut reader, &mut f).await?;
        tokio::io::AsyncWriteExt::flush(&mut f).await
    }
    .await;
    if exceeded.load(std::sync::atomic::Ordering::SeqCst) {
        let _ = tokio::fs::remove_file(&path).await;
        return Err(OpError::PayloadTooLarge(format!("archive larger than {max} bytes")).into());
    }
    if let Err(e) = copy {
        let _ = tokio::fs::remove_file(&path).await;
        return Err(OpError::InvalidRequest(format!("upload interrupted: {e}")).into());
    }
    // the spooled archive is the server's: removed whatever the import did
    let import = TemplateImport {
        name,
        archive: path.clone(),
        force: q.force,
    };
    let imported = cp.import_template(&cx, import).await;
    let _ = tokio::fs::remove_file(&path).await;
    Ok((StatusCode::CREATED, Json(imported?)))
}

/// Runs the resource planner on a task context and shows what the policy
/// guard would approve for the caller; the decision is recorded.
#[utoipa::path(post, path = "/v1/plan", request_body(content = Object, description = "task context (DESIGN §7)"),
    responses((status = 200, body = aviary_control::planning::PlanResponse), (status = 400, body = ErrorBody)), security(("api_key" = [])))]
async fn plan(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiJson(task): ApiJson<serde_json::Value>,
) -> Result<Json<aviary_control::planning::PlanResponse>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.plan(&cx, task).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LimitQuery {
    limit: Option<u32>,
}

/// Planner and policy decisions (`sandbox_allocation`), newest first, with
/// the measured usage once a sandbox ended.
#[utoipa::path(get, path = "/v1/allocations", params(LimitQuery), responses((status = 200, body = aviary_control::planning::AllocationList)), security(("api_key" = [])))]
async fn allocations(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<LimitQuery>,
) -> Result<Json<aviary_control::planning::AllocationList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = AllocationQuery { limit: q.limit };
    Ok(Json(cp.allocations(&cx, req).await?))
}

/// Warm pools with their sizes and hit/miss counts (admin only: the counts
/// are server-wide).
#[utoipa::path(get, path = "/v1/pools", responses((status = 200, body = aviary_control::pools::PoolList), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn pools(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
) -> Result<Json<aviary_control::pools::PoolList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.pools_view(&cx).await?))
}

/// Sets `pool_min`/`pool_max` of the pools of a class (admin only; kept across restarts).
#[utoipa::path(put, path = "/v1/pools/{class}", request_body = aviary_control::pools::SetPoolRequest,
    responses((status = 200, body = aviary_control::pools::PoolList), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn set_pool(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(class): Path<String>,
    ApiJson(bounds): ApiJson<aviary_control::pools::SetPoolRequest>,
) -> Result<Json<aviary_control::pools::PoolList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.set_pool(&cx, PoolUpdate { class, bounds }).await?))
}

/// Sets the sandbox's expiry to now + `ttl_s` (it may shorten it); fenced.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ttl", request_body = SetTtlBody, params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 200, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn set_ttl(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<SetTtlBody>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    let req = aviary_control::requests::SetTtlRequest {
        id,
        ttl_s: body.ttl_s,
    };
    Ok(Json(cp.set_ttl(&cx, req).await?))
}

/// Freezes the sandbox's processes (cgroup freezer); fenced.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn pause(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    Ok(Json(cp.pause(&cx, SandboxRef::new(id)).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn resume(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    Ok(Json(cp.resume(&cx, SandboxRef::new(id)).await?))
}

/// Recycling: level 1 kills leftover processes, clears /tmp, revokes the lease (/workspace stays);
/// level 2 restores the clean checkpoint; level 3 destroys.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/reset", params(ResetQuery, ("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn reset(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ResetQuery>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    let req = ResetRequest {
        id,
        level: q.level.unwrap_or(1),
    };
    Ok(Json(cp.reset_level(&cx, req).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ResetQuery {
    /// 1 soft reset (default), 2 back to the clean checkpoint, 3 hard destroy.
    level: Option<u8>,
}

/// Marks the sandbox tainted (an operator's verdict): it is never reused nor returned to a pool;
/// a level-2 reset clears the mark. No lease is needed.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/taint", request_body = aviary_control::taint::TaintRequest, responses((status = 200, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn taint(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<aviary_control::taint::TaintRequest>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.taint_sandbox(&cx, OnSandbox::new(id, req)).await?))
}

/// Ends a call: releases the lease, refreshes the manifest, sandbox back to Idle for its scope.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/release", params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn release(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    Ok(Json(cp.release(&cx, SandboxRef::new(id)).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ManifestQuery {
    /// Probe the sandbox now instead of returning the stored manifest.
    #[serde(default)]
    refresh: bool,
}

/// The environment manifest: template digest, runtimes, package sets and hashes, dirty paths.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/manifest", params(ManifestQuery), responses((status = 200, body = aviary_reuse::EnvironmentManifest), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn manifest(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ManifestQuery>,
) -> Result<Json<aviary_reuse::EnvironmentManifest>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = ManifestRequest {
        id,
        refresh: q.refresh,
    };
    Ok(Json(cp.manifest(&cx, req).await?))
}

/// Checkpoint: workspace + writable layer as content-defined chunks (fenced).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", params(LabelQuery, ("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 201, body = aviary_control::snapshots::SandboxSnapshot), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn snapshot(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<LabelQuery>,
) -> Result<(StatusCode, Json<aviary_control::snapshots::SandboxSnapshot>), ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    let req = CheckpointRequest { id, label: q.label };
    Ok((StatusCode::CREATED, Json(cp.snapshot(&cx, req).await?)))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LabelQuery {
    /// `clean` marks the checkpoint level-2 resets return to (default `checkpoint`).
    label: Option<String>,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsQuery {
    sandbox: Option<String>,
}

#[utoipa::path(get, path = "/v1/snapshots", params(SnapshotsQuery), responses((status = 200, body = aviary_control::snapshots::SnapshotList)), security(("api_key" = [])))]
async fn snapshots(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<SnapshotsQuery>,
) -> Result<Json<aviary_control::snapshots::SnapshotList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = SnapshotQuery { sandbox: q.sandbox };
    Ok(Json(cp.list_snapshots(&cx, req).await?))
}

/// A new sandbox from a checkpoint of this one (a fresh one when none is named).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", request_body = aviary_control::snapshots::ForkRequest, responses((status = 201, body = CreateSandboxResponse), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn fork(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<aviary_control::snapshots::ForkRequest>,
) -> Result<(StatusCode, Json<CreateSandboxResponse>), ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Body(req.token))?;
    Ok((
        StatusCode::CREATED,
        Json(cp.fork(&cx, OnSandbox::new(id, req)).await?),
    ))
}

/// Snapshot, then stop compute; the sandbox keeps its id and wakes from the snapshot.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/hibernate", params(("x-aviary-lease-token" = Option<String>, Header, description = "the lease token FENCE.SECRET, required while the sandbox is leased")), responses((status = 200, body = Sandbox), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn hibernate(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Header)?;
    Ok(Json(cp.hibernate(&cx, SandboxRef::new(id)).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/wake", responses((status = 200, body = Sandbox), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn wake(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.wake(&cx, SandboxRef::new(id)).await?))
}

/// Every node (the local one and registered agents) as the scheduler sees it
/// (admin only: capacity and commitments are server-wide).
#[utoipa::path(get, path = "/v1/nodes", responses((status = 200, body = aviary_control::nodes::NodeList), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn nodes(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
) -> Result<Json<aviary_control::nodes::NodeList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.list_nodes(&cx).await?))
}

/// Registers an `aviary node` agent (admin only); it is asked for its info first.
#[utoipa::path(post, path = "/v1/nodes", request_body = aviary_control::nodes::AddNodeRequest, responses((status = 201, body = aviary_control::nodes::NodeList), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn add_node(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiJson(req): ApiJson<aviary_control::nodes::AddNodeRequest>,
) -> Result<(StatusCode, Json<aviary_control::nodes::NodeList>), ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok((StatusCode::CREATED, Json(cp.add_node(&cx, req).await?)))
}

/// Snapshot retention and chunk garbage collection (admin only).
#[utoipa::path(post, path = "/v1/snapshots/gc", request_body = aviary_control::snapshots::GcRequest, responses((status = 200, body = aviary_control::snapshots::GcResult), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn gc_snapshots(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiJson(req): ApiJson<aviary_control::snapshots::GcRequest>,
) -> Result<Json<aviary_control::snapshots::GcResult>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.gc_snapshots(&cx, req).await?))
}

/// Creates a key for a tenant (admin only); the secret is in this answer only.
#[utoipa::path(post, path = "/v1/keys", request_body = CreateKeyRequest, responses((status = 201, body = aviary_control::keys::IssuedKey), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn create_key(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateKeyRequest>,
) -> Result<(StatusCode, Json<aviary_control::keys::IssuedKey>), ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok((StatusCode::CREATED, Json(cp.issue_key(&cx, req).await?)))
}

/// Every API key with its id, tenant and revocation time; never a secret
/// (admin only).
#[utoipa::path(get, path = "/v1/keys", responses((status = 200, body = aviary_control::keys::KeyList), (status = 403, body = ErrorBody)), security(("api_key" = [])))]
async fn list_keys(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
) -> Result<Json<aviary_control::keys::KeyList>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.list_keys(&cx).await?))
}

/// Removes a template (admin only); 409 while a sandbox, a snapshot, a pool
/// or the server's default still needs it.
#[utoipa::path(delete, path = "/v1/templates/{name}", responses((status = 204), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn remove_template(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    cp.remove_template(&cx, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Deletes one of the caller's snapshots (its chunks go with the next GC);
/// 409 for the one a hibernated sandbox wakes from.
#[utoipa::path(delete, path = "/v1/snapshots/{id}", responses((status = 200, body = aviary_control::snapshots::SandboxSnapshot), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)), security(("api_key" = [])))]
async fn delete_snapshot(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<aviary_control::snapshots::SandboxSnapshot>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.delete_snapshot(&cx, &id).await?))
}

/// Revokes a key (admin only): from the next request on it is 401.
#[utoipa::path(delete, path = "/v1/keys/{id}", responses((status = 200, body = aviary_control::keys::ApiKeyInfo), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)), security(("api_key" = [])))]
async fn revoke_key(
    State(cp): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<aviary_control::keys::ApiKeyInfo>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    Ok(Json(cp.revoke_key(&cx, KeyRef { id }).await?))
}

fn check_content_length(headers: &HeaderMap, max: u64) -> Result<(), ApiError> {
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok())
    {
        if len > max {
            return Err(OpError::PayloadTooLarge(format!(
                "body of {len} bytes is larger than {max}"
            ))
            .into());
        }
    }
    Ok(())
}

/// A reader over a request body that fails once more than `max` bytes came.
fn limited_reader(
    body: Body,
    max: u64,
) -> (
    impl tokio::io::AsyncRead + Unpin + Send,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let exceeded = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = exceeded.clone();
    let mut seen = 0u64;
    let stream = body
        .into_data_stream()
        .map_err(std::io::Error::other)
        .and_then(move |chunk| {
            seen += chunk.len() as u64;
            let over = seen > max;
            if over {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            async move {
                if over {
                    Err(std::io::Error::other("body too large"))
                } else {
                    Ok(chunk)
                }
            }
        });
    (
        tokio_util::io::StreamReader::new(Box::pin(stream)),
        exceeded,
    )
}

async fn not_found() -> ApiError {
    OpError::NotFound("route".into()).into()
}

async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(OpError::InvalidRequest("method not allowed on this route".into()).body(None)),
    )
        .into_response()
}

struct SecurityAddon;

impl utoipa::Modify for SecurityAddon {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Documents, on every operation, the error statuses the server can give
/// it (each an `ErrorBody`), where the operation does not already: 401,
/// 403 and 429 on authenticated ones; 404 where the path names an object;
/// 409 on a sandbox's own routes (state, lease, conflicts); 400 and 413
/// where a body or query is read; 503 everywhere the registry is read.
/// Also describes `/openapi.json` itself.
struct ErrorResponses;

impl utoipa::Modify for ErrorResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let error = |description: &str| {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
                .build()
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let names_object = path.contains('{');
            let on_sandbox = path.starts_with("/v1/sandboxes/{id}");
            for (method, op) in [
                ("get", item.get.as_mut()),
                ("put", item.put.as_mut()),
                ("post", item.post.as_mut()),
                ("delete", item.delete.as_mut()),
            ] {
                let Some(op) = op else { continue };
                let secured = op.security.as_ref().is_some_and(|s| !s.is_empty());
                let reads_input =
                    method != "delete" || op.parameters.is_some() || op.request_body.is_some();
                let mut add = |status: &str, description: &str| {
                    op.responses
                        .responses
                        .entry(status.to_owned())
                        .or_insert_with(|| error(description).into());
                };
                if reads_input {
                    add(
                        "400",
                        "the request is malformed or invalid (`invalid_request`, `invalid_path`)",
                    );
                }
                if secured {
                    add(
                        "401",
                        "no API key, or one that is unknown or revoked (`unauthorized`)",
                    );
                    add("403", "the key may not do this, or policy denied it (`forbidden`, `permission_denied`)");
                    add(
                        "429",
                        "too many requests for this key (`rate_limited`; see `Retry-After`)",
                    );
                }
                if names_object {
                    add("404", "no such object for this tenant (`not_found`)");
                }
                if on_sandbox {
                    add("409", "the sandbox's state or lease forbids it now (`invalid_state`, `lease_required`, `stale_token`, `lease_held`, `sandbox_lost`, `conflict`)");
                }
                if method == "post" || method == "put" {
                    add(
                        "413",
                        "the body is larger than this route accepts (`payload_too_large`)",
                    );
                }
                if path.starts_with("/v1/") {
                    add("503", "a backend is unavailable, or capacity is exhausted; retry (`unavailable`, `capacity_exhausted`, `busy`)");
                }
            }
        }
        let spec = OperationBuilder::new()
            .summary(Some("This OpenAPI document"))
            .response(
                "200",
                ResponseBuilder::new()
                    .description("the OpenAPI 3.1 document of this API")
                    .content("application/json", ContentBuilder::new().build())
                    .build(),
            )
            .build();
        openapi
            .paths
            .paths
            .insert("/openapi.json".into(), PathItem::new(HttpMethod::Get, spec));
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Aviary API", description = "Sandbox control plane for AI agents (v1)."),
    paths(healthz, readyz, create_sandbox, list_sandboxes, get_sandbox, delete_sandbox, exec, exec_stream, exec_piped,
          read_file, write_file, remove_file, list_files, stat_file, mkdir, lease_acquire, lease_renew, lease_release,
          crate::tty::exec_tty, events, event_stream, sandbox_events, templates, import_template, create_key, list_keys, revoke_key, metrics, metrics_history, plan, allocations, pools, set_pool, set_ttl, pause, resume, reset, taint, release, manifest, snapshot, snapshots, delete_snapshot, remove_template, fork, hibernate, wake, nodes, add_node, gc_snapshots,
          crate::ports::endpoint, crate::ports::proxy_doc, crate::ports::proxy_post_doc,
          crate::procs::list_processes, crate::procs::start_background, crate::procs::signal, crate::procs::output,
          crate::usage::usage),
    components(schemas(ExecEvent, Event, aviary_control::tty::TtyStart)),
    modifiers(&SecurityAddon, &ErrorResponses)
)]
pub struct ApiDoc;

/// Where the OpenSandbox surface is served: `OPEN_SANDBOX_DOMAIN=HOST:PORT/opensandbox`.
pub const OPENSANDBOX_PREFIX: &str = "/opensandbox";

pub fn router(cp: Arc<ControlPlane>, server: Arc<ServerSettings>) -> Router {
    use axum::extract::DefaultBodyLimit;
    let json_limit = server.max_json_bytes;
    let limiter = Arc::new(RateLimiter::from_settings(&cp.cfg.settings.server.edge));
    // the OpenSandbox-compatible surface, beside v1 (its own auth; the
    // same per-key rate limits)
    let compat_limiter = limiter.clone();
    let opensandbox = aviary_compat_opensandbox::router(
        cp.clone(),
        aviary_compat_opensandbox::OpenSandboxSettings {
            prefix: OPENSANDBOX_PREFIX.into(),
            max_json_bytes: json_limit,
            max_upload_bytes: server.max_upload_bytes,
            admission: Some(Arc::new(move |bucket: &str| {
                compat_limiter.take(bucket, std::time::Instant::now())
            })),
        },
    );
    let cp = AppState { cp, server };
    let edge = &cp.cfg.settings.server.edge;
    let body_timeout = std::time::Duration::from_millis(edge.body_read_timeout_ms);
    let streamed = Router::new()
        .route(
            "/v1/sandboxes/{id}/files",
            get(read_file).put(write_file).delete(remove_file),
        )
        .route(
            "/v1/templates/{name}",
            post(import_template).delete(remove_template),
        )
        .route("/v1/sandboxes/{id}/exec/stdin", post(exec_piped))
        .route_layer(axum::middleware::from_fn_with_state(
            cp.cp.clone(),
            observe_latency,
        ))
        .layer(DefaultBodyLimit::disable());
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/metrics/history", get(metrics_history))
        .route("/openapi.json", get(openapi_json))
        .route("/v1/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route(
            "/v1/sandboxes/{id}",
            get(get_sandbox).delete(delete_sandbox),
        )
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec_stream))
        .route("/v1/sandboxes/{id}/exec/tty", get(crate::tty::exec_tty))
        .route("/v1/sandboxes/{id}/files/list", get(list_files))
        .route("/v1/sandboxes/{id}/files/stat", get(stat_file))
        .route("/v1/sandboxes/{id}/files/mkdir", post(mkdir))
        .route(
            "/v1/sandboxes/{id}/lease",
            post(lease_acquire).put(lease_renew).delete(lease_release),
        )
        .route("/v1/sandboxes/{id}/events", get(sandbox_events))
        .route("/v1/sandboxes/{id}/ttl", post(set_ttl))
        .route("/v1/sandboxes/{id}/pause", post(pause))
        .route("/v1/sandboxes/{id}/resume", post(resume))
        .route("/v1/sandboxes/{id}/reset", post(reset))
        .route("/v1/sandboxes/{id}/taint", post(taint))
        .route("/v1/sandboxes/{id}/release", post(release))
        .route("/v1/sandboxes/{id}/manifest", get(manifest))
        .route("/v1/sandboxes/{id}/snapshot", post(snapshot))
        .route("/v1/sandboxes/{id}/fork", post(fork))
        .route("/v1/sandboxes/{id}/hibernate", post(hibernate))
        .route("/v1/sandboxes/{id}/wake", post(wake))
        .route("/v1/snapshots", get(snapshots))
        .route("/v1/snapshots/{id}", axum::routing::delete(delete_snapshot))
        .route("/v1/snapshots/gc", post(gc_snapshots))
        .route("/v1/nodes", get(nodes).post(add_node))
        .route("/v1/events", get(events))
        .route("/v1/events/stream", get(event_stream))
        .route("/v1/templates", get(templates))
        .route("/v1/keys", post(create_key).get(list_keys))
        .route("/v1/keys/{id}", axum::routing::delete(revoke_key))
        .route("/v1/plan", post(plan))
        .route("/v1/pools", get(pools))
        .route("/v1/pools/{class}", axum::routing::put(set_pool))
        .route("/v1/allocations", get(allocations))
        .merge(crate::procs::router())
        .merge(crate::usage::router())
        .route_layer(axum::middleware::from_fn_with_state(
            cp.cp.clone(),
            observe_latency,
        ))
        .layer(DefaultBodyLimit::max(json_limit))
        .merge(streamed)
        .merge(crate::ports::router())
        .nest(OPENSANDBOX_PREFIX, opensandbox)
        .merge(crate::console::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            cp.clone(),
            crate::ports::by_host,
        ))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            body_timeout,
        ))
        .layer(axum::Extension(limiter))
        // one span per request, inside the request-id layers below so it
        // names the id (exported when OpenTelemetry is configured)
        .layer(
            tower_http::trace::TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_response(
                    |res: &axum::http::Response<_>,
                     _latency: std::time::Duration,
                     span: &tracing::Span| {
                        span.record("http.response.status_code", res.status().as_u16());
                    },
                ),
        )
        // every answer carries its request id: the client's (when it is a
        // usable one) or a new one, the same id the events record
        .layer(tower_http::request_id::PropagateRequestIdLayer::x_request_id())
        .layer(tower_http::request_id::SetRequestIdLayer::x_request_id(
            NewRequestId,
        ))
        .layer(axum::middleware::map_request(drop_unusable_request_id))
        .with_state(cp)
}

/// The span of one request: method, path (never the query) and the request
/// id (`aviary.request_id`), the status recorded when the answer is made.
fn request_span<B>(req: &axum::http::Request<B>) -> tracing::Span {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    tracing::info_span!(
        "http.request",
        "otel.kind" = "server",
        "http.request.method" = %req.method(),
        "url.path" = %req.uri().path(),
        "aviary.request_id" = %id,
        "http.response.status_code" = tracing::field::Empty,
    )
}

/// Makes the id of a request that came without a usable one.
#[derive(Clone, Copy)]
struct NewRequestId;

impl tower_http::request_id::MakeRequestId for NewRequestId {
    fn make_request_id<B>(
        &mut self,
        _request: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        HeaderValue::from_str(&aviary_core::new_id("req"))
            .ok()
            .map(tower_http::request_id::RequestId::new)
    }
}

/// A client's `x-request-id` that is empty, too long or not printable
/// ASCII is dropped, so a new one is made (and echoed) instead.
async fn drop_unusable_request_id(mut req: Request) -> Request {
    let unusable = req
        .headers()
        .get("x-request-id")
        .is_some_and(|v| usable_request_id(v.to_str().ok()).is_none());
    if unusable {
        req.headers_mut().remove("x-request-id");
    }
    req
}

fn usable_request_id(v: Option<&str>) -> Option<&str> {
    v.filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
}
