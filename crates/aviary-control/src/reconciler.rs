//! The periodic reconciler (DESIGN §3, issue 9): observe → compare →
//! reconcile, over the compute this control plane drives — its own
//! runtimes and the node agents connected here. A sandbox on any other node
//! (another replica's own runtimes) is never touched.
//!
//! One pass, [`ControlPlane::reconcile`]:
//! 1. **Observe.** Every driven runtime's sandboxes (`list`), *then* the
//!    registry's non-terminal rows. In that order, compute the pass lists
//!    already had its row when it was listed: a create inserts its row
//!    before it provisions (`create_seeded`, pool refills).
//! 2. **Compute gone.** A live row whose compute the runtime says is
//!    `NotFound` or `Stopped` becomes `Lost` (the shared loss path: lease
//!    revoked, so the token is stale; event `sandbox_lost` with the cause).
//!    A lost sandbox whose compute is gone — lost here, by the envd probe or
//!    on the request path — is then recovered: with a snapshot, new compute
//!    of the same id with the snapshot's layers staged, as `wake` does
//!    (`Lost → Provisioning → Locking → Idle`, events `recovering` and
//!    `recovered` naming the snapshot); without one, a user-managed sandbox
//!    (its owner manages its life and expects it there) gets new compute
//!    from its template with an empty workspace (event `recreated`,
//!    `data_lost: true`), any other stays `Lost` with one `unrecoverable`
//!    event (its owner deletes it or creates anew; scope reuse never hands
//!    a lost sandbox out). A pooled (tenant-less) one is destroyed: its
//!    pool refills.
//! 3. **Orphans.** Compute whose id the registry does not know, or knows
//!    as terminated, is destroyed once it has been seen so for
//!    `orphan_grace_s` (tenant-less event `orphan_destroyed`) — unless a
//!    background reclaim of this process is on it (`reclaim`).
//! 4. **Silent nodes.** A node agent whose runtime has not answered `list`
//!    for `node_unhealthy_after_s` is unhealthy (event `node_unhealthy`,
//!    the registry's node row marked so): its live sandboxes become `Lost`
//!    naming the node. When it answers again (event `node_healthy`), a
//!    sandbox it lost whose compute is still running is attached again with
//!    the current fence pushed (`Lost → Provisioning → Locking → Idle`,
//!    event `reattached`); one whose compute went is handled as in 2.
//!
//! Every action is an event in the registry, a count in `/metrics`
//! (`aviary_reconciler_actions_total{action=...}`, [`ReconcileAction`]) and
//! a count in the pass's [`ReconcileReport`].
//!
//! Concurrency: per-sandbox work holds `lifecycle/<id>` (the lock hibernate
//! and wake take), tried and never waited for — a hibernate, a wake or
//! another replica's pass over the same agent has it, and the next pass
//! looks again — and re-reads the row under it; every write is
//! version-checked, so a request racing the pass (a delete, say) either
//! wins or makes the pass's write fail cleanly. What was decided about a
//! loss is read back from the event log (the last `sandbox_lost` event and
//! what followed it), so neither a restart nor another replica repeats a
//! verdict or forgets a loss it should re-attach.
//!
//! In-process state (observations, not records): when each unknown compute
//! was first seen, and when each agent last answered. A restarted replica
//! starts both clocks again, which only makes it wait longer.

use crate::error::OpError;
use crate::lifecycle::LOST_COMPUTE_GONE;
use crate::metrics::ReconcileAction;
use crate::ops::{anyhow_of, rfc3339, ControlPlane};
use crate::snapshots::SandboxSnapshot;
use aviary_core::{SandboxId, SandboxState};
use aviary_registry::{FenceCheck, SandboxRecord, TransitionCtx, POOL_TENANT};
use aviary_runtime::{Pausable, Runtime, RuntimeError, RuntimeStatus};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

/// The `cause` a loss to a silent node records (rule 4 re-attaches only these).
const CAUSE_NODE_UNHEALTHY: &str = "node_unhealthy";
/// The `cause` a loss of compute the runtime no longer runs records.
pub(crate) const CAUSE_COMPUTE_GONE: &str = "compute_gone";

/// Longest a node agent's `list` may take before it counts as no answer.
const AGENT_LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a re-attach waits for the envd of a sandbox on an agent.
const REATTACH_ANSWER: Duration = Duration::from_secs(3);

/// Which compute a pass looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciling {
    /// This control plane's own runtimes only (a replica that does not
    /// hold the leader lock).
    OwnNode,
    /// Its own runtimes and every node agent connected here (the leader,
    /// and the single embedded server).
    OwnNodeAndAgents,
}

