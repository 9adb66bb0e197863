//! Per-sandbox disk quotas: `disk_mb` bounds the overlay's writable layer
//! and `/workspace` together.
//!
//! Each sandbox dir `<state_dir>/<id>` is the mount point of the sandbox's own
//! file system ([`DiskFs`]: ext4 by default, or XFS with reflinks so
//! snapshots can track changes inside large files, see
//! `aviary_snapshots::shadow`): a sparse image file `<state_dir>/<id>.img` of exactly
//! `disk_mb` MiB, attached to a loop device (auto-clear, direct I/O) and
//! mounted with `discard`. Everything the sandbox can write on disk — `upper/`,
//! `work/`, `workspace/` — lives on it, so a full sandbox gets `ENOSPC`
//! ("No space left on device") inside, `df` inside shows the class's size, and
//! the host file system holds at most `disk_mb` for it (deleted files are
//! punched out of the image again through `discard`).
//!
//! New disks are not formatted one by one: the first sandbox of a size runs
//! `mkfs.ext4` once into `<state_dir>/.disks/ext4-v1-<mb>.img` (lazy inode
//! tables and journal, no resize inode: ~240 KiB of data for 10 GiB), and
//! every disk of that size is a sparse copy of it. XFS likewise
//! (`mkfs.xfs -m reflink=1` into `xfs-v1-<mb>.img`); mkfs writes its 64 MiB
//! log as zeros, which the golden image keeps as holes (132 KiB of data for
//! 10 GiB). All copies share one UUID: XFS disks are mounted `nouuid`.
//! [`mount_disk`] tells the two apart by the image's superblock, so the
//! disk pool, reboot recovery and disks made before a change of `disk_fs`
//! all mount right.
//!
//! Why not project quotas (XFS `prjquota`, as Docker's overlay2 does, or ext4
//! `project`): the kernels this runs on are built without `CONFIG_XFS_QUOTA`
//! and without `CONFIG_QFMT_V2` ("XFS: quota support not available in this
//! kernel", "EXT4: kernel was not built with CONFIG_QUOTA and CONFIG_QFMT_V2"),
//! so neither mounts with project quotas. A file system per sandbox needs
//! only the loop driver and `mkfs.ext4`.
//!
//! Invariants: the image exists only while the sandbox dir does (it is
//! created after the dir is claimed and removed before the dir at destroy),
//! so `list()`, which sees sandbox dirs, sees every image. The loop device
//! is auto-clear: unmounting the file system frees it, so there is nothing
//! else to release. After a host reboot the images of surviving sandbox dirs
//! are mounted again when the runtime is constructed.
//!
//! Cross-file-system moves: a layer staged outside the sandbox disk
//! (`<id>.seed/`) cannot be renamed into it (`EXDEV`); [`SandboxDisks::adopt`]
//! copies it with `cp -a` (owners, modes, xattrs, hard links and overlay
//! whiteouts kept) instead.
//!
//! Concurrency: stateless; everything derives from paths, so calls for
//! different sandboxes run concurrently. The loop ioctls and `mount(2)` are
//! plain syscalls (this module's `unsafe`); `mkfs.ext4` and `cp` run through
//! the runtime's [`Spawner`].

use aviary_runtime::{RuntimeError, SpawnRequest, Spawner};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Smallest sandbox disk: an ext4 journal and its metadata need a few MiB.
/// (XFS needs more: [`DiskFs::min_disk_mb`].)
pub const MIN_DISK_MB: u64 = 32;

/// Smallest XFS sandbox disk: `mkfs.xfs` (6.1) refuses anything smaller
/// ("Filesystem must be larger than 300MB"), its log alone is 64 MiB.
pub const MIN_XFS_DISK_MB: u64 = 300;

/// The file system of each sandbox's disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DiskFs {
    /// ext4: the smallest and quickest to make; no reflinks, so a snapshot
    /// reads every changed file whole.
    #[default]
    Ext4,
    /// XFS with `reflink=1`: snapshots keep `FICLONE` shadows of large files
    /// and read only their changed extents. At least [`MIN_XFS_DISK_MB`].
    Xfs,
}

