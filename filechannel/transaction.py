"""Transaction: one unit of puts, takes and marks that commits or rolls back as a whole.

This module owns a transaction's life: its state table (open, committed,
rolled back, failed), what it holds until it ends (the PUT payloads, framed
plain or with headers, or as one ``format.PutColumn``; its takes; its marks),
the checks of each put and take against the channel's options, the commit
through ``Log`` and the rollback, and the ``on_corruption`` policy applied to
records found damaged when taken. The state it shares with the channel and
with the other transactions (the queue, capacity, the take cache, the marks)
is ``channelstate.ChannelState``'s; this module changes it through that
class's paths. It also holds what the channel asks of transactions on its
own behalf: the take-only commits of what external consumers acknowledged
(:func:`take_acknowledged`) and the open transactions' takes a checkpoint
counts as queued (:func:`open_takes`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, cast

from . import format as fmt
from ._queue import Columns, Entry, Taken
from .channelstate import ChannelState
from .errors import (
    ConsumerConflictError,
    CorruptLogError,
    EventTooLargeError,
    InvalidEventError,
    TransactionCapacityError,
    TransactionStateError,
)
from .events import NO_HEADERS, Event, as_body, bad_header_text, check_headers, coerce_event
from .log import CommitResult, CorruptionReport
from .takes import column_events, take_runs

__all__ = ["Transaction", "open_takes", "take_acknowledged"]

_ACK_CHUNK = 1_000_000  # most events one take-only commit of acknowledgements holds

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

    def __init__(self, state: ChannelState) -> None:
        self._ch = state
        self._log = state.log
        self.txn_id = state.log.new_txn_id()
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
        state.open_txns[self.txn_id] = self

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
        if ch.closed or self._log.failed is not None:
            ch.check_open()
        if not self._payloads:
            # Room (free space, max_bytes) is checked at the first put and again at commit,
            # before anything is written (puts write nothing; the check costs ~0.5 us).
            self._log.wait_for_room(self._dir)
        ch.reserve_put()
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
            self._ch.check_mark_room(self._marks, key)
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
        consumers = self._ch.consumers.cached_list()  # one access() while no consumer was ever registered
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
        popped, n, cached, hits = self._ch.pop(self._taken, want, timeout)
        out = self._load(popped, cached, hits)
        if len(out) < n:
            # on_corruption="skip" dropped damaged events: take more in their place, so a
            # short or empty answer still means the queue had no more (within the timeout).
            deadline = time.monotonic() + timeout
            while n and len(out) < want:
                left = max(0.0, deadline - time.monotonic())
                popped, n, cached, hits = self._ch.pop(self._taken, want - len(out), left)
                out += self._load(popped, cached, hits)
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
            ch.count("transactions_committed")
            ch.open_txns.pop(self.txn_id, None)
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
            ch.undo(self.txn_id, len(self._payloads), self._taken)
            ch.count("commit_failures")
            raise
        self._advance("commit")
        ch.count("transactions_committed")
        if self._freed:
            ch.on_freed()
        self._payloads = []
        self._plain = True
        self._bodies = []
        self._headers = []
        self._taken = Taken()
        self._marks = {}

    def _on_written(self, res: CommitResult) -> None:
        # Runs on the writing thread, in commit order, once the records are durable
        # (written, with fsync="interval"): the commit takes effect here.
        self._freed = self._ch.publish(
            self.txn_id,
            res,
            self._taken.count,
            self._runs,
            self._payloads,
            self._bodies,
            self._headers,
            self._plain,
            self._marks,
        )

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
        self._ch.undo(self.txn_id, n_puts, self._taken)
        self._ch.count("rollbacks")
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
            return self.put_column(*got)
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

    def put_column(self, col: fmt.PutColumn, longest: int) -> int:
        """Add the events of framed puts held as a ``format.PutColumn``: all, or none; returns how many.

        For code that holds its events framed already (:meth:`put_arrow`, ``staged.put_chunks``);
        ``longest``: the longest body (PUT payload when the column has no ``head``). Joins a column
        with the same ``head``; otherwise the puts become lists. Raises as :meth:`put_many`.
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
        if ch.closed or self._log.failed is not None:
            ch.check_open()
        if not self._payloads:
            self._log.wait_for_room(self._dir)
        ch.reserve_put(n)
        return n

    def _load(self, popped: list[Entry] | Columns, cached: list[Event | None], hits: int) -> list[Event]:
        """The Events of a take (``ChannelState.serve``); damaged records go to :func:`_on_damaged_take`."""
        got = self._ch.serve(popped, cached, hits)
        if got.damaged:
            _on_damaged_take(self, got.entries, got.damaged)
        return got.events


def _on_damaged_take(tx: Transaction, entries: list[Entry], damaged: list[tuple[Entry, CorruptLogError]]) -> None:
    """Apply ``on_corruption`` to events whose records no longer verify when taken.

    ``"fail"``: this take's events go back to the head and the error is raised.
    ``"skip"``: the damaged events are dropped for good (a take-only commit, so a
    restart never brings them back), reported, and the take returns the rest.

    Raises:
        CorruptLogError: ``on_corruption="fail"``.
    """
    ch = tx._ch
    if ch.config.on_corruption != "skip":
        keep = {e[0] for e in entries}
        with ch.lock:  # a checkpoint must see each entry in the transaction or in the queue
            ch.requeue([e for e in tx._taken if e[0] in keep])
            tx._taken = Taken([e for e in tx._taken if e[0] not in keep])
        raise damaged[0][1]
    bad = {e[0] for e, _ in damaged}
    drop = Transaction(ch)
    with ch.lock:  # a checkpoint must see each entry in one transaction, not two
        drop._taken = Taken([e for e in tx._taken if e[0] in bad])
        tx._taken = Taken([e for e in tx._taken if e[0] not in bad])
    drop.commit()  # durable per the fsync policy; raises (and returns them to the queue) if it fails
    for e, exc in damaged:
        ch.log.report_corruption(
            CorruptionReport(
                exc.path, exc.offset, f"{exc.reason}; dropped when taken", 0, lost_positions=[(e[0], e[0] + 1)]
            )
        )
    ch.count("damaged_events_dropped", len(damaged))


def take_acknowledged(state: ChannelState, low: int) -> int:
    """Take every queued event below position ``low`` in take-only commits; return how many.

    The take ``AckPoller`` makes of what every external consumer acknowledged;
    each commit holds at most a million events (not limited by ``transaction_capacity``).
    """
    total = 0
    while state.count_below(low):
        tx = Transaction(state)
        got = state.pop_below(tx._taken, low, _ACK_CHUNK)
        tx.commit()  # a failure returns the entries to the queue and raises
        total += got
        state.count("acked_events_taken", got)
    return total


def open_takes(state: ChannelState) -> list[Entry]:
    """The entries the open transactions have taken (a checkpoint counts them as queued); under the lock."""
    return [e for tx in state.open_txns.values() for e in tx._taken]
