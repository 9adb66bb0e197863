//! The deterministic planner: features → requirement → class.
//!
//! From the [`Features`] it derives a *requirement* (cpu, memory, disk) per
//! workload kind — e.g. a dataframe job needs about 2.5× its data in memory, a
//! JVM build 6 GiB, a browser 3 GiB — and then scores every class of the
//! catalog:
//! - +1000 when the class fits the requirement (cpu, memory and disk);
//! - +2000 for a GPU class when a GPU is needed, −400 for a GPU class when not;
//! - +500 when the class has the capability the kind needs (browser, build),
//!   −300 when it has a capability the work does not need (a data job does
//!   not get the Playwright class just because it is big enough);
//! - among fitting classes the smallest wins; when nothing fits, the largest.
//!
//! Confidence grows with the strength of the winning kind's signals and drops
//! when another kind is almost as strong or when no class fits.

use crate::context::TaskContext;
use crate::features::{Features, Reader, WorkloadKind};
use crate::intent::{validate_catalog, Capability, ClassSpec, PlanSource, ResourceIntent};
use crate::{PlanError, Planner};
use aviary_registry::AllocationRecord;
use std::collections::BTreeMap;

/// Values the planner cannot read from the catalog.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerDefaults {
    /// Template for every class without an entry in `class_templates`.
    pub template: String,
    /// Class name → template (e.g. `browser-medium` → `node-playwright`).
    pub class_templates: BTreeMap<String, String>,
    /// Runtime when a class lists none.
    pub runtime: String,
}

impl Default for PlannerDefaults {
    fn default() -> Self {
        PlannerDefaults {
            template: "default".into(),
            class_templates: BTreeMap::new(),
            runtime: aviary_core::RuntimeName::default().as_str().into(),
        }
    }
}

/// What the work needs, before it is mapped to a class.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Requirement {
    pub cpu: f64,
    pub memory_mb: f64,
    pub disk_mb: f64,
}

/// Keyword/size heuristics; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct HeuristicPlanner {
    defaults: PlannerDefaults,
}

impl HeuristicPlanner {
    pub fn new(defaults: PlannerDefaults) -> Self {
        HeuristicPlanner { defaults }
    }

    pub fn defaults(&self) -> &PlannerDefaults {
        &self.defaults
    }

    /// The synchronous core of [`Planner::plan`]: validates, extracts
    /// features and maps them to a class.
    pub fn plan_sync(
        &self,
        ctx: &TaskContext,
        catalog: &[ClassSpec],
    ) -> Result<ResourceIntent, PlanError> {
        ctx.validate()?;
        validate_catalog(catalog)?;
        let f = Features::extract(ctx);
        Ok(self.plan_features(ctx, &f, catalog))
    }

