//! E2B's control API (`E2B_API_URL`), over the control-plane operations.
//!
//! Mapping (README "E2B SDK"):
//! - create (`POST /v2/sandboxes`, v1 `POST /sandboxes`) → `ControlPlane::create`:
//!   `templateID` `base` is the default template, any other names an Aviary
//!   template; `timeout` (default 300 s, 15 s on v1) is the TTL; `metadata`
//!   is the sandbox's metadata; `envVars` its default exec environment;
//!   `autoPause: true` makes it user-managed (at its TTL the platform stops
//!   it, snapshot and hibernate, instead of destroying it). The metadata
//!   keys `aviary.session`, `aviary.user`, `aviary.agent` name Aviary's
//!   session scope (see [`scope_from_metadata`]).
//! - kill → delete; timeout → TTL from now (may shorten); pause → Aviary's
//!   pause (every process frozen, files and memory kept) with the TTL
//!   set to the server's longest (`max_sandbox_ttl_s`), so a paused
//!   sandbox waits for its connect; connect/resume → resume
//!   (or wake, for a sandbox the platform hibernated) with `timeout` as the
//!   new TTL.
//!
//! Errors are E2B's `{"code": <http status>, "message"}`; a failed
//! non-idempotent call says `Should-Retry: false`, so the SDK's retry loop
//! never creates (or kills) twice.

use crate::{Charge, E2bState, CLIENT_ID, ENVD_VERSION};
use aviary_control::requests::{SandboxQuery, SandboxRef, SetTtlRequest};
use aviary_control::{OpContext, OpError};
use aviary_core::api::{CreateSandboxRequest, Sandbox};
use aviary_core::{SandboxState, Scope};
use axum::extract::{FromRequest, FromRequestParts, Path, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// E2B's default sandbox lifetime (v2 create, connect).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// The v1 create's default lifetime.
pub const V1_DEFAULT_TIMEOUT_S: u64 = 15;
/// Largest page of a list.
pub const MAX_PAGE: usize = 100;
/// The metadata keys that name Aviary's scope fields.
pub const SESSION_KEY: &str = "aviary.session";
pub const USER_KEY: &str = "aviary.user";
pub const AGENT_KEY: &str = "aviary.agent";

pub(crate) fn routes() -> Router<E2bState> {
    Router::new()
        .route("/v2/sandboxes", post(create_v2).get(list_v2))
        .route("/sandboxes", post(create_v1).get(list_v1))
        .route("/sandboxes/{id}", get(get_sandbox).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
}

// ---- errors ---------------------------------------------------------------

/// An error in E2B's shape.
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
    /// The call changed (or may have changed) something: tell the SDK not
    /// to retry it.
    pub no_retry: bool,
    /// `Retry-After` (seconds), for a rate-limited call.
    pub retry_after_s: Option<u64>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
            no_retry: false,
            retry_after_s: None,
        }
    }

    fn no_retry(mut self) -> Self {
        self.no_retry = true;
        self
    }
}

