//! The official `opensandbox` Python SDK (async and sync flavours) and
//! AgentScope's `OpenSandboxWorkspace` against a live server (real crun
//! sandboxes of the debootstrap default template), through the
//! OpenSandbox surface at `/opensandbox`. The Python scripts are in
//! `crates/aviary-compat-opensandbox/tests/sdk/`; they print one JSON
//! object of observations, asserted on here. The venv with the pinned
//! packages comes from `scripts/test.sh` (`AVIARY_OSB_VENV`); without it
//! the tests skip, saying so.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use serde_json::Value;
use std::path::PathBuf;

fn venv_python() -> Option<PathBuf> {
    let Some(venv) = std::env::var_os("AVIARY_OSB_VENV") else {
        eprintln!(
            "SKIP: AVIARY_OSB_VENV is not set (scripts/test.sh installs opensandbox==1.1.1 and \
             agentscope==2.0.11 into a venv and sets it)"
        );
        return None;
    };
    let py = PathBuf::from(venv).join("bin/python");
    assert!(
        py.exists(),
        "AVIARY_OSB_VENV has no bin/python: {}",
        py.display()
    );
    Some(py)
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../aviary-compat-opensandbox/tests/sdk")
        .join(name)
}

/// Runs a script with the SDK's two settings pointed at the server; its
/// last stdout line is the JSON report.
async fn run_script(
    py: &PathBuf,
    name: &str,
    args: &[&str],
    ts: &common::TestServer,
    key: &str,
    other_key: &str,
) -> Value {
    let domain = format!("{}/opensandbox", ts.url().trim_start_matches("http://"));
    let out = tokio::process::Command::new(py)
        .arg(script(name))
        .args(args)
        .env("OPEN_SANDBOX_DOMAIN", &domain)
        .env("OPEN_SANDBOX_PROTOCOL", "http")
        .env("OPEN_SANDBOX_API_KEY", key)
        .env("OSB_OTHER_KEY", other_key)
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .env_remove("ALL_PROXY")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "--- {name} stderr ---\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or("");
    let report: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{name} printed no JSON report ({e}):\n{stdout}"));
    eprintln!("--- {name} report ---\n{report:#}");
    assert!(
        report.get("exception").is_none(),
        "{name} raised: {}",
        report["exception"].as_str().unwrap_or("")
    );
    report
}

fn ts_of(v: &Value) -> time::OffsetDateTime {
    time::OffsetDateTime::parse(
        v.as_str().unwrap_or_else(|| panic!("not a time: {v}")),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap()
}

/// The tenant has no sandbox left that has not ended.
async fn assert_nothing_left(ts: &common::TestServer, tenant: &str) {
    let live: Vec<_> = ts
        .cp()
        .registry
        .list_sandboxes(Some(tenant), false)
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.id, s.state))
        .collect();
    assert!(live.is_empty(), "{tenant} has sandboxes left: {live:?}");
}

