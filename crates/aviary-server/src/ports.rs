//! Sandbox ports through the control plane: `/v1/sandboxes/{id}/ports/{port}/{*path}`
//! (every method) reverse-proxies HTTP/1.1, WebSocket upgrades included, to
//! a server listening on `127.0.0.1:port` inside the sandbox, over an envd
//! port tunnel ([`ControlPlane::connect_port`]): the sandbox needs no network.
//!
//! **Auth.** Either the bearer API key (the sandbox's tenant; another
//! tenant's id is `not_found`), or the sandbox port's *port token*
//! ([`ControlPlane::port_token`], from `GET /v1/sandboxes/{id}/endpoints/{port}`)
//! in the `x-aviary-port-token` header, the `aviary_port_token` cookie, or the
//! `aviary_port_token` query parameter (for a browser: the answer then sets
//! the cookie, scoped to this port's path, and the parameter is not
//! forwarded). While the sandbox is leased the lease token header is needed
//! too (the tunnel is fenced like exec).
//!
//! **What is forwarded.** The method, the path below the port prefix and
//! the query; the headers minus hop-by-hop ones, the caller's
//! `Authorization`, Aviary's own headers and the port-token cookie; plus
//! `x-forwarded-host`, `x-forwarded-proto` and `x-forwarded-prefix`. The
//! request body streams through, at most `max_upload_bytes`. What the
//! sandbox answers is the attacker's: it is parsed by hyper as an HTTP/1.1
//! answer (bounded head), hop-by-hop headers and any cookie named like the
//! port token are dropped, the body streams back; a `101` is passed through
//! only when the caller asked for an upgrade, and then bytes are spliced
//! both ways until either side closes (envd closes an idle tunnel).

use crate::error::ApiError;
use crate::http::{header_token, request_id, AppState, Auth};
use aviary_control::ports::PortRequest;
use aviary_control::{OpContext, OpError};
use aviary_core::api::PortEndpoint;
use aviary_core::ErrorBody;
use axum::body::Body;
use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Version};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Json, Router};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

/// The header a port token travels in.
pub const PORT_TOKEN_HEADER: &str = "x-aviary-port-token";
/// The cookie (and query parameter) a browser's port token travels in.
pub const PORT_TOKEN_COOKIE: &str = "aviary_port_token";

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/sandboxes/{id}/ports/{port}", any(proxy))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(proxy))
        .route("/v1/sandboxes/{id}/ports/{port}/{*path}", any(proxy))
        .route("/v1/sandboxes/{id}/endpoints/{port}", get(endpoint))
}

#[derive(Deserialize)]
pub(crate) struct PortPath {
    id: String,
    port: String,
}

/// The URL and port token of one port of a sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/endpoints/{port}",
    params(("id" = String, Path, description = "sandbox id", max_length = 64),
           ("port" = u16, Path, description = "port inside the sandbox", minimum = 1, maximum = 65535)),
    responses((status = 200, body = PortEndpoint)),
    security(("api_key" = [])))]
pub(crate) async fn endpoint(
    State(st): State<AppState>,
    Auth(caller): Auth,
    Path(p): Path<PortPath>,
    headers: HeaderMap,
) -> Result<Json<PortEndpoint>, ApiError> {
    let target = PortRequest::parse(p.id, &p.port)?;
    let cx = OpContext::new(caller).with_request_id(request_id(&headers));
    let token = st.port_token(&cx, &target).await?;
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.len() <= 255
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .unwrap_or("127.0.0.1");
    let path = format!("/v1/sandboxes/{}/ports/{}/", target.id, target.port);
    Ok(Json(PortEndpoint {
        port: target.port,
        url: format!("http://{host}{path}"),
        browser_url: format!("http://{host}{path}?{PORT_TOKEN_COOKIE}={token}"),
        header: PORT_TOKEN_HEADER.into(),
        token,
    }))
}

