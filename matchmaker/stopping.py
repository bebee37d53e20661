"""Stopping background tasks within a bound, whatever the libraries under them do.

A cancelled task is expected to end at its next ``await``.  Not every library
lets it: redis-py (8.1, Python 3.11) turns a cancellation that lands while it
connects into a connection error, which its own retry loop catches, and the
task goes on with a fresh connection, one cancel request still pending and
never raised.  A daemon that then waited for that task without a bound never
exited (a worker outliving its supervisor's SIGKILL).

`cancel_and_wait` therefore cancels again while it waits (the second request
lands at a later ``await``, past the connect), and after ``within`` seconds
gives up on what is still running: it logs ``tasks_ignored_cancel`` with their
names and returns, so that a stop always ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import structlog

log = structlog.get_logger(__name__)

RECANCEL_EVERY = 0.5
"""Seconds between two cancel requests to a task still running."""

STOP_WITHIN = 5.0
"""Seconds a daemon's stop waits for its background tasks before abandoning them."""


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]], within: float, what: str) -> bool:
    """Cancel ``tasks`` and wait until they end, at most ``within`` seconds.

    True when all ended; False when some were abandoned (logged, an error).
    Their results and exceptions are consumed, as ``gather(return_exceptions=True)``
    does.
    """
    if within <= 0:
        raise ValueError(f"within must be positive, not {within!r}")
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
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" later
    if pending:
        names = sorted(t.get_name() for t in pending)
        log.error("tasks_ignored_cancel", what=what, tasks=names, seconds=within)
        return False
    return True
