//! The request values of the client operations that have no API request
//! type of their own in `aviary_core::api` (or need the target's id beside
//! one): each operation takes an [`OpContext`](crate::OpContext) and one
//! of these, or one API request type.
//!
//! Ids are the strings the client sent: an id that does not parse is
//! `not_found` like one of another tenant, answered by the operation.

use crate::error::OpError;
use crate::pools::SetPoolRequest;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// One sandbox, by id (get, delete, pause, resume, reset, release,
/// hibernate, wake).
#[derive(Clone, Debug)]
pub struct SandboxRef {
    pub id: String,
}

impl SandboxRef {
    pub fn new(id: impl Into<String>) -> Self {
        SandboxRef { id: id.into() }
    }
}

/// An API request aimed at one sandbox (exec, fork, leases).
#[derive(Clone, Debug)]
pub struct OnSandbox<R> {
    pub id: String,
    pub request: R,
}

impl<R> OnSandbox<R> {
    pub fn new(id: impl Into<String>, request: R) -> Self {
        OnSandbox {
            id: id.into(),
            request,
        }
    }
}

/// Recycling at a level: 1 soft reset, 2 back to the clean checkpoint,
/// 3 hard destroy.
#[derive(Clone, Debug)]
pub struct ResetRequest {
    pub id: String,
    pub level: u8,
}

/// A checkpoint of a sandbox (`label`: `clean` marks the one level-2
/// resets return to; `checkpoint` when absent).
#[derive(Clone, Debug)]
pub struct CheckpointRequest {
    pub id: String,
    pub label: Option<String>,
}

impl CheckpointRequest {
    /// A checkpoint with the default label.
    pub fn new(id: impl Into<String>) -> Self {
        CheckpointRequest {
            id: id.into(),
            label: None,
        }
    }
}

/// A sandbox's environment manifest (`refresh`: probe it now).
#[derive(Clone, Debug)]
pub struct ManifestRequest {
    pub id: String,
    pub refresh: bool,
}

/// A sandbox's live resource usage; `all_tenants`: find it in any tenant
/// (admin keys only, `forbidden` for any other caller before anything is
/// read).
#[derive(Clone, Debug)]
pub struct UsageRequest {
    pub id: String,
    pub all_tenants: bool,
}

impl UsageRequest {
    /// One of the caller's own sandboxes.
    pub fn new(id: impl Into<String>) -> Self {
        UsageRequest {
            id: id.into(),
            all_tenants: false,
        }
    }
}

/// A path inside a sandbox (read, list, stat, mkdir).
#[derive(Clone, Debug)]
pub struct FileRequest {
    pub id: String,
    pub path: String,
}

impl FileRequest {
    pub fn new(id: impl Into<String>, path: impl Into<String>) -> Self {
        FileRequest {
            id: id.into(),
            path: path.into(),
        }
    }
}

/// A file or directory to remove inside a sandbox.
#[derive(Clone, Debug)]
pub struct RemoveFileRequest {
    pub id: String,
    pub path: String,
    pub recursive: bool,
}

/// A file to write inside a sandbox, with the stream of its content.
pub struct FileUpload<R> {
    pub id: String,
    pub path: String,
    pub body: R,
}

impl<R> std::fmt::Debug for FileUpload<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileUpload")
            .field("id", &self.id)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The caller's sandboxes (`include_terminated`: the ended ones too; the
/// default lists the others only), only those whose labels contain every
/// pair of `metadata` when it is not empty.
#[derive(Clone, Debug, Default)]
pub struct SandboxQuery {
    pub include_terminated: bool,
    pub metadata: BTreeMap<String, String>,
    /// Only sandboxes in this state (`Terminated` implies `include_terminated`).
    pub state: Option<aviary_core::SandboxState>,
    /// Only sandboxes working for this end user / in this session.
    pub user_id: Option<String>,
    pub session_id: Option<String>,
    /// Every tenant's sandboxes, not only the caller's: admin keys only
    /// (`forbidden` for any other caller, before anything is read).
    pub all_tenants: bool,
}

impl SandboxQuery {
    /// Every sandbox of the caller, the terminated ones included.
    pub fn all() -> Self {
        SandboxQuery {
            include_terminated: true,
            ..Default::default()
        }
    }
}

/// A label filter as the E2B and OpenSandbox APIs (and `GET /v1/sandboxes`)
/// spell it: one query value holding `k=v&k2=v2`, each key and value
/// form-urlencoded (`%xx`, `+` for a space). Empty: no filter.
pub fn parse_label_filter(s: &str) -> Result<BTreeMap<String, String>, OpError> {
    let mut out = BTreeMap::new();
    for (k, v) in form_urlencoded::parse(s.as_bytes()) {
        if k.is_empty() {
            return Err(OpError::InvalidRequest(format!(
                "metadata filter {s:?} has an empty key (expected k=v&k2=v2)"
            )));
        }
        out.insert(k.into_owned(), v.into_owned());
    }
    crate::validate::labels(&out)?;
    Ok(out)
}

/// `expires_at = now + ttl_s` (1 s up to the server's maximum ttl; it may
/// shorten the sandbox's life).
#[derive(Clone, Debug)]
pub struct SetTtlRequest {
    pub id: String,
    pub ttl_s: u64,
}

/// The caller's events, oldest first: of one sandbox when given, only
/// those after an event id (for following), at most `limit` (100 when
/// absent, 1000 at most).
#[derive(Clone, Debug, Default)]
pub struct EventQuery {
    pub sandbox: Option<String>,
    pub after: Option<i64>,
    pub limit: Option<u32>,
    /// The last `limit` events (after `after`) instead of the first; the
    /// answer is oldest first either way.
    pub newest: bool,
    /// Every tenant's events (and `sandbox` may name any tenant's
    /// sandbox): admin keys only (`forbidden` for any other caller, before
    /// anything is read).
    pub all_tenants: bool,
}

/// The caller's snapshots, of one sandbox when given.
#[derive(Clone, Debug, Default)]
pub struct SnapshotQuery {
    pub sandbox: Option<String>,
}

/// The caller's planner and policy decisions, newest first (100 when
/// `limit` is absent, 1000 at most).
#[derive(Clone, Debug, Default)]
pub struct AllocationQuery {
    pub limit: Option<u32>,
}

/// One API key, by id.
#[derive(Clone, Debug)]
pub struct KeyRef {
    pub id: String,
}

/// New bounds for the pools of a resource class.
#[derive(Clone, Debug)]
pub struct PoolUpdate {
    pub class: String,
    pub bounds: SetPoolRequest,
}

/// A template archive to import under `name` (spooled to `archive` by the
/// caller, who removes it afterwards).
#[derive(Clone, Debug)]
pub struct TemplateImport {
    pub name: String,
    pub archive: PathBuf,
    /// Replace a template of that name (otherwise an existing name is a 409).
    pub force: bool,
}
