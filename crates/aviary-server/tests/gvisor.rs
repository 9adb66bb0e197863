//! The gVisor tier through the server: a sandbox on `runsc` beside crun
//! (exec, files, pause/resume, delete, nothing left), and hibernate that
//! keeps the running processes (runsc checkpoint → restore on wake), and a
//! live fork whose child runs the parent's processes.
//! Skips loudly without runsc; fails under `AVIARY_REQUIRE_SERVICES=1`.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::{RuntimeName, SandboxState};
use common::shell;
use std::path::Path;

fn runsc_present() -> bool {
    let found = std::process::Command::new("runsc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        let why = "SKIPPED: runsc is not installed (scripts/deps.sh installs it)";
        assert!(
            std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("{why}");
    }
    found
}

fn on_runsc() -> CreateSandboxRequest {
    CreateSandboxRequest {
        runtime: Some("runsc".into()),
        ..Default::default()
    }
}

/// Entries of a runtime's state dir that name a sandbox.
fn sandboxes_left(state: &Path) -> Vec<String> {
    std::fs::read_dir(state)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("sbx"))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runsc_sandbox_execs_keeps_files_pauses_and_goes_away() {
    if !runsc_present() {
        return;
    }
    let (ts, dir) = common::start_edited(|cfg| {
        cfg.control.settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Runsc];
    })
    .await;
    let data = dir.path().join("d");
    let c = ts.client.clone();
    let s = c.create_sandbox(&on_runsc()).await.unwrap().sandbox;
    assert_eq!(s.runtime, "runsc");
    let id = s.id.to_string();
    assert!(data.join("sandboxes-runsc").join(&id).is_dir());
    // gVisor's own kernel answers
    let out = c
        .exec(&id, &shell("uname -r; echo $((6*7))"))
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert!(out.stdout.ends_with("\n42\n"), "{out:?}");
    let dmesg = c.exec(&id, &shell("dmesg | head -1")).await.unwrap();
    assert!(dmesg.stdout.contains("gVisor"), "{dmesg:?}");
    // files both ways
    c.write_file(&id, "/workspace/in.txt", b"from host\n".to_vec(), None)
        .await
        .unwrap();
    let out = c
        .exec(
            &id,
            &shell("cat /workspace/in.txt; echo inside > /workspace/out.txt"),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "from host\n");
    assert_eq!(
        c.read_file(&id, "/workspace/out.txt").await.unwrap(),
        b"inside\n"
    );
    // pause / resume
    let p = c.sandbox_action(&id, "pause", None).await.unwrap();
    assert!(p.paused, "{p:?}");
    assert!(
        c.exec(&id, &shell("true")).await.is_err(),
        "no exec while paused"
    );
    c.sandbox_action(&id, "resume", None).await.unwrap();
    let out = c.exec(&id, &shell("echo back")).await.unwrap();
    assert_eq!(out.stdout, "back\n");
    // a process inside cannot reach envd's socket (only the host can)
    let out = c
        .exec(
            &id,
            &shell("ls /run/aviary/ 2>&1; cat /run/aviary/envd.sock 2>&1; echo rc=$?"),
        )
        .await
        .unwrap();
    assert!(out.stdout.contains("rc=1"), "{out:?}");
    c.delete_sandbox(&id, None).await.unwrap();
    // delete answers first and reclaims the compute in the background
    ts.cp().reclaims.settled().await;
    assert_eq!(
        sandboxes_left(&data.join("sandboxes-runsc")),
        Vec::<String>::new()
    );
    assert_eq!(
        sandboxes_left(&data.join("sandboxes-runsc").join("runsc-state")),
        Vec::<String>::new()
    );
}

/// A tiny REPL: a persistent namespace that runs what it receives on
/// 127.0.0.1:7000 and answers with the value.
const REPL: &str = r#"
import os, socket
ns = {}
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000))
s.listen()
open("/tmp/repl.pid", "w").write(str(os.getpid()))
while True:
    c, _ = s.accept()
    code = c.recv(65536).decode()
    try:
        r = repr(eval(code, ns))
    except SyntaxError:
        exec(code, ns)
        r = "ok"
    c.sendall(r.encode())
    c.close()
