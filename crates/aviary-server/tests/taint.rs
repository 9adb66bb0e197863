//! What taints a sandbox, through the real server (real crun, real envd):
//! each cause a real sandbox can show is produced the real way — a stale
//! lease token, envd killed from the host, a snapshot the sandbox's own
//! files make fail, a restore from corrupted chunks, an OOM kill and a full
//! disk while shared, the operator's mark — and each ends with a `tainted`
//! event naming it and a scope whose next create does not get the sandbox
//! back. A dead sandbox is never handed out: with a snapshot it is restored
//! on new compute (branch C), without one the create goes cold (branch D);
//! either way the first exec works.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::Client;
use aviary_core::api::{CreateSandboxRequest, CreateSandboxResponse, ExecRequest};
use aviary_core::{ErrorCode, LeaseToken};

fn user(u: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        user_id: Some(u.into()),
        ..Default::default()
    }
}

fn shell_as(s: &str, token: Option<LeaseToken>) -> ExecRequest {
    ExecRequest {
        token,
        ..common::shell(s)
    }
}

/// The `tainted` events of a sandbox: (cause, detail).
async fn taints(c: &Client, id: &str) -> Vec<(String, String)> {
    c.events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.event_type == "tainted")
        .map(|e| {
            (
                e.metadata["cause"].as_str().unwrap_or("").to_owned(),
                e.metadata["detail"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// Asserts the sandbox is tainted with `cause` among its events.
async fn assert_tainted(c: &Client, id: &str, cause: &str) {
    let s = c.get_sandbox(id).await.unwrap();
    let t = taints(c, id).await;
    assert!(s.tainted, "{id} not tainted; events {t:?}");
    assert!(t.iter().any(|(k, _)| k == cause), "no {cause} taint: {t:?}");
}

/// Releases the caller's lease (if any) and asks again for the same user:
/// the tainted sandbox is not handed out; returns the new create.
async fn not_reused(c: &Client, first: &CreateSandboxResponse, u: &str) -> CreateSandboxResponse {
    let id = first.sandbox.id.as_str();
    // the holder ends its call (a lease it lost is fine: it is ended)
    let _ = c
        .sandbox_action(id, "release", first.lease.as_ref().map(|l| l.token))
        .await;
    let again = c.create_sandbox(&user(u)).await.unwrap();
    assert_ne!(again.sandbox.id.as_str(), id, "{:?}", again.decision);
    assert_eq!(again.decision.action, "new_sandbox", "{:?}", again.decision);
    again
}

/// Every process of the sandbox killed from the host (SIGKILL), envd
/// included: the way a sandbox's processes really die.
fn kill_from_host(id: &str) {
    let procs = std::fs::read_to_string(format!("/sys/fs/cgroup/pids/aviary/{id}/cgroup.procs"))
        .or_else(|_| std::fs::read_to_string(format!("/sys/fs/cgroup/aviary/{id}/cgroup.procs")))
        .unwrap();
    let pids: Vec<i32> = procs
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(!pids.is_empty(), "sandbox {id} has no processes");
    for pid in pids {
        // SAFETY-free: a plain kill(2) through the shell tool
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
}

/// A server with a class `tiny` (64 MiB of memory, a 40 MiB disk) besides
/// the built-in ones.
async fn tiny_server() -> (common::TestServer, tempfile::TempDir) {
    common::start_edited(|cfg| {
        let mut tiny = cfg.control.settings.classes[0].clone();
        tiny.name = "tiny".into();
        tiny.memory_mb = 64;
        tiny.disk_mb = 40;
        cfg.control.settings.classes.push(tiny);
    })
    .await
}

/// A server whose background envd probe and reconciler stay quiet for
/// the test's length: what finds a dead sandbox is the create's own probe.
async fn quiet_server() -> (common::TestServer, tempfile::TempDir) {
    common::start_edited(|cfg| {
        cfg.control.health_probe_interval_ms = 3_600_000;
        cfg.control.reconcile_interval_ms = 3_600_000;
    })
    .await
}

fn tiny_user(u: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        class: Some("tiny".into()),
        ..user(u)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_mark_through_the_api_and_the_reset_levels() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("op")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    assert!(!a.sandbox.tainted);

    // bad input changes nothing
    let http = reqwest::Client::new();
    let url = format!("{}/v1/sandboxes/{id}/taint", ts.url());
    for body in [
        serde_json::json!({}),
        serde_json::json!({"reason": ""}),
        serde_json::json!({"reason": "   "}),
        serde_json::json!({"reason": "x".repeat(513)}),
        serde_json::json!({"reason": "line\nbreak"}),
        serde_json::json!({"reason": "ok", "extra": 1}),
        serde_json::json!({"reason": 7}),
    ] {
        let r = http
            .post(&url)
            .bearer_auth(&ts.key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
    }
    assert!(!c.get_sandbox(&id).await.unwrap().tainted);
    assert!(taints(c, &id).await.is_empty());
    // another tenant never reaches it
    let k = c.create_key("tenant-b", false).await.unwrap().key;
    let other = Client::new(&ts.url(), &k);
    let e = other.taint(&id, "not yours").await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    let e = c
        .taint("sbx-aaaaaaaaaaaaaaaaaaaa", "ghost")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");

    // a clean checkpoint to come back to, then the mark (no lease needed)
    c.snapshot_labelled(&id, "clean", Some(token))
        .await
        .unwrap();
    let s = c.taint(&id, "operator saw odd traffic").await.unwrap();
    assert!(s.tainted);
    assert_eq!(
        taints(c, &id).await,
        vec![("operator".to_owned(), "operator saw odd traffic".to_owned())]
    );
    // level 1 keeps the mark
    let s = c.reset(&id, 1, Some(token)).await.unwrap();
    assert!(s.tainted, "level 1 does not clear the taint");
    let b = c.create_sandbox(&user("op")).await.unwrap();
    assert_ne!(b.sandbox.id.as_str(), id, "{:?}", b.decision);
    assert!(b.decision.reason.contains("tainted"), "{:?}", b.decision);
    // level 2 (new compute from the clean checkpoint) clears it
    let s = c.reset(&id, 2, None).await.unwrap();
    assert!(!s.tainted, "level 2 clears the taint");
    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    assert!(evs.iter().any(|e| e.event_type == "untainted"), "{evs:?}");
    let out = c.exec(&id, &common::shell("echo back")).await.unwrap();
    assert_eq!(out.stdout, "back\n");
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_lease_token_taints() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("stale")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let old = a.lease.as_ref().unwrap().token;
    c.sandbox_action(&id, "release", Some(old)).await.unwrap();
    assert!(
        !c.get_sandbox(&id).await.unwrap().tainted,
        "an honest release"
    );
    // a new holder; the old token is used against the sandbox
    let now = c.acquire_lease(&id, "second", None).await.unwrap();
    let e = c
        .exec(&id, &shell_as("echo late", Some(old)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::StaleToken), "{e}");
    assert_tainted(c, &id, "stale_token").await;
    c.release_lease(&id, now.token).await.unwrap();
    let again = c.create_sandbox(&user("stale")).await.unwrap();
    assert_ne!(again.sandbox.id.as_str(), id, "{:?}", again.decision);
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sandbox_without_a_snapshot_is_tainted_and_the_create_goes_cold() {
    let (ts, _dir) = quiet_server().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("dies")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    c.exec(&id, &shell_as("echo x > /workspace/x", Some(token)))
        .await
        .unwrap();
    c.sandbox_action(&id, "release", Some(token)).await.unwrap();
    kill_from_host(&id);

    let b = c.create_sandbox(&user("dies")).await.unwrap();
    assert_ne!(
        b.sandbox.id.as_str(),
        id,
        "a dead sandbox is never handed out"
    );
    assert_eq!(
        (b.decision.action.as_str(), b.decision.branch.as_str()),
        ("new_sandbox", "D"),
        "{:?}",
        b.decision
    );
    assert!(b.decision.reason.contains("found dead"), "{:?}", b.decision);
    let out = c
        .exec(
            b.sandbox.id.as_str(),
            &shell_as("echo first", b.lease.as_ref().map(|l| l.token)),
        )
        .await
        .unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "first\n"));
    let dead = c.get_sandbox(&id).await.unwrap();
    assert_eq!(dead.state, aviary_core::SandboxState::Lost);
    assert_tainted(c, &id, "envd_died").await;
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sandbox_with_a_snapshot_is_restored_on_new_compute() {
    let (ts, _dir) = quiet_server().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("phoenix")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    c.exec(&id, &shell_as("echo kept > /workspace/kept", Some(token)))
        .await
        .unwrap();
    c.snapshot_labelled(&id, "checkpoint", Some(token))
        .await
        .unwrap();
    c.sandbox_action(&id, "release", Some(token)).await.unwrap();
    kill_from_host(&id);

    let b = c.create_sandbox(&user("phoenix")).await.unwrap();
    assert_eq!(b.sandbox.id.as_str(), id, "{:?}", b.decision);
    assert_eq!(b.decision.branch, "C", "{:?}", b.decision);
    assert!(
        b.decision.reason.contains("envd was dead"),
        "{:?}",
        b.decision
    );
    assert!(!b.sandbox.tainted, "new compute from the snapshot");
    let out = c
        .exec(
            &id,
            &shell_as("cat /workspace/kept", b.lease.as_ref().map(|l| l.token)),
        )
        .await
        .unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "kept\n"));
    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    let kinds: Vec<&str> = evs.iter().map(|e| e.event_type.as_str()).collect();
    for k in [
        "sandbox_lost",
        "tainted",
        "recovering",
        "recovered",
        "restore_branch",
    ] {
        assert!(kinds.contains(&k), "no {k} event: {kinds:?}");
    }
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_the_sandbox_makes_fail_taints() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("snapfail")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    // a symlink whose target is not UTF-8: no snapshot can record it
    c.exec(
        &id,
        &shell_as("ln -s \"$(printf 'x\\377y')\" /workspace/odd", Some(token)),
    )
    .await
    .unwrap();
    c.snapshot_labelled(&id, "checkpoint", Some(token))
        .await
        .unwrap_err();
    assert_tainted(c, &id, "snapshot_failed").await;
    not_reused(c, &a, "snapfail").await;
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_from_corrupted_chunks_taints() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("rot")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    c.exec(
        &id,
        &shell_as("head -c 300000 /dev/urandom > /workspace/data", Some(token)),
    )
    .await
    .unwrap();
    c.sandbox_action(&id, "release", Some(token)).await.unwrap();
    c.sandbox_action(&id, "hibernate", None).await.unwrap();
    // every stored chunk rots
    let chunks = ts.data.join("snapshots/chunks");
    let mut rotted = 0;
    for entry in walk(&chunks) {
        let len = std::fs::metadata(&entry).unwrap().len() as usize;
        std::fs::write(&entry, vec![0x5a; len.max(1)]).unwrap();
        rotted += 1;
    }
    assert!(rotted > 0, "no chunk under {}", chunks.display());
    c.sandbox_action(&id, "wake", None).await.unwrap_err();
    assert_tainted(c, &id, "restore_failed").await;
    let again = c.create_sandbox(&user("rot")).await.unwrap();
    assert_ne!(again.sandbox.id.as_str(), id, "{:?}", again.decision);
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_dir_restore_from_corrupted_chunks_taints_and_the_create_goes_cold() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("wiped")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    c.exec(
        &id,
        &shell_as("head -c 300000 /dev/urandom > /workspace/data", Some(token)),
    )
    .await
    .unwrap();
    c.snapshot_labelled(&id, "checkpoint", Some(token))
        .await
        .unwrap();
    // the work dir is lost while the container lives (branch B), and the
    // snapshot's chunks rot
    c.exec(
        &id,
        &shell_as("rm -rf /workspace/* /workspace/.[!.]*; true", Some(token)),
    )
    .await
    .unwrap();
    c.sandbox_action(&id, "release", Some(token)).await.unwrap();
    for entry in walk(&ts.data.join("snapshots/chunks")) {
        let len = std::fs::metadata(&entry).unwrap().len() as usize;
        std::fs::write(&entry, vec![0x5a; len.max(1)]).unwrap();
    }
    let b = c.create_sandbox(&user("wiped")).await.unwrap();
    assert_ne!(b.sandbox.id.as_str(), id, "{:?}", b.decision);
    assert_eq!(b.decision.branch, "D", "{:?}", b.decision);
    assert!(
        b.decision.reason.contains("could not be restored"),
        "{:?}",
        b.decision
    );
    assert_tainted(c, &id, "restore_failed").await;
    // handed back: idle, not leased by the failed hand-out
    let s = c.get_sandbox(&id).await.unwrap();
    assert_eq!(s.state, aviary_core::SandboxState::Idle);
    let out = c
        .exec(
            b.sandbox.id.as_str(),
            &shell_as("echo fresh", b.lease.as_ref().map(|l| l.token)),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "fresh\n");
    ts.cleanup().await;
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_kill_while_shared_taints() {
    let (ts, _dir) = tiny_server().await;
    let c = &ts.client;
    let a = c.create_sandbox(&tiny_user("hog")).await.unwrap();
    assert_eq!(a.sandbox.resource_class, "tiny");
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    // one 200 MiB read buffer in a 64 MiB sandbox: the OOM killer ends it
    let out = c
        .exec(
            &id,
            &shell_as(
                "dd if=/dev/zero of=/dev/null bs=209715200 count=1",
                Some(token),
            ),
        )
        .await
        .unwrap();
    assert!(out.oom_killed, "{out:?}");
    assert_tainted(c, &id, "memory_limit").await;
    not_reused(c, &a, "hog").await;
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_while_shared_taints() {
    let (ts, _dir) = tiny_server().await;
    let c = &ts.client;
    let a = c.create_sandbox(&tiny_user("filler")).await.unwrap();
    let id = a.sandbox.id.to_string();
    let token = a.lease.as_ref().unwrap().token;
    // a small write leaves it clean
    c.exec(&id, &shell_as("echo small > /workspace/s", Some(token)))
        .await
        .unwrap();
    assert!(!c.get_sandbox(&id).await.unwrap().tainted);
    let out = c
        .exec(
            &id,
            &shell_as("dd if=/dev/zero of=/workspace/fill bs=1M 2>&1", Some(token)),
        )
        .await
        .unwrap();
    assert_ne!(out.exit_code, 0, "{out:?}");
    assert!(out.stdout.contains("No space left"), "{out:?}");
    assert_tainted(c, &id, "disk_limit").await;
    not_reused(c, &a, "filler").await;
    ts.cleanup().await;
}
