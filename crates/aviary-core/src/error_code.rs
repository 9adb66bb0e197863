//! Stable, documented error codes. The HTTP layer maps each to one status; the
//! CLI maps each to one exit code. Renaming a code breaks clients.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Body is not valid JSON, has unknown fields or wrong types.
    InvalidRequest,
    /// Body larger than the route allows.
    PayloadTooLarge,
    /// No API key, or a key that is not known.
    Unauthorized,
    /// The key is valid but may not do this (e.g. admin-only route).
    Forbidden,
    /// No such object for this tenant (other tenants' objects are not found either).
    NotFound,
    /// The sandbox is leased and the call carried no token.
    LeaseRequired,
    /// The call carried a token that is not the current lease's.
    StaleToken,
    /// The sandbox already has a live lease.
    LeaseHeld,
    /// The sandbox is not in a state that allows the call (e.g. terminated).
    InvalidState,
    /// A path escapes the sandbox or is not absolute.
    InvalidPath,
    /// Concurrent modification; retry.
    Conflict,
    /// A template archive could not be imported.
    InvalidArchive,
    /// Runtime or dependency unavailable right now.
    Unavailable,
    /// Too many requests for this key (or connections); retry after `Retry-After`.
    RateLimited,
    /// No node has room for the sandbox within the configured over-commit.
    CapacityExhausted,
    /// The sandbox's daemon is busy (all of its lanes in use); retry after `Retry-After`.
    Busy,
    /// The sandbox's runtime or in-sandbox daemon is gone; the sandbox is Lost.
    SandboxLost,
    /// The sandbox refused the operation on that path (read-only, not permitted, not a regular file).
    PermissionDenied,
    /// Anything else; details are in the server log, never in the body.
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::InvalidPath | ErrorCode::InvalidArchive => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden | ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::LeaseRequired
            | ErrorCode::StaleToken
            | ErrorCode::LeaseHeld
            | ErrorCode::InvalidState
            | ErrorCode::Conflict
            | ErrorCode::SandboxLost => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::RateLimited => 429,
            ErrorCode::Unavailable | ErrorCode::CapacityExhausted | ErrorCode::Busy => 503,
            ErrorCode::Internal => 500,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::LeaseRequired => "lease_required",
            ErrorCode::StaleToken => "stale_token",
            ErrorCode::LeaseHeld => "lease_held",
            ErrorCode::InvalidState => "invalid_state",
            ErrorCode::InvalidPath => "invalid_path",
            ErrorCode::Conflict => "conflict",
            ErrorCode::InvalidArchive => "invalid_archive",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::CapacityExhausted => "capacity_exhausted",
            ErrorCode::Busy => "busy",
            ErrorCode::SandboxLost => "sandbox_lost",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::Internal => "internal",
        }
    }

    /// Exit code of the `aviary` CLI when a call fails with this code
    /// (documented in the README). Commands run in a sandbox exit with their
    /// own code instead.
    pub fn cli_exit_code(self) -> i32 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::InvalidPath | ErrorCode::InvalidArchive => 64,
            ErrorCode::PayloadTooLarge => 64,
            ErrorCode::Unauthorized | ErrorCode::Forbidden | ErrorCode::PermissionDenied => 77,
            ErrorCode::NotFound => 66,
            ErrorCode::LeaseRequired
            | ErrorCode::StaleToken
            | ErrorCode::LeaseHeld
            | ErrorCode::InvalidState
            | ErrorCode::Conflict
            | ErrorCode::RateLimited
            | ErrorCode::Busy
            | ErrorCode::SandboxLost => 75,
            ErrorCode::Unavailable | ErrorCode::CapacityExhausted => 69,
            ErrorCode::Internal => 70,
        }
    }
}

/// The body of every error response.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}
