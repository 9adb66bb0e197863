//! `aviary-bench`: measures the core path side by side, in one run, on this
//! machine, and prints a markdown report (scripts/bench.sh puts it into
//! BENCHMARKS.md).
//!
//! - cold create → first exec through the API vs raw `crun run` of an
//!   equivalent bundle (the floor) vs `docker run --rm` of the same rootfs;
//! - exec round trip of `true` through the API vs `crun exec` vs `docker exec`;
//! - host memory per idle sandbox.
//!
//! `aviary-bench planner` runs only the planner scoring ([`planner`]);
//! `aviary-bench pool-churn [CYCLES]` a warm pool under create → exec → rm
//! churn, hits and hit/miss latency ([`pool_churn`]); `aviary-bench leases
//! [CYCLES]` lease operations per second on each lease store beside
//! `redis-benchmark` ([`leases`]); `aviary-bench replicas [ITERATIONS]`
//! distributed create → first exec and Lost → restored times ([`replicas`]);
//! `aviary-bench docker-runtime [ITERATIONS]` the `docker` runtime beside
//! crun in one server ([`docker_runtime`]).
//! `aviary-bench scale [MAX] [TSV]` sustained creates/s and the cost per idle
//! sandbox at 10 / 100 / 500 / 1000 alive ([`scale`]).
//! `aviary-bench tiers [ITERATIONS] [IDLE]` the isolation tiers (crun, runc,
//! runsc, docker) side by side in one server ([`tiers`]).
//! `aviary-bench exec-path [ITERATIONS]` where an exec's time goes beside
//! envd's own round trip, and `aviary run` as a user runs it ([`exec_path`]).
#![forbid(unsafe_code)]

mod docker_runtime;
mod exec_path;
mod leases;
mod planner;
mod pool_churn;
mod replicas;
mod scale;
mod tiers;

use anyhow::{bail, Context};
use aviary_client::Client;
use aviary_core::api::{CreateSandboxRequest, ExecRequest};
use aviary_runtime::{SpawnIsolation, SpawnRequest, SpawnStdio, Spawner};
use aviary_runtime_oci::ProcessSpawner;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Destroys every sandbox the runtime still has when dropped.
struct SweepOnDrop(std::sync::Arc<dyn aviary_runtime::Runtime>);

impl Drop for SweepOnDrop {
    fn drop(&mut self) {
        let runtime = self.0.clone();
        let swept = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(ids) = runtime.list().await {
                    for id in ids {
                        if let Err(e) = runtime.destroy(&id).await {
                            eprintln!("bench cleanup of {id}: {e}");
                        }
                    }
                }
            });
        });
        let _ = swept.join();
    }
}

/// The scratch directory of one run (data dir, templates, bundles).
fn work_dir() -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new()
        .prefix("avbench")
        .tempdir_in("/var/tmp")?)
}

/// Starts the server every API measurement runs against, in this process, on
/// `127.0.0.1:0`, with its data under `work`: the busybox template, one pool
/// (`python-small` on busybox, empty until `pool set`), and waits until it is
/// ready.
async fn start_server(work: &Path) -> anyhow::Result<aviary_server::RunningServer> {
    start_server_with(work, |_| {}).await
}

