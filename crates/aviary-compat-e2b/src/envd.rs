//! E2B's envd API (`E2B_SANDBOX_URL`), over the control plane's exec and
//! file operations.
//!
//! Every call names its sandbox with `E2b-Sandbox-Id` and presents the
//! sandbox's access token as `X-Access-Token`; the token resolves to a
//! context acting as the sandbox's tenant, so the operations' own checks
//! (tenant, fencing, paused, lost) apply unchanged. A sandbox that is
//! unknown, ended, paused or lost answers E2B's proxy answer: 502 with
//! `…was not found`, which the SDK reads as "not running".
//!
//! Commands: `process.Process/Start` runs `cmd args…` through
//! `ControlPlane::exec_start` with `Connect-Timeout-Ms` as the process's
//! lifetime (envd kills the process group when it passes; the stream then
//! ends with `deadline_exceeded`), and streams its output as it happens
//! ([`crate::process`]). Commands run as the sandbox's root in
//! `/home/user` when no `cwd` is given (E2B's home; made at create).

use crate::connect::{self, Code, ConnectError};
use crate::process::{ProcEvent, ProcessConfig, Selector};
use crate::{Charge, E2bState};
use aviary_control::requests::{FileRequest, FileUpload, OnSandbox, RemoveFileRequest, SandboxRef};
use aviary_control::{OpContext, OpError};
use aviary_core::api::{ExecRequest, FileInfo};
use aviary_core::ErrorCode;
use axum::body::Body;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use bytes::Bytes;
use futures_util::{Stream, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

/// E2B's default user's home: where commands start and relative paths
/// point.
pub const HOME: &str = "/home/user";
/// Longest listing of a recursive `ListDir`.
const MAX_LISTED: usize = 10_000;
/// Silence after which a stream gets a keepalive event when the client
/// named no interval.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);

pub(crate) fn routes() -> Router<E2bState> {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(download).post(upload))
        .route("/process.Process/{method}", post(process_rpc))
        .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
}

// ---- errors ---------------------------------------------------------------

/// E2B's proxy answer for a sandbox that is not running (or not the
/// caller's): the SDK looks for `was not found`.
pub fn sandbox_not_found(id: &str, why: &str) -> Response {
    let body = serde_json::json!({
        "sandboxId": id,
        "message": format!("The sandbox was not found{why}"),
        "code": 502,
    });
    (StatusCode::BAD_GATEWAY, Json(body)).into_response()
}

/// An envd-surface error: answered as a Connect error on RPC routes and as
/// E2B's `{code:int,message}` on REST routes; the sandbox-not-running case
/// is the proxy's 502 on both.
#[derive(Debug)]
pub enum EnvdError {
    NotRunning { id: String, why: String },
    Rpc(ConnectError),
}

impl From<ConnectError> for EnvdError {
    fn from(e: ConnectError) -> Self {
        EnvdError::Rpc(e)
    }
}

impl EnvdError {
    /// The error of a control-plane operation on sandbox `id`.
    pub fn op(id: &str, e: OpError) -> Self {
        if let OpError::Internal(cause) = &e {
            tracing::error!(
                error = format!("{cause:#}"),
                "internal error (e2b envd surface)"
            );
        }
        let message = e.public_message();
        let code = match e.code() {
            ErrorCode::InvalidState | ErrorCode::SandboxLost => {
                return EnvdError::NotRunning {
                    id: id.to_owned(),
                    why: format!(": {message}"),
                }
            }
            ErrorCode::InvalidRequest | ErrorCode::InvalidPath => Code::InvalidArgument,
            ErrorCode::NotFound => Code::NotFound,
            ErrorCode::Unauthorized => Code::Unauthenticated,
            ErrorCode::Forbidden | ErrorCode::PermissionDenied => Code::PermissionDenied,
            // a lease a native client holds: E2B calls carry no token
            ErrorCode::LeaseRequired | ErrorCode::StaleToken | ErrorCode::LeaseHeld => {
                Code::FailedPrecondition
            }
            ErrorCode::Conflict => Code::Aborted,
            ErrorCode::PayloadTooLarge | ErrorCode::RateLimited => Code::ResourceExhausted,
            ErrorCode::Unavailable
            | ErrorCode::Busy
            | ErrorCode::CapacityExhausted
            | ErrorCode::PortUnreachable => Code::Unavailable,
            ErrorCode::InvalidArchive | ErrorCode::Internal => Code::Internal,
            ErrorCode::Unsupported => Code::Unimplemented,
        };
        EnvdError::Rpc(ConnectError::new(code, message))
    }

    /// As a Connect RPC answer.
    pub fn rpc(self) -> Response {
        match self {
            EnvdError::NotRunning { id, why } => sandbox_not_found(&id, &why),
            EnvdError::Rpc(e) => e.into_response(),
        }
    }

    /// As a REST (`/files`, `/health`) answer.
    pub fn rest(self) -> Response {
        match self {
            EnvdError::NotRunning { id, why } => sandbox_not_found(&id, &why),
            EnvdError::Rpc(e) => {
                let status = match e.code {
                    // E2B's envd answers a full disk with 507
                    Code::ResourceExhausted if e.message.contains("disk is full") => {
                        StatusCode::INSUFFICIENT_STORAGE
                    }
                    c => c.http_status(),
                };
                let body = serde_json::json!({"code": status.as_u16(), "message": e.message});
                (status, Json(body)).into_response()
            }
        }
    }
}

// ---- auth -----------------------------------------------------------------

