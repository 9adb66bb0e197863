//! Plan → policy: what a sandbox gets (DESIGN §1.2–1.3).
//!
//! The planner (heuristics, telemetry right-sizing, optional LLM) only
//! *recommends*; the policy guard maps the recommendation to a configured
//! class the tenant may use, clamps or denies. Every decision is stored in
//! `sandbox_allocation` and denials are events. "Where" (placement) is not
//! decided here.

use crate::context::{Caller, OpContext};
use crate::error::OpError;
use crate::ops::ControlPlane;
use crate::requests::AllocationQuery;
use aviary_config::Config;
use aviary_core::api::CreateSandboxRequest;
use aviary_core::{NetworkProfile, ResourceLimits};
use aviary_planner::{
    ChainPlanner, ClassSpec, LlmConfig, PlannerDefaults, ResourceIntent, TaskContext,
    TelemetryRules,
};
use aviary_policy::{IntentRequest, PolicyGuard, TenantUsage};
use aviary_registry::AllocationRecord;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The planner and the guard, built once from the configuration.
pub struct Planning {
    pub guard: PolicyGuard,
    pub planner: ChainPlanner,
    pub catalog: Vec<ClassSpec>,
    pub history_window: u32,
}

impl Planning {
    pub fn new(cfg: &Config, runtime: &str) -> anyhow::Result<Self> {
        let catalog: Vec<ClassSpec> = cfg
            .classes
            .iter()
            .map(|c| ClassSpec {
                name: c.name.clone(),
                cpu: c.cpu,
                memory_mb: c.memory_mb,
                disk_mb: c.disk_mb,
                pids: c.pids,
                gpu: c.gpu,
                runtimes: c.runtimes.iter().map(|r| r.as_str().to_owned()).collect(),
                network_profiles: c.network_profiles.clone(),
            })
            .collect();
        let llm = cfg.planner.llm.as_ref().map(|l| LlmConfig {
            base_url: l.base_url.clone(),
            model: l.model.clone(),
            api_key: l.resolve_api_key(),
            timeout: Duration::from_millis(l.timeout_ms),
        });
        let defaults = PlannerDefaults {
            template: cfg.server.default_template.clone(),
            runtime: runtime.to_owned(),
            ..Default::default()
        };
        let rules = TelemetryRules {
            window: cfg.planner.history_window as usize,
            ..Default::default()
        };
        Ok(Planning {
            guard: PolicyGuard::new(cfg),
            planner: ChainPlanner::new(defaults, llm, rules)
                .map_err(|e| anyhow::anyhow!("planner configuration: {e}"))?,
            catalog,
            history_window: cfg.planner.history_window,
        })
    }
}

/// What the guard approved for a create.
pub struct Approved {
    pub class: String,
    pub limits: ResourceLimits,
    pub network: NetworkProfile,
    /// The approved `[[network_profile]]` by name (its rules reach the node
    /// in the sandbox's spec).
    pub network_name: String,
    /// The runtime the guard approved (one of the class's runtimes); the
    /// sandbox runs on it, on whichever node offers it.
    pub runtime: String,
    pub reason: String,
    pub allocation: AllocationRecord,
    /// How the planner reached its recommendation, when the create carried
    /// a task context: recorded as the sandbox's `planned` event.
    pub planner_trace: Option<aviary_planner::PlanTrace>,
    /// What the guard was asked and what it approved, for the quota check
    /// of a sandbox the create really adds ([`ControlPlane::quota_stage`]).
    pub(crate) policy: (IntentRequest, aviary_policy::Approval),
}

/// Held from a create's quota check until its new sandbox's row exists
/// (inserted, or a pooled one claimed), so concurrent creates of one tenant
/// count each other: the lock `quota/<tenant>`.
pub(crate) struct QuotaHold {
    _held: aviary_leases::LockGuard,
}

/// How long a create waits for another create of the same tenant between
/// its quota check and its row (one placement and insert, or a claim).
const QUOTA_WAIT: Duration = Duration::from_secs(300);

/// `POST /v1/plan` answer: the recommendation, how it was reached, and what
/// the policy guard would do with it for the caller.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlanResponse {
    pub intent: ResourceIntent,
    pub trace: aviary_planner::PlanTrace,
    pub policy: PolicyView,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PolicyView {
    pub approved: bool,
    pub class: Option<String>,
    pub clamped: bool,
    pub reasons: Vec<String>,
    pub denial_code: Option<String>,
}

