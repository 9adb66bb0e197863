//! [`FakeEnvd`]: an in-process server of envd's wire protocol on a unix socket.
//!
//! Concurrency: one accept task per fake, one task per connection (all on the
//! tokio runtime that started the fake); the state sits behind one std mutex,
//! never held across an await. Exec rules run outside the lock, so a rule may
//! call back into the fake (e.g. [`FakeEnvd::put_file`] to mimic a side effect).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use aviary_envd_proto::{
    decode_header, decode_json, encode_header, encode_json, ErrorBody, ErrorCode, ExitWire,
    FileStat, FrameKind, Health, Request, Response, CHUNK_SIZE, FRAME_HEADER_LEN, PROTOCOL_VERSION,
};
use aviary_runtime::EnvdEndpoint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::exec::{self, ExecCall, ExecReply, ExecRule};
use crate::tree::FileTree;

/// Directories every fake envd's file tree starts with.
const INITIAL_DIRS: &[&str] = &["/workspace", "/tmp"];
/// Directory entries per `Data` frame of a listing (well below the data
/// frame limit even for the longest paths).
const LIST_CHUNK: usize = 64;

/// One request the fake answered, in the order the answers were sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdCall {
    /// The request's wire name: `health`, `set_fence`, `kill_all`, `exec`,
    /// `exec_pty`, `read_file`, `write_file`, `list_dir`, `stat`, `mkdir`, `remove`.
    pub method: &'static str,
    /// The token the call carried; for `set_fence`, the fence it asked for.
    pub token: Option<u64>,
    /// The fence when the call arrived.
    pub fence: Option<u64>,
    /// `Err(code)` when the fake answered with an error frame.
    pub result: Result<(), ErrorCode>,
}

/// Which calls a busy fake refuses with [`ErrorCode::Busy`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BusyMode {
    #[default]
    Off,
    /// The general lane is full: exec and file calls are refused, while
    /// `health`, `set_fence` and `kill_all` are still served (the real
    /// envd's reserved control lane).
    GeneralLane,
    /// Both lanes are full: every call is refused.
    AllLanes,
}

#[derive(Default)]
struct Fence {
    current: Option<u64>,
    highest: Option<u64>,
}

struct State {
    fence: Fence,
    tree: FileTree,
    rules: Vec<ExecRule>,
    execs: Vec<ExecCall>,
    calls: Vec<EnvdCall>,
    sweeps: u64,
    busy: BusyMode,
    /// Exec and file calls are answered with bytes outside the protocol.
    garbled: bool,
}

struct Inner {
    socket: PathBuf,
    started: Instant,
    state: Mutex<State>,
    /// `true` once the fake was told to die.
    stop: watch::Sender<bool>,
    /// `true` while the sandbox is paused: connections are accepted but not
    /// answered until it thaws.
    frozen: watch::Sender<bool>,
    /// The accept task; taken (and awaited) by the first [`FakeEnvd::die`].
    task: tokio::sync::Mutex<Option<JoinHandle<()>>>,
}

/// A fake envd serving the real wire protocol on a unix socket in this
/// process. Cheap to clone: clones share the server and its state.
#[derive(Clone)]
pub struct FakeEnvd {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for FakeEnvd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeEnvd")
            .field("socket", &self.inner.socket)
            .field("dead", &self.is_dead())
            .finish()
    }
}

fn fail(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code,
        message: message.into(),
    }
}

