"""The take cache: recently committed event bodies kept in memory, one entry per commit.

A take whose event is still here is served without reading its record back
from disk. This module owns only that memory: which positions are held, how
many bytes they count for, and what is evicted first when the limit is
passed. It knows nothing of files, locks or the queue; the channel calls it
under its own lock.

A commit's events have consecutive positions, so a commit is one entry (a
run: its first position, its bodies and headers, and how many of them are
still held; small commits whose positions follow on share one, see
:data:`MERGE_MAX`). Adding a commit costs one entry whatever its size, and eviction
drops whole runs, lowest positions first (the events a FIFO take reaches
soonest are also the oldest). Taking an event clears its slot; a run whose
slots are all cleared is dropped.

A commit of ``Transaction.put_arrow``'s column is added lazily (:meth:`TakeCache.add_lazy`):
the run holds the column, and its bodies are made, in one C call, by the first
take that reaches it, so a commit costs no Python object per event.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

# What a cached event costs in memory, as counted (``cache_bytes``): a model measured with
# tracemalloc on CPython 3.11 (64-bit), rounded up so the count is not below the real cost:
#   body bytes + OVERHEAD                                          every event
#   + HEADERS_OVERHEAD + HEADER_ENTRY * entries + header bytes     an event with headers
# OVERHEAD is the body's bytes object (33 bytes and malloc's rounding) and its slots in the
# run's lists; HEADERS_OVERHEAD is the headers dict; HEADER_ENTRY is a key and a value str
# object and the dict's slot for them (growth included); "header bytes" is the length of the
# event's encoded header block (format.encode_event: the keys' and values' UTF-8 plus their
# length prefixes), which the channel has already (its PUT payloads). Counting costs three
# C-level passes over a commit's lists (``len`` of bodies, of headers, ``bool`` of headers),
# no per-event Python code. Headers shared by several events (``put_many``'s) are counted for
# each: the count may be above the real cost, never far below.

#: Bytes counted per cached event besides its body (the body's object, its slots).
OVERHEAD = 56
#: Bytes counted per cached event with headers: its headers dict.
HEADERS_OVERHEAD = 176
#: Bytes counted per header entry, besides the text (the key's and value's str objects, the dict slot).
HEADER_ENTRY = 104

#: Events one run may hold by merging commits whose positions follow on (one-event producers): a
#: commit costs a run object and two lists, which the garbage collector walks on every full collection,
#: so a cache of many small commits would pause every thread for tens of milliseconds; merged, it
#: holds a few objects per ``MERGE_MAX`` events. Bigger commits stay runs of their own.
MERGE_MAX = 1024
#: A merged run counts at most this share of the limit (``limit // MERGE_SHARE`` bytes), so that
#: evicting one never drops much more than the limit asks.
MERGE_SHARE = 32

#: What a hit returns by default (``pop`` without ``take``): the fields of the Event a take hands out.
Cached = tuple[bytes, Mapping[str, str], int]
Take = Callable[[list[Any], Sequence[Mapping[str, str]], int, int, int], tuple[list[Any], int]]
"""How :meth:`TakeCache.pop` takes a stretch of a run: ``take(bodies, headers, a, m, first)`` turns
slots ``a .. a + m - 1`` (positions ``first, first + 1, ...``, none of them cleared) into items, sets
those slots to None, and returns the items and the bodies' total length."""


def take_tuples(
    bodies: list[Any], headers: Sequence[Mapping[str, str]], a: int, m: int, first: int
) -> tuple[list[Cached], int]:
    """The default :data:`Take`: a :data:`Cached` tuple per event."""
    seg = bodies[a : a + m]
    nbytes = sum(map(len, seg))
    items = list(zip(seg, headers[a : a + m], range(first, first + m), strict=True))
    bodies[a : a + m] = [None] * m
    return items, nbytes


Load = Callable[[], tuple[list[Any], list[Mapping[str, str]]]]
"""How a lazy run makes its bodies and headers (lists of its length), at its first take."""


