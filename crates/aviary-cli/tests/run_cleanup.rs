//! `aviary run` as a user runs it (the real binary as a child process,
//! against a real server on 127.0.0.1:0 with real crun sandboxes): it exits
//! with the remote command's code, and once the background reclaims have
//! settled nothing of its sandboxes is left: no runtime sandbox, every row
//! terminated with its compute reclaimed.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_aviary");

fn envd() -> PathBuf {
    std::env::var_os("AVIARY_ENVD")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
            let out = Command::new(root.join("scripts/build-envd.sh"))
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_exits_with_the_remote_code_and_leaves_nothing() {
    let dir = tempfile::Builder::new()
        .prefix("avr")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = aviary_server::config::ServerConfig::new(dir.path().join("d"), envd());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.templates_dir = Some(
        std::env::var_os("AVIARY_TEST_TEMPLATE_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/tmp/aviary-test-templates")),
    );
    cfg.control.default_template = "busybox".into();
    cfg.control.default_template_source = aviary_server::config::DefaultTemplateSource::Busybox;
    let server = aviary_server::start(cfg, |_| {}).await.unwrap();
    assert_eq!(
        server.control_plane.wait_ready().await,
        aviary_server::ops::Readiness::Ready
    );
    let (url, key) = (server.url(), server.admin_key.clone());
    let run = |args: &'static [&'static str]| {
        let (url, key) = (url.clone(), key.clone());
        tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args(args)
                .env("AVIARY_URL", url)
                .env("AVIARY_API_KEY", key)
                .output()
                .unwrap()
        })
    };
    let o = run(&["run", "--", "sh", "-c", "echo out; echo err >&2; exit 7"])
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "out\n");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("err\n"),
        "{o:?}"
    );
    let o = run(&["run", "--", "true"]).await.unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = run(&["run", "--", "no-such-command"]).await.unwrap();
    assert_eq!(o.status.code(), Some(127), "{o:?}");

    server.control_plane.reclaims.settled().await;
    let left = server.control_plane.runtime().list().await.unwrap();
    assert!(left.is_empty(), "runtime sandboxes left: {left:?}");
    let client = aviary_client::Client::new(&url, &key);
    let all = client.list_sandboxes(true).await.unwrap().sandboxes;
    assert_eq!(all.len(), 3, "{all:?}");
    for s in &all {
        assert_eq!(s.state, aviary_core::SandboxState::Terminated, "{s:?}");
        let events = client
            .events(Some(s.id.as_str()), None, Some(100))
            .await
            .unwrap()
            .events;
        assert!(
            events.iter().any(|e| e.event_type == "compute_reclaimed"),
            "{:?}",
            events.iter().map(|e| &e.event_type).collect::<Vec<_>>()
        );
    }
    server.stop().await.unwrap();
}
