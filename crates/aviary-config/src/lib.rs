//! Aviary's configuration file (`aviary serve --config aviary.toml`).
//!
//! This crate owns the shape of the file, its built-in defaults and its
//! validation. The defaults are documented, option by option, in
//! `aviary.example.toml` at the repository root; a test keeps
//! [`Config::default()`] equal to that file.
//!
//! Invariants of a [`Config`] returned by [`Config::load`] / [`Config::from_str`]
//! (and of the default): names are unique per section; every class has
//! positive limits and at least one runtime and network profile, all of them
//! defined; every tenant, pool and `server.default_class` refers only to
//! defined classes, profiles and runtimes; pool bounds are ordered; every
//! projection's host path is absolute, existed at load time and is not a
//! symlink, and its sandbox path is absolute, normalized (no `.`, `..`, empty
//! components or trailing `/`) and unique. Anything
//! else is a [`ConfigError`] naming `file:line:column` and the key, so a
//! server with a bad file never starts.
//!
//! Section rules: every top-level section may be left out, and then takes its
//! built-in default as a whole. A section that is present replaces the default
//! entirely (a file with one `[[class]]` has one class). Within `[server]`,
//! `[planner]`, `[overcommit]` and `[reconciler]` each key defaults on its own.
//!
//! I/O: [`Config::load`] reads the file, and validation looks at each
//! `[[projection]]` host path (it must exist when the configuration is
//! loaded); no global state.
#![forbid(unsafe_code)]

pub mod distributed;
mod error;
mod raw;

pub use distributed::{DistributedSettings, ServiceKind, ServiceUrl};
pub use error::{ConfigError, LineCol};

use aviary_core::{NetworkProfile, ResourceLimits};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The example file, which documents every option; it equals the defaults.
pub const EXAMPLE_TOML: &str = include_str!("../../../aviary.example.toml");

/// The whole configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub server: ServerSettings,
    /// `[[class]]` tables, in file order.
    pub classes: Vec<ResourceClass>,
    /// `[[network_profile]]` tables, in file order.
    pub network_profiles: Vec<NetworkProfileDef>,
    /// `[[tenant]]` tables, in file order.
    pub tenants: Vec<Tenant>,
    /// `[[pool]]` tables, in file order.
    pub pools: Vec<PoolSettings>,
    pub planner: PlannerSettings,
    pub overcommit: Overcommit,
    /// `[reconciler]`: how often the registry is compared with the runtimes,
    /// and how long before unclaimed compute or a silent node is acted on.
    pub reconciler: ReconcilerSettings,
    /// `[snapshots]`: where snapshot chunks and manifests are kept.
    pub snapshots: SnapshotSettings,
    /// `[distributed]`: a shared PostgreSQL registry and Redis coordination
    /// store (default: neither, the embedded SQLite + in-process mode).
    pub distributed: DistributedSettings,
    /// `[[projection]]` tables, in file order (default: none).
    pub projections: Vec<Projection>,
    /// `[remote_e2b]`: the E2B-compatible service behind runtime `e2b`
    /// (default: none; `server.runtimes` may list `e2b` only with it).
    pub remote_e2b: Option<RemoteE2bSettings>,
    /// `[remote_opensandbox]`: the OpenSandbox-compatible service behind
    /// runtime `opensandbox` (default: none; `server.runtimes` may list
    /// `opensandbox` only with it).
    pub remote_opensandbox: Option<RemoteOpenSandboxSettings>,
    /// `[kubernetes]`: the Kubernetes runtime's cluster, namespace, tier and
    /// images; present exactly when `server.runtimes` lists `kubernetes`.
    pub kubernetes: Option<KubernetesSettings>,
}

/// `[remote_e2b]`: where runtime `e2b` places sandboxes (an E2B-compatible
/// service: E2B's cloud, or another Aviary's `/e2b` surface). The key is
/// named by an environment variable or a file, never written here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteE2bSettings {
    /// The control API (`E2B_API_URL`), `http(s)://…`, no trailing slash.
    pub api_url: String,
    /// One URL for every sandbox's envd (`E2B_SANDBOX_URL`); `None`:
    /// `https://49983-{id}.{domain}`.
    pub sandbox_url: Option<String>,
    /// The sandbox domain: a port is `{port}-{id}.{domain}`.
    pub domain: String,
    /// Where port traffic is sent, `Host` still `{port}-{id}.{domain}`;
    /// `None`: `https://{port}-{id}.{domain}`.
    pub port_url: Option<String>,
    /// Send the key to the port proxy as a bearer token (only for a proxy
    /// that consumes it, such as Aviary's).
    pub proxy_key: bool,
    /// The environment variable that holds the API key.
    pub api_key_env: Option<String>,
    /// A file that holds the API key (first line).
    pub api_key_file: Option<PathBuf>,
    /// Aviary template (name or `sha256:` digest) → the provider's template.
    pub templates: std::collections::BTreeMap<String, String>,
    /// The lifetime asked of the provider per sandbox, seconds.
    pub timeout_s: u64,
}

