//! The security suite per isolation tier (issue 11): the project's own
//! escape and abuse probes — capabilities, mounts, /proc and /sys, devices,
//! kernel interfaces, namespaces, envd (PID 1), another tenant's sandbox,
//! the host's services, resource bombs and the network profiles — run from
//! inside real sandboxes of every tier this machine has, through the real
//! server API. A tier is only the create's `runtime` field, so the suite
//! covers whatever runtime the server can be configured with: adding a tier
//! is one line in [`TIERS`].
//!
//! Each probe attempts the attack for real and reports per check whether it
//! was contained (`security/probe.py` holds the in-sandbox half; every
//! attempt is one that would change nothing on the host if it succeeded).
//! The test prints a table tier × probe → contained / skipped (why) /
//! ESCAPED (what), then fails if anything escaped, broke, or (under
//! `AVIARY_REQUIRE_SERVICES=1`) a tier's runtime is missing.
//! API-level abuse (other tenants on every route, bad input, envd socket
//! redirection) lives in `adversarial.rs`.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::{Client, ClientError};
use aviary_config::NetworkProfileDef;
use aviary_core::api::{CreateSandboxRequest, ExecRequest, ExecResult};
use aviary_core::{ErrorCode, NetworkProfile, RuntimeName};
use aviary_server::config::ServerConfig;
use futures_util::future::join_all;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One isolation tier: a runtime the server can drive.
struct Tier {
    /// The runtime's name in `[server] runtimes` and a create's `runtime`.
    name: &'static str,
    /// What this machine needs to run the tier.
    needs: Needs,
    /// Server configuration the tier needs beyond being listed.
    configure: fn(&mut ServerConfig),
    /// Probes that do not apply to the tier, each with the reason.
    not_applicable: &'static [(&'static str, &'static str)],
    /// Known, documented weaknesses (README "Security suite"): a probe, one
    /// of its checks (`*`: any), and why it is not fixed. Only that check
    /// may fail; the table shows it as KNOWN GAP, loudly.
    known_gaps: &'static [(&'static str, &'static str, &'static str)],
}

