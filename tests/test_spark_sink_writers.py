"""The Spark sink's writers (filechannel.spark.sink): schema, staging Arrow batches, commit and abort.

These need PySpark (the schema's types) and pyarrow (the batches). They drive
the writers' ``write``/``commit``/``abort`` directly, with the Spark task's
identity faked; tests marked ``spark`` run real queries on a shared local
session: batch and streaming writes, a restart whose checkpoint lacks the last
``commits/N``, and the errors users see (the ``spark`` fixture:
tests/spark_session.py). The commit protocol's own tests, which need neither,
are in ``test_spark_sink.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from pyspark.sql.types import (  # noqa: E402
    BinaryType,
    IntegerType,
    MapType,
    StringType,
    StructField,
    StructType,
)
from sink_helpers import CH_OPTS, QUERY, bodies_of, commit_records, guards, options, staged_files, view  # noqa: E402

import filechannel  # noqa: E402
from filechannel._fs import DEFAULT_FS  # noqa: E402
from filechannel.spark import sink  # noqa: E402
from filechannel.spark.sink import (  # noqa: E402
    HEADER_BATCH,
    HEADER_QUERY,
    FileChannelBatchWriter,
    FileChannelStreamWriter,
    SinkCommitter,
    StagedFiles,
    TaskInfo,
    read_staged,
    stage_events,
)

SCHEMA = StructType([StructField("body", BinaryType()), StructField("headers", MapType(StringType(), StringType()))])
TEXT_SCHEMA = StructType([StructField("body", StringType())])


# --------------------------------------------------------------------------
# helpers


def batch_of(bodies: list[Any], headers: list[Any] | None = None, text: bool = False) -> Any:
    cols = [pa.array(bodies, type=pa.string() if text else pa.binary())]
    names = ["body"]
    if headers is not None:
        cols.append(pa.array(headers, type=pa.map_(pa.string(), pa.string())))
        names.append("headers")
    return pa.record_batch(cols, names=names)


@pytest.fixture
def fake_task(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make ``write`` believe it runs in task ``partition`` of batch ``batch_id`` of QUERY."""
    info: dict[str, Any] = {"partition": 0, "attempt": 0, "query": QUERY, "batch_id": 0}
    monkeypatch.setattr(sink, "task_info", lambda: TaskInfo(**info))
    return info


def run_writer(w: FileChannelStreamWriter, info: dict[str, Any], batch_id: int, parts: list[Any]) -> list[StagedFiles]:
    """Run ``write`` once per partition of one micro-batch, as Spark's tasks would."""
    msgs = []
    for i, part in enumerate(parts):
        info.update(partition=i, batch_id=batch_id)
        msgs.append(w.write(iter(part)))
    return msgs


# --------------------------------------------------------------------------
# schema and construction


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (StructType([StructField("body", BinaryType()), StructField("k", StringType()),
                     StructField("v", IntegerType())]), "unexpected column.*'k', 'v'"),
        (StructType([StructField("value", BinaryType())]), "unexpected column.*'value'.*alias"),
        (StructType([StructField("headers", MapType(StringType(), StringType()))]), "no `body` column"),
        (StructType([StructField("body", IntegerType())]), "`body` must be binary or string, got int"),
        (StructType([StructField("body", BinaryType()), StructField("headers", MapType(StringType(), IntegerType()))]),
         "`headers` must be map<string,string>"),
    ],
)  # fmt: skip
def test_bad_columns_are_named_at_construction(tmp_path: Path, schema: StructType, words: str) -> None:
    for cls in (FileChannelStreamWriter, FileChannelBatchWriter):
        with pytest.raises(filechannel.ConfigError, match=words):
            cls({"path": str(tmp_path / "ch"), **CH_OPTS}, schema)