/// [`start_server`] with its configuration changed by `edit` first.
async fn start_server_with(
    work: &Path,
    edit: impl FnOnce(&mut aviary_server::config::ServerConfig),
) -> anyhow::Result<aviary_server::RunningServer> {
    let envd = PathBuf::from(
        std::env::var("AVIARY_ENVD")
            .context("AVIARY_ENVD must name the static envd (scripts/bench.sh sets it)")?,
    );
    let mut cfg = aviary_server::config::ServerConfig::new(work.join("data"), envd);
    cfg.listen = "127.0.0.1:0".parse()?;
    cfg.control.default_template = "busybox".into();
    cfg.control.default_template_source = aviary_server::config::DefaultTemplateSource::Busybox;
    cfg.templates_dir = Some(work.join("templates"));
    // The benchmark measures latency from one key on a 2-core machine: the
    // per-key rate limit and the scheduler's over-commit bound are not what
    // is measured here (edge.rs and robustness.rs test those).
    cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
    cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    // (`scale` keeps a thousand 1-CPU, 2 GiB sandboxes on 2 cores)
    cfg.control.settings.overcommit.cpu_ratio = 10_000.0;
    cfg.control.settings.overcommit.memory_ratio = 10_000.0;
    // nor the tenant's quota (64 live sandboxes by default)
    for t in &mut cfg.control.settings.tenants {
        t.max_sandboxes = t.max_sandboxes.max(2000);
        t.max_cpu = t.max_cpu.max(4000.0);
        t.max_memory_mb = t.max_memory_mb.max(8 << 20);
    }
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: POOL_CLASS.into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 0,
        pool_max: 64,
        buffer_min: 0,
        buffer_max: 0,
    }];
    edit(&mut cfg);
    let server = aviary_server::start(cfg, |_| {}).await?;
    if server.control_plane.wait_ready().await != aviary_server::ops::Readiness::Ready {
        bail!("server did not get ready");
    }
    Ok(server)
}

/// The class of the one pool [`start_server`] configures (the class a default
/// create is planned into).
const POOL_CLASS: &str = "python-small";

struct Stats {
    p50: f64,
    p90: f64,
    n: usize,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |q: f64| ms(v[((v.len() as f64 - 1.0) * q).round() as usize]);
    Stats {
        p50: at(0.5),
        p90: at(0.9),
        n: v.len(),
    }
}

