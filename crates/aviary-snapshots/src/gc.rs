//! Retention and garbage collection.
//!
//! Retention deletes manifests: per (tenant, sandbox, label) group it keeps the newest
//! `keep_last` and drops those older than `max_age`. Manifests are self-contained, so
//! deleting a parent never breaks a child. Garbage collection is mark-and-sweep: mark
//! every chunk referenced by any remaining manifest of any tenant, then page through
//! the store's chunks and delete the unmarked ones.
//!
//! Concurrency: a snapshot writes its chunks before its manifest, so a sweep running
//! while a snapshot is in flight could delete chunks the new manifest is about to
//! reference. [`crate::SnapshotService`] serialises the two within one process (GC
//! takes the write side of a lock that snapshots hold for reading); deployments with
//! several writers to one store must run GC from one place while no snapshot runs.
//!
//! [`GraceSweep`] is the sweep that runs unattended (in the background, and once at
//! start-up, to collect the chunks of a snapshot interrupted by a crash): a chunk is
//! deleted only after it has been seen unreferenced for a whole grace period, so a
//! snapshot in flight in another process (chunks written, manifest not yet) has that
//! long to store its manifest. It needs nothing from a backend beyond [`ChunkStore`]
//! (no timestamps), so it works on every store.

use crate::error::SnapshotError;
use crate::hash::{ChunkHash, SnapshotId};
use crate::store::ChunkStore;
use std::collections::{BTreeMap, HashMap, HashSet};
use time::OffsetDateTime;

const LIST_PAGE: usize = 1000;

/// Which snapshots to keep per (sandbox, label) group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Keep at most this many newest snapshots per group (`None`: no count limit).
    pub keep_last: Option<usize>,
    /// Delete snapshots older than this (`None`: no age limit).
    pub max_age: Option<time::Duration>,
}

/// (sandbox id, label): the unit retention counts within.
type RetentionGroup = (Option<String>, String);

/// Delete `tenant`'s manifests that `policy` does not keep; returns the deleted ids.
pub async fn apply_retention(
    store: &dyn ChunkStore,
    tenant: &str,
    policy: &RetentionPolicy,
    now: OffsetDateTime,
) -> Result<Vec<SnapshotId>, SnapshotError> {
    let keys = store.list_manifests(Some(tenant)).await?;
    let mut groups: BTreeMap<RetentionGroup, Vec<(OffsetDateTime, SnapshotId)>> = BTreeMap::new();
    for key in keys {
        let m = store.get_manifest(&key.tenant, &key.id).await?;
        groups
            .entry((m.sandbox_id.map(String::from), m.label))
            .or_default()
            .push((m.created_at, m.id));
    }
    let mut deleted = Vec::new();
    for (_, mut snaps) in groups {
        snaps.sort_by(|a, b| b.cmp(a));
        for (i, (created_at, id)) in snaps.into_iter().enumerate() {
            let too_many = policy.keep_last.is_some_and(|n| i >= n);
            let too_old = policy.max_age.is_some_and(|age| now - created_at > age);
            if too_many || too_old {
                store.delete_manifest(tenant, &id).await?;
                deleted.push(id);
            }
        }
    }
    Ok(deleted)
}

/// What a sweep found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests: u64,
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
}

/// Every chunk referenced by a manifest of any tenant, and how many manifests there are.
async fn mark(store: &dyn ChunkStore) -> Result<(HashSet<ChunkHash>, u64), SnapshotError> {
    let mut live: HashSet<ChunkHash> = HashSet::new();
    let keys = store.list_manifests(None).await?;
    for key in &keys {
        let m = store.get_manifest(&key.tenant, &key.id).await?;
        live.extend(m.chunk_refs().cloned());
    }
    Ok((live, keys.len() as u64))
}

/// Mark-and-sweep: delete every chunk no manifest (of any tenant) references.
pub async fn collect_garbage(store: &dyn ChunkStore) -> Result<GcReport, SnapshotError> {
    let (live, manifests) = mark(store).await?;
    let mut report = GcReport {
        manifests,
        ..GcReport::default()
    };
    let mut cursor: Option<ChunkHash> = None;
    loop {
        let page = store.list(cursor.as_ref(), LIST_PAGE).await?;
        let Some(last) = page.last().cloned() else {
            break;
        };
        for hash in page {
            if live.contains(&hash) {
                report.chunks_kept += 1;
            } else {
                store.delete(&hash).await?;
                report.chunks_deleted += 1;
            }
        }
        cursor = Some(last);
    }
    tracing::info!(?report, "snapshot gc done");
    Ok(report)
}

