//! User namespaces: root in a sandbox is an unprivileged id range on the host.
//!
//! Every sandbox gets **its own** range of 65,536 host ids (a *slot* of an
//! [`IdPool`], by default host ids `0x4000_0000 + slot × 65,536`); container
//! id `n` is host id `first + n`. Its files on the host (overlay `upper/`,
//! `workspace/`, `control/`) are owned by that range, so a setuid binary or a
//! file left by the sandbox is never a host-root file, and no two live
//! sandboxes share a uid.
//!
//! Why one range per sandbox rather than one shared range: the kernel keeps
//! some per-*host-uid* budgets that user and PID namespaces do not split —
//! epoll watches (`fs.epoll.max_user_watches`), pipe buffer pages
//! (`fs.pipe-user-pages-soft`), locked-memory accounting of io_uring/perf
//! (`user_struct`) — so with one shared range one tenant could exhaust them
//! for every other tenant. Distinct ranges also keep defence in depth for a
//! mount-namespace escape: another sandbox's files and processes belong to
//! a different uid. The price is a per-sandbox idmapped view of the template
//! (below: three syscalls, a short-lived helper and one detach —
//! measured 0.4–1.3 ms median per create on the 2-core test VM, mostly the
//! detach's RCU grace period; a whole crun create, 26–29 ms with the disk
//! image, shows no difference above noise, `tests/userns.rs`
//! `create_cost_side_by_side`) and an ownership
//! shift when a snapshot of one sandbox seeds another (files are chowned
//! once at adoption, [`shift_tree`]).
//!
//! The template is shared, read-only and owned by host uid 0, which the
//! sandbox's namespace does not map. Rather than copying or chowning it, each
//! sandbox mounts an **idmapped** clone of it (`open_tree(OPEN_TREE_CLONE)` +
//! `mount_setattr(MOUNT_ATTR_IDMAP)` + `move_mount`) at `<sandbox>/idmapped-lower` and
//! uses that as the overlay's lower layer (overlayfs accepts idmapped layers
//! since Linux 5.19). Through it, template uid `n` reads as host `first + n`;
//! copy-up therefore creates upper files owned by the sandbox's range, and the
//! template on disk is never touched. The overlay keeps a private clone of
//! each layer, so that mount is detached right after the
//! overlay is up ([`detach_lower`]): no idmapped mount outlives a create.
//!
//! Slots are claimed under an `flock` of the id dir (the runtime's state dir,
//! or one several runtimes of a host share, `OciConfig::id_dir`): a marker
//! file `<id dir>/userns/<sandbox-id>` holds the range's first host id and,
//! on a second line, the state dir of the runtime that claimed it (a marker
//! without one is the id dir's own runtime's). A slot is released by
//! `destroy` only once the sandbox's directory **and** its cgroups are gone
//! (its processes are dead), and a claim reclaims markers of sandboxes for
//! which both are gone (a crash between removal and release), looking in
//! the state dir the marker names, so runtimes sharing an id dir never hand
//! out one range twice. Ranges are reused lowest-first.
//!
//! Snapshots record host ids. Seeded layers and in-place restores are shifted
//! into the sandbox's range by taking every id modulo 65,536 (slots are
//! 65,536-aligned, so this is the container id; files a pre-userns snapshot
//! recorded as host root become container root).
//!
//! This module holds `unsafe` for the `clone`, `open_tree`,
//! `mount_setattr` and `move_mount` system calls, each with a SAFETY note.

use aviary_core::SandboxId;
use aviary_runtime::RuntimeError;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Ids per sandbox: the whole 16-bit id space a distribution expects
/// (`nobody` is 65534).
pub const RANGE_SIZE: u32 = 65_536;

/// The host ids sandboxes are given: `slots` ranges of [`RANGE_SIZE`] ids
/// from `first` (a multiple of [`RANGE_SIZE`], at least [`RANGE_SIZE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdPool {
    pub first: u32,
    pub slots: u32,
}

impl Default for IdPool {
    /// Host ids 0x4000_0000..0x5000_0000 (4,096 sandboxes): far above login
    /// users and the usual `/etc/subuid` ranges (100000 + n × 65536).
    fn default() -> Self {
        IdPool {
            first: 0x4000_0000,
            slots: 4096,
        }
    }
}

