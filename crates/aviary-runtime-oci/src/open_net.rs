//! The `open` network profile: NAT egress through a user-mode network stack
//! (`slirp4netns`, one process per sandbox) with the always-denied ranges
//! refused by a firewall in the sandbox's own network namespace.
//!
//! Order matters: the firewall (`iptables-restore` run in the sandbox's
//! netns, which the sandbox cannot change: it holds no `CAP_NET_ADMIN` and
//! seccomp refuses `setns`/`unshare`) is in place **before** `slirp4netns`
//! adds the `tap0` interface, so there is never a moment of unfiltered
//! egress. Refused: private (RFC 1918), shared (CGNAT), loopback beyond `lo`,
//! link-local (169.254.169.254 among them), multicast, reserved,
//! documentation and benchmarking ranges, with one exception: slirp's own
//! DNS forwarder (10.0.2.3:53). `--disable-host-loopback` keeps the gateway
//! from reaching the host's 127.0.0.1 as well. IPv6 is not enabled in slirp
//! and refused by the firewall besides.
//!
//! `slirp4netns` is started with `setsid -f` (so it is no child of the
//! server and survives a server restart); its pid is recorded in the
//! host-only control dir and checked against `/proc/<pid>/cmdline` before
//! destroy kills it.

use crate::{OciRuntime, SandboxDirs};
use aviary_runtime::{RuntimeError, SpawnRequest, SpawnStdio};
use std::path::Path;
use std::time::Duration;

/// IPv4 destinations the sandbox never reaches (besides slirp's DNS).
pub(crate) const DENIED_V4: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// slirp4netns' DNS forwarder inside its default 10.0.2.0/24.
const SLIRP_DNS: &str = "10.0.2.3";
const PID_FILE: &str = "slirp4netns.pid";
const RULES_FILE: &str = "open-net.rules";
/// How long slirp4netns may take to configure `tap0`.
const CONFIGURE_WAIT: Duration = Duration::from_secs(10);

/// The `iptables-restore` input for the sandbox's netns.
pub(crate) fn ipv4_rules() -> String {
    let mut r = String::from("*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -o lo -j ACCEPT\n");
    for proto in ["udp", "tcp"] {
        r.push_str(&format!(
            "-A OUTPUT -d {SLIRP_DNS}/32 -p {proto} --dport 53 -j ACCEPT\n"
        ));
    }
    for cidr in DENIED_V4 {
        r.push_str(&format!("-A OUTPUT -d {cidr} -j REJECT\n"));
    }
    r.push_str("COMMIT\n");
    r
}

fn ipv6_rules() -> &'static str {
    "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -o lo -j ACCEPT\n-A OUTPUT -j REJECT\nCOMMIT\n"
}

