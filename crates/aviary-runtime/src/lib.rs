//! The seam between Aviary's control plane and whatever actually runs sandboxes.
//!
//! This crate owns the [`Runtime`] trait (create / destroy / status / usage /
//! list), the optional [`Pausable`], [`Snapshottable`] and [`Checkpointable`]
//! (memory) capabilities (a
//! runtime implements the traits of what it can do; callers never reach into
//! a runtime's own directories), the [`RuntimeError`] every
//! backend maps its failures into, and the [`Spawner`] seam: backends start
//! external programs (crun, runc, helpers) only through a `Spawner`, so unit
//! tests can swap in the [`RecordingSpawner`] fake.
//!
//! Invariants every backend upholds (checked by [`conformance`]):
//! - `create` returns only once PID 1 of the sandbox is running;
//! - `destroy` is idempotent and leaves nothing behind on the host (processes,
//!   mounts, cgroups, directories), also after a crash left half a sandbox;
//! - `list` reports what the backend really has, not what it was told, so the
//!   reconciler can compare it with the registry.
//!
//! Concurrency: runtimes are `Send + Sync` and called concurrently for
//! *different* sandboxes; callers serialise operations on one sandbox (the
//! lease manager does). The crate itself has no I/O and no unsafe code.
#![forbid(unsafe_code)]

pub mod conformance;
mod error;
mod spawner;

pub use error::RuntimeError;
pub use spawner::{
    RecordingSpawner, SpawnIsolation, SpawnOutput, SpawnRequest, SpawnStdio, Spawner,
};

use async_trait::async_trait;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;

/// A path inside every sandbox that is reserved for the platform (no bind may
/// target it). Nothing is mounted there any more: envd's socket lives in a
/// host-only directory and reaches envd as an inherited fd (see
/// [`ENVD_LISTEN_FD`]).
pub const CONTROL_MOUNT: &str = "/run/aviary";
/// File name of envd's listening socket inside [`SandboxHandle::control_dir`].
pub const ENVD_SOCKET_NAME: &str = "envd.sock";
/// The fd number at which PID 1 (envd, `--listen-fd 3`) inherits its
/// listening socket. The runtime creates and binds the socket on the host in
/// the sandbox's host-only control dir and passes it on; envd calls
/// `listen()` itself, so the kernel's peer credentials of every connection
/// name the sandbox's init process, which the host verifies.
pub const ENVD_LISTEN_FD: i32 = 3;
/// Where the workspace directory is mounted inside every sandbox.
pub const WORKSPACE_MOUNT: &str = "/workspace";

/// An extra bind mount from the host into the sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindMount {
    /// Existing host path (file or directory).
    pub host: PathBuf,
    /// Absolute path inside the sandbox, without `..` components.
    pub sandbox: String,
    pub read_only: bool,
}

/// The node's egress proxy as a runtime sees it (`allowlist` profile,
/// implemented by `aviary-egress`): the runtime makes a directory that only
/// this sandbox mounts, asks for the sandbox's own socket in it, and
/// detaches on destroy.
pub trait EgressGateway: Send + Sync {
    /// Serves `policy` for sandbox `id` on a new socket at `socket`.
    fn attach(
        &self,
        id: &SandboxId,
        policy: &aviary_core::egress::EgressPolicy,
        socket: &std::path::Path,
    ) -> std::io::Result<()>;
    /// Stops serving `id` (no-op when not attached).
    fn detach(&self, id: &SandboxId);
}

/// Which template a sandbox starts from. The runtime resolves it to a root
/// file system on its own host (a template's digest names the same tree on
/// every node); the caller never names a host path.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TemplateRef {
    /// The template's name, for messages (names can move to new content).
    pub name: String,
    /// `sha256:<64 lowercase hex>` of the template's canonical tree: what
    /// the runtime resolves.
    pub digest: String,
}

