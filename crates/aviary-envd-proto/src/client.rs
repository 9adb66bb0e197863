//! The async client the control plane uses to talk to envd.
//!
//! Every call opens its own connection (envd serves one request per
//! connection), so an [`EnvdClient`] is just an address: cheap to clone and
//! safe to share between tasks. Long-running results ([`ExecStream`],
//! [`FileReader`]) own their connection; dropping them closes it, and envd then
//! kills the exec's process group.
//!
//! Two transports carry the same frames:
//! - **unix** ([`EnvdClient::new`]): the sandbox's envd socket on this host.
//!   The socket path's final component must not be a symlink (checked with
//!   `lstat` before every connect). With [`EnvdClient::expect_peer_pid`] every
//!   connection is also checked with `SO_PEERCRED` before the request is sent:
//!   its peer must be the sandbox's init process (envd, which called `listen`
//!   on the socket itself), so a socket swapped for another sandbox's is
//!   refused with [`EnvdError::PeerMismatch`];
//! - **node** ([`EnvdClient::remote`]): a TCP connection to the node agent
//!   that runs the sandbox. The client sends one HTTP/1.1 request,
//!   `GET /node/v1/sandboxes/{id}/envd` with `Authorization: Bearer <node
//!   token>`, `Connection: Upgrade` and `Upgrade: aviary-envd`; the node
//!   answers `101 Switching Protocols` and from then on splices the TCP
//!   connection to the sandbox's envd socket byte for byte. Any other answer
//!   is the node's JSON error ([`EnvdError::Node`]). Nothing follows the 101
//!   before the client's first frame (envd never speaks first), so the client
//!   can read the answer head without buffering protocol bytes.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::task::JoinHandle;

mod pty;
pub use pty::{PtyEvent, PtyInput, PtyOutput, PtySpec};

use crate::{
    decode_header, decode_json, encode_header, encode_json, ErrorBody, ErrorCode, FileStat,
    FrameKind, Health, ProtoError, Request, Response, CHUNK_SIZE, FRAME_HEADER_LEN,
};

