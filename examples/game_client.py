"""A game client: finds a host through the matchmaker, joins it, plays for a while.

Start a matchmaker and ``examples/game_host.py`` first (see its docstring), then::

    python examples/game_client.py --name alice
    python examples/game_client.py --name bob --seconds 30

What it shows, in the order a real client does it:

1. **One UDP socket** (``rudp.open_endpoint``) for the matchmaker, the server browser and
   the game, so the address the matchmaker introduces is the one the game connects from.
2. **The server list**: ``list_servers(game=..., version=..., not_full=True)``.
3. **The server browser**: ``query_servers`` asks every listed host for its current info
   and measures the ping, all at once, straight to the hosts; the lowest ping wins.
4. **The introduction with a connect token** (``ticket``): the host is told our address
   and punches towards it; we get the host's key and a token the matchmaker signed for
   us and that host, with our player name as its user data. The client library checks
   the signature with the matchmaker's public key it pinned (``issuer_keys``), then
   ``ticket.connect()`` connects with Noise NK to the vouched key, presenting the token;
   our CONNECT, resent by rudp until it gets through, is our punch. The host's welcome
   echoes the user data it read from our token.
5. **Playing**: a hello, then moves (reliable-ordered, channel 0) ten times a second and a
   chat line (channel 2) while snapshots of the world arrive unreliable-sequenced on
   channel 1, then a graceful ``close()``.

It exits 0 when the game worked end to end: welcomed, its own position seen in a snapshot,
its chat line echoed back by the host; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys

import msgpack

import rudp
from matchmaker.client import MatchmakerClient, MatchmakerError
from matchmaker.keys import read_public_key
from matchmaker.serverinfo import query_servers
from matchmaker.tickets import UntrustedIntroduction

GAME = "arena"
VERSION = "1"
INPUT, SNAPSHOT, CHAT = 0, 1, 2  # channels


ISSUER_KEY_FILE = ".matchmaker-issuer.key.pub"


def add_issuer_arguments(parser: argparse.ArgumentParser) -> None:
    """The matchmaker's token-issuing public key, which the game ships: hex, or a file."""
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


