//! The web console (`console/`, served at `/` by `aviary serve`) in a real
//! browser: Debian's Chromium driven by puppeteer-core against a live server
//! on 127.0.0.1:0 with real crun sandboxes. The flow itself is
//! `console/tests/flow.mjs`; it prints its observations as one JSON object,
//! asserted here and cross-checked through the API.
//!
//! scripts/test.sh builds the console (scripts/build-console.sh, before
//! cargo embeds it), installs `chromium` and the pinned puppeteer-core, and
//! names them: `AVIARY_CHROMIUM`, `AVIARY_PUPPETEER_MODULE`. A missing one,
//! a console not built into this binary, or a browser that cannot start here
//! skips loudly with the reason (and fails under `AVIARY_REQUIRE_SERVICES=1`).
//! `AVIARY_CONSOLE_SCREENSHOTS=docs/console` refreshes the README's
//! screenshots (default: a temporary dir).

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::SandboxState;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn skip(why: &str) {
    let why = format!("SKIPPED: {why}");
    assert!(
        std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
        "{why}"
    );
    eprintln!("{why}");
}

fn tool(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            skip(&format!(
                "{var} is not set; scripts/test.sh installs chromium and the pinned puppeteer-core and sets it"
            ));
            None
        }
    }
}

/// Can this browser start here at all? (headless, as root: no sandbox)
fn browser_runs(chromium: &str) -> Result<(), String> {
    let out = std::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--dump-dom",
            "data:text/html,<p>chromium-ok</p>",
        ])
        .output()
        .map_err(|e| format!("cannot run {chromium}: {e}"))?;
    let dom = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && dom.contains("chromium-ok") {
        Ok(())
    } else {
        Err(format!(
            "{chromium} cannot render a page here ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Tenant `team` may use only the network profile `none`; `rival` is
/// another tenant.
async fn server() -> (common::TestServer, tempfile::TempDir) {
    let tenants = "[[tenant]]\nname = \"team\"\nmax_sandboxes = 8\nmax_cpu = 16.0\nmax_memory_mb = 65536\nallowed_classes = \"*\"\nallowed_network_profiles = [\"none\"]\nallowed_runtimes = \"*\"\n\n\
                   [[tenant]]\nname = \"rival\"\nmax_sandboxes = 8\nmax_cpu = 16.0\nmax_memory_mb = 65536\nallowed_classes = \"*\"\nallowed_network_profiles = \"*\"\nallowed_runtimes = \"*\"\n\n\
                   [[tenant]]\nname = \"default\"";
    let settings = aviary_config::Config::from_str(
        &aviary_config::EXAMPLE_TOML.replace("[[tenant]]\nname = \"default\"", tenants),
        "console-test.toml",
    )
    .unwrap();
    assert!(settings.tenant("team").is_some() && settings.tenant("rival").is_some());
    common::start_edited(|cfg| {
        cfg.control.settings = settings;
        // the charts page draws the server's own history: sample it often
        cfg.control.metrics_history_interval_ms = 500;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_headers_and_assets() {
    let (ts, _dir) = server().await;
    let http = reqwest::Client::new();
    let base = ts.url();
    let index = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(index.status(), 200);
    let h = index.headers().clone();
    let csp = h["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'self'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe"),
        "{csp}"
    );
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-frame-options"], "DENY");
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    let html = index.text().await.unwrap();
    // no inline script: every <script> names its source
    for tag in html.split("<script").skip(1) {
        let open = &tag[..tag.find('>').unwrap()];
        assert!(
            open.contains("src="),
            "inline script in the console: <script{open}>"
        );
    }
    if !aviary_server::console::is_built() {
        assert!(html.contains("scripts/build-console.sh"), "{html}");
        skip("console/dist was not built when aviary-server compiled; run scripts/build-console.sh and rebuild");
        return;
    }
    assert!(html.contains("/console/app.js"), "{html}");
    for (path, ty) in [
        ("/console/app.js", "text/javascript"),
        ("/console/app.css", "text/css"),
    ] {
        let r = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with(ty),
            "{path}"
        );
        assert_eq!(r.headers()["x-content-type-options"], "nosniff", "{path}");
        assert!(!r.bytes().await.unwrap().is_empty(), "{path}");
    }
    // only the embedded files: no traversal to the file system, no listing
    for path in [
        "/console/..%2fCargo.toml",
        "/console/%2e%2e%2f%2e%2e%2fCargo.toml",
        "/console/nope.js",
        "/console/src/main.jsx",
    ] {
        let r = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        assert!(
            r.headers().contains_key("content-security-policy"),
            "{path}"
        );
    }
    // the page adds no privilege: the API still wants a key
    let r = http
        .get(format!("{base}/v1/sandboxes"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http.post(format!("{base}/")).send().await.unwrap();
    assert_eq!(r.status(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_flow() {
    let (Some(chromium), Some(puppeteer)) =
        (tool("AVIARY_CHROMIUM"), tool("AVIARY_PUPPETEER_MODULE"))
    else {
        return;
    };
    if !aviary_server::console::is_built() {
        skip("console/dist was not built when aviary-server compiled; run scripts/build-console.sh and rebuild");
        return;
    }
    if let Err(why) = browser_runs(&chromium) {
        skip(&why);
        return;
    }
    let (ts, _dir) = server().await;
    let team = ts.client.create_key("team", false).await.unwrap().key;
    let rival = ts.client.create_key("rival", false).await.unwrap().key;
    let team_client = aviary_client::Client::new(&ts.url(), &team);
    let shots_tmp = tempfile::tempdir().unwrap();
    let shots = std::env::var_os("AVIARY_CONSOLE_SCREENSHOTS")
        .map(|p| workspace_root().join(p))
        .unwrap_or_else(|| shots_tmp.path().to_path_buf());
    let run = format!("r{}", std::process::id());

    let out = tokio::task::block_in_place(|| {
        std::process::Command::new("node")
            .arg(workspace_root().join("console/tests/flow.mjs"))
            .env("AVIARY_URL", ts.url())
            .env("TEAM_KEY", &team)
            .env("RIVAL_KEY", &rival)
            .env("ADMIN_KEY", &ts.key)
            .env("RUN", &run)
            .env("CHROMIUM", &chromium)
            .env("PUPPETEER", &puppeteer)
            .env("SHOTS", &shots)
            .output()
            .unwrap()
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // whatever the flow did, nothing it created may outlive the test
    let rival_client = aviary_client::Client::new(&ts.url(), &rival);
    let mut left: Vec<_> = team_client
        .list_sandboxes(false)
        .await
        .unwrap()
        .sandboxes
        .into_iter()
        .chain(rival_client.list_sandboxes(false).await.unwrap().sandboxes)
        .filter(|s| !s.state.is_terminal())
        .collect();
    left.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
    for s in &left {
        let owner = if s.tenant == "rival" {
            &rival_client
        } else {
            &team_client
        };
        let _ = owner.delete_sandbox(s.id.as_str(), None).await;
    }
    assert!(
        out.status.success(),
        "flow.mjs failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let o: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("flow printed no JSON ({e}):\n{stdout}\n{stderr}"));
    eprintln!("console flow observed: {o}");

    // the page ran clean under its CSP, never put a key in a URL, and sent
    // every API call with the bearer key
    assert_eq!(o["page_errors"], serde_json::json!([]), "{o}");
    assert_eq!(
        o["console_errors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e.as_str().unwrap().contains("Content Security Policy"))
            .count(),
        0,
        "{o}"
    );
    assert_eq!(o["requests_with_key_in_url"], serde_json::json!([]));
    assert_eq!(o["api_requests_without_auth"], serde_json::json!([]));
    assert!(o["api_requests"].as_u64().unwrap() > 10, "{o}");
    assert!(o["index_csp"]
        .as_str()
        .unwrap()
        .contains("frame-ancestors 'none'"));

    // login: a wrong key refused with the API's code, not kept; the right one kept for the tab
    assert_eq!(o["login_label"], "API key");
    assert!(
        o["bad_login_error"]
            .as_str()
            .unwrap()
            .contains("unauthorized"),
        "{o}"
    );
    assert_eq!(o["key_stored_after_bad_login"], Value::Null);
    assert_eq!(o["key_in_session_storage"], true);

    // keyboard: the page's heading has focus, Tab walks the filters, then
    // the skip link and the navigation; Enter on "New sandbox" opened the form
    assert_eq!(o["focused_after_login"], "H1:Sandboxes", "{o}");
    let tabs: Vec<&str> = o["tab_order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        &tabs[..4],
        &["f-state", "f-labels", "f-ended", "f-live"],
        "{tabs:?}"
    );
    let skip_at = tabs.iter().position(|t| *t == "Skip to content").unwrap();
    assert_eq!(
        tabs[skip_at..],
        ["Skip to content", "Aviary", "Sandboxes", "New sandbox"],
        "{tabs:?}"
    );
    // every input of the form has a label
    let labels = o["form_labels"].as_array().unwrap();
    assert_eq!(labels.len(), 4, "{o}");
    assert!(
        labels
            .iter()
            .all(|l| l.as_str().is_some_and(|s| !s.is_empty())),
        "{o}"
    );
    assert!(
        o["templates_offered"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == "busybox"),
        "{o}"
    );

    // the policy denial, with its reason, as an alert; it created nothing
    let denial = o["denial"].as_str().unwrap();
    assert!(denial.starts_with("forbidden"), "{denial}");
    assert!(denial.contains("network_profile_not_allowed"), "{denial}");
    assert!(denial.contains("open"), "{denial}");
    assert_eq!(o["denial_role"], "alert");
    let denied = team_client
        .events(None, None, Some(1000))
        .await
        .unwrap()
        .events;
    assert!(
        denied.iter().any(|e| e.event_type == "policy.denied"),
        "{denied:?}"
    );

    // created from the page: this tenant's, with the form's labels
    let id = o["created_id"].as_str().unwrap();
    // (plus those the flow made through the API: to watch the list refresh,
    // for the admin's view, for the create-latency chart)
    let all = team_client.list_sandboxes(true).await.unwrap().sandboxes;
    let api_id = o["api_created_id"].as_str().unwrap();
    let team_sbx = o["team_sandbox"].as_str().unwrap();
    let rival_sbx = o["rival_sandbox"].as_str().unwrap();
    let mut ids: Vec<&str> = all.iter().map(|s| s.id.as_str()).collect();
    ids.sort_unstable();
    let probe_sbx = o["chart_probe_sandbox"].as_str().unwrap();
    let fork_sbx = o["fork_id"].as_str().unwrap();
    let planned_sbx = o["planned_sandbox"].as_str().unwrap();
    let mut want = vec![id, api_id, team_sbx, probe_sbx, fork_sbx, planned_sbx];
    want.sort_unstable();
    assert_eq!(ids, want, "the denied create made nothing: {all:?}");
    let sbx = all.iter().find(|s| s.id.as_str() == id).unwrap();
    assert_eq!(sbx.tenant, "team");
    assert_eq!(
        sbx.metadata.get("suite").map(String::as_str),
        Some("console")
    );
    assert_eq!(sbx.metadata.get("run"), Some(&run));
    assert_eq!(o["fields_tenant"], "team");
    // the create's answer (decision, restore branch, score, reason) is on
    // the sandbox's page
    let d = &o["decision"];
    assert_eq!(d["action"], "new_sandbox", "{o}");
    assert!(
        ["A", "B", "C", "D"].contains(&d["branch"].as_str().unwrap()),
        "{o}"
    );
    assert!(!d["reason"].as_str().unwrap().is_empty(), "{o}");
    // the label with markup is shown as text, nothing injected
    let html = r#"<img src=x onerror="window.__pwned=1">"#;
    assert_eq!(sbx.metadata.get("note").map(String::as_str), Some(html));
    assert!(
        o["label_texts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t.as_str() == Some(&format!("note={html}"))),
        "{o}"
    );
    assert_eq!(o["injected_images"], 0);
    assert_eq!(o["pwned"], false);
    // the usage panel: the runtime's memory figure (> 0) against the class's
    // limit, labelled meters, a CPU percentage from two reads
    let usage = &o["usage"];
    let memory: u64 = usage["memory"]["value"].as_str().unwrap().parse().unwrap();
    assert!(memory > 0, "{o}");
    assert_eq!(
        usage["memory"]["meter"]["max"].as_u64(),
        Some(sbx.resources.memory_mb * 1024 * 1024),
        "{o}"
    );
    assert_eq!(usage["memory"]["meter"]["label"], "Memory", "{o}");
    assert!(
        usage["memory"]["meter"]["valuetext"]
            .as_str()
            .unwrap()
            .contains(" of "),
        "{o}"
    );
    assert_eq!(usage["pids"]["meter"]["label"], "Processes", "{o}");
    let pids: u64 = usage["pids"]["value"].as_str().unwrap().parse().unwrap();
    assert!(pids >= 1, "{o}");
    assert!(
        usage["cpu"]["text"]
            .as_str()
            .unwrap()
            .contains("% of one core"),
        "{o}"
    );
    assert_eq!(o["api_sandbox_left_list"], true);

    // a NEW event arrived live on the sandbox's page after the API's exec
    // and lease; it is in the API's log for this sandbox
    assert_eq!(o["exec_stdout"], "from-the-api\n");
    let live = o["live_events"].as_array().unwrap();
    assert!(!live.is_empty(), "{o}");
    let before_max = o["events_before"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .max()
        .unwrap_or(0);
    let logged = team_client
        .events(Some(id), None, Some(1000))
        .await
        .unwrap()
        .events;
    for ev in live {
        let eid = ev["id"].as_i64().unwrap();
        assert!(eid > before_max);
        let found = logged
            .iter()
            .find(|e| e.id == eid)
            .unwrap_or_else(|| panic!("page event {ev} not in the log"));
        assert_eq!(found.event_type, ev["type"].as_str().unwrap());
        assert_eq!(found.sandbox_id.as_ref().map(|s| s.as_str()), Some(id));
    }
    assert_eq!(o["page_lease_holder"], "console-flow");
    // the lease's event, opened by keyboard on the page, is the log's record
    let lease_ev = live.iter().find(|e| e["type"] == "lease_acquired").unwrap();
    let logged_lease = logged
        .iter()
        .find(|e| e.id == lease_ev["id"].as_i64().unwrap())
        .unwrap();
    assert_eq!(o["lease_event_details"], logged_lease.metadata, "{o}");

    // the list: the row's fields; filters by label and by state
    let row = &o["list_row"];
    assert_eq!(row["Class"], sbx.resource_class.as_str());
    assert_eq!(row["Runtime"], sbx.runtime.as_str());
    assert_eq!(row["Node"], sbx.node.as_str());
    assert_eq!(row["Lease holder"], "console-flow");
    assert!(
        row["Labels"].as_str().unwrap().contains("suite=console"),
        "{row}"
    );
    assert_eq!(o["filtered_ids"], serde_json::json!([id]));
    assert_eq!(o["nomatch_rows"], 0);
    assert_eq!(o["in_terminated_filter"], 0);
    assert!(
        o["narrow_overflow"].as_i64().unwrap() <= 0,
        "wider than a phone: {o}"
    );

    // logging out forgot the key (and the tab's create decisions)
    assert_eq!(o["storage_after_logout"], 0);
    // another tenant: not listed, not readable (the API's 404)
    assert!(
        !o["rival_ids"].as_array().unwrap().iter().any(|v| v == id),
        "{o}"
    );
    assert!(
        o["rival_page_error"]
            .as_str()
            .unwrap()
            .starts_with("not_found"),
        "{o}"
    );
    assert_eq!(o["rival_sees_fields"], 0);

    // destroyed from the page
    assert!(
        o["destroyed_state"]
            .as_str()
            .unwrap()
            .starts_with("Terminated"),
        "{o}"
    );
    let after = team_client.get_sandbox(id).await.unwrap();
    assert_eq!(after.state, SandboxState::Terminated);
    assert!(left.is_empty(), "sandboxes left by the flow: {left:?}");

    // the terminal: the shell's output is on the page, F6 left it, `exit 3`
    // ended the session with its code; both ends are in the sandbox's log
    assert_eq!(o["term_focus"], "Terminal input", "{o}");
    let rows: Vec<&str> = o["term_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert!(rows.contains(&"term-42"), "{rows:?}");
    assert!(
        rows.iter().any(|r| r.contains("echo term-$((6*7))")),
        "{rows:?}"
    );
    assert_eq!(o["term_f6_focus"], "Close terminal", "{o}");
    assert_eq!(o["term_exit"], "Exited with code 3.", "{o}");
    // leased: refused without the token, a shell with it
    assert!(
        !o["term_leased_without_token"].as_str().unwrap().is_empty(),
        "{o}"
    );
    assert!(
        o["lease_token_label"]
            .as_str()
            .unwrap()
            .contains("console-flow"),
        "{o}"
    );
    assert!(
        o["term_leased_rows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "leased-42"),
        "{o}"
    );
    let types: Vec<&str> = logged.iter().map(|e| e.event_type.as_str()).collect();
    assert!(
        types.contains(&"tty_started") && types.contains(&"tty_exited"),
        "{types:?}"
    );

    // files: the page's upload is the same bytes through the API, and its
    // download is the same bytes on disk
    assert_eq!(o["api_bytes_equal"], true, "{o}");
    assert_eq!(o["download_equal"], true, "{o}");
    let size = o["upload_size"].as_u64().unwrap();
    assert!(
        o["upload_note"]
            .as_str()
            .unwrap()
            .contains(&format!("upload.bin ({size} bytes)")),
        "{o}"
    );
    assert!(
        o["download_note"]
            .as_str()
            .unwrap()
            .contains(&format!("({size} bytes)")),
        "{o}"
    );
    // the tenant's audit page lists its policy denial with the reason; a
    // tenant is offered no admin page and no cross-tenant switch
    assert!(
        o["audit_rows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_str().unwrap().contains("network_profile_not_allowed")),
        "{o}"
    );
    assert_eq!(
        o["tenant_nav"],
        serde_json::json!(["Sandboxes", "New sandbox", "Planner", "Events", "Audit"])
    );
    assert_eq!(o["tenant_all_switch"], 0);
    // a create with a task context: the page lists the planner's trace from
    // the sandbox's `planned` event, and names the decision
    let trace = o["planned_trace"].as_array().unwrap();
    assert!(
        trace
            .iter()
            .any(|s| s.as_str().unwrap().starts_with("heuristic")),
        "{o}"
    );
    assert!(
        o["planned_decisions"].as_str().unwrap().contains("planned"),
        "{o}"
    );

    // the admin: its own tenant by default, every tenant with the switch
    let own: Vec<&str> = o["admin_own_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        !own.contains(&team_sbx) && !own.contains(&rival_sbx),
        "{own:?}"
    );
    let all_rows = o["admin_all_rows"].as_array().unwrap();
    let tenant_of = |sid: &str| {
        all_rows
            .iter()
            .find(|r| r["id"] == sid)
            .map(|r| r["tenant"].as_str().unwrap().to_owned())
    };
    assert_eq!(tenant_of(team_sbx).as_deref(), Some("team"), "{o}");
    assert_eq!(tenant_of(rival_sbx).as_deref(), Some("rival"), "{o}");
    // another tenant's sandbox, opened by the admin: read only
    let foreign = &o["admin_foreign"];
    assert_eq!(foreign["tenant"], "rival", "{o}");
    assert!(
        foreign["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "created"),
        "{o}"
    );
    assert_eq!(foreign["terminals"], 0, "{o}");
    assert_eq!(foreign["file_tables"], 0, "{o}");
    assert_eq!(foreign["destroy_buttons"], 0, "{o}");
    assert!(foreign["usage_memory"].as_u64().unwrap() > 0, "{o}");
    // ... while the rival (a tenant) saw only its own
    assert!(!o["rival_ids"].as_array().unwrap().iter().any(|v| v == id));

    // keyboard: every page reached from the navigation with Shift+Tab and
    // Enter, its heading focused, every input labelled
    assert_eq!(
        o["admin_nav"],
        serde_json::json!([
            "Sandboxes",
            "New sandbox",
            "Planner",
            "Events",
            "Audit",
            "Pools",
            "Nodes",
            "Charts",
            "Tenants and keys"
        ])
    );
    let visited = o["keyboard_pages"].as_array().unwrap();
    assert_eq!(visited.len(), 9, "{o}");
    for p in visited {
        assert_eq!(p["reached"], true, "{p}");
        assert_eq!(p["unlabelled"], serde_json::json!([]), "{p}");
        assert!(p["heading"].as_str().is_some_and(|h| !h.is_empty()), "{p}");
    }
    // the planner page's plan: class, source and the trace's steps
    assert!(
        o["plan_fields"]["Class"]
            .as_str()
            .is_some_and(|c| !c.is_empty()),
        "{o}"
    );
    assert!(!o["plan_steps"].as_array().unwrap().is_empty(), "{o}");
    // the events page widened to every tenant, then filtered by type
    let ev_tenants = o["events_tenants"].as_array().unwrap();
    assert!(
        ev_tenants.iter().any(|t| t == "rival") && ev_tenants.iter().any(|t| t == "team"),
        "{o}"
    );
    assert!(o["events_filtered_types"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_str().unwrap().contains("lease")));
    // nodes (capacity vs committed as meters, health), charts, tenants
    let nodes = o["nodes"].as_array().unwrap();
    assert!(!nodes.is_empty(), "{o}");
    assert!(nodes.iter().all(|n| n["meters"] == 2), "{o}");
    assert_eq!(
        o["charts"],
        serde_json::json!(["chart-states", "chart-create-latency", "chart-hit-rate"])
    );
    // the charts start from the server's own history (sampled every 500 ms here)
    let history = o["charts_history"].as_str().unwrap();
    let n: u32 = history
        .split("history: ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{history}"));
    assert!(n >= 1, "{history}");
    assert!(o["tenant_rows"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == "team"));
    // snapshots taken from the page chain (the second under the first); the
    // fork made from the second shows under it, and names where it came from
    let tree = o["snapshot_tree"].as_array().unwrap();
    assert_eq!(tree.len(), 2, "{o}");
    let first = tree.iter().find(|s| s["parent"].is_null()).unwrap();
    let second = tree.iter().find(|s| !s["parent"].is_null()).unwrap();
    assert_eq!(second["parent"], first["id"], "{o}");
    assert_eq!(o["fork_lineage"]["under"], second["id"], "{o}");
    assert!(
        o["fork_lineage"]["text"]
            .as_str()
            .unwrap()
            .contains("this sandbox"),
        "{o}"
    );
    assert_eq!(o["fork_decision"]["action"], "fork", "{o}");
    let from = o["forked_from"].as_str().unwrap();
    assert!(
        from.contains(second["id"].as_str().unwrap()) && from.contains(team_sbx),
        "{from}"
    );
    let snaps = team_client.snapshots(None).await.unwrap();
    let of_team_sbx: Vec<&str> = snaps["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["sandbox_id"] == team_sbx)
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(of_team_sbx.len(), 2, "{snaps}");
    let fork_log = team_client
        .events(Some(fork_sbx), None, Some(1000))
        .await
        .unwrap()
        .events;
    let forked = fork_log
        .iter()
        .find(|e| e.event_type == "forked")
        .unwrap_or_else(|| panic!("{fork_log:?}"));
    assert_eq!(forked.metadata["snapshot"], second["id"]);
    assert_eq!(forked.metadata["parent_sandbox"], team_sbx);

    // narrow screens: no page wider than 400 px
    for (page, overflow) in o["narrow_overflow_by_page"].as_object().unwrap() {
        assert!(overflow.as_i64().unwrap() <= 0, "{page} overflows: {o}");
    }
    assert!(o["narrow_sandbox_overflow"].as_i64().unwrap() <= 0, "{o}");

    for page in [
        "login",
        "create-denied",
        "sandbox",
        "sandbox-terminal-files",
        "sandbox-narrow",
        "sandboxes",
        "sandboxes-narrow",
        "other-tenant",
        "audit",
        "admin-all-tenants",
        "admin-foreign-sandbox",
        "planner",
        "events",
        "pools",
        "nodes",
        "charts",
        "keys",
        "keys-narrow",
        "snapshots-fork",
    ] {
        let shot = shots.join(format!("{page}.png"));
        assert!(
            std::fs::metadata(&shot).unwrap().len() > 0,
            "{}",
            shot.display()
        );
    }
}
