//! The host end of a remote sandbox's envd: a unix socket in the sandbox's
//! host-only control dir, served by this process (`aviary-relay`). Each
//! connection accepted there is carried to envd in the remote sandbox over
//! one upgraded HTTP/1.1 connection through the provider's port proxy
//! (envd's bridge, see `aviary-envd`'s `bridge.rs`), byte for byte. The
//! control plane's envd client connects here like to any local sandbox and
//! checks, as always, that the socket's listener is the process it expects:
//! this one.

use crate::e2b::{E2bClient, RemoteSandbox};
pub use aviary_relay::{Relay, BRIDGE_PORT, PROTOCOL, SECRET_HEADER};
use std::path::Path;

/// What one relay needs to reach its sandbox's envd.
pub struct Target {
    pub client: E2bClient,
    pub sandbox: RemoteSandbox,
    pub secret: String,
}

impl aviary_relay::Connect for Target {
    type Stream = reqwest::Upgraded;

    async fn connect(&self) -> std::io::Result<reqwest::Upgraded> {
        self.client
            .upgrade(
                &self.sandbox,
                BRIDGE_PORT,
                PROTOCOL,
                &[(SECRET_HEADER, &self.secret)],
            )
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn describe(&self) -> String {
        self.sandbox.remote_id.clone()
    }
}

/// Binds `socket` (replacing a stale socket file, never anything else) and
/// relays every connection to `target`.
pub fn start(socket: &Path, target: Target) -> std::io::Result<Relay> {
    aviary_relay::start(socket, target)
}
