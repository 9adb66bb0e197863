//! Control-plane robustness (issue 7, findings 2, 3, 6, 7, 8): each test
//! reproduces the fault against the real server (real crun, real envd) and
//! checks the server contains it.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_control::requests::{CheckpointRequest, OnSandbox};
use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest};
use aviary_core::{ErrorCode, SandboxId, SandboxState};
use aviary_envd_proto::EnvdClient;
use common::{shell, TestServer};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The context of a call by the bootstrap admin key, made on the control
/// plane directly.
fn admin() -> aviary_control::OpContext {
    aviary_control::OpContext::new(aviary_server::ops::Caller {
        tenant: "default".into(),
        admin: true,
    })
}

fn data_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("avr")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    (dir, data)
}

async fn restart(ts: &mut TestServer, cfg: aviary_server::config::ServerConfig) -> TestServer {
    ts.stop().await;
    common::start_cfg(cfg).await
}

/// The host pid of the sandbox's init, which is its envd.
async fn envd_pid(ts: &TestServer, id: &str) -> u32 {
    let id: SandboxId = id.parse().unwrap();
    ts.cp().runtime().envd_endpoint(&id).await.unwrap().peer_pid
}

async fn events_of(ts: &TestServer, id: &str) -> Vec<aviary_core::api::Event> {
    ts.client
        .events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events
}

async fn wait_state(ts: &TestServer, id: &str, want: SandboxState) -> aviary_core::api::Sandbox {
    let mut last = None;
    for _ in 0..100 {
        let s = ts.client.get_sandbox(id).await.unwrap();
        if s.state == want {
            return s;
        }
        last = Some(s.state);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("sandbox {id} never reached {want}; last {last:?}");
}

fn freezer_state(id: &str) -> PathBuf {
    Path::new("/sys/fs/cgroup/freezer/aviary")
        .join(id)
        .join("freezer.state")
}

/// Finding 2: one envd refusing the fence pushed at start-up used to abort
/// start-up (`/readyz` stuck at "preparing" for every tenant).
#[tokio::test]
async fn restart_goes_on_when_one_envd_refuses_its_fence() {
    let (_dir, data) = data_dir();
    let cfg = common::config(&data, "busybox");
    let mut ts = common::start_cfg(cfg.clone()).await;
    let bad = ts
        .client
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "agent".into(),
                ttl_s: Some(600),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox
        .id
        .to_string();
    let good = common::new_sandbox(&ts.client).await;
    // behind the server's back, the bad sandbox's envd is moved to a fence
    // far above the lease store's: it refuses the one pushed at start-up
    let bad_id: SandboxId = bad.parse().unwrap();
    let ep = ts.cp().runtime().envd_endpoint(&bad_id).await.unwrap();
    ts.stop().await;
    EnvdClient::new(ep.socket)
        .set_fence(Some(1 << 40))
        .await
        .unwrap();

    let mut ts = common::start_cfg(cfg).await; // asserts Ready
    let v = ts.client.readyz().await.unwrap();
    assert_eq!(v["status"], "ready", "{v}");
    let s = ts.client.get_sandbox(&bad).await.unwrap();
    assert_eq!(s.state, SandboxState::Lost);
    assert!(s.tainted);
    let evs = events_of(&ts, &bad).await;
    assert!(
        evs.iter()
            .any(|e| e.event_type == "sandbox_lost" && e.new_state == Some(SandboxState::Lost)),
        "{evs:?}"
    );
    let err = ts.client.exec(&bad, &shell("true")).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::SandboxLost), "{err}");
    // the others work
    let r = ts.client.exec(&good, &shell("echo ok")).await.unwrap();
    assert_eq!(r.stdout, "ok\n");
    // a lost sandbox can still be deleted
    ts.client.delete_sandbox(&bad, None).await.unwrap();
    ts.cleanup().await;
    ts.stop().await;
}

