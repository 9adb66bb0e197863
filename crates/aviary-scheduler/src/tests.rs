use super::*;
use proptest::prelude::*;

const TPL: &str = "sha256:aaaa";

fn t0() -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
}

fn node(id: &str, cpu: f64, mem_mb: u64) -> NodeView {
    NodeView {
        id: id.into(),
        address: format!("127.0.0.1:{}", 7500 + cpu as u16),
        runtimes: vec!["crun".into(), "runc".into()],
        templates: vec![TPL.into()],
        cpu_capacity: cpu,
        memory_capacity_mb: mem_mb,
        cpu_committed: 0.0,
        memory_committed_mb: 0,
        cpu_used: 0.0,
        memory_used_mb: 0,
        warm: HashMap::new(),
        healthy: true,
        last_seen: t0(),
    }
}

/// Three nodes of 2, 4 and 8 CPUs (4, 8, 16 GiB).
fn three() -> Vec<NodeView> {
    vec![
        node("n2", 2.0, 4096),
        node("n4", 4.0, 8192),
        node("n8", 8.0, 16384),
    ]
}

fn req(class: &str, cpu: f64, mem_mb: u64) -> PlacementRequest {
    PlacementRequest {
        class: class.into(),
        limits: ResourceLimits {
            cpu,
            memory_mb: mem_mb,
            disk_mb: 10240,
            pids: 512,
        },
        template_digest: TPL.into(),
        runtime: "crun".into(),
    }
}

fn strict(k: usize) -> SchedulerConfig {
    SchedulerConfig {
        cpu_overcommit: 1.0,
        memory_overcommit: 1.0,
        sample_k: k,
        ..SchedulerConfig::default()
    }
}

fn rejection_of<'a>(d: &'a [Candidate], node: &str) -> Option<&'a Rejection> {
    d.iter()
        .find(|c| c.node == node)
        .and_then(|c| match &c.outcome {
            CandidateOutcome::Rejected { rejection } => Some(rejection),
            _ => None,
        })
}

