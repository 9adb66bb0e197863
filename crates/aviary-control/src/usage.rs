//! Live resource usage of one sandbox: its runtime's counters (memory,
//! CPU time, processes, OOM kills, free disk) beside the limits of its
//! class, for `GET /v1/sandboxes/{id}/usage`, the CLI's `sandbox usage` and
//! the console's usage panel.
//!
//! Invariants: only the caller's own sandboxes (another tenant's id is
//! `not_found`), or any tenant's for an admin asking for all tenants; only
//! a sandbox that holds compute is read (a paused one too: its counters
//! stand still), any other state is `invalid_state` and a lost one
//! `sandbox_lost`. A read changes nothing: no event, no activity touch, no
//! envd call. The counters come from the host side (cgroup files, a node
//! agent, a runtime's API), never from inside the sandbox.

use crate::context::OpContext;
use crate::error::OpError;
use crate::requests::UsageRequest;
use crate::ControlPlane;
use aviary_core::api::SandboxUsage;
use aviary_registry::SandboxRecord;
use aviary_runtime::{ResourceUsage, RuntimeError};

const MIB: u64 = 1024 * 1024;

impl ControlPlane {
    /// The live resource usage of one sandbox.
    pub async fn sandbox_usage(
        &self,
        cx: &OpContext,
        req: UsageRequest,
    ) -> Result<SandboxUsage, OpError> {
        let rec = if req.all_tenants {
            cx.require_admin("reading another tenant's sandbox")?;
            self.any_sandbox(&req.id).await?
        } else {
            self.sandbox_for(&cx.caller, &req.id).await?
        };
        Self::running(&rec)?;
        let runtime = self.runtime_for(&rec.node, &rec.runtime)?;
        let counters = match runtime.usage(&rec.id).await {
            Ok(u) => u,
            // the row says it runs, the runtime has nothing: torn down
            // under this read (a delete, a hibernate) or lost; the
            // reconciler settles which
            Err(RuntimeError::NotFound { .. }) => {
                return Err(OpError::InvalidState {
                    state: rec.state,
                    what: "its runtime holds no compute for it now".into(),
                })
            }
            Err(e) => return Err(OpError::runtime("read usage")(e)),
        };
        Ok(usage_view(&rec, &counters, aviary_core::now()))
    }
}

/// The API view of a sandbox's counters at `at`.
pub fn usage_view(
    rec: &SandboxRecord,
    u: &ResourceUsage,
    at: time::OffsetDateTime,
) -> SandboxUsage {
    let disk_limit_bytes = rec.resources.disk_mb.saturating_mul(MIB);
    SandboxUsage {
        sandbox_id: rec.id.clone(),
        state: rec.state,
        paused: rec.paused,
        cpu_seconds: u.cpu_usage_ns as f64 / 1e9,
        cpu_limit: rec.resources.cpu,
        memory_bytes: u.memory_current_bytes,
        memory_peak_bytes: u.memory_peak_bytes.max(u.memory_current_bytes),
        memory_limit_bytes: rec.resources.memory_mb.saturating_mul(MIB),
        pids: u.pids_current,
        pids_limit: u64::from(rec.resources.pids),
        oom_kills: u.oom_kills,
        disk_limit_bytes,
        disk_free_bytes: u.disk_free_bytes,
        disk_used_bytes: u
            .disk_free_bytes
            .map(|free| disk_limit_bytes.saturating_sub(free)),
        sampled_at: at,
    }
}
