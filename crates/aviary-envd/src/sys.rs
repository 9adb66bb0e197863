//! Thin, safe wrappers over the libc calls envd needs. This is the only module
//! of the crate allowed to use `unsafe`; each wrapper checks its arguments and
//! turns `-1`/errno into `io::Error`.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cstr(s: impl AsRef<OsStr>) -> io::Result<CString> {
    CString::new(s.as_ref().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

pub fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() }
}

fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given; sigaddset only writes
    // into that initialised set; the signal numbers are valid constants.
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        for s in signals {
            libc::sigaddset(set.as_mut_ptr(), *s);
        }
        set.assume_init()
    }
}

/// Blocks `signals` in the calling thread (and so in every thread it spawns later).
pub fn block_signals(signals: &[libc::c_int]) -> io::Result<()> {
    let set = sigset(signals);
    // SAFETY: `set` is an initialised sigset; a null old-set pointer is allowed.
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Waits up to `timeout` for one of the (blocked) `signals`; returns the signal
/// number and the sender's pid as seen from our PID namespace (0 when the sender
/// lives in an ancestor namespace).
pub fn wait_signal(signals: &[libc::c_int], timeout: Duration) -> Option<(libc::c_int, i32)> {
    let set = sigset(signals);
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
    // SAFETY: all pointers are to live, properly typed locals.
    let sig = unsafe { libc::sigtimedwait(&set, info.as_mut_ptr(), &ts) };
    if sig <= 0 {
        return None;
    }
    // SAFETY: sigtimedwait filled `info` for the returned signal; si_pid is valid
    // for signals sent with kill() and for SIGCHLD.
    let pid = unsafe { info.assume_init().si_pid() };
    Some((sig, pid))
}

/// Waits up to `timeout` for `fd` to become readable (a listener: a
/// connection to accept). `Ok(false)` on timeout or an interrupting signal.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one live, initialised pollfd, and the count passed is 1.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(n > 0)
}

/// Makes orphaned descendants re-parent to this process so that it reaps them
/// even when it is not PID 1.
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes one integer argument.
    cvt(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) })?;
    Ok(())
}

/// The pid of a unix-socket peer as seen from our PID namespace (SO_PEERCRED);
/// 0 for a peer in an ancestor namespace.
pub fn peer_pid(sock: BorrowedFd<'_>) -> io::Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the size passed in `len`.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred.pid)
}

fn getsockopt_int(fd: RawFd, opt: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are live locals of the size passed in `len`.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(v)
}

/// Takes over the inherited descriptor `fd` as envd's listening socket
/// (socket activation): it must be an open `AF_UNIX` `SOCK_STREAM` socket
/// other than stdio. Marks it close-on-exec, so no exec'd process inherits it,
/// and calls `listen` on it here, so that the kernel records envd's own pid
/// as the peer of every connection (`SO_PEERCRED`).
pub fn adopt_listen_fd(fd: RawFd) -> io::Result<std::os::unix::net::UnixListener> {
    let refuse = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    if fd <= 2 {
        return Err(refuse(format!("fd {fd} is stdio, not a socket")));
    }
    // SAFETY: F_GETFD only reads the flags of `fd`; it fails with EBADF when
    // the descriptor is not open, and touches nothing else.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })
        .map_err(|e| refuse(format!("fd {fd} was not inherited: {e}")))?;
    let domain = match getsockopt_int(fd, libc::SO_DOMAIN) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {
            return Err(refuse(format!("fd {fd} is not a socket")))
        }
        r => r?,
    };
    let kind = getsockopt_int(fd, libc::SO_TYPE)?;
    if domain != libc::AF_UNIX || kind != libc::SOCK_STREAM {
        return Err(refuse(format!(
            "fd {fd} is a socket of domain {domain} type {kind}, not AF_UNIX SOCK_STREAM"
        )));
    }
    // SAFETY: F_SETFD on the open descriptor checked above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) })?;
    // SAFETY: plain syscall on the open socket checked above. Listening again
    // on an already listening socket is allowed and re-records our pid.
    cvt(unsafe { libc::listen(fd, libc::SOMAXCONN) })?;
    // SAFETY: `fd` is open (F_GETFD succeeded), is a unix stream socket, and
    // nothing else in this process owns it: it was inherited, and envd adopts
    // it once, at start, before opening any descriptor of its own.
    Ok(unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) })
}

