//! The conformance suite every [`ChunkStore`] passes, run by each backend's tests
//! against a real store (a temp dir, a real S3-compatible server, Redis, PostgreSQL).
//!
//! Each check panics with a message on failure (these are test helpers). The store
//! passed in must be empty and private to the caller (its own prefix/namespace),
//! because the GC check sweeps everything unreferenced.

use crate::error::SnapshotError;
use crate::gc::{apply_retention, collect_garbage, RetentionPolicy};
use crate::hash::{ChunkHash, SnapshotId};
use crate::manifest::SnapshotManifest;
use crate::store::ChunkStore;
use crate::tree::{restore_dir, snapshot_dir, RestoreOptions, SnapshotRequest};
use crate::ChunkerConfig;
use std::path::PathBuf;

/// Run every check in order.
pub async fn run_all(store: &dyn ChunkStore) {
    chunk_crud(store).await;
    manifest_crud(store).await;
    tenant_isolation(store).await;
    corruption_is_detected(store).await;
    gc_keeps_referenced_chunks(store).await;
}

/// A scratch directory removed on drop (no dev-dependency needed).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let p = std::env::temp_dir().join(aviary_core::new_id("aviary-snapconf"));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn small_chunks() -> ChunkerConfig {
    ChunkerConfig {
        min_size: 1024,
        avg_size: 4096,
        max_size: 16384,
    }
}

fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub async fn chunk_crud(store: &dyn ChunkStore) {
    let a = b"alpha chunk".to_vec();
    let b = pseudo_random(1, 100_000);
    let (ha, hb) = (ChunkHash::of(&a), ChunkHash::of(&b));
    assert!(!store.has(&ha).await.unwrap());
    let err = store.get(&ha).await.unwrap_err();
    assert!(err.is_not_found(), "get of a missing chunk: {err}");
    store.put(&ha, a.clone()).await.unwrap();
    store.put(&ha, a.clone()).await.unwrap(); // idempotent
    store.put(&hb, b.clone()).await.unwrap();
    assert!(store.has(&ha).await.unwrap());
    assert_eq!(store.get(&ha).await.unwrap(), a);
    assert_eq!(store.get(&hb).await.unwrap(), b);
    store.put(&ChunkHash::of(b""), Vec::new()).await.unwrap();
    assert_eq!(
        store.get(&ChunkHash::of(b"")).await.unwrap(),
        Vec::<u8>::new()
    );

    let mut expected = vec![ha.clone(), hb.clone(), ChunkHash::of(b"")];
    expected.sort();
    assert_eq!(store.list(None, 100).await.unwrap(), expected);
    // Paging: strictly after the cursor, ascending, at most `limit`.
    let first = store.list(None, 1).await.unwrap();
    assert_eq!(first, expected[..1]);
    let rest = store.list(Some(&first[0]), 100).await.unwrap();
    assert_eq!(rest, expected[1..]);
    assert!(store.list(expected.last(), 10).await.unwrap().is_empty());

    store.delete(&ha).await.unwrap();
    store.delete(&ha).await.unwrap(); // deleting a missing chunk is fine
    assert!(!store.has(&ha).await.unwrap());
    store.delete(&hb).await.unwrap();
    store.delete(&ChunkHash::of(b"")).await.unwrap();
    assert!(store.list(None, 100).await.unwrap().is_empty());
}

fn manifest(tenant: &str, label: &str) -> SnapshotManifest {
    SnapshotManifest {
        id: SnapshotId::generate(),
        parent: None,
        created_at: aviary_core::now(),
        tenant: tenant.into(),
        sandbox_id: Some(aviary_core::SandboxId::generate()),
        label: label.into(),
        entries: Vec::new(),
        total_bytes: 0,
        new_bytes: 0,
        new_chunks: 0,
        read_bytes: 0,
    }
}

pub async fn manifest_crud(store: &dyn ChunkStore) {
    let m1 = manifest("tenant-a", "workspace");
    let mut m2 = manifest("tenant-a", "upper");
    m2.parent = Some(m1.id.clone());
    store.put_manifest(&m1).await.unwrap();
    store.put_manifest(&m2).await.unwrap();
    assert_eq!(store.get_manifest("tenant-a", &m1.id).await.unwrap(), m1);
    assert_eq!(store.get_manifest("tenant-a", &m2.id).await.unwrap(), m2);
    let ids: Vec<SnapshotId> = store
        .list_manifests(Some("tenant-a"))
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.id)
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&m1.id) && ids.contains(&m2.id));
    store.delete_manifest("tenant-a", &m1.id).await.unwrap();
    assert!(store
        .get_manifest("tenant-a", &m1.id)
        .await
        .unwrap_err()
        .is_not_found());
    assert!(store
        .delete_manifest("tenant-a", &m1.id)
        .await
        .unwrap_err()
        .is_not_found());
    store.delete_manifest("tenant-a", &m2.id).await.unwrap();
    assert!(store
        .list_manifests(Some("tenant-a"))
        .await
        .unwrap()
        .is_empty());
    let bad = store.get_manifest("../x", &m1.id).await.unwrap_err();
    assert!(matches!(bad, SnapshotError::InvalidName { .. }), "{bad}");
}

