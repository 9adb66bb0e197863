//! API tests against the real server, real crun and the real envd.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::ClientError;
use aviary_core::api::*;
use aviary_core::{ErrorCode, LeaseToken, SandboxState};
use common::shell;
use reqwest::Method;

/// method, path, body, key, expected status, expected error code
type Case<'a> = (
    Method,
    &'a str,
    Option<Vec<u8>>,
    Option<&'a str>,
    u16,
    &'a str,
);

fn code(e: ClientError) -> ErrorCode {
    e.code()
        .unwrap_or_else(|| panic!("expected an API error, got {e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_exec_and_delete() {
    let ts = common::start().await;
    let c = &ts.client;
    let created = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap();
    assert_eq!(created.sandbox.state, SandboxState::Idle);
    assert_eq!(created.sandbox.resource_class, "python-small");
    assert!(created.sandbox.template_digest.starts_with("sha256:"));
    assert_eq!(created.decision.action, "new_sandbox");
    let id = created.sandbox.id.to_string();

    let r = c.exec(&id, &shell("echo hi; echo err >&2")).await.unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (0, "hi\n", "err\n")
    );
    assert!(!r.timed_out && !r.oom_killed);

    let r = c.exec(&id, &shell("exit 7")).await.unwrap();
    assert_eq!(r.exit_code, 7);

    let mut req = ExecRequest {
        cmd: Some(vec![
            "sh".into(),
            "-c".into(),
            "cat; echo \"$FOO\"; pwd".into(),
        ]),
        cwd: Some("/workspace".into()),
        stdin: Some("from stdin\n".into()),
        ..Default::default()
    };
    req.env.insert("FOO".into(), "bar".into());
    let r = c.exec(&id, &req).await.unwrap();
    assert_eq!(r.stdout, "from stdin\nbar\n/workspace\n");

    // the sandbox has its own hostname and only a loopback interface
    let r = c
        .exec(
            &id,
            &shell("hostname; cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "sandbox\nlo\n");

    let gone = c.delete_sandbox(&id, None).await.unwrap();
    assert_eq!(gone.state, SandboxState::Terminated);
    assert_eq!(
        code(c.exec(&id, &shell("true")).await.unwrap_err()),
        ErrorCode::InvalidState
    );
    assert_eq!(
        code(c.delete_sandbox(&id, None).await.unwrap_err()),
        ErrorCode::InvalidState
    );
    // still visible with --all, with its history
    let all = c.list_sandboxes(true).await.unwrap();
    assert!(all.sandboxes.iter().any(|s| s.id.as_str() == id));
    assert!(!c
        .list_sandboxes(false)
        .await
        .unwrap()
        .sandboxes
        .iter()
        .any(|s| s.id.as_str() == id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_kills_the_process_group() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let mut req = shell("sleep 300 & sleep 300; echo never");
    req.timeout_s = Some(0.5);
    let r = c.exec(&id, &req).await.unwrap();
    assert!(r.timed_out);
    assert_ne!(r.exit_code, 0);
    assert!(!r.stdout.contains("never"));
    // no sleep survives: only envd (PID 1) and this ps are left
    let r = c
        .exec(&id, &shell("ps -o pid,comm | grep -c sleep || true"))
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "0", "leftover processes: {}", r.stdout);
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_oom_is_reported() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    // dd touches a 3000 MiB buffer: past the 2 GiB limit of the class
    let r = c
        .exec(&id, &shell("dd if=/dev/zero of=/dev/null bs=3000M count=1"))
        .await
        .unwrap();
    assert!(r.oom_killed, "expected an OOM kill, got {r:?}");
    // the sandbox survives its command's OOM
    assert_eq!(
        c.exec(&id, &shell("echo alive")).await.unwrap().stdout,
        "alive\n"
    );
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_exec_delivers_large_output_incrementally() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    // 64 MiB through the stream
    let req = shell("head -c 67108864 /dev/zero; echo done >&2");
    let mut s = c.exec_stream(&id, &req).await.unwrap();
    let (mut out, mut err, mut chunks) = (0usize, Vec::new(), 0usize);
    let exit = loop {
        match s.next().await.unwrap().unwrap() {
            aviary_client::StreamItem::Stdout(d) => {
                out += d.len();
                chunks += 1;
            }
            aviary_client::StreamItem::Stderr(d) => err.extend(d),
            aviary_client::StreamItem::Exit(r) => break r,
        }
    };
    assert_eq!(exit.exit_code, 0);
    assert_eq!(out, 64 << 20);
    assert!(chunks > 10, "output came in {chunks} chunks");
    assert_eq!(err, b"done\n");
    // the non-streaming answer is capped and says so
    let r = c
        .exec(&id, &shell("head -c 3000000 /dev/zero | tr '\\0' a"))
        .await
        .unwrap();
    assert!(r.truncated);
    assert_eq!(r.stdout.len(), 1 << 20);
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_round_trip_and_confinement() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let data = b"a,b\n1,2\n3,4\n".to_vec();
    assert_eq!(
        c.write_file(&id, "/workspace/data.csv", data.clone(), None)
            .await
            .unwrap(),
        data.len() as u64
    );
    assert_eq!(c.read_file(&id, "/workspace/data.csv").await.unwrap(), data);
    let r = c
        .exec(&id, &shell("wc -l < /workspace/data.csv"))
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "3");
    c.mkdir(&id, "/workspace/a/b", None).await.unwrap();
    let st = c.stat(&id, "/workspace/a/b").await.unwrap();
    assert_eq!(st.kind, "dir");
    let ls = c.list_files(&id, "/workspace").await.unwrap();
    let names: Vec<_> = ls.entries.iter().map(|e| e.name.as_str()).collect();
    assert!(
        names.contains(&"data.csv") && names.contains(&"a"),
        "{names:?}"
    );
    c.remove(&id, "/workspace/a", true, None).await.unwrap();
    assert_eq!(
        code(c.stat(&id, "/workspace/a").await.unwrap_err()),
        ErrorCode::NotFound
    );

    // traversal and relative paths are refused before anything is touched
    for bad in [
        "../etc/passwd",
        "/workspace/../../etc/passwd",
        "workspace/x",
        "",
    ] {
        let e = c.read_file(&id, bad).await.unwrap_err();
        assert_eq!(code(e), ErrorCode::InvalidPath, "path {bad:?}");
        let e = c
            .write_file(&id, bad, b"x".to_vec(), None)
            .await
            .unwrap_err();
        assert_eq!(code(e), ErrorCode::InvalidPath, "path {bad:?}");
    }
    // a symlink pointing "out" resolves inside the sandbox's own root:
    // the host's files are unreachable
    c.exec(
        &id,
        &shell("ln -s / /workspace/root && ln -s /../../../ /workspace/up"),
    )
    .await
    .unwrap();
    let host_hostname = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
    for p in ["/workspace/root/etc/hostname", "/workspace/up/etc/hostname"] {
        match c.read_file(&id, p).await {
            Ok(b) => assert_ne!(
                String::from_utf8_lossy(&b),
                host_hostname,
                "{p} leaked the host file"
            ),
            Err(e) => assert!(matches!(
                code(e),
                ErrorCode::NotFound | ErrorCode::InvalidPath
            )),
        }
    }
    // the template is never written
    let template_root = aviary_templates::TemplateStore::open(ts.server_cfg().templates_root())
        .unwrap()
        .get("busybox")
        .unwrap()
        .unwrap()
        .rootfs;
    c.write_file(&id, "/bin/evil", b"x".to_vec(), None)
        .await
        .unwrap();
    assert!(!template_root.join("bin/evil").exists());
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_fence_every_mutating_call() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let l1 = c.acquire_lease(&id, "agent-a", Some(60)).await.unwrap();
    assert_eq!(
        c.get_sandbox(&id).await.unwrap().state,
        SandboxState::Leased
    );
    // a second acquire is refused while the lease is live
    assert_eq!(
        code(c.acquire_lease(&id, "agent-b", None).await.unwrap_err()),
        ErrorCode::LeaseHeld
    );

    // missing / wrong token refused on every mutating call
    assert_eq!(
        code(c.exec(&id, &shell("true")).await.unwrap_err()),
        ErrorCode::LeaseRequired
    );
    let mut with = shell("echo ok");
    with.token = Some(LeaseToken::generate(l1.token.fence() + 1));
    assert_eq!(
        code(c.exec(&id, &with).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    assert_eq!(
        code(
            c.write_file(&id, "/workspace/x", b"1".to_vec(), None)
                .await
                .unwrap_err()
        ),
        ErrorCode::LeaseRequired
    );
    assert_eq!(
        code(c.mkdir(&id, "/workspace/d", None).await.unwrap_err()),
        ErrorCode::LeaseRequired
    );
    assert_eq!(
        code(c.remove(&id, "/workspace", true, None).await.unwrap_err()),
        ErrorCode::LeaseRequired
    );
    assert_eq!(
        code(c.delete_sandbox(&id, None).await.unwrap_err()),
        ErrorCode::LeaseRequired
    );
    assert_eq!(
        code(
            c.delete_sandbox(&id, Some(LeaseToken::generate(0)))
                .await
                .unwrap_err()
        ),
        ErrorCode::StaleToken
    );
    // reads need no token
    c.list_files(&id, "/").await.unwrap();

    with.token = Some(l1.token);
    assert_eq!(c.exec(&id, &with).await.unwrap().stdout, "ok\n");
    c.write_file(&id, "/workspace/x", b"1".to_vec(), Some(l1.token))
        .await
        .unwrap();

    let renewed = c.renew_lease(&id, l1.token, Some(120)).await.unwrap();
    assert_eq!(renewed.token, l1.token);
    assert!(renewed.expires_at > l1.expires_at);
    assert_eq!(
        code(
            c.renew_lease(&id, LeaseToken::generate(l1.token.fence() + 7), None)
                .await
                .unwrap_err()
        ),
        ErrorCode::StaleToken
    );

    c.release_lease(&id, l1.token).await.unwrap();
    assert_eq!(c.get_sandbox(&id).await.unwrap().state, SandboxState::Idle);
    // unleased: tokenless calls work again, the old token is stale
    c.exec(&id, &shell("true")).await.unwrap();
    assert_eq!(
        code(c.exec(&id, &with).await.unwrap_err()),
        ErrorCode::StaleToken
    );

    let l2 = c.acquire_lease(&id, "agent-b", Some(1)).await.unwrap();
    assert!(l2.token > l1.token, "tokens must strictly increase");
    // expiry frees the sandbox and fences the expired holder out
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert_eq!(c.get_sandbox(&id).await.unwrap().state, SandboxState::Idle);
    let mut stale = shell("true");
    stale.token = Some(l2.token);
    assert_eq!(
        code(c.exec(&id, &stale).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    let l3 = c.acquire_lease(&id, "agent-c", None).await.unwrap();
    assert!(l3.token > l2.token);
    c.delete_sandbox(&id, Some(l3.token)).await.unwrap();

    let evs = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    let kinds: Vec<_> = evs.iter().map(|e| e.event_type.as_str()).collect();
    for k in ["lease_acquired", "lease_released", "lease_expired"] {
        assert!(kinds.contains(&k), "missing {k} in {kinds:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_at_create_and_fencing_inside_envd() {
    let ts = common::start().await;
    let c = &ts.client;
    let created = c
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "me".into(),
                ttl_s: Some(30),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let lease = created.lease.unwrap();
    assert_eq!(created.sandbox.state, SandboxState::Leased);
    assert_eq!(created.sandbox.lease_owner.as_deref(), Some("me"));
    let id = created.sandbox.id;
    // envd itself refuses a stale token, even if a caller got past the API
    let sock = ts
        .server_cfg()
        .runtime_state_dir()
        .join(id.as_str())
        .join("control/envd.sock");
    let envd = aviary_envd_proto::EnvdClient::new(sock);
    let spec = aviary_envd_proto::ExecSpec {
        argv: vec!["true".into()],
        cwd: None,
        env: vec![],
        stdin: None,
        timeout: None,
        user: Default::default(),
    };
    let e = envd
        .exec_collect(spec.clone(), Some(lease.token.fence() + 1))
        .await
        .expect_err("stale token must fail");
    assert!(
        matches!(e, aviary_envd_proto::EnvdError::StaleToken),
        "{e:?}"
    );
    let e = envd
        .exec_collect(spec.clone(), None)
        .await
        .expect_err("missing token must fail");
    assert!(
        matches!(e, aviary_envd_proto::EnvdError::LeaseRequired),
        "{e:?}"
    );
    let ok = envd
        .exec_collect(spec, Some(lease.token.fence()))
        .await
        .unwrap();
    assert_eq!(ok.exit.exit_code, 0);
    c.delete_sandbox(id.as_str(), Some(lease.token))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cannot_see_each_other() {
    let ts = common::start().await;
    let admin = &ts.client;
    let k1 = admin.create_key("tenant-one", false).await.unwrap();
    let k2 = admin.create_key("tenant-two", false).await.unwrap();
    let one = aviary_client::Client::new(&ts.url(), &k1.key);
    let two = aviary_client::Client::new(&ts.url(), &k2.key);
    let id = common::new_sandbox(&one).await;
    assert_eq!(one.get_sandbox(&id).await.unwrap().tenant, "tenant-one");

    assert_eq!(
        code(two.get_sandbox(&id).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(two.exec(&id, &shell("true")).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(two.read_file(&id, "/etc/hostname").await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(
            two.write_file(&id, "/workspace/x", b"x".to_vec(), None)
                .await
                .unwrap_err()
        ),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(two.acquire_lease(&id, "thief", None).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(two.delete_sandbox(&id, None).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(two.events(Some(&id), None, None).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert!(two.list_sandboxes(true).await.unwrap().sandboxes.is_empty());
    assert!(two
        .events(None, None, None)
        .await
        .unwrap()
        .events
        .is_empty());
    // non-admins cannot mint keys
    assert_eq!(
        code(two.create_key("tenant-one", true).await.unwrap_err()),
        ErrorCode::Forbidden
    );
    // nothing changed for the owner
    assert_eq!(
        one.get_sandbox(&id).await.unwrap().state,
        SandboxState::Idle
    );
    one.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_4xx_and_changes_nothing() {
    let ts = common::start().await;
    let c = &ts.client;
    let key = ts.key.clone();
    let before = c.list_sandboxes(true).await.unwrap().sandboxes.len();
    let long_key = "x".repeat(10_000);
    let cases: Vec<Case> = vec![
        (
            Method::POST,
            "/v1/sandboxes",
            Some(b"{not json".to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(br#"{"tempalte":"x"}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(br#"{"ttl_s":"soon"}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(br#"{"ttl_s":0}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(br#"{"class":"gpu-huge"}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(br#"{"template":"nope"}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(br#"{"network":"open"}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            // just over the 1 MiB limit, so the unread rest fits in socket
            // buffers and the client reads the answer before the close
            Some(
                format!("{{\"user_id\":\"{}\"}}", "u".repeat((1 << 20) + (64 << 10))).into_bytes(),
            ),
            Some(&key),
            413,
            "payload_too_large",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(b"{}".to_vec()),
            None,
            401,
            "unauthorized",
        ),
        (
            Method::POST,
            "/v1/sandboxes",
            Some(b"{}".to_vec()),
            Some("avk_wrong"),
            401,
            "unauthorized",
        ),
        (
            Method::GET,
            "/v1/sandboxes",
            None,
            Some(long_key.as_str()),
            401,
            "unauthorized",
        ),
        (
            Method::GET,
            "/v1/sandboxes/sbx-aaaaaaaaaaaaaaaaaaaa",
            None,
            Some(&key),
            404,
            "not_found",
        ),
        (
            Method::GET,
            "/v1/sandboxes/..%2F..%2Fetc",
            None,
            Some(&key),
            404,
            "not_found",
        ),
        (
            Method::GET,
            "/v1/sandboxes?bogus=1",
            None,
            Some(&key),
            400,
            "invalid_request",
        ),
        (Method::GET, "/v1/nope", None, Some(&key), 404, "not_found"),
        (
            Method::POST,
            "/v1/sandboxes/sbx-aaaaaaaaaaaaaaaaaaaa/exec",
            Some(br#"{"shell":"true","cmd":["x"]}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/sandboxes/sbx-aaaaaaaaaaaaaaaaaaaa/lease",
            Some(br#"{"owner":""}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
        (
            Method::POST,
            "/v1/keys",
            Some(br#"{"tenant":"t","extra":1}"#.to_vec()),
            Some(&key),
            400,
            "invalid_request",
        ),
    ];
    for (m, path, body, auth, status, want) in cases {
        // A server that refuses a body it did not read closes the connection;
        // a client still writing can then miss the answer: ask again.
        let mut answer = c.raw(m.clone(), path, body.clone(), auth).await;
        for _ in 0..5 {
            if answer.is_ok() {
                break;
            }
            answer = c.raw(m.clone(), path, body.clone(), auth).await;
        }
        let (got, v) = answer.unwrap();
        assert_eq!(got.as_u16(), status, "{m} {path}: {v}");
        assert_eq!(v["error"]["code"], want, "{m} {path}: {v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|s| !s.is_empty()));
    }
    assert_eq!(
        c.list_sandboxes(true).await.unwrap().sandboxes.len(),
        before
    );

    // bad exec bodies against a real sandbox change nothing in it
    let id = common::new_sandbox(c).await;
    for body in [
        br#"{"cmd":[]}"#.to_vec(),
        br#"{"shell":"true","timeout_s":-1}"#.to_vec(),
        br#"{"shell":"true","cwd":"relative"}"#.to_vec(),
        br#"{"shell":"touch /workspace/should-not-exist","unknown":1}"#.to_vec(),
    ] {
        let (got, v) = c
            .raw(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(body),
                Some(&key),
            )
            .await
            .unwrap();
        assert_eq!(got.as_u16(), 400, "{v}");
    }
    assert_eq!(
        code(
            c.stat(&id, "/workspace/should-not-exist")
                .await
                .unwrap_err()
        ),
        ErrorCode::NotFound
    );
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_record_every_transition() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    c.delete_sandbox(&id, None).await.unwrap();
    let evs = c.events(Some(&id), None, None).await.unwrap().events;
    let path: Vec<_> = evs.iter().filter_map(|e| e.new_state).collect();
    use SandboxState::*;
    assert_eq!(
        path,
        vec![
            Requested,
            Planning,
            Allocating,
            Provisioning,
            Locking,
            Idle,
            Sanitizing,
            Terminated
        ]
    );
    for w in evs.windows(2) {
        assert!(w[0].id < w[1].id);
        if let (Some(a), Some(b)) = (w[1].old_state, w[1].new_state) {
            assert!(a.can_transition_to(b) || a == b, "{a} -> {b}");
        }
    }
    // following with `after` returns only newer events
    let last = evs.last().unwrap().id;
    assert!(c
        .events(Some(&id), Some(last), None)
        .await
        .unwrap()
        .events
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_health_and_metrics() {
    let ts = common::start().await;
    let http = reqwest::Client::new();
    let doc: serde_json::Value = http
        .get(format!("{}/openapi.json", ts.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}/exec",
        "/v1/sandboxes/{id}/lease",
        "/v1/sandboxes/{id}/files",
        "/v1/events",
        "/v1/templates",
    ] {
        assert!(paths.contains_key(p), "openapi lacks {p}");
    }
    assert!(doc["components"]["schemas"]["CreateSandboxRequest"].is_object());
    assert_eq!(
        http.get(format!("{}/healthz", ts.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        http.get(format!("{}/readyz", ts.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let m = ts.client.metrics().await.unwrap();
    assert!(m.contains("aviary_sandboxes_created_total"));

    // real traffic shows up: a latency histogram per route template, the
    // sandboxes by state, lease operations and a fence refusal
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let lease = c.acquire_lease(&id, "m", None).await.unwrap();
    let refused = c.exec(&id, &shell("true")).await.unwrap_err();
    assert_eq!(code(refused), ErrorCode::LeaseRequired);
    c.release_lease(&id, lease.token).await.unwrap();
    let m = ts.client.metrics().await.unwrap();
    let line = |needle: &str| {
        m.lines()
            .find(|l| l.starts_with(needle))
            .unwrap_or_else(|| panic!("no line starting {needle:?} in\n{m}"))
            .to_owned()
    };
    let count = |needle: &str| -> f64 { line(needle).rsplit(' ').next().unwrap().parse().unwrap() };
    assert!(
        count("aviary_http_request_duration_seconds_count{method=\"POST\",route=\"/v1/sandboxes\",status=\"2xx\"}") >= 1.0
    );
    assert!(
        count("aviary_http_request_duration_seconds_count{method=\"POST\",route=\"/v1/sandboxes/{id}/exec\",status=\"4xx\"}") >= 1.0,
        "the refused exec, under its route template (never the raw id)"
    );
    assert!(!m.contains(&id), "no sandbox id in a label");
    assert!(count("aviary_sandboxes{state=\"Idle\"}") >= 1.0);
    assert_eq!(count("aviary_lease_operations_total{op=\"acquired\"}"), 1.0);
    assert_eq!(count("aviary_lease_operations_total{op=\"released\"}"), 1.0);
    assert!(count("aviary_fence_refusals_total") >= 1.0);
    assert!(m.ends_with("# EOF\n"));
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reattaches_and_keeps_tokens_monotonic() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let mut ts = common::start_on(&data, "busybox").await;
    let c = ts.client.clone();
    let id = common::new_sandbox(&c).await;
    c.write_file(&id, "/workspace/keep", b"kept".to_vec(), None)
        .await
        .unwrap();
    let l1 = c.acquire_lease(&id, "a", None).await.unwrap();
    c.release_lease(&id, l1.token).await.unwrap();
    let doomed = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox
        .id;
    ts.stop().await;
    // the runtime loses one sandbox while the server is down
    ts.cp_runtime_destroy(&doomed).await;

    let ts2 = common::start_on(&data, "busybox").await;
    let c2 = &ts2.client;
    assert_eq!(ts2.key, ts.key, "admin key survives restarts");
    assert_eq!(c2.read_file(&id, "/workspace/keep").await.unwrap(), b"kept");
    let l2 = c2.acquire_lease(&id, "b", None).await.unwrap();
    assert!(l2.token > l1.token);
    let mut stale = shell("true");
    stale.token = Some(l1.token);
    assert_eq!(
        code(c2.exec(&id, &stale).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    c2.delete_sandbox(&id, Some(l2.token)).await.unwrap();
    let lost = c2.get_sandbox(doomed.as_str()).await.unwrap();
    assert_eq!(lost.state, SandboxState::Terminated);
    let evs = c2
        .events(Some(doomed.as_str()), None, None)
        .await
        .unwrap()
        .events;
    assert!(evs.iter().any(|e| e.new_state == Some(SandboxState::Lost)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expiry_destroys_the_sandbox() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = c
        .create_sandbox(&CreateSandboxRequest {
            ttl_s: Some(1),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox
        .id
        .to_string();
    let mut state = SandboxState::Idle;
    for _ in 0..60 {
        state = c.get_sandbox(&id).await.unwrap().state;
        if state == SandboxState::Terminated {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(state, SandboxState::Terminated);
}

/// Every answer carries its request id: the client's when usable (and the
/// events record it), a new one otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_echo_the_request_id() {
    let ts = common::start().await;
    let http = reqwest::Client::new();
    let get = |id: Option<String>| {
        let mut r = http
            .get(format!("{}/v1/sandboxes", ts.url()))
            .bearer_auth(&ts.key);
        if let Some(id) = id {
            r = r.header("x-request-id", id);
        }
        r.send()
    };
    let echoed = |r: &reqwest::Response| {
        r.headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let r = get(Some("trace-42".into())).await.unwrap();
    assert_eq!(echoed(&r).as_deref(), Some("trace-42"));
    let r = get(None).await.unwrap();
    let made = echoed(&r).expect("a new id");
    assert!(made.starts_with("req"), "{made}");
    let r = get(Some("x".repeat(200))).await.unwrap();
    let replaced = echoed(&r).expect("a new id");
    assert!(replaced.starts_with("req"), "{replaced}");
    // errors carry it too, and the events record the same id
    let r = http
        .post(format!("{}/v1/sandboxes", ts.url()))
        .bearer_auth(&ts.key)
        .header("x-request-id", "create-7")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(echoed(&r).as_deref(), Some("create-7"));
    let created: serde_json::Value = r.json().await.unwrap();
    let sandbox = created.get("sandbox").unwrap_or(&created);
    let id = sandbox["id"].as_str().expect("created").to_owned();
    let events = ts.client.events(Some(&id), None, Some(100)).await.unwrap();
    assert!(
        events
            .events
            .iter()
            .any(|e| e.request_id.as_deref() == Some("create-7")),
        "{:?}",
        events.events
    );
    let r = http
        .get(format!(
            "{}/v1/sandboxes/sbx-aaaaaaaaaaaaaaaaaaaa",
            ts.url()
        ))
        .bearer_auth(&ts.key)
        .header("x-request-id", "missing-1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(echoed(&r).as_deref(), Some("missing-1"));
    ts.client.delete_sandbox(&id, None).await.unwrap();
}

/// Issue 13, bug 4: ordinary mistakes are never a 5xx. A command that cannot
/// start exits as in a shell (127 not found, 126 not executable; never
/// Aviary's own exit codes), and deleting a non-empty directory is a 4xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordinary_mistakes_are_shell_exits_or_4xx() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let missing = aviary_core::api::ExecRequest {
        cmd: Some(vec!["no-such-binary".into()]),
        ..Default::default()
    };
    let r = c.exec(&id, &missing).await.unwrap();
    assert_eq!(r.exit_code, 127, "{r:?}");
    assert!(r.stderr.contains("command not found"), "{r:?}");
    c.exec(
        &id,
        &common::shell(
            "echo echo hi > /workspace/x.sh; mkdir -p /workspace/d; touch /workspace/d/f",
        ),
    )
    .await
    .unwrap();
    let not_exec = aviary_core::api::ExecRequest {
        cmd: Some(vec!["/workspace/x.sh".into()]),
        ..Default::default()
    };
    let r = c.exec(&id, &not_exec).await.unwrap();
    assert_eq!(r.exit_code, 126, "{r:?}");
    let (status, body) = c
        .raw(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}/files?path=/workspace/d"),
            None,
            Some(&ts.key),
        )
        .await
        .unwrap();
    assert!(status.is_client_error(), "{status} {body}");
    c.delete_sandbox(&id, None).await.unwrap();
}

/// Issue 13, bug 6: the newest events by default, and following them over
/// a server-side stream (as they are recorded, from the registry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newest_events_and_a_followed_stream() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let all = c.events(Some(&id), None, Some(1000)).await.unwrap().events;
    assert!(all.len() >= 3, "{all:?}");
    let last_two = c.newest_events(Some(&id), 2).await.unwrap().events;
    let want: Vec<i64> = all[all.len() - 2..].iter().map(|e| e.id).collect();
    assert_eq!(
        last_two.iter().map(|e| e.id).collect::<Vec<_>>(),
        want,
        "the newest, oldest first"
    );
    // follow from now: only what happens next arrives, as it happens
    let mut stream = c.follow_events(Some(&id), None).await.unwrap();
    c.sandbox_action(&id, "pause", None).await.unwrap();
    c.sandbox_action(&id, "resume", None).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let ev = tokio::time::timeout(std::time::Duration::from_secs(10), stream.next())
            .await
            .expect("pushed within 10 s")
            .unwrap()
            .expect("an event");
        assert!(ev.id > all.last().unwrap().id, "nothing old replayed");
        seen.push(ev.event_type);
    }
    assert_eq!(seen, ["paused", "resumed"]);
    // another tenant cannot follow this sandbox
    let other = c.create_key("tenant-b", false).await.unwrap();
    let b = aviary_client::Client::new(&ts.url(), &other.key);
    let e = match b.follow_events(Some(&id), None).await {
        Ok(_) => panic!("another tenant followed the sandbox"),
        Err(e) => e,
    };
    assert_eq!(e.code(), Some(aviary_core::ErrorCode::NotFound), "{e}");
    c.delete_sandbox(&id, None).await.unwrap();
}

/// Issue 13, bug 11: `files/list?recursive=true` lists the whole tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recursive_listing_lists_the_whole_tree() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    c.exec(
        &id,
        &common::shell("mkdir -p /workspace/t/a/b && touch /workspace/t/top /workspace/t/a/mid /workspace/t/a/b/deep && ln -s /etc /workspace/t/link"),
    )
    .await
    .unwrap();
    let (status, body) = c
        .raw(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/files/list?path=/workspace/t&recursive=true"),
            None,
            Some(&ts.key),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let mut paths: Vec<&str> = body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    paths.sort_unstable();
    assert_eq!(
        paths,
        [
            "/workspace/t/a",
            "/workspace/t/a/b",
            "/workspace/t/a/b/deep",
            "/workspace/t/a/mid",
            "/workspace/t/link",
            "/workspace/t/top"
        ],
        "the symlink listed, not followed"
    );
    assert_eq!(body["truncated"], false);
    // without the flag, one level
    let flat = c.list_files(&id, "/workspace/t").await.unwrap();
    assert_eq!(flat.entries.len(), 3);
    c.delete_sandbox(&id, None).await.unwrap();
}

/// `exec/stdin`: the process reads its stdin as the client sends it (the
/// second line is only sent once the answer to the first has arrived, so a
/// server that buffered the whole body would never answer), bytes arrive
/// unchanged, and malformed bodies are 4xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_streamed_stdin() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;

    // an interactive exchange: line, answer, line, answer
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(4);
    let input = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let req = shell("read a; echo got-$a; read b; echo got-$b >&2");
    let mut s = c.exec_stream_piped(&id, &req, input).await.unwrap();
    tx.send(Ok(bytes::Bytes::from_static(b"one\n")))
        .await
        .unwrap();
    let mut out = Vec::new();
    while !out.ends_with(b"got-one\n") {
        match s.next().await.unwrap().unwrap() {
            aviary_client::StreamItem::Stdout(d) => out.extend(d),
            other => panic!("before the second line: {other:?}"),
        }
    }
    tx.send(Ok(bytes::Bytes::from_static(b"two\n")))
        .await
        .unwrap();
    drop(tx);
    let mut err = Vec::new();
    let exit = loop {
        match s.next().await.unwrap().unwrap() {
            aviary_client::StreamItem::Stdout(d) => out.extend(d),
            aviary_client::StreamItem::Stderr(d) => err.extend(d),
            aviary_client::StreamItem::Exit(r) => break r,
        }
    };
    assert_eq!(
        (exit.exit_code, out.as_slice(), err.as_slice()),
        (0, &b"got-one\n"[..], &b"got-two\n"[..])
    );

    // 3 MiB of every byte value, in odd-sized chunks: the same bytes arrive
    let data: Vec<u8> = (0..3 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let chunks: Vec<std::io::Result<bytes::Bytes>> = data
        .chunks(7919)
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    let mut s = c
        .exec_stream_piped(
            &id,
            &shell("cat > /workspace/in.bin; wc -c < /workspace/in.bin"),
            futures_util::stream::iter(chunks),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    let exit = loop {
        match s.next().await.unwrap().unwrap() {
            aviary_client::StreamItem::Stdout(d) => out.extend(d),
            aviary_client::StreamItem::Stderr(_) => {}
            aviary_client::StreamItem::Exit(r) => break r,
        }
    };
    assert_eq!(exit.exit_code, 0);
    assert_eq!(
        String::from_utf8(out).unwrap().trim(),
        data.len().to_string()
    );
    assert_eq!(c.read_file(&id, "/workspace/in.bin").await.unwrap(), data);

    // bad bodies: not multipart, parts missing or out of order, bad JSON,
    // stdin given twice; none runs anything
    let http = reqwest::Client::new();
    let url = format!("{}/v1/sandboxes/{id}/exec/stdin", ts.url());
    let send = |form: Option<reqwest::multipart::Form>, body: Option<&'static str>| {
        let mut rb = http.post(&url).bearer_auth(&ts.key);
        if let Some(f) = form {
            rb = rb.multipart(f);
        }
        if let Some(b) = body {
            rb = rb.header("content-type", "application/json").body(b);
        }
        async move {
            let r = rb.send().await.unwrap();
            let status = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap();
            (
                status,
                v["error"]["code"].as_str().unwrap_or_default().to_owned(),
            )
        }
    };
    use reqwest::multipart::{Form, Part};
    let touch = r#"{"shell": "touch /workspace/ran"}"#;
    for (what, form, body) in [
        ("json body", None, Some(touch)),
        ("no parts", Some(Form::new()), None),
        (
            "stdin first",
            Some(
                Form::new()
                    .part("stdin", Part::bytes(&b"x"[..]))
                    .text("request", touch),
            ),
            None,
        ),
        (
            "no stdin part",
            Some(Form::new().text("request", touch)),
            None,
        ),
        (
            "bad json",
            Some(
                Form::new()
                    .text("request", "{nope")
                    .part("stdin", Part::bytes(&b""[..])),
            ),
            None,
        ),
        (
            "unknown field",
            Some(
                Form::new()
                    .text("request", r#"{"shell": "true", "bogus": 1}"#)
                    .part("stdin", Part::bytes(&b""[..])),
            ),
            None,
        ),
        (
            "stdin twice",
            Some(
                Form::new()
                    .text(
                        "request",
                        r#"{"shell": "touch /workspace/ran", "stdin": "x"}"#,
                    )
                    .part("stdin", Part::bytes(&b""[..])),
            ),
            None,
        ),
    ] {
        let (status, code) = send(form, body).await;
        assert_eq!((status, code.as_str()), (400, "invalid_request"), "{what}");
    }
    let r = c
        .exec(&id, &shell("test -e /workspace/ran; echo $?"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "1\n", "a refused request ran nothing");
    // another tenant's sandbox is not found, and no key is 401
    let other = c.create_key("mallory", false).await.unwrap();
    let r = http
        .post(&url)
        .bearer_auth(&other.key)
        .multipart(
            Form::new()
                .text("request", touch)
                .part("stdin", Part::bytes(&b""[..])),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let r = http
        .post(&url)
        .multipart(
            Form::new()
                .text("request", touch)
                .part("stdin", Part::bytes(&b""[..])),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    c.delete_sandbox(&id, None).await.unwrap();
}

/// `GET /v1/metrics/history`: the server samples its own figures (sandboxes
/// by state, live compute, creates served, pool hits) on an interval, for
/// the admin or the metrics token only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_history_samples_the_servers_own_figures() {
    let (ts, _dir) =
        common::start_edited(|cfg| cfg.control.metrics_history_interval_ms = 200).await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/metrics/history", ts.url());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let h = loop {
        let h: serde_json::Value = http
            .get(&url)
            .bearer_auth(&ts.key)
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap()
            .json()
            .await
            .unwrap();
        let newest = h["samples"].as_array().unwrap().last().cloned();
        if newest.as_ref().is_some_and(|s| {
            s["creates_served"].as_u64() >= Some(1) && s["by_state"]["Idle"].as_u64() >= Some(1)
        }) {
            break h;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no sample saw the create: {h}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(h["interval_ms"], 200);
    let samples = h["samples"].as_array().unwrap();
    let newest = samples.last().unwrap();
    assert!(newest["live"].as_u64().unwrap() >= 1, "{newest}");
    assert!(
        newest["create_seconds_sum"].as_f64().unwrap() > 0.0,
        "{newest}"
    );
    // oldest first, counters never go down
    for w in samples.windows(2) {
        assert!(w[0]["at"].as_str() <= w[1]["at"].as_str(), "{h}");
        assert!(
            w[0]["creates_served"].as_u64() <= w[1]["creates_served"].as_u64(),
            "{h}"
        );
    }
    // a tenant key may not read it; no key is 401; a query parameter is 400
    let tenant = c.create_key("history-tenant", false).await.unwrap();
    let s = |r: reqwest::Response| r.status().as_u16();
    assert_eq!(
        s(http
            .get(&url)
            .bearer_auth(&tenant.key)
            .send()
            .await
            .unwrap()),
        403
    );
    assert_eq!(s(http.get(&url).send().await.unwrap()), 401);
    assert_eq!(
        s(http
            .get(format!("{url}?since=0"))
            .bearer_auth(&ts.key)
            .send()
            .await
            .unwrap()),
        400
    );
    c.delete_sandbox(&id, None).await.unwrap();
}
