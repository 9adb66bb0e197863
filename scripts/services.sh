#!/usr/bin/env bash
# Real backing services for the snapshot-store tests: Redis, PostgreSQL and an
# S3-compatible object store (s3s-fs, which keeps objects as files), all on loopback
# with their data in a scratch directory; and a dockerd of its own for the Docker
# runtime's tests (no networking, its socket and data under AVIARY_DOCKER_DIR).
#
#   scripts/services.sh start > /tmp/aviary-services.env   # installs if needed, starts
#   . /tmp/aviary-services.env                               # AVIARY_TEST_* variables
#   scripts/services.sh stop                                 # stops them, removes the data
#
# `start` is idempotent (a running service is left alone) and prints only `export`
# lines on stdout; progress goes to stderr. Ports and the data dir can be overridden
# with AVIARY_SERVICES_DIR, AVIARY_REDIS_PORT, AVIARY_PG_PORT, AVIARY_S3_PORT;
# AVIARY_SERVICES_DOCKERD=0 leaves dockerd alone (a private set next to the shared one).
set -euo pipefail

DIR="${AVIARY_SERVICES_DIR:-/tmp/aviary-services}"
REDIS_PORT="${AVIARY_REDIS_PORT:-16379}"
PG_PORT="${AVIARY_PG_PORT:-15432}"
S3_PORT="${AVIARY_S3_PORT:-18014}"
S3_ACCESS_KEY="aviary-test"
S3_SECRET_KEY="aviary-test-secret"
S3_BUCKET="aviary-snapshots"
# s3s-fs 0.17 needs rustc >= 1.96; 0.14.1 is the newest that builds with this toolchain.
S3S_FS_VERSION="0.14.1"
# dockerd keeps overlay2 layers here, so not on a tmpfs /tmp
DOCKER_DIR="${AVIARY_DOCKER_DIR:-/var/tmp/aviary-dockerd}"

log() { echo "services: $*" >&2; }

apt_install() {
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2; then
        apt-get update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >&2
    fi
}

pg_bin() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
    [ -n "$d" ] && echo "$d"
}

s3s_bin() {
    command -v s3s-fs 2>/dev/null || { [ -x "$HOME/.cargo/bin/s3s-fs" ] && echo "$HOME/.cargo/bin/s3s-fs"; }
}

