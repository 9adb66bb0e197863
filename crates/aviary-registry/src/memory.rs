//! [`MemoryRegistry`]: the registry and the lease store in one mutex-guarded
//! state, the test double at the registry seam (no root, no SQLite, no files).
//!
//! It keeps the invariants of the crate docs and of [`aviary_leases`] the way
//! `aviary-registry-sqlite` does: a sandbox's lease and fencing counter live
//! on its row, so a fenced [`Registry::transition`] reads the live lease in
//! the same critical section that writes the state; every call checks
//! everything before it writes anything, so a failed call changes nothing;
//! times are stored at microsecond precision, like the SQL backends, so code
//! under test sees the values it would see on them. Clones share one state,
//! so "restarting" the registry is cloning it; nothing survives the process.
//!
//! Concurrency: every call takes one [`std::sync::Mutex`] for its whole body
//! (the body never awaits), which makes each call one transaction.

use crate::*;
use aviary_core::api::Event;
use aviary_leases::{expiry, Fence, Lease, LeaseSlot, LeaseStore};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// An in-memory [`Registry`] that is also the [`LeaseStore`] of its sandboxes.
#[derive(Clone, Default)]
pub struct MemoryRegistry {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the state holds secrets (lease tokens, node agent tokens)
        f.debug_struct("MemoryRegistry").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    sandboxes: BTreeMap<SandboxId, SandboxRow>,
    events: EventLog,
    /// Orders rows that tie on a timestamp (SQL's `rowid`) and pool claims.
    order: Order,
    templates: BTreeMap<String, TemplateRecord>,
    nodes: BTreeMap<String, NodeRecord>,
    /// In the order they were created.
    api_keys: Vec<ApiKeyRecord>,
    /// Oldest first; ids are positions + 1.
    allocations: Vec<AllocationRecord>,
    environments: BTreeMap<SandboxId, EnvironmentRecord>,
    projections: BTreeMap<SandboxId, BTreeMap<String, String>>,
    snapshots: BTreeMap<String, SnapshotRow>,
    pool_bounds: BTreeMap<String, PoolBoundsRecord>,
    node_registrations: BTreeMap<String, NodeRegistration>,
    secrets: BTreeMap<String, String>,
}

struct SandboxRow {
    record: SandboxRecord,
    /// Insertion order, for `created_at` ties.
    order: u64,
    /// Set by [`Registry::claim_sandbox`]: the sandbox is a pool hand-out,
    /// listed in this order.
    claimed: Option<u64>,
    /// The lease and the highest fence ever granted (the lease store's
    /// rules, shared with `MemoryLeaseStore`).
    lease: LeaseSlot,
}

struct SnapshotRow {
    record: SnapshotRecord,
    /// Insertion order, for `created_at` ties.
    order: u64,
}

#[derive(Default)]
struct Order(u64);

impl Order {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
}

#[derive(Default)]
struct EventLog {
    /// In id order.
    rows: Vec<Event>,
    last_id: i64,
}

impl EventLog {
    fn append(&mut self, ev: NewEvent, at: OffsetDateTime) -> i64 {
        self.last_id += 1;
        self.rows.push(Event {
            id: self.last_id,
            sandbox_id: ev.sandbox_id,
            tenant: ev.tenant,
            event_type: ev.event_type,
            old_state: ev.old_state,
            new_state: ev.new_state,
            request_id: ev.request_id,
            timestamp: at,
            metadata: stored_json(ev.metadata),
        });
        self.last_id
    }
}

/// JSON as the SQL backends store it: `null` becomes `{}`.
fn stored_json(v: serde_json::Value) -> serde_json::Value {
    if v.is_null() {
        serde_json::Value::Object(serde_json::Map::new())
    } else {
        v
    }
}

/// `t` at the stored precision (microseconds).
fn truncate(t: OffsetDateTime) -> OffsetDateTime {
    let nanos = t.nanosecond();
    t.replace_nanosecond(nanos - nanos % 1000).unwrap_or(t)
}

