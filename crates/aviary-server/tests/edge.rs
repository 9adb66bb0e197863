//! The HTTP edge under attack (security issue 7, findings 4, 9, 10, 12, 13):
//! connection floods and slow clients on loopback (bounded, a few seconds),
//! per-key rate limits, bad inputs that must be 4xx and never reach a sandbox,
//! tenant names, key revocation, and who may read metrics, pools and nodes.
#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::ExecRequest;
use aviary_core::ErrorCode;
use reqwest::Method;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A server whose edge limits `edit` changes.
async fn start_with_edge(
    edit: impl FnOnce(&mut aviary_config::EdgeSettings),
) -> (common::TestServer, tempfile::TempDir) {
    common::start_edited(|cfg| edit(&mut cfg.control.settings.server.edge)).await
}

fn code(e: aviary_client::ClientError) -> ErrorCode {
    e.code().unwrap_or_else(|| panic!("no API error: {e:?}"))
}

fn gauge(ts: &common::TestServer, name: &str) -> u64 {
    let text = ts.cp().metrics.render(0, &[]);
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

/// Waits (bounded) until the server has accepted `n` connections.
async fn wait_open(ts: &common::TestServer, n: u64) {
    for _ in 0..200 {
        if gauge(ts, "aviary_http_connections_open") >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "server accepted {} connections, expected {n}",
        gauge(ts, "aviary_http_connections_open")
    );
}

/// Reads until the peer closes (or resets) the connection; what it sent.
async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(within, read_all)
        .await
        .expect("the server kept the connection open");
    out
}

