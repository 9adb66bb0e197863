//! The Kubernetes runtime against recorded API exchanges (see
//! `replay/mod.rs`). **Not a live cluster**: the fixtures are written from
//! the Kubernetes API reference. What these tests pin down is what the
//! runtime sends (the Pod's security settings, limits, runtime class,
//! labels, the Secret, the policy, the order of requests) and how it reads
//! each answer (phases, container states, addresses, Status errors).
//!
//! The envd transport is tested with a real envd (`bridge_envd`): the
//! recorded Pod's address is 127.0.0.1 and its bridge port is where the
//! test started envd, with the secret the runtime put in the Secret it
//! sent. No Pod, no kubelet, no network plugin is involved: the init
//! container and the NetworkPolicy are checked as objects only.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

#[allow(dead_code)] // shared with the server's test
mod bridge_envd;
#[allow(dead_code)] // shared with the server's test
mod replay;

use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
use aviary_envd_proto::{EnvdClient, ExecSpec};
use aviary_runtime::{BindMount, Runtime, RuntimeError, RuntimeStatus, SandboxSpec, TemplateRef};
use aviary_runtime_kube::{ApiAccess, KubeError, KubeRuntime, KubeSettings, NO_HOST_DIR};
use base64::Engine as _;
use replay::{kubeconfig, Replay};
use serde_json::{json, Value};
use std::time::Duration;

const A: &str = "sbx-aaaaaaaaaaaaaaaaaaaa";
const B: &str = "sbx-bbbbbbbbbbbbbbbbbbbb";

fn id(s: &str) -> SandboxId {
    s.parse().unwrap()
}

fn settings() -> KubeSettings {
    let mut s = KubeSettings::for_tests("aviary", "test");
    s.images.insert(
        "python".into(),
        format!("registry.example/aviary/python@sha256:{}", "0".repeat(64)),
    );
    s.ready_timeout = Duration::from_secs(30);
    s.delete_timeout = Duration::from_secs(30);
    s.poll_interval = Duration::from_millis(10);
    s
}

/// The spec the control plane sends (`ControlPlane::sandbox_spec`), with
/// the class `python-small`'s limits but 1.5 CPUs and 4 GiB of disk.
fn spec(sandbox: &str) -> SandboxSpec {
    SandboxSpec {
        id: id(sandbox),
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
        env: vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            "HOME=/root".into(),
            "LANG=C.UTF-8".into(),
        ],
        binds: vec![BindMount {
            host: "/usr/local/lib/aviary/aviary-envd".into(),
            sandbox: "/.aviary/envd".into(),
            read_only: true,
        }],
    }
}

/// The runtime against `replay`, its relays under the returned dir.
async fn runtime(replay: &Replay, settings: KubeSettings) -> (KubeRuntime, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_in(replay, settings, dir.path()).await;
    (rt, dir)
}

async fn runtime_in(
    replay: &Replay,
    mut settings: KubeSettings,
    dir: &std::path::Path,
) -> KubeRuntime {
    settings.relay_dir = dir.join("relays");
    let path = kubeconfig(dir, &replay.url());
    KubeRuntime::connect(
        &ApiAccess::Kubeconfig {
            path,
            context: None,
        },
        settings,
    )
    .await
    .unwrap()
}

fn sent(replay: &Replay, method: &str, path: &str) -> Value {
    replay
        .requests()
        .into_iter()
        .find(|r| r.method == method && r.path == path)
        .and_then(|r| r.body)
        .unwrap_or_else(|| panic!("no {method} {path} with a body was sent"))
}

/// The bridge secret the runtime sent in its Secret.
fn secret_of(replay: &Replay) -> String {
    let secret = sent(replay, "POST", "/api/v1/namespaces/aviary/secrets");
    let b64 = secret["data"]["bridge-secret"].as_str().unwrap();
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap(),
    )
    .unwrap()
}

