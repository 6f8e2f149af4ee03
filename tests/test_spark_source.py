"""The ``filechannel`` Spark source: batch reads, and streaming reads that survive restarts exactly once.

One local SparkSession for the whole run (``tests/spark_session.py``); small
channels; parquet sinks with checkpoints, so restarts are real restarts.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import ChannelReader
from filechannel._fs import DEFAULT_FS
from filechannel.consumers import ConsumerStore
from filechannel.log import CHANNEL_FILE, decode_channel_file

pytestmark = pytest.mark.spark

OPTS: dict[str, Any] = {"minimum_required_space": 0}


def body(i: int, size: int = 0) -> bytes:
    b = b"event-%06d" % i
    return b + bytes((i + k) % 251 for k in range(max(0, size - len(b))))


def put(ch: filechannel.FileChannel, first: int, n: int, size: int = 0) -> None:
    """Put events ``first .. first+n-1`` (body and headers derived from the number) in one transaction."""
    with ch.transaction() as tx:
        for i in range(first, first + n):
            tx.put(body(i, size), headers={"i": str(i), "kind": "even" if i % 2 == 0 else "odd"})


def roll_back_one(ch: filechannel.FileChannel) -> None:
    tx = ch.transaction()
    tx.put(b"ROLLED-BACK", headers={"i": "-1"})
    tx.rollback()


def channel_id(d: str) -> str:
    with open(os.path.join(d, CHANNEL_FILE), "rb") as f:
        return decode_channel_file(f.read())[0].hex()


def stream(spark: Any, path: str, consumer: str = "q", **options: Any) -> Any:
    r = spark.readStream.format("filechannel").option("consumer", consumer)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load(path)


def to_parquet(df: Any, base: Path, **trigger: Any) -> Any:
    return (
        df.writeStream.format("parquet")
        .option("path", str(base / "out"))
        .option("checkpointLocation", str(base / "ck"))
        .trigger(**(trigger or {"processingTime": "0.5 seconds"}))
        .start()
    )


def drain(spark: Any, path: str, base: Path, **options: Any) -> Any:
    """Run an availableNow query to its end; return it."""
    q = to_parquet(stream(spark, path, **options), base, availableNow=True)
    assert q.awaitTermination(120)
    assert q.exception() is None
    return q


def delivered(spark: Any, base: Path) -> list[tuple[int, bytes, dict[str, str]]]:
    """What the parquet sink committed (its _spark_metadata log), in position order."""
    rows = spark.read.parquet(str(base / "out")).orderBy("position").collect()
    return [(r.position, bytes(r.body), dict(r.headers)) for r in rows]


def expected(positions: range | list[int], size: int = 0) -> list[tuple[int, bytes, dict[str, str]]]:
    return [(i, body(i, size), {"i": str(i), "kind": "even" if i % 2 == 0 else "odd"}) for i in positions]


def failure(q: Any) -> str:
    """The message of a query that must fail (the Python traceback of the source is in it)."""
    with pytest.raises(Exception) as info:  # StreamingQueryException, whatever its module
        q.awaitTermination(120)
    return str(info.value)


def offsets(base: Path) -> list[str]:
    """The source's offset line of every batch in the checkpoint's offset log, in batch order."""
    files = sorted((p for p in (base / "ck" / "offsets").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return [p.read_text().splitlines()[-1] for p in files]


def acked(d: str, consumer: str = "q") -> int:
    return ConsumerStore(DEFAULT_FS, d).list()[consumer].acked


# -- streaming -------------------------------------------------------------------------------


def test_positions_and_offsets_across_restarts_exactly_once(spark: Any, tmp_path: Path) -> None:
    d, base = str(tmp_path / "ch"), tmp_path / "q"
    ch = filechannel.open(d, background=False, **OPTS)
    try:
        put(ch, 0, 6)
        roll_back_one(ch)
        q = to_parquet(stream(spark, d), base)
        q.processAllAvailable()
        put(ch, 6, 4)
        roll_back_one(ch)
        put(ch, 10, 3)
        q.processAllAvailable()
        q.stop()
        # stopped: the events put now are read by the restarted query, after its checkpoint
        put(ch, 13, 7)
        roll_back_one(ch)
        q = to_parquet(stream(spark, d), base)
        q.processAllAvailable()
        q.stop()
        assert delivered(spark, base) == expected(range(20))  # each once, byte for byte; no rollback

        # offsets: canonical JSON, the channel's id, one token for the query, positions that only grow
        logged = offsets(base)
        parsed = [json.loads(line) for line in logged]
        assert all(line == json.dumps(p) for line, p in zip(logged, parsed, strict=True))
        assert {tuple(p) for p in parsed} == {("positions", "query")}
        assert {tuple(p["positions"]) for p in parsed} == {(channel_id(d),)}
        assert len({p["query"] for p in parsed}) == 1
        ends = [p["positions"][channel_id(d)] for p in parsed]
        assert ends == sorted(ends)
        assert ends[-1] == 20

        # acks reach the owner: Spark acknowledged all but (at most) its last micro-batch
        mark = acked(d)
        assert ends[-2] <= mark <= 20
        assert ch.apply_acks() == mark
        assert ch.size == 20 - mark
    finally:
        ch.close()


def test_max_events_per_trigger_and_available_now(spark: Any, tmp_path: Path) -> None:
    d, base = str(tmp_path / "ch"), tmp_path / "q"
    ch = filechannel.open(d, background=False, **OPTS)
    sizes: list[int] = []
    seen: list[int] = []

    def each(df: Any, batch_id: int) -> None:
        rows = df.collect()
        sizes.append(len(rows))
        seen.extend(r.position for r in rows)
        if batch_id == 0:
            put(ch, 25, 5)  # after the availableNow target: not for this run

    try:
        put(ch, 0, 25)
        q = (
            stream(spark, d, maxEventsPerTrigger=10)
            .writeStream.foreachBatch(each)
            .option("checkpointLocation", str(base / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        assert q.awaitTermination(120)  # drained what was there at the start, then stopped
        assert sizes == [10, 10, 5]
        assert sorted(seen) == list(range(25))
        assert max(p["numInputRows"] for p in q.recentProgress) == 10
        # the same checkpoint again: only what came after
        q = (
            stream(spark, d, maxEventsPerTrigger=10)
            .writeStream.foreachBatch(each)
            .option("checkpointLocation", str(base / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        assert q.awaitTermination(120)
        assert sizes == [10, 10, 5, 5]
        assert sorted(seen) == list(range(30))
    finally:
        ch.close()


def test_a_replayed_first_micro_batch_after_a_crash_is_delivered_once(spark: Any, tmp_path: Path) -> None:
    """Spark replays a batch whose commit it did not log with the logged range (the first one: a new token)."""
    d, base = str(tmp_path / "ch"), tmp_path / "q"
    with filechannel.open(d, background=False, **OPTS) as ch:
        put(ch, 0, 8)
    drain(spark, d, base)
    # as if the driver died after the sink wrote its files but before either log recorded batch 0
    for p in [base / "ck" / "commits" / "0", base / "out" / "_spark_metadata" / "0"]:
        p.unlink()
        (p.parent / ".0.crc").unlink(missing_ok=True)
    assert not os.listdir(base / "out" / "_spark_metadata")
    with filechannel.open(d, background=False, **OPTS) as ch:
        put(ch, 8, 2)
    drain(spark, d, base)
    assert delivered(spark, base) == expected(range(10))
    assert len({json.loads(line)["query"] for line in offsets(base)}) == 1


def test_follows_a_channel_that_rolls_and_retires_files_while_the_query_runs(spark: Any, tmp_path: Path) -> None:
    d, base = str(tmp_path / "ch"), tmp_path / "q"
    ch = filechannel.open(d, max_file_size=8 * 1024, ack_interval=0.1, **OPTS)
    total = 0

    def produce(rounds: int) -> None:  # 5 KiB transactions: a data file holds about 16 events
        nonlocal total
        for _ in range(rounds):
            put(ch, total, 10, size=500)
            total += 10
            roll_back_one(ch)
            time.sleep(0.05)

    try:
        put(ch, 0, 40, size=500)
        total = 40
        q = to_parquet(stream(spark, d), base)
        q.processAllAvailable()
        produce(10)
        q.processAllAvailable()  # a second batch: Spark acknowledges the first, the owner takes it
        deadline = time.monotonic() + 30
        while ch.stats()["files_retired"] == 0:
            assert time.monotonic() < deadline, "the owner retired no data file"
            time.sleep(0.1)
        produce(20)  # the query keeps reading while files roll and retire behind it
        q.processAllAvailable()
        q.stop()
        assert delivered(spark, base) == expected(range(total), size=500)
        live = [int(Path(p).name[4:20], 16) for p in glob.glob(os.path.join(d, "data", "seg-*.wal"))]
        assert min(live) > 1
        assert max(live) > 10  # rolled often
    finally:
        ch.close()


def test_several_channels_as_one_stream(spark: Any, tmp_path: Path) -> None:
    a, b, base = str(tmp_path / "a"), str(tmp_path / "b"), tmp_path / "q"
    with filechannel.open(a, **OPTS) as ca, filechannel.open(b, **OPTS) as cb:
        put(ca, 0, 9)
        put(cb, 0, 3)
    q = drain(spark, f"{a},{b}", base, maxEventsPerTrigger=4)
    assert max(p["numInputRows"] for p in q.recentProgress) <= 4
    rows = spark.read.parquet(str(base / "out")).collect()
    got = sorted((r.channel, r.position, bytes(r.body)) for r in rows)
    assert got == sorted([(a, i, body(i)) for i in range(9)] + [(b, i, body(i)) for i in range(3)])
    last = json.loads(offsets(base)[-1])
    assert last["positions"] == dict(sorted({channel_id(a): 9, channel_id(b): 3}.items()))


# -- errors ----------------------------------------------------------------------------------


def test_clear_errors_for_options_and_missing_channels(spark: Any, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(Exception, match=r"nope is not a filechannel directory: no such directory"):
        spark.read.format("filechannel").load(missing).collect()
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        put(ch, 0, 3)
    with pytest.raises(Exception, match=r"no such option"):
        spark.read.format("filechannel").option("maxEventPerTrigger", "3").load(d).collect()

    no_consumer = spark.readStream.format("filechannel").load(d)
    msg = failure(to_parquet(no_consumer, tmp_path / "q1", availableNow=True))
    assert "a streaming read needs .option('consumer', NAME)" in msg
    msg = failure(to_parquet(stream(spark, missing), tmp_path / "q3", availableNow=True))
    assert f"{missing} is not a filechannel directory" in msg


def test_lost_checkpoint_and_checkpoint_of_another_channel_are_refused(spark: Any, tmp_path: Path) -> None:
    d, other = str(tmp_path / "ch"), str(tmp_path / "other")
    with filechannel.open(d, **OPTS) as ch, filechannel.open(other, **OPTS) as ch2:
        put(ch, 0, 5)
        put(ch2, 0, 5)
    drain(spark, d, tmp_path / "a")

    # a new checkpoint under the same consumer name: a lost checkpoint, or a second query
    msg = failure(to_parquet(stream(spark, d), tmp_path / "b", availableNow=True))
    assert "consumer 'q' of channel" in msg
    assert "belongs to another query" in msg
    assert "resetConsumer" in msg
    # taking the name over resumes at the consumer's acknowledged position (here: nothing acknowledged yet)
    drain(spark, d, tmp_path / "b", resetConsumer="true")
    assert delivered(spark, tmp_path / "b") == expected(range(5))

    # the checkpoint of a query on `d`, used on another channel
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    msg = failure(to_parquet(stream(spark, other, consumer="q2"), tmp_path / "c", availableNow=True))
    assert f"this query's Spark checkpoint belongs to channel(s) {channel_id(d)}, but it reads" in msg


def test_a_channel_restored_from_an_older_copy_is_data_loss(spark: Any, tmp_path: Path) -> None:
    d, base = str(tmp_path / "ch"), tmp_path / "q"
    with filechannel.open(d, **OPTS) as ch:
        put(ch, 0, 5)
    shutil.copytree(d, tmp_path / "backup")
    with filechannel.open(d, **OPTS) as ch:
        put(ch, 5, 5)
    drain(spark, d, base)
    assert delivered(spark, base) == expected(range(10))
    shutil.rmtree(d)
    shutil.copytree(tmp_path / "backup", d)  # holds positions 0..4 only
    msg = failure(to_parquet(stream(spark, d), base, availableNow=True))
    assert "DataLossError: positions [5, 10) are gone" in msg
    assert "the channel holds positions below 5 only" in msg
    assert "restored from an older copy" in msg


# -- batch -----------------------------------------------------------------------------------


def test_batch_read_equals_channel_reader_and_acknowledges_nothing(spark: Any, tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, max_file_size=16 * 1024, background=False, **OPTS)
    try:
        put(ch, 0, 60, size=400)
        roll_back_one(ch)
        with ch.transaction() as tx:  # the owner consumed some: not in the snapshot
            assert len(tx.take_batch(7)) == 7
        df = spark.read.format("filechannel").option("maxPartitionBytes", 4096).load(d)
        assert df.rdd.getNumPartitions() > 3
        rows = [(r.position, bytes(r.body), dict(r.headers)) for r in df.orderBy("position").collect()]
        with ChannelReader(d) as view:
            events = view.read(*view.available())
        assert rows == [(e.position, e.body, dict(e.headers)) for e in events]
        assert rows == expected(range(7, 60), size=400)
        consumers = os.path.join(d, "consumers")
        assert ch.size == 53
        assert not os.path.isdir(consumers) or not os.listdir(consumers)
        # a schema of some of the columns, in another order
        some = spark.read.format("filechannel").schema("body binary, position long").load(d)
        assert [(r.body, r.position) for r in some.orderBy("position").collect()] == [(b, p) for p, b, _ in rows]
        empty = str(tmp_path / "empty")
        filechannel.open(empty, **OPTS).close()
        assert spark.read.format("filechannel").load(empty).count() == 0
    finally:
        ch.close()


# -- the stream reader's protocol, called directly as Spark calls it (no JVM) -------------------


def _source(options: dict[str, str]) -> Any:
    from pyspark.sql.types import BinaryType, LongType, MapType, StringType, StructField, StructType

    from filechannel.spark import FileChannelDataSource

    schema = StructType(
        [
            StructField("position", LongType()),
            StructField("body", BinaryType()),
            StructField("headers", MapType(StringType(), StringType())),
        ]
    )
    return FileChannelDataSource(options).streamReader(schema)


def _read_all(reader: Any, parts: list[Any]) -> list[tuple[int, bytes]]:
    import pickle

    planner = pickle.loads(pickle.dumps(reader))  # what the executors get
    out: list[tuple[int, bytes]] = []
    for part in pickle.loads(pickle.dumps(parts)):
        for batch in planner.read(part):
            out.extend(zip(batch.column("position").to_pylist(), batch.column("body").to_pylist(), strict=True))
    return out


def test_stream_reader_protocol_without_spark(tmp_path: Path) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

    from filechannel.spark import CheckpointMismatchError

    d = str(tmp_path / "ch")
    ch = filechannel.open(d, background=False, **OPTS)
    try:
        put(ch, 0, 10)
        r = _source({"path": d, "consumer": "u", "maxEventsPerTrigger": "4", "maxPartitionBytes": "64"})
        assert r.getDefaultReadLimit() == ReadMaxRows(4)
        start = r.initialOffset()
        cid = channel_id(d)
        assert json.dumps(start) == json.dumps({"positions": {cid: 0}, "query": start["query"]})
        assert r.initialOffset() == start  # called again by Spark for the first batch's start
        end = r.latestOffset(start, ReadMaxRows(4))
        assert end["positions"] == {cid: 4}
        parts = r.partitions(start, end)
        assert len(parts) > 1  # 64-byte partitions
        assert _read_all(r, parts) == [(i, body(i)) for i in range(4)]
        assert [p.segment for p in r.partitions(start, end)] == [p.segment for p in parts]  # deterministic
        assert r.partitions(end, end) == []
        assert r.latestOffset(end, ReadAllAvailable())["positions"] == {cid: 10}

        r.commit(end)
        r.commit(end)  # idempotent
        r.commit(start)  # a lower end changes nothing
        assert acked(d, "u") == 4
        assert ch.apply_acks() == 4
        with pytest.raises(filechannel.DataLossError, match=r"acknowledged them already"):
            r.latestOffset(start, ReadAllAvailable())
        with pytest.raises(filechannel.DataLossError, match=r"positions \[0, 4\) are gone"):
            r.partitions(start, end)
        beyond = {"positions": {cid: 12}, "query": start["query"]}
        with pytest.raises(filechannel.DataLossError, match=r"the channel holds positions below 10 only"):
            r.partitions(end, beyond)
        with pytest.raises(filechannel.DataLossError, match=r"the channel holds positions below 10 only"):
            r.commit(beyond)
        with pytest.raises(CheckpointMismatchError, match=r"was not made by the filechannel source"):
            r.latestOffset({"pos": 3}, ReadAllAvailable())
        with pytest.raises(CheckpointMismatchError, match=r"belongs to channel\(s\) 00"):
            r.latestOffset({"positions": {"00": 3}, "query": start["query"]}, ReadAllAvailable())

        # availableNow: the end at prepare time, whatever comes later
        r.prepareForTriggerAvailableNow()
        put(ch, 10, 5)
        assert r.latestOffset(end, ReadAllAvailable())["positions"] == {cid: 10}

        # a fresh checkpoint under the same consumer: refused, unless told to take the name over
        fresh = _source({"path": d, "consumer": "u"})
        first = fresh.initialOffset()
        assert first["positions"] == {cid: 4}
        assert first["query"] != start["query"]
        with pytest.raises(CheckpointMismatchError, match=r"belongs to another query"):
            fresh.latestOffset(first, ReadAllAvailable())
        taken = _source({"path": d, "consumer": "u", "resetConsumer": "true"})
        assert taken.latestOffset(first, ReadAllAvailable())["positions"] == {cid: 15}
        with pytest.raises(CheckpointMismatchError, match=r"belongs to another query"):
            r.commit({"positions": {cid: 8}, "query": start["query"]})  # the old query is fenced off
    finally:
        ch.close()


def test_options_and_the_share_of_a_limit() -> None:
    from filechannel.spark.offsets import share as _share
    from filechannel.spark.source import SourceOptions

    with pytest.raises(filechannel.ConfigError, match="consumer"):
        SourceOptions.parse({"path": "/x"}, streaming=True)
    with pytest.raises(filechannel.ConfigError, match="no channel directory"):
        SourceOptions.parse({}, streaming=False)
    with pytest.raises(filechannel.ConfigError, match="listed twice"):
        SourceOptions.parse({"path": "/x,/y,/x"}, streaming=False)
    with pytest.raises(filechannel.ConfigError, match=r"maxEventsPerTrigger: must be a positive integer, got '0'"):
        SourceOptions.parse({"path": "/x", "consumer": "c", "maxEventsPerTrigger": "0"}, streaming=True)
    with pytest.raises(filechannel.ConfigError, match="no such option"):
        SourceOptions.parse({"path": "/x", "maxEventPerTrigger": "3"}, streaming=False)
    with pytest.raises(filechannel.ConfigError, match="resetConsumer"):
        SourceOptions.parse({"path": "/x", "consumer": "c", "resetConsumer": "yes"}, streaming=True)
    o = SourceOptions.parse({"PATH": "/x, /y", "Consumer": "c", "MAXEVENTSPERTRIGGER": "7"}, streaming=True)
    assert (o.paths, o.consumer, o.max_events, o.multi) == (("/x", "/y"), "c", 7, True)
    assert SourceOptions.parse({"paths": '["/a", "/b"]'}, streaming=False).paths == ("/a", "/b")
    assert _share({"a": 10, "b": 1, "c": 10}, 7) == {"b": 1, "a": 3, "c": 3}
    assert _share({"a": 10, "b": 10}, 1) == {"a": 0, "b": 1}
    assert _share({"a": 2, "b": 3}, 100) == {"a": 2, "b": 3}
