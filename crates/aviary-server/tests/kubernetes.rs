//! The Kubernetes runtime wired into the server, against recorded API
//! exchanges (**not a live cluster**: the fixture is written from the
//! Kubernetes API reference; see `aviary-runtime-kube/tests/replay`).
//!
//! What works: a server configured with `[kubernetes]` starts, holds the
//! runtime in its `RuntimeSet` (without `Pausable`), its start-up and
//! reconciler passes list the deployment's Pods and policies, and a create
//! placed on `kubernetes` sends the policy and the Pod. What does not yet
//! (README, "Kubernetes runtime"): envd in the Pod is unreachable (no
//! transport to it), so the control plane's wait for envd fails and the
//! create fails cleanly: a 5xx, the sandbox `terminated`, its Pod and policy
//! deleted again. When the transport lands, this test must change with it.

#![cfg(feature = "kubernetes")]
#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;
#[path = "../../aviary-runtime-kube/tests/replay/mod.rs"]
#[allow(dead_code)] // shared with the runtime's own tests
mod replay;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{RuntimeName, SandboxState};
use std::collections::BTreeMap;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_kubernetes_creates_the_pod_and_removes_it_when_envd_is_unreachable() {
    let replay = replay::Replay::start("server_create_no_envd").await;
    let kube_dir = tempfile::tempdir().unwrap();
    let kubeconfig = replay::kubeconfig(kube_dir.path(), &replay.url());
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
        });
    })
    .await;
    let c = ts.client.clone();
    let e = c
        .create_sandbox(&CreateSandboxRequest {
            runtime: Some("kubernetes".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        e.code().is_some_and(|c| c.http_status() >= 500),
        "envd in a Pod is not reachable yet: {e}"
    );
    // the failed sandbox: on kubernetes, terminated
    let all = c.list_sandboxes(true).await.unwrap().sandboxes;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0].runtime, "kubernetes");
    assert_eq!(all[0].state, SandboxState::Terminated, "{all:?}");
    // the policy and the Pod were sent, then deleted (every exchange used)
    replay.finish();
    let writes: Vec<(String, String)> = replay
        .requests()
        .into_iter()
        .filter(|r| r.method != "GET")
        .map(|r| (r.method.clone(), r.path.clone()))
        .collect();
    let id = all[0].id.as_str();
    assert_eq!(
        writes,
        [
            (
                "POST",
                "/apis/networking.k8s.io/v1/namespaces/aviary/networkpolicies".to_owned()
            ),
            ("POST", "/api/v1/namespaces/aviary/pods".to_owned()),
            ("DELETE", format!("/api/v1/namespaces/aviary/pods/{id}")),
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
    // the local runtime still serves
    let local = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox;
    assert_eq!(local.runtime, "crun");
    ts.cleanup().await;
}