fn limit_of(limit: u32) -> usize {
    usize::try_from(effective_limit(limit)).unwrap_or(usize::MAX)
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every call checks before it writes and nothing between its first
        // write and the unlock can fail, so a panic never leaves a
        // half-written state behind and a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A single-row update under `expected_version` that bumps it by one.
    fn update_versioned(
        &self,
        id: &SandboxId,
        expected_version: i64,
        update: impl FnOnce(&mut SandboxRecord),
    ) -> Result<SandboxRecord, RegistryError> {
        let mut state = self.lock();
        let row = state.sandboxes.get_mut(id).ok_or(RegistryError::NotFound)?;
        if row.record.version != expected_version {
            return Err(RegistryError::Conflict);
        }
        update(&mut row.record);
        row.record.version += 1;
        Ok(row.record.clone())
    }
}

#[async_trait]
impl Registry for MemoryRegistry {
    async fn insert_sandbox(
        &self,
        new: &NewSandbox,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.sandboxes.contains_key(&new.id) {
            return Err(RegistryError::Duplicate);
        }
        let new = new.clone();
        let record = SandboxRecord {
            id: new.id,
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
            runtime_instance_id: new.runtime_instance_id,
            node: new.node,
            network_profile: new.network_profile,
            state: SandboxState::Requested,
            created_at: now,
            last_active_at: now,
            expires_at: new.expires_at.map(truncate),
            version: 0,
            tainted: new.tainted,
            user_managed: new.user_managed,
            paused: false,
            metadata: new.metadata,
            env: new.env,
            workdir: new.workdir,
            run_as: new.run_as,
        };
        state.events.append(
            NewEvent {
                sandbox_id: Some(record.id.clone()),
                tenant: record.tenant.clone(),
                event_type: ctx.event_type.unwrap_or_else(|| "created".to_owned()),
                old_state: None,
                new_state: Some(SandboxState::Requested),
                request_id: ctx.request_id,
                metadata: ctx.metadata,
            },
            now,
        );
        let row = SandboxRow {
            record: record.clone(),
            order: state.order.next(),
            claimed: None,
            lease: LeaseSlot::default(),
        };
        state.sandboxes.insert(record.id.clone(), row);
        Ok(record)
    }

    async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxRecord, RegistryError> {
        let state = self.lock();
        let row = state.sandboxes.get(id).ok_or(RegistryError::NotFound)?;
        Ok(row.record.clone())
    }

    async fn list_sandboxes(
        &self,
        tenant: Option<&str>,
        include_terminated: bool,
    ) -> Result<Vec<SandboxRecord>, RegistryError> {
        let state = self.lock();
        let mut rows: Vec<&SandboxRow> = state
            .sandboxes
            .values()
            .filter(|r| tenant.is_none_or(|t| r.record.tenant == t))
            .filter(|r| include_terminated || r.record.state != SandboxState::Terminated)
            .collect();
        rows.sort_by_key(|r| (r.record.created_at, r.order));
        Ok(rows.into_iter().map(|r| r.record.clone()).collect())
    }

