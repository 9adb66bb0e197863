//! Distributed mode as an operator runs it, with real processes: `aviary
//! serve` replicas on one PostgreSQL + Redis (+ the S3-compatible store; the
//! test services of scripts/services.sh), `aviary node` agents holding the
//! compute, and the `aviary` CLI as the client. Faults are real signals:
//! SIGSTOP/SIGCONT of a lease holder past its TTL, `kill -9` of a replica in
//! the middle of an exec, `kill -9` of a node agent (and its return), and
//! `kill -9` of a sandbox's processes behind the control plane's back. Each
//! fault counts what must never happen (stale writes accepted, committed
//! files lost, orphans left) and asserts zero; the time each took to
//! converge is printed (`converged in`) for BENCHMARKS.md.

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

/// How a test's replicas are set up beyond the shared registry and
/// coordination store.
#[derive(Clone, Default)]
struct ReplicaOpts {
    /// Run sandboxes on this replica too, as node `node_name`.
    node_name: Option<String>,
    /// Snapshots in the S3-compatible test store under this prefix.
    s3_prefix: Option<String>,
    /// `[reconciler]` keys (a fast loop for the fault tests).
    fast_reconciler: bool,
}

fn replica(dir: &Path, name: &str, pg: &str, redis: &str, space: &str) -> Replica {
    replica_with(dir, name, pg, redis, space, &ReplicaOpts::default())
}

