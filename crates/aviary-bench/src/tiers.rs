//! `aviary-bench tiers [ITERATIONS] [IDLE]`: the isolation tiers side by
//! side (issue 11). One Aviary server serves `crun`, `runc`, `runsc`
//! (gVisor) and `docker` (a dockerd started for the run, as the core part
//! does), the busybox template on each:
//!
//! - cold create → first exec completes (API), the tiers alternating create
//!   by create, ITERATIONS per tier;
//! - exec round trip of `true` (API → envd), alternating exec by exec;
//! - host memory per idle sandbox: per tier, IDLE sandboxes (10 by default)
//!   created and left idle for [`SETTLE`], then (a) the sum of their cgroup
//!   memory (`GET /v1/sandboxes/{id}/usage`, `memory_bytes`) divided by
//!   IDLE and (b) the drop of the host's `MemAvailable` while they are
//!   alive (against the mean of before the creates and after the deletes
//!   were reclaimed), divided by IDLE; [`MEM_ROUNDS`] rounds, the tiers
//!   alternating round by round, the median shown (with the spread);
//! - memory checkpoint / restore through the server: hibernate → wake →
//!   first exec of an idle sandbox on `runsc` (the only tier whose
//!   hibernate keeps processes; the others keep files only).
//!
//! A tier whose runtime is missing (binary absent, dockerd not starting,
//! the server's self-check failing) is skipped, and the reason printed in
//! its row. It measures, it asserts nothing: scripts/bench.sh puts the
//! report into BENCHMARKS.md.

use crate::scale::mem_available_kib;
use crate::{stats, true_cmd, Docker, Stats, SweepOnDrop};
use anyhow::Context;
use aviary_client::Client;
use aviary_config::Runtime;
use aviary_core::api::CreateSandboxRequest;
use aviary_server::RunningServer;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The tiers, in the order of the table.
const TIERS: [Runtime; 4] = [
    Runtime::Crun,
    Runtime::Runc,
    Runtime::Runsc,
    Runtime::Docker,
];
/// How long the idle sandboxes of a memory round sit before they are read.
const SETTLE: Duration = Duration::from_secs(5);
/// Memory rounds per tier (the median is shown; another build on the
/// machine moves `MemAvailable`).
const MEM_ROUNDS: usize = 5;
/// Hibernate → wake rounds on runsc.
const CHECKPOINT_ROUNDS: usize = 3;

fn progress(line: &str) {
    eprintln!("bench tiers: {line}");
}

