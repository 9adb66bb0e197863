//! `aviary sandbox exec -it` end to end through a REAL pseudo-terminal: the
//! `aviary` binary runs with a pty (nix's openpty) as its controlling
//! terminal and stdio, like under a terminal emulator, against
//! `aviary serve` on the default (Debian) template; the test types into
//! bash and reads the screen.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_aviary");

struct Server {
    child: Child,
    url: String,
    data: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

fn envd() -> PathBuf {
    if let Some(p) = std::env::var_os("AVIARY_ENVD") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/build-envd.sh"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// `aviary serve` on a free port, a fresh data dir and the shared template cache.
fn serve() -> Server {
    let dir = tempfile::Builder::new()
        .prefix("avy")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("data");
    let cache = std::env::var_os("AVIARY_TEST_TEMPLATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/aviary-test-templates"));
    std::fs::create_dir_all(&cache).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let log = std::fs::File::create(dir.path().join("serve.log")).unwrap();
    let child = Command::new(BIN)
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--templates-dir")
        .arg(&cache)
        .arg("--envd")
        .arg(envd())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let s = Server {
        child,
        url,
        data,
        _dir: dir,
    };
    // the first run on a fresh machine builds the Debian template (~1-2 min)
    let start = Instant::now();
    loop {
        let out = Command::new("curl")
            .args(["-s", &format!("{}/readyz", s.url)])
            .output()
            .unwrap();
        let body = String::from_utf8_lossy(&out.stdout);
        if body.contains("\"ready\"") {
            break;
        }
        assert!(!body.contains("\"failed\""), "server failed: {body}");
        assert!(
            start.elapsed() < Duration::from_secs(900),
            "server not ready: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    s
}

fn aviary(s: &Server, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("AVIARY_URL", &s.url)
        .env("AVIARY_DATA_DIR", &s.data)
        .env_remove("AVIARY_API_KEY")
        .output()
        .unwrap()
}

/// `aviary ARGS` on a new pseudo-terminal of `cols` x `rows`: what the
/// terminal shows is collected by a reader thread.
struct OnTerminal {
    child: Child,
    master: std::fs::File,
    slave_path: PathBuf,
    screen: Arc<Mutex<String>>,
    _slave: OwnedFd,
}

impl OnTerminal {
    fn start(s: &Server, args: &[&str], cols: u16, rows: u16) -> OnTerminal {
        let size = nix::pty::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(Some(&size), None).unwrap();
        let slave_path =
            std::fs::read_link(format!("/proc/self/fd/{}", pty.slave.as_raw_fd())).unwrap();
        let stdio = || Stdio::from(pty.slave.try_clone().unwrap());
        // setsid -c: a new session whose controlling terminal is the pty
        let child = Command::new("setsid")
            .args(["-w", "-c", BIN])
            .args(args)
            .env("AVIARY_URL", &s.url)
            .env("AVIARY_DATA_DIR", &s.data)
            .env_remove("AVIARY_API_KEY")
            .env("TERM", "xterm")
            .stdin(stdio())
            .stdout(stdio())
            .stderr(stdio())
            .spawn()
            .unwrap();
        let master = std::fs::File::from(pty.master);
        let screen = Arc::new(Mutex::new(String::new()));
        let (mut reader, seen) = (master.try_clone().unwrap(), screen.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once every process let go of the terminal
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        OnTerminal {
            child,
            master,
            slave_path,
            screen,
            _slave: pty.slave,
        }
    }

    fn screen(&self) -> String {
        self.screen.lock().unwrap().clone()
    }

    fn type_keys(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).unwrap();
    }

    /// Waits until `needle` is on the screen (a hung session fails after a
    /// generous guard, with the screen).
    fn expect(&self, needle: &str) {
        let start = Instant::now();
        while !self.screen().contains(needle) {
            if start.elapsed() > Duration::from_secs(120) {
                panic!("{needle:?} never showed; screen: {:?}", self.screen());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the CLI's exit (the same guard).
    fn exit_code(&mut self) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            if start.elapsed() > Duration::from_secs(120) {
                let _ = self.child.kill();
                panic!("the CLI never exited; screen: {:?}", self.screen());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for OnTerminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until exactly one `sleep` runs in the sandbox.
fn wait_for_sleep(s: &Server, id: &str) {
    let start = Instant::now();
    loop {
        let o = aviary(
            s,
            &[
                "sandbox",
                "exec",
                id,
                "--",
                "sh",
                "-c",
                "cat /proc/[0-9]*/comm | grep -cx sleep || true",
            ],
        );
        if String::from_utf8_lossy(&o.stdout).trim() == "1" {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "sleep never ran: {o:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn exec_it_runs_bash_on_a_real_terminal() {
    let s = serve();
    let o = aviary(&s, &["sandbox", "create"]);
    assert!(o.status.success(), "{o:?}");
    let id = String::from_utf8(o.stdout).unwrap().trim().to_owned();

    let mut t = OnTerminal::start(
        &s,
        &[
            "sandbox",
            "exec",
            "-it",
            "-e",
            "WHO=tester",
            "-w",
            "/tmp",
            &id,
            "--",
            "bash",
        ],
        100,
        30,
    );
    t.type_keys("echo $((6*7)); echo \"$WHO in $PWD\"; stty size\r");
    t.expect("42\r\n");
    t.expect("tester in /tmp");
    t.expect("30 100");
    // the local window changes: the CLI gets SIGWINCH and resizes the remote one
    let st = Command::new("stty")
        .arg("-F")
        .arg(&t.slave_path)
        .args(["cols", "120", "rows", "40"])
        .status()
        .unwrap();
    assert!(st.success());
    let start = Instant::now();
    loop {
        t.type_keys("stty size\r");
        std::thread::sleep(Duration::from_millis(200));
        if t.screen().contains("40 120") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never resized: {:?}",
            t.screen()
        );
    }
    // Ctrl-C (raw mode: the byte goes to the sandbox) stops sleep, not the CLI
    t.type_keys("sleep 600\r");
    wait_for_sleep(&s, &id);
    t.type_keys("\x03");
    t.type_keys("echo after-$?\r");
    t.expect("after-130");
    t.type_keys("exit 3\r");
    assert_eq!(t.exit_code(), Some(3), "screen: {:?}", t.screen());
    drop(t);

    // -t alone: a terminal, the keyboard not read; Ctrl-C here (a SIGINT to
    // the CLI, the local terminal is not raw) is sent on to the command
    let mut t = OnTerminal::start(
        &s,
        &[
            "sandbox",
            "exec",
            "-t",
            &id,
            "--",
            "sh",
            "-c",
            "[ -t 1 ] && echo on-a-tty; exec sleep 600",
        ],
        80,
        24,
    );
    t.expect("on-a-tty");
    wait_for_sleep(&s, &id);
    t.type_keys("\x03");
    assert_eq!(t.exit_code(), Some(130), "screen: {:?}", t.screen());
    drop(t);

    // -t without a terminal on stdin is a clear error, nothing runs
    let o = aviary(&s, &["sandbox", "exec", "-t", &id, "--", "true"]);
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("-t needs a terminal on stdin"), "{err}");

    // -i alone still streams stdin as before; -e and -w work without -t too
    let o = Command::new(BIN)
        .args([
            "sandbox", "exec", "-i", "-e", "X=y", "-w", "/tmp", &id, "--",
        ])
        .args(["sh", "-c", "cat; echo \"$X $PWD\""])
        .env("AVIARY_URL", &s.url)
        .env("AVIARY_DATA_DIR", &s.data)
        .env_remove("AVIARY_API_KEY")
        .stdin(Stdio::from(std::fs::File::open("/etc/hostname").unwrap()))
        .output()
        .unwrap();
    let expected = format!(
        "{}y /tmp\n",
        std::fs::read_to_string("/etc/hostname").unwrap()
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), expected, "{o:?}");

    // run -it: create, the terminal session, destroy; exit code propagates
    let mut t = OnTerminal::start(&s, &["run", "-it", "--", "bash"], 80, 24);
    t.type_keys("echo in-run-$((1+1)); exit 4\r");
    t.expect("in-run-2");
    assert_eq!(t.exit_code(), Some(4), "screen: {:?}", t.screen());
    drop(t);
    let o = aviary(&s, &["sandbox", "rm", &id]);
    assert!(o.status.success(), "{o:?}");
    let o = aviary(&s, &["sandbox", "ls", "--json"]);
    let left: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        left["sandboxes"].as_array().map(Vec::len),
        Some(0),
        "{left}"
    );
}
