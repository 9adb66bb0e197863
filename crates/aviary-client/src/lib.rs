//! Client for the Aviary v1 HTTP API.
//!
//! One method per API operation; errors come back as [`ClientError::Api`]
//! carrying the server's stable [`ErrorCode`], so callers (the CLI, tests)
//! can branch on codes rather than on message text. Streaming exec decodes
//! the server-sent events into [`ExecEvent`]s as they arrive.
#![forbid(unsafe_code)]

use aviary_core::api::*;
use aviary_core::{ErrorBody, ErrorCode, LeaseToken};
use base64::Engine;
use futures_util::StreamExt;
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;
use std::path::Path;

/// Header carrying the lease token on mutating calls that have no JSON body.
pub const LEASE_TOKEN_HEADER: &str = "x-aviary-lease-token";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{code:?} ({status}): {message}")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    #[error("cannot reach the aviary server at {url}")]
    Connect {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("http transport failed")]
    Transport(#[source] reqwest::Error),
    #[error("unexpected response from server: {0}")]
    Protocol(String),
    #[error("local file i/o failed")]
    Io(#[source] std::io::Error),
}

impl ClientError {
    /// The server's error code, if the server answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api { code, .. } => Some(*code),
            _ => None,
        }
    }
}

#[derive(Clone)]
pub struct Client {
    base: String,
    key: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// Server-sent events of one response, parsed by `sse-stream`.
type SseEvents =
    futures_util::stream::BoxStream<'static, Result<sse_stream::Sse, sse_stream::Error>>;

fn sse_events(resp: reqwest::Response) -> SseEvents {
    sse_stream::SseStream::from_bytes_stream(resp.bytes_stream()).boxed()
}

/// The next event of `events` that carries data (keep-alive comments and
/// empty events are skipped); `None` when the stream ends.
async fn next_data(events: &mut SseEvents) -> Result<Option<(String, String)>, ClientError> {
    loop {
        match events.next().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(ClientError::Protocol(format!("event stream: {e}"))),
            Some(Ok(sse)) => {
                if let Some(data) = sse.data.filter(|d| !d.is_empty()) {
                    return Ok(Some((sse.event.unwrap_or_else(|| "message".into()), data)));
                }
            }
        }
    }
}

/// The result of a streaming exec, event by event.
pub struct ExecStream {
    events: SseEvents,
}

impl ExecStream {
    /// Next event; `None` after the final `Exit` (or when the stream ends).
    /// `Stdout`/`Stderr` data is decoded from base64 into raw bytes.
    pub async fn next(&mut self) -> Result<Option<StreamItem>, ClientError> {
        match next_data(&mut self.events).await? {
            Some((_, data)) => decode_exec_event(&data).map(Some),
            None => Ok(None),
        }
    }
}

/// The events a server pushes (`Client::follow_events`).
pub struct EventStream {
    events: SseEvents,
}

impl EventStream {
    /// The next event; `None` when the server ends the stream. An `error`
    /// event (the sandbox was deleted, say) is returned as that error.
    pub async fn next(&mut self) -> Result<Option<Event>, ClientError> {
        let Some((name, data)) = next_data(&mut self.events).await? else {
            return Ok(None);
        };
        if name == "error" {
            let v: serde_json::Value = serde_json::from_str(&data).unwrap_or_default();
            let code: ErrorCode =
                serde_json::from_value(v["code"].clone()).unwrap_or(ErrorCode::Internal);
            return Err(ClientError::Api {
                status: code.http_status(),
                code,
                message: v["message"].as_str().unwrap_or_default().to_owned(),
            });
        }
        serde_json::from_str(&data)
            .map(Some)
            .map_err(|e| ClientError::Protocol(format!("bad event: {e}")))
    }
}

/// One decoded item of a streaming exec.
#[derive(Debug)]
pub enum StreamItem {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(ExecResult),
}