enum Needs {
    /// A binary on `PATH` that answers `--version`.
    Binary(&'static str),
    /// A dockerd answering on `AVIARY_DOCKER_HOST` (`scripts/services.sh`).
    DockerSocket,
}

fn as_listed(_: &mut ServerConfig) {}

/// The test's own dockerd (`scripts/services.sh` exports its socket).
fn docker_host() -> Option<std::path::PathBuf> {
    std::env::var_os("AVIARY_DOCKER_HOST")
        .map(std::path::PathBuf::from)
        .filter(|p| p.exists())
}

fn docker_socket(cfg: &mut ServerConfig) {
    if let Some(p) = docker_host() {
        cfg.control.settings.server.docker_socket = p;
    }
}

/// Every tier the suite knows; the ones whose runtime is present run.
const TIERS: &[Tier] = &[
    Tier {
        name: "crun",
        needs: Needs::Binary("crun"),
        configure: as_listed,
        not_applicable: &[],
        known_gaps: &[],
    },
    Tier {
        name: "runc",
        needs: Needs::Binary("runc"),
        configure: as_listed,
        not_applicable: &[],
        known_gaps: &[],
    },
    Tier {
        name: "runsc",
        needs: Needs::Binary("runsc"),
        configure: as_listed,
        not_applicable: &[
            (
                "envd_pid1",
                "NOT RUN, KNOWN GAP: under gVisor a signal from root inside ends envd (PID 1) \
                 and with it the sandbox (README \"Security suite\")",
            ),
            (
                "namespaces",
                "gVisor's kernel has no /proc/PID/ns/{cgroup,ipc,mnt,uts} and numbers its \
                 namespaces itself: no comparison with the host's can be made",
            ),
        ],
        known_gaps: &[
            (
                "capabilities",
                "self NoNewPrivs",
                "gVisor's /proc/PID/status shows no NoNewPrivs and no seccomp filter: Aviary's \
                 profile is not applied inside (no --oci-seccomp)",
            ),
            (
                "capabilities",
                "self seccomp filter",
                "gVisor's /proc/PID/status shows no NoNewPrivs and no seccomp filter: Aviary's \
                 profile is not applied inside (no --oci-seccomp)",
            ),
            (
                "capabilities",
                "1 NoNewPrivs",
                "gVisor's /proc/PID/status shows no NoNewPrivs and no seccomp filter: Aviary's \
                 profile is not applied inside (no --oci-seccomp)",
            ),
            (
                "capabilities",
                "1 seccomp filter",
                "gVisor's /proc/PID/status shows no NoNewPrivs and no seccomp filter: Aviary's \
                 profile is not applied inside (no --oci-seccomp)",
            ),
            (
                "devices",
                "*",
                "gVisor's emulated /dev and /proc/sys (the Sentry's, not the host's): the \
                 nodes and writes are allowed there; not yet shown harmless per file",
            ),
            (
                "proc_sys",
                "*",
                "gVisor's emulated /dev and /proc/sys (the Sentry's, not the host's): the \
                 nodes and writes are allowed there; not yet shown harmless per file",
            ),
            (
                "kernel_syscalls",
                "*",
                "Aviary's seccomp profile is not applied inside gVisor (runsc runs \
                 without --oci-seccomp): the Sentry implements these calls itself",
            ),
            (
                "syscall_abis",
                "*",
                "Aviary's seccomp profile is not applied inside gVisor (runsc runs \
                 without --oci-seccomp): the Sentry implements these calls itself",
            ),
            (
                "fork_bomb",
                "*",
                "a bomb ends the whole gVisor sandbox (envd goes with it), not just the \
                 bomb: the host and the other sandboxes are unaffected (aftermath)",
            ),
            (
                "memory_bomb",
                "*",
                "a bomb ends the whole gVisor sandbox (envd goes with it), not just the \
                 bomb: the host and the other sandboxes are unaffected (aftermath)",
            ),
            (
                "fd_exhaustion",
                "*",
                "a bomb ends the whole gVisor sandbox (envd goes with it), not just the \
                 bomb: the host and the other sandboxes are unaffected (aftermath)",
            ),
            (
                "disk_fill",
                "*",
                "a bomb ends the whole gVisor sandbox (envd goes with it), not just the \
                 bomb: the host and the other sandboxes are unaffected (aftermath)",
            ),
        ],
    },
    Tier {
        name: "docker",
        needs: Needs::DockerSocket,
        configure: docker_socket,
        not_applicable: &[],
        known_gaps: &[
            (
                "namespaces",
                "own user namespace",
                "Docker has no per-container user namespace unless dockerd runs with \
                 userns-remap: root inside is host root, held back by the capability set, \
                 seccomp and no-new-privileges only",
            ),
            (
                "disk_fill",
                "fill /var/tmp/aviary-fill",
                "the container's writable layer is dockerd's overlay2 dir, not bounded by \
                 disk_mb (overlay2 size quotas need xfs with pquota under dockerd's data-root)",
            ),
        ],
    },
];

/// The resource class every probe sandbox runs in: small, so the bombs
/// reach its limits quickly.
const CLASS: &str = "security";
const MEMORY_MB: u64 = 512;
const DISK_MB: u64 = 128;
const PIDS: u32 = 128;
/// The allowlist profile of the network probe.
const ALLOW_PROFILE: &str = "security-allow";
const ALLOWED_HOST: &str = "allowed.test";
/// Most files one process in a sandbox may hold open. With the pids limit
/// it bounds a sandbox's share of the host's file table (`fs.file-max`).
const MAX_NOFILE: u64 = 1 << 20;
/// The capabilities root may hold in a sandbox of any tier
/// (`aviary-runtime-oci`'s `CAPABILITIES`): CHOWN, DAC_OVERRIDE, FOWNER,
/// FSETID, KILL, SETGID, SETUID, SETPCAP, NET_BIND_SERVICE, SYS_CHROOT,
/// AUDIT_WRITE.
const ALLOWED_CAPS: [u32; 11] = [0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29];
const PROBE_PY: &str = include_str!("security/probe.py");
const PROBE_PATH: &str = "/tmp/aviary-probe.py";

fn tier_available(t: &Tier) -> Result<(), String> {
    match t.needs {
        Needs::Binary(b) => {
            let ok = std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                Ok(())
            } else {
                Err(format!(
                    "{b} is not installed (scripts/deps.sh installs it)"
                ))
            }
        }
        Needs::DockerSocket => match docker_host() {
            Some(_) => Ok(()),
            None => Err("AVIARY_DOCKER_HOST names no dockerd socket \
                 (scripts/services.sh starts one)"
                .into()),
        },
    }
}

/// What one probe found on one tier.
#[derive(Clone, Debug)]
enum Outcome {
    Contained(usize),
    Skipped(String),
    /// Every failed check is one of the tier's documented known gaps.
    KnownGap(Vec<String>),
    Escaped(Vec<String>),
    /// The probe itself could not run (no answer, unparsable output).
    Broken(String),
}