#[tokio::test]
async fn a_sandbox_is_created_read_listed_and_destroyed() {
    let replay = Replay::start("lifecycle").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    assert_eq!(rt.name(), "kubernetes");

    let handle = rt.create(&spec(A)).await.unwrap();
    assert_eq!(handle.runtime, "kubernetes");
    assert_eq!(
        handle.runtime_instance_id,
        "6f1c2a7e-2b1d-4c57-9a51-0c6f8e0b1a01"
    );
    // envd is reached through a relay socket this process serves; the
    // workspace is the Pod's own
    let ep = handle.envd.clone().unwrap();
    assert_eq!(ep.peer_pid, std::process::id());
    assert_eq!(
        ep.socket,
        _dir.path().join("relays").join(A).join("envd.sock")
    );
    assert!(ep.socket.exists());
    assert!(handle.workspace_dir.starts_with(NO_HOST_DIR));

    assert_eq!(rt.status(&id(A)).await.unwrap(), RuntimeStatus::Running);
    let usage = rt.usage(&id(A)).await.unwrap();
    assert_eq!(usage.memory_current_bytes, 52428 * 1024);
    assert_eq!(usage.memory_peak_bytes, 52428 * 1024);
    assert_eq!(usage.oom_kills, 0);
    assert_eq!(rt.list().await.unwrap(), vec![id(A), id(B)]);
    rt.destroy(&id(A)).await.unwrap();
    assert!(!ep.socket.exists(), "the relay socket is gone");
    assert!(!ep.socket.parent().unwrap().exists());
    assert_eq!(rt.status(&id(A)).await.unwrap(), RuntimeStatus::NotFound);
    rt.destroy(&id(A)).await.unwrap();
    replay.finish();

    // Every request carried the kubeconfig's credentials.
    for r in replay.requests() {
        assert_eq!(r.authorization.as_deref(), Some("Bearer replay-token"));
    }

    // The policy selects exactly this sandbox, allows no egress and one
    // ingress: envd's bridge port from envd_from.
    let policy = sent(
        &replay,
        "POST",
        "/apis/networking.k8s.io/v1/namespaces/aviary/networkpolicies",
    );
    assert_eq!(
        policy["spec"],
        json!({
            "podSelector": {"matchLabels": {"aviary.dev/sandbox": A, "aviary.dev/deployment": "test"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
                "ports": [{"protocol": "TCP", "port": 49877}],
            }],
        })
    );

    // The Secret: labelled, immutable, one key, a fresh 64-hex secret.
    let secret = sent(&replay, "POST", "/api/v1/namespaces/aviary/secrets");
    assert_eq!(secret["metadata"]["name"], A);
    assert_eq!(secret["metadata"]["labels"]["aviary.dev/sandbox"], A);
    assert_eq!(
        secret["metadata"]["labels"]["aviary.dev/deployment"],
        "test"
    );
    assert_eq!(secret["immutable"], true);
    assert!(secret.get("stringData").is_none());
    let data = secret["data"].as_object().unwrap();
    assert_eq!(data.keys().collect::<Vec<_>>(), ["bridge-secret"]);
    let value = secret_of(&replay);
    assert_eq!(value.len(), 64);
    assert!(value.bytes().all(|b| b.is_ascii_hexdigit()), "{value}");

    // The Pod, field by field: where bugs would hide.
    let pod = sent(&replay, "POST", "/api/v1/namespaces/aviary/pods");
    let md = &pod["metadata"];
    assert_eq!(md["name"], A);
    assert_eq!(md["namespace"], "aviary");
    assert_eq!(md["labels"]["aviary.dev/sandbox"], A);
    assert_eq!(md["labels"]["aviary.dev/deployment"], "test");
    assert_eq!(md["annotations"]["aviary.dev/template"], "python");
    let ps = &pod["spec"];
    assert_eq!(ps["runtimeClassName"], "gvisor");
    assert_eq!(ps["automountServiceAccountToken"], false);
    assert_eq!(ps["enableServiceLinks"], false);
    assert_eq!(ps["hostNetwork"], false);
    assert_eq!(ps["hostPID"], false);
    assert_eq!(ps["hostIPC"], false);
    assert_eq!(ps["restartPolicy"], "Never");
    assert_eq!(ps["hostname"], "sandbox");
    assert!(ps.get("serviceAccountName").is_none());
    assert!(ps.get("nodeName").is_none());
    assert_eq!(
        ps["securityContext"],
        json!({
            "runAsNonRoot": true, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        })
    );
    let volumes = ps["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 3);
    for v in &volumes[..2] {
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["emptyDir", "name"], "no host path: {v}");
    }
    assert_eq!(
        volumes[2],
        json!({"name": "bridge-secret", "secret": {
            "secretName": A, "defaultMode": 0o400, "optional": false,
            "items": [{"key": "bridge-secret", "path": "bridge-secret"}],
        }})
    );
    // The init container stages the secret; only it mounts the Secret.
    let inits = ps["initContainers"].as_array().unwrap();
    assert_eq!(inits.len(), 1);
    assert_eq!(inits[0]["command"], json!(["/.aviary/envd"]));
    assert_eq!(
        inits[0]["args"],
        json!([
            "--stage-secret",
            "/var/run/aviary-secret/bridge-secret",
            "/run/aviary/bridge-secret"
        ])
    );
    assert_eq!(
        inits[0]["volumeMounts"],
        json!([
            {"name": "bridge-secret", "mountPath": "/var/run/aviary-secret", "readOnly": true},
            {"name": "control", "mountPath": "/run/aviary"},
        ])
    );
    let containers = ps["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert_eq!(
        c["image"],
        format!("registry.example/aviary/python@sha256:{}", "0".repeat(64))
    );
    assert_eq!(c["command"], json!(["/.aviary/envd"]));
    assert_eq!(
        c["args"],
        json!([
            "--socket",
            "/run/aviary/envd.sock",
            "--bridge",
            "0.0.0.0:49877",
            "--bridge-secret-file",
            "/run/aviary/bridge-secret",
        ])
    );
    // the secret is nowhere in the Pod spec: not in env, args or mounts
    let pod_text = pod.to_string();
    assert!(
        !pod_text.contains(&value),
        "the secret leaked into the Pod spec"
    );
    assert_eq!(
        c["volumeMounts"],
        json!([
            {"name": "workspace", "mountPath": "/workspace"},
            {"name": "control", "mountPath": "/run/aviary"},
        ])
    );
    assert_eq!(inits[0]["securityContext"], c["securityContext"]);
    assert_eq!(
        c["securityContext"],
        json!({
            "allowPrivilegeEscalation": false, "privileged": false,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": true, "runAsUser": 1000, "runAsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        })
    );
    let limits = json!({"cpu": "1500m", "memory": "2048Mi", "ephemeral-storage": "4096Mi"});
    assert_eq!(
        c["resources"],
        json!({"limits": limits, "requests": limits})
    );
    assert!(c.get("ports").is_none(), "no port is declared: {c}");
    assert_eq!(c["env"][1], json!({"name": "HOME", "value": "/root"}));

    // The delete is graceful (1 s) and bound to the uid that was read.
    let delete = sent(
        &replay,
        "DELETE",
        &format!("/api/v1/namespaces/aviary/pods/{A}"),
    );
    assert_eq!(delete["gracePeriodSeconds"], 1);
    assert_eq!(
        delete["preconditions"]["uid"],
        "6f1c2a7e-2b1d-4c57-9a51-0c6f8e0b1a01"
    );
}

