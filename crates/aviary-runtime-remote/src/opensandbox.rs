//! The client of an OpenSandbox-compatible service (an OpenSandbox server,
//! or another Aviary's `/opensandbox` surface): its lifecycle API under
//! `{url}/v1` (`OPEN-SANDBOX-API-KEY`), each sandbox's execd (reached at the
//! endpoint the lifecycle API gives for port 44772, with that endpoint's
//! headers and never the API key), and the endpoint of envd's bridge port
//! (the same API, port [`BRIDGE_PORT`]), where the relay opens its HTTP/1.1
//! upgrades.
//!
//! A create is asynchronous in OpenSandbox (`202`, `Pending` → `Running`),
//! and so are pause (`Pausing` → `Paused`) and resume (`Resuming` →
//! `Running`): each call here polls the sandbox until it is there, within
//! [`OsbEndpoint::ready_timeout`], so the runtime's callers see a finished
//! transition. A create that fails after the service made the sandbox kills
//! it before it returns.
//!
//! Everything the service answers is parsed with bounds: JSON answers of at
//! most [`MAX_ANSWER`] bytes, command events of at most [`MAX_EVENT`], a
//! command's output capped at [`MAX_OUTPUT`] per stream, listings at most
//! [`MAX_PAGES`] pages; an endpoint must be a plain `host[:port][/path]`
//! with at most [`MAX_HEADERS`] well-formed headers; every call has a
//! timeout. Error messages are cut and stripped of control characters. The
//! API key and the endpoints' headers are never printed (`Debug` redacts
//! them).

pub use crate::http::MAX_ANSWER;
use crate::http::{self, body, check_remote_id, clean, json, read_bounded, send, unreachable};
use crate::relay::{BRIDGE_PORT, PROTOCOL, SECRET_HEADER};
use crate::{CreateRemote, Provider, RemoteError, RemoteState, RunOutput};
use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The lifecycle API's key header.
pub const API_KEY_HEADER: &str = "open-sandbox-api-key";
/// execd's port in every OpenSandbox sandbox.
pub const EXECD_PORT: u16 = 44772;
/// Largest command event read.
pub const MAX_EVENT: usize = 1 << 20;
/// Output of a setup command kept (per stream).
pub const MAX_OUTPUT: usize = 64 * 1024;
/// Pages of a listing read at most.
pub const MAX_PAGES: usize = 100;
/// Sandboxes asked for per page.
const PAGE_SIZE: usize = 100;
/// Most headers an endpoint may carry.
pub const MAX_HEADERS: usize = 16;
/// How often a transition is looked at.
const POLL: Duration = Duration::from_millis(250);
/// Uploads (envd is a few MiB) get at least this long.
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(300);
/// The states a listing asks for: every sandbox that still holds compute.
const LIVE_STATES: [&str; 6] = [
    "Pending", "Running", "Pausing", "Paused", "Resuming", "Failed",
];

/// Where and how to reach the service.
#[derive(Clone)]
pub struct OsbEndpoint {
    /// The server, `http(s)://host[:port][/prefix]` without a trailing
    /// slash: the lifecycle API is `{url}/v1`, and its scheme is the one
    /// every endpoint is reached with (as the SDK's `protocol`).
    pub url: String,
    pub api_key: String,
    /// Longest one call may take.
    pub request_timeout: Duration,
    /// Longest a create, pause or resume may take to finish.
    pub ready_timeout: Duration,
    /// Ask for a network policy that denies all egress (the sandbox then
    /// has no network, as runtime profile `none` says). Needs a service
    /// with OpenSandbox's egress sidecar; Aviary's own surface refuses the
    /// field (its sandboxes have no network unless their class says so).
    pub deny_egress: bool,
}

impl std::fmt::Debug for OsbEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OsbEndpoint")
            .field("url", &self.url)
            .field("api_key", &"<redacted>")
            .field("request_timeout", &self.request_timeout)
            .field("ready_timeout", &self.ready_timeout)
            .field("deny_egress", &self.deny_egress)
            .finish()
    }
}

/// Where one port of a sandbox answers: a base URL (scheme included) and
/// the headers every request to it carries.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PortEndpoint {
    pub url: String,
    pub headers: BTreeMap<String, String>,
}

impl std::fmt::Debug for PortEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortEndpoint")
            .field("url", &self.url)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A sandbox the service created: what reaching it needs.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct OsbSandbox {
    pub remote_id: String,
    /// execd (port 44772).
    pub execd: PortEndpoint,
    /// envd's bridge ([`BRIDGE_PORT`]) as the service gave it at create,
    /// if it did (a service may give a port's endpoint only once something
    /// listens there); looked up again when it is missing or stops
    /// answering (a resumed sandbox may move).
    #[serde(default)]
    pub bridge: Option<PortEndpoint>,
}

impl std::fmt::Debug for OsbSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OsbSandbox")
            .field("remote_id", &self.remote_id)
            .finish_non_exhaustive()
    }
}

/// The client. Cheap to clone (clones share the bridge endpoints learnt).
#[derive(Clone, Debug)]
pub struct OsbClient {
    ep: OsbEndpoint,
    http: reqwest::Client,
    /// Bridge endpoints looked up after create, per remote id (the
    /// record keeps the one of create); never held across an await.
    bridges: Arc<Mutex<HashMap<String, PortEndpoint>>>,
}

