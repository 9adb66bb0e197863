//! `exec_pty` end to end: the real `aviary-envd` binary on a temp socket,
//! driven by the real async client: a process on a real pseudo-terminal
//! (isatty, window size and resize, input, Ctrl-C and signals to the
//! foreground group, exit codes, a hang-up on disconnect, the fence).

#[cfg(test)]
mod pty {
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use aviary_envd_proto::{
        EnvdClient, EnvdError, ExitInfo, PtyEvent, PtyInput, PtyOutput, PtySpec, SignalSpec,
    };

    fn envd_bin() -> String {
        std::env::var("AVIARY_ENVD_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_aviary-envd").to_owned())
    }

    /// envd as an ordinary process (`--trust-all-peers`: the test moves the fence).
    struct Daemon {
        child: Child,
        _dir: tempfile::TempDir,
        socket: PathBuf,
    }

    impl Daemon {
        async fn start() -> Daemon {
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("envd.sock");
            let root = dir.path().join("root");
            std::fs::create_dir(&root).unwrap();
            let child = Command::new(envd_bin())
                .arg("--socket")
                .arg(&socket)
                .arg("--root")
                .arg(&root)
                .arg("--trust-all-peers")
                .stdin(Stdio::null())
                .spawn()
                .unwrap();
            let d = Daemon {
                child,
                _dir: dir,
                socket,
            };
            d.client()
                .wait_ready(Duration::from_secs(10))
                .await
                .unwrap();
            d
        }

        fn client(&self) -> EnvdClient {
            EnvdClient::new(&self.socket)
        }
    }

    impl Drop for Daemon {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn sh(script: &str, cols: u16, rows: u16) -> PtySpec {
        PtySpec {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            cols,
            rows,
            ..PtySpec::default()
        }
    }

    /// Output so far, and the session's exit once it came.
    struct Session {
        input: PtyInput,
        output: PtyOutput,
        seen: String,
        exit: Option<ExitInfo>,
    }

    impl Session {
        async fn start(c: &EnvdClient, spec: PtySpec, token: Option<u64>) -> Session {
            let (input, output) = c.exec_pty(spec, token).await.unwrap();
            Session {
                input,
                output,
                seen: String::new(),
                exit: None,
            }
        }

        /// Reads until `needle` shows up in the output (a hung session
        /// fails the test after a generous guard, with what it printed).
        async fn expect(&mut self, needle: &str) {
            let guard = tokio::time::timeout(Duration::from_secs(60), async {
                while !self.seen.contains(needle) {
                    assert!(
                        self.exit.is_none(),
                        "exited before {needle:?}: {}",
                        self.seen
                    );
                    match self.output.next().await.unwrap() {
                        PtyEvent::Output(b) => self.seen.push_str(&String::from_utf8_lossy(&b)),
                        PtyEvent::Exit(e) => self.exit = Some(e),
                    }
                }
            })
            .await;
            if guard.is_err() {
                panic!("no {needle:?} in {:?}", self.seen);
            }
        }

        async fn exit(mut self) -> (ExitInfo, String) {
            while self.exit.is_none() {
                match self.output.next().await.unwrap() {
                    PtyEvent::Output(b) => self.seen.push_str(&String::from_utf8_lossy(&b)),
                    PtyEvent::Exit(e) => self.exit = Some(e),
                }
            }
            (self.exit.unwrap(), self.seen)
        }
    }

    #[tokio::test]
    async fn a_terminal_session_sizes_resizes_reads_and_exits() {
        let d = Daemon::start().await;
        let mut spec = sh(
            "[ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo isatty-yes; echo term=$TERM; \
             stty size; read line; stty size; echo \"line=$line\"; exit 3",
            100,
            30,
        );
        spec.env = vec![("TERM".into(), "vt100".into())];
        let mut s = Session::start(&d.client(), spec, None).await;
        s.expect("isatty-yes").await;
        s.expect("term=vt100").await;
        s.expect("30 100").await;
        s.input.resize(120, 40).await.unwrap();
        s.input.write(b"hello\n").await.unwrap();
        s.expect("line=hello").await;
        let (exit, seen) = s.exit().await;
        assert_eq!((exit.exit_code, exit.signal), (3, None), "{seen}");
        assert!(seen.contains("40 120"), "{seen}");
        // the terminal's own line discipline: CR LF, and input echoed
        assert!(seen.contains("hello\r\n"), "{seen}");
    }

    #[tokio::test]
    async fn signals_and_ctrl_c_reach_the_foreground_process() {
        let d = Daemon::start().await;
        let c = d.client();
        // a signal by name, trapped by the shell
        let mut s = Session::start(
            &c,
            sh(
                "trap 'echo caught-int; exit 42' INT; echo ready; while :; do sleep 0.1; done",
                80,
                24,
            ),
            None,
        )
        .await;
        s.expect("ready").await;
        s.input
            .signal(SignalSpec::Name("INT".into()))
            .await
            .unwrap();
        let (exit, seen) = s.exit().await;
        assert_eq!(exit.exit_code, 42, "{seen}");
        assert!(seen.contains("caught-int"), "{seen}");

        // Ctrl-C typed (the byte 0x03): the terminal turns it into SIGINT
        let mut s = Session::start(&c, sh("echo ready; exec sleep 600", 80, 24), None).await;
        s.expect("ready").await;
        s.input.write(b"\x03").await.unwrap();
        let (exit, seen) = s.exit().await;
        assert_eq!((exit.exit_code, exit.signal), (130, Some(2)), "{seen}");

        // by number; an unknown one is refused before it is sent
        let mut s = Session::start(&c, sh("echo ready; exec sleep 600", 80, 24), None).await;
        s.expect("ready").await;
        let e = s
            .input
            .signal(SignalSpec::Name("NOPE".into()))
            .await
            .unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
        s.input.signal(SignalSpec::Number(15)).await.unwrap();
        let (exit, _) = s.exit().await;
        assert_eq!(exit.signal, Some(15));
    }

    #[tokio::test]
    async fn a_missing_command_exits_127_and_bad_requests_are_refused() {
        let d = Daemon::start().await;
        let c = d.client();
        let spec = PtySpec {
            argv: vec!["/nonexistent/prog".into()],
            cols: 80,
            rows: 24,
            ..PtySpec::default()
        };
        let (exit, seen) = Session::start(&c, spec, None).await.exit().await;
        assert_eq!(exit.exit_code, 127);
        assert!(seen.contains("command not found"), "{seen}");
        for (spec, what) in [
            (sh("true", 0, 24), "out of range"),
            (sh("true", 80, 5000), "out of range"),
            (
                PtySpec {
                    cols: 80,
                    rows: 24,
                    ..PtySpec::default()
                },
                "argv is empty",
            ),
            (
                PtySpec {
                    cwd: Some("/nonexistent".into()),
                    ..sh("true", 80, 24)
                },
                "does not exist",
            ),
        ] {
            let e = c.exec_pty(spec, None).await.unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
        // an unknown user is envd's refusal, nothing runs
        let spec = PtySpec {
            user: Some("nobody-here".into()),
            ..sh("true", 80, 24)
        };
        let e = c.exec_pty(spec, None).await.unwrap_err();
        assert!(matches!(e, EnvdError::BadRequest(_)), "{e:?}");
    }

    #[tokio::test]
    async fn a_disconnect_hangs_up_and_kills_the_session() {
        let d = Daemon::start().await;
        let mut s =
            Session::start(&d.client(), sh("echo pid=$$; exec sleep 600", 80, 24), None).await;
        s.expect("pid=").await;
        s.expect("\n").await;
        let pid: i32 = s
            .seen
            .split("pid=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|p| p.parse().ok())
            .unwrap();
        drop(s);
        let gone = tokio::time::timeout(Duration::from_secs(30), async {
            // /proc/PID disappears once envd reaped it
            while std::path::Path::new(&format!("/proc/{pid}")).exists() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if gone.is_err() {
            panic!("process {pid} survived the disconnect");
        }
    }

    #[tokio::test]
    async fn the_fence_is_checked_like_exec() {
        let d = Daemon::start().await;
        let c = d.client();
        c.set_fence(Some(5)).await.unwrap();
        let e = c.exec_pty(sh("true", 80, 24), None).await.unwrap_err();
        assert!(matches!(e, EnvdError::LeaseRequired), "{e:?}");
        let e = c.exec_pty(sh("true", 80, 24), Some(4)).await.unwrap_err();
        assert!(matches!(e, EnvdError::StaleToken), "{e:?}");
        let (exit, _) = Session::start(&c, sh("exit 7", 80, 24), Some(5))
            .await
            .exit()
            .await;
        assert_eq!(exit.exit_code, 7);
        // a session of the old holder ends when the fence moves on
        let mut s = Session::start(&c, sh("echo up; exec sleep 600", 80, 24), Some(5)).await;
        s.expect("up").await;
        c.set_fence(Some(6)).await.unwrap();
        let (exit, _) = s.exit().await;
        assert_eq!(exit.signal, Some(9));
    }

    /// Measures (prints, asserts nothing about time) the throughput of a
    /// large terminal output; checks it arrives whole and in order.
    #[tokio::test]
    async fn measure_terminal_output_throughput() {
        let d = Daemon::start().await;
        let started = std::time::Instant::now();
        let s = Session::start(&d.client(), sh("seq 1 200000", 80, 24), None).await;
        let (exit, seen) = s.exit().await;
        let took = started.elapsed();
        assert_eq!(exit.exit_code, 0);
        let lines: Vec<&str> = seen.split("\r\n").collect();
        assert_eq!((lines[0], lines[199_999]), ("1", "200000"));
        eprintln!(
            "MEASURED envd terminal output: {} bytes in {took:?} ({:.1} MiB/s)",
            seen.len(),
            seen.len() as f64 / took.as_secs_f64() / (1024.0 * 1024.0)
        );
    }
}
