"""FileChannel and Transaction: the transactional queue built on the log.

This module owns the channel's semantics: transactions and their state table,
capacity and waiting, the in-memory queue rebuilt by replaying the log,
publishing each commit (the queue, the take cache, the marks) and the
``on_corruption`` policy at take. It never performs I/O itself: every byte
goes through ``Log``. Its background jobs live in rooms of their own:
checkpoints (``checkpointer``), acknowledgement polling (``acks``), the
retirement of data files nothing needs any more (``retention``) and serving
takes from the cache or from disk (``takes``). ``Event`` lives in ``events``
and is re-exported here (pickles made before naming ``filechannel.channel``
still load).

Lock order: a writer's locks (inside ``Log``) may call back into the channel
lock; code holding the channel lock never calls into ``Log``'s write path.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from functools import partial
from types import TracebackType
from typing import Any, Final, cast

from . import format as fmt
from ._cache import TakeCache
from ._fs import DEFAULT_FS, FS
from ._queue import Columns, Entry, Taken
from ._runs import RunQueue, StoredRun
from .acks import AckPoller, keep_acknowledged_positions
from .checkpoint import CHECKPOINT_DIR, CheckpointStore
from .checkpointer import Checkpointer
from .config import ChannelConfig
from .consumers import ConsumerStore
from .errors import (
    ChannelClosedError,
    ChannelError,
    ChannelFullError,
    ConfigError,
    ConsumerConflictError,
    CorruptLogError,
    EventTooLargeError,
    InvalidEventError,
    TransactionCapacityError,
    TransactionStateError,
)
from .events import (
    NO_HEADERS,
    Event,
    as_body,
    bad_header_text,
    check_headers,
    coerce_event,
)
from .events import no_headers as _no_headers  # noqa: F401 - named by pickles of Events made before events.py
from .log import CommitResult, CorruptionReport, Log, merge_ranges
from .permissions import fs_for
from .replay import replay_queue, spot_check
from .retention import FileRefs, Retirer
from .stats import ChannelStats
from .takes import column_events, position_of, read_taken, take_runs, take_slots

__all__ = ["MAX_MARKS", "Event", "FileChannel", "Transaction", "open_channel"]

MAX_MARKS: Final = 4096
"""Distinct mark keys a channel holds at most (each is re-logged before the data file holding it retires)."""
_ACK_CHUNK = 1_000_000  # most events one take-only commit of acknowledgements holds

logger = logging.getLogger(__name__)


_PLAIN_PREFIX_LEN = len(fmt.EMPTY_HEADERS)


# -- transaction states, as a table ------------------------------------------------

OPEN = "open"
COMMITTED = "committed"
ROLLED_BACK = "rolled back"
FAILED = "failed"

_TRANSITIONS: dict[tuple[str, str], str] = {
    (OPEN, "put"): OPEN,
    (OPEN, "take"): OPEN,
    (OPEN, "commit"): COMMITTED,
    (OPEN, "rollback"): ROLLED_BACK,
    (OPEN, "fail"): FAILED,
    # A failed commit already undid the transaction; rolling it back is a no-op,
    # so ``except: tx.rollback()`` is always safe.
    (FAILED, "rollback"): FAILED,
    (ROLLED_BACK, "rollback"): ROLLED_BACK,
}


_BYTES_ONLY = frozenset({bytes})


class Transaction:
    """One unit of puts and takes that commits or rolls back as a whole.

    Get one from :meth:`FileChannel.transaction`. Used as a context manager it
    commits on normal exit and rolls back on any exception. A transaction
    belongs to one thread at a time.
    """

    def __init__(self, channel: FileChannel) -> None:
        self._ch = channel
        self._log = channel._log
        self.txn_id = channel._log.new_txn_id()
        self.state = OPEN
        # Each put's PUT payload; while ``_plain`` (no put so far had headers) without the empty
        # header block every one of them begins with, which the commit passes once as a prefix.
        # A transaction whose puts all came from put_arrow (without headers) holds them as a
        # format.PutColumn instead (_bodies and _headers stay empty): see put_arrow.
        self._payloads: list[bytes] | fmt.PutColumn = []
        self._plain = True
        self._bodies: list[bytes] = []
        self._headers: list[Mapping[str, str]] = []
        self._taken = Taken()
        self._runs: list[tuple[int, int, int]] = []  # _taken as (file_id, first, count) runs, set at commit
        self._freed = False
        self._marks: dict[str, bytes] = {}
        self._dir = self._log.writer_for(self.txn_id)
        channel._open_txns[self.txn_id] = self

    def _advance(self, op: str) -> None:
        try:
            self.state = _TRANSITIONS[(self.state, op)]
        except KeyError:
            raise TransactionStateError(f"cannot {op}: the transaction is {self.state}") from None

    # -- puts -----------------------------------------------------------------------

    def put(self, body: bytes | bytearray | memoryview | Event, headers: Mapping[str, str] | None = None) -> None:
        """Add an event; it becomes visible to takers when this transaction commits.

        Args:
            body: The event body (bytes-like), or an :class:`Event`.
            headers: String keys and values (not allowed with an Event).

        Raises:
            TypeError: The body is not bytes-like, or a header is not str.
            EventTooLargeError: The event is larger than ``max_event_size`` (a ``ValueError``).
            InvalidEventError: A header key or value is not valid UTF-8 text (a ``ValueError``).
            TransactionCapacityError: More than ``transaction_capacity`` puts.
            ChannelFullError: The channel stayed full (``capacity``, ``max_bytes``) for ``keep_alive`` seconds.
            DiskSpaceError: Free space stayed under ``minimum_required_space`` for ``keep_alive`` seconds.
            TransactionStateError: The transaction is no longer open.
            ChannelClosedError: The channel is closed or has failed.
        """
        if type(body) is not bytes:
            body, headers = coerce_event(body, headers)
        hdrs = check_headers(headers) if headers else NO_HEADERS
        if hdrs:
            try:
                payload = fmt.encode_event(body, hdrs)
            except UnicodeEncodeError as exc:
                raise bad_header_text(hdrs) from exc
            size = len(payload)
        else:
            payload = body
            size = len(body) + _PLAIN_PREFIX_LEN
        ch = self._ch
        cfg = ch.config
        if size > cfg.max_event_size:
            raise EventTooLargeError(size, cfg.max_event_size)
        if self.state is not OPEN:
            self._advance("put")
        if len(self._payloads) >= cfg.transaction_capacity:
            raise TransactionCapacityError(
                f"more than transaction_capacity={cfg.transaction_capacity} puts in one transaction; "
                "commit smaller batches or raise transaction_capacity"
            )
        if ch._closed or self._log.failed is not None:
            ch._check_open()
        if not self._payloads:
            # Room (free space, max_bytes) is checked at the first put and again at commit,
            # before anything is written (puts write nothing; the check costs ~0.5 us).
            self._log.wait_for_room(self._dir)
        ch._reserve_put()
        payloads = self._payloads
        if type(payloads) is not list:
            payloads = self._delist()
        if hdrs and self._plain:
            payloads = self._unplain()
        payloads.append(payload if self._plain or hdrs else fmt.EMPTY_HEADERS + payload)
        self._bodies.append(body)
        self._headers.append(hdrs)

    def _unplain(self) -> list[bytes]:
        """A put with headers joins: from now on ``_payloads`` hold whole PUT payloads (returned)."""
        self._payloads = out = [fmt.EMPTY_HEADERS + p for p in self._payloads]
        self._plain = False
        return out

    def _delist(self) -> list[bytes]:
        """Another kind of put joins put_arrow's column: from now on the puts are lists (returned)."""
        col = self._payloads
        assert type(col) is fmt.PutColumn
        bodies, headers = column_events(col)
        if col.head == fmt.EMPTY_HEADERS:
            self._payloads = out = bodies  # plain events: each payload is the body
            self._bodies = list(out)
        else:
            self._payloads = out = col.payloads() if not col.head else [col.head + b for b in bodies]
            self._plain = False
            self._bodies = bodies
        self._headers = headers
        return out

    def put_many(
        self, bodies: Iterable[bytes | bytearray | memoryview], headers: Mapping[str, str] | None = None
    ) -> None:
        """Add several events that share ``headers``: all of them, or none.

        The same as calling :meth:`put` for each body, with the checks and the
        capacity reservation done once for the batch (the fast way to put many
        small events).

        Args:
            bodies: Event bodies (bytes-like).
            headers: String keys and values given to every event.

        Raises:
            TypeError: A body is not bytes-like, or a header is not str.
            EventTooLargeError: An event is larger than ``max_event_size`` (a ``ValueError``).
            InvalidEventError: A header key or value is not valid UTF-8 text (a ``ValueError``).
            TransactionCapacityError: The transaction would hold more than ``transaction_capacity`` puts.
            ChannelFullError: No room for all of them appeared within ``keep_alive`` seconds.
            DiskSpaceError: Free space stayed under ``minimum_required_space`` for ``keep_alive`` seconds.
            TransactionStateError: The transaction is no longer open.
            ChannelClosedError: The channel is closed or has failed.
        """
        if type(bodies) is list and len(bodies) == 1 and headers is None and type(bodies[0]) is bytes:
            self.put(bodies[0])  # one event (a producer committing each one): put's shorter path
            return
        given = list(bodies)
        # All bytes (checked in C), or each body made bytes or refused, in order.
        bl = [as_body(b) for b in given] if set(map(type, given)) - _BYTES_ONLY else cast("list[bytes]", given)
        hdrs = check_headers(headers) if headers else NO_HEADERS
        if hdrs:
            try:
                payloads = [fmt.encode_event(b, hdrs) for b in bl]
            except UnicodeEncodeError as exc:
                raise bad_header_text(hdrs) from exc
            big = max(map(len, payloads), default=0)
        else:
            payloads = bl  # framed behind the empty header block (see _plain)
            big = max(map(len, bl), default=0) + _PLAIN_PREFIX_LEN
        n = len(payloads)
        if not self._check_puts(n, big):
            return
        mine = self._payloads
        if type(mine) is not list:
            mine = self._delist()
        if hdrs:
            if self._plain:
                mine = self._unplain()
        elif not self._plain:
            payloads = list(map(fmt.EMPTY_HEADERS.__add__, bl))
        mine += payloads
        self._bodies += bl
        self._headers += [hdrs] * n

    # -- takes ----------------------------------------------------------------------

    def mark(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Set the mark ``key`` to ``value`` when this transaction commits, atomically with its events.

        After the commit (and after any restart), :meth:`FileChannel.mark`
        returns ``value`` until a later transaction marks ``key`` again; a
        rollback, or a crash before the commit is durable, leaves the previous
        value. Marking a key twice in one transaction keeps the last value. A
        transaction may commit marks alone (no puts or takes).

        Args:
            key: 1 to 128 bytes of UTF-8 text without control characters
                (e.g. ``"producer:web-1"``).
            value: At most 1024 bytes (e.g. a sequence number or a file offset).

        Raises:
            TypeError: The key is not a str or the value is not bytes-like.
            InvalidEventError: The key or value is out of those bounds (a ``ValueError``).
            TransactionCapacityError: More than 64 keys in one transaction, or a new
                key past the channel's 4096.
            TransactionStateError: The transaction is no longer open.
        """
        try:
            key, v = fmt.check_mark(key, value)
        except ValueError as exc:
            raise InvalidEventError(str(exc)) from None
        if self.state is not OPEN:
            self._advance("put")
        if key not in self._marks:
            if len(self._marks) >= fmt.MAX_MARKS_PER_RECORD:
                raise TransactionCapacityError(
                    f"more than {fmt.MAX_MARKS_PER_RECORD} mark keys in one transaction; commit them in several"
                )
            ch = self._ch
            if key not in ch._marks and len(ch._marks) + sum(k not in ch._marks for k in self._marks) >= MAX_MARKS:
                raise TransactionCapacityError(f"the channel holds {MAX_MARKS} mark keys, the most it keeps")
        self._marks[key] = v

    def take(self, timeout: float = 0.0) -> Event | None:
        """Take the event at the head of the queue, or None if there is none.

        Args:
            timeout: Seconds to wait for an event when the queue is empty.

        Raises:
            TransactionCapacityError: More than ``transaction_capacity`` takes.
            TransactionStateError: The transaction is no longer open.
            ChannelClosedError: The channel is closed.
            ConsumerConflictError: External consumers are registered on the channel.
            CorruptLogError: The event's record no longer verifies on disk.
        """
        evs = self.take_batch(1, timeout)
        return evs[0] if evs else None

    def take_batch(self, max_events: int, timeout: float = 0.0) -> list[Event]:
        """Take up to ``max_events`` events from the head, possibly fewer (only when fewer are queued).

        Args:
            max_events: The most events to take. Like :meth:`put_many`, a request
                that would take the transaction past ``transaction_capacity`` is
                refused whole: it is never cut short silently.
            timeout: Seconds to wait while the queue is empty.

        Raises:
            ValueError: ``max_events`` is not a positive int.
            TransactionCapacityError: The transaction's takes plus ``max_events``
                exceed ``transaction_capacity`` (nothing is taken).
            TransactionStateError: The transaction is no longer open.
            ChannelClosedError: The channel is closed.
            ConsumerConflictError: External consumers are registered on the channel
                (they read through ``ChannelReader``; in-process takes would remove
                events they have not read).
            CorruptLogError: An event's record no longer verifies on disk, or a
                consumer's ``.ack`` file does not decode.
        """
        if (type(max_events) is not int or max_events <= 0) and (
            not isinstance(max_events, int) or isinstance(max_events, bool) or max_events <= 0
        ):
            raise ValueError(f"max_events must be a positive int, got {max_events!r}")
        if self.state is not OPEN:
            self._advance("take")
        consumers = self._ch._consumers.cached_list()  # one access() while no consumer was ever registered
        if consumers:
            raise ConsumerConflictError(self._ch.directory, sorted(consumers))
        cap = self._ch.config.transaction_capacity
        room = cap - self._taken.count
        if max_events > room:
            held = f" (it holds {self._taken.count} takes already)" if self._taken.count else ""
            raise TransactionCapacityError(
                f"take_batch({max_events}) would exceed transaction_capacity={cap} takes in one transaction"
                f"{held}; take at most {max(room, 0)}, commit smaller batches, or raise transaction_capacity"
            )
        # The entries join self._taken inside the channel lock (a checkpoint reads them);
        # if loading fails they stay with the transaction, and a rollback returns them.
        want = min(max_events, room)
        popped, n, cached, hits = self._ch._pop(self, want, timeout)
        out = self._ch._load(self, popped, n, cached, hits)
        if len(out) < n:
            # on_corruption="skip" dropped damaged events: take more in their place, so a
            # short or empty answer still means the queue had no more (within the timeout).
            deadline = time.monotonic() + timeout
            while n and len(out) < want:
                popped, n, cached, hits = self._ch._pop(self, want - len(out), max(0.0, deadline - time.monotonic()))
                out += self._ch._load(self, popped, n, cached, hits)
        return out

    # -- ending -------------------------------------------------------------------------

    def commit(self) -> None:
        """Make the puts visible and the takes permanent, durably (per ``fsync``).

        Raises:
            OSError: Writing or syncing failed; the transaction is undone.
            ChannelFullError: Puts only: the data files stayed at ``max_bytes``, or
                (``DiskSpaceError``) free space stayed under ``minimum_required_space``
                plus what the commit writes, for ``keep_alive`` seconds; nothing was
                written and the transaction stays open. Or the write itself ran out
                of space (``DiskSpaceError``, ``reason="disk_full"``): it was cut
                back and the transaction is undone; the channel goes on.
            TransactionStateError: The transaction is no longer open.
            ChannelClosedError: The channel is closed or has failed.
        """
        if self.state is not OPEN:
            self._advance("commit")
        ch = self._ch
        if not self._payloads and not self._taken.count and not self._marks:
            self._advance("commit")
            ch._count("transactions_committed")
            ch._open_txns.pop(self.txn_id, None)
            return
        if self._payloads:
            self._log.wait_for_room(self._dir, self._payloads)
        takes: list[tuple[int, int]] = []
        if self._taken.count:
            run = self._taken.one_run()
            if run is not None:  # the usual take: one run of consecutive positions in one file
                takes, self._runs = [(run[1], run[2])], [run]
            else:
                takes, self._runs = take_runs(self._taken.entries())
        try:
            puts = self._payloads
            prefix = puts.head if type(puts) is fmt.PutColumn else fmt.EMPTY_HEADERS if self._plain else b""
            marks = [fmt.encode_marks([fmt.Mark(k, v) for k, v in self._marks.items()])] if self._marks else ()
            self._log.commit(self.txn_id, self._payloads, takes, self._on_written, prefix, marks)
        except BaseException:
            self._advance("fail")
            ch._undo(self, len(self._payloads), self._taken)
            ch._count("commit_failures")
            raise
        self._advance("commit")
        ch._count("transactions_committed")
        if self._freed:
            ch._want_gc()
        self._payloads = []
        self._plain = True
        self._bodies = []
        self._headers = []
        self._taken = Taken()
        self._marks = {}

    def _on_written(self, res: CommitResult) -> None:
        # Runs on the writing thread, in commit order, once the records are durable
        # (written, with fsync="interval"): the commit takes effect here.
        self._freed = self._ch._apply(self, res)

    def rollback(self) -> None:
        """Undo the transaction: drop its puts, return its takes to the head of the queue.

        Raises:
            TransactionStateError: The transaction already committed.
        """
        was = self.state
        self._advance("rollback")
        if was is not OPEN:
            return
        n_puts, n_takes = len(self._payloads), len(self._taken)
        self._ch._undo(self, n_puts, self._taken)
        self._ch._count("rollbacks")
        if n_puts or n_takes:
            self._log.rollback(self.txn_id, n_puts, n_takes)
        self._payloads = []
        self._plain = True
        self._bodies = []
        self._headers = []
        self._taken = Taken()
        self._marks = {}

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            if self.state is OPEN:
                self.commit()
        elif self.state is OPEN:
            self.rollback()

    def __repr__(self) -> str:
        return (
            f"<Transaction {self.txn_id} {self.state}: {len(self._payloads)} puts, {len(self._taken)} takes, "
            f"{len(self._marks)} marks>"
        )

    def put_arrow(self, data: Any) -> int:
        """Add each row of Arrow ``data`` as an event: all of them, or none. Returns how many.

        ``data``: a ``pyarrow.RecordBatch`` or ``Table`` with a binary (or
        string) ``body`` column and optionally ``headers``, a
        ``map<string, string>`` column (a null map is no headers; a repeated key
        keeps its last value, as in a dict); or a binary ``Array`` /
        ``ChunkedArray`` of bodies. A ``position`` column (as
        ``ChannelReader.read_arrow`` returns) is ignored. Otherwise the same as
        :meth:`put_many`. Needs pyarrow.

        Rows without headers, in a transaction that has no other kind of put,
        are held as one column (the bodies copied into one buffer, one C call
        per chunk) and framed at commit from that buffer, with no Python object
        per event (``format.PutColumn``); the take cache makes the events'
        objects only if a take reaches them. Otherwise the payloads are made
        from the Arrow buffers in one C call per chunk (``filechannel.arrow``).

        Raises:
            TypeError: ``data`` is not Arrow data, or a column has the wrong type.
            InvalidEventError: A null body or header value, a header that is not UTF-8,
                no ``body`` column or an unknown column (a ``ValueError``).
            EventTooLargeError, TransactionCapacityError, ChannelFullError, DiskSpaceError,
            TransactionStateError, ChannelClosedError: As for :meth:`put_many`.
        """
        from .arrow import prepare_column, prepare_puts

        cur = self._payloads
        plain_column = type(cur) is fmt.PutColumn and cur.head == fmt.EMPTY_HEADERS
        got = prepare_column(data) if not cur or plain_column else data
        if isinstance(got, tuple):
            return self._put_column(*got)
        payloads, bodies, headers, any_headers = prepare_puts(got, NO_HEADERS)
        n = self._check_puts(
            len(payloads), max(map(len, payloads), default=0) + (0 if any_headers else _PLAIN_PREFIX_LEN)
        )
        if not n:
            return 0
        mine = self._payloads
        if type(mine) is not list:
            mine = self._delist()
        if any_headers:
            if self._plain:
                mine = self._unplain()
        elif not self._plain:
            payloads = list(map(fmt.EMPTY_HEADERS.__add__, bodies))
        if mine:
            mine += payloads
            self._bodies += bodies
            self._headers += headers
        else:  # the first puts: the lists prepare_puts made (each a new list) become the transaction's
            self._payloads, self._bodies, self._headers = payloads, bodies, headers
        return n

    def _put_column(self, col: fmt.PutColumn, longest: int) -> int:
        """Add a column's events (see put_arrow; ``longest``: its longest body); returns how many.

        Joins a column with the same ``head`` already held; otherwise the puts become lists.
        """
        n = self._check_puts(len(col), longest + len(col.head))
        if n:
            cur = self._payloads
            if not cur:
                self._payloads, self._plain = col, True
            elif type(cur) is fmt.PutColumn and cur.head == col.head:
                for chunk in col.chunks:
                    cur.add(*chunk)
            else:
                mine = cur if type(cur) is list else self._delist()
                bodies, headers = column_events(col)
                if col.head == fmt.EMPTY_HEADERS and self._plain:
                    mine += bodies
                else:
                    if self._plain:
                        mine = self._unplain()
                    mine += col.payloads() if not col.head else [col.head + b for b in bodies]
                self._bodies += bodies
                self._headers += headers
        return n

    def _check_puts(self, n: int, big: int) -> int:
        """The checks of ``n`` puts, the largest ``big`` bytes, then their reservation; returns ``n``.

        ``put_many`` and ``put_arrow`` both pass through here.
        """
        ch = self._ch
        cfg = ch.config
        if n and big > cfg.max_event_size:
            raise EventTooLargeError(big, cfg.max_event_size)
        if self.state is not OPEN:
            self._advance("put")
        if not n:
            return 0
        if len(self._payloads) + n > cfg.transaction_capacity:
            raise TransactionCapacityError(
                f"{len(self._payloads) + n} puts exceed transaction_capacity={cfg.transaction_capacity} in one "
                "transaction; commit smaller batches or raise transaction_capacity"
            )
        if ch._closed or self._log.failed is not None:
            ch._check_open()
        if not self._payloads:
            self._log.wait_for_room(self._dir)
        ch._reserve_put(n)
        return n


class FileChannel:
    """A durable, transactional FIFO of events in a directory.

    Open one with :func:`filechannel.open`. See the README for semantics.

    Its background jobs live in rooms of their own: checkpoints in
    ``checkpointer.Checkpointer``, acknowledgement polling in
    ``acks.AckPoller``, retirement in ``retention.Retirer`` and reading taken
    events from disk in ``takes``.

    Args:
        directory: The channel directory (created if missing).
        config: The channel's options.
        fs: The I/O seam (tests pass a simulated file system).
        background: Retire data files on a background thread (default); when
            False, retirement runs inline after the take commit that allows it.

    Raises:
        ChannelLockedError: The directory is already open.
        CorruptLogError: Acknowledged data is damaged (see ``on_corruption``).
        NotAChannelError: The directory is not a channel directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: ChannelConfig | None = None,
        *,
        fs: FS | None = None,
        background: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.config = config or ChannelConfig()
        self._progress = progress  # told which file recovery reads (the CLI on a terminal)
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        # Threads waiting on each condition (counted under the lock): a commit notifies only when
        # someone waits (Condition.notify is Python code, paid on every commit otherwise).
        self._put_waiters = 0
        self._take_waiters = 0
        self._closed = False
        self._inflight_puts = 0
        self._inflight_takes = 0
        self._open_txns: dict[int, Transaction] = {}
        # The committed marks: key -> (value, woid of the COMMIT that set it, file holding its newest copy).
        self._marks: dict[str, tuple[bytes, int, int]] = {}
        self._cache = TakeCache(self.config.cache_bytes)
        self._counters: dict[str, int] = dict.fromkeys(
            (
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
            ),
            0,
        )
        t0 = time.monotonic()
        self._fs = fs_for(fs or DEFAULT_FS, self.config.permissions)
        self._store = CheckpointStore(
            self._fs, os.path.join(self.directory, CHECKPOINT_DIR), self.config.backup_checkpoint_dir
        )
        self._consumers = ConsumerStore(self._fs, self.directory, self.config.permissions)
        self._log, self._queue, refs = self._recover()
        log = self._log
        self._retirer = Retirer(log, self._lock, refs, self._marks, lambda: self._closed, background)
        self._files = refs
        self._checkpointer = Checkpointer(
            log, self._store, self.config, self._lock, self._capture, lambda: self._closed
        )
        self._ckpt_lock = self._checkpointer.lock
        self._ckpt_stop = self._checkpointer.stop
        self._acks = AckPoller(self._consumers, self.config.ack_interval, self._take_below, self._live)
        if log.meta_mac is not None:
            self._consumers.mac = log.meta_mac
            self._consumers.seen, self._consumers.owner = log.consumer_acks, True  # older acks refused
            self._consumers.required = log.macs_required and not log.sealing_started
            try:
                self._consumers.seal_all()
            except CorruptLogError as exc:  # refused acks pin the queue (see AckPoller.apply); the open goes on
                logger.error("consumer acknowledgements not resealed: %s", exc)
            self._consumers.required = log.macs_required
        self.replay_seconds = time.monotonic() - t0
        used = log.recovered_from
        self._store.note_open(
            {
                "time": time.time(),
                "source": self.recovery_source,
                "checkpoint": used.path if used else None,
                "checkpoint_woid": used.woid if used else None,
                "fallbacks": self.checkpoint_fallbacks,
                "replay_seconds": round(self.replay_seconds, 6),
                "queued": len(self._queue),
            }
        )
        try:
            keep_acknowledged_positions(self._consumers, log)
            # Acknowledgements written while no owner ran take effect now.
            self._acks.apply(strict=False)
        except BaseException:
            log.close()
            raise
        if background:
            self._checkpointer.start()
            self._acks.start()
        logger.info(
            "opened %s: %d events queued, replay took %.3f s", self.directory, len(self._queue), self.replay_seconds
        )

    def _recover(self) -> tuple[Log, RunQueue, FileRefs]:
        """Open the log from the newest usable checkpoint and rebuild the queue.

        A checkpoint that decodes is trusted: data that disagrees with it is
        damaged data, handled by ``on_corruption`` like any other damage, never
        a reason to fall back to an older view that knows less.
        """
        log = Log(self.directory, self.config, fs=self._fs, checkpoints=self._store, progress=self._progress)
        base = log.base_snapshot
        unreplayed = set(base.files) if base is not None else set()
        try:
            q, take_targets, taken_from = replay_queue(log, base, self._marks)
            if log.recovered_from is not None and self.config.on_corruption != "skip":
                spot_check(log, q)
        except BaseException:
            log.close()
            raise
        self.checkpoint_fallbacks = list(log.checkpoint_fallbacks)
        if log.recovered_from is None:
            self.recovery_source = "full"
        elif self.checkpoint_fallbacks:
            self.recovery_source = "backup"
        else:
            self.recovery_source = "checkpoint"
        return log, q, FileRefs(q.file_counts(), take_targets, taken_from, unreplayed)

    # -- public API -----------------------------------------------------------------------

    def transaction(self) -> Transaction:
        """Begin a transaction.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._check_open()
        return Transaction(self)

    def marks(self) -> dict[str, bytes]:
        """The committed marks (:meth:`Transaction.mark`): each key's last committed value.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._check_open()
        with self._lock:
            return {k: v[0] for k, v in self._marks.items()}

    def mark(self, key: str) -> bytes | None:
        """The last committed value of mark ``key`` (:meth:`Transaction.mark`), or None.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._check_open()
        with self._lock:
            m = self._marks.get(key)
        return None if m is None else m[0]

    @property
    def size(self) -> int:
        """Committed events waiting in the queue (not counting those taken by open transactions)."""
        return len(self._queue)

    def __len__(self) -> int:
        """The number of queued events: :attr:`size`, ``stats()["queue_size"]``."""
        return len(self._queue)

    def __bool__(self) -> bool:
        """Always true, like any open or closed channel object: ``len()`` is the queue, not the truth."""
        return True

    @property
    def data_dirs(self) -> list[str]:
        """The channel's data directories, in the order of the ``data_dirs`` option (``DIR/data`` by default)."""
        return list(self._log.data_dirs)

    def stats(self) -> ChannelStats:
        """Return counters: puts, takes, commits, rollbacks, fsyncs, bytes, files, and more.

        Every key is typed in :class:`filechannel.stats.ChannelStats` and described
        in docs/stats.md.

        ``consumers`` maps each registered external consumer to its ``acked``
        position, ``lag_events`` (queued events at or after it), ``identity`` and
        ``oldest_file`` (the data file holding its oldest unacknowledged queued
        event, which it keeps from retiring; None when it has none);
        ``consumers_problem`` says why the registry could not be read, or is None.
        """
        try:
            registry = self._consumers.cached_list()
            problem = None
        except CorruptLogError as exc:
            registry, problem = {}, str(exc)
        with self._lock:
            q = self._queue
            consumers: dict[str, Any] = {}
            for name, c in registry.items():
                first = q.first_file_at_or_after(c.acked)
                consumers[name] = {
                    "acked": c.acked,
                    "lag_events": len(q) - q.count_below(c.acked),
                    "identity": c.identity,
                    "oldest_file": None if first is None else self._log.file_path(first[1]),
                }
            out: dict[str, Any] = dict(self._counters)
            out.update(
                queue_size=len(self._queue),
                inflight_puts=self._inflight_puts,
                inflight_takes=self._inflight_takes,
                capacity=self.config.capacity,
                next_position=self._log.next_position,
                head_position=self._queue.first_position(),
                cache_events=len(self._cache),
                cache_bytes=self._cache.nbytes,
                queue_memory_bytes=self._queue.memory_bytes(),
                replay_seconds=round(self.replay_seconds, 6),
                failed=self._log.failed is not None,
                recovery_source=self.recovery_source,
                accelerator=fmt.accelerator(),
                checkpoint_fallbacks=len(self.checkpoint_fallbacks),
                key_ids_in_use=self._log.key_ids_in_use(),
                open_transactions=len(self._open_txns),
                consumers=consumers,
                consumers_problem=problem,
            )
            out.update(self._checkpointer.stats)
        out.update(self._log.stats())
        reports = list(self._log.corruption)
        out["lost_positions"] = [list(r) for r in merge_ranges([r for rep in reports for r in rep.lost_positions])]
        out["corruption_report"] = [r.describe() for r in reports]
        return cast("ChannelStats", out)

    def sync(self) -> None:
        """Make every commit so far durable now (useful with ``fsync="interval"``).

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._check_open()
        self._log.sync()

    def retire_files(self) -> int:
        """Delete data files that no queued or in-flight event needs; return how many.

        Runs on its own after take commits; call it to force the work now.
        Before a file goes, the takes it recorded of events in files that stay
        are written again (durably) into the active file, so neither a replay
        from a checkpoint nor a full replay can bring those events back.
        """
        return self._retirer.retire_files()

    def _relog_marks(self, marks: list[fmt.Mark]) -> None:
        """Commit MARK records repeating ``marks`` with their woids (what a retirement does; see ``Retirer``)."""
        self._retirer.relog_marks(marks)

    def apply_acks(self) -> int:
        """Turn the external consumers' acknowledgements into committed takes now.

        When consumers are registered (``DIR/consumers``, see ``ChannelReader``),
        every queued event below the lowest acknowledged position is taken in a
        take-only commit (not limited by ``transaction_capacity``), durable per
        the ``fsync`` policy, and data files then retire as after any take. The
        channel does this on its own at open, every ``ack_interval`` seconds and
        on close.

        Returns:
            How many events were taken.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
            CorruptLogError: A consumer's ``.ack`` file does not decode (nothing is taken).
            OSError: The commit failed; the events stay queued.
        """
        self._check_open()
        return self._acks.apply(strict=True)

    def _take_below(self, low: int) -> int:
        """Take every queued event below position ``low`` in take-only commits; return how many (AckPoller's take)."""
        total = 0
        while True:
            with self._lock:
                if not self._queue.count_below(low):
                    return total
            tx = Transaction(self)
            with self._lock:
                # Like _pop: the entries join the transaction inside the lock (a checkpoint reads them).
                entries = self._queue.pop(min(self._queue.count_below(low), _ACK_CHUNK))
                tx._taken.add(entries)
                self._inflight_takes += len(entries)
                self._cache.pop([e[0] for e in entries])
            tx.commit()  # a failure returns the entries to the queue and raises
            total += len(entries)
            self._count("acked_events_taken", len(entries))

    def _live(self) -> bool:
        return not self._closed and self._log.failed is None

    def checkpoint(self) -> dict[str, Any]:
        """Write a checkpoint now, so the next open replays only what follows it.

        Transactions keep running while it is written: while writers are held
        still, the queue's columns are lent to the checkpoint (not copied), and
        they are encoded and written to disk after, in blocks.

        Returns:
            What was written: ``woid``, ``events``, ``bytes``, ``seconds``, ``path``.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
            OSError: Writing the checkpoint failed (the previous ones are untouched).
        """
        return self._checkpointer.checkpoint(self._check_open)

    def _write_checkpoint(self, paced: bool = False) -> dict[str, Any]:
        """Write a checkpoint (the caller holds ``_ckpt_lock``); see ``Checkpointer.write``."""
        return self._checkpointer.write(paced)

    def _capture(
        self, files: dict[int, int]
    ) -> tuple[
        tuple[list[StoredRun], list[Entry], list[int]],
        dict[int, list[tuple[int, int]]],
        list[tuple[str, bytes, int, int]],
    ]:
        """What a checkpoint holds (under the lock, writers held): see ``checkpointer.Capture``."""
        extra = [e for tx in self._open_txns.values() for e in tx._taken]
        queue = self._queue.stored(extra)  # O(runs): the queue's runs, not its events
        taken = {f: list(r) for f, r in self._files.taken_from.items() if f in files}
        marks = [(k, v, w, f) for k, (v, w, f) in sorted(self._marks.items())]
        return queue, taken, marks

    def close(self) -> None:
        """Make everything durable and release the directory. Idempotent.

        Open transactions are abandoned: their puts are dropped, their takes
        return to the queue on the next open.
        """
        self._acks.signal_stop()
        self._checkpointer.halt()
        self._acks.join()
        with self._ckpt_lock:
            if self._closed:
                return
            if self._log.failed is None:
                try:
                    self._acks.apply(strict=False)
                except (OSError, ChannelError) as exc:
                    logger.warning("applying consumer acknowledgements on close failed (%s); the next open does", exc)
                # An open that only took events wrote its takes into files that hold no event: no take
                # freed a file, so nothing asked for a retirement. They go now (their takes re-logged
                # first, durably), before the checkpoint, which then no longer lists them.
                try:
                    self._retirer.retire_files()
                except (OSError, ChannelError) as exc:
                    logger.warning("retiring data files on close failed (%s); the next close tries again", exc)
            unchanged = self._checkpointer.unchanged() and not self._open_txns
            if self._log.failed is None and not unchanged:
                try:
                    self._checkpointer.write()
                except (OSError, ChannelClosedError) as exc:
                    logger.warning("checkpoint on close failed (%s); the next open replays more of the log", exc)
            with self._lock:
                self._closed = True
                self._not_empty.notify_all()
                self._not_full.notify_all()
        self._retirer.stop()
        self._log.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> FileChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FileChannel {self.directory!r} size={len(self._queue)}>"

    # -- internals used by Transaction -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError(f"channel {self.directory} is closed")
        if self._log.failed is not None:
            self._log.check_writable()

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def _reserve_put(self, n: int = 1) -> None:
        with self._lock:
            self._counters["puts_attempted"] += n
            if len(self._queue) + self._inflight_puts + self._inflight_takes + n > self.config.capacity:
                cfg = self.config
                deadline = time.monotonic() + cfg.keep_alive
                while len(self._queue) + self._inflight_puts + self._inflight_takes + n > cfg.capacity:
                    left = deadline - time.monotonic()
                    self._check_open()  # closed while waiting: say so, not "full"
                    if left <= 0:
                        self._counters["channel_full"] += 1
                        raise ChannelFullError(
                            f"channel is full: capacity={cfg.capacity} events are queued or in flight, and no "
                            f"room appeared within keep_alive={cfg.keep_alive} s; take events or raise capacity"
                        )
                    self._put_waiters += 1
                    try:
                        self._not_full.wait(left)
                    finally:
                        self._put_waiters -= 1
                self._check_open()
            self._inflight_puts += n

    def _pop(
        self, tx: Transaction, n: int, timeout: float
    ) -> tuple[list[Entry] | Columns, int, list[Event | None], int]:
        """Pop up to ``n`` entries for ``tx``.

        Returns the entries as popped (column slices, or a list of entries while
        rolled-back takes are at the head), how many, their cached Events (None
        where not held; ``[]`` when the cache is empty) and how many were held.

        A deep queue's head is found by walking its data file (``_runs``): that
        walk runs first, outside the lock, so commits are not held behind it.
        """
        with self._lock:
            scans = self._queue.scans_needed(n) if self._log.failed is None else []
        for sc in scans:
            try:
                found = self._log.locate_puts(sc.run.fid, sc.offset, sc.start, sc.hi, sc.want)
            except (OSError, CorruptLogError):
                break  # the pop below walks again under the lock and raises it there
            with self._lock:
                self._queue.install(sc, found)
        with self._lock:
            if self._closed or self._log.failed is not None:
                self._check_open()
            self._counters["takes_attempted"] += 1
            q = self._queue
            if timeout > 0 and not len(q):
                deadline = time.monotonic() + timeout
                while not len(q):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._take_waiters += 1
                    try:
                        self._not_empty.wait(left)
                    finally:
                        self._take_waiters -= 1
                    self._check_open()
            popped: list[Entry] | Columns | None = q.pop_columns(n)
            if popped is None:
                popped = q.pop(n)
                got = len(popped)
                positions: Sequence[int] = list(map(position_of, popped))
            else:
                positions = popped[0]
                got = len(positions)
            tx._taken.add(popped, got)
            self._inflight_takes += got
            cache = self._cache
            if not cache.events:
                return popped, got, [], 0
            cached = cache.pop(positions, take_slots)
            return popped, got, cached, cache.last_hits

    def _load(
        self, tx: Transaction, popped: list[Entry] | Columns, n: int, cached: list[Event | None], hits: int
    ) -> list[Event]:
        """The Events of a take (``takes.read_taken``); damaged records go to :meth:`_damaged_at_take`."""
        got = read_taken(self._log, popped, cached, hits)
        self._counters["cache_hits"] += got.hits
        self._counters["disk_reads"] += got.disk_reads
        if got.damaged:
            self._damaged_at_take(tx, got.entries, got.damaged)
        return got.events

    def _damaged_at_take(
        self, tx: Transaction, entries: list[Entry], damaged: list[tuple[Entry, CorruptLogError]]
    ) -> None:
        """Apply ``on_corruption`` to events whose records no longer verify when taken.

        ``"fail"``: this take's events go back to the head and the error is raised.
        ``"skip"``: the damaged events are dropped for good (a take-only commit, so a
        restart never brings them back), reported, and the take returns the rest.

        Raises:
            CorruptLogError: ``on_corruption="fail"``.
        """
        bad = {e[0] for e, _ in damaged}
        if self.config.on_corruption != "skip":
            keep = {e[0] for e in entries}
            with self._lock:  # a checkpoint must see each entry in the transaction or in the queue
                mine = [e for e in tx._taken if e[0] in keep]
                tx._taken = Taken([e for e in tx._taken if e[0] not in keep])
                self._queue.push_back(mine)
                self._inflight_takes -= len(mine)
                if self._take_waiters:
                    self._not_empty.notify(len(mine))
            raise damaged[0][1]
        drop = Transaction(self)
        with self._lock:  # a checkpoint must see each entry in one transaction, not two
            drop._taken = Taken([e for e in tx._taken if e[0] in bad])
            tx._taken = Taken([e for e in tx._taken if e[0] not in bad])
        drop.commit()  # durable per the fsync policy; raises (and returns them to the queue) if it fails
        for e, exc in damaged:
            self._log.report_corruption(
                CorruptionReport(
                    exc.path, exc.offset, f"{exc.reason}; dropped when taken", 0, lost_positions=[(e[0], e[0] + 1)]
                )
            )
        self._count("damaged_events_dropped", len(damaged))

    def _apply(self, tx: Transaction, res: CommitResult) -> bool:
        """Make a written commit take effect: publish its puts, drop its takes.

        Called on the log's writing thread, in commit order. Returns whether a
        data file lost its last reference (so retirement may have work).
        """
        n = len(res.put_offsets)
        first = res.first_position
        fid = res.file_id
        with self._lock:
            n_taken = tx._taken.count
            freed = self._files.committed(fid, n, tx._runs if n_taken else ())
            if n:
                sizes = res.put_sizes
                if n == 1:  # a one-event transaction: no columns to extend from
                    self._queue.append(first, fid, res.put_offsets[0], sizes[0])
                else:
                    self._queue.append_run(first, fid, res.put_offsets, sizes)
                self._inflight_puts -= n
                self._counters["puts_committed"] += n
                puts = tx._payloads
                if type(puts) is fmt.PutColumn:  # put_arrow's column: its Python objects only if taken
                    self._cache.add_lazy(first, n, puts.nbytes, partial(column_events, puts))
                else:
                    # Headers' cost is counted from the payloads' length (the bodies plus encoded headers).
                    self._cache.add(
                        first, tx._bodies, tx._headers, None if tx._plain else sum(map(len, cast("list[bytes]", puts)))
                    )
                if self._take_waiters:
                    self._not_empty.notify(n)
            if n_taken:
                self._inflight_takes -= n_taken
                self._counters["takes_committed"] += n_taken
                if self._put_waiters:
                    self._not_full.notify(n_taken)
            if tx._marks:
                cur_marks = self._marks
                for key, value in tx._marks.items():
                    cur = cur_marks.get(key)
                    if cur is None or cur[1] < res.woid:
                        cur_marks[key] = (value, res.woid, fid)
            self._open_txns.pop(tx.txn_id, None)
        return freed

    def _undo(self, tx: Transaction, n_puts: int, taken: Taken) -> None:
        with self._lock:
            self._open_txns.pop(tx.txn_id, None)
            self._inflight_puts -= n_puts
            if taken:
                self._queue.push_back(taken)
                self._inflight_takes -= len(taken)
                if self._take_waiters:
                    self._not_empty.notify(len(taken))
            if n_puts and self._put_waiters:
                self._not_full.notify(n_puts)

    def _want_gc(self) -> None:
        self._retirer.want()


def open_channel(
    directory: str | os.PathLike[str], *, fs: FS | None = None, background: bool = True, **options: Any
) -> FileChannel:
    """Open (creating if needed) the channel in ``directory``; see :func:`filechannel.open`."""
    return FileChannel(directory, channel_config(options), fs=fs, background=background)


def channel_config(options: Mapping[str, Any]) -> ChannelConfig:
    """The :class:`ChannelConfig` of :func:`filechannel.open`'s ``options``, checked; opens nothing.

    Raises:
        ConfigError: An unknown option (naming a close match) or an invalid value.
    """
    try:
        return ChannelConfig.from_options(dict(options))
    except ConfigError as exc:
        if exc.option in options and exc.reason.startswith("unknown option"):
            close = difflib.get_close_matches(exc.option, [f.name for f in fields(ChannelConfig)], n=1)
            if close:
                raise ConfigError(exc.option, f"unknown option; did you mean {close[0]}=?") from None
        raise
