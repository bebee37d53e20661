from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from rudp.aio.loop import new_event_loop

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    """The asyncio-API tests run on both loops; everything else on the default one."""
    if item.path.name == "test_aio.py":
        return {
            "asyncio": lambda: new_event_loop(use_uvloop=False),
            "uvloop": lambda: new_event_loop(use_uvloop=True),
        }
    return {"asyncio": asyncio.new_event_loop}
