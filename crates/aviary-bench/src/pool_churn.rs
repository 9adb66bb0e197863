//! `aviary-bench pool-churn [CYCLES]`: a warm pool under create → exec → rm
//! churn (issue 8: a pool with min 2 serves ≥ 90% hits over 50 cycles). It
//! measures, it asserts nothing: scripts/bench.sh puts the report into
//! BENCHMARKS.md; `crates/aviary-server/tests/pool_churn.rs` asserts the
//! accounting.
//!
//! Against the same in-process server as the core path ([`crate::start_server`]):
//! three cold cycles first (so one-off costs such as the first disk image of a
//! size are not counted as misses), then `pool set python-small --min 2 --max 4`
//! through the API, the fill from empty, and two runs of CYCLES cycles:
//!
//! - **back to back**: the next create as soon as the previous rm returned, so
//!   the refill races the client (the harder case);
//! - **paced**: the next create once the pool shows 2 idle again, as the test
//!   does; the wait is the pool's refill time.
//!
//! A create is a hit when its decision says so (`reason` starts with
//! `warm pool hit`, the only place the create answer reports it); the pool's
//! own hit and miss counters are read before and after each run and printed
//! beside the count, so the two can be compared.

use crate::{pool_view, pool_when, row, stats, true_cmd, Stats, POOL_CLASS};
use anyhow::Context;
use aviary_client::Client;
use aviary_core::api::CreateSandboxRequest;
use std::time::{Duration, Instant};

const POOL_MIN: u32 = 2;
const POOL_MAX: u32 = 4;
/// How often the paced run looks at the pool while it refills.
const REFILL_POLL: Duration = Duration::from_millis(2);

/// The create latencies of one run, split by the create's decision, and the
/// pool's counters over it.
#[derive(Default)]
struct Run {
    hits: Vec<Duration>,
    misses: Vec<Duration>,
    counted_hits: u64,
    counted_misses: u64,
    wall: Duration,
    refills: Vec<Duration>,
}

pub async fn run(cycles: usize) -> anyhow::Result<()> {
    anyhow::ensure!(cycles > 0, "pool-churn needs at least one cycle");
    let load_before = load_average();
    let work = crate::work_dir()?;
    let server = crate::start_server(work.path()).await?;
    // no sandbox of this run outlives it, also when a cycle fails
    let _sweep = crate::SweepOnDrop(server.control_plane.runtime().clone());
    let client = Client::new(&server.url(), &server.admin_key);

    for _ in 0..3 {
        cycle(&client).await.context("warm-up cycle")?;
    }

    let t = Instant::now();
    client.set_pool(POOL_CLASS, POOL_MIN, POOL_MAX).await?;
    pool_when(&client, REFILL_POLL, |v| idle(v) >= POOL_MIN.into())
        .await
        .context("initial fill")?;
    let fill = t.elapsed();

    let back_to_back = churn(&client, cycles, false).await?;
    pool_when(&client, REFILL_POLL, |v| idle(v) >= POOL_MIN.into())
        .await
        .context("refill between the runs")?;
    let paced = churn(&client, cycles, true).await?;

    client.set_pool(POOL_CLASS, 0, 0).await?;
    server.stop().await?;

    let load = (load_before, load_average());
    report(cycles, fill, &back_to_back, &paced, load);
    Ok(())
}

/// `cycles` create → exec → rm cycles; when `paced`, each is followed by a
/// wait until the pool is back to `POOL_MIN` idle (timed from rm's answer).
async fn churn(c: &Client, cycles: usize, paced: bool) -> anyhow::Result<Run> {
    let before = pool_view(c).await?;
    let mut run = Run::default();
    let started = Instant::now();
    for i in 0..cycles {
        let (hit, create) = cycle(c).await.with_context(|| format!("cycle {i}"))?;
        if hit {
            run.hits.push(create);
        } else {
            run.misses.push(create);
        }
        if paced {
            let t = Instant::now();
            pool_when(c, REFILL_POLL, |v| idle(v) >= POOL_MIN.into())
                .await
                .with_context(|| format!("refill after cycle {i}"))?;
            run.refills.push(t.elapsed());
        }
    }
    run.wall = started.elapsed();
    let after = pool_view(c).await?;
    let delta = |k: &str| after[k].as_u64().unwrap_or(0) - before[k].as_u64().unwrap_or(0);
    run.counted_hits = delta("hits");
    run.counted_misses = delta("misses");
    Ok(run)
}

