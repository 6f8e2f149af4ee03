"""Replay: the queue of committed, untaken events rebuilt from a checkpoint and the log after it.

This module owns what a channel's open (and ``verify``, ``inspect``, a
``ChannelReader``) derives from the log's verified records: the queue in
position order, the files each TAKE record removed events from, the committed
marks (sealed MARK records opened with their file's cipher), and the exact
positions lost to damage that replay stepped over (``_LossAccounting``). It
reads through ``Log`` and writes nothing.
"""

from __future__ import annotations

import bisect
from operator import attrgetter

from . import _accel
from . import format as fmt
from ._queue import Entry
from ._runs import RunQueue
from .checkpoint import Snapshot
from .crypto import SEALED_WITHOUT_KEY, TAMPERED
from .errors import CorruptLogError, DecryptionError, FormatError
from .log import INF_WOID, CorruptionReport, Log, LogRecord, merge_ranges, ranges_of
from .scan import LOST, PUT_RUN, PutRun, ScanRecord, expand_runs

__all__ = ["base_queue", "read_event", "replay_queue", "spot_check"]


_OFFSET = attrgetter("offset")
_SIZE = attrgetter("size")


def _place_runs(q: RunQueue, first: int, n: int, items: list[ScanRecord]) -> bool:
    """Place a committed transaction's puts when they are all runs covering ``n`` PUTs.

    Returns False (placing nothing) otherwise: a salvaged PUT record among them,
    or a count that does not match the COMMIT; the caller decides what that means.
    """
    total = 0
    for it in items:
        if it.op != PUT_RUN:
            return False
        assert isinstance(it, PutRun)
        total += it.count
    if total != n:
        return False
    for it in items:
        assert isinstance(it, PutRun)
        s, c = it.start, it.count
        # array slices: the pointers move between int64 columns without an object per PUT
        q.append_run(first, it.file_id, it.offsets[s : s + c], it.sizes[s : s + c])
        first += c
    return True


def base_queue(log: Log, base: Snapshot) -> RunQueue:
    """The queue a checkpoint holds, as runs: O(runs) for version 6, one pass over the columns before it.

    Raises:
        CorruptLogError: The checkpoint's runs overlap, or a hole or an entry is out of place.
    """
    try:
        if base.runs is not None:
            entries = zip(base.positions, base.file_ids, base.offsets, base.sizes, strict=True)
            return RunQueue.from_stored(log.locate_puts, base.runs, entries, base.holes)
        return RunQueue.from_columns(log.locate_puts, base.positions, base.file_ids, base.offsets)
    except ValueError as exc:
        where = log.recovered_from.path if log.recovered_from is not None else "checkpoint"
        raise CorruptLogError(where, 0, f"the checkpoint's queue does not hold together: {exc}") from exc


def _note_taken(
    taken_from: dict[int, list[tuple[int, int]]], tset: set[int] | None, got: list[tuple[int, int, int]]
) -> None:
    for f, a, c in got:
        if tset is not None:
            tset.add(f)
        lst = taken_from.get(f)
        if lst is None:
            taken_from[f] = [(a, c)]
        elif lst[-1][0] + lst[-1][1] == a:
            lst[-1] = (lst[-1][0], lst[-1][1] + c)
        else:
            lst.append((a, c))


