//! `aviary mcp`: a Model Context Protocol server that lets an agent (an LLM
//! host speaking MCP) plan, create and drive Aviary sandboxes through the v1
//! HTTP API, over stdio or streamable HTTP.
//!
//! Invariants:
//! - One [`Session`] per MCP session (the stdio connection, or one
//!   streamable-HTTP session id). It leases every sandbox it creates or
//!   forks (owner `mcp-<session>`), sends that lease's token on every call
//!   on the sandbox, renews the leases in the background, and releases them
//!   when the session closes. A sandbox another session leased answers this
//!   one `lease_required`: the token never leaves the session that holds it.
//! - Every failure of the API (policy denials among them) comes back as a
//!   tool error carrying the stable code and the server's reason, never as a
//!   protocol error, so the model sees why.
//! - Tool input is the model's (untrusted): sandbox ids are checked before
//!   they reach a URL, output is bounded before it reaches the model.
//!
//! Concurrency: the session's lease table is a mutex-guarded map; the
//! renewal task holds only a weak reference, so dropping the last handle of
//! a session ends its renewals and releases its leases.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use aviary_client::{Client, ClientError, StreamItem};
use aviary_core::api::{CreateSandboxRequest, ExecRequest};
use aviary_core::{ErrorCode, LeaseToken};
use base64::Engine;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, Implementation, ProgressNotificationParam, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{schemars, tool, tool_handler, tool_router, RoleServer, ServerHandler, ServiceExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Default lease lifetime of the session's sandboxes; renewed every third of it.
pub const DEFAULT_LEASE_TTL_S: u64 = 60;
/// Most bytes of stdout (and of stderr) a `run_command` result carries;
/// the whole output went out as progress notifications.
const MAX_OUTPUT_BYTES: usize = 64 * 1024;
/// Most bytes `read_file` returns.
const MAX_READ_BYTES: usize = 1024 * 1024;

/// Where the MCP server finds Aviary.
#[derive(Clone)]
pub struct McpConfig {
    pub url: String,
    pub api_key: String,
    /// Lifetime of the session's leases, seconds (renewed every third of it).
    pub lease_ttl_s: u64,
}

impl std::fmt::Debug for McpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpConfig")
            .field("url", &self.url)
            .field("api_key", &"<redacted>")
            .field("lease_ttl_s", &self.lease_ttl_s)
            .finish()
    }
}

/// The leases one MCP session holds.
struct Session {
    owner: String,
    lease_ttl_s: u64,
    client: Client,
    leases: Mutex<HashMap<String, LeaseToken>>,
}

impl Session {
    fn token(&self, id: &str) -> Option<LeaseToken> {
        self.leases.lock().ok()?.get(id).copied()
    }

    fn hold(&self, id: &str, token: LeaseToken) {
        if let Ok(mut l) = self.leases.lock() {
            l.insert(id.to_owned(), token);
        }
    }

    fn forget(&self, id: &str) {
        if let Ok(mut l) = self.leases.lock() {
            l.remove(id);
        }
    }

    fn held(&self) -> Vec<(String, LeaseToken)> {
        self.leases
            .lock()
            .map(|l| l.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default()
    }

    /// Gives back every lease (the session is over).
    async fn release_all(&self) {
        let held: Vec<(String, LeaseToken)> = match self.leases.lock() {
            Ok(mut l) => l.drain().collect(),
            Err(_) => return,
        };
        release(&self.client, held).await;
    }
}

async fn release(client: &Client, held: Vec<(String, LeaseToken)>) {
    for (id, token) in held {
        if let Err(e) = client.release_lease(&id, token).await {
            tracing::info!(sandbox.id = %id, error = %e, "lease not released at session end");
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let held: Vec<(String, LeaseToken)> = match self.leases.get_mut() {
            Ok(l) => l.drain().collect(),
            Err(_) => return,
        };
        if held.is_empty() {
            return;
        }
        // the session ended without `close` (an HTTP session dropped): the
        // leases are given back in the background
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            rt.spawn(async move { release(&client, held).await });
        }
    }
}

/// Renews the session's leases until the session is gone; a lease the
/// server no longer knows (destroyed, reset, expired) is dropped.
async fn renew_loop(session: Weak<Session>, lease_ttl_s: u64) {
    let every = Duration::from_millis((lease_ttl_s * 1000 / 3).max(500));
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = session.upgrade() else { return };
        for (id, token) in s.held() {
            match s.client.renew_lease(&id, token, Some(s.lease_ttl_s)).await {
                Ok(_) => {}
                Err(e) if e.code().is_some() => {
                    tracing::info!(sandbox.id = %id, error = %e, "lease lost");
                    s.forget(&id);
                }
                Err(e) => tracing::warn!(sandbox.id = %id, error = %e, "lease renewal failed"),
            }
        }
    }
}

