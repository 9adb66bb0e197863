//! JSON shapes of the v1 HTTP API (DESIGN §7). Request types reject unknown
//! fields so a typo in a client is an error, not a silently ignored option.

use crate::{LeaseToken, NetworkProfile, ResourceLimits, SandboxId, SandboxState, Scope};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use time::OffsetDateTime;

/// `POST /v1/sandboxes`
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Template name; the default template when absent.
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub template: Option<String>,
    /// Resource class; the default class when absent.
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub class: Option<String>,
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub user_id: Option<String>,
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub session_id: Option<String>,
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub agent: Option<String>,
    #[serde(default)]
    pub scope: Option<Scope>,
    /// Network profile by name (`none`, or one from the configuration).
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub network: Option<String>,
    /// Task context for the resource planner (DESIGN §7); the planner's
    /// recommendation goes through the policy guard. Ignored when `class` is set.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub intent: Option<serde_json::Value>,
    /// Lifetime in seconds; the sandbox is destroyed after it.
    #[serde(default)]
    pub ttl_s: Option<u64>,
    /// Take a lease as part of the create.
    #[serde(default)]
    pub lease: Option<AcquireLeaseRequest>,
    /// A saved sandbox state (snapshot id of this tenant) to start from.
    #[serde(default)]
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub from_snapshot: Option<String>,
    /// The caller manages this sandbox's life: the platform (TTL, idle
    /// timeout) only stops it — snapshot and hibernate — and never destroys it.
    #[serde(default)]
    pub user_managed: bool,
    /// The runtime to run on (`crun`, `runc`): it must be one the class
    /// offers, the tenant may use and a node serves. Absent: the default
    /// runtime when the class offers it, else one of the class's.
    #[serde(default)]
    pub runtime: Option<String>,
    /// Labels kept with the sandbox, shown by `get`/`ls` and filterable
    /// (keys 1-128 characters, values up to 1024, at most 64 pairs).
    #[serde(default)]
    #[schema(schema_with = labels_schema)]
    pub metadata: BTreeMap<String, String>,
    /// Default environment of every exec in the sandbox (an exec's own
    /// `env` wins); never shown back. Names `[A-Za-z_][A-Za-z0-9_]*`, at
    /// most 128 variables and 32 KiB.
    #[serde(default)]
    #[schema(schema_with = env_schema)]
    pub env: BTreeMap<String, String>,
    /// Default working directory of every exec (absolute, no `..`; an
    /// exec's own `cwd` wins). Absent: the template's `WorkingDir`, else
    /// envd's default.
    #[serde(default)]
    #[schema(pattern = "^/", max_length = 4096)]
    pub workdir: Option<String>,
}

/// A string-to-string map of at most `max` entries, as the schema states it.
fn bounded_map_schema(max: usize) -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .additional_properties(Some(ObjectBuilder::new().schema_type(Type::String)))
        .max_properties(Some(max))
        .build()
}

/// `metadata` of a create (see `aviary-control`'s `validate::MAX_LABELS`).
fn labels_schema() -> utoipa::openapi::schema::Object {
    bounded_map_schema(64)
}

/// `env` of a create (see `aviary-control`'s `validate::MAX_SANDBOX_ENV`).
fn env_schema() -> utoipa::openapi::schema::Object {
    bounded_map_schema(128)
}

/// What an imported image's config asks of the processes run from it
/// (`Env`, `WorkingDir`, `User` of a `docker save` / OCI image config).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ImageDefaults {
    /// The image's environment; a create's `env` and an exec's own win.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The default working directory of execs (absolute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    /// The user execs run as: `name`, `uid`, `name:group` or `uid:gid`,
    /// resolved inside the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// A sandbox as the API shows it.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Sandbox {
    pub id: SandboxId,
    pub state: SandboxState,
    pub tenant: String,
    pub user_id: Option<String>,
    pub session_id: Option<String>,
    pub agent: Option<String>,
    pub scope: Scope,
    pub resource_class: String,
    pub resources: ResourceLimits,
    pub template: String,
    pub template_digest: String,
    pub runtime: String,
    pub node: String,
    pub network_profile: NetworkProfile,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<OffsetDateTime>,
    pub tainted: bool,
    /// Owned by the user: the platform only stops (hibernates) it, never destroys it.
    #[serde(default)]
    pub user_managed: bool,
    /// Frozen by `pause` (every process stopped) until `resume`.
    #[serde(default)]
    pub paused: bool,
    /// The labels given at create.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Default working directory of its execs, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The user its execs run as (from the template's image config), if not root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<String>,
    /// Optimistic-concurrency version of the registry row.
    pub version: i64,
    /// The live lease, if any (its token is shown only in the acquire/create answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_owner: Option<String>,
}

