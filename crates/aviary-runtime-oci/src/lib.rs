//! Aviary's local OCI runtime: sandboxes as `crun` (default) or `runc`
//! containers on this host.
//!
//! This crate owns, per sandbox, everything under `<state_dir>/<id>/`:
//! `upper/` + `work/` + `rootfs/` (an overlayfs whose read-only lower layer is
//! the shared template rootfs, which is never written; `lower` is a symlink to
//! that template so the overlay's mount options name no host path),
//! `control/` (host-only, 0700: envd's socket, bound here and inherited by
//! PID 1 as fd 3 — nothing of it is mounted into the sandbox), `workspace/` (at
//! `/workspace`), `bundle/config.json`
//! (generated with `oci-spec`, see [`config`]), `runtime.log` and `init.pid`;
//! plus the container in the runtime's own state dir
//! (`<state_dir>/crun-state` or `<state_dir>/runc-state`) and its cgroups at
//! `/aviary/<id>` in every hierarchy. Snapshots reach `upper/` and
//! `workspace/` only through [`Snapshottable`]: a restore stages layers in
//! `<state_dir>/<id>.seed/` (adopted by `create`) or a workspace tree in
//! `<id>/.restore/` (merged into the running workspace), and this crate
//! shifts their owners into the sandbox's id range.
//!
//! Invariants: `destroy` removes all of the above (killing leftover processes
//! through the cgroups, unmounting, removing dirs) even when the runtime lost
//! its state in a crash; `list` is the union of sandbox dirs and runtime state,
//! so half-created sandboxes are visible to the reconciler.
//!
//! crun 1.8 refuses hybrid cgroup hosts (v1 controllers plus a cgroup2 mount
//! at `/sys/fs/cgroup/unified`); the runtime is therefore started in a private
//! mount namespace in which that cgroup2 mount is detached (see [`spawn`]).
//!
//! Limits: cpu (CFS quota), memory (+swap = memory) and pids are enforced by
//! cgroups. `disk_mb` bounds `upper/` and `workspace/` together: each
//! sandbox dir is its own loop-mounted ext4 (or XFS, `OciConfig::disk_fs`) image of `disk_mb` MiB
//! (`<state_dir>/<id>.img`, see [`quota`]), so a full sandbox gets `ENOSPC`
//! inside (unless `OciConfig::disk_quota` is off).
//!
//! Each sandbox runs in a user namespace of its own: root inside is an
//! unprivileged host id range per sandbox, and the template is seen through
//! an idmapped mount (see [`idmap`]); capabilities, seccomp and
//! no-new-privs still apply on top.
//!
//! **gVisor** (`OciBinary::Runsc`): the same bundle, overlay, disk and
//! cgroups, run by `runsc --platform=ptrace --network=none
//! --host-uds=create`, without a user namespace (gVisor's own kernel is the
//! boundary) and with a host pids limit of at least [`RUNSC_MIN_PIDS`].
//! runsc cannot pass envd a descriptor: envd binds its socket itself in
//! `<id>/envd-run/` (mounted at `/run/aviary`), which gVisor makes a host
//! socket only the host can connect to; the host checks that its peer is the
//! sandbox's own gofer (`SandboxHandle::envd`). [`Checkpointable`] saves a
//! runsc sandbox's memory in `<state_dir>/<id>.checkpoint/` and restores it,
//! envd stepping aside for the save (ARCHITECTURE.md, "The gVisor tier").
//!
//! Concurrency: `OciRuntime` is `Send + Sync`; calls for different sandboxes
//! run concurrently; calls for one sandbox must be serialised by the caller.

pub mod config;
mod disk_pool;
mod host;
pub mod idmap;
mod mount_ns;
mod open_net;
pub mod quota;
pub mod seccomp;
mod spawn;

pub use quota::{disk_image, DiskFs, SandboxDisks, MIN_DISK_MB, MIN_XFS_DISK_MB};
pub use spawn::ProcessSpawner;

use async_trait::async_trait;
use aviary_core::{RuntimeName, SandboxId};
use aviary_runtime::conformance::Inspector;
use aviary_runtime::{
    validate_spec, Checkpointable, EnvdEndpoint, LayerExport, LayerStage, LiveFork, Pausable,
    ResourceUsage, Runtime, RuntimeError, RuntimeStatus, SandboxHandle, SandboxSpec, Snapshottable,
    SpawnIsolation, SpawnOutput, SpawnRequest, SpawnStdio, Spawner, TemplateRef,
};
use host::CgroupLayout;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::instrument;

/// Which OCI runtime binary drives the sandboxes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OciBinary {
    Crun,
    Runc,
    /// gVisor's `runsc` (see the crate doc's **gVisor** paragraph).
    Runsc,
}

impl OciBinary {
    /// The runtime's name (`aviary_core::RuntimeName`), which is also the
    /// binary's.
    pub fn name(self) -> &'static str {
        RuntimeName::from(self).as_str()
    }

    /// Whether this is gVisor, whose sandboxes run on a user-space kernel:
    /// no descriptor can be passed to PID 1, no user-id mapping is taken,
    /// and the sandbox's processes are not host processes.
    pub fn is_gvisor(self) -> bool {
        self == OciBinary::Runsc
    }
}

impl TryFrom<RuntimeName> for OciBinary {
    type Error = RuntimeError;

    /// The OCI binary of `name`; runtimes that are not an OCI binary
    /// (`docker`) are `Unsupported` here.
    fn try_from(name: RuntimeName) -> Result<Self, RuntimeError> {
        match name {
            RuntimeName::Crun => Ok(OciBinary::Crun),
            RuntimeName::Runc => Ok(OciBinary::Runc),
            RuntimeName::Runsc => Ok(OciBinary::Runsc),
            other => Err(RuntimeError::Unsupported {
                what: format!("runtime {other} as an OCI runtime binary"),
            }),
        }
    }
}

impl From<OciBinary> for RuntimeName {
    fn from(binary: OciBinary) -> Self {
        match binary {
            OciBinary::Crun => RuntimeName::Crun,
            OciBinary::Runc => RuntimeName::Runc,
            OciBinary::Runsc => RuntimeName::Runsc,
        }
    }
}

/// Configuration of an [`OciRuntime`].
#[derive(Clone, Debug)]
pub struct OciConfig {
    pub binary: OciBinary,
    /// Path of the binary; `None` looks `crun`/`runc` up in `PATH`.
    pub binary_path: Option<PathBuf>,
    /// Root of all per-sandbox state; created if missing. Must not contain
    /// `,` `:` or `\` (overlay option syntax).
    pub state_dir: PathBuf,
    /// Parent of every sandbox cgroup (`/<parent>/<id>` in each hierarchy).
    pub cgroup_parent: String,
    /// Size of each sandbox's private `/tmp` tmpfs (charged to its memory).
    pub tmp_size_mb: u64,
    /// Longest a single runtime command may take before it is killed.
    pub command_timeout: Duration,
    /// Enforce each sandbox's `disk_mb` with a file system of its own (see
    /// [`quota`]). Off only on purpose: sandboxes can then fill the host disk.
    pub disk_quota: bool,
    /// Sandbox disks kept made ahead of need, per recently asked size (see
    /// `disk_pool`): a create then moves one into place instead of making
    /// it. 0 (the library default) keeps none; the server keeps 2.
    pub disk_pool: usize,
    /// The file system of each sandbox's disk (ext4 unless set; XFS gives
    /// snapshots reflink change tracking, see [`quota::DiskFs`]).
    pub disk_fs: DiskFs,
    /// Host ids for user namespaces, one range per sandbox (see [`idmap`]).
    /// `None` runs sandboxes without one: root inside is host root.
    pub user_namespace: Option<idmap::IdPool>,
    /// Where the ranges are claimed (`<id dir>/userns/`, under its lock):
    /// the state dir unless set. Every OCI runtime of one host must share
    /// one (a control plane with crun and runc side by side passes the
    /// same dir to both), or two sandboxes may get one range.
    pub id_dir: Option<PathBuf>,
    /// The template store (`aviary-templates`) whose `rootfs/<digest hex>`
    /// trees a spec's [`TemplateRef`] resolves to. `None`: every create is
    /// refused.
    pub template_store: Option<PathBuf>,
}

impl OciConfig {
    /// The defaults for `binary`: everything on, a user namespace per
    /// sandbox except under gVisor, which cannot map ids (its sandboxes'
    /// root is root of gVisor's own kernel, not of the host's).
    pub fn new(binary: OciBinary, state_dir: impl Into<PathBuf>) -> Self {
        OciConfig {
            binary,
            binary_path: None,
            state_dir: state_dir.into(),
            cgroup_parent: "aviary".into(),
            tmp_size_mb: 256,
            command_timeout: Duration::from_secs(30),
            disk_quota: true,
            disk_pool: 0,
            disk_fs: DiskFs::Ext4,
            user_namespace: (!binary.is_gvisor()).then(idmap::IdPool::default),
            id_dir: None,
            template_store: None,
        }
    }

    /// Resolves templates in the store at `root`.
    pub fn with_template_store(mut self, root: impl Into<PathBuf>) -> Self {
        self.template_store = Some(root.into());
        self
    }
}

/// What [`OciRuntime::probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    /// First line of `<binary> --version`.
    pub version: String,
    /// `"v1"`, `"hybrid"` or `"v2"`.
    pub cgroup_mode: &'static str,
}

