//! Runtime adapters for remote sandbox providers: Aviary's planner, policy,
//! leases and registry in front of sandboxes that another service runs:
//! an E2B-compatible one (runtime `e2b`, [`e2b`]: E2B's cloud, or another
//! Aviary's `/e2b` surface) or an OpenSandbox-compatible one (runtime
//! `opensandbox`, [`opensandbox`]: an OpenSandbox server, or another
//! Aviary's `/opensandbox` surface).
//!
//! One [`RemoteRuntime`] holds everything the two share (records, the
//! relay, how envd is started, usage, the owner tag); a [`Provider`] is one
//! service's wire protocol, and nothing else.
//!
//! **How a sandbox comes up.** [`RemoteRuntime::create`] asks the service
//! for a sandbox of the template the class's template is mapped to
//! (metadata `aviary_sandbox` = the Aviary id and `aviary_owner` = this
//! runtime's own tag), uploads Aviary's static envd (the file the spec
//! binds at its init path) and a fresh random bridge secret through the
//! service's file API, and starts envd through its command API as a daemon
//! in the sandbox: `--socket` in a private dir, `--bridge
//! 127.0.0.1:`[`relay::BRIDGE_PORT`] with the secret (read and removed by
//! envd), `--daemon` (it returns once both listen).
//!
//! **How the host reaches envd.** The sandbox has no host-only socket, so the
//! runtime serves one: `<state>/<id>/control/envd.sock`, listened on by this
//! process ([`relay`]); every connection is carried by the service to the
//! bridge port (E2B: its port proxy `{port}-{id}.{domain}`; OpenSandbox: the
//! port's endpoint with its headers), an HTTP/1.1 upgrade with the secret,
//! and envd's bridge splices it to envd's socket. The control plane uses it
//! like a local sandbox's socket ([`aviary_runtime::EnvdEndpoint`]: the peer
//! it checks is this process). A port was chosen over the command API as
//! the byte stream because one upgrade is one connection, binary and full
//! duplex, while a command stream is text events with no input.
//!
//! **Fencing.** Every envd call still carries the lease token and envd
//! checks it against its fence; only the bridge's connections may move the
//! fence. The control plane checks the lease store and the registry before
//! it calls envd at all, and only it holds the service key, the access
//! token and the bridge secret (kept in `<state>/<id>/remote.json`, 0600).
//! Unlike a local sandbox, envd is not PID 1 of a namespace the host
//! controls: root in the remote sandbox can end it (the sandbox then turns
//! `lost`), so envd's own check is a second line, not the first.
//!
//! What it does not do: network profiles other than `none`, bind mounts,
//! host workspaces and snapshots (no [`aviary_runtime::Snapshottable`]).
//! Resource limits are the provider's: E2B's template decides them,
//! OpenSandbox is asked for the spec's CPU and memory. Pause and resume are
//! the provider's ([`Pausable`], when the provider has them).
//!
//! Concurrency: callers serialise operations on one sandbox; the relay
//! table is one mutex, never held across an await.
#![forbid(unsafe_code)]

pub mod e2b;
pub mod http;
pub mod opensandbox;
pub mod relay;

use async_trait::async_trait;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
use aviary_envd_proto::EnvdClient;
use aviary_runtime::{
    EnvdEndpoint, Pausable, ResourceUsage, Runtime, RuntimeError, RuntimeStatus, SandboxHandle,
    SandboxSpec, ENVD_SOCKET_NAME,
};
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Where envd and its socket live in a remote sandbox.
pub const REMOTE_DIR: &str = "/tmp/.aviary-envd";
/// Metadata key naming the Aviary sandbox id on the remote sandbox.
pub const META_SANDBOX: &str = "aviary_sandbox";
/// Metadata key naming the runtime that owns a remote sandbox.
pub const META_OWNER: &str = "aviary_owner";
/// Longest envd's start may take in the remote sandbox.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Failures talking to the provider (mapped into [`RuntimeError`] at the
/// trait's edge).
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("set up the provider client: {0}")]
    Setup(String),
    #[error("{action}: the provider is unreachable: {detail}")]
    Unreachable { action: String, detail: String },
    #[error("{action}: the provider refused the API key ({status})")]
    Unauthorized { action: String, status: u16 },
    #[error("{action}: not found at the provider: {message}")]
    NotFound { action: String, message: String },
    #[error("{action}: the provider failed ({status}): {message}")]
    Failed {
        action: String,
        status: u16,
        message: String,
    },
    #[error("{action}: refused: {message}")]
    Refused {
        action: String,
        status: u16,
        message: String,
    },
    #[error("{action}: unexpected answer: {detail}")]
    Protocol { action: String, detail: String },
}