#[test]
fn capacity_filter_without_overcommit() {
    let s = Scheduler::with_seed(strict(3), 1);
    // compute-large: 8 CPU / 16 GiB fits only the 8-CPU node.
    let d = s
        .place(&three(), &req("compute-large", 8.0, 16384), t0())
        .unwrap();
    assert_eq!(d.node_id, "n8");
    assert!(matches!(
        rejection_of(&d.candidates, "n2"),
        Some(Rejection::CpuFull { .. })
    ));
    assert!(matches!(
        rejection_of(&d.candidates, "n4"),
        Some(Rejection::CpuFull { .. })
    ));
    // 9 CPUs fit nowhere: every node is rejected, reasons kept.
    let e = s.place(&three(), &req("x", 9.0, 1024), t0()).unwrap_err();
    match e {
        ScheduleError::NoFeasibleNode { candidates } => {
            assert_eq!(candidates.len(), 3);
            assert!(candidates
                .iter()
                .all(|c| matches!(c.outcome, CandidateOutcome::Rejected { .. })));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn overcommit_lets_committed_exceed_capacity_up_to_the_ratio() {
    let cfg = SchedulerConfig {
        cpu_overcommit: 2.0,
        memory_overcommit: 1.0,
        sample_k: 1,
        ..SchedulerConfig::default()
    };
    let s = Scheduler::with_seed(cfg, 7);
    let mut nodes = vec![node("n2", 2.0, 8192)];
    // 4 × 1 CPU on a 2-CPU node with ratio 2 fit, the fifth does not.
    for _ in 0..4 {
        let r = req("python-small", 1.0, 1024);
        let d = s.place(&nodes, &r, t0()).unwrap();
        assert_eq!(d.node_id, "n2");
        nodes[0].commit(&r.limits);
    }
    let e = s
        .place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap_err();
    let ScheduleError::NoFeasibleNode { candidates } = e else {
        panic!("expected NoFeasibleNode")
    };
    assert_eq!(
        rejection_of(&candidates, "n2"),
        Some(&Rejection::CpuFull {
            committed: 4.0,
            requested: 1.0,
            limit: 4.0
        })
    );
    // Memory over-commit is separate: 8 GiB committed on 8 GiB, ratio 1.
    nodes[0].release(&req("", 4.0, 0).limits);
    nodes[0].memory_committed_mb = 8192;
    let e = s
        .place(&nodes, &req("python-small", 1.0, 1), t0())
        .unwrap_err();
    let ScheduleError::NoFeasibleNode { candidates } = e else {
        panic!("expected NoFeasibleNode")
    };
    assert!(matches!(
        rejection_of(&candidates, "n2"),
        Some(Rejection::MemoryFull { .. })
    ));
}

#[test]
fn a_lone_node_past_its_overcommit_is_refused_as_capacity() {
    // the local node alone, as the control plane sees it with no agents:
    // 2 CPUs at ratio 4 take eight 1-CPU sandboxes, not a ninth
    let s = Scheduler::with_seed(
        SchedulerConfig {
            cpu_overcommit: 4.0,
            memory_overcommit: 100.0,
            ..SchedulerConfig::default()
        },
        1,
    );
    let mut local = vec![node("local", 2.0, 4096)];
    let r = req("python-small", 1.0, 256);
    for _ in 0..8 {
        let d = s.place(&local, &r, t0()).unwrap();
        assert_eq!(d.node_id, "local");
        local[0].commit(&r.limits);
    }
    let err = s.place(&local, &r, t0()).unwrap_err();
    assert!(err.is_capacity(), "{err:?}");
    let ScheduleError::NoFeasibleNode { candidates } = err else {
        panic!("expected NoFeasibleNode");
    };
    assert_eq!(
        rejection_of(&candidates, "local"),
        Some(&Rejection::CpuFull {
            committed: 8.0,
            requested: 1.0,
            limit: 8.0
        })
    );
    // a node that lacks the runtime is not "full"
    let mut other = node("other", 2.0, 4096);
    other.runtimes = vec!["runc".into()];
    let err = s.place(&[other], &r, t0()).unwrap_err();
    assert!(!err.is_capacity());
}

#[test]
fn unhealthy_and_stale_nodes_are_never_chosen() {
    let mut nodes = three();
    nodes[2].healthy = false; // n8, the emptiest
    nodes[1].last_seen = t0() - time::Duration::seconds(120); // n4 stale
    for seed in 0..50 {
        let s = Scheduler::with_seed(SchedulerConfig::default(), seed);
        let d = s
            .place(&nodes, &req("python-small", 1.0, 2048), t0())
            .unwrap();
        assert_eq!(d.node_id, "n2", "seed {seed}");
        assert_eq!(
            rejection_of(&d.candidates, "n8"),
            Some(&Rejection::Unhealthy)
        );
        assert_eq!(
            rejection_of(&d.candidates, "n4"),
            Some(&Rejection::Stale {
                seconds_since_seen: 120
            })
        );
    }
}

#[test]
fn runtime_filter() {
    let mut nodes = three();
    nodes[0].runtimes = vec!["runc".into()];
    nodes[1].runtimes = vec!["crun".into()];
    nodes[2].runtimes = vec!["crun".into()];
    let s = Scheduler::with_seed(strict(3), 3);
    let mut r = req("python-small", 1.0, 1024);
    r.runtime = "runc".into();
    let d = s.place(&nodes, &r, t0()).unwrap();
    assert_eq!(d.node_id, "n2");
    assert_eq!(
        rejection_of(&d.candidates, "n8"),
        Some(&Rejection::RuntimeMissing {
            runtime: "runc".into()
        })
    );
}

#[test]
fn template_presence_is_a_filter_or_a_bonus() {
    let mut nodes = three();
    nodes[2].templates.clear(); // the 8-CPU node lacks the template
    let s = Scheduler::with_seed(strict(3), 3);
    let d = s
        .place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap();
    assert_eq!(d.node_id, "n4");
    assert!(matches!(
        rejection_of(&d.candidates, "n8"),
        Some(Rejection::TemplateMissing { .. })
    ));

    // With shipping on, n8 is feasible; locality is only a bonus.
    let shipping = SchedulerConfig {
        ship_templates: true,
        ..strict(3)
    };
    let s = Scheduler::with_seed(shipping, 3);
    let d = s
        .place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap();
    assert!(d
        .candidates
        .iter()
        .all(|c| matches!(c.outcome, CandidateOutcome::Scored { .. })));
    // Equal load on n4 and n8 ⇒ the template decides.
    let mut equal = vec![node("a", 4.0, 8192), node("b", 4.0, 8192)];
    equal[0].templates.clear();
    let d = s
        .place(&equal, &req("python-small", 1.0, 1024), t0())
        .unwrap();
    assert_eq!(d.node_id, "b");
    assert!(d.score.template_local);
}

#[test]
fn a_warm_sandbox_wins_over_an_emptier_node() {
    let mut nodes = three();
    nodes[0].cpu_committed = 1.0; // n2 half full
    nodes[0]
        .warm
        .insert(WarmKey::new("python-small", TPL, "crun"), 1);
    // Warm for another class does not count.
    nodes[1]
        .warm
        .insert(WarmKey::new("python-ds", TPL, "crun"), 3);
    let s = Scheduler::with_seed(strict(3), 5);
    let d = s
        .place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap();
    assert_eq!(d.node_id, "n2");
    assert_eq!(d.score.warm, 1);
    let d = s.place(&nodes, &req("python-ds", 1.0, 1024), t0()).unwrap();
    assert_eq!(d.node_id, "n4");
    // A different runtime is a different pool.
    let mut r = req("python-small", 1.0, 1024);
    r.runtime = "runc".into();
    let d = s.place(&nodes, &r, t0()).unwrap();
    assert_eq!(d.node_id, "n8");
}

#[test]
fn placement_spreads_load_in_proportion_to_capacity() {
    let s = Scheduler::with_seed(strict(3), 11);
    let mut nodes = three();
    let mut placed: HashMap<String, u32> = HashMap::new();
    // 14 one-CPU sandboxes fill 2 + 4 + 8 CPUs exactly.
    for i in 0..14 {
        if i == 7 {
            // Half way, every node is half full.
            assert_eq!((placed["n2"], placed["n4"], placed["n8"]), (1, 2, 4));
        }
        let r = req("python-small", 1.0, 1024);
        let d = s.place(&nodes, &r, t0()).unwrap();
        *placed.entry(d.node_id.clone()).or_default() += 1;
        nodes
            .iter_mut()
            .find(|n| n.id == d.node_id)
            .unwrap()
            .commit(&r.limits);
    }
    assert_eq!(placed["n2"], 2);
    assert_eq!(placed["n4"], 4);
    assert_eq!(placed["n8"], 8);
    s.place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap_err();
}

#[test]
fn used_resources_count_against_a_node() {
    let mut nodes = vec![node("busy", 4.0, 8192), node("idle", 4.0, 8192)];
    nodes[0].cpu_used = 3.5;
    nodes[0].memory_used_mb = 7000;
    let s = Scheduler::with_seed(strict(2), 1);
    let d = s
        .place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap();
    assert_eq!(d.node_id, "idle");
}

#[test]
fn k_one_samples_deterministically_per_seed() {
    let nodes = three();
    let r = req("python-small", 1.0, 1024);
    let pick = |seed| {
        Scheduler::with_seed(strict(1), seed)
            .place(&nodes, &r, t0())
            .unwrap()
            .node_id
    };
    for seed in 0..20 {
        assert_eq!(pick(seed), pick(seed));
    }
    // K = 1 is random choice: over many seeds every node gets picked.
    let picked: std::collections::HashSet<String> = (0..200).map(pick).collect();
    assert_eq!(picked.len(), 3, "{picked:?}");
    let d = Scheduler::with_seed(strict(1), 0)
        .place(&nodes, &r, t0())
        .unwrap();
    let scored = d
        .candidates
        .iter()
        .filter(|c| matches!(c.outcome, CandidateOutcome::Scored { .. }))
        .count();
    let unsampled = d
        .candidates
        .iter()
        .filter(|c| matches!(c.outcome, CandidateOutcome::NotSampled))
        .count();
    assert_eq!((scored, unsampled), (1, 2));
}

#[test]
fn bad_requests_are_refused() {
    let s = Scheduler::with_seed(SchedulerConfig::default(), 0);
    for r in [
        req("c", f64::NAN, 1024),
        req("c", 0.0, 1024),
        req("c", 1.0, 0),
        req("", 1.0, 1024),
    ] {
        assert!(matches!(
            s.place(&three(), &r, t0()).unwrap_err(),
            ScheduleError::InvalidRequest { .. }
        ));
    }
    let e = s.place(&[], &req("c", 1.0, 1), t0()).unwrap_err();
    assert!(matches!(e, ScheduleError::NoFeasibleNode { .. }));
}

#[test]
fn decision_serializes_for_the_event_log() {
    let mut nodes = three();
    nodes[0].healthy = false;
    nodes[1]
        .warm
        .insert(WarmKey::new("python-small", TPL, "crun"), 2);
    let s = Scheduler::with_seed(strict(3), 0);
    let d = s
        .place(&nodes, &req("python-small", 1.0, 1024), t0())
        .unwrap();
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["node_id"], "n4");
    assert_eq!(v["candidates"][0]["outcome"], "rejected");
    assert_eq!(v["candidates"][0]["rejection"]["reason"], "unhealthy");
    assert_eq!(v["candidates"][1]["outcome"], "scored");
    assert_eq!(v["candidates"][1]["score"]["warm"], 2);
    let back: PlacementDecision = serde_json::from_value(v).unwrap();
    assert_eq!(back, d);
    // Node views round-trip too (warm map as a list).
    let nv = serde_json::to_string(&nodes[1]).unwrap();
    assert!(nv.contains(r#""warm":[{"class":"python-small""#), "{nv}");
    assert_eq!(serde_json::from_str::<NodeView>(&nv).unwrap(), nodes[1]);
}

fn arb_node(i: usize) -> impl Strategy<Value = NodeView> {
    (
        1u32..=16,
        1u64..=32,
        0u32..=64,
        0u64..=64,
        0u32..=100,
        0u32..=100,
        any::<bool>(),
        prop_oneof![Just(0i64), Just(5), Just(60)],
        any::<bool>(),
        0u32..3,
    )
        .prop_map(
            move |(cpu, mem_gib, c_half, m_gib, cu_pct, mu_pct, runc, age, tpl, warm)| {
                let mut n = node(&format!("n{i}"), cpu as f64, mem_gib * 1024);
                n.cpu_committed = c_half as f64 / 2.0;
                n.memory_committed_mb = m_gib * 1024;
                n.cpu_used = n.cpu_capacity * cu_pct as f64 / 100.0;
                n.memory_used_mb = n.memory_capacity_mb * mu_pct as u64 / 100;
                n.healthy = age != 5 || runc; // some unhealthy
                n.last_seen = t0() - time::Duration::seconds(age);
                if !runc {
                    n.runtimes = vec!["crun".into()];
                }
                if !tpl {
                    n.templates.clear();
                }
                if warm > 0 {
                    n.warm
                        .insert(WarmKey::new("python-small", TPL, "crun"), warm);
                }
                n
            },
        )
}

fn arb_nodes() -> impl Strategy<Value = Vec<NodeView>> {
    (1usize..8).prop_flat_map(|n| (0..n).map(arb_node).collect::<Vec<_>>())
}

fn arb_req() -> impl Strategy<Value = PlacementRequest> {
    (
        1u32..=16,
        1u64..=16,
        any::<bool>(),
        prop_oneof![Just("python-small"), Just("build-medium")],
    )
        .prop_map(|(half_cpus, gib, runc, class)| {
            let mut r = req(class, half_cpus as f64 / 2.0, gib * 1024);
            if runc {
                r.runtime = "runc".into();
            }
            r
        })
}

fn arb_config() -> impl Strategy<Value = SchedulerConfig> {
    (1u32..=4, 1u32..=3, 1usize..=8, any::<bool>()).prop_map(|(c, m, k, ship)| SchedulerConfig {
        cpu_overcommit: c as f64,
        memory_overcommit: 1.0 + (m - 1) as f64 * 0.25,
        sample_k: k,
        stale_after: Duration::from_secs(30),
        ship_templates: ship,
    })
}

proptest! {
    #[test]
    fn never_places_where_it_does_not_fit(
        nodes in arb_nodes(), r in arb_req(), cfg in arb_config(), seed in any::<u64>()
    ) {
        let s = Scheduler::with_seed(cfg.clone(), seed);
        match s.place(&nodes, &r, t0()) {
            Ok(d) => {
                let n = nodes.iter().find(|n| n.id == d.node_id).unwrap();
                prop_assert!(n.healthy);
                prop_assert!(t0() - n.last_seen <= cfg.stale_after);
                prop_assert!(n.runtimes.contains(&r.runtime));
                prop_assert!(cfg.ship_templates || n.templates.contains(&r.template_digest));
                prop_assert!(n.cpu_committed + r.limits.cpu <= n.cpu_capacity * cfg.cpu_overcommit + 1e-9);
                prop_assert!((n.memory_committed_mb + r.limits.memory_mb) as f64
                    <= n.memory_capacity_mb as f64 * cfg.memory_overcommit);
                prop_assert_eq!(d.candidates.len(), nodes.len());
            }
            Err(ScheduleError::NoFeasibleNode { candidates }) => {
                let all_rejected = candidates
                    .iter()
                    .all(|c| matches!(c.outcome, CandidateOutcome::Rejected { .. }));
                prop_assert!(all_rejected);
                for n in &nodes {
                    prop_assert!(s.filter(n, &r, t0()).is_some());
                }
            }
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }

    #[test]
    fn with_k_at_least_the_node_count_the_best_score_wins(
        nodes in arb_nodes(), r in arb_req(), mut cfg in arb_config(), seed in any::<u64>()
    ) {
        cfg.sample_k = nodes.len();
        let s = Scheduler::with_seed(cfg, seed);
        if let Ok(d) = s.place(&nodes, &r, t0()) {
            let best = nodes
                .iter()
                .filter(|n| s.filter(n, &r, t0()).is_none())
                .map(|n| s.score(n, &r).total)
                .fold(f64::MIN, f64::max);
            prop_assert_eq!(d.score.total, best);
            // Every feasible node was scored, none left unsampled.
            let none_unsampled = d
                .candidates
                .iter()
                .all(|c| !matches!(c.outcome, CandidateOutcome::NotSampled));
            prop_assert!(none_unsampled);
        }
    }
}
