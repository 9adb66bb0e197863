//! State that outlives a request lives in the registry (issue 8): a data dir
//! an older version left with JSON side files (`snapshot-index/*.json`,
//! `pools.json`, `nodes.json`) is imported once at start-up, the files are
//! removed, and the server behaves as before: the snapshots restore, the pool
//! bounds hold, the node agent is reconnected.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_registry::SnapshotFilter;
use common::shell;
use std::os::unix::fs::PermissionsExt;

fn pool_config(data: &std::path::Path) -> aviary_server::config::ServerConfig {
    let mut cfg = common::config(data, "busybox");
    cfg.control.settings.pools = vec![aviary_config::PoolSettings {
        class: "python-small".into(),
        template: "busybox".into(),
        runtime: aviary_config::Runtime::Crun,
        pool_min: 0,
        pool_max: 4,
        buffer_min: 0,
        buffer_max: 0,
    }];
    cfg
}

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
    let token = format!("token-{id}-{}", aviary_core::new_id("s"));
    let node = aviary_node::start_node(aviary_node::NodeConfig {
        id: id.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        token: token.clone(),
        runtime: rt.clone(),
        layers: Some(rt),
        templates: aviary_templates::TemplateStore::open(common::template_cache()).unwrap(),
        state_dir: state.join("agent"),
        capacity: aviary_node::Capacity {
            cpu: 8.0,
            memory_mb: 16_384,
        },
        provided_binds: vec![aviary_node::ProvidedBind::envd(common::envd_binary())],
    })
    .await
    .unwrap();
    (node, token)
}

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn write_0600(p: &std::path::Path, content: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(p)
        .unwrap();
    f.write_all(content.as_bytes()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_side_files_of_an_old_data_dir_are_imported_once() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let (node, node_token) = agent(dir.path(), "node-old").await;

    // a sandbox with two checkpoints, taken by this version …
    let mut ts = common::start_cfg(pool_config(&data)).await;
    let c = ts.client.clone();
    let sbx = common::new_sandbox(&c).await;
    c.exec(&sbx, &shell("echo clean > /workspace/state"))
        .await
        .unwrap();
    let clean = c.snapshot_labelled(&sbx, "clean", None).await.unwrap();
    c.exec(&sbx, &shell("echo dirty > /workspace/state"))
        .await
        .unwrap();
    let dirty = c.snapshot(&sbx, None).await.unwrap();
    let before = c.snapshots(Some(&sbx)).await.unwrap();
    assert_eq!(before["snapshots"].as_array().unwrap().len(), 2);

    // … turned into the files an older version kept instead: one JSON file
    // per snapshot (the old format, field by field), pools.json, nodes.json
    let registry = ts.cp().registry.clone();
    let index = data.join("snapshot-index");
    std::fs::create_dir(&index).unwrap();
    for s in registry
        .list_snapshots(&SnapshotFilter::default())
        .await
        .unwrap()
    {
        let old = serde_json::json!({
            "id": s.id,
            "tenant": s.tenant,
            "sandbox_id": s.sandbox_id,
            "parent": s.parent,
            "workspace_manifest": s.workspace_manifest,
            "upper_manifest": s.upper_manifest,
            "template": s.template,
            "template_digest": s.template_digest,
            "resource_class": s.resource_class,
            "created_at": aviary_server::ops::rfc3339(s.created_at),
            "total_bytes": s.total_bytes,
            "new_bytes": s.new_bytes,
            "label": s.label,
        });
        std::fs::write(
            index.join(format!("{}.json", s.id)),
            serde_json::to_vec_pretty(&old).unwrap(),
        )
        .unwrap();
        registry.delete_snapshot(&s.id).await.unwrap();
    }
    // a write the old version never finished
    std::fs::write(index.join(".snap-unfinished.tmp"), b"{\"id\":").unwrap();
    write_0600(
        &data.join("pools.json"),
        r#"[{"class": "python-small", "min": 1, "max": 3}]"#,
    );
    write_0600(
        &data.join("nodes.json"),
        &serde_json::json!([{
            "id": "node-old",
            "address": node.addr().to_string(),
            "token": node_token,
        }])
        .to_string(),
    );
    assert!(c.snapshots(None).await.unwrap()["snapshots"]
        .as_array()
        .unwrap()
        .is_empty());
    ts.stop().await;

    // the next start imports them and removes the files
    let ts = common::start_cfg(pool_config(&data)).await;
    let c = ts.client.clone();
    for gone in ["snapshot-index", "pools.json", "nodes.json"] {
        assert!(!data.join(gone).exists(), "{gone} is still there");
    }
    let after = c.snapshots(Some(&sbx)).await.unwrap();
    assert_eq!(after, before, "the same snapshots, field by field");
    let regs = ts.cp().registry.list_node_registrations().await.unwrap();
    assert_eq!(regs.len(), 1, "{regs:?}");
    assert_eq!(
        (regs[0].id.as_str(), regs[0].token.as_str()),
        ("node-old", node_token.as_str())
    );
    // the token now sits in the registry file, which nobody else can read
    for f in ["registry.db", "registry.db-wal"] {
        assert_eq!(mode(&data.join(f)), 0o600, "{f}");
    }

    // … and everything behaves as before the move:
    // the node agent is reconnected,
    let nodes = c.nodes().await.unwrap();
    assert!(
        nodes["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == "node-old"),
        "{nodes}"
    );
    // the pool runs with the bounds of pools.json,
    let pools = c.pools().await.unwrap();
    assert_eq!(
        (
            &pools["pools"][0]["pool_min"],
            &pools["pools"][0]["pool_max"]
        ),
        (&serde_json::json!(1), &serde_json::json!(3)),
        "{pools}"
    );
    // the snapshots restore (by id) and chain (the next one's parent is the
    // latest imported one),
    let restored = c
        .create_sandbox(&CreateSandboxRequest {
            from_snapshot: clean["id"].as_str().map(str::to_owned),
            ..Default::default()
        })
        .await
        .unwrap();
    let r = c
        .exec(restored.sandbox.id.as_str(), &shell("cat /workspace/state"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "clean\n");
    let next = c.snapshot(&sbx, None).await.unwrap();
    assert_eq!(next["parent"], dirty["id"]);
    assert_eq!(next["new_bytes"], 0, "incremental over the imported parent");
    // a level-2 reset finds the imported `clean` checkpoint
    c.exec(&sbx, &shell("echo later > /workspace/state"))
        .await
        .unwrap();
    c.reset(&sbx, 2, None).await.unwrap();
    let r = c.exec(&sbx, &shell("cat /workspace/state")).await.unwrap();
    assert_eq!(r.stdout, "clean\n");
    let mut ts = ts;
    ts.stop().await;

    // a second start has nothing left to import and keeps the state
    let ts = common::start_cfg(pool_config(&data)).await;
    let pools = ts.client.pools().await.unwrap();
    assert_eq!(pools["pools"][0]["pool_max"], 3, "{pools}");
    assert_eq!(
        ts.client.snapshots(Some(&sbx)).await.unwrap()["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    ts.cleanup().await;
    // the pool keeps warm sandboxes on the agent too: they go with the test
    drop(ts);
    let (remote, _) = aviary_node::RemoteRuntime::connect(node.addr().to_string(), node_token)
        .await
        .unwrap();
    for id in aviary_runtime::Runtime::list(&remote).await.unwrap() {
        aviary_runtime::Runtime::destroy(&remote, &id)
            .await
            .unwrap();
    }
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_side_file_is_left_alone_and_start_up_goes_on() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    std::fs::create_dir_all(data.join("snapshot-index")).unwrap();
    std::fs::write(data.join("snapshot-index/snap-bad.json"), b"not json").unwrap();
    write_0600(&data.join("pools.json"), "[{");
    let ts = common::start_cfg(pool_config(&data)).await;
    // older versions ignored such files; this one logs them and goes on
    assert!(data.join("snapshot-index/snap-bad.json").exists());
    assert!(data.join("pools.json").exists());
    let pools = ts.client.pools().await.unwrap();
    assert_eq!(pools["pools"][0]["pool_max"], 4, "configured bounds");
    ts.cleanup().await;
}
