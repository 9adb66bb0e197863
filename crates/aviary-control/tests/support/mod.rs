//! A control plane over in-memory fakes, for unit tests that need no root,
//! no crun and no database: [`MemoryRegistry`] (registry and lease store on
//! one storage, as SQLite is), in-process locks, a [`FakeRuntime`] whose
//! sandboxes serve a [`FakeEnvd`](aviary_fakes::FakeEnvd), an in-memory chunk
//! store and template catalog, no node agents.
#![allow(dead_code)] // each test binary uses part of the harness

use async_trait::async_trait;
use aviary_control::backends::Progress;
use aviary_control::requests::EventQuery;
use aviary_control::{
    Backends, Caller, ControlConfig, ControlPlane, DefaultTemplateSource, NoNodes, NodeAgent,
    NodeConnector, NodeSummary, OpContext, OpError, Readiness, RuntimeSet, TemplateCatalog,
    TreeArchive,
};
use aviary_core::SandboxId;
use aviary_envd_proto::EnvdClient;
use aviary_fakes::FakeRuntime;
use aviary_registry::{MemoryRegistry, TemplateRecord};
use aviary_runtime::{CapableRuntime, Pausable, RuntimeError};
use aviary_snapshots::{
    ChunkStore, RestoreStats, SnapshotError, SnapshotManifest, SnapshotRequest,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

impl Plane {
    /// Restarts over the same registry, runtime and `chunks` (the store the
    /// snapshots were written to), with a snapshottable runtime.
    pub async fn restart_keeping(
        self,
        cfg: ControlConfig,
        nodes: Arc<dyn NodeConnector>,
        chunks: Arc<dyn ChunkStore>,
    ) -> Plane {
        let Plane {
            cp,
            registry,
            runtime,
            ..
        } = self;
        drop(cp);
        plane_full(cfg, registry, runtime, nodes, chunks).await
    }
}

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
        defaults: Default::default(),
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
    async fn remove(&self, name: &str) -> Result<(), OpError> {
        self.templates.lock().unwrap().remove(name);
        Ok(())
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

/// The host's directories, as the server's tree archive reads and writes
/// them (`aviary_snapshots::snapshot_dir` / `restore_dir`): what the fake
/// runtime's snapshottable layers need.
pub struct DiskTrees;

/// Runs a chunk-store future on a blocking thread (its futures are not
/// `Send` for every lifetime; the server's tree archive does the same).
async fn off_thread<F, Fut, T>(f: F) -> Result<T, SnapshotError>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, SnapshotError>>,
    T: Send + 'static,
{
    let h = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || h.block_on(f()))
        .await
        .expect("tree walk panicked")
}

#[async_trait]
impl TreeArchive for DiskTrees {
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
                &aviary_snapshots::RestoreOptions::default(),
            )
            .await
        })
        .await
    }
    /// Taken as intact (like [`NoTrees`]): no test here loses a live
    /// workspace, and the control plane's crate has no file system.
    async fn is_empty(&self, _dir: PathBuf) -> bool {
        false
    }
}

/// `aviary node` agents over fake runtimes: `connect` hands out the agent
/// added at that address (refused while its runtime is unreachable).
#[derive(Default)]
pub struct FakeNodes {
    agents: Mutex<BTreeMap<String, (String, Arc<FakeRuntime>)>>,
}

impl FakeNodes {
    /// An agent `id` at `address` running `runtime`.
    pub fn add(&self, id: &str, address: &str, runtime: Arc<FakeRuntime>) {
        self.agents
            .lock()
            .unwrap()
            .insert(address.to_owned(), (id.to_owned(), runtime));
    }
}

#[async_trait]
impl NodeConnector for FakeNodes {
    async fn connect(
        &self,
        address: &str,
        _token: &str,
    ) -> Result<(Arc<dyn NodeAgent>, NodeSummary), RuntimeError> {
        let (id, runtime) = self
            .agents
            .lock()
            .unwrap()
            .get(address)
            .cloned()
            .ok_or_else(|| RuntimeError::ProbeRuntime {
                reason: format!("no fake agent at {address}"),
            })?;
        if runtime.is_unreachable() {
            return Err(RuntimeError::ProbeRuntime {
                reason: format!("fake agent at {address} is unreachable"),
            });
        }
        let summary = NodeSummary {
            runtimes: vec![aviary_runtime::Runtime::name(runtime.as_ref()).to_owned()],
            cpu: 16.0,
            memory_mb: 65_536,
        };
        Ok((Arc::new(FakeAgent { id, runtime }), summary))
    }
}

/// One fake agent: its runtime is the fake runtime; its sandboxes' envd
/// is reached on the fake envd's socket (on a socket nobody listens on
/// while the runtime is unreachable).
pub struct FakeAgent {
    id: String,
    runtime: Arc<FakeRuntime>,
}

