//! The proxy over a real unix socket against a real loopback HTTP server
//! (reached only through the operator's `resolve` override).

use super::*;
use aviary_core::egress::{EgressLimits, EgressRule};
use std::collections::BTreeMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};

/// A tiny HTTP/1.0-style origin: answers every request with its own
/// request line, then closes.
async fn origin() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).to_string();
                let line = head.lines().next().unwrap_or("").to_owned();
                let host = head
                    .lines()
                    .find(|l| l.to_ascii_lowercase().starts_with("host:"))
                    .unwrap_or("")
                    .to_owned();
                let body = format!("origin saw: {line} | {host}");
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    addr
}

fn policy(origin: std::net::SocketAddr) -> EgressPolicy {
    EgressPolicy {
        profile: "test".into(),
        allow: vec![
            EgressRule {
                domain: "pkgs.test".into(),
                methods: Some(vec!["GET".into(), "HEAD".into(), "CONNECT".into()]),
            },
            EgressRule {
                domain: "localhost".into(),
                methods: None,
            },
        ],
        deny: vec![],
        resolve: BTreeMap::from([("pkgs.test".to_owned(), origin.to_string())]),
        limits: EgressLimits {
            max_connections: 4,
            idle_timeout_s: 5,
            max_header_bytes: 2048,
        },
    }
}

async fn exchange(sock: &std::path::Path, req: &[u8]) -> String {
    let mut s = UnixStream::connect(sock).await.unwrap();
    s.write_all(req).await.unwrap();
    let mut out = Vec::new();
    let r = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    // a refusal that did not read the whole request may reset after its answer
    if text.is_empty() {
        r.unwrap();
    }
    text
}

#[tokio::test]
async fn allows_named_hosts_and_refuses_the_rest_with_denials() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("proxy.sock");
    let origin = origin().await;
    let (proxy, mut denials) = EgressProxy::new(tokio::runtime::Handle::current());
    let id = SandboxId::generate();
    proxy.attach(&id, &policy(origin), &sock).unwrap();

    // plain HTTP in absolute form, rewritten to origin form
    let r = exchange(
        &sock,
        b"GET http://pkgs.test/simple/?q=1 HTTP/1.1\r\nHost: pkgs.test\r\nProxy-Authorization: x\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        r.contains("origin saw: GET /simple/?q=1 HTTP/1.1 | Host: pkgs.test"),
        "{r}"
    );

    // CONNECT, then a request through the tunnel
    let mut s = UnixStream::connect(&sock).await.unwrap();
    s.write_all(b"CONNECT pkgs.test:443 HTTP/1.1\r\nHost: pkgs.test:443\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 39];
    s.read_exact(&mut first).await.unwrap();
    assert_eq!(&first[..], b"HTTP/1.1 200 Connection established\r\n\r\n");
    s.write_all(b"GET /tunnelled HTTP/1.1\r\nHost: pkgs.test\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.contains("origin saw: GET /tunnelled"), "{out}");

    // refusals: each a 403 and one denial
    for (req, want) in [
        (
            "GET http://other.test/ HTTP/1.1\r\n\r\n",
            "not on the allow list",
        ),
        (
            "POST http://pkgs.test/upload HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            "method POST",
        ),
        ("CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n", "metadata"),
        ("GET http://2130706433:8080/ HTTP/1.1\r\n\r\n", "loopback"),
        ("GET http://0x0a000001/ HTTP/1.1\r\n\r\n", "private"),
        (
            "CONNECT [::ffff:127.0.0.1]:443 HTTP/1.1\r\n\r\n",
            "loopback",
        ),
        ("GET http://1.1.1.1/ HTTP/1.1\r\n\r\n", "IP literal"),
        // an allowed name whose DNS answer is loopback: no override, refused
        ("GET http://localhost/ HTTP/1.1\r\n\r\n", "always denied"),
    ] {
        let r = exchange(&sock, req.as_bytes()).await;
        assert!(r.starts_with("HTTP/1.1 403"), "{req:?} -> {r}");
        let d = denials.recv().await.unwrap();
        assert_eq!(d.sandbox, id);
        assert_eq!(d.profile, "test");
        assert!(d.reason.contains(want), "{req:?}: {}", d.reason);
    }
    let d = {
        let r = exchange(&sock, b"CONNECT 10.0.0.1:443 HTTP/1.1\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 403"), "{r}");
        denials.recv().await.unwrap()
    };
    assert_eq!(
        (d.host.as_str(), d.port, d.method.as_str()),
        ("10.0.0.1", 443, "CONNECT")
    );

    // bounds: an oversized head is 431, https in absolute form is 400
    let big = format!(
        "GET http://pkgs.test/ HTTP/1.1\r\nX: {}\r\n\r\n",
        "a".repeat(4096)
    );
    let r = exchange(&sock, big.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 431"), "{r}");
    let r = exchange(&sock, b"GET https://pkgs.test/ HTTP/1.1\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    // no smuggling a second request past the method limit in the body
    let smuggle = b"GET http://pkgs.test/ HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 44\r\n\r\nPOST /upload HTTP/1.1\r\nHost: pkgs.test\r\n\r\n";
    let r = exchange(&sock, smuggle).await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let r = exchange(
        &sock,
        b"GET http://pkgs.test/ HTTP/1.1\r\nContent-Length: +4\r\n\r\nabcd",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let r = exchange(
        &sock,
        b"GET http://pkgs.test/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 411"), "{r}");
    assert!(
        denials.try_recv().is_err(),
        "malformed requests are not denials"
    );

    // detached: the socket no longer answers
    proxy.detach(&id);
    assert!(proxy.attached().is_empty());
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let gone = match UnixStream::connect(&sock).await {
        Err(_) => true,
        Ok(mut s) => {
            let _ = s.write_all(b"GET http://pkgs.test/ HTTP/1.1\r\n\r\n").await;
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out).await;
            out.is_empty()
        }
    };
    assert!(gone, "a detached sandbox's socket still proxies");
}

#[tokio::test]
async fn connections_per_sandbox_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("proxy.sock");
    let origin = origin().await;
    let (proxy, _denials) = EgressProxy::new(tokio::runtime::Handle::current());
    let id = SandboxId::generate();
    let mut p = policy(origin);
    p.limits.max_connections = 2;
    proxy.attach(&id, &p, &sock).unwrap();
    // two idle connections hold both slots (their heads never complete)
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = UnixStream::connect(&sock).await.unwrap();
        s.write_all(b"GET http://pkgs.test/ HTTP/1.1\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    // the third is refused once the first two are being served
    let mut r = String::new();
    for _ in 0..100 {
        r = exchange(&sock, b"GET http://pkgs.test/ HTTP/1.1\r\n\r\n").await;
        if r.starts_with("HTTP/1.1 429") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(r.starts_with("HTTP/1.1 429"), "{r}");
    drop(held);
    proxy.detach(&id);
}

#[test]
fn denial_reports_have_a_budget_and_name_what_they_skipped() {
    let mut b = ReportBudget::new();
    for _ in 0..REPORTS_PER_WINDOW {
        assert_eq!(b.take(), Some(0));
    }
    assert_eq!(b.take(), None);
    assert_eq!(b.take(), None);
    // a new window reports again, naming the two it skipped
    b.window_start -= REPORT_WINDOW;
    assert_eq!(b.take(), Some(2));
    assert_eq!(b.take(), Some(0));
}
