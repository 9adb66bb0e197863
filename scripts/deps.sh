#!/usr/bin/env bash
# Installs what Aviary needs on Debian 12, idempotently. Sourced or run.
#   scripts/deps.sh            runtime + build dependencies
#   scripts/deps.sh test       plus what the test suite and benchmarks use
set -euo pipefail

# xfsprogs: an XFS (reflink=1) filesystem lets snapshots track changes below the
# file level (aviary-snapshots shadow clones); its tests and bench make one
want=(crun runc runsc debootstrap busybox-static jq curl ca-certificates gcc libc6-dev pkg-config util-linux iproute2 file e2fsprogs xfsprogs slirp4netns iptables)
# node/npm build the web console (scripts/build-console.sh); the E2B JS SDK
# tests use them too
command -v npm >/dev/null || want+=(nodejs npm)
if [[ "${1:-}" == test || "${1:-}" == bench ]]; then
  # chromium: the web console's browser tests
  want+=(docker.io procps chromium)
  python3 -c 'import venv, ensurepip' 2>/dev/null || want+=(python3-venv)
fi

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  if [[ $EUID -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "deps: cargo not found; install a Rust toolchain (rustup) first" >&2
    exit 1
  fi
fi
