//! Telemetry right-sizing: moves a base intent up or down one class from the
//! measured usage of earlier runs with the same workload signature.
//!
//! Only `sandbox_allocation` rows with the same signature and with measured
//! usage count, newest first, at most `window` of them, and only rows whose
//! `actual_class` is still in the catalog. Rules (defaults in
//! [`TelemetryRules::default`]):
//! - **Up.** Rows that ran in the base class or a bigger one are relevant. If
//!   any of the last `recent` relevant rows, or at least `failure_rate` of
//!   all relevant rows, ended in an OOM kill or a timeout, the intent moves
//!   to the class one step above the *largest class that failed* (so a class
//!   that already failed is never recommended again while the failure is in
//!   the window). "One step above" is the smallest strictly bigger class of the
//!   same GPU-ness that has the capability the work needs or no capability.
//!   Timeouts also raise the TTL to 1.5× the p95 duration.
//! - **Down.** Needs at least `min_samples_down` rows that ran in the base
//!   class or a smaller one, none of them failed, and p95 peak memory below
//!   `down_memory_ratio` of the next lower class's memory *and* p95 peak CPU
//!   below `down_cpu_ratio` of its CPU. The next lower class is the biggest
//!   strictly smaller class with the same GPU-ness and the capability the work
//!   needs (a browser job never drops into a class without a browser).
//!   Counting runs in smaller classes keeps the decision stable after a move
//!   down.
//! - Otherwise nothing changes; the note says why.

use crate::features::{Features, WorkloadKind};
use crate::heuristic::human_mb;
use crate::intent::{Capability, ClassSpec, PlanSource, ResourceIntent};
use aviary_registry::AllocationRecord;

/// Thresholds of the right-sizing rules; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct TelemetryRules {
    /// Most history rows considered (newest first).
    pub window: usize,
    /// A failure among this many newest relevant rows moves up.
    pub recent: usize,
    /// A failure share of the relevant rows at least this large moves up.
    pub failure_rate: f64,
    /// Fewest successful rows needed before moving down.
    pub min_samples_down: usize,
    /// Move down only when p95 peak memory < this × the lower class's memory.
    pub down_memory_ratio: f64,
    /// … and p95 peak CPU < this × the lower class's CPU.
    pub down_cpu_ratio: f64,
}

impl Default for TelemetryRules {
    fn default() -> Self {
        TelemetryRules {
            window: 20,
            recent: 5,
            failure_rate: 0.2,
            min_samples_down: 5,
            down_memory_ratio: 0.4,
            down_cpu_ratio: 0.6,
        }
    }
}

/// The result of a telemetry pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Adjustment {
    pub intent: ResourceIntent,
    pub changed: bool,
    /// What telemetry saw and decided, for the reason and the trace.
    pub note: String,
    /// History rows of this signature that were considered.
    pub samples: usize,
}

/// Right-sizing from history; stateless apart from its rules.
#[derive(Clone, Debug, Default)]
pub struct TelemetryPlanner {
    rules: TelemetryRules,
}

struct Row<'a> {
    class: &'a ClassSpec,
    peak_cpu: f64,
    peak_memory_mb: f64,
    duration_s: f64,
    oom: bool,
    timed_out: bool,
}

impl TelemetryPlanner {
    pub fn new(rules: TelemetryRules) -> Self {
        TelemetryPlanner { rules }
    }

    pub fn rules(&self) -> &TelemetryRules {
        &self.rules
    }

