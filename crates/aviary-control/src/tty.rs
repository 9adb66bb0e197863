//! Interactive terminals: a command on a pseudo-terminal in a sandbox
//! (`aviary sandbox exec -it`, the API's `exec/tty` WebSocket).
//!
//! The operation is exec's, on envd's `exec_pty`: the same sandbox checks
//! (tenant, running, not paused, the context's lease token), the same
//! environment order (the request's, the task's venv, the sandbox's and
//! the template's defaults), the sandbox's working directory and user
//! unless the request names its own. A session is recorded twice in the
//! event log: `tty_started` (command, user, size) and `tty_exited` (exit
//! code, signal, duration); what is typed and printed is not recorded.

use std::collections::BTreeMap;

use aviary_core::{SandboxId, SandboxState};
use aviary_envd_proto::{PtyInput, PtyOutput, PtySpec};
use serde::{Deserialize, Serialize};

use crate::ops::{check_sandbox_path, ControlPlane, ExecGuard};
use crate::requests::OnSandbox;
use crate::{OpContext, OpError};

/// Default window size when the start message names none.
const DEFAULT_COLS: u16 = 80;
const DEFAULT_ROWS: u16 = 24;
/// Longest `user` accepted (`name`, `uid`, `name:group`, `uid:gid`).
const MAX_USER: usize = 65;

/// What to run on the terminal: the first message of an `exec/tty` session.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TtyStart {
    /// Program and arguments (`argv` is accepted too); default `["/bin/sh"]`.
    #[serde(default, alias = "argv")]
    pub cmd: Vec<String>,
    /// Working directory (absolute; `workdir` is accepted too); default:
    /// the sandbox's.
    #[serde(default, alias = "workdir")]
    pub cwd: Option<String>,
    /// Environment variables, over the sandbox's defaults (`TERM` defaults
    /// to `xterm-256color`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The sandbox user to run as (`name`, `uid`, `name:group`, `uid:gid`);
    /// default: the sandbox's (its image's `User`, else root).
    #[serde(default)]
    pub user: Option<String>,
    /// Window width in cells, 1-4096 (default 80).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 4096)]
    pub cols: Option<u16>,
    /// Window height in cells, 1-4096 (default 24).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 4096)]
    pub rows: Option<u16>,
}

impl TtyStart {
    /// Checks everything that needs no sandbox: the command (as exec's:
    /// no NUL, bounded size), cwd, user and window size.
    pub fn validate(&self) -> Result<(), OpError> {
        let as_exec = aviary_core::api::ExecRequest {
            cmd: Some(self.cmd.clone()),
            cwd: self.cwd.clone(),
            env: self.env.clone(),
            ..Default::default()
        };
        crate::validate::exec_request(&as_exec)?;
        if let Some(cwd) = &self.cwd {
            check_sandbox_path(cwd)?;
        }
        if let Some(u) = &self.user {
            let ok = !u.is_empty()
                && u.len() <= MAX_USER
                && u.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b));
            if !ok {
                return Err(OpError::InvalidRequest(format!(
                    "user must be 1-{MAX_USER} characters of A-Z a-z 0-9 '.' '_' '-' ':' (name, uid, name:group or uid:gid)"
                )));
            }
        }
        let (cols, rows) = self.size();
        aviary_envd_proto::check_pty_size(cols, rows).map_err(OpError::InvalidRequest)
    }

    /// The window size asked for, defaults filled in.
    pub fn size(&self) -> (u16, u16) {
        (
            self.cols.unwrap_or(DEFAULT_COLS),
            self.rows.unwrap_or(DEFAULT_ROWS),
        )
    }
}

/// A running terminal session: its two halves, and the session that
/// [`ControlPlane::exec_tty_finish`] records the end of.
pub struct TtyRun {
    /// Keyboard, window size and signals.
    pub input: PtyInput,
    /// Terminal output, then the exit.
    pub output: PtyOutput,
    pub session: TtySession,
}

/// Which sandbox a terminal session runs in; keeps the sandbox counted
/// busy until dropped.
pub struct TtySession {
    pub id: SandboxId,
    tenant: String,
    state: SandboxState,
    request_id: Option<String>,
    /// Keeps the sandbox counted busy while the session runs.
    _busy: ExecGuard,
}

