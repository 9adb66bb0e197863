//! envd's shared state (lease fence, running exec groups, the file system) and
//! the handling of one connection.
//!
//! Invariants:
//! - The fence only moves through [`Envd::set_fence`], which accepts callers
//!   outside the sandbox only (SO_PEERCRED pid 0 = a peer in an ancestor PID
//!   namespace) unless `--trust-all-peers` was given, and never lowers the fence
//!   below the highest value seen.
//! - Moving the fence to a different value (a new holder, an expiry, a release,
//!   a first lease) first ends every process in the sandbox but envd
//!   ([`crate::sweep`]); setting the same value again is a renewal and kills
//!   nothing. So a new lease starts with no process left from the previous
//!   holder. If processes survive the bounded wait, the fence still moves (the
//!   old token is refused from then on) but the answer is an error, and the
//!   next `set_fence`, even to the same value, sweeps again.
//! - Mutating operations check the fence before doing anything, and again at
//!   the moment they take effect (exec and exec_pty: the spawn; write: the rename that
//!   publishes the file; mkdir/remove: the whole call) while holding the *fence
//!   gate* for reading. `set_fence` holds the gate for writing across the sweep
//!   and the move, so no work authorised by an old token starts or lands after
//!   the fence moved.
//! - Port tunnels ([`crate::tunnel`]) and background commands
//!   ([`crate::procs`]) are fenced the same way; a fence move also closes every
//!   tunnel and forgets every background handle before the sweep, so the old
//!   holder keeps no way into the sandbox and the new one reads none of its
//!   output.
//! - A live fork's envd (restored from its parent's memory image) forgets the
//!   parent's fence without ending any process ([`Envd::forget_lease`]): the
//!   child starts unleased, and its first lease moves the fence as usual.
//!
//! Lanes: [`MAX_CONNECTIONS`] general connections, plus [`CONTROL_LANE`]
//! reserved ones that serve only `health`, `set_fence` and `kill_all`; and one
//! control thread, started at boot, takes such calls when no slot or no new
//! thread is available (a sandbox at its pids limit), so the host's control
//! calls cannot be starved by long execs or a fork bomb.
//!
//! Concurrency: one thread per connection, at most [`MAX_CONNECTIONS`]; the
//! fence and the exec table are behind mutexes held only for map/field updates;
//! the fence gate (a read-write lock) is held by readers only around the
//! effect of one fenced call.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use aviary_envd_proto::{
    decode_json, encode_json, read_frame, write_frame, ErrorBody, ErrorCode, FileStat, FrameKind,
    Health, Request, Response, CHUNK_SIZE, MAX_JSON_FRAME, PROTOCOL_VERSION,
};

use crate::exec::{self, ExecRequest};
use crate::files::{map_io, SandboxFs};
use crate::reaper::Reaper;
use crate::{sweep, sys};

/// Most general connections (exec, files) served at once; more are answered
/// `Busy`.
pub const MAX_CONNECTIONS: usize = 128;
/// Connections reserved for the control plane's control calls (`health`,
/// `set_fence`) when the general lane is full: long execs and file streams
/// can never keep a fence move or a health probe out.
pub const CONTROL_LANE: usize = 8;
/// How long envd waits for the next frame from a client (outside exec).
const READ_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy)]
struct Fence {
    current: Option<u64>,
    highest: Option<u64>,
    /// Whether the last move of the fence ended every process of the previous
    /// holder; when not, the next `set_fence` sweeps even for the same value.
    swept: bool,
}

impl Default for Fence {
    fn default() -> Fence {
        Fence {
            current: None,
            highest: None,
            swept: true,
        }
    }
}

/// Held (for reading) while a fenced call takes effect; see the module docs.
pub struct FenceGuard<'a> {
    _gate: RwLockReadGuard<'a, ()>,
}

