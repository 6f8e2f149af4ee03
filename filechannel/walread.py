"""Reading a write-ahead log's records back: its committed records in write order, in a log's words.

This module owns the read side that ``wal.WriteAheadLog`` (``read``,
``read_all``) and the ``filechannel wal`` tools (``dump_wal``, ``verify_wal``)
share: which files to read and how far (:class:`Slot`, :func:`sealed_end`,
:func:`kept_ends`), the walk of each file through ``scan.Scanner`` as a
sealed file with its damage policy (:func:`entries`, reporting to a
:class:`ScanContext`), the decryption of an encrypted record's payload
(:func:`open_payload`), and the channel errors reworded for a write-ahead log
(:func:`in_wal_words`, :func:`worded`). It writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from . import format as fmt
from ._fs import FS
from .config import ChannelConfig
from .crypto import SEALED_WITHOUT_KEY, TAMPERED, FileCipher
from .errors import WAL_HINT, CorruptLogError, DecryptionError, FormatError, NotAChannelError
from .log import Log
from .recovery import first_record
from .scan import CorruptionReport, Scanner

__all__ = [
    "SEALED",
    "Entry",
    "ScanContext",
    "Slot",
    "close_all",
    "entries",
    "in_wal_words",
    "kept_ends",
    "open_payload",
    "sealed_end",
    "worded",
]

logger = logging.getLogger("filechannel.wal")


@dataclass
class ScanContext:
    """What ``scan.Scanner`` asks of the directory it reads (for reads after opening)."""

    channel_id: bytes
    crc_kind: int
    max_payload: int
    config: ChannelConfig
    reports: list[CorruptionReport] = field(default_factory=list)

    def report_corruption(self, report: CorruptionReport) -> None:
        """Keep ``report`` (skip mode) and log it."""
        self.reports.append(report)
        logger.error("on_corruption='skip': %s", report.describe())

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:  # pragma: no cover
        """Log unverified bytes at a file's end (a sealed scan does not meet them)."""
        # Files are scanned as sealed (only up to what was written and verified), so
        # a torn tail cannot be seen here; recovery at open dealt with the real one.
        logger.warning("%s: unverified bytes from %d to %d: %s", path, start, size, reason)


@dataclass
class Slot:
    """A file to read: its id, path, the length to read and, until read, an open descriptor."""

    fid: int
    path: str
    end: int
    fd: int | None


def close_all(fs: FS, files: Sequence[Slot]) -> None:
    """Close the descriptors of the files not read (an iteration stopped early)."""
    for f in files:
        fd, f.fd = f.fd, None
        if fd is not None:
            try:
                fs.close(fd)
            except OSError:
                pass


@dataclass(frozen=True)
class Entry:
    """One record as the scan of a file yields it (for ``read_all`` and ``dump``)."""

    file_id: int
    offset: int
    length: int
    woid: int
    kind: int
    time_ns: int
    data: bytes


def open_payload(log: Log, fid: int, path: str, head: bytes, offset: int, payload: bytes) -> bytes:
    """Decrypt a PUT payload of an encrypted file (as stored otherwise).

    Raises:
        DecryptionError: The authentication tag fails (tampered, moved, wrong key),
            or the file is encrypted and no key was given.
    """
    cipher: FileCipher | None = log.cipher_of(fid)
    if cipher is not None:
        plain = cipher.open(head, offset, payload)
        if plain is None:
            raise DecryptionError(path, offset, TAMPERED, cipher.key_id)
        return plain
    if log.is_encrypted(fid):
        raise DecryptionError(path, offset, "the data file is encrypted and no key for it was given")
    if head[1] == fmt.FLAG_SEALED:
        raise DecryptionError(path, offset, SEALED_WITHOUT_KEY)
    return payload


def sealed_end(log: Log, fid: int) -> int | None:
    """How far to read a file no longer written: all of a recovered one, else its written end.

    A recovered file is read whole: in skip mode its end of verified batches may
    lie before records salvaged from damage. A torn tail was cut off at open, or,
    read-only, is left out.
    """
    size = log.file_sizes.get(fid)
    if size is None or any(path == log.file_path(fid) for path, _start, _size in log.torn_tails):
        return log.file_end.get(fid)  # a torn tail stays on disk in a read-only inspection
    return size


def kept_ends(log: Log) -> dict[int, int]:
    """The recovered files whose kept bytes reach past their last verified batch, and how far.

    That happens only with ``on_corruption="skip"``: records salvaged from damaged
    bytes that the newest checkpoint vouched for (acknowledged, and returned by
    this open). A checkpoint written later must go on vouching for them, up to
    the file's size, or the next open would take them for a torn tail and cut
    them: a record lost after it was delivered. Call it before replay, which
    drops the vouching checkpoint.
    """
    voucher = log.voucher
    if voucher is None:
        return {}
    out: dict[int, int] = {}
    for fid, vouched in voucher.files.items():
        size, end = log.file_sizes.get(fid), log.file_end.get(fid)
        if size is not None and end is not None and min(vouched, size) > end:
            out[fid] = min(vouched, size)
    return out