impl From<OpError> for E2bError {
    fn from(e: OpError) -> Self {
        if let OpError::Internal(cause) = &e {
            tracing::error!(error = format!("{cause:#}"), "internal error (e2b surface)");
        }
        let status = StatusCode::from_u16(e.code().http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        E2bError {
            retry_after_s: e.retry_after_s(),
            ..E2bError::new(status, e.public_message())
        }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        let mut r = (self.status, Json(body)).into_response();
        if self.no_retry {
            r.headers_mut()
                .insert("should-retry", HeaderValue::from_static("false"));
        }
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// The answer to a path this surface does not serve.
pub(crate) async fn unknown_route() -> E2bError {
    E2bError::new(
        StatusCode::NOT_FOUND,
        "this E2B API route is not served by Aviary",
    )
}

// ---- auth and bodies ------------------------------------------------------

/// The caller, from `X-API-KEY` (its Aviary API key).
pub struct ApiCaller(pub OpContext);

impl FromRequestParts<E2bState> for ApiCaller {
    type Rejection = E2bError;
    async fn from_request_parts(parts: &mut Parts, st: &E2bState) -> Result<Self, E2bError> {
        let key = parts
            .headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        let caller = match st.cp.authenticate(key).await {
            Ok(c) => c,
            Err(OpError::Unauthorized) => {
                st.settings
                    .charge(Charge::FailedAuth, &parts.extensions)
                    .map_err(rate_limited)?;
                return Err(E2bError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing or unknown API key (X-API-KEY must be an Aviary API key)",
                ));
            }
            Err(e) => return Err(e.into()),
        };
        let hash = aviary_control::ops::hash_key(key.unwrap_or_default());
        st.settings
            .charge(Charge::Key(&format!("e2b key {hash}")), &parts.extensions)
            .map_err(rate_limited)?;
        let mut cx = OpContext::new(caller);
        if let Some(id) = request_id(&parts.headers) {
            cx = cx.with_request_id(id);
        }
        Ok(ApiCaller(cx))
    }
}

/// 429 with `Retry-After`, in E2B's shape (the SDK retries it).
pub(crate) fn rate_limited(retry_after_s: u64) -> E2bError {
    E2bError {
        status: StatusCode::TOO_MANY_REQUESTS,
        message: "too many requests; retry later".into(),
        no_retry: false,
        retry_after_s: Some(retry_after_s),
    }
}

/// The client's request id when it is a usable one (recorded on events).
pub(crate) fn request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| {
            !s.is_empty()
                && s.len() <= 128
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map(str::to_owned)
}

/// A JSON object body (an empty body reads as `{}`), bounded by the
/// surface's JSON limit.
pub struct E2bJson<T>(pub T);

impl<T: serde::de::DeserializeOwned> FromRequest<E2bState> for E2bJson<T> {
    type Rejection = E2bError;
    async fn from_request(req: Request, st: &E2bState) -> Result<Self, E2bError> {
        let limit = st.settings.max_json_bytes;
        let body = axum::body::to_bytes(req.into_body(), limit)
            .await
            .map_err(|_| {
                E2bError::new(
                    StatusCode::BAD_REQUEST,
                    format!("request body unreadable or larger than {limit} bytes"),
                )
            })?;
        let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &body
        };
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(E2bError::new(
                StatusCode::BAD_REQUEST,
                "the request body must be a JSON object",
            ));
        }
        serde_json::from_slice(body)
            .map(E2bJson)
            .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("invalid body: {e}")))
    }
}

// ---- JSON shapes ----------------------------------------------------------

/// `NewSandbox`: the fields Aviary honours, and those it refuses rather
/// than silently ignore; anything else is ignored as E2B's server does.
#[derive(Debug, Default, Deserialize)]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default, rename = "autoPause")]
    pub auto_pause: Option<bool>,
    #[serde(default)]
    pub allow_internet_access: Option<bool>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "envVars")]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub secure: Option<bool>,
    #[serde(default)]
    pub network: Option<serde_json::Value>,
    #[serde(default)]
    pub mcp: Option<serde_json::Value>,
    #[serde(default, rename = "volumeMounts")]
    pub volume_mounts: Option<serde_json::Value>,
    #[serde(default, rename = "autoResume")]
    pub auto_resume: Option<serde_json::Value>,
}

/// `{"timeout": N}` (timeout, connect, resume).
#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    #[serde(default)]
    pub timeout: Option<u64>,
}

/// E2B's `Sandbox` (create, connect, resume answers).
#[derive(Debug, Serialize)]
pub struct SandboxJson {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub alias: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    #[serde(rename = "envdAccessToken")]
    pub envd_access_token: String,
    #[serde(rename = "trafficAccessToken")]
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

/// E2B's `SandboxDetail` and `ListedSandbox` (one shape serves both).
#[derive(Debug, Serialize)]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub alias: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub metadata: BTreeMap<String, String>,
    #[serde(rename = "envdAccessToken", skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub domain: Option<String>,
}