impl Outcome {
    fn cell(&self) -> String {
        match self {
            Outcome::Contained(n) => format!("contained ({n})"),
            Outcome::Skipped(why) => format!("skipped: {why}"),
            Outcome::KnownGap(what) => format!("KNOWN GAP ({})", what.len()),
            Outcome::Escaped(what) => format!("ESCAPED ({})", what.len()),
            Outcome::Broken(_) => "BROKEN".into(),
        }
    }
    fn failed(&self) -> bool {
        matches!(self, Outcome::Escaped(_) | Outcome::Broken(_))
    }
}

/// The probe's JSON line: every check contained → contained.
fn judge(r: &ExecResult) -> Outcome {
    let Some(line) = r.stdout.lines().rev().find(|l| l.starts_with('{')) else {
        return Outcome::Broken(format!(
            "no answer (exit {}): {}{}",
            r.exit_code, r.stdout, r.stderr
        ));
    };
    let v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return Outcome::Broken(format!("{e}: {line}")),
    };
    if let Some(why) = v["skipped"].as_str() {
        return Outcome::Skipped(why.to_owned());
    }
    let Some(checks) = v["checks"].as_array() else {
        return Outcome::Broken(format!("no checks: {line}"));
    };
    if checks.is_empty() {
        return Outcome::Broken("the probe checked nothing".into());
    }
    let escaped: Vec<String> = checks
        .iter()
        .filter(|c| c["contained"] != Value::Bool(true))
        .map(|c| format!("{}: {}", c["name"], c["detail"]))
        .collect();
    if escaped.is_empty() {
        Outcome::Contained(checks.len())
    } else {
        Outcome::Escaped(escaped)
    }
}

/// What each check of a probe saw (for the notes the bombs print).
fn details(r: &ExecResult) -> Vec<String> {
    let line = r
        .stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or("{}");
    let v: Value = serde_json::from_str(line).unwrap_or_default();
    v["checks"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    format!(
                        "{}: {}",
                        c["name"].as_str().unwrap_or(""),
                        c["detail"].as_str().unwrap_or("")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn run(c: &Client, id: &str, argv: &[&str], timeout_s: f64) -> Result<ExecResult, String> {
    let req = ExecRequest {
        cmd: Some(argv.iter().map(|s| s.to_string()).collect()),
        timeout_s: Some(timeout_s),
        ..Default::default()
    };
    c.exec(id, &req).await.map_err(|e| format!("exec: {e}"))
}

/// Runs `probe.py MODE ARG` in a sandbox.
async fn py(c: &Client, id: &str, mode: &str, arg: &Value) -> Result<ExecResult, String> {
    let arg = arg.to_string();
    run(c, id, &["python3", PROBE_PATH, mode, &arg], 300.0).await
}

async fn py_probe(c: &Client, id: &str, mode: &str, arg: Value) -> Outcome {
    match py(c, id, mode, &arg).await {
        Ok(r) => {
            // `AVIARY_SECURITY_VERBOSE=1`: every check with what it saw
            if std::env::var_os("AVIARY_SECURITY_VERBOSE").is_some() {
                for d in details(&r) {
                    eprintln!("check {id} {mode}: {d}");
                }
            }
            judge(&r)
        }
        Err(e) => Outcome::Broken(e),
    }
}

/// The sandbox still runs commands (after a bomb).
async fn answers(c: &Client, id: &str) -> Result<(), String> {
    let r = run(c, id, &["echo", "alive"], 60.0).await?;
    if r.exit_code == 0 && r.stdout == "alive\n" {
        Ok(())
    } else {
        Err(format!("answered {r:?}"))
    }
}

/// A host TCP or unix listener that counts every connection it accepts.
struct HostServices {
    tcp: Vec<(String, u16)>,
    unix: Vec<String>,
    abstract_names: Vec<String>,
    accepted: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

/// Counts every connection `accept` returns, on a thread of its own.
fn count_accepts<S>(
    accept: impl Fn() -> std::io::Result<S> + Send + 'static,
    accepted: Arc<AtomicUsize>,
) {
    std::thread::spawn(move || loop {
        if accept().is_ok() {
            accepted.fetch_add(1, Ordering::SeqCst);
        }
    });
}

fn host_addresses() -> Vec<String> {
    let out = std::process::Command::new("hostname")
        .arg("-I")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    out.split_whitespace().map(str::to_owned).collect()
}

/// Listeners on the host's loopback, on every address, on a unix socket
/// path and on an abstract unix socket, plus the server's own port.
fn host_services(server_port: u16) -> HostServices {
    use std::os::linux::net::SocketAddrExt;
    let accepted = Arc::new(AtomicUsize::new(0));
    let mut tcp = Vec::new();
    let lo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    tcp.push(("127.0.0.1".to_owned(), lo.local_addr().unwrap().port()));
    let any4 = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let p4 = any4.local_addr().unwrap().port();
    tcp.push(("127.0.0.1".to_owned(), p4));
    let any6 = std::net::TcpListener::bind("[::]:0").ok();
    let p6 = any6.as_ref().map(|l| l.local_addr().unwrap().port());
    if let Some(p6) = p6 {
        tcp.push(("::1".to_owned(), p6));
    }
    for ip in host_addresses() {
        if ip.contains(':') {
            if let Some(p6) = p6 {
                tcp.push((ip, p6));
            }
        } else {
            tcp.push((ip, p4));
        }
    }
    tcp.push(("127.0.0.1".to_owned(), server_port));
    for l in [Some(lo), Some(any4), any6].into_iter().flatten() {
        count_accepts(move || l.accept(), accepted.clone());
    }
    let dir = tempfile::Builder::new()
        .prefix("avsec")
        .tempdir_in("/tmp")
        .unwrap();
    let path = dir.path().join("host.sock");
    let ul = std::os::unix::net::UnixListener::bind(&path).unwrap();
    count_accepts(move || ul.accept(), accepted.clone());
    let name = format!("aviary-host-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let al = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    count_accepts(move || al.accept(), accepted.clone());
    HostServices {
        tcp,
        unix: vec![path.display().to_string()],
        abstract_names: vec![name],
        accepted,
        _dir: dir,
    }
}

/// A loopback HTTP origin on the host standing in for the allowlist's
/// allowed domain: answers every request with `allowed origin`.
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
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\nConnection: close\r\n\r\nallowed origin",
                );
            });
        }
    });
    addr
}