def replay_queue(
    log: Log, base: Snapshot | None = None, marks: dict[str, tuple[bytes, int, int]] | None = None
) -> tuple[RunQueue, dict[int, set[int]], dict[int, list[tuple[int, int]]]]:
    """Rebuild the queue from a checkpoint (if any) and the log records after it.

    Replay is idempotent by position: a put sets the events at its positions,
    a take removes them if present. Returns the queue of committed, untaken
    events (runs: see ``_runs``); for each data file, the files whose events its
    TAKE records removed; and for each data file, the positions taken from it.
    From a checkpoint of runs (version 6) the work is O(runs + records after
    the checkpoint), whatever the queue's depth.

    Damage that recovery stepped over (``on_corruption="skip"``) is accounted
    for here, exactly: the positions of PUT records lost from a salvaged
    transaction, the positions no intact COMMIT claims around a damaged span,
    and every event the newest checkpoint vouched for that is gone without
    having been taken. Each lands in ``log.corruption`` as lost positions.

    ``marks``, when given, receives the committed marks: key -> (value, woid of
    the COMMIT that set it, file of its newest copy). A MARK record counts only
    when its transaction's COMMIT does; of several copies of a key (a re-logged
    mark keeps its original woid) the highest woid wins, the later copy on a tie.

    Raises:
        CorruptLogError: A COMMIT does not match the PUT records before it, the
            checkpoint's queue does not hold together, or (``on_corruption="fail"``)
            an event the newest checkpoint vouched for is gone.
    """
    # A transaction's PUTs until its COMMIT: runs of verified PUTs (pointers in a scan's
    # columns, no object per PUT) and, after damage, salvaged PUT records.
    puts: dict[int, list[ScanRecord]] = {}
    takes: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    targets: dict[int, set[int]] = {}
    taken_from: dict[int, list[tuple[int, int]]] = {f: list(r) for f, r in base.taken.items()} if base else {}
    acct = _LossAccounting(log, base)
    if base is not None and base.marks_unread and marks is not None:
        # Only a keyless inspection (which asks for no marks) reads a checkpoint without its sealed marks.
        where = log.recovered_from.path if log.recovered_from is not None else ""
        raise DecryptionError(where, 0, "the checkpoint's marks table is sealed, and no key was given to open it")
    if marks is None:
        marks = {}
    q = RunQueue(log.locate_puts)
    if base is not None:
        for key, value, woid, file_id in base.marks:
            marks[key] = (value, woid, file_id)
        q = base_queue(log, base)
        # A data file is retired only once no queued event points into it, so
        # checkpoint entries in a file known retired were taken after the
        # checkpoint (their TAKE record may have gone with a later file). Entries in
        # a file that is gone without a trace of retirement are lost, not taken.
        gone = log.retired_files | log.missing_files
        if gone:
            got = q.remove_files(gone)
            _note_taken(taken_from, None, got)
            for f, a, c in got:
                if f in log.missing_files:
                    for p in range(a, a + c):
                        acct.vouched_lost(p, f)
    pending_marks: dict[int, list[tuple[LogRecord, list[fmt.Mark]]]] = {}
    for r in log.replay_runs():
        op = r.op
        if op == PUT_RUN or op == fmt.PUT:
            lst = puts.get(r.txn_id)
            if lst is None:
                puts[r.txn_id] = [r]
            else:
                lst.append(r)
        elif op == fmt.TAKE:
            assert isinstance(r, LogRecord)
            takes[r.txn_id] = (r.file_id, fmt.decode_take(r.payload))
        elif op == fmt.COMMIT:
            assert isinstance(r, LogRecord)
            first, n, n_taken = fmt.decode_commit(r.payload)
            items = puts.pop(r.txn_id, [])
            if _place_runs(q, first, n, items):
                pass  # the usual case: every PUT verified in its batch, placed run by run
            elif len(ptrs := list(expand_runs(items))) == n:
                # A transaction's puts are written in one write, in write-order: when its first and
                # last put are in one data file, all of them are (the usual case: one run).
                if ptrs and ptrs[0].file_id == ptrs[-1].file_id:
                    q.append_run(first, ptrs[0].file_id, list(map(_OFFSET, ptrs)), list(map(_SIZE, ptrs)))
                else:
                    for i, rec in enumerate(ptrs):
                        q.append(first + i, rec.file_id, rec.offset, rec.size)
            elif r.salvaged:
                # Some PUT records of this transaction were damaged: place the intact
                # ones by write-order id (PUTs, then a TAKE if any, then the COMMIT).
                first_woid = r.woid - n - (1 if n_taken else 0)
                placed = set()
                for rec in ptrs:
                    i = (rec.woid if rec.salvaged else -1) - first_woid
                    if 0 <= i < n and i not in placed:
                        placed.add(i)
                        q.append(first + i, rec.file_id, rec.offset, rec.size)
                acct.lost_puts(r, [first + i for i in range(n) if i not in placed], first_woid)
            else:
                path = log.file_path(r.file_id)
                raise CorruptLogError(path, r.offset, f"commit of {n} puts, but {len(ptrs)} put records precede it")
            acct.commit(first, n, r.woid)
            tk = takes.pop(r.txn_id, None)
            if tk is None and n_taken and r.salvaged:
                acct.unreadable_takes(r, n_taken)
            if tk is not None:
                tfile, ranges = tk
                acct.taken(ranges, r.woid)
                tset = targets.setdefault(tfile, set())
                for start, count in ranges:
                    # A position not queued now never will be (its put came first): nothing to remove.
                    _note_taken(taken_from, tset, q.remove_range(start, count))
            pm = pending_marks.pop(r.txn_id, None)
            if pm is not None:
                _apply_marks(marks, pm, r.woid)
        elif op == fmt.MARK:
            assert isinstance(r, LogRecord)
            ms = _record_marks(log, r)
            if ms is not None:
                pending_marks.setdefault(r.txn_id, []).append((r, ms))
        elif op == fmt.ROLLBACK:
            puts.pop(r.txn_id, None)
            takes.pop(r.txn_id, None)
            pending_marks.pop(r.txn_id, None)
    q = acct.finish(q)
    # Recovery is over: the checkpoint it checked against is not needed again.
    log.release_recovery_state()
    # What recovery freed (the scans' columns) goes back to the system.
    _accel.trim_heap(fmt.speedups)
    return q, targets, taken_from