/// Daemon-wide state.
pub struct Envd {
    pub started: Instant,
    pub pid1: bool,
    pub trust_all_peers: bool,
    /// With `--bridge`: envd's own pid, the peer of every bridged
    /// connection (the host), which may move the fence like a peer outside.
    pub bridge_peer: Option<i32>,
    /// The socket is a gVisor host socket (`--gvisor-host-socket`): a peer
    /// whose pid is envd's own is the host.
    pub gvisor_host_socket: bool,
    /// Root of the file API, and the default working directory of exec.
    pub root: PathBuf,
    pub fs: SandboxFs,
    pub reaper: Reaper,
    fence: Mutex<Fence>,
    fence_gate: RwLock<()>,
    running_groups: Mutex<HashSet<i32>>,
    /// Open port tunnels, closed when the fence moves ([`crate::tunnel`]).
    pub tunnels: crate::tunnel::Tunnels,
    /// Background commands and their kept output ([`crate::procs`]).
    pub background: crate::procs::Background,
    connections: AtomicUsize,
    control_connections: AtomicUsize,
}

impl Envd {
    /// See [`Envd::gvisor_host_socket`].
    pub fn with_gvisor_host_socket(mut self, on: bool) -> Envd {
        self.gvisor_host_socket = on;
        self
    }
}

fn fail(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code,
        message: message.into(),
    }
}

impl Envd {
    pub fn new(root: PathBuf, fs: SandboxFs, pid1: bool, trust_all_peers: bool) -> Envd {
        Envd {
            started: Instant::now(),
            pid1,
            trust_all_peers,
            bridge_peer: None,
            gvisor_host_socket: false,
            root,
            fs,
            reaper: Reaper::default(),
            fence: Mutex::new(Fence::default()),
            fence_gate: RwLock::new(()),
            running_groups: Mutex::new(HashSet::new()),
            tunnels: Default::default(),
            background: Default::default(),
            connections: AtomicUsize::new(0),
            control_connections: AtomicUsize::new(0),
        }
    }

    fn fence(&self) -> std::sync::MutexGuard<'_, Fence> {
        self.fence.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks a mutating call's token against the fence.
    pub fn check_token(&self, token: Option<u64>) -> Result<(), ErrorBody> {
        match (self.fence().current, token) {
            (None, None) => Ok(()),
            (Some(f), Some(t)) if f == t => Ok(()),
            (Some(_), None) => Err(fail(
                ErrorCode::LeaseRequired,
                "sandbox is leased: token required",
            )),
            (_, Some(_)) => Err(fail(
                ErrorCode::StaleToken,
                "token is not the current lease fence",
            )),
        }
    }

