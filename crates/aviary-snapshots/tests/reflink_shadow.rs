//! Reflink shadows on a real XFS filesystem (a sparse image, loop-mounted): an
//! incremental snapshot that reads only what changed must describe exactly the bytes
//! a full re-read describes — same chunk list, and a restore that compares equal
//! byte for byte — after in-place edits, appends, truncation, holes, files replaced
//! by rename, and unchanged files. Needs root, `mkfs.xfs` (scripts/deps.sh) and a
//! loop device; skips loudly otherwise.
#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

use aviary_snapshots::{
    restore_dir, snapshot_dir, ChunkerConfig, LocalStore, RestoreOptions, SnapshotManifest,
    SnapshotRequest,
};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: usize = 1024 * 1024;
const CFG: ChunkerConfig = ChunkerConfig {
    min_size: 16 * 1024,
    avg_size: 64 * 1024,
    max_size: 256 * 1024,
};

/// A loop-mounted filesystem on a sparse image; unmounted and removed on drop.
struct LoopFs {
    /// Holds the image; removed after the unmount.
    _dir: tempfile::TempDir,
    mnt: PathBuf,
}

impl LoopFs {
    /// `None` (after printing why) when this host cannot make one.
    fn xfs() -> Option<LoopFs> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: mounting a loop XFS filesystem needs root");
            return None;
        }
        if Command::new("mkfs.xfs").arg("-V").output().is_err() {
            eprintln!("SKIPPED: mkfs.xfs not installed (scripts/deps.sh installs xfsprogs)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("fs.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(512 * MIB as u64)
            .unwrap();
        let out = Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img)
            .output()
            .unwrap();
        assert!(out.status.success(), "mkfs.xfs: {out:?}");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let out = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!(
                "SKIPPED: cannot loop-mount XFS here: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        Some(LoopFs { _dir: dir, mnt })
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

fn write_at(path: &Path, off: u64, data: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(off)).unwrap();
    f.write_all(data).unwrap();
}

/// Every regular file's bytes, by relative path.
fn contents(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            out.insert(
                e.file_name().to_str().unwrap().to_owned(),
                std::fs::read(e.path()).unwrap(),
            );
        }
    }
    out
}

fn chunks_by_path(m: &SnapshotManifest) -> BTreeMap<String, Vec<String>> {
    m.entries
        .iter()
        .map(|e| {
            (
                e.path.clone(),
                e.chunks.iter().map(|c| c.to_string()).collect(),
            )
        })
        .collect()
}

fn shadow_files(shadow: &Path) -> usize {
    std::fs::read_dir(shadow.join("files")).map_or(0, |d| d.count())
}

