"""``python -m matchmaker``: parse flags and environment, configure logging, run."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import rudp
from matchmaker import logging as mm_logging
from matchmaker.cli import parse_args
from matchmaker.server import Matchmaker
from matchmaker.settings import Settings, SettingsError


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Exit status: 0 after a clean shutdown, 2 for invalid settings."""
    try:
        settings = Settings.from_sources(parse_args(argv), os.environ if env is None else env)
    except SettingsError as exc:
        print(f"matchmaker: {exc}", file=sys.stderr)
        return 2
    mm_logging.configure(settings.log_level, settings.log_format)
    rudp.run(Matchmaker(settings).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
