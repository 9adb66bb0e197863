//! The node agent's errors and the one place they become HTTP answers.

use crate::api::{ErrorAnswer, ErrorDetail};
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
}

impl NodeError {
    /// HTTP status and stable error code.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            NodeError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            NodeError::InvalidRequest { .. } => (StatusCode::BAD_REQUEST, "invalid_request"),
            NodeError::FindTemplate { .. } => (StatusCode::BAD_REQUEST, "template_missing"),
            NodeError::FindSandbox { .. } => (StatusCode::NOT_FOUND, "not_found"),
            NodeError::Runtime(e) => runtime_status(e),
            NodeError::ConnectEnvd { .. } => (StatusCode::SERVICE_UNAVAILABLE, "envd_unavailable"),
            NodeError::ImportTemplate(
                aviary_templates::TemplateError::InvalidName(_)
                | aviary_templates::TemplateError::InvalidArchive(_),
            ) => (StatusCode::BAD_REQUEST, "invalid_archive"),
            NodeError::ReceiveUpload(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            NodeError::UploadTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
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
            e => chain(e),
        }
    }
}

fn runtime_status(e: &RuntimeError) -> (StatusCode, &'static str) {
    match e {
        RuntimeError::NotFound { .. } => (StatusCode::NOT_FOUND, "not_found"),
        RuntimeError::AlreadyExists { .. } => (StatusCode::CONFLICT, "already_exists"),
        RuntimeError::Unsupported { .. } => (StatusCode::BAD_REQUEST, "unsupported"),
        RuntimeError::InvalidSpec { .. } => (StatusCode::BAD_REQUEST, "invalid_spec"),
        RuntimeError::ProbeRuntime { .. } | RuntimeError::Spawn { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
        }
        RuntimeError::Cleanup { original, .. } => runtime_status(original),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    }
}

impl IntoResponse for NodeError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if status.is_server_error() {
            tracing::warn!(error = %chain(&self), "node request failed");
        }
        let body = Json(ErrorAnswer {
            error: ErrorDetail {
                code: code.into(),
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
            ),
            (
                NodeError::Runtime(RuntimeError::AlreadyExists { id: id.clone() }),
                409,
                "already_exists",
            ),
            (
                NodeError::Runtime(RuntimeError::Unsupported {
                    what: "network profile \"open\"".into(),
                }),
                400,
                "unsupported",
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
            ),
            (
                NodeError::Runtime(RuntimeError::InvokeRuntime {
                    action: "crun start".into(),
                    detail: "boom".into(),
                }),
                500,
                "internal",
            ),
            (NodeError::Unauthorized, 401, "unauthorized"),
            (
                NodeError::FindTemplate {
                    template: "t".into(),
                },
                400,
                "template_missing",
            ),
            (NodeError::UploadTooLarge { limit_mb: 1 }, 413, "too_large"),
        ];
        for (e, status, code) in cases {
            let (s, a) = answer(e);
            assert_eq!((s.as_u16(), a.error.code.as_str()), (status, code));
        }
        // Unsupported travels bare, so the client rebuilds the same message.
        let (_, a) = answer(NodeError::Runtime(RuntimeError::Unsupported {
            what: "gpu".into(),
        }));
        assert_eq!(a.error.message, "gpu");
    }
}
