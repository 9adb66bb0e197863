//! The real `EnvdClient` against [`FakeEnvd`], and the runtime conformance
//! suite against [`FakeRuntime`].

use super::*;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
use aviary_envd_proto::{EnvdClient, EnvdError, ErrorCode, ExecSpec, FileKind, PROTOCOL_VERSION};
use aviary_runtime::conformance;
use aviary_runtime::{Pausable, Runtime, RuntimeError, RuntimeStatus, SandboxSpec, TemplateRef};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// A fake envd in a fresh directory (kept alive by the returned guard).
fn envd() -> (tempfile::TempDir, FakeEnvd, EnvdClient) {
    let dir = tempfile::Builder::new()
        .prefix("aviary-fake-envd-")
        .tempdir_in("/tmp")
        .unwrap();
    let fake = FakeEnvd::start(dir.path().join("envd.sock")).unwrap();
    let client = EnvdClient::new(fake.socket()).expect_peer_pid(fake.peer_pid());
    (dir, fake, client)
}

fn argv(args: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: args.iter().map(|s| s.to_string()).collect(),
        ..ExecSpec::default()
    }
}

async fn read_all(c: &EnvdClient, path: &str) -> Result<Vec<u8>, EnvdError> {
    let mut r = c.read_file(path, None).await?;
    let mut out = Vec::new();
    r.read_to_end(&mut out)
        .await
        .map_err(EnvdError::Transport)?;
    Ok(out)
}

#[tokio::test]
async fn health_reports_the_protocol_and_the_fence() {
    let (_dir, fake, c) = envd();
    assert_eq!(fake.peer_pid(), std::process::id());
    let h = c.health().await.unwrap();
    assert_eq!(h.protocol, PROTOCOL_VERSION);
    assert_eq!((h.fence, h.highest_fence), (None, None));
    c.wait_ready(Duration::from_secs(5)).await.unwrap();
    c.set_fence(Some(4)).await.unwrap();
    let h = c.health().await.unwrap();
    assert_eq!((h.fence, h.highest_fence), (Some(4), Some(4)));
}

#[tokio::test]
async fn exec_is_scripted_and_recorded() {
    let (_dir, fake, c) = envd();
    let out = c
        .exec_collect(argv(&["echo", "hello", "world"]), None)
        .await
        .unwrap();
    assert_eq!(out.stdout, b"hello world\n");
    assert_eq!(out.exit.exit_code, 0);
    let out = c
        .exec_collect(argv(&["/bin/sh", "-c", "exit 3"]), None)
        .await
        .unwrap();
    assert_eq!(out.exit.exit_code, 3);

    fake.on_exec(|call| {
        (call.argv[0] == "make").then(|| ExecReply {
            stdout: b"built\n".to_vec(),
            stderr: b"warning\n".to_vec(),
            exit_code: 2,
            ..ExecReply::default()
        })
    });
    fake.on_argv(&["oom"], ExecReply::killed(9));
    let spec = ExecSpec {
        cwd: Some("/workspace".into()),
        env: vec![("A".into(), "b".into())],
        ..argv(&["make", "all"])
    };
    let out = c.exec_collect(spec, None).await.unwrap();
    assert_eq!(
        (
            out.stdout.as_slice(),
            out.stderr.as_slice(),
            out.exit.exit_code
        ),
        (&b"built\n"[..], &b"warning\n"[..], 2)
    );
    let out = c.exec_collect(argv(&["oom"]), None).await.unwrap();
    assert_eq!((out.exit.exit_code, out.exit.signal), (137, Some(9)));
    let out = c.exec_collect(argv(&["unscripted"]), None).await.unwrap();
    assert_eq!(out.exit.exit_code, 127);

    let spec = ExecSpec {
        stdin: Some(b"piped".to_vec()),
        ..argv(&["cat"])
    };
    assert_eq!(c.exec_collect(spec, None).await.unwrap().stdout, b"piped");

    let execs = fake.execs();
    assert_eq!(execs.len(), 6);
    assert_eq!(execs[2].argv, ["make", "all"]);
    assert_eq!(execs[2].cwd.as_deref(), Some("/workspace"));
    assert_eq!(execs[2].env, [("A".to_string(), "b".to_string())]);
    assert_eq!(execs[5].stdin.as_deref(), Some(&b"piped"[..]));

    // Refused before anything "runs", and not recorded as an exec.
    let spec = ExecSpec {
        cwd: Some("/nope".into()),
        ..argv(&["true"])
    };
    let e = c.exec_collect(spec, None).await.unwrap_err();
    assert!(matches!(e, EnvdError::InvalidPath(_)), "{e:?}");
    let e = c.exec_collect(argv(&[]), None).await.unwrap_err();
    assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
    assert_eq!(fake.execs().len(), 6);
}

