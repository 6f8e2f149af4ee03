"""Kafka-style options of the source: startingPosition / endingPosition, minEventsPerTrigger / maxTriggerDelay.

The planning logic runs without a JVM (the reader classes are plain Python); one Spark test reads a range.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql.streaming.datasource import ReadAllAvailable
from pyspark.sql.types import BinaryType, LongType, MapType, StringType, StructField, StructType

import filechannel
from filechannel.errors import ConfigError, DataLossError
from filechannel.spark.source import (
    FileChannelBatchReader,
    FileChannelStreamReader,
    SourceOptions,
    _parse_offset,
)


def channel(tmp_path: Path, n: int = 10, taken: int = 0) -> str:
    d = str(tmp_path / "ch")
    with filechannel.open(d, minimum_required_space=0, background=False) as ch:
        with ch.transaction() as tx:
            tx.put_many([b"e%d" % i for i in range(n)])
        if taken:
            with ch.transaction() as tx:
                tx.take_batch(taken)
    return d


SCHEMA = StructType(
    [
        StructField("position", LongType()),
        StructField("body", BinaryType()),
        StructField("headers", MapType(StringType(), StringType())),
    ]
)


def positions(reader: FileChannelBatchReader) -> list[tuple[int, int]]:
    return [(p.segment.start, p.segment.end) for p in reader.partitions()]  # type: ignore[attr-defined]


def batch(d: str, **opts: str) -> FileChannelBatchReader:
    return FileChannelBatchReader(SourceOptions.parse({"path": d, **opts}, streaming=False), SCHEMA)


def test_batch_ranges(tmp_path: Path) -> None:
    d = channel(tmp_path, 10, taken=2)
    assert positions(batch(d)) == [(2, 10)]
    assert positions(batch(d, startingPosition="5")) == [(5, 10)]
    assert positions(batch(d, startingPosition="3", endingPosition="6")) == [(3, 6)]
    assert positions(batch(d, startingPosition="latest")) == []
    assert positions(batch(d, startingPosition=f'{{"{d}": 4}}')) == [(4, 10)]
    with pytest.raises(DataLossError, match="taken before"):
        batch(d, startingPosition="1").partitions()
    with pytest.raises(ConfigError, match="beyond"):
        batch(d, endingPosition="11").partitions()
    with pytest.raises(ConfigError, match="before startingPosition"):
        batch(d, startingPosition="6", endingPosition="4").partitions()


@pytest.mark.parametrize(
    ("opts", "msg"),
    [
        ({"startingPosition": "soon"}, "earliest, latest or a position"),
        ({"startingPosition": "-1"}, "earliest, latest or a position"),
        ({"startingPosition": "{}"}, "at least one channel"),
        ({"startingPosition": "{oops"}, "neither earliest"),
    ],
)
def test_bad_positions(tmp_path: Path, opts: dict[str, str], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        SourceOptions.parse({"path": str(tmp_path), **opts}, streaming=False)


def test_streaming_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="batch reads only"):
        SourceOptions.parse({"path": str(tmp_path), "consumer": "c", "endingPosition": "3"}, streaming=True)
    with pytest.raises(ConfigError, match="positive duration"):
        SourceOptions.parse({"path": str(tmp_path), "consumer": "c", "maxTriggerDelay": "soon"}, streaming=True)


def stream(d: str, consumer: str = "q", **opts: str) -> FileChannelStreamReader:
    parsed = SourceOptions.parse({"path": d, "consumer": consumer, **opts}, streaming=True)
    return FileChannelStreamReader(parsed, SCHEMA)


def test_a_new_consumer_starts_where_startingPosition_says(tmp_path: Path) -> None:
    d = channel(tmp_path, 10)
    r = stream(d, startingPosition="7")
    first, _ = _parse_offset(r.initialOffset())
    assert list(first.values()) == [7]
    assert filechannel.ChannelReader(d, "q", reset=True).acked == 7
    # An existing consumer keeps its own position: the option is for new ones only.
    again, _ = _parse_offset(stream(d, startingPosition="earliest", resetConsumer="true").initialOffset())
    assert list(again.values()) == [7]


def test_min_events_wait_then_give_up_after_the_delay(tmp_path: Path) -> None:
    d = channel(tmp_path, 3)
    r = stream(d, minEventsPerTrigger="5", maxTriggerDelay="300ms")
    start = r.initialOffset()
    end: dict[str, Any] = r.latestOffset(start, ReadAllAvailable())
    assert _parse_offset(end)[0] == _parse_offset(start)[0]  # 3 < 5: wait (no micro-batch)
    time.sleep(0.35)
    end = r.latestOffset(start, ReadAllAvailable())
    assert list(_parse_offset(end)[0].values()) == [3]  # waited maxTriggerDelay: go with what there is
    with filechannel.open(d, minimum_required_space=0, background=False) as ch, ch.transaction() as tx:
        tx.put_many([b"x"] * 6)
    r2 = stream(d, "q2", minEventsPerTrigger="5")
    s2 = r2.initialOffset()
    assert list(_parse_offset(r2.latestOffset(s2, ReadAllAvailable()))[0].values()) == [9]  # 9 >= 5: at once