/// The crun/runc runtime.
pub struct OciRuntime {
    config: OciConfig,
    program: PathBuf,
    spawner: Arc<dyn Spawner>,
    cgroups: CgroupLayout,
    /// cgroup2 mount crun must not see on hybrid hosts.
    hide_for_crun: Vec<PathBuf>,
    disks: quota::SandboxDisks,
    /// The node's egress proxy; without one `allowlist` is refused.
    egress: Option<Arc<dyn aviary_runtime::EgressGateway>>,
    /// `slirp4netns`, for the `open` profile; without it `open` is refused.
    open_network: Option<PathBuf>,
    /// Whether crun/runc run in the prepared mount namespace (see
    /// `mount_ns`): real processes only, not a recording fake.
    prepared_ns: bool,
    /// That namespace, made at the first command (`None`: it could not be
    /// made; commands then run as before, in a fresh copy of the host's).
    mount_ns: std::sync::OnceLock<Option<Arc<std::os::fd::OwnedFd>>>,
}

/// Where a sandbox's staged layers ([`Snapshottable::stage_layers`]) wait
/// for its create: `<state_dir>/<id>.seed/{upper,workspace}`, beside (not
/// inside) the sandbox dir, which does not exist yet.
fn seed_dir(sandbox_root: &Path) -> PathBuf {
    let mut s = sandbox_root.as_os_str().to_owned();
    s.push(".seed");
    PathBuf::from(s)
}

/// Host paths of one sandbox.
struct SandboxDirs {
    root: PathBuf,
}

impl SandboxDirs {
    fn upper(&self) -> PathBuf {
        self.root.join("upper")
    }
    fn work(&self) -> PathBuf {
        self.root.join("work")
    }
    fn rootfs(&self) -> PathBuf {
        self.root.join("rootfs")
    }
    fn control(&self) -> PathBuf {
        self.root.join("control")
    }
    fn workspace(&self) -> PathBuf {
        self.root.join("workspace")
    }
    /// Holds the sandbox's egress socket only; the one host dir of an
    /// `allowlist` sandbox that it mounts besides its workspace.
    fn egress(&self) -> PathBuf {
        self.root.join("egress")
    }
    fn bundle(&self) -> PathBuf {
        self.root.join("bundle")
    }
    fn log(&self) -> PathBuf {
        self.root.join("runtime.log")
    }
    fn pid_file(&self) -> PathBuf {
        self.root.join("init.pid")
    }
    /// A tree waiting to be merged into the running workspace
    /// ([`Snapshottable::stage_workspace`]): on the sandbox's own disk, so
    /// the merge is renames, and never mounted inside.
    fn workspace_stage(&self) -> PathBuf {
        self.root.join(".restore")
    }
    /// Snapshot shadows of the layers ([`LayerExport::shadows`]): on the
    /// sandbox's own disk (so reflinks work and destroy removes them), never
    /// mounted inside, host-only (0700).
    fn shadows(&self) -> PathBuf {
        self.root.join(".shadow")
    }
    /// gVisor only: the dir mounted read-write at
    /// [`aviary_runtime::CONTROL_MOUNT`], where envd binds its socket (a host
    /// socket, by `--host-uds=create`). Sandbox-writable: the host reaches
    /// the socket without following a symlink and checks its peer.
    fn envd_run(&self) -> PathBuf {
        self.root.join("envd-run")
    }
    /// gVisor only: the memory checkpoint (`runsc checkpoint`), host-only,
    /// beside the sandbox dir (not on its disk: memory is not the
    /// sandbox's `disk_mb`).
    fn checkpoint(&self) -> PathBuf {
        let mut s = self.root.as_os_str().to_owned();
        s.push(CHECKPOINT_SUFFIX);
        PathBuf::from(s)
    }
}

impl OciRuntime {
    /// A runtime that spawns real processes. Creates the state dir.
    pub fn new(config: OciConfig) -> Result<Self, RuntimeError> {
        let mut rt = Self::with_spawner(config, Arc::new(ProcessSpawner))?;
        rt.prepared_ns = !rt.config.binary.is_gvisor();
        Ok(rt)
    }

    /// A runtime that spawns through `spawner` (tests pass a recording fake).
    pub fn with_spawner(
        mut config: OciConfig,
        spawner: Arc<dyn Spawner>,
    ) -> Result<Self, RuntimeError> {
        if config.binary.is_gvisor() && config.user_namespace.is_some() {
            return Err(RuntimeError::InvalidSpec {
                reason: "runsc cannot map user ids: user_namespace must be None".into(),
            });
        }
        if !config.state_dir.is_absolute() {
            return Err(RuntimeError::InvalidSpec {
                reason: format!("state dir {:?} must be absolute", config.state_dir),
            });
        }
        std::fs::create_dir_all(&config.state_dir).map_err(|source| RuntimeError::CreateDir {
            path: config.state_dir.clone(),
            source,
        })?;
        // A stable, symlink-free path: it ends up in mount options and mountinfo.
        config.state_dir =
            config
                .state_dir
                .canonicalize()
                .map_err(|source| RuntimeError::ReadFile {
                    path: config.state_dir.clone(),
                    source,
                })?;
        if config
            .state_dir
            .to_str()
            .is_none_or(|s| s.contains([',', ':', '\\', '\n', ' ']))
        {
            return Err(RuntimeError::InvalidSpec {
                reason: format!(
                    "state dir {:?} cannot be used in mount options",
                    config.state_dir
                ),
            });
        }
        let hierarchies = host::cgroup_hierarchies().map_err(|source| RuntimeError::ReadFile {
            path: "/proc/self/mountinfo".into(),
            source,
        })?;
        let hybrid =
            hierarchies.iter().any(|h| !h.unified) && hierarchies.iter().any(|h| h.unified);
        let hide_for_crun = if hybrid && config.binary == OciBinary::Crun {
            hierarchies
                .iter()
                .filter(|h| h.unified)
                .map(|h| h.mount.clone())
                .collect()
        } else {
            Vec::new()
        };
        let runtime_root = config
            .state_dir
            .join(format!("{}-state", config.binary.name()));
        std::fs::create_dir_all(&runtime_root).map_err(|source| RuntimeError::CreateDir {
            path: runtime_root.clone(),
            source,
        })?;
        let program = config
            .binary_path
            .clone()
            .unwrap_or_else(|| PathBuf::from(config.binary.name()));
        let disks = quota::SandboxDisks::open(
            &config.state_dir,
            config.disk_quota,
            config.command_timeout,
        )?
        .with_fs(config.disk_fs)
        .with_pool(config.disk_pool);
        Ok(OciRuntime {
            disks,
            cgroups: CgroupLayout {
                hierarchies,
                parent: config.cgroup_parent.clone(),
            },
            config,
            program,
            spawner,
            hide_for_crun,
            egress: None,
            open_network: None,
            prepared_ns: false,
            mount_ns: std::sync::OnceLock::new(),
        })
    }

    /// Enforces the `open` network profile with `slirp4netns` at `slirp`
    /// (see [`open_net`]).
    pub fn with_open_network(mut self, slirp: impl Into<PathBuf>) -> Self {
        self.open_network = Some(slirp.into());
        self
    }

    /// Enforces the `allowlist` network profile through `gateway`: each such
    /// sandbox gets `<sandbox>/egress/proxy.sock`, served by the gateway and
    /// bind-mounted read-only at [`aviary_core::egress::EGRESS_DIR_IN_SANDBOX`].
    ///
    /// Sandboxes of this state dir that already have a socket (a restarted
    /// server) are attached again with the rules recorded at their create
    /// (`control/egress.json`, host-only), so their egress keeps working.
    pub fn with_egress(mut self, gateway: Arc<dyn aviary_runtime::EgressGateway>) -> Self {
        self.reattach_egress(gateway.as_ref());
        self.egress = Some(gateway);
        self
    }

