//! Running one process on a pseudo-terminal for one `exec_pty` connection
//! (an interactive shell).
//!
//! The process becomes the leader of a new session whose controlling
//! terminal is a fresh pty slave, also its stdin, stdout and stderr. envd
//! keeps the master. As for exec, two threads serve it:
//!
//! - the connection thread *pumps* the master's output into `Stdout` frames
//!   (one chunk at a time: a slow client back-pressures the terminal) and,
//!   after the leader exited, drains it briefly, then sends the exit;
//! - a *controller* thread takes the client's frames: `Data` is typed into
//!   the master (non-blocking, so a process that never reads cannot stall
//!   the controller), `Control` resizes the window or signals the
//!   terminal's foreground process group; a disconnect kills the session's
//!   process groups.
//!
//! Fence: the token is checked before anything, and again at the spawn
//! under the fence gate, as for exec ([`crate::server`]'s module docs).
//! Resource bounds: one pty, two threads and one 64 KiB buffer per
//! session, within envd's connection limit; every frame is size-checked by
//! the framing before it is read.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use aviary_envd_proto::{
    check_pty_size, decode_json, encode_header, encode_json, read_frame, write_frame, ErrorBody,
    ErrorCode, ExitWire, FrameKind, PtyControl, Response, CHUNK_SIZE, FRAME_HEADER_LEN,
};

use crate::exec::{internal, read_retrying, shell_exit, spawn_error};
use crate::server::Envd;
use crate::sys;

/// A validated `exec_pty` request.
pub struct PtyRequest {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub env: Vec<(String, String)>,
    pub user: Option<String>,
    pub cols: u16,
    pub rows: u16,
    /// The lease token, checked again at the spawn.
    pub token: Option<u64>,
}

/// State shared by the pump and the controller of one session.
struct PtyShared {
    /// The session leader's pid (and its process group).
    pgid: i32,
    master: OwnedFd,
    /// Set once the leader has been reaped; after that nothing is killed.
    exited: Mutex<bool>,
}

impl PtyShared {
    /// Kills the leader's process group and the terminal's foreground group.
    fn kill_session(&self) {
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        if !*exited {
            if let Some(fg) = sys::foreground_group(self.master.as_fd()) {
                sys::kill_group(fg, libc::SIGKILL);
            }
            sys::kill_group(self.pgid, libc::SIGKILL);
        }
    }

    fn signal(&self, sig: i32) {
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        if !*exited {
            let target = sys::foreground_group(self.master.as_fd()).unwrap_or(self.pgid);
            sys::kill_group(target, sig);
        }
    }
}

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::BadRequest,
        message: message.into(),
    }
}

fn send_json(conn: &mut UnixStream, r: &Response) {
    if let Ok(payload) = encode_json(r) {
        let _ = write_frame(conn, FrameKind::Response, &payload);
    }
}