/// How E2B sees an Aviary sandbox: `running`, `paused` (frozen by pause,
/// or hibernated by the platform), or not at all (ended, failed, lost,
/// still being set up or torn down).
pub fn e2b_state(s: &Sandbox) -> Option<&'static str> {
    match s.state {
        SandboxState::Hibernating => Some("paused"),
        st if st.is_live() => Some(if s.paused { "paused" } else { "running" }),
        _ => None,
    }
}

fn template_id(st: &E2bState, s: &Sandbox) -> String {
    if s.template == st.cp.cfg.default_template {
        "base".into()
    } else {
        s.template.clone()
    }
}

fn rfc3339(t: time::OffsetDateTime) -> String {
    aviary_control::ops::rfc3339(t)
}

fn detail(st: &E2bState, s: &Sandbox, token: Option<String>) -> SandboxDetail {
    let now = aviary_core::now();
    SandboxDetail {
        template_id: template_id(st, s),
        sandbox_id: s.id.to_string(),
        alias: s.template.clone(),
        client_id: CLIENT_ID,
        started_at: rfc3339(s.created_at),
        // a paused sandbox has no end: E2B's field is required, so it says now
        end_at: rfc3339(s.expires_at.unwrap_or(now)),
        envd_version: ENVD_VERSION,
        cpu_count: s.resources.cpu.ceil().max(1.0) as u64,
        memory_mb: s.resources.memory_mb,
        disk_size_mb: s.resources.disk_mb,
        state: e2b_state(s).unwrap_or("running"),
        metadata: s.metadata.clone(),
        envd_access_token: token,
        domain: None,
    }
}

async fn sandbox_json(st: &E2bState, cx: &OpContext, s: &Sandbox) -> Result<SandboxJson, OpError> {
    let token = st.cp.sandbox_access_token(cx, s.id.as_str()).await?;
    Ok(SandboxJson {
        template_id: template_id(st, s),
        sandbox_id: s.id.to_string(),
        alias: s.template.clone(),
        client_id: CLIENT_ID,
        envd_version: ENVD_VERSION,
        envd_access_token: token,
        traffic_access_token: None,
        domain: None,
    })
}

// ---- create ---------------------------------------------------------------

/// Aviary's scope fields named by E2B metadata: `aviary.session` makes the
/// sandbox the session's (SESSION scope: a later create for the same
/// session gets the same sandbox back, when the reuse checker proves it
/// fits); `aviary.user` and `aviary.agent` are recorded with it. Without a
/// session they are not applied: alone they would make a USER/AGENT-scope
/// sandbox, which Aviary hands out under a lease the E2B SDK cannot carry.
pub fn scope_from_metadata(req: &mut CreateSandboxRequest, metadata: &BTreeMap<String, String>) {
    let Some(session) = metadata.get(SESSION_KEY).cloned() else {
        return;
    };
    req.session_id = Some(session);
    req.user_id = metadata.get(USER_KEY).cloned();
    req.agent = metadata.get(AGENT_KEY).cloned();
    req.scope = Some(Scope::Session);
}

/// The Aviary create request for an E2B `NewSandbox`.
pub fn create_request(
    body: NewSandbox,
    default_timeout: u64,
) -> Result<CreateSandboxRequest, E2bError> {
    for (name, v) in [
        ("network", &body.network),
        ("mcp", &body.mcp),
        ("volumeMounts", &body.volume_mounts),
        ("autoResume", &body.auto_resume),
    ] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(E2bError::new(
                StatusCode::BAD_REQUEST,
                format!("{name} is not supported by Aviary's E2B surface"),
            ));
        }
    }
    if body.template_id.is_empty() {
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            "templateID is required",
        ));
    }
    let mut req = CreateSandboxRequest {
        template: (body.template_id != "base").then_some(body.template_id),
        ttl_s: Some(body.timeout.unwrap_or(default_timeout)),
        user_managed: body.auto_pause.unwrap_or(false),
        // E2B's sandboxes reach the internet unless told not to; Aviary's
        // default profile has no network, and asking for `open` goes
        // through the policy guard
        network: body
            .allow_internet_access
            .and_then(|open| open.then(|| "open".to_owned())),
        ..Default::default()
    };
    let metadata = body.metadata.unwrap_or_default();
    scope_from_metadata(&mut req, &metadata);
    req.metadata = metadata;
    req.env = body.env_vars.unwrap_or_default();
    Ok(req)
}