#[tokio::test]
async fn a_taken_name_is_already_exists_and_nothing_of_the_other_is_deleted() {
    let replay = Replay::start("conflict").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    let e = rt.create(&spec(A)).await.unwrap_err();
    assert!(matches!(e, RuntimeError::AlreadyExists { .. }), "{e:?}");
    // the policy was new, the pod was not: the policy stays for it
    let e = rt.create(&spec(B)).await.unwrap_err();
    assert!(matches!(e, RuntimeError::AlreadyExists { .. }), "{e:?}");
    assert_eq!(e.code(), aviary_core::ErrorCode::Conflict);
    replay.finish();
    assert!(replay.requests().iter().all(|r| r.method == "POST"));
}

#[tokio::test]
async fn a_forbidden_answer_says_what_the_account_lacks() {
    let replay = Replay::start("forbidden").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    let e = rt.create(&spec(A)).await.unwrap_err();
    let RuntimeError::ProbeRuntime { reason } = &e else {
        panic!("{e:?}")
    };
    assert!(reason.contains("403"), "{reason}");
    assert!(reason.contains("forbade create networkpolicy"), "{reason}");
    assert!(reason.contains("cannot create resource"), "{reason}");
    assert!(reason.contains("namespace \"aviary\""), "{reason}");
    assert_eq!(e.code(), aviary_core::ErrorCode::Unavailable);
    let e = rt.status(&id(A)).await.unwrap_err();
    assert!(e.to_string().contains("forbade read pod"), "{e}");
    let e = rt.list().await.unwrap_err();
    assert!(e.to_string().contains("forbade list pods"), "{e}");
    replay.finish();
}

