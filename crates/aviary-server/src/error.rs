//! Where a control-plane error becomes an HTTP answer: the status comes from
//! the one code table (`ErrorCode::http_status`), the body is the error's
//! public form (a 5xx never carries internals; an `internal` cause is
//! logged here), and codes that ask for a retry carry `Retry-After`.

use aviary_control::OpError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An [`OpError`] on its way to the client.
#[derive(Debug)]
pub struct ApiError(pub OpError);

impl<E: Into<OpError>> From<E> for ApiError {
    fn from(e: E) -> Self {
        ApiError(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let e = self.0;
        if let OpError::Internal(cause) = &e {
            tracing::error!(error = format!("{cause:#}"), "internal error");
        }
        let status = StatusCode::from_u16(e.code().http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let retry_after = e.retry_after_s();
        let mut response = (status, axum::Json(e.body(None))).into_response();
        if let Some(s) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(s),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::ErrorCode;

    #[test]
    fn status_and_retry_after_come_from_the_code_table() {
        for code in ErrorCode::ALL {
            let e = OpError::layer(code, "m", anyhow::anyhow!("/var/lib/aviary/SECRET"));
            let retry = e.retry_after_s();
            let r = ApiError(e).into_response();
            assert_eq!(r.status().as_u16(), code.http_status(), "{code:?}");
            assert_eq!(
                r.headers().get(axum::http::header::RETRY_AFTER).map(|v| v
                    .to_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()),
                retry,
                "{code:?}"
            );
        }
    }
}
