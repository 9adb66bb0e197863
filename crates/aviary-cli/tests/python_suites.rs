//! Runs the Python suites against this build's `aviary`: the SDK's pytest
//! suite (`sdk/python/tests`: both clients against a live `aviary serve`)
//! and the MCP server's (`crates/aviary-mcp/tests/python`, driven by the
//! official MCP Python client over stdio and streamable HTTP).
//!
//! They need the Python venv `scripts/test.sh` prepares (pinned pytest,
//! mypy, httpx, mcp, and the SDK installed), named by `AVIARY_SDK_VENV`;
//! without it each test skips, saying so.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_aviary");

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

fn envd() -> PathBuf {
    if let Some(p) = std::env::var_os("AVIARY_ENVD") {
        return PathBuf::from(p);
    }
    let out = Command::new(workspace_root().join("scripts/build-envd.sh"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Runs pytest from `venv` on `tests` (relative to `dir`); `None` (after
/// saying why) when there is no venv.
fn pytest(dir: &Path, tests: &str) -> Option<()> {
    let Some(venv) = std::env::var_os("AVIARY_SDK_VENV") else {
        eprintln!(
            "SKIPPED: AVIARY_SDK_VENV is not set (scripts/test.sh makes the Python venv with \
             pytest, mypy, httpx, mcp and the SDK); the Python suite in {} did not run",
            dir.join(tests).display()
        );
        return None;
    };
    let pytest = PathBuf::from(venv).join("bin/pytest");
    assert!(pytest.exists(), "{} is missing", pytest.display());
    let status = Command::new(&pytest)
        .args(["-q", "-p", "no:cacheprovider", tests])
        .current_dir(dir)
        .env("AVIARY_BIN", BIN)
        .env("AVIARY_ENVD", envd())
        .env_remove("AVIARY_URL")
        .env_remove("AVIARY_API_KEY")
        .env_remove("AVIARY_DATA_DIR")
        .status()
        .unwrap();
    assert!(
        status.success(),
        "pytest {tests} in {} failed",
        dir.display()
    );
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_sdk_suite() {
        pytest(&workspace_root().join("sdk/python"), "tests");
    }

    #[test]
    fn mcp_server_suite() {
        pytest(
            &workspace_root().join("crates/aviary-mcp/tests/python"),
            ".",
        );
    }
}
