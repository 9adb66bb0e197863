//! The node agent: an axum server over one host's runtime.
//!
//! Handlers are thin: authenticate (middleware), extract, call the runtime or
//! the template store, map the error in [`crate::NodeError`]. The agent's
//! own state is the table of sandboxes it created ([`PlacedSandbox`]), kept
//! in memory behind a mutex (held only for map operations, never across an
//! await) and mirrored to one JSON file per sandbox, written with
//! write-then-rename, so a restarted agent can still reach their envd sockets
//! and account their limits.

use crate::api::*;
use crate::error::NodeError;
use crate::layers::{
    Frame, FrameReader, LayerSnapshotRequest, SinkStore, StreamStore, WorkspaceEmpty,
};
use aviary_core::SandboxId;
use aviary_runtime::{Layer, Pausable, RuntimeStatus, Snapshottable};
use aviary_templates::TemplateStore;
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Everything a node agent needs.
pub struct NodeConfig {
    /// Stable node id (recorded as the sandbox's `node`).
    pub id: String,
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// Shared secret the control plane presents as `Bearer`. Not empty.
    pub token: String,
    pub runtime: Arc<dyn Pausable>,
    /// The same runtime as [`Snapshottable`], when it is: the node then
    /// snapshots and restores its sandboxes' layers for the control plane
    /// ([`crate::layers`]).
    pub layers: Option<Arc<dyn Snapshottable>>,
    /// The node's own template store.
    pub templates: TemplateStore,
    /// Where the agent keeps its sandbox table (created if missing).
    pub state_dir: PathBuf,
    pub capacity: Capacity,
    /// Host files the node binds into sandboxes that ask for them (normally
    /// just [`ProvidedBind::envd`]).
    pub provided_binds: Vec<ProvidedBind>,
}

impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("id", &self.id)
            .field("listen", &self.listen)
            .field("token", &"<redacted>")
            .field("runtime", &self.runtime.name())
            .field("templates", &self.templates.root())
            .field("state_dir", &self.state_dir)
            .field("capacity", &self.capacity)
            .field("provided_binds", &self.provided_binds)
            .finish()
    }
}

/// A started node agent. Dropping it does not stop the server; call
/// [`RunningNode::stop`]. Sandboxes outlive the agent.
#[derive(Debug)]
pub struct RunningNode {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl RunningNode {
    /// The address the agent listens on (the `node_addr` of its clients).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections and waits for in-flight requests.
    /// Spliced envd connections already open keep running until they end.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match (&mut self.task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "node server ended with an error"),
            Err(e) => tracing::warn!(error = %e, "node server task failed"),
        }
    }
}

struct Node {
    id: String,
    token_hash: [u8; 32],
    runtime: Arc<dyn Pausable>,
    layers: Option<Arc<dyn Snapshottable>>,
    templates: TemplateStore,
    state_dir: PathBuf,
    capacity: Capacity,
    provided_binds: Vec<ProvidedBind>,
    placed: Mutex<HashMap<SandboxId, PlacedSandbox>>,
    /// Last (time, cpu_usage_ns) per sandbox, for the CPU rate in `info`.
    cpu_samples: Mutex<HashMap<SandboxId, (Instant, u64)>>,
}

type Shared = Arc<Node>;