class _Run:
    """One commit's events: ``bodies[k]`` is position ``first + k``, None once taken.

    FIFO takes clear a run from its start, so the cleared slots are usually a
    prefix: ``lo`` counts them, and while ``holes`` is false no slot at or after
    ``lo`` is cleared (a pop there needs no search for None).
    """

    __slots__ = ("bodies", "extra", "headers", "holes", "left", "lo", "load", "merged", "nbytes")

    def __init__(
        self, bodies: list[bytes | None], headers: Sequence[Mapping[str, str]], nbytes: int, extra: int
    ) -> None:
        self.bodies = bodies
        self.headers = headers
        self.left = len(bodies)
        self.nbytes = nbytes  # counted bytes held: the bodies' lengths plus extra
        self.extra = extra  # counted bytes held besides the bodies' lengths (shared evenly by the slots held)
        self.lo = 0
        self.holes = False
        self.load: Load | None = None  # a lazy run's: makes bodies and headers at its first take
        self.merged = False  # later commits were appended (``headers`` is then the run's own list)

    def loaded(self) -> list[bytes | None]:
        """The run's bodies, made now if the run is lazy (see :meth:`TakeCache.add_lazy`)."""
        if self.load is not None:
            bodies, headers = self.load()
            if len(bodies) != self.left or len(headers) != self.left:
                raise ValueError("a lazy cache run loaded a different number of events than it holds")
            self.bodies, self.headers, self.load = bodies, headers, None
        return self.bodies


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
        self.last_hits = 0  # how many events the last pop returned (not None)

    def __len__(self) -> int:
        return self.events

    def add(
        self,
        first: int,
        bodies: Sequence[bytes],
        headers: Sequence[Mapping[str, str]],
        payload_bytes: int | None = None,
    ) -> None:
        """Hold a commit's events (positions ``first, first + 1, ...``), evicting the lowest runs past the limit.

        ``payload_bytes``: the total length of the events' PUT payloads (bodies and encoded headers),
        when any event has headers; None when none has (see the cost model above).
        """
        n = len(bodies)
        if not n or not self.limit:
            return
        body_bytes = sum(map(len, bodies))
        extra = OVERHEAD * n
        if payload_bytes is not None:
            extra += (
                HEADERS_OVERHEAD * sum(map(bool, headers))
                + HEADER_ENTRY * sum(map(len, headers))
                + max(0, payload_bytes - body_bytes)
            )
        if self._extend_last(first, bodies, headers, body_bytes, extra):
            return
        self._insert(first, _Run(list(bodies), headers, body_bytes + extra, extra), n)

    def _extend_last(
        self, first: int, bodies: Sequence[bytes], headers: Sequence[Mapping[str, str]], body_bytes: int, extra: int
    ) -> bool:
        """Append a small commit to the newest run when its positions follow on (see :data:`MERGE_MAX`)."""
        firsts = self._firsts
        if len(firsts) <= self._head:
            return False
        last_first = firsts[-1]
        run = self._runs.get(last_first)
        n = len(bodies)
        if (
            run is None
            or run.load is not None
            or last_first + len(run.bodies) != first
            or len(run.bodies) + n > MERGE_MAX
            or run.nbytes + body_bytes + extra > self.limit // MERGE_SHARE
        ):
            return False
        if not run.merged:  # its headers may be the committer's list: extend a copy
            run.headers = list(run.headers)
            run.merged = True
        run.bodies.extend(bodies)
        cast("list[Mapping[str, str]]", run.headers).extend(headers)
        run.left += n
        run.nbytes += body_bytes + extra
        run.extra += extra
        self.nbytes += body_bytes + extra
        self.events += n
        if self.nbytes > self.limit:
            self._evict()
        return True

    def add_lazy(self, first: int, n: int, nbytes: int, load: Load) -> None:
        """:meth:`add` of a commit whose bodies are made only if a take reaches them.

        ``n`` events of ``nbytes`` body bytes together; ``load()`` returns their
        bodies and headers (``Transaction.put_arrow``'s column: committing costs
        no Python object per event, and a run evicted untaken never makes them).
        """
        if not n or not self.limit:
            return
        run = _Run([], (), nbytes + OVERHEAD * n, OVERHEAD * n)
        run.left = n
        run.load = load
        self._insert(first, run, n)

    def _insert(self, first: int, run: _Run, n: int) -> None:
        self._runs[first] = run
        firsts = self._firsts
        if not firsts or first > firsts[-1]:
            firsts.append(first)
        else:  # several data directories: commits can take effect out of position order
            insort(firsts, first, lo=self._head)
        self.nbytes += run.nbytes
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

    def pop(self, positions: Sequence[int], take: Take | None = None) -> list[Any]:
        """Remove and return the events at ``positions`` (None where one is not held).

        ``positions`` must be ascending and distinct, as the queue hands them out: a stretch
        of them that spans as many positions as it has entries is then consecutive, and is
        served as one call of ``take`` (see :data:`Take`); by default a :data:`Cached`
        tuple per event.
        """
        if not self.events:
            self.last_hits = 0
            return [None] * len(positions)
        if take is None:
            take = take_tuples
        out: list[Any] = []
        runs = self._runs
        firsts = self._firsts
        head = self._head
        freed = taken = 0
        i = 0
        n_pos = len(positions)
        while i < n_pos:
            p = positions[i]
            k = bisect_right(firsts, p, head) - 1
            run = runs.get(firsts[k]) if k >= head else None
            if run is None:
                out.append(None)
                i += 1
                continue
            first = firsts[k]
            bodies = run.bodies if run.load is None else run.loaded()
            a = p - first
            if a >= len(bodies):
                out.append(None)
                i += 1
                continue
            j = min(n_pos, i + len(bodies) - a)  # entries i..j-1 may lie in this run
            while positions[j - 1] - p != j - 1 - i:  # not consecutive: shrink to the consecutive part
                j = i + 1 + (j - i - 1) // 2 if j - i > 2 else i + 1
            m = j - i
            if (run.holes or a < run.lo) and None in bodies[a : a + m]:  # some already taken: one at a time
                m = 1
                if bodies[a] is None:
                    out.append(None)
                    i += 1
                    continue
            items, held = take(bodies, run.headers, a, m, p)
            out += items
            if a == run.lo:
                run.lo = a + m
            elif a > run.lo:
                run.holes = True
            share = run.extra if m == run.left else run.extra * m // run.left
            run.extra -= share
            size = held + share
            run.nbytes -= size
            run.left -= m
            freed += size
            taken += m
            if not run.left:
                del runs[first]
            i += m
        self.nbytes -= freed
        self.events -= taken
        self.last_hits = taken
        return out
