"""stream_test: a StreamTest for PySpark with crashes.

The Spark tests run the worked example of docs/testing.md (its job module and
its test function, executed here) on its two ``foreachBatch`` sinks: the producer is killed with a transaction open,
then the driver is killed (with its JVM) right after the sink wrote a batch and
before Spark's commit log, and restarted on the same checkpoint. The
idempotent sink (one directory per batch id, overwritten) passes; the appending
sink (no record of batch ids) writes the replayed batch twice and is caught.
Each costs two driver (JVM) starts; the argument checks need no Spark.
"""

from __future__ import annotations

import fnmatch
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_testing_docs import DOC, FILES, TESTS, expected_lines

from filechannel.errors import ConfigError
from filechannel.testing import (
    AddData,
    CheckAnswer,
    CheckExactlyOnce,
    CrashDriver,
    ExpectFailure,
    ProcessAllAvailable,
    StartStream,
    StreamTestError,
    stream_test,
)
from filechannel.testing.stream import _expected_matches, kill_session, session_pids


def doc_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """The worked example of docs/testing.md: its job module importable, its test function."""
    (tmp_path / "my_job.py").write_text(FILES["my_job.py"])
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver subprocess sees it too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a failing run keeps its work dir: here
    code = next(t for t in TESTS if "spark" in t[0])[1]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/testing.md", "exec"), namespace)
    return namespace["test_exactly_once_across_crashes"]  # type: ignore[no-any-return]


@pytest.mark.spark
@pytest.mark.slow
def test_doc_example_an_idempotent_foreach_batch_sink_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc_example(tmp_path, monkeypatch)("my_job:write_batches")  # it asserts the driver crashed once, as armed


@pytest.mark.spark
@pytest.mark.slow
def test_doc_example_a_non_idempotent_foreach_batch_sink_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    test = doc_example(tmp_path, monkeypatch)
    with pytest.raises(StreamTestError) as ei:
        test("my_job:append_batches")
    e = ei.value
    msg = str(e)
    assert e.step == 9, msg
    assert isinstance(e.action, CheckExactlyOnce)
    assert msg.startswith("stream_test step 9 of 9 failed: CheckExactlyOnce()"), msg
    assert "not exactly once: produced 8, delivered 16: missing 0, duplicated 8 (8 items), unexpected 0" in msg
    assert "  6 ProcessAllAvailable()  ok" in msg
    assert "the sink held 16 rows" in msg
    assert e.rows is not None
    orders = [f"order-{i}".encode() for i in range(8)]
    assert sorted(row["body"] for row in e.rows) == sorted(orders * 2)
    # what docs/testing.md shows is what it says
    m = re.search(r"```\n(E   filechannel\.testing\.stream\.StreamTestError: .*?)```", DOC, flags=re.S)
    assert m, "docs/testing.md shows no StreamTestError output"
    shown = m.group(1)
    lines = [f"{type(e).__module__}.{type(e).__name__}: {msg.splitlines()[0]}", *msg.splitlines()]
    for pattern in expected_lines(shown):
        pattern = pattern.replace("/tmp/", "*/")  # the work dir is in tmp_path here
        assert any(fnmatch.fnmatchcase(line, pattern) for line in lines), pattern


@pytest.mark.spark
@pytest.mark.slow
def test_check_answer_then_crash_after_sink_needs_a_foreach_batch_sink(tmp_path: Path) -> None:
    steps = [AddData([b"x", b"y"]), StartStream(), ProcessAllAvailable(), CheckAnswer([(0, b"x"), (1, b"y")])]
    with pytest.raises(StreamTestError) as ei:
        stream_test(
            "stream_queries:file_sink", [*steps, CrashDriver(at="after_sink"), ProcessAllAvailable()], work_dir=tmp_path
        )
    msg = str(ei.value)
    assert ei.value.step == 5, msg
    assert "  4 CheckAnswer(2 rows)  ok" in msg
    assert "CrashDriver(at='after_sink') needs a foreachBatch sink" in msg
    assert "use CrashDriver() (a kill at any instant) instead" in msg


@pytest.mark.spark
@pytest.mark.slow
def test_expect_failure() -> None:
    steps = [AddData([b"x"]), StartStream(), ExpectFailure(match=r"boom: batch 0 holds 1 rows")]
    r = stream_test("stream_queries:failing_sink", steps)
    assert any("the query failed as expected" in line for line in r.log), r.log


