//! [`FakeRuntime`]: a [`Runtime`] + [`Pausable`] whose sandboxes are a map
//! entry, two empty host directories and a [`FakeEnvd`].
//!
//! Layout under the fake's own temporary directory, like the OCI runtime's:
//! `<root>/<id>/control/envd.sock` (the control dir) and
//! `<root>/<id>/workspace`. Concurrency: one std mutex over the sandbox map,
//! never held across an await; everything `create` does after its hold point
//! happens under it, so creates of one id cannot race.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use aviary_core::SandboxId;
use aviary_runtime::{
    validate_spec, CapableRuntime, EnvdEndpoint, LayerExport, LayerStage, Pausable, ResourceUsage,
    Runtime, RuntimeError, RuntimeStatus, SandboxHandle, SandboxSpec, Snapshottable,
    ENVD_SOCKET_NAME, WORKSPACE_MOUNT,
};
use tokio::sync::Notify;

use crate::FakeEnvd;

/// What `usage` reports for a new sandbox: PID 1 and some memory, no OOM kill.
pub const INITIAL_USAGE: ResourceUsage = ResourceUsage {
    memory_current_bytes: 16 * 1024 * 1024,
    memory_peak_bytes: 16 * 1024 * 1024,
    cpu_usage_ns: 0,
    oom_kills: 0,
    pids_current: 1,
    disk_free_bytes: None,
};

struct FakeSandbox {
    handle: SandboxHandle,
    envd: FakeEnvd,
    status: RuntimeStatus,
    usage: ResourceUsage,
}

#[derive(Default)]
struct State {
    sandboxes: BTreeMap<SandboxId, FakeSandbox>,
    created_specs: Vec<SandboxSpec>,
    create_failures: VecDeque<RuntimeError>,
    create_holds: VecDeque<Arc<HoldInner>>,
    /// Ids whose create adopted staged layers, in order.
    seeded: Vec<SandboxId>,
}

/// A runtime for unit tests: no root, no crun, no processes.
pub struct FakeRuntime {
    name: String,
    root: tempfile::TempDir,
    state: Mutex<State>,
    creates: AtomicU64,
    destroys: AtomicU64,
    frozen_kills: AtomicU64,
    /// Every call fails as if the host (a node agent) did not answer.
    unreachable: AtomicBool,
}

impl std::fmt::Debug for FakeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeRuntime")
            .field("name", &self.name)
            .field("root", &self.root.path())
            .field("live", &self.live_ids())
            .finish()
    }
}

#[derive(Default)]
struct HoldInner {
    entered: Notify,
    released: Notify,
}

/// Holds one `create` at its start until released (see
/// [`FakeRuntime::hold_next_create`]). Dropping the hold releases it.
pub struct CreateHold {
    inner: Arc<HoldInner>,
}

impl CreateHold {
    /// Waits until a create is waiting on this hold.
    pub async fn entered(&self) {
        self.inner.entered.notified().await;
    }

    /// Lets the held create go on (also before it arrived).
    pub fn release(&self) {
        self.inner.released.notify_one();
    }
}

impl Drop for CreateHold {
    fn drop(&mut self) {
        self.release();
    }
}

impl FakeRuntime {
    /// A fake named `"crun"` with its own temporary directory (under `/tmp`,
    /// so socket paths stay short), removed when the fake is dropped.
    pub fn new() -> io::Result<FakeRuntime> {
        let root = tempfile::Builder::new()
            .prefix("aviary-fake-rt-")
            .tempdir_in(short_tmp())?;
        Ok(FakeRuntime {
            name: "crun".to_owned(),
            root,
            state: Mutex::new(State::default()),
            creates: AtomicU64::new(0),
            destroys: AtomicU64::new(0),
            frozen_kills: AtomicU64::new(0),
            unreachable: AtomicBool::new(false),
        })
    }

    /// The same fake under another backend name.
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> FakeRuntime {
        self.name = name.into();
        self
    }