/// Runs `req` on a new terminal and serves the session over `conn`. Errors
/// before the process started are returned (sent as an `Error` frame).
pub fn run(envd: &Envd, conn: &mut UnixStream, req: PtyRequest) -> Result<(), ErrorBody> {
    check_pty_size(req.cols, req.rows).map_err(bad)?;
    // exec's command and environment, with a terminal type under the request's
    let (mut cmd, run_as) = crate::exec::command(
        envd,
        &req.argv,
        &req.env,
        req.cwd.as_deref(),
        req.user.as_deref(),
        &[("TERM", "xterm-256color")],
    )?;
    let argv0 = &req.argv[0];
    let (master, slave) =
        sys::open_pty(req.cols, req.rows).map_err(|e| internal("open a pseudo-terminal", &e))?;
    if let Some(u) = &run_as {
        // the user's own terminal, as login gives it (best effort: the
        // descriptors are what the process uses)
        let _ = sys::fchown(slave.as_fd(), u.uid, u.gid);
    }
    let stdio = |fd: &OwnedFd| {
        fd.try_clone()
            .map(Stdio::from)
            .map_err(|e| internal("duplicate the terminal", &e))
    };
    cmd.stdin(stdio(&slave)?)
        .stdout(stdio(&slave)?)
        .stderr(stdio(&slave)?);
    sys::spawn_with_controlling_terminal(&mut cmd);

    let ctl_sock = conn.try_clone().map_err(|e| internal("clone socket", &e))?;
    let (wake_r, wake_w) = sys::pipe().map_err(|e| internal("create pipe", &e))?;
    sys::set_nonblocking(master.as_fd(), true).map_err(|e| internal("terminal mode", &e))?;

    let gate = envd.enter_fence(req.token)?;
    let spawned = envd.reaper.spawn(&mut cmd);
    // The parent's copies of the slave: once only the session holds it, the
    // master reads EIO when the last process closes it.
    drop(cmd);
    drop(slave);
    let (child, exit_rx) = match spawned {
        Ok(spawned) => spawned,
        Err(e) => {
            drop(gate);
            // as a shell would: 127 not found, 126 not executable
            if let Some((exit_code, why)) = shell_exit(&e) {
                send_json(conn, &Response::Ok);
                let line = format!("{argv0}: {why}\r\n");
                let _ = write_frame(conn, FrameKind::Stdout, line.as_bytes());
                send_json(
                    conn,
                    &Response::Exit(ExitWire {
                        exit_code,
                        signal: None,
                        timed_out: false,
                        duration_us: 0,
                    }),
                );
                return Ok(());
            }
            return Err(spawn_error(argv0, req.cwd.as_deref(), &e));
        }
    };
    let started = Instant::now();
    let pgid = child.id() as i32;
    envd.exec_started(pgid);
    drop(gate);
    let shared = Arc::new(PtyShared {
        pgid,
        master,
        exited: Mutex::new(false),
    });
    send_json(conn, &Response::Ok);

    let ctl_shared = Arc::clone(&shared);
    let controller = std::thread::Builder::new()
        .name("envd-pty-ctl".into())
        .stack_size(64 * 1024)
        .spawn(move || control(ctl_sock, wake_r, &ctl_shared));
    if controller.is_err() {
        // nobody would watch the client or type its input
        shared.kill_session();
    }
    let (exit, client_gone) = pump(conn, &exit_rx, &shared);
    let (status, exited_at) =
        exit.unwrap_or_else(|| (exit_rx.recv().unwrap_or(libc::SIGKILL), Instant::now()));
    *shared.exited.lock().unwrap_or_else(|p| p.into_inner()) = true;
    drop(wake_w);
    if let Ok(handle) = controller {
        let _ = handle.join();
    }
    envd.exec_finished(pgid);
    if client_gone {
        return Ok(());
    }
    let (exit_code, signal) = sys::decode_wait_status(status);
    send_json(
        conn,
        &Response::Exit(ExitWire {
            exit_code,
            signal,
            timed_out: false,
            duration_us: u64::try_from(exited_at.saturating_duration_since(started).as_micros())
                .unwrap_or(u64::MAX),
        }),
    );
    Ok(())
}

