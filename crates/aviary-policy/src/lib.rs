//! Aviary's policy guard: the planner recommends, the guard approves.
//!
//! The guard owns one decision: given a tenant, a planner's recommendation
//! ([`IntentRequest`]) and what the tenant already uses ([`TenantUsage`]), which
//! configured resource class (and network profile, runtime, template) the new
//! sandbox gets — or why it gets none ([`Denial`]).
//!
//! Invariants of every [`Approval`]:
//! - its `limits` are exactly one configured class's limits, never numbers
//!   from the request (a planner asking for 64 CPUs gets at most the biggest
//!   class the tenant may use);
//! - the tenant may use that class, the network profile and the runtime, and
//!   the class offers both;
//! - a GPU request gets a class with a GPU;
//! - the tenant's quotas hold with this sandbox counted (class limits, not
//!   measured use).
//!
//! Choosing the class:
//! 1. The requested class is used when it is *eligible*: configured, allowed
//!    for the tenant, offering the network profile and a usable runtime, and
//!    with a GPU when one is needed. Request numbers above the class's limits
//!    are clamped to the class (reason `clamped: requested 64 cpu, class
//!    compute-large has 8`).
//! 2. Otherwise the *needs* are the requested class's limits (when it is
//!    configured; the request numbers when it is not), and the guard picks
//!    the **largest eligible class no bigger than the needs** in cpu, memory
//!    and disk — so a substitute never grants more than was asked. When every
//!    eligible class is bigger, it picks the **smallest** eligible class (the
//!    closest from above). Classes are ordered by memory, then cpu, then
//!    disk; ties go to the class listed first in the configuration. A request
//!    that needs no GPU is given a GPU class only when no other is eligible.
//! 3. When no class is eligible at all the request is denied, with the code
//!    of the constraint that left nothing: class, GPU, network profile or
//!    runtime. Quotas are checked last, against the chosen class.
//!
//! Over-commit is not the guard's concern: each sandbox's limits are real
//! cgroup limits whatever the host has; how far a node's committed sum may
//! exceed its capacity is `[overcommit]` in the configuration, applied by the
//! scheduler.
//!
//! The guard is immutable after [`PolicyGuard::new`]; share it freely across
//! threads. It does no I/O; recording denials as events is the caller's job
//! ([`Denial::to_event_metadata`]).
#![forbid(unsafe_code)]

use aviary_config::{Config, NetworkProfileDef, ResourceClass, Runtime, Tenant};
use aviary_core::{ErrorCode, NetworkProfile, ResourceLimits};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::fmt;

/// What the planner recommends (the integrator converts a `ResourceIntent`
/// into this). Numbers are only used to pick a substitute class and to say
/// what was clamped; they never become limits.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IntentRequest {
    /// Recommended class name; may be unknown or empty (then the numbers decide).
    pub class: String,
    pub cpu: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub needs_gpu: bool,
    /// Network profile name; `None` or empty means `"none"`.
    pub network_profile: Option<String>,
    /// Runtime name (`crun`, `runc`); `None` means the server's runtime when
    /// the class and tenant allow it, else the first one they both allow.
    pub runtime: Option<String>,
    /// Template name; `None` means `server.default_template`. Passed through.
    pub template: Option<String>,
}

/// What the tenant holds right now: its live sandboxes and the sum of their
/// classes' limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantUsage {
    pub sandboxes: u32,
    pub cpu: f64,
    pub memory_mb: u64,
}

/// An approved request: exactly one configured class.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Approval {
    pub class: String,
    /// The class's limits, verbatim.
    pub limits: ResourceLimits,
    pub network_profile: String,
    /// The kind of `network_profile` (what the runtime has to set up).
    pub network_kind: NetworkProfile,
    pub runtime: Runtime,
    pub template: String,
    /// The class differs from the requested one, or the request asked for
    /// more than the class gives.
    pub clamped: bool,
    /// Human-readable reasons, first the decision, then each adjustment.
    pub reasons: Vec<String>,
}

