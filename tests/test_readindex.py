"""RunIndex, the reader's queue as runs, against a model: random commits, takes and reads.

A model data file per file id holds records ``(position, offset, size)``; the
locator walks it forward as ``scan.locate_puts`` walks a real one. Small marks
and read-ahead make every path (marks, hints, the read-ahead, byte counts
rebased after takes at the head and in the middle) run on a small queue.
"""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filechannel import _readindex
from filechannel._readindex import RunIndex
from filechannel.scan import LOST, PutWalk


class Files:
    """Model data files: each a list of (offset, position, size), in file order; records that are not PUTs between."""

    def __init__(self) -> None:
        self.recs: dict[int, list[tuple[int, int, int]]] = {}
        self.ends: dict[int, int] = {}
        self.walked = 0  # records the locator stepped over, in all

    def write(self, fid: int, first: int, sizes: list[int]) -> array[int]:
        recs = self.recs.setdefault(fid, [])
        off = self.ends.get(fid, 16) + 24  # a TAKE/COMMIT/BATCH_END's worth between commits
        offs = array("q")
        for i, sz in enumerate(sizes):
            recs.append((off, first + i, sz))
            offs.append(off)
            off += sz
        self.ends[fid] = off
        return offs

    def locate(self, fid: int, offset: int, lo: int, hi: int, want: int, event_bytes: int = 200) -> PutWalk:
        offs, sizes = array("q"), array("q")
        nxt = offset
        for off, p, sz in self.recs[fid]:
            if off < offset:
                continue
            self.walked += 1
            if p >= hi or len(offs) >= want:
                break
            if p >= lo:
                assert p == lo + len(offs), "a run's positions are consecutive PUTs of its file"
                offs.append(off)
                sizes.append(sz)
                nxt = off + sz
        return PutWalk(lo if len(offs) else -1, offs, sizes, nxt, True)


@pytest.fixture(autouse=True)
def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_readindex, "MARK_EVERY", 4)
    monkeypatch.setattr(_readindex, "READ_AHEAD", 6)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 1 << 30), n_ops=st.integers(1, 60))
def test_reads_and_byte_counts_match_a_model(seed: int, n_ops: int) -> None:
    rnd = random.Random(seed)
    files = Files()
    idx = RunIndex(files.locate)
    model: dict[int, tuple[int, int, int]] = {}  # position -> (file id, offset, size)
    nxt = 0
    pending: list[tuple[int, int]] = []  # positions left for a later, out-of-order commit
    fid = 1
    for _ in range(n_ops):
        r = rnd.random()
        if r < 0.45 or not model:
            if rnd.random() < 0.15:
                fid += 1  # the owner rolled to a new data file
            n = rnd.randrange(1, 12)
            if rnd.random() < 0.2:
                pending.append((nxt, n))  # another data directory publishes these later
            else:
                sizes = [rnd.choice((40, 48, 200)) for _ in range(n)]
                offs = files.write(fid, nxt, sizes)
                idx.add(nxt, fid, offs, array("q", sizes))
                model.update({nxt + i: (fid, offs[i], sizes[i]) for i in range(n)})
            nxt += n
        elif r < 0.55 and pending:
            first, n = pending.pop(rnd.randrange(len(pending)))
            other = 1000 + first  # a file of its own
            sizes = [56] * n
            offs = files.write(other, first, sizes)
            idx.add(first, other, offs, array("q", sizes))
            model.update({first + i: (other, offs[i], 56) for i in range(n)})
        elif r < 0.75:
            held = sorted(model)
            a = held[0] if rnd.random() < 0.7 else rnd.choice(held)  # takes come from the head, mostly
            c = rnd.randrange(1, 10)
            idx.remove(a, c)
            for p in range(a, a + c):
                model.pop(p, None)
        else:
            lo, hi = sorted(rnd.randrange(0, nxt + 1) for _ in range(2))
            limit = rnd.choice((None, None, 1, 5))
            want = [p for p in sorted(model) if lo <= p < hi][:limit]
            pos, fids, offs, sizes = idx.columns(lo, hi, limit)
            assert list(pos) == want
            assert list(zip(fids, offs, sizes, strict=True)) == [model[p] for p in want]
            starts = [lo, rnd.randrange(lo, hi + 1)]
            assert [idx.record_bytes(s, hi) for s in starts] == [
                sum(model[p][2] for p in model if s <= p < hi) for s in starts
            ]
        held = sorted(model)
        assert idx.head() == (held[0] if held else None)
        assert len(idx) == len(model)