/// Errors of the envd client. The semantic variants map one-to-one onto API errors.
#[derive(Debug, thiserror::Error)]
pub enum EnvdError {
    /// The socket could not be reached (envd not (yet) running, or gone).
    #[error("connect to envd")]
    Connect(#[source] io::Error),
    /// The connection failed after it was established.
    #[error("envd connection")]
    Transport(#[source] io::Error),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid path: {0}")]
    InvalidPath(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    #[error("directory not empty: {0}")]
    NotEmpty(String),
    /// The sandbox is leased and the call carried no token.
    #[error("lease required")]
    LeaseRequired,
    /// The call's token is not the sandbox's current fence.
    #[error("stale token")]
    StaleToken,
    /// Nothing accepts connections on the port a tunnel asked for.
    #[error("port unreachable: {0}")]
    PortUnreachable(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The path is a FIFO, socket or device where a regular file is required.
    #[error("not a regular file: {0}")]
    NotRegularFile(String),
    /// The sandbox's disk or quota is full.
    #[error("no space left in the sandbox: {0}")]
    NoSpace(String),
    /// The process listening on the socket is not the sandbox's init process:
    /// the socket is not the one of this sandbox. Nothing was sent.
    #[error("envd socket peer is pid {got:?}, not the sandbox init {expected}")]
    PeerMismatch { expected: u32, got: Option<i32> },
    /// envd refused the request as malformed.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// envd is at its connection limit.
    #[error("envd busy")]
    Busy,
    /// envd broke the protocol (or the client received something it cannot parse).
    #[error("envd protocol")]
    Protocol(#[source] ProtoError),
    /// Any other failure reported by envd.
    #[error("envd: {0}")]
    Remote(String),
    #[error("envd not ready after {0:?}")]
    NotReady(Duration),
    /// The node agent refused to open the envd connection (bad token,
    /// unknown sandbox, ...): its HTTP status and message.
    #[error("node refused the envd connection ({status}): {message}")]
    Node { status: u16, message: String },
    /// `next()` was called after the exec's exit was already returned.
    #[error("exec stream already finished")]
    StreamFinished,
}

impl EnvdError {
    /// The stable API error code of this failure (`aviary_core::ErrorCode`,
    /// the control plane's one table).
    pub fn code(&self) -> aviary_core::ErrorCode {
        use aviary_core::ErrorCode as C;
        match self {
            EnvdError::NotFound(_) => C::NotFound,
            EnvdError::InvalidPath(_) => C::InvalidPath,
            EnvdError::LeaseRequired => C::LeaseRequired,
            EnvdError::StaleToken => C::StaleToken,
            EnvdError::PortUnreachable(_) => C::PortUnreachable,
            // refusals for the caller's input or the sandbox's contents
            EnvdError::BadRequest(_)
            | EnvdError::AlreadyExists(_)
            | EnvdError::NotEmpty(_)
            | EnvdError::NoSpace(_) => C::InvalidRequest,
            EnvdError::PermissionDenied(_) | EnvdError::NotRegularFile(_) => C::PermissionDenied,
            EnvdError::Busy => C::Busy,
            // envd up but unreachable for now (a gone envd is turned into
            // `sandbox_lost` by the control plane before its error is mapped)
            EnvdError::Connect(_) | EnvdError::Transport(_) => C::Unavailable,
            EnvdError::Node { status: 503, .. } => C::Unavailable,
            EnvdError::Node { .. }
            | EnvdError::PeerMismatch { .. }
            | EnvdError::Protocol(_)
            | EnvdError::Remote(_)
            | EnvdError::NotReady(_)
            | EnvdError::StreamFinished => C::Internal,
        }
    }

    fn from_body(body: ErrorBody) -> EnvdError {
        let m = body.message;
        match body.code {
            ErrorCode::NotFound => EnvdError::NotFound(m),
            ErrorCode::InvalidPath => EnvdError::InvalidPath(m),
            ErrorCode::AlreadyExists => EnvdError::AlreadyExists(m),
            ErrorCode::NotEmpty => EnvdError::NotEmpty(m),
            ErrorCode::LeaseRequired => EnvdError::LeaseRequired,
            ErrorCode::StaleToken => EnvdError::StaleToken,
            ErrorCode::PermissionDenied => EnvdError::PermissionDenied(m),
            ErrorCode::NotRegularFile => EnvdError::NotRegularFile(m),
            ErrorCode::NoSpace => EnvdError::NoSpace(m),
            ErrorCode::BadRequest => EnvdError::BadRequest(m),
            ErrorCode::Busy => EnvdError::Busy,
            ErrorCode::Internal => EnvdError::Remote(m),
            ErrorCode::PortUnreachable => EnvdError::PortUnreachable(m),
        }
    }

    /// envd cannot be reached (yet): worth retrying while it starts. A refused
    /// socket path (a symlink) is not: it will not fix itself.
    fn is_not_ready(&self) -> bool {
        match self {
            EnvdError::Connect(e) => e.kind() != io::ErrorKind::InvalidInput,
            EnvdError::Transport(_) | EnvdError::Node { status: 503, .. } => true,
            _ => false,
        }
    }

    fn unexpected(kind: FrameKind) -> EnvdError {
        EnvdError::Protocol(ProtoError::UnexpectedFrame(kind))
    }
}

/// Where a process's stdin comes from when it is streamed.
pub type StdinSource = Pin<Box<dyn AsyncRead + Send>>;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct ExecSpec {
    /// Program and arguments (a shell string becomes `["/bin/sh", "-c", s]`).
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    /// Added to envd's clean default environment (PATH, HOME=/root, LANG=C.UTF-8).
    pub env: Vec<(String, String)>,
    /// Written to the process's stdin, which is then closed. `None`: stdin is /dev/null.
    pub stdin: Option<Vec<u8>>,
    /// Kills the whole process group when exceeded.
    pub timeout: Option<Duration>,
    /// The sandbox user to run as (`name`, `uid`, `name:group`, `uid:gid`).
    pub user: Option<String>,
}

/// How an exec ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit code, or 128 + signal number when the process was killed by a signal.
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration: Duration,
}

/// One event of a running exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// Always the last event.
    Exit(ExitInfo),
}

/// The collected result of an exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExitInfo,
}

/// A running exec. Dropping it before [`ExecEvent::Exit`] closes the connection,
/// and envd kills the process group.
#[derive(Debug)]
pub struct ExecStream {
    conn: Conn,
    stdin_writer: Option<JoinHandle<io::Result<()>>>,
    finished: bool,
}

impl ExecStream {
    /// The next output chunk, or the exit (always last).
    pub async fn next(&mut self) -> Result<ExecEvent, EnvdError> {
        if self.finished {
            return Err(EnvdError::StreamFinished);
        }
        let (kind, payload) = read_frame(&mut self.conn).await?;
        match kind {
            FrameKind::Stdout => Ok(ExecEvent::Stdout(payload)),
            FrameKind::Stderr => Ok(ExecEvent::Stderr(payload)),
            FrameKind::Response => {
                self.finished = true;
                match decode_json::<Response>(&payload).map_err(EnvdError::Protocol)? {
                    Response::Exit(w) => Ok(ExecEvent::Exit(ExitInfo {
                        exit_code: w.exit_code,
                        signal: w.signal,
                        timed_out: w.timed_out,
                        duration: Duration::from_micros(w.duration_us),
                    })),
                    _ => Err(EnvdError::unexpected(kind)),
                }
            }
            FrameKind::Error => {
                self.finished = true;
                Err(error_from_payload(&payload))
            }
            other => Err(EnvdError::unexpected(other)),
        }
    }

    /// Collects all output in memory (for bounded commands) and the exit.
    pub async fn collect(mut self) -> Result<ExecOutput, EnvdError> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        loop {
            match self.next().await? {
                ExecEvent::Stdout(b) => stdout.extend_from_slice(&b),
                ExecEvent::Stderr(b) => stderr.extend_from_slice(&b),
                ExecEvent::Exit(exit) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        exit,
                    })
                }
            }
        }
    }
}

impl Drop for ExecStream {
    fn drop(&mut self) {
        if let Some(w) = self.stdin_writer.take() {
            w.abort();
        }
    }
}

/// The content of a file being read; implements [`AsyncRead`]. An error reported
/// by envd mid-stream surfaces as an `io::Error` wrapping an [`EnvdError`].
#[derive(Debug)]
pub struct FileReader {
    conn: Conn,
    size: u64,
    /// Payload bytes of the current `Data` frame not yet handed out.
    remaining: usize,
    header: [u8; FRAME_HEADER_LEN],
    header_filled: usize,
    /// Set while the payload of an `Error` frame is being read.
    error: Option<(Vec<u8>, usize)>,
    done: bool,
}

