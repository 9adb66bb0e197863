//! End-to-end tests: the real `aviary-envd` binary on a temp socket, driven by
//! the real async client (and by raw bytes for the malformed-input cases).

#[cfg(test)]
mod e2e {
    use std::io::{Read, Write};
    use std::os::unix::fs::symlink;
    use std::os::unix::net::UnixStream as StdUnixStream;
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use aviary_envd_proto::{EnvdClient, EnvdError, ExecEvent, ExecSpec, FileKind};
    use tokio::io::AsyncReadExt;

    /// The envd under test: this crate's binary, or `AVIARY_ENVD_BIN` (e.g. the
    /// static release build from scripts/build-envd.sh, to measure it).
    fn envd_bin() -> String {
        std::env::var("AVIARY_ENVD_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_aviary-envd").to_owned())
    }

    struct Daemon {
        child: Child,
        _dir: tempfile::TempDir,
        socket: PathBuf,
        root: PathBuf,
    }

    impl Daemon {
        /// Starts envd as an ordinary process with `--root <tmp>/root`.
        async fn start(extra: &[&str]) -> Daemon {
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("envd.sock");
            let root = dir.path().join("root");
            std::fs::create_dir(&root).unwrap();
            let child = Command::new(envd_bin())
                .arg("--socket")
                .arg(&socket)
                .arg("--root")
                .arg(&root)
                .args(extra)
                .stdin(Stdio::null())
                .spawn()
                .unwrap();
            let d = Daemon {
                child,
                _dir: dir,
                socket,
                root,
            };
            d.client()
                .wait_ready(Duration::from_secs(10))
                .await
                .unwrap();
            d
        }

        /// Starts envd as PID 1 of a new PID namespace (`unshare --pid --fork
        /// --mount-proc --kill-child`), or `None` (with the reason printed) when this
        /// machine cannot create one.
        async fn start_pid1() -> Option<Daemon> {
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("envd.sock");
            let root = dir.path().join("root");
            std::fs::create_dir(&root).unwrap();
            let probe = Command::new("unshare")
                .args(["--pid", "--fork", "--mount-proc", "true"])
                .status();
            if !probe.map(|s| s.success()).unwrap_or(false) {
                eprintln!("SKIPPED: `unshare --pid --fork --mount-proc` does not work here (needs root and util-linux)");
                return None;
            }
            let child = Command::new("unshare")
                .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
                .arg(envd_bin())
                .arg("--socket")
                .arg(&socket)
                .arg("--root")
                .arg(&root)
                .stdin(Stdio::null())
                .spawn()
                .unwrap();
            let d = Daemon {
                child,
                _dir: dir,
                socket,
                root,
            };
            d.client()
                .wait_ready(Duration::from_secs(10))
                .await
                .unwrap();
            Some(d)
        }

        fn client(&self) -> EnvdClient {
            EnvdClient::new(&self.socket)
        }

        /// Host pid of envd itself (the child of `unshare` in PID-1 mode).
        fn envd_pid(&self) -> i32 {
            let own = self.child.id() as i32;
            let children = std::fs::read_to_string(format!("/proc/{own}/task/{own}/children"))
                .unwrap_or_default();
            children
                .split_whitespace()
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(own)
        }

        fn status_field(&self, field: &str) -> u64 {
            let status =
                std::fs::read_to_string(format!("/proc/{}/status", self.envd_pid())).unwrap();
            let line = status.lines().find(|l| l.starts_with(field)).unwrap();
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        }
    }

    impl Drop for Daemon {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn sh(script: &str) -> ExecSpec {
        ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            ..ExecSpec::default()
        }
    }

    /// Whether a process is still alive (a zombie counts as dead *and reaped* only
    /// once it has disappeared from /proc, so zombies count as alive here).
    fn process_exists(pid: i32) -> bool {
        Path::new(&format!("/proc/{pid}")).exists()
    }

    fn wait_gone(pid: i32) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if !process_exists(pid) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[tokio::test]
    async fn exec_exit_codes_streams_env_cwd_stdin() {
        let d = Daemon::start(&[]).await;
        let c = d.client();

        let out = c.exec_collect(sh("exit 7"), None).await.unwrap();
        assert_eq!(
            (out.exit.exit_code, out.exit.signal, out.exit.timed_out),
            (7, None, false)
        );

        let out = c
            .exec_collect(sh("echo out; echo err >&2"), None)
            .await
            .unwrap();
        assert_eq!(
            (out.stdout.as_slice(), out.stderr.as_slice()),
            (&b"out\n"[..], &b"err\n"[..])
        );
        assert_eq!(out.exit.exit_code, 0);

        let mut spec = sh("echo \"$FOO|$HOME|$LANG|$PATH\"; env | wc -l");
        spec.env = vec![("FOO".into(), "bar baz".into())];
        let out = c.exec_collect(spec, None).await.unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        assert_eq!(
            lines.next().unwrap(),
            "bar baz|/root|C.UTF-8|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        );
        // A clean environment: the test runner's variables do not leak in (sh adds PWD, SHLVL, _).
        assert!(
            lines.next().unwrap().trim().parse::<u32>().unwrap() <= 8,
            "{text}"
        );

        std::fs::create_dir(d.root.join("work")).unwrap();
        let mut spec = sh("pwd");
        spec.cwd = Some(d.root.join("work").to_str().unwrap().to_owned());
        let out = c.exec_collect(spec, None).await.unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap().trim(),
            d.root.join("work").to_str().unwrap()
        );
        let out = c.exec_collect(sh("pwd"), None).await.unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap().trim(),
            d.root.to_str().unwrap()
        );

        // Without stdin the process reads EOF at once.
        let out = c.exec_collect(sh("cat; echo done"), None).await.unwrap();
        assert_eq!(out.stdout, b"done\n");

        let mut spec = sh("tr a-z A-Z");
        spec.stdin = Some(b"hello stdin".to_vec());
        let out = c.exec_collect(spec, None).await.unwrap();
        assert_eq!(out.stdout, b"HELLO STDIN");

        // Stdin far larger than a pipe buffer, echoed back: needs concurrent write and read.
        let big: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut spec = ExecSpec {
            argv: vec!["/bin/cat".into()],
            ..ExecSpec::default()
        };
        spec.stdin = Some(big.clone());
        let out = c.exec_collect(spec, None).await.unwrap();
        assert_eq!(out.stdout.len(), big.len());
        assert!(out.stdout == big);

        // A process that never reads its stdin does not hang the exec.
        let mut spec = sh("exit 3");
        spec.stdin = Some(vec![b'x'; 2_000_000]);
        assert_eq!(c.exec_collect(spec, None).await.unwrap().exit.exit_code, 3);

        // Signalled: 128 + signal.
        let out = c.exec_collect(sh("kill -TERM $$"), None).await.unwrap();
        assert_eq!((out.exit.exit_code, out.exit.signal), (143, Some(15)));

        let err = c
            .exec_collect(
                ExecSpec {
                    argv: vec!["/no/such/program".into()],
                    ..ExecSpec::default()
                },
                None,
            )
            .await
            .unwrap_err();
        assert!(matches!(err, EnvdError::NotFound(_)), "{err:?}");
        let err = c.exec_collect(ExecSpec::default(), None).await.unwrap_err();
        assert!(matches!(err, EnvdError::BadRequest(_)), "{err:?}");
    }

    #[tokio::test]
    async fn exec_output_streams_as_it_comes() {
        let d = Daemon::start(&[]).await;
        let mut s = d
            .client()
            .exec(sh("echo first; sleep 0.5; echo second"), None)
            .await
            .unwrap();
        let t0 = Instant::now();
        assert_eq!(
            s.next().await.unwrap(),
            ExecEvent::Stdout(b"first\n".to_vec())
        );
        let first_at = t0.elapsed();
        assert_eq!(
            s.next().await.unwrap(),
            ExecEvent::Stdout(b"second\n".to_vec())
        );
        assert!(t0.elapsed() > first_at);
        assert!(matches!(s.next().await.unwrap(), ExecEvent::Exit(e) if e.exit_code == 0));
        assert!(matches!(
            s.next().await.unwrap_err(),
            EnvdError::StreamFinished
        ));
    }

    #[tokio::test]
    async fn background_processes_outlive_a_normal_exit() {
        let d = Daemon::start(&[]).await;
        let c = d.client();
        // The background process keeps stdout open; the exec still completes.
        let out = c
            .exec_collect(sh("sleep 100 & echo $!"), None)
            .await
            .unwrap();
        assert_eq!(out.exit.exit_code, 0);
        let bg: i32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(process_exists(bg));
        kill_pid(bg);
        assert!(wait_gone(bg), "background process {bg} was not reaped");

        let mut spec = sh("true");
        spec.cwd = Some("/no/such/dir".into());
        let e = c.exec_collect(spec, None).await.unwrap_err();
        assert!(
            matches!(&e, EnvdError::NotFound(m) if m.contains("/no/such/dir")),
            "{e:?}"
        );
    }

    fn kill_pid(pid: i32) {
        let status = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_process_group() {
        let d = Daemon::start(&[]).await;
        let pidfile = d.root.join("bg.pid");
        let mut spec = sh(&format!(
            "sleep 100 & echo $! > {}; sleep 100",
            pidfile.display()
        ));
        spec.timeout = Some(Duration::from_millis(300));
        let out = d.client().exec_collect(spec, None).await.unwrap();
        assert!(out.exit.timed_out);
        assert_eq!((out.exit.exit_code, out.exit.signal), (137, Some(9)));
        assert!(out.exit.duration >= Duration::from_millis(300));
        let bg: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Killed and reaped (envd is a child subreaper for its execs' orphans).
        assert!(
            wait_gone(bg),
            "backgrounded grandchild {bg} survived the timeout"
        );
    }

    #[tokio::test]
    async fn dropping_the_stream_kills_the_process_group() {
        let d = Daemon::start(&[]).await;
        let mut s = d
            .client()
            .exec(sh("sleep 100 & echo $! $$; wait"), None)
            .await
            .unwrap();
        let ExecEvent::Stdout(line) = s.next().await.unwrap() else {
            panic!("expected the pids first")
        };
        let pids: Vec<i32> = String::from_utf8(line)
            .unwrap()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert!(process_exists(pids[0]) && process_exists(pids[1]));
        drop(s);
        for pid in pids {
            assert!(
                wait_gone(pid),
                "process {pid} survived the client disconnect"
            );
        }
        let h = d.client().health().await.unwrap();
        assert_eq!(h.running_execs, 0);
    }

    #[tokio::test]
    async fn large_output_streams_with_bounded_memory() {
        let d = Daemon::start(&[]).await;
        const TOTAL: u64 = 200 * 1000 * 1000;
        let mut s = d
            .client()
            .exec(sh(&format!("head -c {TOTAL} /dev/zero")), None)
            .await
            .unwrap();
        let mut n = 0u64;
        let exit = loop {
            match s.next().await.unwrap() {
                ExecEvent::Stdout(b) => n += b.len() as u64,
                ExecEvent::Stderr(b) => panic!("stderr: {}", String::from_utf8_lossy(&b)),
                ExecEvent::Exit(e) => break e,
            }
        };
        assert_eq!((n, exit.exit_code), (TOTAL, 0));
        let hwm_kib = d.status_field("VmHWM:");
        eprintln!(
            "200 MB streamed in {:?}; envd peak RSS {hwm_kib} KiB",
            exit.duration
        );
        assert!(
            hwm_kib < 32 * 1024,
            "envd peak RSS {hwm_kib} KiB: output was buffered"
        );
    }

    #[tokio::test]
    async fn file_operations() {
        let d = Daemon::start(&[]).await;
        let c = d.client();
        c.mkdir("/a/b/c", true, None).await.unwrap();
        assert!(matches!(
            c.mkdir("/a/b/c", false, None).await.unwrap_err(),
            EnvdError::AlreadyExists(_)
        ));
        assert!(matches!(
            c.mkdir("/x/y", false, None).await.unwrap_err(),
            EnvdError::NotFound(_)
        ));

        let content: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
        let n = c
            .write_file("/a/b/data.bin", Some(0o640), &content[..], None)
            .await
            .unwrap();
        assert_eq!(n, content.len() as u64);
        assert_eq!(std::fs::read(d.root.join("a/b/data.bin")).unwrap(), content);

        let mut r = c.read_file("/a/b/data.bin", None).await.unwrap();
        assert_eq!(r.size(), content.len() as u64);
        let mut back = Vec::new();
        r.read_to_end(&mut back).await.unwrap();
        assert!(back == content);

        // Overwrite keeps going through a temp file + rename; mode kept when not given.
        c.write_file("/a/b/data.bin", None, &b"short"[..], None)
            .await
            .unwrap();
        let st = c.stat("/a/b/data.bin").await.unwrap();
        assert_eq!(
            (st.kind, st.size, st.mode, st.name.as_str()),
            (FileKind::File, 5, 0o640, "data.bin")
        );
        c.write_file("/a/empty", None, &b""[..], None)
            .await
            .unwrap();
        assert_eq!(c.stat("/a/empty").await.unwrap().size, 0);

        symlink("b", d.root.join("a/lnk")).unwrap();
        let list = c.list_dir("/a").await.unwrap();
        let names: Vec<(&str, FileKind)> = list.iter().map(|e| (e.name.as_str(), e.kind)).collect();
        assert_eq!(
            names,
            vec![
                ("b", FileKind::Dir),
                ("empty", FileKind::File),
                ("lnk", FileKind::Symlink)
            ]
        );
        assert_eq!(list[0].path, "/a/b");
        assert_eq!(c.list_dir("/a/lnk").await.unwrap().len(), 2);

        // Many entries: the listing is chunked below the frame limit.
        for i in 0..2000 {
            std::fs::write(
                d.root
                    .join(format!("a/b/c/file-with-a-longish-name-{i:05}")),
                b"",
            )
            .unwrap();
        }
        assert_eq!(c.list_dir("/a/b/c").await.unwrap().len(), 2000);

        assert!(matches!(
            c.read_file("/a/b", None).await.unwrap_err(),
            EnvdError::InvalidPath(_)
        ));
        assert!(matches!(
            c.read_file("/nope", None).await.unwrap_err(),
            EnvdError::NotFound(_)
        ));
        assert!(matches!(
            c.stat("/nope").await.unwrap_err(),
            EnvdError::NotFound(_)
        ));
        assert!(matches!(
            c.remove("/a", false, None).await.unwrap_err(),
            EnvdError::NotEmpty(_)
        ));
        c.remove("/a/lnk", false, None).await.unwrap();
        assert!(d.root.join("a/b").is_dir());
        c.remove("/a", true, None).await.unwrap();
        assert!(!d.root.join("a").exists());
        assert!(matches!(
            c.remove("/", true, None).await.unwrap_err(),
            EnvdError::InvalidPath(_)
        ));
    }

    async fn check_traversal_refused(d: &Daemon) {
        let c = d.client();
        let outside = d.root.parent().unwrap().join("outside.txt");
        std::fs::write(&outside, b"secret").unwrap();
        symlink("/etc", d.root.join("etc-link")).unwrap();
        symlink("../outside.txt", d.root.join("up-link")).unwrap();
        symlink(
            "../../../../../../../../etc/passwd",
            d.root.join("deep-link"),
        )
        .unwrap();

        for p in [
            "/../outside.txt",
            "/a/../../outside.txt",
            "/..",
            "relative.txt",
            "",
        ] {
            let e = c.read_file(p, None).await.unwrap_err();
            assert!(matches!(e, EnvdError::InvalidPath(_)), "{p}: {e:?}");
            let e = c.write_file(p, None, &b"x"[..], None).await.unwrap_err();
            assert!(matches!(e, EnvdError::InvalidPath(_)), "{p}: {e:?}");
        }
        // Symlinks resolve inside the root: the host's /etc and files beside the root
        // are unreachable (ROOT/etc and ROOT/outside.txt do not exist).
        for p in ["/etc-link/passwd", "/up-link", "/deep-link"] {
            let e = c.read_file(p, None).await.unwrap_err();
            assert!(matches!(e, EnvdError::NotFound(_)), "{p}: {e:?}");
        }
        let e = c
            .write_file("/etc-link/aviary-escape", None, &b"x"[..], None)
            .await
            .unwrap_err();
        assert!(matches!(e, EnvdError::NotFound(_)), "{e:?}");
        assert!(!Path::new("/etc/aviary-escape").exists());
        assert!(matches!(
            c.list_dir("/etc-link").await.unwrap_err(),
            EnvdError::NotFound(_)
        ));
        assert!(matches!(
            c.mkdir("/etc-link/x", true, None).await.unwrap_err(),
            EnvdError::NotFound(_) | EnvdError::InvalidPath(_)
        ));
        // Writing over the symlink itself replaces the link, not its target.
        c.write_file("/up-link", None, &b"replaced"[..], None)
            .await
            .unwrap();
        assert_eq!(std::fs::read(&outside).unwrap(), b"secret");
        assert_eq!(std::fs::read(d.root.join("up-link")).unwrap(), b"replaced");
        // A recursive remove through a symlinked directory removes the link only.
        c.remove("/etc-link", true, None).await.unwrap();
        assert!(Path::new("/etc/passwd").exists());
    }

    #[tokio::test]
    async fn path_traversal_is_refused_with_openat2() {
        let d = Daemon::start(&[]).await;
        check_traversal_refused(&d).await;
    }

    #[tokio::test]
    async fn path_traversal_is_refused_with_the_userspace_resolver() {
        let d = Daemon::start(&["--no-openat2"]).await;
        check_traversal_refused(&d).await;
    }

    #[tokio::test]
    async fn fencing_rules() {
        let d = Daemon::start(&["--trust-all-peers"]).await;
        let c = d.client();
        // Unleased: no token accepted, any token stale.
        c.mkdir("/free", false, None).await.unwrap();
        assert!(matches!(
            c.mkdir("/t1", false, Some(1)).await.unwrap_err(),
            EnvdError::StaleToken
        ));

        c.set_fence(Some(5)).await.unwrap();
        assert_eq!(c.health().await.unwrap().fence, Some(5));
        assert!(matches!(
            c.mkdir("/t", false, None).await.unwrap_err(),
            EnvdError::LeaseRequired
        ));
        assert!(matches!(
            c.mkdir("/t", false, Some(4)).await.unwrap_err(),
            EnvdError::StaleToken
        ));
        assert!(matches!(
            c.exec_collect(sh("true"), Some(4)).await.unwrap_err(),
            EnvdError::StaleToken
        ));
        assert!(matches!(
            c.exec_collect(sh("true"), None).await.unwrap_err(),
            EnvdError::LeaseRequired
        ));
        assert!(matches!(
            c.write_file("/f", None, &b"x"[..], Some(6))
                .await
                .unwrap_err(),
            EnvdError::StaleToken
        ));
        assert!(matches!(
            c.remove("/free", false, None).await.unwrap_err(),
            EnvdError::LeaseRequired
        ));
        assert!(!d.root.join("f").exists() && d.root.join("free").exists());
        // Reads are not fenced.
        c.stat("/free").await.unwrap();
        c.list_dir("/").await.unwrap();

        c.mkdir("/t", false, Some(5)).await.unwrap();
        c.write_file("/t/f", None, &b"x"[..], Some(5))
            .await
            .unwrap();
        assert_eq!(
            c.exec_collect(sh("true"), Some(5))
                .await
                .unwrap()
                .exit
                .exit_code,
            0
        );

        // The fence never goes down.
        assert!(matches!(
            c.set_fence(Some(3)).await.unwrap_err(),
            EnvdError::StaleToken
        ));
        c.set_fence(None).await.unwrap();
        c.remove("/t", true, None).await.unwrap();
        assert!(matches!(
            c.set_fence(Some(4)).await.unwrap_err(),
            EnvdError::StaleToken
        ));
        c.set_fence(Some(6)).await.unwrap();
        let h = c.health().await.unwrap();
        assert_eq!((h.fence, h.highest_fence), (Some(6), Some(6)));
    }

    #[tokio::test]
    async fn set_fence_refused_from_a_peer_in_the_same_pid_namespace() {
        // Without --trust-all-peers and not in its own namespace, every peer (this
        // test included) shows a non-zero pid, like code inside a sandbox does.
        let d = Daemon::start(&[]).await;
        let e = d.client().set_fence(Some(9)).await.unwrap_err();
        assert!(matches!(e, EnvdError::PermissionDenied(_)), "{e:?}");
        assert_eq!(d.client().health().await.unwrap().fence, None);
    }

    #[tokio::test]
    async fn pid1_reaps_orphans_and_trusts_only_the_outside() {
        let Some(d) = Daemon::start_pid1().await else {
            return;
        };
        let c = d.client();
        let h = c.health().await.unwrap();
        assert!(h.pid1);

        // The test process is outside the namespace: SO_PEERCRED pid 0, trusted.
        c.set_fence(Some(2)).await.unwrap();

        // Orphans whose parents exit immediately are re-parented to envd (PID 1) and
        // must be reaped; then no zombie is left in the namespace.
        let script = "i=0; while [ $i -lt 30 ]; do sh -c 'sleep 0.05 &'; i=$((i+1)); done; sleep 0.6; \
                  for f in /proc/[0-9]*/stat; do read -r line < $f 2>/dev/null && echo \"$line\"; done";
        let out = c.exec_collect(sh(script), Some(2)).await.unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let zombies: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.rsplit_once(") ")
                    .map(|(_, rest)| rest.starts_with('Z'))
                    .unwrap_or(false)
            })
            .collect();
        assert!(zombies.is_empty(), "zombies left: {zombies:?}");
        assert!(
            text.lines().any(|l| l.starts_with("1 (aviary-envd)")),
            "{text}"
        );

        // Code inside the sandbox can reach the socket but must not move the fence.
        if !Path::new("/usr/bin/python3").exists() {
            eprintln!("SKIPPED part: /usr/bin/python3 missing, cannot act as an in-sandbox client");
        } else {
            let py = format!(
                "import socket,struct,json\n\
             s=socket.socket(socket.AF_UNIX); s.connect({sock:?})\n\
             p=json.dumps({{'op':'set_fence','token':99}}).encode()\n\
             s.sendall(bytes([1])+struct.pack('>I',len(p))+p)\n\
             h=s.recv(5); print(s.recv(struct.unpack('>I',h[1:])[0]).decode())",
                sock = d.socket.to_str().unwrap()
            );
            let spec = ExecSpec {
                argv: vec!["/usr/bin/python3".into(), "-c".into(), py],
                ..ExecSpec::default()
            };
            let out = c.exec_collect(spec, Some(2)).await.unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                text.contains("permission_denied"),
                "{text} {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(c.health().await.unwrap().fence, Some(2));
        }

        // SIGTERM from inside the sandbox is ignored; from outside, envd kills everything and exits.
        let mut s = c
            .exec(sh("kill -TERM 1; sleep 100"), Some(2))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        c.health().await.unwrap();
        let envd_pid = d.envd_pid();
        let status = Command::new("kill")
            .args(["-TERM", &envd_pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exit = loop {
            match s.next().await {
                Ok(ExecEvent::Exit(e)) => break Some(e),
                Ok(_) => continue,
                Err(_) => break None, // envd exited before it could report: also acceptable
            }
        };
        if let Some(e) = exit {
            assert_eq!(e.signal, Some(9));
        }
        assert!(wait_gone(envd_pid), "envd did not exit on SIGTERM");
    }

    #[tokio::test]
    async fn sigterm_stops_an_ordinary_envd_and_its_execs() {
        let mut d = Daemon::start(&[]).await;
        let mut s = d
            .client()
            .exec(sh("echo $$; sleep 100"), None)
            .await
            .unwrap();
        let ExecEvent::Stdout(pid) = s.next().await.unwrap() else {
            panic!("expected the pid")
        };
        let pid: i32 = String::from_utf8(pid).unwrap().trim().parse().unwrap();
        let status = Command::new("kill")
            .args(["-TERM", &d.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let code = d.child.wait().unwrap();
        assert_eq!(code.code(), Some(0));
        assert!(
            wait_gone(pid),
            "exec'd process {pid} survived envd's SIGTERM"
        );
        assert!(!d.socket.exists());
    }

    fn raw_request(socket: &Path, bytes: &[u8]) -> Vec<u8> {
        let mut s = StdUnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // envd may answer and close before reading everything we send.
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    }

    #[tokio::test]
    async fn malformed_frames_get_an_error_and_do_not_crash_envd() {
        let d = Daemon::start(&[]).await;
        let json = br#"{"op":"health"}"#;
        let mut data_first = vec![2u8, 0, 0, 0, 3];
        data_first.extend_from_slice(b"abc");
        let mut bad_json = vec![1u8, 0, 0, 0, 5];
        bad_json.extend_from_slice(b"{oops");
        let mut unknown_op = vec![1u8, 0, 0, 0, 18];
        unknown_op.extend_from_slice(br#"{"op":"format_c"}"#);
        unknown_op.push(b' ');
        let mut truncated = vec![1u8, 0, 0, 0, 200];
        truncated.extend_from_slice(&json[..]);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("garbage", b"GET / HTTP/1.1\r\n\r\n".to_vec()),
            ("huge length", vec![1, 0xff, 0xff, 0xff, 0xff]),
            ("unknown kind", vec![42, 0, 0, 0, 0]),
            ("data first", data_first),
            ("bad json", bad_json),
            ("unknown op", unknown_op),
            ("truncated", truncated),
            ("half header", vec![1, 0]),
        ];
        for (name, bytes) in cases {
            let answer = raw_request(&d.socket, &bytes);
            assert!(answer.len() > 5, "{name}: no error frame");
            assert_eq!(answer[0], 7, "{name}: not an error frame");
            let body = String::from_utf8_lossy(&answer[5..]);
            assert!(body.contains("bad_request"), "{name}: {body}");
        }
        // Random bytes, several times.
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for _ in 0..50 {
            let bytes: Vec<u8> = (0..512)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            raw_request(&d.socket, &bytes);
        }
        // Connect and hang up without sending anything.
        drop(StdUnixStream::connect(&d.socket).unwrap());
        let h = d.client().health().await.unwrap();
        assert_eq!(h.protocol, aviary_envd_proto::PROTOCOL_VERSION);
    }

    #[tokio::test]
    async fn measure_exec_round_trip_and_idle_rss() {
        let d = Daemon::start(&[]).await;
        let c = d.client();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let idle_rss = d.status_field("VmRSS:");
        let mut times = Vec::with_capacity(200);
        for _ in 0..200 {
            let t = Instant::now();
            let out = c
                .exec_collect(
                    ExecSpec {
                        argv: vec!["/bin/true".into()],
                        ..ExecSpec::default()
                    },
                    None,
                )
                .await
                .unwrap();
            times.push(t.elapsed());
            assert_eq!(out.exit.exit_code, 0);
        }
        times.sort();
        let t = Instant::now();
        for _ in 0..200 {
            c.health().await.unwrap();
        }
        eprintln!(
        "exec /bin/true round trip: median {:?}, p90 {:?}; health round trip mean {:?}; envd idle RSS {idle_rss} KiB ({})",
        times[100],
        times[180],
        t.elapsed() / 200,
        envd_bin()
    );
    }
}
