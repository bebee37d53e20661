"""Daemon settings: one frozen dataclass, every default written and explained once.

Theory of operation
-------------------
Each field of `Settings` is one setting.  Its command-line flag is the field
name with dashes (``--hide-after``) and its environment variable is
``MATCHMAKER_`` plus the upper-cased name (``MATCHMAKER_HIDE_AFTER``); a flag
beats the environment, which beats the default.  `Settings.from_sources`
converts the strings and validates every value and the relations between them,
collecting *all* problems into one `SettingsError` so an operator fixes a
broken config in one go.  `cli.py` builds its parser from the same fields, so
the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from matchmaker.addresses import normalise_ip
from matchmaker.keys import parse_key, read_key_file
from matchmaker.messages import Limits
from matchmaker.ratelimit import Rate
from matchmaker.registry import REDIS_SCHEMES

ENV_PREFIX = "MATCHMAKER_"
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_WORKERS = 64
MAX_KEEPALIVE = 3600.0
"""The longest heartbeat interval a host takes from the daemon (its reader's bound on
the `registered` reply's ``keepalive``)."""


class SettingsError(ValueError):
    """One or more settings are invalid; the message lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid settings:\n  " + "\n  ".join(problems))
        self.problems = problems


def _s(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    # -- network
    bind: str = _s("0.0.0.0", "address the UDP (rudp) port listens on")
    port: int = _s(27950, "UDP port for the matchmaker protocol")
    http_bind: str = _s("0.0.0.0", "address of the HTTP port (/metrics /healthz /readyz /servers)")
    http_port: int = _s(27951, "HTTP port")
    max_connections: int = _s(20000, "rudp connections at once (a listed host holds none)")
    max_connections_per_source: int = _s(
        64, "rudp connections at once from one source (IPv4 / IPv6 /64); 0: no limit"
    )
    handshake_rate: float = _s(20.0, "rudp handshakes per second per source; 0: no limit")
    handshake_burst: int = _s(100, "rudp handshake burst per source")
    # -- registry
    store: str = _s("memory://", "registry: memory:// or redis://host:port/db")
    redis_prefix: str = _s("{mm}:", "key prefix in Redis (braces: one cluster slot)")
    replica_id: str = _s("", "this replica's id in a shared registry (default: host-pid-random)")
    hide_after: float = _s(15.0, "seconds without a heartbeat before a host is left out of lists")
    expire_after: float = _s(30.0, "seconds without a heartbeat before a host is removed")
    keepalive: float = _s(5.0, "heartbeat interval asked of hosts, seconds")
    sweep_interval: float = _s(1.0, "seconds between expiry sweeps")
    # -- abuse limits
    max_hosts_per_ip: int = _s(16, "registered hosts allowed per public IP (IPv6: per /64)")
    register_rate: float = _s(1.0, "registrations+updates per second per source (IPv4 / IPv6 /64)")
    register_burst: float = _s(10.0, "registration burst per source")
    list_rate: float = _s(2.0, "list requests per second per source")
    list_burst: float = _s(10.0, "list request burst per source")
    introduce_rate: float = _s(2.0, "introductions per second per source")
    introduce_burst: float = _s(10.0, "introduction burst per source")
    rate_limit_keys: int = _s(65536, "sources tracked by each rate limiter (LRU beyond)")
    allow_private: bool = _s(False, "LAN/dev: list loopback, private and link-local hosts")
    max_message_bytes: int = _s(4096, "largest accepted request, bytes")
    max_info_bytes: int = _s(512, "largest opaque host info blob, bytes")
    max_tags: int = _s(16, "tags per host and per filter")
    list_limit: int = _s(1000, "most hosts one list request returns")
    # -- list paging
    page_hosts: int = _s(32, "most hosts per list page")
    # One page is one rudp message, which must fit one datagram: 1176 bytes
    # with rudp's 1200-byte datagrams; 1150 leaves room for the page header.
    page_bytes: int = _s(1150, "target size of one list page, bytes (one datagram, <= 1150)")
    page_per_ip: int = _s(2, "most hosts from one IP (IPv6: one /64) in one page")
    # A 10,000-host list is ~1,250 pages; at 100 ms RTT the window, not the
    # bandwidth, sets its time (docs/performance.md, "Matchmaker").  The
    # daemon's rudp window follows it (never below rudp's 256); 1024 is rudp's
    # replay window, beyond which a peer refuses packets as too old.
    pages_in_flight: int = _s(1024, "unacknowledged list pages per connection")
    # A client that never acknowledges must not make the daemon hold its answers:
    # one answer is sent at a time per connection, a few more wait, and every
    # connection's unacknowledged pages share one budget (docs/matchmaker.md, "Lists").
    lists_per_connection: int = _s(4, "list requests one connection may have unanswered")
    list_bytes_in_flight: int = _s(
        16 * 1024 * 1024, "unacknowledged list page bytes, all connections together"
    )
    list_ack_timeout: float = _s(
        15.0, "seconds list pages may wait unacknowledged before the connection is closed"
    )
    # -- master server protocols (for server browsers that predate us)
    master: bool = _s(False, "answer Steam master and Quake III getservers queries (UDP)")
    master_port: int = _s(27011, "UDP port of --master (0: any free port)")
    # -- HTTP
    http_timeout: float = _s(5.0, "seconds to read one HTTP request")
    http_max_connections: int = _s(256, "concurrent HTTP connections")
    metrics_max_games: int = _s(20, "games with their own hosts-listed series; the rest: _other")
    # -- connect tokens (matchmaker.keys)
    issuer_key_file: str = _s("", "file of the Ed25519 key signing connect tokens (keygen --out)")
    issuer_key: str = _s("", "the token-signing key in hex; prefer the env var or the file")
    ephemeral_issuer_key: bool = _s(
        False, "make a token-signing key in memory at start: development only, never production"
    )
    token_lifetime: float = _s(30.0, "seconds a connect token stays good")
    static_key_file: str = _s(
        "",
        "file of the rudp static key (64 hex digits): clients given its public half "
        "authenticate the matchmaker (Noise NK)",
    )
    # -- process
    # Each worker is a process of its own with its own replica id in the shared
    # registry, behind the one address (SO_REUSEPORT): see matchmaker/workers.py.
    workers: int = _s(
        1, "worker processes behind the one address (SO_REUSEPORT); > 1 needs a redis:// store"
    )
    worker_watchdog: float = _s(
        10.0, "seconds a worker may go without a sign of life before it is killed and restarted"
    )
    shutdown_timeout: float = _s(10.0, "seconds to close connections on SIGTERM before cancelling")
    log_format: str = _s("auto", "auto (console on a TTY, else JSON), json or console")
    log_level: str = _s("info", "debug, info, warning or error")

    # ------------------------------------------------------------------ derived

    @property
    def limits(self) -> Limits:
        return Limits(
            max_message_bytes=self.max_message_bytes,
            info_bytes=self.max_info_bytes,
            max_tags=self.max_tags,
            list_limit=self.list_limit,
        )

    def startup_fields(self) -> dict[str, object]:
        """The effective settings an operator checks in the startup log line.

        The store's password, if its URL has one, is masked.
        """
        return {
            "store": _masked_url(self.store),
            "allow_private": self.allow_private,
            "max_connections": self.max_connections,
            "max_connections_per_source": self.max_connections_per_source,
            "handshake_rate": f"{self.handshake_rate:g}/s burst {self.handshake_burst}",
            "max_hosts_per_ip": self.max_hosts_per_ip,
            "list_limit": self.list_limit,
            "register_rate": f"{self.register_rate:g}/s burst {self.register_burst:g}",
            "list_rate": f"{self.list_rate:g}/s burst {self.list_burst:g}",
            "introduce_rate": f"{self.introduce_rate:g}/s burst {self.introduce_burst:g}",
            "master": self.master_port if self.master else "off",
            "workers": self.workers,
            "issuer": self.issuer_source,
        }

    @property
    def issuer_source(self) -> str:
        """Where the token-signing key comes from: file, env, ephemeral or none."""
        if self.issuer_key_file:
            return "file"
        if self.issuer_key:
            return "env"
        return "ephemeral" if self.ephemeral_issuer_key else "none"

    def issuer_private_key(self) -> bytes | None:
        """The token-signing key from the file or the setting (None: ephemeral or none)."""
        if self.issuer_key_file:
            return read_key_file(self.issuer_key_file)
        if self.issuer_key:
            return parse_key(self.issuer_key)
        return None

    def static_private_key(self) -> bytes | None:
        """The rudp static key from ``static_key_file`` (None: Noise NN only)."""
        return read_key_file(self.static_key_file) if self.static_key_file else None

    @property
    def register_bucket(self) -> Rate:
        return Rate(rate=self.register_rate, burst=self.register_burst)

    @property
    def list_bucket(self) -> Rate:
        return Rate(rate=self.list_rate, burst=self.list_burst)

    @property
    def introduce_bucket(self) -> Rate:
        return Rate(rate=self.introduce_rate, burst=self.introduce_burst)

    @property
    def uses_redis(self) -> bool:
        return self.store.startswith(REDIS_SCHEMES)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None
    ) -> Settings:
        """Settings from parsed flags (field name -> value) over env vars over defaults."""
        flags = flags or {}
        env = env or {}
        values: dict[str, Any] = {}
        problems: list[str] = []
        for f in dataclasses.fields(cls):
            raw = flags.get(f.name)
            origin = flag_name(f.name)
            if raw is None and env_name(f.name) in env:
                raw, origin = env[env_name(f.name)], env_name(f.name)
            if raw is None:
                continue
            try:
                values[f.name] = _convert(raw, type(f.default))
            except ValueError as exc:
                problems.append(f"{origin}: {exc}")
        if problems:
            raise SettingsError(problems)
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise SettingsError listing every invalid value."""
        problems = [f"{flag_name(name)} ({env_name(name)}): {msg}" for name, msg in _checks(self)]
        if problems:
            raise SettingsError(problems)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _convert(raw: object, kind: type) -> object:
    if not isinstance(raw, str):
        return raw  # argparse already typed it (booleans)
    text = raw.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {raw!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return value
    return text


def _masked_url(url: str) -> str:
    """``url`` with the password of its userinfo, if any, replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{host}"


def _is_ip(text: str) -> bool:
    try:
        normalise_ip(text)
    except ValueError:
        return False
    return True


Check = tuple[str, Callable[["Settings"], bool], str | Callable[["Settings"], str]]
"""(setting, test, what is wrong: a text, or a function of the settings for a text that
names the cause)."""

_RULES: list[Check] = [
    ("bind", lambda s: _is_ip(s.bind), "must be an IP address"),
    ("http_bind", lambda s: _is_ip(s.http_bind), "must be an IP address"),
    ("port", lambda s: 0 <= s.port <= 65535, "must be in 0..65535 (0: any free port)"),
    ("http_port", lambda s: 0 <= s.http_port <= 65535, "must be in 0..65535 (0: any free port)"),
    (
        "master_port",
        lambda s: 0 <= s.master_port <= 65535,
        "must be in 0..65535 (0: any free port)",
    ),
    (
        "master_port",
        lambda s: not s.master or s.master_port == 0 or s.master_port != s.port,
        "must differ from --port (both are UDP ports on --bind)",
    ),
    ("max_connections", lambda s: 1 <= s.max_connections <= 1_000_000, "must be 1..1000000"),
    (
        "max_connections_per_source",
        lambda s: 0 <= s.max_connections_per_source <= 1_000_000,
        "must be 0..1000000 (0: no limit)",
    ),
    ("handshake_rate", lambda s: s.handshake_rate >= 0, "must be >= 0 (0: no limit)"),
    ("handshake_burst", lambda s: 1 <= s.handshake_burst <= 1_000_000, "must be 1..1000000"),
    (
        "store",
        lambda s: s.store == "memory://" or s.store.startswith(REDIS_SCHEMES),
        "must be memory:// or a redis://, rediss:// or unix:// URL",
    ),
    (
        "store",
        lambda s: not s.uses_redis or _store_problem(s) is None,
        lambda s: f"is not a usable Redis URL: {_store_problem(s)}",
    ),
    ("redis_prefix", lambda s: 0 < len(s.redis_prefix) <= 64, "must be 1..64 characters"),
    ("replica_id", lambda s: len(s.replica_id) <= 64, "must be at most 64 characters"),
    ("hide_after", lambda s: s.hide_after > 0, "must be > 0"),
    ("expire_after", lambda s: s.expire_after >= s.hide_after, "must be >= --hide-after"),
    (
        "keepalive",
        lambda s: 0 < s.keepalive * 2 <= s.hide_after and s.keepalive <= MAX_KEEPALIVE,
        f"must be in (0, hide_after/2] and at most {MAX_KEEPALIVE:g} (what a host takes)",
    ),
    (
        "sweep_interval",
        lambda s: 0 < s.sweep_interval <= s.hide_after,
        "must be in (0, hide_after]",
    ),
    ("max_hosts_per_ip", lambda s: s.max_hosts_per_ip >= 1, "must be >= 1"),
    ("register_rate", lambda s: s.register_rate > 0, "must be > 0"),
    ("list_rate", lambda s: s.list_rate > 0, "must be > 0"),
    ("introduce_rate", lambda s: s.introduce_rate > 0, "must be > 0"),
    ("register_burst", lambda s: s.register_burst >= 1, "must be >= 1"),
    ("list_burst", lambda s: s.list_burst >= 1, "must be >= 1"),
    ("introduce_burst", lambda s: s.introduce_burst >= 1, "must be >= 1"),
    ("rate_limit_keys", lambda s: 1 <= s.rate_limit_keys <= 1 << 24, "must be 1..16777216"),
    ("max_message_bytes", lambda s: 256 <= s.max_message_bytes <= 65536, "must be 256..65536"),
    (
        "max_info_bytes",
        lambda s: 1 <= s.max_info_bytes <= s.max_message_bytes // 2,
        "must be 1..max_message_bytes/2",
    ),
    ("max_tags", lambda s: 1 <= s.max_tags <= 64, "must be 1..64"),
    ("list_limit", lambda s: 1 <= s.list_limit <= 100_000, "must be 1..100000"),
    ("page_hosts", lambda s: 1 <= s.page_hosts <= 1000, "must be 1..1000"),
    ("page_bytes", lambda s: 256 <= s.page_bytes <= 1150, "must be 256..1150 (one datagram)"),
    ("page_per_ip", lambda s: s.page_per_ip >= 1, "must be >= 1"),
    ("pages_in_flight", lambda s: 1 <= s.pages_in_flight <= 1024, "must be 1..1024"),
    ("lists_per_connection", lambda s: 1 <= s.lists_per_connection <= 64, "must be 1..64"),
    (
        "list_bytes_in_flight",
        lambda s: s.list_bytes_in_flight >= s.page_bytes,
        "must be >= page_bytes",
    ),
    ("list_ack_timeout", lambda s: s.list_ack_timeout > 0, "must be > 0"),
    ("http_timeout", lambda s: s.http_timeout > 0, "must be > 0"),
    ("http_max_connections", lambda s: s.http_max_connections >= 1, "must be >= 1"),
    ("metrics_max_games", lambda s: 0 <= s.metrics_max_games <= 1000, "must be 0..1000"),
    (
        "issuer_key_file",
        lambda s: not s.issuer_key_file or _key_problem(s) is None,
        lambda s: (
            f"must be a key file written by 'python -m matchmaker keygen --out' ({_key_problem(s)})"
        ),
    ),
    ("issuer_key", lambda s: not s.issuer_key or _key_problem(s) is None, "must be 64 hex digits"),
    (
        "ephemeral_issuer_key",
        lambda s: not s.ephemeral_issuer_key or not (s.issuer_key or s.issuer_key_file),
        "cannot be combined with a key (--issuer-key-file or --issuer-key)",
    ),
    ("issuer_key", lambda s: not (s.issuer_key and s.issuer_key_file), "or a file, not both"),
    ("token_lifetime", lambda s: 1 <= s.token_lifetime <= 3600, "must be 1..3600"),
    (
        "static_key_file",
        lambda s: not s.static_key_file or _static_key_problem(s) is None,
        lambda s: (
            "must be a file with one line of 64 hex digits (a random 32-byte key) "
            f"({_static_key_problem(s)})"
        ),
    ),
    ("workers", lambda s: 1 <= s.workers <= MAX_WORKERS, f"must be 1..{MAX_WORKERS}"),
    ("worker_watchdog", lambda s: 3 <= s.worker_watchdog <= 3600, "must be 3..3600"),
    (
        "workers",
        lambda s: s.workers <= 1 or s.uses_redis,
        "more than 1 needs a redis:// store: the workers share the registry as replicas "
        "do, and memory:// is one process's own",
    ),
    ("shutdown_timeout", lambda s: s.shutdown_timeout > 0, "must be > 0"),
    ("log_format", lambda s: s.log_format in LOG_FORMATS, f"must be one of {LOG_FORMATS}"),
    ("log_level", lambda s: s.log_level in LOG_LEVELS, f"must be one of {LOG_LEVELS}"),
]


def _key_problem(s: Settings) -> str | None:
    try:
        s.issuer_private_key()
    except ValueError as exc:
        return str(exc)
    return None


def _static_key_problem(s: Settings) -> str | None:
    try:
        s.static_private_key()
    except ValueError as exc:
        return str(exc)
    return None


def _store_problem(s: Settings) -> str | None:
    """What redis-py finds wrong in the store's URL (a port that is not a number, an
    option it cannot read), before the daemon starts on it."""
    try:
        from redis.connection import parse_url
    except ImportError:  # the daemon says so when it opens the store
        return None
    try:
        parse_url(s.store)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _checks(s: Settings) -> list[tuple[str, str]]:
    return [
        (name, msg if isinstance(msg, str) else msg(s)) for name, ok, msg in _RULES if not ok(s)
    ]