impl Approval {
    /// Event type for approvals in the event log.
    pub const EVENT_TYPE: &'static str = "policy.approved";

    /// JSON for the event's metadata.
    pub fn to_event_metadata(&self) -> serde_json::Value {
        json!({
            "class": self.class,
            "limits": self.limits,
            "network_profile": self.network_profile,
            "runtime": self.runtime.as_str(),
            "template": self.template,
            "clamped": self.clamped,
            "reasons": self.reasons,
        })
    }
}

/// Why a request was denied.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenialCode {
    /// The chosen class would exceed a tenant quota (sandboxes, cpu, memory).
    OverQuota,
    /// The tenant may use no class at all.
    ClassNotAllowed,
    /// A GPU is needed and no class the tenant may use has one.
    GpuNotAvailable,
    /// The profile is unknown, not allowed for the tenant, or offered by no
    /// class the tenant may use.
    NetworkProfileNotAllowed,
    /// The runtime is unknown, not allowed for the tenant, or offered by no
    /// class the tenant may use.
    RuntimeNotAllowed,
    /// The configuration has no policy for this tenant.
    UnknownTenant,
}

impl DenialCode {
    pub fn as_str(self) -> &'static str {
        match self {
            DenialCode::OverQuota => "over_quota",
            DenialCode::ClassNotAllowed => "class_not_allowed",
            DenialCode::GpuNotAvailable => "gpu_not_available",
            DenialCode::NetworkProfileNotAllowed => "network_profile_not_allowed",
            DenialCode::RuntimeNotAllowed => "runtime_not_allowed",
            DenialCode::UnknownTenant => "unknown_tenant",
        }
    }
}

impl fmt::Display for DenialCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A denied request. Denials are events: record
/// [`Denial::to_event_metadata`] under [`Denial::EVENT_TYPE`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Denial {
    pub code: DenialCode,
    /// Says what was asked, what the policy allows, and for whom.
    pub message: String,
    pub tenant: String,
    pub requested_class: String,
}

impl Denial {
    /// Event type for denials in the event log.
    pub const EVENT_TYPE: &'static str = "policy.denied";

    /// The API error code: every denial is `forbidden` (HTTP 403).
    pub fn error_code(&self) -> ErrorCode {
        ErrorCode::Forbidden
    }

    /// JSON for the event's metadata.
    pub fn to_event_metadata(&self) -> serde_json::Value {
        json!({
            "code": self.code.as_str(),
            "message": self.message,
            "tenant": self.tenant,
            "requested_class": self.requested_class,
        })
    }
}

/// Approves or denies intents against the configured classes and tenants.
#[derive(Clone, Debug)]
pub struct PolicyGuard {
    classes: Vec<ResourceClass>,
    profiles: Vec<NetworkProfileDef>,
    tenants: Vec<Tenant>,
    default_runtime: Runtime,
    default_template: String,
}

/// Slack for comparing CPU sums (fractional cores add up inexactly).
const CPU_EPSILON: f64 = 1e-9;

impl PolicyGuard {
    pub fn new(config: &Config) -> PolicyGuard {
        PolicyGuard {
            classes: config.classes.clone(),
            profiles: config.network_profiles.clone(),
            tenants: config.tenants.clone(),
            default_runtime: config.server.runtime,
            default_template: config.server.default_template.clone(),
        }
    }

    /// Maps `req` to a class `tenant` may use, or denies it; quotas
    /// included ([`Self::approve_class`] then [`Self::check_quota`]).
    pub fn approve(
        &self,
        tenant: &str,
        req: &IntentRequest,
        usage: &TenantUsage,
    ) -> Result<Approval, Denial> {
        let approval = self.approve_class(tenant, req)?;
        self.check_quota(tenant, req, &approval, usage)?;
        Ok(approval)
    }

