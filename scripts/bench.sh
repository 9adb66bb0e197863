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
machine="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), kernel $(uname -r), $(. /etc/os-release; echo "$PRETTY_NAME"), crun $(crun --version | head -1 | awk '{print $3}')"

# write_section NAME HEADER FILE: replaces what stands between
# <!-- NAME:start --> and <!-- NAME:end --> in BENCHMARKS.md with HEADER, a
# blank line and FILE's contents.
write_section() {
  local name=$1 header=$2 body=$3 section
  section=$(mktemp)
  { echo "<!-- $name:start -->"; echo "$header"; echo; cat "$body"; echo "<!-- $name:end -->"; } >"$section"
  python3 - "$name" "$section" <<'PY'
import re, sys
name, section = sys.argv[1], open(sys.argv[2]).read().rstrip("\n")
text = open("BENCHMARKS.md").read()
pattern = r"<!-- %s:start -->.*?<!-- %s:end -->" % (name, name)
if not re.search(pattern, text, flags=re.S):
    sys.exit("BENCHMARKS.md has no %s markers" % name)
open("BENCHMARKS.md", "w").write(re.sub(pattern, lambda m: section, text, flags=re.S))
PY
  rm -f "$section"
}
measured="Measured $(date -u +%Y-%m-%d) on: $machine."
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# core path: cold create, exec round trip, warm pool, memory (vs crun and docker)
"$CARGO_TARGET_DIR/release/aviary-bench" "${1:-30}" | tee "$out"
write_section core "$measured" "$out"

# snapshots: 1 GiB workspace, incremental after a 1% change, vs tar | zstd
"$CARGO_TARGET_DIR/release/examples/snapshot_bench" --size-mib "${AVIARY_BENCH_SNAPSHOT_MIB:-1024}" | tee "$out"
write_section snapshots "$measured" "$out"

# disk quotas: create/destroy with and without the per-sandbox disk, interleaved
cargo test --release --locked -p aviary-runtime-oci --test quota -- \
    --ignored --nocapture measure_create_cost 2>/dev/null |
    grep -E '^(probe|create|destroy)' | { echo '```'; cat; echo '```'; } | tee "$out"
write_section quota "$measured p50 / p90 ms:" "$out"

# planner: accuracy on the labelled corpus, beside both baselines (no root, seconds)
"$CARGO_TARGET_DIR/release/aviary-bench" planner | tee "$out"
write_section planner "Measured $(date -u +%Y-%m-%d) by \`aviary-bench planner\` (accuracy does not depend on the machine; the timing does: $machine)." "$out"
echo "BENCHMARKS.md updated" >&2
