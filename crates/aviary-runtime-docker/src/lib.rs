//! Aviary's Docker runtime: sandboxes as containers of a `dockerd` the
//! operator already runs, driven through the Docker Engine API (`bollard`).
//!
//! Per sandbox this crate owns `<state_dir>/<id>/` — the mount point of the
//! sandbox's own ext4 disk of `disk_mb` (`aviary_runtime_oci::SandboxDisks`,
//! the same quota as the crun tier: `/workspace` is bounded, and no host path
//! shows in the container's mountinfo) holding `control/` (host-only, 0700:
//! the hard link to envd's socket), `envd/` (bind-mounted at
//! [`envd_socket::ENVD_SOCKET_DIR_IN_SANDBOX`], where envd binds its socket)
//! and `workspace/` (at `/workspace`) — plus one container named
//! `aviary-<id>`, labelled with this runtime's state dir, and one image per
//! template, `aviary-template:<digest hex>`, imported from the template
//! store's rootfs on first use (see [`image`]).
//!
//! envd: Docker cannot pass a descriptor to PID 1, so an init that asks for
//! socket activation (`--listen-fd 3`) is started with `--socket` on a path in
//! the bind-mounted `envd/` dir instead; create waits for the socket and takes
//! it out of the sandbox's reach (see [`envd_socket`]). The host's peer check
//! (`SO_PEERCRED` = the container's init pid from inspect, a host pid) is the
//! same as for crun.
//!
//! Hardening, as far as Docker allows: every capability dropped but the crun
//! tier's set (`aviary_runtime_oci::config::CAPABILITIES`), no-new-privileges,
//! Aviary's own seccomp profile (`aviary_runtime_oci::seccomp`; Docker's
//! default allows io_uring), no network (`none`), memory (= memory+swap),
//! CPU and pids limits from the spec, a private `/tmp` tmpfs, no log driver
//! (the sandbox's output never lands in a host file), no restart, a private
//! cgroup namespace, a read-only `/sys/fs/cgroup`, 1024 open files. What
//! differs from crun: no per-sandbox user namespace (root inside is host
//! root unless dockerd runs with `userns-remap`), and the container's
//! writable layer is Docker's overlay2 dir, not bounded by `disk_mb`.
//!
//! Invariants: `destroy` removes the container (forced, paused or not), the
//! disk and the dirs, and is idempotent; `list` is the union of this
//! runtime's labelled containers and its sandbox dirs, so half-created
//! sandboxes are visible. Concurrency: `DockerRuntime` is `Send + Sync`;
//! calls for one sandbox are serialised by the caller.

pub mod envd_socket;

/// Open files per process in a container (soft and hard): what a crun or
/// runc sandbox gets, not dockerd's own limit (20000 here, which let pids x
/// nofile outgrow the host's `fs.file-max` in the suite's `fd_exhaustion`).
const NOFILE: i64 = 1024;

/// Paths made read-only in every container: Docker's defaults (a list set
/// here replaces them) and `/sys/fs/cgroup`.
const READONLY_PATHS: [&str; 6] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/sys/fs/cgroup",
];
mod image;

