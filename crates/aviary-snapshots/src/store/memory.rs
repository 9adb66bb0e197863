//! In-memory store: the test double at the chunk-store seam.
//!
//! Chunks and manifests live in two ordered maps behind one mutex, so `list` pages
//! in hash order straight from the map. Manifests are kept in their encoded form and
//! decoded on read, exactly like the other backends, so a manifest that does not
//! round-trip fails here too. Clones share one storage; nothing survives the
//! process. No call holds the lock across an `.await` (none awaits at all).

use super::{decode_manifest, ChunkStore};
use crate::error::SnapshotError;
use crate::hash::{validate_tenant, ChunkHash, SnapshotId};
use crate::manifest::{ManifestKey, SnapshotManifest};
use async_trait::async_trait;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Clone, Default)]
pub struct MemoryStore {
    objects: Arc<Mutex<Objects>>,
}

#[derive(Default)]
struct Objects {
    chunks: BTreeMap<ChunkHash, Vec<u8>>,
    /// Encoded manifests ([`SnapshotManifest::to_bytes`]).
    manifests: BTreeMap<ManifestKey, Vec<u8>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Objects> {
        // Every update is a single map insert or remove, so a panic while holding
        // the lock cannot leave an object half-written: a poisoned map is usable.
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn key(tenant: &str, id: &SnapshotId) -> Result<ManifestKey, SnapshotError> {
    validate_tenant(tenant)?;
    Ok(ManifestKey {
        tenant: tenant.to_owned(),
        id: id.clone(),
    })
}

#[async_trait]
impl ChunkStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        self.lock().chunks.insert(hash.clone(), bytes);
        Ok(())
    }

    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        self.lock()
            .chunks
            .get(hash)
            .cloned()
            .ok_or_else(|| SnapshotError::not_found(format!("chunk {hash}")))
    }

    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError> {
        Ok(self.lock().chunks.contains_key(hash))
    }

    async fn delete(&self, hash: &ChunkHash) -> Result<(), SnapshotError> {
        self.lock().chunks.remove(hash);
        Ok(())
    }

    async fn list(
        &self,
        after: Option<&ChunkHash>,
        limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        Ok(self
            .lock()
            .chunks
            .range::<ChunkHash, _>((start, Bound::Unbounded))
            .take(limit)
            .map(|(h, _)| h.clone())
            .collect())
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        let key = key(&manifest.tenant, &manifest.id)?;
        let bytes = manifest.to_bytes();
        self.lock().manifests.insert(key, bytes);
        Ok(())
    }

    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        let key = key(tenant, id)?;
        let bytes = self
            .lock()
            .manifests
            .get(&key)
            .cloned()
            .ok_or_else(|| SnapshotError::not_found(format!("snapshot {id}")))?;
        decode_manifest(tenant, id, &bytes)
    }

    async fn list_manifests(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        if let Some(t) = tenant {
            validate_tenant(t)?;
        }
        Ok(self
            .lock()
            .manifests
            .keys()
            .filter(|k| tenant.is_none_or(|t| k.tenant == t))
            .cloned()
            .collect())
    }

    async fn delete_manifest(&self, tenant: &str, id: &SnapshotId) -> Result<(), SnapshotError> {
        let key = key(tenant, id)?;
        match self.lock().manifests.remove(&key) {
            Some(_) => Ok(()),
            None => Err(SnapshotError::not_found(format!("snapshot {id}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_store_passes_conformance() {
        crate::conformance::run_all(&MemoryStore::new()).await;
    }

    #[tokio::test]
    async fn clones_share_objects() {
        let a = MemoryStore::new();
        let b = a.clone();
        let hash = ChunkHash::of(b"shared");
        a.put(&hash, b"shared".to_vec()).await.unwrap();
        assert_eq!(b.get(&hash).await.unwrap(), b"shared");
        b.delete(&hash).await.unwrap();
        assert!(!a.has(&hash).await.unwrap());
    }
}