/// `[remote_opensandbox]`: where runtime `opensandbox` places sandboxes (an
/// OpenSandbox-compatible service: an OpenSandbox server, or another
/// Aviary's `/opensandbox` surface). The key is named by an environment
/// variable or a file, never written here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteOpenSandboxSettings {
    /// The server, `http(s)://host[:port][/prefix]`, no trailing slash: the
    /// lifecycle API is `{url}/v1` (`OPEN_SANDBOX_DOMAIN` with its
    /// protocol); its scheme is also the one endpoints are reached with.
    pub url: String,
    /// The environment variable that holds the API key.
    pub api_key_env: Option<String>,
    /// A file that holds the API key (first line).
    pub api_key_file: Option<PathBuf>,
    /// Aviary template (name or `sha256:` digest) → the provider's image.
    pub templates: std::collections::BTreeMap<String, String>,
    /// The lifetime asked of the provider per sandbox, seconds.
    pub timeout_s: u64,
    /// Longest one call to the provider may take, seconds.
    pub request_timeout_s: u64,
    /// Longest a sandbox may take to run, pause or resume, seconds.
    pub ready_timeout_s: u64,
    /// Ask for a deny-all egress policy (`networkPolicy`), so that the
    /// sandbox has no network as profile `none` says (default true; a
    /// provider without an egress sidecar, or Aviary's own surface, refuses
    /// the field).
    pub deny_egress: bool,
    /// The provider pauses and resumes (default true); false: the runtime
    /// has no pause and the control plane treats it as such.
    pub pausable: bool,
}

/// `[[projection]]`: a host file or directory synced one-way into every
/// sandbox when it starts (workspace projection, seed 000: `AGENTS.md`,
/// `skills/`, `knowledge/`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Projection {
    /// Absolute host path; it existed and was not a symlink when loaded.
    pub host: PathBuf,
    /// Absolute, normalized path in the sandbox (`/workspace/skills`).
    pub sandbox: String,
}

/// `[server]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerSettings {
    /// Registry, templates, sandboxes and `admin.key` live here.
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// The local node's default OCI runtime.
    pub runtime: Runtime,
    /// Every runtime the local node serves side by side (`runtime` among
    /// them); a class or a create that names one of them gets it.
    pub runtimes: Vec<Runtime>,
    /// Template used when a create names none.
    pub default_template: String,
    /// Class used when a create names neither a class nor an intent.
    pub default_class: String,
    /// The HTTP edge's limits against floods and slow clients.
    pub edge: EdgeSettings,
    /// Enforce the `open` network profile on this node (NAT through
    /// `slirp4netns`, always-denied ranges refused by a firewall in the
    /// sandbox's namespace). Off: `open` creates are refused by the node.
    pub open_network: bool,
    /// dockerd's API socket, for the `docker` runtime (used only when
    /// `runtimes` lists it).
    pub docker_socket: PathBuf,
    /// Sandbox disks each crun/runc runtime keeps made ahead of need, per
    /// recently asked disk size (0..=16; 0 = make each on its create).
    pub disk_pool: usize,
    /// The file system of each crun/runc sandbox's disk (`ext4` or `xfs`).
    pub disk_fs: DiskFs,
}

/// The file system of each sandbox's own disk (`[server] disk_fs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DiskFs {
    /// ext4 (the default): smallest and quickest to make.
    #[default]
    Ext4,
    /// XFS with reflinks: snapshots read only the changed extents of large
    /// files. Every class's `disk_mb` must be at least [`XFS_MIN_DISK_MB`].
    Xfs,
}

/// `mkfs.xfs` refuses file systems smaller than this (MiB).
pub const XFS_MIN_DISK_MB: u64 = 300;

impl DiskFs {
    pub fn as_str(self) -> &'static str {
        match self {
            DiskFs::Ext4 => "ext4",
            DiskFs::Xfs => "xfs",
        }
    }
}