impl OciRuntime {
    async fn run_host(
        &self,
        program: &str,
        args: Vec<String>,
        stdio: SpawnStdio,
    ) -> Result<aviary_runtime::SpawnOutput, RuntimeError> {
        let mut req = SpawnRequest::new(program, args);
        req.stdio = stdio;
        req.timeout = self.config.command_timeout;
        let out = self
            .spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: program.to_owned(),
                source,
            })?;
        if !out.success() {
            return Err(RuntimeError::Unsupported {
                what: format!(
                    "network profile \"open\": {} failed: {}",
                    req.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(out)
    }

    /// Firewall, then slirp4netns, for the sandbox whose init is `pid`.
    pub(crate) async fn attach_open_network(
        &self,
        slirp: &Path,
        dirs: &SandboxDirs,
        pid: u32,
    ) -> Result<(), RuntimeError> {
        let netns = format!("--net=/proc/{pid}/ns/net");
        for (tool, rules, name) in [
            ("iptables-restore", ipv4_rules(), RULES_FILE.to_owned()),
            (
                "ip6tables-restore",
                ipv6_rules().to_owned(),
                format!("{RULES_FILE}.v6"),
            ),
        ] {
            let path = dirs.control().join(name);
            std::fs::write(&path, rules).map_err(|source| RuntimeError::WriteFile {
                path: path.clone(),
                source,
            })?;
            self.run_host(
                "nsenter",
                vec![
                    netns.clone(),
                    tool.into(),
                    "-w".into(),
                    "5".into(),
                    path.display().to_string(),
                ],
                SpawnStdio::Capture,
            )
            .await?;
        }
        self.run_host(
            "setsid",
            vec![
                "-f".into(),
                slirp.display().to_string(),
                "--configure".into(),
                "--mtu=65520".into(),
                "--disable-host-loopback".into(),
                "--enable-sandbox".into(),
                "--enable-seccomp".into(),
                pid.to_string(),
                "tap0".into(),
            ],
            SpawnStdio::Null,
        )
        .await?;
        let started = std::time::Instant::now();
        let mut recorded = false;
        loop {
            if !recorded {
                if let Some(slirp_pid) = find_slirp(pid) {
                    let path = dirs.control().join(PID_FILE);
                    std::fs::write(&path, slirp_pid.to_string()).map_err(|source| {
                        RuntimeError::WriteFile {
                            path: path.clone(),
                            source,
                        }
                    })?;
                    recorded = true;
                }
            }
            let out = self
                .run_host(
                    "nsenter",
                    vec![
                        netns.clone(),
                        "ip".into(),
                        "-o".into(),
                        "-4".into(),
                        "addr".into(),
                        "show".into(),
                        "dev".into(),
                        "tap0".into(),
                    ],
                    SpawnStdio::Capture,
                )
                .await;
            if recorded
                && out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("10.0.2.100"))
            {
                return Ok(());
            }
            if started.elapsed() > CONFIGURE_WAIT {
                return Err(RuntimeError::Unsupported {
                    what: "network profile \"open\": slirp4netns did not configure tap0".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

/// The pid of the slirp4netns serving init pid `pid`, from `/proc`.
fn find_slirp(pid: u32) -> Option<u32> {
    let want = pid.to_string();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if is_slirp_for(p, &want) {
            return Some(p);
        }
    }
    None
}

fn is_slirp_for(p: u32, init_pid: &str) -> bool {
    let Ok(cmd) = std::fs::read(format!("/proc/{p}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
    args.first().is_some_and(|a| a.ends_with(b"slirp4netns"))
        && args.contains(&init_pid.as_bytes())
        && args.contains(&&b"tap0"[..])
}

/// `spec` plus, for `open`, a read-only `/etc/resolv.conf` naming slirp's
/// DNS forwarder (the template's resolver is the host's, which the firewall
/// refuses); written to `<sandbox>/net/`, which holds nothing else.
pub(crate) fn with_resolver(
    spec: &aviary_runtime::SandboxSpec,
    root: &Path,
) -> Result<aviary_runtime::SandboxSpec, RuntimeError> {
    let mut spec = spec.clone();
    if spec.network != aviary_core::NetworkProfile::Open {
        return Ok(spec);
    }
    let dir = root.join("net");
    crate::make_dir(&dir, 0o755)?;
    let file = dir.join("resolv.conf");
    std::fs::write(&file, format!("nameserver {SLIRP_DNS}\n")).map_err(|source| {
        RuntimeError::WriteFile {
            path: file.clone(),
            source,
        }
    })?;
    spec.binds.push(aviary_runtime::BindMount {
        host: file,
        sandbox: "/etc/resolv.conf".into(),
        read_only: true,
    });
    Ok(spec)
}

/// Ends the sandbox's slirp4netns (no-op without one).
pub(crate) fn detach_open_network(dirs: &SandboxDirs) {
    let Ok(text) = std::fs::read_to_string(dirs.control().join(PID_FILE)) else {
        return;
    };
    let Ok(p) = text.trim().parse::<i32>() else {
        return;
    };
    // the recorded pid must still be a slirp4netns (never kill a reused pid)
    let Ok(cmd) = std::fs::read(format!("/proc/{p}/cmdline")) else {
        return;
    };
    if !cmd
        .split(|b| *b == 0)
        .next()
        .is_some_and(|a| a.ends_with(b"slirp4netns"))
    {
        return;
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p),
        nix::sys::signal::Signal::SIGKILL,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_firewall_refuses_every_denied_range_but_slirps_dns() {
        let r = ipv4_rules();
        let lines: Vec<&str> = r.lines().collect();
        let dns = lines
            .iter()
            .position(|l| l.contains("10.0.2.3/32"))
            .unwrap();
        let private = lines
            .iter()
            .position(|l| l.contains("-d 10.0.0.0/8 -j REJECT"))
            .unwrap();
        assert!(dns < private, "DNS must be accepted before 10/8 is refused");
        for cidr in [
            "169.254.0.0/16",
            "127.0.0.0/8",
            "100.64.0.0/10",
            "172.16.0.0/12",
            "192.168.0.0/16",
        ] {
            assert!(r.contains(&format!("-d {cidr} -j REJECT")), "{cidr}");
        }
        assert!(r.ends_with("COMMIT\n"));
        assert!(ipv6_rules().contains("-A OUTPUT -j REJECT"));
    }
}
