//! Node agents on real crun: three agents on different loopback ports in this
//! process, each with its own state dir, template store (busybox) and
//! `OciRuntime`, driven through `RemoteRuntime` and the remote envd transport.
//! Needs root, crun and busybox-static; each test prints why and returns when
//! it cannot run.

#[cfg(test)]
mod node {
    use async_trait::async_trait;
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_envd_proto::{EnvdClient, EnvdError, ExecSpec};
    use aviary_node::api::{ENVD_IN_SANDBOX, ENVD_SOCKET_NAME};
    use aviary_node::{start_node, Capacity, NodeConfig, ProvidedBind, RemoteRuntime, RunningNode};
    use aviary_runtime::conformance::{self, Inspector};
    use aviary_runtime::{
        BindMount, Pausable, Runtime, RuntimeError, RuntimeStatus, SandboxHandle, SandboxSpec,
        SpawnOutput,
    };
    use aviary_runtime_oci::{OciBinary, OciConfig, OciRuntime};
    use aviary_scheduler::{PlacementRequest, Scheduler, SchedulerConfig};
    use aviary_templates::TemplateStore;
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, OnceLock};
    use std::time::{Duration, Instant};

    const TOKEN: &str = "node-secret-for-tests";

    fn workspace_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .canonicalize()
            .unwrap()
    }

    /// The static envd: `AVIARY_ENVD`, or built once with scripts/build-envd.sh.
    fn envd_binary() -> PathBuf {
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

    /// Why this machine cannot run these tests, if it cannot.
    fn cannot_run() -> Option<String> {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let root = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0");
        if !root {
            return Some("node tests need root (mounts, cgroups)".into());
        }
        if !Path::new("/usr/bin/crun").exists() && !Path::new("/usr/local/bin/crun").exists() {
            return Some("crun is not installed (apt-get install crun)".into());
        }
        if !Path::new("/bin/busybox").exists() {
            return Some("/bin/busybox missing (apt-get install busybox-static)".into());
        }
        None
    }

    /// One node agent with everything it owns.
    struct TestNode {
        running: Option<RunningNode>,
        rt: RemoteRuntime,
        state: PathBuf,
        templates: TemplateStore,
        runtime: Arc<OciRuntime>,
        capacity: Capacity,
        id: String,
        _dir: tempfile::TempDir,
    }

    impl TestNode {
        fn addr(&self) -> String {
            self.running.as_ref().unwrap().addr().to_string()
        }

        fn config(&self, listen: std::net::SocketAddr) -> NodeConfig {
            node_config(
                &self.id,
                &self.state,
                &self.templates,
                &self.runtime,
                self.capacity,
                listen,
            )
        }
    }

    fn node_config(
        id: &str,
        state: &Path,
        templates: &TemplateStore,
        runtime: &Arc<OciRuntime>,
        capacity: Capacity,
        listen: std::net::SocketAddr,
    ) -> NodeConfig {
        NodeConfig {
            id: id.into(),
            listen,
            token: TOKEN.into(),
            runtime: runtime.clone(),
            layers: Some(runtime.clone()),
            templates: templates.clone(),
            state_dir: state.join("node"),
            capacity,
            provided_binds: vec![ProvidedBind::envd(envd_binary())],
        }
    }

    impl Drop for TestNode {
        /// A failed test must not leave sandboxes on the host.
        fn drop(&mut self) {
            let runtime = self.runtime.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    for id in runtime.list().await.unwrap_or_default() {
                        if let Err(e) = runtime.destroy(&id).await {
                            eprintln!("cleanup of {id}: {}", conformance::chain(&e));
                        }
                    }
                });
            })
            .join()
            .unwrap();
        }
    }

    async fn start_test_node(id: &str, cpu: f64, memory_mb: u64) -> TestNode {
        let dir = tempfile::Builder::new()
            .prefix("aviary-node-")
            .tempdir_in("/tmp")
            .unwrap();
        let state = dir.path().to_path_buf();
        let store_root = state.join("templates");
        let templates = tokio::task::spawn_blocking(move || {
            let store = TemplateStore::open(store_root).unwrap();
            store.build_busybox("busybox").unwrap();
            store
        })
        .await
        .unwrap();
        let runtime = Arc::new(
            OciRuntime::new(
                OciConfig::new(OciBinary::Crun, state.join("oci"))
                    .with_template_store(state.join("templates")),
            )
            .unwrap(),
        );
        let capacity = Capacity { cpu, memory_mb };
        let cfg = node_config(
            id,
            &state,
            &templates,
            &runtime,
            capacity,
            "127.0.0.1:0".parse().unwrap(),
        );
        let running = start_node(cfg).await.unwrap();
        let (rt, info) = RemoteRuntime::connect(running.addr().to_string(), TOKEN)
            .await
            .unwrap();
        assert_eq!(info.id, id);
        assert_eq!(info.runtimes, vec!["crun".to_string()]);
        TestNode {
            running: Some(running),
            rt,
            state,
            templates,
            runtime,
            capacity,
            id: id.into(),
            _dir: dir,
        }
    }

    fn spec(digest: &str, cpu: f64) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: aviary_runtime::TemplateRef {
                name: "busybox".into(),
                digest: digest.into(),
            },
            resources: ResourceLimits {
                cpu,
                memory_mb: 128,
                disk_mb: 1024,
                pids: 64,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx-node".into(),
            init: vec![ENVD_IN_SANDBOX.into(), "--listen-fd".into(), "3".into()],
            env: vec!["PATH=/bin:/usr/bin".into()],
            // A control-plane path: the node must put its own envd here.
            binds: vec![BindMount {
                host: "/nonexistent/control-plane/envd".into(),
                sandbox: ENVD_IN_SANDBOX.into(),
                read_only: true,
            }],
        }
    }

    fn sh(cmd: &str) -> ExecSpec {
        ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
            ..ExecSpec::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_nodes_place_create_exec_pause_destroy_through_node_b() {
        if let Some(why) = cannot_run() {
            eprintln!("SKIP: {why}");
            return;
        }
        envd_binary();
        let mut nodes = vec![
            start_test_node("node-a", 2.0, 4096).await,
            start_test_node("node-b", 8.0, 16384).await,
            start_test_node("node-c", 4.0, 8192).await,
        ];
        let ports: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
        assert_eq!(
            ports.iter().collect::<std::collections::HashSet<_>>().len(),
            3,
            "three ports: {ports:?}"
        );

        // Same busybox content ⇒ same digest on every node.
        let infos = futures_infos(&nodes).await;
        let digest = infos[0].templates[0].digest.clone();
        assert!(infos
            .iter()
            .all(|i| i.templates.iter().any(|t| t.digest == digest)));

        // The scheduler picks the emptiest node: B (8 CPUs).
        let views: Vec<_> = infos
            .iter()
            .zip(&nodes)
            .map(|(i, n)| i.to_view(n.addr(), HashMap::new(), aviary_core::now()))
            .collect();
        let sched = Scheduler::with_seed(
            SchedulerConfig {
                sample_k: 3,
                ..SchedulerConfig::default()
            },
            1,
        );
        let req = PlacementRequest {
            class: "python-small".into(),
            limits: ResourceLimits {
                cpu: 0.5,
                memory_mb: 128,
                disk_mb: 1024,
                pids: 64,
            },
            template_digest: digest.clone(),
            runtime: "crun".into(),
        };
        let decision = sched.place(&views, &req, aviary_core::now()).unwrap();
        assert_eq!(decision.node_id, "node-b");
        let b = &nodes[1];

        // The control plane names the template by its digest.
        let s = spec(&digest, 0.5);
        let id = s.id.clone();
        let t = Instant::now();
        let handle = b.rt.create(&s).await.unwrap();
        let create_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(handle.id, id);
        assert_eq!(handle.runtime, "crun");
        assert!(b.rt.list().await.unwrap().contains(&id));
        assert!(!nodes[0].rt.list().await.unwrap().contains(&id));
        assert!(!nodes[2].rt.list().await.unwrap().contains(&id));

        // envd through the node.
        let envd = b.rt.envd(&id);
        let t = Instant::now();
        envd.wait_ready(Duration::from_secs(10)).await.unwrap();
        let ready_ms = t.elapsed().as_secs_f64() * 1e3;
        let out = envd
            .exec_collect(
                sh("echo hi; cat /proc/sys/kernel/hostname; echo err >&2; exit 3"),
                None,
            )
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\nsbx-node\n");
        assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
        assert_eq!(out.exit.exit_code, 3);
        // stdin goes over the same TCP connection (duplicated descriptor).
        let mut with_stdin = sh("cat; echo done");
        with_stdin.stdin = Some(b"from-stdin\n".repeat(10_000));
        let out = envd.exec_collect(with_stdin, None).await.unwrap();
        assert_eq!(out.stdout.len(), 110_000 + 5);
        assert!(out.stdout.ends_with(b"from-stdin\ndone\n"));
        // Files, including a large one in several frames.
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let n = envd
            .write_file("/workspace/big.bin", Some(0o600), &big[..], None)
            .await
            .unwrap();
        assert_eq!(n, big.len() as u64);
        let mut back = Vec::new();
        let mut r = envd.read_file("/workspace/big.bin", None).await.unwrap();
        tokio::io::AsyncReadExt::read_to_end(&mut r, &mut back)
            .await
            .unwrap();
        assert_eq!(back, big);
        assert_eq!(
            std::fs::read(handle.workspace_dir.join("big.bin")).unwrap(),
            big,
            "the file is on node B's host"
        );
        // Fencing works remotely as on a local socket.
        envd.set_fence(Some(5)).await.unwrap();
        assert!(matches!(
            envd.exec_collect(sh("true"), Some(4)).await.unwrap_err(),
            EnvdError::StaleToken
        ));
        envd.exec_collect(sh("true"), Some(5)).await.unwrap();
        envd.set_fence(None).await.unwrap();

        // Dropping a remote exec stream ends the process inside (the node
        // closes envd's connection, envd kills the process group).
        let mut stream = envd
            .exec(
                sh("echo $$ > /tmp/sleeper.pid; echo started; exec sleep 1000"),
                None,
            )
            .await
            .unwrap();
        match stream.next().await.unwrap() {
            aviary_envd_proto::ExecEvent::Stdout(b) => assert_eq!(b, b"started\n"),
            other => panic!("{other:?}"),
        }
        drop(stream);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let out = envd
                .exec_collect(sh("kill -0 $(cat /tmp/sleeper.pid) 2>/dev/null"), None)
                .await
                .unwrap();
            if out.exit.exit_code != 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "sleep survived the dropped stream"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // Latency of a remote exec round trip vs the local socket.
        let local = EnvdClient::new(handle.control_dir.join(ENVD_SOCKET_NAME));
        let remote_ms = median_ms(&envd, 50).await;
        let local_ms = median_ms(&local, 50).await;
        eprintln!(
            "node B: create {create_ms:.1} ms, envd ready {ready_ms:.1} ms, exec `true` p50 remote {remote_ms:.2} ms vs local {local_ms:.2} ms"
        );

        // Usage, info.
        let usage = b.rt.usage(&id).await.unwrap();
        assert!(usage.pids_current >= 1);
        let info = b.rt.info().await.unwrap();
        assert_eq!(info.sandboxes, 1);
        assert_eq!(info.committed.cpu, 0.5);
        assert_eq!(info.committed.memory_mb, 128);
        assert_eq!(nodes[0].rt.info().await.unwrap().sandboxes, 0);

        // Pause / resume.
        b.rt.pause(&id).await.unwrap();
        assert_eq!(b.rt.status(&id).await.unwrap(), RuntimeStatus::Paused);
        b.rt.resume(&id).await.unwrap();
        assert_eq!(b.rt.status(&id).await.unwrap(), RuntimeStatus::Running);
        envd.exec_collect(sh("true"), None).await.unwrap();

        // A restarted agent (new port, same state dir) still reaches the sandbox.
        let old = nodes[1].running.take().unwrap();
        old.stop().await;
        let running = start_node(nodes[1].config("127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        let (rt2, info2) = RemoteRuntime::connect(running.addr().to_string(), TOKEN)
            .await
            .unwrap();
        nodes[1].running = Some(running);
        nodes[1].rt = rt2;
        assert_eq!(info2.sandboxes, 1);
        let b = &nodes[1];
        let out =
            b.rt.envd(&id)
                .exec_collect(sh("echo again"), None)
                .await
                .unwrap();
        assert_eq!(out.stdout, b"again\n");

        // Destroy.
        b.rt.destroy(&id).await.unwrap();
        assert_eq!(b.rt.status(&id).await.unwrap(), RuntimeStatus::NotFound);
        b.rt.destroy(&id).await.unwrap();
        match b.rt.envd(&id).health().await.unwrap_err() {
            EnvdError::Node { status: 404, .. } => {}
            other => panic!("{other:?}"),
        }
        assert!(!handle.control_dir.exists());
        assert_eq!(b.rt.info().await.unwrap().sandboxes, 0);

        for n in &mut nodes {
            n.running.take().unwrap().stop().await;
        }
    }

    async fn futures_infos(nodes: &[TestNode]) -> Vec<aviary_node::NodeInfo> {
        let mut v = Vec::new();
        for n in nodes {
            v.push(n.rt.info().await.unwrap());
        }
        v
    }

    async fn median_ms(envd: &EnvdClient, n: usize) -> f64 {
        let mut v = Vec::new();
        for _ in 0..n {
            let t = Instant::now();
            envd.exec_collect(
                ExecSpec {
                    argv: vec!["/bin/true".into()],
                    ..ExecSpec::default()
                },
                None,
            )
            .await
            .unwrap();
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        v.sort_by(f64::total_cmp);
        v[n / 2]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wrong_token_unknown_sandbox_and_bad_input_are_refused() {
        if let Some(why) = cannot_run() {
            eprintln!("SKIP: {why}");
            return;
        }
        envd_binary();
        let mut n = start_test_node("node-x", 2.0, 4096).await;
        let addr = n.addr();
        let digest = n.rt.info().await.unwrap().templates[0].digest.clone();
        let http = reqwest::Client::new();
        let url = |p: &str| format!("http://{addr}/node/v1{p}");

        // Wrong or missing token: 401, and nothing happens.
        let err = RemoteRuntime::connect(addr.clone(), "wrong")
            .await
            .unwrap_err();
        assert!(matches!(err, RuntimeError::ProbeRuntime { .. }), "{err:?}");
        let s = spec(&digest, 0.5);
        let body = serde_json::json!({"spec": s, "template": digest});
        for auth in [Some("Bearer wrong"), Some(TOKEN), Some("Bearer "), None] {
            let mut r = http.post(url("/sandboxes")).json(&body);
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            let resp = r.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{auth:?}");
            assert_eq!(resp.headers()["www-authenticate"], "Bearer");
            let v: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["code"], "unauthorized");
        }
        let resp = http.get(url("/no/such/route")).send().await.unwrap();
        assert_eq!(
            resp.status(),
            401,
            "unauthenticated callers learn no routes"
        );
        assert!(n.rt.list().await.unwrap().is_empty(), "nothing was created");
        assert!(n.runtime.list().await.unwrap().is_empty());
        let bad_envd = EnvdClient::remote(addr.clone(), "sbx", "wrong");
        match bad_envd.health().await.unwrap_err() {
            EnvdError::Node {
                status: 401,
                message,
            } => {
                assert!(message.starts_with("unauthorized"), "{message}")
            }
            other => panic!("{other:?}"),
        }

        // Unknown sandbox: 404 everywhere except the idempotent destroy.
        let ghost = SandboxId::generate();
        assert_eq!(n.rt.status(&ghost).await.unwrap(), RuntimeStatus::NotFound);
        for e in [
            n.rt.usage(&ghost).await.unwrap_err(),
            n.rt.pause(&ghost).await.unwrap_err(),
            n.rt.resume(&ghost).await.unwrap_err(),
        ] {
            assert!(matches!(e, RuntimeError::NotFound { .. }), "{e:?}");
        }
        n.rt.destroy(&ghost).await.unwrap();
        match n.rt.envd(&ghost).health().await.unwrap_err() {
            EnvdError::Node { status: 404, .. } => {}
            other => panic!("{other:?}"),
        }
        let resp = http
            .get(url("/sandboxes/not%20an%20id/usage"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);

        // Bad input: 4xx JSON, runtime untouched.
        let post = |body: String| {
            http.post(url("/sandboxes"))
                .bearer_auth(TOKEN)
                .header("content-type", "application/json")
                .body(body)
                .send()
        };
        // the code is the control plane's (one table); `kind` says which
        for (body, kind) in [
            ("{not json".to_string(), None),
            (r#"{"spec": 1, "template": "busybox"}"#.to_string(), None),
            (
                serde_json::json!({"spec": s, "template": "sha256:0000"}).to_string(),
                Some("template_missing"),
            ),
            (
                serde_json::json!({"spec": s, "template": "../../etc"}).to_string(),
                Some("template_missing"),
            ),
        ] {
            let resp = post(body.clone()).await.unwrap();
            assert_eq!(resp.status(), 400, "{body}");
            let v: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["code"], "invalid_request", "{body}: {v}");
            assert_eq!(v["error"]["kind"].as_str(), kind, "{body}: {v}");
        }
        // A bind the node does not provide (e.g. the host's /etc) is refused.
        let mut sneaky = spec(&digest, 0.5);
        sneaky.binds.push(BindMount {
            host: "/etc".into(),
            sandbox: "/host-etc".into(),
            read_only: false,
        });
        let e = n.rt.create(&sneaky).await.unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidSpec { .. }), "{e:?}");
        // A spec whose template is not a digest.
        let e = n.rt.create(&spec("/some/dir", 0.5)).await.unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidSpec { .. }), "{e:?}");
        // The envd route without the upgrade headers.
        let resp = http
            .get(url(&format!("/sandboxes/{ghost}/envd")))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        assert!(n.runtime.list().await.unwrap().is_empty());

        // By name works as well as by digest.
        let named = spec(&digest, 0.25);
        let h = n.rt.create_from_template(&named, "busybox").await.unwrap();
        assert_eq!(h.id, named.id);
        // A duplicate id is a conflict, and the original survives.
        let e = n.rt.create(&named).await.unwrap_err();
        assert!(matches!(e, RuntimeError::AlreadyExists { .. }), "{e:?}");
        assert_eq!(
            n.rt.status(&named.id).await.unwrap(),
            RuntimeStatus::Running
        );
        n.rt.destroy(&named.id).await.unwrap();

        n.running.take().unwrap().stop().await;
    }

    /// A minimal `docker save` archive of a busybox rootfs, made with tar(1).
    fn docker_save_archive(dir: &Path) -> PathBuf {
        let script = r#"
set -eu
mkdir -p L/bin L/tmp L/etc
cp /bin/busybox L/bin/busybox
for a in sh cat echo true sleep kill; do ln -s busybox L/bin/$a; done
echo 'root:x:0:0:root:/root:/bin/sh' > L/etc/passwd
tar -cf layer.tar -C L .
diff=$(sha256sum layer.tar | cut -d' ' -f1)
printf '{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' "$diff" > cfg.json
cfg=$(sha256sum cfg.json | cut -d' ' -f1)
mv cfg.json "$cfg.json"
mkdir -p l1 && mv layer.tar l1/layer.tar
printf '[{"Config":"%s.json","RepoTags":["up:1"],"Layers":["l1/layer.tar"]}]' "$cfg" > manifest.json
tar -cf image.tar manifest.json "$cfg.json" l1
"#;
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(script)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir.join("image.tar")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shipped_template_can_run_sandboxes() {
        if let Some(why) = cannot_run() {
            eprintln!("SKIP: {why}");
            return;
        }
        envd_binary();
        let mut n = start_test_node("node-t", 2.0, 4096).await;
        let work = tempfile::tempdir().unwrap();
        let archive = docker_save_archive(work.path());

        let entry = n.rt.upload_template("shipped", &archive).await.unwrap();
        assert_eq!(entry.name, "shipped");
        assert!(entry.digest.starts_with("sha256:"));
        let info = n.rt.info().await.unwrap();
        assert!(info.templates.contains(&entry), "{:?}", info.templates);
        assert!(
            !n.state
                .join("node/uploads")
                .read_dir()
                .unwrap()
                .any(|_| true),
            "upload removed"
        );

        let s = spec("sha256:unused", 0.5);
        n.rt.create_from_template(&s, &entry.digest).await.unwrap();
        let envd = n.rt.envd(&s.id);
        envd.wait_ready(Duration::from_secs(10)).await.unwrap();
        let out = envd
            .exec_collect(sh("echo shipped-ok"), None)
            .await
            .unwrap();
        assert_eq!(out.stdout, b"shipped-ok\n");
        n.rt.destroy(&s.id).await.unwrap();

        // Garbage, a bad name, a wrong token.
        let junk = work.path().join("junk.tar");
        std::fs::write(&junk, b"this is not a tarball").unwrap();
        let e = n.rt.upload_template("junk", &junk).await.unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidSpec { .. }), "{e:?}");
        let e = n.rt.upload_template("..", &archive).await.unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidSpec { .. }), "{e:?}");
        let resp = reqwest::Client::new()
            .put(format!("http://{}/node/v1/templates/evil", n.addr()))
            .bearer_auth("wrong")
            .body(std::fs::read(&archive).unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
        let names: Vec<String> =
            n.rt.info()
                .await
                .unwrap()
                .templates
                .into_iter()
                .map(|t| t.name)
                .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        n.running.take().unwrap().stop().await;
    }

    /// Looks inside through the remote envd.
    struct RemoteInspector(RemoteRuntime);

    #[async_trait]
    impl Inspector for RemoteInspector {
        async fn run_inside(
            &self,
            handle: &SandboxHandle,
            argv: &[&str],
        ) -> Result<SpawnOutput, RuntimeError> {
            let envd = self.0.envd(&handle.id);
            envd.wait_ready(Duration::from_secs(10))
                .await
                .map_err(|e| RuntimeError::InvokeRuntime {
                    action: "envd ready".into(),
                    detail: conformance::chain(&e),
                })?;
            let out = envd
                .exec_collect(
                    ExecSpec {
                        argv: argv.iter().map(|s| s.to_string()).collect(),
                        ..ExecSpec::default()
                    },
                    None,
                )
                .await
                .map_err(|e| RuntimeError::InvokeRuntime {
                    action: "remote exec".into(),
                    detail: conformance::chain(&e),
                })?;
            Ok(SpawnOutput {
                code: Some(out.exit.exit_code),
                timed_out: out.exit.timed_out,
                stdout: out.stdout,
                stderr: out.stderr,
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn remote_runtime_passes_the_runtime_conformance_suite() {
        if let Some(why) = cannot_run() {
            eprintln!("SKIP: {why}");
            return;
        }
        envd_binary();
        let mut n = start_test_node("node-conf", 2.0, 4096).await;
        let digest = n.rt.info().await.unwrap().templates[0].digest.clone();
        let make = || spec(&digest, 0.5);
        let rt = n.rt.clone();
        conformance::check_lifecycle(&rt, &make).await;
        conformance::check_unknown_ids(&rt).await;
        conformance::check_refusals(&rt, &make).await;
        conformance::check_pause_resume(&rt, &make).await;
        conformance::check_limits_visible(&rt, &RemoteInspector(rt.clone()), &make).await;
        assert!(n.runtime.list().await.unwrap().is_empty());
        n.running.take().unwrap().stop().await;
    }
}
