//! The heuristic planner against the labelled corpus (`corpus/tasks.jsonl`,
//! issue 16): at least 95% right overall, no injection case planned above
//! what its work needs, and a reason that explains every decision.

#[cfg(test)]
mod labelled_corpus {
    use aviary_planner::corpus::{load_corpus, report_markdown, score, Contender};
    use aviary_planner::ClassSpec;

    #[test]
    fn planner_scores_at_least_95_percent_and_injection_never_buys_resources() {
        let cases = load_corpus().unwrap();
        let catalog = ClassSpec::seed_defaults();
        println!("{}", report_markdown(&cases, &catalog));
        let results = score(Contender::Heuristic, &cases, &catalog);
        for r in &results {
            // the reason names the chosen class and what it needed
            assert!(
                r.reason.contains(&format!("→ {}", r.class)) && r.reason.contains("needs ≥"),
                "{}: {}",
                r.id,
                r.reason
            );
        }
        let over: Vec<_> = results
            .iter()
            .filter(|r| r.category == "injection" && r.over)
            .map(|r| format!("{}: {} > {}: {}", r.id, r.class, r.expected_class, r.reason))
            .collect();
        assert!(
            over.is_empty(),
            "injection bought resources:\n{}",
            over.join("\n")
        );
        let right = results.iter().filter(|r| r.correct).count();
        let share = right as f64 / results.len() as f64;
        assert!(
            share >= 0.95,
            "{right}/{} = {:.1}% right",
            results.len(),
            share * 100.0
        );
    }
}
