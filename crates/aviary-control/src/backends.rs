//! What the control plane is built over: [`Backends`], one trait object per
//! seam, chosen once by whoever builds the control plane (the server's
//! start-up; the unit tests pass in-memory fakes).
//!
//! | field | trait | embedded default | elsewhere |
//! |---|---|---|---|
//! | `registry` | [`Registry`] | SQLite (`aviary-registry-sqlite`) | PostgreSQL; `MemoryRegistry` in tests |
//! | `coordination` | [`LeaseStore`](aviary_leases::LeaseStore) + [`Locks`](aviary_leases::Locks) | the registry's lease table + in-process locks | Redis |
//! | `runtimes` | [`RuntimeSet`] of [`CapableRuntime`]s | crun and runc (`aviary-runtime-oci`) | `FakeRuntime` in tests |
//! | `chunks` | [`ChunkStore`] | local chunk dir | S3, Redis, PostgreSQL, memory |
//! | `trees` | [`TreeArchive`] | the host's directories (`aviary-snapshots`) | |
//! | `templates` | [`TemplateCatalog`] | the local template store (`aviary-templates`) | |
//! | `nodes` | [`NodeConnector`] | `aviary node` agents over HTTP (`aviary-node`) | none |
//!
//! Paths that cross these traits ([`TreeArchive`] directories, a template
//! archive) are opaque values to the control plane: it never opens them.
//!
//! Snapshots reach a sandbox's layers through a [`LayerArchive`] per node:
//! for the control plane's own runtimes, the runtime's [`Snapshottable`]
//! directories walked by the [`TreeArchive`] ([`RuntimeLayers`]); for a node
//! agent, [`NodeAgent::layers`] (the agent walks its own directories and
//! streams chunks, `aviary_node::layers`).

use crate::error::OpError;
use async_trait::async_trait;
use aviary_core::SandboxId;
use aviary_envd_proto::EnvdClient;
use aviary_leases::Coordination;
use aviary_registry::{Registry, TemplateRecord};
use aviary_runtime::{CapableRuntime, Layer, Pausable, RuntimeError, Snapshottable};
use aviary_scheduler::NodeView;
use aviary_snapshots::{
    ChunkStore, RestoreStats, SnapshotError, SnapshotManifest, SnapshotRequest,
};
use std::path::PathBuf;
use std::sync::Arc;
use time::OffsetDateTime;

/// Every backend the control plane uses.
pub struct Backends {
    pub registry: Arc<dyn Registry>,
    pub coordination: Coordination,
    pub runtimes: RuntimeSet,
    pub chunks: Arc<dyn ChunkStore>,
    pub trees: Arc<dyn TreeArchive>,
    pub templates: Arc<dyn TemplateCatalog>,
    pub nodes: Arc<dyn NodeConnector>,
}

/// The local runtimes, by name, side by side: a sandbox runs on the one its
/// record names (`SandboxRecord::runtime`, chosen per class or request), so
/// crun and runc (or a fake) can serve one control plane together.
#[derive(Clone, Debug)]
pub struct RuntimeSet {
    /// In configuration order; the first is the default.
    runtimes: Vec<CapableRuntime>,
}

impl RuntimeSet {
    /// A set with one runtime, the default.
    pub fn single(runtime: CapableRuntime) -> Self {
        RuntimeSet {
            runtimes: vec![runtime],
        }
    }

    /// A set of several runtimes; the first is the default. Two runtimes
    /// with one name are refused (a record could not say which it means).
    pub fn new(runtimes: Vec<CapableRuntime>) -> Result<Self, String> {
        if runtimes.is_empty() {
            return Err("a control plane needs at least one runtime".into());
        }
        for (i, r) in runtimes.iter().enumerate() {
            if runtimes[..i]
                .iter()
                .any(|o| o.runtime.name() == r.runtime.name())
            {
                return Err(format!(
                    "runtime {:?} is configured twice",
                    r.runtime.name()
                ));
            }
        }
        Ok(RuntimeSet { runtimes })
    }

    /// The default runtime (the first).
    pub fn default_runtime(&self) -> &CapableRuntime {
        &self.runtimes[0]
    }

