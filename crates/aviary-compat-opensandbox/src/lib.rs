//! Aviary's OpenSandbox-compatible surface (DESIGN §8, §9): the official
//! `opensandbox` SDK, and frameworks built on it (AgentScope's
//! `OpenSandboxWorkspace`), run unchanged against Aviary with
//! `OPEN_SANDBOX_DOMAIN=HOST:PORT/opensandbox` and their Aviary API key.
//!
//! [`router`] serves, under the prefix it is nested at:
//! - `/v1/…`: the lifecycle API ([`lifecycle`]), authenticated by
//!   `OPEN-SANDBOX-API-KEY` = an Aviary API key;
//! - `/sandboxes/{id}/execd/…`: each sandbox's execd ([`execd`]),
//!   authenticated by the sandbox's access token, which the lifecycle API
//!   hands out in the endpoint's `headers`;
//! - `/sandboxes/{id}/egress/…`: the egress endpoint, which only says that
//!   Aviary has none (`501`).
//!
//! It is a surface, not a second system: every handler parses, calls
//! control-plane operations (create goes through plan → policy → pools;
//! every operation is audited and fenced as for native clients) and maps
//! the answer and the error ([`error`]) to OpenSandbox's shapes. It keeps
//! no state of its own.
#![forbid(unsafe_code)]

pub mod error;
pub mod events;
pub mod execd;
pub mod lifecycle;
pub mod upload;

use aviary_control::ControlPlane;
use axum::extract::DefaultBodyLimit;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;

/// Admission of an authenticated request by the server's rate limits:
/// called with the caller's bucket (the hash of its API key, as the v1
/// API's, or `sandbox-token ID` for execd); `Err(retry_after_s)` refuses.
pub type Admission = Arc<dyn Fn(&str) -> Result<(), u64> + Send + Sync>;

/// The surface's settings.
#[derive(Clone)]
pub struct OpenSandboxSettings {
    /// Where the router is nested (`/opensandbox`): the endpoints it hands
    /// out name it.
    pub prefix: String,
    /// Largest JSON body accepted.
    pub max_json_bytes: usize,
    /// Largest upload (a whole multipart body) accepted.
    pub max_upload_bytes: u64,
    /// The server's rate limits (none: not limited here).
    pub admission: Option<Admission>,
}

impl OsbState {
    /// Takes one request from `bucket`'s rate limit.
    pub(crate) fn admit(&self, bucket: &str) -> Result<(), error::OsbError> {
        match &self.settings.admission {
            Some(admit) => admit(bucket).map_err(|retry_after_s| {
                aviary_control::OpError::RateLimited {
                    message: "too many requests for this key".into(),
                    retry_after_s,
                }
                .into()
            }),
            None => Ok(()),
        }
    }
}

/// What every handler gets.
#[derive(Clone)]
pub struct OsbState {
    pub cp: Arc<ControlPlane>,
    pub settings: Arc<OpenSandboxSettings>,
}

/// The client's `x-request-id` when usable, else a new one (recorded on
/// the events the operation writes).
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| aviary_core::new_id("req"))
}

/// The OpenSandbox surface; nest it at `settings.prefix` (it carries its
/// own state, so it nests into a router of any state type).
pub fn router<S: Clone + Send + Sync + 'static>(
    control: Arc<ControlPlane>,
    settings: OpenSandboxSettings,
) -> Router<S> {
    let json_limit = settings.max_json_bytes;
    let state = OsbState {
        cp: control,
        settings: Arc::new(settings),
    };
    let execd = "/sandboxes/{id}/execd";
    let limited = Router::new()
        .route(
            "/v1/sandboxes",
            post(lifecycle::create).get(lifecycle::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(lifecycle::get).delete(lifecycle::delete),
        )
        .route("/v1/sandboxes/{id}/pause", post(lifecycle::pause))
        .route("/v1/sandboxes/{id}/resume", post(lifecycle::resume))
        .route(
            "/v1/sandboxes/{id}/renew-expiration",
            post(lifecycle::renew),
        )
        .route(
            "/v1/sandboxes/{id}/endpoints/{port}",
            get(lifecycle::endpoint),
        )
        .route("/v1/metrics/events", post(lifecycle::metrics_event))
        .route(&format!("{execd}/ping"), get(execd::ping))
        .route(&format!("{execd}/command"), post(execd::command))
        .route(
            &format!("{execd}/files/download"),
            get(execd::files_download),
        )
        .route(&format!("{execd}/files/info"), get(execd::files_info))
        .route(&format!("{execd}/files/search"), get(execd::files_search))
        .route(
            &format!("{execd}/files"),
            axum::routing::delete(execd::files_remove),
        )
        .route(
            &format!("{execd}/directories"),
            post(execd::dirs_make).delete(execd::dirs_remove),
        )
        .route(
            &format!("{execd}/{{*rest}}"),
            axum::routing::any(execd::not_supported),
        )
        .route("/sandboxes/{id}/egress", axum::routing::any(execd::egress))
        .route(
            "/sandboxes/{id}/egress/{*rest}",
            axum::routing::any(execd::egress),
        )
        .layer(DefaultBodyLimit::max(json_limit));
    let streamed = Router::new()
        .route(&format!("{execd}/files/upload"), post(execd::files_upload))
        .layer(DefaultBodyLimit::disable());
    limited
        .merge(streamed)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found() -> error::OsbError {
    aviary_control::OpError::NotFound("route".into()).into()
}

async fn method_not_allowed() -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut r = error::OsbError::invalid("method not allowed on this route").into_response();
    *r.status_mut() = axum::http::StatusCode::METHOD_NOT_ALLOWED;
    r
}
