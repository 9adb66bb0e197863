//! The client of an E2B-compatible service: its control API (`X-API-KEY`),
//! its envd (`/files` uploads and `process.Process/Start` as a Connect
//! server stream, with the sandbox's `envdAccessToken`), and its port proxy
//! (`{port}-{sandbox id}.{domain}`, an HTTP/1.1 upgrade).
//!
//! Everything the service answers is parsed with bounds: bodies of at most
//! [`MAX_ANSWER`] bytes, Connect envelopes of at most [`MAX_ENVELOPE`], a
//! command's output capped at [`MAX_OUTPUT`]; error messages are cut and
//! stripped of control characters before they reach an error. The API key
//! is never printed (`Debug` redacts it).

use crate::http::{self, body, json, read_bounded, send, unreachable};
pub use crate::http::{check_remote_id, clean, MAX_ANSWER};
use crate::relay::{BRIDGE_PORT, PROTOCOL, SECRET_HEADER};
use crate::{CreateRemote, Provider, RemoteError};
pub use crate::{RemoteState, RunOutput};
use async_trait::async_trait;
use base64::Engine;
use bytes::{Buf, BytesMut};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;
/// Largest Connect envelope read from a process stream.
pub const MAX_ENVELOPE: usize = 1 << 20;
/// Output of a setup command kept (per stream).
pub const MAX_OUTPUT: usize = 64 * 1024;
/// The port E2B's envd listens on in every sandbox.
pub const ENVD_PORT: u16 = 49983;
/// Pages of a listing read at most (100 sandboxes each).
const MAX_PAGES: usize = 100;

/// Where and how to reach the service.
#[derive(Clone)]
pub struct E2bEndpoint {
    /// The control API (`E2B_API_URL`), without a trailing slash.
    pub api_url: String,
    /// One URL for every sandbox's envd (`E2B_SANDBOX_URL`, routed by the
    /// `E2b-Sandbox-Id` header); `None`: `https://49983-{id}.{domain}`.
    pub sandbox_url: Option<String>,
    /// The sandbox domain: ports are `{port}-{id}.{domain}`.
    pub domain: String,
    /// Where port traffic is sent (`Host` stays `{port}-{id}.{domain}`);
    /// `None`: `https://{port}-{id}.{domain}`.
    pub port_url: Option<String>,
    /// Send the API key as `Authorization: Bearer` to the port proxy. Only
    /// for a proxy that consumes it (Aviary's): a proxy that forwards
    /// headers into the sandbox would hand the key to the sandbox.
    pub proxy_key: bool,
    pub api_key: String,
}

impl std::fmt::Debug for E2bEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2bEndpoint")
            .field("api_url", &self.api_url)
            .field("sandbox_url", &self.sandbox_url)
            .field("domain", &self.domain)
            .field("port_url", &self.port_url)
            .field("proxy_key", &self.proxy_key)
            .field("api_key", &"<redacted>")
            .finish()
    }
}

/// A sandbox the service created: what reaching it needs.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct RemoteSandbox {
    pub remote_id: String,
    /// `envdAccessToken` (`X-Access-Token` on envd calls), if the service
    /// gave one.
    pub access_token: Option<String>,
    /// `trafficAccessToken` (`e2b-traffic-access-token` on port traffic).
    pub traffic_token: Option<String>,
}

impl std::fmt::Debug for RemoteSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSandbox")
            .field("remote_id", &self.remote_id)
            .finish_non_exhaustive()
    }
}

/// The client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct E2bClient {
    ep: E2bEndpoint,
    http: reqwest::Client,
}

#[derive(Deserialize)]
struct CreatedJson {
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "envdAccessToken", default)]
    envd_access_token: Option<String>,
    #[serde(rename = "trafficAccessToken", default)]
    traffic_access_token: Option<String>,
}

#[derive(Deserialize)]
struct DetailJson {
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

impl E2bClient {
    pub fn new(ep: E2bEndpoint) -> Result<E2bClient, RemoteError> {
        Ok(E2bClient {
            ep,
            http: http::client()?,
        })
    }

    pub fn endpoint(&self) -> &E2bEndpoint {
        &self.ep
    }

