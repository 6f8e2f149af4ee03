"""The Spark sink (filechannel.spark.sink): options, staging, one transaction per batch, exactly once per batch id.

Most tests need no JVM: they drive the writers' ``write``/``commit``/``abort``
directly (with the Spark task's identity faked) and the commit protocol
(``SinkCommitter``) on real directories, on a crashable simulated file system
(every mutating call of a commit, several crash variants, then a replay of the
same batch id, with and without another producer and a reader acknowledging
everything in between) and in a subprocess killed with SIGKILL at chosen
points. Tests marked ``spark`` run real queries on a shared local session:
batch and streaming writes, a restart whose checkpoint lacks the last
``commits/N``, and the errors users see (the ``spark`` fixture: tests/spark_session.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from simfs import MUTATING_OPS, SimFS

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

import filechannel  # noqa: E402
from filechannel import ChannelReader, cli  # noqa: E402
from filechannel._fs import DEFAULT_FS, FS  # noqa: E402
from filechannel.consumers import ConsumerStore  # noqa: E402
from filechannel.spark import sink  # noqa: E402
from filechannel.spark.sink import (  # noqa: E402
    HEADER_BATCH,
    HEADER_QUERY,
    FileChannelBatchWriter,
    FileChannelStreamWriter,
    SinkCommitter,
    SinkLockedError,
    SinkOptions,
    StagedFiles,
    TaskInfo,
    read_staged,
    stage_events,
)

QUERY = "0b1e7a52-6a55-4c1f-9d07-5a1d2f3c4b5e"
CH_OPTS: dict[str, Any] = {"channel.minimum_required_space": "0", "channel.checkpoint_interval": "0"}
SCHEMA = StructType([StructField("body", BinaryType()), StructField("headers", MapType(StringType(), StringType()))])
TEXT_SCHEMA = StructType([StructField("body", StringType())])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


# --------------------------------------------------------------------------
# helpers


def options(path: str | Path, **extra: str) -> SinkOptions:
    return SinkOptions.from_spark({"path": str(path), **CH_OPTS, **extra})


def batch_of(bodies: list[Any], headers: list[Any] | None = None, text: bool = False) -> Any:
    cols = [pa.array(bodies, type=pa.string() if text else pa.binary())]
    names = ["body"]
    if headers is not None:
        cols.append(pa.array(headers, type=pa.map_(pa.string(), pa.string())))
        names.append("headers")
    return pa.record_batch(cols, names=names)


def stage(opts: SinkOptions, batch_id: int, bodies: list[bytes], part: int = 0, fs: FS = DEFAULT_FS) -> str:
    """Stage ``bodies`` as one task of ``batch_id`` would; return the staged file's name."""
    name = sink._staged_name(sink._stream_prefix(QUERY, batch_id), part, 0)
    got, rows, _ = stage_events(fs, opts.staging_dir, name, [(b, None) for b in bodies], 1 << 20)
    assert (got, rows) == (name, len(bodies))
    return name


def view(path: str | Path, fs: FS | None = None) -> list[filechannel.Event]:
    """Every committed event still in the channel (a lock-free view)."""
    with ChannelReader(str(path), fs=fs) as v:
        start, end = v.available()
        return v.read(start, end)


def bodies_of(path: str | Path, fs: FS | None = None) -> list[bytes]:
    return [e.body for e in view(path, fs)]


def commit_records(path: str | Path) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["dump", str(path)]) == 0
    return [r for r in map(json.loads, out.getvalue().splitlines()) if r["op"] == "commit" and r["puts"]]


def staged_files(opts: SinkOptions) -> list[str]:
    try:
        return sorted(os.listdir(opts.staging_dir))
    except FileNotFoundError:
        return []


def guards(path: str | Path, fs: FS = DEFAULT_FS) -> list[str]:
    return sorted(n for n in ConsumerStore(fs, str(path)).list() if n.startswith("spark-sink."))


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
# options and schema


