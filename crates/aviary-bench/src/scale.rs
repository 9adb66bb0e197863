//! `aviary-bench scale [MAX] [TSV]`: how cost grows with scale (issue 12).
//! It measures, it asserts nothing. Against the same kind of in-process
//! server as the core path ([`crate::start_server`], the over-commit bound
//! lifted further so a thousand sandboxes of the default class are
//! admitted: what is measured is the host, not the scheduler's policy):
//!
//! 1. **Sustained creates/s** with 1, 4 and 16 concurrent clients, each a
//!    create → delete loop for [`SUSTAIN`], beside the crun floor (raw
//!    `crun run` of an equivalent bundle, back to back: 1000 / its p50).
//! 2. **Idle sandboxes alive**: grows to 10 / 100 / 500 / 1000 (up to MAX)
//!    idle sandboxes, 4 creators at a time. At each point: cold create →
//!    first exec (then deleted, its reclaim awaited), the exec round trip
//!    of `true` in an idle sandbox, host memory per idle sandbox (the drop
//!    of `MemAvailable` since before the first, divided by the count) and
//!    the RSS of each sandbox's processes (envd), and what the host holds
//!    for them (loop devices, mounts, the server's open fds). A create that
//!    fails stops the growth: its error is the limit, printed.
//!
//! Every create's latency is kept by its sequence number: the first and
//! the last of the growth are compared. Everything is deleted at the end
//! and the reclaims awaited; the runtime is swept on drop whatever happens.
//! Progress lines go to stderr; the report (Markdown) to stdout; the curve
//! points to TSV when given (for the plot, `scripts/plot-scale.py`).

use crate::{crun_floor, stats, true_cmd, SweepOnDrop};
use anyhow::Context;
use aviary_client::Client;
use aviary_core::api::CreateSandboxRequest;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long each sustained-create run lasts.
const SUSTAIN: Duration = Duration::from_secs(8);
/// The points of the curve.
const POINTS: [usize; 4] = [10, 100, 500, 1000];
/// Concurrent creators while growing.
const GROWERS: usize = 4;

/// One point of the curve.
struct Point {
    alive: usize,
    create_exec_p50: f64,
    exec_p50: f64,
    mem_per_sandbox_mib: f64,
    rss_per_sandbox_mib: f64,
    loops: usize,
    mounts: usize,
    fds: usize,
}

fn progress(line: &str) {
    eprintln!("bench scale: {line}");
}

pub(crate) fn mem_available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Attached loop devices (a non-empty `backing_file`).
fn loop_devices() -> usize {
    std::fs::read_dir("/sys/block")
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
                .filter(|e| e.path().join("loop/backing_file").exists())
                .count()
        })
        .unwrap_or(0)
}

fn count_lines(path: &str) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn own_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|r| r.count())
        .unwrap_or(0)
}

/// The RSS of the processes in a sandbox's memory cgroup, KiB.
fn sandbox_rss_kib(id: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/fs/cgroup/memory/aviary/{id}/cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .map(crate::vm_rss_kib)
        .sum()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// What create → delete loops measured.
struct Sustained {
    creates_per_s: f64,
    /// Each create's and each delete's latency (the delete is answered
    /// before its compute is reclaimed).
    creates: Vec<Duration>,
    deletes: Vec<Duration>,
}

/// create → delete loops by `clients` clients for [`SUSTAIN`].
async fn sustained(client: &Client, clients: usize) -> anyhow::Result<Sustained> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let c = client.clone();
        tasks.push(tokio::spawn(async move {
            let (mut creates, mut deletes) = (Vec::new(), Vec::new());
            while started.elapsed() < SUSTAIN {
                let t = Instant::now();
                let s = c.create_sandbox(&CreateSandboxRequest::default()).await?;
                creates.push(t.elapsed());
                let t = Instant::now();
                c.delete_sandbox(s.sandbox.id.as_str(), None).await?;
                deletes.push(t.elapsed());
            }
            anyhow::Ok((creates, deletes))
        }));
    }
    let (mut creates, mut deletes) = (Vec::new(), Vec::new());
    for t in tasks {
        let (c, d) = t.await??;
        creates.extend(c);
        deletes.extend(d);
    }
    Ok(Sustained {
        creates_per_s: creates.len() as f64 / started.elapsed().as_secs_f64(),
        creates,
        deletes,
    })
}

