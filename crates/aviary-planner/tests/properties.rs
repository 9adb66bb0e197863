//! Property tests: no input makes a planner panic, and every intent names a
//! class of the catalog it was planned against.

#[cfg(test)]
mod properties {
    use aviary_planner::{
        workload_signature, ChainPlanner, ClassSpec, Features, HeuristicPlanner, Risk, TaskContext,
        TelemetryPlanner,
    };
    use aviary_registry::{AllocationRecord, AllocationUsage};
    use proptest::prelude::*;

    const WORDS: &[&str] = &[
        "pandas",
        "20 GB",
        "10 million rows",
        "playwright",
        "mvn",
        "gradle",
        "npm install",
        "webpack",
        "cuda",
        "fine-tune",
        "torch",
        "train",
        "hello world",
        "excel",
        "统计",
        "画图表",
        "1000万行",
        "no gpu",
        "monorepo",
        "ffmpeg",
        "3.5GiB",
        "1,000,000",
        "12 GB RAM",
        "chromium",
        "spark",
        "compile",
        "cargo build",
        "9999999999999999999999 tb",
        "0.0.0.1 gb",
        "∞",
        "NaN",
        "-5 GB",
        "\u{202e}",
        "亿",
        "k rows",
    ];

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            prop::collection::vec(prop::sample::select(WORDS), 0..12).prop_map(|w| w.join(" ")),
            "[0-9 .,kmgbtKMGBT万亿行]{0,40}",
        ]
    }

    fn number() -> impl Strategy<Value = Option<f64>> {
        prop_oneof![
            Just(None),
            (0.0f64..1e7).prop_map(Some),
            any::<f64>().prop_map(Some),
        ]
    }

    prop_compose! {
        fn context()(
            task in text(),
            plan in prop::collection::vec(text(), 0..4),
            tools in prop::collection::vec(text(), 0..3),
            languages in prop::collection::vec(text(), 0..3),
            dependencies in prop::collection::vec(text(), 0..4),
            repo in number(), data in number(), ws in number(), dur in number(),
            flags in prop::array::uniform3(prop::option::of(any::<bool>())),
            network in prop::option::of("[a-z-]{1,12}"),
            risk in prop::option::of(prop::sample::select(vec![Risk::Low, Risk::Medium, Risk::High])),
        ) -> TaskContext {
            TaskContext {
                task, plan, tools, languages, dependencies,
                repo_size_mb: repo, data_size_mb: data, workspace_mb: ws, expected_duration_s: dur,
                needs_browser: flags[0], needs_gpu: flags[1], needs_compile: flags[2],
                network, risk, task_id: None,
            }
        }
    }

    fn catalog() -> impl Strategy<Value = Vec<ClassSpec>> {
        prop_oneof![
            Just(ClassSpec::seed_defaults()),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "small",
                        "browser-x",
                        "build-y",
                        "gpu-z",
                        "big",
                        "data"
                    ]),
                    0.1f64..64.0,
                    1u64..100_000,
                    1u64..100_000,
                    any::<bool>(),
                ),
                1..6
            )
            .prop_map(|v| {
                v.into_iter()
                    .enumerate()
                    .map(|(i, (n, cpu, mem, disk, gpu))| ClassSpec {
                        name: format!("{n}-{i}"),
                        cpu,
                        memory_mb: mem,
                        disk_mb: disk,
                        pids: 128,
                        gpu,
                        runtimes: vec![],
                        network_profiles: vec![],
                    })
                    .collect()
            }),
        ]
    }

    fn history(sig: String, classes: Vec<String>) -> impl Strategy<Value = Vec<AllocationRecord>> {
        prop::collection::vec(
            (
                0usize..8,
                any::<u64>(),
                any::<f64>(),
                any::<f64>(),
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                0i64..10_000,
            ),
            0..30,
        )
        .prop_map(move |rows| {
            rows.into_iter()
                .map(
                    |(ci, mem, cpu, dur, oom, to, same_sig, age)| AllocationRecord {
                        id: None,
                        task_id: "t".into(),
                        tenant: "default".into(),
                        sandbox_id: None,
                        planner_input_hash: "h".into(),
                        workload_signature: if same_sig {
                            sig.clone()
                        } else {
                            "ws-other".into()
                        },
                        recommended_class: "x".into(),
                        actual_class: classes.get(ci).cloned().unwrap_or_else(|| "gone".into()),
                        reason: String::new(),
                        confidence: 0.5,
                        source: "heuristic".into(),
                        cpu: 1.0,
                        memory_mb: 1,
                        created_at: time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(age),
                        usage: Some(AllocationUsage {
                            duration_s: dur,
                            peak_cpu: cpu,
                            peak_memory_mb: mem,
                            oom,
                            timed_out: to,
                        }),
                    },
                )
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn heuristic_never_panics_and_stays_in_catalog(ctx in context(), catalog in catalog()) {
            let _ = workload_signature(&ctx);
            match HeuristicPlanner::default().plan_sync(&ctx, &catalog) {
                Ok(i) => {
                    prop_assert!(ctx.validate().is_ok());
                    let class = catalog.iter().find(|c| c.name == i.resource_class);
                    prop_assert!(class.is_some(), "{} not in catalog", i.resource_class);
                    let class = class.unwrap();
                    prop_assert_eq!(i.cpu, class.cpu);
                    prop_assert_eq!(i.memory_mb, class.memory_mb);
                    prop_assert!((0.0..=1.0).contains(&i.confidence));
                    prop_assert!(i.ttl_s >= 60 && i.ttl_s <= 86_400);
                }
                Err(e) => prop_assert!(e.is_bad_input(), "{e}"),
            }
        }

        #[test]
        fn telemetry_never_leaves_the_catalog(
            (ctx, catalog, hist) in (context(), catalog()).prop_flat_map(|(ctx, catalog)| {
                let sig = workload_signature(&ctx);
                let names = catalog.iter().map(|c| c.name.clone()).collect();
                (Just(ctx), Just(catalog), history(sig, names))
            })
        ) {
            let Ok(base) = HeuristicPlanner::default().plan_sync(&ctx, &catalog) else {
                return Ok(());
            };
            let f = Features::extract(&ctx);
            let adj = TelemetryPlanner::default().adjust(base, &f, &catalog, &hist);
            prop_assert!(catalog.iter().any(|c| c.name == adj.intent.resource_class));
            prop_assert!((0.0..=1.0).contains(&adj.intent.confidence));
        }

        #[test]
        fn arbitrary_json_never_panics(s in any::<String>()) {
            let _ = TaskContext::from_json(&s);
        }
    }

    #[test]
    fn chain_on_random_contexts_without_llm() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let chain = ChainPlanner::default();
        let catalog = ClassSpec::seed_defaults();
        let mut runner = proptest::test_runner::TestRunner::default();
        runner
            .run(&context(), |ctx| {
                if let Ok(out) = rt.block_on(chain.plan_traced(&ctx, &catalog, &[])) {
                    prop_assert!(catalog.iter().any(|c| c.name == out.intent.resource_class));
                }
                Ok(())
            })
            .unwrap();
    }
}