impl TemplateRef {
    /// The hex part of a well-formed digest.
    pub fn digest_hex(&self) -> Option<&str> {
        self.digest.strip_prefix("sha256:").filter(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    }
}

/// Everything a runtime needs to start one sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    pub id: SandboxId,
    /// The read-only lower layer, shared by many sandboxes; never modified.
    pub template: TemplateRef,
    pub resources: ResourceLimits,
    /// [`NetworkProfile::None`]: loopback only. [`NetworkProfile::Allowlist`]
    /// needs `egress` and a runtime with an [`EgressGateway`];
    /// [`NetworkProfile::Open`] a runtime with a NAT stack. A runtime that
    /// cannot enforce a profile fails with [`RuntimeError::Unsupported`].
    pub network: NetworkProfile,
    /// The egress rules of an `allowlist` sandbox (its profile, resolved by
    /// the control plane from `aviary.toml`); `None` for the other profiles.
    #[serde(default)]
    pub egress: Option<aviary_core::egress::EgressPolicy>,
    pub hostname: String,
    /// argv of PID 1 inside the sandbox (the control plane passes its envd).
    pub init: Vec<String>,
    /// `KEY=VALUE` entries for PID 1.
    pub env: Vec<String>,
    pub binds: Vec<BindMount>,
}

/// What `create` hands back: where the sandbox lives on the host.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxHandle {
    pub id: SandboxId,
    /// Backend name, e.g. `"crun"` or `"runc"`.
    pub runtime: String,
    /// The backend's own name for the sandbox (container id, VM name, ...).
    pub runtime_instance_id: String,
    /// Host-only directory created by the runtime, never visible inside the
    /// sandbox; envd's listening socket ([`ENVD_SOCKET_NAME`]) lives here.
    pub control_dir: PathBuf,
    /// Host directory bind-mounted read-write at [`WORKSPACE_MOUNT`].
    pub workspace_dir: PathBuf,
    /// Host pid of the sandbox's PID 1 (under gVisor: of the sandbox's
    /// `runsc-sandbox` process, the user-space kernel that runs PID 1).
    pub init_pid: u32,
    /// Where envd is reached when not at `control_dir/envd.sock` with
    /// `init_pid` as the peer (gVisor: a host socket in a dir mounted
    /// inside, whose peer is the sandbox's gofer; see `aviary-runtime-oci`).
    #[serde(default)]
    pub envd: Option<EnvdEndpoint>,
}

/// How the host reaches a sandbox's envd, and how it recognises it: the
/// socket path is in a directory the sandbox cannot see, and the peer of every
/// connection must be `peer_pid` (the sandbox's init, as seen from the host).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvdEndpoint {
    pub socket: PathBuf,
    pub peer_pid: u32,
}

impl SandboxHandle {
    /// The envd endpoint of a sandbox this host created.
    pub fn envd_endpoint(&self) -> EnvdEndpoint {
        self.envd.clone().unwrap_or_else(|| EnvdEndpoint {
            socket: self.control_dir.join(ENVD_SOCKET_NAME),
            peer_pid: self.init_pid,
        })
    }
}

/// What the runtime says about one sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeStatus {
    Running,
    Paused,
    /// Known to the runtime but PID 1 has exited.
    Stopped,
    NotFound,
}

/// Resource counters of one sandbox, read from its cgroup. Cheap enough to
/// call around every exec (OOM detection compares `oom_kills`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceUsage {
    pub memory_current_bytes: u64,
    pub memory_peak_bytes: u64,
    pub cpu_usage_ns: u64,
    /// Processes killed by the OOM killer in this sandbox since it started.
    pub oom_kills: u64,
    pub pids_current: u64,
    /// Bytes still writable on the sandbox's own disk (`disk_mb`), when the
    /// runtime gives each sandbox one (`None`: it does not know).
    #[serde(default)]
    pub disk_free_bytes: Option<u64>,
}

