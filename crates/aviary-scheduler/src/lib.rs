//! Where a sandbox runs: Aviary's scheduler.
//!
//! This crate owns the *placement* decision and nothing else. Its input is a
//! [`PlacementRequest`] (a resource class already chosen by the planner and
//! approved by the policy guard, its limits, a template digest and a runtime)
//! and a snapshot of the nodes ([`NodeView`]); its output is a
//! [`PlacementDecision`] naming one node, its [`PlacementScore`] and, for
//! every node, why it was scored or rejected. *What* a sandbox needs is
//! decided elsewhere (the planner); this crate never picks or changes a class.
//!
//! Placement is two steps:
//! 1. **Filters** reject a node that is unhealthy, not seen for longer than
//!    [`SchedulerConfig::stale_after`], lacks the runtime, lacks the template
//!    (unless [`SchedulerConfig::ship_templates`] says templates can be
//!    shipped to it), or whose committed limits plus the request would exceed
//!    its capacity times the over-commit ratio ([`Rejection`]).
//! 2. **Best-of-K**: K feasible nodes are sampled uniformly (the
//!    "power of K choices": near-best balance without scoring hot spots the
//!    same way on every replica) and the best [`PlacementScore`] wins. The
//!    score prefers, in this order of weight, a node holding a warm sandbox for
//!    the request's (class, template, runtime), then the least loaded node
//!    after placement (committed and used CPU and memory), then template
//!    locality. Ties go to the smaller node id, so a seeded scheduler is
//!    deterministic.
//!
//! Invariants: a chosen node always passes every filter (never placed where
//! it does not fit); with K ≥ the number of feasible nodes the chosen node
//! has the maximal score.
//!
//! Concurrency and I/O: none. The caller passes the current time and the node
//! views; [`Scheduler`] keeps only its random generator behind a mutex, so it
//! can be shared between tasks. The caller is responsible for committing the
//! placed limits to its node records ([`NodeView::commit`] does it on a view).
#![forbid(unsafe_code)]

use aviary_core::ResourceLimits;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;
use time::OffsetDateTime;

/// Warm sandboxes are counted per (class, template, runtime), like pools.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WarmKey {
    pub class: String,
    /// Template digest (`sha256:<hex>`).
    pub template: String,
    pub runtime: String,
}

impl WarmKey {
    pub fn new(
        class: impl Into<String>,
        template: impl Into<String>,
        runtime: impl Into<String>,
    ) -> Self {
        WarmKey {
            class: class.into(),
            template: template.into(),
            runtime: runtime.into(),
        }
    }
}

/// The scheduler's view of one node: capacity, what is committed (sum of the
/// limits of the sandboxes placed there), what is really used (measured), and
/// what it holds (runtimes, templates, warm sandboxes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub id: String,
    /// Where the node agent listens (`host:port`), or `local`.
    pub address: String,
    pub runtimes: Vec<String>,
    /// Digests (`sha256:<hex>`) of the templates present on the node.
    pub templates: Vec<String>,
    pub cpu_capacity: f64,
    pub memory_capacity_mb: u64,
    pub cpu_committed: f64,
    pub memory_committed_mb: u64,
    pub cpu_used: f64,
    pub memory_used_mb: u64,
    /// Warm (pooled, unclaimed) sandboxes on this node.
    #[serde(with = "warm_entries")]
    pub warm: HashMap<WarmKey, u32>,
    pub healthy: bool,
    #[serde(with = "time::serde::rfc3339")]
    pub last_seen: OffsetDateTime,
}

impl NodeView {
    /// Adds a placed sandbox's limits to the committed totals.
    pub fn commit(&mut self, limits: &ResourceLimits) {
        self.cpu_committed += limits.cpu;
        self.memory_committed_mb = self.memory_committed_mb.saturating_add(limits.memory_mb);
    }

    /// Removes a departed sandbox's limits from the committed totals.
    pub fn release(&mut self, limits: &ResourceLimits) {
        self.cpu_committed = (self.cpu_committed - limits.cpu).max(0.0);
        self.memory_committed_mb = self.memory_committed_mb.saturating_sub(limits.memory_mb);
    }

    fn warm_for(&self, req: &PlacementRequest) -> u32 {
        // Look up without allocating a key per node: the map is tiny.
        self.warm
            .iter()
            .find(|(k, _)| {
                k.class == req.class
                    && k.template == req.template_digest
                    && k.runtime == req.runtime
            })
            .map_or(0, |(_, n)| *n)
    }
}

