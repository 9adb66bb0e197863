//! Runtime `e2b` (`crates/aviary-runtime-remote`) against a live
//! E2B-compatible service: a second Aviary server started here, reached
//! only through its `/e2b` surface (control API, envd, port proxy) with a
//! tenant key.
//!
//! - the runtime conformance checks that apply to a runtime whose
//!   sandboxes are not on this host (lifecycle, unknown ids, refusals,
//!   pause/resume), and fencing end to end through the relay and envd's
//!   bridge;
//! - a server flow: a first server with a class on `e2b` creates a sandbox
//!   there, runs commands and moves files in it, and destroying it removes
//!   the provider's sandbox;
//! - the provider's refusals (bad key, unknown template, down) as clear
//!   errors.
//!
//! Needs what every server test needs (crun, the static envd with the
//! bridge: `AVIARY_ENVD`, or scripts/build-envd.sh).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;
#[path = "common/remote.rs"]
mod remote;

use aviary_core::RuntimeName;
use aviary_envd_proto::EnvdClient;
use aviary_runtime::{Runtime, RuntimeError, RuntimeStatus};
use aviary_runtime_remote::e2b::E2bEndpoint;
use aviary_runtime_remote::{E2bRuntime, RemoteConfig, RemoteRuntime};
use remote::{provider, provider_sandboxes, spec_for, Provider};
use std::collections::BTreeMap;
use std::path::Path;

fn endpoint(p: &Provider, key: &str) -> E2bEndpoint {
    let base = p.ts.url();
    E2bEndpoint {
        api_url: format!("{base}/e2b"),
        sandbox_url: Some(format!("{base}/e2b/envd")),
        domain: "aviary.test".into(),
        port_url: Some(base),
        proxy_key: true,
        api_key: key.into(),
    }
}

fn runtime(p: &Provider, state: &Path, key: &str) -> E2bRuntime {
    RemoteRuntime::e2b(
        RemoteConfig {
            name: "e2b".into(),
            state_dir: state.to_path_buf(),
            templates: BTreeMap::from([(p.digest.clone(), "base".to_owned())]),
            timeout_s: 600,
        },
        endpoint(p, key),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_e2b_runtime_passes_the_conformance_checks_that_apply() {
    let p = provider().await;
    let state = tempfile::tempdir().unwrap();
    let rt = runtime(&p, state.path(), &p.ts.key);
    remote::check_conformance(&rt, &p, state.path(), "e2b").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envd_in_a_remote_sandbox_runs_commands_and_enforces_fences() {
    let p = provider().await;
    let state = tempfile::tempdir().unwrap();
    let rt = runtime(&p, state.path(), &p.ts.key);
    let spec = spec_for(&p.digest);
    let handle = rt.create(&spec).await.unwrap();
    assert_eq!(handle.runtime, "e2b");
    let remote_id = rt.remote_id(&spec.id).unwrap();
    assert_eq!(handle.runtime_instance_id, remote_id);

    let ep = rt.envd_endpoint(&spec.id).await.unwrap();
    let envd = EnvdClient::new(&ep.socket).expect_peer_pid(ep.peer_pid);
    remote::check_envd_and_fence(&envd).await;

    // code in the sandbox reaches envd's socket but may not move the fence
    remote::inside_envd_dir(
        &envd,
        "ls /tmp/.aviary-envd; test -e /tmp/.aviary-envd/secret && echo secret-left",
    )
    .await;

    // a relay restarted from the record (a server restart) reaches the same envd
    let again = runtime(&p, state.path(), &p.ts.key);
    let ep2 = again.envd_endpoint(&spec.id).await;
    // the first runtime still serves the socket; a second one binds it anew
    let ep2 = ep2.unwrap();
    let h2 = EnvdClient::new(&ep2.socket)
        .expect_peer_pid(ep2.peer_pid)
        .health()
        .await
        .unwrap();
    assert_eq!(h2.fence, Some(7), "the same envd, its fence kept");

    let usage = rt.usage(&spec.id).await.unwrap();
    assert!(usage.memory_current_bytes > 0, "{usage:?}");
    assert!(usage.pids_current >= 1, "{usage:?}");

    rt.destroy(&spec.id).await.unwrap();
    drop(again);
    assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);
    assert_eq!(provider_sandboxes(&p).await.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn provider_refusals_are_clear_runtime_errors() {
    let p = provider().await;
    let state = tempfile::tempdir().unwrap();

    // a key the provider does not know: 401 → unavailable, nothing left
    let rt = runtime(&p, state.path(), "not-a-key");
    let spec = spec_for(&p.digest);
    let e = rt.create(&spec).await.unwrap_err();
    assert!(matches!(e, RuntimeError::ProbeRuntime { .. }), "{e:?}");
    assert!(e.to_string().contains("refused the API key (401)"), "{e}");
    assert_eq!(e.code(), aviary_core::ErrorCode::Unavailable);
    assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);

    // a template the provider does not have
    let rt = RemoteRuntime::e2b(
        RemoteConfig {
            name: "e2b".into(),
            state_dir: state.path().to_path_buf(),
            templates: BTreeMap::from([(p.digest.clone(), "no-such-template".to_owned())]),
            timeout_s: 600,
        },
        endpoint(&p, &p.ts.key),
    )
    .unwrap();
    let e = rt.create(&spec_for(&p.digest)).await.unwrap_err();
    assert!(
        matches!(
            e,
            RuntimeError::InvalidSpec { .. } | RuntimeError::InvokeRuntime { .. }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("no-such-template"), "{e}");
    assert_eq!(provider_sandboxes(&p).await.len(), 0);

    // the provider down: unavailable
    let mut p = p;
    let rt = runtime(&p, state.path(), &p.ts.key);
    p.ts.stop().await;
    let e = rt.create(&spec_for(&p.digest)).await.unwrap_err();
    assert_eq!(e.code(), aviary_core::ErrorCode::Unavailable, "{e}");
    assert!(e.to_string().contains("unreachable"), "{e}");
    let e = rt.list().await.unwrap_err();
    assert_eq!(e.code(), aviary_core::ErrorCode::Unavailable, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_places_a_class_on_the_remote_runtime() {
    let p = provider().await;
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let key_file = dir.path().join("e2b.key");
    std::fs::write(&key_file, format!("{}\n", p.ts.key)).unwrap();

    let cfg = remote::server_config(RuntimeName::E2b, dir.path(), |settings| {
        settings.remote_e2b = Some(aviary_config::RemoteE2bSettings {
            api_url: format!("{}/e2b", p.ts.url()),
            sandbox_url: Some(format!("{}/e2b/envd", p.ts.url())),
            domain: "aviary.test".into(),
            port_url: Some(p.ts.url()),
            proxy_key: true,
            api_key_env: None,
            api_key_file: Some(key_file),
            templates: BTreeMap::from([("busybox".to_owned(), "base".to_owned())]),
            timeout_s: 600,
        });
    });
    let a = common::start_cfg(cfg).await;
    remote::check_server_flow(&a, &p, "e2b").await;
}