/// The HTTP edge's limits (keys of `[server]`). Every value is positive.
#[derive(Clone, Debug, PartialEq)]
pub struct EdgeSettings {
    /// A client must send a request's headers within this time, and a kept-alive
    /// connection may sit idle between requests no longer; then it is closed.
    pub header_read_timeout_ms: u64,
    /// A request body may stall this long between two chunks before the
    /// request fails and the connection is closed.
    pub body_read_timeout_ms: u64,
    /// Connections open at once; more are answered 503 and closed at once.
    pub max_connections: u32,
    /// Connections open at once from one client address, so one client
    /// cannot take all of `max_connections`.
    pub max_connections_per_ip: u32,
    /// Requests per second per API key, sustained (token bucket refill).
    pub rate_limit_per_s: f64,
    /// Requests per API key allowed in a burst (token bucket size).
    pub rate_limit_burst: u32,
    /// Environment variable holding the bearer token `GET /metrics` accepts
    /// besides an admin key; empty: admin keys only.
    pub metrics_token_env: String,
}

impl EdgeSettings {
    /// The metrics token, read from the environment at use time; `None` when
    /// no variable is configured or it is unset or empty.
    pub fn metrics_token(&self) -> Option<String> {
        if self.metrics_token_env.is_empty() {
            return None;
        }
        std::env::var(&self.metrics_token_env)
            .ok()
            .filter(|t| !t.is_empty())
    }
}

/// A runtime a sandbox can run on: the one list of runtime names lives in
/// `aviary-core`.
pub use aviary_core::RuntimeName as Runtime;

/// The runtimes of this host (not the remote providers', not a cluster's):
/// what a class runs on unless it lists its runtimes.
pub fn local_runtimes() -> Vec<Runtime> {
    Runtime::LOCAL.to_vec()
}

/// `[[class]]`: a named resource class. A sandbox always runs with exactly one
/// class's limits.
#[derive(Clone, Debug, PartialEq)]
pub struct ResourceClass {
    pub name: String,
    /// CPU cores, fractional allowed (CFS quota).
    pub cpu: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u32,
    pub gpu: bool,
    pub runtimes: Vec<Runtime>,
    /// Names of [`NetworkProfileDef`]s this class may use.
    pub network_profiles: Vec<String>,
}

impl ResourceClass {
    /// The limits a sandbox of this class runs under.
    pub fn limits(&self) -> ResourceLimits {
        ResourceLimits {
            cpu: self.cpu,
            memory_mb: self.memory_mb,
            disk_mb: self.disk_mb,
            pids: self.pids,
        }
    }

    pub fn supports_runtime(&self, runtime: Runtime) -> bool {
        self.runtimes.contains(&runtime)
    }

    pub fn supports_network_profile(&self, profile: &str) -> bool {
        self.network_profiles.iter().any(|p| p == profile)
    }
}

/// `[[network_profile]]`: a named network policy of one kind.
#[derive(Clone, Debug, PartialEq)]
pub struct NetworkProfileDef {
    pub name: String,
    pub kind: NetworkProfile,
    /// For `allowlist`: the domains egress may reach (`example.org` exactly,
    /// `*.example.org` any subdomain). Empty for the other kinds.
    pub allow: Vec<String>,
    /// For `allowlist`: domains never reached, even when allowed.
    pub deny: Vec<String>,
    /// For `allowlist`: method limits by allow entry (e.g. `"pypi.org" =
    /// ["GET", "HEAD"]`); an entry without one admits any method.
    pub methods: std::collections::BTreeMap<String, Vec<String>>,
    /// For `allowlist`: the operator's own name overrides (`"host" =
    /// "ip"` or `"ip:port"`), trusted as given (they may name loopback).
    pub resolve: std::collections::BTreeMap<String, String>,
    /// For `allowlist`: per-sandbox bounds of the egress proxy.
    pub limits: aviary_core::egress::EgressLimits,
}

impl NetworkProfileDef {
    /// What the node's egress proxy enforces for a sandbox of this profile
    /// (`None` unless the kind is `allowlist`).
    pub fn egress_policy(&self) -> Option<aviary_core::egress::EgressPolicy> {
        (self.kind == NetworkProfile::Allowlist).then(|| aviary_core::egress::EgressPolicy {
            profile: self.name.clone(),
            allow: self
                .allow
                .iter()
                .map(|d| aviary_core::egress::EgressRule {
                    domain: d.clone(),
                    methods: self.methods.get(d).cloned(),
                })
                .collect(),
            deny: self.deny.clone(),
            resolve: self.resolve.clone(),
            limits: self.limits,
        })
    }