/// One exec event's JSON `data`, with stdout/stderr decoded from base64.
fn decode_exec_event(data: &str) -> Result<StreamItem, ClientError> {
    let ev: ExecEvent = serde_json::from_str(data)
        .map_err(|e| ClientError::Protocol(format!("bad exec event: {e}")))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    Ok(match ev {
        ExecEvent::Stdout { data } => StreamItem::Stdout(
            b64.decode(data)
                .map_err(|e| ClientError::Protocol(format!("bad base64: {e}")))?,
        ),
        ExecEvent::Stderr { data } => StreamItem::Stderr(
            b64.decode(data)
                .map_err(|e| ClientError::Protocol(format!("bad base64: {e}")))?,
        ),
        ExecEvent::Exit { result } => StreamItem::Exit(result),
        ExecEvent::Error { code, message } => {
            return Err(ClientError::Api {
                status: code.http_status(),
                code,
                message,
            })
        }
    })
}

fn token_header(rb: RequestBuilder, token: Option<LeaseToken>) -> RequestBuilder {
    match token {
        Some(t) => rb.header(LEASE_TOKEN_HEADER, t.to_string()),
        None => rb,
    }
}

impl Client {
    pub fn new(base_url: &str, api_key: &str) -> Self {
        let base = base_url.trim_end_matches('/').to_owned();
        let builder = reqwest::Client::builder()
            .pool_max_idle_per_host(8)
            // below the server's default idle limit (header_read_timeout_ms,
            // 10 s), so a pooled connection is not reused as the server
            // closes it
            .pool_idle_timeout(std::time::Duration::from_secs(5))
            .tcp_nodelay(true);
        // A plain-HTTP server needs no trust roots: loading the system's
        // (the bundle and every file in /etc/ssl/certs, each parsed) was
        // most of a short CLI command's start-up. Such a client trusts no
        // TLS server, so a redirect to https fails rather than going out.
        let builder = if is_plain_http(&base) {
            builder.tls_built_in_root_certs(false)
        } else {
            builder
        };
        Client {
            base,
            key: api_key.to_owned(),
            http: builder.build().unwrap_or_default(),
        }
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn req(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(&self.key)
    }

    async fn send(&self, rb: RequestBuilder) -> Result<Response, ClientError> {
        let resp = rb.send().await.map_err(|e| {
            if e.is_connect() {
                ClientError::Connect {
                    url: self.base.clone(),
                    source: e,
                }
            } else {
                ClientError::Transport(e)
            }
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body = resp.bytes().await.map_err(ClientError::Transport)?;
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(b) => Err(ClientError::Api {
                status,
                code: b.error.code,
                message: b.error.message,
            }),
            Err(_) => Err(ClientError::Protocol(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }

    async fn json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T, ClientError> {
        let resp = self.send(rb).await?;
        resp.json().await.map_err(ClientError::Transport)
    }

    pub async fn healthz(&self) -> Result<(), ClientError> {
        self.send(self.http.get(format!("{}/healthz", self.base)))
            .await
            .map(|_| ())
    }

    pub async fn readyz(&self) -> Result<serde_json::Value, ClientError> {
        self.json(self.http.get(format!("{}/readyz", self.base)))
            .await
    }

    pub async fn create_sandbox(
        &self,
        req: &CreateSandboxRequest,
    ) -> Result<CreateSandboxResponse, ClientError> {
        self.json(self.req(Method::POST, "/v1/sandboxes").json(req))
            .await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}")))
            .await
    }

    pub async fn list_sandboxes(&self, all: bool) -> Result<SandboxList, ClientError> {
        self.list_sandboxes_with(&SandboxFilter {
            all,
            ..Default::default()
        })
        .await
    }

    /// `GET /v1/sandboxes` with filters.
    pub async fn list_sandboxes_with(&self, f: &SandboxFilter) -> Result<SandboxList, ClientError> {
        let mut q = format!("?all={}", f.all);
        if !f.metadata.is_empty() {
            let pairs: Vec<String> = f
                .metadata
                .iter()
                .map(|(k, v)| format!("{}={}", urlencode(k), urlencode(v)))
                .collect();
            q.push_str(&format!("&metadata={}", urlencode(&pairs.join("&"))));
        }
        for (name, v) in [
            ("state", &f.state),
            ("user_id", &f.user_id),
            ("session_id", &f.session_id),
        ] {
            if let Some(v) = v {
                q.push_str(&format!("&{name}={}", urlencode(v)));
            }
        }
        self.json(self.req(Method::GET, &format!("/v1/sandboxes{q}")))
            .await
    }

    /// `DELETE /v1/snapshots/{id}`.
    pub async fn delete_snapshot(&self, id: &str) -> Result<serde_json::Value, ClientError> {
        self.json(self.req(Method::DELETE, &format!("/v1/snapshots/{}", urlencode(id))))
            .await
    }

    /// `DELETE /v1/templates/{name}` (admin).
    pub async fn remove_template(&self, name: &str) -> Result<(), ClientError> {
        self.send(self.req(
            Method::DELETE,
            &format!("/v1/templates/{}", urlencode(name).replace('/', "%2F")),
        ))
        .await
        .map(|_| ())
    }

    /// `POST /v1/sandboxes/{id}/ttl`: expire `ttl_s` seconds from now.
    pub async fn set_ttl(
        &self,
        id: &str,
        ttl_s: u64,
        token: Option<LeaseToken>,
    ) -> Result<Sandbox, ClientError> {
        self.json(token_header(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/ttl"))
                .json(&SetTtlBody { ttl_s }),
            token,
        ))
        .await
    }

    pub async fn delete_sandbox(
        &self,
        id: &str,
        token: Option<LeaseToken>,
    ) -> Result<Sandbox, ClientError> {
        self.json(token_header(
            self.req(Method::DELETE, &format!("/v1/sandboxes/{id}")),
            token,
        ))
        .await
    }

    pub async fn exec(&self, id: &str, req: &ExecRequest) -> Result<ExecResult, ClientError> {
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
                .json(req),
        )
        .await
    }

    pub async fn exec_stream(
        &self,
        id: &str,
        req: &ExecRequest,
    ) -> Result<ExecStream, ClientError> {
        let resp = self
            .send(
                self.req(Method::POST, &format!("/v1/sandboxes/{id}/exec/stream"))
                    .json(req),
            )
            .await?;
        Ok(ExecStream {
            events: sse_events(resp),
        })
    }

    /// `exec/stream` with the process's stdin streamed from `stdin` (bytes,
    /// sent as they come; stdin closes when the stream ends):
    /// `POST /v1/sandboxes/{id}/exec/stdin`, a multipart body.
    pub async fn exec_stream_piped<S>(
        &self,
        id: &str,
        req: &ExecRequest,
        stdin: S,
    ) -> Result<ExecStream, ClientError>
    where
        S: futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static,
    {
        let json = serde_json::to_string(req)
            .map_err(|e| ClientError::Protocol(format!("encoding the request: {e}")))?;
        let request = reqwest::multipart::Part::text(json)
            .mime_str("application/json")
            .map_err(ClientError::Transport)?;
        let form = reqwest::multipart::Form::new()
            .part("request", request)
            .part(
                "stdin",
                reqwest::multipart::Part::stream(reqwest::Body::wrap_stream(stdin)),
            );
        let resp = self
            .send(
                self.req(Method::POST, &format!("/v1/sandboxes/{id}/exec/stdin"))
                    .multipart(form),
            )
            .await?;
        Ok(ExecStream {
            events: sse_events(resp),
        })
    }

    fn files_url(id: &str, op: &str, path: &str) -> String {
        let mut s = format!("/v1/sandboxes/{id}/files{op}?path=");
        s.push_str(&urlencode(path));
        s
    }

    /// Uploads a local file, streamed.
    pub async fn upload(
        &self,
        id: &str,
        local: &Path,
        remote: &str,
        token: Option<LeaseToken>,
    ) -> Result<u64, ClientError> {
        let file = tokio::fs::File::open(local)
            .await
            .map_err(ClientError::Io)?;
        let len = file.metadata().await.map_err(ClientError::Io)?.len();
        self.upload_sized(id, file, Some(len), remote, token).await
    }

    /// Uploads bytes held in memory.
    pub async fn write_file(
        &self,
        id: &str,
        remote: &str,
        data: Vec<u8>,
        token: Option<LeaseToken>,
    ) -> Result<u64, ClientError> {
        let rb = self
            .req(Method::PUT, &Self::files_url(id, "", remote))
            .body(data);
        let v: serde_json::Value = self.json(token_header(rb, token)).await?;
        Ok(v["bytes"].as_u64().unwrap_or(0))
    }

    /// Uploads whatever `reader` yields (stdin, say: its length unknown)
    /// as the file `remote`, streamed.
    pub async fn upload_reader<R>(
        &self,
        id: &str,
        reader: R,
        remote: &str,
        token: Option<LeaseToken>,
    ) -> Result<u64, ClientError>
    where
        R: tokio::io::AsyncRead + Send + 'static,
    {
        self.upload_sized(id, reader, None, remote, token).await
    }

    /// Uploads `reader` as the file `remote`, streamed; with `len`, the
    /// request declares it (`Content-Length`) and `reader` must yield exactly
    /// that many bytes.
    pub async fn upload_sized<R>(
        &self,
        id: &str,
        reader: R,
        len: Option<u64>,
        remote: &str,
        token: Option<LeaseToken>,
    ) -> Result<u64, ClientError>
    where
        R: tokio::io::AsyncRead + Send + 'static,
    {
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(reader));
        let mut rb = self.req(Method::PUT, &Self::files_url(id, "", remote));
        if let Some(len) = len {
            rb = rb.header(reqwest::header::CONTENT_LENGTH, len);
        }
        let v: serde_json::Value = self.json(token_header(rb.body(body), token)).await?;
        Ok(v["bytes"].as_u64().or(len).unwrap_or(0))
    }

    /// Streams the file `remote` into `out` (stdout, say).
    pub async fn download_to<W>(
        &self,
        id: &str,
        remote: &str,
        out: &mut W,
    ) -> Result<u64, ClientError>
    where
        W: tokio::io::AsyncWrite + Unpin,
    {
        let resp = self
            .send(self.req(Method::GET, &Self::files_url(id, "", remote)))
            .await?;
        let mut stream = resp.bytes_stream();
        let mut n = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(ClientError::Transport)?;
            n += chunk.len() as u64;
            tokio::io::AsyncWriteExt::write_all(out, &chunk)
                .await
                .map_err(ClientError::Io)?;
        }
        tokio::io::AsyncWriteExt::flush(out)
            .await
            .map_err(ClientError::Io)?;
        Ok(n)
    }

    /// Downloads a file into a local path, streamed.
    pub async fn download(&self, id: &str, remote: &str, local: &Path) -> Result<u64, ClientError> {
        let resp = self
            .send(self.req(Method::GET, &Self::files_url(id, "", remote)))
            .await?;
        let mut out = tokio::fs::File::create(local)
            .await
            .map_err(ClientError::Io)?;
        let mut stream = resp.bytes_stream();
        let mut n = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(ClientError::Transport)?;
            n += chunk.len() as u64;
            tokio::io::AsyncWriteExt::write_all(&mut out, &chunk)
                .await
                .map_err(ClientError::Io)?;
        }
        tokio::io::AsyncWriteExt::flush(&mut out)
            .await
            .map_err(ClientError::Io)?;
        Ok(n)
    }