impl RemoteError {
    /// The error for an HTTP answer `status` with `body` (E2B's
    /// `{code,message}`, or text).
    pub fn from_status(action: &str, status: u16, body: &[u8]) -> RemoteError {
        let message = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
        let message = http::clean(&message);
        let action = action.to_owned();
        match status {
            401 | 403 => RemoteError::Unauthorized { action, status },
            404 => RemoteError::NotFound { action, message },
            429 | 500..=599 => RemoteError::Failed {
                action,
                status,
                message,
            },
            _ => RemoteError::Refused {
                action,
                status,
                message: format!("HTTP {status}: {message}"),
            },
        }
    }

    fn into_runtime(self, runtime: &str) -> RuntimeError {
        match self {
            // the service is down, overloaded or misconfigured: 503
            e @ (RemoteError::Setup(_)
            | RemoteError::Unreachable { .. }
            | RemoteError::Unauthorized { .. }
            | RemoteError::Failed { .. }) => RuntimeError::ProbeRuntime {
                reason: format!("{runtime}: {e}"),
            },
            e => RuntimeError::InvokeRuntime {
                action: runtime.to_owned(),
                detail: e.to_string(),
            },
        }
    }
}

/// What the service says about one sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteState {
    Running,
    Paused,
    /// It exists but no longer runs (failed).
    Stopped,
}

/// How a setup command ended.
#[derive(Debug, Default)]
pub struct RunOutput {
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// What a create asks of the provider.
#[derive(Debug)]
pub struct CreateRemote<'a> {
    /// The provider's template (E2B) or image (OpenSandbox).
    pub template: &'a str,
    /// The lifetime asked of the provider.
    pub timeout_s: u64,
    /// `aviary_sandbox` and `aviary_owner`.
    pub metadata: &'a BTreeMap<String, String>,
    /// The spec's limits (a provider that sizes by template ignores them).
    pub resources: &'a ResourceLimits,
}

/// One provider's wire protocol: everything [`RemoteRuntime`] asks of a
/// remote service. Every call is bounded in time and in what it reads, and
/// checks what the service answers (it is not trusted blindly).
#[async_trait]
pub trait Provider: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// What reaching one of its sandboxes needs (kept in the sandbox's
    /// record, 0600: it may hold tokens).
    type Sandbox: Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static;

    /// The provider's id of the sandbox (checked by [`http::check_remote_id`]).
    fn remote_id(sandbox: &Self::Sandbox) -> &str;

    /// A new sandbox, running once this returns (or none left behind).
    async fn create(&self, req: &CreateRemote<'_>) -> Result<Self::Sandbox, RemoteError>;
    /// Its state; `None` when the service has no such (live) sandbox.
    async fn state(&self, remote_id: &str) -> Result<Option<RemoteState>, RemoteError>;
    /// Ends it; an unknown one is fine.
    async fn kill(&self, remote_id: &str) -> Result<(), RemoteError>;
    /// Freezes it, memory and files kept; paused when this returns.
    async fn pause(&self, sandbox: &Self::Sandbox) -> Result<(), RemoteError>;
    /// Thaws it (its lifetime renewed to `timeout_s`); running when this returns.
    async fn resume(&self, sandbox: &Self::Sandbox, timeout_s: u64) -> Result<(), RemoteError>;
    /// Every live sandbox whose metadata has `key=value`: id and metadata.
    async fn list(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<(String, BTreeMap<String, String>)>, RemoteError>;
    /// Writes `data` at `path` in the sandbox (parents made), with `mode`
    /// where the file API takes one.
    async fn upload(
        &self,
        sandbox: &Self::Sandbox,
        path: &str,
        data: Vec<u8>,
        mode: u32,
    ) -> Result<(), RemoteError>;
    /// Runs `/bin/sh -c script` in the sandbox and waits for its end.
    async fn run(
        &self,
        sandbox: &Self::Sandbox,
        script: &str,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<RunOutput, RemoteError>;
    /// One upgraded connection to envd's bridge in the sandbox
    /// ([`relay::BRIDGE_PORT`], protocol [`relay::PROTOCOL`], the secret in
    /// [`relay::SECRET_HEADER`]).
    async fn open_bridge(
        &self,
        sandbox: &Self::Sandbox,
        secret: &str,
    ) -> Result<reqwest::Upgraded, RemoteError>;
}

/// One remote runtime's settings (the provider's own are its client's).
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// The runtime's name (`e2b`, `opensandbox`): what classes list and
    /// records keep.
    pub name: String,
    /// Host-only state: per sandbox its record and envd socket.
    pub state_dir: PathBuf,
    /// Aviary template (its digest, or its name) → the provider's template
    /// (E2B) or image (OpenSandbox). A template with no entry is refused.
    pub templates: BTreeMap<String, String>,
    /// The lifetime asked of the provider for each sandbox (Aviary's own
    /// TTL ends it earlier; the provider's ends it at the latest).
    pub timeout_s: u64,
}

/// What the runtime keeps per sandbox (`remote.json`, 0600).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(bound = "")]
struct Record<P: Provider> {
    sandbox: P::Sandbox,
    secret: String,
}

/// A runtime whose sandboxes a remote service runs, through provider `P`.
pub struct RemoteRuntime<P: Provider> {
    cfg: RemoteConfig,
    client: P,
    /// `aviary_owner` of this runtime's sandboxes (`<state>/owner`).
    owner: String,
    relays: Mutex<HashMap<SandboxId, relay::Relay>>,
}

/// Runtime `e2b`.
pub type E2bRuntime = RemoteRuntime<e2b::E2bClient>;
/// Runtime `opensandbox`.
pub type OpenSandboxRuntime = RemoteRuntime<opensandbox::OsbClient>;

impl<P: Provider> std::fmt::Debug for RemoteRuntime<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteRuntime")
            .field("cfg", &self.cfg)
            .field("client", &self.client)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::WriteFile {
        path: path.to_path_buf(),
        source,
    }
}