"#;

/// Sends `code` to the REPL from inside the sandbox.
fn repl(code: &str) -> aviary_core::api::ExecRequest {
    shell(&format!(
        "python3 -c 'import socket,sys; c=socket.create_connection((\"127.0.0.1\",7000)); c.sendall(sys.argv[1].encode()); print(c.recv(65536).decode())' '{code}'"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hibernate_on_runsc_keeps_the_running_processes() {
    if !runsc_present() {
        return;
    }
    let (ts, dir) = common::start_edited(|cfg| {
        cfg.control.default_template = "default".into();
        cfg.control.default_template_source =
            aviary_server::config::DefaultTemplateSource::Debootstrap;
        cfg.control.settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Runsc];
    })
    .await;
    let data = dir.path().join("d");
    let c = ts.client.clone();
    let s = c.create_sandbox(&on_runsc()).await.unwrap().sandbox;
    let id = s.id.to_string();
    c.write_file(&id, "/tmp/repl.py", REPL.as_bytes().to_vec(), None)
        .await
        .unwrap();
    let out = c
        .exec(
            &id,
            &shell(
                "nohup python3 /tmp/repl.py >/tmp/repl.log 2>&1 & \
                 cd /workspace && echo served > page.txt && \
                 nohup python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/http.log 2>&1 & \
                 for i in $(seq 100); do [ -s /tmp/repl.pid ] && break; sleep 0.1; done; cat /tmp/repl.pid",
            ),
        )
        .await
        .unwrap();
    let pid = out.stdout.trim().to_string();
    assert!(!pid.is_empty(), "{out:?}");
    // a process inside cannot connect to envd's socket (only the host can)
    let dial = c
        .exec(
            &id,
            &shell("python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.connect(\"/run/aviary/envd.sock\")' 2>&1 | tail -1"),
        )
        .await
        .unwrap();
    assert!(dial.stdout.contains("PermissionError"), "{dial:?}");
    let set = c.exec(&id, &repl("x = 41 + 1")).await.unwrap();
    assert_eq!(set.stdout, "ok\n", "{set:?}");
    assert_eq!(c.exec(&id, &repl("x")).await.unwrap().stdout, "42\n");

    let h = c.sandbox_action(&id, "hibernate", None).await.unwrap();
    assert_eq!(h.state, SandboxState::Hibernating);
    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    assert!(
        evs.iter().any(|e| e.event_type == "memory_checkpointed"),
        "{evs:?}"
    );
    assert!(
        data.join("sandboxes-runsc")
            .join(format!("{id}.checkpoint"))
            .is_dir(),
        "the memory image is kept on the host"
    );
    let w = c.sandbox_action(&id, "wake", None).await.unwrap();
    assert_eq!(w.state, SandboxState::Idle);

    // the same process, with its variable, and the server still answers
    assert_eq!(c.exec(&id, &repl("x")).await.unwrap().stdout, "42\n");
    assert_eq!(
        c.exec(&id, &repl("__import__(\"os\").getpid()"))
            .await
            .unwrap()
            .stdout
            .trim(),
        pid
    );
    let page = c
        .exec(
            &id,
            &shell("python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8000/page.txt\").read().decode(), end=\"\")'"),
        )
        .await
        .unwrap();
    assert_eq!(page.stdout, "served\n", "{page:?}");
    assert!(!data
        .join("sandboxes-runsc")
        .join(format!("{id}.checkpoint"))
        .exists());
    c.delete_sandbox(&id, None).await.unwrap();
    // delete answers first and reclaims the compute in the background
    ts.cp().reclaims.settled().await;
    assert_eq!(
        sandboxes_left(&data.join("sandboxes-runsc")),
        Vec::<String>::new()
    );
}

/// Reads the page the sandbox's http.server serves, from inside.
fn fetch_page() -> aviary_core::api::ExecRequest {
    shell("python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:8000/page.txt\").read().decode(), end=\"\")'")
}

fn with_token(
    mut req: aviary_core::api::ExecRequest,
    token: &aviary_core::LeaseToken,
) -> aviary_core::api::ExecRequest {
    req.token = Some(*token);
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_on_runsc_runs_the_parents_processes() {
    use aviary_client::ClientError;
    use aviary_core::ErrorCode;
    if !runsc_present() {
        return;
    }
    let (ts, dir) = common::start_edited(|cfg| {
        cfg.control.default_template = "default".into();
        cfg.control.default_template_source =
            aviary_server::config::DefaultTemplateSource::Debootstrap;
        cfg.control.settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Runsc];
    })
    .await;
    let data = dir.path().join("d");
    let c = ts.client.clone();
    let s = c.create_sandbox(&on_runsc()).await.unwrap().sandbox;
    let id = s.id.to_string();
    // the parent is leased: its holder forks it
    let lease = c.acquire_lease(&id, "alice", None).await.unwrap();
    let t = lease.token;
    c.write_file(&id, "/tmp/repl.py", REPL.as_bytes().to_vec(), Some(t))
        .await
        .unwrap();
    let out = c
        .exec(
            &id,
            &with_token(
                shell(
                    "nohup python3 /tmp/repl.py >/tmp/repl.log 2>&1 & \
                     cd /workspace && echo served > page.txt && \
                     nohup python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/http.log 2>&1 & \
                     for i in $(seq 100); do [ -s /tmp/repl.pid ] && python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:8000/\")' 2>/dev/null && break; sleep 0.1; done; cat /tmp/repl.pid",
                ),
                &t,
            ),
        )
        .await
        .unwrap();
    let pid = out.stdout.trim().to_string();
    assert!(!pid.is_empty(), "{out:?}");
    let set = c
        .exec(&id, &with_token(repl("x = 41 + 1"), &t))
        .await
        .unwrap();
    assert_eq!(set.stdout, "ok\n", "{set:?}");

    // a command still running in the parent: refused (gVisor cannot save
    // its open connection), nothing made, the command goes on
    let mut stream = c
        .exec_stream(
            &id,
            &with_token(
                shell("echo started; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo done"),
                &t,
            ),
        )
        .await
        .unwrap();
    assert!(
        matches!(stream.next().await.unwrap(), Some(aviary_client::StreamItem::Stdout(b)) if b == b"started\n")
    );
    let err = c.fork_live(&id, Some(t)).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Api {
                code: ErrorCode::InvalidState,
                status: 409,
                ..
            }
        ),
        "{err:?}"
    );
    c.exec(&id, &with_token(shell("touch /tmp/go"), &t))
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(item) = stream.next().await.unwrap() {
        match item {
            aviary_client::StreamItem::Stdout(b) => out.extend(b),
            aviary_client::StreamItem::Exit(r) => assert_eq!(r.exit_code, 0, "{r:?}"),
            aviary_client::StreamItem::Stderr(_) => {}
        }
    }
    assert_eq!(out, b"done\n");
    // without the parent's token: refused, nothing made
    let err = c.fork_live(&id, None).await.unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Api {
                code: ErrorCode::LeaseRequired,
                ..
            }
        ),
        "{err:?}"
    );
    let f = c.fork_live(&id, Some(t)).await.unwrap();
    let child = f.sandbox;
    let cid = child.id.to_string();
    assert_eq!(child.state, SandboxState::Idle, "the child starts unleased");
    assert_eq!(child.runtime, "runsc");
    assert!(f.lease.is_none());
    assert_eq!(f.decision.action, "fork");
    let evs = c.events(Some(&cid), None, Some(1000)).await.unwrap().events;
    let forked = evs
        .iter()
        .find(|e| e.event_type == "forked")
        .unwrap_or_else(|| panic!("{evs:?}"));
    assert_eq!(forked.metadata["live"], true, "{forked:?}");
    assert_eq!(forked.metadata["parent_sandbox"], id.as_str(), "{forked:?}");

    // the child: the same REPL process with x, and the server answers
    assert_eq!(c.exec(&cid, &repl("x")).await.unwrap().stdout, "42\n");
    assert_eq!(
        c.exec(&cid, &repl("__import__(\"os\").getpid()"))
            .await
            .unwrap()
            .stdout
            .trim(),
        pid
    );
    assert_eq!(
        c.exec(&cid, &fetch_page()).await.unwrap().stdout,
        "served\n"
    );
    // the parent's lease token is refused by the child
    let err = c
        .exec(&cid, &with_token(shell("echo in"), &t))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Api {
                code: ErrorCode::StaleToken,
                ..
            }
        ),
        "{err:?}"
    );
    // the parent keeps running, its lease and its processes
    let p = c.get_sandbox(&id).await.unwrap();
    assert_eq!(p.state, SandboxState::Leased);
    assert_eq!(
        c.exec(&id, &with_token(repl("x"), &t))
            .await
            .unwrap()
            .stdout,
        "42\n"
    );
    assert_eq!(
        c.exec(&id, &with_token(fetch_page(), &t))
            .await
            .unwrap()
            .stdout,
        "served\n"
    );
    // apart from the fork on: memory and files
    assert_eq!(c.exec(&cid, &repl("x = 7")).await.unwrap().stdout, "ok\n");
    c.exec(&cid, &shell("echo child > /workspace/c.txt"))
        .await
        .unwrap();
    c.exec(
        &id,
        &with_token(shell("echo parent > /workspace/p.txt"), &t),
    )
    .await
    .unwrap();
    assert_eq!(
        c.exec(&id, &with_token(repl("x"), &t))
            .await
            .unwrap()
            .stdout,
        "42\n"
    );
    assert_eq!(c.exec(&cid, &repl("x")).await.unwrap().stdout, "7\n");
    // (a glob, not ls: this runsc answers coreutils' statx with EINVAL)
    let ls = c
        .exec(&id, &with_token(shell("cd /workspace && echo *"), &t))
        .await
        .unwrap();
    assert_eq!(ls.stdout, "p.txt page.txt\n", "{ls:?}");
    let ls = c
        .exec(&cid, &shell("cd /workspace && echo *"))
        .await
        .unwrap();
    assert_eq!(ls.stdout, "c.txt page.txt\n", "{ls:?}");

    c.delete_sandbox(&cid, None).await.unwrap();
    c.delete_sandbox(&id, Some(t)).await.unwrap();
    // delete answers first and reclaims the compute in the background
    ts.cp().reclaims.settled().await;
    assert_eq!(
        sandboxes_left(&data.join("sandboxes-runsc")),
        Vec::<String>::new()
    );
    assert_eq!(
        sandboxes_left(&data.join("sandboxes-runsc").join("runsc-state")),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_is_unsupported_on_crun() {
    use aviary_client::ClientError;
    use aviary_core::ErrorCode;
    if !runsc_present() {
        return;
    }
    let (ts, dir) = common::start_edited(|cfg| {
        cfg.control.settings.server.runtimes = vec![RuntimeName::Crun, RuntimeName::Runsc];
    })
    .await;
    let c = ts.client.clone();
    let s = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox;
    assert_eq!(s.runtime, "crun");
    let id = s.id.to_string();
    let err = c.fork_live(&id, None).await.unwrap_err();
    match err {
        ClientError::Api { status, code, .. } => {
            assert_eq!((status, code), (409, ErrorCode::Unsupported));
        }
        other => panic!("{other:?}"),
    }
    // nothing was made: the one sandbox is still the only one
    let all = c.list_sandboxes(true).await.unwrap();
    assert_eq!(all.sandboxes.len(), 1, "{all:?}");
    c.delete_sandbox(&id, None).await.unwrap();
    ts.cp().reclaims.settled().await;
    drop(dir);
}