    /// Checks `token` against the fence and holds the fence gate: the fence
    /// cannot move until the returned guard is dropped.
    pub fn enter_fence(&self, token: Option<u64>) -> Result<FenceGuard<'_>, ErrorBody> {
        let gate = self.fence_gate.read().unwrap_or_else(|p| p.into_inner());
        self.check_token(token)?;
        Ok(FenceGuard { _gate: gate })
    }

    /// Runs `op` if `token` is the current fence, with the fence held still.
    pub fn fenced<T>(
        &self,
        token: Option<u64>,
        op: impl FnOnce() -> Result<T, ErrorBody>,
    ) -> Result<T, ErrorBody> {
        let _gate = self.enter_fence(token)?;
        op()
    }

    /// Moves the fence; refuses to go below the highest fence seen. A move to a
    /// different value first ends every other process in the sandbox (see the
    /// module docs); a renewal (same value) kills nothing.
    pub fn set_fence(&self, token: Option<u64>) -> Result<(), ErrorBody> {
        let _gate = self.fence_gate.write().unwrap_or_else(|p| p.into_inner());
        let before = *self.fence();
        if let Some(t) = token {
            if before.highest.is_some_and(|h| t < h) {
                return Err(fail(
                    ErrorCode::StaleToken,
                    format!("fence {t} is below the highest fence seen"),
                ));
            }
        }
        let swept = if before.current != token || !before.swept {
            self.tunnels.close_all();
            self.background.clear();
            sweep::end_all_processes(self)
        } else {
            Ok(())
        };
        let mut f = self.fence();
        if token.is_some() {
            f.highest = token;
        }
        f.current = token;
        f.swept = swept.is_ok();
        swept.map_err(|left| {
            fail(
                ErrorCode::Internal,
                format!(
                    "{left} process(es) of the previous lease holder survived SIGKILL for {:?}; \
                     the fence moved but the sandbox is not clean",
                    sweep::SWEEP_TIMEOUT
                ),
            )
        })
    }

    /// Forgets the lease state this envd was restored with, keeping every
    /// process: the sandbox is a new one (a live fork, `hostsock`'s
    /// `SIGHUP`), restored from a memory image of its parent. The fence
    /// becomes unleased with no fence seen (the child's lease counter is its
    /// own), and the parent holder's tunnels and background handles go, so
    /// nothing authorised by the parent's lease reaches the child.
    pub fn forget_lease(&self) {
        let _gate = self.fence_gate.write().unwrap_or_else(|p| p.into_inner());
        self.tunnels.close_all();
        self.background.clear();
        *self.fence() = Fence::default();
    }

    /// Ends every process but envd, the fence unchanged (a level-1 reset).
    pub fn kill_all(&self) -> Result<(), ErrorBody> {
        let _gate = self.fence_gate.write().unwrap_or_else(|p| p.into_inner());
        self.tunnels.close_all();
        sweep::end_all_processes(self).map_err(|left| {
            fail(
                ErrorCode::Internal,
                format!(
                    "{left} process(es) survived SIGKILL for {:?}",
                    sweep::SWEEP_TIMEOUT
                ),
            )
        })
    }

    pub fn exec_started(&self, pgid: i32) {
        self.groups().insert(pgid);
    }

    pub fn exec_finished(&self, pgid: i32) {
        self.groups().remove(&pgid);
    }

    fn groups(&self) -> std::sync::MutexGuard<'_, HashSet<i32>> {
        self.running_groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Kills the process groups of every running exec.
    pub fn kill_running_groups(&self) {
        for &g in self.groups().iter() {
            sys::kill_group(g, libc::SIGKILL);
        }
    }

    fn health(&self) -> Health {
        let f = *self.fence();
        Health {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol: PROTOCOL_VERSION,
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            fence: f.current,
            highest_fence: f.highest,
            pid1: self.pid1,
            running_execs: self.groups().len() as u64,
        }
    }

    /// Connections holding a slot right now (both lanes).
    pub fn live_connections(&self) -> usize {
        self.connections.load(Ordering::Acquire) + self.control_connections.load(Ordering::Acquire)
    }

    /// Reserves a connection slot; `None` when at the limit.
    pub fn try_acquire_connection(self: &Arc<Self>) -> Option<ConnectionSlot> {
        for (lane, counter, limit) in [
            (Lane::General, &self.connections, MAX_CONNECTIONS),
            (Lane::Control, &self.control_connections, CONTROL_LANE),
        ] {
            let prev = counter.fetch_add(1, Ordering::AcqRel);
            if prev < limit {
                return Some(ConnectionSlot(Arc::clone(self), lane));
            }
            counter.fetch_sub(1, Ordering::AcqRel);
        }
        None
    }
}

/// A reserved connection slot, released on drop.
pub struct ConnectionSlot(Arc<Envd>, Lane);

/// Which pool a connection's slot came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    General,
    /// Only `health` and `set_fence` are served on it.
    Control,
}

impl ConnectionSlot {
    pub fn envd(&self) -> &Envd {
        &self.0
    }

    pub fn lane(&self) -> Lane {
        self.1
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        match self.1 {
            Lane::General => self.0.connections.fetch_sub(1, Ordering::AcqRel),
            Lane::Control => self.0.control_connections.fetch_sub(1, Ordering::AcqRel),
        };
    }
}

/// Sends an `Error` frame, ignoring a client that already went away.
pub fn send_error(conn: &mut UnixStream, body: &ErrorBody) {
    if let Ok(payload) = encode_json(body) {
        let _ = write_frame(conn, FrameKind::Error, &payload);
    }
}

fn send_response(conn: &mut UnixStream, r: &Response) {
    match encode_json(r) {
        Ok(payload) => {
            let _ = write_frame(conn, FrameKind::Response, &payload);
        }
        Err(e) => send_error(conn, &fail(ErrorCode::Internal, e.to_string())),
    }
}

