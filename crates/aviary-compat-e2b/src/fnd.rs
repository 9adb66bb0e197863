//! The control-plane calls this surface needs beyond the v1 operations
//! (sandbox labels and default environment, TTL changes, per-sandbox
//! access tokens), in one place so the rest of the crate names them once.

use aviary_control::requests::SandboxQuery;
use aviary_control::{ControlPlane, OpContext, OpError};
use aviary_core::api::{CreateSandboxRequest, Sandbox};
use std::collections::BTreeMap;

fn pending() -> OpError {
    OpError::Unavailable("this server lacks the compat foundation".into())
}

/// The access token the SDK sends as `X-Access-Token` to envd: only the
/// sandbox's tenant can obtain it.
pub async fn access_token(
    _cp: &ControlPlane,
    _cx: &OpContext,
    _sandbox: &str,
) -> Result<String, OpError> {
    Err(pending())
}

/// The context of an envd call presenting `token` for `sandbox`.
pub async fn authenticate_token(
    _cp: &ControlPlane,
    _sandbox: &str,
    _token: &str,
) -> Result<OpContext, OpError> {
    Err(pending())
}

/// `expires_at = now + ttl_s` (`None`: no expiry).
pub async fn set_ttl(
    _cp: &ControlPlane,
    _cx: &OpContext,
    _sandbox: &str,
    _ttl_s: Option<u64>,
) -> Result<Sandbox, OpError> {
    Err(pending())
}

/// A sandbox's metadata.
pub fn metadata(_s: &Sandbox) -> BTreeMap<String, String> {
    BTreeMap::new()
}

/// Sets a create's metadata and default exec environment.
pub fn set_labels(
    _req: &mut CreateSandboxRequest,
    _metadata: BTreeMap<String, String>,
    _env: BTreeMap<String, String>,
) {
}

/// The query of the caller's sandboxes whose metadata holds every pair.
pub fn query(_metadata: &BTreeMap<String, String>) -> SandboxQuery {
    SandboxQuery::default()
}
