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

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{NetworkProfile, ResourceLimits, RuntimeName, SandboxId};
use aviary_envd_proto::{EnvdClient, EnvdError, ExecSpec};
use aviary_runtime::conformance;
use aviary_runtime::{BindMount, Runtime, RuntimeError, RuntimeStatus, SandboxSpec, TemplateRef};
use aviary_runtime_remote::e2b::E2bEndpoint;
use aviary_runtime_remote::{E2bRuntime, RemoteConfig, RemoteRuntime};
use std::collections::BTreeMap;
use std::path::Path;

/// The provider: an Aviary server whose `/e2b` surface the runtime uses.
struct Provider {
    ts: common::TestServer,
    /// Its default template's digest (the template the runtime maps).
    digest: String,
}

async fn provider() -> Provider {
    let ts = common::start().await;
    let digest = ts
        .client
        .templates()
        .await
        .unwrap()
        .templates
        .into_iter()
        .find(|t| t.name == "busybox")
        .expect("the provider's default template")
        .digest;
    Provider { ts, digest }
}

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

fn spec_for(digest: &str) -> SandboxSpec {
    let envd = common::envd_binary();
    SandboxSpec {
        id: SandboxId::generate(),
        template: TemplateRef {
            name: "busybox".into(),
            digest: digest.into(),
        },
        resources: ResourceLimits::default(),
        network: NetworkProfile::None,
        egress: None,
        hostname: "sandbox".into(),
        init: vec!["/.aviary/envd".into(), "--listen-fd".into(), "3".into()],
        env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
        binds: vec![BindMount {
            host: envd,
            sandbox: "/.aviary/envd".into(),
            read_only: true,
        }],
    }
}

/// Sandboxes the provider still runs (its admin sees every tenant's).
async fn provider_sandboxes(p: &Provider) -> usize {
    p.ts.client
        .list_sandboxes(false)
        .await
        .unwrap()
        .sandboxes
        .into_iter()
        .filter(|s| !s.state.is_terminal())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_e2b_runtime_passes_the_conformance_checks_that_apply() {
    let p = provider().await;
    let state = tempfile::tempdir().unwrap();
    let rt = runtime(&p, state.path(), &p.ts.key);
    let make = || spec_for(&p.digest);

    conformance::check_unknown_ids(&rt).await;
    conformance::check_lifecycle_off_host(&rt, &make).await;
    conformance::check_refusals(&rt, &make).await;
    conformance::check_pause_resume(&rt, &make).await;
    // create/destroy cycles leave no host state behind (the runtime's state
    // dir holds its owner tag only)
    let dir = state.path().to_path_buf();
    let footprint = move || {
        conformance::Footprint::from([(
            "state entries".to_owned(),
            std::fs::read_dir(&dir).unwrap().count() as u64,
        )])
    };
    let (creates, destroys) = conformance::check_teardown(&rt, &make, 3, &footprint).await;
    eprintln!(
        "e2b runtime against a local Aviary: create median {:?}, destroy median {:?}",
        conformance::median(&creates),
        conformance::median(&destroys)
    );
    assert!(rt.list().await.unwrap().is_empty(), "nothing left listed");
    assert_eq!(
        provider_sandboxes(&p).await,
        0,
        "nothing left at the provider"
    );
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
    let health = envd.health().await.unwrap();
    assert!(!health.pid1, "envd runs as a daemon in the remote sandbox");
    let out = envd
        .exec_collect(
            ExecSpec {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    "echo remote; hostname >&2; exit 3".into(),
                ],
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(out.exit.exit_code, 3);
    assert_eq!(out.stdout, b"remote\n");

    // the fence moves through the bridge (the host), and envd holds it
    envd.set_fence(Some(7)).await.unwrap();
    let refused = envd
        .exec_collect(
            ExecSpec {
                argv: vec!["true".into()],
                ..Default::default()
            },
            None,
        )
        .await
        .unwrap_err();
    assert!(matches!(refused, EnvdError::LeaseRequired), "{refused:?}");
    let stale = envd
        .exec_collect(
            ExecSpec {
                argv: vec!["true".into()],
                ..Default::default()
            },
            Some(6),
        )
        .await
        .unwrap_err();
    assert!(matches!(stale, EnvdError::StaleToken), "{stale:?}");
    envd.write_file("/tmp/fenced.txt", None, &mut &b"ok"[..], Some(7))
        .await
        .unwrap();

    // code in the sandbox reaches envd's socket but may not move the fence
    let inside = envd
        .exec_collect(
            ExecSpec {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    "ls /tmp/.aviary-envd; test -e /tmp/.aviary-envd/secret && echo secret-left"
                        .into(),
                ],
                ..Default::default()
            },
            Some(7),
        )
        .await
        .unwrap();
    let listing = String::from_utf8_lossy(&inside.stdout).to_string();
    assert!(listing.contains("envd.sock"), "{listing}");
    assert!(
        !listing.contains("secret"),
        "the secret file is gone: {listing}"
    );

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
    assert_eq!(provider_sandboxes(&p).await, 0);
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
    assert_eq!(provider_sandboxes(&p).await, 0);

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

    let mut settings = aviary_config::Config::default();
    settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::E2b];
    let mut remote = settings
        .classes
        .iter()
        .find(|c| c.name == settings.server.default_class)
        .unwrap()
        .clone();
    remote.name = "remote".into();
    remote.runtimes = vec![RuntimeName::E2b];
    settings.classes.push(remote);
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
    let mut cfg =
        aviary_server::config::ServerConfig::from_settings(settings, common::envd_binary());
    let base = common::config(&dir.path().join("d"), "busybox");
    cfg.data_dir = base.data_dir;
    cfg.listen = base.listen;
    cfg.templates_dir = base.templates_dir;
    cfg.control.default_template = base.control.default_template;
    cfg.control.default_template_source = base.control.default_template_source;
    cfg.control.sweep_interval_ms = 100;
    let a = common::start_cfg(cfg).await;

    let created = a
        .client
        .create_sandbox(&CreateSandboxRequest {
            class: Some("remote".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let s = created.sandbox;
    assert_eq!(s.runtime, "e2b");
    let id = s.id.to_string();
    assert_eq!(provider_sandboxes(&p).await, 1, "the provider runs it");

    let r = a
        .client
        .exec(&id, &common::shell("echo hello from $(uname -s); exit 4"))
        .await
        .unwrap();
    assert_eq!(r.exit_code, 4);
    assert_eq!(r.stdout, "hello from Linux\n");
    a.client
        .write_file(&id, "/tmp/round.txt", b"round trip".to_vec(), None)
        .await
        .unwrap();
    let r = a
        .client
        .exec(&id, &common::shell("cat /tmp/round.txt | tr a-z A-Z"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "ROUND TRIP");
    assert_eq!(
        a.client.read_file(&id, "/tmp/round.txt").await.unwrap(),
        b"round trip"
    );

    a.client.delete_sandbox(&id, None).await.unwrap();
    // delete answers first and reclaims the compute in the background
    a.cp().reclaims.settled().await;
    assert_eq!(
        provider_sandboxes(&p).await,
        0,
        "destroy removed the provider's sandbox"
    );

    // a class on e2b with a template nobody mapped is refused, and leaves nothing
    let e = a
        .client
        .create_sandbox(&CreateSandboxRequest {
            class: Some("remote".into()),
            template: Some("busybox-unmapped".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(!e.to_string().is_empty());
    assert_eq!(provider_sandboxes(&p).await, 0);
}