/// The MCP server of one session: the tools, and the leases they hold.
#[derive(Clone)]
pub struct AviaryMcp {
    session: Arc<Session>,
    tool_router: ToolRouter<Self>,
}

impl AviaryMcp {
    /// A new session against the Aviary server of `cfg`; its lease
    /// renewals run on the current tokio runtime.
    pub fn new(cfg: &McpConfig) -> Self {
        let session = Arc::new(Session {
            owner: aviary_core::new_id("mcp"),
            lease_ttl_s: cfg.lease_ttl_s,
            client: Client::new(&cfg.url, &cfg.api_key),
            leases: Mutex::new(HashMap::new()),
        });
        tokio::spawn(renew_loop(Arc::downgrade(&session), cfg.lease_ttl_s));
        AviaryMcp {
            session,
            tool_router: Self::tool_router(),
        }
    }

    /// Releases every lease the session holds.
    pub async fn close(&self) {
        self.session.release_all().await;
    }

    fn client(&self) -> &Client {
        &self.session.client
    }

    /// Leases a sandbox this session created, so that it alone may change it.
    async fn take_lease(&self, id: &str) -> Result<LeaseToken, ClientError> {
        let lease = self
            .client()
            .acquire_lease(id, &self.session.owner, Some(self.session.lease_ttl_s))
            .await?;
        self.session.hold(id, lease.token);
        Ok(lease.token)
    }
}