#[tokio::test]
async fn the_fence_refuses_missing_and_stale_tokens() {
    let (_dir, fake, c) = envd();
    // Unleased: a token is stale, none is fine.
    let e = c.exec_collect(argv(&["true"]), Some(1)).await.unwrap_err();
    assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
    c.exec_collect(argv(&["true"]), None).await.unwrap();

    c.set_fence(Some(5)).await.unwrap();
    let e = c.exec_collect(argv(&["true"]), None).await.unwrap_err();
    assert!(matches!(e, EnvdError::LeaseRequired), "{e:?}");
    let e = c.exec_collect(argv(&["true"]), Some(4)).await.unwrap_err();
    assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
    c.exec_collect(argv(&["true"]), Some(5)).await.unwrap();
    let e = c
        .write_file("/workspace/f", None, &b"x"[..], Some(4))
        .await
        .unwrap_err();
    assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
    let e = c.mkdir("/workspace/d", false, None).await.unwrap_err();
    assert!(matches!(e, EnvdError::LeaseRequired), "{e:?}");
    let e = c.remove("/tmp", true, Some(6)).await.unwrap_err();
    assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
    assert_eq!(fake.file("/workspace/f"), None);
    // Reads are not fenced.
    c.list_dir("/").await.unwrap();

    // Never below the highest fence; a renewal does not sweep, a move does.
    let e = c.set_fence(Some(3)).await.unwrap_err();
    assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
    assert_eq!(fake.sweeps(), 1);
    c.set_fence(Some(5)).await.unwrap();
    assert_eq!(fake.sweeps(), 1);
    c.set_fence(None).await.unwrap();
    assert_eq!((fake.fence(), fake.highest_fence()), (None, Some(5)));
    c.kill_all().await.unwrap();
    assert_eq!(fake.sweeps(), 3);

    let calls = fake.calls();
    let fence_push = calls
        .iter()
        .position(|c| c.method == "set_fence" && c.token == Some(5))
        .unwrap();
    let refused = calls
        .iter()
        .position(|c| c.method == "exec" && c.result == Err(ErrorCode::LeaseRequired))
        .unwrap();
    assert!(fence_push < refused);
    assert_eq!(calls[refused].fence, Some(5));
    assert_eq!(fake.execs().len(), 2);
}