impl DiskFs {
    pub fn name(self) -> &'static str {
        match self {
            DiskFs::Ext4 => "ext4",
            DiskFs::Xfs => "xfs",
        }
    }

    /// Smallest disk of this file system, in MiB.
    pub fn min_disk_mb(self) -> u64 {
        match self {
            DiskFs::Ext4 => MIN_DISK_MB,
            DiskFs::Xfs => MIN_XFS_DISK_MB,
        }
    }

    fn mkfs(self) -> &'static str {
        match self {
            DiskFs::Ext4 => "mkfs.ext4",
            DiskFs::Xfs => "mkfs.xfs",
        }
    }

    fn package(self) -> &'static str {
        match self {
            DiskFs::Ext4 => "e2fsprogs",
            DiskFs::Xfs => "xfsprogs",
        }
    }
}

impl std::fmt::Display for DiskFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DiskFs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ext4" => Ok(DiskFs::Ext4),
            "xfs" => Ok(DiskFs::Xfs),
            other => Err(format!("unknown disk file system {other:?} (ext4 or xfs)")),
        }
    }
}

const MIB: u64 = 1024 * 1024;

/// Distinguishes the temporary files of concurrent golden-image makers.
static TMP_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The sandbox disks of one runtime (or none, when quotas are off).
#[derive(Clone, Debug)]
pub struct SandboxDisks {
    enabled: bool,
    /// `<state_dir>/.disks`: the formatted images new disks are copied from.
    golden_dir: PathBuf,
    /// The file system new disks get.
    fs: DiskFs,
    /// `mkfs.ext4` or `mkfs.xfs`, looked up in `PATH`.
    mkfs: PathBuf,
    /// Longest `mkfs.ext4` may take.
    timeout: Duration,
    /// Disks made ahead of need (off unless [`Self::with_pool`]).
    pool: crate::disk_pool::DiskPool,
}

/// Where the disk image of the sandbox whose dir is `sandbox_root` lives:
/// `<state_dir>/<id>.img`, beside (not inside) its mount point.
pub fn disk_image(sandbox_root: &Path) -> PathBuf {
    let mut s = sandbox_root.as_os_str().to_owned();
    s.push(".img");
    PathBuf::from(s)
}

impl SandboxDisks {
    /// The disks of the sandboxes in `state_dir`. Makes `<state_dir>/.disks`
    /// and mounts again the disks a host reboot unmounted (see [`Self::recover`]).
    pub fn open(state_dir: &Path, enabled: bool, timeout: Duration) -> Result<Self, RuntimeError> {
        let disks = SandboxDisks {
            enabled,
            golden_dir: state_dir.join(".disks"),
            fs: DiskFs::Ext4,
            mkfs: PathBuf::from(DiskFs::Ext4.mkfs()),
            timeout,
            pool: crate::disk_pool::DiskPool::open(state_dir, 0),
        };
        if enabled {
            std::fs::create_dir_all(&disks.golden_dir).map_err(|source| {
                RuntimeError::CreateDir {
                    path: disks.golden_dir.clone(),
                    source,
                }
            })?;
        } else {
            tracing::warn!(
                state_dir = %state_dir.display(),
                "DISK QUOTAS ARE DISABLED (disk_quota = false): disk_mb is not enforced and \
                 any sandbox can fill the host file system"
            );
        }
        disks.recover(state_dir);
        Ok(disks)
    }

    /// Makes new disks with file system `fs` (ext4 unless set). Disks made
    /// before keep theirs.
    pub fn with_fs(mut self, fs: DiskFs) -> Self {
        self.fs = fs;
        self.mkfs = PathBuf::from(fs.mkfs());
        self
    }

    /// The file system new disks get.
    pub fn fs(&self) -> DiskFs {
        self.fs
    }

    /// Keeps `per_size` disks of each recently asked size made ahead of need
    /// (see [`crate::disk_pool`]); 0 keeps none. No effect when disks are off.
    pub fn with_pool(mut self, per_size: usize) -> Self {
        if self.enabled {
            if let Some(state_dir) = self.golden_dir.parent() {
                self.pool = crate::disk_pool::DiskPool::open(state_dir, per_size);
            }
        }
        self
    }

