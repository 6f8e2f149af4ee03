"""The take path's grouping helpers: their one-run fast paths give what the general loops give."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from filechannel import format as fmt
from filechannel._queue import Taken
from filechannel._runs import Located, RunQueue
from filechannel.takes import file_runs as _file_runs
from filechannel.takes import ranges as _ranges
from filechannel.takes import take_runs as _take_runs


def _no_locate(fid: int, offset: int, lo: int, hi: int, want: int) -> Located:
    raise AssertionError("a queue whose runs hold their pointers never scans")


def _ranges_by_loop(positions: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return [(a, c) for a, c in out]


def _file_runs_by_loop(entries: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    for p, f, _off, _size in entries:
        if out and out[-1][0] == f and out[-1][1] + out[-1][2] == p:
            out[-1][2] += 1
        else:
            out.append([f, p, 1])
    return [(f, a, c) for f, a, c in out]


# Mostly the usual take (consecutive positions of one file), with a change of file, a gap,
# a repeat or a step back somewhere in some of them.
_edits = st.lists(st.tuples(st.integers(0, 60), st.sampled_from(["file", "gap", "repeat", "back"])), max_size=3)


@st.composite
def _entries(draw: st.DrawFn) -> list[tuple[int, int, int, int]]:
    n = draw(st.integers(0, 60))
    p0 = draw(st.integers(0, 1000))
    f0 = draw(st.integers(1, 3))
    ps = list(range(p0, p0 + n))
    fs = [f0] * n
    for i, what in draw(_edits):
        if i >= n:
            continue
        if what == "file":
            fs[i] = fs[i] + 1
        elif what == "gap":
            ps[i:] = [p + 1 for p in ps[i:]]
        elif what == "repeat" and i:
            ps[i] = ps[i - 1]
        elif what == "back" and i:
            ps[i] = ps[i - 1] - 1
    return [(p, f, 64 * k, 40) for k, (p, f) in enumerate(zip(ps, fs, strict=True))]


@settings(max_examples=500, deadline=None)
@given(entries=_entries())
def test_file_runs_fast_path_matches_the_loop(entries: list[tuple[int, int, int, int]]) -> None:
    assert _file_runs(entries) == _file_runs_by_loop(entries)


@settings(max_examples=500, deadline=None)
@given(entries=_entries())
def test_ranges_fast_path_matches_the_loop(entries: list[tuple[int, int, int, int]]) -> None:
    positions = sorted(e[0] for e in entries)
    assert _ranges(positions) == _ranges_by_loop(positions)


def test_the_usual_take_is_one_run() -> None:
    entries = [(p, 7, 64 * p, 40) for p in range(10, 110)]
    assert _file_runs(entries) == [(7, 10, 100)]
    assert _ranges(list(range(10, 110))) == [(10, 100)]
    # the same positions over two files are two runs; a gap splits them too
    assert _file_runs(entries[:50] + [(p, 8, o, s) for p, _, o, s in entries[50:]]) == [(7, 10, 50), (8, 60, 50)]
    assert _ranges([*range(10, 60), *range(61, 111)]) == [(10, 50), (61, 50)]


@settings(max_examples=500, deadline=None)
@given(entries=_entries())
def test_take_runs_twins_agree(entries: list[tuple[int, int, int, int]]) -> None:
    """The commit's grouping (``_take_runs``): the C pass and the Python twin give the same runs."""
    python = (_ranges_by_loop(sorted(e[0] for e in entries)), _file_runs_by_loop(entries))
    saved = fmt.speedups
    try:
        fmt.speedups = None
        assert _take_runs(entries) == python
    finally:
        fmt.speedups = saved
    assert _take_runs(entries) == python  # C when built (it falls back to Python when positions do not ascend)
    if fmt.speedups is not None and all(a[0] < b[0] for a, b in itertools.pairwise(entries)):
        assert fmt.speedups.take_runs(entries) == python  # ascending: answered by C, not the fallback


# A queue's history: appends of runs (several files, out-of-order data directories, gaps),
# and takes that roll back (their entries return to the head).
_queue_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 30), st.integers(1, 3), st.integers(0, 2)),
        st.tuples(st.just("take"), st.integers(1, 40), st.booleans()),
        st.tuples(st.just("fill"), st.integers(1, 3)),
    ),
    max_size=25,
)


@settings(max_examples=400, deadline=None)
@given(ops=_queue_ops)
def test_taken_columns_match_the_entries(ops: list[tuple]) -> None:
    """A take popped as columns (``Taken``) holds what ``pop`` hands out; ``one_run`` agrees with the loops."""
    q = RunQueue(_no_locate)
    model = RunQueue(_no_locate)  # the same history through pop() only
    nxt = 0
    gaps: list[tuple[int, int]] = []  # (first, count) left free by an append, filled later out of order
    for op in ops:
        if op[0] == "fill":
            if gaps:
                first, n = gaps.pop()
                for queue in (q, model):
                    queue.append_run(first, op[1], [64 * (first + k) for k in range(n)], [40] * n)
            continue
        if op[0] == "append":
            _, n, fid, gap = op
            if gap:
                gaps.append((nxt, gap))
            nxt += gap
            offsets = [64 * (nxt + k) for k in range(n)]
            for queue in (q, model):
                queue.append_run(nxt, fid, offsets, [40] * n)
            nxt += n
            continue
        _, n, roll_back = op
        taken = Taken()
        cols = q.pop_columns(n)
        if cols is None:  # rolled-back takes wait at the head: the tuple path
            taken.add(q.pop(n))
        else:
            taken.add(cols)
            assert len(cols[0]) == len(taken)
        want = model.pop(n)
        assert taken.entries() == want
        assert list(taken) == want
        assert len(taken) == len(want)
        run = taken.one_run()
        if run is not None:
            assert cols is not None
            assert [run] == _file_runs_by_loop(want)
            assert [(run[1], run[2])] == _ranges_by_loop(sorted(e[0] for e in want))
        elif cols is not None and want:
            assert len(_file_runs_by_loop(want)) > 1  # one_run says None only when it is not one run
        if roll_back:
            q.push_back(taken)
            model.push_back(want)
        assert list(q) == list(model)