install() {
    command -v redis-server >/dev/null || { log "installing redis-server"; apt_install redis-server; }
    # The Debian package starts a system-wide instance on 6379; ours runs separately.
    [ -n "$(pg_bin)" ] || { log "installing postgresql"; apt_install postgresql; }
    if [ -z "$(s3s_bin)" ]; then
        log "installing s3s-fs $S3S_FS_VERSION from crates.io (a few minutes)"
        cargo install s3s-fs --version "$S3S_FS_VERSION" --features binary --locked >&2
    fi
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_port() {
    local port=$1 name=$2
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    log "$name did not open port $port"; return 1
}

start_redis() {
    mkdir -p "$DIR/redis"
    if alive "$DIR/redis/redis.pid"; then log "redis already running"; return; fi
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no \
        --daemonize yes --pidfile "$DIR/redis/redis.pid" --dir "$DIR/redis" \
        --logfile "$DIR/redis/redis.log" >&2
    wait_port "$REDIS_PORT" redis
    log "redis on 127.0.0.1:$REDIS_PORT"
}

start_postgres() {
    local bin data sock
    bin=$(pg_bin); data="$DIR/pg/data"; sock="$DIR/pg/sock"
    mkdir -p "$DIR/pg" "$sock"
    chown -R postgres:postgres "$DIR/pg"
    if runuser -u postgres -- "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        log "postgres already running"; return
    fi
    if [ ! -f "$data/PG_VERSION" ]; then
        runuser -u postgres -- "$bin/initdb" -D "$data" -A trust -U postgres >/dev/null
    fi
    runuser -u postgres -- "$bin/pg_ctl" -D "$data" -l "$DIR/pg/postgres.log" -w \
        -o "-k $sock -p $PG_PORT -c listen_addresses=127.0.0.1 -c fsync=off" start >&2
    runuser -u postgres -- "$bin/psql" -h "$sock" -p "$PG_PORT" -U postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname='aviary_test'" | grep -q 1 ||
        runuser -u postgres -- "$bin/createdb" -h "$sock" -p "$PG_PORT" -U postgres aviary_test
    log "postgres on 127.0.0.1:$PG_PORT (socket dir $sock)"
}

start_s3() {
    mkdir -p "$DIR/s3/data/$S3_BUCKET"
    if alive "$DIR/s3/s3s-fs.pid"; then log "s3s-fs already running"; return; fi
    nohup "$(s3s_bin)" --host 127.0.0.1 --port "$S3_PORT" \
        --access-key "$S3_ACCESS_KEY" --secret-key "$S3_SECRET_KEY" "$DIR/s3/data" \
        >"$DIR/s3/s3s-fs.log" 2>&1 &
    echo $! >"$DIR/s3/s3s-fs.pid"
    wait_port "$S3_PORT" s3s-fs
    log "s3s-fs on 127.0.0.1:$S3_PORT"
}

start_dockerd() {
    if [ "${AVIARY_SERVICES_DOCKERD:-1}" = 0 ]; then return; fi
    if ! command -v dockerd >/dev/null; then
        log "dockerd is not installed (scripts/deps.sh test installs docker.io): skipping it"
        return
    fi
    mkdir -p "$DOCKER_DIR"
    if alive "$DOCKER_DIR/dockerd.pid"; then log "dockerd already running"; return; fi
    # no bridge, no iptables: sandboxes run with network "none"
    setsid dockerd --data-root "$DOCKER_DIR/data" --exec-root "$DOCKER_DIR/exec" \
        --pidfile "$DOCKER_DIR/dockerd.pid" -H "unix://$DOCKER_DIR/docker.sock" \
        --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
        --storage-driver=overlay2 >"$DOCKER_DIR/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 100); do
        if [ -S "$DOCKER_DIR/docker.sock" ] &&
            docker -H "unix://$DOCKER_DIR/docker.sock" version >/dev/null 2>&1; then
            log "dockerd on $DOCKER_DIR/docker.sock"
            return
        fi
        sleep 0.1
    done
    log "dockerd did not come up (see $DOCKER_DIR/dockerd.log)"; return 1
}

stop_dockerd() {
    local pid
    # a private set of services (AVIARY_SERVICES_DOCKERD=0) never touches the shared dockerd
    if [ "${AVIARY_SERVICES_DOCKERD:-1}" = 0 ]; then return 0; fi
    alive "$DOCKER_DIR/dockerd.pid" || return 0
    pid=$(cat "$DOCKER_DIR/dockerd.pid")
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    log "dockerd stopped"
    # its data (images, containers' layers) is kept for the next run's imports
}

start() {
    install
    mkdir -p "$DIR"
    chmod 755 "$DIR"
    start_redis
    start_postgres
    start_s3
    start_dockerd
    if [ -S "$DOCKER_DIR/docker.sock" ]; then
        echo "export AVIARY_DOCKER_HOST=$DOCKER_DIR/docker.sock"
    fi
    cat <<ENV
export AVIARY_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0
export AVIARY_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:$PG_PORT/aviary_test
export AVIARY_TEST_S3_ENDPOINT=http://127.0.0.1:$S3_PORT
export AVIARY_TEST_S3_ACCESS_KEY=$S3_ACCESS_KEY
export AVIARY_TEST_S3_SECRET_KEY=$S3_SECRET_KEY
export AVIARY_TEST_S3_BUCKET=$S3_BUCKET
ENV
}

stop() {
    local bin
    if alive "$DIR/redis/redis.pid"; then
        kill "$(cat "$DIR/redis/redis.pid")" && log "redis stopped"
    fi
    bin=$(pg_bin || true)
    if [ -n "$bin" ] && [ -f "$DIR/pg/data/postmaster.pid" ]; then
        runuser -u postgres -- "$bin/pg_ctl" -D "$DIR/pg/data" -m fast -w stop >&2 || true
    fi
    if alive "$DIR/s3/s3s-fs.pid"; then
        kill "$(cat "$DIR/s3/s3s-fs.pid")" && log "s3s-fs stopped"
    fi
    stop_dockerd
    sleep 0.2
    rm -rf "$DIR"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    install) install ;;
    *) echo "usage: $0 start|stop|install" >&2; exit 2 ;;
esac
