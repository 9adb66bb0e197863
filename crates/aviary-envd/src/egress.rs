//! The in-sandbox end of the `allowlist` network profile: when the runtime
//! mounted this sandbox's proxy socket (`/.aviary/egress/proxy.sock`), envd
//! listens on `127.0.0.1:3128` (the sandbox's own `lo`; the sandbox's
//! `HTTP_PROXY` points there) and splices each accepted connection to that
//! socket. envd judges nothing: the host-side proxy enforces the profile,
//! and knows the sandbox by the socket alone.
//!
//! Threads: one acceptor, two per open connection (one per direction), at
//! most [`MAX_FORWARDS`] connections at once (more are closed at accept),
//! all counted against the sandbox's own pids limit.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Where the runtime mounts the socket (`aviary_core::egress`, which envd
/// does not depend on: keep the two equal).
pub const SOCKET: &str = "/.aviary/egress/proxy.sock";
/// `aviary_core::egress::EGRESS_PROXY_PORT`.
pub const PORT: u16 = 3128;
/// Connections forwarded at once.
pub const MAX_FORWARDS: usize = 256;

/// Starts the forwarder when the socket is present; silent otherwise
/// (profile `none`: no socket, nothing listens).
pub fn start() {
    if !Path::new(SOCKET).exists() {
        return;
    }
    let listener = match TcpListener::bind(("127.0.0.1", PORT)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("envd: egress: bind 127.0.0.1:{PORT}: {e}");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("envd-egress".into())
        .stack_size(64 * 1024)
        .spawn(move || accept_loop(&listener));
    if let Err(e) = spawned {
        eprintln!("envd: egress: start thread: {e}");
    }
}

fn accept_loop(listener: &TcpListener) {
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(tcp) = conn else { continue };
        if open.fetch_add(1, Ordering::SeqCst) >= MAX_FORWARDS {
            open.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed
        }
        let open2 = Arc::clone(&open);
        let spawned = std::thread::Builder::new()
            .name("envd-egress-conn".into())
            .stack_size(64 * 1024)
            .spawn(move || {
                forward(tcp);
                open2.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn forward(tcp: TcpStream) {
    let Ok(unix) = UnixStream::connect(SOCKET) else {
        return;
    };
    let (Ok(tcp_r), Ok(unix_w)) = (tcp.try_clone(), unix.try_clone()) else {
        return;
    };
    // sandbox → proxy on a second thread; proxy → sandbox here
    let up = std::thread::Builder::new()
        .name("envd-egress-up".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            pipe(tcp_r, &unix_w);
            let _ = unix_w.shutdown(Shutdown::Write);
        });
    if up.is_err() {
        return;
    }
    pipe(unix, &tcp);
    let _ = tcp.shutdown(Shutdown::Both);
    if let Ok(h) = up {
        let _ = h.join();
    }
}

fn pipe(mut from: impl Read, mut to: impl Write) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}
