"""ChannelReader at depth: its memory is O(runs), opening it reads no data file, and what it reads is right.

The reader keeps the owner's queue as runs and walks a run's data file
forward (``scan.locate_puts``) when a read needs it; these tests pin that it
neither holds one entry per queued event nor reads every data file to open,
and that reads, polls, segments and byte counts agree with a drain of the
channel whatever the path the reader learned the events by (the owner's
checkpointed runs, or following the writes live).
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

import filechannel
from filechannel import ChannelReader, scan
from filechannel import format as fmt
from filechannel._fs import OsFS

N = 300_000
BATCH = 10_000
OPTIONS = {"fsync": "interval", "checkpoint_interval": 0, "max_file_size": 4 << 20, "capacity": 1 << 30}


def _body(i: int) -> bytes:
    return b"%08d" % i + b"x" * 92


def _record_size(body: bytes) -> int:
    n = len(fmt.encode_event(body, None))
    return fmt.RECORD_HEADER_LEN + n + (-n & 7)


def _fill(d: str, n: int = N) -> None:
    with filechannel.open(d, **OPTIONS) as ch:
        for i in range(0, n, BATCH):
            with ch.transaction() as tx:
                tx.put_many([_body(k) for k in range(i, min(n, i + BATCH))])


class _CountingFS(OsFS):
    """The OS, counting the bytes read from data files."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}
        self.data_bytes = 0

    def open_read(self, path: str) -> int:
        fd = super().open_read(path)
        self.names[fd] = path
        return fd

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        got = super().pread(fd, n, offset)
        if Path(self.names.get(fd, "")).name.startswith("seg-"):
            self.data_bytes += len(got)
        return got


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("deep") / "ch")
    _fill(d)
    return d


def _data_bytes(d: str) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("seg-*"))


def test_opening_a_reader_on_a_deep_queue_reads_no_data_file_and_holds_no_entry_per_event(deep: str) -> None:
    fs = _CountingFS()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        rd = ChannelReader(deep, fs=fs)
        start, end = rd.available()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert (start, end) == (0, N)
    # One entry per event (four int64 columns) would be 32 B x 300 000 = 9.6 MB.
    assert held < 1_000_000, f"the reader holds {held} bytes for {N} queued events"
    # Opening walked no data file: recovery read the tail after the checkpoint at most.
    assert fs.data_bytes < _data_bytes(deep) // 20, (fs.data_bytes, _data_bytes(deep))
    # A read in the middle walks the run that holds it (here, from its data file's start), not the queue.
    fs.data_bytes = 0
    got = rd.read(179_990, 180_000)
    assert [e.body for e in got] == [_body(k) for k in range(179_990, 180_000)]
    first = fs.data_bytes
    assert first < 2 * OPTIONS["max_file_size"] < _data_bytes(deep) // 4
    # Once walked, the run's marks bring a read anywhere in it within a few thousand events.
    fs.data_bytes = 0
    got = rd.read(178_000, 178_001)
    assert [e.body for e in got] == [_body(178_000)]
    assert fs.data_bytes < first // 2


def test_byte_counts_at_depth_read_no_data_file_and_are_the_runs_extents(deep: str) -> None:
    # The agent's /metrics, `status` and `filechannel top` ask a reader for the queued bytes and
    # each consumer's lag in bytes; a reader that walked every run it has not read yet to count
    # them would read every data file (20 GB at 100 M queued events) inside a scrape.
    fs = _CountingFS()
    rd = ChannelReader(deep, fs=fs)
    start, end = rd.available()
    size = _record_size(_body(0))
    starts = [start, 1, 4_095, 133_457, 150_000, 299_999, end]
    exact = [(end - s) * size for s in starts]
    # The head, the end, run boundaries and starts deep in a run: no data file is read at all.
    fs.data_bytes = 0
    far = rd.record_bytes([start, 133_457, 150_000, 299_999, end], end)
    assert fs.data_bytes == 0
    # A start within a mark's stretch (MARK_EVERY events) of a run's first record is placed
    # exactly: one walk each, which reads to its transaction's COMMIT (here 10 000 events, in a
    # window of scan.LOCATE_WINDOW grown four times once), whatever the depth.
    got = rd.record_bytes(starts, end)
    assert [got[0], *got[3:]] == far  # the walks changed none of the others
    assert [got[0] - got[1], got[0] - got[2]] == [size, 4_095 * size]  # the events before them: exact
    assert fs.data_bytes <= 2 * 5 * scan.LOCATE_WINDOW < _data_bytes(deep) // 3, fs.data_bytes
    # The runs' extents in their data files: the events' records, plus a COMMIT and a
    # BATCH_END per 10 000 of them and the file's last batch (0.1% and a record at most).
    for g, e in zip(got, exact, strict=True):
        assert e <= g <= e + e // 1000 + size, (g, e)
    # Once the reader has walked the runs (segments() walks every event's record), exact.
    rd.segments(start, end)
    assert rd.record_bytes(starts, end) == exact


