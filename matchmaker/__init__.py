"""Matchmaker daemon: game hosts register over rudp, clients list and join them.

See docs/matchmaker.md.  `python -m matchmaker --help` lists every setting.
"""

from __future__ import annotations

__version__ = "0.1.0"