/// What the real envd's `check_token` decides: unleased takes no token,
/// leased takes exactly the current fence.
fn check_token(fence: Option<u64>, token: Option<u64>) -> Result<(), ErrorBody> {
    match (fence, token) {
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

impl FakeEnvd {
    /// Binds `socket` (its directory must exist) and starts serving on the
    /// current tokio runtime; the server lives until [`FakeEnvd::die`] or
    /// until that runtime shuts down.
    pub fn start(socket: impl Into<PathBuf>) -> io::Result<FakeEnvd> {
        let socket = socket.into();
        tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
        let listener = UnixListener::bind(&socket)?;
        let inner = Arc::new(Inner {
            socket,
            started: Instant::now(),
            state: Mutex::new(State {
                fence: Fence::default(),
                tree: FileTree::with_dirs(INITIAL_DIRS),
                rules: Vec::new(),
                execs: Vec::new(),
                calls: Vec::new(),
                sweeps: 0,
                busy: BusyMode::Off,
                garbled: false,
            }),
            stop: watch::Sender::new(false),
            frozen: watch::Sender::new(false),
            task: tokio::sync::Mutex::new(None),
        });
        let task = tokio::spawn(accept_loop(Arc::clone(&inner), listener));
        // Nobody else has the mutex yet.
        if let Ok(mut slot) = inner.task.try_lock() {
            *slot = Some(task);
        }
        Ok(FakeEnvd { inner })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state()
    }

    /// The socket the fake listens on.
    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// The pid `SO_PEERCRED` names for the fake's connections: this process.
    pub fn peer_pid(&self) -> u32 {
        std::process::id()
    }

    /// Socket and peer pid, as a runtime reports them.
    pub fn endpoint(&self) -> EnvdEndpoint {
        EnvdEndpoint {
            socket: self.inner.socket.clone(),
            peer_pid: self.peer_pid(),
        }
    }

    /// The current lease fence.
    pub fn fence(&self) -> Option<u64> {
        self.state().fence.current
    }

    /// The highest fence ever set.
    pub fn highest_fence(&self) -> Option<u64> {
        self.state().fence.highest
    }

    /// How many times the fake "ended every process in the sandbox": each
    /// `kill_all` and each `set_fence` that moved the fence.
    pub fn sweeps(&self) -> u64 {
        self.state().sweeps
    }

    /// Adds an exec rule, consulted before older rules and the built-ins
    /// (see [`crate::exec`]); `None` passes the call on.
    pub fn on_exec(&self, rule: impl Fn(&ExecCall) -> Option<ExecReply> + Send + Sync + 'static) {
        self.state().rules.push(Arc::new(rule));
    }

    /// Answers an exec of exactly `argv` with `reply`.
    pub fn on_argv(&self, argv: &[&str], reply: ExecReply) {
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        self.on_exec(move |c| (c.argv == argv).then(|| reply.clone()));
    }

    /// Drops every exec rule (the built-ins stay).
    pub fn clear_exec_rules(&self) {
        self.state().rules.clear();
    }

    /// Every exec the fake accepted, in order.
    pub fn execs(&self) -> Vec<ExecCall> {
        self.state().execs.clone()
    }

    /// Every request the fake answered, in the order of the answers.
    pub fn calls(&self) -> Vec<EnvdCall> {
        self.state().calls.clone()
    }

    /// Forgets the recorded calls and execs.
    pub fn clear_calls(&self) {
        let mut s = self.state();
        s.calls.clear();
        s.execs.clear();
    }

    /// Makes the fake answer `Busy`.
    /// Answers exec and file calls with bytes that are no frame of the
    /// protocol (what a compromised or broken envd could send); `health`,
    /// `set_fence` and `kill_all` stay honest.
    pub fn set_garbled(&self, garbled: bool) {
        self.state().garbled = garbled;
    }

    pub fn set_busy(&self, mode: BusyMode) {
        self.state().busy = mode;
    }

    /// The content of a file in the fake's tree.
    pub fn file(&self, path: &str) -> Option<Vec<u8>> {
        self.state().tree.read(path).ok()
    }

    /// Writes a file into the fake's tree, creating its parent directories.
    pub fn put_file(&self, path: &str, data: impl Into<Vec<u8>>) -> Result<(), ErrorBody> {
        self.state().tree.put(path, data.into()).map(drop)
    }

    /// Every regular file of the fake's tree with its content, by absolute
    /// path (what a snapshot of the fake runtime's layers reads).
    pub fn files(&self) -> Vec<(String, Vec<u8>)> {
        self.state().tree.files()
    }

    /// Metadata of a path in the fake's tree.
    pub fn stat(&self, path: &str) -> Result<FileStat, ErrorBody> {
        self.state().tree.stat(path)
    }

    /// Stops answering requests until [`FakeEnvd::thaw`], like an envd whose
    /// sandbox is frozen: connects still succeed, answers never come.
    pub fn freeze(&self) {
        self.inner.frozen.send_replace(true);
    }

    pub fn thaw(&self) {
        self.inner.frozen.send_replace(false);
    }

    /// Simulates a dead envd: closes the listener (later connects are
    /// refused; the socket file stays, as after a crash) and every open
    /// connection. Returns once both are closed. Idempotent.
    pub async fn die(&self) {
        self.inner.stop.send_replace(true);
        let mut task = self.inner.task.lock().await;
        if let Some(t) = task.take() {
            let _ = t.await;
        }
    }

    /// Whether [`FakeEnvd::die`] was called.
    pub fn is_dead(&self) -> bool {
        *self.inner.stop.borrow()
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn health(&self) -> Health {
        let s = self.state();
        Health {
            version: format!("{}-fake", env!("CARGO_PKG_VERSION")),
            protocol: PROTOCOL_VERSION,
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            fence: s.fence.current,
            highest_fence: s.fence.highest,
            // The fake stands in for envd as a sandbox's PID 1.
            pid1: true,
            // Scripted execs finish at once.
            running_execs: 0,
        }
    }

    /// The real envd's `set_fence`: never below the highest fence seen; a
    /// move to another value sweeps the sandbox (a renewal does not).
    fn set_fence(&self, token: Option<u64>) -> Result<(), ErrorBody> {
        let mut s = self.state();
        if let (Some(t), Some(h)) = (token, s.fence.highest) {
            if t < h {
                return Err(fail(
                    ErrorCode::StaleToken,
                    format!("fence {t} is below the highest fence seen"),
                ));
            }
        }
        if s.fence.current != token {
            s.sweeps += 1;
        }
        if token.is_some() {
            s.fence.highest = token;
        }
        s.fence.current = token;
        Ok(())
    }

    fn check_token(&self, token: Option<u64>) -> Result<(), ErrorBody> {
        check_token(self.state().fence.current, token)
    }
}

async fn accept_loop(inner: Arc<Inner>, listener: UnixListener) {
    let mut stop = inner.stop.subscribe();
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.wait_for(|stopped| *stopped) => break,
            accepted = listener.accept() => {
                if let Ok((conn, _)) = accepted {
                    conns.spawn(serve(Arc::clone(&inner), conn));
                }
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    conns.shutdown().await;
}

type Conn = UnixStream;

async fn read_frame(conn: &mut Conn) -> Result<Option<(FrameKind, Vec<u8>)>, ErrorBody> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    match conn.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(fail(ErrorCode::BadRequest, format!("read frame: {e}"))),
    }
    let (kind, len) = decode_header(h).map_err(|e| fail(ErrorCode::BadRequest, e.to_string()))?;
    let mut payload = vec![0u8; len as usize];
    conn.read_exact(&mut payload)
        .await
        .map_err(|e| fail(ErrorCode::BadRequest, format!("read frame: {e}")))?;
    Ok(Some((kind, payload)))
}

async fn write_frame(conn: &mut Conn, kind: FrameKind, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
    buf.extend_from_slice(&encode_header(kind, payload.len()));
    buf.extend_from_slice(payload);
    conn.write_all(&buf).await
}

// A client that went away is not the fake's problem: send errors are ignored.
async fn send_response(conn: &mut Conn, r: &Response) {
    if let Ok(payload) = encode_json(r) {
        let _ = write_frame(conn, FrameKind::Response, &payload).await;
    }
}

async fn send_error(conn: &mut Conn, body: &ErrorBody) {
    if let Ok(payload) = encode_json(body) {
        let _ = write_frame(conn, FrameKind::Error, &payload).await;
    }
}

/// Reads `Data`* `End` into memory.
async fn receive_data(conn: &mut Conn) -> Result<Vec<u8>, ErrorBody> {
    let mut data = Vec::new();
    loop {
        match read_frame(conn).await? {
            Some((FrameKind::Data, payload)) => data.extend_from_slice(&payload),
            Some((FrameKind::End, _)) => return Ok(data),
            Some((kind, _)) => {
                return Err(fail(
                    ErrorCode::BadRequest,
                    format!("unexpected {kind:?} frame in data"),
                ))
            }
            None => {
                return Err(fail(
                    ErrorCode::BadRequest,
                    "connection closed before end of data",
                ))
            }
        }
    }
}

fn method(req: &Request) -> (&'static str, Option<u64>) {
    match req {
        Request::Health => ("health", None),
        Request::SetFence { token } => ("set_fence", *token),
        Request::KillAll => ("kill_all", None),
        Request::Exec { token, .. } => ("exec", *token),
        Request::ExecPty { token, .. } => ("exec_pty", *token),
        Request::ReadFile { .. } => ("read_file", None),
        Request::WriteFile { token, .. } => ("write_file", *token),
        Request::ListDir { .. } => ("list_dir", None),
        Request::Stat { .. } => ("stat", None),
        Request::Mkdir { token, .. } => ("mkdir", *token),
        Request::Remove { token, .. } => ("remove", *token),
        Request::Connect { token, .. } => ("connect", *token),
        Request::ListProcesses => ("list_processes", None),
        Request::Signal { token, .. } => ("signal", *token),
        Request::Spawn { token, .. } => ("spawn", *token),
        Request::Output { .. } => ("output", None),
    }
}

/// Serves one connection: one request, one answer.
async fn serve(inner: Arc<Inner>, mut conn: Conn) {
    let mut frozen = inner.frozen.subscribe();
    if frozen.wait_for(|f| !*f).await.is_err() {
        return;
    }
    let req = match read_frame(&mut conn).await {
        Ok(None) => return,
        Ok(Some((FrameKind::Request, payload))) => match decode_json::<Request>(&payload) {
            Ok(r) => r,
            Err(e) => {
                let body = fail(ErrorCode::BadRequest, e.to_string());
                return send_error(&mut conn, &body).await;
            }
        },
        Ok(Some((kind, _))) => {
            let body = fail(
                ErrorCode::BadRequest,
                format!("first frame must be a request, got {kind:?}"),
            );
            return send_error(&mut conn, &body).await;
        }
        Err(body) => return send_error(&mut conn, &body).await,
    };
    let (method, token) = method(&req);
    let (fence, busy, garbled) = {
        let s = inner.state();
        (s.fence.current, s.busy, s.garbled)
    };
    let control = matches!(
        req,
        Request::Health | Request::SetFence { .. } | Request::KillAll
    );
    if garbled && !control {
        // a frame header announcing an unknown kind and an absurd length
        let _ = conn
            .write_all(&[0xee, 0xff, 0xff, 0xff, 0xff, b'?', b'?'])
            .await;
        let _ = conn.flush().await;
        return;
    }
    let result = match busy {
        BusyMode::AllLanes => Err(fail(ErrorCode::Busy, "fake envd is busy")),
        BusyMode::GeneralLane if !control => Err(fail(ErrorCode::Busy, "fake envd is busy")),
        _ => dispatch(&inner, &mut conn, req).await,
    };
    let code = match result {
        Ok(()) => Ok(()),
        Err(body) => {
            let code = body.code;
            send_error(&mut conn, &body).await;
            Err(code)
        }
    };
    inner.state().calls.push(EnvdCall {
        method,
        token,
        fence,
        result: code,
    });
}

async fn dispatch(inner: &Inner, conn: &mut Conn, req: Request) -> Result<(), ErrorBody> {
    match req {
        Request::Health => send_response(conn, &Response::Health(inner.health())).await,
        // Every peer of the fake is this process, i.e. "outside the sandbox".
        Request::SetFence { token } => {
            inner.set_fence(token)?;
            send_response(conn, &Response::Ok).await;
        }
        Request::KillAll => {
            inner.state().sweeps += 1;
            send_response(conn, &Response::Ok).await;
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
            inner.check_token(token)?;
            check_exec(inner, &argv, cwd.as_deref(), &env)?;
            let stdin = if stdin {
                Some(receive_data(conn).await?)
            } else {
                None
            };
            let call = ExecCall {
                argv,
                cwd,
                env,
                stdin,
                timeout_ms,
                token,
                user,
            };
            let rules = {
                // Checked again at the "spawn", as envd does under its fence gate.
                let mut s = inner.state();
                check_token(s.fence.current, token)?;
                s.execs.push(call.clone());
                s.rules.clone()
            };
            let reply = exec::answer(&rules, &call);
            send_exec_reply(conn, &reply).await;
        }
        // The fake sandbox has no processes of its own: an empty listing,
        // no pid to signal, no background commands (fenced like envd's).
        Request::ListProcesses => {
            send_response(conn, &Response::Listed { count: 0 }).await;
        }
        Request::Signal { pid, token, .. } => {
            inner.check_token(token)?;
            return Err(fail(ErrorCode::NotFound, format!("process {pid}")));
        }
        Request::Spawn { token, .. } => {
            inner.check_token(token)?;
            return Err(fail(
                ErrorCode::BadRequest,
                "the fake envd runs no background commands",
            ));
        }
        Request::Output { handle, .. } => {
            return Err(fail(
                ErrorCode::NotFound,
                format!("background command {handle}"),
            ));
        }
        Request::Connect { port, token } => {
            // fenced like envd's; the fake sandbox runs no servers
            inner.check_token(token)?;
            return Err(fail(
                ErrorCode::PortUnreachable,
                format!("nothing listens on port {port} in the fake sandbox"),
            ));
        }
        // A terminal session answers like an exec whose output the
        // terminal merged; the client's input is not read.
        Request::ExecPty {
            argv,
            cwd,
            env,
            user,
            token,
            ..
        } => {
            inner.check_token(token)?;
            check_exec(inner, &argv, cwd.as_deref(), &env)?;
            let call = ExecCall {
                argv,
                cwd,
                env,
                stdin: None,
                timeout_ms: None,
                token,
                user,
            };
            let rules = {
                let mut s = inner.state();
                check_token(s.fence.current, token)?;
                s.execs.push(call.clone());
                s.rules.clone()
            };
            let mut reply = exec::answer(&rules, &call);
            reply.stdout.append(&mut reply.stderr);
            send_response(conn, &Response::Ok).await;
            send_exec_reply(conn, &reply).await;
        }
        Request::ReadFile { path } => {
            let data = inner.state().tree.read(&path)?;
            send_response(
                conn,
                &Response::Opened {
                    size: data.len() as u64,
                },
            )
            .await;
            for chunk in data.chunks(CHUNK_SIZE) {
                if write_frame(conn, FrameKind::Data, chunk).await.is_err() {
                    return Ok(());
                }
            }
            let _ = write_frame(conn, FrameKind::End, &[]).await;
        }
        Request::WriteFile { path, mode, token } => {
            inner.check_token(token)?;
            inner.state().tree.check_write(&path, mode)?;
            let data = receive_data(conn).await?;
            let bytes = {
                // The fence may have moved during the upload: checked again at the commit.
                let mut s = inner.state();
                check_token(s.fence.current, token)?;
                s.tree.write(&path, mode, data)?
            };
            send_response(conn, &Response::Written { bytes }).await;
        }
        Request::ListDir { path } => {
            let entries = inner.state().tree.list(&path)?;
            for chunk in entries.chunks(LIST_CHUNK) {
                let payload = serde_json::to_vec(chunk)
                    .map_err(|e| fail(ErrorCode::Internal, e.to_string()))?;
                if write_frame(conn, FrameKind::Data, &payload).await.is_err() {
                    return Ok(());
                }
            }
            let count = entries.len() as u64;
            send_response(conn, &Response::Listed { count }).await;
        }
        Request::Stat { path } => {
            let st = inner.state().tree.stat(&path)?;
            send_response(conn, &Response::Stat(st)).await;
        }
        Request::Mkdir {
            path,
            parents,
            token,
        } => {
            {
                let mut s = inner.state();
                check_token(s.fence.current, token)?;
                s.tree.mkdir(&path, parents)?;
            }
            send_response(conn, &Response::Ok).await;
        }
        Request::Remove {
            path,
            recursive,
            token,
        } => {
            {
                let mut s = inner.state();
                check_token(s.fence.current, token)?;
                s.tree.remove(&path, recursive)?;
            }
            send_response(conn, &Response::Ok).await;
        }
    }
    Ok(())
}

/// The checks envd makes before it spawns (argv, env, cwd).
fn check_exec(
    inner: &Inner,
    argv: &[String],
    cwd: Option<&str>,
    env: &[(String, String)],
) -> Result<(), ErrorBody> {
    if argv.is_empty() {
        return Err(fail(ErrorCode::BadRequest, "argv is empty"));
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(fail(ErrorCode::BadRequest, "argv contains a NUL byte"));
    }
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(fail(
                ErrorCode::BadRequest,
                format!("invalid environment variable {k:?}"),
            ));
        }
    }
    if let Some(cwd) = cwd {
        if cwd.contains('\0') {
            return Err(fail(ErrorCode::BadRequest, "exec cwd contains a NUL byte"));
        }
        match inner.state().tree.stat(cwd) {
            Ok(st) if st.kind == aviary_envd_proto::FileKind::Dir => {}
            Ok(_) => {
                return Err(fail(
                    ErrorCode::InvalidPath,
                    format!("exec cwd {cwd:?} is not a directory"),
                ))
            }
            Err(_) => {
                return Err(fail(
                    ErrorCode::InvalidPath,
                    format!("exec cwd {cwd:?} does not exist"),
                ))
            }
        }
    }
    Ok(())
}

async fn send_exec_reply(conn: &mut Conn, reply: &ExecReply) {
    for (kind, data) in [
        (FrameKind::Stdout, &reply.stdout),
        (FrameKind::Stderr, &reply.stderr),
    ] {
        for chunk in data.chunks(CHUNK_SIZE) {
            if write_frame(conn, kind, chunk).await.is_err() {
                return;
            }
        }
    }
    let exit = Response::Exit(ExitWire {
        exit_code: reply.exit_code,
        signal: reply.signal,
        timed_out: reply.timed_out,
        duration_us: 0,
    });
    send_response(conn, &exit).await;
}
