//! Disks made ahead of need (`OciConfig::disk_pool`, issue 12) on the real
//! thing: crun, loop devices and ext4. A pooled disk must be exactly what a
//! create would have made (its own empty file system of the class's size,
//! quota enforced), never reused, refilled after each take, and nothing of
//! the pool may stay on the host once the runtime is gone.
//! They need root; each test prints why and returns when it cannot run.

mod common;

#[cfg(test)]
mod disk_pool {
    use crate::common::{self, mounts_under, Fixture};
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_runtime::{BindMount, Runtime, SandboxSpec, SpawnOutput};
    use aviary_runtime_oci::{disk_image, OciBinary, OciRuntime};
    use std::path::Path;
    use std::time::Duration;
    use tokio::sync::Mutex;

    /// The tests count host-wide things (mounts, loop devices).
    static LOCK: Mutex<()> = Mutex::const_new(());

    const DISK_MB: u64 = 64;

    fn fixture() -> Option<Fixture> {
        common::fixture(
            "disk_pool",
            &[
                common::binary_needs(OciBinary::Crun),
                ("/dev/loop-control", "modprobe loop"),
                ("/usr/sbin/mkfs.ext4", "apt-get install e2fsprogs"),
            ],
        )
    }

    fn runtime(f: &Fixture, pool: usize) -> OciRuntime {
        let mut cfg = f.config(OciBinary::Crun);
        cfg.disk_pool = pool;
        OciRuntime::new(cfg).unwrap()
    }

