//! Pause / resume, recycling level 1 (soft reset), release (end of a call),
//! the environment manifest (DESIGN §3 Recycler, §5), and lost sandboxes.
//!
//! Pause is the cgroup freezer: it is not a lifecycle state (the sandbox
//! keeps its `Idle`/`Leased` state and its lease); a paused sandbox refuses
//! exec and file calls with `invalid_state` until it is resumed. Its record
//! is the `paused` / `resumed` event pair, so a restart tells a requested
//! pause from a freeze a crash left behind (a snapshot in progress).
//!
//! A sandbox is *lost* (DESIGN §4: Running/Idle → Lost) when its envd is
//! gone (the runtime says its init exited, or its socket refuses
//! connections) or when its envd does not take the lease fence the control
//! plane pushes: then the fence cannot be enforced inside, so the sandbox
//! is never handed out again. Losing one sandbox is contained: its lease
//! is revoked, what still runs is frozen, the row goes to `Lost`, tainted,
//! with a `sandbox_lost` event, and calls on it answer `sandbox_lost` (409).
//! Detection happens on the request path (an envd call that cannot
//! connect), in the background probe, and at start-up.
//!
//! Hibernate and wake of one sandbox are serialised by the lock
//! `lifecycle/<id>` of the control plane's [`aviary_leases::Locks`]
//! ([`ControlPlane::lifecycle_guard`]). Every lock the control plane takes
//! lives [`LOCK_TTL`] and is renewed in the background while its holder
//! works, so only a crashed holder's lock runs out.

use crate::context::OpContext;
use crate::error::OpError;
use crate::ops::{ControlPlane, LiveSandbox};
use crate::requests::{ManifestRequest, OnSandbox, ResetRequest, SandboxRef, SnapshotQuery};
use crate::taint::TaintCause;
use aviary_core::api::Sandbox;
use aviary_core::SandboxId;
use aviary_core::SandboxState;
use aviary_envd_proto::EnvdError;
use aviary_envd_proto::ExecSpec;
use aviary_leases::{LockGuard, LockName, LockRequest};
use aviary_registry::{FenceCheck, SandboxRecord, TransitionCtx};
use aviary_reuse::{EnvironmentManifest, ProbeOutputs};
use aviary_runtime::RuntimeStatus;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Why a sandbox was lost (what the client and the event say).
pub(crate) const LOST_ENVD_GONE: &str = "its envd is not running";
pub(crate) const LOST_FENCE_REFUSED: &str = "its envd did not take the lease fence";
pub(crate) const LOST_COMPUTE_GONE: &str = "its compute is gone from the runtime";

/// How long a lock taken by the control plane lives without a renewal (its
/// guard renews it every third of that while held).
pub(crate) const LOCK_TTL: Duration = Duration::from_secs(30);

/// How long a hibernate or wake waits for another one of the same sandbox
/// (a wake restores a snapshot into new compute: minutes at worst).
const LIFECYCLE_WAIT: Duration = Duration::from_secs(300);