    /// Unmounts and deletes the disks made ahead of need (the server is
    /// stopping); later creates make their disks themselves.
    pub fn drain_pool(&self) {
        self.pool.drain();
    }

    /// How many disks are made ahead of need right now.
    pub fn pooled(&self) -> usize {
        self.pool.ready_count()
    }

    /// Gives the freshly claimed, empty sandbox dir `root` its own file system
    /// of `disk_mb` MiB. On failure the caller destroys the sandbox, which
    /// unmounts and removes whatever this left.
    pub async fn attach(
        &self,
        spawner: &dyn Spawner,
        root: &Path,
        disk_mb: u64,
    ) -> Result<(), RuntimeError> {
        self.attach_from(spawner, root, disk_mb, true).await
    }

    /// [`Self::attach`], taking a disk made ahead of need when `pooled`.
    async fn attach_from(
        &self,
        spawner: &dyn Spawner,
        root: &Path,
        disk_mb: u64,
        pooled: bool,
    ) -> Result<(), RuntimeError> {
        if !self.enabled {
            return Ok(());
        }
        let min = self.fs.min_disk_mb();
        if disk_mb < min {
            return Err(RuntimeError::InvalidSpec {
                reason: format!(
                    "disk_mb {disk_mb} is below the smallest sandbox disk on {} ({min} MiB)",
                    self.fs
                ),
            });
        }
        let image = disk_image(root);
        let golden = self.golden(spawner, disk_mb).await?;
        if pooled && self.pool.take(root, disk_mb, &golden) {
            return Ok(());
        }
        let (from, to) = (golden.clone(), image.clone());
        tokio::task::spawn_blocking(move || copy_sparse(&from, &to))
            .await
            .unwrap_or_else(|join| Err(io::Error::other(join.to_string())))
            .map_err(|source| RuntimeError::WriteFile {
                path: image.clone(),
                source,
            })?;
        let mount_image = image.clone();
        let target = root.to_path_buf();
        tokio::task::spawn_blocking(move || mount_disk(&mount_image, &target))
            .await
            .unwrap_or_else(|join| Err(io::Error::other(join.to_string())))
            .map_err(|source| RuntimeError::MountDisk {
                path: root.to_path_buf(),
                source,
            })
    }

