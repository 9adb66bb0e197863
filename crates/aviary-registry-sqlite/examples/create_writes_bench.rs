//! What a cold create's registry writes cost on SQLite, each apart, in the
//! order `ControlPlane::create` makes them (issue 12: "one registry
//! transaction per create"). Median of N creates' worth of writes.
//!
//! `cargo run --release -p aviary-registry-sqlite --example create_writes_bench -- [N]`

use std::time::{Duration, Instant};

use aviary_core::SandboxState;
use aviary_registry::conformance::sample_sandbox;
use aviary_registry::{AllocationRecord, FenceCheck, NewSandbox, Registry, TransitionCtx};
use aviary_registry_sqlite::SqliteRegistry;

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

fn allocation(new: &NewSandbox) -> AllocationRecord {
    AllocationRecord {
        id: None,
        task_id: "task".into(),
        tenant: new.tenant.clone(),
        sandbox_id: Some(new.id.clone()),
        planner_input_hash: "hash".into(),
        workload_signature: "python".into(),
        recommended_class: "python-small".into(),
        actual_class: "python-small".into(),
        reason: "default class".into(),
        confidence: 1.0,
        source: "request".into(),
        cpu: 1.0,
        memory_mb: 2048,
        created_at: aviary_core::now(),
        usage: None,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300);
    let dir = tempfile::tempdir().unwrap();
    let reg = SqliteRegistry::open(&dir.path().join("registry.db"))
        .await
        .unwrap();
    let names = [
        "insert_sandbox (+ created event)",
        "transition Planning → Allocating → Provisioning (3 events)",
        "insert_allocation",
        "set_runtime_instance",
        "transition Locking → Idle (2 events)",
        "live_totals (tenant) + live_totals (all)",
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    let mut total = Vec::new();
    for _ in 0..n {
        let new = sample_sandbox("acme");
        let start = Instant::now();
        let t = Instant::now();
        let _ = reg.live_totals(Some("acme")).await.unwrap();
        let _ = reg.live_totals(None).await.unwrap();
        times[5].push(t.elapsed());
        let t = Instant::now();
        let rec = reg
            .insert_sandbox(&new, TransitionCtx::default())
            .await
            .unwrap();
        times[0].push(t.elapsed());
        let t = Instant::now();
        let rec = reg
            .transition(
                &rec.id,
                rec.version,
                &[
                    SandboxState::Planning,
                    SandboxState::Allocating,
                    SandboxState::Provisioning,
                ],
                FenceCheck::Skip,
                TransitionCtx::default(),
            )
            .await
            .unwrap();
        times[1].push(t.elapsed());
        let t = Instant::now();
        reg.insert_allocation(&allocation(&new)).await.unwrap();
        times[2].push(t.elapsed());
        let t = Instant::now();
        let rec = reg
            .set_runtime_instance(&rec.id, rec.version, rec.id.as_str(), "local")
            .await
            .unwrap();
        times[3].push(t.elapsed());
        let t = Instant::now();
        reg.transition(
            &rec.id,
            rec.version,
            &[SandboxState::Locking, SandboxState::Idle],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
        times[4].push(t.elapsed());
        total.push(start.elapsed());
    }
    println!("| a cold create's registry work (SQLite, WAL, synchronous=NORMAL) | median µs |");
    println!("|---|---:|");
    for (name, t) in names.iter().zip(times) {
        println!("| {name} | {:.0} |", median(t));
    }
    println!("| all of it, per create | {:.0} |", median(total));
}