/// Reverse proxy to a port inside the sandbox (every method; documented for
/// GET and POST). The answer is the sandbox server's own.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}/{path}",
    params(("id" = String, Path, description = "sandbox id", max_length = 64),
           ("port" = u16, Path, description = "port inside the sandbox", minimum = 1, maximum = 65535),
           ("path" = String, Path, description = "path forwarded to the sandbox's server")),
    responses((status = 200, description = "the sandbox server's answer (any status it gives)"),
              (status = 101, description = "WebSocket (or other) upgrade passed through"),
              (status = 502, description = "nothing listens on the port (`port_unreachable`), or it broke the connection", body = ErrorBody)),
    security(("api_key" = [])))]
#[allow(dead_code)] // only its OpenAPI annotation is used: `proxy` serves every method
pub(crate) async fn proxy_doc() {}

/// The POST form of the proxy (documentation only; every method proxies).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ports/{port}/{path}",
    params(("id" = String, Path, description = "sandbox id", max_length = 64),
           ("port" = u16, Path, description = "port inside the sandbox", minimum = 1, maximum = 65535),
           ("path" = String, Path, description = "path forwarded to the sandbox's server")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "forwarded as it comes"),
    responses((status = 200, description = "the sandbox server's answer (any status it gives)"),
              (status = 502, description = "nothing listens on the port (`port_unreachable`), or it broke the connection", body = ErrorBody)),
    security(("api_key" = [])))]
#[allow(dead_code)] // only its OpenAPI annotation is used
pub(crate) async fn proxy_post_doc() {}

async fn proxy(
    State(st): State<AppState>,
    Path(p): Path<PortPath>,
    req: Request,
) -> Result<Response, ApiError> {
    let target = PortRequest::parse(p.id, &p.port)?;
    let prefix = format!("/v1/sandboxes/{}/ports/{}", target.id, target.port);
    proxy_to(st, target, prefix, req).await
}

/// Host-based routing, as E2B's `sandbox.get_host(port)` spells a port:
/// a request whose `Host` is `{port}-{sandbox id}.{any domain}` goes to
/// that port whatever its path (wildcard DNS for the domain points at this
/// server). Same credentials as the path form.
pub async fn by_host(
    State(st): State<AppState>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    match host_target(req.headers()) {
        Some(target) => proxy_to(st, target, String::new(), req)
            .await
            .unwrap_or_else(IntoResponse::into_response),
        None => next.run(req).await,
    }
}

/// `{port}-{sandbox id}.` at the start of the `Host` header.
fn host_target(h: &HeaderMap) -> Option<PortRequest> {
    let host = h.get(header::HOST)?.to_str().ok()?;
    let (label, _domain) = host.split_once('.')?;
    let (port, id) = label.split_once('-')?;
    if !id.starts_with("sbx-") || port.is_empty() || port.len() > 5 {
        return None;
    }
    PortRequest::parse(id, port).ok()
}

