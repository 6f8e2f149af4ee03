"""The in-memory queue of committed, untaken events: positions and pointers only.

It owns ordering and nothing else: no I/O, no locking (the channel holds its
lock around every call), no event bytes. Each entry is a position and the
pointer ``(file_id, offset, size)`` of the event's PUT record, kept in four
parallel ``array('q')`` columns so a million queued events cost about 32 MB,
not a million Python objects.

The queue is always in position order. Puts append at the tail (an insert
near the tail when two data directories publish out of order). Takes pop from
the head; rolled-back takes go to a small heap, which the head drains first,
because their positions are smaller than anything left in the columns.

A take pops column slices, not tuples; ``Taken`` holds them for the
transaction and makes ``Entry`` tuples only when one is needed at a time.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from . import format as fmt

Entry = tuple[int, int, int, int]
"""``(position, file_id, offset, size)``."""

Columns = tuple["array[int]", "array[int]", "array[int]", "array[int]"]
"""Entries as four parallel columns: positions, file ids, offsets, sizes."""

_COMPACT_MIN = 1 << 14


class EventQueue:
    """Committed events waiting to be taken, in position order."""

    __slots__ = ("_fid", "_head", "_lent", "_off", "_pos", "_returned", "_size")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._pos = array("q")
        self._fid = array("q")
        self._off = array("q")
        self._size = array("q")
        self._head = 0
        self._returned: list[Entry] = []
        self._lent = 0  # windows of the columns lent to checkpoints being written (see lend)
        for e in entries:
            self.append(*e)

    def __len__(self) -> int:
        return len(self._pos) - self._head + len(self._returned)

    def append(self, position: int, file_id: int, offset: int, size: int) -> None:
        """Add a newly committed event (normally at the tail)."""
        pos = self._pos
        if not pos or position > pos[-1] or len(pos) == self._head:
            if pos and len(pos) == self._head:
                self._clear_columns()
                pos = self._pos
            pos.append(position)
            self._fid.append(file_id)
            self._off.append(offset)
            self._size.append(size)
            return
        # Out of order (another data directory published first): insert in place.
        if self._lent:
            self._unshare()
            pos = self._pos
        i = bisect_left(pos, position, self._head)
        if i < len(pos) and pos[i] == position:
            raise ValueError(f"position {position} is already queued")
        pos.insert(i, position)
        self._fid.insert(i, file_id)
        self._off.insert(i, offset)
        self._size.insert(i, size)

    def append_run(self, first: int, file_id: int, offsets: Sequence[int], sizes: Sequence[int]) -> None:
        """Add one commit's puts: positions ``first, first + 1, ...`` in ``file_id``."""
        n = len(offsets)
        pos = self._pos
        if n and pos and first <= pos[-1] and len(pos) > self._head:
            for i in range(n):  # out of order (another data directory published first)
                self.append(first + i, file_id, offsets[i], sizes[i])
            return
        if pos and len(pos) == self._head:
            self._clear_columns()
            pos = self._pos
        # The bulk forms run in C without an object per entry: frombytes of the positions (with
        # the accelerator), array * n, and extend from the commit's array("q") columns.
        sp = fmt.speedups
        if sp is not None:
            pos.frombytes(sp.int64_range(first, n))
        else:
            pos.fromlist(list(range(first, first + n)))
        self._fid.extend(array("q", (file_id,)) * n)
        _extend(self._off, offsets)
        _extend(self._size, sizes)

    def pop(self, n: int) -> list[Entry]:
        """Remove and return up to ``n`` entries from the head."""
        out: list[Entry] = []
        ret = self._returned
        pos = self._pos
        while ret and len(out) < n:
            h = self._head
            if h < len(pos) and pos[h] < ret[0][0]:
                out.append((pos[h], self._fid[h], self._off[h], self._size[h]))
                self._head = h + 1
            else:
                out.append(heapq.heappop(ret))
        need = n - len(out)
        if need > 0:
            h = self._head
            end = min(h + need, len(self._pos))
            if end > h:
                out.extend(zip(self._pos[h:end], self._fid[h:end], self._off[h:end], self._size[h:end], strict=True))
                self._head = end
                self._maybe_compact()
        return out

    def pop_columns(self, n: int) -> Columns | None:
        """Remove up to ``n`` entries from the head and return them as column slices.

        The take path's form of :meth:`pop`: no tuple or int object per entry.
        Returns None (and removes nothing) while rolled-back takes wait in front
        of the columns; then :meth:`pop` merges them.
        """
        if self._returned:
            return None
        h = self._head
        end = min(h + n, len(self._pos))
        cols = (self._pos[h:end], self._fid[h:end], self._off[h:end], self._size[h:end])
        if end > h:
            self._head = end
            self._maybe_compact()
        return cols

    def count_below(self, position: int) -> int:
        """Return how many queued entries have a position below ``position``."""
        k = bisect_left(self._pos, position, self._head) - self._head
        return k + sum(1 for e in self._returned if e[0] < position)

    def first_at_or_after(self, position: int) -> Entry | None:
        """Return the queued entry with the smallest position >= ``position``, or None."""
        best: Entry | None = None
        i = bisect_left(self._pos, position, self._head)
        if i < len(self._pos):
            best = (self._pos[i], self._fid[i], self._off[i], self._size[i])
        for e in self._returned:
            if e[0] >= position and (best is None or e[0] < best[0]):
                best = e
        return best

    def __contains__(self, position: object) -> bool:
        """Return whether ``position`` is queued."""
        if not isinstance(position, int):
            return False
        pos = self._pos
        i = bisect_left(pos, position, self._head)
        if i < len(pos) and pos[i] == position:
            return True
        return any(e[0] == position for e in self._returned)

    def pop_range(self, start: int, count: int) -> list[Entry] | None:
        """Pop the head if it is exactly positions ``start .. start+count-1``, else return None.

        Replay's fast path: consumers take from the head, so most TAKE ranges
        match the head of the queue being rebuilt.
        """
        if self._returned or count <= 0:
            return None
        h = self._head
        pos = self._pos
        last = h + count - 1
        if last >= len(pos) or pos[h] != start or pos[last] != start + count - 1:
            return None
        return self.pop(count)

    def drain_head(self, removed: set[int]) -> list[Entry]:
        """Pop head entries whose positions are in ``removed`` (taking them out of the set)."""
        out: list[Entry] = []
        while removed:
            p = self.first_position()
            if p is None or p not in removed:
                break
            removed.discard(p)
            out.extend(self.pop(1))
        return out

    def push_back(self, entries: Iterable[Entry]) -> None:
        """Return rolled-back takes to the head, in position order."""
        for e in entries:
            heapq.heappush(self._returned, e)

    def _maybe_compact(self) -> None:
        h = self._head
        if h >= _COMPACT_MIN and h * 2 >= len(self._pos) and not self._lent:
            del self._pos[:h]
            del self._fid[:h]
            del self._off[:h]
            del self._size[:h]
            self._head = 0

    def _clear_columns(self) -> None:
        self._pos = array("q")
        self._fid = array("q")
        self._off = array("q")
        self._size = array("q")
        self._head = 0
        self._lent = 0  # lent windows keep the old arrays

    def __iter__(self) -> Iterator[Entry]:
        """Iterate entries in position order (the returned heap first)."""
        yield from sorted(self._returned)
        h = self._head
        yield from zip(self._pos[h:], self._fid[h:], self._off[h:], self._size[h:], strict=True)

    def first_position(self) -> int | None:
        """Return the position at the head, or None when empty."""
        if self._returned:
            return self._returned[0][0]
        if self._head < len(self._pos):
            return self._pos[self._head]
        return None

    def file_counts(self) -> dict[int, int]:
        """Return how many queued entries point into each data file."""
        counts = Counter(e[1] for e in self._returned)
        counts.update(self._fid[self._head :])  # counted in C: a million entries in ~30 ms
        return dict(counts)

    def snapshot(self, extra: Iterable[Entry] = ()) -> tuple[array[int], array[int], array[int], array[int]]:
        """Copy the queue, plus ``extra`` entries (held by open transactions), as four sorted columns."""
        h = self._head
        cols = (self._pos[h:], self._fid[h:], self._off[h:], self._size[h:])
        more = sorted([*self._returned, *extra])
        if not more:
            return cols
        if not cols[0] or more[-1][0] < cols[0][0]:
            front = tuple(array("q", (e[i] for e in more)) for i in range(4))
            return front[0] + cols[0], front[1] + cols[1], front[2] + cols[2], front[3] + cols[3]
        merged = sorted([*more, *zip(*cols, strict=True)])
        return tuple(array("q", (e[i] for e in merged)) for i in range(4))  # type: ignore[return-value]

    def lend(
        self, extra: Iterable[Entry] = ()
    ) -> list[tuple[int, int, tuple[array[int], array[int], array[int], array[int]]]]:
        """Return the queue plus ``extra`` as ``(first, end, columns)`` windows, without copying the columns.

        The twin of :meth:`snapshot` for a checkpoint: O(1) in the queue's length
        in the usual case (``extra`` and rolled-back takes all before the
        columns' head), so it is cheap while every writer is held. Until
        :meth:`give_back`, nothing changes the lent windows in place: appends go
        past their end, pops only move the head, compaction waits, and an
        out-of-order insert first moves the queue to fresh copies of its columns.
        """
        h = self._head
        cols = (self._pos, self._fid, self._off, self._size)
        n = len(self._pos)
        more = sorted([*self._returned, *extra])
        if more and n > h and more[-1][0] >= self._pos[h]:
            merged = self.snapshot(extra)  # interleaved (rare): copy as before
            return [(0, len(merged[0]), merged)]
        out: list[tuple[int, int, tuple[array[int], array[int], array[int], array[int]]]] = []
        if more:
            front = (
                array("q", [e[0] for e in more]),
                array("q", [e[1] for e in more]),
                array("q", [e[2] for e in more]),
                array("q", [e[3] for e in more]),
            )
            out.append((0, len(more), front))
        if n > h:
            out.append((h, n, cols))
            self._lent += 1
        return out

    def give_back(self, windows: list[tuple[int, int, tuple[array[int], array[int], array[int], array[int]]]]) -> None:
        """End a :meth:`lend` whose windows are no longer read."""
        if self._lent and any(w[2][0] is self._pos for w in windows):
            self._lent -= 1
            self._maybe_compact()

    def _unshare(self) -> None:
        """Move to private copies of the columns; lent windows keep the old ones."""
        self._pos = array("q", self._pos)
        self._fid = array("q", self._fid)
        self._off = array("q", self._off)
        self._size = array("q", self._size)
        self._lent = 0

    @classmethod
    def from_snapshot(cls, snap: Any, removed: set[int], taken_from: dict[int, list[tuple[int, int]]]) -> EventQueue:
        """Build a queue from a checkpoint's columns, leaving out ``removed`` positions.

        Each removed position is recorded in ``taken_from`` under its data file.
        """
        q = cls()
        pos, fid, off, size = snap.positions, snap.file_ids, snap.offsets, snap.sizes
        if removed:
            # Consumers take from the head: usually the removed positions are a prefix.
            k = 0
            n = len(pos)
            hits = 0
            while k < n and pos[k] in removed:
                k += 1
                hits += 1
            for i in range(k):
                _note(taken_from, fid[i], pos[i])
            if hits == len(removed) or k == n:
                q._pos, q._fid, q._off, q._size = pos[k:], fid[k:], off[k:], size[k:]
            else:
                keep = [i for i in range(k, n) if pos[i] not in removed]
                for i in range(k, n):
                    if pos[i] in removed:
                        _note(taken_from, fid[i], pos[i])
                q._pos = array("q", (pos[i] for i in keep))
                q._fid = array("q", (fid[i] for i in keep))
                q._off = array("q", (off[i] for i in keep))
                q._size = array("q", (size[i] for i in keep))
        else:
            q._pos, q._fid, q._off, q._size = pos, fid, off, size
        return q

    def without(self, removed: set[int], taken_from: dict[int, list[tuple[int, int]]]) -> EventQueue:
        """Return a queue of these entries minus ``removed`` positions (noted in ``taken_from``)."""
        head = self.first_position()
        if head is None or not any(p >= head for p in removed):
            return self
        q = EventQueue()
        for e in self:
            if e[0] in removed:
                _note(taken_from, e[1], e[0])
            else:
                q.append(*e)
        return q

    def positions_array(self) -> array[int]:
        """Return every queued position (unordered when rolled-back takes are pending)."""
        h = self._head
        return array("q", [e[0] for e in self._returned]) + self._pos[h:]

    def missing(self, positions: array[int], chunk: int = 1 << 16) -> set[int]:
        """Return the ``positions`` that are not queued (in any order; each at most once).

        A chunk of ``positions`` at a time, against the window of the (sorted)
        columns between the chunk's smallest and largest position: when the two
        are equal (the usual case: a checkpoint's positions, all still queued)
        that is one array comparison in C, and otherwise a set difference of one
        chunk. Never a set of every position (that was the peak of a full replay).
        """
        pos, h = self._pos, self._head
        returned = {e[0] for e in self._returned}
        out: set[int] = set()
        for i in range(0, len(positions), chunk):
            part = positions[i : i + chunk]
            lo = bisect_left(pos, part[0], h)
            if pos[lo : lo + len(part)] == part:
                continue  # every one of them is queued (whatever order ``positions`` is in)
            lo = bisect_left(pos, min(part), h)
            hi = bisect_right(pos, max(part), lo)
            out.update(set(part).difference(pos[lo:hi], returned))
        return out

    def entries_in(self, file_ids: set[int]) -> list[Entry]:
        """Return the entries that point into the given data files."""
        return [e for e in self if e[1] in file_ids]

    def entries_at(self, indices: Iterable[int]) -> list[Entry]:
        """Return the entries at the given queue indices (0 is the head)."""
        allq = None
        out = []
        for i in indices:
            if self._returned:
                if allq is None:
                    allq = list(self)
                out.append(allq[i])
            else:
                j = self._head + i
                out.append((self._pos[j], self._fid[j], self._off[j], self._size[j]))
        return out

    def memory_bytes(self) -> int:
        """Return the bytes held by the columns (for stats and benchmarks)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in (self._pos, self._fid, self._off, self._size))


def _extend(a: array[int], xs: Sequence[int]) -> None:
    if isinstance(xs, list):
        a.fromlist(xs)
    else:
        a.extend(xs)  # an array("q"): one copy


def _note(taken_from: dict[int, list[tuple[int, int]]], file_id: int, position: int) -> None:
    lst = taken_from.setdefault(file_id, [])
    if lst and lst[-1][0] + lst[-1][1] == position:
        lst[-1] = (lst[-1][0], lst[-1][1] + 1)
    else:
        lst.append((position, 1))


class Taken:
    """The entries one transaction has taken, kept as popped: column slices or tuples.

    A take pops the head as column slices (:meth:`EventQueue.pop_columns`);
    they become ``Entry`` tuples only when something needs them one by one (a
    rollback, a checkpoint, a damaged event). Parts are only appended, under
    the channel's lock, so a checkpoint reading :meth:`entries` under that lock
    sees every part whole; whoever removes entries assigns a new ``Taken``.
    """

    __slots__ = ("_parts", "count")

    def __init__(self, entries: list[Entry] | None = None) -> None:
        self._parts: list[list[Entry] | Columns] = [entries] if entries else []
        self.count = len(entries) if entries else 0

    def __len__(self) -> int:
        return self.count

    def add(self, part: list[Entry] | Columns, n: int | None = None) -> None:
        """Append entries popped from the queue (a list of entries, or columns), ``n`` of them."""
        if n is None:
            n = len(part[0]) if isinstance(part, tuple) else len(part)
        if n:
            self._parts.append(part)
            self.count += n

    def entries(self) -> list[Entry]:
        """Return every entry, in the order taken (a new list)."""
        out: list[Entry] = []
        for part in self._parts:
            if isinstance(part, tuple):
                out.extend(zip(*part, strict=True))
            else:
                out.extend(part)
        return out

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries())

    def one_run(self) -> tuple[int, int, int] | None:
        """Return ``(file_id, first_position, count)`` for the usual take, else None.

        The usual take: every entry popped as columns in one call, one run of
        consecutive positions in one file.
        """
        if len(self._parts) != 1:
            return None
        part = self._parts[0]
        if not isinstance(part, tuple):
            return None
        pos, fid = part[0], part[1]
        n = len(pos)
        # The columns hold distinct positions in ascending order: first and last decide.
        if pos[n - 1] - pos[0] == n - 1 and fid == array("q", (fid[0],)) * n:  # compared in C
            return fid[0], pos[0], n
        return None
