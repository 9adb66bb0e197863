//! [`SnapshotService`]: one store plus the lock that keeps GC from sweeping chunks a
//! running snapshot is about to reference, and the state of the unattended
//! [`GraceSweep`]. This is what the server holds.

use crate::error::SnapshotError;
use crate::gc::{apply_retention, collect_garbage, GcReport, GraceSweep, RetentionPolicy};
use crate::hash::SnapshotId;
use crate::manifest::SnapshotManifest;
use crate::store::ChunkStore;
use crate::tree::{restore_dir, snapshot_dir, RestoreOptions, RestoreStats, SnapshotRequest};
use std::path::Path;
use std::sync::Arc;
use tokio::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub struct SnapshotService {
    store: Arc<dyn ChunkStore>,
    gc_lock: RwLock<()>,
    grace_sweep: Arc<Mutex<GraceSweep>>,
}

impl SnapshotService {
    pub fn new(store: Arc<dyn ChunkStore>) -> Self {
        SnapshotService {
            store,
            gc_lock: RwLock::new(()),
            grace_sweep: Arc::new(Mutex::new(GraceSweep::new())),
        }
    }

    /// Held by a caller that writes a snapshot through [`Self::store`] itself
    /// (chunks, then manifest): no GC sweeps while it is held.
    pub async fn hold_for_snapshot(&self) -> RwLockReadGuard<'_, ()> {
        self.gc_lock.read().await
    }

    /// Held by a caller that sweeps through [`Self::store`] itself: no snapshot
    /// runs while it is held.
    pub async fn hold_for_gc(&self) -> RwLockWriteGuard<'_, ()> {
        self.gc_lock.write().await
    }

    /// The first-seen times of the unattended sweep (run it under [`Self::hold_for_gc`]).
    pub fn grace_sweep(&self) -> Arc<Mutex<GraceSweep>> {
        self.grace_sweep.clone()
    }

    pub fn store(&self) -> &Arc<dyn ChunkStore> {
        &self.store
    }

    /// Snapshot the directory `root` (see [`snapshot_dir`]).
    pub async fn snapshot(
        &self,
        root: &Path,
        req: SnapshotRequest,
    ) -> Result<SnapshotManifest, SnapshotError> {
        let _guard = self.gc_lock.read().await;
        snapshot_dir(self.store.as_ref(), root, req).await
    }

    /// Restore `tenant`'s snapshot `id` into `target` (missing or empty).
    pub async fn restore(
        &self,
        tenant: &str,
        id: &SnapshotId,
        target: &Path,
        opts: &RestoreOptions,
    ) -> Result<RestoreStats, SnapshotError> {
        let _guard = self.gc_lock.read().await;
        let manifest = self.store.get_manifest(tenant, id).await?;
        restore_dir(self.store.as_ref(), &manifest, target, opts).await
    }

    pub async fn manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        self.store.get_manifest(tenant, id).await
    }

    /// Apply `policy` to `tenant`, then sweep unreferenced chunks of the whole store.
    pub async fn gc(
        &self,
        tenant: &str,
        policy: &RetentionPolicy,
    ) -> Result<(Vec<SnapshotId>, GcReport), SnapshotError> {
        let _guard = self.gc_lock.write().await;
        let deleted =
            apply_retention(self.store.as_ref(), tenant, policy, aviary_core::now()).await?;
        let report = collect_garbage(self.store.as_ref()).await?;
        Ok((deleted, report))
    }
}
