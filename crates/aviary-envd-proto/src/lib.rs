//! The wire protocol between Aviary's control plane and `envd`, the daemon that
//! runs as PID 1 inside every sandbox.
//!
//! **What it owns.** The framing, the JSON request/response messages, the hard
//! size limits, the error codes that cross the wire, and the normalisation of
//! sandbox paths. Behind the `client` feature it also owns [`EnvdClient`], the
//! async (tokio) client used by the control plane. Without that feature the
//! crate depends on `serde` and `serde_json` only, so envd stays small and static.
//!
//! **Protocol.** One request per unix-socket connection. Every frame is
//! `kind: u8 | len: u32 big-endian | payload[len]`:
//!
//! | kind | name | direction | payload |
//! |---|---|---|---|
//! | 1 | `Request` | client → envd, first frame, exactly once | JSON [`Request`] |
//! | 2 | `Data` | both | raw bytes (stdin, file content, list chunks) |
//! | 3 | `End` | both | empty: end of a data stream |
//! | 4 | `Stdout` | envd → client | raw bytes |
//! | 5 | `Stderr` | envd → client | raw bytes |
//! | 6 | `Response` | envd → client | JSON [`Response`] |
//! | 7 | `Error` | envd → client, final | JSON [`ErrorBody`] |
//! | 8 | `Control` | client → envd (`exec_pty` only) | JSON [`PtyControl`], at most [`MAX_CONTROL_FRAME`] |
//!
//! Per operation:
//! - `health`, `set_fence`, `stat`, `mkdir`, `remove`: `Request` → `Response | Error`.
//! - `exec`: `Request` [→ `Data`* `End` when `stdin` is true] ; envd answers
//!   `Stdout|Stderr`* then `Response::Exit`, or `Error`. Closing the connection
//!   (or shutting down its write side) before the final frame kills the process
//!   group. Processes that the command leaves running in the background after a
//!   normal exit keep running; their output is forwarded for 100 ms after the exit.
//! - `exec_pty`: `Request`; envd answers `Response::Ok` once the process runs
//!   (its controlling terminal and stdio a new pseudo-terminal) or `Error`.
//!   Then, concurrently: client → envd `Data` (terminal input) and `Control`
//!   (resize, signal to the foreground process group); envd → client `Stdout`
//!   (terminal output: one stream, the terminal merges stdout and stderr) then
//!   `Response::Exit`. Closing the connection before the exit hangs the
//!   terminal up and kills the process group.
//! - `read_file`: `Request` → `Response::Opened` `Data`* `End` (or `Error` at any point).
//! - `write_file`: `Request` `Data`* `End` → `Response::Written` or `Error`.
//! - `list_dir`: `Request` → `Data`* (each a JSON array of [`FileStat`]) `Response::Listed`.
//! - `connect` (a port tunnel, fenced): `Request` → `Response::Ok | Error`;
//!   after `Ok` the connection is a byte tunnel to `127.0.0.1:port` in the
//!   sandbox: `Data`* both ways, `End` for a half-close of that direction.
//!   envd ends the tunnel (closes the connection) when the fence moves, on
//!   `kill_all`, and after [`TUNNEL_IDLE_TIMEOUT_S`] without a byte either way.
//! - `list_processes`: `Request` → `Data`* (JSON arrays of [`ProcessInfo`]) `Response::Listed`.
//! - `signal` (fenced): `Request` → `Response::Ok | Error`.
//! - `spawn` (a background command, fenced): `Request` → `Response::Spawned | Error`;
//!   envd keeps the last [`BACKGROUND_RING_BYTES`] of each output stream and the
//!   exit of at most [`MAX_BACKGROUND`] handles (the oldest finished one makes
//!   room); a fence move forgets them all (and the sweep ends their processes).
//! - `output`: `Request` → `Stdout|Stderr`* (what the rings hold, then, with
//!   `follow`, new output as it comes) then, with `follow`, `Response::Exit` at
//!   the exit, else `Response::Background` at once; or `Error`.
//!
//! **Invariants.** Decoding never panics and never allocates more than
//! [`MAX_DATA_FRAME`] for one frame: the header is checked (known kind, length
//! within the kind's limit, `End` empty) before any payload is read.
#![forbid(unsafe_code)]