async fn proxy_to(
    st: AppState,
    target: PortRequest,
    prefix: String,
    req: Request,
) -> Result<Response, ApiError> {
    let (mut parts, body) = req.into_parts();
    let (cx, set_cookie) = context(&st, &mut parts, &target).await?;
    let max = st.server.max_upload_bytes;
    let too_large = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > max);
    if too_large {
        return Err(OpError::PayloadTooLarge(format!(
            "a proxied request body is at most {max} bytes"
        ))
        .into());
    }
    let upgrade = wants_upgrade(&parts.headers);
    let client_upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>();
    let out = forwarded_request(&parts, &prefix, upgrade, body, max)?;

    let stream = st.connect_port(&cx, &target).await?;
    let broke = |what: &str| {
        OpError::layer(
            aviary_core::ErrorCode::PortUnreachable,
            format!("the server on port {} {what}", target.port),
            anyhow::anyhow!("proxy to port {}", target.port),
        )
    };
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_ANSWER_HEAD)
        .handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|_| broke("did not take the connection"))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "port tunnel connection ended");
        }
    });
    let mut answer = sender
        .send_request(out)
        .await
        .map_err(|_| broke("closed the connection without a valid HTTP/1.1 answer"))?;

    let mut response = if answer.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade.filter(|_| upgrade) else {
            return Err(broke("switched protocols without being asked to").into());
        };
        let sandbox_upgrade = hyper::upgrade::on(&mut answer);
        tokio::spawn(async move {
            let (Ok(a), Ok(b)) = (client_upgrade.await, sandbox_upgrade.await) else {
                return;
            };
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(a), &mut TokioIo::new(b)).await;
        });
        let (mut head, _) = answer.into_parts();
        clean_answer_headers(&mut head.headers, true);
        Response::from_parts(head, Body::empty())
    } else {
        let (mut head, body) = answer.into_parts();
        clean_answer_headers(&mut head.headers, false);
        Response::from_parts(head, Body::new(body))
    };
    if let Some(token) = set_cookie {
        let cookie = format!("{PORT_TOKEN_COOKIE}={token}; Path={prefix}/; HttpOnly; SameSite=Lax");
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            response.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    Ok(response.into_response())
}

/// Largest answer head (status line and headers) read from the sandbox.
const MAX_ANSWER_HEAD: usize = 64 * 1024;

/// Who the proxied request acts for, and the port token to set as a cookie
/// (when it came in the query).
async fn context(
    st: &AppState,
    parts: &mut Parts,
    target: &PortRequest,
) -> Result<(OpContext, Option<String>), ApiError> {
    let lease = header_token(&parts.headers)?;
    let rid = request_id(&parts.headers);
    if parts.headers.contains_key(header::AUTHORIZATION) {
        let Auth(caller) = Auth::from_request_parts(parts, st).await?;
        return Ok((
            OpContext::new(caller)
                .with_request_id(rid)
                .with_token(lease),
            None,
        ));
    }
    let from_header = parts
        .headers
        .get(PORT_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let from_query = query_token(parts.uri.query());
    let from_cookie = cookie_token(&parts.headers);
    let (token, set_cookie) = match (from_header, from_query, from_cookie) {
        (Some(t), _, _) => (t, false),
        (None, Some(t), _) => (t, true),
        (None, None, Some(t)) => (t, false),
        (None, None, None) => return Err(OpError::Unauthorized.into()),
    };
    let cx = st.authenticate_port_token(target, &token).await?;
    Ok((
        cx.with_request_id(rid).with_token(lease),
        set_cookie.then_some(token),
    ))
}

fn query_token(query: Option<&str>) -> Option<String> {
    query?.split('&').find_map(|kv| {
        kv.strip_prefix(PORT_TOKEN_COOKIE)
            .and_then(|v| v.strip_prefix('='))
            .map(str::to_owned)
    })
}

fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| {
            c.trim()
                .strip_prefix(PORT_TOKEN_COOKIE)
                .and_then(|v| v.strip_prefix('='))
                .map(str::to_owned)
        })
}

/// Headers that describe one hop, never forwarded either way (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn wants_upgrade(h: &HeaderMap) -> bool {
    h.contains_key(header::UPGRADE)
        && h.get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Removes hop-by-hop headers, and the ones `Connection` names.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
}