#[derive(Deserialize)]
struct SandboxJson {
    id: String,
    #[serde(default)]
    status: Option<StatusJson>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct StatusJson {
    #[serde(default)]
    state: Option<String>,
}

impl SandboxJson {
    fn state(&self) -> Option<&str> {
        self.status.as_ref()?.state.as_deref()
    }
}

#[derive(Deserialize)]
struct PageJson {
    items: Vec<SandboxJson>,
    #[serde(default)]
    pagination: Option<PaginationJson>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PaginationJson {
    #[serde(default)]
    has_next_page: bool,
}

#[derive(Deserialize)]
struct EndpointJson {
    endpoint: String,
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
}

/// What the service says about a sandbox's lifecycle, as the runtime sees it.
pub fn parse_state(action: &str, s: Option<&str>) -> Result<Option<RemoteState>, RemoteError> {
    Ok(Some(match s {
        // coming up: the runtime's create waited for Running, so only a
        // resume in flight is seen here
        Some("Running" | "Pending" | "Resuming") => RemoteState::Running,
        Some("Paused" | "Pausing") => RemoteState::Paused,
        Some("Failed") => RemoteState::Stopped,
        Some("Stopping" | "Terminated") => return Ok(None),
        other => {
            return Err(RemoteError::Protocol {
                action: action.into(),
                detail: format!("unknown sandbox state {:?}", other.map(clean)),
            })
        }
    }))
}

/// An endpoint as the service hands it out (`host[:port][/path]`, no
/// scheme; a scheme of its own is kept), checked: no user info, query,
/// fragment, spaces or control characters; headers well-formed, never
/// hop-by-hop or framing ones, at most [`MAX_HEADERS`].
pub fn parse_endpoint(
    action: &str,
    scheme: &str,
    raw: &str,
    headers: BTreeMap<String, String>,
) -> Result<PortEndpoint, RemoteError> {
    let bad = |detail: String| RemoteError::Protocol {
        action: action.into(),
        detail,
    };
    let (scheme, rest) = match raw.split_once("://") {
        Some((s @ ("http" | "https"), rest)) => (s, rest),
        Some(_) => {
            return Err(bad(format!(
                "endpoint {:?} has an unknown scheme",
                clean(raw)
            )))
        }
        None => (scheme, raw),
    };
    let rest = rest.trim_end_matches('/');
    let host = rest.split('/').next().unwrap_or_default();
    let plain = !host.is_empty()
        && rest.len() <= 512
        && rest.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'.' | b'-' | b'_' | b':' | b'[' | b']' | b'/' | b'~' | b'%'
                )
        });
    if !plain {
        return Err(bad(format!(
            "endpoint {:?} is not host[:port][/path]",
            clean(raw)
        )));
    }
    if headers.len() > MAX_HEADERS {
        return Err(bad(format!("an endpoint with {} headers", headers.len())));
    }
    const REFUSED: [&str; 10] = [
        "host",
        "connection",
        "upgrade",
        "content-length",
        "transfer-encoding",
        "te",
        "trailer",
        "keep-alive",
        "proxy-authorization",
        SECRET_HEADER,
    ];
    for (k, v) in &headers {
        let name = reqwest::header::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
            bad(format!(
                "endpoint header {:?} is not a header name",
                clean(k)
            ))
        })?;
        if REFUSED.contains(&name.as_str()) || v.len() > 4096 {
            return Err(bad(format!(
                "endpoint header {:?} is not accepted",
                clean(k)
            )));
        }
        reqwest::header::HeaderValue::from_str(v)
            .map_err(|_| bad(format!("endpoint header {:?} has a bad value", clean(k))))?;
    }
    Ok(PortEndpoint {
        url: format!("{scheme}://{rest}"),
        headers,
    })
}

/// The multipart body of one upload: a `metadata` part (path, mode as
/// octal digits) and the `file` part, as execd pairs them; the boundary is
/// random and not in `data`.
pub fn upload_body(path: &str, data: &[u8], mode: u32) -> (String, Vec<u8>) {
    let boundary = loop {
        let b = format!("aviary-{}", hex::encode(rand::random::<[u8; 16]>()));
        if !data.windows(b.len()).any(|w| w == b.as_bytes()) {
            break b;
        }
    };
    // execd reads the mode's decimal digits as octal (755 → 0o755)
    let digits: u64 = format!("{:o}", mode & 0o7777).parse().unwrap_or(644);
    let meta = json!({ "path": path, "mode": digits });
    let name = path.rsplit('/').next().unwrap_or("file");
    let mut out = Vec::with_capacity(data.len() + 512);
    out.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\
             Content-Type: application/json\r\n\r\n{meta}\r\n--{boundary}\r\n\
             Content-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    out.extend_from_slice(data);
    out.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), out)
}

/// A CPU quantity as OpenSandbox spells it: whole cores, else millicores.
pub fn cpu_quantity(cores: f64) -> String {
    let milli = (cores * 1000.0).round().max(1.0) as u64;
    if milli.is_multiple_of(1000) {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }
}

/// Reads execd's command events (bare JSON objects or SSE `data:` lines,
/// each ended by a blank line) into a [`RunOutput`].
#[derive(Default)]
pub struct CommandEvents {
    buf: Vec<u8>,
    pub out: RunOutput,
}

