//! The node API's wire types, shared by the agent and [`crate::RemoteRuntime`].
//!
//! Routes (all under `/node/v1`, all requiring `Authorization: Bearer <node
//! token>`; errors are `{"error": {"code", "message"}}` with a 4xx/5xx status):
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | GET | `/info` | → [`NodeInfo`] |
//! | GET | `/sandboxes` | → [`SandboxList`] (what the runtime really has) |
//! | POST | `/sandboxes` | [`CreateSandboxRequest`] → 201 [`SandboxHandle`] |
//! | DELETE | `/sandboxes/{id}` | → 204 (idempotent) |
//! | GET | `/sandboxes/{id}/status` | → [`StatusAnswer`], 404 when unknown |
//! | GET | `/sandboxes/{id}/usage` | → [`ResourceUsage`] |
//! | POST | `/sandboxes/{id}/pause`, `/resume` | → 204 |
//! | GET | `/sandboxes/{id}/envd` | `Upgrade: aviary-envd` → 101, then raw envd frames |
//! | PUT | `/templates/{name}` | a `docker save` or OCI-layout tarball → 201 [`TemplateEntry`] |
//!
//! Error codes are the control plane's (`aviary_core::ErrorCode`, the one
//! table; the status is the code's): a runtime failure answers with
//! `RuntimeError::code()`, so e.g. a full host is 503 `capacity_exhausted`
//! here as on the control plane's own node. `kind` names some failures more
//! finely, for [`crate::RemoteRuntime`] to rebuild the same error:
//! `already_exists` (409 `conflict`), `unsupported`, `invalid_spec`,
//! `template_missing` (400 `invalid_request`), `envd_unavailable` (503
//! `unavailable`). (Agents of older versions sent those names as the code.)

use aviary_core::{ResourceLimits, SandboxId};
use aviary_runtime::{RuntimeStatus, SandboxSpec};
use aviary_scheduler::{NodeView, WarmKey};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;
use time::OffsetDateTime;

#[doc(no_inline)]
pub use aviary_runtime::{ResourceUsage, SandboxHandle};

/// Name of envd's socket in a sandbox's host-only control dir (the runtime
/// binds it and hands it to envd, started with `--listen-fd 3`).
pub use aviary_runtime::ENVD_SOCKET_NAME;
/// The `Upgrade` protocol token of the envd route.
pub const ENVD_UPGRADE_PROTOCOL: &str = "aviary-envd";
/// Largest template archive `PUT /node/v1/templates/{name}` accepts.
pub const MAX_TEMPLATE_UPLOAD_MB: u64 = 8 * 1024;
/// Where the control plane mounts envd in every sandbox.
pub const ENVD_IN_SANDBOX: &str = "/.aviary/envd";

/// `POST /node/v1/sandboxes`. Host paths in `spec` name files on the
/// *control plane's* machine and are not used: the node resolves `template`
/// (a digest `sha256:<hex>` or a template name) in its own template store,
/// and replaces each bind's host side by the file the node provides for that
/// sandbox path ([`ProvidedBind`]); a bind to any other sandbox path is
/// refused, so a control plane can never make a node expose an arbitrary
/// host path.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreateSandboxRequest {
    pub spec: SandboxSpec,
    pub template: String,
}

/// A host file the node binds (read-only) at a fixed path in sandboxes that
/// ask for a bind there, e.g. its envd binary at [`ENVD_IN_SANDBOX`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvidedBind {
    /// Absolute path inside the sandbox.
    pub sandbox: String,
    /// The node's own host path.
    pub host: PathBuf,
}

impl ProvidedBind {
    /// The node's envd binary at [`ENVD_IN_SANDBOX`].
    pub fn envd(host: impl Into<PathBuf>) -> Self {
        ProvidedBind {
            sandbox: ENVD_IN_SANDBOX.into(),
            host: host.into(),
        }
    }
}

/// CPU cores and memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    pub cpu: f64,
    pub memory_mb: u64,
}

impl Capacity {
    /// This host's CPUs and `MemTotal`.
    pub fn detect() -> Capacity {
        let cpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let memory_mb = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("MemTotal:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
            .map_or(0, |kb| kb / 1024);
        Capacity { cpu, memory_mb }
    }
}

/// A template present on the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateEntry {
    pub name: String,
    pub digest: String,
}