fn forwarded_request(
    parts: &Parts,
    prefix: &str,
    upgrade: bool,
    body: Body,
    max: u64,
) -> Result<axum::http::Request<Body>, ApiError> {
    let raw = parts.uri.path();
    let rest = raw.strip_prefix(prefix).unwrap_or("/");
    let path = if rest.is_empty() { "/" } else { rest };
    let query: Vec<&str> = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty() && !kv.starts_with(&format!("{PORT_TOKEN_COOKIE}=")))
        .collect();
    let uri = if query.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", query.join("&"))
    };
    let mut headers = parts.headers.clone();
    let upgrade_value = headers.get(header::UPGRADE).cloned();
    strip_hop_by_hop(&mut headers);
    for h in [
        header::AUTHORIZATION.as_str(),
        PORT_TOKEN_HEADER,
        crate::http::LEASE_TOKEN_HEADER,
    ] {
        headers.remove(h);
    }
    let cookies: Vec<String> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|c| !c.is_empty() && !c.starts_with(&format!("{PORT_TOKEN_COOKIE}=")))
        .map(str::to_owned)
        .collect();
    headers.remove(header::COOKIE);
    if !cookies.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&cookies.join("; ")) {
            headers.insert(header::COOKIE, v);
        }
    }
    if upgrade {
        if let Some(u) = upgrade_value {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, u);
        }
    }
    if let Some(host) = parts.headers.get(header::HOST) {
        headers.insert("x-forwarded-host", host.clone());
    }
    headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    match HeaderValue::from_str(prefix) {
        Ok(v) if !prefix.is_empty() => {
            headers.insert("x-forwarded-prefix", v);
        }
        _ => {}
    }
    let limited = http_body_util::Limited::new(body, usize::try_from(max).unwrap_or(usize::MAX));
    let mut out = axum::http::Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .version(Version::HTTP_11)
        .body(Body::new(limited))
        .map_err(|e| OpError::InvalidRequest(format!("cannot forward this request: {e}")))?;
    *out.headers_mut() = headers;
    Ok(out)
}

/// The sandbox's answer headers as the caller gets them: no hop-by-hop
/// headers (but the upgrade pair of a passed-through 101), and no cookie
/// that would replace the caller's port token.
fn clean_answer_headers(h: &mut HeaderMap, switching: bool) {
    let upgrade = h.get(header::UPGRADE).cloned();
    strip_hop_by_hop(h);
    if switching {
        if let Some(u) = upgrade {
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, u);
        }
    }
    let cookies: Vec<HeaderValue> = h
        .get_all(header::SET_COOKIE)
        .iter()
        .filter(|v| {
            !v.to_str()
                .unwrap_or("")
                .trim_start()
                .starts_with(PORT_TOKEN_COOKIE)
        })
        .cloned()
        .collect();
    h.remove(header::SET_COOKIE);
    for c in cookies {
        h.append(header::SET_COOKIE, c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_port_dash_sandbox_hosts_are_routed_by_host() {
        let t = |h: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(header::HOST, HeaderValue::from_static(h));
            host_target(&m).map(|t| (t.port, t.id))
        };
        assert_eq!(
            t("8000-sbx-abc.aviary.test:7400"),
            Some((8000, "sbx-abc".to_owned()))
        );
        for not in [
            "127.0.0.1:7400",
            "localhost",
            "0-sbx-abc.x",
            "99999-sbx-abc.x",
            "8000-abc.x",
            "8000-sbx-abc",
        ] {
            assert_eq!(t(not), None, "{not}");
        }
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn port_token_is_found_in_query_and_cookie_only_by_exact_name() {
        assert_eq!(
            query_token(Some("a=1&aviary_port_token=abc&b=2")).as_deref(),
            Some("abc")
        );
        assert_eq!(query_token(Some("aviary_port_tokenx=abc")), None);
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("x=1; aviary_port_token=def"),
        );
        assert_eq!(cookie_token(&h).as_deref(), Some("def"));
    }

    #[test]
    fn the_sandbox_cannot_replace_the_port_token_cookie() {
        let mut h = HeaderMap::new();
        h.append(
            header::SET_COOKIE,
            HeaderValue::from_static("aviary_port_token=evil; Path=/"),
        );
        h.append(header::SET_COOKIE, HeaderValue::from_static("app=1"));
        clean_answer_headers(&mut h, false);
        let left: Vec<_> = h.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(left, [HeaderValue::from_static("app=1")]);
    }
}
