"""The collector's settings for a daemon with a large registry (matchmaker/gctuning.py)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from matchmaker import server
from matchmaker.gctuning import GC_THRESHOLDS, tune_gc
from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import settings


@pytest.fixture
def restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_tune_gc_freezes_the_heap_and_raises_the_thresholds(restore_gc: None) -> None:
    tune_gc()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == GC_THRESHOLDS
    assert GC_THRESHOLDS[0] > 700 and GC_THRESHOLDS[2] > 10  # CPython's defaults


async def test_the_daemon_tunes_the_collector_once_started(
    restore_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    mm = Matchmaker(settings())
    monkeypatch.setattr(server, "tune_gc", lambda: calls.append(mm._udp is not None))
    stop = asyncio.Event()
    run = asyncio.create_task(mm.run(stop))
    for _ in range(500):  # bounded: 5 s
        if calls or run.done():
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(run, 10)
    assert calls == [True]  # after start(): the sockets exist
