//! File operations confined to the sandbox root.
//!
//! Invariants: a request path is normalised lexically first (absolute, `..`
//! never climbs above `/`), then resolved *relative to the root directory
//! descriptor* with chroot semantics: symlinks are followed inside the root, an
//! absolute symlink target or a `..` at the root stays at the root, so no path
//! ever reaches a file outside it. On Linux ≥ 5.6 the kernel does this
//! (`openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`); otherwise a userspace
//! resolver walks component by component with `O_PATH | O_NOFOLLOW` descriptors,
//! expanding symlinks itself (at most 40) so the walk cannot leave the root
//! either. The final component of mutating calls is handled with `*at` calls on
//! the parent descriptor and is never followed (a write replaces a symlink, a
//! remove deletes it, a stat describes it).
//!
//! Inside a sandbox the root is `/` and this is exactly what the sandboxed
//! processes see; with `--root DIR` (tests) it confines the file API to DIR.
//!
//! Only regular files are read or replaced: a FIFO, socket or device could
//! block a reader (or writer) forever and pin one of envd's connections, so it
//! is refused at once with `NotRegularFile`. Reads open with `O_NONBLOCK` (an
//! open of a FIFO without a writer returns at once) and `O_NOCTTY`, check the
//! open descriptor with `fstat`, and only then switch back to blocking I/O.
//!
//! Writes are staged ([`SandboxFs::stage_write`]): the content goes to a
//! temporary file, and [`StagedWrite::commit`] publishes it with one rename, so
//! the caller can re-check the lease fence right before the write lands.
//!
//! Concurrency: stateless apart from the root descriptor; safe from any thread.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use aviary_envd_proto::{
    join_components, normalize_path, ErrorBody, ErrorCode, FileKind, FileStat,
};

use crate::sys::{self, Stat};

const MAX_SYMLINKS: usize = 40;

/// A failed file operation, already in wire form.
pub type FsResult<T> = Result<T, ErrorBody>;

fn err(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code,
        message: message.into(),
    }
}

/// Maps an errno from a file operation on `path` to a wire error.
pub fn map_io(path: &str, e: &io::Error) -> ErrorBody {
    let code = match e.raw_os_error() {
        Some(libc::ENOENT) => ErrorCode::NotFound,
        Some(libc::EEXIST) => ErrorCode::AlreadyExists,
        Some(libc::ENOTEMPTY) => ErrorCode::NotEmpty,
        // EBUSY/ETXTBSY: the target is a mount point (e.g. the read-only bind
        // of envd itself) or a running binary.
        Some(libc::EACCES | libc::EPERM | libc::EROFS | libc::EBUSY | libc::ETXTBSY) => {
            ErrorCode::PermissionDenied
        }
        Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => ErrorCode::NoSpace,
        Some(
            libc::EXDEV
            | libc::ELOOP
            | libc::ENOTDIR
            | libc::EISDIR
            | libc::ENAMETOOLONG
            | libc::EINVAL,
        ) => ErrorCode::InvalidPath,
        _ => ErrorCode::Internal,
    };
    err(code, format!("{path}: {e}"))
}

fn parse(path: &str) -> FsResult<Vec<String>> {
    normalize_path(path).map_err(|e| err(ErrorCode::InvalidPath, format!("{path}: {e}")))
}

fn stat_to_wire(name: String, path: String, st: &Stat) -> FileStat {
    let kind = if st.is_file() {
        FileKind::File
    } else if st.is_dir() {
        FileKind::Dir
    } else if st.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    FileStat {
        name,
        path,
        kind,
        size: st.size,
        mode: st.mode & 0o7777,
        modified_unix: st.mtime,
    }
}

/// The sandbox's file system, seen through its root directory descriptor.
pub struct SandboxFs {
    root: OwnedFd,
    use_openat2: AtomicBool,
    tmp_counter: AtomicU64,
}

