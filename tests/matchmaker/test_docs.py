"""docs/matchmaker.md must not drift from the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from matchmaker.messages import ErrorReason, MsgType
from matchmaker.metrics import Metrics
from matchmaker.registry import MemoryRegistry
from matchmaker.settings import Settings, env_name, flag_name
from matchmaker.workers import count_restarts

DOC = (Path(__file__).parents[2] / "docs" / "matchmaker.md").read_text()


def test_every_setting_is_documented() -> None:
    for f in dataclasses.fields(Settings):
        assert f"`{flag_name(f.name)}`" in DOC or f"`{flag_name(f.name)}` /" in DOC, f.name
        assert f"`{env_name(f.name)}`" in DOC, f.name


def test_every_error_reason_and_message_type_is_documented() -> None:
    for reason in ErrorReason:
        assert f"`{reason.value}`" in DOC, reason
    for t in MsgType:
        assert f"| {int(t)} |" in DOC, t


def test_every_metric_is_documented() -> None:
    metrics = Metrics(CollectorRegistry())
    reg = MemoryRegistry()
    metrics.bind_state(
        hosts_by_game=reg.count_by_game, stale=lambda: False, connections=lambda: 0, max_games=1
    )
    metrics.bind_transport(())  # the rudp_* families are there even with no socket
    count_restarts(metrics.registry, 0)  # a worker's own, besides the Metrics
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name.endswith(("_created", "_gcount", "_gsum")):
            continue  # companion series (the 0.0.4 text format splits gauge histograms)
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in DOC, name


def test_the_dropped_counter_says_it_counts_messages_not_datagrams() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.dropped.labels("send_failed").inc()
    text = generate_latest(metrics.registry).decode()
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "matchmaker_dropped_datagrams"
    )
    assert "messages (not datagrams" in family.documentation
    assert "send_failed" in family.documentation  # replies, not only incoming messages
    row = next(line for line in DOC.splitlines() if line.startswith("| `matchmaker_dropped_"))
    assert "*messages*, not datagrams" in row


_LOGGED = re.compile(
    r"\b(?:log\.(?:debug|info|warning|error|exception|critical)|_exit_now|_drop_event)"
    r"\(\s*\"([a-z][a-z_]*)[ \"]"
)
"""An event logged by name: structlog's ``log.info("event", ...)``, the standard
library's ``log.info("event key=%s", ...)``, and the helpers that log the name given."""


def test_every_log_event_is_in_the_logs_section() -> None:
    logs = DOC.split("\n## Logs\n", 1)[1].split("\n## ", 1)[0]
    package = Path(__file__).parents[2] / "matchmaker"
    events = {
        (name, str(path.relative_to(package)))
        for path in sorted(package.rglob("*.py"))
        for name in _LOGGED.findall(path.read_text())
    }
    assert len(events) > 60 and ("shutdown_timeout", "server.py") in events
    missing = sorted(
        (name, where) for name, where in events if not re.search(rf"`{name}[` ]", logs)
    )
    assert not missing, f"not in docs/matchmaker.md, Logs: {missing}"
