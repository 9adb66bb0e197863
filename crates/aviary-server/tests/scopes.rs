//! Isolation scopes and the reuse checker through the real server: same
//! session, same user in a new session, another user, another tenant,
//! incompatible dependencies, a tainted sandbox, and callers of a shared
//! scope serializing through the lease.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use std::time::Duration;

fn req(user: Option<&str>, session: Option<&str>) -> CreateSandboxRequest {
    CreateSandboxRequest {
        user_id: user.map(str::to_owned),
        session_id: session.map(str::to_owned),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_session_reuses_without_a_lease() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&req(None, Some("s1"))).await.unwrap();
    assert_eq!(a.sandbox.scope, aviary_core::Scope::Session);
    assert!(a.lease.is_none());
    c.exec(
        a.sandbox.id.as_str(),
        &common::shell("echo state > /workspace/f"),
    )
    .await
    .unwrap();
    let b = c.create_sandbox(&req(None, Some("s1"))).await.unwrap();
    assert_eq!(b.sandbox.id, a.sandbox.id, "{:?}", b.decision);
    assert_eq!(
        (b.decision.action.as_str(), b.decision.branch.as_str()),
        ("reuse", "A"),
        "{:?}",
        b.decision
    );
    assert!(b.decision.score > 0.5);
    assert_eq!(
        c.read_file(b.sandbox.id.as_str(), "/workspace/f")
            .await
            .unwrap(),
        b"state\n"
    );
    // another session gets its own sandbox
    let other = c.create_sandbox(&req(None, Some("s2"))).await.unwrap();
    assert_ne!(other.sandbox.id, a.sandbox.id);
    let evs = c
        .events(Some(a.sandbox.id.as_str()), None, None)
        .await
        .unwrap()
        .events;
    assert!(evs
        .iter()
        .any(|e| e.event_type == "reuse_decision" && e.metadata["action"] == "reuse"));
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_scope_is_shared_across_sessions_through_the_lease() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c
        .create_sandbox(&req(Some("u1"), Some("s1")))
        .await
        .unwrap();
    assert_eq!(a.sandbox.scope, aviary_core::Scope::User);
    let la = a
        .lease
        .clone()
        .expect("a shared scope hands out its sandbox under a lease");
    let id = a.sandbox.id.clone();

    // a second caller of the same user waits until the first releases
    let c2 = c.clone();
    let second = tokio::spawn(async move { c2.create_sandbox(&req(Some("u1"), Some("s2"))).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !second.is_finished(),
        "the second caller must wait for the lease"
    );
    c.sandbox_action(id.as_str(), "release", Some(la.token))
        .await
        .unwrap();
    let b = second.await.unwrap().unwrap();
    assert_eq!(b.sandbox.id, id);
    assert_eq!(b.decision.action, "reuse");
    let lb = b.lease.unwrap();
    assert!(lb.token > la.token);

    // another user never gets it
    let other = c
        .create_sandbox(&req(Some("u2"), Some("s1")))
        .await
        .unwrap();
    assert_ne!(other.sandbox.id, id);
    // another tenant with the same user id never gets it
    let k = c.create_key("tenant-b", false).await.unwrap().key;
    let cb = aviary_client::Client::new(&ts.url(), &k);
    let theirs = cb
        .create_sandbox(&req(Some("u1"), Some("s1")))
        .await
        .unwrap();
    assert_ne!(theirs.sandbox.id, id);
    assert_eq!(theirs.sandbox.tenant, "tenant-b");
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incompatible_or_tainted_sandboxes_are_not_reused() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&req(None, Some("s9"))).await.unwrap();
    // the busybox template has no python: a pandas job cannot reuse it
    let needs_pandas = CreateSandboxRequest {
        session_id: Some("s9".into()),
        intent: Some(
            serde_json::json!({"task": "pandas stats", "languages": ["python"], "dependencies": ["pandas==1.5"]}),
        ),
        ..Default::default()
    };
    let b = c.create_sandbox(&needs_pandas).await.unwrap();
    assert_ne!(b.sandbox.id, a.sandbox.id);
    assert_eq!(b.decision.action, "new_sandbox");
    assert!(b.decision.reason.contains("rejected"), "{:?}", b.decision);

    // a tainted sandbox is never handed out again
    let t = c.create_sandbox(&req(None, Some("s10"))).await.unwrap();
    let rec = ts.cp().registry.get_sandbox(&t.sandbox.id).await.unwrap();
    ts.cp()
        .registry
        .set_tainted(&t.sandbox.id, rec.version, true)
        .await
        .unwrap();
    let again = c.create_sandbox(&req(None, Some("s10"))).await.unwrap();
    assert_ne!(again.sandbox.id, t.sandbox.id);
    assert!(
        again.decision.reason.contains("taint"),
        "{:?}",
        again.decision
    );
    ts.cleanup().await;
}
