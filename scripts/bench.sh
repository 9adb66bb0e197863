#!/usr/bin/env bash
# Benchmarks: builds release binaries, starts what it compares against
# (dockerd, hand-started as in RUNTIME-NOTES), measures side by side in one
# run, and writes the results into BENCHMARKS.md (between the markers).
#   scripts/bench.sh [ITERATIONS] [PART...]
# PARTs (default: all, in this order): core exec snapshots chunker history quota gvisor planner pool leases replicas docker tiers scale.
set -euo pipefail
cd "$(dirname "$0")/.."
iterations=${1:-30}
all_parts=" core exec snapshots chunker history quota gvisor planner pool leases replicas docker tiers scale "
parts=" ${*:2} "
[[ $parts == "  " ]] && parts=$all_parts
for p in $parts; do
  [[ $all_parts == *" $p "* ]] || { echo "bench: unknown part $p (parts:$all_parts)" >&2; exit 2; }
done
want() { [[ $parts == *" $1 "* ]]; }
source scripts/deps.sh bench
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
if want core || want exec || want planner || want pool || want leases || want replicas || want docker || want tiers || want scale; then
  # one package set for every part (another set would unify features
  # differently and rebuild the tree); `exec` runs the real `aviary` binary
  cargo build --release --locked -p aviary-bench -p aviary-cli
fi
if want snapshots; then
  cargo build --release --locked -p aviary-snapshots --example snapshot_bench
fi
if want chunker; then
  cargo build --release --locked -p aviary-snapshots --example chunker_bench
fi
if want history; then
  cargo build --release --locked -p aviary-registry-sqlite --example history_bench --example create_writes_bench
fi
# a static envd given by the caller is used as it is (e.g. the CI target's)
AVIARY_ENVD=${AVIARY_ENVD:-$(scripts/build-envd.sh)}
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
# part NAME: a progress line per part, with the time since the start
bench_start=0  # (SECONDS counts from the start of the script, builds included)
part_no=0
part_count=$(wc -w <<<"$parts")
part() {
  part_no=$((part_no + 1))
  printf 'bench [%02d:%02d] part %d/%d: %s\n' $(((SECONDS - bench_start) / 60)) $(((SECONDS - bench_start) % 60)) \
    "$part_no" "$part_count" "$1" >&2
}
measured="Measured $(date -u +%Y-%m-%d) on: $machine."
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# core path: cold create, exec round trip, warm pool, memory (vs crun and docker)
if want core; then
  part core
  "$CARGO_TARGET_DIR/release/aviary-bench" "$iterations" | tee "$out"
  write_section core "$measured" "$out"
fi

# exec path: envd's own round trip vs the API's (and where the difference
# goes), `aviary run -- true` as a user runs it vs crun run + crun delete
if want exec; then
  part exec
  load_before=$(cut -d' ' -f1 /proc/loadavg)
  AVIARY_BIN="$CARGO_TARGET_DIR/release/aviary" \
    "$CARGO_TARGET_DIR/release/aviary-bench" exec-path "$iterations" | tee "$out"
  write_section exec "$measured 1-minute load average before / after: $load_before / $(cut -d' ' -f1 /proc/loadavg)." "$out"
fi

# snapshots: 1 GiB workspace, incremental after a 1% change, vs tar | zstd; once in a
# plain dir (the host's fs), once on a loop-mounted XFS the example makes (root; reflink
# shadows: changed files re-read only where they changed)
if want snapshots; then
  part "snapshots (plain dir, then XFS with reflink shadows)"
  "$CARGO_TARGET_DIR/release/examples/snapshot_bench" --size-mib "${AVIARY_BENCH_SNAPSHOT_MIB:-1024}" | tee "$out"
  write_section snapshots "$measured" "$out"
fi

# chunker: the fastcdc crate (used) beside the former hand-written gear chunker
if want chunker; then
  part chunker
  "$CARGO_TARGET_DIR/release/examples/chunker_bench" --size-mib 256 | { echo '```'; cat; echo '```'; } | tee "$out"
  write_section chunker "$measured 256 MiB of random bytes, median of 5:" "$out"
fi

# registry: a create's live listing with 100k terminated sandboxes, with and without the live index;
# and each of a cold create's registry writes apart
if want history; then
  part history
  { "$CARGO_TARGET_DIR/release/examples/history_bench" 100000
    echo
    echo "A cold create's own registry work, each write apart (median of 300 creates' worth):"
    echo
    "$CARGO_TARGET_DIR/release/examples/create_writes_bench" 300; } | tee "$out"
  write_section history "$measured Median of 300 listings of a tenant's 20 live sandboxes:" "$out"
fi

# disk quotas: create/destroy with and without the per-sandbox disk, interleaved
if want quota; then
  part quota
  cargo test --release --locked -p aviary-runtime-oci --test quota -- \
      --ignored --nocapture measure_create_cost 2>/dev/null |
      grep -E '^(probe|create|destroy)' | { echo '```'; cat; echo '```'; } | tee "$out"
  write_section quota "$measured p50 / p90 ms:" "$out"
