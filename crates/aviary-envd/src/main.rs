//! envd: the daemon that runs as PID 1 inside every Aviary sandbox.
//!
//! It serves the `aviary-envd-proto` protocol on a unix socket: exec with
//! streamed output and process-group kill, exec on a pseudo-terminal
//! (`pty`), confined file operations, health, and the lease fence that every
//! mutating call is checked against.
//!
//! **The socket.** In a sandbox the socket is *activated*: the host creates an
//! `AF_UNIX` `SOCK_STREAM` socket, binds it in a host-only directory that the
//! sandbox cannot see, does not listen on it, and passes it down as an
//! inherited descriptor (`--listen-fd 3`, e.g. `crun run --preserve-fds 1`).
//! envd checks that the descriptor is such a socket (and exits 1 otherwise),
//! marks it close-on-exec so no process it starts inherits it, and calls
//! `listen` itself, so that `SO_PEERCRED` of every connection names envd's own
//! pid: the host checks that the peer is the sandbox's init process. Code in
//! the sandbox can therefore neither replace the path the host connects to nor
//! reach envd's socket at all. `--socket PATH` (bind a path and listen) remains
//! for tests and development.
//!
//! **Under gVisor** (`runsc`, which cannot pass a descriptor in) envd binds
//! `--socket PATH` itself in a directory the runtime bind-mounts from the
//! host, and `runsc --host-uds=create` makes that a host socket: the host
//! connects to it, processes in the sandbox cannot (`connect` answers
//! `EPERM` without `--host-uds=open`). gVisor shows every such host peer to
//! envd as envd itself (`SO_PEERCRED` pid = envd's own pid), so with
//! `--gvisor-host-socket` envd takes a peer with its own pid for the host.
//! It then also steps aside for a memory checkpoint when the host signals
//! (see `hostsock`).
//!
//! **PID 1.** As PID 1 it reaps every zombie in the sandbox and, on SIGTERM from
//! outside the sandbox, kills everything and exits. It makes itself
//! non-dumpable at start, so root inside the sandbox (without `CAP_SYS_PTRACE`
//! over envd's user namespace) can neither ptrace it, take its descriptors with
//! `pidfd_getfd`, nor open `/proc/1/fd`. It also runs as an ordinary process
//! (tests): it then makes itself a child subreaper so it still reaps the orphans
//! of the processes it started.
//!
//! **Leases.** A new lease starts with no processes left from the previous
//! holder: whenever the fence moves to a different value (new holder, expiry,
//! release, first lease), envd kills every other process in the sandbox and
//! waits until they are reaped before it records the new fence and answers
//! (see `sweep`); a renewal (same value) kills nothing.
//!
//! Threads: the main thread accepts; one thread per connection (bounded); one
//! signal thread waits for SIGCHLD/SIGTERM/SIGINT (blocked everywhere else) and
//! runs the reaper. Only std, libc, serde_json and the protocol crate: the binary
//! is built static by `scripts/build-envd.sh`.
#![deny(unsafe_code)]

mod bridge;
mod egress;
mod exec;
mod files;
mod hostsock;
mod procs;
mod pty;
mod reaper;
mod server;
mod sweep;
mod sys;
mod tunnel;
mod user;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aviary_envd_proto::{ErrorBody, ErrorCode};

use crate::files::SandboxFs;
use crate::server::{ConnectionSlot, Envd, Lane};

