//! [`RemoteRuntime`]: the control plane's client for one node agent,
//! usable wherever a local [`Runtime`] is.

use crate::api::*;
use crate::layers::{
    receive_snapshot, send_restore, wire_error, FrameReader, LayerSnapshotRequest, WorkspaceEmpty,
};
use async_trait::async_trait;
use aviary_core::SandboxId;
use aviary_envd_proto::EnvdClient;
use aviary_runtime::{Layer, Pausable, Runtime, RuntimeError, RuntimeStatus, SandboxSpec};
use aviary_snapshots::{ChunkStore, SnapshotError, SnapshotManifest, SnapshotRequest};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// A node agent's runtime, driven over its HTTP API. Cheap to clone.
///
/// Handles returned by `create` carry the *node's* host paths
/// (`control_dir`, `workspace_dir`); they are only meaningful on that node.
/// Talk to the sandbox's envd through [`RemoteRuntime::envd`].
#[derive(Clone)]
pub struct RemoteRuntime {
    addr: String,
    token: String,
    runtime_name: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for RemoteRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteRuntime")
            .field("addr", &self.addr)
            .field("runtime", &self.runtime_name)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// Longest any node API call may take (sandbox creation included).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a layer snapshot or restore may take (a large workspace).
const LAYER_TIMEOUT: Duration = Duration::from_secs(3600);

/// A layer call's failure: the node's answer (its runtime's code), or the
/// stream and the chunk store's.
#[derive(Debug, thiserror::Error)]
pub enum LayerCallError {
    #[error(transparent)]
    Node(#[from] RuntimeError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
}

impl RemoteRuntime {
    /// Connects to the node agent at `addr` (`host:port`): checks the token
    /// and learns the node's runtime name with one `GET /node/v1/info`.
    pub async fn connect(
        addr: impl Into<String>,
        token: impl Into<String>,
    ) -> Result<(RemoteRuntime, NodeInfo), RuntimeError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| RuntimeError::ProbeRuntime {
                reason: format!("build http client: {e}"),
            })?;
        let mut rt = RemoteRuntime {
            addr: addr.into(),
            token: token.into(),
            runtime_name: String::new(),
            http,
        };
        let info = rt.info().await?;
        rt.runtime_name =
            info.runtimes
                .first()
                .cloned()
                .ok_or_else(|| RuntimeError::ProbeRuntime {
                    reason: format!("node {} reports no runtime", rt.addr),
                })?;
        Ok((rt, info))
    }

    /// `host:port` of the node agent.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Capacity, committed and used resources, templates of the node.
    pub async fn info(&self) -> Result<NodeInfo, RuntimeError> {
        self.call(Method::GET, "/node/v1/info", None::<&()>, None)
            .await
    }

    /// A client for the sandbox's envd, through the node.
    pub fn envd(&self, id: &SandboxId) -> EnvdClient {
        EnvdClient::remote(self.addr.clone(), id.to_string(), self.token.clone())
    }

    /// Creates a sandbox from `template` (a digest `sha256:<hex>` or a name
    /// on the node); the node puts what it finds in `spec.template`. Binds must target
    /// paths the node provides (see [`CreateSandboxRequest`]).
    pub async fn create_from_template(
        &self,
        spec: &SandboxSpec,
        template: &str,
    ) -> Result<SandboxHandle, RuntimeError> {
        let body = CreateSandboxRequest {
            spec: spec.clone(),
            template: template.to_owned(),
        };
        self.call(
            Method::POST,
            "/node/v1/sandboxes",
            Some(&body),
            Some(&spec.id),
        )
        .await
    }

    /// Ships a template archive (`docker save` or OCI layout tarball) to the
    /// node, which imports it as `name`; streams the file.
    pub async fn upload_template(
        &self,
        name: &str,
        archive: &std::path::Path,
    ) -> Result<TemplateEntry, RuntimeError> {
        // Checked here too: a name like `..` would not even reach the route.
        aviary_templates::validate_name(name).map_err(|e| RuntimeError::InvalidSpec {
            reason: e.to_string(),
        })?;
        let file =
            tokio::fs::File::open(archive)
                .await
                .map_err(|source| RuntimeError::ReadFile {
                    path: archive.to_owned(),
                    source,
                })?;
        let path = format!("/node/v1/templates/{name}");
        let action = format!("node PUT {path}");
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
        let resp = self
            .http
            .put(format!("http://{}{path}", self.addr))
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
            .body(body)
            .send()
            .await
            .map_err(|e| RuntimeError::ProbeRuntime {
                reason: format!("node {} unreachable: {}", self.addr, error_chain(&e)),
            })?;
        if !resp.status().is_success() {
            return Err(self.error_from(resp, &action, None).await);
        }
        resp.json().await.map_err(|e| RuntimeError::InvokeRuntime {
            action,
            detail: format!("bad answer: {}", error_chain(&e)),
        })
    }

