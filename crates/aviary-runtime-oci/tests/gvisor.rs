//! The gVisor tier (`runsc`) on the real thing: the runtime conformance
//! suite, teardown without residue, and envd's transport under attack.
//! They need root and runsc (`scripts/deps.sh` installs it); without runsc
//! they skip with the reason printed, and fail under
//! `AVIARY_REQUIRE_SERVICES=1`. The envd tests also need the static envd
//! (`AVIARY_ENVD`, from `scripts/build-envd.sh`).

mod common;

#[cfg(test)]
mod gvisor {
    use crate::common::{self, Fixture};
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_envd_proto::{EnvdClient, EnvdError, ExecSpec};
    use aviary_runtime::conformance::{self, Footprint};
    use aviary_runtime::{BindMount, Runtime, RuntimeStatus, SandboxHandle, SandboxSpec};
    use aviary_runtime_oci::{OciBinary, OciRuntime};
    use std::os::unix::fs::FileTypeExt;
    use std::path::{Path, PathBuf};
    use std::time::Duration;
    use tokio::sync::Mutex;

    static LOCK: Mutex<()> = Mutex::const_new(());

    /// `None` (with the reason printed) when runsc or root is missing;
    /// a missing runsc fails under `AVIARY_REQUIRE_SERVICES=1`.
    fn fixture() -> Option<Fixture> {
        let found = std::process::Command::new("runsc")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            let why = "SKIPPED: runsc is not installed (scripts/deps.sh installs it)";
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            return None;
        }
        common::fixture("gvisor", &[common::binary_needs(OciBinary::Runsc)])
    }

    /// The static envd, or `None` with the reason printed (a failure under
    /// `AVIARY_REQUIRE_SERVICES=1`).
    fn envd_binary() -> Option<PathBuf> {
        match std::env::var_os("AVIARY_ENVD").map(PathBuf::from) {
            Some(p) if p.is_file() => Some(p),
            _ => {
                let why =
                    "SKIPPED: AVIARY_ENVD is not set to the static envd (scripts/build-envd.sh)";
                assert!(
                    std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                    "{why}"
                );
                eprintln!("{why}");
                None
            }
        }
    }

    fn spec_for(f: &Fixture) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: f.template_ref.clone(),
            resources: ResourceLimits {
                cpu: 0.5,
                memory_mb: 256,
                disk_mb: 1024,
                pids: 1024,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx-gvisor".into(),
            init: vec![
                "/bin/sh".into(),
                "-c".into(),
                "trap 'exit 0' TERM; while :; do sleep 1; done".into(),
            ],
            env: vec!["AVIARY_TEST=1".into()],
            binds: vec![BindMount {
                host: f.envd.clone(),
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }],
        }
    }

    /// A spec whose PID 1 is the real envd, asking for the inherited socket
    /// as the control plane does (the runtime turns that into a socket envd
    /// binds itself).
    fn envd_spec(f: &Fixture, envd: &Path, hostname: &str) -> SandboxSpec {
        let mut spec = spec_for(f);
        spec.hostname = hostname.into();
        spec.binds = vec![BindMount {
            host: envd.to_path_buf(),
            sandbox: "/.aviary/envd".into(),
            read_only: true,
        }];
        spec.init = vec!["/.aviary/envd".into(), "--listen-fd".into(), "3".into()];
        spec
    }

    /// Everything a runsc sandbox could leave behind on the host.
    fn footprint(state: &Path) -> Footprint {
        let mut fp = Footprint::new();
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let state_s = state.to_str().unwrap();
        fp.insert(
            "mounts under state dir".into(),
            mountinfo.lines().filter(|l| l.contains(state_s)).count() as u64,
        );
        let mut cgroup_dirs = 0;
        for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
            if let Ok(rd) = std::fs::read_dir(h.path().join("aviary")) {
                cgroup_dirs += rd.flatten().filter(|e| e.path().is_dir()).count() as u64;
            }
        }
        fp.insert("cgroup dirs under */aviary".into(), cgroup_dirs);
        let mut naming_state = 0;
        for p in std::fs::read_dir("/proc").unwrap().flatten() {
            let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
            if stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            {
                continue;
            }
            if std::fs::read(p.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(state_s))
            {
                naming_state += 1;
            }
        }
        fp.insert(
            "processes naming the state dir (runsc, gofer)".into(),
            naming_state,
        );
        let entries = |d: &Path| std::fs::read_dir(d).map(|r| r.count() as u64).unwrap_or(0);
        fp.insert("state dir entries".into(), entries(state));
        fp.insert(
            "runsc-state entries".into(),
            entries(&state.join("runsc-state")),
        );
        fp
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_runsc() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let report = rt.probe().await.unwrap();
        eprintln!("runsc: {} (cgroups {})", report.version, report.cgroup_mode);
        let make = || spec_for(&f);
        conformance::check_unknown_ids(&rt).await;
        conformance::check_lifecycle(&rt, &make).await;
        conformance::check_refusals(&rt, &make).await;
        // gVisor's kernel shows no cgroup limits inside: see
        // `limits_are_the_host_cgroups` for where they are enforced
        conformance::check_isolation_visible(&rt, &rt, &make).await;
        conformance::check_pause_resume(&rt, &make).await;
        conformance::check_layers(&rt, &rt, &make).await;
        assert!(rt.list().await.unwrap().is_empty());
    }

    /// The first of `paths` that reads, trimmed.
    fn read_first(paths: &[PathBuf]) -> String {
        paths
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_else(|| panic!("none of {paths:?} reads"))
            .trim()
            .to_string()
    }

    /// The limits are the host's cgroup limits on the whole gVisor sandbox
    /// (its kernel, gofer and every task), pids with gVisor's own floor.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn limits_are_the_host_cgroups() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let mut spec = spec_for(&f);
        spec.resources.pids = 64;
        let h = rt.create(&spec).await.unwrap();
        let cg = |ctrl: &str, v1: &str, v2: &str| {
            read_first(&[
                PathBuf::from(format!("/sys/fs/cgroup/{ctrl}/aviary/{}/{v1}", spec.id)),
                PathBuf::from(format!("/sys/fs/cgroup/aviary/{}/{v2}", spec.id)),
            ])
        };
        assert_eq!(
            cg("memory", "memory.limit_in_bytes", "memory.max"),
            (spec.resources.memory_mb * 1024 * 1024).to_string()
        );
        assert_eq!(
            cg("pids", "pids.max", "pids.max"),
            aviary_runtime_oci::RUNSC_MIN_PIDS.to_string(),
            "gVisor's floor under a lower class limit"
        );
        assert_eq!(
            cg("cpu", "cpu.cfs_quota_us", "cpu.max")
                .split_whitespace()
                .next()
                .unwrap(),
            "50000"
        );
        // runsc's own processes are in it (their memory is charged there)
        let procs = cg("memory", "cgroup.procs", "cgroup.procs");
        assert!(
            procs.lines().any(|p| p == h.init_pid.to_string()),
            "runsc-sandbox {} in {procs:?}",
            h.init_pid
        );
        assert!(rt.usage(&spec.id).await.unwrap().memory_current_bytes > 0);
        rt.destroy(&spec.id).await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn teardown_runsc() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let make = || spec_for(&f);
        let (creates, destroys) =
            conformance::check_teardown(&rt, &make, 10, &|| footprint(&f.state)).await;
        eprintln!(
            "runsc over 10 cycles: create median {:?}, destroy median {:?}",
            conformance::median(&creates),
            conformance::median(&destroys)
        );
    }

    /// The host's client of `h`'s envd, as the control plane builds it.
    fn client_of(h: &SandboxHandle) -> EnvdClient {
        let ep = h.envd_endpoint();
        EnvdClient::new(ep.socket).expect_peer_pid(ep.peer_pid)
    }

    async fn sh(client: &EnvdClient, script: &str) -> (i32, String) {
        sh_within(client, script, Duration::from_secs(20)).await
    }

    async fn sh_within(client: &EnvdClient, script: &str, limit: Duration) -> (i32, String) {
        let out = client
            .exec_collect(
                ExecSpec {
                    argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
                    timeout: Some(limit),
                    ..Default::default()
                },
                Some(1),
            )
            .await
            .unwrap();
        let mut text = String::from_utf8_lossy(&out.stdout).to_string();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.exit.exit_code, text)
    }

    /// envd runs as PID 1 under gVisor and serves the host: health, a fence
    /// move (only the host may make one) and exec.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn envd_serves_the_host_under_gvisor() {
        let _g = LOCK.lock().await;
        let Some(envd) = envd_binary() else { return };
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let spec = envd_spec(&f, &envd, "sbx-a");
        let h = rt.create(&spec).await.unwrap();
        let ep = h.envd_endpoint();
        assert_eq!(ep, rt.envd_endpoint(&spec.id).await.unwrap());
        assert!(
            ep.socket.starts_with(f.state.join(spec.id.as_str())),
            "{ep:?}"
        );
        assert_ne!(ep.peer_pid, h.init_pid, "the peer is runsc's gofer");
        let client = client_of(&h);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        client.set_fence(Some(1)).await.unwrap();
        assert_eq!(sh(&client, "hostname").await, (0, "sbx-a\n".into()));
        assert_eq!(
            sh(&client, "echo hi > /workspace/x && cat /workspace/x").await,
            (0, "hi\n".into())
        );
        assert_eq!(
            std::fs::read_to_string(h.workspace_dir.join("x")).unwrap(),
            "hi\n"
        );
        rt.destroy(&spec.id).await.unwrap();
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);
    }

    /// A sandbox cannot get the host talking to another sandbox through
    /// envd's socket dir (mounted inside, sandbox-writable): it cannot
    /// replace envd's socket (gVisor refuses unlink, rename and a new entry
    /// over a host socket); a symlink it makes there to another sandbox's
    /// socket is never followed; that socket reached anyway (a swap racing
    /// the client's lstat) has the other sandbox's gofer as its peer and is
    /// refused; a listener of its own there is served by its own gofer, so
    /// it only ever answers for the sandbox it runs in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sandbox_cannot_redirect_the_host_into_another() {
        let _g = LOCK.lock().await;
        let Some(envd) = envd_binary() else { return };
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let (sa, sb) = (envd_spec(&f, &envd, "sbx-a"), envd_spec(&f, &envd, "sbx-b"));
        let (ha, hb) = (rt.create(&sa).await.unwrap(), rt.create(&sb).await.unwrap());
        let (a, b) = (client_of(&ha), client_of(&hb));
        a.wait_ready(Duration::from_secs(10)).await.unwrap();
        b.wait_ready(Duration::from_secs(10)).await.unwrap();
        a.set_fence(Some(1)).await.unwrap();
        b.set_fence(Some(1)).await.unwrap();
        let (ea, eb) = (ha.envd_endpoint(), hb.envd_endpoint());
        assert_ne!(ea.peer_pid, eb.peer_pid, "one gofer per sandbox");
        let dir_a = ea.socket.parent().unwrap().to_path_buf();

        // replacing envd's socket from inside fails, whichever way
        for attempt in [
            "rm -f /run/aviary/envd.sock",
            "mv /run/aviary/envd.sock /run/aviary/moved",
            "ln -sf /run/aviary/other /run/aviary/envd.sock",
        ] {
            let (code, out) = sh(&a, attempt).await;
            assert_ne!(code, 0, "{attempt}: {out}");
        }
        assert!(std::fs::symlink_metadata(&ea.socket)
            .unwrap()
            .file_type()
            .is_socket());
        assert_eq!(sh(&a, "hostname").await, (0, "sbx-a\n".into()));

        // a symlink the sandbox makes there, to B's socket, is not followed
        let (code, out) = sh(
            &a,
            &format!(
                "ln -s {} /run/aviary/evil && echo made",
                eb.socket.display()
            ),
        )
        .await;
        assert_eq!((code, out.as_str()), (0, "made\n"));
        let via_link = EnvdClient::new(dir_a.join("evil")).expect_peer_pid(ea.peer_pid);
        let err = via_link.health().await.unwrap_err();
        assert!(
            matches!(&err, EnvdError::Connect(e) if e.kind() == std::io::ErrorKind::InvalidInput),
            "a symlink is never followed: {err:?}"
        );
        // B's socket reached at A's endpoint (a lost race): the peer check
        let crossed = EnvdClient::new(eb.socket.clone()).expect_peer_pid(ea.peer_pid);
        let err = crossed.health().await.unwrap_err();
        assert!(matches!(err, EnvdError::PeerMismatch { .. }), "{err:?}");

        // a listener of A's own (a second envd) beside envd's socket: the
        // host's connection lands in A, behind A's gofer
        let (code, out) = sh(
            &a,
            "(/.aviary/envd --socket /run/aviary/own.sock --gvisor-host-socket >/dev/null 2>&1 &); echo started",
        )
        .await;
        assert_eq!((code, out.as_str()), (0, "started\n"));
        let own = EnvdClient::new(dir_a.join("own.sock")).expect_peer_pid(ea.peer_pid);
        own.wait_ready(Duration::from_secs(10)).await.unwrap();
        own.set_fence(Some(1)).await.unwrap();
        assert_eq!(
            sh(&own, "hostname").await,
            (0, "sbx-a\n".into()),
            "whatever answers there runs in the same sandbox"
        );
        let wrong = EnvdClient::new(dir_a.join("own.sock")).expect_peer_pid(eb.peer_pid);
        assert!(matches!(
            wrong.health().await.unwrap_err(),
            EnvdError::PeerMismatch { .. }
        ));
        // B is untouched
        assert_eq!(sh(&b, "hostname").await, (0, "sbx-b\n".into()));
        rt.destroy(&sa.id).await.unwrap();
        rt.destroy(&sb.id).await.unwrap();
        assert!(rt.list().await.unwrap().is_empty());
    }

    /// A memory checkpoint keeps the process tree: a background process and
    /// what it holds in memory survive checkpoint → restore, envd serves
    /// again (behind a new gofer), and destroy removes the image.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checkpoint_and_restore_keep_the_processes() {
        use aviary_runtime::Checkpointable;
        let _g = LOCK.lock().await;
        let Some(envd) = envd_binary() else { return };
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let spec = envd_spec(&f, &envd, "sbx-mem");
        let h = rt.create(&spec).await.unwrap();
        let client = client_of(&h);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        client.set_fence(Some(1)).await.unwrap();
        // a shell variable lives only in that shell's memory
        let (code, pid) = sh(
            &client,
            "sh -c 'secret=$$-kept; while :; do echo $secret > /tmp/seen; sleep 0.2; done' >/dev/null 2>&1 & echo $!",
        )
        .await;
        assert_eq!(code, 0, "{pid}");
        let pid = pid.trim().to_string();
        let (code, out) = sh(
            &client,
            &format!("sleep 0.5; kill -0 {pid} && cat /tmp/seen"),
        )
        .await;
        assert_eq!((code, out), (0, format!("{pid}-kept\n")), "running before");
        assert!(!rt.has_checkpoint(&spec.id).await.unwrap());

        let t = std::time::Instant::now();
        rt.checkpoint(&spec.id).await.unwrap();
        let took_checkpoint = t.elapsed();
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::Stopped);
        assert!(
            rt.list().await.unwrap().contains(&spec.id),
            "kept for the restore"
        );
        assert!(rt.has_checkpoint(&spec.id).await.unwrap());
        assert!(client.health().await.is_err(), "no envd while checkpointed");

        let t = std::time::Instant::now();
        let restored = rt.restore(&spec).await.unwrap();
        let took_restore = t.elapsed();
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::Running);
        assert!(!rt.has_checkpoint(&spec.id).await.unwrap(), "consumed");
        let ep = restored.envd_endpoint();
        assert_ne!(ep.peer_pid, h.envd_endpoint().peer_pid, "a new gofer");
        let client = client_of(&restored);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        // (envd's fence came back with its memory: still 1)
        let (code, out) = sh(
            &client,
            &format!("kill -0 {pid} && rm /tmp/seen && sleep 1 && cat /tmp/seen"),
        )
        .await;
        assert_eq!((code, out), (0, format!("{pid}-kept\n")));
        eprintln!("runsc checkpoint {took_checkpoint:?}, restore {took_restore:?} (small process)");
        rt.destroy(&spec.id).await.unwrap();
        assert!(rt.list().await.unwrap().is_empty());
        assert!(!f.state.join(format!("{}.checkpoint", spec.id)).exists());
    }

    /// `sh -c script` through `client` under lease token `token`.
    async fn sh_as(
        client: &EnvdClient,
        token: Option<u64>,
        script: &str,
    ) -> Result<(i32, String), EnvdError> {
        let out = client
            .exec_collect(
                ExecSpec {
                    argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
                    timeout: Some(Duration::from_secs(20)),
                    ..Default::default()
                },
                token,
            )
            .await?;
        let mut text = String::from_utf8_lossy(&out.stdout).to_string();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        Ok((out.exit.exit_code, text))
    }

    /// A live fork: the child runs the parent's processes with their memory
    /// (a shell variable), has its own copy of the files as they were at the
    /// fork, its own gofer and envd socket, and starts unleased (the
    /// parent's fence is refused, a lower first fence of its own is taken);
    /// the parent keeps running with its lease; both go without residue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_fork_runs_the_parents_processes() {
        use aviary_runtime::Checkpointable;
        let _g = LOCK.lock().await;
        let Some(envd) = envd_binary() else { return };
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Runsc);
        let empty = footprint(&f.state);
        let parent = envd_spec(&f, &envd, "sbx-fork");
        let h = rt.create(&parent).await.unwrap();
        let client = client_of(&h);
        client.wait_ready(Duration::from_secs(10)).await.unwrap();
        client.set_fence(Some(3)).await.unwrap();
        let (code, pid) = sh_as(
            &client,
            Some(3),
            "echo before > /workspace/before.txt; cd /workspace; \
             sh -c 'secret=$$-kept; while :; do echo $secret > /tmp/seen; sleep 0.2; done' >/dev/null 2>&1 & echo $!",
        )
        .await
        .unwrap();
        assert_eq!(code, 0, "{pid}");
        let pid = pid.trim().to_string();
        let alive = format!("kill -0 {pid} && rm -f /tmp/seen && sleep 1 && cat /tmp/seen");
        assert_eq!(
            sh_as(&client, Some(3), &alive).await.unwrap(),
            (0, format!("{pid}-kept\n"))
        );

        let child = envd_spec(&f, &envd, "sbx-fork");
        let fork = rt.fork_running(&parent.id, &child).await.unwrap();
        assert_eq!(fork.child.id, child.id);
        let (pe, ce) = (fork.parent.envd_endpoint(), fork.child.envd_endpoint());
        assert_ne!(pe.peer_pid, ce.peer_pid, "a gofer each");
        assert!(
            ce.socket.starts_with(f.state.join(child.id.as_str())),
            "{ce:?}"
        );
        assert!(!f.state.join(format!("{}.checkpoint", child.id)).exists());
        assert!(!f.state.join(format!("{}.seed", child.id)).exists());
        assert_eq!(rt.status(&parent.id).await.unwrap(), RuntimeStatus::Running);
        assert_eq!(rt.status(&child.id).await.unwrap(), RuntimeStatus::Running);

        // the parent: same process, same lease
        let p = client_of(&fork.parent);
        p.wait_ready(Duration::from_secs(10)).await.unwrap();
        assert_eq!(
            sh_as(&p, Some(3), &alive).await.unwrap(),
            (0, format!("{pid}-kept\n"))
        );
        // the child: the same process with its memory, unleased; the
        // parent's token is refused there
        let c = client_of(&fork.child);
        c.wait_ready(Duration::from_secs(10)).await.unwrap();
        let err = sh_as(&c, Some(3), "true").await.unwrap_err();
        assert!(format!("{err:?}").contains("StaleToken"), "{err:?}");
        assert_eq!(
            sh_as(&c, None, &alive).await.unwrap(),
            (0, format!("{pid}-kept\n"))
        );
        // files: copied at the fork, apart from then on
        assert_eq!(
            sh_as(
                &c,
                None,
                "cat /workspace/before.txt; echo child > /workspace/c.txt"
            )
            .await
            .unwrap(),
            (0, "before\n".into())
        );
        sh_as(&p, Some(3), "echo parent > /workspace/p.txt")
            .await
            .unwrap();
        assert_eq!(
            sh_as(&p, Some(3), "ls /workspace").await.unwrap(),
            (0, "before.txt\np.txt\n".into())
        );
        assert_eq!(
            sh_as(&c, None, "ls /workspace").await.unwrap(),
            (0, "before.txt\nc.txt\n".into())
        );
        assert!(fork.child.workspace_dir.join("c.txt").is_file());
        assert!(!h.workspace_dir.join("c.txt").exists());
        // the child's own fence set-up: unleased again keeps the processes;
        // its first lease may take a fence below the parent's
        c.set_fence(None).await.unwrap();
        assert_eq!(
            sh_as(&c, None, &format!("kill -0 {pid} && echo up"))
                .await
                .unwrap(),
            (0, "up\n".into())
        );
        c.set_fence(Some(1)).await.unwrap();
        assert_eq!(
            sh_as(&c, Some(1), "echo leased").await.unwrap(),
            (0, "leased\n".into())
        );
        // the parent's process never noticed
        assert_eq!(
            sh_as(&p, Some(3), &alive).await.unwrap(),
            (0, format!("{pid}-kept\n"))
        );

        // a fork that fails once the parent was saved (the child's
        // template is not there) leaves nothing of the child, and the
        // parent running its process under its lease (behind a new gofer)
        let mut bad = envd_spec(&f, &envd, "sbx-fork");
        bad.template.digest = format!("sha256:{}", "0".repeat(64));
        let err = rt.fork_running(&parent.id, &bad).await.unwrap_err();
        assert!(
            format!("{err}").contains("not in the template store"),
            "{err}"
        );
        assert!(!rt.list().await.unwrap().contains(&bad.id));
        for suffix in ["", ".checkpoint", ".seed"] {
            assert!(!f.state.join(format!("{}{suffix}", bad.id)).exists());
        }
        let p = client_of(&SandboxHandle {
            envd: Some(rt.envd_endpoint(&parent.id).await.unwrap()),
            ..fork.parent.clone()
        });
        p.wait_ready(Duration::from_secs(10)).await.unwrap();
        assert_eq!(
            sh_as(&p, Some(3), &alive).await.unwrap(),
            (0, format!("{pid}-kept\n"))
        );
        // an id that is taken is refused before the parent is touched
        let before = rt.envd_endpoint(&parent.id).await.unwrap();
        let err = rt.fork_running(&parent.id, &child).await.unwrap_err();
        assert!(
            matches!(err, aviary_runtime::RuntimeError::AlreadyExists { .. }),
            "{err:?}"
        );
        assert_eq!(
            rt.envd_endpoint(&parent.id).await.unwrap(),
            before,
            "the parent was not stopped"
        );

        rt.destroy(&child.id).await.unwrap();
        rt.destroy(&parent.id).await.unwrap();
        assert!(rt.list().await.unwrap().is_empty());
        // (other sandboxes of this host may come and go under */aviary)
        let without_cgroups = |mut fp: Footprint| {
            fp.remove("cgroup dirs under */aviary");
            fp
        };
        assert_eq!(
            without_cgroups(footprint(&f.state)),
            without_cgroups(empty),
            "nothing of either is left"
        );
        for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
            for id in [&parent.id, &child.id] {
                assert!(!h.path().join("aviary").join(id.as_str()).exists());
            }
        }
    }

    /// crun cannot fork a running sandbox: `Unsupported`, nothing made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_fork_is_unsupported_on_crun() {
        use aviary_runtime::{Checkpointable, RuntimeError};
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = f.runtime(OciBinary::Crun);
        let (parent, child) = (spec_for(&f), spec_for(&f));
        let err = rt.fork_running(&parent.id, &child).await.unwrap_err();
        assert!(matches!(err, RuntimeError::Unsupported { .. }), "{err:?}");
        assert!(rt.list().await.unwrap().is_empty());
    }

    /// p50 of `samples` in ms.
    fn p50_ms(samples: &[Duration]) -> f64 {
        conformance::median(samples).as_secs_f64() * 1000.0
    }

    /// Create → envd answers → first exec, and then an exec round trip (p50 of 20).
    async fn create_to_first_exec(
        rt: &OciRuntime,
        spec: &SandboxSpec,
    ) -> (Duration, Duration, EnvdClient) {
        let t = std::time::Instant::now();
        let h = rt.create(spec).await.unwrap();
        let client = client_of(&h);
        client.wait_ready(Duration::from_secs(20)).await.unwrap();
        client.set_fence(Some(1)).await.unwrap();
        assert_eq!(sh(&client, "true").await.0, 0);
        let first = t.elapsed();
        let mut execs = Vec::new();
        for _ in 0..20 {
            let t = std::time::Instant::now();
            sh(&client, "true").await;
            execs.push(t.elapsed());
        }
        (first, conformance::median(&execs), client)
    }

    /// Benchmark (`scripts/bench.sh gvisor`): crun beside runsc for create →
    /// first exec and exec round trips, and runsc's memory checkpoint and
    /// restore of a sandbox whose process holds 100 MB. Prints a table.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a timing measurement, not a test: scripts/bench.sh gvisor runs it and writes BENCHMARKS.md; tests never assert timings"]
    async fn measure_checkpoint_cost() {
        use aviary_runtime::Checkpointable;
        let _g = LOCK.lock().await;
        let Some(envd) = envd_binary() else { return };
        let Some(f) = fixture() else { return };
        let rounds: usize = std::env::var("AVIARY_BENCH_GVISOR_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5);
        let crun = f.runtime(OciBinary::Crun);
        let runsc = f.runtime(OciBinary::Runsc);
        let mut first = [Vec::new(), Vec::new()];
        let mut execs = [Vec::new(), Vec::new()];
        let (mut ckpt, mut restore, mut image_mb, mut held_mb) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            for (i, rt) in [&crun, &runsc].into_iter().enumerate() {
                let mut spec = envd_spec(&f, &envd, "sbx-bench");
                spec.resources.memory_mb = 1024;
                let (a, b, client) = create_to_first_exec(rt, &spec).await;
                first[i].push(a);
                execs[i].push(b);
                if i == 1 {
                    // 100 MB of base64 text in a shell variable
                    let (code, out) = sh_within(
                        &client,
                        "head -c 78643200 /dev/urandom > /tmp/blob && \
                         sh -c 'x=$(base64 -w 0 /tmp/blob); rm /tmp/blob; echo $$ > /tmp/holder; echo ${#x} > /tmp/held; while :; do sleep 1000; done' >/dev/null 2>&1 & \
                         while [ ! -s /tmp/held ]; do sleep 0.1; done; cat /tmp/held",
                        Duration::from_secs(600),
                    )
                    .await;
                    assert_eq!(code, 0, "{out}");
                    held_mb.push(out.trim().parse::<f64>().unwrap() / 1e6);
                    let t = std::time::Instant::now();
                    rt.checkpoint(&spec.id).await.unwrap();
                    ckpt.push(t.elapsed());
                    let dir = f.state.join(format!("{}.checkpoint", spec.id));
                    let bytes: u64 = std::fs::read_dir(&dir)
                        .unwrap()
                        .flatten()
                        .map(|e| e.metadata().unwrap().len())
                        .sum();
                    image_mb.push(bytes as f64 / 1e6);
                    let t = std::time::Instant::now();
                    let h = rt.restore(&spec).await.unwrap();
                    client_of(&h)
                        .wait_ready(Duration::from_secs(20))
                        .await
                        .unwrap();
                    restore.push(t.elapsed());
                    // the same process, its 100 MB resident again
                    let (code, out) = sh(
                        &client_of(&h),
                        "cat /tmp/held; grep VmRSS /proc/$(cat /tmp/holder)/status",
                    )
                    .await;
                    assert_eq!(code, 0, "{out}");
                    let rss_kb: u64 = out
                        .split_whitespace()
                        .find_map(|w| w.parse().ok().filter(|_| w != "104857600"))
                        .unwrap_or(0);
                    assert!(out.starts_with("104857600\n"), "{out}");
                    assert!(rss_kb > 100_000, "the holder's memory came back: {out}");
                }
                rt.destroy(&spec.id).await.unwrap();
            }
        }
        let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        println!("| operation (p50 of {rounds}) | crun | runsc |");
        println!("|---|---|---|");
        println!(
            "| create → envd answers → first exec | {:.0} ms | {:.0} ms |",
            p50_ms(&first[0]),
            p50_ms(&first[1])
        );
        println!(
            "| exec round trip (`true`, p50 of 20 per sandbox) | {:.1} ms | {:.1} ms |",
            p50_ms(&execs[0]),
            p50_ms(&execs[1])
        );
        println!(
            "| memory checkpoint, a process holding {:.0} MB (envd steps aside, save, stop) | — | {:.0} ms |",
            avg(&held_mb),
            p50_ms(&ckpt)
        );
        println!(
            "| restore → envd answers | — | {:.0} ms |",
            p50_ms(&restore)
        );
        println!(
            "| checkpoint image on disk | — | {:.0} MB |",
            avg(&image_mb)
        );
        assert!(runsc.list().await.unwrap().is_empty());
        assert!(crun.list().await.unwrap().is_empty());
    }
}