impl IdPool {
    fn validate(&self) -> Result<(), RuntimeError> {
        let end = u64::from(self.first) + u64::from(self.slots) * u64::from(RANGE_SIZE);
        if self.first < RANGE_SIZE
            || !self.first.is_multiple_of(RANGE_SIZE)
            || self.slots == 0
            || end > u64::from(u32::MAX)
        {
            return Err(RuntimeError::InvalidSpec {
                reason: format!(
                    "user-id pool {self:?} must start at a non-zero multiple of {RANGE_SIZE} and end below 2^32-1"
                ),
            });
        }
        Ok(())
    }

    fn range(&self, slot: u32) -> IdRange {
        IdRange {
            host_first: self.first + slot * RANGE_SIZE,
        }
    }
}

/// One sandbox's ids: container `0..65536` is host `host_first..+65536`,
/// for uids and gids alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdRange {
    pub host_first: u32,
}

impl IdRange {
    /// The host id of container id `id` (taken modulo [`RANGE_SIZE`]).
    pub fn host(&self, id: u32) -> u32 {
        self.host_first + id % RANGE_SIZE
    }

    /// `/proc/<pid>/{uid,gid}_map` text.
    fn map_line(&self) -> String {
        format!("0 {} {}\n", self.host_first, RANGE_SIZE)
    }
}

fn marker_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("userns")
}

/// Holds an exclusive `flock` on the state dir while alive.
fn lock_state_dir(state_dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, RuntimeError> {
    let dir = std::fs::File::open(state_dir).map_err(|source| RuntimeError::ReadFile {
        path: state_dir.to_path_buf(),
        source,
    })?;
    nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| {
        RuntimeError::ReadFile {
            path: state_dir.to_path_buf(),
            source: e.into(),
        }
    })
}

/// The range recorded for `id`, if it holds one.
pub fn range_of(id_dir: &Path, id: &SandboxId) -> Option<IdRange> {
    marker(id_dir, id).map(|(range, _)| range)
}

/// `id`'s range and the state dir of the runtime that claimed it.
fn marker(id_dir: &Path, id: &SandboxId) -> Option<(IdRange, PathBuf)> {
    let text = std::fs::read_to_string(marker_dir(id_dir).join(id.as_str())).ok()?;
    let mut lines = text.lines();
    let range = IdRange {
        host_first: lines.next()?.trim().parse().ok()?,
    };
    let owner = match lines.next().map(str::trim).filter(|l| !l.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => id_dir.to_path_buf(),
    };
    Some((range, owner))
}

/// Claims a free range in `id_dir` for `id` of the runtime whose state dir
/// is `owner` (or returns the one it already holds). `in_use(other, its
/// owner's state dir)` tells whether a sandbox whose marker is found may
/// still have files or processes; markers of sandboxes for which it is
/// false are reclaimed.
pub fn claim(
    id_dir: &Path,
    owner: &Path,
    pool: &IdPool,
    id: &SandboxId,
    in_use: &dyn Fn(&SandboxId, &Path) -> bool,
) -> Result<IdRange, RuntimeError> {
    pool.validate()?;
    let _lock = lock_state_dir(id_dir)?;
    if let Some(r) = range_of(id_dir, id) {
        return Ok(r);
    }
    let dir = marker_dir(id_dir);
    std::fs::create_dir_all(&dir).map_err(|source| RuntimeError::CreateDir {
        path: dir.clone(),
        source,
    })?;
    let mut taken = std::collections::HashSet::new();
    let entries = std::fs::read_dir(&dir).map_err(|source| RuntimeError::ReadFile {
        path: dir.clone(),
        source,
    })?;
    for e in entries.flatten() {
        let Some(other) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<SandboxId>().ok())
        else {
            continue;
        };
        let Some((r, other_owner)) = marker(id_dir, &other) else {
            continue;
        };
        if !in_use(&other, &other_owner) {
            let _ = std::fs::remove_file(e.path());
            continue;
        }
        taken.insert(r.host_first);
    }
    let range = (0..pool.slots)
        .map(|s| pool.range(s))
        .find(|r| !taken.contains(&r.host_first))
        .ok_or_else(|| RuntimeError::CapacityExhausted {
            what: format!("all {} user-id ranges are in use", pool.slots),
        })?;
    let marker = dir.join(id.as_str());
    let text = format!("{}\n{}\n", range.host_first, owner.display());
    std::fs::write(&marker, text).map_err(|source| RuntimeError::WriteFile {
        path: marker,
        source,
    })?;
    Ok(range)
}

