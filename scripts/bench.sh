#!/usr/bin/env bash
# Benchmarks: builds release binaries, starts what it compares against
# (dockerd, hand-started as in RUNTIME-NOTES), measures side by side in one
# run, and writes the results into BENCHMARKS.md (between the markers).
#   scripts/bench.sh [ITERATIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh bench
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release --locked -p aviary-bench
cargo build --release --locked -p aviary-snapshots --example snapshot_bench
AVIARY_ENVD=$(scripts/build-envd.sh)
export AVIARY_ENVD
out=$(mktemp)
"$CARGO_TARGET_DIR/release/aviary-bench" "${1:-30}" | tee "$out"

machine="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r), $(. /etc/os-release; echo "$PRETTY_NAME"), crun $(crun --version | head -1 | awk '{print $3}')"
section=$(mktemp)
{
  echo "<!-- core:start -->"
  echo "Measured $(date -u +%Y-%m-%d) on: $machine."
  echo
  cat "$out"
  echo "<!-- core:end -->"
} >"$section"
python3 - "$section" <<'PY'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
text = open("BENCHMARKS.md").read()
new = re.sub(r"<!-- core:start -->.*?<!-- core:end -->", lambda m: section, text, flags=re.S)
open("BENCHMARKS.md", "w").write(new)
PY
rm -f "$out" "$section"

# snapshots: 1 GiB workspace, incremental after a 1% change, vs tar | zstd
snap_out=$(mktemp)
"$CARGO_TARGET_DIR/release/examples/snapshot_bench" --size-mib "${AVIARY_BENCH_SNAPSHOT_MIB:-1024}" | tee "$snap_out"
section=$(mktemp)
{
  echo "<!-- snapshots:start -->"
  echo "Measured $(date -u +%Y-%m-%d) on: $machine."
  echo
  cat "$snap_out"
  echo "<!-- snapshots:end -->"
} >"$section"
python3 - "$section" <<'PY'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
text = open("BENCHMARKS.md").read()
new = re.sub(r"<!-- snapshots:start -->.*?<!-- snapshots:end -->", lambda m: section, text, flags=re.S)
open("BENCHMARKS.md", "w").write(new)
PY
rm -f "$snap_out" "$section"
# disk quotas: create/destroy with and without the per-sandbox disk, interleaved
quota_out=$(mktemp)
cargo test --release --locked -p aviary-runtime-oci --test quota -- \
    --ignored --nocapture measure_create_cost 2>/dev/null |
    grep -E '^(probe|create|destroy)' | tee "$quota_out"
section=$(mktemp)
{
  echo "<!-- quota:start -->"
  echo "Measured $(date -u +%Y-%m-%d) on: $machine. p50 / p90 ms, $(grep -c . "$quota_out") rows:"
  echo
  echo '```'
  cat "$quota_out"
  echo '```'
  echo "<!-- quota:end -->"
} >"$section"
python3 - "$section" <<'PY'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
text = open("BENCHMARKS.md").read()
new = re.sub(r"<!-- quota:start -->.*?<!-- quota:end -->", lambda m: section, text, flags=re.S)
open("BENCHMARKS.md", "w").write(new)
PY
rm -f "$quota_out" "$section"
# planner: accuracy on the labelled corpus, beside both baselines (no root, seconds)
planner_out=$(mktemp)
"$CARGO_TARGET_DIR/release/aviary-bench" planner | tee "$planner_out"
section=$(mktemp)
{
  echo "<!-- planner:start -->"
  echo "Measured $(date -u +%Y-%m-%d) by \`aviary-bench planner\` (accuracy does not depend on the machine; the timing does: $machine)."
  echo
  cat "$planner_out"
  echo "<!-- planner:end -->"
} >"$section"
python3 - "$section" <<'PY'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
text = open("BENCHMARKS.md").read()
new = re.sub(r"<!-- planner:start -->.*?<!-- planner:end -->", lambda m: section, text, flags=re.S)
open("BENCHMARKS.md", "w").write(new)
PY
rm -f "$planner_out" "$section"
echo "BENCHMARKS.md updated" >&2