impl FileReader {
    /// Size of the file when it was opened.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl AsyncRead for FileReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.done || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if let Some((body, filled)) = &mut this.error {
                while *filled < body.len() {
                    let mut eb = ReadBuf::new(&mut body[*filled..]);
                    ready!(Pin::new(&mut this.conn).poll_read(cx, &mut eb))?;
                    let n = eb.filled().len();
                    if n == 0 {
                        return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                    }
                    *filled += n;
                }
                this.done = true;
                let err = error_from_payload(body);
                return Poll::Ready(Err(io::Error::other(err)));
            }
            if this.remaining > 0 {
                let want = this.remaining.min(buf.remaining());
                let mut limited = ReadBuf::new(buf.initialize_unfilled_to(want));
                ready!(Pin::new(&mut this.conn).poll_read(cx, &mut limited))?;
                let n = limited.filled().len();
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                }
                buf.advance(n);
                this.remaining -= n;
                return Poll::Ready(Ok(()));
            }
            while this.header_filled < FRAME_HEADER_LEN {
                let mut hb = ReadBuf::new(&mut this.header[this.header_filled..]);
                ready!(Pin::new(&mut this.conn).poll_read(cx, &mut hb))?;
                let n = hb.filled().len();
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                }
                this.header_filled += n;
            }
            this.header_filled = 0;
            let (kind, len) = decode_header(this.header).map_err(io::Error::other)?;
            match kind {
                FrameKind::Data => this.remaining = len as usize,
                FrameKind::End => this.done = true,
                // Bounded: decode_header caps Error frames at MAX_JSON_FRAME.
                FrameKind::Error => this.error = Some((vec![0; len as usize], 0)),
                other => return Poll::Ready(Err(io::Error::other(EnvdError::unexpected(other)))),
            }
        }
    }
}

/// How an [`EnvdClient`] reaches envd.
#[derive(Clone)]
pub enum EnvdTransport {
    /// The sandbox's envd unix socket on this host.
    Unix(PathBuf),
    /// Through the node agent that runs the sandbox (see the module docs).
    Node {
        /// `host:port` of the node agent.
        addr: String,
        sandbox_id: String,
        /// The node's shared secret; never printed.
        token: String,
    },
}

impl std::fmt::Debug for EnvdTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EnvdTransport::Unix(p) => f.debug_tuple("Unix").field(p).finish(),
            EnvdTransport::Node {
                addr, sandbox_id, ..
            } => f
                .debug_struct("Node")
                .field("addr", addr)
                .field("sandbox_id", sandbox_id)
                .field("token", &"<redacted>")
                .finish(),
        }
    }
}

/// Longest the node handshake (TCP connect + upgrade answer) may take.
const NODE_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest node answer head (and error body) the client reads.
const MAX_NODE_ANSWER: usize = 16 * 1024;

/// Client for one sandbox's envd.
#[derive(Debug, Clone)]
pub struct EnvdClient {
    transport: EnvdTransport,
    /// Unix transport: the pid (in the host's PID namespace) that every
    /// connection's peer must have.
    expected_peer_pid: Option<u32>,
}

