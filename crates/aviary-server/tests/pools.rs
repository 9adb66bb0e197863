//! Warm pools against the real server: refill to the configured size, a
//! pooled sandbox is handed out at most once even under 50 parallel creates,
//! hits and misses are counted, `pool set` is kept across restarts.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use std::collections::HashSet;
use std::time::Duration;

fn pool_config(
    data: &std::path::Path,
    buffer: u32,
    max: u32,
) -> aviary_server::config::ServerConfig {
    let mut cfg = common::config(data, "busybox");
    // the parallel-claim test needs more sandboxes than this host's CPUs
    // take under the default over-commit
    cfg.control.settings.overcommit.cpu_ratio = 100.0;
    cfg.control.settings.overcommit.memory_ratio = 100.0;
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: "python-small".into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 0,
        pool_max: max,
        buffer_min: buffer,
        buffer_max: buffer,
    }];
    cfg
}

async fn wait_idle(c: &aviary_client::Client, want: u64) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    for _ in 0..300 {
        last = c.pools().await.unwrap();
        if last["pools"][0]["idle"].as_u64() == Some(want) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("pool never reached {want} idle: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_refills_and_hands_out_each_sandbox_once() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let ts = common::start_cfg(pool_config(&dir.path().join("d"), 8, 64)).await;
    let c = ts.client.clone();
    wait_idle(&c, 8).await;

    // 50 parallel creates: every answer is a different sandbox
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.create_sandbox(&CreateSandboxRequest::default()).await
        }));
    }
    let mut ids = HashSet::new();
    let mut hits = 0;
    for t in tasks {
        let r = t.await.unwrap().unwrap();
        if r.decision.reason.starts_with("warm pool hit") {
            hits += 1;
        }
        assert_eq!(r.sandbox.tenant, "default");
        assert!(
            ids.insert(r.sandbox.id.clone()),
            "sandbox {} handed out twice",
            r.sandbox.id
        );
    }
    assert_eq!(ids.len(), 50);
    assert!(hits >= 1, "no create was served from the pool");
    let view = c.pools().await.unwrap();
    assert_eq!(view["pools"][0]["hits"].as_u64().unwrap(), hits);
    assert_eq!(
        view["pools"][0]["hits"].as_u64().unwrap() + view["pools"][0]["misses"].as_u64().unwrap(),
        50
    );
    // every one of them works and belongs to its caller alone
    for id in &ids {
        let r = c
            .exec(id.as_str(), &common::shell("echo $((6*7))"))
            .await
            .unwrap();
        assert_eq!(r.stdout, "42\n");
    }
    for id in &ids {
        c.delete_sandbox(id.as_str(), None).await.unwrap();
    }
    // the pool comes back to its buffer
    wait_idle(&c, 8).await;
    let m = ts.client.metrics().await.unwrap();
    assert!(
        m.contains("aviary_pool_hits_total{class=\"python-small\""),
        "{m}"
    );
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_set_changes_bounds_and_survives_restart() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let mut ts = common::start_cfg(pool_config(&data, 2, 4)).await;
    let c = ts.client.clone();
    wait_idle(&c, 2).await;
    // pool_max 1 trims the buffer to 1
    let v = c.set_pool("python-small", 0, 1).await.unwrap();
    assert_eq!(v["pools"][0]["pool_max"], 1);
    wait_idle(&c, 1).await;
    assert_eq!(
        c.set_pool("no-such-class", 0, 1).await.unwrap_err().code(),
        Some(aviary_core::ErrorCode::NotFound)
    );
    assert_eq!(
        c.set_pool("python-small", 5, 1).await.unwrap_err().code(),
        Some(aviary_core::ErrorCode::InvalidRequest)
    );
    let user = aviary_client::Client::new(
        &ts.url(),
        &c.create_key("someone", false).await.unwrap().key,
    );
    assert_eq!(
        user.set_pool("python-small", 0, 9)
            .await
            .unwrap_err()
            .code(),
        Some(aviary_core::ErrorCode::Forbidden)
    );
    ts.stop().await;

    let ts2 = common::start_cfg(pool_config(&data, 2, 4)).await;
    let v = wait_idle(&ts2.client, 1).await;
    assert_eq!(v["pools"][0]["pool_max"], 1, "{v}");
    ts2.cleanup().await;
    let _ = ts;
}