#[tokio::test]
async fn files_round_trip_with_envd_error_codes() {
    let (_dir, fake, c) = envd();
    let big = vec![7u8; 200_000];
    let n = c
        .write_file("/workspace/a.bin", Some(0o600), &big[..], None)
        .await
        .unwrap();
    assert_eq!(n, big.len() as u64);
    assert_eq!(read_all(&c, "/workspace/a.bin").await.unwrap(), big);
    assert_eq!(fake.file("/workspace/a.bin").unwrap(), big);

    c.mkdir("/workspace/src/deep", true, None).await.unwrap();
    fake.put_file("/workspace/src/main.rs", "fn main() {}")
        .unwrap();
    let names: Vec<String> = c
        .list_dir("/workspace")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a.bin", "src"]);
    let st = c.stat("/workspace/a.bin").await.unwrap();
    assert_eq!(
        (st.kind, st.size, st.mode),
        (FileKind::File, 200_000, 0o600)
    );
    assert_eq!(c.stat("/workspace/src").await.unwrap().kind, FileKind::Dir);

    let e = c.mkdir("/workspace/src", false, None).await.unwrap_err();
    assert!(matches!(e, EnvdError::AlreadyExists(_)), "{e:?}");
    let e = c.remove("/workspace/src", false, None).await.unwrap_err();
    assert!(matches!(e, EnvdError::NotEmpty(_)), "{e:?}");
    let e = read_all(&c, "/workspace/missing").await.unwrap_err();
    assert!(matches!(e, EnvdError::NotFound(_)), "{e:?}");
    let e = c.stat("/../etc").await.unwrap_err();
    assert!(matches!(e, EnvdError::InvalidPath(_)), "{e:?}");
    let e = c
        .write_file("/nodir/x", None, &b""[..], None)
        .await
        .unwrap_err();
    assert!(matches!(e, EnvdError::NotFound(_)), "{e:?}");

    c.remove("/workspace/src", true, None).await.unwrap();
    c.remove("/workspace/a.bin", false, None).await.unwrap();
    assert!(c.list_dir("/workspace").await.unwrap().is_empty());
    let e = c.remove("/workspace/a.bin", false, None).await.unwrap_err();
    assert!(matches!(e, EnvdError::NotFound(_)), "{e:?}");
}

#[tokio::test]
async fn a_dead_envd_refuses_connections() {
    let (_dir, fake, c) = envd();
    c.health().await.unwrap();
    // A connection the fake holds open (frozen) is closed by the death too.
    fake.freeze();
    let pending = tokio::spawn({
        let c = c.clone();
        async move { c.health().await }
    });
    tokio::task::yield_now().await;
    fake.die().await;
    fake.die().await;
    assert!(fake.is_dead());
    let e = pending.await.unwrap().unwrap_err();
    assert!(
        matches!(
            e,
            EnvdError::Protocol(_) | EnvdError::Transport(_) | EnvdError::Connect(_)
        ),
        "{e:?}"
    );
    let e = c.health().await.unwrap_err();
    assert!(matches!(e, EnvdError::Connect(_)), "{e:?}");
    let e = c.exec_collect(argv(&["true"]), None).await.unwrap_err();
    assert!(matches!(e, EnvdError::Connect(_)), "{e:?}");
}

#[tokio::test]
async fn a_busy_envd_keeps_its_control_lane() {
    let (_dir, fake, c) = envd();
    fake.set_busy(BusyMode::GeneralLane);
    let e = c.exec_collect(argv(&["true"]), None).await.unwrap_err();
    assert!(matches!(e, EnvdError::Busy), "{e:?}");
    c.health().await.unwrap();
    c.set_fence(Some(1)).await.unwrap();
    fake.set_busy(BusyMode::AllLanes);
    let e = c.health().await.unwrap_err();
    assert!(matches!(e, EnvdError::Busy), "{e:?}");
    fake.set_busy(BusyMode::Off);
    c.exec_collect(argv(&["true"]), Some(1)).await.unwrap();
    assert!(fake.execs().len() == 1 && fake.calls().len() == 5);
}

#[tokio::test]
async fn a_wrong_peer_pid_is_refused() {
    let (_dir, fake, _) = envd();
    let c = EnvdClient::new(fake.socket()).expect_peer_pid(fake.peer_pid() + 1);
    let e = c.health().await.unwrap_err();
    assert!(matches!(e, EnvdError::PeerMismatch { .. }), "{e:?}");
    assert!(fake.calls().is_empty());
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        id: SandboxId::generate(),
        template: TemplateRef {
            name: "base".into(),
            digest: format!("sha256:{}", "ab".repeat(32)),
        },
        resources: ResourceLimits::default(),
        network: NetworkProfile::None,
        egress: None,
        hostname: "sbx".into(),
        init: vec!["/.aviary/envd".into()],
        env: vec![],
        binds: vec![],
    }
}

