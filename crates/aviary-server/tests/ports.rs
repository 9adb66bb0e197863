//! Sandbox ports through the control plane, end to end: a real crun sandbox
//! (debootstrap template, no network) runs a small python3 HTTP + WebSocket
//! echo server; the real server proxies to it over envd's port tunnel.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::ErrorCode;
use reqwest::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET echoes what reached it (path, Authorization, Cookie) and tries to set
/// the port-token cookie; POST echoes its body; `Upgrade: websocket` is
/// answered by an echo of every frame (RFC 6455, enough for the test).
const SERVER: &str = r#"
import base64, hashlib, http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Set-Cookie", "aviary_port_token=evil; Path=/")
        self.send_header("Set-Cookie", "app=1")
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.websocket()
        self.reply(("GET %s auth=%s cookie=%s" % (self.path, self.headers.get("Authorization"), self.headers.get("Cookie"))).encode())
    def do_POST(self):
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.reply(b"POST " + self.path.encode() + b" " + hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode())
    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
        self.end_headers()
        self.wfile.flush()
        while True:
            h = self.rfile.read(2)
            if len(h) < 2:
                return
            op, n = h[0] & 15, h[1] & 127
            if n == 126:
                n = int.from_bytes(self.rfile.read(2), "big")
            mask = self.rfile.read(4) if h[1] & 128 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if op == 8:
                return
            head = bytes([0x80 | op]) + (bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big"))
            self.wfile.write(head + data)
            self.wfile.flush()
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"#;

const PORT: u16 = 8000;

async fn start_server(c: &aviary_client::Client, id: &str, lease: Option<&str>) {
    let mut req = common::shell(&format!(
        "nohup python3 /tmp/srv.py {PORT} >/tmp/srv.log 2>&1 &"
    ));
    req.token = lease.map(|t| t.parse().unwrap());
    let r = c.exec(id, &req).await.unwrap();
    assert_eq!(r.exit_code, 0, "{r:?}");
}

fn port_url(base: &str, id: &str, rest: &str) -> String {
    format!("{base}/v1/sandboxes/{id}/ports/{PORT}{rest}")
}

/// GETs `url` until the server in the sandbox answers (it starts in the
/// background); any answer but `port_unreachable` ends the wait.
async fn get_when_up(http: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    for _ in 0..200 {
        let r = http.get(url).bearer_auth(key).send().await.unwrap();
        if r.status() != StatusCode::BAD_GATEWAY {
            return r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the sandbox's server never came up at {url}");
}

async fn error_code(r: reqwest::Response) -> (StatusCode, String) {
    let status = r.status();
    let v: serde_json::Value = r.json().await.unwrap();
    (status, v["error"]["code"].as_str().unwrap_or("").to_owned())
}

/// Opens a WebSocket through the proxy with raw HTTP/1.1 and returns the
/// stream after the 101.
async fn websocket(base: &str, id: &str, key: &str, lease: Option<&str>) -> tokio::net::TcpStream {
    let addr = base.strip_prefix("http://").unwrap();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let lease = lease
        .map(|t| format!("x-aviary-lease-token: {t}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "GET /v1/sandboxes/{id}/ports/{PORT}/ws HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n{lease}\
         Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(
            s.read(&mut b).await.unwrap(),
            1,
            "closed in the head: {head:?}"
        );
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // RFC 6455's own example key and answer: the sandbox's handshake came through
    assert!(
        head.to_ascii_lowercase()
            .contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    s
}

async fn ws_echo(s: &mut tokio::net::TcpStream, text: &str) -> String {
    let mask = [1u8, 2, 3, 4];
    let mut frame = vec![0x81, 0x80 | u8::try_from(text.len()).unwrap()];
    frame.extend_from_slice(&mask);
    frame.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    s.write_all(&frame).await.unwrap();
    let mut h = [0u8; 2];
    s.read_exact(&mut h).await.unwrap();
    assert_eq!(h[0], 0x81);
    let mut data = vec![0u8; usize::from(h[1] & 127)];
    s.read_exact(&mut data).await.unwrap();
    String::from_utf8(data).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ports_reach_a_server_in_a_sandbox_without_network() {
    let ts = common::start_with("default").await;
    let c = &ts.client;
    let base = ts.url();
    let http = reqwest::Client::new();
    let created = c
        .create_sandbox(&aviary_core::api::CreateSandboxRequest::default())
        .await
        .unwrap();
    let id = created.sandbox.id.to_string();
    assert_eq!(
        serde_json::to_value(created.sandbox.network_profile).unwrap(),
        "none",
        "the sandbox has no network"
    );
    c.write_file(&id, "/tmp/srv.py", SERVER.as_bytes().to_vec(), None)
        .await
        .unwrap();

    // nothing listens yet: 502 port_unreachable; out of range: 400
    let r = http
        .get(port_url(&base, &id, "/"))
        .bearer_auth(&ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_code(r).await,
        (StatusCode::BAD_GATEWAY, "port_unreachable".into())
    );
    for bad in ["0", "65536", "http"] {
        let r = http
            .get(format!("{base}/v1/sandboxes/{id}/ports/{bad}/"))
            .bearer_auth(&ts.key)
            .send()
            .await
            .unwrap();
        assert_eq!(
            error_code(r).await,
            (StatusCode::BAD_REQUEST, "invalid_request".into()),
            "{bad}"
        );
    }

    start_server(c, &id, None).await;
    let r = get_when_up(&http, &port_url(&base, &id, "/hello?x=1"), &ts.key).await;
    assert_eq!(r.status(), StatusCode::OK);
    let cookies: Vec<_> = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        cookies,
        ["app=1"],
        "the sandbox cannot set the port-token cookie"
    );
    // the caller's API key never reaches the sandbox
    assert_eq!(
        r.text().await.unwrap(),
        "GET /hello?x=1 auth=None cookie=None"
    );

    // a POST body streams through both ways (2 MiB, in many frames)
    let body: Vec<u8> = (0..2 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let want = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&body))
    };
    let r = http
        .post(port_url(&base, &id, "/upload"))
        .bearer_auth(&ts.key)
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.text().await.unwrap(),
        format!("POST /upload {want} {}", body.len())
    );

    // a WebSocket echo through the proxy
    let mut ws = websocket(&base, &id, &ts.key, None).await;
    assert_eq!(
        ws_echo(&mut ws, "hello through envd").await,
        "hello through envd"
    );
    assert_eq!(ws_echo(&mut ws, "twice").await, "twice");
    drop(ws);

    // the port token: header, query (which sets the cookie), cookie
    let ep = c.port_endpoint(&id, PORT).await.unwrap();
    assert_eq!(ep.url, port_url(&base, &id, "/"));
    let r = http
        .get(port_url(&base, &id, "/t"))
        .header(&ep.header, &ep.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.text().await.unwrap(), "GET /t auth=None cookie=None");
    let r = http.get(&ep.browser_url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let set: Vec<String> = r
        .headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert!(
        set.iter().any(
            |c| c.starts_with(&format!("aviary_port_token={}", ep.token))
                && c.contains(&format!("Path=/v1/sandboxes/{id}/ports/{PORT}/"))
        ),
        "{set:?}"
    );
    assert_eq!(r.text().await.unwrap(), "GET / auth=None cookie=None");
    let r = http
        .get(port_url(&base, &id, "/c"))
        .header("cookie", format!("a=b; aviary_port_token={}", ep.token))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "GET /c auth=None cookie=a=b");

    // host-based routing (E2B's get_host form): `{port}-{id}.{domain}`
    let r = http
        .get(format!("{base}/by/host?q=1"))
        .header("host", format!("{PORT}-{id}.aviary.test"))
        .header(&ep.header, &ep.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.text().await.unwrap(),
        "GET /by/host?q=1 auth=None cookie=None"
    );
    let r = http
        .get(format!("{base}/"))
        .header("host", format!("{PORT}-{id}.aviary.test"))
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await.0, StatusCode::UNAUTHORIZED);

    // refused: no credential, a wrong key, a wrong token, another port's token
    let r = http.get(port_url(&base, &id, "/")).send().await.unwrap();
    assert_eq!(error_code(r).await.0, StatusCode::UNAUTHORIZED);
    let r = http
        .get(port_url(&base, &id, "/"))
        .bearer_auth("not-a-key")
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await.0, StatusCode::UNAUTHORIZED);
    let r = http
        .get(port_url(&base, &id, "/"))
        .header(&ep.header, "00".repeat(32))
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await.0, StatusCode::UNAUTHORIZED);
    let r = http
        .get(format!("{base}/v1/sandboxes/{id}/ports/8001/"))
        .header(&ep.header, &ep.token)
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await.0, StatusCode::UNAUTHORIZED);

    // another tenant: not found, for the proxy and for the endpoint
    let other = c.create_key("ports-other", false).await.unwrap();
    let r = http
        .get(port_url(&base, &id, "/"))
        .bearer_auth(&other.key)
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_code(r).await,
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    let oc = aviary_client::Client::new(&base, &other.key);
    assert_eq!(
        oc.port_endpoint(&id, PORT).await.unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );

    // leases: the tunnel is fenced. A new lease ends the old holder's
    // processes and tunnels; its token is refused afterwards.
    let lease = c.acquire_lease(&id, "agent-a", Some(60)).await.unwrap();
    let t1 = lease.token.to_string();
    start_server(c, &id, Some(&t1)).await;
    let r = http
        .get(port_url(&base, &id, "/"))
        .bearer_auth(&ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_code(r).await,
        (StatusCode::CONFLICT, "lease_required".into())
    );
    let mut up = None;
    for _ in 0..200 {
        let r = http
            .get(port_url(&base, &id, "/leased"))
            .bearer_auth(&ts.key)
            .header("x-aviary-lease-token", &t1)
            .send()
            .await
            .unwrap();
        if r.status() != StatusCode::BAD_GATEWAY {
            up = Some(r);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let r = up.expect("the leased sandbox's server came up");
    assert_eq!(r.status(), StatusCode::OK);
    let mut ws = websocket(&base, &id, &ts.key, Some(&t1)).await;
    assert_eq!(ws_echo(&mut ws, "leased").await, "leased");
    c.release_lease(&id, lease.token).await.unwrap();
    let lease2 = c.acquire_lease(&id, "agent-b", Some(60)).await.unwrap();
    // the old holder's tunnel was closed when the fence moved
    let mut rest = Vec::new();
    let n = ws.read_to_end(&mut rest).await.unwrap_or(0);
    assert_eq!(n, 0, "nothing more came through the old tunnel: {rest:?}");
    let r = http
        .get(port_url(&base, &id, "/"))
        .bearer_auth(&ts.key)
        .header("x-aviary-lease-token", &t1)
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_code(r).await,
        (StatusCode::CONFLICT, "stale_token".into())
    );
    c.release_lease(&id, lease2.token).await.unwrap();

    c.delete_sandbox(&id, None).await.unwrap();
    let r = http
        .get(port_url(&base, &id, "/"))
        .bearer_auth(&ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(
        error_code(r).await,
        (StatusCode::CONFLICT, "invalid_state".into())
    );
    // an ended sandbox's port token opens nothing
    let r = http
        .get(port_url(&base, &id, "/"))
        .header(&ep.header, &ep.token)
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await.0, StatusCode::NOT_FOUND);
}