impl ControlPlane {
    /// Whether a terminal could start on sandbox `id` for this context
    /// (tenant, running, not paused, lease token): checked before a
    /// WebSocket is accepted, so refusals are plain HTTP answers.
    pub async fn tty_admissible(&self, cx: &OpContext, id: &str) -> Result<(), OpError> {
        self.writable(cx, id).await.map(|_| ())
    }

    /// Starts `req` on a new terminal in the sandbox.
    pub async fn exec_tty_start(
        &self,
        cx: &OpContext,
        req: OnSandbox<TtyStart>,
    ) -> Result<TtyRun, OpError> {
        let start = req.request;
        start.validate()?;
        let (rec, live) = self.writable(cx, &req.id).await?;
        let mut env: Vec<(String, String)> = start.env.clone().into_iter().collect();
        if let Some(venv) = self.active_venv(&rec.id).await? {
            for (k, v) in venv.exec_env(aviary_envd_proto::DEFAULT_PATH) {
                if !env.iter().any(|(have, _)| *have == k) {
                    env.push((k, v));
                }
            }
        }
        for (k, v) in &rec.env {
            if !env.iter().any(|(have, _)| have == k) {
                env.push((k.clone(), v.clone()));
            }
        }
        let argv = if start.cmd.is_empty() {
            vec!["/bin/sh".to_owned()]
        } else {
            start.cmd.clone()
        };
        let (cols, rows) = start.size();
        let user = start.user.clone().or_else(|| rec.run_as.clone());
        let spec = PtySpec {
            argv: argv.clone(),
            cwd: start.cwd.clone().or_else(|| rec.workdir.clone()),
            env,
            user: user.clone(),
            cols,
            rows,
        };
        let (input, output) = self
            .via_envd(
                &rec,
                &live,
                live.envd.exec_pty(spec, cx.token.map(|t| t.fence())).await,
            )
            .await?;
        self.metrics.inc_exec();
        self.event(
            &rec,
            "tty_started",
            cx.request_id(),
            serde_json::json!({"cmd": argv, "user": user, "cols": cols, "rows": rows}),
        )
        .await?;
        Ok(TtyRun {
            input,
            output,
            session: TtySession {
                id: rec.id.clone(),
                tenant: rec.tenant.clone(),
                state: rec.state,
                request_id: cx.request_id().map(str::to_owned),
                _busy: ExecGuard::new(live),
            },
        })
    }

    /// Records the end of a session (its exit, or `None` when it ended
    /// without one: the client went away or envd failed).
    pub async fn exec_tty_finish(
        &self,
        run: &TtySession,
        exit: Option<&aviary_envd_proto::ExitInfo>,
    ) {
        self.touch_lazily(&run.id);
        let meta = match exit {
            Some(e) => serde_json::json!({
                "exit_code": e.exit_code,
                "signal": e.signal,
                "duration_ms": e.duration.as_secs_f64() * 1000.0,
            }),
            None => serde_json::json!({"exit_code": null, "ended": "disconnected"}),
        };
        if let Err(e) = self
            .record_event(
                &run.tenant,
                Some(&run.id),
                Some(run.state),
                "tty_exited",
                run.request_id.as_deref(),
                meta,
            )
            .await
        {
            tracing::warn!(sandbox.id = %run.id, error = %e, "could not record the end of a terminal session");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_messages_are_checked() {
        let ok: TtyStart =
            serde_json::from_str(r#"{"argv":["/bin/sh"],"workdir":"/tmp","cols":120,"rows":40}"#)
                .unwrap();
        ok.validate().unwrap();
        assert_eq!(ok.size(), (120, 40));
        assert_eq!(TtyStart::default().size(), (80, 24));
        serde_json::from_str::<TtyStart>(r#"{"cmd":["sh"],"colz":1}"#).unwrap_err();
        serde_json::from_str::<TtyStart>(r#"{"cols":70000}"#).unwrap_err();
        for bad in [
            r#"{"cols":0}"#,
            r#"{"rows":5000}"#,
            r#"{"cwd":"relative"}"#,
            r#"{"user":"a b"}"#,
            r#"{"user":""}"#,
            r#"{"cmd":["a\u0000b"]}"#,
            r#"{"env":{"A=B":"c"}}"#,
        ] {
            let s: TtyStart = serde_json::from_str(bad).unwrap();
            s.validate().unwrap_err();
        }
    }
}
