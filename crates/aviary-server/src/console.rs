//! The web console, served by `aviary serve` itself: `GET /` is the
//! single-page app, `GET /console/{path}` its assets, all embedded in the
//! binary at compile time (see `build.rs`; the app lives in `console/`).
//!
//! The console is only static files: it holds no session and adds no
//! privilege. The page calls the v1 API with the API key the user typed, so
//! the API's own authentication and tenant rules decide everything it shows.
//! Every answer here carries a strict Content-Security-Policy (no inline
//! script, same-origin only, never framed) and `nosniff`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));

/// The policy of every console answer: scripts, styles and API calls from
/// this origin only, no inline code, no plugins, never inside a frame.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; object-src 'none'; \
     base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Shown at `/` when the binary was built without `console/dist`.
const NOT_BUILT: &str = "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<title>Aviary console not built</title></head><body><main>\
<h1>The Aviary web console is not built into this binary</h1>\
<p>The API works as usual under <code>/v1</code>. To include the console, run \
<code>scripts/build-console.sh</code> (needs node and npm) and rebuild \
<code>aviary</code> (<code>cargo build --release</code>).</p></main></body></html>\n";

/// The console's routes, to merge into the server's router.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(index))
        .route("/console", get(index))
        .route("/console/", get(index))
        .route("/console/{*path}", get(asset))
}

/// Whether this binary embeds a built console (else `/` explains how to build it).
pub fn is_built() -> bool {
    find("index.html").is_some()
}

fn find(path: &str) -> Option<&'static [u8]> {
    CONSOLE_ASSETS
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, bytes)| *bytes)
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("json" | "map") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("woff2") => "font/woff2",
        Some("txt") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// An answer with the console's security headers.
fn secured(status: StatusCode, content_type: &'static str, body: &'static [u8]) -> Response {
    let mut res = (status, body).into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    // asset names are not content-hashed: revalidate so an upgraded server
    // never runs a stale page against a newer API
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

async fn index() -> Response {
    match find("index.html") {
        Some(bytes) => secured(StatusCode::OK, content_type("index.html"), bytes),
        None => secured(
            StatusCode::OK,
            "text/html; charset=utf-8",
            NOT_BUILT.as_bytes(),
        ),
    }
}

async fn asset(axum::extract::Path(path): axum::extract::Path<String>) -> Response {
    // only the embedded table is ever read: no file system, no traversal
    match find(&path) {
        Some(bytes) => secured(StatusCode::OK, content_type(&path), bytes),
        None => secured(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            b"not found\n",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_by_extension() {
        assert_eq!(content_type("app.js"), "text/javascript; charset=utf-8");
        assert_eq!(content_type("app.css"), "text/css; charset=utf-8");
        assert_eq!(content_type("index.html"), "text/html; charset=utf-8");
        assert_eq!(content_type("x"), "application/octet-stream");
    }

    #[test]
    fn policy_forbids_inline_script_and_framing() {
        assert!(CONTENT_SECURITY_POLICY.starts_with("default-src 'self'"));
        assert!(!CONTENT_SECURITY_POLICY.contains("unsafe-inline"));
        assert!(CONTENT_SECURITY_POLICY.contains("frame-ancestors 'none'"));
    }

    #[test]
    fn no_asset_outside_the_table() {
        assert!(find("../Cargo.toml").is_none());
        assert!(find("/etc/passwd").is_none());
    }
}
