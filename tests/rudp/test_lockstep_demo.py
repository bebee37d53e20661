"""examples/lockstep_demo.py: a small game over real rudp on loopback, through the netsim.

Bounded by the demo's own ``--timeout``; no timing assertions (the numbers it prints depend on
the machine), only on what the run verified.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DEMO_PATH = Path(__file__).resolve().parents[2] / "examples" / "lockstep_demo.py"
SMALL = ["--clients", "4", "--turns", "60", "--loss", "0.05", "--delay-ms", "20"]
SMALL += ["--turn-ms", "20", "--seed", "3", "--print-every", "20", "--timeout", "30"]


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lockstep_demo", DEMO_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def test_small_game_has_identical_checksums_on_every_turn(
    demo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "checksums: identical on all 4 clients on every one of 60 turns" in out
    assert "identical on 4/4 clients" in out  # the per-turn progress lines
    assert "input-to-execution latency (issuing client): p50" in out
    assert "turn rate:" in out
    assert "DESYNC" not in out and "problem:" not in out
    assert out.rstrip().splitlines()[-1].startswith("result: OK")


def test_injected_divergence_is_caught_and_fails_the_run(
    demo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*SMALL, "--turns", "30", "--inject-desync", "10"]
    assert demo.main(args) == 1
    out = capsys.readouterr().out
    assert "DESYNC at turn 10:" in out
    assert "checksums: DIFFER from turn 10 on" in out
    assert "problem: host: desync at turn 10, diverged [0]" in out
    assert out.rstrip().splitlines()[-1].startswith("result: FAILED")


def test_world_is_integer_only_and_order_sensitive(demo: ModuleType) -> None:
    world_cls = demo.World
    cmd = demo.COMMAND
    turns = [
        [(0, cmd.pack(demo.OP_SPAWN, 0, 0, 0, 1)), (1, cmd.pack(demo.OP_SPAWN, 0, 0, 0, 1))],
        [(2, cmd.pack(demo.OP_ATTACK, 1, 9000, 9000, 2)), (0, b"junk")],
        [(1, cmd.pack(demo.OP_MOVE, 3, 100, 16000, 2))],
        [],
    ] * 40

    def play(order: int) -> list[int]:
        world = world_cls(7, [2, 0, 1])
        return [world.step(n, cmds[::order]) for n, cmds in enumerate(turns)]

    first = play(1)
    assert first == play(1)  # same commands, same order: same world
    assert play(-1) != first  # the host's order matters, so clients must all use it
    world = world_cls(7, [0, 1, 2])
    for n, cmds in enumerate(turns):
        world.step(n, cmds)
    for unit in world.units.values():
        assert all(type(value) is int for value in dataclasses.astuple(unit))
    assert world.units and all(type(n) is int for n in world.losses.values())
