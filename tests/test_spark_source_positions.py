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

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, ReadMinRows
from pyspark.sql.types import BinaryType, LongType, MapType, StringType, StructField, StructType

import filechannel
from filechannel._fs import DEFAULT_FS
from filechannel.consumers import ConsumerStore
from filechannel.errors import ConfigError, DataLossError
from filechannel.spark.offsets import parse_offset as _parse_offset
from filechannel.spark.source import (
    FileChannelBatchReader,
    FileChannelStreamReader,
    SourceOptions,
    _channel_id,
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
    limit = r.getDefaultReadLimit()  # what Spark passes to latestOffset, except under trigger(once=True)
    assert limit == ReadMinRows(5)
    end: dict[str, Any] = r.latestOffset(start, limit)
    assert _parse_offset(end)[0] == _parse_offset(start)[0]  # 3 < 5: wait (no micro-batch)
    time.sleep(0.35)
    end = r.latestOffset(start, limit)
    assert list(_parse_offset(end)[0].values()) == [3]  # waited maxTriggerDelay: go with what there is
    with filechannel.open(d, minimum_required_space=0, background=False) as ch, ch.transaction() as tx:
        tx.put_many([b"x"] * 6)
    r2 = stream(d, "q2", minEventsPerTrigger="5")
    s2 = r2.initialOffset()
    assert list(_parse_offset(r2.latestOffset(s2, r2.getDefaultReadLimit()))[0].values()) == [9]  # 9 >= 5: at once


def test_min_events_with_max_events_caps_each_micro_batch(tmp_path: Path) -> None:
    d = channel(tmp_path, 12)
    r = stream(d, minEventsPerTrigger="3", maxEventsPerTrigger="5")
    start = r.initialOffset()
    end = r.latestOffset(start, r.getDefaultReadLimit())
    assert list(_parse_offset(end)[0].values()) == [5]  # the minimum is met; the maximum still caps the batch
    assert list(_parse_offset(r.latestOffset(end, ReadMaxRows(2)))[0].values()) == [7]


def test_trigger_once_ignores_min_events(tmp_path: Path) -> None:
    # Under trigger(once=True) Spark passes ReadAllAvailable instead of the source's default
    # limit: a scheduled run delivers the remainder below the minimum, as the Kafka source does.
    d = channel(tmp_path, 5)
    r = stream(d, minEventsPerTrigger="10", maxEventsPerTrigger="10")
    start = r.initialOffset()
    assert list(_parse_offset(r.latestOffset(start, ReadAllAvailable()))[0].values()) == [5]


def test_min_events_above_max_events_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"minEventsPerTrigger.*10 is above maxEventsPerTrigger 5"):
        stream(str(tmp_path), minEventsPerTrigger="10", maxEventsPerTrigger="5")
    stream(str(tmp_path), minEventsPerTrigger="5", maxEventsPerTrigger="5")  # equal is fine


def test_a_per_channel_key_naming_no_channel_read_is_refused(tmp_path: Path) -> None:
    d = channel(tmp_path, 10)
    cid = _channel_id(d)
    typo = cid[:-1] + ("0" if cid[-1] != "0" else "1")
    with pytest.raises(ConfigError, match=f"endingPosition.*{typo!r}.*it reads {cid} \\({d}\\)"):
        batch(d, endingPosition=f'{{"{typo}": 9}}').partitions()
    with pytest.raises(ConfigError, match=f"startingPosition.*{typo!r}"):
        batch(d, startingPosition=f'{{"{typo}": 8}}').partitions()
    with pytest.raises(ConfigError, match=r"startingPosition.*'ch'"):  # a relative path is not the channel's key
        batch(d, startingPosition='{"ch": 8}').partitions()
    assert positions(batch(d, startingPosition=f'{{"{cid}": 8}}')) == [(8, 10)]
    # A stream refuses it before registering the consumer.
    with pytest.raises(ConfigError, match=f"startingPosition.*{typo!r}"):
        stream(d, startingPosition=f'{{"{typo}": 8}}').initialOffset()
    assert ConsumerStore(DEFAULT_FS, d).list() == {}


@pytest.mark.parametrize("value", ["true", "TRUE", " true "])
def test_fail_on_data_loss_true_is_what_the_source_does(tmp_path: Path, value: str) -> None:
    stream(str(tmp_path), failOnDataLoss=value)
    SourceOptions.parse({"path": str(tmp_path), "failOnDataLoss": value}, streaming=False)


@pytest.mark.parametrize(
    ("value", "msg"), [("false", "false is not supported.*resetConsumer"), ("maybe", "must be true")]
)
def test_fail_on_data_loss_false_is_refused_with_the_reason(tmp_path: Path, value: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=f"failOnDataLoss.*{msg}"):
        stream(str(tmp_path), failOnDataLoss=value)


def test_trigger_once_delivers_a_remainder_below_min_events(spark: Any, tmp_path: Path) -> None:
    d = channel(tmp_path, 5)
    seen: list[int] = []
    q = (
        spark.readStream.format("filechannel")
        .option("consumer", "once")
        .option("minEventsPerTrigger", "10")
        .option("maxTriggerDelay", "1s")
        .load(d)
        .writeStream.foreachBatch(lambda df, _id: seen.extend(r.position for r in df.collect()))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(once=True)
        .start()
    )
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == [0, 1, 2, 3, 4]
