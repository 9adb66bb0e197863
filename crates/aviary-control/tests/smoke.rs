//! The control plane over fakes, end to end: create → exec → delete, as the
//! HTTP API drives it, without root.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_core::api::{CreateSandboxRequest, ExecRequest};
    use aviary_core::SandboxState;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn create_exec_delete_over_fakes() {
        let p = plane().await;
        let alice = tenant("alice");
        let created =
            p.cp.create(&alice, CreateSandboxRequest::default(), Some("req-1"))
                .await
                .unwrap();
        let id = created.sandbox.id.clone();
        assert_eq!(p.runtime.live_ids(), vec![id.clone()]);
        let spec = &p.runtime.created_specs()[0];
        assert_eq!(spec.template.digest, TEMPLATE_DIGEST);
        let out =
            p.cp.exec(
                &alice,
                id.as_str(),
                &ExecRequest {
                    cmd: Some(vec!["echo".into(), "hi".into()]),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(out.exit_code, 0);
        assert_eq!(out.stdout, "hi\n");
        // another tenant cannot see it
        let bob = tenant("bob");
        let e = p.cp.get(&bob, id.as_str()).await.unwrap_err();
        assert_eq!(e.code(), aviary_core::ErrorCode::NotFound);
        let gone = p.cp.delete(&alice, id.as_str(), None, None).await.unwrap();
        assert_eq!(gone.state, SandboxState::Terminated);
        assert!(p.runtime.live_ids().is_empty());
    }
}
