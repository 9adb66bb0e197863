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
