//! Processes started through the envd surface, and the pump that carries
//! each one's output from Aviary's envd to its E2B clients.
//!
//! E2B's envd keeps a process running when the client that started it
//! goes away, and lets other calls find it (`List`), attach to it
//! (`Connect`) and end it (`SendSignal`). Aviary's envd ends an exec when
//! the connection that started it closes, so each started process gets a
//! pump task that owns that connection and drains it until the process
//! exits, whoever is listening: the starting call through a bounded
//! channel (back-pressure, nothing dropped), attached calls through a
//! broadcast (one that falls behind is cut off with an error). A kill drops
//! the connection, and envd kills the process group.
//!
//! The table lives in this replica's memory: a process started through
//! another replica is not listed here (DESIGN: the live handles a replica
//! keeps). Entries leave the table when their process ends.

use crate::connect::{Code, ConnectError};
use aviary_control::ops::ExecRun;
use aviary_control::ControlPlane;
use bytes::Bytes;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, mpsc, Notify};

/// What a process was started with (E2B's `ProcessConfig`, as `List` shows it).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// How a process ended, in E2B's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndInfo {
    /// The exit code; -1 when a signal ended it (as Go's `ExitCode()`).
    pub exit_code: i32,
    /// Go's `ProcessState.String()`: `exit status N` or `signal: killed`.
    pub status: String,
    /// The process ran past its call's deadline (`Connect-Timeout-Ms`).
    pub deadline_exceeded: bool,
}

impl EndInfo {
    pub fn from_exit(exit: &aviary_envd_proto::ExitInfo) -> Self {
        match exit.signal {
            Some(sig) => EndInfo {
                exit_code: -1,
                status: format!("signal: {}", signal_name(sig)),
                deadline_exceeded: exit.timed_out,
            },
            None => EndInfo {
                exit_code: exit.exit_code,
                status: format!("exit status {}", exit.exit_code),
                deadline_exceeded: exit.timed_out,
            },
        }
    }

    fn killed() -> Self {
        EndInfo {
            exit_code: -1,
            status: "signal: killed".into(),
            deadline_exceeded: false,
        }
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        n => format!("signal {n}"),
    }
}

/// One event of a process's life after its start.
#[derive(Clone, Debug)]
pub enum ProcEvent {
    Stdout(Bytes),
    Stderr(Bytes),
    /// What a PTY printed (its process's stdout and stderr, merged).
    Pty(Bytes),
    End(EndInfo),
    /// The exec broke (envd gone, sandbox lost): the stream ends with it.
    Failed(ConnectError),
}

/// A running process.
pub struct Proc {
    pub pid: u32,
    pub config: ProcessConfig,
    pub tag: Option<String>,
    events: broadcast::Sender<ProcEvent>,
    kill: Notify,
    /// A PTY's keyboard and window size (`SendInput`, `Update`); `None`
    /// for a plain command.
    pty: Option<tokio::sync::Mutex<aviary_envd_proto::PtyInput>>,
    /// A plain command started with `stdin: true`: the write end of its
    /// stdin (`SendInput`, `StreamInput`), `None` inside once closed
    /// (`CloseStdin`: the command reads end of file).
    stdin: Option<tokio::sync::Mutex<Option<tokio::io::DuplexStream>>>,
}

impl Proc {
    /// Attaches to the process's output from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<ProcEvent> {
        self.events.subscribe()
    }

    /// Ends the process: its envd connection is dropped, and envd kills
    /// its process group.
    pub fn kill(&self) {
        self.kill.notify_one();
    }

    /// The PTY's input half, when the process runs on one.
    pub fn pty(&self) -> Option<&tokio::sync::Mutex<aviary_envd_proto::PtyInput>> {
        self.pty.as_ref()
    }

    /// The write end of a plain command's stdin, when it was started with
    /// one (`None` inside: closed).
    pub fn stdin(&self) -> Option<&tokio::sync::Mutex<Option<tokio::io::DuplexStream>>> {
        self.stdin.as_ref()
    }
}

/// The processes of every sandbox, by sandbox id then pid.
#[derive(Default)]
pub struct Processes {
    next_pid: AtomicU32,
    table: Mutex<HashMap<String, HashMap<u32, Arc<Proc>>>>,
}