fn on(rt: Runtime) -> CreateSandboxRequest {
    CreateSandboxRequest {
        runtime: Some(rt.as_str().into()),
        ..Default::default()
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// The first line of `binary --version`, or why there is none.
fn version_of(binary: &str) -> Result<String, String> {
    match Command::new(binary).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_owned()),
        Ok(o) => Err(format!(
            "`{binary} --version` failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("`{binary}` is not installed ({e})")),
    }
}

/// What was measured of one tier.
#[derive(Default)]
struct Tier {
    version: String,
    /// Why the tier was not measured.
    skipped: Option<String>,
    cold: Vec<Duration>,
    exec: Vec<Duration>,
    /// Per memory round: cgroup bytes summed over the idle sandboxes, and
    /// the `MemAvailable` drop (KiB, may be negative on a busy machine).
    cgroup_bytes: Vec<u64>,
    mem_drop_kib: Vec<i64>,
    pids: Vec<u64>,
}

pub async fn run(iters: usize, idle: usize) -> anyhow::Result<()> {
    anyhow::ensure!(iters > 0, "tiers needs at least one iteration");
    anyhow::ensure!(idle > 0, "tiers needs at least one idle sandbox");
    let load_before = load_average();
    let work = crate::work_dir()?;
    let mut tiers: Vec<(Runtime, Tier)> = TIERS.iter().map(|r| (*r, Tier::default())).collect();
    for (rt, t) in &mut tiers {
        let binary = if *rt == Runtime::Docker {
            "dockerd"
        } else {
            rt.as_str()
        };
        match version_of(binary) {
            Ok(v) => t.version = v,
            Err(why) => t.skipped = Some(why),
        }
    }
    if let Some(why) = &tiers[0].1.skipped {
        anyhow::bail!("crun is the reference tier and is missing: {why}");
    }
    let mut docker = None;
    if tiers[3].1.skipped.is_none() {
        match Docker::start(work.path()).await {
            Ok(d) => docker = Some(d),
            Err(e) => tiers[3].1.skipped = Some(format!("dockerd did not start: {e:#}")),
        }
    }
    let socket = docker.as_ref().map(|d| d.dir.join("docker.sock"));
    let measured = measure(work.path(), socket.as_deref(), &mut tiers, iters, idle).await;
    if let Some(d) = docker {
        d.stop();
    }
    report(&tiers, &measured?, iters, idle, &load_before);
    Ok(())
}

async fn start(
    work: &Path,
    runtimes: Vec<Runtime>,
    socket: Option<&Path>,
) -> anyhow::Result<RunningServer> {
    let socket = socket.map(Path::to_path_buf);
    crate::start_server_with(work, move |cfg| {
        cfg.control.settings.server.runtimes = runtimes;
        if let Some(s) = socket {
            cfg.control.settings.server.docker_socket = s;
        }
    })
    .await
}

/// One server serving every tier that is present. When it does not start
/// (a runtime's self-check fails), each tier is tried beside crun alone,
/// the failing ones are skipped with their error, and the rest served.
async fn start_all(
    work: &Path,
    socket: Option<&Path>,
    tiers: &mut [(Runtime, Tier)],
) -> anyhow::Result<RunningServer> {
    let present = |tiers: &[(Runtime, Tier)]| -> Vec<Runtime> {
        tiers
            .iter()
            .filter(|(_, t)| t.skipped.is_none())
            .map(|(r, _)| *r)
            .collect()
    };
    let first = match start(&work.join("all"), present(tiers), socket).await {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    progress(&format!(
        "the server with every tier did not start ({first:#}); trying each tier beside crun"
    ));
    for (rt, t) in tiers.iter_mut().skip(1) {
        if t.skipped.is_some() {
            continue;
        }
        let dir = work.join(format!("probe-{}", rt.as_str()));
        match start(&dir, vec![Runtime::Crun, *rt], socket).await {
            Ok(s) => s.stop().await?,
            Err(e) => t.skipped = Some(format!("the server's self-check failed: {e:#}")),
        }
    }
    start(&work.join("rest"), present(tiers), socket)
        .await
        .context("the server with the remaining tiers")
}

async fn measure(
    work: &Path,
    socket: Option<&Path>,
    tiers: &mut [(Runtime, Tier)],
    iters: usize,
    idle: usize,
) -> anyhow::Result<Result<Checkpoint, String>> {
    let server = start_all(work, socket, tiers).await?;
    // no sandbox of this run outlives it, on any runtime
    let _sweeps: Vec<SweepOnDrop> = server
        .control_plane
        .runtimes
        .all()
        .iter()
        .map(|r| SweepOnDrop(r.runtime.clone()))
        .collect();
    let client = Client::new(&server.url(), &server.admin_key);
    for (rt, t) in tiers.iter() {
        if let Some(why) = &t.skipped {
            progress(&format!("SKIPPED tier {}: {why}", rt.as_str()));
        }
    }

    // warm-up (the first docker create imports the template as an image)
    progress("warm-up");
    for _ in 0..2 {
        for i in live(tiers) {
            if let Err(e) = cold_cycle(&client, tiers[i].0).await {
                fail(&mut tiers[i], "warm-up", e);
            }
        }
    }

    progress(&format!("cold create → first exec, {iters} per tier"));
    for _ in 0..iters {
        for i in live(tiers) {
            match cold_cycle(&client, tiers[i].0).await {
                Ok(d) => tiers[i].1.cold.push(d),
                Err(e) => fail(&mut tiers[i], "cold creates", e),
            }
        }
    }
    server.control_plane.reclaims.settled().await;

    progress("exec round trips");
    let mut kept = Vec::new();
    for i in live(tiers) {
        match client.create_sandbox(&on(tiers[i].0)).await {
            Ok(s) => kept.push((i, s.sandbox.id)),
            Err(e) => fail(&mut tiers[i], "exec round trips", e.into()),
        }
    }
    for n in 0..(iters * 7) {
        for (i, id) in &kept {
            if tiers[*i].1.skipped.is_some() {
                continue;
            }
            let t = Instant::now();
            match exec_true(&client, id.as_str()).await {
                Ok(()) if n >= exec_warmups(iters) => tiers[*i].1.exec.push(t.elapsed()),
                Ok(()) => {}
                Err(e) => fail(&mut tiers[*i], "exec round trips", e),
            }
        }
    }

    // memory checkpoint / restore on runsc, of its kept (idle) sandbox
    let mut checkpoint = Err("runsc was not measured".to_owned());
    if let Some((_, id)) = kept
        .iter()
        .find(|(i, _)| tiers[*i].0 == Runtime::Runsc && tiers[*i].1.skipped.is_none())
    {
        progress("hibernate → wake on runsc");
        let image = server
            .cfg
            .runtime_state_dir_of(Runtime::Runsc)
            .join(format!("{id}.checkpoint"));
        checkpoint = hibernate_wake(&client, id.as_str(), &image)
            .await
            .map_err(|e| format!("{e:#}"));
        if let Err(e) = &checkpoint {
            progress(&format!("runsc hibernate → wake failed: {e}"));
        }
    }
    for (_, id) in &kept {
        if let Err(e) = client.delete_sandbox(id.as_str(), None).await {
            progress(&format!("delete of {id}: {e}"));
        }
    }
    server.control_plane.reclaims.settled().await;

    for round in 0..MEM_ROUNDS {
        for i in live(tiers) {
            let rt = tiers[i].0;
            progress(&format!(
                "memory round {}/{MEM_ROUNDS}: {idle} idle on {}",
                round + 1,
                rt.as_str()
            ));
            match idle_memory(&server, &client, rt, idle).await {
                Ok((cg, drop_kib, pids)) => {
                    let t = &mut tiers[i].1;
                    t.cgroup_bytes.push(cg);
                    t.mem_drop_kib.push(drop_kib);
                    t.pids.push(pids);
                }
                Err(e) => fail(&mut tiers[i], "memory rounds", e),
            }
        }
    }
    server.stop().await?;
    Ok(checkpoint)
}

/// Exec round trips per tier not counted (of `iters * 7`): 10, fewer on a
/// short run.
fn exec_warmups(iters: usize) -> usize {
    10.min(iters * 7 / 2)
}

/// The tiers still measured.
fn live(tiers: &[(Runtime, Tier)]) -> Vec<usize> {
    (0..tiers.len())
        .filter(|i| tiers[*i].1.skipped.is_none())
        .collect()
}

/// A tier that fails stops being measured (its row says why); the others
/// go on.
fn fail(tier: &mut (Runtime, Tier), phase: &str, e: anyhow::Error) {
    let why = format!("failed in the {phase}: {e:#}");
    progress(&format!("tier {}: {why}", tier.0.as_str()));
    tier.1.skipped = Some(why);
}

/// Create on `rt` → exec `true` completes (timed), then delete.
async fn cold_cycle(c: &Client, rt: Runtime) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let s = c.create_sandbox(&on(rt)).await?;
    let id = s.sandbox.id;
    let r = exec_true(c, id.as_str()).await;
    let d = t.elapsed();
    let deleted = c.delete_sandbox(id.as_str(), None).await;
    anyhow::ensure!(
        s.sandbox.runtime == rt.as_str(),
        "asked {}, got {}",
        rt.as_str(),
        s.sandbox.runtime
    );
    r?;
    deleted?;
    Ok(d)
}

async fn exec_true(c: &Client, id: &str) -> anyhow::Result<()> {
    let r = c.exec(id, &true_cmd()).await?;
    anyhow::ensure!(r.exit_code == 0, "exec `true` failed: {r:?}");
    Ok(())
}

/// Hibernate → wake rounds on runsc.
struct Checkpoint {
    hibernate: Stats,
    wake: Stats,
    image_mib: f64,
}

/// [`CHECKPOINT_ROUNDS`] times: hibernate (answered once runsc saved the
/// memory image and stopped), the image's size on disk, then wake → the
/// first exec completes.
async fn hibernate_wake(c: &Client, id: &str, image: &Path) -> anyhow::Result<Checkpoint> {
    let (mut hib, mut wake, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..CHECKPOINT_ROUNDS {
        let t = Instant::now();
        let h = c.sandbox_action(id, "hibernate", None).await?;
        hib.push(t.elapsed());
        anyhow::ensure!(
            h.state == aviary_core::SandboxState::Hibernating,
            "hibernate left {:?}",
            h.state
        );
        anyhow::ensure!(
            image.is_dir(),
            "no memory image at {} after hibernate",
            image.display()
        );
        sizes.push(dir_bytes(image));
        let t = Instant::now();
        c.sandbox_action(id, "wake", None).await?;
        let r = c.exec(id, &true_cmd()).await?;
        wake.push(t.elapsed());
        anyhow::ensure!(r.exit_code == 0, "exec after wake: {r:?}");
    }
    sizes.sort_unstable();
    Ok(Checkpoint {
        hibernate: stats(hib),
        wake: stats(wake),
        image_mib: sizes[sizes.len() / 2] as f64 / (1 << 20) as f64,
    })
}

/// Bytes of the files under `dir` as allocated on disk.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack: Vec<PathBuf> = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.blocks() * 512,
                Err(_) => {}
            }
        }
    }
    total
}

