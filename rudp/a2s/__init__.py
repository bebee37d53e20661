"""Valve's A2S server queries, answered on a game host's rudp socket.

Server browsers (Steam's, qstat, python-a2s, gamedig, hosting providers' checks)
ask a game server for its info, players and rules with A2S queries.  Their
datagrams start with ``FF FF FF FF``, which no rudp packet does, so they can share
the game port: `serve_a2s` (in ``rudp.a2s.aio``) installs a `Responder` as the
server's foreign-datagram handler.  The rules (challenges, amplification, split
replies) live in the sans-IO `Responder`; the packets in ``rudp.a2s.packets``.
"""

from rudp.a2s.aio import serve_a2s
from rudp.a2s.packets import Player, ServerInfo
from rudp.a2s.responder import Responder

__all__ = ["Player", "Responder", "ServerInfo", "serve_a2s"]
