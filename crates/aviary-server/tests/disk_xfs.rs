//! Sandbox disks on XFS (`[server] disk_fs = "xfs"`): the disk quota still
//! holds, and snapshots of a sandbox keep reflink shadows on its own disk, so
//! an in-place edit of a large file is read back in a few chunks, not whole.
//! Against the real server, crun, loop devices, XFS and the chunk store.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use common::shell;
use std::path::{Path, PathBuf};

const MIB: u64 = 1024 * 1024;
/// The smallest disk mkfs.xfs makes (the class is shrunk to it so the
/// quota test fills it quickly).
const DISK_MB: u64 = 320;

/// Why XFS sandbox disks cannot be tested here, if they cannot.
fn unavailable() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata("/proc/self").map_or(true, |m| m.uid() != 0) {
        return Some("needs root (loop devices, mount)".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Some("/dev/loop-control is missing (modprobe loop)".into());
    }
    if !["/usr/sbin/mkfs.xfs", "/sbin/mkfs.xfs"]
        .iter()
        .any(|p| Path::new(p).exists())
    {
        return Some("mkfs.xfs is missing (scripts/deps.sh installs xfsprogs)".into());
    }
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs
        .lines()
        .any(|l| l.split_whitespace().last() == Some("xfs"))
    {
        // the mount would load the module; a kernel without it cannot
        if !Path::new("/sys/module/xfs").exists()
            && std::process::Command::new("modprobe")
                .arg("xfs")
                .status()
                .map_or(true, |s| !s.success())
        {
            return Some("the kernel has no XFS (modprobe xfs failed)".into());
        }
    }
    None
}

/// The sandbox dir (its disk's mount point) of `id` under `data`.
fn sandbox_root(data: &Path, id: &str) -> PathBuf {
    fn find(dir: &Path, id: &str, depth: usize) -> Option<PathBuf> {
        for e in std::fs::read_dir(dir).ok()?.flatten() {
            let p = e.path();
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if e.file_name() == id && p.join("workspace").is_dir() {
                return Some(p);
            }
            if depth > 0 {
                if let Some(found) = find(&p, id, depth - 1) {
                    return Some(found);
                }
            }
        }
        None
    }
    find(data, id, 4).unwrap_or_else(|| panic!("no sandbox dir of {id} under {data:?}"))
}

/// The file system type mounted at `dir` (host mount namespace).
fn fstype_at(dir: &Path) -> Option<String> {
    let d = dir.to_str().unwrap();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(d))
        .and_then(|l| l.split(" - ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_disks_keep_the_quota_and_snapshots_read_only_changed_extents() {
    if let Some(why) = unavailable() {
        eprintln!("SKIPPED: XFS sandbox disks: {why}");
        return;
    }
    let (ts, _dir) = common::start_edited(|cfg| {
        let settings = &mut cfg.control.settings;
        settings.server.disk_fs = aviary_config::DiskFs::Xfs;
        let class = settings.server.default_class.clone();
        for c in settings.classes.iter_mut().filter(|c| c.name == class) {
            c.disk_mb = DISK_MB;
        }
    })
    .await;
    let c = &ts.client;
    let p = common::new_sandbox(c).await;
    let root = sandbox_root(&ts.data, &p);
    assert_eq!(fstype_at(&root).as_deref(), Some("xfs"), "{root:?}");

    let run = write_edit_snapshot(&ts, &p).await;
    let (m1, m2) = (&run.m1, &run.m2);
    eprintln!(
        "XFS shadows: snapshot #1 read {} bytes, #2 (8 KiB edited in a 32 MiB file) read {} bytes, stored {} new",
        m1.read_bytes, m2.read_bytes, m2.new_bytes
    );
    assert!(
        m1.read_bytes >= 32 * MIB,
        "first snapshot reads it all: {m1:?}"
    );
    assert!(
        m2.read_bytes < 12 * MIB,
        "snapshot #2 read {} of a {} byte file",
        m2.read_bytes,
        32 * MIB
    );
    assert!(m2.new_bytes < 12 * MIB, "{m2:?}");

    // the shadows live on the sandbox's own disk, one dir per layer
    let shadow = root.join(".shadow");
    assert!(
        shadow.join("workspace/index.json").is_file(),
        "{:?}",
        std::fs::read_dir(&shadow).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
    );
    assert!(shadow.join("writable").is_dir());

    // ... and nowhere inside the sandbox: not mounted, not reachable
    let out = c
        .exec(&p, &shell("cat /proc/self/mountinfo; ls -a / /workspace"))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert!(!out.stdout.contains(".shadow"), "{}", out.stdout);
    assert!(!out.stdout.contains("index.json"), "{}", out.stdout);

    // a fork from the second snapshot holds exactly the edited file
    let f = c
        .fork(&p, run.s2["id"].as_str(), None)
        .await
        .unwrap()
        .sandbox
        .id
        .to_string();
    let out = c.exec(&f, &shell("md5sum < /workspace/big")).await.unwrap();
    assert_eq!(out.stdout, run.edited_md5);

    // the quota holds on XFS: the disk fills up, with ENOSPC inside
    let out = c
        .exec(
            &p,
            &shell("dd if=/dev/zero of=/workspace/fill bs=1M count=400 conv=fsync"),
        )
        .await
        .unwrap();
    assert_ne!(out.exit_code, 0, "{out:?}");
    assert!(out.stderr.contains("No space left on device"), "{out:?}");
    let out = c
        .exec(
            &p,
            &shell("rm -f /workspace/fill && df -m /workspace | tail -n 1"),
        )
        .await
        .unwrap();
    let size: u64 = out
        .stdout
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("df: {out:?}"));
    assert!(size <= DISK_MB, "df inside shows the class's disk: {out:?}");

    // destroy takes the shadows with the disk
    c.delete_sandbox(&p, None).await.unwrap();
    ts.cp().reclaims.settled().await;
    assert!(!shadow.exists(), "shadow dir outlived its sandbox");
    assert!(!root.exists());
    ts.cleanup().await;
}

