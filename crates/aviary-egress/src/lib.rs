//! The node's egress proxy: what makes the `allowlist` network profile real.
//!
//! A sandbox with that profile has no network of its own (its namespace has
//! only `lo`). The runtime asks [`EgressProxy`] (through
//! [`aviary_runtime::EgressGateway`]) for a unix socket of that sandbox's
//! own and bind-mounts the directory holding it into the sandbox; envd
//! forwards `127.0.0.1:3128` inside to it. **Identity is the socket**: a
//! connection is judged under the policy of the sandbox whose socket it
//! arrived on, never by anything the sandbox says.
//!
//! Per request ([`proxy`]): HTTP `CONNECT host:port` (a tunnel, for https)
//! or plain HTTP in absolute form (`GET http://host/path`, one request per
//! connection, forwarded with `Connection: close`). The host is parsed the
//! way a resolver would read it ([`classify::parse_host`]); an address in an
//! always-denied range ([`classify::forbidden`]) is refused in every
//! encoding; other IP literals are refused for not being names; a name goes
//! through the profile's rules ([`rules::judge`]: deny list, allow list with
//! wildcards, method limits). An allowed name is resolved **here** (or by
//! the operator's `resolve` override, trusted as configured) and the proxy
//! connects to the very address it checked: no second lookup, no rebinding,
//! and DNS answers in denied ranges are refused like literals.
//!
//! Every refusal is answered `403` and reported as an [`EgressDenial`] on
//! the channel [`EgressProxy::new`] returns (the server turns each into an
//! `egress_denied` event and taints the sandbox). Bounds per sandbox: open
//! connections, request head size, idle time.
//!
//! Concurrency: one accept task per attached sandbox and one task per
//! connection, on the tokio runtime given at construction; detaching a
//! sandbox closes its listener and ends its open connections.
#![forbid(unsafe_code)]

pub mod classify;
mod proxy;
pub mod rules;

use aviary_core::egress::{EgressDenial, EgressPolicy};
use aviary_core::SandboxId;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch, Semaphore};

/// How many denials may wait for the server before new ones are dropped
/// (and logged): a sandbox hammering the proxy cannot grow host memory.
pub const DENIAL_QUEUE: usize = 1024;

/// The per-node proxy. Cheap to clone.
#[derive(Clone)]
pub struct EgressProxy {
    inner: Arc<Inner>,
}

struct Inner {
    handle: tokio::runtime::Handle,
    denials: mpsc::Sender<EgressDenial>,
    attached: Mutex<HashMap<SandboxId, Attached>>,
}

struct Attached {
    /// Dropped on detach: every task of the sandbox sees the channel close.
    _stop: watch::Sender<()>,
}

/// What one connection task knows about its sandbox.
pub(crate) struct SandboxCtx {
    pub id: SandboxId,
    pub policy: EgressPolicy,
    pub connections: Arc<Semaphore>,
    pub denials: mpsc::Sender<EgressDenial>,
    pub reports: Mutex<ReportBudget>,
}

/// How many denials of one sandbox are reported one by one per
/// [`REPORT_WINDOW`]; the rest are counted and named in the next report
/// (a sandbox hammering the proxy cannot flood the event log).
pub const REPORTS_PER_WINDOW: u32 = 60;
pub const REPORT_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// The per-sandbox report budget.
pub(crate) struct ReportBudget {
    window_start: std::time::Instant,
    reported: u32,
    suppressed: u64,
}

impl ReportBudget {
    fn new() -> Self {
        ReportBudget {
            window_start: std::time::Instant::now(),
            reported: 0,
            suppressed: 0,
        }
    }

    /// `Some(n)`: report this denial, with `n` unreported ones before it;
    /// `None`: count it only.
    pub(crate) fn take(&mut self) -> Option<u64> {
        if self.window_start.elapsed() >= REPORT_WINDOW {
            self.window_start = std::time::Instant::now();
            self.reported = 0;
        }
        if self.reported >= REPORTS_PER_WINDOW {
            self.suppressed += 1;
            return None;
        }
        self.reported += 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

impl EgressProxy {
    /// A proxy whose tasks run on `handle`, and the receiving end of its
    /// denials.
    pub fn new(handle: tokio::runtime::Handle) -> (EgressProxy, mpsc::Receiver<EgressDenial>) {
        let (tx, rx) = mpsc::channel(DENIAL_QUEUE);
        (
            EgressProxy {
                inner: Arc::new(Inner {
                    handle,
                    denials: tx,
                    attached: Mutex::new(HashMap::new()),
                }),
            },
            rx,
        )
    }

    /// Starts serving `policy` for sandbox `id` on a new socket at `socket`
    /// (mode 0666: the sandbox's own users must reach it; only this
    /// sandbox's mount shows it). Replaces an earlier attachment of `id`.
    pub fn attach(
        &self,
        id: &SandboxId,
        policy: &EgressPolicy,
        socket: &Path,
    ) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        match std::fs::remove_file(socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let std_listener = std::os::unix::net::UnixListener::bind(socket)?;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666))?;
        std_listener.set_nonblocking(true)?;
        let (stop_tx, stop_rx) = watch::channel(());
        let ctx = Arc::new(SandboxCtx {
            id: id.clone(),
            policy: policy.clone(),
            connections: Arc::new(Semaphore::new(policy.limits.max_connections as usize)),
            denials: self.inner.denials.clone(),
            reports: Mutex::new(ReportBudget::new()),
        });
        let handle = self.inner.handle.clone();
        let listener = {
            let _entered = handle.enter();
            tokio::net::UnixListener::from_std(std_listener)?
        };
        handle.spawn(accept_loop(listener, ctx, stop_rx));
        let old = self
            .inner
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), Attached { _stop: stop_tx });
        drop(old);
        tracing::info!(sandbox.id = %id, profile = %policy.profile, "egress proxy attached");
        Ok(())
    }

    /// Stops serving `id` (no-op when not attached).
    pub fn detach(&self, id: &SandboxId) {
        let gone = self
            .inner
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        if gone.is_some() {
            tracing::info!(sandbox.id = %id, "egress proxy detached");
        }
    }

    /// Sandboxes served now.
    pub fn attached(&self) -> Vec<SandboxId> {
        self.inner
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }
}

impl aviary_runtime::EgressGateway for EgressProxy {
    fn attach(&self, id: &SandboxId, policy: &EgressPolicy, socket: &Path) -> std::io::Result<()> {
        EgressProxy::attach(self, id, policy, socket)
    }

    fn detach(&self, id: &SandboxId) {
        EgressProxy::detach(self, id)
    }
}

async fn accept_loop(
    listener: tokio::net::UnixListener,
    ctx: Arc<SandboxCtx>,
    mut stop: watch::Receiver<()>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.changed() => return,
        };
        let (stream, _) = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(sandbox.id = %ctx.id, error = %e, "egress accept failed");
                // out of descriptors, say: do not spin
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let ctx = ctx.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = proxy::serve(&ctx, stream) => {}
                _ = stop.changed() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests;
