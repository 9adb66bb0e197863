//! The project's own adversarial suite (issue 7), run as an attacker would:
//! from inside a sandbox against the host's envd connection, from the API as
//! another tenant over every route in `/openapi.json`, and with a table of
//! bad inputs over every route (never a 5xx). Lease-loss writes live in
//! `robustness.rs`, connection floods and rate limits in `edge.rs`.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::{Client, ClientError};
use aviary_core::api::{CreateSandboxRequest, ExecRequest};
use aviary_core::{ErrorCode, LeaseToken};
use reqwest::{Method, StatusCode};

/// A server whose per-key rate limit is out of the way: these tests send
/// hundreds of requests from one key on purpose (limits are `edge.rs`'s).
async fn start_unthrottled() -> (common::TestServer, tempfile::TempDir) {
    common::start_edited(|cfg| {
        cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
        cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    })
    .await
}

async fn sh(c: &Client, id: &str, script: &str) -> (i32, String) {
    let r = c.exec(id, &common::shell(script)).await.unwrap();
    (r.exit_code, format!("{}{}", r.stdout, r.stderr))
}

/// Finding 1 (critical): a sandbox swaps the path the host used to connect to
/// for a symlink to another tenant's envd socket — by its host path, and via
/// `/proc/<pid>/root` — and the next calls on its own sandbox must still run
/// in its own sandbox, and the victim's fence must not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_cannot_redirect_the_hosts_envd_connection() {
    let ts = common::start().await;
    let admin = &ts.client;
    let ka = admin.create_key("victim", false).await.unwrap();
    let kb = admin.create_key("attacker", false).await.unwrap();
    let a = Client::new(&ts.url(), &ka.key);
    let b = Client::new(&ts.url(), &kb.key);
    let created_a = a
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(aviary_core::api::AcquireLeaseRequest {
                owner: "victim".into(),
                ttl_s: Some(120),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let id_a = created_a.sandbox.id.to_string();
    let lease_a = created_a.lease.unwrap();
    let id_b = common::new_sandbox(&b).await;
    let mut mark = common::shell("echo victim > /workspace/owner");
    mark.token = Some(lease_a.token);
    assert_eq!(a.exec(&id_a, &mark).await.unwrap().exit_code, 0);
    sh(&b, &id_b, "echo attacker > /workspace/owner").await;

    // What the attacker can learn about the host from inside.
    let data = ts.data.to_string_lossy().to_string();
    let (_, mountinfo) = sh(&b, &id_b, "cat /proc/self/mountinfo").await;
    assert!(
        !mountinfo.contains(&data),
        "the host data dir {data} shows in the sandbox's mountinfo:\n{mountinfo}"
    );
    let (_, run) = sh(&b, &id_b, "ls -la /run/aviary 2>&1 || true").await;
    assert!(
        !run.contains("envd.sock"),
        "envd's socket is visible inside: {run}"
    );

    // The attack as reported: plant symlinks where the socket used to be,
    // to the victim's socket by host path and through /proc/<pid>/root.
    let victim_sock = ts
        .server_cfg()
        .runtime_state_dir()
        .join(&id_a)
        .join("control/envd.sock");
    let victim_init = ts
        .cp()
        .runtime()
        .envd_endpoint(&id_a.parse().unwrap())
        .await
        .unwrap()
        .peer_pid;
    for target in [
        victim_sock.display().to_string(),
        format!("/proc/{victim_init}/root/run/aviary/envd.sock"),
        "/proc/1/root/run/aviary/envd.sock".to_string(),
    ] {
        let (code, out) = sh(
            &b,
            &id_b,
            &format!(
                "mkdir -p /run/aviary && rm -rf /run/aviary/envd.sock && ln -s {target} /run/aviary/envd.sock && echo planted"
            ),
        )
        .await;
        assert_eq!((code, out.trim()), (0, "planted"));
        // The attacker's next calls on its own sandbox stay in its own sandbox.
        let (_, owner) = sh(&b, &id_b, "cat /workspace/owner").await;
        assert_eq!(owner.trim(), "attacker", "exec redirected via {target}");
        let read = b.read_file(&id_b, "/workspace/owner").await.unwrap();
        assert_eq!(read, b"attacker\n", "file read redirected via {target}");
        b.write_file(&id_b, "/workspace/written", b"x".to_vec(), None)
            .await
            .unwrap();
        // A lease grant pushes a fence: it must land in the attacker's envd.
        let l = b.acquire_lease(&id_b, "attacker", Some(30)).await.unwrap();
        b.release_lease(&id_b, l.token).await.unwrap();
    }
    // The victim is untouched: no file of the attacker, same fence, works.
    let victim_files = a.list_files(&id_a, "/workspace").await.unwrap();
    assert!(
        !format!("{victim_files:?}").contains("written"),
        "{victim_files:?}"
    );
    let mut check = common::shell("cat /workspace/owner");
    check.token = Some(lease_a.token);
    let r = a.exec(&id_a, &check).await.unwrap();
    assert_eq!(r.stdout.trim(), "victim");
    // The host-side socket still belongs to the victim's init (nothing inside
    // could replace it), and its envd still holds the victim's fence.
    let health = aviary_envd_proto::EnvdClient::new(victim_sock)
        .expect_peer_pid(victim_init)
        .health()
        .await
        .unwrap();
    assert_eq!(health.fence, Some(lease_a.token.fence()));
    ts.cleanup().await;
}

/// Finding 11: the fence number is public (events) and small; a token with
/// the right fence and a guessed secret is refused, and no event or listing
/// carries the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_tokens_cannot_be_guessed_from_the_fence() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let lease = c.acquire_lease(&id, "holder", Some(60)).await.unwrap();
    let guessed: LeaseToken = format!("{}.{}", lease.token.fence(), "0".repeat(32))
        .parse()
        .unwrap();
    let mut req = common::shell("touch /workspace/pwned");
    req.token = Some(guessed);
    match c.exec(&id, &req).await.unwrap_err() {
        ClientError::Api { code, .. } => assert_eq!(code, ErrorCode::StaleToken),
        other => panic!("{other:?}"),
    }
    for bad in [
        format!("{}", lease.token.fence()),
        "1.2".into(),
        "../..".into(),
    ] {
        let (status, body) = c
            .raw(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(format!(r#"{{"argv":["true"],"token":"{bad}"}}"#).into_bytes()),
                Some(&ts.key),
            )
            .await
            .unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let secret = lease.token.to_string();
    let secret = secret.split('.').nth(1).unwrap();
    let events = c.events(Some(&id), None, None).await.unwrap();
    let text = serde_json::to_string(&events).unwrap();
    assert!(text.contains("lease_acquired"), "{text}");
    assert!(!text.contains(secret), "an event carries the lease secret");
    let got = c.get_sandbox(&id).await.unwrap();
    assert!(!serde_json::to_string(&got).unwrap().contains(secret));
    let mut ok = common::shell("true");
    ok.token = Some(lease.token);
    assert_eq!(c.exec(&id, &ok).await.unwrap().exit_code, 0);
    c.delete_sandbox(&id, Some(lease.token)).await.unwrap();
}

/// Finding 5: a sandbox plants FIFOs, sockets and device nodes and waits for
/// the host to read them. 130 parallel reads of a FIFO are refused at once
/// (never a hang, never `busy`), and the sandbox keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_regular_files_cannot_exhaust_envd() {
    let (ts, _dir) = start_unthrottled().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let (code, out) = sh(
        c,
        &id,
        "mkfifo /workspace/fifo && ln -s /dev/zero /workspace/zero && echo ok",
    )
    .await;
    assert_eq!((code, out.trim()), (0, "ok"));
    let reads = (0..130).map(|_| {
        let c = c.clone();
        let id = id.clone();
        tokio::spawn(async move { c.read_file(&id, "/workspace/fifo").await })
    });
    for r in futures_join(reads).await {
        match r.unwrap_err() {
            ClientError::Api { code, status, .. } => {
                assert_eq!((code, status), (ErrorCode::PermissionDenied, 403))
            }
            other => panic!("{other:?}"),
        }
    }
    for path in ["/dev/zero", "/dev/null", "/proc/self/fd/0"] {
        let e = c.read_file(&id, path).await.unwrap_err();
        assert!(
            matches!(
                e,
                ClientError::Api {
                    status: 400..=499,
                    ..
                }
            ),
            "{path}: {e:?}"
        );
    }
    assert_eq!(sh(c, &id, "echo alive").await.1.trim(), "alive");
    c.write_file(&id, "/workspace/after", b"x".to_vec(), None)
        .await
        .unwrap();
    ts.cleanup().await;
}

/// Finding 9, the inputs that reached the sandbox and came back as 500: a
/// `cwd` that is a file, writing the read-only envd binary, writing and
/// making dirs under `/sys`. Each is a stable 4xx now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_inside_the_sandbox_are_client_errors() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let status = |e: ClientError| match e {
        ClientError::Api { status, code, .. } => (status, code),
        other => panic!("{other:?}"),
    };
    let mut req = common::shell("true");
    req.cwd = Some("/etc/passwd".into());
    let (s, _) = status(c.exec(&id, &req).await.unwrap_err());
    assert_eq!(s, 400, "cwd that is a file");
    let (s, code) = status(
        c.write_file(&id, "/.aviary/envd", b"x".to_vec(), None)
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (s, code),
        (403, ErrorCode::PermissionDenied),
        "read-only envd"
    );
    for path in ["/sys/kernel/x", "/proc/sys/kernel/x"] {
        let (s, _) = status(
            c.write_file(&id, path, b"1".to_vec(), None)
                .await
                .unwrap_err(),
        );
        assert!((400..500).contains(&s), "write {path}: {s}");
        let (s, _) = status(c.mkdir(&id, &format!("{path}d"), None).await.unwrap_err());
        assert!((400..500).contains(&s), "mkdir {path}d: {s}");
    }
    assert_eq!(sh(c, &id, "echo fine").await.1.trim(), "fine");
    ts.cleanup().await;
}