    /// Adjusts `base` (planned for `features`) from `history` rows of the
    /// same signature. Never fails: without usable history the intent comes
    /// back unchanged.
    pub fn adjust(
        &self,
        base: ResourceIntent,
        features: &Features,
        catalog: &[ClassSpec],
        history: &[AllocationRecord],
    ) -> Adjustment {
        let signature = features.signature();
        let unchanged = |intent: ResourceIntent, note: String, samples: usize| Adjustment {
            intent,
            changed: false,
            note,
            samples,
        };
        let Some(base_class) = catalog.iter().find(|c| c.name == base.resource_class) else {
            return unchanged(base, "telemetry: base class not in the catalog".into(), 0);
        };

        let mut matching: Vec<&AllocationRecord> = history
            .iter()
            .filter(|r| r.workload_signature == signature && r.usage.is_some())
            .collect();
        matching.sort_by_key(|r| std::cmp::Reverse(r.created_at));
        let rows: Vec<Row<'_>> = matching
            .into_iter()
            .filter_map(|r| {
                let u = r.usage.as_ref()?;
                let class = catalog.iter().find(|c| c.name == r.actual_class)?;
                Some(Row {
                    class,
                    peak_cpu: finite(u.peak_cpu),
                    peak_memory_mb: u.peak_memory_mb as f64,
                    duration_s: finite(u.duration_s),
                    oom: u.oom,
                    timed_out: u.timed_out,
                })
            })
            .take(self.rules.window)
            .collect();
        let n = rows.len();
        if n == 0 {
            return unchanged(
                base,
                format!("telemetry: no measured runs of {signature}"),
                0,
            );
        }

        let need = match features.kind {
            WorkloadKind::Browser => Some(Capability::Browser),
            WorkloadKind::Build => Some(Capability::Build),
            _ => None,
        };

        // --- up ---
        let relevant: Vec<&Row<'_>> = rows
            .iter()
            .filter(|r| r.class.size_key() >= base_class.size_key())
            .collect();
        let failed: Vec<&Row<'_>> = relevant
            .iter()
            .copied()
            .filter(|r| r.oom || r.timed_out)
            .collect();
        let recent_fail = relevant
            .iter()
            .take(self.rules.recent)
            .any(|r| r.oom || r.timed_out);
        let rate = if relevant.is_empty() {
            0.0
        } else {
            failed.len() as f64 / relevant.len() as f64
        };
        if !failed.is_empty() && (recent_fail || rate >= self.rules.failure_rate) {
            let ooms = failed.iter().filter(|r| r.oom).count();
            let timeouts = failed.iter().filter(|r| r.timed_out).count();
            let top = failed
                .iter()
                .map(|r| r.class)
                .max_by(|a, b| a.size_key().total_cmp(&b.size_key()))
                .unwrap_or(base_class);
            let peak = failed.iter().map(|r| r.peak_memory_mb).fold(0.0, f64::max);
            let what = format!(
                "telemetry: {} of {} runs of {signature} in {} or larger failed ({ooms} OOM, {timeouts} timeout; peak {})",
                failed.len(),
                relevant.len(),
                base_class.name,
                human_mb(peak)
            );
            let mut intent = base;
            let mut changed = false;
            if timeouts > 0 {
                let p95_dur = p95(rows.iter().map(|r| r.duration_s).collect());
                let ttl = ((p95_dur * 1.5).ceil()).min(86400.0) as u64;
                if ttl > intent.ttl_s {
                    intent.ttl_s = ttl;
                    changed = true;
                }
            }
            let note = match step_up(top, base_class, need, catalog) {
                Some(up) => {
                    let from = intent.resource_class.clone();
                    set_class(&mut intent, up);
                    changed = true;
                    format!("{what} → up from {from} to {}", up.name)
                }
                None => format!("{what}; {} is already the largest suitable class", top.name),
            };
            if changed {
                intent.source = PlanSource::Telemetry;
                intent.confidence = evidence_confidence(intent.confidence, relevant.len());
            }
            return Adjustment {
                intent,
                changed,
                note,
                samples: n,
            };
        }

        // --- down ---
        let at_or_below: Vec<&Row<'_>> = rows
            .iter()
            .filter(|r| r.class.size_key() <= base_class.size_key())
            .collect();
        if at_or_below.iter().any(|r| r.oom || r.timed_out) {
            return unchanged(
                base,
                format!(
                    "telemetry: {n} runs of {signature}; failures at or below {} block sizing down",
                    base_class.name
                ),
                n,
            );
        }
        if at_or_below.len() < self.rules.min_samples_down {
            return unchanged(
                base,
                format!(
                    "telemetry: {} successful runs of {signature}, need ≥ {} to size down; no change",
                    at_or_below.len(),
                    self.rules.min_samples_down
                ),
                n,
            );
        }
        let p95_mem = p95(at_or_below.iter().map(|r| r.peak_memory_mb).collect());
        let p95_cpu = p95(at_or_below.iter().map(|r| r.peak_cpu).collect());
        let seen = format!(
            "telemetry: {} runs of {signature}, p95 peak {} memory, {:.2} cpu",
            at_or_below.len(),
            human_mb(p95_mem),
            p95_cpu
        );
        let Some(lower) = step_down(base_class, need, catalog) else {
            return unchanged(
                base,
                format!("{seen}; no smaller suitable class than {}", base_class.name),
                n,
            );
        };
        let mem_limit = self.rules.down_memory_ratio * lower.memory_mb as f64;
        let cpu_limit = self.rules.down_cpu_ratio * lower.cpu;
        if p95_mem < mem_limit && p95_cpu < cpu_limit {
            let mut intent = base;
            let from = intent.resource_class.clone();
            set_class(&mut intent, lower);
            intent.source = PlanSource::Telemetry;
            intent.confidence = evidence_confidence(intent.confidence, at_or_below.len());
            return Adjustment {
                intent,
                changed: true,
                note: format!(
                    "{seen} (< {:.0}% of {}'s {} and < {:.0}% of its {} cpu) → down from {from} to {}",
                    self.rules.down_memory_ratio * 100.0,
                    lower.name,
                    human_mb(lower.memory_mb as f64),
                    self.rules.down_cpu_ratio * 100.0,
                    fmt_num(lower.cpu),
                    lower.name
                ),
                samples: n,
            };
        }
        unchanged(
            base,
            format!("{seen}; {} is right-sized", base_class.name),
            n,
        )
    }
}