/// Forwards terminal output until the terminal closes (every process let
/// go of it) or the grace after the leader's exit ends. Returns the wait
/// status and when it came, if it did meanwhile, and whether the client is
/// gone.
fn pump(
    conn: &mut UnixStream,
    exit_rx: &Receiver<libc::c_int>,
    shared: &PtyShared,
) -> (Option<(libc::c_int, Instant)>, bool) {
    let mut master = match shared.master.try_clone() {
        Ok(fd) => File::from(fd),
        Err(_) => {
            shared.kill_session();
            return (None, false);
        }
    };
    let mut buf = vec![0u8; FRAME_HEADER_LEN + CHUNK_SIZE];
    let mut status = None;
    let mut grace_end: Option<Instant> = None;
    let mut client_gone = false;
    // the exit wait is exec's (the same grace after the leader's exit)
    while let Some(timeout_ms) = crate::exec::exit_wait(exit_rx, &mut status, &mut grace_end) {
        let mut fds = [libc::pollfd {
            fd: master.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        if sys::poll(&mut fds, timeout_ms).is_err() {
            break;
        }
        if fds[0].revents == 0 {
            continue;
        }
        let n = match read_retrying(&mut master, &mut buf[FRAME_HEADER_LEN..]) {
            Ok(n) if n > 0 => n + coalesce(&mut master, &mut buf[FRAME_HEADER_LEN + n..]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            // EIO: no process holds the terminal any more
            _ => {
                if status.is_some() {
                    break;
                }
                // wait for the leader's exit without spinning on POLLHUP
                if let Ok(s) = exit_rx.recv() {
                    status = Some((s, Instant::now()));
                }
                break;
            }
        };
        if client_gone {
            continue;
        }
        buf[..FRAME_HEADER_LEN].copy_from_slice(&encode_header(FrameKind::Stdout, n));
        if conn.write_all(&buf[..FRAME_HEADER_LEN + n]).is_err() {
            client_gone = true;
            shared.kill_session();
        }
    }
    (status, client_gone)
}

/// Reads what the terminal already has into `room` without waiting: a
/// program writing line by line (stdio is line-buffered on a terminal)
/// then costs one frame per read-ahead, not one per line. Returns the bytes
/// added; errors are left to the next poll.
fn coalesce(master: &mut File, room: &mut [u8]) -> usize {
    let mut got = 0;
    while room.len() - got >= 1024 {
        match read_retrying(master, &mut room[got..]) {
            Ok(n) if n > 0 => got += n,
            _ => break,
        }
    }
    got
}

/// Types the client's input, applies its control messages and watches it
/// until woken by the pump closing `wake`.
fn control(mut sock: UnixStream, wake: OwnedFd, shared: &PtyShared) {
    let Ok(master) = shared.master.try_clone() else {
        shared.kill_session();
        return;
    };
    let mut master = File::from(master);
    // Frames are read only after poll reports data; a client that sends half
    // a frame only stalls its own session.
    let _ = sock.set_read_timeout(None);
    let mut pending: Vec<u8> = Vec::new();
    let mut offset = 0;
    loop {
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
        if !want_frames {
            fds.push(libc::pollfd {
                fd: master.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            });
        }
        if sys::poll(&mut fds, -1).is_err() {
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds.len() > 2 && fds[2].revents != 0 {
            match master.write(&pending[offset..]) {
                Ok(n) => offset += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // the terminal is gone: the rest of the input is discarded
                Err(_) => offset = pending.len(),
            }
        }
        let sock_ev = fds[1].revents;
        if sock_ev & libc::POLLIN != 0 && want_frames {
            match read_frame(&mut sock) {
                Ok(Some(f)) if f.kind == FrameKind::Data => {
                    pending = f.payload;
                    offset = 0;
                }
                Ok(Some(f)) if f.kind == FrameKind::Control => {
                    // an undecodable or out-of-range message changes nothing
                    match decode_json::<PtyControl>(&f.payload) {
                        Ok(PtyControl::Resize { cols, rows }) => {
                            if check_pty_size(cols, rows).is_ok() {
                                let _ = sys::set_window_size(shared.master.as_fd(), cols, rows);
                            }
                        }
                        Ok(PtyControl::Signal { signal }) => {
                            if let Some(sig) = signal.number() {
                                shared.signal(sig);
                            }
                        }
                        Err(_) => {}
                    }
                }
                // EOF before the exit was sent, or a protocol violation: the
                // client is gone or misbehaving; either way the session dies.
                _ => {
                    shared.kill_session();
                    return;
                }
            }
        } else if sock_ev & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            shared.kill_session();
            return;
        }
        if offset >= pending.len() && !pending.is_empty() {
            pending = Vec::new();
            offset = 0;
        }
    }
}