/// Gives `id`'s range back unless `in_use(id, owner)` (files or processes
/// may remain; a later claim reclaims it once they are gone). Removes the
/// marker dir when it empties, so an idle state dir looks as it did before.
pub fn release(
    id_dir: &Path,
    owner: &Path,
    id: &SandboxId,
    in_use: &dyn Fn(&SandboxId, &Path) -> bool,
) -> Result<(), RuntimeError> {
    let dir = marker_dir(id_dir);
    if !dir.exists() || in_use(id, owner) {
        return Ok(());
    }
    let _lock = lock_state_dir(id_dir)?;
    let marker = dir.join(id.as_str());
    match std::fs::remove_file(&marker) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(RuntimeError::RemoveDir {
                path: marker,
                source,
            })
        }
    }
    // ENOTEMPTY: other sandboxes hold ranges.
    let _ = std::fs::remove_dir(&dir);
    Ok(())
}

/// Chowns every entry of `root` (not following symlinks) into `range`, each
/// id taken modulo [`RANGE_SIZE`], restoring setuid/setgid bits the chown
/// clears. Entries already in `range` are left alone, so the cost of an
/// empty or already-shifted tree is one `lstat` per entry.
pub fn shift_tree(root: &Path, range: IdRange) -> Result<(), RuntimeError> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = match std::fs::symlink_metadata(&p) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(RuntimeError::ReadFile { path: p, source }),
        };
        let (uid, gid) = (range.host(md.uid()), range.host(md.gid()));
        if (uid, gid) != (md.uid(), md.gid()) {
            std::os::unix::fs::lchown(&p, Some(uid), Some(gid)).map_err(|source| {
                RuntimeError::WriteFile {
                    path: p.clone(),
                    source,
                }
            })?;
            if !md.file_type().is_symlink() && md.mode() & 0o6000 != 0 {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(md.mode() & 0o7777))
                    .map_err(|source| RuntimeError::WriteFile {
                    path: p.clone(),
                    source,
                })?;
            }
        }
        if md.is_dir() {
            let rd = std::fs::read_dir(&p).map_err(|source| RuntimeError::ReadFile {
                path: p.clone(),
                source,
            })?;
            stack.extend(rd.flatten().map(|e| e.path()));
        }
    }
    Ok(())
}

/// Shifts a tree the host wrote for sandbox `id` (e.g. a workspace restored
/// in place) into its range. A no-op for sandboxes without a user namespace.
pub fn shift_into(id_dir: &Path, id: &SandboxId, root: &Path) -> Result<(), RuntimeError> {
    match range_of(id_dir, id) {
        Some(range) => shift_tree(root, range),
        None => Ok(()),
    }
}

// Mount API constants (include/uapi/linux/mount.h), stable kernel ABI.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x10_0000;

/// `struct mount_attr` (MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Body of the helper that holds a fresh user namespace open until we have
/// its fd: blocks every signal and sleeps until SIGKILL.
extern "C" fn park(_: *mut libc::c_void) -> libc::c_int {
    // SAFETY: runs on the helper's own stack and only makes async-signal-safe
    // calls on a local sigset; with every signal blocked `pause` never
    // returns, so nothing after it (and no errno write) ever happens.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        loop {
            libc::pause();
        }
    }
}