    async fn transition(
        &self,
        id: &SandboxId,
        expected_version: i64,
        path: &[SandboxState],
        fence: FenceCheck,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let mut guard = self.lock();
        let State {
            sandboxes, events, ..
        } = &mut *guard;
        let row = sandboxes.get_mut(id).ok_or(RegistryError::NotFound)?;
        if row.record.version != expected_version {
            return Err(RegistryError::Conflict);
        }
        // the live lease is read under the lock that writes the state
        match fence {
            FenceCheck::Skip => {}
            FenceCheck::Require(token) => {
                row.lease.check(token, now)?;
            }
            FenceCheck::Counter { seen, leased } => {
                aviary_leases::counter_rule(row.lease.counter(), seen, leased)?;
            }
        }
        let from = row.record.state;
        validate_path(from, path)?;
        let Some(&last) = path.last() else {
            return Ok(row.record.clone());
        };
        let steps = i64::try_from(path.len())
            .map_err(|_| RegistryError::Storage("path too long".into()))?;
        row.record.state = last;
        row.record.version += steps;
        row.record.last_active_at = now;
        let event_type = ctx.event_type.as_deref().unwrap_or("state_changed");
        let olds = std::iter::once(from).chain(path.iter().copied());
        for (old, new) in olds.zip(path.iter().copied()) {
            events.append(
                NewEvent {
                    sandbox_id: Some(id.clone()),
                    tenant: row.record.tenant.clone(),
                    event_type: event_type.to_owned(),
                    old_state: Some(old),
                    new_state: Some(new),
                    request_id: ctx.request_id.clone(),
                    metadata: ctx.metadata.clone(),
                },
                now,
            );
        }
        Ok(row.record.clone())
    }

    async fn claim_sandbox(
        &self,
        id: &SandboxId,
        expected_version: i64,
        claim: &SandboxClaim,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let mut guard = self.lock();
        let State {
            sandboxes,
            events,
            order,
            ..
        } = &mut *guard;
        let row = sandboxes.get_mut(id).ok_or(RegistryError::NotFound)?;
        let r = &row.record;
        if r.version != expected_version
            || r.state != SandboxState::Ready
            || r.tenant != POOL_TENANT
            || r.tainted
        {
            return Err(RegistryError::Conflict);
        }
        validate_path(r.state, &[SandboxState::Locking])?;
        let claim = claim.clone();
        let r = &mut row.record;
        r.tenant = claim.tenant;
        r.user_id = claim.user_id;
        r.session_id = claim.session_id;
        r.agent = claim.agent;
        r.scope = claim.scope;
        r.expires_at = claim.expires_at.map(truncate);
        r.user_managed = claim.user_managed;
        r.metadata = claim.metadata;
        r.env = claim.env;
        r.workdir = claim.workdir;
        r.run_as = claim.run_as;
        r.state = SandboxState::Locking;
        r.version += 1;
        r.last_active_at = now;
        row.claimed = Some(order.next());
        events.append(
            NewEvent {
                sandbox_id: Some(id.clone()),
                tenant: row.record.tenant.clone(),
                event_type: ctx.event_type.unwrap_or_else(|| "pool_claimed".to_owned()),
                old_state: Some(SandboxState::Ready),
                new_state: Some(SandboxState::Locking),
                request_id: ctx.request_id,
                metadata: ctx.metadata,
            },
            now,
        );
        Ok(row.record.clone())
    }

    async fn set_runtime_instance(
        &self,
        id: &SandboxId,
        expected_version: i64,
        runtime_instance_id: &str,
        node: &str,
    ) -> Result<SandboxRecord, RegistryError> {
        self.update_versioned(id, expected_version, |r| {
            r.runtime_instance_id = Some(runtime_instance_id.to_owned());
            node.clone_into(&mut r.node);
        })
    }

    async fn set_tainted(
        &self,
        id: &SandboxId,
        expected_version: i64,
        tainted: bool,
    ) -> Result<SandboxRecord, RegistryError> {
        self.update_versioned(id, expected_version, |r| r.tainted = tainted)
    }

    async fn set_paused(
        &self,
        id: &SandboxId,
        expected_version: i64,
        paused: bool,
    ) -> Result<SandboxRecord, RegistryError> {
        self.update_versioned(id, expected_version, |r| r.paused = paused)
    }

    async fn set_expiry(
        &self,
        id: &SandboxId,
        expected_version: i64,
        expires_at: Option<OffsetDateTime>,
    ) -> Result<SandboxRecord, RegistryError> {
        self.update_versioned(id, expected_version, |r| {
            r.expires_at = expires_at.map(truncate)
        })
    }

