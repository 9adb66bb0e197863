//! Processes and background commands, end to end through the real server,
//! a real crun sandbox and its envd: list, signal, background output read
//! later by another client, follow until the exit, tenants and leases.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::{Client, StreamItem};
use aviary_core::api::ExecRequest;
use aviary_core::ErrorCode;
use common::shell;

fn code(e: aviary_client::ClientError) -> Option<ErrorCode> {
    e.code()
}

async fn pids_running(c: &Client, id: &str, argv: &[&str]) -> Vec<i32> {
    c.list_processes(id)
        .await
        .unwrap()
        .processes
        .into_iter()
        .filter(|p| p.argv == argv && p.state != "Z")
        .map(|p| p.pid)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_list_signal_and_background_commands() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;

    // a process left running by an exec shows in the listing
    let r = c
        .exec(&id, &shell("sleep 321 >/dev/null 2>&1 &"))
        .await
        .unwrap();
    assert_eq!(r.exit_code, 0);
    let list = c.list_processes(&id).await.unwrap();
    let envd = list.processes.iter().find(|p| p.pid == 1).unwrap();
    assert_eq!(envd.argv[0], "/.aviary/envd", "{envd:?}");
    let sleeping = pids_running(c, &id, &["sleep", "321"]).await;
    assert_eq!(sleeping.len(), 1, "{list:?}");
    let pid = sleeping[0];
    let p = list.processes.iter().find(|p| p.pid == pid).unwrap();
    assert_eq!((p.uid, p.user.as_deref()), (0, Some("root")));

    // argv is the sandbox's text: bounded (64 arguments of at most 256 bytes)
    let r = c
        .exec(
            &id,
            &shell(
                "x=$(head -c 1000 /dev/zero | tr '\\0' x); set --; \
                 for i in $(seq 100); do set -- \"$@\" \"$x\"; done; \
                 sh -c 'sleep 432; true' \"$@\" >/dev/null 2>&1 &",
            ),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, 0);
    let mut wide = None;
    for _ in 0..100 {
        let list = c.list_processes(&id).await.unwrap();
        wide = list
            .processes
            .into_iter()
            .find(|p| p.argv.get(2).map(String::as_str) == Some("sleep 432; true"));
        if wide.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let wide = wide.expect("the shell with a long argv is listed");
    assert!(wide.truncated, "{wide:?}");
    assert_eq!(wide.argv.len(), 64);
    assert!(wide.argv.iter().all(|a| a.len() <= 256));
    assert_eq!(wide.argv[3].len(), 256);

    // refused: envd, a signal envd does not send, a pid that is not there
    assert_eq!(
        code(c.signal_process(&id, 1, None, None).await.unwrap_err()),
        Some(ErrorCode::PermissionDenied)
    );
    assert_eq!(
        code(
            c.signal_process(&id, pid, Some("SEGV"), None)
                .await
                .unwrap_err()
        ),
        Some(ErrorCode::InvalidRequest)
    );
    assert_eq!(
        code(
            c.signal_process(&id, 4_000_000, None, None)
                .await
                .unwrap_err()
        ),
        Some(ErrorCode::NotFound)
    );
    // kill ends it (envd reaps it: it leaves the listing)
    c.signal_process(&id, pid, Some("TERM"), None)
        .await
        .unwrap();
    let mut gone = false;
    for _ in 0..100 {
        if pids_running(c, &id, &["sleep", "321"]).await.is_empty() {
            gone = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(gone, "the signalled sleep still runs");

    // a background command: its starting client is gone before it ends;
    // another client reads its output later, and follows it to the exit
    let started = {
        let starter = Client::new(&ts.url(), &ts.key);
        starter
            .start_background(&id, &shell("echo out; echo err >&2; sleep 1; echo done"))
            .await
            .unwrap()
    };
    assert!(started.handle > 0 && started.pid > 1, "{started:?}");
    let reader = Client::new(&ts.url(), &ts.key);
    let mut follow = reader.follow_background(&id, started.handle).await.unwrap();
    let (mut out, mut err, mut exit) = (Vec::new(), Vec::new(), None);
    while let Some(item) = follow.next().await.unwrap() {
        match item {
            StreamItem::Stdout(d) => out.extend(d),
            StreamItem::Stderr(d) => err.extend(d),
            StreamItem::Exit(r) => exit = Some(r),
        }
    }
    assert_eq!(String::from_utf8(out).unwrap(), "out\ndone\n");
    assert_eq!(String::from_utf8(err).unwrap(), "err\n");
    assert_eq!(exit.expect("follow ends with the exit").exit_code, 0);
    let o = reader.background_output(&id, started.handle).await.unwrap();
    assert_eq!(
        (o.running, o.exit_code, o.stdout.as_str(), o.stderr.as_str()),
        (false, Some(0), "out\ndone\n", "err\n")
    );
    // a running one says so, and signalling its pid ends it
    let bg = c
        .start_background(&id, &shell("echo ready; exec sleep 654"))
        .await
        .unwrap();
    let mut o = c.background_output(&id, bg.handle).await.unwrap();
    for _ in 0..100 {
        if o.stdout == "ready\n" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        o = c.background_output(&id, bg.handle).await.unwrap();
    }
    assert_eq!(
        (o.running, o.exit_code, o.stdout.as_str()),
        (true, None, "ready\n")
    );
    c.signal_process(&id, bg.pid, Some("KILL"), None)
        .await
        .unwrap();
    let mut follow = c.follow_background(&id, bg.handle).await.unwrap();
    let mut exit = None;
    while let Some(item) = follow.next().await.unwrap() {
        if let StreamItem::Exit(r) = item {
            exit = Some(r);
        }
    }
    assert_eq!(exit.unwrap().exit_code, 128 + 9);
    // the kept output is bounded: the newest 1 MiB, the rest counted
    let big = c
        .start_background(&id, &shell("yes | head -c 3000000"))
        .await
        .unwrap();
    let mut follow = c.follow_background(&id, big.handle).await.unwrap();
    while follow.next().await.unwrap().is_some() {}
    let o = c.background_output(&id, big.handle).await.unwrap();
    assert_eq!(o.stdout.len(), 1024 * 1024);
    assert_eq!(o.stdout_dropped, 3_000_000 - 1024 * 1024);
    // unknown handles, bad input
    assert_eq!(
        code(c.background_output(&id, 999_999).await.unwrap_err()),
        Some(ErrorCode::NotFound)
    );
    let with_stdin = ExecRequest {
        stdin: Some("x".into()),
        ..shell("cat")
    };
    assert_eq!(
        code(c.start_background(&id, &with_stdin).await.unwrap_err()),
        Some(ErrorCode::InvalidRequest)
    );

    // another tenant sees none of it
    let other = c.create_key("procs-other", false).await.unwrap();
    let oc = Client::new(&ts.url(), &other.key);
    assert_eq!(
        code(oc.list_processes(&id).await.unwrap_err()),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code(
            oc.signal_process(&id, bg.pid, None, None)
                .await
                .unwrap_err()
        ),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code(oc.background_output(&id, started.handle).await.unwrap_err()),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code(oc.start_background(&id, &shell("true")).await.unwrap_err()),
        Some(ErrorCode::NotFound)
    );

    // leases: starts and signals are fenced; a fence move ends the old
    // holder's background commands and envd forgets their handles
    let lease = c.acquire_lease(&id, "agent-a", Some(60)).await.unwrap();
    assert_eq!(
        code(
            c.start_background(&id, &shell("sleep 100"))
                .await
                .unwrap_err()
        ),
        Some(ErrorCode::LeaseRequired)
    );
    let held = c
        .start_background(
            &id,
            &ExecRequest {
                token: Some(lease.token),
                ..shell("sleep 777")
            },
        )
        .await
        .unwrap();
    assert_eq!(pids_running(c, &id, &["sleep", "777"]).await, [held.pid]);
    c.release_lease(&id, lease.token).await.unwrap();
    let lease2 = c.acquire_lease(&id, "agent-b", Some(60)).await.unwrap();
    assert!(pids_running(c, &id, &["sleep", "777"]).await.is_empty());
    assert_eq!(
        code(c.background_output(&id, held.handle).await.unwrap_err()),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code(
            c.start_background(
                &id,
                &ExecRequest {
                    token: Some(lease.token),
                    ..shell("true")
                },
            )
            .await
            .unwrap_err()
        ),
        Some(ErrorCode::StaleToken)
    );
    assert_eq!(
        code(
            c.signal_process(&id, 2, None, Some(lease.token))
                .await
                .unwrap_err()
        ),
        Some(ErrorCode::StaleToken)
    );
    c.release_lease(&id, lease2.token).await.unwrap();
    c.delete_sandbox(&id, None).await.unwrap();
}