@contextmanager
def in_wal_words() -> Iterator[None]:
    """Give the errors the shared channel code raises a write-ahead log's words.

    A damage report names ``filechannel wal verify``, not the channel's ``verify``
    (which refuses a log); a directory that is not a log says so, not that it is
    "not a filechannel directory".
    """
    try:
        yield
    except CorruptLogError as exc:
        exc.rehint(WAL_HINT)
        raise
    except NotAChannelError as exc:
        if exc.expected != "a filechannel directory":
            raise
        reason = exc.reason
        if reason.startswith("it is a channel"):
            reason = "it is a channel (open it with filechannel.open; the `filechannel` channel commands inspect it)"
        elif reason.startswith("no CHANNEL file"):
            reason = "no CHANNEL file (create a write-ahead log with filechannel.WriteAheadLog)"
        raise NotAChannelError(exc.path, reason, expected="a write-ahead log") from None


def worded(records: Iterator[Any]) -> Iterator[Any]:
    """``records``, with the errors raised while iterating them in a write-ahead log's words."""
    with in_wal_words():
        yield from records


SEALED = -1  # an Entry kind: the record is encrypted and no key was given (dump and verify only)


def entries(log: Log, ctx: ScanContext, files: Sequence[Slot], keyless: bool = False) -> Iterator[Entry]:
    """Yield the committed records of ``files`` in write order (closing each once read).

    Each file is read up to ``end`` (what was written and verified) and walked
    by ``scan.Scanner`` as a sealed file: damage raises ``CorruptLogError``, or
    with ``on_corruption="skip"`` is stepped over and reported in ``ctx``. An
    encrypted file whose key the log holds has its batch tags checked: a batch
    forged or edited since the log was opened is damage, never read.
    """
    prev_woid = 0
    fs = log.fs
    for slot in files:
        fid, path, fd = slot.fid, slot.path, slot.fd
        if fd is None:
            continue
        slot.fd = None
        try:
            buf = fs.pread(fd, slot.end, 0)
        finally:
            fs.close(fd)
        start: int | None = None
        try:
            decoded = fmt.decode_file_header(buf)
            if not isinstance(decoded, fmt.FileHeader):
                raise FormatError(0, "file shorter than its header")
            if decoded.channel_id != log.channel_id or decoded.file_id != fid:
                raise FormatError(0, "file header names another log or file")
            header = decoded
        except FormatError as exc:
            if ctx.config.on_corruption != "skip":
                raise CorruptLogError(path, exc.offset, exc.reason) from exc
            # As recovery does: only the header is lost; the records are read with the
            # seed the file name gives, from the first one that verifies.
            start = first_record(log, buf, fid)
            ctx.report_corruption(CorruptionReport(path, exc.offset, f"file header: {exc.reason}", start, file_id=fid))
            header = fmt.FileHeader(log.crc_kind, log.channel_id, fid, 0, 0, 0, 0)
        # An authenticated file (format version 2) read with its key: every batch's tag must verify
        # and chain to the one before, as at open. Without the key (dump, verify) tags go unchecked.
        scan = Scanner(ctx, path, fid, buf, header, auth=log.cipher_of(fid)).scan(False, prev_woid, start)
        prev_woid = scan.last_woid
        puts: dict[int, list[tuple[int, int, int]]] = {}
        for r in scan.plain():
            if r.op == fmt.PUT:
                puts.setdefault(r.txn_id, []).append((r.offset, r.size, r.woid))
            elif r.op == fmt.COMMIT:
                for off, size, woid in puts.pop(r.txn_id, []):
                    n = fmt.record_length_at(buf, off)
                    start = off + fmt.RECORD_HEADER_LEN
                    if keyless and log.is_encrypted(fid) and log.cipher_of(fid) is None:
                        yield Entry(fid, off, size, woid, SEALED, 0, b"")
                        continue
                    try:
                        payload = open_payload(log, fid, path, buf[off : off + 24], off, buf[start : start + n])
                    except DecryptionError as exc:
                        if ctx.config.on_corruption != "skip" or log.cipher_of(fid) is None:
                            raise
                        ctx.report_corruption(CorruptionReport(path, off, exc.reason, size, file_id=fid))
                        continue
                    try:
                        kind, t, data = fmt.decode_wal_payload(payload)
                    except FormatError as exc:
                        # The checksum verified, so these bytes were written as they are.
                        raise CorruptLogError(path, off, f"not a write-ahead log record: {exc.reason}") from exc
                    yield Entry(fid, off, size, woid, kind, t, data)
        for txn, lost in puts.items():  # skip mode: PUTs whose COMMIT was damaged
            ctx.report_corruption(
                CorruptionReport(
                    path,
                    lost[0][0],
                    f"the COMMIT record of write {txn} is lost: its {len(lost)} record(s) dropped",
                    0,
                    file_id=fid,
                )
            )
