//! What the control plane is configured with: the settings file (classes,
//! network profiles, tenants, pools, planner) and the limits and intervals
//! of its operations. Where data lives and where to listen are the server's.

use crate::backends::DefaultTemplateSource;
use std::path::PathBuf;

#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// The `--config` file (classes, network profiles, tenants, pools,
    /// planner); built-in defaults equal `aviary.example.toml`.
    pub settings: aviary_config::Config,
    /// Static envd binary bind-mounted into every sandbox as PID 1 (a host
    /// path the runtime binds; the control plane never opens it).
    pub envd_binary: PathBuf,
    /// Template used when a create names none.
    pub default_template: String,
    /// How the default template is made when missing.
    pub default_template_source: DefaultTemplateSource,
    pub default_class: String,
    /// Cap per stream of the non-streaming exec answer.
    pub exec_output_cap: usize,
    /// Lease ttl when the client gives none, and the longest allowed.
    pub default_lease_ttl_s: u64,
    pub max_lease_ttl_s: u64,
    pub max_sandbox_ttl_s: u64,
    /// How often leases and TTLs are checked.
    pub sweep_interval_ms: u64,
    /// How often the server samples its own metrics into the history
    /// `GET /v1/metrics/history` serves (the last [`crate::metrics::HISTORY_LEN`] samples).
    pub metrics_history_interval_ms: u64,
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
    /// The local node's capacity (CPUs, memory in MiB), for placement; the
    /// server reads it off the host.
    pub local_cpu: f64,
    pub local_memory_mb: u64,
    /// The name this control plane's own runtimes go by as a node
    /// ([`crate::nodes::LOCAL_NODE`] by default). Replicas sharing one
    /// registry each need their own, stable across restarts: a replica
    /// re-attaches and reconciles only the sandboxes on its own node.
    pub local_node: String,
    /// Whether this control plane runs sandboxes on its own runtimes (the
    /// default). A distributed replica started without a node name runs
    /// none: its compute is on `aviary node` agents, so it is stateless.
    pub runs_sandboxes: bool,
    /// How often the reconciler compares the registry with the runtimes
    /// and node agents this control plane drives
    /// ([`crate::reconciler`]).
    pub reconcile_interval_ms: u64,
    /// A runtime sandbox the registry does not know (or knows as
    /// terminated) is destroyed only once it has been seen unknown for
    /// this long.
    pub orphan_grace_s: u64,
    /// A node agent whose runtime has not answered for this long is
    /// unhealthy: its sandboxes become `Lost`.
    pub node_unhealthy_after_s: u64,
}

impl ControlConfig {
    /// Settings from a configuration file with the built-in limits; callers
    /// override fields afterwards.
    pub fn from_settings(settings: aviary_config::Config, envd_binary: PathBuf) -> Self {
        let reconciler = settings.reconciler;
        ControlConfig {
            default_template: settings.server.default_template.clone(),
            default_template_source: DefaultTemplateSource::Debootstrap,
            default_class: settings.server.default_class.clone(),
            settings,
            envd_binary,
            local_node: crate::nodes::LOCAL_NODE.to_owned(),
            runs_sandboxes: true,
            exec_output_cap: 1 << 20,
            default_lease_ttl_s: 60,
            max_lease_ttl_s: 24 * 3600,
            max_sandbox_ttl_s: 7 * 24 * 3600,
            sweep_interval_ms: 500,
            metrics_history_interval_ms: 10_000,
            idle_hibernate_s: Some(900),
            health_probe_interval_ms: 5_000,
            chunk_gc_interval_s: 600,
            chunk_gc_grace_s: 3_600,
            local_cpu: 1.0,
            local_memory_mb: 1024,
            reconcile_interval_ms: reconciler.interval_ms,
            orphan_grace_s: reconciler.orphan_grace_s,
            node_unhealthy_after_s: reconciler.node_unhealthy_after_s,
        }
    }
}