def test_memory_is_runs_and_marks_and_a_sequential_read_walks_each_record_about_once() -> None:
    files = Files()
    idx = RunIndex(files.locate)
    n = 4000
    sizes = [40] * 100
    for first in range(0, n, 100):  # forty commits of one data file: one run
        idx.add(first, 7, files.write(7, first, sizes), array("q", sizes))
    assert len(idx.runs) == 1
    cold = RunIndex(files.locate)  # the same events as an owner's checkpointed run: nothing known but where it starts
    cold.add_stored(0, n, 7, files.recs[7][0][0], [])
    files.walked = 0
    got = []
    for a in range(0, n, 10):
        got += list(cold.columns(a, a + 10)[0])
    assert got == list(range(n))
    assert files.walked < 2 * n  # never from the run's start again
    assert cold.record_bytes(123, n) == idx.record_bytes(123, n) == 40 * (n - 123)
    cold.remove(0, 2000)
    assert cold.record_bytes(0, n) == 40 * 2000
    (run,) = cold.runs
    assert run.mpos is not None
    assert len(run.mpos) <= n // _readindex.MARK_EVERY + 1
    # A sizes-only walk from a mark: reading the middle of the run walks a mark's stretch, not the run.
    files.walked = 0
    assert list(cold.columns(3001, 3003)[0]) == [3001, 3002]
    assert files.walked <= 2 * _readindex.MARK_EVERY + _readindex.READ_AHEAD + 2


def test_a_position_the_walk_does_not_find_reads_as_lost() -> None:
    files = Files()
    idx = RunIndex(files.locate)
    offs = files.write(3, 0, [40] * 10)
    idx.add_stored(0, 12, 3, offs[0], [])  # the run claims two positions the file does not hold
    pos, _, got, sizes = idx.columns(0, 12)
    assert list(pos) == list(range(12))
    assert list(got[10:]) == [LOST, LOST]
    assert list(sizes[10:]) == [0, 0]
    assert idx.record_bytes(0, 12) == 400


def test_runs_not_walked_yet_count_their_extent_without_walking_then_exact() -> None:
    files = Files()
    offs1 = files.write(1, 0, [40] * 50)  # file 1: positions 0..49, then 50..99 in a later commit
    offs1b = files.write(1, 50, [40] * 50)
    offs2 = files.write(2, 100, [48] * 30)  # file 2: positions 100..129
    cold = RunIndex(files.locate, files.ends.get)
    cold.add_stored(0, 100, 1, offs1[0], [60])  # position 60 taken out of order: a hole, two runs
    cold.add_stored(100, 30, 2, offs2[0], [])
    exact = {p: 40 for p in range(100) if p != 60} | {p: 48 for p in range(100, 130)}
    files.walked = 0
    starts = [0, 30, 61, 100, 117, 130]
    got = cold.record_bytes_many(starts, 130)
    # Only the starts within MARK_EVERY (4 here) of a run's first record are walked to.
    assert files.walked == 0
    # The runs' extents: their records and the 24 bytes between commits (one in file 1, none after
    # the hole's split: the run before it reaches to the next run's first mark, the same offset).
    assert got[0] == offs1b[-1] + 40 - offs1[0] + 30 * 48 == sum(exact.values()) + 40 + 24
    assert got[3] == 30 * 48
    assert got[5] == 0
    assert got[4] == 30 * 48 * 13 // 30  # a start inside a part not walked: events taken as equal
    # Once walked, exact (a start in the middle too).
    cold.columns(0, 130)
    assert cold.record_bytes_many(starts, 130) == [sum(b for p, b in exact.items() if p >= s) for s in starts]