use std::fmt;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

#[cfg(feature = "client")]
mod client;
#[cfg(feature = "client")]
mod port_stream;
#[cfg(feature = "client")]
pub use client::{
    EnvdClient, EnvdError, ExecEvent, ExecOutput, ExecSpec, ExecStream, ExitInfo, FileReader,
    PtyEvent, PtyInput, PtyOutput, PtySpec, StdinSource,
};
#[cfg(feature = "client")]
pub use port_stream::PortStream;

/// Protocol version reported by `health`; bump on incompatible changes.
/// The `PATH` envd gives a command whose request sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

pub const PROTOCOL_VERSION: u32 = 1;
/// Length of a frame header: kind byte + big-endian u32 length.
pub const FRAME_HEADER_LEN: usize = 5;
/// Largest JSON frame (`Request`, `Response`, `Error`).
pub const MAX_JSON_FRAME: u32 = 64 * 1024;
/// Largest data-carrying frame (`Data`, `Stdout`, `Stderr`).
pub const MAX_DATA_FRAME: u32 = 1024 * 1024;
/// Size of the data chunks envd and the client send (well below [`MAX_DATA_FRAME`]).
pub const CHUNK_SIZE: usize = 64 * 1024;
/// Largest `Control` frame (a [`PtyControl`] message).
pub const MAX_CONTROL_FRAME: u32 = 1024;
/// Largest terminal size accepted in either dimension (cells).
pub const MAX_PTY_CELLS: u16 = 4096;
/// Longest accepted sandbox path, in bytes.
pub const MAX_PATH_LEN: usize = 4096;
/// Longest accepted path component, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// A port tunnel with no byte in either direction for this long is closed.
pub const TUNNEL_IDLE_TIMEOUT_S: u64 = 300;
/// Output kept per stream of a background command (the newest bytes).
pub const BACKGROUND_RING_BYTES: usize = 1024 * 1024;
/// Background command handles envd keeps.
pub const MAX_BACKGROUND: usize = 32;
/// Longest argument envd reports in a process listing, in bytes.
pub const MAX_LISTED_ARG: usize = 256;
/// Most arguments envd reports per process in a listing.
pub const MAX_LISTED_ARGS: usize = 64;
/// Most processes envd reports in a listing.
pub const MAX_LISTED_PROCESSES: usize = 4096;

/// The kind byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    Request = 1,
    Data = 2,
    End = 3,
    Stdout = 4,
    Stderr = 5,
    Response = 6,
    Error = 7,
    Control = 8,
}

impl FrameKind {
    /// Parses a kind byte.
    pub fn from_byte(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Request,
            2 => FrameKind::Data,
            3 => FrameKind::End,
            4 => FrameKind::Stdout,
            5 => FrameKind::Stderr,
            6 => FrameKind::Response,
            7 => FrameKind::Error,
            8 => FrameKind::Control,
            _ => return None,
        })
    }

    /// The largest payload a frame of this kind may carry.
    pub fn max_len(self) -> u32 {
        match self {
            FrameKind::Request | FrameKind::Response | FrameKind::Error => MAX_JSON_FRAME,
            FrameKind::Data | FrameKind::Stdout | FrameKind::Stderr => MAX_DATA_FRAME,
            FrameKind::Control => MAX_CONTROL_FRAME,
            FrameKind::End => 0,
        }
    }
}

