//! `aviary-bench exec-path [N]`: where an exec's time goes, and what
//! `aviary run` costs as a user runs it (issue 12).
//!
//! In one server of this process, on one sandbox of each kind (unleased, and
//! leased as `aviary run` makes it):
//! - envd's own round trip of `true`, through the control plane's envd
//!   client (`aviary-envd-proto`) on the sandbox's host-only socket, with
//!   the peer check the control plane makes, interleaved with
//! - the API's round trip of the same command (`POST /v1/sandboxes/{id}/exec`
//!   through `aviary-client`), and its stages: the control plane's
//!   `trace`-level spans (`exec.*`, `http.auth`; off, they cost one level
//!   check) timed by a tracing layer this command installs;
//! - the real release `aviary` binary as a child process against the same
//!   server: `aviary run -- true`, and the split `aviary sandbox create` /
//!   `exec` / `rm` with a lease as `run` takes one, beside the same three
//!   calls from an in-process client and `aviary --version` (the process's
//!   own start and exit), against `crun run --detach` + `crun delete` of the
//!   sandbox's bundle (the floor of [`super::floor_spec`]).
//!
//! The `aviary` binary is `$AVIARY_BIN`, else the `aviary` beside this one
//! (`cargo build --release -p aviary-cli`).

use super::{row, stats, Stats};
use anyhow::{bail, Context};
use aviary_client::Client;
use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest};
use aviary_core::{LeaseToken, SandboxId};
use aviary_envd_proto::{EnvdClient, ExecEvent, ExecSpec};
use aviary_runtime::{SpawnIsolation, SpawnRequest, SpawnStdio, Spawner};
use aviary_runtime_oci::ProcessSpawner;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;

/// The spans this command times: the control plane's exec stages and the
/// HTTP adapter's authentication.
fn timed_span(name: &str) -> bool {
    name.starts_with("exec.") || name == "http.auth"
}

/// Durations of closed spans by name, in the order they closed.
#[derive(Clone, Default)]
struct SpanTimes(Arc<Mutex<Vec<(&'static str, Duration)>>>);

impl SpanTimes {
    fn take(&self) -> HashMap<&'static str, Duration> {
        let mut got = HashMap::new();
        for (name, d) in self.0.lock().expect("span times").drain(..) {
            *got.entry(name).or_default() += d;
        }
        got
    }
}

/// When a timed span was made (kept in the span's extensions).
struct Opened(Instant);

impl<S> Layer<S> for SpanTimes
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        _attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Opened(Instant::now()));
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(Opened(t)) = span.extensions().get::<Opened>() {
                self.0
                    .lock()
                    .expect("span times")
                    .push((span.name(), t.elapsed()));
            }
        }
    }
}

fn progress(what: &str) {
    eprintln!("bench exec-path: {what}");
}

pub async fn run(iters: usize) -> anyhow::Result<()> {
    let iters = iters.max(5);
    let times = SpanTimes::default();
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(times.clone().with_filter(
            tracing_subscriber::filter::filter_fn(|m| m.is_span() && timed_span(m.name())),
        )),
    )
    .context("installing the span timer")?;

    progress("starting the server");
    let work = super::work_dir()?;
    let server = super::start_server(work.path()).await?;
    let _sweep = super::SweepOnDrop(server.control_plane.runtime().clone());
    let client = Client::new(&server.url(), &server.admin_key);
    let runtime = server.control_plane.runtime().clone();

    let unleased = client
        .create_sandbox(&CreateSandboxRequest::default())
        .await?
        .sandbox
        .id;
    let leased_created = client
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "bench".into(),
                ttl_s: Some(3600),
            }),
            ..Default::default()
        })
        .await?;
    let leased = leased_created.sandbox.id;
    let token = leased_created
        .lease
        .context("leased create without lease")?
        .token;

    let rounds = iters * 10;
    progress(&format!(
        "exec round trips: envd direct vs API, {rounds} each on two sandboxes (unleased, leased)"
    ));
    let plain = exec_rounds(&client, &*runtime, &unleased, None, rounds, &times).await?;
    let with_lease = exec_rounds(&client, &*runtime, &leased, Some(token), rounds, &times).await?;
    client.delete_sandbox(leased.as_str(), Some(token)).await?;

    progress(&format!(
        "CLI: aviary run / create / exec / rm, {iters} each"
    ));
    let cli = match aviary_bin() {
        Ok(bin) => Some(cli_rounds(&bin, &server.url(), &server.admin_key, iters).await?),
        Err(e) => {
            eprintln!("bench exec-path: no aviary binary ({e:#}); CLI rows skipped");
            None
        }
    };
    progress(&format!(
        "in-process client: create + exec + delete, {iters}"
    ));
    let inproc = client_rounds(&client, iters).await?;

    progress(&format!(
        "floor: crun run --detach + crun delete, {iters} (and crun run alone)"
    ));
    let state_dir = server.cfg.runtime_state_dir();
    let rootfs = aviary_templates::TemplateStore::open(server.cfg.templates_root())?
        .get("busybox")?
        .context("busybox template")?
        .rootfs;
    let bundle_cfg = state_dir.join(unleased.as_str()).join("bundle/config.json");
    let floor = crun_run_delete(&bundle_cfg, &rootfs, work.path(), iters, &state_dir).await;
    client.delete_sandbox(unleased.as_str(), None).await?;
    server.control_plane.reclaims.settled().await;
    server.stop().await?;

    report(&plain, &with_lease, cli.as_ref(), &inproc, &floor);
    Ok(())
}

