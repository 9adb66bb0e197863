//! Warm pools over fakes: refills start `Ready` sandboxes up to the bounds,
//! a matching create claims one without starting compute, hand-outs are
//! counted until their sandbox ends, and one pooled sandbox is never handed
//! to two creates.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::pools::{PoolView, SetPoolRequest};
    use aviary_control::requests::{
        AllocationQuery, OnSandbox, PoolUpdate, SandboxQuery, SandboxRef,
    };
    use aviary_core::api::{CreateSandboxRequest, ExecRequest};
    use aviary_core::{ErrorCode, SandboxState};
    use aviary_registry::{Registry, POOL_TENANT};

    /// A plane with one python-small pool on the test template.
    async fn pooled_plane(pool_min: u32, pool_max: u32) -> Plane {
        let mut cfg = config();
        cfg.settings.pools = vec![pool_settings("python-small", pool_min, pool_max)];
        plane_with(cfg).await
    }

    async fn view(p: &Plane) -> PoolView {
        let mut pools = p.cp.pools_view(&admin()).await.unwrap().pools;
        assert_eq!(pools.len(), 1);
        pools.remove(0)
    }

    fn is_hit(c: &aviary_core::api::CreateSandboxResponse) -> bool {
        c.decision.reason.starts_with("warm pool hit")
    }

    async fn pooled_rows(p: &Plane) -> Vec<aviary_registry::SandboxRecord> {
        p.registry
            .list_sandboxes(Some(POOL_TENANT), false)
            .await
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refill_starts_ready_sandboxes_up_to_pool_min() {
        let p = pooled_plane(3, 5).await;
        assert_eq!(p.cp.refill_pools().await.unwrap(), 3);
        assert_eq!(p.runtime.create_calls(), 3);
        let rows = pooled_rows(&p).await;
        assert_eq!(rows.len(), 3);
        for r in &rows {
            assert_eq!(r.state, SandboxState::Ready);
            assert_eq!(r.resource_class, "python-small");
            assert_eq!(r.template, "busybox");
            assert_eq!(
                state_path(&p, &r.id).await,
                [
                    SandboxState::Requested,
                    SandboxState::Planning,
                    SandboxState::Allocating,
                    SandboxState::Provisioning,
                    SandboxState::Ready,
                ]
            );
        }
        let v = view(&p).await;
        assert_eq!((v.idle, v.handed_out, v.hits, v.misses), (3, 0, 0, 0));
        // a full pool starts nothing more
        assert_eq!(p.cp.refill_pools().await.unwrap(), 0);
        assert_eq!(p.runtime.create_calls(), 3);
        // pooled sandboxes belong to no tenant
        assert!(p
            .cp
            .list(&tenant("alice"), SandboxQuery::all())
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_matching_create_claims_a_warm_sandbox_without_new_compute() {
        let p = pooled_plane(1, 2).await;
        p.cp.refill_pools().await.unwrap();
        let warm = pooled_rows(&p).await[0].id.clone();
        let creates = p.runtime.create_calls();

        let alice = tenant("alice");
        let c =
            p.cp.create(
                &alice.clone().with_request_id("req-hit"),
                CreateSandboxRequest::default(),
            )
            .await
            .unwrap();
        assert!(is_hit(&c), "{:?}", c.decision);
        assert_eq!(c.sandbox.id, warm);
        assert_eq!(c.sandbox.tenant, "alice");
        assert_eq!(c.sandbox.state, SandboxState::Idle);
        assert_eq!(p.runtime.create_calls(), creates);
        assert_eq!(
            state_path(&p, &warm).await[4..],
            [
                SandboxState::Ready,
                SandboxState::Locking,
                SandboxState::Idle
            ]
        );
        let claimed: Vec<_> = sandbox_events(&p, &alice, &warm)
            .await
            .into_iter()
            .filter(|e| e.event_type == "pool_claimed")
            .collect();
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].request_id.as_deref(), Some("req-hit"));
        // the claim's allocation row names the sandbox
        let a = &p
            .cp
            .allocations(&alice, AllocationQuery::default())
            .await
            .unwrap()
            .allocations[0];
        assert_eq!(a.sandbox_id.as_deref(), Some(warm.as_str()));

        let v = view(&p).await;
        assert_eq!((v.idle, v.handed_out, v.hits, v.misses), (0, 1, 1, 0));
        // the sandbox works
        let out =
            p.cp.exec(
                &alice,
                OnSandbox::new(
                    warm.as_str(),
                    ExecRequest {
                        cmd: Some(vec!["echo".into(), "warm".into()]),
                        ..Default::default()
                    },
                ),
            )
            .await
            .unwrap();
        assert_eq!(out.stdout, "warm\n");

        p.cp.delete(&alice, SandboxRef::new(warm.as_str()))
            .await
            .unwrap();
        let v = view(&p).await;
        assert_eq!((v.idle, v.handed_out), (0, 0));
        // and the pool fills again
        assert_eq!(p.cp.refill_pools().await.unwrap(), 1);
        assert_eq!(view(&p).await.idle, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_empty_pool_is_a_miss_and_a_cold_create() {
        let p = pooled_plane(1, 2).await;
        let alice = tenant("alice");
        let c =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap();
        assert!(!is_hit(&c), "{:?}", c.decision);
        assert!(
            c.decision.reason.starts_with("cold create"),
            "{:?}",
            c.decision
        );
        assert_eq!(p.runtime.create_calls(), 1);
        let v = view(&p).await;
        assert_eq!((v.hits, v.misses, v.handed_out), (0, 1, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_create_the_pool_does_not_match_is_not_served_from_it() {
        let p = pooled_plane(1, 2).await;
        p.cp.refill_pools().await.unwrap();
        let alice = tenant("alice");
        let c =
            p.cp.create(
                &alice,
                CreateSandboxRequest {
                    class: Some("python-ds".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(!is_hit(&c), "{:?}", c.decision);
        assert_eq!(p.runtime.create_calls(), 2);
        let v = view(&p).await;
        assert_eq!((v.idle, v.hits, v.misses), (1, 0, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_scoped_create_claims_from_the_pool_and_is_reused_after() {
        let p = pooled_plane(1, 2).await;
        p.cp.refill_pools().await.unwrap();
        let alice = tenant("alice");
        let req = || CreateSandboxRequest {
            session_id: Some("s1".into()),
            scope: Some(aviary_core::Scope::Session),
            ..Default::default()
        };
        let first = p.cp.create(&alice, req()).await.unwrap();
        assert!(is_hit(&first), "{:?}", first.decision);
        assert_eq!(first.sandbox.session_id.as_deref(), Some("s1"));
        let again = p.cp.create(&alice, req()).await.unwrap();
        assert_eq!(again.decision.action, "reuse");
        assert_eq!(again.sandbox.id, first.sandbox.id);
        assert_eq!(view(&p).await.hits, 1);
        assert_eq!(p.runtime.create_calls(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fifty_cycles_with_refills_are_all_hits() {
        let p = pooled_plane(2, 4).await;
        let alice = tenant("alice");
        assert_eq!(p.cp.refill_pools().await.unwrap(), 2);
        let mut seen = std::collections::HashSet::new();
        for i in 0..50 {
            let before = p.runtime.create_calls();
            let c =
                p.cp.create(&alice, CreateSandboxRequest::default())
                    .await
                    .unwrap();
            assert!(is_hit(&c), "cycle {i}: {:?}", c.decision);
            assert_eq!(p.runtime.create_calls(), before, "cycle {i}");
            assert!(
                seen.insert(c.sandbox.id.clone()),
                "cycle {i}: handed out twice"
            );
            let out =
                p.cp.exec(
                    &alice,
                    OnSandbox::new(
                        c.sandbox.id.as_str(),
                        ExecRequest {
                            cmd: Some(vec!["echo".into(), format!("{i}")]),
                            ..Default::default()
                        },
                    ),
                )
                .await
                .unwrap();
            assert_eq!(out.stdout, format!("{i}\n"));
            p.cp.delete(&alice, SandboxRef::new(c.sandbox.id.as_str()))
                .await
                .unwrap();
            assert_eq!(view(&p).await.handed_out, 0, "cycle {i}");
            assert_eq!(p.cp.refill_pools().await.unwrap(), 1, "cycle {i}");
        }
        let v = view(&p).await;
        assert_eq!(
            (v.hits, v.misses, v.handed_out, v.idle),
            (50, 0, 0, 2),
            "{v:?}"
        );
        assert_eq!(p.runtime.create_calls(), 52);
        assert_eq!(p.runtime.live_ids().len(), 2);
        assert!(p
            .cp
            .list(&alice, SandboxQuery::default())
            .await
            .unwrap()
            .is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_pooled_sandbox_is_never_handed_to_two_creates() {
        let p = pooled_plane(1, 1).await;
        let alice = tenant("alice");
        for round in 0..20 {
            assert_eq!(p.cp.refill_pools().await.unwrap(), 1, "round {round}");
            let warm = pooled_rows(&p).await[0].id.clone();
            let start = std::sync::Arc::new(tokio::sync::Barrier::new(2));
            let tasks: Vec<_> = (0..2)
                .map(|_| {
                    let cp = p.cp.clone();
                    let start = start.clone();
                    tokio::spawn(async move {
                        start.wait().await;
                        cp.create(&tenant("alice"), CreateSandboxRequest::default())
                            .await
                    })
                })
                .collect();
            let mut got = Vec::new();
            for t in tasks {
                got.push(t.await.unwrap().unwrap());
            }
            let hits: Vec<_> = got.iter().filter(|c| is_hit(c)).collect();
            assert_eq!(hits.len(), 1, "round {round}: {got:?}");
            assert_eq!(hits[0].sandbox.id, warm);
            assert_ne!(got[0].sandbox.id, got[1].sandbox.id, "round {round}");
            for c in &got {
                p.cp.delete(&alice, SandboxRef::new(c.sandbox.id.as_str()))
                    .await
                    .unwrap();
            }
        }
        let v = view(&p).await;
        assert_eq!((v.hits, v.misses, v.handed_out), (20, 20, 0), "{v:?}");
        // one refill and one cold create per round
        assert_eq!(p.runtime.create_calls(), 40);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pool_set_changes_the_bounds_refills_follow() {
        let p = pooled_plane(1, 2).await;
        let e =
            p.cp.set_pool(
                &tenant("alice"),
                PoolUpdate {
                    class: "python-small".into(),
                    bounds: SetPoolRequest { min: 3, max: 4 },
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Forbidden, "{e}");
        let e =
            p.cp.set_pool(
                &admin(),
                PoolUpdate {
                    class: "compute-large".into(),
                    bounds: SetPoolRequest { min: 1, max: 1 },
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound, "{e}");
        let e =
            p.cp.set_pool(
                &admin(),
                PoolUpdate {
                    class: "python-small".into(),
                    bounds: SetPoolRequest { min: 3, max: 2 },
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e}");

        let list =
            p.cp.set_pool(
                &admin(),
                PoolUpdate {
                    class: "python-small".into(),
                    bounds: SetPoolRequest { min: 3, max: 4 },
                },
            )
            .await
            .unwrap();
        assert_eq!((list.pools[0].pool_min, list.pools[0].pool_max), (3, 4));
        assert_eq!(p.cp.refill_pools().await.unwrap(), 3);
        assert_eq!(view(&p).await.idle, 3);
        // lowering the bounds trims idle sandboxes above them
        p.cp.set_pool(
            &admin(),
            PoolUpdate {
                class: "python-small".into(),
                bounds: SetPoolRequest { min: 1, max: 1 },
            },
        )
        .await
        .unwrap();
        assert_eq!(p.cp.refill_pools().await.unwrap(), 0);
        assert_eq!(view(&p).await.idle, 1);
        p.cp.reclaims.settled().await;
        assert_eq!(p.runtime.live_ids().len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refills_stop_at_the_node_capacity() {
        let mut cfg = config();
        cfg.settings.pools = vec![pool_settings("python-small", 4, 4)];
        cfg.local_cpu = 2.0;
        cfg.settings.overcommit.cpu_ratio = 1.0;
        let p = plane_with(cfg).await;
        // a full node is not a refill failure: the pool waits for room
        assert_eq!(p.cp.refill_pools().await.unwrap(), 2);
        assert_eq!(p.runtime.create_calls(), 2);
        assert_eq!(view(&p).await.idle, 2);
        // warm sandboxes are committed: a cold create finds no room
        let e =
            p.cp.create(
                &tenant("alice"),
                CreateSandboxRequest {
                    class: Some("python-ds".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::CapacityExhausted, "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_refill_leaves_nothing_behind() {
        let p = pooled_plane(2, 2).await;
        p.runtime
            .fail_next_create(aviary_runtime::RuntimeError::InvokeRuntime {
                action: "crun run".into(),
                detail: "boom".into(),
            });
        let e = p.cp.refill_pools().await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::Internal, "{e}");
        assert!(p.runtime.live_ids().is_empty());
        let v = view(&p).await;
        assert_eq!((v.idle, v.handed_out), (0, 0));
        // the next pass fills the pool
        assert_eq!(p.cp.refill_pools().await.unwrap(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pool_hit_with_a_lease_fences_envd_before_it_answers() {
        let p = pooled_plane(1, 1).await;
        p.cp.refill_pools().await.unwrap();
        let warm = pooled_rows(&p).await[0].id.clone();
        let c =
            p.cp.create(
                &tenant("alice"),
                CreateSandboxRequest {
                    lease: Some(aviary_core::api::AcquireLeaseRequest {
                        owner: "agent-1".into(),
                        ttl_s: None,
                    }),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(is_hit(&c), "{:?}", c.decision);
        assert_eq!(c.sandbox.state, SandboxState::Leased);
        let fence = c.lease.unwrap().token.fence();
        let envd = envd_of(&p, &warm);
        assert_eq!(envd.fence(), Some(fence));
        let pushes = logged_calls(&envd, "set_fence").await;
        assert_eq!(pushes.last().unwrap().token, Some(fence), "{pushes:?}");
        assert_eq!(pushes.last().unwrap().result, Ok(()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pool_hit_gets_the_requested_ttl() {
        let p = pooled_plane(1, 1).await;
        p.cp.refill_pools().await.unwrap();
        assert_eq!(pooled_rows(&p).await[0].expires_at, None);
        let before = aviary_core::now();
        let c =
            p.cp.create(
                &tenant("alice"),
                CreateSandboxRequest {
                    ttl_s: Some(600),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(is_hit(&c), "{:?}", c.decision);
        let expires = c.sandbox.expires_at.unwrap();
        assert!(
            expires >= before + time::Duration::seconds(600),
            "{expires}"
        );
        assert!(
            expires <= aviary_core::now() + time::Duration::seconds(600),
            "{expires}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_user_managed_create_stays_user_managed_on_a_pool_hit() {
        let p = pooled_plane(1, 1).await;
        p.cp.refill_pools().await.unwrap();
        let c =
            p.cp.create(
                &tenant("alice"),
                CreateSandboxRequest {
                    user_managed: true,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        // served from the pool or not, the sandbox is the user's to keep
        assert!(c.sandbox.user_managed, "{:?}", c.decision);
        let rec = p.registry.get_sandbox(&c.sandbox.id).await.unwrap();
        assert!(rec.user_managed);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pooled_sandbox_whose_compute_vanished_is_not_handed_out() {
        let p = pooled_plane(1, 1).await;
        p.cp.refill_pools().await.unwrap();
        let warm = pooled_rows(&p).await[0].id.clone();
        assert!(p.runtime.vanish(&warm).await);
        let alice = tenant("alice");
        let c =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap();
        assert_ne!(c.sandbox.id, warm, "{:?}", c.decision);
        p.cp.exec(
            &alice,
            OnSandbox::new(
                c.sandbox.id.as_str(),
                ExecRequest {
                    cmd: Some(vec!["true".into()]),
                    ..Default::default()
                },
            ),
        )
        .await
        .unwrap();
    }

    /// A replica that runs no sandboxes keeps warm pools on the agents it
    /// drives (refilled only by a pass over the agents: the leader's), and
    /// a create is handed one of those, which works through the agent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pools_live_on_node_agents_for_a_stateless_replica() {
        use aviary_control::nodes::AddNodeRequest;
        use aviary_control::Reconciling;
        use std::sync::Arc;
        let mut cfg = config();
        cfg.runs_sandboxes = false;
        cfg.local_node = "replica-1".into();
        cfg.settings.pools = vec![pool_settings("python-small", 1, 4)];
        let nodes = Arc::new(FakeNodes::default());
        let agent = Arc::new(aviary_fakes::FakeRuntime::new().unwrap());
        nodes.add("agent-1", "127.0.0.1:7401", agent.clone());
        let p = plane_full(
            cfg,
            aviary_registry::MemoryRegistry::new(),
            Arc::new(aviary_fakes::FakeRuntime::new().unwrap()),
            nodes,
            Arc::new(aviary_snapshots::MemoryStore::new()),
        )
        .await;
        p.cp.add_node(
            &admin(),
            AddNodeRequest {
                id: "agent-1".into(),
                address: "127.0.0.1:7401".into(),
                token: "agent-token".into(),
            },
        )
        .await
        .unwrap();
        // a non-leader's pass keeps only its own node's pools: it has none
        assert_eq!(p.cp.refill_pools_as(Reconciling::OwnNode).await.unwrap(), 0);
        assert_eq!(
            p.cp.refill_pools_as(Reconciling::OwnNodeAndAgents)
                .await
                .unwrap(),
            1
        );
        assert_eq!(agent.create_calls(), 1);
        assert_eq!(p.runtime.create_calls(), 0, "nothing on the replica");
        let rows = pooled_rows(&p).await;
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].node, "agent-1");

        let alice = tenant("alice");
        let c =
            p.cp.create(&alice, CreateSandboxRequest::default())
                .await
                .unwrap();
        assert!(is_hit(&c), "{}", c.decision.reason);
        assert_eq!(c.sandbox.node, "agent-1");
        assert_eq!(agent.create_calls(), 1, "a hit starts no compute");
        p.cp.exec(
            &alice,
            OnSandbox::new(
                c.sandbox.id.as_str(),
                ExecRequest {
                    shell: Some("echo hi".into()),
                    ..Default::default()
                },
            ),
        )
        .await
        .unwrap();
        let v = view(&p).await;
        assert_eq!((v.idle, v.handed_out, v.hits), (0, 1, 1));
        // pool_min counts hand-outs: with one out, none is to start
        assert_eq!(
            p.cp.refill_pools_as(Reconciling::OwnNodeAndAgents)
                .await
                .unwrap(),
            0
        );
        p.cp.delete(&alice, SandboxRef::new(c.sandbox.id.as_str()))
            .await
            .unwrap();
        assert_eq!(
            p.cp.refill_pools_as(Reconciling::OwnNodeAndAgents)
                .await
                .unwrap(),
            1,
            "refilled once the hand-out ended"
        );
        assert_eq!(agent.create_calls(), 2);
    }
}
