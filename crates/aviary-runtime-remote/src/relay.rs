//! The host end of a remote sandbox's envd: a unix socket in the sandbox's
//! host-only control dir, served by this process (`aviary-relay`). Each
//! connection accepted there is carried to envd in the remote sandbox over
//! one upgraded HTTP/1.1 connection that the provider carries to envd's
//! bridge (E2B's port proxy, an OpenSandbox endpoint; see `aviary-envd`'s
//! `bridge.rs`), byte for byte. The control plane's envd client connects
//! here like to any local sandbox and checks, as always, that the socket's
//! listener is the process it expects: this one.

use crate::Provider;
pub use aviary_relay::{Relay, BRIDGE_PORT, PROTOCOL, SECRET_HEADER};
use std::path::Path;

/// What one relay needs to reach its sandbox's envd.
pub struct Target<P: Provider> {
    pub provider: P,
    pub sandbox: P::Sandbox,
    pub secret: String,
}

impl<P: Provider> aviary_relay::Connect for Target<P> {
    type Stream = reqwest::Upgraded;

    async fn connect(&self) -> std::io::Result<reqwest::Upgraded> {
        self.provider
            .open_bridge(&self.sandbox, &self.secret)
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn describe(&self) -> String {
        P::remote_id(&self.sandbox).to_owned()
    }
}

/// Binds `socket` (replacing a stale socket file, never anything else) and
/// relays every connection to `target`.
pub fn start<P: Provider>(socket: &Path, target: Target<P>) -> std::io::Result<Relay> {
    aviary_relay::start(socket, target)
}