/// What [`write_edit_snapshot`] saw.
struct EditRun {
    m1: aviary_snapshots::SnapshotManifest,
    m2: aviary_snapshots::SnapshotManifest,
    s2: serde_json::Value,
    edited_md5: String,
}

/// 32 MiB of random bytes into sandbox `p`'s workspace, a snapshot, 8 KiB
/// edited in place in the middle, another snapshot: their workspace
/// manifests (which count the bytes each read).
async fn write_edit_snapshot(ts: &common::TestServer, p: &str) -> EditRun {
    let c = &ts.client;
    let out = c
        .exec(
            p,
            &shell("head -c 33554432 /dev/urandom > /workspace/big && sync"),
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let s1 = c.snapshot(p, None).await.unwrap();
    let out = c
        .exec(
            p,
            &shell(
                "head -c 8192 /dev/urandom | dd of=/workspace/big bs=4096 seek=2000 conv=notrunc 2>/dev/null \
                 && sync && md5sum < /workspace/big",
            ),
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let s2 = c.snapshot(p, None).await.unwrap();
    assert_eq!(s2["parent"], s1["id"]);
    let store = ts.cp().snapshots.store().clone();
    let tenant = s1["tenant"].as_str().unwrap();
    let manifest = |s: &serde_json::Value| {
        s["workspace_manifest"]
            .as_str()
            .unwrap()
            .parse::<aviary_snapshots::SnapshotId>()
            .unwrap()
    };
    EditRun {
        m1: store.get_manifest(tenant, &manifest(&s1)).await.unwrap(),
        m2: store.get_manifest(tenant, &manifest(&s2)).await.unwrap(),
        s2,
        edited_md5: out.stdout,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_disks_read_an_edited_file_whole() {
    if let Some(why) = unavailable() {
        eprintln!("SKIPPED: sandbox disks: {why}");
        return;
    }
    // the default file system: the shadow dir is offered, but without
    // reflinks a snapshot falls back to reading changed files whole
    let ts = common::start().await;
    let p = common::new_sandbox(&ts.client).await;
    let root = sandbox_root(&ts.data, &p);
    assert_eq!(fstype_at(&root).as_deref(), Some("ext4"), "{root:?}");
    let run = write_edit_snapshot(&ts, &p).await;
    eprintln!(
        "ext4: snapshot #1 read {} bytes, #2 read {} bytes",
        run.m1.read_bytes, run.m2.read_bytes
    );
    assert!(run.m2.read_bytes >= 32 * MIB, "{:?}", run.m2);
    assert!(
        !root.join(".shadow/workspace/index.json").exists()
            || std::fs::read_dir(root.join(".shadow/workspace/files"))
                .unwrap()
                .next()
                .is_none(),
        "no clones on ext4"
    );
    ts.cleanup().await;
}