def test_options_parse_and_convert(tmp_path: Path) -> None:
    o = SinkOptions.from_spark(
        {
            "PATH": str(tmp_path / "ch"),
            "channel.capacity": "5000",
            "channel.fsync": "interval",
            "channel.fsync_interval": "0.5",
            "channel.data_dirs": f"{tmp_path}/d1, {tmp_path}/d2",
            "lockTimeout": "2.5",
            "checkpointLocation": "/ck",
        }
    )
    assert o.channel == {
        "capacity": 5000,
        "fsync": "interval",
        "fsync_interval": 0.5,
        "data_dirs": (f"{tmp_path}/d1", f"{tmp_path}/d2"),
    }
    assert (o.lock_timeout, o.checkpoint_location) == (2.5, "/ck")
    assert o.staging_dir == str(tmp_path / "ch" / "spark-sink" / "staging")


@pytest.mark.parametrize(
    ("opts", "option", "words"),
    [
        ({}, "path", "channel directory"),
        ({"channel.capacity": "lots"}, "channel.capacity", "must be an int"),
        ({"channel.capacity": "0"}, "channel.capacity", "positive int"),
        ({"channel.transaction_capacity": "20", "channel.capacity": "10"}, "channel.transaction_capacity", "exceeds"),
        ({"channel.fsync": "never"}, "channel.fsync", "must be one of"),
        ({"channel.bogus": "1"}, "channel.bogus", "unknown channel option"),
        ({"lockTimout": "1"}, "locktimout", "unknown option"),
        ({"lockTimeout": "soon"}, "lockTimeout", "number of seconds"),
        ({"staleStagingSeconds": "-1"}, "staleStagingSeconds", ">= 0"),
    ],
)
def test_bad_options_raise_config_error(tmp_path: Path, opts: dict[str, str], option: str, words: str) -> None:
    if option != "path":
        opts = {"path": str(tmp_path / "ch"), **opts}
    with pytest.raises(filechannel.ConfigError, match=words) as ei:
        SinkOptions.from_spark(opts)
    assert ei.value.option == option
    assert not (tmp_path / "ch").exists()


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
# staging (the executor side)


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


# --------------------------------------------------------------------------
# idempotence per batch id


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
    st = sink._StateStore(DEFAULT_FS, w.options).load(QUERY)
    assert st == sink.QueryState(QUERY, 1, None)


def test_queries_are_independent(tmp_path: Path) -> None:
    o = options(tmp_path / "ch")
    c = SinkCommitter(o)
    c.ensure_channel()
    for q in ("query-a", "query/b with spaces"):
        name = sink._staged_name(sink._stream_prefix(q, 0), 0, 0)
        stage_events(DEFAULT_FS, o.staging_dir, name, [(q.encode(), None)], 1 << 20)
        assert c.commit_batch(q, 0, [name]).committed
    assert bodies_of(o.path) == [b"query-a", b"query/b with spaces"]
    assert len(os.listdir(o.queries_dir)) == 2


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


# --------------------------------------------------------------------------
# all or nothing, refusals, the lock


def test_a_refused_batch_leaves_nothing_and_commits_later(tmp_path: Path) -> None:
    o = options(tmp_path / "ch", **{"channel.capacity": "10", "channel.keep_alive": "0"})
    c = SinkCommitter(o)
    c.ensure_channel()
    with (
        filechannel.open(o.path, minimum_required_space=0, capacity=10, transaction_capacity=10) as ch,
        ch.transaction() as tx,
    ):
        tx.put_many([b"p%d" % i for i in range(8)])
    names = [stage(o, 0, [b"a", b"b"], 0), stage(o, 0, [b"c", b"d", b"e"], 1)]
    with pytest.raises(filechannel.ChannelFullError):
        c.commit_batch(QUERY, 0, names)
    assert len(bodies_of(o.path)) == 8  # none of the batch
    assert guards(o.path) == []  # settled at once: nothing stays pinned
    assert sink._StateStore(DEFAULT_FS, o).load(QUERY).pending is None
    with (
        filechannel.open(o.path, minimum_required_space=0, capacity=10, transaction_capacity=10) as ch,
        ch.transaction() as tx,
    ):
        tx.take_batch(6)
    assert c.commit_batch(QUERY, 0, names).committed  # Spark replays the batch after the restart
    assert bodies_of(o.path) == [b"p6", b"p7", b"a", b"b", b"c", b"d", b"e"]
    big = stage(o, 1, [b"%d" % i for i in range(11)])
    with pytest.raises(filechannel.TransactionCapacityError, match=r"11 rows, more than the channel's capacity=10"):
        c.commit_batch(QUERY, 1, [big])