/// Finding 5: a reset never strands a sandbox in `Sanitizing`. With 128
/// long execs holding every general lane of envd, a level-1 reset still
/// fences (the reserved control lane) and ends `Idle`; with envd killed, it
/// answers `sandbox_lost` and the sandbox is in a defined end state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_never_strands_a_sandbox() {
    let (ts, _dir) = start_unthrottled().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    // Fill envd's general lane (128 connections) with long execs; a plain
    // exec is then refused as busy.
    let mut streams = Vec::new();
    for _ in 0..128 {
        streams.push(
            c.exec_stream(&id, &common::shell("sleep 60"))
                .await
                .unwrap(),
        );
    }
    let mut busy = None;
    for _ in 0..100 {
        match c.exec(&id, &common::shell("true")).await {
            Err(ClientError::Api { status, .. }) => {
                busy = Some(status);
                break;
            }
            _ => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
    // `busy`, or `unavailable` when envd refused the connection outright.
    assert_eq!(busy, Some(503), "envd's lane never filled");
    let reset = c.reset(&id, 1, None).await.unwrap();
    assert_eq!(reset.state, aviary_core::SandboxState::Idle);
    drop(streams);
    assert_eq!(sh(c, &id, "echo after").await.1.trim(), "after");

    let pid = ts
        .cp()
        .runtime()
        .envd_endpoint(&id.parse().unwrap())
        .await
        .unwrap()
        .peer_pid;
    let pid = i32::try_from(pid).unwrap();
    // kill(1), as an operator (or a crash) would.
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    match c.reset(&id, 1, None).await.unwrap_err() {
        ClientError::Api { code, status, .. } => {
            assert_eq!((code, status), (ErrorCode::SandboxLost, 409))
        }
        other => panic!("{other:?}"),
    }
    let state = c.get_sandbox(&id).await.unwrap().state;
    assert!(
        matches!(
            state,
            aviary_core::SandboxState::Lost | aviary_core::SandboxState::Failed
        ),
        "{state:?}"
    );
    c.delete_sandbox(&id, None).await.unwrap();
}

async fn futures_join<T: Send + 'static>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<T> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// Every route of the OpenAPI document with a `{...}` parameter, filled with
/// `value`; routes without parameters as they are.
fn routes(openapi: &serde_json::Value, value: &str) -> Vec<(Method, String)> {
    let mut out = Vec::new();
    for (path, ops) in openapi["paths"].as_object().expect("paths") {
        let mut p = String::new();
        let mut rest = path.as_str();
        while let Some(start) = rest.find('{') {
            p.push_str(&rest[..start]);
            let end = rest[start..].find('}').expect("closing brace") + start;
            p.push_str(value);
            rest = &rest[end + 1..];
        }
        p.push_str(rest);
        for m in ops.as_object().expect("operations").keys() {
            let method = match m.as_str() {
                "get" => Method::GET,
                "post" => Method::POST,
                "put" => Method::PUT,
                "delete" => Method::DELETE,
                "patch" => Method::PATCH,
                _ => continue,
            };
            out.push((method, p.clone()));
        }
    }
    out
}

/// Cross-tenant matrix: another tenant's sandbox id on every per-sandbox
/// route answers 404 (or 403 on admin routes), never reveals or changes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_ids_are_not_found_on_every_route() {
    let ts = common::start().await;
    let admin = &ts.client;
    let ka = admin.create_key("owner", false).await.unwrap();
    let kb = admin.create_key("intruder", false).await.unwrap();
    let a = Client::new(&ts.url(), &ka.key);
    let id = common::new_sandbox(&a).await;
    sh(&a, &id, "echo mine > /workspace/f").await;
    let before = a.get_sandbox(&id).await.unwrap();
    let (_, openapi) = admin
        .raw(Method::GET, "/openapi.json", None, None)
        .await
        .unwrap();
    let bodies: [&[u8]; 3] = [
        b"{}",
        br#"{"cmd":["sh","-c","echo pwned > /workspace/f"]}"#,
        br#"{"shell":"echo pwned > /workspace/f","path":"/workspace/f","owner":"x"}"#,
    ];
    let mut checked = 0;
    let mut not_found = 0;
    for (method, path) in routes(&openapi, &id) {
        // Per-sandbox routes; other `{...}` routes name classes, keys, nodes.
        if !path.starts_with(&format!("/v1/sandboxes/{id}")) {
            continue;
        }
        for body in bodies {
            let (status, v) = admin
                .raw(method.clone(), &path, Some(body.to_vec()), Some(&kb.key))
                .await
                .unwrap();
            // 404 for the sandbox; a body the route cannot parse may be
            // refused first (400), which reveals nothing either.
            assert!(
                status == StatusCode::NOT_FOUND
                    || status == StatusCode::FORBIDDEN
                    || status == StatusCode::BAD_REQUEST,
                "{method} {path} as another tenant: {status} {v}"
            );
            if status == StatusCode::NOT_FOUND {
                not_found += 1;
            }
            assert!(!v.to_string().contains("mine"), "{method} {path}: {v}");
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} requests checked");
    // the routes whose input is a query string, a multipart body or a
    // lease token (files, lease, ttl, exec/stdin: 11 of 26) refuse these
    // generic bodies before the tenant check; the rest must reach it
    assert!(
        not_found * 5 >= checked * 2,
        "only {not_found} of {checked} reached the tenant check"
    );
    // The two that matter most, with well-formed bodies: exactly not_found.
    let (status, _) = admin
        .raw(
            Method::GET,
            &format!("/v1/sandboxes/{id}"),
            None,
            Some(&kb.key),
        )
        .await
        .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = admin
        .raw(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(bodies[1].to_vec()),
            Some(&kb.key),
        )
        .await
        .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    // …and a well-formed mark from another tenant never lands
    let (status, _) = admin
        .raw(
            Method::POST,
            &format!("/v1/sandboxes/{id}/taint"),
            Some(br#"{"reason":"pwned"}"#.to_vec()),
            Some(&kb.key),
        )
        .await
        .unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    let after = a.get_sandbox(&id).await.unwrap();
    assert_eq!(after.state, before.state);
    assert!(!after.tainted, "another tenant cannot taint it");
    assert_eq!(sh(&a, &id, "cat /workspace/f").await.1.trim(), "mine");
    ts.cleanup().await;
}

/// Bad-input table over every route: malformed, wrong-typed, oversized,
/// hostile bodies and path parameters never produce a 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_every_route_is_never_a_5xx() {
    let (ts, _dir) = start_unthrottled().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let (_, openapi) = c
        .raw(Method::GET, "/openapi.json", None, None)
        .await
        .unwrap();
    let deep = "[".repeat(10_000);
    let big_arg = format!(r#"{{"argv":["echo","{}"]}}"#, "a".repeat(900_000));
    let bodies: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"[]".to_vec(),
        b"null".to_vec(),
        b"\"x\"".to_vec(),
        b"{".to_vec(),
        b"{\"unknown_field\":1}".to_vec(),
        vec![0xff, 0xfe, 0x00],
        deep.into_bytes(),
        big_arg.into_bytes(),
        br#"{"argv":["true"],"env":{"A":"x\u0000y"}}"#.to_vec(),
        br#"{"argv":["true"],"cwd":"/etc/passwd"}"#.to_vec(),
        br#"{"template":"../../etc","tenant":"../../evil","user":"\u00e9\u00e9"}"#.to_vec(),
        br#"{"owner":"x","ttl_s":18446744073709551615}"#.to_vec(),
    ];
    let params = [
        id.as_str(),
        "..%2F..%2Fetc",
        "sbx-aaaaaaaaaaaaaaaaaaaa",
        "%00",
    ];
    let mut sent = 0;
    let mut fives = Vec::new();
    for p in params {
        for (method, path) in routes(&openapi, p) {
            if path.ends_with("/events/stream") || path.contains("gc") {
                continue; // a live stream; the admin GC sweeps (bodies irrelevant)
            }
            for body in &bodies {
                let send = || c.raw(method.clone(), &path, Some(body.clone()), Some(&ts.key));
                let answer = match send().await {
                    // A pooled connection the server closed after refusing
                    // the previous (oversized) body: send once more.
                    Err(ClientError::Transport(_)) => send().await,
                    other => other,
                };
                sent += 1;
                let (status, v) = match answer {
                    Ok(a) => a,
                    // The server answered 413 and closed before the client
                    // finished sending a large body: refused, not a 5xx.
                    Err(ClientError::Transport(e)) if body.len() > 64 * 1024 => {
                        assert!(e.is_request(), "{method} {path}: {e:?}");
                        continue;
                    }
                    Err(e) => panic!(
                        "{method} {path} body {:?}: {e:?}",
                        String::from_utf8_lossy(&body[..body.len().min(60)])
                    ),
                };
                if status.is_server_error() {
                    fives.push(format!(
                        "{method} {path} body {:?}: {status} {v}",
                        String::from_utf8_lossy(&body[..body.len().min(60)])
                    ));
                }
            }
        }
    }
    assert!(sent > 300, "only {sent} requests sent");
    assert!(
        fives.is_empty(),
        "{} of {sent} gave 5xx:\n{}",
        fives.len(),
        fives.join("\n")
    );
    // …and the server still serves (the table's DELETE with a real id may
    // legitimately have removed the first sandbox).
    let fresh = common::new_sandbox(c).await;
    assert_eq!(sh(c, &fresh, "echo ok").await.1.trim(), "ok");
    ts.cleanup().await;
}

/// Guard for the test above: the raw helper really reaches the routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_read_from_the_live_openapi_document() {
    let ts = common::start().await;
    let (status, openapi) = ts
        .client
        .raw(Method::GET, "/openapi.json", None, None)
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    let all = routes(&openapi, "X");
    assert!(
        all.iter()
            .any(|(m, p)| *m == Method::POST && p == "/v1/sandboxes/X/exec"),
        "{all:?}"
    );
    let _ = ExecRequest::default();
}
