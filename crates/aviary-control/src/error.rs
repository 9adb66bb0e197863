//! The control plane's error type; the HTTP adapter turns it into an answer
//! (status from the code table, `Retry-After` from [`OpError::retry_after_s`]).
//!
//! The code of an error comes from the one table, `aviary_core::ErrorCode`:
//! every layer error names its own code (`RegistryError::code`,
//! `LeaseError::code`, `LockError::code`, `RuntimeError::code`,
//! `EnvdError::code`, `SnapshotError::code`, the template catalog's,
//! `ScopeError::code`, `PlanError::code`; a node agent answers with
//! `RuntimeError::code` too, so a remote runtime's failure arrives as the
//! same `RuntimeError` code as a local one's) and the conversions below only
//! choose the message a client sees ([`OpError::layer`]); the status is
//! always `code.http_status()`. The unit tests check, variant by variant,
//! that a converted error keeps its layer's code.
//!
//! 5xx bodies never carry internals: an `internal` error's cause is logged
//! and the client gets a fixed sentence; the other 5xx codes (`unavailable`,
//! `capacity_exhausted`, `busy`) get a sentence chosen here, their cause is
//! logged.

use aviary_core::{ErrorBody, ErrorCode, ErrorDetail, SandboxState, StateError};
use aviary_envd_proto::EnvdError;
use aviary_leases::{LeaseError, LockError};
use aviary_planner::PlanError;
use aviary_registry::RegistryError;
use aviary_reuse::ScopeError;
use aviary_runtime::RuntimeError;
use aviary_snapshots::SnapshotError;

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
    /// A layer's failure whose code has no variant of its own above
    /// (`not_found` with the layer's sentence, `invalid_state` without a
    /// state, …); built by [`OpError::layer`] only.
    #[error("{message}")]
    Coded { code: ErrorCode, message: String },
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
            OpError::Coded { code, .. } => *code,
            OpError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// Seconds a client should wait before retrying, for the codes that ask for it.
    pub fn retry_after_s(&self) -> Option<u64> {
        match (self, self.code()) {
            (OpError::RateLimited { retry_after_s, .. }, _) => Some(*retry_after_s),
            (_, ErrorCode::Busy) => Some(1),
            (_, ErrorCode::CapacityExhausted) => Some(5),
            _ => None,
        }
    }

    pub fn internal(e: impl Into<anyhow::Error>) -> Self {
        OpError::Internal(e.into())
    }

    /// The error of a layer failure whose code (the layer's `code()`) is
    /// `code`. `message` is the sentence a client sees; for a 5xx code it
    /// must say nothing about internals (the cause is logged here).
    /// `internal` keeps the cause for the log and shows nothing.
    pub fn layer(code: ErrorCode, message: impl Into<String>, cause: anyhow::Error) -> Self {
        if code.is_server_error() && code != ErrorCode::Internal {
            tracing::warn!(
                code = code.as_str(),
                error = format!("{cause:#}"),
                "backend failure"
            );
        }
        let message = message.into();
        match code {
            ErrorCode::InvalidRequest => OpError::InvalidRequest(message),
            ErrorCode::PayloadTooLarge => OpError::PayloadTooLarge(message),
            ErrorCode::Unauthorized => OpError::Unauthorized,
            ErrorCode::Forbidden => OpError::Forbidden(message),
            ErrorCode::InvalidPath => OpError::InvalidPath(message),
            ErrorCode::LeaseRequired => OpError::LeaseRequired,
            ErrorCode::StaleToken => OpError::StaleToken,
            // the plain retry message unless the layer says more
            ErrorCode::Conflict if message.is_empty() => OpError::Conflict,
            ErrorCode::InvalidArchive => OpError::InvalidArchive(message),
            ErrorCode::Unavailable => OpError::Unavailable(message),
            ErrorCode::CapacityExhausted => OpError::CapacityExhausted(message),
            ErrorCode::Busy => OpError::Busy(message),
            ErrorCode::SandboxLost => OpError::SandboxLost(message),
            ErrorCode::PermissionDenied => OpError::PermissionDenied(message),
            ErrorCode::Internal => OpError::Internal(cause),
            code @ (ErrorCode::NotFound
            | ErrorCode::Conflict
            | ErrorCode::LeaseHeld
            | ErrorCode::InvalidState
            | ErrorCode::RateLimited
            | ErrorCode::PortUnreachable
            | ErrorCode::Unsupported) => OpError::Coded { code, message },
        }
    }

    /// Maps a runtime failure through its code, with `action` (what the
    /// control plane asked the runtime to do) in the logged cause:
    /// `.map_err(OpError::runtime("pause"))`.
    pub fn runtime(action: &'static str) -> impl FnOnce(RuntimeError) -> OpError {
        move |e| {
            let (code, message) = (e.code(), runtime_message(&e));
            OpError::layer(code, message, anyhow::Error::new(e).context(action))
        }
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

impl From<RegistryError> for OpError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::NotFound => OpError::NotFound("sandbox".into()),
            RegistryError::IllegalTransition(StateError::IllegalTransition { from, to }) => {
                OpError::InvalidState {
                    state: from,
                    what: format!("it cannot become {to}"),
                }
            }
            e => OpError::layer(e.code(), e.to_string(), e.into()),
        }
    }
}

