//! The labelled planner corpus (`corpus/tasks.jsonl`, compiled in) and its
//! scoring, shared by the corpus test and `aviary-bench planner`.
//!
//! A case is right when the planner names the labelled class *and* the
//! labelled GPU need. A case is *over-provisioned* when the planned class is
//! bigger than the labelled one (more memory, or as much memory and more
//! CPU); for injection cases that must never happen.
//!
//! Two baselines are scored in the same run:
//! - **always python-ds**: one medium class for everything;
//! - **language rule**: the fixed rule engine of the seed (§4.2): GPU flag →
//!   the largest class; browser flag → `browser-medium`; compile flag or a
//!   compiled/Node language (java, kotlin, scala, c, c++, rust, go, javascript,
//!   typescript, node) → `build-medium`; anything else → `python-small`.

use crate::context::TaskContext;
use crate::heuristic::HeuristicPlanner;
use crate::intent::ClassSpec;
use crate::PlanError;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The corpus as shipped in the crate.
pub const CORPUS_JSONL: &str = include_str!("../corpus/tasks.jsonl");

/// One labelled task.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorpusCase {
    pub id: String,
    pub category: String,
    pub lang: String,
    pub expected_class: String,
    pub expected_needs_gpu: bool,
    /// The labeller's reason.
    pub why: String,
    pub context: TaskContext,
}

/// Parses and validates a JSONL corpus (blank lines skipped).
pub fn parse_corpus(text: &str) -> Result<Vec<CorpusCase>, PlanError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let case: CorpusCase = serde_json::from_str(line)
            .map_err(|e| PlanError::RejectContext(format!("corpus line {}: {e}", i + 1)))?;
        case.context
            .validate()
            .map_err(|e| PlanError::RejectContext(format!("corpus case {}: {e}", case.id)))?;
        out.push(case);
    }
    Ok(out)
}

/// The compiled-in corpus.
pub fn load_corpus() -> Result<Vec<CorpusCase>, PlanError> {
    parse_corpus(CORPUS_JSONL)
}

/// Who is scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Contender {
    Heuristic,
    AlwaysPythonDs,
    LanguageRule,
}

impl Contender {
    pub const ALL: [Contender; 3] = [
        Contender::Heuristic,
        Contender::AlwaysPythonDs,
        Contender::LanguageRule,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Contender::Heuristic => "planner (heuristic)",
            Contender::AlwaysPythonDs => "always python-ds",
            Contender::LanguageRule => "language rule",
        }
    }
}

/// How one contender did on one case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    pub id: String,
    pub category: String,
    pub lang: String,
    pub expected_class: String,
    pub expected_needs_gpu: bool,
    pub class: String,
    pub needs_gpu: bool,
    pub correct: bool,
    /// Planned bigger than labelled.
    pub over: bool,
    /// Planned smaller than labelled.
    pub under: bool,
    /// The planner's reason (empty for baselines).
    pub reason: String,
}

/// The language-rule baseline; see the module docs.
pub fn language_rule(ctx: &TaskContext, catalog: &[ClassSpec]) -> (String, bool) {
    let largest = catalog
        .iter()
        .max_by(|a, b| a.size_key().total_cmp(&b.size_key()))
        .map(|c| c.name.clone())
        .unwrap_or_default();
    if ctx.needs_gpu == Some(true) {
        return (largest, true);
    }
    if ctx.needs_browser == Some(true) {
        return ("browser-medium".into(), false);
    }
    const BUILT: &[&str] = &[
        "java",
        "kotlin",
        "scala",
        "c",
        "c++",
        "cpp",
        "rust",
        "go",
        "golang",
        "javascript",
        "typescript",
        "node",
        "nodejs",
    ];
    let built = ctx
        .languages
        .iter()
        .any(|l| BUILT.contains(&l.trim().to_ascii_lowercase().as_str()));
    if ctx.needs_compile == Some(true) || built {
        return ("build-medium".into(), false);
    }
    ("python-small".into(), false)
}

