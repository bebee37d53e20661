#!/usr/bin/env bash
# Builds the matchmaker image with podman and runs it for real: the image alone,
# then the compose stack (deploy/docker-compose.yml) with podman-compose.
#
#   bash deploy/podman/ci.sh        # as root; run by .ci/run
#
# No Docker engine and no image registry are needed: the base images the
# Dockerfile and the compose file name are stand-ins bootstrapped from Debian
# bookworm packages (mmdebstrap), whose Python is 3.11 like the official
# images'. Installs podman, runc, mmdebstrap and podman-compose with apt-get
# when they are missing; skips (exit 0, with the reason) when it is not root or
# they cannot be installed. Fails (exit 1) naming the first check that failed.
# Removes its containers, networks and volumes on exit; keeps the images and the
# bootstrapped base (in $MATCHMAKER_PODMAN_CACHE) for the next run.
#
# Environment:
#   MATCHMAKER_PODMAN_CACHE  base tarball cache (default /var/cache/matchmaker-podman)
#   MATCHMAKER_PODMAN_PORT   host UDP port for the image check; HTTP is the next
#                            one (default 27970, 27971)
#   PYTHON                   the interpreter with the package installed (default .venv)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"

NAME="ci.sh"
CACHE="${MATCHMAKER_PODMAN_CACHE:-/var/cache/matchmaker-podman}"
UDP_PORT="${MATCHMAKER_PODMAN_PORT:-27970}"
HTTP_PORT=$((UDP_PORT + 1))
PY="${PYTHON:-$ROOT/.venv/bin/python}"
COMPOSE_FILE="deploy/docker-compose.yml"
PROJECT="matchmaker-podman-ci"
CONTAINER="matchmaker-podman-ci"
IMAGE="matchmaker:local" # the compose file's image name for the replicas
STOP_TIMEOUT=10          # Docker's (and podman's) default stop timeout
BASE_PACKAGES="python3,python-is-python3,ca-certificates,passwd"
export CONTAINERS_CONF="$HERE/containers.conf"

log() { printf '==> %s\n' "$*"; }
skip() {
    echo "deploy/podman/$NAME: skipped: $*"
    exit 0
}

# ------------------------------------------------------------------ tools

if [[ "$(id -u)" -ne 0 ]]; then
    skip "needs root (rootful podman, mmdebstrap --mode=root)"
fi
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }
seconds() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); } # ms -> "12.3"
START=$(now_ms)
declare -a TIMES=()
mark=$START
lap() { # lap NAME: time since the previous lap
    local now
    now=$(now_ms)
    TIMES+=("$(printf '%-36s %6s s' "$1" "$(seconds $((now - mark)))")")
    mark=$now
}

