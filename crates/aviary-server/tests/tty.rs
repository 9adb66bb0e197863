//! `GET /v1/sandboxes/{id}/exec/tty` over a real WebSocket client
//! (tokio-tungstenite) against the real server and real crun sandboxes:
//! a shell on a pseudo-terminal (size, resize, signals, exit code), the
//! subprotocol authentication, and every refusal (wrong key, another
//! tenant, the lease fence, a bad start message).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

fn tty_url(ts: &common::TestServer, id: &str) -> String {
    format!(
        "{}/v1/sandboxes/{id}/exec/tty",
        ts.url().replacen("http://", "ws://", 1)
    )
}

/// Connects with these headers; the 101's `Sec-WebSocket-Protocol`, or the
/// HTTP refusal's status.
async fn connect(
    url: &str,
    headers: &[(&'static str, String)],
) -> Result<(Ws, Option<String>), StatusCode> {
    let mut req = url.into_client_request().unwrap();
    for (k, v) in headers {
        req.headers_mut()
            .insert(*k, HeaderValue::from_str(v).unwrap());
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, resp)) => {
            let proto = resp
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap().to_owned());
            Ok((ws, proto))
        }
        Err(WsError::Http(resp)) => Err(resp.status()),
        Err(e) => panic!("websocket connect: {e}"),
    }
}

fn bearer(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

fn protocols(p: &str) -> (&'static str, String) {
    ("sec-websocket-protocol", p.to_owned())
}

/// A terminal session seen from the client.
struct Term {
    ws: Ws,
    seen: String,
    texts: Vec<serde_json::Value>,
    close: Option<(CloseCode, String)>,
}

impl Term {
    fn new(ws: Ws) -> Term {
        Term {
            ws,
            seen: String::new(),
            texts: Vec::new(),
            close: None,
        }
    }

    async fn text(&mut self, v: serde_json::Value) {
        self.ws.send(Message::text(v.to_string())).await.unwrap();
    }

    async fn keys(&mut self, s: &str) {
        self.ws
            .send(Message::binary(s.as_bytes().to_vec()))
            .await
            .unwrap();
    }

    /// Takes one message; false once the socket ended.
    async fn take(&mut self) -> bool {
        match self.ws.next().await {
            Some(Ok(Message::Binary(b))) => self.seen.push_str(&String::from_utf8_lossy(&b)),
            Some(Ok(Message::Text(t))) => self.texts.push(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Close(f))) => {
                self.close = f.map(|f| (f.code, f.reason.to_string()));
            }
            Some(Ok(_)) => {}
            Some(Err(_)) | None => return false,
        }
        true
    }

    /// Reads until `done` holds (a hung session fails after a generous guard).
    async fn until(&mut self, what: &str, done: impl Fn(&Term) -> bool) {
        let r = tokio::time::timeout(Duration::from_secs(60), async {
            while !done(self) {
                assert!(
                    self.take().await,
                    "socket ended before {what}: {}",
                    self.seen
                );
            }
        })
        .await;
        if r.is_err() {
            panic!(
                "no {what}; output {:?}, messages {:?}",
                self.seen, self.texts
            );
        }
    }

    async fn expect(&mut self, needle: &str) {
        self.until(needle, |t| t.seen.contains(needle)).await;
    }

    /// Reads to the end; the exit message, if any.
    async fn finish(&mut self) -> Option<serde_json::Value> {
        self.until("the end", |t| t.close.is_some()).await;
        self.texts.iter().find_map(|v| v.get("exit").cloned())
    }

    fn error_code(&self) -> Option<String> {
        self.texts
            .iter()
            .find_map(|v| v["error"]["code"].as_str().map(str::to_owned))
    }
}