pub async fn run(max: usize, tsv: Option<&Path>) -> anyhow::Result<()> {
    let work = crate::work_dir()?;
    let server = crate::start_server(work.path()).await?;
    let _sweep = SweepOnDrop(server.control_plane.runtime().clone());
    let cp = server.control_plane.clone();
    let client = Client::new(&server.url(), &server.admin_key);
    let state_dir = server.cfg.runtime_state_dir();
    let rootfs = aviary_templates::TemplateStore::open(server.cfg.templates_root())?
        .get("busybox")?
        .context("busybox template")?
        .rootfs;

    // warm-up, and the bundle the floor is made from
    let keep = client
        .create_sandbox(&CreateSandboxRequest::default())
        .await?
        .sandbox
        .id;
    client.exec(keep.as_str(), &true_cmd()).await?;
    let bundle_cfg = state_dir.join(keep.as_str()).join("bundle/config.json");
    progress("crun floor (20 back-to-back `crun run`)");
    let floor = crun_floor(&bundle_cfg, &rootfs, work.path(), 20, &state_dir).await;
    client.delete_sandbox(keep.as_str(), None).await?;
    cp.reclaims.settled().await;

    let mut rates = Vec::new();
    for clients in [1, 4, 16] {
        progress(&format!(
            "sustained creates with {clients} client(s) for {SUSTAIN:?}"
        ));
        let r = sustained(&client, clients).await;
        cp.reclaims.settled().await;
        rates.push((clients, r.map_err(|e| format!("{e:#}"))));
    }

    let base_avail = mem_available_kib();
    let mut alive: Vec<String> = Vec::new();
    let mut creates: Vec<Duration> = Vec::new();
    let mut points = Vec::new();
    let mut limit: Option<String> = None;
    for target in POINTS.into_iter().filter(|p| *p <= max) {
        progress(&format!(
            "growing to {target} idle sandboxes (from {})",
            alive.len()
        ));
        while alive.len() < target && limit.is_none() {
            let batch = (target - alive.len()).min(GROWERS);
            let mut tasks = Vec::new();
            for _ in 0..batch {
                let c = client.clone();
                tasks.push(tokio::spawn(async move {
                    let t = Instant::now();
                    let s = c.create_sandbox(&CreateSandboxRequest::default()).await?;
                    anyhow::Ok((s.sandbox.id.to_string(), t.elapsed()))
                }));
            }
            for t in tasks {
                match t.await? {
                    Ok((id, d)) => {
                        alive.push(id);
                        creates.push(d);
                    }
                    Err(e) => limit = Some(format!("create #{} failed: {e:#}", alive.len() + 1)),
                }
            }
        }
        if let Some(why) = &limit {
            progress(&format!("stopped growing: {why}"));
            break;
        }
        progress(&format!("measuring at {target} idle sandboxes"));
        // settle: the page cache and envd's start-up allocations
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mem_per =
            (base_avail.saturating_sub(mem_available_kib())) as f64 / 1024.0 / target as f64;
        let sample: Vec<&String> = alive.iter().step_by((target / 10).max(1)).collect();
        let rss: u64 = sample.iter().map(|id| sandbox_rss_kib(id)).sum();
        let rss_per = rss as f64 / 1024.0 / sample.len() as f64;
        let (cold, _) = cold_creates(&client, &cp, 5).await?;
        let mut exec = Vec::new();
        for i in 0..30 {
            let id = &alive[(i * 7919) % alive.len()];
            let t = Instant::now();
            let r = client.exec(id, &true_cmd()).await?;
            exec.push(t.elapsed());
            anyhow::ensure!(r.exit_code == 0, "exec failed: {r:?}");
        }
        points.push(Point {
            alive: target,
            create_exec_p50: cold.p50,
            exec_p50: stats(exec).p50,
            mem_per_sandbox_mib: mem_per,
            rss_per_sandbox_mib: rss_per,
            loops: loop_devices(),
            mounts: count_lines("/proc/self/mountinfo"),
            fds: own_fds(),
        });
    }

    progress(&format!("deleting {} idle sandboxes", alive.len()));
    for id in &alive {
        client.delete_sandbox(id, None).await?;
    }
    cp.reclaims.settled().await;

    // per-request registry work must not grow with history: the same cold
    // create → first exec before and after 100k terminated sandboxes are
    // added to the server's own registry
    progress("cold creates with the history so far, then with 100k more terminated sandboxes");
    let (before_history, tenant) = cold_creates(&client, &cp, 10).await?;
    let registry = aviary_registry_sqlite::SqliteRegistry::open(&server.cfg.registry_path())
        .await
        .context("open the server's registry")?;
    registry
        .seed_terminated_history(&tenant, HISTORY)
        .await
        .context("seed the history")?;
    registry.close().await;
    let (after_history, _) = cold_creates(&client, &cp, 10).await?;
    server.stop().await?;
    report(&floor, &rates, &points, &creates, limit.as_deref(), tsv)?;
    println!(
        "\n| terminated sandboxes in the registry | cold create → first exec p50 ms | p90 ms | n |\n|---|---|---|---|"
    );
    for (what, s) in [
        ("the bench's own (a few thousand)", &before_history),
        ("+ 100000 (half the measured tenant's)", &after_history),
    ] {
        println!("| {what} | {:.2} | {:.2} | {} |", s.p50, s.p90, s.n);
    }
    println!(
        "\nWith 100k more terminated sandboxes a cold create → first exec takes {:.2}× the time.",
        after_history.p50 / before_history.p50
    );
    Ok(())
}