/// What the namespace probe compares the inside with.
fn host_view() -> Value {
    let ns: BTreeMap<&str, String> = ["pid", "net", "mnt", "uts", "ipc", "cgroup", "user"]
        .into_iter()
        .map(|k| {
            let l = std::fs::read_link(format!("/proc/self/ns/{k}")).unwrap();
            (k, l.display().to_string())
        })
        .collect();
    let comm = std::fs::read_to_string("/proc/self/comm")
        .unwrap()
        .trim()
        .to_owned();
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned();
    json!({
        "host_ns": ns,
        "host_pid": std::process::id(),
        "host_comm": comm,
        "host_comms": [comm, "cargo", "systemd", "sshd", "dockerd", "containerd", "kthreadd", "rustc"],
        "host_hostname": hostname,
    })
}

/// The sandboxes of one tier's run.
struct TierSandboxes {
    attacker: String,
    peer: String,
    bombs: String,
    allowlist: Option<String>,
}

struct Suite {
    ts: common::TestServer,
    attacker: Client,
    peer: Client,
    host: HostServices,
}

impl Suite {
    async fn sandbox(
        &self,
        c: &Client,
        tier: &str,
        network: Option<&str>,
    ) -> Result<String, String> {
        let created = c
            .create_sandbox(&CreateSandboxRequest {
                class: Some(CLASS.into()),
                runtime: Some(tier.into()),
                network: network.map(str::to_owned),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("create on {tier}: {e}"))?;
        let id = created.sandbox.id.to_string();
        if created.sandbox.runtime != tier {
            return Err(format!("asked for {tier}, got {}", created.sandbox.runtime));
        }
        c.write_file(&id, PROBE_PATH, PROBE_PY.as_bytes().to_vec(), None)
            .await
            .map_err(|e| format!("upload the probe: {e}"))?;
        Ok(id)
    }

    async fn sandboxes(&self, tier: &str, allowlist: bool) -> Result<TierSandboxes, String> {
        Ok(TierSandboxes {
            attacker: self.sandbox(&self.attacker, tier, None).await?,
            peer: self.sandbox(&self.peer, tier, None).await?,
            bombs: self.sandbox(&self.attacker, tier, None).await?,
            allowlist: if allowlist {
                Some(
                    self.sandbox(&self.attacker, tier, Some(ALLOW_PROFILE))
                        .await?,
                )
            } else {
                None
            },
        })
    }
}

/// Another tenant's sandbox: its secret planted everywhere a sandbox could
/// leak it, then looked for from the attacker's sandbox and via the API.
async fn probe_peer(s: &Suite, tier: &str, sb: &TierSandboxes) -> Vec<(&'static str, Outcome)> {
    let secret = format!("aviary-secret-{}-{tier}", std::process::id());
    let arg = json!({
        "secret": secret,
        "port": 7777,
        "abstract": format!("aviary-peer-{secret}"),
        "shm_key": 0x5ec0,
    });
    let planted = match py(&s.peer, &sb.peer, "victim", &arg).await {
        Ok(r) if r.stdout.contains("\"ready\": true") => {
            py_probe(&s.peer, &sb.peer, "self_reach", arg.clone()).await
        }
        Ok(r) => Outcome::Broken(format!("the peer did not start: {r:?}")),
        Err(e) => Outcome::Broken(e),
    };
    if planted.failed() {
        return vec![
            ("other_sandbox", planted.clone()),
            ("other_tenant_api", planted),
        ];
    }
    let rt = s.ts.cp().runtimes.get(tier).expect("the tier's runtime");
    let mut host_paths = Vec::new();
    if let Ok(ep) = rt.runtime.envd_endpoint(&sb.peer.parse().unwrap()).await {
        host_paths.push(ep.socket.display().to_string());
        host_paths.push(format!("/proc/{}/root/workspace/secret", ep.peer_pid));
        if let Some(dir) = ep.socket.parent().and_then(|d| d.parent()) {
            host_paths.push(dir.display().to_string());
        }
    }
    let mut peer_arg = arg.clone();
    peer_arg["host_paths"] = json!(host_paths);
    let files = py_probe(&s.attacker, &sb.attacker, "peer", peer_arg).await;

    // the API: the peer's id under the attacker's key is not found
    let mut checks = 0;
    let mut escaped = Vec::new();
    let mut expect_404 = |what: &str, r: Result<String, ClientError>| {
        checks += 1;
        match r {
            Err(ClientError::Api {
                status: 404,
                code: ErrorCode::NotFound,
                ..
            }) => {}
            other => escaped.push(format!("{what}: {other:?}")),
        }
    };
    let a = &s.attacker;
    let id = &sb.peer;
    expect_404("get", a.get_sandbox(id).await.map(|s| format!("{s:?}")));
    expect_404(
        "exec",
        a.exec(id, &common::shell("cat /workspace/secret"))
            .await
            .map(|r| r.stdout),
    );
    expect_404(
        "read_file",
        a.read_file(id, "/workspace/secret")
            .await
            .map(|b| String::from_utf8_lossy(&b).to_string()),
    );
    expect_404(
        "write_file",
        a.write_file(id, "/workspace/secret", b"pwned".to_vec(), None)
            .await
            .map(|_| "written".into()),
    );
    expect_404(
        "acquire_lease",
        a.acquire_lease(id, "attacker", Some(30))
            .await
            .map(|l| format!("{l:?}")),
    );
    expect_404(
        "delete",
        a.delete_sandbox(id, None).await.map(|_| "deleted".into()),
    );
    checks += 1;
    match a.list_sandboxes(true).await {
        Ok(list) if list.sandboxes.iter().any(|x| x.id.as_str() == id) => {
            escaped.push("the attacker's listing shows the peer".into())
        }
        Ok(_) => {}
        Err(e) => escaped.push(format!("list: {e}")),
    }
    // …and the peer is as it was
    checks += 1;
    match s
        .peer
        .exec(id, &common::shell("cat /workspace/secret"))
        .await
    {
        Ok(r) if r.stdout == secret => {}
        other => escaped.push(format!("the peer changed: {other:?}")),
    }
    let api = if escaped.is_empty() {
        Outcome::Contained(checks)
    } else {
        Outcome::Escaped(escaped)
    };
    vec![("other_sandbox", files), ("other_tenant_api", api)]
}

async fn probe_host(s: &Suite, sb: &TierSandboxes) -> Outcome {
    let before = s.host.accepted.load(Ordering::SeqCst);
    let data = s.ts.data.display().to_string();
    let arg = json!({
        "tcp": s.host.tcp,
        "unix": s.host.unix,
        "abstract": s.host.abstract_names,
        "absent": [data, common::template_cache().display().to_string(),
                   s.ts.server_cfg().registry_path().display().to_string()],
    });
    let out = py_probe(&s.attacker, &sb.attacker, "host", arg).await;
    let after = s.host.accepted.load(Ordering::SeqCst);
    match out {
        Outcome::Contained(n) if after == before => Outcome::Contained(n + 1),
        Outcome::Contained(_) => Outcome::Escaped(vec![format!(
            "the host's listeners accepted {} connections",
            after - before
        )]),
        other => other,
    }
}

/// Resource bombs, one after another in their own sandbox; after each the
/// sandbox must still answer.
async fn probe_bombs(s: &Suite, tier: &str, sb: &TierSandboxes) -> Vec<(&'static str, Outcome)> {
    let c = &s.attacker;
    let id = &sb.bombs;
    let limits = json!({
        "pids": PIDS,
        "memory_mb": MEMORY_MB,
        "disk_mb": DISK_MB,
        "max_nofile": MAX_NOFILE,
    });
    let mut out = Vec::new();
    for (name, mode) in [
        ("fork_bomb", "forkbomb"),
        ("memory_bomb", "membomb"),
        ("fd_exhaustion", "fdbomb"),
        ("disk_fill", "diskfill"),
    ] {
        let mut outcome = match py(c, id, mode, &limits).await {
            Ok(r) if r.exit_code == 137 || r.oom_killed => {
                eprintln!(
                    "note {tier} {name}: killed inside (exit {}, oom_killed {})",
                    r.exit_code, r.oom_killed
                );
                Outcome::Contained(1) // killed by the memory limit, inside
            }
            Ok(r) => {
                for d in details(&r) {
                    eprintln!("note {tier} {name}: {d}");
                }
                judge(&r)
            }
            Err(e) => Outcome::Broken(e),
        };
        if let Err(e) = answers(c, id).await {
            outcome = Outcome::Escaped(vec![format!("the sandbox stopped answering: {e}")]);
        }
        out.push((name, outcome));
    }
    out
}

async fn probe_allowlist(s: &Suite, id: &str) -> Outcome {
    let before = s.host.accepted.load(Ordering::SeqCst);
    let (lo_host, lo_port) = s.host.tcp[0].clone();
    let arg = json!({
        "allowed": ALLOWED_HOST,
        "denied_requests": [
            format!("http://{lo_host}:{lo_port}/"),
            format!("http://localhost:{lo_port}/"),
            "http://169.254.169.254/latest/meta-data/".to_string(),
            format!("http://0x7f000001:{lo_port}/"),
            "http://denied.test/".to_string(),
        ],
        "denied_connects": [format!("{lo_host}:{lo_port}"), "169.254.169.254:443".to_string()],
        "direct": s.host.tcp,
    });
    let out = py_probe(&s.attacker, id, "allowlist", arg).await;
    let after = s.host.accepted.load(Ordering::SeqCst);
    match out {
        Outcome::Contained(n) if after == before => Outcome::Contained(n + 1),
        Outcome::Contained(_) => Outcome::Escaped(vec![format!(
            "the host's listeners accepted {} connections",
            after - before
        )]),
        other => other,
    }
}

async fn run_tier(s: &Suite, tier: &Tier) -> BTreeMap<&'static str, Outcome> {
    let mut results = BTreeMap::new();
    let rt = s.ts.cp().runtimes.get(tier.name).expect("configured");
    let allowlist = rt.runtime.enforces_network(NetworkProfile::Allowlist);
    let sb = match s.sandboxes(tier.name, allowlist).await {
        Ok(sb) => sb,
        Err(e) => {
            results.insert("setup", Outcome::Broken(e));
            return results;
        }
    };
    let mask: u64 = ALLOWED_CAPS.iter().map(|b| 1u64 << b).sum();
    let mut host = host_view();
    host["envd"] = json!("/.aviary/envd");
    host["data_dir"] = json!(s.ts.data.display().to_string());
    let c = &s.attacker;
    let a = &sb.attacker;
    let in_sandbox = [
        (
            "capabilities",
            "caps",
            json!({"allowed_mask": mask.to_string()}),
        ),
        ("mounts", "mounts", json!({})),
        ("proc_sys", "proc_sys", json!({})),
        ("sys_and_cgroupfs", "sys", json!({})),
        ("devices", "devices", json!({})),
        ("kernel_syscalls", "syscalls", json!({})),
        ("syscall_abis", "abi", json!({})),
        ("envd_pid1", "envd", host.clone()),
        ("chroot_escape", "chroot", host.clone()),
        ("namespaces", "namespaces", host.clone()),
        ("network_none", "network_none", json!({})),
    ];
    // the read-only probes in parallel in one sandbox, beside the peer,
    // host and bomb probes in their own
    // a probe that does not apply is not run either (on runsc the envd
    // probe would end the sandbox the other probes run in)
    let singles = join_all(
        in_sandbox
            .into_iter()
            .filter(|(name, _, _)| !tier.not_applicable.iter().any(|(p, _)| p == name))
            .map(|(name, mode, arg)| async move { (name, py_probe(c, a, mode, arg).await) }),
    );
    let (singles, peer, host_out, bombs) = tokio::join!(
        singles,
        probe_peer(s, tier.name, &sb),
        probe_host(s, &sb),
        probe_bombs(s, tier.name, &sb)
    );
    results.extend(singles);
    results.extend(peer);
    results.insert("host_services", host_out);
    results.extend(bombs);
    results.insert(
        "network_allowlist",
        match &sb.allowlist {
            Some(id) => probe_allowlist(s, id).await,
            None => Outcome::Skipped("the tier does not enforce the allowlist profile".into()),
        },
    );
    // after everything: the peer and the server still answer
    if let Err(e) = answers(&s.peer, &sb.peer).await {
        results.insert(
            "aftermath",
            Outcome::Escaped(vec![format!("the peer: {e}")]),
        );
    } else if let Err(e) = s.ts.client.healthz().await {
        results.insert(
            "aftermath",
            Outcome::Escaped(vec![format!("the server: {e}")]),
        );
    } else {
        results.insert("aftermath", Outcome::Contained(2));
    }
    for (probe, why) in tier.not_applicable {
        results.insert(probe, Outcome::Skipped((*why).to_owned()));
    }
    for (probe, o) in results.iter_mut() {
        let Outcome::Escaped(what) = o else { continue };
        let gap = |w: &String| {
            tier.known_gaps.iter().find(|(p, check, _)| {
                p == probe && (*check == "*" || w.starts_with(&format!("\"{check}\"")))
            })
        };
        if what.iter().all(|w| gap(w).is_some()) {
            let why = what
                .iter()
                .map(|w| format!("{w} [{}]", gap(w).map_or("", |g| g.2)))
                .collect();
            *o = Outcome::KnownGap(why);
        }
    }
    for id in [Some(&sb.attacker), Some(&sb.bombs), sb.allowlist.as_ref()]
        .into_iter()
        .flatten()
    {
        let _ = s.attacker.delete_sandbox(id, None).await;
    }
    let _ = s.peer.delete_sandbox(&sb.peer, None).await;
    results
}