def _record_marks(log: Log, r: LogRecord) -> list[fmt.Mark] | None:
    """The marks of a MARK record, a sealed one opened with its file's cipher; None when they do not count.

    A sealed MARK whose tag fails, or that no cipher of its file can open, is
    damage as a sealed PUT is when taken: ``on_corruption="fail"`` raises
    :class:`DecryptionError`, ``"skip"`` reports it and its marks do not count.
    An inspection without the key (a file the log keeps as undecryptable) does
    not read them.
    """
    if not r.sealed:
        return fmt.decode_marks(r.payload)
    fid = r.file_id
    cipher = log.cipher_of(fid)
    if cipher is not None:
        head = fmt.record_head(fmt.MARK, fmt.FLAG_SEALED, len(r.payload), r.woid, r.txn_id)
        plain = cipher.open(head, r.offset, r.payload)
        if plain is not None:
            return fmt.decode_marks(plain)
        err = DecryptionError(log.file_path(fid), r.offset, f"mark record: {TAMPERED}", cipher.key_id)
    elif fid in log.undecryptable:
        return None
    else:
        why = log.headerless.get(fid, SEALED_WITHOUT_KEY)
        err = DecryptionError(log.file_path(fid), r.offset, f"mark record: {why}")
    if log.config.on_corruption != "skip":
        raise err
    log.report_corruption(CorruptionReport(err.path, r.offset, f"{err.reason}; its marks are dropped", 0, file_id=fid))
    return None


def _apply_marks(
    marks: dict[str, tuple[bytes, int, int]], records: list[tuple[LogRecord, list[fmt.Mark]]], commit_woid: int
) -> None:
    """Apply a committed transaction's MARK records to ``marks`` (see :func:`replay_queue`)."""
    for rec, ms in records:
        for m in ms:
            woid = m.woid or commit_woid
            cur = marks.get(m.key)
            if cur is None or cur[1] <= woid:
                marks[m.key] = (m.value, woid, rec.file_id)


