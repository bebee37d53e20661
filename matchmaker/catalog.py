"""The visible hosts of one game or of every game, read from the registry's local index.

The registry answers a list request for one game (``Registry.query``); server
browsers that speak Valve's or Quake III's master protocols, and ``GET /servers``
without ``game``, may ask for every game.  `visible` answers both from the same
index, with the same filters (`listing.matches`), so every list agrees.
"""

from __future__ import annotations

import random
from dataclasses import replace

from matchmaker.listing import paginate, shuffled
from matchmaker.messages import ListFilter
from matchmaker.registry import Registry
from matchmaker.registry.base import HostRecord

EVERY_GAME = "-"
"""What a filter's ``game`` is set to when it asks for every game (no game is named
"-": game names are identifiers starting with a letter or digit)."""


def visible(registry: Registry, f: ListFilter) -> list[HostRecord]:
    """Visible records matching `f` (every game when ``f.game`` is `EVERY_GAME`),
    in index order, without `limit` applied."""
    if f.game != EVERY_GAME:
        return registry.visible(f)
    out: list[HostRecord] = []
    for game in registry.game_names():
        out.extend(registry.visible(replace(f, game=game)))
    return out


def every_game_list(
    registry: Registry,
    f: ListFilter,
    rng: random.Random,
    *,
    list_limit: int,
    page_hosts: int,
    page_per_ip: int,
) -> list[list[HostRecord]]:
    """A list of every game's hosts, as a list request for one game gets it: a random
    sample of at most ``min(f.limit, list_limit)``, in pages with the per-IP cap."""
    chosen = shuffled(visible(registry, replace(f, game=EVERY_GAME)), rng, min(f.limit, list_limit))
    return paginate(chosen, page_hosts, page_per_ip)