impl CommandEvents {
    /// Takes more of the stream; `true` once the command's end was read.
    pub fn push(&mut self, action: &str, chunk: &[u8]) -> Result<bool, RemoteError> {
        // a raw CR is never inside a JSON text: dropping it makes CRLF
        // framing plain LF
        self.buf
            .extend(chunk.iter().copied().filter(|b| *b != b'\r'));
        while let Some(at) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let block: Vec<u8> = self.buf.drain(..at + 2).collect();
            if self.event(action, &block[..at])? {
                return Ok(true);
            }
        }
        if self.buf.len() > MAX_EVENT {
            return Err(RemoteError::Protocol {
                action: action.into(),
                detail: format!("a command event larger than {MAX_EVENT} bytes"),
            });
        }
        Ok(false)
    }

    /// The stream ended: the last event may lack its blank line.
    pub fn finish(&mut self, action: &str) -> Result<bool, RemoteError> {
        let rest = std::mem::take(&mut self.buf);
        self.event(action, &rest)
    }

    fn event(&mut self, action: &str, block: &[u8]) -> Result<bool, RemoteError> {
        let bad = |detail: String| RemoteError::Protocol {
            action: action.into(),
            detail,
        };
        let text =
            std::str::from_utf8(block).map_err(|_| bad("a command event is not UTF-8".into()))?;
        let text = text.trim();
        if text.is_empty() {
            return Ok(false);
        }
        let payload = if text.starts_with('{') {
            text.to_owned()
        } else {
            // SSE: data lines joined; comments and other fields skipped
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect::<Vec<_>>()
                .join("\n")
        };
        if payload.trim().is_empty() {
            return Ok(false);
        }
        let v: Value =
            serde_json::from_str(&payload).map_err(|e| bad(format!("command event: {e}")))?;
        let kind = v.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "stdout" | "stderr" => {
                let sink = if kind == "stdout" {
                    &mut self.out.stdout
                } else {
                    &mut self.out.stderr
                };
                let t = v.get("text").and_then(Value::as_str).unwrap_or_default();
                let room = MAX_OUTPUT.saturating_sub(sink.len());
                sink.extend_from_slice(&t.as_bytes()[..t.len().min(room)]);
                Ok(false)
            }
            "execution_complete" => {
                self.out.exit_code = 0;
                Ok(true)
            }
            "error" => {
                let evalue = v
                    .pointer("/error/evalue")
                    .and_then(|e| match e {
                        Value::String(s) => Some(s.clone()),
                        Value::Number(n) => Some(n.to_string()),
                        _ => None,
                    })
                    .unwrap_or_default();
                match evalue.trim().parse::<i32>() {
                    // execd reports a non-zero exit as an error whose value
                    // is the code
                    Ok(code) => {
                        self.out.exit_code = code;
                        Ok(true)
                    }
                    Err(_) => Err(RemoteError::Refused {
                        action: action.into(),
                        status: 0,
                        message: format!("the command did not run: {}", clean(&evalue)),
                    }),
                }
            }
            // init, ping, status, execution_count, anything newer
            _ => Ok(false),
        }
    }
}

impl OsbClient {
    pub fn new(ep: OsbEndpoint) -> Result<OsbClient, RemoteError> {
        if !(ep.url.starts_with("http://") || ep.url.starts_with("https://")) {
            return Err(RemoteError::Setup(format!(
                "the OpenSandbox URL {:?} is not http(s)://",
                clean(&ep.url)
            )));
        }
        Ok(OsbClient {
            ep,
            http: http::client()?,
            bridges: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    pub fn endpoint(&self) -> &OsbEndpoint {
        &self.ep
    }

    /// The scheme every endpoint is reached with.
    fn scheme(&self) -> &'static str {
        if self.ep.url.starts_with("https://") {
            "https"
        } else {
            "http"
        }
    }

    fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}/v1{path}", self.ep.url))
            .header(API_KEY_HEADER, &self.ep.api_key)
            .timeout(self.ep.request_timeout)
    }

    fn at(
        &self,
        ep: &PortEndpoint,
        method: reqwest::Method,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .request(method, format!("{}{path}", ep.url))
            .timeout(self.ep.request_timeout);
        for (k, v) in &ep.headers {
            req = req.header(k, v);
        }
        req
    }

    /// `POST /v1/sandboxes`: the new sandbox's id (it may still be `Pending`).
    async fn create_sandbox(&self, req: &CreateRemote<'_>) -> Result<String, RemoteError> {
        let action = "create a sandbox";
        let mut body_json = json!({
            "image": {"uri": req.template},
            "timeout": req.timeout_s,
            "resourceLimits": {
                "cpu": cpu_quantity(req.resources.cpu),
                "memory": format!("{}Mi", req.resources.memory_mb),
            },
            "metadata": req.metadata,
            "entrypoint": ["tail", "-f", "/dev/null"],
        });
        if self.ep.deny_egress {
            body_json["networkPolicy"] = json!({"defaultAction": "deny", "egress": []});
        }
        let resp = send(
            action,
            self.api(reqwest::Method::POST, "/sandboxes")
                .json(&body_json),
        )
        .await?;
        let created: SandboxJson = json(action, &body(action, resp).await?)?;
        check_remote_id(&created.id)?;
        Ok(created.id)
    }

    /// `GET /v1/sandboxes/{id}`: its state name, `None` for a 404.
    async fn get(&self, action: &str, remote_id: &str) -> Result<Option<String>, RemoteError> {
        check_remote_id(remote_id)?;
        let resp = send(
            action,
            self.api(reqwest::Method::GET, &format!("/sandboxes/{remote_id}")),
        )
        .await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let d: SandboxJson = json(action, &body(action, resp).await?)?;
        if d.id != remote_id {
            return Err(RemoteError::Protocol {
                action: action.into(),
                detail: format!("asked for {remote_id}, got {:?}", clean(&d.id)),
            });
        }
        Ok(Some(
            d.state()
                .ok_or_else(|| RemoteError::Protocol {
                    action: action.into(),
                    detail: "the sandbox has no status.state".into(),
                })?
                .to_owned(),
        ))
    }

