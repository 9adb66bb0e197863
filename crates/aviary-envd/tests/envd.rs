//! End-to-end tests: the real `aviary-envd` binary on a temp socket, driven by
//! the real async client (and by raw bytes for the malformed-input cases).

#[cfg(test)]
mod e2e {
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{symlink, FileTypeExt};
    use std::os::unix::net::UnixStream as StdUnixStream;
    use std::os::unix::process::CommandExt;
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
        /// Activated daemons: the pid the client requires as the socket's peer.
        peer_pid: Option<u32>,
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
                peer_pid: None,
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
                peer_pid: None,
            };
            d.client()
                .wait_ready(Duration::from_secs(10))
                .await
                .unwrap();
            Some(d)
        }

        fn client(&self) -> EnvdClient {
            match self.peer_pid {
                Some(pid) => EnvdClient::new(&self.socket).expect_peer_pid(pid),
                None => EnvdClient::new(&self.socket),
            }
        }

        /// Starts envd the way the host does: on a socket bound in a directory
        /// of its own and not listening, passed as fd 3 (`--listen-fd 3`). With
        /// `pid1`, as PID 1 of a new PID namespace, behind `wrapper` (a command
        /// prefix such as `setpriv …`). The client verifies the peer pid.
        async fn start_activated(pid1: bool, wrapper: &[&str]) -> Option<Daemon> {
            if pid1 && !pid_namespaces_work() {
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("envd.sock");
            let root = dir.path().join("root");
            std::fs::create_dir(&root).unwrap();
            let sock = bound_unlistened_socket(&socket, libc::SOCK_STREAM);
            let mut argv: Vec<String> = Vec::new();
            if pid1 {
                argv.extend(
                    ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
                        .map(String::from),
                );
            }
            argv.extend(wrapper.iter().map(|a| a.to_string()));
            argv.push(envd_bin());
            argv.extend(["--listen-fd".into(), "3".into(), "--root".into()]);
            argv.push(root.to_str().unwrap().to_owned());
            let mut cmd = Command::new(&argv[0]);
            cmd.args(&argv[1..]).stdin(Stdio::null());
            pass_as_fd3(&mut cmd, sock.as_raw_fd());
            let child = cmd.spawn().unwrap();
            drop(sock);
            let mut d = Daemon {
                child,
                _dir: dir,
                socket,
                root,
                peer_pid: None,
            };
            // As PID 1, envd is the child of `unshare`: wait until it exists.
            let deadline = Instant::now() + Duration::from_secs(10);
            while pid1 && d.envd_pid() == d.child.id() as i32 {
                assert!(Instant::now() < deadline, "unshare never forked envd");
                std::thread::sleep(Duration::from_millis(5));
            }
            d.peer_pid = Some(d.envd_pid() as u32);
            d.client()
                .wait_ready(Duration::from_secs(10))
                .await
                .unwrap();
            Some(d)
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

    fn pid_namespaces_work() -> bool {
        let probe = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "true"])
            .status();
        let ok = probe.map(|s| s.success()).unwrap_or(false);
        if !ok {
            eprintln!("SKIPPED: `unshare --pid --fork --mount-proc` does not work here (needs root and util-linux)");
        }
        ok
    }

    /// An AF_UNIX socket of `kind` bound at `path` and not listening, as the
    /// host creates envd's socket.
    fn bound_unlistened_socket(path: &Path, kind: libc::c_int) -> OwnedFd {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_UNIX, kind | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_un is a valid (empty) address.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = path.as_os_str().as_bytes();
        assert!(bytes.len() < addr.sun_path.len(), "socket path too long");
        for (d, b) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *b as libc::c_char;
        }
        // SAFETY: `addr` is an initialised sockaddr_un of the size passed.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        fd
    }

    /// Makes `fd` the spawned child's descriptor 3, inheritable.
    fn pass_as_fd3(cmd: &mut Command, fd: RawFd) {
        // SAFETY: between fork and exec the closure only calls dup2 and fcntl,
        // which are async-signal-safe, and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if fd == 3 {
                    // dup2(3, 3) would keep close-on-exec: clear it instead.
                    let flags = libc::fcntl(3, libc::F_GETFD);
                    if flags == -1 || libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC) == -1
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 3) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
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

        // A command that cannot start exits as in a shell: 127 not found,
        // 126 not executable, the reason on stderr.
        let out = c
            .exec_collect(
                ExecSpec {
                    argv: vec!["/no/such/program".into()],
                    ..ExecSpec::default()
                },
                None,
            )
            .await
            .unwrap();
        assert_eq!(out.exit.exit_code, 127);
        assert_eq!(out.stderr, b"/no/such/program: command not found\n");
        let script = d.root.join("not-executable.sh");
        std::fs::write(&script, "echo hi\n").unwrap();
        let out = c
            .exec_collect(
                ExecSpec {
                    argv: vec![script.to_str().unwrap().into()],
                    ..ExecSpec::default()
                },
                None,
            )
            .await
            .unwrap();
        assert_eq!(out.exit.exit_code, 126, "{:?}", out);
        assert!(String::from_utf8_lossy(&out.stderr).contains("permission denied"));
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

    // ---- Security hardening (issue 7) -------------------------------------

    /// Finding 1: envd serves a socket the host bound and handed down; the
    /// kernel names envd as the peer, and no exec'd process inherits the socket.
    #[tokio::test]
    async fn socket_activation_serves_an_inherited_unlistened_socket() {
        let d = Daemon::start_activated(false, &[]).await.unwrap();
        let envd_pid = d.child.id();
        let h = d.client().health().await.unwrap();
        assert!(!h.pid1);
        let conn = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
        assert_eq!(
            conn.peer_cred().unwrap().pid(),
            Some(i32::try_from(envd_pid).unwrap())
        );
        drop(conn);
        // The verified client refuses a socket served by anyone else.
        let e = EnvdClient::new(&d.socket)
            .expect_peer_pid(envd_pid + 1)
            .health()
            .await
            .unwrap_err();
        assert!(matches!(e, EnvdError::PeerMismatch { .. }), "{e:?}");
        // An exec'd process holds no socket at all: its stdio are pipes, and the
        // listening socket (and the connection) are close-on-exec.
        let out = d
            .client()
            .exec_collect(
                sh("for f in /proc/$$/fd/*; do echo \"$f $(readlink $f)\"; done"),
                None,
            )
            .await
            .unwrap();
        let fds = String::from_utf8(out.stdout).unwrap();
        assert!(fds.contains("pipe:"), "{fds}");
        assert!(
            !fds.contains("socket:"),
            "an exec inherited a socket: {fds}"
        );
    }

    /// Runs envd with `args` and `fd3` as its descriptor 3; returns its exit
    /// code and stderr (it must exit by itself).
    fn run_envd_expecting_exit(args: &[&str], fd3: Option<RawFd>) -> (Option<i32>, String) {
        let mut cmd = Command::new(envd_bin());
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(fd) = fd3 {
            pass_as_fd3(&mut cmd, fd);
        }
        let mut child = cmd.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("envd {args:?} kept running: it accepted what it must refuse");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (status.code(), err)
    }

    #[test]
    fn listen_fd_refuses_anything_but_a_unix_stream_socket() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap().to_owned();
        let file = std::fs::File::create(dir.path().join("plain")).unwrap();
        let dgram = bound_unlistened_socket(&dir.path().join("dgram.sock"), libc::SOCK_DGRAM);
        let args = ["--listen-fd", "3", "--root", root.as_str()];
        let cases: [(&str, Option<RawFd>, &str); 3] = [
            ("regular file", Some(file.as_raw_fd()), "is not a socket"),
            (
                "datagram socket",
                Some(dgram.as_raw_fd()),
                "not AF_UNIX SOCK_STREAM",
            ),
            ("nothing inherited", None, "was not inherited"),
        ];
        for (name, fd, why) in cases {
            let (code, err) = run_envd_expecting_exit(&args, fd);
            assert_eq!(code, Some(1), "{name}: {err}");
            assert!(err.contains(why), "{name}: {err}");
        }
        let (code, err) =
            run_envd_expecting_exit(&["--listen-fd", "1", "--root", root.as_str()], None);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("stdio"), "{err}");
        let (code, err) = run_envd_expecting_exit(
            &[
                "--listen-fd",
                "3",
                "--socket",
                "/tmp/x.sock",
                "--root",
                root.as_str(),
            ],
            None,
        );
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("exclude each other"), "{err}");
    }

    /// Finding 1 (PID 1): root inside the sandbox, with the sandbox's
    /// capabilities (no CAP_SYS_PTRACE), cannot reach envd's descriptors
    /// through /proc/1; and the host-side peer check names envd's host pid.
    #[tokio::test]
    async fn pid1_envd_is_activated_and_not_dumpable_for_sandbox_root() {
        if !Path::new("/usr/bin/setpriv").exists() {
            eprintln!("SKIPPED: setpriv (util-linux) missing");
            return;
        }
        let wrapper = ["/usr/bin/setpriv", "--bounding-set", "-sys_ptrace"];
        let Some(d) = Daemon::start_activated(true, &wrapper).await else {
            return;
        };
        let c = d.client();
        assert!(c.health().await.unwrap().pid1);
        c.set_fence(Some(1)).await.unwrap();
        // Listing /proc/1/fd is allowed to root; reading where the descriptors
        // lead (or opening them) needs ptrace access, which non-dumpable denies.
        let out = c
            .exec_collect(sh("ls -l /proc/1/fd/"), Some(1))
            .await
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            !stdout.contains(" -> ") && stderr.contains("Permission denied"),
            "envd's descriptors are readable from inside the sandbox: {stdout} {stderr}"
        );
        // Processes envd starts stay ordinary (dumpable).
        let out = c
            .exec_collect(sh("ls /proc/self/fd >/dev/null"), Some(1))
            .await
            .unwrap();
        assert_eq!(out.exit.exit_code, 0);

        // As PID 1 a new fence ends every process of the namespace, daemons
        // that left their session included, before set_fence answers.
        let out = c
            .exec_collect(
                sh("setsid sh -c 'sleep 100' </dev/null >/dev/null 2>&1 & sleep 100 </dev/null >/dev/null 2>&1 & echo started"),
                Some(1),
            )
            .await
            .unwrap();
        assert_eq!(out.stdout, b"started\n");
        c.set_fence(Some(2)).await.unwrap();
        let out = c
            .exec_collect(sh("ls -d /proc/[0-9]* | wc -l"), Some(2))
            .await
            .unwrap();
        // PID 1, the sh and its ls (wc may have run before ls's /proc read, or not).
        let n: u32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            n <= 4,
            "{n} processes left in the sandbox after the fence moved"
        );
    }

    /// Finding 3: an exec still running under the old token, and a daemon it
    /// left behind in its own session, are gone before set_fence answers; their
    /// writes never land. A renewal kills nothing.
    #[tokio::test]
    async fn moving_the_fence_ends_the_previous_holders_processes() {
        let d = Daemon::start(&["--trust-all-peers"]).await;
        let c = d.client();
        c.set_fence(Some(1)).await.unwrap();
        let stale = d.root.join("stale");
        let daemon_stale = d.root.join("daemon-stale");
        let mut running = c
            .exec(
                sh(&format!("echo $$; sleep 1; echo x > {}", stale.display())),
                Some(1),
            )
            .await
            .unwrap();
        let ExecEvent::Stdout(line) = running.next().await.unwrap() else {
            panic!("expected the pid first")
        };
        let exec_pid: i32 = String::from_utf8(line).unwrap().trim().parse().unwrap();
        let out = c
            .exec_collect(
                sh(&format!(
                    "setsid sh -c 'sleep 1; echo y > {}' </dev/null >/dev/null 2>&1 & echo $!",
                    daemon_stale.display()
                )),
                Some(1),
            )
            .await
            .unwrap();
        let daemon_pid: i32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(process_exists(exec_pid) && process_exists(daemon_pid));

        // A new holder: everything of the old one is dead and reaped on return.
        c.set_fence(Some(2)).await.unwrap();
        assert!(
            !process_exists(exec_pid),
            "the old exec survived the fence move"
        );
        assert!(
            !process_exists(daemon_pid),
            "the old exec's daemon survived"
        );
        match running.next().await.unwrap() {
            ExecEvent::Exit(e) => assert_eq!(e.signal, Some(9)),
            other => panic!("{other:?}"),
        }
        // Past the moment they would have written.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!stale.exists() && !daemon_stale.exists());

        // A renewal (same fence) leaves the holder's processes alone.
        let out = c
            .exec_collect(
                sh("sleep 100 </dev/null >/dev/null 2>&1 & echo $!"),
                Some(2),
            )
            .await
            .unwrap();
        let bg: i32 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        c.set_fence(Some(2)).await.unwrap();
        assert!(process_exists(bg), "a renewal killed the holder's process");
        // Release (Some -> None) ends them.
        c.set_fence(None).await.unwrap();
        assert!(!process_exists(bg), "a release left the holder's process");
        assert_eq!(c.health().await.unwrap().running_execs, 0);
    }

    /// Finding 5: FIFOs, sockets and the like are refused at once, so parallel
    /// reads of a FIFO cannot pin envd's connections.
    #[tokio::test]
    async fn non_regular_files_are_refused_and_cannot_exhaust_envd() {
        let d = Daemon::start(&[]).await;
        let c = d.client();
        let made = Command::new("mkfifo")
            .arg(d.root.join("fifo"))
            .status()
            .unwrap();
        assert!(made.success());
        let _sock = std::os::unix::net::UnixListener::bind(d.root.join("envd.sock")).unwrap();
        let reads = (0..130).map(|_| {
            let c = c.clone();
            tokio::spawn(async move { c.read_file("/fifo", None).await.map(|_| ()) })
        });
        // A guard against the old hang, not a timing assertion.
        let results =
            tokio::time::timeout(Duration::from_secs(60), futures_join_all(reads.collect()))
                .await
                .expect("reads of a FIFO hung");
        let mut refused = 0;
        for r in results {
            match r.unwrap().unwrap_err() {
                EnvdError::NotRegularFile(m) => {
                    assert!(m.contains("FIFO"), "{m}");
                    refused += 1;
                }
                // 130 connections at once may exceed the connection cap for an instant.
                EnvdError::Busy => {}
                other => panic!("{other:?}"),
            }
        }
        assert!(refused > 0);
        for p in ["/fifo", "/envd.sock"] {
            let e = c.read_file(p, None).await.unwrap_err();
            assert!(matches!(e, EnvdError::NotRegularFile(_)), "{p}: {e:?}");
            let e = c.write_file(p, None, &b"x"[..], None).await.unwrap_err();
            assert!(matches!(e, EnvdError::NotRegularFile(_)), "{p}: {e:?}");
        }
        assert!(std::fs::symlink_metadata(d.root.join("fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        c.health().await.unwrap();
    }

    /// Finding 5: the host's control calls get a reserved lane. With every
    /// general connection held by a running exec, `health` and `set_fence`
    /// still get through (and the fence move ends those execs); any other
    /// call on the reserved lane is `Busy`.
    #[tokio::test]
    async fn control_calls_have_a_lane_that_execs_cannot_exhaust() {
        // envd's general lane (`server::MAX_CONNECTIONS`).
        const MAX_CONNECTIONS: usize = 128;
        let d = Daemon::start(&["--trust-all-peers"]).await;
        let c = d.client();
        let mut streams = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            streams.push(c.exec(sh("sleep 60"), None).await.unwrap());
        }
        // The first frame of each exec is only sent once it runs; make sure
        // all of them hold their connection before probing.
        while c.health().await.unwrap().running_execs < MAX_CONNECTIONS as u64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let e = c.exec_collect(sh("true"), None).await.unwrap_err();
        assert!(matches!(e, EnvdError::Busy), "{e:?}");
        let e = c.stat("/").await.unwrap_err();
        assert!(matches!(e, EnvdError::Busy), "{e:?}");
        c.set_fence(Some(1)).await.unwrap();
        for mut s in streams {
            let ev = loop {
                match s.next().await {
                    Ok(ExecEvent::Exit(x)) => break Ok(x),
                    Ok(_) => continue,
                    Err(e) => break Err(e),
                }
            };
            if let Ok(x) = ev {
                assert_ne!(x.exit_code, 0, "the fence move ends the old execs");
            }
        }
        assert_eq!(c.health().await.unwrap().running_execs, 0);
        c.exec_collect(sh("true"), Some(1)).await.unwrap();
        // kill_all (a level-1 reset) ends processes and leaves the fence.
        let mut s = c.exec(sh("sleep 60"), Some(1)).await.unwrap();
        while c.health().await.unwrap().running_execs == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        c.kill_all().await.unwrap();
        loop {
            match s.next().await {
                Ok(ExecEvent::Exit(x)) => {
                    assert_ne!(x.exit_code, 0);
                    break;
                }
                Ok(_) => continue,
                Err(_) => break,
            }
        }
        let h = c.health().await.unwrap();
        assert_eq!((h.running_execs, h.fence), (0, Some(1)));
    }

    async fn futures_join_all<T>(
        handles: Vec<tokio::task::JoinHandle<T>>,
    ) -> Vec<Result<T, tokio::task::JoinError>> {
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(h.await);
        }
        out
    }

    /// Finding 9 (envd side): bad exec inputs are client errors, never Internal.
    #[tokio::test]
    async fn bad_exec_inputs_are_client_errors() {
        let d = Daemon::start(&[]).await;
        let c = d.client();
        let mut spec = sh("true");
        spec.env = vec![("A".into(), "x\0y".into())];
        let e = c.exec_collect(spec, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
        let e = c.exec_collect(sh("echo a\0b"), None).await.unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
        std::fs::write(d.root.join("file"), b"").unwrap();
        for (cwd, why) in [
            ("/no/such/dir".to_owned(), "does not exist"),
            (
                d.root.join("file").to_str().unwrap().to_owned(),
                "is not a directory",
            ),
        ] {
            let mut spec = sh("true");
            spec.cwd = Some(cwd.clone());
            match c.exec_collect(spec, None).await.unwrap_err() {
                EnvdError::InvalidPath(m) => assert!(m.contains(why) && m.contains(&cwd), "{m}"),
                other => panic!("{cwd}: {other:?}"),
            }
        }
        let mut spec = sh("true");
        spec.cwd = Some("/tmp\0x".into());
        let e = c.exec_collect(spec, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
        // Over the JSON frame limit: one huge argument, or many env vars.
        let e = c
            .exec_collect(sh(&"x".repeat(900 * 1024)), None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, EnvdError::BadRequest(m) if m.contains("65536")),
            "{e:?}"
        );
        let mut spec = sh("true");
        spec.env = (0..10_000).map(|i| (format!("V{i}"), "v".into())).collect();
        let e = c.exec_collect(spec, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
        // envd's own answer to an oversized frame names the limit.
        let answer = raw_request(&d.socket, &[1, 0, 1, 0, 1]);
        let body = String::from_utf8_lossy(&answer[5..]);
        assert!(
            body.contains("bad_request") && body.contains("65536"),
            "{body}"
        );
    }

    /// Finding 9: read-only file systems, mount points (like the read-only bind
    /// of envd at /.aviary/envd) and full disks are 4xx-class codes.
    #[tokio::test]
    async fn read_only_mounted_and_full_targets_are_client_errors() {
        let probe = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "true"])
            .status();
        if !probe.map(|s| s.success()).unwrap_or(false) {
            eprintln!("SKIPPED: `unshare --mount` does not work here (needs root)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("envd.sock");
        let root = dir.path().join("root");
        for sub in ["ro", "small"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        std::fs::write(root.join("envd-bin"), b"original").unwrap();
        let script = "mount -t tmpfs -o ro,size=1m ro \"$1/ro\" && \
                      mount -t tmpfs -o size=64k small \"$1/small\" && \
                      mount --bind -o ro /bin/true \"$1/envd-bin\" && \
                      exec \"$2\" --socket \"$3\" --root \"$1\"";
        let child = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
            ])
            .arg(&root)
            .arg(envd_bin())
            .arg(&socket)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let d = Daemon {
            child,
            _dir: dir,
            socket,
            root,
            peer_pid: None,
        };
        let c = d.client();
        c.wait_ready(Duration::from_secs(10)).await.unwrap();
        let e = c
            .write_file("/ro/x", None, &b"x"[..], None)
            .await
            .unwrap_err();
        assert!(matches!(e, EnvdError::PermissionDenied(_)), "{e:?}");
        let e = c.mkdir("/ro/d", false, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::PermissionDenied(_)), "{e:?}");
        let e = c
            .write_file("/envd-bin", None, &b"x"[..], None)
            .await
            .unwrap_err();
        assert!(matches!(e, EnvdError::PermissionDenied(_)), "{e:?}");
        let e = c.remove("/envd-bin", false, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::PermissionDenied(_)), "{e:?}");
        let big = vec![7u8; 1024 * 1024];
        let e = c
            .write_file("/small/big", None, &big[..], None)
            .await
            .unwrap_err();
        assert!(matches!(e, EnvdError::NoSpace(_)), "{e:?}");
        // The failed write left no temporary file behind.
        assert_eq!(c.list_dir("/small").await.unwrap().len(), 0);
    }

    #[tokio::test]
    async fn port_tunnels_carry_bytes_half_close_and_end_when_the_fence_moves() {
        use tokio::io::AsyncWriteExt;
        let d = Daemon::start(&["--trust-all-peers"]).await;
        let c = d.client();
        // a server that answers once its request ended (it needs the half-close)
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(b"got:").unwrap();
            s.write_all(&got).unwrap();
        });
        let mut t = c.connect_port(port, None).await.unwrap();
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        t.write_all(&big).await.unwrap();
        t.shutdown().await.unwrap();
        let mut back = Vec::new();
        t.read_to_end(&mut back).await.unwrap();
        server.join().unwrap();
        assert_eq!(&back[..4], b"got:");
        assert!(back[4..] == big[..], "{} bytes came back", back.len());

        // nothing listening; port 0
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_port = closed.local_addr().unwrap().port();
        drop(closed);
        let e = c.connect_port(closed_port, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::PortUnreachable(_)), "{e:?}");
        let e = c.connect_port(0, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");

        // fenced: a token is needed while leased, and a fence move ends the tunnel
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let holder = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // keeps the connection open until the tunnel is closed from envd's side
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        });
        c.set_fence(Some(5)).await.unwrap();
        let e = c.connect_port(port, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::LeaseRequired), "{e:?}");
        let e = c.connect_port(port, Some(4)).await.unwrap_err();
        assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
        let mut t = c.connect_port(port, Some(5)).await.unwrap();
        t.write_all(b"ping").await.unwrap();
        t.flush().await.unwrap();
        c.set_fence(Some(6)).await.unwrap();
        let mut rest = Vec::new();
        assert_eq!(
            t.read_to_end(&mut rest).await.unwrap(),
            0,
            "the old tunnel ended"
        );
        holder.join().unwrap();
    }

    #[tokio::test]
    async fn background_commands_keep_output_for_later_readers() {
        let d = Daemon::start(&["--trust-all-peers"]).await;
        let c = d.client();
        let (handle, pid) = c
            .spawn(sh("echo one; echo two >&2; sleep 0.3; echo three"), None)
            .await
            .unwrap();
        assert!(handle > 0 && pid > 0);
        // follow from another connection: everything, then the exit
        let mut f = c.follow_output(handle).await.unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let exit = loop {
            match f.next().await.unwrap() {
                ExecEvent::Stdout(b) => out.extend(b),
                ExecEvent::Stderr(b) => err.extend(b),
                ExecEvent::Exit(e) => break e,
            }
        };
        assert_eq!(
            (out.as_slice(), err.as_slice(), exit.exit_code),
            (&b"one\nthree\n"[..], &b"two\n"[..], 0)
        );
        // and again, without follow: the kept output and the exit
        let (out, err, info) = c.output(handle).await.unwrap();
        assert_eq!(
            (out.as_slice(), err.as_slice()),
            (&b"one\nthree\n"[..], &b"two\n"[..])
        );
        assert_eq!((info.pid, info.exit.map(|e| e.exit_code)), (pid, Some(0)));
        let e = c.output(handle + 100).await.unwrap_err();
        assert!(matches!(e, EnvdError::NotFound(_)), "{e:?}");
        // a fence move forgets every handle
        c.set_fence(Some(1)).await.unwrap();
        let e = c.output(handle).await.unwrap_err();
        assert!(matches!(e, EnvdError::NotFound(_)), "{e:?}");
        let e = c.spawn(sh("true"), None).await.unwrap_err();
        assert!(matches!(e, EnvdError::LeaseRequired), "{e:?}");
    }

    /// `--bridge`: an HTTP upgrade with the secret reaches envd's protocol
    /// and may move the fence; a wrong or missing secret, or another
    /// upgrade, is refused before envd; a direct connection to the socket
    /// (not the bridge, not from outside) may not move the fence. The
    /// secret file is gone once envd runs.
    #[tokio::test]
    async fn the_bridge_takes_upgrades_with_the_secret_and_may_move_the_fence() {
        use aviary_envd_proto::{
            decode_json, encode_json, read_frame, write_frame, FrameKind, Request, Response,
        };
        let secret_dir = tempfile::tempdir().unwrap();
        let secret_file = secret_dir.path().join("secret");
        let secret = "0123456789abcdef0123456789abcdef";
        std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let addr = format!("127.0.0.1:{port}");
        let d = Daemon::start(&[
            "--bridge",
            &addr,
            "--bridge-secret-file",
            secret_file.to_str().unwrap(),
        ])
        .await;
        assert!(!secret_file.exists(), "envd removed the secret file");

        let upgrade = |headers: &str| {
            let mut c = std::net::TcpStream::connect(&addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(
                c,
                "GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n{headers}\r\n"
            )
            .unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if c.read(&mut b).unwrap() == 0 {
                    break;
                }
                head.push(b[0]);
            }
            (c, String::from_utf8(head).unwrap())
        };
        for (headers, status) in [
            ("Upgrade: aviary-envd\r\n", "401"),
            (
                "Upgrade: aviary-envd\r\nx-aviary-envd-secret: wrong-wrong-wrong-wrong\r\n",
                "401",
            ),
            (
                &*format!("Upgrade: websocket\r\nx-aviary-envd-secret: {secret}\r\n"),
                "400",
            ),
        ] {
            let (_, head) = upgrade(headers);
            assert!(
                head.starts_with(&format!("HTTP/1.1 {status}")),
                "{headers}: {head}"
            );
        }
        let call = |c: &mut std::net::TcpStream, req: &Request| -> Response {
            write_frame(c, FrameKind::Request, &encode_json(req).unwrap()).unwrap();
            let f = read_frame(c).unwrap().expect("an answer");
            assert_eq!(
                f.kind,
                FrameKind::Response,
                "{:?}",
                String::from_utf8_lossy(&f.payload)
            );
            decode_json(&f.payload).unwrap()
        };
        let (mut c, head) = upgrade(&format!(
            "Upgrade: aviary-envd\r\nx-aviary-envd-secret: {secret}\r\n"
        ));
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert!(matches!(
            call(&mut c, &Request::Health),
            Response::Health(_)
        ));
        let (mut c, _) = upgrade(&format!(
            "Upgrade: aviary-envd\r\nx-aviary-envd-secret: {secret}\r\n"
        ));
        assert!(matches!(
            call(&mut c, &Request::SetFence { token: Some(9) }),
            Response::Ok
        ));
        // the same request on the socket directly: not the bridge
        let e = d.client().set_fence(Some(10)).await.unwrap_err();
        assert!(matches!(e, EnvdError::PermissionDenied(_)), "{e:?}");
        assert_eq!(d.client().health().await.unwrap().fence, Some(9));
    }

    /// `--stage-secret SRC DST` (a Pod's init container): the secret of a
    /// read-only file lands in a new 0600 file that `--bridge-secret-file`
    /// takes, and the bridge then accepts it; anything else in the
    /// arguments is refused.
    #[tokio::test]
    async fn a_staged_secret_is_what_the_bridge_then_takes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("mounted");
        let secret = "0123456789abcdef0123456789abcdef";
        std::fs::write(&src, secret).unwrap();
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o400)).unwrap();
        let dst = dir.path().join("staged");
        let status = Command::new(envd_bin())
            .arg("--stage-secret")
            .args([&src, &dst])
            .status()
            .unwrap();
        assert!(status.success());
        assert!(src.exists());
        let mode = std::fs::metadata(&dst).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let status = Command::new(envd_bin())
            .arg("--stage-secret")
            .args([&src, &dst, &src])
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(2));
        // envd with the staged file: the bridge takes the secret
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let _d = Daemon::start(&[
            "--bridge",
            &addr,
            "--bridge-secret-file",
            dst.to_str().unwrap(),
        ])
        .await;
        assert!(!dst.exists(), "envd removed the staged copy");
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            c,
            "GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: aviary-envd\r\nx-aviary-envd-secret: {secret}\r\n\r\n"
        )
        .unwrap();
        let mut head = [0u8; 12];
        c.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"HTTP/1.1 101");
    }
}