/// Serializes the warm map as a list of `{class, template, runtime, count}`
/// (JSON object keys must be strings).
mod warm_entries {
    use super::WarmKey;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::HashMap;

    #[derive(Serialize, Deserialize)]
    struct Entry {
        class: String,
        template: String,
        runtime: String,
        count: u32,
    }

    pub fn serialize<S: Serializer>(m: &HashMap<WarmKey, u32>, s: S) -> Result<S::Ok, S::Error> {
        let mut v: Vec<Entry> = m
            .iter()
            .map(|(k, n)| Entry {
                class: k.class.clone(),
                template: k.template.clone(),
                runtime: k.runtime.clone(),
                count: *n,
            })
            .collect();
        v.sort_by(|a, b| {
            (&a.class, &a.template, &a.runtime).cmp(&(&b.class, &b.template, &b.runtime))
        });
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<HashMap<WarmKey, u32>, D::Error> {
        let v = Vec::<Entry>::deserialize(d)?;
        Ok(v.into_iter()
            .map(|e| (WarmKey::new(e.class, e.template, e.runtime), e.count))
            .collect())
    }
}

/// What to place: a class the policy guard approved, and its limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementRequest {
    pub class: String,
    pub limits: ResourceLimits,
    /// Template digest (`sha256:<hex>`).
    pub template_digest: String,
    pub runtime: String,
}

/// Tunables of the scheduler.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// A node's committed CPU may reach `cpu_capacity * cpu_overcommit`.
    /// Limits are cgroup ceilings, not reservations, so CPU over-commit is
    /// safe (contention slows sandboxes down, it does not kill them).
    pub cpu_overcommit: f64,
    /// A node's committed memory may reach `memory_capacity_mb *
    /// memory_overcommit`. Over-committed memory turns into OOM kills under
    /// pressure, so the default is lower than for CPU.
    pub memory_overcommit: f64,
    /// How many feasible nodes best-of-K samples (at least 1).
    pub sample_k: usize,
    /// A node not seen for longer is treated as down.
    pub stale_after: Duration,
    /// When true, a node without the template is feasible (the control plane
    /// ships the template); when false, it is rejected.
    pub ship_templates: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            cpu_overcommit: 4.0,
            memory_overcommit: 1.5,
            sample_k: 2,
            stale_after: Duration::from_secs(30),
            ship_templates: false,
        }
    }
}

/// Why a node was filtered out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Rejection {
    Unhealthy,
    Stale {
        seconds_since_seen: i64,
    },
    RuntimeMissing {
        runtime: String,
    },
    TemplateMissing {
        template: String,
    },
    CpuFull {
        committed: f64,
        requested: f64,
        limit: f64,
    },
    MemoryFull {
        committed_mb: u64,
        requested_mb: u64,
        limit_mb: u64,
    },
}

impl Rejection {
    /// The node is up and able, only full: waiting (or freeing capacity)
    /// helps, unlike a missing runtime or an unhealthy node.
    pub fn is_capacity(&self) -> bool {
        matches!(
            self,
            Rejection::CpuFull { .. } | Rejection::MemoryFull { .. }
        )
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Unhealthy => f.write_str("node is unhealthy"),
            Rejection::Stale { seconds_since_seen } => {
                write!(f, "node not seen for {seconds_since_seen} s")
            }
            Rejection::RuntimeMissing { runtime } => write!(f, "runtime {runtime} not available"),
            Rejection::TemplateMissing { template } => {
                write!(f, "template {template} not present and shipping is off")
            }
            Rejection::CpuFull {
                committed,
                requested,
                limit,
            } => write!(
                f,
                "cpu: {committed} committed + {requested} requested exceeds {limit}"
            ),
            Rejection::MemoryFull {
                committed_mb,
                requested_mb,
                limit_mb,
            } => write!(
                f,
                "memory: {committed_mb} MiB committed + {requested_mb} MiB requested exceeds {limit_mb} MiB"
            ),
        }
    }
}

/// How good a feasible node is for a request; higher `total` is better.
/// Fractions are after placement: committed ones relative to the
/// over-committed limit, used ones relative to real capacity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementScore {
    pub total: f64,
    pub cpu_committed_frac: f64,
    pub memory_committed_frac: f64,
    pub cpu_used_frac: f64,
    pub memory_used_frac: f64,
    /// Warm sandboxes for this (class, template, runtime) on the node.
    pub warm: u32,
    pub template_local: bool,
}

