//! The README's quick start, for real: `aviary serve` as a process on the
//! default (Debian + python3) template, driven by the `aviary` binary.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
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

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn envd() -> PathBuf {
    if let Some(p) = std::env::var_os("AVIARY_ENVD") {
        return PathBuf::from(p);
    }
    let out = Command::new(workspace_root().join("scripts/build-envd.sh"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn serve() -> Server {
    serve_with(&[])
}

/// `aviary serve` with extra environment variables.
fn serve_with(env: &[(&str, &str)]) -> Server {
    let dir = tempfile::Builder::new()
        .prefix("avc")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("data");
    let cache = std::env::var_os("AVIARY_TEST_TEMPLATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/aviary-test-templates"));
    std::fs::create_dir_all(&cache).unwrap();
    let url = format!("http://127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.path().join("serve.log")).unwrap();
    let child = Command::new(BIN)
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args(["--listen", url.trim_start_matches("http://")])
        .arg("--templates-dir")
        .arg(&cache)
        .arg("--envd")
        .arg(envd())
        .envs(env.iter().copied())
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

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn quick_start_works_end_to_end() {
    let s = serve();

    let o = aviary(&s, &["run", "--", "python3", "-c", "print(6*7)"]);
    assert_eq!(
        (o.status.code(), stdout(&o).as_str()),
        (Some(0), "42\n"),
        "{o:?}"
    );
    let o = aviary(&s, &["run", "--", "sh", "-c", "exit 7"]);
    assert_eq!(o.status.code(), Some(7), "{o:?}");
    let o = aviary(&s, &["run", "--timeout", "0.5", "--", "sleep", "10"]);
    assert_eq!(o.status.code(), Some(124), "{o:?}");
    // --json: stdout is exactly one JSON document, the output inside it
    let o = aviary(
        &s,
        &[
            "--json",
            "run",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ],
    );
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exit_code"], 3, "{v}");
    assert_eq!(v["stdout"], "out\n", "{v}");
    assert_eq!(v["stderr"], "err\n", "{v}");
    assert!(v["sandbox"].as_str().unwrap().starts_with("sbx-"), "{v}");
    // errors too: one document naming the stable code
    let o = aviary(
        &s,
        &["--json", "sandbox", "get", "sbx-aaaaaaaaaaaaaaaaaaaa"],
    );
    assert_eq!(o.status.code(), Some(66), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["error"]["code"], "not_found", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("sbx-"),
        "{v}"
    );

    let o = aviary(&s, &["--json", "sandbox", "create"]);
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = v["id"].as_str().unwrap().to_owned();
    assert_eq!(v["state"], "Idle");

    let local = s._dir.path().join("data.csv");
    std::fs::write(&local, "a\nb\nc\n").unwrap();
    let o = aviary(
        &s,
        &[
            "sandbox",
            "cp",
            local.to_str().unwrap(),
            &format!("{id}:/workspace/data.csv"),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let o = aviary(
        &s,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "wc",
            "-l",
            "/workspace/data.csv",
        ],
    );
    assert_eq!(stdout(&o), "3 /workspace/data.csv\n", "{o:?}");
    let o = aviary(
        &s,
        &[
            "--json",
            "sandbox",
            "exec",
            &id,
            "--",
            "cat",
            "/workspace/data.csv",
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["exit_code"].as_i64(), v["stdout"].as_str()),
        (Some(0), Some("a\nb\nc\n")),
        "{v}"
    );
    let back = s._dir.path().join("back.csv");
    let o = aviary(
        &s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/workspace/data.csv"),
            back.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "a\nb\nc\n");

    // directories both ways, and `-` for stdin / stdout
    let tree = s._dir.path().join("tree");
    std::fs::create_dir_all(tree.join("sub/deeper")).unwrap();
    std::fs::write(tree.join("top.txt"), "top\n").unwrap();
    std::fs::write(tree.join("sub/deeper/leaf.txt"), "leaf\n").unwrap();
    let o = aviary(
        &s,
        &[
            "sandbox",
            "cp",
            tree.to_str().unwrap(),
            &format!("{id}:/workspace/tree"),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let o = aviary(
        &s,
        &["sandbox", "exec", &id, "--", "sh", "-c", "cat /workspace/tree/top.txt /workspace/tree/sub/deeper/leaf.txt; ls -a /workspace/tree"],
    );
    assert_eq!(
        stdout(&o),
        "top\nleaf\n.\n..\nsub\ntop.txt\n",
        "no temp file left: {o:?}"
    );
    let out = s._dir.path().join("tree-back");
    let o = aviary(
        &s,
        &[
            "sandbox",
            "cp",
            &format!("{id}:/workspace/tree"),
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        std::fs::read_to_string(out.join("sub/deeper/leaf.txt")).unwrap(),
        "leaf\n"
    );
    let mut piped = Command::new(BIN)
        .args(["sandbox", "cp", "-", &format!("{id}:/workspace/piped.bin")])
        .env("AVIARY_URL", &s.url)
        .env("AVIARY_DATA_DIR", &s.data)
        .env_remove("AVIARY_API_KEY")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = piped.stdin.take().unwrap();
        stdin.write_all(&[0u8, 255, 10, 13, 7]).unwrap();
    }
    assert!(piped.wait().unwrap().success());
    let o = aviary(
        &s,
        &["sandbox", "cp", &format!("{id}:/workspace/piped.bin"), "-"],
    );
    assert_eq!(
        o.stdout,
        vec![0u8, 255, 10, 13, 7],
        "bytes, not text: {o:?}"
    );

    // leases through the CLI
    let o = aviary(&s, &["lease", "acquire", &id, "--owner", "cli-test"]);
    assert!(o.status.success(), "{o:?}");
    let token = stdout(&o).trim().to_owned();
    let o = aviary(&s, &["sandbox", "exec", &id, "--", "true"]);
    assert_eq!(o.status.code(), Some(75), "no token while leased: {o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("lease_required"));
    let o = aviary(
        &s,
        &["sandbox", "exec", &id, "--token", &token, "--", "true"],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let o = aviary(&s, &["lease", "renew", &id, "--token", &token]);
    assert!(o.status.success(), "{o:?}");
    let o = aviary(&s, &["lease", "release", &id, "--token", &token]);
    assert!(o.status.success(), "{o:?}");

    // the operator's mark: never reused again, the reason in its event
    let o = aviary(&s, &["sandbox", "taint", &id]);
    assert_eq!(o.status.code(), Some(2), "a reason is required: {o:?}");
    let o = aviary(
        &s,
        &[
            "sandbox",
            "taint",
            &id,
            "--reason",
            "cli test: it looked wrong",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).contains("tainted"), "{o:?}");
    let o = aviary(&s, &["--json", "events", "--sandbox", &id]);
    assert!(
        stdout(&o).contains("cli test: it looked wrong") && stdout(&o).contains("\"operator\""),
        "{o:?}"
    );

    let o = aviary(&s, &["sandbox", "ls"]);
    assert!(stdout(&o).contains(&id));
    let o = aviary(&s, &["--json", "sandbox", "get", &id]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["resource_class"], "python-small");
    assert_eq!(v["tainted"], true, "{v}");
    let o = aviary(&s, &["sandbox", "rm", &id]);
    assert!(o.status.success(), "{o:?}");
    let o = aviary(&s, &["sandbox", "exec", &id, "--", "true"]);
    assert_eq!(o.status.code(), Some(75), "{o:?}");
    let o = aviary(&s, &["sandbox", "get", "sbx-aaaaaaaaaaaaaaaaaaaa"]);
    assert_eq!(o.status.code(), Some(66), "{o:?}");

    // rm answers first; the compute is reclaimed in the background and that is the last event
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let all = loop {
        let o = aviary(&s, &["--json", "events", "--sandbox", &id]);
        if stdout(&o).contains("compute_reclaimed") {
            break o;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no compute_reclaimed event: {o:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(stdout(&all).contains("Terminated"), "{all:?}");
    let newest: serde_json::Value =
        serde_json::from_str(stdout(&all).lines().last().unwrap()).unwrap();
    assert_eq!(newest["event_type"], "compute_reclaimed", "{newest}");
    // the newest by default: with --limit 1, only the last one
    let o = aviary(&s, &["--json", "events", "--sandbox", &id, "--limit", "1"]);
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(lines.len(), 1, "{o:?}");
    let last: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(last, newest, "{o:?}");
    let o = aviary(&s, &["template", "ls"]);
    assert!(stdout(&o).contains("default"), "{o:?}");
}

#[test]
fn labels_env_and_ttl_through_the_cli() {
    let s = serve();
    let create = |label: &str| {
        let o = aviary(
            &s,
            &[
                "--json",
                "sandbox",
                "create",
                "--metadata",
                &format!("agentscope.workspace.id={label}"),
                "--metadata",
                "team=a b",
                "--env",
                "GREETING=hello there",
                "--env",
                "MODE=sandbox",
            ],
        );
        assert!(o.status.success(), "{o:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["metadata"]["agentscope.workspace.id"], label, "{v}");
        assert!(v.get("env").is_none(), "env is never shown: {v}");
        v["id"].as_str().unwrap().to_owned()
    };
    let (one, two) = (create("ws-1"), create("ws-2"));
    // the sandbox env reaches the real process; an exec's own --env wins
    let o = aviary(
        &s,
        &[
            "sandbox",
            "exec",
            &one,
            "--env",
            "MODE=exec",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING/$MODE\"",
        ],
    );
    assert_eq!(stdout(&o), "hello there/exec\n", "{o:?}");
    // the label filter, through the real query string
    let ls = |filter: &[&str]| {
        let mut args = vec!["--json", "sandbox", "ls"];
        for f in filter {
            args.extend(["--metadata", f]);
        }
        let o = aviary(&s, &args);
        assert!(o.status.success(), "{o:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let mut ids: Vec<String> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let mut both = vec![one.clone(), two.clone()];
    both.sort();
    assert_eq!(ls(&["team=a b"]), both);
    assert_eq!(
        ls(&["agentscope.workspace.id=ws-2", "team=a b"]),
        vec![two.clone()]
    );
    assert!(ls(&["team=other"]).is_empty());
    let o = aviary(&s, &["sandbox", "get", &one]);
    assert!(stdout(&o).contains("agentscope.workspace.id=ws-1"), "{o:?}");
    // ttl: now + 120 s, shown; a zero ttl is refused with a usage error
    let o = aviary(&s, &["--json", "sandbox", "ttl", &one, "120"]);
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let expires = time::OffsetDateTime::parse(
        v["expires_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let left = (expires - time::OffsetDateTime::now_utc()).whole_seconds();
    assert!((100..=121).contains(&left), "{left} s left: {v}");
    let o = aviary(&s, &["sandbox", "ttl", &one, "0"]);
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    let o = aviary(&s, &["sandbox", "create", "--env", "1BAD=x"]);
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    for id in [&one, &two] {
        let o = aviary(&s, &["sandbox", "rm", id]);
        assert!(o.status.success(), "{o:?}");
    }
}

/// With an OTLP endpoint configured, every API request is exported as a
/// span carrying its request id (here to a small OTLP/HTTP JSON receiver).
#[test]
fn requests_are_traced_over_otlp_when_configured() {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = bodies.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let (mut path, mut len) = (String::new(), 0usize);
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if path.is_empty() {
                    path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            sink.lock()
                .unwrap()
                .push(format!("{path} {}", String::from_utf8_lossy(&body)));
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
            );
        }
    });
    let s = serve_with(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let key = std::fs::read_to_string(s.data.join("admin.key")).unwrap();
    let o = Command::new("curl")
        .args(["-s", "-D", "-", "-o", "/dev/null"])
        .args(["-H", &format!("authorization: Bearer {}", key.trim())])
        .args(["-H", "x-request-id: req-otel-probe-1"])
        .arg(format!("{}/v1/templates", s.url))
        .output()
        .unwrap();
    let head = String::from_utf8_lossy(&o.stdout).to_ascii_lowercase();
    assert!(head.contains("x-request-id: req-otel-probe-1"), "{head}");
    let start = Instant::now();
    let exported = loop {
        let found = bodies
            .lock()
            .unwrap()
            .iter()
            .find(|b| b.contains("req-otel-probe-1"))
            .cloned();
        if let Some(b) = found {
            break b;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no span with the request id exported: {:?}",
            bodies.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(exported.starts_with("/v1/traces "), "{exported}");
    let json: serde_json::Value =
        serde_json::from_str(exported.trim_start_matches("/v1/traces ")).unwrap();
    let span = json["resourceSpans"][0]["scopeSpans"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["spans"].as_array().unwrap().iter())
        .find(|sp| sp.to_string().contains("req-otel-probe-1"))
        .unwrap()
        .clone();
    assert_eq!(span["name"], "http.request", "{span}");
    let attr = |k: &str| {
        span["attributes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["key"] == k)
            .map(|a| a["value"].clone())
    };
    assert_eq!(
        attr("aviary.request_id").unwrap()["stringValue"],
        "req-otel-probe-1",
        "{span}"
    );
    assert_eq!(attr("url.path").unwrap()["stringValue"], "/v1/templates");
    assert!(
        json["resourceSpans"][0]["resource"]
            .to_string()
            .contains("\"aviary\""),
        "service name: {json}"
    );
}

/// Long work draws progress on a terminal (here a real pseudo-terminal made
/// by script(1)) and nothing when piped, under `--json` or with
/// `AVIARY_NO_PROGRESS=1`; the bytes arrive intact either way.
#[test]
fn cp_shows_progress_only_on_a_terminal() {
    let s = serve();
    let o = aviary(&s, &["--json", "sandbox", "create"]);
    assert!(o.status.success(), "{o:?}");
    let id = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let big = s._dir.path().join("big.bin");
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(&big, &data).unwrap();
    let remote = format!("{id}:/workspace/big.bin");

    // piped: stderr is the one summary line, nothing drawn
    let o = aviary(&s, &["sandbox", "cp", big.to_str().unwrap(), &remote]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        format!("{} bytes copied\n", data.len())
    );

    // on a terminal: a byte bar naming the file
    let on_tty = |extra_env: &str, args: &str| -> String {
        let cmd = format!(
            "{extra_env} AVIARY_URL={} AVIARY_DATA_DIR={} {BIN} {args}",
            s.url,
            s.data.display()
        );
        let o = Command::new("script")
            .args(["-qec", &cmd, "/dev/null"])
            .env_remove("AVIARY_API_KEY")
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let up = on_tty("", &format!("sandbox cp {} {remote}", big.display()));
    assert!(up.contains("/workspace/big.bin ["), "no bar drawn: {up:?}");
    assert!(up.contains("MiB"), "{up:?}");
    assert!(
        up.contains(&format!("{} bytes copied", data.len())),
        "{up:?}"
    );
    let back = s._dir.path().join("back.bin");
    let down = on_tty("", &format!("sandbox cp {remote} {}", back.display()));
    assert!(
        down.contains("/workspace/big.bin ["),
        "no bar drawn: {down:?}"
    );
    assert_eq!(std::fs::read(&back).unwrap(), data);

    // off on request, and under --json (stdout stays one JSON document)
    let quiet = on_tty(
        "AVIARY_NO_PROGRESS=1",
        &format!("sandbox cp {} {remote}", big.display()),
    );
    assert!(!quiet.contains("MiB"), "{quiet:?}");
    let js = on_tty("", &format!("--json sandbox cp {} {remote}", big.display()));
    assert!(!js.contains("MiB"), "{js:?}");
    assert!(
        js.contains("\"bytes\"") && js.contains(&data.len().to_string()),
        "{js:?}"
    );

    let o = aviary(&s, &["sandbox", "rm", &id]);
    assert!(o.status.success(), "{o:?}");
}

#[test]
fn template_import_from_a_docker_save_archive() {
    let s = serve();
    // a docker-save style archive: one layer with a static busybox
    let work = s._dir.path().join("img");
    let layer = work.join("layer");
    std::fs::create_dir_all(layer.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", layer.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", layer.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", layer.join("bin/echo")).unwrap();
    std::os::unix::fs::symlink("busybox", layer.join("bin/id")).unwrap();
    std::os::unix::fs::symlink("busybox", layer.join("bin/pwd")).unwrap();
    // the image's WORKDIR exists in its layers, as `docker build` makes it
    std::fs::create_dir_all(layer.join("srv/app")).unwrap();
    std::fs::create_dir_all(layer.join("etc")).unwrap();
    std::fs::write(
        layer.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\napp:x:1234:5678:App:/srv/app:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(layer.join("etc/group"), "root:x:0:\napp:x:5678:\n").unwrap();
    let st = Command::new("tar")
        .arg("-C")
        .arg(&layer)
        .args(["-cf"])
        .arg(work.join("layer.tar"))
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::write(
        work.join("manifest.json"),
        r#"[{"Config":"config.json","RepoTags":["mini:latest"],"Layers":["layer.tar"]}]"#,
    )
    .unwrap();
    let sum = Command::new("sha256sum")
        .arg(work.join("layer.tar"))
        .output()
        .unwrap();
    let diff_id = String::from_utf8(sum.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    std::fs::write(
        work.join("config.json"),
        format!(r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/bin","GREETING=from-image","MODE=image"],"WorkingDir":"/srv/app","User":"app"}},"rootfs":{{"type":"layers","diff_ids":["sha256:{diff_id}"]}}}}"#),
    )
    .unwrap();
    let archive = s._dir.path().join("mini.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&work)
        .arg("-cf")
        .arg(&archive)
        .args(["manifest.json", "config.json", "layer.tar"])
        .status()
        .unwrap();
    assert!(st.success());

    // --force: the template store is shared by test runs, "mini" may exist
    let o = aviary(
        &s,
        &[
            "template",
            "import",
            "--force",
            "mini",
            archive.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(stdout(&o).starts_with("mini sha256:"));
    // an existing name is never replaced silently
    let o = aviary(
        &s,
        &["template", "import", "mini", archive.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(75), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--force"),
        "{o:?}"
    );
    let o = aviary(
        &s,
        &["run", "--template", "mini", "--", "echo", "from-mini"],
    );
    assert_eq!(stdout(&o), "from-mini\n", "{o:?}");
    // the image config is honoured: Env (the create's own env wins),
    // WorkingDir and User (resolved in the image's /etc/passwd)
    let o = aviary(&s, &["--json", "template", "ls"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mini = v["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mini")
        .unwrap()
        .clone();
    assert_eq!(mini["defaults"]["working_dir"], "/srv/app", "{mini}");
    assert_eq!(mini["defaults"]["user"], "app", "{mini}");
    assert_eq!(mini["defaults"]["env"]["GREETING"], "from-image", "{mini}");
    let o = aviary(
        &s,
        &[
            "--json",
            "sandbox",
            "create",
            "--template",
            "mini",
            "--env",
            "MODE=create",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["workdir"].as_str(), v["run_as"].as_str()),
        (Some("/srv/app"), Some("app")),
        "{v}"
    );
    let img = v["id"].as_str().unwrap().to_owned();
    let o = aviary(
        &s,
        &[
            "sandbox",
            "exec",
            &img,
            "--",
            "sh",
            "-c",
            "echo $GREETING $MODE $HOME; pwd; id -u; id -g",
        ],
    );
    assert_eq!(
        stdout(&o),
        "from-image create /srv/app\n/srv/app\n1234\n5678\n",
        "{o:?}"
    );
    // an exec's own cwd still wins
    let o = aviary(&s, &["sandbox", "exec", &img, "--cwd", "/", "--", "pwd"]);
    assert_eq!(stdout(&o), "/\n", "{o:?}");
    let o = aviary(&s, &["sandbox", "rm", &img]);
    assert!(o.status.success(), "{o:?}");
    // a create's own workdir wins over the image's; a relative one is refused
    let o = aviary(
        &s,
        &[
            "--json",
            "sandbox",
            "create",
            "--template",
            "mini",
            "--workdir",
            "/tmp",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["workdir"], "/tmp", "{v}");
    let o = aviary(&s, &["sandbox", "rm", v["id"].as_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let o = aviary(
        &s,
        &[
            "sandbox",
            "create",
            "--template",
            "mini",
            "--workdir",
            "tmp",
        ],
    );
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    // template rm: refused while a sandbox runs on it, then removed
    let o = aviary(&s, &["--json", "sandbox", "create", "--template", "mini"]);
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let on_mini = v["id"].as_str().unwrap().to_owned();
    let o = aviary(&s, &["template", "rm", "mini"]);
    assert_eq!(o.status.code(), Some(75), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("1 sandbox"),
        "{o:?}"
    );
    let o = aviary(&s, &["sandbox", "rm", &on_mini]);
    assert!(o.status.success(), "{o:?}");
    let o = aviary(&s, &["template", "rm", "mini"]);
    assert!(o.status.success(), "{o:?}");
    assert!(!stdout(&aviary(&s, &["template", "ls"])).contains("mini"));
    let o = aviary(&s, &["run", "--template", "mini", "--", "true"]);
    assert_eq!(o.status.code(), Some(64), "unknown template: {o:?}");
    let o = aviary(&s, &["template", "rm", "mini"]);
    assert_eq!(o.status.code(), Some(66), "{o:?}");
    let o = aviary(&s, &["template", "rm", "default"]);
    assert_eq!(o.status.code(), Some(75), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("default"),
        "{o:?}"
    );
    let o = aviary(&s, &["template", "rm", "../etc"]);
    assert_eq!(o.status.code(), Some(64), "{o:?}");

    // garbage is refused with a clear error
    let junk = s._dir.path().join("junk.tar");
    std::fs::write(&junk, b"this is not a tarball").unwrap();
    let o = aviary(&s, &["template", "import", "junk", junk.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(64), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("invalid_archive"),
        "{o:?}"
    );
}

#[test]
fn ls_filters_and_snapshot_rm() {
    let s = serve();
    let create = |args: &[&str]| {
        let mut all = vec!["--json", "sandbox", "create"];
        all.extend_from_slice(args);
        let o = aviary(&s, &all);
        assert!(o.status.success(), "{o:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["id"].as_str().unwrap().to_owned()
    };
    let a = create(&["--user", "alice", "--session", "s1", "--scope", "session"]);
    let b = create(&["--user", "bob", "--session", "s2", "--scope", "session"]);
    let ls = |args: &[&str]| {
        let mut all = vec!["--json", "sandbox", "ls"];
        all.extend_from_slice(args);
        let o = aviary(&s, &all);
        assert!(o.status.success(), "{o:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let mut ids: Vec<String> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(ls(&["--user", "alice"]), vec![a.clone()]);
    assert_eq!(ls(&["--session", "s2"]), vec![b.clone()]);
    assert!(ls(&["--user", "alice", "--session", "s2"]).is_empty());
    let o = aviary(&s, &["sandbox", "ls", "--state", "Sleepy"]);
    assert_eq!(
        o.status.code(),
        Some(64),
        "an unknown state is refused: {o:?}"
    );

    // snapshots: take two of a, delete the older one
    let snap = |id: &str| {
        let o = aviary(&s, &["--json", "sandbox", "snapshot", id]);
        assert!(o.status.success(), "{o:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["id"].as_str().unwrap().to_owned()
    };
    let first = snap(&a);
    let o = aviary(
        &s,
        &[
            "sandbox",
            "exec",
            &a,
            "--",
            "sh",
            "-c",
            "echo v2 > /workspace/f",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let second = snap(&a);
    let o = aviary(&s, &["snapshot", "rm", &first]);
    assert!(o.status.success(), "{o:?}");
    let o = aviary(&s, &["snapshot", "ls", "--sandbox", &a]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let listed: Vec<&str> = v["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, vec![second.as_str()], "{v}");
    let o = aviary(&s, &["snapshot", "rm", &first]);
    assert_eq!(o.status.code(), Some(66), "gone: {o:?}");
    // the later snapshot is whole without its parent: fork from it
    let o = aviary(
        &s,
        &["--json", "sandbox", "fork", &a, "--snapshot", &second],
    );
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let fork = v["id"].as_str().unwrap().to_owned();
    let o = aviary(&s, &["sandbox", "exec", &fork, "--", "cat", "/workspace/f"]);
    assert_eq!(stdout(&o), "v2\n", "{o:?}");
    // a hibernated sandbox's wake snapshot is kept
    let o = aviary(&s, &["--json", "sandbox", "hibernate", &b]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(ls(&["--state", "Hibernating"]), vec![b.clone()]);
    let o = aviary(&s, &["--json", "snapshot", "ls", "--sandbox", &b]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let wake_from = v["snapshots"][0]["id"].as_str().unwrap().to_owned();
    let o = aviary(&s, &["snapshot", "rm", &wake_from]);
    assert_eq!(o.status.code(), Some(75), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("wake"), "{o:?}");
    for id in [&a, &b, &fork] {
        let o = aviary(&s, &["sandbox", "rm", id]);
        assert!(o.status.success(), "{o:?}");
    }
    let o = aviary(&s, &["snapshot", "rm", &wake_from]);
    assert!(o.status.success(), "after the sandbox is deleted: {o:?}");
}

#[test]
fn exec_i_streams_stdin_bytes() {
    use std::io::Write as _;
    let s = serve();
    let o = aviary(&s, &["sandbox", "create"]);
    let id = stdout(&o).trim().to_owned();
    let with_stdin = |args: &[&str], input: &[u8]| {
        let mut child = Command::new(BIN)
            .args(args)
            .env("AVIARY_URL", &s.url)
            .env("AVIARY_DATA_DIR", &s.data)
            .env_remove("AVIARY_API_KEY")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
        let o = child.wait_with_output().unwrap();
        writer.join().unwrap();
        o
    };
    let o = with_stdin(&["sandbox", "exec", "-i", &id, "--", "cat"], b"hi\n");
    assert_eq!(
        (o.status.code(), stdout(&o).as_str()),
        (Some(0), "hi\n"),
        "{o:?}"
    );
    // binary input, bigger than one frame, arrives unchanged
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let o = with_stdin(
        &[
            "sandbox",
            "exec",
            "-i",
            &id,
            "--",
            "sh",
            "-c",
            "cat > /workspace/b; md5sum < /workspace/b",
        ],
        &data,
    );
    assert!(o.status.success(), "{o:?}");
    let local = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut li = local.stdin.as_ref().unwrap();
    li.write_all(&data).unwrap();
    let local = local.wait_with_output().unwrap();
    assert_eq!(stdout(&o), stdout(&local));
    // without -i the command's stdin is empty (as with docker exec)
    let o = with_stdin(&["sandbox", "exec", &id, "--", "cat"], b"ignored\n");
    assert_eq!(
        (o.status.code(), stdout(&o).as_str()),
        (Some(0), ""),
        "{o:?}"
    );
    // run -i too
    let o = with_stdin(&["run", "-i", "--", "tr", "a-z", "A-Z"], b"shout\n");
    assert_eq!(stdout(&o), "SHOUT\n", "{o:?}");
    let o = aviary(&s, &["sandbox", "rm", &id]);
    assert!(o.status.success(), "{o:?}");
}

/// A raw HTTP/1.1 GET with one extra header; the status code and body.
fn http_get(url: &str, header: (&str, &str)) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{}: {}\r\nConnection: close\r\n\r\n",
        header.0, header.1
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn ps_kill_background_logs_and_port_urls() {
    let s = serve();
    let o = aviary(&s, &["sandbox", "create"]);
    let id = stdout(&o).trim().to_owned();
    // exec -d prints a handle at once; ps shows the process; kill ends it
    let o = aviary(&s, &["sandbox", "exec", "-d", &id, "--", "sleep", "500"]);
    assert!(o.status.success(), "{o:?}");
    let handle = stdout(&o).trim().to_owned();
    assert!(handle.parse::<u64>().is_ok(), "{o:?}");
    let o = aviary(&s, &["sandbox", "ps", &id]);
    let ps = stdout(&o);
    assert!(ps.starts_with("PID"), "{ps}");
    let line = ps.lines().find(|l| l.ends_with("sleep 500")).expect(&ps);
    let pid = line.split_whitespace().next().unwrap().to_owned();
    // usage: a table of what is in use beside the limits, and --json
    let o = aviary(&s, &["sandbox", "usage", &id]);
    assert!(o.status.success(), "{o:?}");
    let table = stdout(&o);
    assert!(table.starts_with(&format!("{id} Idle")), "{table}");
    assert!(
        table.lines().nth(1).unwrap().starts_with("RESOURCE"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("memory ") && l.ends_with('%')),
        "{table}"
    );
    let procs = table
        .lines()
        .find(|l| l.starts_with("processes"))
        .expect(&table);
    let counted: u64 = procs.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(counted >= 2, "envd and the sleep: {table}");
    let o = aviary(&s, &["--json", "sandbox", "usage", &id]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["sandbox_id"], id.as_str());
    assert!(v["memory_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["pids"].as_u64().unwrap() >= 2, "{v}");
    let o = aviary(&s, &["sandbox", "usage", "sbx-nosuchsandbox"]);
    assert_eq!(o.status.code(), Some(66), "{o:?}");
    let o = aviary(&s, &["sandbox", "kill", &id, &pid, "--signal", "KILL"]);
    assert!(o.status.success(), "{o:?}");
    // logs -f follows to the exit and exits with its code (128 + 9)
    let o = aviary(&s, &["sandbox", "logs", "-f", &id, &handle]);
    assert_eq!(o.status.code(), Some(137), "{o:?}");
    // a background command's output, read by a later command
    let o = aviary(
        &s,
        &[
            "sandbox",
            "exec",
            "-d",
            &id,
            "--",
            "sh",
            "-c",
            "echo hi; echo oops >&2; sleep 1; echo bye; exit 3",
        ],
    );
    let handle = stdout(&o).trim().to_owned();
    let o = aviary(&s, &["sandbox", "logs", "--follow", &id, &handle]);
    assert_eq!(
        (
            o.status.code(),
            stdout(&o).as_str(),
            String::from_utf8_lossy(&o.stderr).as_ref()
        ),
        (Some(3), "hi\nbye\n", "oops\n"),
        "{o:?}"
    );
    let o = aviary(&s, &["--json", "sandbox", "logs", &id, &handle]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["running"].as_bool(), v["exit_code"].as_i64()),
        (Some(false), Some(3)),
        "{v}"
    );
    // a server in the sandbox, reached through the port URL the CLI prints
    let o = aviary(
        &s,
        &[
            "sandbox",
            "exec",
            "-d",
            &id,
            "--",
            "python3",
            "-m",
            "http.server",
            "8000",
            "--bind",
            "127.0.0.1",
            "--directory",
            "/etc",
        ],
    );
    assert!(o.status.success(), "{o:?}");
    let o = aviary(&s, &["--json", "sandbox", "port", &id, "8000"]);
    let ep: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let url = format!("{}hostname", ep["url"].as_str().unwrap());
    let o = aviary(&s, &["sandbox", "port", &id, "8000"]);
    assert_eq!(stdout(&o).trim(), ep["url"].as_str().unwrap(), "{o:?}");
    let header = (
        ep["header"].as_str().unwrap(),
        ep["token"].as_str().unwrap(),
    );
    let mut answer = http_get(&url, header);
    for _ in 0..100 {
        if answer.0 != 502 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        answer = http_get(&url, header);
    }
    let o = aviary(&s, &["sandbox", "exec", &id, "--", "cat", "/etc/hostname"]);
    assert_eq!(answer, (200, stdout(&o)));
    let o = aviary(&s, &["sandbox", "rm", &id]);
    assert!(o.status.success(), "{o:?}");
}

/// Runs the built `aviary` with `args` and no server.
fn aviary_local(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_aviary"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn bash_completion_completes_commands_and_flags() {
    let script = aviary_local(&["completions", "bash"]);
    assert!(script.status.success(), "{script:?}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("aviary.bash");
    std::fs::write(&path, &script.stdout).unwrap();
    // what bash's completion machinery does on TAB: set COMP_WORDS/COMP_CWORD
    // and call the registered function
    let complete = |words: &str, cword: usize| {
        let o = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "source {}; COMP_WORDS=({words}); COMP_CWORD={cword}; \
                 _aviary aviary \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; \
                 printf '%s\\n' \"${{COMPREPLY[@]}}\"",
                path.display()
            ))
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    assert_eq!(complete("aviary sandbox cr", 2), "create\n");
    let flags = complete("aviary sandbox create --me", 3);
    assert_eq!(flags, "--metadata\n", "{flags}");
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let o = aviary_local(&["completions", shell]);
        assert!(o.status.success() && !o.stdout.is_empty(), "{shell}: {o:?}");
    }
    let o = aviary_local(&["completions", "tcsh"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

#[test]
fn man_pages_render_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let o = aviary_local(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let page = dir.path().join("aviary-sandbox-create.1");
    let roff = std::fs::read_to_string(&page).unwrap();
    assert!(roff.contains("metadata"), "{roff}");
    assert!(dir.path().join("aviary-sandbox-ttl.1").is_file());
    // the top page on stdout names the commands' pages
    let top = aviary_local(&["man"]);
    let top = String::from_utf8(top.stdout).unwrap();
    assert!(top.starts_with(".ie"), "roff");
    assert!(
        top.contains("aviary\\-sandbox(1)"),
        "no see-also of sandbox"
    );
    // and it is valid roff: man formats it without warnings
    let man = Command::new("man")
        .args(["--warnings", "-l", "-P", "cat"])
        .arg(&page)
        .env("MANWIDTH", "100")
        .output();
    match man {
        Ok(o) => {
            assert!(o.status.success(), "{o:?}");
            let text = String::from_utf8_lossy(&o.stdout);
            assert!(text.contains("--metadata"), "{text}");
            assert!(
                o.stderr.is_empty(),
                "roff warnings: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Err(e) => eprintln!("SKIP formatting check: `man` is not installed here ({e})"),
    }
}

/// A TLS terminator in front of `backend` (127.0.0.1), with a certificate
/// for `localhost` issued by a fresh CA; returns its port and the CA's PEM.
fn tls_front(backend: u16) -> (u16, String) {
    use std::sync::Arc;
    use tokio_rustls::rustls;
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "aviary test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &ca, &ca_key)
        .unwrap();
    // ring is the only crypto provider built in, so it is the default
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone(), ca.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut up) = tokio::net::TcpStream::connect(("127.0.0.1", backend)).await
                    else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                });
            }
        });
    });
    (port, ca.pem())
}

#[test]
fn the_cli_speaks_https_and_checks_the_certificate() {
    let s = serve();
    let backend: u16 = s.url.rsplit(':').next().unwrap().parse().unwrap();
    let (port, ca_pem) = tls_front(backend);
    let ca_file = s._dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca_pem).unwrap();
    let https = format!("https://localhost:{port}");
    let run = |trust: Option<&Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_aviary"));
        cmd.args(["run", "--", "echo", "over-tls"])
            .env("AVIARY_URL", &https)
            .env("AVIARY_DATA_DIR", &s.data);
        match trust {
            Some(f) => cmd.env("SSL_CERT_FILE", f),
            // a trust store without our CA
            None => cmd.env("SSL_CERT_FILE", "/dev/null"),
        };
        cmd.output().unwrap()
    };
    let o = run(Some(&ca_file));
    assert_eq!(
        (o.status.code(), stdout(&o).as_str()),
        (Some(0), "over-tls\n"),
        "{o:?}"
    );
    // an unknown issuer is refused, not silently accepted
    let o = run(None);
    assert_eq!(o.status.code(), Some(69), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("certificate"), "names the cause: {err}");
}

/// `aviary compat env` prints one `export NAME=value` a line for the
/// running server, and the E2B API URL it prints answers E2B's list with
/// the user's own key.
#[test]
fn compat_env_points_the_e2b_sdk_at_the_running_server() {
    let s = serve();
    let o = aviary(&s, &["compat", "env"]);
    assert!(o.status.success(), "{o:?}");
    let out = stdout(&o);
    let exports: std::collections::HashMap<String, String> = out
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let (name, value) = l
                .strip_prefix("export ")
                .and_then(|e| e.split_once('='))
                .unwrap_or_else(|| panic!("not an export line: {l:?}"));
            (name.to_owned(), value.to_owned())
        })
        .collect();
    assert_eq!(exports["E2B_API_URL"], format!("{}/e2b", s.url));
    assert_eq!(exports["E2B_SANDBOX_URL"], format!("{}/e2b/envd", s.url));
    assert!(out.contains("E2B_API_KEY"), "{out}");
    let key = std::fs::read_to_string(s.data.join("admin.key")).unwrap();
    let list = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "-H"])
        .arg(format!("X-API-KEY: {}", key.trim()))
        .arg(format!("{}/v2/sandboxes", exports["E2B_API_URL"]))
        .output()
        .unwrap();
    assert_eq!(stdout(&list), "[]\n200");
    // and the OpenSandbox lines reach its lifecycle API
    let (scheme, host) = s.url.split_once("://").unwrap();
    assert_eq!(exports["OPEN_SANDBOX_PROTOCOL"], scheme);
    assert_eq!(
        exports["OPEN_SANDBOX_DOMAIN"],
        format!("{host}/opensandbox")
    );
    let list = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "-H"])
        .arg(format!("OPEN-SANDBOX-API-KEY: {}", key.trim()))
        .arg(format!(
            "{}://{}/v1/sandboxes",
            exports["OPEN_SANDBOX_PROTOCOL"], exports["OPEN_SANDBOX_DOMAIN"]
        ))
        .output()
        .unwrap();
    let body = stdout(&list);
    assert!(body.ends_with("\n200"), "{body}");
    assert!(body.contains("\"pagination\""), "{body}");
    let o = aviary(&s, &["--json", "compat", "env"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exports"]["E2B_API_URL"], format!("{}/e2b", s.url));
}
