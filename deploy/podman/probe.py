"""Checks that deploy/podman/ci.sh runs from the host against running containers.

    python deploy/podman/probe.py http URL [--timeout S]
    python deploy/podman/probe.py register-list --register HOST:PORT --list HOST:PORT
    python deploy/podman/probe.py prometheus-up URL --job JOB --targets N

Each subcommand retries until its check passes or its deadline ends, prints
what it saw, and exits 0 on success, 1 (with the reason on stderr) otherwise.
The matchmaker side uses the package's own client (`MatchmakerClient`), as a
game host and a game client would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from typing import TypeVar

import rudp
from matchmaker.client import MatchmakerClient, MatchmakerError
from matchmaker.messages import ErrorReason, HostEntry

T = TypeVar("T")
GAME = "podman-ci"
RETRYABLE = frozenset({ErrorReason.RATE_LIMITED, ErrorReason.UNAVAILABLE})


class CheckFailed(Exception):
    pass


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _get(url: str, timeout: float = 3.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http(url: str, timeout: float) -> None:
    """GET url until it answers 200."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _get(url)
        except OSError as exc:
            last = repr(exc)
        else:
            last = f"{status} {body[:200]!r}"
            if status == 200:
                print(f"{url}: {status} {body.decode(errors='replace').strip()}")
                return
        time.sleep(0.25)
    raise CheckFailed(f"{url} did not answer 200 within {timeout:g} s (last: {last})")


async def _until(what: str, timeout: float, attempt: Callable[[], Awaitable[T | None]]) -> T:
    deadline = time.monotonic() + timeout
    last = "nothing"
    while True:
        try:
            # Each attempt ends by the deadline too.
            left = max(deadline - time.monotonic(), 0.5)
            result = await asyncio.wait_for(attempt(), left)
        except MatchmakerError as exc:
            if exc.reason not in RETRYABLE:
                raise CheckFailed(f"{what}: refused: {exc}") from None
            last = f"refused: {exc}"
        except (OSError, TimeoutError, ConnectionError, rudp.RudpError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if result is not None:
                return result
            last = "not yet"
        if time.monotonic() >= deadline:
            raise CheckFailed(f"{what}: not within {timeout:g} s (last: {last})")
        await asyncio.sleep(0.3)


async def register_list(register_at: str, list_at: str, timeout: float) -> None:
    """A host registers at one matchmaker; a client lists it at another (or the same)."""
    name = f"podman-ci-{time.time_ns() % 1_000_000}"
    game = await rudp.open_endpoint()  # the socket a game would serve on
    host = MatchmakerClient.to(*_address(register_at), via=game, timeout=5.0)
    joiner = MatchmakerClient.to(*_address(list_at), timeout=5.0)
    try:
        address = await _until(
            f"registering at {register_at}",
            timeout,
            lambda: host.register(name=name, game=GAME, version="1", max_players=8),
        )
        print(f"registered {name!r} at {register_at}: listed address {address.ip}:{address.port}")

        async def listed() -> HostEntry | None:
            entries = await joiner.list_servers(game=GAME)
            return next((e for e in entries if e.info.name == name), None)

        entry = await _until(f"{name!r} listed by {list_at}", timeout, listed)
        print(
            f"listed by {list_at}: {entry.info.name!r} at {entry.address.ip}:{entry.address.port}"
        )
    finally:
        await host.close()
        await joiner.close()
        await game.close()


def prometheus_up(url: str, job: str, targets: int, timeout: float) -> None:
    """Prometheus's HTTP API reports `up == 1` for `targets` targets of `job`."""
    query = urllib.parse.urlencode({"query": f'up{{job="{job}"}}'})
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _get(f"{url}/api/v1/query?{query}")
        except OSError as exc:
            last = repr(exc)
        else:
            last = f"{status} {body[:300]!r}"
            if status == 200:
                result = json.loads(body)["data"]["result"]
                up = {r["metric"].get("instance", "?"): r["value"][1] for r in result}
                last = f"up = {up}"
                if len(up) == targets and all(v == "1" for v in up.values()):
                    for r in result:
                        labels = r["metric"]
                        where = (
                            f"instance={labels['instance']!r}, replica={labels.get('replica')!r}"
                        )
                        print(f"up{{{where}}} = 1")
                    return
        time.sleep(0.5)
    what = f"{targets} targets of job {job!r}"
    raise CheckFailed(f"Prometheus at {url}: {what} not up within {timeout:g} s ({last})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("http", help="GET a URL until it answers 200")
    p.add_argument("url")
    p.add_argument("--timeout", type=float, default=30.0)
    p = sub.add_parser("register-list", help="register a host at one address, list it at another")
    p.add_argument("--register", required=True, metavar="HOST:PORT")
    p.add_argument("--list", required=True, metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=20.0)
    p = sub.add_parser("prometheus-up", help="Prometheus scrapes every target of a job")
    p.add_argument("url")
    p.add_argument("--job", required=True)
    p.add_argument("--targets", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        if args.command == "http":
            http(args.url, args.timeout)
        elif args.command == "register-list":
            asyncio.run(register_list(args.register, args.list, args.timeout))
        else:
            prometheus_up(args.url, args.job, args.targets, args.timeout)
    except CheckFailed as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
