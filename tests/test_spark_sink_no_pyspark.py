"""The sink's commit-protocol tests run, and pass, where PySpark and pyarrow cannot be imported (issue 23).

``test_spark_sink.py`` drives staging and ``SinkCommitter`` with no SparkSession;
it used to be skipped whole when PySpark was missing. Here pytest runs it in a
subprocess whose import system refuses ``pyspark`` and ``pyarrow`` as if they
were not installed: every test it collects (those marked slow aside) must
pass, none skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TARGET = str(TESTS / "test_spark_sink.py")

_BLOCKED_RUN = r"""
import sys

class Missing:
    # find_spec raising ModuleNotFoundError is what a missing package looks like to an import.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "pyarrow", "py4j"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
import pytest

code = pytest.main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("pyspark", "pyarrow"))
print("imported:", ",".join(leaked) or "none")
sys.exit(code)
"""


def _pytest(*args: str, blocked: bool) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", _BLOCKED_RUN] if blocked else [sys.executable, "-m", "pytest"]
    return subprocess.run(
        [*cmd, "-p", "no:cacheprovider", "-p", "no:randomly", "-m", "not slow", *args],
        cwd=str(TESTS.parent),
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_protocol_tests_pass_without_pyspark_or_pyarrow() -> None:
    collected = _pytest("--collect-only", "-q", TARGET, blocked=False)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    n = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    assert n >= 10  # the protocol's tests, not an empty module

    r = _pytest("-q", TARGET, blocked=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    summary = [line for line in r.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    assert summary, out
    assert re.search(rf"\b{n} passed\b", summary[-1]), summary[-1]
    for word in ("skipped", "failed", "error"):
        assert word not in summary[-1], summary[-1]
    assert "imported: none" in r.stdout  # PySpark and pyarrow really were out of reach
