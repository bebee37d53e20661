"""Host registries: one interface (`Registry`), two implementations.

``memory://`` (the default) keeps everything in this process;
``redis://host:port/db`` (or ``rediss://``, ``unix://``) shares one registry
between several matchmaker replicas.
"""

from __future__ import annotations

from matchmaker.registry.base import (
    Change,
    ChangeKind,
    FeedOverflow,
    HostRecord,
    LocalIndex,
    Notice,
    NotRegistered,
    Registry,
    RegistryBusy,
    RegistryError,
    RegistryFull,
    RegistryUnavailable,
    RemovalReason,
    Subscription,
    Takeover,
    TakeoverResult,
    TooManyHosts,
)
from matchmaker.registry.memory import MemoryRegistry

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

__all__ = [
    "REDIS_SCHEMES",
    "Change",
    "ChangeKind",
    "FeedOverflow",
    "HostRecord",
    "LocalIndex",
    "MemoryRegistry",
    "NotRegistered",
    "Notice",
    "Registry",
    "RegistryBusy",
    "RegistryError",
    "RegistryFull",
    "RegistryUnavailable",
    "RemovalReason",
    "Subscription",
    "Takeover",
    "TakeoverResult",
    "TooManyHosts",
]
