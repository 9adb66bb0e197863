//! The Docker runtime behind the real server: a server that serves crun and
//! docker side by side (`[server] runtimes`, `docker_socket` = the test's own
//! dockerd from `scripts/services.sh`, `AVIARY_DOCKER_HOST`); a create with
//! `runtime = "docker"` gets a container whose envd serves exec and files;
//! pause/resume; a snapshot forked into a second docker sandbox keeps both
//! layers; destroy leaves no container and no sandbox dir. Without dockerd
//! the test says why and returns; under `AVIARY_REQUIRE_SERVICES=1` it fails.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::RuntimeName;
use std::path::PathBuf;

fn docker_host() -> Option<PathBuf> {
    let found = std::env::var_os("AVIARY_DOCKER_HOST")
        .map(PathBuf::from)
        .filter(|p| p.exists());
    if found.is_none() {
        let why = "SKIPPED: AVIARY_DOCKER_HOST does not name a dockerd socket \
                   (scripts/services.sh start runs one)";
        assert!(
            std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("{why}");
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_docker_sandbox_serves_exec_files_pause_fork_and_leaves_nothing() {
    let Some(socket) = docker_host() else { return };
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let mut cfg = common::config(&data, "busybox");
    cfg.control.settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Docker];
    cfg.control.settings.server.docker_socket = socket.clone();
    let ts = common::start_cfg(cfg).await;
    let c = ts.client.clone();

    let on_docker = |c: aviary_client::Client| async move {
        c.create_sandbox(&CreateSandboxRequest {
            runtime: Some("docker".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox
    };
    let s = on_docker(c.clone()).await;
    assert_eq!(s.runtime, "docker");
    let id = s.id.to_string();
    assert!(data.join("sandboxes-docker").join(&id).is_dir());

    // exec through envd (PID 1 of the container)
    let out = c
        .exec(
            &id,
            &common::shell("echo hi; cat /proc/1/cmdline | tr '\\0' ' '; exit 3"),
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 3, "{out:?}");
    assert!(
        out.stdout.starts_with("hi\n/.aviary/envd --socket"),
        "{out:?}"
    );

    // files both ways
    c.write_file(
        &id,
        "/workspace/notes.txt",
        b"from the host\n".to_vec(),
        None,
    )
    .await
    .unwrap();
    let out = c
        .exec(
            &id,
            &common::shell("cat /workspace/notes.txt && echo inside > /etc/marker"),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "from the host\n");
    assert_eq!(c.read_file(&id, "/etc/marker").await.unwrap(), b"inside\n");

    // pause and resume (docker's freezer)
    let paused = c.sandbox_action(&id, "pause", None).await.unwrap();
    assert!(paused.paused, "{paused:?}");
    let resumed = c.sandbox_action(&id, "resume", None).await.unwrap();
    assert!(!resumed.paused, "{resumed:?}");
    let out = c.exec(&id, &common::shell("echo back")).await.unwrap();
    assert_eq!(out.stdout, "back\n");

    // snapshot + fork: the child, also on docker, has both layers
    c.snapshot(&id, None).await.unwrap();
    let child = c.fork(&id, None, None).await.unwrap().sandbox;
    assert_eq!(child.runtime, "docker");
    let out = c
        .exec(
            child.id.as_str(),
            &common::shell("cat /workspace/notes.txt /etc/marker"),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "from the host\ninside\n", "{out:?}");

    for sid in [id.as_str(), child.id.as_str()] {
        c.delete_sandbox(sid, None).await.unwrap();
    }
    // delete answers first and reclaims the compute in the background
    ts.cp().reclaims.settled().await;
    // nothing left: no container of this server, no sandbox dir
    let docker = ts
        .cp()
        .runtimes
        .get("docker")
        .expect("the docker runtime is served")
        .runtime
        .clone();
    assert_eq!(docker.list().await.unwrap(), vec![]);
    let left: Vec<_> = std::fs::read_dir(data.join("sandboxes-docker"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_str().is_some_and(|n| !n.starts_with('.')))
        .collect();
    assert!(left.is_empty(), "left in the state dir: {left:?}");
}
