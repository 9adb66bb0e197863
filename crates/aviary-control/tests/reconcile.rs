//! The reconciler's decisions.
//!
//! At start-up (`tests`): a second control plane over the same registry and
//! the same fake runtime stands for a restarted server. Running sandboxes
//! are re-attached with their fence pushed again; rows whose compute is gone
//! or stopped end `Terminated` via `Lost` (or `Failed` for half-created
//! ones) unless a snapshot can bring them back; runtime sandboxes the
//! registry does not know are destroyed; one sandbox that cannot be brought
//! back is marked lost and never holds up the others.
//!
//! The periodic pass (`periodic`, `ControlPlane::reconcile`): compute that
//! goes behind the control plane's back makes its sandbox `Lost`, then
//! recovered from its snapshot or judged unrecoverable once; pooled ones are
//! destroyed; orphans go after their grace; a node agent that stops
//! answering loses its sandboxes and gets them back when it answers; nodes
//! this plane does not drive and sandboxes another operation holds are left
//! alone.

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
            metadata: Default::default(),
            env: Default::default(),
            run_as: Default::default(),
            workdir: Default::default(),
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

#[cfg(test)]
mod periodic {
    use super::support::*;
    use aviary_control::metrics::ReconcileAction;
    use aviary_control::nodes::AddNodeRequest;
    use aviary_control::requests::{
        CheckpointRequest, FileRequest, FileUpload, OnSandbox, SandboxRef,
    };
    use aviary_control::{ControlConfig, ReconcileReport};
    use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest, ExecRequest};
    use aviary_core::{ErrorCode, SandboxId, SandboxState};
    use aviary_fakes::FakeRuntime;
    use aviary_leases::{LeaseStore, LockName, LockRequest};
    use aviary_registry::{EventFilter, NewSandbox, Registry, TransitionCtx, POOL_TENANT};
    use aviary_runtime::{Runtime, RuntimeStatus, SandboxSpec};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    const TO_IDLE: [SandboxState; 5] = [
        SandboxState::Planning,
        SandboxState::Allocating,
        SandboxState::Provisioning,
        SandboxState::Locking,
        SandboxState::Idle,
    ];

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

    async fn state(p: &Plane, id: &SandboxId) -> SandboxState {
        p.registry.get_sandbox(id).await.unwrap().state
    }

    async fn write(p: &Plane, id: &SandboxId, path: &str, body: &'static [u8]) {
        p.cp.write_file(
            &tenant("alice"),
            FileUpload {
                id: id.to_string(),
                path: path.into(),
                body,
            },
        )
        .await
        .unwrap();
    }

    /// A file's content read through the control plane (the sandbox's envd).
    async fn read(p: &Plane, id: &SandboxId, path: &str) -> Result<Vec<u8>, ErrorCode> {
        let mut reader =
            p.cp.read_file(&tenant("alice"), FileRequest::new(id.as_str(), path))
                .await
                .map_err(|e| e.code())?;
        let mut out = Vec::new();
        reader.read_to_end(&mut out).await.unwrap();
        Ok(out)
    }

    async fn snapshot(p: &Plane, id: &SandboxId) -> String {
        p.cp.snapshot(&tenant("alice"), CheckpointRequest::new(id.as_str()))
            .await
            .unwrap()
            .id
    }

    /// The event types of a sandbox, oldest first.
    async fn event_types(p: &Plane, id: &SandboxId) -> Vec<String> {
        state_events(p, id)
            .await
            .into_iter()
            .map(|e| e.event_type)
            .collect()
    }

    async fn state_events(p: &Plane, id: &SandboxId) -> Vec<aviary_core::api::Event> {
        p.registry
            .list_events(&EventFilter {
                tenant: None,
                sandbox_id: Some(id.clone()),
                after_id: None,
                limit: 1000,
                newest: false,
            })
            .await
            .unwrap()
    }

    /// The events without a tenant (orphans, nodes), oldest first.
    async fn platform_events(p: &Plane) -> Vec<aviary_core::api::Event> {
        p.registry
            .list_events(&EventFilter {
                tenant: Some(POOL_TENANT.into()),
                sandbox_id: None,
                after_id: None,
                limit: 1000,
                newest: false,
            })
            .await
            .unwrap()
            .into_iter()
            .filter(|e| !e.event_type.starts_with("pool"))
            .collect()
    }

    fn report(f: impl FnOnce(&mut ReconcileReport)) -> ReconcileReport {
        let mut r = ReconcileReport::default();
        f(&mut r);
        r
    }

    /// A spec like the ones `like` was given, for compute made behind the
    /// control plane's back.
    fn spec_like(like: &FakeRuntime, id: SandboxId) -> SandboxSpec {
        SandboxSpec {
            id,
            ..like.created_specs()[0].clone()
        }
    }

    /// A registry row copied from `like`, on `node`, walked to `Idle`.
    async fn idle_row_on(p: &Plane, like: &SandboxId, node: &str) -> SandboxId {
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
            runtime: rec.runtime,
            runtime_instance_id: None,
            node: node.to_owned(),
            network_profile: rec.network_profile,
            expires_at: rec.expires_at,
            tainted: false,
            user_managed: false,
            metadata: Default::default(),
            env: Default::default(),
            run_as: Default::default(),
            workdir: Default::default(),
        };
        let row = p
            .registry
            .insert_sandbox(&new, TransitionCtx::default())
            .await
            .unwrap();
        p.registry
            .transition(
                &id,
                row.version,
                &TO_IDLE,
                aviary_registry::FenceCheck::Skip,
                TransitionCtx::default(),
            )
            .await
            .unwrap();
        id
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn vanished_compute_with_a_snapshot_is_lost_then_recovered_from_it() {
        let p = snapshot_plane(config()).await;
        let alice = tenant("alice");
        let id = create(&p).await;
        write(&p, &id, "/workspace/committed", b"in the snapshot").await;
        write(&p, &id, "/tmp/outside", b"outside the workspace").await;
        let snap = snapshot(&p, &id).await;
        write(&p, &id, "/workspace/after", b"never snapshotted").await;
        let lease =
            p.cp.lease_acquire(
                &alice,
                OnSandbox::new(
                    id.as_str(),
                    AcquireLeaseRequest {
                        owner: "agent-1".into(),
                        ttl_s: Some(3600),
                    },
                ),
            )
            .await
            .unwrap();
        assert!(p.runtime.vanish(&id).await);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(
            done,
            report(|r| {
                r.lost = 1;
                r.recovered = 1;
            })
        );
        let rec = p.registry.get_sandbox(&id).await.unwrap();
        assert_eq!(rec.state, SandboxState::Idle);
        assert!(!rec.tainted, "new compute: the loss's taint is gone");
        assert_eq!(p.runtime.seeded_creates(), vec![id.clone()]);
        // what the snapshot had is back, under the same id; what came after is not
        assert_eq!(
            read(&p, &id, "/workspace/committed").await.unwrap(),
            b"in the snapshot"
        );
        assert_eq!(
            read(&p, &id, "/tmp/outside").await.unwrap(),
            b"outside the workspace"
        );
        assert_eq!(
            read(&p, &id, "/workspace/after").await.unwrap_err(),
            ErrorCode::NotFound
        );
        let events = state_events(&p, &id).await;
        let lost = events
            .iter()
            .find(|e| e.event_type == "sandbox_lost")
            .unwrap();
        assert_eq!(lost.old_state, Some(SandboxState::Leased));
        assert_eq!(
            lost.metadata["reason"],
            "its compute is gone from the runtime"
        );
        assert_eq!(lost.metadata["cause"], "compute_gone");
        let recovered = events.iter().find(|e| e.event_type == "recovered").unwrap();
        assert_eq!(recovered.metadata["snapshot"], snap.as_str());
        let types = event_types(&p, &id).await;
        let from_loss: Vec<_> = types
            .iter()
            .skip_while(|t| *t != "sandbox_lost")
            .map(String::as_str)
            .collect();
        assert_eq!(
            from_loss,
            [
                "sandbox_lost",
                "tainted",
                "recovering",
                "state_changed",
                "state_changed",
                "recovered"
            ]
        );
        // the lease ended with the loss: its token is stale, the sandbox works
        let e =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleToken, "{e}");
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
        assert_eq!(p.cp.metrics.reconcile_count(ReconcileAction::Recovered), 1);
        let metrics = p.cp.metrics.render(p.cp.live_count(), &[]);
        assert!(
            metrics.contains("aviary_reconciler_actions_total{action=\"recovered\"} 1\n")
                && metrics.contains("aviary_reconciler_actions_total{action=\"lost\"} 1\n")
                && metrics.contains("aviary_reconciler_passes_total 1\n"),
            "{metrics}"
        );
        // nothing left to do
        assert!(p.cp.reconcile().await.unwrap().is_quiet());
    }

    /// Compute whose PID 1 exited (`Stopped`, still listed) is recovered
    /// the same way; its remains are removed before the restore is staged.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stopped_compute_with_a_snapshot_is_recovered() {
        let p = snapshot_plane(config()).await;
        let id = create(&p).await;
        write(&p, &id, "/workspace/kept", b"kept").await;
        snapshot(&p, &id).await;
        assert!(p.runtime.crash(&id).await);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!((done.lost, done.recovered), (1, 1), "{done:?}");
        assert_eq!(state(&p, &id).await, SandboxState::Idle);
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Running);
        assert_eq!(read(&p, &id, "/workspace/kept").await.unwrap(), b"kept");
    }

    /// A sandbox the envd probe found lost (before any pass) is recovered by
    /// the next pass: the reconciler settles losses, whoever found them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_loss_the_probe_found_is_recovered_by_the_next_pass() {
        let p = snapshot_plane(config()).await;
        let id = create(&p).await;
        write(&p, &id, "/workspace/kept", b"kept").await;
        snapshot(&p, &id).await;
        assert!(p.runtime.crash(&id).await);
        p.cp.probe_envds().await;
        assert_eq!(state(&p, &id).await, SandboxState::Lost);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(done, report(|r| r.recovered = 1));
        assert_eq!(read(&p, &id, "/workspace/kept").await.unwrap(), b"kept");
    }

    /// A user-managed sandbox's owner expects it to be there: without a
    /// snapshot it gets new compute from its template, and the event says
    /// its data is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_user_managed_sandbox_without_a_snapshot_is_recreated_empty() {
        let p = plane().await;
        let alice = tenant("alice");
        let id =
            p.cp.create(
                &alice,
                CreateSandboxRequest {
                    user_managed: true,
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .sandbox
            .id;
        write(&p, &id, "/workspace/gone", b"x").await;
        let old =
            p.cp.lease_acquire(
                &alice,
                OnSandbox::new(
                    id.as_str(),
                    AcquireLeaseRequest {
                        owner: "agent-1".into(),
                        ttl_s: Some(3600),
                    },
                ),
            )
            .await
            .unwrap();
        assert!(p.runtime.vanish(&id).await);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(
            done,
            report(|r| {
                r.lost = 1;
                r.recreated = 1;
            })
        );
        let rec = p.registry.get_sandbox(&id).await.unwrap();
        assert_eq!(rec.state, SandboxState::Idle);
        assert!(!rec.tainted, "new compute, clean again");
        assert!(rec.user_managed);
        let events = state_events(&p, &id).await;
        let last = events.last().unwrap();
        assert_eq!(last.event_type, "recreated");
        assert_eq!(last.metadata["data_lost"], true);
        assert!(p.runtime.live_ids().contains(&id), "new compute runs");
        assert!(
            read(&p, &id, "/workspace/gone").await.is_err(),
            "the workspace starts empty"
        );
        // the holder before the loss is refused; the sandbox works for a new one
        let e =
            p.cp.exec(
                &alice.clone().with_token(old.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleToken, "{e}");
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
        assert!(p.cp.reconcile().await.unwrap().is_quiet());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lost_compute_without_a_snapshot_stays_lost_with_one_verdict() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = create(&p).await;
        let other = create(&p).await;
        assert!(p.runtime.vanish(&id).await);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(
            done,
            report(|r| {
                r.lost = 1;
                r.unrecoverable = 1;
            })
        );
        let rec = p.registry.get_sandbox(&id).await.unwrap();
        assert_eq!(rec.state, SandboxState::Lost);
        assert!(rec.tainted);
        let events = state_events(&p, &id).await;
        let verdict = events.last().unwrap();
        assert_eq!(verdict.event_type, "unrecoverable");
        assert_eq!(
            verdict.metadata["reason"],
            "it has no snapshot to restore from"
        );
        assert_eq!(
            p.registry.current(&id, aviary_core::now()).await.unwrap(),
            None,
            "its lease is revoked"
        );
        // judged once: later passes leave it
        assert!(p.cp.reconcile().await.unwrap().is_quiet());
        assert_eq!(
            event_types(&p, &id)
                .await
                .iter()
                .filter(|t| *t == "unrecoverable")
                .count(),
            1
        );
        let e =
            p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::SandboxLost, "{e}");
        // its owner deletes it; the neighbour never noticed
        p.cp.delete(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        assert_eq!(state(&p, &other).await, SandboxState::Idle);
        p.cp.exec(&alice, OnSandbox::new(other.as_str(), echo()))
            .await
            .unwrap();
    }

    /// A lost sandbox whose compute is still there (its envd refused the
    /// fence: frozen, untrusted) is its owner's to delete: no pass touches it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_sandbox_whose_compute_remains_is_left_to_its_owner() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = create(&p).await;
        aviary_envd_proto::EnvdClient::new(envd_of(&p, &id).socket())
            .set_fence(Some(1 << 40))
            .await
            .unwrap();
        let e =
            p.cp.lease_acquire(
                &alice,
                OnSandbox::new(
                    id.as_str(),
                    AcquireLeaseRequest {
                        owner: "agent-1".into(),
                        ttl_s: Some(60),
                    },
                ),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::SandboxLost, "{e}");
        let before = event_types(&p, &id).await;

        assert!(p.cp.reconcile().await.unwrap().is_quiet());

        assert_eq!(state(&p, &id).await, SandboxState::Lost);
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Paused);
        assert_eq!(event_types(&p, &id).await, before);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pooled_sandbox_that_dies_is_destroyed() {
        let mut cfg = config();
        cfg.settings.pools = vec![pool_settings("python-small", 1, 1)];
        let p = plane_with(cfg).await;
        p.cp.refill_pools().await.unwrap();
        let pooled = p
            .registry
            .list_sandboxes(Some(POOL_TENANT), false)
            .await
            .unwrap();
        assert_eq!(pooled.len(), 1);
        let id = pooled[0].id.clone();
        assert!(p.runtime.vanish(&id).await);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(
            done,
            report(|r| {
                r.lost = 1;
                r.pooled_destroyed = 1;
            })
        );
        assert_eq!(state(&p, &id).await, SandboxState::Terminated);
        // the pool starts a fresh one
        p.cp.refill_pools().await.unwrap();
        let pooled = p
            .registry
            .list_sandboxes(Some(POOL_TENANT), false)
            .await
            .unwrap();
        assert_eq!(pooled.len(), 1);
        assert_ne!(pooled[0].id, id);
    }

    /// Rows on a node this control plane does not drive (another replica's
    /// own runtimes) are never judged, however dead they look from here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sandboxes_on_a_node_this_plane_does_not_drive_are_not_touched() {
        let mut cfg = config();
        cfg.local_node = "node-a".into();
        let p = plane_with(cfg).await;
        let mine = create(&p).await;
        let foreign = idle_row_on(&p, &mine, "node-b").await;
        let before = event_types(&p, &foreign).await;

        assert!(p.cp.reconcile().await.unwrap().is_quiet());

        assert_eq!(state(&p, &foreign).await, SandboxState::Idle);
        assert_eq!(event_types(&p, &foreign).await, before);
        assert_eq!(state(&p, &mine).await, SandboxState::Idle);
    }

    /// Per-sandbox work holds `lifecycle/<id>`, tried: a sandbox another
    /// operation (a hibernate, a wake, another replica's pass) holds is
    /// looked at again on the next pass, never waited for.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sandbox_under_its_lifecycle_lock_waits_for_the_next_pass() {
        let p = plane().await;
        let id = create(&p).await;
        assert!(p.runtime.vanish(&id).await);
        let held =
            p.cp.locks
                .try_acquire(&LockRequest::new(
                    LockName::new("lifecycle", id.as_str()),
                    "a wake elsewhere",
                    Duration::from_secs(60),
                ))
                .await
                .unwrap()
                .unwrap();

        assert!(p.cp.reconcile().await.unwrap().is_quiet());
        assert_eq!(state(&p, &id).await, SandboxState::Idle);

        drop(held);
        let done = p.cp.reconcile().await.unwrap();
        assert_eq!((done.lost, done.unrecoverable), (1, 1), "{done:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unclaimed_compute_is_destroyed_only_after_the_grace() {
        let mut cfg = config();
        cfg.orphan_grace_s = 1;
        let p = plane_with(cfg).await;
        let alice = tenant("alice");
        let known = create(&p).await;
        // compute the registry does not know, and compute of a deleted row
        let stray = SandboxId::generate();
        p.runtime
            .create(&spec_like(&p.runtime, stray.clone()))
            .await
            .unwrap();
        let deleted = create(&p).await;
        p.cp.delete(&alice, SandboxRef::new(deleted.as_str()))
            .await
            .unwrap();
        p.cp.reclaims.settled().await;
        p.runtime
            .create(&spec_like(&p.runtime, deleted.clone()))
            .await
            .unwrap();

        // seen now, destroyed only once the grace has passed
        assert!(p.cp.reconcile().await.unwrap().is_quiet());
        let mut live = p.runtime.live_ids();
        live.sort();
        let mut all = vec![known.clone(), stray.clone(), deleted.clone()];
        all.sort();
        assert_eq!(live, all);
        tokio::time::sleep(Duration::from_millis(1100)).await;

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(done, report(|r| r.orphans_destroyed = 2));
        assert_eq!(p.runtime.live_ids(), vec![known.clone()]);
        let events = platform_events(&p).await;
        let mut orphans: Vec<_> = events
            .iter()
            .filter(|e| e.event_type == "orphan_destroyed")
            .map(|e| {
                (
                    e.sandbox_id.clone().unwrap(),
                    e.metadata["registry"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        orphans.sort();
        let mut want = vec![
            (stray, "unknown".to_owned()),
            (deleted, "terminated".to_owned()),
        ];
        want.sort();
        assert_eq!(orphans, want);
        assert_eq!(state(&p, &known).await, SandboxState::Idle);
        assert_eq!(
            p.cp.metrics
                .reconcile_count(ReconcileAction::OrphanDestroyed),
            2
        );
    }

    /// With the default grace (a minute) nothing unclaimed is destroyed by
    /// the passes of the first seconds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_default_grace_spares_fresh_unclaimed_compute() {
        let p = plane().await;
        create(&p).await;
        let stray = SandboxId::generate();
        p.runtime
            .create(&spec_like(&p.runtime, stray.clone()))
            .await
            .unwrap();
        for _ in 0..3 {
            assert!(p.cp.reconcile().await.unwrap().is_quiet());
        }
        assert!(p.runtime.live_ids().contains(&stray));
    }

    /// Rule 4 over a fake agent: silent past `node_unhealthy_after_s` → its
    /// live sandboxes `Lost` naming it; answering again → the one whose
    /// compute survived is attached again (fence pushed, `Idle`, untainted),
    /// the one whose compute went is judged like any lost compute.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_node_loses_its_sandboxes_and_gets_them_back_when_it_answers() {
        let mut cfg: ControlConfig = config();
        cfg.node_unhealthy_after_s = 1;
        let nodes = Arc::new(FakeNodes::default());
        let agent = Arc::new(FakeRuntime::new().unwrap());
        nodes.add("agent-1", "127.0.0.1:7401", agent.clone());
        let p = plane_full(
            cfg,
            aviary_registry::MemoryRegistry::new(),
            Arc::new(FakeRuntime::new().unwrap()),
            nodes,
            Arc::new(aviary_snapshots::MemoryStore::new()),
        )
        .await;
        let alice = tenant("alice");
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
        let local = create(&p).await;
        let (survives, vanishes) = (
            idle_row_on(&p, &local, "agent-1").await,
            idle_row_on(&p, &local, "agent-1").await,
        );
        for id in [&survives, &vanishes] {
            agent
                .create(&spec_like(&p.runtime, id.clone()))
                .await
                .unwrap();
        }
        // the agent's sandboxes work through this plane
        p.cp.exec(&alice, OnSandbox::new(survives.as_str(), echo()))
            .await
            .unwrap();
        assert!(p.cp.reconcile().await.unwrap().is_quiet());

        agent.set_unreachable(true);
        // silent, but not for long enough yet
        assert!(p.cp.reconcile().await.unwrap().is_quiet());
        assert_eq!(state(&p, &survives).await, SandboxState::Idle);
        tokio::time::sleep(Duration::from_millis(1100)).await;

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(
            done,
            report(|r| {
                r.nodes_unhealthy = 1;
                r.lost = 2;
            })
        );
        for id in [&survives, &vanishes] {
            let lost = state_events(&p, id)
                .await
                .into_iter()
                .find(|e| e.event_type == "sandbox_lost")
                .unwrap();
            assert_eq!(lost.new_state, Some(SandboxState::Lost));
            assert_eq!(lost.metadata["node"], "agent-1");
            assert_eq!(
                lost.metadata["reason"],
                "its node agent agent-1 stopped answering"
            );
            let e =
                p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
                    .await
                    .unwrap_err();
            assert_eq!(e.code(), ErrorCode::SandboxLost, "{e}");
        }
        let node_events: Vec<_> = platform_events(&p)
            .await
            .into_iter()
            .map(|e| (e.event_type, e.metadata["node"].clone()))
            .collect();
        assert_eq!(
            node_events,
            [("node_unhealthy".to_owned(), serde_json::json!("agent-1"))]
        );
        let row = p.registry.list_nodes().await.unwrap();
        assert!(!row.iter().find(|n| n.id == "agent-1").unwrap().healthy);
        assert_eq!(
            state(&p, &local).await,
            SandboxState::Idle,
            "the local node is fine"
        );
        // still silent: nothing new
        assert!(p.cp.reconcile().await.unwrap().is_quiet());

        // one sandbox's compute goes while the agent is away
        assert!(agent.vanish(&vanishes).await);
        let envd = agent.envd(&survives).unwrap();
        envd.clear_calls();
        agent.set_unreachable(false);

        let done = p.cp.reconcile().await.unwrap();

        assert_eq!(
            done,
            report(|r| {
                r.nodes_healthy = 1;
                r.reattached = 1;
                r.unrecoverable = 1;
            })
        );
        let rec = p.registry.get_sandbox(&survives).await.unwrap();
        assert_eq!(rec.state, SandboxState::Idle);
        assert!(!rec.tainted);
        let back: Vec<_> = state_events(&p, &survives)
            .await
            .into_iter()
            .filter(|e| e.event_type == "reattached")
            .map(|e| (e.old_state.unwrap(), e.new_state.unwrap()))
            .collect();
        assert_eq!(
            back,
            [
                (SandboxState::Lost, SandboxState::Provisioning),
                (SandboxState::Provisioning, SandboxState::Locking),
                (SandboxState::Locking, SandboxState::Idle),
            ]
        );
        let pushed = calls_until(&envd, |c| c.iter().any(|c| c.method == "set_fence")).await;
        let push = pushed.iter().find(|c| c.method == "set_fence").unwrap();
        assert_eq!(push.token, None, "the loss revoked the lease");
        p.cp.exec(&alice, OnSandbox::new(survives.as_str(), echo()))
            .await
            .unwrap();
        assert_eq!(state(&p, &vanishes).await, SandboxState::Lost);
        assert_eq!(
            event_types(&p, &vanishes).await.last().map(String::as_str),
            Some("unrecoverable")
        );
        assert!(
            p.registry
                .list_nodes()
                .await
                .unwrap()
                .iter()
                .find(|n| n.id == "agent-1")
                .unwrap()
                .healthy
        );
        assert!(p.cp.reconcile().await.unwrap().is_quiet());
    }

    /// Compute that went while the server was down: with a snapshot, start-up
    /// marks it lost (not terminated) and the first pass restores it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn compute_lost_while_down_is_recovered_by_the_first_pass() {
        let p = snapshot_plane(config()).await;
        let id = create(&p).await;
        write(&p, &id, "/workspace/kept", b"kept").await;
        snapshot(&p, &id).await;
        assert!(p.runtime.vanish(&id).await);
        let chunks = p.cp.snapshots.store().clone();

        let p = p
            .restart_keeping(config(), Arc::new(aviary_control::NoNodes), chunks)
            .await;

        assert_eq!(state(&p, &id).await, SandboxState::Lost);
        let done = p.cp.reconcile().await.unwrap();
        assert_eq!(done, report(|r| r.recovered = 1));
        assert_eq!(read(&p, &id, "/workspace/kept").await.unwrap(), b"kept");
    }
}