fn print_table(tiers: &[&str], rows: &BTreeMap<&'static str, BTreeMap<&str, Outcome>>) {
    let w0 = rows.keys().map(|k| k.len()).max().unwrap_or(5).max(5);
    let cells: Vec<Vec<String>> = rows
        .values()
        .map(|r| {
            tiers
                .iter()
                .map(|t| r.get(t).map(Outcome::cell).unwrap_or_default())
                .collect()
        })
        .collect();
    let widths: Vec<usize> = (0..tiers.len())
        .map(|i| {
            cells
                .iter()
                .map(|r| r[i].len())
                .chain([tiers[i].len()])
                .max()
                .unwrap_or(4)
        })
        .collect();
    let mut out = format!("\nsecurity suite: tier x probe\n{:w0$}", "probe");
    for (t, w) in tiers.iter().zip(&widths) {
        out.push_str(&format!(" | {t:w$}"));
    }
    out.push('\n');
    for (probe, row) in rows.keys().zip(&cells) {
        out.push_str(&format!("{probe:w0$}"));
        for (c, w) in row.iter().zip(&widths) {
            out.push_str(&format!(" | {c:w$}"));
        }
        out.push('\n');
    }
    for (probe, r) in rows {
        for (tier, o) in r {
            match o {
                Outcome::Escaped(what) => {
                    for w in what {
                        out.push_str(&format!("ESCAPED {tier} {probe}: {w}\n"));
                    }
                }
                Outcome::Broken(why) => out.push_str(&format!("BROKEN {tier} {probe}: {why}\n")),
                Outcome::KnownGap(what) => {
                    for w in what {
                        out.push_str(&format!("KNOWN GAP {tier} {probe}: {w}\n"));
                    }
                }
                _ => {}
            }
        }
    }
    println!("{out}");
}