    fn reattach_egress(&self, gateway: &dyn aviary_runtime::EgressGateway) {
        let Ok(entries) = std::fs::read_dir(&self.config.state_dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Some(id) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<SandboxId>().ok())
            else {
                continue;
            };
            let dirs = self.dirs(&id);
            let Ok(json) = std::fs::read(dirs.control().join(EGRESS_RECORD)) else {
                continue;
            };
            let policy = match serde_json::from_slice(&json) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(sandbox.id = %id, error = %e, "unreadable egress record: egress stays closed");
                    continue;
                }
            };
            let socket = dirs.egress().join(aviary_core::egress::EGRESS_SOCKET_NAME);
            if let Err(e) = gateway.attach(&id, &policy, &socket) {
                tracing::warn!(sandbox.id = %id, error = %e, "re-attaching egress failed: egress stays closed");
            }
        }
    }

    /// The sandbox disks (and the disks made ahead of need).
    pub fn disks(&self) -> &quota::SandboxDisks {
        &self.disks
    }

    pub fn config(&self) -> &OciConfig {
        &self.config
    }

    /// The runtime binary's own state dir (`--root`).
    pub fn runtime_root(&self) -> PathBuf {
        self.config
            .state_dir
            .join(format!("{}-state", self.config.binary.name()))
    }

    fn dirs(&self, id: &SandboxId) -> SandboxDirs {
        SandboxDirs {
            root: self.config.state_dir.join(id.as_str()),
        }
    }

    /// The rootfs tree of a template: `<store>/rootfs/<digest hex>` (the
    /// layout of `aviary-templates`, whose trees never change once there).
    pub fn template_rootfs(&self, template: &TemplateRef) -> Result<PathBuf, RuntimeError> {
        let hex = template
            .digest_hex()
            .ok_or_else(|| RuntimeError::InvalidSpec {
                reason: format!(
                    "template digest {:?} is not sha256:<64 hex>",
                    template.digest
                ),
            })?;
        let store =
            self.config
                .template_store
                .as_ref()
                .ok_or_else(|| RuntimeError::InvalidSpec {
                    reason: "this runtime has no template store".into(),
                })?;
        let rootfs = store.join("rootfs").join(hex);
        if !rootfs.is_dir() {
            return Err(RuntimeError::InvalidSpec {
                reason: format!(
                    "template {} ({}) is not in the template store {store:?}",
                    template.name, template.digest
                ),
            });
        }
        Ok(rootfs)
    }

    fn cgroups_path(&self, id: &SandboxId) -> String {
        format!("/{}/{}", self.config.cgroup_parent, id)
    }

    /// Whether a sandbox whose runtime keeps its state in `owner` may still
    /// have files or processes on this host, so its user-id range must stay
    /// claimed.
    fn may_hold_ids(&self, id: &SandboxId, owner: &Path) -> bool {
        owner.join(id.as_str()).exists() || self.cgroups.dirs(id).iter().any(|d| d.exists())
    }

    /// Where user-id ranges are claimed ([`OciConfig::id_dir`]).
    fn id_dir(&self) -> &Path {
        self.config
            .id_dir
            .as_deref()
            .unwrap_or(&self.config.state_dir)
    }

    /// Whether the runtime binary has state for this container.
    fn runtime_knows(&self, id: &SandboxId) -> bool {
        self.runtime_state_files(id).iter().any(|p| p.exists())
    }

    /// What the runtime binary keeps for a container: a dir named after it
    /// (crun, runc), or `<id>_sandbox:<id>.state` and `.lock` (runsc).
    fn runtime_state_files(&self, id: &SandboxId) -> Vec<PathBuf> {
        let root = self.runtime_root();
        if self.config.binary.is_gvisor() {
            ["state", "lock"]
                .iter()
                .map(|ext| root.join(format!("{id}_sandbox:{id}.{ext}")))
                .collect()
        } else {
            vec![root.join(id.as_str())]
        }
    }

    /// runsc's record of a container: its state file, JSON written by runsc
    /// on the host (never by the sandbox).
    fn runsc_state(&self, id: &SandboxId) -> Result<serde_json::Value, RuntimeError> {
        let path = self.runtime_state_files(id).swap_remove(0);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(RuntimeError::NotFound { id: id.clone() })
            }
            Err(source) => return Err(RuntimeError::ReadFile { path, source }),
        };
        serde_json::from_slice(&text).map_err(|e| RuntimeError::ParseState {
            detail: format!("runsc state file is not JSON: {e}"),
        })
    }

    /// The host pid of a runsc sandbox's gofer: the process that binds the
    /// sandbox's host sockets (`--host-uds=create`), and so the peer of every
    /// connection to envd's socket. One per sandbox, outside it.
    fn gofer_pid(&self, id: &SandboxId) -> Result<u32, RuntimeError> {
        let state = self.runsc_state(id)?;
        state["goferPid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 1)
            .ok_or_else(|| RuntimeError::ParseState {
                detail: format!("runsc state has no gofer pid: {:?}", state["goferPid"]),
            })
    }

    /// envd's endpoint in a runsc sandbox: its socket in `envd-run/`, the
    /// gofer as the peer.
    fn gvisor_envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        Ok(EnvdEndpoint {
            socket: self
                .dirs(id)
                .envd_run()
                .join(aviary_runtime::ENVD_SOCKET_NAME),
            peer_pid: self.gofer_pid(id)?,
        })
    }

    /// How commands ran before the prepared namespace (and still do when
    /// it cannot be made): crun on hybrid hosts in a fresh private copy of
    /// the host's namespace without cgroup2, anything else as it is.
    fn fresh_isolation(&self) -> SpawnIsolation {
        if self.hide_for_crun.is_empty() {
            SpawnIsolation::None
        } else {
            SpawnIsolation::PrivateMountNamespace {
                detach: self.hide_for_crun.clone(),
            }
        }
    }

    /// Whether creates run in the prepared mount namespace (made by the
    /// first create; `false` before it, or when it could not be made).
    pub fn uses_prepared_namespace(&self) -> bool {
        self.mount_ns.get().is_some_and(Option::is_some)
    }

    /// The prepared mount namespace (`mount_ns`), made at the first call.
    fn prepared_mount_ns(&self) -> Option<&Arc<std::os::fd::OwnedFd>> {
        if !self.prepared_ns {
            return None;
        }
        self.mount_ns
            .get_or_init(
                || match mount_ns::prepare(&self.config.state_dir, &self.hide_for_crun) {
                    Ok(fd) => Some(Arc::new(fd)),
                    Err(error) => {
                        tracing::warn!(%error, "cannot prepare the runtime's mount namespace; \
                            each command copies the host's (slower with many sandboxes)");
                        None
                    }
                },
            )
            .as_ref()
    }

    fn request(&self, args: Vec<String>, stdio: SpawnStdio) -> SpawnRequest {
        let mut full = vec![
            "--root".to_string(),
            self.runtime_root().display().to_string(),
        ];
        if self.config.binary.is_gvisor() {
            // The platform that works here (kvm hangs), loopback only, and
            // host sockets only as envd's listener: processes inside may
            // create them (bind) but never connect to one.
            full.extend(RUNSC_FLAGS.iter().map(|f| f.to_string()));
        }
        full.extend(args);
        SpawnRequest {
            program: self.program.clone(),
            args: full,
            stdio,
            isolation: self.fresh_isolation(),
            timeout: self.config.command_timeout,
            pass_fd: None,
        }
    }

    /// Runs the runtime binary; a non-zero exit becomes `InvokeRuntime`.
    async fn invoke(&self, action: &str, args: Vec<String>) -> Result<SpawnOutput, RuntimeError> {
        let req = self.request(args, SpawnStdio::Capture);
        let out = self
            .spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: self.program.display().to_string(),
                source,
            })?;
        if out.success() {
            Ok(out)
        } else {
            Err(self.failure(action, &out, None))
        }
    }

    fn failure(&self, action: &str, out: &SpawnOutput, log: Option<&Path>) -> RuntimeError {
        let mut detail = if out.timed_out {
            format!("timed out after {:?}", self.config.command_timeout)
        } else {
            format!("exit {:?}", out.code)
        };
        let mut text = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if let Some(log) = log {
            if let Ok(l) = std::fs::read_to_string(log) {
                text.push_str(l.trim());
            }
        }
        if !text.is_empty() {
            // Keep the tail: the last lines carry the reason.
            let start = text.len().saturating_sub(1500);
            let start = (start..text.len())
                .find(|i| text.is_char_boundary(*i))
                .unwrap_or(0);
            detail = format!("{detail}: {}", &text[start..]);
        }
        RuntimeError::InvokeRuntime {
            action: format!("{} {action}", self.config.binary.name()),
            detail,
        }
    }

    /// Checks that the binary runs, the state dir takes an overlay mount whose
    /// lower layer stays untouched, and a cgroup memory controller exists.
    pub async fn probe(&self) -> Result<ProbeReport, RuntimeError> {
        let probe_err = |reason: String| RuntimeError::ProbeRuntime { reason };
        let mut req = SpawnRequest::new(self.program.clone(), vec!["--version".into()]);
        req.timeout = self.config.command_timeout;
        let out = self.spawner.run(&req).await.map_err(|e| {
            probe_err(format!(
                "cannot run {:?}: {e} (is {} installed?)",
                self.program,
                self.config.binary.name()
            ))
        })?;
        if !out.success() {
            return Err(probe_err(format!(
                "{:?} --version exited with {:?}",
                self.program, out.code
            )));
        }
        let version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();

        let has_v1 = self.cgroups.hierarchies.iter().any(|h| !h.unified);
        let has_v2 = self.cgroups.hierarchies.iter().any(|h| h.unified);
        let has_memory = self
            .cgroups
            .hierarchies
            .iter()
            .any(|h| h.unified || h.controllers.iter().any(|c| c == "memory"));
        if !has_memory {
            return Err(probe_err("no memory cgroup controller is mounted".into()));
        }
        let cgroup_mode = match (has_v1, has_v2) {
            (true, true) => "hybrid",
            (true, false) => "v1",
            _ => "v2",
        };

        let dir = self
            .config
            .state_dir
            .join(format!(".probe-{}", std::process::id()));
        let result = probe_overlay(&dir);
        let _ = host::unmount_all_under(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        result.map_err(|e| {
            probe_err(format!(
                "overlayfs does not work in {:?}: {e}",
                self.config.state_dir
            ))
        })?;
        self.disks
            .probe(&*self.spawner, &self.config.state_dir)
            .await
            .map_err(probe_err)?;
        Ok(ProbeReport {
            version,
            cgroup_mode,
        })
    }

    /// Runs `argv` inside a running sandbox with `<binary> exec` (always with
    /// `--no-new-privs`, which crun 1.8 does not take from the bundle) and
    /// captures its output. A diagnostics path: the control plane runs
    /// commands through envd instead.
    pub async fn exec(&self, id: &SandboxId, argv: &[&str]) -> Result<SpawnOutput, RuntimeError> {
        if !self.runtime_knows(id) {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        let mut args = vec!["exec".to_string()];
        if !self.config.binary.is_gvisor() {
            // (runsc has no such flag: gVisor applies the bundle's process
            // settings to exec'd processes itself)
            args.push("--no-new-privs".to_string());
        }
        args.push(id.to_string());
        args.extend(argv.iter().map(|s| s.to_string()));
        let req = self.request(args, SpawnStdio::Capture);
        self.spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: self.program.display().to_string(),
                source,
            })
    }

    async fn create_inner(
        &self,
        spec: &SandboxSpec,
        template: &Path,
        dirs: &SandboxDirs,
        start: Start<'_>,
    ) -> Result<SandboxHandle, RuntimeError> {
        // Layers staged for this id (`stage_layers`, a restore) are adopted
        // (moved onto the sandbox's disk, see `quota`) instead of starting
        // empty; `idmap::prepare_sandbox` shifts their owners below.
        let seed = seed_dir(&dirs.root);
        for d in [
            dirs.upper(),
            dirs.work(),
            dirs.rootfs(),
            dirs.control(),
            dirs.workspace(),
            dirs.bundle(),
        ] {
            let staged = d.file_name().map(|n| seed.join(n));
            if let Some(staged) =
                staged.filter(|s| (d == dirs.upper() || d == dirs.workspace()) && s.is_dir())
            {
                self.disks.adopt(&*self.spawner, &staged, &d).await?;
                continue;
            }
            std::fs::create_dir(&d).map_err(|source| RuntimeError::CreateDir {
                path: d.clone(),
                source,
            })?;
        }
        if seed.exists() {
            let _ = std::fs::remove_dir_all(&seed);
        }
        let id_range = match &self.config.user_namespace {
            Some(pool) => Some(idmap::claim(
                self.id_dir(),
                &self.config.state_dir,
                pool,
                &spec.id,
                &|o, owner| self.may_hold_ids(o, owner),
            )?),
            None => None,
        };
        let lower = match id_range {
            Some(range) => idmap::prepare_sandbox(
                &dirs.root,
                template,
                &[dirs.upper(), dirs.workspace()],
                range,
            )?,
            None => template.to_path_buf(),
        };
        host::mount_sandbox_overlay(&dirs.root, &lower)?;
        if id_range.is_some() {
            idmap::detach_lower(&dirs.root)?;
        }
        let rootfs = dirs.rootfs();
        let control = dirs.control();
        let workspace = dirs.workspace();
        // envd's socket: made and bound here, in the host-only control dir,
        // and handed to PID 1 as fd 3; envd calls listen() itself (see
        // `aviary_runtime::ENVD_LISTEN_FD`). The sandbox never sees the path.
        // Under gVisor no descriptor reaches PID 1: envd binds its socket
        // itself in `envd-run/` (see `gvisor_spec`).
        let gvisor = self.config.binary.is_gvisor();
        let envd_socket = if gvisor {
            None
        } else {
            Some(bind_envd_socket(&control)?)
        };
        let spec = &if gvisor {
            std::fs::set_permissions(
                &control,
                std::os::unix::fs::PermissionsExt::from_mode(0o700),
            )
            .map_err(|source| RuntimeError::WriteFile {
                path: control.clone(),
                source,
            })?;
            make_dir(&dirs.envd_run(), 0o700)?;
            gvisor_spec(spec, &dirs.envd_run())
        } else {
            spec.clone()
        };
        let spec = &self.with_egress_socket(spec, dirs)?;
        let spec = &open_net::with_resolver(spec, &dirs.root)?;
        let inputs = config::BundleInputs {
            rootfs: &rootfs,
            workspace_dir: &workspace,
            cgroups_path: self.cgroups_path(&spec.id),
            tmp_size_mb: self.config.tmp_size_mb,
            id_range,
        };
        let oci = config::build_spec(spec, &inputs).map_err(|e| RuntimeError::BuildConfig {
            source: Box::new(e),
        })?;
        let config_path = dirs.bundle().join("config.json");
        let json = serde_json::to_vec_pretty(&oci).map_err(|e| RuntimeError::BuildConfig {
            source: Box::new(e),
        })?;
        std::fs::write(&config_path, json).map_err(|source| RuntimeError::WriteFile {
            path: config_path,
            source,
        })?;

        // PID 1 inherits the runtime's stdio: /dev/null, never a host file or a
        // pipe we would wait on. Errors come back through --log.
        let mut args = vec!["--log".into(), dirs.log().display().to_string()];
        match start {
            Start::Run => args.extend(["run".into(), "--detach".into()]),
            // (runsc only: no descriptor is passed below)
            Start::Fork { image } => args.extend([
                "restore".into(),
                "--image-path".into(),
                image.display().to_string(),
                "--detach".into(),
            ]),
        }
        if envd_socket.is_some() {
            args.extend(["--preserve-fds".into(), "1".into()]);
        }
        args.extend([
            "--bundle".into(),
            dirs.bundle().display().to_string(),
            "--pid-file".into(),
            dirs.pid_file().display().to_string(),
            spec.id.to_string(),
        ]);
        let mut req = self.request(args, SpawnStdio::Null);
        req.pass_fd = envd_socket.as_ref().map(|s| s.as_raw_fd());
        // The create runs in the prepared namespace (`mount_ns`), with the
        // sandbox's own mounts attached from a clone of them; the other
        // commands (kill, delete, exec: off the create path, and runc's
        // need the bundle dir of the sandbox they name) run as before.
        let _tree = match (start, self.prepared_mount_ns()) {
            (Start::Run, Some(ns)) => match mount_ns::clone_tree(&dirs.root) {
                Ok(fd) => {
                    req.isolation = SpawnIsolation::JoinMountNamespace {
                        ns: ns.as_raw_fd(),
                        tree: Some((fd.as_raw_fd(), dirs.root.clone())),
                    };
                    Some(fd)
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot clone the sandbox's mounts; running in a copy of the host's namespace");
                    None
                }
            },
            _ => None,
        };
        let out = self
            .spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: self.program.display().to_string(),
                source,
            })?;
        // envd holds its own copy now; the host never accepts on it.
        drop(envd_socket);
        if !out.success() {
            return Err(self.failure(
                match start {
                    Start::Run => "run",
                    Start::Fork { .. } => "restore",
                },
                &out,
                Some(&dirs.log()),
            ));
        }
        if let Start::Fork { .. } = start {
            // the restored envd still holds its parent's lease state and
            // waits, quiesced: SIGHUP makes it forget that state and serve
            self.resume_envd(&spec.id, "HUP").await?;
        }
        let pid_text =
            std::fs::read_to_string(dirs.pid_file()).map_err(|source| RuntimeError::ReadFile {
                path: dirs.pid_file(),
                source,
            })?;
        let init_pid = pid_text
            .trim()
            .parse::<u32>()
            .map_err(|_| RuntimeError::ParseState {
                detail: format!("pid file holds {:?}", pid_text.trim()),
            })?;
        if let (aviary_core::NetworkProfile::Open, Some(slirp)) = (spec.network, &self.open_network)
        {
            self.attach_open_network(slirp, dirs, init_pid).await?;
        }
        let envd = if gvisor {
            Some(self.gvisor_envd_endpoint(&spec.id)?)
        } else {
            None
        };
        Ok(SandboxHandle {
            id: spec.id.clone(),
            runtime: self.config.binary.name().to_string(),
            runtime_instance_id: spec.id.to_string(),
            control_dir: control,
            workspace_dir: workspace,
            init_pid,
            envd,
        })
    }
}

