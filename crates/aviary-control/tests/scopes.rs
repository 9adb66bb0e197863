//! Isolation scopes and reuse over fakes: which creates get an existing
//! sandbox back (SESSION per session id, USER across a user's sessions),
//! which never do (another tenant, a tainted sandbox), and the decision the
//! create answers with.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{OnSandbox, SandboxRef};
    use aviary_control::OpContext;
    use aviary_core::api::{CreateSandboxRequest, CreateSandboxResponse, ReleaseLeaseRequest};
    use aviary_core::{SandboxState, Scope};
    use aviary_registry::Registry;

    fn session(session_id: &str) -> CreateSandboxRequest {
        CreateSandboxRequest {
            session_id: Some(session_id.into()),
            scope: Some(Scope::Session),
            ..Default::default()
        }
    }

    fn user(user_id: &str, session_id: &str) -> CreateSandboxRequest {
        CreateSandboxRequest {
            user_id: Some(user_id.into()),
            session_id: Some(session_id.into()),
            scope: Some(Scope::User),
            ..Default::default()
        }
    }

    async fn create(
        p: &Plane,
        caller: &OpContext,
        req: CreateSandboxRequest,
    ) -> CreateSandboxResponse {
        p.cp.create(caller, req).await.unwrap()
    }

    /// Gives a shared-scope sandbox back (its create took the scope's lease).
    async fn release(p: &Plane, caller: &OpContext, created: &CreateSandboxResponse) {
        let token = created.lease.as_ref().unwrap().token;
        p.cp.lease_release(
            caller,
            OnSandbox::new(created.sandbox.id.as_str(), ReleaseLeaseRequest { token }),
        )
        .await
        .unwrap();
    }

    fn assert_new(c: &CreateSandboxResponse) {
        assert_eq!(
            (c.decision.action.as_str(), c.decision.branch.as_str()),
            ("new_sandbox", "D"),
            "{:?}",
            c.decision
        );
    }

    fn assert_reused(c: &CreateSandboxResponse) {
        assert_eq!(
            (c.decision.action.as_str(), c.decision.branch.as_str()),
            ("reuse", "A"),
            "{:?}",
            c.decision
        );
        assert!(c.decision.score > 0.0, "{:?}", c.decision);
    }

    /// The `reuse_decision` events of the caller's tenant, as (action, reasons).
    async fn reuse_decisions(p: &Plane, caller: &OpContext) -> Vec<(String, Vec<String>)> {
        tenant_events(p, caller)
            .await
            .into_iter()
            .filter(|e| e.event_type == "reuse_decision")
            .map(|e| {
                let reasons = e.metadata["reasons"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| r.as_str().unwrap().to_owned())
                    .collect();
                (e.metadata["action"].as_str().unwrap().to_owned(), reasons)
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn session_scope_reuses_within_a_session_only() {
        let p = plane().await;
        let alice = tenant("alice");
        let first = create(&p, &alice, session("s1")).await;
        assert_new(&first);
        assert!(
            first.decision.reason.contains("no sandbox in scope"),
            "{}",
            first.decision.reason
        );
        // SESSION is safe by construction: no lease
        assert!(first.lease.is_none());
        assert_eq!(first.sandbox.state, SandboxState::Idle);

        let again = create(&p, &alice, session("s1")).await;
        assert_reused(&again);
        assert_eq!(again.sandbox.id, first.sandbox.id);
        assert!(again.lease.is_none());

        let other = create(&p, &alice, session("s2")).await;
        assert_new(&other);
        assert_ne!(other.sandbox.id, first.sandbox.id);

        assert_eq!(p.runtime.create_calls(), 2);
        let restored: Vec<_> = sandbox_events(&p, &alice, &first.sandbox.id)
            .await
            .into_iter()
            .filter(|e| e.event_type == "restore_branch")
            .collect();
        assert_eq!(restored.len(), 1, "{restored:?}");
        assert_eq!(restored[0].metadata["branch"], "A");
        assert_eq!(reuse_decisions(&p, &alice).await[0].0, "reuse");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn user_scope_shares_one_sandbox_across_the_users_sessions() {
        let p = plane().await;
        let alice = tenant("alice");
        let first = create(&p, &alice, user("u1", "s1")).await;
        assert_new(&first);
        // a shared scope hands its sandbox out under the scope's lease
        let lease = first.lease.clone().unwrap();
        assert!(lease.owner.starts_with("scope:"), "{}", lease.owner);
        assert_eq!(first.sandbox.state, SandboxState::Leased);
        release(&p, &alice, &first).await;

        let second = create(&p, &alice, user("u1", "s2")).await;
        assert_reused(&second);
        assert_eq!(second.sandbox.id, first.sandbox.id);
        let second_lease = second.lease.clone().unwrap();
        assert!(second_lease.token.fence() > lease.token.fence());
        assert_eq!(
            envd_of(&p, &second.sandbox.id).fence(),
            Some(second_lease.token.fence())
        );
        release(&p, &alice, &second).await;

        let bob_user = create(&p, &alice, user("u2", "s1")).await;
        assert_new(&bob_user);
        assert_ne!(bob_user.sandbox.id, first.sandbox.id);
        assert_eq!(p.runtime.create_calls(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn user_scope_without_a_user_falls_back_to_the_session() {
        let p = plane().await;
        let alice = tenant("alice");
        let req = |s: &str| CreateSandboxRequest {
            session_id: Some(s.into()),
            scope: Some(Scope::User),
            ..Default::default()
        };
        let first = create(&p, &alice, req("s1")).await;
        assert_eq!(first.sandbox.scope, Scope::Session);
        assert!(first.lease.is_none());
        let again = create(&p, &alice, req("s1")).await;
        assert_reused(&again);
        assert_eq!(again.sandbox.id, first.sandbox.id);
        let other = create(&p, &alice, req("s2")).await;
        assert_ne!(other.sandbox.id, first.sandbox.id);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_tenant_never_gets_the_sandbox_of_the_same_ids() {
        let p = plane().await;
        let alice = tenant("alice");
        let bob = tenant("bob");
        let a_session = create(&p, &alice, session("s1")).await;
        let a_user = create(&p, &alice, user("u1", "s9")).await;
        release(&p, &alice, &a_user).await;

        let b_session = create(&p, &bob, session("s1")).await;
        assert_new(&b_session);
        assert_eq!(b_session.sandbox.tenant, "bob");
        let b_user = create(&p, &bob, user("u1", "s9")).await;
        assert_new(&b_user);
        assert_eq!(b_user.sandbox.tenant, "bob");
        for b in [&b_session, &b_user] {
            assert_ne!(b.sandbox.id, a_session.sandbox.id);
            assert_ne!(b.sandbox.id, a_user.sandbox.id);
        }
        // bob's creates never even looked at alice's sandboxes
        assert!(reuse_decisions(&p, &bob).await.is_empty());
        // and alice still gets hers back
        let again = create(&p, &alice, session("s1")).await;
        assert_eq!(again.sandbox.id, a_session.sandbox.id);
        assert_eq!(p.runtime.create_calls(), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tainted_sandbox_is_never_reused() {
        let p = plane().await;
        let alice = tenant("alice");
        let first = create(&p, &alice, session("s1")).await;
        let id = first.sandbox.id.clone();
        let rec = p.registry.get_sandbox(&id).await.unwrap();
        p.registry
            .set_tainted(&id, rec.version, true)
            .await
            .unwrap();

        let next = create(&p, &alice, session("s1")).await;
        assert_new(&next);
        assert_ne!(next.sandbox.id, id);
        assert!(
            next.decision.reason.contains(id.as_str()) && next.decision.reason.contains("tainted"),
            "{}",
            next.decision.reason
        );
        assert_eq!(next.decision.score, 0.0);
        let decisions = reuse_decisions(&p, &alice).await;
        assert_eq!(decisions.len(), 1, "{decisions:?}");
        assert_eq!(decisions[0].0, "new_sandbox");
        assert!(
            decisions[0].1.iter().any(|r| r == "tainted"),
            "{decisions:?}"
        );
        assert_eq!(p.runtime.create_calls(), 2);

        // the new one is reused from then on
        let third = create(&p, &alice, session("s1")).await;
        assert_reused(&third);
        assert_eq!(third.sandbox.id, next.sandbox.id);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deleted_sandbox_is_not_reused() {
        let p = plane().await;
        let alice = tenant("alice");
        let first = create(&p, &alice, session("s1")).await;
        p.cp.delete(&alice, SandboxRef::new(first.sandbox.id.as_str()))
            .await
            .unwrap();
        let next = create(&p, &alice, session("s1")).await;
        assert_new(&next);
        assert_ne!(next.sandbox.id, first.sandbox.id);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_different_class_in_the_same_session_is_a_new_sandbox() {
        let p = plane().await;
        let alice = tenant("alice");
        let first = create(&p, &alice, session("s1")).await;
        let mut req = session("s1");
        req.class = Some("python-ds".into());
        let next = create(&p, &alice, req).await;
        assert_new(&next);
        assert_ne!(next.sandbox.id, first.sandbox.id);
        assert_eq!(next.sandbox.resource_class, "python-ds");
        assert!(
            next.decision.reason.contains("rejected"),
            "{}",
            next.decision.reason
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_creates_of_one_session_share_one_sandbox() {
        let p = plane().await;
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let cp = p.cp.clone();
                tokio::spawn(async move { cp.create(&tenant("alice"), session("s1")).await })
            })
            .collect();
        let mut ids = Vec::new();
        for t in tasks {
            ids.push(t.await.unwrap().unwrap().sandbox.id);
        }
        ids.dedup();
        assert_eq!(ids.len(), 1, "{ids:?}");
        assert_eq!(p.runtime.create_calls(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reusing_a_sandbox_does_not_count_against_the_quota() {
        let mut cfg = config();
        let mut acme = open_tenant("acme");
        acme.max_sandboxes = 1;
        cfg.settings.tenants.push(acme);
        let p = plane_with(cfg).await;
        let acme = tenant("acme");
        let first = create(&p, &acme, session("s1")).await;
        // the tenant's one sandbox is handed back: no new sandbox is made
        let again = p.cp.create(&acme, session("s1")).await.unwrap();
        assert_reused(&again);
        assert_eq!(again.sandbox.id, first.sandbox.id);
        // a second session would be a second sandbox: over the quota
        let e = p.cp.create(&acme, session("s2")).await.unwrap_err();
        assert_eq!(e.code(), aviary_core::ErrorCode::Forbidden, "{e}");
    }
}