/// Makes envd non-dumpable: processes without `CAP_SYS_PTRACE` over it
/// (root inside the sandbox included) can then neither ptrace it, nor take
/// its descriptors with `pidfd_getfd`, nor open `/proc/1/fd/*`. Not inherited
/// across exec, so exec'd processes are unaffected.
pub fn set_not_dumpable() -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes one integer argument.
    cvt(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) })?;
    Ok(())
}

/// Whether any process other than this one could be signalled (`kill(-1, 0)`).
/// As PID 1 of a PID namespace: whether anything but envd is left in the
/// sandbox (unreaped zombies count).
pub fn any_other_process() -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(-1, 0) };
    !(r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH))
}

/// Sends `sig` to process `pid` (> 1).
pub fn kill_pid(pid: i32, sig: libc::c_int) {
    if pid > 1 {
        // SAFETY: plain syscall; pid > 1 so this is never a group or "everyone".
        unsafe { libc::kill(pid, sig) };
    }
}

/// `poll(2)`; returns the number of ready descriptors (0 on timeout or EINTR).
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: the pointer and length describe the caller's live slice.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if r == -1 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(r as usize)
}

/// Sends `sig` to every process of process group `pgid`.
pub fn kill_group(pgid: i32, sig: libc::c_int) {
    if pgid > 1 {
        // SAFETY: plain syscall; pgid > 1 so this never means "every process".
        unsafe { libc::kill(-pgid, sig) };
    }
}

/// Sends `sig` to every process we may signal except ourselves. Only sensible as
/// PID 1 of a PID namespace, where that means "everything in the sandbox".
pub fn kill_all(sig: libc::c_int) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(-1, sig) };
}

/// Makes the spawned child the leader of a new session (and process group), so
/// that killing the group reaches every process it starts, and gives it an
/// empty signal mask (envd blocks SIGCHLD/SIGTERM/SIGINT in all its threads,
/// and a blocked mask is inherited across exec).
pub fn spawn_in_new_session(cmd: &mut Command) {
    let empty = sigset(&[]);
    // SAFETY: the closure runs between fork and exec and only calls setsid and
    // sigprocmask, both async-signal-safe; it allocates nothing (`empty` was
    // built before the fork and is copied into the closure).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Finds an exited child without reaping it (`waitid(P_ALL, WNOWAIT)`).
/// `None` when no child has exited (or there are no children).
pub fn peek_exited_child() -> Option<i32> {
    let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
    // SAFETY: `info` is a zeroed siginfo_t the kernel fills in.
    let r = unsafe {
        libc::waitid(
            libc::P_ALL,
            0,
            info.as_mut_ptr(),
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if r == -1 {
        return None;
    }
    // SAFETY: waitid succeeded; with WNOHANG and no exited child si_pid stays 0
    // (the struct was zeroed).
    let pid = unsafe { info.assume_init().si_pid() };
    (pid > 0).then_some(pid)
}

/// Reaps `pid` if it has exited; returns its raw wait status.
pub fn reap(pid: i32) -> Option<libc::c_int> {
    let mut status = 0;
    // SAFETY: `status` is a live local.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    (r == pid).then_some(status)
}

/// Decodes a raw wait status into (exit code, terminating signal); the exit code
/// of a signalled process is 128 + signal, as shells report it.
pub fn decode_wait_status(status: libc::c_int) -> (i32, Option<i32>) {
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        (128 + sig, Some(sig))
    } else {
        (libc::WEXITSTATUS(status), None)
    }
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub fn set_nonblocking(fd: BorrowedFd<'_>, on: bool) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor the caller keeps open.
    unsafe {
        let flags = cvt(libc::fcntl(fd.as_raw_fd(), libc::F_GETFL))?;
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        cvt(libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags))?;
    }
    Ok(())
}

/// Kernel `struct open_how` for openat2(2).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

pub const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
pub const RESOLVE_IN_ROOT: u64 = 0x10;

/// openat2(2). Errors with `ENOSYS` on kernels older than 5.6.
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &str,
    flags: libc::c_int,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let p = cstr(path)?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve,
    };
    // SAFETY: `p` is NUL-terminated, `how` is a live open_how of the size passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            p.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a new descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

/// openat(2) of one name relative to `dir`.
pub fn openat(
    dir: BorrowedFd<'_>,
    name: impl AsRef<OsStr>,
    flags: libc::c_int,
    mode: u32,
) -> io::Result<OwnedFd> {
    let p = cstr(name)?;
    // SAFETY: `p` is NUL-terminated; mode is passed as the variadic argument.
    let fd = cvt(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            p.as_ptr(),
            flags | libc::O_CLOEXEC,
            mode as libc::c_uint,
        )
    })?;
    // SAFETY: openat returned a new descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The parts of `struct stat` envd reports.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime: i64,
}