def test_missing_or_damaged_staged_files_fail_clearly(tmp_path: Path) -> None:
    o = options(tmp_path / "ch")
    c = SinkCommitter(o)
    c.ensure_channel()
    name = stage(o, 0, [b"a", b"b"])
    path = os.path.join(o.staging_dir, name)
    data = bytearray(Path(path).read_bytes())
    data[12] ^= 1
    Path(path).write_bytes(bytes(data))
    with pytest.raises(filechannel.CorruptLogError, match="checksum mismatch"):
        c.commit_batch(QUERY, 0, [name])
    os.unlink(path)
    with pytest.raises(filechannel.ChannelError, match="is missing"):
        c.commit_batch(QUERY, 0, [name])
    with pytest.raises(filechannel.ChannelError, match="reported 3 rows"):
        c.commit_batch(QUERY, 0, [stage(o, 0, [b"a", b"b"])], rows=3)
    assert bodies_of(o.path) == []


def test_locked_channel_is_retried_then_refused_with_a_clear_message(tmp_path: Path) -> None:
    o = options(tmp_path / "ch", lockTimeout="0.3")
    c = SinkCommitter(o)
    c.ensure_channel()
    name = stage(o, 0, [b"a"])
    holder = filechannel.open(o.path, minimum_required_space=0)
    try:
        t0 = time.monotonic()
        with pytest.raises(filechannel.ChannelLockedError) as ei:
            c.commit_batch(QUERY, 0, [name])
        assert time.monotonic() - t0 >= 0.3
        assert isinstance(ei.value, SinkLockedError)
        msg = str(ei.value)
        for words in ("batch 0 of query", "stayed open by another process", "lockTimeout", "ChannelReader"):
            assert words in msg
        assert ei.value.path == o.path
    finally:
        holder.close()
    assert staged_files(o) == [name]  # kept for the retry
    # Released while the sink waits: the commit goes through.
    holder = filechannel.open(o.path, minimum_required_space=0)
    threading.Timer(0.3, holder.close).start()
    assert SinkCommitter(options(o.path, lockTimeout="10")).commit_batch(QUERY, 0, [name]).committed
    assert bodies_of(o.path) == [b"a"]


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
# settling an interrupted commit


def _planted_intent(o: SinkOptions, landed: bool, others: int) -> None:
    """Leave the state an interrupted commit of batch 0 (2 rows) leaves, then let another producer write."""
    c = SinkCommitter(o)
    c.ensure_channel()
    ConsumerStore(DEFAULT_FS, o.path).register(sink._guard_name(QUERY), "guard", 0)
    sink._StateStore(DEFAULT_FS, o).save(sink.QueryState(QUERY, -1, sink.Pending(0, 0, 2)))
    with filechannel.open(o.path, minimum_required_space=0) as ch:
        if landed:
            with ch.transaction() as tx:
                tx.put_many([b"a", b"b"], headers=sink._sink_headers(QUERY, 0))
        if others:
            with ch.transaction() as tx:
                tx.put_many([b"other"] * others)


@pytest.mark.parametrize("landed", [True, False])
def test_an_interrupted_commit_is_settled_from_the_channel(tmp_path: Path, landed: bool) -> None:
    o = options(tmp_path / "ch")
    _planted_intent(o, landed, others=3)  # others fill position 0.. when the batch did not land
    names = [stage(o, 0, [b"a", b"b"])]
    out = SinkCommitter(o).commit_batch(QUERY, 0, names)
    assert out.committed is not landed
    got = bodies_of(o.path)
    assert sorted(got) == [b"a", b"b", b"other", b"other", b"other"]
    assert guards(o.path) == []
    assert sink._StateStore(DEFAULT_FS, o).load(QUERY) == sink.QueryState(QUERY, 0, None)