    /// A profile of `kind` with nothing but its name and allow list.
    pub fn plain(name: &str, kind: NetworkProfile, allow: &[&str]) -> Self {
        NetworkProfileDef {
            name: name.into(),
            kind,
            allow: allow.iter().map(|d| (*d).to_owned()).collect(),
            deny: vec![],
            methods: Default::default(),
            resolve: Default::default(),
            limits: Default::default(),
        }
    }
}

/// A tenant's list of allowed names, or `"*"` for everything configured.
#[derive(Clone, Debug, PartialEq)]
pub enum Allowed<T> {
    All,
    Only(Vec<T>),
}

impl<T: PartialEq> Allowed<T> {
    pub fn allows(&self, item: &T) -> bool {
        match self {
            Allowed::All => true,
            Allowed::Only(items) => items.contains(item),
        }
    }
}

impl Allowed<String> {
    pub fn allows_name(&self, name: &str) -> bool {
        match self {
            Allowed::All => true,
            Allowed::Only(items) => items.iter().any(|i| i == name),
        }
    }
}

/// `[[tenant]]`: quotas and allow-lists. Quotas count the limits of the
/// tenant's live sandboxes (their classes' limits, not measured use).
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub name: String,
    /// Live sandboxes at once; 0 suspends the tenant.
    pub max_sandboxes: u32,
    /// Sum of the classes' CPU limits over live sandboxes.
    pub max_cpu: f64,
    /// Sum of the classes' memory limits over live sandboxes.
    pub max_memory_mb: u64,
    pub allowed_classes: Allowed<String>,
    pub allowed_network_profiles: Allowed<String>,
    pub allowed_runtimes: Allowed<Runtime>,
}

/// `[[pool]]`: a warm pool for one (class, template, runtime).
///
/// `pool_min`/`pool_max` bound the pool's total (warm idle plus handed out
/// and not yet returned); `buffer_min`/`buffer_max` bound its warm idle
/// sandboxes. The pool manager refills while idle < `buffer_min` (and total <
/// `pool_max`) or total < `pool_min`, and destroys returned sandboxes beyond
/// `buffer_max` idle.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSettings {
    pub class: String,
    pub template: String,
    pub runtime: Runtime,
    pub pool_min: u32,
    pub pool_max: u32,
    pub buffer_min: u32,
    pub buffer_max: u32,
}

/// `[planner]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerSettings {
    /// How many most recent allocation records per workload signature the
    /// telemetry right-sizer reads.
    pub history_window: u32,
    /// `[planner.llm]`; absent means no LLM planner.
    pub llm: Option<LlmSettings>,
}

/// `[planner.llm]`: an OpenAI-compatible chat-completions endpoint.
#[derive(Clone, PartialEq)]
pub struct LlmSettings {
    /// `POST {base_url}/chat/completions`.
    pub base_url: String,
    pub model: String,
    /// The key itself (prefer `api_key_env`); never printed by `Debug`.
    pub api_key: Option<String>,
    /// Name of the environment variable holding the key, read at use time.
    pub api_key_env: Option<String>,
    pub timeout_ms: u64,
}

impl LlmSettings {
    /// The key to send, from `api_key` or the `api_key_env` variable; `None`
    /// when neither gives one (endpoints without auth).
    pub fn resolve_api_key(&self) -> Option<String> {
        if let Some(k) = &self.api_key {
            return Some(k.clone());
        }
        self.api_key_env
            .as_ref()
            .and_then(|var| std::env::var(var).ok())
            .filter(|k| !k.is_empty())
    }
}

impl fmt::Debug for LlmSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmSettings")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("api_key_env", &self.api_key_env)
            .field("timeout_ms", &self.timeout_ms)
            .finish()
    }
}

