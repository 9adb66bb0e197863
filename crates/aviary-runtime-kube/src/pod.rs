//! The Kubernetes objects one sandbox is made of, built from its spec: the
//! NetworkPolicy that selects it (no egress; ingress only to envd's bridge
//! port from `envd_from`), the Secret holding its bridge secret, and the
//! Pod. Pure functions, no I/O, so the exact objects the runtime sends are
//! unit-tested here and checked again on the wire by the recorded-exchange
//! tests.
//!
//! How the secret reaches envd without the sandbox's code ever seeing it:
//! the Secret is mounted (read-only, mode 0400) only in the Pod's init
//! container, which runs envd's `--stage-secret` to copy it into the
//! Pod's in-memory control volume; the sandbox container does not mount
//! the Secret, and envd, its PID 1, reads and removes the copy before it
//! starts anything (`--bridge-secret-file`). The kubelet adds group read
//! for `fsGroup` (= `run_as_user`) to Secret files (a 0400 `defaultMode`
//! becomes 0440, group `fsGroup`: kubernetes/kubernetes#57923), which is
//! how the init container, running as that uid, reads a file owned by root.

use crate::KubeSettings;
use aviary_core::SandboxId;
use aviary_runtime::{SandboxSpec, CONTROL_MOUNT, ENVD_SOCKET_NAME, WORKSPACE_MOUNT};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, KeyToPath, Pod, PodSecurityContext,
    PodSpec, ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource, SecurityContext,
    Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use std::collections::BTreeMap;
use std::net::IpAddr;

/// Label carrying the sandbox id on every object of a sandbox.
pub const SANDBOX_LABEL: &str = "aviary.dev/sandbox";
/// Label carrying the deployment name: one Aviary deployment never lists,
/// reads or deletes another's objects in a shared namespace.
pub const DEPLOYMENT_LABEL: &str = "aviary.dev/deployment";
/// Annotations naming the template the Pod was started from.
pub const TEMPLATE_ANNOTATION: &str = "aviary.dev/template";
pub const TEMPLATE_DIGEST_ANNOTATION: &str = "aviary.dev/template-digest";
/// The sandbox container of a Pod.
pub const CONTAINER_NAME: &str = "sandbox";
/// The init container that stages the bridge secret.
pub const INIT_CONTAINER_NAME: &str = "stage-secret";
/// The key of the bridge secret in the sandbox's Secret.
pub const SECRET_KEY: &str = "bridge-secret";
/// Where the init container (only it) mounts the Secret.
pub const SECRET_MOUNT: &str = "/var/run/aviary-secret";
/// The staged copy envd reads and removes, on the in-memory control volume.
pub fn staged_secret_path() -> String {
    format!("{CONTROL_MOUNT}/{SECRET_KEY}")
}

/// The Pod (and policy) name of a sandbox: its id, which is already a valid
/// DNS label (`sbx-` and 20 lowercase base32 characters).
pub fn object_name(id: &SandboxId) -> String {
    id.as_str().to_owned()
}

/// The labels every object of sandbox `id` carries.
pub fn labels(settings: &KubeSettings, id: &SandboxId) -> BTreeMap<String, String> {
    BTreeMap::from([
        (SANDBOX_LABEL.to_owned(), id.as_str().to_owned()),
        (DEPLOYMENT_LABEL.to_owned(), settings.deployment.clone()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "aviary".to_owned(),
        ),
    ])
}

/// The label selector of every object of this deployment.
pub fn deployment_selector(settings: &KubeSettings) -> String {
    format!("{DEPLOYMENT_LABEL}={},{SANDBOX_LABEL}", settings.deployment)
}

/// Whether an object's labels say it is sandbox `id` of this deployment.
pub fn is_ours(
    settings: &KubeSettings,
    id: &SandboxId,
    labels: Option<&BTreeMap<String, String>>,
) -> bool {
    labels.is_some_and(|l| {
        l.get(SANDBOX_LABEL).map(String::as_str) == Some(id.as_str())
            && l.get(DEPLOYMENT_LABEL) == Some(&settings.deployment)
    })
}

