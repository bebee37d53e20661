"""A game host seen by server browsers: A2S answers fed from its matchmaker listing.

`serve_browsers` is the one call a host makes: from then on A2S_INFO publishes
the `HostInfo` it registers with the matchmaker (``MatchmakerClient.host_info``
is the natural source), A2S_PLAYER the player list the game supplies, and
A2S_RULES the listing's other fields plus whatever rules the game adds.  The
packets, challenges and amplification rules are ``rudp.a2s``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

import rudp
from matchmaker.messages import HostInfo
from rudp.a2s import Player, Responder, ServerInfo, serve_a2s

InfoSource = Callable[[], HostInfo | None]

ENVIRONMENT = {"win32": "w", "darwin": "m"}.get(sys.platform, "l")


def a2s_info(host: HostInfo, port: int | None = None, *, app_id: int = 0) -> ServerInfo:
    """What A2S_INFO says about a listed host: the game is both folder and game name
    (Steam's ``\\gamedir\\`` filter and the matchmaker's ``game`` filter agree), the
    tags are the keywords."""
    return ServerInfo(
        name=host.name,
        map=host.map,
        folder=host.game,
        game=host.game,
        app_id=app_id,
        players=host.players,
        max_players=host.max_players,
        environment=ENVIRONMENT,
        password=host.password,
        version=host.version,
        port=port,
        keywords=",".join(host.tags),
    )


def listing_rules(host: HostInfo) -> dict[str, str]:
    """The listed fields A2S_INFO has no room for, as A2S rules."""
    rules = {"game": host.game, "version": host.version}
    if host.region:
        rules["region"] = host.region
    if host.tags:
        rules["tags"] = ",".join(host.tags)
    return rules


def serve_browsers(
    server: rudp.Server,
    info: InfoSource | HostInfo,
    *,
    players: Callable[[], Sequence[Player]] | None = None,
    rules: Callable[[], Mapping[str, str]] | None = None,
    app_id: int = 0,
) -> Responder:
    """Answer A2S queries on the host's rudp socket from its listing (None: silent)."""
    source: InfoSource = (lambda: info) if isinstance(info, HostInfo) else info
    port = server.address[1]

    def current() -> ServerInfo | None:
        host = source()
        return None if host is None else a2s_info(host, port, app_id=app_id)

    def all_rules() -> Mapping[str, str]:
        host = source()
        merged = listing_rules(host) if host is not None else {}
        if rules is not None:
            merged.update(rules())
        return merged

    return serve_a2s(server, current, players=players, rules=all_rules)