#[tokio::test]
async fn runtime_conformance() {
    let rt = FakeRuntime::new().unwrap();
    conformance::check_unknown_ids(&rt).await;
    conformance::check_lifecycle(&rt, &spec).await;
    conformance::check_pause_resume(&rt, &spec).await;
    let root = rt.root().to_path_buf();
    let footprint = move || {
        let entries = std::fs::read_dir(&root).unwrap().count() as u64;
        [("sandbox dirs".to_string(), entries)]
            .into_iter()
            .collect()
    };
    conformance::check_teardown(&rt, &spec, 3, &footprint).await;
    assert!(rt.live_ids().is_empty());
    // Not run:
    // - check_refusals: the fake has no template store and never runs the
    //   init argv, so "a template the runtime does not have" and "a missing
    //   init" cannot fail; its network refusal is checked below.
    // - check_limits_visible: needs an Inspector that runs commands inside
    //   (hostname, cgroup limits, /workspace shared with the host); nothing
    //   runs in a fake sandbox.
    // - check_layers: needs an Inspector that runs commands inside (owners,
    //   `cat`); the fake's layers are checked below
    //   (`snapshottable_layers_are_the_envd_files`).
}

#[tokio::test]
async fn snapshottable_layers_are_the_envd_files() {
    use aviary_runtime::Snapshottable;
    let rt = FakeRuntime::new().unwrap();
    let s = spec();
    rt.create(&s).await.unwrap();
    let envd = rt.envd(&s.id).unwrap();
    envd.put_file("/workspace/src/a.txt", "ws").unwrap();
    envd.put_file("/tmp/up.txt", "up").unwrap();
    let export = rt.export_layers(&s.id).await.unwrap();
    assert_eq!(
        std::fs::read(export.workspace.join("src/a.txt")).unwrap(),
        b"ws"
    );
    assert_eq!(
        std::fs::read(export.writable.join("tmp/up.txt")).unwrap(),
        b"up"
    );
    let e = rt.stage_layers(&s.id).await.unwrap_err();
    assert!(matches!(e, RuntimeError::AlreadyExists { .. }), "{e:?}");
    // a merge adds what the workspace lacks and keeps what it has
    let staged = rt.stage_workspace(&s.id).await.unwrap();
    std::fs::create_dir_all(staged.join("src")).unwrap();
    std::fs::write(staged.join("src/a.txt"), "replaced").unwrap();
    std::fs::write(staged.join("merged.txt"), "merged").unwrap();
    rt.merge_workspace(&s.id).await.unwrap();
    assert!(!staged.exists());
    assert_eq!(envd.file("/workspace/src/a.txt").unwrap(), b"ws");
    assert_eq!(envd.file("/workspace/merged.txt").unwrap(), b"merged");

    // an export staged for a new id seeds its create, and is consumed
    let t = spec();
    let stage = rt.stage_layers(&t.id).await.unwrap();
    std::fs::create_dir_all(stage.workspace.join("src")).unwrap();
    std::fs::copy(
        export.workspace.join("src/a.txt"),
        stage.workspace.join("src/a.txt"),
    )
    .unwrap();
    std::fs::create_dir_all(stage.writable.join("etc")).unwrap();
    std::fs::write(stage.writable.join("etc/seeded"), "seeded").unwrap();
    rt.create(&t).await.unwrap();
    assert!(!stage.workspace.exists() && !stage.writable.exists());
    let seeded = rt.envd(&t.id).unwrap();
    assert_eq!(seeded.file("/workspace/src/a.txt").unwrap(), b"ws");
    assert_eq!(seeded.file("/etc/seeded").unwrap(), b"seeded");
    assert_eq!(rt.seeded_creates(), vec![t.id.clone()]);
    // a stage no create adopted goes with destroy
    let u = spec();
    let stage = rt.stage_layers(&u.id).await.unwrap();
    rt.destroy(&u.id).await.unwrap();
    assert!(!stage.workspace.exists());
    for id in [&s.id, &t.id] {
        rt.destroy(id).await.unwrap();
    }
    assert_eq!(std::fs::read_dir(rt.root()).unwrap().count(), 0);
}

