//! Disk quotas on the real thing: crun, a loop device and ext4 per sandbox.
//! `disk_mb` must bound the overlay's writable layer and `/workspace`
//! together, with `ENOSPC` inside and the host file system untouched.
//! They need root; each test prints why and returns when it cannot run.

mod common;

#[cfg(test)]
mod quota {
    use crate::common::{self, mounts_under, Fixture};
    use aviary_core::{NetworkProfile, ResourceLimits, SandboxId};
    use aviary_runtime::conformance;
    use aviary_runtime::{BindMount, Runtime, SandboxSpec, Snapshottable, SpawnOutput};
    use aviary_runtime_oci::{disk_image, DiskFs, OciBinary, OciRuntime, MIN_XFS_DISK_MB};
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;
    use tokio::sync::Mutex;

    /// The tests count host-wide things (mounts, loop devices).
    static LOCK: Mutex<()> = Mutex::const_new(());

    const DISK_MB: u64 = 64;
    const MIB: u64 = 1024 * 1024;

    fn fixture() -> Option<Fixture> {
        common::fixture(
            "quota",
            &[
                common::binary_needs(OciBinary::Crun),
                ("/dev/loop-control", "modprobe loop"),
                ("/usr/sbin/mkfs.ext4", "apt-get install e2fsprogs"),
            ],
        )
    }

    fn runtime(f: &Fixture) -> OciRuntime {
        f.runtime(OciBinary::Crun)
    }

    fn spec_for(f: &Fixture, disk_mb: u64) -> SandboxSpec {
        SandboxSpec {
            id: SandboxId::generate(),
            template: f.template_ref.clone(),
            resources: ResourceLimits {
                cpu: 1.0,
                memory_mb: 256,
                disk_mb,
                pids: 64,
            },
            network: NetworkProfile::None,
            egress: None,
            hostname: "sbx-quota".into(),
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

    fn text(out: &SpawnOutput) -> String {
        format!(
            "exit {:?}, stdout {:?}, stderr {:?}",
            out.code,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Loop devices whose backing file is `image`.
    fn loops_backed_by(image: &Path) -> usize {
        let want = image.to_str().unwrap();
        std::fs::read_dir("/sys/block")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read_to_string(e.path().join("loop/backing_file"))
                    .is_ok_and(|b| b.trim().trim_end_matches(" (deleted)") == want)
            })
            .count()
    }

    /// Bytes the image really takes on the host file system.
    fn allocated(image: &Path) -> u64 {
        std::fs::metadata(image).unwrap().blocks() * 512
    }

    #[tokio::test]
    async fn full_sandbox_gets_enospc_on_workspace_and_root_from_one_budget() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = runtime(&f);
        rt.probe().await.unwrap();
        let spec = spec_for(&f, DISK_MB);
        let h = rt.create(&spec).await.unwrap();
        let image = disk_image(&f.state.join(spec.id.as_str()));

        // df inside shows the class's disk, for / and /workspace alike.
        let df = sh(&rt, &spec.id, "df -m /workspace / | tail -n 2").await;
        assert!(df.success(), "{}", text(&df));
        for line in String::from_utf8_lossy(&df.stdout).lines() {
            let size: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            assert!((DISK_MB / 2..=DISK_MB).contains(&size), "df: {line}");
        }

        // The disk's mounts name paths inside the disk, never the host's
        // state dir (`/workspace` is the disk's `/workspace`).
        let mountinfo = sh(&rt, &spec.id, "cat /proc/self/mountinfo").await;
        let mountinfo = String::from_utf8_lossy(&mountinfo.stdout).into_owned();
        assert!(
            !mountinfo.contains(f.state.to_str().unwrap()),
            "{mountinfo}"
        );
        assert!(
            mountinfo
                .lines()
                .any(|l| l.split(' ').nth(3) == Some("/workspace")
                    && l.split(' ').nth(4) == Some("/workspace")),
            "{mountinfo}"
        );

        // 200 MB into /workspace: ENOSPC inside.
        let out = sh(
            &rt,
            &spec.id,
            "dd if=/dev/zero of=/workspace/big bs=1M count=200 conv=fsync",
        )
        .await;
        assert!(!out.success(), "{}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("No space left on device"),
            "{}",
            text(&out)
        );
        // The overlay's writable layer shares that budget: nothing fits on /.
        let out = sh(
            &rt,
            &spec.id,
            "dd if=/dev/zero of=/root/big bs=1M count=8 conv=fsync",
        )
        .await;
        assert!(!out.success(), "{}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("No space left on device"),
            "{}",
            text(&out)
        );
        // Freeing /workspace makes room on /, and then / fills up by itself.
        let out = sh(
            &rt,
            &spec.id,
            "rm -f /workspace/big /root/big && sync && \
             dd if=/dev/zero of=/root/some bs=1M count=16 conv=fsync",
        )
        .await;
        assert!(out.success(), "{}", text(&out));
        let out = sh(
            &rt,
            &spec.id,
            "dd if=/dev/zero of=/root/big bs=1M count=200 conv=fsync",
        )
        .await;
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("No space left on device"),
            "{}",
            text(&out)
        );
        // ... after which /workspace is full too.
        let out = sh(
            &rt,
            &spec.id,
            "dd if=/dev/zero of=/workspace/more bs=1M count=8 conv=fsync",
        )
        .await;
        assert!(!out.success(), "{}", text(&out));

        // The host holds at most disk_mb for all of it.
        assert!(
            allocated(&image) <= DISK_MB * MIB,
            "image takes {} bytes",
            allocated(&image)
        );
        assert!(h.workspace_dir.starts_with(f.state.join(spec.id.as_str())));
        rt.destroy(&spec.id).await.unwrap();
    }