impl EnvdClient {
    /// A client for the envd unix socket at `socket` on this host. It does not
    /// check who listens on the socket: use [`EnvdClient::expect_peer_pid`]
    /// whenever the sandbox's init pid is known.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        EnvdClient {
            transport: EnvdTransport::Unix(socket.into()),
            expected_peer_pid: None,
        }
    }

    /// Requires the peer of every unix connection to be process `pid` (the
    /// sandbox's init, i.e. its envd, as seen from this host): after connecting
    /// and before sending anything the client reads `SO_PEERCRED` and fails
    /// with [`EnvdError::PeerMismatch`] on any other peer. envd calls `listen`
    /// on its socket itself, so the kernel names envd's pid for its
    /// connections. Has no effect on a [`EnvdClient::remote`] client (the node
    /// agent owns that connection).
    #[must_use]
    pub fn expect_peer_pid(mut self, pid: u32) -> Self {
        self.expected_peer_pid = Some(pid);
        self
    }

    /// The pid every unix connection's peer must have, if verified.
    pub fn expected_peer_pid(&self) -> Option<u32> {
        self.expected_peer_pid
    }

    /// A client for the envd of sandbox `sandbox_id` on the node agent at
    /// `node_addr` (`host:port`), authenticated with the node's token.
    pub fn remote(
        node_addr: impl Into<String>,
        sandbox_id: impl Into<String>,
        node_token: impl Into<String>,
    ) -> Self {
        EnvdClient {
            transport: EnvdTransport::Node {
                addr: node_addr.into(),
                sandbox_id: sandbox_id.into(),
                token: node_token.into(),
            },
            expected_peer_pid: None,
        }
    }

    /// The unix socket this client connects to (`None` for a remote client).
    pub fn socket(&self) -> Option<&Path> {
        match &self.transport {
            EnvdTransport::Unix(p) => Some(p),
            EnvdTransport::Node { .. } => None,
        }
    }

    pub fn transport(&self) -> &EnvdTransport {
        &self.transport
    }

    async fn open(&self) -> Result<Conn, EnvdError> {
        match &self.transport {
            EnvdTransport::Unix(p) => connect_unix(p, self.expected_peer_pid)
                .await
                .map(Conn::Unix),
            EnvdTransport::Node {
                addr,
                sandbox_id,
                token,
            } => match tokio::time::timeout(
                NODE_HANDSHAKE_TIMEOUT,
                node_handshake(addr, sandbox_id, token),
            )
            .await
            {
                Ok(r) => r.map(Conn::Tcp),
                Err(_) => Err(EnvdError::Connect(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("node {addr} did not answer within {NODE_HANDSHAKE_TIMEOUT:?}"),
                ))),
            },
        }
    }

    async fn connect(&self, req: &Request) -> Result<Conn, EnvdError> {
        // Encoded first: an oversized request (huge argv or env) is the
        // caller's mistake and never needs a connection.
        let payload = encode_json(req).map_err(|e| match e {
            ProtoError::MessageTooLarge { .. } => {
                EnvdError::BadRequest(format!("envd request too large: {e}"))
            }
            other => EnvdError::Protocol(other),
        })?;
        let mut conn = self.open().await?;
        write_frame(&mut conn, FrameKind::Request, &payload).await?;
        Ok(conn)
    }

    /// Sends a request without a data phase and returns its single response.
    async fn call(&self, req: &Request) -> Result<Response, EnvdError> {
        let mut conn = self.connect(req).await?;
        read_response(&mut conn).await
    }

    pub async fn health(&self) -> Result<Health, EnvdError> {
        match self.call(&Request::Health).await? {
            Response::Health(h) => Ok(h),
            _ => Err(EnvdError::unexpected(FrameKind::Response)),
        }
    }

    /// Polls connect + health every ~500µs until envd answers or `timeout` passes.
    /// Through a node, "envd not up yet" is the node's 503, retried the same way.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), EnvdError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.health().await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_not_ready() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                Err(e) if e.is_not_ready() => return Err(EnvdError::NotReady(timeout)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Sets the lease fence: `Some(t)` = leased with current token t; `None` =
    /// unleased. envd refuses a fence below the highest it has seen
    /// ([`EnvdError::StaleToken`]) and refuses callers inside the sandbox
    /// ([`EnvdError::PermissionDenied`]). A different value than the current
    /// one first ends every other process in the sandbox (this call returns
    /// once they are reaped, within seconds); [`EnvdError::Remote`] then means
    /// some survived and the sandbox should not be trusted. The same value
    /// (a renewal) kills nothing.
    pub async fn set_fence(&self, token: Option<u64>) -> Result<(), EnvdError> {
        expect_ok(self.call(&Request::SetFence { token }).await?)
    }

    /// Kills every process in the sandbox but envd, the fence unchanged
    /// (accepted only from outside the sandbox).
    pub async fn kill_all(&self) -> Result<(), EnvdError> {
        expect_ok(self.call(&Request::KillAll).await?)
    }

    /// Starts a process; the returned stream yields output chunks as they come and
    /// finally the exit.
    pub async fn exec(&self, spec: ExecSpec, token: Option<u64>) -> Result<ExecStream, EnvdError> {
        let stdin: Option<StdinSource> = spec
            .stdin
            .clone()
            .map(|data| Box::pin(std::io::Cursor::new(data)) as StdinSource);
        self.exec_with(spec, stdin, token).await
    }

    /// Starts a process whose stdin is `stdin`, read until its end and
    /// forwarded as it comes (`spec.stdin` is ignored); then stdin is closed.
    pub async fn exec_piped(
        &self,
        spec: ExecSpec,
        stdin: StdinSource,
        token: Option<u64>,
    ) -> Result<ExecStream, EnvdError> {
        self.exec_with(spec, Some(stdin), token).await
    }

    async fn exec_with(
        &self,
        spec: ExecSpec,
        stdin: Option<StdinSource>,
        token: Option<u64>,
    ) -> Result<ExecStream, EnvdError> {
        let req = Request::Exec {
            argv: spec.argv,
            cwd: spec.cwd,
            env: spec.env,
            stdin: stdin.is_some(),
            timeout_ms: spec
                .timeout
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)),
            token,
            user: spec.user,
        };
        let conn = self.connect(&req).await?;
        let Some(mut source) = stdin else {
            return Ok(ExecStream {
                conn,
                stdin_writer: None,
                finished: false,
            });
        };
        // Stdin is written concurrently with reading output: a process that
        // writes before it reads would otherwise deadlock against us.
        let (conn_back, mut writer) = conn.duplicate().map_err(EnvdError::Transport)?;
        let handle = tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK_SIZE];
            loop {
                let n = source.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                write_raw_frame(&mut writer, FrameKind::Data, &buf[..n]).await?;
            }
            // Dropping `writer` afterwards closes only this duplicate descriptor:
            // the connection stays open until the ExecStream is dropped.
            write_raw_frame(&mut writer, FrameKind::End, &[]).await
        });
        Ok(ExecStream {
            conn: conn_back,
            stdin_writer: Some(handle),
            finished: false,
        })
    }

    /// Convenience: runs a process to completion and collects its output.
    pub async fn exec_collect(
        &self,
        spec: ExecSpec,
        token: Option<u64>,
    ) -> Result<ExecOutput, EnvdError> {
        self.exec(spec, token).await?.collect().await
    }

    /// Opens a file for streaming. Reads are not fenced; `_token` is accepted for
    /// symmetry with the mutating calls and ignored.
    pub async fn read_file(
        &self,
        path: &str,
        _token: Option<u64>,
    ) -> Result<FileReader, EnvdError> {
        let mut conn = self
            .connect(&Request::ReadFile {
                path: path.to_owned(),
            })
            .await?;
        match read_response(&mut conn).await? {
            Response::Opened { size } => Ok(FileReader {
                conn,
                size,
                remaining: 0,
                header: [0; FRAME_HEADER_LEN],
                header_filled: 0,
                error: None,
                done: false,
            }),
            _ => Err(EnvdError::unexpected(FrameKind::Response)),
        }
    }

    /// Writes (creates or atomically replaces) a file; returns the bytes written.
    pub async fn write_file(
        &self,
        path: &str,
        mode: Option<u32>,
        mut data: impl AsyncRead + Unpin + Send,
        token: Option<u64>,
    ) -> Result<u64, EnvdError> {
        let mut conn = self
            .connect(&Request::WriteFile {
                path: path.to_owned(),
                mode,
                token,
            })
            .await?;
        let mut buf = vec![0u8; CHUNK_SIZE];
        let sent: Result<(), EnvdError> = async {
            loop {
                let n = data.read(&mut buf).await.map_err(EnvdError::Transport)?;
                if n == 0 {
                    break;
                }
                write_frame(&mut conn, FrameKind::Data, &buf[..n]).await?;
            }
            write_frame(&mut conn, FrameKind::End, &[]).await
        }
        .await;
        // envd may have refused the request (bad token, bad path) and closed the
        // connection while we were still sending: its error frame explains why.
        match read_response(&mut conn).await {
            Ok(Response::Written { bytes }) => Ok(bytes),
            Ok(_) => Err(EnvdError::unexpected(FrameKind::Response)),
            Err(e @ (EnvdError::Transport(_) | EnvdError::Protocol(_))) => {
                Err(sent.err().unwrap_or(e))
            }
            Err(e) => Err(e),
        }
    }

    pub async fn list_dir(&self, path: &str) -> Result<Vec<FileStat>, EnvdError> {
        let mut conn = self
            .connect(&Request::ListDir {
                path: path.to_owned(),
            })
            .await?;
        let mut entries = Vec::new();
        loop {
            let (kind, payload) = read_frame(&mut conn).await?;
            match kind {
                FrameKind::Data => {
                    let chunk: Vec<FileStat> =
                        decode_json(&payload).map_err(EnvdError::Protocol)?;
                    entries.extend(chunk);
                }
                FrameKind::Response => {
                    return match decode_json(&payload).map_err(EnvdError::Protocol)? {
                        Response::Listed { .. } => Ok(entries),
                        _ => Err(EnvdError::unexpected(kind)),
                    }
                }
                FrameKind::Error => return Err(error_from_payload(&payload)),
                other => return Err(EnvdError::unexpected(other)),
            }
        }
    }

    /// Metadata of a path; a symlink is described, not followed.
    pub async fn stat(&self, path: &str) -> Result<FileStat, EnvdError> {
        match self
            .call(&Request::Stat {
                path: path.to_owned(),
            })
            .await?
        {
            Response::Stat(s) => Ok(s),
            _ => Err(EnvdError::unexpected(FrameKind::Response)),
        }
    }

    pub async fn mkdir(
        &self,
        path: &str,
        parents: bool,
        token: Option<u64>,
    ) -> Result<(), EnvdError> {
        expect_ok(
            self.call(&Request::Mkdir {
                path: path.to_owned(),
                parents,
                token,
            })
            .await?,
        )
    }

    pub async fn remove(
        &self,
        path: &str,
        recursive: bool,
        token: Option<u64>,
    ) -> Result<(), EnvdError> {
        expect_ok(
            self.call(&Request::Remove {
                path: path.to_owned(),
                recursive,
                token,
            })
            .await?,
        )
    }
}

