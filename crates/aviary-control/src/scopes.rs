//! Isolation scopes and safe reuse (DESIGN §1.5, §5; seed 000).
//!
//! A create that says who the sandbox is for (user / session / agent ids,
//! or `scope: global`) lands in a *scope bucket*. Creates for one bucket are
//! serialized by an execution guard (the lock `bucket/<bucket>` of the
//! control plane's [`aviary_leases::Locks`], held with a TTL that a live
//! holder keeps renewing; a create that waits longer than [`BUCKET_WAIT`]
//! answers `conflict`); an existing sandbox of the bucket is
//! reused only when the reuse checker proves it compatible (same tenant and
//! security context, compatible environment manifest, healthy, untainted).
//! Shared scopes (user, agent, global) hand the sandbox out under a lease:
//! a second caller waits until the first releases (or the lease expires).
//! SESSION is safe by construction and needs no lease.

use crate::context::{Caller, OpContext};
use crate::error::OpError;
use crate::ops::ControlPlane;
use crate::requests::OnSandbox;
use aviary_core::api::{CreateSandboxRequest, CreateSandboxResponse, Decision, Lease};
use aviary_core::{SandboxState, Scope};
use aviary_leases::{LockGuard, LockName};
use aviary_reuse::{
    EnvironmentManifest, EnvironmentRequirements, ReuseAction, ReuseCandidate, ReuseChecker,
    ReuseRequest,
};
use std::time::{Duration, Instant};

/// How long a create waits for a shared sandbox's lease before answering
/// `lease_held`.
const SHARED_WAIT: Duration = Duration::from_secs(30);

/// How long a create waits for its bucket's execution guard (held by
/// another create of the same bucket, which may itself wait up to
/// [`SHARED_WAIT`] for a lease and then wake or create a sandbox).
pub(crate) const BUCKET_WAIT: Duration = Duration::from_secs(300);

/// The outcome of looking into a bucket.
pub(crate) enum BucketOutcome {
    Reused(Box<CreateSandboxResponse>),
    /// No sandbox could be reused; why (for the create's decision).
    New(Decision),
}