    /// The runtime called `name`.
    pub fn get(&self, name: &str) -> Option<&CapableRuntime> {
        self.runtimes.iter().find(|r| r.runtime.name() == name)
    }

    /// Every runtime, the default first.
    pub fn all(&self) -> &[CapableRuntime] {
        &self.runtimes
    }

    /// Names of every runtime, the default first.
    pub fn names(&self) -> Vec<String> {
        self.runtimes
            .iter()
            .map(|r| r.runtime.name().to_owned())
            .collect()
    }
}

/// Turns a directory a runtime exported into a snapshot in a chunk store,
/// and a snapshot back into a directory a runtime staged. The control plane
/// holds these directories as values only; this backend reads and writes
/// them (on the host that has them).
#[async_trait]
pub trait TreeArchive: Send + Sync {
    /// Snapshots the tree at `root` into `store`.
    async fn snapshot(
        &self,
        store: Arc<dyn ChunkStore>,
        root: PathBuf,
        request: SnapshotRequest,
    ) -> Result<SnapshotManifest, SnapshotError>;
    /// Restores `manifest` into `target` (missing or empty).
    async fn restore(
        &self,
        store: Arc<dyn ChunkStore>,
        manifest: SnapshotManifest,
        target: PathBuf,
    ) -> Result<RestoreStats, SnapshotError>;
    /// True when `dir` has no entries (or is gone).
    async fn is_empty(&self, dir: PathBuf) -> bool;
}

/// How the default template is made when missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultTemplateSource {
    /// Debian bookworm minbase + python3, by debootstrap.
    Debootstrap,
    /// A tiny busybox tree (tests).
    Busybox,
}

/// Hears what a long preparation is doing (one line at a time).
pub type Progress = Box<dyn for<'a> Fn(&'a str) + Send>;

/// The templates this control plane can start sandboxes from: immutable
/// root file systems named by digest. Errors carry their code (a bad
/// archive is `invalid_archive`, a store failure `internal`).
#[async_trait]
pub trait TemplateCatalog: Send + Sync {
    async fn get(&self, name: &str) -> Result<Option<TemplateRecord>, OpError>;
    async fn list(&self) -> Result<Vec<TemplateRecord>, OpError>;
    /// Imports a `docker save` / OCI archive (an opaque path the caller
    /// spooled; the caller removes it afterwards).
    async fn import(&self, name: &str, archive: PathBuf) -> Result<TemplateRecord, OpError>;
    /// Removes the name (and its tree when no other name shares it); the
    /// caller has checked that nothing uses it.
    async fn remove(&self, name: &str) -> Result<(), OpError>;
    /// The template `name`, built from `source` first when it is missing;
    /// `progress` hears what is being done.
    async fn prepare(
        &self,
        name: &str,
        source: DefaultTemplateSource,
        progress: Progress,
    ) -> Result<TemplateRecord, OpError>;
}

/// The layers of the sandboxes of one node, snapshotted into and restored
/// from the chunk store, wherever the node is. Errors carry their codes.
#[async_trait]
pub trait LayerArchive: Send + Sync {
    /// Snapshots `layer` of sandbox `id` into `store` (`request.parent`, if
    /// any, is in `store`).
    async fn snapshot_layer(
        &self,
        id: &SandboxId,
        layer: Layer,
        store: Arc<dyn ChunkStore>,
        request: SnapshotRequest,
    ) -> Result<SnapshotManifest, OpError>;
    /// Stages both layers of sandbox `id`, which does not exist yet, from
    /// the two manifests; its next create adopts them.
    async fn stage_layers(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        workspace: SnapshotManifest,
        writable: SnapshotManifest,
    ) -> Result<(), OpError>;
    /// Restores `manifest` into the running sandbox's workspace (entries
    /// it already has are kept).
    async fn restore_workspace(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        manifest: SnapshotManifest,
    ) -> Result<(), OpError>;
    /// Whether the sandbox's workspace has no entries (true when its layers
    /// are gone with its compute).
    async fn workspace_is_empty(&self, id: &SandboxId) -> Result<bool, OpError>;
}

