//! execd, the in-sandbox API of OpenSandbox, served per sandbox at
//! `{prefix}/sandboxes/{id}/execd` (the endpoint the lifecycle API hands
//! out for port 44772). Each route authenticates with the sandbox's access
//! token (header `X-EXECD-ACCESS-TOKEN`, from the endpoint's `headers`;
//! never the API key), which acts as the sandbox's tenant, and runs control
//! plane operations like any client: audited, fenced (a compat call has no
//! lease token, so a sandbox leased by a native client refuses it with
//! `409 LEASE_REQUIRED`).
//!
//! Served: `GET /ping`, `POST /command` (streamed), `POST /files/upload`,
//! `GET /files/download`, `GET /files/info`, `DELETE /files`,
//! `GET /files/search`, `POST /directories`, `DELETE /directories`. Any
//! other execd route answers `501 NOT_SUPPORTED`. The egress endpoint
//! (18080) answers `501` on every route: Aviary's network profiles are set
//! at create, there is no per-sandbox egress sidecar to talk to.
//!
//! Commands run as `/bin/sh -c COMMAND` (or the given argv) as root in the
//! sandbox; `background`, and `uid`/`gid` other than 0, are refused (400).

use crate::error::OsbError;
use crate::events::{now_ms, CommandEvent, LineSplitter};
use crate::lifecycle::{json_body, EXECD_TOKEN_HEADER};
use crate::upload::{self, Pairing, UploadMeta};
use crate::OsbState;
use aviary_control::requests::{FileRequest, FileUpload, OnSandbox, RemoveFileRequest, SandboxRef};
use aviary_control::{ControlPlane, OpContext, OpError};
use aviary_core::api::{ExecRequest, FileInfo};
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::TryStreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// After this long without output, the command stream sends a `ping`.
const PING_AFTER: Duration = Duration::from_secs(3);

/// The sandbox an execd request is for, and the context its token grants.
pub struct SandboxCaller {
    pub id: String,
    pub cx: OpContext,
}

