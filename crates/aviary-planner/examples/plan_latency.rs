//! Measures the heuristic planner and the chain (heuristic + telemetry over
//! 1000 history rows) on every context of `tests/corpus/`.
//!
//! `cargo run --release -p aviary-planner --example plan_latency`

use aviary_planner::{workload_signature, ChainPlanner, ClassSpec, HeuristicPlanner, TaskContext};
use aviary_registry::{AllocationRecord, AllocationUsage};
use std::time::Instant;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn main() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut contexts = Vec::new();
    for e in std::fs::read_dir(dir).expect("corpus dir") {
        let text = std::fs::read_to_string(e.expect("entry").path()).expect("read case");
        let v: serde_json::Value = serde_json::from_str(&text).expect("case json");
        contexts.push(TaskContext::from_json(&v["context"].to_string()).expect("context"));
    }
    let catalog = ClassSpec::seed_defaults();
    let history: Vec<AllocationRecord> = (0..1000)
        .map(|i| AllocationRecord {
            id: Some(i),
            task_id: format!("t{i}"),
            tenant: "default".into(),
            sandbox_id: None,
            planner_input_hash: String::new(),
            workload_signature: workload_signature(&contexts[i as usize % contexts.len()]),
            recommended_class: "python-small".into(),
            actual_class: catalog[i as usize % catalog.len()].name.clone(),
            reason: String::new(),
            confidence: 0.8,
            source: "heuristic".into(),
            cpu: 1.0,
            memory_mb: 2048,
            created_at: time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(i),
            usage: Some(AllocationUsage {
                duration_s: 30.0,
                peak_cpu: 0.3,
                peak_memory_mb: 300,
                oom: i % 17 == 0,
                timed_out: false,
            }),
        })
        .collect();

    let heuristic = HeuristicPlanner::default();
    let rounds = 200;
    let mut samples = Vec::new();
    for _ in 0..rounds {
        for ctx in &contexts {
            let t = Instant::now();
            let i = heuristic.plan_sync(ctx, &catalog).expect("plan");
            samples.push(t.elapsed().as_secs_f64() * 1e6);
            std::hint::black_box(i);
        }
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "heuristic: {} plans, p50 {:.1} µs, p99 {:.1} µs",
        samples.len(),
        percentile(&samples, 0.5),
        percentile(&samples, 0.99)
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let chain = ChainPlanner::default();
    let mut samples = Vec::new();
    for _ in 0..rounds {
        for ctx in &contexts {
            let t = Instant::now();
            let out = rt
                .block_on(chain.plan_traced(ctx, &catalog, &history))
                .expect("plan");
            samples.push(t.elapsed().as_secs_f64() * 1e6);
            std::hint::black_box(out);
        }
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "chain (heuristic + telemetry over {} rows): {} plans, p50 {:.1} µs, p99 {:.1} µs",
        history.len(),
        samples.len(),
        percentile(&samples, 0.5),
        percentile(&samples, 0.99)
    );
}