/// Bonus for a warm sandbox on the node: larger than the whole load range,
/// so a warm hit always wins over a cold, emptier node.
pub const WARM_BONUS: f64 = 200.0;
/// Bonus for the template being present: a tie-breaker between similarly
/// loaded nodes (shipping a template costs seconds).
pub const TEMPLATE_BONUS: f64 = 20.0;
/// Weight of the load term (0 = full, 1 = empty), scaled to this.
pub const LOAD_WEIGHT: f64 = 100.0;

/// What happened to one node in a placement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum CandidateOutcome {
    /// Feasible and sampled.
    Scored {
        score: PlacementScore,
    },
    /// Feasible, but not among the K sampled.
    NotSampled,
    Rejected {
        rejection: Rejection,
    },
}

/// One node's line in a [`PlacementDecision`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub node: String,
    #[serde(flatten)]
    pub outcome: CandidateOutcome,
}

/// The scheduler's answer; the control plane records it as an event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementDecision {
    pub node_id: String,
    pub score: PlacementScore,
    /// Every node given, in input order.
    pub candidates: Vec<Candidate>,
}

/// Placement failures.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("invalid placement request: {reason}")]
    InvalidRequest { reason: String },
    /// Every node was rejected (or there were none); the reasons are kept.
    #[error("no node can take the sandbox ({} considered)", candidates.len())]
    NoFeasibleNode { candidates: Vec<Candidate> },
}

impl ScheduleError {
    /// Some node was rejected only for lack of capacity under its
    /// over-commit limit: the request could fit later.
    pub fn is_capacity(&self) -> bool {
        match self {
            ScheduleError::InvalidRequest { .. } => false,
            ScheduleError::NoFeasibleNode { candidates } => candidates.iter().any(|c| {
                matches!(&c.outcome, CandidateOutcome::Rejected { rejection } if rejection.is_capacity())
            }),
        }
    }
}

/// The placement engine. Cheap to share (`&self` methods).
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    rng: Mutex<StdRng>,
}

impl Scheduler {
    /// A scheduler sampling with a random seed.
    pub fn new(config: SchedulerConfig) -> Self {
        Self::with_rng(config, StdRng::from_entropy())
    }

    /// A deterministic scheduler (tests, replays).
    pub fn with_seed(config: SchedulerConfig, seed: u64) -> Self {
        Self::with_rng(config, StdRng::seed_from_u64(seed))
    }