async fn create(
    st: E2bState,
    cx: OpContext,
    body: NewSandbox,
    default_timeout: u64,
) -> Result<Response, E2bError> {
    let req = create_request(body, default_timeout).map_err(E2bError::no_retry)?;
    let created = st
        .cp
        .create(&cx, req)
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    let s = created.sandbox;
    // E2B's sandboxes have the user's home; commands start there
    if let Err(e) = st
        .cp
        .mkdir(
            &cx,
            aviary_control::requests::FileRequest::new(s.id.as_str(), crate::envd::HOME),
        )
        .await
    {
        tracing::warn!(sandbox.id = %s.id, error = %e, "could not create the E2B home directory");
    }
    let json = sandbox_json(&st, &cx, &s)
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    Ok((StatusCode::CREATED, Json(json)).into_response())
}

async fn create_v2(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    E2bJson(body): E2bJson<NewSandbox>,
) -> Result<Response, E2bError> {
    create(st, cx, body, DEFAULT_TIMEOUT_S).await
}

async fn create_v1(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    E2bJson(body): E2bJson<NewSandbox>,
) -> Result<Response, E2bError> {
    create(st, cx, body, V1_DEFAULT_TIMEOUT_S).await
}

// ---- read -----------------------------------------------------------------

/// A sandbox of the caller that E2B can see (ended ones are not found).
async fn visible(st: &E2bState, cx: &OpContext, id: &str) -> Result<Sandbox, E2bError> {
    let s = st.cp.get(cx, SandboxRef::new(id)).await?;
    if e2b_state(&s).is_none() {
        return Err(not_found(id));
    }
    Ok(s)
}

fn not_found(id: &str) -> E2bError {
    E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
}

async fn get_sandbox(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<Json<SandboxDetail>, E2bError> {
    let s = visible(&st, &cx, &id).await?;
    let token = st.cp.sandbox_access_token(&cx, &id).await?;
    Ok(Json(detail(&st, &s, Some(token))))
}

/// The list filters of `GET /v2/sandboxes`, decoded as E2B encodes them.
#[derive(Debug, Default, PartialEq)]
pub struct ListFilter {
    pub metadata: BTreeMap<String, String>,
    /// `running` and/or `paused`; empty: both.
    pub states: Vec<String>,
    pub limit: usize,
    pub offset: usize,
    /// Oldest first (`order=asc`); newest first otherwise.
    pub ascending: bool,
    /// Only sandboxes started at or after this time.
    pub started_after: Option<time::OffsetDateTime>,
    /// Only sandboxes of this template (E2B id, `base` for the default, or
    /// the Aviary name).
    pub template: Option<String>,
}

/// Parses the query: `metadata` is one parameter holding an urlencoded
/// `k=v&k2=v2` (keys may contain dots), `state` is comma-joined (or
/// repeated), `limit` 1-100, `nextToken` the token of the previous page,
/// `order` asc|desc, `startedAfter` RFC 3339, `template`.
pub fn parse_list_query(raw: Option<&str>) -> Result<ListFilter, E2bError> {
    let bad = |m: String| E2bError::new(StatusCode::BAD_REQUEST, m);
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.unwrap_or(""))
        .map_err(|e| bad(format!("malformed query: {e}")))?;
    let mut f = ListFilter {
        limit: MAX_PAGE,
        ..Default::default()
    };
    for (k, v) in pairs {
        match k.as_str() {
            "metadata" => {
                let inner: Vec<(String, String)> = serde_urlencoded::from_str(&v)
                    .map_err(|e| bad(format!("malformed metadata filter: {e}")))?;
                for (mk, mv) in inner {
                    if mk.is_empty() {
                        return Err(bad("metadata filter has an empty key".into()));
                    }
                    f.metadata.insert(mk, mv);
                }
            }
            "state" => {
                for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    if s != "running" && s != "paused" {
                        return Err(bad(format!("state {s:?} is not one of running, paused")));
                    }
                    if !f.states.iter().any(|x| x == s) {
                        f.states.push(s.to_owned());
                    }
                }
            }
            "limit" => {
                f.limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| bad(format!("limit must be 1-{MAX_PAGE}")))?;
            }
            "nextToken" => {
                f.offset = v
                    .parse()
                    .ok()
                    .filter(|n: &usize| *n <= 1_000_000)
                    .ok_or_else(|| bad("nextToken is not a token this server issued".into()))?;
            }
            "order" => {
                f.ascending = match v.as_str() {
                    "asc" => true,
                    "desc" => false,
                    _ => return Err(bad(format!("order {v:?} is not asc or desc"))),
                }
            }
            "startedAfter" => {
                let t =
                    time::OffsetDateTime::parse(&v, &time::format_description::well_known::Rfc3339)
                        .map_err(|e| bad(format!("startedAfter is not an RFC 3339 time: {e}")))?;
                f.started_after = Some(t);
            }
            "template" => f.template = Some(v),
            _ => {}
        }
    }
    Ok(f)
}