fn row(name: &str, s: &Result<Stats, String>) -> String {
    match s {
        Ok(s) => format!("| {name} | {:.2} | {:.2} | {} |", s.p50, s.p90, s.n),
        Err(why) => format!("| {name} | n/a | n/a | {why} |"),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("planner") {
        return planner::run();
    }
    if args.get(1).map(String::as_str) == Some("leases") {
        let cycles = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000);
        return leases::run(cycles).await;
    }
    if args.get(1).map(String::as_str) == Some("pool-churn") {
        let cycles = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(50);
        return pool_churn::run(cycles).await;
    }
    if args.get(1).map(String::as_str) == Some("docker-runtime") {
        let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(30);
        return docker_runtime::run(iters).await;
    }
    if args.get(1).map(String::as_str) == Some("scale") {
        let max = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
        return scale::run(max, args.get(3).map(Path::new)).await;
    }
    if args.get(1).map(String::as_str) == Some("tiers") {
        let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(30);
        let idle = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10);
        return tiers::run(iters, idle).await;
    }
    if args.get(1).map(String::as_str) == Some("exec-path") {
        let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(30);
        return exec_path::run(iters).await;
    }
    if args.get(1).map(String::as_str) == Some("replicas") {
        let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
        return replicas::run(iters).await;
    }
    let iters: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(30);
    let work = work_dir()?;
    let server = start_server(work.path()).await?;
    // Whatever happens below (an error returns early), no sandbox, mount or
    // loop device of this run outlives it.
    let _sweep = SweepOnDrop(server.control_plane.runtime().clone());
    let client = Client::new(&server.url(), &server.admin_key);
    let state_dir = server.cfg.runtime_state_dir();
    let rootfs = aviary_templates::TemplateStore::open(server.cfg.templates_root())?
        .get("busybox")?
        .context("busybox template")?
        .rootfs;

    // warm-up
    for _ in 0..3 {
        let s = client
            .create_sandbox(&CreateSandboxRequest::default())
            .await?;
        client.exec(s.sandbox.id.as_str(), &true_cmd()).await?;
        client.delete_sandbox(s.sandbox.id.as_str(), None).await?;
    }

    // 1. cold create -> first exec through the API
    let mut api_cold = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        let s = client
            .create_sandbox(&CreateSandboxRequest::default())
            .await?;
        let r = client.exec(s.sandbox.id.as_str(), &true_cmd()).await?;
        api_cold.push(t.elapsed());
        anyhow::ensure!(r.exit_code == 0, "exec failed: {r:?}");
        client.delete_sandbox(s.sandbox.id.as_str(), None).await?;
    }

    // a sandbox kept for the exec round trips and as the bundle template
    let keep = client
        .create_sandbox(&CreateSandboxRequest::default())
        .await?
        .sandbox
        .id;
    let bundle_cfg = state_dir.join(keep.as_str()).join("bundle/config.json");
    let crun_cold = crun_floor(&bundle_cfg, &rootfs, work.path(), iters, &state_dir).await;

    // 2. exec round trip
    let mut api_exec = Vec::new();
    for i in 0..(iters * 7) {
        let t = Instant::now();
        let r = client.exec(keep.as_str(), &true_cmd()).await?;
        if i >= 10 {
            api_exec.push(t.elapsed());
        }
        anyhow::ensure!(r.exit_code == 0);
    }
    let rt = aviary_runtime_oci::OciRuntime::new(aviary_runtime_oci::OciConfig::new(
        aviary_runtime_oci::OciBinary::Crun,
        state_dir.clone(),
    ))?;
    let mut crun_exec = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        let out = rt.exec(&keep, &["/bin/true"]).await?;
        crun_exec.push(t.elapsed());
        anyhow::ensure!(
            out.success(),
            "crun exec failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // 3. memory per idle sandbox
    let mut ids = Vec::new();
    for _ in 0..10 {
        ids.push(
            client
                .create_sandbox(&CreateSandboxRequest::default())
                .await?
                .sandbox
                .id,
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (mut rss_kib, mut cg_bytes) = (0u64, 0u64);
    for id in &ids {
        let procs =
            std::fs::read_to_string(format!("/sys/fs/cgroup/memory/aviary/{id}/cgroup.procs"))
                .unwrap_or_default();
        for pid in procs.lines() {
            rss_kib += vm_rss_kib(pid);
        }
        cg_bytes += std::fs::read_to_string(format!(
            "/sys/fs/cgroup/memory/aviary/{id}/memory.usage_in_bytes"
        ))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    }
    let per_rss_mib = rss_kib as f64 / 1024.0 / ids.len() as f64;
    let per_cg_mib = cg_bytes as f64 / (1 << 20) as f64 / ids.len() as f64;
    for id in &ids {
        client.delete_sandbox(id.as_str(), None).await?;
    }

    // 4. warm pool: refill rate, then acquire -> first exec on hits
    let warm_n = iters.min(20) as u32;
    let t = Instant::now();
    client.set_pool(POOL_CLASS, warm_n, 64).await?;
    wait_idle(&client, warm_n as u64).await?;
    let refill_rate = warm_n as f64 / t.elapsed().as_secs_f64();
    let mut warm = Vec::new();
    let mut warm_ids = Vec::new();
    for _ in 0..warm_n {
        let t = Instant::now();
        let s = client
            .create_sandbox(&CreateSandboxRequest::default())
            .await?;
        let r = client.exec(s.sandbox.id.as_str(), &true_cmd()).await?;
        let d = t.elapsed();
        anyhow::ensure!(r.exit_code == 0);
        if s.decision.reason.starts_with("warm pool hit") {
            warm.push(d);
        }
        warm_ids.push(s.sandbox.id);
    }
    client.set_pool(POOL_CLASS, 0, 0).await?;
    for id in &warm_ids {
        client.delete_sandbox(id.as_str(), None).await?;
    }

    // docker, same rootfs
    let docker = Docker::start(work.path()).await;
    let (docker_cold, docker_exec) = match &docker {
        Ok(d) => d.measure(&rootfs, iters).await,
        Err(e) => (
            Err(format!("docker unavailable: {e}")),
            Err(format!("docker unavailable: {e}")),
        ),
    };
    if let Ok(d) = docker {
        d.stop();
    }
    client.delete_sandbox(keep.as_str(), None).await?;
    server.stop().await?;

    let api_cold = stats(api_cold);
    let api_cold_copy = Stats {
        p50: api_cold.p50,
        p90: api_cold.p90,
        n: api_cold.n,
    };
    let api_exec = stats(api_exec);
    println!("### Core path (issue 2)\n");
    println!(
        "Same rootfs everywhere (the busybox template). Milliseconds; p50 / p90 over n runs.\n"
    );
    println!("| cold create → first exec completes | p50 ms | p90 ms | n |\n|---|---|---|---|");
    println!(
        "{}",
        row(
            "Aviary API (create + exec `true`)",
            &Ok(Stats { ..api_cold })
        )
    );
    println!(
        "{}",
        row("raw `crun run` of an equivalent bundle (floor)", &crun_cold)
    );
    println!(
        "{}",
        row(
            "`docker run --rm` (same rootfs, --network none)",
            &docker_cold
        )
    );
    let ratio = |a: &Stats, b: &Result<Stats, String>| {
        b.as_ref()
            .map(|b| format!("{:.2}×", a.p50 / b.p50))
            .unwrap_or_else(|_| "n/a".into())
    };
    println!();
    println!(
        "Aviary / crun floor at p50: {} (target ≤ 1.5×). docker / Aviary at p50: {} (target ≥ 5×).\n",
        ratio(&api_cold, &crun_cold),
        docker_cold.as_ref().map(|d| format!("{:.1}×", d.p50 / api_cold.p50)).unwrap_or_else(|_| "n/a".into())
    );
    println!("| exec round trip of `true` in a running sandbox | p50 ms | p90 ms | n |\n|---|---|---|---|");
    println!(
        "{}",
        row("Aviary API (HTTP → envd)", &Ok(Stats { ..api_exec }))
    );
    println!(
        "{}",
        row("`crun exec --no-new-privs`", &Ok(stats(crun_exec)))
    );
    println!("{}", row("`docker exec`", &docker_exec));
    println!("\nTarget: Aviary p50 ≤ 2 ms.\n");
    println!("| warm pool | p50 ms | p90 ms | n |\n|---|---|---|---|");
    println!(
        "{}",
        row(
            "warm-pool acquire → first exec completes (API)",
            &(if warm.is_empty() {
                Err("no pool hits".to_owned())
            } else {
                Ok(stats(warm))
            })
        )
    );
    println!(
        "{}",
        row(
            "cold create → first exec completes (API, from above)",
            &Ok(Stats { ..api_cold_copy })
        )
    );
    println!("\nTarget: warm p50 ≤ 5 ms. Pool refill rate on this machine: {refill_rate:.1} sandboxes/s ({warm_n} sandboxes from empty).\n");
    println!("| host memory per idle sandbox | MiB |\n|---|---|");
    println!("| RSS of everything Aviary runs per sandbox (envd, PID 1; crun exits after start) | {per_rss_mib:.2} |");
    println!("| the sandbox cgroup's memory.usage_in_bytes (RSS + page cache charged to it) | {per_cg_mib:.2} |");
    println!("\nTarget: ≤ 3 MiB.");
    Ok(())
}

async fn wait_idle(c: &Client, want: u64) -> anyhow::Result<()> {
    pool_when(c, Duration::from_millis(10), |v| {
        v["idle"].as_u64() >= Some(want)
    })
    .await
    .with_context(|| format!("pool did not fill to {want}"))?;
    Ok(())
}

/// The view of the [`POOL_CLASS`] pool (`GET /v1/pools`).
async fn pool_view(c: &Client) -> anyhow::Result<serde_json::Value> {
    let v = c.pools().await?;
    v["pools"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["class"] == POOL_CLASS))
        .cloned()
        .with_context(|| format!("no {POOL_CLASS} pool in {v}"))
}

/// Polls the pool's view every `poll` until `ready(view)` holds and returns
/// that view; gives up after 60 s, so a pool that never refills fails the
/// run instead of hanging it.
async fn pool_when(
    c: &Client,
    poll: Duration,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = pool_view(c).await?;
        if ready(&v) {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("pool stayed at {v}");
        }
        tokio::time::sleep(poll).await;
    }
}

