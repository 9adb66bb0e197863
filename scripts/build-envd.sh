#!/usr/bin/env bash
# Builds envd (the in-sandbox daemon) as a static binary and prints its path.
#
# glibc static linking (+crt-static) on the gnu target: the musl target is not
# available here. envd uses no NSS lookups (no getpwnam, no DNS), so static
# glibc is safe for it. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

target=x86_64-unknown-linux-gnu
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static -C strip=debuginfo" \
    cargo build --release -p aviary-envd --target "$target" >&2

target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
bin="$target_dir/$target/release/aviary-envd"
if [ ! -x "$bin" ]; then
    echo "build-envd: $bin was not produced" >&2
    exit 1
fi
# Refuse to hand out a dynamically linked envd: it must run in any rootfs.
if command -v file >/dev/null 2>&1; then
    if ! file -L "$bin" | grep -Eq 'statically linked|static-pie linked'; then
        echo "build-envd: $bin is not static: $(file -L "$bin")" >&2
        exit 1
    fi
fi
echo "$bin"