/// How long a health probe may take before it counts as "no answer" (a
/// slow envd is not declared lost for that alone).
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Level 1 reset, run inside the sandbox by envd (PID 1 survives
/// `kill -1`): every other process dies, which also closes every listening
/// port; temporary directories are emptied. `/workspace` is the user's data
/// and stays.
///
/// Then it looks for survivors: any process but PID 1, itself and its own
/// children (the `sed` it runs) that is not a zombie, for up to three
/// seconds. Survivors are printed after `survivors:` and the script exits
/// [`RESET_SURVIVORS_EXIT`]: the control plane taints the sandbox.
const SOFT_RESET_SCRIPT: &str = "kill -9 -1 2>/dev/null; \
for d in /tmp /var/tmp /dev/shm; do [ -d \"$d\" ] && find \"$d\" -mindepth 1 -maxdepth 1 -exec rm -rf {} + 2>/dev/null; done; \
left=; for try in 1 2 3 4; do left=; \
for p in /proc/[0-9]*; do p=${p#/proc/}; [ \"$p\" = 1 ] || [ \"$p\" = $$ ] && continue; \
st=$(sed -n 's/.*) \\(.\\) \\([0-9]*\\) .*/\\1 \\2/p' /proc/$p/stat 2>/dev/null); \
case \"$st\" in ''|Z*|X*|\"? $$\"|*\" $$\") ;; *) left=\"$left $p\";; esac; done; \
[ -z \"$left\" ] && break; [ $try = 4 ] || { kill -9 -1 2>/dev/null; sleep 1; }; done; \
[ -n \"$left\" ] && { echo \"survivors:$left\"; exit 7; }; \
exit 0";

/// The soft reset script's exit when processes survived it.
const RESET_SURVIVORS_EXIT: i32 = 7;

fn ctx(request_id: Option<&str>, event: &str, metadata: serde_json::Value) -> TransitionCtx {
    TransitionCtx {
        request_id: request_id.map(str::to_owned),
        event_type: Some(event.to_owned()),
        metadata,
    }
}

impl ControlPlane {
    /// Takes a lock of the control plane's [`aviary_leases::Locks`] for
    /// `purpose`, waiting up to `wait`; it is renewed while the guard lives
    /// and released when it is dropped. A wait that runs out is `conflict`.
    pub(crate) async fn hold_lock(
        &self,
        name: LockName,
        purpose: &str,
        wait: Duration,
    ) -> Result<LockGuard, OpError> {
        let owner = format!("aviary-server[{}] {purpose}", std::process::id());
        let guard = self
            .locks
            .acquire(&LockRequest::new(name, owner, LOCK_TTL), wait)
            .await?;
        Ok(guard.keep_alive())
    }

    /// The guard that serialises hibernate and wake of one sandbox.
    pub(crate) async fn lifecycle_guard(&self, id: &SandboxId) -> Result<LockGuard, OpError> {
        self.hold_lock(
            LockName::new("lifecycle", id.as_str()),
            "hibernate/wake",
            LIFECYCLE_WAIT,
        )
        .await
    }

    /// The lifecycle guard of one sandbox if nobody holds it now (the
    /// reconciler never waits: a hibernate, wake or another replica's pass
    /// working on the sandbox has it, and the next pass looks again).
    pub(crate) async fn try_lifecycle_guard(
        &self,
        id: &SandboxId,
        purpose: &str,
    ) -> Result<Option<LockGuard>, OpError> {
        let owner = format!("aviary-server[{}] {purpose}", std::process::id());
        let req = LockRequest::new(LockName::new("lifecycle", id.as_str()), owner, LOCK_TTL);
        Ok(self
            .locks
            .try_acquire(&req)
            .await?
            .map(LockGuard::keep_alive))
    }

    /// Freezes every process of the sandbox (fenced like any write).
    pub async fn pause(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let (rec, live) = self.writable(cx, &req.id).await?;
        self.runtime_for(&rec.node, &rec.runtime)?
            .pausable("pause")?
            .pause(&rec.id)
            .await
            .map_err(OpError::runtime("pause"))?;
        live.paused.store(true, Ordering::SeqCst);
        let rec = self.record_paused(&rec.id, true).await?;
        self.event(&rec, "paused", cx.request_id(), serde_json::json!({}))
            .await?;
        self.view(&rec).await
    }

    /// Records on the row whether the sandbox is paused (what `get`, `ls`
    /// and every replica show), retrying a write that raced another.
    pub(crate) async fn record_paused(
        &self,
        id: &SandboxId,
        paused: bool,
    ) -> Result<SandboxRecord, OpError> {
        for _ in 0..8 {
            let rec = self.registry.get_sandbox(id).await?;
            if rec.paused == paused {
                return Ok(rec);
            }
            match self.registry.set_paused(id, rec.version, paused).await {
                Ok(rec) => return Ok(rec),
                Err(aviary_registry::RegistryError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(OpError::Conflict)
    }

    /// Thaws a paused sandbox (fenced) and pushes it the current fence.
    pub async fn resume(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let request_id = cx.request_id();
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        Self::running(&rec)?;
        self.check_fence(&rec.id, cx.token).await?;
        let live = self.live_rec(&rec).await?;
        if !live.paused.load(Ordering::SeqCst) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is not paused".into(),
            });
        }
        self.runtime_for(&rec.node, &rec.runtime)?
            .pausable("resume")?
            .resume(&rec.id)
            .await
            .map_err(OpError::runtime("resume"))?;
        live.paused.store(false, Ordering::SeqCst);
        let rec = self.record_paused(&rec.id, false).await?;
        // the lease may have changed while envd was frozen
        self.push_fence_or_lose(&rec.id, &live, request_id).await?;
        self.event(&rec, "resumed", request_id, serde_json::json!({}))
            .await?;
        let rec = self.registry.get_sandbox(&rec.id).await?;
        self.view(&rec).await
    }

    /// Recycling at a level: 1 soft reset, 2 back to a clean checkpoint,
    /// 3 hard destroy.
    pub async fn reset_level(&self, cx: &OpContext, req: ResetRequest) -> Result<Sandbox, OpError> {
        let sandbox = SandboxRef::new(req.id);
        match req.level {
            1 => self.reset(cx, sandbox).await,
            2 => self.reset_to_checkpoint(cx, sandbox).await,
            3 => self.delete(cx, sandbox).await,
            other => Err(OpError::InvalidRequest(format!(
                "reset level must be 1, 2 or 3, got {other}"
            ))),
        }
    }

    /// Recycling level 2: the sandbox's layers are replaced by its clean
    /// checkpoint (the latest snapshot labelled `clean`, else its first one):
    /// compute stopped, layers restored, compute started, same id. The lease
    /// is revoked. `Idle|Leased → Sanitizing → Idle`.
    pub async fn reset_to_checkpoint(
        &self,
        cx: &OpContext,
        req: SandboxRef,
    ) -> Result<Sandbox, OpError> {
        let request_id = cx.request_id();
        let (rec, _live) = self.writable(cx, &req.id).await?;
        if !matches!(rec.state, SandboxState::Idle | SandboxState::Leased) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle or leased sandbox can be reset".into(),
            });
        }
        // refused before the compute is stopped
        self.layers_for(&rec, "a level-2 reset")?;
        let snaps = self
            .list_snapshots(
                cx,
                SnapshotQuery {
                    sandbox: Some(rec.id.to_string()),
                },
            )
            .await?
            .snapshots;
        let clean = snaps
            .iter()
            .rev()
            .find(|s| s.label == "clean")
            .or_else(|| snaps.first())
            .cloned()
            .ok_or_else(|| OpError::InvalidState {
                state: rec.state,
                what: "it has no checkpoint to reset to (take one with `snapshot --label clean`)"
                    .into(),
            })?;
        let fence = self.client_fence(&rec.id, cx.token).await?;
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Sanitizing],
                fence,
                ctx(
                    request_id,
                    "reset",
                    serde_json::json!({"level": 2, "snapshot": clean.id}),
                ),
            )
            .await?;
        self.leases.revoke(&rec.id).await?;
        self.forget_live(&rec.id);
        self.runtime_for(&rec.node, &rec.runtime)?
            .destroy(&rec.id)
            .await
            .map_err(OpError::runtime("stop compute for reset"))?;
        let restored = async {
            let template = self.template_info(&rec.template).await?;
            self.stage_seed(&clean, &rec).await?;
            let spec = self.sandbox_spec(
                &rec.id,
                &template,
                rec.resources,
                rec.network_profile,
                self.egress_of(&rec)?,
            );
            let (rec, live) = self.provision(&spec, rec.clone(), None).await?;
            self.finish_lock(rec, &live, &[], None, request_id).await
        }
        .await;
        let rec = match restored {
            Ok((rec, _)) => rec,
            Err(e) => {
                let detail = format!("level 2 from {}: {}", clean.id, e.public_message());
                self.taint_or_log(&rec.id, TaintCause::RestoreFailed, &detail, request_id)
                    .await;
                return Err(e);
            }
        };
        // new compute from the clean checkpoint: whatever tainted the old
        // compute is gone with it
        let rec = self
            .untaint_for(
                &rec.id,
                &format!("level 2 reset to checkpoint {}", clean.id),
                request_id,
            )
            .await?;
        self.view(&rec).await
    }

    /// Recycling level 1: kill leftover processes (closing their ports),
    /// clear temporary directories, revoke the lease (its token becomes
    /// stale); the workspace stays. `Idle|Leased → Sanitizing → Idle`.
    pub async fn reset(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let request_id = cx.request_id();
        let (rec, live) = self.writable(cx, &req.id).await?;
        if !matches!(rec.state, SandboxState::Idle | SandboxState::Leased) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle or leased sandbox can be reset".into(),
            });
        }
        let fence = self.client_fence(&rec.id, cx.token).await?;
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Sanitizing],
                fence,
                ctx(request_id, "reset", serde_json::json!({"level": 1})),
            )
            .await?;
        // the lease ends first: nothing the old holder sends is accepted
        // …and every process goes, fenced or not: the reset's own script
        // then always finds a free lane in envd.
        let fenced = match self.leases.revoke(&rec.id).await {
            Ok(()) => match self.push_fence(&rec.id, &live).await {
                Ok(()) => self.kill_all(&live).await,
                Err(e) => Err(e),
            },
            Err(e) => Err(e.into()),
        };
        if let Err(e) = fenced {
            // never stranded in Sanitizing: without its fence the sandbox
            // cannot be trusted again
            tracing::warn!(sandbox.id = %rec.id, error = %e, "reset could not fence the sandbox");
            self.forget_live(&rec.id);
            // a runtime that cannot pause has nothing to freeze with
            if let Some(p) = self
                .runtime_for(&rec.node, &rec.runtime)
                .ok()
                .and_then(|rt| rt.can_pause().cloned())
            {
                let _ = p.pause(&rec.id).await;
            }
            self.registry
                .transition(
                    &rec.id,
                    rec.version,
                    &[SandboxState::Failed],
                    FenceCheck::Skip,
                    ctx(
                        request_id,
                        "sandbox_lost",
                        serde_json::json!({"reason": LOST_FENCE_REFUSED, "during": "reset"}),
                    ),
                )
                .await?;
            self.taint_or_log(
                &rec.id,
                TaintCause::ResetFailed,
                &format!("level 1: {LOST_FENCE_REFUSED}"),
                request_id,
            )
            .await;
            return Err(OpError::SandboxLost(format!(
                "sandbox {} failed during its reset ({LOST_FENCE_REFUSED}); delete it",
                rec.id
            )));
        }
        let out = live
            .envd
            .exec_collect(
                ExecSpec {
                    argv: vec!["/bin/sh".into(), "-c".into(), SOFT_RESET_SCRIPT.into()],
                    timeout: Some(Duration::from_secs(30)),
                    ..Default::default()
                },
                None,
            )
            .await;
        let outcome = match &out {
            Ok(o) => serde_json::json!({"level": 1, "exit_code": o.exit.exit_code}),
            Err(e) => serde_json::json!({"level": 1, "error": e.to_string()}),
        };
        // a reset that did not finish, or left processes behind, leaves a
        // sandbox nobody can vouch for: it stays usable, never reusable
        let taint = match &out {
            Ok(o) if o.exit.exit_code == RESET_SURVIVORS_EXIT => {
                let text = String::from_utf8_lossy(&o.stdout);
                let pids = text
                    .lines()
                    .find_map(|l| l.strip_prefix("survivors:"))
                    .unwrap_or("")
                    .trim()
                    .chars()
                    .take(200)
                    .collect::<String>();
                let detail = format!("level 1 could not kill pids {pids}");
                Some((TaintCause::ResetSurvivors, detail))
            }
            Ok(o) if o.exit.exit_code != 0 || o.exit.timed_out => {
                let detail = format!(
                    "level 1 script exited {} (timed out: {})",
                    o.exit.exit_code, o.exit.timed_out
                );
                Some((TaintCause::ResetFailed, detail))
            }
            Ok(_) => None,
            Err(e) => {
                let detail = format!("level 1: {e}");
                Some((TaintCause::ResetFailed, detail))
            }
        };
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Idle],
                FenceCheck::Skip,
                ctx(request_id, "reset", outcome),
            )
            .await?;
        if let Some((cause, detail)) = taint {
            self.taint_or_log(&rec.id, cause, &detail, request_id).await;
        }
        let rec = self.registry.get_sandbox(&rec.id).await?;
        out?;
        self.view(&rec).await
    }

    /// Ends a call: the lease (if any) is released, the environment manifest
    /// is refreshed, and the sandbox is `Idle` again for its scope.
    pub async fn release(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        match rec.state {
            SandboxState::Leased => {
                let token = cx.token.ok_or(OpError::LeaseRequired)?;
                self.lease_release(
                    cx,
                    OnSandbox::new(req.id, aviary_core::api::ReleaseLeaseRequest { token }),
                )
                .await?;
            }
            SandboxState::Idle => {
                self.check_fence(&rec.id, cx.token).await?;
            }
            other => {
                return Err(OpError::InvalidState {
                    state: other,
                    what: "only a leased or idle sandbox can be released".into(),
                })
            }
        }
        let rec = self.registry.get_sandbox(&rec.id).await?;
        if let Ok(live) = self.live(&rec.id) {
            if let Err(e) = self.refresh_manifest(&rec, &live).await {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "manifest refresh at release failed");
            }
        }
        self.event(&rec, "released", cx.request_id(), serde_json::json!({}))
            .await?;
        self.view(&rec).await
    }

    /// The sandbox's environment manifest (probed now when `refresh` or when
    /// none is stored yet).
    pub async fn manifest(
        &self,
        cx: &OpContext,
        req: ManifestRequest,
    ) -> Result<EnvironmentManifest, OpError> {
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        if !req.refresh {
            if let Some(m) = self
                .registry
                .get_environment(&rec.id)
                .await?
                .as_ref()
                .and_then(EnvironmentManifest::from_record)
            {
                return Ok(m);
            }
        }
        if !rec.state.is_live() {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is not running, and no manifest was stored".into(),
            });
        }
        let live = self.live_rec(&rec).await?;
        self.refresh_manifest(&rec, &live).await
    }

    /// Probes the environment inside the sandbox and stores the manifest.
    pub(crate) async fn refresh_manifest(
        &self,
        rec: &SandboxRecord,
        live: &LiveSandbox,
    ) -> Result<EnvironmentManifest, OpError> {
        if live.paused.load(Ordering::SeqCst) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is paused".into(),
            });
        }
        // a leased sandbox's envd runs only what carries the current fence
        let fence = self
            .leases
            .current(&rec.id, aviary_core::now())
            .await?
            .map(|l| l.token.fence());
        let out = live
            .envd
            .exec_collect(
                ExecSpec {
                    argv: vec!["/bin/sh".into(), "-c".into(), aviary_reuse::probe_script()],
                    timeout: Some(Duration::from_secs(60)),
                    ..Default::default()
                },
                fence,
            )
            .await?;
        let outputs = ProbeOutputs::parse_script_output(&String::from_utf8_lossy(&out.stdout));
        let mut m = EnvironmentManifest::from_probe_outputs(
            rec.template_digest.clone(),
            &outputs,
            aviary_core::now(),
        );
        // what the sandbox changed outside /workspace, when the runtime shows it
        // (the host's own runtimes only: an agent's layers are on its host)
        let local = self
            .drives_own_node(&rec.node)
            .then(|| self.local_runtime(&rec.runtime).ok())
            .flatten()
            .and_then(|r| r.snapshottable.clone());
        let layers = match local {
            Some(runtime) => runtime.export_layers(&rec.id).await.ok(),
            None => None,
        };
        if let Some(layers) = layers {
            let upper = layers.writable;
            m = tokio::task::spawn_blocking(move || m.with_upper_dir(&upper))
                .await
                .map_err(OpError::internal)?
                .map_err(OpError::internal)?;
        }
        let prev = self.registry.get_environment(&rec.id).await?;
        let version = prev
            .as_ref()
            .map(|p| p.environment_version + 1)
            .unwrap_or(1);
        if let Some(p) = &prev {
            if m.last_snapshot_id.is_none() {
                m.last_snapshot_id = p.snapshot_id.clone();
            }
            // not probed: the venv a hand-out made stays the task's
            m.active_venv = EnvironmentManifest::from_record(p).and_then(|old| old.active_venv);
        }
        self.registry
            .upsert_environment(&m.to_record(rec.id.clone(), version))
            .await?;
        Ok(m)
    }
}