impl SandboxFs {
    /// Opens `root`. `allow_openat2 = false` forces the userspace resolver.
    pub fn open(root: &Path, allow_openat2: bool) -> io::Result<SandboxFs> {
        let root = File::open(root)?;
        if !root.metadata()?.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        Ok(SandboxFs {
            root: root.into(),
            use_openat2: AtomicBool::new(allow_openat2),
            tmp_counter: AtomicU64::new(0),
        })
    }

    /// Opens the object at `comps` (following symlinks inside the root) with `flags`.
    fn resolve(&self, comps: &[String], flags: libc::c_int) -> io::Result<OwnedFd> {
        if self.use_openat2.load(Ordering::Relaxed) {
            let rel = if comps.is_empty() {
                ".".to_owned()
            } else {
                comps.join("/")
            };
            match sys::openat2(
                self.root.as_fd(),
                &rel,
                flags,
                sys::RESOLVE_IN_ROOT | sys::RESOLVE_NO_MAGICLINKS,
            ) {
                // Old kernel, or a seccomp filter that hides the syscall.
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    self.use_openat2.store(false, Ordering::Relaxed);
                }
                r => return r,
            }
        }
        self.resolve_userspace(comps, flags)
    }

    fn resolve_userspace(&self, comps: &[String], flags: libc::c_int) -> io::Result<OwnedFd> {
        // `stack` holds the directories walked so far; `..` pops, never below the root.
        let mut stack: Vec<OwnedFd> = vec![sys::openat(
            self.root.as_fd(),
            ".",
            libc::O_PATH | libc::O_DIRECTORY,
            0,
        )?];
        let mut queue: VecDeque<String> = comps.iter().cloned().collect();
        let mut links = 0;
        while let Some(c) = queue.pop_front() {
            if c.is_empty() || c == "." {
                continue;
            }
            if c == ".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            let cur = stack
                .last()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
            let fd = sys::openat(cur.as_fd(), &c, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
            let st = sys::fstatat(fd.as_fd(), "")?;
            if st.is_symlink() {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                // Read the link through the descriptor we hold: no race with a rename.
                let target = sys::readlink_fd(fd.as_fd())?;
                let target = String::from_utf8(target)
                    .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
                if target.starts_with('/') {
                    stack.truncate(1);
                }
                for part in target.split('/').rev() {
                    queue.push_front(part.to_owned());
                }
                continue;
            }
            if queue.is_empty() {
                // Final component, not a symlink: reopen with the requested flags,
                // refusing it if it was swapped for a symlink in the meantime.
                return sys::openat(cur.as_fd(), &c, flags | libc::O_NOFOLLOW, 0);
            }
            if !st.is_dir() {
                return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
            }
            stack.push(fd);
        }
        let top = stack
            .last()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        sys::openat(top.as_fd(), ".", flags, 0)
    }

    /// Opens the parent directory of `comps` and returns it with the final name.
    fn resolve_parent(&self, path: &str, comps: &[String]) -> FsResult<(OwnedFd, String)> {
        let Some((name, parent)) = comps.split_last() else {
            return Err(err(
                ErrorCode::InvalidPath,
                format!("{path}: is the sandbox root"),
            ));
        };
        let dir = self
            .resolve(parent, libc::O_PATH | libc::O_DIRECTORY)
            .map_err(|e| map_io(path, &e))?;
        Ok((dir, name.clone()))
    }

    /// Opens a regular file for reading; returns it with its size. Anything
    /// else is refused without blocking (see the module docs).
    pub fn open_read(&self, path: &str) -> FsResult<(File, u64)> {
        let comps = parse(path)?;
        let fd = self
            .resolve(&comps, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY)
            .map_err(|e| match e.raw_os_error() {
                // open(2) of a unix socket file.
                Some(libc::ENXIO) => not_regular(path, "a socket or an absent device"),
                _ => map_io(path, &e),
            })?;
        let st = sys::fstatat(fd.as_fd(), "").map_err(|e| map_io(path, &e))?;
        if st.is_dir() {
            return Err(err(
                ErrorCode::InvalidPath,
                format!("{path}: is a directory"),
            ));
        }
        if !st.is_file() {
            return Err(not_regular(path, kind_name(&st)));
        }
        sys::set_nonblocking(fd.as_fd(), false).map_err(|e| map_io(path, &e))?;
        Ok((File::from(fd), st.size))
    }

    /// Stages a file that [`StagedWrite::commit`] then creates or atomically
    /// replaces: `fill` writes the content into a temporary file in the same
    /// directory, which the commit renames over `path`. Dropping the staged
    /// write removes the temporary file. A directory, FIFO, socket or device
    /// at `path` is refused; a symlink is replaced, not followed.
    pub fn stage_write(
        &self,
        path: &str,
        mode: Option<u32>,
        fill: impl FnOnce(&mut File) -> FsResult<u64>,
    ) -> FsResult<StagedWrite> {
        let comps = parse(path)?;
        let (dir, name) = self.resolve_parent(path, &comps)?;
        // A replaced regular file keeps its permissions (unless `mode` is given) and owner.
        let existing = match sys::fstatat(dir.as_fd(), &name) {
            Ok(st) if st.is_dir() => {
                return Err(err(
                    ErrorCode::InvalidPath,
                    format!("{path}: is a directory"),
                ))
            }
            Ok(st) if st.is_file() => Some(st),
            Ok(st) if !st.is_symlink() => return Err(not_regular(path, kind_name(&st))),
            _ => None,
        };
        let mode = mode
            .or(existing.map(|st| st.mode & 0o7777))
            .unwrap_or(0o644)
            & 0o7777;
        let tmp = format!(
            ".aviary-tmp-{}-{}",
            sys::getpid(),
            self.tmp_counter.fetch_add(1, Ordering::Relaxed)
        );
        let fd = sys::openat(
            dir.as_fd(),
            &tmp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            0o600,
        )
        .map_err(|e| map_io(path, &e))?;
        // From here on, dropping `staged` removes the temporary file.
        let mut staged = StagedWrite {
            dir,
            tmp,
            name,
            path: path.to_owned(),
            bytes: 0,
            committed: false,
        };
        let mut file = File::from(fd);
        staged.bytes = fill(&mut file)?;
        if let Some(st) = existing {
            // Best effort: only root may give a file away; envd normally is root.
            let _ = sys::fchown(file.as_fd(), st.uid, st.gid);
        }
        // After fchown, which clears set-id bits.
        sys::fchmod(file.as_fd(), mode).map_err(|e| map_io(path, &e))?;
        Ok(staged)
    }

    /// Lists a directory (following a symlinked directory inside the root).
    pub fn list(&self, path: &str) -> FsResult<Vec<FileStat>> {
        let comps = parse(path)?;
        let dir = self
            .resolve(&comps, libc::O_PATH | libc::O_DIRECTORY)
            .map_err(|e| map_io(path, &e))?;
        let names = sys::read_dir_names(dir.as_fd()).map_err(|e| map_io(path, &e))?;
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            // Entries removed since readdir are simply skipped.
            if let Ok(st) = sys::fstatat(dir.as_fd(), &name) {
                let name = name.to_string_lossy().into_owned();
                let mut child = comps.clone();
                child.push(name.clone());
                out.push(stat_to_wire(name, join_components(&child), &st));
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Describes a path without following a final symlink.
    pub fn stat(&self, path: &str) -> FsResult<FileStat> {
        let comps = parse(path)?;
        if comps.is_empty() {
            let st = sys::fstatat(self.root.as_fd(), "").map_err(|e| map_io(path, &e))?;
            return Ok(stat_to_wire("/".into(), "/".into(), &st));
        }
        let (dir, name) = self.resolve_parent(path, &comps)?;
        let st = sys::fstatat(dir.as_fd(), &name).map_err(|e| map_io(path, &e))?;
        Ok(stat_to_wire(name, join_components(&comps), &st))
    }

    pub fn mkdir(&self, path: &str, parents: bool) -> FsResult<()> {
        let comps = parse(path)?;
        if !parents {
            let (dir, name) = self.resolve_parent(path, &comps)?;
            return sys::mkdirat(dir.as_fd(), &name, 0o755).map_err(|e| map_io(path, &e));
        }
        for i in 1..=comps.len() {
            let prefix = &comps[..i];
            match self.resolve(prefix, libc::O_PATH | libc::O_DIRECTORY) {
                Ok(_) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    let (dir, name) = self.resolve_parent(path, prefix)?;
                    match sys::mkdirat(dir.as_fd(), &name, 0o755) {
                        Err(e) if e.raw_os_error() != Some(libc::EEXIST) => {
                            return Err(map_io(path, &e))
                        }
                        _ => {}
                    }
                }
                Err(e) => return Err(map_io(path, &e)),
            }
        }
        Ok(())
    }

    pub fn remove(&self, path: &str, recursive: bool) -> FsResult<()> {
        let comps = parse(path)?;
        let (dir, name) = self.resolve_parent(path, &comps)?;
        let st = sys::fstatat(dir.as_fd(), &name).map_err(|e| map_io(path, &e))?;
        let r = if !st.is_dir() {
            sys::unlinkat(dir.as_fd(), &name, false)
        } else if recursive {
            remove_tree(dir, OsString::from(name))
        } else {
            sys::unlinkat(dir.as_fd(), &name, true)
        };
        r.map_err(|e| map_io(path, &e))
    }
}

/// A file written to a temporary name, not yet published; see
/// [`SandboxFs::stage_write`].
pub struct StagedWrite {
    dir: OwnedFd,
    tmp: String,
    name: String,
    path: String,
    bytes: u64,
    committed: bool,
}

impl StagedWrite {
    /// Publishes the file under its name (one rename); returns its size.
    pub fn commit(mut self) -> FsResult<u64> {
        sys::renameat(self.dir.as_fd(), &self.tmp, &self.name)
            .map_err(|e| map_io(&self.path, &e))?;
        self.committed = true;
        Ok(self.bytes)
    }
}

impl Drop for StagedWrite {
    fn drop(&mut self) {
        if !self.committed {
            let _ = sys::unlinkat(self.dir.as_fd(), &self.tmp, false);
        }
    }
}

fn not_regular(path: &str, what: &str) -> ErrorBody {
    err(
        ErrorCode::NotRegularFile,
        format!("{path}: is {what}, not a regular file"),
    )
}

fn kind_name(st: &Stat) -> &'static str {
    match st.mode & libc::S_IFMT {
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symlink",
        _ => "a special file",
    }
}