/// A user namespace with `range`'s mapping, as an fd, for `MOUNT_ATTR_IDMAP`.
///
/// A helper is cloned straight into a new user namespace (sharing our
/// memory, so nothing is copied: ~0.1 ms instead of a fork's page tables),
/// gets its maps written by us (host root), and is killed once
/// `/proc/<pid>/ns/user` is open; the fd keeps the namespace alive.
fn userns_fd(range: IdRange) -> io::Result<OwnedFd> {
    const STACK: usize = 64 * 1024;
    let mut stack = vec![0u8; STACK];
    // SAFETY: `park` needs no argument and runs on `stack`, which outlives
    // the helper (it is reaped below before `stack` is dropped); `top` is
    // the 16-byte-aligned end of that allocation, as clone(2) wants.
    let pid = unsafe {
        let top = stack.as_mut_ptr().add(STACK);
        let top = top.sub(top as usize % 16);
        libc::clone(
            park,
            top.cast(),
            libc::CLONE_NEWUSER | libc::CLONE_VM | libc::SIGCHLD,
            std::ptr::null_mut(),
        )
    };
    if pid < 0 {
        return Err(with_op("clone(CLONE_NEWUSER)", io::Error::last_os_error()));
    }
    let opened = (|| {
        let map = range.map_line();
        std::fs::write(format!("/proc/{pid}/uid_map"), &map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map)?;
        Ok(OwnedFd::from(std::fs::File::open(format!(
            "/proc/{pid}/ns/user"
        ))?))
    })();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    while let Err(nix::errno::Errno::EINTR) =
        nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None)
    {}
    drop(stack);
    opened
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// Mounts a read-only clone of `source` at `target` (an existing empty dir)
/// whose ids read shifted into `range`.
fn mount_idmapped(source: &Path, target: &Path, range: IdRange) -> io::Result<()> {
    let userns = userns_fd(range)?;
    let (src, dst) = (cpath(source)?, cpath(target)?);
    // SAFETY: open_tree takes a valid NUL-terminated path and flags; the
    // returned fd (checked below) is owned by nothing else yet.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(with_op("open_tree", io::Error::last_os_error()));
    }
    let fd = libc::c_int::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: `fd` was just returned by open_tree and is not owned elsewhere.
    let tree = unsafe { OwnedFd::from_raw_fd(fd) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: `tree` is a detached mount fd, the empty path with AT_EMPTY_PATH
    // names it, and `attr` is a live, correctly sized struct mount_attr.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(with_op(
            "mount_setattr(MOUNT_ATTR_IDMAP)",
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: moves the detached mount named by `tree` onto the valid,
    // NUL-terminated `dst`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(with_op("move_mount", io::Error::last_os_error()));
    }
    Ok(())
}

fn with_op(op: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{op}: {e}"))
}

/// Where the idmapped template view of a sandbox is mounted while its
/// overlay is built.
pub fn lower_dir(sandbox_root: &Path) -> PathBuf {
    sandbox_root.join("idmapped-lower")
}

/// Prepares a sandbox's host side for running in `range`: shifts the
/// writable trees (`upper`, `workspace`: adopted seeds included) into the
/// range, lets only the range's root group (and host root) pass through the
/// sandbox dir, and mounts the idmapped template view at [`lower_dir`].
/// Returns that lower dir, to be given to the overlay and then
/// [`detach_lower`]ed.
///
/// crun and runc resolve the rootfs and the bind sources from inside the new
/// user namespace, as the range's root: every ancestor of the sandbox dir must
/// be searchable by it. A state dir below a mode-0700 directory is refused
/// here with the directory named, rather than by the runtime's bare EACCES.
pub fn prepare_sandbox(
    sandbox_root: &Path,
    template: &Path,
    owned_trees: &[PathBuf],
    range: IdRange,
) -> Result<PathBuf, RuntimeError> {
    check_searchable_ancestors(sandbox_root)?;
    // root:<range root group> 0710: the sandbox's runtime can reach its
    // rootfs and workspace; other host users (and other ranges) cannot.
    std::os::unix::fs::lchown(sandbox_root, Some(0), Some(range.host_first))
        .and_then(|()| {
            std::fs::set_permissions(sandbox_root, std::fs::Permissions::from_mode(0o710))
        })
        .map_err(|source| RuntimeError::WriteFile {
            path: sandbox_root.to_path_buf(),
            source,
        })?;
    for t in owned_trees {
        shift_tree(t, range)?;
    }
    let lower = lower_dir(sandbox_root);
    std::fs::create_dir(&lower).map_err(|source| RuntimeError::CreateDir {
        path: lower.clone(),
        source,
    })?;
    mount_idmapped(template, &lower, range).map_err(|source| RuntimeError::MountOverlay {
        path: lower.clone(),
        source,
    })?;
    Ok(lower)
}

