//! Integration tests on the real thing: crun and runc, overlayfs, cgroups.
//! They need root; each test prints why and returns when it cannot run.
//! All tests take one lock because they count host-wide resources.

mod common;

#[cfg(test)]
mod oci {
    use crate::common::{self, Fixture};
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_runtime::conformance::{self, Footprint};
    use aviary_runtime::{BindMount, Pausable, Runtime, RuntimeStatus, SandboxSpec};
    use aviary_runtime_oci::{OciBinary, OciRuntime};
    use std::path::{Path, PathBuf};
    use std::time::Duration;
    use tokio::sync::Mutex;

    static LOCK: Mutex<()> = Mutex::const_new(());

    /// `None` (with the reason printed) when this machine cannot run the test.
    fn fixture(binary: OciBinary) -> Option<Fixture> {
        common::fixture("rt", &[common::binary_needs(binary)])
    }

    fn runtime(f: &Fixture, binary: OciBinary) -> OciRuntime {
        f.runtime(binary)
    }

    fn spec_for(f: &Fixture) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: f.template_ref.clone(),
            resources: ResourceLimits {
                cpu: 0.5,
                memory_mb: 128,
                disk_mb: 1024,
                pids: 64,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx-test".into(),
            init: vec![
                "/bin/sh".into(),
                "-c".into(),
                "trap 'exit 0' TERM; while :; do sleep 1; done".into(),
            ],
            env: vec!["AVIARY_TEST=1".into()],
            binds: vec![BindMount {
                host: f.envd.clone(),
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }],
        }
    }

    /// Everything a sandbox could leave behind on the host.
    fn footprint(state: &Path) -> Footprint {
        let mut fp = Footprint::new();
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let state_s = state.to_str().unwrap();
        fp.insert(
            "mounts under state dir".into(),
            mountinfo.lines().filter(|l| l.contains(state_s)).count() as u64,
        );
        fp.insert(
            "overlay mounts".into(),
            mountinfo
                .lines()
                .filter(|l| l.contains(" - overlay "))
                .count() as u64,
        );
        let mut cgroup_dirs = 0;
        for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
            if let Ok(rd) = std::fs::read_dir(h.path().join("aviary")) {
                cgroup_dirs += rd.flatten().filter(|e| e.path().is_dir()).count() as u64;
            }
        }
        fp.insert("cgroup dirs under */aviary".into(), cgroup_dirs);
        let mut in_aviary = 0;
        let mut mentioning_state = 0;
        for p in std::fs::read_dir("/proc").unwrap().flatten() {
            if !p
                .file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            {
                continue;
            }
            // Zombies wait for the host's init to reap them; they hold no
            // resources but their pid, and are not ours to reap.
            let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
            if stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            {
                continue;
            }
            if std::fs::read_to_string(p.path().join("cgroup"))
                .is_ok_and(|c| c.contains("/aviary/"))
            {
                in_aviary += 1;
            }
            if std::fs::read(p.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(state_s))
            {
                mentioning_state += 1;
            }
        }
        fp.insert("processes in aviary cgroups".into(), in_aviary);
        fp.insert("processes naming the state dir".into(), mentioning_state);
        let entries = |d: &Path| std::fs::read_dir(d).map(|r| r.count() as u64).unwrap_or(0);
        fp.insert("state dir entries".into(), entries(state));
        fp.insert(
            "crun-state entries".into(),
            entries(&state.join("crun-state")),
        );
        fp.insert(
            "runc-state entries".into(),
            entries(&state.join("runc-state")),
        );
        fp
    }

    /// Hash-free digest of a tree: (path, size, mtime) of every entry.
    fn tree_digest(root: &Path) -> Vec<(PathBuf, u64, i64)> {
        use std::os::unix::fs::MetadataExt;
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let m = e.path().symlink_metadata().unwrap();
                out.push((e.path(), m.size(), m.mtime()));
                if m.is_dir() {
                    stack.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    async fn sh(rt: &OciRuntime, id: &SandboxId, script: &str) -> (i32, String) {
        let out = rt.exec(id, &["/bin/sh", "-c", script]).await.unwrap();
        let mut text = String::from_utf8_lossy(&out.stdout).to_string();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.code.unwrap_or(-1), text)
    }

    async fn conformance_for(binary: OciBinary) {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(binary) else { return };
        let rt = runtime(&f, binary);
        let report = rt.probe().await.unwrap();
        eprintln!(
            "{}: {} (cgroups {})",
            binary.name(),
            report.version,
            report.cgroup_mode
        );
        let make = || spec_for(&f);
        conformance::check_unknown_ids(&rt).await;
        conformance::check_lifecycle(&rt, &make).await;
        conformance::check_refusals(&rt, &make).await;
        conformance::check_limits_visible(&rt, &rt, &make).await;
        conformance::check_pause_resume(&rt, &make).await;
        conformance::check_layers(&rt, &rt, &make).await;
        assert!(rt.list().await.unwrap().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_crun() {
        conformance_for(OciBinary::Crun).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_runc() {
        conformance_for(OciBinary::Runc).await;
    }

    async fn teardown_for(binary: OciBinary) {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(binary) else { return };
        let rt = runtime(&f, binary);
        let make = || spec_for(&f);
        let before = footprint(&f.state);
        let (creates, destroys) =
            conformance::check_teardown(&rt, &make, 50, &|| footprint(&f.state)).await;
        eprintln!(
            "{} over 50 cycles: create median {:?} (min {:?}, max {:?}), destroy median {:?} (min {:?}, max {:?})",
            binary.name(),
            conformance::median(&creates),
            creates.iter().min().unwrap(),
            creates.iter().max().unwrap(),
            conformance::median(&destroys),
            destroys.iter().min().unwrap(),
            destroys.iter().max().unwrap(),
        );
        eprintln!("footprint: {before:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn teardown_50_cycles_crun() {
        teardown_for(OciBinary::Crun).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn teardown_50_cycles_runc() {
        teardown_for(OciBinary::Runc).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inside_view_is_isolated() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let before_template = tree_digest(&f.template);
        let spec = spec_for(&f);
        let h = rt.create(&spec).await.unwrap();
        let id = &spec.id;

        assert_eq!(sh(&rt, id, "hostname").await, (0, "sbx-test\n".into()));
        // Only loopback, and it is up.
        let (_, dev) = sh(
            &rt,
            id,
            "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '",
        )
        .await;
        assert_eq!(dev, "lo\n");
        let (code, out) = sh(
            &rt,
            id,
            "nc -l -p 8080 -e echo hi & sleep 0.3; nc 127.0.0.1 8080 </dev/null",
        )
        .await;
        assert_eq!((code, out.trim()), (0, "hi"), "loopback TCP works");
        // /workspace writable and shared, /tmp a private tmpfs.
        assert_eq!(
            sh(&rt, id, "echo x > /workspace/a && cat /workspace/a").await,
            (0, "x\n".into())
        );
        assert!(h.workspace_dir.join("a").exists());
        let (_, tmp) = sh(&rt, id, "grep ' /tmp ' /proc/self/mountinfo").await;
        assert!(tmp.contains(" - tmpfs "), "/tmp: {tmp}");
        assert!(tmp.contains("size=262144k"), "/tmp size: {tmp}");
        let (_, sys) = sh(&rt, id, "grep ' /sys ' /proc/self/mountinfo").await;
        assert!(sys.contains(" ro,"), "/sys read-only: {sys}");
        // The envd bind is there and read-only.
        assert_eq!(
            sh(&rt, id, "cat /.aviary/envd | head -1").await.1,
            "#!/bin/sh\n"
        );
        let (code, _) = sh(&rt, id, "echo x > /.aviary/envd").await;
        assert_ne!(code, 0, "read-only bind is writable");
        // PID 1: no new privileges, only the granted capabilities.
        let (_, status) = sh(&rt, id, "cat /proc/1/status").await;
        assert!(status.contains("NoNewPrivs:\t1"), "{status}");
        // CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE SYS_CHROOT AUDIT_WRITE
        let expected = (1u64 << 0)
            | (1 << 1)
            | (1 << 3)
            | (1 << 4)
            | (1 << 5)
            | (1 << 6)
            | (1 << 7)
            | (1 << 8)
            | (1 << 10)
            | (1 << 18)
            | (1 << 29);
        let cap_line = status.lines().find(|l| l.starts_with("CapEff:")).unwrap();
        let cap = u64::from_str_radix(cap_line.split_whitespace().nth(1).unwrap(), 16).unwrap();
        assert_eq!(cap, expected, "{cap_line}");
        let bnd = status.lines().find(|l| l.starts_with("CapBnd:")).unwrap();
        assert_eq!(
            u64::from_str_radix(bnd.split_whitespace().nth(1).unwrap(), 16).unwrap(),
            expected
        );
        let (_, exec_status) = sh(&rt, id, "grep NoNewPrivs /proc/self/status").await;
        assert_eq!(exec_status, "NoNewPrivs:\t1\n", "exec'd processes too");
        // What these settings stop (mounts, namespaces, raw sockets, the
        // seccomp deny-list, masked paths and every other escape) is attacked
        // on every tier by `aviary-server/tests/security.rs`.
        // Writes to the rootfs go to the upper dir, never the template.
        assert_eq!(
            sh(
                &rt,
                id,
                "echo changed > /etc/passwd && rm /bin/true && touch /new && echo ok"
            )
            .await
            .0,
            0
        );
        rt.pause(id).await.unwrap();
        assert_eq!(rt.status(id).await.unwrap(), RuntimeStatus::Paused);
        rt.resume(id).await.unwrap();
        assert_eq!(sh(&rt, id, "cat /etc/passwd").await.1, "changed\n");
        rt.destroy(id).await.unwrap();
        assert_eq!(
            tree_digest(&f.template),
            before_template,
            "template changed"
        );
        assert_eq!(
            std::fs::read_to_string(f.template.join("etc/passwd")).unwrap(),
            "root:x:0:0:root:/root:/bin/sh\n"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn oom_kill_is_counted() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let mut spec = spec_for(&f);
        spec.resources.memory_mb = 32;
        rt.create(&spec).await.unwrap();
        assert_eq!(rt.usage(&spec.id).await.unwrap().oom_kills, 0);
        // 64 MiB into a shell variable: well over the limit.
        let (code, _) = sh(
            &rt,
            &spec.id,
            "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo ${#x}",
        )
        .await;
        assert_eq!(code, 137, "the allocating process is SIGKILLed");
        let usage = rt.usage(&spec.id).await.unwrap();
        assert!(usage.oom_kills >= 1, "{usage:?}");
        assert!(usage.memory_peak_bytes >= 30 * 1024 * 1024, "{usage:?}");
        assert_eq!(
            rt.status(&spec.id).await.unwrap(),
            RuntimeStatus::Running,
            "PID 1 survives"
        );
        rt.destroy(&spec.id).await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fork_bomb_is_capped() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let mut spec = spec_for(&f);
        spec.resources.pids = 32;
        rt.create(&spec).await.unwrap();
        // Start 100 sleepers; at most 32 tasks fit.
        let (_, out) = sh(&rt, &spec.id, "for i in $(seq 100); do sleep 30 >/dev/null 2>&1 & done 2>/dev/null; sleep 0.2; echo done").await;
        let usage = rt.usage(&spec.id).await.unwrap();
        assert!(usage.pids_current <= 32, "{usage:?} {out}");
        assert!(usage.pids_current >= 20, "the bomb did run: {usage:?}");
        rt.destroy(&spec.id).await.unwrap();
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn destroy_cleans_up_after_a_crash() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let before = footprint(&f.state);
        let spec = spec_for(&f);
        let h = rt.create(&spec).await.unwrap();
        sh(&rt, &spec.id, "sleep 100 >/dev/null 2>&1 &").await;
        // Simulate a host-side crash: the runtime's state is gone, the
        // processes, overlay, cgroups and sandbox dir are still there.
        std::fs::remove_dir_all(rt.runtime_root().join(spec.id.as_str())).unwrap();
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::Stopped);
        assert!(
            rt.list().await.unwrap().contains(&spec.id),
            "reconciler sees the leftover"
        );
        assert!(Path::new(&format!("/proc/{}", h.init_pid)).exists());
        rt.destroy(&spec.id).await.unwrap();
        // Dead, possibly not yet reaped by the host's init.
        let state =
            std::fs::read_to_string(format!("/proc/{}/stat", h.init_pid)).unwrap_or_default();
        assert!(
            state.is_empty() || state.contains(") Z "),
            "init killed: {state}"
        );
        assert_eq!(footprint(&f.state), before);
        assert_eq!(rt.status(&spec.id).await.unwrap(), RuntimeStatus::NotFound);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_sandboxes_are_independent() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture(OciBinary::Crun) else {
            return;
        };
        let rt = runtime(&f, OciBinary::Crun);
        let specs: Vec<SandboxSpec> = (0..4).map(|_| spec_for(&f)).collect();
        let handles = futures_join(specs.iter().map(|s| rt.create(s))).await;
        for h in &handles {
            h.as_ref().unwrap();
        }
        let ids = rt.list().await.unwrap();
        assert_eq!(ids.len(), 4);
        sh(&rt, &specs[0].id, "echo one > /workspace/f").await;
        assert_eq!(
            sh(&rt, &specs[1].id, "cat /workspace/f").await.0,
            1,
            "workspaces are separate"
        );
        for r in futures_join(specs.iter().map(|s| rt.destroy(&s.id))).await {
            r.unwrap();
        }
        assert!(rt.list().await.unwrap().is_empty());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    /// Polls all futures concurrently on the current task.
    async fn futures_join<F: std::future::Future>(futs: impl Iterator<Item = F>) -> Vec<F::Output> {
        let mut set = Vec::new();
        for f in futs {
            set.push(Box::pin(f));
        }
        let mut out: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (i, f) in set.iter_mut().enumerate() {
                if out[i].is_none() {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(v) => out[i] = Some(v),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        out.into_iter().map(|o| o.unwrap()).collect()
    }
}
