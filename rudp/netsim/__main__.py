"""Command line: ``python -m rudp.netsim --listen HOST:PORT --target HOST:PORT [impairments]``.

Runs :func:`rudp.netsim.proxy.start_proxy` with the same profile in both directions (each with its
own random stream), prints one line with the bound address once it is listening, and on SIGINT or
SIGTERM closes and prints a stats summary. Exit status: 0 after a signal, 1 when the sockets cannot
be opened, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
import time
from collections.abc import Sequence

from rudp.netsim.conditioner import GilbertElliott, LinkProfile, LinkStats
from rudp.netsim.proxy import Proxy, format_address, parse_address, start_proxy

_PREFIX = "netsim:"


def _address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rudp.netsim",
        description="UDP proxy that adds loss, delay, jitter, duplication, reordering, corruption"
        " and a bandwidth limit between any UDP client and server (same profile both ways).",
    )
    add = parser.add_argument
    add("--listen", type=_address, required=True, metavar="HOST:PORT", help="where clients send")
    add("--target", type=_address, required=True, metavar="HOST:PORT", help="the real server")
    add("--loss", type=float, default=0.0, metavar="P", help="uniform loss probability")
    add("--delay-ms", type=float, default=0.0, metavar="MS", help="one-way latency")
    add("--jitter-ms", type=float, default=0.0, metavar="MS", help="uniform +/- latency jitter")
    add("--dup", type=float, default=0.0, metavar="P", help="duplication probability")
    add("--reorder", type=float, default=0.0, metavar="P", help="probability to hold back")
    add("--reorder-delay-ms", type=float, default=10.0, metavar="MS", help="hold-back time")
    add("--corrupt", type=float, default=0.0, metavar="P", help="bit-flip probability")
    add("--bandwidth-kbps", type=float, default=None, metavar="KBPS", help="kilobits/second")
    add("--queue-limit", type=int, default=256 * 1024, metavar="BYTES", help="bottleneck queue")
    add("--mtu", type=int, default=None, metavar="BYTES", help="drop longer datagrams (path MTU)")
    add("--burst-loss", type=float, default=None, metavar="RATE", help="Gilbert-Elliott mean loss")
    add("--burst-len", type=float, default=None, metavar="N", help="mean burst length (def. 3)")
    add("--seed", type=int, default=0, help="random seed (default 0)")
    add("--idle-timeout", type=float, default=60.0, metavar="S", help="client expiry (def. 60)")
    add("--max-clients", type=int, default=4096, metavar="N", help="upstream socket limit")
    add("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    return parser


def profile_from_args(args: argparse.Namespace) -> LinkProfile:
    """Build the profile; ValueError (with a message naming the option) when inconsistent."""
    burst = None
    if args.burst_loss is not None:
        if args.loss:
            raise ValueError("use either --loss or --burst-loss, not both")
        burst_len = 3.0 if args.burst_len is None else args.burst_len
        burst = GilbertElliott.from_mean(args.burst_loss, burst_len)
    elif args.burst_len is not None:
        raise ValueError("--burst-len needs --burst-loss")
    bandwidth = None if args.bandwidth_kbps is None else args.bandwidth_kbps * 1000.0 / 8.0
    return LinkProfile(
        loss=args.loss,
        latency=args.delay_ms / 1000.0,
        jitter=args.jitter_ms / 1000.0,
        duplicate=args.dup,
        reorder=args.reorder,
        reorder_delay=args.reorder_delay_ms / 1000.0,
        corrupt=args.corrupt,
        bandwidth=bandwidth,
        queue_limit=args.queue_limit,
        burst=burst,
        mtu=args.mtu,
    )


def _format_stats(name: str, stats: LinkStats) -> str:
    counters = " ".join(f"{key}={value}" for key, value in vars(stats).items())
    return f"{_PREFIX} {name:<10} {counters}"


def _summary(proxy: Proxy, elapsed: float) -> list[str]:
    stats = proxy.stats
    return [
        f"{_PREFIX} stopped after {elapsed:.1f}s; clients: {stats.clients_created} created,"
        f" {stats.clients_expired} expired, {stats.clients_rejected} rejected;"
        f" errors: {stats.errors}",
        _format_stats("upstream", stats.upstream),
        _format_stats("downstream", stats.downstream),
    ]


async def run(args: argparse.Namespace, profile: LinkProfile) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        # Not available on Windows; Ctrl-C then arrives as KeyboardInterrupt, handled in main().
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    try:
        proxy = await start_proxy(
            args.listen,
            args.target,
            upstream=profile,
            downstream=profile,
            seed=args.seed,
            idle_timeout=args.idle_timeout,
            max_clients=args.max_clients,
        )
    except OSError as exc:
        print(f"{_PREFIX} cannot start: {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    print(
        f"{_PREFIX} listening on {format_address(proxy.address)},"
        f" forwarding to {format_address(proxy.target)}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await proxy.close()
        print("\n".join(_summary(proxy, time.monotonic() - started)), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        profile = profile_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not (args.idle_timeout > 0.0 and math.isfinite(args.idle_timeout)):
        parser.error(
            f"--idle-timeout must be a finite number of seconds > 0, not {args.idle_timeout}"
        )
    if args.max_clients < 1:
        parser.error("--max-clients must be >= 1")
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        parser.error(f"unknown --log-level {args.log_level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(run(args, profile))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
