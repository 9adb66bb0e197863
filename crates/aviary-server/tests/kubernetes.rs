//! The Kubernetes runtime wired into the server, against recorded API
//! exchanges (**not a live cluster**: the fixture is written from the
//! Kubernetes API reference; see `aviary-runtime-kube/tests/replay`).
//!
//! A server configured with `[kubernetes]` starts, holds the runtime in its
//! `RuntimeSet` (without `Pausable`), its start-up and reconciler passes
//! list the deployment's Pods and policies, and a create placed on
//! `kubernetes` sends the policy, the Secret and the Pod. The recorded Pod
//! runs at 127.0.0.1, where this test starts a real envd with its bridge
//! (the arguments the Pod gives it, on loopback) and the secret the runtime
//! put in the Secret it sent; the control plane reaches it through the
//! runtime's relay socket, so the create succeeds and commands run, also
//! after a server restart (the relay is made again from the Pod and the
//! Secret read back). No kubelet, init container or network plugin is
//! involved.

#![cfg(feature = "kubernetes")]
#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

#[path = "../../aviary-runtime-kube/tests/bridge_envd/mod.rs"]
#[allow(dead_code)] // shared with the runtime's own tests
mod bridge_envd;
mod common;
#[path = "../../aviary-runtime-kube/tests/replay/mod.rs"]
#[allow(dead_code)] // shared with the runtime's own tests
mod replay;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{RuntimeName, SandboxState};
use base64::Engine as _;
use std::collections::BTreeMap;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_kubernetes_creates_a_pod_and_runs_commands_through_envd_in_it() {
    let replay = Arc::new(replay::Replay::start("server_create").await);
    let kube_dir = tempfile::tempdir().unwrap();
    let kubeconfig = replay::kubeconfig(kube_dir.path(), &replay.url());
    let port = bridge_envd::free_port();
    // envd "in the Pod": started once the runtime has sent the Secret,
    // with the secret in it
    let envd = {
        let replay = replay.clone();
        tokio::spawn(async move {
            let sent = replay
                .wait_for("POST", "/api/v1/namespaces/aviary/secrets")
                .await;
            let b64 = sent.body.unwrap()["data"]["bridge-secret"]
                .as_str()
                .unwrap()
                .to_owned();
            let secret = base64::engine::general_purpose::STANDARD
                .decode(&b64)
                .unwrap();
            let envd = bridge_envd::BridgeEnvd::start(port, std::str::from_utf8(&secret).unwrap());
            (envd, b64)
        })
    };
    let (ts, _dir) = common::start_edited(|cfg| {
        let s = &mut cfg.control.settings;
        s.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Kubernetes];
        for class in &mut s.classes {
            class.runtimes.push(RuntimeName::Kubernetes);
        }
        s.kubernetes = Some(aviary_config::KubernetesSettings {
            kubeconfig: Some(kubeconfig),
            context: None,
            namespace: "aviary".into(),
            deployment: "test".into(),
            runtime_class: Some("gvisor".into()),
            images: BTreeMap::from([(
                "busybox".to_owned(),
                format!("registry.example/aviary/busybox@sha256:{}", "1".repeat(64)),
            )]),
            run_as_user: 1000,
            ready_timeout_s: 30,
            delete_timeout_s: 30,
            envd_from: vec!["127.0.0.0/8".into()],
            envd_port: port,
            relay_dir: None,
        });
    })
    .await;
    let c = ts.client.clone();
    let created = c
        .create_sandbox(&CreateSandboxRequest {
            runtime: Some("kubernetes".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox;
    let (_envd, secret_base64) = envd.await.unwrap();
    assert_eq!(created.runtime, "kubernetes");
    assert_eq!(created.state, SandboxState::Idle);
    let id = created.id.to_string();
    // from now on the recorded pod list names the sandbox's pod
    replay.bind("listed", &id);
    let r = c
        .exec(&id, &common::shell("echo hello from the pod; exit 3"))
        .await
        .unwrap();
    assert_eq!(r.exit_code, 3);
    assert_eq!(r.stdout, "hello from the pod\n");

    // a restart: the new server's runtime has no relay; it reads the Pod
    // and the Secret back and makes one
    replay.bind("secret_base64", &secret_base64);
    let cfg = ts.server_cfg().clone();
    let mut ts = ts;
    ts.stop().await;
    let ts = common::start_cfg(cfg).await;
    let c = ts.client.clone();
    let r = c.exec(&id, &common::shell("echo again")).await.unwrap();
    assert_eq!(r.stdout, "again\n");
    let secret_reads = replay
        .requests()
        .iter()
        .filter(|r| {
            r.method == "GET" && r.path == format!("/api/v1/namespaces/aviary/secrets/{id}")
        })
        .count();
    assert_eq!(
        secret_reads, 1,
        "the secret was read back once, after the restart"
    );

    c.delete_sandbox(&id, None).await.unwrap();
    // delete answers first and reclaims the compute in the background
    ts.cp().reclaims.settled().await;
    // the policy, the Secret and the Pod were sent, then deleted (every
    // exchange used)
    replay.finish();
    let writes: Vec<(String, String)> = replay
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| (r.method.clone(), r.path.clone()))
        .collect();
    assert_eq!(
        writes,
        [
            (
                "POST",
                "/apis/networking.k8s.io/v1/namespaces/aviary/networkpolicies".to_owned()
            ),
            ("POST", "/api/v1/namespaces/aviary/secrets".to_owned()),
            ("POST", "/api/v1/namespaces/aviary/pods".to_owned()),
            ("DELETE", format!("/api/v1/namespaces/aviary/pods/{id}")),
            ("DELETE", format!("/api/v1/namespaces/aviary/secrets/{id}")),
            (
                "DELETE",
                format!("/apis/networking.k8s.io/v1/namespaces/aviary/networkpolicies/{id}")
            ),
        ]
        .map(|(m, p)| (m.to_owned(), p)),
        "{writes:?}"
    );
    for r in replay.requests() {
        assert_eq!(r.authorization.as_deref(), Some("Bearer replay-token"));
    }
    // the relay socket went with the sandbox
    let relays = ts
        .server_cfg()
        .runtime_state_dir_of(RuntimeName::Kubernetes);
    assert!(!relays.join(&id).exists(), "{}", relays.display());
    // the local runtime still serves
    let local = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox;
    assert_eq!(local.runtime, "crun");
    ts.cleanup().await;
}