/// The planner's input (DESIGN §7): what the work needs. Only `task` is required.
#[derive(Debug, Default, Clone, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskContext {
    /// What the agent is about to do, in plain words.
    pub task: String,
    /// The agent's plan, one step per entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Vec<String>>,
    /// Tools the work will call (e.g. `pytest`, `cargo`, `chromium`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    /// Programming languages involved (e.g. `python`, `rust`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub languages: Option<Vec<String>>,
    /// Packages to install (e.g. `numpy`, `torch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dependencies: Option<Vec<String>>,
    /// Size of the repository to work on, MB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo_size_mb: Option<f64>,
    /// Size of the data to process, MB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_size_mb: Option<f64>,
    /// Workspace space needed, MB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_mb: Option<f64>,
    /// How long the work should take, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_duration_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_browser: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_gpu: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_compile: Option<bool>,
    /// Network profile the work needs (`none`, or a configured profile such as `pypi-readonly`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// `low`, `medium` or `high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub risk: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateArgs {
    /// Template (root filesystem) name; the server's default when absent.
    #[serde(default)]
    pub template: Option<String>,
    /// Resource class (e.g. `python-small`, `build-medium`); when absent the
    /// planner picks one from `intent`, else the default class.
    #[serde(default)]
    pub resource_class: Option<String>,
    /// What the sandbox is for; the planner sizes the sandbox from it and
    /// the policy guard approves (ignored when `resource_class` is set).
    #[serde(default)]
    pub intent: Option<TaskContext>,
    /// Isolation scope: `session`, `user` (default), `agent` or `global`; a
    /// compatible idle sandbox of the same scope may be reused.
    #[serde(default)]
    pub scope: Option<String>,
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub user_id: Option<String>,
    #[serde(default)]
    pub agent: Option<String>,
    /// Network profile (`none` is the default: loopback only).
    #[serde(default)]
    pub network: Option<String>,
    /// Lifetime in seconds; the sandbox is destroyed after it.
    #[serde(default)]
    pub ttl_s: Option<u64>,
    /// Labels kept with the sandbox (filterable in `list_sandboxes`).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Default environment variables of every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxArgs {
    /// The sandbox id (`sbx-...`), as `create_sandbox` or `list_sandboxes` returned it.
    pub sandbox_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunArgs {
    /// The sandbox id (`sbx-...`).
    pub sandbox_id: String,
    /// The command, run with `/bin/sh -c` (pipes, redirections and `&&` work).
    pub command: String,
    /// Text written to the command's standard input.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Working directory (absolute); the sandbox's default when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds before the command's whole process group is killed.
    #[serde(default)]
    pub timeout_s: Option<f64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    /// The sandbox id (`sbx-...`).
    pub sandbox_id: String,
    /// Absolute path of the file inside the sandbox (e.g. `/workspace/main.py`).
    pub path: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The sandbox id (`sbx-...`).
    pub sandbox_id: String,
    /// Absolute path of the file inside the sandbox; missing parent directories are made.
    pub path: String,
    /// The whole new content of the file.
    pub content: String,
    /// `utf8` (default): `content` is the text; `base64`: `content` is base64 of the bytes.
    #[serde(default)]
    pub encoding: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The sandbox id (`sbx-...`).
    pub sandbox_id: String,
    /// Absolute path of a directory inside the sandbox.
    pub path: String,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// Only sandboxes whose labels have every one of these pairs.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Include terminated sandboxes.
    #[serde(default)]
    pub all: bool,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotArgs {
    /// The sandbox id (`sbx-...`).
    pub sandbox_id: String,
    /// `clean` marks the checkpoint a level-2 reset returns to (default `checkpoint`).
    #[serde(default)]
    pub label: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// The sandbox id (`sbx-...`) to fork.
    pub sandbox_id: String,
    /// Snapshot id to fork from; a fresh snapshot of the sandbox when absent.
    #[serde(default)]
    pub snapshot_id: Option<String>,
    /// Fork the running sandbox with its live processes (their memory,
    /// e.g. a REPL's variables) instead of its files: only sandboxes on the
    /// gVisor (`runsc`) runtime can; others answer `unsupported`. Takes no
    /// `snapshot_id`.
    #[serde(default)]
    pub live: bool,
}

/// A tool's answer: the JSON as text (what every model reads) and as
/// structured content.
fn ok(v: Value) -> CallToolResult {
    let text = serde_json::to_string_pretty(&v).unwrap_or_default();
    let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
    r.structured_content = Some(v);
    r
}

/// A tool error the model can act on: the stable code and the server's reason.
fn tool_error(code: &str, message: &str) -> CallToolResult {
    let v = json!({"error": {"code": code, "message": message}});
    let mut r = CallToolResult::error(vec![ContentBlock::text(format!("{code}: {message}"))]);
    r.structured_content = Some(v);
    r
}

fn api_error(e: &ClientError) -> CallToolResult {
    match e {
        ClientError::Api { code, message, .. } => tool_error(code.as_str(), message),
        other => tool_error("unavailable", &other.to_string()),
    }
}

/// Refuses an id that is not a plain sandbox id before it reaches a URL.
fn check_id(id: &str) -> Result<(), CallToolResult> {
    let plain = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if plain {
        Ok(())
    } else {
        Err(tool_error(
            ErrorCode::InvalidRequest.as_str(),
            "sandbox_id must be a sandbox id such as sbx-abc123 (letters, digits, - and _)",
        ))
    }
}

/// Cuts `s` to at most `max` bytes on a character boundary.
fn bounded(s: &str, max: usize) -> (String, bool) {
    if s.len() <= max {
        return (s.to_owned(), false);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (s[..end].to_owned(), true)
}

macro_rules! try_tool {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return Ok(api_error(&e)),
        }
    };
}

