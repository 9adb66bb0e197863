//! The Kubernetes runtime wired into the server, against recorded API
//! exchanges (**not a live cluster**: the fixture is written from the
//! Kubernetes API reference; see `aviary-runtime-kube/tests/replay`).
//!
//! What works: a server configured with `[kubernetes]` starts, holds the
//! runtime in its `RuntimeSet`, and its start-up and reconciler passes list
//! the deployment's Pods and policies. What does not (README, "Kubernetes
//! runtime"): the control plane needs every local runtime to pause, and
//! Kubernetes cannot, so a create placed on `kubernetes` fails before any
//! Pod is sent — cleanly: a 5xx, the sandbox `terminated` with the reason in
//! its event, nothing created in the cluster. When that changes, this test
//! must change with it.

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
async fn a_server_with_kubernetes_lists_it_and_refuses_a_create_there_cleanly() {
    let replay = replay::Replay::start("server_lists").await;
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
        "the create cannot succeed on kubernetes yet: {e}"
    );
    // the failed sandbox: on kubernetes, terminated, the reason recorded
    let all = c.list_sandboxes(true).await.unwrap().sandboxes;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0].runtime, "kubernetes");
    assert_eq!(all[0].state, SandboxState::Terminated, "{all:?}");
    let events = c
        .events(Some(all[0].id.as_str()), None, Some(50))
        .await
        .unwrap();
    let text = serde_json::to_string(&events).unwrap();
    assert!(
        text.contains("local runtime kubernetes cannot pause"),
        "{text}"
    );
    // nothing reached the cluster but lists: no Pod, no policy
    replay.finish();
    for r in replay.requests() {
        assert_eq!(r.method, "GET", "{r:?}");
        assert!(r.query.contains_key("labelSelector"), "{r:?}");
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