impl FromRequestParts<OsbState> for SandboxCaller {
    type Rejection = OsbError;
    async fn from_request_parts(parts: &mut Parts, st: &OsbState) -> Result<Self, OsbError> {
        let Path(params) = Path::<BTreeMap<String, String>>::from_request_parts(parts, st)
            .await
            .map_err(|_| OsbError::invalid("bad sandbox path"))?;
        let id = params
            .get("id")
            .cloned()
            .ok_or_else(|| OsbError::invalid("no sandbox in the path"))?;
        let token = parts
            .headers
            .get(EXECD_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or(OpError::Unauthorized)?;
        let cx = st
            .cp
            .authenticate_sandbox_token(&id, token)
            .await?
            .with_request_id(crate::request_id(&parts.headers));
        st.admit(&format!("sandbox-token {id}"))?;
        Ok(SandboxCaller { id, cx })
    }
}

/// `GET /ping`: 200 while the sandbox runs; 503 while it is paused or not
/// started yet (the SDK keeps polling on 5xx).
pub(crate) async fn ping(
    State(st): State<OsbState>,
    caller: SandboxCaller,
) -> Result<StatusCode, OsbError> {
    let sb = st.cp.get(&caller.cx, SandboxRef::new(&caller.id)).await?;
    match crate::lifecycle::osb_state(&sb) {
        "Running" => Ok(StatusCode::OK),
        "Terminated" => Err(OpError::NotFound(format!("sandbox {}", caller.id)).into()),
        other => Err(OpError::Unavailable(format!("the sandbox is {other}")).into()),
    }
}

/// `POST /command`
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunCommand {
    #[serde(default)]
    command: Option<String>,
    #[serde(default)]
    argv: Option<Vec<String>>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    background: Option<bool>,
    /// Milliseconds.
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    uid: Option<u32>,
    #[serde(default)]
    gid: Option<u32>,
    #[serde(default)]
    envs: Option<BTreeMap<String, String>>,
}

impl RunCommand {
    fn into_exec(self) -> Result<ExecRequest, OsbError> {
        if self.background == Some(true) {
            return Err(OsbError::invalid(
                "background commands are not supported by Aviary's execd; run \
                 `nohup CMD >LOG 2>&1 &` in a foreground command instead",
            ));
        }
        if self.uid.is_some_and(|u| u != 0) || self.gid.is_some_and(|g| g != 0) {
            return Err(OsbError::invalid(
                "commands run as root in Aviary sandboxes; uid/gid other than 0 are not supported",
            ));
        }
        let (shell, cmd) = match (self.command, self.argv) {
            (Some(c), None) if !c.trim().is_empty() => (Some(c), None),
            (None, Some(a)) if !a.is_empty() => (None, Some(a)),
            _ => {
                return Err(OsbError::invalid(
                    "give exactly one of command (non-empty) and argv (non-empty)",
                ))
            }
        };
        if let Some(cwd) = &self.cwd {
            upload::check_path(cwd)?;
        }
        let req = ExecRequest {
            cmd,
            shell,
            cwd: self.cwd,
            env: self.envs.unwrap_or_default(),
            stdin: None,
            timeout_s: self.timeout.map(|ms| ms as f64 / 1000.0),
            token: None,
        };
        aviary_control::validate::exec_request(&req)?;
        Ok(req)
    }
}

/// What the task draining an exec tells the response stream.
enum ExecMsg {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit { code: i32, ms: u64, timed_out: bool },
    Failed(String),
}

/// `POST /command`: the command's events as they happen (see `events`).
/// The exec is drained by its own task, so output is sent the moment it
/// comes and silence is filled with pings; a client that goes away stops
/// the draining (the exec's stream is dropped).
pub(crate) async fn command(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    body: Bytes,
) -> Result<Response, OsbError> {
    let req = json_body::<RunCommand>(&body)?.into_exec()?;
    // execd answers a missing working directory with a 400 before any
    // event (AgentScope probes with a cwd that does not exist yet)
    if let Some(cwd) = &req.cwd {
        let not_dir = |why: &str| OsbError::invalid(format!("working directory {cwd} {why}"));
        match st
            .cp
            .stat(&caller.cx, FileRequest::new(&caller.id, cwd))
            .await
        {
            Ok(info) if info.kind == "dir" || info.kind == "symlink" => {}
            Ok(_) => return Err(not_dir("is not a directory")),
            Err(e) if e.code() == aviary_core::ErrorCode::NotFound => {
                return Err(not_dir("does not exist"))
            }
            Err(e) => return Err(e.into()),
        }
    }
    let mut run = st
        .cp
        .exec_start(&caller.cx, OnSandbox::new(&caller.id, req))
        .await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<ExecMsg>(64);
    let cp = st.cp.clone();
    tokio::spawn(async move {
        loop {
            let msg = match run.stream.next().await {
                Ok(aviary_envd_proto::ExecEvent::Stdout(d)) => ExecMsg::Stdout(d),
                Ok(aviary_envd_proto::ExecEvent::Stderr(d)) => ExecMsg::Stderr(d),
                Ok(aviary_envd_proto::ExecEvent::Exit(exit)) => {
                    cp.exec_finish(&run, &exit).await;
                    let _ = tx
                        .send(ExecMsg::Exit {
                            code: exit.exit_code,
                            ms: u64::try_from(exit.duration.as_millis()).unwrap_or(u64::MAX),
                            timed_out: exit.timed_out,
                        })
                        .await;
                    return;
                }
                Err(e) => {
                    let _ = tx
                        .send(ExecMsg::Failed(OpError::from(e).public_message()))
                        .await;
                    return;
                }
            };
            if tx.send(msg).await.is_err() {
                return;
            }
        }
    });
    let init = CommandEvent::Init {
        execution_id: aviary_core::new_id("exec"),
    };
    let state = Some(CommandStream {
        rx,
        out: LineSplitter::default(),
        err: LineSplitter::default(),
    });
    let first =
        futures_util::stream::once(async move { Ok::<_, std::io::Error>(init.frame(now_ms())) });
    let rest = futures_util::stream::unfold(state, |state| async move {
        let mut s = state?;
        loop {
            let msg = match tokio::time::timeout(PING_AFTER, s.rx.recv()).await {
                Err(_) => return Some((Ok(CommandEvent::Ping.frame(now_ms())), Some(s))),
                Ok(m) => m,
            };
            let (frames, done) = s.frames(msg);
            if !frames.is_empty() || done {
                let next = if done { None } else { Some(s) };
                return Some((Ok(Bytes::from(frames)), next));
            }
        }
    });
    let body = Body::from_stream(futures_util::StreamExt::chain(first, rest));
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response())
}