/// What one pass did, by action (the same counts `/metrics` adds up).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub lost: u64,
    pub recovered: u64,
    pub recreated: u64,
    pub reattached: u64,
    pub unrecoverable: u64,
    pub recovery_failed: u64,
    pub pooled_destroyed: u64,
    pub orphans_destroyed: u64,
    pub nodes_unhealthy: u64,
    pub nodes_healthy: u64,
}

impl ReconcileReport {
    fn slot(&mut self, action: ReconcileAction) -> &mut u64 {
        match action {
            ReconcileAction::Lost => &mut self.lost,
            ReconcileAction::Recovered => &mut self.recovered,
            ReconcileAction::Recreated => &mut self.recreated,
            ReconcileAction::Reattached => &mut self.reattached,
            ReconcileAction::Unrecoverable => &mut self.unrecoverable,
            ReconcileAction::RecoveryFailed => &mut self.recovery_failed,
            ReconcileAction::PooledDestroyed => &mut self.pooled_destroyed,
            ReconcileAction::OrphanDestroyed => &mut self.orphans_destroyed,
            ReconcileAction::NodeUnhealthy => &mut self.nodes_unhealthy,
            ReconcileAction::NodeHealthy => &mut self.nodes_healthy,
        }
    }

    /// How often the pass did `action`.
    pub fn count(&self, action: ReconcileAction) -> u64 {
        let mut copy = *self;
        *copy.slot(action)
    }

    /// True when the pass did nothing.
    pub fn is_quiet(&self) -> bool {
        *self == ReconcileReport::default()
    }
}

/// What the reconciler remembers between passes (see the module doc).
#[derive(Default)]
pub struct Observations {
    /// Compute seen without a row, by (node, runtime, id): since when.
    orphans: StdMutex<HashMap<(String, String, SandboxId), Instant>>,
    /// Per connected agent: when its runtime last answered, and whether it
    /// was declared unhealthy.
    nodes: StdMutex<HashMap<String, NodeWatch>>,
}

#[derive(Clone, Copy)]
struct NodeWatch {
    answered_at: Instant,
    unhealthy: bool,
}

/// One runtime the pass observes.
#[derive(Clone)]
enum Compute {
    /// One of this control plane's own runtimes.
    Local(Arc<dyn Runtime>),
    /// A node agent's runtime (it serves every runtime its rows name).
    Agent(Arc<dyn Pausable>),
}

impl Compute {
    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        match self {
            Compute::Local(rt) => rt.list().await,
            Compute::Agent(rt) => match tokio::time::timeout(AGENT_LIST_TIMEOUT, rt.list()).await {
                Ok(r) => r,
                Err(_) => Err(RuntimeError::InvokeRuntime {
                    action: "list".into(),
                    detail: format!("no answer within {AGENT_LIST_TIMEOUT:?}"),
                }),
            },
        }
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        match self {
            Compute::Local(rt) => rt.status(id).await,
            Compute::Agent(rt) => rt.status(id).await,
        }
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        match self {
            Compute::Local(rt) => rt.destroy(id).await,
            Compute::Agent(rt) => rt.destroy(id).await,
        }
    }
}

/// A driven runtime and what it answered this pass.
struct Source {
    node: String,
    /// A local runtime's name (rows must name it); `None` for an agent.
    runtime: Option<String>,
    compute: Compute,
    /// The sandboxes it listed; `None` when `list` failed.
    listed: Option<HashSet<SandboxId>>,
}

impl Source {
    /// Whether `rec`'s compute is this source's.
    fn serves(&self, rec: &SandboxRecord) -> bool {
        rec.node == self.node && self.runtime.as_ref().is_none_or(|r| *r == rec.runtime)
    }

    fn runtime_label(&self) -> String {
        self.runtime.clone().unwrap_or_else(|| "agent".to_owned())
    }
}

/// What the event log says about a sandbox's last loss.
#[derive(Debug, Default)]
struct LastLoss {
    reason: String,
    cause: Option<String>,
    /// The state it was lost from.
    previous: Option<SandboxState>,
    was_tainted: bool,
    /// An `unrecoverable` verdict followed it: nothing more to do.
    judged: bool,
}

fn ctx(event: &str, metadata: serde_json::Value) -> TransitionCtx {
    TransitionCtx {
        request_id: None,
        event_type: Some(event.to_owned()),
        metadata,
    }
}

fn loss_extra(pairs: &[(&str, &str)]) -> serde_json::Map<String, serde_json::Value> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::String((*v).to_owned())))
        .collect()
}

impl ControlPlane {
    /// One reconciler pass (see the module doc). Failures of one sandbox
    /// or one runtime are logged and looked at again next pass; only a
    /// registry that cannot be read fails the pass.
    pub async fn reconcile(&self) -> Result<ReconcileReport, OpError> {
        self.reconcile_as(Reconciling::OwnNodeAndAgents).await
    }