/// A lease that moves while its sandbox is paused: the holder's processes
/// (frozen mid-command) are ended before the thaw the fence move needs, so
/// they never write; the sandbox stays paused and usable, never lost.
#[tokio::test]
async fn a_paused_holder_cannot_write_after_its_lease_is_released() {
    let ts = common::start().await;
    let c = ts.client.clone();
    let created = c
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "first".into(),
                ttl_s: Some(60),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = created.sandbox.id.to_string();
    let token1 = created.lease.unwrap().token;
    // background writers that outlive their exec: one appending without
    // pause (it would write the moment it ran again), one waiting
    let mut req = shell(
        "(while :; do echo x >> /workspace/spin; done) >/dev/null 2>&1 & \
         (sleep 2; echo late > /workspace/stale_bg) >/dev/null 2>&1 &",
    );
    req.token = Some(token1);
    c.exec(&id, &req).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.sandbox_action(&id, "pause", Some(token1)).await.unwrap();
    let ws = ts
        .server_cfg()
        .runtime_state_dir()
        .join(&id)
        .join("workspace");
    let frozen_at = std::fs::metadata(ws.join("spin")).unwrap().len();
    assert!(frozen_at > 0, "the writer ran before the pause");
    c.release_lease(&id, token1).await.unwrap();
    assert_eq!(
        std::fs::metadata(ws.join("spin")).unwrap().len(),
        frozen_at,
        "the released holder's process wrote during the fence move"
    );
    let s = c.get_sandbox(&id).await.unwrap();
    assert_eq!(s.state, SandboxState::Idle);
    assert!(
        !s.tainted,
        "a fence move on a paused sandbox must not lose it"
    );
    c.sandbox_action(&id, "resume", None).await.unwrap();
    // long past the waiting writer's sleep
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        std::fs::metadata(ws.join("spin")).unwrap().len(),
        frozen_at,
        "the released holder's process wrote after the resume"
    );
    assert!(
        !ws.join("stale_bg").exists(),
        "a process of the released holder wrote after the fence moved"
    );
    let out = c.exec(&id, &shell("echo ok")).await.unwrap();
    assert_eq!(out.stdout, "ok\n");
    ts.cleanup().await;
}

/// Finding 3: a command still running under an expired lease, and what it
/// started in the background, must not write once a new lease is granted.
#[tokio::test]
async fn an_expired_holder_cannot_write_after_a_new_lease() {
    let ts = common::start().await;
    let c = ts.client.clone();
    let created = c
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "first".into(),
                ttl_s: Some(1),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = created.sandbox.id.to_string();
    let token1 = created.lease.unwrap().token;
    let mut req = shell(
        "(sleep 3; echo late > /workspace/stale_bg) >/dev/null 2>&1 & sleep 3; echo late > /workspace/stale",
    );
    req.token = Some(token1);
    let holder = {
        let (c, id) = (c.clone(), id.clone());
        tokio::spawn(async move { c.exec(&id, &req).await })
    };
    // the first lease runs out; a second holder takes the sandbox
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let lease2 = c.acquire_lease(&id, "second", Some(60)).await.unwrap();
    assert!(lease2.token.fence() > token1.fence());
    tokio::time::sleep(Duration::from_secs(4)).await;
    let _ = holder.await.unwrap();
    let ws = ts
        .server_cfg()
        .runtime_state_dir()
        .join(&id)
        .join("workspace");
    assert!(
        !ws.join("stale").exists(),
        "the old holder's command wrote after the new lease"
    );
    assert!(
        !ws.join("stale_bg").exists(),
        "a background process of the old holder wrote after the new lease"
    );
    // the new holder works
    let mut w = shell("echo mine > /workspace/fresh && cat /workspace/fresh");
    w.token = Some(lease2.token);
    assert_eq!(c.exec(&id, &w).await.unwrap().stdout, "mine\n");
    ts.cleanup().await;
}

