"""A stopping replica: it takes no new connection and refuses registrations with
``shutting_down`` from the moment its shutdown begins."""

from __future__ import annotations

import asyncio

from matchmaker.addresses import Address
from matchmaker.messages import Error, ErrorReason, Register
from tests.matchmaker.fakes import settle
from tests.matchmaker.helpers import Harness, info, pub


async def test_a_stopping_replica_refuses_newcomers_and_registrations() -> None:
    h = Harness()
    early = h.connect(pub(1))
    await settle()  # connected before the stop
    h.service.stop_accepting()
    early.send(Register(request_id=7, host=info()))
    refused = await early.recv()
    assert isinstance(refused, Error) and refused.reason is ErrorReason.SHUTTING_DOWN
    assert refused.request_id == 7 and "another replica" in refused.detail
    late = h.connect(pub(2))
    late.send(Register(request_id=8, host=info()))
    assert await asyncio.wait_for(late.conn.inbox.get(), 2) is None  # closed, not served
    assert h.registry.get(Address(pub(2), 27960)) is None


async def test_close_all_takes_no_new_connection_after_it_began() -> None:
    h = Harness()
    await h.service.close_all()
    late = h.connect(pub(2))
    late.send(Register(request_id=1, host=info()))
    assert await asyncio.wait_for(late.conn.inbox.get(), 2) is None
    assert h.registry.get(Address(pub(2), 27960)) is None
