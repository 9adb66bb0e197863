//! Aviary's resource planner: decides *what* a sandbox needs.
//!
//! Input is a [`TaskContext`] (the agent's task text, plan steps, tools,
//! dependencies, sizes, flags); output is a [`ResourceIntent`] naming one class
//! of the configured catalog ([`ClassSpec`]) with a human-readable `reason`, a
//! `confidence` and the `source` that decided it. *Where* the sandbox runs is
//! the scheduler's business and *whether* it may run is the policy guard's: the
//! planner only recommends.
//!
//! Planners:
//! - [`HeuristicPlanner`]: deterministic weighted-signal feature extraction
//!   ([`Features`]) over the whole context, then class scoring.
//! - [`TelemetryPlanner`]: right-sizing from `sandbox_allocation` history of the
//!   same [`workload_signature`] (up after OOMs/timeouts, down when p95 peaks
//!   stay far below the class).
//! - [`LlmPlanner`]: any OpenAI-compatible chat-completions endpoint with a
//!   strict JSON schema; its answer is validated against the catalog.
//! - [`ChainPlanner`]: LLM (if configured) else heuristic, then telemetry; any
//!   LLM failure falls back to the heuristic and is recorded in the
//!   [`PlanTrace`].
//!
//! Text is data: every text field is cut into clauses before any signal is
//! read, and clauses addressed to the planner (class names, CPU counts, fake
//! system/admin notes, demands for the largest or smallest class), writing
//! *about* tools and reading their reports are not taken as work; each one
//! is named in the intent's reason. The LLM sees the context between
//! delimiters as untrusted data, and its answer is bounded by the features.
//! [`corpus`] holds the labelled corpus the planner is scored on.
//!
//! Invariants: every intent names a class of the catalog it was planned
//! against; nothing panics on any input (property-tested); a context is
//! validated before any planner sees it.
//!
//! Concurrency: all planners are immutable after construction and `Send +
//! Sync`; one instance serves concurrent requests.
#![forbid(unsafe_code)]

mod chain;
mod context;
pub mod corpus;
mod error;
mod features;
mod heuristic;
mod intent;
mod llm;
mod telemetry;
mod untrusted;

pub use chain::{ChainPlanner, PlanOutcome, PlanStep, PlanTrace, StepOutcome};
pub use context::{planner_input_hash, Risk, TaskContext};
pub use error::PlanError;
pub use features::{workload_signature, Features, MediaWork, Reader, WorkloadKind};
pub use heuristic::{HeuristicPlanner, PlannerDefaults};
pub use intent::{validate_catalog, ClassSpec, PlanSource, ResourceIntent};
pub use llm::{
    LlmConfig, LlmPlanner, CONTEXT_CLOSE, CONTEXT_OPEN, FAR_ABOVE_RATIO, MAX_LLM_BODY_BYTES,
};
pub use telemetry::{TelemetryPlanner, TelemetryRules};

use aviary_registry::AllocationRecord;

/// Turns a task context into a resource intent for one class of `catalog`.
///
/// `history` is `sandbox_allocation` rows (any signature, newest first is
/// fine); planners that do not use telemetry ignore it.
#[async_trait::async_trait]
pub trait Planner: Send + Sync {
    async fn plan(
        &self,
        ctx: &TaskContext,
        catalog: &[ClassSpec],
        history: &[AllocationRecord],
    ) -> Result<ResourceIntent, PlanError>;
}
