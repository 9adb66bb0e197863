//! The one seam through which runtime backends start external programs.
//!
//! A backend builds a [`SpawnRequest`] and hands it to a [`Spawner`]; the real
//! spawner (in the backend crate, since it may need `pre_exec` tricks) runs
//! it, the [`RecordingSpawner`] fake records it and answers from a script.

use async_trait::async_trait;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// How the child's standard streams are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpawnStdio {
    /// stdin from /dev/null, stdout and stderr captured.
    Capture,
    /// All three on /dev/null. Needed for commands that leave long-lived
    /// descendants holding the streams (a detached container's PID 1).
    Null,
}

/// Extra isolation applied to the child before it execs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpawnIsolation {
    None,
    /// Run the child in a new, recursively private mount namespace in which
    /// these mount points are lazily unmounted (missing ones are skipped).
    PrivateMountNamespace {
        detach: Vec<PathBuf>,
    },
    /// Run the child in a private copy of the mount namespace held open by
    /// the caller's fd `ns` (one prepared once, whose mount table does not
    /// grow with the number of sandboxes), with the detached mount tree
    /// `tree` (an `open_tree(OPEN_TREE_CLONE)` fd) attached at its path
    /// when given. The caller keeps both fds open until `run` returns.
    JoinMountNamespace {
        ns: i32,
        tree: Option<(i32, PathBuf)>,
    },
}

/// One program to run to completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpawnRequest {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub stdio: SpawnStdio,
    pub isolation: SpawnIsolation,
    /// The child is killed when it runs longer than this.
    pub timeout: Duration,
    /// An open fd of the caller handed to the child as fd
    /// [`crate::ENVD_LISTEN_FD`] (3); the caller keeps it open until `run`
    /// returns. Everything else the caller has open stays close-on-exec.
    pub pass_fd: Option<i32>,
}

impl SpawnRequest {
    pub fn new(program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        SpawnRequest {
            program: program.into(),
            args,
            stdio: SpawnStdio::Capture,
            isolation: SpawnIsolation::None,
            timeout: Duration::from_secs(30),
            pass_fd: None,
        }
    }

    /// `program arg arg ...`, for messages.
    pub fn display(&self) -> String {
        let mut s = self.program.display().to_string();
        for a in &self.args {
            s.push(' ');
            s.push_str(a);
        }
        s
    }
}

/// How a spawned program ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpawnOutput {
    /// Exit code; `None` when killed by a signal (or by the timeout).
    pub code: Option<i32>,
    pub timed_out: bool,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl SpawnOutput {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
    /// A successful output with this stdout (for fakes).
    pub fn ok(stdout: impl Into<Vec<u8>>) -> Self {
        SpawnOutput {
            code: Some(0),
            stdout: stdout.into(),
            ..Default::default()
        }
    }
    /// A failed output with this exit code and stderr (for fakes).
    pub fn failed(code: i32, stderr: impl Into<Vec<u8>>) -> Self {
        SpawnOutput {
            code: Some(code),
            stderr: stderr.into(),
            ..Default::default()
        }
    }
}

/// Starts external programs. Runtimes never use `std::process` directly.
#[async_trait]
pub trait Spawner: Send + Sync {
    /// Runs the request to completion (or its timeout). `Err` only when the
    /// program could not be started at all.
    async fn run(&self, request: &SpawnRequest) -> std::io::Result<SpawnOutput>;
}

/// A fake [`Spawner`] for unit tests: records every request and answers from
/// a queue of scripted outputs (success with empty output once it runs dry).
#[derive(Default)]
pub struct RecordingSpawner {
    requests: Mutex<Vec<SpawnRequest>>,
    script: Mutex<VecDeque<std::io::Result<SpawnOutput>>>,
}

impl RecordingSpawner {
    pub fn new() -> Self {
        Self::default()
    }
    /// Queues the answer to the next unanswered request.
    pub fn push(&self, answer: std::io::Result<SpawnOutput>) {
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(answer);
    }
    /// Every request seen so far, in order.
    pub fn requests(&self) -> Vec<SpawnRequest> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[async_trait]
impl Spawner for RecordingSpawner {
    async fn run(&self, request: &SpawnRequest) -> std::io::Result<SpawnOutput> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request.clone());
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
            .unwrap_or_else(|| Ok(SpawnOutput::ok(Vec::new())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recording_spawner_records_and_replays() {
        let s = RecordingSpawner::new();
        s.push(Ok(SpawnOutput::failed(2, "nope")));
        let req = SpawnRequest::new("/bin/crun", vec!["list".into()]);
        let rt = tokio_free_block_on(s.run(&req));
        assert_eq!(rt.unwrap().code, Some(2));
        let second = tokio_free_block_on(s.run(&req)).unwrap();
        assert!(second.success());
        assert_eq!(s.requests(), vec![req.clone(), req]);
        assert_eq!(s.requests()[0].display(), "/bin/crun list");
    }

    /// Polls a future that never waits (the fake answers synchronously).
    fn tokio_free_block_on<F: std::future::Future>(f: F) -> F::Output {
        use std::task::{Context, Poll, Waker};
        let mut f = std::pin::pin!(f);
        let mut cx = Context::from_waker(Waker::noop());
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("fake spawner future was pending"),
        }
    }
}
