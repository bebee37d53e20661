"""``python -m matchmaker``: parse flags and environment, configure logging, run."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import structlog

import rudp
from matchmaker import logging as mm_logging
from matchmaker.cli import parse_args
from matchmaker.server import Matchmaker
from matchmaker.settings import Settings, SettingsError

log = structlog.get_logger("matchmaker")


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Exit status: 0 after a clean shutdown, 1 if it failed (logged), 2 for invalid settings."""
    try:
        settings = Settings.from_sources(parse_args(argv), os.environ if env is None else env)
    except SettingsError as exc:
        print(f"matchmaker: {exc}", file=sys.stderr)
        return 2
    mm_logging.configure(settings.log_level, settings.log_format)
    try:
        rudp.run(Matchmaker(settings).run())
    except Exception:
        # In the configured format (a JSON line), not as a bare traceback on stderr.
        log.exception("matchmaker_failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
