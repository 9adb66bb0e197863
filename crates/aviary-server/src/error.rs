//! The control plane's error type and the one place that maps errors to HTTP
//! status codes and stable error codes. 5xx bodies never carry internals: the
//! cause is logged with the request id and the client gets `internal`.

use aviary_core::{ErrorBody, ErrorCode, ErrorDetail, SandboxState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("missing or unknown API key")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0}")]
    InvalidPath(String),
    #[error("sandbox is leased: this call needs the current lease token")]
    LeaseRequired,
    #[error("lease token is stale: it is not the sandbox's current lease")]
    StaleToken,
    #[error("sandbox is leased by {owner:?} until {expires_at}")]
    LeaseHeld { owner: String, expires_at: String },
    #[error("sandbox is {state}: {what}")]
    InvalidState { state: SandboxState, what: String },
    #[error("concurrent modification of the sandbox, retry")]
    Conflict,
    #[error("{0}")]
    InvalidArchive(String),
    #[error("{0}")]
    Unavailable(String),
    /// Too many requests; the client should retry after `retry_after_s`.
    #[error("{message}")]
    RateLimited { message: String, retry_after_s: u64 },
    #[error("{0}")]
    CapacityExhausted(String),
    /// The sandbox's envd has no free lane; retry shortly.
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    SandboxLost(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl OpError {
    pub fn code(&self) -> ErrorCode {
        match self {
            OpError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            OpError::PayloadTooLarge(_) => ErrorCode::PayloadTooLarge,
            OpError::Unauthorized => ErrorCode::Unauthorized,
            OpError::Forbidden(_) => ErrorCode::Forbidden,
            OpError::NotFound(_) => ErrorCode::NotFound,
            OpError::InvalidPath(_) => ErrorCode::InvalidPath,
            OpError::LeaseRequired => ErrorCode::LeaseRequired,
            OpError::StaleToken => ErrorCode::StaleToken,
            OpError::LeaseHeld { .. } => ErrorCode::LeaseHeld,
            OpError::InvalidState { .. } => ErrorCode::InvalidState,
            OpError::Conflict => ErrorCode::Conflict,
            OpError::InvalidArchive(_) => ErrorCode::InvalidArchive,
            OpError::Unavailable(_) => ErrorCode::Unavailable,
            OpError::RateLimited { .. } => ErrorCode::RateLimited,
            OpError::CapacityExhausted(_) => ErrorCode::CapacityExhausted,
            OpError::Busy(_) => ErrorCode::Busy,
            OpError::SandboxLost(_) => ErrorCode::SandboxLost,
            OpError::PermissionDenied(_) => ErrorCode::PermissionDenied,
            OpError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// Seconds a client should wait before retrying, for the codes that ask for it.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            OpError::RateLimited { retry_after_s, .. } => Some(*retry_after_s),
            OpError::Busy(_) => Some(1),
            OpError::CapacityExhausted(_) => Some(5),
            _ => None,
        }
    }

    pub fn internal(e: impl Into<anyhow::Error>) -> Self {
        OpError::Internal(e.into())
    }

    /// The message a client may see.
    pub fn public_message(&self) -> String {
        match self {
            OpError::Internal(_) => "internal error; see the server log".to_owned(),
            other => other.to_string(),
        }
    }

    pub fn body(&self, request_id: Option<String>) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code(),
                message: self.public_message(),
                request_id,
            },
        }
    }
}

impl IntoResponse for OpError {
    fn into_response(self) -> Response {
        if let OpError::Internal(e) = &self {
            tracing::error!(error = format!("{e:#}"), "internal error");
        }
        let status = StatusCode::from_u16(self.code().http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry_after = self.retry_after_s();
        let mut response = (status, axum::Json(self.body(None))).into_response();
        if let Some(s) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(s),
            );
        }
        response
    }
}

impl From<aviary_registry::RegistryError> for OpError {
    fn from(e: aviary_registry::RegistryError) -> Self {
        use aviary_registry::RegistryError as R;
        match e {
            R::NotFound => OpError::NotFound("sandbox".into()),
            R::Conflict => OpError::Conflict,
            R::LeaseRequired => OpError::LeaseRequired,
            R::StaleToken => OpError::StaleToken,
            R::IllegalTransition(s) => OpError::InvalidRequest(s.to_string()),
            other => OpError::internal(other),
        }
    }
}

impl From<aviary_leases::LeaseError> for OpError {
    fn from(e: aviary_leases::LeaseError) -> Self {
        use aviary_leases::LeaseError as L;
        match e {
            L::NotFound => OpError::NotFound("sandbox".into()),
            L::Held { owner, expires_at } => OpError::LeaseHeld {
                owner,
                expires_at: crate::ops::rfc3339(expires_at),
            },
            L::LeaseRequired => OpError::LeaseRequired,
            L::StaleToken => OpError::StaleToken,
            L::InvalidTtl => OpError::InvalidRequest("invalid lease ttl".into()),
            other => OpError::internal(other),
        }
    }
}

impl From<aviary_envd_proto::EnvdError> for OpError {
    fn from(e: aviary_envd_proto::EnvdError) -> Self {
        use aviary_envd_proto::EnvdError as E;
        match e {
            E::NotFound(p) => OpError::NotFound(format!("path {p}")),
            E::InvalidPath(r) => OpError::InvalidPath(r),
            E::LeaseRequired => OpError::LeaseRequired,
            E::StaleToken => OpError::StaleToken,
            // Refusals by envd for the caller's input or the sandbox's state:
            // client errors with envd's message (it names the sandbox path).
            E::BadRequest(m) => OpError::InvalidRequest(m),
            e @ (E::AlreadyExists(_) | E::NotEmpty(_)) => OpError::InvalidRequest(e.to_string()),
            E::NoSpace(m) => OpError::InvalidRequest(format!("sandbox disk is full: {m}")),
            E::PermissionDenied(m) => OpError::PermissionDenied(m),
            e @ E::NotRegularFile(_) => OpError::PermissionDenied(e.to_string()),
            E::Busy => OpError::Busy("the sandbox's envd is busy; retry".into()),
            // envd up but unreachable for now (a gone envd is turned into
            // `sandbox_lost` by the control plane before it gets here)
            E::Connect(_) => {
                OpError::Unavailable("the sandbox's envd is not reachable; retry".into())
            }
            E::Transport(_) => {
                OpError::Unavailable("the connection to the sandbox's envd broke; retry".into())
            }
            other => OpError::internal(other),
        }
    }
}