const USAGE: &str = "usage: aviary-envd (--listen-fd N | --socket PATH [--gvisor-host-socket]) [--root DIR] [--trust-all-peers] [--no-openat2]
                   [--bridge ADDR --bridge-secret-file FILE] [--daemon]
       aviary-envd --stage-secret SRC DST

  --listen-fd N       serve the inherited socket N (socket activation): an AF_UNIX
                      SOCK_STREAM socket, bound by the host and not yet listening.
                      envd refuses any other descriptor, makes it close-on-exec
                      and calls listen() itself, so SO_PEERCRED names envd
  --socket PATH       bind and serve a unix socket at PATH (a stale socket file is
                      replaced). For tests: code in the sandbox can reach PATH
  --gvisor-host-socket
                      PATH is in a host dir mounted under gVisor with
                      --host-uds=create: only the host can connect, and gVisor
                      shows that peer as envd's own pid, which envd then takes
                      for the host (control operations)
  --root DIR          root of the file API and default exec cwd (default /);
                      file paths are confined to DIR
  --trust-all-peers   accept set_fence from any peer. Without it only peers in an
                      ancestor PID namespace (SO_PEERCRED pid 0, i.e. the host
                      control plane) may move the fence. For tests only: with it,
                      code inside the sandbox could move the fence.
  --no-openat2        resolve paths in userspace instead of openat2 (tests)
  --bridge ADDR       also accept HTTP/1.1 upgrades (`Upgrade: aviary-envd`) on the
                      TCP address ADDR and splice them to the unix socket, for a
                      host that reaches the sandbox only through a port proxy (a
                      remote provider's). Needs --socket and --bridge-secret-file
  --bridge-secret-file FILE
                      the secret every upgrade must carry (x-aviary-envd-secret);
                      read, then removed
  --stage-secret SRC DST
                      copy the bridge secret of SRC (a read-only file, e.g. a
                      Kubernetes Secret volume in an init container) to a new
                      file DST (0600) for --bridge-secret-file, and exit
  --daemon            detach once listening (fork, new session, stdio /dev/null)
  --version";

/// Where envd listens.
enum Listen {
    /// An inherited socket (socket activation).
    Fd(i32),
    /// A path envd binds itself.
    Path(PathBuf),
}

struct Args {
    listen: Listen,
    root: PathBuf,
    trust_all_peers: bool,
    gvisor_host_socket: bool,
    openat2: bool,
    /// `--bridge`: its address, the secret file, envd's socket path.
    bridge: Option<(String, PathBuf, PathBuf)>,
    daemon: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut listen_fd = None;
    let mut root = PathBuf::from("/");
    let mut trust_all_peers = false;
    let mut gvisor_host_socket = false;
    let mut openat2 = true;
    let (mut bridge, mut bridge_secret, mut daemon) = (None, None, false);
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--socket") => {
                socket = Some(PathBuf::from(it.next().ok_or("--socket needs a value")?))
            }
            Some("--listen-fd") => {
                let v = it.next().ok_or("--listen-fd needs a value")?;
                let fd = v
                    .to_str()
                    .and_then(|v| v.parse::<i32>().ok())
                    .ok_or_else(|| format!("--listen-fd {v:?} is not a descriptor number"))?;
                listen_fd = Some(fd);
            }
            Some("--root") => root = PathBuf::from(it.next().ok_or("--root needs a value")?),
            Some("--trust-all-peers") => trust_all_peers = true,
            Some("--gvisor-host-socket") => gvisor_host_socket = true,
            Some("--no-openat2") => openat2 = false,
            Some("--bridge") => {
                let v = it.next().ok_or("--bridge needs a value")?;
                bridge = Some(
                    v.into_string()
                        .map_err(|v| format!("--bridge {v:?} is not an address"))?,
                )
            }
            Some("--bridge-secret-file") => {
                bridge_secret = Some(PathBuf::from(
                    it.next().ok_or("--bridge-secret-file needs a value")?,
                ))
            }
            Some("--daemon") => daemon = true,
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
    let listen = match (listen_fd, socket) {
        (Some(fd), None) => Listen::Fd(fd),
        (None, Some(path)) => Listen::Path(path),
        (Some(_), Some(_)) => {
            return Err(format!(
                "--listen-fd and --socket exclude each other\n{USAGE}"
            ))
        }
        (None, None) => return Err(format!("--listen-fd or --socket is required\n{USAGE}")),
    };
    if gvisor_host_socket && !matches!(listen, Listen::Path(_)) {
        return Err(format!("--gvisor-host-socket needs --socket\n{USAGE}"));
    }
    let bridge = match (bridge, bridge_secret, &listen) {
        (None, None, _) => None,
        (Some(addr), Some(secret), Listen::Path(p)) => Some((addr, secret, p.clone())),
        (Some(_), Some(_), Listen::Fd(_)) => {
            return Err(format!("--bridge needs --socket\n{USAGE}"))
        }
        _ => {
            return Err(format!(
                "--bridge and --bridge-secret-file go together\n{USAGE}"
            ))
        }
    };
    Ok(Args {
        listen,
        root,
        trust_all_peers,
        gvisor_host_socket,
        openat2,
        bridge,
        daemon,
    })
}

pub(crate) fn bind(socket: &Path) -> std::io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(socket) {
        if meta.file_type().is_socket() {
            std::fs::remove_file(socket)?;
        }
    }
    UnixListener::bind(socket)
}