struct CommandStream {
    rx: tokio::sync::mpsc::Receiver<ExecMsg>,
    out: LineSplitter,
    err: LineSplitter,
}

impl CommandStream {
    /// The frames one message makes, and whether the stream ends with them.
    fn frames(&mut self, msg: Option<ExecMsg>) -> (Vec<u8>, bool) {
        let mut frames = Vec::new();
        let mut push = |ev: CommandEvent| frames.extend_from_slice(&ev.frame(now_ms()));
        match msg {
            Some(ExecMsg::Stdout(d)) => {
                if let Some(t) = self.out.push(&d) {
                    push(CommandEvent::Stdout(t));
                }
                (frames, false)
            }
            Some(ExecMsg::Stderr(d)) => {
                if let Some(t) = self.err.push(&d) {
                    push(CommandEvent::Stderr(t));
                }
                (frames, false)
            }
            Some(ExecMsg::Exit {
                code,
                ms,
                timed_out,
            }) => {
                self.flush(&mut push);
                let mut ev = CommandEvent::exit(code, ms);
                if let (true, CommandEvent::Error { traceback, .. }) = (timed_out, &mut ev) {
                    traceback.push("killed: the command's timeout passed".into());
                }
                push(ev);
                (frames, true)
            }
            Some(ExecMsg::Failed(reason)) => {
                self.flush(&mut push);
                push(CommandEvent::Error {
                    evalue: reason.clone(),
                    traceback: vec![reason],
                });
                (frames, true)
            }
            None => {
                self.flush(&mut push);
                push(CommandEvent::Error {
                    evalue: "the command's stream ended without an exit".into(),
                    traceback: vec![],
                });
                (frames, true)
            }
        }
    }

    fn flush(&mut self, push: &mut impl FnMut(CommandEvent)) {
        if let Some(t) = self.out.finish() {
            push(CommandEvent::Stdout(t));
        }
        if let Some(t) = self.err.finish() {
            push(CommandEvent::Stderr(t));
        }
    }
}

/// Runs `argv` in the sandbox for a file operation (chmod, chown); a
/// non-zero exit is the caller's 400 with the command's message.
async fn run_helper(
    cp: &ControlPlane,
    cx: &OpContext,
    id: &str,
    argv: Vec<String>,
) -> Result<(), OsbError> {
    let what = argv.join(" ");
    let req = ExecRequest {
        cmd: Some(argv),
        timeout_s: Some(60.0),
        ..Default::default()
    };
    let res = cp.exec(cx, OnSandbox::new(id, req)).await?;
    if res.exit_code != 0 {
        return Err(OsbError::invalid(format!(
            "{what}: {}",
            res.stderr.trim().chars().take(500).collect::<String>()
        )));
    }
    Ok(())
}