fn true_cmd() -> ExecRequest {
    ExecRequest {
        cmd: Some(vec!["true".into()]),
        ..Default::default()
    }
}

fn vm_rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// The sandbox's own OCI spec changed only where the floor must differ:
/// `/bin/true` as the process, the template rootfs read-only as root (no
/// overlay), no user namespace, no binds into the sandbox's state dir.
fn floor_spec(
    config_json: &Path,
    rootfs: &Path,
    state_dir: &Path,
) -> anyhow::Result<serde_json::Value> {
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(config_json)?)?;
    spec["process"]["args"] = serde_json::json!(["/bin/true"]);
    spec["root"] = serde_json::json!({"path": rootfs, "readonly": true});
    // The floor runs without the sandbox's user namespace: the shared
    // template is owned by host root and only an idmapped mount (which
    // Aviary makes per sandbox) would let the namespace's root read it.
    // So the floor does less than Aviary does (RUNTIME-NOTES: a user
    // namespace costs crun 3–7 ms); the ratio is conservative.
    if let Some(linux) = spec["linux"].as_object_mut() {
        linux.remove("uidMappings");
        linux.remove("gidMappings");
        if let Some(ns) = linux.get_mut("namespaces").and_then(|n| n.as_array_mut()) {
            ns.retain(|n| n["type"] != "user");
        }
    }
    let sd = state_dir.to_string_lossy().into_owned();
    if let Some(m) = spec["mounts"].as_array_mut() {
        m.retain(|m| {
            !m["source"].as_str().is_some_and(|s| s.starts_with(&sd))
                && m["destination"] != "/.aviary/envd"
        });
    }
    Ok(spec)
}

