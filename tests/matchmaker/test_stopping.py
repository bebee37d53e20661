"""Stopping background tasks within a bound (`matchmaker.stopping`)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import structlog

from matchmaker import stopping
from matchmaker.stopping import cancel_and_wait


@pytest.fixture(autouse=True)
def quick_recancel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stopping, "RECANCEL_EVERY", 0.02)


async def test_a_task_that_swallows_one_cancel_is_still_stopped() -> None:
    # What redis-py does when a cancellation lands while it connects.
    swallowed = 0

    async def connects_again() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    task = asyncio.create_task(connects_again())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], 5.0, "test")
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_never_ends_is_abandoned_and_logged() -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.create_task(deaf(), name="deaf")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with structlog.testing.capture_logs() as logs:
        assert not await cancel_and_wait([task], 0.2, "test")
    assert loop.time() - started < 5.0
    assert [(e["event"], e["tasks"], e["log_level"]) for e in logs] == [
        ("tasks_ignored_cancel", ["deaf"], "error")
    ]
    release.set()
    task.cancel()
    await asyncio.wait([task])


async def test_failures_are_consumed_and_finished_tasks_are_left_alone() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def returns() -> int:
        return 1

    failed, done = asyncio.create_task(fails()), asyncio.create_task(returns())
    await asyncio.wait([failed, done])
    with structlog.testing.capture_logs() as logs:
        assert await cancel_and_wait([failed, done], 1.0, "test")
    assert not done.cancelled() and done.result() == 1
    assert isinstance(failed.exception(), RuntimeError)
    assert [(e["event"], e["error"]) for e in logs] == [
        ("task_failed_at_stop", "RuntimeError('boom')")
    ]


async def test_the_calling_task_is_left_out() -> None:
    me = asyncio.current_task()
    assert me is not None
    assert await cancel_and_wait([me], 1.0, "test")
    await asyncio.sleep(0)  # not cancelled: this await returns
    assert me.cancelling() == 0


async def test_a_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="within must be positive"):
        await cancel_and_wait([], 0, "test")