/// Finding 6: creates beyond the configured over-commit were accepted on
/// the local node (72 CPUs committed against 8).
#[tokio::test]
async fn local_node_refuses_creates_past_its_overcommit() {
    let (_dir, data) = data_dir();
    let mut cfg = common::config(&data, "busybox");
    let class_cpu = cfg
        .control
        .settings
        .class(&cfg.control.default_class)
        .unwrap()
        .limits()
        .cpu;
    let cpus = std::thread::available_parallelism().unwrap().get() as f64;
    // room for exactly two sandboxes of the default class
    cfg.control.settings.overcommit.cpu_ratio = 2.0 * class_cpu / cpus;
    cfg.control.settings.overcommit.memory_ratio = 100.0;
    let ts = common::start_cfg(cfg).await;
    let c = &ts.client;
    let a = common::new_sandbox(c).await;
    let _b = common::new_sandbox(c).await;
    let err = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap_err();
    match &err {
        aviary_client::ClientError::Api { status, code, .. } => {
            assert_eq!(*status, 503, "{err}");
            assert_eq!(*code, ErrorCode::CapacityExhausted, "{err}");
        }
        other => panic!("expected capacity_exhausted, got {other}"),
    }
    // the refused create left nothing behind
    assert_eq!(c.list_sandboxes(false).await.unwrap().sandboxes.len(), 2);
    // room again once one is gone
    c.delete_sandbox(&a, None).await.unwrap();
    common::new_sandbox(c).await;
    ts.cleanup().await;
}

/// Finding 7: after `kill -9` of a sandbox's envd the API still said Idle
/// and exec answered 500 "connection refused".
#[tokio::test]
async fn a_killed_envd_makes_its_sandbox_lost_on_the_next_call() {
    let (_dir, data) = data_dir();
    let mut cfg = common::config(&data, "busybox");
    // only the call may find it here
    cfg.control.health_probe_interval_ms = 3_600_000;
    let ts = common::start_cfg(cfg).await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let other = common::new_sandbox(c).await;
    let pid = envd_pid(&ts, &id).await;
    nix_kill(pid);
    let err = c.exec(&id, &shell("true")).await.unwrap_err();
    match &err {
        aviary_client::ClientError::Api { status, code, .. } => {
            assert_eq!((*status, *code), (409, ErrorCode::SandboxLost), "{err}");
        }
        other => panic!("expected sandbox_lost, got {other}"),
    }
    let s = c.get_sandbox(&id).await.unwrap();
    assert_eq!(s.state, SandboxState::Lost);
    assert!(s.tainted);
    assert!(events_of(&ts, &id)
        .await
        .iter()
        .any(|e| e.event_type == "sandbox_lost"));
    // file calls say the same, never a 500
    let err = c.read_file(&id, "/etc/hostname").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::SandboxLost), "{err}");
    // the neighbour is untouched; the lost one can be deleted
    assert_eq!(
        c.exec(&other, &shell("echo ok")).await.unwrap().stdout,
        "ok\n"
    );
    let gone = c.delete_sandbox(&id, None).await.unwrap();
    assert_eq!(gone.state, SandboxState::Terminated);
    ts.cleanup().await;
}

/// Finding 7, without any call: the background probe finds a dead envd.
#[tokio::test]
async fn the_health_probe_finds_a_killed_envd() {
    let (_dir, data) = data_dir();
    let mut cfg = common::config(&data, "busybox");
    cfg.control.health_probe_interval_ms = 200;
    let ts = common::start_cfg(cfg).await;
    let id = common::new_sandbox(&ts.client).await;
    nix_kill(envd_pid(&ts, &id).await);
    let s = wait_state(&ts, &id, SandboxState::Lost).await;
    assert!(s.tainted);
    let evs = events_of(&ts, &id).await;
    let lost = evs
        .iter()
        .find(|e| e.event_type == "sandbox_lost")
        .expect("a sandbox_lost event");
    assert_eq!(lost.old_state, Some(SandboxState::Idle));
    ts.cleanup().await;
}

