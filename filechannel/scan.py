"""Reading data files, read-only: records, batches, and what damage means.

This module owns the one parser of data files that recovery, ``verify`` and
(later) the cross-process reader share: it walks a data file's records, keeps
those inside a verified batch, and classifies everything else as the
zero-filled space ahead of the writer, a torn tail (nothing acknowledged
follows it), or damage to acknowledged data. It never writes, truncates or
moves a file and keeps no state of its own: what to do about damage
(``on_corruption``) and where reports go is asked of a :class:`ScanContext`
(the ``Log`` that opened the directory).

Only records covered by a verified BATCH_END count. Bytes below the length a
checkpoint recorded for a file (``vouched``) were durable and acknowledged, so
losing them is never a torn tail. With ``on_corruption="skip"`` every record
that verifies on its own is salvaged from a damaged stretch, and each stretch
that cannot be framed becomes one :class:`CorruptionReport`.
"""

from __future__ import annotations

import logging
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from . import format as fmt
from ._fs import FS
from .config import ChannelConfig
from .errors import CorruptLogError, FormatError

logger = logging.getLogger(__name__)

SEG_RE = re.compile(r"^seg-([0-9a-f]{16})\.wal$")
BATCH_END_SIZE = fmt.record_size(32)


def segment_name(file_id: int) -> str:
    """Return the file name of data file ``file_id``."""
    return f"seg-{file_id:016x}.wal"


class ScanContext(Protocol):
    """What a scan needs from the directory it reads (``Log`` provides it)."""

    channel_id: bytes
    crc_kind: int
    max_payload: int
    config: ChannelConfig

    def report_corruption(self, report: CorruptionReport) -> None:
        """Record damage that ``on_corruption="skip"`` stepped over."""

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        """Record a torn, unacknowledged tail from ``start`` to ``size``."""


# --------------------------------------------------------------------------
# results of recovery


@dataclass(frozen=True, slots=True)
class LogRecord:
    """A record as replay yields it: where it lives, and its decoded fields.

    ``payload`` is empty for PUT records (read them with :meth:`Log.read_payload`);
    ``size`` is the whole frame, so ``(file_id, offset, size)`` is a pointer.
    ``salvaged``: the record verifies on its own, but its batch does not (it
    was recovered one record at a time from damaged, acknowledged data).
    ``sealed``: a MARK whose payload is encrypted (flag ``FLAG_SEALED``; open it
    with its file's cipher). Always false for a PUT: its flag is read with its
    payload, when it is taken.
    """

    op: int
    woid: int
    txn_id: int
    file_id: int
    offset: int
    size: int
    payload: bytes
    salvaged: bool = False
    sealed: bool = False


PUT_RUN = 0x100
"""The ``op`` of a :class:`PutRun` (no record on disk has it: on-disk ops are one byte)."""


@dataclass(frozen=True, slots=True, eq=True)
class PutRun:
    """Consecutive PUT records of one transaction in one verified batch, stored compactly.

    A compact scan (``Scanner.scan(compact=True)``, what recovery uses) keeps
    no :class:`LogRecord` per verified PUT: the PUTs' offsets and frame sizes
    go into the scan's two ``array("q")`` columns, and one run stands for
    ``count`` PUTs with write-order ids ``woid, woid + 1, ...``, at
    ``offsets[start:start + count]`` and ``sizes[start:start + count]`` of
    file ``file_id``. Runs never hold salvaged PUTs (those stay records).
    """

    op: int  # always PUT_RUN
    woid: int  # the first PUT's write-order id
    txn_id: int
    file_id: int
    start: int
    count: int
    offsets: array[int]
    sizes: array[int]
    salvaged: bool = False  # never: salvaged PUTs stay LogRecords (here so any record can be asked)

    def records(self) -> list[LogRecord]:
        """The PUT records this run stands for, as a non-compact scan keeps them."""
        s, e, w, t, f = self.start, self.start + self.count, self.woid, self.txn_id, self.file_id
        return [
            LogRecord(fmt.PUT, w + i, t, f, o, z, b"")
            for i, (o, z) in enumerate(zip(self.offsets[s:e], self.sizes[s:e], strict=True))
        ]


ScanRecord = LogRecord | PutRun
"""What a scan keeps: records, and (compact scans only) runs of PUTs."""


def expand_runs(records: Iterable[ScanRecord]) -> Iterator[LogRecord]:
    """Yield ``records`` with every :class:`PutRun` replaced by the PUT records it stands for."""
    for r in records:
        if r.op == PUT_RUN:
            assert isinstance(r, PutRun)
            yield from r.records()
        else:
            assert isinstance(r, LogRecord)
            yield r


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
class FileScan:
    """What a scan of one data file found: its verified records and where they end."""

    file_id: int
    path: str
    header: fmt.FileHeader
    records: list[ScanRecord]  # LogRecords, and PutRuns when the scan was compact
    end: int  # offset after the last verified batch
    size: int  # file size on disk
    last_woid: int
    header_damaged: bool = False
    compact: bool = False  # the scan kept verified PUTs as PutRuns
    last_tag: bytes = b""  # an authenticated file's last verified batch tag (where a later scan chains on)

    def plain(self) -> list[LogRecord]:
        """The records of a scan that was not compact: every one a :class:`LogRecord`."""
        if self.compact:
            raise ValueError("a compact scan holds PutRuns: use expand_runs(scan.records)")
        return self.records  # type: ignore[return-value]  # no PutRun without compact=True


