//! Processes of a sandbox over HTTP: `GET /v1/sandboxes/{id}/processes`,
//! `POST /v1/sandboxes/{id}/processes` (a background command: answers its
//! handle at once), `POST /v1/sandboxes/{id}/processes/{pid}/signal`, and
//! `GET /v1/sandboxes/{id}/processes/{handle}/output` (one path parameter,
//! `{process}`, names the pid or the handle) (JSON, or with
//! `follow=true` server-sent events in exec/stream's format until the exit).
//! Handlers are thin: extract, build the context, call one operation.

use crate::error::ApiError;
use crate::http::{header_token, request_id, ApiJson, ApiQuery, AppState, Auth};
use aviary_control::requests::OnSandbox;
use aviary_control::{OpContext, OpError};
use aviary_core::api::{
    BackgroundOutput, BackgroundStarted, ExecRequest, ProcessList, SignalRequest,
};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use std::convert::Infallible;

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/sandboxes/{id}/processes",
            get(list_processes).post(start_background),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/signal",
            post(signal),
        )
        .route("/v1/sandboxes/{id}/processes/{process}/output", get(output))
}

fn context(auth: Auth, headers: &HeaderMap) -> Result<OpContext, ApiError> {
    Ok(OpContext::new(auth.0)
        .with_request_id(request_id(headers))
        .with_token(header_token(headers)?))
}

/// The sandbox's processes, as its envd sees them (pid 1 is envd).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes",
    params(("id" = String, Path, description = "sandbox id", max_length = 64)),
    responses((status = 200, body = ProcessList)),
    security(("api_key" = [])))]
pub(crate) async fn list_processes(
    State(st): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<ProcessList>, ApiError> {
    let cx = context(auth, &headers)?;
    Ok(Json(st.list_processes(&cx, &id).await?))
}

/// Starts a background command (fenced: `token` in the body or the lease
/// token header); envd keeps its last 1 MiB of output per stream and its exit.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes",
    params(("id" = String, Path, description = "sandbox id", max_length = 64)),
    request_body = ExecRequest,
    responses((status = 201, body = BackgroundStarted)),
    security(("api_key" = [])))]
pub(crate) async fn start_background(
    State(st): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<(StatusCode, Json<BackgroundStarted>), ApiError> {
    aviary_control::validate::exec_request(&req)?;
    let mut cx = context(auth, &headers)?;
    if req.token.is_some() {
        cx = cx.with_token(req.token);
    }
    let started = st.start_background(&cx, OnSandbox::new(id, req)).await?;
    Ok((StatusCode::CREATED, Json(started)))
}

#[derive(Deserialize)]
pub(crate) struct PidPath {
    id: String,
    /// The pid.
    process: String,
}

/// Sends a signal to one process of the sandbox (fenced; pid 1, envd, is refused).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/signal",
    params(("id" = String, Path, description = "sandbox id", max_length = 64),
           ("process" = i32, Path, description = "the process id (pid) inside the sandbox", minimum = 2)),
    request_body = SignalRequest,
    responses((status = 204, description = "sent")),
    security(("api_key" = [])))]
pub(crate) async fn signal(
    State(st): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(p): Path<PidPath>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> Result<StatusCode, ApiError> {
    let pid: i32 = p
        .process
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| OpError::InvalidRequest("pid must be a positive number".into()))?;
    let cx = context(auth, &headers)?;
    st.signal_process(&cx, &p.id, pid, req.signal.as_deref())
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub(crate) struct HandlePath {
    id: String,
    /// The handle.
    process: String,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct OutputQuery {
    /// Stream (server-sent events, as exec/stream) until the command exits.
    #[serde(default)]
    follow: bool,
}

/// A background command's kept output: JSON now, or with `follow=true`
/// server-sent events (`stdout`, `stderr` base64 chunks, then `exit`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}/output",
    params(("id" = String, Path, description = "sandbox id", max_length = 64),
           ("process" = u64, Path, description = "the background command's handle (what its start answered)", minimum = 1),
           OutputQuery),
    responses((status = 200, description = "the output (JSON), or with follow=true server-sent events of ExecEvent (as exec/stream)",
               content((BackgroundOutput = "application/json"), (crate::http::SseItem = "text/event-stream")))),
    security(("api_key" = [])))]
pub(crate) async fn output(
    State(st): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(p): Path<HandlePath>,
    ApiQuery(q): ApiQuery<OutputQuery>,
) -> Result<Response, ApiError> {
    let handle: u64 = p
        .process
        .parse()
        .ok()
        .filter(|h| *h > 0)
        .ok_or_else(|| OpError::InvalidRequest("handle must be a positive number".into()))?;
    let cx = context(auth, &headers)?;
    if !q.follow {
        let out: BackgroundOutput = st.background_output(&cx, &p.id, handle).await?;
        return Ok(Json(out).into_response());
    }
    let followed = st.follow_background(&cx, &p.id, handle).await?;
    let stream = futures_util::stream::unfold(Some(followed), |st| async move {
        let mut f = st?;
        let (ev, last) = crate::http::api_exec_event(f.next().await);
        Some((
            Ok::<_, Infallible>(crate::http::exec_event_sse(&ev)),
            (!last).then_some(f),
        ))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}
