//! The reuse checker (seed 002 §5.3–§5.5, DESIGN §3): may this live sandbox
//! serve this request, and if not as it is, how?
//!
//! Order of the checks:
//! 1. **Security context** (hard, never overridden): tenant; user whenever
//!    either side is user- or session-scoped; the scope bucket; taint; policy
//!    violations; health and a state the sandbox can come back from. Any
//!    failure → [`ReuseAction::NewSandbox`], score 0, and nothing else is looked
//!    at.
//! 2. **Environment** against the candidate's manifest: required runtimes and
//!    capabilities (missing → `runtime_capability_mismatch`, wrong version →
//!    `runtime_version_mismatch`), unknown pollution (dirty level 3), and the
//!    required packages: satisfied, missing (installed incrementally on reuse)
//!    or conflicting (installed in another version).
//! 3. **Platform**: template digest, container runtime, network profile,
//!    secret scope, workspace id and resource class must be equal for the
//!    sandbox itself to be reused.
//!
//! Then (§5.5): all compatible → `Reuse`; only pip conflicts and an
//! interpreter that fits → `NewVenv` (small conflicts) ; otherwise a clean
//! snapshot of the candidate that fits → `ForkCleanSnapshot`; large pip
//! conflicts with no fitting snapshot still → `NewVenv`; else `NewSandbox`.
//!
//! Score: `1 − penalties`, rounded to 0.01 (see [`ReusePolicy`]); `NewSandbox`
//! scores 0. The seed's §7.7 second turn (same session, pandas present,
//! matplotlib missing, dependencies installed earlier) scores 0.91.

use crate::manifest::{DirtyLevel, EnvironmentManifest};
use crate::scope::{effective_scope, scope_bucket};
use crate::version::{Ecosystem, PackageRequirement, VersionError, VersionReq};
use aviary_core::{api, NetworkProfile, SandboxId, SandboxState, Scope};
use aviary_registry::SandboxRecord;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// What a request needs from the environment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EnvironmentRequirements {
    /// Language runtime → version requirement (`python` → `3.9`, `node` → `>=18`).
    #[serde(default)]
    pub runtimes: BTreeMap<String, VersionReq>,
    #[serde(default)]
    pub packages: Vec<PackageRequirement>,
    /// Capabilities such as `browser` or `gpu` (see the manifest's `capabilities`).
    #[serde(default)]
    pub capabilities: BTreeSet<String>,
}

impl EnvironmentRequirements {
    /// Requirements from the planner's task context (DESIGN §7): `languages`
    /// such as `python`, `python3.9`, `python >=3.10`, `node 20` (`javascript`
    /// and `typescript` mean node; other languages are ignored),
    /// `dependencies` such as `pandas==1.5` (pip unless prefixed `npm:` or
    /// `apt:`, or a scoped `@npm/name`), and the browser / GPU / compiler needs
    /// as capabilities.
    pub fn from_task(
        languages: &[String],
        dependencies: &[String],
        needs_browser: bool,
        needs_gpu: bool,
        needs_compile: bool,
    ) -> Result<Self, VersionError> {
        let mut req = EnvironmentRequirements::default();
        for lang in languages {
            let l = lang.trim().to_ascii_lowercase();
            let split = l
                .find(|c: char| !c.is_ascii_alphabetic())
                .unwrap_or(l.len());
            let (name, version) = l.split_at(split);
            let runtime = match name {
                "python" | "py" => "python",
                "node" | "nodejs" | "javascript" | "typescript" | "js" | "ts" => "node",
                _ => continue,
            };
            let version = version.trim().trim_start_matches('@').trim();
            req.runtimes.insert(runtime.to_owned(), version.parse()?);
        }
        for dep in dependencies {
            let dep = dep.trim();
            let p = if let Some(rest) = dep.strip_prefix("pip:") {
                PackageRequirement::pip(rest)?
            } else if let Some(rest) = dep.strip_prefix("npm:") {
                PackageRequirement::npm(rest)?
            } else if let Some(rest) = dep.strip_prefix("apt:") {
                PackageRequirement::apt(rest)?
            } else if dep.starts_with('@') {
                PackageRequirement::npm(dep)?
            } else {
                PackageRequirement::pip(dep)?
            };
            req.packages.push(p);
        }
        for (needed, capability) in [
            (needs_browser, "browser"),
            (needs_gpu, "gpu"),
            (needs_compile, "compiler"),
        ] {
            if needed {
                req.capabilities.insert(capability.to_owned());
            }
        }
        Ok(req)
    }
}

/// The caller's side of a reuse check.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReuseRequest {
    pub tenant: String,
    pub user_id: Option<String>,
    pub session_id: Option<String>,
    pub agent: Option<String>,
    pub scope: Scope,
    pub template_digest: String,
    /// Container runtime (`crun`, `runc`, `runsc`, …).
    pub runtime: String,
    pub resource_class: String,
    pub network_profile: NetworkProfile,
    /// Which secrets the caller's sandbox may hold; `None` = no secrets.
    pub secret_scope: Option<String>,
    pub workspace_id: Option<String>,
    pub requirements: EnvironmentRequirements,
}

impl ReuseRequest {
    /// The request side of a `POST /v1/sandboxes`, once the template, runtime,
    /// class and network profile are resolved (the scope defaults as in the API).
    pub fn from_create(
        tenant: &str,
        create: &api::CreateSandboxRequest,
        template_digest: &str,
        runtime: &str,
        resource_class: &str,
        network_profile: NetworkProfile,
        requirements: EnvironmentRequirements,
    ) -> Self {
        ReuseRequest {
            tenant: tenant.to_owned(),
            user_id: create.user_id.clone(),
            session_id: create.session_id.clone(),
            agent: create.agent.clone(),
            scope: create.scope.unwrap_or_default(),
            template_digest: template_digest.to_owned(),
            runtime: runtime.to_owned(),
            resource_class: resource_class.to_owned(),
            network_profile,
            secret_scope: None,
            workspace_id: None,
            requirements,
        }
    }
}