/// An allocation decision as the API shows it.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Allocation {
    pub id: i64,
    pub task_id: String,
    pub sandbox_id: Option<String>,
    pub planner_input_hash: String,
    pub workload_signature: String,
    pub recommended_class: String,
    pub actual_class: String,
    pub reason: String,
    pub confidence: f64,
    pub source: String,
    pub cpu: f64,
    pub memory_mb: u64,
    pub created_at: String,
    #[schema(value_type = Option<Object>)]
    pub usage: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AllocationList {
    pub allocations: Vec<Allocation>,
}

fn parse_context(v: &serde_json::Value) -> Result<TaskContext, OpError> {
    let ctx: TaskContext = serde_json::from_value(v.clone())
        .map_err(|e| OpError::InvalidRequest(format!("task context: {e}")))?;
    ctx.validate()
        .map_err(|e| OpError::InvalidRequest(format!("task context: {e}")))?;
    Ok(ctx)
}

impl ControlPlane {
    /// The tenant whose policy applies: the caller's own `[[tenant]]`, or the
    /// `default` tenant's rules for tenants the configuration does not list.
    fn policy_tenant<'a>(&self, caller: &'a Caller) -> &'a str {
        if self.cfg.settings.tenant(&caller.tenant).is_some() {
            &caller.tenant
        } else {
            "default"
        }
    }

    async fn tenant_usage(&self, tenant: &str) -> Result<TenantUsage, OpError> {
        // sums, not rows: a create's quota check costs the same with a
        // thousand live sandboxes as with one
        let mut u = TenantUsage::default();
        for t in self.registry.live_totals(Some(tenant)).await? {
            if t.state.is_terminal() {
                continue;
            }
            u.sandboxes = u
                .sandboxes
                .saturating_add(u32::try_from(t.sandboxes).unwrap_or(u32::MAX));
            u.cpu += t.cpu;
            u.memory_mb += t.memory_mb;
        }
        Ok(u)
    }

    async fn run_planner(
        &self,
        caller: &Caller,
        ctx: &TaskContext,
    ) -> Result<aviary_planner::PlanOutcome, OpError> {
        let history = self
            .registry
            .list_allocations(
                Some(&caller.tenant),
                self.planning.history_window.max(1) * 20,
            )
            .await?;
        self.planning
            .planner
            .plan_traced(ctx, &self.planning.catalog, &history)
            .await
            .map_err(OpError::from)
    }

    /// `POST /v1/plan`: recommendation + what policy would do; recorded.
    /// The request is the task context (DESIGN §7), a JSON object.
    pub async fn plan(
        &self,
        cx: &OpContext,
        context: serde_json::Value,
    ) -> Result<PlanResponse, OpError> {
        let caller = &cx.caller;
        let ctx = parse_context(&context)?;
        let outcome = self.run_planner(caller, &ctx).await?;
        let usage = self.tenant_usage(&caller.tenant).await?;
        let req = intent_request(&outcome.intent);
        let policy = match self
            .planning
            .guard
            .approve(self.policy_tenant(caller), &req, &usage)
        {
            Ok(a) => PolicyView {
                approved: true,
                class: Some(a.class.clone()),
                clamped: a.clamped,
                reasons: a.reasons.clone(),
                denial_code: None,
            },
            Err(d) => PolicyView {
                approved: false,
                class: None,
                clamped: false,
                reasons: vec![d.message.clone()],
                denial_code: Some(d.code.as_str().to_owned()),
            },
        };
        let i = &outcome.intent;
        self.registry
            .insert_allocation(&AllocationRecord {
                id: None,
                task_id: ctx.task_id.clone().unwrap_or_default(),
                tenant: caller.tenant.clone(),
                sandbox_id: None,
                planner_input_hash: outcome.trace.planner_input_hash.clone(),
                workload_signature: outcome.trace.workload_signature.clone(),
                recommended_class: i.resource_class.clone(),
                actual_class: policy.class.clone().unwrap_or_default(),
                reason: i.reason.clone(),
                confidence: i.confidence,
                source: i.source.as_str().to_owned(),
                cpu: i.cpu,
                memory_mb: i.memory_mb,
                created_at: aviary_core::now(),
                usage: None,
            })
            .await?;
        Ok(PlanResponse {
            intent: outcome.intent,
            trace: outcome.trace,
            policy,
        })
    }

    /// Plan (when the request carries a task context) and approve a class.
    pub(crate) async fn decide(
        &self,
        cx: &OpContext,
        req: &CreateSandboxRequest,
    ) -> Result<Approved, OpError> {
        let caller = &cx.caller;
        let settings = &self.cfg.settings;
        let network_name = req.network.clone().unwrap_or_else(|| "none".into());
        // asked for, or the default (then only when the class offers it)
        let wanted_runtime = WantedRuntime::from_request(req, self.runtime().name());
        let mut planner_trace = None;
        let (intent_req, recommended, reason, confidence, source, input_hash, signature, task_id) =
            match (&req.class, &req.intent) {
                (Some(class), _) => {
                    let c = settings.class(class).ok_or_else(|| {
                        OpError::InvalidRequest(format!(
                            "unknown resource class {class:?} (known: {})",
                            settings
                                .classes
                                .iter()
                                .map(|c| c.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                    (
                        class_request(c, &network_name, &wanted_runtime),
                        class.clone(),
                        "class requested by the caller".to_owned(),
                        1.0,
                        "request".to_owned(),
                        String::new(),
                        format!("class:{class}"),
                        String::new(),
                    )
                }
                (None, Some(context)) => {
                    let ctx = parse_context(context)?;
                    let out = self.run_planner(caller, &ctx).await?;
                    let mut r = intent_request(&out.intent);
                    if let WantedRuntime::Asked(rt) = &wanted_runtime {
                        r.runtime = Some(rt.clone());
                    }
                    let mut reason = out.intent.reason.clone();
                    if req.network.is_some() {
                        r.network_profile = Some(network_name.clone());
                    } else if r.network_profile.as_deref().is_some_and(|n| n != "none") {
                        // a recommendation only: the caller did not ask for a
                        // network, and this node grants loopback only
                        reason.push_str(&format!(
                            "; planner suggested network {:?}, granted \"none\" (ask with `network` explicitly)",
                            r.network_profile.as_deref().unwrap_or_default()
                        ));
                        r.network_profile = Some("none".into());
                    }
                    planner_trace = Some(out.trace.clone());
                    (
                        r,
                        out.intent.resource_class.clone(),
                        reason,
                        out.intent.confidence,
                        out.intent.source.as_str().to_owned(),
                        out.trace.planner_input_hash.clone(),
                        out.trace.workload_signature.clone(),
                        ctx.task_id.clone().unwrap_or_default(),
                    )
                }
                (None, None) => {
                    let class = &self.cfg.default_class;
                    let c = settings.class(class).ok_or_else(|| {
                        OpError::internal(anyhow::anyhow!(
                            "default class {class:?} is not configured"
                        ))
                    })?;
                    (
                        class_request(c, &network_name, &wanted_runtime),
                        class.clone(),
                        "default class".to_owned(),
                        1.0,
                        "default".to_owned(),
                        String::new(),
                        format!("class:{class}"),
                        String::new(),
                    )
                }
            };
        // quotas are checked later, only for a sandbox the create adds
        let approval = match self
            .planning
            .guard
            .approve_class(self.policy_tenant(caller), &intent_req)
        {
            Ok(a) => a,
            Err(d) => return Err(self.denied(cx, &recommended, d).await),
        };
        // the node enforces the profile (`allowlist`: its egress proxy;
        // `open`: its NAT stack) or the create is refused before compute
        let enforced = self
            .runtimes
            .get(approval.runtime.as_str())
            .is_none_or(|r| r.runtime.enforces_network(approval.network_kind));
        if !enforced {
            return Err(OpError::InvalidRequest(format!(
                "network profile {:?} ({}) is allowed but not available on this node: it cannot enforce it",
                approval.network_profile,
                approval.network_kind.as_str()
            )));
        }
        let mut reasons = vec![reason.clone()];
        reasons.extend(approval.reasons.iter().cloned());
        let reason_text = reasons.join("; ");
        Ok(Approved {
            class: approval.class.clone(),
            limits: approval.limits,
            network: approval.network_kind,
            network_name: approval.network_profile.clone(),
            runtime: approval.runtime.as_str().to_owned(),
            reason: reason_text.clone(),
            allocation: AllocationRecord {
                id: None,
                task_id,
                tenant: caller.tenant.clone(),
                sandbox_id: None,
                planner_input_hash: input_hash,
                workload_signature: signature,
                recommended_class: recommended,
                actual_class: approval.class.clone(),
                reason: reason_text,
                confidence,
                source,
                cpu: approval.limits.cpu,
                memory_mb: approval.limits.memory_mb,
                created_at: aviary_core::now(),
                usage: None,
            },
            planner_trace,
            policy: (intent_req, approval),
        })
    }

    /// Records a policy denial (`policy.denied`) and answers it.
    async fn denied(&self, cx: &OpContext, recommended: &str, d: aviary_policy::Denial) -> OpError {
        let mut meta = d.to_event_metadata();
        meta["recommended_class"] = serde_json::Value::String(recommended.to_owned());
        if let Err(e) = self
            .record_event(
                &cx.caller.tenant,
                None,
                None,
                aviary_policy::Denial::EVENT_TYPE,
                cx.request_id(),
                meta,
            )
            .await
        {
            return e;
        }
        OpError::Forbidden(format!(
            "policy denied the sandbox: {} [{}]",
            d.message,
            d.code.as_str()
        ))
    }

    /// The create pipeline's quota stage, for a sandbox the create adds
    /// (after the scope stage found none to hand back): takes `quota/<tenant>`
    /// and checks the tenant's quotas against the registry's rows read under
    /// it. Keep the hold until the new row exists.
    pub(crate) async fn quota_stage(
        &self,
        cx: &OpContext,
        approved: &Approved,
    ) -> Result<QuotaHold, OpError> {
        let caller = &cx.caller;
        let held = self
            .hold_lock(
                aviary_leases::LockName::new("quota", &caller.tenant),
                "quota check",
                QUOTA_WAIT,
            )
            .await?;
        let usage = self.tenant_usage(&caller.tenant).await?;
        let (req, approval) = &approved.policy;
        if let Err(d) =
            self.planning
                .guard
                .check_quota(self.policy_tenant(caller), req, approval, &usage)
        {
            return Err(self
                .denied(cx, &approved.allocation.recommended_class, d)
                .await);
        }
        Ok(QuotaHold { _held: held })
    }

    pub async fn allocations(
        &self,
        cx: &OpContext,
        req: AllocationQuery,
    ) -> Result<AllocationList, OpError> {
        let recs = self
            .registry
            .list_allocations(
                Some(&cx.caller.tenant),
                req.limit.unwrap_or(100).clamp(1, 1000),
            )
            .await?;
        Ok(AllocationList {
            allocations: recs
                .into_iter()
                .map(|a| Allocation {
                    id: a.id.unwrap_or_default(),
                    task_id: a.task_id,
                    sandbox_id: a.sandbox_id.map(|s| s.to_string()),
                    planner_input_hash: a.planner_input_hash,
                    workload_signature: a.workload_signature,
                    recommended_class: a.recommended_class,
                    actual_class: a.actual_class,
                    reason: a.reason,
                    confidence: a.confidence,
                    source: a.source,
                    cpu: a.cpu,
                    memory_mb: a.memory_mb,
                    created_at: crate::ops::rfc3339(a.created_at),
                    usage: a.usage.map(|u| serde_json::to_value(u).unwrap_or_default()),
                })
                .collect(),
        })
    }
}

/// The runtime a create asks for, or the control plane's default.
enum WantedRuntime {
    Asked(String),
    Default(String),
}

impl WantedRuntime {
    fn from_request(req: &CreateSandboxRequest, default: &str) -> Self {
        match req.runtime.as_deref().filter(|r| !r.is_empty()) {
            Some(r) => WantedRuntime::Asked(r.to_owned()),
            None => WantedRuntime::Default(default.to_owned()),
        }
    }
}

fn class_request(
    c: &aviary_config::ResourceClass,
    network: &str,
    runtime: &WantedRuntime,
) -> IntentRequest {
    IntentRequest {
        class: c.name.clone(),
        cpu: c.cpu,
        memory_mb: c.memory_mb,
        disk_mb: c.disk_mb,
        needs_gpu: false,
        network_profile: Some(network.to_owned()),
        runtime: match runtime {
            // the guard checks the class offers it and the tenant may use it
            WantedRuntime::Asked(r) => Some(r.clone()),
            // the default when the class offers it; otherwise the guard
            // picks one of the class's runtimes
            WantedRuntime::Default(r) => c
                .runtimes
                .iter()
                .any(|x| x.as_str() == r)
                .then(|| r.clone()),
        },
        template: None,
    }
}

fn intent_request(i: &ResourceIntent) -> IntentRequest {
    let opt = |s: &str| {
        if s.is_empty() {
            None
        } else {
            Some(s.to_owned())
        }
    };
    IntentRequest {
        class: i.resource_class.clone(),
        cpu: i.cpu,
        memory_mb: i.memory_mb,
        disk_mb: i.disk_mb,
        needs_gpu: i.needs_gpu,
        network_profile: opt(&i.network_profile),
        runtime: opt(&i.runtime),
        template: opt(&i.template),
    }
}