/// The egress rules of an `allowlist` sandbox, in its host-only control dir.
const EGRESS_RECORD: &str = "egress.json";

impl OciRuntime {
    /// `spec` plus the bind of its own egress socket's dir, when it has the
    /// `allowlist` profile (the gateway serves the socket from now on).
    fn with_egress_socket(
        &self,
        spec: &SandboxSpec,
        dirs: &SandboxDirs,
    ) -> Result<SandboxSpec, RuntimeError> {
        let mut spec = spec.clone();
        let Some(policy) = &spec.egress else {
            return Ok(spec);
        };
        let gateway = self
            .egress
            .as_ref()
            .ok_or_else(|| RuntimeError::Unsupported {
                what: "network profile \"allowlist\" (this node runs no egress proxy)".into(),
            })?;
        let dir = dirs.egress();
        make_dir(&dir, 0o755)?;
        let socket = dir.join(aviary_core::egress::EGRESS_SOCKET_NAME);
        gateway
            .attach(&spec.id, policy, &socket)
            .map_err(|source| RuntimeError::CreateDir {
                path: socket.clone(),
                source,
            })?;
        // kept host-only, for a restarted server to serve the same rules
        let record = dirs.control().join(EGRESS_RECORD);
        let json = serde_json::to_vec(policy).map_err(|e| RuntimeError::BuildConfig {
            source: Box::new(e),
        })?;
        std::fs::write(&record, json).map_err(|source| RuntimeError::WriteFile {
            path: record,
            source,
        })?;
        spec.binds.push(aviary_runtime::BindMount {
            host: dir,
            sandbox: aviary_core::egress::EGRESS_DIR_IN_SANDBOX.into(),
            read_only: true,
        });
        Ok(spec)
    }
}

/// runsc's global flags, on every call (see [`OciRuntime::request`]).
const RUNSC_FLAGS: &[&str] = &["--platform=ptrace", "--network=none", "--host-uds=create"];

