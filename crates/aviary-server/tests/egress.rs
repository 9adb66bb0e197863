//! Network profiles enforced by the node, through the real server (real
//! crun sandboxes of the debootstrap template, real envd, the node's real
//! egress proxy): an `allowlist` sandbox reaches a loopback HTTP server
//! standing in for an allowed domain (the profile's `resolve` override
//! points the name at it) over plain HTTP and CONNECT, through the proxy
//! env its execs get; everything else — other and denied domains, a
//! disallowed method, private/metadata/loopback literals in any encoding —
//! is a 403 from the proxy, an `egress_denied` event and a taint. A `none`
//! sandbox has no socket, no proxy and no route out; a sandbox sees only its
//! own proxy socket, and its denials are its own.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::Client;
use aviary_config::NetworkProfileDef;
use aviary_core::api::{CreateSandboxRequest, CreateSandboxResponse, ExecRequest, ExecResult};
use aviary_core::NetworkProfile;
use std::collections::BTreeMap;
use std::io::{Read, Write};

/// A loopback HTTP origin on the host: answers each request with the
/// request line it saw, then closes.
fn origin() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).to_string();
                let body = format!("origin saw: {}", head.lines().next().unwrap_or(""));
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    addr
}

/// Sends one raw request (escapes like `\r\n` decoded) to the proxy envd
/// serves on the sandbox's loopback and prints the whole answer.
const RAW: &str = r#"
import socket, sys
raw = sys.argv[1].encode().decode("unicode_escape").encode()
s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
s.sendall(raw)
out = b""
while True:
    try:
        b = s.recv(65536)
    except (ConnectionResetError, socket.timeout):
        break
    if not b:
        break
    out += b
print(out.decode(errors="replace"))
"#;

/// Tries a direct TCP connection (no proxy) and prints how it ended.
const DIRECT: &str = r#"
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    print("connected")
except OSError as e:
    print("refused:", e)
"#;

fn shell(s: &str, c: &CreateSandboxResponse) -> ExecRequest {
    ExecRequest {
        token: c.lease.as_ref().map(|l| l.token),
        ..common::shell(s)
    }
}

async fn run(client: &Client, c: &CreateSandboxResponse, s: &str) -> ExecResult {
    let r = client
        .exec(c.sandbox.id.as_str(), &shell(s, c))
        .await
        .unwrap();
    assert!(!r.timed_out, "{s}: timed out: {r:?}");
    r
}

/// The answer to one raw proxy request from inside the sandbox.
async fn raw(client: &Client, c: &CreateSandboxResponse, req: &str) -> String {
    let r = run(client, c, &format!("python3 /tmp/raw.py '{req}'")).await;
    assert_eq!(r.exit_code, 0, "{req}: {r:?}");
    r.stdout
}

async fn denials(client: &Client, id: &str) -> Vec<serde_json::Value> {
    client
        .events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.event_type == "egress_denied")
        .map(|e| e.metadata)
        .collect()
}

async fn install_scripts(client: &Client, c: &CreateSandboxResponse) {
    for (name, body) in [("raw.py", RAW), ("direct.py", DIRECT)] {
        let r = run(
            client,
            c,
            &format!("cat > /tmp/{name} <<'PYEOF'\n{body}\nPYEOF"),
        )
        .await;
        assert_eq!(r.exit_code, 0, "{r:?}");
    }
}

/// A server config (debootstrap default template) with the allowlist
/// profile `pkgs`: `pkgs.test` (GET, HEAD, CONNECT) and `*.pkgs.test`
/// allowed, `blocked.pkgs.test` denied, the names pointed at `origin` by the
/// operator's override; every class may use it.
fn config_with_pkgs(
    data: &std::path::Path,
    origin: std::net::SocketAddr,
) -> aviary_server::config::ServerConfig {
    let mut cfg = common::config(data, "default");
    let mut prof = NetworkProfileDef::plain(
        "pkgs",
        NetworkProfile::Allowlist,
        &["pkgs.test", "*.pkgs.test"],
    );
    prof.deny = vec!["blocked.pkgs.test".into()];
    prof.methods = BTreeMap::from([(
        "pkgs.test".to_owned(),
        vec!["GET".to_owned(), "HEAD".to_owned(), "CONNECT".to_owned()],
    )]);
    prof.resolve = ["pkgs.test", "files.pkgs.test", "blocked.pkgs.test"]
        .into_iter()
        .map(|h| (h.to_owned(), origin.to_string()))
        .collect();
    cfg.control.settings.network_profiles.push(prof);
    for c in &mut cfg.control.settings.classes {
        c.network_profiles.push("pkgs".into());
    }
    cfg
}