/// Terminated rows added for the history measurement.
const HISTORY: u64 = 100_000;

/// `n` cold create → first exec → delete cycles, each reclaim awaited; and
/// the tenant they were created for.
async fn cold_creates(
    client: &Client,
    cp: &aviary_server::ops::ControlPlane,
    n: usize,
) -> anyhow::Result<(crate::Stats, String)> {
    let (mut cold, mut tenant) = (Vec::new(), String::new());
    for _ in 0..n {
        let t = Instant::now();
        let s = client
            .create_sandbox(&CreateSandboxRequest::default())
            .await?;
        client.exec(s.sandbox.id.as_str(), &true_cmd()).await?;
        cold.push(t.elapsed());
        tenant = s.sandbox.tenant.clone();
        client.delete_sandbox(s.sandbox.id.as_str(), None).await?;
        cp.reclaims.settled().await;
    }
    Ok((stats(cold), tenant))
}

fn report(
    floor: &Result<crate::Stats, String>,
    rates: &[(usize, Result<Sustained, String>)],
    points: &[Point],
    creates: &[Duration],
    limit: Option<&str>,
    tsv: Option<&Path>,
) -> anyhow::Result<()> {
    println!("### Scale curves (issue 12)\n");
    let floor_rate = floor.as_ref().map(|f| 1000.0 / f.p50);
    println!("| sustained creates/s (create → delete loops, {SUSTAIN:?}) | creates/s | vs crun floor | create p50 ms | delete p50 ms (answer) |\n|---|---|---|---|---|");
    for (clients, r) in rates {
        match r {
            Ok(r) => {
                let vs = floor_rate
                    .as_ref()
                    .map(|f| format!("{:.2}×", r.creates_per_s / f))
                    .unwrap_or_else(|_| "n/a".into());
                println!(
                    "| {clients} client(s) | {:.1} | {vs} | {:.2} | {:.2} |",
                    r.creates_per_s,
                    stats(r.creates.clone()).p50,
                    stats(r.deletes.clone()).p50
                );
            }
            Err(e) => println!("| {clients} client(s) | n/a | {e} | | |"),
        }
    }
    match &floor_rate {
        Ok(f) => {
            println!("| raw `crun run` of `/bin/true` back to back (floor) | {f:.1} | 1× | | |")
        }
        Err(e) => println!("| raw `crun run` back to back (floor) | n/a | {e} | | |"),
    }
    println!();
    println!("| idle sandboxes alive | cold create → first exec p50 ms | exec round trip p50 ms | host MiB per idle sandbox (MemAvailable) | RSS MiB per sandbox (its processes) | loop devices | mounts | server fds |\n|---|---|---|---|---|---|---|---|");
    for p in points {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
            p.alive,
            p.create_exec_p50,
            p.exec_p50,
            p.mem_per_sandbox_mib,
            p.rss_per_sandbox_mib,
            p.loops,
            p.mounts,
            p.fds
        );
    }
    if let (Some(first), Some(last)) = (creates.first(), creates.last()) {
        // the first ten and the last ten, p50 each, 4 creators at a time
        let head = stats(creates.iter().take(10).copied().collect()).p50;
        let tail = stats(creates.iter().rev().take(10).copied().collect()).p50;
        println!(
            "\nCreates while growing ({} in all, {GROWERS} at a time): the first ten p50 {head:.1} ms, the last ten p50 {tail:.1} ms ({:.2}×; first {:.1} ms, last {:.1} ms).",
            creates.len(),
            tail / head,
            ms(*first),
            ms(*last)
        );
    }
    match limit {
        Some(why) => println!("\nGrowth stopped: {why}"),
        None => {
            println!("\nEvery point was reached; everything was deleted and reclaimed at the end.")
        }
    }
    if let Some(path) = tsv {
        let mut s = String::from("alive\tcreate_exec_ms\texec_ms\tmem_mib\trss_mib\n");
        for p in points {
            s.push_str(&format!(
                "{}\t{:.3}\t{:.3}\t{:.3}\t{:.3}\n",
                p.alive,
                p.create_exec_p50,
                p.exec_p50,
                p.mem_per_sandbox_mib,
                p.rss_per_sandbox_mib
            ));
        }
        std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