fn server_config(
    data: &std::path::Path,
    tiers: &[&Tier],
    origin: std::net::SocketAddr,
) -> ServerConfig {
    let mut cfg = common::config(data, "default");
    let names: Vec<RuntimeName> = tiers
        .iter()
        .map(|t| t.name.parse().expect("a tier is a known runtime name"))
        .collect();
    cfg.runtime = names[0];
    cfg.control.settings.server.runtime = names[0];
    cfg.control.settings.server.runtimes = names.clone();
    cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
    cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    let mut prof =
        NetworkProfileDef::plain(ALLOW_PROFILE, NetworkProfile::Allowlist, &[ALLOWED_HOST]);
    prof.resolve = [(ALLOWED_HOST.to_owned(), origin.to_string())]
        .into_iter()
        .collect();
    cfg.control.settings.network_profiles.push(prof);
    let mut class = cfg.control.settings.classes[0].clone();
    class.name = CLASS.into();
    class.cpu = 1.0;
    class.memory_mb = MEMORY_MB;
    class.disk_mb = DISK_MB;
    class.pids = PIDS;
    class.runtimes = names;
    class.network_profiles = vec!["none".into(), ALLOW_PROFILE.into()];
    cfg.control.settings.classes.push(class);
    for t in tiers {
        (t.configure)(&mut cfg);
    }
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn security_suite_on_every_tier() {
    let require = std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() == Ok("1");
    // `AVIARY_SECURITY_TIERS=crun,runc` narrows the run (default: all)
    let only: Option<Vec<String>> = std::env::var("AVIARY_SECURITY_TIERS")
        .ok()
        .map(|v| v.split(',').map(str::to_owned).collect());
    let mut rows: BTreeMap<&'static str, BTreeMap<&str, Outcome>> = BTreeMap::new();
    let mut present = Vec::new();
    let mut missing = Vec::new();
    for t in TIERS {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|n| n == t.name))
        {
            continue;
        }
        match tier_available(t) {
            Ok(()) => present.push(t),
            Err(why) => {
                eprintln!("SKIPPED tier {}: {why}", t.name);
                rows.entry("setup")
                    .or_default()
                    .insert(t.name, Outcome::Skipped(why.clone()));
                missing.push(format!("{}: {why}", t.name));
            }
        }
    }
    let tier_names: Vec<&str> = TIERS
        .iter()
        .filter(|t| only.as_ref().is_none_or(|o| o.iter().any(|n| n == t.name)))
        .map(|t| t.name)
        .collect();
    if !present.is_empty() {
        let origin = origin();
        let dir = tempfile::Builder::new()
            .prefix("avt")
            .tempdir_in("/tmp")
            .unwrap();
        let ts = common::start_cfg(server_config(&dir.path().join("d"), &present, origin)).await;
        let admin = ts.client.clone();
        let ka = admin.create_key("security-attacker", false).await.unwrap();
        let kb = admin.create_key("security-peer", false).await.unwrap();
        let port = ts.server.as_ref().expect("running").addr.port();
        let suite = Suite {
            attacker: Client::new(&ts.url(), &ka.key),
            peer: Client::new(&ts.url(), &kb.key),
            host: host_services(port),
            ts,
        };
        // tiers one after another: each one's probes run in parallel
        for t in &present {
            for (probe, outcome) in run_tier(&suite, t).await {
                rows.entry(probe).or_default().insert(t.name, outcome);
            }
        }
        suite.ts.cleanup().await;
        drop(dir);
    }
    print_table(&tier_names, &rows);
    let failed: Vec<String> = rows
        .iter()
        .flat_map(|(p, r)| {
            r.iter()
                .filter(|(_, o)| o.failed())
                .map(move |(t, o)| format!("{t} {p}: {o:?}"))
        })
        .collect();
    assert!(failed.is_empty(), "not contained:\n{}", failed.join("\n"));
    assert!(
        !require || missing.is_empty(),
        "tiers missing under AVIARY_REQUIRE_SERVICES=1: {missing:?}"
    );
}

