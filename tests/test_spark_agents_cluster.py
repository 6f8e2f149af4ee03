"""Many hosts, one query, on a real Spark standalone cluster: ``scripts/demo.sh --cluster``'s scenario.

``examples/cluster.py`` starts a master and a worker from the pyspark package's
``bin/spark-class`` (UIs off), the worker under ``unshare --mount`` with an empty
tmpfs over the channels' parent directory (where this machine allows it), three
producers with their own channel and agent, and a driver reading the agents.
It SIGKILLs an agent mid-batch (restarted 2 s later), the driver's session
mid-batch and a producer, drains, and checks each channel's Parquet rows
against its producer's ledger. A few minutes; marked ``slow`` and ``spark``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from spark_session import pids_mentioning, require_java

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "examples" / "cluster.py"


@pytest.mark.spark
@pytest.mark.slow
def test_three_agents_a_blind_worker_and_kills_deliver_each_channel_exactly_once(tmp_path: Path) -> None:
    require_java()
    work = tmp_path / "cluster"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, str(CLUSTER), str(work), "--rate", "300", "--phase-seconds", "3"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    hidden = subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0
    if hidden:
        assert "empty tmpfs there (executors cannot see the channels)" in out, out
    for host in ("h1", "h2", "h3"):
        m = re.search(
            rf"channel {host}: produced (\d+), delivered (\d+), duplicated 0, lost 0, .* "
            r"never committed 0, damaged 0\n",
            out,
        )
        assert m, out
        assert int(m.group(1)) == int(m.group(2)) > 0
    assert "agents: mutual TLS with the run's CA" in out  # the secure path, end to end
    assert "agent grpc+tls://localhost:" in out
    assert "SIGKILL of agent h2 mid-batch" in out
    assert "SIGKILL of the driver's session mid-batch" in out
    assert "SIGKILL of producer h3" in out
    m = re.search(r"SIGKILL of the executor JVM mid-batch \((\d+) process\)", out)
    assert m, out
    assert int(m.group(1)) >= 1, out  # an executor was there to kill
    assert "processes left behind: 0" in out
    assert pids_mentioning(str(work)) == []
    # the executors read through the agents, never the files (they could not see them)
    stderr = "\n".join(p.read_text(errors="replace") for p in (work / "spark" / "worker").glob("app-*/*/stderr"))
    assert "FilesNotVisibleError" not in stderr
