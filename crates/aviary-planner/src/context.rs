//! The planner's input: the task context (DESIGN §7) and its validation.

use crate::PlanError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Longest accepted task text, in bytes.
pub const MAX_TASK_BYTES: usize = 64 * 1024;
/// Most items in any one list field.
pub const MAX_LIST_ITEMS: usize = 1000;
/// Longest accepted list item, in bytes.
pub const MAX_ITEM_BYTES: usize = 4 * 1024;
/// Most bytes of text over all list fields together.
pub const MAX_LIST_TOTAL_BYTES: usize = 256 * 1024;
const MAX_SIZE_MB: f64 = 1024.0 * 1024.0 * 1024.0; // 1 PiB
const MAX_DURATION_S: f64 = 30.0 * 24.0 * 3600.0;

/// How risky the agent (or its orchestrator) judges the task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Risk {
    Low,
    Medium,
    High,
}

/// What the agent is about to do. Every field but `task` is optional;
/// unknown fields are rejected.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskContext {
    /// The user's task, as text.
    pub task: String,
    /// The agent's plan steps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plan: Vec<String>,
    /// Tools / commands the agent intends to call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub languages: Vec<String>,
    /// Packages the task will install or import.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dependencies: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo_size_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_size_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_duration_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_browser: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_gpu: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_compile: Option<bool>,
    /// A network profile name (`none`, `pypi-readonly`, `open`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub risk: Option<Risk>,
    /// The caller's id for this task, for telemetry; not part of the input hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
}

impl TaskContext {
    /// A context with only the task text.
    pub fn new(task: impl Into<String>) -> Self {
        TaskContext {
            task: task.into(),
            ..TaskContext::default()
        }
    }

    /// Parses a JSON task context (unknown fields and wrong types are errors)
    /// and validates it.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        let ctx: TaskContext =
            serde_json::from_str(text).map_err(|e| PlanError::RejectContext(e.to_string()))?;
        ctx.validate()?;
        Ok(ctx)
    }

    /// Rejects absurd input: blank or oversized text, too many or oversized
    /// list items, negative, non-finite or huge numbers, malformed names.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |msg: String| Err(PlanError::RejectContext(msg));
        if self.task.trim().is_empty() {
            return bad("task must not be empty".into());
        }
        if self.task.len() > MAX_TASK_BYTES {
            return bad(format!(
                "task is {} bytes, at most {MAX_TASK_BYTES} allowed",
                self.task.len()
            ));
        }
        if self.task.contains('\0') {
            return bad("task contains a NUL character".into());
        }
        let mut total = 0usize;
        for (name, list) in [
            ("plan", &self.plan),
            ("tools", &self.tools),
            ("languages", &self.languages),
            ("dependencies", &self.dependencies),
        ] {
            if list.len() > MAX_LIST_ITEMS {
                return bad(format!(
                    "{name} has {} items, at most {MAX_LIST_ITEMS} allowed",
                    list.len()
                ));
            }
            for (i, item) in list.iter().enumerate() {
                if item.len() > MAX_ITEM_BYTES {
                    return bad(format!(
                        "{name}[{i}] is {} bytes, at most {MAX_ITEM_BYTES} allowed",
                        item.len()
                    ));
                }
                if item.contains('\0') {
                    return bad(format!("{name}[{i}] contains a NUL character"));
                }
                total += item.len();
            }
        }
        if total > MAX_LIST_TOTAL_BYTES {
            return bad(format!(
                "list fields hold {total} bytes together, at most {MAX_LIST_TOTAL_BYTES} allowed"
            ));
        }
        for (name, value, max) in [
            ("repo_size_mb", self.repo_size_mb, MAX_SIZE_MB),
            ("data_size_mb", self.data_size_mb, MAX_SIZE_MB),
            ("workspace_mb", self.workspace_mb, MAX_SIZE_MB),
            (
                "expected_duration_s",
                self.expected_duration_s,
                MAX_DURATION_S,
            ),
        ] {
            let Some(v) = value else { continue };
            if !v.is_finite() {
                return bad(format!("{name} must be a finite number, got {v}"));
            }
            if v < 0.0 {
                return bad(format!("{name} must not be negative, got {v}"));
            }
            if v > max {
                return bad(format!("{name} is {v}, at most {max} allowed"));
            }
        }
        if let Some(n) = &self.network {
            if n.is_empty()
                || n.len() > 64
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
            {
                return bad(format!(
                    "network {n:?} is not a profile name (1-64 of a-z 0-9 - _ .)"
                ));
            }
        }
        if let Some(id) = &self.task_id {
            if id.is_empty() || id.len() > 256 || id.chars().any(char::is_control) {
                return bad("task_id must be 1-256 printable characters".into());
            }
        }
        Ok(())
    }
}

