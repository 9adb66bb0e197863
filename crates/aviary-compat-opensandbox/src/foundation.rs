//! The control-plane features this surface takes from the compat
//! foundation (labels, default exec environment, TTL changes, per-sandbox
//! access tokens), in one place: the handlers call these, never the
//! foundation's names directly.

use aviary_control::{ControlPlane, OpContext, OpError};
use aviary_core::api::{CreateSandboxRequest, Sandbox};
use std::collections::BTreeMap;

/// Labels and default environment onto a create request.
pub fn with_labels(
    mut req: CreateSandboxRequest,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
) -> CreateSandboxRequest {
    req.metadata = metadata;
    req.env = env;
    req
}

/// A sandbox's labels.
pub fn labels(sandbox: &Sandbox) -> BTreeMap<String, String> {
    sandbox.metadata.clone()
}

/// Whether a sandbox carries every pair of `filter`.
pub fn matches_labels(sandbox: &Sandbox, filter: &BTreeMap<String, String>) -> bool {
    filter
        .iter()
        .all(|(k, v)| sandbox.metadata.get(k) == Some(v))
}

/// `expires_at = now + ttl_s` (fenced, audited; may shorten).
pub async fn set_ttl(
    cp: &ControlPlane,
    cx: &OpContext,
    sandbox: &str,
    ttl_s: u64,
) -> Result<Sandbox, OpError> {
    let req = aviary_control::requests::SetTtlRequest {
        id: sandbox.to_owned(),
        ttl_s,
    };
    cp.set_ttl(cx, req).await
}

/// The sandbox's execd token, for its tenant only.
pub async fn access_token(
    cp: &ControlPlane,
    cx: &OpContext,
    sandbox: &str,
) -> Result<String, OpError> {
    cp.sandbox_access_token(cx, sandbox).await
}

/// The context of a caller presenting a sandbox's token.
pub async fn authenticate_token(
    cp: &ControlPlane,
    sandbox: &str,
    token: &str,
) -> Result<OpContext, OpError> {
    cp.authenticate_sandbox_token(sandbox, token).await
}
