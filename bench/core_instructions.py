"""Instructions per message through two sans-IO core endpoints, for valgrind.

Sends N small reliable messages from one core ``Endpoint`` to another in one process
(send, packetise, acknowledge, decode, deliver; no sockets, no event loop). Instruction
counts are repeatable where wall-clock time on a shared machine is not, so compare
builds or commits with the difference of two runs divided by N:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/core_instructions.py 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/core_instructions.py 20000

("Collected" on stderr; set PYTHONPATH to measure another checkout's ``rudp``.)
"""

from __future__ import annotations

import random
import sys

from rudp.config import Config
from rudp.endpoint import Endpoint

CLIENT, SERVER = ("10.0.0.2", 5000), ("10.0.0.1", 9000)
BATCH = 500


def main(count: int) -> None:
    now = 1000.0
    options: dict[str, int] = {"send_queue_limit": 1 << 22}
    if "redundancy" in Config.__dataclass_fields__:  # older checkouts have none
        options["redundancy"] = 0
    config = Config(**options)
    server = Endpoint(config, now=now, rng=random.Random(1), accept=True)
    client = Endpoint(config, now=now, rng=random.Random(2))
    conn = client.connect(SERVER, now)

    def pump() -> None:
        for endpoint, me in ((client, CLIENT), (server, SERVER)):
            for data, dst in endpoint.datagrams_to_send(now):
                (server if dst == SERVER else client).receive_datagram(data, me, now)
        for endpoint in (server, client):
            while endpoint.next_event() is not None:
                pass

    for _ in range(4):  # the handshake
        pump()
    payload = bytes(16)
    for _ in range(count // BATCH):
        for _ in range(BATCH):
            conn.send(payload)
        pump()
        pump()
    assert conn.queued == 0


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
