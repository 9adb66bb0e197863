//! The control-plane calls this surface needs beyond the v1 operations
//! (sandbox labels and default environment, TTL changes, per-sandbox
//! access tokens), in one place so the rest of the crate names them once.

use aviary_control::requests::{SandboxQuery, SetTtlRequest};
use aviary_control::{ControlPlane, OpContext, OpError};
use aviary_core::api::{CreateSandboxRequest, Sandbox};
use std::collections::BTreeMap;

/// The access token the SDK sends as `X-Access-Token` to envd: only the
/// sandbox's tenant can obtain it.
pub async fn access_token(
    cp: &ControlPlane,
    cx: &OpContext,
    sandbox: &str,
) -> Result<String, OpError> {
    cp.sandbox_access_token(cx, sandbox).await
}

/// The context of an envd call presenting `token` for `sandbox`
/// (`not_found` for an unknown or ended sandbox, `unauthorized` for a
/// wrong token).
pub async fn authenticate_token(
    cp: &ControlPlane,
    sandbox: &str,
    token: &str,
) -> Result<OpContext, OpError> {
    cp.authenticate_sandbox_token(sandbox, token).await
}

/// `expires_at = now + ttl_s` (fenced: a leased sandbox refuses it).
pub async fn set_ttl(
    cp: &ControlPlane,
    cx: &OpContext,
    sandbox: &str,
    ttl_s: u64,
) -> Result<Sandbox, OpError> {
    cp.set_ttl(
        cx,
        SetTtlRequest {
            id: sandbox.to_owned(),
            ttl_s,
        },
    )
    .await
}

/// A sandbox's metadata.
pub fn metadata(s: &Sandbox) -> BTreeMap<String, String> {
    s.metadata.clone()
}

/// Sets a create's metadata and default exec environment.
pub fn set_labels(
    req: &mut CreateSandboxRequest,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
) {
    req.metadata = metadata;
    req.env = env;
}

/// The query of the caller's sandboxes whose metadata holds every pair.
pub fn query(metadata: &BTreeMap<String, String>) -> SandboxQuery {
    SandboxQuery {
        metadata: metadata.clone(),
        ..Default::default()
    }
}