/// Errors of the framing and message layer.
#[derive(Debug)]
pub enum ProtoError {
    /// The underlying stream failed (including a clean EOF in the middle of a frame).
    ReadFrame(io::Error),
    /// Writing a frame failed.
    WriteFrame(io::Error),
    /// The connection ended where a frame was expected.
    UnexpectedEof,
    /// A frame header named an unknown kind.
    UnknownKind(u8),
    /// A frame header announced more bytes than its kind allows.
    FrameTooLarge { kind: FrameKind, len: u32 },
    /// A frame arrived that the protocol does not allow at this point.
    UnexpectedFrame(FrameKind),
    /// A JSON payload did not parse as the expected message.
    DecodeJson(serde_json::Error),
    /// A message could not be encoded.
    EncodeJson(String),
    /// A message's encoding is larger than [`MAX_JSON_FRAME`].
    MessageTooLarge { len: usize },
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::ReadFrame(_) => write!(f, "read frame"),
            ProtoError::WriteFrame(_) => write!(f, "write frame"),
            ProtoError::UnexpectedEof => write!(f, "connection closed before the expected frame"),
            ProtoError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            ProtoError::FrameTooLarge { kind, len } => {
                write!(
                    f,
                    "{kind:?} frame of {len} bytes exceeds the limit of {} bytes",
                    kind.max_len()
                )
            }
            ProtoError::UnexpectedFrame(k) => write!(f, "unexpected {k:?} frame"),
            ProtoError::DecodeJson(_) => write!(f, "decode json message"),
            ProtoError::EncodeJson(m) => write!(f, "encode json message: {m}"),
            ProtoError::MessageTooLarge { len } => write!(
                f,
                "message of {len} bytes exceeds the limit of {MAX_JSON_FRAME} bytes"
            ),
        }
    }
}

impl std::error::Error for ProtoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ProtoError::ReadFrame(e) | ProtoError::WriteFrame(e) => Some(e),
            ProtoError::DecodeJson(e) => Some(e),
            _ => None,
        }
    }
}

/// Validates a 5-byte frame header and returns its kind and payload length.
pub fn decode_header(h: [u8; FRAME_HEADER_LEN]) -> Result<(FrameKind, u32), ProtoError> {
    let kind = FrameKind::from_byte(h[0]).ok_or(ProtoError::UnknownKind(h[0]))?;
    let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
    if len > kind.max_len() {
        return Err(ProtoError::FrameTooLarge { kind, len });
    }
    Ok((kind, len))
}

/// Encodes a frame header. The caller guarantees `len` fits the kind's limit.
pub fn encode_header(kind: FrameKind, len: usize) -> [u8; FRAME_HEADER_LEN] {
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    [kind as u8, len[0], len[1], len[2], len[3]]
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub payload: Vec<u8>,
}

/// Reads one frame from a blocking reader. `Ok(None)` means a clean EOF before
/// the first header byte.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, ProtoError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let mut got = 0;
    while got < h.len() {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(ProtoError::UnexpectedEof),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ProtoError::ReadFrame(e)),
        }
    }
    let (kind, len) = decode_header(h)?;
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ProtoError::UnexpectedEof
        } else {
            ProtoError::ReadFrame(e)
        }
    })?;
    Ok(Some(Frame { kind, payload }))
}

/// Writes one frame (header and payload in a single `write_all`).
pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> Result<(), ProtoError> {
    if payload.len() > kind.max_len() as usize {
        return Err(ProtoError::EncodeJson(format!(
            "{kind:?} payload of {} bytes exceeds {}",
            payload.len(),
            kind.max_len()
        )));
    }
    let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
    buf.extend_from_slice(&encode_header(kind, payload.len()));
    buf.extend_from_slice(payload);
    w.write_all(&buf).map_err(ProtoError::WriteFrame)
}

/// Encodes a JSON message, refusing encodings larger than [`MAX_JSON_FRAME`].
pub fn encode_json<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtoError> {
    let v = serde_json::to_vec(msg).map_err(|e| ProtoError::EncodeJson(e.to_string()))?;
    if v.len() > MAX_JSON_FRAME as usize {
        return Err(ProtoError::MessageTooLarge { len: v.len() });
    }
    Ok(v)
}

/// Decodes a JSON message.
pub fn decode_json<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Result<T, ProtoError> {
    serde_json::from_slice(payload).map_err(ProtoError::DecodeJson)
}

