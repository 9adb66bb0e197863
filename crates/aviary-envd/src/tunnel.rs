//! Port tunnels: a `connect` request turns its envd connection into a byte
//! tunnel to `127.0.0.1:port` inside the sandbox's network namespace, so the
//! control plane can reach a server in a sandbox that has no network.
//!
//! Invariants:
//! - A tunnel is fenced: its token is checked, and the TCP connection is
//!   made and registered, while the fence gate is held; a fence move (and
//!   `kill_all`) closes every registered tunnel under the gate's write side,
//!   so a lease holder that lost its lease keeps no tunnel into the sandbox.
//! - At most [`MAX_TUNNELS`] tunnels at once (each also holds a general
//!   connection slot); a tunnel with no byte either way for
//!   [`TUNNEL_IDLE_TIMEOUT_S`] is closed.
//! - Frames from the client are envd's ordinary frames (bounded by the
//!   protocol's limits); bytes from the sandbox go out in `Data` frames of at
//!   most [`CHUNK_SIZE`].
//!
//! Concurrency: the connection's thread copies client → port; one extra
//! thread copies port → client. The registry is a mutex held only for map
//! updates.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aviary_envd_proto::{
    encode_json, read_frame, write_frame, ErrorBody, ErrorCode, FrameKind, ProtoError, Response,
    CHUNK_SIZE, TUNNEL_IDLE_TIMEOUT_S,
};

use crate::server::Envd;

/// Most tunnels open at once.
pub const MAX_TUNNELS: usize = 64;
/// How long envd waits for the port to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a blocked read wakes to check the idle deadline.
const IDLE_TICK: Duration = Duration::from_secs(30);

/// The open tunnels, by id: both sockets of each, to shut them down.
#[derive(Default)]
pub struct Tunnels {
    next: AtomicU64,
    open: Mutex<HashMap<u64, (TcpStream, UnixStream)>>,
}

impl Tunnels {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (TcpStream, UnixStream)>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes every tunnel (both sockets); their threads then end.
    pub fn close_all(&self) {
        for (_, (tcp, conn)) in self.map().drain() {
            let _ = tcp.shutdown(Shutdown::Both);
            let _ = conn.shutdown(Shutdown::Both);
        }
    }

    /// Open tunnels.
    pub fn count(&self) -> usize {
        self.map().len()
    }
}

fn fail(code: ErrorCode, message: impl Into<String>) -> ErrorBody {
    ErrorBody {
        code,
        message: message.into(),
    }
}

/// Serves a `connect` request on `conn` until either side closes.
pub fn run(
    envd: &Envd,
    conn: &mut UnixStream,
    port: u16,
    token: Option<u64>,
) -> Result<(), ErrorBody> {
    if port == 0 {
        return Err(fail(ErrorCode::BadRequest, "port must be 1-65535"));
    }
    let (id, tcp) = {
        let _gate = envd.enter_fence(token)?;
        if envd.tunnels.count() >= MAX_TUNNELS {
            return Err(fail(
                ErrorCode::Busy,
                format!("envd keeps at most {MAX_TUNNELS} port tunnels open"),
            ));
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let tcp = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| {
            fail(
                ErrorCode::PortUnreachable,
                match e.kind() {
                    ErrorKind::ConnectionRefused => {
                        format!("nothing listens on port {port} in the sandbox")
                    }
                    _ => format!("port {port} in the sandbox did not accept: {e}"),
                },
            )
        })?;
        let _ = tcp.set_nodelay(true);
        let clones = tcp
            .try_clone()
            .and_then(|t| Ok((t, conn.try_clone()?)))
            .map_err(|e| fail(ErrorCode::Internal, format!("clone tunnel sockets: {e}")))?;
        let id = envd.tunnels.next.fetch_add(1, Ordering::Relaxed);
        let mut open = envd.tunnels.map();
        // checked again with the map held: the bound is strict under races
        if open.len() >= MAX_TUNNELS {
            return Err(fail(
                ErrorCode::Busy,
                format!("envd keeps at most {MAX_TUNNELS} port tunnels open"),
            ));
        }
        open.insert(id, clones);
        drop(open);
        (id, tcp)
    };
    let result = pump(conn, tcp);
    if let Some((tcp, _)) = envd.tunnels.map().remove(&id) {
        let _ = tcp.shutdown(Shutdown::Both);
    }
    result
}

fn pump(conn: &mut UnixStream, tcp: TcpStream) -> Result<(), ErrorBody> {
    let ok = encode_json(&Response::Ok).map_err(|e| fail(ErrorCode::Internal, e.to_string()))?;
    if write_frame(conn, FrameKind::Response, &ok).is_err() {
        return Ok(()); // client gone
    }
    let started = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let idle = Duration::from_secs(TUNNEL_IDLE_TIMEOUT_S);
    let idle_for = {
        let last = Arc::clone(&last);
        move || {
            let now = started.elapsed().as_millis() as u64;
            Duration::from_millis(now.saturating_sub(last.load(Ordering::Relaxed)))
        }
    };
    let touch = {
        let last = Arc::clone(&last);
        move || {
            let now = started.elapsed().as_millis() as u64;
            last.store(now, Ordering::Relaxed);
        }
    };
    let _ = tcp.set_read_timeout(Some(IDLE_TICK));
    let _ = conn.set_read_timeout(Some(IDLE_TICK));

    // port → client
    let (mut tcp_r, mut conn_w) = match (tcp.try_clone(), conn.try_clone()) {
        (Ok(t), Ok(c)) => (t, c),
        _ => return Err(fail(ErrorCode::Internal, "clone tunnel sockets")),
    };
    let (idle_for_down, touch_down) = (idle_for.clone(), touch.clone());
    let down = std::thread::Builder::new()
        .name("envd-tunnel".into())
        .spawn(move || {
            let mut buf = vec![0u8; CHUNK_SIZE];
            loop {
                match tcp_r.read(&mut buf) {
                    Ok(0) => {
                        let _ = write_frame(&mut conn_w, FrameKind::End, &[]);
                        return;
                    }
                    Ok(n) => {
                        touch_down();
                        if write_frame(&mut conn_w, FrameKind::Data, &buf[..n]).is_err() {
                            let _ = tcp_r.shutdown(Shutdown::Both);
                            return;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if is_timeout(&e) && idle_for_down() < idle => {}
                    Err(_) => {
                        // idle too long, or the port's connection broke
                        let _ = tcp_r.shutdown(Shutdown::Both);
                        let _ = conn_w.shutdown(Shutdown::Both);
                        return;
                    }
                }
            }
        });
    let down = match down {
        Ok(h) => h,
        Err(e) => return Err(fail(ErrorCode::Busy, format!("start tunnel thread: {e}"))),
    };

    // client → port, on this thread
    let mut tcp_w = tcp;
    loop {
        match read_frame(conn) {
            Ok(Some(f)) if f.kind == FrameKind::Data => {
                touch();
                if tcp_w.write_all(&f.payload).is_err() {
                    break;
                }
            }
            Ok(Some(f)) if f.kind == FrameKind::End => {
                // half-close: the server sees EOF; its answer still flows back
                let _ = tcp_w.shutdown(Shutdown::Write);
                let _ = down.join();
                return Ok(());
            }
            Err(ProtoError::ReadFrame(e)) if is_timeout(&e) && idle_for() < idle => {}
            // EOF, a broken or idle connection, or a frame that has no place here
            _ => break,
        }
    }
    let _ = tcp_w.shutdown(Shutdown::Both);
    let _ = conn.shutdown(Shutdown::Both);
    let _ = down.join();
    Ok(())
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}
