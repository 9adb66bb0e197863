//! Several local runtimes in one server (crun and runc side by side, real
//! binaries): each sandbox runs on the runtime its create or class asked
//! for, in that runtime's own state dir, with a user-id range no other
//! sandbox of either runtime holds; both survive a restart; a class that
//! does not offer the asked runtime is swapped for one that does (the
//! guard's clamping, with the reason); an unknown runtime is refused and
//! starts nothing.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::RuntimeName;

fn runc_present() -> bool {
    let found = std::process::Command::new("runc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        let why = "SKIPPED: runc is not installed (scripts/deps.sh installs it)";
        assert!(
            std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("{why}");
    }
    found
}

fn create_on(runtime: Option<&str>, class: Option<&str>) -> CreateSandboxRequest {
    CreateSandboxRequest {
        runtime: runtime.map(str::to_owned),
        class: class.map(str::to_owned),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crun_and_runc_serve_side_by_side_and_survive_a_restart() {
    if !runc_present() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let mut cfg = common::config(&data, "busybox");
    cfg.control.settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Runc];
    // a class that offers crun only
    let mut crun_only = cfg.control.settings.classes[0].clone();
    crun_only.name = "crun-only".into();
    crun_only.runtimes = vec![RuntimeName::Crun];
    cfg.control.settings.classes.push(crun_only);
    let mut ts = common::start_cfg(cfg.clone()).await;
    let c = ts.client.clone();

    let on_crun = c
        .create_sandbox(&create_on(None, None))
        .await
        .unwrap()
        .sandbox;
    let on_runc = c
        .create_sandbox(&create_on(Some("runc"), None))
        .await
        .unwrap()
        .sandbox;
    assert_eq!(on_crun.runtime, "crun", "the default");
    assert_eq!(on_runc.runtime, "runc", "asked for");
    assert!(data.join("sandboxes").join(on_crun.id.as_str()).is_dir());
    assert!(data
        .join("sandboxes-runc")
        .join(on_runc.id.as_str())
        .is_dir());
    let uid_map = |id: String| {
        let c = c.clone();
        async move {
            c.exec(&id, &common::shell("cat /proc/self/uid_map"))
                .await
                .unwrap()
                .stdout
        }
    };
    let (a, b) = (
        uid_map(on_crun.id.to_string()).await,
        uid_map(on_runc.id.to_string()).await,
    );
    assert_ne!(
        a, b,
        "one user-id range per sandbox across runtimes: {a} {b}"
    );

    // a class that does not offer the asked runtime: the guard substitutes
    // one that does (its usual clamping), and says so
    let swapped = c
        .create_sandbox(&create_on(Some("runc"), Some("crun-only")))
        .await
        .unwrap();
    assert_eq!(swapped.sandbox.runtime, "runc");
    assert_ne!(swapped.sandbox.resource_class, "crun-only");
    assert!(
        swapped.decision.reason.contains("crun-only"),
        "{}",
        swapped.decision.reason
    );
    c.delete_sandbox(swapped.sandbox.id.as_str(), None)
        .await
        .unwrap();
    // a runtime nobody knows is refused before anything starts
    let e = c
        .create_sandbox(&create_on(Some("kata"), None))
        .await
        .unwrap_err();
    assert!(
        e.code().is_some_and(|c| c.http_status() < 500),
        "a 4xx: {e}"
    );
    assert_eq!(c.list_sandboxes(false).await.unwrap().sandboxes.len(), 2);

    // a restart re-attaches both, each on its own runtime
    ts.stop().await;
    let ts2 = common::start_cfg(cfg).await;
    let c = ts2.client.clone();
    for (s, rt) in [(&on_crun, "crun"), (&on_runc, "runc")] {
        let got = c.get_sandbox(s.id.as_str()).await.unwrap();
        assert_eq!(got.runtime, rt);
        assert_eq!(got.state, aviary_core::SandboxState::Idle, "{got:?}");
        let out = c
            .exec(s.id.as_str(), &common::shell("echo alive"))
            .await
            .unwrap();
        assert_eq!(out.stdout, "alive\n");
    }
    for s in [&on_crun, &on_runc] {
        c.delete_sandbox(s.id.as_str(), None).await.unwrap();
    }
    ts2.cp().reclaims.settled().await;
    for state in ["sandboxes", "sandboxes-runc"] {
        let left: Vec<_> = std::fs::read_dir(data.join(state))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("sbx"))
            .collect();
        assert_eq!(left, Vec::<String>::new(), "nothing left in {state}");
    }
}
