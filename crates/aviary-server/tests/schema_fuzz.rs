//! A schema fuzzer (schemathesis, from PyPI, installed into a throwaway
//! venv by scripts/test.sh) drives a real server from its `/openapi.json`:
//! no 5xx, no status code or content type the document does not declare,
//! no answer (JSON or server-sent events) that breaks its schema.
//!
//! The server gets room for everything the fuzzer creates (over-commit and
//! rate limits raised), so a 503 `capacity_exhausted` does not count as a
//! server error. Template import is left out: its body is a tarball, which
//! the fuzzer cannot generate.

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
    let (ts, _dir) = common::start_edited(|cfg| {
        cfg.control.settings.overcommit.cpu_ratio = 100.0;
        cfg.control.settings.overcommit.memory_ratio = 100.0;
        cfg.control.settings.server.edge.rate_limit_per_s = 1e6;
        cfg.control.settings.server.edge.rate_limit_burst = 1_000_000;
    })
    .await;
    let url = format!("{}/openapi.json", ts.url());
    let auth = format!("Authorization: Bearer {}", ts.key);
    let out = tokio::process::Command::new(&st)
        .args(["run", &url, "-H", &auth])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,\
             response_schema_conformance,response_headers_conformance",
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
        ])
        .output()
        .await
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "schemathesis found problems:\n{report}"
    );
    assert!(report.contains(" passed"), "{report}");
    ts.cleanup().await;
}