/// The caller's sandboxes that pass `f`, newest first, one page.
async fn list_page(
    st: &E2bState,
    cx: &OpContext,
    f: &ListFilter,
) -> Result<(Vec<SandboxDetail>, Option<String>), E2bError> {
    let query = SandboxQuery {
        metadata: f.metadata.clone(),
        ..Default::default()
    };
    let mut all = st.cp.list(cx, query).await?;
    all.retain(|s| {
        e2b_state(s).is_some_and(|state| f.states.is_empty() || f.states.iter().any(|x| x == state))
            && f.started_after.is_none_or(|t| s.created_at >= t)
            && f.template
                .as_ref()
                .is_none_or(|t| *t == s.template || *t == template_id(st, s))
    });
    all.sort_by(|a, b| {
        let by_start = if f.ascending {
            a.created_at.cmp(&b.created_at)
        } else {
            b.created_at.cmp(&a.created_at)
        };
        by_start.then_with(|| a.id.as_str().cmp(b.id.as_str()))
    });
    let page: Vec<SandboxDetail> = all
        .iter()
        .skip(f.offset)
        .take(f.limit)
        .map(|s| detail(st, s, None))
        .collect();
    let next = (f.offset + page.len() < all.len()).then(|| (f.offset + page.len()).to_string());
    Ok((page, next))
}

async fn list_v2(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    let f = parse_list_query(q.as_deref())?;
    let (page, next) = list_page(&st, &cx, &f).await?;
    let mut r = Json(page).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        r.headers_mut().insert("x-next-token", n);
    }
    Ok(r)
}

/// v1 list: the running sandboxes, every page at once.
async fn list_v1(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    RawQuery(q): RawQuery,
) -> Result<Json<Vec<SandboxDetail>>, E2bError> {
    let mut f = parse_list_query(q.as_deref())?;
    f.states = vec!["running".into()];
    f.limit = usize::MAX;
    Ok(Json(list_page(&st, &cx, &f).await?.0))
}

// ---- lifecycle ------------------------------------------------------------

async fn kill(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    // anything not yet ended can be killed (a lost or failed one too)
    let s = st
        .cp
        .get(&cx, SandboxRef::new(&id))
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    if s.state.is_terminal() {
        return Err(not_found(&id).no_retry());
    }
    st.cp
        .delete(&cx, SandboxRef::new(&id))
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    st.processes.forget_sandbox(&id);
    Ok(StatusCode::NO_CONTENT)
}

