//! Server configuration: where data lives, where to listen, which runtime to
//! drive, and the built-in resource classes.

use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The `--config` file (classes, network profiles, tenants, pools,
    /// planner); built-in defaults equal `aviary.example.toml`.
    pub settings: aviary_config::Config,
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// The runtime of the local node.
    pub runtime: aviary_core::RuntimeName,
    /// Template store root; `<data_dir>/templates` unless set (tests share one).
    pub templates_dir: Option<PathBuf>,
    /// Static envd binary bind-mounted into every sandbox as PID 1.
    pub envd_binary: PathBuf,
    /// Template used when a create names none.
    pub default_template: String,
    /// How the default template is made when missing: `debootstrap` (Debian
    /// bookworm minbase + python3) or `busybox` (tiny, for tests).
    pub default_template_source: DefaultTemplateSource,
    pub default_class: String,
    /// Largest JSON body accepted.
    pub max_json_bytes: usize,
    /// Largest file upload accepted.
    pub max_upload_bytes: u64,
    /// Largest template archive accepted.
    pub max_archive_bytes: u64,
    /// Cap per stream of the non-streaming exec answer.
    pub exec_output_cap: usize,
    /// Lease ttl when the client gives none, and the longest allowed.
    pub default_lease_ttl_s: u64,
    pub max_lease_ttl_s: u64,
    pub max_sandbox_ttl_s: u64,
    /// How often leases and TTLs are checked.
    pub sweep_interval_ms: u64,
    /// Idle sandboxes are hibernated (snapshot, compute stopped) after this
    /// many seconds without activity; `None` keeps them warm forever.
    pub idle_hibernate_s: Option<u64>,
    /// How often the sweep asks every live sandbox's envd for its health
    /// (a dead envd turns its sandbox `Lost`).
    pub health_probe_interval_ms: u64,
    /// How often unreferenced snapshot chunks are collected in the
    /// background (also once at start-up).
    pub chunk_gc_interval_s: u64,
    /// An unreferenced chunk is deleted only once it has been seen
    /// unreferenced for this long (a snapshot in flight elsewhere writes its
    /// chunks before its manifest).
    pub chunk_gc_grace_s: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultTemplateSource {
    Debootstrap,
    Busybox,
}

impl ServerConfig {
    /// Built-in settings with this data dir.
    pub fn new(data_dir: PathBuf, envd_binary: PathBuf) -> Self {
        let mut s = Self::from_settings(aviary_config::Config::default(), envd_binary);
        s.data_dir = data_dir;
        s
    }

    /// Settings from a configuration file; command-line flags override the
    /// returned fields afterwards.
    pub fn from_settings(settings: aviary_config::Config, envd_binary: PathBuf) -> Self {
        ServerConfig {
            data_dir: settings.server.data_dir.clone(),
            listen: settings.server.listen,
            runtime: settings.server.runtime,
            templates_dir: None,
            envd_binary,
            default_template: settings.server.default_template.clone(),
            default_template_source: DefaultTemplateSource::Debootstrap,
            default_class: settings.server.default_class.clone(),
            settings,
            max_json_bytes: 1 << 20,
            max_upload_bytes: 4 << 30,
            max_archive_bytes: 16 << 30,
            exec_output_cap: 1 << 20,
            default_lease_ttl_s: 60,
            max_lease_ttl_s: 24 * 3600,
            max_sandbox_ttl_s: 7 * 24 * 3600,
            sweep_interval_ms: 500,
            idle_hibernate_s: Some(900),
            health_probe_interval_ms: 5_000,
            chunk_gc_interval_s: 600,
            chunk_gc_grace_s: 3_600,
        }
    }

    pub fn templates_root(&self) -> PathBuf {
        self.templates_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("templates"))
    }

    pub fn runtime_state_dir(&self) -> PathBuf {
        self.data_dir.join("sandboxes")
    }

    pub fn registry_path(&self) -> PathBuf {
        self.data_dir.join("registry.db")
    }

    pub fn admin_key_path(&self) -> PathBuf {
        self.data_dir.join("admin.key")
    }
}
