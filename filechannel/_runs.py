"""The queue as runs: committed, untaken events named by ranges of positions, not one entry each.

It owns the queue's order and its memory bound, and no I/O: where an event's
record lies is found by a locator the caller passes (the channel's scans the
data file forward with ``scan.committed_puts``), and tests pass a model.

Why runs can name events. In one data directory, positions are assigned in
the order the records are written (``writer`` takes them under the sequence
lock as it frames a batch), so the committed PUT records of a data file appear
in position order, and consecutive positions of one data file are consecutive
committed PUT records. A run ``(first position, count, file id, offset)``
therefore names ``count`` events: scanning the file forward from ``offset`` (a
record boundary at or before the first one), the committed PUTs with positions
in ``[first, first + count)``. With several data directories positions
interleave, and a run holds the consecutive commits of one directory (at
worst one transaction). Records that are not committed PUTs (TAKE, COMMIT,
MARK, the PUTs of a transaction whose COMMIT never came) are skipped by the
scan, which takes positions from COMMIT records.

Memory. A run is O(1) whatever its length. The record pointers of the newest
events (what commits hand over anyway) are kept "hot" in two ``array('q')``
columns per run, up to :data:`HOT_POINTERS` in all; older runs drop theirs and
become "cold". The head run gets its pointers back a chunk at a time
(:data:`CHUNK` events per scan) as takes reach it. So a queue of any depth costs
O(runs + HOT_POINTERS): with one data directory, about one run per data file.

Besides the runs: rolled-back takes (and any other entry that is not in a run)
wait in a small heap, merged with the runs by position; positions removed from
the middle of a run (replay's out-of-order takes) are holes the head skips.

Every method is called under the channel's lock. A locator may raise (damage,
I/O): the queue is unchanged when it does.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from operator import eq, sub
from typing import NamedTuple

from . import format as fmt
from ._queue import Columns, Entry
from .errors import CorruptLogError

__all__ = ["CHUNK", "HOT_POINTERS", "Locate", "Located", "Run", "RunQueue", "Scan", "StoredRun"]

CHUNK = 8192
"""Events whose pointers one scan of a cold head run finds (at least: a take of more asks for more)."""

HOT_POINTERS = 1 << 20
"""Record pointers kept in memory past the head run (16 B each); older runs drop theirs."""


class Located(NamedTuple):
    """What a locator found: consecutive positions from ``first``, their pointers, where to scan on."""

    first: int
    offsets: array[int]
    sizes: array[int]
    next_offset: int


Locate = Callable[[int, int, int, int, int], Located]
"""``locate(file_id, offset, lo, hi, want)``: the committed PUTs of data file ``file_id``
found scanning forward from ``offset`` with positions in ``[lo, hi)``, the first
``want`` of them (fewer only at ``hi`` or the end of the file), as a :class:`Located`
whose ``next_offset`` is a record boundary after the last one found.

Raises:
    CorruptLogError: The bytes do not verify or the positions found skip.
    OSError: Reading failed.