    async fn send<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<reqwest::Response, RuntimeError> {
        let mut req = self
            .http
            .request(method, format!("http://{}{path}", self.addr))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(b);
        }
        req.send().await.map_err(|e| RuntimeError::ProbeRuntime {
            reason: format!("node {} unreachable: {}", self.addr, error_chain(&e)),
        })
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        id: Option<&SandboxId>,
    ) -> Result<T, RuntimeError> {
        let action = format!("node {method} {path}");
        let resp = self.send(method, path, body).await?;
        if !resp.status().is_success() {
            return Err(self.error_from(resp, &action, id).await);
        }
        resp.json().await.map_err(|e| RuntimeError::InvokeRuntime {
            action,
            detail: format!("bad answer: {}", error_chain(&e)),
        })
    }

    async fn call_empty(
        &self,
        method: Method,
        path: &str,
        id: &SandboxId,
    ) -> Result<(), RuntimeError> {
        let action = format!("node {method} {path}");
        let resp = self.send(method, path, None::<&()>).await?;
        if !resp.status().is_success() {
            return Err(self.error_from(resp, &action, Some(id)).await);
        }
        Ok(())
    }

    /// Snapshots one layer of sandbox `id` on the node into `store`: the
    /// node streams the chunks `req.parent` lacks and the manifest, which
    /// is stored once every chunk it names is there (see [`crate::layers`]).
    pub async fn snapshot_layer(
        &self,
        id: &SandboxId,
        layer: Layer,
        store: &dyn ChunkStore,
        req: SnapshotRequest,
    ) -> Result<SnapshotManifest, LayerCallError> {
        let parent = match &req.parent {
            Some(p) => Some(store.get_manifest(&req.tenant, p).await?),
            None => None,
        };
        let body = LayerSnapshotRequest {
            tenant: req.tenant.clone(),
            label: req.label,
            sandbox_id: req.sandbox_id,
            parent: parent.clone(),
        };
        let path = format!("/node/v1/sandboxes/{id}/layers/{}/snapshot", layer.as_str());
        let resp = self
            .http
            .post(format!("http://{}{path}", self.addr))
            .bearer_auth(&self.token)
            .timeout(LAYER_TIMEOUT)
            .json(&body)
            .send()
            .await
            .map_err(|e| self.unreachable(&e))?;
        if !resp.status().is_success() {
            return Err(self
                .error_from(resp, &format!("node POST {path}"), Some(id))
                .await
                .into());
        }
        let reader = FrameReader::new(Box::pin(resp.bytes_stream()));
        Ok(receive_snapshot(store, reader, &req.tenant, parent.as_ref()).await?)
    }

    /// Stages both layers of sandbox `id` (not created yet) on the node from
    /// `workspace` and `writable`, read from `store`; its next create adopts
    /// them.
    pub async fn stage_layers(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        workspace: SnapshotManifest,
        writable: SnapshotManifest,
    ) -> Result<(), LayerCallError> {
        let path = format!("/node/v1/sandboxes/{id}/layers/stage");
        self.stream_restore(id, &path, store, vec![workspace, writable])
            .await
    }

    /// Restores `manifest` into the running sandbox `id`'s workspace on the
    /// node (entries the workspace already has are kept).
    pub async fn restore_workspace(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        manifest: SnapshotManifest,
    ) -> Result<(), LayerCallError> {
        let path = format!("/node/v1/sandboxes/{id}/workspace/restore");
        self.stream_restore(id, &path, store, vec![manifest]).await
    }

    /// Whether sandbox `id`'s workspace on the node has no entries.
    pub async fn workspace_is_empty(&self, id: &SandboxId) -> Result<bool, RuntimeError> {
        let path = format!("/node/v1/sandboxes/{id}/workspace/empty");
        let answer: WorkspaceEmpty = self.call(Method::GET, &path, None::<&()>, Some(id)).await?;
        Ok(answer.empty)
    }

    /// Posts `manifests` and their chunks from `store` as one streamed body.
    async fn stream_restore(
        &self,
        id: &SandboxId,
        path: &str,
        store: Arc<dyn ChunkStore>,
        manifests: Vec<SnapshotManifest>,
    ) -> Result<(), LayerCallError> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(8);
        let sender =
            tokio::spawn(async move { send_restore(store.as_ref(), &manifests, &tx).await });
        let body =
            reqwest::Body::wrap_stream(futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|frame| (frame, rx))
            }));
        let sent = self
            .http
            .post(format!("http://{}{path}", self.addr))
            .bearer_auth(&self.token)
            .timeout(LAYER_TIMEOUT)
            .body(body)
            .send()
            .await;
        // a store failure is the cause; the node's answer to the cut stream is not
        let read = sender
            .await
            .map_err(|e| wire_error("stream the restore", e.to_string()))?;
        read?;
        let resp = sent.map_err(|e| self.unreachable(&e))?;
        if !resp.status().is_success() {
            return Err(self
                .error_from(resp, &format!("node POST {path}"), Some(id))
                .await
                .into());
        }
        Ok(())
    }

    fn unreachable(&self, e: &reqwest::Error) -> RuntimeError {
        RuntimeError::ProbeRuntime {
            reason: format!("node {} unreachable: {}", self.addr, error_chain(e)),
        }
    }

    /// Rebuilds the runtime's error from the node's error answer: one with
    /// the same `code()` as the node's, so a remote failure answers the
    /// control plane's client as the same failure of the local runtime would.
    async fn error_from(
        &self,
        resp: reqwest::Response,
        action: &str,
        id: Option<&SandboxId>,
    ) -> RuntimeError {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        rebuild_error(&self.addr, status, text, action, id)
    }
}

