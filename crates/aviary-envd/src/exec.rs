//! Running one process for one `exec` connection.
//!
//! Every exec becomes the leader of its own session and process group, so the
//! group can be killed as a whole (`killpg(SIGKILL)`) on timeout and when the
//! client disconnects before the exit was sent. Two threads serve an exec:
//!
//! - the connection thread *pumps* stdout/stderr from pipes into frames, one
//!   chunk at a time (memory stays bounded whatever the output size: a slow
//!   client back-pressures the process through the pipe);
//! - a *controller* thread feeds stdin frames into the process (non-blocking, so
//!   a process that never reads stdin cannot stall it), enforces the deadline,
//!   and watches the socket for a disconnect.
//!
//! After the leader exits, output is drained until both pipes close or for a
//! short grace period (a backgrounded process may keep them open); processes
//! left in the group after a normal exit keep running (until the fence moves:
//! see [`crate::sweep`]).
//!
//! The process is spawned while the fence gate is held and the token still
//! matches, so no exec authorised by an old token can start after the fence
//! moved and escape the sweep.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aviary_envd_proto::{
    encode_header, encode_json, read_frame, write_frame, ErrorBody, ErrorCode, ExitWire, FrameKind,
    Response, CHUNK_SIZE, FRAME_HEADER_LEN,
};

use crate::server::Envd;
use crate::sys;

/// How long output is still forwarded after the leader exited while a pipe is
/// held open by a process it left behind.
const EXIT_DRAIN_GRACE: Duration = Duration::from_millis(100);
/// How often the pump checks for the leader's exit while pipes stay open.
const EXIT_CHECK_TICK_MS: i32 = 50;

use aviary_envd_proto::DEFAULT_PATH;

/// A validated exec request.
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    pub stdin: bool,
    pub timeout: Option<Duration>,
    /// The lease token the exec was sent with, checked again at the spawn.
    pub token: Option<u64>,
    /// Run as this user (`name`, `uid`, `name:group`, `uid:gid`) instead
    /// of root.
    pub user: Option<String>,
}

/// State shared between the pump and the controller of one exec.
struct ExecShared {
    pgid: i32,
    /// Set once the leader has been reaped; after that the group is not killed.
    exited: Mutex<bool>,
    timed_out: AtomicBool,
}

impl ExecShared {
    fn kill_group(&self) {
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        if !*exited {
            sys::kill_group(self.pgid, libc::SIGKILL);
        }
    }
}

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::BadRequest,
        message: message.into(),
    }
}

pub(crate) fn spawn_error(argv0: &str, cwd: Option<&str>, e: &io::Error) -> ErrorBody {
    let code = match e.raw_os_error() {
        Some(libc::ENOENT) => ErrorCode::NotFound,
        Some(libc::EACCES | libc::EPERM) => ErrorCode::PermissionDenied,
        Some(libc::ENOTDIR | libc::ELOOP | libc::ENAMETOOLONG) => ErrorCode::InvalidPath,
        // Not an executable format the kernel knows.
        Some(libc::ENOEXEC) => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    };
    ErrorBody {
        code,
        message: match cwd {
            Some(cwd) => format!("spawn {argv0} in {cwd}: {e}"),
            None => format!("spawn {argv0}: {e}"),
        },
    }
}

/// The exit status and message a shell gives a command that cannot start
/// (POSIX: 127 not found, 126 found but not executable); `None` for other
/// spawn failures, which are envd's errors.
pub(crate) fn shell_exit(e: &io::Error) -> Option<(i32, &'static str)> {
    match e.raw_os_error() {
        Some(libc::ENOENT) => Some((127, "command not found")),
        Some(libc::EACCES | libc::EPERM) => Some((126, "permission denied")),
        Some(libc::ENOEXEC) => Some((126, "cannot execute: not an executable format")),
        _ => None,
    }
}