/// Finding 8: a crash during a snapshot left the cgroup FROZEN while the
/// state said Idle. Start-up thaws it; a pause the user asked for stays.
#[tokio::test]
async fn restart_thaws_a_sandbox_frozen_without_a_pause() {
    let (_dir, data) = data_dir();
    let cfg = common::config(&data, "busybox");
    let mut ts = common::start_cfg(cfg.clone()).await;
    let c = ts.client.clone();
    let frozen = common::new_sandbox(&c).await;
    let paused = common::new_sandbox(&c).await;
    c.sandbox_action(&paused, "pause", None).await.unwrap();
    ts.stop().await;
    // what a crash in the middle of a snapshot leaves behind
    std::fs::write(freezer_state(&frozen), "FROZEN").unwrap();
    for _ in 0..50 {
        if std::fs::read_to_string(freezer_state(&frozen))
            .unwrap()
            .trim()
            == "FROZEN"
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut ts = restart(&mut ts, cfg).await;
    assert_eq!(
        std::fs::read_to_string(freezer_state(&frozen))
            .unwrap()
            .trim(),
        "THAWED"
    );
    let r = ts.client.exec(&frozen, &shell("echo alive")).await.unwrap();
    assert_eq!(r.stdout, "alive\n");
    assert!(events_of(&ts, &frozen)
        .await
        .iter()
        .any(|e| e.event_type == "thawed"));
    // the requested pause survived the restart
    let err = ts.client.exec(&paused, &shell("true")).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::InvalidState), "{err}");
    ts.client
        .sandbox_action(&paused, "resume", None)
        .await
        .unwrap();
    assert_eq!(
        ts.client
            .exec(&paused, &shell("echo back"))
            .await
            .unwrap()
            .stdout,
        "back\n"
    );
    ts.cleanup().await;
    ts.stop().await;
}

/// Finding 8: the chunks of an interrupted snapshot stayed until an admin
/// ran GC. They are collected after a restart on their own; chunks that
/// snapshots reference stay.
#[tokio::test]
async fn orphan_chunks_are_collected_without_an_admin() {
    let (_dir, data) = data_dir();
    let mut cfg = common::config(&data, "busybox");
    cfg.control.chunk_gc_interval_s = 1;
    cfg.control.chunk_gc_grace_s = 1;
    let mut ts = common::start_cfg(cfg.clone()).await;
    let id = common::new_sandbox(&ts.client).await;
    ts.client
        .exec(&id, &shell("echo keep me > /workspace/kept"))
        .await
        .unwrap();
    let snap = ts
        .cp()
        .snapshot(&admin(), CheckpointRequest::new(id.as_str()))
        .await
        .unwrap();
    ts.stop().await;
    // a chunk whose manifest never got written (the crash came first)
    let store = aviary_snapshots::LocalStore::open(data.join("snapshots")).unwrap();
    let orphan_bytes = b"chunk of a snapshot interrupted by a crash".to_vec();
    let orphan = aviary_snapshots::ChunkHash::of(&orphan_bytes);
    aviary_snapshots::ChunkStore::put(&store, &orphan, orphan_bytes)
        .await
        .unwrap();

    let mut ts = restart(&mut ts, cfg).await;
    let mut gone = false;
    for _ in 0..100 {
        if !aviary_snapshots::ChunkStore::has(&store, &orphan)
            .await
            .unwrap()
        {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the orphan chunk was never collected");
    // the snapshot's chunks are intact: a fork of it has the file
    let fork = ts
        .cp()
        .fork(
            &admin(),
            OnSandbox::new(
                id.as_str(),
                aviary_server::snapshots::ForkRequest {
                    snapshot: Some(snap.id.clone()),
                    live: false,
                    token: None,
                },
            ),
        )
        .await
        .unwrap();
    let r = ts
        .client
        .exec(fork.sandbox.id.as_str(), &shell("cat /workspace/kept"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "keep me\n");
    ts.cleanup().await;
    ts.stop().await;
}

fn nix_kill(pid: u32) {
    let st = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -9 {pid}");
}
