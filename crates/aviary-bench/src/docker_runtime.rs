//! `aviary-bench docker-runtime [ITERATIONS]`: Aviary's `docker` runtime
//! beside its crun runtime, one server serving both (issue 11): cold create →
//! first exec completes through the API, and the exec round trip of `true`
//! in a running sandbox. The two runtimes alternate create by create and exec
//! by exec, so both see the same machine load. It starts its own dockerd (as
//! the core part does) and stops it at the end. It measures, it asserts
//! nothing: scripts/bench.sh puts the report into BENCHMARKS.md.

use crate::{row, stats, true_cmd, Docker, SweepOnDrop};
use aviary_client::Client;
use aviary_core::api::CreateSandboxRequest;
use std::path::Path;
use std::time::{Duration, Instant};

const RUNTIMES: [&str; 2] = ["crun", "docker"];

pub async fn run(iters: usize) -> anyhow::Result<()> {
    anyhow::ensure!(iters > 0, "docker-runtime needs at least one iteration");
    let work = crate::work_dir()?;
    let docker = Docker::start(work.path()).await?;
    let measured = measure(work.path(), &docker.dir.join("docker.sock"), iters).await;
    docker.stop();
    measured
}

fn on(runtime: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        runtime: Some(runtime.into()),
        ..Default::default()
    }
}

async fn measure(work: &Path, socket: &Path, iters: usize) -> anyhow::Result<()> {
    let server = crate::start_server_with(work, |cfg| {
        cfg.control.settings.server.runtimes =
            vec![aviary_config::Runtime::Crun, aviary_config::Runtime::Docker];
        cfg.control.settings.server.docker_socket = socket.to_path_buf();
    })
    .await?;
    // no sandbox of this run outlives it, on either runtime
    let _sweeps: Vec<SweepOnDrop> = server
        .control_plane
        .runtimes
        .all()
        .iter()
        .map(|r| SweepOnDrop(r.runtime.clone()))
        .collect();
    let client = Client::new(&server.url(), &server.admin_key);

    // warm-up (the first docker create imports the template as an image)
    for _ in 0..2 {
        for rt in RUNTIMES {
            let s = client.create_sandbox(&on(rt)).await?;
            client.exec(s.sandbox.id.as_str(), &true_cmd()).await?;
            client.delete_sandbox(s.sandbox.id.as_str(), None).await?;
        }
    }

    let mut cold: [Vec<Duration>; 2] = Default::default();
    for _ in 0..iters {
        for (i, rt) in RUNTIMES.iter().enumerate() {
            let t = Instant::now();
            let s = client.create_sandbox(&on(rt)).await?;
            let r = client.exec(s.sandbox.id.as_str(), &true_cmd()).await?;
            cold[i].push(t.elapsed());
            anyhow::ensure!(r.exit_code == 0, "exec on {rt} failed: {r:?}");
            anyhow::ensure!(
                s.sandbox.runtime == *rt,
                "asked {rt}, got {}",
                s.sandbox.runtime
            );
            client.delete_sandbox(s.sandbox.id.as_str(), None).await?;
        }
    }

    let mut kept = Vec::new();
    for rt in RUNTIMES {
        kept.push(client.create_sandbox(&on(rt)).await?.sandbox.id);
    }
    let mut exec: [Vec<Duration>; 2] = Default::default();
    for n in 0..(iters * 7) {
        for (i, id) in kept.iter().enumerate() {
            let t = Instant::now();
            let r = client.exec(id.as_str(), &true_cmd()).await?;
            if n >= 10 {
                exec[i].push(t.elapsed());
            }
            anyhow::ensure!(r.exit_code == 0);
        }
    }
    for id in &kept {
        client.delete_sandbox(id.as_str(), None).await?;
    }
    server.stop().await?;

    let [crun_cold, docker_cold] = cold.map(|v| Ok(stats(v)));
    let [crun_exec, docker_exec] = exec.map(|v| Ok(stats(v)));
    println!("### The docker runtime beside crun (issue 11)\n");
    println!(
        "One Aviary server serving both runtimes (`docker` on a dockerd started for the run: \
         overlay2, no bridge), the busybox template, alternating create by create. Milliseconds; \
         p50 / p90 over n runs.\n"
    );
    println!("| cold create → first exec completes (API) | p50 ms | p90 ms | n |");
    println!("|---|---|---|---|");
    println!("{}", row("runtime `crun`", &crun_cold));
    println!("{}", row("runtime `docker`", &docker_cold));
    println!();
    println!("| exec round trip of `true` (API → envd) | p50 ms | p90 ms | n |");
    println!("|---|---|---|---|");
    println!("{}", row("runtime `crun`", &crun_exec));
    println!("{}", row("runtime `docker`", &docker_exec));
    if let (Ok(c), Ok(d)) = (&crun_cold, &docker_cold) {
        println!(
            "\ndocker / crun cold start at p50: {:.1}×. The exec path is the same on both \
             (HTTP → envd over its unix socket); only create goes through dockerd and containerd.",
            d.p50 / c.p50
        );
    }
    Ok(())
}
