//! The part of the Connect protocol (connectrpc.com/docs/protocol) the E2B
//! SDKs speak to envd, JSON codec only: unary calls (`application/json`
//! bodies, errors as an HTTP status with `{"code","message"}`) and
//! server-streaming calls (`application/connect+json`: one enveloped
//! request message, enveloped response messages, and an end-of-stream
//! envelope that carries the error, if any).
//!
//! Everything here parses what the caller sent, which is untrusted: an
//! envelope's declared length is checked against a bound before anything
//! is allocated, compressed envelopes are refused (the SDK never sends
//! them), and trailing bytes after the one request message are an error.

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use std::time::Duration;

/// Envelope flag: the payload is compressed (never sent by the SDKs; refused).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream message of a streaming response.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Bytes of an envelope's prefix: one flag byte, a big-endian `u32` length.
pub const ENVELOPE_PREFIX: usize = 5;
/// The content type of a streaming call with the JSON codec. The SDK
/// refuses any parameter on the response's (`; charset=utf-8`).
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";

/// Connect's error codes, written as their snake_case names on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// The HTTP status of a unary error with this code (the protocol's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error: a unary answer, or the end of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(Code::Unimplemented, message)
    }

    /// The end-of-stream envelope that ends a stream with this error.
    pub fn end_stream(&self) -> Bytes {
        end_stream(Some(self))
    }
}

impl IntoResponse for ConnectError {
    /// A unary error, or a streaming call refused before its stream began:
    /// the code's status and the JSON error body.
    fn into_response(self) -> Response {
        let mut r = (self.code.http_status(), axum::Json(&self)).into_response();
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// One envelope around `payload`.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(ENVELOPE_PREFIX + payload.len());
    b.put_u8(flags);
    // a response message is built by this server and always far below 4 GiB
    b.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    b.put_slice(payload);
    b.freeze()
}

/// A message envelope holding `msg` as JSON.
pub fn message<T: Serialize>(msg: &T) -> Bytes {
    // serializing our own response types cannot fail (no maps with non-string keys)
    envelope(
        0,
        &serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec()),
    )
}

/// The end-of-stream envelope: `{}` or `{"error":{…}}`.
pub fn end_stream(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        Some(e) => serde_json::json!({ "error": e }),
        None => serde_json::json!({}),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// The one request message of a server-streaming call: `body` must be
/// exactly one uncompressed message envelope of at most `max` bytes.
pub fn single_message(body: &[u8], max: usize) -> Result<&[u8], ConnectError> {
    if body.len() < ENVELOPE_PREFIX {
        return Err(ConnectError::invalid(
            "the request must be one Connect envelope (5-byte prefix, then the message)",
        ));
    }
    let flags = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(ConnectError::new(
            Code::Internal,
            "compressed request messages are not supported (send connect-content-encoding: identity)",
        ));
    }
    if flags != 0 {
        return Err(ConnectError::invalid(format!(
            "unexpected envelope flags {flags:#04x} on the request message"
        )));
    }
    if len > max {
        return Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("request message of {len} bytes is larger than the limit of {max}"),
        ));
    }
    let rest = &body[ENVELOPE_PREFIX..];
    match rest.len().cmp(&len) {
        std::cmp::Ordering::Less => Err(ConnectError::invalid(format!(
            "request envelope announces {len} bytes but only {} arrived",
            rest.len()
        ))),
        std::cmp::Ordering::Greater => Err(ConnectError::invalid(
            "a server-streaming call takes exactly one request message; more bytes followed it",
        )),
        std::cmp::Ordering::Equal => Ok(rest),
    }
}

/// Parses a request message (proto3 JSON) into `T`, whose unknown fields
/// are refused by its own serde attributes; the error names what was wrong.
pub fn parse<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, ConnectError> {
    if payload.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ConnectError::invalid(
            "the request message must be a JSON object",
        ));
    }
    serde_json::from_slice(payload)
        .map_err(|e| ConnectError::invalid(format!("malformed request message: {e}")))
}

/// The call's deadline from `Connect-Timeout-Ms` (at most 10 digits, as the
/// protocol says); `None` when absent. A malformed value is an error.
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v
        .to_str()
        .ok()
        .filter(|s| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            ConnectError::invalid("connect-timeout-ms must be 1 to 10 decimal digits")
        })?;
    let ms: u64 = s
        .parse()
        .map_err(|_| ConnectError::invalid("connect-timeout-ms is not a number"))?;
    Ok(Some(Duration::from_millis(ms)))
}