class Play:
    """What this client saw of the game."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id: int | None = None
        self.token: bytes | None = None
        """The user data the host read from our connect token (its welcome)."""
        self.welcomed = asyncio.Event()
        self.snapshots = 0
        self.last_tick = 0
        self.position: tuple[int, int] | None = None
        self.chat_echoed = False
        self.stale = 0

    def on_message(self, msg: rudp.MessageReceived) -> None:
        event = msgpack.unpackb(msg.data)
        kind = event.get("t")
        if kind == "welcome":
            self.id = event["id"]
            self.token = event.get("token")
            self.welcomed.set()
        elif kind == "snap" and msg.channel == SNAPSHOT:
            # Unreliable-sequenced: ticks only go up; a lost one is simply skipped.
            if event["tick"] <= self.last_tick:
                self.stale += 1  # never, unless the delivery mode is broken
                return
            self.last_tick = event["tick"]
            self.snapshots += 1
            for pid, x, y in event["players"]:
                if pid == self.id:
                    self.position = (x, y)
        elif kind == "chat":
            log(f"[chat] {event['from']}: {event['text']}")
            if event["from"] == self.name:
                self.chat_echoed = True


async def pick_host(
    mm: MatchmakerClient, endpoint: rudp.Server, timeout: float
) -> tuple[str, int] | None:
    hosts = await mm.list_servers(game=GAME, version=VERSION, not_full=True)
    if not hosts:
        return None
    statuses = await query_servers(endpoint, [h.address for h in hosts], timeout=timeout)
    answered = [s for s in statuses if s.info is not None and s.ping is not None]
    for s in answered:
        info = s.info
        assert info is not None and s.ping is not None
        log(
            f"  {info.name!r} at {s.address.ip}:{s.address.port}: "
            f"{info.players}/{info.max_players} players, ping {s.ping * 1000:.1f} ms"
        )
    if not answered:
        return None
    best = min(answered, key=lambda s: s.ping or 0.0)
    return best.address.ip, best.address.port


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--name", default="player", help="player name (also the chat sender)")
    parser.add_argument("--matchmaker", default="127.0.0.1:27950", help="host:port")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to play")
    parser.add_argument("--lan-ip", help="this machine's LAN address, for a host behind our NAT")
    parser.add_argument("--seed", type=int, help="seed of the random walk")
    parser.add_argument(
        "--query-timeout", type=float, default=1.0, help="seconds to wait for the hosts' answers"
    )
    add_issuer_arguments(parser)
    args = parser.parse_args(argv)
    issuer = issuer_key(parser, args)
    # The client library's own lines (reconnections, re-registrations) go where ours
    # do, in order, each prefixed by its logger's name.
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s: %(message)s")
    mm_host, _, mm_port = args.matchmaker.rpartition(":")
    walk = random.Random(args.seed)
    user_data = f"name={args.name}".encode()  # what our connect token tells the host

    endpoint = await rudp.open_endpoint("0.0.0.0", 0)
    mm = MatchmakerClient.to(mm_host, int(mm_port), via=endpoint, issuer_keys=[issuer])
    play = Play(args.name)
    try:
        try:
            host = await pick_host(mm, endpoint, args.query_timeout)
        except (TimeoutError, ConnectionError, rudp.RudpError) as exc:
            log(f"no answer from the matchmaker at {args.matchmaker}: {exc!r}")
            return 1
        if host is None:
            log(f"no {GAME} host answered")
            return 1
        lan = (args.lan_ip, endpoint.address[1]) if args.lan_ip else None
        ticket = await mm.ticket(host, lan=lan, user_data=user_data)
        # Behind the host's own NAT its LAN address first, then its public one.
        conn = await ticket.connect(endpoint)
        target_ip, target_port = conn.remote_address[:2]
        log(f"connected to {target_ip}:{target_port}, key {ticket.host_key.hex()[:16]}...")

        conn.set_receiver(play.on_message)  # handled as it arrives, no task per message
        conn.send(msgpack.packb({"t": "hello", "name": args.name}))
        await asyncio.wait_for(play.welcomed.wait(), 5.0)
        log(f"joined with a token for user data {user_data!r}; the host read {play.token!r}")
        conn.send(msgpack.packb({"t": "chat", "text": f"hello from {args.name}"}), channel=CHAT)
        loop = asyncio.get_running_loop()
        end = loop.time() + args.seconds
        while loop.time() < end and not conn.closed:
            move = {"t": "move", "dx": walk.choice((-1, 0, 1)), "dy": walk.choice((-1, 0, 1))}
            conn.send(msgpack.packb(move), channel=INPUT)
            await asyncio.sleep(0.1)
        # A slow machine may not have shown us yet: give the checks below a while.
        patience = loop.time() + 10.0
        while (play.position is None or not play.chat_echoed) and not conn.closed:
            if loop.time() > patience:
                break
            await asyncio.sleep(0.05)
        await conn.drain()
        ended = conn.disconnected
        if ended is not None:
            log(f"the host ended the game: {ended.reason.value} {ended.text}")
        stats = conn.stats
        log(
            f"played as #{play.id}: {play.snapshots} snapshots (last tick {play.last_tick}), "
            f"position {play.position}, rtt {stats.srtt * 1000:.1f} ms"
        )
        await conn.close(code=1000, text="bye")
    except (MatchmakerError, UntrustedIntroduction, rudp.RudpError, TimeoutError) as exc:
        log(f"failed: {exc!r}")
        return 1
    finally:
        await mm.close()
        await endpoint.close()
    if play.stale:
        log(f"{play.stale} stale snapshots were delivered")
    joined = play.token == user_data  # the host admitted us on our token
    return 0 if joined and play.position is not None and play.chat_echoed and not play.stale else 1


if __name__ == "__main__":
    sys.exit(rudp.run(main()))
