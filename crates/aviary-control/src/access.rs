//! Per-sandbox access tokens: the credential of the surfaces that run
//! *inside* one sandbox on behalf of whoever created it (E2B's envd
//! `X-Access-Token`, OpenSandbox's execd header), where the SDKs send no API
//! key.
//!
//! A token is HMAC-SHA256 over the tenant and the sandbox id, keyed by a
//! server secret kept in the registry (written once, by the first replica
//! that needs it), so every replica computes and checks the same token with
//! no per-sandbox row. Only the sandbox's tenant is ever shown a token; a
//! token opens exactly one sandbox, acts as its tenant without admin rights,
//! and dies with the sandbox (an ended sandbox is `not_found`). Tokens are
//! compared in constant time.

use crate::context::{Caller, OpContext};
use crate::error::OpError;
use crate::ControlPlane;
use aviary_core::{SandboxId, SandboxState};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// The registry name of the access-token key.
const KEY_NAME: &str = "sandbox-access-token-v1";
/// Domain separation: this key signs nothing else.
const CONTEXT: &[u8] = b"aviary sandbox access token v1\0";

impl ControlPlane {
    pub(crate) async fn access_key(&self) -> Result<&[u8], OpError> {
        let key = self
            .access_key
            .get_or_try_init(|| async {
                let mut candidate = [0u8; 32];
                rand::thread_rng().fill_bytes(&mut candidate);
                let stored = self
                    .registry
                    .server_secret(KEY_NAME, &hex::encode(candidate))
                    .await?;
                hex::decode(&stored).map_err(|_| {
                    OpError::Internal(anyhow::anyhow!("stored secret {KEY_NAME} is not hex"))
                })
            })
            .await?;
        Ok(key)
    }

    fn token_for(key: &[u8], tenant: &str, id: &SandboxId) -> Result<Vec<u8>, OpError> {
        let mut mac = Hmac::<Sha256>::new_from_slice(key)
            .map_err(|_| OpError::Internal(anyhow::anyhow!("access token key")))?;
        mac.update(CONTEXT);
        mac.update(tenant.as_bytes());
        mac.update(b"\0");
        mac.update(id.as_str().as_bytes());
        Ok(mac.finalize().into_bytes().to_vec())
    }

    /// The access token of one of the caller's sandboxes (64 hex digits).
    pub async fn sandbox_access_token(&self, cx: &OpContext, id: &str) -> Result<String, OpError> {
        let rec = self.sandbox_for(&cx.caller, id).await?;
        let key = self.access_key().await?;
        Ok(hex::encode(Self::token_for(key, &rec.tenant, &rec.id)?))
    }

    /// The context a request presenting `token` for sandbox `id` acts in:
    /// the sandbox's tenant, without admin rights. `not_found` for an
    /// unknown or ended sandbox, `unauthorized` for any other token.
    pub async fn authenticate_sandbox_token(
        &self,
        id: &str,
        token: &str,
    ) -> Result<OpContext, OpError> {
        let not_found = || OpError::NotFound(format!("sandbox {id}"));
        let sid: SandboxId = id.parse().map_err(|_| not_found())?;
        let rec = match self.registry.get_sandbox(&sid).await {
            Ok(rec) => rec,
            Err(aviary_registry::RegistryError::NotFound) => return Err(not_found()),
            Err(e) => return Err(e.into()),
        };
        if matches!(rec.state, SandboxState::Terminated | SandboxState::Failed) {
            return Err(not_found());
        }
        let key = self.access_key().await?;
        let want = Self::token_for(key, &rec.tenant, &rec.id)?;
        let given = hex::decode(token.trim()).unwrap_or_default();
        if given.len() != want.len() || !bool::from(given.ct_eq(&want)) {
            return Err(OpError::Unauthorized);
        }
        Ok(OpContext::new(Caller {
            tenant: rec.tenant,
            admin: false,
        }))
    }
}