/// `MemAvailable` in KiB, the median of five reads 200 ms apart.
async fn mem_available_steady() -> u64 {
    let mut v = Vec::new();
    for _ in 0..5 {
        v.push(mem_available_kib());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    v.sort_unstable();
    v[v.len() / 2]
}

/// `idle` sandboxes on `rt`, left idle for [`SETTLE`]: the sum of their
/// cgroup memory (bytes), the drop of `MemAvailable` while they are alive
/// (KiB; from the mean of before the first create and after their
/// deletes were reclaimed), and the processes in their cgroups.
async fn idle_memory(
    server: &RunningServer,
    client: &Client,
    rt: Runtime,
    idle: usize,
) -> anyhow::Result<(u64, i64, u64)> {
    server.control_plane.reclaims.settled().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = mem_available_steady().await;
    let mut ids = Vec::new();
    let measured = async {
        for _ in 0..idle {
            ids.push(client.create_sandbox(&on(rt)).await?.sandbox.id);
        }
        tokio::time::sleep(SETTLE).await;
        let after = mem_available_steady().await;
        let (mut cg, mut pids) = (0u64, 0u64);
        for id in &ids {
            let u = client.sandbox_usage(id.as_str()).await?;
            cg += u.memory_bytes;
            pids += u.pids;
        }
        anyhow::Ok((cg, after, pids))
    }
    .await;
    for id in &ids {
        client.delete_sandbox(id.as_str(), None).await?;
    }
    server.control_plane.reclaims.settled().await;
    let (cg, during, pids) = measured?;
    // the baseline is the mean of before and after: memory that something
    // else on the machine took or gave back at a steady rate cancels out
    tokio::time::sleep(Duration::from_secs(2)).await;
    let gone = mem_available_steady().await;
    Ok((cg, (before as i64 + gone as i64) / 2 - during as i64, pids))
}

fn median<T: Copy + Ord>(v: &[T]) -> Option<T> {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len() / 2).copied()
}