    #[tokio::test]
    async fn destroy_releases_disk_loop_device_and_dirs() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = runtime(&f);
        let spec = spec_for(&f, DISK_MB);
        rt.create(&spec).await.unwrap();
        let root = f.state.join(spec.id.as_str());
        let image = disk_image(&root);
        assert_eq!(loops_backed_by(&image), 1);
        assert!(mounts_under(&root).contains(&root.display().to_string()));
        let out = sh(
            &rt,
            &spec.id,
            "dd if=/dev/zero of=/workspace/f bs=1M count=20 conv=fsync",
        )
        .await;
        assert!(out.success(), "{}", text(&out));

        rt.destroy(&spec.id).await.unwrap();
        assert!(!root.exists());
        assert!(!image.exists());
        assert_eq!(mounts_under(&f.state), Vec::<String>::new());
        assert_eq!(loops_backed_by(&image), 0, "loop device freed");
        assert!(rt.list().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn restart_reuses_mounted_disks_and_remounts_after_reboot() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let first = runtime(&f);
        let spec = spec_for(&f, DISK_MB);
        first.create(&spec).await.unwrap();
        let root = f.state.join(spec.id.as_str());
        let out = sh(&first, &spec.id, "echo kept > /workspace/note").await;
        assert!(out.success(), "{}", text(&out));
        let mounts = mounts_under(&root);

        // A server restart: a second runtime on the same state dir changes
        // no mount and drives the running sandbox.
        let second = runtime(&f);
        assert_eq!(mounts_under(&root), mounts);
        let out = sh(&second, &spec.id, "cat /workspace/note").await;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "kept\n",
            "{}",
            text(&out)
        );
        assert_eq!(loops_backed_by(&disk_image(&root)), 1);

        // A reboot: processes and mounts gone, dirs and images left.
        let out = second
            .exec(&spec.id, &["/bin/sh", "-c", "sync"])
            .await
            .unwrap();
        assert!(out.success());
        let crun = std::process::Command::new("crun")
            .args(["--root"])
            .arg(f.state.join("crun-state"))
            .args(["delete", "--force", spec.id.as_str()])
            .status()
            .unwrap();
        assert!(crun.success());
        for m in mounts.iter().rev() {
            nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
        assert!(!root.join("workspace").exists(), "disk is unmounted");
        let third = runtime(&f);
        assert_eq!(
            std::fs::read_to_string(root.join("workspace/note")).unwrap(),
            "kept\n",
            "the sandbox's layers come back"
        );
        third.destroy(&spec.id).await.unwrap();
        assert!(!root.exists());
        assert!(!disk_image(&root).exists());
        assert_eq!(mounts_under(&f.state), Vec::<String>::new());
    }