/// Starts a node agent; returns once it accepts connections.
pub async fn start_node(cfg: NodeConfig) -> Result<RunningNode, NodeError> {
    if cfg.token.is_empty() {
        return Err(NodeError::InvalidRequest {
            reason: "the node token must not be empty".into(),
        });
    }
    for b in &cfg.provided_binds {
        if !b.sandbox.starts_with('/') || !b.host.is_absolute() {
            return Err(NodeError::InvalidRequest {
                reason: format!("provided bind {b:?} needs absolute paths"),
            });
        }
    }
    let table_dir = cfg.state_dir.join("sandboxes");
    tokio::fs::create_dir_all(&table_dir)
        .await
        .map_err(|source| NodeError::WriteState {
            path: table_dir.clone(),
            source,
        })?;
    let placed = load_table(&table_dir, cfg.runtime.as_ref()).await?;
    let node = Arc::new(Node {
        id: cfg.id,
        token_hash: Sha256::digest(cfg.token.as_bytes()).into(),
        runtime: cfg.runtime,
        layers: cfg.layers,
        templates: cfg.templates,
        state_dir: cfg.state_dir,
        capacity: cfg.capacity,
        provided_binds: cfg.provided_binds,
        placed: Mutex::new(placed),
        cpu_samples: Mutex::new(HashMap::new()),
    });
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| NodeError::BindListener {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| NodeError::BindListener {
            addr: cfg.listen,
            source,
        })?;
    let (tx, rx) = oneshot::channel::<()>();
    let app = router(node);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = rx.await;
            })
            .await
    });
    tracing::info!(%addr, "node agent listening");
    Ok(RunningNode {
        addr,
        shutdown: Some(tx),
        task,
    })
}

fn router(node: Shared) -> Router {
    Router::new()
        .route("/node/v1/info", get(info))
        .route("/node/v1/sandboxes", get(list).post(create))
        .route("/node/v1/sandboxes/{id}", axum::routing::delete(destroy))
        .route("/node/v1/sandboxes/{id}/status", get(status))
        .route("/node/v1/sandboxes/{id}/usage", get(usage))
        .route("/node/v1/sandboxes/{id}/pause", post(pause))
        .route("/node/v1/sandboxes/{id}/resume", post(resume))
        .route("/node/v1/sandboxes/{id}/envd", get(envd))
        .route(
            "/node/v1/sandboxes/{id}/layers/{layer}/snapshot",
            post(snapshot_layer),
        )
        .route("/node/v1/sandboxes/{id}/layers/stage", post(stage_layers))
        .route(
            "/node/v1/sandboxes/{id}/workspace/restore",
            post(restore_workspace),
        )
        .route(
            "/node/v1/sandboxes/{id}/workspace/empty",
            get(workspace_empty),
        )
        .route(
            "/node/v1/templates/{name}",
            axum::routing::put(put_template),
        )
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                Json(ErrorAnswer {
                    error: ErrorDetail {
                        code: aviary_core::ErrorCode::NotFound.as_str().into(),
                        kind: None,
                        message: "no such route".into(),
                    },
                }),
            )
        })
        // Applies to the fallback too: unauthenticated callers learn nothing.
        .layer(middleware::from_fn_with_state(node.clone(), authenticate))
        .with_state(node)
}

async fn authenticate(State(node): State<Shared>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Comparing fixed-size hashes in constant time leaks neither the
    // token's bytes nor its length.
    let hash: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    let diff = hash
        .iter()
        .zip(node.token_hash.iter())
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    if presented.is_empty() || diff != 0 {
        return NodeError::Unauthorized.into_response();
    }
    next.run(req).await
}

fn parse_id(raw: &str) -> Result<SandboxId, NodeError> {
    raw.parse().map_err(|e| NodeError::InvalidRequest {
        reason: format!("bad sandbox id: {e}"),
    })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, NodeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(NodeError::JoinTask)
}