/// A policy that selects the sandbox's Pod and allows no egress (`none`:
/// loopback only) and one ingress: TCP to envd's bridge port from the
/// `envd_from` CIDRs (the control plane). Created before the Pod so the Pod
/// never runs unselected. Enforced by the cluster's network plugin.
pub fn network_policy(settings: &KubeSettings, id: &SandboxId) -> NetworkPolicy {
    let labels = labels(settings, id);
    let selector = BTreeMap::from([
        (SANDBOX_LABEL.to_owned(), id.as_str().to_owned()),
        (DEPLOYMENT_LABEL.to_owned(), settings.deployment.clone()),
    ]);
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(object_name(id)),
            namespace: Some(settings.namespace.clone()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector),
                match_expressions: None,
            }),
            policy_types: Some(vec!["Ingress".into(), "Egress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(
                    settings
                        .envd_from
                        .iter()
                        .map(|cidr| NetworkPolicyPeer {
                            ip_block: Some(IPBlock {
                                cidr: cidr.clone(),
                                except: None,
                            }),
                            namespace_selector: None,
                            pod_selector: None,
                        })
                        .collect(),
                ),
                ports: Some(vec![NetworkPolicyPort {
                    protocol: Some("TCP".into()),
                    port: Some(IntOrString::Int(i32::from(settings.envd_port))),
                    end_port: None,
                }]),
            }]),
            egress: None,
        }),
    }
}

/// The Secret holding sandbox `id`'s bridge secret (immutable; mounted
/// only by the init container).
pub fn bridge_secret(settings: &KubeSettings, id: &SandboxId, secret: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(object_name(id)),
            namespace: Some(settings.namespace.clone()),
            labels: Some(labels(settings, id)),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        immutable: Some(true),
        data: Some(BTreeMap::from([(
            SECRET_KEY.to_owned(),
            ByteString(secret.as_bytes().to_vec()),
        )])),
        string_data: None,
    }
}

/// Arguments envd gets in a Pod: a unix socket on the Pod's own in-memory
/// control volume (no host socket can be passed into a Pod: `--listen-fd`
/// is for local runtimes), and the bridge on every address of the Pod at
/// `port`, which takes only upgrades carrying the secret staged at
/// [`staged_secret_path`] (read and removed at start). The bridge's
/// connections are the only ones that may move envd's fence; the sandbox's
/// own code can reach the port over loopback but does not know the secret.
pub fn envd_args(port: u16) -> Vec<String> {
    vec![
        "--socket".into(),
        format!("{CONTROL_MOUNT}/{ENVD_SOCKET_NAME}"),
        "--bridge".into(),
        format!("0.0.0.0:{port}"),
        "--bridge-secret-file".into(),
        staged_secret_path(),
    ]
}

/// The address the host reaches envd's bridge at: the Pod's IPv4 address
/// (envd's bridge listens on `0.0.0.0`), from `status.podIPs` or
/// `status.podIP`. What the API server answers is checked: an address that
/// does not parse, or is unspecified, multicast or broadcast, is refused.
pub fn pod_address(pod: &Pod) -> Result<IpAddr, String> {
    let status = pod.status.as_ref();
    let listed = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().map(|p| p.ip.as_str()).collect::<Vec<_>>())
        .unwrap_or_default();
    let single = status.and_then(|s| s.pod_ip.as_deref());
    let candidates: Vec<&str> = listed.into_iter().chain(single).collect();
    if candidates.is_empty() {
        return Err("the pod has no IP address in its status".into());
    }
    let mut parsed = Vec::new();
    for c in &candidates {
        let ip: IpAddr = c.parse().map_err(|_| {
            format!(
                "the pod's status names {:?} as its IP, which is not an IP address",
                c.chars().take(64).collect::<String>()
            )
        })?;
        let bad = match ip {
            IpAddr::V4(v4) => v4.is_unspecified() || v4.is_multicast() || v4.is_broadcast(),
            IpAddr::V6(v6) => v6.is_unspecified() || v6.is_multicast(),
        };
        if bad {
            return Err(format!("the pod's status names {ip} as its IP"));
        }
        parsed.push(ip);
    }
    parsed.into_iter().find(IpAddr::is_ipv4).ok_or_else(|| {
        "the pod has only IPv6 addresses and envd's bridge listens on IPv4 (0.0.0.0)".into()
    })
}

