//! The rows of the registry, as plain serde-serializable structs.

use aviary_core::api;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId, SandboxState, Scope};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use time::OffsetDateTime;

/// One `sandbox_instance` row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: SandboxId,
    pub tenant: String,
    pub user_id: Option<String>,
    pub session_id: Option<String>,
    pub agent: Option<String>,
    pub scope: Scope,
    pub resource_class: String,
    pub resources: ResourceLimits,
    /// Template name.
    pub template: String,
    pub template_digest: String,
    /// Runtime provider (`crun`, `runc`, `docker`, …).
    pub runtime: String,
    /// The runtime's own id of the compute (container id, pod name, …).
    pub runtime_instance_id: Option<String>,
    /// Node id; empty until placed.
    pub node: String,
    pub network_profile: NetworkProfile,
    pub state: SandboxState,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub last_active_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    pub expires_at: Option<OffsetDateTime>,
    /// Optimistic-concurrency version; +1 per state step or field update.
    pub version: i64,
    /// Never reused once set (a policy violation, a suspicious exec, …).
    pub tainted: bool,
    /// Owned by the user: the platform only stops it (hibernates), never destroys it.
    #[serde(default)]
    pub user_managed: bool,
    /// Frozen by a `pause` (cgroup freezer) and not resumed since; meaningful
    /// while the sandbox holds compute.
    #[serde(default)]
    pub paused: bool,
    /// The owner's labels (shown, filterable).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Default environment of every exec (never shown by the API).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Default working directory of every exec.
    #[serde(default)]
    pub workdir: Option<String>,
    /// The user execs run as (resolved inside the sandbox); `None`: root.
    #[serde(default)]
    pub run_as: Option<String>,
}

impl SandboxRecord {
    /// The API view; `lease_owner` is the owner of the live lease, if any.
    pub fn to_api(&self, lease_owner: Option<String>) -> api::Sandbox {
        api::Sandbox {
            id: self.id.clone(),
            state: self.state,
            tenant: self.tenant.clone(),
            user_id: self.user_id.clone(),
            session_id: self.session_id.clone(),
            agent: self.agent.clone(),
            scope: self.scope,
            resource_class: self.resource_class.clone(),
            resources: self.resources,
            template: self.template.clone(),
            template_digest: self.template_digest.clone(),
            runtime: self.runtime.clone(),
            node: self.node.clone(),
            network_profile: self.network_profile,
            created_at: self.created_at,
            expires_at: self.expires_at,
            tainted: self.tainted,
            user_managed: self.user_managed,
            paused: self.paused && self.state.is_live(),
            metadata: self.metadata.clone(),
            workdir: self.workdir.clone(),
            run_as: self.run_as.clone(),
            version: self.version,
            lease_owner,
        }
    }
}

/// The new owner of a warm pooled sandbox (see [`crate::Registry::claim_sandbox`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxClaim {
    pub tenant: String,
    pub user_id: Option<String>,
    pub session_id: Option<String>,
    pub agent: Option<String>,
    pub scope: aviary_core::Scope,
    #[serde(with = "time::serde::rfc3339::option")]
    pub expires_at: Option<time::OffsetDateTime>,
    /// The new owner manages the sandbox (it is only stopped, never
    /// destroyed, by the TTL sweep), as a cold create would have recorded.
    #[serde(default)]
    pub user_managed: bool,
    /// The new owner's labels and default exec environment.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub run_as: Option<String>,
}

/// Tenant of a pooled sandbox that nobody owns yet (no real tenant name is empty).
pub const POOL_TENANT: &str = "";

/// A sandbox to insert: a [`SandboxRecord`] without state, version and
/// timestamps the registry sets (`Requested`, 0, now).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewSandbox {
    pub id: SandboxId,
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
    pub runtime_instance_id: Option<String>,
    pub node: String,
    pub network_profile: NetworkProfile,
    #[serde(with = "time::serde::rfc3339::option")]
    pub expires_at: Option<OffsetDateTime>,
    pub tainted: bool,
    /// Owned by the user: the platform only stops it (hibernates), never destroys it.
    #[serde(default)]
    pub user_managed: bool,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub workdir: Option<String>,
    #[serde(default)]
    pub run_as: Option<String>,
}

/// An event to append. `tenant` is the tenant the event belongs to (`""`
/// for system-wide events).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewEvent {
    pub sandbox_id: Option<SandboxId>,
    pub tenant: String,
    pub event_type: String,
    pub old_state: Option<SandboxState>,
    pub new_state: Option<SandboxState>,
    pub request_id: Option<String>,
    pub metadata: serde_json::Value,
}

/// Which events to list. `limit` 0 means [`crate::DEFAULT_LIMIT`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EventFilter {
    pub tenant: Option<String>,
    pub sandbox_id: Option<SandboxId>,
    /// Only events with an id greater than this (paging, `--follow`).
    pub after_id: Option<i64>,
    pub limit: u32,
    /// The last `limit` matching events instead of the first (the answer
    /// is still oldest first).
    #[serde(default)]
    pub newest: bool,
}

/// An immutable root filesystem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub name: String,
    pub digest: String,
    pub size_bytes: u64,
    /// Where it came from (`debootstrap`, `oci-archive:…`, …).
    pub source: String,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// From the imported image's config (kept by the template store; the
    /// registry's copy of a template does not carry it).
    #[serde(default)]
    pub defaults: api::ImageDefaults,
}

impl TemplateRecord {
    pub fn to_api(&self) -> api::Template {
        api::Template {
            name: self.name.clone(),
            digest: self.digest.clone(),
            size_bytes: self.size_bytes,
            source: self.source.clone(),
            created_at: self.created_at,
            defaults: self.defaults.clone(),
        }
    }
}

