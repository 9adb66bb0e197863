//! What taints a sandbox (DESIGN §1.5: reuse needs an untainted sandbox).
//!
//! A tainted sandbox is one the control plane no longer trusts to serve
//! another call: the reuse checker never hands it out again, a warm pool
//! never takes it back, and a scope's next create gets other compute. Each
//! cause is one [`TaintCause`], set through [`ControlPlane::taint`], which
//! marks the row (version-checked, retried on a race) and writes one
//! `tainted` event naming the cause and what was seen:
//!
//! - `stale_token`: a stale or foreign lease token was used against it (a
//!   fence check refused it: the caller is not who holds the sandbox now);
//! - `envd_died`, `envd_protocol`: its envd is gone (the loss path), or
//!   answered outside its protocol (a frame it cannot have sent honestly);
//! - `reset_failed`, `snapshot_failed`, `restore_failed`: a recycle or
//!   checkpoint that failed or was interrupted leaves a state nobody can
//!   describe;
//! - `reset_survivors`: processes a level-1 reset could not kill;
//! - `memory_limit`, `disk_limit`: an OOM kill, or a full disk, while the
//!   sandbox is shared (user, agent or global scope): one caller's work
//!   may have left the next one's in a broken state;
//! - `operator`: `POST /v1/sandboxes/{id}/taint {"reason": …}` (CLI
//!   `aviary sandbox taint ID --reason …`);
//! - `egress_denied`: the network layer's hook ([`ControlPlane::egress_denied`]),
//!   called for every refusal of the node's egress proxy (`allowlist`).
//!
//! Clearing: a level-1 reset keeps the mark (the processes and files it
//! leaves are the same sandbox's); a level-2 reset (new compute from the
//! clean checkpoint) clears it, with an `untainted` event; level 3 ends the
//! sandbox. Recovering lost compute from a snapshot clears the mark the loss
//! set, never one set before the loss (`reconciler`).

use crate::context::OpContext;
use crate::error::OpError;
use crate::ops::ControlPlane;
use crate::requests::OnSandbox;
use aviary_core::api::Sandbox;
use aviary_core::SandboxId;
use aviary_registry::{RegistryError, SandboxRecord};
use serde::{Deserialize, Serialize};

/// Why a sandbox was tainted (the `cause` of its `tainted` event).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaintCause {
    StaleToken,
    EnvdDied,
    EnvdProtocol,
    ResetFailed,
    SnapshotFailed,
    RestoreFailed,
    ResetSurvivors,
    MemoryLimit,
    DiskLimit,
    Operator,
    EgressDenied,
}

impl TaintCause {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintCause::StaleToken => "stale_token",
            TaintCause::EnvdDied => "envd_died",
            TaintCause::EnvdProtocol => "envd_protocol",
            TaintCause::ResetFailed => "reset_failed",
            TaintCause::SnapshotFailed => "snapshot_failed",
            TaintCause::RestoreFailed => "restore_failed",
            TaintCause::ResetSurvivors => "reset_survivors",
            TaintCause::MemoryLimit => "memory_limit",
            TaintCause::DiskLimit => "disk_limit",
            TaintCause::Operator => "operator",
            TaintCause::EgressDenied => "egress_denied",
        }
    }
}

impl std::fmt::Display for TaintCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `POST /v1/sandboxes/{id}/taint`: an operator's mark.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaintRequest {
    /// Why (1–512 characters, no control characters); recorded in the event.
    pub reason: String,
}

/// Longest operator reason accepted.
const MAX_REASON: usize = 512;

