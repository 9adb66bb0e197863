//! The create pipeline's decisions, stage by stage, over fakes: which class
//! (requested, planned from a task context, default), what the policy guard
//! denies and how, what a failed runtime create leaves behind, the lease
//! taken with the create, the state path of a cold create, and placement
//! refusing to over-commit the node.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_config::Allowed;
    use aviary_control::requests::{AllocationQuery, SandboxQuery, SandboxRef};
    use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest};
    use aviary_core::{ErrorCode, SandboxState};
    use aviary_registry::Registry as _;
    use aviary_runtime::RuntimeError;

    fn with_class(class: &str) -> CreateSandboxRequest {
        CreateSandboxRequest {
            class: Some(class.into()),
            ..Default::default()
        }
    }

    fn with_intent(intent: serde_json::Value) -> CreateSandboxRequest {
        CreateSandboxRequest {
            intent: Some(intent),
            ..Default::default()
        }
    }

    /// A plane whose configuration has a `[[tenant]]` rule for `acme`,
    /// shaped by `edit`.
    async fn plane_with_tenant(edit: impl FnOnce(&mut aviary_config::Tenant)) -> Plane {
        let mut cfg = config();
        let mut acme = open_tenant("acme");
        edit(&mut acme);
        cfg.settings.tenants.push(acme);
        plane_with(cfg).await
    }

    /// The `policy.denied` events of the caller's tenant.
    async fn denials(p: &Plane, caller: &aviary_control::OpContext) -> Vec<serde_json::Value> {
        tenant_events(p, caller)
            .await
            .into_iter()
            .filter(|e| e.event_type == "policy.denied")
            .map(|e| {
                assert_eq!(e.sandbox_id, None, "a denial has no sandbox");
                e.metadata
            })
            .collect()
    }

    /// `e` is a policy denial (403 forbidden) recorded as exactly one
    /// `policy.denied` event with `code`; returns that event's metadata.
    async fn the_one_denial(
        p: &Plane,
        caller: &aviary_control::OpContext,
        e: &aviary_control::OpError,
        code: &str,
    ) -> serde_json::Value {
        assert_eq!(e.code(), ErrorCode::Forbidden, "{e}");
        let mut denied = denials(p, caller).await;
        assert_eq!(denied.len(), 1, "{denied:?}");
        assert_eq!(denied[0]["code"], code);
        denied.remove(0)
    }

    // ---- class: requested, planned, default --------------------------------

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_class_and_no_intent_gets_the_default_class() {
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap();
        assert_eq!(created.sandbox.resource_class, "python-small");
        assert!(
            created.decision.reason.contains("default class"),
            "{}",
            created.decision.reason
        );
        let allocations =
            p.cp.allocations(&alice, AllocationQuery::default())
                .await
                .unwrap()
                .allocations;
        assert_eq!(allocations.len(), 1);
        let a = &allocations[0];
        assert_eq!(a.source, "default");
        assert_eq!(
            (a.recommended_class.as_str(), a.actual_class.as_str()),
            ("python-small", "python-small")
        );
        assert_eq!(a.sandbox_id.as_deref(), Some(created.sandbox.id.as_str()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_requested_class_is_used_and_its_limits_reach_the_runtime() {
        let p = plane().await;
        let alice = tenant("alice");
        let created = p.cp.create(&alice, with_class("python-ds")).await.unwrap();
        assert_eq!(created.sandbox.resource_class, "python-ds");
        let class = p.cp.cfg.settings.class("python-ds").unwrap().limits();
        assert_eq!(created.sandbox.resources, class);
        assert_eq!(p.runtime.created_specs()[0].resources, class);
        let a = &p
            .cp
            .allocations(&alice, AllocationQuery::default())
            .await
            .unwrap()
            .allocations[0];
        assert_eq!(a.source, "request");
        assert_eq!(a.actual_class, "python-ds");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_context_is_planned_into_a_class() {
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(
                &alice,
                with_intent(serde_json::json!({
                    "task": "run playwright against the staging site",
                    "needs_browser": true,
                })),
            )
            .await
            .unwrap();
        assert_eq!(created.sandbox.resource_class, "browser-medium");
        assert_eq!(
            p.runtime.created_specs()[0].resources,
            p.cp.cfg.settings.class("browser-medium").unwrap().limits()
        );
        let a = &p
            .cp
            .allocations(&alice, AllocationQuery::default())
            .await
            .unwrap()
            .allocations[0];
        assert_eq!(a.recommended_class, "browser-medium");
        assert_eq!(a.actual_class, "browser-medium");
        assert_eq!(a.source, "heuristic");
        assert!(a.workload_signature.starts_with("ws-"), "{a:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_requested_class_wins_over_the_task_context() {
        let p = plane().await;
        let alice = tenant("alice");
        let mut req = with_intent(
            serde_json::json!({"task": "scrape with playwright", "needs_browser": true}),
        );
        req.class = Some("python-small".into());
        let created = p.cp.create(&alice, req).await.unwrap();
        assert_eq!(created.sandbox.resource_class, "python-small");
        let a = &p
            .cp
            .allocations(&alice, AllocationQuery::default())
            .await
            .unwrap()
            .allocations[0];
        assert_eq!(a.source, "request");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_planned_network_is_only_a_recommendation() {
        // the caller asked for no network: whatever the planner suggests,
        // the sandbox gets "none"
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(
                &alice,
                with_intent(serde_json::json!({
                    "task": "pip install requests and fetch https://example.org",
                    "network": "open",
                })),
            )
            .await
            .unwrap();
        assert_eq!(
            created.sandbox.network_profile,
            aviary_core::NetworkProfile::None
        );
        assert_eq!(
            p.runtime.created_specs()[0].network,
            aviary_core::NetworkProfile::None
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_malformed_task_context_is_invalid_and_starts_nothing() {
        let p = plane().await;
        let alice = tenant("alice");
        let e =
            p.cp.create(
                &alice,
                with_intent(serde_json::json!({"languages": ["python"]})),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        assert_eq!(p.runtime.create_calls(), 0);
        assert!(p
            .cp
            .list(&alice, SandboxQuery::all())
            .await
            .unwrap()
            .is_empty());
    }

    // ---- requests refused before any compute --------------------------------

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unknown_class_is_invalid_and_starts_nothing() {
        let p = plane().await;
        let alice = tenant("alice");
        let e =
            p.cp.create(&alice, with_class("gpu-huge"))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        assert!(e.to_string().contains("gpu-huge"), "{e}");
        assert_eq!(p.runtime.create_calls(), 0);
        assert!(p
            .cp
            .list(&alice, SandboxQuery::all())
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unknown_template_is_invalid_and_starts_nothing() {
        let p = plane().await;
        let alice = tenant("alice");
        let req = CreateSandboxRequest {
            template: Some("no-such-template".into()),
            ..Default::default()
        };
        let e = p.cp.create(&alice, req).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        assert!(e.to_string().contains("no-such-template"), "{e}");
        assert_eq!(p.runtime.create_calls(), 0);
        assert!(p
            .cp
            .list(&alice, SandboxQuery::all())
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tenant_without_classes_is_denied_with_an_event() {
        let p = plane_with_tenant(|t| t.allowed_classes = Allowed::Only(vec![])).await;
        let acme = tenant("acme");
        let e =
            p.cp.create(
                &acme.clone().with_request_id("req-deny"),
                CreateSandboxRequest::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code().http_status(), 403);
        assert!(e.to_string().contains("class_not_allowed"), "{e}");
        let denied = the_one_denial(&p, &acme, &e, "class_not_allowed").await;
        assert_eq!(denied["tenant"], "acme");
        assert_eq!(denied["recommended_class"], "python-small");
        let ev = tenant_events(&p, &acme).await;
        assert_eq!(ev[0].request_id.as_deref(), Some("req-deny"));
        assert_eq!(p.runtime.create_calls(), 0);
        assert!(p
            .cp
            .list(&acme, SandboxQuery::all())
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_class_the_tenant_may_not_use_is_substituted_not_granted() {
        let p =
            plane_with_tenant(|t| t.allowed_classes = Allowed::Only(vec!["python-small".into()]))
                .await;
        let acme = tenant("acme");
        let created =
            p.cp.create(&acme, with_class("compute-large"))
                .await
                .unwrap();
        assert_eq!(created.sandbox.resource_class, "python-small");
        assert!(
            created.decision.reason.contains("may not use class"),
            "{}",
            created.decision.reason
        );
        assert_eq!(
            p.runtime.created_specs()[0].resources,
            p.cp.cfg.settings.class("python-small").unwrap().limits()
        );
        let a = &p
            .cp
            .allocations(&acme, AllocationQuery::default())
            .await
            .unwrap()
            .allocations[0];
        assert_eq!(
            (a.recommended_class.as_str(), a.actual_class.as_str()),
            ("compute-large", "python-small")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_network_profile_the_tenant_may_not_use_is_denied_with_an_event() {
        let p =
            plane_with_tenant(|t| t.allowed_network_profiles = Allowed::Only(vec!["none".into()]))
                .await;
        let acme = tenant("acme");
        let req = CreateSandboxRequest {
            network: Some("pypi-readonly".into()),
            ..Default::default()
        };
        let e = p.cp.create(&acme, req).await.unwrap_err();
        the_one_denial(&p, &acme, &e, "network_profile_not_allowed").await;
        assert_eq!(p.runtime.create_calls(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unknown_network_profile_is_denied_with_an_event() {
        let p = plane().await;
        let alice = tenant("alice");
        let req = CreateSandboxRequest {
            network: Some("darknet".into()),
            ..Default::default()
        };
        let e = p.cp.create(&alice, req).await.unwrap_err();
        the_one_denial(&p, &alice, &e, "network_profile_not_allowed").await;
        assert_eq!(p.runtime.create_calls(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_allowed_network_this_node_cannot_give_is_refused_before_compute() {
        let p = plane().await;
        let alice = tenant("alice");
        let req = CreateSandboxRequest {
            network: Some("open".into()),
            ..Default::default()
        };
        let e = p.cp.create(&alice, req).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        assert!(e.to_string().contains("not available on this node"), "{e}");
        // the policy allowed it: no denial is recorded
        assert!(denials(&p, &alice).await.is_empty());
        assert_eq!(p.runtime.create_calls(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_allowlist_profile_reaches_the_runtime_with_its_rules_and_proxy_env() {
        let p = plane().await;
        let alice = tenant("alice");
        let mut env = std::collections::BTreeMap::new();
        // the caller cannot name another profile for later compute
        env.insert("AVIARY_NETWORK_PROFILE".to_owned(), "open".to_owned());
        let req = CreateSandboxRequest {
            network: Some("pypi-readonly".into()),
            env,
            ..Default::default()
        };
        let created = p.cp.create(&alice, req).await.unwrap();
        assert_eq!(
            created.sandbox.network_profile,
            aviary_core::NetworkProfile::Allowlist
        );
        let spec = p.runtime.created_specs().pop().unwrap();
        let egress = spec.egress.expect("allowlist spec without rules");
        assert_eq!(egress.profile, "pypi-readonly");
        let domains: Vec<_> = egress.allow.iter().map(|r| r.domain.as_str()).collect();
        assert_eq!(domains, ["pypi.org", "files.pythonhosted.org"]);
        let rec = p.registry.get_sandbox(&created.sandbox.id).await.unwrap();
        assert_eq!(rec.env["AVIARY_NETWORK_PROFILE"], "pypi-readonly");
        assert_eq!(rec.env["HTTPS_PROXY"], "http://127.0.0.1:3128");
        assert_eq!(rec.env["no_proxy"], "localhost,127.0.0.1");
        // a `none` sandbox gets no rules and no proxy
        let plain =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap();
        let spec = p.runtime.created_specs().pop().unwrap();
        assert_eq!(spec.egress, None);
        let rec = p.registry.get_sandbox(&plain.sandbox.id).await.unwrap();
        assert!(!rec.env.contains_key("HTTP_PROXY"), "{:?}", rec.env);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tenant_over_its_sandbox_quota_is_denied_with_an_event() {
        let p = plane_with_tenant(|t| t.max_sandboxes = 1).await;
        let acme = tenant("acme");
        let first =
            p.cp.create(&acme, CreateSandboxRequest::default())
                .await
                .unwrap();
        let e =
            p.cp.create(&acme, CreateSandboxRequest::default())
                .await
                .unwrap_err();
        the_one_denial(&p, &acme, &e, "over_quota").await;
        assert_eq!(p.runtime.create_calls(), 1);
        // a deleted sandbox no longer counts
        p.cp.delete(&acme, SandboxRef::new(first.sandbox.id.as_str()))
            .await
            .unwrap();
        p.cp.create(&acme, CreateSandboxRequest::default())
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tenant_over_its_cpu_quota_is_denied() {
        let p = plane_with_tenant(|t| t.max_cpu = 1.5).await;
        let acme = tenant("acme");
        let e =
            p.cp.create(&acme, with_class("python-ds"))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Forbidden, "{e}");
        assert_eq!(denials(&p, &acme).await[0]["code"], "over_quota");
        assert_eq!(p.runtime.create_calls(), 0);
        // the class that fits is granted
        p.cp.create(&acme, with_class("python-small"))
            .await
            .unwrap();
    }

    // ---- the runtime's create fails -----------------------------------------

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_runtime_create_leaves_a_terminated_sandbox_and_its_code() {
        let p = plane().await;
        let alice = tenant("alice");
        p.runtime.fail_next_create(RuntimeError::CapacityExhausted {
            what: "uid ranges".into(),
        });
        let e =
            p.cp.create(
                &alice.clone().with_request_id("req-fail"),
                CreateSandboxRequest::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::CapacityExhausted, "{e}");
        assert_eq!(e.code().http_status(), 503);
        assert_eq!(e.code().as_str(), "capacity_exhausted");
        assert_eq!(p.runtime.create_calls(), 1);
        assert!(p.runtime.live_ids().is_empty());
        assert_eq!(p.cp.live_count(), 0);

        let all = p.cp.list(&alice, SandboxQuery::all()).await.unwrap();
        assert_eq!(all.len(), 1);
        let id = all[0].id.clone();
        assert_eq!(all[0].state, SandboxState::Terminated);
        assert!(p
            .cp
            .list(&alice, SandboxQuery::default())
            .await
            .unwrap()
            .is_empty());
        assert_eq!(
            state_path(&p, &id).await,
            [
                SandboxState::Requested,
                SandboxState::Planning,
                SandboxState::Allocating,
                SandboxState::Provisioning,
                SandboxState::Failed,
                SandboxState::Terminated,
            ]
        );
        let failed: Vec<_> = sandbox_events(&p, &alice, &id)
            .await
            .into_iter()
            .filter(|e| e.event_type == "create_failed")
            .collect();
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert_eq!(failed[0].new_state, Some(SandboxState::Failed));
        assert_eq!(failed[0].request_id.as_deref(), Some("req-fail"));
        assert!(
            failed[0].metadata["error"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{:?}",
            failed[0].metadata
        );
        // the failure is not held against the node or the tenant
        p.cp.create(&alice, CreateSandboxRequest::default())
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runtime_failure_keeps_its_layer_code() {
        let p = plane().await;
        let alice = tenant("alice");
        for (err, code) in [
            (
                RuntimeError::ProbeRuntime {
                    reason: "crun is gone".into(),
                },
                ErrorCode::Unavailable,
            ),
            (
                RuntimeError::InvokeRuntime {
                    action: "crun run".into(),
                    detail: "boom at /secret/path".into(),
                },
                ErrorCode::Internal,
            ),
        ] {
            p.runtime.fail_next_create(err);
            let e =
                p.cp.create(&alice, CreateSandboxRequest::default())
                    .await
                    .unwrap_err();
            assert_eq!(e.code(), code, "{e}");
            // 5xx answers never carry internals
            assert!(!e.public_message().contains("/secret/path"), "{e}");
        }
        assert!(p.runtime.live_ids().is_empty());
        assert!(p
            .cp
            .list(&alice, SandboxQuery::default())
            .await
            .unwrap()
            .is_empty());
    }

    // ---- the lease taken with the create --------------------------------------

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_create_with_a_lease_fences_envd_before_it_answers() {
        let p = plane().await;
        let alice = tenant("alice");
        let req = CreateSandboxRequest {
            lease: Some(AcquireLeaseRequest {
                owner: "agent-1".into(),
                ttl_s: Some(120),
            }),
            ..Default::default()
        };
        let created = p.cp.create(&alice, req).await.unwrap();
        let lease = created.lease.clone().unwrap();
        assert_eq!(lease.owner, "agent-1");
        assert_eq!(lease.sandbox_id, created.sandbox.id);
        assert_eq!(created.sandbox.state, SandboxState::Leased);
        let fence = lease.token.fence();
        // envd already holds the fence when the answer arrives
        let envd = envd_of(&p, &created.sandbox.id);
        assert_eq!(envd.fence(), Some(fence));
        assert_eq!(envd.highest_fence(), Some(fence));
        let pushes = logged_calls(&envd, "set_fence").await;
        assert_eq!(pushes.len(), 1, "{pushes:?}");
        assert_eq!(pushes[0].token, Some(fence));
        assert_eq!(pushes[0].result, Ok(()));
        assert_eq!(
            state_path(&p, &created.sandbox.id).await.last(),
            Some(&SandboxState::Leased)
        );
        // and the token is the one that works
        p.cp.delete(
            &holding(&alice, lease.token),
            SandboxRef::new(created.sandbox.id.as_str()),
        )
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_create_without_a_lease_leaves_envd_unfenced() {
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap();
        assert!(created.lease.is_none());
        assert_eq!(created.sandbox.state, SandboxState::Idle);
        let envd = envd_of(&p, &created.sandbox.id);
        assert_eq!(envd.fence(), None);
        assert!(envd.calls().iter().all(|c| c.method != "set_fence"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_invalid_lease_request_starts_nothing() {
        let p = plane().await;
        let alice = tenant("alice");
        for lease in [
            AcquireLeaseRequest {
                owner: String::new(),
                ttl_s: None,
            },
            AcquireLeaseRequest {
                owner: "agent".into(),
                ttl_s: Some(0),
            },
        ] {
            let req = CreateSandboxRequest {
                lease: Some(lease),
                ..Default::default()
            };
            let e = p.cp.create(&alice, req).await.unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        }
        assert_eq!(p.runtime.create_calls(), 0);
    }

    // ---- the state path --------------------------------------------------------

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cold_create_walks_the_design_path() {
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(
                &alice.clone().with_request_id("req-path"),
                CreateSandboxRequest::default(),
            )
            .await
            .unwrap();
        let id = &created.sandbox.id;
        assert_eq!(
            state_path(&p, id).await,
            [
                SandboxState::Requested,
                SandboxState::Planning,
                SandboxState::Allocating,
                SandboxState::Provisioning,
                SandboxState::Locking,
                SandboxState::Idle,
            ]
        );
        assert_eq!(
            (
                created.decision.action.as_str(),
                created.decision.branch.as_str()
            ),
            ("new_sandbox", "D")
        );
        assert!(
            created.decision.reason.starts_with("cold create"),
            "{}",
            created.decision.reason
        );
        // every step carries the request id
        for e in sandbox_events(&p, &alice, id).await {
            assert_eq!(e.request_id.as_deref(), Some("req-path"), "{e:?}");
        }
        // the runtime instance is recorded and the spec names the template
        let rec = {
            use aviary_registry::Registry;
            p.registry.get_sandbox(id).await.unwrap()
        };
        assert_eq!(rec.runtime_instance_id.as_deref(), Some(id.as_str()));
        assert_eq!(p.runtime.created_specs()[0].template.name, "busybox");
    }

    // ---- placement ----------------------------------------------------------------

    /// Room for exactly two python-small sandboxes (1 CPU each).
    fn two_cpu_node() -> aviary_control::ControlConfig {
        let mut cfg = config();
        cfg.local_cpu = 2.0;
        cfg.settings.overcommit.cpu_ratio = 1.0;
        cfg
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn creates_beyond_the_node_capacity_are_refused_before_compute() {
        let p = plane_with(two_cpu_node()).await;
        let alice = tenant("alice");
        let mut ids = Vec::new();
        for _ in 0..2 {
            let c =
                p.cp.create(&alice, CreateSandboxRequest::default())
                    .await
                    .unwrap();
            ids.push(c.sandbox.id);
        }
        let e =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::CapacityExhausted, "{e}");
        assert_eq!(e.retry_after_s(), Some(5));
        assert_eq!(p.runtime.create_calls(), 2);
        // refused before a row was written
        assert_eq!(
            p.cp.list(&alice, SandboxQuery::all()).await.unwrap().len(),
            2
        );
        // a bigger class does not fit either, even alone on a fuller node
        let e =
            p.cp.create(&alice, with_class("python-ds"))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::CapacityExhausted, "{e}");
        // a deleted sandbox frees its room
        p.cp.delete(&alice, SandboxRef::new(ids[0].as_str()))
            .await
            .unwrap();
        p.cp.create(&alice, CreateSandboxRequest::default())
            .await
            .unwrap();
        assert_eq!(p.runtime.create_calls(), 3);
        assert_eq!(p.runtime.live_ids().len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_creates_never_overcommit_the_node() {
        let p = plane_with(two_cpu_node()).await;
        let tasks: Vec<_> = (0..6)
            .map(|i| {
                let cp = p.cp.clone();
                tokio::spawn(async move {
                    cp.create(&tenant(&format!("t{i}")), CreateSandboxRequest::default())
                        .await
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => ok += 1,
                Err(e) => assert_eq!(e.code(), ErrorCode::CapacityExhausted, "{e}"),
            }
        }
        assert_eq!(ok, 2);
        assert_eq!(p.runtime.create_calls(), 2);
        assert_eq!(p.runtime.live_ids().len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_creates_never_exceed_the_tenant_quota() {
        // an empty pool of the default class makes the point a create has
        // passed its quota check observable (its miss is counted)
        let mut cfg = config();
        let mut acme = open_tenant("acme");
        acme.max_sandboxes = 1;
        cfg.settings.tenants.push(acme);
        cfg.settings.pools = vec![pool_settings("python-small", 0, 1)];
        let p = plane_with(cfg).await;
        // placements wait on this lock
        let placing =
            p.cp.locks
                .try_acquire(&aviary_leases::LockRequest::new(
                    aviary_leases::LockName::new("placement", "nodes"),
                    "test",
                    std::time::Duration::from_secs(600),
                ))
                .await
                .unwrap()
                .unwrap();
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let cp = p.cp.clone();
                tokio::spawn(async move {
                    cp.create(&tenant("acme"), CreateSandboxRequest::default())
                        .await
                })
            })
            .collect();
        // the first is past its quota check and the pool (a miss) and waits
        // for the placement; the second waits for the first's quota hold,
        // which ends only once the first's row exists
        while p.cp.pools.pools[0].misses.get() < 1 {
            tokio::task::yield_now().await;
        }
        // give the second every chance to get past its quota check too (it
        // would, and count a second miss, if the check did not wait for the
        // first's row); it must not
        let misses = || p.cp.pools.pools[0].misses.get();
        for _ in 0..10_000 {
            if misses() > 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(
            misses(),
            1,
            "the second create passed its quota check early"
        );
        drop(placing);
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => ok += 1,
                Err(e) => assert_eq!(e.code(), ErrorCode::Forbidden, "{e}"),
            }
        }
        assert_eq!(ok, 1, "a tenant allowed one sandbox got {ok}");
        assert_eq!(
            p.cp.list(&tenant("acme"), SandboxQuery::default())
                .await
                .unwrap()
                .len(),
            1
        );
    }
}
