//! Runtime `opensandbox` (`crates/aviary-runtime-remote`) against a live
//! OpenSandbox-compatible service: a second Aviary server started here,
//! reached only through its `/opensandbox` surface (lifecycle API with
//! `OPEN-SANDBOX-API-KEY`, execd at the endpoint of port 44772, envd's bridge
//! at the endpoint of its port) with a tenant key.
//!
//! - the runtime conformance checks that apply to a runtime whose
//!   sandboxes are not on this host (lifecycle, unknown ids, refusals,
//!   pause/resume, teardown), and fencing end to end through the relay and
//!   envd's bridge; the listing holds only this runtime's sandboxes;
//! - a server flow: a first server with a class on `opensandbox` creates a
//!   sandbox there, runs commands and moves files in it, and deleting it
//!   removes the provider's sandbox;
//! - the provider's refusals (bad key, down) as clear errors;
//! - a provider configured without pause: the control plane refuses a
//!   pause (`unsupported`) and the sandbox keeps running.
//!
//! Needs what every server test needs (crun, the static envd with the
//! bridge: `AVIARY_ENVD`, or scripts/build-envd.sh).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;
#[path = "common/remote.rs"]
mod remote;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{RuntimeName, SandboxId};
use aviary_envd_proto::{EnvdClient, ExecSpec};
use aviary_runtime::{Pausable, Runtime, RuntimeError, RuntimeStatus, TemplateRef};
use aviary_runtime_remote::opensandbox::OsbEndpoint;
use aviary_runtime_remote::{OpenSandboxRuntime, RemoteConfig, RemoteRuntime};
use remote::{provider, provider_sandboxes, spec_for, Provider};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

fn endpoint(p: &Provider, key: &str) -> OsbEndpoint {
    OsbEndpoint {
        url: format!("{}/opensandbox", p.ts.url()),
        api_key: key.into(),
        request_timeout: Duration::from_secs(60),
        ready_timeout: Duration::from_secs(120),
        // Aviary's surface has no egress sidecar (and refuses the field);
        // its sandboxes have no network anyway
        deny_egress: false,
    }
}