/// Serves one connection: one request, then the connection is closed.
pub fn handle_connection(envd: &Envd, lane: Lane, mut conn: UnixStream) {
    let _ = conn.set_read_timeout(Some(READ_TIMEOUT));
    let req = match read_frame(&mut conn) {
        Ok(None) => return,
        Ok(Some(f)) if f.kind == FrameKind::Request => match decode_json::<Request>(&f.payload) {
            Ok(r) => r,
            Err(e) => {
                let detail = std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                return send_error(
                    &mut conn,
                    &fail(ErrorCode::BadRequest, format!("{e}: {detail}")),
                );
            }
        },
        Ok(Some(f)) => {
            return send_error(
                &mut conn,
                &fail(
                    ErrorCode::BadRequest,
                    format!("first frame must be a request, got {:?}", f.kind),
                ),
            )
        }
        Err(e) => return send_error(&mut conn, &fail(ErrorCode::BadRequest, e.to_string())),
    };
    if lane == Lane::Control
        && !matches!(
            req,
            Request::Health | Request::SetFence { .. } | Request::KillAll
        )
    {
        send_error(
            &mut conn,
            &fail(
                ErrorCode::Busy,
                format!("envd serves at most {MAX_CONNECTIONS} connections"),
            ),
        );
        // Closing with unread frames (an exec's stdin) would reset the
        // connection and the client would see a broken pipe, not `Busy`:
        // read what is left, briefly and boundedly.
        let _ = conn.shutdown(std::net::Shutdown::Write);
        let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
        let _ = std::io::copy(&mut (&mut conn).take(1 << 20), &mut std::io::sink());
        return;
    }
    if let Err(body) = dispatch(envd, &mut conn, req) {
        send_error(&mut conn, &body);
    }
}

/// Control operations are accepted only from a peer in an ancestor PID
/// namespace (SO_PEERCRED pid 0: the host) or, with `--bridge`, from the
/// bridge (envd's own pid: a connection the host opened through it),
/// unless `--trust-all-peers`.
/// Under gVisor (`--gvisor-host-socket`) the host's connections show envd's
/// own pid, which no other process of the sandbox has (and none of them can
/// connect to that socket at all).
fn require_outside_peer(envd: &Envd, conn: &UnixStream, op: &str) -> Result<(), ErrorBody> {
    let trusted = envd.trust_all_peers || {
        let peer = sys::peer_pid(conn.as_fd())
            .map_err(|e| fail(ErrorCode::Internal, format!("peer credentials: {e}")))?;
        peer == 0
            || (envd.gvisor_host_socket && peer == sys::getpid())
            || Some(peer) == envd.bridge_peer
    };
    if trusted {
        Ok(())
    } else {
        Err(fail(
            ErrorCode::PermissionDenied,
            format!("{op} is accepted only from outside the sandbox"),
        ))
    }
}

fn dispatch(envd: &Envd, conn: &mut UnixStream, req: Request) -> Result<(), ErrorBody> {
    match req {
        Request::Health => send_response(conn, &Response::Health(envd.health())),
        Request::SetFence { token } => {
            require_outside_peer(envd, conn, "set_fence")?;
            envd.set_fence(token)?;
            send_response(conn, &Response::Ok);
        }
        Request::KillAll => {
            require_outside_peer(envd, conn, "kill_all")?;
            envd.kill_all()?;
            send_response(conn, &Response::Ok);
        }
        Request::Exec {
            argv,
            cwd,
            env,
            stdin,
            timeout_ms,
            token,
            user,
        } => {
            envd.check_token(token)?;
            exec::run(
                envd,
                conn,
                ExecRequest {
                    argv,
                    cwd,
                    env,
                    stdin,
                    timeout: timeout_ms.map(Duration::from_millis),
                    token,
                    user,
                },
            )?;
        }
        Request::ExecPty {
            argv,
            cwd,
            env,
            user,
            cols,
            rows,
            token,
        } => {
            envd.check_token(token)?;
            crate::pty::run(
                envd,
                conn,
                crate::pty::PtyRequest {
                    argv,
                    cwd,
                    env,
                    user,
                    cols,
                    rows,
                    token,
                },
            )?;
        }
        Request::ReadFile { path } => read_file(envd, conn, &path)?,
        Request::WriteFile { path, mode, token } => {
            envd.check_token(token)?;
            let staged = envd
                .fs
                .stage_write(&path, mode, |file| receive_data(conn, file, &path))?;
            // Checked again at the rename: the fence may have moved during the upload.
            let n = envd.fenced(token, || staged.commit())?;
            send_response(conn, &Response::Written { bytes: n });
        }
        Request::ListDir { path } => {
            let entries = envd.fs.list(&path)?;
            send_listing(conn, &entries);
        }
        Request::Stat { path } => {
            let st = envd.fs.stat(&path)?;
            send_response(conn, &Response::Stat(st));
        }
        Request::Mkdir {
            path,
            parents,
            token,
        } => {
            envd.fenced(token, || envd.fs.mkdir(&path, parents))?;
            send_response(conn, &Response::Ok);
        }
        Request::Remove {
            path,
            recursive,
            token,
        } => {
            envd.fenced(token, || envd.fs.remove(&path, recursive))?;
            send_response(conn, &Response::Ok);
        }
        Request::Connect { port, token } => crate::tunnel::run(envd, conn, port, token)?,
        Request::ListProcesses => crate::procs::send_list(conn, &crate::procs::list()?),
        Request::Signal { pid, signal, token } => {
            crate::procs::signal(envd, pid, signal, token)?;
            send_response(conn, &Response::Ok);
        }
        Request::Spawn {
            argv,
            cwd,
            env,
            token,
            user,
        } => {
            envd.check_token(token)?;
            let (handle, pid) = crate::procs::spawn(
                envd,
                crate::procs::SpawnRequest {
                    argv,
                    cwd,
                    env,
                    token,
                    user,
                },
            )?;
            send_response(conn, &Response::Spawned { handle, pid });
        }
        Request::Output { handle, follow } => crate::procs::output(envd, conn, handle, follow)?,
    }
    Ok(())
}

