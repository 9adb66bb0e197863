//! Aviary's registry seam: the source of record (DESIGN §3 "Registry",
//! principle 6).
//!
//! This crate owns the [`Registry`] trait and its record types: sandboxes
//! (`sandbox_instance`), their environments (`sandbox_environment`), the event
//! log (`sandbox_event`), planner allocations (`sandbox_allocation`), the
//! snapshot index (`sandbox_snapshot`), warm-pool bounds and hand-outs,
//! templates, nodes and node agent registrations (tokens included), tenants
//! and API keys: every piece of state that outlives a request (no JSON
//! files beside it). Backends live in their own crates
//! (`aviary-registry-sqlite` today, PostgreSQL later) and must pass
//! [`conformance::run_all`]; callers depend only on this crate.
//!
//! Invariants every backend keeps:
//! - A sandbox's state only moves along [`SandboxState::can_transition_to`];
//!   every move bumps `version` by one and writes one event row, in the same
//!   transaction as the optimistic `version` check and (for client calls) the
//!   fencing check against the lease table.
//! - A failed call changes nothing: no state, no version, no event.
//! - Event ids are strictly increasing in commit order, so `after_id` paging
//!   (and `events --follow`) never skips a row.
//! - A sandbox handed out by [`Registry::claim_sandbox`] stays marked as a
//!   pool hand-out; [`Registry::list_pool_handouts`] lists it until it is
//!   `Terminated`.
//!
//! Concurrency: backends are `Send + Sync` and safe to call from many tasks;
//! lost updates are prevented by `expected_version` ([`RegistryError::Conflict`]),
//! not by locks held across calls.
#![forbid(unsafe_code)]

pub mod conformance;
pub mod memory;
mod records;

pub use memory::MemoryRegistry;
pub use records::*;

use async_trait::async_trait;
use aviary_core::{ErrorCode, LeaseToken, SandboxId, SandboxState, StateError};
use aviary_leases::LeaseError;
use std::collections::BTreeMap;
use time::OffsetDateTime;

/// Whether a transition is fenced by the sandbox's lease.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FenceCheck {
    /// System-initiated (reconciler, expiry, pool manager): no fencing.
    Skip,
    /// Client-initiated: the call's token must pass the lease check
    /// ([`aviary_leases::LeaseStore::check`] rules, against the wall clock).
    Require(Option<LeaseToken>),
    /// Client-initiated, with the lease checked by the caller against the
    /// coordination store: the write is valid only while the sandbox's
    /// durable fencing counter is still `seen` (checked in the same write,
    /// [`aviary_leases::counter_rule`]). A lease granted since is refused
    /// as `StaleToken` (`leased`) or `LeaseRequired`.
    Counter { seen: u64, leased: bool },
}

impl FenceCheck {
    /// The [`FenceCheck::Counter`] for the outcome of a lease check.
    pub fn after(fence: aviary_leases::Fence, counter: u64) -> FenceCheck {
        match fence {
            aviary_leases::Fence::Leased(t) => FenceCheck::Counter {
                seen: t.fence(),
                leased: true,
            },
            aviary_leases::Fence::Unleased => FenceCheck::Counter {
                seen: counter,
                leased: false,
            },
        }
    }
}

/// What a state change records besides the states themselves.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TransitionCtx {
    pub request_id: Option<String>,
    /// Event type of the rows written; `"state_changed"` when `None`
    /// (`"created"` for [`Registry::insert_sandbox`]).
    pub event_type: Option<String>,
    /// Stored on every event row written; `Null` is stored as `{}`.
    pub metadata: serde_json::Value,
}