#[async_trait]
impl NodeAgent for FakeAgent {
    fn runtime(&self) -> Arc<dyn Pausable> {
        self.runtime.clone()
    }
    fn envd(&self, id: &SandboxId) -> EnvdClient {
        match self.runtime.envd(id) {
            Some(e) if !self.runtime.is_unreachable() => EnvdClient::new(e.socket().to_path_buf()),
            _ => EnvdClient::new(self.runtime.root().join("nobody-listens.sock")),
        }
    }
    async fn view(
        &self,
        address: &str,
        now: time::OffsetDateTime,
    ) -> Result<aviary_scheduler::NodeView, RuntimeError> {
        if self.runtime.is_unreachable() {
            return Err(RuntimeError::ProbeRuntime {
                reason: "fake agent is unreachable".into(),
            });
        }
        Ok(aviary_scheduler::NodeView {
            id: self.id.clone(),
            address: address.to_owned(),
            runtimes: vec![aviary_runtime::Runtime::name(self.runtime.as_ref()).to_owned()],
            templates: vec![TEMPLATE_DIGEST.to_owned()],
            cpu_capacity: 16.0,
            memory_capacity_mb: 65_536,
            cpu_committed: 0.0,
            memory_committed_mb: 0,
            cpu_used: 0.0,
            memory_used_mb: 0,
            warm: Default::default(),
            healthy: true,
            last_seen: now,
        })
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
    plane_over(cfg, MemoryRegistry::new(), runtime).await
}

/// The fakes' backends over `registry`, with `runtimes` side by side (the
/// first is the default).
pub fn backends(
    registry: &MemoryRegistry,
    runtimes: &[Arc<FakeRuntime>],
    templates: Arc<MemoryTemplates>,
) -> Backends {
    backends_with(
        registry,
        runtimes.iter().map(|r| r.capable()).collect(),
        templates,
        Arc::new(NoTrees),
        Arc::new(NoNodes),
    )
}

/// [`backends`] with the runtimes seen through the capabilities given, a
/// tree archive and a node connector of the caller's.
pub fn backends_with(
    registry: &MemoryRegistry,
    runtimes: Vec<CapableRuntime>,
    templates: Arc<MemoryTemplates>,
    trees: Arc<dyn TreeArchive>,
    nodes: Arc<dyn NodeConnector>,
) -> Backends {
    Backends {
        registry: Arc::new(registry.clone()),
        coordination: aviary_leases::Coordination {
            leases: Arc::new(registry.clone()),
            locks: Arc::new(aviary_leases::InProcessLocks::new()),
            fences: Arc::new(registry.clone()),
        },
        runtimes: RuntimeSet::new(runtimes).expect("runtime set"),
        chunks: Arc::new(aviary_snapshots::MemoryStore::new()),
        trees,
        templates,
        nodes,
    }
}

/// A ready control plane over `backends`.
pub async fn ready(cfg: ControlConfig, backends: Backends) -> Arc<ControlPlane> {
    let cp = ControlPlane::new(cfg, backends).expect("control plane");
    cp.prepare(|_| {}).await.expect("prepare");
    assert_eq!(cp.readiness(), Readiness::Ready);
    cp
}

/// A ready control plane over fakes with the test configuration.
pub async fn plane() -> Plane {
    plane_with(config()).await
}

/// The context of a call by a (non-admin) key of tenant `name`, with no
/// request id and no lease token.
pub fn tenant(name: &str) -> OpContext {
    OpContext::new(Caller {
        tenant: name.to_owned(),
        admin: false,
    })
}

/// The context of a call by the bootstrap admin key.
pub fn admin() -> OpContext {
    OpContext::new(Caller {
        tenant: "default".into(),
        admin: true,
    })
}

/// `cx` presenting the lease token `token` (or none).
pub fn holding(cx: &OpContext, token: impl Into<Option<aviary_core::LeaseToken>>) -> OpContext {
    cx.clone().with_token(token)
}

// ---- helpers for the create, scope and pool tests ---------------------------

/// A tenant rule as open as the built-in `default` one; tests narrow it.
pub fn open_tenant(name: &str) -> aviary_config::Tenant {
    aviary_config::Tenant {
        name: name.to_owned(),
        max_sandboxes: 64,
        max_cpu: 128.0,
        max_memory_mb: 262_144,
        allowed_classes: aviary_config::Allowed::All,
        allowed_network_profiles: aviary_config::Allowed::All,
        allowed_runtimes: aviary_config::Allowed::All,
    }
}

/// One warm pool of `class` on the test template (`busybox`) and the fake's
/// runtime (`crun`), with no idle buffer beyond `pool_min`.
pub fn pool_settings(class: &str, pool_min: u32, pool_max: u32) -> aviary_config::PoolSettings {
    aviary_config::PoolSettings {
        class: class.to_owned(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min,
        pool_max,
        buffer_min: 0,
        buffer_max: 0,
    }
}

/// Every event of the caller's tenant (sandbox events and the others, such
/// as policy denials), oldest first.
pub async fn tenant_events(p: &Plane, cx: &OpContext) -> Vec<aviary_core::api::Event> {
    let all = EventQuery {
        limit: Some(1000),
        ..Default::default()
    };
    p.cp.events(cx, all).await.unwrap()
}

/// The events of one sandbox, oldest first.
pub async fn sandbox_events(
    p: &Plane,
    cx: &OpContext,
    id: &aviary_core::SandboxId,
) -> Vec<aviary_core::api::Event> {
    let of_sandbox = EventQuery {
        sandbox: Some(id.to_string()),
        after: None,
        limit: Some(1000),
        newest: false,
        all_tenants: false,
    };
    p.cp.events(cx, of_sandbox).await.unwrap()
}

/// The states a sandbox walked through, from its events (events that leave
/// the state as it is are skipped). Read from the registry directly, so it
/// works for pooled sandboxes before and after their claim too.
pub async fn state_path(p: &Plane, id: &aviary_core::SandboxId) -> Vec<aviary_core::SandboxState> {
    use aviary_registry::Registry;
    p.registry
        .list_events(&aviary_registry::EventFilter {
            tenant: None,
            sandbox_id: Some(id.clone()),
            after_id: None,
            limit: 1000,
            newest: false,
        })
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.old_state != e.new_state)
        .filter_map(|e| e.new_state)
        .collect()
}

/// The fake envd of a sandbox the fake runtime still has.
pub fn envd_of(p: &Plane, id: &aviary_core::SandboxId) -> aviary_fakes::FakeEnvd {
    p.runtime
        .envd(id)
        .unwrap_or_else(|| panic!("the fake runtime has no sandbox {id}"))
}

// ---- helpers for the lease, lifecycle and reconcile tests -------------------

/// A ready control plane over an existing `registry` and `runtime`: a
/// restarted server finds the rows and the sandboxes the previous one left
/// (start-up runs `reconcile_on_start`).
pub async fn plane_over(
    cfg: ControlConfig,
    registry: MemoryRegistry,
    runtime: Arc<FakeRuntime>,
) -> Plane {
    let templates = Arc::new(MemoryTemplates::default());
    let cp = ready(
        cfg,
        backends(&registry, std::slice::from_ref(&runtime), templates.clone()),
    )
    .await;
    Plane {
        cp,
        registry,
        runtime,
        templates,
    }
}

/// Simulates a server restart: the old control plane (and its in-process
/// state) goes, a new one starts over the same registry and runtime.
pub async fn restart(p: Plane) -> Plane {
    restart_with(p, config()).await
}

/// [`restart`] with `cfg`.
pub async fn restart_with(p: Plane, cfg: ControlConfig) -> Plane {
    let Plane {
        cp,
        registry,
        runtime,
        ..
    } = p;
    drop(cp);
    plane_over(cfg, registry, runtime).await
}

/// Waits until the fake envd's call log satisfies `done` and returns it.
/// The fake logs a call just after it sent the answer, so a client may see
/// the answer a moment before the log shows the call; the deadline only
/// turns a hang into a failure, it is not a timing assertion.
pub async fn calls_until(
    envd: &aviary_fakes::FakeEnvd,
    done: impl Fn(&[aviary_fakes::EnvdCall]) -> bool,
) -> Vec<aviary_fakes::EnvdCall> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let calls = envd.calls();
        if done(&calls) {
            return calls;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the fake envd never logged the expected calls: {calls:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// The fake envd's `method` calls once at least one is logged. The fake
/// logs a call just after sending its answer, so a caller that has its
/// answer may look a moment before the entry is there; this yields (no
/// sleep) until it is, and panics if it never comes.
pub async fn logged_calls(
    envd: &aviary_fakes::FakeEnvd,
    method: &str,
) -> Vec<aviary_fakes::EnvdCall> {
    for _ in 0..100_000 {
        let calls: Vec<_> = envd
            .calls()
            .into_iter()
            .filter(|c| c.method == method)
            .collect();
        if !calls.is_empty() {
            return calls;
        }
        tokio::task::yield_now().await;
    }
    panic!(
        "the fake envd never logged a {method} call: {:?}",
        envd.calls()
    )
}

// ---- helpers for the reconciler tests ---------------------------------------

/// A ready control plane over `registry` whose local runtime `runtime` can
/// snapshot (its layers on disk, [`DiskTrees`]), with node agents from
/// `nodes`. Note: the chunk store is new, so a restart over it loses the
/// snapshots' chunks; use [`Plane::restart_keeping`] for that.
pub async fn plane_full(
    cfg: ControlConfig,
    registry: MemoryRegistry,
    runtime: Arc<FakeRuntime>,
    nodes: Arc<dyn NodeConnector>,
    chunks: Arc<dyn ChunkStore>,
) -> Plane {
    let templates = Arc::new(MemoryTemplates::default());
    let mut b = backends_with(
        &registry,
        vec![runtime.snapshottable()],
        templates.clone(),
        Arc::new(DiskTrees),
        nodes,
    );
    b.chunks = chunks;
    let cp = ready(cfg, b).await;
    Plane {
        cp,
        registry,
        runtime,
        templates,
    }
}

/// A ready control plane with `cfg` whose runtime can snapshot, no agents.
pub async fn snapshot_plane(cfg: ControlConfig) -> Plane {
    plane_full(
        cfg,
        MemoryRegistry::new(),
        Arc::new(FakeRuntime::new().expect("fake runtime")),
        Arc::new(NoNodes),
        Arc::new(aviary_snapshots::MemoryStore::new()),
    )
    .await
}