async fn set_timeout(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
    E2bJson(body): E2bJson<TimeoutBody>,
) -> Result<StatusCode, E2bError> {
    let timeout = body.timeout.ok_or_else(|| {
        E2bError::new(StatusCode::BAD_REQUEST, "timeout (seconds) is required").no_retry()
    })?;
    let s = visible(&st, &cx, &id).await.map_err(E2bError::no_retry)?;
    if e2b_state(&s) == Some("paused") {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is paused; connect to it to set its timeout"),
        )
        .no_retry());
    }
    set_ttl(&st, &cx, &id, timeout)
        .await
        .map_err(E2bError::no_retry)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let s = visible(&st, &cx, &id).await.map_err(E2bError::no_retry)?;
    if e2b_state(&s) == Some("paused") {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        )
        .no_retry());
    }
    st.cp
        .pause(&cx, SandboxRef::new(&id))
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    // a paused E2B sandbox waits for its connect: it is kept as long as
    // any sandbox may live (the server's longest TTL)
    set_ttl(&st, &cx, &id, st.cp.cfg.max_sandbox_ttl_s)
        .await
        .map_err(E2bError::no_retry)?;
    Ok(StatusCode::NO_CONTENT)
}

/// E2B's `timeout`: the sandbox now expires `ttl_s` from now.
async fn set_ttl(st: &E2bState, cx: &OpContext, id: &str, ttl_s: u64) -> Result<Sandbox, E2bError> {
    let req = SetTtlRequest {
        id: id.to_owned(),
        ttl_s,
    };
    Ok(st.cp.set_ttl(cx, req).await?)
}

/// Brings a paused (or hibernated) sandbox back with `timeout` as its new
/// lifetime; a running one only has its lifetime extended, never
/// shortened. Answers whether it was resumed.
async fn bring_back(
    st: &E2bState,
    cx: &OpContext,
    id: &str,
    timeout: u64,
) -> Result<(Sandbox, bool), E2bError> {
    let s = visible(st, cx, id).await?;
    let resumed = match (s.state, s.paused) {
        (SandboxState::Hibernating, _) => {
            st.cp.wake(cx, SandboxRef::new(id)).await?;
            true
        }
        (_, true) => {
            st.cp.resume(cx, SandboxRef::new(id)).await?;
            true
        }
        _ => false,
    };
    let wanted = aviary_core::now() + time::Duration::seconds(timeout.min(i64::MAX as u64) as i64);
    let s = if resumed || s.expires_at.is_some_and(|t| t < wanted) {
        set_ttl(st, cx, id, timeout).await?
    } else {
        s
    };
    Ok((s, resumed))
}

async fn connect(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
    E2bJson(body): E2bJson<TimeoutBody>,
) -> Result<Response, E2bError> {
    let timeout = body.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    let (s, resumed) = bring_back(&st, &cx, &id, timeout)
        .await
        .map_err(E2bError::no_retry)?;
    let json = sandbox_json(&st, &cx, &s)
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(json)).into_response())
}