fn common_flow_checks(r: &Value) {
    assert_eq!(r["state"], "Running");
    // streamed: line1 reached the handler well before line3 was printed
    assert_eq!(
        r["stream_texts"],
        serde_json::json!(["line1\n", "line2\n", "line3\n"])
    );
    let offsets: Vec<f64> = r["stream_offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert!(
        offsets[0] < offsets[2],
        "line1 came no earlier than line3: {offsets:?}"
    );
    assert_eq!(r["stream_exit"], 0);
    assert_eq!(r["split_stdout"], "out\n");
    assert_eq!(r["split_stderr"], "err\n");
    assert_eq!(r["exit3"], 3);
    assert_eq!(r["files_seen"], serde_json::json!(["100000", "755", "644"]));
    assert_eq!(r["read_back"], "hello file");
    assert_eq!(
        r["list_running_tagged"],
        serde_json::json!([r["id"].clone()])
    );
    // expiresAt ≈ createdAt + timeout, then moved by renew
    let created = ts_of(&r["created_at"]);
    let expires = ts_of(&r["expires_at"]);
    let timeout_s = (expires - created).whole_seconds();
    assert!(
        (timeout_s - r["timeout_s"].as_i64().unwrap()).abs() <= 5,
        "expiresAt - createdAt = {timeout_s}s"
    );
    let renewed = ts_of(&r["expires_after_renew"]);
    let requested = ts_of(&r["renew_requested"]);
    assert!(
        (renewed - requested).whole_seconds().abs() <= 5,
        "renew asked {requested}, got {renewed}"
    );
    assert!(renewed > expires);
    let states = r["pause_states"].as_array().unwrap();
    assert_eq!(states.last().unwrap(), "Paused", "{states:?}");
    assert!(states
        .iter()
        .all(|s| s == "Running" || s == "Pausing" || s == "Paused"));
    assert_eq!(r["resumed_state"], "Running");
    assert_eq!(r["after_resume"], "hello file");
    assert_eq!(r["get_after_kill"][0], 404);
    assert_eq!(r["get_after_kill"][1]["code"], "NOT_FOUND");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn opensandbox_sdk_async_flow() {
    let Some(py) = venv_python() else { return };
    let ts = common::start_with("default").await;
    let user = ts.client.create_key("osb-user", false).await.unwrap();
    let other = ts.client.create_key("osb-other", false).await.unwrap();
    let mut r = run_script(&py, "osb_flow.py", &["async"], &ts, &user.key, &other.key).await;
    r["timeout_s"] = 600.into();
    common_flow_checks(&r);
    assert_eq!(r["metadata"]["team"], "osb async");
    // the sandbox's env is every command's default; the command's own wins
    assert_eq!(r["cwd_env"], "/tmp\nhello env\nfrom create\n");
    assert_eq!(r["read_big_len"], 100000);
    assert_eq!(r["list_paused_tagged"], serde_json::json!([]));
    assert_eq!(r["list_other_tag"], serde_json::json!([]));
    assert_eq!(r["pagination_total"], 0);
    assert_eq!(
        r["list_paused_after_pause"],
        serde_json::json!([r["id"].clone()])
    );
    assert!(
        r["endpoint"].as_str().unwrap().ends_with(&format!(
            "/opensandbox/sandboxes/{}/execd",
            r["id"].as_str().unwrap()
        )),
        "{}",
        r["endpoint"]
    );
    // get_endpoint(port) of a server in the sandbox: the native port proxy
    assert!(
        r["app_endpoint"].as_str().unwrap().ends_with(&format!(
            "/v1/sandboxes/{}/ports/8123",
            r["id"].as_str().unwrap()
        )),
        "{}",
        r["app_endpoint"]
    );
    assert_eq!(r["app_get"][0], 200, "{}", r["app_get"]);
    // python's text is the hostname line; the SDK's stdout messages drop newlines
    assert_eq!(
        r["app_get"][1].as_str().unwrap().trim(),
        r["app_hostname"].as_str().unwrap().trim()
    );
    assert_eq!(r["app_no_token"], 401);
    let adv = &r["adversarial"];
    assert_eq!(adv["execd_no_token"], 401);
    assert_eq!(adv["execd_wrong_token"], 401);
    assert_eq!(adv["execd_api_key_instead_of_token"], 401);
    assert_eq!(adv["other_tenant_get"][0], 404);
    assert_eq!(adv["other_tenant_get"][1]["code"], "NOT_FOUND");
    assert_eq!(adv["other_tenant_delete"], 404);
    assert_eq!(adv["other_tenant_endpoint"], 404);
    assert_eq!(adv["no_key"][0], 401);
    assert!(adv["no_key"][1]["code"].is_string());
    for k in [
        "create_array_body",
        "create_bad_json",
        "create_volumes",
        "create_huge_cpu",
        "create_bad_metadata",
        "list_bad_state",
        "renew_past",
    ] {
        assert_eq!(adv[k][0], 400, "{k}: {}", adv[k]);
        assert!(adv[k][1]["message"].is_string(), "{k}");
    }
    assert_eq!(adv["command_bad_body"], 400);
    assert_eq!(adv["command_missing_cwd"], 400);
    assert_eq!(adv["upload_relative_path"], 400);
    assert_eq!(adv["upload_file_without_metadata"], 400);
    assert_eq!(adv["egress"], 501);
    assert_nothing_left(&ts, "osb-user").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn opensandbox_sdk_sync_flow() {
    let Some(py) = venv_python() else { return };
    let ts = common::start_with("default").await;
    let user = ts.client.create_key("osb-sync", false).await.unwrap();
    let other = ts.client.create_key("osb-other", false).await.unwrap();
    let mut r = run_script(&py, "osb_flow.py", &["sync"], &ts, &user.key, &other.key).await;
    r["timeout_s"] = 300.into();
    common_flow_checks(&r);
    assert_eq!(r["metadata"]["flavour"], "sync");
    assert_nothing_left(&ts, "osb-sync").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agentscope_opensandbox_workspace_pauses_and_reattaches() {
    let Some(py) = venv_python() else { return };
    let ts = common::start_with("default").await;
    let user = ts.client.create_key("osb-agentscope", false).await.unwrap();
    let r = run_script(&py, "agentscope_flow.py", &[], &ts, &user.key, "").await;
    let first = r["first_id"].clone();
    assert!(first.is_string());
    assert_eq!(r["exec_exit"], 0);
    assert_eq!(
        r["exec_stdout"],
        "hello from /workspace\ndata\nsessions\nskills\n"
    );
    assert_eq!(r["exec_exit7"], 7);
    assert_eq!(r["read_back"], "persist me\n");
    assert_eq!(r["missing"], "FileNotFoundError");
    assert!(r["info_before_close"]["agentscope.workspace.id"]
        .as_str()
        .unwrap()
        .starts_with("ws-"));
    // close pauses; the same workspace id re-attaches to the same sandbox
    // (resumed) with its files
    assert_eq!(r["state_after_close"], "Paused");
    assert_eq!(r["second_id"], first);
    assert_eq!(r["state_after_reattach"], "Running");
    assert_eq!(r["read_after_reattach"], "persist me\n");
    assert_eq!(r["state_after_second_close"], "Paused");
    // another workspace id gets a sandbox of its own
    assert!(r["other_workspace_id"].is_string());
    assert_ne!(r["other_workspace_id"], first);
    assert_eq!(r["kill"], 204);
    assert_eq!(r["kill_extra"], serde_json::json!([204]));
    assert_nothing_left(&ts, "osb-agentscope").await;
}

/// Without the SDK (runs everywhere): the raw wire of a command, and
/// fencing — a sandbox leased by a native client refuses OpenSandbox calls,
/// which carry no lease token, until the lease is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_sandbox_refuses_opensandbox_calls() {
    let ts = common::start().await;
    let key = ts.client.create_key("osb-fenced", false).await.unwrap().key;
    let native = aviary_client::Client::new(&ts.url(), &key);
    let http = reqwest::Client::new();
    let base = format!("{}/opensandbox", ts.url());
    let api = |m: reqwest::Method, path: &str| {
        http.request(m, format!("{base}{path}"))
            .header("OPEN-SANDBOX-API-KEY", &key)
    };
    let created = api(reqwest::Method::POST, "/v1/sandboxes")
        .json(
            &serde_json::json!({"image": {"uri": "busybox"}, "timeout": 120,
            "resourceLimits": {"cpu": "1", "memory": "2Gi"},
            "entrypoint": ["tail", "-f", "/dev/null"], "secureAccess": false}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let created: Value = created.json().await.unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(created["status"]["state"], "Running");
    assert_eq!(created["image"]["uri"], "busybox");
    assert_eq!(
        created["entrypoint"],
        serde_json::json!(["tail", "-f", "/dev/null"])
    );

    let ep: Value = api(
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}/endpoints/44772"),
    )
    .send()
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let endpoint = ep["endpoint"].as_str().unwrap();
    assert!(!endpoint.starts_with("http"), "no scheme: {endpoint}");
    assert!(!endpoint.ends_with('/'), "no trailing slash: {endpoint}");
    let token = ep["headers"]["X-EXECD-ACCESS-TOKEN"]
        .as_str()
        .unwrap()
        .to_owned();
    let command = |body: Value| {
        http.post(format!("http://{endpoint}/command"))
            .header("X-EXECD-ACCESS-TOKEN", &token)
            .json(&body)
            .send()
    };
    let r = command(serde_json::json!({"command": "echo hi; echo oops >&2; exit 4"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types.first(), Some(&"init"), "{text}");
    assert!(events.iter().all(|e| e["timestamp"].is_i64()), "{text}");
    let texts = |t: &str| -> String {
        events
            .iter()
            .filter(|e| e["type"] == t)
            .map(|e| e["text"].as_str().unwrap())
            .collect()
    };
    assert_eq!(texts("stdout"), "hi\n");
    assert_eq!(texts("stderr"), "oops\n");
    let last = events.last().unwrap();
    assert_eq!(last["type"], "error", "{text}");
    assert_eq!(last["error"]["evalue"], "4");
    assert!(!types.contains(&"execution_complete"));

    // the command's timeout (ms) kills it and ends the stream with an error
    let r = command(serde_json::json!({"command": "echo started; sleep 30", "timeout": 300}))
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    let last: Value = serde_json::from_str(text.trim_end().rsplit("\n\n").next().unwrap()).unwrap();
    assert_eq!(last["type"], "error", "{text}");
    assert!(
        last["error"]["traceback"].to_string().contains("timeout"),
        "{text}"
    );
    assert!(text.contains("started"), "{text}");

    // one sandbox's token opens no other sandbox's execd
    let other: Value = api(reqwest::Method::POST, "/v1/sandboxes")
        .json(&serde_json::json!({"image": {"uri": "busybox"}, "timeout": 120}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let other_id = other["id"].as_str().unwrap();
    let crossed = http
        .get(format!("http://{}", endpoint.replace(&id, other_id)) + "/ping")
        .header("X-EXECD-ACCESS-TOKEN", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(crossed.status(), 401);
    let removed = api(
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{other_id}"),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(removed.status(), 204);

    let lease = native
        .acquire_lease(&id, "native-agent", Some(60))
        .await
        .unwrap();
    let refused = command(serde_json::json!({"command": "true"}))
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["code"], "LEASE_REQUIRED", "{body}");
    let refused = api(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    // reads are not fenced
    let ping = http
        .get(format!("http://{endpoint}/ping"))
        .header("X-EXECD-ACCESS-TOKEN", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(ping.status(), 200);

    native.release_lease(&id, lease.token).await.unwrap();
    let ok = command(serde_json::json!({"command": "true"}))
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(ok.text().await.unwrap().contains("execution_complete"));
    let deleted = api(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 204);
    let gone = api(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
    let ping = http
        .get(format!("http://{endpoint}/ping"))
        .header("X-EXECD-ACCESS-TOKEN", &token)
        .send()
        .await
        .unwrap();
    assert!(
        ping.status() == 404 || ping.status() == 401,
        "{}",
        ping.status()
    );
    assert_nothing_left(&ts, "osb-fenced").await;
}

/// The compat routes take from the same per-key rate limit as `/v1`, and
/// answer over it in OpenSandbox's error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opensandbox_calls_share_the_keys_rate_limit() {
    let (ts, _dir) = common::start_edited(|cfg| {
        let e = &mut cfg.control.settings.server.edge;
        e.rate_limit_per_s = 0.2;
        e.rate_limit_burst = 5;
    })
    .await;
    let key = ts.client.create_key("osb-busy", false).await.unwrap().key;
    let http = reqwest::Client::new();
    let mut statuses = Vec::new();
    let mut limited = None;
    for _ in 0..8 {
        let r = http
            .get(format!("{}/opensandbox/v1/sandboxes", ts.url()))
            .header("OPEN-SANDBOX-API-KEY", &key)
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            assert!(r.headers().contains_key("retry-after"));
            limited = Some(r.json::<Value>().await.unwrap());
        }
    }
    assert_eq!(&statuses[..5], &[200; 5], "{statuses:?}");
    assert_eq!(statuses[7], 429, "{statuses:?}");
    assert_eq!(limited.unwrap()["code"], "RATE_LIMITED");
    // the same bucket as the v1 API's
    let v1 = http
        .get(format!("{}/v1/sandboxes", ts.url()))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(v1.status(), 429);
}
