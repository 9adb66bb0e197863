//! `aviary-bench planner`: scores the heuristic planner and the two baselines
//! ("always python-ds", "language rule") on the labelled corpus in one run and
//! prints the markdown section scripts/bench.sh puts into BENCHMARKS.md. Needs
//! no root, no envd and no server; takes well under a second.

use aviary_planner::corpus::{load_corpus, report_markdown};
use aviary_planner::{ClassSpec, HeuristicPlanner};
use std::time::Instant;

pub fn run() -> anyhow::Result<()> {
    let cases = load_corpus()?;
    let catalog = ClassSpec::seed_defaults();
    println!("### Planner accuracy on the labelled corpus (issue 16)\n");
    println!("{}", report_markdown(&cases, &catalog));
    // planning cost per task, for scale (heuristic only; no LLM configured)
    let planner = HeuristicPlanner::default();
    let rounds = 20;
    let started = Instant::now();
    for _ in 0..rounds {
        for c in &cases {
            planner.plan_sync(&c.context, &catalog)?;
        }
    }
    let per = started.elapsed().as_secs_f64() * 1e6 / (rounds * cases.len()) as f64;
    println!(
        "Heuristic planning time: {per:.0} µs per task (mean over {rounds} × {} tasks).",
        cases.len()
    );
    Ok(())
}