impl E2bRuntime {
    /// Runtime `e2b` on the service at `endpoint`.
    pub fn e2b(cfg: RemoteConfig, endpoint: e2b::E2bEndpoint) -> Result<Self, RuntimeError> {
        let client = e2b::E2bClient::new(endpoint).map_err(|e| e.into_runtime(&cfg.name))?;
        RemoteRuntime::new(cfg, client)
    }
}

impl OpenSandboxRuntime {
    /// Runtime `opensandbox` on the service at `endpoint`.
    pub fn opensandbox(
        cfg: RemoteConfig,
        endpoint: opensandbox::OsbEndpoint,
    ) -> Result<Self, RuntimeError> {
        let client =
            opensandbox::OsbClient::new(endpoint).map_err(|e| e.into_runtime(&cfg.name))?;
        RemoteRuntime::new(cfg, client)
    }
}

impl<P: Provider> RemoteRuntime<P> {
    /// Opens the state dir (made 0700 if missing) and its owner tag.
    pub fn new(cfg: RemoteConfig, client: P) -> Result<RemoteRuntime<P>, RuntimeError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&cfg.state_dir)
            .map_err(|source| RuntimeError::CreateDir {
                path: cfg.state_dir.clone(),
                source,
            })?;
        let owner_file = cfg.state_dir.join("owner");
        let owner = match std::fs::read_to_string(&owner_file) {
            Ok(s) if is_tag(s.trim()) => s.trim().to_owned(),
            _ => {
                let tag = format!("aviary-{}", hex::encode(rand::random::<[u8; 8]>()));
                std::fs::write(&owner_file, &tag).map_err(io_err(&owner_file))?;
                tag
            }
        };
        Ok(RemoteRuntime {
            cfg,
            client,
            owner,
            relays: Mutex::new(HashMap::new()),
        })
    }

    /// The tag this runtime's sandboxes carry as `aviary_owner`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The provider's id of sandbox `id`, if this runtime has it.
    pub fn remote_id(&self, id: &SandboxId) -> Option<String> {
        self.record(id)
            .ok()
            .flatten()
            .map(|r| P::remote_id(&r.sandbox).to_owned())
    }

    fn remote(&self, e: RemoteError) -> RuntimeError {
        e.into_runtime(&self.cfg.name)
    }

    fn dir(&self, id: &SandboxId) -> PathBuf {
        self.cfg.state_dir.join(id.as_str())
    }

    fn control_dir(&self, id: &SandboxId) -> PathBuf {
        self.dir(id).join("control")
    }

    fn record(&self, id: &SandboxId) -> Result<Option<Record<P>>, RuntimeError> {
        let path = self.dir(id).join("remote.json");
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| RuntimeError::ParseState {
                    detail: format!("{}: {e}", path.display()),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(RuntimeError::ReadFile { path, source }),
        }
    }

    fn write_record(&self, id: &SandboxId, rec: &Record<P>) -> Result<(), RuntimeError> {
        let path = self.dir(id).join("remote.json");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(&path))?;
        let body = serde_json::to_vec(rec).map_err(|e| RuntimeError::BuildConfig {
            source: Box::new(e),
        })?;
        std::io::Write::write_all(&mut f, &body).map_err(io_err(&path))
    }

    /// The provider's template for `spec`: by digest, else by name.
    fn remote_template(&self, spec: &SandboxSpec) -> Result<&str, RuntimeError> {
        self.cfg
            .templates
            .get(&spec.template.digest)
            .or_else(|| self.cfg.templates.get(&spec.template.name))
            .map(String::as_str)
            .ok_or_else(|| RuntimeError::Unsupported {
                what: format!(
                    "template {:?} ({}) on runtime {} (no provider template is mapped to it)",
                    spec.template.name, spec.template.digest, self.cfg.name
                ),
            })
    }

    /// The host file the spec binds at its init path: envd, uploaded.
    fn init_binary<'a>(&self, spec: &'a SandboxSpec) -> Result<&'a Path, RuntimeError> {
        let init = &spec.init[0];
        let mut found = None;
        for b in &spec.binds {
            if &b.sandbox == init && b.host.is_file() {
                found = Some(b.host.as_path());
            } else {
                return Err(RuntimeError::Unsupported {
                    what: format!(
                        "bind mount {:?} into a sandbox of runtime {}",
                        b.sandbox, self.cfg.name
                    ),
                });
            }
        }
        found.ok_or_else(|| RuntimeError::InvalidSpec {
            reason: format!(
                "init {init:?} is not a file bound from the host (runtime {} uploads its init)",
                self.cfg.name
            ),
        })
    }

    /// Starts (or keeps) the relay of `id`; its socket.
    fn ensure_relay(&self, id: &SandboxId, rec: Record<P>) -> Result<PathBuf, RuntimeError> {
        let socket = self.control_dir(id).join(ENVD_SOCKET_NAME);
        let mut relays = self.relays.lock().expect("relay table poisoned");
        if !relays.contains_key(id) {
            let r = relay::start(
                &socket,
                relay::Target {
                    provider: self.client.clone(),
                    sandbox: rec.sandbox,
                    secret: rec.secret,
                },
            )
            .map_err(io_err(&socket))?;
            relays.insert(id.clone(), r);
        }
        Ok(socket)
    }

    fn stop_relay(&self, id: &SandboxId) {
        self.relays.lock().expect("relay table poisoned").remove(id);
    }

    async fn start_remote(
        &self,
        spec: &SandboxSpec,
        envd: &Path,
        sandbox: &P::Sandbox,
        secret: &str,
    ) -> Result<(), RuntimeError> {
        let binary = tokio::fs::read(envd)
            .await
            .map_err(|source| RuntimeError::ReadFile {
                path: envd.to_path_buf(),
                source,
            })?;
        let upload = |path: String, data: Vec<u8>, mode: u32| async move {
            self.client
                .upload(sandbox, &path, data, mode)
                .await
                .map_err(|e| self.remote(e))
        };
        upload(format!("{REMOTE_DIR}/envd"), binary, 0o755).await?;
        upload(
            format!("{REMOTE_DIR}/secret"),
            format!("{secret}\n").into_bytes(),
            0o600,
        )
        .await?;
        let env: BTreeMap<String, String> = spec
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let d = REMOTE_DIR;
        let script = format!(
            "chmod 0700 {d} && chmod 0755 {d}/envd && {{ mkdir -p /workspace 2>/dev/null || true; }} && \
             exec {d}/envd --socket {d}/envd.sock --bridge 127.0.0.1:{port} --bridge-secret-file {d}/secret --daemon",
            port = relay::BRIDGE_PORT
        );
        let out = self
            .client
            .run(sandbox, &script, &env, START_TIMEOUT)
            .await
            .map_err(|e| self.remote(e))?;
        if out.exit_code != 0 {
            return Err(RuntimeError::InvokeRuntime {
                action: format!("{}: start envd in the remote sandbox", self.cfg.name),
                detail: format!(
                    "exit {}: {}",
                    out.exit_code,
                    http::clean(&String::from_utf8_lossy(&out.stderr))
                ),
            });
        }
        Ok(())
    }

    /// Kills every remote sandbox of this owner named `id` (a create that
    /// failed before its record was written leaves one).
    async fn kill_by_metadata(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let found = self
            .client
            .list(META_SANDBOX, id.as_str())
            .await
            .map_err(|e| self.remote(e))?;
        for (remote_id, meta) in found {
            if meta.get(META_OWNER).map(String::as_str) == Some(self.owner.as_str()) {
                self.client
                    .kill(&remote_id)
                    .await
                    .map_err(|e| self.remote(e))?;
            }
        }
        Ok(())
    }

    fn remove_dir(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let dir = self.dir(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RuntimeError::RemoveDir { path: dir, source }),
        }
    }

    /// Reads `paths` in turn through envd (the first readable one), as a
    /// number; `None` when none is.
    async fn read_counter(envd: &EnvdClient, paths: &[&str], field: Option<&str>) -> Option<u64> {
        for p in paths {
            let Ok(mut f) = envd.read_file(p, None).await else {
                continue;
            };
            let mut text = String::new();
            if (&mut f)
                .take(16 * 1024)
                .read_to_string(&mut text)
                .await
                .is_err()
            {
                continue;
            }
            let value = match field {
                None => text.trim().parse().ok(),
                Some(name) => text.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == name).then(|| v.trim().parse().ok()).flatten()
                }),
            };
            if value.is_some() {
                return value;
            }
        }
        None
    }
}