pub async fn tenant_isolation(store: &dyn ChunkStore) {
    let m = manifest("tenant-a", "workspace");
    store.put_manifest(&m).await.unwrap();
    let err = store.get_manifest("tenant-b", &m.id).await.unwrap_err();
    assert!(
        err.is_not_found(),
        "another tenant's snapshot must be NotFound: {err}"
    );
    assert!(store
        .delete_manifest("tenant-b", &m.id)
        .await
        .unwrap_err()
        .is_not_found());
    assert!(store
        .list_manifests(Some("tenant-b"))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(store.get_manifest("tenant-a", &m.id).await.unwrap(), m);
    let all = store.list_manifests(None).await.unwrap();
    assert!(all.iter().any(|k| k.tenant == "tenant-a" && k.id == m.id));
    store.delete_manifest("tenant-a", &m.id).await.unwrap();
}

/// Flip a byte in a stored chunk, truncate another, remove a third: each restore
/// fails with `Corrupt` / `NotFound` and leaves the target empty.
pub async fn corruption_is_detected(store: &dyn ChunkStore) {
    let dir = Scratch::new();
    let src = dir.0.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("data.bin"), pseudo_random(2, 60_000)).unwrap();
    let mut req = SnapshotRequest::new("tenant-c", "workspace");
    req.chunker = small_chunks();
    let m = snapshot_dir(store, &src, req).await.unwrap();
    let chunks = &m
        .entries
        .iter()
        .find(|e| e.path == "data.bin")
        .unwrap()
        .chunks;
    assert!(
        chunks.len() >= 3,
        "want several chunks, got {}",
        chunks.len()
    );
    let opts = RestoreOptions::default();

    // Intact first.
    restore_dir(store, &m, &dir.0.join("ok"), &opts)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(dir.0.join("ok/data.bin")).unwrap(),
        pseudo_random(2, 60_000)
    );

    let victim = chunks[1].clone();
    let good = store.get(&victim).await.unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x40;
    store.delete(&victim).await.unwrap();
    store.put(&victim, flipped).await.unwrap();
    let out = dir.0.join("flipped");
    let err = restore_dir(store, &m, &out, &opts).await.unwrap_err();
    assert!(
        matches!(&err, SnapshotError::Corrupt { hash, .. } if *hash == victim),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        0,
        "nothing left behind"
    );

    store.delete(&victim).await.unwrap();
    store
        .put(&victim, good[..good.len() - 1].to_vec())
        .await
        .unwrap();
    let out = dir.0.join("truncated");
    let err = restore_dir(store, &m, &out, &opts).await.unwrap_err();
    assert!(matches!(err, SnapshotError::Corrupt { .. }), "{err}");

    store.delete(&victim).await.unwrap();
    let out = dir.0.join("missing");
    let err = restore_dir(store, &m, &out, &opts).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");

    store.put(&victim, good).await.unwrap();
    store.delete_manifest("tenant-c", &m.id).await.unwrap();
}

/// Two generations of a tree; retention keeps the newest; GC removes exactly the
/// chunks only the old one used; the kept snapshot still restores.
pub async fn gc_keeps_referenced_chunks(store: &dyn ChunkStore) {
    let dir = Scratch::new();
    let src = dir.0.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("shared.bin"), pseudo_random(3, 40_000)).unwrap();
    std::fs::write(src.join("old.bin"), pseudo_random(4, 40_000)).unwrap();
    let sandbox = aviary_core::SandboxId::generate();
    let mut req = SnapshotRequest::new("tenant-d", "workspace").sandbox(sandbox.clone());
    req.chunker = small_chunks();
    let old = snapshot_dir(store, &src, req.clone()).await.unwrap();
    std::fs::remove_file(src.join("old.bin")).unwrap();
    std::fs::write(src.join("new.bin"), pseudo_random(5, 40_000)).unwrap();
    let new = snapshot_dir(store, &src, req.parent(old.id.clone()))
        .await
        .unwrap();
    // An unreferenced stray chunk too.
    let stray = ChunkHash::of(b"stray");
    store.put(&stray, b"stray".to_vec()).await.unwrap();

    let policy = RetentionPolicy {
        keep_last: Some(1),
        max_age: None,
    };
    let deleted = apply_retention(store, "tenant-d", &policy, aviary_core::now())
        .await
        .unwrap();
    assert_eq!(deleted, vec![old.id.clone()]);
    let report = collect_garbage(store).await.unwrap();

    let live: std::collections::HashSet<&ChunkHash> = new.chunk_refs().collect();
    let only_old: Vec<&ChunkHash> = old.chunk_refs().filter(|h| !live.contains(h)).collect();
    assert!(!only_old.is_empty());
    for h in &live {
        assert!(
            store.has(h).await.unwrap(),
            "referenced chunk {h} was swept"
        );
    }
    for h in &only_old {
        assert!(
            !store.has(h).await.unwrap(),
            "unreferenced chunk {h} survived"
        );
    }
    assert!(!store.has(&stray).await.unwrap());
    assert_eq!(report.chunks_kept, live.len() as u64);
    assert!(report.chunks_deleted > only_old.len() as u64);

    let out = dir.0.join("out");
    restore_dir(store, &new, &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(out.join("new.bin")).unwrap(),
        pseudo_random(5, 40_000)
    );
    assert!(!out.join("old.bin").exists());
}
