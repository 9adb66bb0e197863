//! The host end of an envd the host did not start next to itself (a remote
//! provider's sandbox, a Kubernetes Pod): a unix socket in a host-only
//! directory, listened on by this process, whose every accepted connection
//! is carried byte for byte over one upgraded connection to envd's bridge
//! (`aviary-envd`'s `bridge.rs`: an HTTP/1.1 `GET` with `Upgrade:
//! aviary-envd` and the bridge secret in [`SECRET_HEADER`], answered `101`
//! and then spliced to envd's own unix socket).
//!
//! The control plane's envd client connects to the relay socket like to any
//! local sandbox's socket and checks, as always, that the socket's listener
//! is the process it expects: this one (`EnvdEndpoint { socket, peer_pid:
//! std::process::id() }`).
//!
//! What is shared here: the relay loop ([`start`], generic over how one
//! upgraded connection is opened: [`Connect`]) and the plain-TCP upgrade
//! client ([`TcpBridge`], for a bridge reached directly, e.g. a Pod's IP).
//! The remote runtime opens its upgrades through the provider's port proxy
//! instead and brings its own [`Connect`].
//!
//! Invariants: the socket is created 0600 in a directory the caller made
//! host-only; a stale socket file at the path is replaced, anything else
//! there is an error; the secret never appears in a log line or a `Debug`.
//!
//! Concurrency: one accept task per relay; one task per relayed
//! connection. Dropping the [`Relay`] stops accepting; connections already
//! relayed run until either side closes.
#![forbid(unsafe_code)]

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener};
use tokio::task::JoinHandle;

/// The header the bridge secret travels in (envd: `bridge::SECRET_HEADER`).
pub const SECRET_HEADER: &str = "x-aviary-envd-secret";
/// The bridge's upgrade protocol (envd: `bridge::PROTOCOL`).
pub const PROTOCOL: &str = "aviary-envd";
/// The port envd's bridge listens on unless configured otherwise.
pub const BRIDGE_PORT: u16 = 49_877;
/// Longest a direct bridge connection may take to connect and answer the
/// upgrade.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer head read from a bridge (envd's is under 100 bytes).
const MAX_ANSWER_HEAD: usize = 4 * 1024;
/// Shortest and longest secret accepted (envd: at least 16 printable bytes).
const SECRET_LEN: std::ops::RangeInclusive<usize> = 16..=1024;

/// How a relay opens one upgraded connection to envd's bridge.
pub trait Connect: Send + Sync + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Opens one connection, upgraded: the bytes that follow are envd's
    /// protocol.
    fn connect(&self) -> impl Future<Output = io::Result<Self::Stream>> + Send;
    /// Which sandbox's envd, for log lines (never the secret).
    fn describe(&self) -> String;
}

/// A running relay; dropping it stops accepting (open connections finish).
pub struct Relay {
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").finish_non_exhaustive()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Binds `socket` (replacing a stale socket file, never anything else),
/// makes it 0600 and relays every connection accepted there to `target`.
/// Must be called within a tokio runtime.
pub fn start<C: Connect>(socket: &Path, target: C) -> io::Result<Relay> {
    if let Ok(meta) = std::fs::symlink_metadata(socket) {
        if meta.file_type().is_socket() {
            std::fs::remove_file(socket)?;
        }
    }
    let listener = UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    let target = Arc::new(target);
    let accept = tokio::spawn(async move {
        loop {
            let mut conn = match listener.accept().await {
                Ok((conn, _)) => conn,
                Err(e) => {
                    // out of descriptors, most likely: do not spin on it
                    tracing::warn!(error = %e, "relay accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let target = Arc::clone(&target);
            tokio::spawn(async move {
                match target.connect().await {
                    Ok(mut remote) => {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut remote).await;
                    }
                    // the client sees the connection close: envd unreachable
                    Err(e) => tracing::debug!(
                        envd = %target.describe(),
                        error = %e,
                        "envd bridge connection failed"
                    ),
                }
            });
        }
    });
    Ok(Relay { accept })
}

/// Whether `secret` can be a bridge secret: 16 to 1024 printable ASCII
/// bytes without spaces (it travels in a header line and envd compares the
/// header's trimmed value).
pub fn valid_secret(secret: &str) -> bool {
    SECRET_LEN.contains(&secret.len()) && secret.bytes().all(|b| b.is_ascii_graphic())
}

/// envd's bridge reached directly over TCP at `addr`.
#[derive(Clone)]
pub struct TcpBridge {
    addr: SocketAddr,
    secret: String,
}

impl std::fmt::Debug for TcpBridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBridge")
            .field("addr", &self.addr)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl TcpBridge {
    /// The bridge at `addr` with `secret`; `None` if the secret is not one
    /// ([`valid_secret`]).
    pub fn new(addr: SocketAddr, secret: String) -> Option<TcpBridge> {
        valid_secret(&secret).then_some(TcpBridge { addr, secret })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connects and upgrades within [`HANDSHAKE_TIMEOUT`]. A refusal by the
    /// bridge is `PermissionDenied` (401: wrong secret) or `InvalidData`,
    /// naming the status line.
    pub async fn open(&self) -> io::Result<TcpStream> {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.handshake()).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "envd's bridge at {} did not answer within {HANDSHAKE_TIMEOUT:?}",
                    self.addr
                ),
            )),
        }
    }

    async fn handshake(&self) -> io::Result<TcpStream> {
        let mut conn = TcpStream::connect(self.addr).await?;
        // frames are small and latency-bound: do not wait for Nagle
        conn.set_nodelay(true)?;
        let head = format!(
            "GET / HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: {PROTOCOL}\r\n{SECRET_HEADER}: {}\r\n\r\n",
            self.addr, self.secret
        );
        conn.write_all(head.as_bytes()).await?;
        let mut buf = Vec::with_capacity(256);
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            if buf.len() >= MAX_ANSWER_HEAD {
                return Err(bad_answer("answer head too long"));
            }
            let mut chunk = [0u8; 512];
            let n = conn.read(&mut chunk).await?;
            if n == 0 {
                return Err(bad_answer("connection closed before the answer"));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let status_line = buf[..end]
            .split(|b| *b == b'\r')
            .next()
            .map(|l| String::from_utf8_lossy(l).into_owned())
            .unwrap_or_default();
        let status = status_line.split(' ').nth(1).unwrap_or_default();
        match status {
            // envd speaks only after a request: nothing may follow the head
            "101" if buf.len() == end + 4 => Ok(conn),
            "101" => Err(bad_answer("data before the first request")),
            "401" => Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "envd's bridge at {} refused the secret ({status_line})",
                    self.addr
                ),
            )),
            _ => Err(bad_answer(&format!(
                "refused: {:?}",
                status_line.chars().take(120).collect::<String>()
            ))),
        }
    }
}

