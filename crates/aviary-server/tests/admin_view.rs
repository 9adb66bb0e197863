//! The admin's cross-tenant view (`all_tenants=true` on `GET /v1/sandboxes`,
//! `GET /v1/events` and `GET /v1/events/stream`), which the web console's
//! admin pages read: an admin key sees every tenant's sandboxes and events;
//! any other key asking for it is refused with 403 before anything is read,
//! and the refusal names nothing of another tenant. Real server, real crun.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use serde_json::Value;

/// Tenants `team` and `rival` beside the default one (the admin key's).
async fn server() -> (common::TestServer, tempfile::TempDir) {
    let tenants = "[[tenant]]\nname = \"team\"\nmax_sandboxes = 4\nmax_cpu = 16.0\nmax_memory_mb = 65536\nallowed_classes = \"*\"\nallowed_network_profiles = \"*\"\nallowed_runtimes = \"*\"\n\n\
                   [[tenant]]\nname = \"rival\"\nmax_sandboxes = 4\nmax_cpu = 16.0\nmax_memory_mb = 65536\nallowed_classes = \"*\"\nallowed_network_profiles = \"*\"\nallowed_runtimes = \"*\"\n\n\
                   [[tenant]]\nname = \"default\"";
    let settings = aviary_config::Config::from_str(
        &aviary_config::EXAMPLE_TOML.replace("[[tenant]]\nname = \"default\"", tenants),
        "admin-view-test.toml",
    )
    .unwrap();
    common::start_edited(|cfg| cfg.control.settings = settings).await
}

async fn get(base: &str, key: &str, path: &str) -> (u16, String) {
    let r = reqwest::Client::new()
        .get(format!("{base}{path}"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

fn sandbox_tenants(body: &str) -> Vec<(String, String)> {
    let v: Value = serde_json::from_str(body).unwrap();
    let mut out: Vec<(String, String)> = v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_owned(),
                s["tenant"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_sees_every_tenant_and_a_tenant_asking_is_refused() {
    let (ts, _dir) = server().await;
    let base = ts.url();
    let team = ts.client.create_key("team", false).await.unwrap().key;
    let rival = ts.client.create_key("rival", false).await.unwrap().key;
    let team_client = aviary_client::Client::new(&base, &team);
    let rival_client = aviary_client::Client::new(&base, &rival);
    let team_id = common::new_sandbox(&team_client).await;
    let rival_id = common::new_sandbox(&rival_client).await;

    // a tenant asking for every tenant: 403, and the answer names nothing
    for path in [
        "/v1/sandboxes?all_tenants=true",
        "/v1/sandboxes?all_tenants=true&all=true",
        "/v1/events?all_tenants=true",
        &format!("/v1/events?all_tenants=true&sandbox={rival_id}"),
        "/v1/events/stream?all_tenants=true",
    ] {
        let (status, body) = get(&base, &team, path).await;
        assert_eq!(status, 403, "{path}: {body}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["code"], "forbidden", "{path}: {body}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("admin key"),
            "{body}"
        );
        assert!(
            !body.contains(&rival_id) && !body.contains(&team_id) && !body.contains("rival"),
            "{path} leaked: {body}"
        );
    }
    let (status, body) = get(
        &base,
        &team,
        &format!("/v1/sandboxes/{rival_id}?all_tenants=true"),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("rival"), "{body}");
    // the tenant's own view is unchanged: its sandbox only
    let (status, body) = get(&base, &team, "/v1/sandboxes").await;
    assert_eq!(status, 200);
    assert_eq!(
        sandbox_tenants(&body),
        vec![(team_id.clone(), "team".into())]
    );
    // a tenant still cannot read another tenant's events by naming its sandbox
    let (status, _) = get(&base, &team, &format!("/v1/events?sandbox={rival_id}")).await;
    assert_eq!(status, 404);

    // the admin: its own tenant by default (neither sandbox), all with the flag
    let (status, body) = get(&base, &ts.key, "/v1/sandboxes").await;
    assert_eq!(status, 200);
    let own = sandbox_tenants(&body);
    assert!(
        !own.iter().any(|(id, _)| *id == team_id || *id == rival_id),
        "{own:?}"
    );
    let (status, body) = get(&base, &ts.key, "/v1/sandboxes?all_tenants=true").await;
    assert_eq!(status, 200, "{body}");
    let all = sandbox_tenants(&body);
    assert!(all.contains(&(team_id.clone(), "team".into())), "{all:?}");
    assert!(all.contains(&(rival_id.clone(), "rival".into())), "{all:?}");
    // filters still apply across tenants
    let (status, body) = get(
        &base,
        &ts.key,
        "/v1/sandboxes?all_tenants=true&state=Terminated",
    )
    .await;
    assert_eq!(status, 200);
    assert!(sandbox_tenants(&body).is_empty(), "{body}");

    // events: every tenant's, and one sandbox's of another tenant
    let (status, body) = get(&base, &ts.key, "/v1/events?all_tenants=true&limit=1000").await;
    assert_eq!(status, 200, "{body}");
    let events: Value = serde_json::from_str(&body).unwrap();
    let tenants: std::collections::BTreeSet<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["tenant"].as_str().unwrap())
        .collect();
    assert!(
        tenants.contains("team") && tenants.contains("rival"),
        "{tenants:?}"
    );
    let (status, body) = get(
        &base,
        &ts.key,
        &format!("/v1/events?all_tenants=true&sandbox={rival_id}"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let events: Value = serde_json::from_str(&body).unwrap();
    let events = events["events"].as_array().unwrap();
    assert!(!events.is_empty());
    assert!(events
        .iter()
        .all(|e| e["sandbox_id"] == rival_id.as_str() && e["tenant"] == "rival"));
    // one sandbox of another tenant, read only
    let (status, body) = get(
        &base,
        &ts.key,
        &format!("/v1/sandboxes/{rival_id}?all_tenants=true"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let one: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(one["id"], rival_id.as_str());
    assert_eq!(one["tenant"], "rival");
    let (status, _) = get(&base, &ts.key, &format!("/v1/sandboxes/{rival_id}")).await;
    assert_eq!(status, 404);
    // without the flag the admin is a tenant like any other
    let (status, _) = get(&base, &ts.key, &format!("/v1/events?sandbox={rival_id}")).await;
    assert_eq!(status, 404);
    // the live stream opens for the admin (its head is a 200)
    let r = reqwest::Client::new()
        .get(format!("{base}/v1/events/stream?all_tenants=true"))
        .bearer_auth(&ts.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    drop(r);

    // the OpenAPI document names the parameter on each route
    let (_, doc) = get(&base, &ts.key, "/openapi.json").await;
    let doc: Value = serde_json::from_str(&doc).unwrap();
    for route in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}",
        "/v1/events",
        "/v1/events/stream",
    ] {
        let op = &doc["paths"][route]["get"];
        assert!(
            op["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "all_tenants"),
            "{route}"
        );
        assert!(op["responses"]["403"].is_object(), "{route}");
    }

    team_client.delete_sandbox(&team_id, None).await.unwrap();
    rival_client.delete_sandbox(&rival_id, None).await.unwrap();
}
