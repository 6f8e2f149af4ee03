"""Recovery: which checkpoint to trust, which data files belong to the channel, what to keep.

This module decides; ``scan.py`` reports what the bytes say and ``_fs`` does the
syscalls. At open, :class:`Recovery` reads every data directory: the newest
file of each decides which files are live; older live files are scanned
strictly, oldest first; the newest checkpoint that decodes vouches for the
length of every live file and for every queued event, so data that disagrees
with it is damage, never a torn tail. Only records covered by a verified
BATCH_END count; in the newest data file of a directory, damage with nothing
verified after it and beyond what a checkpoint vouched for is a torn tail: it
is copied aside and truncated. Any other damage is corruption of
acknowledged data and raises ``CorruptLogError`` (or, with
``on_corruption="skip"``, is skipped and reported exactly). What it finds goes
into the shared :class:`~filechannel.logstate.LogState`; the counters continue
above everything seen.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import os
import time
from collections.abc import Callable
from typing import Any

from . import format as fmt
from ._fs import map_file, truncate_durably
from .checkpoint import CheckpointStore, Snapshot
from .crypto import header_cipher
from .directory import ANCHOR_FILE
from .errors import CorruptLogError, FormatError
from .logstate import LogState
from .scan import (
    INF_WOID,
    SEG_RE,
    CorruptionReport,
    FileScan,
    LogRecord,
    Scanner,
    all_zero,
    find_verified_batch_end,
    oldest_authenticated,
    segment_name,
)
from .scan import (
    first_record as scan_first_record,
)

logger = logging.getLogger(__name__)

AUTH_HINT = (
    "restore the channel from a backup; to accept the loss, open with on_corruption='skip' (it is reported); "
    "see docs/encryption.md"
)
MISSING_HINT = (
    "restore the file or mount its disk; to accept the loss, open with on_corruption='skip' "
    "(every lost position is reported)"
)
_TXN_ID = operator.attrgetter("txn_id")
_OP = operator.attrgetter("op")
_COMMIT_OR_RETIRE = frozenset((fmt.COMMIT, fmt.RETIRE)).__contains__

_Newest = tuple[int, "frozenset[int] | None"]
"""A data directory's newest file id and its header's live list (None: the header is damaged)."""


class _CheckpointUnusable(Exception):
    """A checkpoint does not fit the data files on disk (recovery tries an older one)."""


class Recovery:
    """Recovers the data directories of an open log into its shared state.

    Args:
        st: The log's shared state (identity and data directories already set).
        checkpoints: Where checkpoints live; recovery starts from the newest
            usable one (unless ``replay="full"``), falling back to older ones.
        progress: Called with a short message as recovery reads each data file.
    """

    def __init__(
        self,
        st: LogState,
        checkpoints: CheckpointStore | None,
        progress: Callable[[str], None] | None,
        anchor: fmt.AuthState | None = None,
    ) -> None:
        self.st = st
        # What ANCHOR and (once one is chosen) the checkpoint vouch for of each
        # authenticated file: its key check, and the batch tag at a length it reached.
        # Both are checked against the file, each on its own: they are MACed apart, and
        # one swapped in from a copy of the channel is valid alone (never "the longer wins").
        self._anchor = anchor.by_id() if anchor is not None else {}
        self._anchor_first = anchor.first_auth if anchor is not None else fmt.NO_AUTH_FILE
        self._ckpt_auth: dict[int, fmt.AuthEntry] = {}
        self._anchor_gen = anchor.generation if anchor is not None else 0
        # Positions an authenticated record (ANCHOR, a checkpoint) says were given out: never again.
        self.vouched_next_position = anchor.next_position if anchor is not None else 0
        self._anchor_acks = anchor.acks if anchor is not None else ()
        self._gen_checked = False
        self.checkpoints = checkpoints
        self._progress = progress
        self._woid_floor = 0
        self._maps = contextlib.ExitStack()  # the data files of the directory being recovered, mapped
        self._first_auth = 1 << 64  # the oldest authenticated data file (format version 2) of any directory
        self._plaintext: list[str] = []  # plaintext files an encrypted channel reads while they drain
        self.live_by_dir: list[list[int]] = []  # each data directory's live file ids, for its writer

    def run(self) -> None:
        """Recover: choose the checkpoint to trust, check every data file, decide what to keep.

        Raises:
            CorruptLogError: Acknowledged data is damaged, missing or foreign
                (unless ``on_corruption="skip"``: then it is reported).
            DecryptionError: An encrypted file's key is missing or wrong.
        """
        self._first_auth = min(oldest_authenticated(self.st.fs, self.st.data_dirs), self._anchor_first)
        self.st.anchor_generation = self._anchor_gen
        if self._anchor_acks:
            self.st.note_acks(self._anchor_acks)
        self._recover()
        self.first_auth = self._first_auth
        if self._plaintext:
            logger.warning(
                "%d plaintext data file(s) from before encryption was turned on are read while their events "
                "drain (%s ...); their events and control records are not authenticated",
                len(self._plaintext),
                self._plaintext[0],
            )

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
            if store is None:  # pragma: no cover - found is empty without a store
                continue
            try:
                snap = store.load(c, self.st.crc_kind, self.st.channel_id, self.st.meta_mac, self.st.macs_required)
            except (FormatError, OSError) as exc:
                self._checkpoint_fallback(c.path, str(exc))
                continue
            self._use_auth(snap.auth, c.path)
            self.st.voucher = snap
            self.st.voucher_path = c.path
            if self.st.config.replay == "checkpoint":
                try:
                    self._recover_with(snap)
                except _CheckpointUnusable as exc:
                    self._checkpoint_fallback(c.path, str(exc))
                    self._reset_recovery()
                    continue
                self.st.recovered_from = c
                self.st.base_snapshot = snap
                return
            break
        self._recover_with(None)

    def _use_auth(self, auth: fmt.AuthState | None, path: str) -> None:
        """Check the data files against ANCHOR and against this checkpoint's authenticated files, each."""
        self._ckpt_auth = auth.by_id() if auth is not None else {}
        if auth is None:
            return
        self._first_auth = min(self._first_auth, auth.first_auth)
        self.st.anchor_generation = max(self.st.anchor_generation, auth.generation)
        self.vouched_next_position = max(self.vouched_next_position, auth.next_position)
        self.st.note_acks(auth.acks)
        if not self._gen_checked and self.st.meta_mac is not None:
            self._gen_checked = True  # the newest checkpoint that decodes judges (an older one is older)
            if auth.generation > self._anchor_gen:
                anchor_path = os.path.join(self.st.directory, ANCHOR_FILE)
                reason = (
                    f"ANCHOR is older than checkpoint {os.path.basename(path)} (generation {self._anchor_gen}, "
                    f"the checkpoint saw {auth.generation}): an older ANCHOR (or a copy's) was put in its place, "
                    "so batches cut since cannot be checked"
                )
                self._refuse(anchor_path, 0, reason, 0)

    def _refs(self, fid: int) -> list[fmt.AuthEntry]:
        """What ANCHOR and the checkpoint each recorded of a file (none, one or two entries)."""
        return [e for e in (self._anchor.get(fid), self._ckpt_auth.get(fid)) if e is not None]

    def _refuse(self, path: str, offset: int, reason: str, fid: int, size: int = 0) -> None:
        """Authenticated data that disagrees with ANCHOR or the checkpoint: refused, or reported in skip mode."""
        if self.st.config.on_corruption != "skip":
            raise CorruptLogError(path, offset, reason, AUTH_HINT)
        self.st.report_corruption(CorruptionReport(path, offset, reason, size, None, [], fid))

    def _check_tag(self, path: str, fid: int, end: int, h: fmt.FileHeader) -> None:
        """The batch chain of an authenticated file must pass through the tag recorded at each vouched length."""
        if fid not in self.st.ciphers:
            return
        for e in self._refs(fid):
            if end < e.length:
                continue  # cut short of it: the scan reported the loss
            if e.length <= h.header_len:
                got = h.key_check  # no batch yet: the chain starts at the header's key check
            else:
                fs = self.st.fs
                fd = fs.open_read(path)
                try:
                    got = fs.pread(fd, fmt.BATCH_TAG_LEN, e.length - fmt.BATCH_TAG_LEN)
                finally:
                    fs.close(fd)
            if got != e.tag:
                self._refuse(
                    path,
                    e.length,
                    f"the batches up to offset {e.length} are not the ones the channel wrote (their last tag differs "
                    f"from the one {self._who(fid, e)} recorded): replaced by a copy's, or forged",
                    fid,
                )
                return

    def _who(self, fid: int, e: fmt.AuthEntry) -> str:
        """Which authenticated record an entry came from, for a message."""
        return "ANCHOR" if self._anchor.get(fid) is e else "the checkpoint"

    def _finish_auth(self, path: str, fid: int, s: FileScan) -> None:
        """Check an authenticated file against its recorded tag; keep the tag at its end (the next ANCHOR's)."""
        if fid not in self.st.ciphers or not s.header.authenticated:
            return
        self._check_tag(path, fid, s.end, s.header)
        tag = s.last_tag
        if not tag:  # only the header was read (a checkpoint covers the whole file)
            tag = s.header.key_check
            if s.end > s.header.header_len:
                fd = self.st.fs.open_read(path)
                try:
                    tag = self.st.fs.pread(fd, fmt.BATCH_TAG_LEN, s.end - fmt.BATCH_TAG_LEN)
                finally:
                    self.st.fs.close(fd)
        self.st.file_tags[fid] = bytes(tag)

    def _anchored_gone(self, index: int, d: str, ids: list[int]) -> None:
        """Authenticated files that ANCHOR or the checkpoint recorded newer than any file left: cut whole."""
        newest = ids[-1] if ids else 0
        recorded = {**self._ckpt_auth, **self._anchor}
        for e in sorted(recorded.values(), key=lambda e: e.file_id):
            if e.dir_index != index or e.file_id <= newest or e.file_id in self.st.discarded:
                continue
            path = os.path.join(d, segment_name(e.file_id))
            reason = "data file is missing, but ANCHOR or the checkpoint recorded it (the newest files were removed)"
            if self.st.config.on_corruption != "skip":
                raise CorruptLogError(path, 0, reason, MISSING_HINT)
            self.st.missing_files.add(e.file_id)
            self.st.report_corruption(CorruptionReport(path, 0, reason, e.length, None, [], e.file_id))

    def _reset_recovery(self) -> None:
        self.st.files.clear()
        self.st.seeds.clear()
        self.st.ciphers.clear()
        self.st.undecryptable.clear()
        self.st.headerless.clear()
        self.st.key_ids.clear()
        self.st.file_end.clear()
        self.st.file_sizes.clear()
        self.st.retired_files.clear()
        self.st.missing_files.clear()
        self.st.corruption.clear()
        self.st.torn_tails.clear()
        self.st.voucher = None

    def _checkpoint_fallback(self, path: str, reason: str) -> None:
        self.st.checkpoint_fallbacks.append(f"{path}: {reason}")
        logger.warning("checkpoint %s is not usable (%s); trying an older one, else a full replay", path, reason)

    def _recover_with(self, snap: Snapshot | None) -> None:
        scans: list[FileScan] = []
        live_by_dir: list[list[int]] = []
        max_next_pos = 0
        max_txn = 0
        max_woid = 0
        max_file_id = 0
        newest_by_dir: dict[int, _Newest] = {}
        retired: set[int] = set()
        for index, d in enumerate(self.st.data_dirs):
            with contextlib.ExitStack() as self._maps:
                dscans, max_id, newest, retired_d = self._recover_dir(index, d, snap)
            retired |= retired_d
            if newest is not None:
                newest_by_dir[index] = newest
            max_file_id = max(max_file_id, max_id)
            live_by_dir.append([s.file_id for s in dscans])
            for s in dscans:
                max_next_pos = max(max_next_pos, s.header.next_position)
                max_txn = max(max_txn, s.header.next_txn_id - 1)
                max_woid = max(max_woid, s.header.base_woid - 1, s.last_woid)
                recs = s.records  # a compact scan: one PutRun per transaction's PUTs, not one record each
                if recs:
                    max_txn = max(max_txn, max(map(_TXN_ID, recs)))
                # Only COMMIT and RETIRE records matter below; skip the rest at C speed.
                for r in itertools.compress(recs, map(_COMMIT_OR_RETIRE, map(_OP, recs))):
                    assert isinstance(r, LogRecord)
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
        max_next_pos = max(max_next_pos, self.vouched_next_position)
        if self.st.voucher is not None:
            max_next_pos = max(max_next_pos, self.st.voucher.next_position)
            self._classify_vanished(retired, newest_by_dir)
        # Where replay's position accounting starts: positions below the oldest live
        # file's first were in files retired long ago.
        if snap is not None:
            self.st.position_floor = snap.next_position
        elif scans and not any(s.header_damaged for s in scans):
            self.st.position_floor = min(s.header.next_position for s in scans)
        elif self.st.voucher is not None and len(self.st.voucher):
            self.st.position_floor = self.st.voucher.first_position() or 0
        else:
            self.st.position_floor = 0
        self.st.scans = scans
        self.st.next_woid = max_woid + 1
        self.st.next_position = max_next_pos
        self.st.next_file_id = max_file_id + 1
        self.st.set_next_txn_id(max_txn + 1)
        self.live_by_dir = live_by_dir

    def _classify_vanished(self, retired: set[int], newest_by_dir: dict[int, _Newest]) -> None:
        """Sort the checkpointed files that are gone into retired ones and missing ones.

        A file is known retired when a RETIRE record names it, or when the newest
        file of its data directory is newer and does not list it as live (a retired
        file leaves the live list before its RETIRE is written, and a directory's
        newest file never retires). Any other file the checkpoint vouched for and
        that is gone is missing: its events are lost. The checkpoint records each
        file's data directory; one written before it did (version 1) leaves any
        directory's newest file as the judge, which cannot tell the newest file of
        one directory, deleted, from a retired one.
        """
        voucher = self.st.voucher
        assert voucher is not None
        gone = set(voucher.files) - set(self.st.files) - self.st.discarded
        for fid in sorted(gone):
            index = voucher.file_dirs.get(fid)
            if index is not None and index < len(self.st.data_dirs):
                judges = [newest_by_dir[index]] if index in newest_by_dir else []
            else:
                index = None
                judges = list(newest_by_dir.values())
            listed = not self.st.dir_lost and any(
                fid < n and live is not None and fid not in live for n, live in judges
            )
            if fid in retired or listed:
                self.st.retired_files.add(fid)
                continue
            path = os.path.join(self.st.data_dirs[index or 0], segment_name(fid))
            reason = "data file is missing, but the newest checkpoint lists it as live"
            if self.st.config.on_corruption != "skip":
                raise CorruptLogError(path, 0, reason, MISSING_HINT)
            self.st.missing_files.add(fid)
            span = (voucher.woid, INF_WOID)
            self.st.report_corruption(CorruptionReport(path, 0, reason, 0, span, file_id=fid))

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
        """The length the newest checkpoint (or, encrypted, ANCHOR) recorded for a file (0: nothing)."""
        v = self.st.voucher
        got = v.files.get(fid, 0) if v is not None else 0
        if fid not in self.st.ciphers:
            return got
        return max([got, *(e.length for e in self._refs(fid))])

    def _read_data_file(self, path: str, fid: int, snap: Snapshot | None) -> tuple[Any, int]:
        """Read a data file, only its header when a checkpoint covers all of it; return it and its size."""
        fs = self.st.fs
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
        finally:
            fs.close(fd)
        # Mapped, not read: a file larger than memory (a sparse or crafted one) costs address space only.
        return self._maps.enter_context(map_file(fs, path)), size

    def _recover_dir(
        self, index: int, d: str, snap: Snapshot | None = None
    ) -> tuple[list[FileScan], int, tuple[int, frozenset[int] | None] | None, set[int]]:
        """Recover one data directory.

        Returns its scans, the highest file id seen, ``(newest file id, its live
        list or None when its header is damaged)`` and the file ids its newest
        file's RETIRE records name.
        """
        fs = self.st.fs
        if not fs.exists(d):
            return [], 0, None, set()
        ids = sorted(int(m.group(1), 16) for n in fs.listdir(d) if (m := SEG_RE.match(n)))
        self._anchored_gone(index, d, ids)
        if not ids:
            return [], 0, None, set()
        max_id = ids[-1]
        # 1. The newest file decides which files belong to the channel.
        newest = None
        nh: fmt.FileHeader | None = None
        nbuf: Any = b""
        nfirst: int | None = None
        while ids:
            fid = ids[-1]
            path = os.path.join(d, segment_name(fid))
            buf = self._maps.enter_context(map_file(fs, path))
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
        nscan = Scanner(self.st, npath, newest, nbuf, nh, auth=self.st.ciphers.get(newest)).scan(
            True, 0, nstart, floor, self._vouched(newest), compact=True
        )
        nscan.header_damaged = ndamaged
        retired = {
            fmt.decode_retire(r.payload) for r in nscan.records if isinstance(r, LogRecord) and r.op == fmt.RETIRE
        }
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
        if missing and self.st.config.on_corruption != "skip":
            path = os.path.join(d, segment_name(missing[0]))
            raise CorruptLogError(
                path, 0, "data file is missing, but the newest data file lists it as live", MISSING_HINT
            )
        for fid in sorted(present - expected):
            path = os.path.join(d, segment_name(fid))
            buf = self._maps.enter_context(map_file(fs, path))
            # Retired: its RETIRE record (or an older header) says it is gone.
            if fid < newest and not self.st.readonly and self._header_ok(buf, fid):
                logger.info("removing retired data file %s", path)
                fs.unlink(path)
                fs.fsync_dir(d)
        # 2. Scan the older live files strictly, oldest first.
        scans: list[FileScan] = []
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
                s = FileScan(fid, path, h, [], size, size, max(prev_woid, h.base_woid - 1))
                if vouched > size:  # pragma: no cover - a header-only read means size == resume offset
                    Scanner(self.st, path, fid, buf, h).report_short_file(size, vouched, s.last_woid)
            else:
                s = Scanner(self.st, path, fid, buf, h, auth=self.st.ciphers.get(fid)).scan(
                    False, prev_woid, start, floor, vouched, compact=True
                )
            s.header_damaged = damaged
            self._finish_auth(path, fid, s)
            buf = b""  # not two whole files in memory at once while the next one is read
            prev_woid = s.last_woid
            scans.append(s)
            self.st.register_file(fid, index, path)
            self.st.file_end[fid] = s.end
            self.st.file_sizes[fid] = s.size
        if not ndamaged and nh.base_woid <= prev_woid:
            raise CorruptLogError(npath, 0, "write-order ids overlap the previous data file")
        self.st.register_file(newest, index, npath)
        self.st.file_end[newest] = nscan.end
        self._finish_auth(npath, newest, nscan)
        self.st.file_sizes[newest] = nscan.size
        # Only a torn tail (past what the checkpoint vouched for) is cut off. An end below
        # that means skip mode salvaged records from damaged, acknowledged bytes up to the
        # end of the file: they stay (replay points into them; writes go to a new file).
        if nscan.end < nscan.size and not self.st.readonly and nscan.end >= self._vouched(newest):
            self._truncate_tail(npath, nscan.end, nbuf)
        scans.append(nscan)
        for fid in missing:
            # What the file held lies between the files around it, in write-order ids.
            lo = max((s.last_woid for s in scans if s.file_id < fid), default=0)
            hi = min((s.header.base_woid for s in scans if s.file_id > fid and not s.header_damaged), default=INF_WOID)
            path = os.path.join(d, segment_name(fid))
            reason = "data file is missing, but the newest data file lists it as live"
            self.st.missing_files.add(fid)
            self.st.report_corruption(CorruptionReport(path, 0, reason, 0, (lo, hi), file_id=fid))
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

    def _header_ok(self, buf: Any, fid: int) -> bool:
        try:
            h = fmt.decode_file_header(buf)
        except FormatError:
            return False
        return isinstance(h, fmt.FileHeader) and h.channel_id == self.st.channel_id and h.file_id == fid

    def _read_header(self, path: str, fid: int, buf: Any, newest: bool) -> tuple[fmt.FileHeader, int | None] | None:
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
                self.st.torn_tails.append((path, 0, len(buf)))
                self.st.discarded.add(fid)
                if not self.st.readonly:
                    self._set_aside(path, buf, 0)
                    self.st.fs.unlink(path)
                    self.st.fs.fsync_dir(os.path.dirname(path))
                return None
            if self.st.config.on_corruption != "skip":
                raise CorruptLogError(path, exc.offset, f"data file header: {exc.reason}") from exc
            first = self._first_record(buf, fid)
            self.st.report_corruption(
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
            stand_in = fmt.FileHeader(self.st.crc_kind, self.st.channel_id, fid, 0, 0, 0, 0)
            # The salt went with the header: an encrypted file's events cannot be decrypted.
            # Each record says whether it was sealed, so a plaintext file's (a mixed history)
            # are still read, and a sealed one is never decoded as plaintext.
            self.st.headerless[fid] = "the data file header is damaged: its encrypted events cannot be decrypted"
            return stand_in, first
        assert isinstance(h, fmt.FileHeader)
        if h.channel_id != self.st.channel_id:
            raise CorruptLogError(path, 16, "data file belongs to another channel; move it out of this directory")
        if h.file_id != fid:
            raise CorruptLogError(path, 32, f"header says file id {h.file_id}, but the name says {fid}")
        if h.crc_kind != self.st.crc_kind:
            raise CorruptLogError(path, 12, "checksum algorithm differs from the channel's")
        if not h.authenticated and fid > self._first_auth:
            # Once a channel writes authenticated files it never writes another kind: a plaintext
            # (or older-format encrypted) file newer than its first authenticated one was forged,
            # or copied in. It is never read.
            reason = (
                f"{'a plaintext' if not h.cipher else 'an unauthenticated (format version 1)'} data file newer "
                f"than the channel's first authenticated one ({segment_name(self._first_auth)}): forged or copied "
                "in; move it out of the data directory"
            )
            if self.st.config.on_corruption != "skip":
                raise CorruptLogError(path, 8, reason)
            self.st.report_corruption(CorruptionReport(path, 0, f"{reason}; it is not read", len(buf), None, [], fid))
            self.st.discarded.add(fid)
            self.st.missing_files.add(fid)
            return None
        if not h.cipher and self.st.config.encryption is not None:
            self._plaintext.append(path)
        self._setup_cipher(path, fid, h, buf)
        wrong = [e for e in self._refs(fid) if e.key_check != h.key_check]
        if wrong and h.authenticated and fid in self.st.ciphers:
            reason = (
                "data file is not the one this channel wrote (its key check differs from the one "
                f"{' and '.join(self._who(fid, e) for e in wrong)} recorded): a file from a copy of the channel, "
                "or forged; it is not read"
            )
            self._refuse(path, 0, reason, fid, len(buf))
            self.st.discarded.add(fid)
            self.st.missing_files.add(fid)  # a checkpoint's events in it are lost, not taken
            self.st.ciphers.pop(fid, None)
            return None
        if h.authenticated and fid in self.st.ciphers:
            self.st.key_checks[fid] = h.key_check
        return h, None

    def _setup_cipher(self, path: str, fid: int, h: fmt.FileHeader, buf: bytes | memoryview) -> None:
        """Check an encrypted file's key (at open) and keep its cipher for reads.

        Raises:
            DecryptionError: The file is encrypted and no key, or the wrong key, is given
                (a read-only inspection without a key only notes it: checksums need no key).
        """
        self.st.ciphers.pop(fid, None)
        self.st.undecryptable.pop(fid, None)
        self.st.key_ids.pop(fid, None)
        if not h.cipher:
            return
        self.st.key_ids[fid] = h.key_id
        if self.st.config.encryption is None and self.st.readonly and self.st.keyless_ok:
            self.st.undecryptable[fid] = (
                f"data file is encrypted (key id {h.key_id!r}), but the channel was opened without encryption="
            )
            return
        cipher = header_cipher(self.st.config.encryption, path, h, buf, self.st.channel_id)
        assert cipher is not None
        self.st.ciphers[fid] = cipher

    def _first_record(self, buf: bytes, fid: int) -> int:
        return first_record(self.st, buf, fid)

    def _no_verified_data(self, buf: bytes, fid: int) -> bool:
        seed = fmt.file_seed(self.st.crc_kind, self.st.channel_id, fid)
        return find_verified_batch_end(buf, 0, seed, self.st.crc_kind, self.st.max_payload) is None

    def _set_aside(self, path: str, buf: bytes, start: int) -> None:
        """Keep a forensic copy of bytes recovery is about to drop."""
        dest = f"{path}.torn-{time.time_ns()}"
        fd = self.st.fs.create(dest)
        try:
            self.st.fs.pwrite_all(fd, buf[start:], 0)
            self.st.fs.fsync(fd)
        finally:
            self.st.fs.close(fd)

    def _truncate_tail(self, path: str, end: int, buf: bytes) -> None:
        fs = self.st.fs
        if not all_zero(buf, end):
            self._set_aside(path, buf, end)
        truncate_durably(fs, path, end)
        fs.fsync_dir(os.path.dirname(path))


def first_record(st: LogState, buf: Any, fid: int) -> int:
    """Where the first record that verifies starts, after a damaged header (or the end); bounded work."""
    seed = fmt.file_seed(st.crc_kind, st.channel_id, fid)
    smallest = fmt.FILE_HEADER_FIXED + 4  # a header that lists no live file, before padding
    got = scan_first_record(buf, smallest, fmt.MAX_HEADER_LEN, seed, st.crc_kind, st.max_payload)
    return len(buf) - (len(buf) & 7) if got is None else got
