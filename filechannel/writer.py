"""Appending to data files: one writer per data directory, group commit, the fsync policy.

This module owns the write path. Committers hand a transaction's payloads to
the writer of one data directory. One of them becomes the leader, takes every
pending transaction, assigns write-order ids and positions, frames them, ends
the write with a BATCH_END record (a checksum over the whole write), writes it
with one ``pwrite`` and, with ``fsync="commit"``, makes it durable with one
``fdatasync`` before any of those commits return. A failed fsync or a failed
write that cannot be cleanly undone moves the log to FAILED: every later
write raises, and nothing is fsynced again as if it were safe. Files are
zero-filled ahead of the writer and rolled at ``max_file_size``.

It never reads a data file back; the counters it advances belong to the log's
shared state (``logstate.LogState``), which it is handed: it imports nothing
from ``log.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from . import format as fmt
from .errors import ChannelClosedError, ChannelFullError
from .scan import BATCH_END_SIZE, segment_name

if TYPE_CHECKING:
    from .logstate import LogState

logger = logging.getLogger(__name__)

# Data files are zero-filled this far ahead of the last write, so that most
# fdatasyncs find no size change to journal (PostgreSQL's wal_init_zero idea):
# one in every PREALLOC_STEP bytes pays for the metadata. Recovery reads an
# all-zero tail after the last verified batch of the newest file as a clean end.
PREALLOC_STEP = 1 << 20
_ZEROS = bytes(PREALLOC_STEP)
# A batch of at most this many frame buffers is written with one gathered write (pwritev)
# and checksummed buffer by buffer; more small ones (the pure-Python framing gives four per PUT)
# are joined first. Large buffers (a column's chunks, each framed whole) are never joined: a
# copy of a big batch costs more than the pwritev's extra iovecs.
_GATHER_MAX = 16
_GATHER_SMALL = 1 << 16  # average bytes per buffer under which many buffers are joined
_count_of = itemgetter(1)  # of a (first_position, count) take range


class CommitResult:
    """What a durable (or, with ``fsync="interval"``, written) commit produced."""

    __slots__ = ("file_id", "first_position", "put_offsets", "put_sizes", "txn_id", "woid")

    def __init__(self, txn_id: int) -> None:
        self.txn_id = txn_id
        self.woid = 0
        self.first_position = 0
        self.file_id = 0
        # each PUT frame's offset and size, as columns the queue extends from in one copy
        self.put_offsets: array[int] = array("q")
        self.put_sizes: array[int] = array("q")

    def __repr__(self) -> str:
        return (
            f"CommitResult(txn_id={self.txn_id}, woid={self.woid}, first_position={self.first_position}, "
            f"file_id={self.file_id}, puts={len(self.put_offsets)})"
        )


_COMMIT_SIZE = fmt.record_size(16)
_NOTE_SIZE = fmt.record_size(8)  # a ROLLBACK or a RETIRE record


class FilePolicy(Protocol):
    """Optional per-file rules a writer consults (the write-ahead log's time-based rolling).

    The channel sets none. With one, the writer also rolls when
    :meth:`must_roll` says so, and writes :meth:`first_item` at the start of
    every new file, in that file's first batch.
    """

    reserve: int  # bytes the first item may occupy (kept free when sizing a new file's first batch)

    def must_roll(self, file_id: int, item: Item) -> bool:
        """Whether ``item`` may not go into file ``file_id`` (a non-empty file being written)."""

    def started(self, file_id: int, item: Item) -> None:
        """File ``file_id`` was just created; ``item`` is the first one headed for it."""

    def first_item(self, file_id: int) -> Item | None:
        """An item to write first in the new file ``file_id`` (its first batch), or None."""


# --------------------------------------------------------------------------
# writing: one writer per data directory


class Item:
    """One unit handed to a writer: a transaction, a rollback note or retirements."""

    __slots__ = (
        "done",
        "durable",
        "error",
        "kind",
        "marks",
        "nbytes",
        "on_written",
        "payloads",
        "prefix",
        "published",
        "result",
        "retire",
        "takes",
        "txn_id",
        "wake",
    )

    def __init__(
        self,
        kind: int,
        txn_id: int,
        payloads: Sequence[bytes] = (),
        takes: Sequence[tuple[int, int]] = (),
        durable: bool = True,
        on_written: Callable[[CommitResult], None] | None = None,
        retire: Sequence[int] = (),
        overhead: int = 0,
        prefix: bytes = b"",
        marks: Sequence[bytes] = (),
    ) -> None:
        self.kind = kind
        self.txn_id = txn_id
        self.payloads = payloads  # each PUT's payload is prefix + payloads[i]
        self.prefix = prefix
        self.takes = takes
        self.marks = marks  # MARK payloads, framed first (before the PUTs: see _write_chunk); sealed like PUTs
        self.durable = durable
        self.on_written = on_written
        self.retire = retire
        self.result = CommitResult(txn_id)
        self.done = False
        self.published = False
        self.error: BaseException | None = None
        self.wake: Any = None  # a held lock its committer blocks on until a leader releases it
        if kind == fmt.COMMIT:
            n = _COMMIT_SIZE
            if payloads:  # ``overhead``: what sealing adds to a PUT (or MARK) payload (encryption)
                n += fmt.frames_size(payloads, overhead + len(prefix))
            if takes:
                n += fmt.record_size(4 + 16 * len(takes))
            for m in marks:
                n += fmt.record_size(len(m) + overhead)
        elif kind == fmt.ROLLBACK:
            n = _NOTE_SIZE
        else:
            n = _NOTE_SIZE * len(retire)
        self.nbytes = n


class Pin(NamedTuple):
    """A data file pinned for a sync outside ``io_lock`` (:meth:`Writer.pin`)."""

    fd: int
    file_id: int
    length: int


class Writer:
    """Appends batches to the active data file of one data directory."""

    def __init__(self, log: LogState, index: int, path: str, live: list[int]) -> None:
        self.log = log
        self.index = index
        self.path = path
        self.live = live  # file ids of this directory that are part of the channel
        self.lock = threading.Lock()  # guards pending, leading, waiting and items' wake locks
        self.pending: list[Item] = []
        self.leading = False
        self.io_lock = threading.Lock()
        self.fd: int | None = None
        self.file_id = 0
        self.offset = 0
        self.synced = 0
        self.encoder: Any = None
        self.seed = 0
        self.header_len = 0
        self.phys_end = 0  # file size including the zero-filled space ahead of ``offset``
        self._unpublished: list[Item] = []
        self.waiting = 0  # committers waiting for a leader's write
        self.policy: FilePolicy | None = None  # the write-ahead log's rolling rules; None for a channel
        # An encrypted file is authenticated (format version 2): each batch's tag chains to the one before.
        self.tagger: Callable[[int, bytes], bytes] | None = None
        self.prev_tag = b""
        self.batch_end_size = BATCH_END_SIZE

    # -- called by committers ------------------------------------------------

    def submit(self, item: Item) -> None:
        """Queue ``item``; return when it is written (and durable if it asks to be).

        The first committer to find no leader leads: it writes everything
        pending, again and again, until nothing is pending. The others block
        on their item's own lock, which the leader releases once the item is
        written (no thundering herd), or when it stops leading with the item
        still pending (then one of them leads).
        """
        lock = self.lock
        with lock:
            self.log.check_writable()
            if not self.leading and (item.durable or item.on_written):
                # Nobody leads: lead at once, writing this item and whatever waits to ride along
                # (one lock round trip less for a lone committer than queueing first).
                self.leading = True
                first = self.pending
                first.append(item)
                self.pending = []
                wake = None
            else:
                self.pending.append(item)
                if not item.durable and not item.on_written:
                    return  # rides along with the next write
                wake = self._lead_or_wait(item)
                first = None
        if first is not None and len(first) == 1:
            # A lone committer: write its item here, and stop leading unless others queued
            # meanwhile (then lead on, as below). Saves _lead's loop for the common case.
            try:
                with self.io_lock:
                    self._write_batch_locked(first)
            except BaseException as exc:  # noqa: BLE001 - raised below, as _lead hands it over
                if item.error is None and not item.published:
                    item.error = exc
            with lock:
                item.done = True
                alone = not self.pending and not self.waiting
                if alone:
                    self.leading = False
            if alone:
                if item.error is not None:
                    raise item.error
                return
            first = None  # lead on: others queued while this item was written
        while True:
            if wake is None:  # this committer leads
                try:
                    self._lead(first)  # returns having given up leadership
                except BaseException:
                    with lock:
                        self.leading = False
                        for it in self.pending:
                            self._wake(it)
                    raise
                break  # a leader writes until nothing is pending: its own item is done
            wake.acquire()  # released by a leader: the item is written, or nobody leads any more
            with lock:
                if item.done:
                    break
                wake = self._lead_or_wait(item)
        if item.error is not None:
            raise item.error

    def _lead_or_wait(self, item: Item) -> threading.Lock | None:
        """Lead if nobody does (None); else return ``item``'s armed wake lock (the caller holds ``lock``)."""
        if not self.leading:
            self.leading = True
            return None
        wake = item.wake = threading.Lock()
        wake.acquire()
        self.waiting += 1
        return wake

    def _wake(self, item: Item) -> None:
        """Release ``item``'s committer if it is blocked (the caller holds ``lock``)."""
        wake = item.wake
        if wake is not None:
            item.wake = None
            self.waiting -= 1
            wake.release()

    def _lead(self, first: list[Item] | None = None) -> None:
        """Write ``first`` (if given), then pending items until none is left, then stop leading.

        ``first``: the batch a committer took from ``pending`` as it began to lead (under ``lock``).
        """
        lock = self.lock
        batch: list[Item] = []
        while True:
            if first is not None:
                batch, first = first, None
            else:
                if self.waiting or len(batch) > 1:
                    # Other committers are about: let those ready to run (just woken, or
                    # waiting for the GIL) queue their transactions first. Bigger groups,
                    # fewer fdatasyncs: +30% commits/s with 16 threads on 2 cores.
                    time.sleep(0)
                with lock:
                    batch = self.pending
                    for i in batch:
                        if i.durable or i.on_written:
                            break
                    else:  # nothing pending that anyone waits for
                        self.leading = False
                        for it in batch:  # nothing waits for these, but stay safe
                            self._wake(it)
                        return
                    self.pending = []
            try:
                with self.io_lock:
                    self._write_batch_locked(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting committer
                for it in batch:
                    if it.error is None and not it.published:
                        it.error = exc
            with lock:
                for it in batch:
                    it.done = True
                    self._wake(it)
                if not self.pending and not self.waiting and len(batch) == 1:
                    # A lone committer, nothing came in meanwhile: stop leading now. (After a
                    # group, the loop first yields, so the committers just released can queue.)
                    self.leading = False
                    return

    # -- I/O (leader only) ------------------------------------------------------

    def _write_batch_locked(self, batch: list[Item], closing: bool = False) -> None:
        """Write ``batch`` (rolling files as needed); the caller holds ``io_lock``.

        ``closing``: the log's close writes what was still pending, past the
        check that refuses new work once closing has begun.
        """
        log = self.log
        if not closing or log.failed is not None:
            log.check_writable()
        limit = log.config.max_file_size
        policy = self.policy
        if len(batch) == 1 and policy is None and self.tagger is None and self.fd is not None:
            it = batch[0]
            if (
                it.kind == fmt.COMMIT
                and len(it.payloads) == 1
                and not it.takes
                and not it.marks
                and log.seal_overhead == 0
                and it.nbytes <= limit - self.offset - self.batch_end_size
            ):
                # A lone one-event transaction (the producer that commits every event): one
                # framing call, one write, then the same fdatasync as any batch.
                self._write_commit1(it)
                if log.config.fsync == "commit":
                    self._sync()
                return
        if policy is not None:
            limit -= policy.reserve
        chunk: list[Item] = []
        size = 0
        for it in batch:
            if self.fd is None:
                self._roll()
                if policy is not None:
                    policy.started(self.file_id, it)
            elif policy is not None and policy.must_roll(self.file_id, it):
                if chunk or self.offset > self.header_len:
                    if chunk:
                        self._write_chunk(chunk)
                        chunk, size = [], 0
                    self._roll()
                # A new file, or one still empty (its first write failed): its rules are
                # written with its first batch, so they can still follow this item.
                policy.started(self.file_id, it)
            room = limit - self.offset - self.batch_end_size
            if chunk and size + it.nbytes > room:
                self._write_chunk(chunk)
                chunk, size = [], 0
                room = limit - self.offset - self.batch_end_size
            if not chunk and it.nbytes > room and self.offset > self.header_len:
                self._roll()
                if policy is not None:
                    policy.started(self.file_id, it)
            chunk.append(it)
            size += it.nbytes
        if chunk:
            self._write_chunk(chunk)
        if log.config.fsync == "commit":
            self._sync()

    def _write_chunk(self, chunk: list[Item]) -> None:
        log = self.log
        enc = self.encoder
        start = self.offset
        parts: list[bytes] = []
        off = start
        file_id = self.file_id
        if self.policy is not None and start == self.header_len:
            first = self.policy.first_item(file_id)
            if first is not None:
                chunk = [first, *chunk]
        with log.seq_lock:
            first_woid = log.next_woid
            woid = first_woid
            for it in chunk:
                res = it.result
                res.file_id = file_id
                if it.kind == fmt.COMMIT:
                    txn = it.txn_id
                    offs = res.put_offsets
                    sizes = res.put_sizes
                    # MARK records come first: a transaction's PUTs keep consecutive woids ending
                    # just before its TAKE and COMMIT (what salvage places lost puts by). An encrypted
                    # file seals them as it seals PUTs: a mark is the user's data too.
                    for m in it.marks:
                        off += enc.add_sealed(parts, fmt.MARK, woid, txn, m, off)
                        woid += 1
                    if it.payloads:  # a take-only commit frames no PUTs
                        off = enc.add_puts(parts, woid, txn, it.payloads, offs, sizes, off, it.prefix)
                        woid += len(it.payloads)
                    if it.takes:
                        off += enc.add(parts, fmt.TAKE, woid, txn, fmt.encode_take(it.takes))
                        woid += 1
                    res.first_position = log.next_position
                    log.next_position += len(it.payloads)
                    res.woid = woid
                    n_taken = sum(map(_count_of, it.takes))
                    off += enc.add(
                        parts, fmt.COMMIT, woid, txn, fmt.encode_commit(res.first_position, len(it.payloads), n_taken)
                    )
                    woid += 1
                elif it.kind == fmt.ROLLBACK:
                    assert isinstance(it, RollbackItem)
                    off += enc.add(parts, fmt.ROLLBACK, woid, it.txn_id, fmt.encode_rollback(*it.counts))
                    woid += 1
                else:
                    for fid in it.retire:
                        off += enc.add(parts, fmt.RETIRE, woid, 0, fmt.encode_retire(fid))
                        woid += 1
            if len(parts) > _GATHER_MAX and off - start < len(parts) * _GATHER_SMALL:
                parts = [b"".join(parts)]  # many small frames (the pure-Python path): one join is cheaper
            tag = b""
            if self.tagger is None:
                off += enc.close_batch(parts, start, first_woid, woid)  # checksums every byte of parts
            else:
                n, tag = enc.close_batch_auth(parts, start, first_woid, woid, self.tagger, self.prev_tag)
                off += n
            log.next_woid = woid + 1
        nbytes = off - start
        assert self.fd is not None
        try:
            log.fs.pwrite_all(self.fd, parts, start)  # gathered: the frames are not joined into one copy
        except OSError as exc:
            self._undo_write(start, exc)
            raise
        end = self.offset = start + nbytes
        if tag:
            self.prev_tag = tag  # only once the batch is written: an undone write leaves the chain as it was
        self.phys_end = max(self.phys_end, end)
        log.bytes_written += nbytes
        log.space_used(self.index, nbytes)
        if self.phys_end - end < PREALLOC_STEP // 2:
            self._preallocate(start, end)
        self._unpublished.extend(chunk)
        if log.config.fsync == "interval":
            self._publish()

    def _write_commit1(self, it: Item) -> None:
        """:meth:`_write_chunk` of one unsealed COMMIT item with one PUT and nothing else (``io_lock`` held)."""
        log = self.log
        start = self.offset
        res = it.result
        res.file_id = self.file_id
        with log.seq_lock:
            woid = log.next_woid
            first = res.first_position = log.next_position
            data = fmt.frame_commit1(self.seed, log.crc_kind, woid, it.txn_id, it.payloads[0], it.prefix, start, first)
            log.next_position = first + 1
            res.woid = woid + 1
            log.next_woid = woid + 3
        nbytes = len(data)
        res.put_offsets.append(start)
        res.put_sizes.append(fmt.record_size(len(it.prefix) + len(it.payloads[0])))  # the PUT's frame
        assert self.fd is not None
        try:
            log.fs.pwrite_all(self.fd, data, start)
        except OSError as exc:
            self._undo_write(start, exc)
            raise
        end = self.offset = start + nbytes
        if end > self.phys_end:
            self.phys_end = end
        log.bytes_written += nbytes
        log.space_used(self.index, nbytes)
        if self.phys_end - end < PREALLOC_STEP // 2:
            self._preallocate(start, end)
        self._unpublished.append(it)
        if log.config.fsync == "interval":
            self._publish()

    def _sync(self) -> None:
        log = self.log
        if self.fd is None or self.synced == self.offset:
            self._publish()
            return
        t0 = time.monotonic()
        try:
            log.fs.fdatasync(self.fd)
        except OSError as exc:
            log.fail(exc, f"fdatasync of {self.path_of(self.file_id)} failed")
            self._unpublished.clear()
            raise
        log.note_fsync(time.monotonic() - t0)
        self.synced = self.offset
        self._publish()

    def _publish(self) -> None:
        """Hand written (and, in commit mode, durable) commits to their callbacks, in order."""
        items, self._unpublished = self._unpublished, []
        for it in items:
            it.published = True
            if it.on_written is not None:
                it.on_written(it.result)

    def _preallocate(self, start: int, end: int) -> None:
        """Zero-fill the file ahead of ``end`` (up to ``max_file_size``); rides on the next fdatasync."""
        log = self.log
        assert self.fd is not None
        frm = self.phys_end
        to = min(frm + PREALLOC_STEP, max(log.config.max_file_size, end))
        if to <= frm:
            return
        try:
            log.fs.pwrite_all(self.fd, _ZEROS[: to - frm], frm)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # The batch itself is written: drop the partial zeros and go on.
                try:
                    log.fs.truncate(self.fd, end)
                except OSError as exc2:
                    log.fail(exc2, f"truncate after failed zero-fill of {self.path_of(self.file_id)} failed")
                    raise
                self.phys_end = end
                return
            self._undo_write(start, exc)
            raise
        self.phys_end = to
        log.space_used(self.index, to - frm)

    def _undo_write(self, start: int, exc: OSError) -> None:
        """A write failed: cut the file back so no partial record stays behind."""
        log = self.log
        assert self.fd is not None
        self.phys_end = start
        try:
            log.fs.truncate(self.fd, start)
        except OSError as exc2:
            log.fail(exc2, f"truncate after failed write to {self.path_of(self.file_id)} failed")
            return
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.fail(exc, f"write to {self.path_of(self.file_id)} failed")

    def path_of(self, file_id: int) -> str:
        """The path of data file ``file_id`` in this writer's directory."""
        return os.path.join(self.path, segment_name(file_id))

    def _roll(self) -> None:
        """Start a new data file (the old one is made durable first)."""
        log = self.log
        fs = log.fs
        if self.fd is not None:
            # Trim the zero-filled space: only the newest file of a directory may end in zeros.
            trim = self.phys_end > self.offset
            if self.synced != self.offset or trim:
                try:
                    if trim:
                        fs.truncate(self.fd, self.offset)
                        self.phys_end = self.offset
                    fs.fdatasync(self.fd)
                except OSError as exc:
                    log.fail(exc, f"sealing {self.path_of(self.file_id)} failed")
                    raise
                log.fsyncs += 1
                self.synced = self.offset
            self._publish()
            log.file_end[self.file_id] = self.offset
            log.file_sealed(self.file_id, self.offset)
            if self.tagger is not None:
                log.file_tags[self.file_id] = self.prev_tag
            fs.close(self.fd)
            self.fd = None
        enc = log.config.encryption
        with log.seq_lock:
            file_id = log.next_file_id
            log.next_file_id += 1
            header = fmt.FileHeader(
                crc_kind=log.crc_kind,
                channel_id=log.channel_id,
                file_id=file_id,
                base_woid=log.next_woid,
                next_position=log.next_position,
                next_txn_id=log.peek_txn_id(),
                created_ns=time.time_ns(),
                live_files=tuple(self.live),
            )
        cipher = None
        if enc is not None:
            # A new file, a new random salt, so a new key: with woids as nonces, no
            # (key, nonce) pair is ever used twice, even after a torn tail was cut.
            cipher = enc.new_file_cipher(log.channel_id, file_id)
            header = dataclasses.replace(
                header, version=fmt.AUTH_VERSION, cipher=cipher.suite, key_id=cipher.key_id, salt=cipher.salt
            )
        if header.header_len > 0xFFFF:
            # The header lists every live file of the directory in 16 bits of length.
            raise ChannelFullError(
                f"{len(self.live)} live data files in {self.path}: a new one cannot list them all; old events "
                "(or a lagging consumer) pin them: take or acknowledge them, or raise max_file_size",
                "live_files",
            )
        data = fmt.encode_file_header(header, cipher.key_check if cipher is not None else None)
        path = self.path_of(file_id)
        fd = fs.create(path)
        syncing = False
        try:
            fs.pwrite_all(fd, data, 0)
            syncing = True
            fs.fdatasync(fd)
            fs.fsync_dir(self.path)
        except OSError as exc:
            try:
                fs.close(fd)
                fs.unlink(path)
            except OSError:
                pass
            # A write that ran out of space leaves nothing behind once the file is
            # removed, and may be tried again. A failed fsync is never retried as if
            # the data were safe: the log fails, whatever the errno.
            if syncing or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.fail(exc, f"creating {path} failed")
            raise
        log.fsyncs += 2
        log.register_file(file_id, self.index, path)
        if cipher is not None:
            log.ciphers[file_id] = cipher
            log.key_ids[file_id] = cipher.key_id
        self.live.append(file_id)
        self.fd = fd
        self.file_id = file_id
        self.offset = self.synced = self.header_len = self.phys_end = len(data)
        self.seed = fmt.file_seed(log.crc_kind, log.channel_id, file_id)
        old_encoder = self.encoder
        self.encoder = fmt.record_encoder(self.seed, log.crc_kind, cipher.seal if cipher is not None else None)
        if old_encoder is not None:  # its frame buffer is free (the last batch is written): keep its pages
            self.encoder.adopt_buffer(old_encoder)
        if cipher is not None:
            # The first batch's tag chains to the header's key check (which binds the salt, key id and live list).
            at = header.check_offset
            self.tagger = cipher.batch_tag
            self.prev_tag = data[at : at + fmt.ENC_CHECK_LEN]
            log.key_checks[file_id] = self.prev_tag
            log.first_auth = min(log.first_auth, file_id)
            self.batch_end_size = BATCH_END_SIZE + fmt.BATCH_TAG_LEN
        else:
            self.tagger = None
            self.prev_tag = b""
            self.batch_end_size = BATCH_END_SIZE
        log.files_created += 1
        logger.debug("started data file %s", path)

    def sync_now(self) -> None:
        """Make everything written so far durable (the interval syncer)."""
        with self.io_lock:
            if self.log.failed is not None or self.fd is None or self.synced == self.offset:
                return
            try:
                self.log.fs.fdatasync(self.fd)
            except OSError as exc:
                self.log.fail(exc, f"background fdatasync of {self.path_of(self.file_id)} failed")
                return
            self.log.fsyncs += 1
            self.synced = self.offset

    def pin(self) -> Pin | None:
        """What :meth:`sync_pinned` needs to make the file's bytes so far durable later (``io_lock`` held).

        None when they are durable already. Otherwise a second descriptor of the
        file being written (so a roll that closes the writer's own cannot pull it
        away), its id and its length now; the caller passes it to :meth:`sync_pinned`
        or :meth:`unpin`.
        """
        if self.fd is None or self.synced == self.offset:
            return None
        return Pin(self.log.fs.dup(self.fd), self.file_id, self.offset)

    def sync_pinned(self, pin: Pin) -> None:
        """Make the pinned file durable up to the pinned length, without holding ``io_lock`` for the sync.

        Committers keep appending meanwhile. The descriptor shares the writer's open
        file, so a write-back error is reported to one of the two syncs: the one
        that sees it fails the log, and this one then checks, under ``io_lock`` (which
        every other sync of the file holds), that no sync failed before it returned.

        Raises:
            OSError: The fdatasync failed (the log has failed).
            ChannelClosedError: The log failed meanwhile (perhaps the bytes are not durable).
        """
        log = self.log
        try:
            try:
                log.fs.fdatasync(pin.fd)
            except OSError as exc:
                log.fail(exc, f"fdatasync of {self.path_of(pin.file_id)} failed")
                raise
        finally:
            self.unpin(pin)
        with self.io_lock:
            log.check_writable()
            log.fsyncs += 1
            if self.file_id == pin.file_id and self.fd is not None and self.synced < pin.length <= self.offset:
                self.synced = pin.length

    def unpin(self, pin: Pin) -> None:
        """Release a pin's descriptor (its bytes may not be durable)."""
        try:
            self.log.fs.close(pin.fd)
        except OSError as exc:  # a deferred write-back error: the file's bytes may not be durable
            self.log.fail(exc, f"closing a descriptor of {self.path_of(pin.file_id)} failed")
            raise

    def drain_on_close(self) -> OSError | None:
        """The log closes: write what is pending, release its committers, then :meth:`close`.

        New commits are refused already (``log.closing``). A failed write fails the
        pending items (their committers see the error); returns the first
        ``OSError`` of the write or the close, for the log's close to raise.
        """
        err: OSError | None = None
        with self.io_lock:
            with self.lock:
                pending = self.pending
                self.pending = []
            if self.fd is None and all(it.kind == fmt.ROLLBACK for it in pending):
                # Rollback notes are informational: not worth a new data file.
                pending = []
            if pending:
                try:
                    self._write_batch_locked(pending, closing=True)
                except (OSError, ChannelClosedError) as exc:
                    err = exc if isinstance(exc, OSError) else None
                    for it in pending:
                        if it.error is None and not it.published:
                            it.error = exc
            with self.lock:  # release committers whose items close wrote (or failed)
                for it in pending:
                    it.done = True
                    self._wake(it)
        try:
            self.close()
        except OSError as exc:
            err = err or exc
        return err

    def close(self) -> None:
        """Trim the zero-filled tail, make the file durable and close it (the log's close)."""
        with self.io_lock:
            if self.fd is not None:
                fd, self.fd = self.fd, None
                try:
                    if self.log.failed is None and (self.synced != self.offset or self.phys_end > self.offset):
                        if self.phys_end > self.offset:
                            self.log.fs.truncate(fd, self.offset)  # leave no zero-filled tail behind
                        self.log.fs.fdatasync(fd)
                        self.log.fsyncs += 1
                finally:
                    self.log.fs.close(fd)


class RollbackItem(Item):
    """A ROLLBACK note: written with the next write, nobody waits for it."""

    __slots__ = ("counts",)

    def __init__(self, txn_id: int, n_puts: int, n_takes: int) -> None:
        super().__init__(fmt.ROLLBACK, txn_id, durable=False)
        self.counts = (n_puts, n_takes)
