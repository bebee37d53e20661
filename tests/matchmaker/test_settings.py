from __future__ import annotations

import pytest

from matchmaker.__main__ import main
from matchmaker.cli import build_parser, parse_args
from matchmaker.settings import Settings, SettingsError


def test_defaults_are_valid_and_documented() -> None:
    s = Settings.from_sources({}, {})
    assert (s.port, s.hide_after, s.expire_after, s.store) == (27950, 15.0, 30.0, "memory://")
    assert not s.uses_redis and not s.allow_private
    assert s.limits.info_bytes == 512
    help_text = build_parser().format_help()
    assert "MATCHMAKER_HIDE_AFTER" in help_text and "--allow-private" in help_text


def test_env_then_flags() -> None:
    env = {
        "MATCHMAKER_PORT": "4000",
        "MATCHMAKER_ALLOW_PRIVATE": "yes",
        "MATCHMAKER_LIST_RATE": "7",
    }
    s = Settings.from_sources(parse_args(["--port", "5000"]), env)
    assert s.port == 5000  # flag beats env
    assert s.allow_private is True and s.list_rate == 7.0
    s = Settings.from_sources(parse_args(["--no-allow-private"]), env)
    assert s.allow_private is False
    s = Settings.from_sources(parse_args(["--store", "redis://r:6379/1"]), {})
    assert s.uses_redis and s.store == "redis://r:6379/1"


def test_conversion_errors_name_their_source() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_sources(parse_args(["--port", "x"]), {"MATCHMAKER_HIDE_AFTER": "soon"})
    text = str(info.value)
    assert "--port: expected an integer, got 'x'" in text
    assert "MATCHMAKER_HIDE_AFTER: expected a number, got 'soon'" in text
    with pytest.raises(SettingsError, match="finite"):
        Settings.from_sources({}, {"MATCHMAKER_KEEPALIVE": "inf"})
    with pytest.raises(SettingsError, match="true/false"):
        Settings.from_sources({}, {"MATCHMAKER_ALLOW_PRIVATE": "maybe"})


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MATCHMAKER_PORT": "70000"}, "--port (MATCHMAKER_PORT): must be in 0..65535"),
        ({"MATCHMAKER_BIND": "localhost"}, "--bind"),
        ({"MATCHMAKER_STORE": "mysql://x"}, "--store"),
        ({"MATCHMAKER_EXPIRE_AFTER": "10"}, "--expire-after"),
        ({"MATCHMAKER_KEEPALIVE": "10"}, "--keepalive"),
        ({"MATCHMAKER_MAX_INFO_BYTES": "4000"}, "--max-info-bytes"),
        ({"MATCHMAKER_LOG_FORMAT": "xml"}, "--log-format"),
        ({"MATCHMAKER_PAGES_IN_FLIGHT": "0"}, "--pages-in-flight"),
        ({"MATCHMAKER_PAGES_IN_FLIGHT": "1025"}, "--pages-in-flight"),
        # A page is one rudp datagram: larger pages could never be sent.
        (
            {"MATCHMAKER_PAGE_BYTES": "1151"},
            "--page-bytes (MATCHMAKER_PAGE_BYTES): must be 256..1150",
        ),
        ({"MATCHMAKER_REGISTER_BURST": "0.5"}, "--register-burst"),
        ({"MATCHMAKER_STATIC_KEY_FILE": "/nonexistent/static.key"}, "--static-key-file"),
        # What is wrong with a key file is said, not only what it should be.
        ({"MATCHMAKER_STATIC_KEY_FILE": "/nonexistent/static.key"}, "No such file"),
        ({"MATCHMAKER_ISSUER_KEY_FILE": "/nonexistent/issuer.key"}, "No such file"),
        # A host refuses a heartbeat interval above an hour: it could never register.
        (
            {
                "MATCHMAKER_KEEPALIVE": "4000",
                "MATCHMAKER_HIDE_AFTER": "9000",
                "MATCHMAKER_EXPIRE_AFTER": "9000",
            },
            "--keepalive (MATCHMAKER_KEEPALIVE): must be in (0, hide_after/2] and at most 3600",
        ),
        ({"MATCHMAKER_RATE_LIMIT_KEYS": "16777217"}, "--rate-limit-keys"),
        (
            {
                "MATCHMAKER_MASTER": "1",
                "MATCHMAKER_PORT": "29950",
                "MATCHMAKER_MASTER_PORT": "29950",
            },
            "--master-port (MATCHMAKER_MASTER_PORT): must differ from --port",
        ),
        ({"MATCHMAKER_STORE": "redis://127.0.0.1:notaport/0"}, "not a usable Redis URL"),
        ({"MATCHMAKER_STORE": "redis://127.0.0.1/0?socket_timeout=abc"}, "--store"),
    ],
)
def test_validation(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_sources({}, env)
    assert needle in str(info.value)


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_sources({}, {"MATCHMAKER_PORT": "-1", "MATCHMAKER_LOG_LEVEL": "loud"})
    assert len(info.value.problems) == 2


def test_zero_workers_is_one_problem() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_sources({}, {"MATCHMAKER_WORKERS": "0"})
    assert len(info.value.problems) == 1


def test_flags_are_not_abbreviated() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--shutdown", "5"])


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(AttributeError):
        s.port = 1  # type: ignore[misc]


def test_main_exits_2_on_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hide-after", "-1"], env={}) == 2
    assert "--hide-after" in capsys.readouterr().err
