//! Several runtimes side by side in one control plane (`RuntimeSet`): a
//! sandbox runs on the runtime its class allows, every later call goes to
//! that runtime, and a runtime nobody serves is a clear refusal.

mod support;

#[cfg(test)]
mod tests {
    use super::support::*;
    use aviary_control::requests::{OnSandbox, SandboxRef};
    use aviary_control::RuntimeSet;
    use aviary_core::api::{CreateSandboxRequest, ExecRequest};
    use aviary_core::{ErrorCode, RuntimeName};
    use aviary_fakes::FakeRuntime;
    use aviary_registry::MemoryRegistry;
    use std::sync::Arc;

    /// The built-in classes plus `runc-only`, a copy of the default class
    /// that allows runc alone.
    fn config_with_runc_class() -> aviary_control::ControlConfig {
        let mut cfg = config();
        let mut c = cfg
            .settings
            .class(&cfg.default_class)
            .expect("default class")
            .clone();
        c.name = "runc-only".into();
        c.runtimes = vec![RuntimeName::Runc];
        cfg.settings.classes.push(c);
        cfg
    }

    async fn plane_of(
        cfg: aviary_control::ControlConfig,
        runtimes: Vec<Arc<FakeRuntime>>,
    ) -> Arc<aviary_control::ControlPlane> {
        let templates = Arc::new(MemoryTemplates::default());
        ready(cfg, backends(&MemoryRegistry::new(), &runtimes, templates)).await
    }

    fn echo() -> ExecRequest {
        ExecRequest {
            cmd: Some(vec!["echo".into(), "ok".into()]),
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_sandbox_runs_on_the_runtime_its_class_allows() {
        let crun = Arc::new(FakeRuntime::new().unwrap());
        let runc = Arc::new(FakeRuntime::new().unwrap().with_name("runc"));
        let cp = plane_of(config_with_runc_class(), vec![crun.clone(), runc.clone()]).await;
        let alice = tenant("alice");

        let on_default = cp
            .create(&alice, CreateSandboxRequest::default())
            .await
            .unwrap();
        assert_eq!(on_default.sandbox.runtime, "crun");
        let on_runc = cp
            .create(
                &alice,
                CreateSandboxRequest {
                    class: Some("runc-only".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(on_runc.sandbox.runtime, "runc");
        assert_eq!(crun.live_ids(), vec![on_default.sandbox.id.clone()]);
        assert_eq!(runc.live_ids(), vec![on_runc.sandbox.id.clone()]);

        // later calls reach the sandbox's own runtime and envd
        let out = cp
            .exec(&alice, OnSandbox::new(on_runc.sandbox.id.as_str(), echo()))
            .await
            .unwrap();
        assert_eq!(out.stdout, "ok\n");
        assert_eq!(runc.envd(&on_runc.sandbox.id).unwrap().execs().len(), 1);
        cp.pause(&alice, SandboxRef::new(on_runc.sandbox.id.as_str()))
            .await
            .unwrap();
        assert_eq!(
            aviary_runtime::Runtime::status(runc.as_ref(), &on_runc.sandbox.id)
                .await
                .unwrap(),
            aviary_runtime::RuntimeStatus::Paused
        );
        cp.resume(&alice, SandboxRef::new(on_runc.sandbox.id.as_str()))
            .await
            .unwrap();
        cp.delete(&alice, SandboxRef::new(on_runc.sandbox.id.as_str()))
            .await
            .unwrap();
        cp.reclaims.settled().await;
        assert!(runc.live_ids().is_empty());
        assert_eq!(runc.destroy_calls(), 1);
        assert_eq!(crun.destroy_calls(), 0, "crun's sandbox is untouched");
        assert_eq!(crun.live_ids().len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runtime_no_node_serves_is_refused_before_anything_starts() {
        let crun = Arc::new(FakeRuntime::new().unwrap());
        let cp = plane_of(config_with_runc_class(), vec![crun.clone()]).await;
        let e = cp
            .create(
                &tenant("alice"),
                CreateSandboxRequest {
                    class: Some("runc-only".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                e.code(),
                ErrorCode::Unavailable | ErrorCode::CapacityExhausted
            ),
            "{e:?}"
        );
        assert_eq!(crun.create_calls(), 0);
    }

    /// A runtime without `Pausable` (as Kubernetes): creates, execs, leases
    /// and deletes work; pause, resume and hibernate answer `unsupported`
    /// naming the runtime, and change nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runtime_that_cannot_pause_serves_everything_else() {
        let fake = Arc::new(FakeRuntime::new().unwrap());
        let templates = Arc::new(MemoryTemplates::default());
        let cp = ready(
            config(),
            backends_with(
                &MemoryRegistry::new(),
                vec![fake.basic()],
                templates,
                Arc::new(NoTrees),
                Arc::new(aviary_control::NoNodes),
            ),
        )
        .await;
        let alice = tenant("alice");
        let sbx = cp
            .create(&alice, CreateSandboxRequest::default())
            .await
            .unwrap()
            .sandbox;
        let id = sbx.id.as_str();

        let e = cp.pause(&alice, SandboxRef::new(id)).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unsupported, "{e:?}");
        assert_eq!(e.code().http_status(), 409);
        assert!(e.public_message().contains("crun"), "{e}");
        // hibernation needs a snapshot first, which this runtime cannot take either
        let e = cp.hibernate(&alice, SandboxRef::new(id)).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidRequest, "{e:?}");
        assert!(e.public_message().contains("runtime crun"), "{e}");
        let e = cp.resume(&alice, SandboxRef::new(id)).await.unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "never paused: {e:?}");
        assert_eq!(
            aviary_runtime::Runtime::status(fake.as_ref(), &sbx.id)
                .await
                .unwrap(),
            aviary_runtime::RuntimeStatus::Running
        );
        let now = cp.get(&alice, SandboxRef::new(id)).await.unwrap();
        assert!(!now.paused);
        assert_eq!(now.state, sbx.state);

        // a lease moves the fence (no freeze involved) and execs still run
        let lease = cp
            .lease_acquire(
                &alice,
                OnSandbox::new(
                    id,
                    aviary_core::api::AcquireLeaseRequest {
                        owner: "agent".into(),
                        ttl_s: None,
                    },
                ),
            )
            .await
            .unwrap();
        let out = cp
            .exec(&holding(&alice, lease.token), OnSandbox::new(id, echo()))
            .await
            .unwrap();
        assert_eq!(out.stdout, "ok\n");
        cp.sweep().await.unwrap();
        cp.delete(&holding(&alice, lease.token), SandboxRef::new(id))
            .await
            .unwrap();
        // the compute goes in the background, after the answer
        cp.reclaims.settled().await;
        assert!(fake.live_ids().is_empty());
        assert_eq!(fake.frozen_kill_calls(), 0);
    }

    #[test]
    fn a_runtime_set_refuses_two_runtimes_of_one_name() {
        let rt = || Arc::new(FakeRuntime::new().unwrap()).capable();
        assert!(RuntimeSet::new(vec![rt(), rt()])
            .unwrap_err()
            .contains("configured twice"));
        assert!(RuntimeSet::new(vec![])
            .unwrap_err()
            .contains("at least one"));
    }
}