/// The runtime error of a node's error answer (`status`, body `text`) to
/// `action` on sandbox `id` of the node at `addr`.
fn rebuild_error(
    addr: &str,
    status: StatusCode,
    text: String,
    action: &str,
    id: Option<&SandboxId>,
) -> RuntimeError {
    let (code, kind, message) = match serde_json::from_str::<ErrorAnswer>(&text) {
        Ok(a) => (a.error.code, a.error.kind, a.error.message),
        Err(_) => (String::new(), None, text),
    };
    // the finer name when there is one (agents of older versions sent it as
    // the code)
    let name = kind.as_deref().unwrap_or(&code);
    match (status, name, id) {
        (StatusCode::NOT_FOUND, "not_found", Some(id)) => RuntimeError::NotFound { id: id.clone() },
        (StatusCode::CONFLICT, "already_exists", Some(id)) => {
            RuntimeError::AlreadyExists { id: id.clone() }
        }
        (_, "unsupported", _) => RuntimeError::Unsupported { what: message },
        // sent bare; which node it was is not the tenant's business
        (_, "capacity_exhausted", _) => RuntimeError::CapacityExhausted { what: message },
        (_, "invalid_spec" | "invalid_request" | "template_missing" | "invalid_archive", _) => {
            RuntimeError::InvalidSpec {
                reason: format!("node {addr}: {message}"),
            }
        }
        (StatusCode::UNAUTHORIZED, _, _) => RuntimeError::ProbeRuntime {
            reason: format!("node {addr} refused the token"),
        },
        (StatusCode::SERVICE_UNAVAILABLE, _, _) => RuntimeError::ProbeRuntime {
            reason: format!("node {addr}: {message}"),
        },
        _ => RuntimeError::InvokeRuntime {
            action: action.to_owned(),
            detail: format!("{status}: {message}"),
        },
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    aviary_runtime::conformance::chain(e)
}

/// The template a control-plane spec names, as the node's API takes it: its
/// digest (a digest names the same tree on every node).
fn template_of(spec: &SandboxSpec) -> Result<&str, RuntimeError> {
    match spec.template.digest_hex() {
        Some(_) => Ok(&spec.template.digest),
        None => Err(RuntimeError::InvalidSpec {
            reason: format!(
                "template digest {:?} is not sha256:<64 hex>",
                spec.template.digest
            ),
        }),
    }
}

#[async_trait]
impl Runtime for RemoteRuntime {
    fn name(&self) -> &str {
        &self.runtime_name
    }

    /// Sends the spec; the node resolves `spec.template`'s digest in its
    /// own template store.
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        let template = template_of(spec)?;
        self.create_from_template(spec, template).await
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.call_empty(Method::DELETE, &format!("/node/v1/sandboxes/{id}"), id)
            .await
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        let path = format!("/node/v1/sandboxes/{id}/status");
        let resp = self.send(Method::GET, &path, None::<&()>).await?;
        // 404 carries {"status": "not_found"}: the trait's answer, not an error.
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(RuntimeStatus::NotFound);
        }
        if !resp.status().is_success() {
            return Err(self
                .error_from(resp, &format!("node GET {path}"), Some(id))
                .await);
        }
        let a: StatusAnswer = resp.json().await.map_err(|e| RuntimeError::InvokeRuntime {
            action: format!("node GET {path}"),
            detail: format!("bad answer: {}", error_chain(&e)),
        })?;
        Ok(a.status)
    }

    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        self.call(
            Method::GET,
            &format!("/node/v1/sandboxes/{id}/usage"),
            None::<&()>,
            Some(id),
        )
        .await
    }

    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        let l: SandboxList = self
            .call(Method::GET, "/node/v1/sandboxes", None::<&()>, None)
            .await?;
        Ok(l.sandboxes)
    }
}