/// The first frame of every connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Health,
    /// Control operation, accepted only from peers outside the sandbox. Moving
    /// the fence to a different value (including to or from `None`) first kills
    /// every other process in the sandbox and waits until they are reaped, so a
    /// new lease starts with no process of the previous holder; setting the
    /// current value again (a renewal) kills nothing. If processes survive the
    /// bounded wait, the fence moves but the answer is an `internal` error.
    SetFence {
        token: Option<u64>,
    },
    /// Control operation, accepted only from peers outside the sandbox: kills
    /// every other process in the sandbox and waits until they are reaped,
    /// without touching the fence (a level-1 reset). Answers `Ok`, or an
    /// `internal` error when processes survive the bounded wait.
    KillAll,
    Exec {
        argv: Vec<String>,
        #[serde(default)]
        cwd: Option<String>,
        #[serde(default)]
        env: Vec<(String, String)>,
        /// When true, `Data`* `End` frames follow with the process's stdin.
        #[serde(default)]
        stdin: bool,
        #[serde(default)]
        timeout_ms: Option<u64>,
        #[serde(default)]
        token: Option<u64>,
        /// Run as this user of the sandbox (`name`, `uid`, `name:group`,
        /// `uid:gid`); root when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    /// Runs a process with a new pseudo-terminal as its controlling
    /// terminal and stdio (an interactive shell). Same fence, user and
    /// environment rules as `Exec`; `TERM` defaults to `xterm-256color`.
    ExecPty {
        argv: Vec<String>,
        #[serde(default)]
        cwd: Option<String>,
        #[serde(default)]
        env: Vec<(String, String)>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Initial window size, 1..=[`MAX_PTY_CELLS`] each.
        cols: u16,
        rows: u16,
        #[serde(default)]
        token: Option<u64>,
    },
    ReadFile {
        path: String,
    },
    WriteFile {
        path: String,
        #[serde(default)]
        mode: Option<u32>,
        #[serde(default)]
        token: Option<u64>,
    },
    ListDir {
        path: String,
    },
    Stat {
        path: String,
    },
    Mkdir {
        path: String,
        #[serde(default)]
        parents: bool,
        #[serde(default)]
        token: Option<u64>,
    },
    Remove {
        path: String,
        #[serde(default)]
        recursive: bool,
        #[serde(default)]
        token: Option<u64>,
    },
    /// Opens a byte tunnel to `127.0.0.1:port` inside the sandbox (fenced:
    /// the tunnel is the caller's hand on whatever listens there).
    Connect {
        port: u16,
        #[serde(default)]
        token: Option<u64>,
    },
    /// The sandbox's processes, read from `/proc` in envd's PID namespace.
    ListProcesses,
    /// Sends `signal` to process `pid` (fenced; envd and pid 1 refused).
    Signal {
        pid: i32,
        signal: i32,
        #[serde(default)]
        token: Option<u64>,
    },
    /// Starts a background command (stdin closed) and answers its handle.
    Spawn {
        argv: Vec<String>,
        #[serde(default)]
        cwd: Option<String>,
        #[serde(default)]
        env: Vec<(String, String)>,
        #[serde(default)]
        token: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
    },
    /// The kept output of a background command; with `follow`, until it exits.
    Output {
        handle: u64,
        #[serde(default)]
        follow: bool,
    },
}

/// A control message of a running `exec_pty` (a `Control` frame).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum PtyControl {
    /// The terminal's new window size (the process gets `SIGWINCH`).
    Resize { cols: u16, rows: u16 },
    /// Deliver a signal to the terminal's foreground process group.
    Signal { signal: SignalSpec },
}

/// A signal by name (`INT`, `SIGINT`, case-insensitive) or by number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SignalSpec {
    Number(i32),
    Name(String),
}

/// The signals a terminal client may send, by name and Linux number.
pub const PTY_SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("WINCH", 28),
];

impl SignalSpec {
    /// The signal's number, if it is one of [`PTY_SIGNALS`].
    pub fn number(&self) -> Option<i32> {
        match self {
            SignalSpec::Number(n) => PTY_SIGNALS.iter().find(|s| s.1 == *n).map(|s| s.1),
            SignalSpec::Name(name) => {
                let upper = name.to_ascii_uppercase();
                let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
                PTY_SIGNALS.iter().find(|s| s.0 == bare).map(|s| s.1)
            }
        }
    }
}

/// Checks a terminal size: both dimensions in 1..=[`MAX_PTY_CELLS`].
pub fn check_pty_size(cols: u16, rows: u16) -> Result<(), String> {
    if (1..=MAX_PTY_CELLS).contains(&cols) && (1..=MAX_PTY_CELLS).contains(&rows) {
        Ok(())
    } else {
        Err(format!(
            "terminal size {cols}x{rows} is out of range: cols and rows must be 1 to {MAX_PTY_CELLS}"
        ))
    }
}