impl ControlPlane {
    /// Marks the sandbox lost and returns the error its caller answers with.
    /// Only a sandbox with compute in a settled state (`Ready`, `Leased`,
    /// `Running`, `Idle`, `ReuseChecking`) is moved; one that is being
    /// created, reset or deleted belongs to that operation, which fails on
    /// its own.
    pub(crate) async fn mark_lost(
        &self,
        id: &SandboxId,
        reason: &str,
        request_id: Option<&str>,
    ) -> OpError {
        match self
            .lose(id, reason, request_id, serde_json::Map::new())
            .await
        {
            Ok(_) => OpError::SandboxLost(format!(
                "sandbox {id} is lost ({reason}); delete it and create a new one"
            )),
            Err(e) => e,
        }
    }

    /// [`Self::mark_lost`]'s work: `Ok(true)` when this call moved the
    /// sandbox (to `Lost`, or `Failed` from `ReuseChecking`), `Ok(false)`
    /// when it already was lost or failed. The `sandbox_lost` event carries
    /// `reason`, whether what still runs was frozen, whether the sandbox was
    /// tainted before (a recovery puts that back), and `extra` (the
    /// reconciler's cause and node).
    pub(crate) async fn lose(
        &self,
        id: &SandboxId,
        reason: &str,
        request_id: Option<&str>,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<bool, OpError> {
        for _ in 0..8 {
            let rec = self.registry.get_sandbox(id).await?;
            let to = if rec.state.can_transition_to(SandboxState::Lost) {
                SandboxState::Lost
            } else if rec.state == SandboxState::ReuseChecking {
                SandboxState::Failed
            } else if matches!(rec.state, SandboxState::Lost | SandboxState::Failed) {
                return Ok(false);
            } else {
                return Err(OpError::Unavailable(format!(
                    "sandbox {id} is {}: its envd does not answer",
                    rec.state
                )));
            };
            self.forget_live(id);
            // its token is void: envd may never have been told about a newer one
            let _ = self.leases.revoke(id).await;
            // without a fence envd enforces, nothing in it may keep running
            let frozen = match self.runtime_for(&rec.node, &rec.runtime) {
                Ok(rt) => match rt.status(id).await {
                    // a runtime that cannot pause leaves it running (it is
                    // never paused, so it is never found frozen either)
                    Ok(RuntimeStatus::Running) => match rt.can_pause() {
                        Some(p) => p.pause(id).await.is_ok(),
                        None => false,
                    },
                    Ok(RuntimeStatus::Paused) => true,
                    _ => false,
                },
                Err(_) => false,
            };
            tracing::warn!(sandbox.id = %id, reason, frozen, "sandbox lost");
            let mut meta = serde_json::json!({
                "reason": reason,
                "frozen": frozen,
                "was_tainted": rec.tainted,
            });
            if let Some(m) = meta.as_object_mut() {
                m.extend(extra.clone());
            }
            match self
                .registry
                .transition(
                    id,
                    rec.version,
                    &[to],
                    FenceCheck::Skip,
                    ctx(request_id, "sandbox_lost", meta),
                )
                .await
            {
                Ok(_) => {
                    let cause = if reason == LOST_FENCE_REFUSED {
                        TaintCause::EnvdProtocol
                    } else {
                        TaintCause::EnvdDied
                    };
                    self.taint_or_log(id, cause, reason, request_id).await;
                    return Ok(true);
                }
                Err(aviary_registry::RegistryError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(OpError::Conflict)
    }

    /// True when the sandbox's envd is gone for good: its runtime says the
    /// init exited, or (local sandboxes) its socket refuses connections. A
    /// slow or busy envd is not gone.
    pub(crate) async fn envd_is_gone(
        &self,
        rec: &SandboxRecord,
        live: Option<&LiveSandbox>,
    ) -> bool {
        let Ok(rt) = self.runtime_for(&rec.node, &rec.runtime) else {
            return false;
        };
        match rt.status(&rec.id).await {
            Ok(RuntimeStatus::Stopped | RuntimeStatus::NotFound) => true,
            Ok(RuntimeStatus::Running) if rec.node == self.cfg.local_node => {
                let Some(live) = live else {
                    return false;
                };
                matches!(
                    tokio::time::timeout(PROBE_TIMEOUT, live.envd.health()).await,
                    Ok(Err(EnvdError::Connect(e)))
                        if matches!(e.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound)
                )
            }
            _ => false,
        }
    }

    /// The result of an envd call, failures mapped by [`Self::envd_failed`].
    pub(crate) async fn via_envd<T>(
        &self,
        rec: &SandboxRecord,
        live: &LiveSandbox,
        r: Result<T, EnvdError>,
    ) -> Result<T, OpError> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => Err(self.envd_failed(rec, live, e).await),
        }
    }

    /// A failed envd call: a connection failure is checked, and a sandbox
    /// whose envd is gone is marked lost (`sandbox_lost`, never a 500).
    pub(crate) async fn envd_failed(
        &self,
        rec: &SandboxRecord,
        live: &LiveSandbox,
        e: EnvdError,
    ) -> OpError {
        if matches!(e, EnvdError::Connect(_) | EnvdError::Transport(_))
            && self.envd_is_gone(rec, Some(live)).await
        {
            return self.mark_lost(&rec.id, LOST_ENVD_GONE, None).await;
        }
        if matches!(e, EnvdError::Protocol(_) | EnvdError::PeerMismatch { .. }) {
            // an honest envd never sends this: what answers is not trusted
            self.taint_or_log(&rec.id, TaintCause::EnvdProtocol, &e.to_string(), None)
                .await;
        }
        e.into()
    }

    /// Pushes the lease store's current view to the sandbox's envd; when
    /// envd does not take it, the sandbox is marked lost (its old holder's
    /// processes could otherwise go on under a fence nobody enforces).
    pub(crate) async fn push_fence_or_lose(
        &self,
        id: &SandboxId,
        live: &LiveSandbox,
        request_id: Option<&str>,
    ) -> Result<(), OpError> {
        match self.push_fence(id, live).await {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::warn!(sandbox.id = %id, error = %e, "envd did not take the fence");
                Err(self.mark_lost(id, LOST_FENCE_REFUSED, request_id).await)
            }
        }
    }

    /// The background health probe: every attached, unpaused sandbox's envd
    /// is asked for its health; one that is gone makes its sandbox lost.
    /// One health call to a sandbox's envd: true when nothing answers on its
    /// socket (connect or transport failure). A slow or busy envd is not
    /// unreachable.
    pub(crate) async fn envd_unreachable(id: &SandboxId, live: &LiveSandbox) -> bool {
        match tokio::time::timeout(PROBE_TIMEOUT, live.envd.health()).await {
            Ok(Ok(_)) => false,
            Ok(Err(EnvdError::Connect(_) | EnvdError::Transport(_))) => true,
            Ok(Err(e)) => {
                tracing::debug!(sandbox.id = %id, error = %e, "envd health probe");
                false
            }
            Err(_) => {
                tracing::debug!(sandbox.id = %id, "envd health probe timed out");
                false
            }
        }
    }

    pub async fn probe_envds(&self) {
        for (id, live) in self.live_snapshot() {
            if live.paused.load(Ordering::SeqCst) {
                continue;
            }
            if !Self::envd_unreachable(&id, &live).await {
                continue;
            }
            let Ok(rec) = self.registry.get_sandbox(&id).await else {
                continue;
            };
            // only a settled sandbox still attached as probed (not one a
            // create, reset or delete is working on)
            let settled = matches!(
                rec.state,
                SandboxState::Ready
                    | SandboxState::Leased
                    | SandboxState::Running
                    | SandboxState::Idle
            );
            let same = || self.live_opt(&id).is_some_and(|l| Arc::ptr_eq(&l, &live));
            if !settled || !same() {
                continue;
            }
            // not one a hibernate, wake or live fork is working on (a live
            // fork saves and restores its parent: its envd is away meanwhile
            // while the row stays `Leased`); the next probe looks again
            let Ok(Some(_lifecycle)) = self.try_lifecycle_guard(&id, "envd probe").await else {
                continue;
            };
            if same() && self.envd_is_gone(&rec, Some(&live)).await {
                let _ = self.mark_lost(&id, LOST_ENVD_GONE, None).await;
            }
        }
    }

    /// Whether the sandbox's last pause/resume event is a pause: a frozen
    /// cgroup without one was left by a crash (e.g. during a snapshot).
    pub(crate) async fn paused_on_record(&self, id: &SandboxId) -> Result<bool, OpError> {
        let mut after = None;
        let mut paused = false;
        loop {
            let page = self
                .registry
                .list_events(&aviary_registry::EventFilter {
                    tenant: None,
                    sandbox_id: Some(id.clone()),
                    after_id: after,
                    limit: 1000,
                    newest: false,
                })
                .await?;
            let Some(last) = page.last() else {
                return Ok(paused);
            };
            after = Some(last.id);
            for e in &page {
                match e.event_type.as_str() {
                    "paused" => paused = true,
                    "resumed" => paused = false,
                    _ => {}
                }
            }
        }
    }
}
