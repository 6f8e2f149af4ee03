"""The take cache: recently committed event bodies kept in memory, one entry per commit.

A take whose event is still here is served without reading its record back
from disk. This module owns only that memory: which positions are held, how
many bytes they count for, and what is evicted first when the limit is
passed. It knows nothing of files, locks or the queue; the channel calls it
under its own lock.

A commit's events have consecutive positions, so a commit is one entry (a
run): its first position, its bodies and headers, and how many of them are
still held. Adding a commit costs one entry whatever its size, and eviction
drops whole runs, lowest positions first (the events a FIFO take reaches
soonest are also the oldest). Taking an event clears its slot; a run whose
slots are all cleared is dropped.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Mapping, Sequence

#: Bytes counted per cached event besides its body (the slot, the headers' reference).
OVERHEAD = 64

#: What a hit returns: the fields of the Event a take hands out.
Cached = tuple[bytes, Mapping[str, str], int]


class _Run:
    """One commit's events: ``bodies[k]`` is position ``first + k``, None once taken."""

    __slots__ = ("bodies", "headers", "left", "nbytes")

    def __init__(self, bodies: list[bytes | None], headers: Sequence[Mapping[str, str]], nbytes: int) -> None:
        self.bodies = bodies
        self.headers = headers
        self.left = len(bodies)
        self.nbytes = nbytes


class TakeCache:
    """Event bodies by position, in runs, within ``limit`` counted bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self.events = 0
        self._runs: dict[int, _Run] = {}
        # First positions of the runs, ascending; entries before _head are gone. A run that was
        # emptied by takes leaves its first position here until eviction or compaction steps over it.
        self._firsts: list[int] = []
        self._head = 0

    def __len__(self) -> int:
        return self.events

    def add(self, first: int, bodies: Sequence[bytes], headers: Sequence[Mapping[str, str]]) -> None:
        """Hold a commit's events (positions ``first, first + 1, ...``), evicting the lowest runs past the limit."""
        n = len(bodies)
        if not n or not self.limit:
            return
        nbytes = sum(map(len, bodies)) + OVERHEAD * n
        self._runs[first] = _Run(list(bodies), headers, nbytes)
        firsts = self._firsts
        if not firsts or first > firsts[-1]:
            firsts.append(first)
        else:  # several data directories: commits can take effect out of position order
            insort(firsts, first, lo=self._head)
        self.nbytes += nbytes
        self.events += n
        if self.nbytes > self.limit:
            self._evict()

    def _evict(self) -> None:
        runs = self._runs
        firsts = self._firsts
        head = self._head
        while self.nbytes > self.limit and head < len(firsts):
            run = runs.pop(firsts[head], None)
            head += 1
            if run is not None:
                self.nbytes -= run.nbytes
                self.events -= run.left
        if head > 1024 and head * 2 > len(firsts):
            del firsts[:head]
            head = 0
        self._head = head

    def pop(self, positions: Sequence[int]) -> list[Cached | None]:
        """Remove and return the events at ``positions`` (None where one is not held)."""
        out: list[Cached | None] = []
        if not self.events:
            return [None] * len(positions)
        runs = self._runs
        firsts = self._firsts
        run: _Run | None = None
        first = end = 0
        freed = taken = 0
        for p in positions:
            if not first <= p < end:
                i = bisect_right(firsts, p, self._head) - 1
                run = runs.get(firsts[i]) if i >= self._head else None
                if run is None:
                    end = first = 0
                    out.append(None)
                    continue
                first = firsts[i]
                end = first + len(run.bodies)
                if p >= end:
                    out.append(None)
                    continue
            assert run is not None
            k = p - first
            body = run.bodies[k]
            if body is None:
                out.append(None)
                continue
            run.bodies[k] = None
            size = len(body) + OVERHEAD
            run.nbytes -= size
            run.left -= 1
            freed += size
            taken += 1
            out.append((body, run.headers[k], p))
            if not run.left:
                del runs[first]
                end = first = 0
        self.nbytes -= freed
        self.events -= taken
        return out
