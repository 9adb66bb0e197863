#!/usr/bin/env bash
# Set-up command 1: installs dependencies, builds Aviary, installs `aviary` and
# the static `aviary-envd` into /usr/local/bin, and starts `aviary serve` on the
# embedded default (SQLite registry, local crun runtime) in the background.
# Returns once the server is ready for `aviary run` (the first start prepares
# the default Debian+python3 template, about a minute).
#
#   scripts/serve.sh [--foreground] [extra `aviary serve` flags...]
#
# Environment: AVIARY_DATA_DIR (default /var/lib/aviary), AVIARY_LISTEN
# (default 127.0.0.1:7400), CARGO_TARGET_DIR (default ./target).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh

foreground=0
if [[ "${1:-}" == --foreground ]]; then foreground=1; shift; fi

target=${CARGO_TARGET_DIR:-$PWD/target}
# the web console first: the release build embeds console/dist
scripts/build-console.sh >/dev/null
cargo build --release --locked -p aviary-cli
envd=$(scripts/build-envd.sh)
install -m 0755 "$target/release/aviary" /usr/local/bin/aviary
install -m 0755 "$envd" /usr/local/bin/aviary-envd

data=${AVIARY_DATA_DIR:-/var/lib/aviary}
listen=${AVIARY_LISTEN:-127.0.0.1:7400}
mkdir -p "$data"
if ((foreground)); then
  exec /usr/local/bin/aviary serve --data-dir "$data" --listen "$listen" "$@"
fi

if [[ -f "$data/serve.pid" ]] && kill -0 "$(cat "$data/serve.pid")" 2>/dev/null; then
  echo "aviary: stopping the running server (pid $(cat "$data/serve.pid")) to start the new build" >&2
  kill "$(cat "$data/serve.pid")"
  for _ in $(seq 50); do kill -0 "$(cat "$data/serve.pid")" 2>/dev/null || break; sleep 0.1; done
fi
nohup /usr/local/bin/aviary serve --data-dir "$data" --listen "$listen" "$@" >>"$data/serve.log" 2>&1 &
echo $! >"$data/serve.pid"
echo "aviary: server starting (pid $!, log $data/serve.log)" >&2
tail -n 0 -f "$data/serve.log" --pid=$! >&2 &
tailer=$!
for _ in $(seq 1800); do
  if curl -fsS "http://$listen/readyz" >/dev/null 2>&1; then
    kill $tailer 2>/dev/null || true
    echo "aviary: ready at http://$listen — try: aviary run -- python3 -c 'print(6*7)'" >&2
    exit 0
  fi
  if ! kill -0 "$(cat "$data/serve.pid")" 2>/dev/null; then
    kill $tailer 2>/dev/null || true
    echo "aviary: server exited; see $data/serve.log" >&2
    exit 1
  fi
  if curl -s "http://$listen/readyz" 2>/dev/null | grep -q '"failed"'; then
    kill $tailer 2>/dev/null || true
    echo "aviary: server failed to get ready; see $data/serve.log" >&2
    exit 1
  fi
  sleep 0.2
done
kill $tailer 2>/dev/null || true
echo "aviary: server not ready after 6 minutes; see $data/serve.log" >&2
exit 1
