"""``python -m matchmaker``: parse flags and environment, configure logging, run.

``python -m matchmaker keygen`` creates a connect-token issuing key instead
(``matchmaker.keys``).

Exit status: 0 after a clean shutdown (SIGTERM, SIGINT or SIGHUP), 1 if the
daemon failed (logged as ``matchmaker_failed`` with its traceback, or
``tasks_ignored_cancel`` when a task would not end), 2 for invalid settings (on
stderr), 3 when one of its ports cannot be bound (in use, not permitted, or an
address this machine does not have), logged as one ``port_unavailable`` line
naming the port.

SIGUSR1 writes the Python stack of every thread to stderr and changes nothing
else (`matchmaker.stopping.stacks_on_request`), in the daemon, a supervisor and
each of its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import structlog

import rudp
from matchmaker import logging as mm_logging
from matchmaker.cli import parse_args
from matchmaker.keys import keygen
from matchmaker.server import Matchmaker
from matchmaker.settings import Settings, SettingsError
from matchmaker.stopping import STOP_WITHIN, cancel_and_wait, stacks_on_request

log = structlog.get_logger("matchmaker")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_SETTINGS = 2
EXIT_PORT_UNAVAILABLE = 3

# What bind() fails with when the port, not the daemon, is the problem.
BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL})


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run the daemon; the exit status is one of the ``EXIT_*`` codes above."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["keygen"]:
        return keygen(args[1:])
    if argv is None:  # the process's own command line: the process is the daemon's
        stacks_on_request()
    try:
        settings = Settings.from_sources(parse_args(args), os.environ if env is None else env)
    except SettingsError as exc:
        print(f"matchmaker: {exc}", file=sys.stderr)
        return EXIT_BAD_SETTINGS
    mm_logging.configure(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from matchmaker.workers import Supervisor  # its workers run through run_daemon

        supervisor = Supervisor(settings, args, env)

        def supervise() -> int:
            try:
                return supervisor.run()
            finally:
                _stopped()  # as a lone daemon: a stop during its exit changes nothing

        return guarded(settings, supervise)
    return run_daemon(settings, lambda: Matchmaker(settings).run())


def run_daemon(settings: Settings, serve: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Run ``serve()`` on rudp's event loop; the exit status (`guarded`)."""

    def body() -> int:
        try:
            rudp.run(_to_the_end(serve()))
        finally:
            _stopped()
        return EXIT_OK

    return guarded(settings, body)


def _stopped() -> None:
    """The daemon has stopped: a stop signal from now on (a supervisor, or coreutils'
    ``timeout`` signalling the process group too) has nothing left to stop. Closing
    the loop put the default actions back, which would end the process with status
    143 or 130 instead of the one it is returning; they are ignored instead."""
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                signal.signal(sig, signal.SIG_IGN)


async def _to_the_end(serving: Coroutine[Any, Any, None]) -> None:
    """``serving``, then whatever still runs cancelled within a bound.

    asyncio's own teardown cancels each task left once and waits for it without
    a bound: one whose cancellation redis-py swallowed (`matchmaker.stopping`)
    kept the process alive for ever.  If some still run after the bound, the
    process ends at once, status 1, after ``tasks_ignored_cancel``."""
    failure: BaseException | None = None
    try:
        await serving
    except BaseException as exc:
        failure = exc
        raise
    finally:
        left = list(asyncio.all_tasks())  # less this one: cancel_and_wait leaves it out
        if left and not await cancel_and_wait(left, STOP_WITHIN, "exit"):
            if failure is not None and not isinstance(failure, asyncio.CancelledError):
                log.error("matchmaker_failed", exc_info=failure)  # before the abrupt exit
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(EXIT_FAILED)


def guarded(settings: Settings, body: Callable[[], int]) -> int:
    """``body()``'s exit status, or the one of the failure it raised (logged)."""
    try:
        return body()
    except OSError as exc:
        cause = bind_error(exc)
        if cause is None:
            log.exception("matchmaker_failed")
            return EXIT_FAILED
        # The daemon has closed its sockets: binding each again finds the one at fault.
        port = unbindable(settings, cause.errno) or "one of " + ", ".join(sockets(settings))
        # The system's words: uvloop's and rudp's own texts differ ("error while
        # attempting to bind on address ...", "cannot bind ..."), and port names it.
        words = os.strerror(cause.errno) if cause.errno is not None else cause.strerror
        log.error("port_unavailable", port=port, error=words)
        return EXIT_PORT_UNAVAILABLE
    except Exception:
        # In the configured format (a JSON line), not as a bare traceback on stderr.
        log.exception("matchmaker_failed")
        return EXIT_FAILED


def bind_error(exc: BaseException) -> OSError | None:
    """The bind failure behind ``exc``, if that is what it is. uvloop raises its own
    ``OSError("could not bind to local_addr ...")``, without an errno, from the
    system's (its context), so the chain is followed."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in BIND_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def sockets(settings: Settings) -> dict[str, tuple[str, int, socket.SocketKind]]:
    """The daemon's listening sockets: label -> (bind address, port, kind)."""
    found = {
        f"udp {_join(settings.bind, settings.port)} (--port)": (
            settings.bind,
            settings.port,
            socket.SOCK_DGRAM,
        ),
        f"tcp {_join(settings.http_bind, settings.http_port)} (--http-port)": (
            settings.http_bind,
            settings.http_port,
            socket.SOCK_STREAM,
        ),
    }
    if settings.master:
        label = f"udp {_join(settings.bind, settings.master_port)} (--master-port)"
        found[label] = (settings.bind, settings.master_port, socket.SOCK_DGRAM)
    return found


def unbindable(settings: Settings, error: int | None) -> str | None:
    """The label of the first of the daemon's sockets that bind() refuses with ``error``."""
    for label, (host, port, kind) in sockets(settings).items():
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=kind, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind) as probe:
                if kind == socket.SOCK_STREAM:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
                if family == socket.AF_INET6 and address[0] == "::":
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # as rudp does
                probe.bind(address)
        except OSError as exc:
            if exc.errno == error:
                return label
    return None


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
