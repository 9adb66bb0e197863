//! The planner's output ([`ResourceIntent`]) and the class catalog it maps
//! onto ([`ClassSpec`]).

use crate::PlanError;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;

/// Which planner decided an intent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PlanSource {
    Llm,
    Telemetry,
    Heuristic,
}

impl PlanSource {
    pub fn as_str(self) -> &'static str {
        match self {
            PlanSource::Llm => "llm",
            PlanSource::Telemetry => "telemetry",
            PlanSource::Heuristic => "heuristic",
        }
    }
}

impl fmt::Display for PlanSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A recommendation: one class of the catalog plus the details the policy
/// guard and the pool need. `cpu`, `memory_mb` and `disk_mb` are the class's
/// limits (a class is the unit of allocation), never free-form numbers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourceIntent {
    pub resource_class: String,
    pub cpu: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub runtime: String,
    pub template: String,
    pub network_profile: String,
    pub ttl_s: u64,
    /// The work needs a GPU; when no class of the catalog has one the intent
    /// still says so, and the policy guard denies ("GPU not available").
    pub needs_gpu: bool,
    /// 0..=1, how sure the planner is.
    pub confidence: f64,
    /// Human-readable: the signals found and why this class.
    pub reason: String,
    pub source: PlanSource,
}

/// One resource class as the planner sees it (the config crate converts its
/// `[[class]]` entries into these).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClassSpec {
    pub name: String,
    pub cpu: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u32,
    #[serde(default)]
    pub gpu: bool,
    /// Allowed runtimes, preferred first.
    #[serde(default)]
    pub runtimes: Vec<String>,
    /// Allowed network profiles.
    #[serde(default)]
    pub network_profiles: Vec<String>,
}

/// A capability a class provides beyond raw size. The catalog has no
/// capability field, so it is read from the class name: `browser`,
/// `chrom` or `playwright` → browser; `build` or `compile` → build. A class
/// that has a capability is kept for work that needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) enum Capability {
    Browser,
    Build,
}

impl ClassSpec {
    fn new(name: &str, cpu: f64, memory_gib: u64, disk_gib: u64, pids: u32, nets: &[&str]) -> Self {
        ClassSpec {
            name: name.into(),
            cpu,
            memory_mb: memory_gib * 1024,
            disk_mb: disk_gib * 1024,
            pids,
            gpu: false,
            runtimes: aviary_core::RuntimeName::LOCAL
                .iter()
                .filter(|r| !r.is_remote())
                .map(|r| r.as_str().into())
                .collect(),
            network_profiles: nets.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The seed's five classes (seed 002 §4.4/§4.5).
    pub fn seed_defaults() -> Vec<ClassSpec> {
        vec![
            ClassSpec::new("python-small", 1.0, 2, 10, 256, &["none", "pypi-readonly"]),
            ClassSpec::new("python-ds", 2.0, 4, 20, 512, &["none", "pypi-readonly"]),
            ClassSpec::new(
                "build-medium",
                4.0,
                8,
                30,
                2048,
                &["none", "pypi-readonly", "open"],
            ),
            ClassSpec::new("browser-medium", 4.0, 8, 30, 1024, &["none", "open"]),
            ClassSpec::new(
                "compute-large",
                8.0,
                16,
                50,
                4096,
                &["none", "pypi-readonly", "open"],
            ),
        ]
    }

    pub(crate) fn capability(&self) -> Option<Capability> {
        let n = self.name.to_ascii_lowercase();
        if n.contains("browser") || n.contains("chrom") || n.contains("playwright") {
            Some(Capability::Browser)
        } else if n.contains("build") || n.contains("compile") {
            Some(Capability::Build)
        } else {
            None
        }
    }

    /// Capacity as one comparable number (memory dominates, cpu breaks ties).
    pub(crate) fn size_key(&self) -> f64 {
        self.memory_mb as f64 + self.cpu * 0.001
    }

    /// At least as big as `other` in cpu and memory, and bigger in one.
    pub(crate) fn strictly_bigger_than(&self, other: &ClassSpec) -> bool {
        self.cpu >= other.cpu
            && self.memory_mb >= other.memory_mb
            && (self.cpu > other.cpu || self.memory_mb > other.memory_mb)
    }
}

/// Rejects a catalog the planner cannot map onto: empty, duplicate or
/// malformed names, non-positive or non-finite sizes.
pub fn validate_catalog(catalog: &[ClassSpec]) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::RejectCatalog(m));
    if catalog.is_empty() {
        return bad("no resource classes".into());
    }
    let mut seen = HashSet::new();
    for c in catalog {
        if c.name.is_empty()
            || c.name.len() > 64
            || c.name
                .chars()
                .any(|ch| ch.is_whitespace() || ch.is_control())
        {
            return bad(format!(
                "class name {:?} must be 1-64 non-space characters",
                c.name
            ));
        }
        if !seen.insert(c.name.as_str()) {
            return bad(format!("class {:?} appears twice", c.name));
        }
        if !c.cpu.is_finite() || c.cpu <= 0.0 || c.cpu > 4096.0 {
            return bad(format!(
                "class {:?}: cpu must be in (0, 4096], got {}",
                c.name, c.cpu
            ));
        }
        if c.memory_mb == 0 || c.disk_mb == 0 {
            return bad(format!(
                "class {:?}: memory_mb and disk_mb must be > 0",
                c.name
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_defaults_match_the_seed() {
        let c = ClassSpec::seed_defaults();
        let got: Vec<_> = c
            .iter()
            .map(|c| (c.name.as_str(), c.cpu, c.memory_mb, c.disk_mb))
            .collect();
        assert_eq!(
            got,
            vec![
                ("python-small", 1.0, 2048, 10240),
                ("python-ds", 2.0, 4096, 20480),
                ("build-medium", 4.0, 8192, 30720),
                ("browser-medium", 4.0, 8192, 30720),
                ("compute-large", 8.0, 16384, 51200),
            ]
        );
        validate_catalog(&c).unwrap();
        assert_eq!(c[3].capability(), Some(Capability::Browser));
        assert_eq!(c[2].capability(), Some(Capability::Build));
        assert_eq!(c[4].capability(), None);
    }

    #[test]
    fn bad_catalogs_are_rejected() {
        validate_catalog(&[]).unwrap_err();
        let mut c = ClassSpec::seed_defaults();
        c[1].name = "python-small".into();
        assert!(validate_catalog(&c)
            .unwrap_err()
            .to_string()
            .contains("twice"));
        let mut c = ClassSpec::seed_defaults();
        c[0].cpu = f64::NAN;
        validate_catalog(&c).unwrap_err();
        let mut c = ClassSpec::seed_defaults();
        c[0].memory_mb = 0;
        validate_catalog(&c).unwrap_err();
    }

    #[test]
    fn intent_round_trips_and_rejects_unknown_fields() {
        let i = ResourceIntent {
            resource_class: "python-small".into(),
            cpu: 1.0,
            memory_mb: 2048,
            disk_mb: 10240,
            runtime: "crun".into(),
            template: "default".into(),
            network_profile: "none".into(),
            ttl_s: 900,
            needs_gpu: false,
            confidence: 0.9,
            reason: "r".into(),
            source: PlanSource::Heuristic,
        };
        let json = serde_json::to_string(&i).unwrap();
        assert!(json.contains(r#""source":"heuristic""#), "{json}");
        assert_eq!(serde_json::from_str::<ResourceIntent>(&json).unwrap(), i);
        let bad = json.replace(r#""ttl_s""#, r#""extra":1,"ttl_s""#);
        serde_json::from_str::<ResourceIntent>(&bad).unwrap_err();
    }
}
