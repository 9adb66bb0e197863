//! A schema fuzzer (schemathesis, from PyPI, installed into a throwaway
//! venv by scripts/test.sh) drives a real server from its `/openapi.json`:
//! no 5xx, no status code or content type the document does not declare,
//! no answer (JSON or server-sent events) that breaks its schema.
//!
//! The tenant's quota binds before the node's capacity and there are no
//! warm pools, so what stops the fuzzer's creates is the quota's documented
//! 403, never a 503 `capacity_exhausted`; the rate limits are raised.
//! Template import is left out: its body is a tarball, which the fuzzer
//! cannot generate.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_fuzzer_finds_nothing() {
    let st = std::env::var("AVIARY_SCHEMATHESIS").unwrap_or_else(|_| "schemathesis".into());
    if std::process::Command::new(&st)
        .arg("--version")
        .output()
        .is_err()
    {
        let why = format!("SKIPPED: {st} not runnable; scripts/test.sh installs it");
        assert!(
            std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("{why}");
        return;
    }
    let (ts, dir) = common::start_edited(|cfg| {
        // what the fuzzer starts is bounded by the tenant's quota (64
        // sandboxes, 128 CPUs: a documented 403), which binds before the
        // node's capacity (2 cores x 100); no warm pools, so no bounds it
        // sets can make the server start sandboxes of its own
        cfg.control.settings.overcommit.cpu_ratio = 100.0;
        cfg.control.settings.overcommit.memory_ratio = 100.0;
        cfg.control.settings.pools = Vec::new();
        cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
        cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    })
    .await;
    let url = format!("{}/openapi.json", ts.url());
    let auth = format!("Authorization: Bearer {}", ts.key);
    // it keeps a cache in its working directory: a scratch one, not the tree
    let scratch = tempfile::tempdir().unwrap();
    // The port proxy answers 502 `port_unreachable` when nothing listens on
    // the port (a documented gateway error, as any reverse proxy): it is
    // fuzzed on its own, with every check but "no 5xx".
    const PROXY: &str = "^/v1/sandboxes/\\{id\\}/ports/\\{port\\}/";
    let runs: [(&str, &str, &str); 2] = [
        (
            "--exclude-path-regex",
            PROXY,
            "not_a_server_error,status_code_conformance,content_type_conformance,\
             response_schema_conformance,response_headers_conformance",
        ),
        (
            "--include-path-regex",
            PROXY,
            "status_code_conformance,content_type_conformance,\
             response_schema_conformance,response_headers_conformance",
        ),
    ];
    let mut report = String::new();
    let mut failed = false;
    for (filter, regex, checks) in runs {
        let out = tokio::process::Command::new(&st)
            .current_dir(scratch.path())
            .args(["run", &url, "-H", &auth])
            .args([
                "--checks",
                checks,
                "--max-examples",
                "5",
                "--workers",
                "1",
                "--seed",
                "1",
                // a loaded 2-core machine answers slowly, not wrongly
                "--request-timeout",
                "60",
                "--exclude-path",
                "/v1/templates/{name}",
                filter,
                regex,
            ])
            .output()
            .await
            .unwrap();
        failed |= !out.status.success();
        report.push_str(&String::from_utf8_lossy(&out.stdout));
        report.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    // what it created goes before any assertion can end the test, and the
    // server before its data dir
    ts.cleanup().await;
    drop(ts);
    drop(dir);
    assert!(!failed, "schemathesis found problems:\n{report}");
    assert!(report.contains(" passed"), "{report}");
}