async fn wait_denials(client: &Client, id: &str, n: usize) -> Vec<serde_json::Value> {
    let mut events = Vec::new();
    for _ in 0..200 {
        events = denials(client, id).await;
        if events.len() >= n {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allowlist_egress_survives_a_server_restart_and_new_compute() {
    let origin = origin();
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let mut ts = common::start_cfg(config_with_pkgs(&data, origin)).await;
    let a = ts
        .client
        .create_sandbox(&CreateSandboxRequest {
            network: Some("pkgs".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = a.sandbox.id.as_str().to_owned();
    install_scripts(&ts.client, &a).await;
    let out = raw(
        &ts.client,
        &a,
        "GET http://pkgs.test/before HTTP/1.1\\r\\n\\r\\n",
    )
    .await;
    assert!(out.contains("origin saw: GET /before"), "{out}");
    ts.stop().await;

    // a new server on the same data dir serves the surviving sandbox again
    let ts = common::start_cfg(config_with_pkgs(&data, origin)).await;
    let client = &ts.client;
    let state = client.get_sandbox(&id).await.unwrap().state;
    assert!(!state.is_terminal(), "{state:?}");
    let out = raw(
        client,
        &a,
        "GET http://pkgs.test/after HTTP/1.1\\r\\n\\r\\n",
    )
    .await;
    assert!(out.contains("origin saw: GET /after"), "{out}");
    let out = raw(client, &a, "GET http://other.test/ HTTP/1.1\\r\\n\\r\\n").await;
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    let events = wait_denials(client, &id, 1).await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["host"], "other.test");

    // new compute (hibernate, then wake) gets the same rules from the record
    client
        .sandbox_action(&id, "release", a.lease.as_ref().map(|l| l.token))
        .await
        .unwrap();
    let h = client.sandbox_action(&id, "hibernate", None).await.unwrap();
    assert_eq!(h.state, aviary_core::SandboxState::Hibernating);
    let w = client.sandbox_action(&id, "wake", None).await.unwrap();
    assert!(!w.state.is_terminal(), "{:?}", w.state);
    let mut unleased = a.clone();
    unleased.lease = None;
    install_scripts(client, &unleased).await;
    let out = raw(
        client,
        &unleased,
        "GET http://pkgs.test/woken HTTP/1.1\\r\\n\\r\\n",
    )
    .await;
    assert!(out.contains("origin saw: GET /woken"), "{out}");
    let out = raw(
        client,
        &unleased,
        "GET http://10.0.0.1/ HTTP/1.1\\r\\n\\r\\n",
    )
    .await;
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    client.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_profiles_are_enforced_by_the_node() {
    let origin = origin();
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let cfg = config_with_pkgs(&dir.path().join("d"), origin);
    let ts = common::start_cfg(cfg).await;
    let client = &ts.client;
    let port = origin.port();
    let create = |network: &str| CreateSandboxRequest {
        network: Some(network.into()),
        ..Default::default()
    };

    // --- allowlist: the allowed domain over plain HTTP and CONNECT
    let a = client.create_sandbox(&create("pkgs")).await.unwrap();
    let a_id = a.sandbox.id.as_str().to_owned();
    assert_eq!(a.sandbox.network_profile, NetworkProfile::Allowlist);
    install_scripts(client, &a).await;
    let env = run(client, &a, "env | grep -i _proxy | sort").await.stdout;
    assert!(env.contains("HTTP_PROXY=http://127.0.0.1:3128"), "{env}");
    assert!(env.contains("https_proxy=http://127.0.0.1:3128"), "{env}");
    assert!(env.contains("NO_PROXY=localhost,127.0.0.1"), "{env}");
    // an ordinary client, through the proxy env alone
    let r = run(
        client,
        &a,
        "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://pkgs.test/simple/pip/').read().decode())\"",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    assert!(
        r.stdout.contains("origin saw: GET /simple/pip/ HTTP/1.1"),
        "{r:?}"
    );
    let out = raw(
        client,
        &a,
        "CONNECT pkgs.test:443 HTTP/1.1\\r\\nHost: pkgs.test:443\\r\\n\\r\\nGET /tunnelled HTTP/1.1\\r\\nHost: pkgs.test\\r\\n\\r\\n",
    )
    .await;
    assert!(
        out.starts_with("HTTP/1.1 200 Connection established"),
        "{out}"
    );
    assert!(out.contains("origin saw: GET /tunnelled HTTP/1.1"), "{out}");
    let out = raw(
        client,
        &a,
        "GET http://files.pkgs.test/f.whl HTTP/1.1\\r\\n\\r\\n",
    )
    .await;
    assert!(out.contains("origin saw: GET /f.whl"), "{out}");
    assert!(denials(client, &a_id).await.is_empty());
    assert!(
        !client.get_sandbox(&a_id).await.unwrap().tainted,
        "allowed egress tainted"
    );

    // --- refusals: 403 from the proxy, one event each, the sandbox tainted
    let refused = [
        (
            "GET http://other.test/ HTTP/1.1\\r\\n\\r\\n",
            "other.test",
            "not on the allow list",
        ),
        (
            "GET http://blocked.pkgs.test/ HTTP/1.1\\r\\n\\r\\n",
            "blocked.pkgs.test",
            "deny rule",
        ),
        (
            "POST http://pkgs.test/upload HTTP/1.1\\r\\nContent-Length: 0\\r\\n\\r\\n",
            "pkgs.test",
            "method POST",
        ),
        (
            "CONNECT 169.254.169.254:80 HTTP/1.1\\r\\n\\r\\n",
            "169.254.169.254",
            "metadata",
        ),
        (
            "GET http://10.0.0.1/ HTTP/1.1\\r\\n\\r\\n",
            "10.0.0.1",
            "private",
        ),
        (
            &format!("GET http://0x7f000001:{port}/ HTTP/1.1\\r\\n\\r\\n"),
            "0x7f000001",
            "loopback",
        ),
        (
            &format!("GET http://2130706433:{port}/ HTTP/1.1\\r\\n\\r\\n"),
            "2130706433",
            "loopback",
        ),
        (
            &format!("CONNECT [::ffff:127.0.0.1]:{port} HTTP/1.1\\r\\n\\r\\n"),
            "[::ffff:127.0.0.1]",
            "loopback",
        ),
        (
            "GET http://0xa9fea9fe/latest/meta-data/ HTTP/1.1\\r\\n\\r\\n",
            "0xa9fea9fe",
            "metadata",
        ),
    ];
    for (req, _, _) in &refused {
        let out = raw(client, &a, req).await;
        assert!(out.starts_with("HTTP/1.1 403"), "{req}: {out}");
        assert!(!out.contains("origin saw"), "{req}: {out}");
    }
    // events are written by a background task: wait for all of them
    let events = wait_denials(client, &a_id, refused.len()).await;
    assert_eq!(events.len(), refused.len(), "{events:#?}");
    for (e, (req, host, why)) in events.iter().zip(&refused) {
        assert_eq!(e["sandbox"], a_id.as_str(), "{e}");
        assert_eq!(e["profile"], "pkgs", "{e}");
        assert_eq!(e["host"], *host, "{req}: {e}");
        assert!(e["reason"].as_str().unwrap().contains(why), "{req}: {e}");
        assert!(e["port"].as_u64().unwrap() > 0, "{e}");
        assert!(req.starts_with(e["method"].as_str().unwrap()), "{req}: {e}");
    }
    let s = client.get_sandbox(&a_id).await.unwrap();
    assert!(s.tainted, "egress denials did not taint");
    // no way around the proxy: no route out, the host's loopback is not its own
    for (host, p) in [("10.0.0.1", 80), ("1.1.1.1", 443), ("127.0.0.1", port)] {
        let r = run(client, &a, &format!("python3 /tmp/direct.py {host} {p}")).await;
        assert!(r.stdout.starts_with("refused"), "{host}:{p}: {r:?}");
    }

    // --- another allowlist sandbox: its own socket only, its own denials
    let c = client.create_sandbox(&create("pkgs")).await.unwrap();
    let c_id = c.sandbox.id.as_str().to_owned();
    install_scripts(client, &c).await;
    let r = run(client, &c, "ls -A /.aviary/egress").await;
    assert_eq!(r.stdout.trim(), "proxy.sock", "{r:?}");
    let a_socket = ts
        .server_cfg()
        .runtime_state_dir()
        .join(&a_id)
        .join("egress/proxy.sock");
    assert!(
        a_socket.exists(),
        "{} missing on the host",
        a_socket.display()
    );
    let r = run(
        client,
        &c,
        &format!(
            "test -e {p} || test -e /proc/1/root{p} && echo visible || echo absent; \
             grep -c {a_id} /proc/self/mountinfo || true",
            p = a_socket.display()
        ),
    )
    .await;
    assert!(r.stdout.starts_with("absent"), "{r:?}");
    assert_eq!(r.stdout.lines().nth(1), Some("0"), "{r:?}");
    let out = raw(client, &c, "GET http://other.test/ HTTP/1.1\\r\\n\\r\\n").await;
    assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    let c_events = wait_denials(client, &c_id, 1).await;
    assert_eq!(c_events.len(), 1, "{c_events:#?}");
    assert_eq!(c_events[0]["sandbox"], c_id.as_str());
    assert_eq!(denials(client, &a_id).await.len(), refused.len());

    // --- none: no socket, nothing on 3128, no proxy env, no route out
    let b = client.create_sandbox(&create("none")).await.unwrap();
    assert_eq!(b.sandbox.network_profile, NetworkProfile::None);
    install_scripts(client, &b).await;
    let r = run(client, &b, "ls /.aviary/egress 2>&1; env | grep -ci _proxy").await;
    assert!(r.stdout.contains("No such file"), "{r:?}");
    assert_eq!(r.stdout.lines().last(), Some("0"), "{r:?}");
    for (host, p) in [("127.0.0.1", 3128), ("10.0.0.1", 80), ("1.1.1.1", 443)] {
        let r = run(client, &b, &format!("python3 /tmp/direct.py {host} {p}")).await;
        assert!(r.stdout.starts_with("refused"), "{host}:{p}: {r:?}");
    }
    let r = run(client, &b, "cat /proc/net/route | wc -l; ls /sys/class/net").await;
    assert_eq!(
        r.stdout.split_whitespace().collect::<Vec<_>>(),
        ["1", "lo"],
        "{r:?}"
    );

    // --- open: refused with a clear error (no enforcement on this node yet)
    let e = client.create_sandbox(&create("open")).await.unwrap_err();
    assert!(e.to_string().contains("not available"), "{e}");

    for s in [&a, &b, &c] {
        client
            .delete_sandbox(s.sandbox.id.as_str(), s.lease.as_ref().map(|l| l.token))
            .await
            .unwrap();
    }
    // its dir (and the socket in it) goes with the background reclaim
    ts.cp().reclaims.settled().await;
    assert!(!a_socket.exists(), "the proxy socket outlived its sandbox");
}

/// Packets the `open` firewall in `pid`'s network namespace refused, by
/// destination range (from the host: iptables' own counters).
fn rejected(pid: &str) -> BTreeMap<String, u64> {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args(["iptables", "-w", "-L", "OUTPUT", "-v", "-n", "-x"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| l.contains("REJECT"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // pkts bytes target prot opt in out source destination
            (f[8].to_owned(), f[0].parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn open_is_nat_through_slirp_with_the_denied_ranges_refused() {
    let have = |p: &str| {
        std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .any(|d| d.join(p).is_file())
    };
    if !have("slirp4netns") || !have("iptables-restore") || !have("nsenter") {
        eprintln!("SKIP open_is_nat_through_slirp: slirp4netns/iptables/nsenter not installed (scripts/deps.sh installs them)");
        return;
    }
    let origin = origin();
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = config_with_pkgs(&dir.path().join("d"), origin);
    cfg.control.settings.server.open_network = true;
    let ts = common::start_cfg(cfg).await;
    let client = &ts.client;
    let o = client
        .create_sandbox(&CreateSandboxRequest {
            network: Some("open".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = o.sandbox.id.as_str().to_owned();
    assert_eq!(o.sandbox.network_profile, NetworkProfile::Open);
    install_scripts(client, &o).await;
    // a real interface and a default route, and no proxy env
    let r = run(client, &o, "ls /sys/class/net; awk 'NR>1 && $2==\"00000000\" {print \"default\", $1}' /proc/net/route; env | grep -ci _proxy").await;
    let words: Vec<&str> = r.stdout.split_whitespace().collect();
    assert!(words.contains(&"tap0"), "{r:?}");
    assert!(r.stdout.contains("default tap0"), "{r:?}");
    assert_eq!(words.last(), Some(&"0"), "{r:?}");
    // names resolve through slirp's forwarder, the one private address allowed
    let r = run(client, &o, "cat /etc/resolv.conf").await;
    assert_eq!(r.stdout.trim(), "nameserver 10.0.2.3", "{r:?}");
    let pid = std::fs::read_to_string(
        ts.server_cfg()
            .runtime_state_dir()
            .join(&id)
            .join("init.pid"),
    )
    .unwrap()
    .trim()
    .to_owned();
    let slirp_pid = std::fs::read_to_string(
        ts.server_cfg()
            .runtime_state_dir()
            .join(&id)
            .join("control/slirp4netns.pid"),
    )
    .unwrap()
    .trim()
    .to_owned();
    // a DNS query to the forwarder passes the firewall (no answer needed:
    // this host has no upstream resolver). The socket stays open a while for
    // the forwarder's answer: a reply that found it closed would make the
    // sandbox's kernel send an ICMP error to 10.0.2.3, which the firewall
    // rightly refuses and counts.
    let before = rejected(&pid);
    let r = run(client, &o, "python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3); s.sendto(b'\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x04test\\x00\\x00\\x01\\x00\\x01', ('10.0.2.3', 53)); print('sent')\ntry: s.recvfrom(512)\nexcept OSError: pass\"").await;
    assert_eq!(r.stdout.trim(), "sent", "{r:?}");
    assert_eq!(
        rejected(&pid)["10.0.0.0/8"],
        before["10.0.0.0/8"],
        "the DNS query was refused: {before:?}"
    );

    // the always-denied ranges: refused by the firewall in its namespace
    for (host, p, range) in [
        ("10.0.2.2", origin.port(), "10.0.0.0/8"), // slirp's gateway = the host's loopback
        ("169.254.169.254", 80, "169.254.0.0/16"),
        ("10.0.0.1", 80, "10.0.0.0/8"),
        ("192.168.1.1", 80, "192.168.0.0/16"),
        ("100.64.0.1", 80, "100.64.0.0/10"),
        ("192.0.2.2", origin.port(), "192.0.2.0/24"),
    ] {
        let seen = rejected(&pid)[range];
        let r = run(client, &o, &format!("python3 /tmp/direct.py {host} {p}")).await;
        assert!(r.stdout.starts_with("refused"), "{host}:{p}: {r:?}");
        assert!(
            rejected(&pid)[range] > seen,
            "{host} not refused by the {range} rule"
        );
    }
    // its own loopback is its own: the host's services are not there
    let r = run(
        client,
        &o,
        &format!("python3 /tmp/direct.py 127.0.0.1 {}", origin.port()),
    )
    .await;
    assert!(r.stdout.starts_with("refused"), "{r:?}");
    // a public address leaves through slirp's NAT (no firewall rule fires;
    // this host has no internet, so the connection itself fails beyond it)
    let seen: u64 = rejected(&pid).values().sum();
    let tx = |r: &ExecResult| r.stdout.trim().parse::<u64>().unwrap();
    let tx_before = tx(&run(client, &o, "cat /sys/class/net/tap0/statistics/tx_packets").await);
    let _ = run(client, &o, "python3 /tmp/direct.py 1.1.1.1 80").await;
    let tx_after = tx(&run(client, &o, "cat /sys/class/net/tap0/statistics/tx_packets").await);
    assert_eq!(
        rejected(&pid).values().sum::<u64>(),
        seen,
        "a public address was refused"
    );
    assert!(tx_after > tx_before, "nothing left through tap0");
    // the sandbox cannot change its firewall (no CAP_NET_ADMIN)
    let r = run(client, &o, "cat /proc/self/status | grep CapEff").await;
    let caps = u64::from_str_radix(r.stdout.split_whitespace().nth(1).unwrap(), 16).unwrap();
    assert_eq!(caps & (1 << 12), 0, "CAP_NET_ADMIN inside: {r:?}");

    client
        .delete_sandbox(&id, o.lease.as_ref().map(|l| l.token))
        .await
        .unwrap();
    ts.cp().reclaims.settled().await;
    assert!(
        !std::path::Path::new(&format!("/proc/{slirp_pid}/cmdline")).exists()
            || !std::fs::read(format!("/proc/{slirp_pid}/cmdline"))
                .unwrap_or_default()
                .starts_with(b"slirp4netns"),
        "slirp4netns outlived its sandbox"
    );
}
