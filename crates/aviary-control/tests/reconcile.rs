//! The reconciler's start-up decisions: a second control plane over the
//! same registry and the same fake runtime stands for a restarted server.
//! Running sandboxes are re-attached with their fence pushed again; rows
//! whose compute is gone or stopped end `Terminated` via `Lost` (or `Failed`
//! for half-created ones); runtime sandboxes the registry does not know are
//! destroyed; one sandbox that cannot be brought back is marked lost and
//! never holds up the others.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{OnSandbox, SandboxRef};
    use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest, ExecRequest, Lease};
    use aviary_core::{ErrorCode, SandboxId, SandboxState};
    use aviary_leases::LeaseStore;
    use aviary_registry::{NewSandbox, Registry, TransitionCtx};
    use aviary_runtime::{Pausable, Runtime, RuntimeStatus, SandboxSpec};

    /// `echo hi`; the lease token it runs under is the context's.
    fn echo() -> ExecRequest {
        ExecRequest {
            cmd: Some(vec!["echo".into(), "hi".into()]),
            ..Default::default()
        }
    }

    async fn create(p: &Plane) -> SandboxId {
        p.cp.create(&tenant("alice"), CreateSandboxRequest::default())
            .await
            .unwrap()
            .sandbox
            .id
    }

    async fn acquire(p: &Plane, id: &SandboxId) -> Lease {
        p.cp.lease_acquire(
            &tenant("alice"),
            OnSandbox::new(
                id.as_str(),
                AcquireLeaseRequest {
                    owner: "agent-1".into(),
                    ttl_s: Some(3600),
                },
            ),
        )
        .await
        .unwrap()
    }

    async fn state(p: &Plane, id: &SandboxId) -> SandboxState {
        p.registry.get_sandbox(id).await.unwrap().state
    }

    /// `(event type, old state, new state)` of a sandbox's events after
    /// `skip` of them.
    async fn events_after(
        p: &Plane,
        id: &SandboxId,
        skip: usize,
    ) -> Vec<(String, Option<SandboxState>, Option<SandboxState>)> {
        sandbox_events(p, &tenant("alice"), id)
            .await
            .into_iter()
            .skip(skip)
            .map(|e| (e.event_type, e.old_state, e.new_state))
            .collect()
    }

    fn step(
        event: &str,
        from: SandboxState,
        to: SandboxState,
    ) -> (String, Option<SandboxState>, Option<SandboxState>) {
        (event.to_owned(), Some(from), Some(to))
    }

    /// A spec like the control plane's own, for a sandbox made behind its back.
    fn spec_for(p: &Plane, id: SandboxId) -> SandboxSpec {
        SandboxSpec {
            id,
            ..p.runtime.created_specs()[0].clone()
        }
    }

    /// A registry row copied from `like` (fields the control plane wrote),
    /// with another id and `runtime`, walked to `to` through `path`.
    async fn insert_row(
        p: &Plane,
        like: &SandboxId,
        runtime: &str,
        path: &[SandboxState],
    ) -> SandboxId {
        let rec = p.registry.get_sandbox(like).await.unwrap();
        let id = SandboxId::generate();
        let new = NewSandbox {
            id: id.clone(),
            tenant: rec.tenant,
            user_id: None,
            session_id: None,
            agent: None,
            scope: rec.scope,
            resource_class: rec.resource_class,
            resources: rec.resources,
            template: rec.template,
            template_digest: rec.template_digest,
            runtime: runtime.to_owned(),
            runtime_instance_id: None,
            node: rec.node,
            network_profile: rec.network_profile,
            expires_at: rec.expires_at,
            tainted: false,
            user_managed: false,
        };
        let ctx = || TransitionCtx {
            request_id: None,
            event_type: None,
            metadata: serde_json::json!({}),
        };
        let row = p.registry.insert_sandbox(&new, ctx()).await.unwrap();
        p.registry
            .transition(
                &id,
                row.version,
                path,
                aviary_registry::FenceCheck::Skip,
                ctx(),
            )
            .await
            .unwrap();
        id
    }

    const TO_IDLE: [SandboxState; 5] = [
        SandboxState::Planning,
        SandboxState::Allocating,
        SandboxState::Provisioning,
        SandboxState::Locking,
        SandboxState::Idle,
    ];

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_running_sandbox_is_reattached_with_its_fence_pushed_again() {
        let p = plane().await;
        let alice = tenant("alice");
        let leased = create(&p).await;
        let idle = create(&p).await;
        let lease = acquire(&p, &leased).await;
        let (leased_envd, idle_envd) = (envd_of(&p, &leased), envd_of(&p, &idle));
        leased_envd
            .put_file("/workspace/work", "in progress")
            .unwrap();
        let sweeps = leased_envd.sweeps();
        leased_envd.clear_calls();
        idle_envd.clear_calls();
        let skip = sandbox_events(&p, &alice, &leased).await.len();

        let p = restart(p).await;

        assert_eq!(p.cp.live_count(), 2);
        assert_eq!(state(&p, &leased).await, SandboxState::Leased);
        assert_eq!(state(&p, &idle).await, SandboxState::Idle);
        assert_eq!(events_after(&p, &leased, skip).await, []);
        let calls = calls_until(&leased_envd, |c| c.iter().any(|c| c.method == "set_fence")).await;
        let push = calls.iter().find(|c| c.method == "set_fence").unwrap();
        assert_eq!(push.token, Some(lease.token.fence()));
        assert_eq!(push.result, Ok(()));
        assert_eq!(
            leased_envd.sweeps(),
            sweeps,
            "the same fence again: the holder's processes keep running"
        );
        let calls = calls_until(&idle_envd, |c| c.iter().any(|c| c.method == "set_fence")).await;
        let push = calls.iter().find(|c| c.method == "set_fence").unwrap();
        assert_eq!(push.token, None);

        // the old token still works; the work survived; the lease is intact
        let out =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(leased.as_str(), echo()),
            )
            .await
            .unwrap();
        assert_eq!(out.stdout, "hi\n");
        assert_eq!(
            leased_envd.file("/workspace/work"),
            Some(b"in progress".to_vec())
        );
        let e =
            p.cp.exec(&alice, OnSandbox::new(leased.as_str(), echo()))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::LeaseRequired, "{e}");
        p.cp.exec(&alice, OnSandbox::new(idle.as_str(), echo()))
            .await
            .unwrap();
        assert_eq!(
            p.cp.get(&alice, SandboxRef::new(leased.as_str()))
                .await
                .unwrap()
                .lease_owner
                .as_deref(),
            Some("agent-1")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sandbox_the_runtime_lost_becomes_lost_then_terminated() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = create(&p).await;
        let lease = acquire(&p, &id).await;
        let skip = sandbox_events(&p, &alice, &id).await.len();
        assert!(p.runtime.vanish(&id).await);

        let p = restart(p).await;

        assert_eq!(state(&p, &id).await, SandboxState::Terminated);
        assert_eq!(
            events_after(&p, &id, skip).await,
            [
                step("reconciled", SandboxState::Leased, SandboxState::Lost),
                step("reconciled", SandboxState::Lost, SandboxState::Terminated),
            ]
        );
        let events = sandbox_events(&p, &alice, &id).await;
        assert_eq!(
            events.last().unwrap().metadata["reason"],
            "runtime has no such sandbox after restart"
        );
        assert_eq!(p.cp.live_count(), 0);
        assert_eq!(
            p.registry.current(&id, aviary_core::now()).await.unwrap(),
            None,
            "its lease is revoked"
        );
        let e =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runtime_sandbox_the_registry_does_not_know_is_destroyed() {
        let p = plane().await;
        let known = create(&p).await;
        let stray = SandboxId::generate();
        p.runtime
            .create(&spec_for(&p, stray.clone()))
            .await
            .unwrap();
        let stray_envd = envd_of(&p, &stray);
        let mut live = p.runtime.live_ids();
        live.sort();
        let mut both = vec![known.clone(), stray.clone()];
        both.sort();
        assert_eq!(live, both);

        let p = restart(p).await;

        assert_eq!(p.runtime.live_ids(), vec![known.clone()]);
        assert!(stray_envd.is_dead());
        assert!(matches!(
            p.registry.get_sandbox(&stray).await.unwrap_err(),
            aviary_registry::RegistryError::NotFound
        ));
        assert_eq!(state(&p, &known).await, SandboxState::Idle);
        p.cp.exec(&tenant("alice"), OnSandbox::new(known.as_str(), echo()))
            .await
            .unwrap();
    }

    /// Pins what the reconciler does with compute whose PID 1 exited (runtime
    /// status `Stopped`): like a lost one, it is destroyed and the row goes
    /// `Lost → Terminated`; nothing restarts it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crashed_sandbox_is_destroyed_and_terminated() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = create(&p).await;
        acquire(&p, &id).await;
        let skip = sandbox_events(&p, &alice, &id).await.len();
        assert!(p.runtime.crash(&id).await);
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Stopped);
        let destroys = p.runtime.destroy_calls();

        let p = restart(p).await;

        assert_eq!(state(&p, &id).await, SandboxState::Terminated);
        assert_eq!(
            events_after(&p, &id, skip).await,
            [
                step("reconciled", SandboxState::Leased, SandboxState::Lost),
                step("reconciled", SandboxState::Lost, SandboxState::Terminated),
            ]
        );
        assert!(p.runtime.live_ids().is_empty());
        assert!(p.runtime.destroy_calls() > destroys);
        assert_eq!(
            p.registry.current(&id, aviary_core::now()).await.unwrap(),
            None
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_sandbox_stays_paused_and_resumes_after_a_restart() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = create(&p).await;
        p.cp.pause(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();

        let p = restart(p).await;

        assert_eq!(p.cp.live_count(), 1);
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Paused);
        let e =
            p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "{e}");
        p.cp.resume(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
    }

    /// A frozen cgroup without a `paused` event is a snapshot the crash
    /// interrupted: the reconciler thaws it (event `thawed`) and re-attaches.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sandbox_frozen_without_a_pause_on_record_is_thawed() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = create(&p).await;
        Pausable::pause(p.runtime.as_ref(), &id).await.unwrap();
        let skip = sandbox_events(&p, &alice, &id).await.len();

        let p = restart(p).await;

        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Running);
        assert_eq!(
            events_after(&p, &id, skip).await,
            [step("thawed", SandboxState::Idle, SandboxState::Idle)]
        );
        assert_eq!(state(&p, &id).await, SandboxState::Idle);
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
    }

    /// Rows of work a crash interrupted: a create still `Provisioning` ends
    /// `Failed → Terminated` and its compute is destroyed; a `Hibernating`
    /// row keeps its state (it wakes from its snapshot) and compute a crash
    /// left behind is destroyed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn interrupted_creates_fail_and_hibernated_rows_lose_leftover_compute() {
        let p = plane().await;
        let alice = tenant("alice");
        let like = create(&p).await;
        let creating = insert_row(
            &p,
            &like,
            "crun",
            &[
                SandboxState::Planning,
                SandboxState::Allocating,
                SandboxState::Provisioning,
            ],
        )
        .await;
        p.runtime
            .create(&spec_for(&p, creating.clone()))
            .await
            .unwrap();
        let mut to_hibernating = TO_IDLE.to_vec();
        to_hibernating.push(SandboxState::Hibernating);
        let hibernated = insert_row(&p, &like, "crun", &to_hibernating).await;
        p.runtime
            .create(&spec_for(&p, hibernated.clone()))
            .await
            .unwrap();
        let skip_creating = sandbox_events(&p, &alice, &creating).await.len();
        let skip_hibernated = sandbox_events(&p, &alice, &hibernated).await.len();

        let p = restart(p).await;

        assert_eq!(state(&p, &creating).await, SandboxState::Terminated);
        assert_eq!(
            events_after(&p, &creating, skip_creating).await,
            [
                step(
                    "reconciled",
                    SandboxState::Provisioning,
                    SandboxState::Failed
                ),
                step("reconciled", SandboxState::Failed, SandboxState::Terminated),
            ]
        );
        assert_eq!(state(&p, &hibernated).await, SandboxState::Hibernating);
        assert_eq!(events_after(&p, &hibernated, skip_hibernated).await, []);
        assert_eq!(p.runtime.live_ids(), vec![like.clone()]);
        assert_eq!(p.cp.live_count(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_bad_sandbox_does_not_stop_the_others_from_being_reconciled() {
        let p = plane().await;
        let alice = tenant("alice");
        // reconciled in creation order: the bad ones come first
        let first = create(&p).await;
        let unserved = insert_row(&p, &first, "runtime-not-served-here", &TO_IDLE).await;
        let refuses_fence = create(&p).await;
        let lease = acquire(&p, &refuses_fence).await;
        let good = create(&p).await;
        let vanished = create(&p).await;
        let stray = SandboxId::generate();
        p.runtime
            .create(&spec_for(&p, stray.clone()))
            .await
            .unwrap();
        // an envd that has seen a higher fence than the lease store ever
        // granted refuses the one pushed after the restart
        let refusing_envd = envd_of(&p, &refuses_fence);
        aviary_envd_proto::EnvdClient::new(refusing_envd.socket())
            .set_fence(Some(lease.token.fence() + 1000))
            .await
            .unwrap();
        assert!(p.runtime.vanish(&vanished).await);

        let p = restart(p).await;

        // a row on a runtime this server does not serve: lost, tainted
        let rec = p.registry.get_sandbox(&unserved).await.unwrap();
        assert_eq!(rec.state, SandboxState::Lost);
        assert!(rec.tainted);
        // an envd refusing its fence: lost, tainted, frozen
        let rec = p.registry.get_sandbox(&refuses_fence).await.unwrap();
        assert_eq!(rec.state, SandboxState::Lost);
        assert!(rec.tainted);
        let lost = sandbox_events(&p, &alice, &refuses_fence)
            .await
            .into_iter()
            .find(|e| e.event_type == "sandbox_lost")
            .unwrap();
        assert_eq!(
            lost.metadata["reason"],
            "its envd did not take the lease fence"
        );
        assert_eq!(
            p.runtime.status(&refuses_fence).await.unwrap(),
            RuntimeStatus::Paused
        );
        let e =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(refuses_fence.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::SandboxLost, "{e}");
        // …and everything after them was reconciled all the same
        for id in [&first, &good] {
            assert_eq!(state(&p, id).await, SandboxState::Idle);
            p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
                .await
                .unwrap();
        }
        assert_eq!(state(&p, &vanished).await, SandboxState::Terminated);
        assert!(!p.runtime.live_ids().contains(&stray));
        assert_eq!(p.cp.live_count(), 2);
    }
}
