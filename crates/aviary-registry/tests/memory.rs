//! The registry and lease conformance suites on [`MemoryRegistry`], plus the
//! two properties a test double must not lose: clones share one storage, and
//! the leases fencing its transitions are the ones its [`LeaseStore`] grants.

#[cfg(test)]
mod tests {
    use async_trait::async_trait;
    use aviary_core::{SandboxId, SandboxState};
    use aviary_leases::conformance::LeaseHarness;
    use aviary_leases::LeaseStore;
    use aviary_registry::conformance::{sample_sandbox, RegistryHarness};
    use aviary_registry::{FenceCheck, MemoryRegistry, Registry, RegistryError, TransitionCtx};
    use std::time::Duration;

    /// Opening is cloning: every open sees one storage, as a restart would.
    struct Harness(MemoryRegistry);

    #[async_trait]
    impl RegistryHarness for Harness {
        type Registry = MemoryRegistry;
        async fn open(&self) -> MemoryRegistry {
            self.0.clone()
        }
    }

    #[async_trait]
    impl LeaseHarness for Harness {
        type Store = MemoryRegistry;
        async fn open(&self) -> MemoryRegistry {
            self.0.clone()
        }
        async fn create_sandbox(&self, store: &MemoryRegistry) -> SandboxId {
            let new = sample_sandbox("lease-conformance");
            store
                .insert_sandbox(&new, TransitionCtx::default())
                .await
                .unwrap();
            new.id
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn registry_conformance() {
        aviary_registry::conformance::run_all(&Harness(MemoryRegistry::new())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lease_conformance() {
        aviary_leases::conformance::run_all(&Harness(MemoryRegistry::new())).await;
    }

    #[tokio::test]
    async fn clones_share_sandboxes_and_leases() {
        let a = MemoryRegistry::new();
        let b = a.clone();
        let new = sample_sandbox("acme");
        a.insert_sandbox(&new, TransitionCtx::default())
            .await
            .unwrap();
        assert_eq!(b.get_sandbox(&new.id).await.unwrap().id, new.id);

        let lease = b
            .acquire(
                &new.id,
                "agent-1",
                Duration::from_secs(60),
                aviary_core::now(),
            )
            .await
            .unwrap();
        let planning = [SandboxState::Planning];
        let e = a
            .transition(
                &new.id,
                0,
                &planning,
                FenceCheck::Require(None),
                TransitionCtx::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e, RegistryError::LeaseRequired, "the clone's lease fences");
        let rec = a
            .transition(
                &new.id,
                0,
                &planning,
                FenceCheck::Require(Some(lease.token)),
                TransitionCtx::default(),
            )
            .await
            .unwrap();
        assert_eq!((rec.state, rec.version), (SandboxState::Planning, 1));
    }
}
