//! Generates the OCI runtime `config.json` of one sandbox.
//!
//! Pure: turns a [`SandboxSpec`] plus the host paths of its per-sandbox
//! directories (and, when it has one, its user-id range, see [`crate::idmap`])
//! into an [`oci_spec::runtime::Spec`]. Unit-tested without a runtime; the
//! integration tests check the result from inside a sandbox.

use crate::idmap::{IdRange, RANGE_SIZE};
use crate::seccomp;
use aviary_runtime::{SandboxSpec, WORKSPACE_MOUNT};
use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroup,
    LinuxDeviceCgroupBuilder, LinuxDeviceType, LinuxIdMapping, LinuxIdMappingBuilder,
    LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, LinuxPidsBuilder,
    LinuxResourcesBuilder, Mount, MountBuilder, ProcessBuilder, RootBuilder, Spec, SpecBuilder,
    UserBuilder,
};
use oci_spec::OciSpecError;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// CFS period used for the CPU quota (100 ms, the kernel default).
pub const CPU_PERIOD_US: u64 = 100_000;

/// The capabilities root inside a sandbox keeps; everything else is dropped.
///
/// The set is what a root package installer (apt/dpkg, pip, npm) and ordinary
/// daemons need, and nothing that reaches past the sandbox's own files:
/// - CHOWN, DAC_OVERRIDE, FOWNER, FSETID: dpkg/tar unpack files owned by
///   other users and restore their modes (incl. setgid dirs);
/// - SETUID, SETGID: maintainer scripts and daemons switch to service users;
/// - SETPCAP: lets a daemon drop capabilities from its bounding set (only
///   removes, since inheritable/ambient are empty);
/// - KILL: signal processes of other uids inside the sandbox (the PID
///   namespace stops it at the sandbox edge);
/// - NET_BIND_SERVICE: dev servers on ports below 1024 (loopback only);
/// - SYS_CHROOT: build tools and some maintainer scripts chroot;
/// - AUDIT_WRITE: PAM-based tools (su, login) refuse to run without it.
///
/// Deliberately absent: NET_RAW (raw packets, spoofing), NET_ADMIN, SYS_ADMIN
/// (mount, namespaces, most of the kernel), SYS_PTRACE, SYS_MODULE, MKNOD
/// (device nodes), SETFCAP (file capabilities that outlive the sandbox's
/// bounding set in a shared template), SYS_TIME, SYS_RESOURCE, DAC_READ_SEARCH
/// (`open_by_handle_at`).
pub const CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fowner,
    Capability::Fsetid,
    Capability::Kill,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::AuditWrite,
];

/// Host paths of one sandbox's directories, and runtime-wide options.
#[derive(Debug, Clone)]
pub struct BundleInputs<'a> {
    /// Merged overlay, the container's root.
    pub rootfs: &'a Path,
    pub workspace_dir: &'a Path,
    /// Cgroup path relative to each hierarchy root, e.g. `/aviary/<id>`.
    pub cgroups_path: String,
    /// Size of the private /tmp tmpfs.
    pub tmp_size_mb: u64,
    /// Run in a user namespace whose root is this host range; `None` keeps
    /// root inside equal to host root.
    pub id_range: Option<IdRange>,
}

fn id_mappings(range: IdRange) -> Result<Vec<LinuxIdMapping>, OciSpecError> {
    Ok(vec![LinuxIdMappingBuilder::default()
        .container_id(0u32)
        .host_id(range.host_first)
        .size(RANGE_SIZE)
        .build()?])
}

fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount, OciSpecError> {
    MountBuilder::default()
        .destination(PathBuf::from(dest))
        .typ(typ.to_string())
        .source(PathBuf::from(source))
        .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .build()
}

fn bind(dest: &str, source: &Path, read_only: bool) -> Result<Mount, OciSpecError> {
    let mode = if read_only { "ro" } else { "rw" };
    MountBuilder::default()
        .destination(PathBuf::from(dest))
        .typ("bind".to_string())
        .source(source.to_path_buf())
        .options(
            ["rbind", mode, "nosuid", "nodev"]
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )
        .build()
}

fn mounts(spec: &SandboxSpec, inputs: &BundleInputs<'_>) -> Result<Vec<Mount>, OciSpecError> {
    let tmp_size = format!("size={}m", inputs.tmp_size_mb);
    let mut m = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
        )?,
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?,
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?,
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        )?,
        // Exec allowed: pip and compilers run build helpers from /tmp. Pages
        // are charged to the sandbox's memory cgroup.
        mount(
            "/tmp",
            "tmpfs",
            "tmpfs",
            &["nosuid", "nodev", "mode=1777", &tmp_size],
        )?,
        bind(WORKSPACE_MOUNT, inputs.workspace_dir, false)?,
    ];
    for b in &spec.binds {
        m.push(bind(&b.sandbox, &b.host, b.read_only)?);
    }
    Ok(m)
}