/// A host that runs sandboxes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    pub address: String,
    /// Runtimes available on the node (`crun`, `runc`, …).
    pub runtimes: Vec<String>,
    pub cpu: f64,
    pub memory_mb: u64,
    pub healthy: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub last_seen: OffsetDateTime,
}

/// An API key, stored by hash only.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiKeyRecord {
    /// Public handle of the key (listing, revocation); not a secret and not
    /// derived from it.
    pub id: String,
    pub key_hash: String,
    pub tenant: String,
    pub admin: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Set once the key is revoked; a revoked key never authenticates again.
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub revoked_at: Option<OffsetDateTime>,
}

impl std::fmt::Debug for ApiKeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeyRecord")
            .field("id", &self.id)
            .field("key_hash", &"<redacted>")
            .field("tenant", &self.tenant)
            .field("admin", &self.admin)
            .field("created_at", &self.created_at)
            .field("revoked_at", &self.revoked_at)
            .finish()
    }
}

/// One planner decision (`sandbox_allocation`), the input of telemetry
/// right-sizing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationRecord {
    /// Set by the registry; ignored on insert.
    pub id: Option<i64>,
    pub task_id: String,
    pub tenant: String,
    pub sandbox_id: Option<SandboxId>,
    /// Hash of the planner's input (the task context).
    pub planner_input_hash: String,
    /// Groups similar work for right-sizing (e.g. tools + languages).
    pub workload_signature: String,
    pub recommended_class: String,
    pub actual_class: String,
    pub reason: String,
    pub confidence: f64,
    /// `llm | telemetry | heuristic | request`
    pub source: String,
    /// Granted limits.
    pub cpu: f64,
    pub memory_mb: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// What the sandbox really used; `None` until it is released.
    pub usage: Option<AllocationUsage>,
}

/// Measured usage of one allocation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationUsage {
    pub duration_s: f64,
    pub peak_cpu: f64,
    pub peak_memory_mb: u64,
    pub oom: bool,
    pub timed_out: bool,
}

/// A sandbox's environment manifest (`sandbox_environment`), what the reuse
/// checker compares.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentRecord {
    pub sandbox_id: SandboxId,
    pub base_image_digest: String,
    pub dependency_hash: String,
    pub workspace_id: Option<String>,
    pub snapshot_id: Option<String>,
    pub environment_version: i64,
    /// 0 = clean; higher = more state left behind by earlier work.
    pub dirty_level: i32,
    /// The full manifest as JSON (`{}` when only the summary is known).
    #[serde(default)]
    pub manifest: serde_json::Value,
}

/// One sandbox snapshot's index entry (`sandbox_snapshot`): ties the two
/// chunk-store manifests of a checkpoint (workspace and writable layer) to
/// its sandbox, template and parent, so snapshots form a tree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub tenant: String,
    pub sandbox_id: SandboxId,
    /// The snapshot of the same lineage taken before this one.
    pub parent: Option<String>,
    /// Chunk-store manifest of `/workspace`.
    pub workspace_manifest: String,
    /// Chunk-store manifest of the writable layer.
    pub upper_manifest: String,
    pub template: String,
    pub template_digest: String,
    pub resource_class: String,
    /// `checkpoint`, `clean`, `hibernate`, …
    pub label: String,
    /// Bytes of files in both trees.
    pub total_bytes: u64,
    /// Chunk bytes this snapshot had to store.
    pub new_bytes: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// The environment manifest the sandbox had when the snapshot was
    /// taken (`None`: not known), for the reuse checker's forks.
    #[serde(default)]
    pub manifest: Option<serde_json::Value>,
}

/// Which snapshots to list: every field that is set narrows the list.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotFilter {
    pub tenant: Option<String>,
    pub sandbox_id: Option<SandboxId>,
    pub label: Option<String>,
}

/// The bounds `pool set` gave every warm pool of a resource class; they
/// replace the configuration's `pool_min`/`pool_max` for that class.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolBoundsRecord {
    pub class: String,
    pub pool_min: u32,
    pub pool_max: u32,
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
}

/// A node agent the control plane connects to (`aviary node add`).
/// `token` is the agent's bearer token, which the control plane presents on
/// every call, so it is kept as given: a secret, redacted in `Debug`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRegistration {
    pub id: String,
    /// `ip:port` of the agent.
    pub address: String,
    pub token: String,
    #[serde(with = "time::serde::rfc3339")]
    pub registered_at: OffsetDateTime,
}

impl std::fmt::Debug for NodeRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRegistration")
            .field("id", &self.id)
            .field("address", &self.address)
            .field("token", &"<redacted>")
            .field("registered_at", &self.registered_at)
            .finish()
    }
}

/// Live sandboxes on one node in one state, summed ([`crate::Registry::live_totals`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LiveTotal {
    pub node: String,
    pub state: SandboxState,
    pub sandboxes: u64,
    pub cpu: f64,
    pub memory_mb: u64,
}

impl LiveTotal {
    /// Sums `records` (terminated ones left out) by node and state, in
    /// (node, state) order.
    pub fn sum(records: &[SandboxRecord]) -> Vec<LiveTotal> {
        let mut by: std::collections::BTreeMap<(&str, &'static str), LiveTotal> =
            Default::default();
        for r in records
            .iter()
            .filter(|r| r.state != SandboxState::Terminated)
        {
            let t = by
                .entry((r.node.as_str(), r.state.as_str()))
                .or_insert_with(|| LiveTotal {
                    node: r.node.clone(),
                    state: r.state,
                    sandboxes: 0,
                    cpu: 0.0,
                    memory_mb: 0,
                });
            t.sandboxes += 1;
            t.cpu += r.resources.cpu;
            t.memory_mb += r.resources.memory_mb;
        }
        by.into_values().collect()
    }
}
