//! Pre-made sandbox disks (issue 12): a few formatted, loop-attached and
//! mounted disks per size, kept ready in `<state_dir>/.disk-pool` so a
//! create only moves one onto its sandbox dir (`MS_MOVE`, no I/O) instead of
//! copying the golden image, attaching a loop device and mounting ext4 on
//! the request path (the mount waits for the journal's first write and a
//! cache flush of the host disk: 3–16 ms here, more when the disk is busy).
//!
//! - A disk in the pool is fresh: made from the golden image exactly as
//!   [`super::quota::SandboxDisks::attach`] makes one, never used by any
//!   sandbox. A sandbox's disk is never returned to the pool: destroy
//!   unmounts and deletes it as before.
//! - The pool dir is host-only (0700) and not below any sandbox dir; no
//!   sandbox sees it. Names are the pool's own (`<mb>-<n>`), never input.
//! - Refills run in the background after each take (and after a miss, so
//!   the next create of that size hits), one at a time per size.
//! - Anything that fails falls back to making the disk on the request path,
//!   as without a pool; a failed move leaves the pooled disk to be removed.
//! - Left-overs of a previous run (the process ended without dropping the
//!   pool) are unmounted and deleted when a pool that is on is opened on
//!   the same state dir; dropping the pool unmounts and deletes what it
//!   holds.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Distinct disk sizes the pool keeps disks for; a create of a further
/// size makes its disk on the request path.
const MAX_SIZES: usize = 8;

/// The disks ready for each size, and the sizes being refilled.
#[derive(Debug, Default)]
struct Ready {
    by_size: HashMap<u64, Vec<PathBuf>>,
    refilling: std::collections::HashSet<u64>,
    /// Set by [`DiskPool::drain`]: nothing is taken or made any more.
    drained: bool,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    per_size: usize,
    ready: Mutex<Ready>,
    seq: AtomicU64,
}

/// The pool of one runtime's sandbox disks; `per_size` 0 turns it off.
#[derive(Clone, Debug)]
pub(crate) struct DiskPool(Arc<Inner>);

/// Where a pooled disk's image lives: beside its mount point.
fn image_of(entry: &Path) -> PathBuf {
    super::quota::disk_image(entry)
}

impl DiskPool {
    /// The pool under `<state_dir>/.disk-pool`, emptied of a previous run's
    /// disks.
    pub(crate) fn open(state_dir: &Path, per_size: usize) -> DiskPool {
        let dir = state_dir.join(".disk-pool");
        let pool = DiskPool(Arc::new(Inner {
            dir,
            per_size,
            ready: Mutex::new(Ready::default()),
            seq: AtomicU64::new(0),
        }));
        if per_size > 0 {
            // (only a pool that is on owns the dir: a tool opening the same
            // state dir with the pool off leaves the server's disks alone)
            pool.sweep();
            use std::os::unix::fs::DirBuilderExt;
            if let Err(error) = std::fs::DirBuilder::new().mode(0o700).create(&pool.0.dir) {
                if error.kind() != io::ErrorKind::AlreadyExists {
                    tracing::warn!(%error, dir = %pool.0.dir.display(), "disk pool off: cannot make its dir");
                    return DiskPool(Arc::new(Inner {
                        dir: pool.0.dir.clone(),
                        per_size: 0,
                        ready: Mutex::new(Ready::default()),
                        seq: AtomicU64::new(0),
                    }));
                }
            }
        }
        pool
    }

    fn enabled(&self) -> bool {
        self.0.per_size > 0
    }

