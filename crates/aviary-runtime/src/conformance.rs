//! A conformance suite every [`Runtime`] backend runs against itself.
//!
//! Each `check_*` function drives a real runtime through one contract of the
//! trait and panics with a clear message when the backend breaks it, so a
//! backend's integration test is a list of calls. Specs come from the caller
//! (`make_spec` returns a fresh spec with a new id each time), because only
//! the caller knows a template and an init that fit its backend. The suite
//! expects the template to have a POSIX `sh`, `cat`, `mkdir` and `ls` for the
//! checks that look inside through an [`Inspector`]. [`check_layers`] writes
//! files with other owners into stages, so it needs to run as root (as the
//! local runtimes do anyway).

use crate::{
    Pausable, Runtime, RuntimeError, RuntimeStatus, SandboxHandle, SandboxSpec, Snapshottable,
    SpawnOutput,
};
use async_trait::async_trait;
use aviary_core::{NetworkProfile, SandboxId};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Runs a command inside a sandbox, for checks that must look inside (the
/// OCI backend uses `crun exec`; an envd client fits as well).
#[async_trait]
pub trait Inspector: Send + Sync {
    async fn run_inside(
        &self,
        handle: &SandboxHandle,
        argv: &[&str],
    ) -> Result<SpawnOutput, RuntimeError>;
}

/// Named host-side counters (mounts, cgroup dirs, processes, state dirs ...)
/// that must be the same before and after create/destroy cycles.
pub type Footprint = BTreeMap<String, u64>;

/// Produces a fresh spec (new id) for each sandbox the suite creates.
pub type MakeSpec<'a> = &'a (dyn Fn() -> SandboxSpec + Sync);

/// create → status Running → listed → usage readable → destroy → NotFound,
/// not listed, usage NotFound, and a second destroy succeeds.
pub async fn check_lifecycle(rt: &dyn Runtime, make_spec: MakeSpec<'_>) {
    lifecycle(rt, make_spec, true).await
}

/// [`check_lifecycle`] for a runtime whose sandboxes do not run on this
/// host (a remote provider's): the same contract, but the sandbox has no
/// host workspace dir; the control dir (where its envd endpoint is served)
/// must still exist and go with the sandbox.
pub async fn check_lifecycle_off_host(rt: &dyn Runtime, make_spec: MakeSpec<'_>) {
    lifecycle(rt, make_spec, false).await
}

async fn lifecycle(rt: &dyn Runtime, make_spec: MakeSpec<'_>, on_host: bool) {
    let spec = make_spec();
    let id = spec.id.clone();
    let handle = rt.create(&spec).await.expect("create");
    assert_eq!(handle.id, id, "handle carries the spec's id");
    assert_eq!(handle.runtime, rt.name(), "handle names the runtime");
    assert!(handle.init_pid > 0, "init pid is set");
    assert!(
        handle.control_dir.is_dir(),
        "control dir exists on the host"
    );
    assert!(
        !on_host || handle.workspace_dir.is_dir(),
        "workspace dir exists on the host"
    );
    assert_eq!(
        rt.status(&id).await.expect("status"),
        RuntimeStatus::Running
    );
    assert!(
        rt.list().await.expect("list").contains(&id),
        "list contains a created sandbox"
    );
    let usage = rt.usage(&id).await.expect("usage");
    assert!(usage.pids_current >= 1, "PID 1 is counted: {usage:?}");
    assert!(
        usage.memory_current_bytes > 0,
        "memory is charged: {usage:?}"
    );
    assert_eq!(usage.oom_kills, 0, "no OOM kill yet: {usage:?}");

    let again = rt
        .create(&spec)
        .await
        .expect_err("second create with the same id");
    assert!(
        matches!(again, RuntimeError::AlreadyExists { .. }),
        "second create must be AlreadyExists, got {again:?}"
    );
    assert_eq!(
        rt.status(&id).await.expect("status"),
        RuntimeStatus::Running,
        "a refused duplicate create must not harm the original"
    );

    rt.destroy(&id).await.expect("destroy");
    assert_eq!(
        rt.status(&id).await.expect("status"),
        RuntimeStatus::NotFound
    );
    assert!(
        !rt.list().await.expect("list").contains(&id),
        "destroyed sandbox listed"
    );
    let err = rt.usage(&id).await.expect_err("usage after destroy");
    assert!(
        matches!(err, RuntimeError::NotFound { .. }),
        "usage: {err:?}"
    );
    rt.destroy(&id).await.expect("destroy is idempotent");
    assert!(!handle.control_dir.exists(), "control dir removed");
    assert!(
        !on_host || !handle.workspace_dir.exists(),
        "workspace dir removed"
    );
}

/// Unknown ids: status NotFound, usage NotFound, destroy Ok.
pub async fn check_unknown_ids(rt: &dyn Runtime) {
    let id = SandboxId::generate();
    assert_eq!(
        rt.status(&id).await.expect("status"),
        RuntimeStatus::NotFound
    );
    let err = rt.usage(&id).await.expect_err("usage of unknown id");
    assert!(
        matches!(err, RuntimeError::NotFound { .. }),
        "usage: {err:?}"
    );
    rt.destroy(&id).await.expect("destroy of unknown id");
}

/// Network profiles the runtime does not enforce
/// ([`Runtime::enforces_network`]) are refused with `Unsupported`, and leave
/// nothing behind; a template the runtime does not have and a missing init
/// binary fail cleanly.
pub async fn check_refusals(rt: &dyn Runtime, make_spec: MakeSpec<'_>) {
    assert!(rt.enforces_network(NetworkProfile::None));
    for profile in [NetworkProfile::Allowlist, NetworkProfile::Open] {
        if rt.enforces_network(profile) {
            continue;
        }
        let mut spec = make_spec();
        spec.network = profile;
        if profile == NetworkProfile::Allowlist {
            spec.egress = Some(aviary_core::egress::EgressPolicy {
                profile: "conformance".into(),
                allow: vec![],
                deny: vec![],
                resolve: Default::default(),
                limits: Default::default(),
            });
        }
        let err = rt
            .create(&spec)
            .await
            .expect_err("create with a network profile the runtime does not enforce");
        assert!(
            matches!(err, RuntimeError::Unsupported { .. }),
            "{profile:?}: got {err:?}"
        );
        assert_eq!(
            rt.status(&spec.id).await.expect("status"),
            RuntimeStatus::NotFound
        );
    }

    let mut spec = make_spec();
    spec.template.digest = format!("sha256:{}", "0".repeat(64));
    rt.create(&spec)
        .await
        .expect_err("create from a template the runtime does not have");
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::NotFound,
        "a refused template leaves nothing"
    );

    let mut spec = make_spec();
    spec.init = vec!["/does/not/exist".into()];
    rt.create(&spec)
        .await
        .expect_err("create with a missing init");
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::NotFound,
        "a failed create leaves nothing"
    );
    assert!(!rt.list().await.expect("list").contains(&spec.id));
}

