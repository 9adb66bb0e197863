//! Snapshots, fork, hibernate / wake and the restore branches (DESIGN §3
//! Snapshot store, §5 four-branch restore).
//!
//! A sandbox snapshot is two content-defined, content-addressed tree
//! snapshots in the chunk store — the workspace and the overlay's writable
//! upper layer — plus an index row in the registry (`sandbox_snapshot`,
//! [`aviary_registry::SnapshotRecord`]) tying them to the sandbox, its
//! template and its parent snapshot, so snapshots form a tree. The index row
//! is written after both manifests are stored, so it never names a missing
//! manifest. (Older versions kept the index as `<data>/snapshot-index/*.json`;
//! [`ControlPlane::import_snapshot_index_files`] moves those into the
//! registry once, at start-up.) The sandbox is frozen while its trees are read, so
//! a snapshot is consistent. Unchanged chunks are never written twice, and
//! files unchanged since the parent snapshot are not even read again.
//!
//! The layers are read and written only through the [`LayerArchive`] of
//! the sandbox's node ([`ControlPlane::layers_for`]): for this control
//! plane's own runtimes, their [`Snapshottable`](aviary_runtime::Snapshottable)
//! capability (a snapshot walks the directories of `export_layers`; a
//! restore writes into `stage_layers`, adopted by the runtime's next create,
//! never into a running writable layer, or for the workspace of a live
//! sandbox into `stage_workspace` + `merge_workspace`); for a node agent,
//! the agent does the same on its host and streams the chunks. Where the
//! runtime keeps the layers and whose ids own them is the runtime's
//! business. A runtime or agent without the capability answers
//! `invalid_request`.
//!
//! A *live* fork (`{"live": true}`, runtimes with memory checkpoints only,
//! else 409 `unsupported`) takes no snapshot: the runtime forks the running
//! parent ([`aviary_runtime::Checkpointable::fork_running`]). Fencing choice:
//! the child is a new sandbox with its own lease counter, created unleased,
//! and its envd forgets the fence restored from the parent's memory (the
//! host's SIGHUP; envd ignores signals from inside), so the parent's lease
//! token is refused by the child at both layers, while no fence move (which
//! would end every process) happens at the child's create; its first lease
//! ends the processes like any new lease. Resetting envd's fence keeps the
//! "a new holder starts clean" rule intact and needs no new envd call that a
//! stale host-side holder could use.

use crate::backends::{LayerArchive, RuntimeLayers};
use crate::context::OpContext;
use crate::error::OpError;
use crate::ops::ControlPlane;
use crate::requests::{CheckpointRequest, OnSandbox, SandboxRef, SnapshotQuery};
use crate::taint::TaintCause;
use aviary_core::api::{CreateSandboxRequest, CreateSandboxResponse, Decision, Sandbox};
use aviary_core::{LeaseToken, SandboxId, SandboxState};
use aviary_registry::{FenceCheck, SandboxRecord, SnapshotFilter, SnapshotRecord, TransitionCtx};
use aviary_runtime::Layer;
use aviary_snapshots::{SnapshotId, SnapshotRequest};
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// One sandbox snapshot (a checkpoint).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SandboxSnapshot {
    pub id: String,
    pub tenant: String,
    pub sandbox_id: String,
    /// The snapshot of the same lineage taken before this one.
    pub parent: Option<String>,
    /// Chunk-store manifest of `/workspace`.
    pub workspace_manifest: String,
    /// Chunk-store manifest of the writable layer (everything changed outside `/workspace`).
    pub upper_manifest: String,
    pub template: String,
    pub template_digest: String,
    pub resource_class: String,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: time::OffsetDateTime,
    /// Bytes of files in both trees.
    pub total_bytes: u64,
    /// Chunk bytes this snapshot had to store (the rest was already there).
    pub new_bytes: u64,
    pub label: String,
}

impl From<SnapshotRecord> for SandboxSnapshot {
    fn from(r: SnapshotRecord) -> Self {
        SandboxSnapshot {
            id: r.id,
            tenant: r.tenant,
            sandbox_id: r.sandbox_id.to_string(),
            parent: r.parent,
            workspace_manifest: r.workspace_manifest,
            upper_manifest: r.upper_manifest,
            template: r.template,
            template_digest: r.template_digest,
            resource_class: r.resource_class,
            created_at: r.created_at,
            total_bytes: r.total_bytes,
            new_bytes: r.new_bytes,
            label: r.label,
        }
    }
}