fn too_many(retry_after_s: u64) -> Response {
    let body = serde_json::json!({"code": 429, "message": "too many requests; retry later"});
    let mut r = (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
    r
}

/// The sandbox a call is for and the context it acts in.
pub struct SandboxCall {
    pub id: String,
    pub cx: OpContext,
}

impl FromRequestParts<E2bState> for SandboxCall {
    type Rejection = Response;
    async fn from_request_parts(parts: &mut Parts, st: &E2bState) -> Result<Self, Response> {
        let h = &parts.headers;
        let refuse = |status: StatusCode, message: &str| {
            let body = serde_json::json!({"code": status.as_u16(), "message": message});
            (status, Json(body)).into_response()
        };
        let id = h
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                refuse(
                    StatusCode::BAD_REQUEST,
                    "the E2b-Sandbox-Id header is required (set E2B_SANDBOX_URL to this server's /e2b/envd)",
                )
            })?
            .to_owned();
        let token = h
            .get("x-access-token")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                refuse(
                    StatusCode::UNAUTHORIZED,
                    "the X-Access-Token header (the sandbox's envdAccessToken) is required",
                )
            })?;
        match st.cp.authenticate_sandbox_token(&id, token).await {
            Ok(mut cx) => {
                let key = format!("e2b sandbox {id}");
                if let Err(after) = st.settings.charge(Charge::Key(&key), &parts.extensions) {
                    return Err(too_many(after));
                }
                if let Some(rid) = crate::api::request_id(h) {
                    cx = cx.with_request_id(rid);
                }
                Ok(SandboxCall { id, cx })
            }
            Err(OpError::NotFound(_)) => Err(sandbox_not_found(&id, "")),
            Err(OpError::Unauthorized) => {
                if let Err(after) = st.settings.charge(Charge::FailedAuth, &parts.extensions) {
                    return Err(too_many(after));
                }
                Err(refuse(
                    StatusCode::UNAUTHORIZED,
                    "invalid access token for this sandbox",
                ))
            }
            Err(e) => Err(EnvdError::op(&id, e).rest()),
        }
    }
}

// ---- /health --------------------------------------------------------------

/// 204 while the sandbox runs; 502 `…was not found` when it is paused,
/// ended or lost.
async fn health(State(st): State<E2bState>, call: SandboxCall) -> Response {
    match st.cp.get(&call.cx, SandboxRef::new(&call.id)).await {
        Ok(s) if crate::api::e2b_state(&s) == Some("running") => {
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(s) if s.paused => sandbox_not_found(&call.id, ": it is paused"),
        Ok(s) => sandbox_not_found(&call.id, &format!(": it is {}", s.state)),
        Err(e) => EnvdError::op(&call.id, e).rest(),
    }
}

// ---- paths ----------------------------------------------------------------

/// A sandbox path as E2B takes it: absolute, or relative to the home.
pub fn resolve(path: &str) -> Result<String, ConnectError> {
    if path.is_empty() {
        return Err(ConnectError::invalid("path is required"));
    }
    let p = if path.starts_with('/') {
        path.to_owned()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{HOME}/{rest}")
    } else if path == "~" {
        HOME.to_owned()
    } else {
        format!("{HOME}/{path}")
    };
    aviary_control::ops::check_sandbox_path(&p)
        .map_err(|e| ConnectError::invalid(e.public_message()))?;
    Ok(p)
}

fn parent(path: &str) -> Option<&str> {
    let trimmed = path.trim_end_matches('/');
    let (dir, _) = trimmed.rsplit_once('/')?;
    (!dir.is_empty()).then_some(dir)
}

fn base_name(path: &str) -> &str {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(path)
}

// ---- /files ---------------------------------------------------------------

#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    #[serde(default)]
    pub path: Option<String>,
    /// The user the SDK names; commands and files are the sandbox root's.
    #[serde(default)]
    #[allow(dead_code)]
    pub username: Option<String>,
}

async fn download(
    State(st): State<E2bState>,
    call: SandboxCall,
    Query(q): Query<FilesQuery>,
) -> Response {
    let path = match resolve(q.path.as_deref().unwrap_or("")) {
        Ok(p) => p,
        Err(e) => return EnvdError::from(e).rest(),
    };
    match st
        .cp
        .read_file(&call.cx, FileRequest::new(&call.id, &path))
        .await
    {
        Ok(reader) => {
            let body = Body::from_stream(tokio_util::io::ReaderStream::new(reader));
            ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
        }
        Err(e) => EnvdError::op(&call.id, e).rest(),
    }
}

/// One written file, as E2B answers an upload.
#[derive(Debug, Serialize)]
pub struct WriteInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
}

/// A byte stream cut at `max` bytes (the error names the limit).
fn limited<S>(s: S, max: u64) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send,
{
    let mut seen = 0u64;
    s.map(move |chunk| {
        let chunk = chunk?;
        seen += chunk.len() as u64;
        if seen > max {
            return Err(std::io::Error::other(format!(
                "upload larger than the limit of {max} bytes"
            )));
        }
        Ok(chunk)
    })
}

async fn write_one<S>(
    st: &E2bState,
    call: &SandboxCall,
    path: &str,
    body: S,
) -> Result<WriteInfo, EnvdError>
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send,
{
    if let Some(dir) = parent(path) {
        st.cp
            .mkdir(&call.cx, FileRequest::new(&call.id, dir))
            .await
            .map_err(|e| EnvdError::op(&call.id, e))?;
    }
    let reader = tokio_util::io::StreamReader::new(limited(body, st.settings.max_upload_bytes));
    let upload = FileUpload {
        id: call.id.clone(),
        path: path.to_owned(),
        body: Box::pin(reader),
    };
    st.cp
        .write_file(&call.cx, upload)
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    Ok(WriteInfo {
        name: base_name(path).to_owned(),
        kind: "file",
        path: path.to_owned(),
    })
}

/// `POST /files`: a multipart form (one `file` part per file; the target is
/// `?path=` for a single file, else each part's file name) or a raw body
/// to `?path=`. Answers the written files.
async fn upload(
    State(st): State<E2bState>,
    call: SandboxCall,
    Query(q): Query<FilesQuery>,
    req: Request,
) -> Response {
    match upload_files(&st, &call, q, req).await {
        Ok(written) => Json(written).into_response(),
        Err(e) => e.rest(),
    }
}