/// The lowest host pids limit a runsc sandbox gets (RUNTIME-NOTES: gVisor
/// does not start under less).
pub const RUNSC_MIN_PIDS: u32 = 1024;

/// Where envd listens inside a runsc sandbox.
fn gvisor_envd_socket() -> String {
    format!(
        "{}/{}",
        aviary_runtime::CONTROL_MOUNT,
        aviary_runtime::ENVD_SOCKET_NAME
    )
}

/// `spec` as runsc runs it: a host pids limit of at least
/// [`RUNSC_MIN_PIDS`], `envd_run` mounted read-write at
/// [`aviary_runtime::CONTROL_MOUNT`], and an init that asks for the
/// inherited socket (`--listen-fd 3`, which runsc cannot pass) binding
/// its own there instead (`--socket … --gvisor-host-socket`).
fn gvisor_spec(spec: &SandboxSpec, envd_run: &Path) -> SandboxSpec {
    let mut spec = spec.clone();
    // gVisor's own threads count against the host's pids limit (with the
    // ptrace platform every task of the sandbox is a host thread too)
    spec.resources.pids = spec.resources.pids.max(RUNSC_MIN_PIDS);
    let fd = aviary_runtime::ENVD_LISTEN_FD.to_string();
    if let Some(at) = spec
        .init
        .windows(2)
        .position(|w| w[0] == "--listen-fd" && w[1] == fd)
    {
        spec.init.splice(
            at..at + 2,
            [
                "--socket".to_string(),
                gvisor_envd_socket(),
                "--gvisor-host-socket".to_string(),
            ],
        );
    }
    spec.binds.push(aviary_runtime::BindMount {
        host: envd_run.to_path_buf(),
        sandbox: aviary_runtime::CONTROL_MOUNT.into(),
        read_only: false,
    });
    spec
}

/// A unix stream socket bound (not listening) at `<control>/envd.sock`,
/// close-on-exec in this process. The control dir is host-only and mode 0700.
fn bind_envd_socket(control: &Path) -> Result<std::os::fd::OwnedFd, RuntimeError> {
    use nix::sys::socket::{bind, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::unix::fs::PermissionsExt;
    let path = control.join(aviary_runtime::ENVD_SOCKET_NAME);
    std::fs::set_permissions(control, std::fs::Permissions::from_mode(0o700)).map_err(
        |source| RuntimeError::WriteFile {
            path: control.to_path_buf(),
            source,
        },
    )?;
    let io = |e: nix::Error| RuntimeError::CreateDir {
        path: path.clone(),
        source: e.into(),
    };
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io)?;
    let addr = UnixAddr::new(&path).map_err(io)?;
    bind(fd.as_raw_fd(), &addr).map_err(io)?;
    Ok(fd)
}

fn probe_overlay(dir: &Path) -> std::io::Result<()> {
    let (lower, upper, work, merged) = (dir.join("l"), dir.join("u"), dir.join("w"), dir.join("m"));
    for d in [&lower, &upper, &work, &merged] {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(lower.join("f"), "lower")?;
    host::mount_overlay(&lower, &upper, &work, &merged).map_err(std::io::Error::other)?;
    std::fs::write(merged.join("f"), "upper")?;
    let lower_after = std::fs::read_to_string(lower.join("f"))?;
    let merged_after = std::fs::read_to_string(merged.join("f"))?;
    if lower_after != "lower" || merged_after != "upper" {
        return Err(std::io::Error::other("overlay copy-up did not behave"));
    }
    Ok(())
}

impl OciRuntime {
    /// `create`, or (`Start::Fork`) the same sandbox started from a memory
    /// image instead of its init: everything but the runtime's start is
    /// shared, so a forked child is set up exactly like a created one.
    async fn create_from(
        &self,
        spec: &SandboxSpec,
        start: Start<'_>,
    ) -> Result<SandboxHandle, RuntimeError> {
        validate_spec(spec)?;

        if spec.network == aviary_core::NetworkProfile::Open && self.open_network.is_none() {
            return Err(RuntimeError::Unsupported {
                what: "network profile \"open\" (slirp4netns is not installed on this node)".into(),
            });
        }
        if spec.egress.is_some() && self.egress.is_none() {
            return Err(RuntimeError::Unsupported {
                what: "network profile \"allowlist\" (this node runs no egress proxy)".into(),
            });
        }
        let template = self.template_rootfs(&spec.template)?;
        let dirs = self.dirs(&spec.id);
        if self.runtime_knows(&spec.id) {
            return Err(RuntimeError::AlreadyExists {
                id: spec.id.clone(),
            });
        }
        // create_dir (not _all) is the atomic claim on the id.
        match std::fs::create_dir(&dirs.root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(RuntimeError::AlreadyExists {
                    id: spec.id.clone(),
                })
            }
            Err(source) => {
                return Err(RuntimeError::CreateDir {
                    path: dirs.root.clone(),
                    source,
                })
            }
        }
        let created = match self
            .disks
            .attach(&*self.spawner, &dirs.root, spec.resources.disk_mb)
            .await
        {
            Ok(()) => self.create_inner(spec, &template, &dirs, start).await,
            Err(e) => Err(e),
        };
        match created {
            Ok(h) => Ok(h),
            Err(e) => {
                tracing::warn!(error = %e, "create failed, tearing down");
                Err(e.with_cleanup(self.destroy(&spec.id).await))
            }
        }
    }
}

#[async_trait]
impl Runtime for OciRuntime {
    fn name(&self) -> &str {
        self.config.binary.name()
    }

    fn enforces_network(&self, profile: aviary_core::NetworkProfile) -> bool {
        if self.config.binary.is_gvisor() {
            // runsc runs with `--network=none` and without host sockets to
            // connect to (the egress socket would need `--host-uds=open`)
            return profile == aviary_core::NetworkProfile::None;
        }
        match profile {
            aviary_core::NetworkProfile::None => true,
            aviary_core::NetworkProfile::Allowlist => self.egress.is_some(),
            aviary_core::NetworkProfile::Open => self.open_network.is_some(),
        }
    }

    #[instrument(skip_all, fields(sandbox.id = %spec.id, runtime = self.config.binary.name()))]
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        self.create_from(spec, Start::Run).await
    }

    fn release_spares(&self) {
        self.disks.drain_pool();
    }

    /// Cuts the egress socket and the user-mode network (`open`): after a
    /// destroy is answered, the sandbox reaches nothing outside it while
    /// the rest of the teardown runs.
    async fn quiesce(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let dirs = self.dirs(id);
        if let Some(gateway) = &self.egress {
            gateway.detach(id);
        }
        open_net::detach_open_network(&dirs);
        Ok(())
    }

    #[instrument(skip_all, fields(sandbox.id = %id, runtime = self.config.binary.name()))]
    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let dirs = self.dirs(id);
        if let Some(gateway) = &self.egress {
            gateway.detach(id);
        }
        open_net::detach_open_network(&dirs);
        let mut errors: Vec<RuntimeError> = Vec::new();
        if self.runtime_knows(id) {
            // A frozen sandbox cannot die; thaw first (no-op otherwise).
            self.cgroups.thaw(id);
            if let Err(e) = self
                .invoke(
                    "delete",
                    vec!["delete".into(), "--force".into(), id.to_string()],
                )
                .await
            {
                // Carry on: the steps below kill and remove by hand.
                tracing::warn!(error = %e, "runtime delete failed");
                errors.push(e);
            }
        }
        let mut residue: Vec<RuntimeError> = Vec::new();
        if let Err(e) = self.cgroups.kill_and_remove(id).await {
            residue.push(e);
        }
        if let Err(e) = host::unmount_all_under(&dirs.root) {
            residue.push(e);
        }
        // Before the dir: an image without its dir would be invisible to list().
        if let Err(e) = self.disks.release(&dirs.root) {
            residue.push(e);
        }
        for path in self.runtime_state_files(id) {
            // runsc's own files, when `delete` could not remove them
            if path.is_file() {
                if let Err(source) = std::fs::remove_file(&path) {
                    residue.push(RuntimeError::RemoveDir { path, source });
                }
            }
        }
        for dir in [
            dirs.root.clone(),
            seed_dir(&dirs.root),
            dirs.checkpoint(),
            self.runtime_root().join(id.as_str()),
        ] {
            // Unlinking is slow on some disks (ext4 with `discard`: 20-50 ms
            // per sandbox here); keep it off the async workers.
            let d = dir.clone();
            let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&d))
                .await
                .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())));
            match removed {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => residue.push(RuntimeError::RemoveDir { path: dir, source }),
            }
        }
        // Kept while anything of the sandbox remains (see `idmap`).
        if let Err(e) = idmap::release(self.id_dir(), &self.config.state_dir, id, &|o, owner| {
            self.may_hold_ids(o, owner)
        }) {
            residue.push(e);
        }
        // A failed `delete` whose leftovers were then removed by hand is fine.
        let mut all = residue.into_iter();
        match all.next() {
            None => Ok(()),
            Some(first) => Err(all.fold(first, |acc, e| acc.with_cleanup(Err(e)))),
        }
        .map_err(|e| match errors.pop() {
            Some(delete_err) => e.with_cleanup(Err(delete_err)),
            None => e,
        })
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        if !self.runtime_knows(id) {
            return Ok(if self.dirs(id).root.exists() {
                // Half-created or half-destroyed: there is something to destroy.
                RuntimeStatus::Stopped
            } else {
                RuntimeStatus::NotFound
            });
        }
        let out = self
            .invoke("state", vec!["state".into(), id.to_string()])
            .await?;
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| RuntimeError::ParseState {
                detail: format!("state output is not JSON: {e}"),
            })?;
        Ok(match v["status"].as_str() {
            Some("running") => RuntimeStatus::Running,
            Some("paused") => RuntimeStatus::Paused,
            Some("created") | Some("creating") | Some("stopped") => RuntimeStatus::Stopped,
            other => {
                return Err(RuntimeError::ParseState {
                    detail: format!("unknown container status {other:?}"),
                })
            }
        })
    }

    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        let root = self.dirs(id).root;
        if !root.exists() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        let mut usage = self.cgroups.usage(id)?;
        // the sandbox dir is its own disk's mount point (without the
        // quota it is the host's disk: nothing to say about the sandbox)
        if self.config.disk_quota {
            usage.disk_free_bytes = nix::sys::statvfs::statvfs(&root)
                .ok()
                .map(|v| v.blocks_available().saturating_mul(v.fragment_size()));
        }
        Ok(usage)
    }

    async fn oom_kills(&self, id: &SandboxId) -> Result<u64, RuntimeError> {
        self.cgroups.oom_kills(id)
    }

    async fn envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        if self.config.binary.is_gvisor() {
            return self.gvisor_envd_endpoint(id);
        }
        let dirs = self.dirs(id);
        let pid_file = dirs.pid_file();
        let text = match std::fs::read_to_string(&pid_file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(RuntimeError::NotFound { id: id.clone() })
            }
            Err(source) => {
                return Err(RuntimeError::ReadFile {
                    path: pid_file,
                    source,
                })
            }
        };
        let peer_pid = text
            .trim()
            .parse::<u32>()
            .map_err(|_| RuntimeError::ParseState {
                detail: format!("pid file holds {:?}", text.trim()),
            })?;
        Ok(EnvdEndpoint {
            socket: dirs.control().join(aviary_runtime::ENVD_SOCKET_NAME),
            peer_pid,
        })
    }

    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        let mut ids = Vec::new();
        for dir in [self.config.state_dir.clone(), self.runtime_root()] {
            let rd = match std::fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => return Err(RuntimeError::ReadFile { path: dir, source }),
            };
            // a sandbox's dir, its container, or a stage no create adopted
            // (`<id>.seed`): each is the sandbox's to `destroy`
            ids.extend(rd.flatten().filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                // runsc: `<id>_sandbox:<id>.state` (ids have no `_`)
                let name = name.split_once('_').map_or(name, |(id, _)| id);
                name.strip_suffix(".seed")
                    .or_else(|| name.strip_suffix(CHECKPOINT_SUFFIX))
                    .unwrap_or(name)
                    .parse::<SandboxId>()
                    .ok()
            }));
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }
}