impl SandboxSnapshot {
    /// The registry row of this snapshot; `None` when its sandbox id is
    /// malformed (only a hand-edited index file can have one).
    pub fn to_record(&self) -> Option<SnapshotRecord> {
        Some(SnapshotRecord {
            id: self.id.clone(),
            tenant: self.tenant.clone(),
            sandbox_id: self.sandbox_id.parse().ok()?,
            parent: self.parent.clone(),
            workspace_manifest: self.workspace_manifest.clone(),
            upper_manifest: self.upper_manifest.clone(),
            template: self.template.clone(),
            template_digest: self.template_digest.clone(),
            resource_class: self.resource_class.clone(),
            label: self.label.clone(),
            total_bytes: self.total_bytes,
            new_bytes: self.new_bytes,
            created_at: self.created_at,
            manifest: None,
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotList {
    pub snapshots: Vec<SandboxSnapshot>,
}

/// `POST /v1/sandboxes/{id}/fork`
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Checkpoint to fork from; a fresh snapshot of the sandbox when absent.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// Fork the *running* sandbox with its live processes (their memory,
    /// open files, listening servers) instead of its files only: runtimes
    /// with memory checkpoints (runsc) only, `unsupported` (409) elsewhere.
    /// The child starts unleased; the parent keeps running.
    #[serde(default)]
    pub live: bool,
    /// The lease token as the HTTP body may carry it (else the lease token
    /// header); the HTTP surface moves it into the operation's context,
    /// which is the only token the control plane checks.
    #[serde(default)]
    pub token: Option<LeaseToken>,
}

/// The label of the checkpoint level-2 resets return to and scope reuse forks.
pub(crate) const CLEAN_LABEL: &str = "clean";

/// The label of a checkpoint taken without one.
const DEFAULT_LABEL: &str = "checkpoint";

fn valid_snapshot_id(s: &str) -> Result<(), OpError> {
    if s.is_empty()
        || s.len() > 64
        || !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(OpError::NotFound(format!("snapshot {s:?}")));
    }
    Ok(())
}

impl ControlPlane {
    /// A snapshot of the caller's tenant (others' are `not_found`).
    pub(crate) async fn load_snapshot(
        &self,
        caller_tenant: &str,
        id: &str,
    ) -> Result<SandboxSnapshot, OpError> {
        valid_snapshot_id(id)?;
        match self.registry.get_snapshot(id).await {
            Ok(s) if s.tenant == caller_tenant => Ok(s.into()),
            Ok(_) | Err(aviary_registry::RegistryError::NotFound) => {
                Err(OpError::NotFound(format!("snapshot {id}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The caller's snapshots (of one sandbox, when given), oldest first.
    pub async fn list_snapshots(
        &self,
        cx: &OpContext,
        req: SnapshotQuery,
    ) -> Result<SnapshotList, OpError> {
        let sandbox_id = match req.sandbox.as_deref() {
            // no sandbox has a malformed id, so it has no snapshots either
            Some(s) => match s.parse::<SandboxId>() {
                Ok(id) => Some(id),
                Err(_) => return Ok(SnapshotList { snapshots: vec![] }),
            },
            None => None,
        };
        let rows = self
            .registry
            .list_snapshots(&SnapshotFilter {
                tenant: Some(cx.caller.tenant.clone()),
                sandbox_id,
                label: None,
            })
            .await?;
        Ok(SnapshotList {
            snapshots: rows.into_iter().map(SandboxSnapshot::from).collect(),
        })
    }

    /// The latest snapshot of a sandbox, if any.
    pub(crate) async fn last_snapshot(
        &self,
        tenant: &str,
        sandbox: &SandboxId,
    ) -> Result<Option<SandboxSnapshot>, OpError> {
        Ok(self
            .registry
            .latest_snapshot(tenant, sandbox)
            .await?
            .map(SandboxSnapshot::from))
    }

    /// `POST /v1/sandboxes/{id}/snapshot` (fenced): a checkpoint with a
    /// label (`clean` marks the one level-2 resets return to).
    pub async fn snapshot(
        &self,
        cx: &OpContext,
        req: CheckpointRequest,
    ) -> Result<SandboxSnapshot, OpError> {
        let label = req.label.as_deref().unwrap_or(DEFAULT_LABEL);
        if label.is_empty()
            || label.len() > 32
            || !label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(OpError::InvalidRequest(
                "snapshot label must be 1-32 of [a-z0-9-]".into(),
            ));
        }
        let (rec, live) = self.writable(cx, &req.id).await?;
        if label == CLEAN_LABEL {
            // a clean checkpoint is what scope reuse may fork: it carries
            // the environment it was taken with, probed now
            if let Err(e) = self.refresh_manifest(&rec, &live).await {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "manifest probe before a clean checkpoint failed");
            }
        }
        let snap = self.take_snapshot(&rec, label).await?;
        self.record_event(&rec.tenant, Some(&rec.id), Some(rec.state), "snapshot_taken", cx.request_id(), serde_json::json!({"snapshot": snap.id, "parent": snap.parent, "total_bytes": snap.total_bytes, "new_bytes": snap.new_bytes})).await?;
        Ok(snap)
    }

    /// The layers of the sandbox's node (its own runtimes' or a node
    /// agent's), or a clear refusal of `what` when they cannot be
    /// snapshotted there.
    pub(crate) fn layers_for(
        &self,
        rec: &SandboxRecord,
        what: &str,
    ) -> Result<Arc<dyn LayerArchive>, OpError> {
        if let Some(node) = self.nodes.get(&rec.node) {
            return node.runtime.layers().ok_or_else(|| {
                OpError::InvalidRequest(format!(
                    "{what} is not supported on node {}: its agent cannot snapshot sandbox layers",
                    rec.node
                ))
            });
        }
        if !self.drives_own_node(&rec.node) {
            return Err(OpError::Unavailable(format!(
                "the sandbox runs on node {}, which this replica does not drive: \
                 send the request to that replica",
                rec.node
            )));
        }
        let runtime = self
            .local_runtime(&rec.runtime)?
            .snapshottable
            .clone()
            .ok_or_else(|| {
                OpError::InvalidRequest(format!(
                    "{what} is not supported by runtime {}",
                    rec.runtime
                ))
            })?;
        Ok(Arc::new(RuntimeLayers {
            runtime,
            trees: self.trees.clone(),
        }))
    }

    /// Snapshots the sandbox's workspace and writable layer, frozen.
    pub(crate) async fn take_snapshot(
        &self,
        rec: &SandboxRecord,
        label: &str,
    ) -> Result<SandboxSnapshot, OpError> {
        let layers = self.layers_for(rec, "snapshotting")?;
        let runtime = self.runtime_for(&rec.node, &rec.runtime)?;
        let parent = self.last_snapshot(&rec.tenant, &rec.id).await?;
        let live = self.live_opt(&rec.id);
        let freeze = match &live {
            Some(l) if !l.paused.load(Ordering::SeqCst) => {
                runtime
                    .pausable("snapshotting")?
                    .pause(&rec.id)
                    .await
                    .map_err(OpError::runtime("freeze for snapshot"))?;
                true
            }
            _ => false,
        };
        let result = async {
            // chunks land before their manifest: no GC sweep in between
            let _no_gc = self.snapshots.hold_for_snapshot().await;
            let mut ws = SnapshotRequest::new(rec.tenant.clone(), format!("{label}/workspace"))
                .sandbox(rec.id.clone());
            let mut up = SnapshotRequest::new(rec.tenant.clone(), format!("{label}/upper"))
                .sandbox(rec.id.clone());
            if let Some(p) = &parent {
                ws = ws.parent(
                    p.workspace_manifest
                        .parse::<SnapshotId>()
                        .map_err(OpError::internal)?,
                );
                up = up.parent(
                    p.upper_manifest
                        .parse::<SnapshotId>()
                        .map_err(OpError::internal)?,
                );
            }
            let store = self.snapshots.store().clone();
            let w = layers
                .snapshot_layer(&rec.id, Layer::Workspace, store.clone(), ws)
                .await?;
            let u = layers
                .snapshot_layer(&rec.id, Layer::Writable, store, up)
                .await?;
            Ok::<_, OpError>((w, u))
        }
        .await;
        if let (true, Some(p)) = (freeze, runtime.can_pause()) {
            if let Err(e) = p.resume(&rec.id).await {
                tracing::error!(sandbox.id = %rec.id, error = %e, "could not thaw after snapshot");
            }
        }
        let manifest = match self.registry.get_environment(&rec.id).await {
            Ok(Some(env)) if !env.manifest.is_null() => Some(env.manifest),
            _ => None,
        };
        let (w, u) = match result {
            Ok(r) => r,
            Err(e) => {
                // a checkpoint that failed half-way says nothing good about
                // what the sandbox holds (a tree it cannot be read back from)
                let detail = format!("{label}: {}", e.public_message());
                self.taint_or_log(&rec.id, TaintCause::SnapshotFailed, &detail, None)
                    .await;
                return Err(e);
            }
        };
        let snap: SandboxSnapshot = self
            .registry
            .insert_snapshot(&SnapshotRecord {
                id: w.id.as_str().to_owned(),
                tenant: rec.tenant.clone(),
                sandbox_id: rec.id.clone(),
                parent: parent.map(|p| p.id),
                workspace_manifest: w.id.as_str().to_owned(),
                upper_manifest: u.id.as_str().to_owned(),
                template: rec.template.clone(),
                template_digest: rec.template_digest.clone(),
                resource_class: rec.resource_class.clone(),
                label: label.to_owned(),
                total_bytes: w.total_bytes + u.total_bytes,
                new_bytes: w.new_bytes + u.new_bytes,
                created_at: aviary_core::now(),
                manifest,
            })
            .await?
            .into();
        if let Ok(Some(mut env)) = self.registry.get_environment(&rec.id).await {
            env.snapshot_id = Some(snap.id.clone());
            let _ = self.registry.upsert_environment(&env).await;
        }
        Ok(snap)
    }

    /// Restores a snapshot's two trees into the layers the runtime stages
    /// for the sandbox `rec` (not created yet); its create adopts them.
    pub(crate) async fn stage_seed(
        &self,
        snap: &SandboxSnapshot,
        rec: &SandboxRecord,
    ) -> Result<(), OpError> {
        let layers = self.layers_for(rec, "restoring a snapshot")?;
        let workspace = self
            .manifest_of(&snap.tenant, &snap.workspace_manifest)
            .await?;
        let writable = self.manifest_of(&snap.tenant, &snap.upper_manifest).await?;
        layers
            .stage_layers(&rec.id, self.snapshots.store().clone(), workspace, writable)
            .await
    }

    /// A new sandbox from a checkpoint (copy of its layers; changes in the
    /// fork never show in the parent).
    /// A fresh checkpoint, when the request names none, is taken under the
    /// context's token (fenced like any snapshot).
    pub async fn fork(
        &self,
        cx: &OpContext,
        req: OnSandbox<ForkRequest>,
    ) -> Result<CreateSandboxResponse, OpError> {
        let OnSandbox { id, request: req } = req;
        if req.live {
            if req.snapshot.is_some() {
                return Err(OpError::InvalidRequest(
                    "a live fork forks the running sandbox: it takes no snapshot".into(),
                ));
            }
            return self.fork_live(cx, &id).await;
        }
        let parent = self.sandbox_for(&cx.caller, &id).await?;
        let snap = match &req.snapshot {
            Some(s) => {
                let snap = self.load_snapshot(&cx.caller.tenant, s).await?;
                if snap.sandbox_id != parent.id.as_str() {
                    return Err(OpError::NotFound(format!("snapshot {s} of sandbox {id}")));
                }
                snap
            }
            None => self.snapshot(cx, CheckpointRequest::new(id)).await?,
        };
        let create = CreateSandboxRequest {
            template: Some(snap.template.clone()),
            class: Some(snap.resource_class.clone()),
            // the child runs where its parent does (crun, runc, docker ...),
            // not on the node's default runtime
            runtime: Some(parent.runtime.clone()),
            ..Default::default()
        };
        let mut resp = self.create_seeded(cx, create, Some(snap.clone())).await?;
        resp.decision = Decision {
            action: "fork".into(),
            branch: "C".into(),
            reason: format!("forked from snapshot {} of {}", snap.id, parent.id),
            score: 1.0,
        };
        // the lineage (snapshot → fork), on the fork's log; the fork exists
        // either way, so a failed write is logged, not answered
        let child = &resp.sandbox;
        if let Err(e) = self
            .record_event(
                &child.tenant,
                Some(&child.id),
                Some(child.state),
                "forked",
                cx.request_id(),
                serde_json::json!({"snapshot": snap.id, "parent_sandbox": parent.id.as_str()}),
            )
            .await
        {
            tracing::warn!(sandbox.id = %child.id, error = %e, "could not record the fork's lineage");
        }
        Ok(resp)
    }

    /// A live fork (`{"live": true}`): a new sandbox running the parent's
    /// processes, from a memory image of the parent and a copy of its files
    /// at that moment ([`aviary_runtime::Checkpointable::fork_running`]).
    ///
    /// Fencing: the caller must be able to write the parent (its lease
    /// token, when it is leased). The child is a new sandbox with a lease
    /// counter of its own, created unleased (`Idle`): its envd forgets the
    /// parent's fence when it is restored (envd's SIGHUP), so the parent's
    /// lease token is refused by the child both here (the child has no
    /// lease) and in its envd; no fence is pushed to the child at create (it
    /// is unleased already), so its processes survive it. Its first lease
    /// moves the fence as for any sandbox, which ends them (a new holder
    /// starts clean). The parent keeps its lease and processes; it stops
    /// briefly for the image and is re-attached on its new compute.
    async fn fork_live(&self, cx: &OpContext, id: &str) -> Result<CreateSandboxResponse, OpError> {
        let (parent, _live) = self.writable(cx, id).await?;
        if self.checkpoints_for(&parent).is_none() {
            return Err(OpError::Coded {
                code: aviary_core::ErrorCode::Unsupported,
                message: format!(
                    "runtime {} cannot fork a running sandbox with its processes (runsc can); fork without \"live\" copies its files",
                    parent.runtime
                ),
            });
        }
        // no hibernate, wake or other live fork of the parent meanwhile
        let _lifecycle = self.lifecycle_guard(&parent.id).await?;
        let (parent, live) = self.writable(cx, id).await?;
        // gVisor cannot save a sandbox with an open host connection (the
        // save would end it): envd waits a bounded time for its connections
        // to end, so a running command or terminal refuses the fork instead
        let running = live.active_execs.load(Ordering::SeqCst);
        if running > 0 {
            return Err(OpError::InvalidState {
                state: parent.state,
                what: format!(
                    "it has {running} running command(s) or terminal(s); a live fork needs them ended"
                ),
            });
        }
        let create = CreateSandboxRequest {
            template: Some(parent.template.clone()),
            class: Some(parent.resource_class.clone()),
            runtime: Some(parent.runtime.clone()),
            ..Default::default()
        };
        let mut resp = self.create_from(cx, create, None, Some(&parent)).await?;
        resp.decision = Decision {
            action: "fork".into(),
            branch: "C".into(),
            reason: format!("forked live from running sandbox {}", parent.id),
            score: 1.0,
        };
        let child = &resp.sandbox;
        if let Err(e) = self
            .record_event(
                &child.tenant,
                Some(&child.id),
                Some(child.state),
                "forked",
                cx.request_id(),
                serde_json::json!({"live": true, "parent_sandbox": parent.id.as_str()}),
            )
            .await
        {
            tracing::warn!(sandbox.id = %child.id, error = %e, "could not record the fork's lineage");
        }
        Ok(resp)
    }

    /// The compute of a live fork's child (`rec`, `Provisioning`): the
    /// runtime forks `parent`, the parent is attached again on its new
    /// compute, and the child settles unleased in `Idle`.
    pub(crate) async fn start_live_fork(
        &self,
        spec: &aviary_runtime::SandboxSpec,
        rec: SandboxRecord,
        parent: &SandboxRecord,
        allocation_id: Option<i64>,
        request_id: Option<&str>,
    ) -> Result<(SandboxRecord, Option<aviary_leases::Lease>), OpError> {
        let c = self.checkpoints_for(parent).ok_or_else(|| OpError::Coded {
            code: aviary_core::ErrorCode::Unsupported,
            message: format!("runtime {} cannot fork a running sandbox", parent.runtime),
        })?;
        let forked = c.fork_running(&parent.id, spec).await;
        // the parent is on new compute (or gone, when its own restore
        // failed): its envd has a new gofer either way
        self.reattach_after_fork(c.as_ref(), parent).await;
        let fork = forked.map_err(OpError::runtime(
            "runtime could not fork the running sandbox",
        ))?;
        let (rec, live) = self.attach_compute(&fork.child, rec, allocation_id).await?;
        self.finish_lock(rec, &live, &[SandboxState::Locking], None, request_id)
            .await
    }

    /// Attaches the parent of a live fork to its envd again (new gofer,
    /// same fence); a parent that did not come back is left to the
    /// reconciler (no live handle: calls to it answer `unavailable`).
    async fn reattach_after_fork(
        &self,
        c: &dyn aviary_runtime::Checkpointable,
        parent: &SandboxRecord,
    ) {
        let id = &parent.id;
        let allocation = self.live_opt(id).and_then(|l| {
            let a = l.allocation_id.load(Ordering::SeqCst);
            (a >= 0).then_some(a)
        });
        self.forget_live(id);
        let running = matches!(
            c.status(id).await,
            Ok(aviary_runtime::RuntimeStatus::Running)
        );
        let endpoint = match c.envd_endpoint(id).await {
            Ok(ep) if running => ep,
            Ok(_) => {
                tracing::error!(sandbox.id = %id, "the parent of a live fork did not come back");
                return;
            }
            Err(e) => {
                tracing::error!(sandbox.id = %id, error = %e, "the parent of a live fork did not come back");
                return;
            }
        };
        let envd = crate::ops::envd_client(&endpoint);
        if let Err(e) = envd.wait_ready(Duration::from_secs(10)).await {
            tracing::error!(sandbox.id = %id, error = %e, "the parent's envd did not answer after a live fork");
            return;
        }
        let live = self.attach(id, envd, allocation);
        // the same fence again (a renewal: nothing ends), unless the lease
        // moved meanwhile
        if let Err(e) = self.push_fence(id, &live).await {
            tracing::warn!(sandbox.id = %id, error = %e, "fence push to the parent after a live fork failed");
        }
    }

    /// Idle → Hibernating: snapshot, then stop compute (the registry row
    /// stays; `wake` restores it).
    pub async fn hibernate(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let (rec, _live) = self.writable(cx, &req.id).await?;
        if rec.state != SandboxState::Idle {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle sandbox can hibernate".into(),
            });
        }
        self.hibernate_record(rec, cx.request_id(), "requested")
            .await
    }

    pub(crate) async fn hibernate_record(
        &self,
        rec: SandboxRecord,
        request_id: Option<&str>,
        why: &str,
    ) -> Result<Sandbox, OpError> {
        let _lifecycle = self.lifecycle_guard(&rec.id).await?;
        let rec = self.registry.get_sandbox(&rec.id).await?;
        if rec.state != SandboxState::Idle {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle sandbox can hibernate".into(),
            });
        }
        let snap = self.take_snapshot(&rec, "hibernate").await?;
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Hibernating],
                FenceCheck::Skip,
                TransitionCtx {
                    request_id: request_id.map(str::to_owned),
                    event_type: Some("hibernated".into()),
                    metadata: serde_json::json!({"snapshot": snap.id, "reason": why}),
                },
            )
            .await?;
        self.forget_live(&rec.id);
        // A runtime with memory checkpoints keeps the running processes (wake
        // continues them); when that fails, or without one, the compute goes
        // and wake starts from the file-system snapshot just taken.
        let kept = match self.checkpoints_for(&rec) {
            Some(c) => match c.checkpoint(&rec.id).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(sandbox.id = %rec.id, error = %e, "memory checkpoint failed: waking from the file-system snapshot");
                    false
                }
            },
            None => false,
        };
        if kept {
            let meta = serde_json::json!({"snapshot": snap.id});
            if let Err(e) = self
                .event(&rec, "memory_checkpointed", request_id, meta)
                .await
            {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "could not record the memory checkpoint");
            }
        } else if let Err(e) = self
            .runtime_for(&rec.node, &rec.runtime)?
            .destroy(&rec.id)
            .await
        {
            tracing::warn!(sandbox.id = %rec.id, error = %e, "stopping hibernated compute failed");
        }
        self.view(&rec).await
    }

    /// The memory checkpoints of `rec`'s runtime, when it is one of this
    /// host's own and has them.
    fn checkpoints_for(
        &self,
        rec: &SandboxRecord,
    ) -> Option<Arc<dyn aviary_runtime::Checkpointable>> {
        self.drives_own_node(&rec.node)
            .then(|| self.local_runtime(&rec.runtime).ok())
            .flatten()
            .and_then(|r| r.checkpointable.clone())
    }

    /// Wakes `rec` from its memory checkpoint, when it has one: `None` when
    /// there is none, or when the restore failed (its compute is then
    /// destroyed, and the caller wakes from the file-system snapshot).
    async fn wake_from_memory(
        &self,
        rec: &SandboxRecord,
        request_id: Option<&str>,
    ) -> Option<Result<SandboxRecord, OpError>> {
        let c = self.checkpoints_for(rec)?;
        if !c.has_checkpoint(&rec.id).await.unwrap_or(false) {
            return None;
        }
        let restored = async {
            let template = self.template_info(&rec.template).await?;
            let spec = self.sandbox_spec(
                &rec.id,
                &template,
                rec.resources,
                rec.network_profile,
                self.egress_of(rec)?,
            );
            let handle = c.restore(&spec).await.map_err(OpError::runtime(
                "runtime could not restore the sandbox's memory",
            ))?;
            let (rec, live) = self.attach_compute(&handle, rec.clone(), None).await?;
            self.finish_lock(rec, &live, &[SandboxState::Locking], None, request_id)
                .await
        }
        .await;
        match restored {
            Ok((rec, _)) => Some(Ok(rec)),
            Err(e) => {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "restoring the memory checkpoint failed: waking from the file-system snapshot");
                self.forget_live(&rec.id);
                if let Err(e) = c.destroy(&rec.id).await {
                    return Some(Err(OpError::runtime(
                        "runtime could not remove a failed memory restore",
                    )(e)));
                }
                None
            }
        }
    }

    /// Hibernating → Provisioning → Idle: new compute with the last snapshot.
    pub async fn wake(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        if rec.state != SandboxState::Hibernating {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only a hibernating sandbox can be woken".into(),
            });
        }
        let rec = self.wake_record(rec, cx.request_id()).await?;
        self.view(&rec).await
    }

    pub(crate) async fn wake_record(
        &self,
        rec: SandboxRecord,
        request_id: Option<&str>,
    ) -> Result<SandboxRecord, OpError> {
        let _lifecycle = self.lifecycle_guard(&rec.id).await?;
        let rec = self.registry.get_sandbox(&rec.id).await?;
        if rec.state != SandboxState::Hibernating {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is not hibernating".into(),
            });
        }
        let snap = self
            .last_snapshot(&rec.tenant, &rec.id)
            .await?
            .ok_or_else(|| OpError::InvalidState {
                state: rec.state,
                what: "it has no snapshot to wake from".into(),
            })?;
        // new compute: it must fit under the node's over-commit like a create
        let placement = self
            .place(crate::nodes::PlaceRequest {
                tenant: &rec.tenant,
                class: &rec.resource_class,
                limits: rec.resources,
                template_digest: &rec.template_digest,
                runtime: &rec.runtime,
                on: crate::nodes::PlaceOn::Node(&rec.node),
                request_id,
            })
            .await?;
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Provisioning],
                FenceCheck::Skip,
                TransitionCtx {
                    request_id: request_id.map(str::to_owned),
                    event_type: Some("waking".into()),
                    metadata: serde_json::json!({"snapshot": snap.id}),
                },
            )
            .await?;
        drop(placement);
        if let Some(woken) = self.wake_from_memory(&rec, request_id).await {
            return woken;
        }
        let woken = async {
            let template = self.template_info(&rec.template).await?;
            self.stage_seed(&snap, &rec).await?;
            let spec = self.sandbox_spec(
                &rec.id,
                &template,
                rec.resources,
                rec.network_profile,
                self.egress_of(&rec)?,
            );
            let (rec, live) = self.provision(&spec, rec.clone(), None).await?;
            self.finish_lock(rec, &live, &[SandboxState::Locking], None, request_id)
                .await
        }
        .await;
        match woken {
            Ok((rec, _)) => Ok(rec),
            Err(e) => {
                let detail = format!("wake from {}: {}", snap.id, e.public_message());
                self.taint_or_log(&rec.id, TaintCause::RestoreFailed, &detail, request_id)
                    .await;
                Err(e)
            }
        }
    }

    /// Branch B: the compute is alive but its work dir is gone: restore the
    /// last snapshot's workspace into the live sandbox.
    pub(crate) async fn restore_workspace_live(
        &self,
        rec: &SandboxRecord,
        snap: &SandboxSnapshot,
    ) -> Result<(), OpError> {
        let layers = self.layers_for(rec, "restoring a workspace")?;
        let restored = async {
            let manifest = self
                .manifest_of(&snap.tenant, &snap.workspace_manifest)
                .await?;
            layers
                .restore_workspace(&rec.id, self.snapshots.store().clone(), manifest)
                .await
        }
        .await;
        if let Err(e) = &restored {
            // a workspace restored half-way is neither the old nor the new
            let detail = format!("workspace from {}: {}", snap.id, e.public_message());
            self.taint_or_log(&rec.id, TaintCause::RestoreFailed, &detail, None)
                .await;
        }
        restored
    }

    /// True when the live workspace lost what the snapshot had. A sandbox
    /// whose layers this runtime cannot read is taken as intact.
    pub(crate) async fn workspace_lost(&self, rec: &SandboxRecord, snap: &SandboxSnapshot) -> bool {
        if snap.total_bytes == 0 {
            return false;
        }
        let Ok(layers) = self.layers_for(rec, "reading the workspace") else {
            return false;
        };
        // gone with its compute: nothing of it is left (the archive says empty)
        match layers.workspace_is_empty(&rec.id).await {
            Ok(empty) => empty,
            Err(e) => {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "cannot read the workspace");
                false
            }
        }
    }

    /// Hibernates idle sandboxes past the idle timeout (called by the sweep).
    pub(crate) async fn hibernate_idle(&self, scope: crate::Reconciling) -> Result<(), OpError> {
        let Some(limit) = self.cfg.idle_hibernate_s else {
            return Ok(());
        };
        let now = aviary_core::now();
        for rec in self.registry.list_sandboxes(None, false).await? {
            if rec.state != SandboxState::Idle
                || rec.tenant.is_empty()
                || !self.looks_after(scope, &rec.node)
            {
                continue;
            }
            if rec.node == self.cfg.local_node
                && self
                    .local_runtime(&rec.runtime)
                    .is_ok_and(|r| r.snapshottable.is_none())
            {
                // its runtime cannot snapshot (Kubernetes): it stays up
                continue;
            }
            let live = self.live_opt(&rec.id);
            let idle = match &live {
                Some(l) => l
                    .last_activity
                    .lock()
                    .expect("activity poisoned")
                    .elapsed()
                    .as_secs_f64(),
                None => (now - rec.last_active_at).as_seconds_f64(),
            };
            let busy = live
                .as_ref()
                .is_some_and(|l| l.active_execs.load(Ordering::SeqCst) > 0);
            let paused = live
                .as_ref()
                .is_some_and(|l| l.paused.load(Ordering::SeqCst));
            if idle >= limit as f64 && !paused && !busy {
                if let Err(e) = self
                    .hibernate_record(rec.clone(), None, "idle timeout")
                    .await
                {
                    tracing::warn!(sandbox.id = %rec.id, error = %e, "idle hibernation failed");
                }
            }
        }
        Ok(())
    }
}

