//! Plan → policy → create, against the real server: the planner's
//! recommendation, the guard's clamps and denials (as events), allocation
//! records, and the telemetry loop from a measured OOM back into sizing.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::CreateSandboxRequest;
use aviary_core::ErrorCode;
use serde_json::json;

fn intent(v: serde_json::Value) -> CreateSandboxRequest {
    CreateSandboxRequest {
        intent: Some(v),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_with_an_intent_runs_plan_then_policy() {
    let ts = common::start().await;
    let c = &ts.client;
    let hello = c
        .create_sandbox(&intent(
            json!({"task": "print hello world in python", "languages": ["python"]}),
        ))
        .await
        .unwrap();
    assert_eq!(hello.sandbox.resource_class, "python-small");
    assert!(
        hello.decision.reason.contains("python-small"),
        "{:?}",
        hello.decision
    );
    // the planner's reasoning is on the sandbox's own record: one `planned`
    // event with the trace of every planner tried
    let events = c
        .events(Some(hello.sandbox.id.as_str()), None, Some(100))
        .await
        .unwrap()
        .events;
    let planned: Vec<_> = events
        .iter()
        .filter(|e| e.event_type == "planned")
        .collect();
    assert_eq!(planned.len(), 1, "{events:?}");
    let m = &planned[0].metadata;
    assert_eq!(m["recommended_class"], "python-small", "{m}");
    assert_eq!(m["approved_class"], "python-small", "{m}");
    assert_eq!(m["source"], "heuristic", "{m}");
    let steps = m["trace"]["steps"].as_array().expect("trace steps");
    assert!(steps.iter().any(|s| s["planner"] == "heuristic"), "{m}");
    // a create naming its class has no planner trace
    let plain = c
        .create_sandbox(&CreateSandboxRequest {
            class: Some("python-small".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let events = c
        .events(Some(plain.sandbox.id.as_str()), None, Some(100))
        .await
        .unwrap()
        .events;
    assert!(
        events.iter().all(|e| e.event_type != "planned"),
        "{events:?}"
    );

    let plan = c
        .plan(&json!({
            "task": "load the 20 GB parquet sales dataset with pandas and aggregate by region",
            "dependencies": ["pandas", "pyarrow"],
            "data_size_mb": 20480
        }))
        .await
        .unwrap();
    let big = plan["intent"]["resource_class"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(big, "python-small", "{plan}");
    assert_eq!(plan["policy"]["approved"], true, "{plan}");
    assert_eq!(plan["intent"]["source"], "heuristic");
    assert!(plan["trace"]["workload_signature"]
        .as_str()
        .is_some_and(|s| !s.is_empty()));

    // the create's decision lands in sandbox_allocation, with the sandbox id
    let allocs = c.allocations(Some(10)).await.unwrap();
    let rows = allocs["allocations"].as_array().unwrap();
    assert!(rows.iter().any(
        |a| a["sandbox_id"] == hello.sandbox.id.as_str() && a["actual_class"] == "python-small"
    ));
    assert!(rows
        .iter()
        .any(|a| a["recommended_class"] == big.as_str() && a["sandbox_id"].is_null()));

    // usage is measured at the end of the sandbox's life
    c.exec(
        hello.sandbox.id.as_str(),
        &common::shell("head -c 50000000 /dev/zero | tail -c 1 >/dev/null"),
    )
    .await
    .unwrap();
    c.delete_sandbox(hello.sandbox.id.as_str(), None)
        .await
        .unwrap();
    let allocs = c.allocations(Some(10)).await.unwrap();
    let row = allocs["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["sandbox_id"] == hello.sandbox.id.as_str())
        .cloned()
        .unwrap();
    assert!(
        row["usage"]["peak_memory_mb"].as_u64().unwrap() >= 1,
        "{row}"
    );
    assert_eq!(row["usage"]["oom"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_task_contexts_are_clear_400s() {
    let ts = common::start().await;
    let c = &ts.client;
    for bad in [
        json!({"task": "x", "unknown_field": 1}),
        json!({"task": "x", "data_size_mb": -5}),
        json!({"task": "x", "needs_gpu": "yes"}),
        json!({"plan": ["no task"]}),
        json!({"task": "x".repeat(100_000)}),
    ] {
        let e = c.plan(&bad).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{bad}");
        let e = c.create_sandbox(&intent(bad.clone())).await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{bad}");
    }
    assert!(c.list_sandboxes(true).await.unwrap().sandboxes.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_clamps_and_denies_per_tenant() {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let settings = aviary_config::Config::from_str(
        &aviary_config::EXAMPLE_TOML.replace(
            "[[tenant]]\nname = \"default\"",
            "[[tenant]]\nname = \"small\"\nmax_sandboxes = 1\nmax_cpu = 4.0\nmax_memory_mb = 8192\nallowed_classes = [\"python-small\"]\nallowed_network_profiles = [\"none\"]\nallowed_runtimes = \"*\"\n\n[[tenant]]\nname = \"default\"",
        ),
        "test.toml",
    )
    .unwrap();
    assert!(
        settings.tenant("small").is_some(),
        "test config must define tenant small"
    );
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    cfg.control.settings = settings;
    let ts = common::start_cfg(cfg).await;
    let key = ts.client.create_key("small", false).await.unwrap().key;
    let c = aviary_client::Client::new(&ts.url(), &key);

    // asking for a class the tenant may not use is clamped to one it may
    let r = c
        .create_sandbox(&CreateSandboxRequest {
            class: Some("compute-large".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.sandbox.resource_class, "python-small");
    assert_eq!(r.sandbox.resources.cpu, 1.0);
    assert!(
        r.decision.reason.contains("compute-large"),
        "{:?}",
        r.decision
    );

    // over quota (max 1 sandbox): denied, recorded as an event, nothing created
    let e = c
        .create_sandbox(&CreateSandboxRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    assert!(e.to_string().contains("over_quota"), "{e}");
    let evs = c.events(None, None, Some(1000)).await.unwrap().events;
    assert!(
        evs.iter().any(|e| e.event_type == "policy.denied"),
        "{evs:?}"
    );
    assert_eq!(c.list_sandboxes(false).await.unwrap().sandboxes.len(), 1);
    c.delete_sandbox(r.sandbox.id.as_str(), None).await.unwrap();

    // a GPU job where no class has a GPU
    let e = c
        .create_sandbox(&intent(
            json!({"task": "fine-tune llama with torch on cuda", "needs_gpu": true}),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    assert!(e.to_string().contains("gpu"), "{e}");

    // a network profile the tenant may not use
    let e = c
        .create_sandbox(&CreateSandboxRequest {
            network: Some("open".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
    // the admin's tenant may use "open", but this node cannot give it
    let e = ts
        .client
        .create_sandbox(&CreateSandboxRequest {
            network: Some("open".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidRequest), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_moves_the_next_plan_for_that_workload_up_a_class() {
    let ts = common::start().await;
    let c = &ts.client;
    let ctx = json!({"task": "summarise the monthly sales csv with python", "languages": ["python"], "task_id": "sales-1"});
    let before = c.plan(&ctx).await.unwrap();
    let first_class = before["intent"]["resource_class"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(first_class, "python-small", "{before}");

    let s = c.create_sandbox(&intent(ctx.clone())).await.unwrap();
    let r = c
        .exec(
            s.sandbox.id.as_str(),
            &common::shell("dd if=/dev/zero of=/dev/null bs=3000M count=1"),
        )
        .await
        .unwrap();
    assert!(r.oom_killed, "{r:?}");
    c.delete_sandbox(s.sandbox.id.as_str(), None).await.unwrap();

    let after = c.plan(&ctx).await.unwrap();
    assert_eq!(after["intent"]["source"], "telemetry", "{after}");
    assert_ne!(
        after["intent"]["resource_class"],
        first_class.as_str(),
        "{after}"
    );
}

/// A local OpenAI-compatible endpoint: its first answer is a good intent,
/// every later one asks for 64 CPUs.
async fn fake_llm() -> std::net::SocketAddr {
    use axum::routing::post;
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |axum::Json(body): axum::Json<serde_json::Value>| {
            let calls = calls.clone();
            async move {
                assert_eq!(body["response_format"]["type"], "json_schema");
                let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let cpu = if n == 0 { 2.0 } else { 64.0 };
                let content = json!({
                    "resource_class": "python-ds", "cpu": cpu, "memory_mb": 4096, "disk_mb": 20480,
                    "network_profile": "none", "ttl_s": 1200, "needs_gpu": false, "confidence": 0.8,
                    "reason": "pandas over a medium CSV"
                })
                .to_string();
                axum::Json(json!({
                    "id": "c", "object": "chat.completion", "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_llm_planner_is_used_and_a_hostile_answer_falls_back() {
    let llm = fake_llm().await;
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    cfg.control.settings.planner.llm = Some(aviary_config::LlmSettings {
        base_url: format!("http://{llm}/v1"),
        model: "test-model".into(),
        api_key: None,
        api_key_env: None,
        timeout_ms: 2000,
    });
    let ts = common::start_cfg(cfg).await;
    let c = &ts.client;
    let ctx = json!({"task": "summarise a CSV of sales with pandas", "dependencies": ["pandas"]});
    let good = c.plan(&ctx).await.unwrap();
    assert_eq!(good["intent"]["source"], "llm", "{good}");
    assert_eq!(good["intent"]["resource_class"], "python-ds");
    // asks for 64 CPUs: rejected, heuristics answer, the failure is in the trace
    let hostile = c.plan(&ctx).await.unwrap();
    assert_eq!(hostile["intent"]["source"], "heuristic", "{hostile}");
    assert_eq!(hostile["trace"]["fell_back"], true);
    assert!(
        hostile["intent"]["reason"]
            .as_str()
            .unwrap()
            .contains("llm planner failed"),
        "{hostile}"
    );
}
