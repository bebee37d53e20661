"""`serve_a2s`: a `Responder` on a rudp server's socket, with the clock and a key."""

from __future__ import annotations

import os
from time import monotonic
from typing import Any

from rudp.a2s.packets import ServerInfo
from rudp.a2s.responder import InfoSource, PlayerSource, Responder, RuleSource
from rudp.aio.server import Server
from rudp.errors import EndpointClosed


def serve_a2s(
    server: Server,
    info: InfoSource | ServerInfo,
    *,
    players: PlayerSource | None = None,
    rules: RuleSource | None = None,
    challenge_period: float = 30.0,
) -> Responder:
    """Answer A2S_INFO, A2S_PLAYER and A2S_RULES on `server`'s socket; returns the responder.

    `info` is a `ServerInfo` or a function returning the current one (None: stay
    silent); `players` and `rules` are functions the game supplies.  rudp traffic
    on the socket is not affected: only datagrams starting with ``FF FF FF FF``
    reach the responder.  ``server.on_foreign = None`` turns it off.  A server
    whose close has begun is refused (``EndpointClosed``): nothing would be answered.
    """
    if server.endpoint.is_closing:
        state = "closed" if server.endpoint.is_closed else "closing"
        raise EndpointClosed(f"serve_a2s() on a server that is {state}: nothing would answer")
    responder = Responder(  # which checks every argument before on_foreign is set
        info,
        key=os.urandom(32),
        players=players,
        rules=rules,
        challenge_period=challenge_period,
        max_datagram=server.endpoint.config.base_datagram_size,
    )

    endpoint = server.endpoint

    def handle(data: bytes, address: Any) -> list[bytes]:
        if endpoint.is_closing:  # going away: browsers must not list it as hosting
            return responder.not_hosting()
        return responder.datagram_received(data, address, monotonic())

    server.on_foreign = handle
    return responder