async fn upload_files(
    st: &E2bState,
    call: &SandboxCall,
    q: FilesQuery,
    req: Request,
) -> Result<Vec<WriteInfo>, EnvdError> {
    let headers = req.headers().clone();
    let gzip = match headers
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase())
    {
        None => false,
        Some(e) if e == "identity" => false,
        Some(e) if e == "gzip" => true,
        Some(e) => {
            return Err(ConnectError::invalid(format!(
                "Content-Encoding {e:?} is not supported (gzip or identity)"
            ))
            .into())
        }
    };
    let target = q.path.as_deref().map(resolve).transpose()?;
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let multipart = ct.to_ascii_lowercase().starts_with("multipart/form-data");
    if !multipart {
        let path = target.ok_or_else(|| ConnectError::invalid("?path= is required"))?;
        let body = req
            .into_body()
            .into_data_stream()
            .map_err(std::io::Error::other);
        if gzip {
            // the upload limit applies to what is written: decompressed
            let inflated = async_compression::tokio::bufread::GzipDecoder::new(
                tokio_util::io::StreamReader::new(body),
            );
            let inflated = tokio_util::io::ReaderStream::new(inflated);
            return Ok(vec![write_one(st, call, &path, inflated).await?]);
        }
        return Ok(vec![write_one(st, call, &path, body).await?]);
    }
    if gzip {
        return Err(ConnectError::invalid(
            "a gzip-compressed multipart form is not supported; compress octet-stream uploads only",
        )
        .into());
    }
    let boundary = multer::parse_boundary(ct)
        .map_err(|e| ConnectError::invalid(format!("bad multipart content type: {e}")))?;
    let mut form = multer::Multipart::new(req.into_body().into_data_stream(), boundary);
    let mut written = Vec::new();
    while let Some(field) = form
        .next_field()
        .await
        .map_err(|e| ConnectError::invalid(format!("malformed multipart body: {e}")))?
    {
        if field.name() != Some("file") {
            continue;
        }
        let path = match (&target, field.file_name()) {
            (Some(p), _) if written.is_empty() => p.clone(),
            (Some(_), _) => {
                return Err(ConnectError::invalid(
                    "several files with one ?path=: name each file's path in its part instead",
                )
                .into())
            }
            (None, Some(name)) => resolve(name)?,
            (None, None) => {
                return Err(
                    ConnectError::invalid("a file part without a file name needs ?path=").into(),
                )
            }
        };
        let body = field.map_err(std::io::Error::other);
        written.push(write_one(st, call, &path, body).await?);
    }
    if written.is_empty() {
        return Err(ConnectError::invalid("the form has no `file` part").into());
    }
    Ok(written)
}

// ---- Connect plumbing -----------------------------------------------------

/// The body of a unary call: JSON (`application/json`), bounded.
async fn unary_body(st: &E2bState, req: Request) -> Result<Bytes, ConnectError> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        return Err(ConnectError::new(
            Code::Unimplemented,
            format!("content type {ct:?} is not served; use the JSON codec (application/json)"),
        ));
    }
    connect::require_identity(req.headers())?;
    read_bounded(st, req).await
}

async fn read_bounded(st: &E2bState, req: Request) -> Result<Bytes, ConnectError> {
    let limit = st.settings.max_json_bytes;
    axum::body::to_bytes(req.into_body(), limit + connect::ENVELOPE_PREFIX)
        .await
        .map_err(|_| {
            ConnectError::new(
                Code::ResourceExhausted,
                format!("request unreadable or larger than {limit} bytes"),
            )
        })
}

/// The one message of a server-streaming call.
async fn stream_request(st: &E2bState, req: Request) -> Result<Bytes, ConnectError> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if !ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .eq_ignore_ascii_case(connect::STREAM_CONTENT_TYPE)
    {
        return Err(ConnectError::new(
            Code::Unimplemented,
            format!("content type {ct:?} is not served; use application/connect+json"),
        ));
    }
    connect::require_identity(req.headers())?;
    let max = st.settings.max_json_bytes;
    let body = read_bounded(st, req).await?;
    Ok(Bytes::copy_from_slice(connect::single_message(&body, max)?))
}

fn unary_ok<T: Serialize>(msg: &T) -> Response {
    let mut r = Json(msg).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A streaming answer: 200, `application/connect+json`, one envelope per
/// item, each written as it comes.
fn stream_response(s: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    let body = Body::from_stream(s.map(Ok::<_, Infallible>));
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(connect::STREAM_CONTENT_TYPE),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn keepalive_interval(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.clamp(1, 300)))
        .unwrap_or(DEFAULT_KEEPALIVE)
}

// ---- process.Process ------------------------------------------------------

/// `ProcessConfig` as sent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessConfigIn {
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartRequest {
    pub process: ProcessConfigIn,
    #[serde(default)]
    pub pty: Option<serde_json::Value>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// `ProcessSelector`: a pid or a tag.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectorIn {
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub tag: Option<String>,
}

