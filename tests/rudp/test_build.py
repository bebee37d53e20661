"""Which build is installed: pure Python, or the sans-IO core compiled with mypyc (and,
on Linux, the C extension ``rudp._batch``).

Runs against both builds. ``RUDP_EXPECT_COMPILED=1`` (or ``0``) makes it also
check that the build under test is the one intended, so that a test run meant
for the compiled wheel cannot silently import the source tree instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES

import pytest

import rudp

# setup.py's COMPILED_MODULES, as module names.
CORE = [
    "rudp.events",
    "rudp.drops",
    "rudp.wire",
    "rudp.frames",
    "rudp.wire_v1",
    "rudp.protection",
    "rudp.noise",
    "rudp.handshake",
    "rudp.seqnum",
    "rudp.sending",
    "rudp.packet_builder",
    "rudp.packet_reader",
    "rudp.recovery",
    "rudp.pmtu",
    "rudp.parity",
    "rudp.congestion",
    "rudp.receiving",
    "rudp.graph",
    "rudp.state",
    "rudp.opening",
    "rudp.migration",
    "rudp.connection",
    "rudp.sink",
    "rudp.admission",
    "rudp.accepting",
    "rudp.queries",
    "rudp.endpoint",
    "rudp.stats",
    "rudp.tokens",
    "rudp.aio.connection",
    "rudp.aio.endpoint",
]
INTERPRETED = [
    "rudp.config",
    "rudp.errors",
    "rudp.aio.server",
    "rudp.metrics",
]


def _is_extension(name: str) -> bool:
    path = importlib.import_module(name).__file__ or ""
    return path.endswith(tuple(EXTENSION_SUFFIXES))


def test_compiled_is_a_bool() -> None:
    assert isinstance(rudp.compiled, bool)
    assert "compiled" in rudp.__all__


def test_every_core_module_is_of_the_reported_build() -> None:
    assert {name: _is_extension(name) for name in CORE} == {name: rudp.compiled for name in CORE}


def test_the_rest_stays_interpreted() -> None:
    assert not any(_is_extension(name) for name in INTERPRETED)


@pytest.mark.skipif("RUDP_EXPECT_COMPILED" not in os.environ, reason="RUDP_EXPECT_COMPILED unset")
def test_the_intended_build_is_under_test() -> None:
    expected = os.environ["RUDP_EXPECT_COMPILED"].strip() not in ("", "0")
    assert rudp.compiled is expected, rudp.__file__


def test_native_says_whether_the_batch_extension_is_there() -> None:
    assert isinstance(rudp.native, bool)
    assert "native" in rudp.__all__
    try:
        importlib.import_module("rudp._batch")
    except ImportError:
        assert rudp.native is False
    else:
        assert rudp.native is True and _is_extension("rudp._batch")


@pytest.mark.skipif("RUDP_EXPECT_COMPILED" not in os.environ, reason="RUDP_EXPECT_COMPILED unset")
def test_the_compiled_build_has_the_batch_extension_on_linux() -> None:
    # RUDP_COMPILE=1 builds rudp._batch wherever recvmmsg and sendmmsg exist.
    expected = os.environ["RUDP_EXPECT_COMPILED"].strip() not in ("", "0")
    if expected and sys.platform.startswith("linux"):
        assert rudp.native is True
        from rudp.aio import endpoint

        assert endpoint._batch is not None or os.environ.get("RUDP_NO_NATIVE")