    pub async fn read_file(&self, id: &str, remote: &str) -> Result<Vec<u8>, ClientError> {
        let resp = self
            .send(self.req(Method::GET, &Self::files_url(id, "", remote)))
            .await?;
        Ok(resp.bytes().await.map_err(ClientError::Transport)?.to_vec())
    }

    pub async fn list_files(&self, id: &str, path: &str) -> Result<FileList, ClientError> {
        self.json(self.req(Method::GET, &Self::files_url(id, "/list", path)))
            .await
    }

    pub async fn stat(&self, id: &str, path: &str) -> Result<FileInfo, ClientError> {
        self.json(self.req(Method::GET, &Self::files_url(id, "/stat", path)))
            .await
    }

    pub async fn mkdir(
        &self,
        id: &str,
        path: &str,
        token: Option<LeaseToken>,
    ) -> Result<(), ClientError> {
        let body = MkdirRequest {
            path: path.to_owned(),
            token,
        };
        self.send(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/files/mkdir"))
                .json(&body),
        )
        .await
        .map(|_| ())
    }

    pub async fn remove(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        token: Option<LeaseToken>,
    ) -> Result<(), ClientError> {
        let mut url = Self::files_url(id, "", path);
        if recursive {
            url.push_str("&recursive=true");
        }
        self.send(token_header(self.req(Method::DELETE, &url), token))
            .await
            .map(|_| ())
    }

