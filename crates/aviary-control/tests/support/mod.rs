//! A control plane over in-memory fakes, for unit tests that need no root,
//! no crun and no database: [`MemoryRegistry`] (registry and lease store on
//! one storage, as SQLite is), in-process locks, a [`FakeRuntime`] whose
//! sandboxes serve a [`FakeEnvd`](aviary_fakes::FakeEnvd), an in-memory chunk
//! store and template catalog, no node agents.
#![allow(dead_code)] // each test binary uses part of the harness

use async_trait::async_trait;
use aviary_control::backends::Progress;
use aviary_control::{
    Backends, Caller, ControlConfig, ControlPlane, DefaultTemplateSource, NoNodes, OpError,
    Readiness, RuntimeSet, TemplateCatalog, TreeArchive,
};
use aviary_fakes::FakeRuntime;
use aviary_registry::{MemoryRegistry, TemplateRecord};
use aviary_snapshots::{
    ChunkStore, RestoreStats, SnapshotError, SnapshotManifest, SnapshotRequest,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The digest every fake template has (the fake runtime resolves any).
pub const TEMPLATE_DIGEST: &str =
    "sha256:0000000000000000000000000000000000000000000000000000000000000001";

/// Templates in a map; `prepare` adds the default one when missing.
#[derive(Default)]
pub struct MemoryTemplates {
    pub templates: Mutex<BTreeMap<String, TemplateRecord>>,
}

pub fn template(name: &str) -> TemplateRecord {
    TemplateRecord {
        name: name.to_owned(),
        digest: TEMPLATE_DIGEST.to_owned(),
        size_bytes: 1,
        source: "fake".into(),
        created_at: aviary_core::now(),
    }
}

#[async_trait]
impl TemplateCatalog for MemoryTemplates {
    async fn get(&self, name: &str) -> Result<Option<TemplateRecord>, OpError> {
        Ok(self.templates.lock().unwrap().get(name).cloned())
    }
    async fn list(&self) -> Result<Vec<TemplateRecord>, OpError> {
        Ok(self.templates.lock().unwrap().values().cloned().collect())
    }
    async fn import(&self, name: &str, _archive: PathBuf) -> Result<TemplateRecord, OpError> {
        let t = template(name);
        self.templates
            .lock()
            .unwrap()
            .insert(name.to_owned(), t.clone());
        Ok(t)
    }
    async fn prepare(
        &self,
        name: &str,
        _source: DefaultTemplateSource,
        progress: Progress,
    ) -> Result<TemplateRecord, OpError> {
        progress("fake template");
        Ok(self
            .templates
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_insert_with(|| template(name))
            .clone())
    }
}

/// The fake runtime is not `Snapshottable`, so no tree ever reaches this;
/// a call is a bug in the control plane.
pub struct NoTrees;

#[async_trait]
impl TreeArchive for NoTrees {
    async fn snapshot(
        &self,
        _: Arc<dyn ChunkStore>,
        root: PathBuf,
        _: SnapshotRequest,
    ) -> Result<SnapshotManifest, SnapshotError> {
        panic!("snapshot of {root:?} without a Snapshottable runtime")
    }
    async fn restore(
        &self,
        _: Arc<dyn ChunkStore>,
        _: SnapshotManifest,
        target: PathBuf,
    ) -> Result<RestoreStats, SnapshotError> {
        panic!("restore into {target:?} without a Snapshottable runtime")
    }
    async fn is_empty(&self, _dir: PathBuf) -> bool {
        false
    }
}

/// One control plane over fakes, and handles to look behind its back.
pub struct Plane {
    pub cp: Arc<ControlPlane>,
    pub registry: MemoryRegistry,
    pub runtime: Arc<FakeRuntime>,
    pub templates: Arc<MemoryTemplates>,
}

/// The configuration the tests use: busybox default template, no idle
/// hibernation, built-in classes and pools.
pub fn config() -> ControlConfig {
    let mut cfg = ControlConfig::from_settings(
        aviary_config::Config::default(),
        PathBuf::from("/nonexistent/envd"),
    );
    cfg.default_template = "busybox".into();
    cfg.default_template_source = DefaultTemplateSource::Busybox;
    cfg.idle_hibernate_s = None;
    cfg.local_cpu = 64.0;
    cfg.local_memory_mb = 256 * 1024;
    cfg
}

/// A ready control plane over fakes with `cfg`.
pub async fn plane_with(cfg: ControlConfig) -> Plane {
    let runtime = Arc::new(FakeRuntime::new().expect("fake runtime"));
    plane_on(cfg, runtime).await
}

/// A ready control plane whose local runtime is `runtime`.
pub async fn plane_on(cfg: ControlConfig, runtime: Arc<FakeRuntime>) -> Plane {
    let registry = MemoryRegistry::new();
    let templates = Arc::new(MemoryTemplates::default());
    let backends = Backends {
        registry: Arc::new(registry.clone()),
        coordination: aviary_leases::Coordination {
            leases: Arc::new(registry.clone()),
            locks: Arc::new(aviary_leases::InProcessLocks::new()),
        },
        runtimes: RuntimeSet::single(runtime.capable()),
        chunks: Arc::new(aviary_snapshots::MemoryStore::new()),
        trees: Arc::new(NoTrees),
        templates: templates.clone(),
        nodes: Arc::new(NoNodes),
    };
    let cp = ControlPlane::new(cfg, backends).expect("control plane");
    cp.prepare(|_| {}).await.expect("prepare");
    assert_eq!(cp.readiness(), Readiness::Ready);
    Plane {
        cp,
        registry,
        runtime,
        templates,
    }
}

/// A ready control plane over fakes with the test configuration.
pub async fn plane() -> Plane {
    plane_with(config()).await
}

pub fn tenant(name: &str) -> Caller {
    Caller {
        tenant: name.to_owned(),
        admin: false,
    }
}

pub fn admin() -> Caller {
    Caller {
        tenant: "default".into(),
        admin: true,
    }
}