fn is_tag(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[async_trait]
impl<P: Provider> Runtime for RemoteRuntime<P> {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        aviary_runtime::validate_spec(spec)?;
        if spec.network != NetworkProfile::None {
            return Err(RuntimeError::Unsupported {
                what: format!(
                    "network profile {:?} on runtime {}",
                    spec.network.as_str(),
                    self.cfg.name
                ),
            });
        }
        let template = self.remote_template(spec)?.to_owned();
        let envd = self.init_binary(spec)?.to_path_buf();
        let id = &spec.id;
        let dir = self.dir(id);
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(RuntimeError::AlreadyExists { id: id.clone() })
            }
            Err(source) => return Err(RuntimeError::CreateDir { path: dir, source }),
        }
        let metadata = BTreeMap::from([
            (META_SANDBOX.to_owned(), id.to_string()),
            (META_OWNER.to_owned(), self.owner.clone()),
        ]);
        let req = CreateRemote {
            template: &template,
            timeout_s: self.cfg.timeout_s,
            metadata: &metadata,
            resources: &spec.resources,
        };
        let sandbox = match self.client.create(&req).await {
            Ok(s) => s,
            Err(e) => {
                let e = match e {
                    RemoteError::NotFound { message, .. } => RuntimeError::InvalidSpec {
                        reason: format!(
                            "runtime {}: the provider has no template {template:?}: {message}",
                            self.cfg.name
                        ),
                    },
                    e => self.remote(e),
                };
                return Err(e.with_cleanup(self.remove_dir(id)));
            }
        };
        let secret = hex::encode(rand::random::<[u8; 32]>());
        let rec = Record {
            sandbox: sandbox.clone(),
            secret: secret.clone(),
        };
        let started = async {
            self.write_record(id, &rec)?;
            let control = self.control_dir(id);
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&control)
                .map_err(|source| RuntimeError::CreateDir {
                    path: control.clone(),
                    source,
                })?;
            self.start_remote(spec, &envd, &sandbox, &secret).await?;
            self.ensure_relay(id, rec)
        }
        .await;
        match started {
            Ok(socket) => Ok(SandboxHandle {
                id: id.clone(),
                runtime: self.cfg.name.clone(),
                runtime_instance_id: P::remote_id(&sandbox).to_owned(),
                control_dir: socket.parent().map(Path::to_path_buf).unwrap_or_default(),
                // the workspace is the remote sandbox's own
                workspace_dir: PathBuf::new(),
                init_pid: std::process::id(),
                // the relay, served by this process
                envd: Some(EnvdEndpoint {
                    socket,
                    peer_pid: std::process::id(),
                }),
            }),
            Err(e) => {
                let cleanup = self.destroy(id).await;
                Err(e.with_cleanup(cleanup))
            }
        }
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.stop_relay(id);
        match self.record(id)? {
            Some(rec) => self
                .client
                .kill(P::remote_id(&rec.sandbox))
                .await
                .map_err(|e| self.remote(e))?,
            None => self.kill_by_metadata(id).await?,
        }
        self.remove_dir(id)
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        let Some(rec) = self.record(id)? else {
            return Ok(RuntimeStatus::NotFound);
        };
        Ok(
            match self
                .client
                .state(P::remote_id(&rec.sandbox))
                .await
                .map_err(|e| self.remote(e))?
            {
                None => RuntimeStatus::NotFound,
                Some(RemoteState::Running) => RuntimeStatus::Running,
                Some(RemoteState::Paused) => RuntimeStatus::Paused,
                Some(RemoteState::Stopped) => RuntimeStatus::Stopped,
            },
        )
    }

    /// Read through envd from the sandbox's cgroup (v2, else v1), the
    /// counters at once (each read is a round trip through the provider):
    /// what the provider's sandbox reports about itself, so advisory.
    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        // no record: NotFound (envd_endpoint); a gone sandbox: unreadable
        let ep = self.envd_endpoint(id).await?;
        let envd = EnvdClient::new(ep.socket).expect_peer_pid(ep.peer_pid);
        let c = |paths: &'static [&'static str], field: Option<&'static str>| {
            let envd = envd.clone();
            async move { Self::read_counter(&envd, paths, field).await }
        };
        let (memory, peak, cpu_v2, cpu_v1, oom, pids) = tokio::join!(
            c(
                &[
                    "/sys/fs/cgroup/memory.current",
                    "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                ],
                None,
            ),
            c(
                &[
                    "/sys/fs/cgroup/memory.peak",
                    "/sys/fs/cgroup/memory/memory.max_usage_in_bytes",
                ],
                None,
            ),
            c(&["/sys/fs/cgroup/cpu.stat"], Some("usage_usec")),
            c(&["/sys/fs/cgroup/cpuacct/cpuacct.usage"], None),
            c(
                &[
                    "/sys/fs/cgroup/memory.events",
                    "/sys/fs/cgroup/memory/memory.oom_control",
                ],
                Some("oom_kill"),
            ),
            c(
                &[
                    "/sys/fs/cgroup/pids.current",
                    "/sys/fs/cgroup/pids/pids.current",
                ],
                None,
            ),
        );
        if memory.is_none() && pids.is_none() {
            return Err(RuntimeError::InvokeRuntime {
                action: format!("{}: read usage", self.cfg.name),
                detail: "envd answered no cgroup counter (unreachable, or no cgroup files)".into(),
            });
        }
        let memory_current_bytes = memory.unwrap_or(0);
        Ok(ResourceUsage {
            memory_current_bytes,
            memory_peak_bytes: peak.unwrap_or(memory_current_bytes),
            cpu_usage_ns: match cpu_v2 {
                Some(us) => us.saturating_mul(1000),
                None => cpu_v1.unwrap_or(0),
            },
            oom_kills: oom.unwrap_or(0),
            pids_current: pids.unwrap_or(0),
            disk_free_bytes: None,
        })
    }

    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        let found = self
            .client
            .list(META_OWNER, &self.owner)
            .await
            .map_err(|e| self.remote(e))?;
        Ok(found
            .into_iter()
            .filter(|(_, meta)| meta.get(META_OWNER) == Some(&self.owner))
            .filter_map(|(_, meta)| meta.get(META_SANDBOX)?.parse().ok())
            .collect())
    }

    async fn envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        let rec = self
            .record(id)?
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })?;
        let socket = self.ensure_relay(id, rec)?;
        Ok(EnvdEndpoint {
            socket,
            peer_pid: std::process::id(),
        })
    }
}