    fn api(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.ep.api_url))
            .header("x-api-key", &self.ep.api_key)
            .timeout(Duration::from_secs(60))
    }

    /// `POST /sandboxes`: a new sandbox of `template`, without internet
    /// access, alive for `timeout_s`, with `metadata` and `env`.
    pub async fn create(
        &self,
        template: &str,
        timeout_s: u64,
        metadata: &BTreeMap<String, String>,
        env: &BTreeMap<String, String>,
    ) -> Result<RemoteSandbox, RemoteError> {
        let action = "create a sandbox";
        let request = serde_json::json!({
            "templateID": template,
            "timeout": timeout_s,
            "metadata": metadata,
            "envVars": env,
            "allow_internet_access": false,
        });
        let resp = send(
            action,
            self.api(reqwest::Method::POST, "/sandboxes").json(&request),
        )
        .await?;
        let created: CreatedJson = json(action, &body(action, resp).await?)?;
        check_remote_id(&created.sandbox_id)?;
        Ok(RemoteSandbox {
            remote_id: created.sandbox_id,
            access_token: created.envd_access_token,
            traffic_token: created.traffic_access_token,
        })
    }

    /// `GET /sandboxes/{id}`: its state, `None` when the service has no such
    /// sandbox (404).
    pub async fn state(&self, remote_id: &str) -> Result<Option<RemoteState>, RemoteError> {
        let action = "read a sandbox";
        check_remote_id(remote_id)?;
        let resp = send(
            action,
            self.api(reqwest::Method::GET, &format!("/sandboxes/{remote_id}")),
        )
        .await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let d: DetailJson = json(action, &body(action, resp).await?)?;
        Ok(Some(parse_state(action, d.state.as_deref())?))
    }

    /// `DELETE /sandboxes/{id}`; an unknown one is fine.
    pub async fn kill(&self, remote_id: &str) -> Result<(), RemoteError> {
        let action = "kill a sandbox";
        check_remote_id(remote_id)?;
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

    /// `POST /sandboxes/{id}/pause`.
    pub async fn pause(&self, remote_id: &str) -> Result<(), RemoteError> {
        self.lifecycle("pause a sandbox", remote_id, "pause", None)
            .await
    }

    /// `POST /sandboxes/{id}/resume` (`timeout` renews its lifetime).
    pub async fn resume(&self, remote_id: &str, timeout_s: u64) -> Result<(), RemoteError> {
        self.lifecycle("resume a sandbox", remote_id, "resume", Some(timeout_s))
            .await
    }

    async fn lifecycle(
        &self,
        action: &str,
        remote_id: &str,
        verb: &str,
        timeout_s: Option<u64>,
    ) -> Result<(), RemoteError> {
        check_remote_id(remote_id)?;
        let mut req = self.api(
            reqwest::Method::POST,
            &format!("/sandboxes/{remote_id}/{verb}"),
        );
        if let Some(t) = timeout_s {
            req = req.json(&serde_json::json!({ "timeout": t }));
        }
        let resp = send(action, req).await?;
        body(action, resp).await.map(|_| ())
    }

    /// Every running or paused sandbox whose metadata has `key=value`
    /// (`GET /v2/sandboxes`, paged by `x-next-token`): id and metadata.
    pub async fn list(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<(String, BTreeMap<String, String>)>, RemoteError> {
        let action = "list sandboxes";
        let filter = serde_urlencoded::to_string([(key, value)])
            .map_err(|e| RemoteError::Setup(format!("metadata filter {key}={value}: {e}")))?;
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let mut q = vec![
                ("metadata", filter.as_str()),
                ("state", "running,paused"),
                ("limit", "100"),
            ];
            if let Some(n) = &next {
                q.push(("nextToken", n));
            }
            let resp = send(
                action,
                self.api(reqwest::Method::GET, "/v2/sandboxes").query(&q),
            )
            .await?;
            next = resp
                .headers()
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty() && v.len() <= 256)
                .map(str::to_owned);
            let page: Vec<DetailJson> = json(action, &body(action, resp).await?)?;
            for d in page {
                if check_remote_id(&d.sandbox_id).is_ok() {
                    out.push((d.sandbox_id, d.metadata.unwrap_or_default()));
                }
            }
            if next.is_none() {
                return Ok(out);
            }
        }
        Err(RemoteError::Protocol {
            action: action.into(),
            detail: format!("more than {MAX_PAGES} pages"),
        })
    }

    fn envd(
        &self,
        sbx: &RemoteSandbox,
        method: reqwest::Method,
        path: &str,
    ) -> Result<reqwest::RequestBuilder, RemoteError> {
        check_remote_id(&sbx.remote_id)?;
        let base = match &self.ep.sandbox_url {
            Some(u) => u.clone(),
            None => format!("https://{ENVD_PORT}-{}.{}", sbx.remote_id, self.ep.domain),
        };
        let mut req = self
            .http
            .request(method, format!("{base}{path}"))
            .header("e2b-sandbox-id", &sbx.remote_id)
            .header("e2b-sandbox-port", ENVD_PORT.to_string());
        if let Some(t) = &sbx.access_token {
            req = req.header("x-access-token", t);
        }
        Ok(req)
    }

    /// `POST /files?path=`: writes `data` at `path` in the sandbox.
    pub async fn upload(
        &self,
        sbx: &RemoteSandbox,
        path: &str,
        data: Vec<u8>,
    ) -> Result<(), RemoteError> {
        let action = "upload a file";
        let req = self
            .envd(sbx, reqwest::Method::POST, "/files")?
            .query(&[("path", path)])
            .header("content-type", "application/octet-stream")
            .timeout(Duration::from_secs(300))
            .body(data);
        let resp = send(action, req).await?;
        body(action, resp).await.map(|_| ())
    }

    /// Runs `/bin/sh -c script` in the sandbox through envd's
    /// `process.Process/Start` and waits for its end (at most `timeout`).
    pub async fn run(
        &self,
        sbx: &RemoteSandbox,
        script: &str,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<RunOutput, RemoteError> {
        let action = "run a command";
        let msg = serde_json::json!({
            "process": {"cmd": "/bin/sh", "args": ["-c", script], "envs": env, "cwd": "/"}
        });
        let req = self
            .envd(sbx, reqwest::Method::POST, "/process.Process/Start")?
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .header("connect-timeout-ms", timeout.as_millis().to_string())
            .timeout(timeout + Duration::from_secs(10))
            .body(envelope(0, &serde_json::to_vec(&msg).expect("json")));
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
        let mut buf = BytesMut::new();
        let mut out = RunOutput::default();
        let mut ended = false;
        loop {
            while let Some((flags, data)) = take_envelope(action, &mut buf)? {
                if flags & 0x02 != 0 {
                    end_of_stream(action, &data)?;
                    return if ended {
                        Ok(out)
                    } else {
                        Err(RemoteError::Protocol {
                            action: action.into(),
                            detail: "the stream ended without the process's end".into(),
                        })
                    };
                }
                ended |= process_event(action, &data, &mut out)?;
            }
            match resp.chunk().await {
                Ok(Some(c)) => buf.extend_from_slice(&c),
                Ok(None) => {
                    return Err(RemoteError::Protocol {
                        action: action.into(),
                        detail: "the stream was cut".into(),
                    })
                }
                Err(e) => return Err(unreachable(action, &e)),
            }
        }
    }

    /// Opens an HTTP/1.1 upgrade to `protocol` on `port` of the sandbox
    /// through the service's port proxy, with `headers`; the upgraded
    /// byte stream.
    pub async fn upgrade(
        &self,
        sbx: &RemoteSandbox,
        port: u16,
        protocol: &str,
        headers: &[(&str, &str)],
    ) -> Result<reqwest::Upgraded, RemoteError> {
        let action = "open a port connection";
        check_remote_id(&sbx.remote_id)?;
        let host = format!("{port}-{}.{}", sbx.remote_id, self.ep.domain);
        let url = match &self.ep.port_url {
            Some(u) => format!("{u}/"),
            None => format!("https://{host}/"),
        };
        let mut req = self
            .http
            .get(url)
            .header("host", &host)
            .header("connection", "upgrade")
            .header("upgrade", protocol)
            .timeout(Duration::from_secs(15));
        if self.ep.proxy_key {
            req = req.bearer_auth(&self.ep.api_key);
        }
        if let Some(t) = &sbx.traffic_token {
            req = req.header("e2b-traffic-access-token", t);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = send(action, req).await?;
        if resp.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
            let status = resp.status().as_u16();
            let body = read_bounded(action, resp, 4096).await.unwrap_or_default();
            return Err(RemoteError::from_status(action, status, &body));
        }
        resp.upgrade().await.map_err(|e| unreachable(action, &e))
    }
}

