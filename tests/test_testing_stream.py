"""stream_test: a StreamTest for PySpark with crashes.

The Spark tests run the same scenario on two ``foreachBatch`` sinks from
``tests/stream_queries.py``: the producer is killed with a transaction open,
then the driver is killed (with its JVM) right after the sink wrote a batch and
before Spark's commit log, and restarted on the same checkpoint. The
idempotent sink (one directory per batch id, overwritten) passes; the appending
sink (no record of batch ids) writes the replayed batch twice and is caught.
Each costs two driver (JVM) starts; the argument checks need no Spark.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from filechannel.errors import ConfigError
from filechannel.testing import (
    AddData,
    CheckAnswer,
    CheckExactlyOnce,
    CrashDriver,
    CrashProducer,
    ProcessAllAvailable,
    StartStream,
    StopStream,
    StreamTestError,
    stream_test,
)


def bodies(a: int, b: int) -> list[bytes]:
    return [f"event-{i}".encode() for i in range(a, b)]


def scenario() -> list[object]:
    return [
        AddData(bodies(0, 5)),
        CrashProducer(),  # killed with an uncommitted put: it must never show
        AddData(bodies(5, 8)),  # a new producer recovers the channel first
        CrashDriver(at="after_sink"),  # armed: the first batch's sink write is the driver's last act
        StartStream(),
        ProcessAllAvailable(),  # batch 0 written, driver and JVM killed before the commit log
        StartStream(),  # a new driver on the same checkpoint replays batch 0
        ProcessAllAvailable(),
        CheckExactlyOnce(),
    ]


@pytest.mark.spark
@pytest.mark.slow
def test_an_idempotent_foreach_batch_sink_passes(tmp_path: Path) -> None:
    expected = [{"position": i, "body": b, "batch": 0} for i, b in enumerate(bodies(0, 8))]
    r = stream_test(
        "stream_queries:idempotent_sink",
        [*scenario(), CheckAnswer(expected), StopStream()],
        channel_dir=tmp_path / "channel",
    )
    assert r.driver_crashes == ["after the sink wrote batch 0"]
    assert r.producer_crashes == 1
    assert [e.body for e in r.produced] == bodies(0, 8)
    assert r.rows is not None
    assert sorted(row["position"] for row in r.rows) == list(range(8))


@pytest.mark.spark
@pytest.mark.slow
def test_a_non_idempotent_foreach_batch_sink_is_caught() -> None:
    steps = scenario()
    with pytest.raises(StreamTestError) as ei:
        stream_test("stream_queries:appending_sink", steps)
    e = ei.value
    msg = str(e)
    assert e.step == len(steps), msg
    assert isinstance(e.action, CheckExactlyOnce)
    assert msg.startswith(f"stream_test step {len(steps)} of {len(steps)} failed: CheckExactlyOnce()"), msg
    assert "not exactly once: produced 8, delivered 16: missing 0, duplicated 8 (8 items), unexpected 0" in msg
    assert "  6 ProcessAllAvailable()  ok" in msg
    assert "the sink held 16 rows" in msg
    assert e.rows is not None
    assert sorted(row["body"] for row in e.rows) == sorted(bodies(0, 8) * 2)


@pytest.mark.spark
@pytest.mark.slow
def test_crash_after_sink_needs_a_foreach_batch_sink() -> None:
    with pytest.raises(StreamTestError) as ei:
        stream_test("stream_queries:file_sink", [CrashDriver(at="after_sink"), StartStream()])
    msg = str(ei.value)
    assert ei.value.step == 2
    assert "CrashDriver(at='after_sink') needs a foreachBatch sink" in msg
    assert "use CrashDriver() (a kill at any instant) instead" in msg


def test_a_step_that_needs_a_stream_says_so_without_starting_spark() -> None:
    with pytest.raises(StreamTestError) as ei:
        stream_test("stream_queries:idempotent_sink", [AddData([b"a"]), ProcessAllAvailable(), CheckExactlyOnce()])
    msg = str(ei.value)
    assert msg.splitlines()[:2] == [
        "stream_test step 2 of 3 failed: ProcessAllAvailable()",
        "  ProcessAllAvailable: no stream is running (add a StartStream() before it)",
    ]
    assert "  1 AddData(1 events)  ok" in msg
    assert "  3 CheckExactlyOnce()  not run" in msg
    assert "no driver ran: the sink was not read" in msg


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="invalid option query: 'stream_queries' is not 'module:function'"):
        stream_test("stream_queries", [])
    with pytest.raises(ConfigError, match="cannot be imported by the driver subprocess"):
        stream_test(lambda spark, c, o: None, [])
    with pytest.raises(ConfigError, match="step 2 is 'StartStream', not one of AddData"):
        stream_test("stream_queries:idempotent_sink", [StartStream(), "StartStream"])
    with pytest.raises(ConfigError, match="invalid option timeout"):
        stream_test("stream_queries:idempotent_sink", [], timeout=0)