    fn tenant_rules(&self, tenant: &str, req: &IntentRequest) -> Result<&Tenant, Denial> {
        self.tenants
            .iter()
            .find(|t| t.name == tenant)
            .ok_or_else(|| Denial {
                code: DenialCode::UnknownTenant,
                message: format!("tenant {tenant:?} has no policy in the configuration"),
                tenant: tenant.to_owned(),
                requested_class: req.class.clone(),
            })
    }

    /// Everything [`Self::approve`] decides but the quotas: the class, its
    /// network profile, runtime and template. A caller that may not need a
    /// new sandbox (a scope hands an existing one back) approves the class
    /// first and checks the quota only for a sandbox it really adds, under a
    /// lock that covers the new sandbox's row.
    pub fn approve_class(&self, tenant: &str, req: &IntentRequest) -> Result<Approval, Denial> {
        let deny = |code: DenialCode, message: String| Denial {
            code,
            message,
            tenant: tenant.to_owned(),
            requested_class: req.class.clone(),
        };
        let t = self.tenant_rules(tenant, req)?;
        let mut reasons = Vec::new();

        // Network profile: configured and allowed for the tenant.
        let profile_name = req
            .network_profile
            .as_deref()
            .filter(|p| !p.is_empty())
            .unwrap_or("none");
        let profile = self
            .profiles
            .iter()
            .find(|p| p.name == profile_name)
            .ok_or_else(|| {
                deny(
                    DenialCode::NetworkProfileNotAllowed,
                    format!("network profile {profile_name:?} is not configured"),
                )
            })?;
        if !t.allowed_network_profiles.allows_name(profile_name) {
            return Err(deny(
                DenialCode::NetworkProfileNotAllowed,
                format!("tenant {tenant:?} may not use network profile {profile_name:?}"),
            ));
        }

        // Runtime: known and allowed for the tenant, when one is asked for.
        let runtime = match req.runtime.as_deref().filter(|r| !r.is_empty()) {
            None => None,
            Some(name) => {
                let rt = name
                    .parse::<Runtime>()
                    .map_err(|e| deny(DenialCode::RuntimeNotAllowed, e))?;
                if !t.allowed_runtimes.allows(&rt) {
                    return Err(deny(
                        DenialCode::RuntimeNotAllowed,
                        format!("tenant {tenant:?} may not use runtime {rt}"),
                    ));
                }
                Some(rt)
            }
        };

        // Eligible classes, narrowing one constraint at a time so that a
        // denial names the constraint that left nothing.
        let allowed: Vec<&ResourceClass> = self
            .classes
            .iter()
            .filter(|c| t.allowed_classes.allows_name(&c.name))
            .collect();
        if allowed.is_empty() {
            return Err(deny(
                DenialCode::ClassNotAllowed,
                format!("tenant {tenant:?} may not use any resource class"),
            ));
        }
        let with_gpu: Vec<&ResourceClass> = if req.needs_gpu {
            allowed.iter().copied().filter(|c| c.gpu).collect()
        } else {
            allowed
        };
        if with_gpu.is_empty() {
            let gpu_classes: Vec<&str> = self
                .classes
                .iter()
                .filter(|c| c.gpu)
                .map(|c| c.name.as_str())
                .collect();
            let message = if gpu_classes.is_empty() {
                "a GPU is needed and no configured class has one".to_owned()
            } else {
                format!(
                    "a GPU is needed and tenant {tenant:?} may not use a GPU class ({})",
                    gpu_classes.join(", ")
                )
            };
            return Err(deny(DenialCode::GpuNotAvailable, message));
        }
        let gpu_note = if req.needs_gpu { " with a GPU" } else { "" };
        let with_profile: Vec<&ResourceClass> = with_gpu
            .into_iter()
            .filter(|c| c.supports_network_profile(profile_name))
            .collect();
        if with_profile.is_empty() {
            return Err(deny(
                DenialCode::NetworkProfileNotAllowed,
                format!(
                    "no class{gpu_note} that tenant {tenant:?} may use offers network profile {profile_name:?}"
                ),
            ));
        }
        let usable_runtime = |c: &ResourceClass| match runtime {
            Some(rt) => c.supports_runtime(rt),
            None => c.runtimes.iter().any(|rt| t.allowed_runtimes.allows(rt)),
        };
        let eligible: Vec<&ResourceClass> = with_profile
            .into_iter()
            .filter(|c| usable_runtime(c))
            .collect();
        if eligible.is_empty() {
            let what = runtime.map_or_else(
                || "a runtime it may use".to_owned(),
                |rt| format!("runtime {rt}"),
            );
            return Err(deny(
                DenialCode::RuntimeNotAllowed,
                format!(
                    "no class{gpu_note} with network profile {profile_name:?} that tenant {tenant:?} may use runs on {what}"
                ),
            ));
        }

        // Sanitised request numbers: NaN, infinite or negative CPU counts as none.
        let req_cpu = if req.cpu.is_finite() && req.cpu >= 0.0 {
            req.cpu
        } else {
            reasons.push(format!("ignored invalid cpu request {}", req.cpu));
            0.0
        };

        let requested = self.classes.iter().find(|c| c.name == req.class);
        let mut clamped = false;
        let chosen: &ResourceClass = match requested {
            Some(c) if eligible.iter().any(|e| e.name == c.name) => {
                reasons.push(format!("class {:?} approved for tenant {tenant:?}", c.name));
                c
            }
            _ => {
                let why = match requested {
                    None if req.class.is_empty() => "no class requested".to_owned(),
                    None => format!("class {:?} is not configured", req.class),
                    Some(c) if !t.allowed_classes.allows_name(&c.name) => {
                        format!("tenant {tenant:?} may not use class {:?}", c.name)
                    }
                    Some(c) if req.needs_gpu && !c.gpu => {
                        format!("class {:?} has no GPU", c.name)
                    }
                    Some(c) if !c.supports_network_profile(profile_name) => format!(
                        "class {:?} does not offer network profile {profile_name:?}",
                        c.name
                    ),
                    Some(c) => format!(
                        "class {:?} runs on no runtime allowed here ({})",
                        c.name,
                        runtime.map_or("tenant's runtimes", Runtime::as_str)
                    ),
                };
                let needs = match requested {
                    Some(c) => Needs {
                        cpu: c.cpu,
                        memory_mb: c.memory_mb,
                        disk_mb: c.disk_mb,
                    },
                    None => Needs {
                        cpu: req_cpu,
                        memory_mb: req.memory_mb,
                        disk_mb: req.disk_mb,
                    },
                };
                let (c, how) = substitute(&eligible, req.needs_gpu, &needs);
                reasons.push(format!(
                    "{why}; using class {:?} ({} cpu, {} MiB), {how}",
                    c.name, c.cpu, c.memory_mb
                ));
                clamped = true;
                c
            }
        };

        // The request's numbers never exceed the chosen class's limits.
        if req_cpu > chosen.cpu + CPU_EPSILON {
            reasons.push(format!(
                "clamped: requested {req_cpu} cpu, class {} has {}",
                chosen.name, chosen.cpu
            ));
            clamped = true;
        }
        if req.memory_mb > chosen.memory_mb {
            reasons.push(format!(
                "clamped: requested {} MiB memory, class {} has {}",
                req.memory_mb, chosen.name, chosen.memory_mb
            ));
            clamped = true;
        }
        if req.disk_mb > chosen.disk_mb {
            reasons.push(format!(
                "clamped: requested {} MiB disk, class {} has {}",
                req.disk_mb, chosen.name, chosen.disk_mb
            ));
            clamped = true;
        }

        let runtime = match runtime {
            Some(rt) => rt,
            None if chosen.supports_runtime(self.default_runtime)
                && t.allowed_runtimes.allows(&self.default_runtime) =>
            {
                self.default_runtime
            }
            None => {
                // Eligibility guarantees one exists.
                let rt = chosen
                    .runtimes
                    .iter()
                    .copied()
                    .find(|rt| t.allowed_runtimes.allows(rt))
                    .unwrap_or(self.default_runtime);
                reasons.push(format!(
                    "runtime {rt}: the server's {} is not allowed for this class or tenant",
                    self.default_runtime
                ));
                rt
            }
        };

        let template = req
            .template
            .clone()
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| self.default_template.clone());
        Ok(Approval {
            class: chosen.name.clone(),
            limits: chosen.limits(),
            network_profile: profile.name.clone(),
            network_kind: profile.kind,
            runtime,
            template,
            clamped,
            reasons,
        })
    }

    /// Whether one more sandbox of the approved class fits `tenant`'s
    /// quotas, given what it `usage`s now (counting the new sandbox at its
    /// class's limits).
    pub fn check_quota(
        &self,
        tenant: &str,
        req: &IntentRequest,
        approval: &Approval,
        usage: &TenantUsage,
    ) -> Result<(), Denial> {
        let deny = |code: DenialCode, message: String| Denial {
            code,
            message,
            tenant: tenant.to_owned(),
            requested_class: req.class.clone(),
        };
        let t = self.tenant_rules(tenant, req)?;
        let chosen = &approval.limits;
        let class = &approval.class;
        if usage.sandboxes.saturating_add(1) > t.max_sandboxes {
            return Err(deny(
                DenialCode::OverQuota,
                format!(
                    "tenant {tenant:?} has {} of {} sandboxes",
                    usage.sandboxes, t.max_sandboxes
                ),
            ));
        }
        if usage.cpu + chosen.cpu > t.max_cpu + CPU_EPSILON {
            return Err(deny(
                DenialCode::OverQuota,
                format!(
                    "tenant {tenant:?} cpu quota is {}: {} in use + {} for class {} exceeds it",
                    t.max_cpu, usage.cpu, chosen.cpu, class
                ),
            ));
        }
        if usage.memory_mb.saturating_add(chosen.memory_mb) > t.max_memory_mb {
            return Err(deny(
                DenialCode::OverQuota,
                format!(
                    "tenant {tenant:?} memory quota is {} MiB: {} in use + {} for class {} exceeds it",
                    t.max_memory_mb, usage.memory_mb, chosen.memory_mb, class
                ),
            ));
        }
        Ok(())
    }
}

