//! Cross-request work is serialised by the control plane's `Locks` backend,
//! not by in-process mutexes: a lock held there by someone else (another
//! replica, here the test) holds back placements (`placement/nodes`), fence
//! pushes to one envd (`fence/<id>`) and a pool's refill
//! (`pool/<class>/<template>/<runtime>`); each guard is gone when its work
//! is done.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_leases::{LockGuard, LockName, LockRequest};
use std::time::Duration;

/// Takes `name` in the server's lock backend as another holder would.
async fn hold(ts: &common::TestServer, name: &LockName) -> LockGuard {
    ts.cp()
        .locks
        .try_acquire(&LockRequest::new(
            name.clone(),
            "another replica",
            Duration::from_secs(600),
        ))
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{name} is free"))
}

/// `task` is still waiting after a while (there is no event to wait for: it
/// is blocked on a lock).
async fn still_waiting<T>(task: &tokio::task::JoinHandle<T>, what: &str) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!task.is_finished(), "{what} ran while its lock was held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_and_fence_pushes_wait_for_their_locks() {
    let ts = common::start().await;
    let c = &ts.client;

    // a create places its sandbox under `placement/nodes`
    let placement = LockName::new("placement", "nodes");
    let held = hold(&ts, &placement).await;
    let create = {
        let c = c.clone();
        tokio::spawn(async move { c.create_sandbox(&CreateSandboxRequest::default()).await })
    };
    still_waiting(&create, "a placement").await;
    drop(held);
    let id = create.await.unwrap().unwrap().sandbox.id.to_string();
    assert_eq!(ts.cp().locks.holder(&placement).await.unwrap(), None);

    // a lease acquire pushes the new fence to envd under `fence/<id>`
    let fence = LockName::new("fence", &id);
    let held = hold(&ts, &fence).await;
    let acquire = {
        let (c, id) = (c.clone(), id.clone());
        tokio::spawn(async move { c.acquire_lease(&id, "me", None).await })
    };
    still_waiting(&acquire, "a fence push").await;
    drop(held);
    let lease = acquire.await.unwrap().unwrap();
    assert_eq!(ts.cp().locks.holder(&fence).await.unwrap(), None);
    // the push that waited sent the current fence: the holder can work
    let mut exec = common::shell("true");
    exec.token = Some(lease.token);
    c.exec(&id, &exec).await.unwrap();
    c.delete_sandbox(&id, Some(lease.token)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_refilled_elsewhere_is_skipped() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: "python-small".into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 0,
        pool_max: 4,
        buffer_min: 0,
        buffer_max: 0,
    }];
    let ts = common::start_cfg(cfg).await;
    let c = &ts.client;
    let name = LockName::new(
        "pool",
        format!(
            "{}/python-small/busybox/{}",
            aviary_control::nodes::LOCAL_NODE,
            aviary_config::Runtime::Crun.as_str()
        ),
    );

    // another replica is refilling the pool: this one starts nothing
    let held = hold(&ts, &name).await;
    c.set_pool("python-small", 1, 4).await.unwrap();
    assert_eq!(ts.cp().refill_pools().await.unwrap(), 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(c.pools().await.unwrap()["pools"][0]["idle"], 0);

    // once it is done, the pool is refilled here (by this pass or the
    // background one, whichever takes the lock)
    drop(held);
    ts.cp().refill_pools().await.unwrap();
    let mut last = serde_json::Value::Null;
    for _ in 0..300 {
        last = c.pools().await.unwrap();
        if last["pools"][0]["idle"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(last["pools"][0]["idle"], 1, "{last}");
    assert_eq!(ts.cp().locks.holder(&name).await.unwrap(), None);
}
