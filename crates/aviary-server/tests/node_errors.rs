//! Errors of a node agent reach the client as the same code as the same
//! failure of the control plane's own node: the agent answers with
//! `RuntimeError::code()`, `RemoteRuntime` rebuilds an error of that code,
//! and the server maps it through the one table.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

use async_trait::async_trait;
use aviary_core::api::CreateSandboxRequest;
use aviary_core::{ErrorCode, SandboxId};
use aviary_runtime::{
    Pausable, ResourceUsage, Runtime, RuntimeError, RuntimeStatus, SandboxHandle, SandboxSpec,
};
use std::sync::Arc;

/// A real runtime whose host is full: every create fails the way the OCI
/// runtime fails when its user-id ranges are used up.
struct FullHost(aviary_runtime_oci::OciRuntime);

#[async_trait]
impl Runtime for FullHost {
    fn name(&self) -> &str {
        self.0.name()
    }
    async fn create(&self, _spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        Err(RuntimeError::CapacityExhausted {
            what: "all user-id ranges are in use".into(),
        })
    }
    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.0.destroy(id).await
    }
    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        self.0.status(id).await
    }
    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        self.0.usage(id).await
    }
    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        self.0.list().await
    }
}

#[async_trait]
impl Pausable for FullHost {
    async fn pause(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.0.pause(id).await
    }
    async fn resume(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.0.resume(id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_remote_host_is_503_capacity_exhausted() {
    let ts = common::start().await;
    let c = &ts.client;
    let dir = tempfile::Builder::new()
        .prefix("avne")
        .tempdir_in("/tmp")
        .unwrap();
    let state = dir.path().join("node-full");
    let rt = aviary_runtime_oci::OciRuntime::new(aviary_runtime_oci::OciConfig::new(
        aviary_runtime_oci::OciBinary::Crun,
        state.join("sandboxes"),
    ))
    .unwrap();
    let token = "token-node-full".to_string();
    // far bigger than this host, so the scheduler places there
    let agent = aviary_node::start_node(aviary_node::NodeConfig {
        id: "node-full".into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        token: token.clone(),
        runtime: Arc::new(FullHost(rt)),
        layers: None,
        templates: aviary_templates::TemplateStore::open(common::template_cache()).unwrap(),
        state_dir: state.join("agent"),
        capacity: aviary_node::Capacity {
            cpu: 64.0,
            memory_mb: 262_144,
        },
        provided_binds: vec![aviary_node::ProvidedBind::envd(common::envd_binary())],
    })
    .await
    .unwrap();
    c.add_node("node-full", &agent.addr().to_string(), &token)
        .await
        .unwrap();

    let err = c
        .create_sandbox(&CreateSandboxRequest {
            class: Some("compute-large".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    let evs = c.events(None, None, Some(1000)).await.unwrap().events;
    let placement = evs
        .iter()
        .rev()
        .find(|e| e.event_type == "placement")
        .expect("placement event");
    assert_eq!(placement.metadata["node_id"], "node-full", "{placement:?}");
    match &err {
        aviary_client::ClientError::Api {
            status,
            code,
            message,
        } => {
            assert_eq!(
                (*status, *code),
                (503, ErrorCode::CapacityExhausted),
                "{err}"
            );
            // the node's address is not the tenant's business
            assert!(!message.contains("127.0.0.1"), "{message}");
        }
        other => panic!("{other:?}"),
    }

    // the failed create holds nothing on the node
    let nodes = c.nodes().await.unwrap();
    let full = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "node-full")
        .unwrap()
        .clone();
    assert_eq!(full["cpu_committed"].as_f64().unwrap(), 0.0, "{full}");
    agent.stop().await;
}

/// An agent whose runtime cannot snapshot (started without layers) is
/// refused with a clear 400 naming the node, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_cannot_snapshot_says_so() {
    let ts = common::start().await;
    let c = &ts.client;
    let dir = tempfile::Builder::new()
        .prefix("avne")
        .tempdir_in("/tmp")
        .unwrap();
    let state = dir.path().join("node-plain");
    let rt = aviary_runtime_oci::OciRuntime::new(
        aviary_runtime_oci::OciConfig::new(
            aviary_runtime_oci::OciBinary::Crun,
            state.join("sandboxes"),
        )
        .with_template_store(common::template_cache()),
    )
    .unwrap();
    let token = "token-node-plain".to_string();
    // far bigger than this host, so the scheduler places there
    let agent = aviary_node::start_node(aviary_node::NodeConfig {
        id: "node-plain".into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        token: token.clone(),
        runtime: Arc::new(rt),
        layers: None,
        templates: aviary_templates::TemplateStore::open(common::template_cache()).unwrap(),
        state_dir: state.join("agent"),
        capacity: aviary_node::Capacity {
            cpu: 64.0,
            memory_mb: 262_144,
        },
        provided_binds: vec![aviary_node::ProvidedBind::envd(common::envd_binary())],
    })
    .await
    .unwrap();
    c.add_node("node-plain", &agent.addr().to_string(), &token)
        .await
        .unwrap();
    let id = common::new_sandbox(c).await;
    assert_eq!(c.get_sandbox(&id).await.unwrap().node, "node-plain");
    let err = c.snapshot(&id, None).await.unwrap_err();
    match &err {
        aviary_client::ClientError::Api {
            status,
            code,
            message,
        } => {
            assert_eq!((*status, *code), (400, ErrorCode::InvalidRequest), "{err}");
            assert!(message.contains("node-plain"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        c.snapshots(Some(&id)).await.unwrap()["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    c.exec(&id, &common::shell("true")).await.unwrap();
    c.delete_sandbox(&id, None).await.unwrap();
    agent.stop().await;
}