# --------------------------------------------------------------------------
# scanning one data file


CRC_CHUNK = 1 << 20
"""Bytes checksummed per step over a long stretch: a batch is never copied whole to be checksummed."""

SALVAGE_WORK = 8
"""Bytes salvage may checksum per byte of a damaged stretch (plus :data:`SALVAGE_SLACK`) before it gives up on it.

Damage a disk or a crash makes never comes near it; a stretch crafted so that every
8-byte step looks like a long record would otherwise cost time quadratic in its size.
"""
SALVAGE_SLACK = 1 << 20


def crc_of(kind: int, buf: bytes | bytearray, start: int, end: int, seed: int) -> int:
    """Return the checksum of ``buf[start:end]`` extending ``seed``, copying at most :data:`CRC_CHUNK` bytes at once."""
    view = memoryview(buf)
    c = seed
    for a in range(start, end, CRC_CHUNK):
        c = fmt.crc(kind, view[a : min(a + CRC_CHUNK, end)], c)
    return c


def all_zero(buf: bytes | bytearray, start: int) -> bool:
    """Return whether every byte of ``buf`` from ``start`` on is zero."""
    n = len(buf) - start
    if n <= 0:
        return True
    if isinstance(buf, (bytes, bytearray)):
        return buf.count(0, start) == n
    view = memoryview(buf)  # a mapped file: compared a chunk at a time
    end = len(buf)
    zero = bytes(min(n, CRC_CHUNK))
    return all(view[a : a + CRC_CHUNK] == zero[: min(CRC_CHUNK, end - a)] for a in range(start, end, CRC_CHUNK))


def first_record(buf: bytes | bytearray, start: int, limit: int, seed: int, kind: int, max_payload: int) -> int | None:
    """Return the first 8-aligned offset in ``[start, limit)`` where a record verifies, else None.

    What recovery tries after a damaged file header. Bounded: the bytes it
    checksums are at most :data:`SALVAGE_WORK` times the stretch tried plus
    :data:`SALVAGE_SLACK` (a candidate frame claiming a long payload costs its
    length); past that it gives up (None), as a crafted stretch would make it
    quadratic otherwise.
    """
    limit = min(limit, len(buf))
    budget = SALVAGE_WORK * max(0, limit - start) + SALVAGE_SLACK
    for off in range(start + fmt.pad_len(start), limit, 8):
        cost = _frame_cost(buf, off, len(buf))
        if cost > budget:
            return None
        budget -= cost
        try:
            rec = fmt.decode_record(buf, off, seed, kind, max_payload)
        except FormatError:
            continue
        if isinstance(rec, fmt.Record):
            return off
    return None


def _frame_cost(buf: bytes | bytearray | memoryview, pos: int, stop: int) -> int:
    """Bytes ``format.decode_record`` may checksum for a frame at ``pos`` (at most up to ``stop``)."""
    if pos + fmt.RECORD_HEADER_LEN > stop or buf[pos] not in (fmt.PUT, fmt.TAKE, fmt.MARK):
        return 0  # the other ops' lengths are checked before the checksum: constant work
    return min(fmt.record_size(fmt.record_length_at(buf, pos)), stop - pos)


def find_verified_batch_end(
    buf: bytes | bytearray, start: int, seed: int, kind: int, max_payload: int, base: int = 0
) -> tuple[int, fmt.BatchEnd] | None:
    """Return the first BATCH_END at or after ``start`` whose whole batch verifies.

    ``buf`` holds the file's bytes from offset ``base`` on; ``start`` and the
    returned offset are relative to ``buf``, the BatchEnd's fields to the file.

    Linear in the bytes searched, whatever they hold: a frame that is not a
    BATCH_END of an allowed length is refused before its checksum
    (``format.decode_record``), and the batches checksummed never overlap. A
    BATCH_END frame that verifies on its own was written by us, so no batch
    spans it: a later one claiming a batch that starts before its end is
    refused without checksumming that batch.
    """
    off = start + fmt.pad_len(start)
    n = len(buf)
    find = buf.find
    marker = bytes([fmt.BATCH_END])
    floor = 0  # where the batch of the next BATCH_END may start, at the earliest
    while off + BATCH_END_SIZE <= n:
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
                rel = be.batch_start - base
                if rel + be.batch_len == off and rel >= floor and crc_of(kind, buf, rel, off, seed) == be.batch_crc:
                    return off, be
                floor = rec.end
        except FormatError:
            pass
        off += 8
    return None


