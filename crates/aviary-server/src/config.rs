//! Server configuration: where data lives, where to listen, which runtimes
//! to drive, the HTTP body limits, and the control plane's own settings
//! ([`ControlConfig`]).

use aviary_control::ControlConfig;
use std::net::SocketAddr;
use std::path::PathBuf;

pub use aviary_control::DefaultTemplateSource;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Settings, limits and intervals of the control plane.
    pub control: ControlConfig,
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// The runtime of the local node.
    pub runtime: aviary_core::RuntimeName,
    /// Template store root; `<data_dir>/templates` unless set (tests share one).
    pub templates_dir: Option<PathBuf>,
    /// Largest JSON body accepted.
    pub max_json_bytes: usize,
    /// Largest file upload accepted.
    pub max_upload_bytes: u64,
    /// Largest template archive accepted.
    pub max_archive_bytes: u64,
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
        let (cpu, memory_mb) = host_capacity();
        let mut control = ControlConfig::from_settings(settings.clone(), envd_binary);
        control.local_cpu = cpu;
        control.local_memory_mb = memory_mb;
        if settings.distributed.is_distributed() {
            // replicas share the registry: each one's own runtimes need a
            // node name of their own
            // a replica runs sandboxes itself only when started as a node
            // too (with a node name); otherwise its compute is on agents
            match settings.distributed.node_name.clone() {
                Some(name) => control.local_node = name,
                None => {
                    control.runs_sandboxes = false;
                    control.local_node = format!("replica-{}", host_name());
                }
            }
        }
        ServerConfig {
            data_dir: settings.server.data_dir.clone(),
            listen: settings.server.listen,
            runtime: settings.server.runtime,
            templates_dir: None,
            control,
            max_json_bytes: 1 << 20,
            max_upload_bytes: 4 << 30,
            max_archive_bytes: 16 << 30,
        }
    }

    pub fn templates_root(&self) -> PathBuf {
        self.templates_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("templates"))
    }

    /// The default runtime's state dir (where every local runtime claims
    /// user-id ranges).
    pub fn runtime_state_dir(&self) -> PathBuf {
        self.data_dir.join("sandboxes")
    }

    /// The state dir of local runtime `name`: the default's, or
    /// `sandboxes-<name>` for another one the node serves beside it.
    pub fn runtime_state_dir_of(&self, name: aviary_core::RuntimeName) -> PathBuf {
        if name == self.runtime {
            self.runtime_state_dir()
        } else {
            self.data_dir.join(format!("sandboxes-{}", name.as_str()))
        }
    }

    pub fn registry_path(&self) -> PathBuf {
        self.data_dir.join("registry.db")
    }

    pub fn admin_key_path(&self) -> PathBuf {
        self.data_dir.join("admin.key")
    }

    /// Where uploads and template archives are spooled.
    pub fn spool_dir(&self) -> PathBuf {
        self.data_dir.join("spool")
    }
}

/// This host's name (the default node name of a replica), `local` if it
/// cannot be read.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| aviary_control::nodes::LOCAL_NODE.to_owned())
}

/// CPUs and memory (MiB) of this host, for the local node's placement view.
fn host_capacity() -> (f64, u64) {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as f64)
        .unwrap_or(1.0);
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|v| v.parse::<u64>().ok())
                })
        })
        .unwrap_or(0);
    (cpus, mem_kib / 1024)
}