packages=()
command -v podman >/dev/null 2>&1 || packages+=(podman)
command -v runc >/dev/null 2>&1 || packages+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || packages+=(mmdebstrap)
command -v podman-compose >/dev/null 2>&1 || packages+=(podman-compose)
if ((${#packages[@]})); then
    command -v apt-get >/dev/null 2>&1 || skip "no apt-get to install ${packages[*]}"
    log "installing ${packages[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq "${packages[@]}" >/dev/null; }; then
        skip "could not install ${packages[*]} with apt-get"
    fi
fi
podman info >/dev/null 2>&1 || {
    podman info >&2 || true
    echo "FAILED: podman info (podman is installed but does not run here)" >&2
    exit 1
}
if [[ ! -x "$PY" ]]; then
    make dev >/dev/null
    PY="$ROOT/.venv/bin/python"
fi
lap "install podman & co."

# ------------------------------------------------------------------ checks

WORK="$(mktemp -d "${TMPDIR:-/tmp}/matchmaker-podman.XXXXXX")"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
CURRENT="setup"
PASSED=0
BUILD_PID=""

cleanup() {
    local status=$?
    trap - EXIT
    if [[ -n "$BUILD_PID" ]]; then
        pkill -TERM -P "$BUILD_PID" 2>/dev/null || true
        kill "$BUILD_PID" 2>/dev/null || true
        wait "$BUILD_PID" 2>/dev/null || true
    fi
    podman rm -f -t 0 "$CONTAINER" >/dev/null 2>&1 || true
    podman-compose -p "$PROJECT" -f "$COMPOSE_FILE" down -v -t 2 >/dev/null 2>&1 || true
    local label="io.podman.compose.project=$PROJECT"
    podman ps -aq --filter "label=$label" | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
    podman volume ls -q --filter "label=$label" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
    podman network ls -q --filter "label=$label" | xargs -r podman network rm -f >/dev/null 2>&1 || true
    if ((status)); then lap "failed check and cleanup"; else lap "cleanup"; fi
    printf '%s\n' "${TIMES[@]}"
    printf '%-36s %6s s\n' "total" "$(seconds $(($(now_ms) - START)))"
    if ((status)); then
        echo "deploy/podman/$NAME: FAILED at: $CURRENT (logs kept in $LOGS)" >&2
    else
        rm -rf "$WORK"
        log "deploy/podman/$NAME: all $PASSED checks passed"
    fi
    exit "$status"
}
trap cleanup EXIT

# check NAME COMMAND...: runs one check, stops at the first failure.
check() {
    CURRENT="$1"
    shift
    if "$@"; then
        PASSED=$((PASSED + 1))
        log "ok: $CURRENT"
    else
        echo "FAILED: $CURRENT" >&2
        exit 1
    fi
}

# tail_log LOG: prints the end of a log and returns 1.
tail_log() {
    echo "--- last lines of $1:" >&2
    grep -v 'systemd\|syslog' "$1" | tail -n 40 >&2 || true
    echo "---" >&2
    return 1
}

# logged LOG COMMAND...: runs a command with its output in LOG, shown if it fails.
logged() {
    local file="$1"
    shift
    "$@" >"$file" 2>&1 || tail_log "$file"
}

probe() { "$PY" "$HERE/probe.py" "$@"; }

ports_free() {
    "$PY" - "$@" <<'EOF'
import socket, sys
busy = []
for spec in sys.argv[1:]:
    port, proto = spec.split("/")
    kind = socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as s:
        if kind == socket.SOCK_STREAM:  # a listener's TIME_WAIT does not count
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", int(port)))
        except OSError as exc:
            busy.append(f"{spec} ({exc.strerror})")
if busy:
    print("in use on this host: " + ", ".join(busy), file=sys.stderr)
    sys.exit(1)
EOF
    local status=$?
    if ((status)) && command -v ss >/dev/null 2>&1; then
        ss -Hlntup | grep -E "$(printf ':%s |' "${@%/*}")^$" >&2 || true
    fi
    return "$status"
}

# compose_image SERVICE: the image the compose file names for a service.
compose_image() {
    awk -v svc="  $1:" '$0 == svc {found = 1; next}
        found && /^  [^ ]/ {exit}
        found && $1 == "image:" {print $2; exit}' "$COMPOSE_FILE"
}
# dockerfile_arg NAME: the default of an ARG of the Dockerfile.
dockerfile_arg() { sed -n "s/^ARG $1=//p" Dockerfile; }

SLIM_IMAGE="$(dockerfile_arg PYTHON_IMAGE)"
BUILD_IMAGE="$(dockerfile_arg BUILD_IMAGE)"
REDIS_IMAGE="$(compose_image redis)"
PROMETHEUS_IMAGE="$(compose_image prometheus)"
for v in SLIM_IMAGE BUILD_IMAGE REDIS_IMAGE PROMETHEUS_IMAGE; do
    [[ -n "${!v}" ]] || {
        echo "FAILED: reading the image names ($v) from Dockerfile and $COMPOSE_FILE" >&2
        exit 1
    }
done
grep -q "^  image: $IMAGE\$" "$COMPOSE_FILE" || {
    echo "FAILED: $COMPOSE_FILE does not name the replicas' image $IMAGE" >&2
    exit 1
}

# Leftovers of an interrupted run.
podman rm -f -t 0 "$CONTAINER" >/dev/null 2>&1 || true
podman-compose -p "$PROJECT" -f "$COMPOSE_FILE" down -v -t 2 >/dev/null 2>&1 || true

# ------------------------------------------------------------------ stand-in bases
#
# One Debian bookworm root file system, bootstrapped once a week and cached, is the
# stand-in for the slim Python image; every other stand-in is built from it.
# If HTTPS is intercepted on this machine (a CA of its own in
# /usr/local/share/ca-certificates), the stand-in trusts the same CAs, and pip
# inside the build uses the same package index as pip here.

OVERLAY="$WORK/overlay"
mkdir -p "$OVERLAY/usr/local/share/ca-certificates" "$OVERLAY/etc/dpkg/dpkg.cfg.d"
if [[ -d /usr/local/share/ca-certificates ]]; then
    cp -rL /usr/local/share/ca-certificates/. "$OVERLAY/usr/local/share/ca-certificates/"
fi
# As in Debian's official images: no fsync for every file dpkg unpacks.
echo force-unsafe-io >"$OVERLAY/etc/dpkg/dpkg.cfg.d/unsafe-io"
{
    echo "[global]"
    echo "cert = /etc/ssl/certs/ca-certificates.crt"
    index="${PIP_INDEX_URL:-$("$PY" -m pip config get global.index-url 2>/dev/null || true)}"
    if [[ "$index" == http* ]]; then
        echo "index-url = $index"
    fi
    extra=()
    for url in ${PIP_EXTRA_INDEX_URL:-$("$PY" -m pip config get global.extra-index-url 2>/dev/null || true)}; do
        [[ "$url" == http* ]] && extra+=("$url")
    done
    if ((${#extra[@]})); then
        echo "extra-index-url = ${extra[*]}"
    fi
} >"$OVERLAY/etc/pip.conf"

# The host's own Debian sources when it has them (same mirror, same proxy path).
SOURCES=()
if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    SOURCES=(/etc/apt/sources.list.d/debian.sources)
fi
# Bootstrapped again each week: the derived stand-ins install from the package
# lists the base carries, which must not fall far behind the mirror.
KEY="$( {
    date -u +%G-W%V
    echo "$BASE_PACKAGES"
    cat "${SOURCES[@]}" /dev/null
    (cd "$OVERLAY" && find . -type f | sort | xargs cat)
} | sha256sum | cut -c1-16)"
BASE_TAR="$CACHE/bookworm-$KEY.tar"

bootstrap() {
    mkdir -p "$CACHE"
    # The bootstrap's scratch root on tmpfs when there is room: a disk-backed
    # one spends as long deleting it as building it.
    local scratch="$CACHE"
    if [[ -d /dev/shm ]] && (($(df -Pk /dev/shm | awk 'NR == 2 {print $4}') > 2000000)); then
        scratch=/dev/shm
    fi
    rm -f "$CACHE"/bookworm-*.tar "$CACHE"/*.tmp
    # Package lists are kept: the derived stand-ins install with apt-get.
    # shellcheck disable=SC2016  # "$1" is the hook's argument, the new root
    TMPDIR="$scratch" mmdebstrap --mode=root --variant=apt --format=tar \
        --include="$BASE_PACKAGES" \
        --skip=cleanup/apt/lists \
        --dpkgopt=force-unsafe-io \
        --aptopt='Acquire::Languages "none"' \
        --customize-hook="sync-in $OVERLAY /" \
        --customize-hook='chroot "$1" update-ca-certificates' \
        bookworm "$BASE_TAR.tmp" "${SOURCES[@]}" </dev/null &&
        mv "$BASE_TAR.tmp" "$BASE_TAR"
}

import_slim() {
    # Imported once per base tarball: the same image id keeps the layer cache
    # of the images built on it.
    if [[ "$(podman image inspect --format '{{index .Labels "matchmaker.standin"}}' \
        "$SLIM_IMAGE" 2>/dev/null)" == "$KEY" ]]; then
        return 0
    fi
    podman import \
        --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV LANG=C.UTF-8" \
        --change "LABEL matchmaker.standin=$KEY" \
        --change 'CMD ["python3"]' \
        "$BASE_TAR" "$SLIM_IMAGE"
}

# standin NAME CONTAINERFILE: a stand-in image built on the slim one.
standin() {
    podman build --pull=never --format docker --build-arg "BASE=$SLIM_IMAGE" \
        -t "$1" -f "$HERE/standins/$2" "$HERE/standins"
}

if [[ -f "$BASE_TAR" ]]; then
    log "stand-in base: cached $BASE_TAR"
else
    log "stand-in base: bootstrapping Debian bookworm ($BASE_PACKAGES)"
    check "bootstrap the stand-in base (mmdebstrap)" logged "$LOGS/mmdebstrap.log" bootstrap
fi
lap "bootstrap base (mmdebstrap)"
check "import the stand-in base as $SLIM_IMAGE" logged "$LOGS/import.log" import_slim
check "$SLIM_IMAGE stand-in: Python 3.11, reaches the package index over HTTPS" \
    podman run --rm --read-only "$SLIM_IMAGE" python -c \
    "import sys, urllib.request as r, configparser as c
assert sys.version_info[:2] == (3, 11), sys.version
p = c.ConfigParser(); p.read('/etc/pip.conf')
index = p.get('global', 'index-url', fallback='https://pypi.org/simple').rstrip('/')
r.urlopen(index + '/pip/', timeout=20).read(1)"
lap "import base"

# Redis and Prometheus stand-ins build while the image does (they are needed
# only by the compose checks).
(
    set -e
    standin "$REDIS_IMAGE" redis.Containerfile
    standin "$PROMETHEUS_IMAGE" prometheus.Containerfile
) >"$LOGS/standins.log" 2>&1 &
BUILD_PID=$!

log "building $BUILD_IMAGE stand-in, then $IMAGE"
check "build the $BUILD_IMAGE stand-in" \
    logged "$LOGS/python-build.log" standin "$BUILD_IMAGE" python-build.Containerfile
lap "build stand-in $BUILD_IMAGE"
# --format docker: the OCI image format has no HEALTHCHECK.
PREVIOUS="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
check "build the image (podman build)" \
    logged "$LOGS/image-build.log" podman build --pull=never --format docker -t "$IMAGE" .
if [[ -n "$PREVIOUS" && "$PREVIOUS" != "$(podman image inspect --format '{{.Id}}' "$IMAGE")" ]]; then
    podman rmi "$PREVIOUS" >/dev/null 2>&1 || true # the image this build replaced
fi
lap "build matchmaker image"

# ------------------------------------------------------------------ the image alone

run_container() {
    podman run -d --name "$CONTAINER" \
        --read-only --cap-drop=ALL --security-opt=no-new-privileges \
        -e MATCHMAKER_ALLOW_PRIVATE=true \
        -p "127.0.0.1:$UDP_PORT:27950/udp" -p "127.0.0.1:$HTTP_PORT:27951/tcp" \
        "$IMAGE"
}

# In the container: uid, capabilities and a write to the root file system.
confinement() {
    podman exec "$CONTAINER" python -c '
import errno, sys
status = dict(line.split(":\t", 1) for line in open("/proc/1/status").read().splitlines())
uid = status["Uid"].split()
assert set(uid) == {"10001"}, f"PID 1 uids {uid}"
caps = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
assert all(int(v, 16) == 0 for v in caps.values()), f"capabilities left: {caps}"
try:
    open("/probe", "w")
except OSError as exc:
    assert exc.errno in (errno.EROFS, errno.EACCES), exc
    print(f"uid 10001, no capabilities, write to /: {errno.errorcode[exc.errno]}")
else:
    sys.exit("the root file system is writable")
' && [[ "$(podman inspect --format '{{.HostConfig.ReadonlyRootfs}}' "$CONTAINER")" == true ]] &&
        [[ "$(podman top "$CONTAINER" huser | tail -n 1)" == 10001 ]]
}

healthy() {
    podman healthcheck run "$CONTAINER" >/dev/null 2>>"$LOGS/health.log" &&
        [[ "$(podman inspect --format '{{.State.Health.Status}}' "$CONTAINER")" == healthy ]]
}

frozen_is_unhealthy() {
    podman kill --signal STOP "$CONTAINER" >/dev/null || return 1
    local rc=0
    podman healthcheck run "$CONTAINER" >/dev/null 2>>"$LOGS/health.log" || rc=$?
    podman kill --signal CONT "$CONTAINER" >/dev/null || return 1
    ((rc != 0)) || {
        echo "the health check passed while the daemon was stopped" >&2
        return 1
    }
    healthy
}

sigterm_exits_0() {
    local t0 took code
    t0=$(now_ms)
    podman stop -t "$STOP_TIMEOUT" "$CONTAINER" >/dev/null 2>>"$LOGS/health.log" || return 1
    took=$(($(now_ms) - t0))
    code="$(podman inspect --format '{{.State.ExitCode}}' "$CONTAINER")"
    podman logs "$CONTAINER" >"$LOGS/container.log" 2>&1
    echo "stopped in $(seconds "$took") s, exit code $code"
    [[ "$code" == 0 ]] && ((took < STOP_TIMEOUT * 1000)) &&
        grep -q '"matchmaker_stopped"' "$LOGS/container.log"
}

check "host ports $UDP_PORT/udp, $HTTP_PORT/tcp free" ports_free "$UDP_PORT/udp" "$HTTP_PORT/tcp"
check "run $IMAGE (--read-only --cap-drop=ALL)" logged "$LOGS/run.log" run_container
check "/healthz from the host" probe http "http://127.0.0.1:$HTTP_PORT/healthz"
check "/readyz from the host" probe http "http://127.0.0.1:$HTTP_PORT/readyz"
check "a host registers over UDP and is listed" \
    probe register-list --register "127.0.0.1:$UDP_PORT" --list "127.0.0.1:$UDP_PORT"
check "uid 10001, read-only root, no capabilities" confinement
check "HEALTHCHECK passes (podman healthcheck run)" healthy
check "HEALTHCHECK fails while the daemon is frozen (SIGSTOP)" frozen_is_unhealthy
check "SIGTERM ends it with exit code 0 within ${STOP_TIMEOUT} s" sigterm_exits_0
podman rm -f -t 0 "$CONTAINER" >/dev/null 2>&1
lap "image checks"

# ------------------------------------------------------------------ compose stack
#
# Grafana has no Debian package, so no stand-in: every service but grafana is
# started (its dashboard is checked statically by deploy/check.sh).

wait_standins() {
    local pid=$BUILD_PID
    BUILD_PID=""
    wait "$pid" || tail_log "$LOGS/standins.log"
}
check "build the $REDIS_IMAGE and $PROMETHEUS_IMAGE stand-ins" wait_standins
lap "wait for redis/prometheus stand-ins"

SERVICES=(redis matchmaker-1 matchmaker-2 prometheus)
compose_up() {
    MATCHMAKER_ALLOW_PRIVATE=true podman-compose -p "$PROJECT" -f "$COMPOSE_FILE" \
        up -d --no-build "${SERVICES[@]}"
}

compose_stop_exits_0() {
    podman-compose -p "$PROJECT" -f "$COMPOSE_FILE" stop >"$LOGS/compose-stop.log" 2>&1
    local bad
    bad="$(podman ps -a --filter "label=io.podman.compose.project=$PROJECT" \
        --format '{{.Names}} {{.ExitCode}}' | awk '$2 != 0')"
    [[ -z "$bad" ]] || {
        echo "exit codes: $bad" >&2
        return 1
    }
}

redis_healthy() {
    local n
    for ((n = 0; n < 20; n++)); do
        podman healthcheck run "${PROJECT}_redis_1" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    return 1
}

# The compose file publishes these on the host.
check "host ports 27950-27953, 9090 free" \
    ports_free 27950/udp 27951/tcp 27952/udp 27953/tcp 9090/tcp
check "podman-compose up (${SERVICES[*]})" logged "$LOGS/compose-up.log" compose_up
check "redis healthcheck" redis_healthy
check "matchmaker-1 /readyz" probe http http://127.0.0.1:27951/readyz
check "matchmaker-2 /readyz" probe http http://127.0.0.1:27953/readyz
check "a host registered on matchmaker-1 is listed by matchmaker-2" \
    probe register-list --register 127.0.0.1:27950 --list 127.0.0.1:27952
check "Prometheus scrapes both replicas (up == 1)" \
    probe prometheus-up http://127.0.0.1:9090 --job matchmaker --targets 2
check "podman-compose stop: every container exits 0" compose_stop_exits_0
podman-compose -p "$PROJECT" -f "$COMPOSE_FILE" down -v >/dev/null 2>&1
lap "compose checks"
# Images left untagged by builds on an earlier base. Untagged images on the
# current base stay: the build stage's is the cache of the next build.
podman images --filter dangling=true --format '{{.ID}} {{index .Labels "matchmaker.standin"}}' |
    awk -v key="$KEY" '$2 != "" && $2 != key {print $1}' |
    xargs -r podman rmi -f >/dev/null 2>&1 || true

CURRENT="cleanup"
