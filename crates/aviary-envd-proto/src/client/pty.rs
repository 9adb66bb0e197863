//! The client side of `exec_pty`: a process on a pseudo-terminal.
//!
//! [`EnvdClient::exec_pty`] returns two halves on one connection (each its
//! own duplicated descriptor, so they can live in different tasks):
//! [`PtyInput`] sends terminal input, window sizes and signals;
//! [`PtyOutput`] yields terminal output and finally the exit. The
//! connection closes when both are dropped; envd then hangs the terminal up
//! and kills the process group if it still runs.

use super::{
    error_from_payload, read_frame, read_response, write_frame, Conn, EnvdClient, EnvdError,
    ExitInfo,
};
use crate::{
    check_pty_size, decode_json, encode_json, FrameKind, PtyControl, Request, Response, SignalSpec,
    CHUNK_SIZE,
};
use std::time::Duration;

/// What to run on a terminal.
#[derive(Debug, Clone, Default)]
pub struct PtySpec {
    /// Program and arguments.
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    /// Added to envd's clean default environment, as for exec.
    pub env: Vec<(String, String)>,
    /// The sandbox user to run as (`name`, `uid`, `name:group`, `uid:gid`).
    pub user: Option<String>,
    /// Initial window size.
    pub cols: u16,
    pub rows: u16,
}

/// One event of a terminal session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtyEvent {
    /// Bytes the terminal printed (the process's stdout and stderr, merged
    /// as a terminal merges them). The sandbox's: just bytes.
    Output(Vec<u8>),
    /// Always the last event.
    Exit(ExitInfo),
}

/// The sending half of a terminal session.
#[derive(Debug)]
pub struct PtyInput {
    conn: Conn,
}

impl PtyInput {
    /// Types `data` into the terminal (sent in chunks of at most [`CHUNK_SIZE`]).
    pub async fn write(&mut self, data: &[u8]) -> Result<(), EnvdError> {
        for chunk in data.chunks(CHUNK_SIZE) {
            write_frame(&mut self.conn, FrameKind::Data, chunk).await?;
        }
        Ok(())
    }

    /// Sets the terminal's window size (the foreground process gets SIGWINCH).
    pub async fn resize(&mut self, cols: u16, rows: u16) -> Result<(), EnvdError> {
        check_pty_size(cols, rows).map_err(EnvdError::BadRequest)?;
        self.control(&PtyControl::Resize { cols, rows }).await
    }

    /// Sends a signal to the terminal's foreground process group.
    pub async fn signal(&mut self, signal: SignalSpec) -> Result<(), EnvdError> {
        if signal.number().is_none() {
            return Err(EnvdError::BadRequest(format!(
                "unknown signal {signal:?}; one of {}",
                crate::PTY_SIGNALS
                    .iter()
                    .map(|s| s.0)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        self.control(&PtyControl::Signal { signal }).await
    }

    async fn control(&mut self, msg: &PtyControl) -> Result<(), EnvdError> {
        let payload = encode_json(msg).map_err(EnvdError::Protocol)?;
        write_frame(&mut self.conn, FrameKind::Control, &payload).await
    }
}

/// The receiving half of a terminal session.
#[derive(Debug)]
pub struct PtyOutput {
    conn: Conn,
    finished: bool,
}

impl PtyOutput {
    /// The next output chunk, or the exit (always last).
    pub async fn next(&mut self) -> Result<PtyEvent, EnvdError> {
        if self.finished {
            return Err(EnvdError::StreamFinished);
        }
        let (kind, payload) = read_frame(&mut self.conn).await?;
        match kind {
            FrameKind::Stdout => Ok(PtyEvent::Output(payload)),
            FrameKind::Response => {
                self.finished = true;
                match decode_json::<Response>(&payload).map_err(EnvdError::Protocol)? {
                    Response::Exit(w) => Ok(PtyEvent::Exit(ExitInfo {
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
}

impl EnvdClient {
    /// Starts a process on a new pseudo-terminal. Returns once envd has
    /// started it; refusals (fence, user, cwd, a command that cannot start)
    /// are this call's error.
    pub async fn exec_pty(
        &self,
        spec: PtySpec,
        token: Option<u64>,
    ) -> Result<(PtyInput, PtyOutput), EnvdError> {
        check_pty_size(spec.cols, spec.rows).map_err(EnvdError::BadRequest)?;
        let req = Request::ExecPty {
            argv: spec.argv,
            cwd: spec.cwd,
            env: spec.env,
            user: spec.user,
            cols: spec.cols,
            rows: spec.rows,
            token,
        };
        let mut conn = self.connect(&req).await?;
        match read_response(&mut conn).await? {
            Response::Ok => {}
            _ => return Err(EnvdError::unexpected(FrameKind::Response)),
        }
        let (output, input) = conn.duplicate().map_err(EnvdError::Transport)?;
        Ok((
            PtyInput { conn: input },
            PtyOutput {
                conn: output,
                finished: false,
            },
        ))
    }
}