/// Checks an exec's argv (non-empty, no NUL), environment (names non-empty
/// without `=` or NUL, values without NUL) and working directory; returns
/// the program.
pub(crate) fn check_command<'a>(
    argv: &'a [String],
    env: &[(String, String)],
    cwd: Option<&str>,
) -> Result<&'a String, ErrorBody> {
    let Some(argv0) = argv.first() else {
        return Err(bad("argv is empty"));
    };
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(bad(format!(
                "invalid environment variable {k:?}: the name must be non-empty without '=' \
                 or NUL, the value without NUL"
            )));
        }
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(bad("argv contains a NUL byte"));
    }
    if let Some(cwd) = cwd {
        check_cwd(cwd)?;
    }
    Ok(argv0)
}

/// The command envd starts for a request (an exec, a terminal session, a
/// background command), built the one way: the request's checks
/// ([`check_command`]), its user resolved in the sandbox's own
/// `/etc/passwd`, a cleared environment with envd's defaults (`PATH`,
/// `HOME` of the user, `LANG`, then `defaults`), the request's own variables
/// over them, and its working directory (the sandbox root when absent).
/// Stdio and the session are the caller's.
pub(crate) fn command(
    envd: &Envd,
    argv: &[String],
    env: &[(String, String)],
    cwd: Option<&str>,
    user: Option<&str>,
    defaults: &[(&str, &str)],
) -> Result<(Command, Option<crate::user::RunAs>), ErrorBody> {
    let argv0 = check_command(argv, env, cwd)?;
    let run_as = match user {
        None => None,
        Some(spec) => Some(crate::user::resolve(spec).map_err(bad)?),
    };
    let home = run_as.as_ref().map_or("/root", |u| u.home.as_str());
    let mut cmd = Command::new(argv0);
    if let Some(u) = &run_as {
        use std::os::unix::process::CommandExt;
        // std drops the supplementary groups when it changes the uid as root
        cmd.uid(u.uid).gid(u.gid);
    }
    cmd.args(&argv[1..])
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("HOME", home)
        .env("LANG", "C.UTF-8")
        .envs(defaults.iter().copied())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd.map(std::path::Path::new).unwrap_or(envd.root.as_path()));
    Ok((cmd, run_as))
}

/// Runs `req` and streams its output and exit over `conn`. Errors before the
/// process started are returned (the caller sends them as an `Error` frame).
pub fn run(envd: &Envd, conn: &mut UnixStream, req: ExecRequest) -> Result<(), ErrorBody> {
    let (mut cmd, _) = command(
        envd,
        &req.argv,
        &req.env,
        req.cwd.as_deref(),
        req.user.as_deref(),
        &[],
    )?;
    let argv0 = &req.argv[0];
    cmd
        // Always a pipe: without stdin its write end is closed at once (EOF), which
        // unlike Stdio::null() does not need /dev/null in the sandbox.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    sys::spawn_in_new_session(&mut cmd);

    // The controller needs its own handle on the socket; get it before spawning
    // so that a failure here cannot leave a process behind.
    let ctl_sock = conn.try_clone().map_err(|e| internal("clone socket", &e))?;
    let (wake_r, wake_w) = sys::pipe().map_err(|e| internal("create pipe", &e))?;

    let gate = envd.enter_fence(req.token)?;
    let (mut child, exit_rx) = match envd.reaper.spawn(&mut cmd) {
        Ok(spawned) => spawned,
        Err(e) => {
            drop(gate);
            // a command that cannot start exits as a shell's would: 127
            // not found, 126 not executable, the reason on stderr
            if let Some((exit_code, why)) = shell_exit(&e) {
                let line = format!("{argv0}: {why}\n");
                let _ = write_frame(conn, FrameKind::Stderr, line.as_bytes());
                let exit = Response::Exit(ExitWire {
                    exit_code,
                    signal: None,
                    timed_out: false,
                    duration_us: 0,
                });
                if let Ok(payload) = encode_json(&exit) {
                    let _ = write_frame(conn, FrameKind::Response, &payload);
                }
                return Ok(());
            }
            return Err(spawn_error(argv0, req.cwd.as_deref(), &e));
        }
    };
    let started = Instant::now();
    let pgid = child.id() as i32;
    envd.exec_started(pgid);
    drop(gate);
    let shared = Arc::new(ExecShared {
        pgid,
        exited: Mutex::new(false),
        timed_out: AtomicBool::new(false),
    });

    let deadline = req.timeout.map(|t| started + t);
    let stdin = child.stdin.take().map(OwnedFd::from).filter(|_| req.stdin);
    let ctl_shared = Arc::clone(&shared);
    let controller = std::thread::Builder::new()
        .name("envd-exec-ctl".into())
        .stack_size(64 * 1024)
        .spawn(move || control(ctl_sock, stdin, req.stdin, deadline, wake_r, &ctl_shared));
    if controller.is_err() {
        // Without a controller nobody enforces the deadline or watches the client.
        shared.kill_group();
    }

    let stdout = child.stdout.take().map(|p| File::from(OwnedFd::from(p)));
    let stderr = child.stderr.take().map(|p| File::from(OwnedFd::from(p)));
    let (exit, client_gone) = pump(conn, stdout, stderr, &exit_rx, &shared);
    // The reaper never drops a registered waiter, so recv only fails if envd is
    // shutting down; report that as a kill.
    let (status, exited_at) =
        exit.unwrap_or_else(|| (exit_rx.recv().unwrap_or(libc::SIGKILL), Instant::now()));
    *shared.exited.lock().unwrap_or_else(|p| p.into_inner()) = true;
    let duration = exited_at.saturating_duration_since(started);
    drop(wake_w);
    if let Ok(handle) = controller {
        let _ = handle.join();
    }
    envd.exec_finished(pgid);

    if client_gone {
        return Ok(());
    }
    let (exit_code, signal) = sys::decode_wait_status(status);
    let exit = Response::Exit(ExitWire {
        exit_code,
        signal,
        timed_out: shared.timed_out.load(Ordering::Relaxed),
        duration_us: u64::try_from(duration.as_micros()).unwrap_or(u64::MAX),
    });
    if let Ok(payload) = encode_json(&exit) {
        let _ = write_frame(conn, FrameKind::Response, &payload);
    }
    Ok(())
}