fn read_file(envd: &Envd, conn: &mut UnixStream, path: &str) -> Result<(), ErrorBody> {
    let (mut file, size) = envd.fs.open_read(path)?;
    send_response(conn, &Response::Opened { size });
    let mut buf = vec![0u8; CHUNK_SIZE];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(map_io(path, &e)),
        };
        if write_frame(conn, FrameKind::Data, &buf[..n]).is_err() {
            return Ok(()); // client gone
        }
    }
    let _ = write_frame(conn, FrameKind::End, &[]);
    Ok(())
}

/// Copies `Data` frames into `file` until `End`.
fn receive_data(
    conn: &mut UnixStream,
    file: &mut std::fs::File,
    path: &str,
) -> Result<u64, ErrorBody> {
    let mut total = 0u64;
    loop {
        match read_frame(conn) {
            Ok(Some(f)) if f.kind == FrameKind::Data => {
                file.write_all(&f.payload).map_err(|e| map_io(path, &e))?;
                total += f.payload.len() as u64;
            }
            Ok(Some(f)) if f.kind == FrameKind::End => return Ok(total),
            Ok(Some(f)) => {
                return Err(fail(
                    ErrorCode::BadRequest,
                    format!("unexpected {:?} frame in file data", f.kind),
                ))
            }
            Ok(None) => {
                return Err(fail(
                    ErrorCode::BadRequest,
                    "connection closed before end of file data",
                ))
            }
            Err(e) => return Err(fail(ErrorCode::BadRequest, e.to_string())),
        }
    }
}

/// Sends directory entries as JSON arrays in `Data` frames, each well below the
/// JSON frame limit, then `Listed`.
fn send_listing(conn: &mut UnixStream, entries: &[FileStat]) {
    let budget = (MAX_JSON_FRAME as usize) / 2;
    let mut start = 0;
    let mut size = 0;
    for (i, e) in entries.iter().enumerate() {
        // name and path dominate an entry's encoded size; 128 covers the rest.
        let est = e.name.len() * 2 + e.path.len() * 2 + 128;
        if size + est > budget && i > start {
            if send_chunk(conn, &entries[start..i]).is_err() {
                return;
            }
            start = i;
            size = 0;
        }
        size += est;
    }
    if start < entries.len() && send_chunk(conn, &entries[start..]).is_err() {
        return;
    }
    send_response(
        conn,
        &Response::Listed {
            count: entries.len() as u64,
        },
    );
}

fn send_chunk(conn: &mut UnixStream, chunk: &[FileStat]) -> Result<(), ()> {
    let payload = serde_json::to_vec(chunk).map_err(|_| ())?;
    write_frame(conn, FrameKind::Data, &payload).map_err(|_| ())
}
