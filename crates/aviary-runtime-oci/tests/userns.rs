//! User namespaces on the real thing (crun and runc): root inside is an
//! unprivileged host id range of its own, the shared template is seen through
//! an idmapped mount and never changes, and nothing of either outlives the
//! sandbox. They need root; each test prints why and returns when it cannot
//! run. All tests take one lock because they count host-wide resources.

mod common;

#[cfg(test)]
mod userns {
    use crate::common;
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_runtime::{BindMount, Runtime, SandboxSpec, Snapshottable};
    use aviary_runtime_oci::idmap::{self, IdRange, RANGE_SIZE};
    use aviary_runtime_oci::{OciBinary, OciConfig, OciRuntime};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::path::{Path, PathBuf};
    use std::time::Instant;
    use tokio::sync::Mutex;

    static LOCK: Mutex<()> = Mutex::const_new(());

    struct Fixture {
        common: common::Fixture,
        template: PathBuf,
        state: PathBuf,
        /// A host dir bind-mounted into sandboxes, holding a host-root 0600 file.
        secret_dir: PathBuf,
    }

    fn fixture(binary: OciBinary) -> Option<Fixture> {
        let common = common::fixture("userns", &[common::binary_needs(binary)])?;
        let secret_dir = common.dir.path().join("host-secrets");
        std::fs::create_dir(&secret_dir).unwrap();
        std::fs::write(secret_dir.join("shadow"), "host-root-only\n").unwrap();
        std::fs::set_permissions(
            secret_dir.join("shadow"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        Some(Fixture {
            template: common.template.clone(),
            state: common.state.clone(),
            secret_dir,
            common,
        })
    }

    fn runtime(f: &Fixture, binary: OciBinary) -> OciRuntime {
        f.common.runtime(binary)
    }

    fn spec_for(f: &Fixture) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: f.common.template_ref.clone(),
            resources: ResourceLimits {
                cpu: 0.5,
                memory_mb: 128,
                disk_mb: 256,
                pids: 64,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx-userns".into(),
            init: vec![
                "/bin/sh".into(),
                "-c".into(),
                "trap 'exit 0' TERM; while :; do sleep 1; done".into(),
            ],
            env: vec![],
            binds: vec![BindMount {
                host: f.secret_dir.clone(),
                sandbox: "/srv/host".into(),
                read_only: false,
            }],
        }
    }

    async fn sh(rt: &OciRuntime, id: &SandboxId, script: &str) -> (i32, String) {
        let out = rt.exec(id, &["/bin/sh", "-c", script]).await.unwrap();
        let mut text = String::from_utf8_lossy(&out.stdout).to_string();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.code.unwrap_or(-1), text)
    }

    fn owner(p: &Path) -> (u32, u32) {
        let md = std::fs::symlink_metadata(p).unwrap();
        (md.uid(), md.gid())
    }

    /// (path, uid, gid, mode, size, mtime) of every entry.
    fn tree_digest(root: &Path) -> Vec<(PathBuf, u32, u32, u32, u64, i64)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let m = e.path().symlink_metadata().unwrap();
                out.push((e.path(), m.uid(), m.gid(), m.mode(), m.size(), m.mtime()));
                if m.is_dir() {
                    stack.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    fn mounts_mentioning(s: &str) -> Vec<String> {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(s))
            .map(str::to_string)
            .collect()
    }

