//! Processes of a sandbox: the listing (from envd's view of its own PID
//! namespace), signals, and background commands whose output a later
//! client reads back by handle.
//!
//! Invariants: only the caller's own sandboxes (another tenant's id is
//! `not_found`); signals and background starts are fenced like exec (the
//! context's lease token, checked here and again by envd); a fence move
//! ends background commands like every process and envd forgets their
//! handles, so a new lease holder never reads the previous one's output.
//! What envd reports (argv, user names, output) is the sandbox's data,
//! bounded by envd and again by the client, and only ever shown.

use crate::context::OpContext;
use crate::error::OpError;
use crate::requests::OnSandbox;
use crate::ControlPlane;
use aviary_core::api::{
    BackgroundOutput, BackgroundStarted, ExecRequest, ProcessEntry, ProcessList,
};
use aviary_envd_proto::ExecStream;

/// A signal name as the API takes it (`TERM` or `SIGTERM`, any case) →
/// its number; `TERM` when absent.
pub fn signal_number(name: Option<&str>) -> Result<i32, OpError> {
    let Some(name) = name else {
        return Ok(libc_signal::TERM);
    };
    let upper = name.trim().to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    Ok(match bare {
        "TERM" => libc_signal::TERM,
        "KILL" => libc_signal::KILL,
        "INT" => libc_signal::INT,
        "HUP" => libc_signal::HUP,
        "QUIT" => libc_signal::QUIT,
        "USR1" => libc_signal::USR1,
        "USR2" => libc_signal::USR2,
        "STOP" => libc_signal::STOP,
        "CONT" => libc_signal::CONT,
        _ => {
            return Err(OpError::InvalidRequest(format!(
            "signal must be one of TERM, KILL, INT, HUP, QUIT, USR1, USR2, STOP, CONT, not {:?}",
            name.chars().take(16).collect::<String>()
        )))
        }
    })
}

/// Linux's signal numbers (x86-64, aarch64: the same for these).
mod libc_signal {
    pub const HUP: i32 = 1;
    pub const INT: i32 = 2;
    pub const QUIT: i32 = 3;
    pub const KILL: i32 = 9;
    pub const USR1: i32 = 10;
    pub const USR2: i32 = 12;
    pub const TERM: i32 = 15;
    pub const CONT: i32 = 18;
    pub const STOP: i32 = 19;
}

impl ControlPlane {
    /// The processes of one of the caller's sandboxes.
    pub async fn list_processes(&self, cx: &OpContext, id: &str) -> Result<ProcessList, OpError> {
        let (rec, live) = self.readable(cx, id).await?;
        let procs = self
            .via_envd(&rec, &live, live.envd.list_processes().await)
            .await?;
        Ok(ProcessList {
            processes: procs
                .into_iter()
                .map(|p| ProcessEntry {
                    pid: p.pid,
                    ppid: p.ppid,
                    uid: p.uid,
                    user: p.user,
                    state: p.state,
                    argv: p.argv,
                    truncated: p.truncated,
                })
                .collect(),
        })
    }

    /// Sends a signal to one process of the sandbox (fenced).
    pub async fn signal_process(
        &self,
        cx: &OpContext,
        id: &str,
        pid: i32,
        signal: Option<&str>,
    ) -> Result<(), OpError> {
        let signum = signal_number(signal)?;
        if pid <= 1 {
            return Err(OpError::PermissionDenied(
                "pid 1 is the sandbox's envd; it is never signalled".into(),
            ));
        }
        let (rec, live) = self.writable(cx, id).await?;
        let r = live
            .envd
            .signal(pid, signum, cx.token.map(|t| t.fence()))
            .await;
        self.via_envd(&rec, &live, r).await.map_err(|e| match e {
            OpError::NotFound(_) => OpError::NotFound(format!("process {pid}")),
            e => e,
        })
    }