async fn info(State(node): State<Shared>) -> Result<Json<NodeInfo>, NodeError> {
    let store = node.templates.clone();
    let templates = blocking(move || store.list())
        .await?
        .map_err(NodeError::ListTemplates)?
        .into_iter()
        .map(|t| TemplateEntry {
            name: t.name,
            digest: t.digest,
        })
        .collect();
    let placed: Vec<(SandboxId, aviary_core::ResourceLimits)> = {
        let map = node.placed.lock().unwrap_or_else(|p| p.into_inner());
        map.iter().map(|(id, p)| (id.clone(), p.limits)).collect()
    };
    let mut committed = Capacity::default();
    let mut used = Capacity::default();
    let mut samples = Vec::new();
    for (id, limits) in &placed {
        committed.cpu += limits.cpu;
        committed.memory_mb += limits.memory_mb;
        // A sandbox gone or paused mid-way simply does not count as used.
        if let Ok(u) = node.runtime.usage(id).await {
            used.memory_mb += u.memory_current_bytes / (1024 * 1024);
            samples.push((id.clone(), Instant::now(), u.cpu_usage_ns));
        }
    }
    {
        let mut prev = node.cpu_samples.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = HashMap::new();
        for (id, at, ns) in samples {
            if let Some((t0, ns0)) = prev.get(&id) {
                let dt = at.duration_since(*t0).as_secs_f64();
                if dt > 0.0 && ns >= *ns0 {
                    used.cpu += (ns - ns0) as f64 / 1e9 / dt;
                }
            }
            next.insert(id, (at, ns));
        }
        *prev = next;
    }
    Ok(Json(NodeInfo {
        id: node.id.clone(),
        runtimes: vec![node.runtime.name().to_owned()],
        templates,
        capacity: node.capacity,
        committed,
        used,
        sandboxes: placed.len(),
        snapshots: node.layers.is_some(),
    }))
}

async fn list(State(node): State<Shared>) -> Result<Json<SandboxList>, NodeError> {
    Ok(Json(SandboxList {
        sandboxes: node.runtime.list().await?,
    }))
}