/// A clean checkpoint the candidate could be forked from, with its manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CleanSnapshot {
    pub snapshot_id: String,
    pub manifest: EnvironmentManifest,
}

/// An existing sandbox that might serve the request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReuseCandidate {
    pub sandbox_id: SandboxId,
    pub tenant: String,
    pub user_id: Option<String>,
    pub session_id: Option<String>,
    pub agent: Option<String>,
    pub scope: Scope,
    pub state: SandboxState,
    pub template_digest: String,
    pub runtime: String,
    pub resource_class: String,
    pub network_profile: NetworkProfile,
    pub secret_scope: Option<String>,
    /// Latest health check passed.
    pub healthy: bool,
    pub tainted: bool,
    /// Policy violations recorded against the sandbox; any one forbids reuse.
    pub policy_violations: Vec<String>,
    /// `None`: never probed, so there is no compatibility proof.
    pub manifest: Option<EnvironmentManifest>,
    /// Clean checkpoints of this sandbox's lineage, oldest first.
    pub clean_snapshots: Vec<CleanSnapshot>,
}

impl ReuseCandidate {
    /// A candidate from its registry row. Health is taken from the state
    /// (live or hibernating); secret scope, policy violations and snapshots
    /// start empty for the caller to fill in.
    pub fn from_record(record: &SandboxRecord, manifest: Option<EnvironmentManifest>) -> Self {
        ReuseCandidate {
            sandbox_id: record.id.clone(),
            tenant: record.tenant.clone(),
            user_id: record.user_id.clone(),
            session_id: record.session_id.clone(),
            agent: record.agent.clone(),
            scope: record.scope,
            state: record.state,
            template_digest: record.template_digest.clone(),
            runtime: record.runtime.clone(),
            resource_class: record.resource_class.clone(),
            network_profile: record.network_profile,
            secret_scope: None,
            healthy: reusable_state(record.state),
            tainted: record.tainted,
            policy_violations: Vec::new(),
            manifest,
            clean_snapshots: Vec::new(),
        }
    }
}

/// States a sandbox can serve a new call from (directly, after the current
/// lease, or after waking from hibernation).
fn reusable_state(state: SandboxState) -> bool {
    state.is_live() || state == SandboxState::Hibernating
}

#[derive(
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Debug,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ReuseAction {
    /// Use the sandbox as it is (installing missing packages incrementally).
    Reuse,
    /// Use the sandbox, in a fresh virtualenv for the conflicting packages.
    NewVenv,
    /// A new sandbox forked from the candidate's clean checkpoint.
    ForkCleanSnapshot,
    /// Nothing of the candidate may be used.
    NewSandbox,
}

impl ReuseAction {
    pub fn as_str(self) -> &'static str {
        match self {
            ReuseAction::Reuse => "reuse",
            ReuseAction::NewVenv => "new_venv",
            ReuseAction::ForkCleanSnapshot => "fork_clean_snapshot",
            ReuseAction::NewSandbox => "new_sandbox",
        }
    }

    /// Preference order: reuse best, new sandbox worst.
    fn preference(self) -> u8 {
        match self {
            ReuseAction::Reuse => 3,
            ReuseAction::NewVenv => 2,
            ReuseAction::ForkCleanSnapshot => 1,
            ReuseAction::NewSandbox => 0,
        }
    }
}

impl fmt::Display for ReuseAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The checker's answer. Reasons are `code` or `code: detail`, most specific
/// first; the first one is the headline (`api::Decision::reason`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReuseDecision {
    pub action: ReuseAction,
    /// 0..=1, higher is a better fit; 0 for `new_sandbox`.
    pub score: f64,
    pub reasons: Vec<String>,
    /// The checkpoint to fork (`fork_clean_snapshot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// Python version the new virtualenv should use (`new_venv`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub venv_python: Option<String>,
    /// Packages to install after reuse / in the venv / in the fork.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub install: Vec<PackageRequirement>,
}

impl ReuseDecision {
    fn new_sandbox(reasons: Vec<String>) -> Self {
        ReuseDecision {
            action: ReuseAction::NewSandbox,
            score: 0.0,
            reasons,
            snapshot_id: None,
            venv_python: None,
            install: Vec::new(),
        }
    }

    /// The codes of the reasons (the part before `:`).
    pub fn reason_codes(&self) -> Vec<&str> {
        self.reasons
            .iter()
            .map(|r| r.split(':').next().unwrap_or(r).trim())
            .collect()
    }

    /// The API shape of this decision, with the restore branch taken.
    pub fn to_api(&self, branch: &str) -> api::Decision {
        api::Decision {
            action: self.action.as_str().to_owned(),
            branch: branch.to_owned(),
            reason: self.reasons.first().cloned().unwrap_or_default(),
            score: self.score,
        }
    }
}

/// Tunables of the checker. Penalties are subtracted from 1.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReusePolicy {
    /// Per required package that must still be installed.
    pub missing_package_penalty: f64,
    /// Cap of the missing-package penalty.
    pub max_missing_penalty: f64,
    /// Per dirty level of the candidate (0..=2; level 3 is never reused).
    pub dirty_level_penalty: f64,
    /// Shared-scope sandbox last used by another session.
    pub other_session_penalty: f64,
    /// Extra penalty of `new_venv` over plain reuse.
    pub new_venv_penalty: f64,
    /// Extra penalty of `fork_clean_snapshot` over plain reuse.
    pub fork_penalty: f64,
    /// Above this many conflicting pip packages, a fitting clean snapshot is
    /// preferred to a venv (seed 002 §5.5: small change → venv, large → fork).
    pub max_venv_conflicts: usize,
}

impl Default for ReusePolicy {
    fn default() -> Self {
        ReusePolicy {
            missing_package_penalty: 0.05,
            max_missing_penalty: 0.30,
            dirty_level_penalty: 0.02,
            other_session_penalty: 0.10,
            new_venv_penalty: 0.25,
            fork_penalty: 0.40,
            max_venv_conflicts: 3,
        }
    }
}

/// Compares requests with candidates. Stateless; share it freely.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReuseChecker {
    pub policy: ReusePolicy,
}