fn char_device(
    major: i64,
    minor: Option<i64>,
    access: &str,
) -> Result<LinuxDeviceCgroup, OciSpecError> {
    let mut b = LinuxDeviceCgroupBuilder::default()
        .allow(true)
        .typ(LinuxDeviceType::C)
        .major(major)
        .access(access.to_string());
    if let Some(minor) = minor {
        b = b.minor(minor);
    }
    b.build()
}

/// Device cgroup: deny everything, then allow the standard nodes the runtime
/// creates in /dev (null, zero, full, random, urandom, tty, ptmx, pts/*).
fn device_rules() -> Result<Vec<LinuxDeviceCgroup>, OciSpecError> {
    Ok(vec![
        LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm".to_string())
            .build()?,
        char_device(1, Some(3), "rwm")?,
        char_device(1, Some(5), "rwm")?,
        char_device(1, Some(7), "rwm")?,
        char_device(1, Some(8), "rwm")?,
        char_device(1, Some(9), "rwm")?,
        char_device(5, Some(0), "rwm")?,
        char_device(5, Some(2), "rwm")?,
        char_device(136, None, "rwm")?,
    ])
}

/// The complete OCI config of one sandbox.
pub fn build_spec(spec: &SandboxSpec, inputs: &BundleInputs<'_>) -> Result<Spec, OciSpecError> {
    let caps: HashSet<Capability> = CAPABILITIES.iter().copied().collect();
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        .inheritable(HashSet::new())
        .ambient(HashSet::new())
        .build()?;
    let mut env = spec.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(0u32).gid(0u32).build()?)
        .args(spec.init.clone())
        .env(env)
        .cwd(PathBuf::from("/"))
        .capabilities(capabilities)
        // No rlimits: PID 1 inherits the runtime's (crun applies them after
        // dropping CAP_SYS_RESOURCE, so a hard limit above the host's fails).
        .no_new_privileges(true)
        .build()?;

    let limits = spec.resources;
    let memory_bytes =
        i64::try_from(limits.memory_mb.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX);
    // Quota of at least 1 ms per period: the kernel refuses less.
    let quota_us = ((limits.cpu * CPU_PERIOD_US as f64).round() as i64).max(1000);
    let resources = LinuxResourcesBuilder::default()
        .devices(device_rules()?)
        .memory(
            LinuxMemoryBuilder::default()
                .limit(memory_bytes)
                // memory+swap = memory: the sandbox never swaps.
                .swap(memory_bytes)
                .build()?,
        )
        .cpu(
            LinuxCpuBuilder::default()
                .quota(quota_us)
                .period(CPU_PERIOD_US)
                .build()?,
        )
        .pids(
            LinuxPidsBuilder::default()
                .limit(i64::from(limits.pids))
                .build()?,
        )
        .build()?;

    let mut namespace_types = vec![
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Network,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Cgroup,
    ];
    if inputs.id_range.is_some() {
        namespace_types.push(LinuxNamespaceType::User);
    }
    let namespaces = namespace_types
        .into_iter()
        .map(|typ| LinuxNamespaceBuilder::default().typ(typ).build())
        .collect::<Result<Vec<_>, _>>()?;

    let mut linux = LinuxBuilder::default();
    if let Some(range) = inputs.id_range {
        // Same map for gids: files keep their group relation to their owner.
        linux = linux
            .uid_mappings(id_mappings(range)?)
            .gid_mappings(id_mappings(range)?);
    }
    let linux = linux
        .namespaces(namespaces)
        .cgroups_path(PathBuf::from(&inputs.cgroups_path))
        .resources(resources)
        .seccomp(seccomp::profile()?)
        .masked_paths(
            [
                "/proc/acpi",
                "/proc/asound",
                "/proc/kcore",
                "/proc/keys",
                "/proc/latency_stats",
                "/proc/timer_list",
                "/proc/timer_stats",
                "/proc/sched_debug",
                "/proc/scsi",
                "/sys/firmware",
                "/sys/devices/virtual/powercap",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
        )
        .readonly_paths(
            [
                "/proc/bus",
                "/proc/fs",
                "/proc/irq",
                "/proc/sys",
                "/proc/sysrq-trigger",
                // On cgroup v1 the runtimes mount a tmpfs here that holds the
                // (read-only) controller mounts and leave the tmpfs itself
                // writable, though the mount asks for `ro`; a read-only bind
                // of it keeps the sandbox from making anything there.
                "/sys/fs/cgroup",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
        )
        .rootfs_propagation("private".to_string())
        .build()?;

    SpecBuilder::default()
        .version("1.0.2".to_string())
        .root(
            RootBuilder::default()
                .path(inputs.rootfs.to_path_buf())
                // Writes land in the overlay's upper dir, never the template.
                .readonly(false)
                .build()?,
        )
        .hostname(spec.hostname.clone())
        .process(process)
        .mounts(mounts(spec, inputs)?)
        .linux(linux)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_runtime::BindMount;
    use serde_json::Value;

    fn config() -> Value {
        config_with(None)
    }

    fn config_with(id_range: Option<IdRange>) -> Value {
        let spec = SandboxSpec {
            id: SandboxId::generate(),
            template: aviary_runtime::TemplateRef {
                name: "t".into(),
                digest: format!("sha256:{}", "ab".repeat(32)),
            },
            resources: ResourceLimits {
                cpu: 0.5,
                memory_mb: 256,
                disk_mb: 1024,
                pids: 64,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "box".into(),
            init: vec!["/.aviary/envd".into()],
            env: vec!["A=1".into()],
            binds: vec![BindMount {
                host: "/opt/envd".into(),
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }],
        };
        let inputs = BundleInputs {
            rootfs: Path::new("/s/x/rootfs"),
            workspace_dir: Path::new("/s/x/workspace"),
            cgroups_path: "/aviary/x".into(),
            tmp_size_mb: 100,
            id_range,
        };
        serde_json::to_value(build_spec(&spec, &inputs).unwrap()).unwrap()
    }

    #[test]
    fn limits_namespaces_and_cgroup_path() {
        let c = config();
        let r = &c["linux"]["resources"];
        assert_eq!(r["memory"]["limit"], 256 * 1024 * 1024);
        assert_eq!(r["memory"]["swap"], 256 * 1024 * 1024);
        assert_eq!(r["cpu"]["quota"], 50_000);
        assert_eq!(r["cpu"]["period"], 100_000);
        assert_eq!(r["pids"]["limit"], 64);
        assert_eq!(c["linux"]["cgroupsPath"], "/aviary/x");
        let ns: Vec<&str> = c["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        assert_eq!(ns, ["pid", "network", "ipc", "uts", "mount", "cgroup"]);
        assert_eq!(c["hostname"], "box");
    }

    #[test]
    fn process_is_hardened() {
        let c = config();
        let p = &c["process"];
        assert_eq!(p["terminal"], false);
        assert_eq!(p["noNewPrivileges"], true);
        let eff: Vec<&str> = p["capabilities"]["effective"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(eff.len(), CAPABILITIES.len());
        for banned in [
            "CAP_NET_RAW",
            "CAP_SYS_ADMIN",
            "CAP_SYS_PTRACE",
            "CAP_MKNOD",
        ] {
            assert!(!eff.contains(&banned), "{banned} granted");
        }
        assert!(eff.contains(&"CAP_CHOWN"));
        assert_eq!(
            p["capabilities"]["inheritable"].as_array().unwrap().len(),
            0
        );
        assert!(p["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().starts_with("PATH=")));
        assert!(c["linux"]["maskedPaths"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "/proc/kcore"));
        assert!(c["linux"]["readonlyPaths"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "/proc/sys"));
        assert!(c["linux"]["readonlyPaths"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "/sys/fs/cgroup"));
    }

    #[test]
    fn mounts_cover_tmp_workspace_and_binds_but_no_control_dir() {
        let c = config();
        let mounts = c["mounts"].as_array().unwrap();
        let find = |d: &str| {
            mounts
                .iter()
                .find(|m| m["destination"] == d)
                .unwrap()
                .clone()
        };
        assert_eq!(find("/tmp")["type"], "tmpfs");
        assert!(find("/tmp")["options"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o == "size=100m"));
        assert_eq!(find("/workspace")["source"], "/s/x/workspace");
        assert!(
            !mounts.iter().any(|m| m["destination"] == "/run/aviary"),
            "envd's socket dir is host-only: nothing is mounted at /run/aviary"
        );
        assert!(find("/sys")["options"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o == "ro"));
        let envd = find("/.aviary/envd");
        assert!(envd["options"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o == "ro"));
        assert_eq!(c["root"]["readonly"], false);
    }

    #[test]
    fn user_namespace_maps_root_to_the_range() {
        let c = config_with(Some(IdRange {
            host_first: 0x4003_0000,
        }));
        let ns: Vec<&str> = c["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        assert!(ns.contains(&"user"), "{ns:?}");
        for key in ["uidMappings", "gidMappings"] {
            let m = &c["linux"][key];
            assert_eq!(m.as_array().unwrap().len(), 1, "{key}: {m}");
            assert_eq!(m[0]["containerID"], 0);
            assert_eq!(m[0]["hostID"], 0x4003_0000);
            assert_eq!(m[0]["size"], 65_536);
        }
        assert_eq!(c["process"]["user"]["uid"], 0, "root inside");
        let plain = config();
        assert!(plain["linux"]["uidMappings"].is_null());
        assert!(!plain["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["type"] == "user"));
    }
}