fi

# gVisor: crun beside runsc (create → first exec, exec), and runsc's memory
# checkpoint / restore of a sandbox whose process holds 100 MB
if want gvisor; then
  part gvisor
  # one round by default: under ptrace each round's 100 MB process takes ~4 min to fill
  AVIARY_BENCH_GVISOR_ROUNDS=${AVIARY_BENCH_GVISOR_ROUNDS:-1} \
  cargo test --release --locked -p aviary-runtime-oci --test gvisor -- \
      --ignored --nocapture measure_checkpoint_cost 2>/dev/null |
      grep -E '^\|' | tee "$out"
  write_section gvisor "$measured runsc $(runsc --version | head -1 | awk '{print $3}'), \`--platform=ptrace\`:" "$out"
fi

# planner: accuracy on the labelled corpus, beside both baselines (no root, seconds)
if want planner; then
  part planner
  "$CARGO_TARGET_DIR/release/aviary-bench" planner | tee "$out"
  write_section planner "Measured $(date -u +%Y-%m-%d) by \`aviary-bench planner\` (accuracy does not depend on the machine; the timing does: $machine)." "$out"
fi

# warm pool under churn: hits over create → exec → rm cycles, hit vs miss latency
if want pool; then
  part pool
  "$CARGO_TARGET_DIR/release/aviary-bench" pool-churn "${AVIARY_BENCH_POOL_CYCLES:-50}" | tee "$out"
  write_section pool "$measured" "$out"
fi
# services_up / services_down: the test services (PostgreSQL, Redis) for the
# parts that need them, from scripts/services.sh; services that were already up
# (a test run, a developer's) are left running
services_up() {
  services_env=$(mktemp)
  were_up=no
  if (exec 3<>/dev/tcp/127.0.0.1/"${AVIARY_PG_PORT:-15432}") 2>/dev/null; then were_up=yes; fi
  scripts/services.sh start >"$services_env"
  # shellcheck disable=SC1090
  . "$services_env"
}
services_down() {
  [[ $were_up == yes ]] || scripts/services.sh stop >/dev/null 2>&1 || true
  rm -f "$services_env"
}

# lease stores: embedded vs PostgreSQL vs Redis, beside redis-benchmark (the floor)
if want leases; then
  part leases
  services_up
  "$CARGO_TARGET_DIR/release/aviary-bench" leases "${AVIARY_BENCH_LEASE_CYCLES:-2000}" | tee "$out"
  services_down
  write_section leases "$measured" "$out"
fi

# replicas: distributed create → first exec (1 vs 3 replicas, two node agents)
# vs the embedded server; reconciler time to find and restore a Lost sandbox
if want replicas; then
  part replicas
  services_up
  "$CARGO_TARGET_DIR/release/aviary-bench" replicas "$iterations" | tee "$out"
  services_down
  write_section replicas "$measured" "$out"
fi
# the docker runtime beside crun in one server: cold create → first exec, exec round trip
if want docker; then
  part docker
  "$CARGO_TARGET_DIR/release/aviary-bench" docker-runtime "$iterations" | tee "$out"
  write_section docker "$measured" "$out"
fi

# isolation tiers side by side in one server: crun, runc, runsc (gVisor),
# docker; cold create → first exec, exec round trip, host memory per idle
# sandbox (AVIARY_BENCH_TIERS_IDLE of a tier alive), runsc hibernate → wake
if want tiers; then
  part tiers
  "$CARGO_TARGET_DIR/release/aviary-bench" tiers "$iterations" "${AVIARY_BENCH_TIERS_IDLE:-10}" | tee "$out"
  write_section tiers "$measured" "$out"
fi

# scale: sustained creates/s (1, 4, 16 clients) vs the crun floor, and the
# cost per idle sandbox with 10 / 100 / 500 / 1000 alive; the curve plotted
# by matplotlib from a throwaway venv (pinned) into docs/scale.png
if want scale; then
  part "scale (up to ${AVIARY_BENCH_SCALE_MAX:-1000} idle sandboxes)"
  load_before=$(cut -d' ' -f1 /proc/loadavg)
  points=$(mktemp)
  "$CARGO_TARGET_DIR/release/aviary-bench" scale "${AVIARY_BENCH_SCALE_MAX:-1000}" "$points" | tee "$out"
  venv=/var/tmp/aviary-bench-venv
  if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
    python3 -m venv "$venv" >/dev/null
    "$venv/bin/pip" install --quiet 'matplotlib==3.9.2' >&2
  fi
  "$venv/bin/python" scripts/plot-scale.py "$points" docs/scale.png "$machine"
  echo "![scale curves](docs/scale.png)" >>"$out"
  rm -f "$points"
  write_section scale "$measured 1-minute load average before / after: $load_before / $(cut -d' ' -f1 /proc/loadavg)." "$out"
fi
printf 'bench [%02d:%02d] done: BENCHMARKS.md updated\n' $(((SECONDS - bench_start) / 60)) $(((SECONDS - bench_start) % 60)) >&2