impl Processes {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<u32, Arc<Proc>>>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The running processes of a sandbox.
    pub fn list(&self, sandbox: &str) -> Vec<Arc<Proc>> {
        let mut v: Vec<_> = self
            .table()
            .get(sandbox)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        v.sort_by_key(|p| p.pid);
        v
    }

    /// A running process by pid or tag.
    pub fn find(&self, sandbox: &str, sel: &Selector) -> Option<Arc<Proc>> {
        let t = self.table();
        let procs = t.get(sandbox)?;
        match sel {
            Selector::Pid(pid) => procs.get(pid).cloned(),
            Selector::Tag(tag) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
        }
    }

    /// Drops a sandbox's entries (it was killed: its processes are gone).
    pub fn forget_sandbox(&self, sandbox: &str) {
        if let Some(procs) = self.table().remove(sandbox) {
            for p in procs.values() {
                p.kill();
            }
        }
    }

    fn remove(&self, sandbox: &str, pid: u32) {
        let mut t = self.table();
        if let Some(m) = t.get_mut(sandbox) {
            m.remove(&pid);
            if m.is_empty() {
                t.remove(sandbox);
            }
        }
    }

    /// Registers a started exec (with the write end of its stdin, when it
    /// has one) and spawns its pump; answers the process and the starting
    /// call's channel of events.
    pub fn start(
        self: &Arc<Self>,
        cp: Arc<ControlPlane>,
        sandbox: String,
        config: ProcessConfig,
        tag: Option<String>,
        run: ExecRun,
        stdin: Option<tokio::io::DuplexStream>,
    ) -> (Arc<Proc>, mpsc::Receiver<ProcEvent>) {
        // E2B shows pids; Aviary's envd does not expose the process's own,
        // so the surface numbers processes itself (unique per replica)
        let pid = 1000 + self.next_pid.fetch_add(1, Ordering::Relaxed);
        let (events, _) = broadcast::channel(256);
        let proc = Arc::new(Proc {
            pid,
            config,
            tag,
            events,
            kill: Notify::new(),
            pty: None,
            stdin: stdin.map(|w| tokio::sync::Mutex::new(Some(w))),
        });
        self.table()
            .entry(sandbox.clone())
            .or_default()
            .insert(pid, proc.clone());
        let (tx, rx) = mpsc::channel(64);
        let procs = self.clone();
        let p = proc.clone();
        tokio::spawn(async move {
            pump(cp, run, &p, tx).await;
            procs.remove(&sandbox, p.pid);
        });
        (proc, rx)
    }
}

impl Processes {
    /// Registers a started terminal session (E2B's PTY) and spawns its
    /// pump; `deadline` ends it like a command's timeout.
    pub fn start_pty(
        self: &Arc<Self>,
        cp: Arc<ControlPlane>,
        sandbox: String,
        config: ProcessConfig,
        run: aviary_control::tty::TtyRun,
        deadline: Option<std::time::Duration>,
    ) -> (Arc<Proc>, mpsc::Receiver<ProcEvent>) {
        let pid = 1000 + self.next_pid.fetch_add(1, Ordering::Relaxed);
        let (events, _) = broadcast::channel(256);
        let aviary_control::tty::TtyRun {
            input,
            output,
            session,
        } = run;
        let proc = Arc::new(Proc {
            pid,
            config,
            tag: None,
            events,
            kill: Notify::new(),
            pty: Some(tokio::sync::Mutex::new(input)),
            stdin: None,
        });
        self.table()
            .entry(sandbox.clone())
            .or_default()
            .insert(pid, proc.clone());
        let (tx, rx) = mpsc::channel(64);
        let procs = self.clone();
        let p = proc.clone();
        tokio::spawn(async move {
            pump_pty(cp, output, session, &p, tx, deadline).await;
            // the table held the input half: the session's connection
            // closes with the entry, and envd ends the terminal's processes
            procs.remove(&sandbox, p.pid);
        });
        (proc, rx)
    }
}

