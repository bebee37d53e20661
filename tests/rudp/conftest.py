from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator, Mapping

import pytest

from rudp.aio.loop import new_event_loop

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


SAME_TURN_REBIND = "test_server_restart_is_noticed_within_a_round_trip"
DEAFENED = (
    "test_drain_returns_once_unreliable_messages_have_left",
    "test_a_waiter_on_a_superseded_message_wakes_in_the_same_turn",
)


def without_add_reader(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    """`loop`, refusing ``add_reader`` as Windows' Proactor loop does: rudp.aio then
    reads and writes through a DatagramProtocol (rudp/aio/protocol.py)."""

    def refuse(*args: object) -> None:
        raise NotImplementedError

    loop.add_reader = refuse  # type: ignore[method-assign]
    return loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, LoopFactory]:
    """The asyncio-API tests run on both loops, each also without ``add_reader``;
    everything else on the default loop."""
    if item.path.name == "test_aio.py":
        loops = {
            "asyncio": lambda: new_event_loop(use_uvloop=False),
            "uvloop": lambda: new_event_loop(use_uvloop=True),
            "asyncio-protocol": lambda: without_add_reader(new_event_loop(use_uvloop=False)),
            "uvloop-protocol": lambda: without_add_reader(new_event_loop(use_uvloop=True)),
        }
        if item.name.startswith(SAME_TURN_REBIND):
            # uvloop's datagram transport holds a duplicate of the socket until the
            # next loop iteration: its port cannot be bound again in the same turn.
            del loops["uvloop-protocol"]
        if item.name.startswith(DEAFENED):
            # They deafen the server with loop.remove_reader(), which only the
            # add_reader path can be deafened with.
            del loops["asyncio-protocol"], loops["uvloop-protocol"]
        return loops
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cyclic collector off for the test (what it would free is then asked)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        if enabled:
            gc.enable()
