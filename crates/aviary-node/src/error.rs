//! The node agent's errors and the one place they become HTTP answers.
//!
//! Status and code come from the control plane's one table
//! (`aviary_core::ErrorCode`): a runtime failure answers with
//! `RuntimeError::code()`, exactly as it would on the control plane's own
//! node, and [`crate::RemoteRuntime`] rebuilds an error of the same code
//! from the answer. `kind` names the failure more finely where the code
//! alone does not say which runtime error it was.

use crate::api::{ErrorAnswer, ErrorDetail};
use aviary_core::ErrorCode;
use aviary_runtime::conformance::chain;
use aviary_runtime::RuntimeError;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Failures of the node agent. Messages never repeat the `#[source]`.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("missing or wrong node token")]
    Unauthorized,
    #[error("{reason}")]
    InvalidRequest { reason: String },
    #[error("template {template} is not on this node")]
    FindTemplate { template: String },
    #[error("sandbox {id} not found on this node")]
    FindSandbox { id: String },
    #[error("runtime")]
    Runtime(#[from] RuntimeError),
    #[error("template store")]
    ListTemplates(#[source] aviary_templates::TemplateError),
    #[error("import template")]
    ImportTemplate(#[source] aviary_templates::TemplateError),
    #[error("receive upload")]
    ReceiveUpload(#[source] axum::Error),
    #[error("upload exceeds {limit_mb} MiB")]
    UploadTooLarge { limit_mb: u64 },
    #[error("connect to envd of sandbox {id}")]
    ConnectEnvd {
        id: String,
        #[source]
        source: std::io::Error,
    },
    #[error("write node state {path:?}")]
    WriteState {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read node state {path:?}")]
    ReadState {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("listen on {addr}")]
    BindListener {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("blocking task")]
    JoinTask(#[source] tokio::task::JoinError),
    #[error("snapshot layers")]
    Layers(#[source] aviary_snapshots::SnapshotError),
}

impl NodeError {
    /// The stable error code of this failure, from the control plane's one
    /// table: a runtime failure keeps [`RuntimeError::code`], so a failure
    /// on a remote node answers the same as on the local one.
    pub fn code(&self) -> ErrorCode {
        match self {
            NodeError::Unauthorized => ErrorCode::Unauthorized,
            NodeError::InvalidRequest { .. }
            | NodeError::FindTemplate { .. }
            | NodeError::ReceiveUpload(_) => ErrorCode::InvalidRequest,
            NodeError::FindSandbox { .. } => ErrorCode::NotFound,
            NodeError::Runtime(e) => e.code(),
            NodeError::ListTemplates(e) | NodeError::ImportTemplate(e) => e.code(),
            NodeError::UploadTooLarge { .. } => ErrorCode::PayloadTooLarge,
            NodeError::ConnectEnvd { .. } => ErrorCode::Unavailable,
            NodeError::Layers(e) => e.code(),
            NodeError::WriteState { .. }
            | NodeError::ReadState { .. }
            | NodeError::BindListener { .. }
            | NodeError::JoinTask(_) => ErrorCode::Internal,
        }
    }

    /// The HTTP status of the answer: the code's, from the table.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code().http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The finer name of the failure (`ErrorDetail::kind`), where
    /// [`crate::RemoteRuntime`] needs more than the code to rebuild the
    /// same error.
    pub fn kind(&self) -> Option<&'static str> {
        match self {
            NodeError::FindTemplate { .. } => Some("template_missing"),
            NodeError::ConnectEnvd { .. } => Some("envd_unavailable"),
            NodeError::Runtime(e) => runtime_kind(e),
            _ => None,
        }
    }

    /// The message sent to the caller. The node API is internal and
    /// authenticated: 5xx messages carry the error chain so that the control
    /// plane can log it (it must not forward them to its own clients).
    fn message(&self) -> String {
        match self {
            // Sent bare, so that RemoteRuntime rebuilds the same variant.
            NodeError::Runtime(RuntimeError::Unsupported { what }) => what.clone(),
            NodeError::Runtime(RuntimeError::InvalidSpec { reason }) => reason.clone(),
            NodeError::Runtime(RuntimeError::CapacityExhausted { what }) => what.clone(),
            e => chain(e),
        }
    }
}

fn runtime_kind(e: &RuntimeError) -> Option<&'static str> {
    match e {
        RuntimeError::AlreadyExists { .. } => Some("already_exists"),
        RuntimeError::Unsupported { .. } => Some("unsupported"),
        RuntimeError::InvalidSpec { .. } => Some("invalid_spec"),
        RuntimeError::Cleanup { original, .. } => runtime_kind(original),
        _ => None,
    }
}

impl IntoResponse for NodeError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(error = %chain(&self), "node request failed");
        }
        let body = Json(ErrorAnswer {
            error: ErrorDetail {
                code: self.code().as_str().into(),
                kind: self.kind().map(str::to_owned),
                message: self.message(),
            },
        });
        if status == StatusCode::UNAUTHORIZED {
            return (status, [(header::WWW_AUTHENTICATE, "Bearer")], body).into_response();
        }
        (status, body).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::SandboxId;

    fn answer(e: NodeError) -> (StatusCode, ErrorAnswer) {
        let resp = e.into_response();
        let status = resp.status();
        let body = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(axum::body::to_bytes(resp.into_body(), 1 << 16))
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[test]
    fn runtime_errors_keep_their_meaning_on_the_wire() {
        let id = SandboxId::generate();
        let cases = [
            (
                NodeError::Runtime(RuntimeError::NotFound { id: id.clone() }),
                404,
                "not_found",
                None,
            ),
            (
                NodeError::Runtime(RuntimeError::AlreadyExists { id: id.clone() }),
                409,
                "conflict",
                Some("already_exists"),
            ),
            (
                NodeError::Runtime(RuntimeError::Unsupported {
                    what: "network profile \"open\"".into(),
                }),
                400,
                "invalid_request",
                Some("unsupported"),
            ),
            (
                NodeError::Runtime(RuntimeError::InvalidSpec {
                    reason: "no rootfs".into(),
                }),
                400,
                "invalid_request",
                Some("invalid_spec"),
            ),
            (
                NodeError::Runtime(RuntimeError::NotFound { id: id.clone() }.with_cleanup(Err(
                    RuntimeError::InvokeRuntime {
                        action: "crun delete".into(),
                        detail: "x".into(),
                    },
                ))),
                404,
                "not_found",
                None,
            ),
            (
                NodeError::Runtime(RuntimeError::InvokeRuntime {
                    action: "crun start".into(),
                    detail: "boom".into(),
                }),
                500,
                "internal",
                None,
            ),
            // a full host is a retryable 503 here as on the local node
            // (it once was a 500 on a remote node)
            (
                NodeError::Runtime(RuntimeError::CapacityExhausted {
                    what: "all user-id ranges are in use".into(),
                }),
                503,
                "capacity_exhausted",
                None,
            ),
            (
                NodeError::Runtime(RuntimeError::ProbeRuntime {
                    reason: "crun missing".into(),
                }),
                503,
                "unavailable",
                None,
            ),
            (NodeError::Unauthorized, 401, "unauthorized", None),
            (
                NodeError::FindTemplate {
                    template: "t".into(),
                },
                400,
                "invalid_request",
                Some("template_missing"),
            ),
            (
                NodeError::UploadTooLarge { limit_mb: 1 },
                413,
                "payload_too_large",
                None,
            ),
            (
                NodeError::ImportTemplate(aviary_templates::TemplateError::InvalidArchive(
                    "not a tarball".into(),
                )),
                400,
                "invalid_archive",
                None,
            ),
            (
                NodeError::ConnectEnvd {
                    id: id.to_string(),
                    source: std::io::Error::other("refused"),
                },
                503,
                "unavailable",
                Some("envd_unavailable"),
            ),
        ];
        for (e, status, code, kind) in cases {
            let (s, a) = answer(e);
            assert_eq!(
                (s.as_u16(), a.error.code.as_str(), a.error.kind.as_deref()),
                (status, code, kind)
            );
        }
        // Unsupported and capacity travel bare, so the client rebuilds the
        // same message.
        let (_, a) = answer(NodeError::Runtime(RuntimeError::Unsupported {
            what: "gpu".into(),
        }));
        assert_eq!(a.error.message, "gpu");
        let (_, a) = answer(NodeError::Runtime(RuntimeError::CapacityExhausted {
            what: "no ranges".into(),
        }));
        assert_eq!(a.error.message, "no ranges");
    }

    /// Every runtime failure answers with the status and code the control
    /// plane gives the same failure of its local runtime.
    #[test]
    fn runtime_errors_answer_with_their_code() {
        let id = SandboxId::generate();
        let io = || std::io::Error::other("x");
        for e in [
            RuntimeError::NotFound { id: id.clone() },
            RuntimeError::AlreadyExists { id: id.clone() },
            RuntimeError::Unsupported { what: "x".into() },
            RuntimeError::InvalidSpec { reason: "x".into() },
            RuntimeError::ProbeRuntime { reason: "x".into() },
            RuntimeError::CapacityExhausted { what: "x".into() },
            RuntimeError::Spawn {
                program: "crun".into(),
                source: io(),
            },
            RuntimeError::InvokeRuntime {
                action: "x".into(),
                detail: "x".into(),
            },
            RuntimeError::ParseState { detail: "x".into() },
        ] {
            let code = e.code();
            let (s, a) = answer(NodeError::Runtime(e));
            assert_eq!(s.as_u16(), code.http_status());
            assert_eq!(a.error.code, code.as_str());
        }
    }
}
