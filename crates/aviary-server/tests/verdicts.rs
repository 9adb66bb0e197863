//! The reuse checker's verdicts carried out, through the real server, their
//! effects checked inside the sandbox: `new_venv` makes a fresh virtual
//! environment in the reused sandbox and later execs of the task run in it
//! (the earlier task's conflicting package is not importable there);
//! `fork_clean_snapshot` gives the scope a new sandbox from its clean
//! checkpoint (its files, not the dirty ones made after it).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::{CreateSandboxRequest, ExecRequest, ExecResult};
use aviary_core::LeaseToken;

fn user(u: &str, class: Option<&str>, intent: Option<serde_json::Value>) -> CreateSandboxRequest {
    CreateSandboxRequest {
        user_id: Some(u.into()),
        class: class.map(str::to_owned),
        intent,
        ..Default::default()
    }
}

async fn sh(c: &aviary_client::Client, id: &str, token: LeaseToken, s: &str) -> ExecResult {
    c.exec(
        id,
        &ExecRequest {
            token: Some(token),
            ..common::shell(s)
        },
    )
    .await
    .unwrap()
}

/// A tiny local package `leftpad` 1.0 in the system site-packages: what an
/// earlier task installed (no network needed).
const INSTALL_LEFTPAD_1: &str = "set -e; d=$(python3 -c 'import site; print(site.getsitepackages()[0])'); \
mkdir -p \"$d/leftpad\" \"$d/leftpad-1.0.dist-info\"; \
echo 'VERSION = \"1.0\"' > \"$d/leftpad/__init__.py\"; \
printf 'Metadata-Version: 2.1\\nName: leftpad\\nVersion: 1.0\\n' > \"$d/leftpad-1.0.dist-info/METADATA\"; \
python3 -c 'import leftpad; print(leftpad.VERSION)'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_venv_runs_the_next_task_in_a_fresh_virtual_environment() {
    let ts = common::start_with("default").await;
    let c = &ts.client;
    let a = c
        .create_sandbox(&user("py", Some("python-small"), None))
        .await
        .unwrap();
    let id = a.sandbox.id.to_string();
    let ta = a.lease.as_ref().unwrap().token;
    let out = sh(c, &id, ta, INSTALL_LEFTPAD_1).await;
    assert_eq!(
        (out.exit_code, out.stdout.as_str()),
        (0, "1.0\n"),
        "{out:?}"
    );
    // the task ends; its manifest now lists leftpad 1.0
    c.sandbox_action(&id, "release", Some(ta)).await.unwrap();

    // the next task of the same user needs leftpad 2.0: a conflict a venv solves
    let needs_2 = serde_json::json!({
        "task": "pad strings", "languages": ["python"], "dependencies": ["leftpad==2.0"]
    });
    let b = c
        .create_sandbox(&user("py", Some("python-small"), Some(needs_2)))
        .await
        .unwrap();
    assert_eq!(b.sandbox.id.as_str(), id, "{:?}", b.decision);
    assert_eq!(b.decision.action, "new_venv", "{:?}", b.decision);
    assert!(
        b.decision.reason.contains("/opt/aviary/venvs/"),
        "the answer says what was done: {:?}",
        b.decision
    );
    let tb = b.lease.as_ref().unwrap().token;
    // inside: the task's python is the venv's, leftpad 1.0 is not on its path
    let out = sh(
        c,
        &id,
        tb,
        "echo \"$VIRTUAL_ENV\"; python3 -c 'import sys; print(sys.prefix)'",
    )
    .await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{out:?}");
    assert!(lines[0].starts_with("/opt/aviary/venvs/"), "{out:?}");
    assert_eq!(lines[0], lines[1], "python3 runs from the venv: {out:?}");
    let out = sh(c, &id, tb, "python3 -c 'import leftpad'").await;
    assert_ne!(out.exit_code, 0, "{out:?}");
    assert!(out.stderr.contains("No module named 'leftpad'"), "{out:?}");
    // the system interpreter still has it: the venv, not a wipe, hides it
    let out = sh(
        c,
        &id,
        tb,
        "/usr/bin/python3 -c 'import leftpad; print(leftpad.VERSION)'",
    )
    .await;
    assert_eq!(out.stdout, "1.0\n", "{out:?}");
    // the event log records it
    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    let made = evs
        .iter()
        .find(|e| e.event_type == "venv_created")
        .expect("a venv_created event");
    assert_eq!(made.metadata["path"].as_str(), Some(lines[0]));
    assert!(
        made.metadata["install"].to_string().contains("leftpad"),
        "{}",
        made.metadata
    );
    assert!(evs
        .iter()
        .any(|e| e.event_type == "reuse_decision" && e.metadata["action"] == "new_venv"));

    // a later plain reuse by another session drops the venv
    c.sandbox_action(&id, "release", Some(tb)).await.unwrap();
    let next = c
        .create_sandbox(&CreateSandboxRequest {
            session_id: Some("other".into()),
            ..user("py", Some("python-small"), None)
        })
        .await
        .unwrap();
    assert_eq!(next.sandbox.id.as_str(), id, "{:?}", next.decision);
    assert_eq!(next.decision.action, "reuse", "{:?}", next.decision);
    let out = sh(
        c,
        &id,
        next.lease.as_ref().unwrap().token,
        "echo \"[$VIRTUAL_ENV]\"",
    )
    .await;
    assert_eq!(out.stdout, "[]\n", "{out:?}");
    ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_clean_snapshot_gives_the_scope_its_clean_checkpoint() {
    let ts = common::start().await;
    let c = &ts.client;
    let a = c.create_sandbox(&user("forky", None, None)).await.unwrap();
    let id = a.sandbox.id.to_string();
    let ta = a.lease.as_ref().unwrap().token;
    sh(c, &id, ta, "echo clean > /workspace/clean.txt").await;
    c.snapshot_labelled(&id, "clean", Some(ta)).await.unwrap();
    // then the task pollutes it outside anything a manifest can describe
    let out = sh(
        c,
        &id,
        ta,
        "echo dirty > /workspace/dirty.txt && echo x > /etc/aviary-dirty-marker",
    )
    .await;
    assert_eq!(out.exit_code, 0, "{out:?}");
    c.sandbox_action(&id, "release", Some(ta)).await.unwrap();

    let b = c.create_sandbox(&user("forky", None, None)).await.unwrap();
    assert_ne!(b.sandbox.id.as_str(), id, "{:?}", b.decision);
    assert_eq!(
        (b.decision.action.as_str(), b.decision.branch.as_str()),
        ("fork_clean_snapshot", "C"),
        "{:?}",
        b.decision
    );
    assert!(
        b.decision.reason.contains("unknown_pollution"),
        "{:?}",
        b.decision
    );
    assert_eq!(
        b.sandbox.user_id.as_deref(),
        Some("forky"),
        "it is the scope's"
    );
    let fid = b.sandbox.id.to_string();
    let tb = b.lease.as_ref().unwrap().token;
    let out = sh(
        c,
        &fid,
        tb,
        "cat /workspace/clean.txt; [ -e /workspace/dirty.txt ] && echo dirty-ws; \
         [ -e /etc/aviary-dirty-marker ] && echo dirty-etc; true",
    )
    .await;
    assert_eq!(out.stdout, "clean\n", "{out:?}");
    let evs = c.events(Some(&fid), None, Some(1000)).await.unwrap().events;
    assert!(
        evs.iter().any(|e| e.event_type == "restore_branch"
            && e.metadata["action"] == "fork_clean_snapshot"
            && e.metadata["from_sandbox"] == id.as_str()),
        "{evs:?}"
    );
    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    assert!(
        evs.iter()
            .any(|e| e.event_type == "reuse_decision"
                && e.metadata["action"] == "fork_clean_snapshot")
    );
    ts.cleanup().await;
}