#[tokio::test]
async fn an_unreachable_api_server_is_a_clear_error() {
    // a port that was just free and is closed now
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = kubeconfig(dir.path(), &format!("http://{addr}"));
    let mut s = settings();
    s.relay_dir = dir.path().join("relays");
    let rt = KubeRuntime::connect(
        &ApiAccess::Kubeconfig {
            path,
            context: None,
        },
        s,
    )
    .await
    .unwrap();
    for e in [
        rt.create(&spec(A)).await.unwrap_err(),
        rt.status(&id(A)).await.unwrap_err(),
        rt.destroy(&id(A)).await.unwrap_err(),
    ] {
        let RuntimeError::ProbeRuntime { reason } = &e else {
            panic!("{e:?}")
        };
        assert!(reason.contains("unreachable"), "{reason}");
        assert!(reason.contains(&addr.to_string()), "{reason}");
    }
}

#[tokio::test]
async fn a_pod_that_never_runs_fails_the_create_and_is_deleted() {
    let replay = Replay::start("never_running").await;
    let mut s = settings();
    s.ready_timeout = Duration::from_millis(200);
    let (rt, _dir) = runtime(&replay, s).await;
    let e = rt.create(&spec(A)).await.unwrap_err();
    let RuntimeError::InvokeRuntime { action, detail } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(action, &format!("start pod {A}"));
    assert!(detail.contains("did not run within"), "{detail}");
    assert!(
        detail.contains("PodScheduled=False Unschedulable"),
        "{detail}"
    );
    assert!(detail.contains("0/3 nodes are available"), "{detail}");
    // finish: the pod was deleted, waited for, and the policy removed
    replay.finish();
}

#[tokio::test]
async fn an_image_pull_error_fails_the_create_at_once_and_is_reported() {
    let replay = Replay::start("image_pull").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    let e = rt.create(&spec(A)).await.unwrap_err();
    let text = e.to_string();
    assert!(text.contains("ErrImagePull"), "{text}");
    assert!(text.contains("failed to pull and unpack image"), "{text}");
    replay.finish();
    // one read saw the error; then the cleanup's read
    let reads = replay
        .requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path == format!("/api/v1/namespaces/aviary/pods/{A}"))
        .count();
    assert_eq!(reads, 4, "poll, cleanup read, terminating, gone");
}

#[tokio::test]
async fn stopped_pods_missing_metrics_and_foreign_pods() {
    let replay = Replay::start("stopped_and_foreign").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    assert_eq!(rt.status(&id(A)).await.unwrap(), RuntimeStatus::Stopped);
    let e = rt.usage(&id(A)).await.unwrap_err();
    assert!(e.to_string().contains("is metrics-server installed"), "{e}");
    // another deployment's pod of the same name: not ours to see or delete
    assert_eq!(rt.status(&id(B)).await.unwrap(), RuntimeStatus::NotFound);
    let e = rt.destroy(&id(B)).await.unwrap_err();
    assert!(e.to_string().contains("not ours, not deleted"), "{e}");
    replay.finish();
    assert!(replay.requests().iter().all(|r| r.method == "GET"));
}