#[async_trait]
impl Pausable for OciRuntime {
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        if !self.runtime_knows(id) {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        self.invoke("pause", vec!["pause".into(), id.to_string()])
            .await?;
        if self.config.binary.is_gvisor() {
            // gVisor stops its own kernel's tasks before `pause` returns;
            // the host freezer is not involved
            return Ok(());
        }
        // the v1 freezer can still say FREEZING when the runtime returns: a
        // pause (and a snapshot's consistency) means every task is stopped
        let deadline = std::time::Instant::now() + self.config.command_timeout;
        while !self.cgroups.is_frozen(id) {
            if std::time::Instant::now() > deadline {
                return Err(RuntimeError::InvokeRuntime {
                    action: "pause".into(),
                    detail: format!(
                        "sandbox {id} was not frozen within {:?}",
                        self.config.command_timeout
                    ),
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        Ok(())
    }

    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        if !self.runtime_knows(id) {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        self.invoke("resume", vec!["resume".into(), id.to_string()])
            .await
            .map(drop)
    }

    /// The pids come from the sandbox's cgroups (`cgroup.procs`, written by
    /// the kernel) and the init pid from the runtime's own pid file; frozen
    /// processes cannot exit, so no pid is reused under us.
    async fn end_frozen_processes(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        if self.config.binary.is_gvisor() {
            // the sandbox's processes live in gVisor's kernel, not the
            // host's: no host pid to kill (the cgroup holds runsc itself)
            return Err(RuntimeError::Unsupported {
                what: format!("ending the processes of paused runsc sandbox {id}"),
            });
        }
        let init = self.envd_endpoint(id).await?.peer_pid;
        for pid in self.cgroups.processes(id) {
            if pid as u32 == init {
                continue;
            }
            // ESRCH: already gone
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        Ok(())
    }
}

/// Runs blocking file work off the async workers; a panicked task is
/// reported as a failed write of `path`.
async fn blocking<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, RuntimeError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|join| {
        Err(RuntimeError::WriteFile {
            path: path.to_path_buf(),
            source: std::io::Error::other(join.to_string()),
        })
    })
}

/// Removes `dir` and everything in it; a missing dir is fine.
fn remove_tree(dir: &Path) -> Result<(), RuntimeError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RuntimeError::RemoveDir {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Makes `dir` (not its parents) with mode `mode`.
pub(crate) fn make_dir(dir: &Path, mode: u32) -> Result<(), RuntimeError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .mode(mode)
        .create(dir)
        .map_err(|source| RuntimeError::CreateDir {
            path: dir.to_path_buf(),
            source,
        })
}

/// The layers are the overlay's `upper/` and the bind-mounted `workspace/`
/// of the sandbox dir; stages live where `create` and the disk expect them
/// (`<id>.seed/`, `<id>/.restore`), and owners are shifted into the
/// sandbox's id range (see [`idmap`]) when a staged tree is adopted.
#[async_trait]
impl Snapshottable for OciRuntime {
    async fn export_layers(&self, id: &SandboxId) -> Result<LayerExport, RuntimeError> {
        let dirs = self.dirs(id);
        let (writable, workspace) = (dirs.upper(), dirs.workspace());
        if !writable.is_dir() || !workspace.is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        // Only a sandbox with a disk of its own gets shadows: they pin the
        // blocks the sandbox rewrites, which must count against its disk,
        // never the host's.
        let shadows = if self.config.disk_quota {
            let dir = dirs.shadows();
            blocking(&dir.clone(), move || {
                match make_dir(&dir, 0o700) {
                    Ok(()) => {}
                    Err(RuntimeError::CreateDir { source, .. })
                        if source.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(e),
                }
                // the disk root is the host's alone; still, only a real dir
                let meta =
                    std::fs::symlink_metadata(&dir).map_err(|source| RuntimeError::CreateDir {
                        path: dir.clone(),
                        source,
                    })?;
                if !meta.is_dir() {
                    return Err(RuntimeError::CreateDir {
                        path: dir,
                        source: std::io::Error::other("not a directory"),
                    });
                }
                Ok(Some(dir))
            })
            .await?
        } else {
            None
        };
        Ok(LayerExport {
            writable,
            workspace,
            shadows,
        })
    }

    #[instrument(skip_all, fields(sandbox.id = %id))]
    async fn stage_layers(&self, id: &SandboxId) -> Result<LayerStage, RuntimeError> {
        let dirs = self.dirs(id);
        if dirs.root.exists() || self.runtime_knows(id) {
            return Err(RuntimeError::AlreadyExists { id: id.clone() });
        }
        let seed = seed_dir(&dirs.root);
        let stage = LayerStage {
            writable: seed.join("upper"),
            workspace: seed.join("workspace"),
        };
        let made = stage.clone();
        blocking(&seed.clone(), move || {
            remove_tree(&seed)?;
            // Host-only: a staged tree may hold set-id files of any owner
            // until create shifts it into the sandbox's range.
            make_dir(&seed, 0o700)?;
            make_dir(&made.writable, 0o755)?;
            make_dir(&made.workspace, 0o755)
        })
        .await?;
        Ok(stage)
    }

    #[instrument(skip_all, fields(sandbox.id = %id))]
    async fn stage_workspace(&self, id: &SandboxId) -> Result<PathBuf, RuntimeError> {
        let dirs = self.dirs(id);
        if !dirs.workspace().is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        let stage = dirs.workspace_stage();
        let made = stage.clone();
        blocking(&stage, move || {
            remove_tree(&made)?;
            make_dir(&made, 0o700)
        })
        .await?;
        Ok(stage)
    }

    #[instrument(skip_all, fields(sandbox.id = %id))]
    async fn merge_workspace(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let dirs = self.dirs(id);
        let (stage, workspace) = (dirs.workspace_stage(), dirs.workspace());
        if !workspace.is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        if !stage.is_dir() {
            return Err(RuntimeError::InvalidSpec {
                reason: format!("no workspace tree is staged for sandbox {id}"),
            });
        }
        let (id_dir, id) = (self.id_dir().to_path_buf(), id.clone());
        blocking(&stage.clone(), move || {
            // written by the host: owned by the sandbox's range like the rest
            idmap::shift_into(&id_dir, &id, &stage)?;
            let entries = std::fs::read_dir(&stage).map_err(|source| RuntimeError::ReadFile {
                path: stage.clone(),
                source,
            })?;
            for e in entries.flatten() {
                let target = workspace.join(e.file_name());
                // symlink_metadata: a dangling symlink is an entry too
                if std::fs::symlink_metadata(&target).is_ok() {
                    continue;
                }
                std::fs::rename(e.path(), &target).map_err(|source| RuntimeError::WriteFile {
                    path: target.clone(),
                    source,
                })?;
            }
            remove_tree(&stage)
        })
        .await
    }
}

/// How `create_from` starts the container.
#[derive(Clone, Copy)]
enum Start<'a> {
    /// `run`: PID 1 starts fresh.
    Run,
    /// `runsc restore` from another sandbox's memory image (a live fork).
    Fork { image: &'a Path },
}

/// `<state_dir>/<id>.checkpoint`: a runsc sandbox's saved memory.
const CHECKPOINT_SUFFIX: &str = ".checkpoint";

/// envd's marker beside its socket: it holds no host socket any more
/// (`aviary-envd`'s `hostsock`; the sandbox could forge it, which only
/// fails its own checkpoint).
const ENVD_QUIESCED: &str = "quiesced";
/// Written into a checkpoint dir once `runsc checkpoint` finished, so a
/// half-written image is never restored.
const CHECKPOINT_COMPLETE: &str = "complete";

impl OciRuntime {
    fn require_gvisor(&self, what: &str) -> Result<(), RuntimeError> {
        if self.config.binary.is_gvisor() {
            Ok(())
        } else {
            Err(RuntimeError::Unsupported {
                what: format!("{what} on runtime {}", self.config.binary.name()),
            })
        }
    }

    /// Asks envd to serve again (`signal`: SIGUSR2, or SIGHUP for a live
    /// fork's child, which also forgets its parent's lease) after removing
    /// its old socket file, which gVisor does not let it unlink from inside (`remove_file`
    /// unlinks whatever the sandbox left there, never following it).
    async fn resume_envd(&self, id: &SandboxId, signal: &str) -> Result<(), RuntimeError> {
        let socket = self
            .dirs(id)
            .envd_run()
            .join(aviary_runtime::ENVD_SOCKET_NAME);
        match std::fs::remove_file(&socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(RuntimeError::RemoveDir {
                    path: socket,
                    source,
                })
            }
        }
        self.signal_init(id, signal).await
    }

    /// Sends `signal` to the sandbox's PID 1 (envd) from outside.
    async fn signal_init(&self, id: &SandboxId, signal: &str) -> Result<(), RuntimeError> {
        self.invoke("kill", vec!["kill".into(), id.to_string(), signal.into()])
            .await
            .map(drop)
    }

    /// Asks envd to close its host socket and connections (SIGUSR1), and
    /// waits for its marker; on a timeout it is asked to serve again.
    async fn quiesce_envd(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let marker = self.dirs(id).envd_run().join(ENVD_QUIESCED);
        let _ = std::fs::remove_file(&marker);
        self.signal_init(id, "USR1").await?;
        let deadline = std::time::Instant::now() + self.config.command_timeout;
        // lstat: a regular file made by envd (never followed)
        while !std::fs::symlink_metadata(&marker).is_ok_and(|m| m.is_file()) {
            if std::time::Instant::now() > deadline {
                let _ = self.resume_envd(id, "USR2").await;
                return Err(RuntimeError::InvokeRuntime {
                    action: "runsc checkpoint".into(),
                    detail: format!(
                        "envd of sandbox {id} did not close its socket within {:?}",
                        self.config.command_timeout
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// `runsc checkpoint` of a quiesced sandbox into `dir`, marked complete.
    async fn checkpoint_into(
        &self,
        id: &SandboxId,
        dir: &Path,
        leave_running: bool,
    ) -> Result<(), RuntimeError> {
        remove_tree(dir)?;
        make_dir(dir, 0o700)?;
        let mut args = vec!["checkpoint".to_string(), "--image-path".into()];
        args.push(dir.display().to_string());
        if leave_running {
            args.push("--leave-running".into());
        }
        args.push(id.to_string());
        if let Err(e) = self.invoke("checkpoint", args).await {
            let _ = remove_tree(dir);
            return Err(e);
        }
        std::fs::write(dir.join(CHECKPOINT_COMPLETE), b"").map_err(|source| {
            RuntimeError::WriteFile {
                path: dir.join(CHECKPOINT_COMPLETE),
                source,
            }
        })
    }
}

/// runsc only: `checkpoint` asks envd to step aside (its socket is a host
/// socket, which gVisor cannot save), saves the memory into
/// `<id>/checkpoint/` (host-only, on the sandbox's own disk) and deletes the
/// container, keeping the sandbox dir, its mounts and its disk; `restore`
/// runs `runsc restore` from there with the same bundle and tells envd to
/// serve again (SIGUSR2).
#[async_trait]
impl Checkpointable for OciRuntime {
    #[instrument(skip_all, fields(sandbox.id = %id))]
    async fn checkpoint(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.require_gvisor("memory checkpoints")?;
        if !self.runtime_knows(id) {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        // a frozen envd cannot step aside: it runs for the checkpoint
        if self.status(id).await? == RuntimeStatus::Paused {
            self.resume(id).await?;
        }
        self.quiesce_envd(id).await?;
        let dir = self.dirs(id).checkpoint();
        self.checkpoint_into(id, &dir, false).await?;
        // the container has stopped; its runsc state and cgroups go, the
        // sandbox's storage stays for the restore
        self.invoke(
            "delete",
            vec!["delete".into(), "--force".into(), id.to_string()],
        )
        .await?;
        self.cgroups.kill_and_remove(id).await
    }

    async fn has_checkpoint(&self, id: &SandboxId) -> Result<bool, RuntimeError> {
        Ok(self.config.binary.is_gvisor()
            && !self.runtime_knows(id)
            && self
                .dirs(id)
                .checkpoint()
                .join(CHECKPOINT_COMPLETE)
                .is_file())
    }

    #[instrument(skip_all, fields(sandbox.id = %spec.id))]
    async fn restore(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        self.require_gvisor("memory checkpoints")?;
        let id = &spec.id;
        if self.runtime_knows(id) {
            return Err(RuntimeError::AlreadyExists { id: id.clone() });
        }
        if !self.has_checkpoint(id).await? {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        let checkpoint = self.dirs(id).checkpoint();
        let handle = self.restore_image(id, &checkpoint).await?;
        remove_tree(&checkpoint)?;
        Ok(handle)
    }

    #[instrument(skip_all, fields(sandbox.id = %parent, child.id = %child.id))]
    async fn fork_running(
        &self,
        parent: &SandboxId,
        child: &SandboxSpec,
    ) -> Result<LiveFork, RuntimeError> {
        self.require_gvisor("live forks")?;
        validate_spec(child)?;
        if !self.runtime_knows(parent) {
            return Err(RuntimeError::NotFound { id: parent.clone() });
        }
        let child_dirs = self.dirs(&child.id);
        if self.runtime_knows(&child.id)
            || child_dirs.root.exists()
            || seed_dir(&child_dirs.root).exists()
        {
            return Err(RuntimeError::AlreadyExists {
                id: child.id.clone(),
            });
        }
        // a frozen envd cannot step aside: it runs for the image, and is
        // frozen again after
        let was_paused = self.status(parent).await? == RuntimeStatus::Paused;
        if was_paused {
            self.resume(parent).await?;
        }
        self.quiesce_envd(parent).await?;
        // the image is the child's (`<child>.checkpoint`): a crash from here
        // on leaves it to the child's destroy, never to the parent's
        let image = child_dirs.checkpoint();
        if let Err(e) = self.checkpoint_into(parent, &image, false).await {
            let _ = self.resume_envd(parent, "USR2").await;
            return Err(e);
        }
        // the parent has stopped: its files are now what the image expects
        // (runsc `--leave-running` does the same stop and restore inside,
        // and then waits for the container in the foreground)
        self.invoke(
            "delete",
            vec!["delete".into(), "--force".into(), parent.to_string()],
        )
        .await?;
        self.cgroups.kill_and_remove(parent).await?;
        let copied = self.copy_layers_for_fork(parent, &child.id).await;
        let parent_handle = match self.restore_image(parent, &image).await {
            Ok(h) => h,
            Err(e) => {
                let _ = remove_tree(&image);
                let _ = remove_tree(&seed_dir(&child_dirs.root));
                return Err(RuntimeError::InvokeRuntime {
                    action: "runsc restore of the parent of a live fork".into(),
                    detail: format!("sandbox {parent} did not come back: {e}"),
                });
            }
        };
        if was_paused {
            self.pause(parent).await?;
        }
        let forked = match copied {
            Ok(()) => self.create_from(child, Start::Fork { image: &image }).await,
            Err(e) => Err(e),
        };
        let removed = remove_tree(&image);
        let child_handle = match forked {
            Ok(h) => h,
            Err(e) => {
                let _ = remove_tree(&seed_dir(&child_dirs.root));
                return Err(e.with_cleanup(self.destroy(&child.id).await));
            }
        };
        if let Err(e) = removed {
            return Err(e.with_cleanup(self.destroy(&child.id).await));
        }
        Ok(LiveFork {
            parent: parent_handle,
            child: child_handle,
        })
    }
}

impl OciRuntime {
    /// `runsc restore` of sandbox `id` (its own bundle, written at create)
    /// from the memory image in `image`, then envd serves again (SIGUSR2).
    async fn restore_image(
        &self,
        id: &SandboxId,
        image: &Path,
    ) -> Result<SandboxHandle, RuntimeError> {
        let dirs = self.dirs(id);
        let _ = std::fs::remove_file(dirs.pid_file());
        let _ = std::fs::remove_file(dirs.envd_run().join(aviary_runtime::ENVD_SOCKET_NAME));
        // the bundle written at create (host-only) describes the same sandbox
        let req = self.request(
            vec![
                "--log".into(),
                dirs.log().display().to_string(),
                "restore".into(),
                "--image-path".into(),
                image.display().to_string(),
                "--detach".into(),
                "--bundle".into(),
                dirs.bundle().display().to_string(),
                "--pid-file".into(),
                dirs.pid_file().display().to_string(),
                id.to_string(),
            ],
            SpawnStdio::Null,
        );
        let out = self
            .spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: self.program.display().to_string(),
                source,
            })?;
        if !out.success() {
            return Err(self.failure("restore", &out, Some(&dirs.log())));
        }
        self.resume_envd(id, "USR2").await?;
        let init_pid = read_pid_file(&dirs.pid_file())?;
        Ok(SandboxHandle {
            id: id.clone(),
            runtime: self.config.binary.name().to_string(),
            runtime_instance_id: id.to_string(),
            control_dir: dirs.control(),
            workspace_dir: dirs.workspace(),
            init_pid,
            envd: Some(self.gvisor_envd_endpoint(id)?),
        })
    }

    /// Copies a stopped parent's writable layer and workspace into the
    /// child's stage (`<child>.seed/`, adopted by its create), owners,
    /// modes, overlay whiteouts and xattrs kept (`cp -a`; gVisor sandboxes
    /// have no id mapping to shift).
    async fn copy_layers_for_fork(
        &self,
        parent: &SandboxId,
        child: &SandboxId,
    ) -> Result<(), RuntimeError> {
        let stage = self.stage_layers(child).await?;
        let from = self.dirs(parent);
        for (src, dst) in [
            (from.upper(), &stage.writable),
            (from.workspace(), &stage.workspace),
        ] {
            let mut src = src.into_os_string();
            src.push("/.");
            let mut req = SpawnRequest::new(
                PathBuf::from("cp"),
                vec![
                    "-a".into(),
                    "--".into(),
                    src.to_string_lossy().into_owned(),
                    dst.display().to_string(),
                ],
            );
            req.stdio = SpawnStdio::Capture;
            req.timeout = self.config.command_timeout;
            let out = self
                .spawner
                .run(&req)
                .await
                .map_err(|source| RuntimeError::Spawn {
                    program: "cp".into(),
                    source,
                })?;
            if !out.success() {
                return Err(RuntimeError::InvokeRuntime {
                    action: "copy of a live fork's files".into(),
                    detail: format!(
                        "cp exit {:?}: {}",
                        out.code,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The pid in a runtime's pid file.
fn read_pid_file(path: &Path) -> Result<u32, RuntimeError> {
    let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    text.trim()
        .parse::<u32>()
        .map_err(|_| RuntimeError::ParseState {
            detail: format!("pid file holds {:?}", text.trim()),
        })
}

#[async_trait]
impl Inspector for OciRuntime {
    async fn run_inside(
        &self,
        handle: &SandboxHandle,
        argv: &[&str],
    ) -> Result<SpawnOutput, RuntimeError> {
        self.exec(&handle.id, argv).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_runtime::RecordingSpawner;

    fn fake(binary: OciBinary) -> (tempfile::TempDir, Arc<RecordingSpawner>, OciRuntime) {
        let dir = tempfile::tempdir().unwrap();
        let spawner = Arc::new(RecordingSpawner::new());
        let mut config = OciConfig::new(binary, dir.path().join("state"));
        config.binary_path = Some("/opt/bin/oci".into());
        let rt = OciRuntime::with_spawner(config, spawner.clone()).unwrap();
        (dir, spawner, rt)
    }

    #[tokio::test]
    async fn status_parses_runtime_state_and_names_its_root() {
        let (_d, spawner, rt) = fake(OciBinary::Runc);
        let id = SandboxId::generate();
        assert_eq!(rt.status(&id).await.unwrap(), RuntimeStatus::NotFound);
        assert!(spawner.requests().is_empty(), "unknown ids cost no spawn");
        std::fs::create_dir_all(rt.runtime_root().join(id.as_str())).unwrap();
        spawner.push(Ok(SpawnOutput::ok(
            r#"{"id":"x","status":"paused","pid":42}"#,
        )));
        assert_eq!(rt.status(&id).await.unwrap(), RuntimeStatus::Paused);
        let req = &spawner.requests()[0];
        assert_eq!(req.program, PathBuf::from("/opt/bin/oci"));
        assert_eq!(
            req.args,
            vec![
                "--root".to_string(),
                rt.runtime_root().display().to_string(),
                "state".into(),
                id.to_string()
            ]
        );
        assert_eq!(req.isolation, SpawnIsolation::None, "runc runs as it is");
    }

    #[tokio::test]
    async fn runtime_failures_carry_stderr() {
        let (_d, spawner, rt) = fake(OciBinary::Crun);
        let id = SandboxId::generate();
        std::fs::create_dir_all(rt.runtime_root().join(id.as_str())).unwrap();
        spawner.push(Ok(SpawnOutput::failed(1, "cannot freeze")));
        let err = rt.pause(&id).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "crun pause failed: exit Some(1): cannot freeze"
        );
        let hybrid = host::cgroup_hierarchies()
            .unwrap()
            .iter()
            .any(|h| h.unified)
            && host::cgroup_hierarchies()
                .unwrap()
                .iter()
                .any(|h| !h.unified);
        let expected = if hybrid {
            SpawnIsolation::PrivateMountNamespace {
                detach: vec!["/sys/fs/cgroup/unified".into()],
            }
        } else {
            SpawnIsolation::None
        };
        assert_eq!(
            spawner.requests()[0].isolation,
            expected,
            "crun hides cgroup2 on hybrid hosts"
        );
    }

    #[tokio::test]
    async fn layers_are_staged_beside_the_sandbox_and_exported_from_it() {
        use std::os::unix::fs::PermissionsExt;
        let (_d, spawner, rt) = fake(OciBinary::Crun);
        let id = SandboxId::generate();
        let err = rt.export_layers(&id).await.unwrap_err();
        assert!(matches!(err, RuntimeError::NotFound { .. }), "{err:?}");

        let stage = rt.stage_layers(&id).await.unwrap();
        let seed = seed_dir(&rt.dirs(&id).root);
        assert_eq!(stage.writable, seed.join("upper"));
        assert_eq!(stage.workspace, seed.join("workspace"));
        assert!(stage.writable.is_dir() && stage.workspace.is_dir());
        let mode = std::fs::metadata(&seed).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "the stage is host-only");
        // staging again starts empty
        std::fs::write(stage.workspace.join("old"), "x").unwrap();
        let again = rt.stage_layers(&id).await.unwrap();
        assert_eq!(std::fs::read_dir(&again.workspace).unwrap().count(), 0);

        // an existing sandbox exports its layers and cannot be staged
        let other = SandboxId::generate();
        let dirs = rt.dirs(&other);
        std::fs::create_dir_all(dirs.upper()).unwrap();
        std::fs::create_dir_all(dirs.workspace()).unwrap();
        let export = rt.export_layers(&other).await.unwrap();
        assert_eq!(export.writable, dirs.upper());
        assert_eq!(export.workspace, dirs.workspace());
        let err = rt.stage_layers(&other).await.unwrap_err();
        assert!(matches!(err, RuntimeError::AlreadyExists { .. }), "{err:?}");
        assert!(spawner.requests().is_empty(), "no runtime call needed");
    }

    #[tokio::test]
    async fn a_staged_workspace_merges_without_replacing_entries() {
        let (_d, _spawner, rt) = fake(OciBinary::Crun);
        let id = SandboxId::generate();
        let err = rt.stage_workspace(&id).await.unwrap_err();
        assert!(matches!(err, RuntimeError::NotFound { .. }), "{err:?}");
        let ws = rt.dirs(&id).workspace();
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::write(ws.join("kept"), "live").unwrap();
        let err = rt.merge_workspace(&id).await.unwrap_err();
        assert!(matches!(err, RuntimeError::InvalidSpec { .. }), "{err:?}");

        let stage = rt.stage_workspace(&id).await.unwrap();
        assert!(
            stage.starts_with(&rt.dirs(&id).root),
            "on the sandbox's disk"
        );
        std::fs::write(stage.join("kept"), "snapshot").unwrap();
        std::fs::create_dir(stage.join("src")).unwrap();
        std::fs::write(stage.join("src/main.py"), "print(1)").unwrap();
        rt.merge_workspace(&id).await.unwrap();
        assert_eq!(std::fs::read_to_string(ws.join("kept")).unwrap(), "live");
        assert_eq!(
            std::fs::read_to_string(ws.join("src/main.py")).unwrap(),
            "print(1)"
        );
        assert!(!stage.exists(), "the stage is gone after the merge");
    }

    #[tokio::test]
    async fn spawn_errors_and_unknown_ids() {
        let (_d, spawner, rt) = fake(OciBinary::Crun);
        let id = SandboxId::generate();
        assert!(matches!(
            rt.resume(&id).await.unwrap_err(),
            RuntimeError::NotFound { .. }
        ));
        assert!(matches!(
            rt.usage(&id).await.unwrap_err(),
            RuntimeError::NotFound { .. }
        ));
        spawner.push(Err(std::io::Error::from(std::io::ErrorKind::NotFound)));
        let err = rt.probe().await.unwrap_err();
        assert!(matches!(err, RuntimeError::ProbeRuntime { .. }), "{err:?}");
        assert!(err.to_string().contains("is crun installed?"), "{err}");
    }
}