/// A local runtime's layers: its [`Snapshottable`] directories, read and
/// written by the [`TreeArchive`].
pub struct RuntimeLayers {
    pub runtime: Arc<dyn Snapshottable>,
    pub trees: Arc<dyn TreeArchive>,
}

#[async_trait]
impl LayerArchive for RuntimeLayers {
    async fn snapshot_layer(
        &self,
        id: &SandboxId,
        layer: Layer,
        store: Arc<dyn ChunkStore>,
        request: SnapshotRequest,
    ) -> Result<SnapshotManifest, OpError> {
        let layers = self
            .runtime
            .export_layers(id)
            .await
            .map_err(OpError::runtime("read the sandbox's layers"))?;
        let root = layers.layer(layer).to_owned();
        // one shadow dir per layer, where the runtime offers one (on ext4
        // or any file system without reflinks it stays empty)
        let request = match layers.shadow(layer) {
            Some(dir) => request.shadow(dir),
            None => request,
        };
        Ok(self.trees.snapshot(store, root, request).await?)
    }

    async fn stage_layers(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        workspace: SnapshotManifest,
        writable: SnapshotManifest,
    ) -> Result<(), OpError> {
        let stage = self
            .runtime
            .stage_layers(id)
            .await
            .map_err(OpError::runtime("stage the sandbox's layers"))?;
        self.trees
            .restore(store.clone(), workspace, stage.workspace)
            .await?;
        self.trees.restore(store, writable, stage.writable).await?;
        Ok(())
    }

    async fn restore_workspace(
        &self,
        id: &SandboxId,
        store: Arc<dyn ChunkStore>,
        manifest: SnapshotManifest,
    ) -> Result<(), OpError> {
        // restored beside the workspace, then merged in by the runtime (the
        // workspace is mounted and must stay the same directory)
        let staging = self
            .runtime
            .stage_workspace(id)
            .await
            .map_err(OpError::runtime("stage the workspace"))?;
        self.trees.restore(store, manifest, staging).await?;
        self.runtime
            .merge_workspace(id)
            .await
            .map_err(OpError::runtime("merge the restored workspace"))
    }

    async fn workspace_is_empty(&self, id: &SandboxId) -> Result<bool, OpError> {
        match self.runtime.export_layers(id).await {
            Ok(layers) => Ok(self.trees.is_empty(layers.workspace).await),
            Err(RuntimeError::NotFound { .. }) => Ok(true),
            Err(e) => Err(OpError::runtime("read the workspace")(e)),
        }
    }
}

/// What a node agent reports about itself at registration.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSummary {
    pub runtimes: Vec<String>,
    pub cpu: f64,
    pub memory_mb: u64,
}

/// A connected node agent: a runtime on another host, the envd of its
/// sandboxes, and its own view for the scheduler.
#[async_trait]
pub trait NodeAgent: Send + Sync {
    /// The agent's runtime (create, destroy, status, pause, ...).
    fn runtime(&self) -> Arc<dyn Pausable>;
    /// The envd of one of its sandboxes, reached through the agent.
    fn envd(&self, id: &SandboxId) -> EnvdClient;
    /// The node as the scheduler sees it now.
    async fn view(&self, address: &str, now: OffsetDateTime) -> Result<NodeView, RuntimeError>;
    /// Its sandboxes' layers, when the agent can snapshot them.
    fn layers(&self) -> Option<Arc<dyn LayerArchive>> {
        None
    }
}

/// Connects node agents (`aviary node`) by address and token.
#[async_trait]
pub trait NodeConnector: Send + Sync {
    async fn connect(
        &self,
        address: &str,
        token: &str,
    ) -> Result<(Arc<dyn NodeAgent>, NodeSummary), RuntimeError>;
}

/// A [`NodeConnector`] for control planes without node agents: every
/// registration is refused.
pub struct NoNodes;

#[async_trait]
impl NodeConnector for NoNodes {
    async fn connect(
        &self,
        address: &str,
        _token: &str,
    ) -> Result<(Arc<dyn NodeAgent>, NodeSummary), RuntimeError> {
        Err(RuntimeError::Unsupported {
            what: format!("node agents (asked to connect {address})"),
        })
    }
}
