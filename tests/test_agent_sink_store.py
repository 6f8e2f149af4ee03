"""The agent's side of the Spark sink (``filechannel.agent.staging``), without Flight, PySpark or pyarrow.

The agent owns the channel; a task's rows are staged in one durable file; the
commit puts the staged rows of a batch in one transaction with the mark
``spark-sink:<query>`` = batch id. Here: exactly once per (query, batch id) and
per job id, refusals that leave nothing, cleanup of other attempts and stale
files, and a simulated power cut at every persistence point of staging and of
the commit, after which a restarted agent (the channel recovered) and a retried
commit (or Spark's replay with new staged files) deliver each row exactly once,
while a producer writes through the same agent and a reader acknowledges
everything in between.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from simfs import MUTATING_OPS, SimFS

import filechannel
from filechannel import ChannelReader
from filechannel._fs import DEFAULT_FS, FS
from filechannel.agent.staging import JOBS_MARK, AgentSink, StageRequest, batch_mark
from filechannel.spark.sink import HEADER_BATCH, HEADER_QUERY

QUERY = "0b1e7a52-6a55-4c1f-9d07-5a1d2f3c4b5e"
OPTS = {"minimum_required_space": 0, "checkpoint_interval": 0, "background": False}


def stage(store: AgentSink, batch: int, bodies: list[bytes], part: int = 0, attempt: int = 0) -> str:
    name, rows, _ = store.stage(StageRequest(part, attempt, query=QUERY, batch_id=batch), [(b, None) for b in bodies])
    assert name is not None
    assert rows == len(bodies)
    return name


def events(path: str, fs: FS = DEFAULT_FS) -> list[filechannel.Event]:
    with ChannelReader(path, fs=fs) as v:
        start, end = v.available()
        return v.read(start, end)


def test_one_transaction_per_batch_exactly_once_then_cleanup(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        store = AgentSink(ch, d)
        names = [stage(store, 0, [b"a", b"b"], 0), stage(store, 0, [b"c"], 1)]
        lost = stage(store, 0, [b"x"], 1, attempt=1)  # a speculative attempt Spark did not commit
        assert store.commit_batch(QUERY, 0, names, rows=3)["committed"]
        assert ch.mark(batch_mark(QUERY)) == b"0"
        # The same commit again, and Spark's replay of batch 0 with new staged files: nothing put.
        assert store.commit_batch(QUERY, 0, names)["reason"] == "already committed"
        replay = stage(store, 0, [b"a", b"b", b"c"], 0, attempt=2)
        assert store.commit_batch(QUERY, 0, [replay])["reason"] == "already committed"
        assert os.listdir(store.staging_dir) == []  # every attempt of batch 0 is gone, `lost` too
        assert lost not in os.listdir(store.staging_dir)
        assert store.commit_batch(QUERY, 1, [stage(store, 1, [b"d"])])["committed"]
        # A batch job: one transaction, its id remembered in the jobs mark.
        j, _, _ = store.stage(StageRequest(0, 0, job="job1"), [(b"j", {"k": "v"})])
        assert j is not None
        assert store.commit_job("job1", [j], 1)["committed"]
        assert store.commit_job("job1", [j], 1)["reason"] == "already committed"
        assert ch.mark(JOBS_MARK) == b"job1"
    evs = events(d)
    assert [e.body for e in evs] == [b"a", b"b", b"c", b"d", b"j"]
    assert [e.headers.get(HEADER_BATCH) for e in evs] == ["0", "0", "0", "1", None]
    assert {e.headers.get(HEADER_QUERY) for e in evs[:4]} == {QUERY}
    with filechannel.open(d, **OPTS) as ch:  # the marks survive a restart of the owner
        assert AgentSink(ch, d).commit_batch(QUERY, 1, [])["reason"] == "already committed"


def test_refusals_leave_nothing_and_the_batch_commits_later(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, capacity=6, transaction_capacity=4, keep_alive=0, **OPTS) as ch:
        store = AgentSink(ch, d)
        with ch.transaction() as tx:
            tx.put_many([b"p"] * 4)
        names = [stage(store, 0, [b"a", b"b"], 0), stage(store, 0, [b"c"], 1)]
        with pytest.raises(filechannel.ChannelFullError):
            store.commit_batch(QUERY, 0, names)
        assert ch.mark(batch_mark(QUERY)) is None
        with pytest.raises(filechannel.ChannelError, match="reported 5 rows"):
            store.commit_batch(QUERY, 0, names, rows=5)
        with pytest.raises(filechannel.TransactionCapacityError, match="--transaction-capacity"):
            store.commit_batch(QUERY, 0, [*names, stage(store, 0, [b"d", b"e"], 2)])
        with pytest.raises(filechannel.ChannelError, match="not a staged file name"):
            store.commit_batch(QUERY, 0, ["../../etc/passwd"])
        with pytest.raises(filechannel.EventTooLargeError):
            stage(store, 0, [b"x" * (ch.config.max_event_size + 1)])
        with pytest.raises(filechannel.InvalidEventError, match="job id"):
            StageRequest(0, 0, job="../x")
        with ch.transaction() as tx:
            tx.take_batch(4)
        assert store.commit_batch(QUERY, 0, names)["committed"]  # the replay, once there is room
    assert [e.body for e in events(d)] == [b"a", b"b", b"c"]


def test_abort_and_sweep_drop_staged_files(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        store = AgentSink(ch, d)
        keep = stage(store, 1, [b"k"])
        a = stage(store, 0, [b"a"], 0)
        stage(store, 0, [b"b"], 1, attempt=3)  # a failed task's file: named by nobody, found by its prefix
        assert store.discard(StageRequest(0, 0, query=QUERY, batch_id=0).prefix, [a]) == 2
        assert os.listdir(store.staging_dir) == [keep]
        assert store.sweep(3600) == 0
        assert store.sweep(0) == 1  # older than staleStagingSeconds=0
        assert os.listdir(store.staging_dir) == []


# --------------------------------------------------------------------------
# a power cut at every persistence point of staging and commit, then the agent restarts

SIM = "/sim/ch"
VARIANTS = [("drop", 0), ("keep", 0), ("prefix", 1), ("subset", 2), ("torn", 3), ("random", 4)]
BATCH1 = [b"b1-0", b"b1-1", b"b1-2", b"b1-3"]
BEFORE = [b"pre-0", b"pre-1", b"b0-0", b"b0-1", b"b0-2"]


def _open(fs: FS, fsync: str) -> filechannel.FileChannel:
    return filechannel.open(SIM, fs=fs, max_file_size=8192, fsync=fsync, fsync_interval=3600, **OPTS)


@pytest.mark.parametrize(
    ("fsync", "variants"),
    [("commit", VARIANTS), ("interval", [("drop", 0), ("prefix", 1), ("random", 4)])],
)
def test_power_cut_at_every_point_then_the_retried_commit_delivers_each_row_once(
    fsync: str, variants: list[tuple[str, int]]
) -> None:
    fs = SimFS()
    ch = _open(fs, fsync)
    with ch.transaction() as tx:
        tx.put_many([b"pre-0", b"pre-1"])
    store = AgentSink(ch, SIM, fs=fs)
    assert store.commit_batch(QUERY, 0, [stage(store, 0, [b"b0-0", b"b0-1", b"b0-2"])])["committed"]
    snaps: list[tuple[SimFS, str]] = []
    fs.on_op = lambda op, path: snaps.append((fs.snapshot(), f"{op} {path}")) if op in MUTATING_OPS else None
    names = [stage(store, 1, BATCH1[:2], 0), stage(store, 1, BATCH1[2:], 1)]
    assert store.commit_batch(QUERY, 1, names)["committed"]
    fs.on_op = None
    ch.close()
    assert len(snaps) >= 15
    checked = 0
    for i, (snap, op) in enumerate(snaps):
        for j, (mode, seed) in enumerate(variants):
            crashed = snap.crash(seed * 7919 + i, mode)
            where = f"power cut after #{i} {op} ({mode}/{seed})"
            owner = _open(crashed, fsync)  # the restarted agent recovers the channel
            try:
                got = [e.body for e in events(SIM, crashed)]
                assert got[:5] == BEFORE, where
                assert got[5:] in ([], BATCH1), where  # all of the batch or none
                seen: list[filechannel.Event] = []
                if j % 2:  # a producer writes through the agent, a reader acknowledges everything
                    with owner.transaction() as tx:
                        tx.put_many([b"other"] * 6)
                    with ChannelReader(SIM, consumer="reader", fs=crashed) as r:
                        start, end = r.available()
                        seen = r.read(start, end)
                        r.ack(end)
                    owner.apply_acks()
                agent = AgentSink(owner, SIM, fs=crashed)
                staged = crashed.listdir(agent.staging_dir) if crashed.exists(agent.staging_dir) else []
                if all(n in staged for n in names):
                    replay = names  # the driver retries its commit
                else:  # a stage did not finish: Spark runs the batch's tasks again
                    replay = [stage(agent, 1, BATCH1[:2], 0, 1), stage(agent, 1, BATCH1[2:], 1, 1)]
                agent.commit_batch(QUERY, 1, replay)
                final = events(SIM, crashed)
                head = final[0].position if final else 1 << 62
                delivered = [e for e in seen if e.position < head] + final
                assert [e.body for e in delivered if e.body != b"other"] == BEFORE + BATCH1, where
                assert [e.body for e in delivered].count(b"other") == (6 if j % 2 else 0), where
                assert owner.mark(batch_mark(QUERY)) == b"1", where
                assert crashed.listdir(agent.staging_dir) == [], where
                assert agent.commit_batch(QUERY, 1, replay)["reason"] == "already committed", where
            finally:
                owner.close()
            checked += 1
    print(f"\nagent sink ({fsync}): {len(snaps)} persistence points x {len(variants)} variants = {checked} checked")