#[tokio::test]
async fn specs_it_cannot_honour_are_refused_before_any_request() {
    let replay = Replay::silent().await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    let mut unknown = spec(A);
    unknown.template.name = "node".into();
    let e = rt.create(&unknown).await.unwrap_err();
    assert!(e.to_string().contains("no image"), "{e}");
    let mut open = spec(A);
    open.network = NetworkProfile::Open;
    let e = rt.create(&open).await.unwrap_err();
    assert!(matches!(e, RuntimeError::Unsupported { .. }), "{e:?}");
    assert!(!rt.enforces_network(NetworkProfile::Open));
    assert!(rt.enforces_network(NetworkProfile::None));
    let mut bind = spec(A);
    bind.binds.push(BindMount {
        host: "/etc".into(),
        sandbox: "/mnt/etc".into(),
        read_only: true,
    });
    let e = rt.create(&bind).await.unwrap_err();
    assert!(e.to_string().contains("host path"), "{e}");
    let mut bad = spec(A);
    bad.resources.cpu = 0.0;
    let e = rt.create(&bad).await.unwrap_err();
    assert!(matches!(e, RuntimeError::InvalidSpec { .. }), "{e:?}");
    replay.finish();
    assert!(replay.requests().is_empty());
}

#[tokio::test]
async fn bad_settings_and_credentials_fail_at_connect() {
    let missing = ApiAccess::Kubeconfig {
        path: "/nonexistent/kubeconfig".into(),
        context: None,
    };
    let e = KubeRuntime::connect(&missing, settings())
        .await
        .unwrap_err();
    assert!(matches!(e, KubeError::ReadKubeconfig { .. }), "{e:?}");
    let dir = tempfile::tempdir().unwrap();
    let path = kubeconfig(dir.path(), "http://127.0.0.1:1");
    let access = ApiAccess::Kubeconfig {
        path,
        context: Some("no-such-context".into()),
    };
    let e = KubeRuntime::connect(&access, settings()).await.unwrap_err();
    assert!(matches!(e, KubeError::LoadKubeconfig { .. }), "{e:?}");
    for (namespace, deployment) in [("Aviary", "test"), ("aviary", "a b"), ("aviary", "")] {
        let e = KubeRuntime::connect(&missing, KubeSettings::for_tests(namespace, deployment))
            .await
            .unwrap_err();
        assert!(matches!(e, KubeError::InvalidSettings { .. }), "{e:?}");
    }
}

#[tokio::test]
async fn conformance_unknown_ids() {
    // The runtime conformance checks that need no container: the others
    // look at host directories, host pids and cgroups, which a Pod has not.
    let replay = Replay::start("conformance_unknown").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    aviary_runtime::conformance::check_unknown_ids(&rt).await;
    replay.finish();
}

#[tokio::test]
async fn a_pod_the_api_server_finds_invalid_is_an_invalid_spec_and_its_policy_goes() {
    let replay = Replay::start("invalid").await;
    let (rt, _dir) = runtime(&replay, settings()).await;
    let e = rt.create(&spec(A)).await.unwrap_err();
    let RuntimeError::InvalidSpec { reason } = &e else {
        panic!("{e:?}")
    };
    assert!(reason.contains("invalid reference format"), "{reason}");
    assert_eq!(e.code(), aviary_core::ErrorCode::InvalidRequest);
    replay.finish();
}

