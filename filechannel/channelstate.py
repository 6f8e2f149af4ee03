"""The channel's in-memory state and the put and take paths that change it.

This module owns what a ``FileChannel`` and its transactions share while the
channel is open: the queue rebuilt by replay, the in-flight counts and the
capacity waits, the take cache, the committed marks, the open transactions,
the counters and the closed flag, all under one lock. Its paths are the ones
every transaction takes through that state: reserving room for puts, popping
the head for a take and serving its events (``takes``), publishing a written
commit and undoing a failed or rolled-back one. It writes nothing: the log is
the transaction's to call.

Lock order: a writer's locks (inside ``Log``) may call back into this lock
(:meth:`ChannelState.publish` runs on the writing thread); code holding this
lock never calls into ``Log``'s write path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final, cast

from . import format as fmt
from ._cache import TakeCache
from ._queue import Columns, Entry, Taken
from ._runs import RunQueue, StoredRun
from .config import ChannelConfig
from .consumers import ConsumerStore
from .errors import ChannelClosedError, ChannelFullError, CorruptLogError, TransactionCapacityError
from .events import Event
from .log import CommitResult, Log
from .retention import FileRefs
from .takes import Served, column_events, position_of, read_taken, take_slots

__all__ = ["COUNTERS", "MAX_MARKS", "ChannelState"]

MAX_MARKS: Final = 4096
"""Distinct mark keys a channel holds at most (each is re-logged before the data file holding it retires)."""

COUNTERS: Final = (
    "puts_attempted",
    "puts_committed",
    "takes_attempted",
    "takes_committed",
    "transactions_committed",
    "rollbacks",
    "commit_failures",
    "channel_full",
    "cache_hits",
    "disk_reads",
    "damaged_events_dropped",
    "acked_events_taken",
)
"""The counters :meth:`ChannelState.count` keeps (``FileChannel.stats`` reports each)."""


class ChannelState:
    """The state an open channel and its transactions share, and the paths through it.

    Every attribute is read and changed under :attr:`lock` (``closed`` and the
    counters are read without it where a stale answer is harmless).

    Args:
        directory: The channel directory (named in errors).
        config: The channel's options.
        log: The open log.
        queue: The queue replay rebuilt.
        files: What each data file still holds (replay's ``FileRefs``).
        marks: The committed marks replay found: key -> (value, woid, file id).
        consumers: The external consumers' registry.
    """

    def __init__(
        self,
        directory: str,
        config: ChannelConfig,
        log: Log,
        queue: RunQueue,
        files: FileRefs,
        marks: dict[str, tuple[bytes, int, int]],
        consumers: ConsumerStore,
    ) -> None:
        self.directory = directory
        self.config = config
        self.log = log
        self.queue = queue
        self.files = files
        self.marks = marks
        self.consumers = consumers
        self.lock = threading.Lock()
        self.not_empty = threading.Condition(self.lock)
        self.not_full = threading.Condition(self.lock)
        # Threads waiting on each condition (counted under the lock): a commit notifies only when
        # someone waits (Condition.notify is Python code, paid on every commit otherwise).
        self.put_waiters = 0
        self.take_waiters = 0
        self.closed = False
        self.inflight_puts = 0
        self.inflight_takes = 0
        self.open_txns: dict[int, Any] = {}  # txn_id -> the open Transaction
        self.cache = TakeCache(config.cache_bytes)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.on_freed: Callable[[], None] = lambda: None  # told when a commit freed a data file (retirement)

    # -- state checks -------------------------------------------------------------------

    def check_open(self) -> None:
        """Raise if the channel is closed or its log has failed.

        Raises:
            ChannelClosedError: The channel is closed.
            LogFailedError: The log failed (``Log.check_writable``).
        """
        if self.closed:
            raise ChannelClosedError(f"channel {self.directory} is closed")
        if self.log.failed is not None:
            self.log.check_writable()

    def live(self) -> bool:
        """Whether the channel is open and its log has not failed."""
        return not self.closed and self.log.failed is None

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (one of :data:`COUNTERS`)."""
        self.counters[name] += n

    def shut(self) -> None:
        """Mark the channel closed and wake every waiting put and take (they raise ``ChannelClosedError``)."""
        with self.lock:
            self.closed = True
            self.not_empty.notify_all()
            self.not_full.notify_all()

    def check_mark_room(self, keys: Mapping[str, bytes], key: str) -> None:
        """Refuse ``key`` if committing it beside a transaction's ``keys`` would pass :data:`MAX_MARKS`.

        Raises:
            TransactionCapacityError: The channel would hold more than :data:`MAX_MARKS` keys.
        """
        held = self.marks
        if key not in held and len(held) + sum(k not in held for k in keys) >= MAX_MARKS:
            raise TransactionCapacityError(f"the channel holds {MAX_MARKS} mark keys, the most it keeps")

    # -- puts -----------------------------------------------------------------------------

    def reserve_put(self, n: int = 1) -> None:
        """Count ``n`` puts in flight, waiting up to ``keep_alive`` for room under ``capacity``.

        Raises:
            ChannelFullError: No room appeared within ``keep_alive`` seconds.
            ChannelClosedError: The channel closed (or failed) while waiting.
        """
        with self.lock:
            self.counters["puts_attempted"] += n
            if len(self.queue) + self.inflight_puts + self.inflight_takes + n > self.config.capacity:
                cfg = self.config
                deadline = time.monotonic() + cfg.keep_alive
                while len(self.queue) + self.inflight_puts + self.inflight_takes + n > cfg.capacity:
                    left = deadline - time.monotonic()
                    self.check_open()  # closed while waiting: say so, not "full"
                    if left <= 0:
                        self.counters["channel_full"] += 1
                        raise ChannelFullError(
                            f"channel is full: capacity={cfg.capacity} events are queued or in flight, and no "
                            f"room appeared within keep_alive={cfg.keep_alive} s; take events or raise capacity"
                        )
                    self.put_waiters += 1
                    try:
                        self.not_full.wait(left)
                    finally:
                        self.put_waiters -= 1
                self.check_open()
            self.inflight_puts += n

    # -- takes ----------------------------------------------------------------------------

    def pop(self, taken: Taken, n: int, timeout: float) -> tuple[list[Entry] | Columns, int, list[Event | None], int]:
        """Pop up to ``n`` entries into ``taken`` (a transaction's takes), waiting up to ``timeout`` for one.

        Returns the entries as popped (column slices, or a list of entries while
        rolled-back takes are at the head), how many, their cached Events (None
        where not held; ``[]`` when the cache is empty) and how many were held.

        A deep queue's head is found by walking its data file (``_runs``): that
        walk runs first, outside the lock, so commits are not held behind it.
        """
        log = self.log
        with self.lock:
            scans = self.queue.scans_needed(n) if log.failed is None else []
        for sc in scans:
            try:
                found = log.locate_puts(sc.run.fid, sc.offset, sc.start, sc.hi, sc.want)
            except (OSError, CorruptLogError):
                break  # the pop below walks again under the lock and raises it there
            with self.lock:
                self.queue.install(sc, found)
        with self.lock:
            if self.closed or log.failed is not None:
                self.check_open()
            self.counters["takes_attempted"] += 1
            q = self.queue
            if timeout > 0 and not len(q):
                deadline = time.monotonic() + timeout
                while not len(q):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.take_waiters += 1
                    try:
                        self.not_empty.wait(left)
                    finally:
                        self.take_waiters -= 1
                    self.check_open()
            popped: list[Entry] | Columns | None = q.pop_columns(n)
            if popped is None:
                popped = q.pop(n)
                got = len(popped)
                positions: Sequence[int] = list(map(position_of, popped))
            else:
                positions = popped[0]
                got = len(positions)
            taken.add(popped, got)
            self.inflight_takes += got
            cache = self.cache
            if not cache.events:
                return popped, got, [], 0
            cached = cache.pop(positions, take_slots)
            return popped, got, cached, cache.last_hits

    def pop_below(self, taken: Taken, low: int, most: int) -> int:
        """Pop at most ``most`` queued entries below position ``low`` into ``taken``; return how many."""
        with self.lock:
            # Like pop: the entries join the transaction inside the lock (a checkpoint reads them).
            entries = self.queue.pop(min(self.queue.count_below(low), most))
            taken.add(entries)
            self.inflight_takes += len(entries)
            self.cache.pop([e[0] for e in entries])
        return len(entries)

    def count_below(self, low: int) -> int:
        """How many queued events lie below position ``low``."""
        with self.lock:
            return self.queue.count_below(low)

    def serve(self, popped: list[Entry] | Columns, cached: list[Event | None], hits: int) -> Served:
        """The Events of a take (``takes.read_taken``), counted; damaged records come back beside them."""
        got = read_taken(self.log, popped, cached, hits)
        self.counters["cache_hits"] += got.hits
        self.counters["disk_reads"] += got.disk_reads
        return got

    def requeue(self, entries: Sequence[Entry]) -> None:
        """Return taken ``entries`` to the head of the queue; the caller holds :attr:`lock`.

        The caller removes them from its transaction under the same hold, so a
        checkpoint sees each entry in the transaction or in the queue.
        """
        self.queue.push_back(entries)
        self.inflight_takes -= len(entries)
        if self.take_waiters:
            self.not_empty.notify(len(entries))

    # -- ending a transaction ---------------------------------------------------------------

    def publish(
        self,
        txn_id: int,
        res: CommitResult,
        taken: int,
        runs: Sequence[tuple[int, int, int]],
        puts: list[bytes] | fmt.PutColumn,
        bodies: list[bytes],
        headers: list[Mapping[str, str]],
        plain: bool,
        marks: Mapping[str, bytes],
    ) -> bool:
        """Make a written commit take effect: publish its puts, drop its ``taken`` takes, set its marks.

        Called on the log's writing thread, in commit order. ``runs`` are the
        takes as (file_id, first, count); ``puts`` the PUT payloads as the
        transaction held them (``plain``: without the empty header block), with
        their ``bodies`` and ``headers`` for the take cache. Returns whether a
        data file lost its last reference (so retirement may have work).
        """
        n = len(res.put_offsets)
        first = res.first_position
        fid = res.file_id
        with self.lock:
            freed = self.files.committed(fid, n, runs if taken else ())
            if n:
                sizes = res.put_sizes
                if n == 1:  # a one-event transaction: no columns to extend from
                    self.queue.append(first, fid, res.put_offsets[0], sizes[0])
                else:
                    self.queue.append_run(first, fid, res.put_offsets, sizes)
                self.inflight_puts -= n
                self.counters["puts_committed"] += n
                if type(puts) is fmt.PutColumn:  # put_arrow's column: its Python objects only if taken
                    self.cache.add_lazy(first, n, puts.nbytes, partial(column_events, puts))
                else:
                    # Headers' cost is counted from the payloads' length (the bodies plus encoded headers).
                    self.cache.add(first, bodies, headers, None if plain else sum(map(len, cast("list[bytes]", puts))))
                if self.take_waiters:
                    self.not_empty.notify(n)
            if taken:
                self.inflight_takes -= taken
                self.counters["takes_committed"] += taken
                if self.put_waiters:
                    self.not_full.notify(taken)
            if marks:
                cur_marks = self.marks
                for key, value in marks.items():
                    cur = cur_marks.get(key)
                    if cur is None or cur[1] < res.woid:
                        cur_marks[key] = (value, res.woid, fid)
            self.open_txns.pop(txn_id, None)
        return freed

    def undo(self, txn_id: int, n_puts: int, taken: Taken) -> None:
        """Forget an ended transaction's ``n_puts`` reserved puts and return its ``taken`` takes to the head."""
        with self.lock:
            self.open_txns.pop(txn_id, None)
            self.inflight_puts -= n_puts
            if taken:
                self.queue.push_back(taken)
                self.inflight_takes -= len(taken)
                if self.take_waiters:
                    self.not_empty.notify(len(taken))
            if n_puts and self.put_waiters:
                self.not_full.notify(n_puts)

    # -- what others read -----------------------------------------------------------------

    def capture(
        self, files: dict[int, int], in_flight: list[Entry]
    ) -> tuple[
        tuple[list[StoredRun], list[Entry], list[int]],
        dict[int, list[tuple[int, int]]],
        list[tuple[str, bytes, int, int]],
    ]:
        """What a checkpoint holds (under the lock, writers held): see ``checkpointer.Capture``.

        ``in_flight``: the entries open transactions have taken (they are queued again on a restart).
        """
        queue = self.queue.stored(in_flight)  # O(runs): the queue's runs, not its events
        taken = {f: list(r) for f, r in self.files.taken_from.items() if f in files}
        marks = [(k, v, w, f) for k, (v, w, f) in sorted(self.marks.items())]
        return queue, taken, marks

    def snapshot(self, registry: Mapping[str, Any], channel: Mapping[str, Any]) -> dict[str, Any]:
        """The counters and the queue's numbers for ``stats()``, read together under the lock.

        ``registry``: the external consumers (name -> ``Consumer``), each reported with its lag;
        ``channel``: the channel's own keys, placed before ``open_transactions``.
        """
        log = self.log
        with self.lock:
            q = self.queue
            consumers: dict[str, Any] = {}
            for name, c in registry.items():
                first = q.first_file_at_or_after(c.acked)
                consumers[name] = {
                    "acked": c.acked,
                    "lag_events": len(q) - q.count_below(c.acked),
                    "identity": c.identity,
                    "oldest_file": None if first is None else log.file_path(first[1]),
                }
            out: dict[str, Any] = dict(self.counters)
            out.update(
                queue_size=len(q),
                inflight_puts=self.inflight_puts,
                inflight_takes=self.inflight_takes,
                capacity=self.config.capacity,
                next_position=log.next_position,
                head_position=q.first_position(),
                cache_events=len(self.cache),
                cache_bytes=self.cache.nbytes,
                queue_memory_bytes=q.memory_bytes(),
                **channel,
                open_transactions=len(self.open_txns),
                consumers=consumers,
            )
        return out