#[tokio::test]
async fn an_unreachable_host_fails_every_call_and_keeps_its_sandboxes() {
    let rt = FakeRuntime::new().unwrap();
    let s = spec();
    rt.create(&s).await.unwrap();
    rt.set_unreachable(true);
    assert!(rt.is_unreachable());
    let errors = [
        rt.list().await.unwrap_err(),
        rt.status(&s.id).await.unwrap_err(),
        rt.destroy(&s.id).await.unwrap_err(),
        rt.pause(&s.id).await.unwrap_err(),
        rt.create(&spec()).await.unwrap_err(),
    ];
    for e in errors {
        assert_eq!(e.code(), aviary_core::ErrorCode::Unavailable, "{e:?}");
    }
    assert_eq!(
        rt.live_ids(),
        vec![s.id.clone()],
        "nothing changed behind it"
    );
    rt.set_unreachable(false);
    assert_eq!(rt.list().await.unwrap(), vec![s.id.clone()]);
    assert_eq!(rt.status(&s.id).await.unwrap(), RuntimeStatus::Running);
    rt.destroy(&s.id).await.unwrap();
}

#[tokio::test]
async fn refused_specs_leave_nothing() {
    let rt = FakeRuntime::new().unwrap();
    let mut s = spec();
    s.network = NetworkProfile::Open;
    let e = rt.create(&s).await.unwrap_err();
    assert!(matches!(e, RuntimeError::Unsupported { .. }), "{e:?}");
    let mut s2 = spec();
    s2.hostname = "not a host".into();
    let e = rt.create(&s2).await.unwrap_err();
    assert!(matches!(e, RuntimeError::InvalidSpec { .. }), "{e:?}");
    assert_eq!(rt.status(&s.id).await.unwrap(), RuntimeStatus::NotFound);
    assert!(rt.list().await.unwrap().is_empty());
    assert!(rt.created_specs().is_empty());
    assert_eq!(rt.create_calls(), 2);
    assert_eq!(std::fs::read_dir(rt.root()).unwrap().count(), 0);
}

