//! The planner chain the server calls: LLM (if configured) else heuristic,
//! then telemetry right-sizing, with a trace of what ran.
//!
//! An invalid context or catalog is an error (the caller's fault). Every LLM
//! failure — timeout, HTTP error, oversized or malformed body, an answer that
//! breaks the schema or asks for more than a class — falls back to the
//! heuristic; the failure is in the trace and at the head of the reason
//! (`llm planner failed: timeout after 2s; heuristic: …`).

use crate::context::{planner_input_hash, TaskContext};
use crate::error::{error_chain, PlanError};
use crate::features::Features;
use crate::heuristic::{HeuristicPlanner, PlannerDefaults};
use crate::intent::{validate_catalog, ClassSpec, PlanSource, ResourceIntent};
use crate::llm::{LlmConfig, LlmPlanner};
use crate::telemetry::{TelemetryPlanner, TelemetryRules};
use crate::Planner;
use aviary_registry::AllocationRecord;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// What one planner of the chain did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StepOutcome {
    /// Its intent was taken as the base.
    Used,
    /// It failed; the chain fell back.
    Failed,
    /// Telemetry changed the intent.
    Adjusted,
    /// Telemetry looked and left the intent as it was.
    Unchanged,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlanStep {
    pub planner: PlanSource,
    pub outcome: StepOutcome,
    /// The error, the note or the chosen class.
    pub detail: String,
    pub elapsed_ms: f64,
}

/// Everything the caller should record next to the intent
/// (`sandbox_allocation.planner_input_hash`, `workload_signature`, events).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlanTrace {
    pub planner_input_hash: String,
    pub workload_signature: String,
    /// The normalized features the signature was made from.
    pub features: String,
    pub steps: Vec<PlanStep>,
    /// The LLM was configured but its answer was not used.
    pub fell_back: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlanOutcome {
    pub intent: ResourceIntent,
    pub trace: PlanTrace,
}

/// LLM → heuristic fallback → telemetry; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct ChainPlanner {
    heuristic: HeuristicPlanner,
    llm: Option<LlmPlanner>,
    telemetry: TelemetryPlanner,
}

impl ChainPlanner {
    /// `llm: None` runs heuristic + telemetry only. Fails only when the HTTP
    /// client cannot be built.
    pub fn new(
        defaults: PlannerDefaults,
        llm: Option<LlmConfig>,
        rules: TelemetryRules,
    ) -> Result<Self, PlanError> {
        let llm = match llm {
            Some(cfg) => Some(LlmPlanner::new(cfg, defaults.clone())?),
            None => None,
        };
        Ok(ChainPlanner {
            heuristic: HeuristicPlanner::new(defaults),
            llm,
            telemetry: TelemetryPlanner::new(rules),
        })
    }

    pub fn has_llm(&self) -> bool {
        self.llm.is_some()
    }

    /// Plans and says how. `history` may hold rows of any signature (e.g.
    /// the tenant's newest `sandbox_allocation` rows); only matching ones
    /// count.
    #[tracing::instrument(skip_all, fields(task_id = ctx.task_id.as_deref().unwrap_or("")))]
    pub async fn plan_traced(
        &self,
        ctx: &TaskContext,
        catalog: &[ClassSpec],
        history: &[AllocationRecord],
    ) -> Result<PlanOutcome, PlanError> {
        ctx.validate()?;
        validate_catalog(catalog)?;
        let features = Features::extract(ctx);
        let mut steps = Vec::new();
        let mut fell_back = false;
        let mut llm_failure: Option<String> = None;

        let mut base: Option<ResourceIntent> = None;
        if let Some(llm) = &self.llm {
            let t = Instant::now();
            match llm.ask(ctx, catalog).await {
                Ok(intent) => {
                    steps.push(PlanStep {
                        planner: PlanSource::Llm,
                        outcome: StepOutcome::Used,
                        detail: intent.resource_class.clone(),
                        elapsed_ms: ms(t),
                    });
                    base = Some(intent);
                }
                Err(e) => {
                    let msg = error_chain(&e);
                    tracing::warn!(error = %msg, "llm planner failed; falling back to heuristics");
                    steps.push(PlanStep {
                        planner: PlanSource::Llm,
                        outcome: StepOutcome::Failed,
                        detail: msg.clone(),
                        elapsed_ms: ms(t),
                    });
                    fell_back = true;
                    llm_failure = Some(msg);
                }
            }
        }
        let base = match base {
            Some(b) => b,
            None => {
                let t = Instant::now();
                let mut intent = self.heuristic.plan_features(ctx, &features, catalog);
                steps.push(PlanStep {
                    planner: PlanSource::Heuristic,
                    outcome: StepOutcome::Used,
                    detail: intent.resource_class.clone(),
                    elapsed_ms: ms(t),
                });
                if let Some(msg) = &llm_failure {
                    intent.reason = format!("llm planner failed: {msg}; {}", intent.reason);
                }
                intent
            }
        };

        let t = Instant::now();
        let adj = self.telemetry.adjust(base, &features, catalog, history);
        steps.push(PlanStep {
            planner: PlanSource::Telemetry,
            outcome: if adj.changed {
                StepOutcome::Adjusted
            } else {
                StepOutcome::Unchanged
            },
            detail: adj.note.clone(),
            elapsed_ms: ms(t),
        });
        let mut intent = adj.intent;
        if adj.changed || adj.samples > 0 {
            intent.reason = format!("{}; {}", intent.reason, adj.note);
        }

        Ok(PlanOutcome {
            intent,
            trace: PlanTrace {
                planner_input_hash: planner_input_hash(ctx),
                workload_signature: features.signature(),
                features: features.normalized(),
                steps,
                fell_back,
            },
        })
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

#[async_trait::async_trait]
impl Planner for ChainPlanner {
    async fn plan(
        &self,
        ctx: &TaskContext,
        catalog: &[ClassSpec],
        history: &[AllocationRecord],
    ) -> Result<ResourceIntent, PlanError> {
        Ok(self.plan_traced(ctx, catalog, history).await?.intent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn heuristic_only_chain_traces_both_steps() {
        let chain = ChainPlanner::default();
        assert!(!chain.has_llm());
        let out = chain
            .plan_traced(
                &TaskContext::new("用 Playwright 检查网页"),
                &ClassSpec::seed_defaults(),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(out.intent.resource_class, "browser-medium");
        assert_eq!(out.intent.source, PlanSource::Heuristic);
        let planners: Vec<_> = out.trace.steps.iter().map(|s| s.planner).collect();
        assert_eq!(planners, vec![PlanSource::Heuristic, PlanSource::Telemetry]);
        assert!(!out.trace.fell_back);
        assert_eq!(out.trace.planner_input_hash.len(), 64);
        assert!(out.trace.workload_signature.starts_with("ws-"));
    }

    #[tokio::test]
    async fn invalid_input_is_an_error_not_a_fallback() {
        let chain = ChainPlanner::default();
        let err = chain
            .plan_traced(&TaskContext::new(""), &ClassSpec::seed_defaults(), &[])
            .await
            .unwrap_err();
        assert!(err.is_bad_input());
        let err = chain
            .plan_traced(&TaskContext::new("x"), &[], &[])
            .await
            .unwrap_err();
        assert!(matches!(err, PlanError::RejectCatalog(_)), "{err}");
    }
}
