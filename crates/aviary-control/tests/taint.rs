//! Taint causes that a real sandbox cannot be made to show on demand, over
//! the fakes, through the control plane's real paths: a level-1 reset that
//! leaves processes it could not kill or whose script fails, an envd that
//! answers outside its protocol, and the network layer's egress hook. Each
//! taints with a `tainted` event naming the cause, and a tainted sandbox is
//! not handed out again to its scope. (The causes a real sandbox can show —
//! stale tokens, a dead envd, failed snapshots and restores, OOM kills and
//! full disks while shared, the operator's mark — are tested through the
//! real server in `aviary-server/tests/taint.rs`.)

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{OnSandbox, ResetRequest};
    use aviary_core::api::{CreateSandboxRequest, ExecRequest};
    use aviary_core::{SandboxId, SandboxState};
    use aviary_fakes::ExecReply;
    use aviary_registry::Registry;

    fn in_session(session: &str) -> CreateSandboxRequest {
        CreateSandboxRequest {
            session_id: Some(session.into()),
            ..Default::default()
        }
    }

    /// The `tainted` events of a sandbox: (cause, detail).
    async fn taints(p: &Plane, id: &SandboxId) -> Vec<(String, String)> {
        sandbox_events(p, &tenant("alice"), id)
            .await
            .into_iter()
            .filter(|e| e.event_type == "tainted")
            .map(|e| {
                (
                    e.metadata["cause"].as_str().unwrap_or("").to_owned(),
                    e.metadata["detail"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    }

    async fn tainted(p: &Plane, id: &SandboxId) -> bool {
        p.registry.get_sandbox(id).await.unwrap().tainted
    }

    /// The next create of the same session gets another sandbox, and says
    /// why the first was not reused.
    async fn not_reused(p: &Plane, session: &str, id: &SandboxId) {
        let again =
            p.cp.create(&tenant("alice"), in_session(session))
                .await
                .unwrap();
        assert_ne!(&again.sandbox.id, id, "{:?}", again.decision);
        assert_eq!(again.decision.action, "new_sandbox");
        assert!(
            again.decision.reason.contains("tainted"),
            "{:?}",
            again.decision
        );
    }

    fn reset(id: &SandboxId) -> ResetRequest {
        ResetRequest {
            id: id.to_string(),
            level: 1,
        }
    }

    fn is_reset_script(argv: &[String]) -> bool {
        argv.get(2).is_some_and(|s| s.contains("kill -9 -1"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn processes_a_level_one_reset_could_not_kill_taint_and_level_one_keeps_the_mark() {
        let p = plane().await;
        let alice = tenant("alice");
        let a = p.cp.create(&alice, in_session("s1")).await.unwrap();
        let id = a.sandbox.id.clone();
        let envd = envd_of(&p, &id);
        // a clean reset taints nothing
        p.cp.reset_level(&alice, reset(&id)).await.unwrap();
        assert!(!tainted(&p, &id).await);
        assert!(taints(&p, &id).await.is_empty());

        envd.on_exec(|call| {
            is_reset_script(&call.argv).then(|| ExecReply {
                stdout: b"survivors: 4242 4343\n".to_vec(),
                ..ExecReply::exit(7)
            })
        });
        let after = p.cp.reset_level(&alice, reset(&id)).await.unwrap();
        assert_eq!(after.state, SandboxState::Idle);
        assert!(after.tainted);
        let t = taints(&p, &id).await;
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0, "reset_survivors");
        assert!(t[0].1.contains("4242 4343"), "{t:?}");

        // a level-1 reset that works does not clear the mark
        envd.clear_exec_rules();
        let again = p.cp.reset_level(&alice, reset(&id)).await.unwrap();
        assert!(again.tainted);
        not_reused(&p, "s1", &id).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_level_one_reset_whose_script_fails_taints() {
        let p = plane().await;
        let alice = tenant("alice");
        let a = p.cp.create(&alice, in_session("s2")).await.unwrap();
        let id = a.sandbox.id.clone();
        envd_of(&p, &id).on_exec(|call| is_reset_script(&call.argv).then(|| ExecReply::exit(1)));
        let after = p.cp.reset_level(&alice, reset(&id)).await.unwrap();
        assert!(after.tainted);
        let t = taints(&p, &id).await;
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0, "reset_failed");
        assert!(t[0].1.contains("exited 1"), "{t:?}");
        not_reused(&p, "s2", &id).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_envd_answering_outside_its_protocol_taints() {
        let p = plane().await;
        let alice = tenant("alice");
        let a = p.cp.create(&alice, in_session("s3")).await.unwrap();
        let id = a.sandbox.id.clone();
        let envd = envd_of(&p, &id);
        envd.set_garbled(true);
        let exec = ExecRequest {
            cmd: Some(vec!["true".into()]),
            ..Default::default()
        };
        p.cp.exec(&alice, OnSandbox::new(id.as_str(), exec))
            .await
            .unwrap_err();
        assert!(tainted(&p, &id).await);
        let t = taints(&p, &id).await;
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].0, "envd_protocol");
        envd.set_garbled(false);
        not_reused(&p, "s3", &id).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_egress_hook_taints() {
        let p = plane().await;
        let alice = tenant("alice");
        let a = p.cp.create(&alice, in_session("s4")).await.unwrap();
        let id = a.sandbox.id.clone();
        let denial = |sandbox: &SandboxId| aviary_core::egress::EgressDenial {
            sandbox: sandbox.clone(),
            profile: "pypi-readonly".into(),
            host: "evil.org".into(),
            port: 443,
            method: "CONNECT".into(),
            reason: "domain is not on the allow list".into(),
        };
        assert!(p.cp.egress_denied(&denial(&id)).await.unwrap());
        let t = taints(&p, &id).await;
        assert_eq!(
            t,
            vec![(
                "egress_denied".to_owned(),
                "CONNECT evil.org:443: domain is not on the allow list".to_owned()
            )]
        );
        not_reused(&p, "s4", &id).await;
        // a sandbox that is gone has nothing left to protect
        assert!(!p
            .cp
            .egress_denied(&denial(&SandboxId::generate()))
            .await
            .unwrap());
    }
}