impl From<LeaseError> for OpError {
    fn from(e: LeaseError) -> Self {
        match e {
            LeaseError::NotFound => OpError::NotFound("sandbox".into()),
            LeaseError::Held { owner, expires_at } => OpError::LeaseHeld {
                owner,
                expires_at: crate::ops::rfc3339(expires_at),
            },
            e => OpError::layer(e.code(), e.to_string(), e.into()),
        }
    }
}

impl From<LockError> for OpError {
    fn from(e: LockError) -> Self {
        OpError::layer(e.code(), e.to_string(), e.into())
    }
}

impl From<RuntimeError> for OpError {
    fn from(e: RuntimeError) -> Self {
        let (code, message) = (e.code(), runtime_message(&e));
        OpError::layer(code, message, e.into())
    }
}

/// What a client may read of a runtime failure (only 4xx codes show the
/// runtime's own message; a 5xx one gets a sentence without internals).
fn runtime_message(e: &RuntimeError) -> String {
    match e {
        RuntimeError::Cleanup { original, .. } => runtime_message(original),
        RuntimeError::CapacityExhausted { .. } => {
            format!("this node cannot host another sandbox now: {e}")
        }
        e if e.code().is_server_error() => {
            "the sandbox runtime is not available right now; retry".into()
        }
        e => e.to_string(),
    }
}

impl From<EnvdError> for OpError {
    fn from(e: EnvdError) -> Self {
        let message = match &e {
            EnvdError::NotFound(p) => format!("path {p} not found"),
            EnvdError::PortUnreachable(m)
            | EnvdError::InvalidPath(m)
            | EnvdError::BadRequest(m)
            | EnvdError::PermissionDenied(m) => m.clone(),
            EnvdError::NoSpace(m) => format!("sandbox disk is full: {m}"),
            EnvdError::Busy => "the sandbox's envd is busy; retry".into(),
            // envd up but unreachable for now (a gone envd is turned into
            // `sandbox_lost` by the control plane before it gets here)
            EnvdError::Connect(_) => "the sandbox's envd is not reachable; retry".into(),
            EnvdError::Transport(_) => "the connection to the sandbox's envd broke; retry".into(),
            EnvdError::Node { .. } => "the sandbox's node cannot reach its envd now; retry".into(),
            // refusals for the caller's input name the sandbox path
            other => other.to_string(),
        };
        OpError::layer(e.code(), message, e.into())
    }
}

impl From<SnapshotError> for OpError {
    fn from(e: SnapshotError) -> Self {
        let message = match &e {
            SnapshotError::Backend { .. } => {
                "the snapshot store is not available right now; retry".into()
            }
            SnapshotError::Corrupt { .. }
            | SnapshotError::InvalidManifest { .. }
            | SnapshotError::PathEscape { .. } => {
                format!("the snapshot cannot be restored: {e}")
            }
            e => e.to_string(),
        };
        OpError::layer(e.code(), message, e.into())
    }
}

impl From<ScopeError> for OpError {
    fn from(e: ScopeError) -> Self {
        OpError::layer(e.code(), format!("scope: {e}"), e.into())
    }
}

