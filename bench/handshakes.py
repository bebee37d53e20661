"""What a handshake costs a server: CPU per completed handshake, and so how many a
single core completes per second, with the sans-IO core (no sockets, no event loop).

N clients, each its own ``Endpoint`` at its own address, connect to one server
``Endpoint`` in one process; the datagrams go straight from one to the other.
Only the time spent inside the server's calls (``receive_datagram``,
``datagrams_to_send``, events) is charged to the server, measured with
``time.thread_time`` (CPU, not wall clock). Every handshake is the full exchange:
CONNECT, CHALLENGE, CONNECT with the cookie, ACCEPT.

    python bench/handshakes.py [N] [--server-key]

``--server-key`` gives the server a static key and the clients its public half
(Noise NK) where the checkout supports it; the default is NN. Set PYTHONPATH to
measure another checkout's ``rudp`` (an older one without keys runs its own
handshake). For valgrind, ``--quiet`` prints nothing:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/handshakes.py 0 --quiet
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/handshakes.py 500 --quiet
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from rudp.config import Config
from rudp.endpoint import Endpoint

SERVER = ("10.0.0.1", 9000)


def run(count: int, server_key: bool) -> tuple[float, float, int]:
    """(server CPU seconds, client CPU seconds, handshakes completed)."""
    now = 1000.0
    options: dict[str, Any] = {"max_connections": count + 1}
    client_options: dict[str, Any] = {}
    if server_key and "static_key" in Config.__dataclass_fields__:
        from rudp.noise import public_key

        key = bytes(range(32))
        options["static_key"] = key
        client_options["server_key"] = public_key(key)
    server = Endpoint(Config(**options), now=now, rng=random.Random(1), accept=True)
    client_config = Config(**client_options)
    clients = [
        (
            Endpoint(client_config, now=now, rng=random.Random(100 + i)),
            (f"10.1.{i // 250}.{i % 250}", 5000),
        )
        for i in range(count)
    ]
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
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    server_cpu, client_cpu, done = run(args.count, args.server_key)
    assert done == args.count, f"only {done} of {args.count} handshakes completed"
    if args.quiet or not done:
        return
    print(
        f"{done} handshakes: server {server_cpu / done * 1e6:.0f} us CPU each "
        f"({done / server_cpu:.0f}/s on one core), client {client_cpu / done * 1e6:.0f} us each"
    )


if __name__ == "__main__":
    main()
