"""A game host: players join it over rudp, and it lists itself on a matchmaker.

Run a matchmaker that lists loopback hosts, then a host, then clients::

    MATCHMAKER_ALLOW_PRIVATE=1 make run
    # or, without make: an issuing key, then the daemon that signs with it
    #   python -m matchmaker keygen --out .matchmaker-issuer.key --if-absent
    #   python -m matchmaker --allow-private --issuer-key-file .matchmaker-issuer.key
    python examples/game_host.py --name "Arena 1"
    python examples/game_client.py --name alice   # as many as you like, in other shells

The game is a tiny arena: each player walks around a 100 x 100 field. What it shows:

* **Only players the matchmaker sent.** The host requires a connect token
  (``Config(token_issuers=...)``): the matchmaker signs one for every introduction, bound
  to the client's handshake key and to this host's key, and the host checks it alone with
  the matchmaker's public key (``--issuer-key-file``, by default the
  ``.matchmaker-issuer.key.pub`` that ``make run`` wrote). A plain ``rudp.connect()`` is
  refused with "this server requires a connect token". The token's user data (what the
  client asked to be known as) arrives as ``conn.peer_identity``.
* **A key clients can check.** The host registers its static public key
  (``register(key=server.public_key)``); clients connect with Noise NK to the key the
  matchmaker vouched for, so no one else can answer in the host's place.

* **One UDP socket for everything.** Players connect to ``rudp.serve``'s socket, and the
  matchmaker client talks *through* it (``MatchmakerClient.to(..., via=server)``), so the
  address the matchmaker observes and lists is the game port, and a NAT in front of the
  host keeps one mapping for both.
* **Staying listed**: ``register()`` once; the client library sends heartbeats and
  re-registers by itself (matchmaker restart, failover). The player count is kept up to
  date with ``update(players=...)``, at most once a second (updates are rate limited).
* **Server browsers** ask the host directly for its info and ping (``serve_info``),
  without going through the matchmaker; tools that speak Valve's A2S queries (qstat,
  python-a2s, Steam-style browsers and trackers) get the same info, the player list and
  rules on the same port (``serve_browsers``)::

      quakestat -a2s 127.0.0.1:27960 -P -R
* **Introductions** (NAT traversal): when a client asks the matchmaker to join, the host
  is told the client's address and sends one datagram towards it from the game socket,
  which opens the host's NAT for the client's CONNECT.
* **Channels and delivery modes** per message kind: inputs are reliable-ordered on
  channel 0, chat reliable-ordered on channel 2 (a lost chat line never holds up an
  input), and the 20 Hz world snapshots unreliable-sequenced on channel 1: a lost
  snapshot is not resent (the next one supersedes it) and a late one is dropped.

Messages are msgpack maps with a ``"t"`` (type) key; see ``examples/game_client.py`` for
the other side. ``--exit-after N`` stops the host after N players have come and gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack

import rudp
import rudp.a2s
from matchmaker.browsers import serve_browsers
from matchmaker.client import MatchmakerClient, MatchmakerError
from matchmaker.keys import read_public_key
from matchmaker.serverinfo import serve_info

GAME = "arena"
VERSION = "1"
FIELD = 100
TICK = 0.05  # 20 snapshots per second
INPUT, SNAPSHOT, CHAT = 0, 1, 2  # channels


@dataclass
class Player:
    id: int
    name: str
    conn: rudp.Connection
    x: int = FIELD // 2
    y: int = FIELD // 2
    joined: float = field(default_factory=time.monotonic)


@dataclass
class Arena:
    max_players: int
    players: dict[int, Player] = field(default_factory=dict)
    next_id: int = 1
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # the player count moved
    left: int = 0

    def broadcast(
        self, message: Mapping[str, object], *, channel: int, delivery: rudp.Delivery | None = None
    ) -> None:
        data = msgpack.packb(message)
        for player in list(self.players.values()):
            with contextlib.suppress(rudp.ConnectionClosed, rudp.SendQueueFull):
                player.conn.send(data, channel=channel, delivery=delivery)


ISSUER_KEY_FILE = ".matchmaker-issuer.key.pub"


def add_issuer_arguments(parser: argparse.ArgumentParser) -> None:
    """The matchmaker's token-issuing public key: hex, or a file holding it."""
    parser.add_argument("--issuer-key", help="the matchmaker's issuing public key, in hex")
    parser.add_argument(
        "--issuer-key-file",
        default=ISSUER_KEY_FILE,
        help="file with that key in hex (make run writes it)",
    )


