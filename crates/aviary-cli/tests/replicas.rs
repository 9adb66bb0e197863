//! Distributed mode as an operator runs it, with real processes: two
//! `aviary serve` replicas on one PostgreSQL + Redis (the test services of
//! scripts/services.sh), one `aviary node` agent holding the compute, and the
//! `aviary` CLI as the client. Faults are real signals: SIGSTOP/SIGCONT of a
//! lease holder past its TTL, `kill -9` of a replica in the middle of an exec.
//! Each fault counts what must never happen (stale writes accepted,
//! committed files lost) and asserts zero.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_aviary");

/// A child process, killed (-9) and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn envd() -> PathBuf {
    if let Some(p) = std::env::var_os("AVIARY_ENVD") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/build-envd.sh"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn template_cache() -> PathBuf {
    let p = std::env::var_os("AVIARY_TEST_TEMPLATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/aviary-test-templates"));
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn services() -> Option<(String, String)> {
    match (
        std::env::var("AVIARY_TEST_POSTGRES_URL"),
        std::env::var("AVIARY_TEST_REDIS_URL"),
    ) {
        (Ok(pg), Ok(redis)) => Some((pg, redis)),
        _ => {
            let why = "SKIPPED: AVIARY_TEST_POSTGRES_URL / AVIARY_TEST_REDIS_URL not set (run scripts/services.sh start)";
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            None
        }
    }
}

struct Replica {
    proc: Proc,
    url: String,
    data: PathBuf,
}