def test_the_guard_keeps_the_intended_position_readable(tmp_path: Path) -> None:
    # Not landed, another producer wrote more events than the batch, a reader acknowledged all:
    # the owner must not take them (the guard pins position 0), or the sink could not tell.
    o = options(tmp_path / "ch")
    _planted_intent(o, landed=False, others=4)
    with ChannelReader(o.path, consumer="reader") as r:
        r.ack(r.available()[1])
    with filechannel.open(o.path, minimum_required_space=0) as ch:
        assert ch.size == 4  # pinned
    assert SinkCommitter(o).commit_batch(QUERY, 0, [stage(o, 0, [b"a", b"b"])]).committed
    with filechannel.open(o.path, minimum_required_space=0) as ch:
        ch.apply_acks()
        assert ch.size == 2  # the guard is gone: the acknowledged events are taken now
    assert bodies_of(o.path) == [b"a", b"b"]


# --------------------------------------------------------------------------
# crashes at every point of a commit (simulated power cuts), then a replay of the batch id

SIM = "/sim/ch"
VARIANTS = [("drop", 0), ("keep", 0), ("prefix", 1), ("subset", 2), ("torn", 3), ("random", 4)]


def _sim_setup(fsync: str) -> tuple[SimFS, SinkOptions, list[str]]:
    fs = SimFS()
    o = options(SIM, **{"channel.max_file_size": "8192", "channel.fsync": fsync, "channel.fsync_interval": "3600"})
    c = SinkCommitter(o, fs=fs)
    c.ensure_channel()
    with filechannel.open(SIM, fs=fs, minimum_required_space=0, background=False) as ch, ch.transaction() as tx:
        tx.put_many([b"pre-0", b"pre-1"])
    assert c.commit_batch(QUERY, 0, [stage(o, 0, [b"b0-%d" % i for i in range(3)], fs=fs)]).committed
    names = [stage(o, 1, [b"b1-0", b"b1-1"], 0, fs=fs), stage(o, 1, [b"b1-2", b"b1-3"], 1, fs=fs)]
    return fs, o, names


def _interfere(fs: FS, o: SinkOptions, n: int) -> list[filechannel.Event]:
    """Another producer puts ``n`` events; a reader reads and acknowledges everything; the owner applies it."""
    with filechannel.open(o.path, fs=fs, minimum_required_space=0, background=False) as ch, ch.transaction() as tx:
        tx.put_many([b"other"] * n)
    with ChannelReader(o.path, consumer="reader", fs=fs) as r:
        start, end = r.available()
        seen = r.read(start, end)
        r.ack(end)
    with filechannel.open(o.path, fs=fs, minimum_required_space=0, background=False) as ch:
        ch.apply_acks()
    return seen


