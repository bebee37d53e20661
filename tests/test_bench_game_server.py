"""bench/game_server.py runs end to end: two clients against rudp (pure build, asyncio
loop) and raw UDP on loopback, every input and snapshot counted.

Only the counts are asserted, never a speed: every tick is played (a late tick is
played late, not skipped), and each process waits for what it expects up to a generous
bound, so a loaded machine slows the run down without changing what it delivers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WARMUP, TICKS, CLIENTS = 5, 20, 2


def test_game_server_bench_delivers_every_input_and_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "game_server.py"),
        "--n", str(CLIENTS),
        "--transports", "rudp,udp",
        "--builds", "pure",
        "--loops", "asyncio",
        "--warmup", str(WARMUP),
        "--ticks", str(TICKS),
        "--drain-cap", "20",
        "--json", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    cases = json.loads(out.read_text())["cases"]
    assert sorted(case["variant"] for case in cases) == ["rudp-pure-asyncio", "udp"]
    expected = CLIENTS * (WARMUP + TICKS)
    for case in cases:
        server, clients = case["server"], case["clients"]
        assert server["inputs_received"] == expected, case["variant"]
        assert server["inputs_out_of_order"] == 0, case["variant"]
        assert sum(c["snapshots_received"] for c in clients) == expected, case["variant"]
    rudp_case = next(case for case in cases if case["variant"] == "rudp-pure-asyncio")
    assert rudp_case["server"]["build"]["compiled"] is False
    assert Path(rudp_case["server"]["build"]["path"]) == ROOT / "rudp"
    table = run.stdout.splitlines()
    assert any(line.startswith("| 2 |") and "rudp-pure-asyncio" in line for line in table)
