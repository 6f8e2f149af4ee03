"""The Spark sink's commit protocol (filechannel.spark.sink), without Spark, PySpark or pyarrow.

Options, the commit protocol (``SinkCommitter``) on real directories: one
transaction per batch, exactly once per batch id, refusals and the lock, an
interrupted commit settled from the channel; on a crashable simulated file
system (every mutating call of a commit, several crash variants, then a replay
of the same batch id, with and without another producer and a reader
acknowledging everything in between) and in a subprocess killed with SIGKILL at
chosen points. None of these needs PySpark or pyarrow, and
``test_spark_sink_no_pyspark.py`` runs them with both blocked. The writers
(schema checks, staging Arrow batches) and real queries are in
``test_spark_sink_writers.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from simfs import MUTATING_OPS, SimFS
from sink_helpers import ENV, QUERY, bodies_of, guards, options, stage, staged_files, view

import filechannel
from filechannel import ChannelReader
from filechannel._fs import DEFAULT_FS, FS
from filechannel.consumers import ConsumerStore
from filechannel.spark import sink, sink_commit
from filechannel.spark.sink import HEADER_BATCH, SinkCommitter, SinkLockedError, SinkOptions, stage_events

# --------------------------------------------------------------------------
# options


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


# --------------------------------------------------------------------------
# the commit protocol: all or nothing, refusals, the lock


def test_queries_are_independent(tmp_path: Path) -> None:
    o = options(tmp_path / "ch")
    c = SinkCommitter(o)
    c.ensure_channel()
    for q in ("query-a", "query/b with spaces"):
        name = sink._staged_name(sink.stream_prefix(q, 0), 0, 0)
        stage_events(DEFAULT_FS, o.staging_dir, name, [(q.encode(), None)], 1 << 20)
        assert c.commit_batch(q, 0, [name]).committed
    assert bodies_of(o.path) == [b"query-a", b"query/b with spaces"]
    assert len(os.listdir(o.queries_dir)) == 2


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
    assert sink.StateStore(DEFAULT_FS, o).load(QUERY).pending is None
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


# --------------------------------------------------------------------------
# settling an interrupted commit


def _planted_intent(o: SinkOptions, landed: bool, others: int) -> None:
    """Leave the state an interrupted commit of batch 0 (2 rows) leaves, then let another producer write."""
    c = SinkCommitter(o)
    c.ensure_channel()
    ConsumerStore(DEFAULT_FS, o.path).register(sink_commit._guard_name(QUERY), "guard", 0)
    sink.StateStore(DEFAULT_FS, o).save(sink.QueryState(QUERY, -1, sink.Pending(0, 0, 2)))
    with filechannel.open(o.path, minimum_required_space=0) as ch:
        if landed:
            with ch.transaction() as tx:
                tx.put_many([b"a", b"b"], headers=sink.sink_headers(QUERY, 0))
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
    assert sink.StateStore(DEFAULT_FS, o).load(QUERY) == sink.QueryState(QUERY, 0, None)


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
            assert sink.StateStore(crashed, o).load(QUERY) == sink.QueryState(QUERY, 1, None), where
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