/// A sandbox backend.
#[async_trait]
pub trait Runtime: Send + Sync {
    /// Stable backend name, recorded in the registry (`"crun"`, `"runc"`, ...).
    fn name(&self) -> &str;
    /// Whether this runtime enforces network profile `profile` (a create
    /// with one it does not is refused with [`RuntimeError::Unsupported`]).
    /// Every runtime gives `none`; the others need the node's means.
    fn enforces_network(&self, profile: NetworkProfile) -> bool {
        profile == NetworkProfile::None
    }
    /// Starts a sandbox; returns once its PID 1 has started. On failure nothing
    /// is left behind.
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError>;
    /// The server is stopping: let go of what the runtime keeps ready ahead
    /// of need (e.g. pre-made disks). Sandboxes are not touched.
    fn release_spares(&self) {}
    /// Kills and removes the sandbox and everything the runtime made for it.
    /// Idempotent: destroying an unknown id succeeds.
    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError>;
    /// The part of a destroy that must be done before the destroy is
    /// answered, when the rest ([`Runtime::destroy`]) runs in the background:
    /// whatever connects the sandbox to the world outside it (an egress
    /// socket, a user-mode network) is cut. Cheap; idempotent; `destroy`
    /// still does all of it. Default: nothing (a runtime without such
    /// connections).
    async fn quiesce(&self, _id: &SandboxId) -> Result<(), RuntimeError> {
        Ok(())
    }
    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError>;
    /// Fails with [`RuntimeError::NotFound`] for an unknown sandbox.
    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError>;
    /// [`ResourceUsage::oom_kills`] alone, read before every exec (to tell
    /// an OOM kill from a plain failure): a runtime that can read it for
    /// less than all of [`Runtime::usage`] says so here.
    async fn oom_kills(&self, id: &SandboxId) -> Result<u64, RuntimeError> {
        self.usage(id).await.map(|u| u.oom_kills)
    }
    /// The sandboxes this runtime actually has (for the reconciler), including
    /// half-torn-down ones that `destroy` should finish.
    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError>;
    /// Where the host connects to a running sandbox's envd (after a restart,
    /// when no [`SandboxHandle`] is at hand). Runtimes whose sandboxes are
    /// not on this host answer [`RuntimeError::Unsupported`].
    async fn envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        Err(RuntimeError::Unsupported {
            what: format!("a host envd endpoint for {id} on runtime {}", self.name()),
        })
    }
}

/// A runtime that can freeze and thaw all processes of a sandbox.
#[async_trait]
pub trait Pausable: Runtime {
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError>;
    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError>;
    /// Sends SIGKILL to every process of a paused sandbox but its init
    /// (envd), from the host. Frozen processes die on the thaw that follows
    /// without running again, so a lease can move while a sandbox is
    /// paused: its holder's processes never get back to user code. Runtimes
    /// that cannot do this answer [`RuntimeError::Unsupported`].
    async fn end_frozen_processes(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported {
            what: format!(
                "ending the processes of paused sandbox {id} on runtime {}",
                self.name()
            ),
        })
    }
}

/// One of the two layers a snapshot keeps of a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layer {
    /// What is mounted at [`WORKSPACE_MOUNT`].
    Workspace,
    /// Everything the sandbox changed outside the workspace.
    Writable,
}

impl Layer {
    /// Its name on the wire (`workspace`, `writable`).
    pub fn as_str(self) -> &'static str {
        match self {
            Layer::Workspace => "workspace",
            Layer::Writable => "writable",
        }
    }
}

impl std::str::FromStr for Layer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "workspace" => Ok(Layer::Workspace),
            "writable" => Ok(Layer::Writable),
            other => Err(format!("unknown layer {other:?} (workspace or writable)")),
        }
    }
}

impl LayerExport {
    /// The directory of `layer`.
    pub fn layer(&self, layer: Layer) -> &std::path::Path {
        match layer {
            Layer::Workspace => &self.workspace,
            Layer::Writable => &self.writable,
        }
    }

    /// Where a snapshot of `layer` keeps its change-tracking state (one dir
    /// per layer under [`Self::shadows`]), if the runtime offers one.
    pub fn shadow(&self, layer: Layer) -> Option<std::path::PathBuf> {
        self.shadows.as_ref().map(|d| d.join(layer.as_str()))
    }
}