/// Snapshot `ws` incrementally (parent + shadow) and in full (neither); check both
/// describe the same chunks and that the incremental one restores to `ws`.
async fn check_round(
    store: &LocalStore,
    ws: &Path,
    shadow: &Path,
    parent: &SnapshotManifest,
    scratch: &Path,
) -> SnapshotManifest {
    let mut req = SnapshotRequest::new("t", "ws").shadow(shadow);
    req.chunker = CFG;
    let inc = snapshot_dir(store, ws, req.parent(parent.id.clone()))
        .await
        .unwrap();
    let mut full_req = SnapshotRequest::new("t", "ws");
    full_req.chunker = CFG;
    let full = snapshot_dir(store, ws, full_req).await.unwrap();
    assert_eq!(full.read_bytes, full.total_bytes);
    assert_eq!(
        chunks_by_path(&inc),
        chunks_by_path(&full),
        "the incremental chunk lists are those of a full re-read"
    );
    assert_eq!(inc.total_bytes, full.total_bytes);
    eprintln!(
        "incremental snapshot read {} of {} bytes",
        inc.read_bytes, inc.total_bytes
    );
    let out = scratch.join(inc.id.to_string());
    restore_dir(store, &inc, &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(contents(&out), contents(ws), "restore equals the live tree");
    inc
}

#[tokio::test]
async fn partial_rereads_equal_full_rereads_on_xfs() {
    let Some(fs) = LoopFs::xfs() else { return };
    let host = tempfile::tempdir().unwrap();
    let store = LocalStore::open(host.path().join("store")).unwrap();
    let ws = fs.mnt.join("workspace");
    let shadow = fs.mnt.join("shadow");
    std::fs::create_dir(&ws).unwrap();
    let names = [
        "edited",
        "appended",
        "truncated",
        "holed",
        "renamed",
        "unchanged",
        "grown",
        "small",
    ];
    for (i, n) in names.iter().enumerate() {
        let len = if *n == "small" {
            4096
        } else {
            6 * MIB + i * 1000
        };
        std::fs::write(ws.join(n), random_bytes(i as u64, len)).unwrap();
    }
    let mut req = SnapshotRequest::new("t", "ws").shadow(&shadow);
    req.chunker = CFG;
    let first = snapshot_dir(&store, &ws, req).await.unwrap();
    assert_eq!(first.read_bytes, first.total_bytes);
    assert_eq!(
        shadow_files(&shadow),
        7,
        "every file of 1 MiB or more has a shadow"
    );

    // In-place edits (one spanning a chunk boundary region, one tiny), an append, a
    // truncation, a punched hole, a rename over the file, and a sparse extension.
    write_at(
        &ws.join("edited"),
        3 * MIB as u64,
        &random_bytes(100, 64 * 1024),
    );
    write_at(&ws.join("edited"), 100, b"x");
    std::fs::OpenOptions::new()
        .append(true)
        .open(ws.join("appended"))
        .unwrap()
        .write_all(&random_bytes(101, 3 * MIB + 17))
        .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(ws.join("truncated"))
        .unwrap()
        .set_len(2 * MIB as u64 + 5)
        .unwrap();
    let holed = std::fs::OpenOptions::new()
        .write(true)
        .open(ws.join("holed"))
        .unwrap();
    nix::fcntl::fallocate(
        holed.as_raw_fd(),
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        MIB as i64,
        (2 * MIB) as i64,
    )
    .unwrap();
    drop(holed);
    let mut replaced = std::fs::read(ws.join("renamed")).unwrap();
    replaced[4 * MIB..4 * MIB + 10].fill(0xAB);
    std::fs::write(ws.join(".tmp"), &replaced).unwrap();
    std::fs::rename(ws.join(".tmp"), ws.join("renamed")).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(ws.join("grown"))
        .unwrap()
        .set_len(9 * MIB as u64)
        .unwrap();

    let second = check_round(&store, &ws, &shadow, &first, host.path()).await;
    // Unchanged data is not read again: well under half of the tree.
    assert!(
        second.read_bytes < second.total_bytes / 2,
        "read {} of {}",
        second.read_bytes,
        second.total_bytes
    );

    // A second round from the new shadows: more edits, a deleted file, and a file
    // that shrinks to below the shadow size.
    write_at(&ws.join("edited"), 5 * MIB as u64, &random_bytes(102, 1000));
    write_at(&ws.join("appended"), 0, b"head");
    std::fs::remove_file(ws.join("holed")).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(ws.join("grown"))
        .unwrap()
        .set_len(1000)
        .unwrap();
    let third = check_round(&store, &ws, &shadow, &second, host.path()).await;
    assert!(
        third.read_bytes < third.total_bytes / 4,
        "read {}",
        third.read_bytes
    );
    // Shadows of deleted and now-small files are gone; the others remain.
    assert_eq!(shadow_files(&shadow), 5);

    // Without anything changed, nothing is read even for files whose metadata is too
    // fresh to trust: their shadows prove them unchanged.
    let fourth = check_round(&store, &ws, &shadow, &third, host.path()).await;
    assert!(
        fourth.read_bytes < 2 * MIB as u64,
        "read {}",
        fourth.read_bytes
    );
    drop(fs);
}

#[tokio::test]
async fn untrusted_shadow_state_falls_back_to_full_reads() {
    let Some(fs) = LoopFs::xfs() else { return };
    let host = tempfile::tempdir().unwrap();
    let store = LocalStore::open(host.path().join("store")).unwrap();
    let ws = fs.mnt.join("workspace");
    let shadow = fs.mnt.join("shadow");
    std::fs::create_dir(&ws).unwrap();
    std::fs::write(ws.join("a"), random_bytes(1, 3 * MIB)).unwrap();
    let mut req = SnapshotRequest::new("t", "ws").shadow(&shadow);
    req.chunker = CFG;
    let first = snapshot_dir(&store, &ws, req.clone()).await.unwrap();

    // A shadow made for another lineage is not trusted: with a parent whose chunks
    // differ from the shadow's, the changed file is read whole.
    let mut other_req = SnapshotRequest::new("t", "ws");
    other_req.chunker = CFG;
    std::fs::write(ws.join("a"), random_bytes(2, 3 * MIB)).unwrap();
    let other = snapshot_dir(&store, &ws, other_req).await.unwrap();
    std::fs::write(ws.join("a"), random_bytes(1, 3 * MIB)).unwrap();
    write_at(&ws.join("a"), 10, b"y");
    let _ = first;
    let m = check_round(&store, &ws, &shadow, &other, host.path()).await;
    assert_eq!(m.read_bytes, 3 * MIB as u64);

    // A corrupt index is ignored (full read), then replaced.
    std::fs::write(shadow.join("index.json"), b"{not json").unwrap();
    write_at(&ws.join("a"), 20, b"z");
    let m2 = check_round(&store, &ws, &shadow, &m, host.path()).await;
    assert_eq!(m2.read_bytes, 3 * MIB as u64);
    write_at(&ws.join("a"), 30, b"w");
    let m3 = check_round(&store, &ws, &shadow, &m2, host.path()).await;
    assert!(m3.read_bytes < MIB as u64, "read {}", m3.read_bytes);

    // A shadow directory inside the tree is refused.
    let mut inside = SnapshotRequest::new("t", "ws").shadow(ws.join("sh"));
    inside.chunker = CFG;
    let err = snapshot_dir(&store, &ws, inside).await.unwrap_err();
    assert!(err.to_string().contains("shadow"), "{err}");
    drop(fs);
}

#[tokio::test]
async fn without_reflinks_the_shadow_is_unused_and_results_are_the_same() {
    // The host's temp dir: ext4 or tmpfs here, neither clones.
    let host = tempfile::tempdir().unwrap();
    let store = LocalStore::open(host.path().join("store")).unwrap();
    let ws = host.path().join("ws");
    let shadow = host.path().join("shadow");
    std::fs::create_dir(&ws).unwrap();
    std::fs::write(ws.join("a"), random_bytes(1, 3 * MIB)).unwrap();
    let mut req = SnapshotRequest::new("t", "ws").shadow(&shadow);
    req.chunker = CFG;
    let clones = reflink_supported(host.path());
    let first = snapshot_dir(&store, &ws, req).await.unwrap();
    write_at(&ws.join("a"), 10, b"y");
    let m = check_round(&store, &ws, &shadow, &first, host.path()).await;
    if clones {
        eprintln!("NOTE: the temp dir's filesystem clones; checked the shadow path instead");
    } else {
        assert_eq!(m.read_bytes, 3 * MIB as u64);
        assert_eq!(shadow_files(&shadow), 0);
    }
}

/// Whether `dir`'s filesystem clones (probed with `cp --reflink=always`).
fn reflink_supported(dir: &Path) -> bool {
    std::fs::write(dir.join("probe-a"), b"probe").unwrap();
    let ok = Command::new("cp")
        .arg("--reflink=always")
        .arg(dir.join("probe-a"))
        .arg(dir.join("probe-b"))
        .output()
        .is_ok_and(|o| o.status.success());
    let _ = std::fs::remove_file(dir.join("probe-a"));
    let _ = std::fs::remove_file(dir.join("probe-b"));
    ok
}

#[tokio::test]
async fn random_edit_rounds_match_full_rereads_on_xfs() {
    let Some(fs) = LoopFs::xfs() else { return };
    let host = tempfile::tempdir().unwrap();
    let store = LocalStore::open(host.path().join("store")).unwrap();
    let ws = fs.mnt.join("workspace");
    let shadow = fs.mnt.join("shadow");
    std::fs::create_dir(&ws).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    for i in 0..4u64 {
        std::fs::write(
            ws.join(format!("f{i}")),
            random_bytes(i, 2 * MIB + rng.gen_range(0..MIB)),
        )
        .unwrap();
    }
    let mut req = SnapshotRequest::new("t", "ws").shadow(&shadow);
    req.chunker = CFG;
    let mut parent = snapshot_dir(&store, &ws, req).await.unwrap();
    for round in 0..6u64 {
        for i in 0..4u64 {
            let path = ws.join(format!("f{i}"));
            let len = std::fs::metadata(&path).unwrap().len();
            match rng.gen_range(0..5) {
                0 => {
                    let n = rng.gen_range(1..200_000usize);
                    let off = rng.gen_range(0..len);
                    write_at(&path, off, &random_bytes(round * 10 + i, n));
                }
                1 => std::fs::OpenOptions::new()
                    .append(true)
                    .open(&path)
                    .unwrap()
                    .write_all(&random_bytes(round, rng.gen_range(1..300_000)))
                    .unwrap(),
                2 => std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .unwrap()
                    .set_len(rng.gen_range(MIB as u64..=len.max(MIB as u64 + 1)))
                    .unwrap(),
                3 => {
                    // Several small scattered writes.
                    for k in 0..5 {
                        let off = rng.gen_range(0..len);
                        write_at(&path, off, &random_bytes(round * 100 + k, 10));
                    }
                }
                _ => {} // unchanged
            }
        }
        parent = check_round(&store, &ws, &shadow, &parent, host.path()).await;
    }
    drop(fs);
}