    async fn server_secret(&self, name: &str, candidate: &str) -> Result<String, RegistryError> {
        let mut state = self.lock();
        Ok(state
            .secrets
            .entry(name.to_owned())
            .or_insert_with(|| candidate.to_owned())
            .clone())
    }

    async fn touch(&self, id: &SandboxId, now: OffsetDateTime) -> Result<(), RegistryError> {
        let mut state = self.lock();
        let row = state.sandboxes.get_mut(id).ok_or(RegistryError::NotFound)?;
        row.record.last_active_at = truncate(now);
        Ok(())
    }

    async fn append_event(&self, ev: NewEvent) -> Result<i64, RegistryError> {
        let now = truncate(aviary_core::now());
        Ok(self.lock().events.append(ev, now))
    }

    async fn list_events(&self, filter: &EventFilter) -> Result<Vec<Event>, RegistryError> {
        let state = self.lock();
        let rows = &state.events.rows;
        let after = filter.after_id.unwrap_or(0);
        let start = rows.partition_point(|e| e.id <= after);
        let matching: Vec<&Event> = rows[start..]
            .iter()
            .filter(|e| filter.tenant.as_ref().is_none_or(|t| &e.tenant == t))
            .filter(|e| {
                filter
                    .sandbox_id
                    .as_ref()
                    .is_none_or(|s| e.sandbox_id.as_ref() == Some(s))
            })
            .collect();
        let limit = limit_of(filter.limit);
        let skip = if filter.newest {
            matching.len().saturating_sub(limit)
        } else {
            0
        };
        Ok(matching
            .into_iter()
            .skip(skip)
            .take(limit)
            .cloned()
            .collect())
    }

    async fn upsert_template(&self, t: &TemplateRecord) -> Result<(), RegistryError> {
        let mut t = t.clone();
        t.created_at = truncate(t.created_at);
        self.lock().templates.insert(t.name.clone(), t);
        Ok(())
    }

    async fn list_templates(&self) -> Result<Vec<TemplateRecord>, RegistryError> {
        Ok(self.lock().templates.values().cloned().collect())
    }

    async fn upsert_node(&self, n: &NodeRecord) -> Result<(), RegistryError> {
        let mut n = n.clone();
        n.last_seen = truncate(n.last_seen);
        self.lock().nodes.insert(n.id.clone(), n);
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, RegistryError> {
        Ok(self.lock().nodes.values().cloned().collect())
    }

    async fn insert_api_key(
        &self,
        key_hash: &str,
        tenant: &str,
        admin: bool,
    ) -> Result<(), RegistryError> {
        let now = truncate(aviary_core::now());
        let mut state = self.lock();
        // revoked keys keep their hash: it can never be registered again
        if state.api_keys.iter().any(|k| k.key_hash == key_hash) {
            return Err(RegistryError::Duplicate);
        }
        state.api_keys.push(ApiKeyRecord {
            id: aviary_core::new_id("key"),
            key_hash: key_hash.to_owned(),
            tenant: tenant.to_owned(),
            admin,
            created_at: now,
            revoked_at: None,
        });
        Ok(())
    }

    async fn find_api_key(&self, key_hash: &str) -> Result<Option<ApiKeyRecord>, RegistryError> {
        let state = self.lock();
        Ok(state
            .api_keys
            .iter()
            .find(|k| k.key_hash == key_hash && k.revoked_at.is_none())
            .cloned())
    }

    async fn list_api_keys(&self) -> Result<Vec<ApiKeyRecord>, RegistryError> {
        Ok(self.lock().api_keys.clone())
    }

    async fn revoke_api_key(
        &self,
        id: &str,
        at: OffsetDateTime,
    ) -> Result<ApiKeyRecord, RegistryError> {
        let mut state = self.lock();
        let key = state
            .api_keys
            .iter_mut()
            .find(|k| k.id == id)
            .ok_or(RegistryError::NotFound)?;
        key.revoked_at.get_or_insert(truncate(at));
        Ok(key.clone())
    }

    async fn insert_allocation(&self, a: &AllocationRecord) -> Result<i64, RegistryError> {
        let mut state = self.lock();
        let id = i64::try_from(state.allocations.len() + 1)
            .map_err(|_| RegistryError::Storage("too many allocations".into()))?;
        let mut a = a.clone();
        a.id = Some(id);
        a.usage = None;
        a.created_at = truncate(a.created_at);
        state.allocations.push(a);
        Ok(id)
    }

    async fn update_allocation_usage(
        &self,
        id: i64,
        usage: &AllocationUsage,
    ) -> Result<(), RegistryError> {
        let mut state = self.lock();
        let a = usize::try_from(id)
            .ok()
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| state.allocations.get_mut(i))
            .ok_or(RegistryError::NotFound)?;
        a.usage = Some(usage.clone());
        Ok(())
    }

