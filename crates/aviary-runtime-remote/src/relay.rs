//! The host end of a remote sandbox's envd: a unix socket in the sandbox's
//! host-only control dir, served by this process. Each connection accepted
//! there is carried to envd in the remote sandbox over one upgraded HTTP/1.1
//! connection that the provider carries to envd's bridge (E2B's port proxy,
//! an OpenSandbox endpoint; see
//! `aviary-envd`'s `bridge.rs`), byte for byte. The control plane's envd
//! client connects here like to any local sandbox and checks, as always,
//! that the socket's listener is the process it expects: this one.

use crate::Provider;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

/// The port envd's bridge listens on inside a remote sandbox (loopback).
pub const BRIDGE_PORT: u16 = 49_877;
/// The header the bridge secret travels in.
pub const SECRET_HEADER: &str = "x-aviary-envd-secret";
/// The bridge's upgrade protocol.
pub const PROTOCOL: &str = "aviary-envd";

/// What one relay needs to reach its sandbox's envd.
pub struct Target<P: Provider> {
    pub provider: P,
    pub sandbox: P::Sandbox,
    pub secret: String,
}

/// A running relay; dropping it stops accepting (open connections finish).
pub struct Relay {
    accept: JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Binds `socket` (replacing a stale socket file, never anything else) and
/// relays every connection to `target`.
pub fn start<P: Provider>(socket: &Path, target: Target<P>) -> std::io::Result<Relay> {
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
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            let target = Arc::clone(&target);
            tokio::spawn(async move {
                let opened = target
                    .provider
                    .open_bridge(&target.sandbox, &target.secret)
                    .await;
                match opened {
                    Ok(mut remote) => {
                        let _ = tokio::io::copy_bidirectional(&mut conn, &mut remote).await;
                    }
                    // the client sees the connection close: envd unreachable
                    Err(e) => tracing::debug!(
                        remote = %P::remote_id(&target.sandbox),
                        error = %e,
                        "remote envd connection failed"
                    ),
                }
            });
        }
    });
    Ok(Relay { accept })
}