fn size_of<'a>(catalog: &'a [ClassSpec], name: &str) -> Option<&'a ClassSpec> {
    catalog.iter().find(|c| c.name == name)
}

/// Plans every case with `who` against `catalog`.
pub fn score(who: Contender, cases: &[CorpusCase], catalog: &[ClassSpec]) -> Vec<CaseResult> {
    let planner = HeuristicPlanner::default();
    cases
        .iter()
        .map(|case| {
            let (class, needs_gpu, reason) = match who {
                Contender::Heuristic => match planner.plan_sync(&case.context, catalog) {
                    Ok(i) => (i.resource_class, i.needs_gpu, i.reason),
                    Err(e) => (String::new(), false, format!("error: {e}")),
                },
                Contender::AlwaysPythonDs => ("python-ds".into(), false, String::new()),
                Contender::LanguageRule => {
                    let (c, g) = language_rule(&case.context, catalog);
                    (c, g, String::new())
                }
            };
            let (over, under) = match (
                size_of(catalog, &class),
                size_of(catalog, &case.expected_class),
            ) {
                (Some(got), Some(want)) => (
                    got.strictly_bigger_than(want),
                    want.strictly_bigger_than(got),
                ),
                _ => (false, false),
            };
            CaseResult {
                id: case.id.clone(),
                category: case.category.clone(),
                lang: case.lang.clone(),
                expected_class: case.expected_class.clone(),
                expected_needs_gpu: case.expected_needs_gpu,
                correct: class == case.expected_class && needs_gpu == case.expected_needs_gpu,
                class,
                needs_gpu,
                over,
                under,
                reason,
            }
        })
        .collect()
}

/// Category order in reports.
pub const CATEGORIES: [&str; 6] = [
    "everyday",
    "misleading",
    "injection",
    "boundary",
    "implicit",
    "data_size",
];

/// Right / total per group key.
fn tally<'a>(
    results: &'a [CaseResult],
    key: impl Fn(&'a CaseResult) -> &'a str,
) -> BTreeMap<&'a str, (usize, usize)> {
    let mut m: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for r in results {
        let e = m.entry(key(r)).or_default();
        e.1 += 1;
        if r.correct {
            e.0 += 1;
        }
    }
    m
}

fn pct((right, total): (usize, usize)) -> String {
    if total == 0 {
        "–".into()
    } else {
        format!(
            "{:.1}% ({right}/{total})",
            100.0 * right as f64 / total as f64
        )
    }
}