    /// The fake seen as a runtime without optional capabilities (one that
    /// can neither pause nor snapshot, as Kubernetes): the control plane
    /// never reaches its `Pausable` side.
    pub fn basic(self: &Arc<Self>) -> CapableRuntime {
        CapableRuntime::basic(self.clone())
    }

    /// The fake seen through the capabilities it has: pausable, not
    /// snapshottable.
    pub fn capable(self: &Arc<Self>) -> CapableRuntime {
        CapableRuntime {
            runtime: self.clone(),
            pausable: Some(self.clone()),
            snapshottable: None,
            checkpointable: None,
        }
    }

    /// The fake seen through every capability, snapshots included: a
    /// snapshot reads the fake envd's files as layers on disk
    /// (`<root>/<id>/{workspace,upper}`), a create adopts staged layers
    /// (`<root>/<id>.seed/`) into its new envd's files, a workspace merge
    /// adds the staged files the workspace lacks.
    pub fn snapshottable(self: &Arc<Self>) -> CapableRuntime {
        CapableRuntime {
            runtime: self.clone(),
            pausable: Some(self.clone()),
            snapshottable: Some(self.clone()),
            checkpointable: None,
        }
    }

    /// While `true`, every runtime call fails as an unreachable host's
    /// would (`list` included: a node agent that stopped answering); the
    /// sandboxes and their envds are left as they are.
    pub fn set_unreachable(&self, unreachable: bool) {
        self.unreachable.store(unreachable, Ordering::SeqCst);
    }

    /// Whether [`FakeRuntime::set_unreachable`] is on.
    pub fn is_unreachable(&self) -> bool {
        self.unreachable.load(Ordering::SeqCst)
    }

    fn reachable(&self) -> Result<(), RuntimeError> {
        if !self.is_unreachable() {
            return Ok(());
        }
        Err(RuntimeError::Spawn {
            program: format!("fake runtime {}", self.name),
            source: io::Error::new(io::ErrorKind::ConnectionRefused, "host unreachable"),
        })
    }

    /// Ids whose create adopted staged layers (a restore), in order.
    pub fn seeded_creates(&self) -> Vec<SandboxId> {
        self.state().seeded.clone()
    }