fn fmt_num(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x}")
    }
}

fn finite(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

/// Nearest-rank p95 of the values (0 for none).
fn p95(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((0.95 * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn evidence_confidence(old: f64, samples: usize) -> f64 {
    let c = (0.6 + 0.04 * samples as f64).min(0.95);
    ((old.max(c)) * 100.0).round() / 100.0
}

fn suits(c: &ClassSpec, base: &ClassSpec, need: Option<Capability>) -> bool {
    c.gpu == base.gpu && (c.capability().is_none() || c.capability() == need)
}

/// The smallest class strictly bigger than `from` that suits the work,
/// preferring one with the needed capability.
fn step_up<'a>(
    from: &ClassSpec,
    base: &ClassSpec,
    need: Option<Capability>,
    catalog: &'a [ClassSpec],
) -> Option<&'a ClassSpec> {
    catalog
        .iter()
        .filter(|c| c.strictly_bigger_than(from) && suits(c, base, need))
        .min_by(|a, b| {
            let pa = need.is_some() && a.capability() == need;
            let pb = need.is_some() && b.capability() == need;
            pb.cmp(&pa).then(a.size_key().total_cmp(&b.size_key()))
        })
}

/// The biggest class strictly smaller than `base` with the same GPU-ness and
/// exactly the needed capability (none for plain work).
fn step_down<'a>(
    base: &ClassSpec,
    need: Option<Capability>,
    catalog: &'a [ClassSpec],
) -> Option<&'a ClassSpec> {
    catalog
        .iter()
        .filter(|c| base.strictly_bigger_than(c) && c.gpu == base.gpu && c.capability() == need)
        .max_by(|a, b| a.size_key().total_cmp(&b.size_key()))
}