/// Drains a terminal session until it exits, is killed or runs past its
/// deadline, handing its output to the starting call and attached calls.
async fn pump_pty(
    cp: Arc<ControlPlane>,
    mut output: aviary_envd_proto::PtyOutput,
    session: aviary_control::tty::TtySession,
    proc: &Proc,
    tx: mpsc::Sender<ProcEvent>,
    deadline: Option<std::time::Duration>,
) {
    let mut primary = Some(tx);
    let timer = async {
        match deadline {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(timer);
    loop {
        let ev = tokio::select! {
            r = output.next() => match r {
                Ok(aviary_envd_proto::PtyEvent::Output(d)) => ProcEvent::Pty(d.into()),
                Ok(aviary_envd_proto::PtyEvent::Exit(exit)) => {
                    cp.exec_tty_finish(&session, Some(&exit)).await;
                    ProcEvent::End(EndInfo::from_exit(&exit))
                }
                Err(e) => {
                    cp.exec_tty_finish(&session, None).await;
                    let e = aviary_control::OpError::from(e);
                    ProcEvent::Failed(ConnectError::new(
                        Code::Unavailable,
                        format!("the terminal's output was cut: {}", e.public_message()),
                    ))
                }
            },
            _ = proc.kill.notified() => {
                cp.exec_tty_finish(&session, None).await;
                ProcEvent::End(EndInfo::killed())
            }
            _ = &mut timer => {
                cp.exec_tty_finish(&session, None).await;
                ProcEvent::End(EndInfo {
                    deadline_exceeded: true,
                    ..EndInfo::killed()
                })
            }
        };
        let last = matches!(ev, ProcEvent::End(_) | ProcEvent::Failed(_));
        let _ = proc.events.send(ev.clone());
        if let Some(tx) = &primary {
            if tx.send(ev).await.is_err() {
                primary = None;
            }
        }
        if last {
            return;
        }
    }
}

/// A process named by `pid` or `tag` (E2B's `ProcessSelector`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    Pid(u32),
    Tag(String),
}

/// Drains the exec until it ends (or is killed), handing every event to
/// the starting call (while it listens) and to attached calls.
async fn pump(cp: Arc<ControlPlane>, mut run: ExecRun, proc: &Proc, tx: mpsc::Sender<ProcEvent>) {
    let mut primary = Some(tx);
    loop {
        let ev = tokio::select! {
            r = run.stream.next() => match r {
                Ok(aviary_envd_proto::ExecEvent::Stdout(d)) => ProcEvent::Stdout(d.into()),
                Ok(aviary_envd_proto::ExecEvent::Stderr(d)) => ProcEvent::Stderr(d.into()),
                Ok(aviary_envd_proto::ExecEvent::Exit(exit)) => {
                    cp.exec_finish(&run, &exit).await;
                    ProcEvent::End(EndInfo::from_exit(&exit))
                }
                Err(e) => {
                    let e = aviary_control::OpError::from(e);
                    ProcEvent::Failed(ConnectError::new(
                        Code::Unavailable,
                        format!("the process's output was cut: {}", e.public_message()),
                    ))
                }
            },
            _ = proc.kill.notified() => ProcEvent::End(EndInfo::killed()),
        };
        let last = matches!(ev, ProcEvent::End(_) | ProcEvent::Failed(_));
        let _ = proc.events.send(ev.clone());
        if let Some(tx) = &primary {
            if tx.send(ev).await.is_err() {
                // the starting client went away; the process runs on
                primary = None;
            }
        }
        if last {
            // dropping `run` here, for a kill, closes envd's connection:
            // envd kills the process group
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn exits_and_signals_read_as_go_prints_them() {
        let exit = |code, signal| aviary_envd_proto::ExitInfo {
            exit_code: code,
            signal,
            timed_out: false,
            duration: Duration::ZERO,
        };
        let e = EndInfo::from_exit(&exit(3, None));
        assert_eq!((e.exit_code, e.status.as_str()), (3, "exit status 3"));
        let e = EndInfo::from_exit(&exit(137, Some(9)));
        assert_eq!((e.exit_code, e.status.as_str()), (-1, "signal: killed"));
        assert_eq!(EndInfo::killed().status, "signal: killed");
    }
}
