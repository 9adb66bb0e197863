//! The sandbox state machine through the control plane's operations, over
//! fakes: pause/resume, the level-1 reset, illegal operations (409
//! `invalid_state`, nothing changed), fenced delete, lost sandboxes (an envd
//! that died, a sandbox the host lost) and the capabilities this runtime
//! lacks (snapshot, fork, hibernate, level-2 reset: 400 `invalid_request`).

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{
        CheckpointRequest, FileRequest, FileUpload, OnSandbox, ResetRequest, SandboxRef,
    };
    use aviary_control::snapshots::ForkRequest;
    use aviary_control::OpError;
    use aviary_core::api::{AcquireLeaseRequest, CreateSandboxRequest, ExecRequest, Lease};
    use aviary_core::{ErrorCode, LeaseToken, SandboxId, SandboxState};
    use aviary_fakes::FakeEnvd;
    use aviary_leases::LeaseStore;
    use aviary_registry::Registry;
    use aviary_runtime::{Runtime, RuntimeStatus};

    /// `echo hi`; the lease token it runs under is the context's.
    fn echo() -> ExecRequest {
        ExecRequest {
            cmd: Some(vec!["echo".into(), "hi".into()]),
            ..Default::default()
        }
    }

    async fn idle_sandbox(p: &Plane) -> (SandboxId, FakeEnvd) {
        let created =
            p.cp.create(&tenant("alice"), CreateSandboxRequest::default())
                .await
                .unwrap();
        assert_eq!(created.sandbox.state, SandboxState::Idle);
        let id = created.sandbox.id;
        let envd = envd_of(p, &id);
        (id, envd)
    }

    async fn acquire(p: &Plane, id: &SandboxId) -> Lease {
        p.cp.lease_acquire(
            &tenant("alice"),
            OnSandbox::new(
                id.as_str(),
                AcquireLeaseRequest {
                    owner: "agent-1".into(),
                    ttl_s: None,
                },
            ),
        )
        .await
        .unwrap()
    }

    /// The registry row's state, version and taint, and how many events it has.
    async fn row(p: &Plane, id: &SandboxId) -> (SandboxState, i64, bool, usize) {
        let rec = p.registry.get_sandbox(id).await.unwrap();
        let events = sandbox_events(p, &tenant("alice"), id).await.len();
        (rec.state, rec.version, rec.tainted, events)
    }

    #[track_caller]
    fn assert_code<T: std::fmt::Debug>(r: Result<T, OpError>, code: ErrorCode, what: &str) {
        let e = r.unwrap_err();
        assert_eq!(e.code(), code, "{what}: {e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pause_refuses_exec_and_files_until_resume() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;

        let paused =
            p.cp.pause(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(paused.state, SandboxState::Idle, "pause is not a state");
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Paused);
        let before = row(&p, &id).await;

        assert_code(
            p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo())).await,
            ErrorCode::InvalidState,
            "exec while paused",
        );
        assert_code(
            p.cp.write_file(
                &alice,
                FileUpload {
                    id: id.to_string(),
                    path: "/workspace/f".into(),
                    body: &b"x"[..],
                },
            )
            .await,
            ErrorCode::InvalidState,
            "write while paused",
        );
        assert_code(
            p.cp.list_files(&alice, FileRequest::new(id.as_str(), "/workspace"))
                .await,
            ErrorCode::InvalidState,
            "list while paused",
        );
        assert_code(
            p.cp.pause(&alice, SandboxRef::new(id.as_str())).await,
            ErrorCode::InvalidState,
            "pause while paused",
        );
        assert!(envd.execs().is_empty(), "{:?}", envd.execs());
        assert_eq!(row(&p, &id).await, before);

        let resumed =
            p.cp.resume(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(resumed.state, SandboxState::Idle);
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Running);
        let out =
            p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
                .await
                .unwrap();
        assert_eq!(out.stdout, "hi\n");
        let kinds: Vec<String> = sandbox_events(&p, &alice, &id)
            .await
            .into_iter()
            .map(|e| e.event_type)
            .filter(|t| t == "paused" || t == "resumed")
            .collect();
        assert_eq!(kinds, ["paused", "resumed"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pause_and_resume_of_a_leased_sandbox_need_its_token() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, _envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id).await;

        assert_code(
            p.cp.pause(&alice, SandboxRef::new(id.as_str())).await,
            ErrorCode::LeaseRequired,
            "pause without token",
        );
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Running);
        p.cp.pause(&holding(&alice, lease.token), SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        assert_code(
            p.cp.resume(&alice, SandboxRef::new(id.as_str())).await,
            ErrorCode::LeaseRequired,
            "resume without token",
        );
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Paused);
        p.cp.resume(&holding(&alice, lease.token), SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        p.cp.exec(
            &holding(&alice, lease.token),
            OnSandbox::new(id.as_str(), echo()),
        )
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn level_one_reset_kills_everything_revokes_the_lease_and_ends_idle() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id).await;
        envd.clear_calls();

        let reset =
            p.cp.reset_level(
                &holding(&alice, lease.token),
                ResetRequest {
                    id: id.to_string(),
                    level: 1,
                },
            )
            .await
            .unwrap();
        assert_eq!(reset.state, SandboxState::Idle);
        assert_eq!(reset.lease_owner, None);

        let calls = calls_until(&envd, |c| c.iter().any(|c| c.method == "kill_all")).await;
        let kill = calls.iter().find(|c| c.method == "kill_all").unwrap();
        assert_eq!(kill.result, Ok(()));
        assert_eq!(kill.fence, None, "the lease was revoked before the kill");
        assert_eq!(envd.fence(), None);
        let script = envd.execs();
        assert_eq!(script.len(), 1, "{script:?}");
        assert_eq!(script[0].argv[..2], ["/bin/sh", "-c"]);
        assert!(script[0].argv[2].contains("kill -9 -1"), "{script:?}");

        let path = state_path(&p, &id).await;
        assert_eq!(
            path[path.len() - 3..],
            [
                SandboxState::Leased,
                SandboxState::Sanitizing,
                SandboxState::Idle
            ]
        );
        let resets: Vec<_> = sandbox_events(&p, &alice, &id)
            .await
            .into_iter()
            .filter(|e| e.event_type == "reset")
            .collect();
        assert_eq!(resets.len(), 2, "{resets:?}");
        assert!(resets.iter().all(|e| e.metadata["level"] == 1));

        // the old holder is out; the sandbox serves unleased calls again
        assert_code(
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await,
            ErrorCode::StaleToken,
            "exec with the revoked token",
        );
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
        // and a reset level outside 1-3 is a clear refusal
        assert_code(
            p.cp.reset_level(
                &alice,
                ResetRequest {
                    id: id.to_string(),
                    level: 4,
                },
            )
            .await,
            ErrorCode::InvalidRequest,
            "reset level 4",
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resuming_a_running_sandbox_is_invalid_state_and_changes_nothing() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let before = row(&p, &id).await;
        let e =
            p.cp.resume(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "{e}");
        assert_eq!(e.code().http_status(), 409);
        assert_eq!(row(&p, &id).await, before);
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Running);
        assert_eq!(envd.fence(), None);
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_operation_on_a_terminated_sandbox_is_invalid_state() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let gone =
            p.cp.delete(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(gone.state, SandboxState::Terminated);
        p.cp.reclaims.settled().await;
        assert!(envd.is_dead());
        assert!(p.runtime.live_ids().is_empty());
        let before = row(&p, &id).await;
        let (creates, destroys) = (p.runtime.create_calls(), p.runtime.destroy_calls());
        let sid = id.as_str();
        let code = ErrorCode::InvalidState;

        assert_code(
            p.cp.exec(&alice, OnSandbox::new(sid, echo())).await,
            code,
            "exec",
        );
        assert_code(
            p.cp.write_file(
                &alice,
                FileUpload {
                    id: sid.into(),
                    path: "/workspace/f".into(),
                    body: &b"x"[..],
                },
            )
            .await,
            code,
            "write_file",
        );
        assert_code(
            p.cp.read_file(&alice, FileRequest::new(sid, "/workspace/f"))
                .await,
            code,
            "read_file",
        );
        assert_code(
            p.cp.pause(&alice, SandboxRef::new(sid)).await,
            code,
            "pause",
        );
        assert_code(
            p.cp.resume(&alice, SandboxRef::new(sid)).await,
            code,
            "resume",
        );
        assert_code(
            p.cp.reset(&alice, SandboxRef::new(sid)).await,
            code,
            "reset",
        );
        assert_code(
            p.cp.reset_level(
                &alice,
                ResetRequest {
                    id: sid.into(),
                    level: 2,
                },
            )
            .await,
            code,
            "reset level 2",
        );
        assert_code(
            p.cp.delete(&alice, SandboxRef::new(sid)).await,
            code,
            "delete",
        );
        assert_code(
            p.cp.release(&alice, SandboxRef::new(sid)).await,
            code,
            "release",
        );
        assert_code(
            p.cp.lease_acquire(
                &alice,
                OnSandbox::new(
                    sid,
                    AcquireLeaseRequest {
                        owner: "agent-1".into(),
                        ttl_s: None,
                    },
                ),
            )
            .await,
            code,
            "lease_acquire",
        );
        assert_code(
            p.cp.snapshot(&alice, CheckpointRequest::new(sid)).await,
            code,
            "snapshot",
        );
        assert_code(
            p.cp.hibernate(&alice, SandboxRef::new(sid)).await,
            code,
            "hibernate",
        );
        assert_code(p.cp.wake(&alice, SandboxRef::new(sid)).await, code, "wake");
        assert_code(
            p.cp.fork(&alice, OnSandbox::new(sid, ForkRequest::default()))
                .await,
            code,
            "fork",
        );

        assert_eq!(row(&p, &id).await, before);
        assert_eq!(p.runtime.create_calls(), creates);
        assert_eq!(p.runtime.destroy_calls(), destroys);
    }

    /// A live fork on a runtime without memory checkpoints is 409
    /// `unsupported`; with a snapshot named it is 400; without the lease
    /// token of a leased parent it is `lease_required`. Nothing is made and
    /// the parent's row is untouched.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_fork_is_refused_where_it_cannot_be_made() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, _envd) = idle_sandbox(&p).await;
        let sid = id.as_str();
        let creates = p.runtime.create_calls();
        let before = row(&p, &id).await;
        let live = |snapshot: Option<String>| ForkRequest {
            snapshot,
            live: true,
            token: None,
        };
        let e =
            p.cp.fork(&alice, OnSandbox::new(sid, live(None)))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");
        assert_eq!(e.code().http_status(), 409);
        assert!(
            e.to_string().contains("cannot fork a running sandbox"),
            "{e}"
        );
        assert_code(
            p.cp.fork(&alice, OnSandbox::new(sid, live(Some("snap".into()))))
                .await,
            ErrorCode::InvalidRequest,
            "live fork of a snapshot",
        );
        let _lease = acquire(&p, &id).await;
        let before_leased = row(&p, &id).await;
        assert_code(
            p.cp.fork(&alice, OnSandbox::new(sid, live(None))).await,
            ErrorCode::LeaseRequired,
            "live fork without the token",
        );
        assert_eq!(row(&p, &id).await, before_leased);
        assert_ne!(before_leased, before);
        assert_eq!(p.runtime.create_calls(), creates);
        let all = p.registry.list_sandboxes(None, true).await.unwrap();
        assert_eq!(all.len(), 1, "{all:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deleting_a_leased_sandbox_needs_its_token() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id).await;
        let before = row(&p, &id).await;

        assert_code(
            p.cp.delete(&alice, SandboxRef::new(id.as_str())).await,
            ErrorCode::LeaseRequired,
            "delete without token",
        );
        assert_code(
            p.cp.delete(
                &holding(&alice, Some(LeaseToken::generate(lease.token.fence()))),
                SandboxRef::new(id.as_str()),
            )
            .await,
            ErrorCode::StaleToken,
            "delete with a forged token",
        );
        // nothing changed but the taint a forged token sets (and its event)
        assert_eq!(
            row(&p, &id).await,
            (before.0, before.1 + 1, true, before.3 + 1)
        );
        assert_eq!(p.runtime.live_ids(), vec![id.clone()]);
        assert!(!envd.is_dead());

        let gone =
            p.cp.delete(&holding(&alice, lease.token), SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(gone.state, SandboxState::Terminated);
        // the compute goes in the background, after the answer
        p.cp.reclaims.settled().await;
        assert!(p.runtime.live_ids().is_empty());
        assert!(envd.is_dead());
        assert_eq!(
            p.registry.current(&id, aviary_core::now()).await.unwrap(),
            None
        );
        let path = state_path(&p, &id).await;
        assert_eq!(
            path[path.len() - 3..],
            [
                SandboxState::Leased,
                SandboxState::Sanitizing,
                SandboxState::Terminated
            ]
        );
    }

    /// Calls on a lost sandbox: `sandbox_lost` (409) for the calls that
    /// need its compute, never a 5xx; the owner can still delete it.
    async fn assert_lost_afterwards(p: &Plane, id: &SandboxId, token: Option<LeaseToken>) {
        let alice = tenant("alice");
        let sid = id.as_str();
        let lost = ErrorCode::SandboxLost;
        for (what, r) in [
            (
                "exec",
                p.cp.exec(&holding(&alice, token), OnSandbox::new(sid, echo()))
                    .await
                    .map(drop),
            ),
            (
                "exec unfenced",
                p.cp.exec(&alice, OnSandbox::new(sid, echo()))
                    .await
                    .map(drop),
            ),
            (
                "write_file",
                p.cp.write_file(
                    &holding(&alice, token),
                    FileUpload {
                        id: sid.into(),
                        path: "/workspace/f".into(),
                        body: &b"x"[..],
                    },
                )
                .await
                .map(drop),
            ),
            (
                "read_file",
                p.cp.read_file(&alice, FileRequest::new(sid, "/workspace"))
                    .await
                    .map(drop),
            ),
            (
                "list_files",
                p.cp.list_files(&alice, FileRequest::new(sid, "/workspace"))
                    .await
                    .map(drop),
            ),
            (
                "pause",
                p.cp.pause(&holding(&alice, token), SandboxRef::new(sid))
                    .await
                    .map(drop),
            ),
            (
                "reset",
                p.cp.reset(&holding(&alice, token), SandboxRef::new(sid))
                    .await
                    .map(drop),
            ),
            (
                "snapshot",
                p.cp.snapshot(&holding(&alice, token), CheckpointRequest::new(sid))
                    .await
                    .map(drop),
            ),
        ] {
            let e = r.unwrap_err();
            assert_eq!(e.code(), lost, "{what}: {e}");
            assert_eq!(e.code().http_status(), 409, "{what}");
        }
        assert_eq!(
            p.registry.get_sandbox(id).await.unwrap().state,
            SandboxState::Lost
        );
        let gone = p.cp.delete(&alice, SandboxRef::new(sid)).await.unwrap();
        assert_eq!(gone.state, SandboxState::Terminated);
        p.cp.reclaims.settled().await;
        assert!(!p.runtime.live_ids().contains(id));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exec_that_finds_envd_dead_makes_the_sandbox_lost() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id).await;
        envd.die().await;

        let e =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::SandboxLost, "{e}");
        assert_eq!(e.code().http_status(), 409);

        let sandbox =
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(sandbox.state, SandboxState::Lost);
        assert!(sandbox.tainted);
        assert_eq!(sandbox.lease_owner, None, "its lease is revoked");
        // what still ran in it is frozen: nobody enforces its fence any more
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Paused);
        let events = sandbox_events(&p, &alice, &id).await;
        let lost = events
            .iter()
            .find(|e| e.event_type == "sandbox_lost")
            .unwrap();
        assert_eq!(lost.old_state, Some(SandboxState::Leased));
        assert_eq!(lost.new_state, Some(SandboxState::Lost));
        assert_eq!(lost.metadata["reason"], "its envd is not running");
        assert_eq!(lost.metadata["frozen"], true);

        assert_lost_afterwards(&p, &id, Some(lease.token)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_probe_makes_a_sandbox_the_host_lost_lost_and_leaves_the_others() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, _envd) = idle_sandbox(&p).await;
        let (healthy, _) = idle_sandbox(&p).await;
        assert!(p.runtime.vanish(&id).await);

        p.cp.probe_envds().await;

        let sandbox =
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(sandbox.state, SandboxState::Lost);
        assert!(sandbox.tainted);
        let events = sandbox_events(&p, &alice, &id).await;
        let taint = events.last().unwrap();
        assert_eq!(taint.event_type, "tainted");
        assert_eq!(taint.metadata["cause"], "envd_died");
        let lost = &events[events.len() - 2];
        assert_eq!(lost.event_type, "sandbox_lost");
        assert_eq!(lost.old_state, Some(SandboxState::Idle));
        assert_eq!(lost.new_state, Some(SandboxState::Lost));
        assert_eq!(lost.metadata["frozen"], false, "nothing left to freeze");

        let other =
            p.cp.get(&alice, SandboxRef::new(healthy.as_str()))
                .await
                .unwrap();
        assert_eq!(other.state, SandboxState::Idle);
        assert!(!other.tainted);
        p.cp.exec(&alice, OnSandbox::new(healthy.as_str(), echo()))
            .await
            .unwrap();

        // probing again changes nothing
        let before = row(&p, &id).await;
        p.cp.probe_envds().await;
        assert_eq!(row(&p, &id).await, before);

        assert_lost_afterwards(&p, &id, None).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resume_and_lease_acquire_on_a_lost_sandbox_say_it_is_lost() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        envd.die().await;
        p.cp.probe_envds().await;
        assert_eq!(
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap()
                .state,
            SandboxState::Lost
        );
        assert_code(
            p.cp.resume(&alice, SandboxRef::new(id.as_str())).await,
            ErrorCode::SandboxLost,
            "resume",
        );
        assert_code(
            p.cp.lease_acquire(
                &alice,
                OnSandbox::new(
                    id.as_str(),
                    AcquireLeaseRequest {
                        owner: "agent-1".into(),
                        ttl_s: None,
                    },
                ),
            )
            .await,
            ErrorCode::SandboxLost,
            "lease_acquire",
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn snapshot_fork_hibernate_and_level_two_reset_need_a_snapshottable_runtime() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let before = row(&p, &id).await;
        let (creates, destroys) = (p.runtime.create_calls(), p.runtime.destroy_calls());
        let sid = id.as_str();

        for (what, r) in [
            (
                "snapshot",
                p.cp.snapshot(&alice, CheckpointRequest::new(sid))
                    .await
                    .map(drop),
            ),
            (
                "fork",
                p.cp.fork(&alice, OnSandbox::new(sid, ForkRequest::default()))
                    .await
                    .map(drop),
            ),
            (
                "hibernate",
                p.cp.hibernate(&alice, SandboxRef::new(sid)).await.map(drop),
            ),
            (
                "reset level 2",
                p.cp.reset_level(
                    &alice,
                    ResetRequest {
                        id: sid.into(),
                        level: 2,
                    },
                )
                .await
                .map(drop),
            ),
        ] {
            let e = r.unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidRequest, "{what}: {e}");
            assert_eq!(e.code().http_status(), 400, "{what}");
            assert!(
                e.to_string().contains("not supported by runtime crun"),
                "{what}: {e}"
            );
        }

        assert_eq!(row(&p, &id).await, before);
        assert_eq!(p.runtime.create_calls(), creates, "no fork was created");
        assert_eq!(p.runtime.destroy_calls(), destroys);
        assert_eq!(p.runtime.live_ids(), vec![id.clone()]);
        assert_eq!(
            p.runtime.status(&id).await.unwrap(),
            RuntimeStatus::Running,
            "not left frozen"
        );
        assert_eq!(envd.sweeps(), 0);
        p.cp.exec(&alice, OnSandbox::new(sid, echo()))
            .await
            .unwrap();
    }

    /// Pause is not a state and keeps the lease; ending the lease while the
    /// sandbox is frozen must not cost the sandbox: the control plane thaws
    /// it for the fence move (envd ends the holder's processes first) and
    /// freezes it again. Before the fix the push went to the frozen envd,
    /// waited out the 10 s timeout and made the sandbox Lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn releasing_the_lease_of_a_paused_sandbox_keeps_the_sandbox() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id).await;
        p.cp.pause(&holding(&alice, lease.token), SandboxRef::new(id.as_str()))
            .await
            .unwrap();

        p.cp.lease_release(
            &alice,
            OnSandbox::new(
                id.as_str(),
                aviary_core::api::ReleaseLeaseRequest { token: lease.token },
            ),
        )
        .await
        .unwrap();

        let sandbox =
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(sandbox.state, SandboxState::Idle);
        assert!(!sandbox.tainted);
        // the holder's processes were ended while frozen, before the thaw
        assert_eq!(p.runtime.frozen_kill_calls(), 1);
        // frozen again after the fence move, as the caller left it
        assert_eq!(p.runtime.status(&id).await.unwrap(), RuntimeStatus::Paused);
        p.cp.resume(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        assert_eq!(envd.fence(), None, "the release reached envd");
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();
    }
}