impl SelectorIn {
    fn selector(self) -> Result<Selector, ConnectError> {
        match (self.pid, self.tag) {
            (Some(pid), None) => Ok(Selector::Pid(pid)),
            (None, Some(tag)) => Ok(Selector::Tag(tag)),
            _ => Err(ConnectError::invalid(
                "process must name exactly one of pid and tag",
            )),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectRequest {
    pub process: SelectorIn,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub process: SelectorIn,
    #[serde(default)]
    pub signal: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

/// The Aviary exec for a `StartRequest` (`timeout`: the call's deadline,
/// which is the process's lifetime).
pub fn exec_request(
    req: StartRequest,
    timeout: Option<Duration>,
    default_cwd: Option<&str>,
) -> Result<(ExecRequest, ProcessConfig), ConnectError> {
    if req.pty.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(ConnectError::unimplemented(
            "PTY sessions are not supported by Aviary's envd",
        ));
    }
    let p = req.process;
    if p.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is required"));
    }
    let cwd = match &p.cwd {
        Some(c) => Some(resolve(c)?),
        None => default_cwd.map(str::to_owned),
    };
    let config = ProcessConfig {
        cmd: p.cmd.clone(),
        args: p.args.clone(),
        envs: p.envs.clone(),
        cwd: cwd.clone(),
    };
    let mut cmd = vec![p.cmd];
    cmd.extend(p.args);
    let exec = ExecRequest {
        cmd: Some(cmd),
        cwd,
        env: p.envs,
        timeout_s: timeout.map(|t| t.as_secs_f64().max(0.001)),
        ..Default::default()
    };
    aviary_control::validate::exec_request(&exec)
        .map_err(|e| ConnectError::invalid(e.public_message()))?;
    Ok((exec, config))
}

/// `{"event": …}` of a process stream.
fn event_json(ev: serde_json::Value) -> Bytes {
    connect::message(&serde_json::json!({ "event": ev }))
}

fn start_event(pid: u32) -> Bytes {
    event_json(serde_json::json!({"start": {"pid": pid}}))
}

/// The envelopes for one process event; the second answer says the stream
/// ends with it.
fn process_envelopes(ev: ProcEvent) -> (Vec<Bytes>, bool) {
    let b64 = base64::engine::general_purpose::STANDARD;
    match ev {
        ProcEvent::Stdout(d) => (
            vec![event_json(
                serde_json::json!({"data": {"stdout": b64.encode(d)}}),
            )],
            false,
        ),
        ProcEvent::Stderr(d) => (
            vec![event_json(
                serde_json::json!({"data": {"stderr": b64.encode(d)}}),
            )],
            false,
        ),
        ProcEvent::Pty(d) => (
            vec![event_json(
                serde_json::json!({"data": {"pty": b64.encode(d)}}),
            )],
            false,
        ),
        ProcEvent::End(end) => {
            let mut e = serde_json::json!({"exited": true, "status": end.status});
            if end.exit_code != 0 {
                e["exitCode"] = end.exit_code.into();
            }
            let eos = if end.deadline_exceeded {
                ConnectError::new(
                    Code::DeadlineExceeded,
                    "the command ran past its timeout and was killed",
                )
                .end_stream()
            } else {
                connect::end_stream(None)
            };
            (vec![event_json(serde_json::json!({"end": e})), eos], true)
        }
        ProcEvent::Failed(err) => (vec![err.end_stream()], true),
    }
}

/// The stream of a process: `first`, then an envelope per event (a
/// keepalive after `keepalive` of silence), until the end.
fn process_stream(
    first: Bytes,
    keepalive: Duration,
    events: impl Stream<Item = ProcEvent> + Send + 'static,
) -> impl Stream<Item = Bytes> + Send {
    let events = Box::pin(events);
    let rest = futures_util::stream::unfold(Some(events), move |state| async move {
        let mut events = state?;
        // `next` on a stream is cancel-safe: an event is never lost to the timeout
        match tokio::time::timeout(keepalive, events.next()).await {
            Err(_) => Some((
                vec![event_json(serde_json::json!({"keepalive": {}}))],
                Some(events),
            )),
            Ok(Some(ev)) => {
                let (envs, last) = process_envelopes(ev);
                Some((envs, (!last).then_some(events)))
            }
            Ok(None) => Some((
                vec![ConnectError::new(
                    Code::Unavailable,
                    "the process's output ended without its exit",
                )
                .end_stream()],
                None,
            )),
        }
    })
    .flat_map(futures_util::stream::iter);
    futures_util::stream::once(async move { first }).chain(rest)
}

async fn process_rpc(
    State(st): State<E2bState>,
    call: SandboxCall,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    let r = match method.as_str() {
        "Start" => start(&st, call, req).await,
        "Connect" => attach(&st, call, req).await,
        "List" => list(&st, call, req).await,
        "SendSignal" => signal(&st, call, req).await,
        "SendInput" => send_input(&st, call, req).await,
        "Update" => update(&st, call, req).await,
        "StreamInput" => stream_input(&st, call, req).await,
        "CloseStdin" => close_stdin(&st, call, req).await,
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{other} does not exist"),
        )
        .into()),
    };
    r.unwrap_or_else(EnvdError::rpc)
}

async fn start(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let timeout = connect::timeout(req.headers())?;
    let keepalive = keepalive_interval(req.headers());
    let msg: StartRequest = connect::parse(&stream_request(st, req).await?)?;
    if msg.pty.as_ref().is_some_and(|p| !p.is_null()) {
        return start_pty(st, call, msg, timeout, keepalive).await;
    }
    let tag = msg.tag.clone();
    // commands start in the home when it exists (E2B's default), else
    // where envd starts them
    let home = match msg.process.cwd {
        Some(_) => None,
        None => st
            .cp
            .stat(&call.cx, FileRequest::new(&call.id, HOME))
            .await
            .ok()
            .filter(|f| f.kind == "dir")
            .map(|_| HOME),
    };
    let with_stdin = msg.stdin == Some(true);
    let (exec, config) = exec_request(msg, timeout, home)?;
    let (run, stdin) = if with_stdin {
        // the command reads what SendInput/StreamInput write, until CloseStdin
        let (writer, reader) = tokio::io::duplex(STDIN_BUFFER);
        let run = st
            .cp
            .exec_start_piped(&call.cx, OnSandbox::new(&call.id, exec), Box::pin(reader))
            .await
            .map_err(|e| EnvdError::op(&call.id, e))?;
        (run, Some(writer))
    } else {
        let run = st
            .cp
            .exec_start(&call.cx, OnSandbox::new(&call.id, exec))
            .await
            .map_err(|e| EnvdError::op(&call.id, e))?;
        (run, None)
    };
    let (proc, rx) = st
        .processes
        .start(st.cp.clone(), call.id.clone(), config, tag, run, stdin);
    let events =
        futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) },
        );
    let s = process_stream(start_event(proc.pid), keepalive, events);
    Ok(stream_response(s))
}

/// E2B's `PTY { size { cols, rows } }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtyIn {
    pub size: PtySizeIn,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySizeIn {
    #[serde(default)]
    pub cols: u32,
    #[serde(default)]
    pub rows: u32,
}

impl PtySizeIn {
    fn cells(&self) -> Result<(u16, u16), ConnectError> {
        let cols = u16::try_from(self.cols).unwrap_or(0);
        let rows = u16::try_from(self.rows).unwrap_or(0);
        aviary_envd_proto::check_pty_size(cols, rows).map_err(ConnectError::invalid)?;
        Ok((cols, rows))
    }
}