/// A running sandbox's layers as host directories, for reading: what a
/// snapshot copies. Valid until the sandbox is destroyed; the runtime keeps
/// ownership (the caller only reads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerExport {
    /// The writable layer: everything the sandbox changed outside
    /// [`WORKSPACE_MOUNT`] (for an overlay, its upper dir, whiteouts
    /// included), with owners as the host sees them.
    pub writable: PathBuf,
    /// The directory mounted at [`WORKSPACE_MOUNT`].
    pub workspace: PathBuf,
    /// A host-only directory on the same file system as both layers,
    /// outside them and out of the sandbox's reach, where snapshots may keep
    /// state between runs (reflink shadows, `aviary_snapshots::shadow`; see
    /// [`Self::shadow`]). Removed with the sandbox. `None`: no such place.
    pub shadows: Option<PathBuf>,
}

/// Empty host directories where the caller writes the layers of a sandbox
/// that does not exist yet; its next `create` adopts them instead of
/// starting empty. Same layout as [`LayerExport`], so an export of one
/// sandbox written here seeds another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerStage {
    pub writable: PathBuf,
    pub workspace: PathBuf,
}

/// A runtime that can hand out and take in a sandbox's writable layer and
/// workspace, so snapshots, fork, hibernate/wake and restores work without
/// the caller knowing where the runtime keeps them.
///
/// File owners: a tree the caller writes (a stage, a workspace merge) may
/// carry any ids (another sandbox's host range, host root); the runtime
/// shifts them into the sandbox's own ids when it adopts the tree. Exports
/// show host ids as they are. Pause the sandbox around an export for a
/// consistent copy ([`Pausable`]).
#[async_trait]
pub trait Snapshottable: Pausable {
    /// The layers of an existing sandbox, for reading.
    /// [`RuntimeError::NotFound`] for an unknown sandbox.
    async fn export_layers(&self, id: &SandboxId) -> Result<LayerExport, RuntimeError>;
    /// Empty directories for the layers of `id`, which must not exist yet
    /// ([`RuntimeError::AlreadyExists`] otherwise); the next `create` of `id`
    /// adopts what was written. Staging again discards the earlier stage;
    /// `destroy(id)` discards a stage no create adopted.
    async fn stage_layers(&self, id: &SandboxId) -> Result<LayerStage, RuntimeError>;
    /// An empty directory (on the sandbox's own storage, never visible
    /// inside) where the caller writes a tree to be merged into the running
    /// sandbox's workspace by [`Self::merge_workspace`]. Discards an earlier,
    /// unmerged one.
    async fn stage_workspace(&self, id: &SandboxId) -> Result<PathBuf, RuntimeError>;
    /// Moves the top-level entries of the staged tree into the workspace,
    /// keeping any entry the workspace already has, with owners shifted into
    /// the sandbox's ids; then removes the stage. The workspace itself stays
    /// the same directory (it is mounted).
    async fn merge_workspace(&self, id: &SandboxId) -> Result<(), RuntimeError>;
}

