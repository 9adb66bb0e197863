//! Workspace projection through the real server (real crun, real envd): host
//! roots land in the sandbox at create; edits, deletions and changes made
//! inside the sandbox are reconciled on the next start; a root with a symlink
//! to /etc fails the start with 503 and projects nothing; a leased sandbox is
//! synced with the lease token.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::{CreateSandboxRequest, Event};
use aviary_core::ErrorCode;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

fn write(path: &Path, content: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

/// A host workspace: AGENTS.md, skills/ (one executable script), knowledge/.
fn host_workspace() -> tempfile::TempDir {
    let h = tempfile::tempdir().unwrap();
    write(&h.path().join("AGENTS.md"), "# agent v1\n");
    write(&h.path().join("skills/excel/SKILL.md"), "read excel\n");
    let run = h.path().join("skills/excel/run.sh");
    write(&run, "#!/bin/sh\necho ran\n");
    fs::set_permissions(&run, fs::Permissions::from_mode(0o755)).unwrap();
    write(&h.path().join("knowledge/notes/a.txt"), "fact a\n");
    h
}

/// A server projecting `h`'s three roots into /workspace, with its data dir
/// (kept until the test ends).
async fn server(h: &Path) -> (common::TestServer, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    cfg.control.settings.projections = [
        ("AGENTS.md", "/workspace/AGENTS.md"),
        ("skills", "/workspace/.agent/skills"),
        ("knowledge", "/workspace/knowledge"),
    ]
    .iter()
    .map(|(host, sandbox)| aviary_config::Projection {
        host: h.join(host),
        sandbox: (*sandbox).into(),
    })
    .collect();
    (common::start_cfg(cfg).await, dir)
}

fn session(s: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        session_id: Some(s.into()),
        ..Default::default()
    }
}

/// The sandbox's events of `kind`, oldest first.
async fn events(ts: &common::TestServer, id: &str, kind: &str) -> Vec<Event> {
    ts.client
        .events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.event_type == kind)
        .collect()
}

fn counts(e: &Event) -> (u64, u64, u64) {
    let n = |k: &str| e.metadata[k].as_u64().unwrap();
    (n("uploaded"), n("deleted"), n("skipped"))
}

