"""Stopping background tasks within a bound, whatever the libraries under them do.

A cancelled task is expected to end at its next ``await``.  Not every library
lets it.  redis-py (8.1, on Python 3.11) loses cancellations two ways: one
that lands while it connects becomes a connection error, which its own retry
loop catches, and the task goes on with a fresh connection; and with a socket
timeout set it sends each command through ``asyncio.wait_for``, which on 3.11
drops a cancellation that lands as the send completes (about one in two for a
loop of commands; the registry sets no socket timeout for that reason, and
bounds each call itself).  A daemon that then waited for such a task without a
bound never exited (a worker outliving its supervisor's SIGKILL).

Hence three habits: every background loop also looks at a flag between two
rounds; `cancel_and_wait` cancels again while it waits (the next request lands
at a later ``await``) and gives up after ``within`` seconds, logging
``tasks_ignored_cancel`` with the tasks' names; and the daemon's last step
(`matchmaker.__main__`) does the same for whatever is left, ending the process
with status 1 rather than waiting for ever as asyncio's own teardown would.

For a stop that still hangs, `stacks_on_request` makes SIGUSR1 write the Python
stack of every thread to stderr: the daemon, the supervisor and each worker
install it first thing.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
from collections.abc import Collection
from typing import Any

import structlog

log = structlog.get_logger(__name__)

RECANCEL_EVERY = 0.5
"""Seconds between two cancel requests to a task still running."""

STOP_WITHIN = 3.0
"""Seconds each stage of a stop (HTTP clients, background tasks, the registry's
tasks, whatever is left at exit) waits for its tasks before abandoning them."""


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]], within: float, what: str) -> bool:
    """Cancel ``tasks`` and wait until they end, at most ``within`` seconds.

    True when all ended; False when some were abandoned (logged, an error).
    Their results and exceptions are consumed, as ``gather(return_exceptions=True)``
    does, and an exception other than the cancellation is logged
    (``task_failed_at_stop``).  The calling task is left out of ``tasks``.
    """
    if within <= 0:
        raise ValueError(f"within must be positive, not {within!r}")
    me = asyncio.current_task()
    tasks = [t for t in tasks if t is not me]  # never itself
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_EVERY, left))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            # Retrieved (no "exception was never retrieved" later), and told.
            log.warning("task_failed_at_stop", what=what, task=task.get_name(),
                        error=repr(task.exception()))  # fmt: skip
    if pending:
        names = sorted(t.get_name() for t in pending)
        log.error("tasks_ignored_cancel", what=what, tasks=names, seconds=within)
        return False
    return True


def stacks_on_request() -> None:
    """SIGUSR1 writes every thread's Python stack to stderr and changes nothing
    else (``faulthandler``): what to send a process that seems stuck, before
    killing it."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
