//! Small filesystem helpers: advisory file locks, staging directories and
//! mount-aware removal.
//!
//! Locks are `flock(2)` locks, which conflict between processes and between
//! separate opens within one process, so they serialize threads and processes
//! alike. A staging directory `tmp/<id>/` is owned by whoever holds the lock
//! on `tmp/<id>.lock`; a staging directory whose lock can be taken belongs to a
//! builder that died and may be swept.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::error::{lock_err, remove_err, IoContext, TemplateError};

/// An exclusive `flock` on a file; released on drop.
pub(crate) struct FileLock {
    _lock: Flock<File>,
}

fn open_lock_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// Blocks until the exclusive lock on `path` (created if missing) is held.
pub(crate) fn lock_exclusive(path: &Path) -> Result<FileLock, TemplateError> {
    let file = open_lock_file(path).ctx(lock_err, path)?;
    let lock = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| lock_err(path.to_path_buf(), errno.into()))?;
    Ok(FileLock { _lock: lock })
}

/// Takes the exclusive lock on `path` if nobody holds it.
pub(crate) fn try_lock_exclusive(path: &Path) -> Result<Option<FileLock>, TemplateError> {
    let file = open_lock_file(path).ctx(lock_err, path)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(FileLock { _lock: lock })),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, errno)) => Err(lock_err(path.to_path_buf(), errno.into())),
    }
}

/// True when `lock`'s open file is still the file at `path` (nobody unlinked
/// and recreated it between our open and our flock).
fn lock_is_current(lock: &FileLock, path: &Path) -> bool {
    let (Ok(held), Ok(on_disk)) = (lock._lock.metadata(), fs::metadata(path)) else {
        return false;
    };
    held.dev() == on_disk.dev() && held.ino() == on_disk.ino()
}

/// A private build directory under `<store>/tmp`, removed (after unmounting
/// anything a build tool left mounted inside) when dropped.
pub(crate) struct Staging {
    dir: PathBuf,
    lock_path: PathBuf,
    lock: Option<FileLock>,
}

impl Staging {
    pub(crate) fn create(tmp: &Path) -> Result<Self, TemplateError> {
        loop {
            let id = format!("build-{:016x}", rand::random::<u64>());
            let lock_path = tmp.join(format!("{id}.lock"));
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&lock_path)
            {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(lock_err(lock_path, e)),
            }
            let Some(lock) = try_lock_exclusive(&lock_path)? else {
                continue;
            };
            // A sweeper may have taken and unlinked the fresh lock file before we
            // locked it; then our lock protects nothing and we start over.
            if !lock_is_current(&lock, &lock_path) {
                continue;
            }
            let dir = tmp.join(&id);
            fs::create_dir(&dir).ctx(lock_err, &dir)?;
            return Ok(Staging {
                dir,
                lock_path,
                lock: Some(lock),
            });
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.dir) {
            tracing::warn!(error = %e, dir = %self.dir.display(), "could not remove staging dir");
            return;
        }
        let _ = fs::remove_file(&self.lock_path);
        self.lock.take();
    }
}

/// Removes staging directories of builders that died (their lock is free).
pub(crate) fn sweep_staging(tmp: &Path) -> Result<(), TemplateError> {
    let entries = match fs::read_dir(tmp) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(lock_err(tmp.to_path_buf(), e)),
    };
    for entry in entries {
        let entry = entry.ctx(lock_err, tmp)?;
        let name = entry.file_name();
        let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".lock")) else {
            continue;
        };
        let lock_path = entry.path();
        let Some(lock) = try_lock_exclusive(&lock_path)? else {
            continue;
        };
        if !lock_is_current(&lock, &lock_path) {
            continue;
        }
        let dir = tmp.join(id);
        tracing::info!(dir = %dir.display(), "removing leftover staging dir of a dead build");
        remove_tree(&dir)?;
        let _ = fs::remove_file(&lock_path);
    }
    Ok(())
}

/// Removes `dir` recursively after detaching every mount below it, so that a
/// build tool's leftover `/proc` or `/dev` mount never makes us delete host
/// files. Missing `dir` is fine.
pub(crate) fn remove_tree(dir: &Path) -> Result<(), TemplateError> {
    if fs::symlink_metadata(dir).is_err() {
        return Ok(());
    }
    unmount_under(dir)?;
    if !mounts_under(dir)?.is_empty() {
        return Err(remove_err(
            dir.to_path_buf(),
            io::Error::other("mounts remain below the directory"),
        ));
    }
    fs::remove_dir_all(dir).ctx(remove_err, dir)
}

/// Mount points at or below `dir`, deepest first.
pub(crate) fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>, TemplateError> {
    let canonical = fs::canonicalize(dir).ctx(remove_err, dir)?;
    let info = fs::read_to_string("/proc/self/mountinfo")
        .ctx(remove_err, Path::new("/proc/self/mountinfo"))?;
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p.starts_with(&canonical))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    Ok(found)
}

fn unmount_under(dir: &Path) -> Result<(), TemplateError> {
    for mount in mounts_under(dir)? {
        tracing::warn!(mount = %mount.display(), "detaching leftover mount in build dir");
        nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH)
            .map_err(|errno| remove_err(mount.clone(), errno.into()))?;
    }
    Ok(())
}

/// Undoes mountinfo's octal escapes (`\040` for space and friends).
fn unescape_mountinfo(s: &str) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = (oct[0] - b'0') * 64 + (oct[1] - b'0') * 8 + (oct[2] - b'0');
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    std::ffi::OsString::from_vec(out)
}

/// Writes `data` to `path` atomically (temp file, fsync, rename, fsync dir).
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.{:016x}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        rand::random::<u64>()
    ));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/a\040b\134c"), "/a b\\c");
        assert_eq!(unescape_mountinfo(r"/plain"), "/plain");
        assert_eq!(unescape_mountinfo(r"/end\04"), r"/end\04");
    }

    #[test]
    fn staging_is_removed_on_drop_and_dead_builds_are_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = Staging::create(tmp.path()).unwrap();
        let dir = staging.dir().to_path_buf();
        fs::write(dir.join("f"), b"x").unwrap();
        // A live build is not swept.
        sweep_staging(tmp.path()).unwrap();
        assert!(dir.join("f").exists());
        drop(staging);
        assert!(!dir.exists());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);

        // A dead build: lock file present but unlocked.
        fs::create_dir(tmp.path().join("build-dead")).unwrap();
        fs::write(tmp.path().join("build-dead/x"), b"x").unwrap();
        fs::write(tmp.path().join("build-dead.lock"), b"").unwrap();
        sweep_staging(tmp.path()).unwrap();
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn remove_tree_detaches_mounts_first() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED remove_tree_detaches_mounts_first: needs root to mount");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        fs::create_dir(&victim).unwrap();
        fs::write(victim.join("precious"), b"keep me").unwrap();
        let build = tmp.path().join("build");
        fs::create_dir_all(build.join("mnt")).unwrap();
        nix::mount::mount(
            Some(&victim),
            &build.join("mnt"),
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap();
        remove_tree(&build).unwrap();
        assert!(!build.exists());
        assert_eq!(fs::read(victim.join("precious")).unwrap(), b"keep me");
    }
}
