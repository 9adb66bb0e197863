//! Stable, documented error codes: the one table of the control plane's
//! errors. Every layer error (`RegistryError`, `LeaseError`, `LockError`,
//! `RuntimeError`, `EnvdError`, `TemplateError`, …) names its code with a
//! `code()` method; the server builds its answer from that code (status,
//! body), and the CLI exits with the code's exit code. No other place decides
//! a status or an exit code. Renaming a code breaks clients.

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
    /// Nothing accepts connections on the sandbox port a proxied request
    /// asked for (502).
    PortUnreachable,
    /// The sandbox's runtime cannot do this (e.g. pause a Pod on Kubernetes);
    /// nothing was changed.
    Unsupported,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::InvalidRequest,
        ErrorCode::PayloadTooLarge,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::LeaseRequired,
        ErrorCode::StaleToken,
        ErrorCode::LeaseHeld,
        ErrorCode::InvalidState,
        ErrorCode::InvalidPath,
        ErrorCode::Conflict,
        ErrorCode::InvalidArchive,
        ErrorCode::Unavailable,
        ErrorCode::RateLimited,
        ErrorCode::CapacityExhausted,
        ErrorCode::Busy,
        ErrorCode::SandboxLost,
        ErrorCode::PermissionDenied,
        ErrorCode::Internal,
        ErrorCode::PortUnreachable,
        ErrorCode::Unsupported,
    ];

    /// The HTTP status of an answer with this code.
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
            | ErrorCode::SandboxLost
            | ErrorCode::Unsupported => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::RateLimited => 429,
            ErrorCode::Unavailable | ErrorCode::CapacityExhausted | ErrorCode::Busy => 503,
            ErrorCode::Internal => 500,
            ErrorCode::PortUnreachable => 502,
        }
    }

    /// Whether the answer is a server error (5xx): its body never carries
    /// internals.
    pub fn is_server_error(self) -> bool {
        self.http_status() >= 500
    }

    /// The code as it appears on the wire (`error.code`).
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
            ErrorCode::PortUnreachable => "port_unreachable",
            ErrorCode::Unsupported => "unsupported",
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
            ErrorCode::Unsupported => 69,
            ErrorCode::Unavailable | ErrorCode::CapacityExhausted | ErrorCode::PortUnreachable => {
                69
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    /// Its position in [`ErrorCode::ALL`]. The match is exhaustive, so a new
    /// code does not compile until it is listed here, and the walk below
    /// fails until it is in `ALL` too.
    fn position(c: ErrorCode) -> usize {
        match c {
            ErrorCode::InvalidRequest => 0,
            ErrorCode::PayloadTooLarge => 1,
            ErrorCode::Unauthorized => 2,
            ErrorCode::Forbidden => 3,
            ErrorCode::NotFound => 4,
            ErrorCode::LeaseRequired => 5,
            ErrorCode::StaleToken => 6,
            ErrorCode::LeaseHeld => 7,
            ErrorCode::InvalidState => 8,
            ErrorCode::InvalidPath => 9,
            ErrorCode::Conflict => 10,
            ErrorCode::InvalidArchive => 11,
            ErrorCode::Unavailable => 12,
            ErrorCode::RateLimited => 13,
            ErrorCode::CapacityExhausted => 14,
            ErrorCode::Busy => 15,
            ErrorCode::SandboxLost => 16,
            ErrorCode::PermissionDenied => 17,
            ErrorCode::Internal => 18,
            ErrorCode::PortUnreachable => 19,
            ErrorCode::Unsupported => 20,
        }
    }

    #[test]
    fn all_lists_every_code_once_in_order() {
        for (i, c) in ErrorCode::ALL.iter().enumerate() {
            assert_eq!(position(*c), i, "{c:?} is out of place in ErrorCode::ALL");
        }
    }

    #[test]
    fn every_code_has_a_status_a_string_and_an_exit_code() {
        let mut strings = HashSet::new();
        for c in ErrorCode::ALL {
            let status = c.http_status();
            assert!((400..600).contains(&status), "{c:?}: status {status}");
            assert_eq!(c.is_server_error(), status >= 500, "{c:?}");
            let s = c.as_str();
            assert!(
                !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{c:?}: {s:?} is not snake_case"
            );
            assert!(strings.insert(s), "{s:?} is the string of two codes");
            // sysexits.h: 64..=78, never a code a sandboxed command could be
            // confused with by the tests (0, 1, 2, 124)
            let exit = c.cli_exit_code();
            assert!((64..=78).contains(&exit), "{c:?}: exit code {exit}");
        }
        // only internal is a 500; the other server errors ask for a retry
        let internal: Vec<_> = ErrorCode::ALL
            .into_iter()
            .filter(|c| c.http_status() == 500)
            .collect();
        assert_eq!(internal, [ErrorCode::Internal]);
    }

    #[test]
    fn codes_round_trip_through_serde_as_their_string() {
        for c in ErrorCode::ALL {
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            let back: ErrorCode = serde_json::from_str(&json).unwrap();
            assert_eq!(back, c);
            let body = ErrorBody {
                error: ErrorDetail {
                    code: c,
                    message: "m".into(),
                    request_id: None,
                },
            };
            let back: ErrorBody =
                serde_json::from_value(serde_json::to_value(&body).unwrap()).unwrap();
            assert_eq!(back.error.code, c);
        }
        serde_json::from_str::<ErrorCode>("\"no_such_code\"").unwrap_err();
    }

    /// The README's error table documents this table: every code is in it,
    /// with this status and exit code.
    #[test]
    fn readme_error_table_agrees() {
        let readme = include_str!("../../../README.md");
        let by_str: HashMap<&str, ErrorCode> = ErrorCode::ALL
            .into_iter()
            .map(|c| (c.as_str(), c))
            .collect();
        let mut documented = HashSet::new();
        for line in readme.lines().filter(|l| l.starts_with("| `")) {
            let cols: Vec<&str> = line.split('|').map(str::trim).collect();
            let [_, names, http, exit, ..] = cols[..] else {
                continue;
            };
            // the code names are the backticked words before any parenthesis
            let names = names.split(" (").next().unwrap_or_default();
            let codes: Vec<ErrorCode> = names
                .split('`')
                .skip(1)
                .step_by(2)
                .filter_map(|n| by_str.get(n).copied())
                .collect();
            if codes.is_empty() {
                continue;
            }
            // "401 / 403" pairs with "`unauthorized` / `forbidden`"
            let pick = |col: &str, i: usize| -> String {
                let parts: Vec<&str> = col.split(" / ").collect();
                parts.get(i).unwrap_or(&parts[0]).trim().to_owned()
            };
            for (i, c) in codes.iter().enumerate() {
                assert_eq!(pick(http, i), c.http_status().to_string(), "README: {line}");
                assert_eq!(
                    pick(exit, i),
                    c.cli_exit_code().to_string(),
                    "README: {line}"
                );
                documented.insert(*c);
            }
        }
        for c in ErrorCode::ALL {
            assert!(
                documented.contains(&c),
                "README's error table lacks {}",
                c.as_str()
            );
        }
    }
}