/// Refuses a working directory that cannot work, with a message that says why
/// (spawn would only report a bare errno).
pub(crate) fn check_cwd(cwd: &str) -> Result<(), ErrorBody> {
    let invalid = |why: String| ErrorBody {
        code: ErrorCode::InvalidPath,
        message: format!("exec cwd {cwd:?} {why}"),
    };
    if cwd.contains('\0') {
        return Err(bad("exec cwd contains a NUL byte"));
    }
    match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(invalid("is not a directory".into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(invalid("does not exist".into())),
        Err(e) => Err(invalid(format!("cannot be used: {e}"))),
    }
}

pub(crate) fn internal(what: &str, e: &io::Error) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::Internal,
        message: format!("{what}: {e}"),
    }
}

/// One turn of a pump's wait for its process's exit: takes the reaper's
/// status when it arrived (from then on output is drained for at most
/// [`EXIT_DRAIN_GRACE`]) and answers the next poll timeout, or `None` when
/// the grace is over. Shared by exec's and the terminal's pumps.
pub(crate) fn exit_wait(
    exit_rx: &Receiver<libc::c_int>,
    status: &mut Option<(libc::c_int, Instant)>,
    grace_end: &mut Option<Instant>,
) -> Option<i32> {
    if status.is_none() {
        match exit_rx.try_recv() {
            Ok(s) => {
                *status = Some((s, Instant::now()));
                *grace_end = Some(Instant::now() + EXIT_DRAIN_GRACE);
            }
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => {}
        }
    }
    match grace_end {
        Some(end) => {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            Some(i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1))
        }
        None => Some(EXIT_CHECK_TICK_MS),
    }
}

