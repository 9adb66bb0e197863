//! Where an error becomes an OpenSandbox answer: the status comes from
//! Aviary's one code table (`ErrorCode::http_status`), the body is the
//! OpenSandbox shape `{"code": "STRING", "message": "…"}` (the SDK parses
//! every 4xx/5xx body as JSON; a text body turns a 404 into a confusing
//! client-side parse error). The code string is Aviary's stable code in
//! upper case (`NOT_FOUND`, `LEASE_REQUIRED`, …). 5xx bodies never carry
//! internals.

use aviary_control::OpError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error on its way to an OpenSandbox client.
#[derive(Debug)]
pub enum OsbError {
    /// A control-plane operation's error.
    Op(OpError),
    /// Something this surface does not serve (`501`), with what to do instead.
    NotSupported(String),
}

impl From<OpError> for OsbError {
    fn from(e: OpError) -> Self {
        OsbError::Op(e)
    }
}

impl OsbError {
    /// A `400 INVALID_REQUEST`.
    pub fn invalid(message: impl Into<String>) -> Self {
        OsbError::Op(OpError::InvalidRequest(message.into()))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            OsbError::Op(e) => StatusCode::from_u16(e.code().http_status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            OsbError::NotSupported(_) => StatusCode::NOT_IMPLEMENTED,
        }
    }

    /// The body's `code`.
    pub fn code(&self) -> String {
        match self {
            OsbError::Op(e) => e.code().as_str().to_ascii_uppercase(),
            OsbError::NotSupported(_) => "NOT_SUPPORTED".into(),
        }
    }

    /// The body's `message` (an internal error's cause is logged, not sent).
    pub fn message(&self) -> String {
        match self {
            OsbError::Op(e) => e.public_message(),
            OsbError::NotSupported(m) => m.clone(),
        }
    }
}

impl IntoResponse for OsbError {
    fn into_response(self) -> Response {
        if let OsbError::Op(OpError::Internal(cause)) = &self {
            tracing::error!(error = format!("{cause:#}"), "internal error");
        }
        let mut response = (
            self.status(),
            axum::Json(serde_json::json!({"code": self.code(), "message": self.message()})),
        )
            .into_response();
        if let OsbError::Op(e) = &self {
            if let Some(s) = e.retry_after_s() {
                response.headers_mut().insert(
                    axum::http::header::RETRY_AFTER,
                    axum::http::HeaderValue::from(s),
                );
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_are_code_string_and_message() {
        let r = OsbError::from(OpError::NotFound("sandbox sbx-1".into())).into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["code"], "NOT_FOUND");
        assert_eq!(v["message"], "sandbox sbx-1 not found");
    }

    #[tokio::test]
    async fn internal_errors_do_not_leak() {
        let e = OpError::internal(std::io::Error::other("/var/lib/aviary/SECRET"));
        let r = OsbError::from(e).into_response();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        assert!(!String::from_utf8_lossy(&body).contains("SECRET"));
    }
}
