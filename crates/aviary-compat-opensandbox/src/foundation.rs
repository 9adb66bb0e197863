//! The control-plane features this surface needs from the compat
//! foundation (labels, default exec environment, TTL changes, per-sandbox
//! access tokens), in one place so the rest of the crate calls them the
//! same way before and after the foundation lands.
//!
//! STAND-IN until `compat-foundation` is merged: labels are not stored
//! (filters match nothing but an empty filter), TTL changes are refused,
//! and the access token is a keyed hash under a per-process secret (one
//! replica only). Each function names the foundation call that replaces it.

use aviary_control::{Caller, ControlPlane, OpContext, OpError};
use aviary_core::api::{CreateSandboxRequest, Sandbox};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// Labels and default environment onto a create request
/// (foundation: `CreateSandboxRequest::{metadata, env}`).
pub fn with_labels(
    req: CreateSandboxRequest,
    _metadata: BTreeMap<String, String>,
    _env: BTreeMap<String, String>,
) -> CreateSandboxRequest {
    req
}

/// A sandbox's labels (foundation: `Sandbox::metadata`).
pub fn labels(_sandbox: &Sandbox) -> BTreeMap<String, String> {
    BTreeMap::new()
}

/// Whether a sandbox carries every pair of `filter` (foundation:
/// `SandboxQuery::metadata`, applied by the list operation).
pub fn matches_labels(sandbox: &Sandbox, filter: &BTreeMap<String, String>) -> bool {
    let have = labels(sandbox);
    filter.iter().all(|(k, v)| have.get(k) == Some(v))
}

/// `expires_at = now + ttl_s` (foundation: `ControlPlane::set_ttl`).
pub async fn set_ttl(
    _cp: &ControlPlane,
    _cx: &OpContext,
    _sandbox: &str,
    _ttl_s: Option<u64>,
) -> Result<Sandbox, OpError> {
    Err(OpError::Unavailable(
        "changing a sandbox's lifetime needs the compat foundation".into(),
    ))
}

fn secret() -> &'static [u8; 32] {
    static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
    SECRET.get_or_init(rand::random)
}

fn token_of(sandbox: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(secret());
    h.update(sandbox.as_bytes());
    hex::encode(h.finalize())
}

/// The sandbox's execd token, for its tenant only (foundation:
/// `ControlPlane::sandbox_access_token`).
pub async fn access_token(
    cp: &ControlPlane,
    cx: &OpContext,
    sandbox: &str,
) -> Result<String, OpError> {
    cp.get(cx, aviary_control::requests::SandboxRef::new(sandbox))
        .await?;
    Ok(token_of(sandbox))
}

/// The context of a caller presenting a sandbox's token (foundation:
/// `ControlPlane::authenticate_sandbox_token`).
pub async fn authenticate_token(
    cp: &ControlPlane,
    sandbox: &str,
    token: &str,
) -> Result<OpContext, OpError> {
    let id: aviary_core::SandboxId = sandbox
        .parse()
        .map_err(|_| OpError::NotFound(format!("sandbox {sandbox}")))?;
    let rec = cp
        .registry
        .get_sandbox(&id)
        .await
        .map_err(|_| OpError::NotFound(format!("sandbox {sandbox}")))?;
    let want = token_of(sandbox);
    let same = want.len() == token.len()
        && want
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if !same {
        return Err(OpError::Unauthorized);
    }
    Ok(OpContext::new(Caller {
        tenant: rec.tenant,
        admin: false,
    }))
}