/// One create → exec `true` → rm; returns whether the create was a pool hit
/// and how long the create took.
async fn cycle(c: &Client) -> anyhow::Result<(bool, Duration)> {
    let t = Instant::now();
    let s = c.create_sandbox(&CreateSandboxRequest::default()).await?;
    let create = t.elapsed();
    let hit = s.decision.reason.starts_with("warm pool hit");
    let id = s.sandbox.id.to_string();
    let r = c.exec(&id, &true_cmd()).await?;
    anyhow::ensure!(r.exit_code == 0, "exec failed: {r:?}");
    c.delete_sandbox(&id, None).await?;
    Ok((hit, create))
}

/// The 1-minute load average: the back-to-back run races the refill for
/// the cores, so other work on the machine shows in its hit rate.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn idle(view: &serde_json::Value) -> u64 {
    view["idle"].as_u64().unwrap_or(0)
}

fn measured(v: &[Duration]) -> Result<Stats, String> {
    if v.is_empty() {
        Err("0".into())
    } else {
        Ok(stats(v.to_vec()))
    }
}

fn report(cycles: usize, fill: Duration, b2b: &Run, paced: &Run, load: (Option<f64>, Option<f64>)) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!("### Warm pool under churn (issue 8)\n");
    println!(
        "Pool `{POOL_CLASS}` (busybox template) set to min {POOL_MIN} / max {POOL_MAX} through the API; \
         {cycles} create → exec `true` → rm cycles per run, one client, default create request. \
         Hit = the create's decision says `warm pool hit`.\n"
    );
    println!("| run | hits | hit rate | pool counters (hits / misses) | wall time per cycle |");
    println!("|---|---:|---:|---|---:|");
    for (name, r) in [
        ("back to back (next create as soon as rm returns)", b2b),
        ("paced (next create once the pool is back to 2 idle)", paced),
    ] {
        let hits = r.hits.len();
        println!(
            "| {name} | {hits}/{cycles} | {:.1}% | {} / {} | {:.1} ms |",
            hits as f64 * 100.0 / cycles as f64,
            r.counted_hits,
            r.counted_misses,
            ms(r.wall) / cycles as f64
        );
    }
    println!("\n| create latency (API, create answer received) | p50 ms | p90 ms | n |\n|---|---|---|---|");
    println!("{}", row("hit, back to back", &measured(&b2b.hits)));
    println!("{}", row("miss, back to back", &measured(&b2b.misses)));
    println!("{}", row("hit, paced", &measured(&paced.hits)));
    println!("{}", row("miss, paced", &measured(&paced.misses)));
    let refill = measured(&paced.refills)
        .map(|s| format!("p50 {:.1} ms, p90 {:.1} ms (n = {})", s.p50, s.p90, s.n))
        .unwrap_or_else(|_| "n/a".into());
    println!(
        "\nRefill: from empty to {POOL_MIN} idle in {:.1} ms ({:.1} sandboxes/s); \
         in the paced run, rm answered → {POOL_MIN} idle again: {refill}.",
        ms(fill),
        f64::from(POOL_MIN) / fill.as_secs_f64()
    );
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let show = |l: Option<f64>| l.map_or_else(|| "n/a".into(), |l| format!("{l:.2}"));
    println!(
        "1-minute load average before / after: {} / {} on {cores} cores \
         (other work on the machine takes cores from the refill).",
        show(load.0),
        show(load.1)
    );
}