@pytest.mark.parametrize(
    ("fsync", "variants"),
    [("commit", VARIANTS), ("interval", [("drop", 0), ("prefix", 1), ("random", 4)])],
)
def test_crash_at_every_point_of_a_commit_then_replay_puts_the_batch_once(
    fsync: str, variants: list[tuple[str, int]]
) -> None:
    # With fsync="interval" the sink still syncs the batch before recording it as committed.
    fs, o, names = _sim_setup(fsync)
    snaps: list[tuple[SimFS, str]] = []
    fs.on_op = lambda op, path: snaps.append((fs.snapshot(), f"{op} {path}")) if op in MUTATING_OPS else None
    assert SinkCommitter(o, fs=fs).commit_batch(QUERY, 1, names).committed
    fs.on_op = None
    assert len(snaps) >= 25
    batch1 = [b"b1-%d" % i for i in range(4)]
    before = [b"pre-0", b"pre-1", b"b0-0", b"b0-1", b"b0-2"]
    checked = 0
    for i, (snap, op) in enumerate(snaps):
        for j, (mode, seed) in enumerate(variants):
            crashed = snap.crash(seed * 7919 + i, mode)
            where = f"crash after #{i} {op} ({mode}/{seed})"
            # All or nothing: what a reader sees right after the crash.
            got = bodies_of(SIM, crashed)
            assert got[:5] == before, where
            assert got[5:] in ([], batch1), where
            seen: list[filechannel.Event] = []
            if j % 2:
                seen = _interfere(crashed, o, 6)
            # Spark replays batch 1 (its tasks ran again or the staged files are still there).
            replay = list(names)
            if not all(crashed.exists(os.path.join(o.staging_dir, n)) for n in names):
                replay = [stage(o, 1, batch1, 7, fs=crashed)]
            SinkCommitter(o, fs=crashed).commit_batch(QUERY, 1, replay)
            final = view(SIM, crashed)
            head = final[0].position if final else 1 << 62
            delivered = [e for e in seen if e.position < head] + final
            # Every event: taken only after a reader acknowledged it, never lost, never twice.
            assert [e.body for e in delivered if e.body != b"other"] == before + batch1, where
            assert [e.body for e in delivered].count(b"other") == (6 if j % 2 else 0), where
            assert all(e.headers[HEADER_BATCH] == "1" for e in delivered if e.body.startswith(b"b1-")), where
            assert guards(SIM, crashed) == [], where
            assert crashed.listdir(o.queries_dir) == [f"{QUERY}.state"], where  # no temporaries left
            assert crashed.listdir(o.staging_dir) == [], where
            assert sink._StateStore(crashed, o).load(QUERY) == sink.QueryState(QUERY, 1, None), where
            assert SinkCommitter(o, fs=crashed).commit_batch(QUERY, 1, replay).reason == "already committed"
            checked += 1
    print(f"\nsink commit ({fsync}): {len(snaps)} persistence points x {len(variants)} variants = {checked} checked")


# --------------------------------------------------------------------------
# SIGKILL of a real process in the middle of a commit

_KILL_CHILD = r"""
import os, signal, sys
from filechannel._fs import OsFS
from filechannel.spark.sink import SinkCommitter, SinkOptions

class KillFS(OsFS):
    n = 0
for _op in ("makedirs", "create", "pwrite_all", "fsync", "fdatasync", "fsync_dir", "replace", "unlink", "truncate"):
    def _wrap(self, *a, _op=_op, **k):
        KillFS.n += 1
        if KillFS.n == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)
        return getattr(OsFS, _op)(self, *a, **k)
    setattr(KillFS, _op, _wrap)

opts = SinkOptions.from_spark({"path": sys.argv[1], "channel.minimum_required_space": "0",
                               "channel.checkpoint_interval": "0"})
out = SinkCommitter(opts, fs=KillFS()).commit_batch(sys.argv[3], 1, sys.argv[4].split(","))
print("done", KillFS.n, out.committed)
"""


@pytest.mark.slow
def test_sigkill_at_points_of_a_commit_then_replay_puts_the_batch_once(tmp_path: Path) -> None:
    base = tmp_path / "base"
    o = options(base)
    SinkCommitter(o).ensure_channel()
    batch1 = [b"b1-%03d" % i for i in range(300)]
    names = [stage(o, 1, batch1[:150], 0), stage(o, 1, batch1[150:], 1)]
    # How many mutating calls does an uninterrupted commit make?
    dry = tmp_path / "dry"
    shutil.copytree(base, dry)
    r = subprocess.run(
        [sys.executable, "-c", _KILL_CHILD, str(dry), "0", QUERY, ",".join(names)],
        env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    total = int(r.stdout.split()[1])
    points = sorted({1, total, *range(2, total, max(1, total // 7))})
    for k in points:
        d = tmp_path / f"kill-{k}"
        shutil.copytree(base, d)
        r = subprocess.run(
            [sys.executable, "-c", _KILL_CHILD, str(d), str(k), QUERY, ",".join(names)],
            env=ENV, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == -signal.SIGKILL, (k, r.returncode, r.stderr)
        got = bodies_of(d)
        assert got in ([], batch1), f"kill at call {k}: {len(got)} events visible"
        od = options(d)
        replay = names if all((Path(od.staging_dir) / n).exists() for n in names) else [stage(od, 1, batch1, 5)]
        SinkCommitter(od).commit_batch(QUERY, 1, replay)
        assert bodies_of(d) == batch1, f"kill at call {k}"
        assert guards(d) == []


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