class _LossAccounting:
    """Turns damage that replay stepped over into exact lost positions (see :func:`replay_queue`)."""

    def __init__(self, log: Log, base: Snapshot | None) -> None:
        self.log = log
        self.base = base
        self.damaged = [r for r in log.corruption if r.woid_span is not None]
        self.prev_end = log.position_floor
        self.prev_woid = base.woid if base is not None else 0
        self.holes: list[tuple[int, int, int, int]] = []  # (first, end, woid before, woid after)
        self.taken_ranges: list[tuple[int, int]] = []
        self.vouched_gone: dict[int, list[int]] = {}  # file id -> positions

    def commit(self, first: int, n: int, woid: int) -> None:
        if not self.damaged:
            return
        if first > self.prev_end:
            self.holes.append((self.prev_end, first, self.prev_woid, woid))
        self.prev_end = max(self.prev_end, first + n)
        self.prev_woid = woid

    def taken(self, ranges: list[tuple[int, int]], woid: int) -> None:
        v = self.log.voucher
        if self.damaged or (v is not None and woid > v.woid):
            self.taken_ranges += [(a, a + c) for a, c in ranges]

    def lost_puts(self, commit: LogRecord, positions: list[int], first_woid: int) -> None:
        if not positions:
            return
        for rep in self.damaged:
            a, b = rep.woid_span or (0, 0)
            if a < first_woid + len(positions) and first_woid <= b and rep.file_id == commit.file_id:
                rep.lost_positions += ranges_of(positions)
                return
        self.log.report_corruption(
            CorruptionReport(
                self.log.file_path(commit.file_id),
                commit.offset,
                f"PUT records of transaction {commit.txn_id} are damaged",
                0,
                lost_positions=ranges_of(positions),
                file_id=commit.file_id,
            )
        )

    def unreadable_takes(self, commit: LogRecord, n_taken: int) -> None:
        self.log.report_corruption(
            CorruptionReport(
                self.log.file_path(commit.file_id),
                commit.offset,
                f"the TAKE record of transaction {commit.txn_id} is damaged: {n_taken} taken events may be "
                "delivered again",
                0,
                file_id=commit.file_id,
            )
        )

    def vouched_lost(self, position: int, file_id: int) -> None:
        self.vouched_gone.setdefault(file_id, []).append(position)

    def finish(self, q: RunQueue) -> RunQueue:
        """Attribute holes to damage, drop entries that point at damaged bytes, check the voucher."""
        log = self.log
        taken = merge_ranges(self.taken_ranges)
        if self.damaged:
            if log.next_position > self.prev_end:
                self.holes.append((self.prev_end, log.next_position, self.prev_woid, INF_WOID))
            for first, end, w0, w1 in self.holes:
                for rep in self.damaged:
                    a, b = rep.woid_span or (0, 0)
                    if max(a, w0) + 2 <= min(b, w1):
                        rep.lost_positions += _subtract([(first, end)], taken)
                        break
        q = self._drop_unreadable(q)
        v = log.voucher
        if v is not None and (self.base is None or self.base is not v):
            # A full replay (or one from an older checkpoint) must hold everything
            # the newest checkpoint vouched for, unless it was taken after it or lived
            # in a file known retired.
            # (Only after a fallback: a checkpoint of runs expands to its positions here.)
            vpos, vfid = v.queued_positions()
            missing = q.missing(vpos)
            retired = log.retired_files
            if missing:
                for i in range(len(vpos)):
                    p = vpos[i]
                    if p in missing and vfid[i] not in retired and not _in_ranges(p, taken):
                        self.vouched_gone.setdefault(vfid[i], []).append(p)
        if self.vouched_gone:
            self._report_vouched()
        for rep in log.corruption:
            rep.lost_positions = merge_ranges(rep.lost_positions)
        return q

    def _drop_unreadable(self, q: RunQueue) -> RunQueue:
        """Remove queued events whose records lie past a file's end or in bytes recovery dropped.

        The runs of a damaged file are walked (past each dropped stretch): an event
        whose record overlaps one, or that the walk no longer finds (its record or
        its COMMIT was in one), is removed and reported.
        """
        log = self.log
        bad: dict[int, list[tuple[int, int]]] = {}
        for rep in log.corruption:
            if rep.lost_bytes and rep.file_id in log.file_sizes:
                bad.setdefault(rep.file_id, []).append((rep.offset, rep.offset + rep.lost_bytes))
        if not bad:
            return q
        drop: list[int] = []
        runs, entries, holes = q.stored()
        for r in runs:
            if r.file_id in bad:
                regions = sorted(bad[r.file_id])
                lost, found = self._unreadable_in_run(r.file_id, r.offset, r.first, r.first + r.length, regions)
                for _a, b in ranges_of(lost):
                    if b in found:
                        q.split(b, found[b])  # the walk resumes past the damage: never walks it again
                drop += lost
        for pos, f, off, size in entries:
            if f in bad and (off + size > log.file_sizes[f] or any(off < b and a < off + size for a, b in bad[f])):
                drop.append(pos)
        for a, b in ranges_of(sorted(set(drop) - set(holes))):
            for f, first, c in q.remove_range(a, b - a):
                self.vouched_gone.setdefault(f, []).extend(range(first, first + c))
        return q

    def _unreadable_in_run(
        self, fid: int, offset: int, lo: int, hi: int, bad: list[tuple[int, int]]
    ) -> tuple[list[int], dict[int, int]]:
        """The positions of one run (``[lo, hi)`` scanned from ``offset`` in ``fid``) that cannot be read.

        Also where the walk found each position that follows a lost one (a record
        boundary past the damage, where that position's part of the run may resume).
        """
        log = self.log
        size = log.file_sizes[fid]
        out: list[int] = []
        resume: dict[int, int] = {}
        expect = lo
        while expect < hi:
            try:
                got = log.locate_puts(fid, offset, expect, hi, 1 << 16)
            except CorruptLogError as exc:
                after = [b for a, b in bad if b > offset and a <= max(exc.offset, offset)]
                if not after:
                    raise
                offset = after[0]  # go on after the dropped stretch (recovery resumed there)
                continue
            if not len(got.offsets):
                break
            if got.first > expect:
                out += range(expect, got.first)
                resume[got.first] = got.offsets[0]
            for i in range(len(got.offsets)):
                off, end = got.offsets[i], got.offsets[i] + got.sizes[i]
                if off == LOST or end > size or any(off < b and a < end for a, b in bad):
                    out.append(got.first + i)
                elif out and out[-1] == got.first + i - 1:
                    resume[got.first + i] = off
            expect = got.first + len(got.offsets)
            offset = got.next_offset
        out += range(expect, hi)
        return out, resume

    def _report_vouched(self) -> None:
        log = self.log
        already = merge_ranges([r for rep in log.corruption for r in rep.lost_positions])
        for fid, positions in sorted(self.vouched_gone.items()):
            lost = _subtract(ranges_of(positions), already)
            if not lost:
                continue
            path = log.file_path(fid) if fid in log.file_sizes else f"data file {fid}"
            reason = (
                f"{sum(b - a for a, b in lost)} events the newest checkpoint ({log.voucher_path}) "
                "vouched for are missing or damaged"
            )
            if log.config.on_corruption != "skip":
                raise CorruptLogError(path, 0, reason)
            log.report_corruption(CorruptionReport(path, 0, reason, 0, lost_positions=lost, file_id=fid))


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open ``ranges`` without the (sorted, merged) ranges ``minus``."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        for c, d in minus:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _in_ranges(p: int, ranges: list[tuple[int, int]]) -> bool:
    i = bisect.bisect_right(ranges, (p, INF_WOID)) - 1
    return i >= 0 and ranges[i][0] <= p < ranges[i][1]


def read_event(log: Log, entry: Entry) -> tuple[bytes, dict[str, str]]:
    """Read and decode the event a queue entry points at.

    Raises:
        CorruptLogError: Its record no longer verifies, or its payload does not decode.
    """
    got = log.read_events((entry,))[0]
    if isinstance(got, CorruptLogError):
        raise got
    return got


def spot_check(log: Log, q: RunQueue) -> None:
    """Check that a queue rebuilt from a checkpoint points at real records.

    The first event of up to 16 runs spread over the queue is found in its file
    and read back (the runs' offsets lead to records that verify and decode).

    Raises:
        CorruptLogError: An entry points into a missing file or at a record that does not verify.
    """
    live = set(log.file_ids())
    counts = q.file_counts()
    for f in counts:
        if f not in live:
            raise CorruptLogError(f"data file {f}", 0, "the checkpoint's queue points into a missing data file")
    if not len(q):
        return
    for _pos, f, off, size in q.sample(16):
        payload = log.read_payload(f, off, size)
        try:
            fmt.decode_event(payload)
        except FormatError as exc:
            raise CorruptLogError(log.file_path(f), off, f"queued event does not decode: {exc.reason}") from exc
