//! Destroy off the request path (issue 12), with real crun: a delete is
//! answered with the sandbox terminated while its compute is still being
//! reclaimed; the reclaim then leaves nothing; and a server that stops
//! (a crash, for the sandbox) between the answer and the reclaim has the
//! leftovers destroyed by the next start's reconciliation.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::SandboxState;
use std::path::Path;

/// Whether the runtime still has anything of `id`: its dir in the state
/// dir, a mount under it, a cgroup dir of it.
fn traces_of(state_dir: &Path, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    let dir = state_dir.join(id);
    if dir.exists() {
        out.push(format!("dir {}", dir.display()));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for line in mounts.lines().filter(|l| l.contains(id)) {
        out.push(format!("mount {line}"));
    }
    if let Ok(ctrls) = std::fs::read_dir("/sys/fs/cgroup") {
        for c in ctrls.flatten() {
            let cg = c.path().join("aviary").join(id);
            if cg.exists() {
                out.push(format!("cgroup {}", cg.display()));
            }
        }
    }
    out
}

async fn event_types(c: &aviary_client::Client, id: &str) -> Vec<(String, serde_json::Value)> {
    c.events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events
        .into_iter()
        .map(|e| (e.event_type, e.metadata))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_answers_before_the_compute_is_reclaimed_and_the_reclaim_leaves_nothing() {
    let ts = common::start().await;
    let c = &ts.client;
    let state_dir = ts.server_cfg().runtime_state_dir();
    let s = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox;
    let id = s.id.to_string();
    let r = c
        .exec(&id, &common::shell("sleep 100 & echo started"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "started\n");

    let hold = ts.cp().reclaims.hold().await;
    let gone = c.delete_sandbox(&id, None).await.unwrap();
    assert_eq!(gone.state, SandboxState::Terminated);
    // answered while the compute is still there, and out of reach already
    assert!(
        !traces_of(&state_dir, &id).is_empty(),
        "the compute went before the answer"
    );
    assert_eq!(ts.cp().reclaims.in_flight(), 1);
    c.exec(&id, &common::shell("true")).await.unwrap_err();
    let events = event_types(c, &id).await;
    let (_, meta) = events
        .iter()
        .rev()
        .find(|(t, m)| t == "state_changed" && m["compute"] == "reclaiming")
        .expect("the terminated transition says the compute is being reclaimed");
    assert_eq!(meta["reason"], "deleted");

    drop(hold);
    ts.cp().reclaims.settled().await;
    assert_eq!(traces_of(&state_dir, &id), Vec::<String>::new());
    let listed = ts.cp().runtime().list().await.unwrap();
    assert!(!listed.iter().any(|l| l.as_str() == id), "{listed:?}");
    let events = event_types(c, &id).await;
    assert!(
        events.iter().any(|(t, _)| t == "compute_reclaimed"),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_between_the_answer_and_the_reclaim_is_healed_by_the_next_start() {
    let mut ts = common::start().await;
    let data = ts.data.clone();
    let state_dir = ts.server_cfg().runtime_state_dir();
    let id = common::new_sandbox(&ts.client).await;
    // reclaims never run on this server: it stops with one pending
    let _hold = ts.cp().reclaims.hold().await;
    let gone = ts.client.delete_sandbox(&id, None).await.unwrap();
    assert_eq!(gone.state, SandboxState::Terminated);
    ts.stop().await;
    assert!(
        !traces_of(&state_dir, &id).is_empty(),
        "the compute went before the stop"
    );

    let ts2 = common::start_on(&data, "busybox").await;
    assert_eq!(traces_of(&state_dir, &id), Vec::<String>::new());
    let listed = ts2.cp().runtime().list().await.unwrap();
    assert!(listed.is_empty(), "left over after the restart: {listed:?}");
    let s = ts2.client.get_sandbox(&id).await.unwrap();
    assert_eq!(s.state, SandboxState::Terminated);
    let events = event_types(&ts2.client, &id).await;
    let (_, meta) = events
        .iter()
        .find(|(t, _)| t == "compute_reclaimed")
        .expect("start-up records the reclaim");
    assert_eq!(meta["by"], "start-up");
}