/// One sandbox's interleaved round trips.
struct ExecRounds {
    envd: Vec<Duration>,
    api: Vec<Duration>,
    /// `GET /healthz` through the same client: HTTP alone.
    http: Vec<Duration>,
    /// Per API round trip, its stages (span name → time).
    stages: Vec<HashMap<&'static str, Duration>>,
}

async fn exec_rounds(
    client: &Client,
    runtime: &dyn aviary_runtime::Runtime,
    id: &SandboxId,
    token: Option<LeaseToken>,
    rounds: usize,
    times: &SpanTimes,
) -> anyhow::Result<ExecRounds> {
    let ep = runtime.envd_endpoint(id).await?;
    let envd = EnvdClient::new(ep.socket.clone()).expect_peer_pid(ep.peer_pid);
    let req = aviary_core::api::ExecRequest {
        cmd: Some(vec!["true".into()]),
        token,
        ..Default::default()
    };
    let mut out = ExecRounds {
        envd: Vec::new(),
        api: Vec::new(),
        http: Vec::new(),
        stages: Vec::new(),
    };
    let warm = 20;
    for i in 0..rounds + warm {
        let t = Instant::now();
        let code = envd_true(&envd, token.map(|t| t.fence())).await?;
        let d_envd = t.elapsed();
        anyhow::ensure!(code == 0, "envd exec of true exited {code}");
        times.take();
        let t = Instant::now();
        let r = client.exec(id.as_str(), &req).await?;
        let d_api = t.elapsed();
        anyhow::ensure!(r.exit_code == 0, "API exec of true: {r:?}");
        let stages = times.take();
        let t = Instant::now();
        client.healthz().await?;
        let d_http = t.elapsed();
        if i >= warm {
            out.http.push(d_http);
            out.envd.push(d_envd);
            out.api.push(d_api);
            out.stages.push(stages);
        }
    }
    Ok(out)
}

/// `true` through envd's own protocol, to its exit.
async fn envd_true(envd: &EnvdClient, fence: Option<u64>) -> anyhow::Result<i32> {
    let mut s = envd
        .exec(
            ExecSpec {
                argv: vec!["true".into()],
                ..Default::default()
            },
            fence,
        )
        .await?;
    loop {
        if let ExecEvent::Exit(e) = s.next().await? {
            return Ok(e.exit_code);
        }
    }
}

fn aviary_bin() -> anyhow::Result<PathBuf> {
    let bin = match std::env::var_os("AVIARY_BIN") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()?
            .parent()
            .context("the bench binary has no directory")?
            .join("aviary"),
    };
    anyhow::ensure!(bin.is_file(), "{} is not there", bin.display());
    Ok(bin)
}

struct CliRounds {
    version: Vec<Duration>,
    run: Vec<Duration>,
    create: Vec<Duration>,
    exec: Vec<Duration>,
    rm: Vec<Duration>,
}