/// What a substitute class is measured against.
struct Needs {
    cpu: f64,
    memory_mb: u64,
    disk_mb: u64,
}

/// Ordering of classes by size: memory, then cpu, then disk.
fn bigger(a: &ResourceClass, b: &ResourceClass) -> bool {
    (a.memory_mb, a.cpu, a.disk_mb) > (b.memory_mb, b.cpu, b.disk_mb)
}

/// The largest eligible class no bigger than `needs`, else the smallest one.
/// Prefers classes without a GPU when none is needed. `eligible` is non-empty.
fn substitute<'a>(
    eligible: &[&'a ResourceClass],
    needs_gpu: bool,
    needs: &Needs,
) -> (&'a ResourceClass, &'static str) {
    let without_gpu: Vec<&ResourceClass> = eligible.iter().copied().filter(|c| !c.gpu).collect();
    let pool: &[&ResourceClass] = if !needs_gpu && !without_gpu.is_empty() {
        &without_gpu
    } else {
        eligible
    };
    let fits = |c: &ResourceClass| {
        c.cpu <= needs.cpu + CPU_EPSILON
            && c.memory_mb <= needs.memory_mb
            && c.disk_mb <= needs.disk_mb
    };
    let mut largest_fit: Option<&ResourceClass> = None;
    let mut smallest: &ResourceClass = pool[0];
    for &c in pool {
        if fits(c) && largest_fit.is_none_or(|best| bigger(c, best)) {
            largest_fit = Some(c);
        }
        if bigger(smallest, c) {
            smallest = c;
        }
    }
    match largest_fit {
        Some(c) => (c, "the largest allowed class no bigger than the request"),
        None => (
            smallest,
            "the smallest allowed class (every allowed class is bigger than the request)",
        ),
    }
}

#[cfg(test)]
mod tests;
