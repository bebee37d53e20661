"""Network simulator: make loopback behave like a real, lossy, jittery network.

Loopback never loses, reorders or corrupts datagrams, and kernel netem is not always available,
so rudp ships its own impairment layer (as GameNetworkingSockets and yojimbo do):

* :mod:`rudp.netsim.conditioner` -- :class:`LinkConditioner`, a sans-IO model of one direction of
  a link (loss, Gilbert-Elliott burst loss, latency, jitter, duplication, reordering, corruption,
  bandwidth with a drop-tail queue), driven by an explicit clock and a seeded RNG;
* :mod:`rudp.netsim.aio` -- :class:`ConditionedPipe`, the same on an asyncio event loop, to put in
  front of a socket;
* :mod:`rudp.netsim.proxy` -- :func:`start_proxy`, a UDP proxy that impairs traffic between any
  UDP client and server; ``python -m rudp.netsim --help`` runs it from the command line.

See docs/netsim.md.
"""

from __future__ import annotations

from rudp.netsim.aio import ConditionedPipe
from rudp.netsim.conditioner import GilbertElliott, LinkConditioner, LinkProfile, LinkStats
from rudp.netsim.proxy import Proxy, ProxyStats, format_address, parse_address, start_proxy

__all__ = [
    "ConditionedPipe",
    "GilbertElliott",
    "LinkConditioner",
    "LinkProfile",
    "LinkStats",
    "Proxy",
    "ProxyStats",
    "format_address",
    "parse_address",
    "start_proxy",
]