#[async_trait]
impl<P: Provider> Pausable for RemoteRuntime<P> {
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let rec = self
            .record(id)?
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })?;
        self.client.pause(&rec.sandbox).await.map_err(|e| match e {
            RemoteError::NotFound { .. } => RuntimeError::NotFound { id: id.clone() },
            e => self.remote(e),
        })
    }

    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let rec = self
            .record(id)?
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })?;
        self.client
            .resume(&rec.sandbox, self.cfg.timeout_s)
            .await
            .map_err(|e| match e {
                RemoteError::NotFound { .. } => RuntimeError::NotFound { id: id.clone() },
                e => self.remote(e),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use e2b::E2bEndpoint;

    #[test]
    fn provider_answers_become_clear_runtime_errors() {
        let e = RemoteError::from_status(
            "create a sandbox",
            401,
            br#"{"code":401,"message":"bad key"}"#,
        );
        let r = e.into_runtime("e2b");
        assert_eq!(r.code(), aviary_core::ErrorCode::Unavailable);
        assert_eq!(
            r.to_string(),
            "runtime is not usable: e2b: create a sandbox: the provider refused the API key (401)"
        );
        let e = RemoteError::from_status("kill a sandbox", 503, b"down\x07 for maintenance");
        assert_eq!(
            e.to_string(),
            "kill a sandbox: the provider failed (503): down for maintenance"
        );
        assert_eq!(
            e.into_runtime("e2b").code(),
            aviary_core::ErrorCode::Unavailable
        );
        let e = RemoteError::from_status(
            "read a sandbox",
            404,
            br#"{"code":404,"message":"no such sandbox"}"#,
        );
        assert!(matches!(e, RemoteError::NotFound { .. }), "{e:?}");
        let e =
            RemoteError::from_status("create a sandbox", 400, br#"{"code":400,"message":"bad"}"#);
        assert_eq!(e.to_string(), "create a sandbox: refused: HTTP 400: bad");
        assert_eq!(
            e.into_runtime("e2b").code(),
            aviary_core::ErrorCode::Internal
        );
    }

    #[test]
    fn the_key_is_never_printed() {
        let ep = E2bEndpoint {
            api_url: "http://127.0.0.1:1".into(),
            sandbox_url: None,
            domain: "example".into(),
            port_url: None,
            proxy_key: false,
            api_key: "sekrit-key".into(),
        };
        let dir = tempfile::tempdir().unwrap();
        let rt = RemoteRuntime::e2b(
            RemoteConfig {
                name: "e2b".into(),
                state_dir: dir.path().join("state"),
                templates: BTreeMap::new(),
                timeout_s: 60,
            },
            ep,
        )
        .unwrap();
        let printed = format!("{rt:?}");
        assert!(!printed.contains("sekrit"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
        // the owner tag is kept across restarts
        let again = RemoteRuntime::new(rt.cfg.clone(), rt.client.clone()).unwrap();
        assert_eq!(again.owner(), rt.owner());
    }

    #[tokio::test]
    async fn an_unreachable_provider_is_unavailable_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // a port nothing listens on
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let rt = RemoteRuntime::e2b(
            RemoteConfig {
                name: "e2b".into(),
                state_dir: dir.path().join("state"),
                templates: BTreeMap::from([("t".to_owned(), "base".to_owned())]),
                timeout_s: 60,
            },
            E2bEndpoint {
                api_url: format!("http://{addr}"),
                sandbox_url: None,
                domain: "example".into(),
                port_url: None,
                proxy_key: false,
                api_key: "k".into(),
            },
        )
        .unwrap();
        let envd = dir.path().join("envd");
        std::fs::write(&envd, b"binary").unwrap();
        let spec = SandboxSpec {
            id: SandboxId::generate(),
            template: aviary_runtime::TemplateRef {
                name: "t".into(),
                digest: format!("sha256:{}", "ab".repeat(32)),
            },
            resources: Default::default(),
            network: NetworkProfile::None,
            egress: None,
            hostname: "sandbox".into(),
            init: vec!["/.aviary/envd".into()],
            env: vec![],
            binds: vec![aviary_runtime::BindMount {
                host: envd,
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }],
        };
        let e = rt.create(&spec).await.unwrap_err();
        assert_eq!(e.code(), aviary_core::ErrorCode::Unavailable, "{e}");
        assert!(e.to_string().contains("unreachable"), "{e}");
        assert!(
            !rt.dir(&spec.id).exists(),
            "a failed create leaves no state"
        );
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);
    }
}
