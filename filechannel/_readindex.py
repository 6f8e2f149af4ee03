"""The reader's queue as runs: committed events named by ranges of positions, and walks to find them.

It owns what ``ChannelReader`` keeps of the queue and no I/O: a run names
consecutive positions whose records are consecutive committed PUTs of one
data file (``_runs.py`` says why they are), and the records of a range are
found by a locator the caller passes (the reader's walks a data file forward
with ``scan.locate_puts``, the one damage policy; tests pass a model). Memory
is O(runs) plus a mark every :data:`MARK_EVERY` events walked and a bounded
read-ahead, never one entry per event.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence

from ._queue import Columns
from .scan import LOST, PutWalk

__all__ = ["MARK_EVERY", "READ_AHEAD", "Locator", "Run", "RunIndex"]

MARK_EVERY = 4096
"""Events between two of a run's marks: a read anywhere in a run walks at most this many to reach its start."""

READ_AHEAD = 16384
"""Pointers one walk keeps beyond what it was asked for (16 B each): the next read on starts from them.

Positions come from COMMIT records, so a walk into a large transaction reads to
its end anyway; keeping what it found makes reading a run in small steps cost
one walk per :data:`READ_AHEAD` events, not one per step.
"""

READ_AHEAD_BYTES = 2 << 20
"""At most about this many bytes of records read ahead (fewer than :data:`READ_AHEAD` pointers for large events)."""

Locator = Callable[[int, int, int, int, int, int], PutWalk]
"""``locate(file_id, offset, lo, hi, want, event_bytes)``: as ``_runs.Locate`` (a :class:`~filechannel.scan.PutWalk`),
``event_bytes`` the record bytes per event the walk should expect (how much to read at once)."""


class Run:
    """Committed events ``lo .. hi - 1``: consecutive committed PUTs of data file ``fid``.

    Marks: a position, a record boundary at or before its record, and the
    bytes of this run's events from the first mark up to it. The first mark
    (``p0``, ``o0``, 0 bytes) is at or before ``lo``; later ones (``mpos``,
    ``moff``, ``mcum``, None until there is one) come every :data:`MARK_EVERY`
    events as walks pass them. ``hint`` is where the last walk stopped (the
    same three numbers): a consumer reading on starts there. ``total``: the
    bytes of the events from the first mark up to ``hi``, once known.
    """

    __slots__ = ("fid", "hi", "hint", "lo", "mcum", "moff", "mpos", "o0", "p0", "total")

    def __init__(self, lo: int, hi: int, fid: int, offset: int, total: int | None = None) -> None:
        self.lo = lo
        self.hi = hi
        self.fid = fid
        self.p0 = lo
        self.o0 = offset
        self.mpos: array[int] | None = None
        self.moff: array[int] | None = None
        self.mcum: array[int] | None = None
        self.hint: tuple[int, int, int] | None = None
        self.total = total

    def last_mark(self) -> int:
        """The position of the newest mark."""
        return self.mpos[-1] if self.mpos else self.p0

    def mark(self, p: int) -> tuple[int, int, int]:
        """The newest mark at or before position ``p`` (``p0 <= p``): position, offset, bytes before it."""
        mpos = self.mpos
        if mpos and mpos[0] <= p:
            assert self.moff is not None
            assert self.mcum is not None
            k = bisect_right(mpos, p) - 1
            return mpos[k], self.moff[k], self.mcum[k]
        return self.p0, self.o0, 0

    def add_mark(self, p: int, offset: int, cum: int) -> None:
        if self.mpos is None or self.moff is None or self.mcum is None:
            self.mpos, self.moff, self.mcum = array("q"), array("q"), array("q")
        self.mpos.append(p)
        self.moff.append(offset)
        self.mcum.append(cum)

    def copy_from(self, lo: int, hi: int) -> Run:
        """The part ``lo .. hi - 1`` of this run, with the marks that still help (counted from its own first)."""
        p0, o0, base = self.mark(lo)
        r = Run(lo, hi, self.fid, o0)
        r.p0 = p0
        if self.mpos is not None and self.moff is not None and self.mcum is not None:
            k = bisect_right(self.mpos, p0)
            m = bisect_left(self.mpos, hi, k)
            for i in range(k, m):
                r.add_mark(self.mpos[i], self.moff[i], self.mcum[i] - base)
        h = self.hint
        if h is not None and lo <= h[0] < hi:
            r.hint = (h[0], h[1], h[2] - base)
        if hi == self.hi and self.total is not None:
            r.total = self.total - base
        return r

    def extend(self, first: int, offsets: array[int], sizes: array[int]) -> None:
        """Add the events ``first, first + 1, ...`` after ``hi`` (``total`` must be known)."""
        assert self.total is not None
        assert first == self.hi
        cum = self.total
        q = self.last_mark() + MARK_EVERY
        j = 0
        while q < first + len(offsets):
            i = q - first
            if i >= 0:
                cum += sum(sizes[j:i])
                j = i
                self.add_mark(q, offsets[i], cum)
            q += MARK_EVERY
        self.total = cum + sum(sizes[j:])
        self.hi = first + len(offsets)