fn main() {
    // `--stage-secret SRC DST` (a Pod's init container): nothing else runs
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == "--stage-secret") {
        let [_, src, dst] = &args[..] else {
            eprintln!("envd: --stage-secret needs SRC and DST and nothing else\n{USAGE}");
            std::process::exit(2);
        };
        if let Err(e) = bridge::stage_secret(Path::new(src), Path::new(dst)) {
            eprintln!("envd: --stage-secret {src:?} {dst:?}: {e}");
            std::process::exit(1);
        }
        std::process::exit(0);
    }
    // Before any thread exists, so that every thread inherits the mask and only
    // the signal thread receives these (children get a clean mask from std).
    if let Err(e) = sys::block_signals(HANDLED_SIGNALS) {
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
    // The bridge and the daemon fork come before anything else: the fork
    // needs a single-threaded process, and whoever started envd may connect
    // as soon as it returns, so every socket is bound by then.
    let early_socket = match &args.listen {
        Listen::Path(path) if args.bridge.is_some() => match bind(path) {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("envd: bind {}: {e}", path.display());
                std::process::exit(1);
            }
        },
        _ => None,
    };
    let bridge = args.bridge.as_ref().map(|(addr, secret_file, socket)| {
        let secret = bridge::read_secret(secret_file).unwrap_or_else(|e| {
            eprintln!("envd: --bridge-secret-file {}: {e}", secret_file.display());
            std::process::exit(1);
        });
        let listener = std::net::TcpListener::bind(addr).unwrap_or_else(|e| {
            eprintln!("envd: --bridge {addr}: {e}");
            std::process::exit(1);
        });
        bridge::Bridge {
            listener,
            secret,
            socket: socket.clone(),
        }
    });
    if args.daemon {
        if let Err(e) = sys::daemonize() {
            eprintln!("envd: --daemon: {e}");
            std::process::exit(1);
        }
    }
    let pid1 = sys::getpid() == 1;
    if pid1 {
        if let Err(e) = sys::set_not_dumpable() {
            eprintln!("envd: make envd non-dumpable: {e}");
            std::process::exit(1);
        }
    } else {
        if let Err(e) = sys::set_child_subreaper() {
            eprintln!("envd: set child subreaper (orphans will not be reaped): {e}");
        }
        // the bridge secret is in memory: keep it from ptrace and /proc/PID/mem
        if bridge.is_some() {
            if let Err(e) = sys::set_not_dumpable() {
                eprintln!("envd: make envd non-dumpable: {e}");
                std::process::exit(1);
            }
        }
    }
    // The inherited socket is adopted before envd opens any descriptor of its
    // own, so that a missing fd N can never be mistaken for one of them.
    let (listener, socket_path) = match &args.listen {
        Listen::Path(path) if early_socket.is_some() => {
            (early_socket.expect("checked"), Some(path.clone()))
        }
        Listen::Fd(fd) => match sys::adopt_listen_fd(*fd) {
            Ok(l) => (l, None),
            Err(e) => {
                eprintln!("envd: --listen-fd {fd}: {e}");
                std::process::exit(1);
            }
        },
        Listen::Path(path) => match bind(path) {
            Ok(l) => (l, Some(path.clone())),
            Err(e) => {
                eprintln!("envd: bind {}: {e}", path.display());
                std::process::exit(1);
            }
        },
    };
    let fs = match SandboxFs::open(&args.root, args.openat2) {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("envd: open root {}: {e}", args.root.display());
            std::process::exit(1);
        }
    };
    let mut envd = Envd::new(args.root, fs, pid1, args.trust_all_peers)
        .with_gvisor_host_socket(args.gvisor_host_socket);
    if let Some(bridge) = bridge {
        envd.bridge_peer = Some(sys::getpid());
        if let Err(e) = bridge::start(bridge) {
            eprintln!("envd: start the bridge: {e}");
            std::process::exit(1);
        }
    }
    let envd = Arc::new(envd);
    // the `allowlist` profile's in-sandbox end (only when its socket is mounted)
    egress::start();

    let gate = Arc::new(hostsock::Gate::default());
    let sig_envd = Arc::clone(&envd);
    let sig_gate = args.gvisor_host_socket.then(|| Arc::clone(&gate));
    let sig_socket = socket_path.clone();
    let spawned = std::thread::Builder::new()
        .name("envd-signals".into())
        .stack_size(64 * 1024)
        .spawn(move || signal_loop(&sig_envd, sig_socket.as_deref(), sig_gate.as_deref()));
    if let Err(e) = spawned {
        eprintln!("envd: start signal thread: {e}");
        std::process::exit(1);
    }

    // One thread started now, while the sandbox is fresh, serves control
    // calls (health, set_fence) whenever a connection cannot get a slot or a
    // thread of its own: a sandbox at its pids limit (a fork bomb) or with
    // every lane held still takes a fence move.
    let (control_tx, control_rx) =
        std::sync::mpsc::sync_channel::<(Option<ConnectionSlot>, UnixStream)>(server::CONTROL_LANE);
    let control_envd = Arc::clone(&envd);
    let spawned = std::thread::Builder::new()
        .name("envd-control".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            for (_slot, conn) in control_rx {
                server::handle_connection(&control_envd, Lane::Control, conn);
            }
        });
    if let Err(e) = spawned {
        eprintln!("envd: start control thread: {e}");
        std::process::exit(1);
    }

    if let (true, Some(path)) = (args.gvisor_host_socket, &socket_path) {
        // `hostsock::serve` steps aside on the host's request
        let live_envd = Arc::clone(&envd);
        let served = hostsock::serve(
            listener,
            path,
            &gate,
            &|| live_envd.live_connections(),
            &mut |conn| serve_connection(&envd, &control_tx, conn),
        );
        if let Err(e) = served {
            eprintln!("envd: serve {}: {e}", path.display());
            std::process::exit(1);
        }
        return;
    }
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        serve_connection(&envd, &control_tx, conn);
    }
}