/// How one environment (a live sandbox or a snapshot) meets the requirements.
#[derive(Debug, Default)]
struct EnvFit {
    /// Runtime or capability problems: the environment cannot serve as is.
    runtime_problems: Vec<String>,
    /// Python matches only through a non-default interpreter.
    venv_python: Option<String>,
    conflicts: Vec<(PackageRequirement, String)>,
    missing: Vec<PackageRequirement>,
    unknown_pollution: bool,
}

impl EnvFit {
    fn of(m: &EnvironmentManifest, req: &EnvironmentRequirements) -> EnvFit {
        let mut fit = EnvFit::default();
        for (lang, vreq) in &req.runtimes {
            if lang == "python" {
                match m.runtimes.get("python") {
                    Some(v) if vreq.matches(v) => {}
                    _ => match m.python_matching(vreq) {
                        Some(other) => fit.venv_python = Some(other.to_owned()),
                        None if m.runtimes.contains_key("python") => {
                            fit.runtime_problems.push(format!(
                                "runtime_version_mismatch: python {} installed, {vreq} required",
                                m.runtimes["python"]
                            ))
                        }
                        None => fit
                            .runtime_problems
                            .push("runtime_capability_mismatch: python not installed".to_owned()),
                    },
                }
                continue;
            }
            match m.runtimes.get(lang) {
                Some(v) if vreq.matches(v) => {}
                Some(v) => fit.runtime_problems.push(format!(
                    "runtime_version_mismatch: {lang} {v} installed, {vreq} required"
                )),
                None => fit
                    .runtime_problems
                    .push(format!("runtime_capability_mismatch: {lang} not installed")),
            }
        }
        let missing_caps: Vec<&str> = req
            .capabilities
            .iter()
            .filter(|c| !m.capabilities.contains(*c))
            .map(String::as_str)
            .collect();
        if !missing_caps.is_empty() {
            fit.runtime_problems.push(format!(
                "runtime_capability_mismatch: {} missing",
                missing_caps.join(", ")
            ));
        }
        for p in &req.packages {
            match m.installed_version(p.ecosystem, &p.name) {
                Some(v) if p.version.matches(v) => {}
                Some(v) => fit.conflicts.push((p.clone(), v.to_owned())),
                None => fit.missing.push(p.clone()),
            }
        }
        fit.unknown_pollution = m.dirty_level == DirtyLevel::Unknown;
        fit
    }