    fn seed_dir(&self, id: &SandboxId) -> PathBuf {
        self.root.path().join(format!("{id}.seed"))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fake's own directory (sandbox directories live below it).
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    fn sandbox_dir(&self, id: &SandboxId) -> PathBuf {
        self.root.path().join(id.as_str())
    }

    /// The next create fails with `err` (after its validation passed);
    /// queued failures are used up one per create.
    pub fn fail_next_create(&self, err: RuntimeError) {
        self.state().create_failures.push_back(err);
    }

    /// The next `n` creates fail with what `make` returns.
    pub fn fail_next_creates(&self, n: usize, make: impl Fn() -> RuntimeError) {
        let mut s = self.state();
        for _ in 0..n {
            s.create_failures.push_back(make());
        }
    }

    /// The next create waits at its start until the returned hold is
    /// released or dropped. Holds queue up, one per create.
    pub fn hold_next_create(&self) -> CreateHold {
        let inner = Arc::new(HoldInner::default());
        self.state().create_holds.push_back(Arc::clone(&inner));
        CreateHold { inner }
    }

    /// Specs of every successful create, in order.
    pub fn created_specs(&self) -> Vec<SandboxSpec> {
        self.state().created_specs.clone()
    }

    /// The sandboxes that exist (running, paused or stopped).
    pub fn live_ids(&self) -> Vec<SandboxId> {
        self.state().sandboxes.keys().cloned().collect()
    }

    /// The fake envd of an existing sandbox.
    pub fn envd(&self, id: &SandboxId) -> Option<FakeEnvd> {
        self.state().sandboxes.get(id).map(|s| s.envd.clone())
    }

    /// The handle `create` returned for an existing sandbox.
    pub fn handle(&self, id: &SandboxId) -> Option<SandboxHandle> {
        self.state().sandboxes.get(id).map(|s| s.handle.clone())
    }

    /// Calls of `create`, failed ones included.
    pub fn create_calls(&self) -> u64 {
        self.creates.load(Ordering::SeqCst)
    }

    /// Calls of `destroy`, of unknown ids included.
    pub fn destroy_calls(&self) -> u64 {
        self.destroys.load(Ordering::SeqCst)
    }

    /// How often `end_frozen_processes` was called for an existing sandbox.
    pub fn frozen_kill_calls(&self) -> u64 {
        self.frozen_kills.load(Ordering::SeqCst)
    }

    /// Sets what `usage` reports; `false` for an unknown sandbox.
    pub fn set_usage(&self, id: &SandboxId, usage: ResourceUsage) -> bool {
        self.update_usage(id, |u| *u = usage)
    }

    /// Changes what `usage` reports (e.g. `|u| u.oom_kills += 1` to
    /// simulate an OOM kill); `false` for an unknown sandbox.
    pub fn update_usage(&self, id: &SandboxId, f: impl FnOnce(&mut ResourceUsage)) -> bool {
        match self.state().sandboxes.get_mut(id) {
            Some(s) => {
                f(&mut s.usage);
                true
            }
            None => false,
        }
    }

    /// PID 1 exited: the envd dies, status becomes `Stopped`, the sandbox is
    /// still listed until destroyed. `false` for an unknown sandbox.
    pub async fn crash(&self, id: &SandboxId) -> bool {
        let envd = {
            let mut s = self.state();
            let Some(sbx) = s.sandboxes.get_mut(id) else {
                return false;
            };
            sbx.status = RuntimeStatus::Stopped;
            sbx.usage.pids_current = 0;
            sbx.envd.clone()
        };
        envd.die().await;
        true
    }

    /// The host lost the sandbox: its envd dies, its directories go, and
    /// the runtime no longer knows it (status `NotFound`, not listed).
    /// `false` for an unknown sandbox.
    pub async fn vanish(&self, id: &SandboxId) -> bool {
        let Some(sbx) = self.state().sandboxes.remove(id) else {
            return false;
        };
        sbx.envd.die().await;
        let _ = std::fs::remove_dir_all(self.sandbox_dir(id));
        true
    }

    /// Everything `create` does once it may go on, under the state lock.
    fn create_locked(
        &self,
        s: &mut State,
        spec: &SandboxSpec,
    ) -> Result<SandboxHandle, RuntimeError> {
        if let Some(err) = s.create_failures.pop_front() {
            return Err(err);
        }
        if s.sandboxes.contains_key(&spec.id) {
            return Err(RuntimeError::AlreadyExists {
                id: spec.id.clone(),
            });
        }
        let dir = self.sandbox_dir(&spec.id);
        let control = dir.join("control");
        let workspace = dir.join("workspace");
        let made = make_dirs(&[&control, &workspace]).and_then(|()| {
            FakeEnvd::start(control.join(ENVD_SOCKET_NAME)).map_err(|source| RuntimeError::Spawn {
                program: "fake envd".into(),
                source,
            })
        });
        let envd = match made {
            Ok(envd) => envd,
            Err(e) => return Err(e.with_cleanup(remove_dir(&dir))),
        };
        let handle = SandboxHandle {
            id: spec.id.clone(),
            runtime: self.name.clone(),
            runtime_instance_id: spec.id.to_string(),
            control_dir: control,
            workspace_dir: workspace,
            init_pid: envd.peer_pid(),
            envd: None,
        };
        s.sandboxes.insert(
            spec.id.clone(),
            FakeSandbox {
                handle: handle.clone(),
                envd,
                status: RuntimeStatus::Running,
                usage: INITIAL_USAGE,
            },
        );
        s.created_specs.push(spec.clone());
        Ok(handle)
    }

    fn set_paused(&self, id: &SandboxId, paused: bool) -> Result<(), RuntimeError> {
        let mut s = self.state();
        let sbx = s
            .sandboxes
            .get_mut(id)
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })?;
        let action = if paused { "pause" } else { "resume" };
        if sbx.status == RuntimeStatus::Stopped {
            return Err(RuntimeError::InvokeRuntime {
                action: action.into(),
                detail: format!("sandbox {id} is stopped"),
            });
        }
        if paused {
            sbx.status = RuntimeStatus::Paused;
            sbx.envd.freeze();
        } else {
            sbx.status = RuntimeStatus::Running;
            sbx.envd.thaw();
        }
        Ok(())
    }
}