/// Successful answers (the final frame, except `Opened`, which precedes file data).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Health(Health),
    Ok,
    Exit(ExitWire),
    Stat(FileStat),
    Opened { size: u64 },
    Written { bytes: u64 },
    Listed { count: u64 },
    Spawned { handle: u64, pid: i32 },
    Background(BackgroundInfo),
}

/// A background command's state (`output` without `follow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackgroundInfo {
    pub handle: u64,
    pub pid: i32,
    /// Set once it exited.
    pub exit: Option<ExitWire>,
    /// Bytes of each stream that fell out of the ring before this read.
    pub stdout_dropped: u64,
    pub stderr_dropped: u64,
}

/// One process of a sandbox, as envd read it from `/proc` (all of it written
/// by the sandbox: bounded, and never more than text to show).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: i32,
    pub ppid: i32,
    pub uid: u32,
    /// The uid's name in the sandbox's `/etc/passwd`, if any.
    pub user: Option<String>,
    /// `/proc/PID/stat`'s state letter (`R`, `S`, `Z`, ...).
    pub state: String,
    /// Arguments (lossy UTF-8), each at most [`MAX_LISTED_ARG`] bytes, at
    /// most [`MAX_LISTED_ARGS`] of them; empty for kernel-less zombies.
    pub argv: Vec<String>,
    /// Whether `argv` was cut.
    pub truncated: bool,
}

impl ProcessInfo {
    /// Whether the entry keeps envd's listing bounds (what a host reading a
    /// listing checks: the listing comes from inside the sandbox): at most
    /// [`MAX_LISTED_ARGS`] arguments of [`MAX_LISTED_ARG`] bytes, a short
    /// user name and state.
    pub fn within_bounds(&self) -> bool {
        self.argv.len() <= MAX_LISTED_ARGS
            && self.argv.iter().all(|a| a.len() <= MAX_LISTED_ARG)
            && self.user.as_ref().is_none_or(|u| u.len() <= MAX_NAME_LEN)
            && self.state.len() <= 8
    }
}

/// envd's health report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// envd's crate version.
    pub version: String,
    pub protocol: u32,
    pub uptime_ms: u64,
    /// Current lease fence: `Some(t)` leased with token t, `None` unleased.
    pub fence: Option<u64>,
    /// Highest fence ever set; the fence can never be set below it.
    pub highest_fence: Option<u64>,
    /// Whether envd runs as PID 1 (inside a sandbox) or as an ordinary process.
    pub pid1: bool,
    /// Processes started by exec that are still running.
    pub running_execs: u64,
}

/// How a process ended, as sent on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitWire {
    /// Exit code, or 128 + signal number when killed by a signal.
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_us: u64,
}

/// Kind of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// Metadata of one file (symlinks are reported as themselves, not followed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub name: String,
    /// Normalised absolute sandbox path.
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub modified_unix: i64,
}

/// Stable error codes that cross the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    NotFound,
    InvalidPath,
    AlreadyExists,
    NotEmpty,
    LeaseRequired,
    StaleToken,
    PermissionDenied,
    /// The path names a FIFO, socket, device (or other non-regular file) where
    /// a regular file is required. Refused at once, never opened for I/O that
    /// could block.
    NotRegularFile,
    /// The sandbox's disk (or its quota) is full: `ENOSPC`, `EDQUOT`, `EFBIG`.
    NoSpace,
    /// The request was malformed or violated the protocol.
    BadRequest,
    /// envd refused the connection because it is at its connection limit.
    Busy,
    /// Anything else (I/O failure inside the sandbox, spawn failure, ...).
    Internal,
    /// Nothing accepts connections on the requested port in the sandbox.
    PortUnreachable,
}

/// Payload of an `Error` frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

/// Why a sandbox path was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    NotAbsolute,
    ContainsNul,
    TooLong,
    NameTooLong,
    /// `..` would climb above the sandbox root.
    EscapesRoot,
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathError::NotAbsolute => "path must be absolute",
            PathError::ContainsNul => "path contains a NUL byte",
            PathError::TooLong => "path too long",
            PathError::NameTooLong => "path component too long",
            PathError::EscapesRoot => "path escapes the sandbox root",
        })
    }
}

