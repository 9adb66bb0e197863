//! The Kubernetes objects one sandbox is made of, built from its spec: the
//! Pod and the deny-all NetworkPolicy that selects it. Pure functions, no
//! I/O, so the exact objects the runtime sends are unit-tested here and
//! checked again on the wire by the recorded-exchange tests.

use crate::KubeSettings;
use aviary_core::SandboxId;
use aviary_runtime::{SandboxSpec, CONTROL_MOUNT, ENVD_SOCKET_NAME, WORKSPACE_MOUNT};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, Pod, PodSecurityContext, PodSpec,
    ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use std::collections::BTreeMap;

/// Label carrying the sandbox id on every object of a sandbox.
pub const SANDBOX_LABEL: &str = "aviary.dev/sandbox";
/// Label carrying the deployment name: one Aviary deployment never lists,
/// reads or deletes another's objects in a shared namespace.
pub const DEPLOYMENT_LABEL: &str = "aviary.dev/deployment";
/// Annotations naming the template the Pod was started from.
pub const TEMPLATE_ANNOTATION: &str = "aviary.dev/template";
pub const TEMPLATE_DIGEST_ANNOTATION: &str = "aviary.dev/template-digest";
/// The one container of a sandbox Pod.
pub const CONTAINER_NAME: &str = "sandbox";

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

/// A policy that selects the sandbox's Pod and allows no ingress and no
/// egress (`none`: loopback only), created before the Pod so the Pod never
/// runs unselected. Enforced by the cluster's network plugin.
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
            ingress: None,
            egress: None,
        }),
    }
}

/// Arguments envd gets in a Pod: it serves a unix socket on the Pod's own
/// in-memory control volume. No host socket can be passed into a Pod
/// (`--listen-fd` is for local runtimes), and no TCP port is opened (a
/// loopback port would be reachable by the sandbox's own code, and envd's
/// fence authority rests on peer credentials that TCP does not carry).
pub fn envd_args() -> Vec<String> {
    vec![
        "--socket".into(),
        format!("{CONTROL_MOUNT}/{ENVD_SOCKET_NAME}"),
    ]
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
    let container = Container {
        name: CONTAINER_NAME.into(),
        image: Some(image.to_owned()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![spec.init[0].clone()]),
        args: Some(envd_args()),
        env: Some(env),
        resources: Some(ResourceRequirements {
            limits: Some(limits.clone()),
            requests: Some(limits),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
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
        }),
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
            assert!(v.empty_dir.is_some());
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
            c.args.as_deref(),
            Some(&["--socket".to_owned(), "/run/aviary/envd.sock".to_owned()][..])
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