/// How long a wake may take before the caller sees an error.
pub const WAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs a snapshot-store future on a blocking thread of its own. The
/// chunk-store futures are not `Send` for every lifetime (a rustc limitation
/// with closures in stream combinators), which axum handlers require.
async fn off_thread<F, Fut, T>(f: F) -> Result<T, OpError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
    T: Send + 'static,
{
    let h = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || h.block_on(f()))
        .await
        .map_err(OpError::internal)
}

impl ControlPlane {
    /// `tenant`'s manifest named by a snapshot row.
    async fn manifest_of(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<aviary_snapshots::SnapshotManifest, OpError> {
        let mid: SnapshotId = id.parse().map_err(OpError::internal)?;
        // its errors carry their codes (not found, corrupt, store down)
        Ok(self.snapshots.store().get_manifest(tenant, &mid).await?)
    }
}

/// `POST /v1/snapshots/gc` (admin): retention, then a sweep of chunks no
/// remaining snapshot references.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Snapshots kept per sandbox (newest first); the rest are deleted.
    pub keep_last: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GcResult {
    pub snapshots_deleted: Vec<String>,
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
}

impl ControlPlane {
    /// Applies retention to every tenant's snapshots and sweeps unreferenced
    /// chunks. Snapshots other snapshots name as parent stay readable: a
    /// manifest holds its full chunk list, so deleting a parent never breaks
    /// a child.
    pub async fn gc_snapshots(&self, cx: &OpContext, req: GcRequest) -> Result<GcResult, OpError> {
        cx.require_admin("snapshot garbage collection")?;
        if req.keep_last == 0 || req.keep_last > 10_000 {
            return Err(OpError::InvalidRequest(
                "keep_last must be between 1 and 10000".into(),
            ));
        }
        let all = self
            .registry
            .list_snapshots(&SnapshotFilter::default())
            .await?;
        let mut by_sandbox: std::collections::BTreeMap<(String, SandboxId), Vec<SnapshotRecord>> =
            Default::default();
        for s in all {
            by_sandbox
                .entry((s.tenant.clone(), s.sandbox_id.clone()))
                .or_default()
                .push(s);
        }
        let store = self.snapshots.store().clone();
        let _no_snapshots = self.snapshots.hold_for_gc().await;
        let mut deleted = Vec::new();
        for (_, list) in by_sandbox {
            // the registry lists oldest first
            for old in list.into_iter().rev().skip(req.keep_last) {
                for m in [&old.workspace_manifest, &old.upper_manifest] {
                    let id: SnapshotId = m.parse().map_err(OpError::internal)?;
                    let (st, tenant) = (store.clone(), old.tenant.clone());
                    off_thread(move || async move { st.delete_manifest(&tenant, &id).await })
                        .await?
                        .or_else(|e| if e.is_not_found() { Ok(()) } else { Err(e) })
                        .map_err(OpError::from)?;
                }
                match self.registry.delete_snapshot(&old.id).await {
                    Ok(()) | Err(aviary_registry::RegistryError::NotFound) => {}
                    Err(e) => return Err(e.into()),
                }
                deleted.push(old.id);
            }
        }
        let st = store.clone();
        let report =
            off_thread(move || async move { aviary_snapshots::collect_garbage(st.as_ref()).await })
                .await?
                .map_err(OpError::from)?;
        Ok(GcResult {
            snapshots_deleted: deleted,
            chunks_kept: report.chunks_kept,
            chunks_deleted: report.chunks_deleted,
        })
    }
}

impl ControlPlane {
    /// Deletes one of the caller's snapshots: its manifests and its row
    /// (its chunks go with the next chunk GC once nothing references them).
    /// Other snapshots stay readable (a manifest lists all its chunks). The
    /// latest snapshot of a hibernated sandbox is what it wakes from: that
    /// one is refused until the sandbox is woken or deleted.
    pub async fn delete_snapshot(
        &self,
        cx: &OpContext,
        id: &str,
    ) -> Result<SandboxSnapshot, OpError> {
        let snap = self.load_snapshot(&cx.caller.tenant, id).await?;
        let sandbox: SandboxId = snap.sandbox_id.parse().map_err(OpError::internal)?;
        if let Ok(rec) = self.registry.get_sandbox(&sandbox).await {
            let latest = self.last_snapshot(&rec.tenant, &rec.id).await?;
            if rec.state == SandboxState::Hibernating && latest.is_some_and(|l| l.id == snap.id) {
                return Err(OpError::layer(
                    aviary_core::ErrorCode::Conflict,
                    format!(
                        "snapshot {id} is what hibernated sandbox {} wakes from: wake or delete the sandbox first",
                        rec.id
                    ),
                    anyhow::anyhow!("snapshot {id} in use"),
                ));
            }
        }
        let store = self.snapshots.store().clone();
        for m in [&snap.workspace_manifest, &snap.upper_manifest] {
            let mid: SnapshotId = m.parse().map_err(OpError::internal)?;
            let (st, tenant) = (store.clone(), snap.tenant.clone());
            off_thread(move || async move { st.delete_manifest(&tenant, &mid).await })
                .await?
                .or_else(|e| if e.is_not_found() { Ok(()) } else { Err(e) })
                .map_err(OpError::from)?;
        }
        match self.registry.delete_snapshot(&snap.id).await {
            Ok(()) | Err(aviary_registry::RegistryError::NotFound) => {}
            Err(e) => return Err(e.into()),
        }
        self.record_event(
            &cx.caller.tenant,
            Some(&sandbox),
            None,
            "snapshot_deleted",
            cx.request_id(),
            serde_json::json!({"snapshot": snap.id}),
        )
        .await?;
        Ok(snap)
    }

    /// The unattended chunk GC (start-up and background): deletes chunks no
    /// snapshot references once they have been unreferenced for
    /// `chunk_gc_grace_s` — what a snapshot interrupted by a crash left behind.
    pub async fn collect_unreferenced_chunks(&self) -> Result<aviary_snapshots::GcReport, OpError> {
        let grace = time::Duration::seconds(self.cfg.chunk_gc_grace_s.min(i64::MAX as u64) as i64);
        let _no_snapshots = self.snapshots.hold_for_gc().await;
        let store = self.snapshots.store().clone();
        let sweep = self.snapshots.grace_sweep();
        off_thread(move || async move {
            sweep
                .lock()
                .await
                .sweep(store.as_ref(), grace, aviary_core::now())
                .await
        })
        .await?
        .map_err(OpError::from)
    }
}
