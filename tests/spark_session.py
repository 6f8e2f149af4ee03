"""The one local SparkSession of a test run (a pytest plugin, loaded by conftest.py).

Nothing here imports PySpark or starts a JVM until a test asks for the
``spark`` fixture, so the rest of the suite runs without them. Every test that
uses the fixture is marked ``spark`` (deselect them with ``-m "not spark"``).
Java 17+ is required: without it each Spark test fails with one line saying so
(CI has it, so a missing Java is an error, not a skip).

Settings: those of :func:`filechannel.testing.processes.local_spark` (``local[2]``,
``spark.sql.shuffle.partitions=1``, no UI, 1 GiB of driver memory, the
``filechannel`` data source registered), and the workers on this interpreter
(``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

JAVA_NEEDED = "the Spark tests need Java 17+"


def java_problem() -> str | None:
    """Return one line saying why Java cannot run Spark here, or None if it can."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if home and not os.access(java or "", os.X_OK):
        return f"{JAVA_NEEDED}: JAVA_HOME={home} has no bin/java; point JAVA_HOME at a JDK 17+ or unset it"
    if not java:
        return f"{JAVA_NEEDED}: no `java` on PATH; install a JDK 17+ (e.g. openjdk-17-jre-headless)"
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{JAVA_NEEDED}: `{java} -version` failed: {exc}"
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return f"{JAVA_NEEDED}: cannot tell the version of {java}: {(out.stderr or out.stdout).strip()[:200]}"
    major = int(m.group(1))
    if major == 1 and m.group(2):  # "1.8.0_392"
        major = int(m.group(2))
    if major < 17:
        return f"{JAVA_NEEDED}: {java} is Java {major}; install a JDK 17+ or point JAVA_HOME at one"
    return None


def require_java() -> None:
    """Fail the calling test with :func:`java_problem`'s line when Java cannot run Spark (CI has it: no skip)."""
    problem = java_problem()
    if problem:
        pytest.fail(problem, pytrace=False)


def pids_mentioning(text: str) -> list[int]:
    """The live processes other than this one whose command line holds ``text`` (what a run left behind)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(d))
        except OSError:
            continue
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the ``spark`` fixture (so ``-m "not spark"`` deselects it)."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()) and item.get_closest_marker("spark") is None:
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local SparkSession with the ``filechannel`` data source registered, shared by the whole run."""
    require_java()
    try:
        import pyspark.sql  # noqa: F401

        import filechannel.spark  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the Spark tests need the spark extra: {exc}", pytrace=False)
    from filechannel.testing.processes import local_spark

    # The Python workers must be this interpreter (it has filechannel and pyarrow).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = local_spark("filechannel-tests", tmp_path_factory.mktemp("spark"))
    yield session
    session.stop()
