//! A conformance suite every [`Runtime`] backend runs against itself.
//!
//! Each `check_*` function drives a real runtime through one contract of the
//! trait and panics with a clear message when the backend breaks it, so a
//! backend's integration test is a list of calls. Specs come from the caller
//! (`make_spec` returns a fresh spec with a new id each time), because only
//! the caller knows a template and an init that fit its backend. The suite
//! expects the template to have a POSIX `sh` and `cat` for the checks that
//! look inside through an [`Inspector`].

use crate::{
    Pausable, Runtime, RuntimeError, RuntimeStatus, SandboxHandle, SandboxSpec, SpawnOutput,
};
use async_trait::async_trait;
use aviary_core::{NetworkProfile, SandboxId};
use std::collections::BTreeMap;
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
        handle.workspace_dir.is_dir(),
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
    assert!(!handle.workspace_dir.exists(), "workspace dir removed");
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

/// Network profiles other than `none` are refused with `Unsupported`, and
/// leave nothing behind; a missing init binary fails cleanly.
pub async fn check_refusals(rt: &dyn Runtime, make_spec: MakeSpec<'_>) {
    let mut spec = make_spec();
    spec.network = NetworkProfile::Open;
    let err = rt
        .create(&spec)
        .await
        .expect_err("create with open network");
    assert!(
        matches!(err, RuntimeError::Unsupported { .. }),
        "got {err:?}"
    );
    assert_eq!(
        rt.status(&spec.id).await.expect("status"),
        RuntimeStatus::NotFound
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