    pub async fn acquire_lease(
        &self,
        id: &str,
        owner: &str,
        ttl_s: Option<u64>,
    ) -> Result<Lease, ClientError> {
        let body = AcquireLeaseRequest {
            owner: owner.to_owned(),
            ttl_s,
        };
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/lease"))
                .json(&body),
        )
        .await
    }

    pub async fn renew_lease(
        &self,
        id: &str,
        token: LeaseToken,
        ttl_s: Option<u64>,
    ) -> Result<Lease, ClientError> {
        let body = RenewLeaseRequest { token, ttl_s };
        self.json(
            self.req(Method::PUT, &format!("/v1/sandboxes/{id}/lease"))
                .json(&body),
        )
        .await
    }

    pub async fn release_lease(&self, id: &str, token: LeaseToken) -> Result<(), ClientError> {
        let body = ReleaseLeaseRequest { token };
        self.send(
            self.req(Method::DELETE, &format!("/v1/sandboxes/{id}/lease"))
                .json(&body),
        )
        .await
        .map(|_| ())
    }

    pub async fn events(
        &self,
        sandbox: Option<&str>,
        after: Option<i64>,
        limit: Option<u32>,
    ) -> Result<EventList, ClientError> {
        let mut q = Vec::new();
        if let Some(s) = sandbox {
            q.push(format!("sandbox={}", urlencode(s)));
        }
        if let Some(a) = after {
            q.push(format!("after={a}"));
        }
        if let Some(l) = limit {
            q.push(format!("limit={l}"));
        }
        let qs = if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        };
        self.json(self.req(Method::GET, &format!("/v1/events{qs}")))
            .await
    }

    /// The last `limit` events (of one sandbox when given), oldest first.
    pub async fn newest_events(
        &self,
        sandbox: Option<&str>,
        limit: u32,
    ) -> Result<EventList, ClientError> {
        let mut q = format!("?newest=true&limit={limit}");
        if let Some(s) = sandbox {
            q.push_str(&format!("&sandbox={}", urlencode(s)));
        }
        self.json(self.req(Method::GET, &format!("/v1/events{q}")))
            .await
    }

    /// `GET /v1/events/stream`: the events recorded after `after` (from now
    /// when `None`), pushed by the server as they happen.
    pub async fn follow_events(
        &self,
        sandbox: Option<&str>,
        after: Option<i64>,
    ) -> Result<EventStream, ClientError> {
        let mut q = Vec::new();
        if let Some(s) = sandbox {
            q.push(format!("sandbox={}", urlencode(s)));
        }
        if let Some(a) = after {
            q.push(format!("after={a}"));
        }
        let qs = if q.is_empty() {
            String::new()
        } else {
            format!("?{}", q.join("&"))
        };
        // no overall timeout: a followed stream lasts as long as the caller wants
        let resp = self
            .send(
                self.req(Method::GET, &format!("/v1/events/stream{qs}"))
                    .timeout(std::time::Duration::from_secs(365 * 24 * 3600)),
            )
            .await?;
        Ok(EventStream {
            events: sse_events(resp),
        })
    }

    pub async fn templates(&self) -> Result<TemplateList, ClientError> {
        self.json(self.req(Method::GET, "/v1/templates")).await
    }

    /// Imports a `docker save` or OCI image-layout tarball as template `name` (streamed upload).
    pub async fn import_template(
        &self,
        name: &str,
        archive: &Path,
    ) -> Result<Template, ClientError> {
        self.import_template_with(name, archive, false).await
    }

    /// [`Self::import_template`], replacing a template of that name when
    /// `force` (without it an existing name is a 409 `conflict`).
    pub async fn import_template_with(
        &self,
        name: &str,
        archive: &Path,
        force: bool,
    ) -> Result<Template, ClientError> {
        let file = tokio::fs::File::open(archive)
            .await
            .map_err(ClientError::Io)?;
        let len = file.metadata().await.map_err(ClientError::Io)?.len();
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
        self.json(
            self.req(
                Method::POST,
                &format!("/v1/templates/{}?force={force}", urlencode(name)),
            )
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(body),
        )
        .await
    }

    /// `POST /v1/plan` with a task context; the answer as JSON.
    pub async fn plan(
        &self,
        context: &serde_json::Value,
    ) -> Result<serde_json::Value, ClientError> {
        self.json(self.req(Method::POST, "/v1/plan").json(context))
            .await
    }

    /// `GET /v1/allocations`.
    pub async fn allocations(&self, limit: Option<u32>) -> Result<serde_json::Value, ClientError> {
        let q = limit.map(|l| format!("?limit={l}")).unwrap_or_default();
        self.json(self.req(Method::GET, &format!("/v1/allocations{q}")))
            .await
    }

    /// `GET /v1/pools` (admin).
    pub async fn pools(&self) -> Result<serde_json::Value, ClientError> {
        self.json(self.req(Method::GET, "/v1/pools")).await
    }

    /// `PUT /v1/pools/{class}`.
    pub async fn set_pool(
        &self,
        class: &str,
        min: u32,
        max: u32,
    ) -> Result<serde_json::Value, ClientError> {
        self.json(
            self.req(Method::PUT, &format!("/v1/pools/{}", urlencode(class)))
                .json(&serde_json::json!({"min": min, "max": max})),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/{action}` for pause, resume, reset and release.
    pub async fn sandbox_action(
        &self,
        id: &str,
        action: &str,
        token: Option<LeaseToken>,
    ) -> Result<Sandbox, ClientError> {
        self.json(token_header(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/{action}")),
            token,
        ))
        .await
    }

    /// `GET /v1/sandboxes/{id}/manifest`.
    pub async fn manifest(
        &self,
        id: &str,
        refresh: bool,
    ) -> Result<serde_json::Value, ClientError> {
        self.json(self.req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/manifest?refresh={refresh}"),
        ))
        .await
    }

    /// `GET /v1/sandboxes/{id}/usage`: live resource usage (memory, CPU
    /// time, processes, disk) beside the sandbox's limits.
    pub async fn sandbox_usage(
        &self,
        id: &str,
    ) -> Result<aviary_core::api::SandboxUsage, ClientError> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}/usage")))
            .await
    }

    /// [`Self::sandbox_usage`] of any tenant's sandbox (`all_tenants=true`;
    /// admin keys only).
    pub async fn sandbox_usage_any_tenant(
        &self,
        id: &str,
    ) -> Result<aviary_core::api::SandboxUsage, ClientError> {
        self.json(self.req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/usage?all_tenants=true"),
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/taint`: marks the sandbox never to be reused.
    pub async fn taint(&self, id: &str, reason: &str) -> Result<Sandbox, ClientError> {
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/taint"))
                .json(&serde_json::json!({ "reason": reason })),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/reset?level=N`.
    pub async fn reset(
        &self,
        id: &str,
        level: u8,
        token: Option<LeaseToken>,
    ) -> Result<Sandbox, ClientError> {
        self.json(token_header(
            self.req(
                Method::POST,
                &format!("/v1/sandboxes/{id}/reset?level={level}"),
            ),
            token,
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/snapshot?label=L`.
    pub async fn snapshot_labelled(
        &self,
        id: &str,
        label: &str,
        token: Option<LeaseToken>,
    ) -> Result<serde_json::Value, ClientError> {
        self.json(token_header(
            self.req(
                Method::POST,
                &format!("/v1/sandboxes/{id}/snapshot?label={}", urlencode(label)),
            ),
            token,
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/snapshot`.
    pub async fn snapshot(
        &self,
        id: &str,
        token: Option<LeaseToken>,
    ) -> Result<serde_json::Value, ClientError> {
        self.json(token_header(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/snapshot")),
            token,
        ))
        .await
    }

    /// `GET /v1/snapshots`.
    pub async fn snapshots(&self, sandbox: Option<&str>) -> Result<serde_json::Value, ClientError> {
        let q = sandbox
            .map(|s| format!("?sandbox={}", urlencode(s)))
            .unwrap_or_default();
        self.json(self.req(Method::GET, &format!("/v1/snapshots{q}")))
            .await
    }

    /// `POST /v1/sandboxes/{id}/fork`.
    pub async fn fork(
        &self,
        id: &str,
        snapshot: Option<&str>,
        token: Option<LeaseToken>,
    ) -> Result<CreateSandboxResponse, ClientError> {
        let body = serde_json::json!({"snapshot": snapshot, "token": token});
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/fork"))
                .json(&body),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/fork` with `{"live": true}`: a child
    /// running the sandbox's processes (runsc only; `unsupported` elsewhere).
    pub async fn fork_live(
        &self,
        id: &str,
        token: Option<LeaseToken>,
    ) -> Result<CreateSandboxResponse, ClientError> {
        let body = serde_json::json!({"live": true, "token": token});
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/fork"))
                .json(&body),
        )
        .await
    }

    /// `GET /v1/nodes` (admin).
    pub async fn nodes(&self) -> Result<serde_json::Value, ClientError> {
        self.json(self.req(Method::GET, "/v1/nodes")).await
    }

    /// `POST /v1/nodes`.
    pub async fn add_node(
        &self,
        id: &str,
        address: &str,
        token: &str,
    ) -> Result<serde_json::Value, ClientError> {
        let body = serde_json::json!({"id": id, "address": address, "token": token});
        self.json(self.req(Method::POST, "/v1/nodes").json(&body))
            .await
    }

    /// `POST /v1/keys` (admin): a new key for a tenant, its secret shown once.
    pub async fn create_key(&self, tenant: &str, admin: bool) -> Result<IssuedKey, ClientError> {
        let body = CreateKeyRequest {
            tenant: tenant.to_owned(),
            admin,
        };
        self.json(self.req(Method::POST, "/v1/keys").json(&body))
            .await
    }

    /// `GET /v1/keys` (admin): every key, revoked ones included; no secrets.
    pub async fn list_keys(&self) -> Result<Vec<ApiKeyInfo>, ClientError> {
        let list: KeyList = self.json(self.req(Method::GET, "/v1/keys")).await?;
        Ok(list.keys)
    }

    /// `DELETE /v1/keys/{id}` (admin): the key fails from the next request on.
    pub async fn revoke_key(&self, id: &str) -> Result<ApiKeyInfo, ClientError> {
        let segment = urlencode(id).replace('/', "%2F");
        self.json(self.req(Method::DELETE, &format!("/v1/keys/{segment}")))
            .await
    }

    /// `GET /metrics` (Prometheus text) with this client's key, which must be
    /// an admin key or the server's metrics token.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        self.send(self.req(Method::GET, "/metrics"))
            .await?
            .text()
            .await
            .map_err(ClientError::Transport)
    }

    /// The sandbox's processes (pid 1 is its envd).
    pub async fn list_processes(
        &self,
        id: &str,
    ) -> Result<aviary_core::api::ProcessList, ClientError> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}/processes")))
            .await
    }

    /// Sends a signal (`TERM`, `KILL`, ...; `None` = TERM) to one process.
    pub async fn signal_process(
        &self,
        id: &str,
        pid: i32,
        signal: Option<&str>,
        token: Option<LeaseToken>,
    ) -> Result<(), ClientError> {
        let body = aviary_core::api::SignalRequest {
            signal: signal.map(str::to_owned),
        };
        self.send(token_header(
            self.req(
                Method::POST,
                &format!("/v1/sandboxes/{id}/processes/{pid}/signal"),
            )
            .json(&body),
            token,
        ))
        .await
        .map(|_| ())
    }

    /// Starts a background command; answers its handle at once.
    pub async fn start_background(
        &self,
        id: &str,
        req: &ExecRequest,
    ) -> Result<aviary_core::api::BackgroundStarted, ClientError> {
        self.json(
            self.req(Method::POST, &format!("/v1/sandboxes/{id}/processes"))
                .json(req),
        )
        .await
    }

    /// What the sandbox kept of a background command's output, and its state.
    pub async fn background_output(
        &self,
        id: &str,
        handle: u64,
    ) -> Result<aviary_core::api::BackgroundOutput, ClientError> {
        self.json(self.req(
            Method::GET,
            &format!("/v1/sandboxes/{id}/processes/{handle}/output"),
        ))
        .await
    }

    /// Follows a background command: its kept output, new output, then its
    /// exit (events as `exec_stream`'s).
    pub async fn follow_background(
        &self,
        id: &str,
        handle: u64,
    ) -> Result<ExecStream, ClientError> {
        let resp = self
            .send(self.req(
                Method::GET,
                &format!("/v1/sandboxes/{id}/processes/{handle}/output?follow=true"),
            ))
            .await?;
        Ok(ExecStream {
            events: sse_events(resp),
        })
    }

    /// The proxy URL and port token of one port of a sandbox.
    pub async fn port_endpoint(
        &self,
        id: &str,
        port: u16,
    ) -> Result<aviary_core::api::PortEndpoint, ClientError> {
        self.json(self.req(Method::GET, &format!("/v1/sandboxes/{id}/endpoints/{port}")))
            .await
    }

    /// A raw request, for tests that send deliberately bad input.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        auth: Option<&str>,
    ) -> Result<(StatusCode, serde_json::Value), ClientError> {
        let mut rb = self.http.request(method, format!("{}{}", self.base, path));
        if let Some(k) = auth {
            rb = rb.bearer_auth(k);
        }
        if let Some(b) = body {
            rb = rb
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b);
        }
        let resp = rb.send().await.map_err(ClientError::Transport)?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(ClientError::Transport)?;
        let v = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        Ok((status, v))
    }
}