    async fn list_allocations(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<AllocationRecord>, RegistryError> {
        let state = self.lock();
        Ok(state
            .allocations
            .iter()
            .rev()
            .filter(|a| tenant.is_none_or(|t| a.tenant == t))
            .take(limit_of(limit))
            .cloned()
            .collect())
    }

    async fn upsert_environment(&self, e: &EnvironmentRecord) -> Result<(), RegistryError> {
        let mut state = self.lock();
        if !state.sandboxes.contains_key(&e.sandbox_id) {
            return Err(RegistryError::NotFound);
        }
        let mut e = e.clone();
        e.manifest = stored_json(e.manifest);
        state.environments.insert(e.sandbox_id.clone(), e);
        Ok(())
    }

    async fn get_projection_index(
        &self,
        id: &SandboxId,
    ) -> Result<Option<BTreeMap<String, String>>, RegistryError> {
        Ok(self.lock().projections.get(id).cloned())
    }

    async fn put_projection_index(
        &self,
        id: &SandboxId,
        files: &BTreeMap<String, String>,
    ) -> Result<(), RegistryError> {
        let mut state = self.lock();
        if !state.sandboxes.contains_key(id) {
            return Err(RegistryError::NotFound);
        }
        state.projections.insert(id.clone(), files.clone());
        Ok(())
    }

    async fn delete_projection_index(&self, id: &SandboxId) -> Result<(), RegistryError> {
        self.lock().projections.remove(id);
        Ok(())
    }

    async fn get_environment(
        &self,
        id: &SandboxId,
    ) -> Result<Option<EnvironmentRecord>, RegistryError> {
        Ok(self.lock().environments.get(id).cloned())
    }

    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<SnapshotRecord, RegistryError> {
        let mut state = self.lock();
        if state.snapshots.contains_key(&s.id) {
            return Err(RegistryError::Duplicate);
        }
        let mut record = s.clone();
        record.created_at = truncate(s.created_at);
        let row = SnapshotRow {
            record: record.clone(),
            order: state.order.next(),
        };
        state.snapshots.insert(record.id.clone(), row);
        Ok(record)
    }

    async fn get_snapshot(&self, id: &str) -> Result<SnapshotRecord, RegistryError> {
        let state = self.lock();
        let row = state.snapshots.get(id).ok_or(RegistryError::NotFound)?;
        Ok(row.record.clone())
    }

    async fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
    ) -> Result<Vec<SnapshotRecord>, RegistryError> {
        let state = self.lock();
        let mut rows: Vec<&SnapshotRow> = state
            .snapshots
            .values()
            .filter(|r| filter.tenant.as_ref().is_none_or(|t| &r.record.tenant == t))
            .filter(|r| {
                filter
                    .sandbox_id
                    .as_ref()
                    .is_none_or(|s| &r.record.sandbox_id == s)
            })
            .filter(|r| filter.label.as_ref().is_none_or(|l| &r.record.label == l))
            .collect();
        rows.sort_by_key(|r| (r.record.created_at, r.order));
        Ok(rows.into_iter().map(|r| r.record.clone()).collect())
    }

