//! Pause/resume, level-1 reset, release and the manifest, checked both
//! through the API and by looking at the host (cgroups, processes).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{ErrorCode, SandboxState};
use common::shell;

fn cgroup_procs(id: &str) -> Vec<String> {
    std::fs::read_to_string(format!("/sys/fs/cgroup/pids/aviary/{id}/cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_freezes_and_resume_thaws() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    c.exec(&id, &shell("sleep 1000 >/dev/null 2>&1 &"))
        .await
        .unwrap();
    c.sandbox_action(&id, "pause", None).await.unwrap();
    let state =
        std::fs::read_to_string(format!("/sys/fs/cgroup/freezer/aviary/{id}/freezer.state"))
            .unwrap();
    assert_eq!(state.trim(), "FROZEN");
    let e = c.exec(&id, &shell("true")).await.unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidState), "{e}");
    assert_eq!(
        c.sandbox_action(&id, "pause", None)
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::InvalidState)
    );
    c.sandbox_action(&id, "resume", None).await.unwrap();
    let state =
        std::fs::read_to_string(format!("/sys/fs/cgroup/freezer/aviary/{id}/freezer.state"))
            .unwrap();
    assert_eq!(state.trim(), "THAWED");
    assert_eq!(
        c.exec(&id, &shell("echo back")).await.unwrap().stdout,
        "back\n"
    );
    assert_eq!(
        c.sandbox_action(&id, "resume", None)
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::InvalidState)
    );
    let evs = c.events(Some(&id), None, None).await.unwrap().events;
    assert!(
        evs.iter().any(|e| e.event_type == "paused")
            && evs.iter().any(|e| e.event_type == "resumed")
    );
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_reset_kills_processes_clears_tmp_keeps_workspace() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let r = c
        .exec(&id, &shell("sleep 1000 >/dev/null 2>&1 & (httpd -f -p 8080 -h /tmp >/dev/null 2>&1 &); echo junk > /tmp/junk; echo data > /workspace/keep; sleep 0.3; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | grep -c ' 0A '"))
        .await
        .unwrap();
    assert_eq!(
        r.stdout.trim(),
        "1",
        "a port listens before the reset: {r:?}"
    );
    assert!(cgroup_procs(&id).len() >= 3, "{:?}", cgroup_procs(&id));
    let lease = c.acquire_lease(&id, "agent", None).await.unwrap();
    // reset is fenced like any write
    assert_eq!(
        c.sandbox_action(&id, "reset", None)
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::LeaseRequired)
    );
    let s = c
        .sandbox_action(&id, "reset", Some(lease.token))
        .await
        .unwrap();
    assert_eq!(s.state, SandboxState::Idle);
    assert!(s.lease_owner.is_none());

    // from the host: only envd is left in the sandbox's cgroup
    assert_eq!(cgroup_procs(&id).len(), 1, "{:?}", cgroup_procs(&id));
    // from inside: no listener, /tmp empty, the workspace kept
    let r = c
        .exec(
            &id,
            &shell("cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | grep -c ' 0A '; ls -A /tmp | wc -l; cat /workspace/keep"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "0\n0\ndata\n", "{r:?}");
    // the revoked lease's token is stale now
    let mut stale = shell("true");
    stale.token = Some(lease.token);
    assert_eq!(
        c.exec(&id, &stale).await.unwrap_err().code(),
        Some(ErrorCode::StaleToken)
    );
    let evs = c.events(Some(&id), None, None).await.unwrap().events;
    assert!(evs
        .iter()
        .any(|e| e.event_type == "reset" && e.new_state == Some(SandboxState::Sanitizing)));
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_ends_a_call_and_records_the_manifest() {
    let ts = common::start().await;
    let c = &ts.client;
    let created = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap();
    let id = created.sandbox.id.to_string();
    let lease = c.acquire_lease(&id, "agent", None).await.unwrap();
    let mut w = shell("mkdir -p /etc/app && echo x > /etc/app/conf && echo y > /workspace/out");
    w.token = Some(lease.token);
    c.exec(&id, &w).await.unwrap();
    assert_eq!(
        c.sandbox_action(&id, "release", None)
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::LeaseRequired)
    );
    let s = c
        .sandbox_action(&id, "release", Some(lease.token))
        .await
        .unwrap();
    assert_eq!(s.state, SandboxState::Idle);
    let m = c.manifest(&id, false).await.unwrap();
    assert_eq!(
        m["base_template_digest"],
        created.sandbox.template_digest.as_str()
    );
    let dirty: Vec<String> = serde_json::from_value(m["dirty_paths"].clone()).unwrap();
    assert!(dirty.iter().any(|p| p.starts_with("/etc/app")), "{dirty:?}");
    c.delete_sandbox(&id, None).await.unwrap();
    // the stored manifest outlives the sandbox
    let m = c.manifest(&id, false).await.unwrap();
    assert_eq!(
        m["base_template_digest"],
        created.sandbox.template_digest.as_str()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn level_two_returns_to_the_clean_checkpoint_and_level_three_destroys() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    c.exec(
        &id,
        &shell("echo base > /workspace/base; echo base > /etc/base"),
    )
    .await
    .unwrap();
    assert_eq!(
        c.reset(&id, 2, None).await.unwrap_err().code(),
        Some(ErrorCode::InvalidState),
        "no checkpoint yet"
    );
    c.snapshot_labelled(&id, "clean", None).await.unwrap();
    c.exec(&id, &shell("echo junk > /workspace/junk; echo junk > /etc/junk; rm /workspace/base; sleep 1000 >/dev/null 2>&1 &")).await.unwrap();
    let s = c.reset(&id, 2, None).await.unwrap();
    assert_eq!(s.state, SandboxState::Idle);
    let r = c
        .exec(
            &id,
            &shell("cat /workspace/base /etc/base; ls /workspace/junk /etc/junk 2>&1 | wc -l"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "base\nbase\n2\n", "{r:?}");
    // fresh compute: only envd runs
    assert_eq!(cgroup_procs(&id).len(), 1, "{:?}", cgroup_procs(&id));
    assert_eq!(
        c.reset(&id, 7, None).await.unwrap_err().code(),
        Some(ErrorCode::InvalidRequest)
    );

    // level 3: destroyed, nothing left on the host
    let gone = c.reset(&id, 3, None).await.unwrap();
    assert_eq!(gone.state, SandboxState::Terminated);
    // answered first; the compute goes in the background
    ts.cp().reclaims.settled().await;
    assert!(!ts.server_cfg().runtime_state_dir().join(&id).exists());
    assert!(!std::path::Path::new(&format!("/sys/fs/cgroup/pids/aviary/{id}")).exists());
    assert!(!std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .contains(&id));
}

/// Issue 13, bug 1: every operation on a paused sandbox answers at once
/// (it works, or is refused with `invalid_state`), and none leaves it stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_on_a_paused_sandbox_answers_at_once() {
    let ts = common::start().await;
    let c = &ts.client;
    let t = std::time::Duration::from_secs(15);
    let id = common::new_sandbox(c).await;
    let paused = c.sandbox_action(&id, "pause", None).await.unwrap();
    assert!(paused.paused, "{paused:?}");
    assert!(
        c.get_sandbox(&id).await.unwrap().paused,
        "get shows it paused"
    );
    let listed = c.list_sandboxes(false).await.unwrap().sandboxes;
    assert!(
        listed.iter().any(|s| s.id.as_str() == id && s.paused),
        "ls shows it"
    );
    // a lease on a paused sandbox: granted at once, the sandbox stays paused
    let lease = tokio::time::timeout(t, c.acquire_lease(&id, "agent", Some(60)))
        .await
        .expect("lease acquire answers")
        .unwrap();
    let events = c.events(Some(&id), None, Some(100)).await.unwrap().events;
    assert!(
        events.iter().any(|e| e.event_type == "lease_acquired"),
        "{events:?}"
    );
    // exec on a frozen sandbox is refused, not hung
    let mut exec = common::shell("true");
    exec.token = Some(lease.token);
    let e = tokio::time::timeout(t, c.exec(&id, &exec))
        .await
        .expect("exec answers")
        .unwrap_err();
    assert_eq!(e.code(), Some(aviary_core::ErrorCode::InvalidState), "{e}");
    // release and acquire again while paused: both answer
    tokio::time::timeout(t, c.release_lease(&id, lease.token))
        .await
        .expect("release answers")
        .unwrap();
    let again = tokio::time::timeout(t, c.acquire_lease(&id, "agent-2", Some(60)))
        .await
        .expect("acquire answers")
        .unwrap();
    // resume with the lease, then the holder works
    assert!(c.get_sandbox(&id).await.unwrap().paused, "still paused");
    let resumed = tokio::time::timeout(t, c.sandbox_action(&id, "resume", Some(again.token)))
        .await
        .expect("resume answers")
        .unwrap();
    assert!(!resumed.paused);
    assert!(!c.get_sandbox(&id).await.unwrap().paused);
    let mut exec = common::shell("echo thawed");
    exec.token = Some(again.token);
    assert_eq!(c.exec(&id, &exec).await.unwrap().stdout, "thawed\n");
    // paused again: a level-3 reset and a delete both answer
    c.sandbox_action(&id, "pause", Some(again.token))
        .await
        .unwrap();
    tokio::time::timeout(t, c.delete_sandbox(&id, Some(again.token)))
        .await
        .expect("delete answers")
        .unwrap();
    let other = common::new_sandbox(c).await;
    c.sandbox_action(&other, "pause", None).await.unwrap();
    tokio::time::timeout(t, c.reset(&other, 3, None))
        .await
        .expect("reset answers")
        .unwrap();
}
