# syntax=docker/dockerfile:1
# Matchmaker daemon image.  Build from the repository root:
#   docker build -t matchmaker .
# Configuration is by MATCHMAKER_* environment variables (see docs/matchmaker.md);
# tests/deploy/test_image.py installs and runs exactly what this file describes.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The build stage compiles rudp's per-message code with mypyc (RUDP_COMPILE=1), which
# needs a C compiler: the full image has one, the slim one does not. Both carry the
# same CPython under /usr/local, so the venv and its C extensions run in the slim one.
ARG BUILD_IMAGE=python:3.11-bookworm

# ---------------------------------------------------------------- build stage
FROM ${BUILD_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RUDP_COMPILE=1
RUN python -m venv /opt/matchmaker
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY build_backend ./build_backend
COPY rudp ./rudp
COPY matchmaker ./matchmaker
# A regular (non-editable) install of the compiled build (2-2.7x the pure build's
# throughput) with the daemon's extra (structlog, redis, hiredis, prometheus-client, uvloop);
# the import (-P: of the installed package, not of the sources in this directory)
# proves the wheel fits and is compiled.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/matchmaker/bin/python -m pip install '.[matchmaker]' \
 && /opt/matchmaker/bin/python -P -c "import uvloop, hiredis, matchmaker, rudp; assert rudp.compiled"

# -------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="matchmaker" \
      org.opencontainers.image.description="rudp matchmaker daemon" \
      org.opencontainers.image.licenses="MIT"
RUN groupadd --system --gid 10001 matchmaker \
 && useradd --system --uid 10001 --gid matchmaker --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin matchmaker
COPY --from=build /opt/matchmaker /opt/matchmaker
# Every setting is an environment variable; these are the image's defaults.
# The shutdown timeout stays below Docker's default 10 s stop timeout, so a
# `docker stop` ends with the daemon's own graceful shutdown, not SIGKILL. With
# MATCHMAKER_WORKERS above 1 the supervisor waits up to the shutdown timeout
# + 20 s for a draining worker before killing it: give such a container a stop
# timeout above that (`docker stop -t 30`; the compose file gives 35 s).
ENV VIRTUAL_ENV=/opt/matchmaker \
    PATH=/opt/matchmaker/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MATCHMAKER_BIND=0.0.0.0 \
    MATCHMAKER_PORT=27950 \
    MATCHMAKER_HTTP_BIND=0.0.0.0 \
    MATCHMAKER_HTTP_PORT=27951 \
    MATCHMAKER_STORE=memory:// \
    MATCHMAKER_LOG_FORMAT=json \
    MATCHMAKER_SHUTDOWN_TIMEOUT=8
USER 10001:10001
EXPOSE 27950/udp 27951/tcp
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; b = os.environ.get('MATCHMAKER_HTTP_BIND', '0.0.0.0'); h = {'0.0.0.0': '127.0.0.1', '::': '::1'}.get(b, b); h = '[%s]' % h if ':' in h else h; r.urlopen('http://%s:%s/healthz' % (h, os.environ.get('MATCHMAKER_HTTP_PORT', '27951')), timeout=2)"]
STOPSIGNAL SIGTERM
# Exec form: the daemon is PID 1 and gets SIGTERM itself; it installs its own
# SIGTERM/SIGINT handlers. A single process starts no children. With
# MATCHMAKER_WORKERS the supervisor (PID 1) starts the worker processes, forwards
# the stop to them and waits for each itself, so they leave no zombies and no
# init is needed for them; an init (`docker run --init`) would only reap orphans
# of processes started in the container from outside (`docker exec`).
CMD ["matchmaker"]
