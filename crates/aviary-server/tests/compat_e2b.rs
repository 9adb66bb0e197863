//! The E2B-compatible surface (`crates/aviary-compat-e2b`) driven by the
//! official SDKs, unmodified, against a live server on 127.0.0.1:0 with
//! real crun sandboxes of the default (Debian) template: the `e2b` Python
//! SDK (sync and async), AgentScope 2.0's `E2BWorkspace`, and the E2B JS
//! SDK. The flows live in `crates/aviary-compat-e2b/tests/sdk/`; each
//! prints its observations as one JSON object, asserted here.
//!
//! scripts/test.sh installs the pinned packages into throwaway
//! environments and names them: `AVIARY_E2B_PYTHON` (a venv's python with
//! e2b==2.63.0 and agentscope==2.0.11) and `AVIARY_E2B_JS_MODULE` (the ESM
//! entry of npm e2b@2.51.0). A test whose environment is missing skips
//! with the reason (and fails under `AVIARY_REQUIRE_SERVICES=1`).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use serde_json::Value;
use std::path::PathBuf;

fn sdk_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../aviary-compat-e2b/tests/sdk")
}

/// The tool named by `var`, or a loud skip.
fn tool(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            let why = format!(
                "SKIPPED: {var} is not set; scripts/test.sh installs the pinned E2B SDKs and sets it"
            );
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            None
        }
    }
}

struct Flow {
    ts: common::TestServer,
    other_key: String,
}

async fn server() -> Flow {
    let ts = common::start_with("default").await;
    let other = ts.client.create_key("e2b-other", false).await.unwrap();
    Flow {
        ts,
        other_key: other.key,
    }
}

/// Runs `program script` with the E2B settings `aviary compat env` prints
/// and answers the JSON object the flow printed last.
fn run_flow(flow: &Flow, program: &str, script: &str, extra: &[(&str, &str)]) -> Value {
    let base = flow.ts.url();
    let run = format!("r{}", std::process::id()) + &rand_suffix();
    let mut cmd = std::process::Command::new(program);
    cmd.arg(sdk_dir().join(script))
        .env("E2B_API_URL", format!("{base}/e2b"))
        .env("E2B_SANDBOX_URL", format!("{base}/e2b/envd"))
        .env("E2B_API_KEY", &flow.ts.key)
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .env("OTHER_KEY", &flow.other_key)
        .env("RUN", &run)
        // a crash of the interpreter (seen once: SIGABRT at exit after the
        // flow had printed its result) shows every thread's Python stack
        .env("PYTHONFAULTHANDLER", "1");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    eprintln!("{script} observed: {last}");
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{script} printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

fn rand_suffix() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{n:x}")
}

