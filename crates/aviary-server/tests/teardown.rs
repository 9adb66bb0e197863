//! 50 create/delete cycles through the API leave no mount, cgroup, process or
//! directory behind. Alone in its own test binary so nothing else runs.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use std::path::Path;

fn count_lines(path: &str) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn aviary_cgroup_dirs() -> usize {
    let mut n = 0;
    let Ok(ctrls) = std::fs::read_dir("/sys/fs/cgroup") else {
        return 0;
    };
    for c in ctrls.flatten() {
        let base = c.path().join("aviary");
        if let Ok(rd) = std::fs::read_dir(&base) {
            n += rd.flatten().filter(|e| e.path().is_dir()).count();
        }
    }
    n
}

/// Processes that belong to Aviary sandboxes: in an `aviary` cgroup, or
/// started from a sandbox's state dir (the machine's other processes are
/// not this test's business and come and go on their own).
fn processes(state_dir: &Path) -> usize {
    let marker = state_dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter(|e| {
            let cg = std::fs::read_to_string(e.path().join("cgroup")).unwrap_or_default();
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            cg.contains("/aviary/") || String::from_utf8_lossy(&cmd).contains(&marker)
        })
        .count()
}

fn entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|r| r.count()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_cycles_leave_nothing_behind() {
    let ts = common::start().await;
    let c = &ts.client;
    let state_dir = ts.server_cfg().runtime_state_dir();
    // one warm-up cycle so lazily created shared dirs exist before counting
    let id = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox
        .id;
    c.delete_sandbox(id.as_str(), None).await.unwrap();
    ts.cp().reclaims.settled().await;

    let before = (
        count_lines("/proc/self/mountinfo"),
        aviary_cgroup_dirs(),
        processes(&state_dir),
        entries(&state_dir),
    );
    for i in 0..50 {
        let s = c
            .create_sandbox(&CreateSandboxRequest::default())
            .await
            .unwrap()
            .sandbox;
        if i % 10 == 0 {
            let r = c
                .exec(s.id.as_str(), &common::shell("sleep 100 & echo started"))
                .await
                .unwrap();
            assert_eq!(r.stdout, "started\n");
        }
        c.delete_sandbox(s.id.as_str(), None).await.unwrap();
    }
    // processes can take a moment to be reaped by the kernel
    let mut after = (0, 0, 0, 0);
    for _ in 0..50 {
        after = (
            count_lines("/proc/self/mountinfo"),
            aviary_cgroup_dirs(),
            processes(&state_dir),
            entries(&state_dir),
        );
        if after == before {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        after, before,
        "(mounts, cgroup dirs, processes, sandbox dirs) before vs after 50 cycles"
    );
}