/// `Start` with a `pty`: the command on a terminal (Aviary's `exec/tty`
/// session), its output as `data.pty` events; input through `SendInput`,
/// the window size through `Update`.
async fn start_pty(
    st: &E2bState,
    call: SandboxCall,
    msg: StartRequest,
    timeout: Option<Duration>,
    keepalive: Duration,
) -> Result<Response, EnvdError> {
    if msg.stdin == Some(true) {
        return Err(ConnectError::invalid("a PTY takes its input through SendInput").into());
    }
    let pty: PtyIn = serde_json::from_value(msg.pty.unwrap_or_default())
        .map_err(|e| ConnectError::invalid(format!("pty: {e}")))?;
    let (cols, rows) = pty.size.cells()?;
    let p = msg.process;
    if p.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is required").into());
    }
    let cwd = match &p.cwd {
        Some(c) => Some(resolve(c)?),
        None => st
            .cp
            .stat(&call.cx, FileRequest::new(&call.id, HOME))
            .await
            .ok()
            .filter(|f| f.kind == "dir")
            .map(|_| HOME.to_owned()),
    };
    let config = ProcessConfig {
        cmd: p.cmd.clone(),
        args: p.args.clone(),
        envs: p.envs.clone(),
        cwd: cwd.clone(),
    };
    let mut cmd = vec![p.cmd];
    cmd.extend(p.args);
    let start = aviary_control::tty::TtyStart {
        cmd,
        cwd,
        env: p.envs,
        user: None,
        cols: Some(cols),
        rows: Some(rows),
    };
    start
        .validate()
        .map_err(|e| ConnectError::invalid(e.public_message()))?;
    let run = st
        .cp
        .exec_tty_start(&call.cx, OnSandbox::new(&call.id, start))
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    let (proc, rx) = st
        .processes
        .start_pty(st.cp.clone(), call.id.clone(), config, run, timeout);
    let events =
        futures_util::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) },
        );
    Ok(stream_response(process_stream(
        start_event(proc.pid),
        keepalive,
        events,
    )))
}

/// `SendInputRequest`: `{"process": …, "input": {"pty": base64}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendInputRequest {
    pub process: SelectorIn,
    pub input: ProcessInputIn,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessInputIn {
    #[serde(default)]
    pub pty: Option<String>,
    #[serde(default)]
    pub stdin: Option<String>,
}

/// `UpdateRequest`: `{"process": …, "pty": {"size": {…}}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateRequest {
    pub process: SelectorIn,
    #[serde(default)]
    pub pty: Option<PtyIn>,
}

/// The running process named by `sel`, or an E2B error.
fn find_proc(
    st: &E2bState,
    id: &str,
    sel: SelectorIn,
) -> Result<std::sync::Arc<crate::process::Proc>, ConnectError> {
    let sel = sel.selector()?;
    st.processes.find(id, &sel).ok_or_else(|| {
        ConnectError::new(
            Code::NotFound,
            format!("process {sel:?} not found (or it was started through another Aviary replica)"),
        )
    })
}

/// The running PTY named by `sel`, or an E2B error.
fn find_pty(
    st: &E2bState,
    id: &str,
    sel: SelectorIn,
) -> Result<std::sync::Arc<crate::process::Proc>, ConnectError> {
    let proc = find_proc(st, id, sel)?;
    if proc.pty().is_none() {
        return Err(ConnectError::unimplemented(
            "this process has no PTY: a command's input is given when it starts",
        ));
    }
    Ok(proc)
}

async fn send_input(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: SendInputRequest = connect::parse(&unary_body(st, req).await?)?;
    let data = match (msg.input.pty, msg.input.stdin) {
        (Some(d), None) => d,
        (None, Some(d)) => {
            let proc = find_proc(st, &call.id, msg.process)?;
            write_stdin(&proc, &d).await?;
            return Ok(unary_ok(&serde_json::json!({})));
        }
        _ => {
            return Err(
                ConnectError::invalid("input must hold exactly one of pty and stdin").into(),
            )
        }
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.as_bytes())
        .map_err(|e| ConnectError::invalid(format!("input.pty is not base64: {e}")))?;
    let proc = find_pty(st, &call.id, msg.process)?;
    let Some(input) = proc.pty() else {
        return Err(ConnectError::unimplemented("this process has no PTY").into());
    };
    input
        .lock()
        .await
        .write(&bytes)
        .await
        .map_err(|e| EnvdError::op(&call.id, OpError::from(e)))?;
    Ok(unary_ok(&serde_json::json!({})))
}

/// How much written stdin may wait for the command to read it: a writer
/// beyond it waits (back-pressure), as on a pipe.
const STDIN_BUFFER: usize = 64 * 1024;

/// Writes base64 `data` to a plain command's stdin.
async fn write_stdin(proc: &crate::process::Proc, data: &str) -> Result<(), ConnectError> {
    use tokio::io::AsyncWriteExt;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.as_bytes())
        .map_err(|e| ConnectError::invalid(format!("input.stdin is not base64: {e}")))?;
    let Some(stdin) = proc.stdin() else {
        return Err(ConnectError::new(
            Code::FailedPrecondition,
            "the process was not started with stdin (start it with stdin=True)",
        ));
    };
    let mut w = stdin.lock().await;
    let closed = || ConnectError::new(Code::FailedPrecondition, "the process's stdin is closed");
    let writer = w.as_mut().ok_or_else(closed)?;
    // the command may have exited: its end of the pipe is gone
    writer.write_all(&bytes).await.map_err(|_| closed())?;
    writer.flush().await.map_err(|_| closed())
}

/// `CloseStdin`: the command reads end of file.
async fn close_stdin(
    st: &E2bState,
    call: SandboxCall,
    req: Request,
) -> Result<Response, EnvdError> {
    let msg: SelectRequest = connect::parse(&unary_body(st, req).await?)?;
    let proc = find_proc(st, &call.id, msg.process)?;
    let Some(stdin) = proc.stdin() else {
        return Err(ConnectError::new(
            Code::FailedPrecondition,
            "the process was not started with stdin (start it with stdin=True)",
        )
        .into());
    };
    // dropping the write end is the end of file
    stdin.lock().await.take();
    Ok(unary_ok(&serde_json::json!({})))
}