def test_construction_creates_the_channel_and_refuses_overwrite_and_foreign_dirs(tmp_path: Path) -> None:
    d = tmp_path / "ch"
    FileChannelStreamWriter({"path": str(d), **CH_OPTS}, SCHEMA)
    assert (d / "CHANNEL").exists()
    with pytest.raises(filechannel.ConfigError, match="only appends"):
        FileChannelBatchWriter({"path": str(d), **CH_OPTS}, SCHEMA, overwrite=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(filechannel.NotAChannelError):
        FileChannelStreamWriter({"path": str(foreign), **CH_OPTS}, SCHEMA)


# --------------------------------------------------------------------------
# staging (the executor side) and the writers' commit and abort


def test_write_stages_durably_and_commit_puts_one_transaction(tmp_path: Path, fake_task: dict[str, Any]) -> None:
    d = tmp_path / "ch"
    w = FileChannelStreamWriter({"path": str(d), **CH_OPTS, "channel.transaction_capacity": "2"}, SCHEMA)
    parts = [
        [batch_of([b"a", b"b"], [{"k": "1"}, None]), batch_of([b"c"], [[("k", "1"), ("j", "x")]])],
        [],  # an empty partition stages nothing
        [batch_of([b"d", b"e"], [None, None])],
    ]
    msgs = run_writer(w, fake_task, 0, parts)
    assert [(m.rows, len(m.files)) for m in msgs] == [(3, 1), (0, 0), (2, 1)]
    assert all(m.query == QUERY and m.batch_id == 0 for m in msgs)
    o = w.options
    assert staged_files(o) == sorted(f for m in msgs for f in m.files)  # no temporaries left
    assert len(read_staged(DEFAULT_FS, os.path.join(o.staging_dir, msgs[0].files[0]))) == 3
    # Commit messages travel pickled from executors to the driver.
    import pickle

    msgs = [pickle.loads(pickle.dumps(m)) for m in msgs]
    FileChannelStreamWriter({"path": str(d), **CH_OPTS}, SCHEMA).commit(list(msgs), 0)
    evs = view(d)
    assert [e.body for e in evs] == [b"a", b"b", b"c", b"d", b"e"]
    assert [e.position for e in evs] == [0, 1, 2, 3, 4]
    tag = {HEADER_QUERY: QUERY, HEADER_BATCH: "0"}
    assert [dict(e.headers) for e in evs] == [{"k": "1", **tag}, tag, {"k": "1", "j": "x", **tag}, tag, tag]
    # One transaction although transaction_capacity=2: the sink raises it for its own open.
    assert [(r["first_position"], r["puts"]) for r in commit_records(d)] == [(0, 5)]
    assert staged_files(o) == []
    assert guards(d) == []


def test_text_bodies_are_utf8(tmp_path: Path, fake_task: dict[str, Any]) -> None:
    d = tmp_path / "ch"
    w = FileChannelStreamWriter({"path": str(d), **CH_OPTS}, TEXT_SCHEMA)
    msgs = run_writer(w, fake_task, 0, [[batch_of(["héllo", ""], text=True)]])
    w.commit(list(msgs), 0)
    assert bodies_of(d) == ["héllo".encode(), b""]


def test_write_refuses_null_bodies_and_oversized_rows_leaving_nothing(
    tmp_path: Path, fake_task: dict[str, Any]
) -> None:
    d = tmp_path / "ch"
    w = FileChannelStreamWriter({"path": str(d), **CH_OPTS, "channel.max_event_size": "200"}, SCHEMA)
    with pytest.raises(filechannel.InvalidEventError, match=r"row 1 .* null body"):
        w.write(iter([batch_of([b"ok", None], [None, None])]))
    with pytest.raises(filechannel.InvalidEventError, match="null value for header 'k'"):
        w.write(iter([batch_of([b"ok"], [[("k", None)]])]))
    # 150 bytes of body fit in 200, but not with the sink's own headers (55 + 23 bytes) added.
    with pytest.raises(filechannel.EventTooLargeError) as ei:
        w.write(iter([batch_of([b"x" * 50, b"x" * 150], [None, None])]))
    assert ei.value.limit == 200
    assert staged_files(w.options) == []


def test_commit_twice_with_the_same_messages_puts_once(tmp_path: Path, fake_task: dict[str, Any]) -> None:
    d = tmp_path / "ch"
    w = FileChannelStreamWriter({"path": str(d), **CH_OPTS}, SCHEMA)
    m0 = run_writer(w, fake_task, 0, [[batch_of([b"a", b"b"], [None, None])]])
    m1 = run_writer(w, fake_task, 1, [[batch_of([b"c"], [None])], [batch_of([b"d"], [None])]])
    w.commit(list(m0), 0)
    w.commit(list(m0), 0)  # the same messages again: files are gone, the state says done
    w.commit(list(m1), 1)
    assert bodies_of(d) == [b"a", b"b", b"c", b"d"]
    # A replay of batch 1 after a failure runs its tasks again: new staged files, skipped.
    again = run_writer(w, fake_task, 1, [[batch_of([b"c"], [None])], [batch_of([b"d"], [None])]])
    w.commit(list(again), 1)
    w.commit(list(m0), 0)  # an older batch id: also done
    assert bodies_of(d) == [b"a", b"b", b"c", b"d"]
    assert [e.headers[HEADER_BATCH] for e in view(d)] == ["0", "0", "1", "1"]
    assert staged_files(w.options) == []
    st = sink.StateStore(DEFAULT_FS, w.options).load(QUERY)
    assert st == sink.QueryState(QUERY, 1, None)


def test_abort_deletes_the_batch_files_including_failed_attempts(tmp_path: Path, fake_task: dict[str, Any]) -> None:
    d = tmp_path / "ch"
    w = FileChannelStreamWriter({"path": str(d), **CH_OPTS}, SCHEMA)
    ok = run_writer(w, fake_task, 3, [[batch_of([b"a"], [None])]])
    fake_task.update(partition=1, attempt=0)
    w.write(iter([batch_of([b"lost"], [None])]))  # its task "failed" after staging: Spark sends None
    keep = run_writer(w, fake_task, 4, [[batch_of([b"next"], [None])]])
    assert len(staged_files(w.options)) == 3
    w.abort([ok[0], None], 3)
    assert staged_files(w.options) == list(keep[0].files)
    assert bodies_of(d) == []
    with pytest.raises(filechannel.ChannelError, match="task 1 reported no commit message"):
        w.commit([keep[0], None], 4)


def test_commit_sweeps_older_attempts_and_stale_files(tmp_path: Path, fake_task: dict[str, Any]) -> None:
    d = tmp_path / "ch"
    w = FileChannelStreamWriter({"path": str(d), **CH_OPTS, "staleStagingSeconds": "3600"}, SCHEMA)
    o = w.options
    old_ns = time.time_ns() - 2 * 3600 * 10**9
    stale = f"j.deadbeef.p0.a0.1.{old_ns}.stage"  # a crashed batch job's leftover
    young = f"j.cafe.p0.a0.1.{time.time_ns()}.stage"  # a batch job in progress
    tmp = f".tmp.q.other.b9.p0.a0.1.{old_ns}.stage"  # a task killed mid-write
    for name in (stale, young, tmp):
        stage_events(DEFAULT_FS, o.staging_dir, name, [(b"x", None)], 1 << 20)
    earlier = run_writer(w, fake_task, 0, [[batch_of([b"retry-leftover"], [None])]])  # an older attempt
    msgs = run_writer(w, fake_task, 1, [[batch_of([b"a"], [None])]])
    w.commit(list(msgs), 1)
    assert staged_files(o) == [young]
    assert earlier[0].files[0] not in staged_files(o)
    assert bodies_of(d) == [b"a"]


def test_batch_job_is_one_transaction_without_sink_headers(tmp_path: Path, fake_task: dict[str, Any]) -> None:
    d = tmp_path / "ch"
    w = FileChannelBatchWriter({"path": str(d), **CH_OPTS}, SCHEMA)
    fake_task.update(query=None, batch_id=None)
    msgs = [w.write(iter([batch_of([b"a", b"b"], [{"k": "v"}, None])])), w.write(iter([batch_of([b"c"], [None])]))]
    assert all(m.job == w.job for m in msgs)
    w.commit(list(msgs))
    assert [(e.body, dict(e.headers)) for e in view(d)] == [(b"a", {"k": "v"}), (b"b", {}), (b"c", {})]
    assert [r["puts"] for r in commit_records(d)] == [3]
    assert staged_files(w.options) == []
    w2 = FileChannelBatchWriter({"path": str(d), **CH_OPTS}, SCHEMA)
    m = w2.write(iter([batch_of([b"z"], [None])]))
    w2.abort([m, None])
    assert staged_files(w2.options) == []
    assert bodies_of(d) == [b"a", b"b", b"c"]


# --------------------------------------------------------------------------
# with Spark


FORMAT = "filechannel"


def _json_input(d: Path, files: int, rows: int, first: int = 0) -> list[str]:
    """Write JSON files the file source reads one per batch, in order (it orders them by mtime)."""
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(first, first + files):
        path = d / f"part-{i:03d}.json"
        with open(path, "w") as f:
            for j in range(rows):
                body = f"row-{i:03d}-{j:03d}"
                out.append(body)
                f.write(json.dumps({"body": body, "k": str(j % 2)}) + "\n")
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    return out


def _stream(spark: Any, src: Path, path: Path, ck: Path, **opts: str) -> Any:
    from pyspark.sql import functions as F

    df = spark.readStream.schema("body string, k string").option("maxFilesPerTrigger", 1).json(str(src))
    df = df.select(F.col("body"), F.create_map(F.lit("k"), F.col("k")).alias("headers"))
    w = df.writeStream.format(FORMAT).option("path", str(path)).option("checkpointLocation", str(ck))
    for k, v in {**CH_OPTS, **opts}.items():
        w = w.option(k, v)
    return w.trigger(availableNow=True).start()


@pytest.mark.spark
def test_spark_batch_write(spark: Any, tmp_path: Path) -> None:
    d = tmp_path / "ch"
    df = spark.createDataFrame(
        [(b"a", {"k": "1"}), (b"b", None), (b"c", {})], "body binary, headers map<string,string>"
    ).repartition(2)
    w = df.write.format(FORMAT).mode("append")
    for k, v in CH_OPTS.items():
        w = w.option(k, v)
    w.save(str(d))
    evs = view(d)
    assert sorted((e.body, dict(e.headers)) for e in evs) == [(b"a", {"k": "1"}), (b"b", {}), (b"c", {})]
    assert [r["puts"] for r in commit_records(d)] == [3]  # one transaction for the job
    assert staged_files(options(d)) == []


@pytest.mark.spark
def test_spark_stream_restart_without_the_last_commit_log_entry(spark: Any, tmp_path: Path) -> None:
    src, d, ck = tmp_path / "in", tmp_path / "ch", tmp_path / "ck"
    rows = _json_input(src, 3, 4)
    q = _stream(spark, src, d, ck)
    q.awaitTermination(120)
    assert q.exception() is None
    evs = view(d)
    assert [e.body.decode() for e in evs] == rows  # one file per batch, in order
    assert [e.headers[HEADER_BATCH] for e in evs] == [str(i // 4) for i in range(12)]
    assert {e.headers[HEADER_QUERY] for e in evs} == {q.id}
    assert [r["puts"] for r in commit_records(d)] == [4, 4, 4]  # one transaction per micro-batch
    # The driver "crashed" after the sink committed batch 2 but before Spark logged commits/2:
    # the restarted query replays batch 2, and the sink does not put it twice.
    (ck / "commits" / "2").unlink()
    with contextlib.suppress(FileNotFoundError):
        (ck / "commits" / ".2.crc").unlink()
    more = _json_input(src, 1, 2, first=100)
    q2 = _stream(spark, src, d, ck)
    q2.awaitTermination(120)
    assert q2.exception() is None
    assert q2.id == q.id
    assert [p["batchId"] for p in q2.recentProgress if p["numInputRows"]] == [2, 3]
    assert [e.body.decode() for e in view(d)] == rows + more
    assert staged_files(options(d)) == []


def _run_to_end(writer: Any) -> None:
    """Start a streaming query and wait for it; raise what failed it (at start or while running)."""
    q = writer.start()
    q.awaitTermination(120)
    exc = q.exception()
    if exc is not None:
        raise exc


@pytest.mark.spark
def test_spark_errors_users_see(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    src, d = tmp_path / "in", tmp_path / "ch"
    _json_input(src, 1, 2)
    df = spark.readStream.schema("body string, k string").json(str(src))
    w = df.writeStream.format(FORMAT).option("path", str(d)).option("checkpointLocation", str(tmp_path / "c1"))
    with pytest.raises(Exception, match=r"unexpected column\(s\) 'k'"):
        _run_to_end(w.trigger(availableNow=True))
    # A channel another process keeps open: the query fails naming the lock and the way out.
    SinkCommitter(options(d)).ensure_channel()
    holder = filechannel.open(str(d), minimum_required_space=0)
    try:
        w = df.select(F.col("body")).writeStream.format(FORMAT).option("path", str(d)).option("lockTimeout", "0.5")
        w = w.option("checkpointLocation", str(tmp_path / "c2")).trigger(availableNow=True)
        with pytest.raises(Exception, match="lockTimeout"):
            _run_to_end(w)
    finally:
        holder.close()
    assert bodies_of(d) == []