    fn spec(f: &Fixture) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: f.template_ref.clone(),
            resources: ResourceLimits {
                cpu: 1.0,
                memory_mb: 256,
                disk_mb: DISK_MB,
                pids: 64,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx-pool".into(),
            init: vec![
                "/bin/sh".into(),
                "-c".into(),
                "trap 'exit 0' TERM; while :; do sleep 1; done".into(),
            ],
            env: vec![],
            binds: vec![BindMount {
                host: f.envd.clone(),
                sandbox: "/.aviary/envd".into(),
                read_only: true,
            }],
        }
    }

    async fn sh(rt: &OciRuntime, id: &SandboxId, script: &str) -> SpawnOutput {
        rt.exec(id, &["/bin/sh", "-c", script]).await.unwrap()
    }

    fn out(o: &SpawnOutput) -> String {
        format!(
            "exit {:?}, stdout {:?}, stderr {:?}",
            o.code,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    }

    /// How many loop devices have their backing file under `dir`.
    fn loops_under(dir: &Path) -> usize {
        loop_names_under(dir).len()
    }

    /// The loop devices (names) whose backing file lies under `dir`.
    fn loop_names_under(dir: &Path) -> Vec<String> {
        let d = dir.to_str().unwrap();
        std::fs::read_dir("/sys/block")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_to_string(e.path().join("loop/backing_file"))
                    .is_ok_and(|b| b.trim().starts_with(d))
            })
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    async fn wait_pooled(rt: &OciRuntime, n: usize) {
        for _ in 0..200 {
            if rt.disks().pooled() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!(
            "the pool never held {n} disks (holds {})",
            rt.disks().pooled()
        );
    }

    #[tokio::test]
    async fn a_pooled_disk_is_a_fresh_bounded_file_system_and_is_refilled() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let pool_dir = f.state.join(".disk-pool");
        {
            let rt = runtime(&f, 2);
            // the first create of a size makes its disk and starts the pool
            let a = spec(&f);
            rt.create(&a).await.unwrap();
            // (and crun ran in the runtime's own small mount namespace)
            assert!(rt.uses_prepared_namespace());
            wait_pooled(&rt, 2).await;
            assert_eq!(mounts_under(&pool_dir).len(), 2, "two disks ready");

            // the second one is moved into place from the pool: its disk is
            // on a loop device that backed a pooled disk a moment ago
            let pooled_loops = loop_names_under(&pool_dir);
            assert_eq!(pooled_loops.len(), 2);
            let b = spec(&f);
            rt.create(&b).await.unwrap();
            let root_b = f.state.join(b.id.as_str());
            let b_loops = loop_names_under(&disk_image(&root_b));
            assert_eq!(b_loops.len(), 1);
            assert!(
                pooled_loops.contains(&b_loops[0]),
                "{b_loops:?} not in {pooled_loops:?}"
            );
            assert!(mounts_under(&root_b).contains(&root_b.display().to_string()));
            assert!(disk_image(&root_b).exists(), "its image carries its name");
            wait_pooled(&rt, 2).await;

            // fresh: nothing of another sandbox, and the class's size,
            // enforced (ENOSPC inside, from one budget)
            let ls = sh(&rt, &b.id, "ls -A /workspace; df -m /workspace | tail -n 1").await;
            assert!(ls.success(), "{}", out(&ls));
            let text = String::from_utf8_lossy(&ls.stdout).into_owned();
            let mut lines = text.lines();
            let df = lines.next_back().unwrap();
            assert_eq!(lines.count(), 0, "an empty workspace: {text}");
            let size: u64 = df.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert!((DISK_MB / 2..=DISK_MB).contains(&size), "df: {df}");
            sh(&rt, &a.id, "echo from-a > /workspace/a").await;
            let fill = sh(
                &rt,
                &b.id,
                "dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>&1",
            )
            .await;
            assert!(out(&fill).contains("No space left"), "{}", out(&fill));
            let ls = sh(&rt, &b.id, "ls -A /workspace").await;
            assert_eq!(
                String::from_utf8_lossy(&ls.stdout).trim(),
                "fill",
                "b sees only its own files"
            );

            // the pool is not visible to a sandbox
            let mountinfo = sh(&rt, &b.id, "cat /proc/self/mountinfo").await;
            assert!(
                !String::from_utf8_lossy(&mountinfo.stdout).contains(".disk-pool"),
                "{}",
                out(&mountinfo)
            );

            for s in [&a, &b] {
                rt.destroy(&s.id).await.unwrap();
                assert!(!f.state.join(s.id.as_str()).exists());
                assert!(!disk_image(&f.state.join(s.id.as_str())).exists());
            }
            // only the pool's two disks remain
            assert_eq!(
                mounts_under(&f.state).len(),
                2,
                "{:?}",
                mounts_under(&f.state)
            );
            assert_eq!(loops_under(&f.state), 2);
        }
        // the runtime is gone: so is its pool
        for _ in 0..100 {
            if mounts_under(&f.state).is_empty() && loops_under(&f.state) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(mounts_under(&f.state), Vec::<String>::new());
        assert_eq!(loops_under(&f.state), 0, "loop devices freed");
        assert!(!pool_dir.exists() || std::fs::read_dir(&pool_dir).unwrap().count() == 0);
    }

    #[tokio::test]
    async fn a_previous_runs_pool_is_swept_and_the_pool_off_makes_disks_as_before() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        // a previous run that ended without dropping its pool: a mounted
        // disk and a stray image in the pool dir
        let pool_dir = f.state.join(".disk-pool");
        let left = pool_dir.join("64-7");
        std::fs::create_dir_all(&left).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &left,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        std::fs::write(pool_dir.join("64-8.img"), b"stale").unwrap();

        // a runtime with the pool off leaves it alone (it is not its own)
        let off = runtime(&f, 0);
        assert_eq!(mounts_under(&pool_dir).len(), 1);
        let s = spec(&f);
        off.create(&s).await.unwrap();
        assert_eq!(off.disks().pooled(), 0, "pool off: nothing made ahead");
        off.destroy(&s.id).await.unwrap();
        drop(off);
        assert_eq!(mounts_under(&pool_dir).len(), 1);

        // a runtime with the pool on sweeps it before anything else
        let on = runtime(&f, 1);
        assert_eq!(mounts_under(&pool_dir), Vec::<String>::new());
        assert!(!pool_dir.join("64-8.img").exists());
        drop(on);
    }
}