/// Runs `aviary ARGS` against the server; its stdout, when it exits 0.
async fn aviary(bin: &Path, url: &str, key: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(bin)
        .args(args)
        .env("AVIARY_URL", url)
        .env("AVIARY_API_KEY", key)
        .env_remove("AVIARY_LOG")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .with_context(|| format!("starting {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "aviary {args:?} exited {:?}: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn timed<T>(
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Duration)> {
    let t = Instant::now();
    let v = f.await?;
    Ok((v, t.elapsed()))
}

async fn cli_rounds(bin: &Path, url: &str, key: &str, iters: usize) -> anyhow::Result<CliRounds> {
    let mut r = CliRounds {
        version: Vec::new(),
        run: Vec::new(),
        create: Vec::new(),
        exec: Vec::new(),
        rm: Vec::new(),
    };
    let warm = 2;
    for i in 0..iters + warm {
        let (_, d_version) = timed(aviary(bin, url, key, &["--version"])).await?;
        let (_, d_run) = timed(aviary(bin, url, key, &["run", "--", "true"])).await?;
        let (created, d_create) = timed(aviary(
            bin,
            url,
            key,
            &["sandbox", "create", "--lease-owner", "bench-cli"],
        ))
        .await?;
        let mut lines = created.lines();
        let (Some(id), Some(token)) = (lines.next(), lines.next()) else {
            bail!("sandbox create printed {created:?}");
        };
        let (_, d_exec) = timed(aviary(
            bin,
            url,
            key,
            &["sandbox", "exec", "--token", token, id, "--", "true"],
        ))
        .await?;
        let (_, d_rm) = timed(aviary(
            bin,
            url,
            key,
            &["sandbox", "rm", "--token", token, id],
        ))
        .await?;
        if i >= warm {
            r.version.push(d_version);
            r.run.push(d_run);
            r.create.push(d_create);
            r.exec.push(d_exec);
            r.rm.push(d_rm);
        }
    }
    Ok(r)
}

/// What `aviary run` asks of the server, from a client in this process
/// (no process start): create with a lease, streamed exec, delete; each
/// phase timed.
struct ClientRounds {
    total: Vec<Duration>,
    create: Vec<Duration>,
    exec: Vec<Duration>,
    delete: Vec<Duration>,
}

async fn client_rounds(client: &Client, iters: usize) -> anyhow::Result<ClientRounds> {
    let mut out = ClientRounds {
        total: Vec::new(),
        create: Vec::new(),
        exec: Vec::new(),
        delete: Vec::new(),
    };
    for i in 0..iters + 2 {
        let t = Instant::now();
        let created = client
            .create_sandbox(&CreateSandboxRequest {
                lease: Some(AcquireLeaseRequest {
                    owner: "bench-client".into(),
                    ttl_s: Some(3600),
                }),
                ..Default::default()
            })
            .await?;
        let d_create = t.elapsed();
        let token = created.lease.map(|l| l.token);
        let id = created.sandbox.id.to_string();
        let t_exec = Instant::now();
        let mut s = client
            .exec_stream(
                &id,
                &aviary_core::api::ExecRequest {
                    cmd: Some(vec!["true".into()]),
                    token,
                    ..Default::default()
                },
            )
            .await?;
        loop {
            match s.next().await? {
                Some(aviary_client::StreamItem::Exit(r)) => {
                    anyhow::ensure!(r.exit_code == 0);
                    break;
                }
                Some(_) => {}
                None => bail!("exec stream ended without an exit"),
            }
        }
        drop(s);
        let d_exec = t_exec.elapsed();
        let t_delete = Instant::now();
        client.delete_sandbox(&id, token).await?;
        let d_delete = t_delete.elapsed();
        if i >= 2 {
            out.total.push(t.elapsed());
            out.create.push(d_create);
            out.exec.push(d_exec);
            out.delete.push(d_delete);
        }
    }
    Ok(out)
}

/// The floor of `aviary run -- true`: `crun run --detach` of the
/// sandbox's bundle running `/bin/true` (as [`super::floor_spec`] changes
/// it), then `crun delete --force`; and `crun run` in the foreground alone
/// (it waits for `true` and removes the container itself).
async fn crun_run_delete(
    config_json: &Path,
    rootfs: &Path,
    work: &Path,
    iters: usize,
    state_dir: &Path,
) -> Result<(Stats, Stats), String> {
    let inner = async {
        let mut spec = super::floor_spec(config_json, rootfs, state_dir)?;
        let bundle = work.join("exec-floor-bundle");
        std::fs::create_dir_all(&bundle)?;
        let root = work.join("exec-floor-crun");
        let crun = |args: Vec<String>| {
            let mut req = SpawnRequest::new(
                "crun",
                [vec!["--root".into(), root.to_string_lossy().into()], args].concat(),
            );
            req.stdio = SpawnStdio::Capture;
            req.isolation = SpawnIsolation::PrivateMountNamespace {
                detach: vec![PathBuf::from("/sys/fs/cgroup/unified")],
            };
            req
        };
        let (mut pair, mut alone) = (Vec::new(), Vec::new());
        for i in 0..iters + 2 {
            for detached in [true, false] {
                let name = format!("exec-floor-{i}-{detached}");
                spec["linux"]["cgroupsPath"] = serde_json::json!(format!("/aviary-bench/{name}"));
                std::fs::write(bundle.join("config.json"), serde_json::to_vec(&spec)?)?;
                let mut run = vec!["run".into()];
                if detached {
                    run.push("--detach".into());
                }
                run.extend([
                    "--bundle".into(),
                    bundle.to_string_lossy().into(),
                    name.clone(),
                ]);
                let t = Instant::now();
                let o = ProcessSpawner.run(&crun(run)).await?;
                if !o.success() {
                    bail!("crun run failed: {}", String::from_utf8_lossy(&o.stderr));
                }
                if detached {
                    let o = ProcessSpawner
                        .run(&crun(vec!["delete".into(), "--force".into(), name]))
                        .await?;
                    if !o.success() {
                        bail!("crun delete failed: {}", String::from_utf8_lossy(&o.stderr));
                    }
                }
                let d = t.elapsed();
                if i >= 2 {
                    if detached { &mut pair } else { &mut alone }.push(d);
                }
            }
        }
        for ctrl in std::fs::read_dir("/sys/fs/cgroup")?.flatten() {
            let _ = std::fs::remove_dir(ctrl.path().join("aviary-bench"));
        }
        anyhow::Ok((stats(pair), stats(alone)))
    };
    inner.await.map_err(|e| format!("{e:#}"))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The stages of the API's exec, each the median over the round trips (in
/// µs), in the order a request passes them. `rest` is the round trip less
/// every span: the client, HTTP, routing, body parsing and the answer.
fn stage_rows(r: &ExecRounds) -> Vec<(&'static str, &'static str, f64)> {
    let get = |s: &HashMap<&'static str, Duration>, n: &str| s.get(n).copied().unwrap_or_default();
    let per = |f: &dyn Fn(&HashMap<&'static str, Duration>) -> Duration| {
        median(r.stages.iter().map(|s| ms(f(s)) * 1000.0).collect())
    };
    let mut rows = vec![
        (
            "authentication (API key, cached)",
            "http.auth",
            per(&|s| get(s, "http.auth")),
        ),
        (
            "registry read: the sandbox's row (tenant, state)",
            "exec.lookup",
            per(&|s| get(s, "exec.lookup")),
        ),
        (
            "fence check in the lease store",
            "exec.fence",
            per(&|s| get(s, "exec.fence")),
        ),
        (
            "live envd handle",
            "exec.live",
            per(&|s| get(s, "exec.live")),
        ),
        (
            "registry read: the sandbox's environment (active venv)",
            "exec.venv",
            per(&|s| get(s, "exec.venv")),
        ),
        (
            "cgroup read: OOM counter before the exec",
            "exec.usage",
            per(&|s| get(s, "exec.usage")),
        ),
        (
            "envd: connect + request",
            "exec.envd_start",
            per(&|s| get(s, "exec.envd_start")),
        ),
        (
            "envd: the command runs, to its exit",
            "exec.envd_wait − exec.finish",
            per(&|s| get(s, "exec.envd_wait").saturating_sub(get(s, "exec.finish"))),
        ),
        (
            "after the exit (activity, OOM attribution)",
            "exec.finish",
            per(&|s| get(s, "exec.finish")),
        ),
    ];
    let api = r.api.clone();
    let rest: Vec<f64> = api
        .iter()
        .zip(&r.stages)
        .map(|(t, s)| ms(t.saturating_sub(get(s, "exec.op") + get(s, "http.auth"))) * 1000.0)
        .collect();
    rows.push((
        "the rest: client, HTTP, routing, JSON, answer",
        "round trip − exec.op − http.auth",
        median(rest),
    ));
    rows
}

fn report(
    plain: &ExecRounds,
    leased: &ExecRounds,
    cli: Option<&CliRounds>,
    inproc: &ClientRounds,
    floor: &Result<(Stats, Stats), String>,
) {
    println!("### Exec path and `aviary run` (issue 12)\n");
    println!(
        "Milliseconds; p50 / p90 over n. envd and API round trips interleaved, same sandbox.\n"
    );
    println!("| exec round trip of `true` | p50 ms | p90 ms | n |\n|---|---|---|---|");
    let s_envd = stats(plain.envd.clone());
    let s_api = stats(plain.api.clone());
    let l_envd = stats(leased.envd.clone());
    let l_api = stats(leased.api.clone());
    let over = |a: &Stats, b: &Stats| (a.p50 - b.p50) * 1000.0;
    let (o_plain, o_leased) = (over(&s_api, &s_envd), over(&l_api, &l_envd));
    println!(
        "{}",
        row(
            "envd's own round trip (control plane's envd client, unleased)",
            &Ok(s_envd)
        )
    );
    println!("{}", row("Aviary API (`POST /exec`, unleased)", &Ok(s_api)));
    println!(
        "{}",
        row(
            "envd's own round trip (leased, with the fence)",
            &Ok(l_envd)
        )
    );
    println!("{}", row("Aviary API (leased, with the token)", &Ok(l_api)));
    println!(
        "{}",
        row(
            "HTTP alone: `GET /healthz`, same client (no auth, no body)",
            &Ok(stats(leased.http.clone()))
        )
    );
    println!(
        "\nAPI overhead over envd at p50: {o_plain:.0} µs unleased, {o_leased:.0} µs leased (target ≤ 300 µs).\n"
    );
    println!("Where the API's exec spends it (leased; median µs per stage, from the control plane's `trace` spans):\n");
    println!("| stage | span | µs |\n|---|---|---|");
    for (what, span, us) in stage_rows(leased) {
        println!("| {what} | `{span}` | {us:.0} |");
    }
    println!();
    println!("| `aviary run -- true` and its parts | p50 ms | p90 ms | n |\n|---|---|---|---|");
    let cli_p50 = cli.map(|c| {
        let (run, create, exec, rm) = (
            stats(c.run.clone()),
            stats(c.create.clone()),
            stats(c.exec.clone()),
            stats(c.rm.clone()),
        );
        let p50 = (run.p50, create.p50 + exec.p50 + rm.p50, create.p50, rm.p50);
        println!(
            "{}",
            row(
                "`aviary run -- true` (CLI process: create + exec + destroy)",
                &Ok(run)
            )
        );
        println!(
            "{}",
            row(
                "`aviary sandbox create --lease-owner` (CLI process)",
                &Ok(create)
            )
        );
        println!(
            "{}",
            row(
                "`aviary sandbox exec --token … -- true` (CLI process)",
                &Ok(exec)
            )
        );
        println!(
            "{}",
            row("`aviary sandbox rm --token …` (CLI process)", &Ok(rm))
        );
        println!(
            "{}",
            row(
                "`aviary --version` (the CLI process alone)",
                &Ok(stats(c.version.clone()))
            )
        );
        p50
    });
    if cli.is_none() {
        println!("| `aviary` CLI | n/a | n/a | no aviary binary |");
    }
    let total = stats(inproc.total.clone());
    let inproc_p50 = total.p50;
    println!(
        "{}",
        row(
            "the same create + streamed exec + delete from an in-process client",
            &Ok(total)
        )
    );
    println!(
        "{}",
        row(
            "… its create (with a lease)",
            &Ok(stats(inproc.create.clone()))
        )
    );
    println!(
        "{}",
        row("… its streamed exec", &Ok(stats(inproc.exec.clone())))
    );
    println!("{}", row("… its delete", &Ok(stats(inproc.delete.clone()))));
    let floor_p50 = match floor {
        Ok((pair, alone)) => {
            let p = pair.p50;
            println!(
                "{}",
                row(
                    "`crun run --detach` + `crun delete` of the bundle (floor)",
                    &Ok(Stats { ..*pair })
                )
            );
            println!(
                "{}",
                row(
                    "`crun run` in the foreground (runs, waits, removes)",
                    &Ok(Stats { ..*alone })
                )
            );
            Some(p)
        }
        Err(e) => {
            println!(
                "{}",
                row(
                    "`crun run --detach` + `crun delete` (floor)",
                    &Err(e.clone())
                )
            );
            None
        }
    };
    println!();
    if let Some((run, parts, create, rm)) = cli_p50 {
        let vs_floor = floor_p50
            .map(|f| format!("{:.2}× the crun floor (target ≤ 1.5×)", run / f))
            .unwrap_or_else(|| "no crun floor".into());
        println!(
            "`aviary run` at p50: {run:.1} ms = {vs_floor}; its parts as separate processes sum to {parts:.1} ms (target: run ≤ parts); \
             rm / create = {:.2} (target ≤ 0.33); in-process client {inproc_p50:.1} ms.",
            rm / create
        );
    }
}
