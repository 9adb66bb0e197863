#!/usr/bin/env bash
# Set-up command 2: installs what the tests need and runs the whole suite
# (format, lints, unit, property, conformance and integration tests against
# real crun/runc, overlayfs, cgroups, sockets, and real PostgreSQL, Redis and
# S3-compatible servers that it starts here and stops at the end). Run as root.
# With arguments, it runs only those cargo test targets in the same set-up
# (no fmt, clippy or control-plane check): scripts/test.sh -p aviary-cli --test cli
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh test

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
export AVIARY_TEST_TEMPLATE_CACHE=${AVIARY_TEST_TEMPLATE_CACHE:-/var/tmp/aviary-test-templates}
mkdir -p "$AVIARY_TEST_TEMPLATE_CACHE"

echo "== services (PostgreSQL, Redis, S3-compatible s3s-fs on loopback)"
services_env=$(mktemp)
trap 'scripts/services.sh stop >/dev/null 2>&1 || true; rm -f "$services_env"' EXIT
scripts/services.sh start >"$services_env"
# shellcheck disable=SC1090
. "$services_env"
# the services are up: a test that finds them missing fails instead of skipping
export AVIARY_REQUIRE_SERVICES=1

echo "== python tools (a throwaway venv: openapi-spec-validator, schemathesis)"
venv=${AVIARY_TEST_VENV:-/var/tmp/aviary-test-venv}
if [[ ! -x $venv/bin/openapi-spec-validator || ! -x $venv/bin/schemathesis ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "openapi-spec-validator==0.9.0" "schemathesis==4.32.5"
fi
export AVIARY_OPENAPI_VALIDATOR=$venv/bin/openapi-spec-validator
export AVIARY_SCHEMATHESIS=$venv/bin/schemathesis

echo "== OpenSandbox SDK and AgentScope (their own throwaway venv, pinned)"
osb_venv=${AVIARY_OSB_VENV:-/var/tmp/aviary-osb-venv}
if ! "$osb_venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("opensandbox") != "1.1.1" or m.version("agentscope") != "2.0.11")' 2>/dev/null; then
  python3 -m venv "$osb_venv"
  "$osb_venv/bin/pip" install -q "opensandbox==1.1.1" "agentscope==2.0.11"
fi
export AVIARY_OSB_VENV=$osb_venv

echo "== E2B SDKs (throwaway venv + npm dir: e2b, agentscope, e2b for node)"
e2b_venv=${AVIARY_E2B_VENV:-/var/tmp/aviary-e2b-venv}
if ! "$e2b_venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(not (m.version("e2b") == "2.63.0" and m.version("agentscope") == "2.0.11"))' 2>/dev/null; then
  python3 -m venv "$e2b_venv"
  "$e2b_venv/bin/pip" install -q "e2b==2.63.0" "agentscope==2.0.11"
fi
export AVIARY_E2B_PYTHON=$e2b_venv/bin/python
e2b_npm=${AVIARY_E2B_NPM:-/var/tmp/aviary-e2b-npm}
if [[ $(node -p 'require(process.argv[1]).version' "$e2b_npm/node_modules/e2b/package.json" 2>/dev/null) != 2.51.0 ]]; then
  mkdir -p "$e2b_npm"
  (cd "$e2b_npm" && { [[ -f package.json ]] || npm init -y >/dev/null; } && npm install -q --no-audit --no-fund "e2b@2.51.0")
fi
export AVIARY_E2B_NODE=node
export AVIARY_E2B_JS_MODULE=$e2b_npm/node_modules/e2b/dist/index.mjs

echo "== web console (npm ci + esbuild into console/dist, embedded by the build below; chromium + pinned puppeteer-core)"
scripts/build-console.sh >/dev/null
console_npm=${AVIARY_CONSOLE_NPM:-/var/tmp/aviary-console-npm}
if [[ $(node -p 'require(process.argv[1]).version' "$console_npm/node_modules/puppeteer-core/package.json" 2>/dev/null) != 25.19.0 ]]; then
  mkdir -p "$console_npm"
  (cd "$console_npm" && { [[ -f package.json ]] || npm init -y >/dev/null; } && npm install -q --no-audit --no-fund "puppeteer-core@25.19.0")
fi
AVIARY_CHROMIUM=$(command -v chromium)
export AVIARY_CHROMIUM
export AVIARY_PUPPETEER_MODULE=$console_npm/node_modules/puppeteer-core/lib/puppeteer/puppeteer-core.js

echo "== python SDK and MCP test venv (pinned pytest, mypy, httpx, the official mcp client)"
sdk_venv=${AVIARY_SDK_VENV:-/var/tmp/aviary-sdk-venv}
if [[ ! -x $sdk_venv/bin/pytest || ! -x $sdk_venv/bin/mypy ]] || ! "$sdk_venv/bin/python" -c 'import mcp, httpx' 2>/dev/null; then
  python3 -m venv "$sdk_venv"
  "$sdk_venv/bin/pip" install -q "httpx==0.28.1" "pytest==8.3.5" "mypy==1.15.0" "anyio==4.9.0" "mcp==1.26.0"
fi
# the SDK as a user installs it (pip install ./sdk/python), fresh each run
"$sdk_venv/bin/pip" install -q --force-reinstall --no-deps ./sdk/python
export AVIARY_SDK_VENV=$sdk_venv

echo "== static envd"
AVIARY_ENVD=$(scripts/build-envd.sh)
export AVIARY_ENVD
if [[ $# -gt 0 ]]; then
    # a part of the suite, in the same set-up: scripts/test.sh -p aviary-server --test docker
    echo "== tests: $*"
    cargo test --locked --no-fail-fast "$@" -- --test-threads="${AVIARY_TEST_THREADS:-4}"
    exit
fi
echo "== fmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== tests"
cargo test --workspace --locked --no-fail-fast -- --test-threads="${AVIARY_TEST_THREADS:-4}"
echo "== control plane: no backend crate in its tree, unit tests as a non-root user"
scripts/check-control.sh
