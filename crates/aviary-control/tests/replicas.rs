//! Several control planes on one registry (replicas): each drives only its
//! own node's compute. Over the in-memory fakes, without root.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::SandboxRef;
    use aviary_core::api::CreateSandboxRequest;
    use aviary_core::{ErrorCode, SandboxState};
    use aviary_registry::{FenceCheck, Registry, TransitionCtx};

    fn on(node: &str) -> aviary_control::ControlConfig {
        let mut cfg = config();
        cfg.local_node = node.into();
        cfg
    }

    #[tokio::test]
    async fn a_replica_creates_on_its_node_and_leaves_other_nodes_alone() {
        let p = plane_with(on("node-a")).await;
        let cx = tenant("acme");
        let made =
            p.cp.create(&cx, CreateSandboxRequest::default())
                .await
                .unwrap();
        let id = made.sandbox.id.clone();
        let rec = p.registry.get_sandbox(&id).await.unwrap();
        assert_eq!(rec.node, "node-a", "the sandbox is on this replica's node");

        // the same sandbox seen from a control plane that is node-b
        // (another replica on the same registry): the record, its TTL past
        let mut foreign = aviary_registry::conformance::sample_sandbox("acme");
        foreign.node = "node-b".into();
        foreign.expires_at = Some(aviary_core::now() - time::Duration::seconds(5));
        let row = p
            .registry
            .insert_sandbox(&foreign, TransitionCtx::default())
            .await
            .unwrap();
        p.registry
            .transition(
                &row.id,
                row.version,
                &[
                    SandboxState::Planning,
                    SandboxState::Allocating,
                    SandboxState::Locking,
                    SandboxState::Idle,
                ],
                FenceCheck::Skip,
                TransitionCtx::default(),
            )
            .await
            .unwrap();
        p.cp.sweep().await.unwrap();
        let after = p.registry.get_sandbox(&row.id).await.unwrap();
        assert_eq!(
            after.state,
            SandboxState::Idle,
            "the TTL of node-b's sandbox is node-b's to enforce"
        );
        // work that needs its compute names the node
        let e =
            p.cp.pause(&cx, SandboxRef::new(row.id.as_str()))
                .await
                .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unavailable);
        assert!(e.to_string().contains("node-b"), "{e}");
        // and a restart of node-a's control plane does not mark it lost
        let p = restart_with(p, on("node-a")).await;
        let after = p.registry.get_sandbox(&row.id).await.unwrap();
        assert_eq!(after.state, SandboxState::Idle, "not node-a's to reconcile");
        assert_eq!(
            p.registry.get_sandbox(&id).await.unwrap().state,
            SandboxState::Idle,
            "its own sandbox re-attached"
        );
    }
}