fn replica(dir: &Path, name: &str, pg: &str, redis: &str, space: &str) -> Replica {
    let data = dir.join(name);
    std::fs::create_dir_all(&data).unwrap();
    let url = format!("http://127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let config = dir.join(format!("{name}.toml"));
    // schema and key prefix of this test's own deployment; busybox default
    std::fs::write(
        &config,
        format!(
            "[server]\ndefault_template = \"busybox\"\n\n[distributed]\nregistry = \"{pg}\"\ncoordination = \"{redis}\"\nschema = \"{space}\"\nkey_prefix = \"{space}\"\n"
        ),
    )
    .unwrap();
    let child = Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", url.trim_start_matches("http://")])
        .arg("--templates-dir")
        .arg(template_cache())
        .arg("--envd")
        .arg(envd())
        .args(["--default-template-source", "busybox"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let r = Replica {
        proc: Proc(child),
        url,
        data,
    };
    wait_ready(&r.url, dir, name);
    r
}

fn wait_ready(url: &str, dir: &Path, name: &str) {
    let start = Instant::now();
    loop {
        let out = Command::new("curl")
            .args(["-s", &format!("{url}/readyz")])
            .output()
            .unwrap();
        let body = String::from_utf8_lossy(&out.stdout);
        if body.contains("\"ready\"") {
            return;
        }
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "{name} not ready: {body}\n{log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn agent(dir: &Path, id: &str, token: &str) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join(format!("{id}.log"))).unwrap();
    let child = Command::new(BIN)
        .args(["node", "--id", id, "--listen", &addr, "--token", token])
        .arg("--data-dir")
        .arg(dir.join(id))
        .arg("--templates-dir")
        .arg(template_cache())
        .arg("--envd")
        .arg(envd())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "agent {id} did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (Proc(child), addr)
}

/// The `aviary` CLI against `url` with `key`.
fn cli(url: &str, key: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("AVIARY_URL", url)
        .env("AVIARY_API_KEY", key)
        .output()
        .unwrap()
}

fn ok(o: Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}: {}{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill {sig} {pid}");
}

#[test]
fn two_replicas_and_an_agent_survive_a_stopped_holder_and_a_killed_replica() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("avr")
        .tempdir_in("/tmp")
        .unwrap();
    let space = format!("t_replicas_{}", std::process::id());
    let (_agent, agent_addr) = agent(dir.path(), "agent-1", "agent-token");
    let a = replica(dir.path(), "replica-a", &pg, &redis, &space);
    let b = replica(dir.path(), "replica-b", &pg, &redis, &space);
    // the admin key of one replica is valid on every replica (one registry)
    let key = std::fs::read_to_string(a.data.join("admin.key"))
        .unwrap()
        .trim()
        .to_owned();
    let on_a = |args: &[&str]| cli(&a.url, &key, args);
    let on_b = |args: &[&str]| cli(&b.url, &key, args);

    ok(on_a(&[
        "nodes",
        "add",
        "agent-1",
        &agent_addr,
        "--token",
        "agent-token",
    ]));
    let start = Instant::now();
    while !ok(on_b(&["nodes", "ls", "--json"])).contains("agent-1") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "B never saw the agent"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let created: serde_json::Value =
        serde_json::from_str(&ok(on_a(&["sandbox", "create", "--json"]))).unwrap();
    let sandbox = created.get("sandbox").unwrap_or(&created);
    assert_eq!(sandbox["node"], "agent-1", "placed on the agent: {created}");
    let id = sandbox["id"].as_str().unwrap().to_owned();

    // --- a lease holder stopped past its TTL (SIGSTOP), then resumed
    let old = ok(on_a(&[
        "lease", "acquire", &id, "--owner", "holder-1", "--ttl", "3",
    ]));
    let holder_loop = format!(
        "i=0; while true; do i=$((i+1)); \
         {BIN} lease renew {id} --token {old} --ttl 3 >/dev/null 2>&1; \
         {BIN} sandbox exec {id} --token {old} -- sh -c \"echo old-$i >> /workspace/log\" >/dev/null 2>&1; \
         sleep 0.2; done"
    );
    let holder = Proc(
        Command::new("sh")
            .args(["-c", &holder_loop])
            .env("AVIARY_URL", &b.url)
            .env("AVIARY_API_KEY", &key)
            .spawn()
            .unwrap(),
    );
    // let it write a few lines, then stop it (and its children) past the TTL
    let start = Instant::now();
    while !ok(on_a(&[
        "sandbox",
        "exec",
        &id,
        "--token",
        &old,
        "--",
        "sh",
        "-c",
        "cat /workspace/log 2>/dev/null || true",
    ]))
    .contains("old-2")
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the holder never wrote"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    signal(holder.0.id(), "-STOP");
    let new = {
        let start = Instant::now();
        loop {
            let o = on_b(&[
                "lease", "acquire", &id, "--owner", "holder-2", "--ttl", "60",
            ]);
            if o.status.success() {
                break String::from_utf8_lossy(&o.stdout).trim().to_owned();
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the TTL never ran out"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    ok(on_a(&[
        "sandbox",
        "exec",
        &id,
        "--token",
        &new,
        "--",
        "sh",
        "-c",
        "echo NEW >> /workspace/log",
    ]));
    signal(holder.0.id(), "-CONT");
    // give the resumed holder time for several writes, through replica B
    std::thread::sleep(Duration::from_secs(2));
    drop(holder);
    let log = ok(on_b(&[
        "sandbox",
        "exec",
        &id,
        "--token",
        &new,
        "--",
        "cat",
        "/workspace/log",
    ]));
    let after_new: Vec<_> = log
        .lines()
        .skip_while(|l| *l != "NEW")
        .skip(1)
        .filter(|l| l.starts_with("old-"))
        .collect();
    assert_eq!(
        after_new.len(),
        0,
        "stale writes accepted after the new grant: {after_new:?}"
    );
    assert!(
        log.contains("old-1") && log.contains("NEW"),
        "committed writes kept: {log}"
    );

    // --- replica A killed (-9) in the middle of an exec; the client retries on B
    let mut running = Command::new(BIN)
        .args([
            "sandbox",
            "exec",
            &id,
            "--token",
            &new,
            "--",
            "sh",
            "-c",
            "sleep 2; echo late",
        ])
        .env("AVIARY_URL", &a.url)
        .env("AVIARY_API_KEY", &key)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let mut a = a;
    let _ = a.proc.0.kill();
    let _ = a.proc.0.wait();
    let st = running.wait().unwrap();
    assert!(
        !st.success(),
        "the exec through the killed replica did not complete"
    );
    let retried = ok(on_b(&[
        "sandbox",
        "exec",
        &id,
        "--token",
        &new,
        "--",
        "cat",
        "/workspace/log",
    ]));
    assert_eq!(
        retried, log,
        "committed files lost = 0 after the replica died"
    );
    ok(on_b(&["sandbox", "rm", &id, "--token", &new]));
}
