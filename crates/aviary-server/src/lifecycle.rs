//! Pause / resume, recycling level 1 (soft reset), release (end of a call)
//! and the environment manifest (DESIGN §3 Recycler, §5).
//!
//! Pause is the cgroup freezer: it is not a lifecycle state (the sandbox
//! keeps its `Idle`/`Leased` state and its lease); a paused sandbox refuses
//! exec and file calls with `invalid_state` until it is resumed.

use crate::error::OpError;
use crate::ops::{Caller, ControlPlane, LiveSandbox};
use aviary_core::api::Sandbox;
use aviary_core::{LeaseToken, SandboxState};
use aviary_envd_proto::ExecSpec;
use aviary_registry::{FenceCheck, SandboxRecord, TransitionCtx};
use aviary_reuse::{EnvironmentManifest, ProbeOutputs};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Level 1 reset, run inside the sandbox by envd (PID 1 survives
/// `kill -1`): every other process dies, which also closes every listening
/// port; temporary directories are emptied. `/workspace` is the user's data
/// and stays.
const SOFT_RESET_SCRIPT: &str = "kill -9 -1 2>/dev/null; \
for d in /tmp /var/tmp /dev/shm; do [ -d \"$d\" ] && find \"$d\" -mindepth 1 -maxdepth 1 -exec rm -rf {} + 2>/dev/null; done; \
exit 0";

fn ctx(request_id: Option<&str>, event: &str, metadata: serde_json::Value) -> TransitionCtx {
    TransitionCtx {
        request_id: request_id.map(str::to_owned),
        event_type: Some(event.to_owned()),
        metadata,
    }
}

impl ControlPlane {
    /// Freezes every process of the sandbox (fenced like any write).
    pub async fn pause(
        &self,
        caller: &Caller,
        id: &str,
        token: Option<LeaseToken>,
        request_id: Option<&str>,
    ) -> Result<Sandbox, OpError> {
        let (rec, live) = self.writable(caller, id, token).await?;
        self.runtime_for(&rec.node)?
            .pause(&rec.id)
            .await
            .map_err(|e| OpError::Internal(anyhow::Error::new(e).context("pause")))?;
        live.paused.store(true, Ordering::SeqCst);
        self.event(&rec, "paused", request_id, serde_json::json!({}))
            .await?;
        self.view(&rec).await
    }

    pub async fn resume(
        &self,
        caller: &Caller,
        id: &str,
        token: Option<LeaseToken>,
        request_id: Option<&str>,
    ) -> Result<Sandbox, OpError> {
        let rec = self.sandbox_for(caller, id).await?;
        if !rec.state.is_live() {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is not running".into(),
            });
        }
        self.check_fence(&rec.id, token).await?;
        let live = self.live(&rec.id)?;
        if !live.paused.load(Ordering::SeqCst) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is not paused".into(),
            });
        }
        self.runtime_for(&rec.node)?
            .resume(&rec.id)
            .await
            .map_err(|e| OpError::Internal(anyhow::Error::new(e).context("resume")))?;
        live.paused.store(false, Ordering::SeqCst);
        // the lease may have changed while envd was frozen
        self.push_fence(&rec.id, &live).await?;
        self.event(&rec, "resumed", request_id, serde_json::json!({}))
            .await?;
        self.view(&rec).await
    }

    /// Recycling at a level: 1 soft reset, 2 back to a clean checkpoint,
    /// 3 hard destroy.
    pub async fn reset_level(
        &self,
        caller: &Caller,
        id: &str,
        token: Option<LeaseToken>,
        level: u8,
        request_id: Option<&str>,
    ) -> Result<Sandbox, OpError> {
        match level {
            1 => self.reset(caller, id, token, request_id).await,
            2 => {
                self.reset_to_checkpoint(caller, id, token, request_id)
                    .await
            }
            3 => self.delete(caller, id, token, request_id).await,
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
        caller: &Caller,
        id: &str,
        token: Option<LeaseToken>,
        request_id: Option<&str>,
    ) -> Result<Sandbox, OpError> {
        let (rec, _live) = self.writable(caller, id, token).await?;
        if !matches!(rec.state, SandboxState::Idle | SandboxState::Leased) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle or leased sandbox can be reset".into(),
            });
        }
        Self::require_local(&rec, "a level-2 reset")?;
        let snaps = self
            .list_snapshots(caller, Some(rec.id.as_str()))
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
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Sanitizing],
                FenceCheck::Require(token),
                ctx(
                    request_id,
                    "reset",
                    serde_json::json!({"level": 2, "snapshot": clean.id}),
                ),
            )
            .await?;
        self.leases.revoke(&rec.id).await?;
        self.forget_live(&rec.id);
        self.runtime.destroy(&rec.id).await.map_err(|e| {
            OpError::Internal(anyhow::Error::new(e).context("stop compute for reset"))
        })?;
        let template = self.template_info(&rec.template).await?;
        self.stage_seed(&clean, &rec.id).await?;
        let spec = self.sandbox_spec(&rec.id, &template, rec.resources, rec.network_profile);
        let (rec, live) = self.provision(&spec, rec, None).await?;
        let (rec, _) = self.finish_lock(rec, &live, &[], None, request_id).await?;
        self.view(&rec).await
    }

    /// Recycling level 1: kill leftover processes (closing their ports),
    /// clear temporary directories, revoke the lease (its token becomes
    /// stale); the workspace stays. `Idle|Leased → Sanitizing → Idle`.
    pub async fn reset(
        &self,
        caller: &Caller,
        id: &str,
        token: Option<LeaseToken>,
        request_id: Option<&str>,
    ) -> Result<Sandbox, OpError> {
        let (rec, live) = self.writable(caller, id, token).await?;
        if !matches!(rec.state, SandboxState::Idle | SandboxState::Leased) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle or leased sandbox can be reset".into(),
            });
        }
        let rec = self
            .registry
            .transition(
                &rec.id,
                rec.version,
                &[SandboxState::Sanitizing],
                FenceCheck::Require(token),
                ctx(request_id, "reset", serde_json::json!({"level": 1})),
            )
            .await?;
        // the lease ends first: nothing the old holder sends is accepted
        self.leases.revoke(&rec.id).await?;
        self.push_fence(&rec.id, &live).await?;
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
        out?;
        self.view(&rec).await
    }

    /// Ends a call: the lease (if any) is released, the environment manifest
    /// is refreshed, and the sandbox is `Idle` again for its scope.
    pub async fn release(
        &self,
        caller: &Caller,
        id: &str,
        token: Option<LeaseToken>,
        request_id: Option<&str>,
    ) -> Result<Sandbox, OpError> {
        let rec = self.sandbox_for(caller, id).await?;
        match rec.state {
            SandboxState::Leased => {
                let token = token.ok_or(OpError::LeaseRequired)?;
                self.lease_release(
                    caller,
                    id,
                    aviary_core::api::ReleaseLeaseRequest { token },
                    request_id,
                )
                .await?;
            }
            SandboxState::Idle => {
                self.check_fence(&rec.id, token).await?;
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
        self.event(&rec, "released", request_id, serde_json::json!({}))
            .await?;
        self.view(&rec).await
    }

    /// The sandbox's environment manifest (probed now when `refresh` or when
    /// none is stored yet).
    pub async fn manifest(
        &self,
        caller: &Caller,
        id: &str,
        refresh: bool,
    ) -> Result<EnvironmentManifest, OpError> {
        let rec = self.sandbox_for(caller, id).await?;
        if !refresh {
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
        let live = self.live(&rec.id)?;
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
        let out = live
            .envd
            .exec_collect(
                ExecSpec {
                    argv: vec!["/bin/sh".into(), "-c".into(), aviary_reuse::probe_script()],
                    timeout: Some(Duration::from_secs(60)),
                    ..Default::default()
                },
                None,
            )
            .await?;
        let outputs = ProbeOutputs::parse_script_output(&String::from_utf8_lossy(&out.stdout));
        let mut m = EnvironmentManifest::from_probe_outputs(
            rec.template_digest.clone(),
            &outputs,
            aviary_core::now(),
        );
        let upper = self
            .cfg
            .runtime_state_dir()
            .join(rec.id.as_str())
            .join("upper");
        if upper.is_dir() {
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
        }
        self.registry
            .upsert_environment(&m.to_record(rec.id.clone(), version))
            .await?;
        Ok(m)
    }
}