def _compact(batch: list[LogRecord], records: list[ScanRecord], offsets: array[int], sizes: array[int]) -> None:
    """Keep a verified batch compactly: each stretch of one transaction's PUTs becomes one run.

    The twin of the C walk's compact mode (``_speedups.scan_batches`` with a run type).
    """
    first: LogRecord | None = None
    start = count = 0

    def run(r: LogRecord) -> PutRun:
        return PutRun(PUT_RUN, r.woid, r.txn_id, r.file_id, start, count, offsets, sizes)

    for r in batch:
        if r.op == fmt.PUT:
            if first is not None and r.txn_id == first.txn_id:
                count += 1
            else:
                if first is not None:
                    records.append(run(first))
                first, start, count = r, len(offsets), 1
            offsets.append(r.offset)
            sizes.append(r.size)
        else:
            if first is not None:
                records.append(run(first))
                first = None
            records.append(r)
    if first is not None:
        records.append(run(first))


class BatchAuthenticator(Protocol):
    """What checks an authenticated file's batch tags (a ``crypto.FileCipher``)."""

    def check_batch(self, woid: int, data: bytes, tag: bytes) -> bool:
        """Return whether ``tag`` authenticates ``data`` (see ``format.batch_auth_data``) at ``woid``."""


FORGED = "batch authentication failed: the batch was forged, edited, moved or reordered (or the key is not this file's)"