fn set_class(intent: &mut ResourceIntent, c: &ClassSpec) {
    intent.resource_class = c.name.clone();
    intent.cpu = c.cpu;
    intent.memory_mb = c.memory_mb;
    intent.disk_mb = c.disk_mb;
    if !c.runtimes.is_empty() && !c.runtimes.contains(&intent.runtime) {
        intent.runtime = c.runtimes[0].clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::TaskContext;
    use crate::heuristic::HeuristicPlanner;
    use aviary_registry::AllocationUsage;
    use time::{Duration, OffsetDateTime};

    struct Case {
        ctx: TaskContext,
        features: Features,
        base: ResourceIntent,
        catalog: Vec<ClassSpec>,
    }

    fn case(task: &str) -> Case {
        let ctx = TaskContext::new(task);
        let catalog = ClassSpec::seed_defaults();
        let base = HeuristicPlanner::default()
            .plan_sync(&ctx, &catalog)
            .unwrap();
        Case {
            features: Features::extract(&ctx),
            ctx,
            base,
            catalog,
        }
    }

    fn row(
        sig: &str,
        class: &str,
        age_min: i64,
        mem: u64,
        cpu: f64,
        oom: bool,
        timed_out: bool,
    ) -> AllocationRecord {
        AllocationRecord {
            id: Some(age_min),
            task_id: format!("t{age_min}"),
            tenant: "default".into(),
            sandbox_id: None,
            planner_input_hash: "h".into(),
            workload_signature: sig.into(),
            recommended_class: class.into(),
            actual_class: class.into(),
            reason: "r".into(),
            confidence: 0.8,
            source: "heuristic".into(),
            cpu: 1.0,
            memory_mb: 2048,
            created_at: OffsetDateTime::UNIX_EPOCH + Duration::days(1000)
                - Duration::minutes(age_min),
            usage: Some(AllocationUsage {
                duration_s: 60.0,
                peak_cpu: cpu,
                peak_memory_mb: mem,
                oom,
                timed_out,
            }),
        }
    }

    fn adjust(c: &Case, history: &[AllocationRecord]) -> Adjustment {
        TelemetryPlanner::default().adjust(c.base.clone(), &c.features, &c.catalog, history)
    }

    #[test]
    fn oom_moves_up_one_class() {
        let c = case("统计 Excel 销售数据");
        assert_eq!(c.base.resource_class, "python-small");
        let sig = c.features.signature();
        let mut history: Vec<_> = (1..=6)
            .map(|i| row(&sig, "python-small", i, 900, 0.5, false, false))
            .collect();
        history.push(row(&sig, "python-small", 0, 2048, 1.0, true, false));
        let a = adjust(&c, &history);
        assert!(a.changed, "{}", a.note);
        assert_eq!(a.intent.resource_class, "python-ds");
        assert_eq!((a.intent.cpu, a.intent.memory_mb), (2.0, 4096));
        assert_eq!(a.intent.source, PlanSource::Telemetry);
        assert!(
            a.note.contains("1 OOM") && a.note.contains("up from python-small to python-ds"),
            "{}",
            a.note
        );
        let _ = &c.ctx;
    }

    #[test]
    fn failure_in_the_bigger_class_moves_above_it() {
        let c = case("统计 Excel 销售数据");
        let sig = c.features.signature();
        let history = vec![
            row(&sig, "python-ds", 1, 4096, 2.0, true, false),
            row(&sig, "python-small", 2, 2048, 1.0, true, false),
        ];
        let a = adjust(&c, &history);
        assert_eq!(a.intent.resource_class, "compute-large", "{}", a.note);
    }

    #[test]
    fn timeouts_raise_class_and_ttl() {
        let c = case("print hello world");
        let sig = c.features.signature();
        let mut history = vec![row(&sig, "python-small", 1, 100, 1.0, false, true)];
        history[0].usage.as_mut().unwrap().duration_s = 3000.0;
        let a = adjust(&c, &history);
        assert_eq!(a.intent.resource_class, "python-ds");
        assert_eq!(a.intent.ttl_s, 4500);
    }

    #[test]
    fn low_p95_moves_down() {
        let c = case("pandas over a 1 GB csv file");
        assert_eq!(c.base.resource_class, "python-ds");
        let sig = c.features.signature();
        let history: Vec<_> = (0..8)
            .map(|i| row(&sig, "python-ds", i, 300 + i as u64 * 50, 0.3, false, false))
            .collect();
        let a = adjust(&c, &history);
        assert!(a.changed, "{}", a.note);
        assert_eq!(a.intent.resource_class, "python-small");
        assert!(
            a.note.contains("down from python-ds to python-small"),
            "{}",
            a.note
        );
    }

    #[test]
    fn high_p95_stays() {
        let c = case("pandas over a 1 GB csv file");
        let sig = c.features.signature();
        let history: Vec<_> = (0..8)
            .map(|i| row(&sig, "python-ds", i, 1500, 0.8, false, false))
            .collect();
        let a = adjust(&c, &history);
        assert!(!a.changed, "{}", a.note);
        assert!(a.note.contains("right-sized"), "{}", a.note);
    }

    #[test]
    fn too_few_samples_change_nothing() {
        let c = case("pandas over a 1 GB csv file");
        let sig = c.features.signature();
        let history: Vec<_> = (0..4)
            .map(|i| row(&sig, "python-ds", i, 100, 0.1, false, false))
            .collect();
        let a = adjust(&c, &history);
        assert!(!a.changed);
        assert_eq!(a.intent, c.base);
        assert!(a.note.contains("need ≥ 5"), "{}", a.note);
    }

    #[test]
    fn other_signatures_and_unmeasured_rows_are_ignored() {
        let c = case("统计 Excel 销售数据");
        let mut unmeasured = row(
            &c.features.signature(),
            "python-small",
            1,
            0,
            0.0,
            true,
            false,
        );
        unmeasured.usage = None;
        let history = vec![
            row("ws-other", "python-small", 2, 2048, 1.0, true, false),
            unmeasured,
        ];
        let a = adjust(&c, &history);
        assert!(!a.changed);
        assert_eq!(a.samples, 0);
    }

    #[test]
    fn browser_work_never_drops_into_a_class_without_browser() {
        let c = case("open the page with playwright and take a screenshot");
        assert_eq!(c.base.resource_class, "browser-medium");
        let sig = c.features.signature();
        let history: Vec<_> = (0..10)
            .map(|i| row(&sig, "browser-medium", i, 200, 0.2, false, false))
            .collect();
        let a = adjust(&c, &history);
        assert!(!a.changed);
        assert!(a.note.contains("no smaller suitable class"), "{}", a.note);
    }

    #[test]
    fn old_failures_outside_recent_and_below_rate_are_forgiven() {
        let c = case("统计 Excel 销售数据");
        let sig = c.features.signature();
        let mut history: Vec<_> = (0..9)
            .map(|i| row(&sig, "python-small", i, 900, 0.5, false, false))
            .collect();
        history.push(row(&sig, "python-small", 100, 2048, 1.0, true, false));
        // 1 failure in 10 (10% < 20%) and not among the newest 5 → no move up
        let a = adjust(&c, &history);
        assert_eq!(a.intent.resource_class, "python-small", "{}", a.note);
    }

    #[test]
    fn p95_is_nearest_rank() {
        assert_eq!(p95(vec![]), 0.0);
        assert_eq!(p95(vec![3.0]), 3.0);
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(p95(v), 19.0);
    }
}
