//! The chunk store seam and its backends.
//!
//! A [`ChunkStore`] keeps two kinds of objects: chunks, named by the SHA-256 of their
//! bytes, and manifests, named by (tenant, snapshot id). Stores do not verify chunk
//! hashes on `put` or `get` (the caller hashed already; restore verifies every chunk
//! it reads), which keeps them dumb and lets tests plant corrupt chunks.
//!
//! Invariants every backend keeps (checked by [`crate::conformance`]):
//! `put` is idempotent; `has` after `put` is true; `get` of a missing chunk is
//! `NotFound`; `list` pages chunk hashes in ascending order strictly after the cursor;
//! `get_manifest` with another tenant is `NotFound`. All methods take `&self` and are
//! safe to call concurrently.

use crate::error::SnapshotError;
use crate::hash::{ChunkHash, SnapshotId};
use crate::manifest::{ManifestKey, SnapshotManifest};
use async_trait::async_trait;

pub mod local;
pub mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "s3")]
pub mod s3;

#[async_trait]
pub trait ChunkStore: Send + Sync {
    /// Short backend name for logs and errors (`local`, `memory`, `s3`, `redis`, `postgres`).
    fn backend(&self) -> &'static str;

    /// Store `bytes` under `hash` (idempotent; overwriting with the same bytes is fine).
    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError>;
    /// The stored bytes (unverified).
    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError>;
    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError>;
    /// Remove a chunk; removing a missing chunk is not an error.
    async fn delete(&self, hash: &ChunkHash) -> Result<(), SnapshotError>;
    /// Up to `limit` chunk hashes strictly greater than `after`, ascending.
    async fn list(
        &self,
        after: Option<&ChunkHash>,
        limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError>;

    /// Make every chunk `put` so far durable. Snapshots call this once before
    /// storing their manifest, so a backend may skip per-object syncs (the local
    /// store does one `syncfs` here instead of an fsync per chunk). Default: no-op,
    /// for backends whose `put` is durable when it returns.
    async fn flush(&self) -> Result<(), SnapshotError> {
        Ok(())
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError>;
    /// The manifest `id` of `tenant`; another tenant's manifest is `NotFound`.
    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError>;
    /// Keys of all manifests of `tenant`, or of every tenant with `None` (for GC).
    async fn list_manifests(&self, tenant: Option<&str>)
        -> Result<Vec<ManifestKey>, SnapshotError>;
    /// Remove a manifest; `NotFound` if `tenant` has no such manifest.
    async fn delete_manifest(&self, tenant: &str, id: &SnapshotId) -> Result<(), SnapshotError>;
}

/// Decode a stored manifest and check it belongs to `tenant` and is `id`.
pub(crate) fn decode_manifest(
    tenant: &str,
    id: &SnapshotId,
    bytes: &[u8],
) -> Result<SnapshotManifest, SnapshotError> {
    let m = SnapshotManifest::from_bytes(id.as_str(), bytes)?;
    if m.tenant != tenant || &m.id != id {
        return Err(SnapshotError::not_found(format!("snapshot {id}")));
    }
    Ok(m)
}