pub(crate) fn requirements(req: &CreateSandboxRequest) -> Result<EnvironmentRequirements, OpError> {
    let Some(ctx) = &req.intent else {
        return Ok(EnvironmentRequirements::default());
    };
    let list = |k: &str| -> Vec<String> {
        ctx.get(k)
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let flag = |k: &str| ctx.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    EnvironmentRequirements::from_task(
        &list("languages"),
        &list("dependencies"),
        flag("needs_browser"),
        flag("needs_gpu"),
        flag("needs_compile"),
    )
    .map_err(|e| OpError::InvalidRequest(format!("dependencies: {e}")))
}

impl ControlPlane {
    /// The bucket of a create, when it names who the sandbox is for.
    pub(crate) fn bucket_of(
        &self,
        caller: &Caller,
        req: &CreateSandboxRequest,
        scope: Scope,
    ) -> Result<Option<String>, OpError> {
        if req.user_id.is_none()
            && req.session_id.is_none()
            && req.agent.is_none()
            && req.scope.is_none()
        {
            return Ok(None);
        }
        aviary_reuse::scope_bucket(
            scope,
            &caller.tenant,
            req.user_id.as_deref(),
            req.session_id.as_deref(),
            req.agent.as_deref(),
        )
        .map(Some)
        .map_err(OpError::from)
    }

    /// The execution guard of a bucket (held for the whole find-or-create;
    /// released when dropped).
    pub(crate) async fn bucket_guard(&self, bucket: &str) -> Result<LockGuard, OpError> {
        self.hold_lock(LockName::new("bucket", bucket), "create", BUCKET_WAIT)
            .await
    }

    /// Looks for a reusable sandbox in the bucket and hands it out.
    pub(crate) async fn reuse_in_bucket(
        &self,
        stage: &crate::ops::CreateStage<'_>,
        bucket: &str,
    ) -> Result<BucketOutcome, OpError> {
        let crate::ops::CreateStage { cx, req, scope, .. } = *stage;
        let (caller, request_id) = (&cx.caller, cx.request_id());
        let template_digest = stage.template.digest.as_str();
        let class = stage.approved.class.as_str();
        let network = stage.approved.network;
        let lease_req = stage.lease_req.clone();
        let request = ReuseRequest::from_create(
            &caller.tenant,
            req,
            template_digest,
            &stage.approved.runtime,
            class,
            network,
            requirements(req)?,
        );
        // a shared scope's sandbox in use by another caller: wait for it
        // (the lease is the execution guard), then judge it like any other
        let start = Instant::now();
        let rows = loop {
            let rows: Vec<_> = self
                .registry
                .list_sandboxes(Some(&caller.tenant), false)
                .await?
                .into_iter()
                .filter(|r| {
                    aviary_reuse::scope_bucket(
                        r.scope,
                        &r.tenant,
                        r.user_id.as_deref(),
                        r.session_id.as_deref(),
                        r.agent.as_deref(),
                    )
                    .as_deref()
                        == Ok(bucket)
                })
                .collect();
            let busy = rows.iter().any(|r| r.state == SandboxState::Leased);
            let free = rows.iter().any(|r| r.state == SandboxState::Idle);
            if scope == Scope::Session || !busy || free {
                break rows;
            }
            if start.elapsed() >= SHARED_WAIT {
                let owner = match self.leases.current(&rows[0].id, aviary_core::now()).await? {
                    Some(l) => l.owner,
                    None => "another caller".into(),
                };
                return Err(OpError::LeaseHeld {
                    owner,
                    expires_at: "its release".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // branch C: the bucket's compute is gone (hibernated) but its
        // snapshot is there: new compute, layers restored
        let mut rows = rows;
        let mut woken = None;
        if !rows
            .iter()
            .any(|r| matches!(r.state, SandboxState::Idle | SandboxState::Leased))
        {
            if let Some(h) = rows
                .iter()
                .find(|r| r.state == SandboxState::Hibernating && !r.tainted)
                .cloned()
            {
                let rec = self.wake_record(h, request_id).await?;
                woken = Some(rec.id.clone());
                rows = vec![rec];
            }
        }
        let mut candidates = Vec::new();
        for r in rows {
            if !matches!(r.state, SandboxState::Idle | SandboxState::Leased) {
                continue;
            }
            let Some(live) = self.live_opt(&r.id) else {
                continue;
            };
            let mut manifest = self
                .registry
                .get_environment(&r.id)
                .await?
                .as_ref()
                .and_then(EnvironmentManifest::from_record);
            if manifest.is_none() && r.state == SandboxState::Idle {
                // no compatibility proof yet: probe the sandbox now
                manifest = self.refresh_manifest(&r, &live).await.ok();
            }
            let mut c = ReuseCandidate::from_record(&r, manifest);
            c.healthy = !live.paused.load(std::sync::atomic::Ordering::SeqCst);
            candidates.push((r, c));
        }
        let cands: Vec<ReuseCandidate> = candidates.iter().map(|(_, c)| c.clone()).collect();
        let checker = ReuseChecker::default();
        // when nothing is reusable, the first candidate's verdict says why
        let best = checker
            .pick_best(&request, &cands)
            .or_else(|| cands.first().map(|c| (0, checker.check(&request, c))));
        let (rec, decision) = match best {
            Some((i, d)) if d.action == ReuseAction::Reuse => (candidates[i].0.clone(), d),
            Some((i, d)) => {
                self.reuse_event(cx, Some(&candidates[i].0.id), &d).await?;
                let mut api = d.to_api("D");
                api.action = "new_sandbox".into();
                api.reason = format!(
                    "{} rejected ({}): {}",
                    candidates[i].0.id,
                    d.action.as_str(),
                    d.reasons.join("; ")
                );
                return Ok(BucketOutcome::New(api));
            }
            None => {
                return Ok(BucketOutcome::New(Decision {
                    action: "new_sandbox".into(),
                    branch: "D".into(),
                    reason: format!("no sandbox in scope {bucket} yet"),
                    score: 0.0,
                }))
            }
        };
        self.reuse_event(cx, Some(&rec.id), &decision).await?;
        // hand it out: shared scopes through the lease (waiting for it)
        let lease = match (scope, lease_req) {
            (Scope::Session, None) => None,
            (_, l) => {
                let (owner, ttl) = l.unwrap_or_else(|| {
                    (
                        format!("scope:{bucket}"),
                        Duration::from_secs(self.cfg.default_lease_ttl_s),
                    )
                });
                Some(self.acquire_waiting(cx, &rec.id, &owner, ttl).await?)
            }
        };
        let rec = self.registry.get_sandbox(&rec.id).await?;
        if let Some(live) = self.live_opt(&rec.id) {
            // every start of a call sees the current projected files
            self.sync_projection(&rec.id, &live).await?;
        }
        let (branch, how) = if woken.as_ref() == Some(&rec.id) {
            (
                "C",
                "container was gone, new compute restored from its snapshot",
            )
        } else {
            let last = self.last_snapshot(&rec.tenant, &rec.id).await?;
            let lost = match &last {
                Some(snap) => self.workspace_lost(&rec, snap).await,
                None => false,
            };
            match last {
                // branch B: compute alive, work dir lost: restore it in place
                Some(snap) if lost => {
                    self.restore_workspace_live(&rec, &snap).await?;
                    (
                        "B",
                        "container alive, work dir lost: restored from the last snapshot",
                    )
                }
                _ => ("A", "container alive, work dir intact"),
            }
        };
        let mut api = decision.to_api(branch);
        api.reason = format!("{how}: {}", decision.reasons.join("; "));
        self.record_event(
            &rec.tenant,
            Some(&rec.id),
            Some(rec.state),
            "restore_branch",
            request_id,
            serde_json::json!({"branch": branch, "reason": how}),
        )
        .await?;
        Ok(BucketOutcome::Reused(Box::new(CreateSandboxResponse {
            sandbox: self.view(&rec).await?,
            decision: api,
            lease,
        })))
    }

    async fn reuse_event(
        &self,
        cx: &OpContext,
        id: Option<&aviary_core::SandboxId>,
        d: &aviary_reuse::ReuseDecision,
    ) -> Result<(), OpError> {
        self.record_event(&cx.caller.tenant, id, None, "reuse_decision", cx.request_id(), serde_json::json!({"action": d.action.as_str(), "score": d.score, "reasons": d.reasons})).await?;
        Ok(())
    }

    /// Acquires the sandbox's lease, waiting while another caller holds it.
    async fn acquire_waiting(
        &self,
        cx: &OpContext,
        id: &aviary_core::SandboxId,
        owner: &str,
        ttl: Duration,
    ) -> Result<Lease, OpError> {
        let start = Instant::now();
        loop {
            let req = aviary_core::api::AcquireLeaseRequest {
                owner: owner.to_owned(),
                ttl_s: Some(ttl.as_secs().max(1)),
            };
            match self
                .lease_acquire(cx, OnSandbox::new(id.as_str(), req))
                .await
            {
                Ok(l) => return Ok(l),
                Err(OpError::LeaseHeld { .. }) if start.elapsed() < SHARED_WAIT => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