async fn create(
    State(node): State<Shared>,
    body: Result<Json<CreateSandboxRequest>, JsonRejection>,
) -> Result<(StatusCode, Json<SandboxHandle>), NodeError> {
    let Json(CreateSandboxRequest { mut spec, template }) =
        body.map_err(|e| NodeError::InvalidRequest {
            reason: e.body_text(),
        })?;
    let store = node.templates.clone();
    let wanted = template.clone();
    let found = blocking(move || find_template(&store, &wanted))
        .await?
        .map_err(NodeError::ListTemplates)?;
    let (digest, name) = found.ok_or(NodeError::FindTemplate { template })?;
    // the node's runtime resolves the digest in this node's store
    spec.template = aviary_runtime::TemplateRef {
        name,
        digest: digest.clone(),
    };
    for bind in &mut spec.binds {
        let provided = node
            .provided_binds
            .iter()
            .find(|p| p.sandbox == bind.sandbox)
            .ok_or_else(|| NodeError::InvalidRequest {
                reason: format!(
                    "bind at {:?}: this node binds only the files it provides ({})",
                    bind.sandbox,
                    node.provided_binds
                        .iter()
                        .map(|p| p.sandbox.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
        bind.host = provided.host.clone();
        bind.read_only = true;
    }
    let handle = node.runtime.create(&spec).await?;
    let placed = PlacedSandbox {
        handle: handle.clone(),
        limits: spec.resources,
        template: digest,
    };
    if let Err(e) = write_entry(&node.state_dir, &placed).await {
        // Without its table entry the sandbox would be unreachable: undo it.
        let undo = node.runtime.destroy(&spec.id).await;
        if let Err(u) = undo {
            tracing::warn!(error = %aviary_runtime::conformance::chain(&u), "undo create");
        }
        return Err(e);
    }
    tracing::info!(sandbox.id = %spec.id, template = %placed.template, "sandbox created");
    node.placed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(spec.id.clone(), placed);
    Ok((StatusCode::CREATED, Json(handle)))
}

/// A digest (`sha256:<hex>`) or a name → (digest, name).
fn find_template(
    store: &TemplateStore,
    wanted: &str,
) -> Result<Option<(String, String)>, aviary_templates::TemplateError> {
    if wanted.starts_with("sha256:") {
        Ok(store
            .list()?
            .into_iter()
            .find(|t| t.digest == wanted)
            .map(|t| (t.digest, t.name)))
    } else if aviary_templates::validate_name(wanted).is_ok() {
        Ok(store.get(wanted)?.map(|t| (t.digest, t.name)))
    } else {
        Ok(None)
    }
}

async fn destroy(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<StatusCode, NodeError> {
    let id = parse_id(&id)?;
    node.runtime.destroy(&id).await?;
    tracing::info!(sandbox.id = %id, "sandbox destroyed");
    node.placed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id);
    let path = entry_path(&node.state_dir, &id);
    match tokio::fs::remove_file(&path).await {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(NodeError::WriteState { path, source }),
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn status(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<Response, NodeError> {
    let id = parse_id(&id)?;
    let status = node.runtime.status(&id).await?;
    let code = if status == RuntimeStatus::NotFound {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::OK
    };
    Ok((code, Json(StatusAnswer { status })).into_response())
}

async fn usage(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<ResourceUsage>, NodeError> {
    let id = parse_id(&id)?;
    Ok(Json(node.runtime.usage(&id).await?))
}

async fn pause(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<StatusCode, NodeError> {
    let id = parse_id(&id)?;
    node.runtime.pause(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn resume(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<StatusCode, NodeError> {
    let id = parse_id(&id)?;
    node.runtime.resume(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Upgrades the connection and splices it to the sandbox's envd socket.
async fn envd(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    mut req: Request,
) -> Result<Response, NodeError> {
    let id = parse_id(&id)?;
    let wants = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(ENVD_UPGRADE_PROTOCOL));
    if !wants {
        return Err(NodeError::InvalidRequest {
            reason: format!(
                "this route needs `Connection: Upgrade` and `Upgrade: {ENVD_UPGRADE_PROTOCOL}`"
            ),
        });
    }
    let endpoint = {
        let map = node.placed.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&id)
            .map(|p| p.handle.envd_endpoint())
            .ok_or_else(|| NodeError::FindSandbox { id: id.to_string() })?
    };
    // Connect before answering 101, so that "envd not up yet" is an HTTP
    // error the client can retry on, not a dead stream.
    let unix = UnixStream::connect(&endpoint.socket)
        .await
        .map_err(|source| NodeError::ConnectEnvd {
            id: id.to_string(),
            source,
        })?;
    // The socket is host-only, and its peer must be the sandbox's init:
    // anything else is not this sandbox's envd.
    let peer = unix.peer_cred().ok().and_then(|c| c.pid());
    if peer != i32::try_from(endpoint.peer_pid).ok() {
        return Err(NodeError::ConnectEnvd {
            id: id.to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "envd socket peer is pid {peer:?}, not the sandbox init {}",
                    endpoint.peer_pid
                ),
            ),
        });
    }
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => splice(hyper_util::rt::TokioIo::new(upgraded), unix).await,
            Err(e) => tracing::warn!(error = %e, "envd upgrade failed"),
        }
    });
    Ok(Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, ENVD_UPGRADE_PROTOCOL)
        .body(Body::empty())
        .expect("static response parts are valid"))
}

/// Copies bytes both ways until either side is done, then closes both: a
/// client that goes away closes envd's connection (envd then kills a running
/// exec), and envd closing after its final frame ends the client's stream.
async fn splice<T>(client: T, envd: UnixStream)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut er, mut ew) = envd.into_split();
    tokio::select! {
        _ = tokio::io::copy(&mut cr, &mut ew) => {}
        r = tokio::io::copy(&mut er, &mut cw) => {
            if r.is_ok() {
                let _ = cw.shutdown().await;
            }
        }
    }
}

/// The node's runtime as `Snapshottable`, or `invalid_request` saying it
/// is not.
fn layers_of(node: &Node) -> Result<Arc<dyn Snapshottable>, NodeError> {
    node.layers
        .clone()
        .ok_or_else(|| NodeError::InvalidRequest {
            reason: format!(
                "runtime {} on node {} cannot snapshot sandbox layers",
                node.runtime.name(),
                node.id
            ),
        })
}

/// How restores write on a node: as the snapshot recorded owners (the
/// runtime shifts them into the sandbox's ids when it adopts the tree),
/// one chunk at a time in manifest order (the request body's order).
fn restore_options() -> aviary_snapshots::RestoreOptions {
    aviary_snapshots::RestoreOptions {
        fetch_concurrency: 1,
        ..Default::default()
    }
}

/// Runs a tree walk or restore (it borrows across awaits, and blocks on
/// the file system) on a blocking thread.
async fn off_thread<F, Fut>(f: F) -> Result<(), aviary_snapshots::SnapshotError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), aviary_snapshots::SnapshotError>>,
{
    let h = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || h.block_on(f()))
        .await
        .map_err(|e| crate::layers::wire_error("run the restore", e.to_string()))?
}

/// Snapshots one layer; the answer streams its new chunks, then its
/// manifest (or an error frame), see [`crate::layers`].
async fn snapshot_layer(
    State(node): State<Shared>,
    UrlPath((id, layer)): UrlPath<(String, String)>,
    body: Result<Json<LayerSnapshotRequest>, JsonRejection>,
) -> Result<Response, NodeError> {
    let id = parse_id(&id)?;
    let layer: Layer = layer
        .parse()
        .map_err(|reason| NodeError::InvalidRequest { reason })?;
    let Json(req) = body.map_err(|e| NodeError::InvalidRequest {
        reason: e.body_text(),
    })?;
    let layers = layers_of(&node)?;
    let exported = layers.export_layers(&id).await?;
    let root = exported.layer(layer).to_owned();
    let parent_id = req.parent.as_ref().map(|p| p.id.clone());
    let mut snap = aviary_snapshots::SnapshotRequest::new(req.tenant, req.label);
    snap.sandbox_id = req.sandbox_id;
    snap.parent = parent_id;
    // the node's own shadow dir, never one named by the request
    snap.shadow = exported.shadow(layer);
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    let h = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        h.block_on(async move {
        let sink = SinkStore::new(tx.clone(), req.parent);
        let last = match aviary_snapshots::snapshot_dir(&sink, &root, snap).await {
            Ok(_) => match sink.take_manifest() {
                Some(m) => Frame::Manifest(Box::new(m)),
                None => Frame::Error("the snapshot stored no manifest".into()),
            },
            Err(e) => {
                tracing::warn!(sandbox.id = %id, layer = layer.as_str(), error = %e, "layer snapshot failed");
                Frame::Error(format!("snapshot of {} failed: {e}", layer.as_str()))
            }
        };
        let _ = tx.send(last.encode()).await;
    })
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|frame| (Ok::<_, std::convert::Infallible>(frame), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .body(Body::from_stream(stream))
        .map_err(|e| NodeError::InvalidRequest {
            reason: e.to_string(),
        })
}

/// Stages both layers of a sandbox that does not exist yet from the body's
/// stream (workspace, then writable); the next create adopts them.
async fn stage_layers(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
    body: Body,
) -> Result<StatusCode, NodeError> {
    let id = parse_id(&id)?;
    let layers = layers_of(&node)?;
    let stage = layers.stage_layers(&id).await?;
    let stream = body.into_data_stream();
    let restored = off_thread(move || async move {
        let src = StreamStore::new(FrameReader::new(stream));
        for dir in [stage.workspace, stage.writable] {
            let m = src.next_manifest().await?;
            aviary_snapshots::restore_dir(&src, &m, &dir, &restore_options()).await?;
        }
        Ok(())
    })
    .await;
    if let Err(e) = restored {
        // a half-written stage is never adopted
        let _ = layers.destroy(&id).await;
        return Err(NodeError::Layers(e));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Restores a workspace into a running sandbox: beside it, then merged in
/// (entries it already has are kept).
async fn restore_workspace(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
    body: Body,
) -> Result<StatusCode, NodeError> {
    let id = parse_id(&id)?;
    let layers = layers_of(&node)?;
    let staging = layers.stage_workspace(&id).await?;
    let stream = body.into_data_stream();
    off_thread(move || async move {
        let src = StreamStore::new(FrameReader::new(stream));
        let m = src.next_manifest().await?;
        aviary_snapshots::restore_dir(&src, &m, &staging, &restore_options())
            .await
            .map(drop)
    })
    .await
    .map_err(NodeError::Layers)?;
    layers.merge_workspace(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Whether a sandbox's workspace has no entries.
async fn workspace_empty(
    State(node): State<Shared>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<WorkspaceEmpty>, NodeError> {
    let id = parse_id(&id)?;
    let ws = layers_of(&node)?.export_layers(&id).await?.workspace;
    let empty = blocking(move || match std::fs::read_dir(&ws) {
        Ok(mut rd) => rd.next().is_none(),
        Err(_) => true,
    })
    .await?;
    Ok(Json(WorkspaceEmpty { empty }))
}

/// Streams a template archive to a file under the state dir, then imports
/// it into the node's store (which verifies every blob and layer digest).
async fn put_template(
    State(node): State<Shared>,
    UrlPath(name): UrlPath<String>,
    body: Body,
) -> Result<(StatusCode, Json<TemplateEntry>), NodeError> {
    use futures_util::StreamExt;
    aviary_templates::validate_name(&name).map_err(NodeError::ImportTemplate)?;
    let dir = node.state_dir.join("uploads");
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |source| NodeError::WriteState { path, source }
    };
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(write_err(&dir))?;
    let path = dir.join(format!("{}.tar", aviary_core::new_id("upload")));
    let received = async {
        let mut file = tokio::fs::File::create(&path)
            .await
            .map_err(write_err(&path))?;
        let mut stream = body.into_data_stream();
        let limit = MAX_TEMPLATE_UPLOAD_MB * 1024 * 1024;
        let mut total = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(NodeError::ReceiveUpload)?;
            total += chunk.len() as u64;
            if total > limit {
                return Err(NodeError::UploadTooLarge {
                    limit_mb: MAX_TEMPLATE_UPLOAD_MB,
                });
            }
            file.write_all(&chunk).await.map_err(write_err(&path))?;
        }
        file.flush().await.map_err(write_err(&path))
    }
    .await;
    let imported = match received {
        Ok(()) => {
            let store = node.templates.clone();
            let (name, archive) = (name.clone(), path.clone());
            blocking(move || store.import_archive(&name, &archive)).await
        }
        Err(e) => Err(e),
    };
    // The archive is not kept either way.
    let _ = tokio::fs::remove_file(&path).await;
    let info = imported?.map_err(NodeError::ImportTemplate)?;
    Ok((
        StatusCode::CREATED,
        Json(TemplateEntry {
            name: info.name,
            digest: info.digest,
        }),
    ))
}

fn entry_path(state_dir: &Path, id: &SandboxId) -> PathBuf {
    state_dir.join("sandboxes").join(format!("{id}.json"))
}

async fn write_entry(state_dir: &Path, placed: &PlacedSandbox) -> Result<(), NodeError> {
    let path = entry_path(state_dir, &placed.handle.id);
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec(placed).expect("PlacedSandbox serializes");
    let write = async {
        tokio::fs::write(&tmp, &bytes).await?;
        tokio::fs::rename(&tmp, &path).await
    };
    write
        .await
        .map_err(|source| NodeError::WriteState { path, source })
}

/// Reads the sandbox table, keeping the entries the runtime still has.
async fn load_table(
    dir: &Path,
    runtime: &dyn Pausable,
) -> Result<HashMap<SandboxId, PlacedSandbox>, NodeError> {
    let read_err = |source| NodeError::ReadState {
        path: dir.to_owned(),
        source,
    };
    let live = runtime.list().await?;
    let mut table = HashMap::new();
    let mut rd = tokio::fs::read_dir(dir).await.map_err(read_err)?;
    while let Some(entry) = rd.next_entry().await.map_err(read_err)? {
        let path = entry.path();
        let parsed = tokio::fs::read(&path)
            .await
            .ok()
            .and_then(|b| serde_json::from_slice::<PlacedSandbox>(&b).ok());
        match parsed {
            Some(p) if live.contains(&p.handle.id) => {
                table.insert(p.handle.id.clone(), p);
            }
            // Gone from the runtime, a torn write, or junk: forget it.
            _ => {
                let _ = tokio::fs::remove_file(&path).await;
            }
        }
    }
    Ok(table)
}