impl From<PlanError> for OpError {
    fn from(e: PlanError) -> Self {
        let message = match &e {
            e if e.code().is_server_error() => {
                "the planner cannot reach its model endpoint now; retry".into()
            }
            e => e.to_string(),
        };
        OpError::layer(e.code(), message, e.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::SandboxId;
    use std::time::Duration;

    /// A string no client may ever see: it stands for a host path, a
    /// command line or a storage message.
    const SECRET: &str = "/var/lib/aviary/SECRET-detail";

    fn io() -> std::io::Error {
        std::io::Error::other(SECRET)
    }

    /// The converted error keeps the layer's code, answers with the
    /// table's status, and a 5xx body says nothing of the cause.
    #[track_caller]
    fn check(layer: ErrorCode, e: OpError) {
        assert_eq!(e.code(), layer, "{e:?}");
        let body = e.body(None);
        assert_eq!(body.error.code, layer);
        if layer.is_server_error() {
            assert!(
                !body.error.message.contains("SECRET"),
                "a {} body carries internals: {}",
                layer.as_str(),
                body.error.message
            );
        }
    }

    #[test]
    fn registry_errors_keep_their_codes() {
        let illegal = || {
            RegistryError::IllegalTransition(StateError::IllegalTransition {
                from: SandboxState::Terminated,
                to: SandboxState::Leased,
            })
        };
        // an illegal transition is 409 invalid_state, as in the registry
        assert_eq!(illegal().code(), ErrorCode::InvalidState);
        assert_eq!(illegal().code().http_status(), 409);
        for e in [
            RegistryError::NotFound,
            RegistryError::Conflict,
            illegal(),
            RegistryError::IllegalTransition(StateError::UnknownState("zombie".into())),
            RegistryError::LeaseRequired,
            RegistryError::StaleToken,
            RegistryError::Duplicate,
            RegistryError::Storage(SECRET.into()),
        ] {
            check(e.code(), e.into());
        }
        let e = OpError::from(illegal());
        assert_eq!(
            e.to_string(),
            "sandbox is Terminated: it cannot become Leased"
        );
    }

    #[test]
    fn lease_and_lock_errors_keep_their_codes() {
        for e in [
            LeaseError::NotFound,
            LeaseError::Held {
                owner: "a".into(),
                expires_at: aviary_core::now(),
            },
            LeaseError::LeaseRequired,
            LeaseError::StaleToken,
            LeaseError::InvalidTtl,
            LeaseError::Storage(SECRET.into()),
        ] {
            check(e.code(), e.into());
        }
        for e in [
            LockError::Timeout {
                name: "bucket/x".into(),
                holder: "aviary-server:1".into(),
                waited: Duration::from_secs(1),
            },
            LockError::InvalidTtl,
            LockError::Storage(SECRET.into()),
        ] {
            check(e.code(), e.into());
        }
    }

    #[test]
    fn runtime_errors_map_through_their_code() {
        let id = SandboxId::generate();
        let cases = [
            (RuntimeError::NotFound { id: id.clone() }, 404),
            (RuntimeError::AlreadyExists { id: id.clone() }, 409),
            (
                RuntimeError::Unsupported {
                    what: "gpus".into(),
                },
                400,
            ),
            (
                RuntimeError::InvalidSpec {
                    reason: "no rootfs".into(),
                },
                400,
            ),
            (
                RuntimeError::CapacityExhausted {
                    what: "all user-id ranges are in use".into(),
                },
                503,
            ),
            (
                RuntimeError::ProbeRuntime {
                    reason: SECRET.into(),
                },
                503,
            ),
            (
                RuntimeError::Spawn {
                    program: SECRET.into(),
                    source: io(),
                },
                503,
            ),
            (
                RuntimeError::InvokeRuntime {
                    action: "crun run".into(),
                    detail: SECRET.into(),
                },
                500,
            ),
            (
                RuntimeError::MountOverlay {
                    path: SECRET.into(),
                    source: io(),
                },
                500,
            ),
            (
                RuntimeError::NotFound { id: id.clone() }.with_cleanup(Err(
                    RuntimeError::RemoveDir {
                        path: SECRET.into(),
                        source: io(),
                    },
                )),
                404,
            ),
        ];
        for (e, status) in cases {
            let code = e.code();
            assert_eq!(code.http_status(), status, "{e:?}");
            check(code, e.into());
        }
        // with the action in the logged cause, the same code
        let e = OpError::runtime("pause")(RuntimeError::NotFound { id: id.clone() });
        assert_eq!(e.to_string(), format!("sandbox {id} not found"));
        check(ErrorCode::NotFound, e);
        let e = OpError::runtime("create")(RuntimeError::CapacityExhausted { what: "x".into() });
        assert_eq!(e.retry_after_s(), Some(5));
        assert!(matches!(e, OpError::CapacityExhausted(_)), "{e:?}");
    }

    #[test]
    fn envd_errors_keep_their_codes() {
        for e in [
            EnvdError::Connect(io()),
            EnvdError::Transport(io()),
            EnvdError::NotFound("/a".into()),
            EnvdError::InvalidPath("relative".into()),
            EnvdError::AlreadyExists("/a".into()),
            EnvdError::NotEmpty("/a".into()),
            EnvdError::LeaseRequired,
            EnvdError::StaleToken,
            EnvdError::PermissionDenied("/etc/shadow".into()),
            EnvdError::NotRegularFile("/dev/zero".into()),
            EnvdError::NoSpace("/big".into()),
            EnvdError::PeerMismatch {
                expected: 1,
                got: Some(2),
            },
            EnvdError::BadRequest("bad".into()),
            EnvdError::Busy,
            EnvdError::Remote(SECRET.into()),
            EnvdError::NotReady(Duration::from_secs(1)),
            EnvdError::Node {
                status: 503,
                message: SECRET.into(),
            },
            EnvdError::Node {
                status: 401,
                message: SECRET.into(),
            },
            EnvdError::StreamFinished,
        ] {
            check(e.code(), e.into());
        }
        assert_eq!(OpError::from(EnvdError::Busy).retry_after_s(), Some(1));
    }

    #[test]
    fn snapshot_errors_keep_their_codes() {
        for e in [
            SnapshotError::NotFound {
                what: "snapshot s".into(),
            },
            SnapshotError::Corrupt {
                hash: aviary_snapshots::ChunkHash::of(b"x"),
                detail: "truncated".into(),
            },
            SnapshotError::InvalidManifest {
                id: "m".into(),
                detail: "bad json".into(),
            },
            SnapshotError::PathEscape {
                path: "../etc".into(),
            },
            SnapshotError::InvalidName {
                kind: "snapshot id",
                value: "..".into(),
            },
            SnapshotError::TargetNotEmpty {
                path: SECRET.into(),
            },
            SnapshotError::AccessFile {
                op: "read",
                path: SECRET.into(),
                source: io(),
            },
            SnapshotError::Backend {
                backend: "s3",
                op: SECRET.into(),
                source: Box::new(io()),
            },
        ] {
            check(e.code(), e.into());
        }
        // a damaged snapshot is 409 invalid_state, as restores answered before
        let e = OpError::from(SnapshotError::Corrupt {
            hash: aviary_snapshots::ChunkHash::of(b"x"),
            detail: "truncated".into(),
        });
        assert_eq!(e.code().http_status(), 409);
    }

    #[test]
    fn scope_and_plan_errors_keep_their_codes() {
        for e in [
            ScopeError::MissingTenant,
            ScopeError::MissingSessionId {
                scope: aviary_core::Scope::Session,
            },
            ScopeError::MissingAgent,
        ] {
            check(e.code(), e.into());
        }
        let e = OpError::from(ScopeError::MissingAgent);
        assert_eq!(e.to_string(), "scope: agent scope needs an agent name");
        for e in [
            PlanError::RejectContext("languages must be a list".into()),
            PlanError::RejectCatalog("no classes".into()),
            PlanError::AwaitLlmAnswer { after_ms: 2000 },
            PlanError::ReceiveLlmStatus { status: 502 },
            PlanError::ParseLlmAnswer(SECRET.into()),
            PlanError::ValidateLlmAnswer(SECRET.into()),
        ] {
            check(e.code(), e.into());
        }
        let e = OpError::from(PlanError::RejectContext("bad".into()));
        assert_eq!(e.to_string(), "invalid task context: bad");
    }

    /// Every code can come out of a layer, and answers with its status.
    #[test]
    fn every_code_survives_the_layer_constructor() {
        for code in ErrorCode::ALL {
            let e = OpError::layer(code, "message", anyhow::anyhow!(SECRET));
            check(code, e);
        }
    }
}