"""


class StoredRun(NamedTuple):
    """A run as a checkpoint stores it: ``length`` positions from ``first``, scanned from ``offset`` in ``file_id``."""

    first: int
    length: int
    file_id: int
    offset: int


class Scan(NamedTuple):
    """A scan a pop needs (:meth:`RunQueue.scans_needed`): ``locate(run.fid, offset, start, hi, want)``."""

    run: Run
    offset: int
    start: int
    hi: int
    want: int


class Run:
    """Positions ``lo .. hi - 1`` (less the queue's holes) in data file ``fid``.

    Hot: ``offs``/``sizes`` hold the pointers of positions ``cols_lo, cols_lo + 1, ...``
    (``cols_lo <= lo``); ``off`` is where a scan for the positions after them starts.
    Cold (``offs`` is None): ``off`` is a record boundary at or before ``lo``'s record.
    """

    __slots__ = ("cols_lo", "fid", "hi", "lo", "off", "offs", "sizes")

    def __init__(
        self, lo: int, hi: int, fid: int, off: int, offs: array[int] | None = None, sizes: array[int] | None = None
    ) -> None:
        self.lo = lo
        self.hi = hi
        self.fid = fid
        self.off = off
        self.cols_lo = lo
        self.offs = offs
        self.sizes = sizes

    def hot_end(self) -> int:
        """The position after the last one whose pointer is held (``lo`` when none past it)."""
        return self.cols_lo + len(self.offs) if self.offs is not None else self.lo

    def start_offset(self) -> int:
        """A record boundary at or before ``lo``'s record (its own offset when hot)."""
        if self.offs is not None and self.cols_lo <= self.lo < self.hot_end():
            return self.offs[self.lo - self.cols_lo]
        return self.off

    def __repr__(self) -> str:
        state = f"hot {self.cols_lo}..{self.hot_end()}" if self.offs is not None else "cold"
        return f"Run({self.lo}..{self.hi} in file {self.fid} from {self.off}, {state})"


def _range_array(first: int, n: int) -> array[int]:
    sp = fmt.speedups
    if sp is not None:
        a = array("q")
        a.frombytes(sp.int64_range(first, n))
        return a
    return array("q", range(first, first + n))


class RunQueue:
    """Committed events waiting to be taken, in position order, as runs (see the module docstring).

    Args:
        locate: Finds the pointers of a cold run's events (see :data:`Locate`).
        hot_pointers: The budget of pointers kept past the head run.
        chunk: Pointers one scan of the head run finds.
    """

    __slots__ = (
        "_chunk",
        "_cool_from",
        "_h",
        "_holes",
        "_hot",
        "_hot_budget",
        "_locate",
        "_n",
        "_returned",
        "_runs",
    )

    def __init__(self, locate: Locate, hot_pointers: int = HOT_POINTERS, chunk: int = CHUNK) -> None:
        self._locate = locate
        self._runs: list[Run] = []
        self._h = 0  # runs before this index are gone (compacted now and then)
        self._holes: set[int] = set()  # positions inside runs that are not queued
        self._returned: list[Entry] = []  # a heap: rolled-back takes and entries outside any run
        self._n = 0  # sum of hi - lo over the runs (holes included)
        self._hot = 0  # pointers held by all runs
        self._hot_budget = hot_pointers
        self._cool_from = 0  # runs between the head and this index hold no pointers
        self._chunk = chunk

    # -- size and lookups ------------------------------------------------------------

    def __len__(self) -> int:
        return self._n - len(self._holes) + len(self._returned)

    def run_count(self) -> int:
        """How many runs the queue holds."""
        return len(self._runs) - self._h

    def pointer_count(self) -> int:
        """How many record pointers the queue holds in memory."""
        return self._hot

    def _index(self, position: int) -> int:
        """The index of the run holding ``position`` or, if none does, of the first run after it."""
        runs = self._runs
        i = bisect_right(runs, position, self._h, key=_lo) - 1
        if i >= self._h and position < runs[i].hi:
            return i
        return i + 1

    def __contains__(self, position: object) -> bool:
        """Return whether ``position`` is queued."""
        if not isinstance(position, int):
            return False
        i = self._index(position)
        runs = self._runs
        if i < len(runs) and runs[i].lo <= position < runs[i].hi and position not in self._holes:
            return True
        return any(e[0] == position for e in self._returned)

    def first_position(self) -> int | None:
        """Return the position at the head, or None when empty."""
        best = self._returned[0][0] if self._returned else None
        p = self._first_run_position()
        if p is not None and (best is None or p < best):
            best = p
        return best

    def _first_run_position(self) -> int | None:
        holes = self._holes
        for r in self._runs[self._h :]:
            p = r.lo
            while p < r.hi and p in holes:
                p += 1
            if p < r.hi:
                return p
        return None

    def count_below(self, position: int) -> int:
        """Return how many queued events have a position below ``position`` (O(runs))."""
        n = 0
        for r in self._runs[self._h :]:
            if r.lo >= position:
                break
            n += min(r.hi, position) - r.lo
        if self._holes:
            n -= sum(1 for p in self._holes if p < position)
        return n + sum(1 for e in self._returned if e[0] < position)

    def first_file_at_or_after(self, position: int) -> tuple[int, int] | None:
        """Return ``(position, file_id)`` of the queued event with the smallest position >= ``position``."""
        best: tuple[int, int] | None = None
        runs = self._runs
        for i in range(self._index(position), len(runs)):
            r = runs[i]
            p = max(r.lo, position)
            while p < r.hi and p in self._holes:
                p += 1
            if p < r.hi:
                best = (p, r.fid)
                break
        for e in self._returned:
            if e[0] >= position and (best is None or e[0] < best[0]):
                best = (e[0], e[1])
        return best

    def file_counts(self) -> dict[int, int]:
        """Return how many queued events point into each data file (O(runs))."""
        out: dict[int, int] = {}
        for r in self._runs[self._h :]:
            out[r.fid] = out.get(r.fid, 0) + r.hi - r.lo
        for p in self._holes:
            f = self._runs[self._index(p)].fid
            out[f] -= 1
            if not out[f]:
                del out[f]
        for e in self._returned:
            out[e[1]] = out.get(e[1], 0) + 1
        return out

    def memory_bytes(self) -> int:
        """Return about how many bytes the queue holds (runs, pointers, holes, returned entries)."""
        return 112 * (len(self._runs) - self._h) + 16 * self._hot + 72 * (len(self._holes) + len(self._returned))

    # -- puts -------------------------------------------------------------------------

    def append(self, position: int, file_id: int, offset: int, size: int) -> None:
        """Add one newly committed event."""
        self.append_run(position, file_id, array("q", (offset,)), array("q", (size,)))

    def append_run(self, first: int, file_id: int, offsets: Iterable[int], sizes: Iterable[int]) -> None:
        """Add one commit's puts: positions ``first, first + 1, ...`` in ``file_id``, their pointers given.

        Raises:
            ValueError: One of the positions is queued already.
        """
        offs = offsets if type(offsets) is array else array("q", offsets)
        szs = sizes if type(sizes) is array else array("q", sizes)
        n = len(offs)
        if not n:
            return
        runs = self._runs
        last = runs[-1] if len(runs) > self._h else None
        if last is not None and first < last.hi:
            self._insert(first, file_id, offs, szs)
            return
        if last is not None and last.hi == first and last.fid == file_id:
            # The next commit of the same data file: its records follow the run's.
            if last.offs is not None and last.hot_end() == last.hi:
                last.offs.extend(offs)
                assert last.sizes is not None
                last.sizes.extend(szs)
                last.hi += n
                self._hot += n
            elif last.offs is None and len(runs) - self._h > 1 and self._hot + n <= self._hot_budget:
                # A cold run: a hot run of their own while the budget allows, so a shallow queue never scans.
                runs.append(Run(first, first + n, file_id, offs[0], array("q", offs), array("q", szs)))
                self._hot += n
            else:
                last.hi += n  # cold, or the head run mid-scan: a scan from its offset reaches them
        else:
            runs.append(Run(first, first + n, file_id, offs[0], array("q", offs), array("q", szs)))
            self._hot += n
        self._n += n
        if self._hot > self._hot_budget:
            self._cool()

    def _insert(self, first: int, file_id: int, offs: array[int], sizes: array[int]) -> None:
        """A commit published after a later position (another data directory): a run of its own, in place."""
        n = len(offs)
        runs = self._runs
        i = self._index(first)
        if (i < len(runs) and runs[i].lo < first + n) or (i > self._h and runs[i - 1].hi > first):
            raise ValueError(f"positions {first}..{first + n - 1} are already queued")
        runs.insert(i, Run(first, first + n, file_id, offs[0], array("q", offs), array("q", sizes)))
        if i < self._cool_from:
            self._cool_from += 1
        self._hot += n
        self._n += n

    def _head_pointers(self) -> int:
        runs = self._runs
        if self._h < len(runs):
            offs = runs[self._h].offs
            return len(offs) if offs is not None else 0
        return 0

    def _cool(self) -> None:
        """Drop the pointers of the oldest hot runs (never the head run's) down to half the budget."""
        held_past_head = self._hot - self._head_pointers()
        if held_past_head <= self._hot_budget:
            return
        excess = held_past_head - self._hot_budget // 2
        runs = self._runs
        i = max(self._h + 1, self._cool_from)
        while excess > 0 and i < len(runs):
            r = runs[i]
            if r.offs is None:
                i += 1
                continue
            assert r.sizes is not None
            held = len(r.offs)
            if i == len(runs) - 1 and held > excess and r.hot_end() == r.hi:
                # The newest run holds more than the excess: its older part goes cold.
                m = r.cols_lo + excess
                if m > r.lo:
                    runs.insert(i, Run(r.lo, m, r.fid, r.start_offset()))
                    r.lo = m
                r.offs = r.offs[excess:]
                r.sizes = r.sizes[excess:]
                r.cols_lo = m
                self._hot -= excess
                if m > r.lo - 1 and i < len(runs) and runs[i] is not r and self._merge_back(i):
                    i -= 1
                self._cool_from = i + 1
                return
            r.off = r.start_offset()
            r.offs = r.sizes = None
            r.cols_lo = r.lo
            self._hot -= held
            excess -= held
            if not self._merge_back(i):
                i += 1
        self._cool_from = i

    def _merge_back(self, i: int) -> bool:
        """Join the cold run at ``i`` to the run before it when it continues that run in the same file."""
        runs = self._runs
        if i <= self._h:
            return False
        prev, r = runs[i - 1], runs[i]
        if prev.hi != r.lo or prev.fid != r.fid or r.offs is not None:
            return False
        if prev.offs is not None and prev.hot_end() == prev.hi:
            assert prev.sizes is not None
            prev.off = prev.offs[-1] + prev.sizes[-1]  # the record after its last: where the scan goes on
        prev.hi = r.hi
        del runs[i]
        if i < self._cool_from:
            self._cool_from -= 1
        return True

    # -- takes --------------------------------------------------------------------------

    def _ensure(self, r: Run, upto: int) -> None:
        """Make ``r`` hold the pointers of ``lo .. upto - 1`` (scanning its file), or raise unchanged."""
        end = r.hot_end()
        if r.offs is not None and end >= upto:
            return
        start = end if r.offs is not None else r.lo
        want = max(self._chunk, upto - start)
        offs: array[int] = array("q")
        sizes: array[int] = array("q")
        off = r.off
        while start + len(offs) < upto:  # a locator may answer in parts (a bounded read each)
            p = start + len(offs)
            got = self._locate(r.fid, off, p, r.hi, want - len(offs))
            k = len(got.offsets)
            if got.first != p or not k or len(got.sizes) != k:
                raise CorruptLogError(
                    f"data file {r.fid}",
                    off,
                    f"queued positions {p}..{r.hi - 1} are not where their run says: the scan found "
                    f"{k} from position {got.first}",
                )
            offs += got.offsets
            sizes += got.sizes
            off = got.next_offset
        old = len(r.offs) if r.offs is not None else 0
        if r.offs is not None:
            assert r.sizes is not None
            keep = r.lo - r.cols_lo
            r.offs = r.offs[keep:] + offs
            r.sizes = r.sizes[keep:] + sizes
        else:
            r.offs, r.sizes = offs, sizes
        r.cols_lo = r.lo
        r.off = off
        self._hot += len(r.offs) - old

    def scans_needed(self, n: int) -> list[Scan]:
        """The scans a pop of ``n`` would make, to run without the channel's lock (see :meth:`install`)."""
        if self._returned or self._holes:
            return []
        if self._head_holds(n):
            return []
        out: list[Scan] = []
        for r, upto in self._plan(n):
            end = r.hot_end()
            if r.offs is not None and end >= upto:
                continue
            start = end if r.offs is not None else r.lo
            out.append(Scan(r, r.off, start, r.hi, max(self._chunk, upto - start)))
        return out

    def install(self, scan: Scan, got: Located) -> None:
        """Give a run the pointers a scan found outside the lock, if the run is as the scan saw it."""
        r = scan.run
        start = r.hot_end() if r.offs is not None else r.lo
        k = len(got.offsets)
        if r.off != scan.offset or start != scan.start or r.lo >= r.hi or got.first != start or not k:
            return  # the queue moved on meanwhile: the pop scans again under the lock
        if len(got.sizes) != k:
            return
        old = len(r.offs) if r.offs is not None else 0
        if r.offs is not None:
            assert r.sizes is not None
            keep = r.lo - r.cols_lo
            r.offs = r.offs[keep:] + got.offsets
            r.sizes = r.sizes[keep:] + got.sizes
        else:
            r.offs, r.sizes = array("q", got.offsets), array("q", got.sizes)
        r.cols_lo = r.lo
        r.off = got.next_offset
        self._hot += len(r.offs) - old

    def _head_holds(self, n: int) -> Run | None:
        """The head run, if it holds more than ``n`` events and the pointers of its first ``n`` (the usual take)."""
        runs = self._runs
        if n <= 0 or self._h >= len(runs):
            return None
        r = runs[self._h]
        if r.offs is None or r.hi - r.lo <= n or r.cols_lo + len(r.offs) < r.lo + n:
            return None
        return r

    def _plan(self, n: int) -> list[tuple[Run, int]]:
        """The runs a pop of ``n`` (no holes, nothing returned) touches, and where it stops in each."""
        plan: list[tuple[Run, int]] = []
        runs = self._runs
        i = self._h
        while n > 0 and i < len(runs):
            r = runs[i]
            take = min(n, r.hi - r.lo)
            plan.append((r, r.lo + take))
            n -= take
            i += 1
        return plan

    def pop_columns(self, n: int) -> Columns | None:
        """Remove up to ``n`` events from the head and return them as columns (positions, files, offsets, sizes).

        Returns None (and removes nothing) while rolled-back takes or holes are in
        the way; then :meth:`pop` merges them.

        Raises:
            CorruptLogError: A cold run's events are not where it says (nothing is removed).
            OSError: Reading a data file failed (nothing is removed).
        """
        if self._returned or self._holes:
            return None
        r = self._head_holds(n)
        if r is not None:  # no scan, one run, which stays at the head: what the loop below does, in short
            assert r.offs is not None
            assert r.sizes is not None
            a = r.lo - r.cols_lo
            cols = (_range_array(r.lo, n), array("q", (r.fid,)) * n, r.offs[a : a + n], r.sizes[a : a + n])
            self._consume(r, r.lo + n)
            return cols
        plan = self._plan(n)
        for r, upto in plan:
            self._ensure(r, upto)  # every scan first: a failure leaves the queue as it was
        parts: list[Columns] = []
        for r, upto in plan:
            k = upto - r.lo
            a = r.lo - r.cols_lo
            assert r.offs is not None
            assert r.sizes is not None
            parts.append((_range_array(r.lo, k), array("q", (r.fid,)) * k, r.offs[a : a + k], r.sizes[a : a + k]))
            self._consume(r, upto)
        self._drop_empty()
        if len(parts) == 1:
            return parts[0]
        return (
            _concat([p[0] for p in parts]),
            _concat([p[1] for p in parts]),
            _concat([p[2] for p in parts]),
            _concat([p[3] for p in parts]),
        )

    def _consume(self, r: Run, upto: int) -> None:
        """Move ``r``'s head to ``upto`` (everything before it taken or removed)."""
        if upto <= r.lo:
            return
        if self._holes:
            for p in range(r.lo, upto):
                self._holes.discard(p)
        self._n -= upto - r.lo
        r.lo = upto
        if r.offs is not None:
            assert r.sizes is not None
            a = upto - r.cols_lo
            if a >= len(r.offs):
                # Past its pointers: ``off`` is where a scan for the rest starts.
                self._hot -= len(r.offs)
                r.offs = r.sizes = None
                r.cols_lo = upto
            elif a >= 4096 and a * 2 >= len(r.offs):
                del r.offs[:a]
                del r.sizes[:a]
                r.cols_lo = upto
                self._hot -= a

    def _drop_empty(self) -> None:
        """Drop emptied runs at the head."""
        runs = self._runs
        while self._h < len(runs) and runs[self._h].lo >= runs[self._h].hi:
            r = runs[self._h]
            if r.offs is not None:
                self._hot -= len(r.offs)
                r.offs = r.sizes = None
            self._h += 1
        if self._h > 64 and self._h * 2 > len(runs):
            del runs[: self._h]
            self._cool_from = max(0, self._cool_from - self._h)
            self._h = 0

    def _skip_head_holes(self) -> None:
        """Move the head past holes (and runs emptied by them)."""
        runs = self._runs
        holes = self._holes
        while holes and self._h < len(runs):
            r = runs[self._h]
            p = r.lo
            while p < r.hi and p in holes:
                p += 1
            if p == r.lo:
                return
            self._consume(r, p)
            self._drop_empty()

    def pop(self, n: int) -> list[Entry]:
        """Remove and return up to ``n`` events from the head, in position order.

        Raises:
            CorruptLogError, OSError: As :meth:`pop_columns` (what was popped before the failure stays popped
                only when it came from the returned heap; call again after fixing the cause).
        """
        ret = self._returned
        if not ret and not self._holes:
            cols = self.pop_columns(n)
            assert cols is not None
            return list(zip(*cols, strict=True))
        out: list[Entry] = []
        while len(out) < n:
            self._skip_head_holes()
            runs = self._runs
            r = runs[self._h] if self._h < len(runs) else None
            if ret and (r is None or ret[0][0] < r.lo):
                out.append(heapq.heappop(ret))
                continue
            if r is None:
                break
            p = r.lo
            stop = min(r.hi, ret[0][0]) if ret else r.hi
            end = p
            want = n - len(out)
            while end < stop and end - p < want and end not in self._holes:
                end += 1
            try:
                self._ensure(r, end)
            except BaseException:
                self.push_back(out)
                raise
            a = p - r.cols_lo
            assert r.offs is not None
            assert r.sizes is not None
            offs, sizes, fid = r.offs, r.sizes, r.fid
            out.extend((p + i, fid, offs[a + i], sizes[a + i]) for i in range(end - p))
            self._consume(r, end)
            self._drop_empty()
        return out

    def push_back(self, entries: Iterable[Entry]) -> None:
        """Return rolled-back takes to the head, in position order."""
        for e in entries:
            heapq.heappush(self._returned, e)

    # -- replay's removals ----------------------------------------------------------------

    def remove_range(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """Remove the queued positions in ``[start, start + count)``; return them as ``(file_id, first, count)``.

        No I/O: a removal at a run's head or tail moves its ends, one in its middle
        becomes holes (rare: replay of takes that did not come from the head).
        """
        end = start + count
        out: list[tuple[int, int, int]] = []
        runs = self._runs
        holes = self._holes
        i = self._index(start)
        while i < len(runs) and runs[i].lo < end:
            r = runs[i]
            a, b = max(r.lo, start), min(r.hi, end)
            fresh = [p for p in range(a, b) if p not in holes] if holes else range(a, b)
            out += [(r.fid, f, c) for f, c in _ranges(fresh)]
            if a == r.lo:
                self._consume(r, b)
            elif b == r.hi:
                for p in range(a, b):
                    holes.discard(p)
                self._n -= b - a
                r.hi = a
                if r.offs is not None and r.hot_end() > a:
                    assert r.sizes is not None
                    cut = r.hot_end() - a
                    del r.offs[len(r.offs) - cut :]
                    del r.sizes[len(r.sizes) - cut :]
                    self._hot -= cut
            else:
                holes.update(range(a, b))
            self._trim_holes(r)
            i += 1
        self._drop_empty_anywhere()
        if self._returned:
            kept = [e for e in self._returned if not start <= e[0] < end]
            if len(kept) != len(self._returned):
                out += [(e[1], e[0], 1) for e in self._returned if start <= e[0] < end]
                heapq.heapify(kept)
                self._returned = kept
        return out

    def _trim_holes(self, r: Run) -> None:
        """Move ``r``'s ends inward past holes, so a run never begins or ends with one."""
        holes = self._holes
        if not holes:
            return
        hi = r.hi
        while hi > r.lo and hi - 1 in holes:
            hi -= 1
            holes.discard(hi)
        if hi < r.hi:
            self._n -= r.hi - hi
            if r.offs is not None and r.hot_end() > hi:
                assert r.sizes is not None
                cut = min(r.hot_end() - hi, len(r.offs))
                del r.offs[len(r.offs) - cut :]
                del r.sizes[len(r.sizes) - cut :]
                self._hot -= cut
            r.hi = hi
        p = r.lo
        while p < r.hi and p in holes:
            p += 1
        self._consume(r, p)

    def _drop_empty_anywhere(self) -> None:
        runs = self._runs
        if any(r.lo >= r.hi for r in runs[self._h :]):
            for r in runs[self._h :]:
                if r.lo >= r.hi and r.offs is not None:
                    self._hot -= len(r.offs)
                    r.offs = r.sizes = None
            self._runs = [r for r in runs[self._h :] if r.lo < r.hi]
            self._h = 0
            self._cool_from = 0

    def split(self, position: int, offset: int) -> None:
        """Split the run holding ``position`` so that a new run starts there, scanned from ``offset``.

        ``offset`` is a record boundary at or before ``position``'s record and after
        every earlier event of the run (the walk that found it says where): what
        lies between, such as damaged bytes, is never walked again.
        """
        runs = self._runs
        i = self._index(position)
        if i >= len(runs) or not runs[i].lo < position < runs[i].hi:
            return
        r = runs[i]
        new = Run(position, r.hi, r.fid, offset)
        if r.offs is not None and r.hot_end() > position:
            assert r.sizes is not None
            a = position - r.cols_lo
            new.offs, new.sizes, new.off = r.offs[a:], r.sizes[a:], r.off
            del r.offs[a:]
            del r.sizes[a:]
        r.hi = position
        runs.insert(i + 1, new)
        if i + 1 < self._cool_from:
            self._cool_from += 1

    def remove_files(self, file_ids: set[int]) -> list[tuple[int, int, int]]:
        """Remove every queued event in these data files; return them as ``(file_id, first, count)``."""
        out: list[tuple[int, int, int]] = []
        for r in [r for r in self._runs[self._h :] if r.fid in file_ids]:
            out += self.remove_range(r.lo, r.hi - r.lo)
        for e in [e for e in self._returned if e[1] in file_ids]:
            out += self.remove_range(e[0], 1)
        return out

    def missing(self, positions: Iterable[int]) -> set[int]:
        """Return the ``positions`` that are not queued (O(n log runs), no I/O)."""
        return {p for p in positions if p not in self}

    def sample(self, k: int) -> list[Entry]:
        """About ``k`` events spread over the queue, located (for a spot check; no change).

        Up to ``k`` runs spread over the queue, and from the head of each an equal
        share of the ``k`` (a queue of one run: its first ``k`` events). One scan each.

        Raises:
            CorruptLogError, OSError: As the locator.
        """
        runs = self._runs[self._h :]
        if not runs:
            return sorted(self._returned)[:k]
        step = max(1, len(runs) // k)
        picks = sorted({*range(0, len(runs), step), len(runs) - 1})
        per = max(1, k // len(picks))
        out: list[Entry] = []
        for i in picks:
            r = runs[i]
            out += islice(self._run_entries(r, per), per)
        return out

    def entries_in(self, file_ids: set[int]) -> Iterator[Entry]:
        """Yield the queued events in these data files, located (no change).

        Raises:
            CorruptLogError, OSError: As the locator.
        """
        for r in list(self._runs[self._h :]):
            if r.fid in file_ids:
                yield from self._run_entries(r)
        yield from (e for e in sorted(self._returned) if e[1] in file_ids)

    # -- checkpoints ------------------------------------------------------------------------

    def stored(self, extra: Iterable[Entry] = ()) -> tuple[list[StoredRun], list[Entry], list[int]]:
        """The queue (plus ``extra`` entries, held by open transactions) as a checkpoint stores it.

        Returns ``(runs, entries, holes)``: runs in position order, entries outside
        any run (sorted), holes (sorted). O(runs + holes + entries); no I/O.
        """
        runs = [StoredRun(r.lo, r.hi - r.lo, r.fid, r.start_offset()) for r in self._runs[self._h :]]
        return runs, sorted([*self._returned, *extra]), sorted(self._holes)

    @classmethod
    def from_stored(
        cls,
        locate: Locate,
        runs: Iterable[StoredRun],
        entries: Iterable[Entry] = (),
        holes: Iterable[int] = (),
        hot_pointers: int = HOT_POINTERS,
        chunk: int = CHUNK,
    ) -> RunQueue:
        """Build a queue of cold runs (and entries, holes) from a checkpoint's tables.

        Raises:
            ValueError: Runs overlap or are out of order, a hole is outside every run,
                or an entry is inside one or repeated.
        """
        q = cls(locate, hot_pointers, chunk)
        prev = -1
        for s in runs:
            if s.length <= 0 or s.first < prev:
                raise ValueError(f"run at position {s.first} overlaps the one before or is empty")
            q._runs.append(Run(s.first, s.first + s.length, s.file_id, s.offset))
            q._n += s.length
            prev = s.first + s.length
        for p in holes:
            i = q._index(p)
            if i >= len(q._runs) or not q._runs[i].lo <= p < q._runs[i].hi or p in q._holes:
                raise ValueError(f"hole at position {p} is outside every run")
            q._holes.add(p)
        seen = set()
        for e in entries:
            if e[0] in q or e[0] in seen:
                raise ValueError(f"entry at position {e[0]} is inside a run or repeated")
            seen.add(e[0])
            heapq.heappush(q._returned, e)
        for r in q._runs:  # runs that begin or end with holes: their ends move (no I/O)
            q._trim_holes(r)
        q._drop_empty_anywhere()
        return q

    @classmethod
    def from_columns(
        cls,
        locate: Locate,
        positions: array[int],
        file_ids: array[int],
        offsets: array[int],
        hot_pointers: int = HOT_POINTERS,
        chunk: int = CHUNK,
    ) -> RunQueue:
        """Build a queue of cold runs from entries in position order (an older checkpoint's columns).

        Consecutive positions in one data file are consecutive committed PUTs of it
        (the module docstring says why), so each stretch of them becomes one run
        starting at its first entry's offset: one pass, no I/O.

        Raises:
            ValueError: Positions do not increase (``from_stored`` finds the runs overlap).
        """
        n = len(positions)
        runs: list[StoredRun] = []
        if n:
            steps = map(sub, islice(positions, 1, None), positions)
            same = map(eq, islice(file_ids, 1, None), file_ids)
            breaks = [i for i, (d, f) in enumerate(zip(steps, same, strict=True), 1) if d != 1 or not f]
            start = 0
            for b in [*breaks, n]:
                runs.append(StoredRun(positions[start], b - start, file_ids[start], offsets[start]))
                start = b
        return cls.from_stored(locate, runs, hot_pointers=hot_pointers, chunk=chunk)

    # -- reading without taking -----------------------------------------------------------

    def __iter__(self) -> Iterator[Entry]:
        """Yield every queued event in position order, scanning cold runs a chunk at a time (no change)."""
        ret = sorted(self._returned)
        j = 0
        for r in list(self._runs[self._h :]):
            for e in self._run_entries(r):
                while j < len(ret) and ret[j][0] < e[0]:
                    yield ret[j]
                    j += 1
                yield e
        yield from ret[j:]

    def _run_entries(self, r: Run, want: int = 0) -> Iterator[Entry]:
        """Yield ``r``'s queued events, located ``want`` (default: a chunk) per scan."""
        p = r.lo
        holes = self._holes
        off = r.off
        if r.offs is not None:
            assert r.sizes is not None
            for i in range(r.lo - r.cols_lo, len(r.offs)):
                if r.cols_lo + i not in holes:
                    yield (r.cols_lo + i, r.fid, r.offs[i], r.sizes[i])
            p = r.hot_end()
        while p < r.hi:
            got = self._locate(r.fid, off, p, r.hi, want or self._chunk)
            if got.first != p or not len(got.offsets):
                raise CorruptLogError(f"data file {r.fid}", off, f"queued position {p} is not where its run says")
            for i in range(len(got.offsets)):
                if p + i not in holes:
                    yield (p + i, r.fid, got.offsets[i], got.sizes[i])
            p += len(got.offsets)
            off = got.next_offset

    def positions(self) -> Iterator[int]:
        """Yield every queued position in order, without I/O."""
        ret = sorted(e[0] for e in self._returned)
        j = 0
        holes = self._holes
        for r in self._runs[self._h :]:
            for p in range(r.lo, r.hi):
                if p in holes:
                    continue
                while j < len(ret) and ret[j] < p:
                    yield ret[j]
                    j += 1
                yield p
        yield from ret[j:]


def _lo(r: Run) -> int:
    return r.lo


def _concat(parts: list[array[int]]) -> array[int]:
    out = array("q")
    for p in parts:
        out.extend(p)
    return out


def _ranges(positions: Iterable[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out
