//! A sandbox's live resource usage, end to end through the real server and
//! a real crun sandbox: memory that a process allocates shows, a started
//! process is counted, CPU time grows with work, the limits are the
//! class's; other tenants, unknown ids, a paused, a hibernated and a
//! deleted sandbox get their documented answers.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::Client;
use aviary_core::api::{CreateSandboxRequest, SandboxUsage};
use aviary_core::ErrorCode;
use common::shell;
use std::time::Duration;

const MIB: u64 = 1024 * 1024;

fn code(e: aviary_client::ClientError) -> Option<ErrorCode> {
    e.code()
}

/// Reads usage until `done` holds (at most ~10 s of reads); the last read.
async fn usage_until(c: &Client, id: &str, done: impl Fn(&SandboxUsage) -> bool) -> SandboxUsage {
    let mut u = c.sandbox_usage(id).await.unwrap();
    for _ in 0..200 {
        if done(&u) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        u = c.sandbox_usage(id).await.unwrap();
    }
    u
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn usage_shows_memory_processes_and_cpu_of_a_running_sandbox() {
    let ts = common::start().await;
    let c = &ts.client;
    let created = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox;
    let id = created.id.to_string();

    // at rest: envd runs, something is charged, the limits are the class's
    let base = c.sandbox_usage(&id).await.unwrap();
    assert_eq!(base.sandbox_id, created.id);
    assert_eq!((base.state, base.paused), (created.state, false));
    assert!(base.memory_bytes > 0, "{base:?}");
    assert!(base.memory_peak_bytes >= base.memory_bytes, "{base:?}");
    assert!(base.pids >= 1, "{base:?}");
    assert_eq!(base.memory_limit_bytes, created.resources.memory_mb * MIB);
    assert_eq!(base.pids_limit, u64::from(created.resources.pids));
    assert_eq!(base.cpu_limit, created.resources.cpu);
    assert_eq!(base.disk_limit_bytes, created.resources.disk_mb * MIB);
    assert_eq!(base.oom_kills, 0);
    // what the runtime knows of the disk, consistently
    assert_eq!(
        base.disk_used_bytes,
        base.disk_free_bytes
            .map(|f| base.disk_limit_bytes.saturating_sub(f))
    );

    // ~64 MiB allocated and touched by a process that stays: dd fills one
    // 64 MiB block from /dev/zero, then blocks writing it into a pipe no
    // one reads
    c.start_background(
        &id,
        &shell("dd if=/dev/zero bs=64M count=1 2>/dev/null | sleep 600"),
    )
    .await
    .unwrap();
    let grown = usage_until(c, &id, |u| u.memory_bytes >= base.memory_bytes + 48 * MIB).await;
    assert!(
        grown.memory_bytes >= base.memory_bytes + 48 * MIB,
        "memory did not grow by the allocation: {base:?} then {grown:?}"
    );
    assert!(grown.memory_peak_bytes >= grown.memory_bytes, "{grown:?}");
    assert!(grown.sampled_at >= base.sampled_at);

    // a process started in the background is counted
    let before = usage_until(c, &id, |u| u.pids >= base.pids + 2).await.pids;
    let sleeper = c
        .start_background(&id, &shell("exec sleep 777"))
        .await
        .unwrap();
    let counted = usage_until(c, &id, |u| u.pids > before).await;
    assert!(counted.pids > before, "{before} then {counted:?}");
    // and its end too
    c.signal_process(&id, sleeper.pid, Some("KILL"), None)
        .await
        .unwrap();
    let ended = usage_until(c, &id, |u| u.pids < counted.pids).await;
    assert!(ended.pids < counted.pids, "{counted:?} then {ended:?}");

    // CPU time grows with work
    let cpu_before = c.sandbox_usage(&id).await.unwrap().cpu_seconds;
    let r = c
        .exec(
            &id,
            &shell("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo $i"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "300000");
    let cpu_after = c.sandbox_usage(&id).await.unwrap().cpu_seconds;
    assert!(cpu_after > cpu_before, "{cpu_before} then {cpu_after}");

    // another tenant: not found; an admin across tenants: found
    let other = c.create_key("usage-other", false).await.unwrap();
    let oc = Client::new(&ts.url(), &other.key);
    assert_eq!(
        code(oc.sandbox_usage(&id).await.unwrap_err()),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code(oc.sandbox_usage_any_tenant(&id).await.unwrap_err()),
        Some(ErrorCode::Forbidden)
    );
    let theirs = common::new_sandbox(&oc).await;
    assert_eq!(
        code(c.sandbox_usage(&theirs).await.unwrap_err()),
        Some(ErrorCode::NotFound),
        "the admin's own tenant does not hold it"
    );
    let across = c.sandbox_usage_any_tenant(&theirs).await.unwrap();
    assert_eq!(across.sandbox_id.as_str(), theirs);
    assert!(across.memory_bytes > 0, "{across:?}");
    // unknown and malformed ids, unknown query parameters
    for bad in ["sbx-doesnotexist", "not-an-id"] {
        assert_eq!(
            code(c.sandbox_usage(bad).await.unwrap_err()),
            Some(ErrorCode::NotFound),
            "{bad}"
        );
    }
    let raw = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/usage?everything=1", ts.url()))
        .bearer_auth(&ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);

    // paused: the frozen cgroup still has its counters, and says so
    c.sandbox_action(&id, "pause", None).await.unwrap();
    let paused = c.sandbox_usage(&id).await.unwrap();
    assert!(paused.paused, "{paused:?}");
    assert!(
        paused.memory_bytes >= base.memory_bytes + 48 * MIB,
        "the paused allocation is still charged: {paused:?}"
    );
    c.sandbox_action(&id, "resume", None).await.unwrap();
    assert!(!c.sandbox_usage(&id).await.unwrap().paused);

    // deleted: no compute any more (409 invalid_state)
    c.delete_sandbox(&id, None).await.unwrap();
    let e = c.sandbox_usage(&id).await.unwrap_err();
    assert_eq!(code(e), Some(ErrorCode::InvalidState));
    ts.cp().reclaims.settled().await;
    assert_eq!(
        code(c.sandbox_usage(&id).await.unwrap_err()),
        Some(ErrorCode::InvalidState)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hibernated_sandbox_has_no_usage_until_it_wakes() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    assert!(c.sandbox_usage(&id).await.unwrap().memory_bytes > 0);
    c.sandbox_action(&id, "hibernate", None).await.unwrap();
    let e = c.sandbox_usage(&id).await.unwrap_err();
    assert_eq!(code(e), Some(ErrorCode::InvalidState));
    c.sandbox_action(&id, "wake", None).await.unwrap();
    let u = c.sandbox_usage(&id).await.unwrap();
    assert!(u.state.is_live() && u.memory_bytes > 0, "{u:?}");
}
