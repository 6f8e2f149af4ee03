"""The benchmark runs end to end and prints valid JSON lines (not how fast: no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(*args: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``python -m <args>`` from the project root; return (every JSON line, the result lines)."""
    out = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    results = [r for r in lines if "workload" in r]
    assert results, out.stdout[-2000:]
    return lines, results


@pytest.mark.slow
def test_quick_bench_prints_json_lines(tmp_path: Path) -> None:
    lines, results = run_bench("bench", "--quick", "--n", "300", "--out", str(tmp_path / "out"))
    for r in results:
        for key in ("machine", "fsync", "event_size", "workload", "system", "median", "min", "max", "repeats"):
            assert key in r, (key, r)
        assert r["min"] <= r["median"] <= r["max"]
    systems = {r["system"] for r in results}
    assert {"filechannel-commit", "filechannel-interval", "sqlite-wal-full"} <= systems
    assert any(r["workload"].startswith("memory at") for r in results)
    assert any(r.get("type") == "target" for r in lines)
    assert list((tmp_path / "out").glob("results-*.jsonl"))


@pytest.mark.slow
def test_quick_reader_bench_prints_json_lines() -> None:
    lines, results = run_bench("bench.reader", "--quick", "--n", "400", "--calls", "300")
    for r in results:
        for key in ("machine", "workload", "system", "event_size", "fsync", "median", "min", "max", "repeats", "unit"):
            assert key in r, (key, r)
        assert r["min"] <= r["median"] <= r["max"]
    workloads = {r["workload"] for r in results}
    assert {"put x100", "take x100", "follow x100", "catch-up", "read all", "available() idle"} <= workloads
    units = {r["unit"] for r in results}
    assert {"events/s", "us", "x"} <= units
    assert any(r.get("type") == "run" for r in lines)


@pytest.mark.slow
def test_quick_encryption_bench_prints_json_lines() -> None:
    pytest.importorskip("cryptography", reason="the crypto extra is not installed")
    lines, results = run_bench("bench.encryption", "--quick", "--n", "300")
    for r in results:
        for key in ("machine", "workload", "system", "event_size", "fsync", "median", "min", "max", "repeats", "unit"):
            assert key in r, (key, r)
        assert r["min"] <= r["median"] <= r["max"]
    systems = {r["system"] for r in results}
    assert {"plaintext", "aes-256-gcm", "chacha20-poly1305", "aes-256-gcm / plaintext"} <= systems
    assert {r["workload"] for r in results} == {"put x100", "take x100", "seal cost (CPU)", "batch tag cost (CPU)"}
    assert {"aes-256-gcm tag / sealed framing", "chacha20-poly1305 tag / sealed framing"} <= systems
    assert any(r.get("type") == "target" for r in lines)


@pytest.mark.slow
def test_quick_wal_bench_prints_json_lines() -> None:
    lines, results = run_bench("bench.wal", "--quick", "--seconds", "0.1")
    for r in results:
        for key in ("machine", "workload", "system", "event_size", "fsync", "median", "min", "max", "repeats", "unit"):
            assert key in r, (key, r)
        assert r["min"] <= r["median"] <= r["max"]
        assert r["median"] > 0
    systems = {r["system"] for r in results}
    assert {"wal write x1", "wal write x16 threads", "wal write_many x100", "raw per record"} <= systems
    assert {r["event_size"] for r in results} == {100, 4096}
    assert any(r.get("type") == "run" for r in lines)


@pytest.mark.slow
def test_quick_sources_bench_prints_json_lines() -> None:
    pytest.importorskip("msgpack", reason="the sources extra is not installed")
    pytest.importorskip("aiohttp", reason="the agent extra is not installed")
    lines, results = run_bench("bench.sources", "--quick")
    systems = {r["system"] for r in results}
    assert {"tcp discard (ceiling)", "otlp protobuf", "forward + chunk", "http json", "flight put_batch"} <= systems
    assert {r["clients"] for r in results} == {1, 8}
    assert "otlp protobuf / http json" in systems
    for r in results:
        assert r["min"] <= r["median"] <= r["max"]
    assert any(r.get("type") == "run" for r in lines)