async fn read(ts: &common::TestServer, id: &str, path: &str) -> String {
    String::from_utf8(ts.client.read_file(id, path).await.unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_land_at_create_and_follow_the_host_on_each_start() {
    let h = host_workspace();
    let (ts, _data) = server(h.path()).await;
    let c = &ts.client;

    let a = c.create_sandbox(&session("s")).await.unwrap();
    let id = a.sandbox.id.as_str();
    assert_eq!(read(&ts, id, "/workspace/AGENTS.md").await, "# agent v1\n");
    assert_eq!(
        read(&ts, id, "/workspace/.agent/skills/excel/SKILL.md").await,
        "read excel\n"
    );
    assert_eq!(
        read(&ts, id, "/workspace/knowledge/notes/a.txt").await,
        "fact a\n"
    );
    // the script keeps its execute bit and runs
    let out = c
        .exec(id, &common::shell("/workspace/.agent/skills/excel/run.sh"))
        .await
        .unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.as_str()),
        (0, "ran\n"),
        "{out:?}"
    );
    let synced = events(&ts, id, "projection_synced").await;
    assert_eq!(synced.len(), 1);
    assert_eq!(counts(&synced[0]), (4, 0, 0));

    // edit one host file, delete another, then start the same session again
    write(&h.path().join("skills/excel/SKILL.md"), "read excel v2\n");
    fs::remove_file(h.path().join("knowledge/notes/a.txt")).unwrap();
    let b = c.create_sandbox(&session("s")).await.unwrap();
    assert_eq!(b.sandbox.id, a.sandbox.id, "{:?}", b.decision);
    assert_eq!(
        read(&ts, id, "/workspace/.agent/skills/excel/SKILL.md").await,
        "read excel v2\n"
    );
    let gone = c
        .read_file(id, "/workspace/knowledge/notes/a.txt")
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Some(ErrorCode::NotFound), "{gone}");
    let synced = events(&ts, id, "projection_synced").await;
    assert_eq!(synced.len(), 2);
    assert_eq!(counts(&synced[1]), (1, 1, 2), "{}", synced[1].metadata);
    assert_eq!(synced[1].metadata["repaired"], 0);

    // the sandbox changes a projected file and removes another: the next
    // start puts the host's versions back, the untouched one is skipped
    c.exec(
        id,
        &common::shell(
            "echo evil > /workspace/AGENTS.md && rm /workspace/.agent/skills/excel/run.sh",
        ),
    )
    .await
    .unwrap();
    c.create_sandbox(&session("s")).await.unwrap();
    assert_eq!(read(&ts, id, "/workspace/AGENTS.md").await, "# agent v1\n");
    assert_eq!(
        read(&ts, id, "/workspace/.agent/skills/excel/run.sh").await,
        "#!/bin/sh\necho ran\n"
    );
    let synced = events(&ts, id, "projection_synced").await;
    assert_eq!(counts(&synced[2]), (2, 0, 1), "{}", synced[2].metadata);
    assert_eq!(synced[2].metadata["repaired"], 2);
    eprintln!(
        "projection sync times (ms): {:?}",
        synced
            .iter()
            .map(|e| e.metadata["duration_ms"].as_u64().unwrap())
            .collect::<Vec<_>>()
    );
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_with_a_symlink_to_etc_fails_the_start_and_projects_nothing() {
    let h = host_workspace();
    std::os::unix::fs::symlink("/etc", h.path().join("skills/etc")).unwrap();
    let (ts, _data) = server(h.path()).await;
    let c = &ts.client;

    let err = c.create_sandbox(&session("s")).await.unwrap_err();
    match &err {
        aviary_client::ClientError::Api {
            status,
            code,
            message,
        } => {
            assert_eq!((*status, *code), (503, ErrorCode::Unavailable), "{err}");
            assert!(
                message.starts_with("workspace projection failed:")
                    && message.contains("symlink leading outside the root"),
                "{message}"
            );
        }
        other => panic!("expected an API error, got {other}"),
    }
    // the failure is an event of the (now terminated) sandbox
    let all = c.events(None, None, Some(1000)).await.unwrap().events;
    let failed: Vec<_> = all
        .iter()
        .filter(|e| e.event_type == "projection_failed")
        .collect();
    assert_eq!(failed.len(), 1, "{all:?}");
    let error = failed[0].metadata["error"].as_str().unwrap();
    assert!(error.contains("skills/etc"), "{error}");
    assert!(!all.iter().any(|e| e.event_type == "projection_synced"));
    // nothing was left running, and no sandbox is live
    assert!(ts.cp().runtime().list().await.unwrap().is_empty());
    let listed = c.list_sandboxes(true).await.unwrap();
    assert!(
        listed.sandboxes.iter().all(|s| s.state.is_terminal()),
        "{:?}",
        listed.sandboxes
    );
    assert_eq!(ts.cp().live_count(), 0);

    // once the operator removes the link, starts work again and /etc stays out
    fs::remove_file(h.path().join("skills/etc")).unwrap();
    let ok = c.create_sandbox(&session("s2")).await.unwrap();
    let id = ok.sandbox.id.as_str();
    let ls = c.list_files(id, "/workspace/.agent/skills").await.unwrap();
    let names: Vec<_> = ls.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["excel"]);
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_sandbox_is_synced_with_the_lease_token() {
    let h = host_workspace();
    let (ts, _data) = server(h.path()).await;
    let c = &ts.client;
    let user = |s: &str| CreateSandboxRequest {
        user_id: Some("u1".into()),
        session_id: Some(s.into()),
        ..Default::default()
    };
    let a = c.create_sandbox(&user("s1")).await.unwrap();
    let id = a.sandbox.id.clone();
    let la = a.lease.clone().expect("user scope hands out under a lease");
    c.sandbox_action(id.as_str(), "release", Some(la.token))
        .await
        .unwrap();

    write(&h.path().join("AGENTS.md"), "# agent v2\n");
    let b = c.create_sandbox(&user("s2")).await.unwrap();
    assert_eq!(b.sandbox.id, id, "{:?}", b.decision);
    let lb = b.lease.clone().expect("reused under a new lease");
    // the sandbox's envd holds the fence: a tokenless write is refused…
    let refused = c
        .write_file(id.as_str(), "/workspace/x", b"x".to_vec(), None)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some(ErrorCode::LeaseRequired), "{refused}");
    // …yet the projection went through with the lease's token
    assert_eq!(
        read(&ts, id.as_str(), "/workspace/AGENTS.md").await,
        "# agent v2\n"
    );
    let synced = events(&ts, id.as_str(), "projection_synced").await;
    assert_eq!(synced.len(), 2);
    assert_eq!(counts(&synced[1]), (1, 0, 3), "{}", synced[1].metadata);
    c.sandbox_action(id.as_str(), "release", Some(lb.token))
        .await
        .unwrap();
    ts.cleanup().await;
}

/// The projection index lives in the registry: a server restarted on the
/// same data dir re-attaches the sandbox and its next start uploads nothing
/// that did not change (and still uploads what did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_upload_unchanged_projected_files_again() {
    let h = host_workspace();
    let (mut ts, data) = server(h.path()).await;
    let a = ts.client.create_sandbox(&session("r")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let synced = events(&ts, &id, "projection_synced").await;
    assert_eq!(counts(&synced[0]), (4, 0, 0));
    ts.stop().await;

    // the same configuration on the same data dir
    let mut cfg = common::config(&data.path().join("d"), "busybox");
    cfg.control.settings.projections = [
        ("AGENTS.md", "/workspace/AGENTS.md"),
        ("skills", "/workspace/.agent/skills"),
        ("knowledge", "/workspace/knowledge"),
    ]
    .iter()
    .map(|(host, sandbox)| aviary_config::Projection {
        host: h.path().join(host),
        sandbox: (*sandbox).into(),
    })
    .collect();
    let ts2 = common::start_cfg(cfg).await;
    let b = ts2.client.create_sandbox(&session("r")).await.unwrap();
    assert_eq!(b.sandbox.id.as_str(), id, "{:?}", b.decision);
    let synced = events(&ts2, &id, "projection_synced").await;
    assert_eq!(synced.len(), 2, "{synced:?}");
    assert_eq!(
        counts(&synced[1]),
        (0, 0, 4),
        "nothing unchanged is uploaded again after a restart: {:?}",
        synced[1].metadata
    );

    // a file changed on the host while the server was down is uploaded
    write(&h.path().join("AGENTS.md"), "# agent v2\n");
    let c2 = ts2.client.create_sandbox(&session("r")).await.unwrap();
    assert_eq!(c2.sandbox.id.as_str(), id);
    let synced = events(&ts2, &id, "projection_synced").await;
    assert_eq!(counts(&synced[2]), (1, 0, 3));
    assert_eq!(
        read(&ts2, &id, "/workspace/AGENTS.md").await,
        "# agent v2\n"
    );
    ts2.cleanup().await;
}
