//! One error map through the real API: state errors are 409 `invalid_state`
//! on every route (and the registry's own illegal-transition refusal maps
//! the same way), a runtime's `not_found` is a 404, not a 500; and the
//! control plane's scope buckets are the `Locks` backend's locks.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_client::ClientError;
use aviary_control::OpError;
use aviary_core::api::CreateSandboxRequest;
use aviary_core::{ErrorCode, SandboxId, SandboxState, Scope};
use aviary_leases::{LockName, LockRequest};
use aviary_registry::{FenceCheck, TransitionCtx};
use axum::response::IntoResponse;
use std::time::Duration;

#[track_caller]
fn assert_api(e: &ClientError, code: ErrorCode) {
    match e {
        ClientError::Api {
            status, code: got, ..
        } => {
            assert_eq!((*got, *status), (code, code.http_status()), "{e}")
        }
        other => panic!("expected an API error {code:?}, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_illegal_transition_is_409_invalid_state_everywhere() {
    let ts = common::start().await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    c.delete_sandbox(&id, None).await.unwrap();
    // the API's own state checks
    assert_api(
        &c.sandbox_action(&id, "pause", None).await.unwrap_err(),
        ErrorCode::InvalidState,
    );
    assert_api(
        &c.sandbox_action(&id, "reset", None).await.unwrap_err(),
        ErrorCode::InvalidState,
    );
    assert_api(
        &c.exec(&id, &common::shell("true")).await.unwrap_err(),
        ErrorCode::InvalidState,
    );
    assert_api(
        &c.acquire_lease(&id, "late", None).await.unwrap_err(),
        ErrorCode::InvalidState,
    );
    assert_api(
        &c.delete_sandbox(&id, None).await.unwrap_err(),
        ErrorCode::InvalidState,
    );
    // the registry's refusal of the same move (a check that lost a race
    // ends here) answers the same: 409 invalid_state, not 400
    let sid: SandboxId = id.parse().unwrap();
    let rec = ts.cp().registry.get_sandbox(&sid).await.unwrap();
    assert_eq!(rec.state, SandboxState::Terminated);
    let refused = ts
        .cp()
        .registry
        .transition(
            &sid,
            rec.version,
            &[SandboxState::Leased],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(refused.code(), ErrorCode::InvalidState);
    let e = OpError::from(refused);
    assert_eq!(e.code(), ErrorCode::InvalidState);
    assert_eq!(
        aviary_server::error::ApiError(e)
            .into_response()
            .status()
            .as_u16(),
        409
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_not_found_is_404() {
    // no probe: the sandbox must not be marked lost before the call
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = common::config(&dir.path().join("d"), "busybox");
    cfg.control.health_probe_interval_ms = 3_600_000;
    let ts = common::start_cfg(cfg).await;
    let c = &ts.client;
    let id = common::new_sandbox(c).await;
    // the runtime loses the sandbox behind the control plane's back
    ts.cp_runtime_destroy(&id.parse().unwrap()).await;
    let e = c.sandbox_action(&id, "pause", None).await.unwrap_err();
    assert_api(&e, ErrorCode::NotFound);
    assert!(e.to_string().contains(&id), "names the sandbox: {e}");
    // teardown is idempotent: the delete still succeeds
    c.delete_sandbox(&id, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_bucket_is_a_lock_of_the_locks_backend() {
    let ts = common::start().await;
    let c = &ts.client;
    let probe = common::new_sandbox(c).await;
    let tenant = ts
        .cp()
        .registry
        .get_sandbox(&probe.parse().unwrap())
        .await
        .unwrap()
        .tenant;
    c.delete_sandbox(&probe, None).await.unwrap();
    let bucket =
        aviary_reuse::scope_bucket(Scope::Session, &tenant, None, Some("s-locked"), None).unwrap();
    // another holder (a crashed replica, say) has the bucket
    let held = ts
        .cp()
        .locks
        .try_acquire(&LockRequest::new(
            LockName::new("bucket", &bucket),
            "elsewhere",
            Duration::from_secs(600),
        ))
        .await
        .unwrap()
        .expect("the bucket is free");
    let req = CreateSandboxRequest {
        session_id: Some("s-locked".into()),
        ..Default::default()
    };
    let create = {
        let (c, req) = (c.clone(), req.clone());
        tokio::spawn(async move { c.create_sandbox(&req).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !create.is_finished(),
        "a create ran while its bucket was held"
    );
    drop(held);
    let created = create.await.unwrap().unwrap();
    // and the create's own guard is gone with it
    let name = LockName::new("bucket", &bucket);
    assert_eq!(ts.cp().locks.holder(&name).await.unwrap(), None);
    c.delete_sandbox(&created.sandbox.id.to_string(), None)
        .await
        .unwrap();
}

/// The constraints the OpenAPI document states on a create's and a key's
/// fields (identifier patterns, absolute paths, bounded maps) are the ones
/// the server enforces: every value the document's schema forbids is a 400
/// that creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_constraints_are_enforced() {
    use utoipa::OpenApi;
    let doc = serde_json::to_value(aviary_server::http::ApiDoc::openapi()).unwrap();
    let props = &doc["components"]["schemas"]["CreateSandboxRequest"]["properties"];
    // Option<String> fields are `type: [string, null]` with the pattern beside it
    let patterned: Vec<(String, String)> = props
        .as_object()
        .unwrap()
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), v["pattern"].as_str()?.to_owned())))
        .collect();
    let names: Vec<&str> = patterned.iter().map(|(k, _)| k.as_str()).collect();
    for f in [
        "template",
        "class",
        "network",
        "user_id",
        "session_id",
        "agent",
        "from_snapshot",
        "workdir",
    ] {
        assert!(names.contains(&f), "{f} has no pattern in {props}");
    }
    assert_eq!(props["metadata"]["maxProperties"], 64, "{props}");
    assert_eq!(props["env"]["maxProperties"], 128, "{props}");

    let ts = common::start().await;
    let url = ts.url();
    let http = reqwest::Client::new();
    let post = |path: &str, body: serde_json::Value| {
        http.post(format!("{url}{path}"))
            .bearer_auth(&ts.key)
            .json(&body)
            .send()
    };
    let before = ts
        .client
        .list_sandboxes(true)
        .await
        .unwrap()
        .sandboxes
        .len();
    // "../evil" breaks every identifier pattern and the absolute-path one
    for (field, _) in &patterned {
        let r = post(
            "/v1/sandboxes",
            serde_json::json!({ field.as_str(): "../evil" }),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 400, "{field}: {:?}", r.text().await);
    }
    let many = |n: usize| -> serde_json::Map<String, serde_json::Value> {
        (0..n).map(|i| (format!("K{i}"), "v".into())).collect()
    };
    for (field, n) in [("metadata", 65), ("env", 129)] {
        let r = post("/v1/sandboxes", serde_json::json!({ field: many(n) }))
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{field}: {:?}", r.text().await);
    }
    let r = post("/v1/keys", serde_json::json!({"tenant": "../evil"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "{:?}", r.text().await);
    let after = ts
        .client
        .list_sandboxes(true)
        .await
        .unwrap()
        .sandboxes
        .len();
    assert_eq!(before, after, "a refused create made a sandbox");
    ts.cleanup().await;
}