/// `StreamInputRequest`: `start` (the process) first, then `data` or
/// `keepalive` messages.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamInputIn {
    #[serde(default)]
    pub start: Option<SelectRequest>,
    #[serde(default)]
    pub data: Option<StreamInputData>,
    #[serde(default)]
    pub keepalive: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamInputData {
    pub input: ProcessInputIn,
}

/// `StreamInput` (client streaming): the request body is a stream of
/// envelopes, each written to the process's input as it arrives; the
/// answer is one empty message once the client ends its stream.
async fn stream_input(
    st: &E2bState,
    call: SandboxCall,
    req: Request,
) -> Result<Response, EnvdError> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if !ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .eq_ignore_ascii_case(connect::STREAM_CONTENT_TYPE)
    {
        return Err(ConnectError::new(
            Code::Unimplemented,
            format!("content type {ct:?} is not served; use application/connect+json"),
        )
        .into());
    }
    connect::require_identity(req.headers())?;
    let max = st.settings.max_json_bytes;
    let mut body = req.into_body().into_data_stream();
    let mut buf = bytes::BytesMut::new();
    let mut proc: Option<std::sync::Arc<crate::process::Proc>> = None;
    loop {
        // every whole envelope in the buffer
        while buf.len() >= connect::ENVELOPE_PREFIX {
            let flags = buf[0];
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if len > max {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("request message of {len} bytes is larger than the limit of {max}"),
                )
                .into());
            }
            if flags != 0 {
                return Err(ConnectError::invalid(format!(
                    "unexpected envelope flags {flags:#04x} on a request message"
                ))
                .into());
            }
            if buf.len() < connect::ENVELOPE_PREFIX + len {
                break;
            }
            let _ = buf.split_to(connect::ENVELOPE_PREFIX);
            let msg: StreamInputIn = connect::parse(&buf.split_to(len))?;
            match (msg.start, msg.data, msg.keepalive, &proc) {
                (Some(start), None, None, None) => {
                    proc = Some(find_proc(st, &call.id, start.process)?);
                }
                (None, Some(data), None, Some(p)) => match (data.input.stdin, data.input.pty) {
                    (Some(d), None) => write_stdin(p, &d).await?,
                    (None, Some(d)) => {
                        let bytes = base64::engine::general_purpose::STANDARD
                            .decode(d.as_bytes())
                            .map_err(|e| {
                                ConnectError::invalid(format!("input.pty is not base64: {e}"))
                            })?;
                        let Some(input) = p.pty() else {
                            return Err(
                                ConnectError::unimplemented("this process has no PTY").into()
                            );
                        };
                        input
                            .lock()
                            .await
                            .write(&bytes)
                            .await
                            .map_err(|e| EnvdError::op(&call.id, OpError::from(e)))?;
                    }
                    _ => {
                        return Err(ConnectError::invalid(
                            "input must hold exactly one of pty and stdin",
                        )
                        .into())
                    }
                },
                (None, None, Some(_), _) => {}
                (Some(_), _, _, Some(_)) => {
                    return Err(
                        ConnectError::invalid("the stream names its process once, first").into(),
                    )
                }
                (None, Some(_), None, None) => {
                    return Err(ConnectError::invalid(
                        "the first message must be `start`, naming the process",
                    )
                    .into())
                }
                _ => {
                    return Err(ConnectError::invalid(
                        "a message holds exactly one of start, data and keepalive",
                    )
                    .into())
                }
            }
        }
        match body.next().await {
            Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
            Some(Err(_)) => {
                return Err(ConnectError::new(Code::Unavailable, "the input stream was cut").into())
            }
            None => break,
        }
    }
    if !buf.is_empty() {
        return Err(ConnectError::invalid("the input stream ended inside a message").into());
    }
    let s = futures_util::stream::iter([
        connect::message(&serde_json::json!({})),
        connect::end_stream(None),
    ]);
    Ok(stream_response(s))
}

async fn update(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: UpdateRequest = connect::parse(&unary_body(st, req).await?)?;
    let Some(pty) = msg.pty else {
        return Ok(unary_ok(&serde_json::json!({})));
    };
    let (cols, rows) = pty.size.cells()?;
    let proc = find_pty(st, &call.id, msg.process)?;
    let Some(input) = proc.pty() else {
        return Err(ConnectError::unimplemented("this process has no PTY").into());
    };
    input
        .lock()
        .await
        .resize(cols, rows)
        .await
        .map_err(|e| EnvdError::op(&call.id, OpError::from(e)))?;
    Ok(unary_ok(&serde_json::json!({})))
}

async fn attach(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let keepalive = keepalive_interval(req.headers());
    let msg: SelectRequest = connect::parse(&stream_request(st, req).await?)?;
    let sel = msg.process.selector()?;
    let proc = st.processes.find(&call.id, &sel).ok_or_else(|| {
        ConnectError::new(
            Code::NotFound,
            format!("process {sel:?} not found (or it was started through another Aviary replica)"),
        )
    })?;
    let events = futures_util::stream::unfold(proc.subscribe(), |mut rx| async move {
        let ev = match rx.recv().await {
            Ok(ev) => ev,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                ProcEvent::Failed(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("this client fell behind the process's output by {n} events"),
                ))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
        };
        Some((ev, rx))
    });
    let s = process_stream(start_event(proc.pid), keepalive, events);
    Ok(stream_response(s))
}

async fn list(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let _: Empty = connect::parse(&unary_body(st, req).await?)?;
    // the sandbox must still be the caller's and reachable
    st.cp
        .get(&call.cx, SandboxRef::new(&call.id))
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    let processes: Vec<_> = st
        .processes
        .list(&call.id)
        .into_iter()
        .map(|p| {
            let mut v = serde_json::json!({"config": p.config, "pid": p.pid});
            if let Some(t) = &p.tag {
                v["tag"] = t.clone().into();
            }
            v
        })
        .collect();
    Ok(unary_ok(&serde_json::json!({ "processes": processes })))
}