/// Why the control plane chose what it chose.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Decision {
    /// `new_sandbox | reuse | new_venv | fork_clean_snapshot`
    pub action: String,
    /// Restore branch `A | B | C | D` (D = cold init).
    pub branch: String,
    pub reason: String,
    pub score: f64,
}

/// `POST /v1/sandboxes` answer.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateSandboxResponse {
    #[serde(flatten)]
    pub sandbox: Sandbox,
    pub decision: Decision,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<Lease>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/lease`
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireLeaseRequest {
    pub owner: String,
    /// Seconds until the lease expires unless renewed (default 60).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

/// `PUT /v1/sandboxes/{id}/lease` (renew / heartbeat)
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewLeaseRequest {
    pub token: LeaseToken,
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/ttl`: the sandbox now expires `ttl_s` seconds
/// from now (which may shorten its life).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetTtlBody {
    #[schema(minimum = 1)]
    pub ttl_s: u64,
}

/// `DELETE /v1/sandboxes/{id}/lease`
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseLeaseRequest {
    pub token: LeaseToken,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Lease {
    pub sandbox_id: SandboxId,
    pub owner: String,
    pub token: LeaseToken,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub acquired_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: OffsetDateTime,
}

/// `POST /v1/sandboxes/{id}/exec` (and `/exec/stream`)
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// argv form; exactly one of `cmd` and `shell` must be given.
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    /// Shell string, run with `/bin/sh -c`.
    #[serde(default)]
    pub shell: Option<String>,
    /// Working directory (absolute, no `..`).
    #[serde(default)]
    #[schema(pattern = "^/", max_length = 4096)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Bytes written to the command's stdin (UTF-8 text).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Seconds; the whole process group is killed when it passes.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Lease token; required while the sandbox is leased.
    #[serde(default)]
    pub token: Option<LeaseToken>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExecResult {
    /// Exit code; `128 + signal` when killed by a signal.
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    pub duration_ms: f64,
    pub timed_out: bool,
    pub oom_killed: bool,
    /// True when stdout/stderr were cut to the non-streaming cap; use the
    /// streaming endpoint for the whole output.
    #[serde(default)]
    pub truncated: bool,
}

/// One event of a streaming exec (`text/event-stream`, event name = variant).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    Stdout {
        data: String,
    },
    Stderr {
        data: String,
    },
    Exit {
        result: ExecResult,
    },
    Error {
        code: crate::ErrorCode,
        message: String,
    },
}

/// A directory entry or `stat` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FileInfo {
    pub name: String,
    pub path: String,
    /// `file | dir | symlink | other`
    pub kind: String,
    pub size: u64,
    pub mode: u32,
    pub modified_unix: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FileList {
    pub entries: Vec<FileInfo>,
    /// A recursive listing stopped at its cap (10,000 entries).
    #[serde(default)]
    pub truncated: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    pub path: String,
    #[serde(default)]
    pub token: Option<LeaseToken>,
}