/// The transport: the runtime's create returns a handle whose relay socket
/// (served by this process) reaches a real envd's bridge with the secret
/// the runtime generated; envd answers health and runs a command through
/// it; a wrong secret is refused by envd; after a restart the relay is
/// made again from the Pod and the Secret read back; destroy removes the
/// Pod, the Secret, the policy and the relay socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_in_the_pod_is_reached_through_the_relay_with_the_generated_secret() {
    let replay = Replay::start("envd_bridge").await;
    let port = bridge_envd::free_port();
    let mut s = settings();
    s.envd_port = port;
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime_in(&replay, s.clone(), dir.path()).await;
    let handle = rt.create(&spec(A)).await.unwrap();
    // envd in the "Pod": started with what the runtime put in the Secret
    let secret = secret_of(&replay);
    let envd = bridge_envd::BridgeEnvd::start(port, &secret);
    let ep = handle.envd.clone().unwrap();
    let client = EnvdClient::new(&ep.socket).expect_peer_pid(ep.peer_pid);
    client.wait_ready(Duration::from_secs(10)).await.unwrap();
    let health = client.health().await.unwrap();
    assert!(!health.pid1, "the test's envd is an ordinary process");
    let out = client
        .exec_collect(
            ExecSpec {
                argv: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "echo hello from the pod".into(),
                ],
                ..ExecSpec::default()
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from the pod\n");
    // only the bridge's connections may move the fence: these are
    client.set_fence(Some(3)).await.unwrap();
    assert_eq!(client.health().await.unwrap().fence, Some(3));

    // a wrong secret is refused by envd itself
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let wrong = aviary_relay::TcpBridge::new(addr, "f".repeat(64)).unwrap();
    let e = wrong.open().await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    // ...and so is a relay that carries it
    let wrong_socket = dir.path().join("wrong.sock");
    let _wrong_relay = aviary_relay::start(&wrong_socket, wrong).unwrap();
    EnvdClient::new(&wrong_socket).health().await.unwrap_err();

    // a restart: a new runtime, no relay, reads the Pod and the Secret again
    drop(rt);
    replay.bind(
        "secret_base64",
        &base64::engine::general_purpose::STANDARD.encode(&secret),
    );
    let rt = runtime_in(&replay, s, dir.path()).await;
    let again = rt.envd_endpoint(&id(A)).await.unwrap();
    assert_eq!(again, ep);
    let client = EnvdClient::new(&again.socket).expect_peer_pid(again.peer_pid);
    assert_eq!(client.health().await.unwrap().fence, Some(3));
    // a second call reuses the relay: no request to the API server
    rt.envd_endpoint(&id(A)).await.unwrap();

    rt.destroy(&id(A)).await.unwrap();
    assert!(!ep.socket.exists(), "the relay socket is gone");
    assert!(!ep.socket.parent().unwrap().exists());
    client.health().await.unwrap_err();
    replay.finish();
    let deleted: Vec<String> = replay
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE")
        .map(|r| r.path)
        .collect();
    assert_eq!(
        deleted,
        [
            format!("/api/v1/namespaces/aviary/pods/{A}"),
            format!("/api/v1/namespaces/aviary/secrets/{A}"),
            format!("/apis/networking.k8s.io/v1/namespaces/aviary/networkpolicies/{A}"),
        ]
    );
    drop(envd);
}

#[tokio::test]
async fn bridge_settings_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = kubeconfig(dir.path(), "http://127.0.0.1:1");
    let access = ApiAccess::Kubeconfig {
        path,
        context: None,
    };
    for (edit, what) in [
        (
            Box::new(|s: &mut KubeSettings| s.envd_from.clear()) as Box<dyn Fn(&mut KubeSettings)>,
            "names no CIDR",
        ),
        (
            Box::new(|s| s.envd_from = vec!["10.0.0.1/8".into()]),
            "not a CIDR",
        ),
        (
            Box::new(|s| s.envd_from = vec!["everywhere".into()]),
            "not a CIDR",
        ),
        (Box::new(|s| s.envd_port = 80), "below 1024"),
        (Box::new(|s| s.relay_dir = "relative".into()), "absolute"),
    ] {
        let mut s = settings();
        s.relay_dir = dir.path().join("relays");
        edit(&mut s);
        let e = KubeRuntime::connect(&access, s).await.unwrap_err();
        assert!(matches!(e, KubeError::InvalidSettings { .. }), "{e:?}");
        assert!(e.to_string().contains(what), "{e}");
    }
}
