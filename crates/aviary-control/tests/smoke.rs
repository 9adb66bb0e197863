//! The control plane over fakes, end to end: create → exec → delete, as the
//! HTTP API drives it, without root.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{OnSandbox, SandboxRef};
    use aviary_core::api::{CreateSandboxRequest, ExecRequest};
    use aviary_core::SandboxState;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn create_exec_delete_over_fakes() {
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(
                &alice.clone().with_request_id("req-1"),
                CreateSandboxRequest::default(),
            )
            .await
            .unwrap();
        let id = created.sandbox.id.clone();
        assert_eq!(p.runtime.live_ids(), vec![id.clone()]);
        let spec = &p.runtime.created_specs()[0];
        assert_eq!(spec.template.digest, TEMPLATE_DIGEST);
        let out =
            p.cp.exec(
                &alice,
                OnSandbox::new(
                    id.clone(),
                    ExecRequest {
                        cmd: Some(vec!["echo".into(), "hi".into()]),
                        ..Default::default()
                    },
                ),
            )
            .await
            .unwrap();
        assert_eq!(out.exit_code, 0);
        assert_eq!(out.stdout, "hi\n");
        // another tenant cannot see it
        let bob = tenant("bob");
        let e =
            p.cp.get(&bob, SandboxRef::new(id.clone()))
                .await
                .unwrap_err();
        assert_eq!(e.code(), aviary_core::ErrorCode::NotFound);
        let gone = p.cp.delete(&alice, SandboxRef::new(id)).await.unwrap();
        assert_eq!(gone.state, SandboxState::Terminated);
        p.cp.reclaims.settled().await;
        assert!(p.runtime.live_ids().is_empty());
    }
}