/// A runtime that can save a running sandbox's memory (its whole process
/// tree) on the host and start it again from there: hibernate keeps
/// running processes, wake continues them (gVisor's `runsc checkpoint` /
/// `restore`).
///
/// Between [`Self::checkpoint`] and [`Self::restore`] the sandbox has no
/// running compute ([`RuntimeStatus::Stopped`]) but keeps its storage (the
/// writable layer and workspace the memory refers to) and stays in
/// [`Runtime::list`]; `destroy` removes the checkpoint with the rest.
#[async_trait]
pub trait Checkpointable: Pausable {
    /// Saves the memory of running sandbox `id` and stops it. On failure
    /// the sandbox may be gone (the caller destroys it and falls back to its
    /// file-system snapshot); nothing is left half-saved.
    async fn checkpoint(&self, id: &SandboxId) -> Result<(), RuntimeError>;
    /// Whether `id` has a checkpoint that [`Self::restore`] can continue.
    async fn has_checkpoint(&self, id: &SandboxId) -> Result<bool, RuntimeError>;
    /// Starts `spec.id` again from its checkpoint (`spec` is the sandbox's
    /// own, as for its create): its processes continue where they were. The
    /// checkpoint is consumed. Returns like `create`, once PID 1 runs.
    async fn restore(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError>;
    /// A live fork: starts `child.id` (a new sandbox, as for its create)
    /// from a memory image of running sandbox `parent`, with a copy of the
    /// parent's files taken at the moment of the image, so the child runs
    /// the same processes with the same memory. The parent keeps its
    /// processes and files (it stops briefly while the image is taken, and
    /// comes back on new compute: its handle changes). The child's envd
    /// forgets the parent's lease state: it starts unleased, its processes
    /// kept. On failure nothing of the child is left; the parent is running
    /// unless its own restore failed (then the error says so and it must be
    /// destroyed).
    async fn fork_running(
        &self,
        parent: &SandboxId,
        child: &SandboxSpec,
    ) -> Result<LiveFork, RuntimeError>;
}

/// What [`Checkpointable::fork_running`] made.
#[derive(Clone, Debug)]
pub struct LiveFork {
    /// The parent on its new compute (same id, new pids).
    pub parent: SandboxHandle,
    pub child: SandboxHandle,
}

/// One runtime together with the optional capabilities it implements, as a
/// control plane holds it: the same object seen through each trait it has.
#[derive(Clone)]
pub struct CapableRuntime {
    pub runtime: Arc<dyn Runtime>,
    pub pausable: Option<Arc<dyn Pausable>>,
    pub snapshottable: Option<Arc<dyn Snapshottable>>,
    /// Memory checkpoints (hibernate keeps processes), when it has them.
    pub checkpointable: Option<Arc<dyn Checkpointable>>,
}

impl CapableRuntime {
    /// A runtime without optional capabilities.
    pub fn basic(runtime: Arc<dyn Runtime>) -> Self {
        CapableRuntime {
            runtime,
            pausable: None,
            snapshottable: None,
            checkpointable: None,
        }
    }

    /// A runtime that can pause and snapshot (and so also pause).
    pub fn snapshottable<R: Snapshottable + 'static>(runtime: Arc<R>) -> Self {
        CapableRuntime {
            runtime: runtime.clone(),
            pausable: Some(runtime.clone()),
            snapshottable: Some(runtime),
            checkpointable: None,
        }
    }

    /// A runtime that can pause, snapshot and checkpoint memory.
    pub fn checkpointable<R: Snapshottable + Checkpointable + 'static>(runtime: Arc<R>) -> Self {
        CapableRuntime {
            checkpointable: Some(runtime.clone()),
            ..Self::snapshottable(runtime)
        }
    }
}

impl std::fmt::Debug for CapableRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapableRuntime")
            .field("name", &self.runtime.name())
            .field("pausable", &self.pausable.is_some())
            .field("snapshottable", &self.snapshottable.is_some())
            .field("checkpointable", &self.checkpointable.is_some())
            .finish()
    }
}

/// Checks the parts of a spec that do not depend on the backend: a path-safe
/// sandbox path for every bind, a valid hostname, a non-empty init, sane limits.
pub fn validate_spec(spec: &SandboxSpec) -> Result<(), RuntimeError> {
    let invalid = |reason: String| Err(RuntimeError::InvalidSpec { reason });
    if spec.template.digest_hex().is_none() {
        return invalid(format!(
            "template digest {:?} is not sha256:<64 hex>",
            spec.template.digest
        ));
    }
    match (spec.network, &spec.egress) {
        (NetworkProfile::None | NetworkProfile::Open, None)
        | (NetworkProfile::Allowlist, Some(_)) => {}
        (NetworkProfile::Allowlist, None) => {
            return invalid("network profile \"allowlist\" without egress rules".into())
        }
        (other, Some(_)) => {
            return invalid(format!(
                "egress rules given for network profile {:?}",
                other.as_str()
            ))
        }
    }
    if spec.init.is_empty() || spec.init[0].is_empty() {
        return invalid("init argv is empty".into());
    }
    let h = &spec.hostname;
    if h.is_empty()
        || h.len() > 63
        || !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return invalid(format!("hostname {h:?} is not a valid host name"));
    }
    if !(spec.resources.cpu > 0.0 && spec.resources.cpu.is_finite()) {
        return invalid(format!("cpu {} must be positive", spec.resources.cpu));
    }
    if spec.resources.memory_mb < 8 {
        return invalid(format!("memory_mb {} is below 8", spec.resources.memory_mb));
    }
    if spec.resources.pids < 2 {
        return invalid(format!("pids {} is below 2", spec.resources.pids));
    }
    for env in &spec.env {
        if !env.contains('=') || env.starts_with('=') {
            return invalid(format!("env entry {env:?} is not KEY=VALUE"));
        }
    }
    for bind in &spec.binds {
        if !is_clean_absolute(&bind.sandbox) {
            return invalid(format!(
                "bind target {:?} must be absolute without `..`",
                bind.sandbox
            ));
        }
        if bind.sandbox == "/" || is_reserved_target(&bind.sandbox) {
            return invalid(format!(
                "bind target {:?} collides with a runtime mount",
                bind.sandbox
            ));
        }
        if !bind.host.is_absolute() {
            return invalid(format!("bind source {:?} must be absolute", bind.host));
        }
    }
    Ok(())
}

