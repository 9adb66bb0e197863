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

use crate::error::SnapshotError;
use crate::hash::{ChunkHash, SnapshotId};
use crate::store::ChunkStore;
use std::collections::{BTreeMap, HashSet};
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

/// Mark-and-sweep: delete every chunk no manifest (of any tenant) references.
pub async fn collect_garbage(store: &dyn ChunkStore) -> Result<GcReport, SnapshotError> {
    let mut live: HashSet<ChunkHash> = HashSet::new();
    let keys = store.list_manifests(None).await?;
    for key in &keys {
        let m = store.get_manifest(&key.tenant, &key.id).await?;
        live.extend(m.chunk_refs().cloned());
    }
    let mut report = GcReport {
        manifests: keys.len() as u64,
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