/// Looks inside: hostname, memory/pids/cpu limits visible in the sandbox's
/// cgroup, /workspace shared with the host dir; the host-only control dir
/// (envd's socket) and the host's state dir are not visible inside.
pub async fn check_limits_visible(
    rt: &dyn Runtime,
    inspector: &dyn Inspector,
    make_spec: MakeSpec<'_>,
) {
    check_inside_view(rt, inspector, make_spec, true).await
}

/// [`check_limits_visible`] without the cgroup view: for runtimes whose
/// sandboxes run on a kernel of their own that does not show the host's
/// cgroup limits inside (gVisor 2022); their tests check the host's cgroup.
pub async fn check_isolation_visible(
    rt: &dyn Runtime,
    inspector: &dyn Inspector,
    make_spec: MakeSpec<'_>,
) {
    check_inside_view(rt, inspector, make_spec, false).await
}

async fn check_inside_view(
    rt: &dyn Runtime,
    inspector: &dyn Inspector,
    make_spec: MakeSpec<'_>,
    cgroup_view: bool,
) {
    let spec = make_spec();
    let handle = rt.create(&spec).await.expect("create");
    let run = |argv: &'static [&'static str]| {
        let handle = handle.clone();
        async move {
            let out = inspector
                .run_inside(&handle, argv)
                .await
                .expect("run inside");
            assert!(out.success(), "{argv:?} failed: {out:?}");
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        }
    };
    assert_eq!(
        run(&["cat", "/proc/sys/kernel/hostname"]).await,
        spec.hostname
    );
    if cgroup_view {
        check_cgroup_view(&spec, &run).await;
    }

    run(&["sh", "-c", "echo from-inside > /workspace/probe.txt"]).await;
    assert_eq!(
        std::fs::read_to_string(handle.workspace_dir.join("probe.txt")).expect("read probe"),
        "from-inside\n",
        "/workspace is the host workspace dir"
    );
    std::fs::write(handle.control_dir.join("hello"), "from-host").expect("write control");
    assert_eq!(
        run(&[
            "sh",
            "-c",
            "cat /run/aviary/hello 2>/dev/null || echo absent"
        ])
        .await,
        "absent",
        "the control dir is host-only"
    );
    let mountinfo = run(&["cat", "/proc/self/mountinfo"]).await;
    let state_dir = handle
        .control_dir
        .parent()
        .and_then(|sandbox| sandbox.parent())
        .expect("control dir is <state>/<id>/control");
    assert!(
        !mountinfo.contains(&*state_dir.to_string_lossy()),
        "the sandbox's mountinfo names the host state dir {state_dir:?}:\n{mountinfo}"
    );

    rt.destroy(&spec.id).await.expect("destroy");
}

