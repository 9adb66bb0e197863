//! envd: the daemon that runs as PID 1 inside every Aviary sandbox.
//!
//! It serves the `aviary-envd-proto` protocol on a unix socket (the host's
//! control plane connects through a bind-mounted directory): exec with streamed
//! output and process-group kill, confined file operations, health, and the
//! lease fence that every mutating call is checked against.
//!
//! As PID 1 it reaps every zombie in the sandbox and, on SIGTERM from outside
//! the sandbox, kills everything and exits. It also runs as an ordinary process
//! (tests): it then makes itself a child subreaper so it still reaps the orphans
//! of the processes it started.
//!
//! Threads: the main thread accepts; one thread per connection (bounded); one
//! signal thread waits for SIGCHLD/SIGTERM/SIGINT (blocked everywhere else) and
//! runs the reaper. Only std, libc, serde_json and the protocol crate: the binary
//! is built static by `scripts/build-envd.sh`.
#![deny(unsafe_code)]

mod exec;
mod files;
mod reaper;
mod server;
mod sys;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aviary_envd_proto::{ErrorBody, ErrorCode};

use crate::files::SandboxFs;
use crate::server::Envd;

const USAGE: &str =
    "usage: aviary-envd --socket PATH [--root DIR] [--trust-all-peers] [--no-openat2]

  --socket PATH       unix socket to serve (a stale socket file is replaced)
  --root DIR          root of the file API and default exec cwd (default /);
                      file paths are confined to DIR
  --trust-all-peers   accept set_fence from any peer. Without it only peers in an
                      ancestor PID namespace (SO_PEERCRED pid 0, i.e. the host
                      control plane) may move the fence. For tests only: with it,
                      code inside the sandbox could move the fence.
  --no-openat2        resolve paths in userspace instead of openat2 (tests)
  --version";

struct Args {
    socket: PathBuf,
    root: PathBuf,
    trust_all_peers: bool,
    openat2: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut root = PathBuf::from("/");
    let mut trust_all_peers = false;
    let mut openat2 = true;
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--socket") => {
                socket = Some(PathBuf::from(it.next().ok_or("--socket needs a value")?))
            }
            Some("--root") => root = PathBuf::from(it.next().ok_or("--root needs a value")?),
            Some("--trust-all-peers") => trust_all_peers = true,
            Some("--no-openat2") => openat2 = false,
            Some("--version") => {
                println!("aviary-envd {}", env!("CARGO_PKG_VERSION"));
                std::process::exit(0);
            }
            Some("--help" | "-h") => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a:?}\n{USAGE}")),
        }
    }
    Ok(Args {
        socket: socket.ok_or_else(|| format!("--socket is required\n{USAGE}"))?,
        root,
        trust_all_peers,
        openat2,
    })
}

fn bind(socket: &Path) -> std::io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(socket) {
        if meta.file_type().is_socket() {
            std::fs::remove_file(socket)?;
        }
    }
    UnixListener::bind(socket)
}

fn main() {
    // Before any thread exists, so that every thread inherits the mask and only
    // the signal thread receives these (children get a clean mask from std).
    if let Err(e) = sys::block_signals(&[libc::SIGCHLD, libc::SIGTERM, libc::SIGINT]) {
        eprintln!("envd: block signals: {e}");
        std::process::exit(1);
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("envd: {e}");
            std::process::exit(2);
        }
    };
    let pid1 = sys::getpid() == 1;
    if !pid1 {
        if let Err(e) = sys::set_child_subreaper() {
            eprintln!("envd: set child subreaper (orphans will not be reaped): {e}");
        }
    }
    let fs = match SandboxFs::open(&args.root, args.openat2) {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("envd: open root {}: {e}", args.root.display());
            std::process::exit(1);
        }
    };
    let listener = match bind(&args.socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("envd: bind {}: {e}", args.socket.display());
            std::process::exit(1);
        }
    };
    let envd = Arc::new(Envd::new(args.root, fs, pid1, args.trust_all_peers));

    let sig_envd = Arc::clone(&envd);
    let socket_path = args.socket.clone();
    let spawned = std::thread::Builder::new()
        .name("envd-signals".into())
        .stack_size(64 * 1024)
        .spawn(move || signal_loop(&sig_envd, &socket_path));
    if let Err(e) = spawned {
        eprintln!("envd: start signal thread: {e}");
        std::process::exit(1);
    }

    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let Some(slot) = envd.try_acquire_connection() else {
            let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
            server::send_error(
                &mut conn,
                &ErrorBody {
                    code: ErrorCode::Busy,
                    message: format!(
                        "envd serves at most {} connections",
                        server::MAX_CONNECTIONS
                    ),
                },
            );
            continue;
        };
        let spawned = std::thread::Builder::new()
            .name("envd-conn".into())
            .stack_size(256 * 1024)
            .spawn(move || server::handle_connection(slot.envd(), conn));
        if let Err(e) = spawned {
            eprintln!("envd: spawn connection thread: {e}");
        }
    }
}

/// Reaps children on SIGCHLD and shuts down on SIGTERM/SIGINT.
fn signal_loop(envd: &Envd, socket: &Path) {
    loop {
        envd.reaper.reap_available();
        // The timeout is a safety net for processes that join the sandbox from
        // outside (runtime exec) and are re-parented to us later.
        let Some((sig, sender)) = sys::wait_signal(
            &[libc::SIGCHLD, libc::SIGTERM, libc::SIGINT],
            Duration::from_secs(1),
        ) else {
            continue;
        };
        if sig == libc::SIGCHLD {
            continue;
        }
        if envd.pid1 && sender != 0 {
            // Code inside the sandbox must not be able to stop its init.
            eprintln!("envd: ignoring signal {sig} from pid {sender} inside the sandbox");
            continue;
        }
        shutdown(envd, socket);
    }
}

fn shutdown(envd: &Envd, socket: &Path) -> ! {
    if envd.pid1 {
        sys::kill_all(libc::SIGKILL);
    } else {
        envd.kill_running_groups();
    }
    let _ = std::fs::remove_file(socket);
    // Give the kernel a moment to deliver the kills, then reap what died.
    std::thread::sleep(Duration::from_millis(20));
    envd.reaper.reap_available();
    std::process::exit(0);
}