/// `[kubernetes]`: where and how the Kubernetes runtime makes its Pods
/// (`aviary-runtime-kube`; untested against a live cluster).
#[derive(Clone, Debug, PartialEq)]
pub struct KubernetesSettings {
    /// Credentials: a kubeconfig file (absolute path), or `None` for the
    /// in-cluster service account (`in_cluster = true`).
    pub kubeconfig: Option<PathBuf>,
    /// A context of the kubeconfig (its current one when `None`).
    pub context: Option<String>,
    /// Namespace of every sandbox Pod (a DNS label).
    pub namespace: String,
    /// Value of the `aviary.dev/deployment` label: deployments sharing a
    /// namespace never touch each other's Pods.
    pub deployment: String,
    /// `runtimeClassName` of every sandbox Pod (the isolation tier); `None`
    /// leaves the cluster's default.
    pub runtime_class: Option<String>,
    /// Template name → container image (pin by digest). The image holds the
    /// template's tree and the static envd at `/.aviary/envd`.
    pub images: std::collections::BTreeMap<String, String>,
    /// uid/gid of the sandbox's processes; anything but 0 sets runAsNonRoot.
    pub run_as_user: i64,
    /// Longest a new Pod may take to run before the create fails.
    pub ready_timeout_s: u64,
    /// Longest a deleted Pod may take to disappear.
    pub delete_timeout_s: u64,
    /// CIDRs the control plane reaches Pods from: the only sources each
    /// sandbox's NetworkPolicy admits, and only to `envd_port`. Required.
    pub envd_from: Vec<String>,
    /// The port envd's bridge listens on in every Pod (default 49877).
    pub envd_port: u16,
    /// Host-only directory of the relay sockets (default: the runtime's
    /// state dir under the server's data dir).
    pub relay_dir: Option<PathBuf>,
}

/// `[snapshots]`: the snapshot store (seed 000's snapshot specs: local,
/// S3/OSS, Redis, PostgreSQL/JDBC).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct SnapshotSettings {
    pub store: SnapshotStore,
}

/// One snapshot store. Secrets are named by environment variable, never
/// written in the file.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum SnapshotStore {
    /// Content-addressed chunks under `<data dir>/snapshots`.
    #[default]
    Local,
    S3 {
        endpoint: String,
        region: String,
        bucket: String,
        prefix: String,
        access_key_env: String,
        secret_key_env: String,
    },
    Redis {
        url: String,
        prefix: String,
    },
    Postgres {
        url_env: String,
        namespace: String,
    },
}

/// `[reconciler]`: the periodic observe → compare → reconcile pass. Every
/// value is positive; each key defaults on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconcilerSettings {
    /// Milliseconds between two passes.
    pub interval_ms: u64,
    /// Compute the registry does not claim is destroyed only once it has
    /// been seen unclaimed this many seconds.
    pub orphan_grace_s: u64,
    /// A node agent that has not answered for this many seconds is
    /// unhealthy: its live sandboxes become `Lost` (re-attached when it
    /// answers again with their compute intact).
    pub node_unhealthy_after_s: u64,
}

pub(crate) fn default_reconciler() -> ReconcilerSettings {
    ReconcilerSettings {
        interval_ms: 5_000,
        orphan_grace_s: 60,
        node_unhealthy_after_s: 15,
    }
}

/// `[overcommit]`: how far the sum of the limits committed on one node may
/// exceed its real capacity.
///
/// Every sandbox's own limits are real (cgroup CPU quota, memory limit, pids
/// limit), whatever the host has: a class may ask for more CPUs than the host
/// has, and then its quota simply never binds. What over-commit bounds is the
/// *sum* over a node: the scheduler admits a sandbox only while
/// `committed_cpu + class.cpu <= host_cpus * cpu_ratio` and likewise for
/// memory. CPU is compressible (over-committed sandboxes get slower, nothing
/// is killed), so a ratio well above 1 is safe. Memory is not: if sandboxes
/// together really use more than the host has, the kernel OOM killer picks
/// victims outside their cgroups' limits; keep `memory_ratio` near 1 unless
/// workloads are known to stay far below their limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overcommit {
    pub cpu_ratio: f64,
    pub memory_ratio: f64,
}

impl Overcommit {
    /// CPU a node with `host_cpus` cores may commit.
    pub fn cpu_capacity(&self, host_cpus: f64) -> f64 {
        host_cpus * self.cpu_ratio
    }

    /// Memory (MiB) a node with `host_memory_mb` may commit.
    pub fn memory_capacity_mb(&self, host_memory_mb: u64) -> u64 {
        // Float rounding is irrelevant at MiB granularity; saturates on overflow.
        (host_memory_mb as f64 * self.memory_ratio) as u64
    }
}

impl Config {
    /// Reads and validates the file at `path`; errors name the path as origin.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        Config::from_str(&text, &path.display().to_string())
    }

    /// Parses and validates `text`; `origin` names it in errors (usually the
    /// file name).
    #[allow(clippy::should_implement_trait)]
    pub fn from_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        raw::parse(text, origin)
    }

    pub fn class(&self, name: &str) -> Option<&ResourceClass> {
        self.classes.iter().find(|c| c.name == name)
    }

    pub fn tenant(&self, name: &str) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.name == name)
    }

    pub fn network_profile(&self, name: &str) -> Option<&NetworkProfileDef> {
        self.network_profiles.iter().find(|p| p.name == name)
    }
}