    fn with_rng(config: SchedulerConfig, rng: StdRng) -> Self {
        Scheduler {
            config,
            rng: Mutex::new(rng),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Why `node` cannot take `req` at `now`, or `None` when it can.
    pub fn filter(
        &self,
        node: &NodeView,
        req: &PlacementRequest,
        now: OffsetDateTime,
    ) -> Option<Rejection> {
        let cfg = &self.config;
        if !node.healthy {
            return Some(Rejection::Unhealthy);
        }
        let age = now - node.last_seen;
        if age > cfg.stale_after {
            return Some(Rejection::Stale {
                seconds_since_seen: age.whole_seconds(),
            });
        }
        if !node.runtimes.contains(&req.runtime) {
            return Some(Rejection::RuntimeMissing {
                runtime: req.runtime.clone(),
            });
        }
        if !cfg.ship_templates && !node.templates.contains(&req.template_digest) {
            return Some(Rejection::TemplateMissing {
                template: req.template_digest.clone(),
            });
        }
        let cpu_limit = node.cpu_capacity * cfg.cpu_overcommit;
        if node.cpu_committed + req.limits.cpu > cpu_limit + 1e-9 {
            return Some(Rejection::CpuFull {
                committed: node.cpu_committed,
                requested: req.limits.cpu,
                limit: cpu_limit,
            });
        }
        let mem_limit = memory_limit_mb(node.memory_capacity_mb, cfg.memory_overcommit);
        if node
            .memory_committed_mb
            .saturating_add(req.limits.memory_mb)
            > mem_limit
        {
            return Some(Rejection::MemoryFull {
                committed_mb: node.memory_committed_mb,
                requested_mb: req.limits.memory_mb,
                limit_mb: mem_limit,
            });
        }
        None
    }

    /// The score of placing `req` on a feasible `node`.
    pub fn score(&self, node: &NodeView, req: &PlacementRequest) -> PlacementScore {
        let cfg = &self.config;
        let frac = |num: f64, den: f64| {
            if den > 0.0 {
                (num / den).clamp(0.0, 1.0)
            } else {
                1.0
            }
        };
        let cpu_committed_frac = frac(
            node.cpu_committed + req.limits.cpu,
            node.cpu_capacity * cfg.cpu_overcommit,
        );
        let memory_committed_frac = frac(
            (node.memory_committed_mb + req.limits.memory_mb) as f64,
            memory_limit_mb(node.memory_capacity_mb, cfg.memory_overcommit) as f64,
        );
        let cpu_used_frac = frac(node.cpu_used, node.cpu_capacity);
        let memory_used_frac = frac(node.memory_used_mb as f64, node.memory_capacity_mb as f64);
        // Committed limits say what may come; usage says what is there now.
        // The more loaded dimension dominates (a node full on memory is full
        // however idle its CPUs are), averaged with the mean so that both count.
        let dims = [
            cpu_committed_frac,
            memory_committed_frac,
            cpu_used_frac,
            memory_used_frac,
        ];
        let max = dims.iter().copied().fold(0.0, f64::max);
        let mean = dims.iter().sum::<f64>() / dims.len() as f64;
        let load = 0.5 * max + 0.5 * mean;
        let warm = node.warm_for(req);
        let template_local = node.templates.contains(&req.template_digest);
        let total = LOAD_WEIGHT * (1.0 - load)
            + if warm > 0 { WARM_BONUS } else { 0.0 }
            + if template_local { TEMPLATE_BONUS } else { 0.0 };
        PlacementScore {
            total,
            cpu_committed_frac,
            memory_committed_frac,
            cpu_used_frac,
            memory_used_frac,
            warm,
            template_local,
        }
    }

    /// Filters `nodes`, samples K feasible ones and picks the best score.
    pub fn place(
        &self,
        nodes: &[NodeView],
        req: &PlacementRequest,
        now: OffsetDateTime,
    ) -> Result<PlacementDecision, ScheduleError> {
        validate_request(req)?;
        let mut candidates = Vec::with_capacity(nodes.len());
        let mut feasible = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let outcome = match self.filter(node, req, now) {
                Some(rejection) => CandidateOutcome::Rejected { rejection },
                None => {
                    feasible.push(i);
                    CandidateOutcome::NotSampled
                }
            };
            candidates.push(Candidate {
                node: node.id.clone(),
                outcome,
            });
        }
        if feasible.is_empty() {
            return Err(ScheduleError::NoFeasibleNode { candidates });
        }
        let k = self.config.sample_k.max(1);
        let sampled: Vec<usize> = if k >= feasible.len() {
            feasible
        } else {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            rand::seq::index::sample(&mut *rng, feasible.len(), k)
                .into_iter()
                .map(|j| feasible[j])
                .collect()
        };
        let mut best: Option<(usize, PlacementScore)> = None;
        for i in sampled {
            let score = self.score(&nodes[i], req);
            candidates[i].outcome = CandidateOutcome::Scored {
                score: score.clone(),
            };
            let better = match &best {
                None => true,
                Some((b, bs)) => {
                    score.total > bs.total
                        || (score.total == bs.total && nodes[i].id < nodes[*b].id)
                }
            };
            if better {
                best = Some((i, score));
            }
        }
        let (i, score) = best.expect("at least one node was sampled");
        Ok(PlacementDecision {
            node_id: nodes[i].id.clone(),
            score,
            candidates,
        })
    }
}

fn memory_limit_mb(capacity_mb: u64, ratio: f64) -> u64 {
    // Saturating float → int conversion; the ratio is validated positive.
    (capacity_mb as f64 * ratio).floor() as u64
}

fn validate_request(req: &PlacementRequest) -> Result<(), ScheduleError> {
    let invalid = |reason: String| Err(ScheduleError::InvalidRequest { reason });
    if !(req.limits.cpu.is_finite() && req.limits.cpu > 0.0) {
        return invalid(format!("cpu {} must be positive", req.limits.cpu));
    }
    if req.limits.memory_mb == 0 {
        return invalid("memory_mb must be positive".into());
    }
    if req.runtime.is_empty() || req.template_digest.is_empty() || req.class.is_empty() {
        return invalid("class, template digest and runtime are required".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