/// `/tmp` when it exists (unix socket paths are limited to 108 bytes),
/// else the platform's temporary directory.
fn short_tmp() -> PathBuf {
    let tmp = Path::new("/tmp");
    if tmp.is_dir() {
        tmp.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn make_dirs(dirs: &[&Path]) -> Result<(), RuntimeError> {
    for d in dirs {
        std::fs::create_dir_all(d).map_err(|source| RuntimeError::CreateDir {
            path: d.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

fn remove_dir(dir: &Path) -> Result<(), RuntimeError> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(RuntimeError::RemoveDir {
            path: dir.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

#[async_trait]
impl Runtime for FakeRuntime {
    fn name(&self) -> &str {
        &self.name
    }

    /// `none` and `allowlist` (the fake records the rules it is given); no
    /// NAT, so never `open`.
    fn enforces_network(&self, profile: aviary_core::NetworkProfile) -> bool {
        profile != aviary_core::NetworkProfile::Open
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        self.creates.fetch_add(1, Ordering::SeqCst);
        let hold = self.state().create_holds.pop_front();
        if let Some(hold) = hold {
            hold.entered.notify_one();
            hold.released.notified().await;
        }
        self.reachable()?;
        validate_spec(spec)?;
        if !self.enforces_network(spec.network) {
            return Err(RuntimeError::Unsupported {
                what: format!("network profile {:?}", spec.network.as_str()),
            });
        }
        let handle = {
            let mut s = self.state();
            self.create_locked(&mut s, spec)?
        };
        let seed = self.seed_dir(&spec.id);
        if seed.is_dir() {
            let adopted = self.adopt(&spec.id, &seed);
            if let Err(e) = adopted {
                let cleanup = self.destroy(&spec.id).await;
                return Err(e.with_cleanup(cleanup));
            }
            self.state().seeded.push(spec.id.clone());
        }
        Ok(handle)
    }

    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.destroys.fetch_add(1, Ordering::SeqCst);
        self.reachable()?;
        let sbx = self.state().sandboxes.remove(id);
        if let Some(sbx) = sbx {
            sbx.envd.die().await;
        }
        remove_dir(&self.seed_dir(id))?;
        remove_dir(&self.sandbox_dir(id))
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        self.reachable()?;
        Ok(self
            .state()
            .sandboxes
            .get(id)
            .map_or(RuntimeStatus::NotFound, |s| s.status))
    }

    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        self.reachable()?;
        self.state()
            .sandboxes
            .get(id)
            .map(|s| s.usage)
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })
    }

    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        self.reachable()?;
        Ok(self.live_ids())
    }

    async fn envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        self.reachable()?;
        self.state()
            .sandboxes
            .get(id)
            .map(|s| s.handle.envd_endpoint())
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })
    }
}

#[async_trait]
impl Pausable for FakeRuntime {
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.reachable()?;
        self.set_paused(id, true)
    }

    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.reachable()?;
        self.set_paused(id, false)
    }

    /// No processes to end: counts the call (for a sandbox that exists).
    async fn end_frozen_processes(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.reachable()?;
        if !self.state().sandboxes.contains_key(id) {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        self.frozen_kills.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl FakeRuntime {
    /// The fake envd of an existing sandbox, or `NotFound`.
    fn envd_of(&self, id: &SandboxId) -> Result<FakeEnvd, RuntimeError> {
        self.envd(id)
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })
    }

    /// Loads a stage's layers into the new sandbox's envd files (the
    /// workspace at [`WORKSPACE_MOUNT`], the writable layer at `/`), then
    /// removes the stage.
    fn adopt(&self, id: &SandboxId, seed: &Path) -> Result<(), RuntimeError> {
        let envd = self.envd_of(id)?;
        load_files(&envd, &seed.join("workspace"), WORKSPACE_MOUNT, false)?;
        load_files(&envd, &seed.join("upper"), "/", false)?;
        remove_dir(seed)
    }
}

