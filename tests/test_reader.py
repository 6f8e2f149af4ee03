"""ChannelReader: a lock-free, read-only view from any process, following a live owner."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import ChannelReader, DataLossError, read_segment

OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}


def body(i: int, size: int = 60) -> bytes:
    tag = b"ev-%06d|" % i
    return tag + b"x" * max(0, size - len(tag))


def put_range(ch: filechannel.FileChannel, a: int, b: int, **kw: Any) -> None:
    with ch.transaction() as tx:
        for i in range(a, b):
            tx.put(body(i), headers={"i": str(i)} if i % 3 == 0 else None, **kw)


def taken_all(ch: filechannel.FileChannel) -> list[filechannel.Event]:
    tx = ch.transaction()
    evs = tx.take_batch(max(1, ch.size))
    tx.rollback()
    assert len(evs) == ch.size, "one take could not hold the whole queue: raise transaction_capacity"
    return evs


def test_view_of_a_closed_channel_reads_what_a_take_returns(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS, max_file_size=4096) as ch:
        for i in range(0, 120, 10):
            put_range(ch, i, i + 10)
        with ch.transaction() as tx:
            tx.take_batch(15)
        expected = taken_all(ch)
    with ChannelReader(d) as r:
        start, end = r.available()
        assert (start, end) == (15, 120)
        got = r.read(start, end)
        assert got == expected
        assert [e.headers for e in got] == [e.headers for e in expected]
        segs = r.segments(start, end, max_bytes=1024)
        assert len(segs) > 3
        assert [e for s in segs for e in read_segment(s)] == expected
        assert r.read(start, end, limit=5) == expected[:5]
        assert r.read(20, 30) == expected[5:15]


def test_follows_a_live_owner_commits_rollbacks_rolls_and_retirement(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS, max_file_size=4096)
    r = ChannelReader(d)
    seen: list[int] = []
    try:
        nxt = 0
        for rnd in range(30):
            put_range(ch, nxt, nxt + 7)
            nxt += 7
            tx = ch.transaction()
            tx.put(b"rolled back")
            tx.rollback()
            start, end = r.available()
            evs = r.read(max(start, len(seen)), end)
            for e in evs:
                assert e.body == body(e.position)
            seen += [e.position for e in evs]
            if rnd % 5 == 4:  # the owner consumes (and retires files) behind the reader
                with ch.transaction() as t2:
                    t2.take_batch(20)
                ch.retire_files()
        assert seen == list(range(nxt))
        assert ch.stats()["files_retired"] > 0
        # what the owner took is gone for a view: below its head
        with pytest.raises(DataLossError):
            r.read(0, 5)
    finally:
        ch.close()


def _data_end(buf: bytes) -> int:
    """Where the written records end (a BATCH_END's last word, its write-order id, is never zero)."""
    n = len(buf.rstrip(b"\0"))
    return n + (-n & 7)


def test_a_torn_batch_at_the_tail_is_not_yet_visible(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        put_range(ch, 0, 5)
        r = ChannelReader(d)
        assert r.available() == (0, 5)
        data = os.path.join(d, "data")
        seg = os.path.join(data, sorted(n for n in os.listdir(data) if n.endswith(".wal"))[-1])
        size = _data_end(Path(seg).read_bytes())  # the file is zero-filled ahead of the writer
        # The owner's next batch, half written: visible only once it is whole.
        put_range(ch, 5, 8)
        whole = Path(seg).read_bytes()
    end = _data_end(whole)
    d2 = str(tmp_path / "copy")
    os.makedirs(os.path.join(d2, "data"))
    for name in os.listdir(d):
        src = os.path.join(d, name)
        if os.path.isfile(src):
            Path(d2, name).write_bytes(Path(src).read_bytes())
    for name in os.listdir(data):
        Path(d2, "data", name).write_bytes(Path(data, name).read_bytes())
    seg2 = os.path.join(d2, "data", os.path.basename(seg))
    tail = whole[size:end]
    Path(seg2).write_bytes(whole[:size] + tail[: len(tail) // 2])
    r2 = ChannelReader(d2)
    assert r2.available() == (0, 5)  # not yet, and no error
    Path(seg2).write_bytes(whole[:end])
    assert r2.available() == (0, 8)
    assert [e.position for e in r2.read(0, 8)] == list(range(8))


def test_pickled_before_and_after_use(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        put_range(ch, 0, 10)
    r = ChannelReader(d, consumer="spark-q1", identity="q1")
    early = pickle.loads(pickle.dumps(r))
    assert r.available() == (0, 10)
    late = pickle.loads(pickle.dumps(r))
    assert early.read(0, 10) == late.read(0, 10) == r.read(0, 10)


def test_ack_is_monotone_durable_and_checked(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS) as ch:
        put_range(ch, 0, 10)
    r = ChannelReader(d, consumer="c1", identity="job-a")
    assert r.available() == (0, 10)
    assert r.ack(4) == 4
    assert r.ack(2) == 4  # lower: ignored
    assert r.available() == (4, 10)
    with pytest.raises(filechannel.ChannelError, match="only positions below 10"):
        r.ack(11)
    with pytest.raises(DataLossError):
        r.read(2, 6)  # below the acknowledged mark
    with pytest.raises(DataLossError):
        r.read(4, 12)  # beyond what the channel holds
    # another process (a new reader) sees the durable mark
    assert ChannelReader(d, consumer="c1", identity="job-a").available() == (4, 10)
    with pytest.raises(filechannel.ConsumerIdentityError):
        ChannelReader(d, consumer="c1", identity="job-b").available()
    assert ChannelReader(d, consumer="c1", identity="job-b", reset=True).available() == (4, 10)
    with pytest.raises(filechannel.ChannelError, match="view"):
        ChannelReader(d).ack(5)


def test_acks_become_takes_in_the_owner_and_files_retire(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS, max_file_size=4096) as ch:
        for i in range(0, 200, 20):
            put_range(ch, i, i + 20)
        files_before = ch.stats()["files"]
    r = ChannelReader(d, consumer="c1")
    assert r.available() == (0, 200)
    r.ack(150)
    with filechannel.open(d, **OPTS, max_file_size=4096) as ch:  # no owner was running: applied at open
        ch.retire_files()
        assert ch.size == 50
        assert ch.stats()["files"] < files_before
        tx = ch.transaction()
        with pytest.raises(filechannel.ConsumerConflictError, match="c1"):
            tx.take()
        tx.rollback()
    assert r.available() == (150, 200)
    assert [e.position for e in r.read(150, 200)] == list(range(150, 200))


def _read_segment_in_child(seg: Any) -> list[tuple[int, bytes, dict[str, str]]]:
    return [(e.position, e.body, dict(e.headers)) for e in read_segment(seg)]


def test_segments_read_in_parallel_processes_equal_read(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, **OPTS, max_file_size=16384) as ch:
        for i in range(0, 600, 50):
            put_range(ch, i, i + 50)
    r = ChannelReader(d)
    start, end = r.available()
    segs = r.segments(start, end, max_bytes=4096)
    assert len(segs) >= 4
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        parts = pool.map(_read_segment_in_child, segs)
    got = [x for part in parts for x in part]
    assert got == [(e.position, e.body, dict(e.headers)) for e in r.read(start, end)]


_FOLLOWER = r"""
import json, sys, time
from filechannel import ChannelReader
d, n = sys.argv[1], int(sys.argv[2])
r = ChannelReader(d, consumer="follower")
got = 0
deadline = time.monotonic() + 60
while got < n and time.monotonic() < deadline:
    start, end = r.available()
    if end > start:
        for e in r.read(start, end):
            print(json.dumps([e.position, e.body.decode()]), flush=True)
            got += 1
        r.ack(end)
    else:
        time.sleep(0.002)
"""


def test_reader_in_a_subprocess_sees_exactly_the_committed_sequence(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS, max_file_size=8192, ack_interval=0.05)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    n = 400
    p = subprocess.Popen([sys.executable, "-c", _FOLLOWER, d, str(n)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        nxt = 0
        while nxt < n:
            put_range(ch, nxt, nxt + 8)
            tx = ch.transaction()
            tx.put(b"never")
            tx.rollback()
            nxt += 8
            time.sleep(0.001)
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r[0] for r in rows] == list(range(n))
    assert all(r[1].encode() == body(r[0]) for r in rows)
    ch.apply_acks()
    ch.retire_files()
    assert ch.size == 0  # every acknowledged event was taken by the owner
    ch.close()


_OWNER = r"""
import sys, filechannel
d = sys.argv[1]
ch = filechannel.open(d, minimum_required_space=0, max_file_size=8192, checkpoint_interval=0)
i = 0
while True:
    with ch.transaction() as tx:
        for _ in range(5):
            tx.put(b"ev-%06d|" % i + b"y" * 50)
            i += 1
    print(i, flush=True)
"""


def test_sigkill_of_the_owner_while_a_reader_follows(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    filechannel.open(d, **OPTS).close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = ChannelReader(d)
    seen: dict[int, bytes] = {}
    for round_ in range(3):
        p = subprocess.Popen([sys.executable, "-c", _OWNER, d], stdout=subprocess.PIPE, env=env)
        assert p.stdout is not None
        p.stdout.readline()
        t_end = time.monotonic() + 0.3 + 0.1 * round_
        while time.monotonic() < t_end:
            start, end = r.available()
            for e in r.read(max(start, len(seen)), end):
                seen[e.position] = e.body
        p.send_signal(signal.SIGKILL)
        p.wait()
        start, end = r.available()
        for e in r.read(max(start, len(seen)), end):
            seen[e.position] = e.body
        # recovery never drops what the reader returned (a fast owner puts more than one
        # default-sized take holds)
        with filechannel.open(d, **OPTS, capacity=10**8, transaction_capacity=10**8) as ch:
            held = {e.position: e.body for e in taken_all(ch)}
        assert all(held.get(p_) == b for p_, b in seen.items()), "the reader returned an event recovery dropped"
    assert sorted(seen) == list(range(len(seen)))
    assert len(seen) > 0
    # after the owner reopened, the reader continues without gaps or repeats
    with filechannel.open(d, **OPTS) as ch:
        base = ch.stats()["next_position"]
        with ch.transaction() as tx:
            tx.put(b"after")
    start, end = r.available()
    tail = r.read(max(start, len(seen)), end)
    assert [e.position for e in tail][-1] == base
    assert tail[-1].body == b"after"


class _FailOnce(filechannel._fs.OsFS):
    """The real file system; one armed write into ``target`` fails with ENOSPC (nothing written)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.armed = False
        self.paths: dict[int, str] = {}

    def open_rw(self, path: str) -> int:
        fd = super().open_rw(path)
        self.paths[fd] = path
        return fd

    def create(self, path: str) -> int:
        fd = super().create(path)
        self.paths[fd] = path
        return fd

    def pwrite_all(self, fd: int, data: Any, offset: int) -> None:
        if self.armed and os.path.dirname(self.paths.get(fd, "")) == self.target:
            self.armed = False
            raise OSError(28, "No space left on device (injected)")
        super().pwrite_all(fd, data, offset)


def test_a_reader_moves_past_a_failed_commits_positions_with_several_data_directories(tmp_path: Path) -> None:
    """A commit that fails after its positions were assigned (ENOSPC) leaves a gap. With
    several data directories the reader cannot tell a gap from a commit still in flight in
    another directory, until every directory has durably written past the commit after the
    gap: then nothing can fill it, and the reader goes on. Before, it stopped there for good."""
    d = str(tmp_path / "ch")
    dirs = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    fs = _FailOnce(dirs[1])
    ch = filechannel.open(d, data_dirs=dirs, minimum_required_space=0, checkpoint_interval=0, fs=fs)
    reader = ChannelReader(d, "c")
    committed: list[bytes] = []

    def commit(b: bytes) -> bool:
        try:
            with ch.transaction() as tx:
                tx.put(b)
        except OSError:
            return False
        committed.append(b)
        return True

    try:
        for i in range(4):
            assert commit(body(i))
        assert reader.available() == (0, 4)
        fs.armed = True
        # Transactions alternate between the directories: one of these two writes to d1 and fails.
        assert [commit(b"next-%d" % i) for i in range(2)].count(False) == 1
        gap_end = ch.stats()["next_position"]
        assert len(committed) == 5
        assert gap_end == 6
        stuck = reader.available()
        for i in range(4, 10):  # both directories write past the gap
            assert commit(body(i))
        start, end = reader.available()
        assert (start, end) == (0, ch.stats()["next_position"]), f"stuck at {stuck}"
        assert [e.body for e in reader.read(start, end)] == committed
        reader.ack(end)  # past the gap: the owner takes every event, the gap's positions are nothing to take
        ch.apply_acks()
        assert ch.size == 0
        reader.ack(end)
    finally:
        reader.close()
        ch.close()