impl EnvdClient {
    /// Opens a byte tunnel to `127.0.0.1:port` inside the sandbox (fenced by
    /// `token` like every mutating call). The answer is an
    /// `AsyncRead + AsyncWrite` stream: bytes written go to the port,
    /// `shutdown` half-closes towards it, bytes read come from it, EOF when
    /// it closed its side. Dropping the stream closes the tunnel. Nothing
    /// listening is [`EnvdError::PortUnreachable`].
    pub async fn connect_port(
        &self,
        port: u16,
        token: Option<u64>,
    ) -> Result<crate::port_stream::PortStream, EnvdError> {
        let mut conn = self.connect(&Request::Connect { port, token }).await?;
        expect_ok(read_response(&mut conn).await?)?;
        Ok(crate::port_stream::PortStream::new(conn))
    }

    /// The sandbox's processes (as envd sees them in its PID namespace).
    pub async fn list_processes(&self) -> Result<Vec<crate::ProcessInfo>, EnvdError> {
        let mut conn = self.connect(&Request::ListProcesses).await?;
        let mut procs = Vec::new();
        loop {
            let (kind, payload) = read_frame(&mut conn).await?;
            match kind {
                FrameKind::Data => {
                    let chunk: Vec<crate::ProcessInfo> =
                        decode_json(&payload).map_err(EnvdError::Protocol)?;
                    // the listing is written inside the sandbox: an entry
                    // over envd's own bounds, or too many, is out of protocol
                    // (so the host's memory stays bounded whatever it sends)
                    if !chunk.iter().all(crate::ProcessInfo::within_bounds) {
                        return Err(EnvdError::unexpected(kind));
                    }
                    procs.extend(chunk);
                    if procs.len() > crate::MAX_LISTED_PROCESSES {
                        return Err(EnvdError::unexpected(kind));
                    }
                }
                FrameKind::Response => {
                    return match decode_json(&payload).map_err(EnvdError::Protocol)? {
                        Response::Listed { .. } => Ok(procs),
                        _ => Err(EnvdError::unexpected(kind)),
                    }
                }
                FrameKind::Error => return Err(error_from_payload(&payload)),
                other => return Err(EnvdError::unexpected(other)),
            }
        }
    }

