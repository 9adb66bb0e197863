//! The embedded server answers an exec's fencing check from memory
//! (`aviary_leases::CachedLeaseStore`): these tests prove every lease change
//! reaches that answer at once — a release, a take-over, an expiry by the
//! clock (with the expiry sweep off), a revoke — through the v1 API and
//! through the E2B and OpenSandbox surfaces, which share the exec path.
//! Each change is made right after an exec that filled the cache.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest, ExecRequest};
use aviary_core::{ErrorCode, LeaseToken};
use serde_json::Value;
use std::time::Duration;

fn code(e: aviary_client::ClientError) -> ErrorCode {
    e.code().unwrap_or_else(|| panic!("no error code in {e}"))
}

fn true_with(token: Option<LeaseToken>) -> ExecRequest {
    ExecRequest {
        cmd: Some(vec!["true".into()]),
        token,
        ..Default::default()
    }
}

/// A server whose expiry sweep never runs during a test: an expired lease
/// is refused by the clock alone.
async fn server_without_sweep() -> (common::TestServer, tempfile::TempDir) {
    common::start_edited(|cfg| cfg.control.sweep_interval_ms = 3_600_000).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_change_fences_the_old_token_at_once() {
    let (ts, _dir) = server_without_sweep().await;
    let c = &ts.client;
    let created = c
        .create_sandbox(&CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "a".into(),
                ttl_s: Some(300),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = created.sandbox.id.to_string();
    let l1 = created.lease.unwrap().token;
    // twice: the second is answered from the cache
    for _ in 0..2 {
        assert_eq!(
            c.exec(&id, &true_with(Some(l1))).await.unwrap().exit_code,
            0
        );
    }
    assert_eq!(
        code(c.exec(&id, &true_with(None)).await.unwrap_err()),
        ErrorCode::LeaseRequired
    );

    // released: the old token is stale, no token is fine
    c.release_lease(&id, l1).await.unwrap();
    assert_eq!(
        code(c.exec(&id, &true_with(Some(l1))).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    assert_eq!(c.exec(&id, &true_with(None)).await.unwrap().exit_code, 0);

    // taken by another holder right after an unleased exec
    let l2 = c.acquire_lease(&id, "b", Some(300)).await.unwrap().token;
    assert_eq!(
        code(c.exec(&id, &true_with(None)).await.unwrap_err()),
        ErrorCode::LeaseRequired
    );
    assert_eq!(
        code(c.exec(&id, &true_with(Some(l1))).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    assert_eq!(
        c.exec(&id, &true_with(Some(l2))).await.unwrap().exit_code,
        0
    );

    // revoked by the control plane (as a loss or a destroy does)
    ts.cp().leases.revoke(&id.parse().unwrap()).await.unwrap();
    assert_eq!(
        code(c.exec(&id, &true_with(Some(l2))).await.unwrap_err()),
        ErrorCode::StaleToken
    );

    // expired by the clock, with no sweep to delete it: refused as soon as
    // its time is up, and a take-over after it wins
    let l3 = c.acquire_lease(&id, "c", Some(1)).await.unwrap();
    assert_eq!(
        c.exec(&id, &true_with(Some(l3.token)))
            .await
            .unwrap()
            .exit_code,
        0
    );
    let until = l3.expires_at - time::OffsetDateTime::now_utc();
    tokio::time::sleep(Duration::try_from(until).unwrap_or_default() + Duration::from_millis(50))
        .await;
    assert_eq!(
        code(c.exec(&id, &true_with(Some(l3.token))).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    let l4 = c.acquire_lease(&id, "d", Some(300)).await.unwrap().token;
    assert_eq!(
        code(c.exec(&id, &true_with(Some(l3.token))).await.unwrap_err()),
        ErrorCode::StaleToken
    );
    assert_eq!(
        c.exec(&id, &true_with(Some(l4))).await.unwrap().exit_code,
        0
    );

    // the streamed exec and a file write share the check
    match c.exec_stream(&id, &true_with(Some(l3.token))).await {
        Ok(_) => panic!("a streamed exec with a stale token was started"),
        Err(e) => assert_eq!(code(e), ErrorCode::StaleToken),
    }
    assert_eq!(
        code(
            c.write_file(&id, "/tmp/x", b"1".to_vec(), Some(l3.token))
                .await
                .unwrap_err()
        ),
        ErrorCode::StaleToken
    );
    c.write_file(&id, "/tmp/x", b"1".to_vec(), Some(l4))
        .await
        .unwrap();
    c.delete_sandbox(&id, Some(l4)).await.unwrap();
    ts.cp().reclaims.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_surfaces_see_a_native_lease_at_once() {
    let (ts, _dir) = server_without_sweep().await;
    let http = reqwest::Client::new();

    // E2B: a command runs unleased (the cache now says so), then a native
    // client takes a lease: the next command is refused, and runs again
    // once the lease is released
    let base = format!("{}/e2b", ts.url());
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
    let access = created["envdAccessToken"].as_str().unwrap().to_owned();
    let e2b_run = || {
        let mut body = serde_json::to_vec(&serde_json::json!({
            "process": {"cmd": "true", "args": []}
        }))
        .unwrap();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
        framed.append(&mut body);
        http.post(format!("{base}/envd/process.Process/Start"))
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &access)
            .header("content-type", "application/connect+json")
            .body(framed)
            .send()
    };
    let e2b_ran = |status: u16, body: &str| status == 200 && body.contains("\"end\"");
    let r = e2b_run().await.unwrap();
    let (status, body) = (r.status().as_u16(), r.text().await.unwrap());
    assert!(e2b_ran(status, &body), "{status} {body}");
    let lease = ts
        .client
        .acquire_lease(&id, "native", Some(300))
        .await
        .unwrap();
    let r = e2b_run().await.unwrap();
    let (status, body) = (r.status().as_u16(), r.text().await.unwrap());
    assert!(
        !e2b_ran(status, &body),
        "ran under a lease: {status} {body}"
    );
    assert!(body.contains("lease"), "{status} {body}");
    ts.client.release_lease(&id, lease.token).await.unwrap();
    let r = e2b_run().await.unwrap();
    let (status, body) = (r.status().as_u16(), r.text().await.unwrap());
    assert!(e2b_ran(status, &body), "{status} {body}");
    ts.client.delete_sandbox(&id, None).await.unwrap();

    // OpenSandbox's execd: the same
    let base = format!("{}/opensandbox", ts.url());
    let created: Value = http
        .post(format!("{base}/v1/sandboxes"))
        .header("OPEN-SANDBOX-API-KEY", &ts.key)
        .json(
            &serde_json::json!({"image": {"uri": "busybox"}, "timeout": 120,
            "resourceLimits": {"cpu": "1", "memory": "2Gi"},
            "entrypoint": ["tail", "-f", "/dev/null"]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let ep: Value = http
        .get(format!("{base}/v1/sandboxes/{id}/endpoints/44772"))
        .header("OPEN-SANDBOX-API-KEY", &ts.key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let endpoint = ep["endpoint"].as_str().unwrap().to_owned();
    let access = ep["headers"]["X-EXECD-ACCESS-TOKEN"]
        .as_str()
        .unwrap()
        .to_owned();
    let osb_run = || {
        http.post(format!("http://{endpoint}/command"))
            .header("X-EXECD-ACCESS-TOKEN", &access)
            .json(&serde_json::json!({"command": "true"}))
            .send()
    };
    let r = osb_run().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("execution_complete"));
    let lease = ts
        .client
        .acquire_lease(&id, "native", Some(300))
        .await
        .unwrap();
    let r = osb_run().await.unwrap();
    assert_eq!(r.status(), 409);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["code"], "LEASE_REQUIRED", "{body}");
    ts.client.release_lease(&id, lease.token).await.unwrap();
    let r = osb_run().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("execution_complete"));
    ts.client.delete_sandbox(&id, None).await.unwrap();
    ts.cp().reclaims.settled().await;
}
