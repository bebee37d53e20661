"""PEP 517 build backend: setuptools' own, plus the ``RUDP_COMPILE`` switch.

``RUDP_COMPILE=1 pip install .`` (or ``pip wheel .``) compiles the per-message code
with mypyc and builds the C extension ``rudp._batch`` (see setup.py). Only then is
mypy, which provides mypyc, added to the build requirements; a plain build needs
setuptools alone, and ``RUDP_COMPILE=native`` (the C extension alone) setuptools and
a C compiler. Editable installs, sdists and metadata preparation are always pure
Python: an editable install must run the sources as edited, and the extensions are
built for ``build_wheel`` only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every hook not overridden below)

SWITCH = "RUDP_COMPILE"
MYPYC_REQUIRES = ["mypy>=1.10"]  # mypyc ships with mypy; keep in step with the dev extra


def _compiling() -> bool:
    """Whether mypyc runs (``RUDP_COMPILE=native`` builds only the C extension)."""
    return os.environ.get(SWITCH, "").strip() not in ("", "0", "native")


@contextlib.contextmanager
def _pure() -> Iterator[None]:
    saved = os.environ.get(SWITCH)
    os.environ[SWITCH] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = saved


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    compiling = _compiling()
    with _pure():  # setuptools runs setup.py to ask: mypy is not installed yet
        requires = list(_setuptools.get_requires_for_build_wheel(config_settings))
    return requires + MYPYC_REQUIRES if compiling else requires


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    with _pure():  # the metadata is the same; don't run mypyc twice
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    with _pure():
        return list(_setuptools.get_requires_for_build_editable(config_settings))


def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: Any = None
) -> str:
    with _pure():
        return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(
    wheel_directory: str, config_settings: Any = None, metadata_directory: Any = None
) -> str:
    with _pure():
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_sdist(config_settings: Any = None) -> list[str]:
    with _pure():
        return list(_setuptools.get_requires_for_build_sdist(config_settings))


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    with _pure():
        return _setuptools.build_sdist(sdist_directory, config_settings)