    /// Sends signal number `signal` to process `pid` (fenced).
    pub async fn signal(&self, pid: i32, signal: i32, token: Option<u64>) -> Result<(), EnvdError> {
        expect_ok(self.call(&Request::Signal { pid, signal, token }).await?)
    }

    /// Starts a background command (stdin closed); answers its handle and pid.
    pub async fn spawn(&self, spec: ExecSpec, token: Option<u64>) -> Result<(u64, i32), EnvdError> {
        let req = Request::Spawn {
            argv: spec.argv,
            cwd: spec.cwd,
            env: spec.env,
            token,
            user: spec.user,
        };
        match self.call(&req).await? {
            Response::Spawned { handle, pid } => Ok((handle, pid)),
            _ => Err(EnvdError::unexpected(FrameKind::Response)),
        }
    }

    /// The output envd kept of a background command and its state now.
    /// At most twice the ring size arrives (more is a protocol error).
    pub async fn output(
        &self,
        handle: u64,
    ) -> Result<(Vec<u8>, Vec<u8>, crate::BackgroundInfo), EnvdError> {
        let mut conn = self
            .connect(&Request::Output {
                handle,
                follow: false,
            })
            .await?;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        loop {
            let (kind, payload) = read_frame(&mut conn).await?;
            match kind {
                FrameKind::Stdout => out.extend_from_slice(&payload),
                FrameKind::Stderr => err.extend_from_slice(&payload),
                FrameKind::Response => {
                    return match decode_json(&payload).map_err(EnvdError::Protocol)? {
                        Response::Background(info) => Ok((out, err, info)),
                        _ => Err(EnvdError::unexpected(kind)),
                    }
                }
                FrameKind::Error => return Err(error_from_payload(&payload)),
                other => return Err(EnvdError::unexpected(other)),
            }
            if out.len() > crate::BACKGROUND_RING_BYTES * 2
                || err.len() > crate::BACKGROUND_RING_BYTES * 2
            {
                return Err(EnvdError::unexpected(kind));
            }
        }
    }

    /// Follows a background command: the kept output, new output as it
    /// comes, then its exit, as an [`ExecStream`] (dropping it stops
    /// following; the command runs on).
    pub async fn follow_output(&self, handle: u64) -> Result<ExecStream, EnvdError> {
        let conn = self
            .connect(&Request::Output {
                handle,
                follow: true,
            })
            .await?;
        Ok(ExecStream {
            conn,
            stdin_writer: None,
            finished: false,
        })
    }
}

/// Connects to the envd socket at `path`: never through a symlink, and (when
/// `expected_pid` is set) only to a socket whose listener is that process.
async fn connect_unix(path: &Path, expected_pid: Option<u32>) -> Result<UnixStream, EnvdError> {
    // lstat: a final symlink could point at another sandbox's socket. (A
    // symlink in a parent directory is the host's own layout and allowed.)
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(EnvdError::Connect(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} is a symlink; an envd socket is never reached through one",
                    path.display()
                ),
            )))
        }
        // A missing path is reported by connect, like before.
        _ => {}
    }
    let stream = UnixStream::connect(path)
        .await
        .map_err(EnvdError::Connect)?;
    if let Some(expected) = expected_pid {
        let got = stream.peer_cred().map_err(EnvdError::Connect)?.pid();
        if got != i32::try_from(expected).ok() {
            return Err(EnvdError::PeerMismatch { expected, got });
        }
    }
    Ok(stream)
}

fn expect_ok(r: Response) -> Result<(), EnvdError> {
    match r {
        Response::Ok => Ok(()),
        _ => Err(EnvdError::unexpected(FrameKind::Response)),
    }
}

fn error_from_payload(payload: &[u8]) -> EnvdError {
    match decode_json::<ErrorBody>(payload) {
        Ok(body) => EnvdError::from_body(body),
        Err(e) => EnvdError::Protocol(e),
    }
}

/// Reads the final frame of a request: a `Response` or an `Error`.
async fn read_response(conn: &mut Conn) -> Result<Response, EnvdError> {
    let (kind, payload) = read_frame(conn).await?;
    match kind {
        FrameKind::Response => decode_json(&payload).map_err(EnvdError::Protocol),
        FrameKind::Error => Err(error_from_payload(&payload)),
        other => Err(EnvdError::unexpected(other)),
    }
}

async fn read_frame(conn: &mut Conn) -> Result<(FrameKind, Vec<u8>), EnvdError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    match conn.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(EnvdError::Protocol(ProtoError::UnexpectedEof))
        }
        Err(e) => return Err(EnvdError::Transport(e)),
    }
    let (kind, len) = decode_header(h).map_err(EnvdError::Protocol)?;
    let mut payload = vec![0u8; len as usize];
    conn.read_exact(&mut payload).await.map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            EnvdError::Protocol(ProtoError::UnexpectedEof)
        } else {
            EnvdError::Transport(e)
        }
    })?;
    Ok((kind, payload))
}

async fn write_frame(conn: &mut Conn, kind: FrameKind, payload: &[u8]) -> Result<(), EnvdError> {
    write_raw_frame(conn, kind, payload)
        .await
        .map_err(EnvdError::Transport)
}

async fn write_raw_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    payload: &[u8],
) -> io::Result<()> {
    let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
    buf.extend_from_slice(&encode_header(kind, payload.len()));
    buf.extend_from_slice(payload);
    w.write_all(&buf).await
}