    /// The formatted, empty image of `disk_mb` MiB that new sandbox disks
    /// are copied from (`<state_dir>/.disks/<fs>-v1-<mb>.img`), made by
    /// `mkfs.ext4` / `mkfs.xfs` the first time a size is asked for. Copying
    /// its few hundred KiB of metadata is ~10 ms cheaper than running mkfs
    /// for every sandbox. All copies share one file system UUID, which ext4
    /// ignores and XFS is told to (`nouuid`).
    async fn golden(&self, spawner: &dyn Spawner, disk_mb: u64) -> Result<PathBuf, RuntimeError> {
        let dir = &self.golden_dir;
        let golden = dir.join(format!("{}-v1-{disk_mb}.img", self.fs));
        if golden.is_file() {
            return Ok(golden);
        }
        std::fs::create_dir_all(dir).map_err(|source| RuntimeError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        // Made under a private name and renamed: concurrent first creates
        // each make one, and the last rename wins with an equal image.
        let tmp = dir.join(format!(
            ".{}-{disk_mb}.{}.{}.tmp",
            self.fs,
            std::process::id(),
            TMP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let sparse = tmp.with_extension("sparse");
        let made = async {
            create_sparse(&tmp, disk_mb.saturating_mul(MIB)).map_err(|source| {
                RuntimeError::WriteFile {
                    path: tmp.clone(),
                    source,
                }
            })?;
            self.mkfs(spawner, &tmp).await?;
            // mkfs.xfs writes its whole log (64 MiB) as zeros: kept as holes,
            // so every copy stays a few hundred KiB.
            let (from, to) = (tmp.clone(), sparse.clone());
            tokio::task::spawn_blocking(move || copy_dropping_zeros(&from, &to))
                .await
                .unwrap_or_else(|join| Err(io::Error::other(join.to_string())))
                .map_err(|source| RuntimeError::WriteFile {
                    path: sparse.clone(),
                    source,
                })?;
            std::fs::rename(&sparse, &golden).map_err(|source| RuntimeError::WriteFile {
                path: golden.clone(),
                source,
            })
        }
        .await;
        let _ = std::fs::remove_file(&tmp);
        if made.is_err() {
            let _ = std::fs::remove_file(&sparse);
        }
        made.map(|()| golden)
    }

    async fn mkfs(&self, spawner: &dyn Spawner, image: &Path) -> Result<(), RuntimeError> {
        let mut req = SpawnRequest::new(self.mkfs.clone(), mkfs_args(self.fs, image));
        req.timeout = self.timeout;
        let out = spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: format!(
                    "{} (disk quotas need {}, or disk_quota = false)",
                    self.mkfs.display(),
                    self.fs.package()
                ),
                source,
            })?;
        if !out.success() {
            return Err(RuntimeError::InvokeRuntime {
                action: self.fs.mkfs().into(),
                detail: format!(
                    "exit {:?}: {}",
                    out.code,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(())
    }

    /// Removes the disk image of `root` (after its file system was unmounted;
    /// an image still attached is freed when the loop device lets go).
    pub fn release(&self, root: &Path) -> Result<(), RuntimeError> {
        let image = disk_image(root);
        match std::fs::remove_file(&image) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RuntimeError::RemoveDir {
                path: image,
                source,
            }),
        }
    }

    /// Moves the staged layer `staged` to `dest` inside the sandbox: a rename
    /// when both are on one file system, else a faithful copy (`cp -a`)
    /// whose source the caller removes afterwards. A layer larger than the
    /// sandbox's disk fails here with `ENOSPC`.
    pub async fn adopt(
        &self,
        spawner: &dyn Spawner,
        staged: &Path,
        dest: &Path,
    ) -> Result<(), RuntimeError> {
        match std::fs::rename(staged, dest) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {}
            Err(source) => {
                return Err(RuntimeError::CreateDir {
                    path: dest.to_path_buf(),
                    source,
                })
            }
        }
        let mut req = SpawnRequest::new(
            "cp",
            vec![
                "-a".into(),
                "--no-target-directory".into(),
                "--".into(),
                staged.display().to_string(),
                dest.display().to_string(),
            ],
        );
        // Bounded by the disk size, not by a command's usual runtime.
        req.timeout = self.timeout.max(Duration::from_secs(1800));
        let out = spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: "cp".into(),
                source,
            })?;
        if !out.success() {
            return Err(RuntimeError::InvokeRuntime {
                action: format!("copy staged layer {staged:?}"),
                detail: format!(
                    "exit {:?}: {}",
                    out.code,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(())
    }

    /// After a host reboot the sandbox dirs are empty mount points: mount
    /// their images again, so their layers come back for the reconciler
    /// (and for destroy). Images whose sandbox dir is gone are leftovers of
    /// an interrupted destroy and are removed. Best effort: failures are
    /// logged, and destroy cleans up what could not be mounted.
    fn recover(&self, state_dir: &Path) {
        let Ok(state_dev) = std::fs::metadata(state_dir).map(|m| m.dev()) else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(state_dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".img")) else {
                continue;
            };
            if id.parse::<aviary_core::SandboxId>().is_err() {
                continue;
            }
            let image = e.path();
            let root = state_dir.join(id);
            match std::fs::metadata(&root) {
                Ok(m) if m.dev() != state_dev => {} // mounted
                Ok(_) if self.enabled => {
                    if let Err(error) = mount_disk(&image, &root) {
                        tracing::warn!(sandbox.id = id, %error, "cannot mount sandbox disk again");
                    } else {
                        tracing::info!(sandbox.id = id, "mounted sandbox disk again");
                    }
                }
                Ok(_) => {
                    tracing::warn!(sandbox.id = id, "sandbox disk not mounted: quotas are off")
                }
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    let _ = std::fs::remove_file(&image);
                }
                Err(_) => {}
            }
        }
    }

    /// Checks end to end that a sandbox disk can be made, mounted, filled to
    /// `ENOSPC` and removed under `state_dir`.
    pub async fn probe(&self, spawner: &dyn Spawner, state_dir: &Path) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        if !Path::new("/dev/loop-control").exists() {
            return Err(
                "disk quotas need loop devices and /dev/loop-control is missing \
                 (modprobe loop), or set disk_quota = false"
                    .into(),
            );
        }
        let root = state_dir.join(format!(".probe-disk-{}", std::process::id()));
        let _ = std::fs::create_dir(&root);
        let result = async {
            // (the pool is not asked: a probe must not start one of its size)
            let mb = self.fs.min_disk_mb();
            self.attach_from(spawner, &root, mb, false)
                .await
                .map_err(|e| aviary_runtime::conformance::chain(&e))?;
            fill_until_full(&root.join("fill"), mb, self.fs)
        }
        .await;
        let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
        let _ = self.release(&root);
        let _ = std::fs::remove_dir_all(&root);
        result.map_err(|e| format!("sandbox disk quotas do not work in {state_dir:?}: {e}"))
    }
}