/// The detector itself: the same probes run unconfined on the host (the
/// test's own process tree, outside any sandbox) must report escapes, so a
/// `contained` in the table is the sandbox's doing, not a probe that cannot
/// see. Only modes whose attempts are harmless on the host run here.
#[test]
fn the_probes_flag_an_unconfined_process() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("probe.py");
    std::fs::write(&script, PROBE_PY).unwrap();
    let mask: u64 = ALLOWED_CAPS.iter().map(|b| 1u64 << b).sum();
    for (mode, arg) in [
        ("caps", json!({"allowed_mask": mask.to_string()})),
        ("namespaces", host_view()),
        ("proc_sys", json!({})),
    ] {
        let out = match std::process::Command::new("python3")
            .arg(&script)
            .arg(mode)
            .arg(arg.to_string())
            .output()
        {
            Ok(out) => out,
            Err(e) => {
                let why = format!("SKIPPED: python3 cannot run on the host: {e}");
                assert!(
                    std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                    "{why}"
                );
                eprintln!("{why}");
                return;
            }
        };
        let r = ExecResult {
            exit_code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            duration_ms: 0.0,
            timed_out: false,
            oom_killed: false,
            truncated: false,
        };
        match judge(&r) {
            Outcome::Escaped(what) => assert!(!what.is_empty()),
            other => panic!("{mode} unconfined on the host judged {other:?}: {r:?}"),
        }
    }
}