/// Every sandbox of the flow is gone (the flows kill what they create).
async fn assert_all_killed(flow: &Flow) {
    let left: Vec<_> = flow
        .ts
        .client
        .list_sandboxes(false)
        .await
        .unwrap()
        .sandboxes
        .into_iter()
        .filter(|s| !s.state.is_terminal())
        .map(|s| (s.id, s.state))
        .collect();
    assert!(left.is_empty(), "sandboxes left running: {left:?}");
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_sync_flow() {
    let Some(python) = tool("AVIARY_E2B_PYTHON") else {
        return;
    };
    let flow = server().await;
    let o = tokio::task::block_in_place(|| run_flow(&flow, &python, "e2b_sync.py", &[]));
    let id = o["sandbox_id"].as_str().unwrap().to_owned();
    // sandbox env, an exec's own env wins; stdout and stderr apart
    assert_eq!(o["env_stdout"], "hello\n");
    assert_eq!(o["stderr"], "oops\n");
    assert_eq!(o["exit_code"], 0);
    assert_eq!(o["own_env_wins"], "mine\n");
    // streamed: the client saw line1 while the command still ran
    let chunks = strs(&o["stream_chunks"]);
    assert!(
        chunks[0].contains("line1") && !chunks[0].contains("line3"),
        "{chunks:?}"
    );
    assert_eq!(o["stream_stdout"], "line1\nsaw-go\nline3\n");
    assert_eq!(
        o["exit3"],
        serde_json::json!({"exit_code": 3, "stdout": "before-exit\n", "stderr": "bad\n"})
    );
    assert_eq!(o["deadline"], "TimeoutException");
    assert_eq!(o["deadline_left"], "0");
    // files and commands see one file system
    assert_eq!(o["write_path"], "/tmp/e2b/a.txt");
    assert_eq!(o["read_len"], 100000);
    assert_eq!(o["wc"], "100000");
    assert_eq!(
        o["read_bytes"],
        serde_json::json!([0, 1, 255, 98, 105, 110])
    );
    assert_eq!(
        o["list"],
        serde_json::json!([["a.txt", "file"], ["b.bin", "file"]])
    );
    assert_eq!(o["exists"], serde_json::json!([true, false]));
    assert_eq!(o["make_dir"], serde_json::json!([true, false]));
    assert_eq!(o["moved"], "/tmp/e2b/sub/c.bin");
    assert_eq!(strs(&o["moved_seen"]), vec!["c.bin"]);
    assert_eq!(o["removed"], false);
    assert_eq!(o["file_info_size"], 100000);
    assert!(
        o["read_missing"].as_str().unwrap().contains("NotFound"),
        "{}",
        o["read_missing"]
    );
    assert_eq!(o["cmd_file"], "from-cmd\n");
    assert_eq!(o["pwd"], "/home/user");
    assert_eq!(o["rel_cat"], "home");
    // metadata round trip; set_timeout moves the end
    assert_eq!(o["info_metadata"]["suite"], "sync");
    assert_eq!(o["info_state"], "running");
    let (before, after) = (
        o["lifetime_before"].as_f64().unwrap(),
        o["lifetime_after"].as_f64().unwrap(),
    );
    assert!((299.0..=301.0).contains(&before), "{before}");
    assert!(after >= 600.0 && after > before, "{after}");
    // list: metadata filters (pages of one), state filters
    let second = o["second_id"].as_str().unwrap().to_owned();
    let mut both = vec![id.clone(), second.clone()];
    both.sort();
    assert_eq!(strs(&o["list_run"]), both);
    assert_eq!(strs(&o["list_suite"]), vec![id.clone()]);
    assert!(strs(&o["list_paused_before"]).is_empty());
    // pause → paused, not running; connect resumes with the files
    assert_eq!(o["pause"], true);
    assert_eq!(o["running_while_paused"], false);
    assert_eq!(strs(&o["list_paused"]), vec![id.clone()]);
    assert_eq!(strs(&o["list_running"]), vec![second]);
    assert_eq!(o["info_paused_state"], "paused");
    assert_eq!(o["running_after_connect"], true);
    assert_eq!(o["file_after_resume"], "100000");
    // auth
    assert_eq!(o["wrong_token"], 401);
    assert_eq!(o["token_of_other_sandbox"], 401);
    assert_eq!(o["other_tenant_connect"], "NotFoundException");
    assert_eq!(o["other_tenant_kill"], false);
    assert!(strs(&o["other_tenant_list"]).is_empty());
    // kill: True, then False; not running after
    assert_eq!(o["kill"], true);
    assert_eq!(o["kill_again"], false);
    assert_eq!(o["running_after_kill"], false);
    assert_eq!(o["kill_second"], true);
    assert_all_killed(&flow).await;
    // every call went through the operations: the create and the kill are events
    let events = flow
        .ts
        .client
        .events(Some(&id), None, Some(1000))
        .await
        .unwrap()
        .events;
    let types: Vec<_> = events.iter().map(|e| e.event_type.as_str()).collect();
    for t in ["created", "paused", "resumed"] {
        assert!(types.contains(&t), "{t} missing from {types:?}");
    }
}

/// The SDK's `sandbox.pty`: bash on a real terminal in the sandbox (Aviary's
/// envd pty), typed into with `send_stdin`, resized with `resize`, its
/// output as PTY data, its exit code; a second one listed and killed; PTY
/// input to a plain command refused; a plain command's stdin written with
/// `send_stdin` and closed with `close_stdin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_pty_flow() {
    let Some(python) = tool("AVIARY_E2B_PYTHON") else {
        return;
    };
    let flow = server().await;
    let o = tokio::task::block_in_place(|| run_flow(&flow, &python, "e2b_pty.py", &[]));
    assert_eq!(o["exit_code"], 3, "{o}");
    assert_eq!(o["saw_42"], true, "{o}");
    assert_eq!(o["saw_tty"], true, "{o}");
    assert_eq!(o["saw_24_80"], true, "{o}");
    assert_eq!(o["saw_40_120"], true, "{o}");
    assert_eq!(o["listed"], true, "{o}");
    assert_eq!(o["killed"], true, "{o}");
    assert_ne!(o["second_exit"], 0, "{o}");
    assert_ne!(o["plain_stdin"], "accepted", "{o}");
    assert_eq!(o["stdin_out"], "HELLO STDIN\n", "{o}");
    assert_eq!(o["stdin_exit"], 0, "{o}");
    assert_ne!(o["no_stdin"], "accepted", "{o}");
    assert_all_killed(&flow).await;
    flow.ts.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_async_flow() {
    let Some(python) = tool("AVIARY_E2B_PYTHON") else {
        return;
    };
    let flow = server().await;
    let o = tokio::task::block_in_place(|| run_flow(&flow, &python, "e2b_async.py", &[]));
    let id = o["sandbox_id"].as_str().unwrap().to_owned();
    let chunks = strs(&o["stream_chunks"]);
    assert!(
        chunks[0].contains("line1") && !chunks[0].contains("line3"),
        "{chunks:?}"
    );
    assert_eq!(o["stdout"], "line1\nsaw-go\nline3\n");
    assert_eq!(o["stderr"], "async\n");
    assert_eq!(o["exit3"], 3);
    assert_eq!(o["bg_listed"], true);
    assert_eq!(o["bg_killed"], true);
    assert_eq!(o["bg_wait"], -1);
    assert_eq!(o["bg_listed_after"], false);
    // get_host(port) names the port; that Host reaches it through the proxy
    assert!(
        o["host"]
            .as_str()
            .unwrap()
            .starts_with(&format!("8123-{id}.")),
        "{}",
        o["host"]
    );
    assert_eq!(o["host_get"][0], 200, "{}", o["host_get"]);
    assert_eq!(o["host_get"][1], o["hostname"]);
    assert_eq!(o["attached_stdout"], "after-attach\n");
    assert_eq!(o["attached_exit"], 0);
    assert_eq!(o["started_stdout"], "after-attach\n");
    assert_eq!(o["read"], "async data");
    assert_eq!(strs(&o["list"]), vec!["data.txt"]);
    assert_eq!(o["metadata"]["suite"], "async");
    assert_eq!(strs(&o["list_dotted"]), vec![id.clone()]);
    assert_eq!(o["pause"], true);
    assert_eq!(o["pause_again"], false);
    assert_eq!(o["running_paused"], false);
    assert_eq!(strs(&o["list_paused"]), vec![id]);
    assert_eq!(o["running_back"], true);
    assert_eq!(o["read_back"], "async data");
    assert_eq!(o["kill"], true);
    assert_eq!(o["kill_again"], false);
    assert_eq!(o["running_killed"], false);
    assert_all_killed(&flow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentscope_e2b_workspace_reattaches_after_close() {
    let Some(python) = tool("AVIARY_E2B_PYTHON") else {
        return;
    };
    let flow = server().await;
    let o = tokio::task::block_in_place(|| run_flow(&flow, &python, "agentscope_e2b.py", &[]));
    assert_eq!(
        o["exec"],
        serde_json::json!([0, "hello from /home/user/workspace\n"])
    );
    assert_eq!(o["exec_fail"], 5);
    assert_eq!(o["read"], "kept across close");
    assert_eq!(o["read_missing"], "FileNotFoundError");
    let layout = strs(&o["layout"]);
    for d in ["data", "sessions", "skills"] {
        assert!(layout.contains(&d.to_owned()), "{layout:?}");
    }
    assert_eq!(o["state_after_close"], "paused");
    // the second workspace found the paused sandbox, resumed it, saw the file
    assert_eq!(o["second_id"], o["first_id"]);
    assert_eq!(o["read_again"], "kept across close");
    assert_eq!(o["sandboxes_of_run"], 1);
    assert_all_killed(&flow).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_sdk_flow() {
    let (Some(node), Some(module)) = (tool("AVIARY_E2B_NODE"), tool("AVIARY_E2B_JS_MODULE")) else {
        return;
    };
    let flow = server().await;
    let o = tokio::task::block_in_place(|| {
        run_flow(
            &flow,
            &node,
            "e2b_js.mjs",
            &[("E2B_JS_MODULE", module.as_str())],
        )
    });
    let chunks = strs(&o["chunks"]);
    assert!(
        chunks[0].contains("line1") && !chunks[0].contains("saw-go"),
        "{chunks:?}"
    );
    assert_eq!(o["stdout"], "line1\nsaw-go\n");
    assert_eq!(o["stderr"], "js\n");
    assert_eq!(o["exit3"], 3);
    assert_eq!(o["read"], "from js");
    assert_eq!(o["list"], serde_json::json!([["a.txt", "file"]]));
    assert_eq!(o["wc"], "7");
    assert_eq!(o["info"]["suite"], "js");
    let id = o["sandboxId"].as_str().unwrap().to_owned();
    assert_eq!(strs(&o["listRun"]), vec![id.clone()]);
    assert!(strs(&o["listOtherRun"]).is_empty());
    assert_eq!(o["pause"], true);
    assert_eq!(o["runningPaused"], false);
    assert_eq!(strs(&o["listPaused"]), vec![id]);
    assert_eq!(o["runningBack"], true);
    assert_eq!(o["readBack"], "from js");
    assert_eq!(o["kill"], true);
    assert_eq!(o["running"], false);
    assert_all_killed(&flow).await;
}

/// The surface's own answers, without an SDK: fencing holds against E2B
/// calls, unknown sandboxes get E2B's proxy answer, errors have E2B's
/// shapes, and bad Connect input is refused before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_surface_keeps_fencing_and_answers_in_e2b_shapes() {
    let ts = common::start().await;
    let base = format!("{}/e2b", ts.url());
    let http = reqwest::Client::new();
    let api = |m: reqwest::Method, path: &str| {
        http.request(m, format!("{base}{path}"))
            .header("x-api-key", &ts.key)
    };
    // a sandbox a native client holds under a lease
    let leased = ts
        .client
        .create_sandbox(&aviary_core::api::CreateSandboxRequest {
            lease: Some(aviary_core::api::AcquireLeaseRequest {
                owner: "native".into(),
                ttl_s: Some(300),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = leased.sandbox.id.to_string();
    let detail: Value = api(reqwest::Method::GET, &format!("/sandboxes/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = detail["envdAccessToken"].as_str().unwrap().to_owned();
    let envd = |path: &str, sandbox: &str, token: &str| {
        http.post(format!("{base}/envd{path}"))
            .header("e2b-sandbox-id", sandbox)
            .header("x-access-token", token)
    };
    // a write through envd is refused: E2B calls carry no lease token
    let r = envd("/filesystem.Filesystem/MakeDir", &id, &token)
        .header("content-type", "application/json")
        .body(r#"{"path":"/tmp/fenced"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 412);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["code"], "failed_precondition");
    // and so is a kill, with E2B's error body and no retry
    let r = api(reqwest::Method::DELETE, &format!("/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(r.headers()["should-retry"], "false");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["code"], 409);
    assert!(
        body["message"].as_str().unwrap().contains("lease"),
        "{body}"
    );
    assert!(ts.client.get_sandbox(&id).await.unwrap().state.is_live());
    // unknown sandbox: the proxy's 502, which the SDK reads as not running
    let r = http
        .get(format!("{base}/envd/health"))
        .header("e2b-sandbox-id", "sbx-doesnotexist0000000")
        .header("x-access-token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("was not found"),
        "{body}"
    );
    // a malformed Connect request is refused with a Connect error
    for (ct, body, code) in [
        (
            "application/connect+json",
            b"\x00\xff\xff\xff\xff{}".to_vec(),
            "resource_exhausted",
        ),
        (
            "application/connect+json",
            b"\x00\x00\x00\x00\x02{}trailing".to_vec(),
            "invalid_argument",
        ),
        (
            "application/connect+json",
            b"\x00\x00".to_vec(),
            "invalid_argument",
        ),
        ("application/json", b"{}".to_vec(), "unimplemented"),
    ] {
        let r = envd("/process.Process/Start", &id, &token)
            .header("content-type", ct)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["code"], code, "{body:?}: {status} {v}");
    }
    // metadata aviary.session names Aviary's session scope: the session's
    // second create gets its sandbox back
    let create = |body: Value| async move {
        let r = api(reqwest::Method::POST, "/v2/sandboxes")
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        (status, r.json::<Value>().await.unwrap())
    };
    let session = serde_json::json!({"templateID": "base", "metadata": {"aviary.session": "s-e2b", "aviary.user": "u1"}});
    let (s1, first) = create(session.clone()).await;
    let (s2, second) = create(session).await;
    assert_eq!((s1.as_u16(), s2.as_u16()), (201, 201));
    assert_eq!(first["sandboxID"], second["sandboxID"]);
    let sid = first["sandboxID"].as_str().unwrap().to_owned();
    let native = ts.client.get_sandbox(&sid).await.unwrap();
    assert_eq!(native.session_id.as_deref(), Some("s-e2b"));
    assert_eq!(native.user_id.as_deref(), Some("u1"));
    assert_eq!(native.metadata["aviary.session"], "s-e2b");
    // an unknown template and options Aviary cannot honour are 400s naming them
    let (status, body) = create(serde_json::json!({"templateID": "no-such-template"})).await;
    assert_eq!(status.as_u16(), 400, "{body}");
    assert_eq!(body["code"], 400);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("no-such-template"),
        "{body}"
    );
    let (status, body) =
        create(serde_json::json!({"templateID": "base", "volumeMounts": [{"name": "v"}]})).await;
    assert_eq!(status.as_u16(), 400, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("volumeMounts"),
        "{body}"
    );
    let r = api(reqwest::Method::DELETE, &format!("/sandboxes/{sid}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    // a bad key is 401 in E2B's shape
    let r = http
        .get(format!("{base}/v2/sandboxes"))
        .header("x-api-key", "not-a-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["code"], 401);
    // the native holder still owns it; it deletes it with its token
    ts.client
        .delete_sandbox(&id, leased.lease.as_ref().map(|l| l.token))
        .await
        .unwrap();
    // gone: 404 JSON on kill, the proxy's 502 on envd
    let r = api(reqwest::Method::DELETE, &format!("/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], 404);
    let r = http
        .get(format!("{base}/envd/health"))
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
}

/// The E2B surface charges the same per-key budget as the v1 API: a key
/// over it gets 429 with `Retry-After` in E2B's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_calls_are_rate_limited_per_key() {
    let (ts, _dir) = common::start_edited(|cfg| {
        let e = &mut cfg.control.settings.server.edge;
        e.rate_limit_per_s = 0.2;
        e.rate_limit_burst = 3;
    })
    .await;
    let k = ts.client.create_key("e2b-busy", false).await.unwrap();
    let http = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = http
            .get(format!("{}/e2b/v2/sandboxes", ts.url()))
            .header("x-api-key", &k.key)
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            assert!(r.headers().contains_key("retry-after"));
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["code"], 429);
        }
    }
    assert_eq!(statuses, vec![200, 200, 200, 429, 429]);
    // guessing keys is limited per client address as well
    let mut statuses = Vec::new();
    for i in 0..5 {
        let r = http
            .get(format!("{}/e2b/v2/sandboxes", ts.url()))
            .header("x-api-key", format!("guess-{i}"))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, vec![401, 401, 401, 429, 429]);
}

/// `autoPause: true` makes the sandbox user-managed: at its TTL the
/// platform stops it (snapshot, hibernate) instead of destroying it; E2B
/// lists it paused, and connect wakes it with its files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_pause_stops_at_the_ttl_and_connect_wakes_it() {
    let ts = common::start().await;
    let base = format!("{}/e2b", ts.url());
    let http = reqwest::Client::new();
    let created: Value = http
        .post(format!("{base}/v2/sandboxes"))
        .header("x-api-key", &ts.key)
        .json(&serde_json::json!({"templateID": "base", "timeout": 2, "autoPause": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    let token = created["envdAccessToken"].as_str().unwrap().to_owned();
    let files = |m: reqwest::Method| {
        http.request(m, format!("{base}/envd/files?path=/home/user/keep.txt"))
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
    };
    let r = files(reqwest::Method::POST)
        .header("content-type", "application/octet-stream")
        .body("kept through hibernation")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let written: Value = r.json().await.unwrap();
    assert_eq!(written[0]["path"], "/home/user/keep.txt");
    // the sweep stops it once its TTL passed (bounded wait for that pass)
    let mut state = String::new();
    for _ in 0..300 {
        let d: Value = http
            .get(format!("{base}/sandboxes/{id}"))
            .header("x-api-key", &ts.key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        state = d["state"].as_str().unwrap_or_default().to_owned();
        if state == "paused" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(state, "paused");
    let native = ts.client.get_sandbox(&id).await.unwrap();
    assert_eq!(native.state, aviary_core::SandboxState::Hibernating);
    // not running: envd answers the proxy's 502
    let r = http
        .get(format!("{base}/envd/health"))
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    // connect wakes it: 201, running, the file is there
    let r = http
        .post(format!("{base}/v2/sandboxes/{id}/connect"))
        .header("x-api-key", &ts.key)
        .json(&serde_json::json!({"timeout": 120}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = files(reqwest::Method::GET).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "kept through hibernation");
    let r = http
        .delete(format!("{base}/sandboxes/{id}"))
        .header("x-api-key", &ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
}

/// One Connect envelope (flags 0) of `json`.
fn connect_envelope(json: &Value) -> Vec<u8> {
    let data = serde_json::to_vec(json).unwrap();
    let mut v = vec![0u8];
    v.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    v.extend_from_slice(&data);
    v
}

/// The next message of a Connect stream (whole envelopes from `buf`,
/// refilled from `resp`).
async fn next_connect_event(resp: &mut reqwest::Response, buf: &mut Vec<u8>) -> Value {
    loop {
        if buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if buf.len() >= 5 + len {
                let v: Value = serde_json::from_slice(&buf[5..5 + len]).unwrap();
                buf.drain(..5 + len);
                return v;
            }
        }
        let chunk = resp.chunk().await.unwrap().expect("stream ended early");
        buf.extend_from_slice(&chunk);
    }
}

/// A plain command's stdin over the wire, without an SDK: `Start` with
/// `stdin: true`, then `SendInput`, `StreamInput` (client streaming, with a
/// keepalive) and `CloseStdin`; the command reads it all and then end of
/// file. Input to a closed stdin, or to a command started without one, is
/// `failed_precondition`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_command_takes_stdin_until_it_is_closed() {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let ts = common::start().await;
    let base = format!("{}/e2b", ts.url());
    let http = reqwest::Client::new();
    let created: Value = http
        .post(format!("{base}/sandboxes"))
        .header("x-api-key", &ts.key)
        .json(&serde_json::json!({"templateID": "base"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    let token = created["envdAccessToken"].as_str().unwrap().to_owned();
    let rpc = |method: &str, ct: &str| {
        http.post(format!("{base}/envd/process.Process/{method}"))
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .header("content-type", ct)
    };
    let start = |cmd: &str, stdin: bool| {
        rpc("Start", "application/connect+json").body(connect_envelope(&serde_json::json!({
            "process": {"cmd": "sh", "args": ["-c", cmd]}, "stdin": stdin
        })))
    };
    // the process's events, read as they come
    let mut resp = start("tr a-z A-Z", true).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut buf = Vec::new();
    let first = next_connect_event(&mut resp, &mut buf).await;
    let pid = first["event"]["start"]["pid"]
        .as_u64()
        .expect("start event first");
    let unary = |method: &str, body: Value| rpc(method, "application/json").json(&body).send();
    let r = unary(
        "SendInput",
        serde_json::json!({"process": {"pid": pid}, "input": {"stdin": b64.encode("hello ")}}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let mut streamed = connect_envelope(&serde_json::json!({"start": {"process": {"pid": pid}}}));
    streamed.extend(connect_envelope(&serde_json::json!({"keepalive": {}})));
    streamed.extend(connect_envelope(
        &serde_json::json!({"data": {"input": {"stdin": b64.encode("stream\n")}}}),
    ));
    let r = rpc("StreamInput", "application/connect+json")
        .body(streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    assert_eq!(&body[..], b"\x00\x00\x00\x00\x02{}\x02\x00\x00\x00\x02{}");
    let r = unary("CloseStdin", serde_json::json!({"process": {"pid": pid}}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // the command read everything, then end of file, and exited
    let mut stdout = Vec::new();
    let end = loop {
        let ev = next_connect_event(&mut resp, &mut buf).await;
        if let Some(d) = ev["event"]["data"]["stdout"].as_str() {
            stdout.extend(b64.decode(d).unwrap());
        }
        if ev["event"].get("end").is_some() {
            break ev;
        }
    };
    assert_eq!(String::from_utf8(stdout).unwrap(), "HELLO STREAM\n");
    assert_eq!(end["event"]["end"]["status"], "exit status 0", "{end}");
    // input after the end of file, or to a command without stdin, is refused
    let r = unary(
        "SendInput",
        serde_json::json!({"process": {"pid": pid}, "input": {"stdin": b64.encode("late")}}),
    )
    .await
    .unwrap();
    let v: Value = r.json().await.unwrap();
    assert!(
        v["code"] == "failed_precondition" || v["code"] == "not_found",
        "{v}"
    );
    let mut plain = start("sleep 30", false).send().await.unwrap();
    let mut pbuf = Vec::new();
    let first = next_connect_event(&mut plain, &mut pbuf).await;
    let plain_pid = first["event"]["start"]["pid"].as_u64().unwrap();
    for (method, body) in [
        (
            "SendInput",
            serde_json::json!({"process": {"pid": plain_pid}, "input": {"stdin": b64.encode("x")}}),
        ),
        (
            "CloseStdin",
            serde_json::json!({"process": {"pid": plain_pid}}),
        ),
    ] {
        let r = unary(method, body).await.unwrap();
        assert_eq!(r.status(), 412, "{method}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["code"], "failed_precondition", "{method}: {v}");
    }
    // a stream that names no process first is refused
    let r = rpc("StreamInput", "application/connect+json")
        .body(connect_envelope(
            &serde_json::json!({"data": {"input": {"stdin": b64.encode("x")}}}),
        ))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["code"], "invalid_argument", "{v}");
    drop(plain);
    let r = http
        .delete(format!("{base}/sandboxes/{id}"))
        .header("x-api-key", &ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
}
