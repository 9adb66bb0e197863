//! The heuristic planner against a corpus of task contexts
//! (`tests/corpus/*.json`, each `{expected_class, expected_needs_gpu,
//! context}`), planned against the seed's five classes. Every case must come
//! out right.

#[cfg(test)]
mod corpus {
    use aviary_planner::{ClassSpec, HeuristicPlanner, PlanSource, TaskContext};
    use serde::Deserialize;
    use std::path::PathBuf;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Case {
        expected_class: String,
        expected_needs_gpu: bool,
        context: serde_json::Value,
    }

    #[test]
    fn heuristic_gets_every_corpus_case_right() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        files.sort();
        assert!(files.len() >= 25, "corpus has only {} cases", files.len());

        let catalog = ClassSpec::seed_defaults();
        let planner = HeuristicPlanner::default();
        let mut failures = Vec::new();
        for path in &files {
            let name = path.file_stem().unwrap().to_string_lossy().to_string();
            let case: Case = serde_json::from_str(&std::fs::read_to_string(path).unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            // through the public JSON entry point, as the API will
            let ctx = TaskContext::from_json(&case.context.to_string()).unwrap();
            let intent = planner.plan_sync(&ctx, &catalog).unwrap();
            println!(
                "{name:32} {:15} conf {:.2} gpu {:5} net {:13} | {}",
                intent.resource_class,
                intent.confidence,
                intent.needs_gpu,
                intent.network_profile,
                intent.reason
            );
            assert_eq!(intent.source, PlanSource::Heuristic);
            assert!((0.0..=1.0).contains(&intent.confidence));
            assert!(!intent.reason.is_empty());
            if intent.resource_class != case.expected_class
                || intent.needs_gpu != case.expected_needs_gpu
            {
                failures.push(format!(
                    "{name}: expected {} (gpu {}), got {} (gpu {}): {}",
                    case.expected_class,
                    case.expected_needs_gpu,
                    intent.resource_class,
                    intent.needs_gpu,
                    intent.reason
                ));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} wrong:\n{}",
            failures.len(),
            files.len(),
            failures.join("\n")
        );
    }
}