/// Removes the directory `name` inside `parent` and everything below it, without
/// following symlinks. Iterative, so depth is bounded by open descriptors, not stack.
fn remove_tree(parent: OwnedFd, name: OsString) -> io::Result<()> {
    struct Level {
        fd: OwnedFd,
        name_in_parent: OsString,
        pending: Vec<OsString>,
    }
    let fd = sys::openat(
        parent.as_fd(),
        &name,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )?;
    let pending = sys::read_dir_names(fd.as_fd())?;
    let mut stack = vec![Level {
        fd,
        name_in_parent: name,
        pending,
    }];
    while let Some(top) = stack.last_mut() {
        if let Some(entry) = top.pending.pop() {
            let st = match sys::fstatat(top.fd.as_fd(), &entry) {
                Ok(st) => st,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(e),
            };
            if st.is_dir() {
                let fd = sys::openat(
                    top.fd.as_fd(),
                    &entry,
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                )?;
                let pending = sys::read_dir_names(fd.as_fd())?;
                stack.push(Level {
                    fd,
                    name_in_parent: entry,
                    pending,
                });
            } else {
                sys::unlinkat(top.fd.as_fd(), &entry, false)?;
            }
            continue;
        }
        let done = stack
            .pop()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let parent_fd = stack.last().map(|l| l.fd.as_fd()).unwrap_or(parent.as_fd());
        sys::unlinkat(parent_fd, &done.name_in_parent, true)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::symlink;

    fn both(root: &Path) -> [SandboxFs; 2] {
        [
            SandboxFs::open(root, true).unwrap(),
            SandboxFs::open(root, false).unwrap(),
        ]
    }

    fn write(
        fs: &SandboxFs,
        p: &str,
        mode: Option<u32>,
        fill: impl FnOnce(&mut File) -> FsResult<u64>,
    ) -> FsResult<u64> {
        fs.stage_write(p, mode, fill)?.commit()
    }

    #[test]
    fn non_regular_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let made = std::process::Command::new("mkfifo")
            .arg(root.join("fifo"))
            .status()
            .unwrap();
        assert!(made.success());
        let _sock = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
        symlink("fifo", root.join("to-fifo")).unwrap();
        for fs in both(root) {
            // No writer on the FIFO: a blocking open or read would hang here.
            for p in ["/fifo", "/to-fifo", "/sock"] {
                let e = read_all(&fs, p).unwrap_err();
                assert_eq!(e.code, ErrorCode::NotRegularFile, "{p}: {e:?}");
            }
            for p in ["/fifo", "/sock"] {
                let e = write(&fs, p, None, |_| Ok(0)).unwrap_err();
                assert_eq!(e.code, ErrorCode::NotRegularFile, "{p}: {e:?}");
            }
            assert!(read_all(&fs, "/fifo").unwrap_err().message.contains("FIFO"));
        }
        // A symlink to a FIFO is itself replaced by a write, like any symlink.
        write(&both(root)[0], "/to-fifo", None, |_| Ok(0)).unwrap();
        assert!(std::fs::symlink_metadata(root.join("to-fifo"))
            .unwrap()
            .is_file());
        // A device node, when this process may create one.
        let mknod = std::process::Command::new("mknod")
            .arg(root.join("null"))
            .args(["c", "1", "3"])
            .status();
        if mknod.is_ok_and(|s| s.success()) {
            for fs in both(root) {
                let e = read_all(&fs, "/null").unwrap_err();
                assert_eq!(e.code, ErrorCode::NotRegularFile, "{e:?}");
            }
        }
    }

    #[test]
    fn errnos_map_to_stable_codes() {
        let code = |errno| map_io("/p", &io::Error::from_raw_os_error(errno)).code;
        for errno in [libc::EROFS, libc::EACCES, libc::EPERM, libc::EBUSY] {
            assert_eq!(code(errno), ErrorCode::PermissionDenied, "{errno}");
        }
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            assert_eq!(code(errno), ErrorCode::NoSpace, "{errno}");
        }
    }

    fn read_all(fs: &SandboxFs, p: &str) -> FsResult<Vec<u8>> {
        let (mut f, _) = fs.open_read(p)?;
        let mut v = Vec::new();
        f.read_to_end(&mut v).unwrap();
        Ok(v)
    }

    #[test]
    fn symlinks_resolve_inside_the_root_for_both_resolvers() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/hostname"), b"inside").unwrap();
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), b"f").unwrap();
        symlink("/etc", root.join("abs")).unwrap();
        symlink("../../../../../../etc", root.join("a/rel")).unwrap();
        symlink("b", root.join("a/lb")).unwrap();
        symlink("loop2", root.join("loop1")).unwrap();
        symlink("loop1", root.join("loop2")).unwrap();
        for fs in both(root) {
            // Absolute and climbing symlinks land in ROOT/etc, never in the host's /etc.
            assert_eq!(read_all(&fs, "/abs/hostname").unwrap(), b"inside");
            assert_eq!(read_all(&fs, "/a/rel/hostname").unwrap(), b"inside");
            assert_eq!(
                read_all(&fs, "/abs/passwd").unwrap_err().code,
                ErrorCode::NotFound
            );
            assert_eq!(read_all(&fs, "/a/lb/f").unwrap(), b"f");
            assert_eq!(read_all(&fs, "/a/lb/../b/f").unwrap(), b"f");
            assert_eq!(
                read_all(&fs, "/loop1").unwrap_err().code,
                ErrorCode::InvalidPath
            );
            assert_eq!(
                read_all(&fs, "/../etc/passwd").unwrap_err().code,
                ErrorCode::InvalidPath
            );
            assert_eq!(
                read_all(&fs, "etc/hostname").unwrap_err().code,
                ErrorCode::InvalidPath
            );
            assert_eq!(
                read_all(&fs, "/a/b/f/x").unwrap_err().code,
                ErrorCode::InvalidPath
            );
            assert_eq!(fs.list("/abs").unwrap()[0].name, "hostname");
            assert_eq!(fs.stat("/abs").unwrap().kind, FileKind::Symlink);
        }
    }

    #[test]
    fn write_list_mkdir_remove() {
        let dir = tempfile::tempdir().unwrap();
        for fs in both(dir.path()) {
            fs.mkdir("/x/y/z", true).unwrap();
            fs.mkdir("/x/y/z", true).unwrap();
            assert_eq!(
                fs.mkdir("/x/y/z", false).unwrap_err().code,
                ErrorCode::AlreadyExists
            );
            assert_eq!(
                fs.mkdir("/q/r", false).unwrap_err().code,
                ErrorCode::NotFound
            );
            let n = write(&fs, "/x/y/file", Some(0o600), |f| {
                f.write_all(b"hello").unwrap();
                Ok(5)
            })
            .unwrap();
            assert_eq!(n, 5);
            let st = fs.stat("/x/y/file").unwrap();
            assert_eq!(
                (st.kind, st.size, st.mode, st.path.as_str()),
                (FileKind::File, 5, 0o600, "/x/y/file")
            );
            // A failing writer leaves neither a temp file nor a changed target.
            let e = write(&fs, "/x/y/file", None, |f| {
                f.write_all(b"partial").unwrap();
                Err(err(ErrorCode::Internal, "source failed"))
            })
            .unwrap_err();
            assert_eq!(e.message, "source failed");
            assert_eq!(read_all(&fs, "/x/y/file").unwrap(), b"hello");
            // So does a staged write that is never committed.
            let staged = fs
                .stage_write("/x/y/file", None, |f| {
                    f.write_all(b"never").unwrap();
                    Ok(5)
                })
                .unwrap();
            drop(staged);
            assert_eq!(read_all(&fs, "/x/y/file").unwrap(), b"hello");
            let names: Vec<_> = fs
                .list("/x/y")
                .unwrap()
                .into_iter()
                .map(|s| s.name)
                .collect();
            assert_eq!(names, vec!["file", "z"]);
            assert_eq!(
                fs.remove("/x", false).unwrap_err().code,
                ErrorCode::NotEmpty
            );
            assert_eq!(
                fs.remove("/", true).unwrap_err().code,
                ErrorCode::InvalidPath
            );
            fs.remove("/x", true).unwrap();
            assert_eq!(fs.stat("/x").unwrap_err().code, ErrorCode::NotFound);
        }
    }

    #[test]
    fn replacing_a_file_keeps_owner_and_mode() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("owned");
        std::fs::write(&f, b"old").unwrap();
        std::os::unix::fs::chown(&f, Some(1234), Some(4321)).unwrap();
        std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o751)).unwrap();
        let fs = SandboxFs::open(dir.path(), true).unwrap();
        write(&fs, "/owned", None, |w| {
            w.write_all(b"new").unwrap();
            Ok(3)
        })
        .unwrap();
        let meta = std::fs::metadata(&f).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (1234, 4321, 0o751)
        );
        assert_eq!(std::fs::read(&f).unwrap(), b"new");
    }

    #[test]
    fn recursive_remove_does_not_follow_symlinks_out() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"k").unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("t/deep/er")).unwrap();
        symlink(outside.path(), dir.path().join("t/deep/link")).unwrap();
        let fs = SandboxFs::open(dir.path(), true).unwrap();
        fs.remove("/t", true).unwrap();
        assert!(outside.path().join("keep").exists());
        assert!(!dir.path().join("t").exists());
    }
}
