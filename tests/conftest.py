"""Shared fixtures and Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (set by scripts/test.sh) is derandomized and bounded;
``dev`` is the default locally; ``long`` is for soak runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import filechannel

# The shared SparkSession fixture ``spark``: importing the plugin imports neither PySpark nor Java;
# a session starts only when a test asks for it.
pytest_plugins = ["spark_session"]

settings.register_profile(
    "ci", derandomize=True, max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def chan_dir(tmp_path: Path) -> str:
    """A path for a new channel directory (not created)."""
    return str(tmp_path / "ch")


@pytest.fixture
def channel(chan_dir: str) -> Iterator[filechannel.FileChannel]:
    """An open channel with small files, so tests roll files often."""
    ch = filechannel.open(chan_dir, max_file_size=64 * 1024, minimum_required_space=0, background=False)
    yield ch
    ch.close()
