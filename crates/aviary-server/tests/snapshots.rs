//! Snapshots, fork isolation, hibernate/wake and the four restore branches,
//! against the real server, runtime and chunk store.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{ErrorCode, SandboxState};
use common::shell;
use std::time::Duration;

fn session(s: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        session_id: Some(s.into()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_incremental_and_forks_are_isolated() {
    let ts = common::start().await;
    let c = &ts.client;
    let p = common::new_sandbox(c).await;
    c.exec(&p, &shell("head -c 3000000 /dev/urandom > /workspace/blob; echo v1 > /workspace/note; mkdir -p /etc/app && echo conf > /etc/app/x")).await.unwrap();
    let s1 = c.snapshot(&p, None).await.unwrap();
    assert!(s1["total_bytes"].as_u64().unwrap() >= 3_000_000, "{s1}");
    assert!(s1["new_bytes"].as_u64().unwrap() >= 3_000_000, "{s1}");
    // nothing changed: nothing new is stored
    let s2 = c.snapshot(&p, None).await.unwrap();
    assert_eq!(s2["new_bytes"].as_u64().unwrap(), 0, "{s2}");
    assert_eq!(s2["parent"], s1["id"]);

    // a fork from the first checkpoint has the workspace and the writable layer
    let f = c.fork(&p, s1["id"].as_str(), None).await.unwrap();
    assert_eq!(f.decision.action, "fork");
    let fid = f.sandbox.id.to_string();
    assert_ne!(fid, p);
    let r = c
        .exec(
            &fid,
            &shell("cat /workspace/note /etc/app/x; md5sum < /workspace/blob"),
        )
        .await
        .unwrap();
    let rp = c
        .exec(&p, &shell("md5sum < /workspace/blob"))
        .await
        .unwrap();
    assert_eq!(r.stdout, format!("v1\nconf\n{}", rp.stdout));
    // changes on either side never show on the other
    c.exec(
        &fid,
        &shell("echo fork > /workspace/note; echo only-fork > /workspace/new"),
    )
    .await
    .unwrap();
    c.exec(&p, &shell("echo parent > /workspace/note"))
        .await
        .unwrap();
    assert_eq!(
        c.read_file(&p, "/workspace/note").await.unwrap(),
        b"parent\n"
    );
    assert_eq!(
        c.read_file(&fid, "/workspace/note").await.unwrap(),
        b"fork\n"
    );
    assert_eq!(
        c.stat(&p, "/workspace/new").await.unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );

    // another tenant cannot use the snapshot, nor see it
    let k = c.create_key("other", false).await.unwrap().key;
    let other = aviary_client::Client::new(&ts.url(), &k);
    assert!(other.snapshots(None).await.unwrap()["snapshots"]
        .as_array()
        .unwrap()
        .is_empty());
    let mine = common::new_sandbox(&other).await;
    assert_eq!(
        other
            .fork(&mine, s1["id"].as_str(), None)
            .await
            .unwrap_err()
            .code(),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        other.fork(&p, None, None).await.unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_chunk_is_detected_and_nothing_is_restored() {
    let ts = common::start().await;
    let c = &ts.client;
    let p = common::new_sandbox(c).await;
    c.exec(&p, &shell("head -c 2000000 /dev/urandom > /workspace/blob"))
        .await
        .unwrap();
    let s = c.snapshot(&p, None).await.unwrap();
    // flip one byte in every stored chunk file of the random blob: content-
    // defined chunks are at least 256 KiB (and vary in size with the data),
    // manifests and the small files' chunks are far smaller
    let mut flipped = 0;
    for entry in walk(&ts.data.join("snapshots")) {
        let meta = std::fs::metadata(&entry).unwrap();
        if meta.len() >= 256 * 1024 {
            let mut b = std::fs::read(&entry).unwrap();
            b[100] ^= 0xff;
            std::fs::write(&entry, b).unwrap();
            flipped += 1;
        }
    }
    assert!(flipped > 0, "no chunk file found to corrupt");
    let before = c.list_sandboxes(false).await.unwrap().sandboxes.len();
    let e = c.fork(&p, s["id"].as_str(), None).await.unwrap_err();
    assert!(e.to_string().contains("corrupt"), "{e}");
    assert_eq!(
        c.list_sandboxes(false).await.unwrap().sandboxes.len(),
        before
    );
    // the parent is untouched
    assert_eq!(
        c.exec(&p, &shell("wc -c < /workspace/blob"))
            .await
            .unwrap()
            .stdout
            .trim(),
        "2000000"
    );
    ts.cleanup().await;
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_four_restore_branches() {
    let ts = common::start().await;
    let c = &ts.client;
    // D: nothing in the scope yet
    let d = c.create_sandbox(&session("b")).await.unwrap();
    assert_eq!(d.decision.branch, "D", "{:?}", d.decision);
    let id = d.sandbox.id.to_string();
    c.exec(&id, &shell("echo kept > /workspace/f"))
        .await
        .unwrap();

    // A: compute alive, work dir intact
    let a = c.create_sandbox(&session("b")).await.unwrap();
    assert_eq!(
        (a.sandbox.id.as_str(), a.decision.branch.as_str()),
        (id.as_str(), "A"),
        "{:?}",
        a.decision
    );

    // B: compute alive, work dir lost: restored from the last snapshot
    c.snapshot(&id, None).await.unwrap();
    c.exec(
        &id,
        &shell("rm -rf /workspace/* /workspace/.[!.]*; ls -A /workspace | wc -l"),
    )
    .await
    .unwrap();
    let b = c.create_sandbox(&session("b")).await.unwrap();
    assert_eq!(
        (b.sandbox.id.as_str(), b.decision.branch.as_str()),
        (id.as_str(), "B"),
        "{:?}",
        b.decision
    );
    assert_eq!(c.read_file(&id, "/workspace/f").await.unwrap(), b"kept\n");

    // C: compute gone (hibernated), snapshot there: new compute + restore
    let h = c.sandbox_action(&id, "hibernate", None).await.unwrap();
    assert_eq!(h.state, SandboxState::Hibernating);
    assert!(
        !ts.cp().runtime().list().await.unwrap().contains(&h.id),
        "compute must be stopped"
    );
    assert_eq!(
        c.exec(&id, &shell("true")).await.unwrap_err().code(),
        Some(ErrorCode::InvalidState)
    );
    let cc = c.create_sandbox(&session("b")).await.unwrap();
    assert_eq!(
        (cc.sandbox.id.as_str(), cc.decision.branch.as_str()),
        (id.as_str(), "C"),
        "{:?}",
        cc.decision
    );
    assert_eq!(cc.sandbox.state, SandboxState::Idle);
    assert_eq!(c.read_file(&id, "/workspace/f").await.unwrap(), b"kept\n");
    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    let branches: Vec<_> = evs
        .iter()
        .filter(|e| e.event_type == "restore_branch")
        .map(|e| e.metadata["branch"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(branches, vec!["A", "B", "C"]);
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sandboxes_hibernate_and_wake_with_their_files() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    cfg.control.idle_hibernate_s = Some(2);
    let ts = common::start_cfg(cfg).await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    c.exec(
        &id,
        &shell("echo zz > /workspace/z; echo etc > /etc/marker"),
    )
    .await
    .unwrap();
    let mut state = SandboxState::Idle;
    for _ in 0..100 {
        state = c.get_sandbox(&id).await.unwrap().state;
        if state == SandboxState::Hibernating {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, SandboxState::Hibernating);
    let w = c.sandbox_action(&id, "wake", None).await.unwrap();
    assert_eq!(w.state, SandboxState::Idle);
    let r = c
        .exec(&id, &shell("cat /workspace/z /etc/marker"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "zz\netc\n");
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_managed_sandboxes_are_stopped_never_destroyed_and_states_restore() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = c
        .create_sandbox(&CreateSandboxRequest {
            user_managed: true,
            ttl_s: Some(1),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox
        .id
        .to_string();
    assert!(c.get_sandbox(&id).await.unwrap().user_managed);
    c.exec(&id, &shell("echo mine > /workspace/m"))
        .await
        .unwrap();
    let mut state = SandboxState::Idle;
    for _ in 0..100 {
        state = c.get_sandbox(&id).await.unwrap().state;
        if state != SandboxState::Idle {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        state,
        SandboxState::Hibernating,
        "TTL expiry stops a user-managed sandbox, it does not destroy it"
    );

    // a saved state to restore from: a new sandbox starts from its snapshot
    let snap = c.snapshots(Some(&id)).await.unwrap()["snapshots"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    c.delete_sandbox(&id, None).await.unwrap();
    let restored = c
        .create_sandbox(&CreateSandboxRequest {
            from_snapshot: Some(snap.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        c.read_file(restored.sandbox.id.as_str(), "/workspace/m")
            .await
            .unwrap(),
        b"mine\n"
    );
    // into an incompatible template: refused, nothing created
    let n = c.list_sandboxes(false).await.unwrap().sandboxes.len();
    let e = c
        .create_sandbox(&CreateSandboxRequest {
            from_snapshot: Some(snap),
            template: Some("default".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{e}");
    assert_eq!(c.list_sandboxes(false).await.unwrap().sandboxes.len(), n);
    let e = c
        .create_sandbox(&CreateSandboxRequest {
            from_snapshot: Some("snap-nope".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    ts.cleanup().await;
}

/// The same snapshot → fork round trip on every configured snapshot store
/// (the real servers that scripts/test.sh starts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_round_trip_on_every_store() {
    let stores: Vec<(&str, Option<aviary_config::SnapshotStore>)> = vec![
        ("local", Some(aviary_config::SnapshotStore::Local)),
        (
            "redis",
            std::env::var("AVIARY_TEST_REDIS_URL").ok().map(|url| {
                aviary_config::SnapshotStore::Redis {
                    url,
                    prefix: format!("srv-{}", std::process::id()),
                }
            }),
        ),
        (
            "postgres",
            std::env::var("AVIARY_TEST_POSTGRES_URL").ok().map(|_| {
                aviary_config::SnapshotStore::Postgres {
                    url_env: "AVIARY_TEST_POSTGRES_URL".into(),
                    namespace: format!("srv{}", std::process::id()),
                }
            }),
        ),
        (
            "s3",
            std::env::var("AVIARY_TEST_S3_ENDPOINT")
                .ok()
                .map(|endpoint| aviary_config::SnapshotStore::S3 {
                    endpoint,
                    region: "us-east-1".into(),
                    bucket: std::env::var("AVIARY_TEST_S3_BUCKET").unwrap_or_default(),
                    prefix: format!("srv-{}/", std::process::id()),
                    access_key_env: "AVIARY_TEST_S3_ACCESS_KEY".into(),
                    secret_key_env: "AVIARY_TEST_S3_SECRET_KEY".into(),
                }),
        ),
    ];
    for (name, store) in stores {
        let Some(store) = store else {
            eprintln!("SKIPPED: snapshot store {name}: its AVIARY_TEST_* variables are not set (run scripts/services.sh start)");
            continue;
        };
        let dir = tempfile::Builder::new()
            .prefix("avt")
            .tempdir_in("/tmp")
            .unwrap();
        let mut cfg = common::config(&dir.path().join("d"), "busybox");
        cfg.control.settings.snapshots.store = store;
        let ts = common::start_cfg(cfg).await;
        let c = &ts.client;
        let p = common::new_sandbox(c).await;
        c.exec(
            &p,
            &shell(&format!(
                "head -c 1500000 /dev/urandom > /workspace/b; echo {name} > /workspace/n"
            )),
        )
        .await
        .unwrap();
        let s = c.snapshot(&p, None).await.unwrap();
        assert!(s["new_bytes"].as_u64().unwrap() >= 1_500_000, "{name}: {s}");
        let f = c
            .fork(&p, s["id"].as_str(), None)
            .await
            .unwrap()
            .sandbox
            .id
            .to_string();
        let a = c
            .exec(&p, &shell("md5sum < /workspace/b; cat /workspace/n"))
            .await
            .unwrap();
        let b = c
            .exec(&f, &shell("md5sum < /workspace/b; cat /workspace/n"))
            .await
            .unwrap();
        assert_eq!(a.stdout, b.stdout, "{name}");
        assert!(b.stdout.ends_with(&format!("{name}\n")));
        eprintln!("snapshot store {name}: round trip ok");
        ts.cleanup().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_and_gc_free_unreferenced_chunks_only() {
    let ts = common::start().await;
    let c = &ts.client;
    let p = common::new_sandbox(c).await;
    for i in 0..3 {
        c.exec(
            &p,
            &shell(&format!(
                "head -c 1200000 /dev/urandom > /workspace/v{i}; rm -f /workspace/v{}",
                i.max(1) - 1
            )),
        )
        .await
        .unwrap();
        c.snapshot(&p, None).await.unwrap();
    }
    let chunks = |dir: &std::path::Path| walk(dir).len();
    let before = chunks(&ts.data.join("snapshots"));
    let raw = c
        .raw(
            reqwest::Method::POST,
            "/v1/snapshots/gc",
            Some(br#"{"keep_last": 1}"#.to_vec()),
            Some(&ts.key),
        )
        .await
        .unwrap();
    assert_eq!(raw.0.as_u16(), 200, "{}", raw.1);
    assert_eq!(
        raw.1["snapshots_deleted"].as_array().unwrap().len(),
        2,
        "{}",
        raw.1
    );
    assert!(raw.1["chunks_deleted"].as_u64().unwrap() > 0, "{}", raw.1);
    assert!(chunks(&ts.data.join("snapshots")) < before);
    // the kept snapshot still restores completely
    let left = c.snapshots(Some(&p)).await.unwrap()["snapshots"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(left.len(), 1);
    let f = c
        .fork(&p, left[0]["id"].as_str(), None)
        .await
        .unwrap()
        .sandbox
        .id
        .to_string();
    let a = c
        .exec(&p, &shell("cd /workspace && md5sum v2"))
        .await
        .unwrap();
    let b = c
        .exec(&f, &shell("cd /workspace && md5sum v2"))
        .await
        .unwrap();
    assert_eq!(a.stdout, b.stdout);
    // only admins
    let user_key = c.create_key("u", false).await.unwrap().key;
    let (status, body) = c
        .raw(
            reqwest::Method::POST,
            "/v1/snapshots/gc",
            Some(br#"{"keep_last": 1}"#.to_vec()),
            Some(&user_key),
        )
        .await
        .unwrap();
    assert_eq!(status.as_u16(), 403, "{body}");
    ts.cleanup().await;
}
