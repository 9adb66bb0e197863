//! Measures the reuse layer on this machine: checker latency, `pick_best`
//! over many candidates, the probe script's wall time and projection planning
//! / applying over a few thousand files. Run with
//! `cargo run --release -p aviary-reuse --example reuse_bench`.

use aviary_core::{NetworkProfile, SandboxId, SandboxState, Scope};
use aviary_reuse::manifest::probe_script;
use aviary_reuse::{
    apply, EnvironmentManifest, EnvironmentRequirements, LocalDirTarget, PackageRequirement,
    PackageSet, ProbeOutputs, ProjectionPlanner, ProjectionRoot, RemoteIndex, ReuseCandidate,
    ReuseChecker, ReuseRequest,
};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn candidate(i: usize) -> ReuseCandidate {
    let mut m = EnvironmentManifest::new("sha256:tpl", aviary_core::now());
    m.runtimes.insert("python".into(), "3.12.4".into());
    m.python_interpreters.insert("3.12.4".into());
    // 200 installed packages, a realistic data-science environment.
    m.pip = Some(PackageSet::new(
        (0..200)
            .map(|k| (format!("pkg{k}"), format!("1.{}.0", (k + i) % 7)))
            .collect(),
    ));
    ReuseCandidate {
        sandbox_id: SandboxId::generate(),
        tenant: match i % 3 {
            0 => "other".into(),
            _ => "acme".into(),
        },
        user_id: Some("alice".into()),
        session_id: Some(format!("s-{}", i % 5)),
        agent: None,
        scope: Scope::User,
        state: SandboxState::Idle,
        template_digest: "sha256:tpl".into(),
        runtime: "crun".into(),
        resource_class: "python-small".into(),
        network_profile: NetworkProfile::None,
        secret_scope: None,
        healthy: true,
        tainted: false,
        policy_violations: Vec::new(),
        manifest: Some(m),
        clean_snapshots: Vec::new(),
    }
}

fn main() {
    let checker = ReuseChecker::default();
    let request = ReuseRequest {
        tenant: "acme".into(),
        user_id: Some("alice".into()),
        session_id: Some("s-1".into()),
        scope: Scope::User,
        template_digest: "sha256:tpl".into(),
        runtime: "crun".into(),
        resource_class: "python-small".into(),
        requirements: EnvironmentRequirements {
            packages: ["pkg1<1.5", "pkg2", "pkg3>=1.0", "matplotlib"]
                .iter()
                .map(|s| PackageRequirement::pip(s).unwrap())
                .collect(),
            ..Default::default()
        },
        ..Default::default()
    };
    let cands: Vec<ReuseCandidate> = (0..100).map(candidate).collect();

    let mut t = Vec::new();
    for i in 0..2000 {
        let s = Instant::now();
        std::hint::black_box(checker.check(&request, &cands[1 + i % 2]));
        t.push(s.elapsed());
    }
    println!(
        "check (200-package manifest, 4 requirements): median {:?}",
        median(t)
    );
    let mut t = Vec::new();
    for _ in 0..50 {
        let s = Instant::now();
        std::hint::black_box(checker.pick_best(&request, &cands));
        t.push(s.elapsed());
    }
    println!("pick_best over 100 candidates: median {:?}", median(t));

    let mut t = Vec::new();
    let mut n_pkgs = 0;
    for _ in 0..5 {
        let s = Instant::now();
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(probe_script())
            .output()
            .unwrap();
        let m = EnvironmentManifest::from_probe_outputs(
            "sha256:host",
            &ProbeOutputs::parse_script_output(&String::from_utf8_lossy(&out.stdout)),
            aviary_core::now(),
        );
        t.push(s.elapsed());
        n_pkgs = m.installed_capabilities().len();
    }
    println!(
        "probe script + parse on this host ({n_pkgs} packages/capabilities): median {:?}",
        median(t)
    );

    // Projection: 2000 files of 4 KiB in 40 directories.
    let host = tempfile::tempdir().unwrap();
    for d in 0..40 {
        let dir = host.path().join(format!("skills/s{d}/sub"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..50 {
            std::fs::write(
                dir.join(format!("f{f}.md")),
                vec![b'a' + (f % 26) as u8; 4096],
            )
            .unwrap();
        }
    }
    let roots = [ProjectionRoot::new(
        host.path().join("skills"),
        "/workspace/skills",
    )];
    let sandbox = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let planner = ProjectionPlanner::default();

    let s = Instant::now();
    let plan = planner.plan(&roots, &RemoteIndex::default()).unwrap();
    let plan_first = s.elapsed();
    let s = Instant::now();
    let report = rt
        .block_on(apply(&plan, &mut LocalDirTarget::new(sandbox.path())))
        .unwrap();
    let apply_first = s.elapsed();
    println!(
        "projection first sync: plan {plan_first:?}, apply {apply_first:?} ({} files, {} bytes)",
        report.uploaded, report.bytes_uploaded
    );
    std::fs::write(host.path().join("skills/s3/sub/f7.md"), b"changed").unwrap();
    std::fs::remove_file(host.path().join("skills/s4/sub/f8.md")).unwrap();
    let s = Instant::now();
    let plan2 = planner.plan(&roots, &plan.next_index).unwrap();
    let plan_again = s.elapsed();
    let s = Instant::now();
    let report = rt
        .block_on(apply(&plan2, &mut LocalDirTarget::new(sandbox.path())))
        .unwrap();
    println!(
        "projection re-sync after 1 edit + 1 delete: plan {plan_again:?}, apply {:?} (uploaded {}, deleted {}, skipped {})",
        s.elapsed(),
        report.uploaded,
        report.deleted,
        report.skipped
    );
}