/// Applies mode / owner / group to a path written or made.
async fn apply_permissions(
    cp: &ControlPlane,
    cx: &OpContext,
    id: &str,
    path: &str,
    mode: Option<u32>,
    owner: Option<&str>,
    group: Option<&str>,
) -> Result<(), OsbError> {
    if let Some(bits) = mode {
        run_helper(
            cp,
            cx,
            id,
            vec![
                "chmod".into(),
                format!("{bits:04o}"),
                "--".into(),
                path.into(),
            ],
        )
        .await?;
    }
    let spec = match (owner, group) {
        (Some(o), Some(g)) => Some(format!("{o}:{g}")),
        (Some(o), None) => Some(o.to_owned()),
        (None, Some(g)) => Some(format!(":{g}")),
        (None, None) => None,
    };
    if let Some(spec) = spec {
        run_helper(
            cp,
            cx,
            id,
            vec!["chown".into(), spec, "--".into(), path.into()],
        )
        .await?;
    }
    Ok(())
}

/// `POST /files/upload`: see `upload` for the part pairing.
pub(crate) async fn files_upload(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, OsbError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let boundary = multer::parse_boundary(content_type)
        .map_err(|_| OsbError::invalid("expected a multipart/form-data body with a boundary"))?;
    let max = st.settings.max_upload_bytes;
    let constraints = multer::Constraints::new()
        .allowed_fields(vec!["metadata", "file"])
        .size_limit(
            multer::SizeLimit::new()
                .whole_stream(max)
                .for_field("metadata", upload::MAX_METADATA_BYTES),
        );
    let mut parts =
        multer::Multipart::with_constraints(body.into_data_stream(), boundary, constraints);
    let mut pairing = Pairing::default();
    let (cp, cx, id) = (&st.cp, &caller.cx, caller.id.as_str());
    loop {
        let field = match parts.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return Err(multipart_error(e, max)),
        };
        match field.name() {
            Some("metadata") => {
                let bytes = field.bytes().await.map_err(|e| multipart_error(e, max))?;
                pairing.metadata(UploadMeta::parse(&bytes)?);
            }
            Some("file") => {
                let meta = pairing.file()?;
                if let Some(parent) = upload::parent_dir(&meta.path) {
                    cp.mkdir(cx, FileRequest::new(id, parent)).await?;
                }
                let too_large = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let flag = too_large.clone();
                let stream = field.map_err(move |e| {
                    if matches!(e, multer::Error::StreamSizeExceeded { .. }) {
                        flag.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    std::io::Error::other(e)
                });
                let reader = tokio_util::io::StreamReader::new(Box::pin(stream));
                let upload = FileUpload {
                    id: id.to_owned(),
                    path: meta.path.clone(),
                    body: reader,
                };
                let written = cp.write_file(cx, upload).await;
                if too_large.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(OpError::PayloadTooLarge(format!(
                        "upload larger than {max} bytes"
                    ))
                    .into());
                }
                written?;
                apply_permissions(
                    cp,
                    cx,
                    id,
                    &meta.path,
                    meta.mode,
                    meta.owner.as_deref(),
                    meta.group.as_deref(),
                )
                .await?;
            }
            // `allowed_fields` refuses any other name
            _ => return Err(OsbError::invalid("unexpected multipart part")),
        }
    }
    pairing.finish()?;
    Ok(StatusCode::OK)
}

fn multipart_error(e: multer::Error, max: u64) -> OsbError {
    match e {
        multer::Error::StreamSizeExceeded { .. } => {
            OpError::PayloadTooLarge(format!("upload larger than {max} bytes")).into()
        }
        multer::Error::FieldSizeExceeded { field_name, .. } => OsbError::invalid(format!(
            "the {} part is larger than {} bytes",
            field_name.unwrap_or_default(),
            upload::MAX_METADATA_BYTES
        )),
        multer::Error::UnknownField { field_name } => OsbError::invalid(format!(
            "unexpected part {:?} (expected metadata and file parts)",
            field_name.unwrap_or_default()
        )),
        other => OsbError::invalid(format!("malformed multipart body: {other}")),
    }
}

