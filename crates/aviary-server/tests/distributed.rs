//! Distributed mode against real services: the registry on PostgreSQL, the
//! leases and locks on Redis (both started by scripts/services.sh), the
//! sandboxes on real crun. Each test uses its own PostgreSQL schema and Redis
//! key prefix, so they share the two servers with every other test.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_config::{DistributedSettings, ServiceKind, ServiceUrl};
use aviary_core::ErrorCode;
use aviary_server::config::ServerConfig;
use std::time::Duration;

/// The services' URLs, or `None` (and a loud line) when they are not there.
fn services() -> Option<(String, String)> {
    let pg = std::env::var("AVIARY_TEST_POSTGRES_URL").ok();
    let redis = std::env::var("AVIARY_TEST_REDIS_URL").ok();
    match (pg, redis) {
        (Some(pg), Some(redis)) => Some((pg, redis)),
        _ => {
            let why = "SKIPPED: AVIARY_TEST_POSTGRES_URL / AVIARY_TEST_REDIS_URL not set (run scripts/services.sh start)";
            if std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() == Ok("1") {
                panic!("{why}");
            }
            eprintln!("{why}");
            None
        }
    }
}

fn unique(tag: &str) -> String {
    format!(
        "t_{tag}_{}",
        aviary_core::SandboxId::generate()
            .as_str()
            .replace('-', "_")
            .to_lowercase()
    )
}

/// `cfg` on PostgreSQL + Redis, in schema and key prefix `space`, its own
/// sandboxes on node `node`.
fn distributed(cfg: &mut ServerConfig, pg: &str, redis: &str, space: &str) {
    on_node(cfg, pg, redis, space, "replica-1");
}

fn on_node(cfg: &mut ServerConfig, pg: &str, redis: &str, space: &str, node: &str) {
    cfg.control.settings.distributed = DistributedSettings {
        registry: Some(ServiceUrl::parse(ServiceKind::Registry, pg).unwrap()),
        coordination: Some(ServiceUrl::parse(ServiceKind::Coordination, redis).unwrap()),
        schema: Some(space.to_owned()),
        key_prefix: space.to_owned(),
        node_name: Some(node.to_owned()),
    };
    cfg.control.local_node = node.to_owned();
}

