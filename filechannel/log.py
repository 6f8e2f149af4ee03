"""The ``Log``: one open channel directory, as the channel and readers use it.

``Log`` ties the rooms of an open log together and serves the channel: it
opens the directory (``directory.py``: identity, data directories, locks),
recovers it (``recovery.py``: which checkpoint to trust, what to keep, what to
cut), hands the records recovery kept to replay, builds one ``Writer`` per data
directory (``writer.py``: group commit, the fsync policy, rolling files),
retires files (``retention.py``), reads queued events back, holds writers still
for a checkpoint, and reports counters. Its writers (``writers``) and
:meth:`Log.submit` are public for the WAL, which writes through them; a
read-only ``Log`` and its replay are ``logview.open_view``. What these share (counters, the FAILED
state, the live-file table, recovery's findings) is the
:class:`~filechannel.logstate.LogState` that ``Log`` extends. It knows nothing
of queues or capacity: ``channel.py`` builds those from the records it replays.

Reading a data file is ``scan.py``'s job (one read-only parser, shared by
recovery, ``verify`` and readers). Every durability syscall goes through ``_fs``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

from . import format as fmt
from ._fs import FS
from ._runs import Located
from .checkpoint import CheckpointStore
from .config import ChannelConfig
from .crypto import SEALED_WITHOUT_KEY, TAMPERED, FileCipher
from .directory import (
    CHANNEL_FILE,
    DATA_DIR_ID_FILE,
    DATA_DIRS_FILE,
    LOCK_FILE,
    WAL_FILE,
    ChannelDirectory,
    decode_channel_file,
    decode_meta,
    encode_channel_file,
    encode_meta,
)
from .errors import CorruptLogError, DecryptionError, EventFormatError, FormatError
from .logstate import DEFAULT_DATA_DIR, FSYNC_BUCKETS, LogState
from .recovery import Recovery
from .retention import retire_files
from .scan import (
    INF_WOID,
    LOCATE_WINDOW,
    LOST,
    CorruptionReport,
    FileScan,
    LogRecord,
    PutRun,
    ScanRecord,
    expand_runs,
    format_ranges,
    locate_puts,
    merge_ranges,
    ranges_of,
    segment_name,
)
from .space import ENOSPC_ERRNOS, SpaceGuard
from .writer import PREALLOC_STEP, CommitResult, Item, Pin, RollbackItem, Writer

__all__ = [
    "CHANNEL_FILE",
    "DATA_DIRS_FILE",
    "DATA_DIR_ID_FILE",
    "DEFAULT_DATA_DIR",
    "INF_WOID",
    "LOCK_FILE",
    "PREALLOC_STEP",
    "WAL_FILE",
    "CommitResult",
    "CorruptionReport",
    "Frozen",
    "Log",
    "LogRecord",
    "PutRun",
    "ScanRecord",
    "decode_channel_file",
    "decode_meta",
    "encode_channel_file",
    "encode_meta",
    "format_ranges",
    "merge_ranges",
    "ranges_of",
    "segment_name",
]

logger = logging.getLogger(__name__)


class Frozen(NamedTuple):
    """What :meth:`Log.freeze_lengths` yields: the files' lengths, and the syncs that make them durable."""

    files: dict[int, int]
    pins: list[tuple[Writer, Pin]]


LOCATE_CALM = 64
"""``Log.locate_puts`` calls without growth after which its learned window halves (toward ``scan.LOCATE_WINDOW``)."""

_LOST_REASON = "the queued event's record is missing or damaged: walking the file found no record for it"

# Log.read_events reads adjacent records with one pread, up to this many bytes at a time.
_RUN_BYTES = 4 << 20
_FRAME_SLACK = 64  # at least what framing and sealing add to one event (a bound for Log.wait_for_room)


