"""The filechannel pytest plugin (entry point ``pytest11``): fixtures for testing code that uses a channel.

Installed with filechannel, it is loaded by every pytest run; every fixture is
prefixed ``fc_`` so it never clashes with a project's own names, and loading it
imports neither PySpark nor Java.

* ``fc_channel_dir``: a fresh channel directory path (not created) in ``tmp_path``.
* ``fc_channel``: an open channel there, closed after the test.
* ``fc_crashable_channel``: a :class:`~filechannel.testing.crashable.CrashableChannel`
  on a simulated file system; ``.crash(lose="unsynced" | "nothing" | "torn")``
  returns the channel reopened as after a power cut at that instant.

Options for the channels come from the marker ``@pytest.mark.fc_options(**options)``
(any option of :func:`filechannel.open`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import filechannel

from .crashable import CrashableChannel

__all__ = ["fc_channel", "fc_channel_dir", "fc_crashable_channel"]


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``fc_options`` marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line(
        "markers", "fc_options(**options): options for the fc_channel and fc_crashable_channel fixtures"
    )


def _options(request: pytest.FixtureRequest) -> dict[str, Any]:
    marker = request.node.get_closest_marker("fc_options")
    if marker is None:
        return {}
    if marker.args:
        raise pytest.UsageError("fc_options takes keyword arguments only, e.g. @pytest.mark.fc_options(capacity=10)")
    return dict(marker.kwargs)


@pytest.fixture
def fc_channel_dir(tmp_path: Path) -> Path:
    """A path for a new channel directory in ``tmp_path`` (not created: opening creates it)."""
    return tmp_path / "channel"


@pytest.fixture
def fc_channel(fc_channel_dir: Path, request: pytest.FixtureRequest) -> Iterator[filechannel.FileChannel]:
    """An open channel in ``fc_channel_dir`` (options from ``@pytest.mark.fc_options``), closed after the test."""
    ch = filechannel.open(fc_channel_dir, **_options(request))
    try:
        yield ch
    finally:
        ch.close()


@pytest.fixture
def fc_crashable_channel(request: pytest.FixtureRequest) -> Iterator[CrashableChannel]:
    """A channel on a simulated file system that ``.crash(lose=...)`` power-cuts and reopens."""
    ch = CrashableChannel(**_options(request))
    try:
        yield ch
    finally:
        ch.close()
