//! The E2B-compatible surface of Aviary: the HTTP API the official `e2b`
//! SDKs (Python and JS) call, served over the same [`ControlPlane`]
//! operations as the v1 API, so the planner, the policy guard, the pools,
//! fencing and the event log stand behind every E2B call.
//!
//! Two parts, both under the prefix the server nests this router at
//! (`/e2b` on the main listener):
//! - the control API (`E2B_API_URL=http://HOST:PORT/e2b`, [`api`]): create
//!   (v1 and v2), get, list with state/metadata filters and `X-Next-Token`
//!   pages, kill, timeout, pause, connect/resume. Auth: `X-API-KEY` is the
//!   caller's own Aviary API key. Errors are E2B's `{code:int,message}`.
//! - envd (`E2B_SANDBOX_URL=http://HOST:PORT/e2b/envd`, [`envd`]): the
//!   in-sandbox API, routed by the `E2b-Sandbox-Id` header (the SDK sends
//!   every sandbox's calls to that one URL) and authenticated by the
//!   sandbox's access token (`X-Access-Token`, an HMAC the control plane
//!   derives; only the sandbox's tenant is handed it): `/health`, Connect
//!   RPC `process.Process/*` and `filesystem.Filesystem/*` (JSON codec,
//!   [`connect`]), and `/files` downloads and uploads.
//!
//! Invariants: every call resolves to an [`OpContext`] of the caller's
//! tenant (from the API key or the sandbox token) and goes through one
//! control-plane operation (creates through `ControlPlane::create`: plan →
//! policy → pools); E2B calls carry no lease token, so a sandbox a native
//! client holds under a lease refuses them (fencing is never bypassed);
//! another tenant's sandbox is `not found` like an unknown one.
//!
//! In-process state: the table of processes started through this replica's
//! envd surface ([`process::Processes`]), which serves `List`, `Connect` and
//! `SendSignal`; a process started on another replica is not in it (its
//! output still reaches the client that started it).
#![forbid(unsafe_code)]

pub mod api;
pub mod connect;
pub mod envd;
pub mod process;

use aviary_control::ControlPlane;
use axum::Router;
use std::sync::Arc;
use std::time::Duration;

/// The envd version Aviary advertises: the SDK gates features on it
/// (`e2b/envd/versions.py`). 0.5.7 enables octet-stream uploads, which
/// `/files` serves; the file-metadata (0.6.2) and watch (0.6.3+) features
/// are not implemented, so the version stays below them.
pub const ENVD_VERSION: &str = "0.5.7";

/// E2B's `clientID`: a constant the SDK requires and ignores.
pub const CLIENT_ID: &str = "aviary";

/// What a call is charged to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge<'a> {
    /// An authenticated caller's budget (an API key's, or a sandbox's).
    Key(&'a str),
    /// A call whose key or token was refused: charged to its client
    /// (the server reads the address from the request's extensions), so
    /// guessing is as limited as calling.
    FailedAuth,
}

/// A request budget: `Err(retry_after_s)` when the charge is over it.
pub type RateLimit =
    Arc<dyn Fn(Charge<'_>, &axum::http::Extensions) -> Result<(), u64> + Send + Sync>;

/// The surface's own limits.
#[derive(Clone)]
pub struct E2bSettings {
    /// Largest JSON body of a control call or Connect request.
    pub max_json_bytes: usize,
    /// Largest file upload accepted through `/files`.
    pub max_upload_bytes: u64,
    /// A request body that stalls longer than this between chunks is cut.
    pub body_read_timeout: Duration,
    /// Charged once per authenticated call: per API key on the control
    /// API, per sandbox on envd (`None`: unlimited).
    pub rate_limit: Option<RateLimit>,
}

impl std::fmt::Debug for E2bSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bSettings")
            .field("max_json_bytes", &self.max_json_bytes)
            .field("max_upload_bytes", &self.max_upload_bytes)
            .field("body_read_timeout", &self.body_read_timeout)
            .field("rate_limit", &self.rate_limit.is_some())
            .finish()
    }
}

impl E2bSettings {
    /// Charges one call.
    pub(crate) fn charge(
        &self,
        charge: Charge<'_>,
        extensions: &axum::http::Extensions,
    ) -> Result<(), u64> {
        match &self.rate_limit {
            Some(limit) => limit(charge, extensions),
            None => Ok(()),
        }
    }
}

impl Default for E2bSettings {
    fn default() -> Self {
        E2bSettings {
            max_json_bytes: 1 << 20,
            max_upload_bytes: 1 << 30,
            body_read_timeout: Duration::from_secs(30),
            rate_limit: None,
        }
    }
}

/// Shared by every handler of the surface.
#[derive(Clone)]
pub struct E2bState {
    pub cp: Arc<ControlPlane>,
    pub settings: Arc<E2bSettings>,
    pub processes: Arc<process::Processes>,
}

/// The E2B surface: the control API at `/` and envd at `/envd`, to be
/// nested under a prefix (the server uses `/e2b`).
pub fn router(cp: Arc<ControlPlane>, settings: E2bSettings) -> Router {
    let state = E2bState {
        cp,
        settings: Arc::new(settings),
        processes: Arc::new(process::Processes::default()),
    };
    let timeout = state.settings.body_read_timeout;
    Router::new()
        .merge(api::routes())
        .nest("/envd", envd::routes())
        .fallback(api::unknown_route)
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(timeout))
        .with_state(state)
}