fn mkfs_args(fs: DiskFs, image: &Path) -> Vec<String> {
    if fs == DiskFs::Xfs {
        return vec![
            "-q".into(),
            "-f".into(),
            // reflinks for snapshot shadows
            "-m".into(),
            "reflink=1".into(),
            // 4 KiB blocks and sectors: the loop device's logical block size
            // is 4096 (direct I/O), and XFS refuses to mount a file system
            // with smaller sectors on it ("device supports 4096 byte sectors")
            "-b".into(),
            "size=4096".into(),
            "-s".into(),
            "size=4096".into(),
            // no discard of the (sparse) image file
            "-K".into(),
            image.display().to_string(),
        ];
    }
    vec![
        "-q".into(),
        "-F".into(),
        // 4 KiB blocks match the loop device's block size (direct I/O).
        "-b".into(),
        "4096".into(),
        // No blocks reserved for root: root inside is the tenant.
        "-m".into(),
        "0".into(),
        // Leave inode tables and journal unwritten: the image is sparse and
        // reads back zeros; this keeps mkfs at a few ms and a few MiB.
        "-E".into(),
        "lazy_itable_init=1,lazy_journal_init=1,nodiscard".into(),
        // No reserved GDT blocks for online growth (never resized): they
        // were 4 MiB of the 4.3 MiB mkfs writes for a 10 GiB disk.
        "-O".into(),
        "^resize_inode".into(),
        image.display().to_string(),
    ]
}

/// Copies `src` to the new file `dst` (same size) by its data extents only,
/// so holes stay holes.
pub(crate) fn copy_sparse(src: &Path, dst: &Path) -> io::Result<()> {
    copy_extents(src, dst, false)
}

/// [`copy_sparse`] that also leaves every all-zero 4 KiB block a hole.
fn copy_dropping_zeros(src: &Path, dst: &Path) -> io::Result<()> {
    copy_extents(src, dst, true)
}

fn copy_extents(src: &Path, dst: &Path, drop_zeros: bool) -> io::Result<()> {
    use nix::unistd::{lseek, Whence};
    let from = File::open(src)?;
    let len = i64::try_from(from.metadata()?.len()).map_err(io::Error::other)?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    to.set_len(u64::try_from(len).map_err(io::Error::other)?)?;
    let mut pos = 0i64;
    while pos < len {
        let data = match lseek(from.as_raw_fd(), pos, Whence::SeekData) {
            Ok(d) => d,
            Err(nix::errno::Errno::ENXIO) => break, // only a hole is left
            Err(e) => return Err(e.into()),
        };
        let hole = lseek(from.as_raw_fd(), data, Whence::SeekHole)?;
        // A formatted image has a few hundred KiB of data: plain reads and
        // writes are as fast as anything here.
        let mut buf = vec![0u8; usize::try_from(hole - data).map_err(io::Error::other)?];
        let at = u64::try_from(data).map_err(io::Error::other)?;
        from.read_exact_at(&mut buf, at)?;
        if drop_zeros {
            // `dst` reads zeros wherever nothing is written
            let mut off = 0u64;
            for block in buf.chunks(4096) {
                if block.iter().any(|&b| b != 0) {
                    to.write_all_at(block, at + off)?;
                }
                off += block.len() as u64;
            }
        } else {
            to.write_all_at(&buf, at)?;
        }
        pos = hole;
    }
    Ok(())
}

