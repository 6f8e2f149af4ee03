"""The queue as runs (filechannel._runs) against a simple model of the queue.

A model log stands in for the data files: records per file (committed PUTs with
their positions, PUTs of transactions that never committed, other records), two
data directories whose commits interleave in position and publish out of order.
Hypothesis drives puts, takes, rollbacks, commits of takes, replay's removals,
checkpoints and reopens (through ``stored``/``from_stored``), with tiny pointer
budgets and scan chunks so that runs go cold and the head is found by scanning.
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from filechannel._runs import Located, RunQueue, StoredRun
from filechannel.errors import CorruptLogError


class ModelLog:
    """Data files as lists of ``(offset, size, position or None)``: None is a record that is no committed PUT."""

    def __init__(self) -> None:
        self.files: dict[int, list[tuple[int, int, int | None]]] = {}
        self.scans = 0

    def add(self, fid: int, size: int, position: int | None) -> int:
        recs = self.files.setdefault(fid, [])
        off = recs[-1][0] + recs[-1][1] if recs else 80
        recs.append((off, size, position))
        return off

    def locate(self, fid: int, offset: int, lo: int, hi: int, want: int) -> Located:
        self.scans += 1
        recs = self.files[fid]
        starts = [r[0] for r in recs]
        assert offset in starts or offset == (recs[-1][0] + recs[-1][1]), f"{offset} is no record boundary"
        offs, sizes = array("q"), array("q")
        first = -1
        nxt = offset
        for off, size, p in recs:
            if off < offset or p is None or p < lo:
                continue
            if p >= hi or len(offs) >= want:
                break
            if first < 0:
                first = p
            elif p != first + len(offs):
                raise CorruptLogError(f"file {fid}", off, "positions skip")
            offs.append(off)
            sizes.append(size)
            nxt = off + size
        return Located(first, offs, sizes, nxt)


class RunQueueMachine(RuleBasedStateMachine):
    @initialize(
        hot=st.integers(min_value=0, max_value=24),
        chunk=st.integers(min_value=1, max_value=6),
        dirs=st.sampled_from([1, 2]),
    )
    def setup(self, hot: int, chunk: int, dirs: int) -> None:
        self.log = ModelLog()
        self.hot, self.chunk, self.dirs = hot, chunk, dirs
        self.q = RunQueue(self.log.locate, hot_pointers=hot, chunk=chunk)
        self.model: dict[int, tuple[int, int, int]] = {}  # position -> (file, offset, size)
        self.next_pos = 0
        self.next_fid = dirs
        self.cur_file = list(range(dirs))  # each directory's newest file
        self.pending: list[list[tuple[int, int, list[int], list[int]]]] = [[] for _ in range(dirs)]
        self.open_takes: list[list[tuple[int, int, int, int]]] = []

    # -- puts --------------------------------------------------------------------------

    @rule(
        d=st.integers(min_value=0, max_value=1),
        n=st.integers(min_value=1, max_value=7),
        noise=st.booleans(),
        roll=st.booleans(),
        publish=st.booleans(),
    )
    def commit_puts(self, d: int, n: int, noise: bool, roll: bool, publish: bool) -> None:
        d %= self.dirs
        if roll:
            self.cur_file[d] = self.next_fid
            self.next_fid += 1
        fid = self.cur_file[d]
        if noise:
            self.log.add(fid, 24, None)  # a PUT whose transaction never committed
        first = self.next_pos
        self.next_pos += n
        offs, sizes = [], []
        for i in range(n):
            size = 32 + 8 * ((first + i) % 3)
            offs.append(self.log.add(fid, size, first + i))
            sizes.append(size)
        self.log.add(fid, 40, None)  # its COMMIT
        self.pending[d].append((first, fid, offs, sizes))
        if publish:
            self._publish(d)

    def _publish(self, d: int) -> None:
        first, fid, offs, sizes = self.pending[d].pop(0)
        if len(offs) == 1:
            self.q.append(first, fid, offs[0], sizes[0])
        else:
            self.q.append_run(first, fid, offs, sizes)
        for i in range(len(offs)):
            self.model[first + i] = (fid, offs[i], sizes[i])

    @precondition(lambda self: any(self.pending))
    @rule(d=st.integers(min_value=0, max_value=1))
    def publish(self, d: int) -> None:
        d %= self.dirs
        if not self.pending[d]:
            d = 1 - d
        self._publish(d)

    # -- takes -------------------------------------------------------------------------

    @rule(k=st.integers(min_value=1, max_value=20), columns=st.booleans())
    def take(self, k: int, columns: bool) -> None:
        want = sorted(self.model)[:k]
        got: list[tuple[int, int, int, int]]
        cols = self.q.pop_columns(k) if columns else None
        got = list(zip(*cols, strict=True)) if cols is not None else self.q.pop(k)
        assert [e[0] for e in got] == want
        for p, f, off, size in got:
            assert self.model.pop(p) == (f, off, size)
        if got:
            self.open_takes.append(got)

    @precondition(lambda self: self.open_takes)
    @rule(i=st.integers(min_value=0, max_value=10))
    def rollback(self, i: int) -> None:
        got = self.open_takes.pop(i % len(self.open_takes))
        self.q.push_back(got)
        for p, f, off, size in got:
            self.model[p] = (f, off, size)

    @precondition(lambda self: self.open_takes)
    @rule(i=st.integers(min_value=0, max_value=10))
    def commit_takes(self, i: int) -> None:
        self.open_takes.pop(i % len(self.open_takes))

    @rule(data=st.data(), count=st.integers(min_value=1, max_value=4))
    def remove_range(self, data: st.DataObject, count: int) -> None:
        # Mostly around queued positions, so that runs lose heads, tails and middles.
        near = sorted(self.model) or [0]
        start = data.draw(st.sampled_from(near)) + data.draw(st.integers(min_value=-2, max_value=2))
        start = max(0, start)
        got = self.q.remove_range(start, count)
        removed = sorted(p for p in self.model if start <= p < start + count)
        flat = sorted(p for f, a, c in got for p in range(a, a + c))
        assert flat == removed
        for f, a, c in got:
            for p in range(a, a + c):
                assert self.model.pop(p)[0] == f

    # -- checkpoints -------------------------------------------------------------------

    @precondition(lambda self: not any(self.pending))
    @rule()
    def reopen(self) -> None:
        extra = [e for t in self.open_takes for e in t]
        runs, entries, holes = self.q.stored(extra)
        # Through the shape a checkpoint stores: plain tuples.
        runs = [StoredRun(*tuple(r)) for r in runs]
        self.q = RunQueue.from_stored(self.log.locate, runs, entries, holes, self.hot, self.chunk)
        for p, f, off, size in extra:  # recovery returns open transactions' takes
            self.model[p] = (f, off, size)
        self.open_takes = []

    # -- checks -------------------------------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        q, model = self.q, self.model
        assert len(q) == len(model)
        ordered = sorted(model)
        assert list(q.positions()) == ordered
        assert q.first_position() == (ordered[0] if ordered else None)
        counts: dict[int, int] = {}
        for f, _o, _s in model.values():
            counts[f] = counts.get(f, 0) + 1
        assert q.file_counts() == counts
        for probe in (0, 3, self.next_pos // 2, self.next_pos):
            assert q.count_below(probe) == sum(1 for p in ordered if p < probe)
            after = [p for p in ordered if p >= probe]
            assert q.first_file_at_or_after(probe) == ((after[0], model[after[0]][0]) if after else None)
            assert (probe in q) == (probe in model)
        assert q.pointer_count() >= 0

    @invariant()
    def iterates(self) -> None:
        assert list(self.q) == [(p, *self.model[p]) for p in sorted(self.model)]


RunQueueMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRunQueue = RunQueueMachine.TestCase


def test_a_deep_queue_holds_one_run_per_file_and_few_pointers() -> None:
    """One data directory: a million events in commits of 1000 cost a run per data file, and the hot budget."""
    log = ModelLog()
    q = RunQueue(log.locate, hot_pointers=10_000, chunk=512)
    pos = 0
    for c in range(1000):
        fid = c // 250  # four data files
        offs: list[int] = []
        sizes: list[int] = []
        for _ in range(1000):
            offs.append(log.add(fid, 136, pos + len(offs)))
            sizes.append(136)
        log.add(fid, 40, None)
        q.append_run(pos, fid, offs, sizes)
        pos += 1000
    assert len(q) == 1_000_000
    assert q.run_count() <= 8
    assert q.pointer_count() <= 10_000 + 250_000  # the budget, plus the head run's own (its file's)
    runs, entries, holes = q.stored()
    assert len(runs) == q.run_count()
    assert not entries
    assert not holes
    back = RunQueue.from_stored(log.locate, runs, hot_pointers=10_000, chunk=512)
    assert back.pointer_count() == 0
    got = back.pop(2000)
    assert [e[0] for e in got] == list(range(2000))
    assert back.pointer_count() <= 2 * 512 + 2000


def test_a_run_whose_records_are_missing_raises_and_changes_nothing() -> None:
    log = ModelLog()
    offs = [log.add(0, 32, p) for p in range(10)]
    q = RunQueue.from_stored(log.locate, [StoredRun(0, 12, 0, offs[0])])  # claims two more than the file holds
    with pytest.raises(CorruptLogError, match="not where their run says"):
        q.pop(12)
    assert len(q) == 12
    assert q.first_position() == 0
    assert [e[0] for e in q.pop(10)] == list(range(10))


def test_from_stored_refuses_overlapping_runs_and_stray_holes() -> None:
    log = ModelLog()
    with pytest.raises(ValueError, match="overlaps"):
        RunQueue.from_stored(log.locate, [StoredRun(0, 5, 0, 80), StoredRun(3, 5, 0, 200)])
    with pytest.raises(ValueError, match="outside every run"):
        RunQueue.from_stored(log.locate, [StoredRun(0, 5, 0, 80)], holes=[7])
    with pytest.raises(ValueError, match="inside a run"):
        RunQueue.from_stored(log.locate, [StoredRun(0, 5, 0, 80)], entries=[(2, 0, 96, 32)])


def test_a_scan_made_outside_the_lock_is_installed_only_if_the_run_did_not_move() -> None:
    log = ModelLog()
    offs = [log.add(0, 32, p) for p in range(100)]
    q = RunQueue.from_stored(log.locate, [StoredRun(0, 100, 0, offs[0])], chunk=10)
    (sc,) = q.scans_needed(25)
    found = log.locate(sc.run.fid, sc.offset, sc.start, sc.hi, sc.want)
    q.install(sc, found)
    scans = log.scans
    assert [e[0] for e in q.pop(25)] == list(range(25))
    assert log.scans == scans  # the pop found every pointer installed: no scan under the lock
    # A scan of a head that moved meanwhile is dropped; the pop scans again.
    (sc,) = q.scans_needed(30)
    stale = log.locate(sc.run.fid, sc.offset, sc.start, sc.hi, sc.want)
    assert [e[0] for e in q.pop(5)] == list(range(25, 30))
    q.install(sc, stale)
    assert [e[0] for e in q.pop(70)] == list(range(30, 100))
    assert len(q) == 0