fn replica_with(
    dir: &Path,
    name: &str,
    pg: &str,
    redis: &str,
    space: &str,
    opts: &ReplicaOpts,
) -> Replica {
    let data = dir.join(name);
    std::fs::create_dir_all(&data).unwrap();
    let url = format!("http://127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let config = dir.join(format!("{name}.toml"));
    // schema and key prefix of this test's own deployment; busybox default
    let mut toml = format!(
        "[server]\ndefault_template = \"busybox\"\n\n[distributed]\nregistry = \"{pg}\"\ncoordination = \"{redis}\"\nschema = \"{space}\"\nkey_prefix = \"{space}\"\n"
    );
    if let Some(node) = &opts.node_name {
        toml.push_str(&format!("node_name = \"{node}\"\n"));
    }
    if opts.fast_reconciler {
        toml.push_str(
            "\n[reconciler]\ninterval_ms = 300\norphan_grace_s = 3\nnode_unhealthy_after_s = 2\n",
        );
    }
    if let Some(prefix) = &opts.s3_prefix {
        let endpoint = std::env::var("AVIARY_TEST_S3_ENDPOINT").expect("AVIARY_TEST_S3_ENDPOINT");
        let bucket = std::env::var("AVIARY_TEST_S3_BUCKET").expect("AVIARY_TEST_S3_BUCKET");
        toml.push_str(&format!(
            "\n[snapshots]\nstore = \"s3\"\nendpoint = \"{endpoint}\"\nbucket = \"{bucket}\"\nprefix = \"{prefix}\"\naccess_key_env = \"AVIARY_TEST_S3_ACCESS_KEY\"\nsecret_key_env = \"AVIARY_TEST_S3_SECRET_KEY\"\n"
        ));
    }
    std::fs::write(&config, toml).unwrap();
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
    (agent_at(dir, id, token, &addr), addr)
}

/// An agent on `addr` with its data in `<dir>/<id>` (the same call starts
/// it again after a `kill -9`: its sandboxes outlive it).
fn agent_at(dir: &Path, id: &str, token: &str, addr: &str) -> Proc {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{id}.log")))
        .unwrap();
    let child = Command::new(BIN)
        .args(["node", "--id", id, "--listen", addr, "--token", token])
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
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "agent {id} did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Proc(child)
}

/// The sandboxes an agent runs, from its own API.
/// What is left once the background reclaims of removed sandboxes have finished
/// (`sandbox rm` answers before the compute is torn down): `left` is polled until it
/// is empty or two minutes have passed, and its last answer returned for the caller's
/// assertion.
fn after_reclaim<T>(left: impl Fn() -> Vec<T>) -> Vec<T> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let now = left();
        if now.is_empty() || Instant::now() >= deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What the agents still run once the background reclaims have finished.
fn agent_sandboxes_after_reclaim(agents: &[(&str, &str)]) -> Vec<String> {
    after_reclaim(|| {
        agents
            .iter()
            .flat_map(|(addr, token)| agent_sandboxes(addr, token))
            .collect()
    })
}

fn agent_sandboxes(addr: &str, token: &str) -> Vec<String> {
    let out = Command::new("curl")
        .args(["-sf", "-H", &format!("Authorization: Bearer {token}")])
        .arg(format!("http://{addr}/node/v1/sandboxes"))
        .output()
        .unwrap();
    assert!(out.status.success(), "listing agent {addr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// A sandbox's id and state from `sandbox get --json`.
fn state_of(url: &str, key: &str, id: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(&ok(cli(url, key, &["sandbox", "get", id, "--json"]))).unwrap();
    let s = v.get("sandbox").unwrap_or(&v);
    s["state"].as_str().unwrap().to_ascii_lowercase()
}

/// Waits until the sandbox is in `want` (lowercase); how long that took.
fn wait_state(url: &str, key: &str, id: &str, want: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let now = state_of(url, key, id);
        if now == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{id} still {now}, not {want}, after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The event types of one sandbox, oldest first (`events --json` prints
/// one JSON object a line).
fn event_types(url: &str, key: &str, id: &str) -> Vec<String> {
    ok(cli(
        url,
        key,
        &["events", "--sandbox", id, "--limit", "1000", "--json"],
    ))
    .lines()
    .map(|l| {
        let e: serde_json::Value = serde_json::from_str(l).unwrap();
        e["event_type"].as_str().unwrap().to_owned()
    })
    .collect()
}

/// The pids of every process in the sandbox's cgroups (`/aviary/<id>`).
fn sandbox_pids(id: &str) -> Vec<u32> {
    let needle = format!("/aviary/{id}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cg) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if cg
            .lines()
            .any(|l| l.ends_with(&needle) || l.contains(&format!("{needle}/")))
        {
            pids.push(pid);
        }
    }
    pids
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

/// `args` as an `aviary` command line on `url`.
type On<'a> = &'a dyn Fn(&[&str]) -> Output;

/// Runs `sh -c script` in the sandbox through `on`, with `token` if any.
fn sh(on: On<'_>, id: &str, token: Option<&str>, script: &str) -> Output {
    let mut args = vec!["sandbox", "exec", id];
    if let Some(t) = token {
        args.extend(["--token", t]);
    }
    args.extend(["--", "sh", "-c", script]);
    on(&args)
}

/// Waits until `on`'s replica lists every node in `names`.
fn wait_nodes(on: On<'_>, names: &[&str]) {
    let start = Instant::now();
    loop {
        let nodes = ok(on(&["nodes", "ls", "--json"]));
        if names.iter().all(|n| nodes.contains(n)) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{names:?} never listed: {nodes}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Creates a sandbox through `on`: (id, node).
fn create(on: On<'_>) -> (String, String) {
    let created: serde_json::Value =
        serde_json::from_str(&ok(on(&["sandbox", "create", "--json"]))).unwrap();
    let s = created.get("sandbox").unwrap_or(&created);
    (
        s["id"].as_str().unwrap().to_owned(),
        s["node"].as_str().unwrap().to_owned(),
    )
}

fn admin_key(r: &Replica) -> String {
    std::fs::read_to_string(r.data.join("admin.key"))
        .unwrap()
        .trim()
        .to_owned()
}

#[test]
fn three_replicas_and_two_agents_survive_a_stopped_holder_and_a_killed_replica() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("avr")
        .tempdir_in("/tmp")
        .unwrap();
    let space = format!("t_replicas_{}", std::process::id());
    let (_agent1, addr1) = agent(dir.path(), "agent-1", "agent-token-1");
    let (_agent2, addr2) = agent(dir.path(), "agent-2", "agent-token-2");
    let a = replica(dir.path(), "replica-a", &pg, &redis, &space);
    let b = replica(dir.path(), "replica-b", &pg, &redis, &space);
    let c = replica(dir.path(), "replica-c", &pg, &redis, &space);
    // the admin key of one replica is valid on every replica (one registry)
    let key = admin_key(&a);
    let on_a = |args: &[&str]| cli(&a.url, &key, args);
    let on_b = |args: &[&str]| cli(&b.url, &key, args);
    let on_c = |args: &[&str]| cli(&c.url, &key, args);

    ok(on_a(&[
        "nodes",
        "add",
        "agent-1",
        &addr1,
        "--token",
        "agent-token-1",
    ]));
    ok(on_c(&[
        "nodes",
        "add",
        "agent-2",
        &addr2,
        "--token",
        "agent-token-2",
    ]));
    for on in [&on_a as On<'_>, &on_b, &on_c] {
        wait_nodes(on, &["agent-1", "agent-2"]);
    }
    // stateless replicas place only on agents, the least loaded first
    let (id, node_0) = create(&on_a);
    let (other, node_1) = create(&on_b);
    let mut nodes = [node_0, node_1];
    nodes.sort();
    assert_eq!(nodes, ["agent-1", "agent-2"], "one sandbox on each agent");
    // every replica serves every sandbox
    for on in [&on_a as On<'_>, &on_b, &on_c] {
        for sbx in [&id, &other] {
            assert_eq!(ok(on(&["sandbox", "exec", sbx, "--", "echo", "hi"])), "hi");
        }
    }

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
    while !ok(sh(
        &on_a,
        &id,
        Some(&old),
        "cat /workspace/log 2>/dev/null || true",
    ))
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
            let o = on_c(&[
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
    ok(sh(&on_a, &id, Some(&new), "echo NEW >> /workspace/log"));
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

    // --- replica A killed (-9) in the middle of an exec; the client retries on C
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
    let retried = ok(on_c(&[
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
    ok(on_c(&["sandbox", "rm", &other]));
    // orphans left = 0: neither agent runs anything once both are removed
    let left =
        agent_sandboxes_after_reclaim(&[(&addr1, "agent-token-1"), (&addr2, "agent-token-2")]);
    assert_eq!(left, Vec::<String>::new(), "orphans left on the agents");
}

#[test]
fn a_killed_agent_loses_its_sandboxes_and_gets_them_back_when_it_returns() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("avk")
        .tempdir_in("/tmp")
        .unwrap();
    let space = format!("t_agent_kill_{}", std::process::id());
    let (agent1, addr1) = agent(dir.path(), "agent-1", "tok-1");
    let (_agent2, addr2) = agent(dir.path(), "agent-2", "tok-2");
    let opts = ReplicaOpts {
        fast_reconciler: true,
        ..Default::default()
    };
    let a = replica_with(dir.path(), "replica-a", &pg, &redis, &space, &opts);
    let b = replica_with(dir.path(), "replica-b", &pg, &redis, &space, &opts);
    let key = admin_key(&a);
    let on_a = |args: &[&str]| cli(&a.url, &key, args);
    let on_b = |args: &[&str]| cli(&b.url, &key, args);
    ok(on_a(&[
        "nodes", "add", "agent-1", &addr1, "--token", "tok-1",
    ]));
    ok(on_a(&[
        "nodes", "add", "agent-2", &addr2, "--token", "tok-2",
    ]));
    wait_nodes(&on_a, &["agent-1", "agent-2"]);
    wait_nodes(&on_b, &["agent-1", "agent-2"]);
    let mut on_node = std::collections::HashMap::new();
    for _ in 0..2 {
        let (id, node) = create(&on_a);
        on_node.insert(node, id);
    }
    let (victim, bystander) = (on_node["agent-1"].clone(), on_node["agent-2"].clone());
    let old = ok(on_b(&[
        "lease", "acquire", &victim, "--owner", "holder-1", "--ttl", "600",
    ]));
    ok(sh(
        &on_b,
        &victim,
        Some(&old),
        "echo committed > /workspace/kept",
    ));

    // kill -9 the agent: its sandboxes keep running, but nobody can reach them
    let mut agent1 = agent1;
    let _ = agent1.0.kill();
    let _ = agent1.0.wait();
    let to_lost = wait_state(&a.url, &key, &victim, "lost", Duration::from_secs(60));
    assert_eq!(
        state_of(&b.url, &key, &bystander),
        "idle",
        "the other agent's sandbox is untouched"
    );
    let events = event_types(&a.url, &key, &victim);
    assert!(events.iter().any(|e| e == "sandbox_lost"), "{events:?}");
    // while it is lost, a write is refused
    let refused = sh(&on_b, &victim, Some(&old), "echo stale >> /workspace/kept");
    assert!(
        !refused.status.success(),
        "a write to a lost sandbox was accepted"
    );

    // the agent comes back on the same address with the same data
    let _agent1 = agent_at(dir.path(), "agent-1", "tok-1", &addr1);
    let to_back = wait_state(&b.url, &key, &victim, "idle", Duration::from_secs(60));
    let events = event_types(&a.url, &key, &victim);
    assert!(events.iter().any(|e| e == "reattached"), "{events:?}");
    eprintln!(
        "converged in: agent killed -> its sandbox Lost {:.2} s (unhealthy after 2 s, 300 ms passes); agent back -> Idle {:.2} s",
        to_lost.as_secs_f64(),
        to_back.as_secs_f64(),
    );

    // the old holder's token died with the loss: refused through every replica
    let mut stale_accepted = 0;
    for on in [&on_a as On<'_>, &on_b] {
        if sh(on, &victim, Some(&old), "echo stale >> /workspace/kept")
            .status
            .success()
        {
            stale_accepted += 1;
        }
    }
    assert_eq!(stale_accepted, 0, "stale writes accepted");
    let new = ok(on_a(&[
        "lease", "acquire", &victim, "--owner", "holder-2", "--ttl", "60",
    ]));
    let kept = ok(sh(&on_b, &victim, Some(&new), "cat /workspace/kept"));
    assert_eq!(
        kept, "committed",
        "committed files lost = 0 across the agent's death"
    );
    ok(on_a(&["sandbox", "rm", &victim, "--token", &new]));
    ok(on_a(&["sandbox", "rm", &bystander]));
    let left = agent_sandboxes_after_reclaim(&[(&addr1, "tok-1"), (&addr2, "tok-2")]);
    assert_eq!(left, Vec::<String>::new(), "orphans left on the agents");
}

#[test]
fn compute_killed_behind_the_planes_back_is_restored_from_its_snapshot() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("avs")
        .tempdir_in("/tmp")
        .unwrap();
    let space = format!("t_restore_{}", std::process::id());
    // replica A runs sandboxes itself (node "node-a"); B is stateless
    let a_opts = ReplicaOpts {
        node_name: Some("node-a".into()),
        s3_prefix: Some(space.clone()),
        fast_reconciler: true,
    };
    let b_opts = ReplicaOpts {
        node_name: None,
        ..a_opts.clone()
    };
    let a = replica_with(dir.path(), "replica-a", &pg, &redis, &space, &a_opts);
    let b = replica_with(dir.path(), "replica-b", &pg, &redis, &space, &b_opts);
    let key = admin_key(&a);
    let on_a = |args: &[&str]| cli(&a.url, &key, args);
    let on_b = |args: &[&str]| cli(&b.url, &key, args);
    // on A's own node (the only node before the agent is registered)
    let (id, node) = create(&on_a);
    assert_eq!(node, "node-a");
    let (_agent, addr) = agent(dir.path(), "agent-1", "tok-1");
    ok(on_b(&[
        "nodes", "add", "agent-1", &addr, "--token", "tok-1",
    ]));
    wait_nodes(&on_a, &["agent-1"]);
    // the stateless replica places on the agent
    let (remote, node) = create(&on_b);
    assert_eq!(node, "agent-1");
    ok(sh(
        &on_a,
        &id,
        None,
        "echo committed > /workspace/kept && mkdir -p /workspace/d && echo 2 > /workspace/d/two",
    ));
    ok(on_a(&["sandbox", "snapshot", &id]));
    ok(sh(
        &on_b,
        &remote,
        None,
        "echo remote > /workspace/kept && echo tool > /etc/tool",
    ));
    ok(on_b(&["sandbox", "snapshot", &remote]));

    for (sbx, where_) in [(&id, "the replica's own node"), (&remote, "a node agent")] {
        // every process of the sandbox killed from the host, not through Aviary
        let pids = sandbox_pids(sbx);
        assert!(!pids.is_empty(), "found the sandbox's processes");
        let killed_at = Instant::now();
        for pid in &pids {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        // the reconciler (or the envd probe) finds it lost, then restores it
        let start = Instant::now();
        loop {
            let events = event_types(&b.url, &key, sbx);
            if events.iter().any(|e| e == "recovered") {
                break;
            }
            assert!(
                !events
                    .iter()
                    .any(|e| e == "recovery_failed" || e == "unrecoverable"),
                "{events:?}"
            );
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "never recovered: {events:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        wait_state(&b.url, &key, sbx, "idle", Duration::from_secs(30));
        eprintln!(
            "converged in: processes killed on {where_} -> restored and Idle {:.2} s (300 ms passes)",
            killed_at.elapsed().as_secs_f64()
        );
        let events = event_types(&a.url, &key, sbx);
        let lost = events
            .iter()
            .position(|e| e == "sandbox_lost")
            .expect("a sandbox_lost event");
        let recovered = events.iter().position(|e| e == "recovered").unwrap();
        assert!(lost < recovered, "{events:?}");
        assert!(!sandbox_pids(sbx).is_empty(), "new compute runs");
    }
    let kept = ok(sh(&on_a, &id, None, "cat /workspace/kept /workspace/d/two"));
    assert_eq!(kept, "committed\n2", "committed files lost = 0");
    let kept = ok(sh(&on_a, &remote, None, "cat /workspace/kept /etc/tool"));
    assert_eq!(
        kept, "remote\ntool",
        "committed files lost = 0 on the agent"
    );
    ok(on_a(&["sandbox", "rm", &id]));
    ok(on_b(&["sandbox", "rm", &remote]));
    assert_eq!(
        after_reclaim(|| sandbox_pids(&id)),
        Vec::<u32>::new(),
        "orphans left = 0"
    );
    assert_eq!(
        after_reclaim(|| sandbox_pids(&remote)),
        Vec::<u32>::new(),
        "orphans left = 0"
    );
    assert_eq!(
        agent_sandboxes_after_reclaim(&[(&addr, "tok-1")]),
        Vec::<String>::new()
    );
}
