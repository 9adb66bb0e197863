//! What the remote-runtime tests (`remote_e2b.rs`, `remote_opensandbox.rs`)
//! share: a provider (a second Aviary server whose compatible surface the
//! runtime drives), the spec of a sandbox placed there, the conformance
//! checks that apply to a runtime whose sandboxes are not on this host, and
//! the envd checks made through the runtime's relay.

use super::common;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
use aviary_envd_proto::{EnvdClient, EnvdError, ExecSpec};
use aviary_runtime::conformance;
use aviary_runtime::{BindMount, Pausable, SandboxSpec, TemplateRef};
use std::path::Path;

/// The provider: an Aviary server whose compatible surface the runtime uses.
pub struct Provider {
    pub ts: common::TestServer,
    /// Its default template's digest (the template the runtime maps).
    pub digest: String,
}

pub async fn provider() -> Provider {
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

/// A sandbox of the provider's template, envd bound in as the control plane does.
pub fn spec_for(digest: &str) -> SandboxSpec {
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
pub async fn provider_sandboxes(p: &Provider) -> Vec<aviary_core::api::Sandbox> {
    p.ts.client
        .list_sandboxes(false)
        .await
        .unwrap()
        .sandboxes
        .into_iter()
        .filter(|s| !s.state.is_terminal())
        .collect()
}

/// The runtime conformance checks that apply off host, then: nothing listed
/// and nothing left at the provider. `state` is the runtime's state dir
/// (it holds its owner tag only once create/destroy cycles are done).
pub async fn check_conformance<R: Pausable>(rt: &R, p: &Provider, state: &Path, label: &str) {
    let make = || spec_for(&p.digest);
    conformance::check_unknown_ids(rt).await;
    conformance::check_lifecycle_off_host(rt, &make).await;
    conformance::check_refusals(rt, &make).await;
    conformance::check_pause_resume(rt, &make).await;
    let dir = state.to_path_buf();
    let footprint = move || {
        conformance::Footprint::from([(
            "state entries".to_owned(),
            std::fs::read_dir(&dir).unwrap().count() as u64,
        )])
    };
    let (creates, destroys) = conformance::check_teardown(rt, &make, 3, &footprint).await;
    eprintln!(
        "{label} runtime against a local Aviary: create median {:?}, destroy median {:?}",
        conformance::median(&creates),
        conformance::median(&destroys)
    );
    assert!(rt.list().await.unwrap().is_empty(), "nothing left listed");
    assert!(
        provider_sandboxes(p).await.is_empty(),
        "nothing left at the provider"
    );
}

/// envd through the relay: a command's exit code and output, then the
/// fence moved through the bridge (only the host can) and held by envd:
/// no token and a stale one are refused, the current one writes.
pub async fn check_envd_and_fence(envd: &EnvdClient) {
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

    envd.set_fence(Some(7)).await.unwrap();
    let run_true = |fence| {
        envd.exec_collect(
            ExecSpec {
                argv: vec!["true".into()],
                ..Default::default()
            },
            fence,
        )
    };
    let refused = run_true(None).await.unwrap_err();
    assert!(matches!(refused, EnvdError::LeaseRequired), "{refused:?}");
    let stale = run_true(Some(6)).await.unwrap_err();
    assert!(matches!(stale, EnvdError::StaleToken), "{stale:?}");
    envd.write_file("/tmp/fenced.txt", None, &mut &b"ok"[..], Some(7))
        .await
        .unwrap();
}

/// What a process in the sandbox sees of envd's own dir (fence 7 held).
pub async fn inside_envd_dir(envd: &EnvdClient, script: &str) -> String {
    let inside = envd
        .exec_collect(
            ExecSpec {
                argv: vec!["sh".into(), "-c".into(), script.into()],
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
    listing
}

/// A server config whose class `remote` runs on `runtime` (beside the
/// default crun class), on this test's data dir; `provider` fills in the
/// runtime's `[remote_*]` table.
pub fn server_config(
    runtime: aviary_core::RuntimeName,
    dir: &Path,
    provider: impl FnOnce(&mut aviary_config::Config),
) -> aviary_server::config::ServerConfig {
    let mut settings = aviary_config::Config::default();
    settings.server.runtimes = vec![aviary_core::RuntimeName::Crun, runtime];
    let mut remote = settings
        .classes
        .iter()
        .find(|c| c.name == settings.server.default_class)
        .unwrap()
        .clone();
    remote.name = "remote".into();
    remote.runtimes = vec![runtime];
    settings.classes.push(remote);
    provider(&mut settings);
    let mut cfg =
        aviary_server::config::ServerConfig::from_settings(settings, common::envd_binary());
    let base = common::config(&dir.join("d"), "busybox");
    cfg.data_dir = base.data_dir;
    cfg.listen = base.listen;
    cfg.templates_dir = base.templates_dir;
    cfg.control.default_template = base.control.default_template;
    cfg.control.default_template_source = base.control.default_template_source;
    cfg.control.sweep_interval_ms = 100;
    cfg
}

/// Through server `a`, whose class `remote` runs on `runtime` at provider
/// `p`: a create lands at the provider (labelled with this server's id),
/// commands run with their exit code and output, a file makes a round trip,
/// the delete removes the provider's sandbox, and a template nobody mapped
/// is refused and leaves nothing.
pub async fn check_server_flow(a: &common::TestServer, p: &Provider, runtime: &str) {
    use aviary_core::api::CreateSandboxRequest;
    let created = a
        .client
        .create_sandbox(&CreateSandboxRequest {
            class: Some("remote".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let s = created.sandbox;
    assert_eq!(s.runtime, runtime);
    let id = s.id.to_string();
    let theirs = provider_sandboxes(p).await;
    assert_eq!(theirs.len(), 1, "the provider runs it");
    assert_eq!(
        theirs[0].metadata.get("aviary_sandbox"),
        Some(&id),
        "labelled with this server's id"
    );

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
    assert_eq!(r.exit_code, 0);
    assert_eq!(
        a.client.read_file(&id, "/tmp/round.txt").await.unwrap(),
        b"round trip"
    );

    a.client.delete_sandbox(&id, None).await.unwrap();
    // delete answers first and reclaims the compute in the background
    a.cp().reclaims.settled().await;
    assert!(
        provider_sandboxes(p).await.is_empty(),
        "destroy removed the provider's sandbox"
    );

    // a template nobody mapped is refused, and leaves nothing
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
    assert!(provider_sandboxes(p).await.is_empty());
}