    fn host_uid_of(pid: u32) -> u32 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    async fn root_is_unprivileged_for(binary: OciBinary) {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(binary) else { return };
        let rt = runtime(&f, binary);
        let template_before = tree_digest(&f.template);
        let spec = spec_for(&f);
        let id = &spec.id;
        let h = rt.create(&spec).await.unwrap();
        let range = idmap::range_of(&f.state, id).expect("a range is claimed");
        let base = range.host_first;
        assert!(base >= 0x4000_0000, "unprivileged host range: {base}");

        // The mapping, seen from inside and from the host.
        let map = format!("0 {base} {RANGE_SIZE}");
        for file in ["uid_map", "gid_map"] {
            let (code, out) = sh(&rt, id, &format!("cat /proc/self/{file}")).await;
            assert_eq!(code, 0, "{out}");
            assert_eq!(
                out.split_whitespace().collect::<Vec<_>>().join(" "),
                map,
                "{file}"
            );
        }
        assert_eq!(
            sh(&rt, id, "id -u; id -g").await,
            (0, "0\n0\n".into()),
            "root inside"
        );
        assert_eq!(host_uid_of(h.init_pid), base, "PID 1 is host {base}");

        // Files root creates belong to the range on the host.
        assert_eq!(
            sh(
                &rt,
                id,
                "echo w > /workspace/w && echo r > /made-by-root && echo ok"
            )
            .await,
            (0, "ok\n".into())
        );
        assert_eq!(owner(&h.workspace_dir.join("w")), (base, base));
        let upper = f.state.join(id.as_str()).join("upper");
        assert_eq!(owner(&upper.join("made-by-root")), (base, base));
        assert_eq!(owner(&h.workspace_dir), (base, base), "workspace root");
        // Only host root and the range's root group pass through the sandbox dir.
        let sandbox_dir = std::fs::metadata(f.state.join(id.as_str())).unwrap();
        assert_eq!(
            (
                sandbox_dir.uid(),
                sandbox_dir.gid(),
                sandbox_dir.mode() & 0o7777
            ),
            (0, base, 0o710)
        );

        // Copy-up works: root inside writes the template's /etc and chowns.
        let (code, out) = sh(
            &rt,
            id,
            "echo 'app:x:1000:1000::/:/bin/sh' >> /etc/passwd && chown 1000:1000 /workspace/w /etc/passwd && chmod 4755 /workspace/w && stat -c '%u:%g %a' /workspace/w /etc/passwd /bin/busybox",
        )
        .await;
        assert_eq!(code, 0, "{out}");
        assert_eq!(out, "1000:1000 4755\n1000:1000 644\n0:0 755\n");
        assert_eq!(
            owner(&h.workspace_dir.join("w")),
            (base + 1000, base + 1000)
        );
        assert_eq!(owner(&upper.join("etc/passwd")), (base + 1000, base + 1000));
        assert_eq!(owner(&upper.join("etc")), (base, base), "copied-up dir");
        assert!(std::fs::read_to_string(upper.join("etc/passwd"))
            .unwrap()
            .contains("app:x:1000"));

        // Not host root: a host-root 0600 file in a bind mount stays closed
        // (and reads as nobody), /proc/sys stays read-only, no mounts.
        let (code, out) = sh(&rt, id, "cat /srv/host/shadow").await;
        assert_ne!(code, 0, "host-root 0600 file readable: {out}");
        assert!(!out.contains("host-root-only"));
        assert_eq!(
            sh(&rt, id, "stat -c '%u:%g' /srv/host/shadow").await.1,
            "65534:65534\n",
            "unmapped host root shows as nobody"
        );
        let (code, _) = sh(&rt, id, "chown 0:0 /srv/host/shadow").await;
        assert_ne!(code, 0, "root inside cannot chown a host-root file");
        let (code, _) = sh(&rt, id, "echo x > /srv/host/new").await;
        assert_ne!(code, 0, "a host-root 0755 dir is not writable");
        for knob in ["/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"] {
            let (code, out) = sh(&rt, id, &format!("echo 1 > {knob}")).await;
            assert_ne!(code, 0, "{knob} writable: {out}");
        }
        assert_ne!(sh(&rt, id, "echo x > /sys/kernel/uevent_helper").await.0, 0);

        // The template is untouched and still owned by host root.
        assert_eq!(
            tree_digest(&f.template),
            template_before,
            "template changed"
        );
        assert_eq!(owner(&f.template.join("etc/passwd")), (0, 0));
        // No idmapped view of it stays mounted: the overlay holds its own.
        assert_eq!(mounts_mentioning("idmapped-lower"), Vec::<String>::new());

        rt.destroy(id).await.unwrap();
        assert_eq!(idmap::range_of(&f.state, id), None, "range released");
        assert_eq!(
            mounts_mentioning(f.state.to_str().unwrap()),
            Vec::<String>::new()
        );
        assert!(!f.state.join("userns").exists(), "no marker dir left");
        assert_eq!(tree_digest(&f.template), template_before);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn root_is_unprivileged_crun() {
        root_is_unprivileged_for(OciBinary::Crun).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn root_is_unprivileged_runc() {
        root_is_unprivileged_for(OciBinary::Runc).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sandboxes_get_distinct_ranges_and_limits_still_hold() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let mut a = spec_for(&f);
        a.resources.memory_mb = 32;
        a.resources.pids = 32;
        let b = spec_for(&f);
        rt.create(&a).await.unwrap();
        rt.create(&b).await.unwrap();
        let (ra, rb) = (
            idmap::range_of(&f.state, &a.id).unwrap(),
            idmap::range_of(&f.state, &b.id).unwrap(),
        );
        assert_ne!(ra, rb, "one range per sandbox");
        // a's files are not b's: distinct host owners.
        sh(&rt, &a.id, "touch /workspace/f").await;
        sh(&rt, &b.id, "touch /workspace/f").await;
        let (oa, ob) = (
            owner(&f.state.join(a.id.as_str()).join("workspace/f")),
            owner(&f.state.join(b.id.as_str()).join("workspace/f")),
        );
        assert_ne!(oa, ob);

        // Memory: 64 MiB into a shell variable is OOM-killed.
        let (code, _) = sh(
            &rt,
            &a.id,
            "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo ${#x}",
        )
        .await;
        assert_eq!(code, 137, "OOM kill inside a user namespace");
        assert!(rt.usage(&a.id).await.unwrap().oom_kills >= 1);
        // Pids: at most 32 tasks.
        sh(
            &rt,
            &a.id,
            "for i in $(seq 100); do sleep 30 >/dev/null 2>&1 & done 2>/dev/null; sleep 0.2",
        )
        .await;
        let usage = rt.usage(&a.id).await.unwrap();
        assert!(usage.pids_current <= 32, "{usage:?}");
        assert!(usage.pids_current >= 20, "the bomb did run: {usage:?}");
        // Nested user namespaces stay blocked by seccomp.
        let (code, _) = sh(&rt, &b.id, "unshare -U true 2>&1 || exit 1").await;
        assert_ne!(code, 0);

        rt.destroy(&a.id).await.unwrap();
        rt.destroy(&b.id).await.unwrap();
        assert!(!f.state.join("userns").exists());
        assert_eq!(
            mounts_mentioning(f.state.to_str().unwrap()),
            Vec::<String>::new()
        );
    }

    /// A snapshot of another sandbox (another range) or from before user
    /// namespaces (host root) seeds a new sandbox: its files are shifted into
    /// the new range, keeping container ids.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn seeded_layers_are_shifted_into_the_range() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let spec = spec_for(&f);
        std::fs::create_dir_all(&f.state).unwrap();
        let stage = rt.stage_layers(&spec.id).await.unwrap();
        let (upper, workspace) = (stage.writable, stage.workspace);
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::create_dir_all(workspace.join("src")).unwrap();
        let other = IdRange {
            host_first: 0x4000_0000 + 77 * RANGE_SIZE,
        };
        std::fs::write(upper.join("etc/motd"), "seeded\n").unwrap();
        std::os::unix::fs::lchown(
            upper.join("etc/motd"),
            Some(other.host(1000)),
            Some(other.host(1000)),
        )
        .unwrap();
        std::fs::write(workspace.join("src/main.rs"), "fn main() {}\n").unwrap();
        std::fs::write(workspace.join("tool"), "#!/bin/sh\n").unwrap();
        std::os::unix::fs::lchown(workspace.join("tool"), Some(0), Some(0)).unwrap();
        std::fs::set_permissions(
            workspace.join("tool"),
            std::fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        rt.create(&spec).await.unwrap();
        let (code, out) = sh(
            &rt,
            &spec.id,
            "stat -c '%n %u:%g %a' /etc/motd /workspace /workspace/src /workspace/src/main.rs /workspace/tool && cat /etc/motd && echo more >> /workspace/src/main.rs",
        )
        .await;
        assert_eq!(code, 0, "{out}");
        assert_eq!(
            out,
            "/etc/motd 1000:1000 644\n/workspace 0:0 755\n/workspace/src 0:0 755\n/workspace/src/main.rs 0:0 644\n/workspace/tool 0:0 4755\nseeded\n"
        );
        rt.destroy(&spec.id).await.unwrap();
    }

    /// The runtime reaches the rootfs from inside the user namespace: a state
    /// dir below a 0700 directory is refused with that directory named, and
    /// nothing is left behind.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn private_ancestor_is_refused_clearly() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let private = f.state.parent().unwrap().join("private");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let state = private.join("state");
        let rt = OciRuntime::new(
            OciConfig::new(OciBinary::Crun, &state).with_template_store(&f.common.templates),
        )
        .unwrap();
        let spec = spec_for(&f);
        let err = rt.create(&spec).await.unwrap_err();
        let text = aviary_runtime::conformance::chain(&err);
        assert!(
            text.contains("mode 700") && text.contains("private"),
            "{text}"
        );
        assert!(rt.list().await.unwrap().is_empty());
        assert!(!state.join("userns").exists());
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o711)).unwrap();
        rt.create(&spec).await.unwrap();
        rt.destroy(&spec.id).await.unwrap();
    }

    /// The static envd runs as PID 1 in the user namespace and serves its
    /// inherited socket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn static_envd_runs_as_pid1() {
        let _g = LOCK.lock().await;
        let Some(envd) = std::env::var_os("AVIARY_ENVD").map(PathBuf::from) else {
            eprintln!("SKIP: AVIARY_ENVD is not set (export AVIARY_ENVD=$(scripts/build-envd.sh))");
            return;
        };
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let mut spec = spec_for(&f);
        spec.binds.push(BindMount {
            host: envd,
            sandbox: "/.aviary/envd".into(),
            read_only: true,
        });
        spec.init = vec!["/.aviary/envd".into(), "--listen-fd".into(), "3".into()];
        let h = rt.create(&spec).await.unwrap();
        let socket = h.control_dir.join("envd.sock");
        let start = Instant::now();
        loop {
            match std::os::unix::net::UnixStream::connect(&socket) {
                Ok(_) => break,
                Err(e) if start.elapsed().as_secs() < 5 => {
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("envd never listened on {socket:?}: {e}"),
            }
        }
        let range = idmap::range_of(&f.state, &spec.id).unwrap();
        assert_eq!(host_uid_of(h.init_pid), range.host_first);
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", h.init_pid)).unwrap();
        assert!(comm.starts_with("envd"), "PID 1 is envd: {comm}");
        rt.destroy(&spec.id).await.unwrap();
    }

    /// Create cost with and without the user namespace, side by side (printed;
    /// benchmarks measure, tests do not assert timings).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn create_cost_side_by_side() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let with = runtime(&f, OciBinary::Crun);
        let mut cfg = f.common.config(OciBinary::Crun);
        cfg.user_namespace = None;
        let without = OciRuntime::new(cfg).unwrap();
        let mut times: [Vec<u128>; 2] = [Vec::new(), Vec::new()];
        for round in 0..20 {
            for (i, rt) in [&with, &without].into_iter().enumerate() {
                let spec = spec_for(&f);
                let t = Instant::now();
                rt.create(&spec).await.unwrap();
                if round > 0 {
                    times[i].push(t.elapsed().as_micros());
                }
                rt.destroy(&spec.id).await.unwrap();
            }
        }
        // What one range per sandbox costs over a shared one: the claim, the
        // helper user namespace and the idmapped template view.
        let scratch = f.state.join("scratch");
        let mut steps = Vec::new();
        for i in 0..50 {
            let root = scratch.join(i.to_string());
            std::fs::create_dir_all(root.join("upper")).unwrap();
            let id = SandboxId::generate();
            let t = Instant::now();
            let range = idmap::claim(
                &f.state,
                &f.state,
                &Default::default(),
                &id,
                &|_: &SandboxId, _: &std::path::Path| true,
            )
            .unwrap();
            idmap::prepare_sandbox(&root, &f.template, &[root.join("upper")], range).unwrap();
            idmap::detach_lower(&root).unwrap();
            steps.push(t.elapsed().as_micros());
            idmap::release(
                &f.state,
                &f.state,
                &id,
                &|_: &SandboxId, _: &std::path::Path| false,
            )
            .unwrap();
        }
        std::fs::remove_dir_all(&scratch).unwrap();
        steps.sort_unstable();
        eprintln!(
            "per-sandbox range setup (claim + userns + idmapped mount + detach): median {} us, p90 {} us",
            steps[steps.len() / 2],
            steps[steps.len() * 9 / 10]
        );
        for t in &mut times {
            t.sort_unstable();
        }
        eprintln!(
            "crun create median: with user namespace {} us, without {} us (19 rounds, interleaved)",
            times[0][times[0].len() / 2],
            times[1][times[1].len() / 2]
        );
    }
}