class Scanner:
    """Walks one data file's records and classifies damage (policy lives here).

    Only records inside a verified batch count, with two exceptions where the
    channel knows the bytes were acknowledged: a region followed by a verified
    batch, and a region below ``vouched`` (the length a checkpoint recorded).
    Damage there is corruption; with ``on_corruption="skip"`` each record that
    still verifies on its own is salvaged and only what cannot be framed is
    dropped. Damage elsewhere in the newest file is a torn tail.

    In an authenticated file (format version 2) given ``auth``, a batch counts
    only if its tag verifies and chains to the batch before it. A batch whose
    checksums hold but whose tag fails cannot come from a torn write: it is
    always corruption (never a torn tail), and nothing of it is salvaged.
    Without ``auth`` (an inspection without the key) the tags are not checked.
    """

    def __init__(
        self,
        log: ScanContext,
        path: str,
        file_id: int,
        buf: bytes | bytearray,
        header: fmt.FileHeader,
        base: int = 0,
        auth: BatchAuthenticator | None = None,
        prev_tag: bytes | None = None,
    ) -> None:
        self.log = log
        self.path = path
        self.file_id = file_id
        self.buf = buf
        self.base = base  # ``buf`` holds the file's bytes from this offset on (a reader following a file)
        self.header = header
        self.kind = log.crc_kind
        self.seed = fmt.file_seed(self.kind, log.channel_id, file_id)
        self.max_payload = log.max_payload
        self.auth = auth if header.authenticated else None
        self.prev_tag = prev_tag

    def scan(
        self,
        newest: bool,
        prev_woid: int,
        start: int | None = None,
        floor: int = 0,
        vouched: int = 0,
        compact: bool = False,
    ) -> FileScan:
        """Walk the file's records from ``start`` (default: after the header).

        ``prev_woid`` is the last write-order id of the previous file; ``floor``
        is one that every record read must exceed (a checkpoint's, when resuming);
        ``vouched`` is the length a checkpoint recorded for this file: bytes
        below it were durable and acknowledged, so losing them is never a torn tail.
        ``compact``: keep the PUTs of verified batches as :class:`PutRun` s over two
        shared columns instead of one :class:`LogRecord` each (recovery's choice:
        it needs only their pointers). Which bytes count and every damage decision
        are the same either way; salvaged PUTs stay records.
        """
        buf, seed, kind, base = self.buf, self.seed, self.kind, self.base
        records: list[ScanRecord] = []
        offsets: array[int] = array("q")
        sizes: array[int] = array("q")
        pending: list[LogRecord] = []
        # ``g`` is the end of the last verified batch; a checkpoint may say where to start.
        # Offsets in this loop are relative to ``buf`` (``base`` is 0 unless following a file).
        g = (self.header.header_len if start is None else start) - base
        vouched -= base
        pos = g
        last_woid = max(prev_woid, self.header.base_woid - 1)
        batch_last_woid = max(last_woid, floor)
        n = len(buf)
        fid = self.file_id
        if vouched > n:
            self.report_short_file(n + base, vouched + base, last_woid)
        auth = self.auth
        prev_tag = self._chain_start(g) if auth is not None else b""
        forged = False
        accel = fmt.speedups if auth is None else None  # the C walk does not check tags
        if accel is not None and 0 <= batch_last_woid < INF_WOID and g >= 0:
            # The C twin of this loop walks clean, verified batches only and stops at the
            # first thing that is not one; this loop then carries on from there.
            args = (buf, g, seed, kind, min(self.max_payload, 0xFFFFFFFF), batch_last_woid, base, fid, LogRecord)
            if compact:
                end, w = accel.scan_batches(*args, records, PutRun, offsets, sizes)
            else:
                end, w = accel.scan_batches(*args, records)
            if end != g:
                pos = g = end
                last_woid = batch_last_woid = w
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
                elif pending and rec.woid != batch_last_woid + 1:
                    # Inside one write, write-order ids are consecutive (BATCH_END's included).
                    bad_reason = f"write-order id {rec.woid} skips inside a batch (previous {batch_last_woid})"
                elif rec.op == fmt.BATCH_END:
                    try:
                        be = fmt.decode_batch_end(rec.payload)
                    except FormatError as exc:
                        be = None
                        bad_reason = exc.reason
                    if be is not None:
                        if be.batch_start != g + base or be.batch_len != pos - g:
                            bad_reason = "BATCH_END does not cover the preceding batch"
                        elif crc_of(kind, buf, g, pos, seed) != be.batch_crc:
                            bad_reason = "batch checksum mismatch"
                        elif not pending or be.first_woid != pending[0].woid or be.last_woid != pending[-1].woid:
                            bad_reason = "BATCH_END's write-order ids do not match its batch"
                        elif auth is not None and not (
                            be.tag
                            and auth.check_batch(
                                rec.woid, fmt.batch_auth_data(prev_tag, buf[g:pos], buf[pos : pos + 64]), be.tag
                            )
                        ):
                            bad_reason = FORGED
                            forged = True
                        else:
                            prev_tag = be.tag
                            if compact:
                                _compact(pending, records, offsets, sizes)
                            else:
                                records.extend(pending)
                            pending = []
                            batch_last_woid = rec.woid
                            last_woid = rec.woid
                            pos = g = rec.end
                            continue
                else:
                    payload, sealed = (b"", False) if rec.op == fmt.PUT else (rec.payload, rec.sealed)
                    pending.append(
                        LogRecord(rec.op, rec.woid, rec.txn_id, fid, pos + base, rec.size, payload, False, sealed)
                    )
                    batch_last_woid = rec.woid
                    pos = rec.end
                    continue
            # Damage (or an unterminated batch) at ``pos``; the verified prefix ends at ``g``.
            assert bad_reason is not None
            resumed = self._handle_damage(newest, g, pos, bad_reason, records, max(last_woid, floor), vouched, forged)
            if resumed is None:
                break
            g = pos = resumed
            pending = []
            forged = False
            if auth is not None:
                prev_tag = self._chain_start(g)
            if records:
                last = records[-1]  # a record salvaged just now, or one at or below last_woid
                last_woid = max(last_woid, last.woid + (last.count - 1 if isinstance(last, PutRun) else 0))
            batch_last_woid = max(last_woid, floor)
        return FileScan(
            fid, self.path, self.header, records, g + base, n + base, last_woid, compact=compact, last_tag=prev_tag
        )

    def _chain_start(self, g: int) -> bytes:
        """The tag a batch starting at ``g`` (relative to ``buf``) chains to.

        The header's key check at the first record; the ``prev_tag`` a caller
        following the file passes; else the tag of the BATCH_END that ends at ``g``
        (a checkpoint's resume offset, or where skip mode resumes): forging it
        breaks the next batch's tag.
        """
        h = self.header
        if g + self.base <= h.header_len:
            return h.key_check
        if self.prev_tag is not None and g == 0:
            return self.prev_tag
        if g >= fmt.BATCH_TAG_LEN:
            return bytes(self.buf[g - fmt.BATCH_TAG_LEN : g])
        return b""

    def report_short_file(self, size: int, vouched: int, last_woid: int) -> None:
        """The file is ``size`` bytes, under the ``vouched`` a checkpoint recorded: raise, or report (skip) the loss."""
        reason = f"data file is {vouched - size} bytes shorter than the checkpoint recorded ({vouched} bytes)"
        log = self.log
        if log.config.on_corruption != "skip":
            raise CorruptLogError(self.path, size, reason)
        log.report_corruption(
            CorruptionReport(self.path, size, reason, vouched - size, (last_woid, INF_WOID), file_id=self.file_id)
        )

    def _handle_damage(
        self,
        newest: bool,
        g: int,
        x: int,
        reason: str,
        records: list[ScanRecord],
        last_woid: int,
        vouched: int,
        forged: bool = False,
    ) -> int | None:
        """Decide what damage at ``x`` means. Return the offset to resume at, or None to stop.

        Offsets here are relative to ``buf``; reports and errors carry file offsets.
        A ``forged`` batch (its checksums hold, its tag fails) is never a torn tail.
        """
        log = self.log
        buf, base = self.buf, self.base
        n = len(buf)
        if forged:
            after = find_verified_batch_end(buf, x + 8, self.seed, self.kind, self.max_payload, base)
            stop = after[1].batch_start - base if after is not None else n
            if log.config.on_corruption != "skip":
                raise CorruptLogError(self.path, g + base, reason)
            self._dropped(g, stop, last_woid, after[1].first_woid if after is not None else INF_WOID, reason)
            return stop if stop < n else None
        if newest and g >= vouched and all_zero(buf, g):
            return None  # the zero-filled space ahead of the writer: a clean end
        after = find_verified_batch_end(buf, x, self.seed, self.kind, self.max_payload, base)
        while after is not None and after[1].batch_start - base == g:
            # The batch at ``g`` verifies, but its write-order ids do not follow what came
            # before (at or below a checkpoint's floor, say): resuming there would meet the
            # same damage again. The next place to resume is the verified batch after it.
            nxt = after[0] + BATCH_END_SIZE
            after = find_verified_batch_end(buf, nxt, self.seed, self.kind, self.max_payload, base)
        if after is not None and after[1].batch_start - base < g:
            after = None
        if newest and g >= vouched:
            if after is None:
                # A torn, unacknowledged tail: nothing verified follows it.
                log.note_torn_tail(self.path, g + base, n + base, reason)
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
                    x + base,
                    n - g,
                    g + base,
                )
                log.note_torn_tail(self.path, g + base, n + base, reason)
                return None
        if after is not None:
            stop = after[1].batch_start - base
            problem = f"{reason}, and acknowledged records follow it"
        elif newest:
            stop = min(vouched, n)
            problem = f"{reason} in data a checkpoint recorded as written"
        else:
            stop = n
            problem = f"{reason} in a sealed data file"
        if log.config.on_corruption != "skip":
            raise CorruptLogError(self.path, x + base, problem)
        self._salvage(g, stop, records, last_woid, problem)
        return stop  # at the end of the file too: the scan then ends past what was salvaged

    def _salvage(self, start: int, stop: int, records: list[ScanRecord], last_woid: int, problem: str) -> None:
        """Keep every record in ``[start, stop)`` that verifies on its own; report the rest.

        A record whose frame is intact but whose checksum fails is stepped over
        by its length when the next record verifies; elsewhere the scan moves on
        in 8-byte steps to the next record that verifies. Each stretch of bytes
        that could not be read becomes one report.
        """
        buf, fid = self.buf, self.file_id
        if self.auth is not None:
            # Records of an authenticated file count only inside a batch whose tag verifies.
            self._dropped(start, stop, last_woid, INF_WOID, f"{problem}; records outside an authenticated batch")
            return
        view = memoryview(buf)[:stop]
        pos = start
        prev = last_woid
        bad_at = -1
        found = False
        budget = SALVAGE_WORK * (stop - start) + SALVAGE_SLACK  # bytes checksummed: see SALVAGE_WORK
        while pos < stop:
            budget -= _frame_cost(view, pos, stop)
            if budget < 0:
                logger.error(
                    "%s: salvage gave up at byte %d: the damaged stretch costs too much to read frame by frame",
                    self.path,
                    pos + self.base,
                )
                if bad_at < 0:
                    bad_at = pos
                    found = True
                break
            rec = self._decode_at(view, pos, prev)
            if rec is not None:
                if bad_at >= 0:
                    self._dropped(bad_at, pos, prev, rec.woid, problem)
                    bad_at = -1
                if rec.op != fmt.BATCH_END:
                    payload, sealed = (b"", False) if rec.op == fmt.PUT else (rec.payload, rec.sealed)
                    records.append(
                        LogRecord(rec.op, rec.woid, rec.txn_id, fid, pos + self.base, rec.size, payload, True, sealed)
                    )
                prev = rec.woid
                pos = rec.end
                continue
            if bad_at < 0:
                bad_at = pos
                found = True
            # Step over a frame whose length still makes sense, else move on by 8 bytes.
            nxt = pos + 8
            if pos + fmt.RECORD_HEADER_LEN <= stop:
                length = fmt.record_length_at(buf, pos)
                skip = pos + fmt.record_size(length)
                if pos < skip < stop and (cost := _frame_cost(view, skip, stop)) <= budget:
                    budget -= cost
                    if self._decode_at(view, skip, prev) is not None:
                        nxt = skip
            pos = nxt
        if bad_at >= 0:
            self._dropped(bad_at, stop, prev, INF_WOID, problem)
        if not found:  # every record verified: only framing (a BATCH_END, a batch checksum) was damaged
            self.log.report_corruption(
                CorruptionReport(
                    self.path, start + self.base, f"{problem}; every record verified on its own", 0, file_id=fid
                )
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
        self.log.report_corruption(
            CorruptionReport(self.path, a + self.base, problem, b - a, (woid_lo, woid_hi), file_id=self.file_id)
        )


def oldest_authenticated(fs: FS, data_dirs: Sequence[str]) -> int:
    """The lowest file id whose header claims format version 2 (authenticated), in any data directory.

    ``format.NO_AUTH_FILE`` when none does. Only the fixed part of each header
    is read; a claim is checked (key check, then every batch tag) when the file
    itself is read.
    """
    oldest = fmt.NO_AUTH_FILE
    for d in data_dirs:
        if not fs.exists(d):
            continue
        for name in fs.listdir(d):
            m = SEG_RE.match(name)
            if m is None or int(m.group(1), 16) >= oldest:
                continue
            try:
                fd = fs.open_read(os.path.join(d, name))
            except OSError:
                continue
            try:
                head = fs.pread(fd, 16, 0)
            finally:
                fs.close(fd)
            claims = len(head) == 16 and head[:8] == fmt.MAGIC and head[8:10] == b"\x02\x00"
            if claims and int.from_bytes(head[12:14], "little") & fmt.ENCRYPTED:
                oldest = int(m.group(1), 16)
    return oldest


# --------------------------------------------------------------------------
# the queue's head: committed PUTs found walking forward


_REC_HEAD = fmt.REC_HEAD  # op, flags, reserved, payload length, woid, txn id


LOST = -1
"""The offset :func:`committed_puts` gives an event whose record it could not find (damage)."""


@dataclass(frozen=True, slots=True)
class PutWalk:
    """What :func:`committed_puts` found.

    ``first``: the position of the first PUT kept (-1 when none); ``offsets`` and
    ``sizes``: the kept PUTs' pointers, positions ``first, first + 1, ...`` (offset
    :data:`LOST`, size 0, for a position of ``[lo, hi)`` whose record is not there);
    ``next_offset``: the record boundary after the last one found (``start`` when
    none was); ``done``: ``want`` PUTs were kept, or one at ``hi`` or beyond was
    reached (otherwise the buffer ended first: read more); ``damaged``: the offsets
    of frames the walk stepped over (it resumed at the next record that verifies);
    ``window``: from :func:`locate_puts`, the first window a later call should read
    (grown past the one it was given when a batch did not fit; 0 from ``committed_puts``).
    """

    first: int
    offsets: array[int]
    sizes: array[int]
    next_offset: int
    done: bool
    damaged: tuple[int, ...] = ()
    window: int = 0


class _Kept:
    """What a walk keeps: consecutive positions from ``first`` and their pointers (see :func:`committed_puts`)."""

    __slots__ = ("first", "hi", "lo", "next_offset", "offsets", "sizes", "want")

    def __init__(self, lo: int, hi: int, want: int, start: int) -> None:
        self.lo, self.hi, self.want = lo, hi, want
        self.first = -1
        self.offsets: array[int] = array("q")
        self.sizes: array[int] = array("q")
        self.next_offset = start

    def place(self, c_first: int, c_n: int, first_woid: int, pend: list[tuple[int, array[int], array[int]]]) -> bool:
        """Keep a committed transaction's PUTs (``pend``: stretches ``(woid, offsets, sizes)``); True when done.

        A PUT's position is its COMMIT's first position plus its woid's distance
        from the transaction's first PUT woid (a transaction's PUTs have
        consecutive woids): a walk that starts among them places the rest right.
        """
        lo, hi = self.lo, self.hi
        for w0, offs, szs in pend:
            i0 = w0 - first_woid
            a = max(0, -i0)
            b = min(len(offs), c_n - i0)
            if a >= b:
                continue
            p = c_first + i0 + a
            if p < lo:
                a += lo - p
                p = lo
                if a >= b:
                    continue
            if self.first < 0:
                self.first = lo
            end = self.first + len(self.offsets)
            if p < end:  # already kept (a damaged record's duplicate): never twice
                a += end - p
                p = end
                if a >= b:
                    continue
            if p > end and not self._lost(min(p, hi)):
                return True
            room = min(self.want - len(self.offsets), hi - p)
            if room <= 0:
                return True
            b = min(b, a + room)
            self.offsets.extend(offs[a:b])
            self.sizes.extend(szs[a:b])
            self.next_offset = offs[b - 1] + szs[b - 1]
            if len(self.offsets) >= self.want or p + b - a >= hi:
                return True
        return False

    def _lost(self, upto: int) -> bool:
        """Keep positions up to ``upto`` as LOST (the walk passed them: damage); False when ``want`` is reached."""
        if self.first < 0:
            self.first = self.lo
        n = min(upto - self.first - len(self.offsets), self.want - len(self.offsets))
        if n > 0:
            self.offsets.extend(array("q", (LOST,)) * n)
            self.sizes.extend(array("q", (0,)) * n)
        return len(self.offsets) < self.want

    def result(self, done: bool, damaged: list[int]) -> PutWalk:
        return PutWalk(self.first, self.offsets, self.sizes, self.next_offset, done, tuple(damaged))


def committed_puts(
    buf: bytes | bytearray,
    base: int,
    start: int,
    lo: int,
    hi: int,
    want: int,
    seed: int,
    kind: int,
    max_payload: int,
    eof: bool = False,
    fast: bool = True,
) -> PutWalk:
    """Walk the record frames of a data file from ``start``: the committed PUTs with positions in ``[lo, hi)``.

    ``buf`` holds the file's bytes from offset ``base``; ``start`` (a file
    offset) is a record boundary at or before the record of ``lo``, and
    ``[lo, hi)`` are consecutive positions of this file (a run of the queue).
    A transaction's records are contiguous (its MARKs, PUTs, TAKE, then
    COMMIT), and its PUTs have consecutive woids ending before its TAKE and
    COMMIT, whose payload gives their positions. PUTs that no COMMIT of their
    transaction follows are skipped, as are all other records.

    From the first batch boundary on, whole verified batches are walked by the
    C accelerator (``_speedups.scan_batches``, what recovery uses) when it is
    built and ``fast`` (an encrypted file passes False: its batches carry tags
    the C walk does not check; the frames' checksums are checked either way);
    the walk up to there, and after anything that is not a clean batch, is
    this loop.

    Damage is stepped over, never trusted: only COMMITs are verified on the
    Python walk (a PUT is verified when it is read), so at the first frame that
    is bad or inconsistent (a PUT of another transaction, a woid that skips)
    the walk goes back to the first unverified frame since the last verified
    one and walks on verifying every frame up to the next COMMIT; a frame that
    fails then is skipped to the next record that verifies (``first_record``).
    A position of ``[lo, hi)`` the walk passes without finding its record is
    kept as :data:`LOST`, for the take to report under ``on_corruption`` like
    a record that no longer verifies. The walk stops at the end of ``buf``, at
    zero-filled space, after ``want`` positions, or at ``hi``; ``eof``: ``buf``
    ends where the file does (a frame claiming bytes past it is damage).
    """
    n_buf = len(buf)
    pos = start - base
    kept = _Kept(lo, hi, want, start)
    damaged: list[int] = []
    pend: list[tuple[int, array[int], array[int]]] = []  # the PUTs of ``pend_txn`` so far: (woid, offsets, sizes)
    pend_txn = -1
    last_woid = 0
    unpack = _REC_HEAD.unpack_from
    head_len = fmt.RECORD_HEADER_LEN
    ops = fmt.OP_NAMES
    put_op, commit_op, batch_end_op = fmt.PUT, fmt.COMMIT, fmt.BATCH_END
    accel = fmt.speedups if fast else None
    batch_start = True  # perhaps: the C walk checks (a stretch that does not begin a batch is not taken)
    known = False  # ``pos`` is known to begin a batch (one ended just before it)
    py_batch = -1  # where the batch this loop is in began, once it has seen a BATCH_END
    anchor = -1
    careful = False
    while pos + head_len <= n_buf:
        if batch_start and accel is not None and not careful:
            # Whole verified batches in C: their PUTs as runs over two columns, other records as records.
            records: list[ScanRecord] = []
            c_offs: array[int] = array("q")
            c_sizes: array[int] = array("q")
            args = (buf, pos, seed, kind, min(max_payload, 0xFFFFFFFF), last_woid, base, 0, LogRecord)
            end, w = accel.scan_batches(*args, records, PutRun, c_offs, c_sizes)
            batch_start = False
            if end == pos and known and not eof:
                return kept.result(False, damaged)  # a batch the buffer cuts short: read more, then walk on in C
            if end != pos:
                prev_end = -1
                cur_batch = pos + base
                for r in records:
                    if r.op == PUT_RUN:
                        assert isinstance(r, PutRun)
                        roff = c_offs[r.start]
                        if roff != prev_end:
                            cur_batch = roff  # a BATCH_END lay between: a new batch
                        if r.txn_id != pend_txn:
                            pend = []
                            pend_txn = r.txn_id
                        e = r.start + r.count
                        pend.append((r.woid, c_offs[r.start : e], c_sizes[r.start : e]))
                        prev_end = c_offs[e - 1] + c_sizes[e - 1]
                        continue
                    assert isinstance(r, LogRecord)
                    if r.offset != prev_end:
                        cur_batch = r.offset
                    prev_end = r.offset + r.size
                    if r.op == commit_op:
                        c_first, c_n, c_taken = fmt.decode_commit(r.payload)
                        if r.txn_id == pend_txn and kept.place(
                            c_first, c_n, r.woid - c_n - (1 if c_taken else 0), pend
                        ):
                            if len(kept.offsets) >= want:
                                kept.next_offset = cur_batch  # a batch start: the next walk is in C too
                            return kept.result(True, damaged)
                        pend = []
                        pend_txn = -1
                        if c_first + c_n >= hi:
                            kept._lost(hi)
                            return kept.result(True, damaged)
                    elif r.op == put_op:  # pragma: no cover - a compact walk keeps PUTs as runs
                        pass
                pos, last_woid = end, w
                anchor = -1  # everything before ``end`` verified
                batch_start = known = True  # C stopped at a batch it could not take: look at it again
                continue
        op, flags, reserved, n, woid, txn = unpack(buf, pos)
        if op == 0 and not flags and not n and not txn:
            break  # zero-filled space ahead of the writer
        rec: fmt.Record | None = None
        bad = op not in ops or reserved or n > max_payload
        size = head_len + n + (-n & 7)
        if not bad and pos + size > n_buf:
            if eof and not careful and anchor >= 0:
                pos, careful, anchor = anchor, True, -1  # a damaged length may claim bytes past the end
                pend = []
                pend_txn = -1
                continue
            break
        if not bad and (careful or op == commit_op):
            try:
                got = fmt.decode_record(buf, pos, seed, kind, max_payload)
                rec = got if isinstance(got, fmt.Record) else None
            except FormatError:
                pass
            bad = rec is None
        if not bad and not careful and pend:
            # A transaction's PUTs are contiguous with consecutive woids: anything else is
            # an unverified header that may be damaged (verified frames decide, carefully).
            last_put = pend[-1][0] + len(pend[-1][1]) - 1
            if op == put_op:
                bad = txn != pend_txn or woid != last_put + 1
            elif rec is not None and txn == pend_txn:
                c_first, c_n, c_taken = fmt.decode_commit(rec.payload)
                bad = last_put != rec.woid - 1 - (1 if c_taken else 0)
        if bad:
            if not careful and anchor >= 0:
                pos, careful, anchor = anchor, True, -1
                pend = []
                pend_txn = -1
                continue
            if not damaged or damaged[-1] != pos + base:
                damaged.append(pos + base)
            careful = True
            resume = first_record(buf, pos + 8, n_buf, seed, kind, max_payload)
            if resume is None:
                break
            pos = resume  # the PUTs met so far stay pending: their woids place them
            continue
        if rec is None and anchor < 0:
            anchor = pos
        last_woid = woid
        if op == put_op:
            if txn != pend_txn:
                pend = []
                pend_txn = txn
            if pend and pend[-1][0] + len(pend[-1][1]) == woid and pend[-1][1][-1] + pend[-1][2][-1] == pos + base:
                pend[-1][1].append(pos + base)
                pend[-1][2].append(size)
            else:
                pend.append((woid, array("q", (pos + base,)), array("q", (size,))))
        elif op == commit_op and rec is not None:
            careful, anchor = False, -1
            c_first, c_n, c_taken = fmt.decode_commit(rec.payload)
            if txn == pend_txn and kept.place(c_first, c_n, rec.woid - c_n - (1 if c_taken else 0), pend):
                if len(kept.offsets) >= want and py_batch >= 0:
                    kept.next_offset = py_batch  # a batch start: the next walk is in C
                return kept.result(True, damaged)
            pend = []
            pend_txn = -1
            if c_first + c_n >= hi:
                kept._lost(hi)
                return kept.result(True, damaged)
        elif op == batch_end_op and not careful:
            batch_start = known = True
            py_batch = pos + size + base
        pos += size
    return kept.result(False, damaged)


LOCATE_WINDOW = 1 << 20
"""Bytes :func:`locate_puts` reads first (most batches fit; it grows while the walk needs more)."""

LOCATE_MAX = 1 << 24
"""Bytes one :func:`locate_puts` call reads at most (unless one record needs more)."""


def locate_puts(
    pread: Callable[[int, int], bytes],
    offset: int,
    lo: int,
    hi: int,
    want: int,
    seed: int,
    kind: int,
    max_payload: int,
    fast: bool = True,
    event_bytes: int = 200,
    window: int = LOCATE_WINDOW,
) -> PutWalk:
    """Find queued events' records in one data file: :func:`committed_puts` over windows read with ``pread``.

    ``pread(n, offset)`` reads the file. From ``offset`` (a record boundary at
    or before the record of ``lo``) the file is read a window at a time and
    walked: the first ``want`` committed PUTs with positions in ``[lo, hi)``
    (fewer when they span more than :data:`LOCATE_MAX` bytes: call again from
    ``next_offset``). Positions the file ends before are kept as :data:`LOST`.
    The walk never passes the COMMIT of the last event it needs, so it never
    reads what a writer is still writing. ``fast``: as for :func:`committed_puts`;
    ``event_bytes``: the record bytes per event to expect (the first window's size).

    Each window goes on from where the walk of the one before stopped (a record
    boundary after the PUTs it found): no byte is walked twice. A window in which
    the walk found nothing (a batch, or one record, longer than it: walked record
    by record for nothing) is read again four times as large. ``window`` is the
    least window to read; the result's ``window`` is that least grown past such a
    batch, for the caller to pass next time (``Log.locate_puts`` keeps it), so
    a cut batch is walked for nothing once, not at every call.

    Raises:
        FormatError: Never in practice (the walk steps over damage).
        OSError: Reading failed.
    """
    end = min(hi, lo + want)  # the position after the last one asked for
    first = -1
    offsets: array[int] = array("q")
    sizes: array[int] = array("q")
    damaged: tuple[int, ...] = ()
    least = window
    read = 0
    size = min(LOCATE_MAX, max(least, (end - lo) * event_bytes))
    while True:
        buf = pread(size, offset)
        read += len(buf)
        eof = len(buf) < size
        got = committed_puts(buf, offset, offset, lo, hi, end - lo, seed, kind, max_payload, eof, fast)
        damaged += got.damaged
        k = len(got.offsets)
        if k:
            if first < 0:
                first = got.first
            offsets += got.offsets
            sizes += got.sizes
            lo = got.first + k
        offset = got.next_offset
        if got.done or lo >= end:
            return PutWalk(first if first >= 0 else got.first, offsets, sizes, offset, True, damaged, least)
        if eof:
            # The file ends before every position of the run: their records are gone.
            if first < 0:
                first = lo
            offsets.extend(array("q", (LOST,)) * (end - lo))
            sizes.extend(array("q", (0,)) * (end - lo))
            return PutWalk(first, offsets, sizes, offset, True, damaged, least)
        if k:
            if read >= LOCATE_MAX:
                return PutWalk(first, offsets, sizes, offset, False, damaged, least)  # the rest: call again
            size = min(LOCATE_MAX, max(least, (end - lo) * event_bytes))
        else:
            size *= 4  # may pass LOCATE_MAX: one record longer than it
            least = max(least, min(size, LOCATE_MAX))