use async_trait::async_trait;
use aviary_core::{NetworkProfile, SandboxId};
use aviary_runtime::conformance::Inspector;
use aviary_runtime::{
    validate_spec, EnvdEndpoint, Pausable, ResourceUsage, Runtime, RuntimeError, RuntimeStatus,
    SandboxHandle, SandboxSpec, SpawnOutput, Spawner, TemplateRef, ENVD_SOCKET_NAME,
    WORKSPACE_MOUNT,
};
use aviary_runtime_oci::{ProcessSpawner, SandboxDisks};
use bollard::models::{ContainerCreateBody, ContainerStateStatusEnum, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use bollard::Docker;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tracing::instrument;

/// The runtime's name (`aviary_core::RuntimeName::Docker`).
pub const NAME: &str = "docker";
/// Label naming the sandbox a container is.
const LABEL_SANDBOX: &str = "aviary.sandbox";
/// Label naming the state dir of the runtime that made a container, so two
/// runtimes (two servers, tests) sharing one dockerd never see each other's.
const LABEL_STATE: &str = "aviary.state";

/// Configuration of a [`DockerRuntime`].
#[derive(Clone, Debug)]
pub struct DockerConfig {
    /// dockerd's API socket (`unix://` prefix optional).
    pub socket: PathBuf,
    /// Root of all per-sandbox state; created if missing.
    pub state_dir: PathBuf,
    /// The template store (`aviary-templates`) whose `rootfs/<digest hex>`
    /// trees become images. `None`: every create is refused.
    pub template_store: Option<PathBuf>,
    /// Size of each sandbox's private `/tmp` tmpfs (charged to its memory).
    pub tmp_size_mb: u64,
    /// Longest one Engine API call may take (an image import gets longer).
    pub command_timeout: Duration,
    /// Enforce `disk_mb` on `/workspace` with a file system per sandbox.
    pub disk_quota: bool,
    /// Repository of the template images (`<repo>:<digest hex>`).
    pub image_repo: String,
}

impl DockerConfig {
    pub fn new(socket: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        DockerConfig {
            socket: socket.into(),
            state_dir: state_dir.into(),
            template_store: None,
            tmp_size_mb: 256,
            command_timeout: Duration::from_secs(30),
            disk_quota: true,
            image_repo: "aviary-template".into(),
        }
    }

    /// Resolves templates in the store at `root`.
    pub fn with_template_store(mut self, root: impl Into<PathBuf>) -> Self {
        self.template_store = Some(root.into());
        self
    }
}

/// Sandboxes as Docker containers.
pub struct DockerRuntime {
    config: DockerConfig,
    docker: Docker,
    disks: SandboxDisks,
    spawner: Arc<dyn Spawner>,
    /// One template import at a time (two creates of a new template must not
    /// both stream it to dockerd).
    imports: tokio::sync::Mutex<()>,
}

/// Host paths of one sandbox.
struct SandboxDirs {
    root: PathBuf,
}

impl SandboxDirs {
    fn control(&self) -> PathBuf {
        self.root.join("control")
    }
    fn envd(&self) -> PathBuf {
        self.root.join("envd")
    }
    fn workspace(&self) -> PathBuf {
        self.root.join("workspace")
    }
    /// A tree waiting to be merged into the running workspace: on the
    /// sandbox's disk, never mounted inside.
    fn workspace_stage(&self) -> PathBuf {
        self.root.join(".restore")
    }
    /// Layers staged for a sandbox that does not exist yet:
    /// `<state_dir>/<id>.seed/{writable,workspace}`, beside its dir.
    fn seed(&self) -> PathBuf {
        let mut s = self.root.as_os_str().to_owned();
        s.push(".seed");
        PathBuf::from(s)
    }
}

/// Maps an Engine API failure of `action` on sandbox `id`.
fn api_error(action: &str, id: Option<&SandboxId>, e: bollard::errors::Error) -> RuntimeError {
    use bollard::errors::Error as E;
    match (&e, id) {
        (
            E::DockerResponseServerError {
                status_code: 404, ..
            },
            Some(id),
        ) => RuntimeError::NotFound { id: id.clone() },
        (
            E::DockerResponseServerError {
                status_code: 409, ..
            },
            Some(id),
        ) if action == "create container" => RuntimeError::AlreadyExists { id: id.clone() },
        (E::DockerResponseServerError { message, .. }, _) => RuntimeError::InvokeRuntime {
            action: format!("docker {action}"),
            detail: message.clone(),
        },
        _ => RuntimeError::InvokeRuntime {
            action: format!("docker {action}"),
            detail: e.to_string(),
        },
    }
}

fn is_not_found(e: &bollard::errors::Error) -> bool {
    matches!(
        e,
        bollard::errors::Error::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// The container name of sandbox `id`.
pub fn container_name(id: &SandboxId) -> String {
    format!("aviary-{id}")
}

/// What the runtime knows of one sandbox's container.
struct Container {
    status: RuntimeStatus,
    /// Host pid of its init (0 when not running).
    pid: u32,
}

impl DockerRuntime {
    /// Connects to dockerd (negotiating the API version it speaks) and opens
    /// the state dir.
    pub async fn connect(config: DockerConfig) -> Result<Self, RuntimeError> {
        let socket = config.socket.display().to_string();
        let probe = |reason: String| RuntimeError::ProbeRuntime { reason };
        // the per-request timeout; calls that may take long (an import) set
        // their own bound
        let docker = Docker::connect_with_unix(&socket, 600, bollard::API_DEFAULT_VERSION)
            .map_err(|e| probe(format!("dockerd socket {socket}: {e}")))?;
        let docker = tokio::time::timeout(config.command_timeout, docker.negotiate_version())
            .await
            .map_err(|_| probe(format!("dockerd at {socket} did not answer")))?
            .map_err(|e| probe(format!("dockerd at {socket}: {e}")))?;
        std::fs::create_dir_all(&config.state_dir).map_err(|source| RuntimeError::CreateDir {
            path: config.state_dir.clone(),
            source,
        })?;
        let disks =
            SandboxDisks::open(&config.state_dir, config.disk_quota, config.command_timeout)?;
        Ok(DockerRuntime {
            config,
            docker,
            disks,
            spawner: Arc::new(ProcessSpawner),
            imports: tokio::sync::Mutex::new(()),
        })
    }

    pub fn config(&self) -> &DockerConfig {
        &self.config
    }

    /// dockerd's version, and a check that sandbox disks work here.
    pub async fn probe(&self) -> Result<String, RuntimeError> {
        let v = self
            .timed("version", self.docker.version())
            .await?
            .map_err(|e| api_error("version", None, e))?;
        self.disks
            .probe(&*self.spawner, &self.config.state_dir)
            .await
            .map_err(|reason| RuntimeError::ProbeRuntime { reason })?;
        Ok(format!(
            "dockerd {} (API {})",
            v.version.unwrap_or_default(),
            v.api_version.unwrap_or_default()
        ))
    }

    fn dirs(&self, id: &SandboxId) -> SandboxDirs {
        SandboxDirs {
            root: self.config.state_dir.join(id.as_str()),
        }
    }

    /// `fut` within the command timeout.
    async fn timed<T>(
        &self,
        action: &str,
        fut: impl std::future::Future<Output = T>,
    ) -> Result<T, RuntimeError> {
        tokio::time::timeout(self.config.command_timeout, fut)
            .await
            .map_err(|_| RuntimeError::InvokeRuntime {
                action: format!("docker {action}"),
                detail: format!(
                    "no answer from dockerd within {:?}",
                    self.config.command_timeout
                ),
            })
    }

    /// The sandbox's container as dockerd sees it; `None` when it has none
    /// (or one another runtime made).
    async fn container(&self, id: &SandboxId) -> Result<Option<Container>, RuntimeError> {
        let got = self
            .timed(
                "inspect",
                self.docker.inspect_container(
                    &container_name(id),
                    None::<bollard::query_parameters::InspectContainerOptions>,
                ),
            )
            .await?;
        let info = match got {
            Ok(info) => info,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(api_error("inspect", Some(id), e)),
        };
        let labels = info
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .cloned()
            .unwrap_or_default();
        if labels.get(LABEL_STATE).map(String::as_str) != Some(&*self.state_label()) {
            return Ok(None);
        }
        let state = info.state.unwrap_or_default();
        let status = match state.status {
            Some(ContainerStateStatusEnum::RUNNING) if state.paused == Some(true) => {
                RuntimeStatus::Paused
            }
            Some(ContainerStateStatusEnum::RUNNING) => RuntimeStatus::Running,
            Some(ContainerStateStatusEnum::PAUSED) => RuntimeStatus::Paused,
            _ => RuntimeStatus::Stopped,
        };
        let pid = state
            .pid
            .and_then(|p| u32::try_from(p).ok())
            .unwrap_or_default();
        Ok(Some(Container { status, pid }))
    }

    fn state_label(&self) -> String {
        self.config.state_dir.display().to_string()
    }

    /// Runs `argv` inside sandbox `id` (`docker exec`, as root, output
    /// collected): for tests and the conformance suite's [`Inspector`];
    /// Aviary's own execs go through envd.
    pub async fn exec(&self, id: &SandboxId, argv: &[&str]) -> Result<SpawnOutput, RuntimeError> {
        use bollard::container::LogOutput;
        use bollard::exec::{CreateExecOptions, StartExecResults};
        let name = container_name(id);
        let created = self
            .timed(
                "exec",
                self.docker.create_exec(
                    &name,
                    CreateExecOptions {
                        cmd: Some(argv.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
                        attach_stdout: Some(true),
                        attach_stderr: Some(true),
                        ..Default::default()
                    },
                ),
            )
            .await?
            .map_err(|e| api_error("exec", Some(id), e))?;
        let started = self
            .timed("exec", self.docker.start_exec(&created.id, None))
            .await?
            .map_err(|e| api_error("exec", Some(id), e))?;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        if let StartExecResults::Attached { mut output, .. } = started {
            let collect = async {
                while let Some(chunk) = output.next().await {
                    match chunk.map_err(|e| api_error("exec", Some(id), e))? {
                        LogOutput::StdOut { message } | LogOutput::Console { message } => {
                            stdout.extend_from_slice(&message)
                        }
                        LogOutput::StdErr { message } => stderr.extend_from_slice(&message),
                        LogOutput::StdIn { .. } => {}
                    }
                }
                Ok::<(), RuntimeError>(())
            };
            self.timed("exec", collect).await??;
        }
        let inspect = self
            .timed("exec", self.docker.inspect_exec(&created.id))
            .await?
            .map_err(|e| api_error("exec", Some(id), e))?;
        Ok(SpawnOutput {
            code: inspect.exit_code.and_then(|c| i32::try_from(c).ok()),
            timed_out: false,
            stdout,
            stderr,
        })
    }

    async fn create_inner(
        &self,
        spec: &SandboxSpec,
        image: &str,
        dirs: &SandboxDirs,
    ) -> Result<SandboxHandle, RuntimeError> {
        let (control, envd, workspace) = (dirs.control(), dirs.envd(), dirs.workspace());
        make_dir(&control, 0o700)?;
        make_dir(&envd, 0o755)?;
        // a workspace staged for this id (a restore) is adopted instead of
        // starting empty
        let seed = dirs.seed();
        let staged_workspace = seed.join("workspace");
        if staged_workspace.is_dir() {
            self.disks
                .adopt(&*self.spawner, &staged_workspace, &workspace)
                .await?;
        } else {
            make_dir(&workspace, 0o755)?;
        }

        // Socket activation cannot cross the Engine API: envd binds its
        // socket itself, in the bind-mounted dir, and the host adopts it.
        let activation = [
            "--listen-fd".to_string(),
            aviary_runtime::ENVD_LISTEN_FD.to_string(),
        ];
        let mut cmd = spec.init.clone();
        let serves_envd = cmd.len() == 3 && cmd[1..] == activation;
        if serves_envd {
            cmd.truncate(1);
            cmd.extend([
                "--socket".to_string(),
                envd_socket::ENVD_SOCKET_IN_SANDBOX.to_string(),
            ]);
        }
        let body = self.container_body(spec, image, cmd, dirs)?;
        let options = CreateContainerOptionsBuilder::default()
            .name(&container_name(&spec.id))
            .build();
        self.timed(
            "create container",
            self.docker.create_container(Some(options), body),
        )
        .await?
        .map_err(|e| api_error("create container", Some(&spec.id), e))?;
        let staged_writable = seed.join("writable");
        if staged_writable.is_dir() {
            self.adopt_writable(&spec.id, &staged_writable).await?;
        }
        remove_tree(&seed)?;
        self.timed(
            "start",
            self.docker.start_container(
                &container_name(&spec.id),
                None::<bollard::query_parameters::StartContainerOptions>,
            ),
        )
        .await?
        .map_err(|e| api_error("start", None, e))?;
        let running = self
            .container(&spec.id)
            .await?
            .filter(|c| c.pid > 0)
            .ok_or_else(|| RuntimeError::InvokeRuntime {
                action: "docker start".into(),
                detail: "the container's init is not running after start".into(),
            })?;
        if serves_envd {
            self.adopt_envd_socket(&spec.id, dirs).await?;
        }
        Ok(SandboxHandle {
            id: spec.id.clone(),
            runtime: NAME.to_string(),
            runtime_instance_id: container_name(&spec.id),
            control_dir: control,
            workspace_dir: workspace,
            init_pid: running.pid,
            envd: None,
        })
    }

    /// Waits until envd has bound its socket (nothing else runs in the
    /// sandbox yet), then moves it out of the sandbox's reach.
    async fn adopt_envd_socket(
        &self,
        id: &SandboxId,
        dirs: &SandboxDirs,
    ) -> Result<(), RuntimeError> {
        let deadline = tokio::time::Instant::now() + self.config.command_timeout;
        let mut polls = 0u32;
        loop {
            match envd_socket::probe(&dirs.envd(), ENVD_SOCKET_NAME)? {
                envd_socket::Seen::Socket => break,
                envd_socket::Seen::Other => {
                    return Err(RuntimeError::InvokeRuntime {
                        action: "start envd".into(),
                        detail: "its socket path holds something else".into(),
                    })
                }
                envd_socket::Seen::Nothing => {}
            }
            polls += 1;
            // envd exiting early (bad arguments, a broken binary) ends the wait
            if polls.is_multiple_of(20)
                && self
                    .container(id)
                    .await?
                    .is_none_or(|c| c.status == RuntimeStatus::Stopped)
            {
                return Err(RuntimeError::InvokeRuntime {
                    action: "start envd".into(),
                    detail: "the sandbox's init exited before envd listened".into(),
                });
            }
            if tokio::time::Instant::now() > deadline {
                return Err(RuntimeError::InvokeRuntime {
                    action: "start envd".into(),
                    detail: format!("no envd socket within {:?}", self.config.command_timeout),
                });
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        envd_socket::adopt(&dirs.envd(), &dirs.control(), ENVD_SOCKET_NAME)
    }

    /// The container's configuration: the spec's limits and the hardening
    /// of the module doc.
    fn container_body(
        &self,
        spec: &SandboxSpec,
        image: &str,
        cmd: Vec<String>,
        dirs: &SandboxDirs,
    ) -> Result<ContainerCreateBody, RuntimeError> {
        let build =
            |e: Box<dyn std::error::Error + Send + Sync>| RuntimeError::BuildConfig { source: e };
        let seccomp = aviary_runtime_oci::seccomp::profile().map_err(|e| build(Box::new(e)))?;
        let seccomp = serde_json::to_string(&seccomp).map_err(|e| build(Box::new(e)))?;
        let caps = aviary_runtime_oci::config::CAPABILITIES
            .iter()
            .map(|c| {
                serde_json::to_value(c)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .ok_or_else(|| build(format!("capability {c:?} has no name").into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let limits = spec.resources;
        let memory =
            i64::try_from(limits.memory_mb.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX);
        // at least 1 ms of CPU per 100 ms period, as in the crun tier
        let nano_cpus = ((limits.cpu * 1e9).round() as i64).max(10_000_000);
        let mut binds = vec![
            bind(&dirs.workspace(), WORKSPACE_MOUNT, false),
            bind(&dirs.envd(), envd_socket::ENVD_SOCKET_DIR_IN_SANDBOX, false),
        ];
        binds.extend(
            spec.binds
                .iter()
                .map(|b| bind(&b.host, &b.sandbox, b.read_only)),
        );
        let mut env = spec.env.clone();
        if !env.iter().any(|e| e.starts_with("PATH=")) {
            env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
        }
        let host = HostConfig {
            binds: Some(binds),
            network_mode: Some("none".into()),
            cap_drop: Some(vec!["ALL".into()]),
            cap_add: Some(caps),
            security_opt: Some(vec![
                "no-new-privileges".into(),
                format!("seccomp={seccomp}"),
            ]),
            memory: Some(memory),
            memory_swap: Some(memory),
            nano_cpus: Some(nano_cpus),
            pids_limit: Some(i64::from(limits.pids)),
            tmpfs: Some(HashMap::from([(
                "/tmp".to_string(),
                format!("rw,nosuid,nodev,size={}m", self.config.tmp_size_mb),
            )])),
            log_config: Some(bollard::models::HostConfigLogConfig {
                typ: Some("none".into()),
                config: None,
            }),
            // envd is PID 1 and reaps; no docker-init in between
            init: Some(false),
            privileged: Some(false),
            // its own cgroup namespace: the sandbox sees its cgroup as the
            // root, not the host's hierarchy (the security suite's
            // `namespaces` probe)
            cgroupns_mode: Some(bollard::models::HostConfigCgroupnsModeEnum::PRIVATE),
            // Docker's own read-only paths plus the cgroup v1 tmpfs at
            // /sys/fs/cgroup, which runc leaves writable (the suite's
            // `sys_and_cgroupfs` probe made a dir there)
            readonly_paths: Some(READONLY_PATHS.iter().map(|p| p.to_string()).collect()),
            ulimits: Some(vec![bollard::models::ResourcesUlimits {
                name: Some("nofile".into()),
                soft: Some(NOFILE),
                hard: Some(NOFILE),
            }]),
            ..Default::default()
        };
        Ok(ContainerCreateBody {
            hostname: Some(spec.hostname.clone()),
            image: Some(image.to_string()),
            entrypoint: Some(cmd),
            cmd: None,
            env: Some(env),
            user: Some("0:0".into()),
            working_dir: Some("/".into()),
            labels: Some(HashMap::from([
                (LABEL_SANDBOX.to_string(), spec.id.to_string()),
                (LABEL_STATE.to_string(), self.state_label()),
            ])),
            // not `network_disabled`: with it dockerd makes no network
            // namespace at all, and the container shares the host's
            attach_stdin: Some(false),
            attach_stdout: Some(false),
            attach_stderr: Some(false),
            open_stdin: Some(false),
            tty: Some(false),
            host_config: Some(host),
            ..Default::default()
        })
    }

    /// Unmounts the sandbox's disk (if mounted) and removes the sandbox dir
    /// and its image.
    async fn remove_host_state(&self, dirs: &SandboxDirs) -> Vec<RuntimeError> {
        let mut residue = Vec::new();
        if is_mount_point(&dirs.root) {
            if let Err(e) = nix::mount::umount2(&dirs.root, nix::mount::MntFlags::MNT_DETACH) {
                residue.push(RuntimeError::Unmount {
                    path: dirs.root.clone(),
                    source: e.into(),
                });
            }
        }
        if let Err(e) = self.disks.release(&dirs.root) {
            residue.push(e);
        }
        for dir in [dirs.root.clone(), dirs.seed()] {
            // unlinking can be slow; keep it off the async workers
            let d = dir.clone();
            let removed = tokio::task::spawn_blocking(move || remove_tree(&d))
                .await
                .unwrap_or_else(|join| {
                    Err(RuntimeError::RemoveDir {
                        path: dir.clone(),
                        source: std::io::Error::other(join.to_string()),
                    })
                });
            if let Err(e) = removed {
                residue.push(e);
            }
        }
        residue
    }
}

/// `host:target[:ro]`, Docker's bind syntax (`validate_spec` checked the
/// target; host paths are the runtime's own or the control plane's).
fn bind(host: &Path, target: &str, read_only: bool) -> String {
    format!(
        "{}:{target}:{}",
        host.display(),
        if read_only { "ro" } else { "rw" }
    )
}

/// Whether `dir` is on another file system than its parent.
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(dir), dir.parent().map(std::fs::metadata)) {
        (Ok(d), Some(Ok(p))) => d.dev() != p.dev(),
        _ => false,
    }
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
fn make_dir(dir: &Path, mode: u32) -> Result<(), RuntimeError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .mode(mode)
        .create(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)))
        .map_err(|source| RuntimeError::CreateDir {
            path: dir.to_path_buf(),
            source,
        })
}

#[async_trait]
impl Runtime for DockerRuntime {
    fn name(&self) -> &str {
        NAME
    }

    #[instrument(skip_all, fields(sandbox.id = %spec.id, runtime = NAME))]
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        validate_spec(spec)?;
        if spec.network != NetworkProfile::None {
            return Err(RuntimeError::Unsupported {
                what: format!(
                    "network profile {:?} on the docker runtime",
                    spec.network.as_str()
                ),
            });
        }
        let image = self.template_image(&spec.template).await?;
        let dirs = self.dirs(&spec.id);
        if self.container(&spec.id).await?.is_some() {
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
            Ok(()) => self.create_inner(spec, &image, &dirs).await,
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

    #[instrument(skip_all, fields(sandbox.id = %id, runtime = NAME))]
    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let mut errors = Vec::new();
        if self.container(id).await?.is_some() {
            let options = RemoveContainerOptionsBuilder::default()
                .force(true)
                .v(true)
                .build();
            match self
                .timed(
                    "remove",
                    self.docker
                        .remove_container(&container_name(id), Some(options)),
                )
                .await?
            {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => errors.push(api_error("remove", Some(id), e)),
            }
        }
        errors.extend(self.remove_host_state(&self.dirs(id)).await);
        let mut all = errors.into_iter();
        match all.next() {
            None => Ok(()),
            Some(first) => Err(all.fold(first, |acc, e| acc.with_cleanup(Err(e)))),
        }
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        Ok(match self.container(id).await? {
            Some(c) => c.status,
            // half-created or half-destroyed: there is something to destroy
            None if self.dirs(id).root.exists() => RuntimeStatus::Stopped,
            None => RuntimeStatus::NotFound,
        })
    }

    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        let root = self.dirs(id).root;
        let container = self.container(id).await?;
        let Some(container) = container.filter(|_| root.exists()) else {
            return Err(RuntimeError::NotFound { id: id.clone() });
        };
        let mut usage = if container.pid > 0 {
            cgroup::usage(container.pid)?
        } else {
            ResourceUsage::default()
        };
        if self.config.disk_quota {
            usage.disk_free_bytes = nix::sys::statvfs::statvfs(&root)
                .ok()
                .map(|v| v.blocks_available().saturating_mul(v.fragment_size()));
        }
        Ok(usage)
    }

    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_STATE}={}", self.state_label())],
        )]);
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let containers = self
            .timed("list", self.docker.list_containers(Some(options)))
            .await?
            .map_err(|e| api_error("list", None, e))?;
        let mut ids: Vec<SandboxId> = containers
            .iter()
            .filter_map(|c| c.labels.as_ref()?.get(LABEL_SANDBOX)?.parse().ok())
            .collect();
        let dir = &self.config.state_dir;
        match std::fs::read_dir(dir) {
            Ok(rd) => ids.extend(rd.flatten().filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                // a sandbox's dir, its disk image, or a stage no create
                // adopted: each is the sandbox's to `destroy`
                name.strip_suffix(".img")
                    .or_else(|| name.strip_suffix(".seed"))
                    .unwrap_or(name)
                    .parse::<SandboxId>()
                    .ok()
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(RuntimeError::ReadFile {
                    path: dir.clone(),
                    source,
                })
            }
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    async fn envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        let container = self
            .container(id)
            .await?
            .filter(|c| c.pid > 0)
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })?;
        Ok(EnvdEndpoint {
            socket: self.dirs(id).control().join(ENVD_SOCKET_NAME),
            peer_pid: container.pid,
        })
    }
}

