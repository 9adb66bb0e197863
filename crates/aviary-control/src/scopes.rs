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
use crate::snapshots::{SandboxSnapshot, CLEAN_LABEL};
use aviary_core::api::{CreateSandboxRequest, CreateSandboxResponse, Decision, Lease};
use aviary_core::{SandboxState, Scope};
use aviary_leases::{LockGuard, LockName};
use aviary_registry::{SandboxRecord, SnapshotFilter};
use aviary_reuse::{ActiveVenv, CleanSnapshot, ReuseDecision};
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
    /// The checker's `fork_clean_snapshot`: a new sandbox of the bucket
    /// from the scope's clean checkpoint (the decision says which).
    Fork(Box<SandboxSnapshot>, Decision),
}

/// Where a `new_venv` hand-out makes its virtual environments.
const VENV_ROOT: &str = "/opt/aviary/venvs";

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
                        // egress rules differ between profiles of one
                        // kind: only the very profile is reused
                        && r.env
                            .get(aviary_core::egress::NETWORK_PROFILE_ENV)
                            .map_or(r.network_profile == aviary_core::NetworkProfile::None, |n| {
                                *n == stage.approved.network_name
                            })
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
        // a dead sandbox is never handed out: every live one is asked for
        // its health first; one whose envd is gone is lost (tainted, with
        // its event) and, when a snapshot of it exists, restored on new
        // compute now (branch C); else the create goes on to branch D
        let mut rows = rows;
        let mut woken: Option<(aviary_core::SandboxId, &'static str)> = None;
        // found dead here and not brought back (no snapshot to restore)
        let mut dead = Vec::new();
        for r in rows.iter_mut() {
            if !matches!(r.state, SandboxState::Idle | SandboxState::Leased) {
                continue;
            }
            let Some(live) = self.live_opt(&r.id) else {
                continue;
            };
            if live.paused.load(std::sync::atomic::Ordering::SeqCst)
                || !Self::envd_unreachable(&r.id, &live).await
                || !self.envd_is_gone(r, Some(&live)).await
            {
                continue;
            }
            let extra = [(
                "found_by".to_owned(),
                serde_json::json!("reuse health probe"),
            )]
            .into_iter()
            .collect();
            self.lose(&r.id, crate::lifecycle::LOST_ENVD_GONE, request_id, extra)
                .await?;
            match self.recover_lost_now(&r.id).await? {
                Some(rec) => {
                    woken = Some((
                        rec.id.clone(),
                        "its envd was dead: new compute restored from its snapshot",
                    ));
                    *r = rec;
                }
                None => {
                    dead.push(r.id.to_string());
                    *r = self.registry.get_sandbox(&r.id).await?;
                }
            }
        }
        // branch C: the bucket's compute is gone (hibernated) but its
        // snapshot is there: new compute, layers restored
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
                woken = Some((
                    rec.id.clone(),
                    "container was gone, new compute restored from its snapshot",
                ));
                rows = vec![rec];
            }
        }
        let clean = self.clean_checkpoints(&caller.tenant, &rows).await?;
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
            c.clean_snapshots = clean
                .iter()
                .filter(|(s, _)| s.template_digest == template_digest)
                .map(|(_, c)| c.clone())
                .collect();
            candidates.push((r, c));
        }
        let cands: Vec<ReuseCandidate> = candidates.iter().map(|(_, c)| c.clone()).collect();
        let checker = ReuseChecker::default();
        // when nothing is reusable, the first candidate's verdict says why
        let best = checker
            .pick_best(&request, &cands)
            .or_else(|| cands.first().map(|c| (0, checker.check(&request, c))));
        let (rec, decision) = match best {
            Some((i, d)) if matches!(d.action, ReuseAction::Reuse | ReuseAction::NewVenv) => {
                (candidates[i].0.clone(), d)
            }
            Some((i, d)) if d.action == ReuseAction::ForkCleanSnapshot => {
                self.reuse_event(cx, Some(&candidates[i].0.id), &d).await?;
                let snap_id = d.snapshot_id.clone().unwrap_or_default();
                let Some((snap, _)) = clean.into_iter().find(|(s, _)| s.id == snap_id) else {
                    return Err(OpError::internal(anyhow::anyhow!(
                        "the checker chose checkpoint {snap_id}, which is not the scope's"
                    )));
                };
                let mut api = d.to_api("C");
                api.reason = format!(
                    "forked from the scope's clean checkpoint {snap_id} ({} was not reusable as it is): {}",
                    candidates[i].0.id,
                    d.reasons.join("; ")
                );
                return Ok(BucketOutcome::Fork(Box::new(snap), api));
            }
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
                    reason: if dead.is_empty() {
                        format!("no sandbox in scope {bucket} yet")
                    } else {
                        format!(
                            "{} found dead (its envd is gone) with no snapshot to restore: lost and tainted",
                            dead.join(", ")
                        )
                    },
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
        let live = self.live_rec(&rec).await?;
        // every start of a call sees the current projected files
        self.sync_projection(&rec.id, &live).await?;
        let token = lease.as_ref().map(|l| l.token.fence());
        let venv = self
            .venv_for_task(&rec, &live, token, &decision, req.session_id.as_deref())
            .await?;
        let (branch, how) = match &woken {
            Some((id, how)) if *id == rec.id => ("C", *how),
            _ => {
                let last = self.last_snapshot(&rec.tenant, &rec.id).await?;
                let lost = match &last {
                    Some(snap) => self.workspace_lost(&rec, snap).await,
                    None => false,
                };
                match last {
                    // branch B: compute alive, work dir lost: restore it in place
                    Some(snap) if lost => {
                        if let Err(e) = self.restore_workspace_live(&rec, &snap).await {
                            // tainted by the failure: handed back, never out
                            if let Some(l) = &lease {
                                let back = aviary_core::api::ReleaseLeaseRequest { token: l.token };
                                if let Err(r) = self
                                    .lease_release(cx, OnSandbox::new(rec.id.as_str(), back))
                                    .await
                                {
                                    tracing::warn!(sandbox.id = %rec.id, error = %r, "could not hand back the sandbox whose restore failed");
                                }
                            }
                            return Ok(BucketOutcome::New(Decision {
                                action: "new_sandbox".into(),
                                branch: "D".into(),
                                reason: format!(
                                    "{} lost its work dir and could not be restored in place ({}); it is tainted",
                                    rec.id,
                                    e.public_message()
                                ),
                                score: 0.0,
                            }));
                        }
                        (
                            "B",
                            "container alive, work dir lost: restored from the last snapshot",
                        )
                    }
                    _ => ("A", "container alive, work dir intact"),
                }
            }
        };
        let mut api = decision.to_api(branch);
        api.reason = match &venv {
            Some(v) => format!(
                "{how}; new_venv: fresh virtual environment {} (python {}) for this task, \
                 the earlier task's packages are not on its path: {}",
                v.path,
                v.python,
                decision.reasons.join("; ")
            ),
            None => format!("{how}: {}", decision.reasons.join("; ")),
        };
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

    /// The clean checkpoints (label `clean`) of the bucket's sandboxes that
    /// carry the manifest they were taken with, oldest first.
    async fn clean_checkpoints(
        &self,
        tenant: &str,
        rows: &[SandboxRecord],
    ) -> Result<Vec<(SandboxSnapshot, CleanSnapshot)>, OpError> {
        let snaps = self
            .registry
            .list_snapshots(&SnapshotFilter {
                tenant: Some(tenant.to_owned()),
                sandbox_id: None,
                label: Some(CLEAN_LABEL.to_owned()),
            })
            .await?;
        Ok(snaps
            .into_iter()
            .filter(|s| rows.iter().any(|r| r.id == s.sandbox_id))
            .filter_map(|s| {
                let manifest: EnvironmentManifest =
                    serde_json::from_value(s.manifest.clone()?).ok()?;
                let clean = CleanSnapshot {
                    snapshot_id: s.id.clone(),
                    manifest,
                };
                Some((SandboxSnapshot::from(s), clean))
            })
            .collect())
    }

    /// The virtual environment the hand-out's task runs in: `new_venv`
    /// makes a fresh one (and records it, with an event); a plain reuse by
    /// another session drops the one an earlier task had.
    async fn venv_for_task(
        &self,
        rec: &SandboxRecord,
        live: &crate::ops::LiveSandbox,
        token: Option<u64>,
        decision: &ReuseDecision,
        session: Option<&str>,
    ) -> Result<Option<ActiveVenv>, OpError> {
        let env = self.registry.get_environment(&rec.id).await?;
        let mut manifest = env
            .as_ref()
            .and_then(EnvironmentManifest::from_record)
            .unwrap_or_else(|| {
                EnvironmentManifest::new(rec.template_digest.clone(), aviary_core::now())
            });
        let version = env.as_ref().map_or(1, |e| e.environment_version);
        if decision.action != ReuseAction::NewVenv {
            let keep = manifest
                .active_venv
                .as_ref()
                .is_some_and(|v| v.session_id.is_some() && v.session_id.as_deref() == session);
            if manifest.active_venv.is_some() && !keep {
                manifest.active_venv = None;
                self.registry
                    .upsert_environment(&manifest.to_record(rec.id.clone(), version))
                    .await?;
            }
            return Ok(None);
        }
        let python = decision
            .venv_python
            .clone()
            .or_else(|| manifest.runtimes.get("python").cloned())
            .unwrap_or_default();
        // `python3.11` for 3.11.x: the interpreter the checker matched
        let minor: Vec<&str> = python.split('.').take(2).collect();
        let interpreter = match minor.as_slice() {
            [major, minor]
                if major.bytes().all(|b| b.is_ascii_digit())
                    && minor.bytes().all(|b| b.is_ascii_digit()) =>
            {
                format!("python{major}.{minor}")
            }
            _ => "python3".to_owned(),
        };
        let name = format!(
            "{}-{}",
            session
                .filter(|s| s
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
                .unwrap_or("task"),
            aviary_core::now().unix_timestamp_nanos() / 1_000_000
        );
        let path = format!("{VENV_ROOT}/{name}");
        let node_prefix = manifest
            .runtimes
            .contains_key("node")
            .then(|| format!("{path}/node"));
        // without ensurepip (Debian's python3 without python3-venv) the
        // venv is made without pip: isolation does not need it
        let mut script = format!(
            "set -e; mkdir -p {VENV_ROOT}; py={interpreter}; command -v $py >/dev/null 2>&1 || py=python3; \
             $py -m venv {path} 2>/dev/null || {{ rm -rf {path}; $py -m venv --without-pip {path}; }}"
        );
        if let Some(prefix) = &node_prefix {
            script.push_str(&format!(
                "; mkdir -p {prefix}/lib/node_modules {prefix}/bin"
            ));
        }
        let out = live
            .envd
            .exec_collect(
                aviary_envd_proto::ExecSpec {
                    argv: vec!["/bin/sh".into(), "-c".into(), script],
                    timeout: Some(Duration::from_secs(120)),
                    ..Default::default()
                },
                token,
            )
            .await;
        let out = self.via_envd(rec, live, out).await?;
        if out.exit.exit_code != 0 {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(OpError::Unavailable(format!(
                "the reuse checker chose a new virtual environment, but making it failed \
                 (exit {}): {}",
                out.exit.exit_code,
                stderr.chars().take(300).collect::<String>()
            )));
        }
        let venv = ActiveVenv {
            path,
            python,
            node_prefix,
            session_id: session.map(str::to_owned),
        };
        manifest.active_venv = Some(venv.clone());
        self.registry
            .upsert_environment(&manifest.to_record(rec.id.clone(), version))
            .await?;
        let install: Vec<String> = decision.install.iter().map(|p| p.to_string()).collect();
        self.event(
            rec,
            "venv_created",
            None,
            serde_json::json!({"path": venv.path, "python": venv.python, "node_prefix": venv.node_prefix, "install": install}),
        )
        .await?;
        Ok(Some(venv))
    }

    /// The active venv of a sandbox's current task, if a `new_venv`
    /// hand-out made one.
    pub(crate) async fn active_venv(
        &self,
        id: &aviary_core::SandboxId,
    ) -> Result<Option<ActiveVenv>, OpError> {
        Ok(self
            .registry
            .get_environment(id)
            .await?
            .and_then(|e| e.manifest.get("active_venv").cloned())
            .and_then(|v| serde_json::from_value(v).ok()))
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