/// The E2B wire behind the shared remote runtime: the control API for the
/// lifecycle, envd's `/files` and process API for the setup, the port proxy
/// for the bridge.
#[async_trait]
impl Provider for E2bClient {
    type Sandbox = RemoteSandbox;

    fn remote_id(sandbox: &RemoteSandbox) -> &str {
        &sandbox.remote_id
    }

    async fn create(&self, req: &CreateRemote<'_>) -> Result<RemoteSandbox, RemoteError> {
        // E2B's templates fix CPU and memory; the limits are not asked
        E2bClient::create(
            self,
            req.template,
            req.timeout_s,
            req.metadata,
            &BTreeMap::new(),
        )
        .await
    }

    async fn state(&self, remote_id: &str) -> Result<Option<RemoteState>, RemoteError> {
        E2bClient::state(self, remote_id).await
    }

    async fn kill(&self, remote_id: &str) -> Result<(), RemoteError> {
        E2bClient::kill(self, remote_id).await
    }

    async fn pause(&self, sandbox: &RemoteSandbox) -> Result<(), RemoteError> {
        E2bClient::pause(self, &sandbox.remote_id).await
    }

    async fn resume(&self, sandbox: &RemoteSandbox, timeout_s: u64) -> Result<(), RemoteError> {
        E2bClient::resume(self, &sandbox.remote_id, timeout_s).await
    }