def _lo(r: Run) -> int:
    return r.lo


class RunIndex:
    """The committed events known to a reader, as runs of one data file each: memory O(runs).

    A run's events are found by walking its data file forward from a mark with
    ``locate`` (``scan.locate_puts``: the queue's walk, the one damage policy).
    """

    __slots__ = ("ahead", "event_bytes", "file_end", "locate", "runs")

    def __init__(self, locate: Locator, file_end: Callable[[int], int | None] | None = None) -> None:
        self.locate = locate
        self.file_end = file_end  # a data file's visible end (where the last run's extent in it ends), if known
        self.runs: list[Run] = []
        # The pointers the last walk found: (file id, first position, offsets, sizes, offset after them).
        self.ahead: tuple[int, int, array[int], array[int], int] | None = None
        self.event_bytes = 200  # record bytes per event, as the last walk found them

    def head(self) -> int | None:
        return self.runs[0].lo if self.runs else None

    def __len__(self) -> int:
        return sum(r.hi - r.lo for r in self.runs)

    def overlapping(self, start: int, end: int) -> list[Run]:
        """The runs holding a position in ``[start, end)``, in order."""
        runs = self.runs
        i = max(0, bisect_right(runs, start, key=_lo) - 1)
        if i < len(runs) and runs[i].hi <= start:
            i += 1
        j = bisect_left(runs, end, i, key=_lo)
        return runs[i:j]

    # -- changes ---------------------------------------------------------------------

    def add(self, first: int, file_id: int, offsets: array[int], sizes: array[int]) -> None:
        """Add one commit's events (positions from ``first``); positions already held are kept as they are."""
        end = first + len(offsets)
        runs = self.runs
        if runs and first < runs[-1].hi:
            # Another data directory published later positions first, or a repeat: only the gaps.
            gaps: list[tuple[int, int]] = []
            p = first
            for r in self.overlapping(first, end):
                if r.lo > p:
                    gaps.append((p, r.lo))
                p = max(p, r.hi)
            if p < end:
                gaps.append((p, end))
            for a, b in gaps:
                i = bisect_left(runs, a, key=_lo)
                self._put(i, a, file_id, offsets[a - first : b - first], sizes[a - first : b - first])
            return
        self._put(len(runs), first, file_id, offsets, sizes)

    def _put(self, i: int, first: int, file_id: int, offsets: array[int], sizes: array[int]) -> None:
        runs = self.runs
        if i > 0:
            prev = runs[i - 1]
            if prev.hi == first and prev.fid == file_id and prev.total is not None:
                prev.extend(first, offsets, sizes)
                return
        r = Run(first, first, file_id, offsets[0], 0)
        r.extend(first, offsets, sizes)
        runs.insert(i, r)

    def add_stored(self, first: int, count: int, file_id: int, offset: int, holes: list[int]) -> None:
        """Add a run of the owner's queue (a scan from ``offset`` finds it), less ``holes`` (sorted)."""
        p = first
        for h in [*holes, first + count]:
            if h > p:
                self.runs.append(Run(p, h, file_id, offset))
            p = h + 1

    def remove(self, first: int, count: int) -> None:
        """Forget the events taken from ``[first, first + count)``."""
        end = first + count
        runs = self.runs
        parts = self.overlapping(first, end)
        if not parts:
            return
        i = runs.index(parts[0])
        keep: list[Run] = []
        for r in parts:
            if r.lo < first:
                keep.append(r.copy_from(r.lo, first))
            if r.hi > end:
                keep.append(r.copy_from(end, r.hi))
        runs[i : i + len(parts)] = keep

    # -- walks -----------------------------------------------------------------------

    def _walk(self, r: Run, a: int, b: int, collect: bool) -> tuple[int | None, int | None, array[int], array[int]]:
        """Walk ``r``'s file from its best mark at or before ``a`` through ``b - 1``.

        Returns ``(cum at a, cum at b, offsets, sizes)``: the bytes of the run's
        events before ``a`` and before ``b`` (None where a record was missing
        before them), and with ``collect`` the pointers of ``a .. b - 1``
        (:data:`~filechannel.scan.LOST` for a position whose record is not there).
        Marks and the hint are left where the walk passed.

        Raises:
            FileNotFoundError: The data file is gone (retired).
            OSError: Reading failed.
        """
        p, off, cum = r.mark(a)
        # Reading on from where the last walk stopped: read ahead too (a read elsewhere walks just what it needs).
        on = r.hint is not None and r.hint[0] == a
        if r.hint is not None and p < r.hint[0] <= a:
            p, off, cum = r.hint
        offs: array[int] = array("q")
        sizes: array[int] = array("q")
        cum_a: int | None = cum if p == a else None
        known = True
        while p < b:
            got = self._ahead(r.fid, p, b) or (self._find(r, off, p, b, on) if off >= 0 else None)
            n = len(got.offsets) if got is not None else 0
            if got is None or got.first != p or not n:
                # Not where the run says: every position left reads as missing (damage, reported by the read).
                if collect:
                    lo = max(a, p)
                    offs.extend(array("q", (LOST,)) * (b - lo))
                    sizes.extend(array("q", (0,)) * (b - lo))
                return cum_a, None, offs, sizes
            g_offs, g_sizes = got.offsets, got.sizes
            lost_at = g_offs.index(LOST) if LOST in g_offs else n  # the bytes before it are still known
            i0 = max(0, a - p)
            if cum_a is None and p + n >= a and i0 <= n:
                cum_a = cum + sum(g_sizes[:i0]) if known and i0 <= lost_at else None
            if collect and i0 < n:
                offs.extend(g_offs[i0:])
                sizes.extend(g_sizes[i0:])
            if known:
                q = r.last_mark() + MARK_EVERY
                j = 0
                c = cum
                while q < p + lost_at:
                    if q >= p and g_offs[q - p] >= 0:
                        c += sum(g_sizes[j : q - p])
                        j = q - p
                        r.add_mark(q, g_offs[q - p], c)
                    q += MARK_EVERY
                cum += sum(g_sizes)
            if lost_at < n:
                known = False
            p += n
            off = got.next_offset
            if known and p < r.hi:
                r.hint = (p, off, cum)
        if not known:
            return cum_a, None, offs, sizes
        if b == r.hi:
            r.total = cum
        return cum_a, cum, offs, sizes

    def _ahead(self, fid: int, p: int, b: int) -> PutWalk | None:
        """The pointers of ``p ..`` (up to ``b``) from what the last walk kept, if it reached ``p``."""
        got = self.ahead
        if got is None or got[0] != fid or not got[1] <= p < got[1] + len(got[2]):
            return None
        i = p - got[1]
        j = min(len(got[2]), i + b - p)
        nxt = got[2][j] if j < len(got[2]) else got[4]
        if nxt < 0:
            return None  # the next record is missing: a walk says so
        return PutWalk(p, got[2][i:j], got[3][i:j], nxt, True)

    def _find(self, r: Run, off: int, p: int, b: int, on: bool) -> PutWalk:
        """Walk ``r``'s file from ``off`` for ``p .. b - 1`` (reading ``on``: and :data:`READ_AHEAD` more, kept)."""
        ahead = min(READ_AHEAD, max(64, READ_AHEAD_BYTES // self.event_bytes)) if on else 0
        got = self.locate(r.fid, off, p, r.hi, max(b - p, min(ahead, r.hi - p)), self.event_bytes)
        n = len(got.offsets)
        if n:
            self.event_bytes = max(32, sum(got.sizes) // n + 8)
        k = b - p
        if got.first == p and n > k:
            if got.offsets[k] < 0:  # the next record is missing: no place to go on from, walk just the range
                return self.locate(r.fid, off, p, b, k, self.event_bytes)
            self.ahead = (r.fid, p, got.offsets, got.sizes, got.next_offset)
            return PutWalk(p, got.offsets[:k], got.sizes[:k], got.offsets[k], True)
        return got

    def _anchor(self, r: Run, p: int) -> tuple[int, int, int]:
        """The furthest point known at or before ``p``: position, offset, bytes before it (a mark or the hint)."""
        m = r.mark(p)
        h = r.hint
        return h if h is not None and m[0] < h[0] <= p else m

    def _extent_ends(self, i: int) -> dict[int, int | None]:
        """Per run from ``runs[i]`` on (by ``id``): where its extent in its data file ends.

        The first mark's offset of the next run of the same file, else the
        file's visible end (``file_end``; None when it is not known).
        """
        out: dict[int, int | None] = {}
        nxt: dict[int, int] = {}
        file_end = self.file_end
        for r in reversed(self.runs[i:]):
            e = nxt.get(r.fid)
            out[id(r)] = e if e is not None else (file_end(r.fid) if file_end is not None else None)
            nxt[r.fid] = r.o0
        return out

    def _bytes_at(self, r: Run, p: int, ends: Callable[[], dict[int, int | None]]) -> int:
        """The bytes of ``r``'s records from its first mark up to ``p``: exact, or its extent where not read yet.

        Exact at ``hi`` once a walk reached it, and within :data:`MARK_EVERY`
        events of a mark or the hint (a bounded walk; a missing record counts 0).
        Further on, in a part no walk has passed (a run the owner's queue held
        when the reader opened), nothing is read: the bytes of the run's data
        file from its newest mark (the first one: a record boundary at or before
        its first record) to where the run's extent ends (:meth:`_extent_ends`),
        spread evenly over the positions after the mark.
        """
        if p == r.hi and r.total is not None:
            return r.total
        q, off, cum = self._anchor(r, p)
        if q == p:
            return cum
        if p - q <= MARK_EVERY:
            got = self._walk(r, p, p, False)[0]
            if got is not None:
                return got
            sizes = self._walk(r, q, p, True)[3]  # a record is missing: count the ones there
            return cum + sum(sizes)
        # From the newest mark: its offset is its record's (the hint's may be where a walk resumes, earlier).
        q, off, cum = r.mark(p)
        if r.total is not None:
            return cum + (r.total - cum) * (p - q) // (r.hi - q)
        e = ends().get(id(r))
        span = e - off if e is not None else self.event_bytes * (r.hi - q)
        return cum + max(0, span) * (p - q) // (r.hi - q)

    def record_bytes(self, start: int, end: int) -> int:
        """The bytes of the records of the events held in ``[start, end)``: :meth:`record_bytes_many`."""
        return self.record_bytes_many([start], end)[0]

    def record_bytes_many(self, starts: Sequence[int], end: int) -> list[int]:
        """For each of ``starts``: the bytes of the records of the events held in ``[start, end)``.

        Exact where the reader knows the records: runs it followed as they were
        written, and the parts of the others its walks passed (a missing record
        counts 0). A part of a run no walk has passed is counted from its
        extent in its data file (:meth:`_bytes_at`): the file's bytes a reader
        still has to read for it, with the records that are not queued PUTs
        between them (COMMITs, TAKEs, ...), so at most a little more than the
        exact sum; a start inside such a part is placed as if its events were of
        equal size. The data files are read only for a walk of at most
        :data:`MARK_EVERY` events at each end of a run: no I/O grows with depth.
        """
        runs = self.runs
        lo = min((s for s in starts if s < end), default=end)
        first = self.overlapping(lo, end)
        cache: dict[tuple[int, int], int] = {}
        ends: dict[int, int | None] | None = None

        def get_ends() -> dict[int, int | None]:
            nonlocal ends
            if ends is None:
                ends = self._extent_ends(runs.index(first[0]))
            return ends

        def at(r: Run, p: int) -> int:
            key = (id(r), p)
            got = cache.get(key)
            if got is None:
                got = cache[key] = self._bytes_at(r, p, get_ends)
            return got

        out: list[int] = []
        for start in starts:
            total = 0
            for r in self.overlapping(start, end) if start < end else ():
                a, b = max(r.lo, start), min(r.hi, end)
                total += max(0, at(r, b) - at(r, a))
            out.append(total)
        return out

    def columns(self, start: int, end: int, limit: int | None = None) -> Columns:
        """The events held in ``[start, end)`` (the first ``limit``) as columns: positions, files, offsets, sizes."""
        pos: array[int] = array("q")
        fid: array[int] = array("q")
        off: array[int] = array("q")
        size: array[int] = array("q")
        for r in self.overlapping(start, end):
            a, b = max(r.lo, start), min(r.hi, end)
            if limit is not None:
                b = min(b, a + limit - len(pos))
            _, _, o, s = self._walk(r, a, b, True)
            pos.extend(range(a, b))
            fid.extend(array("q", (r.fid,)) * (b - a))
            off.extend(o)
            size.extend(s)
            if limit is not None and len(pos) >= limit:
                break
        return pos, fid, off, size

    def first_pointer(self, r: Run) -> tuple[int, int]:
        """The offset and size of ``r``'s first event's record (offset LOST when it is missing)."""
        _, _, o, s = self._walk(r, r.lo, r.lo + 1, True)
        return o[0], s[0]
