//! envd's socket under gVisor, and how it steps aside for a checkpoint.
//!
//! With `--gvisor-host-socket` envd's listener is a host socket (runsc
//! `--host-uds=create`), and gVisor cannot save a sandbox that holds one: a
//! `runsc checkpoint` with the listener (or any accepted host connection)
//! open fails and ends the sandbox. So the host asks first, with signals only
//! it can send (envd ignores signals from inside the sandbox, see
//! `signal_loop`):
//! - `SIGUSR1` (quiesce): envd stops accepting, closes and unlinks its
//!   listener, waits for its open connections to end (at most
//!   [`DRAIN_LIMIT`]), then writes the marker [`QUIESCED_NAME`] beside the
//!   socket. The host checkpoints once it sees the marker.
//! - `SIGUSR2` (resume, after a restore or a checkpoint that kept the
//!   sandbox running): envd removes the marker and binds its socket again.
//! - `SIGHUP` (resume as a live fork): the same, after envd forgot the lease
//!   state of the sandbox whose memory it was restored from (fence back to
//!   unleased, tunnels and background handles gone; processes kept). The
//!   host sends it only to a *new* sandbox restored from another's image.
//!
//! The marker is in a directory the sandbox can write, so the sandbox could
//! forge it; the only effect is a failed checkpoint of that same sandbox
//! (the host then falls back to its file-system snapshot).

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The marker envd writes beside its socket once it holds no host socket.
pub const QUIESCED_NAME: &str = "quiesced";
/// Longest envd waits for open connections to end before it writes the
/// marker anyway (a checkpoint then fails, and the host falls back).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// How often the accept loop looks for a quiesce request.
const POLL: Duration = Duration::from_millis(100);

/// What the host asked for last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Serve,
    Quiesce,
}

/// The host's requests, set by the signal thread and read by the accept loop.
pub struct Gate {
    want: Mutex<Want>,
    changed: Condvar,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            want: Mutex::new(Want::Serve),
            changed: Condvar::new(),
        }
    }
}

impl Gate {
    fn set(&self, w: Want) {
        *self.want.lock().unwrap_or_else(|p| p.into_inner()) = w;
        self.changed.notify_all();
    }

    /// `SIGUSR1` from the host.
    pub fn quiesce(&self) {
        self.set(Want::Quiesce);
    }

    /// `SIGUSR2` from the host.
    pub fn resume(&self) {
        self.set(Want::Serve);
    }

    fn quiesce_wanted(&self) -> bool {
        *self.want.lock().unwrap_or_else(|p| p.into_inner()) == Want::Quiesce
    }

    fn wait_for_resume(&self) {
        let mut w = self.want.lock().unwrap_or_else(|p| p.into_inner());
        while *w == Want::Quiesce {
            w = self.changed.wait(w).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Serves `first` (bound at `path`) with `serve_one` per connection,
/// stepping aside whenever the host asks and binding `path` again after;
/// returns only when that fails.
pub fn serve(
    first: std::os::unix::net::UnixListener,
    path: &Path,
    gate: &Gate,
    live_connections: &dyn Fn() -> usize,
    serve_one: &mut dyn FnMut(std::os::unix::net::UnixStream),
) -> std::io::Result<()> {
    let marker = marker_of(path);
    let mut first = Some(first);
    loop {
        let listener = match first.take() {
            Some(l) => l,
            None => bind_again(path),
        };
        listener.set_nonblocking(true)?;
        while !gate.quiesce_wanted() {
            if !crate::sys::wait_readable(listener.as_fd(), POLL)? {
                continue;
            }
            match listener.accept() {
                Ok((conn, _)) => {
                    if conn.set_nonblocking(false).is_ok() {
                        serve_one(conn);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => eprintln!("envd: accept: {e}"),
            }
        }
        drop(listener);
        let _ = std::fs::remove_file(path);
        let start = Instant::now();
        while live_connections() > 0 && start.elapsed() < DRAIN_LIMIT {
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Err(e) = std::fs::write(&marker, b"") {
            eprintln!("envd: write {}: {e}", marker.display());
        }
        gate.wait_for_resume();
        let _ = std::fs::remove_file(&marker);
    }
}

/// Binds `path` again after a quiesce, retrying until it works: the old
/// socket file is the host's to remove (gVisor refuses to unlink a host
/// socket from inside), which it does before it asks envd to resume.
fn bind_again(path: &Path) -> std::os::unix::net::UnixListener {
    let mut reported = false;
    loop {
        match crate::bind(path) {
            Ok(l) => return l,
            Err(e) => {
                if !reported {
                    eprintln!("envd: bind {} again: {e} (retrying)", path.display());
                    reported = true;
                }
                std::thread::sleep(POLL);
            }
        }
    }
}

fn marker_of(socket: &Path) -> PathBuf {
    socket.with_file_name(QUIESCED_NAME)
}