/// The seed's five classes (seed 002 §4): name, cpu, memory GiB, disk GiB, pids.
const SEED_CLASSES: [(&str, f64, u64, u64, u32); 5] = [
    ("python-small", 1.0, 2, 10, 512),
    ("python-ds", 2.0, 4, 20, 1024),
    ("build-medium", 4.0, 8, 30, 4096),
    ("browser-medium", 4.0, 8, 30, 4096),
    ("compute-large", 8.0, 16, 50, 4096),
];

pub(crate) fn default_server() -> ServerSettings {
    ServerSettings {
        data_dir: PathBuf::from("/var/lib/aviary"),
        listen: SocketAddr::from(([127, 0, 0, 1], 7400)),
        runtime: Runtime::Crun,
        runtimes: vec![Runtime::Crun],
        default_template: "default".into(),
        default_class: "python-small".into(),
        edge: default_edge(),
        open_network: false,
        docker_socket: PathBuf::from("/var/run/docker.sock"),
        disk_pool: 2,
        disk_fs: DiskFs::Ext4,
    }
}

pub(crate) fn default_edge() -> EdgeSettings {
    EdgeSettings {
        header_read_timeout_ms: 10_000,
        body_read_timeout_ms: 30_000,
        max_connections: 1024,
        max_connections_per_ip: 256,
        rate_limit_per_s: 50.0,
        rate_limit_burst: 100,
        metrics_token_env: "AVIARY_METRICS_TOKEN".into(),
    }
}

pub(crate) fn default_classes() -> Vec<ResourceClass> {
    SEED_CLASSES
        .iter()
        .map(|&(name, cpu, mem_gib, disk_gib, pids)| ResourceClass {
            name: name.into(),
            cpu,
            memory_mb: mem_gib * 1024,
            disk_mb: disk_gib * 1024,
            pids,
            gpu: false,
            runtimes: local_runtimes(),
            network_profiles: vec!["none".into(), "pypi-readonly".into(), "open".into()],
        })
        .collect()
}

pub(crate) fn default_network_profiles() -> Vec<NetworkProfileDef> {
    vec![
        NetworkProfileDef::plain("none", NetworkProfile::None, &[]),
        NetworkProfileDef::plain(
            "pypi-readonly",
            NetworkProfile::Allowlist,
            &["pypi.org", "files.pythonhosted.org"],
        ),
        NetworkProfileDef::plain("open", NetworkProfile::Open, &[]),
    ]
}

pub(crate) fn default_tenants() -> Vec<Tenant> {
    vec![Tenant {
        name: "default".into(),
        max_sandboxes: 64,
        max_cpu: 128.0,
        max_memory_mb: 256 * 1024,
        allowed_classes: Allowed::All,
        allowed_network_profiles: Allowed::All,
        allowed_runtimes: Allowed::All,
    }]
}

pub(crate) fn default_pools() -> Vec<PoolSettings> {
    vec![PoolSettings {
        class: "python-small".into(),
        template: "default".into(),
        runtime: Runtime::Crun,
        pool_min: 0,
        pool_max: 8,
        buffer_min: 0,
        buffer_max: 2,
    }]
}

pub(crate) const DEFAULT_HISTORY_WINDOW: u32 = 50;
pub(crate) const DEFAULT_LLM_TIMEOUT_MS: u64 = 5000;

pub(crate) fn default_overcommit() -> Overcommit {
    Overcommit {
        cpu_ratio: 4.0,
        memory_ratio: 1.5,
    }
}

impl Default for Config {
    /// The built-in configuration; equal to `aviary.example.toml`.
    fn default() -> Self {
        Config {
            server: default_server(),
            classes: default_classes(),
            network_profiles: default_network_profiles(),
            tenants: default_tenants(),
            pools: default_pools(),
            planner: PlannerSettings {
                history_window: DEFAULT_HISTORY_WINDOW,
                llm: None,
            },
            overcommit: default_overcommit(),
            reconciler: default_reconciler(),
            snapshots: SnapshotSettings::default(),
            distributed: DistributedSettings::default(),
            projections: Vec::new(),
            remote_e2b: None,
            remote_opensandbox: None,
            kubernetes: None,
        }
    }
}

#[cfg(test)]
mod tests;