/// `GET /node/v1/info`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: String,
    /// Runtime backends on the node (today one: the agent's runtime).
    pub runtimes: Vec<String>,
    pub templates: Vec<TemplateEntry>,
    pub capacity: Capacity,
    /// Sum of the limits of the sandboxes this node created and has not
    /// destroyed.
    pub committed: Capacity,
    /// Measured: memory currently charged to those sandboxes, and their CPU
    /// rate (cores) since the previous info request (0 on the first).
    pub used: Capacity,
    pub sandboxes: usize,
    /// Whether the node snapshots and restores its sandboxes' layers
    /// (`…/layers/…`, `…/workspace/…`); absent from older agents.
    #[serde(default)]
    pub snapshots: bool,
}

impl NodeInfo {
    /// The scheduler's view of this node. Warm counts come from the pool
    /// manager (the node does not know which sandboxes are pooled).
    /// `healthy` is true because the view is built from a successful `info`
    /// answer: a node whose `info` failed keeps its last view with
    /// `healthy = false` (and ages out through `last_seen`).
    pub fn to_view(
        &self,
        address: impl Into<String>,
        warm: HashMap<WarmKey, u32>,
        last_seen: OffsetDateTime,
    ) -> NodeView {
        NodeView {
            id: self.id.clone(),
            address: address.into(),
            runtimes: self.runtimes.clone(),
            templates: self.templates.iter().map(|t| t.digest.clone()).collect(),
            cpu_capacity: self.capacity.cpu,
            memory_capacity_mb: self.capacity.memory_mb,
            cpu_committed: self.committed.cpu,
            memory_committed_mb: self.committed.memory_mb,
            cpu_used: self.used.cpu,
            memory_used_mb: self.used.memory_mb,
            warm,
            healthy: true,
            last_seen,
        }
    }
}

/// `GET /node/v1/sandboxes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxId>,
}

/// `GET /node/v1/sandboxes/{id}/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusAnswer {
    pub status: RuntimeStatus,
}

/// What the node remembers about a sandbox it created (also persisted under
/// `<state_dir>/sandboxes/<id>.json`, so a restarted agent finds it again).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacedSandbox {
    pub handle: SandboxHandle,
    pub limits: ResourceLimits,
    /// Digest of the template it runs on.
    pub template: String,
}

/// The body of every error answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorAnswer {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// An `aviary_core::ErrorCode` string (kept a string on the wire, so an
    /// answer with a code this side does not know still parses).
    pub code: String,
    /// The finer name of the failure, when the code alone is not enough.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_of_this_host_is_detected() {
        let c = Capacity::detect();
        assert!(c.cpu >= 1.0, "{c:?}");
        assert!(c.memory_mb > 0, "{c:?}");
    }

    #[test]
    fn info_becomes_a_scheduler_view() {
        let info = NodeInfo {
            id: "n1".into(),
            runtimes: vec!["crun".into()],
            templates: vec![TemplateEntry {
                name: "busybox".into(),
                digest: "sha256:ab".into(),
            }],
            capacity: Capacity {
                cpu: 4.0,
                memory_mb: 8192,
            },
            committed: Capacity {
                cpu: 1.5,
                memory_mb: 2048,
            },
            used: Capacity {
                cpu: 0.25,
                memory_mb: 300,
            },
            sandboxes: 2,
            snapshots: false,
        };
        let now = aviary_core::now();
        let mut warm = HashMap::new();
        warm.insert(WarmKey::new("python-small", "sha256:ab", "crun"), 1);
        let v = info.to_view("127.0.0.1:7501", warm.clone(), now);
        assert_eq!(v.templates, vec!["sha256:ab".to_string()]);
        assert_eq!((v.cpu_committed, v.memory_committed_mb), (1.5, 2048));
        assert_eq!((v.cpu_used, v.memory_used_mb), (0.25, 300));
        assert_eq!(v.warm, warm);
        assert!(v.healthy);
        // The wire form round-trips.
        let back: NodeInfo = serde_json::from_str(&serde_json::to_string(&info).unwrap()).unwrap();
        assert_eq!(back, info);
    }
}