async fn signal(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: SignalRequest = connect::parse(&unary_body(st, req).await?)?;
    match &msg.signal {
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGKILL" || s == "SIGNAL_SIGTERM" => {}
        Some(serde_json::Value::Number(n)) if n.as_u64() == Some(9) || n.as_u64() == Some(15) => {}
        other => {
            return Err(ConnectError::invalid(format!(
                "signal {other:?} is not one of SIGNAL_SIGKILL, SIGNAL_SIGTERM"
            ))
            .into())
        }
    }
    let sel = msg.process.selector()?;
    let proc = st
        .processes
        .find(&call.id, &sel)
        .ok_or_else(|| ConnectError::new(Code::NotFound, format!("process {sel:?} not found")))?;
    // both signals end the whole process group (envd's kill on disconnect)
    proc.kill();
    Ok(unary_ok(&serde_json::json!({})))
}

// ---- filesystem.Filesystem ------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListDirRequest {
    pub path: String,
    #[serde(default)]
    pub depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

/// E2B's `EntryInfo` for an Aviary file.
pub fn entry_info(f: &FileInfo) -> serde_json::Value {
    let (kind, type_bit, letter) = match f.kind.as_str() {
        "file" => ("FILE_TYPE_FILE", 0u32, '-'),
        "dir" => ("FILE_TYPE_DIRECTORY", 1 << 31, 'd'),
        "symlink" => ("FILE_TYPE_SYMLINK", 1 << 27, 'l'),
        _ => ("FILE_TYPE_UNSPECIFIED", 0, '?'),
    };
    let perm = f.mode & 0o777;
    let mut permissions = String::with_capacity(10);
    permissions.push(letter);
    for shift in [6u32, 3, 0] {
        let bits = (perm >> shift) & 7;
        permissions.push(if bits & 4 != 0 { 'r' } else { '-' });
        permissions.push(if bits & 2 != 0 { 'w' } else { '-' });
        permissions.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    let modified = time::OffsetDateTime::from_unix_timestamp(f.modified_unix)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    serde_json::json!({
        "name": f.name,
        "type": kind,
        "path": f.path,
        "size": f.size.to_string(),
        "mode": perm | type_bit,
        "permissions": permissions,
        // Aviary's envd does not report owners; files are the sandbox root's
        "owner": "root",
        "group": "root",
        "modifiedTime": aviary_control::ops::rfc3339(modified),
    })
}

async fn filesystem_rpc(
    State(st): State<E2bState>,
    call: SandboxCall,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    let r = match method.as_str() {
        "Stat" => fs_stat(&st, call, req).await,
        "ListDir" => fs_list(&st, call, req).await,
        "MakeDir" => fs_mkdir(&st, call, req).await,
        "Remove" => fs_remove(&st, call, req).await,
        "Move" => fs_move(&st, call, req).await,
        "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => Err(
            ConnectError::unimplemented("watching directories is not supported by Aviary's envd")
                .into(),
        ),
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} does not exist"),
        )
        .into()),
    };
    r.unwrap_or_else(EnvdError::rpc)
}

async fn stat_entry(
    st: &E2bState,
    call: &SandboxCall,
    path: &str,
) -> Result<serde_json::Value, EnvdError> {
    let f = st
        .cp
        .stat(&call.cx, FileRequest::new(&call.id, path))
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    Ok(entry_info(&f))
}

async fn fs_stat(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: PathRequest = connect::parse(&unary_body(st, req).await?)?;
    let path = resolve(&msg.path)?;
    let entry = stat_entry(st, &call, &path).await?;
    Ok(unary_ok(&serde_json::json!({ "entry": entry })))
}

async fn fs_list(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: ListDirRequest = connect::parse(&unary_body(st, req).await?)?;
    let root = resolve(&msg.path)?;
    let depth = msg.depth.unwrap_or(1).max(1);
    let mut entries = Vec::new();
    let mut level = vec![root];
    for d in 1..=depth {
        let mut next = Vec::new();
        for dir in level {
            let listed = st
                .cp
                .list_files(&call.cx, FileRequest::new(&call.id, &dir))
                .await
                .map_err(|e| EnvdError::op(&call.id, e))?;
            for f in listed.entries {
                if entries.len() == MAX_LISTED {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!("more than {MAX_LISTED} entries; list with a smaller depth"),
                    )
                    .into());
                }
                if f.kind == "dir" && d < depth {
                    next.push(f.path.clone());
                }
                entries.push(entry_info(&f));
            }
        }
        level = next;
    }
    Ok(unary_ok(&serde_json::json!({ "entries": entries })))
}

async fn fs_mkdir(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: PathRequest = connect::parse(&unary_body(st, req).await?)?;
    let path = resolve(&msg.path)?;
    if st
        .cp
        .stat(&call.cx, FileRequest::new(&call.id, &path))
        .await
        .is_ok()
    {
        return Err(
            ConnectError::new(Code::AlreadyExists, format!("{path} already exists")).into(),
        );
    }
    st.cp
        .mkdir(&call.cx, FileRequest::new(&call.id, &path))
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    let entry = stat_entry(st, &call, &path).await?;
    Ok(unary_ok(&serde_json::json!({ "entry": entry })))
}

async fn fs_remove(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: PathRequest = connect::parse(&unary_body(st, req).await?)?;
    let path = resolve(&msg.path)?;
    st.cp
        .remove(
            &call.cx,
            RemoveFileRequest {
                id: call.id.clone(),
                path,
                recursive: true,
            },
        )
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    Ok(unary_ok(&serde_json::json!({})))
}

