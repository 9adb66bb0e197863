//! Lease and fence rules of the control plane over fakes: tokens are handed
//! out only once envd enforces their fence; a mutating call without the
//! current token is refused before it reaches envd or changes the registry;
//! renew keeps the fence, release, expiry and reset move it, and fences only
//! grow.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{
        FileRequest, FileUpload, OnSandbox, RemoveFileRequest, SandboxRef,
    };
    use aviary_core::api::{
        AcquireLeaseRequest, CreateSandboxRequest, ExecRequest, Lease, ReleaseLeaseRequest,
        RenewLeaseRequest,
    };
    use aviary_core::{ErrorCode, LeaseToken, SandboxId, SandboxState};
    use aviary_fakes::FakeEnvd;
    use aviary_leases::LeaseStore;
    use aviary_registry::Registry;
    use std::time::Duration;

    /// `echo hi`; the lease token it runs under is the context's.
    fn echo() -> ExecRequest {
        ExecRequest {
            cmd: Some(vec!["echo".into(), "hi".into()]),
            ..Default::default()
        }
    }

    fn acquire_req(owner: &str) -> AcquireLeaseRequest {
        AcquireLeaseRequest {
            owner: owner.into(),
            ttl_s: None,
        }
    }

    /// An idle, unleased sandbox of `alice` and its fake envd.
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

    async fn acquire(p: &Plane, id: &SandboxId, owner: &str) -> Lease {
        p.cp.lease_acquire(
            &tenant("alice"),
            OnSandbox::new(id.as_str(), acquire_req(owner)),
        )
        .await
        .unwrap()
    }

    async fn release(p: &Plane, id: &SandboxId, token: LeaseToken) {
        p.cp.lease_release(
            &tenant("alice"),
            OnSandbox::new(id.as_str(), ReleaseLeaseRequest { token }),
        )
        .await
        .unwrap();
    }

    /// What a refused call must leave as it was: the row's state and
    /// version, and the event log.
    async fn row(p: &Plane, id: &SandboxId) -> (SandboxState, i64, usize) {
        let rec = p.registry.get_sandbox(id).await.unwrap();
        let events = sandbox_events(p, &tenant("alice"), id).await.len();
        (rec.state, rec.version, events)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acquire_hands_out_the_token_only_after_envd_took_its_fence() {
        let p = plane().await;
        let (id, envd) = idle_sandbox(&p).await;
        assert_eq!(envd.fence(), None);

        let lease = acquire(&p, &id, "agent-1").await;
        // the fake sets its fence before it answers `set_fence`, and the
        // control plane returns the token only after that answer
        assert_eq!(envd.fence(), Some(lease.token.fence()));
        let text = lease.token.to_string();
        let (fence, secret) = text.split_once('.').unwrap();
        assert_eq!(fence, lease.token.fence().to_string());
        assert_eq!(secret.len(), 32, "{text}");
        assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{text}");
        assert_eq!(text.parse::<LeaseToken>().unwrap(), lease.token);
        assert_eq!(lease.owner, "agent-1");
        assert_eq!(lease.sandbox_id, id);

        let calls = calls_until(&envd, |c| c.iter().any(|c| c.method == "set_fence")).await;
        let pushes: Vec<_> = calls.iter().filter(|c| c.method == "set_fence").collect();
        assert_eq!(pushes.len(), 1, "{calls:?}");
        assert_eq!(pushes[0].token, Some(lease.token.fence()));
        assert_eq!(pushes[0].fence, None, "the sandbox was unleased before");
        assert_eq!(pushes[0].result, Ok(()));

        let sandbox =
            p.cp.get(&tenant("alice"), SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(sandbox.state, SandboxState::Leased);
        assert_eq!(sandbox.lease_owner.as_deref(), Some("agent-1"));
        let events = sandbox_events(&p, &tenant("alice"), &id).await;
        let acquired = events
            .iter()
            .find(|e| e.event_type == "lease_acquired")
            .unwrap();
        assert_eq!(acquired.old_state, Some(SandboxState::Idle));
        assert_eq!(acquired.new_state, Some(SandboxState::Leased));
        assert_eq!(acquired.metadata["fence"], lease.token.fence());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_acquire_while_held_is_lease_held() {
        let p = plane().await;
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id, "agent-1").await;
        let before = row(&p, &id).await;
        let sweeps = envd.sweeps();

        for owner in ["agent-2", "agent-1"] {
            // even the holder's own second acquire: a lease is held, not re-entrant
            let e =
                p.cp.lease_acquire(
                    &tenant("alice"),
                    OnSandbox::new(id.as_str(), acquire_req(owner)),
                )
                .await
                .unwrap_err();
            assert_eq!(e.code(), ErrorCode::LeaseHeld, "{e}");
            assert_eq!(e.code().http_status(), 409);
        }

        assert_eq!(row(&p, &id).await, before);
        assert_eq!(envd.fence(), Some(lease.token.fence()));
        assert_eq!(
            envd.sweeps(),
            sweeps,
            "the holder's processes were not touched"
        );
        // the holder keeps working
        p.cp.exec(
            &holding(&tenant("alice"), lease.token),
            OnSandbox::new(id.as_str(), echo()),
        )
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mutating_calls_without_the_current_token_never_reach_envd() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        envd.put_file("/workspace/keep", "kept").unwrap();
        let old = acquire(&p, &id, "agent-1").await;
        release(&p, &id, old.token).await;
        let lease = acquire(&p, &id, "agent-1").await;
        assert!(lease.token.fence() > old.token.fence());
        envd.clear_calls();
        let before = row(&p, &id).await;
        let destroys = p.runtime.destroy_calls();

        let wrong_secret = LeaseToken::generate(lease.token.fence());
        let cases = [
            (None, ErrorCode::LeaseRequired),
            (Some(old.token), ErrorCode::StaleToken),
            (Some(wrong_secret), ErrorCode::StaleToken),
        ];
        for (token, code) in cases {
            let e =
                p.cp.exec(&holding(&alice, token), OnSandbox::new(id.as_str(), echo()))
                    .await
                    .unwrap_err();
            assert_eq!(e.code(), code, "exec with {token:?}: {e}");
            let e =
                p.cp.write_file(
                    &holding(&alice, token),
                    FileUpload {
                        id: id.to_string(),
                        path: "/workspace/new".into(),
                        body: &b"data"[..],
                    },
                )
                .await
                .unwrap_err();
            assert_eq!(e.code(), code, "write_file with {token:?}: {e}");
            let e =
                p.cp.mkdir(
                    &holding(&alice, token),
                    FileRequest::new(id.as_str(), "/workspace/dir"),
                )
                .await
                .unwrap_err();
            assert_eq!(e.code(), code, "mkdir with {token:?}: {e}");
            let e =
                p.cp.remove(
                    &holding(&alice, token),
                    RemoveFileRequest {
                        id: id.to_string(),
                        path: "/workspace/keep".into(),
                        recursive: false,
                    },
                )
                .await
                .unwrap_err();
            assert_eq!(e.code(), code, "remove with {token:?}: {e}");
            let e =
                p.cp.delete(&holding(&alice, token), SandboxRef::new(id.as_str()))
                    .await
                    .unwrap_err();
            assert_eq!(e.code(), code, "delete with {token:?}: {e}");
            assert_eq!(e.code().http_status(), 409);
        }

        // nothing reached envd: no exec was accepted, no mutating call arrived
        assert!(envd.execs().is_empty(), "{:?}", envd.execs());
        let mutating = ["exec", "write_file", "mkdir", "remove", "kill_all"];
        let calls = envd.calls();
        assert!(
            !calls.iter().any(|c| mutating.contains(&c.method)),
            "{calls:?}"
        );
        assert_eq!(envd.file("/workspace/keep"), Some(b"kept".to_vec()));
        assert_eq!(envd.file("/workspace/new"), None);
        assert_eq!(envd.fence(), Some(lease.token.fence()));
        // …and nothing changed in the registry or the runtime but the
        // taint the stale and foreign tokens set (once), each attempt an event
        let (state, version, events) = row(&p, &id).await;
        assert_eq!((state, version), (before.0, before.1 + 1));
        assert!(p.registry.get_sandbox(&id).await.unwrap().tainted);
        let added: Vec<_> = sandbox_events(&p, &alice, &id).await[before.2..]
            .iter()
            .map(|e| (e.event_type.clone(), e.metadata["cause"].clone()))
            .collect();
        assert_eq!(added.len(), events - before.2);
        assert_eq!(added.len(), 10, "two stale tokens on five calls: {added:?}");
        assert!(
            added
                .iter()
                .all(|(t, c)| t == "tainted" && c == "stale_token"),
            "{added:?}"
        );
        assert_eq!(p.runtime.destroy_calls(), destroys);
        assert_eq!(p.runtime.live_ids(), vec![id.clone()]);

        // the current token works, and envd saw it
        let out =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap();
        assert_eq!(out.stdout, "hi\n");
        let execs = envd.execs();
        assert_eq!(execs.len(), 1);
        assert_eq!(execs[0].token, Some(lease.token.fence()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn renew_keeps_the_fence() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id, "agent-1").await;
        let sweeps = envd.sweeps();

        let renewed =
            p.cp.lease_renew(
                &alice,
                OnSandbox::new(
                    id.as_str(),
                    RenewLeaseRequest {
                        token: lease.token,
                        ttl_s: Some(600),
                    },
                ),
            )
            .await
            .unwrap();
        assert_eq!(renewed.token, lease.token, "same fence, same secret");
        assert!(renewed.expires_at > lease.expires_at);
        assert_eq!(envd.fence(), Some(lease.token.fence()));
        assert_eq!(
            envd.sweeps(),
            sweeps,
            "a renewal does not sweep the sandbox"
        );
        p.cp.exec(
            &holding(&alice, lease.token),
            OnSandbox::new(id.as_str(), echo()),
        )
        .await
        .unwrap();

        // only the current token renews
        let e =
            p.cp.lease_renew(
                &alice,
                OnSandbox::new(
                    id.as_str(),
                    RenewLeaseRequest {
                        token: LeaseToken::generate(lease.token.fence()),
                        ttl_s: None,
                    },
                ),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleToken, "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn release_moves_the_fence_and_the_next_fence_is_greater() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let first = acquire(&p, &id, "agent-1").await;
        let sweeps = envd.sweeps();

        release(&p, &id, first.token).await;
        assert_eq!(envd.fence(), None, "envd was told before release returned");
        assert_eq!(envd.sweeps(), sweeps + 1, "the old holder's processes end");
        let sandbox =
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(sandbox.state, SandboxState::Idle);
        assert_eq!(sandbox.lease_owner, None);
        let events = sandbox_events(&p, &alice, &id).await;
        let released = events.last().unwrap();
        assert_eq!(released.event_type, "lease_released");
        assert_eq!(released.new_state, Some(SandboxState::Idle));

        // the released token is dead everywhere; an unleased call needs none
        let e =
            p.cp.exec(
                &holding(&alice, first.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleToken, "{e}");
        let e =
            p.cp.lease_release(
                &alice,
                OnSandbox::new(id.as_str(), ReleaseLeaseRequest { token: first.token }),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleToken, "{e}");
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), echo()))
            .await
            .unwrap();

        let second = acquire(&p, &id, "agent-2").await;
        assert!(
            second.token.fence() > first.token.fence(),
            "{} then {}",
            first.token.fence(),
            second.token.fence()
        );
        assert_eq!(envd.fence(), Some(second.token.fence()));
        assert_eq!(envd.highest_fence(), Some(second.token.fence()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sweep_expires_a_lease_whose_time_has_passed() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let lease = acquire(&p, &id, "agent-1").await;
        // There is no clock to inject into the control plane, but the lease
        // store takes `now` as an argument: a renewal "two minutes ago" with
        // a ttl of one second leaves a lease whose expiry has passed, without
        // the test sleeping.
        let long_ago = aviary_core::now() - time::Duration::minutes(2);
        let rewound = p
            .registry
            .renew(&id, lease.token, Duration::from_secs(1), long_ago)
            .await
            .unwrap();
        assert!(rewound.expires_at < aviary_core::now());
        let sweeps = envd.sweeps();
        let before =
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(before.state, SandboxState::Leased);

        p.cp.sweep().await.unwrap();

        let after =
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(after.state, SandboxState::Idle);
        assert_eq!(after.lease_owner, None);
        let events = sandbox_events(&p, &alice, &id).await;
        let expired = events
            .iter()
            .find(|e| e.event_type == "lease_expired")
            .unwrap();
        assert_eq!(expired.old_state, Some(SandboxState::Leased));
        assert_eq!(expired.new_state, Some(SandboxState::Idle));
        assert_eq!(expired.metadata["owner"], "agent-1");
        assert_eq!(expired.metadata["fence"], lease.token.fence());
        assert_eq!(
            envd.fence(),
            None,
            "envd's fence moved off the expired lease"
        );
        assert_eq!(envd.sweeps(), sweeps + 1);

        let e =
            p.cp.exec(
                &holding(&alice, lease.token),
                OnSandbox::new(id.as_str(), echo()),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::StaleToken, "{e}");
        let next = acquire(&p, &id, "agent-2").await;
        assert!(next.token.fence() > lease.token.fence());

        // a second sweep finds nothing to expire
        p.cp.sweep().await.unwrap();
        assert_eq!(
            p.cp.get(&alice, SandboxRef::new(id.as_str()))
                .await
                .unwrap()
                .state,
            SandboxState::Leased
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fences_only_grow_across_acquire_release_expiry_and_reset() {
        let p = plane().await;
        let alice = tenant("alice");
        let (id, envd) = idle_sandbox(&p).await;
        let mut fences = Vec::new();
        for round in 0..4 {
            let lease = acquire(&p, &id, &format!("agent-{round}")).await;
            fences.push(lease.token.fence());
            assert_eq!(envd.fence(), Some(lease.token.fence()));
            match round {
                0 | 1 => release(&p, &id, lease.token).await,
                2 => {
                    // revoked by a level-1 reset
                    p.cp.reset(&holding(&alice, lease.token), SandboxRef::new(id.as_str()))
                        .await
                        .unwrap();
                }
                _ => {
                    let long_ago = aviary_core::now() - time::Duration::minutes(2);
                    p.registry
                        .renew(&id, lease.token, Duration::from_secs(1), long_ago)
                        .await
                        .unwrap();
                    p.cp.sweep().await.unwrap();
                }
            }
            assert_eq!(envd.fence(), None, "round {round}");
        }
        let last = acquire(&p, &id, "agent-last").await;
        fences.push(last.token.fence());
        assert!(
            fences.windows(2).all(|w| w[0] < w[1]),
            "fences must strictly increase: {fences:?}"
        );
        assert_eq!(envd.highest_fence(), Some(last.token.fence()));
        let calls = calls_until(&envd, |c| {
            c.iter()
                .any(|c| c.method == "set_fence" && c.token == Some(last.token.fence()))
        })
        .await;
        assert!(
            calls
                .iter()
                .filter(|c| c.method == "set_fence")
                .all(|c| c.result.is_ok()),
            "envd refused a fence: {calls:?}"
        );
    }
}