/// The `path` parameters of a query (several for info and removals).
fn paths(
    query: Option<&str>,
    allowed: &[&str],
) -> Result<(Vec<String>, BTreeMap<String, String>), OsbError> {
    let mut paths = Vec::new();
    let mut other = BTreeMap::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if k == "path" {
            upload::check_path(&v)?;
            paths.push(v.into_owned());
        } else if allowed.contains(&&*k) {
            other.insert(k.into_owned(), v.into_owned());
        } else {
            return Err(OsbError::invalid(format!("unknown query parameter {k:?}")));
        }
    }
    if paths.is_empty() {
        return Err(OsbError::invalid("the path query parameter is required"));
    }
    Ok((paths, other))
}

/// `GET /files/download?path=`: the file's bytes, streamed.
pub(crate) async fn files_download(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    RawQuery(query): RawQuery,
) -> Result<Response, OsbError> {
    let (paths, _) = paths(query.as_deref(), &[])?;
    let [path] =
        <[String; 1]>::try_from(paths).map_err(|_| OsbError::invalid("download takes one path"))?;
    let reader = st
        .cp
        .read_file(&caller.cx, FileRequest::new(&caller.id, path))
        .await?;
    let body = Body::from_stream(tokio_util::io::ReaderStream::new(reader));
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

/// A file as execd describes it (`mode` in octal digits, as uploads take it).
pub fn file_json(f: &FileInfo) -> Value {
    let modified = time::OffsetDateTime::from_unix_timestamp(f.modified_unix)
        .map(aviary_control::ops::rfc3339)
        .unwrap_or_default();
    json!({
        "path": f.path,
        "size": f.size,
        "modified_at": modified,
        // Aviary's stat has no birth time
        "created_at": modified,
        "owner": "",
        "group": "",
        "mode": upload::mode_digits(f.mode),
        "type": match f.kind.as_str() {
            "dir" => "directory",
            "file" => "file",
            "symlink" => "symlink",
            _ => "other",
        },
    })
}

/// `GET /files/info?path=…[&path=…]`: `{path: info}`.
pub(crate) async fn files_info(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, OsbError> {
    let (paths, _) = paths(query.as_deref(), &[])?;
    let mut out = serde_json::Map::new();
    for path in paths {
        let info = st
            .cp
            .stat(&caller.cx, FileRequest::new(&caller.id, &path))
            .await?;
        out.insert(path, file_json(&info));
    }
    Ok(Json(Value::Object(out)))
}

async fn remove(
    st: &OsbState,
    caller: &SandboxCaller,
    query: Option<&str>,
    recursive: bool,
) -> Result<StatusCode, OsbError> {
    let (paths, _) = paths(query, &[])?;
    for path in paths {
        let req = RemoveFileRequest {
            id: caller.id.clone(),
            path,
            recursive,
        };
        st.cp.remove(&caller.cx, req).await?;
    }
    Ok(StatusCode::OK)
}

/// `DELETE /files?path=…`: removes files.
pub(crate) async fn files_remove(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    RawQuery(query): RawQuery,
) -> Result<StatusCode, OsbError> {
    remove(&st, &caller, query.as_deref(), false).await
}

/// `DELETE /directories?path=…`: removes directories with their content.
pub(crate) async fn dirs_remove(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    RawQuery(query): RawQuery,
) -> Result<StatusCode, OsbError> {
    remove(&st, &caller, query.as_deref(), true).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Permission {
    #[serde(default)]
    mode: Option<u64>,
    #[serde(default)]
    owner: Option<String>,
    #[serde(default)]
    group: Option<String>,
}

/// `POST /directories` `{"/path": {"mode": 755, "owner": …, "group": …}}`.
pub(crate) async fn dirs_make(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    body: Bytes,
) -> Result<StatusCode, OsbError> {
    let dirs: BTreeMap<String, Permission> = json_body(&body)?;
    let mut checked = Vec::new();
    for (path, p) in dirs {
        upload::check_path(&path)?;
        let mode = p.mode.map(upload::parse_mode).transpose()?;
        for (what, name) in [("owner", &p.owner), ("group", &p.group)] {
            if let Some(n) = name {
                upload::check_account(what, n)?;
            }
        }
        checked.push((path, mode, p.owner, p.group));
    }
    for (path, mode, owner, group) in checked {
        st.cp
            .mkdir(&caller.cx, FileRequest::new(&caller.id, &path))
            .await?;
        apply_permissions(
            &st.cp,
            &caller.cx,
            &caller.id,
            &path,
            mode,
            owner.as_deref(),
            group.as_deref(),
        )
        .await?;
    }
    Ok(StatusCode::OK)
}

/// Whether `name` matches a glob of `*` (any run) and `?` (one character).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// `GET /files/search?path=DIR&pattern=GLOB`: the files below DIR whose
/// name matches (at most the recursive listing's cap are looked at).
pub(crate) async fn files_search(
    State(st): State<OsbState>,
    caller: SandboxCaller,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, OsbError> {
    let (paths, other) = paths(query.as_deref(), &["pattern"])?;
    let [dir] =
        <[String; 1]>::try_from(paths).map_err(|_| OsbError::invalid("search takes one path"))?;
    let pattern = other.get("pattern").map_or("*", String::as_str);
    let tree = st
        .cp
        .list_tree(&caller.cx, FileRequest::new(&caller.id, dir))
        .await?;
    let found: Vec<Value> = tree
        .entries
        .iter()
        .filter(|e| e.kind != "dir" && glob_match(pattern, &e.name))
        .map(file_json)
        .collect();
    Ok(Json(Value::Array(found)))
}

/// Any other execd route.
pub(crate) async fn not_supported() -> OsbError {
    OsbError::NotSupported(
        "this execd route is not served by Aviary (served: ping, command, files upload/download/\
         info/search/remove, directories make/remove)"
            .into(),
    )
}

/// Every route of the egress endpoint (18080).
pub(crate) async fn egress() -> OsbError {
    OsbError::NotSupported(
        "Aviary has no egress sidecar: a sandbox's network profile is chosen at create \
         (policy-approved) and cannot be changed through this endpoint"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*.txt", "a.txt"));
        assert!(glob_match("*", "anything"));
        assert!(glob_match("a?c", "abc"));
        assert!(glob_match("*b*", "abc"));
        assert!(!glob_match("*.txt", "a.txt.bak"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("", ""));
        assert!(!glob_match("", "a"));
    }

    #[test]
    fn run_command_bodies_are_checked() {
        let parse = |s: &str| json_body::<RunCommand>(s.as_bytes()).and_then(RunCommand::into_exec);
        let r =
            parse(r#"{"command":"echo hi","cwd":"/tmp","timeout":1500,"envs":{"A":"1"}}"#).unwrap();
        assert_eq!(r.shell.as_deref(), Some("echo hi"));
        assert_eq!(r.timeout_s, Some(1.5));
        assert_eq!(r.env.get("A").map(String::as_str), Some("1"));
        let r = parse(r#"{"argv":["ls","-l"]}"#).unwrap();
        assert_eq!(r.cmd.unwrap(), ["ls", "-l"]);
        for bad in [
            r#"{}"#,
            r#"{"command":""}"#,
            r#"{"command":"x","argv":["y"]}"#,
            r#"{"argv":[]}"#,
            r#"{"command":"x","background":true}"#,
            r#"{"command":"x","uid":1000}"#,
            r#"{"command":"x","cwd":"rel"}"#,
            r#"{"command":"x","bogus":1}"#,
            r#"{"command":1}"#,
            r#"[]"#,
        ] {
            assert_eq!(parse(bad).unwrap_err().status(), 400, "{bad}");
        }
    }

    #[test]
    fn file_json_reports_octal_digit_modes() {
        let f = FileInfo {
            name: "a".into(),
            path: "/tmp/a".into(),
            kind: "file".into(),
            size: 3,
            mode: 0o100755,
            modified_unix: 0,
        };
        let v = file_json(&f);
        assert_eq!(v["mode"], 755);
        assert_eq!(v["type"], "file");
        assert_eq!(v["modified_at"], "1970-01-01T00:00:00Z");
    }
}