/// An entry of the event log.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    pub id: i64,
    pub sandbox_id: Option<SandboxId>,
    pub tenant: String,
    pub event_type: String,
    pub old_state: Option<SandboxState>,
    pub new_state: Option<SandboxState>,
    pub request_id: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub timestamp: OffsetDateTime,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventList {
    pub events: Vec<Event>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Template {
    pub name: String,
    pub digest: String,
    pub size_bytes: u64,
    pub source: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    /// What the imported image's config asks of processes run from it.
    #[serde(default)]
    pub defaults: ImageDefaults,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// `POST /v1/keys` (admin only): a key for a tenant. The secret is shown once.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    #[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    pub tenant: String,
    #[serde(default)]
    pub admin: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatedKey {
    pub tenant: String,
    pub admin: bool,
    pub key: String,
}

/// How to reach one port of a sandbox through the control plane
/// (`GET /v1/sandboxes/{id}/endpoints/{port}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PortEndpoint {
    pub port: u16,
    /// The proxy URL; send the API key, or `token` in the `header` header.
    pub url: String,
    /// The URL for a browser: carries the token once, which the answer
    /// turns into a cookie scoped to this port.
    pub browser_url: String,
    /// The header that carries `token`.
    pub header: String,
    /// The port token: opens this port of this sandbox only.
    pub token: String,
}

/// One process of a sandbox (`GET /v1/sandboxes/{id}/processes`). Every
/// field was written by the sandbox: text to show, nothing more.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProcessEntry {
    pub pid: i32,
    pub ppid: i32,
    pub uid: u32,
    /// The uid's name in the sandbox's `/etc/passwd`.
    pub user: Option<String>,
    /// `R`, `S`, `D`, `Z`, `T`, ...
    pub state: String,
    /// At most 64 arguments of at most 256 bytes each.
    pub argv: Vec<String>,
    /// Whether `argv` was cut.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProcessList {
    pub processes: Vec<ProcessEntry>,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// `TERM` (default), `KILL`, `INT`, `HUP`, `QUIT`, `USR1`, `USR2`, `STOP`, `CONT`
    /// (a `SIG` prefix is accepted).
    #[serde(default)]
    #[schema(max_length = 16)]
    pub signal: Option<String>,
}

/// A started background command (`POST /v1/sandboxes/{id}/processes`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BackgroundStarted {
    /// What `processes/{handle}/output` takes.
    pub handle: u64,
    pub pid: i32,
}

/// What envd kept of a background command
/// (`GET /v1/sandboxes/{id}/processes/{handle}/output`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BackgroundOutput {
    pub handle: u64,
    pub pid: i32,
    pub running: bool,
    /// Once it exited: its code (`128 + signal` when killed by one).
    pub exit_code: Option<i32>,
    /// The newest 1 MiB of each stream (lossy UTF-8).
    pub stdout: String,
    pub stderr: String,
    /// Bytes that fell out of the kept window before this read.
    pub stdout_dropped: u64,
    pub stderr_dropped: u64,
}

/// Live resource usage of one sandbox (`GET /v1/sandboxes/{id}/usage`):
/// its runtime's counters (the sandbox's cgroup) read at `sampled_at`,
/// beside the limits of its class. Counters are cumulative where their
/// names say so: a CPU percentage is the change of `cpu_seconds` between
/// two samples over the time between their `sampled_at`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SandboxUsage {
    pub sandbox_id: SandboxId,
    pub state: SandboxState,
    /// Frozen by `pause`: its counters stand still until `resume`.
    pub paused: bool,
    /// CPU time its processes used since it started, in seconds (all cores together).
    pub cpu_seconds: f64,
    /// CPU cores it may use (its class's quota).
    pub cpu_limit: f64,
    /// Memory charged to it now (page cache included), in bytes.
    pub memory_bytes: u64,
    /// The most it has had charged since it started.
    pub memory_peak_bytes: u64,
    /// Its memory limit: the class's `memory_mb` in bytes.
    pub memory_limit_bytes: u64,
    /// Processes (and threads) in it now, envd (pid 1) included.
    pub pids: u64,
    pub pids_limit: u64,
    /// Processes the OOM killer ended in it since it started.
    pub oom_kills: u64,
    /// Its disk size: the class's `disk_mb` in bytes.
    pub disk_limit_bytes: u64,
    /// Bytes still writable on its own disk, when the runtime gives each
    /// sandbox one (absent: the runtime does not know).
    #[serde(default)]
    pub disk_free_bytes: Option<u64>,
    /// `disk_limit_bytes - disk_free_bytes` when the free space is known
    /// (the file system's own overhead included).
    #[serde(default)]
    pub disk_used_bytes: Option<u64>,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub sampled_at: OffsetDateTime,
}