    /// One pass over what `scope` names. Replicas share the node agents,
    /// so only the one holding the leader lock reconciles them; each
    /// replica reconciles its own node, which no other replica drives.
    pub async fn reconcile_as(&self, scope: Reconciling) -> Result<ReconcileReport, OpError> {
        let mut report = ReconcileReport::default();
        // runtimes first, then the registry: see the module doc
        let sources = self.observe(scope).await;
        let silent = self.watch_nodes(&sources, &mut report).await;
        let rows = self.registry.list_sandboxes(None, false).await?;
        for rec in rows.iter().filter(|r| self.drives_node(&r.node)) {
            // a runtime not served here cannot be observed
            let Some(source) = sources.iter().find(|s| s.serves(rec)) else {
                continue;
            };
            let done = if silent.contains(&rec.node) {
                self.lose_to_silent_node(rec, &mut report).await
            } else if let Some(listed) = &source.listed {
                self.reconcile_sandbox(rec, source, listed, &mut report)
                    .await
            } else {
                // a local runtime that could not list: next pass
                Ok(())
            };
            if let Err(e) = done {
                tracing::warn!(sandbox.id = %rec.id, error = format!("{:#}", anyhow_of(&e)), "reconciling the sandbox failed; next pass tries again");
            }
        }
        self.sweep_orphans(&sources, &rows, &mut report).await;
        self.metrics.inc_reconcile_pass();
        Ok(report)
    }

    /// Counts one action in the report and the metrics.
    fn note(&self, report: &mut ReconcileReport, action: ReconcileAction) {
        *report.slot(action) += 1;
        self.metrics.inc_reconcile(action);
    }

    /// Lists every driven runtime: the local ones, then (if `scope` says
    /// so) the agents.
    async fn observe(&self, scope: Reconciling) -> Vec<Source> {
        let mut out = Vec::new();
        for rt in self.runtimes.all() {
            out.push(Source {
                node: self.cfg.local_node.clone(),
                runtime: Some(rt.runtime.name().to_owned()),
                compute: Compute::Local(rt.runtime.clone()),
                listed: None,
            });
        }
        let agents = match scope {
            Reconciling::OwnNodeAndAgents => self.nodes.all(),
            Reconciling::OwnNode => Vec::new(),
        };
        for n in agents {
            out.push(Source {
                node: n.id.clone(),
                runtime: None,
                compute: Compute::Agent(n.runtime.runtime()),
                listed: None,
            });
        }
        for s in &mut out {
            match s.compute.list().await {
                Ok(ids) => s.listed = Some(ids.into_iter().collect()),
                Err(e) => {
                    tracing::warn!(node = %s.node, runtime = %s.runtime_label(), error = %e, "the runtime did not list its sandboxes")
                }
            }
        }
        out
    }

    /// Rule 4's bookkeeping: which agents answered, which have been silent
    /// too long. Returns the nodes that are unhealthy now.
    async fn watch_nodes(
        &self,
        sources: &[Source],
        report: &mut ReconcileReport,
    ) -> HashSet<String> {
        let now = Instant::now();
        let after = Duration::from_secs(self.cfg.node_unhealthy_after_s);
        let (mut went_silent, mut came_back, mut silent) = (Vec::new(), Vec::new(), HashSet::new());
        {
            let mut watch = self.reconciler.nodes.lock().expect("node watch poisoned");
            watch.retain(|node, _| {
                sources
                    .iter()
                    .any(|s| s.runtime.is_none() && s.node == *node)
            });
            for s in sources.iter().filter(|s| s.runtime.is_none()) {
                let w = watch.entry(s.node.clone()).or_insert(NodeWatch {
                    answered_at: now,
                    unhealthy: false,
                });
                if s.listed.is_some() {
                    w.answered_at = now;
                    if std::mem::take(&mut w.unhealthy) {
                        came_back.push(s.node.clone());
                    }
                    continue;
                }
                let quiet = now.duration_since(w.answered_at);
                if !w.unhealthy && quiet >= after {
                    w.unhealthy = true;
                    went_silent.push((s.node.clone(), quiet));
                }
                if w.unhealthy {
                    silent.insert(s.node.clone());
                }
            }
        }
        for (node, quiet) in went_silent {
            tracing::warn!(%node, silent_for_s = quiet.as_secs(), "node agent unhealthy: its sandboxes are lost");
            let meta = serde_json::json!({"node": node, "silent_for_s": quiet.as_secs(), "after_s": after.as_secs()});
            if let Err(e) = self
                .record_event(POOL_TENANT, None, None, "node_unhealthy", None, meta)
                .await
            {
                tracing::warn!(%node, error = %e, "could not record the unhealthy node");
            }
            self.set_node_health(&node, false).await;
            self.note(report, ReconcileAction::NodeUnhealthy);
        }
        for node in came_back {
            tracing::info!(%node, "node agent answers again");
            let meta = serde_json::json!({"node": node});
            if let Err(e) = self
                .record_event(POOL_TENANT, None, None, "node_healthy", None, meta)
                .await
            {
                tracing::warn!(%node, error = %e, "could not record the healthy node");
            }
            self.set_node_health(&node, true).await;
            self.note(report, ReconcileAction::NodeHealthy);
        }
        silent
    }