/// Memory, pids and cpu limits as the sandbox's cgroup shows them inside.
async fn check_cgroup_view<F, Fut>(spec: &SandboxSpec, run: &F)
where
    F: Fn(&'static [&'static str]) -> Fut,
    Fut: std::future::Future<Output = String>,
{
    let mem = run(&[
        "sh",
        "-c",
        "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes",
    ])
    .await;
    assert_eq!(
        mem,
        (spec.resources.memory_mb * 1024 * 1024).to_string(),
        "memory limit"
    );

    let pids = run(&[
        "sh",
        "-c",
        "cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max",
    ])
    .await;
    assert_eq!(pids, spec.resources.pids.to_string(), "pids limit");

    let cpu = run(&[
        "sh",
        "-c",
        "cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)",
    ])
    .await;
    let nums: Vec<f64> = cpu
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    assert_eq!(nums.len(), 2, "cpu quota and period: {cpu:?}");
    let cores = nums[0] / nums[1];
    assert!(
        (cores - spec.resources.cpu).abs() < 0.01,
        "cpu quota {cores} cores, expected {}",
        spec.resources.cpu
    );
}

/// Pause → Paused → resume → Running; destroying a paused sandbox works.
pub async fn check_pause_resume<R: Pausable>(rt: &R, make_spec: MakeSpec<'_>) {
    let spec = make_spec();
    rt.create(&spec).await.expect("create");
    rt.pause(&spec.id).await.expect("pause");
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::Paused
    );
    rt.resume(&spec.id).await.expect("resume");
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::Running
    );
    rt.pause(&spec.id).await.expect("pause again");
    rt.destroy(&spec.id)
        .await
        .expect("destroy a paused sandbox");
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::NotFound
    );
    let err = rt.pause(&spec.id).await.expect_err("pause after destroy");
    assert!(matches!(err, RuntimeError::NotFound { .. }), "got {err:?}");
}