/// Renames with `mv -T` run through the sandbox's exec (Aviary's envd has
/// no rename call; the exec is fenced and audited like any).
async fn fs_move(st: &E2bState, call: SandboxCall, req: Request) -> Result<Response, EnvdError> {
    let msg: MoveRequest = connect::parse(&unary_body(st, req).await?)?;
    let (src, dst) = (resolve(&msg.source)?, resolve(&msg.destination)?);
    let exec = ExecRequest {
        cmd: Some(vec![
            "mv".into(),
            "-T".into(),
            "--".into(),
            src.clone(),
            dst.clone(),
        ]),
        timeout_s: Some(60.0),
        ..Default::default()
    };
    let r = st
        .cp
        .exec(&call.cx, OnSandbox::new(&call.id, exec))
        .await
        .map_err(|e| EnvdError::op(&call.id, e))?;
    if r.exit_code != 0 {
        let code = if r.stderr.contains("No such file") {
            Code::NotFound
        } else {
            Code::InvalidArgument
        };
        return Err(ConnectError::new(
            code,
            format!("cannot move {src} to {dst}: {}", r.stderr.trim()),
        )
        .into());
    }
    let entry = stat_entry(st, &call, &dst).await?;
    Ok(unary_ok(&serde_json::json!({ "entry": entry })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(json: &str) -> StartRequest {
        connect::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn start_request_becomes_an_argv_exec_with_the_deadline() {
        let req = start(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"}},"stdin":false}"#,
        );
        let (exec, config) =
            exec_request(req, Some(Duration::from_millis(30_000)), Some(HOME)).unwrap();
        assert_eq!(exec.cmd.unwrap(), vec!["/bin/bash", "-l", "-c", "echo hi"]);
        assert_eq!(exec.cwd.as_deref(), Some(HOME));
        assert_eq!(exec.env["A"], "1");
        assert_eq!(exec.timeout_s, Some(30.0));
        assert_eq!(config.cmd, "/bin/bash");
    }

    #[test]
    fn start_request_refuses_what_it_cannot_honour() {
        for (json, code) in [
            (
                r#"{"process":{"cmd":"sh"},"pty":{"size":{"cols":80,"rows":24}}}"#,
                Code::Unimplemented,
            ),
            (r#"{"process":{"cmd":""}}"#, Code::InvalidArgument),
            (
                r#"{"process":{"cmd":"sh","cwd":"../etc"}}"#,
                Code::InvalidArgument,
            ),
        ] {
            let e = exec_request(start(json), None, None).unwrap_err();
            assert_eq!(e.code, code, "{json}");
        }
        // unknown fields are refused, as envd's protojson does
        let e =
            connect::parse::<StartRequest>(br#"{"process":{"cmd":"sh","user":"x"}}"#).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        let e = connect::parse::<StartRequest>(br#"{"proc":{"cmd":"sh"}}"#).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
    }

    #[test]
    fn relative_paths_resolve_in_the_home_and_escapes_are_refused() {
        assert_eq!(resolve("a.txt").unwrap(), "/home/user/a.txt");
        assert_eq!(resolve("~/a").unwrap(), "/home/user/a");
        assert_eq!(resolve("/tmp/a").unwrap(), "/tmp/a");
        for bad in ["", "/tmp/../etc/passwd", "a/../../x", "/a\0b"] {
            assert_eq!(
                resolve(bad).unwrap_err().code,
                Code::InvalidArgument,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn entries_use_proto_enum_names_and_go_modes() {
        let f = FileInfo {
            name: "d".into(),
            path: "/tmp/d".into(),
            kind: "dir".into(),
            size: 4096,
            mode: 0o755,
            modified_unix: 0,
        };
        let e = entry_info(&f);
        assert_eq!(e["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(e["mode"], (1u64 << 31) | 0o755);
        assert_eq!(e["permissions"], "drwxr-xr-x");
        assert_eq!(e["size"], "4096");
        assert_eq!(e["modifiedTime"], "1970-01-01T00:00:00Z");
        let f = FileInfo {
            kind: "file".into(),
            mode: 0o644,
            ..f
        };
        assert_eq!(entry_info(&f)["permissions"], "-rw-r--r--");
    }

    #[test]
    fn end_events_carry_exit_codes_and_deadlines() {
        let (envs, last) = process_envelopes(ProcEvent::End(crate::process::EndInfo {
            exit_code: 3,
            status: "exit status 3".into(),
            deadline_exceeded: false,
        }));
        assert!(last);
        let end: serde_json::Value =
            serde_json::from_slice(&envs[0][connect::ENVELOPE_PREFIX..]).unwrap();
        assert_eq!(end["event"]["end"]["exitCode"], 3);
        assert_eq!(envs[1][0], connect::FLAG_END_STREAM);
        assert_eq!(&envs[1][connect::ENVELOPE_PREFIX..], b"{}");
        let (envs, _) = process_envelopes(ProcEvent::End(crate::process::EndInfo {
            exit_code: 0,
            status: "exit status 0".into(),
            deadline_exceeded: true,
        }));
        let end: serde_json::Value =
            serde_json::from_slice(&envs[0][connect::ENVELOPE_PREFIX..]).unwrap();
        assert!(end["event"]["end"].get("exitCode").is_none());
        let eos: serde_json::Value =
            serde_json::from_slice(&envs[1][connect::ENVELOPE_PREFIX..]).unwrap();
        assert_eq!(eos["error"]["code"], "deadline_exceeded");
    }

    #[tokio::test]
    async fn uploads_are_cut_at_the_limit() {
        let chunks = |n: usize| {
            futures_util::stream::iter(
                (0..n).map(|_| Ok::<_, std::io::Error>(Bytes::from_static(b"0123456789"))),
            )
        };
        let all: Vec<_> = limited(chunks(3), 30).collect().await;
        assert!(all.iter().all(Result::is_ok));
        let over: Vec<_> = limited(chunks(4), 30).collect().await;
        let e = over[3].as_ref().unwrap_err();
        assert!(e.to_string().contains("limit of 30 bytes"), "{e}");
    }

    #[test]
    fn parents_and_names_of_sandbox_paths() {
        assert_eq!(parent("/tmp/a/b.txt"), Some("/tmp/a"));
        assert_eq!(parent("/a.txt"), None);
        assert_eq!(base_name("/tmp/a/b.txt"), "b.txt");
        assert_eq!(base_name("/tmp/a/"), "a");
    }

    #[test]
    fn output_is_base64() {
        let (envs, last) = process_envelopes(ProcEvent::Stdout(Bytes::from_static(b"hi\n")));
        assert!(!last);
        let v: serde_json::Value =
            serde_json::from_slice(&envs[0][connect::ENVELOPE_PREFIX..]).unwrap();
        assert_eq!(v["event"]["data"]["stdout"], "aGkK");
    }
}
