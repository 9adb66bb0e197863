//! API keys: issue, list and revoke (admin), and the authentication cache.
//!
//! Keys are stored hashed; a key's public handle is its id. Revocation is
//! effective on the very next request: the registry never returns a revoked
//! key, and revoking empties the cache. [`KeyCache`] carries an epoch so that
//! a lookup that read the registry before a revocation cannot put the revoked
//! key back into the cache after it was emptied.

use crate::context::{Caller, OpContext};
use crate::error::OpError;
use crate::ops::{hash_key, ControlPlane};
use crate::requests::KeyRef;
use aviary_core::api::CreateKeyRequest;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Mutex;
use time::OffsetDateTime;

/// Authenticated keys by hash, with the revocation epoch.
#[derive(Default)]
pub struct KeyCache {
    inner: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    epoch: u64,
    callers: HashMap<String, Caller>,
}

impl KeyCache {
    pub fn get(&self, key_hash: &str) -> Option<Caller> {
        self.lock().callers.get(key_hash).cloned()
    }

    /// The epoch to pass to [`KeyCache::insert`]; read it before the registry.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Caches a caller read from the registry, unless a revocation happened
    /// since `epoch` was read.
    pub fn insert(&self, key_hash: String, caller: Caller, epoch: u64) {
        let mut s = self.lock();
        if s.epoch == epoch {
            s.callers.insert(key_hash, caller);
        }
    }

    /// Forgets every cached key (after a revocation).
    pub fn invalidate(&self) {
        let mut s = self.lock();
        s.epoch += 1;
        s.callers.clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `POST /v1/keys` answer: the secret is shown this once.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IssuedKey {
    /// Public handle (for `GET /v1/keys` and `DELETE /v1/keys/{id}`).
    pub id: String,
    pub tenant: String,
    pub admin: bool,
    /// The bearer secret.
    pub key: String,
}

/// A key as listed: never the secret nor its hash.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiKeyInfo {
    pub id: String,
    pub tenant: String,
    pub admin: bool,
    #[serde(with = "time::serde::rfc3339")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub revoked_at: Option<OffsetDateTime>,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KeyList {
    pub keys: Vec<ApiKeyInfo>,
}

impl From<aviary_registry::ApiKeyRecord> for ApiKeyInfo {
    fn from(k: aviary_registry::ApiKeyRecord) -> Self {
        ApiKeyInfo {
            id: k.id,
            tenant: k.tenant,
            admin: k.admin,
            created_at: k.created_at,
            revoked_at: k.revoked_at,
        }
    }
}

impl ControlPlane {
    /// Creates a key for a tenant (admin only) and returns it with its id.
    pub async fn issue_key(
        &self,
        cx: &OpContext,
        req: CreateKeyRequest,
    ) -> Result<IssuedKey, OpError> {
        cx.require_admin("creating keys")?;
        crate::validate::key_request(&req)?;
        let created = self.create_key(cx, req).await?;
        let rec = self
            .registry
            .find_api_key(&hash_key(&created.key))
            .await?
            .ok_or_else(|| OpError::internal(anyhow::anyhow!("new key not found")))?;
        Ok(IssuedKey {
            id: rec.id,
            tenant: created.tenant,
            admin: created.admin,
            key: created.key,
        })
    }

    /// Every key, revoked ones included (admin only).
    pub async fn list_keys(&self, cx: &OpContext) -> Result<KeyList, OpError> {
        cx.require_admin("listing keys")?;
        Ok(KeyList {
            keys: self
                .registry
                .list_api_keys()
                .await?
                .into_iter()
                .map(ApiKeyInfo::from)
                .collect(),
        })
    }

    /// Revokes a key (admin only); it fails from the next request on. The
    /// server's bootstrap key (`<data dir>/admin.key`) is refused: the server
    /// re-registers it at start. Rotate it by deleting the file, restarting,
    /// and then revoking the old key by id.
    pub async fn revoke_key(&self, cx: &OpContext, req: KeyRef) -> Result<ApiKeyInfo, OpError> {
        let id = req.id.as_str();
        cx.require_admin("revoking keys")?;
        crate::validate::identifier("key id", id)?;
        let not_found = || OpError::NotFound(format!("key {id}"));
        let bootstrap = self
            .bootstrap_key_hash
            .read()
            .expect("bootstrap key poisoned")
            .clone();
        if let Some(bootstrap) = bootstrap {
            let rec = self.registry.find_api_key(&bootstrap).await?;
            if rec.is_some_and(|r| r.id == id) {
                return Err(OpError::Forbidden(format!(
                    "key {id} is the server's bootstrap admin key (admin.key in its data dir); delete that file and restart to rotate it, then revoke the old key"
                )));
            }
        }
        let rec = self
            .registry
            .revoke_api_key(id, aviary_core::now())
            .await
            .map_err(|e| match e {
                aviary_registry::RegistryError::NotFound => not_found(),
                other => other.into(),
            })?;
        self.key_cache.invalidate();
        tracing::info!(key.id = %rec.id, tenant = %rec.tenant, "API key revoked");
        Ok(rec.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller() -> Caller {
        Caller {
            tenant: "t".into(),
            admin: false,
        }
    }

    #[test]
    fn a_lookup_from_before_a_revocation_is_not_cached() {
        let c = KeyCache::default();
        let before = c.epoch();
        c.invalidate();
        c.insert("h".into(), caller(), before);
        assert!(c.get("h").is_none());
        let now = c.epoch();
        c.insert("h".into(), caller(), now);
        assert_eq!(c.get("h").unwrap().tenant, "t");
        c.invalidate();
        assert!(c.get("h").is_none());
    }
}