#[async_trait]
impl Pausable for DockerRuntime {
    /// `docker pause`: the freezer cgroup; dockerd answers once it is frozen.
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        if self.container(id).await?.is_none() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        self.timed("pause", self.docker.pause_container(&container_name(id)))
            .await?
            .map_err(|e| api_error("pause", Some(id), e))
    }

    /// `docker unpause`, then waits until dockerd itself reports the
    /// container running. dockerd (20.10) also sets its paused flag from
    /// containerd's asynchronous pause event: one handled after the unpause
    /// flips the flag back until the resume event that follows it, and in
    /// between dockerd refuses `exec` and `pause` on a running container.
    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        if self.container(id).await?.is_none() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        self.timed(
            "unpause",
            self.docker.unpause_container(&container_name(id)),
        )
        .await?
        .map_err(|e| api_error("unpause", Some(id), e))?;
        let deadline = tokio::time::Instant::now() + self.config.command_timeout;
        loop {
            match self.container(id).await? {
                Some(c) if c.status == RuntimeStatus::Paused => {}
                Some(_) => return Ok(()),
                None => return Err(RuntimeError::NotFound { id: id.clone() }),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(RuntimeError::InvokeRuntime {
                    action: "docker unpause".into(),
                    detail: format!(
                        "dockerd still reports the container paused after {:?}",
                        self.config.command_timeout
                    ),
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// The pids come from the sandbox's freezer cgroup (written by the
    /// kernel) and the init pid from dockerd; frozen processes cannot exit,
    /// so no pid is reused under us.
    async fn end_frozen_processes(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let container = self
            .container(id)
            .await?
            .filter(|c| c.pid > 0)
            .ok_or_else(|| RuntimeError::NotFound { id: id.clone() })?;
        for pid in cgroup::processes(id, container.pid)? {
            if pid == container.pid {
                continue;
            }
            // ESRCH: already gone
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        Ok(())
    }
}

#[async_trait]
impl Inspector for DockerRuntime {
    async fn run_inside(
        &self,
        handle: &SandboxHandle,
        argv: &[&str],
    ) -> Result<SpawnOutput, RuntimeError> {
        self.exec(&handle.id, argv).await
    }
}

impl DockerRuntime {
    /// The image of `template`, imported from the template store on first
    /// use.
    async fn template_image(&self, template: &TemplateRef) -> Result<String, RuntimeError> {
        image::ensure(self, template).await
    }

    /// Removes a template image (`<repo>:<hex>`) from dockerd; an absent one
    /// is fine. For operators and tests: images are otherwise kept, like the
    /// template store's trees.
    pub async fn remove_image(&self, image: &str) -> Result<(), RuntimeError> {
        match self
            .timed(
                "remove image",
                self.docker.remove_image(
                    image,
                    None::<bollard::query_parameters::RemoveImageOptions>,
                    None,
                ),
            )
            .await?
        {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(api_error("remove image", None, e)),
        }
    }
}

mod cgroup;
mod layers;