/// Signals the signal thread waits for (blocked in every thread): SIGUSR1
/// and SIGUSR2 are the host's quiesce / resume under gVisor, SIGHUP its
/// resume as a live fork (`hostsock`).
const HANDLED_SIGNALS: &[libc::c_int] = &[
    libc::SIGCHLD,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGHUP,
];

/// Gives `conn` a thread of its own, or the control thread when none can
/// be had.
fn serve_connection(
    envd: &Arc<Envd>,
    control_tx: &std::sync::mpsc::SyncSender<(Option<ConnectionSlot>, UnixStream)>,
    conn: UnixStream,
) {
    let Some(slot) = envd.try_acquire_connection() else {
        overflow(control_tx, None, conn);
        return;
    };
    {
        // The connection comes back if no thread can be started for it.
        let cell = Arc::new(Mutex::new(Some((slot, conn))));
        let mine = Arc::clone(&cell);
        let spawned = std::thread::Builder::new()
            .name("envd-conn".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                let taken = mine.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some((slot, conn)) = taken {
                    server::handle_connection(slot.envd(), slot.lane(), conn);
                }
            });
        if spawned.is_err() {
            let taken = cell.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some((slot, conn)) = taken {
                overflow(control_tx, Some(slot), conn);
            }
        }
    }
}

/// Hands a connection to the control thread (which serves only health and
/// set_fence), or answers `Busy` when that thread is backed up too.
fn overflow(
    control: &std::sync::mpsc::SyncSender<(Option<ConnectionSlot>, UnixStream)>,
    slot: Option<ConnectionSlot>,
    conn: UnixStream,
) {
    let (_slot, mut conn) = match control.try_send((slot, conn)) {
        Ok(()) => return,
        Err(std::sync::mpsc::TrySendError::Full(back))
        | Err(std::sync::mpsc::TrySendError::Disconnected(back)) => back,
    };
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
}

/// Reaps children on SIGCHLD and shuts down on SIGTERM/SIGINT; with a
/// gVisor host socket, SIGUSR1/SIGUSR2 from the host quiesce and resume it.
fn signal_loop(envd: &Envd, socket: Option<&Path>, gate: Option<&hostsock::Gate>) {
    loop {
        envd.reaper.reap_available();
        // The timeout is a safety net for processes that join the sandbox from
        // outside (runtime exec) and are re-parented to us later.
        let Some((sig, sender)) = sys::wait_signal(HANDLED_SIGNALS, Duration::from_secs(1)) else {
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
        match (sig, gate) {
            (libc::SIGUSR1, Some(gate)) => gate.quiesce(),
            (libc::SIGUSR2, Some(gate)) => gate.resume(),
            (libc::SIGHUP, Some(gate)) => {
                // a live fork: a new sandbox restored from its parent's
                // memory forgets the parent's lease before it serves
                envd.forget_lease();
                gate.resume();
            }
            (libc::SIGUSR1 | libc::SIGUSR2 | libc::SIGHUP, None) => {}
            _ => shutdown(envd, socket),
        }
    }
}

fn shutdown(envd: &Envd, socket: Option<&Path>) -> ! {
    if envd.pid1 {
        sys::kill_all(libc::SIGKILL);
    } else {
        envd.kill_running_groups();
    }
    if let Some(socket) = socket {
        let _ = std::fs::remove_file(socket);
    }
    // Give the kernel a moment to deliver the kills, then reap what died.
    std::thread::sleep(Duration::from_millis(20));
    envd.reaper.reap_available();
    std::process::exit(0);
}
