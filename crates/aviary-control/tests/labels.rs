//! What the compatible surfaces build on, over fakes: labels (`metadata`)
//! kept and filtered, a sandbox's default exec environment under the exec's
//! own, `set_ttl` (bounded, fenced, audited) and per-sandbox access tokens
//! (one sandbox, one tenant, dead with the sandbox).

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{
        parse_label_filter, OnSandbox, SandboxQuery, SandboxRef, SetTtlRequest,
    };
    use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest, ExecRequest};
    use aviary_core::ErrorCode;
    use std::collections::BTreeMap;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn labels_are_kept_and_filter_the_list() {
        let p = plane().await;
        let alice = tenant("alice");
        let a =
            p.cp.create(
                &alice,
                CreateSandboxRequest {
                    metadata: labels(&[("agentscope.workspace.id", "ws-1"), ("team", "red")]),
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .sandbox;
        let b =
            p.cp.create(
                &alice,
                CreateSandboxRequest {
                    metadata: labels(&[("agentscope.workspace.id", "ws-2"), ("team", "red")]),
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .sandbox;
        assert_eq!(a.metadata["agentscope.workspace.id"], "ws-1");
        let got =
            p.cp.get(&alice, SandboxRef::new(a.id.as_str()))
                .await
                .unwrap();
        assert_eq!(got.metadata, a.metadata);

        let list = |m: BTreeMap<String, String>| {
            let cp = p.cp.clone();
            let alice = alice.clone();
            async move {
                let mut ids: Vec<String> = cp
                    .list(
                        &alice,
                        SandboxQuery {
                            metadata: m,
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|s| s.id.to_string())
                    .collect();
                ids.sort();
                ids
            }
        };
        let mut both = vec![a.id.to_string(), b.id.to_string()];
        both.sort();
        assert_eq!(list(labels(&[("team", "red")])).await, both);
        assert_eq!(
            list(labels(&[
                ("team", "red"),
                ("agentscope.workspace.id", "ws-2")
            ]))
            .await,
            vec![b.id.to_string()]
        );
        assert!(list(labels(&[("team", "blue")])).await.is_empty());
        // another tenant's labels never match
        let bob = tenant("bob");
        let bobs =
            p.cp.list(
                &bob,
                SandboxQuery {
                    metadata: labels(&[("team", "red")]),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(bobs.is_empty());
    }

    #[test]
    fn label_filters_parse_as_the_sdks_send_them() {
        assert_eq!(
            parse_label_filter("agentscope.workspace.id=ws%2D1&team=a+b%3Dc").unwrap(),
            labels(&[("agentscope.workspace.id", "ws-1"), ("team", "a b=c")])
        );
        assert!(parse_label_filter("").unwrap().is_empty());
        let e = parse_label_filter("=v").unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
        let e = parse_label_filter("k=%0a").unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_labels_and_env_are_refused_before_anything_is_created() {
        let p = plane().await;
        let alice = tenant("alice");
        for req in [
            CreateSandboxRequest {
                metadata: labels(&[("k", "line\nbreak")]),
                ..Default::default()
            },
            CreateSandboxRequest {
                env: labels(&[("NOT-A-NAME", "x")]),
                ..Default::default()
            },
        ] {
            let e = p.cp.create(&alice, req).await.unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        }
        assert!(p
            .cp
            .list(&alice, SandboxQuery::all())
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_sandbox_env_is_the_default_of_every_exec() {
        let p = plane().await;
        let alice = tenant("alice");
        let s =
            p.cp.create(
                &alice,
                CreateSandboxRequest {
                    env: labels(&[("GREETING", "hello"), ("MODE", "sandbox")]),
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .sandbox;
        let envd = envd_of(&p, &s.id);
        p.cp.exec(
            &alice,
            OnSandbox::new(
                s.id.as_str(),
                ExecRequest {
                    cmd: Some(vec!["env".into()]),
                    env: labels(&[("MODE", "exec")]),
                    ..Default::default()
                },
            ),
        )
        .await
        .unwrap();
        let call = envd.execs().pop().unwrap();
        let env: BTreeMap<_, _> = call.env.into_iter().collect();
        assert_eq!(env["GREETING"], "hello");
        assert_eq!(env["MODE"], "exec", "the exec's own value wins");
        // never shown back
        let shown = serde_json::to_string(&s).unwrap();
        assert!(!shown.contains("GREETING"), "{shown}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn set_ttl_moves_expiry_is_bounded_fenced_and_audited() {
        let p = plane().await;
        let alice = tenant("alice");
        let s =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap()
                .sandbox;
        let before = aviary_core::now();
        let moved =
            p.cp.set_ttl(
                &alice,
                SetTtlRequest {
                    id: s.id.to_string(),
                    ttl_s: 60,
                },
            )
            .await
            .unwrap();
        let expires = moved.expires_at.unwrap();
        assert!(expires >= before + time::Duration::seconds(59), "{expires}");
        assert!(expires <= aviary_core::now() + time::Duration::seconds(61));
        assert!(expires < s.expires_at.unwrap(), "a shorter ttl shortens");
        let events = sandbox_events(&p, &alice, &s.id).await;
        let set = events.iter().find(|e| e.event_type == "ttl_set").unwrap();
        assert_eq!(set.metadata["ttl_s"], 60);

        for ttl_s in [0, u64::MAX] {
            let e =
                p.cp.set_ttl(
                    &alice,
                    SetTtlRequest {
                        id: s.id.to_string(),
                        ttl_s,
                    },
                )
                .await
                .unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");
        }
        // another tenant's sandbox is not found
        let e =
            p.cp.set_ttl(
                &tenant("bob"),
                SetTtlRequest {
                    id: s.id.to_string(),
                    ttl_s: 60,
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);
        // a leased sandbox needs its token
        let lease =
            p.cp.lease_acquire(
                &alice,
                OnSandbox::new(
                    s.id.as_str(),
                    AcquireLeaseRequest {
                        owner: "holder".into(),
                        ttl_s: None,
                    },
                ),
            )
            .await
            .unwrap();
        let req = || SetTtlRequest {
            id: s.id.to_string(),
            ttl_s: 120,
        };
        let e = p.cp.set_ttl(&alice, req()).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::LeaseRequired, "{e}");
        p.cp.set_ttl(&holding(&alice, lease.token), req())
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn access_tokens_open_one_sandbox_of_one_tenant_while_it_lives() {
        let p = plane().await;
        let alice = tenant("alice");
        let create = || async {
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap()
                .sandbox
        };
        let (a, b) = (create().await, create().await);
        let ta =
            p.cp.sandbox_access_token(&alice, a.id.as_str())
                .await
                .unwrap();
        let tb =
            p.cp.sandbox_access_token(&alice, b.id.as_str())
                .await
                .unwrap();
        assert_eq!(ta.len(), 64);
        assert_ne!(ta, tb);
        assert_eq!(
            ta,
            p.cp.sandbox_access_token(&alice, a.id.as_str())
                .await
                .unwrap(),
            "stable"
        );
        let cx =
            p.cp.authenticate_sandbox_token(a.id.as_str(), &ta)
                .await
                .unwrap();
        assert_eq!(cx.caller.tenant, "alice");
        assert!(!cx.caller.admin);
        for wrong in [tb.as_str(), "", "zz", &"0".repeat(64), &ta[..63]] {
            let e =
                p.cp.authenticate_sandbox_token(a.id.as_str(), wrong)
                    .await
                    .unwrap_err();
            assert_eq!(e.code(), ErrorCode::Unauthorized, "{wrong:?}");
        }
        // bob cannot obtain alice's token
        let e =
            p.cp.sandbox_access_token(&tenant("bob"), a.id.as_str())
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);
        // the key is the registry's: a restarted plane checks the same tokens
        let p = restart(p).await;
        p.cp.authenticate_sandbox_token(a.id.as_str(), &ta)
            .await
            .unwrap();
        // an ended sandbox's token opens nothing
        p.cp.delete(&alice, SandboxRef::new(a.id.as_str()))
            .await
            .unwrap();
        let e =
            p.cp.authenticate_sandbox_token(a.id.as_str(), &ta)
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);
        let e =
            p.cp.authenticate_sandbox_token("sbx-nope", &ta)
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);
    }

    /// `all_tenants`: an admin sees every tenant's sandboxes and events; a
    /// tenant asking is `forbidden` before anything is read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn all_tenants_is_for_admins_only() {
        use aviary_control::requests::EventQuery;
        let p = plane().await;
        let (alice, bob) = (tenant("alice"), tenant("bob"));
        let a =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap()
                .sandbox;
        let b =
            p.cp.create(&bob, CreateSandboxRequest::default())
                .await
                .unwrap()
                .sandbox;
        let everyone = SandboxQuery {
            all_tenants: true,
            ..Default::default()
        };
        let refused = p.cp.list(&alice, everyone.clone()).await.unwrap_err();
        assert_eq!(refused.code(), ErrorCode::Forbidden, "{refused}");
        let all_events = EventQuery {
            all_tenants: true,
            limit: Some(1000),
            ..Default::default()
        };
        let refused = p.cp.events(&alice, all_events.clone()).await.unwrap_err();
        assert_eq!(refused.code(), ErrorCode::Forbidden, "{refused}");
        let refused =
            p.cp.events(
                &alice,
                EventQuery {
                    sandbox: Some(b.id.to_string()),
                    ..all_events.clone()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(refused.code(), ErrorCode::Forbidden, "{refused}");

        // the admin: neither by default (its own tenant), both when asked
        let own = p.cp.list(&admin(), SandboxQuery::default()).await.unwrap();
        assert!(own.iter().all(|s| s.id != a.id && s.id != b.id), "{own:?}");
        let all = p.cp.list(&admin(), everyone).await.unwrap();
        for (id, t) in [(&a.id, "alice"), (&b.id, "bob")] {
            assert_eq!(
                all.iter().find(|s| s.id == *id).map(|s| s.tenant.as_str()),
                Some(t)
            );
        }
        let events = p.cp.events(&admin(), all_events.clone()).await.unwrap();
        assert!(events.iter().any(|e| e.tenant == "alice"));
        assert!(events.iter().any(|e| e.tenant == "bob"));
        let of_b =
            p.cp.events(
                &admin(),
                EventQuery {
                    sandbox: Some(b.id.to_string()),
                    ..all_events
                },
            )
            .await
            .unwrap();
        assert!(!of_b.is_empty());
        assert!(of_b.iter().all(|e| e.sandbox_id.as_ref() == Some(&b.id)));
        // without the flag the admin cannot read bob's sandbox's events
        let hidden =
            p.cp.events(
                &admin(),
                EventQuery {
                    sandbox: Some(b.id.to_string()),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(hidden.code(), ErrorCode::NotFound);
    }
}
