//! The server's adapters from concrete backends to the control plane's
//! backend traits: the local template store ([`LocalTemplates`]), the host's
//! directories as snapshot trees ([`HostTrees`]) and `aviary node` agents
//! over HTTP ([`AgentConnector`]). Backends are chosen in one place,
//! `crate::build`.

use async_trait::async_trait;
use aviary_control::{
    DefaultTemplateSource, LayerArchive, NodeAgent, NodeConnector, NodeSummary, OpError,
};
use aviary_core::SandboxId;
use aviary_envd_proto::EnvdClient;
use aviary_node::{LayerCallError, RemoteRuntime};
use aviary_registry::TemplateRecord;
use aviary_runtime::{Layer, Pausable, RuntimeError};
use aviary_scheduler::NodeView;
use aviary_snapshots::{
    ChunkStore, RestoreOptions, RestoreStats, SnapshotError, SnapshotManifest, SnapshotRequest,
};
use aviary_templates::{TemplateError, TemplateInfo, TemplateStore};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use time::OffsetDateTime;

/// The local content-addressed template store as the control plane's
/// catalog. Its calls block (file system), so they run on blocking threads.
pub struct LocalTemplates(pub Arc<TemplateStore>);

fn record(t: TemplateInfo) -> TemplateRecord {
    TemplateRecord {
        name: t.name,
        digest: t.digest,
        size_bytes: t.size_bytes,
        source: t.source,
        created_at: t.created_at,
        defaults: t.defaults,
    }
}

/// A template store error as the client sees it: its own code, and a
/// sentence without host details for the server-side ones.
pub fn template_error(e: TemplateError) -> OpError {
    let message = match &e {
        TemplateError::InvalidArchive(m) => m.clone(),
        e if e.code().is_server_error() => {
            "the template store cannot build templates on this host now".into()
        }
        e => e.to_string(),
    };
    OpError::layer(e.code(), message, e.into())
}

impl LocalTemplates {
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&TemplateStore) -> Result<T, TemplateError> + Send + 'static,
    ) -> Result<T, OpError> {
        let store = self.0.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(OpError::internal)?
            .map_err(template_error)
    }
}

#[async_trait]
impl aviary_control::TemplateCatalog for LocalTemplates {
    async fn get(&self, name: &str) -> Result<Option<TemplateRecord>, OpError> {
        let n = name.to_owned();
        Ok(self.blocking(move |s| s.get(&n)).await?.map(record))
    }

    async fn list(&self) -> Result<Vec<TemplateRecord>, OpError> {
        Ok(self
            .blocking(|s| s.list())
            .await?
            .into_iter()
            .map(record)
            .collect())
    }

    async fn import(&self, name: &str, archive: PathBuf) -> Result<TemplateRecord, OpError> {
        let n = name.to_owned();
        Ok(record(
            self.blocking(move |s| s.import_archive(&n, &archive))
                .await?,
        ))
    }

    async fn remove(&self, name: &str) -> Result<(), OpError> {
        let n = name.to_owned();
        self.blocking(move |s| s.remove(&n)).await
    }

    async fn prepare(
        &self,
        name: &str,
        source: DefaultTemplateSource,
        progress: aviary_control::backends::Progress,
    ) -> Result<TemplateRecord, OpError> {
        let n = name.to_owned();
        let built = self
            .blocking(move |s| {
                if let Some(t) = s.get(&n)? {
                    return Ok(t);
                }
                match source {
                    DefaultTemplateSource::Debootstrap if n == "default" => {
                        let mut p = |m: &str| progress(m);
                        s.ensure_default(&mut p)
                    }
                    _ => {
                        progress(&format!("building busybox template {n:?}"));
                        s.build_busybox(&n)
                    }
                }
            })
            .await?;
        Ok(record(built))
    }
}

/// Snapshot trees in this host's directories (what the local runtimes
/// export and stage). The tree walks' futures are not `Send` for every
/// lifetime (a rustc limitation with closures in stream combinators), so
/// each runs on a blocking thread of its own.
pub struct HostTrees;

async fn off_thread<F, Fut, T>(f: F) -> Result<T, SnapshotError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, SnapshotError>>,
    T: Send + 'static,
{
    let h = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || h.block_on(f()))
        .await
        .map_err(|e| SnapshotError::AccessFile {
            op: "run the tree walk",
            path: String::new(),
            source: std::io::Error::other(e),
        })?
}

#[async_trait]
impl aviary_control::TreeArchive for HostTrees {
    async fn snapshot(
        &self,
        store: Arc<dyn ChunkStore>,
        root: PathBuf,
        request: SnapshotRequest,
    ) -> Result<SnapshotManifest, SnapshotError> {
        off_thread(move || async move {
            aviary_snapshots::snapshot_dir(store.as_ref(), &root, request).await
        })
        .await
    }