/// `crun run` of the sandbox's own bundle, changed only where it must be:
/// `/bin/true` as the process, the template rootfs read-only as root (no
/// overlay), no binds into the sandbox's state dir, its own cgroup path.
async fn crun_floor(
    config_json: &Path,
    rootfs: &Path,
    work: &Path,
    iters: usize,
    state_dir: &Path,
) -> Result<Stats, String> {
    let inner = async {
        let mut spec = floor_spec(config_json, rootfs, state_dir)?;
        let bundle = work.join("floor-bundle");
        std::fs::create_dir_all(&bundle)?;
        let root = work.join("floor-crun");
        let mut out = Vec::new();
        for i in 0..iters + 3 {
            spec["linux"]["cgroupsPath"] = serde_json::json!(format!("/aviary-bench/floor-{i}"));
            std::fs::write(bundle.join("config.json"), serde_json::to_vec(&spec)?)?;
            let mut req = SpawnRequest::new(
                "crun",
                vec![
                    "--root".into(),
                    root.to_string_lossy().into(),
                    "run".into(),
                    "--bundle".into(),
                    bundle.to_string_lossy().into(),
                    format!("floor-{i}"),
                ],
            );
            req.stdio = SpawnStdio::Capture;
            req.isolation = SpawnIsolation::PrivateMountNamespace {
                detach: vec![PathBuf::from("/sys/fs/cgroup/unified")],
            };
            let t = Instant::now();
            let o = ProcessSpawner.run(&req).await?;
            let d = t.elapsed();
            if !o.success() {
                anyhow::bail!("crun run failed: {}", String::from_utf8_lossy(&o.stderr));
            }
            if i >= 3 {
                out.push(d);
            }
        }
        for ctrl in std::fs::read_dir("/sys/fs/cgroup")?.flatten() {
            let _ = std::fs::remove_dir(ctrl.path().join("aviary-bench"));
        }
        anyhow::Ok(stats(out))
    };
    inner.await.map_err(|e| format!("{e:#}"))
}