/// One connection to envd, over either transport.
#[derive(Debug)]
pub(crate) enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Conn {
    /// Two handles on the same connection (a duplicated descriptor): dropping
    /// one does not close or half-close the connection.
    fn duplicate(self) -> io::Result<(Conn, Conn)> {
        match self {
            Conn::Unix(s) => {
                let a = s.into_std()?;
                let b = a.try_clone()?;
                Ok((
                    Conn::Unix(UnixStream::from_std(a)?),
                    Conn::Unix(UnixStream::from_std(b)?),
                ))
            }
            Conn::Tcp(s) => {
                let a = s.into_std()?;
                let b = a.try_clone()?;
                Ok((
                    Conn::Tcp(TcpStream::from_std(a)?),
                    Conn::Tcp(TcpStream::from_std(b)?),
                ))
            }
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Unix(s) => Pin::new(s).poll_flush(cx),
            Conn::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Opens a TCP connection to the node agent and upgrades it to a raw envd
/// byte stream for `sandbox_id`.
async fn node_handshake(addr: &str, sandbox_id: &str, token: &str) -> Result<TcpStream, EnvdError> {
    if token.bytes().any(|b| b == b'\r' || b == b'\n') {
        return Err(EnvdError::BadRequest(
            "node token contains a line break".into(),
        ));
    }
    let mut conn = TcpStream::connect(addr).await.map_err(EnvdError::Connect)?;
    // Frames are small and latency-bound: do not wait for Nagle.
    conn.set_nodelay(true).map_err(EnvdError::Connect)?;
    let head = format!(
        "GET /node/v1/sandboxes/{}/envd HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: Upgrade\r\nUpgrade: aviary-envd\r\n\r\n",
        encode_path_segment(sandbox_id)
    );
    conn.write_all(head.as_bytes())
        .await
        .map_err(EnvdError::Connect)?;
    let mut buf = Vec::with_capacity(512);
    let head_end = loop {
        if let Some(i) = find_head_end(&buf) {
            break i;
        }
        if buf.len() >= MAX_NODE_ANSWER {
            return Err(node_protocol("answer head too long"));
        }
        let mut chunk = [0u8; 1024];
        let n = conn.read(&mut chunk).await.map_err(EnvdError::Connect)?;
        if n == 0 {
            return Err(node_protocol("connection closed before the answer"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| node_protocol("answer head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| node_protocol("malformed status line"))?;
    if status == 101 {
        if buf.len() > head_end + 4 {
            return Err(node_protocol("data before the first frame"));
        }
        return Ok(conn);
    }
    // An error: read the (small, JSON) body the node sent.
    let content_length = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0)
        .min(MAX_NODE_ANSWER);
    let mut body = buf.split_off(head_end + 4);
    while body.len() < content_length {
        let mut chunk = [0u8; 1024];
        match conn.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    body.truncate(content_length);
    Err(EnvdError::Node {
        status,
        message: node_error_message(&body),
    })
}

fn node_protocol(what: &str) -> EnvdError {
    EnvdError::Transport(io::Error::new(
        io::ErrorKind::InvalidData,
        format!("node upgrade: {what}"),
    ))
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

/// The node's error body is `{"error": {"code": ..., "message": ...}}`;
/// anything else is shown as text.
fn node_error_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Wrapper {
        error: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        code: String,
        message: String,
    }
    match serde_json::from_slice::<Wrapper>(body) {
        Ok(w) => format!("{}: {}", w.error.code, w.error.message),
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    }
}

/// Percent-encodes everything but unreserved characters.
fn encode_path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// The crate's tokio has no `macros` feature (envd-proto stays light).
    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(encode_path_segment("sbx_01-a.b"), "sbx_01-a.b");
        assert_eq!(encode_path_segment("a/../b c"), "a%2F..%2Fb%20c");
    }

    #[test]
    fn the_token_is_redacted() {
        let c = EnvdClient::remote("127.0.0.1:1", "sbx", "s3cret");
        assert!(!format!("{c:?}").contains("s3cret"));
        assert_eq!(c.socket(), None);
        assert_eq!(EnvdClient::new("/x").socket(), Some(Path::new("/x")));
    }

    /// A fake node: answers one connection with `answer`, returns the head it got.
    async fn fake_node(answer: &'static [u8]) -> (String, JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            while find_head_end(&got).is_none() {
                let mut b = [0u8; 256];
                let n = s.read(&mut b).await.unwrap();
                got.extend_from_slice(&b[..n]);
            }
            s.write_all(answer).await.unwrap();
            // Serve health on the upgraded stream when it was a 101.
            if answer.starts_with(b"HTTP/1.1 101") {
                let mut h = [0u8; FRAME_HEADER_LEN];
                s.read_exact(&mut h).await.unwrap();
                let (_, len) = decode_header(h).unwrap();
                let mut p = vec![0u8; len as usize];
                s.read_exact(&mut p).await.unwrap();
                let body = encode_json(&Response::Ok).unwrap();
                write_raw_frame(&mut s, FrameKind::Response, &body)
                    .await
                    .unwrap();
            }
            String::from_utf8(got).unwrap()
        });
        (addr, h)
    }

    #[test]
    fn a_node_error_body_is_reported() {
        block_on(a_node_error_body_is_reported_async());
    }

    async fn a_node_error_body_is_reported_async() {
        let (addr, h) = fake_node(
            b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: 55\r\n\r\n{\"error\":{\"code\":\"unauthorized\",\"message\":\"bad token\"}}",
        )
        .await;
        let c = EnvdClient::remote(addr, "sbx 1", "tok");
        match c.health().await.unwrap_err() {
            EnvdError::Node { status, message } => {
                assert_eq!(status, 401);
                assert_eq!(message, "unauthorized: bad token");
            }
            other => panic!("{other:?}"),
        }
        let head = h.await.unwrap();
        assert!(
            head.starts_with("GET /node/v1/sandboxes/sbx%201/envd HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("Authorization: Bearer tok\r\n"), "{head}");
        assert!(head.contains("Upgrade: aviary-envd\r\n"), "{head}");
    }

    #[test]
    fn frames_flow_after_the_upgrade() {
        block_on(frames_flow_after_the_upgrade_async());
    }

    async fn frames_flow_after_the_upgrade_async() {
        let (addr, h) = fake_node(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: aviary-envd\r\n\r\n",
        )
        .await;
        let c = EnvdClient::remote(addr, "sbx", "tok");
        c.set_fence(Some(3)).await.unwrap();
        h.await.unwrap();
    }

    /// A private directory for a test socket (the crate has no tempfile dep).
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(tag: &str) -> TestDir {
            let d = std::env::temp_dir().join(format!(
                "aviary-envd-proto-{tag}-{}-{:?}",
                std::process::id(),
                Instant::now()
            ));
            std::fs::create_dir_all(&d).unwrap();
            TestDir(d)
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A fake envd in this process: answers every request with `Response::Ok`
    /// and counts the requests it received.
    fn fake_envd(
        listener: tokio::net::UnixListener,
    ) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = std::sync::Arc::clone(&served);
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut h = [0u8; FRAME_HEADER_LEN];
                if s.read_exact(&mut h).await.is_err() {
                    continue; // the client hung up without a request
                }
                let (_, len) = decode_header(h).unwrap();
                let mut p = vec![0u8; len as usize];
                s.read_exact(&mut p).await.unwrap();
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let body = encode_json(&Response::Ok).unwrap();
                write_raw_frame(&mut s, FrameKind::Response, &body)
                    .await
                    .unwrap();
            }
        });
        served
    }

    #[test]
    fn a_verified_client_checks_the_peer_pid_and_refuses_symlinks() {
        block_on(a_verified_client_checks_the_peer_pid_and_refuses_symlinks_async());
    }

    async fn a_verified_client_checks_the_peer_pid_and_refuses_symlinks_async() {
        use std::sync::atomic::Ordering::SeqCst;
        let dir = TestDir::new("peer");
        let socket = dir.0.join("envd.sock");
        let served = fake_envd(tokio::net::UnixListener::bind(&socket).unwrap());
        let me = std::process::id();

        // The listener is this process: the right pid is accepted.
        let ok = EnvdClient::new(&socket).expect_peer_pid(me);
        assert_eq!(ok.expected_peer_pid(), Some(me));
        ok.set_fence(Some(1)).await.unwrap();
        assert_eq!(served.load(SeqCst), 1);

        // Any other expected pid: refused after connect, before the request.
        let wrong = EnvdClient::new(&socket).expect_peer_pid(me + 1);
        match wrong.set_fence(Some(2)).await.unwrap_err() {
            EnvdError::PeerMismatch { expected, got } => {
                assert_eq!((expected, got), (me + 1, i32::try_from(me).ok()));
            }
            other => panic!("{other:?}"),
        }
        let e = wrong.wait_ready(Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, EnvdError::PeerMismatch { .. }), "{e:?}");
        assert!(e.to_string().contains("not the sandbox init"), "{e}");

        // A symlink to a (valid) socket is refused before connecting, verified or not.
        let link = dir.0.join("link.sock");
        std::os::unix::fs::symlink(&socket, &link).unwrap();
        for c in [
            EnvdClient::new(&link),
            EnvdClient::new(&link).expect_peer_pid(me),
        ] {
            match c.set_fence(Some(3)).await.unwrap_err() {
                EnvdError::Connect(e) => {
                    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
                    assert!(e.to_string().contains("symlink"), "{e}");
                }
                other => panic!("{other:?}"),
            }
            // Not retried as "envd not up yet".
            let e = c.wait_ready(Duration::from_secs(5)).await.unwrap_err();
            assert!(matches!(e, EnvdError::Connect(_)), "{e:?}");
        }
        // Let the fake envd see any stray request, then check none arrived.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(served.load(SeqCst), 1);

        // The unverified client still works on the real path.
        EnvdClient::new(&socket).set_fence(None).await.unwrap();
        assert_eq!(served.load(SeqCst), 2);
    }

    #[test]
    fn an_oversized_request_is_a_bad_request() {
        block_on(async {
            let c = EnvdClient::new("/nonexistent/envd.sock");
            let spec = ExecSpec {
                argv: vec!["x".repeat(crate::MAX_JSON_FRAME as usize)],
                ..ExecSpec::default()
            };
            match c.exec(spec, None).await.unwrap_err() {
                EnvdError::BadRequest(m) => assert!(m.contains("65536"), "{m}"),
                other => panic!("{other:?}"),
            }
        });
    }

    #[test]
    fn an_unreachable_node_is_a_connect_error() {
        block_on(an_unreachable_node_is_a_connect_error_async());
    }

    async fn an_unreachable_node_is_a_connect_error_async() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        drop(l);
        let c = EnvdClient::remote(addr, "sbx", "tok");
        assert!(matches!(
            c.health().await.unwrap_err(),
            EnvdError::Connect(_)
        ));
    }
}