impl ControlPlane {
    /// Marks the sandbox tainted for `cause` and records a `tainted` event
    /// (`cause`, `detail`, `was_tainted`). Retries a write that raced
    /// another; `Ok(false)` when the sandbox is gone (nothing to protect).
    pub async fn taint(
        &self,
        id: &SandboxId,
        cause: TaintCause,
        detail: &str,
        request_id: Option<&str>,
    ) -> Result<bool, OpError> {
        for _ in 0..8 {
            let rec = match self.registry.get_sandbox(id).await {
                Ok(r) => r,
                Err(RegistryError::NotFound) => return Ok(false),
                Err(e) => return Err(e.into()),
            };
            if rec.state.is_terminal() {
                return Ok(false);
            }
            let was = rec.tainted;
            let rec = if was {
                rec
            } else {
                match self.registry.set_tainted(id, rec.version, true).await {
                    Ok(r) => r,
                    Err(RegistryError::Conflict) => continue,
                    Err(e) => return Err(e.into()),
                }
            };
            tracing::warn!(sandbox.id = %id, cause = cause.as_str(), detail, "sandbox tainted");
            self.event(
                &rec,
                "tainted",
                request_id,
                serde_json::json!({"cause": cause.as_str(), "detail": detail, "was_tainted": was}),
            )
            .await?;
            return Ok(true);
        }
        Err(OpError::Conflict)
    }

    /// [`Self::taint`] from a path that is already failing: a failure to
    /// taint is logged, never returned instead of the original error.
    pub(crate) async fn taint_or_log(
        &self,
        id: &SandboxId,
        cause: TaintCause,
        detail: &str,
        request_id: Option<&str>,
    ) {
        if let Err(e) = self.taint(id, cause, detail, request_id).await {
            tracing::error!(sandbox.id = %id, cause = cause.as_str(), error = %e, "could not taint the sandbox");
        }
    }

    /// Clears the mark (a level-2 reset put the sandbox on new compute
    /// from its clean checkpoint), with an `untainted` event.
    pub(crate) async fn untaint_for(
        &self,
        id: &SandboxId,
        why: &str,
        request_id: Option<&str>,
    ) -> Result<SandboxRecord, OpError> {
        for _ in 0..8 {
            let rec = self.registry.get_sandbox(id).await?;
            if !rec.tainted {
                return Ok(rec);
            }
            match self.registry.set_tainted(id, rec.version, false).await {
                Ok(rec) => {
                    self.event(
                        &rec,
                        "untainted",
                        request_id,
                        serde_json::json!({"reason": why}),
                    )
                    .await?;
                    return Ok(rec);
                }
                Err(RegistryError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(OpError::Conflict)
    }

    /// The network layer's hook: something inside the sandbox tried egress
    /// its network profile denies (the node's egress proxy reports it). One
    /// `egress_denied` event (sandbox, profile, host, port, method, reason),
    /// then the sandbox is tainted. `Ok(false)` when the sandbox is gone.
    pub async fn egress_denied(
        &self,
        denial: &aviary_core::egress::EgressDenial,
    ) -> Result<bool, OpError> {
        let rec = match self.registry.get_sandbox(&denial.sandbox).await {
            Ok(r) => r,
            Err(RegistryError::NotFound) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        self.event(
            &rec,
            "egress_denied",
            None,
            serde_json::json!({
                "sandbox": denial.sandbox, "profile": denial.profile, "host": denial.host,
                "port": denial.port, "method": denial.method, "reason": denial.reason,
            }),
        )
        .await?;
        let what = format!(
            "{} {}:{}: {}",
            denial.method, denial.host, denial.port, denial.reason
        );
        self.taint(&denial.sandbox, TaintCause::EgressDenied, &what, None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/taint`: an operator (any caller of the
    /// sandbox's tenant) marks it. No lease is needed: marking a sandbox
    /// untrusted only ever takes reuse away.
    pub async fn taint_sandbox(
        &self,
        cx: &OpContext,
        req: OnSandbox<TaintRequest>,
    ) -> Result<Sandbox, OpError> {
        let reason = req.request.reason.trim();
        if reason.is_empty()
            || reason.chars().count() > MAX_REASON
            || reason.chars().any(char::is_control)
        {
            return Err(OpError::InvalidRequest(format!(
                "reason must be 1-{MAX_REASON} characters without control characters"
            )));
        }
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        if rec.state.is_terminal() {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it has ended".into(),
            });
        }
        let detail = reason.to_owned();
        self.taint(&rec.id, TaintCause::Operator, &detail, cx.request_id())
            .await?;
        let rec = self.registry.get_sandbox(&rec.id).await?;
        self.view(&rec).await
    }
}