fn is_clean_absolute(p: &str) -> bool {
    aviary_core::paths::clean_absolute(p).is_some()
}

fn is_reserved_target(p: &str) -> bool {
    let p = p.trim_end_matches('/');
    [CONTROL_MOUNT, WORKSPACE_MOUNT, "/proc", "/sys", "/dev"]
        .iter()
        .any(|r| p == *r || p.starts_with(&format!("{r}/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: TemplateRef {
                name: "t".into(),
                digest: format!("sha256:{}", "ab".repeat(32)),
            },
            resources: ResourceLimits::default(),
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx".into(),
            init: vec!["/bin/sh".into()],
            env: vec!["A=b".into()],
            binds: vec![BindMount {
                host: "/usr/local/bin/envd".into(),
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }],
        }
    }

    #[test]
    fn a_plain_spec_is_valid() {
        validate_spec(&spec()).unwrap();
    }

    #[test]
    fn network_profiles_and_their_rules_must_agree() {
        let mut s = spec();
        s.network = NetworkProfile::Open;
        validate_spec(&s).unwrap();
        s.network = NetworkProfile::Allowlist;
        assert!(matches!(
            validate_spec(&s).unwrap_err(),
            RuntimeError::InvalidSpec { .. }
        ));
        s.egress = Some(aviary_core::egress::EgressPolicy {
            profile: "p".into(),
            allow: vec![],
            deny: vec![],
            resolve: Default::default(),
            limits: Default::default(),
        });
        validate_spec(&s).unwrap();
        s.network = NetworkProfile::None;
        assert!(matches!(
            validate_spec(&s).unwrap_err(),
            RuntimeError::InvalidSpec { .. }
        ));
    }

    #[test]
    fn bind_targets_must_not_escape_or_shadow() {
        for bad in [
            "relative",
            "/a/../etc",
            "/workspace",
            "/run/aviary/x",
            "/proc",
            "/",
        ] {
            let mut s = spec();
            s.binds[0].sandbox = bad.into();
            assert!(
                matches!(
                    validate_spec(&s).unwrap_err(),
                    RuntimeError::InvalidSpec { .. }
                ),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn hostname_env_and_limits_are_checked() {
        let mut s = spec();
        s.hostname = "a b".into();
        validate_spec(&s).unwrap_err();
        let mut s = spec();
        s.env.push("NOEQUALS".into());
        validate_spec(&s).unwrap_err();
        let mut s = spec();
        s.resources.cpu = f64::NAN;
        validate_spec(&s).unwrap_err();
        let mut s = spec();
        s.init.clear();
        validate_spec(&s).unwrap_err();
    }

    #[test]
    fn template_digests_are_checked() {
        for bad in [
            "",
            "sha256:",
            "sha256:../../etc",
            "md5:abcd",
            &format!("sha256:{}", "AB".repeat(32)),
            &format!("sha256:{}/x", "ab".repeat(32)),
        ] {
            let mut s = spec();
            s.template.digest = bad.to_string();
            assert!(
                matches!(
                    validate_spec(&s).unwrap_err(),
                    RuntimeError::InvalidSpec { .. }
                ),
                "{bad} accepted"
            );
        }
    }
}
