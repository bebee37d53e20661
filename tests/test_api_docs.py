"""docs/api.md against the code (outside tests/rudp, which also runs on an installed
compiled build, away from the source tree)."""

from __future__ import annotations

from pathlib import Path

from rudp.stats import ConnectionStats

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_api_docs_say_what_every_connection_statistic_counts() -> None:
    section = API.read_text().split("### Connection statistics", 1)[1].split("\n### ", 1)[0]
    for name in [*ConnectionStats().as_dict(), "min_rtt"]:
        assert f"`{name}`" in section, name


def test_the_api_docs_say_a2s_replies_are_split_at_the_base_datagram_size() -> None:
    # They said Config.max_datagram_size (1,472 B by default); the responder splits at
    # base_datagram_size (1,200 B: tests/rudp/test_secondary_misuse.py).
    docs = API.read_text()
    bullet = docs[docs.index("- **Split replies.**") :].split("\n- ", 1)[0]
    assert "`Config.base_datagram_size`" in bullet
    assert "larger than `Config.max_datagram_size`" not in bullet