struct Docker {
    dir: PathBuf,
    pid: u32,
}

impl Docker {
    async fn start(work: &Path) -> anyhow::Result<Docker> {
        let dir = work.join("docker");
        std::fs::create_dir_all(&dir)?;
        let d = |p: &str| dir.join(p).to_string_lossy().into_owned();
        let child = Command::new("dockerd")
            .args([
                "--data-root",
                &d("data"),
                "--exec-root",
                &d("exec"),
                "--pidfile",
                &d("dockerd.pid"),
                "-H",
                &format!("unix://{}", d("docker.sock")),
            ])
            .args([
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--bridge=none",
                "--storage-driver=overlay2",
            ])
            .stdout(std::fs::File::create(dir.join("dockerd.log"))?)
            .stderr(std::fs::File::create(dir.join("dockerd.err"))?)
            .spawn()
            .context("starting dockerd (apt-get install docker.io)")?;
        let dk = Docker {
            dir,
            pid: child.id(),
        };
        for _ in 0..100 {
            if dk.docker(&["version"]).is_ok() {
                return Ok(dk);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        dk.stop();
        bail!("dockerd did not answer within 10 s")
    }

    fn docker(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("docker")
            .arg("-H")
            .arg(format!("unix://{}", self.dir.join("docker.sock").display()))
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!("docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    async fn measure(
        &self,
        rootfs: &Path,
        iters: usize,
    ) -> (Result<Stats, String>, Result<Stats, String>) {
        let import = || -> anyhow::Result<()> {
            let tar = self.dir.join("rootfs.tar");
            let st = Command::new("tar")
                .arg("-C")
                .arg(rootfs)
                .arg("-cf")
                .arg(&tar)
                .arg(".")
                .status()?;
            anyhow::ensure!(st.success(), "tar failed");
            self.docker(&["import", &tar.to_string_lossy(), "aviary-bench:busybox"])?;
            Ok(())
        };
        if let Err(e) = import() {
            let m = format!("docker import failed: {e:#}");
            return (Err(m.clone()), Err(m));
        }
        let mut cold = Vec::new();
        for i in 0..iters.min(30) + 2 {
            let t = Instant::now();
            let r = self.docker(&[
                "run",
                "--rm",
                "--network",
                "none",
                "aviary-bench:busybox",
                "/bin/true",
            ]);
            let d = t.elapsed();
            if let Err(e) = r {
                return (Err(format!("{e:#}")), Err("skipped".into()));
            }
            if i >= 2 {
                cold.push(d);
            }
        }
        let cid = match self.docker(&[
            "run",
            "-d",
            "--network",
            "none",
            "aviary-bench:busybox",
            "/bin/sleep",
            "100000",
        ]) {
            Ok(c) => c,
            Err(e) => return (Ok(stats(cold)), Err(format!("{e:#}"))),
        };
        let mut ex = Vec::new();
        for i in 0..iters + 2 {
            let t = Instant::now();
            if let Err(e) = self.docker(&["exec", &cid, "/bin/true"]) {
                return (Ok(stats(cold)), Err(format!("{e:#}")));
            }
            if i >= 2 {
                ex.push(t.elapsed());
            }
        }
        let _ = self.docker(&["rm", "-f", &cid]);
        (Ok(stats(cold)), Ok(stats(ex)))
    }

    fn stop(&self) {
        let _ = Command::new("kill").arg(self.pid.to_string()).status();
        for _ in 0..100 {
            if !Path::new(&format!("/proc/{}", self.pid)).exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // dockerd leaves its overlay mounts behind only on a crash; be sure
        let _ = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "grep -o '{}[^ ]*' /proc/mounts | sort -r | xargs -r -n1 umount -l",
                self.dir.display()
            ))
            .status();
    }
}
