//! Aviary's reuse layer (DESIGN §1 principle 5, §3 "Reuse checker", §5).
//!
//! This crate owns the pure logic that decides whether a live sandbox may serve
//! a new request, and the one-way projection of host files into a sandbox:
//!
//! - [`version`]: package and runtime version requirements (`pandas==1.5`,
//!   `numpy<1.24`, `python 3.9`) and a simplified PEP 440 / semver ordering.
//! - [`manifest`]: the [`EnvironmentManifest`] of a sandbox (runtimes, package
//!   sets with their hashes, capabilities, dirty paths and level), the probe
//!   commands that gather it inside a sandbox and the parser of their output.
//! - [`scope`]: isolation scopes mapped to lease bucket keys.
//! - [`checker`]: the [`ReuseChecker`], which turns a request and a candidate
//!   sandbox into a [`ReuseDecision`] (`reuse | new_venv | fork_clean_snapshot |
//!   new_sandbox`) with a score and reasons.
//! - [`projection`]: the [`ProjectionPlanner`] (host roots vs the sandbox's last
//!   synced index, per-file SHA-256) and [`apply`] over a [`ProjectionTarget`].
//!
//! Invariants: a candidate of another tenant, or of another user when either
//! side is user- or session-scoped, is never reused; a tainted, unhealthy or
//! policy-violating sandbox is never reused; projection never reads a file that
//! resolves outside its configured root and never writes a sandbox path with
//! `..` in it.
//!
//! Concurrency: everything but [`apply`] is synchronous and free of shared
//! state; the checker and planner are plain values that are `Send + Sync`.
#![forbid(unsafe_code)]

pub mod checker;
pub mod manifest;
pub mod projection;
pub mod scope;
pub mod version;

pub use checker::{
    CleanSnapshot, EnvironmentRequirements, ReuseAction, ReuseCandidate, ReuseChecker,
    ReuseDecision, ReusePolicy, ReuseRequest,
};
pub use manifest::{
    probe_script, ActiveVenv, DirtyLevel, EnvironmentManifest, PackageSet, ProbeCommand, ProbeKey,
    ProbeOutput, ProbeOutputs, PROBE_COMMANDS,
};
pub use projection::{
    apply, ApplyReport, LocalDirTarget, ProjectionError, ProjectionPlan, ProjectionPlanner,
    ProjectionRoot, ProjectionTarget, RemoteIndex, TargetError, Upload,
};
pub use scope::{effective_scope, scope_bucket, ScopeError};
pub use version::{compare_versions, Ecosystem, PackageRequirement, VersionError, VersionReq};