    /// Moves a ready disk of `disk_mb` MiB onto the empty dir `root` and
    /// names its image after `root`. `false` when none is ready (or the
    /// move failed): the caller makes the disk itself. Either way a refill
    /// of the size is started.
    pub(crate) fn take(&self, root: &Path, disk_mb: u64, golden: &Path) -> bool {
        if !self.enabled() {
            return false;
        }
        let entry = {
            let mut ready = self.0.ready.lock().expect("disk pool poisoned");
            if ready.drained {
                return false;
            }
            ready.by_size.get_mut(&disk_mb).and_then(Vec::pop)
        };
        let taken = match entry {
            Some(entry) => match move_disk(&entry, root) {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(%error, entry = %entry.display(), "pooled disk could not be moved; making one");
                    discard(&entry);
                    false
                }
            },
            None => false,
        };
        self.refill(disk_mb, golden.to_path_buf());
        taken
    }

    /// Fills the size up to `per_size` in the background (once at a time
    /// per size; at most [`MAX_SIZES`] sizes).
    fn refill(&self, disk_mb: u64, golden: PathBuf) {
        {
            let mut ready = self.0.ready.lock().expect("disk pool poisoned");
            if ready.refilling.contains(&disk_mb)
                || (!ready.by_size.contains_key(&disk_mb) && ready.by_size.len() >= MAX_SIZES)
            {
                return;
            }
            ready.refilling.insert(disk_mb);
            ready.by_size.entry(disk_mb).or_default();
        }
        let pool = self.clone();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            pool.0
                .ready
                .lock()
                .expect("disk pool poisoned")
                .refilling
                .remove(&disk_mb);
            return;
        };
        handle.spawn_blocking(move || {
            loop {
                let have = pool
                    .0
                    .ready
                    .lock()
                    .expect("disk pool poisoned")
                    .by_size
                    .get(&disk_mb)
                    .map_or(0, Vec::len);
                if have >= pool.0.per_size {
                    break;
                }
                let n = pool.0.seq.fetch_add(1, Ordering::Relaxed);
                let entry = pool.0.dir.join(format!("{disk_mb}-{n}"));
                match make_disk(&golden, &entry) {
                    Ok(()) => {
                        let mut ready = pool.0.ready.lock().expect("disk pool poisoned");
                        if ready.drained {
                            drop(ready);
                            discard(&entry);
                            break;
                        }
                        ready.by_size.entry(disk_mb).or_default().push(entry);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "disk pool refill failed");
                        discard(&entry);
                        break;
                    }
                }
            }
            pool.0
                .ready
                .lock()
                .expect("disk pool poisoned")
                .refilling
                .remove(&disk_mb);
        });
    }

    /// Unmounts and deletes every ready disk and stops refilling (a refill
    /// under way finishes into an off pool and is discarded by its drop).
    pub(crate) fn drain(&self) {
        let entries: Vec<PathBuf> = {
            let mut ready = self.0.ready.lock().expect("disk pool poisoned");
            ready.drained = true;
            ready.by_size.drain().flat_map(|(_, v)| v).collect()
        };
        for entry in entries {
            discard(&entry);
        }
    }

    /// How many disks are ready, all sizes together.
    pub(crate) fn ready_count(&self) -> usize {
        self.0
            .ready
            .lock()
            .expect("disk pool poisoned")
            .by_size
            .values()
            .map(Vec::len)
            .sum()
    }

    /// Unmounts and deletes everything in the pool dir (a previous run's
    /// disks, or this pool's on drop).
    fn sweep(&self) {
        let Ok(entries) = std::fs::read_dir(&self.0.dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                discard(&path);
            }
        }
        // images whose dir was already gone
        if let Ok(entries) = std::fs::read_dir(&self.0.dir) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let entries: Vec<PathBuf> = self
            .ready
            .get_mut()
            .map(|r| r.by_size.drain().flat_map(|(_, v)| v).collect())
            .unwrap_or_default();
        for entry in entries {
            discard(&entry);
        }
        if self.per_size > 0 {
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// Makes one pooled disk: the golden image copied sparse beside `entry`,
/// attached and mounted at `entry`.
fn make_disk(golden: &Path, entry: &Path) -> io::Result<()> {
    std::fs::create_dir(entry)?;
    super::quota::copy_sparse(golden, &image_of(entry))?;
    super::quota::mount_disk(&image_of(entry), entry)
}

/// Moves the mounted pooled disk `entry` onto `root`, then renames its
/// image to `root`'s. The move comes first: if the process ends in
/// between, the sandbox has its disk and only the image's name is the
/// pool's (the next [`DiskPool::open`] deletes the name; the mounted
/// file lives on until the sandbox's disk is unmounted).
fn move_disk(entry: &Path, root: &Path) -> io::Result<()> {
    nix::mount::mount(
        Some(entry),
        root,
        None::<&str>,
        nix::mount::MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(io::Error::from)?;
    std::fs::rename(image_of(entry), super::quota::disk_image(root))?;
    let _ = std::fs::remove_dir(entry);
    Ok(())
}

/// Unmounts a pooled disk (the loop device goes with it: auto-clear) and
/// deletes its image and dir. Best effort.
fn discard(entry: &Path) {
    let _ = nix::mount::umount2(entry, nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_file(image_of(entry));
    let _ = std::fs::remove_dir(entry);
}