    /// Maps already-extracted features; the catalog must be valid (non-empty).
    pub(crate) fn plan_features(
        &self,
        ctx: &TaskContext,
        f: &Features,
        catalog: &[ClassSpec],
    ) -> ResourceIntent {
        let req = requirement(f);
        let (class, fits) = choose_class(f, &req, catalog);
        let gpu_missing = f.needs_gpu && !catalog.iter().any(|c| c.gpu);

        let strength = f.kind_strength();
        let mut confidence = if strength > 0.0 {
            0.55 + 0.4 * (1.0 - (-strength / 4.0).exp())
        } else {
            // no signal at all: the smallest class is the safe guess
            0.5
        };
        let runner_up = f.runner_up_strength();
        if strength > 0.0 && runner_up >= 0.7 * strength {
            confidence -= 0.1;
        }
        if !fits {
            confidence -= 0.1;
        }
        let confidence = round2(confidence.clamp(0.3, 0.97));

        let mut reason = format!("heuristic: {} workload", f.kind);
        if f.signals.is_empty() {
            reason.push_str(" (no resource signals found)");
        } else {
            let ids: Vec<&str> = f.signals.iter().take(8).map(|s| s.id.as_str()).collect();
            reason.push_str(&format!(" ({})", ids.join(", ")));
        }
        if f.data_mb > 0.0 {
            reason.push_str(&format!("; data ≈ {}", human_mb(f.data_mb)));
            if f.kind == WorkloadKind::Data {
                reason.push_str(&format!(", {}", f.reader.describe()));
            }
            if f.remote_data {
                reason.push_str(", stays remote (no local disk)");
            }
        }
        if let Some(m) = f.media {
            reason.push_str(&format!(
                "; media ≈ {:.0} s × {} ≈ {:.0} s of 1080p work",
                m.seconds,
                m.factor,
                m.units()
            ));
        }
        if f.test_files > 0.0 {
            reason.push_str(&format!("; {} test files", f.test_files));
        }
        if f.repo_mb > 0.0 {
            reason.push_str(&format!("; repo ≈ {}", human_mb(f.repo_mb)));
        }
        if f.memory_hint_mb > 0.0 {
            reason.push_str(&format!("; asks for {} memory", human_mb(f.memory_hint_mb)));
        }
        reason.push_str(&format!(
            "; needs ≥ {} cpu, {} memory, {} disk",
            fmt_cpu(req.cpu),
            human_mb(req.memory_mb),
            human_mb(req.disk_mb)
        ));
        reason.push_str(&format!(
            " → {} ({} cpu, {}, {} disk)",
            class.name,
            fmt_cpu(class.cpu),
            human_mb(class.memory_mb as f64),
            human_mb(class.disk_mb as f64)
        ));
        if !fits {
            reason.push_str("; no class fits, chose the largest suitable one");
        }
        if gpu_missing {
            reason.push_str("; GPU needed but no class of the catalog has one");
        }
        for note in &f.notes {
            reason.push_str("; ");
            reason.push_str(note);
        }

        let runtime = class
            .runtimes
            .first()
            .cloned()
            .unwrap_or_else(|| self.defaults.runtime.clone());
        let template = self
            .defaults
            .class_templates
            .get(&class.name)
            .cloned()
            .unwrap_or_else(|| self.defaults.template.clone());

        ResourceIntent {
            resource_class: class.name.clone(),
            cpu: class.cpu,
            memory_mb: class.memory_mb,
            disk_mb: class.disk_mb,
            runtime,
            template,
            network_profile: network_profile(ctx, f),
            ttl_s: ttl_for(f),
            needs_gpu: f.needs_gpu,
            confidence,
            reason,
            source: PlanSource::Heuristic,
        }
    }
}

#[async_trait::async_trait]
impl Planner for HeuristicPlanner {
    async fn plan(
        &self,
        ctx: &TaskContext,
        catalog: &[ClassSpec],
        _history: &[AllocationRecord],
    ) -> Result<ResourceIntent, PlanError> {
        self.plan_sync(ctx, catalog)
    }
}