/// `POST /v1/keys` answer.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct IssuedKey {
    /// Public handle, for listing and revoking.
    pub id: String,
    pub tenant: String,
    pub admin: bool,
    /// The secret; the server never shows it again.
    pub key: String,
}

impl std::fmt::Debug for IssuedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedKey")
            .field("id", &self.id)
            .field("tenant", &self.tenant)
            .field("admin", &self.admin)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// An API key as listed (`GET /v1/keys`): never the secret.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ApiKeyInfo {
    pub id: String,
    pub tenant: String,
    pub admin: bool,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339, once revoked.
    #[serde(default)]
    pub revoked_at: Option<String>,
}

#[derive(serde::Deserialize)]
struct KeyList {
    keys: Vec<ApiKeyInfo>,
}

/// Which sandboxes `list_sandboxes_with` asks for.
#[derive(Clone, Debug, Default)]
pub struct SandboxFilter {
    /// Terminated ones too.
    pub all: bool,
    /// Labels every listed sandbox has.
    pub metadata: std::collections::BTreeMap<String, String>,
    /// A state name as the API shows it (`Idle`, `Hibernating`, ...).
    pub state: Option<String>,
    pub user_id: Option<String>,
    pub session_id: Option<String>,
}

/// Percent-encodes a query value (RFC 3986 unreserved characters and `/` pass).
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Whether `url` names a plain-HTTP server (no TLS to verify).
fn is_plain_http(url: &str) -> bool {
    url.get(..7)
        .is_some_and(|s| s.eq_ignore_ascii_case("http://"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_goes_without_trust_roots() {
        assert!(is_plain_http("http://127.0.0.1:7400"));
        assert!(is_plain_http("HTTP://host"));
        assert!(!is_plain_http("https://aviary.example"));
        assert!(!is_plain_http("http"));
        assert!(!is_plain_http(""));
    }

    /// An exec stream split at awkward chunk boundaries, with a keep-alive
    /// comment between the events, decodes into the same items.
    #[tokio::test]
    async fn sse_frames_decode_across_chunks() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let wire = format!(
            "event: stdout\ndata: {{\"type\":\"stdout\",\"data\":\"{}\"}}\n\n: keep-alive\n\n\
             event: exit\ndata: {{\"type\":\"exit\",\"result\":{{\"exit_code\":3,\"stdout\":\"\",\"stderr\":\"\",\"duration_ms\":1,\"timed_out\":false,\"oom_killed\":false}}}}\n\n",
            b64.encode(b"hi\n")
        );
        let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = wire
            .as_bytes()
            .chunks(7)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        let mut stream = ExecStream {
            events: sse_stream::SseStream::from_bytes_stream(futures_util::stream::iter(chunks))
                .boxed(),
        };
        match stream.next().await.unwrap().unwrap() {
            StreamItem::Stdout(d) => assert_eq!(d, b"hi\n"),
            other => panic!("unexpected {other:?}"),
        }
        match stream.next().await.unwrap().unwrap() {
            StreamItem::Exit(r) => assert_eq!(r.exit_code, 3),
            other => panic!("unexpected {other:?}"),
        }
        assert!(stream.next().await.unwrap().is_none());
    }

    #[test]
    fn urlencode_escapes_query_syntax() {
        assert_eq!(urlencode("/a b&c=d"), "/a%20b%26c%3Dd");
    }
}