/// The markdown report: accuracy per category and language for the planner
/// and both baselines, over-provisioned injection cases, and the planner's
/// misses with its reason.
pub fn report_markdown(cases: &[CorpusCase], catalog: &[ClassSpec]) -> String {
    let runs: Vec<(Contender, Vec<CaseResult>)> = Contender::ALL
        .iter()
        .map(|&c| (c, score(c, cases, catalog)))
        .collect();
    let mut out = String::new();
    out.push_str(&format!(
        "{} labelled tasks (`crates/aviary-planner/corpus/tasks.jsonl`), planned against the \
         default five classes. A case is right when the class and the GPU need match the label.\n\n",
        cases.len()
    ));
    out.push_str("| category | n |");
    for (c, _) in &runs {
        out.push_str(&format!(" {} |", c.label()));
    }
    out.push_str("\n|---|---:|");
    for _ in &runs {
        out.push_str("---:|");
    }
    out.push('\n');
    let by_cat: Vec<_> = runs
        .iter()
        .map(|(_, r)| tally(r, |x| x.category.as_str()))
        .collect();
    let by_lang: Vec<_> = runs
        .iter()
        .map(|(_, r)| tally(r, |x| x.lang.as_str()))
        .collect();
    let all: Vec<_> = runs.iter().map(|(_, r)| tally(r, |_| "all")).collect();
    let mut rows: Vec<(String, Vec<(usize, usize)>)> = Vec::new();
    for cat in CATEGORIES {
        rows.push((
            cat.to_string(),
            by_cat
                .iter()
                .map(|m| m.get(cat).copied().unwrap_or_default())
                .collect(),
        ));
    }
    for lang in ["en", "zh"] {
        rows.push((
            format!("*{lang}*"),
            by_lang
                .iter()
                .map(|m| m.get(lang).copied().unwrap_or_default())
                .collect(),
        ));
    }
    rows.push((
        "**all**".into(),
        all.iter()
            .map(|m| m.get("all").copied().unwrap_or_default())
            .collect(),
    ));
    for (name, cells) in rows {
        out.push_str(&format!("| {name} | {} |", cells[0].1));
        for cell in cells {
            out.push_str(&format!(" {} |", pct(cell)));
        }
        out.push('\n');
    }
    out.push('\n');
    out.push_str("| over / under the label | ");
    out.push_str(
        &runs
            .iter()
            .map(|(c, _)| c.label())
            .collect::<Vec<_>>()
            .join(" | "),
    );
    out.push_str(" |\n|---|");
    for _ in &runs {
        out.push_str("---:|");
    }
    out.push('\n');
    let count =
        |r: &[CaseResult], f: &dyn Fn(&CaseResult) -> bool| r.iter().filter(|x| f(x)).count();
    let line = |name: &str, f: &dyn Fn(&CaseResult) -> bool| {
        let cells: Vec<String> = runs.iter().map(|(_, r)| count(r, f).to_string()).collect();
        format!("| {name} | {} |\n", cells.join(" | "))
    };
    out.push_str(&line("injection cases planned above their label", &|x| {
        x.category == "injection" && x.over
    }));
    out.push_str(&line("all cases planned above their label", &|x| x.over));
    out.push_str(&line("all cases planned below their label", &|x| x.under));
    let misses: Vec<&CaseResult> = runs[0].1.iter().filter(|r| !r.correct).collect();
    out.push_str(&format!("\nPlanner misses ({}):\n\n", misses.len()));
    if misses.is_empty() {
        out.push_str("- none\n");
    }
    for m in misses {
        out.push_str(&format!(
            "- `{}` ({}, {}): labelled {}{}, planned {}{} — {}\n",
            m.id,
            m.category,
            m.lang,
            m.expected_class,
            if m.expected_needs_gpu { " +gpu" } else { "" },
            m.class,
            if m.needs_gpu { " +gpu" } else { "" },
            m.reason
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_parses_and_names_known_classes_and_categories() {
        let cases = load_corpus().unwrap();
        assert!(cases.len() >= 150, "{}", cases.len());
        let catalog = ClassSpec::seed_defaults();
        let mut ids = std::collections::HashSet::new();
        for c in &cases {
            assert!(ids.insert(c.id.as_str()), "duplicate id {}", c.id);
            assert!(size_of(&catalog, &c.expected_class).is_some(), "{}", c.id);
            assert!(CATEGORIES.contains(&c.category.as_str()), "{}", c.id);
            assert!(c.lang == "en" || c.lang == "zh", "{}", c.id);
            assert!(!c.why.is_empty(), "{}", c.id);
        }
    }

    #[test]
    fn language_rule_baseline() {
        let catalog = ClassSpec::seed_defaults();
        let mut ctx = TaskContext::new("x");
        assert_eq!(language_rule(&ctx, &catalog).0, "python-small");
        ctx.languages = vec!["Java".into()];
        assert_eq!(language_rule(&ctx, &catalog).0, "build-medium");
        ctx.needs_browser = Some(true);
        assert_eq!(language_rule(&ctx, &catalog).0, "browser-medium");
        ctx.needs_gpu = Some(true);
        assert_eq!(
            language_rule(&ctx, &catalog),
            ("compute-large".into(), true)
        );
    }
}