impl TransitionCtx {
    pub fn request(request_id: impl Into<String>) -> Self {
        TransitionCtx {
            request_id: Some(request_id.into()),
            ..Self::default()
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RegistryError {
    #[error("not found")]
    NotFound,
    /// `expected_version` did not match the row; re-read and retry.
    #[error("version conflict")]
    Conflict,
    #[error(transparent)]
    IllegalTransition(StateError),
    #[error("sandbox is leased; the call needs its token")]
    LeaseRequired,
    #[error("stale lease token")]
    StaleToken,
    /// A row with this key already exists.
    #[error("already exists")]
    Duplicate,
    /// The backing store failed; the message is for the server log.
    #[error("registry storage: {0}")]
    Storage(String),
    /// The backing service cannot be reached (down, restarting,
    /// partitioned): nothing was changed and the call may be retried.
    #[error("registry unavailable: {0}")]
    Unavailable(String),
}

impl RegistryError {
    /// The stable API error code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            RegistryError::NotFound => ErrorCode::NotFound,
            RegistryError::Conflict | RegistryError::Duplicate => ErrorCode::Conflict,
            RegistryError::IllegalTransition(_) => ErrorCode::InvalidState,
            RegistryError::LeaseRequired => ErrorCode::LeaseRequired,
            RegistryError::StaleToken => ErrorCode::StaleToken,
            RegistryError::Storage(_) => ErrorCode::Internal,
            RegistryError::Unavailable(_) => ErrorCode::Unavailable,
        }
    }
}

impl From<LeaseError> for RegistryError {
    fn from(e: LeaseError) -> Self {
        match e {
            LeaseError::NotFound => RegistryError::NotFound,
            LeaseError::LeaseRequired => RegistryError::LeaseRequired,
            LeaseError::StaleToken => RegistryError::StaleToken,
            // a held lease or a bad ttl never comes out of a fencing check
            LeaseError::Held { .. } | LeaseError::InvalidTtl => {
                RegistryError::Storage(e.to_string())
            }
            LeaseError::Storage(m) => RegistryError::Storage(m),
            LeaseError::Unavailable(m) => RegistryError::Unavailable(m),
        }
    }
}

/// Default and maximum of a `limit` argument (`0` means the default).
pub const DEFAULT_LIMIT: u32 = 100;
pub const MAX_LIMIT: u32 = 10_000;

/// `limit` as backends apply it: `0` → [`DEFAULT_LIMIT`], capped at [`MAX_LIMIT`].
pub fn effective_limit(limit: u32) -> u32 {
    match limit {
        0 => DEFAULT_LIMIT,
        n => n.min(MAX_LIMIT),
    }
}

/// Checks that `path`, walked from `from`, only takes legal steps.
pub fn validate_path(from: SandboxState, path: &[SandboxState]) -> Result<(), RegistryError> {
    let mut cur = from;
    for &next in path {
        cur = cur
            .transition(next)
            .map_err(RegistryError::IllegalTransition)?;
    }
    Ok(())
}

#[async_trait]
pub trait Registry: Send + Sync {
    /// Inserts a sandbox in state `Requested`, version 0, and writes its
    /// `"created"` event (`ctx.event_type` overrides the name). A second
    /// insert with the same id is `Duplicate`.
    async fn insert_sandbox(
        &self,
        new: &NewSandbox,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError>;

    async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxRecord, RegistryError>;

    /// Sandboxes oldest first, of one tenant or all; `Terminated` ones only
    /// when `include_terminated`.
    async fn list_sandboxes(
        &self,
        tenant: Option<&str>,
        include_terminated: bool,
    ) -> Result<Vec<SandboxRecord>, RegistryError>;

    /// The live (not `Terminated`) sandboxes of one tenant or all, summed by
    /// node and state: what the quota check and the scheduler read on every
    /// create. Its cost is a scan of the live index, never a decode of every
    /// row (this default does the decode; the SQL registries aggregate).
    async fn live_totals(&self, tenant: Option<&str>) -> Result<Vec<LiveTotal>, RegistryError> {
        Ok(LiveTotal::sum(&self.list_sandboxes(tenant, false).await?))
    }

    /// Walks `path` (each step must be legal per
    /// [`SandboxState::can_transition_to`], starting from the current state)
    /// in ONE transaction: checks `version == expected_version` (else
    /// `Conflict`), checks the fence against the lease table in the same
    /// transaction when [`FenceCheck::Require`], writes one event row per
    /// step (`"state_changed"` unless `ctx` says otherwise), bumps `version`
    /// once per step, sets `last_active_at`, and returns the new record. An
    /// empty path only performs the checks. Errors are checked in the order
    /// `NotFound`, `Conflict`, fence, `IllegalTransition`.
    async fn transition(
        &self,
        id: &SandboxId,
        expected_version: i64,
        path: &[SandboxState],
        fence: FenceCheck,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError>;

    /// Hands a warm pooled sandbox (state `Ready`, tenant [`POOL_TENANT`]) to
    /// its owner: sets the owner fields and moves `Ready → Locking` in one
    /// transaction, with one event. `Conflict` when the version moved or the
    /// sandbox is no longer an unowned `Ready` one, so a pooled sandbox is
    /// never handed out twice.
    async fn claim_sandbox(
        &self,
        id: &SandboxId,
        expected_version: i64,
        claim: &SandboxClaim,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError>;

    /// Records where the sandbox's compute runs; bumps `version`.
    async fn set_runtime_instance(
        &self,
        id: &SandboxId,
        expected_version: i64,
        runtime_instance_id: &str,
        node: &str,
    ) -> Result<SandboxRecord, RegistryError>;

    /// Marks the sandbox tainted (never reused again) or clears the mark;
    /// bumps `version`.
    async fn set_tainted(
        &self,
        id: &SandboxId,
        expected_version: i64,
        tainted: bool,
    ) -> Result<SandboxRecord, RegistryError>;

    /// Records that the sandbox is paused (frozen) or not; bumps `version`.
    async fn set_paused(
        &self,
        id: &SandboxId,
        expected_version: i64,
        paused: bool,
    ) -> Result<SandboxRecord, RegistryError>;

    /// Sets (or clears) when the sandbox expires; bumps `version`.
    async fn set_expiry(
        &self,
        id: &SandboxId,
        expected_version: i64,
        expires_at: Option<OffsetDateTime>,
    ) -> Result<SandboxRecord, RegistryError>;

    /// The server secret named `name`: the stored one, or `candidate`
    /// stored now when there is none yet (first writer wins, so every
    /// replica sharing the registry gets the same value).
    async fn server_secret(&self, name: &str, candidate: &str) -> Result<String, RegistryError>;

    /// Sets `last_active_at`; no version bump, no event.
    async fn touch(&self, id: &SandboxId, now: OffsetDateTime) -> Result<(), RegistryError>;

    /// Appends an event (any kind: lease grants, planner decisions, policy
    /// denials…) and returns its id.
    async fn append_event(&self, ev: NewEvent) -> Result<i64, RegistryError>;

    /// Events in id order matching the filter.
    async fn list_events(
        &self,
        filter: &EventFilter,
    ) -> Result<Vec<aviary_core::api::Event>, RegistryError>;

    /// Inserts or replaces the template of this name.
    async fn upsert_template(&self, t: &TemplateRecord) -> Result<(), RegistryError>;
    /// Templates by name.
    async fn list_templates(&self) -> Result<Vec<TemplateRecord>, RegistryError>;

    /// Inserts or replaces the node of this id.
    async fn upsert_node(&self, n: &NodeRecord) -> Result<(), RegistryError>;
    /// Nodes by id.
    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, RegistryError>;

    /// Stores a key (by hash) for a tenant, creating the tenant row if
    /// missing. The same hash twice is `Duplicate`.
    async fn insert_api_key(
        &self,
        key_hash: &str,
        tenant: &str,
        admin: bool,
    ) -> Result<(), RegistryError>;
    /// The key with this hash, unless it was revoked: a revoked key is
    /// `None` here, exactly like an unknown one.
    async fn find_api_key(&self, key_hash: &str) -> Result<Option<ApiKeyRecord>, RegistryError>;
    /// Every key, revoked ones included, in the order they were created.
    async fn list_api_keys(&self) -> Result<Vec<ApiKeyRecord>, RegistryError>;
    /// Revokes the key with this id at `at` and returns it; revoking a revoked
    /// key keeps its first `revoked_at`. An unknown id is `NotFound`.
    async fn revoke_api_key(
        &self,
        id: &str,
        at: OffsetDateTime,
    ) -> Result<ApiKeyRecord, RegistryError>;

    /// Records a planner decision; `a.id` and `a.usage` are ignored. Returns
    /// the new id.
    async fn insert_allocation(&self, a: &AllocationRecord) -> Result<i64, RegistryError>;
    /// Stores what the sandbox really used (at release).
    async fn update_allocation_usage(
        &self,
        id: i64,
        usage: &AllocationUsage,
    ) -> Result<(), RegistryError>;
    /// Allocations newest first.
    async fn list_allocations(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<AllocationRecord>, RegistryError>;

    /// Inserts or replaces the environment manifest of a sandbox (which must
    /// exist, else `NotFound`).
    async fn upsert_environment(&self, e: &EnvironmentRecord) -> Result<(), RegistryError>;
    async fn get_environment(
        &self,
        id: &SandboxId,
    ) -> Result<Option<EnvironmentRecord>, RegistryError>;

    /// The projection index of a sandbox (sandbox path → SHA-256 of what
    /// the last successful projection sync put there); `None` when no sync
    /// succeeded or its index was dropped.
    async fn get_projection_index(
        &self,
        id: &SandboxId,
    ) -> Result<Option<BTreeMap<String, String>>, RegistryError>;
    /// Stores (replaces) the projection index of a sandbox (which must
    /// exist, else `NotFound`).
    async fn put_projection_index(
        &self,
        id: &SandboxId,
        files: &BTreeMap<String, String>,
    ) -> Result<(), RegistryError>;
    /// Drops the projection index of a sandbox (none is fine): the next
    /// sync uploads everything.
    async fn delete_projection_index(&self, id: &SandboxId) -> Result<(), RegistryError>;

    /// Stores a snapshot's index entry and returns it as stored (times at
    /// the backend's precision). The same id twice is `Duplicate`.
    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<SnapshotRecord, RegistryError>;
    /// The snapshot with this id, of any tenant (`NotFound` when none).
    async fn get_snapshot(&self, id: &str) -> Result<SnapshotRecord, RegistryError>;
    /// Snapshots matching the filter, oldest first (equal times in the order
    /// they were inserted).
    async fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
    ) -> Result<Vec<SnapshotRecord>, RegistryError>;
    /// The newest snapshot of a tenant's sandbox, if it has any.
    async fn latest_snapshot(
        &self,
        tenant: &str,
        sandbox: &SandboxId,
    ) -> Result<Option<SnapshotRecord>, RegistryError>;
    /// Removes a snapshot's index entry (`NotFound` when none). The chunk
    /// store's manifests are the caller's to delete.
    async fn delete_snapshot(&self, id: &str) -> Result<(), RegistryError>;

    /// Inserts or replaces the pool bounds of this class.
    async fn set_pool_bounds(&self, b: &PoolBoundsRecord) -> Result<(), RegistryError>;
    /// Pool bounds by class.
    async fn list_pool_bounds(&self) -> Result<Vec<PoolBoundsRecord>, RegistryError>;
    /// Sandboxes [`Registry::claim_sandbox`] handed out of a warm pool that
    /// are not `Terminated`, in the order they were claimed. A pool counts
    /// its hand-outs from here, so the count ends with the sandbox and
    /// survives restarts.
    async fn list_pool_handouts(&self) -> Result<Vec<SandboxRecord>, RegistryError>;

    /// Inserts or replaces the node agent registration of this id.
    async fn upsert_node_registration(&self, n: &NodeRegistration) -> Result<(), RegistryError>;
    /// Node agent registrations by id.
    async fn list_node_registrations(&self) -> Result<Vec<NodeRegistration>, RegistryError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::SandboxState::*;

    #[test]
    fn validate_path_names_the_first_illegal_step() {
        validate_path(Requested, &[Planning, Allocating, Provisioning, Locking]).unwrap();
        validate_path(Idle, &[]).unwrap();
        assert_eq!(
            validate_path(Requested, &[Planning, Running, Idle]).unwrap_err(),
            RegistryError::IllegalTransition(StateError::IllegalTransition {
                from: Planning,
                to: Running
            })
        );
        assert_eq!(
            validate_path(Idle, &[Idle]).unwrap_err(),
            RegistryError::IllegalTransition(StateError::IllegalTransition {
                from: Idle,
                to: Idle
            })
        );
    }

    #[test]
    fn limits_default_and_cap() {
        assert_eq!(effective_limit(0), DEFAULT_LIMIT);
        assert_eq!(effective_limit(7), 7);
        assert_eq!(effective_limit(u32::MAX), MAX_LIMIT);
    }

    #[test]
    fn lease_errors_map_to_registry_errors() {
        assert_eq!(
            RegistryError::from(LeaseError::NotFound),
            RegistryError::NotFound
        );
        assert_eq!(
            RegistryError::from(LeaseError::LeaseRequired),
            RegistryError::LeaseRequired
        );
        assert_eq!(
            RegistryError::from(LeaseError::StaleToken),
            RegistryError::StaleToken
        );
        assert_eq!(
            RegistryError::from(LeaseError::Storage("disk".into())),
            RegistryError::Storage("disk".into())
        );
    }

    #[test]
    fn error_codes_are_stable() {
        assert_eq!(RegistryError::Conflict.code(), ErrorCode::Conflict);
        assert_eq!(RegistryError::StaleToken.code(), ErrorCode::StaleToken);
        assert_eq!(
            RegistryError::LeaseRequired.code(),
            ErrorCode::LeaseRequired
        );
        assert_eq!(
            RegistryError::IllegalTransition(StateError::IllegalTransition {
                from: Terminated,
                to: Idle
            })
            .code(),
            ErrorCode::InvalidState
        );
        assert_eq!(
            RegistryError::Storage("x".into()).code(),
            ErrorCode::Internal
        );
    }

    #[test]
    fn sandbox_record_round_trips_and_maps_to_api() {
        let new = conformance::sample_sandbox("acme");
        let now = time::macros::datetime!(2030-01-01 0:00 UTC);
        let rec = SandboxRecord {
            id: new.id.clone(),
            tenant: new.tenant,
            user_id: new.user_id,
            session_id: new.session_id,
            agent: new.agent,
            scope: new.scope,
            resource_class: new.resource_class,
            resources: new.resources,
            template: new.template,
            template_digest: new.template_digest,
            runtime: new.runtime,
            runtime_instance_id: Some("ctr-1".into()),
            node: new.node,
            network_profile: new.network_profile,
            state: Leased,
            created_at: now,
            last_active_at: now,
            expires_at: None,
            version: 3,
            tainted: true,
            user_managed: false,
            paused: false,
            metadata: Default::default(),
            env: Default::default(),
            run_as: Default::default(),
            workdir: Default::default(),
        };
        let json = serde_json::to_string(&rec).unwrap();
        let back: SandboxRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, rec);
        let api = rec.to_api(Some("agent-1".into()));
        assert_eq!(api.id, rec.id);
        assert_eq!(api.state, Leased);
        assert_eq!(api.version, 3);
        assert!(api.tainted);
        assert_eq!(api.resources, rec.resources);
        assert_eq!(api.lease_owner.as_deref(), Some("agent-1"));
        let api_json = serde_json::to_value(rec.to_api(None)).unwrap();
        assert!(api_json.get("lease_owner").is_none());
        assert_eq!(api_json["created_at"], "2030-01-01T00:00:00Z");
    }

    #[test]
    fn api_key_debug_hides_the_hash() {
        let k = ApiKeyRecord {
            id: "key-1".into(),
            key_hash: "deadbeef".into(),
            tenant: "acme".into(),
            admin: true,
            created_at: time::macros::datetime!(2030-01-01 0:00 UTC),
            revoked_at: None,
        };
        let shown = format!("{k:?}");
        assert!(!shown.contains("deadbeef"), "{shown}");
        assert!(shown.contains("acme"));
    }
}
