//! Aviary's shared vocabulary.
//!
//! This crate owns the types every other crate agrees on: identifiers
//! ([`SandboxId`], [`LeaseToken`]), the sandbox lifecycle state machine
//! ([`SandboxState`]), resource limits, isolation scopes, the names of the known
//! runtimes ([`RuntimeName`]), the JSON shapes of the
//! v1 API ([`api`]) and the stable error codes ([`ErrorCode`]). It has no I/O and
//! no async; it must stay cheap to depend on.
#![forbid(unsafe_code)]

pub mod api;
pub mod egress;
mod error_code;
mod ids;
pub mod paths;
mod resources;
mod runtime_name;
mod state;

pub use error_code::{ErrorBody, ErrorCode, ErrorDetail};
pub use ids::{new_id, IdError, LeaseToken, LeaseTokenError, SandboxId, LEASE_SECRET_LEN};
pub use resources::{NetworkProfile, ResourceLimits, Scope};
pub use runtime_name::RuntimeName;
pub use state::{SandboxState, StateError};

/// Current wall-clock time as UTC.
pub fn now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}
