//! Hot routing against a real Redis: sandbox routes and node heartbeats.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod support;

use aviary_coord_redis::{RedisRoutes, RouteError};
use aviary_core::SandboxId;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(600);
const SHORT: Duration = Duration::from_millis(200);

#[tokio::test]
async fn routes_are_set_read_cleared_and_run_out() {
    let Some((_, conn)) = support::redis().await else {
        return;
    };
    let prefix = support::prefix();
    let routes = RedisRoutes::new(conn.clone(), &prefix);
    let (a, b) = (SandboxId::generate(), SandboxId::generate());
    assert_eq!(routes.route(&a).await.unwrap(), None, "no route yet");

    routes.set_route(&a, "node-1", LONG).await.unwrap();
    assert_eq!(routes.route(&a).await.unwrap().as_deref(), Some("node-1"));
    assert_eq!(
        routes.route(&b).await.unwrap(),
        None,
        "routes are per sandbox"
    );
    routes.set_route(&a, "node-2", LONG).await.unwrap();
    assert_eq!(
        routes.route(&a).await.unwrap().as_deref(),
        Some("node-2"),
        "moved"
    );
    routes.clear_route(&a).await.unwrap();
    assert_eq!(routes.route(&a).await.unwrap(), None, "cleared");
    routes.clear_route(&a).await.unwrap(); // idempotent

    routes.set_route(&b, "node-1", SHORT).await.unwrap();
    tokio::time::sleep(SHORT * 2).await;
    assert_eq!(routes.route(&b).await.unwrap(), None, "ran out");

    assert_eq!(
        routes
            .set_route(&a, "node-1", Duration::ZERO)
            .await
            .unwrap_err(),
        RouteError::InvalidTtl
    );
    support::flush_prefix(&conn, &prefix).await;
}

#[tokio::test]
async fn heartbeats_keep_nodes_alive_until_they_run_out() {
    let Some((url, conn)) = support::redis().await else {
        return;
    };
    let prefix = support::prefix();
    let routes = RedisRoutes::new(conn.clone(), &prefix);
    // another replica's view of the same nodes
    let other = RedisRoutes::new(aviary_coord_redis::connect(&url).await.unwrap(), &prefix);
    assert!(routes.alive_nodes().await.unwrap().is_empty());

    routes.heartbeat("node-b", LONG).await.unwrap();
    routes.heartbeat("node-a", LONG).await.unwrap();
    routes.heartbeat("node-short", SHORT).await.unwrap();
    assert_eq!(
        other.alive_nodes().await.unwrap(),
        ["node-a", "node-b", "node-short"],
        "by name"
    );
    tokio::time::sleep(SHORT * 2).await;
    assert_eq!(other.alive_nodes().await.unwrap(), ["node-a", "node-b"]);
    let members: usize = redis::cmd("ZCARD")
        .arg(format!("{prefix}:nodes"))
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(members, 2, "the dead node was pruned on read");

    // a heartbeat brings a node back; a clean shutdown takes it out
    routes.heartbeat("node-short", LONG).await.unwrap();
    routes.forget_node("node-b").await.unwrap();
    assert_eq!(other.alive_nodes().await.unwrap(), ["node-a", "node-short"]);
    assert_eq!(
        routes
            .heartbeat("node-a", Duration::ZERO)
            .await
            .unwrap_err(),
        RouteError::InvalidTtl
    );
    support::flush_prefix(&conn, &prefix).await;
}