async fn tty_events(c: &aviary_client::Client, id: &str) -> Vec<aviary_core::api::Event> {
    c.events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.event_type.starts_with("tty_"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shell_on_a_terminal_over_a_websocket() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let (ws, proto) = connect(
        &tty_url(&ts, &id),
        &[bearer(&ts.key), protocols("aviary.tty.v1")],
    )
    .await
    .unwrap();
    assert_eq!(proto.as_deref(), Some("aviary.tty.v1"));
    let mut t = Term::new(ws);
    t.text(
        serde_json::json!({"cmd": ["/bin/sh"], "cols": 100, "rows": 30, "env": {"GREETING": "hi"}}),
    )
    .await;
    t.keys("[ -t 0 ] && [ -t 1 ] && echo isatty-$GREETING; stty size\n")
        .await;
    t.expect("isatty-hi").await;
    t.expect("30 100").await;
    t.text(serde_json::json!({"type": "resize", "cols": 120, "rows": 40}))
        .await;
    t.keys("stty size\n").await;
    t.expect("40 120").await;
    // a bad control message is answered and changes nothing
    t.text(serde_json::json!({"type": "launch", "what": "rockets"}))
        .await;
    t.until("an error message", |t| t.error_code().is_some())
        .await;
    assert_eq!(t.error_code().as_deref(), Some("invalid_request"));
    // a signal reaches the foreground process (sleep), not the shell
    t.keys("sleep 600\n").await;
    let running = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let r = c
                .exec(&id, &common::shell("ps -o comm | grep -c '^sleep' || true"))
                .await
                .unwrap();
            if r.stdout.trim() == "1" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if running.is_err() {
        panic!("sleep never ran: {}", t.seen);
    }
    t.text(serde_json::json!({"type": "signal", "signal": "INT"}))
        .await;
    // (an interactive shell abandons the rest of a line whose command died
    // of SIGINT: the status is asked for on the next line)
    t.keys("echo status-$?\n").await;
    t.expect("status-130").await;
    t.keys("echo $((6*7))x; exit 3\n").await;
    t.expect("42x").await;
    let exit = t.finish().await.unwrap();
    assert_eq!(exit["exit_code"], 3, "{exit}");
    assert_eq!(t.close.as_ref().unwrap().0, CloseCode::Normal);
    let events = tty_events(c, &id).await;
    let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, ["tty_started", "tty_exited"]);
    assert_eq!(events[0].metadata["cols"], 100);
    assert_eq!(events[1].metadata["exit_code"], 3);
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_tenancy_and_the_fence_are_enforced() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let url = tty_url(&ts, &id);

    // the key as a subprotocol (browsers): only the plain name is echoed
    let offered = format!("aviary.tty.v1, aviary.bearer.{}", ts.key);
    let (ws, proto) = connect(&url, &[protocols(&offered)]).await.unwrap();
    assert_eq!(proto.as_deref(), Some("aviary.tty.v1"));
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"argv": ["/bin/sh", "-c", "exit 5"]}))
        .await;
    assert_eq!(t.finish().await.unwrap()["exit_code"], 5);

    // no key, a wrong key (header or subprotocol), a key in the query string
    assert_eq!(
        connect(&url, &[]).await.unwrap_err(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        connect(&url, &[bearer("avk_wrong")]).await.unwrap_err(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        connect(&url, &[protocols("aviary.tty.v1, aviary.bearer.avk_wrong")])
            .await
            .unwrap_err(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        connect(&format!("{url}?access_token={}", ts.key), &[])
            .await
            .unwrap_err(),
        StatusCode::UNAUTHORIZED
    );
    // another tenant's sandbox does not exist for it
    let other = c.create_key("tenant-tty-other", false).await.unwrap();
    assert_eq!(
        connect(&url, &[bearer(&other.key)]).await.unwrap_err(),
        StatusCode::NOT_FOUND
    );
    // a plain GET (no upgrade) is a 400 with the API's error body
    let plain = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/exec/tty", ts.url()))
        .bearer_auth(&ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status().as_u16(), 400);
    let body: serde_json::Value = plain.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_request", "{body}");

    // leased: no token is refused before the upgrade
    let lease = c.acquire_lease(&id, "tty-test", Some(120)).await.unwrap();
    assert_eq!(
        connect(&url, &[bearer(&ts.key)]).await.unwrap_err(),
        StatusCode::CONFLICT
    );
    let (ws, _) = connect(
        &url,
        &[
            bearer(&ts.key),
            ("x-aviary-lease-token", lease.token.to_string()),
        ],
    )
    .await
    .unwrap();
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"cmd": ["/bin/sh", "-c", "echo leased-ok"]}))
        .await;
    t.expect("leased-ok").await;
    assert_eq!(t.finish().await.unwrap()["exit_code"], 0);
    // a foreign token (the right fence, another secret) is refused too
    let mut forged = lease.token.to_string();
    let last = if forged.ends_with('0') { "1" } else { "0" };
    forged.replace_range(forged.len() - 1.., last);
    assert_eq!(
        connect(
            &url,
            &[bearer(&ts.key), ("x-aviary-lease-token", forged.clone())]
        )
        .await
        .unwrap_err(),
        StatusCode::CONFLICT
    );
    // a browser offers key and token as subprotocols: only the plain name
    // is echoed; a foreign token that way is refused the same
    let offered = format!(
        "aviary.tty.v1, aviary.bearer.{}, aviary.lease.{}",
        ts.key, lease.token
    );
    let (ws, proto) = connect(&url, &[protocols(&offered)]).await.unwrap();
    assert_eq!(proto.as_deref(), Some("aviary.tty.v1"));
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"cmd": ["/bin/sh", "-c", "echo leased-by-subprotocol"]}))
        .await;
    t.expect("leased-by-subprotocol").await;
    assert_eq!(t.finish().await.unwrap()["exit_code"], 0);
    let offered = format!(
        "aviary.tty.v1, aviary.bearer.{}, aviary.lease.{forged}",
        ts.key
    );
    assert_eq!(
        connect(&url, &[protocols(&offered)]).await.unwrap_err(),
        StatusCode::CONFLICT
    );
    c.release_lease(&id, lease.token).await.unwrap();
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_start_message_is_refused_and_starts_nothing() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let url = tty_url(&ts, &id);
    for (first, code) in [
        (Message::text(r#"{"cmd": "not a list"}"#), "invalid_request"),
        (
            Message::text(r#"{"cmd": ["sh"], "cols": 0}"#),
            "invalid_request",
        ),
        (
            Message::text(r#"{"cmd": ["sh"], "surprise": 1}"#),
            "invalid_request",
        ),
        (Message::text(r#"[["sh"]]"#), "invalid_request"),
        (Message::binary(b"ls\n".to_vec()), "invalid_request"),
        (Message::text(r#"{"cwd": "/no/such/dir"}"#), "invalid_path"),
        (
            Message::text(r#"{"user": "nobody-at-all"}"#),
            "invalid_request",
        ),
    ] {
        let (ws, _) = connect(&url, &[bearer(&ts.key)]).await.unwrap();
        let mut t = Term::new(ws);
        t.ws.send(first.clone()).await.unwrap();
        assert_eq!(t.finish().await, None, "{first:?}");
        assert_eq!(
            t.error_code().as_deref(),
            Some(code),
            "{first:?}: {:?}",
            t.texts
        );
        let close = t.close.clone().unwrap();
        assert!(
            matches!(u16::from(close.0), 4400 | 4404 | 4422),
            "{first:?}: {close:?}"
        );
    }
    assert_eq!(tty_events(c, &id).await.len(), 0);
    // a missing program is a shell's 127, on the terminal
    let (ws, _) = connect(&url, &[bearer(&ts.key)]).await.unwrap();
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"cmd": ["/no/such/program"]}))
        .await;
    assert_eq!(t.finish().await.unwrap()["exit_code"], 127);
    assert!(t.seen.contains("not found"), "{}", t.seen);
    // a client that goes away ends the session (and it is recorded)
    let (ws, _) = connect(&url, &[bearer(&ts.key)]).await.unwrap();
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"cmd": ["/bin/sh", "-c", "echo up; exec sleep 600"]}))
        .await;
    t.expect("up").await;
    drop(t);
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let ev = tty_events(c, &id).await;
            if ev.iter().filter(|e| e.event_type == "tty_exited").count() == 2 {
                return ev;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(ended.last().unwrap().metadata["ended"], "disconnected");
    // envd sees the closed connection and kills the session
    let gone = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let r = c
                .exec(&id, &common::shell("ps -o comm | grep -c '^sleep' || true"))
                .await
                .unwrap();
            if r.stdout.trim() == "0" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if gone.is_err() {
        panic!("the session's process survived its client");
    }
    c.delete_sandbox(&id, None).await.unwrap();
}

/// A node agent on loopback (real crun, its own state dir).
async fn agent(dir: &std::path::Path, id: &str) -> (aviary_node::RunningNode, String) {
    let state = dir.join(id);
    let rt = aviary_runtime_oci::OciRuntime::new(
        aviary_runtime_oci::OciConfig::new(
            aviary_runtime_oci::OciBinary::Crun,
            state.join("sandboxes"),
        )
        .with_template_store(common::template_cache()),
    )
    .unwrap();
    let rt = std::sync::Arc::new(rt);
    let token = format!("token-{id}");
    let node = aviary_node::start_node(aviary_node::NodeConfig {
        id: id.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        token: token.clone(),
        runtime: rt.clone(),
        layers: Some(rt),
        templates: aviary_templates::TemplateStore::open(common::template_cache()).unwrap(),
        state_dir: state.join("agent"),
        capacity: aviary_node::Capacity {
            cpu: 64.0,
            memory_mb: 262_144,
        },
        provided_binds: vec![aviary_node::ProvidedBind::envd(common::envd_binary())],
    })
    .await
    .unwrap();
    (node, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_works_through_a_node_agent() {
    let ts = common::start().await;
    let c = &ts.client;
    let dir = tempfile::Builder::new()
        .prefix("avn")
        .tempdir_in("/tmp")
        .unwrap();
    let (node, token) = agent(dir.path(), "node-tty").await;
    c.add_node("node-tty", &node.addr().to_string(), &token)
        .await
        .unwrap();
    // the big agent beats this host on load: the sandbox lands there
    let s = c
        .create_sandbox(&aviary_core::api::CreateSandboxRequest {
            class: Some("compute-large".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandbox;
    assert_eq!(s.node, "node-tty");
    let id = s.id.to_string();
    let (ws, _) = connect(&tty_url(&ts, &id), &[bearer(&ts.key)])
        .await
        .unwrap();
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"cmd": ["/bin/sh"], "cols": 90, "rows": 33}))
        .await;
    t.keys("stty size; echo via-$((40+2))\n").await;
    t.expect("33 90").await;
    t.expect("via-42").await;
    t.text(serde_json::json!({"type": "resize", "cols": 91, "rows": 34}))
        .await;
    t.keys("stty size; exit 9\n").await;
    t.expect("34 91").await;
    assert_eq!(t.finish().await.unwrap()["exit_code"], 9);
    c.delete_sandbox(&id, None).await.unwrap();
    node.stop().await;
}

/// Measures (prints, asserts nothing about time): a keystroke's round trip
/// (client → server → envd → terminal echo → back) and the throughput of a
/// large output; checks that the output arrives whole, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measure_keystroke_round_trip_and_output_throughput() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let (ws, _) = connect(&tty_url(&ts, &id), &[bearer(&ts.key)])
        .await
        .unwrap();
    let mut t = Term::new(ws);
    // cat on a terminal: every key is echoed by the line discipline
    t.text(serde_json::json!({"cmd": ["/bin/cat"]})).await;
    let mut rtts = Vec::new();
    for i in 0..200 {
        let key = char::from(b'a' + (i % 26) as u8).to_string();
        let before = t.seen.len();
        let started = std::time::Instant::now();
        t.keys(&key).await;
        t.until("the echo", |t| t.seen.len() > before).await;
        rtts.push(started.elapsed());
    }
    rtts.sort();
    eprintln!(
        "MEASURED keystroke round trip over exec/tty: p50 {:?}, p90 {:?}, max {:?} (n={})",
        rtts[rtts.len() / 2],
        rtts[rtts.len() * 9 / 10],
        rtts[rtts.len() - 1],
        rtts.len()
    );
    t.keys("\x04\x04").await; // EOF twice: the typed line, then the end
    assert_eq!(t.finish().await.unwrap()["exit_code"], 0);

    let (ws, _) = connect(&tty_url(&ts, &id), &[bearer(&ts.key)])
        .await
        .unwrap();
    let mut t = Term::new(ws);
    let started = std::time::Instant::now();
    t.text(serde_json::json!({"cmd": ["/bin/sh", "-c", "seq 1 200000; echo done-$((1+1))"]}))
        .await;
    let exit = t.finish().await.unwrap();
    let took = started.elapsed();
    assert_eq!(exit["exit_code"], 0);
    let lines: Vec<&str> = t.seen.split("\r\n").collect();
    assert_eq!(lines[0], "1");
    assert_eq!(lines[199_999], "200000");
    assert_eq!(lines[200_000], "done-2");
    eprintln!(
        "MEASURED terminal output: {} bytes in {took:?} ({:.1} MiB/s)",
        t.seen.len(),
        t.seen.len() as f64 / took.as_secs_f64() / (1024.0 * 1024.0)
    );
    // the same output through the streaming exec (server-sent events), for comparison
    let started = std::time::Instant::now();
    let r = c.exec(&id, &common::shell("seq 1 200000")).await.unwrap();
    eprintln!(
        "MEASURED the same through exec (no terminal): {} bytes in {:?}",
        r.stdout.len(),
        started.elapsed()
    );
    c.delete_sandbox(&id, None).await.unwrap();
}

/// envd's own `exec_pty` inside a crun sandbox, driven with the host's
/// envd client: a terminal as the sandbox's init gives it, and envd's own
/// fence (not only the control plane's) refuses a missing or stale token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_in_a_crun_sandbox_gives_terminals_and_fences_them() {
    use aviary_envd_proto::{EnvdClient, EnvdError, PtyEvent, PtySpec};
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    let ep = ts
        .cp()
        .runtime()
        .envd_endpoint(&id.parse().unwrap())
        .await
        .unwrap();
    let envd = EnvdClient::new(&ep.socket).expect_peer_pid(ep.peer_pid);
    let lease = c.acquire_lease(&id, "tty-envd", Some(120)).await.unwrap();
    let fence = lease.token.fence();
    let spec = PtySpec {
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            "[ -t 0 ] && echo tty=$(tty); stty size; exit 6".into(),
        ],
        cols: 77,
        rows: 21,
        ..PtySpec::default()
    };
    let e = envd.exec_pty(spec.clone(), None).await.unwrap_err();
    assert!(matches!(e, EnvdError::LeaseRequired), "{e:?}");
    let e = envd
        .exec_pty(spec.clone(), Some(fence - 1))
        .await
        .unwrap_err();
    assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
    let (_input, mut output) = envd.exec_pty(spec, Some(fence)).await.unwrap();
    let mut seen = String::new();
    let exit = loop {
        match output.next().await.unwrap() {
            PtyEvent::Output(b) => seen.push_str(&String::from_utf8_lossy(&b)),
            PtyEvent::Exit(e) => break e,
        }
    };
    assert_eq!(exit.exit_code, 6, "{seen}");
    assert!(seen.contains("tty=/dev/pts/"), "{seen}");
    assert!(seen.contains("21 77"), "{seen}");
    c.release_lease(&id, lease.token).await.unwrap();
    c.delete_sandbox(&id, None).await.unwrap();
}

/// A server that stops closes its terminal sessions ("going away") and
/// does not wait for their users; the session's process is ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_server_closes_terminal_sessions() {
    let mut ts = common::start().await;
    let id = common::new_sandbox(&ts.client).await;
    let (ws, _) = connect(&tty_url(&ts, &id), &[bearer(&ts.key)])
        .await
        .unwrap();
    let mut t = Term::new(ws);
    t.text(serde_json::json!({"cmd": ["/bin/sh", "-c", "echo up; exec sleep 600"]}))
        .await;
    t.expect("up").await;
    let sandbox: aviary_core::SandboxId = id.parse().unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(60), ts.stop()).await;
    if stopped.is_err() {
        ts.cp_runtime_destroy(&sandbox).await;
        panic!("the server's stop waited for an open terminal session");
    }
    t.until("the close", |t| t.close.is_some()).await;
    assert_eq!(t.close.as_ref().unwrap().0, CloseCode::Away);
    ts.cp_runtime_destroy(&sandbox).await;
}
