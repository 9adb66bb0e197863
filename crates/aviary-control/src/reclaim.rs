//! Destroy off the request path (issue 12): a destroy is answered once the
//! sandbox is out of reach — its row `Terminated`, its lease revoked, its
//! envd client forgotten, its network cut ([`aviary_runtime::Runtime::quiesce`])
//! — and its compute (the OCI runtime's `delete`, mounts, disk image, id
//! range, cgroup) is reclaimed by a background task.
//!
//! Never leaking: the `Terminated` transition's event says
//! `"compute": "reclaiming"`; the task then writes `compute_reclaimed` (or
//! `compute_reclaim_failed` with the error). Compute a runtime still lists
//! whose row is terminated is a leftover by definition: start-up
//! (`reconcile_on_start`) destroys it at once (event `compute_reclaimed`,
//! `"by": "start-up"`), and the periodic reconciler after its orphan grace —
//! so a crash between the answer and the reclaim, or a reclaim that failed,
//! is healed. A pass never races a reclaim in flight in this process: it
//! skips the ids in [`Reclaims`].
//!
//! Concurrency: one task per destroyed sandbox; [`Reclaims`] is shared with
//! the tasks (an `Arc` inside). [`Reclaims::hold`] stops tasks from starting
//! their work until the hold is dropped — the seam the crash test uses to
//! stop the server with reclaims pending.

use aviary_core::SandboxId;
use aviary_registry::{AllocationUsage, NewEvent, Registry, SandboxRecord};
use aviary_runtime::Runtime;
use std::collections::HashSet;
use std::sync::{Arc, Mutex as StdMutex};

/// The background reclaims of this control plane.
#[derive(Clone, Default)]
pub struct Reclaims {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    in_flight: StdMutex<HashSet<SandboxId>>,
    settled: tokio::sync::Notify,
    gate: Arc<tokio::sync::RwLock<()>>,
}

/// While held, no reclaim starts its work (see [`Reclaims::hold`]).
pub struct ReclaimHold(#[allow(dead_code)] tokio::sync::OwnedRwLockWriteGuard<()>);

/// The sandbox's allocation row, where [`record_usage`] writes what it
/// used: read from the cgroups before the answer (the telemetry
/// right-sizing reads is there when the destroy is answered).
pub(crate) struct UsageTarget {
    pub allocation_id: i64,
    pub timed_out: bool,
}

impl Reclaims {
    /// How many reclaims are in flight.
    pub fn in_flight(&self) -> usize {
        self.inner
            .in_flight
            .lock()
            .expect("reclaims poisoned")
            .len()
    }

    /// Whether `id`'s compute is being reclaimed by this process now.
    pub fn is_reclaiming(&self, id: &SandboxId) -> bool {
        self.inner
            .in_flight
            .lock()
            .expect("reclaims poisoned")
            .contains(id)
    }

    /// Waits until no reclaim is in flight.
    pub async fn settled(&self) {
        loop {
            let notified = self.inner.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Keeps every reclaim from starting its work until the guard drops
    /// (tests: a server stopped with reclaims pending is a crash between
    /// the answer and the reclaim).
    pub async fn hold(&self) -> ReclaimHold {
        ReclaimHold(self.inner.gate.clone().write_owned().await)
    }

    /// Registers `id` as in flight (before its row becomes `Terminated`,
    /// so no reconciler pass sees terminated compute without it).
    pub(crate) fn begin(&self, id: &SandboxId) {
        self.inner
            .in_flight
            .lock()
            .expect("reclaims poisoned")
            .insert(id.clone());
    }

    /// Reclaims `rec`'s compute in the background: the runtime's destroy,
    /// then one event. `refill` is told when done (a pool may refill).
    pub(crate) fn spawn(
        &self,
        rec: SandboxRecord,
        runtime: Arc<dyn Runtime>,
        registry: Arc<dyn Registry>,
        refill: Arc<tokio::sync::Notify>,
    ) {
        let this = self.clone();
        tokio::spawn(async move {
            let gate = this.inner.gate.clone();
            let _open = gate.read().await;
            let destroyed = runtime.destroy(&rec.id).await;
            let (event, meta) = match &destroyed {
                Ok(()) => ("compute_reclaimed", serde_json::json!({})),
                Err(e) => {
                    tracing::warn!(sandbox.id = %rec.id, error = %e, "reclaiming the compute failed; the reconciler destroys what is left");
                    (
                        "compute_reclaim_failed",
                        serde_json::json!({"error": format!("{e:#}")}),
                    )
                }
            };
            let ev = NewEvent {
                sandbox_id: Some(rec.id.clone()),
                tenant: rec.tenant.clone(),
                event_type: event.into(),
                old_state: None,
                new_state: None,
                request_id: None,
                metadata: meta,
            };
            if let Err(e) = registry.append_event(ev).await {
                tracing::warn!(sandbox.id = %rec.id, error = %e, "could not record the reclaim");
            }
            this.inner
                .in_flight
                .lock()
                .expect("reclaims poisoned")
                .remove(&rec.id);
            this.inner.settled.notify_waiters();
            refill.notify_one();
        });
    }
}

/// Telemetry for right-sizing: what the sandbox really used, written to
/// its allocation row at the end of its life. cgroup v1 has no CPU peak,
/// so `peak_cpu` is the mean number of cores used over the lifetime.
pub(crate) async fn record_usage(
    registry: &dyn Registry,
    runtime: &dyn Runtime,
    rec: &SandboxRecord,
    target: &UsageTarget,
) {
    if target.allocation_id < 0 {
        return;
    }
    let Ok(u) = runtime.usage(&rec.id).await else {
        return;
    };
    let lifetime = (aviary_core::now() - rec.created_at)
        .as_seconds_f64()
        .max(0.001);
    let usage = AllocationUsage {
        duration_s: lifetime,
        peak_cpu: u.cpu_usage_ns as f64 / 1e9 / lifetime,
        peak_memory_mb: u.memory_peak_bytes.div_ceil(1 << 20),
        oom: u.oom_kills > 0,
        timed_out: target.timed_out,
    };
    if let Err(e) = registry
        .update_allocation_usage(target.allocation_id, &usage)
        .await
    {
        tracing::warn!(sandbox.id = %rec.id, error = %e, "could not record usage");
    }
}