macro_rules! check_id {
    ($id:expr) => {
        if let Err(r) = check_id($id) {
            return Ok(r);
        }
    };
}

type ToolResult = Result<CallToolResult, rmcp::ErrorData>;

#[tool_router]
impl AviaryMcp {
    #[tool(
        description = "Ask Aviary's resource planner what sandbox a task needs, and whether policy approves it, without creating anything. Returns the recommended resource class, cpu, memory, runtime, template, network profile, TTL, confidence and the reason, plus the policy guard's verdict (approved, class, reasons, denial_code).",
        annotations(read_only_hint = true)
    )]
    async fn plan(&self, Parameters(ctx): Parameters<TaskContext>) -> ToolResult {
        let body = serde_json::to_value(&ctx).unwrap_or_default();
        Ok(ok(try_tool!(self.client().plan(&body).await)))
    }

    #[tool(
        description = "Create an isolated sandbox (or reuse a compatible idle one of the same scope) and lease it to this session: only this session can run commands or change files in it until it is released or destroyed. Give `intent` to let the planner size it, or `resource_class` to pick one. Returns the sandbox (id, state, resource_class, resources, template, expires_at, ...) and the control plane's decision with its reason. A policy denial is an error naming the reason."
    )]
    async fn create_sandbox(&self, Parameters(a): Parameters<CreateArgs>) -> ToolResult {
        let scope = match a.scope.as_deref() {
            None => None,
            Some(s) => match serde_json::from_value(Value::String(s.to_owned())) {
                Ok(s) => Some(s),
                Err(_) => {
                    return Ok(tool_error(
                        "invalid_request",
                        "scope must be one of session, user, agent, global",
                    ))
                }
            },
        };
        let req = CreateSandboxRequest {
            template: a.template,
            class: a.resource_class,
            user_id: a.user_id,
            session_id: a.session_id,
            agent: a.agent,
            scope,
            network: a.network,
            intent: a
                .intent
                .map(|i| serde_json::to_value(i).unwrap_or_default()),
            ttl_s: a.ttl_s,
            lease: Some(aviary_core::api::AcquireLeaseRequest {
                owner: self.session.owner.clone(),
                ttl_s: Some(self.session.lease_ttl_s),
            }),
            metadata: a.metadata,
            env: a.env,
            ..Default::default()
        };
        let created = try_tool!(self.client().create_sandbox(&req).await);
        if let Some(lease) = &created.lease {
            self.session
                .hold(&created.sandbox.id.to_string(), lease.token);
        }
        let mut v = serde_json::to_value(&created).unwrap_or_default();
        // the token stays in the session: the model never needs it
        if let Some(l) = v.get_mut("lease").and_then(Value::as_object_mut) {
            l.remove("token");
        }
        v["leased_by_this_session"] = json!(created.lease.is_some());
        Ok(ok(v))
    }

    #[tool(
        description = "Run a shell command (`/bin/sh -c`) in a sandbox and wait for it. Output is streamed as progress notifications while it runs (when the client asks for progress); the result has exit_code, stdout and stderr (each cut to 64 KiB, `truncated` says so), duration_ms, timed_out and oom_killed."
    )]
    async fn run_command(
        &self,
        Parameters(a): Parameters<RunArgs>,
        cx: RequestContext<RoleServer>,
    ) -> ToolResult {
        check_id!(&a.sandbox_id);
        let req = ExecRequest {
            shell: Some(a.command),
            stdin: a.stdin,
            cwd: a.cwd,
            env: a.env,
            timeout_s: a.timeout_s,
            token: self.session.token(&a.sandbox_id),
            ..Default::default()
        };
        let progress = cx.meta.get_progress_token();
        let mut stream = try_tool!(self.client().exec_stream(&a.sandbox_id, &req).await);
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut step = 0u32;
        let result = loop {
            let item = try_tool!(stream.next().await);
            let (chunk, stream_name) = match item {
                Some(StreamItem::Stdout(d)) => {
                    out.extend_from_slice(&d);
                    (d, "stdout")
                }
                Some(StreamItem::Stderr(d)) => {
                    err.extend_from_slice(&d);
                    (d, "stderr")
                }
                Some(StreamItem::Exit(r)) => break r,
                None => {
                    return Ok(tool_error(
                        "unavailable",
                        "the command's output stream ended before it exited",
                    ))
                }
            };
            if let Some(token) = &progress {
                step += 1;
                let text = String::from_utf8_lossy(&chunk);
                let (text, _) = bounded(&text, MAX_OUTPUT_BYTES);
                let note = ProgressNotificationParam::new(token.clone(), f64::from(step))
                    .with_message(format!("[{stream_name}] {text}"));
                // a client that went away does not stop the command's result
                let _ = cx.peer.notify_progress(note).await;
            }
        };
        let (stdout, cut_out) = bounded(&String::from_utf8_lossy(&out), MAX_OUTPUT_BYTES);
        let (stderr, cut_err) = bounded(&String::from_utf8_lossy(&err), MAX_OUTPUT_BYTES);
        Ok(ok(json!({
            "exit_code": result.exit_code,
            "stdout": stdout,
            "stderr": stderr,
            "truncated": cut_out || cut_err,
            "duration_ms": result.duration_ms,
            "timed_out": result.timed_out,
            "oom_killed": result.oom_killed,
        })))
    }

    #[tool(
        description = "Read a file from a sandbox. Returns `content` (the text, or base64 when `encoding` is `base64` because the file is not UTF-8), `size` and whether it was cut to 1 MiB.",
        annotations(read_only_hint = true)
    )]
    async fn read_file(&self, Parameters(a): Parameters<ReadArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        let data = try_tool!(self.client().read_file(&a.sandbox_id, &a.path).await);
        let size = data.len();
        let cut = size > MAX_READ_BYTES;
        let data = &data[..size.min(MAX_READ_BYTES)];
        let (content, encoding) = match std::str::from_utf8(data) {
            Ok(s) => (s.to_owned(), "utf8"),
            Err(_) => (
                base64::engine::general_purpose::STANDARD.encode(data),
                "base64",
            ),
        };
        Ok(ok(json!({
            "path": a.path,
            "size": size,
            "truncated": cut,
            "encoding": encoding,
            "content": content,
        })))
    }

    #[tool(
        description = "Write (create or replace) a whole file in a sandbox; missing parent directories are made. Returns the number of bytes written."
    )]
    async fn write_file(&self, Parameters(a): Parameters<WriteArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        let data = match a.encoding.as_deref() {
            None | Some("utf8") | Some("utf-8") => a.content.into_bytes(),
            Some("base64") => match base64::engine::general_purpose::STANDARD.decode(&a.content) {
                Ok(d) => d,
                Err(e) => return Ok(tool_error("invalid_request", &format!("bad base64: {e}"))),
            },
            Some(other) => {
                return Ok(tool_error(
                    "invalid_request",
                    &format!("encoding {other:?} is not utf8 or base64"),
                ))
            }
        };
        let token = self.session.token(&a.sandbox_id);
        let client = self.client();
        let mut written = client
            .write_file(&a.sandbox_id, &a.path, data.clone(), token)
            .await;
        if matches!(&written, Err(e) if e.code() == Some(ErrorCode::NotFound)) {
            if let Some((parent, _)) = a.path.rsplit_once('/').filter(|(p, _)| !p.is_empty()) {
                try_tool!(client.mkdir(&a.sandbox_id, parent, token).await);
                written = client.write_file(&a.sandbox_id, &a.path, data, token).await;
            }
        }
        Ok(ok(json!({"path": a.path, "bytes": try_tool!(written)})))
    }

    #[tool(
        description = "List a directory of a sandbox: name, path, kind (file, dir, symlink, other), size, mode and modification time of each entry.",
        annotations(read_only_hint = true)
    )]
    async fn list_files(&self, Parameters(a): Parameters<ListFilesArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        let list = try_tool!(self.client().list_files(&a.sandbox_id, &a.path).await);
        Ok(ok(serde_json::to_value(&list).unwrap_or_default()))
    }

    #[tool(
        description = "List the sandboxes this API key can see (optionally only those whose labels match `metadata`), with `leased_by_this_session` on each.",
        annotations(read_only_hint = true)
    )]
    async fn list_sandboxes(&self, Parameters(a): Parameters<ListArgs>) -> ToolResult {
        let list = try_tool!(
            self.client()
                .list_sandboxes_with(&aviary_client::SandboxFilter {
                    all: a.all,
                    metadata: a.metadata.clone(),
                    ..Default::default()
                })
                .await
        );
        let held = self.session.held();
        let items: Vec<Value> = list
            .sandboxes
            .iter()
            .map(|s| {
                let mut v = serde_json::to_value(s).unwrap_or_default();
                let id = s.id.to_string();
                v["leased_by_this_session"] = json!(held.iter().any(|(h, _)| *h == id));
                v
            })
            .collect();
        Ok(ok(json!({ "sandboxes": items })))
    }

    #[tool(
        description = "Checkpoint a sandbox: its /workspace and everything else it changed, stored as content-addressed chunks (unchanged chunks are not stored again). Returns the snapshot (id, parent, sizes, label); fork from it later."
    )]
    async fn snapshot(&self, Parameters(a): Parameters<SnapshotArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        let token = self.session.token(&a.sandbox_id);
        let label = a.label.as_deref().unwrap_or("checkpoint");
        Ok(ok(try_tool!(
            self.client()
                .snapshot_labelled(&a.sandbox_id, label, token)
                .await
        )))
    }

    #[tool(
        description = "Fork a sandbox: a new sandbox starting from a snapshot of it (a fresh snapshot when `snapshot_id` is absent), leased to this session. Use it to try something risky on a copy. With `live: true` (gVisor sandboxes only) the copy also runs the sandbox's live processes. Returns the new sandbox and the decision."
    )]
    async fn fork(&self, Parameters(a): Parameters<ForkArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        if a.live && a.snapshot_id.is_some() {
            return Ok(tool_error(
                ErrorCode::InvalidRequest.as_str(),
                "a live fork forks the running sandbox: give no snapshot_id with live",
            ));
        }
        let token = self.session.token(&a.sandbox_id);
        let forked = if a.live {
            try_tool!(self.client().fork_live(&a.sandbox_id, token).await)
        } else {
            try_tool!(
                self.client()
                    .fork(&a.sandbox_id, a.snapshot_id.as_deref(), token)
                    .await
            )
        };
        let id = forked.sandbox.id.to_string();
        let leased = self.take_lease(&id).await;
        let mut v = serde_json::to_value(&forked).unwrap_or_default();
        v["leased_by_this_session"] = json!(leased.is_ok());
        if let Err(e) = leased {
            v["lease_error"] = json!(e.to_string());
        }
        Ok(ok(v))
    }

    #[tool(
        description = "End this session's use of a sandbox: its lease is released and it goes back to Idle, to be reused by a compatible request of its scope. It keeps running until its TTL; use destroy_sandbox to end it now."
    )]
    async fn release_sandbox(&self, Parameters(a): Parameters<SandboxArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        let token = self.session.token(&a.sandbox_id);
        let s = try_tool!(
            self.client()
                .sandbox_action(&a.sandbox_id, "release", token)
                .await
        );
        self.session.forget(&a.sandbox_id);
        Ok(ok(serde_json::to_value(&s).unwrap_or_default()))
    }

    #[tool(
        description = "Destroy a sandbox now: its processes are killed and its files and network identity removed.",
        annotations(destructive_hint = true)
    )]
    async fn destroy_sandbox(&self, Parameters(a): Parameters<SandboxArgs>) -> ToolResult {
        check_id!(&a.sandbox_id);
        let token = self.session.token(&a.sandbox_id);
        let s = try_tool!(self.client().delete_sandbox(&a.sandbox_id, token).await);
        self.session.forget(&a.sandbox_id);
        Ok(ok(serde_json::to_value(&s).unwrap_or_default()))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for AviaryMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("aviary", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Aviary runs untrusted commands in isolated sandboxes. Typical flow: plan (optional) -> \
                 create_sandbox -> write_file / run_command / read_file -> snapshot / fork to branch -> \
                 release_sandbox or destroy_sandbox. Sandboxes this session creates are leased to it; \
                 errors carry a stable code (e.g. lease_required, forbidden for policy denials) and the reason.",
            )
    }
}