    /// Marks the registry's row of `node` (healthy or not) for every replica
    /// and the node listing to see.
    async fn set_node_health(&self, node: &str, healthy: bool) {
        let rows = match self.registry.list_nodes().await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(%node, error = %e, "could not read the node rows");
                return;
            }
        };
        if let Some(mut row) = rows.into_iter().find(|r| r.id == node) {
            row.healthy = healthy;
            if healthy {
                row.last_seen = aviary_core::now();
            }
            if let Err(e) = self.registry.upsert_node(&row).await {
                tracing::warn!(%node, error = %e, "could not mark the node's health");
            }
        }
    }

    /// Rule 4: a live sandbox on a silent node becomes `Lost`, naming it.
    async fn lose_to_silent_node(
        &self,
        rec: &SandboxRecord,
        report: &mut ReconcileReport,
    ) -> Result<(), OpError> {
        if !rec.state.is_live() {
            return Ok(());
        }
        let Some(_lifecycle) = self.try_lifecycle_guard(&rec.id, "reconciler").await? else {
            return Ok(());
        };
        let reason = format!("its node agent {} stopped answering", rec.node);
        let extra = loss_extra(&[("cause", CAUSE_NODE_UNHEALTHY), ("node", &rec.node)]);
        if self.lose(&rec.id, &reason, None, extra).await? {
            self.note(report, ReconcileAction::Lost);
        }
        Ok(())
    }

    /// Rules 2 and 4 for one row of a runtime that answered.
    async fn reconcile_sandbox(
        &self,
        rec: &SandboxRecord,
        source: &Source,
        listed: &HashSet<SandboxId>,
        report: &mut ReconcileReport,
    ) -> Result<(), OpError> {
        if rec.state.is_live() {
            if !self.compute_may_be_gone(rec, listed).await {
                return Ok(());
            }
            let Some(_lifecycle) = self.try_lifecycle_guard(&rec.id, "reconciler").await? else {
                return Ok(());
            };
            // the listing is a moment old: decide on the row and the
            // runtime's answer now
            let rec = self.registry.get_sandbox(&rec.id).await?;
            if rec.state == SandboxState::Lost {
                // lost meanwhile (the envd probe, a request): settle it in
                // this pass rather than the next
                return self.settle_lost(rec, source, report).await;
            }
            if !rec.state.is_live() {
                return Ok(());
            }
            let status = source
                .compute
                .status(&rec.id)
                .await
                .map_err(OpError::runtime("ask the runtime for the sandbox's status"))?;
            if !matches!(status, RuntimeStatus::NotFound | RuntimeStatus::Stopped) {
                return Ok(());
            }
            let found = format!("{status:?}");
            let extra = loss_extra(&[("cause", CAUSE_COMPUTE_GONE), ("runtime_status", &found)]);
            if self.lose(&rec.id, LOST_COMPUTE_GONE, None, extra).await? {
                self.note(report, ReconcileAction::Lost);
            }
            let rec = self.registry.get_sandbox(&rec.id).await?;
            if rec.state == SandboxState::Lost {
                self.settle_lost(rec, source, report).await?;
            }
            return Ok(());
        }
        if rec.state != SandboxState::Lost {
            // being created, reset, hibernated or deleted: that operation's
            return Ok(());
        }
        let Some(_lifecycle) = self.try_lifecycle_guard(&rec.id, "reconciler").await? else {
            return Ok(());
        };
        let rec = self.registry.get_sandbox(&rec.id).await?;
        if rec.state == SandboxState::Lost {
            self.settle_lost(rec, source, report).await?;
        }
        Ok(())
    }

    /// Whether a live sandbox's compute needs the runtime's word: it is not
    /// listed, or it is attached here and its envd does not answer, or it is
    /// not attached here (or paused: a frozen envd cannot answer). An
    /// attached envd that answers is running compute; asking it is a socket
    /// round trip, the runtime's status may be a process spawn.
    async fn compute_may_be_gone(&self, rec: &SandboxRecord, listed: &HashSet<SandboxId>) -> bool {
        if !listed.contains(&rec.id) {
            return true;
        }
        match self.live_opt(&rec.id) {
            Some(live) if !live.paused.load(std::sync::atomic::Ordering::SeqCst) => {
                Self::envd_unreachable(&rec.id, &live).await
            }
            _ => true,
        }
    }

    /// A lost sandbox (its lifecycle lock held, the row just read): what
    /// its loss and its compute call for.
    async fn settle_lost(
        &self,
        rec: SandboxRecord,
        source: &Source,
        report: &mut ReconcileReport,
    ) -> Result<(), OpError> {
        let loss = self.last_loss(&rec.id).await?;
        if loss.judged {
            return Ok(());
        }
        if rec.tenant == POOL_TENANT {
            // nobody's data: the pool starts a fresh one
            let destroyed = self
                .destroy_unattended(rec, "pooled sandbox lost; its pool refills")
                .await;
            self.note(report, ReconcileAction::PooledDestroyed);
            return destroyed.map(drop);
        }
        let status = source
            .compute
            .status(&rec.id)
            .await
            .map_err(OpError::runtime("ask the runtime for the sandbox's status"))?;
        match status {
            RuntimeStatus::Running | RuntimeStatus::Paused => {
                if loss.cause.as_deref() == Some(CAUSE_NODE_UNHEALTHY) {
                    self.reattach(rec, &loss, status, report).await
                } else {
                    // compute still there, lost for another cause (a fence
                    // its envd refused, an attach that failed at start-up):
                    // it is not trusted again; its owner decides
                    Ok(())
                }
            }
            RuntimeStatus::NotFound | RuntimeStatus::Stopped => {
                match self.last_snapshot(&rec.tenant, &rec.id).await? {
                    Some(snap) => self.recover(rec, Some(snap), &loss, source, report).await,
                    // its owner manages its life and expects it to be there:
                    // new compute from its template, the data loss said
                    None if rec.user_managed => {
                        self.recover(rec, None, &loss, source, report).await
                    }
                    None => {
                        self.judge_unrecoverable(
                            &rec,
                            &loss,
                            "it has no snapshot to restore from",
                            report,
                        )
                        .await
                    }
                }
            }
        }
    }

    /// The verdict for a lost sandbox nothing can bring back: it stays
    /// `Lost`, once, with the reason.
    async fn judge_unrecoverable(
        &self,
        rec: &SandboxRecord,
        loss: &LastLoss,
        why: &str,
        report: &mut ReconcileReport,
    ) -> Result<(), OpError> {
        tracing::warn!(sandbox.id = %rec.id, why, "lost sandbox cannot be recovered");
        self.event(
            rec,
            "unrecoverable",
            None,
            serde_json::json!({
                "reason": why,
                "lost_reason": loss.reason,
                "next": "delete it, or create a new one",
            }),
        )
        .await?;
        self.note(report, ReconcileAction::Unrecoverable);
        Ok(())
    }

    /// Rule 2's recovery: new compute of the same id with the snapshot's
    /// layers staged, the path `wake` takes from `Hibernating`; without a
    /// snapshot (a user-managed sandbox), new compute from its template
    /// with an empty workspace (event `recreated`, `data_lost: true`). A refusal
    /// found before anything moves is the `unrecoverable` verdict; a full
    /// node waits for the next pass; a failure once the row moved leaves it
    /// `Failed` (event `recovery_failed`) with its new compute removed.
    async fn recover(
        &self,
        rec: SandboxRecord,
        snap: Option<SandboxSnapshot>,
        loss: &LastLoss,
        source: &Source,
        report: &mut ReconcileReport,
    ) -> Result<(), OpError> {
        if snap.is_some() {
            if let Err(e) = self.layers_for(&rec, "restoring a lost sandbox") {
                return self
                    .judge_unrecoverable(&rec, loss, &e.public_message(), report)
                    .await;
            }
        }
        // the template the layers (or, recreated, the sandbox) were built on
        let (needed, what) = match &snap {
            Some(snap) => (&snap.template_digest, format!("its snapshot {}", snap.id)),
            None => (&rec.template_digest, "the sandbox".to_owned()),
        };
        let template = match self.template_info(&rec.template).await {
            Ok(t) if t.digest == *needed => t,
            Ok(t) => {
                let why = format!(
                    "{what} needs template {:?} at {needed}, which now has {}",
                    rec.template, t.digest
                );
                return self.judge_unrecoverable(&rec, loss, &why, report).await;
            }
            Err(e) => {
                return self
                    .judge_unrecoverable(&rec, loss, &e.public_message(), report)
                    .await
            }
        };
        // new compute: it must fit under its node's over-commit like a
        // create (an agent checks its own capacity at its create)
        let placement = if !self.drives_own_node(&rec.node) {
            None
        } else {
            match self
                .place(crate::nodes::PlaceRequest {
                    tenant: &rec.tenant,
                    class: &rec.resource_class,
                    limits: rec.resources,
                    template_digest: &rec.template_digest,
                    runtime: &rec.runtime,
                    on: crate::nodes::PlaceOn::Node(&rec.node),
                    request_id: None,
                })
                .await
            {
                Ok(p) => Some(p),
                Err(OpError::CapacityExhausted(why)) => {
                    tracing::info!(sandbox.id = %rec.id, %why, "recovery waits for capacity");
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        };
        let snap_id = snap.as_ref().map(|s| s.id.to_string());
        let meta = serde_json::json!({
            "snapshot": snap_id,
            "from": if snap.is_some() { "snapshot" } else { "template" },
            "lost_reason": loss.reason,
        });
        let rec = match self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Provisioning],
                FenceCheck::Skip,
                ctx("recovering", meta),
            )
            .await
        {
            Ok(r) => r,
            // a request (a delete) got there first
            Err(aviary_registry::RegistryError::Conflict) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        drop(placement);
        let id = rec.id.clone();
        let restored = async {
            // what the dead compute left (a stopped container, its disk)
            // goes first: a stage is for a sandbox that does not exist
            source
                .compute
                .destroy(&rec.id)
                .await
                .map_err(OpError::runtime("remove the lost sandbox's compute"))?;
            if let Some(snap) = &snap {
                self.stage_seed(snap, &rec).await?;
            }
            let spec = self.sandbox_spec(
                &rec.id,
                &template,
                rec.resources,
                rec.network_profile,
                self.egress_of(&rec)?,
            );
            let (rec, live) = self.provision(&spec, rec, None).await?;
            self.finish_lock(rec, &live, &[SandboxState::Locking], None, None)
                .await
        }
        .await;
        match restored {
            Ok((rec, _)) => {
                let rec = self.untaint(rec, loss).await;
                match &snap {
                    Some(snap) => {
                        tracing::info!(sandbox.id = %rec.id, snapshot = %snap.id, "lost sandbox recovered from its snapshot");
                        let meta = serde_json::json!({
                            "snapshot": snap.id,
                            "snapshot_taken_at": rfc3339(snap.created_at),
                            "lost_reason": loss.reason,
                        });
                        self.event(&rec, "recovered", None, meta).await?;
                        self.note(report, ReconcileAction::Recovered);
                    }
                    None => {
                        tracing::warn!(sandbox.id = %rec.id, "lost user-managed sandbox recreated from its template; its data is gone");
                        let meta = serde_json::json!({
                            "template": rec.template,
                            "data_lost": true,
                            "why": "no snapshot: the workspace and writable layer start empty",
                            "lost_reason": loss.reason,
                        });
                        self.event(&rec, "recreated", None, meta).await?;
                        self.note(report, ReconcileAction::Recreated);
                    }
                }
                Ok(())
            }
            Err(e) => {
                tracing::warn!(sandbox.id = %id, error = format!("{:#}", anyhow_of(&e)), "recovery from the snapshot failed");
                let detail = format!("recovery: {}", e.public_message());
                self.taint_or_log(&id, crate::taint::TaintCause::RestoreFailed, &detail, None)
                    .await;
                self.forget_live(&id);
                let cleanup = source.compute.destroy(&id).await;
                let _ = self.leases.revoke(&id).await;
                let mut meta =
                    serde_json::json!({"snapshot": snap_id, "error": e.public_message()});
                if let Err(c) = cleanup {
                    // reported with the original failure, never instead of it
                    meta["cleanup_error"] = serde_json::Value::String(c.to_string());
                }
                let cur = self.registry.get_sandbox(&id).await?;
                if cur.state.can_transition_to(SandboxState::Failed) {
                    self.registry
                        .transition(
                            &id,
                            cur.version,
                            &[SandboxState::Failed],
                            FenceCheck::Skip,
                            ctx("recovery_failed", meta),
                        )
                        .await?;
                }
                self.note(report, ReconcileAction::RecoveryFailed);
                Ok(())
            }
        }
    }

    /// Rule 4's return: a sandbox lost to a silent node whose compute still
    /// runs is attached again. The fence pushed is the lease store's view
    /// (none: the loss revoked the lease, so the old holder's token stays
    /// stale and envd ends its processes); then `Lost → Provisioning →
    /// Locking → Idle` — the state it was lost from, as far as the state
    /// machine and the revoked lease allow (`Leased` and `Running` come back
    /// `Idle`; their holder acquires again). An envd that does not answer
    /// yet or refuses the fence leaves it `Lost` for the next pass.
    async fn reattach(
        &self,
        rec: SandboxRecord,
        loss: &LastLoss,
        status: RuntimeStatus,
        report: &mut ReconcileReport,
    ) -> Result<(), OpError> {
        let Some(node) = self.nodes.get(&rec.node) else {
            return Ok(());
        };
        let envd = node.runtime.envd(&rec.id);
        if status == RuntimeStatus::Running {
            match tokio::time::timeout(REATTACH_ANSWER, envd.wait_ready(Duration::from_secs(2)))
                .await
            {
                Ok(Ok(())) => {}
                _ => {
                    tracing::info!(sandbox.id = %rec.id, node = %rec.node, "the lost sandbox's envd does not answer yet");
                    return Ok(());
                }
            }
        }
        let live = self.attach(&rec.id, envd, None);
        if status == RuntimeStatus::Paused {
            if self.paused_on_record(&rec.id).await? {
                // its fence push thaws, moves the fence and freezes again
                live.paused.store(true, std::sync::atomic::Ordering::SeqCst);
            } else if let Err(e) = node.runtime.runtime().resume(&rec.id).await {
                self.forget_live(&rec.id);
                return Err(OpError::runtime("thaw the re-attached sandbox")(e));
            }
        }
        if let Err(e) = self.push_fence(&rec.id, &live).await {
            self.forget_live(&rec.id);
            tracing::warn!(sandbox.id = %rec.id, error = %e, "the lost sandbox's envd did not take the fence; it stays lost");
            return Ok(());
        }
        let meta = serde_json::json!({
            "node": rec.node,
            "previous_state": loss.previous,
            "lost_reason": loss.reason,
        });
        let moved = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[
                    SandboxState::Provisioning,
                    SandboxState::Locking,
                    SandboxState::Idle,
                ],
                FenceCheck::Skip,
                ctx("reattached", meta),
            )
            .await;
        match moved {
            Ok(rec) => {
                tracing::info!(sandbox.id = %rec.id, node = %rec.node, "lost sandbox attached again");
                self.untaint(rec, loss).await;
                self.note(report, ReconcileAction::Reattached);
                Ok(())
            }
            Err(e) => {
                self.forget_live(&rec.id);
                match e {
                    aviary_registry::RegistryError::Conflict => Ok(()),
                    e => Err(e.into()),
                }
            }
        }
    }

    /// A sandbox just lost on the request path (the reuse health probe),
    /// settled now rather than on the next pass: with a snapshot it is
    /// restored on new compute (branch C), `Some` with its row once it is
    /// `Idle` and untainted again; `None` when it stays lost (no snapshot,
    /// tainted before, or a recovery that failed or must wait).
    pub(crate) async fn recover_lost_now(
        &self,
        id: &SandboxId,
    ) -> Result<Option<SandboxRecord>, OpError> {
        let rec = self.registry.get_sandbox(id).await?;
        let compute = if self.drives_own_node(&rec.node) {
            match self.local_runtime(&rec.runtime) {
                Ok(rt) => Compute::Local(rt.runtime.clone()),
                Err(_) => return Ok(None),
            }
        } else if let Some(node) = self.nodes.get(&rec.node) {
            Compute::Agent(node.runtime.runtime())
        } else {
            return Ok(None);
        };
        let source = Source {
            node: rec.node.clone(),
            runtime: None,
            compute,
            listed: None,
        };
        let _lifecycle = self.lifecycle_guard(id).await?;
        let rec = self.registry.get_sandbox(id).await?;
        if rec.state != SandboxState::Lost {
            return Ok(None);
        }
        let mut report = ReconcileReport::default();
        self.settle_lost(rec, &source, &mut report).await?;
        let rec = self.registry.get_sandbox(id).await?;
        Ok((rec.state == SandboxState::Idle && !rec.tainted).then_some(rec))
    }

    /// Puts back the taint a loss set when the sandbox was clean before it:
    /// the compute it runs on now is new (or, re-attached, fenced again), so
    /// it may be reused like any other.
    async fn untaint(&self, rec: SandboxRecord, loss: &LastLoss) -> SandboxRecord {
        if loss.was_tainted || !rec.tainted {
            return rec;
        }
        match self.registry.set_tainted(&rec.id, rec.version, false).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "could not clear the loss's taint");
                rec
            }
        }
    }

    /// The sandbox's last loss, from its events.
    async fn last_loss(&self, id: &SandboxId) -> Result<LastLoss, OpError> {
        const PAGE: u32 = 1000;
        let mut loss = LastLoss::default();
        let mut after = None;
        loop {
            let page = self
                .registry
                .list_events(&aviary_registry::EventFilter {
                    tenant: None,
                    sandbox_id: Some(id.clone()),
                    after_id: after,
                    limit: PAGE,
                    newest: false,
                })
                .await?;
            for e in &page {
                match e.event_type.as_str() {
                    "sandbox_lost" => {
                        let text = |k: &str| e.metadata[k].as_str().map(str::to_owned);
                        loss = LastLoss {
                            reason: text("reason").unwrap_or_default(),
                            cause: text("cause"),
                            previous: e.old_state,
                            was_tainted: e.metadata["was_tainted"].as_bool().unwrap_or(false),
                            judged: false,
                        };
                    }
                    "unrecoverable" => loss.judged = true,
                    _ => {}
                }
            }
            match page.last() {
                Some(last) if page.len() == PAGE as usize => after = Some(last.id),
                _ => return Ok(loss),
            }
        }
    }

    /// Rule 3: compute whose id no non-terminal row has (the registry does
    /// not know it, or knows it as terminated), seen so for
    /// `orphan_grace_s`, is destroyed.
    ///
    /// The create order (row, then compute) and this pass's order (runtimes,
    /// then registry) already keep a create in flight from looking like an
    /// orphan. The grace covers what that order cannot see: a registry read
    /// that lags a write another replica just made (a read replica, a
    /// PostgreSQL failover), compute a runtime lists while it is still
    /// being torn down after its row ended, and compute an operator or a
    /// tool starts by hand and registers a moment later. Destroying is
    /// final; waiting a minute costs a minute.
    async fn sweep_orphans(
        &self,
        sources: &[Source],
        rows: &[SandboxRecord],
        report: &mut ReconcileReport,
    ) {
        let now = Instant::now();
        let grace = Duration::from_secs(self.cfg.orphan_grace_s);
        let mut due = Vec::new();
        {
            let mut seen = self
                .reconciler
                .orphans
                .lock()
                .expect("orphan observations poisoned");
            let mut still = HashMap::new();
            for (i, s) in sources.iter().enumerate() {
                let Some(listed) = &s.listed else {
                    // not observed this pass: neither seen nor forgotten
                    for (k, since) in seen.iter() {
                        if k.0 == s.node && k.1 == s.runtime_label() {
                            still.insert(k.clone(), *since);
                        }
                    }
                    continue;
                };
                for id in listed {
                    // any non-terminal row claims its id, wherever it says
                    // the compute is (start-up destroys compute of a row
                    // that names another runtime; this pass never guesses)
                    if rows.iter().any(|r| r.id == *id) {
                        continue;
                    }
                    // a destroy answered moments ago: its reclaim is on it
                    if self.reclaims.is_reclaiming(id) {
                        continue;
                    }
                    let key = (s.node.clone(), s.runtime_label(), id.clone());
                    let since = seen.get(&key).copied().unwrap_or(now);
                    still.insert(key, since);
                    if now.duration_since(since) >= grace {
                        due.push((i, id.clone(), since));
                    }
                }
            }
            *seen = still;
        }
        for (i, id, since) in due {
            let s = &sources[i];
            // a row written since the listing claims it after all
            let known_as = match self.registry.get_sandbox(&id).await {
                Ok(r) if !r.state.is_terminal() => continue,
                Ok(_) => "terminated",
                Err(aviary_registry::RegistryError::NotFound) => "unknown",
                Err(e) => {
                    tracing::warn!(sandbox.id = %id, error = %e, "could not look the runtime sandbox up");
                    continue;
                }
            };
            tracing::warn!(sandbox.id = %id, node = %s.node, runtime = %s.runtime_label(), registry = %known_as, "destroying compute the registry does not claim");
            if let Err(e) = s.compute.destroy(&id).await {
                tracing::warn!(sandbox.id = %id, error = %e, "destroying the orphan failed; next pass tries again");
                continue;
            }
            self.reconciler
                .orphans
                .lock()
                .expect("orphan observations poisoned")
                .remove(&(s.node.clone(), s.runtime_label(), id.clone()));
            let meta = serde_json::json!({
                "node": s.node,
                "runtime": s.runtime_label(),
                "registry": known_as,
                "unclaimed_for_s": since.elapsed().as_secs(),
            });
            if let Err(e) = self
                .record_event(POOL_TENANT, Some(&id), None, "orphan_destroyed", None, meta)
                .await
            {
                tracing::warn!(sandbox.id = %id, error = %e, "could not record the destroyed orphan");
            }
            self.note(report, ReconcileAction::OrphanDestroyed);
        }
    }
}