    async fn latest_snapshot(
        &self,
        tenant: &str,
        sandbox: &SandboxId,
    ) -> Result<Option<SnapshotRecord>, RegistryError> {
        let state = self.lock();
        Ok(state
            .snapshots
            .values()
            .filter(|r| r.record.tenant == tenant && &r.record.sandbox_id == sandbox)
            .max_by_key(|r| (r.record.created_at, r.order))
            .map(|r| r.record.clone()))
    }

    async fn delete_snapshot(&self, id: &str) -> Result<(), RegistryError> {
        match self.lock().snapshots.remove(id) {
            Some(_) => Ok(()),
            None => Err(RegistryError::NotFound),
        }
    }

    async fn set_pool_bounds(&self, b: &PoolBoundsRecord) -> Result<(), RegistryError> {
        let mut b = b.clone();
        b.updated_at = truncate(b.updated_at);
        self.lock().pool_bounds.insert(b.class.clone(), b);
        Ok(())
    }

    async fn list_pool_bounds(&self) -> Result<Vec<PoolBoundsRecord>, RegistryError> {
        Ok(self.lock().pool_bounds.values().cloned().collect())
    }

    async fn list_pool_handouts(&self) -> Result<Vec<SandboxRecord>, RegistryError> {
        let state = self.lock();
        let mut handouts: Vec<(u64, &SandboxRecord)> = state
            .sandboxes
            .values()
            .filter(|r| r.record.state != SandboxState::Terminated)
            .filter_map(|r| Some((r.claimed?, &r.record)))
            .collect();
        handouts.sort_by_key(|&(claimed, _)| claimed);
        Ok(handouts.into_iter().map(|(_, r)| r.clone()).collect())
    }

    async fn upsert_node_registration(&self, n: &NodeRegistration) -> Result<(), RegistryError> {
        let mut n = n.clone();
        n.registered_at = truncate(n.registered_at);
        self.lock().node_registrations.insert(n.id.clone(), n);
        Ok(())
    }

    async fn list_node_registrations(&self) -> Result<Vec<NodeRegistration>, RegistryError> {
        Ok(self.lock().node_registrations.values().cloned().collect())
    }
}

#[async_trait]
impl LeaseStore for MemoryRegistry {
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let now = truncate(now);
        let expires_at = expiry(now, ttl)?;
        self.slot(sandbox, |s| s.acquire(sandbox, owner, expires_at, now))
    }

    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let now = truncate(now);
        let expires_at = expiry(now, ttl)?;
        self.slot(sandbox, |s| s.renew(token, expires_at, now))
    }

    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        self.slot(sandbox, |s| s.release(token, truncate(now)))
    }

    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        self.slot(sandbox, |s| Ok(s.live(truncate(now)).cloned()))
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        self.slot(sandbox, |s| s.check(token, truncate(now)))
    }

    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        let now = truncate(now);
        Ok(self
            .lock()
            .sandboxes
            .values_mut()
            .filter_map(|r| r.lease.expire(now))
            .collect())
    }

    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        self.slot(sandbox, |s| {
            s.revoke();
            Ok(())
        })
    }
}

#[async_trait]
impl aviary_leases::FenceAuthority for MemoryRegistry {
    async fn next_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        self.slot(sandbox, |s| Ok(s.next_fence()))
    }

    async fn current_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        self.slot(sandbox, |s| Ok(s.counter()))
    }
}

impl MemoryRegistry {
    /// Runs `f` on one sandbox's lease slot under the storage lock.
    fn slot<T>(
        &self,
        sandbox: &SandboxId,
        f: impl FnOnce(&mut LeaseSlot) -> Result<T, LeaseError>,
    ) -> Result<T, LeaseError> {
        let mut state = self.lock();
        let row = state
            .sandboxes
            .get_mut(sandbox)
            .ok_or(LeaseError::NotFound)?;
        f(&mut row.lease)
    }
}
