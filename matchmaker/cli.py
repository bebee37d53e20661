"""Command-line parsing only: flags in, a mapping of the given values out.

The parser is generated from `Settings`' fields so every setting has a flag
with the same name and help text; environment variables and validation are
`Settings.from_sources`' business.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from matchmaker.settings import Settings, env_name, flag_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m matchmaker",
        description=(
            "Matchmaker daemon: game hosts register over rudp, clients list and join them. "
            "Every flag can also be set with the environment variable shown."
        ),
        argument_default=argparse.SUPPRESS,
        # A flag is spelled out: an abbreviation would silently mean another flag
        # once a longer one with the same start is added.
        allow_abbrev=False,
    )
    for f in dataclasses.fields(Settings):
        help_text = f"{f.metadata['help']} (default: {f.default!r}; env {env_name(f.name)})"
        if isinstance(f.default, bool):
            parser.add_argument(
                flag_name(f.name), action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            # Strings here; Settings converts and validates with one set of messages.
            parser.add_argument(flag_name(f.name), metavar=f.name.upper(), help=help_text)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> dict[str, object]:
    """The flags given on the command line (field name -> raw value)."""
    return dict(vars(build_parser().parse_args(argv)))
