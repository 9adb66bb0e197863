//! The Docker runtime against a real dockerd (`AVIARY_DOCKER_HOST`, the
//! socket `scripts/services.sh` starts): the runtime conformance suite, envd
//! reached through the adopted socket with the peer check, and the attack a
//! sandbox can try on that socket. Without dockerd (or root) each test says
//! why and returns; under `AVIARY_REQUIRE_SERVICES=1` a missing dockerd fails.

#[cfg(test)]
mod docker {
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_envd_proto::{EnvdClient, ExecSpec};
    use aviary_runtime::conformance;
    use aviary_runtime::{BindMount, Runtime, RuntimeStatus, SandboxSpec, TemplateRef};
    use aviary_runtime_docker::{DockerConfig, DockerRuntime};
    use std::path::{Path, PathBuf};
    use std::time::Duration;
    use tokio::sync::Mutex;

    /// One test at a time: they share one dockerd and count its containers.
    static LOCK: Mutex<()> = Mutex::const_new(());

    const APPLETS: &[&str] = &[
        "sh", "sleep", "cat", "ls", "echo", "true", "mkdir", "rm", "ln", "hostname", "id", "touch",
        "nc", "readlink", "stat", "kill", "ps",
    ];

    fn skip(why: &str) {
        assert!(
            std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("SKIPPED: {why}");
    }

    /// dockerd's socket, or `None` (with the reason printed).
    fn docker_host() -> Option<PathBuf> {
        if !nix::unistd::geteuid().is_root() {
            skip("the docker runtime tests need root (loop-mounted sandbox disks)");
            return None;
        }
        if !Path::new("/bin/busybox").exists() {
            skip("/bin/busybox missing (apt-get install busybox-static)");
            return None;
        }
        match std::env::var_os("AVIARY_DOCKER_HOST").map(PathBuf::from) {
            Some(p) if p.exists() => Some(p),
            _ => {
                skip(
                    "AVIARY_DOCKER_HOST does not name a dockerd socket \
                     (scripts/services.sh start runs one)",
                );
                None
            }
        }
    }

    /// A busybox template in a store of its own (a digest no other run
    /// uses, so each run imports it), a state dir, and cleanup on drop:
    /// every sandbox the runtime still lists, then the template's image.
    struct Fixture {
        dir: tempfile::TempDir,
        socket: PathBuf,
        template: TemplateRef,
    }

    fn fixture() -> Option<Fixture> {
        let socket = docker_host()?;
        let dir = tempfile::Builder::new()
            .prefix("aviary-docker-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let hex: String = {
            let id = SandboxId::generate().to_string();
            let mut h = id.bytes().map(|b| format!("{:02x}", b)).collect::<String>();
            h.push_str(&"0".repeat(64));
            h.truncate(64);
            h
        };
        let root = dir.path().join("templates/rootfs").join(&hex);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        for d in ["etc", "proc", "sys", "dev", "tmp", "root"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
        std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
        for a in APPLETS {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(a)).unwrap();
        }
        Some(Fixture {
            socket,
            template: TemplateRef {
                name: "busybox-docker-fixture".into(),
                digest: format!("sha256:{hex}"),
            },
            dir,
        })
    }

    impl Fixture {
        fn config(&self) -> DockerConfig {
            DockerConfig::new(&self.socket, self.dir.path().join("state"))
                .with_template_store(self.dir.path().join("templates"))
        }

        async fn runtime(&self) -> DockerRuntime {
            DockerRuntime::connect(self.config()).await.unwrap()
        }

        fn spec(&self) -> SandboxSpec {
            SandboxSpec {
                id: SandboxId::generate(),
                template: self.template.clone(),
                resources: ResourceLimits {
                    cpu: 0.5,
                    memory_mb: 128,
                    disk_mb: 256,
                    pids: 64,
                },
                network: NetworkProfile::None,
                egress: None,
                hostname: "sbx-docker".into(),
                init: vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "trap 'exit 0' TERM; while :; do sleep 1; done".into(),
                ],
                env: vec!["AVIARY_TEST=1".into()],
                binds: vec![],
            }
        }

        /// A spec whose PID 1 is the real static envd, as the control plane
        /// starts it (socket activation, which this runtime translates).
        fn envd_spec(&self, envd: &Path) -> SandboxSpec {
            let mut s = self.spec();
            s.init = vec!["/.aviary/envd".into(), "--listen-fd".into(), "3".into()];
            s.binds = vec![BindMount {
                host: envd.to_path_buf(),
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }];
            s
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let config = self.config();
            let image = format!(
                "{}:{}",
                config.image_repo,
                self.template.digest_hex().unwrap()
            );
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let Ok(docker) = DockerRuntime::connect(config).await else {
                        return;
                    };
                    for id in docker.list().await.unwrap_or_default() {
                        if let Err(e) = docker.destroy(&id).await {
                            eprintln!("fixture cleanup of {id}: {}", conformance::chain(&e));
                        }
                    }
                    if let Err(e) = docker.remove_image(&image).await {
                        eprintln!(
                            "fixture cleanup of image {image}: {}",
                            conformance::chain(&e)
                        );
                    }
                });
            })
            .join()
            .unwrap();
        }
    }

    /// The static envd (`AVIARY_ENVD`, built by scripts/build-envd.sh).
    fn static_envd() -> Option<PathBuf> {
        match std::env::var_os("AVIARY_ENVD").map(PathBuf::from) {
            Some(p) if p.is_file() => Some(p),
            _ => {
                skip("AVIARY_ENVD does not name the static envd (scripts/build-envd.sh)");
                None
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime().await;
        eprintln!("{}", rt.probe().await.unwrap());
        let make = || f.spec();
        conformance::check_unknown_ids(&rt).await;
        conformance::check_lifecycle(&rt, &make).await;
        conformance::check_refusals(&rt, &make).await;
        conformance::check_limits_visible(&rt, &rt, &make).await;
        conformance::check_pause_resume(&rt, &make).await;
        conformance::check_layers(&rt, &rt, &make).await;
        assert!(rt.list().await.unwrap().is_empty());
    }

    /// Hardening visible from inside: capabilities, no-new-privs, seccomp
    /// (io_uring and unshare refused), no network but loopback.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_container_is_hardened() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime().await;
        let spec = f.spec();
        rt.create(&spec).await.unwrap();
        let status = rt.exec(&spec.id, &["cat", "/proc/1/status"]).await.unwrap();
        let status = String::from_utf8_lossy(&status.stdout).to_string();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or_else(|| panic!("{name} in {status}"))
                .trim()
                .to_string()
        };
        assert_eq!(field("NoNewPrivs:"), "1");
        assert_eq!(field("Seccomp:"), "2", "a seccomp filter is on");
        // the crun tier's capability set: no NET_RAW, SYS_ADMIN, MKNOD ...
        let caps = u64::from_str_radix(&field("CapBnd:"), 16).unwrap();
        for (bit, name) in [
            (13, "NET_RAW"),
            (21, "SYS_ADMIN"),
            (27, "MKNOD"),
            (19, "SYS_PTRACE"),
        ] {
            assert_eq!(caps & (1 << bit), 0, "{name} in the bounding set");
        }
        assert_ne!(caps & (1 << 0), 0, "CHOWN is kept");
        let unshare = rt
            .exec(&spec.id, &["sh", "-c", "unshare -U true; echo $?"])
            .await
            .unwrap();
        assert_ne!(String::from_utf8_lossy(&unshare.stdout).trim(), "0");
        let links = rt.exec(&spec.id, &["ls", "/sys/class/net"]).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&links.stdout).trim(), "lo");
        rt.destroy(&spec.id).await.unwrap();
    }

    async fn hostname_via_envd(client: &EnvdClient) -> String {
        let out = client
            .exec_collect(
                ExecSpec {
                    argv: vec!["cat".into(), "/proc/sys/kernel/hostname".into()],
                    timeout: Some(Duration::from_secs(10)),
                    ..Default::default()
                },
                None,
            )
            .await
            .unwrap();
        assert_eq!(out.exit.exit_code, 0, "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// envd as PID 1: the host reaches it through the adopted socket with
    /// the peer check, the name inside is gone, and fences can be set only
    /// from the host.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn envd_answers_through_the_adopted_socket() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let Some(envd) = static_envd() else { return };
        let rt = f.runtime().await;
        let spec = f.envd_spec(&envd);
        let handle = rt.create(&spec).await.unwrap();
        let ep = rt.envd_endpoint(&spec.id).await.unwrap();
        assert_eq!(
            ep,
            handle.envd_endpoint(),
            "after a restart the same endpoint"
        );
        let client = EnvdClient::new(ep.socket.clone()).expect_peer_pid(ep.peer_pid);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        assert_eq!(hostname_via_envd(&client).await, spec.hostname);
        client.set_fence(Some(7)).await.unwrap();
        assert_eq!(client.health().await.unwrap().fence, Some(7));
        let inside = rt
            .exec(&spec.id, &["ls", "-a", "/.aviary/run"])
            .await
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&inside.stdout).contains("envd.sock"),
            "envd's socket is no longer reachable inside: {inside:?}"
        );
        // a client that does not expect envd's pid is refused
        let wrong = EnvdClient::new(ep.socket.clone()).expect_peer_pid(ep.peer_pid + 1);
        wrong.health().await.unwrap_err();
        rt.destroy(&spec.id).await.unwrap();
    }

    /// The attack: sandbox A puts, where its envd socket was, a symlink to
    /// sandbox B's socket (host path, as if it had guessed it) and a listener
    /// of its own; the host's connection to A's envd still reaches A's envd
    /// (A's hostname, A's init as peer), never B's and never A's impostor —
    /// also for a runtime started afresh (a server restart).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sandbox_cannot_redirect_the_hosts_envd_connection() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let Some(envd) = static_envd() else { return };
        let rt = f.runtime().await;
        let mut a = f.envd_spec(&envd);
        a.hostname = "sandbox-a".into();
        let mut b = f.envd_spec(&envd);
        b.hostname = "sandbox-b".into();
        let ha = rt.create(&a).await.unwrap();
        let hb = rt.create(&b).await.unwrap();
        let b_socket = hb.envd_endpoint().socket;
        // B's envd dir, as the host sees it, is beside its control dir
        let b_envd_dir = hb.control_dir.parent().unwrap().join("envd");
        let script = format!(
            "ln -sf {} /.aviary/run/envd.sock.b && \
             ln -sf {} /.aviary/run/envd.sock && \
             ls -la /.aviary/run",
            b_socket.display(),
            b_envd_dir.join("envd.sock").display(),
        );
        let planted = rt.exec(&a.id, &["sh", "-c", &script]).await.unwrap();
        assert_eq!(planted.code, Some(0), "{planted:?}");
        // and a process of A listening where envd was (nc -lU: busybox)
        let _ = rt
            .exec(
                &a.id,
                &["sh", "-c", "rm -f /.aviary/run/envd.sock; (nc -lkU /.aviary/run/envd.sock >/dev/null 2>&1 &) ; sleep 0.2; true"],
            )
            .await
            .unwrap();
        for rt in [&rt, &f.runtime().await] {
            let ep = rt.envd_endpoint(&a.id).await.unwrap();
            assert_eq!(ep.peer_pid, ha.init_pid);
            assert!(
                ep.socket.starts_with(&ha.control_dir),
                "the endpoint is in A's host-only control dir: {ep:?}"
            );
            let client = EnvdClient::new(ep.socket.clone()).expect_peer_pid(ep.peer_pid);
            assert_eq!(hostname_via_envd(&client).await, "sandbox-a");
        }
        // B is untouched
        let epb = rt.envd_endpoint(&b.id).await.unwrap();
        let client_b = EnvdClient::new(epb.socket).expect_peer_pid(epb.peer_pid);
        assert_eq!(hostname_via_envd(&client_b).await, "sandbox-b");
        rt.destroy(&a.id).await.unwrap();
        rt.destroy(&b.id).await.unwrap();
        assert_eq!(rt.status(&a.id).await.unwrap(), RuntimeStatus::NotFound);
    }

    /// A failed start leaves nothing: no container, no dir, no mount.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_envd_that_never_listens_fails_the_create_cleanly() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime().await;
        let mut spec = f.spec();
        // asks for socket activation but is not envd: exits at once
        spec.init = vec!["/bin/true".into(), "--listen-fd".into(), "3".into()];
        let err = rt.create(&spec).await.unwrap_err();
        eprintln!("refused as expected: {}", conformance::chain(&err));
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);
        assert!(!rt.list().await.unwrap().contains(&spec.id));
    }
}