#[tokio::test]
async fn a_sandbox_envd_is_reached_through_the_runtime() {
    let rt = FakeRuntime::new().unwrap().with_name("runc");
    let s = spec();
    let handle = rt.create(&s).await.unwrap();
    assert_eq!(handle.runtime, "runc");
    assert_eq!(handle.init_pid, std::process::id());
    let ep = rt.envd_endpoint(&s.id).await.unwrap();
    assert_eq!(ep, handle.envd_endpoint());
    let c = EnvdClient::new(&ep.socket).expect_peer_pid(ep.peer_pid);
    c.set_fence(Some(9)).await.unwrap();
    assert_eq!(rt.envd(&s.id).unwrap().fence(), Some(9));
    assert_eq!(rt.created_specs(), std::slice::from_ref(&s));

    // Paused: the envd does not answer until resumed.
    rt.pause(&s.id).await.unwrap();
    let pending = tokio::spawn({
        let c = c.clone();
        async move { c.health().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!pending.is_finished(), "a paused sandbox's envd answered");
    rt.resume(&s.id).await.unwrap();
    assert_eq!(pending.await.unwrap().unwrap().fence, Some(9));

    rt.destroy(&s.id).await.unwrap();
    let e = c.health().await.unwrap_err();
    assert!(matches!(e, EnvdError::Connect(_)), "{e:?}");
    let e = rt.envd_endpoint(&s.id).await.unwrap_err();
    assert!(matches!(e, RuntimeError::NotFound { .. }), "{e:?}");
    assert_eq!((rt.create_calls(), rt.destroy_calls()), (1, 1));
}

#[tokio::test]
async fn injected_create_failures_are_used_up_in_order() {
    let rt = FakeRuntime::new().unwrap();
    rt.fail_next_create(RuntimeError::CapacityExhausted {
        what: "user-id ranges".into(),
    });
    rt.fail_next_creates(2, || RuntimeError::InvokeRuntime {
        action: "crun run".into(),
        detail: "boom".into(),
    });
    let s = spec();
    let e = rt.create(&s).await.unwrap_err();
    assert!(matches!(e, RuntimeError::CapacityExhausted { .. }), "{e:?}");
    for _ in 0..2 {
        let e = rt.create(&s).await.unwrap_err();
        assert!(matches!(e, RuntimeError::InvokeRuntime { .. }), "{e:?}");
    }
    assert!(rt.live_ids().is_empty());
    rt.create(&s).await.unwrap();
    assert_eq!(rt.live_ids(), std::slice::from_ref(&s.id));
    assert_eq!(rt.create_calls(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_create_waits_for_its_release() {
    let rt = Arc::new(FakeRuntime::new().unwrap());
    let hold = rt.hold_next_create();
    let s = spec();
    let task = tokio::spawn({
        let rt = Arc::clone(&rt);
        let s = s.clone();
        async move { rt.create(&s).await }
    });
    hold.entered().await;
    assert_eq!(rt.create_calls(), 1);
    assert_eq!(rt.status(&s.id).await.unwrap(), RuntimeStatus::NotFound);
    // Other creates go on meanwhile.
    rt.create(&spec()).await.unwrap();
    hold.release();
    task.await.unwrap().unwrap();
    assert_eq!(rt.status(&s.id).await.unwrap(), RuntimeStatus::Running);
    assert_eq!(rt.live_ids().len(), 2);
}

#[tokio::test]
async fn lost_crashed_and_oom_killed_sandboxes() {
    let rt = Arc::new(FakeRuntime::new().unwrap());
    let capable = rt.capable();
    assert!(capable.pausable.is_some() && capable.snapshottable.is_none());

    let lost = spec();
    let handle = rt.create(&lost).await.unwrap();
    let envd = rt.envd(&lost.id).unwrap();
    assert!(rt.vanish(&lost.id).await);
    assert!(envd.is_dead());
    assert_eq!(rt.status(&lost.id).await.unwrap(), RuntimeStatus::NotFound);
    assert!(!rt.list().await.unwrap().contains(&lost.id));
    assert!(!handle.control_dir.exists());
    rt.destroy(&lost.id).await.unwrap();

    let crashed = spec();
    rt.create(&crashed).await.unwrap();
    assert!(rt.crash(&crashed.id).await);
    assert_eq!(
        rt.status(&crashed.id).await.unwrap(),
        RuntimeStatus::Stopped
    );
    assert!(rt.list().await.unwrap().contains(&crashed.id));
    let e = rt.pause(&crashed.id).await.unwrap_err();
    assert!(matches!(e, RuntimeError::InvokeRuntime { .. }), "{e:?}");
    rt.destroy(&crashed.id).await.unwrap();
    assert!(rt.live_ids().is_empty());

    let oom = spec();
    rt.create(&oom).await.unwrap();
    assert_eq!(rt.usage(&oom.id).await.unwrap(), INITIAL_USAGE);
    assert!(rt.update_usage(&oom.id, |u| u.oom_kills += 1));
    assert_eq!(rt.usage(&oom.id).await.unwrap().oom_kills, 1);
    assert!(!rt.set_usage(&SandboxId::generate(), INITIAL_USAGE));
}