    /// Starts a background command (fenced): envd keeps its output and
    /// exit; the answer is its handle.
    pub async fn start_background(
        &self,
        cx: &OpContext,
        req: OnSandbox<ExecRequest>,
    ) -> Result<BackgroundStarted, OpError> {
        if req.request.stdin.is_some() || req.request.timeout_s.is_some() {
            return Err(OpError::InvalidRequest(
                "a background command takes no stdin and no timeout_s (signal it to end it)".into(),
            ));
        }
        let mut spec = Self::exec_spec(&req.request)?;
        let (rec, live) = self.writable(cx, &req.id).await?;
        if let Some(venv) = self.active_venv(&rec.id).await? {
            for (k, v) in venv.exec_env(aviary_envd_proto::DEFAULT_PATH) {
                if !spec.env.iter().any(|(have, _)| *have == k) {
                    spec.env.push((k, v));
                }
            }
        }
        for (k, v) in &rec.env {
            if !spec.env.iter().any(|(name, _)| name == k) {
                spec.env.push((k.clone(), v.clone()));
            }
        }
        if spec.cwd.is_none() {
            spec.cwd = rec.workdir.clone();
        }
        spec.user = rec.run_as.clone();
        let r = live.envd.spawn(spec, cx.token.map(|t| t.fence())).await;
        let (handle, pid) = self.via_envd(&rec, &live, r).await?;
        self.metrics.inc_exec();
        self.touch_lazily(&rec.id);
        Ok(BackgroundStarted { handle, pid })
    }

    /// What envd kept of a background command, and whether it still runs.
    pub async fn background_output(
        &self,
        cx: &OpContext,
        id: &str,
        handle: u64,
    ) -> Result<BackgroundOutput, OpError> {
        let (rec, live) = self.readable(cx, id).await?;
        let r = live.envd.output(handle).await;
        let (out, err, info) = self
            .via_envd(&rec, &live, r)
            .await
            .map_err(|e| not_found_handle(e, handle))?;
        Ok(BackgroundOutput {
            handle,
            pid: info.pid,
            running: info.exit.is_none(),
            exit_code: info.exit.map(|e| e.exit_code),
            stdout: String::from_utf8_lossy(&out).into_owned(),
            stderr: String::from_utf8_lossy(&err).into_owned(),
            stdout_dropped: info.stdout_dropped,
            stderr_dropped: info.stderr_dropped,
        })
    }

    /// Follows a background command: kept output, new output, its exit.
    pub async fn follow_background(
        &self,
        cx: &OpContext,
        id: &str,
        handle: u64,
    ) -> Result<FollowedOutput, OpError> {
        let (rec, live) = self.readable(cx, id).await?;
        let r = live.envd.follow_output(handle).await;
        let mut stream = self.via_envd(&rec, &live, r).await?;
        // an unknown handle is envd's first (and only) frame: surface it as
        // the answer's status, not inside the stream
        match stream.next().await {
            Ok(first) => Ok(FollowedOutput {
                first: Some(first),
                stream,
            }),
            Err(e) => Err(not_found_handle(
                self.envd_failed(&rec, &live, e).await,
                handle,
            )),
        }
    }
}

fn not_found_handle(e: OpError, handle: u64) -> OpError {
    match e {
        OpError::NotFound(_) => OpError::NotFound(format!("background command {handle}")),
        OpError::Coded {
            code: aviary_core::ErrorCode::NotFound,
            ..
        } => OpError::NotFound(format!("background command {handle}")),
        e => e,
    }
}

/// A followed background command: output events, then its exit (last).
/// Dropping it stops following; the command runs on.
pub struct FollowedOutput {
    first: Option<aviary_envd_proto::ExecEvent>,
    stream: ExecStream,
}

impl FollowedOutput {
    pub async fn next(
        &mut self,
    ) -> Result<aviary_envd_proto::ExecEvent, aviary_envd_proto::EnvdError> {
        match self.first.take() {
            Some(ev) => Ok(ev),
            None => self.stream.next().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names_map_to_linux_numbers() {
        assert_eq!(signal_number(None).unwrap(), 15);
        assert_eq!(signal_number(Some("kill")).unwrap(), 9);
        assert_eq!(signal_number(Some("SIGUSR1")).unwrap(), 10);
        assert_eq!(
            signal_number(Some("SEGV")).unwrap_err().code(),
            aviary_core::ErrorCode::InvalidRequest
        );
    }
}