fn code(e: aviary_client::ClientError) -> Option<ErrorCode> {
    e.code()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_on_postgres_and_redis_runs_the_whole_loop_and_survives_a_restart() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let space = unique("loop");
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    distributed(&mut cfg, &pg, &redis, &space);
    let mut ts = common::start_cfg(cfg.clone()).await;
    assert!(
        !ts.data.join("registry.db").exists(),
        "distributed mode keeps no SQLite registry"
    );
    let c = ts.client.clone();
    let id = common::new_sandbox(&c).await;
    let out = c.exec(&id, &common::shell("echo hello")).await.unwrap();
    assert_eq!(out.stdout, "hello\n");

    // leases live in Redis, fences come from PostgreSQL
    let first = c.acquire_lease(&id, "agent-1", Some(60)).await.unwrap();
    let e = c.acquire_lease(&id, "agent-2", Some(60)).await.unwrap_err();
    assert_eq!(code(e), Some(ErrorCode::LeaseHeld));
    c.write_file(&id, "/workspace/a.txt", b"one".to_vec(), Some(first.token))
        .await
        .unwrap();
    let e = c
        .write_file(&id, "/workspace/a.txt", b"x".to_vec(), None)
        .await
        .unwrap_err();
    assert_eq!(code(e), Some(ErrorCode::LeaseRequired));
    c.release_lease(&id, first.token).await.unwrap();
    let second = c.acquire_lease(&id, "agent-2", Some(60)).await.unwrap();
    assert!(second.token.fence() > first.token.fence());
    let e = c
        .write_file(
            &id,
            "/workspace/a.txt",
            b"stale".to_vec(),
            Some(first.token),
        )
        .await
        .unwrap_err();
    assert_eq!(
        code(e),
        Some(ErrorCode::StaleToken),
        "the old holder is fenced out"
    );
    let e = c.delete_sandbox(&id, Some(first.token)).await.unwrap_err();
    assert_eq!(
        code(e),
        Some(ErrorCode::StaleToken),
        "and cannot delete either"
    );

    // a restart on the same schema and prefix keeps the sandbox and its lease
    ts.stop().await;
    let ts = common::start_cfg(cfg).await;
    let c = ts.client.clone();
    let rec = c.get_sandbox(&id).await.unwrap();
    assert_eq!(rec.id.as_str(), id);
    let e = c.acquire_lease(&id, "agent-3", Some(60)).await.unwrap_err();
    assert_eq!(
        code(e),
        Some(ErrorCode::LeaseHeld),
        "the lease survived the restart"
    );
    let got = c.read_file(&id, "/workspace/a.txt").await.unwrap();
    assert_eq!(got, b"one", "the stale write changed nothing");
    let out = c
        .exec(
            &id,
            &aviary_core::api::ExecRequest {
                token: Some(second.token),
                ..common::shell("cat /workspace/a.txt")
            },
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "one");
    c.delete_sandbox(&id, Some(second.token)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_services_stop_the_start_naming_them() {
    let Some((pg, _redis)) = services() else {
        return;
    };
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();

    let mut cfg = common::config(&dir.path().join("a"), "busybox");
    let bad_pg = format!("postgres://aviary:hunter2@127.0.0.1:{closed}/aviary");
    distributed(&mut cfg, &bad_pg, "redis://127.0.0.1:1/0", &unique("down"));
    let started = std::time::Instant::now();
    let e = format!(
        "{:#}",
        aviary_server::start(cfg, |_| {})
            .await
            .err()
            .expect("start fails")
    );
    assert!(
        e.contains("registry") && e.contains(&format!("127.0.0.1:{closed}")),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "no password in the error: {e}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "it gives up: {e}"
    );

    let mut cfg = common::config(&dir.path().join("b"), "busybox");
    distributed(
        &mut cfg,
        &pg,
        &format!("redis://:hunter2@127.0.0.1:{closed}/0"),
        &unique("down"),
    );
    let e = format!(
        "{:#}",
        aviary_server::start(cfg, |_| {})
            .await
            .err()
            .expect("start fails")
    );
    assert!(
        e.contains("coordination") && e.contains(&format!("127.0.0.1:{closed}")),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "no password in the error: {e}");

    // an unset ${VAR} names the variable
    let mut cfg = common::config(&dir.path().join("c"), "busybox");
    distributed(
        &mut cfg,
        "postgres://aviary:${AVIARY_TEST_SURELY_UNSET_PW}@127.0.0.1/aviary",
        "redis://127.0.0.1/0",
        &unique("down"),
    );
    let e = format!(
        "{:#}",
        aviary_server::start(cfg, |_| {})
            .await
            .err()
            .expect("start fails")
    );
    assert!(
        e.contains("AVIARY_TEST_SURELY_UNSET_PW") && e.contains("not set"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_the_registry_and_leases_and_one_leads() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let space = unique("pair");
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg_a = common::config(&dir.path().join("a"), "busybox");
    on_node(&mut cfg_a, &pg, &redis, &space, "node-a");
    let mut cfg_b = common::config(&dir.path().join("b"), "busybox");
    on_node(&mut cfg_b, &pg, &redis, &space, "node-b");
    let mut a = common::start_cfg(cfg_a).await;
    let mut b = common::start_cfg(cfg_b.clone()).await;

    // a sandbox made through A runs on A's node; B sees it in the registry
    let id = common::new_sandbox(&a.client).await;
    let rec = b.client.get_sandbox(&id).await.unwrap();
    assert_eq!(rec.node, "node-a");
    assert!(b
        .client
        .list_sandboxes(false)
        .await
        .unwrap()
        .sandboxes
        .iter()
        .any(|s| s.id.as_str() == id));

    // one lease for both: held through A, refused through B
    let lease = a
        .client
        .acquire_lease(&id, "agent-a", Some(60))
        .await
        .unwrap();
    let e = b
        .client
        .acquire_lease(&id, "agent-b", Some(60))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("node-a"),
        "B names where it runs: {e}"
    );
    assert_eq!(
        code(e),
        Some(ErrorCode::Unavailable),
        "B cannot push a fence to A's node, so it grants nothing"
    );
    let e = a
        .client
        .acquire_lease(&id, "agent-b", Some(60))
        .await
        .unwrap_err();
    assert_eq!(code(e), Some(ErrorCode::LeaseHeld));
    let e = b.client.delete_sandbox(&id, None).await.unwrap_err();
    assert_eq!(
        code(e),
        Some(ErrorCode::LeaseRequired),
        "B enforces A's lease"
    );
    let e = b
        .client
        .delete_sandbox(
            &id,
            Some(aviary_core::LeaseToken::generate(lease.token.fence())),
        )
        .await
        .unwrap_err();
    assert_eq!(
        code(e),
        Some(ErrorCode::StaleToken),
        "a guessed secret is no token"
    );

    // B restarting does not touch A's sandbox (it reconciles its own node)
    b.stop().await;
    let b = common::start_cfg(cfg_b).await;
    let rec = b.client.get_sandbox(&id).await.unwrap();
    assert_eq!(
        rec.state,
        aviary_core::SandboxState::Leased,
        "not lost by B's restart"
    );
    let out = a
        .client
        .exec(
            &id,
            &aviary_core::api::ExecRequest {
                token: Some(lease.token),
                ..common::shell("echo alive")
            },
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "alive\n");

    // exactly one leader; when it stops, the other takes over
    let locks = aviary_coord_redis::RedisLocks::new(
        aviary_coord_redis::connect(&redis).await.unwrap(),
        space.clone(),
    );
    let name = aviary_leases::LockName::new("leader", "background");
    async fn holder(
        l: &aviary_coord_redis::RedisLocks,
        name: &aviary_leases::LockName,
    ) -> Option<String> {
        aviary_leases::Locks::holder(l, name)
            .await
            .unwrap()
            .map(|h| h.owner)
    }
    let mut first = None;
    for _ in 0..100 {
        first = holder(&locks, &name).await;
        if first.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = first.expect("a replica leads");
    let (a_addr, b_addr) = (
        a.url().replace("http://", ""),
        b.url().replace("http://", ""),
    );
    assert!(
        first.contains(&a_addr) || first.contains(&b_addr),
        "{first}"
    );
    let mut b = b;
    let survivor = if first.contains(&a_addr) {
        a.client.release_lease(&id, lease.token).await.unwrap();
        // a stopped server leaves its sandboxes running: none may outlive the test
        a.client.delete_sandbox(&id, None).await.unwrap();
        a.stop().await;
        b_addr
    } else {
        b.stop().await;
        a_addr
    };
    let mut took_over = false;
    for _ in 0..200 {
        if holder(&locks, &name)
            .await
            .is_some_and(|h| h.contains(&survivor))
        {
            took_over = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        took_over,
        "the surviving replica took the background loops over"
    );
}

/// An `aviary node` agent on loopback (real crun, own state dir).
async fn agent(dir: &std::path::Path, id: &str) -> (aviary_node::RunningNode, String) {
    let state = dir.join(id);
    let rt = aviary_runtime_oci::OciRuntime::new(
        aviary_runtime_oci::OciConfig::new(
            aviary_runtime_oci::OciBinary::Crun,
            state.join("sandboxes"),
        )
        .with_template_store(common::template_cache()),
    )
    .unwrap();
    let rt = std::sync::Arc::new(rt);
    let token = format!("token-{id}");
    let node = aviary_node::start_node(aviary_node::NodeConfig {
        id: id.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        token: token.clone(),
        runtime: rt.clone(),
        layers: Some(rt),
        templates: aviary_templates::TemplateStore::open(common::template_cache()).unwrap(),
        state_dir: state.join("agent"),
        capacity: aviary_node::Capacity {
            cpu: 16.0,
            memory_mb: 65_536,
        },
        provided_binds: vec![aviary_node::ProvidedBind::envd(common::envd_binary())],
    })
    .await
    .unwrap();
    (node, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_replica_serves_a_sandbox_on_a_node_agent() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let space = unique("agent");
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let replica = |name: &str| {
        let mut cfg = common::config(&dir.path().join(name), "busybox");
        on_node(&mut cfg, &pg, &redis, &space, name);
        // the replicas run no sandboxes themselves: compute is on the agent
        cfg.control.local_cpu = 0.0;
        cfg.control.local_memory_mb = 0;
        cfg
    };
    let a = common::start_cfg(replica("replica-a")).await;
    let b = common::start_cfg(replica("replica-b")).await;
    let (node, token) = agent(dir.path(), "agent-1").await;

    // registered through A; B connects it from the registry
    a.client
        .add_node("agent-1", &node.addr().to_string(), &token)
        .await
        .unwrap();
    let mut seen = false;
    for _ in 0..100 {
        let nodes = b.client.nodes().await.unwrap();
        if nodes["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == "agent-1")
        {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen, "B connected the agent A registered");

    let id = common::new_sandbox(&a.client).await;
    assert_eq!(a.client.get_sandbox(&id).await.unwrap().node, "agent-1");
    // any replica serves any request for it
    let lease = a
        .client
        .acquire_lease(&id, "agent", Some(60))
        .await
        .unwrap();
    let with = |t: Option<aviary_core::LeaseToken>, cmd: &str| aviary_core::api::ExecRequest {
        token: t,
        ..common::shell(cmd)
    };
    let out = b
        .client
        .exec(
            &id,
            &with(
                Some(lease.token),
                "echo via-b > /workspace/f; cat /workspace/f",
            ),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "via-b\n");
    let e = b
        .client
        .exec(&id, &with(None, "echo sneaky > /workspace/f"))
        .await
        .unwrap_err();
    assert_eq!(code(e), Some(ErrorCode::LeaseRequired));
    // a new lease through B fences A's old token out on both replicas
    b.client.release_lease(&id, lease.token).await.unwrap();
    let newer = b
        .client
        .acquire_lease(&id, "agent-2", Some(60))
        .await
        .unwrap();
    assert!(newer.token.fence() > lease.token.fence());
    for r in [&a, &b] {
        let e = r
            .client
            .write_file(&id, "/workspace/f", b"stale".to_vec(), Some(lease.token))
            .await
            .unwrap_err();
        assert_eq!(code(e), Some(ErrorCode::StaleToken));
    }
    let got = a.client.read_file(&id, "/workspace/f").await.unwrap();
    assert_eq!(got, b"via-b\n", "no stale write landed");
    a.client
        .delete_sandbox(&id, Some(newer.token))
        .await
        .unwrap();
    drop(node);
}

/// Snapshots, hibernate/wake, fork and a level-2 reset of a sandbox on a
/// node agent, through a replica that runs no sandboxes itself: the agent
/// walks and writes its own layers, the chunks stream to and from the
/// replica's chunk store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_fork_and_hibernate_work_on_a_node_agent() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let space = unique("agent_snap");
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("replica"), "busybox");
    distributed(&mut cfg, &pg, &redis, &space);
    cfg.control.settings.distributed.node_name = None;
    cfg.control.runs_sandboxes = false;
    cfg.control.local_node = "replica-stateless".into();
    let r = common::start_cfg(cfg).await;
    let c = &r.client;
    let (node, token) = agent(dir.path(), "agent-1").await;
    c.add_node("agent-1", &node.addr().to_string(), &token)
        .await
        .unwrap();

    let id = common::new_sandbox(c).await;
    assert_eq!(c.get_sandbox(&id).await.unwrap().node, "agent-1");
    // the workspace and the writable layer (outside /workspace) both count
    let out = c
        .exec(
            &id,
            &common::shell(
                "mkdir -p /workspace/src && echo code > /workspace/src/a.py && \
                 head -c 300000 /dev/urandom > /workspace/blob && md5sum /workspace/blob && \
                 echo tool > /etc/installed-tool",
            ),
        )
        .await
        .unwrap();
    let blob_sum = out.stdout.clone();
    let clean = c.snapshot_labelled(&id, "clean", None).await.unwrap();
    assert!(clean["total_bytes"].as_u64().unwrap() >= 300_000, "{clean}");
    // an incremental snapshot: only what changed travels
    c.exec(&id, &common::shell("echo more > /workspace/src/b.py"))
        .await
        .unwrap();
    let second = c.snapshot(&id, None).await.unwrap();
    assert_eq!(second["parent"], clean["id"], "{second}");
    assert!(
        second["new_bytes"].as_u64().unwrap() < 100_000,
        "the unchanged blob is not sent again: {second}"
    );

    // hibernate: compute gone from the agent; wake: the layers come back
    c.sandbox_action(&id, "hibernate", None).await.unwrap();
    assert_eq!(
        c.get_sandbox(&id).await.unwrap().state,
        aviary_core::SandboxState::Hibernating
    );
    c.sandbox_action(&id, "wake", None).await.unwrap();
    let woke = c.get_sandbox(&id).await.unwrap();
    assert_eq!(woke.node, "agent-1");
    let check =
        "cat /workspace/src/a.py /workspace/src/b.py /etc/installed-tool; md5sum /workspace/blob";
    let out = c.exec(&id, &common::shell(check)).await.unwrap();
    assert_eq!(out.stdout, format!("code\nmore\ntool\n{blob_sum}"));

    // fork: a child on the agent (the only node that can stage layers)
    let child = c.fork(&id, None, None).await.unwrap().sandbox;
    assert_eq!(child.node, "agent-1");
    let out = c
        .exec(child.id.as_str(), &common::shell(check))
        .await
        .unwrap();
    assert_eq!(out.stdout, format!("code\nmore\ntool\n{blob_sum}"));
    c.exec(
        child.id.as_str(),
        &common::shell("echo child > /workspace/src/a.py"),
    )
    .await
    .unwrap();
    let parent_a = c.read_file(&id, "/workspace/src/a.py").await.unwrap();
    assert_eq!(
        parent_a, b"code\n",
        "the fork's change does not show in the parent"
    );

    // level 2: back to the clean checkpoint, on the agent
    c.exec(
        &id,
        &common::shell("rm -rf /workspace/src; echo junk > /etc/junk"),
    )
    .await
    .unwrap();
    c.reset(&id, 2, None).await.unwrap();
    let out = c
        .exec(
            &id,
            &common::shell("cat /workspace/src/a.py; test -e /workspace/src/b.py || echo no-b; test -e /etc/junk || echo no-junk"),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "code\nno-b\nno-junk\n");

    for s in [id.as_str(), child.id.as_str()] {
        c.delete_sandbox(s, None).await.unwrap();
    }
    node.stop().await;
}

/// A stateless replica keeps its warm pools on the node agent (the leader
/// refills them) and hands a create one of those, through any replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pools_live_on_the_node_agents() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let space = unique("agent_pool");
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("replica"), "busybox");
    distributed(&mut cfg, &pg, &redis, &space);
    cfg.control.settings.distributed.node_name = None;
    cfg.control.runs_sandboxes = false;
    cfg.control.local_node = "replica-stateless".into();
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: "python-small".into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 1,
        pool_max: 2,
        buffer_min: 0,
        buffer_max: 0,
    }];
    let r = common::start_cfg(cfg).await;
    let c = &r.client;
    let (node, token) = agent(dir.path(), "agent-1").await;
    c.add_node("agent-1", &node.addr().to_string(), &token)
        .await
        .unwrap();
    let idle = |c: aviary_client::Client| async move {
        c.pools().await.unwrap()["pools"][0]["idle"]
            .as_u64()
            .unwrap()
    };
    let mut filled = false;
    for _ in 0..300 {
        if idle(c.clone()).await == 1 {
            filled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(filled, "the leader filled the agent's pool");
    let created = c
        .create_sandbox(&aviary_core::api::CreateSandboxRequest::default())
        .await
        .unwrap();
    assert!(
        created.decision.reason.starts_with("warm pool hit"),
        "{}",
        created.decision.reason
    );
    assert_eq!(created.sandbox.node, "agent-1");
    let id = created.sandbox.id.to_string();
    let out = c.exec(&id, &common::shell("echo warm")).await.unwrap();
    assert_eq!(out.stdout, "warm\n");
    c.delete_sandbox(&id, None).await.unwrap();
    // refilled once the hand-out ended
    let mut refilled = false;
    for _ in 0..300 {
        if idle(c.clone()).await == 1 {
            refilled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refilled);
    // the warm one left on the agent goes with the test (sandboxes outlive
    // an agent process)
    let (remote, _) = aviary_node::RemoteRuntime::connect(node.addr().to_string(), token)
        .await
        .unwrap();
    for id in aviary_runtime::Runtime::list(&remote).await.unwrap() {
        aviary_runtime::Runtime::destroy(&remote, &id)
            .await
            .unwrap();
    }
    node.stop().await;
}