/// The snapshot capability, end to end:
/// - an export of a running (paused) sandbox shows what was written inside,
///   in the writable layer and the workspace; unknown ids are `NotFound`;
///   an existing id cannot be staged (`AlreadyExists`);
/// - a tree staged for the running workspace and merged shows inside, with
///   the owner it was written with (container ids), and never replaces an
///   entry the workspace has;
/// - layers staged for a new id show inside after its create, with their
///   owners, and are consumed; a stage no create adopted is removed by
///   `destroy`.
pub async fn check_layers<R: Snapshottable>(
    rt: &R,
    inspector: &dyn Inspector,
    make_spec: MakeSpec<'_>,
) {
    let unknown = SandboxId::generate();
    let err = rt
        .export_layers(&unknown)
        .await
        .expect_err("export of an unknown id");
    assert!(matches!(err, RuntimeError::NotFound { .. }), "got {err:?}");

    // export after writes inside
    let spec = make_spec();
    let handle = rt.create(&spec).await.expect("create");
    let inside = |argv: Vec<String>| {
        let handle = handle.clone();
        async move {
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            let out = inspector
                .run_inside(&handle, &argv)
                .await
                .expect("run inside");
            assert!(out.success(), "{argv:?} failed: {out:?}");
            String::from_utf8_lossy(&out.stdout).to_string()
        }
    };
    let sh = |script: &str| vec!["sh".to_string(), "-c".to_string(), script.to_string()];
    inside(sh(
        "mkdir -p /workspace/src && echo ws > /workspace/src/a.txt && echo up > /etc/exported.txt",
    ))
    .await;
    rt.pause(&spec.id).await.expect("pause for export");
    let export = rt.export_layers(&spec.id).await.expect("export");
    assert_eq!(read(&export.workspace.join("src/a.txt")), "ws\n");
    assert_eq!(read(&export.writable.join("etc/exported.txt")), "up\n");
    rt.resume(&spec.id).await.expect("resume after export");
    let err = rt
        .stage_layers(&spec.id)
        .await
        .expect_err("staging layers for a running sandbox");
    assert!(
        matches!(err, RuntimeError::AlreadyExists { .. }),
        "got {err:?}"
    );

    // a tree merged into the running workspace
    let stage = rt.stage_workspace(&spec.id).await.expect("stage workspace");
    write(&stage.join("src/a.txt"), "replaced\n", None);
    write(&stage.join("merged.txt"), "merged\n", Some(1000));
    rt.merge_workspace(&spec.id).await.expect("merge workspace");
    assert!(!stage.exists(), "the merged stage is removed");
    assert_eq!(
        inside(sh("cat /workspace/src/a.txt /workspace/merged.txt")).await,
        "ws\nmerged\n",
        "merged entries show; existing ones are kept"
    );
    assert_eq!(
        owners(&inside(sh("ls -lnd /workspace/merged.txt")).await),
        vec!["1000:1000"],
        "a merged file keeps its owner, in the sandbox's ids"
    );
    rt.destroy(&spec.id).await.expect("destroy");

    // stage, then create
    let spec = make_spec();
    let stage = rt.stage_layers(&spec.id).await.expect("stage layers");
    write(
        &stage.workspace.join("seeded.txt"),
        "seeded-ws\n",
        Some(1000),
    );
    write(&stage.writable.join("etc/seeded.txt"), "seeded-up\n", None);
    let handle = rt.create(&spec).await.expect("create from a stage");
    assert!(
        !stage.writable.exists() && !stage.workspace.exists(),
        "create consumes the stage"
    );
    let out = inspector
        .run_inside(
            &handle,
            &[
                "sh",
                "-c",
                "cat /workspace/seeded.txt /etc/seeded.txt && ls -lnd /workspace/seeded.txt /etc/seeded.txt",
            ],
        )
        .await
        .expect("run inside");
    assert!(out.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.starts_with("seeded-ws\nseeded-up\n"),
        "staged layers show inside: {text}"
    );
    assert_eq!(
        owners(&text),
        vec!["0:0", "1000:1000"],
        "staged files keep their owners, in the sandbox's ids: {text}"
    );
    rt.destroy(&spec.id).await.expect("destroy");

    // a stage no create adopted
    let spec = make_spec();
    let stage = rt.stage_layers(&spec.id).await.expect("stage layers");
    write(&stage.workspace.join("left.txt"), "left\n", None);
    rt.destroy(&spec.id).await.expect("destroy a staged id");
    assert!(
        !stage.writable.exists() && !stage.workspace.exists(),
        "destroy removes an unused stage"
    );
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::NotFound
    );
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path:?}: {e}"))
}

/// Writes `text` at `path` (making parents), owned by `uid:uid` when given.
fn write(path: &Path, text: &str, uid: Option<u32>) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {dir:?}: {e}"));
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {path:?}: {e}"));
    if let Some(uid) = uid {
        std::os::unix::fs::lchown(path, Some(uid), Some(uid))
            .unwrap_or_else(|e| panic!("chown {path:?}: {e}"));
    }
}

/// `uid:gid` of every `ls -ln` line in `text`, sorted.
fn owners(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // mode, links, uid, gid, ...
            (f.len() > 4 && f[1].parse::<u64>().is_ok()).then(|| format!("{}:{}", f[2], f[3]))
        })
        .collect();
    v.sort();
    v
}

/// `cycles` create/destroy cycles leave the host footprint unchanged. One
/// warm-up cycle runs first so one-time setup (parent cgroups, state dirs)
/// does not count. Returns the create and destroy durations.
pub async fn check_teardown(
    rt: &dyn Runtime,
    make_spec: MakeSpec<'_>,
    cycles: usize,
    footprint: &(dyn Fn() -> Footprint + Sync),
) -> (Vec<Duration>, Vec<Duration>) {
    let warm = make_spec();
    rt.create(&warm).await.expect("warm-up create");
    rt.destroy(&warm.id).await.expect("warm-up destroy");
    let before = footprint();
    let (mut creates, mut destroys) = (Vec::new(), Vec::new());
    for i in 0..cycles {
        let spec = make_spec();
        let t = Instant::now();
        rt.create(&spec)
            .await
            .unwrap_or_else(|e| panic!("create #{i}: {}", chain(&e)));
        creates.push(t.elapsed());
        let t = Instant::now();
        rt.destroy(&spec.id)
            .await
            .unwrap_or_else(|e| panic!("destroy #{i}: {}", chain(&e)));
        destroys.push(t.elapsed());
    }
    let after = footprint();
    assert_eq!(before, after, "host footprint changed over {cycles} cycles");
    (creates, destroys)
}

/// The error and all its sources, `: `-separated.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Median of durations (the upper one for even counts); zero when empty.
pub fn median(samples: &[Duration]) -> Duration {
    let mut v = samples.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}
