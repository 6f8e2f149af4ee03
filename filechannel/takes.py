"""Serving takes: a take's events from the cache of recent puts or from disk, and its grouping for the commit.

This module owns how the entries a take popped become Events: those the take
cache holds are built straight from it (:func:`take_slots`, one C call with
the accelerator), the rest are read from the data files in one call
(:func:`read_taken`: one pread per run of adjacent records, verified and
decoded together), with each damaged record returned beside them for the
channel's ``on_corruption`` policy. It also groups a transaction's takes for
its commit (:func:`take_runs`). It holds no state: the queue, the cache and the
transaction are the channel's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any, cast

from . import format as fmt
from ._queue import Columns, Entry
from .errors import CorruptLogError
from .events import NO_HEADERS, Event, as_event
from .log import Log

position_of = itemgetter(0)  # of an Entry (position, file_id, offset, size)
_file_id = itemgetter(1)


def take_slots(
    bodies: list[Any], headers: Sequence[Mapping[str, str]], a: int, m: int, first: int
) -> tuple[list[Event], int]:
    """A take's cache hits as Events: the channel's :data:`filechannel._cache.Take`.

    Slots ``a .. a + m - 1`` of a cache run (positions ``first, first + 1, ...``)
    become Events and are cleared; returns them with the bodies' total length.
    With the accelerator, one C call does it (``_speedups.take_slots``: each body's
    reference moves into its Event); this is its twin.
    """
    sp = fmt.speedups
    if sp is not None and type(bodies) is list and type(headers) is list:
        return sp.take_slots(Event, bodies, headers, a, m, first)  # type: ignore[no-any-return]
    if a < 0 or m < 0 or a > len(bodies) - m or a > len(headers) - m:
        raise ValueError("take_slots: the stretch is not inside the run")
    seg = bodies[a : a + m]
    nbytes = sum(map(len, seg))  # a cleared slot (None) raises here, before anything changes
    events = [as_event(Event, (b, h, first + i)) for i, (b, h) in enumerate(zip(seg, headers[a : a + m], strict=True))]
    bodies[a : a + m] = [None] * m
    return events, nbytes


def column_events(col: fmt.PutColumn) -> tuple[list[bytes], list[Mapping[str, str]]]:
    """The bodies and headers of a committed column (its events share ``col.head``), for the take cache.

    A column without a head holds whole PUT payloads (the Spark sink's rows with headers): each is decoded.
    """
    if not col.head:
        events = [fmt.decode_event(p) for p in col.payloads()]
        return [b for b, _ in events], [h or NO_HEADERS for _, h in events]
    hdrs: Mapping[str, str] = NO_HEADERS if col.head == fmt.EMPTY_HEADERS else fmt.decode_event(col.head)[1]
    return col.payloads(), [hdrs] * len(col)


class Served:
    """What :func:`read_taken` returns: the events, the damaged entries, and where the events came from."""

    __slots__ = ("damaged", "disk_reads", "entries", "events", "hits")

    def __init__(
        self,
        events: list[Event],
        entries: list[Entry],
        damaged: list[tuple[Entry, CorruptLogError]],
        hits: int,
        disk_reads: int,
    ) -> None:
        self.events = events
        self.entries = entries
        self.damaged = damaged
        self.hits = hits
        self.disk_reads = disk_reads


def read_taken(log: Log, popped: list[Entry] | Columns, cached: list[Event | None], hits: int) -> Served:
    """The Events of a take: ``cached`` ones as they are (None where the cache missed), the rest read from disk.

    ``popped``: the entries as popped (column slices, or a list); ``hits``: how
    many of them the cache held. The misses are read in one call (one pread per
    run of adjacent records, verified and decoded together, ``Log.read_events``);
    a record that no longer verifies is returned in ``damaged``, not raised.
    """
    if hits and hits == len(cached):  # every event from the cache (built as Events by take_slots)
        return Served(cast("list[Event]", cached), [], [], hits, 0)
    entries: list[Entry] = list(zip(*popped, strict=True)) if isinstance(popped, tuple) else popped
    misses = [e for e, c in zip(entries, cached, strict=True) if c is None] if cached else entries
    read = iter(log.read_events(misses))
    out: list[Event] = []
    damaged: list[tuple[Entry, CorruptLogError]] = []
    for i, e in enumerate(entries):
        c = cached[i] if cached else None
        if c is None:
            got = next(read)
            if isinstance(got, CorruptLogError):
                damaged.append((e, got))
                continue
            body, headers = got
            out.append(Event(body, headers or NO_HEADERS, e[0]))
        else:
            out.append(c)
    hits = len(entries) - len(misses)
    return Served(out, entries, damaged, hits, len(entries) - hits)


def take_runs(entries: list[Entry]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Group a transaction's takes for its commit: ``(ranges, file_runs)``.

    ``ranges``: the sorted positions as ``(first, count)`` runs (the TAKE record's
    payload); ``file_runs``: the entries as ``(file_id, first, count)`` runs of
    consecutive positions in one file (what the commit releases per file). With
    the accelerator, one C pass does both when the positions ascend, as they do
    unless a rollback returned events mid-transaction (``_speedups.take_runs``);
    these two functions are its twin.
    """
    sp = fmt.speedups
    if sp is not None and type(entries) is list:
        got = sp.take_runs(entries)
        if got is not None:
            return got  # type: ignore[no-any-return]
    return ranges(sorted(map(position_of, entries))), file_runs(entries)


def file_runs(entries: list[Entry]) -> list[tuple[int, int, int]]:
    """Group entries into ``(file_id, first_position, count)`` runs of consecutive positions in one file."""
    n = len(entries)
    if n > 1:
        p0, f0 = entries[0][0], entries[0][1]
        # The usual take: consecutive positions of one file, one run (checked with C loops).
        if (
            entries[-1][1] == f0
            and entries[-1][0] - p0 == n - 1
            and list(map(position_of, entries)) == list(range(p0, p0 + n))
            and list(map(_file_id, entries)).count(f0) == n
        ):
            return [(f0, p0, n)]
    out: list[tuple[int, int, int]] = []
    f0 = first = end = -1
    for p, f, _off, _size in entries:
        if p == end and f == f0:
            end += 1
            continue
        if end > first:
            out.append((f0, first, end - first))
        f0, first, end = f, p, p + 1
    if end > first:
        out.append((f0, first, end - first))
    return out


def ranges(positions: list[int]) -> list[tuple[int, int]]:
    """Compress sorted positions into ``(first, count)`` runs."""
    n = len(positions)
    if n > 1 and positions == list(range(positions[0], positions[0] + n)):  # the usual take: one run (C compare)
        return [(positions[0], n)]
    out: list[tuple[int, int]] = []
    first = end = -1
    for p in positions:
        if p == end:
            end += 1
            continue
        if end > first:
            out.append((first, end - first))
        first, end = p, p + 1
    if end > first:
        out.append((first, end - first))
    return out
