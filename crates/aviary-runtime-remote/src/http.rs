//! What every provider client shares: one bounded way to read an answer,
//! errors without URLs and fit for a message, and the check of a provider's
//! sandbox id before it goes into a path or a host name.

use crate::RemoteError;
use std::time::Duration;

/// Largest JSON answer read from a provider.
pub const MAX_ANSWER: usize = 4 << 20;

/// The HTTP client every provider client uses: HTTP/1.1 only (upgrades),
/// no redirects (a key never follows one elsewhere), a connect timeout.
pub fn client() -> Result<reqwest::Client, RemoteError> {
    reqwest::Client::builder()
        .http1_only()
        .connect_timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| RemoteError::Setup(e.to_string()))
}

/// A remote sandbox id: the service's own, so checked before it is put in a
/// path or a host name.
pub fn check_remote_id(id: &str) -> Result<(), RemoteError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(RemoteError::Protocol {
            action: "read a sandbox id".into(),
            detail: format!("{:?} is not a sandbox id", clean(id)),
        })
    }
}

/// A message from the service, fit for an error: at most 300 characters,
/// no control characters.
pub fn clean(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control())
        .take(300)
        .collect::<String>()
}

/// Sends a request; a transport failure is `Unreachable`.
pub async fn send(
    action: &str,
    req: reqwest::RequestBuilder,
) -> Result<reqwest::Response, RemoteError> {
    req.send().await.map_err(|e| unreachable(action, &e))
}

/// A transport failure.
pub fn unreachable(action: &str, e: &reqwest::Error) -> RemoteError {
    RemoteError::Unreachable {
        action: action.into(),
        detail: clean(&without_url(e)),
    }
}

/// The body of a successful answer (bounded), or the service's refusal.
pub async fn body(action: &str, resp: reqwest::Response) -> Result<Vec<u8>, RemoteError> {
    let status = resp.status();
    let bytes = read_bounded(action, resp, MAX_ANSWER).await?;
    if status.is_success() {
        return Ok(bytes);
    }
    Err(RemoteError::from_status(action, status.as_u16(), &bytes))
}

/// `body` parsed as JSON.
pub fn json<T: serde::de::DeserializeOwned>(action: &str, body: &[u8]) -> Result<T, RemoteError> {
    serde_json::from_slice(body).map_err(|e| RemoteError::Protocol {
        action: action.into(),
        detail: format!("unexpected answer: {e}"),
    })
}

/// A reqwest error without its URL (which names the service's hosts, fine,
/// but never a key: keys travel in headers only) and with its causes.
pub fn without_url(e: &reqwest::Error) -> String {
    let mut s = if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        "connection failed".to_owned()
    } else if e.is_body() || e.is_decode() {
        "reading the answer failed".to_owned()
    } else {
        "request failed".to_owned()
    };
    let mut cur = std::error::Error::source(e);
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The whole body, refused past `max` bytes.
pub async fn read_bounded(
    action: &str,
    mut resp: reqwest::Response,
    max: usize,
) -> Result<Vec<u8>, RemoteError> {
    let mut out = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                if out.len() + c.len() > max {
                    return Err(RemoteError::Protocol {
                        action: action.into(),
                        detail: format!("answer larger than {max} bytes"),
                    });
                }
                out.extend_from_slice(&c);
            }
            Ok(None) => return Ok(out),
            Err(e) => return Err(unreachable(action, &e)),
        }
    }
}