def test_reads_polls_segments_and_byte_counts_agree_with_a_drain(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    n = 120_000
    with filechannel.open(d, **OPTIONS):
        pass
    live = ChannelReader(d)  # follows the writes: its runs come from the records it scans
    assert live.available() == (0, 0)
    _fill(d, n)
    cold = ChannelReader(d)  # opened afterwards: its runs are the owner's checkpointed ones
    assert live.available() == cold.available() == (0, n)
    sizes = [_record_size(_body(i)) for i in range(n)]
    for rd in (cold, live):
        for a, b, limit in ((0, 5, None), (9_990, 10_010, None), (33_333, 77_777, None), (n - 3, n, None), (500, n, 7)):
            got = rd.read(a, b, limit)
            want = list(range(a, b if limit is None else min(b, a + limit)))
            assert [e.position for e in got] == want
            assert [e.body for e in got] == [_body(i) for i in want]
        starts = [0, 1, 4_095, 4_096, 50_001, n - 1, n]
        exact = [sum(sizes[s:]) for s in starts]
        got = rd.record_bytes(starts, n)
        if rd is live:  # it followed every record as it was written
            assert got == exact
        else:  # parts of the owner's runs no read has walked: their extent, a COMMIT per 10 000 events more
            assert all(e <= g <= e + e // 1000 for g, e in zip(got, exact, strict=True)), (got, exact)
            rd.segments(0, n)  # walks every run: exact from now on
            assert rd.record_bytes(starts, n) == exact
        assert rd.record_bytes([100], 70_000) == [sum(sizes[100:70_000])]
        segs = rd.segments(12_345, 98_765, 1 << 20, parts=3)
        assert [p for s in segs for p in s.positions] == list(range(12_345, 98_765))
        assert sum(sum(s.sizes) for s in segs) == sum(sizes[12_345:98_765])
        assert [e.body for e in filechannel.read_segment(segs[1])] == [_body(p) for p in segs[1].positions]
    # Polling through everything, a few thousand at a time, sees each event once, in order.
    view = ChannelReader(d)
    seen: list[int] = []
    while batch := view.poll(7_000):
        seen.extend(e.position for e in batch if e.position is not None)
    assert seen == list(range(n))
    # The owner takes from the head; both readers follow, and what is left matches a drain.
    with filechannel.open(d, **OPTIONS) as ch:
        for _ in range(5):
            with ch.transaction() as tx:
                assert len(tx.take_batch(9_000)) == 9_000
        with ch.transaction() as tx:
            tx.put_many([_body(n + i) for i in range(10)])
        with ch.transaction() as tx:  # what a take would return next (rolled back: left queued)
            drained = [(e.position, e.body) for e in tx.take_batch(10_000)]
            tx.rollback()
    for rd in (cold, live, ChannelReader(d)):
        start, end = rd.available()
        assert (start, end) == (45_000, n + 10)
        events = rd.read(start, end)
        assert [(e.position, e.body) for e in events[:10_000]] == drained
        assert [e.body for e in events] == [_body(i) for i in range(45_000, n + 10)]
        assert rd.record_bytes([start], end) == [sum(sizes[45_000:]) + 10 * _record_size(_body(n))]


def test_a_record_the_walk_cannot_find_is_damage_at_exactly_its_position(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    n = 30_000
    _fill(d, n)
    victim = 12_345
    (seg,) = ChannelReader(d).segments(victim, victim + 1)
    with open(seg.path, "r+b") as fh:  # the record's op byte: no longer a record the walk can step on
        fh.seek(seg.offset)
        fh.write(b"\xee")
    with pytest.raises(filechannel.CorruptLogError):
        ChannelReader(d).read(12_000, 13_000)
    rd = ChannelReader(d, on_corruption="skip")
    got = rd.read(12_000, 13_000)
    assert [e.position for e in got] == [p for p in range(12_000, 13_000) if p != victim]
    assert [e.body for e in got] == [_body(p) for p in range(12_000, 13_000) if p != victim]
    assert [c.lost_positions for c in rd.corruption] == [[(victim, victim + 1)]]
    # Reads that start past it, or end before it, never meet it.
    assert [e.position for e in ChannelReader(d).read(victim + 1, victim + 50)] == list(range(victim + 1, victim + 50))
    assert len(ChannelReader(d).read(0, victim)) == victim
    size = _record_size(_body(0))
    assert rd.record_bytes([12_000], 13_000) == [999 * size]  # walked: exact, the missing record counts 0
    # Not walked yet: the extent in the data file, the missing record's bytes still in it.
    (fresh,) = ChannelReader(d, on_corruption="skip").record_bytes([12_000], 13_000)
    assert abs(fresh - 1000 * size) <= size, fresh


def test_an_encrypted_channel_is_read_from_its_runs_with_the_key(tmp_path: Path) -> None:
    from filechannel import Encryption

    enc = Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
    d = str(tmp_path / "ch")
    n = 25_000
    with filechannel.open(d, encryption=enc, **OPTIONS) as ch:
        for i in range(0, n, 5_000):
            with ch.transaction() as tx:
                tx.put_many([_body(k) for k in range(i, i + 5_000)])
    rd = ChannelReader(d, encryption=enc)
    assert rd.available() == (0, n)
    for a, b in ((0, 3), (4_999, 5_002), (17_000, 17_100), (n - 2, n)):
        assert [e.body for e in rd.read(a, b)] == [_body(k) for k in range(a, b)]
    seg = rd.segments(12_000, 12_010)[0]
    assert [e.body for e in filechannel.read_segment(seg, encryption=enc)] == [_body(k) for k in range(12_000, 12_010)]
    # Without the key the events stay sealed: the reader refuses rather than guess.
    with pytest.raises(filechannel.DecryptionError):
        ChannelReader(d).read(0, 1)