    fn conflict_text(&self) -> String {
        self.conflicts
            .iter()
            .map(|(p, have)| format!("{} {have} installed, {} required", p.name, p.version))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn pip_only_conflicts(&self) -> bool {
        self.conflicts
            .iter()
            .all(|(p, _)| p.ecosystem == Ecosystem::Pip)
    }
}

fn missing_text(missing: &[PackageRequirement]) -> String {
    missing
        .iter()
        .map(|p| {
            if p.version.is_any() {
                p.name.clone()
            } else {
                format!("{}{}", p.name, p.version)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn round2(x: f64) -> f64 {
    ((x * 100.0).round() / 100.0).clamp(0.0, 1.0)
}

impl ReuseChecker {
    pub fn new(policy: ReusePolicy) -> Self {
        ReuseChecker { policy }
    }

    /// Security context (step 1); the reasons that forbid any use of the candidate.
    fn security_reasons(request: &ReuseRequest, c: &ReuseCandidate) -> Vec<String> {
        let mut reasons = Vec::new();
        if request.tenant != c.tenant {
            reasons.push("tenant_mismatch".to_owned());
        }
        let user_bound = |scope, user: &Option<String>| {
            matches!(
                effective_scope(scope, user.as_deref()),
                Scope::User | Scope::Session
            )
        };
        let norm = |u: &Option<String>| u.clone().filter(|s| !s.is_empty());
        if (user_bound(request.scope, &request.user_id) || user_bound(c.scope, &c.user_id))
            && norm(&request.user_id) != norm(&c.user_id)
        {
            reasons.push("user_mismatch".to_owned());
        }
        let rb = scope_bucket(
            request.scope,
            &request.tenant,
            request.user_id.as_deref(),
            request.session_id.as_deref(),
            request.agent.as_deref(),
        );
        let cb = scope_bucket(
            c.scope,
            &c.tenant,
            c.user_id.as_deref(),
            c.session_id.as_deref(),
            c.agent.as_deref(),
        );
        match (rb, cb) {
            (Ok(a), Ok(b)) if a == b => {}
            (Ok(a), Ok(b)) => reasons.push(format!("scope_mismatch: {a} vs {b}")),
            (Err(e), _) | (_, Err(e)) => reasons.push(format!("scope_unresolved: {e}")),
        }
        if c.tainted {
            reasons.push("tainted".to_owned());
        }
        if !c.policy_violations.is_empty() {
            reasons.push(format!(
                "policy_violation: {}",
                c.policy_violations.join(", ")
            ));
        }
        if !c.healthy {
            reasons.push("unhealthy".to_owned());
        }
        if !reusable_state(c.state) {
            reasons.push(format!("state_not_reusable: {}", c.state.as_str()));
        }
        reasons
    }

    /// Platform (step 3): what makes the sandbox itself unusable for the request.
    fn platform_reasons(request: &ReuseRequest, c: &ReuseCandidate) -> Vec<String> {
        let mut reasons = Vec::new();
        if request.template_digest != c.template_digest {
            reasons.push(format!(
                "template_mismatch: {} vs {}",
                c.template_digest, request.template_digest
            ));
        }
        if request.runtime != c.runtime {
            reasons.push(format!(
                "runtime_mismatch: {} vs {}",
                c.runtime, request.runtime
            ));
        }
        if request.network_profile != c.network_profile {
            reasons.push(format!(
                "network_profile_mismatch: {} vs {}",
                c.network_profile.as_str(),
                request.network_profile.as_str()
            ));
        }
        if request.secret_scope != c.secret_scope {
            reasons.push("secret_scope_mismatch".to_owned());
        }
        if let Some(ws) = &request.workspace_id {
            let have = c.manifest.as_ref().and_then(|m| m.workspace_id.as_ref());
            if have != Some(ws) {
                reasons.push(format!(
                    "workspace_mismatch: {} vs {ws}",
                    have.map_or("none", String::as_str)
                ));
            }
        }
        if request.resource_class != c.resource_class {
            reasons.push(format!(
                "resource_class_mismatch: {} vs {}",
                c.resource_class, request.resource_class
            ));
        }
        reasons
    }

    /// The best clean snapshot to fork: same template, same workspace, not
    /// polluted, every runtime, capability and package compatible with the
    /// default interpreter. Fewest missing packages wins; ties go to the newest.
    fn fitting_snapshot<'a>(
        request: &ReuseRequest,
        c: &'a ReuseCandidate,
    ) -> Option<(&'a CleanSnapshot, EnvFit)> {
        let mut best: Option<(&CleanSnapshot, EnvFit)> = None;
        for snap in &c.clean_snapshots {
            let m = &snap.manifest;
            if m.base_template_digest != request.template_digest
                || m.dirty_level > DirtyLevel::Dependencies
                || (request.workspace_id.is_some() && m.workspace_id != request.workspace_id)
            {
                continue;
            }
            let fit = EnvFit::of(m, &request.requirements);
            if !fit.runtime_problems.is_empty()
                || fit.venv_python.is_some()
                || !fit.conflicts.is_empty()
            {
                continue;
            }
            if best
                .as_ref()
                .is_none_or(|(_, b)| fit.missing.len() <= b.missing.len())
            {
                best = Some((snap, fit));
            }
        }
        best
    }

    fn fork(&self, snap: &CleanSnapshot, fit: EnvFit, mut reasons: Vec<String>) -> ReuseDecision {
        let p = &self.policy;
        let missing_penalty =
            (fit.missing.len() as f64 * p.missing_package_penalty).min(p.max_missing_penalty);
        let dirty = f64::from(snap.manifest.dirty_level.as_u8()) * p.dirty_level_penalty;
        reasons.push(format!("clean_snapshot: {}", snap.snapshot_id));
        if !fit.missing.is_empty() {
            reasons.push(format!("install: {}", missing_text(&fit.missing)));
        }
        ReuseDecision {
            action: ReuseAction::ForkCleanSnapshot,
            score: round2(1.0 - p.fork_penalty - missing_penalty - dirty),
            reasons,
            snapshot_id: Some(snap.snapshot_id.clone()),
            venv_python: None,
            install: fit.missing,
        }
    }

    /// Decides how (and whether) `candidate` may serve `request`.
    pub fn check(&self, request: &ReuseRequest, candidate: &ReuseCandidate) -> ReuseDecision {
        let security = Self::security_reasons(request, candidate);
        if !security.is_empty() {
            return ReuseDecision::new_sandbox(security);
        }
        let platform = Self::platform_reasons(request, candidate);
        let Some(manifest) = candidate.manifest.as_ref() else {
            let mut reasons = vec!["manifest_missing: no compatibility proof".to_owned()];
            reasons.extend(platform);
            return match Self::fitting_snapshot(request, candidate) {
                Some((snap, fit)) => self.fork(snap, fit, reasons),
                None => ReuseDecision::new_sandbox(reasons),
            };
        };
        let fit = EnvFit::of(manifest, &request.requirements);

        // Most specific explanation first: the environment, then the platform.
        let mut blockers = fit.runtime_problems.clone();
        if fit.unknown_pollution {
            blockers.push(format!(
                "unknown_pollution: {}",
                manifest.dirty_paths.join(", ")
            ));
        }
        blockers.extend(platform);

        let p = &self.policy;
        let same_session =
            request.session_id.is_some() && request.session_id == candidate.session_id;
        let affinity = if same_session {
            "same_session"
        } else {
            "same_scope_other_session"
        };
        let missing_penalty =
            (fit.missing.len() as f64 * p.missing_package_penalty).min(p.max_missing_penalty);
        let base = 1.0
            - missing_penalty
            - f64::from(manifest.dirty_level.as_u8()) * p.dirty_level_penalty
            - if same_session {
                0.0
            } else {
                p.other_session_penalty
            };

        if blockers.is_empty() && fit.conflicts.is_empty() && fit.venv_python.is_none() {
            let mut reasons = vec![affinity.to_owned(), "dependency_compatible".to_owned()];
            if !fit.missing.is_empty() {
                reasons.push(format!("install: {}", missing_text(&fit.missing)));
            }
            return ReuseDecision {
                action: ReuseAction::Reuse,
                score: round2(base),
                reasons,
                snapshot_id: None,
                venv_python: None,
                install: fit.missing,
            };
        }

        let venv_python = fit
            .venv_python
            .clone()
            .or_else(|| manifest.runtimes.get("python").cloned());
        let venv_possible = blockers.is_empty()
            && fit.pip_only_conflicts()
            && venv_python.is_some()
            && manifest.pip.is_some();
        let venv = |conflicts_reason: Vec<String>| {
            let mut reasons = vec![affinity.to_owned()];
            reasons.extend(conflicts_reason);
            let python = venv_python.clone().unwrap_or_default();
            reasons.push(format!("venv_python: {python}"));
            // Inside a fresh venv every required pip package is installed anew.
            let install: Vec<PackageRequirement> = request
                .requirements
                .packages
                .iter()
                .filter(|r| r.ecosystem == Ecosystem::Pip || fit.missing.contains(r))
                .cloned()
                .collect();
            ReuseDecision {
                action: ReuseAction::NewVenv,
                score: round2(base - p.new_venv_penalty),
                reasons,
                snapshot_id: None,
                venv_python: Some(python),
                install,
            }
        };
        let mut why = Vec::new();
        if !fit.conflicts.is_empty() {
            why.push(format!("dependency_conflict: {}", fit.conflict_text()));
        }
        if let Some(py) = &fit.venv_python {
            why.push(format!(
                "non_default_python: default {}, {py} required and installed",
                manifest
                    .runtimes
                    .get("python")
                    .map_or("none", String::as_str)
            ));
        }

        if venv_possible && fit.conflicts.len() <= p.max_venv_conflicts {
            return venv(why);
        }
        let mut reasons = why.clone();
        reasons.extend(blockers.iter().cloned());
        if let Some((snap, sfit)) = Self::fitting_snapshot(request, candidate) {
            return self.fork(snap, sfit, reasons);
        }
        if venv_possible {
            return venv(why);
        }
        ReuseDecision::new_sandbox(reasons)
    }

    /// The best candidate: highest action preference, then highest score, then
    /// lowest index. `None` when every candidate needs a new sandbox.
    pub fn pick_best(
        &self,
        request: &ReuseRequest,
        candidates: &[ReuseCandidate],
    ) -> Option<(usize, ReuseDecision)> {
        let mut best: Option<(usize, ReuseDecision)> = None;
        for (i, c) in candidates.iter().enumerate() {
            let d = self.check(request, c);
            if d.action == ReuseAction::NewSandbox {
                continue;
            }
            let better = best.as_ref().is_none_or(|(_, b)| {
                (d.action.preference(), d.score) > (b.action.preference(), b.score)
            });
            if better {
                best = Some((i, d));
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::PackageSet;
    use proptest::prelude::*;
    use time::OffsetDateTime;

    const PY_TEMPLATE: &str = "sha256:python-ds";
    const BROWSER_TEMPLATE: &str = "sha256:browser";

    fn at() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn pip(pkgs: &[(&str, &str)]) -> Option<PackageSet> {
        Some(PackageSet::new(
            pkgs.iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
        ))
    }

    fn python_manifest(python: &str, pkgs: &[(&str, &str)]) -> EnvironmentManifest {
        let mut m = EnvironmentManifest::new(PY_TEMPLATE, at());
        m.runtimes.insert("python".into(), python.into());
        m.python_interpreters.insert(python.into());
        m.pip = pip(pkgs);
        m
    }

    fn reqs(specs: &[&str]) -> Vec<PackageRequirement> {
        specs
            .iter()
            .map(|s| PackageRequirement::pip(s).unwrap())
            .collect()
    }

    fn request() -> ReuseRequest {
        ReuseRequest {
            tenant: "acme".into(),
            user_id: Some("alice".into()),
            session_id: Some("s-1".into()),
            agent: None,
            scope: Scope::User,
            template_digest: PY_TEMPLATE.into(),
            runtime: "crun".into(),
            resource_class: "python-small".into(),
            network_profile: NetworkProfile::None,
            secret_scope: None,
            workspace_id: None,
            requirements: EnvironmentRequirements::default(),
        }
    }

    /// The seed's sb-1028 after turn 1: `pip install pandas openpyxl`.
    fn sb_1028() -> ReuseCandidate {
        let manifest = python_manifest(
            "3.12.4",
            &[
                ("pandas", "2.2.2"),
                ("openpyxl", "3.1.2"),
                ("numpy", "1.26.4"),
            ],
        )
        .with_changed_paths([
            "/workspace/sales.xlsx",
            "/usr/local/lib/python3.12/site-packages/pandas/__init__.py",
        ]);
        ReuseCandidate {
            sandbox_id: SandboxId::generate(),
            tenant: "acme".into(),
            user_id: Some("alice".into()),
            session_id: Some("s-1".into()),
            agent: None,
            scope: Scope::User,
            state: SandboxState::Idle,
            template_digest: PY_TEMPLATE.into(),
            runtime: "crun".into(),
            resource_class: "python-small".into(),
            network_profile: NetworkProfile::None,
            secret_scope: None,
            healthy: true,
            tainted: false,
            policy_violations: Vec::new(),
            manifest: Some(manifest),
            clean_snapshots: Vec::new(),
        }
    }

    type Mutation = Box<dyn Fn(&mut ReuseCandidate)>;

    fn checker() -> ReuseChecker {
        ReuseChecker::default()
    }

    #[test]
    fn seed_7_7_turn_2_reuses_with_score_0_91() {
        // required = pandas, matplotlib; existing = pandas, openpyxl.
        let mut r = request();
        r.requirements.packages = reqs(&["pandas", "matplotlib"]);
        let d = checker().check(&r, &sb_1028());
        assert_eq!(d.action, ReuseAction::Reuse, "{d:?}");
        assert_eq!(d.score, 0.91);
        assert_eq!(
            d.reason_codes(),
            ["same_session", "dependency_compatible", "install"]
        );
        assert_eq!(d.install, reqs(&["matplotlib"]));
        let api = d.to_api("A");
        assert_eq!(
            (
                api.action.as_str(),
                api.branch.as_str(),
                api.reason.as_str()
            ),
            ("reuse", "A", "same_session")
        );
    }

    #[test]
    fn seed_7_7_turn_3_playwright_needs_a_browser_sandbox() {
        let mut r = request();
        r.resource_class = "browser-medium".into();
        r.template_digest = BROWSER_TEMPLATE.into();
        r.requirements
            .runtimes
            .insert("node".into(), VersionReq::any());
        r.requirements.capabilities.insert("browser".into());
        r.requirements.packages = vec![PackageRequirement::npm("playwright").unwrap()];
        let d = checker().check(&r, &sb_1028());
        assert_eq!(d.action, ReuseAction::NewSandbox, "{d:?}");
        assert_eq!(d.score, 0.0);
        assert_eq!(d.reason_codes()[0], "runtime_capability_mismatch");
        assert!(d.reason_codes().contains(&"resource_class_mismatch"));
        assert!(d.reason_codes().contains(&"template_mismatch"));
    }

    #[test]
    fn seed_5_4_python_3_9_pandas_1_5_cuda_reallocates() {
        let mut r = request();
        r.requirements
            .runtimes
            .insert("python".into(), "3.9".parse().unwrap());
        r.requirements.packages = reqs(&["pandas==1.5"]);
        r.requirements.capabilities.insert("gpu".into());
        let d = checker().check(&r, &sb_1028());
        assert_eq!(d.action, ReuseAction::NewSandbox, "{d:?}");
        assert!(d.reason_codes().contains(&"runtime_version_mismatch"));
        assert!(d.reason_codes().contains(&"runtime_capability_mismatch"));
    }

    #[test]
    fn old_project_pins_get_a_venv_when_python_fits() {
        // §5.1 turn 3: pandas==1.5, numpy<1.24 on a pandas-2 sandbox.
        let mut r = request();
        r.requirements.packages = reqs(&["pandas==1.5", "numpy<1.24"]);
        let d = checker().check(&r, &sb_1028());
        assert_eq!(d.action, ReuseAction::NewVenv, "{d:?}");
        assert_eq!(d.venv_python.as_deref(), Some("3.12.4"));
        assert_eq!(
            d.reason_codes(),
            ["same_session", "dependency_conflict", "venv_python"]
        );
        assert!(d.reasons[1].contains("pandas 2.2.2 installed, ==1.5 required"));
        assert_eq!(d.install, reqs(&["pandas==1.5", "numpy<1.24"]));
        assert_eq!(d.score, 0.71);
    }

    #[test]
    fn python_3_9_with_pandas_1_5_uses_a_second_interpreter_in_a_venv() {
        let mut c = sb_1028();
        c.manifest
            .as_mut()
            .unwrap()
            .python_interpreters
            .insert("3.9.18".into());
        let mut r = request();
        r.requirements
            .runtimes
            .insert("python".into(), "3.9".parse().unwrap());
        r.requirements.packages = reqs(&["pandas==1.5"]);
        let d = checker().check(&r, &c);
        assert_eq!(d.action, ReuseAction::NewVenv, "{d:?}");
        assert_eq!(d.venv_python.as_deref(), Some("3.9.18"));
        assert_eq!(
            d.reason_codes(),
            [
                "same_session",
                "dependency_conflict",
                "non_default_python",
                "venv_python"
            ]
        );
    }

    #[test]
    fn python_3_9_with_pandas_1_5_forks_a_clean_snapshot_when_one_fits() {
        // §5.6: don't pollute checkpoint B; fork the clean base (python 3.9).
        let mut c = sb_1028();
        c.clean_snapshots = vec![
            CleanSnapshot {
                snapshot_id: "snap-checkpoint-a".into(),
                manifest: python_manifest("3.12.4", &[("pandas", "2.2.2")]),
            },
            CleanSnapshot {
                snapshot_id: "snap-clean-base".into(),
                manifest: python_manifest("3.9.18", &[("pip", "23.0.1")]),
            },
        ];
        let mut r = request();
        r.requirements
            .runtimes
            .insert("python".into(), "3.9".parse().unwrap());
        r.requirements.packages = reqs(&["pandas==1.5", "numpy<1.24"]);
        let d = checker().check(&r, &c);
        assert_eq!(d.action, ReuseAction::ForkCleanSnapshot, "{d:?}");
        assert_eq!(d.snapshot_id.as_deref(), Some("snap-clean-base"));
        assert_eq!(d.install, reqs(&["pandas==1.5", "numpy<1.24"]));
        assert_eq!(d.reason_codes()[0], "dependency_conflict");
        assert!(d.reason_codes().contains(&"runtime_version_mismatch"));
        assert_eq!(d.score, 0.5);

        // Without the snapshot there is nothing safe to reuse.
        c.clean_snapshots.clear();
        let d = checker().check(&r, &c);
        assert_eq!(d.action, ReuseAction::NewSandbox, "{d:?}");
    }

    #[test]
    fn many_conflicts_prefer_a_fitting_snapshot_over_a_venv() {
        let mut c = sb_1028();
        c.manifest = Some(python_manifest(
            "3.12.4",
            &[("a", "2.0"), ("b", "2.0"), ("c", "2.0"), ("d", "2.0")],
        ));
        let r = ReuseRequest {
            requirements: EnvironmentRequirements {
                packages: reqs(&["a<2", "b<2", "c<2", "d<2"]),
                ..Default::default()
            },
            ..request()
        };
        assert_eq!(checker().check(&r, &c).action, ReuseAction::NewVenv);
        c.clean_snapshots.push(CleanSnapshot {
            snapshot_id: "snap-0".into(),
            manifest: python_manifest("3.12.4", &[]),
        });
        let d = checker().check(&r, &c);
        assert_eq!(d.action, ReuseAction::ForkCleanSnapshot, "{d:?}");
    }

    #[test]
    fn apt_conflicts_cannot_be_solved_by_a_venv() {
        let mut c = sb_1028();
        c.manifest.as_mut().unwrap().apt = Some(PackageSet::new(
            [("ffmpeg".to_owned(), "7:5.1.6".to_owned())].into(),
        ));
        let mut r = request();
        r.requirements.packages = vec![PackageRequirement::apt("ffmpeg=7:4.4").unwrap()];
        let d = checker().check(&r, &c);
        assert_eq!(d.action, ReuseAction::NewSandbox, "{d:?}");
        assert_eq!(d.reason_codes(), ["dependency_conflict"]);
    }

    #[test]
    fn hard_constraints_always_give_a_new_sandbox() {
        let r = request();
        let cases: Vec<(&str, Mutation)> = vec![
            ("tenant_mismatch", Box::new(|c| c.tenant = "evil".into())),
            (
                "user_mismatch",
                Box::new(|c| c.user_id = Some("bob".into())),
            ),
            ("tainted", Box::new(|c| c.tainted = true)),
            (
                "policy_violation",
                Box::new(|c| c.policy_violations = vec!["egress to 1.2.3.4".into()]),
            ),
            ("unhealthy", Box::new(|c| c.healthy = false)),
            (
                "state_not_reusable",
                Box::new(|c| c.state = SandboxState::Lost),
            ),
            ("scope_mismatch", Box::new(|c| c.scope = Scope::Session)),
        ];
        for (code, mutate) in cases {
            let mut c = sb_1028();
            // A clean snapshot must not rescue a security failure.
            c.clean_snapshots.push(CleanSnapshot {
                snapshot_id: "snap".into(),
                manifest: python_manifest("3.12.4", &[]),
            });
            mutate(&mut c);
            let d = checker().check(&r, &c);
            assert_eq!(d.action, ReuseAction::NewSandbox, "{code}: {d:?}");
            assert_eq!(d.score, 0.0);
            assert!(d.reason_codes().contains(&code), "{code}: {d:?}");
        }
    }

    #[test]
    fn platform_mismatches_block_reuse() {
        let r = request();
        let cases: Vec<(&str, Mutation)> = vec![
            (
                "template_mismatch",
                Box::new(|c| c.template_digest = "sha256:other".into()),
            ),
            ("runtime_mismatch", Box::new(|c| c.runtime = "runsc".into())),
            (
                "network_profile_mismatch",
                Box::new(|c| c.network_profile = NetworkProfile::Open),
            ),
            (
                "secret_scope_mismatch",
                Box::new(|c| c.secret_scope = Some("alice-github".into())),
            ),
            (
                "resource_class_mismatch",
                Box::new(|c| c.resource_class = "python-large".into()),
            ),
        ];
        for (code, mutate) in cases {
            let mut c = sb_1028();
            mutate(&mut c);
            let d = checker().check(&r, &c);
            assert_eq!(d.action, ReuseAction::NewSandbox, "{code}: {d:?}");
            assert_eq!(d.reason_codes(), [code]);
        }
        let mut r = request();
        r.workspace_id = Some("ws-1".into());
        let d = checker().check(&r, &sb_1028());
        assert_eq!(d.reason_codes(), ["workspace_mismatch"]);
    }

    #[test]
    fn unknown_pollution_forks_or_reallocates() {
        let mut c = sb_1028();
        let m = c
            .manifest
            .take()
            .unwrap()
            .with_changed_paths(["/etc/profile.d/x.sh"]);
        c.manifest = Some(m);
        let d = checker().check(&request(), &c);
        assert_eq!(d.action, ReuseAction::NewSandbox);
        assert_eq!(d.reason_codes(), ["unknown_pollution"]);
        c.clean_snapshots.push(CleanSnapshot {
            snapshot_id: "snap-a".into(),
            manifest: python_manifest("3.12.4", &[("pandas", "2.2.2")]),
        });
        let d = checker().check(&request(), &c);
        assert_eq!(d.action, ReuseAction::ForkCleanSnapshot);
        assert_eq!(d.snapshot_id.as_deref(), Some("snap-a"));
    }

    #[test]
    fn missing_manifest_is_no_proof() {
        let mut c = sb_1028();
        c.manifest = None;
        let d = checker().check(&request(), &c);
        assert_eq!(d.action, ReuseAction::NewSandbox);
        assert_eq!(d.reason_codes(), ["manifest_missing"]);
    }

    #[test]
    fn scope_scenarios() {
        let c = sb_1028();
        // Same user, new session, USER scope: shared sandbox, lower score.
        let mut r = request();
        r.session_id = Some("s-2".into());
        let d = checker().check(&r, &c);
        assert_eq!(d.action, ReuseAction::Reuse);
        assert_eq!(d.reasons[0], "same_scope_other_session");
        assert_eq!(d.score, 0.86);
        // SESSION scope: another session never shares.
        let mut c2 = c.clone();
        c2.scope = Scope::Session;
        r.scope = Scope::Session;
        assert_eq!(checker().check(&r, &c2).action, ReuseAction::NewSandbox);
        // AGENT scope: users of one agent share it, as configured.
        let mut c3 = c.clone();
        c3.scope = Scope::Agent;
        c3.agent = Some("analyst".into());
        let mut r3 = request();
        r3.scope = Scope::Agent;
        r3.agent = Some("analyst".into());
        r3.user_id = Some("bob".into());
        assert_eq!(checker().check(&r3, &c3).action, ReuseAction::Reuse);
        r3.agent = Some("other".into());
        assert_eq!(checker().check(&r3, &c3).action, ReuseAction::NewSandbox);
    }

    #[test]
    fn pick_best_prefers_reuse_then_score() {
        let r = ReuseRequest {
            requirements: EnvironmentRequirements {
                packages: reqs(&["pandas"]),
                ..Default::default()
            },
            ..request()
        };
        let mut other_tenant = sb_1028();
        other_tenant.tenant = "evil".into();
        let mut venv_only = sb_1028();
        venv_only.manifest = Some(python_manifest("3.12.4", &[("pandas", "3.0.0")]));
        let r_pinned = ReuseRequest {
            requirements: EnvironmentRequirements {
                packages: reqs(&["pandas<3"]),
                ..Default::default()
            },
            ..r.clone()
        };
        let mut other_session = sb_1028();
        other_session.session_id = Some("s-9".into());
        let candidates = vec![
            other_tenant.clone(),
            other_session,
            venv_only.clone(),
            sb_1028(),
        ];
        let (i, d) = checker().pick_best(&r_pinned, &candidates).unwrap();
        assert_eq!((i, d.action), (3, ReuseAction::Reuse));
        assert_eq!(checker().pick_best(&r, &[other_tenant.clone()]), None);
        let (i, d) = checker()
            .pick_best(&r_pinned, &[other_tenant, venv_only])
            .unwrap();
        assert_eq!((i, d.action), (1, ReuseAction::NewVenv));
    }

    #[test]
    fn from_record_takes_the_security_context() {
        let rec = SandboxRecord {
            id: SandboxId::generate(),
            tenant: "acme".into(),
            user_id: Some("alice".into()),
            session_id: Some("s-1".into()),
            agent: None,
            scope: Scope::User,
            resource_class: "python-small".into(),
            resources: Default::default(),
            template: "python".into(),
            template_digest: PY_TEMPLATE.into(),
            runtime: "crun".into(),
            runtime_instance_id: None,
            node: "local".into(),
            network_profile: NetworkProfile::None,
            state: SandboxState::Failed,
            created_at: at(),
            last_active_at: at(),
            expires_at: None,
            version: 3,
            tainted: true,
            user_managed: false,
            paused: false,
            metadata: Default::default(),
            env: Default::default(),
            run_as: Default::default(),
            workdir: Default::default(),
        };
        let c = ReuseCandidate::from_record(&rec, None);
        assert!(!c.healthy);
        assert!(c.tainted);
        let d = checker().check(&request(), &c);
        assert_eq!(
            d.reason_codes(),
            ["tainted", "unhealthy", "state_not_reusable"]
        );
    }

    #[test]
    fn requirements_from_the_task_context() {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        let r = EnvironmentRequirements::from_task(
            &s(&["Python3.9", "node 20", "sql"]),
            &s(&[
                "pandas==1.5",
                "npm:playwright@^1.40",
                "@playwright/test",
                "apt:ffmpeg",
                "pip:numpy<1.24",
            ]),
            true,
            false,
            true,
        )
        .unwrap();
        assert_eq!(r.runtimes.len(), 2);
        assert!(r.runtimes["python"].matches("3.9.18"));
        assert!(!r.runtimes["python"].matches("3.12.4"));
        assert!(r.runtimes["node"].matches("20.11.1"));
        let names: Vec<String> = r.packages.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "pip:pandas ==1.5",
                "npm:playwright ^1.40",
                "npm:@playwright/test",
                "apt:ffmpeg",
                "pip:numpy <1.24"
            ]
        );
        assert_eq!(
            r.capabilities.iter().collect::<Vec<_>>(),
            ["browser", "compiler"]
        );
        let plain =
            EnvironmentRequirements::from_task(&s(&["python"]), &[], false, false, false).unwrap();
        assert!(plain.runtimes["python"].is_any());
        EnvironmentRequirements::from_task(&[], &s(&["pandas==;"]), false, false, false)
            .unwrap_err();
    }

    #[test]
    fn request_from_the_create_call() {
        let create = api::CreateSandboxRequest {
            user_id: Some("alice".into()),
            session_id: Some("s-1".into()),
            ..Default::default()
        };
        let r = ReuseRequest::from_create(
            "acme",
            &create,
            PY_TEMPLATE,
            "crun",
            "python-small",
            NetworkProfile::None,
            Default::default(),
        );
        assert_eq!(r.scope, Scope::User);
        assert_eq!(r.network_profile, NetworkProfile::None);
        assert_eq!(checker().check(&r, &sb_1028()).action, ReuseAction::Reuse);
    }

    fn opt_id() -> impl Strategy<Value = Option<String>> {
        prop::option::of(prop_oneof![
            Just("a".to_owned()),
            Just("b".to_owned()),
            Just(String::new())
        ])
    }

    fn scope() -> impl Strategy<Value = Scope> {
        prop_oneof![
            Just(Scope::Session),
            Just(Scope::User),
            Just(Scope::Agent),
            Just(Scope::Global)
        ]
    }

    prop_compose! {
        fn pair()(
            t1 in "[ab]", t2 in "[ab]",
            u1 in opt_id(), u2 in opt_id(), s1 in opt_id(), s2 in opt_id(),
            a1 in opt_id(), a2 in opt_id(), sc1 in scope(), sc2 in scope(),
            tainted in any::<bool>(), healthy in any::<bool>(),
            with_snapshot in any::<bool>(), with_manifest in any::<bool>(),
            pkgs in prop::sample::subsequence(vec!["pandas", "pandas==1.5", "numpy<1.24", "matplotlib"], 0..3),
        ) -> (ReuseRequest, ReuseCandidate) {
            let mut r = request();
            r.tenant = t1; r.user_id = u1; r.session_id = s1; r.agent = a1; r.scope = sc1;
            r.requirements.packages = reqs(&pkgs);
            let mut c = sb_1028();
            c.tenant = t2; c.user_id = u2; c.session_id = s2; c.agent = a2; c.scope = sc2;
            c.tainted = tainted; c.healthy = healthy;
            if !with_manifest { c.manifest = None; }
            if with_snapshot {
                c.clean_snapshots.push(CleanSnapshot { snapshot_id: "s".into(), manifest: python_manifest("3.12.4", &[]) });
            }
            (r, c)
        }
    }

    proptest! {
        #[test]
        fn cross_tenant_reuse_is_impossible((r, c) in pair()) {
            let d = checker().check(&r, &c);
            if r.tenant != c.tenant {
                prop_assert_eq!(d.action, ReuseAction::NewSandbox);
                prop_assert_eq!(d.score, 0.0);
            }
        }

        #[test]
        fn cross_user_reuse_is_impossible_under_user_scope((r, c) in pair()) {
            let d = checker().check(&r, &c);
            let norm = |u: &Option<String>| u.clone().filter(|s| !s.is_empty());
            if norm(&r.user_id) != norm(&c.user_id) && (r.scope == Scope::User || c.scope == Scope::User) {
                prop_assert_eq!(d.action, ReuseAction::NewSandbox);
            }
        }

        #[test]
        fn tainted_or_unhealthy_is_never_reused((r, c) in pair()) {
            let d = checker().check(&r, &c);
            if c.tainted || !c.healthy {
                prop_assert_eq!(d.action, ReuseAction::NewSandbox);
            }
        }

        #[test]
        fn scores_stay_in_range_and_new_sandbox_scores_zero((r, c) in pair()) {
            let d = checker().check(&r, &c);
            prop_assert!((0.0..=1.0).contains(&d.score));
            prop_assert!(!d.reasons.is_empty());
            if d.action == ReuseAction::NewSandbox {
                prop_assert_eq!(d.score, 0.0);
            }
            if d.action == ReuseAction::Reuse {
                // Reuse implies the proof: a manifest with no conflicts.
                let m = c.manifest.as_ref().unwrap();
                prop_assert!(r.requirements.packages.iter().all(|p| m.satisfies(p) || m.installed_version(p.ecosystem, &p.name).is_none()));
            }
        }

        #[test]
        fn pick_best_never_returns_another_tenant((r, c) in pair(), (_, c2) in pair()) {
            let cands = [c, c2];
            if let Some((i, d)) = checker().pick_best(&r, &cands) {
                prop_assert_eq!(&cands[i].tenant, &r.tenant);
                prop_assert_ne!(d.action, ReuseAction::NewSandbox);
            }
        }
    }
}