/// Refuses a request whose Connect content encoding is not identity (the
/// SDK's is; nothing else is implemented).
pub fn require_identity(headers: &HeaderMap) -> Result<(), ConnectError> {
    for name in ["connect-content-encoding", "content-encoding"] {
        if let Some(v) = headers.get(name) {
            let v = v.to_str().unwrap_or("?").trim();
            if !v.eq_ignore_ascii_case("identity") {
                return Err(ConnectError::unimplemented(format!(
                    "{name} {v:?} is not supported; only identity"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_through_single_message() {
        let env = message(&serde_json::json!({"path": "/tmp"}));
        assert_eq!(env[0], 0);
        let payload = single_message(&env, 1024).unwrap();
        assert_eq!(payload, br#"{"path":"/tmp"}"#);
    }

    #[test]
    fn short_and_truncated_envelopes_are_invalid_arguments() {
        for body in [
            &b""[..],
            &b"\x00\x00\x00"[..],
            &b"\x00\x00\x00\x00\x10{}"[..],
        ] {
            let e = single_message(body, 1024).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{body:?}");
        }
    }

    #[test]
    fn huge_declared_length_is_refused_before_reading() {
        let mut body = vec![0u8, 0xff, 0xff, 0xff, 0xff];
        body.extend_from_slice(b"{}");
        let e = single_message(&body, 1 << 20).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(e.message.contains("4294967295"), "{}", e.message);
    }

    #[test]
    fn trailing_bytes_and_second_messages_are_refused() {
        let mut body = message(&serde_json::json!({})).to_vec();
        body.extend_from_slice(&message(&serde_json::json!({})));
        assert_eq!(
            single_message(&body, 1024).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn compressed_and_end_stream_flags_are_refused() {
        let compressed = envelope(FLAG_COMPRESSED, b"{}");
        assert_eq!(
            single_message(&compressed, 1024).unwrap_err().code,
            Code::Internal
        );
        let eos = envelope(FLAG_END_STREAM, b"{}");
        assert_eq!(
            single_message(&eos, 1024).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn end_stream_carries_the_error_in_connect_form() {
        let e = ConnectError::new(Code::DeadlineExceeded, "too slow");
        let env = e.end_stream();
        assert_eq!(env[0], FLAG_END_STREAM);
        let len = u32::from_be_bytes([env[1], env[2], env[3], env[4]]) as usize;
        assert_eq!(len, env.len() - ENVELOPE_PREFIX);
        let v: serde_json::Value = serde_json::from_slice(&env[ENVELOPE_PREFIX..]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"code": "deadline_exceeded", "message": "too slow"}})
        );
        assert_eq!(&end_stream(None)[ENVELOPE_PREFIX..], b"{}");
    }

    #[test]
    fn parse_refuses_non_objects_and_bad_json() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        struct M {
            #[allow(dead_code)]
            path: String,
        }
        assert_eq!(parse::<M>(b"[]").unwrap_err().code, Code::InvalidArgument);
        assert_eq!(parse::<M>(b"{").unwrap_err().code, Code::InvalidArgument);
        let e = parse::<M>(br#"{"path":"/","bogus":1}"#).unwrap_err();
        assert!(e.message.contains("bogus"), "{}", e.message);
        parse::<M>(br#" {"path":"/"}"#).unwrap();
    }

    #[test]
    fn timeout_header_is_parsed_and_bounded() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout(&h).unwrap(), None);
        h.insert("connect-timeout-ms", HeaderValue::from_static("30000"));
        assert_eq!(timeout(&h).unwrap(), Some(Duration::from_secs(30)));
        for bad in ["", "-1", "12345678901", "1e3", "abc"] {
            h.insert("connect-timeout-ms", HeaderValue::from_static(bad));
            assert_eq!(
                timeout(&h).unwrap_err().code,
                Code::InvalidArgument,
                "{bad}"
            );
        }
    }

    #[test]
    fn only_identity_encoding_is_accepted() {
        let mut h = HeaderMap::new();
        require_identity(&h).unwrap();
        h.insert(
            "connect-content-encoding",
            HeaderValue::from_static("identity"),
        );
        h.insert("content-encoding", HeaderValue::from_static("identity"));
        require_identity(&h).unwrap();
        h.insert("connect-content-encoding", HeaderValue::from_static("gzip"));
        assert_eq!(require_identity(&h).unwrap_err().code, Code::Unimplemented);
    }

    #[test]
    fn unary_errors_use_the_protocol_status_table() {
        let r = ConnectError::new(Code::NotFound, "x").into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            r.headers()[axum::http::header::CONTENT_TYPE],
            "application/json"
        );
        assert_eq!(
            Code::Unauthenticated.http_status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            Code::Unimplemented.http_status(),
            StatusCode::NOT_IMPLEMENTED
        );
    }
}
