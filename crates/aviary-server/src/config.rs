//! Server configuration: where data lives, where to listen, which runtime to
//! drive, and the built-in resource classes.

use aviary_core::ResourceLimits;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Which OCI runtime binary drives sandboxes on the local node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeKind {
    Crun,
    Runc,
}

impl std::str::FromStr for RuntimeKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "crun" => Ok(RuntimeKind::Crun),
            "runc" => Ok(RuntimeKind::Runc),
            other => Err(format!("unknown runtime {other:?} (crun|runc)")),
        }
    }
}

impl RuntimeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Crun => "crun",
            RuntimeKind::Runc => "runc",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    pub runtime: RuntimeKind,
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultTemplateSource {
    Debootstrap,
    Busybox,
}

impl ServerConfig {
    pub fn new(data_dir: PathBuf, envd_binary: PathBuf) -> Self {
        ServerConfig {
            data_dir,
            listen: SocketAddr::from(([127, 0, 0, 1], 7400)),
            runtime: RuntimeKind::Crun,
            templates_dir: None,
            envd_binary,
            default_template: "default".into(),
            default_template_source: DefaultTemplateSource::Debootstrap,
            default_class: "python-small".into(),
            max_json_bytes: 1 << 20,
            max_upload_bytes: 4 << 30,
            max_archive_bytes: 16 << 30,
            exec_output_cap: 1 << 20,
            default_lease_ttl_s: 60,
            max_lease_ttl_s: 24 * 3600,
            max_sandbox_ttl_s: 7 * 24 * 3600,
            sweep_interval_ms: 500,
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

/// The seed's resource classes (seed 002 §4). Limits are enforced by cgroups,
/// so they hold even when a class asks for more CPUs than the host has: the
/// CFS quota then simply never binds, and memory over-commit is bounded by
/// each sandbox's own memory limit.
pub fn builtin_class(name: &str) -> Option<ResourceLimits> {
    let (cpu, mem_gib, disk_gib, pids) = match name {
        "python-small" => (1.0, 2, 10, 512),
        "python-ds" => (2.0, 4, 20, 1024),
        "build-medium" => (4.0, 8, 30, 4096),
        "browser-medium" => (4.0, 8, 30, 4096),
        "compute-large" => (8.0, 16, 50, 4096),
        _ => return None,
    };
    Some(ResourceLimits {
        cpu,
        memory_mb: mem_gib * 1024,
        disk_mb: disk_gib * 1024,
        pids,
    })
}

pub const BUILTIN_CLASSES: [&str; 5] = [
    "python-small",
    "python-ds",
    "build-medium",
    "browser-medium",
    "compute-large",
];
