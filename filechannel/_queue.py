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
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator

Entry = tuple[int, int, int, int]
"""``(position, file_id, offset, size)``."""

_COMPACT_MIN = 1 << 14


class EventQueue:
    """Committed events waiting to be taken, in position order."""

    __slots__ = ("_fid", "_head", "_off", "_pos", "_returned", "_size")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._pos = array("q")
        self._fid = array("q")
        self._off = array("q")
        self._size = array("q")
        self._head = 0
        self._returned: list[Entry] = []
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
        i = bisect_left(pos, position, self._head)
        if i < len(pos) and pos[i] == position:
            raise ValueError(f"position {position} is already queued")
        pos.insert(i, position)
        self._fid.insert(i, file_id)
        self._off.insert(i, offset)
        self._size.insert(i, size)

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

    def push_back(self, entries: Iterable[Entry]) -> None:
        """Return rolled-back takes to the head, in position order."""
        for e in entries:
            heapq.heappush(self._returned, e)

    def _maybe_compact(self) -> None:
        h = self._head
        if h >= _COMPACT_MIN and h * 2 >= len(self._pos):
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

    def __iter__(self) -> Iterator[Entry]:
        """Iterate entries in position order (the returned heap first)."""
        yield from sorted(self._returned)
        h = self._head
        yield from zip(self._pos[h:], self._fid[h:], self._off[h:], self._size[h:], strict=True)

    def positions(self) -> list[int]:
        """Return the queued positions in order."""
        return [e[0] for e in self]

    def first_position(self) -> int | None:
        """Return the position at the head, or None when empty."""
        if self._returned:
            return self._returned[0][0]
        if self._head < len(self._pos):
            return self._pos[self._head]
        return None

    def last_position(self) -> int | None:
        """Return the position at the tail, or None when empty."""
        if self._head < len(self._pos):
            return self._pos[-1]
        if self._returned:
            return max(self._returned)[0]
        return None

    def file_counts(self) -> dict[int, int]:
        """Return how many queued entries point into each data file."""
        counts: dict[int, int] = {}
        for e in self._returned:
            counts[e[1]] = counts.get(e[1], 0) + 1
        for f in self._fid[self._head :]:
            counts[f] = counts.get(f, 0) + 1
        return counts

    def memory_bytes(self) -> int:
        """Return the bytes held by the columns (for stats and benchmarks)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in (self._pos, self._fid, self._off, self._size))
