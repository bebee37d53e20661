"""Matchmaker daemon: game hosts register over rudp, clients list and join them.

See docs/matchmaker.md.  `python -m matchmaker --help` lists every setting.

Which modules run where
-----------------------
Game side, what game hosts and game clients import; it pulls in none of the
daemon-side modules, nor prometheus_client or redis:

- `matchmaker.client`: `MatchmakerClient`, registration and keep-alive for a
  host, lists and introductions for a client.
- `matchmaker.serverinfo`: GETSVINFO/SVINFO straight between a client and a
  host, without the matchmaker (the host's query responder, the client's pinger).

Shared by both sides:

- `matchmaker.messages`: the wire schema, encoding and validated decoding.
- `matchmaker.addresses`: address normalisation and the bogon check.
- `matchmaker.transport`: the `Peer` seam to rudp connections.

Daemon side, the matchmaker process itself:

- `matchmaker.server` (lifecycle), `matchmaker.service` (connections to
  registry operations and replies), `matchmaker.registry` (memory and Redis),
  `matchmaker.listing` (filters, shuffle, paging), `matchmaker.ratelimit`;
- operations: `matchmaker.http`, `matchmaker.metrics`, `matchmaker.logging`;
- configuration and start-up: `matchmaker.settings`, `matchmaker.cli`,
  ``python -m matchmaker`` (`matchmaker.__main__`).
"""

from __future__ import annotations

from rudp import __version__  # one version for the whole distribution

__all__ = ["__version__"]
