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
from ._queue import Entry, EventQueue
from .checkpoint import Snapshot
from .crypto import SEALED_WITHOUT_KEY, TAMPERED
from .errors import CorruptLogError, DecryptionError, FormatError
from .log import INF_WOID, CorruptionReport, Log, LogRecord, merge_ranges, ranges_of
from .scan import PUT_RUN, PutRun, ScanRecord, expand_runs

__all__ = ["read_event", "replay_queue", "spot_check"]


def _add_position(taken_from: dict[int, list[tuple[int, int]]], file_id: int, position: int) -> None:
    """Record that ``position`` (an event in ``file_id``) was taken, coalescing runs."""
    lst = taken_from.get(file_id)
    if lst is None:
        taken_from[file_id] = [(position, 1)]
        return
    a, c = lst[-1]
    if a + c == position:
        lst[-1] = (a, c + 1)
    else:
        lst.append((position, 1))


_OFFSET = attrgetter("offset")
_SIZE = attrgetter("size")


def _place_runs(tail: EventQueue, first: int, n: int, items: list[ScanRecord]) -> bool:
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
        tail.append_run(first, it.file_id, it.offsets[s : s + c], it.sizes[s : s + c])
        first += c
    return True


def replay_queue(
    log: Log, base: Snapshot | None = None, marks: dict[str, tuple[bytes, int, int]] | None = None
) -> tuple[EventQueue, dict[int, set[int]], dict[int, list[tuple[int, int]]]]:
    """Rebuild the queue from a checkpoint (if any) and the log records after it.

    Replay is idempotent by position: a put sets the entry at its positions,
    a take removes them if present. Returns the queue of committed, untaken
    events in position order; for each data file, the files whose events its
    TAKE records removed; and for each data file, the positions taken from it.

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
        CorruptLogError: A COMMIT does not match the PUT records before it, or
            (``on_corruption="fail"``) an event the newest checkpoint vouched for is gone.
    """
    # Puts replayed here (after the checkpoint, if any) go straight into compact
    # columns, in commit order; takes pop them from the head when they match it
    # (consumers take from the head) and are otherwise noted in ``removed``.
    tail = EventQueue()
    # A transaction's PUTs until its COMMIT: runs of verified PUTs (pointers in a scan's
    # columns, no object per PUT) and, after damage, salvaged PUT records.
    puts: dict[int, list[ScanRecord]] = {}
    takes: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    targets: dict[int, set[int]] = {}
    taken_from: dict[int, list[tuple[int, int]]] = {f: list(r) for f, r in base.taken.items()} if base else {}
    removed: set[int] = set()
    acct = _LossAccounting(log, base)
    if base is not None and base.marks_unread and marks is not None:
        # Only a keyless inspection (which asks for no marks) reads a checkpoint without its sealed marks.
        where = log.recovered_from.path if log.recovered_from is not None else ""
        raise DecryptionError(where, 0, "the checkpoint's marks table is sealed, and no key was given to open it")
    if marks is None:
        marks = {}
    if base is not None:
        for key, value, woid, file_id in base.marks:
            marks[key] = (value, woid, file_id)
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
            if _place_runs(tail, first, n, items):
                pass  # the usual case: every PUT verified in its batch, placed run by run
            elif len(ptrs := list(expand_runs(items))) == n:
                # A transaction's puts are written in one write, in write-order: when its first and
                # last put are in one data file, all of them are (the usual case: one run).
                if ptrs and ptrs[0].file_id == ptrs[-1].file_id:
                    tail.append_run(first, ptrs[0].file_id, list(map(_OFFSET, ptrs)), list(map(_SIZE, ptrs)))
                else:
                    for i, rec in enumerate(ptrs):
                        tail.append(first + i, rec.file_id, rec.offset, rec.size)
            elif r.salvaged:
                # Some PUT records of this transaction were damaged: place the intact
                # ones by write-order id (PUTs, then a TAKE if any, then the COMMIT).
                first_woid = r.woid - n - (1 if n_taken else 0)
                placed = set()
                for rec in ptrs:
                    i = (rec.woid if rec.salvaged else -1) - first_woid
                    if 0 <= i < n and i not in placed:
                        placed.add(i)
                        tail.append(first + i, rec.file_id, rec.offset, rec.size)
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
                    got = tail.pop_range(start, count)
                    if got is None:
                        # A position not in the tail now never will be (its put came
                        # first); without a checkpoint under the tail it can be dropped.
                        removed.update(p for p in range(start, start + count) if base is not None or p in tail)
                        got = tail.drain_head(removed)
                    else:
                        got += tail.drain_head(removed)
                    for p, f, _o, _s in got:
                        tset.add(f)
                        _add_position(taken_from, f, p)
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
    if base is not None:
        # A data file is retired only once no queued event points into it, so
        # checkpoint entries in a file known retired were taken after the
        # checkpoint (their TAKE record may have gone with a later file). Entries in
        # a file that is gone without a trace of retirement are lost, not taken.
        gone = log.retired_files | log.missing_files
        if gone:
            fids, poss = base.file_ids, base.positions
            for i in range(len(poss)):
                if fids[i] in gone:
                    removed.add(poss[i])
                    if fids[i] in log.missing_files:
                        acct.vouched_lost(poss[i], fids[i])
        q = EventQueue.from_snapshot(base, removed, taken_from)
        for e in tail.without(removed, taken_from):
            q.append(*e)
    else:
        q = tail.without(removed, taken_from)
    q = acct.finish(q)
    # Recovery is over: the checkpoint it checked against is not needed again, and after a
    # full replay its columns (~34 B per queued event) would stay beside the queue's.
    log.release_recovery_state()
    # What recovery freed lies below the queue's columns (they grew last): hand it back.
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

    def finish(self, q: EventQueue) -> EventQueue:
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
            # Chunk by chunk in C: usually nothing is missing, and a million vouched
            # positions need neither a Python-level loop nor a set of them all.
            missing = q.missing(v.positions)
            retired = log.retired_files
            if missing:
                for i in range(len(v.positions)):
                    p = v.positions[i]
                    if p in missing and v.file_ids[i] not in retired and not _in_ranges(p, taken):
                        self.vouched_gone.setdefault(v.file_ids[i], []).append(p)
        if self.vouched_gone:
            self._report_vouched()
        for rep in log.corruption:
            rep.lost_positions = merge_ranges(rep.lost_positions)
        return q

    def _drop_unreadable(self, q: EventQueue) -> EventQueue:
        """Remove queue entries that point past a file's end or into bytes recovery dropped."""
        log = self.log
        bad: dict[int, list[tuple[int, int]]] = {}
        for rep in log.corruption:
            if rep.lost_bytes and rep.file_id in log.file_sizes:
                bad.setdefault(rep.file_id, []).append((rep.offset, rep.offset + rep.lost_bytes))
        if not bad:
            return q
        drop: set[int] = set()
        for pos, f, off, size in q.entries_in(set(bad)):
            end = off + size
            if end > log.file_sizes[f] or any(off < b and a < end for a, b in bad[f]):
                drop.add(pos)
                self.vouched_gone.setdefault(f, []).append(pos)
        return q.without(drop, {}) if drop else q

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


def spot_check(log: Log, q: EventQueue) -> None:
    """Check that a queue rebuilt from a checkpoint points at real records.

    Raises:
        CorruptLogError: An entry points into a missing file or at a record that does not verify.
    """
    live = set(log.file_ids())
    counts = q.file_counts()
    for f in counts:
        if f not in live:
            raise CorruptLogError(f"data file {f}", 0, "the checkpoint's queue points into a missing data file")
    n = len(q)
    if not n:
        return
    picks = sorted({0, n - 1, *range(0, n, max(1, n // 16))})
    entries = q.entries_at(picks)
    for _pos, f, off, size in entries:
        payload = log.read_payload(f, off, size)
        try:
            fmt.decode_event(payload)
        except FormatError as exc:
            raise CorruptLogError(log.file_path(f), off, f"queued event does not decode: {exc.reason}") from exc