/// The requirement of the work, per kind; see the module docs.
pub(crate) fn requirement(f: &Features) -> Requirement {
    let mut cpu: f64;
    let mut mem: f64;
    let mut disk: f64;
    match f.kind {
        WorkloadKind::Script => {
            cpu = 0.5;
            mem = 512.0;
            disk = 2048.0;
        }
        WorkloadKind::Data => {
            let mut vol = f.data_mb;
            if vol <= 0.0 && f.big_data > 0.0 {
                // "large dataset" without a number: assume around a gigabyte
                vol = 1024.0;
            }
            // pandas holds ~2.5× the file in memory, Arrow-based readers
            // ~1.5×, openpyxl many times the compressed file; out-of-core
            // engines spill, and streaming readers hold a chunk at a time.
            let streaming = matches!(f.reader, Reader::Streaming { .. });
            mem = match f.reader {
                Reader::InMemory => 1024.0 + vol * 2.5,
                Reader::Arrow => 1024.0 + vol * 1.5,
                Reader::Excel => 1024.0 + vol * 5.0,
                Reader::Distributed => 1024.0 + vol,
                Reader::Streaming { .. } => 1024.0 + (vol * 0.02).min(1024.0),
            };
            cpu = 1.0;
            if streaming {
                // threaded engines over gigabytes use a few cores; awk and
                // chunked loops use one, however big the data
                if matches!(f.reader, Reader::Streaming { threaded: true }) && vol >= 1024.0 {
                    cpu = 2.0;
                }
            } else {
                if vol >= 500.0 {
                    cpu = 2.0;
                }
                if vol >= 4096.0 {
                    cpu = 4.0;
                }
                if vol >= 16384.0 {
                    cpu = 8.0;
                }
            }
            if f.ml > 0.0 {
                cpu = cpu.max(2.0);
                mem = mem.max(3072.0);
            }
            if f.distributed > 0.0 {
                cpu = cpu.max(4.0);
                mem = mem.max(8192.0);
            }
            if f.duration_s >= 1800.0 {
                cpu = cpu.max(2.0);
            }
            disk = if f.remote_data {
                2048.0
            } else {
                2048.0 + vol * 1.2
            };
        }
        WorkloadKind::Compute => match f.media {
            // transcoding cost follows duration × resolution
            Some(m) if m.units() <= 150.0 => {
                cpu = 1.0;
                mem = 1024.0;
                disk = 2048.0 + f.data_mb * 2.0;
            }
            Some(m) if m.units() <= 2400.0 => {
                cpu = 2.0;
                mem = 2048.0;
                disk = 4096.0 + f.data_mb * 2.0;
            }
            _ => {
                cpu = if f.parallel >= 2.0 || f.media.is_some() {
                    8.0
                } else {
                    4.0
                };
                mem = (2048.0 + f.data_mb * 1.5).max(4096.0);
                disk = 4096.0 + f.data_mb * 2.0;
            }
        },
        WorkloadKind::Build => {
            cpu = 2.0;
            mem = 3072.0;
            if f.jvm > 0.0 {
                cpu = 4.0;
                mem = 6144.0;
            }
            mem = mem.max(2048.0 + f.repo_mb * 1.5);
            if f.repo_mb >= 2048.0 || f.monorepo >= 4.0 {
                // a large repository or a multi-tool monorepo: the seed's
                // "大仓库/重计算" class
                cpu = 8.0;
                mem = mem.max(12288.0);
            }
            disk = 4096.0 + f.repo_mb * 3.0;
        }
        WorkloadKind::Browser => {
            cpu = 2.0;
            mem = 3072.0;
            if f.build_score >= 2.0 {
                mem = 4096.0;
            }
            disk = 6144.0 + f.repo_mb * 3.0;
        }
        WorkloadKind::Gpu => {
            cpu = 4.0;
            mem = (8192.0 + f.data_mb * 1.5).max(12288.0);
            disk = 20480.0 + f.data_mb * 1.2;
        }
    }
    if f.test_files >= 200.0 {
        // hundreds of test files: the runner's workers want cores and memory
        cpu = cpu.max(2.0);
        mem = mem.max(3072.0);
    }
    mem = mem.max(f.memory_hint_mb);
    let local_data = if f.remote_data { 0.0 } else { f.data_mb };
    disk = disk.max(1024.0 + f.workspace_mb + f.repo_mb * 1.5 + local_data * 1.2);
    Requirement {
        cpu,
        memory_mb: mem,
        disk_mb: disk,
    }
}

fn needed_capability(kind: WorkloadKind) -> Option<Capability> {
    match kind {
        WorkloadKind::Browser => Some(Capability::Browser),
        WorkloadKind::Build => Some(Capability::Build),
        _ => None,
    }
}

/// Picks the best class for the requirement; returns it and whether it fits.
pub(crate) fn choose_class<'a>(
    f: &Features,
    req: &Requirement,
    catalog: &'a [ClassSpec],
) -> (&'a ClassSpec, bool) {
    let max_mem = catalog
        .iter()
        .map(|c| c.memory_mb)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let max_cpu = catalog.iter().map(|c| c.cpu).fold(0.0, f64::max).max(1e-9);
    let need = needed_capability(f.kind);
    let mut best: Option<(f64, &ClassSpec, bool)> = None;
    for c in catalog {
        let fits = c.cpu >= req.cpu
            && c.memory_mb as f64 >= req.memory_mb
            && c.disk_mb as f64 >= req.disk_mb;
        let mut score = 0.0;
        if fits {
            score += 1000.0;
        }
        if f.needs_gpu && c.gpu {
            score += 2000.0;
        } else if !f.needs_gpu && c.gpu {
            score -= 400.0;
        }
        match (need, c.capability()) {
            (Some(n), Some(h)) if n == h => score += 500.0,
            (_, Some(_)) => score -= 300.0,
            _ => {}
        }
        let size = c.memory_mb as f64 / max_mem + c.cpu / max_cpu;
        if fits {
            score -= size * 10.0;
        } else {
            score += size * 10.0;
        }
        let better = match &best {
            None => true,
            Some((s, _, _)) => score > *s,
        };
        if better {
            best = Some((score, c, fits));
        }
    }
    match best {
        Some((_, c, fits)) => (c, fits),
        // unreachable for a validated catalog; stay total anyway
        None => (&catalog[0], false),
    }
}