    /// A stage no create adopted (a restore cut off) is listed as the
    /// sandbox's, so the reconciler can destroy it as an orphan.
    #[tokio::test]
    async fn an_unadopted_stage_is_listed_and_destroyed() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = runtime(&f);
        std::fs::create_dir_all(&f.state).unwrap();
        let spec = spec_for(&f, DISK_MB);
        let seed = rt.stage_layers(&spec.id).await.unwrap();
        std::fs::write(seed.workspace.join("left"), "x").unwrap();
        assert_eq!(rt.list().await.unwrap(), vec![spec.id.clone()]);
        rt.destroy(&spec.id).await.unwrap();
        assert!(rt.list().await.unwrap().is_empty());
        assert!(!seed.workspace.exists(), "stage removed");
        assert_eq!(mounts_under(&f.state), Vec::<String>::new());
    }

    #[tokio::test]
    async fn staged_seed_layers_are_adopted_onto_the_disk() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = runtime(&f);
        std::fs::create_dir_all(&f.state).unwrap();
        let spec = spec_for(&f, DISK_MB);
        let seed = rt.stage_layers(&spec.id).await.unwrap();
        std::fs::create_dir_all(seed.workspace.join("src")).unwrap();
        std::fs::write(seed.workspace.join("src/main.py"), "print(42)\n").unwrap();
        std::fs::create_dir_all(seed.writable.join("root")).unwrap();
        std::fs::write(seed.writable.join("root/.profile"), "export A=1\n").unwrap();
        // An overlay whiteout: /etc/passwd was deleted in the snapshot.
        std::fs::create_dir_all(seed.writable.join("etc")).unwrap();
        nix::sys::stat::mknod(
            &seed.writable.join("etc/passwd"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o000),
            0,
        )
        .unwrap();

        rt.create(&spec).await.unwrap();
        assert!(
            !seed.workspace.exists() && !seed.writable.exists(),
            "seed consumed"
        );
        let out = sh(
            &rt,
            &spec.id,
            "cat /workspace/src/main.py /root/.profile; test -e /etc/passwd || echo gone",
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "print(42)\nexport A=1\ngone\n",
            "{}",
            text(&out)
        );
        // The adopted layers count against the disk like everything else.
        let out = sh(
            &rt,
            &spec.id,
            "dd if=/dev/zero of=/workspace/src/big bs=1M count=200 conv=fsync",
        )
        .await;
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("No space left on device"),
            "{}",
            text(&out)
        );
        rt.destroy(&spec.id).await.unwrap();

        // A seed larger than the disk: create fails and leaves nothing.
        let spec = spec_for(&f, DISK_MB);
        let seed = rt.stage_layers(&spec.id).await.unwrap();
        let big = std::fs::File::create(seed.workspace.join("big")).unwrap();
        // Real blocks (a sparse file would copy sparse).
        std::io::Write::write_all(&mut &big, &vec![7u8; (DISK_MB * 2 * MIB) as usize]).unwrap();
        let err = rt.create(&spec).await.unwrap_err();
        let chain = conformance::chain(&err);
        assert!(chain.contains("No space left on device"), "{chain}");
        assert!(!f.state.join(spec.id.as_str()).exists());
        assert!(!disk_image(&f.state.join(spec.id.as_str())).exists());
        assert!(!seed.workspace.exists() && !seed.writable.exists());
        assert_eq!(mounts_under(&f.state), Vec::<String>::new());
    }

    #[tokio::test]
    async fn quotas_off_keeps_the_sandbox_on_the_host_file_system() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let mut config = f.config(OciBinary::Crun);
        config.disk_quota = false;
        let rt = OciRuntime::new(config).unwrap();
        let spec = spec_for(&f, DISK_MB);
        rt.create(&spec).await.unwrap();
        let root = f.state.join(spec.id.as_str());
        assert!(!disk_image(&root).exists());
        assert_eq!(
            std::fs::metadata(&root).unwrap().dev(),
            std::fs::metadata(f.dir.path()).unwrap().dev()
        );
        rt.destroy(&spec.id).await.unwrap();
        assert!(!root.exists());
    }

    #[tokio::test]
    async fn disks_smaller_than_the_minimum_are_refused() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = runtime(&f);
        let spec = spec_for(&f, 4);
        let err = rt.create(&spec).await.unwrap_err();
        assert!(
            conformance::chain(&err).contains("smallest sandbox disk"),
            "{err}"
        );
        assert!(!f.state.join(spec.id.as_str()).exists());
    }

    /// Why XFS disks cannot be tested here (besides what [`fixture`] checks).
    fn xfs_missing() -> Option<&'static str> {
        if !Path::new("/usr/sbin/mkfs.xfs").exists() && !Path::new("/sbin/mkfs.xfs").exists() {
            return Some("mkfs.xfs is missing (scripts/deps.sh installs xfsprogs)");
        }
        let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !fs
            .lines()
            .any(|l| l.split_whitespace().last() == Some("xfs"))
            && !std::process::Command::new("modprobe")
                .arg("xfs")
                .status()
                .is_ok_and(|s| s.success())
        {
            return Some("the kernel has no XFS (modprobe xfs failed)");
        }
        None
    }

    fn xfs_runtime(f: &Fixture, pool: usize) -> OciRuntime {
        let mut config = f.config(OciBinary::Crun);
        config.disk_fs = DiskFs::Xfs;
        config.disk_pool = pool;
        OciRuntime::new(config).unwrap()
    }

    /// The file system type mounted at `dir` (this mount namespace).
    fn fstype_at(dir: &Path) -> Option<String> {
        let d = dir.to_str().unwrap();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .rfind(|l| l.split(' ').nth(4) == Some(d))
            .and_then(|l| l.split(" - ").nth(1))
            .and_then(|rest| rest.split(' ').next())
            .map(str::to_string)
    }

    #[tokio::test]
    async fn xfs_disks_below_its_minimum_are_refused() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let rt = xfs_runtime(&f, 0);
        // fine on ext4, too small for mkfs.xfs
        let spec = spec_for(&f, DISK_MB);
        let err = rt.create(&spec).await.unwrap_err();
        assert!(
            conformance::chain(&err)
                .contains("disk_mb 64 is below the smallest sandbox disk on xfs (300 MiB)"),
            "{err}"
        );
        assert!(!f.state.join(spec.id.as_str()).exists());
        assert!(!disk_image(&f.state.join(spec.id.as_str())).exists());
    }

    #[tokio::test]
    async fn xfs_disks_probe_pool_and_shadows() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        if let Some(why) = xfs_missing() {
            eprintln!("SKIPPED: quota/xfs: {why}");
            return;
        }
        let rt = xfs_runtime(&f, 1);
        rt.probe().await.unwrap();
        assert_eq!(rt.disks().fs(), DiskFs::Xfs);
        // the golden image is XFS's own, and sparse despite the 64 MiB log
        let golden = f.state.join(format!(".disks/xfs-v1-{MIN_XFS_DISK_MB}.img"));
        assert!(golden.is_file(), "{golden:?}");
        assert!(allocated(&golden) < 4 * MIB, "{}", allocated(&golden));

        let a = spec_for(&f, MIN_XFS_DISK_MB);
        rt.create(&a).await.unwrap();
        let root_a = f.state.join(a.id.as_str());
        assert_eq!(fstype_at(&root_a).as_deref(), Some("xfs"));
        // a pooled disk (made in the background after the first create)
        // mounts as XFS too
        for _ in 0..400 {
            if rt.disks().pooled() == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        assert_eq!(rt.disks().pooled(), 1, "pool never refilled");
        let b = spec_for(&f, MIN_XFS_DISK_MB);
        rt.create(&b).await.unwrap();
        let root_b = f.state.join(b.id.as_str());
        assert_eq!(fstype_at(&root_b).as_deref(), Some("xfs"));
        let out = sh(&rt, &b.id, "echo hi > /workspace/x && cat /workspace/x").await;
        assert!(out.success(), "{}", text(&out));

        // the layers come with a host-only shadow dir on the same disk
        let layers = rt.export_layers(&a.id).await.unwrap();
        let shadows = layers.shadows.clone().unwrap();
        assert_eq!(shadows, root_a.join(".shadow"));
        let meta = std::fs::symlink_metadata(&shadows).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o777, 0o700);
        assert_eq!(
            meta.dev(),
            std::fs::metadata(&layers.workspace).unwrap().dev()
        );
        assert_eq!(
            layers.shadow(aviary_runtime::Layer::Workspace),
            Some(shadows.join("workspace"))
        );
        let out = sh(&rt, &a.id, "cat /proc/self/mountinfo; ls -a /").await;
        assert!(!String::from_utf8_lossy(&out.stdout).contains(".shadow"));

        // A reboot, then a runtime set back to ext4: the XFS disk is still
        // mounted as XFS (the file system comes from the image itself).
        let out = sh(&rt, &b.id, "sync").await;
        assert!(out.success(), "{}", text(&out));
        let crun = std::process::Command::new("crun")
            .args(["--root"])
            .arg(f.state.join("crun-state"))
            .args(["delete", "--force", b.id.as_str()])
            .status()
            .unwrap();
        assert!(crun.success());
        for m in mounts_under(&root_b).iter().rev() {
            nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
        assert!(!root_b.join("workspace").exists(), "disk is unmounted");
        let ext4 = runtime(&f);
        assert_eq!(fstype_at(&root_b).as_deref(), Some("xfs"));
        assert_eq!(
            std::fs::read_to_string(root_b.join("workspace/x")).unwrap(),
            "hi\n"
        );
        ext4.destroy(&b.id).await.unwrap();
        assert!(!root_b.exists());

        rt.destroy(&a.id).await.unwrap();
        assert!(!shadows.exists());
        rt.disks().drain_pool();
        assert_eq!(mounts_under(&f.state), Vec::<String>::new());
    }

    #[tokio::test]
    async fn quotas_off_offer_no_shadow_dir() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let mut config = f.config(OciBinary::Crun);
        config.disk_quota = false;
        let rt = OciRuntime::new(config).unwrap();
        let spec = spec_for(&f, DISK_MB);
        rt.create(&spec).await.unwrap();
        // shadows would pin blocks on the host's file system, unbounded
        assert_eq!(rt.export_layers(&spec.id).await.unwrap().shadows, None);
        rt.destroy(&spec.id).await.unwrap();
    }

    fn median_p90(mut v: Vec<std::time::Duration>) -> String {
        v.sort();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        format!(
            "median {:.1} ms, p90 {:.1} ms",
            ms(v[v.len() / 2]),
            ms(v[v.len() * 9 / 10])
        )
    }

    /// What the quota costs at create and destroy: `n` creates with and
    /// without, interleaved so both see the same machine. A measurement,
    /// not a test: run by `scripts/bench.sh`.
    #[tokio::test]
    #[ignore = "a timing measurement, not a test: scripts/bench.sh runs it and writes BENCHMARKS.md; tests never assert timings"]
    async fn measure_create_cost_with_and_without_quota() {
        let _g = LOCK.lock().await;
        let Some(f) = fixture() else { return };
        let n: usize = std::env::var("AVIARY_QUOTA_BENCH_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        let with = runtime(&f);
        let mut config = f.config(OciBinary::Crun);
        config.disk_quota = false;
        let without = OciRuntime::new(config).unwrap();
        // the same quota on XFS disks (`disk_fs = "xfs"`), when it can run
        let xfs = xfs_missing().is_none().then(|| xfs_runtime(&f, 0));
        let t = std::time::Instant::now();
        with.probe().await.unwrap();
        let probe = t.elapsed();
        let mut probe_xfs = None;
        if let Some(x) = &xfs {
            let t = std::time::Instant::now();
            x.probe().await.unwrap();
            probe_xfs = Some(t.elapsed());
        }
        let (mut c_on, mut d_on, mut c_off, mut d_off) = (vec![], vec![], vec![], vec![]);
        let (mut c_xfs, mut d_xfs) = (vec![], vec![]);
        for i in 0..=n {
            let mut runs = vec![
                (&with, &mut c_on, &mut d_on),
                (&without, &mut c_off, &mut d_off),
            ];
            if let Some(x) = &xfs {
                runs.push((x, &mut c_xfs, &mut d_xfs));
            }
            for (rt, creates, destroys) in runs {
                // Class-sized disk: 10 GiB, as the default "small" class.
                let spec = spec_for(&f, 10240);
                let t = std::time::Instant::now();
                rt.create(&spec).await.unwrap();
                let created = t.elapsed();
                let t = std::time::Instant::now();
                rt.destroy(&spec.id).await.unwrap();
                // The first round warms caches and cgroup parents.
                if i > 0 {
                    creates.push(created);
                    destroys.push(t.elapsed());
                }
            }
        }
        // Adopting a staged snapshot (500 files, 50 MB): a rename without the
        // quota, a copy onto the sandbox's disk with it.
        let (mut s_on, mut s_off) = (vec![], vec![]);
        for _ in 0..5 {
            for (rt, times) in [(&with, &mut s_on), (&without, &mut s_off)] {
                let spec = spec_for(&f, 10240);
                let seed = rt.stage_layers(&spec.id).await.unwrap();
                for i in 0..500 {
                    std::fs::write(seed.workspace.join(format!("f{i}")), vec![1u8; 100_000])
                        .unwrap();
                }
                let t = std::time::Instant::now();
                rt.create(&spec).await.unwrap();
                times.push(t.elapsed());
                rt.destroy(&spec.id).await.unwrap();
            }
        }
        println!(
            "probe (incl. disk check): {:.1} ms",
            probe.as_secs_f64() * 1000.0
        );
        println!("create with 50 MB seed, quota on : {}", median_p90(s_on));
        println!("create with 50 MB seed, quota off: {}", median_p90(s_off));
        if let Some(p) = probe_xfs {
            println!("probe on xfs: {:.1} ms", p.as_secs_f64() * 1000.0);
            println!("create, disk quota on xfs : {}", median_p90(c_xfs));
            println!("destroy, disk quota on xfs: {}", median_p90(d_xfs));
        }
        println!("create, disk quota on : {}", median_p90(c_on));
        println!("create, disk quota off: {}", median_p90(c_off));
        println!("destroy, disk quota on : {}", median_p90(d_on));
        println!("destroy, disk quota off: {}", median_p90(d_off));
    }
}