async fn half_sent(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_half_sent_connections_are_closed_and_healthz_still_answers() {
    let (ts, _dir) = start_with_edge(|e| {
        e.header_read_timeout_ms = 500;
        e.max_connections = 400;
        e.max_connections_per_ip = 400;
    })
    .await;
    let addr = ts.server.as_ref().unwrap().addr;
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(half_sent(addr).await);
    }
    // a kept-alive connection that went quiet after one request counts too
    let mut quiet = TcpStream::connect(addr).await.unwrap();
    quiet
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    wait_open(&ts, 301).await;
    ts.client.healthz().await.unwrap();

    for s in &mut idle {
        let sent = read_until_closed(s, Duration::from_secs(5)).await;
        // hyper closes on the header timeout; it may say 408 first
        let text = String::from_utf8_lossy(&sent);
        assert!(
            sent.is_empty() || text.starts_with("HTTP/1.1 408"),
            "{text}"
        );
    }
    let sent = read_until_closed(&mut quiet, Duration::from_secs(5)).await;
    assert!(String::from_utf8_lossy(&sent).starts_with("HTTP/1.1 200"));
    // a fresh client: the shared one's pooled connection went idle past the
    // (tiny) timeout too
    let fresh = aviary_client::Client::new(&ts.url(), &ts.key);
    fresh.healthz().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_refused_at_once() {
    let (ts, _dir) = start_with_edge(|e| {
        e.header_read_timeout_ms = 1500;
        e.max_connections = 20;
    })
    .await;
    let addr = ts.server.as_ref().unwrap().addr;
    let mut idle = Vec::new();
    for _ in 0..20 {
        idle.push(half_sent(addr).await);
    }
    wait_open(&ts, 20).await;
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let _ = extra
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let answer = read_until_closed(&mut extra, Duration::from_secs(1)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || text.starts_with("HTTP/1.1 503"),
        "over the cap: {text}"
    );
    assert!(gauge(&ts, "aviary_http_connections_refused_total") >= 1);
    // the idle ones time out and free their slots
    for s in &mut idle {
        read_until_closed(s, Duration::from_secs(5)).await;
    }
    aviary_client::Client::new(&ts.url(), &ts.key)
        .healthz()
        .await
        .unwrap();
}

/// A full `GET /healthz` from `from`; the server's answer.
async fn healthz_from(from: &str, addr: std::net::SocketAddr) -> String {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = sock.connect(addr).await.unwrap();
    let _ = s
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await;
    String::from_utf8_lossy(&read_until_closed(&mut s, Duration::from_secs(2)).await).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_address_cannot_take_every_connection() {
    let (ts, _dir) = start_with_edge(|e| {
        e.header_read_timeout_ms = 5000;
        e.max_connections = 100;
        e.max_connections_per_ip = 10;
    })
    .await;
    let addr = ts.server.as_ref().unwrap().addr;
    let mut idle = Vec::new();
    for _ in 0..10 {
        idle.push(half_sent(addr).await);
    }
    wait_open(&ts, 10).await;
    let refused = healthz_from("127.0.0.1", addr).await;
    assert!(
        refused.is_empty() || refused.starts_with("HTTP/1.1 503"),
        "{refused}"
    );
    // another address (loopback is all of 127/8) is still served
    let served = healthz_from("127.0.0.2", addr).await;
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_fails_instead_of_holding_the_connection() {
    let (ts, _dir) = start_with_edge(|e| e.body_read_timeout_ms = 300).await;
    let addr = ts.server.as_ref().unwrap().addr;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"ttl_s\":",
        ts.key
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut s, Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("invalid_request"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_rate_gets_429_with_retry_after() {
    let (ts, _dir) = start_with_edge(|e| {
        e.rate_limit_per_s = 0.2;
        e.rate_limit_burst = 5;
    })
    .await;
    let k = ts.client.create_key("busy-tenant", false).await.unwrap();
    let http = reqwest::Client::new();
    let list = |key: &str| {
        http.get(format!("{}/v1/sandboxes", ts.url()))
            .bearer_auth(key)
            .send()
    };
    for _ in 0..5 {
        assert_eq!(list(&k.key).await.unwrap().status(), 200);
    }
    let over = list(&k.key).await.unwrap();
    assert_eq!(over.status(), 429);
    let retry: u64 = over.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=5).contains(&retry), "retry-after {retry}");
    let body: serde_json::Value = over.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    // other keys have their own bucket; health checks have none
    assert_eq!(list(&ts.key).await.unwrap().status(), 200);
    ts.client.healthz().await.unwrap();
    assert!(gauge(&ts, "aviary_http_rate_limited_total") >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_keys_is_rate_limited_per_address() {
    let (ts, _dir) = start_with_edge(|e| {
        e.rate_limit_per_s = 0.2;
        e.rate_limit_burst = 3;
    })
    .await;
    // the admin key is known (cached) before the guessing starts
    ts.client.list_sandboxes(false).await.unwrap();
    let http = reqwest::Client::new();
    let list = |key: String| {
        http.get(format!("{}/v1/sandboxes", ts.url()))
            .bearer_auth(key)
            .send()
    };
    for i in 0..3 {
        assert_eq!(list(format!("avk_guess{i}")).await.unwrap().status(), 401);
    }
    let over = list("avk_guess-more".into()).await.unwrap();
    assert_eq!(over.status(), 429);
    assert!(over.headers().contains_key("retry-after"));
    // a known key from the same address still works
    ts.client.list_sandboxes(false).await.unwrap();
}

/// POSTs each body and checks status and code.
async fn expect_refusals(
    ts: &common::TestServer,
    cases: Vec<(String, serde_json::Value, u16, &str)>,
) {
    for (path, body, status, want) in cases {
        let body = serde_json::to_vec(&body).unwrap();
        // a refused body the server did not read may close the connection
        // under a client still writing: ask again
        let mut answer = ts
            .client
            .raw(Method::POST, &path, Some(body.clone()), Some(&ts.key))
            .await;
        for _ in 0..5 {
            if answer.is_ok() {
                break;
            }
            answer = ts
                .client
                .raw(Method::POST, &path, Some(body.clone()), Some(&ts.key))
                .await;
        }
        let (got, v) = answer.unwrap();
        assert_eq!(got.as_u16(), status, "POST {path}: {v}");
        assert_eq!(v["error"]["code"], want, "POST {path}: {v}");
    }
}

/// Oversized and NUL-carrying exec bodies for `id`, on both exec routes.
fn bad_execs(id: &str, marker: &str) -> Vec<(String, serde_json::Value, u16, &'static str)> {
    let big_env: serde_json::Map<String, serde_json::Value> =
        (0..10_000).map(|i| (format!("V{i}"), "x".into())).collect();
    let mut cases = Vec::new();
    for route in ["exec", "exec/stream"] {
        let path = format!("/v1/sandboxes/{id}/{route}");
        cases.extend([
            (
                path.clone(),
                serde_json::json!({"shell": marker, "env": big_env}),
                413,
                "payload_too_large",
            ),
            (
                path.clone(),
                serde_json::json!({"cmd": vec!["a"; 100_000]}),
                413,
                "payload_too_large",
            ),
            (
                path.clone(),
                serde_json::json!({"cmd": ["sh", "-c", marker, "x".repeat(900 << 10)]}),
                413,
                "payload_too_large",
            ),
            (
                path.clone(),
                serde_json::json!({"shell": marker, "env": {"K": "a\u{0}b"}}),
                400,
                "invalid_request",
            ),
            (
                path.clone(),
                serde_json::json!({"shell": marker, "env": {"": "v"}}),
                400,
                "invalid_request",
            ),
            (path.clone(), serde_json::json!([]), 400, "invalid_request"),
        ]);
    }
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_and_names_are_refused_before_any_operation() {
    let ts = common::start().await;
    // no such sandbox: a 4xx other than not_found shows the check came first
    let id = "sbx-aaaaaaaaaaaaaaaaaaaa";
    let post =
        |path: &str, body: serde_json::Value| (path.to_owned(), body, 400, "invalid_request");
    let mut cases = vec![
        post("/v1/sandboxes", serde_json::json!([])),
        post("/v1/sandboxes", serde_json::json!(null)),
        post("/v1/sandboxes", serde_json::json!("x")),
        post(&format!("/v1/sandboxes/{id}/fork"), serde_json::json!([])),
        post(&format!("/v1/sandboxes/{id}/lease"), serde_json::json!([])),
        post(
            "/v1/sandboxes",
            serde_json::json!({"template": "../../etc"}),
        ),
        post(
            "/v1/sandboxes",
            serde_json::json!({"template": "has space"}),
        ),
        post(
            "/v1/sandboxes",
            serde_json::json!({"user_id": "../../evil"}),
        ),
        post(
            "/v1/sandboxes",
            serde_json::json!({"session_id": "s\u{e9}"}),
        ),
        post("/v1/sandboxes", serde_json::json!({"agent": "a/b"})),
        post("/v1/sandboxes", serde_json::json!({"class": "x\u{0}"})),
        post("/v1/keys", serde_json::json!([])),
        post("/v1/keys", serde_json::json!({"tenant": "../../evil"})),
        post("/v1/keys", serde_json::json!({"tenant": "na\u{ef}ve"})),
        post("/v1/keys", serde_json::json!({"tenant": ""})),
    ];
    cases.extend(bad_execs(id, "true"));
    expect_refusals(&ts, cases).await;
    // no key was made for a bad tenant
    let tenants: Vec<String> = ts
        .client
        .list_keys()
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.tenant)
        .collect();
    assert_eq!(tenants, ["default"]);
    assert!(ts
        .client
        .list_sandboxes(true)
        .await
        .unwrap()
        .sandboxes
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_execs_never_reach_the_sandbox() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    expect_refusals(&ts, bad_execs(&id, "touch /workspace/reached")).await;
    assert_eq!(
        code(c.stat(&id, "/workspace/reached").await.unwrap_err()),
        ErrorCode::NotFound,
        "a refused exec ran"
    );
    // a large command that fits still runs
    let r = c
        .exec(
            &id,
            &ExecRequest {
                cmd: Some(vec![
                    "sh".into(),
                    "-c".into(),
                    "echo ${#1}".into(),
                    "sh".into(),
                    "y".repeat(60_000),
                ]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "60000\n");
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_fails_on_the_next_request() {
    let ts = common::start().await;
    let admin = &ts.client;
    let issued = admin.create_key("revokee", false).await.unwrap();
    let user = aviary_client::Client::new(&ts.url(), &issued.key);
    // used once, so the key sits in the authentication cache
    user.list_sandboxes(false).await.unwrap();

    let listed = admin.list_keys().await.unwrap();
    let mine = listed.iter().find(|k| k.id == issued.id).unwrap();
    assert_eq!(
        (mine.tenant.as_str(), mine.admin, mine.revoked_at.as_deref()),
        ("revokee", false, None)
    );
    let raw = admin
        .raw(Method::GET, "/v1/keys", None, Some(&ts.key))
        .await
        .unwrap()
        .1;
    let shown = raw.to_string();
    assert!(
        !shown.contains(&issued.key) && !shown.contains(&ts.key),
        "a secret is listed"
    );
    assert!(
        !shown.contains(&aviary_server::ops::hash_key(&issued.key)),
        "a hash is listed"
    );

    // tenants may not list or revoke keys
    assert_eq!(
        code(user.list_keys().await.unwrap_err()),
        ErrorCode::Forbidden
    );
    assert_eq!(
        code(user.revoke_key(&issued.id).await.unwrap_err()),
        ErrorCode::Forbidden
    );

    let revoked = admin.revoke_key(&issued.id).await.unwrap();
    assert!(revoked.revoked_at.is_some());
    assert_eq!(
        code(user.list_sandboxes(false).await.unwrap_err()),
        ErrorCode::Unauthorized
    );
    assert_eq!(
        code(
            user.get_sandbox("sbx-aaaaaaaaaaaaaaaaaaaa")
                .await
                .unwrap_err()
        ),
        ErrorCode::Unauthorized
    );
    // still revoked after a restart of the cache (a second revoke keeps the time)
    let again = admin.revoke_key(&issued.id).await.unwrap();
    assert_eq!(again.revoked_at, revoked.revoked_at);
    let listed = admin.list_keys().await.unwrap();
    assert!(listed
        .iter()
        .find(|k| k.id == issued.id)
        .unwrap()
        .revoked_at
        .is_some());

    assert_eq!(
        code(admin.revoke_key("key-nosuch").await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(admin.revoke_key("-x y").await.unwrap_err()),
        ErrorCode::InvalidRequest
    );
    // the bootstrap admin key cannot lock the server out of itself
    let boot = listed
        .iter()
        .find(|k| k.admin && k.tenant == "default")
        .unwrap();
    assert_eq!(
        code(admin.revoke_key(&boot.id).await.unwrap_err()),
        ErrorCode::Forbidden
    );
    admin.list_sandboxes(false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pools_and_nodes_are_not_for_tenants() {
    const VAR: &str = "AVIARY_TEST_EDGE_METRICS_TOKEN";
    std::env::set_var(VAR, "metrics-secret-123");
    let (ts, _dir) = start_with_edge(|e| e.metrics_token_env = VAR.into()).await;
    let tenant = ts.client.create_key("curious", false).await.unwrap();
    let http = reqwest::Client::new();
    let get = |path: &str, key: Option<&str>| {
        let mut rb = http.get(format!("{}{path}", ts.url()));
        if let Some(k) = key {
            rb = rb.bearer_auth(k);
        }
        rb.send()
    };
    for (path, key, status) in [
        ("/metrics", None, 401),
        ("/metrics", Some("wrong-token"), 401),
        ("/metrics", Some(tenant.key.as_str()), 403),
        ("/metrics", Some("metrics-secret-123"), 200),
        ("/metrics", Some(ts.key.as_str()), 200),
        ("/v1/pools", Some(tenant.key.as_str()), 403),
        ("/v1/nodes", Some(tenant.key.as_str()), 403),
        ("/v1/pools", Some(ts.key.as_str()), 200),
        ("/v1/nodes", Some(ts.key.as_str()), 200),
    ] {
        let r = get(path, key).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{path} with {key:?}");
    }
    let m = ts.client.metrics().await.unwrap();
    assert!(m.contains("aviary_http_connections_open"), "{m}");
    // the metrics token is no API key
    let as_key = aviary_client::Client::new(&ts.url(), "metrics-secret-123");
    assert_eq!(
        code(as_key.list_sandboxes(false).await.unwrap_err()),
        ErrorCode::Unauthorized
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_the_new_routes() {
    let ts = common::start().await;
    let doc: serde_json::Value = reqwest::get(format!("{}/openapi.json", ts.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths = &doc["paths"];
    assert!(paths["/v1/keys"]["get"].is_object());
    assert!(paths["/v1/keys"]["post"].is_object());
    assert!(paths["/v1/keys/{id}"]["delete"].is_object());
    assert!(paths["/metrics"]["get"]["responses"]["401"].is_object());
    assert!(paths["/v1/pools"]["get"]["responses"]["403"].is_object());
    assert!(paths["/v1/sandboxes/{id}/exec"]["post"]["responses"]["413"].is_object());
    assert!(doc["components"]["schemas"]["ApiKeyInfo"].is_object());
}