    async fn list(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<(String, BTreeMap<String, String>)>, RemoteError> {
        E2bClient::list(self, key, value).await
    }

    /// `mode` is set by the start script (E2B's `/files` takes none).
    async fn upload(
        &self,
        sandbox: &RemoteSandbox,
        path: &str,
        data: Vec<u8>,
        _mode: u32,
    ) -> Result<(), RemoteError> {
        E2bClient::upload(self, sandbox, path, data).await
    }

    async fn run(
        &self,
        sandbox: &RemoteSandbox,
        script: &str,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<RunOutput, RemoteError> {
        E2bClient::run(self, sandbox, script, env, timeout).await
    }

    async fn open_bridge(
        &self,
        sandbox: &RemoteSandbox,
        secret: &str,
    ) -> Result<reqwest::Upgraded, RemoteError> {
        self.upgrade(sandbox, BRIDGE_PORT, PROTOCOL, &[(SECRET_HEADER, secret)])
            .await
    }
}

fn parse_state(action: &str, s: Option<&str>) -> Result<RemoteState, RemoteError> {
    match s {
        Some("running") => Ok(RemoteState::Running),
        Some("paused") => Ok(RemoteState::Paused),
        other => Err(RemoteError::Protocol {
            action: action.into(),
            detail: format!("unknown sandbox state {:?}", other.map(clean)),
        }),
    }
}

/// A Connect envelope: flags, big-endian length, data.
pub fn envelope(flags: u8, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + data.len());
    v.push(flags);
    v.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// The next whole envelope in `buf`, if one is there.
fn take_envelope(action: &str, buf: &mut BytesMut) -> Result<Option<(u8, Vec<u8>)>, RemoteError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_ENVELOPE {
        return Err(RemoteError::Protocol {
            action: action.into(),
            detail: format!("an envelope of {len} bytes"),
        });
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let flags = buf[0];
    buf.advance(5);
    Ok(Some((flags, buf.split_to(len).to_vec())))
}

fn end_of_stream(action: &str, data: &[u8]) -> Result<(), RemoteError> {
    #[derive(Deserialize)]
    struct End {
        #[serde(default)]
        error: Option<ErrorJson>,
    }
    #[derive(Deserialize)]
    struct ErrorJson {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    let end: End =
        serde_json::from_slice(if data.is_empty() { b"{}" } else { data }).map_err(|e| {
            RemoteError::Protocol {
                action: action.into(),
                detail: format!("end of stream: {e}"),
            }
        })?;
    match end.error {
        None => Ok(()),
        Some(e) => Err(RemoteError::Refused {
            action: action.into(),
            status: 0,
            message: clean(&format!("{}: {}", e.code, e.message)),
        }),
    }
}

/// Applies one process event to `out`; `true` for the process's end.
fn process_event(action: &str, data: &[u8], out: &mut RunOutput) -> Result<bool, RemoteError> {
    let bad = |detail: String| RemoteError::Protocol {
        action: action.into(),
        detail,
    };
    let v: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| bad(format!("process event: {e}")))?;
    let ev = &v["event"];
    if let Some(d) = ev.get("data") {
        let b64 = base64::engine::general_purpose::STANDARD;
        for (name, sink) in [("stdout", &mut out.stdout), ("stderr", &mut out.stderr)] {
            if let Some(s) = d.get(name).and_then(|s| s.as_str()) {
                let bytes = b64
                    .decode(s)
                    .map_err(|e| bad(format!("process output: {e}")))?;
                let room = MAX_OUTPUT.saturating_sub(sink.len());
                sink.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
        }
        return Ok(false);
    }
    if let Some(end) = ev.get("end") {
        let code = end.get("exitCode").and_then(|c| c.as_i64()).unwrap_or(0);
        out.exit_code = i32::try_from(code).map_err(|_| bad(format!("exit code {code}")))?;
        return Ok(true);
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_are_bounded() {
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&envelope(0, b"{\"a\":1}"));
        buf.extend_from_slice(&envelope(2, b"{}")[..4]);
        let (flags, data) = take_envelope("t", &mut buf).unwrap().unwrap();
        assert_eq!((flags, data.as_slice()), (0, &b"{\"a\":1}"[..]));
        assert!(take_envelope("t", &mut buf).unwrap().is_none(), "partial");
        buf.extend_from_slice(b"\x00");
        assert_eq!(take_envelope("t", &mut buf).unwrap().unwrap().0, 2);
        let mut huge = BytesMut::new();
        huge.extend_from_slice(&[0, 0xff, 0xff, 0xff, 0xff]);
        take_envelope("t", &mut huge).unwrap_err();
    }

    #[test]
    fn process_events_collect_output_and_the_exit_code() {
        let mut out = RunOutput::default();
        let b64 = base64::engine::general_purpose::STANDARD;
        let ev = |v: serde_json::Value| serde_json::to_vec(&v).unwrap();
        assert!(!process_event(
            "t",
            &ev(serde_json::json!({"event":{"start":{"pid":7}}})),
            &mut out
        )
        .unwrap());
        assert!(!process_event(
            "t",
            &ev(serde_json::json!({"event":{"data":{"stdout": b64.encode("hi\n")}}})),
            &mut out
        )
        .unwrap());
        assert!(process_event(
            "t",
            &ev(serde_json::json!({"event":{"end":{"exited":true,"exitCode":3}}})),
            &mut out
        )
        .unwrap());
        assert_eq!((out.exit_code, out.stdout.as_slice()), (3, &b"hi\n"[..]));
        let mut ok = RunOutput::default();
        assert!(process_event(
            "t",
            &ev(serde_json::json!({"event":{"end":{"exited":true}}})),
            &mut ok
        )
        .unwrap());
        assert_eq!(ok.exit_code, 0, "no exitCode is 0");
        end_of_stream("t", b"{}").unwrap();
        let e = end_of_stream(
            "t",
            br#"{"error":{"code":"not_found","message":"gone\u0007"}}"#,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "t: refused: not_found: gone");
    }

    #[test]
    fn remote_ids_are_checked_before_use() {
        check_remote_id("sbx-01hxyz_AB").unwrap();
        for bad in ["", "a/b", "a.b", "x y", &"a".repeat(129)] {
            check_remote_id(bad).unwrap_err();
        }
    }
}
