#!/usr/bin/env bash
# Builds the web console (console/, a Preact app bundled by esbuild) into
# console/dist, which `aviary serve` embeds at compile time. Installs the
# pinned npm packages (console/package-lock.json) with `npm ci` only when
# console/node_modules does not match the lockfile. Prints the dist dir.
set -euo pipefail
cd "$(dirname "$0")/../console"
command -v npm >/dev/null || { echo "build-console: npm not found (apt-get install nodejs npm)" >&2; exit 1; }
stamp=node_modules/.aviary-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  npm ci --no-audit --no-fund --loglevel=error >&2
  echo "$want" >"$stamp"
fi
node build.mjs >&2
echo "$PWD/dist"
