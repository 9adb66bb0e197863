//! The bridge (`--bridge ADDR`): how the host reaches envd in a sandbox it
//! did not start itself (a remote provider's: `aviary-runtime-remote`; a
//! Kubernetes Pod's: `aviary-runtime-kube`).
//!
//! There is no host-only socket there: the host reaches the sandbox only
//! through the provider's port proxy, as HTTP, or over the Pod network. So
//! envd also listens on a TCP address inside the sandbox (loopback behind a
//! port proxy; `0.0.0.0` in a Pod) and accepts one HTTP/1.1 request
//! per connection: `Upgrade: aviary-envd` with the bridge secret in
//! `x-aviary-envd-secret`. It answers `101 Switching Protocols` and from
//! then on splices the connection byte for byte to envd's own unix socket,
//! so the frames are exactly those of a local connection. Anything else is
//! answered with a 4xx and closed; nothing of envd is reached.
//!
//! The secret comes from a file that envd reads and removes at start (the
//! sandbox is fresh then, nothing else runs in it); afterwards it lives only
//! in envd's memory. A Kubernetes Secret volume is read-only, so in a Pod an
//! init container copies it to the control volume first (`--stage-secret`,
//! [`stage_secret`]) and the sandbox's container never mounts the Secret. The bridge's connections to the unix socket have envd's
//! own pid as their peer, and only those may move the fence (`set_fence`,
//! `kill_all`): code in the sandbox that connects to the socket directly may
//! not. A remote sandbox's own root can still end envd (it is not PID 1 of
//! a namespace the host controls); the control plane's lease store and
//! registry checks stand in front of every call either way.
//!
//! Bounds: a request head of at most [`MAX_HEAD`] bytes within
//! [`HEAD_TIMEOUT`], at most [`MAX_BRIDGED`] connections at a time (two
//! threads each).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest request head the bridge reads.
pub const MAX_HEAD: usize = 8 * 1024;
/// Longest the client may take to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections bridged at once.
pub const MAX_BRIDGED: usize = 64;
/// The header that carries the secret.
pub const SECRET_HEADER: &str = "x-aviary-envd-secret";
/// The `Upgrade` protocol name.
pub const PROTOCOL: &str = "aviary-envd";

/// The bridge's configuration.
pub struct Bridge {
    pub listener: TcpListener,
    pub secret: Vec<u8>,
    /// envd's own unix socket.
    pub socket: PathBuf,
}

/// Reads the secret from `path` and removes the file. The secret is the
/// file's first line, at least 16 bytes.
pub fn read_secret(path: &std::path::Path) -> io::Result<Vec<u8>> {
    let text = std::fs::read(path)?;
    std::fs::remove_file(path)?;
    parse_secret(&text)
}

/// `--stage-secret SRC DST`: copies the secret of `src` (a file envd cannot
/// remove, e.g. a Kubernetes Secret volume, read-only) to a new file `dst`
/// (0600, never an existing file), which envd's `--bridge-secret-file`
/// then reads and removes. For a Pod's init container: the sandbox's own
/// container never mounts `src`, so once envd has started the secret is in
/// its memory only.
pub fn stage_secret(src: &std::path::Path, dst: &std::path::Path) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let line = parse_secret(&std::fs::read(src)?)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    f.write_all(&line)?;
    f.write_all(b"\n")
}

fn parse_secret(text: &[u8]) -> io::Result<Vec<u8>> {
    let line: Vec<u8> = text
        .split(|b| *b == b'\n')
        .next()
        .unwrap_or_default()
        .to_vec();
    if line.len() < 16 || !line.iter().all(|b| b.is_ascii_graphic()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the bridge secret must be at least 16 printable ASCII bytes",
        ));
    }
    Ok(line)
}

/// Serves the bridge on its own thread.
pub fn start(bridge: Bridge) -> io::Result<()> {
    std::thread::Builder::new()
        .name("envd-bridge".into())
        .stack_size(128 * 1024)
        .spawn(move || serve(bridge))
        .map(|_| ())
}