fn create_sparse(path: &Path, bytes: u64) -> io::Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.set_len(bytes)
}

/// Writes zeros to `file` until the file system of `disk_mb` MiB says it
/// is full; `Ok` only when that was `ENOSPC`. On XFS the space is asked for
/// with `fallocate` instead (real blocks reserved, none written: an XFS disk
/// is at least 300 MiB, too much to write at every start).
fn fill_until_full(file: &Path, disk_mb: u64, fs: DiskFs) -> Result<(), String> {
    use std::io::Write;
    let mut f = File::create(file).map_err(|e| format!("create {file:?}: {e}"))?;
    let block = vec![0u8; MIB as usize];
    if fs == DiskFs::Xfs {
        f.write_all(&block)
            .map_err(|e| format!("writing {file:?}: {e}"))?;
        let len = i64::try_from(disk_mb * 2 * MIB).map_err(|e| e.to_string())?;
        return match nix::fcntl::fallocate(
            f.as_raw_fd(),
            nix::fcntl::FallocateFlags::empty(),
            0,
            len,
        ) {
            Err(nix::errno::Errno::ENOSPC) => Ok(()),
            Err(e) => Err(format!("fallocate {file:?}: {e}")),
            Ok(()) => Err(format!("{} MiB fit on a {disk_mb} MiB disk", disk_mb * 2)),
        };
    }
    for _ in 0..(disk_mb * 2) {
        // ext4 reserves blocks at write(): a full disk fails the write itself.
        if let Err(e) = f.write_all(&block) {
            return if e.raw_os_error() == Some(libc::ENOSPC) {
                Ok(())
            } else {
                Err(format!("writing {file:?}: {e}"))
            };
        }
    }
    Err(format!("{} MiB fit on a {disk_mb} MiB disk", disk_mb * 2))
}

// <linux/loop.h>
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// The file system an image holds, by its superblock's magic (XFS: `XFSB`
/// at byte 0; anything else is taken for ext4, whose mount checks its own).
fn image_fs(image: &File) -> io::Result<DiskFs> {
    let mut magic = [0u8; 4];
    image.read_exact_at(&mut magic, 0)?;
    Ok(if &magic == b"XFSB" {
        DiskFs::Xfs
    } else {
        DiskFs::Ext4
    })
}