fn report(
    tiers: &[(Runtime, Tier)],
    checkpoint: &Result<Checkpoint, String>,
    iters: usize,
    idle: usize,
    load_before: &str,
) {
    let load_after = load_average();
    let mib = |b: f64| b / (1 << 20) as f64;
    println!("### Isolation tiers side by side (issue 11)\n");
    println!(
        "One Aviary server serving every tier (`docker` on a dockerd started for the run: \
         overlay2, no bridge, its default runc underneath), the busybox template, the default \
         class. Times in milliseconds, p50 / p90 over n; creates alternate tier by tier, execs \
         exec by exec, so all tiers see the same machine load. Memory: {idle} idle sandboxes \
         of one tier alive for {} s, {MEM_ROUNDS} rounds (tiers alternating round by round), \
         the median round shown, the spread of the rounds in brackets.\n",
        SETTLE.as_secs()
    );
    println!(
        "| tier | cold create → first exec (API) p50 / p90 ms (n) | exec round trip of `true` \
         (API → envd) p50 / p90 ms (n) | cgroup memory per idle sandbox MiB | host \
         `MemAvailable` drop per idle sandbox MiB | processes and threads per idle sandbox (its cgroup) | \
         memory checkpoint / restore |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (rt, t) in tiers {
        let name = format!("`{}` ({})", rt.as_str(), t.version);
        if let Some(why) = &t.skipped {
            println!(
                "| `{}` | skipped: {} | | | | | |",
                rt.as_str(),
                why.replace('|', "/").replace('\n', " ")
            );
            continue;
        }
        let times = |v: &[Duration]| {
            if v.is_empty() {
                "n/a".to_owned()
            } else {
                let s = stats(v.to_vec());
                format!("{:.1} / {:.1} ({})", s.p50, s.p90, s.n)
            }
        };
        let k = idle as f64;
        let cg = median(&t.cgroup_bytes)
            .map(|b| {
                let lo = t.cgroup_bytes.iter().min().copied().unwrap_or(b);
                let hi = t.cgroup_bytes.iter().max().copied().unwrap_or(b);
                format!(
                    "{:.2} [{:.2}–{:.2}]",
                    mib(b as f64) / k,
                    mib(lo as f64) / k,
                    mib(hi as f64) / k
                )
            })
            .unwrap_or_else(|| "n/a".into());
        let drop = median(&t.mem_drop_kib)
            .map(|d| {
                let lo = t.mem_drop_kib.iter().min().copied().unwrap_or(d);
                let hi = t.mem_drop_kib.iter().max().copied().unwrap_or(d);
                format!(
                    "{:.2} [{:.2}–{:.2}]",
                    d as f64 / 1024.0 / k,
                    lo as f64 / 1024.0 / k,
                    hi as f64 / 1024.0 / k
                )
            })
            .unwrap_or_else(|| "n/a".into());
        let pids = median(&t.pids)
            .map(|p| format!("{:.1}", p as f64 / k))
            .unwrap_or_else(|| "n/a".into());
        let ck = if *rt == Runtime::Runsc {
            match checkpoint {
                Ok(c) => format!(
                    "hibernate {:.0} ms, wake → first exec {:.0} ms (p50 of {}; idle sandbox, \
                     image {:.1} MiB); a process holding 100 MB: see the gVisor tier",
                    c.hibernate.p50, c.wake.p50, c.hibernate.n, c.image_mib
                ),
                Err(e) => format!("failed: {}", e.replace('|', "/").replace('\n', " ")),
            }
        } else {
            "— (hibernate keeps files only)".into()
        };
        println!(
            "| {name} | {} | {} | {cg} | {drop} | {pids} | {ck} |",
            times(&t.cold),
            times(&t.exec)
        );
    }
    println!(
        "\n- **cgroup memory** is `memory_bytes` of `GET /v1/sandboxes/{{id}}/usage`: what the \
         kernel charges to the sandbox's memory cgroup (its processes' anonymous memory, page \
         cache and kernel memory charged to it). For `runsc` it is the cgroup runsc places the gVisor \
         sandbox in; for `docker` it is the container's cgroup (dockerd, containerd and the \
         shim are outside it).\n\
         - **`MemAvailable` drop** is the host's `MemAvailable` (median of 5 reads) with the \
         {idle} sandboxes settled, subtracted from the mean of the reads before their creates \
         and after their deletes were reclaimed (so a steady drift of the rest of the machine \
         cancels), divided by {idle}: everything the host gave up, inside the cgroups or not \
         (the runtime's processes outside the sandbox's cgroup, containerd shims, kernel \
         objects: mounts, namespaces, page tables, minus page cache the kernel counts as \
         available). Other work on the machine (builds) still moves it, so read the spread; a \
         negative value means the deletes left memory in use or something else freed memory \
         meanwhile.\n\
         - **Checkpoint / restore** keeps processes only on `runsc` (`runsc checkpoint` / \
         `restore`); on the other tiers hibernate snapshots the files and wake starts the \
         sandbox again.\n\
         - Cold create: {iters} per tier after 2 warm-ups; exec: {} per tier after {} warm-ups.\n\
         - 1-minute load average: {load_before} before the run, {load_after} after (on {} \
         cores: the times move with it, the memory much less).",
        iters * 7 - exec_warmups(iters),
        exec_warmups(iters),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
}
