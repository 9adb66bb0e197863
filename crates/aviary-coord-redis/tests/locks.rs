//! The locks against a real Redis: the lock conformance suite, and two
//! replicas sharing one lock.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod support;

use aviary_coord_redis::RedisLocks;
use aviary_leases::{lock_conformance, LockName, LockRequest, Locks};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_locks_pass_the_conformance_suite() {
    let Some((_, conn)) = support::redis().await else {
        return;
    };
    let prefix = support::prefix();
    lock_conformance::run_all(Arc::new(RedisLocks::new(conn.clone(), &prefix))).await;
    // every lock the suite took was released or ran out
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        support::flush_prefix(&conn, &prefix).await,
        0,
        "locks left behind"
    );
}

/// A lock taken on one replica is held for the other, and its release
/// lets the other in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_locks() {
    let Some((url, conn)) = support::redis().await else {
        return;
    };
    let prefix = support::prefix();
    let a = RedisLocks::new(conn.clone(), &prefix);
    let b = RedisLocks::new(aviary_coord_redis::connect(&url).await.unwrap(), &prefix);
    let name = LockName::new("lifecycle", "sbx-shared");
    let req = |owner: &str| LockRequest::new(name.clone(), owner, Duration::from_secs(60));

    let held = a.try_acquire(&req("replica-a")).await.unwrap().unwrap();
    assert!(b.try_acquire(&req("replica-b")).await.unwrap().is_none());
    assert_eq!(b.holder(&name).await.unwrap().unwrap().owner, "replica-a");
    let b_req = req("replica-b");
    let waiter = tokio::spawn(async move { b.acquire(&b_req, Duration::from_secs(20)).await });
    drop(held);
    let got = waiter.await.unwrap().unwrap();
    assert_eq!(got.owner(), "replica-b");
    assert_eq!(a.holder(&name).await.unwrap().unwrap().owner, "replica-b");
    drop(got);
    support::flush_prefix(&conn, &prefix).await;
}
