//! `aviary-bench replicas [ITERATIONS]`: distributed mode (registry on
//! PostgreSQL, leases and locks on Redis) against the embedded server, in
//! one run, everything in this process on loopback:
//!
//! 1. **create → first exec**, ITERATIONS times per row, interleaved (one
//!    cycle of each row per round, the order rotated every round): the
//!    embedded server (SQLite, its own crun) as the baseline; three
//!    *stateless* replicas (no node name: they run no sandboxes) with two
//!    `aviary node` agents (real crun) registered through the API, every
//!    request to replica 1; the same three replicas round-robin, the create
//!    on replica i and the exec on replica i+1, so the exec goes through a
//!    replica that did not make the sandbox (the cross-replica attach path).
//!    The delete after each cycle is not timed.
//! 2. **Lost → restored**: one replica that runs sandboxes itself (node
//!    `bench-node`, its own crun, local snapshot store); a sandbox gets a
//!    file in /workspace and a snapshot, then, after a random wait of up to
//!    one reconciler interval, every process in its cgroups is killed with
//!    SIGKILL from the host (behind the control plane's back). Timed: kill → the `sandbox_lost` event (its registry timestamp;
//!    the state is also polled every 20 ms, but the reconciler restores in
//!    the same pass, so `Lost` may be too short to be seen) and kill →
//!    `recovered` event present and state `Idle` (polled every 20 ms). The
//!    file must be back, or the run fails. At the default reconciler
//!    interval and at 500 ms; the envd health probe stays at its default.
//!
//! Services come from `AVIARY_TEST_POSTGRES_URL` / `AVIARY_TEST_REDIS_URL`
//! (scripts/bench.sh starts them with scripts/services.sh); every run uses
//! fresh schemas and key prefixes (`bench_replicas_<random>…`), dropped at
//! the end with `psql` / `redis-cli` when those are installed.

use crate::{row, stats, true_cmd, Stats, SweepOnDrop, POOL_CLASS};
use anyhow::{bail, ensure, Context};
use aviary_client::Client;
use aviary_config::{DistributedSettings, ServiceKind, ServiceUrl};
use aviary_core::api::{CreateSandboxRequest, ExecRequest};
use aviary_core::SandboxState;
use aviary_server::config::{DefaultTemplateSource, ServerConfig};
use aviary_server::RunningServer;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Kill → restore runs per reconciler interval.
const RECOVERY_RUNS: usize = 5;
/// The reconciler intervals measured (the first is the default).
const INTERVALS_MS: [u64; 2] = [5_000, 500];
/// How often the state is read while a loss is being restored.
const POLL: Duration = Duration::from_millis(20);
const AGENTS: [&str; 2] = ["agent-1", "agent-2"];

/// Drops the run's PostgreSQL schemas and Redis keys when dropped (after
/// the servers are gone; best effort, with `psql` and `redis-cli`).
struct DropSpaces {
    pg: String,
    redis: String,
    schemas: Vec<String>,
    prefix: String,
}

