"""Optional mypyc build of rudp's per-message code (the sans-IO core and the asyncio layer).

Everything else about the package is declared in pyproject.toml. A plain
``pip install .`` builds a pure-Python wheel; with ``RUDP_COMPILE=1`` in the
environment the modules below are compiled with mypyc into C extensions (same
behaviour, about half the CPU per message). Editable installs and sdists are
always pure Python: see build_backend/backend.py, which also adds mypy to the
build requirements only when compiling.
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup

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


def compile_requested() -> bool:
    return os.environ.get("RUDP_COMPILE", "").strip() not in ("", "0")


def ext_modules() -> list[Any]:
    if not compile_requested():
        return []
    from mypyc.build import mypycify

    return mypycify(COMPILED_MODULES, opt_level="3", debug_level="0", group_name="rudp")


setup(ext_modules=ext_modules())