class Log(LogState):
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
        progress: Called with a short message as recovery reads each data file.
        keyless_ok: A read-only inspection may meet encrypted files it cannot decrypt.
        wal: Open (or create) a write-ahead log's directory instead of a channel's;
            each refuses the other's.

    Raises:
        ChannelLockedError: Another open channel holds the directory.
        CorruptLogError: Acknowledged data is damaged, missing or foreign.
        DataDirOwnershipError: A data directory belongs to another channel.
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
        progress: Callable[[str], None] | None = None,
        keyless_ok: bool = False,
        wal: bool = False,
    ) -> None:
        super().__init__(directory, config, fs, readonly, keyless_ok, wal)
        self.checkpoints = checkpoints
        self._retire_lock = threading.Lock()
        self._syncer: threading.Thread | None = None
        self._stop = threading.Event()
        self._writers: list[Writer] = []
        self._dir = ChannelDirectory(self)
        self._anchor_lock = threading.Lock()  # ANCHOR is written by checkpoints and by refreshes
        self._anchor_woid = -1  # the last write-order id of the state ANCHOR holds (see write_anchor)
        self.sealing_started = False
        # The least window locate_puts reads: grown (and kept) when a batch did not fit in it.
        self.locate_window = LOCATE_WINDOW
        self._locate_calm = 0  # locate_puts calls since the window last had to grow
        try:
            self._dir.open()
            anchor = self._dir.read_anchor()
            recovery = Recovery(self, checkpoints, progress, anchor)
            recovery.run()
            self._writers = [Writer(self, i, d, recovery.live_by_dir[i]) for i, d in enumerate(self.data_dirs)]
            self.guard = SpaceGuard(self, self._active_bytes, self._room_ahead)
            self._dir.record_owners()
            if self.meta_mac is not None and not self.readonly:
                # From here on this channel writes authenticated files only: say so where a
                # truncation or a deletion of them cannot go unnoticed.
                self.first_auth = min(self.first_auth, recovery.first_auth, self.next_file_id)
                if (
                    anchor is None
                    or anchor.first_auth != self.first_auth
                    or anchor.generation < self.anchor_generation  # older than a checkpoint (skip mode)
                    or self._dir.anchor_key_id != self.meta_mac.key_id
                ):
                    # What ANCHOR vouched for stays vouched for (never what this open only read: it
                    # may not be durable yet); the marks of the acks include the checkpoint's.
                    self._dir.write_anchor(
                        fmt.AuthState(
                            self.first_auth,
                            anchor.files if anchor is not None else (),
                            next_position=recovery.vouched_next_position,
                            acks=self.ack_marks(),
                        )
                    )
                self.sealing_started = not self.macs_required  # the small files get their MACs now
                self.macs_required = True
        except BaseException:
            self._release()
            raise
        if not self.readonly and self.config.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="filechannel-fsync", daemon=True)
            self._syncer.start()

    def key_ids_in_use(self) -> list[str]:
        """The key ids of the live encrypted data files (a key may be dropped once its id is gone)."""
        return sorted(set(self.key_ids.values()))

    def cipher_of(self, file_id: int) -> FileCipher | None:
        """The cipher of an encrypted data file this log can decrypt, else None."""
        return self.ciphers.get(file_id)

    def _release(self) -> None:
        for fd in self.read_fds.values():
            try:
                self.fs.close(fd)
            except OSError:
                pass
        self.read_fds.clear()
        self._dir.release()

    # -- replay -----------------------------------------------------------------

    def replay(self) -> Iterator[LogRecord]:
        """Yield every verified record, in write-order id order, once.

        The records are those found when the log was opened; they are released
        as they are yielded, so call this once, right after opening.
        """
        return expand_runs(self.replay_runs())

    def release_recovery_state(self) -> None:
        """Drop what only recovery and replay use: the vouching checkpoint and the base snapshot.

        Replay calls this when it is done (``voucher_path`` stays, for messages).
        A queue built from the base snapshot shares its columns, so this frees
        only what nothing else holds.
        """
        self.voucher = None
        self.base_snapshot = None
        self.scans = []

    def replay_runs(self) -> Iterator[ScanRecord]:
        """Like :meth:`replay`, but the PUTs of each verified batch come as :class:`PutRun` s.

        Recovery kept them compactly (two int64 columns per data file, one run
        per stretch of a transaction's PUTs): no object per PUT. A run's ``woid``
        is its first PUT's, and no other record's write-order id falls inside a
        run, so the stream stays ordered. Salvaged PUTs are records, as in :meth:`replay`.
        """
        scans, self.scans = self.scans, []
        by_dir: dict[str, list[FileScan]] = {}
        for s in scans:
            by_dir.setdefault(os.path.dirname(s.path), []).append(s)
        streams = [itertools.chain.from_iterable(s.records for s in ss) for ss in by_dir.values()]
        if len(streams) == 1:
            return streams[0]  # no generator frame of our own per record
        return heapq.merge(*streams, key=lambda r: r.woid)

    # -- the write path ---------------------------------------------------------

    def writer_for(self, txn_id: int) -> int:
        """Return the data directory index that transaction ``txn_id`` writes to."""
        return txn_id % len(self._writers)

    def commit(
        self,
        txn_id: int,
        payloads: Sequence[bytes],
        takes: Sequence[tuple[int, int]] = (),
        on_written: Callable[[CommitResult], None] | None = None,
        prefix: bytes = b"",
        marks: Sequence[bytes] = (),
    ) -> CommitResult:
        """Append a transaction (MARK records, PUT records, one TAKE record, a COMMIT) and wait for it.

        Each PUT record's payload is ``prefix + payloads[i]`` (a channel passes
        the empty header block once for a transaction whose events have none);
        ``marks`` are encoded MARK payloads (``format.encode_marks``).

        With ``fsync="commit"`` this returns once the records are durable;
        with ``"interval"``, once they are written to the OS. ``on_written`` is
        called by the writing thread, in commit order, just before the commits
        of one write return: that is where the channel publishes the puts.

        Raises:
            OSError: The write or fsync failed; the transaction did not commit.
            ChannelClosedError: The log is closed or has failed.
        """
        item = Item(
            fmt.COMMIT,
            txn_id,
            payloads,
            takes,
            True,
            on_written,
            overhead=self.seal_overhead,
            prefix=prefix,
            marks=marks,
        )
        w = self._writers[txn_id % len(self._writers)]
        try:
            w.submit(item)
        except OSError as exc:
            if exc.errno in ENOSPC_ERRNOS and self.failed is None and payloads:
                # The write ran out of space and was cut back (else the log failed): a full
                # disk, not a failure. The transaction is undone; nothing of it was written.
                raise self.guard.out_of_space(w.index, exc) from exc
            raise
        return item.result

    @property
    def writers(self) -> list[Writer]:
        """The writers, one per data directory, in the order of ``data_dirs``."""
        return self._writers

    def submit(self, item: Item, index: int = 0) -> None:
        """Hand ``item`` to the writer of data directory ``index`` (what the WAL writes through)."""
        self._writers[index].submit(item)

    def rollback(self, txn_id: int, n_puts: int, n_takes: int) -> None:
        """Note a rollback in the log; it is written with the next write, never waited for."""
        if self.failed is not None or self.closed or self.readonly:
            return
        self._writers[txn_id % len(self._writers)].submit(RollbackItem(txn_id, n_puts, n_takes))

    def retire(self, file_ids: Sequence[int]) -> None:
        """Remove data files that no longer hold anything the channel needs (see ``retention.py``)."""
        with self._retire_lock:
            retire_files(self, self._writers, file_ids)

    def is_encrypted(self, file_id: int) -> bool:
        """Whether a live data file's events are encrypted."""
        return file_id in self.key_ids or file_id in self.undecryptable

    def _read_fd(self, file_id: int) -> int:
        """The read-only descriptor of a live data file, opened on first use and kept."""
        fd = self.read_fds.get(file_id)
        if fd is None:
            path = self.files[file_id][1]
            fd = self.fs.open_read(path)
            old = self.read_fds.setdefault(file_id, fd)
            if old != fd:
                self.fs.close(fd)
                fd = old
        return fd

    def locate_puts(self, file_id: int, offset: int, lo: int, hi: int, want: int) -> Located:
        """Find queued events' records: the queue's ``_runs.Locate`` over this log's data files.

        Reads data file ``file_id`` forward from ``offset`` (a record boundary) a
        window at a time and walks it with ``scan.committed_puts``: the first ``want``
        committed PUTs with positions in ``[lo, hi)``, as a ``_runs.Located`` (fewer
        when they span more than :data:`scan.LOCATE_MAX` bytes: call again). The
        walk never passes the COMMIT of the last event it needs, all of whose
        records were written before the event was published, so it never reads
        what a writer is still writing. The log keeps the least window the walks
        needed (:attr:`locate_window`: grown when a batch did not fit in it, halved
        after :data:`LOCATE_CALM` calls that needed no more), so a batch longer
        than the first window is walked for nothing once, not once per run (the
        spot check at reopen samples up to 16 runs' heads) or per file end.

        Raises:
            CorruptLogError: A frame there is not a record, or a COMMIT does not verify.
            OSError: Reading failed.
        """
        fd = self._read_fd(file_id)
        try:
            got = locate_puts(
                lambda n, at: self.fs.pread(fd, n, at),
                offset,
                lo,
                hi,
                want,
                self.seeds[file_id],
                self.crc_kind,
                self.max_payload,
                file_id not in self.ciphers and file_id not in self.undecryptable,
                window=self.locate_window,
            )
        except FormatError as exc:  # pragma: no cover - the walk steps over damage
            raise CorruptLogError(self.files[file_id][1], exc.offset, exc.reason) from exc
        if got.window > self.locate_window:
            self.locate_window = got.window  # a race with another walk keeps one of two good sizes
            self._locate_calm = 0
        elif self.locate_window > LOCATE_WINDOW:
            # One huge batch must not make every later walk read huge windows: after
            # LOCATE_CALM calls that needed no more, the window halves (it grows again if it must).
            self._locate_calm += 1
            if self._locate_calm >= LOCATE_CALM:
                self.locate_window = max(LOCATE_WINDOW, self.locate_window // 2)
                self._locate_calm = 0
        return Located(got.first, got.offsets, got.sizes, got.next_offset)

    def read_payload(self, file_id: int, offset: int, size: int, *, decrypt: bool = True) -> bytes:
        """Read and verify the record at a pointer; return its payload (decrypted).

        ``decrypt=False`` checks only the record's checksum and returns the
        payload as stored (``verify`` without a key).

        Raises:
            CorruptLogError: The record there no longer verifies.
            DecryptionError: Its checksum is intact but its authentication tag
                fails, or its file cannot be decrypted.
        """
        if offset == LOST:
            raise CorruptLogError(self.files[file_id][1], 0, _LOST_REASON)
        buf = self.fs.pread(self._read_fd(file_id), size, offset)
        got = fmt.decode_puts(buf, (0,), (size,), self.seeds[file_id], self.crc_kind, self.max_payload, False)[0]
        if isinstance(got, FormatError):
            err = CorruptLogError(self.files[file_id][1], offset + got.offset, got.reason)
            raise err from got
        payload = cast(bytes, got)  # decode=False: the payload, or the error above
        if not decrypt:
            return payload
        return self._opened(file_id, offset, buf[:24], payload, buf[1] == fmt.FLAG_SEALED)

    def _opened(self, file_id: int, offset: int, head: bytes, payload: bytes, sealed: bool) -> bytes:
        """The plaintext of a verified PUT payload whose frame starts with ``head`` (24 bytes).

        Raises:
            DecryptionError: Its authentication tag fails, its file cannot be
                decrypted, or it is sealed in a file without a cipher.
        """
        cipher = self.ciphers.get(file_id)
        if cipher is not None:
            plain = cipher.open(head, offset, payload)
            if plain is None:
                raise DecryptionError(self.files[file_id][1], offset, TAMPERED, cipher.key_id)
            return plain
        if file_id in self.undecryptable:
            raise DecryptionError(self.files[file_id][1], offset, self.undecryptable[file_id])
        if sealed:
            why = self.headerless.get(file_id, SEALED_WITHOUT_KEY)
            raise DecryptionError(self.files[file_id][1], offset, why)
        return payload

    def read_events(
        self, entries: Sequence[tuple[int, int, int, int]]
    ) -> list[tuple[bytes, dict[str, str]] | CorruptLogError]:
        """Read and decode the events that queue entries ``(position, file id, offset, size)`` point at.

        The batch form of :meth:`read_payload` plus ``format.decode_event`` (what a
        take that misses the cache does per event): entries whose records lie
        back to back in one file (``offset + size`` is the next entry's offset)
        are read with one ``pread`` per run and verified and decoded in one
        ``format.decode_puts`` call (C with the accelerator). Returns, per entry
        and in order, ``(body, headers)`` or the error reading that entry alone
        would raise (not raised here, so the caller applies ``on_corruption``
        per event): a :class:`CorruptLogError` naming the record's path and
        offset, or a :class:`DecryptionError`.

        Raises:
            OSError: Reading a data file failed.
        """
        out: list[tuple[bytes, dict[str, str]] | CorruptLogError] = []
        n = len(entries)
        i = 0
        while i < n:
            fid, start, size = entries[i][1], entries[i][2], entries[i][3]
            if start == LOST:  # the queue's walk found no record for it: damage (scan.committed_puts)
                out.append(CorruptLogError(self.files[fid][1], 0, _LOST_REASON))
                i += 1
                continue
            end = start + size
            j = i + 1
            while j < n:
                _p, f2, o2, s2 = entries[j]
                if f2 != fid or o2 != end or end - start + s2 > _RUN_BYTES:
                    break
                end += s2
                j += 1
            run = entries[i:j]
            i = j
            buf = self.fs.pread(self._read_fd(fid), end - start, start)
            plain = fid not in self.ciphers and fid not in self.undecryptable
            results = fmt.decode_puts(
                buf,
                [e[2] - start for e in run],
                [e[3] for e in run],
                self.seeds[fid],
                self.crc_kind,
                self.max_payload,
                plain,
            )
            for e, r in zip(run, results, strict=True):
                if type(r) is tuple:
                    out.append(r)
                else:
                    out.append(self._event_or_error(fid, e[2], buf, e[2] - start, r))
        return out

    def _event_or_error(
        self, file_id: int, offset: int, buf: bytes, rel: int, got: fmt.DecodedPut
    ) -> tuple[bytes, dict[str, str]] | CorruptLogError:
        """Finish one record of :meth:`read_events` that ``decode_puts`` did not decode."""
        err: CorruptLogError
        if isinstance(got, EventFormatError):
            err = CorruptLogError(self.files[file_id][1], offset, f"queued event does not decode: {got.reason}")
            err.__cause__ = got
            return err
        if isinstance(got, FormatError):
            err = CorruptLogError(self.files[file_id][1], offset + got.offset, got.reason)
            err.__cause__ = got
            return err
        stored = cast(bytes, got)  # verified, left undecoded: an encrypted file's, or sealed
        try:
            payload = self._opened(file_id, offset, buf[rel : rel + 24], stored, buf[rel + 1] == fmt.FLAG_SEALED)
            return fmt.decode_event(payload)
        except EventFormatError as exc:
            err = CorruptLogError(self.files[file_id][1], offset, f"queued event does not decode: {exc.reason}")
            err.__cause__ = exc
            return err
        except CorruptLogError as exc:  # DecryptionError
            return exc

    @contextmanager
    def freeze(self) -> Iterator[dict[int, int]]:
        """Hold every writer still, everything written durable, for a checkpoint.

        Yields the replay resume offset of every live data file: records after
        it have write-order ids above :attr:`last_woid` as read inside the block.
        The writers are held through the fdatasync of what is not durable yet;
        :meth:`freeze_lengths` holds them only while the lengths are read.

        Raises:
            ChannelClosedError: The log has failed or is closed.
            OSError: Making written data durable failed (the log fails too).
        """
        with self._retire_lock:
            locks = [w.io_lock for w in self._writers]
            for lk in locks:
                lk.acquire()
            try:
                self.check_writable()
                for w in self._writers:
                    if w.fd is not None and w.synced != w.offset:
                        try:
                            self.fs.fdatasync(w.fd)
                        except OSError as exc:
                            self.fail(exc, f"fdatasync of {w.path_of(w.file_id)} failed")
                            raise
                        self.fsyncs += 1
                        w.synced = w.offset
                yield self._frozen_files()
            finally:
                for lk in reversed(locks):
                    lk.release()

    def _frozen_files(self) -> dict[int, int]:
        files = {fid: self.file_end.get(fid, 0) for fid in self.files}
        for w in self._writers:
            if w.fd is not None:
                files[w.file_id] = w.offset
        return files

    @contextmanager
    def freeze_lengths(self) -> Iterator[Frozen]:
        """:meth:`freeze` without the fdatasync: every writer held still only while the block runs.

        Yields a :class:`Frozen` whose ``files`` are as :meth:`freeze` yields, not
        yet all durable: after the block, :meth:`make_durable` makes them so
        (committers run while it syncs), and nothing may vouch for them before.
        The block should be short: commits wait for it.

        Raises:
            ChannelClosedError: The log has failed or is closed.
        """
        with self._retire_lock:
            locks = [w.io_lock for w in self._writers]
            for lk in locks:
                lk.acquire()
            pins: list[tuple[Writer, Pin]] = []
            try:
                self.check_writable()
                for w in self._writers:
                    pin = w.pin()
                    if pin is not None:
                        pins.append((w, pin))
                frozen = Frozen(self._frozen_files(), pins)
                yield frozen
            except BaseException:
                self._unpin(pins)
                raise
            finally:
                for lk in reversed(locks):
                    lk.release()

    def make_durable(self, frozen: Frozen) -> None:
        """Make the files :meth:`freeze_lengths` yielded durable to those lengths (call once, after it).

        Raises:
            OSError: An fdatasync failed (the log fails too).
            ChannelClosedError: The log has failed (what it yielded may not be durable).
        """
        pins = list(frozen.pins)
        frozen.pins.clear()
        try:
            while pins:
                w, pin = pins.pop(0)
                w.sync_pinned(pin)
        finally:
            self._unpin(pins)

    @staticmethod
    def _unpin(pins: list[tuple[Writer, Pin]]) -> None:
        for w, pin in pins:
            try:
                w.unpin(pin)
            except OSError:  # the log has failed; the first error is what the caller sees
                pass
        pins.clear()

    def frozen_auth_state(self, files: dict[int, int]) -> fmt.AuthState | None:
        """The authenticated live files at the lengths :meth:`freeze` yielded; call inside it."""
        tags = {w.file_id: w.prev_tag for w in self._writers if w.fd is not None and w.tagger is not None}
        return self.auth_state(files, tags)

    def refresh_anchor(self) -> bool:
        """Vouch in ``ANCHOR`` for every authenticated file as durable now (encrypted channels; False: none).

        Between checkpoints, so that whole batches cut from the end of the newest
        file are caught at the next open (the writers are held while the lengths are
        read, and what is not yet durable is synced after, as for a checkpoint).
        """
        if self.meta_mac is None:
            return False
        with self.freeze_lengths() as frozen:
            woid = self.last_woid
            state = self.frozen_auth_state(frozen.files)
        self.make_durable(frozen)
        self.write_anchor(state, woid)
        return True

    def write_anchor(self, state: fmt.AuthState | None, woid: int | None = None) -> None:
        """Record the authenticated files a checkpoint just vouched for in ``ANCHOR`` (encrypted channels).

        ``woid``: the last write-order id of the frozen state. A state older than
        the one ``ANCHOR`` already holds (a paced checkpoint that froze before a
        refresh) is not written: it would vouch for less.
        """
        with self._anchor_lock:
            if woid is not None:
                if woid < self._anchor_woid:
                    return
                self._anchor_woid = woid
            self._dir.write_anchor(state)

    def file_dirs(self, file_ids: Iterable[int]) -> dict[int, int]:
        """The data directory index of each of these live files (a checkpoint records it)."""
        return {fid: self.files[fid][0] for fid in file_ids if fid in self.files}

    def counters(self) -> tuple[int, int, int, int]:
        """Return ``(last woid, next position, next txn id, next file id)``; call inside :meth:`freeze`."""
        return self.next_woid - 1, self.next_position, self.peek_txn_id(), self.next_file_id

    # -- space, state, stats ------------------------------------------------------

    def check_space(self, index: int) -> None:
        """Raise DiskSpaceError (at once) if data directory ``index`` is under minimum_required_space."""
        self.guard.check(index)

    def wait_for_room(self, index: int, payloads: Sequence[bytes] | fmt.PutColumn = ()) -> None:
        """Return once a put (or the commit of ``payloads``) has room under ``max_bytes`` and the floor.

        Waits up to ``keep_alive`` (``space.py``); takes never call it.

        Raises:
            ChannelFullError: ``max_bytes`` stayed reached, or :class:`DiskSpaceError`:
                free space stayed under the floor. Nothing was written.
        """
        cfg = self.config
        nbytes = 0
        if payloads:
            # A bound first (no event is larger than max_event_size): the exact size only when it matters.
            nbytes = len(payloads) * (cfg.max_event_size + _FRAME_SLACK)
            if self.guard.roomy(index, nbytes):
                return
            nbytes = fmt.frames_size(payloads, self.seal_overhead + len(fmt.EMPTY_HEADERS))
        self.guard.check(index, nbytes, cfg.keep_alive)

    def _active_bytes(self) -> int:
        return sum(w.offset for w in self._writers if w.fd is not None)

    def _room_ahead(self, index: int) -> int:
        w = self._writers[index]
        return max(0, w.phys_end - w.offset) if w.fd is not None else 0

    def file_ids(self) -> list[int]:
        """Return the ids of the data files that are part of the channel."""
        return sorted(self.files)

    def file_path(self, file_id: int) -> str:
        """Return the path of a live data file."""
        return self.files[file_id][1]

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

    def stats(self) -> dict[str, Any]:
        """Counters of the log (fsyncs, bytes, files)."""
        total = 0
        # list() copies the table in one step (no Python code runs while it iterates),
        # so a file retired by the background thread meanwhile cannot break the loop.
        for _, path in list(self.files.values()):
            try:
                fd = self.fs.open_read(path)
            except OSError:
                continue
            try:
                total += self.fs.size(fd)
            finally:
                self.fs.close(fd)
        return {
            "fsyncs": self.fsyncs,
            "fsync_seconds": round(self.fsync_seconds, 6),
            # Cumulative, as Prometheus has them: [upper bound, fdatasyncs that took at most that].
            "fsync_seconds_buckets": [
                [le, n]
                for le, n in zip(
                    (*(repr(b) for b in FSYNC_BUCKETS), "+Inf"), itertools.accumulate(self.fsync_buckets), strict=True
                )
            ],
            "bytes_written": self.bytes_written,
            "files": len(self.files),
            "files_created": self.files_created,
            "files_retired": self.files_retired,
            "disk_bytes": total,
            "last_woid": self.last_woid,
            "torn_tails_truncated": len(self.torn_tails),
            "corruptions_skipped": len(self.corruption),
            **self.guard.stats(self.data_dirs),
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
        self.check_writable()

    def close(self) -> None:
        """Write what is pending, make it durable, release the lock. Idempotent."""
        if self.closed:
            return
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        err: BaseException | None = None
        # From here on new commits are refused; one being written finishes first.
        self.closing = True
        if not self.readonly:
            for w in self._writers:
                err = err or w.drain_on_close()
        self.closed = True
        self._release()
        if err is not None:
            raise err
