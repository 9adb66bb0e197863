#!/usr/bin/env bash
# Set-up command 2: installs what the tests need and runs the whole suite
# (format, lints, unit, property, conformance and integration tests against
# real crun/runc, overlayfs, cgroups, sockets, and real PostgreSQL, Redis and
# S3-compatible servers that it starts here and stops at the end). Run as root.
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

echo "== python SDK and MCP test venv (pinned pytest, mypy, httpx, the official mcp client)"
sdk_venv=${AVIARY_SDK_VENV:-/var/tmp/aviary-sdk-venv}
if [[ ! -x $sdk_venv/bin/pytest || ! -x $sdk_venv/bin/mypy ]] || ! "$sdk_venv/bin/python" -c 'import mcp, httpx' 2>/dev/null; then
  python3 -m venv "$sdk_venv"
  "$sdk_venv/bin/pip" install -q "httpx==0.28.1" "pytest==8.3.5" "mypy==1.15.0" "anyio==4.9.0" "mcp==1.26.0"
fi
# the SDK as a user installs it (pip install ./sdk/python), fresh each run
"$sdk_venv/bin/pip" install -q --force-reinstall --no-deps ./sdk/python
export AVIARY_SDK_VENV=$sdk_venv

echo "== fmt"
cargo fmt --all -- --check
echo "== static envd"
AVIARY_ENVD=$(scripts/build-envd.sh)
export AVIARY_ENVD
echo "== clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== tests"
cargo test --workspace --locked --no-fail-fast -- --test-threads="${AVIARY_TEST_THREADS:-4}"
echo "== control plane: no backend crate in its tree, unit tests as a non-root user"
scripts/check-control.sh