/// SHA-256 (hex) of the canonical JSON of the context: fields in declaration
/// order, absent/empty fields omitted, `task_id` excluded (it names the task,
/// it is not input to the decision). Equal contexts hash equal.
pub fn planner_input_hash(ctx: &TaskContext) -> String {
    let mut canonical = ctx.clone();
    canonical.task_id = None;
    // Serializing a plain struct with String/f64/bool/Vec fields cannot fail.
    let bytes = serde_json::to_vec(&canonical).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_context_parses() {
        let ctx = TaskContext::from_json(r#"{"task":"hello"}"#).unwrap();
        assert_eq!(ctx, TaskContext::new("hello"));
    }

    #[test]
    fn unknown_field_is_rejected() {
        let err = TaskContext::from_json(r#"{"task":"x","cpus":64}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `cpus`"), "{err}");
    }

    #[test]
    fn wrong_type_is_rejected() {
        let err = TaskContext::from_json(r#"{"task":"x","needs_gpu":"yes"}"#).unwrap_err();
        assert!(err.is_bad_input(), "{err}");
        let err = TaskContext::from_json(r#"{"task":"x","risk":"extreme"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown variant"), "{err}");
    }

    #[test]
    fn missing_task_is_rejected() {
        let err = TaskContext::from_json(r#"{"plan":["a"]}"#).unwrap_err();
        assert!(err.to_string().contains("missing field `task`"), "{err}");
    }

    #[test]
    fn absurd_numbers_are_rejected() {
        type Mutate = fn(&mut TaskContext);
        let cases: [(Mutate, &str); 5] = [
            (|c| c.data_size_mb = Some(-1.0), "must not be negative"),
            (|c| c.repo_size_mb = Some(f64::NAN), "finite"),
            (|c| c.workspace_mb = Some(f64::INFINITY), "finite"),
            (|c| c.data_size_mb = Some(1e300), "at most"),
            (|c| c.expected_duration_s = Some(1e9), "at most"),
        ];
        for (mutate, needle) in cases {
            let mut ctx = TaskContext::new("x");
            mutate(&mut ctx);
            let err = ctx.validate().unwrap_err();
            assert!(err.to_string().contains(needle), "{err} lacks {needle}");
        }
    }

    #[test]
    fn oversized_text_and_lists_are_rejected() {
        let err = TaskContext::new("a".repeat(MAX_TASK_BYTES + 1))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("task is 65537 bytes"), "{err}");

        let mut ctx = TaskContext::new("x");
        ctx.plan = vec!["s".into(); MAX_LIST_ITEMS + 1];
        let err = ctx.validate().unwrap_err();
        assert!(err.to_string().contains("plan has 1001 items"), "{err}");

        let mut ctx = TaskContext::new("x");
        ctx.tools = vec!["t".repeat(MAX_ITEM_BYTES + 1)];
        let err = ctx.validate().unwrap_err();
        assert!(err.to_string().contains("tools[0]"), "{err}");

        let mut ctx = TaskContext::new("x");
        ctx.dependencies = vec!["d".repeat(4000); 100];
        let err = ctx.validate().unwrap_err();
        assert!(err.to_string().contains("together"), "{err}");
    }

    #[test]
    fn blank_task_and_bad_names_are_rejected() {
        TaskContext::new("  \n").validate().unwrap_err();
        let mut ctx = TaskContext::new("x");
        ctx.network = Some("Open Internet".into());
        ctx.validate().unwrap_err();
        let mut ctx = TaskContext::new("x");
        ctx.task_id = Some("a\nb".into());
        ctx.validate().unwrap_err();
    }

    #[test]
    fn input_hash_is_stable_and_ignores_task_id() {
        let a = TaskContext::from_json(r#"{"task":"t","tools":["x"],"task_id":"1"}"#).unwrap();
        let b = TaskContext::from_json(r#"{"tools":["x"],"task":"t","task_id":"2"}"#).unwrap();
        assert_eq!(planner_input_hash(&a), planner_input_hash(&b));
        assert_eq!(planner_input_hash(&a).len(), 64);
        let c = TaskContext::from_json(r#"{"task":"t","tools":["y"]}"#).unwrap();
        assert_ne!(planner_input_hash(&a), planner_input_hash(&c));
    }
}
