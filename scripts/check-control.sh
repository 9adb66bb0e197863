#!/usr/bin/env bash
# Checks the control-plane library's two promises (issue 8):
#  1. no backend crate in aviary-control's dependency tree (no database
#     driver, HTTP server, OCI runtime, template store or node agent);
#  2. its unit tests run over in-memory fakes as a NON-root user.
# Run after the workspace's tests are built (scripts/test.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."

denied='^(sqlx|sqlx-[a-z-]+|libsqlite3-sys|axum|axum-core|oci-spec|redis|rusty-s3|tar|aviary-registry-sqlite|aviary-runtime-oci|aviary-runtime-kube|kube|kube-client|k8s-openapi|aviary-templates|aviary-node|aviary-server|aviary-envd|aviary-egress)$'
tree=$(cargo tree -p aviary-control -e normal --prefix none --locked | sed 's/ v[0-9].*//' | sort -u)
bad=$(grep -E "$denied" <<<"$tree" || true)
if [[ -n "$bad" ]]; then
  echo "check-control: aviary-control depends on backend crates:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "check-control: aviary-control's dependency tree has no backend crate ($(wc -l <<<"$tree") crates)"

# The unit tests as nobody: build (as the caller) and run each test binary
# with root's uid and groups dropped.
bins=$(cargo test -p aviary-control --no-run --locked --message-format=json |
  jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test == true) | .executable')
[[ -n "$bins" ]] || { echo "check-control: no test binaries found" >&2; exit 1; }
if [[ $EUID -eq 0 ]]; then
  run_as=(setpriv --reuid=65534 --regid=65534 --clear-groups --)
  who=nobody
else
  run_as=()
  who=$(id -un)
fi
scratch=$(mktemp -d)
chmod 0777 "$scratch"
trap 'rm -rf "$scratch"' EXIT
for b in $bins; do
  echo "== $(basename "$b") as $who"
  # the binaries must be reachable by nobody: run a copy from the scratch dir
  cp "$b" "$scratch/" && chmod 0755 "$scratch/$(basename "$b")"
  (cd "$scratch" && TMPDIR="$scratch" HOME="$scratch" "${run_as[@]}" "./$(basename "$b")" --test-threads=2)
done
