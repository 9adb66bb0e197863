//! A sandbox's live resource usage through the control plane, over fakes:
//! the runtime's counters beside the class's limits, who may read them
//! (the tenant; an admin across tenants, on request), and which states
//! have none (409 `invalid_state`, nothing changed).

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{SandboxRef, UsageRequest};
    use aviary_control::OpError;
    use aviary_core::api::CreateSandboxRequest;
    use aviary_core::{ErrorCode, SandboxId, SandboxState};
    use aviary_registry::Registry;
    use aviary_runtime::ResourceUsage;

    const MIB: u64 = 1024 * 1024;

    #[track_caller]
    fn assert_code<T: std::fmt::Debug>(r: Result<T, OpError>, code: ErrorCode, what: &str) {
        let e = r.unwrap_err();
        assert_eq!(e.code(), code, "{what}: {e}");
    }

    async fn idle_sandbox(p: &Plane) -> SandboxId {
        p.cp.create(&tenant("alice"), CreateSandboxRequest::default())
            .await
            .unwrap()
            .sandbox
            .id
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn usage_is_the_runtime_counters_beside_the_class_limits() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = idle_sandbox(&p).await;
        let rec = p.registry.get_sandbox(&id).await.unwrap();
        assert!(p.runtime.set_usage(
            &id,
            ResourceUsage {
                memory_current_bytes: 70 * MIB,
                memory_peak_bytes: 90 * MIB,
                cpu_usage_ns: 2_500_000_000,
                oom_kills: 1,
                pids_current: 4,
                disk_free_bytes: Some(100 * MIB),
            }
        ));
        let u =
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!(u.sandbox_id, id);
        assert_eq!((u.state, u.paused), (SandboxState::Idle, false));
        assert_eq!(u.cpu_seconds, 2.5);
        assert_eq!(u.cpu_limit, rec.resources.cpu);
        assert_eq!((u.memory_bytes, u.memory_peak_bytes), (70 * MIB, 90 * MIB));
        assert_eq!(u.memory_limit_bytes, rec.resources.memory_mb * MIB);
        assert_eq!((u.pids, u.pids_limit), (4, u64::from(rec.resources.pids)));
        assert_eq!(u.oom_kills, 1);
        assert_eq!(u.disk_limit_bytes, rec.resources.disk_mb * MIB);
        assert_eq!(u.disk_free_bytes, Some(100 * MIB));
        assert_eq!(
            u.disk_used_bytes,
            Some(rec.resources.disk_mb * MIB - 100 * MIB)
        );

        // a runtime that knows no disk says so; a peak below the current
        // reading (a counter reset, cgroup v1 without max) is the current
        p.runtime.update_usage(&id, |u| {
            u.disk_free_bytes = None;
            u.memory_peak_bytes = 0;
        });
        let u =
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await
                .unwrap();
        assert_eq!((u.disk_free_bytes, u.disk_used_bytes), (None, None));
        assert_eq!(u.memory_peak_bytes, 70 * MIB);

        // a read records nothing and changes nothing
        let events = sandbox_events(&p, &alice, &id).await.len();
        let version = p.registry.get_sandbox(&id).await.unwrap().version;
        p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
            .await
            .unwrap();
        assert_eq!(sandbox_events(&p, &alice, &id).await.len(), events);
        assert_eq!(p.registry.get_sandbox(&id).await.unwrap().version, version);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_tenant_or_an_admin_asking_for_all_tenants_reads_usage() {
        let p = plane().await;
        let id = idle_sandbox(&p).await;
        assert_code(
            p.cp.sandbox_usage(&tenant("mallory"), UsageRequest::new(id.as_str()))
                .await,
            ErrorCode::NotFound,
            "another tenant",
        );
        assert_code(
            p.cp.sandbox_usage(&tenant("alice"), UsageRequest::new("sbx-nope"))
                .await,
            ErrorCode::NotFound,
            "an unknown id",
        );
        assert_code(
            p.cp.sandbox_usage(&tenant("alice"), UsageRequest::new("../../etc"))
                .await,
            ErrorCode::NotFound,
            "a malformed id",
        );
        let across = |id: &SandboxId| UsageRequest {
            id: id.to_string(),
            all_tenants: true,
        };
        // all tenants: admin keys only, refused before anything is read
        assert_code(
            p.cp.sandbox_usage(&tenant("alice"), across(&id)).await,
            ErrorCode::Forbidden,
            "all_tenants without admin",
        );
        // the admin's own tenant does not hold it; across tenants it is found
        assert_code(
            p.cp.sandbox_usage(&admin(), UsageRequest::new(id.as_str()))
                .await,
            ErrorCode::NotFound,
            "admin without all_tenants",
        );
        let u = p.cp.sandbox_usage(&admin(), across(&id)).await.unwrap();
        assert_eq!(u.sandbox_id, id);
        assert!(u.memory_bytes > 0, "{u:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn paused_reads_still_counters_ended_and_lost_compute_are_refused() {
        let p = plane().await;
        let alice = tenant("alice");
        let id = idle_sandbox(&p).await;

        // paused: the cgroup is frozen, its counters are still there
        p.cp.pause(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        let u =
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await
                .unwrap();
        assert!(u.paused, "{u:?}");
        assert!(u.memory_bytes > 0 && u.pids >= 1, "{u:?}");
        p.cp.resume(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();

        // the row says it runs but the runtime has nothing: invalid_state
        assert!(p.runtime.vanish(&id).await);
        assert_code(
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await,
            ErrorCode::InvalidState,
            "compute gone under a live row",
        );
        // once an exec found it gone, it is lost: sandbox_lost
        let exec = aviary_core::api::ExecRequest {
            cmd: Some(vec!["true".into()]),
            ..Default::default()
        };
        let e =
            p.cp.exec(
                &alice,
                aviary_control::requests::OnSandbox::new(id.as_str(), exec),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::SandboxLost, "{e}");
        assert_code(
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await,
            ErrorCode::SandboxLost,
            "lost",
        );

        // ended: invalid_state, whatever the runtime still holds
        let id = idle_sandbox(&p).await;
        p.cp.delete(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        assert_code(
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await,
            ErrorCode::InvalidState,
            "terminated",
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hibernated_sandbox_has_no_usage_until_it_wakes() {
        let p = snapshot_plane(config()).await;
        let alice = tenant("alice");
        let id = idle_sandbox(&p).await;
        p.cp.hibernate(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        assert_code(
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await,
            ErrorCode::InvalidState,
            "hibernated",
        );
        p.cp.wake(&alice, SandboxRef::new(id.as_str()))
            .await
            .unwrap();
        let u =
            p.cp.sandbox_usage(&alice, UsageRequest::new(id.as_str()))
                .await
                .unwrap();
        assert!(u.state.is_live() && u.memory_bytes > 0, "{u:?}");
    }
}
