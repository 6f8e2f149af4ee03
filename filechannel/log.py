"""The write-ahead log: data files, write-order ids, group commit, recovery.

``Log`` owns the channel directory's files and everything about them: the
``CHANNEL`` identity file, the lock, the data files in each data directory,
the global write-order id (woid), the position counter that COMMIT records
carry, group commit and the fsync policy, recovery of torn tails, detection of
corruption, and retirement of data files. It knows nothing of queues or
capacity: ``channel.py`` builds those from the records this module replays.

Write path: committers hand a transaction's payloads to the writer of one data
directory. One of them becomes the leader, takes every pending transaction,
assigns woids and positions, frames them, ends the write with a BATCH_END
record (a checksum over the whole write), writes it with one ``pwrite`` and,
with ``fsync="commit"``, makes it durable with one ``fdatasync`` before any of
those commits return. A failed fsync or a failed write that cannot be cleanly
undone moves the log to FAILED: every later write raises, and nothing is
fsynced again as if it were safe.

Recovery (see docs/format.md): only records covered by a verified BATCH_END
count. In the newest data file of a directory, damage with no verified
BATCH_END after it is a torn tail: it is copied aside and truncated. Any other
damage is corruption of acknowledged data and raises ``CorruptLogError``
(or, with ``on_corruption="skip"``, is skipped and reported exactly).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from . import format as fmt
from ._fs import DEFAULT_FS, FS, read_file
from .checkpoint import CheckpointStore, Snapshot, StoredCheckpoint
from .config import ChannelConfig
from .errors import (
    ChannelClosedError,
    ChannelCopyError,
    ChannelLockedError,
    ConfigError,
    CorruptLogError,
    DiskSpaceError,
    FormatError,
    NotAChannelError,
)

logger = logging.getLogger(__name__)

CHANNEL_FILE = "CHANNEL"
DATA_DIRS_FILE = "DATA_DIRS"
DATA_DIR_ID_FILE = "DATADIR"
LOCK_FILE = "LOCK"
DEFAULT_DATA_DIR = "data"
_SEG_RE = re.compile(r"^seg-([0-9a-f]{16})\.wal$")
_CHANNEL_MAGIC = b"FCCHANNL"
_CHANNEL_FMT = struct.Struct("<8sHH16sQ")
_U32 = struct.Struct("<I")
_BATCH_END_SIZE = fmt.record_size(32)
_DATA_DIR_HINT = (
    "mount or restore it at this path (a backup restores the whole channel directory); "
    "to accept the loss of its events, open with on_corruption='skip' (every lost position is reported)"
)
_MISSING_HINT = (
    "restore the file or mount its disk; to accept the loss, open with on_corruption='skip' "
    "(every lost position is reported)"
)
_SPACE_REFRESH_S = 1.0
# Data files are zero-filled this far ahead of the last write, so that most
# fdatasyncs find no size change to journal (PostgreSQL's wal_init_zero idea):
# one in every PREALLOC_STEP bytes pays for the metadata. Recovery reads an
# all-zero tail after the last verified batch of the newest file as a clean end.
PREALLOC_STEP = 1 << 20
_ZEROS = bytes(PREALLOC_STEP)


def segment_name(file_id: int) -> str:
    """Return the file name of data file ``file_id``."""
    return f"seg-{file_id:016x}.wal"


# --------------------------------------------------------------------------
# channel identity file


def encode_channel_file(channel_id: bytes, crc_kind: int, created_ns: int) -> bytes:
    """Encode the ``CHANNEL`` file: magic, version, checksum kind, channel id, creation time."""
    body = _CHANNEL_FMT.pack(_CHANNEL_MAGIC, fmt.FORMAT_VERSION, crc_kind, channel_id, created_ns)
    return body + _U32.pack(fmt.crc(fmt.CRC32_ZLIB, body))


def decode_channel_file(buf: bytes) -> tuple[bytes, int, int]:
    """Decode the ``CHANNEL`` file into ``(channel_id, crc_kind, created_ns)``.

    Raises:
        FormatError: the bytes are not a valid CHANNEL file.
    """
    n = _CHANNEL_FMT.size
    if len(buf) != n + 4:
        raise FormatError(0, f"CHANNEL file is {len(buf)} bytes, expected {n + 4}")
    if fmt.crc(fmt.CRC32_ZLIB, buf[:n]) != _U32.unpack_from(buf, n)[0]:
        raise FormatError(n, "CHANNEL file checksum mismatch")
    magic, version, kind, cid, created = _CHANNEL_FMT.unpack_from(buf, 0)
    if magic != _CHANNEL_MAGIC:
        raise FormatError(0, "bad CHANNEL magic")
    if version != fmt.FORMAT_VERSION:
        raise FormatError(8, f"unsupported channel format version {version}")
    if kind not in (fmt.CRC32C, fmt.CRC32_ZLIB):
        raise FormatError(10, f"unknown checksum kind {kind}")
    if kind == fmt.CRC32C and not fmt.HAVE_CRC32C:
        raise FormatError(10, "channel uses CRC-32C; install google-crc32c")
    return bytes(cid), kind, created


def encode_meta(obj: dict[str, Any]) -> bytes:
    """Encode a small metadata file: one line of JSON, then ``crc32:`` and its zlib CRC-32 in hex."""
    line = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return line + b"\ncrc32:%08x\n" % fmt.crc(fmt.CRC32_ZLIB, line)


def decode_meta(buf: bytes, what: str) -> dict[str, Any]:
    """Decode a metadata file written by :func:`encode_meta`.

    Raises:
        FormatError: the checksum does not match or the JSON is not an object.
    """
    line, sep, rest = buf.partition(b"\n")
    m = re.fullmatch(rb"crc32:([0-9a-f]{8})\n?", rest)
    if not sep or m is None:
        raise FormatError(len(line), f"{what}: no checksum line")
    if int(m.group(1), 16) != fmt.crc(fmt.CRC32_ZLIB, line):
        raise FormatError(len(line), f"{what}: checksum mismatch")
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise FormatError(0, f"{what}: not JSON") from exc
    if not isinstance(obj, dict):
        raise FormatError(0, f"{what}: not a JSON object")
    return obj


def _same_dir(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


# --------------------------------------------------------------------------
# results of recovery


@dataclass(frozen=True, slots=True)
class LogRecord:
    """A record as replay yields it: where it lives, and its decoded fields.

    ``payload`` is empty for PUT records (read them with :meth:`Log.read_payload`);
    ``size`` is the whole frame, so ``(file_id, offset, size)`` is a pointer.
    ``salvaged``: the record verifies on its own, but its batch does not (it
    was recovered one record at a time from damaged, acknowledged data).
    """

    op: int
    woid: int
    txn_id: int
    file_id: int
    offset: int
    size: int
    payload: bytes
    salvaged: bool = False


INF_WOID = 1 << 64
"""An upper bound above every write-order id (an open end of a damaged span)."""


@dataclass
class CorruptionReport:
    """Damage that ``on_corruption="skip"`` stepped over (also in ``stats()``).

    ``woid_span`` is ``(a, b)``: the write-order ids of the last record known
    intact before the damage and of the first after it (``INF_WOID`` when
    nothing follows). Replay turns it into ``lost_positions``: the positions
    that no intact COMMIT inside that span claims. ``lost_positions`` is a
    list of half-open ``(first, end)`` ranges.
    """

    path: str
    offset: int
    reason: str
    lost_bytes: int
    woid_span: tuple[int, int] | None = None
    lost_positions: list[tuple[int, int]] = field(default_factory=list)
    file_id: int = 0

    def describe(self) -> str:
        """One line for the log, ``verify`` and ``stats()``."""
        s = f"{self.path} at byte {self.offset}: {self.reason}"
        if self.lost_bytes:
            s += f"; skipped {self.lost_bytes} bytes"
        n = sum(b - a for a, b in self.lost_positions)
        if n:
            s += f", lost positions {format_ranges(self.lost_positions)} ({n} events)"
        return s


def format_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    """Format half-open position ranges as ``"3, 7..9"`` (inclusive, as people read them)."""
    return ", ".join(str(a) if b - a == 1 else f"{a}..{b - 1}" for a, b in ranges if b > a)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and merge overlapping or touching half-open ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def ranges_of(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Turn positions into sorted, merged half-open ranges."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


@dataclass
class _FileScan:
    file_id: int
    path: str
    header: fmt.FileHeader
    records: list[LogRecord]
    end: int  # offset after the last verified batch
    size: int  # file size on disk
    last_woid: int
    header_damaged: bool = False


@dataclass
class CommitResult:
    """What a durable (or, with ``fsync="interval"``, written) commit produced."""

    txn_id: int
    woid: int = 0
    first_position: int = 0
    file_id: int = 0
    put_offsets: list[int] = field(default_factory=list)
    put_sizes: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------
# scanning one data file


def _all_zero(buf: bytes, start: int) -> bool:
    """Return whether every byte of ``buf`` from ``start`` on is zero."""
    n = len(buf) - start
    return n <= 0 or buf.count(0, start) == n


def _find_verified_batch_end(
    buf: bytes, start: int, seed: int, kind: int, max_payload: int
) -> tuple[int, fmt.BatchEnd] | None:
    """Return the first BATCH_END at or after ``start`` whose whole batch verifies."""
    off = start + fmt.pad_len(start)
    n = len(buf)
    find = buf.find
    marker = bytes([fmt.BATCH_END])
    while off + _BATCH_END_SIZE <= n:
        hit = find(marker, off)
        if hit < 0:
            return None
        if hit & 7:
            off = hit + fmt.pad_len(hit)
            continue
        off = hit
        try:
            rec = fmt.decode_record(buf, off, seed, kind, max_payload)
            if isinstance(rec, fmt.Record) and rec.op == fmt.BATCH_END:
                be = fmt.decode_batch_end(rec.payload)
                if (
                    be.batch_start + be.batch_len == off
                    and be.batch_start >= 0
                    and fmt.crc(kind, buf[be.batch_start : off], seed) == be.batch_crc
                ):
                    return off, be
        except FormatError:
            pass
        off += 8
    return None


class _Scanner:
    """Walks one data file's records and classifies damage (policy lives here).

    Only records inside a verified batch count, with two exceptions where the
    channel knows the bytes were acknowledged: a region followed by a verified
    batch, and a region below ``vouched`` (the length a checkpoint recorded).
    Damage there is corruption; with ``on_corruption="skip"`` each record that
    still verifies on its own is salvaged and only what cannot be framed is
    dropped. Damage elsewhere in the newest file is a torn tail.
    """

    def __init__(self, log: Log, path: str, file_id: int, buf: bytes, header: fmt.FileHeader) -> None:
        self.log = log
        self.path = path
        self.file_id = file_id
        self.buf = buf
        self.header = header
        self.kind = log.crc_kind
        self.seed = fmt.file_seed(self.kind, log.channel_id, file_id)
        self.max_payload = log.max_payload

    def scan(
        self, newest: bool, prev_woid: int, start: int | None = None, floor: int = 0, vouched: int = 0
    ) -> _FileScan:
        """Walk the file's records from ``start`` (default: after the header).

        ``prev_woid`` is the last write-order id of the previous file; ``floor``
        is one that every record read must exceed (a checkpoint's, when resuming);
        ``vouched`` is the length a checkpoint recorded for this file: bytes
        below it were durable and acknowledged, so losing them is never a torn tail.
        """
        buf, seed, kind = self.buf, self.seed, self.kind
        records: list[LogRecord] = []
        pending: list[LogRecord] = []
        # ``g`` is the end of the last verified batch; a checkpoint may say where to start.
        g = self.header.header_len if start is None else start
        pos = g
        last_woid = max(prev_woid, self.header.base_woid - 1)
        batch_last_woid = max(last_woid, floor)
        n = len(buf)
        fid = self.file_id
        if vouched > n:
            self._truncated(n, vouched, last_woid)
        while True:
            if pos >= n and not pending:
                break
            bad_reason = None
            try:
                rec = fmt.decode_record(buf, pos, seed, kind, self.max_payload)
            except FormatError as exc:
                rec = None
                bad_reason = exc.reason
            if rec is fmt.INCOMPLETE:
                bad_reason = "incomplete record at end of file" if pos < n else "batch without BATCH_END"
                rec = None
            if rec is not None:
                assert isinstance(rec, fmt.Record)
                if rec.woid <= batch_last_woid:
                    bad_reason = f"write-order id {rec.woid} does not increase (previous {batch_last_woid})"
                elif rec.op == fmt.BATCH_END:
                    try:
                        be = fmt.decode_batch_end(rec.payload)
                    except FormatError as exc:
                        be = None
                        bad_reason = exc.reason
                    if be is not None:
                        if be.batch_start != g or be.batch_len != pos - g:
                            bad_reason = "BATCH_END does not cover the preceding batch"
                        elif fmt.crc(kind, buf[g:pos], seed) != be.batch_crc:
                            bad_reason = "batch checksum mismatch"
                        elif not pending or be.first_woid != pending[0].woid or be.last_woid != pending[-1].woid:
                            bad_reason = "BATCH_END's write-order ids do not match its batch"
                        else:
                            records.extend(pending)
                            pending = []
                            batch_last_woid = rec.woid
                            last_woid = rec.woid
                            pos = g = rec.end
                            continue
                else:
                    payload = b"" if rec.op == fmt.PUT else rec.payload
                    pending.append(LogRecord(rec.op, rec.woid, rec.txn_id, fid, pos, rec.size, payload))
                    batch_last_woid = rec.woid
                    pos = rec.end
                    continue
            # Damage (or an unterminated batch) at ``pos``; the verified prefix ends at ``g``.
            assert bad_reason is not None
            resumed = self._handle_damage(newest, g, pos, bad_reason, records, max(last_woid, floor), vouched)
            if resumed is None:
                break
            g = pos = resumed
            pending = []
            if records:
                last_woid = max(last_woid, records[-1].woid)
            batch_last_woid = max(last_woid, floor)
        return _FileScan(fid, self.path, self.header, records, g, n, last_woid)

    def _truncated(self, size: int, vouched: int, last_woid: int) -> None:
        """The file is shorter than a checkpoint recorded: acknowledged bytes are gone."""
        reason = f"data file is {vouched - size} bytes shorter than the checkpoint recorded ({vouched} bytes)"
        log = self.log
        if log.config.on_corruption != "skip":
            raise CorruptLogError(self.path, size, reason)
        log._report_corruption(
            CorruptionReport(self.path, size, reason, vouched - size, (last_woid, INF_WOID), file_id=self.file_id)
        )

    def _handle_damage(
        self, newest: bool, g: int, x: int, reason: str, records: list[LogRecord], last_woid: int, vouched: int
    ) -> int | None:
        """Decide what damage at ``x`` means. Return the offset to resume at, or None to stop."""
        log = self.log
        buf = self.buf
        n = len(buf)
        if newest and g >= vouched and _all_zero(buf, g):
            return None  # the zero-filled space ahead of the writer: a clean end
        after = _find_verified_batch_end(buf, x, self.seed, self.kind, self.max_payload)
        if after is not None and after[1].batch_start < g:
            after = None
        if newest and g >= vouched:
            if after is None:
                # A torn, unacknowledged tail: nothing verified follows it.
                log._note_torn_tail(self.path, g, n, reason)
                return None
            if log.config.fsync == "interval":
                # With interval fsync, writeback may persist a later write before an
                # earlier one; the recovered state must stay a prefix of the commit
                # order, so everything from the damage on is dropped.
                logger.error(
                    "%s: %s at byte %d followed by intact writes; fsync='interval' keeps a prefix, "
                    "dropping %d bytes from byte %d",
                    self.path,
                    reason,
                    x,
                    n - g,
                    g,
                )
                log._note_torn_tail(self.path, g, n, reason)
                return None
        if after is not None:
            stop = after[1].batch_start
            problem = f"{reason}, and acknowledged records follow it"
        elif newest:
            stop = min(vouched, n)
            problem = f"{reason} in data a checkpoint recorded as written"
        else:
            stop = n
            problem = f"{reason} in a sealed data file"
        if log.config.on_corruption != "skip":
            raise CorruptLogError(self.path, x, problem)
        self._salvage(g, stop, records, last_woid, problem)
        return stop if stop < n else None

    def _salvage(self, start: int, stop: int, records: list[LogRecord], last_woid: int, problem: str) -> None:
        """Keep every record in ``[start, stop)`` that verifies on its own; report the rest.

        A record whose frame is intact but whose checksum fails is stepped over
        by its length when the next record verifies; elsewhere the scan moves on
        in 8-byte steps to the next record that verifies. Each stretch of bytes
        that could not be read becomes one report.
        """
        buf, fid = self.buf, self.file_id
        view = memoryview(buf)[:stop]
        pos = start
        prev = last_woid
        bad_at = -1
        found = False
        while pos < stop:
            rec = self._decode_at(view, pos, prev)
            if rec is not None:
                if bad_at >= 0:
                    self._dropped(bad_at, pos, prev, rec.woid, problem)
                    bad_at = -1
                if rec.op != fmt.BATCH_END:
                    payload = b"" if rec.op == fmt.PUT else rec.payload
                    records.append(LogRecord(rec.op, rec.woid, rec.txn_id, fid, pos, rec.size, payload, True))
                prev = rec.woid
                pos = rec.end
                continue
            if bad_at < 0:
                bad_at = pos
                found = True
            # Step over a frame whose length still makes sense, else move on by 8 bytes.
            nxt = pos + 8
            if pos + fmt.RECORD_HEADER_LEN <= stop:
                length = _U32.unpack_from(buf, pos + 4)[0]
                skip = pos + fmt.record_size(length)
                if pos < skip < stop and self._decode_at(view, skip, prev) is not None:
                    nxt = skip
            pos = nxt
        if bad_at >= 0:
            self._dropped(bad_at, stop, prev, INF_WOID, problem)
        if not found:  # every record verified: only framing (a BATCH_END, a batch checksum) was damaged
            self.log._report_corruption(
                CorruptionReport(self.path, start, f"{problem}; every record verified on its own", 0, file_id=fid)
            )

    def _decode_at(self, view: memoryview, pos: int, prev: int) -> fmt.Record | None:
        try:
            rec = fmt.decode_record(view, pos, self.seed, self.kind, self.max_payload)
        except FormatError:
            return None
        if isinstance(rec, fmt.Record) and rec.woid > prev:
            return rec
        return None

    def _dropped(self, a: int, b: int, woid_lo: int, woid_hi: int, problem: str) -> None:
        self.log._report_corruption(
            CorruptionReport(self.path, a, problem, b - a, (woid_lo, woid_hi), file_id=self.file_id)
        )


# --------------------------------------------------------------------------
# writing: one writer per data directory


class _Item:
    """One unit handed to a writer: a transaction, a rollback note or retirements."""

    __slots__ = (
        "done",
        "durable",
        "error",
        "kind",
        "nbytes",
        "on_written",
        "payloads",
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
    ) -> None:
        self.kind = kind
        self.txn_id = txn_id
        self.payloads = payloads
        self.takes = takes
        self.durable = durable
        self.on_written = on_written
        self.retire = retire
        self.result = CommitResult(txn_id)
        self.done = False
        self.published = False
        self.error: BaseException | None = None
        self.wake: Any = None  # a held lock its committer blocks on until a leader releases it
        rs = fmt.record_size
        if kind == fmt.COMMIT:
            n = sum([(k + 39) & ~7 for k in map(len, payloads)]) + rs(16)  # rs(k) == (k + 39) & ~7
            if takes:
                n += rs(4 + 16 * len(takes))
        elif kind == fmt.ROLLBACK:
            n = rs(8)
        else:
            n = rs(8) * len(retire)
        self.nbytes = n


class _Writer:
    """Appends batches to the active data file of one data directory."""

    def __init__(self, log: Log, index: int, path: str, live: list[int]) -> None:
        self.log = log
        self.index = index
        self.path = path
        self.live = live  # file ids of this directory that are part of the channel
        self.lock = threading.Lock()  # guards pending, leading, waiting and items' wake locks
        self.pending: list[_Item] = []
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
        self._unpublished: list[_Item] = []
        self.waiting = 0  # committers waiting for a leader's write

    # -- called by committers ------------------------------------------------

    def submit(self, item: _Item) -> None:
        """Queue ``item``; return when it is written (and durable if it asks to be).

        The first committer to find no leader leads: it writes everything
        pending, again and again, until nothing is pending. The others block
        on their item's own lock, which the leader releases once the item is
        written (no thundering herd), or when it stops leading with the item
        still pending (then one of them leads).
        """
        lock = self.lock
        with lock:
            self.log._check_writable()
            self.pending.append(item)
            if not item.durable and not item.on_written:
                return  # rides along with the next write
        while True:
            with lock:
                if item.done:
                    break
                lead = not self.leading
                if lead:
                    self.leading = True
                else:
                    wake = item.wake = threading.Lock()
                    wake.acquire()
                    self.waiting += 1
            if not lead:
                wake.acquire()
                continue
            try:
                self._lead()  # returns having given up leadership
            except BaseException:
                with lock:
                    self.leading = False
                    for it in self.pending:
                        self._wake(it)
                raise
            break  # a leader writes until nothing is pending: its own item is done
        if item.error is not None:
            raise item.error

    def _wake(self, item: _Item) -> None:
        """Release ``item``'s committer if it is blocked (the caller holds ``lock``)."""
        wake = item.wake
        if wake is not None:
            item.wake = None
            self.waiting -= 1
            wake.release()

    def _lead(self) -> None:
        """Write pending items until none is left, then stop leading (under ``lock``)."""
        lock = self.lock
        batch: list[_Item] = []
        while True:
            if self.waiting or len(batch) > 1:
                # Other committers are about: let those ready to run (just woken, or
                # waiting for the GIL) queue their transactions first. Bigger groups,
                # fewer fdatasyncs: +30% commits/s with 16 threads on 2 cores.
                time.sleep(0)
            with lock:
                batch = self.pending
                if not any(i.durable or i.on_written for i in batch):
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

    # -- I/O (leader only) ------------------------------------------------------

    def _write_batch_locked(self, batch: list[_Item], closing: bool = False) -> None:
        """Write ``batch`` (rolling files as needed); the caller holds ``io_lock``.

        ``closing``: the log's close writes what was still pending, past the
        check that refuses new work once closing has begun.
        """
        log = self.log
        if not closing or log._failed is not None:
            log._check_writable()
        limit = log.config.max_file_size
        chunk: list[_Item] = []
        size = 0
        for it in batch:
            if self.fd is None:
                self._roll()
            room = limit - self.offset - _BATCH_END_SIZE
            if chunk and size + it.nbytes > room:
                self._write_chunk(chunk)
                chunk, size = [], 0
                room = limit - self.offset - _BATCH_END_SIZE
            if not chunk and it.nbytes > room and self.offset > self.header_len:
                self._roll()
            chunk.append(it)
            size += it.nbytes
        if chunk:
            self._write_chunk(chunk)
        if log.config.fsync == "commit":
            self._sync()

    def _write_chunk(self, chunk: list[_Item]) -> None:
        log = self.log
        enc = self.encoder
        start = self.offset
        parts: list[bytes] = []
        off = start
        file_id = self.file_id
        with log._seq_lock:
            first_woid = log._next_woid
            woid = first_woid
            for it in chunk:
                res = it.result
                res.file_id = file_id
                if it.kind == fmt.COMMIT:
                    txn = it.txn_id
                    offs = res.put_offsets
                    sizes = res.put_sizes
                    off = enc.add_puts(parts, woid, txn, it.payloads, offs, sizes, off)
                    woid += len(it.payloads)
                    if it.takes:
                        off += enc.add(parts, fmt.TAKE, woid, txn, fmt.encode_take(it.takes))
                        woid += 1
                    res.first_position = log._next_position
                    log._next_position += len(it.payloads)
                    res.woid = woid
                    n_taken = sum(c for _, c in it.takes)
                    off += enc.add(
                        parts, fmt.COMMIT, woid, txn, fmt.encode_commit(res.first_position, len(it.payloads), n_taken)
                    )
                    woid += 1
                elif it.kind == fmt.ROLLBACK:
                    assert isinstance(it, _RollbackItem)
                    off += enc.add(parts, fmt.ROLLBACK, woid, it.txn_id, fmt.encode_rollback(*it.counts))
                    woid += 1
                else:
                    for fid in it.retire:
                        off += enc.add(parts, fmt.RETIRE, woid, 0, fmt.encode_retire(fid))
                        woid += 1
            body = b"".join(parts)
            be = fmt.BatchEnd(start, len(body), fmt.crc(log.crc_kind, body, self.seed), first_woid, woid - 1)
            tail: list[bytes] = []
            enc.add(tail, fmt.BATCH_END, woid, 0, fmt.encode_batch_end(be))
            log._next_woid = woid + 1
        data = body + b"".join(tail)
        assert self.fd is not None
        try:
            log.fs.pwrite_all(self.fd, data, start)
        except OSError as exc:
            self._undo_write(start, exc)
            raise
        end = self.offset = start + len(data)
        self.phys_end = max(self.phys_end, end)
        log._bytes_written += len(data)
        log._space_used(self.index, len(data))
        if self.phys_end - end < PREALLOC_STEP // 2:
            self._preallocate(start, end)
        self._unpublished.extend(chunk)
        if log.config.fsync == "interval":
            self._publish()

    def _sync(self) -> None:
        log = self.log
        if self.fd is None or self.synced == self.offset:
            self._publish()
            return
        try:
            log.fs.fdatasync(self.fd)
        except OSError as exc:
            log._fail(exc, f"fdatasync of {self._path(self.file_id)} failed")
            self._unpublished.clear()
            raise
        log._fsyncs += 1
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
                    log._fail(exc2, f"truncate after failed zero-fill of {self._path(self.file_id)} failed")
                    raise
                self.phys_end = end
                return
            self._undo_write(start, exc)
            raise
        self.phys_end = to
        log._space_used(self.index, to - frm)

    def _undo_write(self, start: int, exc: OSError) -> None:
        """A write failed: cut the file back so no partial record stays behind."""
        log = self.log
        assert self.fd is not None
        self.phys_end = start
        try:
            log.fs.truncate(self.fd, start)
        except OSError as exc2:
            log._fail(exc2, f"truncate after failed write to {self._path(self.file_id)} failed")
            return
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            log._fail(exc, f"write to {self._path(self.file_id)} failed")

    def _path(self, file_id: int) -> str:
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
                    log._fail(exc, f"sealing {self._path(self.file_id)} failed")
                    raise
                log._fsyncs += 1
                self.synced = self.offset
            self._publish()
            log._file_end[self.file_id] = self.offset
            fs.close(self.fd)
            self.fd = None
        with log._seq_lock:
            file_id = log._next_file_id
            log._next_file_id += 1
            header = fmt.FileHeader(
                crc_kind=log.crc_kind,
                channel_id=log.channel_id,
                file_id=file_id,
                base_woid=log._next_woid,
                next_position=log._next_position,
                next_txn_id=log._peek_txn_id(),
                created_ns=time.time_ns(),
                live_files=tuple(self.live),
            )
        data = fmt.encode_file_header(header)
        path = self._path(file_id)
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
                log._fail(exc, f"creating {path} failed")
            raise
        log._fsyncs += 2
        log._register_file(file_id, self.index, path)
        self.live.append(file_id)
        self.fd = fd
        self.file_id = file_id
        self.offset = self.synced = self.header_len = self.phys_end = len(data)
        self.seed = fmt.file_seed(log.crc_kind, log.channel_id, file_id)
        self.encoder = fmt.record_encoder(self.seed, log.crc_kind)
        log._files_created += 1
        logger.debug("started data file %s", path)

    def sync_now(self) -> None:
        """Make everything written so far durable (the interval syncer)."""
        with self.io_lock:
            if self.log._failed is not None or self.fd is None or self.synced == self.offset:
                return
            try:
                self.log.fs.fdatasync(self.fd)
            except OSError as exc:
                self.log._fail(exc, f"background fdatasync of {self._path(self.file_id)} failed")
                return
            self.log._fsyncs += 1
            self.synced = self.offset

    def close(self) -> None:
        with self.io_lock:
            if self.fd is not None:
                fd, self.fd = self.fd, None
                try:
                    if self.log._failed is None and (self.synced != self.offset or self.phys_end > self.offset):
                        if self.phys_end > self.offset:
                            self.log.fs.truncate(fd, self.offset)  # leave no zero-filled tail behind
                        self.log.fs.fdatasync(fd)
                        self.log._fsyncs += 1
                finally:
                    self.log.fs.close(fd)


# --------------------------------------------------------------------------
# the log


class Log:
    """The append-only record log of one channel directory.

    Opening a ``Log`` locks the directory, creates it if needed, and recovers:
    it validates every data file, truncates a torn tail, and keeps the records
    for :meth:`replay`. Records carry a write-order id that strictly increases
    across records, files and restarts.

    Args:
        directory: The channel directory.
        config: Channel options (``ChannelConfig()`` when omitted).
        fs: The I/O seam (tests pass a simulated file system).
        readonly: Inspect without locking, creating or repairing anything.
        checkpoints: Where checkpoints live; recovery starts from the newest
            usable one (unless ``replay="full"``), falling back to older ones.
        skip_checkpoints: Paths of checkpoints not to use (the channel found them wrong).
        progress: Called with a short message as recovery reads each data file.

    Raises:
        ChannelLockedError: Another open channel holds the directory.
        CorruptLogError: Acknowledged data is damaged, missing or foreign.
        NotAChannelError: ``directory`` exists but is not a channel directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: ChannelConfig | None = None,
        *,
        fs: FS | None = None,
        readonly: bool = False,
        checkpoints: CheckpointStore | None = None,
        skip_checkpoints: Sequence[str] = (),
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.checkpoints = checkpoints
        self._progress = progress
        self._skip_checkpoints = set(skip_checkpoints)
        self.base_snapshot: Snapshot | None = None
        self.recovered_from: StoredCheckpoint | None = None
        self.checkpoint_fallbacks: list[str] = []
        self._retire_lock = threading.Lock()
        self._woid_floor = 0
        self._closing = False
        self._file_end: dict[int, int] = {}
        self.file_sizes: dict[int, int] = {}  # data file sizes found at open (recovery's view)
        self.config = config or ChannelConfig()
        self.fs: FS = fs or DEFAULT_FS
        self.readonly = readonly
        # A limit of the format (the u32 length field), not of this open's options: a
        # channel written with a larger max_event_size must still replay, and a smaller
        # limit made intact records look corrupt (or cut an acknowledged tail as torn).
        # Declared lengths are still checked against the bytes left before any read.
        self.max_payload = 0xFFFF_FFFF
        self._seq_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._failed: BaseException | None = None
        self._failed_msg = ""
        self._closed = False
        self._lock_handle: int | None = None
        self._files: dict[int, tuple[int, str]] = {}  # file_id -> (dir index, path)
        self._seeds: dict[int, int] = {}
        self._read_fds: dict[int, int] = {}
        self._scans: list[_FileScan] = []
        self.corruption: list[CorruptionReport] = []
        self.torn_tails: list[tuple[str, int, int]] = []
        self.discarded: set[int] = set()  # files set aside at open (never retired)
        self.voucher: Snapshot | None = None  # the newest checkpoint that decodes
        self.voucher_path: str | None = None
        self.retired_files: set[int] = set()  # files the voucher lists that are known retired
        self.missing_files: set[int] = set()  # files that are gone without a trace of retirement
        self.position_floor = 0  # replay's position accounting starts here
        self._legacy_dirs = False  # DATA_DIRS is missing or of version 1: rewrite it after recovery
        self._dir_lost = False  # a data directory was missing (skip mode): only RETIRE records prove retirement
        self._next_woid = 1
        self._next_position = 0
        self._next_file_id = 1
        self._txn_ids = itertools.count(1)
        self._txn_peek = 1
        self._fsyncs = 0
        self._bytes_written = 0
        self._files_created = 0
        self._files_retired = 0
        self._space: dict[int, tuple[float, int]] = {}
        self._space_written: dict[int, int] = {}
        self._syncer: threading.Thread | None = None
        self._stop = threading.Event()
        self._extra_locks: list[int] = []
        self._writers: list[_Writer] = []
        d = self.config.data_dirs
        self.data_dirs = list(d) if d else [os.path.join(self.directory, DEFAULT_DATA_DIR)]
        try:
            self._open()
        except BaseException:
            self._release()
            raise

    # -- opening ----------------------------------------------------------------

    def _open(self) -> None:
        fs = self.fs
        top = self.directory
        if fs.exists(top) and not fs.isdir(top):
            raise NotAChannelError(top, "it is a file")
        chan_path = os.path.join(top, CHANNEL_FILE)
        if not fs.exists(top) or not fs.exists(chan_path):
            if self.readonly:
                raise NotAChannelError(top, "no CHANNEL file (create a channel with filechannel.open)")
            self._create(chan_path)
        else:
            if not self.readonly:
                self._lock(top)
        try:
            self.channel_id, self.crc_kind, self.created_ns = decode_channel_file(read_file(fs, chan_path))
        except FormatError as exc:
            raise CorruptLogError(chan_path, exc.offset, exc.reason) from exc
        self._load_data_dirs()
        rewrite = self._check_data_dirs()
        self._recover()
        if not self.readonly:
            # Recovery checked every data file against this channel's id: now record
            # (or update, after a move) who owns each data directory.
            for i in rewrite:
                self._write_identity(i)
            if self._legacy_dirs:
                self._write_data_dirs()
        if not self.readonly and self.config.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="filechannel-fsync", daemon=True)
            self._syncer.start()

    def _internal(self, d: str) -> bool:
        """Whether data directory ``d`` lies inside the channel directory (moves with it)."""
        top = os.path.abspath(self.directory)
        a = os.path.abspath(d)
        return a != top and os.path.commonpath([a, top]) == top

    def _check_data_dirs(self) -> list[int]:
        """Check that every data directory is there and this channel's; lock each.

        Returns the indexes of directories whose identity file must be (re)written
        once recovery has checked their data files.

        Raises:
            CorruptLogError: A data directory is missing, empty where data was
                recorded, or belongs to another channel.
            ChannelCopyError: This directory is a copy of a live channel whose data
                directory it would share.
        """
        fs = self.fs
        rewrite: list[int] = []
        for i, d in enumerate(self.data_dirs):
            ident_path = os.path.join(d, DATA_DIR_ID_FILE)
            has_segs = fs.exists(d) and any(_SEG_RE.match(n) for n in fs.listdir(d))
            if not fs.exists(d) or (not fs.exists(ident_path) and not has_segs and not self._legacy_dirs):
                what = "missing" if not fs.exists(d) else "empty (no identity file, no data files)"
                reason = f"data directory is {what}: moved, deleted, or its disk is not mounted"
                if self.config.on_corruption != "skip":
                    raise CorruptLogError(d, 0, reason, _DATA_DIR_HINT)
                self._report_corruption(CorruptionReport(d, 0, reason, 0))
                self._dir_lost = True
                if self.readonly:
                    continue
                self._make_dir(d)
                rewrite.append(i)
            elif not fs.exists(ident_path):
                rewrite.append(i)  # written by an older version, or its identity file was lost
            else:
                try:
                    ident = decode_meta(read_file(fs, ident_path), "data directory identity")
                    cid = bytes.fromhex(str(ident["channel_id"]))
                    owner = ident.get("owner")
                except (FormatError, KeyError, ValueError) as exc:
                    raise CorruptLogError(ident_path, 0, f"unreadable data directory identity: {exc}") from exc
                if cid != self.channel_id:
                    raise CorruptLogError(
                        d,
                        0,
                        f"data directory belongs to another channel (id {cid.hex()}, this is {self.channel_id.hex()})",
                        "pass the data_dirs this channel was created with, or restore its own data directory",
                    )
                if not self._internal(d) and isinstance(owner, str) and not _same_dir(owner, self.directory):
                    if self._owner_is_live(owner):
                        raise ChannelCopyError(self.directory, owner, d)
                    rewrite.append(i)  # the channel directory moved: it owns the data directory now
            if not self.readonly:
                self._extra_locks.append(self._lock_path(os.path.join(d, LOCK_FILE)))
        return rewrite

    def _owner_is_live(self, owner: str) -> bool:
        """Whether ``owner`` is a channel directory with this channel's id (the original of a copy)."""
        path = os.path.join(owner, CHANNEL_FILE)
        try:
            return self.fs.exists(path) and decode_channel_file(read_file(self.fs, path))[0] == self.channel_id
        except (FormatError, OSError):
            return False

    def _make_dir(self, d: str) -> None:
        """Create a directory; its entry (and any parent's) is durable before files in it count."""
        fs = self.fs
        missing = []
        p = os.path.abspath(d)
        while not fs.exists(p):
            missing.append(p)
            p = os.path.dirname(p)
        fs.makedirs(d)
        for m in missing:
            fs.fsync_dir(os.path.dirname(m))

    def _write_identity(self, index: int) -> None:
        d = self.data_dirs[index]
        owner = None if self._internal(d) else os.path.abspath(self.directory)
        data = encode_meta({"channel_id": self.channel_id.hex(), "index": index, "owner": owner, "version": 1})
        self._write_small_file(os.path.join(d, DATA_DIR_ID_FILE), data)
        self.fs.fsync_dir(d)

    def _write_data_dirs(self) -> None:
        """Record the data directories: relative inside the channel directory, absolute outside it."""
        top = os.path.abspath(self.directory)
        entries = [
            os.path.relpath(os.path.abspath(d), top) if self._internal(d) else os.path.abspath(d)
            for d in self.data_dirs
        ]
        self._write_small_file(
            os.path.join(self.directory, DATA_DIRS_FILE), encode_meta({"data_dirs": entries, "version": 2})
        )
        self.fs.fsync_dir(self.directory)
        self._legacy_dirs = False

    def _lock_path(self, path: str) -> int:
        try:
            return self.fs.lock(path)
        except BlockingIOError as exc:
            raise ChannelLockedError(os.path.dirname(path)) from exc

    def _lock(self, top: str) -> None:
        self._lock_handle = self._lock_path(os.path.join(top, LOCK_FILE))

    def _write_small_file(self, path: str, data: bytes) -> None:
        """Write a file atomically: a temporary file, fsync, rename over (the caller fsyncs the directory)."""
        fs = self.fs
        tmp = path + ".tmp"
        if fs.exists(tmp):
            fs.unlink(tmp)
        fd = fs.create(tmp)
        try:
            fs.pwrite_all(fd, data, 0)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, path)

    def _load_data_dirs(self) -> None:
        """Use the data directories recorded at creation; refuse a different list.

        ``DATA_DIRS`` (version 2) holds paths relative to the channel directory for
        data directories inside it, so a moved or restored channel finds its data.
        Version 1 (absolute paths, no checksum) is read too: a recorded
        ``<old>/data`` of a channel that was moved or copied here becomes this
        directory's own ``data``.
        """
        fs = self.fs
        top = self.directory
        path = os.path.join(top, DATA_DIRS_FILE)
        if not fs.exists(path):
            self._legacy_dirs = True  # created before DATA_DIRS existed: the default or the given list
            return
        buf = read_file(fs, path)
        if b"\ncrc32:" in buf:
            try:
                recorded = decode_meta(buf, "DATA_DIRS")["data_dirs"]
                if (
                    not isinstance(recorded, list)
                    or not recorded
                    or not all(isinstance(d, str) and d for d in recorded)
                ):
                    raise FormatError(0, "data_dirs must be a non-empty list of paths")
            except (FormatError, KeyError) as exc:
                raise CorruptLogError(path, 0, f"unreadable list of data directories: {exc}") from exc
            dirs = [d if os.path.isabs(d) else os.path.join(top, d) for d in recorded]
        else:
            try:
                recorded = json.loads(buf)["data_dirs"]
                if (
                    not isinstance(recorded, list)
                    or not recorded
                    or not all(isinstance(d, str) and d for d in recorded)
                ):
                    raise ValueError("data_dirs must be a non-empty list of paths")
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptLogError(path, 0, f"unreadable list of data directories: {exc}") from exc
            self._legacy_dirs = True
            own = os.path.join(top, DEFAULT_DATA_DIR)
            dirs = []
            for d in recorded:
                old_top = os.path.dirname(d)
                if (
                    os.path.basename(d) == DEFAULT_DATA_DIR
                    and not _same_dir(old_top, top)
                    and fs.exists(own)
                    and own not in dirs
                ):
                    d = own  # this channel's default data directory, recorded under an old path
                dirs.append(d)
        if self.config.data_dirs is not None:
            given = [os.path.abspath(d) for d in self.config.data_dirs]
            if given != [os.path.abspath(d) for d in dirs]:
                raise ConfigError(
                    "data_dirs",
                    f"the channel was created with data_dirs={[os.path.abspath(d) for d in dirs]}; "
                    "pass the same list, or omit data_dirs",
                )
        self.data_dirs = dirs

    def _create(self, chan_path: str) -> None:
        fs = self.fs
        top = self.directory
        existed = fs.exists(top)
        fs.makedirs(top)
        self._lock(top)
        if fs.exists(chan_path):  # created concurrently before we took the lock
            return
        # What a crash in the middle of an earlier creation leaves behind.
        leftovers = {LOCK_FILE, CHANNEL_FILE + ".tmp", DATA_DIRS_FILE, DATA_DIRS_FILE + ".tmp"}
        made = {LOCK_FILE, DATA_DIR_ID_FILE, DATA_DIR_ID_FILE + ".tmp"}
        for d in self.data_dirs:
            if self._internal(d) and fs.exists(d) and not set(fs.listdir(d)) - made:
                leftovers.add(os.path.relpath(os.path.abspath(d), os.path.abspath(top)).split(os.sep)[0])
        others = [n for n in fs.listdir(top) if n not in leftovers]
        if others:
            raise NotAChannelError(
                top, f"it holds {len(others)} other entries but no CHANNEL file; use an empty directory"
            )
        for d in self.data_dirs:
            if fs.exists(d) and any(_SEG_RE.match(n) for n in fs.listdir(d)):
                raise NotAChannelError(top, f"no CHANNEL file, but data directory {d} holds data files of some channel")
        # Where the data lives is recorded first, so every later open finds it;
        # CHANNEL is written last: its presence marks a complete creation.
        self.channel_id = uuid.uuid4().bytes
        self._write_data_dirs()
        for i, d in enumerate(self.data_dirs):
            self._make_dir(d)
            self._write_identity(i)
        data = encode_channel_file(self.channel_id, fmt.default_crc_kind(), time.time_ns())
        self._write_small_file(chan_path, data)
        fs.fsync_dir(top)
        if not existed:
            parent = os.path.dirname(os.path.abspath(top))
            fs.fsync_dir(parent)
        logger.info("created channel %s", top)

    def _recover(self) -> None:
        store = self.checkpoints
        found = store.list() if store is not None else []
        # Write-order ids never go below a checkpoint on disk, even one that is not
        # used (recovery may have cut records it covered, as damage): a checkpoint
        # written from now on must sort after it, or pruning would keep the old one.
        self._woid_floor = max((c.woid for c in found), default=0)
        # The newest checkpoint that decodes vouches for what was durable when it was
        # written: the length of every live file and every queued event. Data that
        # disagrees with it is damaged data, never a reason to forget what it knew,
        # so it is used to check any recovery, a full replay included.
        for c in found:
            if c.path in self._skip_checkpoints or store is None:
                continue
            try:
                snap = store.load(c, self.crc_kind, self.channel_id)
            except (FormatError, OSError) as exc:
                self._checkpoint_fallback(c.path, str(exc))
                continue
            self.voucher = snap
            self.voucher_path = c.path
            if self.config.replay == "checkpoint":
                try:
                    self._recover_with(snap)
                except _CheckpointUnusable as exc:
                    self._checkpoint_fallback(c.path, str(exc))
                    self._reset_recovery()
                    continue
                self.recovered_from = c
                self.base_snapshot = snap
                return
            break
        self._recover_with(None)

    def _reset_recovery(self) -> None:
        self._files.clear()
        self._seeds.clear()
        self._file_end.clear()
        self.file_sizes.clear()
        self.retired_files.clear()
        self.missing_files.clear()
        self.corruption.clear()
        self.torn_tails.clear()
        self.voucher = None

    def _checkpoint_fallback(self, path: str, reason: str) -> None:
        self.checkpoint_fallbacks.append(f"{path}: {reason}")
        logger.warning("checkpoint %s is not usable (%s); trying an older one, else a full replay", path, reason)

    def _recover_with(self, snap: Snapshot | None) -> None:
        scans: list[_FileScan] = []
        live_by_dir: list[list[int]] = []
        max_next_pos = 0
        max_txn = 0
        max_woid = 0
        max_file_id = 0
        newest_by_dir: list[tuple[int, frozenset[int] | None]] = []
        retired: set[int] = set()
        for index, d in enumerate(self.data_dirs):
            dscans, max_id, newest, retired_d = self._recover_dir(index, d, snap)
            retired |= retired_d
            if newest is not None:
                newest_by_dir.append(newest)
            max_file_id = max(max_file_id, max_id)
            live_by_dir.append([s.file_id for s in dscans])
            for s in dscans:
                max_next_pos = max(max_next_pos, s.header.next_position)
                max_txn = max(max_txn, s.header.next_txn_id - 1)
                max_woid = max(max_woid, s.header.base_woid - 1, s.last_woid)
                for r in s.records:
                    if r.txn_id > max_txn:
                        max_txn = r.txn_id
                    if r.op == fmt.COMMIT:
                        fp, npt, _ = fmt.decode_commit(r.payload)
                        if fp + npt > max_next_pos:
                            max_next_pos = fp + npt
                    elif r.op == fmt.RETIRE:
                        retired.add(fmt.decode_retire(r.payload))
            scans.extend(dscans)
        max_woid = max(max_woid, self._woid_floor)
        if snap is not None:
            max_next_pos = max(max_next_pos, snap.next_position)
            max_txn = max(max_txn, snap.next_txn_id - 1)
            max_woid = max(max_woid, snap.woid)
            max_file_id = max(max_file_id, snap.next_file_id - 1)
        if self.voucher is not None:
            max_next_pos = max(max_next_pos, self.voucher.next_position)
            self._classify_vanished(retired, newest_by_dir)
        # Where replay's position accounting starts: positions below the oldest live
        # file's first were in files retired long ago.
        if snap is not None:
            self.position_floor = snap.next_position
        elif scans and not any(s.header_damaged for s in scans):
            self.position_floor = min(s.header.next_position for s in scans)
        elif self.voucher is not None and len(self.voucher):
            self.position_floor = self.voucher.positions[0]
        else:
            self.position_floor = 0
        self._scans = scans
        self._next_woid = max_woid + 1
        self._next_position = max_next_pos
        self._next_file_id = max_file_id + 1
        self._txn_ids = itertools.count(max_txn + 1)
        self._txn_peek = max_txn + 1
        self._writers = [_Writer(self, i, d, live_by_dir[i]) for i, d in enumerate(self.data_dirs)]

    def _classify_vanished(self, retired: set[int], newest_by_dir: list[tuple[int, frozenset[int] | None]]) -> None:
        """Sort the checkpointed files that are gone into retired ones and missing ones.

        A file is known retired when a RETIRE record names it, or when the newest
        file of a data directory is newer and does not list it as live (a retired
        file leaves the live list before its RETIRE is written). Any other file the
        checkpoint vouched for and that is gone is missing: its events are lost.
        """
        assert self.voucher is not None
        gone = set(self.voucher.files) - set(self._files) - self.discarded
        for fid in sorted(gone):
            listed = not self._dir_lost and any(
                fid < n and live is not None and fid not in live for n, live in newest_by_dir
            )
            if fid in retired or listed:
                self.retired_files.add(fid)
                continue
            path = os.path.join(self.data_dirs[0], segment_name(fid))
            reason = "data file is missing, but the newest checkpoint lists it as live"
            if self.config.on_corruption != "skip":
                raise CorruptLogError(path, 0, reason, _MISSING_HINT)
            self.missing_files.add(fid)
            span = (self.voucher.woid, INF_WOID)
            self._report_corruption(CorruptionReport(path, 0, reason, 0, span, file_id=fid))

    def _start(self, snap: Snapshot | None, fid: int, h: fmt.FileHeader, size: int) -> int | None:
        """Return where a checkpoint says replay resumes in a file, or None to scan it all.

        A file shorter than the checkpoint recorded resumes at its end: the records
        the checkpoint covered are in the snapshot, and the scan reports the loss.
        """
        if snap is None or fid not in snap.files:
            return None
        r = snap.files[fid]
        if r < h.header_len or r & 7:
            raise _CheckpointUnusable(f"resume offset {r} does not fit {segment_name(fid)} ({size} bytes)")
        return min(r, size)

    def _vouched(self, fid: int) -> int:
        """The length the newest checkpoint recorded for a file (0: it vouches for nothing)."""
        v = self.voucher
        return v.files.get(fid, 0) if v is not None else 0

    def _read_data_file(self, path: str, fid: int, snap: Snapshot | None) -> tuple[bytes, int]:
        """Read a data file, only its header when a checkpoint covers all of it; return it and its size."""
        fs = self.fs
        fd = fs.open_read(path)
        try:
            size = fs.size(fd)
            if snap is not None and snap.files.get(fid) == size:
                head = fs.pread(fd, min(size, 4096), 0)
                try:
                    if isinstance(fmt.decode_file_header(head), fmt.FileHeader):
                        return head, size
                except FormatError:
                    pass  # a damaged header: read it all, _read_header classifies it
            return fs.pread(fd, size, 0), size
        finally:
            fs.close(fd)

    def _recover_dir(
        self, index: int, d: str, snap: Snapshot | None = None
    ) -> tuple[list[_FileScan], int, tuple[int, frozenset[int] | None] | None, set[int]]:
        """Recover one data directory.

        Returns its scans, the highest file id seen, ``(newest file id, its live
        list or None when its header is damaged)`` and the file ids its newest
        file's RETIRE records name.
        """
        fs = self.fs
        if not fs.exists(d):
            return [], 0, None, set()
        ids = sorted(int(m.group(1), 16) for n in fs.listdir(d) if (m := _SEG_RE.match(n)))
        if not ids:
            return [], 0, None, set()
        max_id = ids[-1]
        # 1. The newest file decides which files belong to the channel.
        newest = None
        nh: fmt.FileHeader | None = None
        nbuf = b""
        nfirst: int | None = None
        while ids:
            fid = ids[-1]
            path = os.path.join(d, segment_name(fid))
            buf = read_file(fs, path)
            got = self._read_header(path, fid, buf, newest=True)
            if got is None:
                ids.pop()
                continue
            nh, nfirst = got
            nbuf = buf
            newest = fid
            break
        if newest is None or nh is None:
            return [], max_id, None, set()
        npath = os.path.join(d, segment_name(newest))
        ndamaged = nfirst is not None
        nstart, floor = self._resume(snap, newest, nh, len(nbuf), nfirst)
        nscan = _Scanner(self, npath, newest, nbuf, nh).scan(True, 0, nstart, floor, self._vouched(newest))
        nscan.header_damaged = ndamaged
        retired = {fmt.decode_retire(r.payload) for r in nscan.records if r.op == fmt.RETIRE}
        present = set(ids) - {newest}
        if ndamaged:
            # The live list is unreadable: every file present stays (none is deleted).
            expected = set(present)
        else:
            expected = set(nh.live_files) - retired
            if nstart is not None and snap is not None:
                # RETIRE records before the resume offset were not read: the checkpoint's
                # file list already leaves those files out.
                expected &= set(snap.files)
        missing = sorted(expected - present)
        if missing and self.config.on_corruption != "skip":
            path = os.path.join(d, segment_name(missing[0]))
            raise CorruptLogError(
                path, 0, "data file is missing, but the newest data file lists it as live", _MISSING_HINT
            )
        for fid in sorted(present - expected):
            path = os.path.join(d, segment_name(fid))
            buf = read_file(fs, path)
            # Retired: its RETIRE record (or an older header) says it is gone.
            if fid < newest and not self.readonly and self._header_ok(buf, fid):
                logger.info("removing retired data file %s", path)
                fs.unlink(path)
                fs.fsync_dir(d)
        # 2. Scan the older live files strictly, oldest first.
        scans: list[_FileScan] = []
        prev_woid = 0
        todo = sorted(expected & present)
        for i, fid in enumerate(todo):
            path = os.path.join(d, segment_name(fid))
            if self._progress is not None:
                self._progress(f"reading {path} ({i + 1} of {len(todo) + 1})")
            buf, size = self._read_data_file(path, fid, snap)
            got = self._read_header(path, fid, buf, newest=False)
            if got is None:
                continue
            h, first = got
            damaged = first is not None
            if not damaged and h.base_woid <= prev_woid:
                raise CorruptLogError(path, 0, "write-order ids overlap the previous data file")
            start, floor = self._resume(snap, fid, h, size, first)
            vouched = self._vouched(fid)
            if len(buf) < size:  # only the header was read: the checkpoint covers the rest
                s = _FileScan(fid, path, h, [], size, size, max(prev_woid, h.base_woid - 1))
                if vouched > size:  # pragma: no cover - a header-only read means size == resume offset
                    _Scanner(self, path, fid, buf, h)._truncated(size, vouched, s.last_woid)
            else:
                s = _Scanner(self, path, fid, buf, h).scan(False, prev_woid, start, floor, vouched)
            s.header_damaged = damaged
            prev_woid = s.last_woid
            scans.append(s)
            self._register_file(fid, index, path)
            self._file_end[fid] = s.end
            self.file_sizes[fid] = s.size
        if not ndamaged and nh.base_woid <= prev_woid:
            raise CorruptLogError(npath, 0, "write-order ids overlap the previous data file")
        self._register_file(newest, index, npath)
        self._file_end[newest] = nscan.end
        self.file_sizes[newest] = nscan.size
        if nscan.end < nscan.size and not self.readonly:
            self._truncate_tail(npath, nscan.end, nbuf)
        scans.append(nscan)
        for fid in missing:
            # What the file held lies between the files around it, in write-order ids.
            lo = max((s.last_woid for s in scans if s.file_id < fid), default=0)
            hi = min((s.header.base_woid for s in scans if s.file_id > fid and not s.header_damaged), default=INF_WOID)
            path = os.path.join(d, segment_name(fid))
            reason = "data file is missing, but the newest data file lists it as live"
            self.missing_files.add(fid)
            self._report_corruption(CorruptionReport(path, 0, reason, 0, (lo, hi), file_id=fid))
        return scans, max_id, (newest, None if ndamaged else frozenset(nh.live_files)), retired

    def _resume(
        self, snap: Snapshot | None, fid: int, h: fmt.FileHeader, size: int, first: int | None
    ) -> tuple[int | None, int]:
        """Return ``(offset to scan from or None, write-order id floor)`` for one file.

        ``first`` is the first record after a damaged header (None when the header is intact).
        """
        if first is None:
            start = self._start(snap, fid, h, size)
        elif snap is not None and fid in snap.files:
            start = max(first, min(snap.files[fid], size))
        else:
            return first, 0
        return start, snap.woid if start is not None and snap is not None and fid in snap.files else 0

    def _header_ok(self, buf: bytes, fid: int) -> bool:
        try:
            h = fmt.decode_file_header(buf)
        except FormatError:
            return False
        return isinstance(h, fmt.FileHeader) and h.channel_id == self.channel_id and h.file_id == fid

    def _read_header(self, path: str, fid: int, buf: bytes, newest: bool) -> tuple[fmt.FileHeader, int | None] | None:
        """Decode and check a data file header.

        Returns ``(header, None)``; ``None`` means: ignore this file. With
        ``on_corruption="skip"``, a damaged header whose records still verify
        returns ``(stand-in header, offset of the first record)``: the records
        are read with the seed the file name gives, and only the header is lost.
        """
        try:
            h = fmt.decode_file_header(buf)
            if h is fmt.INCOMPLETE:
                raise FormatError(len(buf), "file shorter than its header")
        except FormatError as exc:
            if newest and self._no_verified_data(buf, fid):
                # Created, but its header never became durable: nothing was acknowledged in it.
                logger.warning("%s: %s; the file was being created at a crash, setting it aside", path, exc.reason)
                self.torn_tails.append((path, 0, len(buf)))
                self.discarded.add(fid)
                if not self.readonly:
                    self._set_aside(path, buf, 0)
                    self.fs.unlink(path)
                    self.fs.fsync_dir(os.path.dirname(path))
                return None
            if self.config.on_corruption != "skip":
                raise CorruptLogError(path, exc.offset, f"data file header: {exc.reason}") from exc
            first = self._first_record(buf, fid)
            self._report_corruption(
                CorruptionReport(
                    path,
                    exc.offset,
                    f"data file header: {exc.reason}; its records are read without it",
                    0,
                    None,
                    [],
                    fid,
                )
            )
            stand_in = fmt.FileHeader(self.crc_kind, self.channel_id, fid, 0, 0, 0, 0)
            return stand_in, first
        assert isinstance(h, fmt.FileHeader)
        if h.channel_id != self.channel_id:
            raise CorruptLogError(path, 16, "data file belongs to another channel; move it out of this directory")
        if h.file_id != fid:
            raise CorruptLogError(path, 32, f"header says file id {h.file_id}, but the name says {fid}")
        if h.crc_kind != self.crc_kind:
            raise CorruptLogError(path, 12, "checksum algorithm differs from the channel's")
        return h, None

    def _first_record(self, buf: bytes, fid: int) -> int:
        """Where the first record that verifies starts, after a damaged header (or the end)."""
        seed = fmt.file_seed(self.crc_kind, self.channel_id, fid)
        limit = min(len(buf), fmt.MAX_HEADER_LEN)
        smallest = fmt.FILE_HEADER_FIXED + 4  # a header that lists no live file, before padding
        for off in range(smallest + fmt.pad_len(smallest), limit, 8):
            try:
                rec = fmt.decode_record(buf, off, seed, self.crc_kind, self.max_payload)
            except FormatError:
                continue
            if isinstance(rec, fmt.Record):
                return off
        return len(buf) - (len(buf) & 7)

    def _no_verified_data(self, buf: bytes, fid: int) -> bool:
        seed = fmt.file_seed(self.crc_kind, self.channel_id, fid)
        return _find_verified_batch_end(buf, 0, seed, self.crc_kind, self.max_payload) is None

    def _set_aside(self, path: str, buf: bytes, start: int) -> None:
        """Keep a forensic copy of bytes recovery is about to drop."""
        dest = f"{path}.torn-{time.time_ns()}"
        fd = self.fs.create(dest)
        try:
            self.fs.pwrite_all(fd, buf[start:], 0)
            self.fs.fsync(fd)
        finally:
            self.fs.close(fd)

    def _truncate_tail(self, path: str, end: int, buf: bytes) -> None:
        fs = self.fs
        if not _all_zero(buf, end):
            self._set_aside(path, buf, end)
        fd = fs.open_rw(path)
        try:
            fs.truncate(fd, end)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.fsync_dir(os.path.dirname(path))

    def _note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        self.torn_tails.append((path, start, size - start))
        logger.warning(
            "%s: torn tail of %d bytes from byte %d (%s)%s",
            path,
            size - start,
            start,
            reason,
            "" if self.readonly else "; truncated, a copy is kept beside it",
        )

    def _report_corruption(self, report: CorruptionReport) -> None:
        self.corruption.append(report)
        logger.error("on_corruption='skip': %s", report.describe())

    def _register_file(self, file_id: int, index: int, path: str) -> None:
        self._files[file_id] = (index, path)
        self._seeds[file_id] = fmt.file_seed(self.crc_kind, self.channel_id, file_id)

    def _release(self) -> None:
        for fd in self._read_fds.values():
            try:
                self.fs.close(fd)
            except OSError:
                pass
        self._read_fds.clear()
        for h in getattr(self, "_extra_locks", []):
            self.fs.unlock(h)
        self._extra_locks = []
        if self._lock_handle is not None:
            self.fs.unlock(self._lock_handle)
            self._lock_handle = None

    # -- replay -----------------------------------------------------------------

    def replay(self) -> Iterator[LogRecord]:
        """Yield every verified record, in write-order id order, once.

        The records are those found when the log was opened; they are released
        as they are yielded, so call this once, right after opening.
        """
        scans, self._scans = self._scans, []
        by_dir: dict[str, list[_FileScan]] = {}
        for s in scans:
            by_dir.setdefault(os.path.dirname(s.path), []).append(s)
        streams = [itertools.chain.from_iterable(s.records for s in ss) for ss in by_dir.values()]
        if len(streams) == 1:
            yield from streams[0]
        else:
            yield from heapq.merge(*streams, key=lambda r: r.woid)

    # -- the write path ---------------------------------------------------------

    def new_txn_id(self) -> int:
        """Return a transaction id never used before in this channel."""
        n = next(self._txn_ids)
        self._txn_peek = n + 1
        return n

    def _peek_txn_id(self) -> int:
        return self._txn_peek

    def writer_for(self, txn_id: int) -> int:
        """Return the data directory index that transaction ``txn_id`` writes to."""
        return txn_id % len(self._writers)

    def commit(
        self,
        txn_id: int,
        payloads: Sequence[bytes],
        takes: Sequence[tuple[int, int]] = (),
        on_written: Callable[[CommitResult], None] | None = None,
    ) -> CommitResult:
        """Append a transaction (PUT records, one TAKE record, a COMMIT) and wait for it.

        With ``fsync="commit"`` this returns once the records are durable;
        with ``"interval"``, once they are written to the OS. ``on_written`` is
        called by the writing thread, in commit order, just before the commits
        of one write return: that is where the channel publishes the puts.

        Raises:
            OSError: The write or fsync failed; the transaction did not commit.
            ChannelClosedError: The log is closed or has failed.
        """
        item = _Item(fmt.COMMIT, txn_id, payloads, takes, True, on_written)
        self._writers[txn_id % len(self._writers)].submit(item)
        return item.result

    def rollback(self, txn_id: int, n_puts: int, n_takes: int) -> None:
        """Note a rollback in the log; it is written with the next write, never waited for."""
        if self._failed is not None or self._closed or self.readonly:
            return
        self._writers[txn_id % len(self._writers)].submit(_RollbackItem(txn_id, n_puts, n_takes))

    def retire(self, file_ids: Sequence[int]) -> None:
        """Remove data files that no longer hold anything the channel needs.

        A RETIRE record for each is made durable in the active file of its
        directory first, so recovery never mistakes a retired file for a
        missing one, nor replays one whose unlink did not persist.
        """
        with self._retire_lock:
            self._retire(file_ids)

    def _retire(self, file_ids: Sequence[int]) -> None:
        by_dir: dict[int, list[int]] = {}
        for fid in file_ids:
            if fid in self._files:
                by_dir.setdefault(self._files[fid][0], []).append(fid)
        for index, fids in by_dir.items():
            w = self._writers[index]
            fids = [f for f in fids if f != w.file_id]
            if not fids:
                continue
            # Leave the live list first: a file the writer starts from now on (even one a
            # concurrent commit rolls to before the RETIRE is written) must not list these
            # in its header, or, once they are unlinked, the newest header names files
            # that are gone and the next open fails. A header that omits a file whose
            # RETIRE did not persist is safe: such a file holds nothing the channel needs,
            # and recovery deletes it.
            for fid in fids:
                if fid in w.live:
                    w.live.remove(fid)
            w.submit(_Item(fmt.RETIRE, 0, retire=fids))
            if self.config.fsync == "interval":
                # Every writer, not just this directory's: the takes re-logged before a
                # retirement may sit in another data directory, and must be durable
                # before the file they make unnecessary is unlinked.
                for other in self._writers:
                    other.sync_now()
                self._check_writable()
            for fid in fids:
                _, path = self._files.pop(fid)
                self._seeds.pop(fid, None)
                rfd = self._read_fds.pop(fid, None)
                if rfd is not None:
                    self.fs.close(rfd)
                try:
                    self.fs.unlink(path)
                except FileNotFoundError:
                    pass
                self._files_retired += 1
                self._file_end.pop(fid, None)
                logger.debug("retired data file %s", path)
            self.fs.fsync_dir(w.path)

    def read_payload(self, file_id: int, offset: int, size: int) -> bytes:
        """Read and verify the record at a pointer; return its payload.

        Raises:
            CorruptLogError: The record there no longer verifies.
        """
        fd = self._read_fds.get(file_id)
        if fd is None:
            path = self._files[file_id][1]
            fd = self.fs.open_read(path)
            old = self._read_fds.setdefault(file_id, fd)
            if old != fd:
                self.fs.close(fd)
                fd = old
        buf = self.fs.pread(fd, size, offset)
        try:
            rec = fmt.decode_record(buf, 0, self._seeds[file_id], self.crc_kind, self.max_payload)
            if not isinstance(rec, fmt.Record) or rec.size != size:
                raise FormatError(0, "record is shorter than expected")
        except FormatError as exc:
            raise CorruptLogError(self._files[file_id][1], offset + exc.offset, exc.reason) from exc
        return rec.payload

    @contextmanager
    def freeze(self) -> Iterator[dict[int, int]]:
        """Hold every writer still, everything written durable, for a checkpoint.

        Yields the replay resume offset of every live data file: records after
        it have write-order ids above :attr:`last_woid` as read inside the block.

        Raises:
            ChannelClosedError: The log has failed or is closed.
            OSError: Making written data durable failed (the log fails too).
        """
        with self._retire_lock:
            locks = [w.io_lock for w in self._writers]
            for lk in locks:
                lk.acquire()
            try:
                self._check_writable()
                for w in self._writers:
                    if w.fd is not None and w.synced != w.offset:
                        try:
                            self.fs.fdatasync(w.fd)
                        except OSError as exc:
                            self._fail(exc, f"fdatasync of {w._path(w.file_id)} failed")
                            raise
                        self._fsyncs += 1
                        w.synced = w.offset
                files = {fid: self._file_end.get(fid, 0) for fid in self._files}
                for w in self._writers:
                    if w.fd is not None:
                        files[w.file_id] = w.offset
                yield files
            finally:
                for lk in reversed(locks):
                    lk.release()

    def counters(self) -> tuple[int, int, int, int]:
        """Return ``(last woid, next position, next txn id, next file id)``; call inside :meth:`freeze`."""
        return self._next_woid - 1, self._next_position, self._txn_peek, self._next_file_id

    # -- space, state, stats ------------------------------------------------------

    def check_space(self, index: int) -> None:
        """Raise DiskSpaceError if data directory ``index`` is under minimum_required_space."""
        need = self.config.minimum_required_space
        if not need:
            return
        now = time.monotonic()
        cached = self._space.get(index)
        if cached is None or now - cached[0] > _SPACE_REFRESH_S:
            free = self.fs.free_space(self.data_dirs[index])
            self._space[index] = (now, free)
            self._space_written[index] = 0
        else:
            free = cached[1] - self._space_written.get(index, 0)
        if free < need:
            self._space.pop(index, None)  # re-read next time: space may come back
            raise DiskSpaceError(self.data_dirs[index], free, need)

    def _space_used(self, index: int, n: int) -> None:
        self._space_written[index] = self._space_written.get(index, 0) + n

    def _check_writable(self) -> None:
        if self._failed is not None:
            raise ChannelClosedError(
                f"the channel failed and refuses writes: {self._failed_msg}: {self._failed}; "
                "close and reopen it to recover from what is on disk"
            ) from self._failed
        if self._closed or self._closing:
            raise ChannelClosedError("the channel is closed")
        if self.readonly:
            raise ChannelClosedError("the log was opened read-only")

    def _fail(self, exc: BaseException, msg: str) -> None:
        with self._state_lock:
            if self._failed is None:
                self._failed = exc
                self._failed_msg = msg
                logger.error("%s: %s; the channel refuses further writes", msg, exc)

    @property
    def failed(self) -> BaseException | None:
        """The error that moved the log to FAILED, or None."""
        return self._failed

    @property
    def last_woid(self) -> int:
        """The highest write-order id assigned so far."""
        return self._next_woid - 1

    @property
    def next_position(self) -> int:
        """The position the next committed put will receive."""
        return self._next_position

    def file_ids(self) -> list[int]:
        """Return the ids of the data files that are part of the channel."""
        return sorted(self._files)

    def file_path(self, file_id: int) -> str:
        """Return the path of a live data file."""
        return self._files[file_id][1]

    def active_file_ids(self) -> set[int]:
        """Return the files being written to (never retired)."""
        return {w.file_id for w in self._writers if w.fd is not None}

    def newest_file_ids(self) -> set[int]:
        """Return the newest file of each data directory (never retired)."""
        out = set()
        for w in self._writers:
            if w.live:
                out.add(max(w.live))
        return out

    def stats(self) -> dict[str, int]:
        """Counters of the log (fsyncs, bytes, files)."""
        total = 0
        # list() copies the table in one step (no Python code runs while it iterates),
        # so a file retired by the background thread meanwhile cannot break the loop.
        for _, path in list(self._files.values()):
            try:
                fd = self.fs.open_read(path)
            except OSError:
                continue
            try:
                total += self.fs.size(fd)
            finally:
                self.fs.close(fd)
        return {
            "fsyncs": self._fsyncs,
            "bytes_written": self._bytes_written,
            "files": len(self._files),
            "files_created": self._files_created,
            "files_retired": self._files_retired,
            "disk_bytes": total,
            "last_woid": self.last_woid,
            "torn_tails_truncated": len(self.torn_tails),
            "corruptions_skipped": len(self.corruption),
        }

    # -- interval sync and closing ----------------------------------------------------

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.config.fsync_interval):
            for w in self._writers:
                w.sync_now()

    def sync(self) -> None:
        """Make everything written so far durable now (any fsync mode).

        Raises:
            ChannelClosedError: The log has failed.
        """
        for w in self._writers:
            w.sync_now()
        self._check_writable()

    def close(self) -> None:
        """Write what is pending, make it durable, release the lock. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        err: BaseException | None = None
        # From here on new commits are refused; one being written finishes first.
        self._closing = True
        if not self.readonly:
            for w in self._writers:
                with w.io_lock:
                    with w.lock:
                        pending = w.pending
                        w.pending = []
                    if w.fd is None and all(it.kind == fmt.ROLLBACK for it in pending):
                        # Rollback notes are informational: not worth a new data file.
                        pending = []
                    if pending:
                        try:
                            w._write_batch_locked(pending, closing=True)
                        except (OSError, ChannelClosedError) as exc:
                            err = err or (exc if isinstance(exc, OSError) else None)
                            for it in pending:
                                if it.error is None and not it.published:
                                    it.error = exc
                with w.lock:  # release committers whose items close wrote (or failed)
                    for it in pending:
                        it.done = True
                        w._wake(it)
                try:
                    w.close()
                except OSError as exc:
                    err = err or exc
        self._closed = True
        self._release()
        if err is not None:
            raise err


class _RollbackItem(_Item):
    """A ROLLBACK note: written with the next write, nobody waits for it."""

    __slots__ = ("counts",)

    def __init__(self, txn_id: int, n_puts: int, n_takes: int) -> None:
        super().__init__(fmt.ROLLBACK, txn_id, durable=False)
        self.counts = (n_puts, n_takes)


class _CheckpointUnusable(Exception):
    """A checkpoint does not fit the data files on disk (recovery tries an older one)."""