impl Drop for DropSpaces {
    fn drop(&mut self) {
        for s in &self.schemas {
            let _ = Command::new("psql")
                .args(["-q", "-X", &self.pg, "-c"])
                .arg(format!("DROP SCHEMA IF EXISTS \"{s}\" CASCADE"))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
        let _ = Command::new("sh")
            .arg("-c")
            .arg(r#"redis-cli -u "$1" --scan --pattern "$2*" | xargs -r redis-cli -u "$1" del"#)
            .args(["sh", &self.redis, &self.prefix])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// The settings every server of this run shares: those of the core path's
/// [`crate::start_server`] (busybox default, its one pool at 0, rate limit
/// and over-commit out of the way), with data under `data` and the template
/// store at `templates`.
fn base_config(data: &Path, templates: &Path, envd: &Path) -> anyhow::Result<ServerConfig> {
    let mut cfg = ServerConfig::new(data.to_path_buf(), envd.to_path_buf());
    cfg.listen = "127.0.0.1:0".parse()?;
    cfg.control.default_template = "busybox".into();
    cfg.control.default_template_source = DefaultTemplateSource::Busybox;
    cfg.templates_dir = Some(templates.to_path_buf());
    cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
    cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    cfg.control.settings.overcommit.cpu_ratio = 100.0;
    cfg.control.settings.overcommit.memory_ratio = 100.0;
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: POOL_CLASS.into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 0,
        pool_max: 64,
        buffer_min: 0,
        buffer_max: 0,
    }];
    Ok(cfg)
}

/// `cfg` in distributed mode on schema and key prefix `space`; with a node
/// name it runs sandboxes itself, without one it is stateless.
fn distributed(
    cfg: &mut ServerConfig,
    pg: &str,
    redis: &str,
    space: &str,
    node: Option<&str>,
    local_node: &str,
) -> anyhow::Result<()> {
    cfg.control.settings.distributed = DistributedSettings {
        registry: Some(ServiceUrl::parse(ServiceKind::Registry, pg).map_err(anyhow::Error::msg)?),
        coordination: Some(
            ServiceUrl::parse(ServiceKind::Coordination, redis).map_err(anyhow::Error::msg)?,
        ),
        schema: Some(space.to_owned()),
        key_prefix: space.to_owned(),
        node_name: node.map(str::to_owned),
    };
    cfg.control.runs_sandboxes = node.is_some();
    cfg.control.local_node = local_node.to_owned();
    Ok(())
}

async fn start(cfg: ServerConfig) -> anyhow::Result<RunningServer> {
    let server = aviary_server::start(cfg, |_| {}).await?;
    if server.control_plane.wait_ready().await != aviary_server::ops::Readiness::Ready {
        bail!("server did not get ready");
    }
    Ok(server)
}

/// An `aviary node` agent on loopback: real crun, its own state dir, the
/// shared template store.
async fn agent(
    work: &Path,
    id: &str,
    templates: &Path,
    envd: &Path,
) -> anyhow::Result<(aviary_node::RunningNode, String, SweepOnDrop)> {
    let state = work.join(id);
    let rt = Arc::new(aviary_runtime_oci::OciRuntime::new(
        aviary_runtime_oci::OciConfig::new(
            aviary_runtime_oci::OciBinary::Crun,
            state.join("sandboxes"),
        )
        .with_template_store(templates),
    )?);
    let token = format!("bench-token-{id}");
    let node = aviary_node::start_node(aviary_node::NodeConfig {
        id: id.into(),
        listen: "127.0.0.1:0".parse()?,
        token: token.clone(),
        runtime: rt.clone(),
        layers: Some(rt.clone()),
        templates: aviary_templates::TemplateStore::open(templates)?,
        state_dir: state.join("agent"),
        capacity: aviary_node::Capacity {
            cpu: 16.0,
            memory_mb: 65_536,
        },
        provided_binds: vec![aviary_node::ProvidedBind::envd(envd)],
    })
    .await?;
    Ok((node, token, SweepOnDrop(rt)))
}

/// One create (on `create`) → exec `true` (on `exec`) timed, then the
/// delete (on `create`) untimed; returns the time and the node it ran on.
async fn cycle(create: &Client, exec: &Client) -> anyhow::Result<(Duration, String)> {
    let t = Instant::now();
    let s = create
        .create_sandbox(&CreateSandboxRequest::default())
        .await?;
    let id = s.sandbox.id.to_string();
    let r = exec.exec(&id, &true_cmd()).await?;
    let d = t.elapsed();
    ensure!(r.exit_code == 0, "exec failed: {r:?}");
    create.delete_sandbox(&id, None).await?;
    Ok((d, s.sandbox.node))
}

/// Polls `GET /v1/nodes` on `c` until it lists every agent.
async fn wait_agents(c: &Client) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = c.nodes().await?;
        let listed = |id: &str| {
            v["nodes"]
                .as_array()
                .is_some_and(|ns| ns.iter().any(|n| n["id"] == id))
        };
        if AGENTS.iter().all(|a| listed(a)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{} never listed both agents: {v}", c.base_url());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Part 1's latencies, per row.
struct Latencies {
    embedded: Vec<Duration>,
    one: Vec<Duration>,
    three: Vec<Duration>,
    /// Sandboxes per agent over both distributed rows.
    placed: Vec<(String, usize)>,
}

async fn create_exec(
    work: &Path,
    templates: &Path,
    envd: &Path,
    (pg, redis, space): (&str, &str, &str),
    iters: usize,
) -> anyhow::Result<Latencies> {
    let embedded = start(base_config(&work.join("embedded"), templates, envd)?).await?;
    let _sweep_embedded = SweepOnDrop(embedded.control_plane.runtime().clone());
    let mut replicas = Vec::new();
    for i in 1..=3 {
        let name = format!("replica-{i}");
        let mut cfg = base_config(&work.join(&name), templates, envd)?;
        distributed(&mut cfg, pg, redis, space, None, &name)?;
        replicas.push(start(cfg).await?);
    }
    // the agents' sandboxes are swept whatever happens below
    let mut agents = Vec::new();
    let mut sweeps = Vec::new();
    for id in AGENTS {
        let (node, token, sweep) = agent(work, id, templates, envd).await?;
        agents.push((node, token));
        sweeps.push(sweep);
    }
    // one admin key for every replica (keys live in the shared registry)
    let key = &replicas[0].admin_key;
    let clients: Vec<Client> = replicas
        .iter()
        .map(|r| Client::new(&r.url(), key))
        .collect();
    for (id, (node, token)) in AGENTS.iter().zip(&agents) {
        clients[0]
            .add_node(id, &node.addr().to_string(), token)
            .await
            .with_context(|| format!("registering {id}"))?;
    }
    for c in &clients {
        wait_agents(c).await?;
    }
    let base = Client::new(&embedded.url(), &embedded.admin_key);

    let mut out = Latencies {
        embedded: Vec::new(),
        one: Vec::new(),
        three: Vec::new(),
        placed: AGENTS.iter().map(|a| ((*a).to_owned(), 0)).collect(),
    };
    let mut count = |node: &str| {
        if let Some(p) = out.placed.iter_mut().find(|p| p.0 == node) {
            p.1 += 1;
        }
    };
    // warm-up: every path, every replica, both agents
    for i in 0..3 {
        cycle(&base, &base).await.context("warm-up, embedded")?;
        cycle(&clients[i], &clients[(i + 1) % 3])
            .await
            .context("warm-up, replicas")?;
        cycle(&clients[0], &clients[0])
            .await
            .context("warm-up, replica 1")?;
    }
    let (mut emb, mut one, mut three) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..iters {
        for k in 0..3 {
            match (round + k) % 3 {
                0 => emb.push(cycle(&base, &base).await.context("embedded")?.0),
                1 => {
                    let (d, node) = cycle(&clients[0], &clients[0])
                        .await
                        .context("one replica")?;
                    count(&node);
                    one.push(d);
                }
                _ => {
                    let i = round % 3;
                    let (d, node) = cycle(&clients[i], &clients[(i + 1) % 3])
                        .await
                        .with_context(|| format!("create on replica {}", i + 1))?;
                    count(&node);
                    three.push(d);
                }
            }
        }
    }
    out.embedded = emb;
    out.one = one;
    out.three = three;

    for r in replicas {
        r.stop().await?;
    }
    for (node, _) in agents {
        node.stop().await;
    }
    embedded.stop().await?;
    drop(sweeps);
    Ok(out)
}

/// One kill → restore.
struct Recovery {
    /// Kill → the `sandbox_lost` event's timestamp.
    lost_event: Duration,
    /// Kill → the first poll that read `Lost`, if one did.
    lost_polled: Option<Duration>,
    /// Kill → `recovered` event present and state `Idle`.
    restored: Duration,
    /// The reconciler (cause `compute_gone`) rather than the envd probe.
    by_reconciler: bool,
}

/// The pids of every process in the sandbox's cgroups (`…/aviary/<id>`).
fn sandbox_pids(id: &str) -> Vec<String> {
    let needle = format!("/aviary/{id}");
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.parse::<u32>().is_err() {
            continue;
        }
        let Ok(cg) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if cg
            .lines()
            .any(|l| l.ends_with(&needle) || l.contains(&format!("{needle}/")))
        {
            pids.push(name);
        }
    }
    pids
}

fn shell(s: &str) -> ExecRequest {
    ExecRequest {
        shell: Some(s.into()),
        ..Default::default()
    }
}

async fn events_of(c: &Client, id: &str) -> anyhow::Result<Vec<aviary_core::api::Event>> {
    Ok(c.events(Some(id), None, Some(1000)).await?.events)
}

/// A uniformly random duration in `[0, max)` (std's randomly keyed hasher
/// as the source: no generator crate for one number per run).
fn jitter(max: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    max.mul_f64((r >> 11) as f64 / (1u64 << 53) as f64)
}

/// Create, write, snapshot, wait a random part of the reconciler's
/// `interval` (so the kill falls anywhere between two passes, not always
/// just after the pass that restored the previous run), kill from the host,
/// wait for the restore, check the file, delete.
async fn kill_and_restore(c: &Client, run: usize, interval: Duration) -> anyhow::Result<Recovery> {
    let s = c.create_sandbox(&CreateSandboxRequest::default()).await?;
    let id = s.sandbox.id.to_string();
    let content = format!("committed-{run}");
    let w = c
        .exec(&id, &shell(&format!("echo {content} > /workspace/kept")))
        .await?;
    ensure!(w.exit_code == 0, "write failed: {w:?}");
    c.snapshot(&id, None).await.context("snapshot")?;
    let before = c.get_sandbox(&id).await?.state;
    ensure!(
        before == SandboxState::Idle,
        "{id} is {before} after its snapshot, not idle"
    );

    tokio::time::sleep(jitter(interval)).await;
    let pids = sandbox_pids(&id);
    ensure!(!pids.is_empty(), "no process found in {id}'s cgroups");
    let killed_wall = aviary_core::now();
    let killed = Instant::now();
    let st = Command::new("kill").arg("-9").args(&pids).status()?;
    ensure!(st.success(), "kill -9 {pids:?} failed");

    let deadline = killed + Duration::from_secs(120);
    let mut lost_polled = None;
    let mut left_idle = false;
    let mut last_events_check = Instant::now();
    let restored = loop {
        let state = c.get_sandbox(&id).await?.state;
        let at = killed.elapsed();
        if state == SandboxState::Lost && lost_polled.is_none() {
            lost_polled = Some(at);
        }
        if state != SandboxState::Idle {
            left_idle = true;
        } else if left_idle || last_events_check.elapsed() > Duration::from_millis(500) {
            // Idle again (or never seen otherwise): restored once the
            // `recovered` event is there
            last_events_check = Instant::now();
            let events = events_of(c, &id).await?;
            if events.iter().any(|e| e.event_type == "recovered") {
                break at;
            }
        }
        if state == SandboxState::Failed || state.is_terminal() {
            bail!("{id} went {state} instead of being restored");
        }
        if Instant::now() > deadline {
            bail!("{id} not restored within 120 s (state {state})");
        }
        tokio::time::sleep(POLL).await;
    };
    let events = events_of(c, &id).await?;
    if let Some(bad) = events
        .iter()
        .find(|e| e.event_type == "recovery_failed" || e.event_type == "unrecoverable")
    {
        bail!("{id}: {} {}", bad.event_type, bad.metadata);
    }
    let lost = events
        .iter()
        .find(|e| e.event_type == "sandbox_lost")
        .with_context(|| format!("{id} restored without a sandbox_lost event"))?;
    let lost_event = Duration::try_from(lost.timestamp - killed_wall).unwrap_or_default();
    let by_reconciler = lost.metadata["cause"] == "compute_gone";

    let r = c.exec(&id, &shell("cat /workspace/kept")).await?;
    ensure!(
        r.exit_code == 0 && r.stdout.trim() == content,
        "{id}: the file did not come back with the restore: {r:?}"
    );
    ensure!(
        !sandbox_pids(&id).is_empty(),
        "{id}: no new compute after the restore"
    );
    c.delete_sandbox(&id, None).await?;
    Ok(Recovery {
        lost_event,
        lost_polled,
        restored,
        by_reconciler,
    })
}

async fn recoveries(
    work: &Path,
    templates: &Path,
    envd: &Path,
    (pg, redis, space): (&str, &str, &str),
    interval_ms: u64,
) -> anyhow::Result<Vec<Recovery>> {
    let data = work.join(format!("bench-node-{interval_ms}"));
    let mut cfg = base_config(&data, templates, envd)?;
    distributed(&mut cfg, pg, redis, space, Some("bench-node"), "bench-node")?;
    cfg.control.reconcile_interval_ms = interval_ms;
    let server = start(cfg).await?;
    let _sweep = SweepOnDrop(server.control_plane.runtime().clone());
    let c = Client::new(&server.url(), &server.admin_key);
    let mut out = Vec::new();
    for run in 0..RECOVERY_RUNS {
        out.push(
            kill_and_restore(&c, run, Duration::from_millis(interval_ms))
                .await
                .with_context(|| format!("reconciler at {interval_ms} ms, run {}", run + 1))?,
        );
    }
    server.stop().await?;
    Ok(out)
}

/// The 1-minute load average.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

pub async fn run(iters: usize) -> anyhow::Result<()> {
    ensure!(iters > 0, "replicas needs at least one iteration");
    let pg = std::env::var("AVIARY_TEST_POSTGRES_URL")
        .context("AVIARY_TEST_POSTGRES_URL (scripts/services.sh start)")?;
    let redis = std::env::var("AVIARY_TEST_REDIS_URL")
        .context("AVIARY_TEST_REDIS_URL (scripts/services.sh start)")?;
    let envd = PathBuf::from(
        std::env::var("AVIARY_ENVD")
            .context("AVIARY_ENVD must name the static envd (scripts/bench.sh sets it)")?,
    );
    let load_before = load_average();
    let work = crate::work_dir()?;
    let templates = std::env::var_os("AVIARY_TEST_TEMPLATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| work.path().join("templates"));
    std::fs::create_dir_all(&templates)?;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos()
        ^ u128::from(std::process::id());
    let space = format!("bench_replicas_{:x}", nonce & 0xffff_ffff_ffff);
    let spaces: Vec<String> = std::iter::once(space.clone())
        .chain(INTERVALS_MS.iter().map(|ms| format!("{space}_r{ms}")))
        .collect();
    // dropped last: after every server, agent and sandbox of the run
    let _drop_spaces = DropSpaces {
        pg: pg.clone(),
        redis: redis.clone(),
        schemas: spaces.clone(),
        prefix: space.clone(),
    };

    let lat = create_exec(
        work.path(),
        &templates,
        &envd,
        (&pg, &redis, &spaces[0]),
        iters,
    )
    .await?;
    let mut recovered = Vec::new();
    for (ms, sp) in INTERVALS_MS.iter().zip(&spaces[1..]) {
        let runs = recoveries(work.path(), &templates, &envd, (&pg, &redis, sp), *ms).await?;
        recovered.push((*ms, runs));
    }
    let load = (load_before, load_average());
    report(iters, &lat, &recovered, load);
    Ok(())
}

fn report(
    iters: usize,
    lat: &Latencies,
    recovered: &[(u64, Vec<Recovery>)],
    load: (Option<f64>, Option<f64>),
) {
    let embedded = stats(lat.embedded.clone());
    let one = stats(lat.one.clone());
    let three = stats(lat.three.clone());
    let ratio = |s: &Stats| {
        format!(
            "{:.2}× / {:.2}×",
            s.p50 / embedded.p50,
            s.p90 / embedded.p90
        )
    };
    println!("### Replicas: distributed create → first exec, and Lost → restored (issue 9)\n");
    println!(
        "Busybox template, default create request, exec `true`; the delete after each cycle is not timed. \
         {iters} cycles per row, interleaved (one of each row per round, the order rotated). \
         Distributed: registry on PostgreSQL, leases and locks on Redis, three stateless replicas \
         (no node name: they run no sandboxes) and two in-process `aviary node` agents on real crun, \
         all on loopback in one process.\n"
    );
    println!("| create → first exec completes | p50 ms | p90 ms | n | p50 / p90 vs embedded |");
    println!("|---|---|---|---|---|");
    println!(
        "{} 1× / 1× |",
        row(
            "embedded server (SQLite, its own crun): baseline",
            &Ok(Stats { ..embedded })
        )
    );
    println!(
        "{} {} |",
        row(
            "1 replica: create and exec on replica 1",
            &Ok(Stats { ..one })
        ),
        ratio(&one)
    );
    println!(
        "{} {} |",
        row(
            "3 replicas round-robin: create on replica i, exec on replica i+1",
            &Ok(Stats { ..three })
        ),
        ratio(&three)
    );
    let placed: Vec<String> = lat.placed.iter().map(|(a, n)| format!("{a} {n}")).collect();
    println!(
        "\nSandboxes placed per agent over both distributed rows: {} (embedded p50 {:.2} ms).\n",
        placed.join(", "),
        embedded.p50
    );

    println!(
        "| reconciler interval | runs | kill → `sandbox_lost` p50 / p90 ms | kill → `recovered` and Idle p50 / p90 ms | lost found by reconciler / envd probe | `Lost` seen by the 20 ms poll |"
    );
    println!("|---|---|---|---|---|---|");
    for (ms, runs) in recovered {
        let lost = stats(runs.iter().map(|r| r.lost_event).collect());
        let restored = stats(runs.iter().map(|r| r.restored).collect());
        let by_rec = runs.iter().filter(|r| r.by_reconciler).count();
        let polled = runs.iter().filter(|r| r.lost_polled.is_some()).count();
        println!(
            "| {ms} ms{} | {} | {:.0} / {:.0} | {:.0} / {:.0} | {by_rec} / {} | {polled}/{} |",
            if *ms == INTERVALS_MS[0] {
                " (default)"
            } else {
                ""
            },
            runs.len(),
            lost.p50,
            lost.p90,
            restored.p50,
            restored.p90,
            runs.len() - by_rec,
            runs.len()
        );
    }
    println!();
    for (ms, runs) in recovered {
        let each: Vec<String> = runs
            .iter()
            .map(|r| {
                format!(
                    "{:.2} ({}) → {:.2}",
                    r.lost_event.as_secs_f64(),
                    if r.by_reconciler {
                        "reconciler"
                    } else {
                        "probe"
                    },
                    r.restored.as_secs_f64()
                )
            })
            .collect();
        println!(
            "- {ms} ms, each run (s after the kill: `sandbox_lost` (found by) → restored): {}",
            each.join("; ")
        );
    }
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let show = |l: Option<f64>| l.map_or_else(|| "n/a".into(), |l| format!("{l:.2}"));
    println!(
        "\nOne replica on node `bench-node` (distributed, runs sandboxes on its own crun, local snapshot store); \
         per run: a new sandbox, a file written in /workspace, a snapshot, a random wait of 0 to one \
         reconciler interval (so the kill falls anywhere between two passes), then SIGKILL to every process \
         in the sandbox's cgroups from the host. `sandbox_lost` is timed by its registry timestamp, \
         `recovered` + Idle by polling every 20 ms; the file is checked after every restore (the run fails \
         if it is missing). The envd health probe stays at its default (5000 ms) and may find the loss \
         first; the restore itself is always the reconciler's. p90 of {RECOVERY_RUNS} runs is the slowest run.\n\
         1-minute load average before / after: {} / {} on {cores} cores.",
        show(load.0),
        show(load.1)
    );
}