fn serve(bridge: Bridge) {
    let bridge = Arc::new(bridge);
    let active = Arc::new(AtomicUsize::new(0));
    for conn in bridge.listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_BRIDGED {
            active.fetch_sub(1, Ordering::SeqCst);
            refuse(&mut conn, "503 Service Unavailable");
            continue;
        }
        let (b, a) = (Arc::clone(&bridge), Arc::clone(&active));
        let spawned = std::thread::Builder::new()
            .name("envd-bridged".into())
            .stack_size(128 * 1024)
            .spawn(move || {
                handle(&b, conn);
                a.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn refuse(conn: &mut TcpStream, status: &str) {
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
}

/// Why a request head was refused: the status line to answer.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    BadRequest,
    Unauthorized,
}

/// Checks a request head (up to the blank line): an HTTP/1.1 `GET` that
/// asks to upgrade to [`PROTOCOL`] and carries `secret`.
pub fn check_head(head: &[u8], secret: &[u8]) -> Result<(), Refusal> {
    let text = std::str::from_utf8(head).map_err(|_| Refusal::BadRequest)?;
    let mut lines = text.split("\r\n");
    let request = lines.next().ok_or(Refusal::BadRequest)?;
    let mut parts = request.split(' ');
    if parts.next() != Some("GET") || parts.nth(1) != Some("HTTP/1.1") {
        return Err(Refusal::BadRequest);
    }
    let (mut upgrade, mut given) = (false, None);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("upgrade") {
            upgrade = value.eq_ignore_ascii_case(PROTOCOL);
        } else if name.eq_ignore_ascii_case(SECRET_HEADER) {
            if given.is_some() {
                return Err(Refusal::BadRequest);
            }
            given = Some(value.as_bytes());
        }
    }
    if !upgrade {
        return Err(Refusal::BadRequest);
    }
    match given {
        Some(g) if constant_time_eq(g, secret) => Ok(()),
        _ => Err(Refusal::Unauthorized),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads the head; returns it and whatever followed it.
fn read_head(conn: &mut TcpStream) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            buf.truncate(i);
            return Ok((buf, rest));
        }
        if buf.len() >= MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "head too long"));
        }
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn handle(bridge: &Bridge, mut conn: TcpStream) {
    let _ = conn.set_read_timeout(Some(HEAD_TIMEOUT));
    let _ = conn.set_nodelay(true);
    let Ok((head, rest)) = read_head(&mut conn) else {
        refuse(&mut conn, "400 Bad Request");
        return;
    };
    match check_head(&head, &bridge.secret) {
        Ok(()) => {}
        Err(Refusal::BadRequest) => return refuse(&mut conn, "400 Bad Request"),
        Err(Refusal::Unauthorized) => return refuse(&mut conn, "401 Unauthorized"),
    }
    let Ok(mut envd) = UnixStream::connect(&bridge.socket) else {
        return refuse(&mut conn, "503 Service Unavailable");
    };
    let _ = conn.set_read_timeout(None);
    let switched = conn
        .write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: aviary-envd\r\n\r\n",
        )
        .and_then(|()| envd.write_all(&rest));
    if switched.is_err() {
        return;
    }
    let (Ok(mut up_from), Ok(mut up_to)) = (conn.try_clone(), envd.try_clone()) else {
        return;
    };
    // client → envd on a thread of its own, envd → client here; each side's
    // end is passed on as a half-close so envd sees the client go
    let upstream = std::thread::Builder::new()
        .name("envd-bridged-up".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            let _ = io::copy(&mut up_from, &mut up_to);
            let _ = up_to.shutdown(Shutdown::Write);
        });
    let _ = io::copy(&mut envd, &mut conn);
    let _ = conn.shutdown(Shutdown::Write);
    if let Ok(t) = upstream {
        // envd closed its side: the client's side has nothing to go to
        let _ = conn.shutdown(Shutdown::Read);
        let _ = envd.shutdown(Shutdown::Both);
        let _ = t.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123";

    fn head(lines: &[&str]) -> Vec<u8> {
        lines.join("\r\n").into_bytes()
    }

    #[test]
    fn a_well_formed_upgrade_with_the_secret_passes() {
        let h = head(&[
            "GET /anything HTTP/1.1",
            "Host: 49999-sbx.example",
            "Connection: Upgrade",
            "Upgrade: aviary-envd",
            "X-Aviary-Envd-Secret: 0123456789abcdef0123",
        ]);
        check_head(&h, SECRET).unwrap();
    }

    #[test]
    fn wrong_missing_or_repeated_secrets_and_other_requests_are_refused() {
        let base = [
            "GET / HTTP/1.1",
            "Connection: Upgrade",
            "Upgrade: aviary-envd",
        ];
        let with = |extra: &[&str]| {
            let mut l = base.to_vec();
            l.extend_from_slice(extra);
            head(&l)
        };
        assert_eq!(check_head(&with(&[]), SECRET), Err(Refusal::Unauthorized));
        assert_eq!(
            check_head(
                &with(&["x-aviary-envd-secret: 0123456789abcdef0124"]),
                SECRET
            ),
            Err(Refusal::Unauthorized)
        );
        assert_eq!(
            check_head(&with(&["x-aviary-envd-secret: 0123"]), SECRET),
            Err(Refusal::Unauthorized)
        );
        assert_eq!(
            check_head(
                &with(&[
                    "x-aviary-envd-secret: 0123456789abcdef0123",
                    "x-aviary-envd-secret: 0123456789abcdef0123"
                ]),
                SECRET
            ),
            Err(Refusal::BadRequest)
        );
        let post = head(&[
            "POST / HTTP/1.1",
            "Upgrade: aviary-envd",
            "x-aviary-envd-secret: 0123456789abcdef0123",
        ]);
        assert_eq!(check_head(&post, SECRET), Err(Refusal::BadRequest));
        let ws = head(&[
            "GET / HTTP/1.1",
            "Upgrade: websocket",
            "x-aviary-envd-secret: 0123456789abcdef0123",
        ]);
        assert_eq!(check_head(&ws, SECRET), Err(Refusal::BadRequest));
        assert_eq!(check_head(&[0xff, 0xfe], SECRET), Err(Refusal::BadRequest));
    }

    #[test]
    fn the_secret_file_is_read_once_and_must_be_long_enough() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        assert_eq!(read_secret(&p).unwrap(), SECRET);
        assert!(!p.exists(), "the secret file is removed");
        std::fs::write(&p, "short\n").unwrap();
        read_secret(&p).unwrap_err();
    }

    #[test]
    fn a_staged_secret_is_a_new_private_file_and_the_source_stays() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("mounted");
        std::fs::write(&src, "0123456789abcdef0123").unwrap();
        let dst = dir.path().join("secret");
        stage_secret(&src, &dst).unwrap();
        assert!(
            src.exists(),
            "the source is left alone (read-only in a Pod)"
        );
        let mode = std::fs::metadata(&dst).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(read_secret(&dst).unwrap(), SECRET);
        // never over an existing file, never a short secret
        std::fs::write(&dst, "x").unwrap();
        stage_secret(&src, &dst).unwrap_err();
        assert_eq!(std::fs::read(&dst).unwrap(), b"x");
        std::fs::write(&src, "short").unwrap();
        stage_secret(&src, &dir.path().join("other")).unwrap_err();
        assert!(!dir.path().join("other").exists());
    }
}