/// Forwards output until both pipes close (or the grace after the exit ends).
/// Returns the wait status and when it arrived, if it did meanwhile, and whether
/// the client is gone.
fn pump(
    conn: &mut UnixStream,
    stdout: Option<File>,
    stderr: Option<File>,
    exit_rx: &Receiver<libc::c_int>,
    shared: &ExecShared,
) -> (Option<(libc::c_int, Instant)>, bool) {
    let mut pipes: [(Option<File>, FrameKind); 2] =
        [(stdout, FrameKind::Stdout), (stderr, FrameKind::Stderr)];
    let mut buf = vec![0u8; FRAME_HEADER_LEN + CHUNK_SIZE];
    let mut status = None;
    let mut grace_end: Option<Instant> = None;
    let mut client_gone = false;
    loop {
        if pipes.iter().all(|(p, _)| p.is_none()) {
            break;
        }
        let Some(timeout_ms) = exit_wait(exit_rx, &mut status, &mut grace_end) else {
            break;
        };
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2);
        let mut which = Vec::with_capacity(2);
        for (i, (p, _)) in pipes.iter().enumerate() {
            if let Some(fd) = p {
                fds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                which.push(i);
            }
        }
        if sys::poll(&mut fds, timeout_ms).is_err() {
            break;
        }
        for (pfd, &i) in fds.iter().zip(&which) {
            if pfd.revents == 0 {
                continue;
            }
            let (pipe, kind) = &mut pipes[i];
            let Some(file) = pipe.as_mut() else { continue };
            let n = match read_retrying(file, &mut buf[FRAME_HEADER_LEN..]) {
                Ok(0) | Err(_) => {
                    *pipe = None;
                    continue;
                }
                Ok(n) => n,
            };
            if client_gone {
                continue;
            }
            buf[..FRAME_HEADER_LEN].copy_from_slice(&encode_header(*kind, n));
            if conn.write_all(&buf[..FRAME_HEADER_LEN + n]).is_err() {
                client_gone = true;
                shared.kill_group();
            }
        }
    }
    (status, client_gone)
}

pub(crate) fn read_retrying(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match f.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// Feeds stdin, enforces the deadline and watches the client until woken by
/// the pump closing `wake`.
fn control(
    mut sock: UnixStream,
    stdin: Option<OwnedFd>,
    mut expecting_stdin: bool,
    mut deadline: Option<Instant>,
    wake: OwnedFd,
    shared: &ExecShared,
) {
    let mut stdin: Option<File> = stdin.map(File::from);
    if let Some(f) = &stdin {
        if sys::set_nonblocking(f.as_fd(), true).is_err() {
            stdin = None;
        }
    }
    // Frames are read only after poll reports data, and a client that sends half
    // a frame only delays its own exec; no read timeout is needed.
    let _ = sock.set_read_timeout(None);
    let mut pending: Vec<u8> = Vec::new();
    let mut offset = 0;
    loop {
        let timeout_ms = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    shared.timed_out.store(true, Ordering::Relaxed);
                    shared.kill_group();
                    deadline = None;
                    continue;
                }
                // Round up so we never wake just before the deadline and spin.
                i32::try_from(left.as_millis() + 1).unwrap_or(i32::MAX)
            }
            None => -1,
        };
        let want_frames = offset >= pending.len();
        let mut fds = vec![
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: if want_frames {
                    libc::POLLIN | libc::POLLRDHUP
                } else {
                    libc::POLLRDHUP
                },
                revents: 0,
            },
        ];
        if let (false, Some(f)) = (want_frames, &stdin) {
            fds.push(libc::pollfd {
                fd: f.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            });
        }
        if sys::poll(&mut fds, timeout_ms).is_err() {
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds.len() > 2 && fds[2].revents != 0 {
            if let Some(f) = stdin.as_mut() {
                match f.write(&pending[offset..]) {
                    Ok(n) => offset += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    // The process closed its stdin: the rest is discarded.
                    Err(_) => {
                        stdin = None;
                        offset = pending.len();
                    }
                }
            }
        }
        let sock_ev = fds[1].revents;
        if sock_ev & libc::POLLIN != 0 && want_frames {
            match read_frame(&mut sock) {
                Ok(Some(f)) if expecting_stdin && f.kind == FrameKind::Data => {
                    if stdin.is_some() {
                        pending = f.payload;
                        offset = 0;
                    }
                }
                Ok(Some(f)) if expecting_stdin && f.kind == FrameKind::End => {
                    expecting_stdin = false;
                    stdin = None;
                }
                // EOF before the exit was sent, or a protocol violation: the client
                // is gone or misbehaving; either way the process group dies.
                _ => {
                    shared.kill_group();
                    return;
                }
            }
        } else if sock_ev & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            shared.kill_group();
            return;
        }
        if offset >= pending.len() && !pending.is_empty() {
            pending = Vec::new();
            offset = 0;
        }
    }
}