/// Every ancestor of `dir` grants search (x) to others.
fn check_searchable_ancestors(dir: &Path) -> Result<(), RuntimeError> {
    for a in dir.ancestors().skip(1) {
        let md = std::fs::metadata(a).map_err(|source| RuntimeError::ReadFile {
            path: a.to_path_buf(),
            source,
        })?;
        if md.mode() & 0o001 == 0 {
            return Err(RuntimeError::InvalidSpec {
                reason: format!(
                    "{a:?} (mode {:o}) is not searchable by unprivileged users; sandboxes run in \
                     user namespaces and their runtime must reach {dir:?} from there \
                     (make it 0711: search without listing)",
                    md.mode() & 0o7777
                ),
            });
        }
    }
    Ok(())
}

/// Detaches the idmapped template view once the overlay holds its own
/// private clone of it, and removes the mount point.
pub fn detach_lower(sandbox_root: &Path) -> Result<(), RuntimeError> {
    let lower = lower_dir(sandbox_root);
    nix::mount::umount2(&lower, nix::mount::MntFlags::MNT_DETACH).map_err(|e| {
        RuntimeError::Unmount {
            path: lower.clone(),
            source: e.into(),
        }
    })?;
    let _ = std::fs::remove_dir(&lower);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_slots_are_aligned_and_bounded() {
        let pool = IdPool::default();
        pool.validate().unwrap();
        assert_eq!(pool.range(0).host_first, 0x4000_0000);
        assert_eq!(pool.range(3).host_first, 0x4000_0000 + 3 * 65_536);
        for bad in [
            IdPool { first: 0, slots: 1 },
            IdPool {
                first: 100_000,
                slots: 1,
            },
            IdPool {
                first: 0xFFFF_0000,
                slots: 1,
            },
            IdPool {
                first: 65_536,
                slots: 0,
            },
        ] {
            bad.validate().unwrap_err();
        }
    }

    #[test]
    fn ids_shift_modulo_the_range() {
        let r = IdRange {
            host_first: 0x4001_0000,
        };
        assert_eq!(r.host(0), 0x4001_0000);
        assert_eq!(r.host(33), 0x4001_0021);
        // A snapshot taken in another slot lands on the same container ids.
        assert_eq!(r.host(0x4005_0000 + 1000), 0x4001_0000 + 1000);
        assert_eq!(r.map_line(), format!("0 {} 65536\n", 0x4001_0000u32));
    }

    #[test]
    fn claims_are_distinct_reused_and_released() {
        let dir = tempfile::tempdir().unwrap();
        let pool = IdPool {
            first: 65_536,
            slots: 2,
        };
        let live = std::sync::Mutex::new(std::collections::HashSet::<SandboxId>::new());
        let in_use = |id: &SandboxId, _: &Path| live.lock().unwrap().contains(id);
        let me = dir.path();
        let (a, b, c) = (
            SandboxId::generate(),
            SandboxId::generate(),
            SandboxId::generate(),
        );
        for id in [&a, &b, &c] {
            live.lock().unwrap().insert(id.clone());
        }
        let ra = claim(dir.path(), me, &pool, &a, &in_use).unwrap();
        let rb = claim(dir.path(), me, &pool, &b, &in_use).unwrap();
        assert_ne!(ra, rb);
        assert_eq!(
            claim(dir.path(), me, &pool, &a, &in_use).unwrap(),
            ra,
            "idempotent"
        );
        assert!(
            claim(dir.path(), me, &pool, &c, &in_use).is_err(),
            "pool exhausted"
        );
        // Still in use (files or processes left): release keeps the range.
        release(dir.path(), me, &a, &in_use).unwrap();
        assert_eq!(range_of(dir.path(), &a), Some(ra));
        live.lock().unwrap().remove(&a);
        release(dir.path(), me, &a, &in_use).unwrap();
        assert_eq!(range_of(dir.path(), &a), None);
        assert_eq!(claim(dir.path(), me, &pool, &c, &in_use).unwrap(), ra);
        // A crash left b's marker behind: reclaimed once b is gone.
        live.lock().unwrap().remove(&b);
        live.lock().unwrap().remove(&c);
        let d = SandboxId::generate();
        live.lock().unwrap().insert(d.clone());
        assert_eq!(claim(dir.path(), me, &pool, &d, &in_use).unwrap(), ra);
        live.lock().unwrap().clear();
        release(dir.path(), me, &d, &in_use).unwrap();
        assert!(
            !dir.path().join("userns").exists(),
            "empty marker dir removed"
        );
    }

    /// Two runtimes share one id dir: a marker is reclaimed only when the
    /// sandbox's files are gone from the state dir of the runtime that
    /// claimed it, never because the other runtime does not have them.
    #[test]
    fn runtimes_sharing_an_id_dir_never_share_a_range() {
        let ids = tempfile::tempdir().unwrap();
        let crun = ids.path().join("crun");
        let runc = ids.path().join("runc");
        let pool = IdPool {
            first: 65_536,
            slots: 4,
        };
        // the state dir a marker names is asked, as the runtimes do
        let in_use = |id: &SandboxId, owner: &Path| owner.join(id.as_str()).exists();
        let (a, b) = (SandboxId::generate(), SandboxId::generate());
        std::fs::create_dir_all(crun.join(a.as_str())).unwrap();
        std::fs::create_dir_all(runc.join(b.as_str())).unwrap();
        let ra = claim(ids.path(), &crun, &pool, &a, &in_use).unwrap();
        let rb = claim(ids.path(), &runc, &pool, &b, &in_use).unwrap();
        assert_ne!(ra, rb, "b's claim saw a's marker as crun's, still in use");
        let c = SandboxId::generate();
        std::fs::create_dir_all(crun.join(c.as_str())).unwrap();
        let rc = claim(ids.path(), &crun, &pool, &c, &in_use).unwrap();
        assert!(rc != ra && rc != rb, "crun's claim kept runc's range");
        // once b's files are gone from runc's dir, its range is free again
        std::fs::remove_dir(runc.join(b.as_str())).unwrap();
        let d = SandboxId::generate();
        std::fs::create_dir_all(crun.join(d.as_str())).unwrap();
        assert_eq!(claim(ids.path(), &crun, &pool, &d, &in_use).unwrap(), rb);
        // a marker written before owners were recorded is the id dir's own
        let legacy = SandboxId::generate();
        std::fs::write(
            ids.path().join("userns").join(legacy.as_str()),
            format!("{}\n", 65_536 * 4),
        )
        .unwrap();
        assert_eq!(
            marker(ids.path(), &legacy).unwrap().1,
            ids.path().to_path_buf()
        );
    }

    #[test]
    fn shift_tree_keeps_setuid_and_skips_symlink_targets() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!(
                "SKIP shift_tree_keeps_setuid_and_skips_symlink_targets: needs root to chown"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "x").unwrap();
        let root = dir.path().join("tree");
        std::fs::create_dir_all(root.join("d")).unwrap();
        std::fs::write(root.join("d/suid"), "x").unwrap();
        std::fs::set_permissions(root.join("d/suid"), std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let r = IdRange {
            host_first: 0x4002_0000,
        };
        shift_tree(&root, r).unwrap();
        for p in [
            root.clone(),
            root.join("d"),
            root.join("d/suid"),
            root.join("link"),
        ] {
            let md = std::fs::symlink_metadata(&p).unwrap();
            assert_eq!((md.uid(), md.gid()), (0x4002_0000, 0x4002_0000), "{p:?}");
        }
        let suid = std::fs::metadata(root.join("d/suid")).unwrap();
        assert_eq!(suid.mode() & 0o7777, 0o4755);
        assert_eq!(
            std::fs::metadata(&outside).unwrap().uid(),
            0,
            "symlink not followed"
        );
    }
}
