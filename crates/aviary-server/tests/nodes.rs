//! Placement across nodes: two `aviary node` agents on loopback ports (real
//! crun each, own state dirs) plus the local node; the scheduler's decision
//! is an event, and a sandbox placed on an agent works through its envd.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::ErrorCode;

async fn agent(
    dir: &std::path::Path,
    id: &str,
    cpu: f64,
    memory_mb: u64,
) -> (aviary_node::RunningNode, String) {
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
        capacity: aviary_node::Capacity { cpu, memory_mb },
        provided_binds: vec![aviary_node::ProvidedBind::envd(common::envd_binary())],
    })
    .await
    .unwrap();
    (node, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_are_placed_on_node_agents_and_work_there() {
    let ts = common::start().await;
    let c = &ts.client;
    let dir = tempfile::Builder::new()
        .prefix("avn")
        .tempdir_in("/tmp")
        .unwrap();
    let (a, ta) = agent(dir.path(), "node-a", 64.0, 262_144).await;
    let (b, tb) = agent(dir.path(), "node-b", 32.0, 131_072).await;

    // registration is admin-only and checks the token with the agent
    let user = aviary_client::Client::new(&ts.url(), &c.create_key("t", false).await.unwrap().key);
    assert_eq!(
        user.add_node("node-a", &a.addr().to_string(), &ta)
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::Forbidden)
    );
    assert_eq!(
        c.add_node("node-a", &a.addr().to_string(), "wrong")
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::InvalidRequest)
    );
    c.add_node("node-a", &a.addr().to_string(), &ta)
        .await
        .unwrap();
    let list = c
        .add_node("node-b", &b.addr().to_string(), &tb)
        .await
        .unwrap();
    let ids: Vec<_> = list["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, vec!["local", "node-a", "node-b"]);

    // the big agents always beat this 2-core host on load after placement
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            class: Some("compute-large".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox;
    assert!(
        s.node == "node-a" || s.node == "node-b",
        "placed on {}",
        s.node
    );
    let evs = c.events(None, None, Some(1000)).await.unwrap().events;
    let placement = evs
        .iter()
        .rev()
        .find(|e| e.event_type == "placement")
        .expect("placement event");
    assert_eq!(placement.metadata["node_id"], s.node.as_str());
    assert_eq!(
        placement.metadata["candidates"].as_array().unwrap().len(),
        3
    );

    // the sandbox works through the agent's envd
    let id = s.id.to_string();
    let r = c
        .exec(&id, &common::shell("echo remote; hostname"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "remote\nsandbox\n");
    c.write_file(&id, "/workspace/x", b"over the network".to_vec(), None)
        .await
        .unwrap();
    assert_eq!(
        c.read_file(&id, "/workspace/x").await.unwrap(),
        b"over the network"
    );
    // ports and background commands through the agent: envd's tunnel and
    // its output rings are reached over the node's upgraded connection
    c.mkdir(&id, "/workspace/www", None).await.unwrap();
    c.write_file(
        &id,
        "/workspace/www/index.html",
        b"served remotely".to_vec(),
        None,
    )
    .await
    .unwrap();
    let bg = c
        .start_background(
            &id,
            &common::shell("echo serving; exec httpd -f -p 127.0.0.1:8080 -h /workspace/www"),
        )
        .await
        .unwrap();
    let ps = c.list_processes(&id).await.unwrap();
    assert!(ps.processes.iter().any(|p| p.pid == bg.pid), "{ps:?}");
    // its live usage is read through the agent (the node's cgroup files)
    let u = c.sandbox_usage(&id).await.unwrap();
    assert_eq!(u.sandbox_id, s.id);
    assert!(u.memory_bytes > 0 && u.pids >= 2, "envd and httpd: {u:?}");
    assert_eq!(u.memory_limit_bytes, s.resources.memory_mb * 1024 * 1024);
    let url = format!("{}/v1/sandboxes/{id}/ports/8080/index.html", ts.url());
    let http = reqwest::Client::new();
    let mut got = None;
    for _ in 0..100 {
        let r = http.get(&url).bearer_auth(&ts.key).send().await.unwrap();
        if r.status() != reqwest::StatusCode::BAD_GATEWAY {
            got = Some((r.status(), r.text().await.unwrap()));
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        got,
        Some((reqwest::StatusCode::OK, "served remotely".to_owned()))
    );
    c.signal_process(&id, bg.pid, Some("TERM"), None)
        .await
        .unwrap();
    let mut follow = c.follow_background(&id, bg.handle).await.unwrap();
    let mut out = Vec::new();
    let mut exit = None;
    while let Some(item) = follow.next().await.unwrap() {
        match item {
            aviary_client::StreamItem::Stdout(d) => out.extend(d),
            aviary_client::StreamItem::Exit(r) => exit = Some(r.exit_code),
            aviary_client::StreamItem::Stderr(_) => {}
        }
    }
    assert_eq!((out.as_slice(), exit), (&b"serving\n"[..], Some(128 + 15)));
    c.sandbox_action(&id, "pause", None).await.unwrap();
    c.sandbox_action(&id, "resume", None).await.unwrap();
    // the agent snapshots its own layers; the chunks land in this store
    let snap = c.snapshot(&id, None).await.unwrap();
    assert!(snap["total_bytes"].as_u64().unwrap() >= 16, "{snap}");
    let listed = c.snapshots(Some(&id)).await.unwrap();
    assert_eq!(listed["snapshots"][0]["id"], snap["id"], "{listed}");
    let nodes = c.nodes().await.unwrap();
    let on = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == s.node.as_str())
        .unwrap()
        .clone();
    assert!(on["cpu_committed"].as_f64().unwrap() >= 8.0, "{on}");
    c.delete_sandbox(&id, None).await.unwrap();
    // the capacity stays committed until the background reclaim has torn the compute down
    ts.cp().reclaims.settled().await;
    let nodes = c.nodes().await.unwrap();
    let on = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == s.node.as_str())
        .unwrap()
        .clone();
    assert_eq!(on["cpu_committed"].as_f64().unwrap(), 0.0, "{on}");
    a.stop().await;
    b.stop().await;
}
