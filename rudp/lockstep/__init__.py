"""Host-authoritative lockstep over rudp (the article's client-server variant).

Sans-IO: :class:`LockstepHost` and :class:`LockstepClient` take ``now`` and
message bytes and hand back messages to send, events, and one deadline; they
never touch sockets, clocks or asyncio. See docs/lockstep.md and the module
docstrings of :mod:`rudp.lockstep.host` and :mod:`rudp.lockstep.client`.
"""

from __future__ import annotations

from rudp.lockstep.client import ClientState, ClientStats, LockstepClient, Turn
from rudp.lockstep.clock import Advance, TurnClock
from rudp.lockstep.config import PROTOCOL_VERSION, LockstepConfig
from rudp.lockstep.events import (
    ClientJoined,
    ClientLeft,
    ClientResponsive,
    ClientUnresponsive,
    DesyncDetected,
    Event,
    FaultReason,
    GameStarted,
    HostFaulted,
    HostResponsive,
    HostUnresponsive,
    Joined,
    JoinRefused,
    TimeDropped,
    TurnsExhausted,
    TurnsReady,
)
from rudp.lockstep.host import ClientRecord, HostState, HostStats, LockstepHost
from rudp.lockstep.messages import ClientStatus, LeaveReason, RefuseReason

__all__ = [
    "PROTOCOL_VERSION",
    "Advance",
    "ClientJoined",
    "ClientLeft",
    "ClientRecord",
    "ClientResponsive",
    "ClientState",
    "ClientStats",
    "ClientStatus",
    "ClientUnresponsive",
    "DesyncDetected",
    "Event",
    "FaultReason",
    "GameStarted",
    "HostFaulted",
    "HostResponsive",
    "HostState",
    "HostStats",
    "HostUnresponsive",
    "JoinRefused",
    "Joined",
    "LeaveReason",
    "LockstepClient",
    "LockstepConfig",
    "LockstepHost",
    "RefuseReason",
    "TimeDropped",
    "Turn",
    "TurnClock",
    "TurnsExhausted",
    "TurnsReady",
]