/// Writes every file of the envd's tree into the layer directories, fresh:
/// below [`WORKSPACE_MOUNT`] into `workspace`, the rest into `writable`.
fn dump_files(envd: &FakeEnvd, layers: &LayerExport) -> Result<(), RuntimeError> {
    for d in [&layers.workspace, &layers.writable] {
        remove_dir(d)?;
        make_dirs(&[d])?;
    }
    let below = format!("{WORKSPACE_MOUNT}/");
    for (path, data) in envd.files() {
        let file = match path.strip_prefix(&below) {
            Some(rel) => layers.workspace.join(rel),
            None => layers.writable.join(path.trim_start_matches('/')),
        };
        if let Some(parent) = file.parent() {
            make_dirs(&[parent])?;
        }
        std::fs::write(&file, data)
            .map_err(|source| RuntimeError::WriteFile { path: file, source })?;
    }
    Ok(())
}

/// Puts every regular file below `root` into the envd's tree under
/// `prefix`; with `keep`, a path the tree has already is left alone.
fn load_files(envd: &FakeEnvd, root: &Path, prefix: &str, keep: bool) -> Result<(), RuntimeError> {
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(RuntimeError::ReadFile { path: dir, source }),
        };
        for entry in entries {
            let path = entry
                .map_err(|source| RuntimeError::ReadFile {
                    path: dir.clone(),
                    source,
                })?
                .path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let Ok(rel) = path.strip_prefix(root) else {
                continue;
            };
            let target = format!("{}/{}", prefix.trim_end_matches('/'), rel.display());
            if keep && envd.file(&target).is_some() {
                continue;
            }
            let data = std::fs::read(&path).map_err(|source| RuntimeError::ReadFile {
                path: path.clone(),
                source,
            })?;
            envd.put_file(&target, data)
                .map_err(|e| RuntimeError::InvokeRuntime {
                    action: "adopt layers".into(),
                    detail: e.message,
                })?;
        }
    }
    Ok(())
}

#[async_trait]
impl Snapshottable for FakeRuntime {
    async fn export_layers(&self, id: &SandboxId) -> Result<LayerExport, RuntimeError> {
        self.reachable()?;
        let envd = self.envd_of(id)?;
        let dir = self.sandbox_dir(id);
        let layers = LayerExport {
            writable: dir.join("upper"),
            workspace: dir.join("workspace"),
            shadows: None,
        };
        dump_files(&envd, &layers)?;
        Ok(layers)
    }

    async fn stage_layers(&self, id: &SandboxId) -> Result<LayerStage, RuntimeError> {
        self.reachable()?;
        if self.state().sandboxes.contains_key(id) {
            return Err(RuntimeError::AlreadyExists { id: id.clone() });
        }
        let seed = self.seed_dir(id);
        remove_dir(&seed)?;
        let stage = LayerStage {
            writable: seed.join("upper"),
            workspace: seed.join("workspace"),
        };
        make_dirs(&[&stage.writable, &stage.workspace])?;
        Ok(stage)
    }

    async fn stage_workspace(&self, id: &SandboxId) -> Result<PathBuf, RuntimeError> {
        self.reachable()?;
        self.envd_of(id)?;
        let staging = self.sandbox_dir(id).join(".restore");
        remove_dir(&staging)?;
        make_dirs(&[&staging])?;
        Ok(staging)
    }

    async fn merge_workspace(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.reachable()?;
        let envd = self.envd_of(id)?;
        let staging = self.sandbox_dir(id).join(".restore");
        load_files(&envd, &staging, WORKSPACE_MOUNT, true)?;
        remove_dir(&staging)
    }
}