fn bad_answer(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("envd bridge: {what}"))
}

impl Connect for TcpBridge {
    type Stream = TcpStream;

    fn connect(&self) -> impl Future<Output = io::Result<TcpStream>> + Send {
        self.open()
    }

    fn describe(&self) -> String {
        self.addr.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, UnixStream};

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    /// A bridge stand-in: answers the first request head with `answer`,
    /// then echoes.
    async fn fake_bridge(answer: &'static str) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if c.read(&mut b).await.unwrap() == 0 {
                    break;
                }
                head.push(b[0]);
            }
            c.write_all(answer.as_bytes()).await.unwrap();
            let mut buf = [0u8; 64];
            while let Ok(n) = c.read(&mut buf).await {
                if n == 0 || c.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            String::from_utf8(head).unwrap()
        });
        (addr, task)
    }

    #[test]
    fn secrets_must_be_printable_and_long_enough() {
        assert!(valid_secret(SECRET));
        for bad in [
            "short",
            "0123456789abcdef 0123",
            "0123456789abcdef\r\nx: y",
            "",
        ] {
            assert!(!valid_secret(bad), "{bad:?}");
        }
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(TcpBridge::new(addr, "0123456789abcdef\nHost: x".into()).is_none());
        let b = TcpBridge::new(addr, SECRET.into()).unwrap();
        assert!(!format!("{b:?}").contains(SECRET));
    }

    #[tokio::test]
    async fn a_relayed_connection_carries_the_upgrade_and_then_bytes_both_ways() {
        let (addr, bridge) =
            fake_bridge("HTTP/1.1 101 Switching Protocols\r\nUpgrade: aviary-envd\r\n\r\n").await;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("envd.sock");
        let relay = start(&socket, TcpBridge::new(addr, SECRET.into()).unwrap()).unwrap();
        let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let mut c = UnixStream::connect(&socket).await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        drop(c);
        let head = bridge.await.unwrap();
        assert!(head.starts_with("GET / HTTP/1.1\r\n"), "{head}");
        assert!(head.contains("Upgrade: aviary-envd\r\n"), "{head}");
        assert!(
            head.contains(&format!("{SECRET_HEADER}: {SECRET}\r\n")),
            "{head}"
        );
        drop(relay);
    }

    #[tokio::test]
    async fn refusals_are_clear_errors() {
        let (addr, _b) =
            fake_bridge("HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n").await;
        let e = TcpBridge::new(addr, SECRET.into())
            .unwrap()
            .open()
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        assert!(!e.to_string().contains(SECRET));
        let (addr, _b) = fake_bridge("HTTP/1.1 101 Switching Protocols\r\n\r\nearly").await;
        let e = TcpBridge::new(addr, SECRET.into())
            .unwrap()
            .open()
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }

    #[tokio::test]
    async fn only_a_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("envd.sock");
        std::fs::write(&file, "not a socket").unwrap();
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let t = || TcpBridge::new(addr, SECRET.into()).unwrap();
        start(&file, t()).unwrap_err();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a socket");
        let socket = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        let _relay = start(&socket, t()).unwrap();
    }
}
