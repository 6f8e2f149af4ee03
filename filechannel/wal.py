"""A plain write-ahead log with Spark Streaming's ``WriteAheadLog`` interface.

This module owns :class:`WriteAheadLog` and :class:`RecordHandle`: write a
record, get a handle, read it back by handle, read everything after a restart,
drop what is older than a time. It is a second face on the channel's log, not
a second log: a write is a transaction of PUT records and a COMMIT, written by
the channel's writer (``writer.py``: group commit, fsync policy, fail-stop),
in the channel's data files (``format.py``: framing, per-file seeded
checksums), recovered by ``log.py`` (torn tails, ``on_corruption``) and read
back through ``scan.py``. What is its own:

* the payload of each PUT: kind, time, data (``format.encode_wal_payload``);
* rolling by the records' time (Spark's rule: a record whose time is past
  the current file's end starts a new file) besides rolling by size, through
  the writer's :class:`~filechannel.writer.FilePolicy` hook;
* the SPAN record that opens every file and bounds the time of every record
  in it, so :meth:`WriteAheadLog.clean` needs no index;
* cleaning by time (files are retired the channel's way: a durable RETIRE
  record, then the unlink), in the foreground or on a background thread;
* ``dump_wal`` and ``verify_wal`` for the ``filechannel wal`` command. Reading records back (for
  ``read``, ``read_all`` and those tools) is ``walread``'s.

A write-ahead log directory is marked by a ``WAL`` file; a channel refuses it
and it refuses a channel.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time as _time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import format as fmt
from ._fs import DEFAULT_FS, FS
from .checkpoint import CheckpointStore, Snapshot
from .config import ChannelConfig
from .errors import (
    WAL_HINT,
    ChannelClosedError,
    ConfigError,
    CorruptLogError,
    DecryptionError,
    FormatError,
    InvalidHandleError,
    RecordTooLargeError,
)
from .log import Log
from .logview import open_view
from .permissions import fs_for
from .scan import CorruptionReport, PutRun
from .walread import (
    SEALED,
    Entry,
    ScanContext,
    Slot,
    close_all,
    entries,
    in_wal_words,
    kept_ends,
    open_payload,
    sealed_end,
    worded,
)
from .writer import Item

__all__ = ["RecordHandle", "WalReport", "WriteAheadLog", "dump_wal", "verify_wal"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
CHECKPOINT_DIR = "checkpoints"  # as a channel's: where the snapshot written on close lives
_NS = 1_000_000_000
# The SPAN transaction at the start of every file: one PUT (sealed, with encryption) and one COMMIT.
_SPAN_BYTES = fmt.record_size(fmt.WAL_HEAD_LEN + 8 + fmt.ENC_TAG_LEN) + fmt.record_size(16)
_EMPTY = -(1 << 63)  # the span of a file without records: older than any threshold
_I64_MAX = (1 << 63) - 1
# How far past now (and past every record's time) a clean threshold may lie: beyond it,
# it is refused as a time in the wrong unit (Spark passes milliseconds).
_CLEAN_AHEAD_NS = 86_400 * _NS


@dataclass(frozen=True)
class RecordHandle:
    """Where one record lies: a small, frozen, picklable value that survives restarts.

    ``log_id`` is the id of the log that wrote it (hex), ``file_id``,
    ``offset`` and ``length`` the record's frame in its data file, ``woid`` its
    write-order id and ``time`` the time it was written with (seconds since
    the epoch). :meth:`WriteAheadLog.read` checks all of them against the
    bytes, so a stale or foreign handle is refused, never answered with the
    wrong record.
    """

    log_id: str
    file_id: int
    offset: int
    length: int
    woid: int
    time: float


class _WalItem(Item):
    """A write (one or more records) with the time it is written under."""

    __slots__ = ("time_ns",)

    def __init__(
        self, txn_id: int, payloads: Sequence[bytes], time_ns: int, overhead: int, durable: bool = True
    ) -> None:
        super().__init__(fmt.COMMIT, txn_id, payloads, (), durable, overhead=overhead)
        self.time_ns = time_ns


class _TimePolicy:
    """Rolls files by record time (Spark's rule) and opens each file with its SPAN."""

    reserve = _SPAN_BYTES

    def __init__(self, log: Log, interval_ns: int, spans: dict[int, tuple[int, int]]) -> None:
        self.log = log
        self.interval_ns = interval_ns
        self.spans = spans  # file id -> (start_ns, end_ns); shared with the WriteAheadLog
        self.current: tuple[int, int] | None = None

    def must_roll(self, file_id: int, item: Item) -> bool:
        span = self.spans.get(file_id)
        return isinstance(item, _WalItem) and span is not None and item.time_ns > span[1]

    def started(self, file_id: int, item: Item) -> None:
        t = item.time_ns if isinstance(item, _WalItem) else _time.time_ns()
        cur = self.current
        # A file rolled for size keeps its predecessor's end: the record that made it
        # roll is not past that end, so no record in the new file will be either.
        end = cur[1] if cur is not None and t <= cur[1] else min(t + self.interval_ns, _I64_MAX)
        self.current = self.spans[file_id] = (t, end)

    def first_item(self, file_id: int) -> Item | None:
        start, end = self.spans[file_id]
        span = [fmt.encode_wal_span(start, end)]
        return _WalItem(self.log.new_txn_id(), span, start, self.log.seal_overhead, durable=False)


def _to_ns(t: float | None, what: str = "time", clamp: bool = False) -> int:
    if t is None:
        return _time.time_ns()
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise TypeError(f"{what} must be a finite number of seconds since the epoch, got {t!r}")
    ns = round(t * _NS)
    if clamp:  # a threshold beyond every possible time is fine: it means "everything"
        return max(_EMPTY + 1, min(ns, _I64_MAX))
    if not _EMPTY < ns <= _I64_MAX:
        raise ValueError(f"{what} {t!r} is out of range (about ±292 years around 1970)")
    return ns


class WriteAheadLog:
    """A durable record log in ``directory``, with Spark Streaming's ``WriteAheadLog`` interface.

    Args:
        directory: The log's directory (created if missing).
        rolling_interval: Seconds of record time one file covers: a record whose
            time is past the current file's end starts a new file.
        max_file_size: Data file size at which a new file starts.
        fsync: ``"commit"`` (a write is durable when it returns; concurrent
            writers share fsyncs) or ``"interval"``.
        fsync_interval: Seconds between background fsyncs in interval mode.
        encryption: A :class:`filechannel.Encryption` (as for a channel): every
            record is sealed with AES-256-GCM or ChaCha20-Poly1305 under a per-file
            key; ``None`` (default): plaintext, and a log holding encrypted files
            refuses to open.
        on_corruption: ``"fail"`` (raise ``CorruptLogError``) or ``"skip"``
            (drop damaged records and report them).
        minimum_required_space: Bytes that must stay free on the log's disk: a
            write below it raises ``DiskSpaceError`` and writes nothing (default
            0: no check, a full disk is the write's ``OSError``).
        permissions: ``"owner"`` (default: files 0600, directories 0700) or
            ``"group"`` (0640 and 0750: the group can read), as for a channel.
        fs: Internal: the I/O seam (tests pass a simulated file system).

    Raises:
        ConfigError: An option is invalid.
        ChannelLockedError: Another process (or open) holds the directory.
        CorruptLogError: Acknowledged records are damaged (``on_corruption="fail"``).
        NotAChannelError: ``directory`` is something else (a channel, a file, ...).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rolling_interval: float = 60.0,
        max_file_size: int = 64 * MiB,
        fsync: str = "commit",
        fsync_interval: float = 5.0,
        encryption: Any = None,
        *,
        on_corruption: str = "fail",
        minimum_required_space: int = 0,
        permissions: str = "owner",
        fs: FS | None = None,
    ) -> None:
        if (
            isinstance(rolling_interval, bool)
            or not isinstance(rolling_interval, (int, float))
            or not math.isfinite(rolling_interval)
            or rolling_interval <= 0
        ):
            raise ConfigError("rolling_interval", f"must be a number of seconds > 0, got {rolling_interval!r}")
        max_event = max_file_size - 1024 if isinstance(max_file_size, int) and max_file_size > 1024 else None
        self.config = ChannelConfig(
            max_file_size=max_file_size,
            max_event_size=max_event,  # type: ignore[arg-type]
            fsync=fsync,
            fsync_interval=fsync_interval,
            on_corruption=on_corruption,
            minimum_required_space=minimum_required_space,
            encryption=encryption,
            permissions=permissions,
            # Every file is scanned at open; the checkpoint written on close only
            # vouches for the files' lengths (the channel's rule, docs/design.md).
            replay="full",
        )
        self.directory = os.fspath(directory)
        self.rolling_interval = float(rolling_interval)
        tag = fmt.ENC_TAG_LEN if encryption is not None else 0
        self._max_data = self.config.max_event_size - fmt.WAL_HEAD_LEN - _SPAN_BYTES - tag
        self._fs = fs_for(fs or DEFAULT_FS, self.config.permissions)
        self._store = CheckpointStore(self._fs, os.path.join(self.directory, CHECKPOINT_DIR))
        with in_wal_words():
            self._log = Log(self.directory, self.config, fs=self._fs, checkpoints=self._store, wal=True)
        self._closed = False
        self._closing = False
        self._lock = threading.Lock()  # guards _fds, _cleaned, _cleaners
        self._clean_lock = threading.Lock()
        self._fds: dict[int, int] = {}
        self._cleaned: set[int] = set()
        self._cleaners: list[threading.Thread] = []
        self._spans: dict[int, tuple[int, int]] = {}
        try:
            self.log_id = self._log.channel_id.hex()
            self.corruption: list[CorruptionReport] = list(self._log.corruption)
            self._kept = kept_ends(self._log)  # before replay drops the checkpoint that vouched
            with in_wal_words():
                self._load_spans()
            self._policy = _TimePolicy(self._log, round(self.rolling_interval * _NS), self._spans)
            for w in self._log.writers:
                w.policy = self._policy
        except BaseException:
            self._log.close()
            raise

    def _load_spans(self) -> None:
        """Read the SPAN record that opens each recovered file (one read per file)."""
        log = self._log
        first: dict[int, tuple[int, int]] = {}
        for r in log.replay_runs():  # a run's first PUT is its first row: no record per PUT
            if r.file_id in first:
                continue
            if isinstance(r, PutRun):
                first[r.file_id] = (r.offsets[r.start], r.sizes[r.start])
            elif r.op == fmt.PUT:
                first[r.file_id] = (r.offset, r.size)
        for fid in log.file_ids():
            got = first.get(fid)
            if got is None:
                # No record (a crash between creating the file and its first write): it
                # holds nothing to keep, so any clean may delete it.
                self._spans[fid] = (_EMPTY, _EMPTY)
                continue
            try:
                try:
                    payload = log.read_payload(fid, *got)
                except DecryptionError as exc:
                    if self.config.on_corruption != "skip":
                        raise
                    raise FormatError(0, exc.reason) from exc
                kind, start, data = fmt.decode_wal_payload(payload)
                if kind != fmt.WAL_SPAN:
                    raise FormatError(0, "its first record is not a span")
                self._spans[fid] = (start, fmt.decode_wal_span(data))
            except FormatError as exc:
                # Only with on_corruption="skip": a file whose span is damaged is never cleaned.
                logger.warning("%s: time span unknown (%s); clean() keeps this file", log.file_path(fid), exc.reason)

    # -- writing ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError("the write-ahead log is closed")

    def _payload(self, data: bytes, time_ns: int) -> bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a record must be bytes-like, got {type(data).__name__}")
        if len(data) > self._max_data:
            raise RecordTooLargeError(len(data), self._max_data)
        return fmt.encode_wal_payload(fmt.WAL_RECORD, time_ns, bytes(data))

    def write(self, data: bytes, time: float | None = None) -> RecordHandle:
        """Append one record; with ``fsync="commit"`` it is durable when this returns.

        Args:
            data: The record (bytes-like).
            time: The record's time in seconds since the epoch (default: now). It
                decides the file the record goes to and when :meth:`clean` drops it.

        Returns:
            The record's handle, for :meth:`read`.

        Raises:
            TypeError: ``data`` is not bytes-like, or ``time`` not a number.
            ValueError: ``time`` is out of range.
            RecordTooLargeError: The record does not fit in a data file (an
                ``EventTooLargeError``; raise ``max_file_size``).
            OSError: The write or fsync failed (a failed fsync also fails the log).
            ChannelClosedError: The log is closed or has failed.
        """
        return self.write_many([data], time)[0]

    def write_many(self, items: Sequence[bytes], time: float | None = None) -> list[RecordHandle]:
        """Append several records, all or none, with one write and one fsync.

        Args:
            items: The records, in order.
            time: Their time in seconds since the epoch (default: now).

        Returns:
            One handle per record, in order.

        Raises:
            TypeError: An item is not bytes-like, or ``time`` not a number.
            ValueError: ``time`` is out of range.
            RecordTooLargeError: A record does not fit in a data file (an
                ``EventTooLargeError``; raise ``max_file_size``).
            DiskSpaceError: Less than ``minimum_required_space`` is free (nothing written).
            OSError: The write or fsync failed (a failed fsync also fails the log).
            ChannelClosedError: The log is closed or has failed.
        """
        self._check_open()
        if isinstance(items, (bytes, bytearray, memoryview)):
            raise TypeError("write_many takes a sequence of records; use write() for one record")
        t = _to_ns(time)
        payloads = [self._payload(d, t) for d in items]
        if not payloads:
            return []
        log = self._log
        log.check_space(0)
        item = _WalItem(log.new_txn_id(), payloads, t, log.seal_overhead)
        log.submit(item)
        res = item.result
        woid = res.woid - len(payloads)  # the COMMIT follows the PUTs
        ts = t / _NS
        lid = self.log_id
        return [
            RecordHandle(lid, res.file_id, off, size, woid + i, ts)
            for i, (off, size) in enumerate(zip(res.put_offsets, res.put_sizes, strict=True))
        ]

    # -- reading ------------------------------------------------------------------

    def read(self, handle: RecordHandle) -> bytes:
        """Return the record ``handle`` names, after checking every byte of it.

        Raises:
            TypeError: ``handle`` is not a :class:`RecordHandle`.
            InvalidHandleError: The handle is of another log, its file was cleaned,
                its fields cannot describe a record, it points past the end of its
                data file, or the intact record at its offset is another one (a
                made-up handle). The log is fine: nothing to repair.
            CorruptLogError: The bytes at the handle's offset do not verify (damage),
                or its record lay in a torn tail this open cut off (lost in a crash).
            ChannelClosedError: The log is closed.
        """
        if not isinstance(handle, RecordHandle):
            raise TypeError(f"read() takes a RecordHandle, got {type(handle).__name__}")
        self._check_open()
        if handle.log_id != self.log_id:
            raise InvalidHandleError(handle, f"it belongs to another write-ahead log (this one is {self.log_id})")
        if (
            not all(isinstance(v, int) for v in (handle.file_id, handle.offset, handle.length, handle.woid))
            or handle.offset < fmt.FILE_HEADER_FIXED
            or handle.offset & 7
            or handle.length < fmt.record_size(fmt.WAL_HEAD_LEN)
            or handle.length & 7
            or handle.length > fmt.record_size(self.config.max_event_size)
        ):
            raise InvalidHandleError(handle, "its offset or length cannot describe a record")
        log = self._log
        fid = handle.file_id
        cut = self._torn_at(fid)
        if cut is not None and handle.offset + handle.length > cut:
            raise CorruptLogError(
                log.file_path(fid),
                handle.offset,
                f"the record was lost: a crash cut a torn tail off data file {fid} at byte {cut} before this open "
                "(a write never acknowledged, or acknowledged with fsync='interval' and not yet synced)",
                WAL_HINT,
            )
        end = self._written_end(fid)
        if end is not None and handle.offset + handle.length > end:
            raise InvalidHandleError(
                handle,
                f"it points past the end of data file {fid} (its records end at byte {end}): no record of this "
                "log lies there (a made-up handle, or one of a record lost in a crash with fsync='interval')",
            )
        with self._lock:
            fd = self._fds.get(fid)
            if fd is None:
                if fid in self._cleaned:
                    raise InvalidHandleError(handle, "its file was deleted by clean()")
                try:
                    path = log.file_path(fid)
                except KeyError:
                    raise InvalidHandleError(
                        handle, "no data file of this log has that id (cleaned, or never written)"
                    ) from None
                fd = self._fds[fid] = self._fs.open_read(path)
            buf = self._fs.pread(fd, handle.length, handle.offset)
        path = os.path.join(log.data_dirs[0], f"seg-{fid:016x}.wal")
        seed = fmt.file_seed(log.crc_kind, log.channel_id, fid)
        try:
            rec = fmt.decode_record(buf, 0, seed, log.crc_kind, log.max_payload)
            if not isinstance(rec, fmt.Record):
                if len(buf) < handle.length:
                    raise FormatError(len(buf), "the file ends inside the record (lost or truncated)")
                # The frame there is longer than the handle says: read it whole to tell a
                # damaged length (damage) from an intact record that is not the handle's.
                declared = fmt.record_length_at(buf, 0)  # at most max_payload, or decode_record refused it
                whole = self._pread(fid, fmt.record_size(declared), handle.offset)
                other = fmt.decode_record(whole, 0, seed, log.crc_kind, log.max_payload)
                if not isinstance(other, fmt.Record):
                    raise FormatError(len(whole), "the file ends inside the record (lost or truncated)")
                raise InvalidHandleError(
                    handle,
                    f"the intact record at byte {handle.offset} of data file {fid} is {other.size} bytes long, "
                    f"not {handle.length}: the handle names no record of this log",
                )
            if rec.size != handle.length:
                raise InvalidHandleError(
                    handle,
                    f"the intact record at byte {handle.offset} of data file {fid} is {rec.size} bytes long, "
                    f"not {handle.length}: the handle names no record of this log",
                )
            if rec.op != fmt.PUT or rec.woid != handle.woid:
                raise InvalidHandleError(
                    handle,
                    f"the intact record at byte {handle.offset} of data file {fid} has write-order id {rec.woid}, "
                    f"not {handle.woid}: the handle names no record of this log (a made-up handle, or one of a "
                    "record lost in a crash with fsync='interval' whose place was reused)",
                )
        except FormatError as exc:
            raise CorruptLogError(path, handle.offset + exc.offset, exc.reason, WAL_HINT) from exc
        payload = open_payload(log, fid, path, bytes(buf[:24]), handle.offset, rec.payload)
        try:
            kind, _t, data = fmt.decode_wal_payload(payload)
            if kind != fmt.WAL_RECORD:
                raise FormatError(0, "the record there is not a data record")
        except FormatError as exc:
            raise CorruptLogError(path, handle.offset, exc.reason, WAL_HINT) from exc
        return data

    def _torn_at(self, fid: int) -> int | None:
        """Where the open cut a torn tail off file ``fid`` (records from there on were lost), or None."""
        log = self._log
        try:
            path = log.file_path(fid)
        except KeyError:
            return None
        starts = [start for p, start, _size in log.torn_tails if p == path]
        return min(starts) if starts else None

    def _written_end(self, fid: int) -> int | None:
        """How far file ``fid`` holds written records (None: unknown, e.g. a file not of this log)."""
        log = self._log
        for w in log.writers:
            with w.io_lock:
                if fid == w.file_id and w.fd is not None:
                    return int(w.offset)
        try:
            return sealed_end(log, fid)
        except KeyError:
            return None

    def _pread(self, fid: int, n: int, offset: int) -> bytes:
        with self._lock:
            fd = self._fds[fid]
            return bytes(self._fs.pread(fd, n, offset))

    def _snapshot(self) -> list[Slot]:
        """Every live file with the length written and verified so far, opened for reading."""
        log = self._log
        files: list[tuple[int, str, int]] = []
        for w in log.writers:
            with w.io_lock:  # a consistent (file, end) list: no batch is half written meanwhile
                for fid in log.file_ids():
                    end = w.offset if fid == w.file_id and w.fd is not None else sealed_end(log, fid)
                    if end is not None:
                        files.append((fid, log.file_path(fid), end))
        out: list[Slot] = []
        for fid, path, end in sorted(files):
            try:
                fd: int | None = self._fs.open_read(path)
            except FileNotFoundError:
                with self._lock:
                    if fid not in self._cleaned:
                        raise CorruptLogError(path, 0, "data file is missing") from None
                fd = None  # cleaned meanwhile: it held only records older than the threshold
            out.append(Slot(fid, path, end, fd))
        return out

    def read_all(self) -> Iterator[bytes]:
        """Yield every record still held, in write order, across all files.

        It reads the files as they are when iteration starts; records written
        later are not included. A torn tail left by a crash was dealt with when
        the log was opened, exactly as for a channel.

        Raises:
            CorruptLogError: A record is damaged (``on_corruption="fail"``); with
                ``"skip"`` it is dropped and listed in :attr:`corruption`.
            ChannelClosedError: The log is closed.
        """
        self._check_open()
        return worded(self._read_all())

    def _read_all(self) -> Iterator[bytes]:
        files = self._snapshot()
        ctx = ScanContext(self._log.channel_id, self._log.crc_kind, self._log.max_payload, self.config)
        try:
            for e in entries(self._log, ctx, files):
                if e.kind == fmt.WAL_RECORD:
                    yield e.data
        finally:
            close_all(self._fs, files)
            self.corruption.extend(ctx.reports)

    # -- cleaning -------------------------------------------------------------------

    def clean(self, thresh_time: float, wait_for_completion: bool = False) -> None:
        """Delete the files whose every record is older than ``thresh_time``.

        A file goes only when its span's end (no record in it is later) is
        before ``thresh_time``; the file being written is kept. Without waiting
        the work runs on a background thread (errors are logged); :meth:`close`
        waits for it.

        Raises:
            TypeError: ``thresh_time`` is not a number.
            ValueError: ``thresh_time`` is more than a day after now and after
                every record's time: a time in milliseconds, not seconds.
            OSError: Writing the RETIRE record failed (when waiting).
            ChannelClosedError: The log is closed or has failed (when waiting).
        """
        self._check_open()
        thresh = _to_ns(thresh_time, "thresh_time", clamp=True)
        self._check_threshold(thresh_time, thresh)
        if wait_for_completion:
            self._clean(thresh)
            return

        def run() -> None:
            try:
                self._clean(thresh)
            except Exception:  # a background task reports by logging
                logger.exception("background clean of %s failed", self.directory)

        t = threading.Thread(target=run, name="filechannel-wal-clean", daemon=True)
        with self._lock:
            if self._closing:
                raise ChannelClosedError("the write-ahead log is closed")
            self._cleaners = [c for c in self._cleaners if c.is_alive()]
            self._cleaners.append(t)
            t.start()

    def _check_threshold(self, thresh_time: float, thresh_ns: int) -> None:
        """Refuse a threshold more than a day after both now and every record's time.

        Such a threshold can only mean "delete every file but the current one",
        which is what a time in milliseconds (Spark's unit) silently does.
        """
        spans = tuple(self._spans.values())  # one C-level copy: the writer may add a file meanwhile
        newest = max((end for _start, end in spans), default=_EMPTY)
        limit = max(_time.time_ns(), newest) + _CLEAN_AHEAD_NS
        if thresh_ns > limit:
            raise ValueError(
                f"thresh_time {thresh_time!r} is more than a day after now and after every record's time: "
                "clean() takes seconds since the epoch (time.time()), not milliseconds (divide by 1000)"
            )

    def _clean(self, thresh_ns: int) -> None:
        log = self._log
        with self._clean_lock:
            active = log.active_file_ids()
            old = [
                fid
                for fid in log.file_ids()
                if fid not in active and fid in self._spans and self._spans[fid][1] < thresh_ns
            ]
            if not old:
                return
            with self._lock:
                self._cleaned.update(old)
                for fid in old:
                    fd = self._fds.pop(fid, None)
                    if fd is not None:
                        self._fs.close(fd)
            log.retire(old)
            for fid in old:
                self._spans.pop(fid, None)
            logger.info("clean: deleted %d data files of %s", len(old), self.directory)

    # -- the rest ---------------------------------------------------------------------

    def sync(self) -> None:
        """Make every record written so far durable now (for ``fsync="interval"``).

        Raises:
            ChannelClosedError: The log has failed.
        """
        self._log.sync()

    def stats(self) -> dict[str, int]:
        """Counters: fsyncs, bytes written, files, files created and retired, ..."""
        return self._log.stats()

    def close(self) -> None:
        """Wait for background cleans, make everything durable, release the lock. Idempotent."""
        if self._closed:
            return
        with self._lock:
            self._closing = True  # no background clean starts from now on
            cleaners = list(self._cleaners)
        for t in cleaners:
            t.join()
        self._closed = True
        if self._log.failed is None:
            try:
                self._vouch()
            except (OSError, ChannelClosedError) as exc:
                logger.warning("%s: no checkpoint written on close (%s)", self.directory, exc)
        with self._lock:
            for fd in self._fds.values():
                try:
                    self._fs.close(fd)
                except OSError:
                    pass
            self._fds.clear()
        self._log.close()

    def _vouch(self) -> None:
        """Write a checkpoint of the files' lengths, as a channel does on close.

        It holds no queue. The next open replays every file anyway, but holds the
        data to it: bytes it covers are never a torn tail, so damage to the last
        write before a clean close is reported, not cut off as if a crash had torn it.
        """
        log = self._log
        with log.freeze() as files:
            woid, next_pos, next_txn, next_file = log.counters()
            file_dirs = log.file_dirs(files)
            auth = log.frozen_auth_state(files) if log.meta_mac is not None else None
        if woid <= 0 or not files:
            return
        for fid, end in self._kept.items():
            if fid in files and files[fid] < end:
                # Skip mode salvaged records past the file's last verified batch: keep
                # vouching for them, or the next open would cut them as a torn tail.
                files[fid] = end
        snap = Snapshot(
            woid, next_pos, next_txn, next_file, log.channel_id, _time.time_ns(), files, file_dirs=file_dirs, auth=auth
        )
        self._store.write(snap, log.crc_kind, None, log.meta_mac)
        log.write_anchor(auth)

    def __enter__(self) -> WriteAheadLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<WriteAheadLog {self.directory!r} {state}>"


# --------------------------------------------------------------------------
# inspection (the ``filechannel wal`` command)


@dataclass
class WalReport:
    """What :func:`verify_wal` found."""

    files: int = 0
    records: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No damage was found."""
        return not self.problems


def _open_readonly(directory: str | os.PathLike[str], fs: FS | None, encryption: Any) -> Log:
    config = ChannelConfig(on_corruption="skip", replay="full", encryption=encryption)
    with in_wal_words():
        return open_view(directory, config, fs=fs, replay=False, keyless_ok=True, wal=True).log


def _walk(log: Log, ctx: ScanContext) -> Iterator[Entry]:
    fs = log.fs
    files: list[Slot] = []
    try:
        for fid in log.file_ids():
            path = log.file_path(fid)
            end = sealed_end(log, fid)
            if end is not None:
                files.append(Slot(fid, path, end, fs.open_read(path)))
        yield from entries(log, ctx, files, keyless=True)
    finally:
        close_all(fs, files)


def dump_wal(
    directory: str | os.PathLike[str], *, encryption: Any = None, fs: FS | None = None
) -> Iterator[dict[str, Any]]:
    """Yield one dict per record (span records included), in write order; read-only, no lock.

    Records of encrypted files read without ``encryption`` are listed as
    ``"kind": "encrypted"``, without time or data.

    Raises:
        NotAChannelError: ``directory`` is not a write-ahead log.
        DecryptionError: The key given is the wrong one for a file.
        CorruptLogError: A record cannot be read (damage is otherwise skipped and logged).
    """
    log = _open_readonly(directory, fs, encryption)
    try:
        ctx = ScanContext(log.channel_id, log.crc_kind, log.max_payload, log.config)
        for e in worded(_walk(log, ctx)):
            d: dict[str, Any] = {"file": e.file_id, "offset": e.offset, "woid": e.woid}
            if e.kind == SEALED:
                d["kind"] = "encrypted"
                yield d
                continue
            d["kind"] = "record" if e.kind == fmt.WAL_RECORD else "span"
            d["time"] = e.time_ns / _NS
            if e.kind == fmt.WAL_SPAN:
                d["end"] = fmt.decode_wal_span(e.data) / _NS
            else:
                d["size"] = len(e.data)
                d["data"] = e.data
            yield d
    finally:
        log.close()


def verify_wal(directory: str | os.PathLike[str], *, encryption: Any = None, fs: FS | None = None) -> WalReport:
    """Check every header, record and span of a write-ahead log, read-only and without a lock.

    Damage to acknowledged records is a problem; a torn tail (a write that a
    crash cut short, never acknowledged) is a note, as for a channel. Without
    ``encryption``, encrypted records are checked by checksum only (a note says so).

    Raises:
        NotAChannelError: ``directory`` is not a write-ahead log.
        DecryptionError: The key given is the wrong one for a file.
    """
    rep = WalReport()
    log = _open_readonly(directory, fs, encryption)
    try:
        for c in log.corruption:
            rep.problems.append(c.describe())
        for path, start, size in log.torn_tails:  # size: the tail's length in bytes
            rep.notes.append(f"{path}: torn tail of {size} bytes from byte {start} (never acknowledged)")
        ctx = ScanContext(log.channel_id, log.crc_kind, log.max_payload, log.config)
        spans: dict[int, int] = {}
        first: set[int] = set()
        sealed = 0
        sealed_files: set[int] = set()
        for e in worded(_walk(log, ctx)):
            if e.kind == SEALED:
                sealed += 1
                sealed_files.add(e.file_id)
                first.add(e.file_id)
                continue
            if e.file_id not in first:
                first.add(e.file_id)
                if e.kind != fmt.WAL_SPAN:
                    rep.problems.append(f"file {e.file_id}: first record is not a time span")
            if e.kind == fmt.WAL_SPAN:
                spans[e.file_id] = fmt.decode_wal_span(e.data)
                continue
            rep.records += 1
            rep.bytes += len(e.data)
            end = spans.get(e.file_id)
            if end is not None and e.time_ns > end:
                rep.problems.append(
                    f"file {e.file_id} at byte {e.offset}: record time {e.time_ns / _NS} is after the file's end "
                    f"{end / _NS}"
                )
        if sealed:
            rep.notes.append(
                f"{sealed} encrypted records (spans included) checked by checksum only: give the key "
                "(encryption=, or --keystore) to check their authentication tags and times"
            )
            rep.records += sealed - len(sealed_files)  # each file's first record is its span
        known = {c.describe() for c in log.corruption}
        rep.problems.extend(r.describe() for r in ctx.reports if r.describe() not in known)
        rep.files = len(log.file_ids())
    finally:
        log.close()
    return rep
