"""What a handshake costs a server: CPU per completed handshake, and so how many a
single core completes per second, with the sans-IO core (no sockets, no event loop).

N clients, each its own ``Endpoint`` at its own address, connect to one server
``Endpoint`` in one process; the datagrams go straight from one to the other.
Only the time spent inside the server's calls (``receive_datagram``,
``datagrams_to_send``, events) is charged to the server, measured with
``time.thread_time`` (CPU, not wall clock). Every handshake is the full exchange:
CONNECT, CHALLENGE, CONNECT with the cookie, ACCEPT.

    python bench/handshakes.py [N] [--server-key] [--token] [--no-gc]

``--server-key`` gives the server a static key and the clients its public half
(Noise NK) where the checkout supports it; the default is NN. ``--token`` (implies
``--server-key``) makes the server require connect tokens and gives each client
one (issued before the clock starts: issuing is the matchmaker's cost, not the
host's), and also prints what verifying one token costs on its own
(``TokenVerifier.verify``: decoding, one Ed25519 signature check, the replay cache).
``--no-gc`` turns the cyclic garbage collector off for the run: the N connections
all stay open, so its collections traverse more of them as the run goes on, which
a daemon whose connections end does not pay.
Set PYTHONPATH to measure another checkout's ``rudp`` (an older one without keys
runs its own handshake). For valgrind, ``--quiet`` prints nothing:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/handshakes.py 0 --quiet
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/handshakes.py 500 --quiet
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from typing import Any

from rudp.config import Config
from rudp.endpoint import Endpoint

SERVER = ("10.0.0.1", 9000)


WALL = 1_800_000_000.0  # the UNIX time tokens are issued and checked at


def _tokens(count: int, host_key: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """An issuer's public key, and ``count`` (token, handshake key) pairs for the host."""
    from rudp.noise import generate_key, public_key
    from rudp.tokens import Issuer

    issuer = Issuer(bytes(range(64, 96)))
    pairs = []
    for i in range(count):
        key = generate_key()
        token = issuer.issue(
            client_key=public_key(key),
            host_key=host_key,
            addresses=[SERVER],
            client_id=i,
            now=WALL,
            user_data=b"player=%d;team=red" % i,
        )
        pairs.append((token, key))
    return issuer.public_key, pairs


def verify_cost(count: int) -> float:
    """CPU seconds per ``TokenVerifier.verify`` of a valid token, alone."""
    from rudp.noise import public_key
    from rudp.tokens import TokenVerifier

    host_key = public_key(bytes(range(32)))
    issuer, pairs = _tokens(count, host_key)
    verifier = TokenVerifier([issuer], host_key, cache_size=count + 1)
    clients = [public_key(key) for _, key in pairs]
    t = time.thread_time()
    for (token, _), client in zip(pairs, clients, strict=True):
        verifier.verify(token, client, WALL)
    return (time.thread_time() - t) / count


def run(count: int, server_key: bool, token: bool = False) -> tuple[float, float, int]:
    """(server CPU seconds, client CPU seconds, handshakes completed)."""
    now = 1000.0
    options: dict[str, Any] = {"max_connections": count + 1}
    client_options: dict[str, Any] = {}
    tokens: list[tuple[bytes, bytes]] = []
    if (server_key or token) and "static_key" in Config.__dataclass_fields__:
        from rudp.noise import public_key

        key = bytes(range(32))
        options["static_key"] = key
        client_options["server_key"] = public_key(key)
        if token:
            issuer, tokens = _tokens(count, public_key(key))
            options["token_issuers"] = (issuer,)
    server = Endpoint(Config(**options), now=now, rng=random.Random(1), accept=True)
    if token:
        server.wall_offset = WALL - now
    client_config = Config(**client_options)
    clients = [
        (
            Endpoint(client_config, now=now, rng=random.Random(100 + i)),
            (f"10.1.{i // 250}.{i % 250}", 5000),
        )
        for i in range(count)
    ]
    if token:
        conns = [
            ep.connect(SERVER, now, token=t, token_key=k)
            for (ep, _), (t, k) in zip(clients, tokens, strict=True)
        ]
    else:
        conns = [ep.connect(SERVER, now) for ep, _ in clients]
    by_address = {address: ep for ep, address in clients}
    server_cpu = client_cpu = 0.0
    for _ in range(3):  # CONNECT -> CHALLENGE -> CONNECT -> ACCEPT
        to_server: list[tuple[bytes, tuple[str, int]]] = []
        t = time.thread_time()
        for ep, address in clients:
            for data, _dst in ep.datagrams_to_send(now):
                to_server.append((data, address))
        client_cpu += time.thread_time() - t
        t = time.thread_time()
        for data, address in to_server:
            server.receive_datagram(data, address, now)
        replies = server.datagrams_to_send(now)
        while server.next_event() is not None:
            pass
        server_cpu += time.thread_time() - t
        t = time.thread_time()
        for data, address in replies:
            by_address[address].receive_datagram(data, SERVER, now)
        client_cpu += time.thread_time() - t
    done = sum(1 for conn in conns if conn.state.value == "connected")
    return server_cpu, client_cpu, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", type=int, nargs="?", default=2000)
    parser.add_argument("--server-key", action="store_true")
    parser.add_argument("--token", action="store_true", help="the server requires tokens")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--no-gc", action="store_true", help="the collector off for the run")
    args = parser.parse_args()
    if args.no_gc:
        gc.disable()
    server_cpu, client_cpu, done = run(args.count, args.server_key, args.token)
    assert done == args.count, f"only {done} of {args.count} handshakes completed"
    if args.quiet or not done:
        return
    print(
        f"{done} handshakes: server {server_cpu / done * 1e6:.0f} us CPU each "
        f"({done / server_cpu:.0f}/s on one core), client {client_cpu / done * 1e6:.0f} us each"
    )
    if args.token:
        print(f"verifying one token alone: {verify_cost(done) * 1e6:.0f} us CPU")


if __name__ == "__main__":
    main()