fn runtime(p: &Provider, state: &Path, key: &str) -> OpenSandboxRuntime {
    RemoteRuntime::opensandbox(
        RemoteConfig {
            name: "opensandbox".into(),
            state_dir: state.to_path_buf(),
            // the provider's image: an Aviary template name on its surface
            templates: BTreeMap::from([(p.digest.clone(), "busybox".to_owned())]),
            timeout_s: 600,
        },
        endpoint(p, key),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_opensandbox_runtime_passes_the_conformance_checks_that_apply() {
    let p = provider().await;
    let state = tempfile::tempdir().unwrap();
    let rt = runtime(&p, state.path(), &p.ts.key);
    remote::check_conformance(&rt, &p, state.path(), "opensandbox").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envd_in_an_opensandbox_sandbox_runs_commands_and_enforces_fences() {
    let p = provider().await;
    let state = tempfile::tempdir().unwrap();
    let rt = runtime(&p, state.path(), &p.ts.key);
    let spec = spec_for(&p.digest);
    let handle = rt.create(&spec).await.unwrap();
    assert_eq!(handle.runtime, "opensandbox");
    let remote_id = rt.remote_id(&spec.id).unwrap();
    assert_eq!(handle.runtime_instance_id, remote_id);

    // the provider's sandbox carries the labels the runtime lists by, and
    // was sized from the spec (resourceLimits → the provider's class)
    let at_provider = provider_sandboxes(&p).await;
    assert_eq!(at_provider.len(), 1);
    let theirs = &at_provider[0];
    assert_eq!(theirs.id.to_string(), remote_id);
    assert_eq!(
        theirs.metadata.get("aviary_sandbox").map(String::as_str),
        Some(spec.id.as_str())
    );
    assert_eq!(
        theirs.metadata.get("aviary_owner").map(String::as_str),
        Some(rt.owner())
    );

    // a sandbox at the provider that another Aviary made, even one naming
    // an id, is never this runtime's
    let foreign =
        p.ts.client
            .create_sandbox(&CreateSandboxRequest {
                metadata: BTreeMap::from([
                    (
                        "aviary_sandbox".to_owned(),
                        SandboxId::generate().to_string(),
                    ),
                    ("aviary_owner".to_owned(), "aviary-someone-else".to_owned()),
                ]),
                ..Default::default()
            })
            .await
            .unwrap()
            .sandbox;
    assert_eq!(rt.list().await.unwrap(), std::slice::from_ref(&spec.id));

    let ep = rt.envd_endpoint(&spec.id).await.unwrap();
    let envd = EnvdClient::new(&ep.socket).expect_peer_pid(ep.peer_pid);
    remote::check_envd_and_fence(&envd).await;

    // files survive a pause and resume of the provider's sandbox
    envd.write_file("/tmp/kept.txt", None, &mut &b"kept"[..], Some(7))
        .await
        .unwrap();
    rt.pause(&spec.id).await.unwrap();
    assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::Paused);
    rt.resume(&spec.id).await.unwrap();
    assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::Running);
    let out = envd
        .exec_collect(
            ExecSpec {
                argv: vec!["cat".into(), "/tmp/kept.txt".into()],
                ..Default::default()
            },
            Some(7),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, b"kept");

    // the secret was consumed; envd's files are not the sandbox's to read
    // through the upload's mode
    let listing = remote::inside_envd_dir(
        &envd,
        "ls /tmp/.aviary-envd; stat -c %a /tmp/.aviary-envd /tmp/.aviary-envd/envd",
    )
    .await;
    assert!(listing.contains("700\n755"), "{listing}");

    // a relay restarted from the record (a server restart) reaches the same envd
    let again = runtime(&p, state.path(), &p.ts.key);
    let ep2 = again.envd_endpoint(&spec.id).await.unwrap();
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
    let left: Vec<String> = provider_sandboxes(&p)
        .await
        .iter()
        .map(|s| s.id.to_string())
        .collect();
    assert_eq!(
        left,
        [foreign.id.to_string()],
        "only the foreign one is left"
    );
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
    assert!(provider_sandboxes(&p).await.is_empty());

    // an Aviary template nobody mapped is refused before the provider is asked
    let mut spec = spec_for(&p.digest);
    spec.template = TemplateRef {
        name: "unmapped".into(),
        digest: format!("sha256:{}", "1".repeat(64)),
    };
    let e = runtime(&p, state.path(), &p.ts.key)
        .create(&spec)
        .await
        .unwrap_err();
    assert!(matches!(e, RuntimeError::Unsupported { .. }), "{e:?}");
    assert!(e.to_string().contains("unmapped"), "{e}");

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

/// The configuration of a server whose class `remote` runs on runtime
/// `opensandbox` at `p`, with `key` in its key file.
fn config_on(p: &Provider, key: &str, dir: &Path) -> aviary_server::config::ServerConfig {
    config_with(p, key, dir, true)
}

/// [`config_on`], saying whether the provider pauses.
fn config_with(
    p: &Provider,
    key: &str,
    dir: &Path,
    pausable: bool,
) -> aviary_server::config::ServerConfig {
    let key_file = dir.join("osb.key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    remote::server_config(RuntimeName::Opensandbox, dir, |settings| {
        settings.remote_opensandbox = Some(aviary_config::RemoteOpenSandboxSettings {
            url: format!("{}/opensandbox", p.ts.url()),
            api_key_env: None,
            api_key_file: Some(key_file),
            templates: BTreeMap::from([("busybox".to_owned(), "busybox".to_owned())]),
            timeout_s: 600,
            request_timeout_s: 60,
            ready_timeout_s: 120,
            deny_egress: false,
            pausable,
        });
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_places_a_class_on_the_opensandbox_runtime() {
    let p = provider().await;
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let a = common::start_cfg(config_on(&p, &p.ts.key, dir.path())).await;
    remote::check_server_flow(&a, &p, "opensandbox").await;

    // a server holding a key the provider refuses does not start, and says why
    let dir_b = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let e = aviary_server::start(config_on(&p, "not-a-key", dir_b.path()), |_| {})
        .await
        .err()
        .expect("a server whose provider refuses its key must not start");
    let shown = format!("{e:#}");
    assert!(shown.contains("[remote_opensandbox]"), "{shown}");
    assert!(
        shown.contains("opensandbox: list sandboxes: the provider refused the API key (401)"),
        "{shown}"
    );
    assert!(
        !shown.contains("not-a-key"),
        "the key is never shown: {shown}"
    );
    assert!(provider_sandboxes(&p).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_without_pause_leaves_the_sandbox_running_and_says_so() {
    let p = provider().await;
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let a = common::start_cfg(config_with(&p, &p.ts.key, dir.path(), false)).await;
    let id = a
        .client
        .create_sandbox(&CreateSandboxRequest {
            class: Some("remote".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox
        .id
        .to_string();

    // the runtime has no pause: the control plane refuses, changing nothing
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/sandboxes/{id}/pause", a.url()))
        .bearer_auth(&a.key)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap();
    assert!(status.is_client_error(), "{status}: {body}");
    assert_eq!(body["error"]["code"], "unsupported", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("runtime opensandbox: it cannot pause"),
        "{message}"
    );
    assert!(!a.client.get_sandbox(&id).await.unwrap().paused);
    let theirs = provider_sandboxes(&p).await;
    assert_eq!(theirs.len(), 1);
    assert!(!theirs[0].paused, "the provider's sandbox was not paused");
    let r = a
        .client
        .exec(&id, &common::shell("echo still running"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "still running\n");

    a.client.delete_sandbox(&id, None).await.unwrap();
    a.cp().reclaims.settled().await;
    assert!(provider_sandboxes(&p).await.is_empty());
}
