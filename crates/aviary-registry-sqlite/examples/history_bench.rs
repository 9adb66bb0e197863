//! How the live listing a create reads (a tenant's live sandboxes: the quota
//! check; the same query serves pool claims and the scheduler) costs with a
//! history of terminated sandboxes in the registry: none, and 100k with and
//! without the live-rows partial index (migration 10), in one run.
//!
//! `cargo run --release -p aviary-registry-sqlite --example history_bench -- [HISTORY]`

use std::time::Instant;

use aviary_registry::conformance::sample_sandbox;
use aviary_registry::{Registry, TransitionCtx};
use aviary_registry_sqlite::SqliteRegistry;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::ConnectOptions;

async fn median_us(reg: &SqliteRegistry, live: usize) -> f64 {
    let mut times = Vec::new();
    for _ in 0..300 {
        let t = Instant::now();
        let n = reg.list_sandboxes(Some("acme"), false).await.unwrap().len();
        times.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(n, live);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let history: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("registry.db");
    let reg = SqliteRegistry::open(&path).await.unwrap();
    let live = 20;
    for _ in 0..live {
        reg.insert_sandbox(&sample_sandbox("acme"), TransitionCtx::default())
            .await
            .unwrap();
    }
    let none = median_us(&reg, live).await;

    reg.seed_terminated_history("acme", history).await.unwrap();
    let mut conn = SqliteConnectOptions::new()
        .filename(&path)
        .connect()
        .await
        .unwrap();
    let with_index = median_us(&reg, live).await;
    sqlx::query("DROP INDEX sandbox_instance_live_by_tenant")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("DROP INDEX sandbox_instance_live")
        .execute(&mut conn)
        .await
        .unwrap();
    // the reader pool re-prepares after the schema change
    let without = median_us(&reg, live).await;
    println!("| terminated rows in the registry | live-index (now) | without it (before) |");
    println!("|---:|---:|---:|");
    println!("| 0 | {none:.0} µs | — |");
    println!("| {history} | {with_index:.0} µs | {without:.0} µs |");
}