/// Serves one MCP session on stdin/stdout until the client closes it, then
/// releases the session's leases.
pub async fn serve_stdio(cfg: McpConfig) -> anyhow::Result<()> {
    let server = AviaryMcp::new(&cfg);
    let running = server.clone().serve(rmcp::transport::stdio()).await?;
    let outcome = running.waiting().await;
    server.close().await;
    outcome?;
    Ok(())
}

/// Serves streamable HTTP at `http://ADDR/mcp` (one session, and one lease
/// table, per MCP session id) until ctrl-c or SIGTERM; `on_ready` gets the
/// bound address.
///
/// The endpoint has no authentication of its own: whoever reaches it acts
/// with the configured API key. So only a loopback address is served, and
/// only loopback `Host` names are accepted (DNS rebinding).
pub async fn serve_http(
    cfg: McpConfig,
    addr: SocketAddr,
    on_ready: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    if !addr.ip().is_loopback() {
        anyhow::bail!(
            "--http {addr}: the MCP endpoint acts with your API key and has no authentication \
             of its own, so it serves loopback addresses only (127.0.0.1:PORT or [::1]:PORT)"
        );
    }
    use rmcp::transport::streamable_http_server::{
        session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
    };
    let ct = tokio_util::sync::CancellationToken::new();
    let factory_cfg = cfg.clone();
    let service: StreamableHttpService<AviaryMcp, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(AviaryMcp::new(&factory_cfg)),
        Default::default(),
        StreamableHttpServerConfig::default().with_cancellation_token(ct.child_token()),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    on_ready(listener.local_addr()?);
    let stop = ct.clone();
    axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            stop.cancel();
        })
        .await?;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_that_could_reach_another_route_are_refused() {
        for bad in [
            "",
            "../../v1/keys",
            "sbx-a/exec",
            "sbx a",
            "sbx-a?x=1",
            "sbx-%2e%2e",
            &"a".repeat(65),
        ] {
            let refused = check_id(bad).unwrap_err();
            assert_eq!(refused.is_error, Some(true), "{bad:?}");
        }
        check_id("sbx-litpnpvuywco62ujs4hf").unwrap();
    }

    #[test]
    fn output_is_cut_on_a_character_boundary() {
        let s = "aé".repeat(10); // 'é' is two bytes
                                 // byte 5 falls inside the second 'é': the cut steps back before it
        assert_eq!(bounded(&s, 5), ("aéa".to_owned(), true));
        assert_eq!(bounded(&s, 4), ("aéa".to_owned(), true));
        assert_eq!(bounded("short", 64), ("short".to_owned(), false));
    }

    #[test]
    fn the_task_context_sends_only_what_was_given() {
        let ctx: TaskContext =
            serde_json::from_value(json!({"task": "t", "languages": ["rust"]})).unwrap();
        assert_eq!(
            serde_json::to_value(&ctx).unwrap(),
            json!({"task": "t", "languages": ["rust"]})
        );
        serde_json::from_value::<TaskContext>(json!({"task": "t", "gpu": true})).unwrap_err();
    }

    #[test]
    fn api_errors_keep_their_code_and_reason() {
        let e = ClientError::Api {
            status: 403,
            code: ErrorCode::Forbidden,
            message: "policy denied the sandbox: no GPU [gpu_not_available]".into(),
        };
        let r = api_error(&e);
        assert_eq!(r.is_error, Some(true));
        let v = r.structured_content.unwrap();
        assert_eq!(v["error"]["code"], "forbidden");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gpu_not_available"));
    }
}
