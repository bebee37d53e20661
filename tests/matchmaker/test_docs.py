"""docs/matchmaker.md must not drift from the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from matchmaker.messages import ErrorReason, MsgType
from matchmaker.metrics import Metrics
from matchmaker.registry import MemoryRegistry
from matchmaker.settings import Settings, env_name, flag_name

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
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name.endswith(("_created", "_gcount", "_gsum")):
            continue  # companion series (the 0.0.4 text format splits gauge histograms)
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in DOC, name