/// Attaches `image` to a free loop device (auto-clear, direct I/O, 4 KiB
/// blocks) and mounts its file system (ext4 or XFS, by its superblock) at
/// `target`. The device fd is closed on return; the mount keeps the
/// device, and unmounting frees it.
pub(crate) fn mount_disk(image: &Path, target: &Path) -> io::Result<()> {
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(image)?;
    let (fstype, options) = match image_fs(&backing)? {
        // noinit_itable: no background zeroing of the inode tables (the
        // image is sparse, they read back as zeros anyway).
        DiskFs::Ext4 => ("ext4", "discard,noinit_itable"),
        // nouuid: every disk is a copy of one golden image, and XFS
        // refuses a second mount of a UUID otherwise.
        DiskFs::Xfs => ("xfs", "discard,nouuid"),
    };
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")?;
    let mut name = [0u8; 64];
    let bytes = image.as_os_str().as_encoded_bytes();
    let n = bytes.len().min(name.len() - 1);
    name[..n].copy_from_slice(&bytes[..n]);
    let config = LoopConfig {
        fd: u32::try_from(backing.as_raw_fd()).map_err(io::Error::other)?,
        block_size: 4096,
        info: LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
            lo_file_name: name,
            lo_crypt_name: [0; 64],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        },
        reserved: [0; 8],
    };
    // Another process may take the free device between the two ioctls.
    for _ in 0..32 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and only returns a
        // device number; `control` is an open fd for the duration of the call.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(io::Error::last_os_error());
        }
        let device_path = PathBuf::from(format!("/dev/loop{number}"));
        let device = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&device_path)?;
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which
        // `LoopConfig` mirrors field for field (`#[repr(C)]`, size checked in
        // the tests); the pointer is valid for the call and the kernel does
        // not keep it. `device` and `backing` are open fds.
        let rc = unsafe {
            libc::ioctl(
                device.as_raw_fd(),
                LOOP_CONFIGURE,
                &config as *const LoopConfig,
            )
        };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EBUSY) {
                continue;
            }
            return Err(err);
        }
        // The device fd is closed on return either way; with auto-clear
        // the device is released as soon as nothing holds it (here: when
        // the mount fails, or later when it is unmounted).
        return nix::mount::mount(
            Some(&device_path),
            target,
            Some(fstype),
            nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOSUID,
            Some(options),
        )
        .map_err(io::Error::from);
    }
    Err(io::Error::other("no free loop device after 32 tries"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_runtime::{RecordingSpawner, SpawnOutput};

    #[test]
    fn loop_config_matches_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn image_sits_beside_the_sandbox_dir() {
        assert_eq!(
            disk_image(Path::new("/s/sbx-abc")),
            PathBuf::from("/s/sbx-abc.img")
        );
    }

    #[tokio::test]
    async fn too_small_disks_are_refused_before_any_work() {
        let dir = tempfile::tempdir().unwrap();
        let spawner = RecordingSpawner::new();
        let disks = SandboxDisks::open(dir.path(), true, Duration::from_secs(5)).unwrap();
        let root = dir.path().join("sbx");
        let err = disks.attach(&spawner, &root, 8).await.unwrap_err();
        assert!(matches!(err, RuntimeError::InvalidSpec { .. }), "{err:?}");
        assert!(spawner.requests().is_empty());
        assert!(!disk_image(&root).exists());
    }

    #[tokio::test]
    async fn mkfs_failure_is_reported_with_its_stderr_and_leaves_no_image() {
        let dir = tempfile::tempdir().unwrap();
        let spawner = RecordingSpawner::new();
        spawner.push(Ok(SpawnOutput::failed(1, "bad blocks")));
        let disks = SandboxDisks::open(dir.path(), true, Duration::from_secs(5)).unwrap();
        let root = dir.path().join("sbx");
        let err = disks.attach(&spawner, &root, 64).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "mkfs.ext4 failed: exit Some(1): bad blocks"
        );
        let req = &spawner.requests()[0];
        assert_eq!(req.program, PathBuf::from("mkfs.ext4"));
        assert!(req.args.contains(&"^resize_inode".to_string()));
        let formatted = PathBuf::from(req.args.last().unwrap());
        assert_eq!(formatted.parent().unwrap(), dir.path().join(".disks"));
        assert!(!formatted.exists(), "half-made golden image removed");
        assert!(!disk_image(&root).exists());
        assert_eq!(
            std::fs::read_dir(dir.path().join(".disks"))
                .unwrap()
                .count(),
            0
        );
        disks.release(&root).unwrap();
    }

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        create_sparse(&src, 64 * MIB).unwrap();
        let f = OpenOptions::new().write(true).open(&src).unwrap();
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(&vec![9u8; 100_000], 40 * MIB).unwrap();
        copy_sparse(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let m = std::fs::metadata(&dst).unwrap();
        assert_eq!(m.len(), 64 * MIB);
        assert!(m.blocks() * 512 < MIB, "holes stay holes: {}", m.blocks());
        assert_eq!(
            copy_sparse(&src, &dst).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
    }

    #[tokio::test]
    async fn disabled_disks_do_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let spawner = RecordingSpawner::new();
        let disks = SandboxDisks::open(dir.path(), false, Duration::from_secs(5)).unwrap();
        disks.attach(&spawner, dir.path(), 1).await.unwrap();
        assert!(spawner.requests().is_empty());
        disks.probe(&spawner, dir.path()).await.unwrap();
    }

    #[tokio::test]
    async fn adopt_renames_on_one_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let spawner = RecordingSpawner::new();
        let disks = SandboxDisks::open(dir.path(), true, Duration::from_secs(5)).unwrap();
        let (staged, dest) = (dir.path().join("seed"), dir.path().join("upper"));
        std::fs::create_dir(&staged).unwrap();
        std::fs::write(staged.join("f"), "x").unwrap();
        disks.adopt(&spawner, &staged, &dest).await.unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("f")).unwrap(), "x");
        assert!(spawner.requests().is_empty(), "no copy needed");
    }
}
