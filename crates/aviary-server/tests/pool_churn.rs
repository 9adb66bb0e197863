//! Warm pools under churn (issue 8): a pool keeps serving hits however many
//! of its sandboxes were handed out and removed. The test asserts the
//! accounting — hits counted from the create answers and the pool's
//! counters, `handed_out` back to 0 after each removal — and waits for the
//! refill by watching the pool's idle count, never by sleeping a fixed time.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use std::time::Duration;

const CYCLES: u64 = 50;

/// The one pool's view once `ready(view)` holds (polled; the bound is only
/// there so a broken refill fails instead of hanging).
async fn pool_when(
    c: &aviary_client::Client,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    for _ in 0..600 {
        last = c.pools().await.unwrap()["pools"][0].clone();
        if ready(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("pool never got {what}: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_keeps_serving_hits_under_create_exec_rm_churn() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    // `pool set python-small --min 2 --max 8` on the default pool
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: "python-small".into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 2,
        pool_max: 8,
        buffer_min: 0,
        buffer_max: 2,
    }];
    // the loop and its polling are faster than the default per-key rate
    // limit allows; it is not what this test is about
    cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
    cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    let ts = common::start_cfg(cfg).await;
    let c = ts.client.clone();
    let refilled = |v: &serde_json::Value| v["idle"] == 2;
    pool_when(&c, "2 idle", refilled).await;

    let mut hits = 0;
    for cycle in 0..CYCLES {
        let r = c
            .create_sandbox(&CreateSandboxRequest::default())
            .await
            .unwrap();
        if r.decision.reason.starts_with("warm pool hit") {
            hits += 1;
        }
        let id = r.sandbox.id.to_string();
        let out = c.exec(&id, &common::shell("echo $((6*7))")).await.unwrap();
        assert_eq!(out.stdout, "42\n");
        let view = c.pools().await.unwrap()["pools"][0].clone();
        let expect_out = u64::from(r.decision.reason.starts_with("warm pool hit"));
        assert_eq!(view["handed_out"], expect_out, "cycle {cycle}: {view}");
        c.delete_sandbox(&id, None).await.unwrap();
        // the removed hand-out no longer counts, at once (no refill needed)
        let view = c.pools().await.unwrap()["pools"][0].clone();
        assert_eq!(view["handed_out"], 0, "cycle {cycle}, after rm: {view}");
        assert_eq!(view["hits"], hits, "cycle {cycle}: {view}");
        pool_when(&c, "2 idle again", refilled).await;
    }

    let view = c.pools().await.unwrap()["pools"][0].clone();
    eprintln!("pool churn: {hits} hits in {CYCLES} cycles ({view})");
    assert!(
        hits * 100 >= CYCLES * 90,
        "only {hits} of {CYCLES} creates hit the pool"
    );
    assert_eq!(view["hits"], hits);
    assert_eq!(view["misses"], CYCLES - hits);
    assert_eq!(view["handed_out"], 0);
    assert_eq!(view["idle"], 2);
    let metrics = c.metrics().await.unwrap();
    assert!(
        metrics.contains("aviary_pool_handed_out{class=\"python-small\",template=\"busybox\",runtime=\"crun\"} 0"),
        "{metrics}"
    );
    ts.cleanup().await;
}