impl Stat {
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }
    pub fn is_symlink(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFLNK
    }
    pub fn is_file(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
}

/// fstatat(2); `name` empty means the descriptor itself. Never follows a final symlink.
pub fn fstatat(dir: BorrowedFd<'_>, name: impl AsRef<OsStr>) -> io::Result<Stat> {
    let p = cstr(name.as_ref())?;
    let mut st = MaybeUninit::<libc::stat>::zeroed();
    let flags = libc::AT_SYMLINK_NOFOLLOW
        | if name.as_ref().is_empty() {
            libc::AT_EMPTY_PATH
        } else {
            0
        };
    // SAFETY: `p` is NUL-terminated and `st` is a live stat buffer.
    cvt(unsafe { libc::fstatat(dir.as_raw_fd(), p.as_ptr(), st.as_mut_ptr(), flags) })?;
    // SAFETY: fstatat succeeded and filled `st`.
    let st = unsafe { st.assume_init() };
    Ok(Stat {
        mode: st.st_mode,
        uid: st.st_uid,
        gid: st.st_gid,
        size: st.st_size as u64,
        mtime: st.st_mtime,
    })
}

pub fn mkdirat(dir: BorrowedFd<'_>, name: impl AsRef<OsStr>, mode: u32) -> io::Result<()> {
    let p = cstr(name)?;
    // SAFETY: `p` is NUL-terminated.
    cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), p.as_ptr(), mode as libc::mode_t) })?;
    Ok(())
}

pub fn unlinkat(dir: BorrowedFd<'_>, name: impl AsRef<OsStr>, remove_dir: bool) -> io::Result<()> {
    let p = cstr(name)?;
    let flags = if remove_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: `p` is NUL-terminated.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), p.as_ptr(), flags) })?;
    Ok(())
}

pub fn renameat(
    dir: BorrowedFd<'_>,
    from: impl AsRef<OsStr>,
    to: impl AsRef<OsStr>,
) -> io::Result<()> {
    let (f, t) = (cstr(from)?, cstr(to)?);
    // SAFETY: both names are NUL-terminated; the same live dirfd is used twice.
    cvt(unsafe { libc::renameat(dir.as_raw_fd(), f.as_ptr(), dir.as_raw_fd(), t.as_ptr()) })?;
    Ok(())
}

pub fn fchown(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the caller keeps open.
    cvt(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) })?;
    Ok(())
}

pub fn fchmod(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the caller keeps open.
    cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) })?;
    Ok(())
}