    async fn restore(
        &self,
        store: Arc<dyn ChunkStore>,
        manifest: SnapshotManifest,
        target: PathBuf,
    ) -> Result<RestoreStats, SnapshotError> {
        off_thread(move || async move {
            aviary_snapshots::restore_dir(
                store.as_ref(),
                &manifest,
                &target,
                &RestoreOptions::default(),
            )
            .await
        })
        .await
    }

    async fn is_empty(&self, dir: PathBuf) -> bool {
        tokio::task::spawn_blocking(move || {
            std::fs::read_dir(&dir)
                .map(|mut r| r.next().is_none())
                .unwrap_or(true)
        })
        .await
        .unwrap_or(false)
    }
}

/// `aviary node` agents reached over HTTP with their bearer token.
pub struct AgentConnector;

/// One connected agent, and whether it snapshots its sandboxes' layers.
struct AgentNode(Arc<RemoteRuntime>, bool);

#[async_trait]
impl NodeAgent for AgentNode {
    fn runtime(&self) -> Arc<dyn Pausable> {
        self.0.clone()
    }

    fn envd(&self, id: &SandboxId) -> EnvdClient {
        self.0.envd(id)
    }

    fn layers(&self) -> Option<Arc<dyn LayerArchive>> {
        self.1
            .then(|| Arc::new(AgentLayers(self.0.clone())) as Arc<dyn LayerArchive>)
    }

    async fn view(&self, address: &str, now: OffsetDateTime) -> Result<NodeView, RuntimeError> {
        Ok(self
            .0
            .info()
            .await?
            .to_view(address.to_owned(), HashMap::new(), now))
    }
}

#[async_trait]
impl NodeConnector for AgentConnector {
    async fn connect(
        &self,
        address: &str,
        token: &str,
    ) -> Result<(Arc<dyn NodeAgent>, NodeSummary), RuntimeError> {
        let (rt, info) = RemoteRuntime::connect(address.to_owned(), token.to_owned()).await?;
        let summary = NodeSummary {
            runtimes: info.runtimes.clone(),
            cpu: info.capacity.cpu,
            memory_mb: info.capacity.memory_mb,
        };
        Ok((Arc::new(AgentNode(Arc::new(rt), info.snapshots)), summary))
    }
}

/// An agent's sandboxes' layers: the agent walks and writes its own
/// directories; chunks stream between it and the control plane's store.
struct AgentLayers(Arc<RemoteRuntime>);

fn layer_error(what: &'static str) -> impl FnOnce(LayerCallError) -> OpError {
    move |e| match e {
        LayerCallError::Node(e) => OpError::runtime(what)(e),
        LayerCallError::Snapshot(e) => e.into(),
    }
}

#[async_trait]
impl LayerArchive for AgentLayers {
    async fn snapshot_layer(
        &self,
        id: &SandboxId,
        layer: Layer,
        store: Arc<dyn ChunkStore>,
        request: SnapshotRequest,
    ) -> Result<SnapshotManifest, OpError> {
        self.0
            .snapshot_layer(id, layer, store.as_ref(), request)
            .await
            .map_err(layer_error("snapshot the layer on the node"))
    }

    async fn stage_layers(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        workspace: SnapshotManifest,
        writable: SnapshotManifest,
    ) -> Result<(), OpError> {
        self.0
            .stage_layers(id, store, workspace, writable)
            .await
            .map_err(layer_error("stage the layers on the node"))
    }

    async fn restore_workspace(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        manifest: SnapshotManifest,
    ) -> Result<(), OpError> {
        self.0
            .restore_workspace(id, store, manifest)
            .await
            .map_err(layer_error("restore the workspace on the node"))
    }

    async fn workspace_is_empty(&self, id: &SandboxId) -> Result<bool, OpError> {
        match self.0.workspace_is_empty(id).await {
            Ok(empty) => Ok(empty),
            Err(RuntimeError::NotFound { .. }) => Ok(true),
            Err(e) => Err(OpError::runtime("read the workspace on the node")(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_errors_keep_their_codes() {
        const SECRET: &str = "/var/lib/aviary/SECRET-detail";
        for e in [
            TemplateError::InvalidName("..".into()),
            TemplateError::NotFound("python".into()),
            TemplateError::InvalidArchive("layer digest mismatch".into()),
            TemplateError::MissingTool {
                tool: "debootstrap",
                hint: "apt-get install debootstrap",
            },
            TemplateError::FindMirror,
            TemplateError::CheckRootfs(SECRET.into()),
        ] {
            let code = e.code();
            let op = template_error(e);
            assert_eq!(op.code(), code);
            if code.is_server_error() {
                assert!(!op.public_message().contains("SECRET"), "{op:?}");
            }
        }
    }
}
