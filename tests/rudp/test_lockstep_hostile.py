"""Lockstep against hostile peers: inputs crafted to raise, to grow memory or to desynchronise.

Everything here is sans-IO on a stepped clock, or over loopback rudp; counters and
sizes are asserted, never wall-clock times.
"""

from __future__ import annotations

import msgpack
import pytest

from rudp.lockstep import ClientState, LockstepClient, LockstepConfig, LockstepHost
from rudp.lockstep import messages as m

CFG = LockstepConfig()

#: 1,000 nested one-element arrays in 1,001 bytes: msgpack accepts about 1,024 levels.
DEEP_TYPE = b"\x91" * 1000 + b"\x01"
#: A JOIN whose ``protocol`` field is 999 arrays deep.
DEEP_JOIN = b"\x94\x01" + b"\x91" * 999 + b"\x01" + b"\xa0\xa1x"


def _running_pair() -> tuple[LockstepHost[str], LockstepClient]:
    host = LockstepHost[str]()
    client = LockstepClient(name="a")
    for data in client.messages_to_send():
        host.receive("a", data, 0.0)
    host.start(0.0)
    for _, data in host.messages_to_send():
        client.receive(data, 0.0)
    assert client.state is ClientState.RUNNING
    return host, client


# ============================================================================ decoding


@pytest.mark.parametrize("data", [DEEP_TYPE, DEEP_JOIN], ids=["type", "join-protocol"])
def test_deep_nesting_is_malformed_not_an_exception(data: bytes) -> None:
    with pytest.raises(m.MalformedMessage):
        m.decode(data, CFG)
    host = LockstepHost[str]()
    host.receive("x", data, 0.0)
    assert host.stats.malformed == 1
    client = LockstepClient(name="a")
    client.receive(data, 0.0)
    assert client.stats.malformed == 1


@pytest.mark.parametrize(
    "fields",
    [
        [m.MsgType.JOIN, {"a": 1}, "", ""],  # maps never appear in lockstep messages
        [m.MsgType.COMMAND, 1, msgpack.ExtType(1, b"x")],
        [m.MsgType.DONETURN, [[[[[1]]]]], 5],
        [m.MsgType.LEFT, 1, [[[[1]]]]],
    ],
)
def test_values_of_the_wrong_shape_are_malformed(fields: list[object]) -> None:
    with pytest.raises(m.MalformedMessage) as info:
        m.decode(msgpack.packb(fields), CFG)
    assert "[" not in str(info.value)  # the peer's values are never echoed


def test_undecodable_msgpack_is_malformed() -> None:
    for data in (b"\xc1", b"\xdd\xff\xff\xff\xff", b"\xc7\x01\xff"):
        with pytest.raises(m.MalformedMessage):
            m.decode(data, CFG)