#[async_trait]
impl Pausable for RemoteRuntime {
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.call_empty(Method::POST, &format!("/node/v1/sandboxes/{id}/pause"), id)
            .await
    }

    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.call_empty(Method::POST, &format!("/node/v1/sandboxes/{id}/resume"), id)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::{NetworkProfile, ResourceLimits};

    fn spec_at(digest: &str) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: aviary_runtime::TemplateRef {
                name: "t".into(),
                digest: digest.into(),
            },
            resources: ResourceLimits::default(),
            network: NetworkProfile::None,
            egress: None,
            hostname: "h".into(),
            init: vec!["/bin/sh".into()],
            env: vec![],
            binds: vec![],
        }
    }

    /// What the agent answers for a runtime failure (its `NodeError`).
    fn node_answer(e: RuntimeError) -> (StatusCode, String) {
        use axum::response::IntoResponse;
        let resp = crate::NodeError::Runtime(e).into_response();
        let status = StatusCode::from_u16(resp.status().as_u16()).unwrap();
        let body = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(axum::body::to_bytes(resp.into_body(), 1 << 16))
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    /// A runtime failure on a node comes back from `RemoteRuntime` as an
    /// error with the same code, so the control plane answers its client as
    /// for the same failure of its local runtime.
    #[test]
    fn remote_runtime_errors_keep_their_code() {
        let id = SandboxId::generate();
        for e in [
            RuntimeError::NotFound { id: id.clone() },
            RuntimeError::AlreadyExists { id: id.clone() },
            RuntimeError::Unsupported { what: "gpu".into() },
            RuntimeError::InvalidSpec {
                reason: "no rootfs".into(),
            },
            RuntimeError::ProbeRuntime {
                reason: "no crun".into(),
            },
            RuntimeError::CapacityExhausted {
                what: "all user-id ranges are in use".into(),
            },
            RuntimeError::InvokeRuntime {
                action: "crun run".into(),
                detail: "boom".into(),
            },
        ] {
            let code = e.code();
            let shown = e.to_string();
            let (status, text) = node_answer(e);
            let back = rebuild_error("10.0.0.1:7401", status, text, "node POST", Some(&id));
            assert_eq!(back.code(), code, "{back:?}");
            if matches!(
                back,
                RuntimeError::NotFound { .. }
                    | RuntimeError::AlreadyExists { .. }
                    | RuntimeError::Unsupported { .. }
                    | RuntimeError::CapacityExhausted { .. }
            ) {
                assert_eq!(back.to_string(), shown, "{back:?}");
            }
        }
    }

    /// Agents of older versions sent the finer name as the code and a
    /// capacity failure as a 500.
    #[test]
    fn answers_of_older_agents_still_rebuild() {
        let id = SandboxId::generate();
        let old = |status: u16, code: &str, message: &str| {
            rebuild_error(
                "10.0.0.1:7401",
                StatusCode::from_u16(status).unwrap(),
                serde_json::json!({"error": {"code": code, "message": message}}).to_string(),
                "node POST",
                Some(&id),
            )
        };
        assert!(matches!(
            old(409, "already_exists", "x"),
            RuntimeError::AlreadyExists { .. }
        ));
        assert!(matches!(
            old(400, "unsupported", "gpu"),
            RuntimeError::Unsupported { .. }
        ));
        assert!(matches!(
            old(400, "template_missing", "x"),
            RuntimeError::InvalidSpec { .. }
        ));
        assert_eq!(
            old(500, "internal", "x").code(),
            aviary_core::ErrorCode::Internal
        );
        // not even JSON
        let e = rebuild_error(
            "10.0.0.1:7401",
            StatusCode::BAD_GATEWAY,
            "<html>".into(),
            "node POST",
            Some(&id),
        );
        assert!(matches!(e, RuntimeError::InvokeRuntime { .. }), "{e:?}");
    }

    #[test]
    fn the_node_is_asked_for_the_template_digest() {
        let digest = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(template_of(&spec_at(&digest)).unwrap(), digest);
        for bad in [
            "/some/dir",
            "busybox",
            "sha256:abcd",
            &format!("sha256:{}", "zz".repeat(32)),
        ] {
            assert!(
                matches!(
                    template_of(&spec_at(bad)).unwrap_err(),
                    RuntimeError::InvalidSpec { .. }
                ),
                "{bad}"
            );
        }
    }
}
