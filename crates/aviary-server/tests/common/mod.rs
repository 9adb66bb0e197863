//! Test harness: a real server (real SQLite registry, real crun, real envd)
//! on 127.0.0.1:0 with a private data dir, driven through the real client.
#![allow(dead_code)]

use aviary_client::Client;
use aviary_server::config::{DefaultTemplateSource, ServerConfig};
use aviary_server::RunningServer;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub struct TestServer {
    pub server: Option<RunningServer>,
    pub client: Client,
    pub data: PathBuf,
    pub key: String,
    _dir: Option<tempfile::TempDir>,
}

impl TestServer {
    pub fn url(&self) -> String {
        self.server.as_ref().expect("server running").url()
    }
    /// The configuration the running server was started with.
    pub fn server_cfg(&self) -> &ServerConfig {
        &self.server.as_ref().expect("server running").cfg
    }
    pub fn cp(&self) -> &aviary_server::ops::ControlPlane {
        &self.server.as_ref().expect("server running").control_plane
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// The static envd: `AVIARY_ENVD`, or built once with scripts/build-envd.sh.
pub fn envd_binary() -> PathBuf {
    static ENVD: OnceLock<PathBuf> = OnceLock::new();
    ENVD.get_or_init(|| {
        if let Some(p) = std::env::var_os("AVIARY_ENVD") {
            return PathBuf::from(p);
        }
        let out = std::process::Command::new(workspace_root().join("scripts/build-envd.sh"))
            .output()
            .expect("run scripts/build-envd.sh");
        assert!(
            out.status.success(),
            "building envd failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

pub fn template_cache() -> PathBuf {
    let p = std::env::var_os("AVIARY_TEST_TEMPLATE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/aviary-test-templates"));
    std::fs::create_dir_all(&p).unwrap();
    p
}

pub fn config(data: &Path, default_template: &str) -> ServerConfig {
    let mut cfg = ServerConfig::new(data.to_path_buf(), envd_binary());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.templates_dir = Some(template_cache());
    cfg.control.default_template = default_template.into();
    cfg.control.default_template_source = if default_template == "default" {
        DefaultTemplateSource::Debootstrap
    } else {
        DefaultTemplateSource::Busybox
    };
    cfg.control.sweep_interval_ms = 100;
    cfg
}

/// A ready server whose default template is the busybox one (fast).
pub async fn start() -> TestServer {
    start_with("busybox").await
}

pub async fn start_with(default_template: &str) -> TestServer {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let data = dir.path().join("d");
    let mut ts = start_on(&data, default_template).await;
    ts._dir = Some(dir);
    ts
}

/// A ready server (busybox default) on a fresh temp data dir, its config
/// changed by `edit` first; the dir lives as long as the returned guard.
pub async fn start_edited(edit: impl FnOnce(&mut ServerConfig)) -> (TestServer, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("avt")
        .tempdir_in("/tmp")
        .unwrap();
    let mut cfg = config(&dir.path().join("d"), "busybox");
    edit(&mut cfg);
    (start_cfg(cfg).await, dir)
}

pub async fn start_on(data: &Path, default_template: &str) -> TestServer {
    let cfg = config(data, default_template);
    start_cfg(cfg).await
}

pub async fn start_cfg(cfg: ServerConfig) -> TestServer {
    let data = cfg.data_dir.clone();
    let server = aviary_server::start(cfg, |line| eprintln!("prepare: {line}"))
        .await
        .unwrap();
    let ready = server.control_plane.wait_ready().await;
    assert_eq!(ready, aviary_server::ops::Readiness::Ready);
    let client = Client::new(&server.url(), &server.admin_key);
    TestServer {
        key: server.admin_key.clone(),
        server: Some(server),
        client,
        data,
        _dir: None,
    }
}

impl TestServer {
    /// Stops the HTTP server (sandboxes keep running).
    pub async fn stop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await.unwrap();
        }
    }

    /// Destroys every sandbox this server's runtime still has, pooled ones
    /// included (test cleanup).
    pub async fn cleanup(&self) {
        for rt in self.cp().runtimes.all() {
            if let Ok(ids) = rt.runtime.list().await {
                for id in ids {
                    let _ = rt.runtime.destroy(&id).await;
                }
            }
        }
    }
}

/// A test that ends with its server still running (normally or by a failed
/// assertion) destroys the sandboxes that server's runtime still has, so a
/// failing test leaves no mounts, loop devices, cgroups or processes behind.
/// Restart tests `stop()` their first server, which then owns nothing here.
impl Drop for TestServer {
    fn drop(&mut self) {
        let Some(server) = self.server.as_ref() else {
            return;
        };
        let runtimes: Vec<_> = server
            .control_plane
            .runtimes
            .all()
            .iter()
            .map(|r| r.runtime.clone())
            .collect();
        let swept = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                for runtime in runtimes {
                    if let Ok(ids) = runtime.list().await {
                        for id in ids {
                            let _ = runtime.destroy(&id).await;
                        }
                    }
                }
            });
        });
        let _ = swept.join();
    }
}

pub fn shell(s: &str) -> aviary_core::api::ExecRequest {
    aviary_core::api::ExecRequest {
        shell: Some(s.into()),
        ..Default::default()
    }
}

impl TestServer {
    /// Destroys a sandbox behind the server's back (simulates runtime loss).
    pub async fn cp_runtime_destroy(&self, id: &aviary_core::SandboxId) {
        let cfg = config(&self.data, "busybox");
        let rt = aviary_runtime_oci::OciRuntime::new(aviary_runtime_oci::OciConfig::new(
            aviary_runtime_oci::OciBinary::Crun,
            cfg.runtime_state_dir(),
        ))
        .unwrap();
        aviary_runtime::Runtime::destroy(&rt, id).await.unwrap();
    }
}

/// A sandbox with the default settings; its id.
pub async fn new_sandbox(c: &aviary_client::Client) -> String {
    c.create_sandbox(&aviary_core::api::CreateSandboxRequest::default())
        .await
        .unwrap()
        .sandbox
        .id
        .to_string()
}