/// Whether `s` is a CIDR in canonical form (`10.0.0.0/8`, `fd00::/8`): an
/// address, a prefix length within its family, no bits set past it.
pub fn is_cidr(s: &str) -> bool {
    let Some((addr, len)) = s.split_once('/') else {
        return false;
    };
    let Ok(len) = len.parse::<u8>() else {
        return false;
    };
    if len.to_string() != s.split_once('/').map(|(_, l)| l).unwrap_or_default() {
        return false;
    }
    match addr.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => {
            len <= 32 && u32::from(a).checked_shl(u32::from(len)).unwrap_or(0) == 0
        }
        Ok(IpAddr::V6(a)) => {
            len <= 128 && u128::from(a).checked_shl(u32::from(len)).unwrap_or(0) == 0
        }
        Err(_) => false,
    }
}

/// The Pod of sandbox `spec`, with container image `image`.
pub fn pod(settings: &KubeSettings, spec: &SandboxSpec, image: &str) -> Pod {
    let id = &spec.id;
    let r = &spec.resources;
    // requests = limits: the Pod is in the Guaranteed QoS class, so what the
    // class promises is what the node reserves.
    let millicores = (r.cpu * 1000.0).ceil().max(1.0) as u64;
    let limits = BTreeMap::from([
        ("cpu".to_owned(), Quantity(format!("{millicores}m"))),
        ("memory".to_owned(), Quantity(format!("{}Mi", r.memory_mb))),
        (
            "ephemeral-storage".to_owned(),
            Quantity(format!("{}Mi", r.disk_mb)),
        ),
    ]);
    let non_root = settings.run_as_user != 0;
    let env = spec
        .env
        .iter()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| EnvVar {
            name: k.to_owned(),
            value: Some(v.to_owned()),
            value_from: None,
        })
        .collect();
    let resources = ResourceRequirements {
        limits: Some(limits.clone()),
        requests: Some(limits),
        ..ResourceRequirements::default()
    };
    let security_context = SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        capabilities: Some(Capabilities {
            add: None,
            drop: Some(vec!["ALL".into()]),
        }),
        run_as_non_root: Some(non_root),
        run_as_user: Some(settings.run_as_user),
        run_as_group: Some(settings.run_as_user),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            localhost_profile: None,
        }),
        ..SecurityContext::default()
    };
    // the init container: the same image and envd, only to stage the secret
    let init = Container {
        name: INIT_CONTAINER_NAME.into(),
        image: Some(image.to_owned()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![spec.init[0].clone()]),
        args: Some(vec![
            "--stage-secret".into(),
            format!("{SECRET_MOUNT}/{SECRET_KEY}"),
            staged_secret_path(),
        ]),
        resources: Some(resources.clone()),
        security_context: Some(security_context.clone()),
        volume_mounts: Some(vec![
            VolumeMount {
                name: "bridge-secret".into(),
                mount_path: SECRET_MOUNT.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "control".into(),
                mount_path: CONTROL_MOUNT.into(),
                ..VolumeMount::default()
            },
        ]),
        ..Container::default()
    };
    let container = Container {
        name: CONTAINER_NAME.into(),
        image: Some(image.to_owned()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![spec.init[0].clone()]),
        args: Some(envd_args(settings.envd_port)),
        env: Some(env),
        resources: Some(resources),
        security_context: Some(security_context),
        // the Secret's volume is not mounted here: the sandbox never sees it
        volume_mounts: Some(vec![
            VolumeMount {
                name: "workspace".into(),
                mount_path: WORKSPACE_MOUNT.into(),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "control".into(),
                mount_path: CONTROL_MOUNT.into(),
                ..VolumeMount::default()
            },
        ]),
        working_dir: Some(WORKSPACE_MOUNT.into()),
        ..Container::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(object_name(id)),
            namespace: Some(settings.namespace.clone()),
            labels: Some(labels(settings, id)),
            annotations: Some(BTreeMap::from([
                (TEMPLATE_ANNOTATION.to_owned(), spec.template.name.clone()),
                (
                    TEMPLATE_DIGEST_ANNOTATION.to_owned(),
                    spec.template.digest.clone(),
                ),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            init_containers: Some(vec![init]),
            containers: vec![container],
            restart_policy: Some("Never".into()),
            runtime_class_name: settings.runtime_class.clone(),
            hostname: Some(spec.hostname.clone()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            host_network: Some(false),
            host_pid: Some(false),
            host_ipc: Some(false),
            share_process_namespace: Some(false),
            // SIGKILL follows SIGTERM at once on delete: nothing in a
            // sandbox gets time to act on its destruction.
            termination_grace_period_seconds: Some(1),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(non_root),
                run_as_user: Some(settings.run_as_user),
                run_as_group: Some(settings.run_as_user),
                fs_group: Some(settings.run_as_user),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    localhost_profile: None,
                }),
                ..PodSecurityContext::default()
            }),
            volumes: Some(vec![
                Volume {
                    name: "workspace".into(),
                    empty_dir: Some(EmptyDirVolumeSource {
                        medium: None,
                        size_limit: Some(Quantity(format!("{}Mi", r.disk_mb))),
                    }),
                    ..Volume::default()
                },
                Volume {
                    name: "control".into(),
                    empty_dir: Some(EmptyDirVolumeSource {
                        medium: Some("Memory".into()),
                        size_limit: Some(Quantity("1Mi".into())),
                    }),
                    ..Volume::default()
                },
                Volume {
                    name: "bridge-secret".into(),
                    secret: Some(SecretVolumeSource {
                        secret_name: Some(object_name(id)),
                        items: Some(vec![KeyToPath {
                            key: SECRET_KEY.into(),
                            path: SECRET_KEY.into(),
                            mode: None,
                        }]),
                        default_mode: Some(0o400),
                        optional: Some(false),
                    }),
                    ..Volume::default()
                },
            ]),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// Bytes of a Kubernetes quantity as the metrics API writes memory
/// (`123456Ki`, `12Mi`, `1G`, `1048576`, `1.5Gi`). `None` for anything else
/// (the answer is the cluster's, not ours: it is checked, never trusted).
pub fn quantity_bytes(q: &str) -> Option<u64> {
    const SUFFIXES: [(&str, u64); 12] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("Pi", 1 << 50),
        ("Ei", 1 << 60),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("E", 1_000_000_000_000_000_000),
    ];
    let (number, scale) = SUFFIXES
        .iter()
        .find_map(|(s, m)| q.strip_suffix(s).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    if number.is_empty() || number.len() > 24 {
        return None;
    }
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) || frac.len() > 9 {
        return None;
    }
    let whole: u64 = whole.parse().ok()?;
    let mut bytes = whole.checked_mul(scale)?;
    if !frac.is_empty() {
        let digits: u64 = frac.parse().ok()?;
        let denom = 10u64.pow(frac.len() as u32);
        // scale ≤ 2^60 and digits < denom ≤ 10^9: fits in u128, then < scale.
        let part = (u128::from(digits) * u128::from(scale) / u128::from(denom)) as u64;
        bytes = bytes.checked_add(part)?;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::{NetworkProfile, ResourceLimits};
    use aviary_runtime::TemplateRef;

    fn spec() -> SandboxSpec {
        SandboxSpec {
            id: "sbx-aaaaaaaaaaaaaaaaaaaa".parse().unwrap(),
            template: TemplateRef {
                name: "python".into(),
                digest: format!("sha256:{}", "ab".repeat(32)),
            },
            resources: ResourceLimits {
                cpu: 1.5,
                memory_mb: 2048,
                disk_mb: 4096,
                pids: 512,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sandbox".into(),
            init: vec!["/.aviary/envd".into(), "--listen-fd".into(), "3".into()],
            env: vec!["PATH=/usr/bin:/bin".into(), "A=b=c".into()],
            binds: vec![],
        }
    }

    #[test]
    fn the_pod_is_locked_down_and_sized_from_the_class() {
        let settings = KubeSettings::for_tests("aviary", "prod");
        let p = pod(&settings, &spec(), "registry.example/python@sha256:00");
        let ps = p.spec.as_ref().unwrap();
        assert_eq!(ps.automount_service_account_token, Some(false));
        assert_eq!(ps.enable_service_links, Some(false));
        assert_eq!(ps.host_network, Some(false));
        assert_eq!(ps.restart_policy.as_deref(), Some("Never"));
        assert_eq!(ps.runtime_class_name.as_deref(), Some("gvisor"));
        for v in ps.volumes.as_ref().unwrap() {
            assert!(v.host_path.is_none());
            assert!(v.empty_dir.is_some() || v.secret.is_some());
        }
        let c = &ps.containers[0];
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_owned()][..])
        );
        assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
        let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
        assert_eq!(limits["cpu"].0, "1500m");
        assert_eq!(limits["memory"].0, "2048Mi");
        assert_eq!(limits["ephemeral-storage"].0, "4096Mi");
        assert_eq!(
            c.command.as_deref(),
            Some(&["/.aviary/envd".to_owned()][..])
        );
        assert_eq!(
            c.args.as_deref().unwrap(),
            [
                "--socket",
                "/run/aviary/envd.sock",
                "--bridge",
                "0.0.0.0:49877",
                "--bridge-secret-file",
                "/run/aviary/bridge-secret"
            ]
        );
        // the secret's volume: only in the init container, read-only
        let mounts = |c: &Container| -> Vec<String> {
            c.volume_mounts
                .iter()
                .flatten()
                .map(|m| m.name.clone())
                .collect()
        };
        assert_eq!(mounts(c), ["workspace", "control"]);
        let init = &ps.init_containers.as_ref().unwrap()[0];
        assert_eq!(mounts(init), ["bridge-secret", "control"]);
        let m = &init.volume_mounts.as_ref().unwrap()[0];
        assert_eq!(m.read_only, Some(true));
        assert_eq!(
            init.args.as_deref().unwrap(),
            [
                "--stage-secret",
                "/var/run/aviary-secret/bridge-secret",
                "/run/aviary/bridge-secret"
            ]
        );
        assert_eq!(init.security_context, c.security_context);
        let secret_volume = ps
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find_map(|v| v.secret.clone())
            .unwrap();
        assert_eq!(secret_volume.default_mode, Some(0o400));
        assert_eq!(
            secret_volume.secret_name.as_deref(),
            Some(spec().id.as_str())
        );
        let env = c.env.as_ref().unwrap();
        assert_eq!(env[1].name, "A");
        assert_eq!(env[1].value.as_deref(), Some("b=c"));
    }

    #[test]
    fn root_is_only_asked_for_explicitly() {
        let mut settings = KubeSettings::for_tests("aviary", "prod");
        settings.run_as_user = 0;
        let p = pod(&settings, &spec(), "img");
        let ps = p.spec.unwrap();
        assert_eq!(ps.security_context.unwrap().run_as_non_root, Some(false));
        // everything else stays locked down
        let sc = ps.containers[0].security_context.clone().unwrap();
        assert_eq!(sc.allow_privilege_escalation, Some(false));
    }

    #[test]
    fn ownership_needs_both_labels() {
        let settings = KubeSettings::for_tests("aviary", "prod");
        let id: SandboxId = "sbx-aaaaaaaaaaaaaaaaaaaa".parse().unwrap();
        assert!(is_ours(&settings, &id, Some(&labels(&settings, &id))));
        let mut other = labels(&settings, &id);
        other.insert(DEPLOYMENT_LABEL.into(), "staging".into());
        assert!(!is_ours(&settings, &id, Some(&other)));
        assert!(!is_ours(&settings, &id, None));
    }

    #[test]
    fn the_policy_admits_only_the_bridge_port_from_the_configured_sources() {
        let mut settings = KubeSettings::for_tests("aviary", "prod");
        settings.envd_from = vec!["10.0.0.0/8".into(), "192.168.1.7/32".into()];
        settings.envd_port = 40_000;
        let id: SandboxId = "sbx-aaaaaaaaaaaaaaaaaaaa".parse().unwrap();
        let p = serde_json::to_value(network_policy(&settings, &id)).unwrap();
        assert_eq!(
            p["spec"]["ingress"],
            serde_json::json!([{
                "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"ipBlock": {"cidr": "192.168.1.7/32"}}],
                "ports": [{"protocol": "TCP", "port": 40000}],
            }])
        );
        assert!(p["spec"].get("egress").is_none(), "no egress at all");
        assert_eq!(
            p["spec"]["policyTypes"],
            serde_json::json!(["Ingress", "Egress"])
        );
    }

    #[test]
    fn the_secret_is_labelled_immutable_and_opaque() {
        let settings = KubeSettings::for_tests("aviary", "prod");
        let id: SandboxId = "sbx-aaaaaaaaaaaaaaaaaaaa".parse().unwrap();
        let s = bridge_secret(&settings, &id, "0123456789abcdef0123");
        assert!(is_ours(&settings, &id, s.metadata.labels.as_ref()));
        assert_eq!(s.immutable, Some(true));
        assert_eq!(
            s.data.unwrap()[SECRET_KEY].0,
            b"0123456789abcdef0123".to_vec()
        );
    }

    #[test]
    fn the_pod_address_is_checked() {
        use k8s_openapi::api::core::v1::{PodIP, PodStatus};
        let with = |ip: Option<&str>, ips: &[&str]| Pod {
            status: Some(PodStatus {
                pod_ip: ip.map(str::to_owned),
                pod_ips: (!ips.is_empty()).then(|| {
                    ips.iter()
                        .map(|i| PodIP {
                            ip: (*i).to_owned(),
                        })
                        .collect()
                }),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        assert_eq!(
            pod_address(&with(Some("10.1.2.3"), &[]))
                .unwrap()
                .to_string(),
            "10.1.2.3"
        );
        // dual stack, IPv6 first: the IPv4 one
        assert_eq!(
            pod_address(&with(Some("fd00::5"), &["fd00::5", "10.1.2.3"]))
                .unwrap()
                .to_string(),
            "10.1.2.3"
        );
        for (ip, ips) in [
            (None, &[][..]),
            (Some("10.1.2.3; rm -rf /"), &[]),
            (Some("0.0.0.0"), &[]),
            (Some("224.0.0.1"), &[]),
            (Some("fd00::5"), &["fd00::5"]),
            (Some("10.1.2.3"), &["not-an-ip"]),
        ] {
            pod_address(&with(ip, ips)).unwrap_err();
        }
    }

    #[test]
    fn cidrs_are_canonical() {
        for good in [
            "10.0.0.0/8",
            "192.168.1.7/32",
            "0.0.0.0/0",
            "fd00::/8",
            "::1/128",
        ] {
            assert!(is_cidr(good), "{good}");
        }
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0",
            "10.0.0.0/33",
            "10.0.0.0/08",
            "10.0.0.0/-1",
            "fd00::/129",
            "host/8",
            "",
        ] {
            assert!(!is_cidr(bad), "{bad}");
        }
    }

    #[test]
    fn memory_quantities_parse_or_are_refused() {
        assert_eq!(quantity_bytes("1024"), Some(1024));
        assert_eq!(quantity_bytes("12Ki"), Some(12 * 1024));
        assert_eq!(quantity_bytes("3Mi"), Some(3 << 20));
        assert_eq!(quantity_bytes("1.5Gi"), Some(3 << 29));
        assert_eq!(quantity_bytes("2M"), Some(2_000_000));
        for bad in [
            "",
            "Ki",
            "-1Mi",
            "1.2.3",
            "abc",
            "1e3",
            "99999999999999999999Ei",
        ] {
            assert_eq!(quantity_bytes(bad), None, "{bad}");
        }
    }
}