/// Reads the target of the symlink that `link` (opened with O_PATH|O_NOFOLLOW) is.
pub fn readlink_fd(link: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    let empty = c"";
    // SAFETY: `buf` is writable for `buf.len()` bytes; the empty path makes the
    // kernel read the link the descriptor refers to.
    let n = unsafe {
        libc::readlinkat(
            link.as_raw_fd(),
            empty.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The names in directory `dir` (without `.` and `..`).
pub fn read_dir_names(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    // fdopendir takes ownership of the descriptor it is given, so give it a dup
    // opened for reading (the caller's may be O_PATH).
    let own = openat(dir, ".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = own.as_raw_fd();
    // SAFETY: `raw` is an open directory descriptor; on success the DIR owns it.
    let d = unsafe { libc::fdopendir(raw) };
    if d.is_null() {
        return Err(io::Error::last_os_error());
    }
    std::mem::forget(own);
    let mut names = Vec::new();
    loop {
        // SAFETY: `d` is a valid DIR stream used by this thread only.
        let ent = unsafe { libc::readdir(d) };
        if ent.is_null() {
            break;
        }
        // SAFETY: readdir returned a valid dirent whose d_name is NUL-terminated.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    }
    // SAFETY: `d` is valid and closed exactly once (this also closes `raw`).
    unsafe { libc::closedir(d) };
    Ok(names)
}

/// A new pseudo-terminal: (master, slave), both close-on-exec, the slave
/// opened without becoming anyone's controlling terminal, the window set to
/// `cols` x `rows`. The slave is reached from the master
/// (`TIOCGPTPEER`), never by a path under /dev/pts the sandbox could
/// replace; the master must be a character device.
pub fn open_pty(cols: u16, rows: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let path = c"/dev/ptmx";
    // SAFETY: `path` is NUL-terminated; the flags ask for a new descriptor.
    let fd = cvt(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: open returned a new descriptor that nobody else owns.
    let master = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = fstatat(master.as_fd(), "")?;
    if st.mode & libc::S_IFMT != libc::S_IFCHR {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "/dev/ptmx is not a character device",
        ));
    }
    let unlock: libc::c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int from the live local `unlock`.
    cvt(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) })?;
    // SAFETY: TIOCGPTPEER takes open flags as its integer argument and
    // returns a new descriptor for the slave.
    let slave = cvt(unsafe {
        libc::ioctl(
            master.as_raw_fd(),
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: the ioctl returned a new descriptor that nobody else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    set_window_size(master.as_fd(), cols, rows)?;
    Ok((master, slave))
}

/// Sets a terminal's window size (the kernel sends SIGWINCH to its
/// foreground process group when it changes).
pub fn set_window_size(fd: BorrowedFd<'_>, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize from the live local `ws`.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) })?;
    Ok(())
}

/// The foreground process group of the terminal whose master is `fd`.
pub fn foreground_group(fd: BorrowedFd<'_>) -> Option<i32> {
    let mut pgrp: libc::pid_t = 0;
    // SAFETY: TIOCGPGRP writes one pid_t into the live local `pgrp`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGPGRP, &mut pgrp) };
    (r != -1 && pgrp > 1).then_some(pgrp)
}

/// Like [`spawn_in_new_session`], and the child's stdin (a terminal slave)
/// becomes the new session's controlling terminal.
pub fn spawn_with_controlling_terminal(cmd: &mut Command) {
    let empty = sigset(&[]);
    // SAFETY: the closure runs between fork and exec and only calls setsid,
    // ioctl and sigprocmask, all async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() == -1 {
                return Err(io::Error::last_os_error());
            }
            if libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
                return Err(io::Error::last_os_error());
            }
            if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Detaches into the background (`--daemon`): forks, the parent exits 0 at
/// once, the child becomes a session leader with stdio on `/dev/null`.
/// Call it while the process has only one thread, after every listening
/// socket is bound (so whoever started envd can connect when it returns).
pub fn daemonize() -> io::Result<()> {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    // SAFETY: the process is single-threaded here, so the child may run
    // arbitrary code; the parent only calls `_exit`.
    let pid = cvt(unsafe { libc::fork() })?;
    if pid > 0 {
        // SAFETY: `_exit` ends the parent without running destructors or
        // flushing buffers the child shares.
        unsafe { libc::_exit(0) };
    }
    // SAFETY: setsid has no arguments; the child is not a group leader.
    cvt(unsafe { libc::setsid() })?;
    for fd in 0..3 {
        // SAFETY: `null` is an open descriptor; dup2 onto 0..2 replaces stdio.
        cvt(unsafe { libc::dup2(null.as_raw_fd(), fd) })?;
    }
    Ok(())
}