fn network_profile(ctx: &TaskContext, f: &Features) -> String {
    if let Some(n) = &ctx.network {
        return n.clone();
    }
    let browses = matches!(f.kind, WorkloadKind::Browser)
        && f.signals
            .iter()
            .any(|s| s.id == "web-page" || s.id == "url");
    if f.fetch_open || browses || matches!(f.kind, WorkloadKind::Build if f.jvm > 0.0) {
        "open".into()
    } else if f.fetch_pypi || !ctx.dependencies.is_empty() {
        "pypi-readonly".into()
    } else {
        "none".into()
    }
}

fn ttl_for(f: &Features) -> u64 {
    let base: f64 = match f.kind {
        WorkloadKind::Script => 900.0,
        WorkloadKind::Data => 1800.0,
        WorkloadKind::Build | WorkloadKind::Browser => 2400.0,
        WorkloadKind::Compute | WorkloadKind::Gpu => 3600.0,
    };
    base.max((f.duration_s * 1.5).ceil()).min(86400.0) as u64
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn fmt_cpu(c: f64) -> String {
    if c.fract() == 0.0 {
        format!("{c:.0}")
    } else {
        format!("{c:.1}")
    }
}

pub(crate) fn human_mb(mb: f64) -> String {
    if mb >= 1024.0 * 1024.0 {
        format!("{:.1} TiB", mb / (1024.0 * 1024.0))
    } else if mb >= 1024.0 {
        format!("{:.1} GiB", mb / 1024.0)
    } else if mb >= 1.0 {
        format!("{mb:.0} MiB")
    } else {
        "<1 MiB".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(ctx: TaskContext) -> ResourceIntent {
        HeuristicPlanner::default()
            .plan_sync(&ctx, &ClassSpec::seed_defaults())
            .unwrap()
    }

    #[test]
    fn hello_world_is_small_and_offline() {
        let i = plan(TaskContext::new("print hello world in python"));
        assert_eq!(i.resource_class, "python-small");
        assert_eq!(i.network_profile, "none");
        assert_eq!(i.source, PlanSource::Heuristic);
        assert_eq!((i.cpu, i.memory_mb), (1.0, 2048));
        assert!(i.reason.contains("hello-world"), "{}", i.reason);
    }

    #[test]
    fn gpu_without_gpu_class_says_so() {
        let i = plan(TaskContext::new("fine-tune a llama model with LoRA"));
        assert!(i.needs_gpu);
        assert_eq!(i.resource_class, "compute-large");
        assert!(
            i.reason.contains("no class of the catalog has one"),
            "{}",
            i.reason
        );
    }

    #[test]
    fn gpu_class_is_chosen_when_present() {
        let mut catalog = ClassSpec::seed_defaults();
        let mut g = catalog[4].clone();
        g.name = "gpu-a10".into();
        g.gpu = true;
        catalog.push(g);
        let i = HeuristicPlanner::default()
            .plan_sync(
                &TaskContext::new("train a resnet with pytorch on cuda"),
                &catalog,
            )
            .unwrap();
        assert_eq!(i.resource_class, "gpu-a10");
        // and a non-GPU job never gets it
        let i = HeuristicPlanner::default()
            .plan_sync(&TaskContext::new("pandas over a 20 GB csv"), &catalog)
            .unwrap();
        assert_eq!(i.resource_class, "compute-large");
    }

    #[test]
    fn explicit_network_and_templates_are_used() {
        let mut ctx = TaskContext::new("run playwright against the staging site");
        ctx.network = Some("none".into());
        let mut d = PlannerDefaults::default();
        d.class_templates
            .insert("browser-medium".into(), "node-playwright".into());
        let i = HeuristicPlanner::new(d)
            .plan_sync(&ctx, &ClassSpec::seed_defaults())
            .unwrap();
        assert_eq!(i.resource_class, "browser-medium");
        assert_eq!(i.template, "node-playwright");
        assert_eq!(i.network_profile, "none");
    }

    #[test]
    fn long_expected_duration_extends_ttl() {
        let mut ctx = TaskContext::new("print hello");
        ctx.expected_duration_s = Some(7200.0);
        assert_eq!(plan(ctx).ttl_s, 10800);
    }

    #[test]
    fn single_class_catalog_always_answers_it() {
        let catalog = vec![ClassSpec::seed_defaults().remove(0)];
        let i = HeuristicPlanner::default()
            .plan_sync(&TaskContext::new("pandas over a 200 GB parquet"), &catalog)
            .unwrap();
        assert_eq!(i.resource_class, "python-small");
        assert!(i.reason.contains("no class fits"), "{}", i.reason);
    }
}