    /// Polls the sandbox until its state is `want`; states in `passing` are
    /// waited through, any other is a failure.
    async fn wait_for(
        &self,
        action: &str,
        remote_id: &str,
        want: &str,
        passing: &[&str],
    ) -> Result<(), RemoteError> {
        let deadline = Instant::now() + self.ep.ready_timeout;
        loop {
            match self.get(action, remote_id).await? {
                Some(s) if s == want => return Ok(()),
                Some(s) if passing.contains(&s.as_str()) => {}
                Some(s) => {
                    return Err(RemoteError::Refused {
                        action: action.into(),
                        status: 0,
                        message: format!("the sandbox turned {} instead of {want}", clean(&s)),
                    })
                }
                None => {
                    return Err(RemoteError::NotFound {
                        action: action.into(),
                        message: format!("sandbox {remote_id} is gone"),
                    })
                }
            }
            if Instant::now() >= deadline {
                return Err(RemoteError::Failed {
                    action: action.into(),
                    status: 0,
                    message: format!(
                        "the sandbox was not {want} within {}s",
                        self.ep.ready_timeout.as_secs()
                    ),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `GET /v1/sandboxes/{id}/endpoints/{port}`; `None` while the service
    /// says the address is not there yet (`…POD_IP_NOT_AVAILABLE`).
    async fn port_endpoint(
        &self,
        remote_id: &str,
        port: u16,
    ) -> Result<Option<PortEndpoint>, RemoteError> {
        let action = format!("look up port {port}");
        check_remote_id(remote_id)?;
        let resp = send(
            &action,
            self.api(
                reqwest::Method::GET,
                &format!("/sandboxes/{remote_id}/endpoints/{port}"),
            )
            .query(&[("use_server_proxy", "false")]),
        )
        .await?;
        let status = resp.status();
        let bytes = read_bounded(&action, resp, MAX_ANSWER).await?;
        if !status.is_success() {
            let not_yet = status == reqwest::StatusCode::NOT_FOUND
                && serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|v| v.get("code")?.as_str().map(str::to_owned))
                    .is_some_and(|c| c.ends_with("POD_IP_NOT_AVAILABLE"));
            if not_yet {
                return Ok(None);
            }
            return Err(RemoteError::from_status(&action, status.as_u16(), &bytes));
        }
        let e: EndpointJson = json(&action, &bytes)?;
        parse_endpoint(
            &action,
            self.scheme(),
            &e.endpoint,
            e.headers.unwrap_or_default(),
        )
        .map(Some)
    }

    /// The endpoint of `port`, waiting out "not there yet" until `deadline`.
    async fn port_endpoint_ready(
        &self,
        remote_id: &str,
        port: u16,
        deadline: Instant,
    ) -> Result<PortEndpoint, RemoteError> {
        loop {
            if let Some(ep) = self.port_endpoint(remote_id, port).await? {
                return Ok(ep);
            }
            if Instant::now() >= deadline {
                return Err(RemoteError::Failed {
                    action: format!("look up port {port}"),
                    status: 0,
                    message: "the sandbox has no address yet".into(),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `GET {execd}/ping` until 2xx (execd comes up after the sandbox
    /// runs); a refused credential fails at once.
    async fn wait_execd(&self, execd: &PortEndpoint, deadline: Instant) -> Result<(), RemoteError> {
        let action = "reach execd";
        loop {
            let last = match send(action, self.at(execd, reqwest::Method::GET, "/ping")).await {
                Ok(resp) if resp.status().is_success() => return Ok(()),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let b = read_bounded(action, resp, 4096).await.unwrap_or_default();
                    let e = RemoteError::from_status(action, status, &b);
                    if matches!(e, RemoteError::Unauthorized { .. }) {
                        return Err(e);
                    }
                    e
                }
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(last);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `POST /v1/sandboxes/{id}/{verb}` (pause, resume).
    async fn transition(
        &self,
        action: &str,
        remote_id: &str,
        verb: &str,
    ) -> Result<(), RemoteError> {
        check_remote_id(remote_id)?;
        let resp = send(
            action,
            self.api(
                reqwest::Method::POST,
                &format!("/sandboxes/{remote_id}/{verb}"),
            ),
        )
        .await?;
        body(action, resp).await.map(|_| ())
    }

    /// `POST /v1/sandboxes/{id}/renew-expiration`: it ends `timeout_s`
    /// from now.
    async fn renew(&self, remote_id: &str, timeout_s: u64) -> Result<(), RemoteError> {
        let action = "renew a sandbox";
        check_remote_id(remote_id)?;
        let at = time::OffsetDateTime::now_utc()
            + time::Duration::seconds(i64::try_from(timeout_s).unwrap_or(i64::MAX / 2));
        let at = at
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| RemoteError::Setup(format!("format a time: {e}")))?;
        let resp = send(
            action,
            self.api(
                reqwest::Method::POST,
                &format!("/sandboxes/{remote_id}/renew-expiration"),
            )
            .json(&json!({ "expiresAt": at })),
        )
        .await?;
        body(action, resp).await.map(|_| ())
    }

    /// One upgrade to envd's bridge at `ep`.
    async fn upgrade(
        &self,
        ep: &PortEndpoint,
        secret: &str,
    ) -> Result<reqwest::Upgraded, RemoteError> {
        let action = "open a bridge connection";
        let req = self
            .at(ep, reqwest::Method::GET, "/")
            .header("connection", "upgrade")
            .header("upgrade", PROTOCOL)
            .header(SECRET_HEADER, secret)
            .timeout(Duration::from_secs(15));
        let resp = send(action, req).await?;
        if resp.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
            let status = resp.status().as_u16();
            let b = read_bounded(action, resp, 4096).await.unwrap_or_default();
            return Err(RemoteError::from_status(action, status, &b));
        }
        resp.upgrade().await.map_err(|e| unreachable(action, &e))
    }
}

#[async_trait]
impl Provider for OsbClient {
    type Sandbox = OsbSandbox;

    fn remote_id(sandbox: &OsbSandbox) -> &str {
        &sandbox.remote_id
    }

    async fn create(&self, req: &CreateRemote<'_>) -> Result<OsbSandbox, RemoteError> {
        let remote_id = self.create_sandbox(req).await?;
        let deadline = Instant::now() + self.ep.ready_timeout;
        let ready = async {
            self.wait_for("start a sandbox", &remote_id, "Running", &["Pending"])
                .await?;
            let execd = self
                .port_endpoint_ready(&remote_id, EXECD_PORT, deadline)
                .await?;
            self.wait_execd(&execd, deadline).await?;
            // nothing listens there yet: a service that gives endpoints
            // only for listening ports is asked again on first use
            let bridge = match self.port_endpoint(&remote_id, BRIDGE_PORT).await {
                Ok(ep) => ep,
                Err(e) => {
                    tracing::debug!(remote = %remote_id, error = %e, "no bridge endpoint yet");
                    None
                }
            };
            Ok(OsbSandbox {
                remote_id: remote_id.clone(),
                execd,
                bridge,
            })
        }
        .await;
        if ready.is_err() {
            // nothing half-made is left at the provider
            if let Err(e) = self.kill(&remote_id).await {
                tracing::warn!(remote = %remote_id, error = %e, "removing a sandbox that did not come up failed");
            }
        }
        ready
    }

    async fn state(&self, remote_id: &str) -> Result<Option<RemoteState>, RemoteError> {
        let action = "read a sandbox";
        match self.get(action, remote_id).await? {
            None => Ok(None),
            Some(s) => parse_state(action, Some(&s)),
        }
    }

    async fn kill(&self, remote_id: &str) -> Result<(), RemoteError> {
        let action = "delete a sandbox";
        check_remote_id(remote_id)?;
        self.bridges.lock().expect("bridge table").remove(remote_id);
        let resp = send(
            action,
            self.api(reqwest::Method::DELETE, &format!("/sandboxes/{remote_id}")),
        )
        .await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(());
        }
        body(action, resp).await.map(|_| ())
    }

    async fn pause(&self, sandbox: &OsbSandbox) -> Result<(), RemoteError> {
        let action = "pause a sandbox";
        self.transition(action, &sandbox.remote_id, "pause").await?;
        self.wait_for(
            action,
            &sandbox.remote_id,
            "Paused",
            &["Running", "Pausing"],
        )
        .await
    }

    async fn resume(&self, sandbox: &OsbSandbox, timeout_s: u64) -> Result<(), RemoteError> {
        let action = "resume a sandbox";
        self.transition(action, &sandbox.remote_id, "resume")
            .await?;
        self.wait_for(
            action,
            &sandbox.remote_id,
            "Running",
            &["Paused", "Resuming"],
        )
        .await?;
        // the provider's clock ran on while it was paused; Aviary's TTL
        // still ends it first
        if let Err(e) = self.renew(&sandbox.remote_id, timeout_s).await {
            tracing::warn!(remote = %sandbox.remote_id, error = %e, "renewing a resumed sandbox failed");
        }
        Ok(())
    }

    async fn list(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<(String, BTreeMap<String, String>)>, RemoteError> {
        let action = "list sandboxes";
        let filter = serde_urlencoded::to_string([(key, value)])
            .map_err(|e| RemoteError::Setup(format!("metadata filter {key}={value}: {e}")))?;
        let mut out = Vec::new();
        for page in 1..=MAX_PAGES {
            let mut q: Vec<(&str, String)> = vec![("metadata", filter.clone())];
            q.extend(LIVE_STATES.iter().map(|s| ("state", (*s).to_owned())));
            q.push(("page", page.to_string()));
            q.push(("pageSize", PAGE_SIZE.to_string()));
            let resp = send(
                action,
                self.api(reqwest::Method::GET, "/sandboxes").query(&q),
            )
            .await?;
            let p: PageJson = json(action, &body(action, resp).await?)?;
            if p.items.len() > PAGE_SIZE {
                return Err(RemoteError::Protocol {
                    action: action.into(),
                    detail: format!("a page of {} sandboxes", p.items.len()),
                });
            }
            for s in p.items {
                let live = !matches!(s.state(), Some("Stopping" | "Terminated"));
                let meta = s.metadata.unwrap_or_default();
                // the filter is checked here too: the answer is not trusted
                if live
                    && check_remote_id(&s.id).is_ok()
                    && meta.get(key).map(String::as_str) == Some(value)
                {
                    out.push((s.id, meta));
                }
            }
            if !p.pagination.is_some_and(|p| p.has_next_page) {
                return Ok(out);
            }
        }
        Err(RemoteError::Protocol {
            action: action.into(),
            detail: format!("more than {MAX_PAGES} pages"),
        })
    }

    async fn upload(
        &self,
        sandbox: &OsbSandbox,
        path: &str,
        data: Vec<u8>,
        mode: u32,
    ) -> Result<(), RemoteError> {
        let action = "upload a file";
        let (content_type, multipart) = upload_body(path, &data, mode);
        drop(data);
        let req = self
            .at(&sandbox.execd, reqwest::Method::POST, "/files/upload")
            .header("content-type", content_type)
            .timeout(self.ep.request_timeout.max(UPLOAD_TIMEOUT))
            .body(multipart);
        let resp = send(action, req).await?;
        body(action, resp).await.map(|_| ())
    }

    async fn run(
        &self,
        sandbox: &OsbSandbox,
        script: &str,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<RunOutput, RemoteError> {
        let action = "run a command";
        let req = self
            .at(&sandbox.execd, reqwest::Method::POST, "/command")
            .header("accept", "text/event-stream")
            .json(&json!({
                "command": script,
                "envs": env,
                "timeout": u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            }))
            .timeout(timeout + Duration::from_secs(10));
        let mut resp = send(action, req).await?;
        if !resp.status().is_success() {
            return Err(body(action, resp)
                .await
                .err()
                .unwrap_or_else(|| RemoteError::Protocol {
                    action: action.into(),
                    detail: "unexpected status".into(),
                }));
        }
        let mut events = CommandEvents::default();
        loop {
            match resp.chunk().await {
                Ok(Some(c)) => {
                    if events.push(action, &c)? {
                        return Ok(events.out);
                    }
                }
                Ok(None) => {
                    return if events.finish(action)? {
                        Ok(events.out)
                    } else {
                        Err(RemoteError::Protocol {
                            action: action.into(),
                            detail: "the command's stream ended without its end".into(),
                        })
                    };
                }
                Err(e) => return Err(unreachable(action, &e)),
            }
        }
    }

    async fn open_bridge(
        &self,
        sandbox: &OsbSandbox,
        secret: &str,
    ) -> Result<reqwest::Upgraded, RemoteError> {
        let id = &sandbox.remote_id;
        let learnt = self.bridges.lock().expect("bridge table").get(id).cloned();
        let known = learnt.or_else(|| sandbox.bridge.clone());
        let mut first = None;
        if let Some(ep) = &known {
            match self.upgrade(ep, secret).await {
                Ok(u) => return Ok(u),
                Err(e) => first = Some(e),
            }
        }
        // none known, or the sandbox answers somewhere else now (resumed):
        // ask where, and try there if it is somewhere new
        let fresh = match self.port_endpoint(id, BRIDGE_PORT).await {
            Ok(Some(ep)) if known.as_ref() != Some(&ep) => ep,
            Ok(_) => {
                return Err(first.unwrap_or_else(|| RemoteError::Failed {
                    action: "open a bridge connection".into(),
                    status: 0,
                    message: "the service gives no endpoint for the bridge port yet".into(),
                }))
            }
            Err(e) => return Err(first.unwrap_or(e)),
        };
        let upgraded = self.upgrade(&fresh, secret).await?;
        self.bridges
            .lock()
            .expect("bridge table")
            .insert(id.clone(), fresh);
        Ok(upgraded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_plain_host_port_paths_with_sane_headers() {
        let ep = parse_endpoint(
            "t",
            "http",
            "127.0.0.1:7400/v1/sandboxes/sbx-1/ports/49877",
            BTreeMap::from([("X-AVIARY-PORT-TOKEN".to_owned(), "ab12".to_owned())]),
        )
        .unwrap();
        assert_eq!(
            ep.url,
            "http://127.0.0.1:7400/v1/sandboxes/sbx-1/ports/49877"
        );
        let ep = parse_endpoint("t", "http", "https://h.example/p/", BTreeMap::new()).unwrap();
        assert_eq!(ep.url, "https://h.example/p", "its own scheme is kept");
        for bad in [
            "",
            "/path-only",
            "user@host",
            "host/p?q=1",
            "host/p#f",
            "host /p",
            "ftp://host",
            "host\n",
        ] {
            parse_endpoint("t", "http", bad, BTreeMap::new()).unwrap_err();
        }
        for (k, v) in [
            ("Host", "evil"),
            ("transfer-encoding", "chunked"),
            ("x-aviary-envd-secret", "s"),
            ("bad name", "v"),
            ("x-ok", "line\nbreak"),
        ] {
            let h = BTreeMap::from([(k.to_owned(), v.to_owned())]);
            parse_endpoint("t", "http", "host:1", h).unwrap_err();
        }
        let many: BTreeMap<String, String> = (0..=MAX_HEADERS)
            .map(|i| (format!("x-{i}"), "v".to_owned()))
            .collect();
        parse_endpoint("t", "http", "host:1", many).unwrap_err();
        // what Debug shows: header names, never their values
        let ep = parse_endpoint(
            "t",
            "http",
            "h:1",
            BTreeMap::from([("x-token".to_owned(), "sekrit".to_owned())]),
        )
        .unwrap();
        assert!(!format!("{ep:?}").contains("sekrit"));
        let client = OsbClient::new(OsbEndpoint {
            url: "https://osb.example".into(),
            api_key: "sekrit-key".into(),
            request_timeout: Duration::from_secs(1),
            ready_timeout: Duration::from_secs(1),
            deny_egress: true,
        })
        .unwrap();
        let printed = format!("{client:?}");
        assert!(
            !printed.contains("sekrit") && printed.contains("<redacted>"),
            "{printed}"
        );
        let sbx = OsbSandbox {
            remote_id: "sbx-1".into(),
            execd: ep.clone(),
            bridge: Some(ep),
        };
        assert!(!format!("{sbx:?}").contains("sekrit"));
        // a URL that is not http(s) is refused up front
        OsbClient::new(OsbEndpoint {
            url: "ftp://osb.example".into(),
            ..client.endpoint().clone()
        })
        .unwrap_err();
    }

    #[test]
    fn command_events_give_output_and_exit_codes_in_either_framing() {
        let mut ev = CommandEvents::default();
        let legacy = concat!(
            "{\"type\":\"init\",\"text\":\"exec-1\",\"timestamp\":1}\n\n",
            "{\"type\":\"stdout\",\"text\":\"hel\",\"timestamp\":2}\n\n",
            "{\"type\":\"ping\",\"timestamp\":3}\n\n",
            "{\"type\":\"stdout\",\"text\":\"lo\\n\",\"timestamp\":4}\n\n",
            "{\"type\":\"stderr\",\"text\":\"warn\\n\",\"timestamp\":5}\n\n",
            "{\"type\":\"error\",\"error\":{\"ename\":\"CommandExecError\",\"evalue\":\"3\",\"traceback\":[]},\"timestamp\":6}\n\n",
        );
        // split anywhere: events are reassembled
        let (a, b) = legacy.split_at(37);
        assert!(!ev.push("t", a.as_bytes()).unwrap());
        assert!(ev.push("t", b.as_bytes()).unwrap());
        assert_eq!(ev.out.exit_code, 3);
        assert_eq!(ev.out.stdout, b"hello\n");
        assert_eq!(ev.out.stderr, b"warn\n");

        let mut ev = CommandEvents::default();
        let sse = "data: {\"type\":\"stdout\",\"text\":\"x\",\"timestamp\":1}\r\n\r\n: comment\r\n\r\ndata: {\"type\":\"execution_complete\",\"execution_time\":5,\"timestamp\":2}\r\n\r\n";
        assert!(ev.push("t", sse.as_bytes()).unwrap());
        assert_eq!((ev.out.exit_code, ev.out.stdout.as_slice()), (0, &b"x"[..]));

        // the last event without its blank line still counts at the end
        let mut ev = CommandEvents::default();
        assert!(!ev
            .push("t", b"{\"type\":\"execution_complete\",\"timestamp\":2}")
            .unwrap());
        assert!(ev.finish("t").unwrap());

        // a start failure is an error, not an exit code
        let mut ev = CommandEvents::default();
        let e = ev
            .push(
                "t",
                b"{\"type\":\"error\",\"error\":{\"evalue\":\"exec: no such file\\u0007\"},\"timestamp\":1}\n\n",
            )
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "t: refused: the command did not run: exec: no such file"
        );

        // bounded: an endless event, and endless output
        let mut ev = CommandEvents::default();
        ev.push("t", &vec![b'{'; MAX_EVENT + 1]).unwrap_err();
        let mut ev = CommandEvents::default();
        let big = format!(
            "{{\"type\":\"stdout\",\"text\":\"{}\",\"timestamp\":1}}\n\n",
            "a".repeat(MAX_OUTPUT)
        );
        ev.push("t", big.as_bytes()).unwrap();
        ev.push("t", big.as_bytes()).unwrap();
        assert_eq!(ev.out.stdout.len(), MAX_OUTPUT);
        let mut ev = CommandEvents::default();
        ev.push("t", b"{not json\n\n").unwrap_err();
        // a line that is neither JSON nor an SSE data field is skipped
        assert!(!CommandEvents::default().push("t", b"retry: 5\n\n").unwrap());
    }

    #[test]
    fn states_map_to_what_the_runtime_reports() {
        let s = |x: &str| parse_state("t", Some(x)).unwrap();
        assert_eq!(s("Running"), Some(RemoteState::Running));
        assert_eq!(s("Resuming"), Some(RemoteState::Running));
        assert_eq!(s("Pausing"), Some(RemoteState::Paused));
        assert_eq!(s("Paused"), Some(RemoteState::Paused));
        assert_eq!(s("Failed"), Some(RemoteState::Stopped));
        assert_eq!(s("Terminated"), None);
        assert_eq!(s("Stopping"), None);
        parse_state("t", Some("running")).unwrap_err();
        parse_state("t", None).unwrap_err();
    }

    #[test]
    fn uploads_are_execd_multipart_with_octal_digit_modes() {
        let (ct, body) = upload_body("/tmp/.aviary-envd/envd", b"\x7fELF..", 0o755);
        let boundary = ct.strip_prefix("multipart/form-data; boundary=").unwrap();
        let text = String::from_utf8_lossy(&body);
        assert!(text.starts_with(&format!("--{boundary}\r\n")), "{text}");
        assert!(text.contains(r#""mode":755"#), "{text}");
        assert!(
            text.contains(r#""path":"/tmp/.aviary-envd/envd""#),
            "{text}"
        );
        assert!(text.contains("name=\"file\"; filename=\"envd\""), "{text}");
        assert!(text.ends_with(&format!("\r\n--{boundary}--\r\n")), "{text}");
        let (_, body) = upload_body("/s", b"x", 0o600);
        assert!(String::from_utf8_lossy(&body).contains(r#""mode":600"#));
        assert_eq!(cpu_quantity(1.0), "1");
        assert_eq!(cpu_quantity(0.5), "500m");
        assert_eq!(cpu_quantity(2.25), "2250m");
    }

    /// A provider that answers from a script: `(method, path without the
    /// query)` → status and body; every request line is recorded.
    async fn scripted(
        answer: impl Fn(&str, &str) -> Option<(u16, Vec<u8>)> + Send + Sync + 'static,
    ) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let answer = std::sync::Arc::new(answer);
        tokio::spawn(async move {
            loop {
                let (mut c, _) = l.accept().await.unwrap();
                let (log, answer) = (log.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut b = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if c.read(&mut b).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(b[0]);
                    }
                    let head = String::from_utf8_lossy(&head).to_string();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    let mut body = vec![0u8; len];
                    c.read_exact(&mut body).await.unwrap();
                    let mut first = head.lines().next().unwrap_or("").split(' ');
                    let method = first.next().unwrap_or("").to_owned();
                    let path = first
                        .next()
                        .unwrap_or("")
                        .split('?')
                        .next()
                        .unwrap_or("")
                        .to_owned();
                    log.lock().unwrap().push(format!("{method} {path}"));
                    // no answer at all: the client's timeout must end the call
                    let Some((status, body)) = answer(&method, &path) else {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        return;
                    };
                    let out = if status == 101 {
                        "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: aviary-envd\r\n\r\n".to_owned()
                    } else {
                        format!(
                            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            body.len()
                        )
                    };
                    let _ = c.write_all(out.as_bytes()).await;
                    let _ = c.write_all(&body).await;
                });
            }
        });
        (url, seen)
    }

    fn client_at(url: &str) -> OsbClient {
        OsbClient::new(OsbEndpoint {
            url: url.to_owned(),
            api_key: "k".into(),
            request_timeout: Duration::from_secs(2),
            ready_timeout: Duration::from_secs(5),
            deny_egress: true,
        })
        .unwrap()
    }

    fn create_req<'a>(
        meta: &'a BTreeMap<String, String>,
        res: &'a aviary_core::ResourceLimits,
    ) -> CreateRemote<'a> {
        CreateRemote {
            template: "python:3.11",
            timeout_s: 60,
            metadata: meta,
            resources: res,
        }
    }

    #[tokio::test]
    async fn a_provider_answering_badly_is_refused_and_leaves_nothing() {
        let meta = BTreeMap::new();
        let res = aviary_core::ResourceLimits::default();

        // an id that is not one
        let (url, _) = scripted(|m, p| match (m, p) {
            ("POST", "/v1/sandboxes") => Some((202, br#"{"id":"../../etc"}"#.to_vec())),
            _ => Some((404, b"{}".to_vec())),
        })
        .await;
        let e = client_at(&url)
            .create(&create_req(&meta, &res))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("is not a sandbox id"), "{e}");

        // an endpoint with user info: refused, and the made sandbox deleted
        let (url, seen) = scripted(|m, p| match (m, p) {
            ("POST", "/v1/sandboxes") => Some((
                202,
                br#"{"id":"sbx-1","status":{"state":"Pending"}}"#.to_vec(),
            )),
            ("GET", "/v1/sandboxes/sbx-1") => Some((
                200,
                br#"{"id":"sbx-1","status":{"state":"Running"}}"#.to_vec(),
            )),
            ("GET", "/v1/sandboxes/sbx-1/endpoints/44772") => {
                Some((200, br#"{"endpoint":"me@169.254.169.254/x"}"#.to_vec()))
            }
            ("DELETE", "/v1/sandboxes/sbx-1") => Some((204, Vec::new())),
            _ => Some((404, b"{}".to_vec())),
        })
        .await;
        let e = client_at(&url)
            .create(&create_req(&meta, &res))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("is not host[:port][/path]"), "{e}");
        assert_eq!(
            seen.lock().unwrap().last().map(String::as_str),
            Some("DELETE /v1/sandboxes/sbx-1"),
            "{seen:?}"
        );

        // a sandbox that fails while starting: deleted too
        let (url, seen) = scripted(|m, p| match (m, p) {
            ("POST", "/v1/sandboxes") => Some((202, br#"{"id":"sbx-2"}"#.to_vec())),
            ("GET", "/v1/sandboxes/sbx-2") => Some((
                200,
                br#"{"id":"sbx-2","status":{"state":"Failed"}}"#.to_vec(),
            )),
            ("DELETE", "/v1/sandboxes/sbx-2") => Some((204, Vec::new())),
            _ => Some((404, b"{}".to_vec())),
        })
        .await;
        let e = client_at(&url)
            .create(&create_req(&meta, &res))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("turned Failed instead of Running"),
            "{e}"
        );
        assert!(seen
            .lock()
            .unwrap()
            .contains(&"DELETE /v1/sandboxes/sbx-2".to_owned()));

        // another sandbox's answer to a read is not believed
        let (url, _) = scripted(|_, _| {
            Some((
                200,
                br#"{"id":"sbx-other","status":{"state":"Running"}}"#.to_vec(),
            ))
        })
        .await;
        let e = client_at(&url).state("sbx-3").await.unwrap_err();
        assert!(e.to_string().contains("asked for sbx-3"), "{e}");

        // an answer past the bound
        let (url, _) = scripted(|_, _| Some((200, vec![b' '; MAX_ANSWER + 1]))).await;
        let e = client_at(&url).state("sbx-4").await.unwrap_err();
        assert!(e.to_string().contains("answer larger than"), "{e}");

        // a provider that never answers: the call's timeout ends it
        let (url, _) = scripted(|_, _| None).await;
        let e = client_at(&url).kill("sbx-5").await.unwrap_err();
        assert!(matches!(e, RemoteError::Unreachable { .. }), "{e:?}");
        assert!(e.to_string().contains("timed out"), "{e}");

        // a listing keeps only entries that match the filter and have ids
        let (url, _) = scripted(|_, _| {
            Some((
                200,
                br#"{"items":[
                    {"id":"sbx-a","metadata":{"aviary_owner":"me"},"status":{"state":"Running"}},
                    {"id":"sbx-b","metadata":{"aviary_owner":"someone"},"status":{"state":"Running"}},
                    {"id":"bad id","metadata":{"aviary_owner":"me"},"status":{"state":"Running"}},
                    {"id":"sbx-c","metadata":{"aviary_owner":"me"},"status":{"state":"Terminated"}}
                ],"pagination":{"page":1,"pageSize":100,"totalItems":4,"totalPages":1,"hasNextPage":false}}"#
                    .to_vec(),
            ))
        })
        .await;
        let found = client_at(&url).list("aviary_owner", "me").await.unwrap();
        let ids: Vec<&str> = found.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["sbx-a"]);
    }

    #[tokio::test]
    async fn the_bridge_endpoint_is_looked_up_when_missing_or_moved_and_remembered() {
        let me = Arc::new(Mutex::new(String::new()));
        let at = me.clone();
        let (url, seen) = scripted(move |m, p| match (m, p) {
            ("GET", "/v1/sandboxes/sbx-9/endpoints/49877") => {
                let host = at.lock().unwrap().trim_start_matches("http://").to_owned();
                Some((
                    200,
                    format!(r#"{{"endpoint":"{host}/bridge","headers":{{"x-port-token":"t"}}}}"#)
                        .into_bytes(),
                ))
            }
            ("GET", "/bridge/") => Some((101, Vec::new())),
            _ => Some((
                502,
                br#"{"code":"PORT_UNREACHABLE","message":"nothing there"}"#.to_vec(),
            )),
        })
        .await;
        *me.lock().unwrap() = url.clone();
        let client = client_at(&url);
        let lookups = || {
            seen.lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains("/endpoints/"))
                .count()
        };
        let execd = parse_endpoint("t", "http", "h:1", BTreeMap::new()).unwrap();

        // none given at create: looked up, then remembered
        let sbx = OsbSandbox {
            remote_id: "sbx-9".into(),
            execd: execd.clone(),
            bridge: None,
        };
        client.open_bridge(&sbx, "secret").await.unwrap();
        assert_eq!(lookups(), 1);
        client.open_bridge(&sbx, "secret").await.unwrap();
        assert_eq!(lookups(), 1, "the endpoint learnt is used again");

        // the one of create no longer answers (moved): looked up again
        let fresh = client_at(&url);
        let stale = OsbSandbox {
            bridge: Some(
                parse_endpoint("t", "http", &format!("{}/old", url), BTreeMap::new()).unwrap(),
            ),
            ..sbx.clone()
        };
        fresh.open_bridge(&stale, "secret").await.unwrap();
        assert_eq!(lookups(), 2);
        let log = seen.lock().unwrap().clone();
        assert!(log.contains(&"GET /old/".to_owned()), "{log:?}");

        // a bridge that does not answer where the service says: its refusal
        let nowhere = OsbSandbox {
            remote_id: "sbx-10".into(),
            execd,
            bridge: None,
        };
        let e = fresh.open_bridge(&nowhere, "secret").await.unwrap_err();
        assert!(e.to_string().contains("look up port 49877"), "{e}");
    }
}
