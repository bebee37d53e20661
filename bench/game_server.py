"""A game server's bill: CPU and datagrams per client per tick, rudp against ENet, UDP, TCP.

The scenario: one server process pinned to one core, N clients (several per process,
every client process pinned to the other core) at 60 Hz on 127.0.0.1. Each tick every
client sends the server a 32-byte reliable input, and the server sends every client a
200-byte unreliable snapshot. Every transport runs in the same invocation:

* ``rudp-<build>-<loop>``: ``rudp.serve`` / ``rudp.connect`` with the default
  ``Config`` (one socket per client, as players have), inputs with ``conn.send()``
  (reliable, ordered, channel 0), snapshots with ``conn.send(..., reliable=False)``,
  received with ``set_receiver``. Builds: *pure* (the checkout's sources) and
  *compiled* (a mypyc wheel of the checkout, built into a venv under
  ``bench/results/`` on first use, or ``--compiled-python``); loops: asyncio, uvloop.
* ``enet``: ENet 1.3 through pyenet (``pip install pyenet``), each host serviced once
  per tick (``service(0)`` until no event), then the tick's sends and one ``flush()``;
  inputs ``PACKET_FLAG_RELIABLE`` on channel 0, snapshots unreliable on channel 1.
* ``udp``: raw datagrams, the floor: the server drains its one socket once per tick,
  then ``sendto`` per client; each client drains its socket, then sends its input
  (not reliable: a lost one stays lost, and shows as such).
* ``tcp``: one connection per client, ``TCP_NODELAY``, 4-byte length prefix; the
  server reads what ``epoll`` says is readable once per tick, then writes the snapshots.

The loops other than rudp's are plain blocking-sleep loops with no event loop, what a C
game server does. Reported for the measured window (``--ticks`` after ``--warmup``):
server and client CPU (user + system, ``time.process_time``) per client per tick;
datagrams per client per tick each way, counted at the server (rudp's endpoint
counters, ENet's host counters, the UDP socket calls, TCP segments from
``TCP_INFO``); whether every input and snapshot arrived (inputs in order) and every
tick started within one period of its time; the server's share of its core, and
the N at which it would reach 100 %. ``rudp`` rows also give the connections'
resend-timer expiries and spurious losses (both sides).

Run from the repository root::

    python bench/game_server.py                          # N = 16,64,256, all transports (~10 min)
    python bench/game_server.py --quick                  # N = 16,64, shorter (~3 min)
    python bench/game_server.py --n 16,64,256 --transports rudp,enet,udp,tcp --builds compiled
    python bench/game_server.py --transports rudp --builds pure --loops asyncio --n 8

A checkout's bench measures that checkout: the pure build imports the sources next to
this file, the compiled build is built from them. The Markdown table goes to stdout,
progress to stderr, everything (every process's raw figures) to a JSON file under
``bench/results/``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import format_table, write_json

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
ROLES = BENCH / "_game_roles.py"
TRANSPORTS = ("rudp", "enet", "udp", "tcp")
BASELINE = "enet"
KEPT_UP_TOLERANCE = 0.02
"""A run counts when its server got the window's inputs in the window, within 2 %:
fewer means the clients fell behind (their inputs landed after the window, and the
server's figures are too low); more, that they were behind when it opened."""

Result = dict[str, Any]


# -- the interpreters of the two rudp builds -----------------------------------------------


def _source_digest() -> str:
    """What the compiled build is made of: the package and build files, by content."""
    digest = hashlib.sha256()
    paths = sorted((ROOT / "rudp").rglob("*.py")) + sorted((ROOT / "build_backend").rglob("*.py"))
    paths += [ROOT / "setup.py", ROOT / "pyproject.toml"]
    for path in paths:
        if path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def compiled_python(explicit: str | None) -> str:
    """An interpreter whose ``rudp`` is the mypyc build of this checkout.

    Built once per source digest into ``bench/results/compiled-<digest>/`` (the
    wheel of ``RUDP_COMPILE=1 pip wheel``, installed with uvloop into a venv of its
    own; a few minutes), from a copy of the checkout so that nothing is left in its
    ``build/`` directory."""
    if explicit:
        return explicit
    home = BENCH / "results" / f"compiled-{_source_digest()}"
    python = home / "venv" / "bin" / "python"
    if (home / "ready").exists():
        return str(python)
    print(f"building the compiled rudp into {home} (once per source version)", file=sys.stderr)
    shutil.rmtree(home, ignore_errors=True)
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "results", ".compiled-test", "__pycache__", "*.so", ".*cache"
    )
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT, src, ignore=skip)
        env = {**os.environ, "RUDP_COMPILE": "1"}
        wheels = home / "dist"
        _check_call(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--wheel-dir",
                str(wheels),
                str(src),
            ],
            env=env,
        )
    _check_call([sys.executable, "-m", "venv", "--clear", str(home / "venv")])
    wheel = next(wheels.glob("aiorudp-*.whl"))
    _check_call([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[uvloop]"])
    (home / "ready").write_text(str(wheel.name) + "\n")
    return str(python)


def _check_call(cmd: list[str], env: dict[str, str] | None = None) -> None:
    subprocess.run(cmd, check=True, env=env, cwd=tempfile.gettempdir())


# -- child processes -----------------------------------------------------------------------


class CaseFailed(RuntimeError):
    pass


class Child:
    """One role process; JSON lines on its stdout, its start time on its stdin."""

    def __init__(self, name: str, python: str, role: str, params: Result, env: dict[str, str]):
        self.name = name
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finish())
        self.proc = subprocess.Popen(
            [python, str(ROLES), role, json.dumps(params)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            cwd=tempfile.gettempdir(),  # never import rudp from the current directory
        )
        self.buffer = b""

    def expect(self, event: str, timeout: float) -> Result:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CaseFailed(f"{self.name}: no {event!r} within {timeout:.0f} s{self._tail()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise CaseFailed(f"{self.name} exited before {event!r}{self._tail()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message: Result = json.loads(line)
        if message["event"] == "error":
            raise CaseFailed(f"{self.name} failed:\n{message['traceback']}")
        if message["event"] != event:
            raise CaseFailed(f"{self.name}: expected {event!r}, got {message['event']!r}")
        return message

    def send_start(self, t0: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"t0": t0}).encode() + b"\n")
        self.proc.stdin.flush()

    def _tail(self) -> str:
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace").strip()
        return f"\n{self.name} stderr:\n{text[-3000:]}" if text else ""

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)
        self.stderr.close()


# -- one case ------------------------------------------------------------------------------


def run_case(variant: Variant, n: int, args: argparse.Namespace) -> Result:
    """One transport, N clients: returns the server's and the clients' results."""
    base: Result = {
        "n": n,
        "hz": args.hz,
        "warmup": args.warmup,
        "measured": args.ticks,
        "drain_cap": args.drain_cap,
        "input_size": 32,
        "snapshot_size": 200,
        "connect_timeout": 30.0,
        "loop": variant.loop,
        "build": variant.build,
        "rudp_config": args.rudp_config,
        "rudp_server_config": args.rudp_server_config,
        "enet_throttle": args.enet_throttle,
    }
    groups = [
        list(range(i, min(n, i + args.clients_per_process)))
        for i in range(0, n, args.clients_per_process)
    ]
    server_cpu, client_cpu = args.cpus
    children: list[Child] = []
    try:
        server = Child(
            "server",
            variant.python,
            f"{variant.kind}-server",
            {**base, "cpu": server_cpu, "phase": 0.0},
            variant.env,
        )
        children.append(server)
        port = server.expect("ready", 60.0)["port"]
        clients = []
        for i, cids in enumerate(groups):
            params = {
                **base,
                "cpu": client_cpu,
                "port": port,
                "cids": cids,
                "phase": (i + 0.5) / len(groups),
            }
            child = Child(
                f"clients[{i}]", variant.python, f"{variant.kind}-client", params, variant.env
            )
            children.append(child)
            clients.append(child)
        for child in clients:
            child.expect("connected", 90.0)
        server.expect("connected", 30.0)
        t0 = time.monotonic() + 0.3
        for child in children:
            child.send_start(t0)
        budget = 0.3 + (args.warmup + args.ticks + 1) / args.hz + args.drain_cap + 60.0
        client_results = [child.expect("result", budget) for child in clients]
        server_result = server.expect("result", 30.0)
    finally:
        for child in reversed(children):
            child.finish()
    return {"server": server_result, "clients": client_results}


def summarize(raw: Result, n: int, ticks: int) -> Result:
    """Per client per tick figures of one case."""
    server, clients = raw["server"], raw["clients"]
    client_ticks = n * ticks
    counters = server["counters"]
    row: Result = {
        "server_us": 1e6 * server["cpu"] / client_ticks,
        "client_us": 1e6 * sum(c["cpu"] for c in clients) / client_ticks,
        "server_core": server["cpu"] / server["wall"] if server["wall"] else float("nan"),
        "client_core": sum(c["cpu"] for c in clients) / max(c["wall"] for c in clients),
        "dg_in": counters.get("datagrams_in", float("nan")) / client_ticks,
        "dg_out": counters.get("datagrams_out", float("nan")) / client_ticks,
        "inputs": (server["inputs_received"], server["inputs_expected"]),
        "inputs_out_of_order": server["inputs_out_of_order"],
        "snapshots": (
            sum(c["snapshots_received"] for c in clients),
            sum(c["snapshots_expected"] for c in clients),
        ),
        "server_late": server["ticks_late"],
        "client_late": sum(c["ticks_late"] for c in clients),
        "server_lateness_p99_ms": server["lateness_p99_ms"],
        # Inputs the server got within its window, per client-tick: below 1 when the
        # clients' core fell behind (their inputs then land after the window).
        "in_window": counters.get("received", 0) / client_ticks,
    }
    row["connections_lost"] = server.get("connections_lost", 0)
    row["kept_up"] = abs(row["in_window"] - 1.0) <= KEPT_UP_TOLERANCE
    if "totals" in server:
        row["rudp"] = {
            side: {
                key: sum(r["totals"].get(f"conn.{key}", 0) for r in results)
                for key in ("timeouts", "spurious_losses", "messages_resent", "packets_lost")
            }
            for side, results in (("server", [server]), ("clients", clients))
        }
        row["build"] = server["build"]
    return row


# -- variants ------------------------------------------------------------------------------


class Variant:
    """One column of the comparison: a transport, and for rudp a build and a loop."""

    def __init__(self, kind: str, python: str, build: str | None = None, loop: str = "") -> None:
        self.kind = kind
        self.python = python
        self.build = build
        self.loop = loop
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RUDP_NO_UVLOOP")}
        if build == "pure":
            env["PYTHONPATH"] = str(ROOT)  # the sources of this checkout, never an installed build
        self.env = env

    @property
    def name(self) -> str:
        return f"rudp-{self.build}-{self.loop}" if self.kind == "rudp" else self.kind


def variants(args: argparse.Namespace) -> tuple[list[Variant], list[str]]:
    """The variants to run, and notes on those left out."""
    out: list[Variant] = []
    notes: list[str] = []
    for kind in args.transports:
        if kind == "rudp":
            for build in args.builds:
                python = (
                    sys.executable if build == "pure" else compiled_python(args.compiled_python)
                )
                out.extend(Variant("rudp", python, build, loop) for loop in args.loops)
        elif kind == "enet" and not _has_pyenet():
            notes.append("enet left out: pyenet is not installed (`pip install pyenet`)")
        else:
            out.append(Variant(kind, sys.executable))
    return out, notes


def _has_pyenet() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import enet"], capture_output=True)
    return probe.returncode == 0


# -- tables --------------------------------------------------------------------------------


def _median(rows: list[Result], key: str) -> float:
    values = [r[key] for r in rows if r[key] == r[key]]
    return statistics.median(values) if values else float("nan")


def _delivered(rows: list[Result], key: str) -> str:
    worst = min(rows, key=lambda r: r[key][0] - r[key][1])
    got, want = worst[key]
    return "all" if got == want else f"{got}/{want}"


def _kept_up(rows: list[Result]) -> list[Result]:
    """The runs whose clients kept up, or all of them if none did."""
    return [r for r in rows if r["kept_up"]] or rows


def _ratio(value: float, base: float | None) -> float:
    return value / base if base else float("nan")


def tables(
    results: dict[tuple[str, int], list[Result]], names: list[str], ns: list[int], hz: float
) -> str:
    rows = []
    for n in ns:
        base = results.get((BASELINE, n))
        base_s = _median(base, "server_us") if base else None
        base_c = _median(base, "client_us") if base else None
        for name in names:
            every = results.get((name, n))
            if not every:
                continue
            got = _kept_up(every)
            s, c = _median(got, "server_us"), _median(got, "client_us")
            rows.append(
                [
                    n,
                    name,
                    s,
                    _ratio(s, base_s),
                    c,
                    _ratio(c, base_c),
                    _median(got, "dg_in"),
                    _median(got, "dg_out"),
                    _delivered(got, "inputs"),
                    _delivered(got, "snapshots"),
                    max(r["server_late"] for r in got),
                    max(r["client_late"] for r in got),
                    100 * _median(got, "server_core"),
                    100 * _median(got, "in_window"),
                    f"{sum(r['kept_up'] for r in every)}/{len(every)}",
                ]
            )
    main = format_table(
        [
            "N",
            "transport",
            "server us/client-tick",
            "x ENet",
            "client us/client-tick",
            "x ENet",
            "dgrams in/client-tick",
            "dgrams out/client-tick",
            "inputs",
            "snapshots",
            "server ticks late",
            "client ticks late",
            "server core %",
            "inputs in window %",
            "runs",
        ],
        rows,
    )
    return main + "\n\n" + saturation_table(results, names, ns, hz) + rudp_table(results, names, ns)


def saturation_table(
    results: dict[tuple[str, int], list[Result]], names: list[str], ns: list[int], hz: float
) -> str:
    """Where the server's core runs out: measured (late ticks) and extrapolated.

    The extrapolation fits per-tick CPU = fixed + marginal x N through the two largest
    N whose clients kept up (see ``KEPT_UP_TOLERANCE``)."""
    rows = []
    for name in names:
        measured_ns = [n for n in ns if (name, n) in results]
        points = [
            (n, _median(_kept_up(results[(name, n)]), "server_us") * n)
            for n in measured_ns
            if any(r["kept_up"] for r in results[(name, n)])
        ]
        if not points:
            continue
        late = [n for n in measured_ns if _late(results[(name, n)])]
        busy = [n for n in measured_ns if _busy(results[(name, n)])]
        late_at = str(late[0]) if late else f"> {measured_ns[-1]}"
        busy_at = str(busy[0]) if busy else f"> {measured_ns[-1]}"
        if len(points) >= 2:
            (n1, c1), (n2, c2) = points[-2], points[-1]
            marginal = (c2 - c1) / (n2 - n1)
            fixed = c2 - marginal * n2
        else:
            marginal, fixed = points[-1][1] / points[-1][0], 0.0
        estimate = (1e6 / hz - fixed) / marginal if marginal > 0 else float("nan")
        fitted = ",".join(str(n) for n, _ in points[-2:])
        rows.append([name, marginal, fixed, fitted, late_at, busy_at, estimate])
    return format_table(
        [
            "transport",
            "server us per extra client-tick",
            "fixed us per tick",
            "fitted on N",
            "late at N",
            "busy at N",
            "N at 100 % of a core (extrapolated)",
        ],
        rows,
    )


def _late(rows: list[Result]) -> bool:
    """The server started more than 1 % of its ticks late (in the median run)."""
    late = [r["server_late"] / r["ticks"] for r in _kept_up(rows)]
    return bool(statistics.median(late) > 0.01)


def _busy(rows: list[Result]) -> bool:
    """The server's own CPU time filled more than 90 % of the window (median run)."""
    return _median(_kept_up(rows), "server_core") > 0.9


def rudp_table(
    results: dict[tuple[str, int], list[Result]], names: list[str], ns: list[int]
) -> str:
    """rudp's resend-timer expiries, spurious losses and resends, whole runs, run by run."""
    keys = ("timeouts", "spurious_losses", "messages_resent")
    rows = []
    for name in names:
        for n in ns:
            runs = [r["rudp"] for r in results.get((name, n), []) if "rudp" in r]
            if runs:
                rows.append(
                    [n, name]
                    + [
                        " / ".join(str(run[side][key]) for run in runs)
                        for side in ("server", "clients")
                        for key in keys
                    ]
                )
    if not rows:
        return ""
    return "\n\n" + format_table(
        [
            "N",
            "rudp",
            "server: resend-timer expiries",
            "spurious losses",
            "messages resent",
            "clients: resend-timer expiries",
            "spurious losses",
            "messages resent",
        ],
        rows,
    )


# -- main ----------------------------------------------------------------------------------


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _config_pair(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--n",
        type=lambda v: [int(x) for x in _csv(v)],
        default=None,
        help="clients per case (default 16,64,256; --quick 16,64)",
    )
    ap.add_argument(
        "--transports", type=_csv, default=list(TRANSPORTS), help="rudp,enet,udp,tcp (default: all)"
    )
    ap.add_argument(
        "--builds",
        type=_csv,
        default=["pure", "compiled"],
        help="rudp builds: pure,compiled (default both)",
    )
    ap.add_argument(
        "--loops",
        type=_csv,
        default=["asyncio", "uvloop"],
        help="rudp event loops: asyncio,uvloop (default both)",
    )
    ap.add_argument(
        "--compiled-python",
        default=None,
        help="an interpreter with the compiled rudp installed (default: build one)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 30 warm-up and 120 measured ticks, N = 16,64",
    )
    ap.add_argument("--ticks", type=int, default=None, help="measured ticks (600; quick 120)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up ticks (60; quick 30)")
    ap.add_argument("--hz", type=float, default=60.0, help="tick rate (60)")
    ap.add_argument(
        "--drain-cap",
        type=float,
        default=None,
        help="seconds to wait for what is still in flight after the last tick (5; quick 3)",
    )
    ap.add_argument("--clients-per-process", type=int, default=64)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every case, interleaved; the table gives medians",
    )
    ap.add_argument(
        "--cpus",
        type=lambda v: [int(x) for x in _csv(v)],
        default=None,
        help="server core,client core (default: the first two this process may use)",
    )
    ap.add_argument(
        "--rudp-config",
        type=_config_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a rudp.Config field for both sides (repeatable)",
    )
    ap.add_argument(
        "--rudp-server-config",
        type=_config_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a rudp.Config field for the server only, after --rudp-config (repeatable)",
    )
    ap.add_argument(
        "--enet-throttle",
        action="store_true",
        help="leave ENet's packet throttle on (it drops snapshots; default off)",
    )
    ap.add_argument(
        "--json", default=None, help="where to write the results (default bench/results/)"
    )
    args = ap.parse_args(argv)
    args.n = args.n or ([16, 64] if args.quick else [16, 64, 256])
    args.ticks = args.ticks or (120 if args.quick else 600)
    args.warmup = args.warmup if args.warmup is not None else (30 if args.quick else 60)
    args.drain_cap = args.drain_cap or (3.0 if args.quick else 5.0)
    args.rudp_config = dict(args.rudp_config)
    args.rudp_server_config = dict(args.rudp_server_config)
    for values, known, what in (
        (args.transports, TRANSPORTS, "transport"),
        (args.builds, ("pure", "compiled"), "build"),
        (args.loops, ("asyncio", "uvloop"), "loop"),
    ):
        for value in values:
            if value not in known:
                ap.error(f"unknown {what} {value!r} (known: {', '.join(known)})")
    if args.cpus is None:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        args.cpus = [allowed[0], allowed[1] if len(allowed) > 1 else allowed[0]]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    chosen, notes = variants(args)
    names = [v.name for v in chosen]
    results: dict[tuple[str, int], list[Result]] = {}
    raw: list[Result] = []
    failures: list[str] = []
    for rep in range(args.repeat):
        for n in args.n:
            shift = rep % len(chosen)  # each run starts with another transport
            for variant in chosen[shift:] + chosen[:shift]:
                label = f"{variant.name} N={n} run {rep + 1}/{args.repeat}"
                print(f"{label}: load {os.getloadavg()[0]:.2f}", file=sys.stderr)
                load = os.getloadavg()
                try:
                    case = run_case(variant, n, args)
                except CaseFailed as exc:
                    failures.append(f"{label}: {exc}")
                    print(f"  FAILED: {exc}", file=sys.stderr)
                    continue
                row = summarize(case, n, args.ticks)
                row["ticks"] = args.ticks
                results.setdefault((variant.name, n), []).append(row)
                raw.append(
                    {
                        "variant": variant.name,
                        "n": n,
                        "run": rep,
                        "load": load,
                        "summary": row,
                        **case,
                    }
                )
                print(
                    f"  server {row['server_us']:.1f} us, clients {row['client_us']:.1f} us"
                    f" per client-tick; datagrams in/out {row['dg_in']:.2f}/{row['dg_out']:.2f}",
                    file=sys.stderr,
                )
    load_end = os.getloadavg()
    print(tables(results, names, args.n, args.hz))
    print()
    print(
        f"{started} UTC; load average (1, 5, 15 min) at start "
        f"{', '.join(f'{x:.2f}' for x in load_start)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load_end)}; {os.cpu_count()} CPUs; "
        f"server on CPU {args.cpus[0]}, clients on CPU {args.cpus[1]}; "
        f"{args.warmup} + {args.ticks} ticks at {args.hz:g} Hz, {args.repeat} run(s) per case"
    )
    behind = sorted(
        {
            f"{name} N={n}"
            for (name, n), rows in results.items()
            if not all(r["kept_up"] for r in rows)
        }
    )
    if behind:
        notes.append(
            f"the clients' core fell behind in some runs of {', '.join(behind)} (their server"
            f" got the window's inputs in the window only to within more than"
            f" {KEPT_UP_TOLERANCE:.0%}): those runs are left"
            " out of the medians where others kept up, and the server figures of a row whose"
            " runs all fell behind are too low"
        )
    for (name, n), rows in results.items():
        lost = [r["connections_lost"] for r in rows if r["connections_lost"]]
        if lost:
            notes.append(f"{name} N={n}: connections ended by idle timeout: {lost}")
    for note in notes + failures:
        print(f"- {note}")
    path = write_json(
        "game_server",
        {
            "started_utc": started,
            "load_start": load_start,
            "load_end": load_end,
            "args": {k: v for k, v in vars(args).items()},
            "python": sys.version.split()[0],
            "notes": notes,
            "failures": failures,
            "cases": raw,
        },
        args.json,
    )
    print(f"results: {path}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