def issuer_key(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bytes:
    try:
        if args.issuer_key:
            return bytes.fromhex(args.issuer_key)
        return read_public_key(args.issuer_key_file)
    except ValueError as exc:
        parser.error(
            f"the matchmaker's issuing key: {exc} (give --issuer-key or --issuer-key-file)"
        )


def log(text: str) -> None:
    print(text, flush=True)


async def play(arena: Arena, conn: rudp.Connection) -> None:
    """One player's connection, from its hello to its end."""
    hello = msgpack.unpackb((await conn.recv()).data)
    if hello.get("t") != "hello" or not isinstance(hello.get("name"), str):
        await conn.close(code=4000, text="expected hello")
        return
    if len(arena.players) >= arena.max_players:
        await conn.close(code=4001, text="server full")
        return
    identity = conn.peer_identity  # the verified token: who the matchmaker sent us
    assert identity is not None  # this host requires tokens: no connection without one
    player = Player(arena.next_id, hello["name"][:32], conn)
    arena.next_id += 1
    arena.players[player.id] = player
    arena.changed.set()
    log(
        f"joined: {player.name} (#{player.id}) from {conn.remote_address[0]}, "
        f"token client id {identity.client_id:#x}, user data {identity.user_data!r}"
    )
    welcome = {"t": "welcome", "id": player.id, "field": FIELD, "token": identity.user_data}
    conn.send(msgpack.packb(welcome))
    arena.broadcast({"t": "chat", "from": "host", "text": f"{player.name} joined"}, channel=CHAT)
    try:
        async for msg in conn:  # ends when the player leaves or times out
            event = msgpack.unpackb(msg.data)
            if msg.channel == INPUT and event.get("t") == "move":
                dx, dy = int(event["dx"]), int(event["dy"])
                player.x = min(FIELD - 1, max(0, player.x + max(-1, min(1, dx))))
                player.y = min(FIELD - 1, max(0, player.y + max(-1, min(1, dy))))
            elif msg.channel == CHAT and event.get("t") == "chat":
                line = {"t": "chat", "from": player.name, "text": str(event["text"])[:200]}
                arena.broadcast(line, channel=CHAT)
    except (ValueError, KeyError, TypeError, msgpack.UnpackException):
        await conn.close(code=4002, text="bad message")  # a broken or hostile client
    finally:
        del arena.players[player.id]
        arena.left += 1
        arena.changed.set()
        end = conn.disconnected
        log(f"left: {player.name} (#{player.id}): {end.reason.value if end else 'closing'}")


def a2s_players(arena: Arena) -> list[rudp.a2s.Player]:
    """The player list A2S browsers show: name and time on the server."""
    now = time.monotonic()
    return [rudp.a2s.Player(p.name, 0, now - p.joined) for p in arena.players.values()]


async def snapshots(arena: Arena) -> None:
    """The world, 20 times a second, to everyone: newest wins, nothing resent."""
    tick = 0
    while True:
        await asyncio.sleep(TICK)
        tick += 1
        positions = [[p.id, p.x, p.y] for p in arena.players.values()]
        arena.broadcast(
            {"t": "snap", "tick": tick, "players": positions},
            channel=SNAPSHOT,
            delivery=rudp.Delivery.UNRELIABLE_SEQUENCED,
        )


async def publish_player_count(arena: Arena, mm: MatchmakerClient) -> None:
    """Keep the listed player count current, at most one update a second."""
    while True:
        await arena.changed.wait()
        arena.changed.clear()
        try:
            await mm.update(players=len(arena.players))
        except (MatchmakerError, TimeoutError, ConnectionError) as exc:
            log(f"player count not updated: {exc!r}")  # the next change tries again
        await asyncio.sleep(1.0)


async def punch(server: rudp.Server, mm: MatchmakerClient) -> None:
    """Answer introductions: one datagram towards the client opens our NAT for it."""
    while True:
        intro = await mm.introductions.get()
        log(f"introduced to {intro.peer.ip}:{intro.peer.port}")
        for peer in filter(None, (intro.peer, intro.peer_lan)):
            # An unconnected query nobody answers: all we need is the datagram leaving.
            with contextlib.suppress(TimeoutError, OSError, rudp.RudpError):
                await server.query((peer.ip, peer.port), b"punch", 0.05)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--name", default="Arena", help="listed name")
    parser.add_argument("--bind", default="0.0.0.0", help="address of the game socket")
    parser.add_argument("--port", type=int, default=27960, help="game port (0: any free port)")
    parser.add_argument("--matchmaker", default="127.0.0.1:27950", help="host:port")
    parser.add_argument("--max-players", type=int, default=8, help="listed player limit")
    parser.add_argument("--lan-ip", help="this machine's LAN address, for clients behind our NAT")
    parser.add_argument("--exit-after", type=int, help="stop after this many players left")
    add_issuer_arguments(parser)
    args = parser.parse_args(argv)
    issuer = issuer_key(parser, args)
    # The client library's own lines (reconnections, re-registrations) go where ours
    # do, in order, each prefixed by its logger's name.
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s: %(message)s")
    mm_host, _, mm_port = args.matchmaker.rpartition(":")

    arena = Arena(args.max_players)
    # A static key clients authenticate us with, and the matchmaker's key whose tokens we
    # require. A real host keeps its key across restarts (docs/security.md).
    config = rudp.Config(static_key=rudp.generate_key(), token_issuers=(issuer,))
    server = await rudp.serve(lambda conn: play(arena, conn), args.bind, args.port, config=config)
    port = server.address[1]
    mm = MatchmakerClient.to(mm_host, int(mm_port), via=server)
    tasks: list[asyncio.Task[None]] = []
    try:
        public = await mm.register(
            name=args.name,
            game=GAME,
            version=VERSION,
            max_players=args.max_players,
            map="field",
            lan=(args.lan_ip, port) if args.lan_ip else None,
            key=server.public_key,
        )
        serve_info(server, lambda: mm.host_info)  # server browsers ask us directly
        serve_browsers(server, lambda: mm.host_info, players=lambda: a2s_players(arena))
        log(f"listed as {public.ip}:{public.port} (game socket {server.address[0]}:{port})")
        tasks = [
            asyncio.create_task(snapshots(arena)),
            asyncio.create_task(publish_player_count(arena, mm)),
            asyncio.create_task(punch(server, mm)),
        ]
        while args.exit_after is None or arena.left < args.exit_after:
            await asyncio.sleep(0.1)
        return 0
    except MatchmakerError as exc:
        log(f"the matchmaker refused: {exc}")
        return 1
    except (TimeoutError, ConnectionError, rudp.RudpError) as exc:
        log(f"no answer from the matchmaker at {args.matchmaker}: {exc!r}")
        return 1
    finally:
        for task in tasks:
            task.cancel()
        await mm.close()  # unlisted at once
        await server.close()  # every player gets a graceful close


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(rudp.run(main()))