impl std::error::Error for PathError {}

/// Normalises an absolute sandbox path lexically into its components:
/// empty and `.` components are dropped, `..` removes the previous component
/// and is refused when it would climb above `/`. `"/"` yields no components.
pub fn normalize_path(path: &str) -> Result<Vec<String>, PathError> {
    if path.len() > MAX_PATH_LEN {
        return Err(PathError::TooLong);
    }
    if path.contains('\0') {
        return Err(PathError::ContainsNul);
    }
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    let mut out: Vec<String> = Vec::new();
    for comp in path.split('/') {
        match comp {
            "" | "." => {}
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::EscapesRoot);
                }
            }
            name if name.len() > MAX_NAME_LEN => return Err(PathError::NameTooLong),
            name => out.push(name.to_owned()),
        }
    }
    Ok(out)
}

/// Joins normalised components back into an absolute path.
pub fn join_components(comps: &[String]) -> String {
    if comps.is_empty() {
        return "/".to_owned();
    }
    let mut s = String::new();
    for c in comps {
        s.push('/');
        s.push_str(c);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_processes_are_checked_against_envds_bounds() {
        let ok = ProcessInfo {
            pid: 2,
            ppid: 1,
            uid: 0,
            user: Some("root".into()),
            state: "S".into(),
            argv: vec!["a".repeat(MAX_LISTED_ARG); MAX_LISTED_ARGS],
            truncated: true,
        };
        assert!(ok.within_bounds());
        let mut long_arg = ok.clone();
        long_arg.argv[0].push('x');
        let mut many = ok.clone();
        many.argv.push(String::new());
        let mut user = ok.clone();
        user.user = Some("u".repeat(MAX_NAME_LEN + 1));
        let mut state = ok;
        state.state = "S".repeat(9);
        for bad in [long_arg, many, user, state] {
            assert!(!bad.within_bounds(), "{bad:?}");
        }
    }

    use proptest::prelude::*;

    #[test]
    fn frame_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, FrameKind::Stdout, b"hello").unwrap();
        write_frame(&mut buf, FrameKind::End, b"").unwrap();
        let mut r = &buf[..];
        let f = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(f.kind, FrameKind::Stdout);
        assert_eq!(f.payload, b"hello");
        assert_eq!(read_frame(&mut r).unwrap().unwrap().kind, FrameKind::End);
        assert!(read_frame(&mut r).unwrap().is_none());
    }

    #[test]
    fn oversized_header_is_refused_before_allocation() {
        let h = encode_header(FrameKind::Request, MAX_JSON_FRAME as usize + 1);
        let err = decode_header(h).unwrap_err();
        assert!(matches!(err, ProtoError::FrameTooLarge { .. }), "{err}");
        let mut r: &[u8] = &[2, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            read_frame(&mut r).unwrap_err(),
            ProtoError::FrameTooLarge { .. }
        ));
        let mut r: &[u8] = &[3, 0, 0, 0, 1, 0];
        assert!(matches!(
            read_frame(&mut r).unwrap_err(),
            ProtoError::FrameTooLarge { .. }
        ));
        let mut r: &[u8] = &[9, 0, 0, 0, 0];
        assert!(matches!(
            read_frame(&mut r).unwrap_err(),
            ProtoError::UnknownKind(9)
        ));
        let mut r: &[u8] = &[2, 0, 0, 0, 4, 1];
        assert!(matches!(
            read_frame(&mut r).unwrap_err(),
            ProtoError::UnexpectedEof
        ));
    }

    #[test]
    fn request_json_shape() {
        let r = Request::Exec {
            argv: vec!["/bin/sh".into(), "-c".into(), "exit 7".into()],
            cwd: None,
            env: vec![("A".into(), "b".into())],
            stdin: false,
            timeout_ms: Some(5),
            token: Some(3),
            user: Default::default(),
        };
        let j = encode_json(&r).unwrap();
        let s = std::str::from_utf8(&j).unwrap();
        assert!(
            s.starts_with(r#"{"op":"exec","argv":["/bin/sh","-c","exit 7"]"#),
            "{s}"
        );
        assert_eq!(decode_json::<Request>(&j).unwrap(), r);
        let minimal: Request = decode_json(br#"{"op":"mkdir","path":"/a"}"#).unwrap();
        assert_eq!(
            minimal,
            Request::Mkdir {
                path: "/a".into(),
                parents: false,
                token: None
            }
        );
    }

    #[test]
    fn pty_messages() {
        let c: PtyControl = decode_json(br#"{"type":"resize","cols":80,"rows":24}"#).unwrap();
        assert_eq!(c, PtyControl::Resize { cols: 80, rows: 24 });
        let c: PtyControl = decode_json(br#"{"type":"signal","signal":"sigint"}"#).unwrap();
        let PtyControl::Signal { signal } = c else {
            panic!("{c:?}")
        };
        assert_eq!(signal.number(), Some(2));
        assert_eq!(SignalSpec::Number(15).number(), Some(15));
        assert_eq!(SignalSpec::Number(0).number(), None);
        assert_eq!(SignalSpec::Name("SIGNOPE".into()).number(), None);
        decode_json::<PtyControl>(br#"{"type":"resize","cols":80,"rows":24,"x":1}"#).unwrap_err();
        check_pty_size(80, 24).unwrap();
        check_pty_size(0, 24).unwrap_err();
        check_pty_size(80, MAX_PTY_CELLS + 1).unwrap_err();
        let mut r: &[u8] = &[8, 0, 0, 4, 1];
        assert!(matches!(
            read_frame(&mut r).unwrap_err(),
            ProtoError::FrameTooLarge { .. }
        ));
    }

    #[test]
    fn normalize_paths() {
        assert_eq!(normalize_path("/").unwrap(), Vec::<String>::new());
        assert_eq!(normalize_path("//a/./b/../c/").unwrap(), vec!["a", "c"]);
        assert_eq!(join_components(&normalize_path("/a//b").unwrap()), "/a/b");
        assert_eq!(normalize_path("/..").unwrap_err(), PathError::EscapesRoot);
        assert_eq!(
            normalize_path("/a/../../etc/passwd").unwrap_err(),
            PathError::EscapesRoot
        );
        assert_eq!(normalize_path("a/b").unwrap_err(), PathError::NotAbsolute);
        assert_eq!(normalize_path("").unwrap_err(), PathError::NotAbsolute);
        assert_eq!(normalize_path("/a\0b").unwrap_err(), PathError::ContainsNul);
        let long = format!("/{}", "x".repeat(256));
        assert_eq!(normalize_path(&long).unwrap_err(), PathError::NameTooLong);
    }

    proptest! {
        #[test]
        fn decoder_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut r = &bytes[..];
            // Consume frames until the stream ends or the decoder refuses it.
            while let Ok(Some(frame)) = read_frame(&mut r) {
                prop_assert!(frame.payload.len() <= frame.kind.max_len() as usize);
                let _ = decode_json::<Request>(&frame.payload);
                let _ = decode_json::<Response>(&frame.payload);
                let _ = decode_json::<ErrorBody>(&frame.payload);
                if let Ok(PtyControl::Resize { cols, rows }) = decode_json::<PtyControl>(&frame.payload) {
                    let _ = check_pty_size(cols, rows);
                }
            }
        }

        #[test]
        fn decoder_never_panics_on_framed_random_payloads(kind in 0u8..11, payload in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut bytes = vec![kind];
            bytes.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
            bytes.extend_from_slice(&payload);
            let mut r = &bytes[..];
            if let Ok(Some(frame)) = read_frame(&mut r) {
                prop_assert_eq!(&frame.payload, &payload);
                let _ = decode_json::<Request>(&frame.payload);
            }
        }

        #[test]
        fn normalized_paths_never_escape(parts in proptest::collection::vec(prop_oneof![Just("..".to_string()), Just(".".to_string()), Just(String::new()), "[a-z]{1,3}"], 0..12)) {
            let path = format!("/{}", parts.join("/"));
            if let Ok(comps) = normalize_path(&path) {
                for c in &comps {
                    prop_assert!(c != ".." && c != "." && !c.is_empty() && !c.contains('/'));
                }
                prop_assert_eq!(normalize_path(&join_components(&comps)).unwrap(), comps);
            }
        }
    }
}