def test_a_step_that_needs_a_stream_says_so_without_starting_spark(tmp_path: Path) -> None:
    with pytest.raises(StreamTestError) as ei:
        stream_test(
            "stream_queries:file_sink", [AddData([b"a"]), ProcessAllAvailable(), CheckExactlyOnce()], work_dir=tmp_path
        )
    msg = str(ei.value)
    assert msg.splitlines()[:2] == [
        "stream_test step 2 of 3 failed: ProcessAllAvailable()",
        "  ProcessAllAvailable: no stream is running (add a StartStream() before it)",
    ]
    assert "  1 AddData(1 events)  ok" in msg
    assert "  3 CheckExactlyOnce()  not run" in msg
    assert "no driver ran: the sink was not read" in msg
    assert f"logs of the driver and producer processes: {tmp_path}" in msg
    assert (tmp_path / "producer-1.log").exists()


def test_check_answer_compares_rows_in_any_order() -> None:
    rows = [{"position": 1, "body": bytearray(b"b")}, {"position": 0, "body": bytearray(b"a")}]
    assert _expected_matches(rows, [(0, b"a"), (1, b"b")]) is None
    assert _expected_matches(rows, [{"body": b"b", "position": 1}, {"position": 0, "body": b"a"}]) is None
    assert _expected_matches(rows, [(0, b"a")]) == (
        "expected 1 rows, the sink holds 2; 1 rows not expected, first: {'position': 1, 'body': bytearray(b'b')}"
    )
    problem = _expected_matches(rows, [(0, b"a"), (1, b"b"), (1, b"b")])
    assert problem is not None
    assert problem == "expected 3 rows, the sink holds 2; 1 expected rows not in the sink, first: (1, b'b')"
    assert _expected_matches([{"n": 1}, {"n": 2}], [1, 2]) is None


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="invalid option query: 'stream_queries' is not 'module:function'"):
        stream_test("stream_queries", [])
    with pytest.raises(ConfigError, match="cannot be imported by the driver subprocess"):
        stream_test(lambda spark, c, o: None, [])
    with pytest.raises(ConfigError, match="step 2 is 'StartStream', not one of AddData"):
        stream_test("stream_queries:file_sink", [StartStream(), "StartStream"])
    with pytest.raises(ConfigError, match="invalid option timeout"):
        stream_test("stream_queries:file_sink", [], timeout=0)


# A session like a Spark driver's: the leader, and a child that moves itself into a process group of
# its own (as PySpark's worker daemon does) and starts one more process.
_SESSION = r"""
import os, sys, time
if os.fork() == 0:
    os.setpgid(0, 0)
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def _start_session() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", _SESSION], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    daemon = int(proc.stdout.readline())
    deadline = time.monotonic() + 10
    while len(session_pids(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(session_pids(proc.pid)) == 3
    assert os.getpgid(daemon) == daemon != proc.pid
    return proc, daemon


def test_kill_session_kills_the_processes_a_process_group_kill_misses() -> None:
    proc, daemon = _start_session()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what a process-group kill reaches: the leader only
        proc.wait()
        time.sleep(0.2)
        left = session_pids(proc.pid)
        assert daemon in left
        assert len(left) == 2
        assert sorted(kill_session(proc.pid)) == sorted(left)
        assert session_pids(proc.pid) == []
    finally:
        kill_session(proc.pid)
        proc.wait()
    proc, daemon = _start_session()
    try:
        assert len(kill_session(proc.pid)) == 3
        assert session_pids(proc.pid) == []
    finally:
        kill_session(proc.pid)
        proc.wait()


@pytest.mark.spark
@pytest.mark.slow
def test_crash_after_sink_on_a_running_stream_returns_once_the_driver_is_dead(tmp_path: Path) -> None:
    """CrashDriver(at="after_sink") with the stream running: a StartStream can follow it at once."""
    steps = [
        StartStream(),
        AddData([b"a", b"b"]),
        CrashDriver(at="after_sink"),
        StartStream(),
        AddData([b"c"]),
        ProcessAllAvailable(),
        CheckExactlyOnce(),
    ]
    r = stream_test("stream_queries:batch_sink", steps, read_output="stream_queries:rows_of", work_dir=tmp_path)
    assert len(r.driver_crashes) == 1
    assert r.driver_crashes[0].startswith("after the sink wrote batch")
    # With nothing new to read, the step says so instead of waiting for a batch that never comes.
    with pytest.raises(StreamTestError, match="no batch reached the sink"):
        stream_test(
            "stream_queries:batch_sink",
            [StartStream(), AddData([b"x"]), ProcessAllAvailable(), CrashDriver(at="after_sink")],
            read_output="stream_queries:rows_of",
            work_dir=tmp_path / "second",
        )