/// Mark-and-sweep with a grace period: an unreferenced chunk is deleted by the first
/// sweep that runs at least `grace` after a sweep first saw it unreferenced. The
/// first-seen times are kept here, in memory: after a restart the grace period starts
/// again, which only delays a deletion.
#[derive(Debug, Default)]
pub struct GraceSweep {
    unreferenced_since: HashMap<ChunkHash, OffsetDateTime>,
}

impl GraceSweep {
    pub fn new() -> Self {
        Self::default()
    }

    /// Unreferenced chunks seen and not deleted yet (still in their grace period).
    pub fn pending(&self) -> usize {
        self.unreferenced_since.len()
    }

    /// One sweep at `now`; `chunks_kept` counts referenced chunks and those still
    /// in their grace period.
    pub async fn sweep(
        &mut self,
        store: &dyn ChunkStore,
        grace: time::Duration,
        now: OffsetDateTime,
    ) -> Result<GcReport, SnapshotError> {
        let (live, manifests) = mark(store).await?;
        let mut report = GcReport {
            manifests,
            ..GcReport::default()
        };
        let mut seen_now: HashMap<ChunkHash, OffsetDateTime> = HashMap::new();
        let mut cursor: Option<ChunkHash> = None;
        loop {
            let page = store.list(cursor.as_ref(), LIST_PAGE).await?;
            let Some(last) = page.last().cloned() else {
                break;
            };
            for hash in page {
                if live.contains(&hash) {
                    report.chunks_kept += 1;
                    continue;
                }
                let since = self.unreferenced_since.get(&hash).copied().unwrap_or(now);
                if now - since >= grace {
                    store.delete(&hash).await?;
                    report.chunks_deleted += 1;
                } else {
                    report.chunks_kept += 1;
                    seen_now.insert(hash, since);
                }
            }
            cursor = Some(last);
        }
        // chunks referenced again (or gone) since the last sweep start over
        self.unreferenced_since = seen_now;
        if report.chunks_deleted > 0 {
            tracing::info!(?report, "unreferenced snapshot chunks collected");
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::local::LocalStore;

    #[tokio::test]
    async fn grace_sweep_deletes_an_orphan_only_after_its_grace_period() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path().join("store")).unwrap();
        let orphan = ChunkHash::of(b"interrupted snapshot");
        store
            .put(&orphan, b"interrupted snapshot".to_vec())
            .await
            .unwrap();
        let grace = time::Duration::seconds(60);
        let t0 = aviary_core::now();
        let mut gc = GraceSweep::new();

        let r = gc.sweep(&store, grace, t0).await.unwrap();
        assert_eq!((r.chunks_kept, r.chunks_deleted), (1, 0));
        assert_eq!(gc.pending(), 1);
        let r = gc
            .sweep(&store, grace, t0 + time::Duration::seconds(59))
            .await
            .unwrap();
        assert_eq!(r.chunks_deleted, 0);
        assert!(store.has(&orphan).await.unwrap());

        let r = gc
            .sweep(&store, grace, t0 + time::Duration::seconds(60))
            .await
            .unwrap();
        assert_eq!(r.chunks_deleted, 1);
        assert!(!store.has(&orphan).await.unwrap());
        assert_eq!(gc.pending(), 0);
    }

    #[tokio::test]
    async fn grace_sweep_forgets_a_chunk_that_became_referenced() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path().join("store")).unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), b"kept by a manifest").unwrap();
        let grace = time::Duration::seconds(10);
        let t0 = aviary_core::now();
        let mut gc = GraceSweep::new();
        // the chunk lands before its manifest, as in a snapshot in flight
        let chunk = ChunkHash::of(b"kept by a manifest");
        store
            .put(&chunk, b"kept by a manifest".to_vec())
            .await
            .unwrap();
        gc.sweep(&store, grace, t0).await.unwrap();
        assert_eq!(gc.pending(), 1);
        crate::snapshot_dir(&store, &src, crate::SnapshotRequest::new("t", "l"))
            .await
            .unwrap();
        let r = gc
            .sweep(&store, grace, t0 + time::Duration::seconds(3600))
            .await
            .unwrap();
        assert_eq!(r.chunks_deleted, 0);
        assert_eq!(gc.pending(), 0);
        assert!(store.has(&chunk).await.unwrap());
    }
}
