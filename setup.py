"""Optional native build of rudp's per-message code (the sans-IO core and the asyncio layer).

Everything else about the package is declared in pyproject.toml. A plain
``pip install .`` builds a pure-Python wheel. With ``RUDP_COMPILE=1`` in the
environment the modules below are compiled with mypyc into C extensions (same
behaviour, about half the CPU per message), and on Linux the C extension
``rudp._batch`` (``rudp/_batch.c``: recvmmsg/sendmmsg, many datagrams per system
call) is built too. ``RUDP_COMPILE=native`` builds that extension alone, over
the pure-Python core: it needs only a C compiler and Python's headers. Editable
installs and sdists are always pure Python: see build_backend/backend.py, which
also adds mypy to the build requirements only when compiling with mypyc.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import Extension, setup

# What runs per datagram and per message: the sans-IO protocol core, the events it
# makes (one per received message), and the asyncio layer's connection and endpoint.
# The rest (config, errors, the server and loop helpers, metrics, netsim, lan) stays
# interpreted; it is not on the hot path.
COMPILED_MODULES = [
    "rudp/events.py",
    "rudp/drops.py",
    "rudp/wire.py",
    "rudp/frames.py",
    "rudp/wire_v1.py",
    "rudp/protection.py",
    "rudp/noise.py",
    "rudp/handshake.py",
    "rudp/seqnum.py",
    "rudp/sending.py",
    "rudp/packet_builder.py",
    "rudp/packet_reader.py",
    "rudp/recovery.py",
    "rudp/pmtu.py",
    "rudp/parity.py",
    "rudp/congestion.py",
    "rudp/receiving.py",
    "rudp/graph.py",
    "rudp/state.py",
    "rudp/opening.py",
    "rudp/migration.py",
    "rudp/connection.py",
    "rudp/sink.py",
    "rudp/admission.py",
    "rudp/accepting.py",
    "rudp/queries.py",
    "rudp/endpoint.py",
    "rudp/stats.py",
    "rudp/tokens.py",
    "rudp/aio/connection.py",
    "rudp/aio/endpoint.py",
]


def compile_requested() -> str:
    """Empty or 0: pure; "native": rudp._batch alone; anything else: mypyc and rudp._batch."""
    value = os.environ.get("RUDP_COMPILE", "").strip()
    return "" if value == "0" else value


# recvmmsg and sendmmsg are Linux's; elsewhere the asyncio layer sends and reads one
# datagram per system call, as the pure build does.
BATCH_EXTENSION = Extension("rudp._batch", ["rudp/_batch.c"], extra_compile_args=["-O2"])


def ext_modules() -> list[Any]:
    mode = compile_requested()
    if not mode:
        return []
    native = [BATCH_EXTENSION] if sys.platform.startswith("linux") else []
    if mode == "native":
        return native
    from mypyc.build import mypycify

    compiled = mypycify(COMPILED_MODULES, opt_level="3", debug_level="0", group_name="rudp")
    return list(compiled) + native


setup(ext_modules=ext_modules())