/// v1 resume: 409 when the sandbox is running, else as connect.
async fn resume(
    State(st): State<E2bState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
    E2bJson(body): E2bJson<TimeoutBody>,
) -> Result<Response, E2bError> {
    let s = visible(&st, &cx, &id).await.map_err(E2bError::no_retry)?;
    if e2b_state(&s) == Some("running") {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already running"),
        )
        .no_retry());
    }
    let timeout = body.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    let (s, _) = bring_back(&st, &cx, &id, timeout)
        .await
        .map_err(E2bError::no_retry)?;
    let json = sandbox_json(&st, &cx, &s)
        .await
        .map_err(|e| E2bError::from(e).no_retry())?;
    Ok((StatusCode::CREATED, Json(json)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filter_is_decoded_as_e2b_encodes_it() {
        // urlencode({"agentscope.workspace.id": "w 1", "a&b": "c=d"}) sent
        // as one parameter, urlencoded again
        let q =
            "metadata=agentscope.workspace.id%3Dw%2B1%26a%2526b%3Dc%253Dd&state=paused%2Crunning";
        let f = parse_list_query(Some(q)).unwrap();
        assert_eq!(f.metadata["agentscope.workspace.id"], "w 1");
        assert_eq!(f.metadata["a&b"], "c=d");
        assert_eq!(f.states, vec!["paused", "running"]);
        assert_eq!(f.limit, MAX_PAGE);
    }

    #[test]
    fn bad_list_queries_are_400() {
        for q in [
            "state=stopped",
            "limit=0",
            "limit=101",
            "limit=x",
            "nextToken=abc",
            "metadata=%3Dv",
            "order=up",
            "startedAfter=yesterday",
        ] {
            let e = parse_list_query(Some(q)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{q}");
        }
        assert_eq!(parse_list_query(None).unwrap().states, Vec::<String>::new());
        let f = parse_list_query(Some(
            "order=asc&startedAfter=2026-01-01T00%3A00%3A00Z&template=base&limit=5&nextToken=10",
        ))
        .unwrap();
        assert!(f.ascending);
        assert_eq!(f.started_after.unwrap().year(), 2026);
        assert_eq!(f.template.as_deref(), Some("base"));
        assert_eq!((f.limit, f.offset), (5, 10));
    }

    #[test]
    fn create_maps_template_timeout_metadata_and_env() {
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","metadata":{"k":"v"},"envVars":{"A":"1"},"unknownField":3}"#,
        )
        .unwrap();
        let req = create_request(body, DEFAULT_TIMEOUT_S).unwrap();
        assert_eq!(req.template, None);
        assert_eq!(req.ttl_s, Some(300));
        assert_eq!(req.metadata["k"], "v");
        assert_eq!(req.env["A"], "1");
        assert_eq!(req.scope, None);
        assert!(!req.user_managed);
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"py","timeout":60,"autoPause":true,"metadata":{"aviary.session":"s1","aviary.user":"u"}}"#,
        )
        .unwrap();
        let req = create_request(body, DEFAULT_TIMEOUT_S).unwrap();
        assert_eq!(req.template.as_deref(), Some("py"));
        assert_eq!(req.ttl_s, Some(60));
        assert!(req.user_managed);
        assert_eq!(req.session_id.as_deref(), Some("s1"));
        assert_eq!(req.user_id.as_deref(), Some("u"));
        assert_eq!(req.scope, Some(Scope::Session));
    }

    #[test]
    fn user_without_session_is_not_a_scope() {
        let body: NewSandbox =
            serde_json::from_str(r#"{"templateID":"base","metadata":{"aviary.user":"u"}}"#)
                .unwrap();
        let req = create_request(body, DEFAULT_TIMEOUT_S).unwrap();
        assert_eq!((req.user_id, req.scope), (None, None));
    }

    #[test]
    fn unsupported_create_options_are_refused_not_ignored() {
        for extra in [
            r#""network":{"allowOut":["x"]}"#,
            r#""mcp":{"a":{}}"#,
            r#""volumeMounts":[{"name":"v"}]"#,
        ] {
            let body: NewSandbox =
                serde_json::from_str(&format!(r#"{{"templateID":"base",{extra}}}"#)).unwrap();
            let e = create_request(body, DEFAULT_TIMEOUT_S).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
        }
        let body: NewSandbox =
            serde_json::from_str(r#"{"templateID":"base","network":null}"#).unwrap();
        create_request(body, DEFAULT_TIMEOUT_S).unwrap();
    }

    #[test]
    fn errors_have_e2b_shape_and_no_retry_header() {
        let r = E2bError::new(StatusCode::NOT_FOUND, "gone")
            .no_retry()
            .into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(r.headers()["should-retry"], "false");
        let r = E2bError::from(OpError::Unauthorized).into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert!(r.headers().get("should-retry").is_none());
    }
}
