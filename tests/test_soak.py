"""The soak (bench/soak.py, issue 36) for 3 minutes with seed 1: every fault kind, nothing lost or duplicated.

``python -m bench.soak --minutes 3 --seed 1`` runs three writable agents with
mutual TLS, producers on HTTP (Idempotency-Key retries), Flight (producer
sequences) and tailed files (rotated by rename), a Spark standalone cluster
reading through the agents (behind a TCP fault proxy) into Parquet, and seed
1's fault schedule, which covers every kind: SIGKILL and SIGSTOP/SIGCONT of
agents, the driver, the executor JVM and producers; delay, cut connections and
a black hole between Spark and the agents; and a full disk under one channel
where the channel makes a full disk back-pressure. Its JSON summary must say:
every acknowledged event delivered once, in order, nothing else, no process
left. About 4 to 5 minutes; marked ``slow`` and ``spark``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from spark_session import pids_mentioning, require_java

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.spark
@pytest.mark.slow
def test_a_three_minute_soak_with_every_fault_kind_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    require_java()
    from bench.soak import KINDS, disk_fault_supported

    work = tmp_path / "soak"
    png = tmp_path / "soak.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "bench.soak", "--minutes", "3", "--seed", "1"]
    argv += ["--workdir", str(work), "--png", str(png)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out, err = p.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        p.terminate()  # the soak sweeps every process it started, then prints its summary
        out, err = p.communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out[-3000:] + err[-5000:]
    s = json.loads(lines[-1])
    report = json.dumps({k: v for k, v in s.items() if k != "log"}, indent=1)[:6000] + err[-3000:]
    assert p.returncode == 0, report
    assert s["ok"], report
    assert s["acked"] > 1000, report
    for key in ("lost", "duplicated", "unexpected_events", "out_of_order", "damaged"):
        assert s[key] == 0, f"{key}: {report}"
    for path in ("http", "flight", "tail"):
        assert s["paths"][path]["acked"] > 0, report
        assert s["paths"][path]["delivered"] == s["paths"][path]["acked"], report
    disk = (
        disk_fault_supported()
        and shutil.which("nsenter") is not None
        and subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0
    )
    assert s["disk_fault"] == disk, report
    for kind in KINDS:
        if kind != "disk_full" or disk:
            assert s["faults"][kind] >= 1, f"{kind} never injected: {report}"
    assert s["fault_kinds_missing"] == [], report
    assert s["processes_left"] == 0, report
    assert pids_mentioning(str(work)) == []
    if s.get("png"):
        assert png.stat().st_size > 10_000
