"""ChannelReader: read a channel from any process, without a lock, and acknowledge what was consumed.

This module owns the read-only, cross-process view of a channel: it loads the
newest checkpoint and replays the log after it (the same recovery, read-only,
that an open performs: ``logview.open_view``), then follows the data files as the owner appends,
rolls and retires them, scanning only the bytes that are new with the one
parser in ``scan.py``. It never writes, truncates or moves a data file or a
checkpoint and takes no lock; the only files it writes are its consumer's
registration and acknowledgements (``consumers.py``), which the owning
channel turns into committed takes.

Visibility follows the owner's durability rules: a transaction is visible once
its batch (BATCH_END) verifies; a torn or partly written batch at the tail of
a live file is "not yet", never damage. Damage to acknowledged data follows
``on_corruption`` like everywhere else.

A reader is picklable: it holds only its arguments until first used, and
reopens what it needs lazily (Spark pickles the planner's copy to executors).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from types import TracebackType
from typing import Any, TypeVar

from . import format as fmt
from ._fs import DEFAULT_FS, FS
from ._readindex import Run, RunIndex
from .config import CORRUPTION_POLICIES, ChannelConfig
from .consumers import ConsumerStore, validate_name
from .crypto import (
    SEALED_WITHOUT_KEY,
    TAMPERED,
    Encryption,
    FileCipher,
    as_encryption,
    header_cipher,
    segment_cipher,
)
from .errors import (
    AckRangeError,
    ChannelError,
    ConfigError,
    CorruptLogError,
    DataLossError,
    DecryptionError,
    FormatError,
)
from .events import Event
from .logview import open_view
from .scan import LOST, SEG_RE, CorruptionReport, LogRecord, PutWalk, Scanner, locate_puts, segment_name

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 8 << 20
_T = TypeVar("_T")
HEADER_GUESS = 4096  # bytes of a data file read first for its header (fmt.MAX_HEADER_LEN if it is longer)


@dataclass(frozen=True)
class Segment:
    """Where a run of committed events lies in one data file: picklable, self-contained.

    :func:`read_segment` reads it with one ``pread`` and checks every record,
    without replaying the log. ``positions``, ``offsets`` (relative to
    ``offset``) and ``sizes`` are parallel.
    """

    path: str
    file_id: int
    channel_id: bytes
    crc_kind: int
    offset: int
    length: int
    positions: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    # An encrypted data file: its cipher suite, key id and salt (never a key).
    cipher: int = 0
    key_id: str = ""
    salt: bytes = b""

    @property
    def start(self) -> int:
        """The first position in the segment."""
        return self.positions[0]

    @property
    def end(self) -> int:
        """One past the last position in the segment."""
        return self.positions[-1] + 1

    def __len__(self) -> int:
        return len(self.positions)


def read_segment(segment: Segment, *, fs: FS | None = None, encryption: Encryption | str | None = None) -> list[Event]:
    """Read the events a :class:`Segment` describes, checking every record's checksum.

    A segment of an encrypted data file needs ``encryption`` (an
    :class:`~filechannel.Encryption` or a keystore path) holding its key id.

    Raises:
        TypeError: ``segment`` is not a :class:`Segment`.
        DataLossError: The data file is gone (retired after the events were acknowledged).
        CorruptLogError: A record there does not verify.
        DecryptionError: No key for an encrypted segment, or a record whose tag fails.
    """
    if not isinstance(segment, Segment):
        raise TypeError(f"read_segment() takes a Segment (from ChannelReader.segments()), got {type(segment).__name__}")
    fs = fs or DEFAULT_FS
    cipher = segment_cipher(segment, encryption)
    try:
        fd = fs.open_read(segment.path)
    except FileNotFoundError as exc:
        raise DataLossError(
            segment.start, segment.end, f"data file {segment.path} is gone (retired after an acknowledgement)"
        ) from exc
    try:
        buf = fs.pread(fd, segment.length, segment.offset)
    finally:
        fs.close(fd)
    seed = fmt.file_seed(segment.crc_kind, segment.channel_id, segment.file_id)
    out: list[Event] = []
    for p, rel, size in zip(segment.positions, segment.offsets, segment.sizes, strict=True):
        out.append(_decode_put(buf, rel, size, seed, segment.crc_kind, segment.path, segment.offset + rel, p, cipher))
    return out


def _decode_put(
    buf: bytes,
    rel: int,
    size: int,
    seed: int,
    kind: int,
    path: str,
    offset: int,
    position: int,
    cipher: FileCipher | None = None,
) -> Event:
    try:
        rec = fmt.decode_record(buf, rel, seed, kind, 0xFFFF_FFFF)
        if not isinstance(rec, fmt.Record) or rec.size != size or rec.op != fmt.PUT:
            raise FormatError(0, "no PUT record of the expected size there")
        payload = rec.payload
        if cipher is not None:
            plain = cipher.open(bytes(buf[rel : rel + 24]), offset, payload)
            if plain is None:
                raise DecryptionError(path, offset, f"event at position {position}: {TAMPERED}", cipher.key_id)
            payload = plain
        elif rec.sealed:
            raise DecryptionError(path, offset, f"event at position {position}: {SEALED_WITHOUT_KEY}")
        body, headers = fmt.decode_event(payload)
    except FormatError as exc:
        raise CorruptLogError(path, offset, f"event at position {position}: {exc.reason}") from exc
    return Event(body, headers, position)


class _FileState:
    """What the reader knows of one live data file."""

    __slots__ = ("cipher", "dir_index", "end", "header", "last_tag", "path")

    def __init__(
        self,
        dir_index: int,
        path: str,
        header: fmt.FileHeader,
        end: int,
        cipher: FileCipher | None = None,
        last_tag: bytes | None = None,
    ) -> None:
        self.dir_index = dir_index
        self.path = path
        self.header = header
        self.end = end  # offset after the last verified batch read
        self.cipher = cipher
        # An authenticated file's tag of the batch that ends at ``end`` (where the next batch's
        # chain starts); None before any batch of it was read: the header's key check is.
        self.last_tag = last_tag


class _Follower:
    """The reader's live state: the index, the files, and the scan context for new bytes."""

    def __init__(self, reader: ChannelReader) -> None:
        self.fs = reader._fs
        self.directory = reader.directory
        self.encryption = as_encryption(reader.encryption)
        self._reported: set[tuple[str, int, str]] = set()
        self.config = ChannelConfig(on_corruption=reader.on_corruption, encryption=self.encryption)
        view = open_view(self.directory, self.config, fs=self.fs, replay=False)
        log = view.log
        try:
            self.data_dirs = list(log.data_dirs)
            # Per data directory, a write-order id no record written there from now on can be at
            # or below (records reach each directory in write-order): what recovery read of it.
            self.frontier = [0] * len(self.data_dirs)
            tags: dict[int, bytes] = {}
            for scan in log.scans:
                d = self._dir_of(scan.path)
                self.frontier[d] = max(self.frontier[d], scan.last_woid)
                if scan.last_tag:
                    tags[scan.file_id] = scan.last_tag
            q = view.replay()
            self.channel_id = log.channel_id
            self.crc_kind = log.crc_kind
            self.meta_mac = log.meta_mac  # an encrypted channel's acks are MACed
            self.macs_required = log.macs_required
            self.consumer_acks = log.consumer_acks  # how far the owner saw each ack go (ANCHOR, checkpoint)
            self.max_payload = log.max_payload
            self.corruption: list[CorruptionReport] = list(log.corruption)
            # The owner's queue as runs (no event is looked at): reads walk the data files from them.
            self.index = RunIndex(self.locate, self.file_end)
            runs, entries, holes = q.stored()
            k = 0
            for r in runs:
                while k < len(holes) and holes[k] < r.first:
                    k += 1
                m = bisect_left(holes, r.first + r.length, k)
                self.index.add_stored(r.first, r.length, r.file_id, r.offset, holes[k:m])
            for p, fid, off, size in entries:  # rolled-back takes waiting outside the runs: one each
                self.index.add(p, fid, array("q", (off,)), array("q", (size,)))
            del q, runs, entries
            self.files: dict[int, _FileState] = {}
            # The oldest authenticated (format version 2) file: a plaintext or version 1 file
            # appearing after it was forged or copied in, as recovery rules at open.
            self.first_auth = 1 << 64
            for fid in log.file_ids():
                path = log.file_path(fid)
                got = self._read_header(path, fid)
                if got is None:
                    continue
                header, cipher = got
                if header.authenticated:
                    self.first_auth = min(self.first_auth, fid)
                end = log.file_end[fid]
                self.files[fid] = _FileState(self._dir_of(path), path, header, end, cipher, tags.get(fid))
            # New records in a directory have write-order ids above everything read so far
            # (with one directory, above the log's last id; with several, the scanner's
            # per-file floor is the file header's base id).
            single = len(self.data_dirs) == 1
            self.last_woid = [log.last_woid if single else 0 for _ in self.data_dirs]
            self.visible_end = log.next_position
        finally:
            log.close()
        # What recovery read of each directory's newest file may not be synced yet either.
        for d in range(len(self.data_dirs)):
            newest = max((f for f, st in self.files.items() if st.dir_index == d), default=None)
            if newest is not None:
                self._sync(self.files[newest].path)
        self.retired: set[int] = set()
        self.lock = threading.RLock()  # one reader may be shared by threads: refresh and lookups exclude each other
        self._first_woids: dict[int, int] = {}  # position after a gap -> its PUT record's write-order id

    def _dir_of(self, path: str) -> int:
        return self.data_dirs.index(os.path.dirname(path))

    # ScanContext for the scanner ------------------------------------------------------

    def report_corruption(self, report: CorruptionReport) -> None:
        key = (report.path, report.offset, report.reason)
        if key in self._reported:
            return  # damage at the tail of a live file is met again by every refresh: reported once
        self._reported.add(key)
        self.corruption.append(report)
        logger.error("on_corruption='skip': %s", report.describe())

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        """A partly written batch at the tail of a live file: not yet visible, not damage."""

    # following ---------------------------------------------------------------------------

    def _read_header(
        self, path: str, fid: int, newest: bool = False
    ) -> tuple[fmt.FileHeader, FileCipher | None] | None:
        """Read a data file's header and its cipher; None while the owner is still creating it (or it is gone).

        Raises:
            DecryptionError: The file is encrypted and this reader has no key, or the wrong one, for it.
        """
        try:
            fd = self.fs.open_read(path)
        except FileNotFoundError:
            return None
        try:
            # Most headers are short: the largest one (a list of live files) is read only when it is one.
            head = self.fs.pread(fd, HEADER_GUESS, 0)
            if len(head) == HEADER_GUESS and _cut_short(head):
                head = self.fs.pread(fd, fmt.MAX_HEADER_LEN, 0)
        finally:
            self.fs.close(fd)
        try:
            h = fmt.decode_file_header(head)
        except FormatError as exc:
            if newest:
                return None  # the owner may be writing it right now; a later call sees it whole
            raise CorruptLogError(path, exc.offset, f"data file header: {exc.reason}") from exc
        if not isinstance(h, fmt.FileHeader):
            return None  # being created: its header is not complete yet
        if h.channel_id != self.channel_id or h.file_id != fid:
            raise CorruptLogError(path, 16, "data file does not belong to this channel")
        return h, header_cipher(self.encryption, path, h, head, self.channel_id)

    def refresh(self) -> None:
        """Read what the owner appended since the last call (only files that changed)."""
        with self.lock:
            for i, d in enumerate(self.data_dirs):
                try:
                    names = tuple(sorted(n for n in self.fs.listdir(d) if SEG_RE.match(n)))
                except FileNotFoundError:
                    names = ()
                ids = [int(n[4:20], 16) for n in names]
                known = [f for f, st in self.files.items() if st.dir_index == i]
                newest = max(known, default=0)
                fresh = sorted(f for f in ids if f > newest and f not in self.retired)
                for fid in fresh:
                    path = os.path.join(d, segment_name(fid))
                    got = self._read_header(path, fid, newest=fid == fresh[-1])
                    if got is None:
                        break  # being created; the next call reads it
                    header, cipher = got
                    if header.authenticated:
                        self.first_auth = min(self.first_auth, fid)
                    elif fid > self.first_auth:
                        self._refuse_unauthenticated(path, fid, header)
                        continue
                    self.files[fid] = _FileState(i, path, header, header.header_len, cipher)
                    # Every record of this file and of later ones has a higher write-order id.
                    self.frontier[i] = max(self.frontier[i], header.base_woid - 1)
                # Only the newest file of a directory grows; the one before it may have
                # received its last batch before the roll. Older files are sealed.
                present = set(ids)
                for fid in sorted(f for f in self.files if self.files[f].dir_index == i and f >= newest):
                    st = self.files[fid]
                    size = self._size(st.path) if fid in present else None
                    if size is None or size <= st.end or self._nothing_new(st):
                        continue
                    self._scan(fid, st, size)

    def _refuse_unauthenticated(self, path: str, fid: int, header: fmt.FileHeader) -> None:
        """A plaintext or version 1 file newer than the channel's first authenticated one: never read.

        The owner of a channel that writes authenticated files never writes another
        kind (the rule recovery applies at open): the file was forged or copied in.

        Raises:
            CorruptLogError: With ``on_corruption="fail"``; in skip mode it is reported and ignored.
        """
        kind = "a plaintext" if not header.cipher else "an unauthenticated (format version 1)"
        reason = (
            f"{kind} data file newer than the channel's first authenticated one "
            f"({segment_name(self.first_auth)}): forged or copied in; move it out of the data directory"
        )
        if self.config.on_corruption != "skip":
            raise CorruptLogError(path, 8, reason)
        self.report_corruption(CorruptionReport(path, 0, f"{reason}; it is not read", 0, None, [], fid))
        self.retired.add(fid)  # never looked at again

    def _sync(self, path: str) -> None:
        try:
            fd = self.fs.open_read(path)
        except FileNotFoundError:
            return  # retired meanwhile: it held nothing this reader shows
        try:
            self.fs.fdatasync(fd)
        finally:
            self.fs.close(fd)

    def _nothing_new(self, st: _FileState) -> bool:
        """Whether the bytes after the last verified batch are still the writer's zero fill.

        The owner zero-fills its file ahead of the last write, so the size alone
        does not say whether anything was appended: the first bytes where the
        next record would start do (a record never starts with a zero byte).
        """
        try:
            fd = self.fs.open_read(st.path)
        except FileNotFoundError:
            return True
        try:
            head = self.fs.pread(fd, 8, st.end)
        finally:
            self.fs.close(fd)
        return not head.strip(b"\0")

    def _size(self, path: str) -> int | None:
        try:
            fd = self.fs.open_read(path)
        except FileNotFoundError:
            return None
        try:
            return self.fs.size(fd)
        finally:
            self.fs.close(fd)

    def _scan(self, fid: int, st: _FileState, size: int) -> None:
        # An authenticated file's new batches must chain to the last one read: the scan is
        # given the file's cipher and that batch's tag, so a batch forged or edited after
        # this reader opened (valid checksums, no valid tag) is refused, never applied.
        # Without a tag carried over (none read yet past the header), the 16 bytes before
        # ``end`` are the tag of the batch recovery verified there.
        auth = st.cipher if st.header.authenticated else None
        base = st.end
        if auth is not None and st.last_tag is None and st.end > st.header.header_len:
            base = st.end - fmt.BATCH_TAG_LEN
        fd = self.fs.open_read(st.path)
        try:
            buf = self.fs.pread(fd, size - base, base)
            prev = self.last_woid[st.dir_index]
            s = Scanner(self, st.path, fid, buf, st.header, base=base, auth=auth, prev_tag=st.last_tag).scan(
                True, prev, st.end
            )
            if s.records:
                # Show only what is durable: the owner may not have synced these bytes yet
                # (the moment between its write and its fdatasync, or fsync="interval"). An
                # event a power cut could still erase must never be read, let alone acked.
                self.fs.fdatasync(fd)
        finally:
            self.fs.close(fd)
        st.end = s.end
        if s.last_tag:
            st.last_tag = s.last_tag
        if s.records:
            self.last_woid[st.dir_index] = max(prev, s.last_woid)
            self.frontier[st.dir_index] = max(self.frontier[st.dir_index], s.last_woid)
            self._apply(s.plain())

    def file_end(self, file_id: int) -> int | None:
        """Where the records this reader has verified in data file ``file_id`` end (None: not a live file)."""
        st = self.files.get(file_id)
        return st.end if st is not None else None

    def locate(self, file_id: int, offset: int, lo: int, hi: int, want: int, event_bytes: int = 200) -> PutWalk:
        """The committed PUTs of ``[lo, hi)`` in data file ``file_id``, walked from ``offset`` (``scan.locate_puts``).

        Raises:
            FileNotFoundError: The file is gone (retired).
            CorruptLogError: The walk could not step over damage.
        """
        st = self.files.get(file_id)
        path = st.path if st is not None else os.path.join(self.data_dirs[0], segment_name(file_id))
        fd = self.fs.open_read(path)
        fs = self.fs
        try:
            return locate_puts(
                lambda n, at: fs.pread(fd, n, at),
                offset,
                lo,
                hi,
                want,
                fmt.file_seed(self.crc_kind, self.channel_id, file_id),
                self.crc_kind,
                self.max_payload,
                st is None or not st.header.cipher,
                event_bytes,
            )
        except FormatError as exc:  # pragma: no cover - the walk steps over damage
            raise CorruptLogError(path, exc.offset, exc.reason) from exc
        finally:
            fs.close(fd)

    def gap_is_final(self, run: Run) -> bool:
        """Whether the positions missing before ``run`` (after the run before it) can never be written.

        Positions and write-order ids are handed out together, in the same order,
        so a commit holding a missing position has write-order ids below those of
        the entry after the gap. Each data directory receives records in
        write-order: once every directory has durably shown one at or above the
        entry's, no commit with a missing position can still appear (a commit that
        failed after its positions were assigned, such as one refused for lack of
        space).
        """
        p = run.lo
        woid = self._first_woids.get(p)
        if woid is None:
            fid = run.fid
            st = self.files.get(fid)
            if st is None:
                return False
            try:
                off, size = self.index.first_pointer(run)
            except FileNotFoundError:
                return False
            if off == LOST:
                return False
            try:
                fd = self.fs.open_read(st.path)
            except FileNotFoundError:
                return False
            try:
                buf = self.fs.pread(fd, size, off)
            finally:
                self.fs.close(fd)
            try:
                rec = fmt.decode_record(
                    buf, 0, fmt.file_seed(self.crc_kind, self.channel_id, fid), self.crc_kind, 0xFFFF_FFFF
                )
            except FormatError:
                return False  # damaged: reading it reports that; the gap stays until then
            if not isinstance(rec, fmt.Record):
                return False
            woid = self._first_woids[p] = rec.woid
        return all(w >= woid for w in self.frontier)

    def _apply(self, records: list[LogRecord]) -> None:
        puts: dict[int, tuple[int, array[int], array[int]]] = {}
        takes: dict[int, list[tuple[int, int]]] = {}
        for r in records:
            if r.op == fmt.PUT:
                got = puts.get(r.txn_id)
                if got is None:
                    got = puts[r.txn_id] = (r.file_id, array("q"), array("q"))
                got[1].append(r.offset)
                got[2].append(r.size)
            elif r.op == fmt.TAKE:
                takes[r.txn_id] = fmt.decode_take(r.payload)
            elif r.op == fmt.COMMIT:
                first, n, _ = fmt.decode_commit(r.payload)
                mine = puts.pop(r.txn_id, None)
                if mine is not None and n:
                    self.index.add(first, mine[0], mine[1][:n], mine[2][:n])
                for a, c in takes.pop(r.txn_id, []):
                    self.index.remove(a, c)
                self.visible_end = max(self.visible_end, first + n)
            elif r.op == fmt.ROLLBACK:
                puts.pop(r.txn_id, None)
                takes.pop(r.txn_id, None)
            elif r.op == fmt.RETIRE:
                gone = fmt.decode_retire(r.payload)
                self.files.pop(gone, None)
                self.retired.add(gone)


class ChannelReader:
    """A read-only view of a channel, for any process, with durable acknowledgements.

    Args:
        directory: The channel directory.
        consumer: A consumer name (registered durably on first use; the owner
            takes an event once every registered consumer acknowledged it), or
            None for a view that registers nothing and cannot acknowledge.
        identity: A token recorded with the consumer (a query id, say); a
            different identity for the same name is refused unless ``reset``.
        reset: Replace a consumer's recorded identity (its acknowledged mark stays).
        on_corruption: ``"fail"`` (default) or ``"skip"`` for damaged events.
        encryption: For an encrypted channel: a :class:`~filechannel.Encryption`
            or the path of a keystore file (loaded when the reader is first
            used; a pickled reader carries the path, never key bytes).

    Raises:
        ConfigError: A bad consumer name or option (checked at once).
        DecryptionError: When first used: encrypted files and no key, or the wrong key.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        consumer: str | None = None,
        *,
        identity: str | None = None,
        reset: bool = False,
        on_corruption: str = "fail",
        fs: FS | None = None,
        encryption: Encryption | str | os.PathLike[str] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        if encryption is not None and not isinstance(encryption, Encryption):
            encryption = os.fspath(encryption)  # a keystore path: loaded when the reader is first used
        self.encryption: Encryption | str | None = encryption
        self.consumer = validate_name(consumer) if consumer is not None else None
        if identity is not None and not isinstance(identity, str):
            raise ConfigError("identity", f"must be a str, got {identity!r}")
        if on_corruption not in CORRUPTION_POLICIES:
            raise ConfigError("on_corruption", f"must be one of {CORRUPTION_POLICIES}, got {on_corruption!r}")
        self.identity = identity
        self.reset = reset
        self.on_corruption = on_corruption
        self._fs = fs or DEFAULT_FS
        self._follower: _Follower | None = None
        self._acked: int | None = None
        self._cursor: int | None = None  # where poll() goes on
        self._closed = False

    # pickling: arguments only; everything else reopens lazily ------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_follower"] = None
        state["_fs"] = None if self._fs is DEFAULT_FS else self._fs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._fs is None:
            self._fs = DEFAULT_FS

    def _state(self) -> _Follower:
        if self._closed:
            raise ChannelError("the reader is closed")
        f = self._follower
        if f is None:
            for attempt in range(3):
                try:
                    f = _Follower(self)
                    break
                except FileNotFoundError:
                    # The owner retired a file while this reader was loading: load again.
                    if attempt == 2:
                        raise
            assert f is not None
            self._follower = f
            if self.consumer is not None:
                store = ConsumerStore(self._fs, self.directory, None, f.meta_mac, f.macs_required, f.consumer_acks)
                start = f.index.head()
                st = store.register(
                    self.consumer, self.identity, f.visible_end if start is None else start, reset=self.reset
                )
                self._acked = st.acked
        return f

    # the API --------------------------------------------------------------------------------

    @property
    def acked(self) -> int | None:
        """This consumer's acknowledged mark (every position below it is done), or None for a view."""
        if self.consumer is None:
            return None
        self._state()
        return self._acked

    def _start(self, f: _Follower) -> int:
        if self._acked is not None:
            return self._acked
        head = f.index.head()
        return f.visible_end if head is None else head

    def available(self) -> tuple[int, int]:
        """Return ``[start, end)``: the positions committed and not yet acknowledged by this consumer.

        Cheap on a quiet channel: it lists the data directories and reads only
        bytes appended since the last call.

        Raises:
            CorruptLogError: Damage found in newly written data (``on_corruption="fail"``).
        """
        f = self._state()
        f.refresh()
        start = self._start(f)
        end = f.visible_end
        if len(f.data_dirs) > 1:
            # With several data directories a later position can be visible before an
            # earlier one is written: stop at the first position not yet seen, unless
            # nothing can fill it any more (a failed commit's positions).
            with f.lock:
                expect = start
                for r in f.index.overlapping(start, end):
                    if max(r.lo, start) != expect and not f.gap_is_final(r):
                        break
                    expect = min(r.hi, end)
                end = expect
        return start, max(start, end)

    def poll(self, max_events: int = 1000, timeout: float = 0.0) -> list[Event]:
        """Return the next events, up to ``max_events``, waiting up to ``timeout`` seconds for one.

        Like a Kafka consumer's ``poll``: the first call starts at this consumer's
        acknowledged mark (a view: at the oldest event held); each call goes on
        after the last event the previous one returned, whether or not it was
        acknowledged. Acknowledge with :meth:`ack` (``events[-1].position + 1``);
        a new reader after a crash starts again at the mark. An empty list means
        nothing was committed within ``timeout``.

        Raises:
            ValueError: ``max_events`` is not a positive int, or ``timeout`` is negative.
            CorruptLogError: Damage found (``on_corruption="fail"``).
        """
        if type(max_events) is not int or max_events <= 0:
            raise ValueError(f"max_events must be a positive int, got {max_events!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            start, end = self.available()
            cursor = self._cursor if self._cursor is not None else start
            cursor = max(cursor, start)  # below start: acknowledged here, or taken by the owner (a view)
            if cursor < end:
                events = self.read(cursor, min(end, cursor + max_events))
                if events:
                    last = events[-1].position
                    assert last is not None
                    self._cursor = last + 1
                    return events
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)

    def read(self, start: int, end: int, limit: int | None = None) -> list[Event]:
        """Return the committed events with positions in ``[start, end)``, in order.

        The same call returns the same events after a crash or restart of
        either process. Positions the channel never held (a failed commit's) are
        simply absent.

        Raises:
            TypeError: ``start``, ``end`` or ``limit`` is not an int (a float too).
            ValueError: ``start`` or ``end`` is negative, ``end`` below ``start``, or
                ``limit`` not positive.
            DataLossError: ``start`` is below this consumer's acknowledged mark (or
                below what the channel still holds), or ``end`` is beyond what it holds.
            CorruptLogError: An event's record is damaged (``on_corruption="fail"``).
        """
        _check_range(start, end)
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool):
                raise TypeError(f"limit must be an int or None, got {type(limit).__name__} {limit!r}")
            if limit <= 0:
                raise ValueError(f"limit must be a positive int, got {limit!r}")
        f = self._state()
        if end > f.visible_end:
            f.refresh()
        self._check_held(f, start, end)
        out: list[Event] = []
        for attempt in range(2):
            try:
                with f.lock:
                    out = self._read_entries(f, start, end, limit)
                break
            except FileNotFoundError:
                if attempt:
                    raise DataLossError(start, end, "a data file was retired while it was read") from None
                f.refresh()
                self._check_held(f, start, end)
        return out

    def _check_held(self, f: _Follower, start: int, end: int) -> None:
        if end > f.visible_end:
            raise DataLossError(
                f.visible_end,
                end,
                f"the channel holds positions below {f.visible_end} only (restored from an older copy?)",
            )
        low = self._start(f) if self._acked is not None else f.index.head()
        if low is not None and start < low and start < end:
            why = "below this consumer's acknowledged mark" if self._acked is not None else "already taken"
            raise DataLossError(start, min(end, low), f"positions {why}")

    def _read_entries(self, f: _Follower, start: int, end: int, limit: int | None) -> list[Event]:
        pos_c, fid_c, off_c, size_c = f.index.columns(start, end, limit)
        out: list[Event] = []
        fds: dict[int, int] = {}
        seeds: dict[int, int] = {}
        try:
            for p, fid, off, size in zip(pos_c, fid_c, off_c, size_c, strict=True):
                st = f.files.get(fid)
                path = st.path if st is not None else os.path.join(f.data_dirs[0], segment_name(fid))
                fd = fds.get(fid)
                if fd is None:
                    fd = fds[fid] = self._fs.open_read(path)
                    seeds[fid] = fmt.file_seed(f.crc_kind, f.channel_id, fid)
                seed = seeds[fid]
                try:
                    if off == LOST:  # the queue's walk found no record for it (scan.committed_puts): damage
                        raise CorruptLogError(path, 0, "the queued event's record is missing: no record found for it")
                    buf = self._fs.pread(fd, size, off)
                    cipher = st.cipher if st is not None else None
                    if cipher is None and st is not None and st.header.cipher:
                        raise DecryptionError(
                            path, off, "the data file is encrypted: no cipher for it", st.header.key_id
                        )
                    out.append(_decode_put(buf, 0, size, seed, f.crc_kind, path, off, p, cipher))
                except CorruptLogError as exc:
                    if self.on_corruption != "skip":
                        raise
                    f.report_corruption(
                        CorruptionReport(exc.path, exc.offset, exc.reason, 0, lost_positions=[(p, p + 1)], file_id=fid)
                    )
        finally:
            for fd in fds.values():
                self._fs.close(fd)
        return out

    def record_bytes(self, starts: Sequence[int], end: int) -> list[int]:
        """For each position in ``starts``: the bytes of the events in ``[start, end)`` (depth, a lag).

        ``end`` is what :meth:`available` said (at most the visible end). What
        the number is: the exact sum of the events' record sizes (the same as
        ``filechannel stat``'s ``lag_bytes``) wherever this reader knows the
        records, that is for events it followed as the owner wrote them and in
        the parts of the queue its reads have walked; for a part it has not
        read yet (events the owner's queue held when the reader opened), the
        bytes of the data file that part spans (from its first record, or the
        furthest point a walk reached, to the next part's first record in the
        same file or the end of what was written to the file): the bytes a
        consumer still has to read, which also count the few records between
        the events that are not events (COMMITs, TAKEs), so a little more than
        the exact sum (about 0.1% with transactions of a thousand 100 B
        events). A start inside such a part is placed as if its events were of
        equal size. No I/O grows with the depth: a data file is read only to
        reach a start or ``end`` within a few thousand events of where a walk
        passed (``_readindex.MARK_EVERY``).

        Raises:
            ValueError: ``end`` beyond what this reader has seen.
        """
        f = self._state()
        if end > f.visible_end:
            raise ValueError(f"end {end} is beyond the visible end {f.visible_end}")
        lo = min(starts, default=end)
        return self._walking(f, lo, end, lambda: f.index.record_bytes_many(starts, end), check=False)

    def _walking(self, f: _Follower, start: int, end: int, work: Callable[[], _T], check: bool = True) -> _T:
        """Run ``work`` (which walks data files) under the reader's lock; a file retired meanwhile: refresh, once.

        Raises:
            DataLossError: A data file is gone even after a refresh (or, with ``check``, as :meth:`_check_held`).
        """
        for attempt in range(2):
            try:
                with f.lock:
                    if check:
                        self._check_held(f, start, end)
                    return work()
            except FileNotFoundError:
                if attempt:
                    raise DataLossError(start, end, "a data file was retired while it was read") from None
                f.refresh()  # the RETIRE and the takes before it: the runs that pointed there are gone
        raise AssertionError("unreachable")  # pragma: no cover

    def segments(
        self, start: int, end: int, max_bytes: int = DEFAULT_SEGMENT_BYTES, *, parts: int = 1, min_bytes: int = 0
    ) -> list[Segment]:
        """Describe where the events of ``[start, end)`` lie, for :func:`read_segment` in other processes.

        Each segment covers consecutive events of one data file whose bytes
        span at most ``max_bytes`` (a single larger event gets a segment alone).
        With ``parts`` > 1 the range is also cut into about ``parts`` runs of
        equal event bytes (fewer if a run would hold under ``min_bytes``), so
        ``parts`` workers get about one segment each; a run still splits at
        data files and at ``max_bytes``. The result depends only on the range,
        the arguments and where the events lie: the same call plans the same
        segments.

        Raises:
            TypeError: ``start``, ``end``, ``max_bytes``, ``parts`` or ``min_bytes`` is not an int.
            ValueError: As for :meth:`read`, or ``max_bytes`` or ``parts`` not positive, or ``min_bytes`` negative.
            DataLossError: As for :meth:`read`.
        """
        _check_range(start, end)
        for name, value, least in (("max_bytes", max_bytes, 1), ("parts", parts, 1), ("min_bytes", min_bytes, 0)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        f = self._state()
        if end > f.visible_end:
            f.refresh()
        return self._walking(f, start, end, lambda: self._segments(f, start, end, max_bytes, parts, min_bytes))

    def _segments(
        self, f: _Follower, start: int, end: int, max_bytes: int, parts: int = 1, min_bytes: int = 0
    ) -> list[Segment]:
        pos_c, fid_c, off_c, size_c = f.index.columns(start, end)
        i, j = 0, len(pos_c)
        out: list[Segment] = []
        total = sum(size_c) if parts > 1 else 0
        if min_bytes > 0:
            parts = min(parts, total // min_bytes)
        parts = max(1, min(parts, j - i))
        before = (
            0  # event bytes of [i, k): run r holds the events whose bytes before them are in [r, r+1) * total/parts
        )
        k = i
        while k < j:
            fid = fid_c[k]
            first_off = off_c[k]
            run = before * parts // total if parts > 1 else 0
            before += size_c[k]
            m = k + 1
            while m < j and fid_c[m] == fid and off_c[m] > off_c[m - 1]:
                if off_c[m] + size_c[m] - first_off > max_bytes:
                    break
                if parts > 1 and before * parts // total != run:
                    break
                before += size_c[m]
                m += 1
            last = m - 1
            st = f.files.get(fid)
            path = st.path if st is not None else os.path.join(f.data_dirs[0], segment_name(fid))
            h = st.header if st is not None else None
            out.append(
                Segment(
                    path,
                    fid,
                    f.channel_id,
                    f.crc_kind,
                    first_off,
                    off_c[last] + size_c[last] - first_off,
                    tuple(pos_c[k:m]),
                    tuple(o - first_off for o in off_c[k:m]),
                    tuple(size_c[k:m]),
                    h.cipher if h is not None else 0,
                    h.key_id if h is not None else "",
                    h.salt if h is not None else b"",
                )
            )
            k = m
        return out

    def ack(self, end: int) -> int:
        """Record durably that this consumer has processed every position below ``end``.

        Idempotent; an ``end`` at or below the last acknowledgement is ignored.
        The owning channel turns acknowledgements into committed takes.

        Returns:
            The acknowledged mark after the call.

        Raises:
            TypeError: ``end`` is not an int (``"3"``, ``3.0`` and ``True`` are refused).
            ValueError: ``end`` is negative.
            AckRangeError: ``end`` is beyond what the channel has committed (a
                ``ValueError``; nothing is acknowledged).
            ChannelError: This reader is a view (``consumer=None``).
            ConsumerIdentityError: Another identity took over this consumer name.
        """
        if self.consumer is None:
            raise ChannelError("a ChannelReader without a consumer name is a view and cannot acknowledge")
        if not isinstance(end, int) or isinstance(end, bool):
            raise TypeError(f"end must be an int, got {type(end).__name__} {end!r}")
        if end < 0:
            raise ValueError(f"end must be a position >= 0, got {end}")
        f = self._state()
        assert self._acked is not None
        if end <= self._acked:
            return self._acked
        if end > f.visible_end:
            f.refresh()
            if end > f.visible_end:
                raise AckRangeError(end, f.visible_end)
        self._acked = ConsumerStore(self._fs, self.directory, None, f.meta_mac, f.macs_required, f.consumer_acks).ack(
            self.consumer, self.identity, end
        )
        return self._acked

    @property
    def corruption(self) -> list[CorruptionReport]:
        """Damage this reader met (with ``on_corruption="skip"``), as reports."""
        return list(self._follower.corruption) if self._follower is not None else []

    def close(self) -> None:
        """Forget the loaded state (nothing to flush: acknowledgements are durable when ack returns)."""
        self._follower = None
        self._closed = True

    def __enter__(self) -> ChannelReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ChannelReader {self.directory!r} consumer={self.consumer!r}>"

    # the Arrow API (filechannel.arrow; needs pyarrow) -------------------------------------------

    def read_arrow(self, start: int, end: int) -> Any:
        """Return the committed events of ``[start, end)`` as one ``pyarrow.RecordBatch``.

        Columns ``position int64, body binary, headers map<string, string>``: the
        events :meth:`read` returns, decoded in C straight into Arrow buffers
        (no Python object per event). Needs pyarrow.

        Raises:
            DataLossError, CorruptLogError, DecryptionError: As for :meth:`read`.
            ArrowTextError: A header holds an encoded lone surrogate (old records only).
        """
        return _read_arrow(self, start, end)

    @staticmethod
    def read_segment_arrow(segment: Segment, encryption: Encryption | str | None = None) -> Any:
        """:func:`filechannel.arrow.read_segment_arrow`: a :class:`Segment` as one ``pyarrow.RecordBatch``."""
        from .arrow import read_segment_arrow

        return read_segment_arrow(segment, encryption)


def _cut_short(head: bytes) -> bool:
    """Whether ``head`` holds only the start of a longer data file header."""
    try:
        return fmt.decode_file_header(head) is fmt.INCOMPLETE
    except FormatError:
        return False


def _check_range(start: int, end: int) -> None:
    for name, v in (("start", start), ("end", end)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int position, got {type(v).__name__} {v!r}")
        if v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if end < start:
        raise ValueError(f"end {end} is below start {start}")


# -- additions for the agent (filechannel.agent): a segment's bytes from elsewhere ------------------


class _OneBuffer:
    """A read-only stand-in for the ``fs`` seam holding one segment's bytes (see :func:`decode_segment`)."""

    def __init__(self, segment: Segment, data: bytes) -> None:
        self._segment = segment
        self._data = data

    def open_read(self, path: str) -> int:
        return 0

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        if n != len(self._data) or offset != self._segment.offset:
            raise CorruptLogError(self._segment.path, offset, f"asked for {n} bytes, the segment has {len(self._data)}")
        return self._data

    def close(self, fd: int) -> None:
        return None


def decode_segment(
    segment: Segment, data: bytes, *, encryption: Encryption | str | os.PathLike[str] | None = None
) -> list[Event]:
    """Decode the events of ``segment`` from its raw bytes ``data`` (received from an agent, say).

    ``data`` must be the ``segment.length`` bytes of the data file at
    ``segment.offset``. The bytes go through :func:`read_segment` itself, so
    every record is checked exactly as a local read checks it: its checksum
    (seeded with the channel id and file id the segment names), its size and
    kind, and for an encrypted file its authentication tag (``encryption``: a
    :class:`~filechannel.Encryption` or a keystore path).

    Raises:
        CorruptLogError: ``data`` is not ``segment.length`` bytes, or a record does not verify.
        DecryptionError: No key for an encrypted segment, or a record whose tag fails.
    """
    if len(data) != segment.length:
        raise CorruptLogError(
            segment.path, segment.offset, f"the segment is {segment.length} bytes, {len(data)} were received"
        )
    shim: Any = _OneBuffer(segment, data)
    enc = os.fspath(encryption) if isinstance(encryption, os.PathLike) else encryption
    return read_segment(segment, fs=shim, encryption=enc)


def channel_id_of(directory: str | os.PathLike[str], *, fs: FS | None = None) -> bytes:
    """Return the id of the channel in ``directory``, read from its ``CHANNEL`` file (no lock, no replay).

    Raises:
        NotAChannelError: ``directory`` is missing or is not a channel directory.
        CorruptLogError: The ``CHANNEL`` file does not decode.
    """
    from ._fs import read_file
    from .directory import CHANNEL_FILE, decode_channel_file
    from .errors import NotAChannelError

    fs = fs or DEFAULT_FS
    path = os.fspath(directory)
    if not os.path.isdir(path):
        raise NotAChannelError(path, "no such directory" if not os.path.exists(path) else "not a directory")
    chan = os.path.join(path, CHANNEL_FILE)
    try:
        data = read_file(fs, chan)
    except FileNotFoundError:
        raise NotAChannelError(path, "no CHANNEL file (create a channel with filechannel.open)") from None
    try:
        return decode_channel_file(data)[0]
    except FormatError as exc:
        raise CorruptLogError(chan, exc.offset, exc.reason) from exc


# -- the Arrow API's planning (filechannel.arrow decodes; needs pyarrow) ----------------------------


def _plan_arrow(reader: ChannelReader, start: int, end: int) -> list[Any]:
    """The runs of ``[start, end)`` (``arrow.Run``), from the reader's index columns (no Python per event)."""
    from . import arrow
    from .arrow import Run

    pa = arrow._pa()
    pc = arrow._pc()
    _check_range(start, end)
    f = reader._state()
    if end > f.visible_end:
        f.refresh()
    with f.lock:
        reader._check_held(f, start, end)
        try:
            pos, fid, off, size = f.index.columns(start, end)
        except FileNotFoundError:  # retired meanwhile: read() refreshes and says what is gone
            raise DataLossError(start, end, "a data file was retired while it was read") from None
        files = dict(f.files)
        data_dir = f.data_dirs[0]
        channel_id, crc_kind = f.channel_id, f.crc_kind
    n = len(pos)
    if not n:
        return []

    def col(a: array[int]) -> Any:
        return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(a)])

    fa, oa = col(fid), col(off)
    starts = [0]
    if n > 1:  # a new run where the file changes or the offsets stop ascending
        brk = pc.or_(pc.not_equal(fa.slice(1), fa.slice(0, n - 1)), pc.less_equal(oa.slice(1), oa.slice(0, n - 1)))
        starts += [k + 1 for k in pc.indices_nonzero(brk).to_pylist()]
    starts.append(n)
    ends = array("q")
    ends.frombytes(pc.add(oa, col(size)).buffers()[1].to_pybytes()[: 8 * n])  # each record's end
    runs: list[Run] = []
    for a, b in pairwise(starts):
        file_id = fid[a]
        st = files.get(file_id)
        if st is not None and st.header.cipher and st.cipher is None:
            raise arrow.Fallback
        path = st.path if st is not None else os.path.join(data_dir, segment_name(file_id))
        k = a
        while k < b:  # at most arrow.READ_SEGMENT_BYTES per pread (a larger record alone)
            first = off[k]
            m = max(k + 1, bisect_right(ends, first + arrow.READ_SEGMENT_BYTES, k + 1, b))
            rel = array("q")
            rel.frombytes(pc.subtract(col(off).slice(k, m - k), first).buffers()[1].to_pybytes()[: 8 * (m - k)])
            runs.append(
                Run(
                    path,
                    file_id,
                    channel_id,
                    crc_kind,
                    first,
                    ends[m - 1] - first,
                    pos[k:m].tobytes(),
                    rel.tobytes(),
                    size[k:m].tobytes(),
                    st.cipher if st is not None else None,
                )
            )
            k = m
    return runs


def _read_arrow(reader: ChannelReader, start: int, end: int) -> Any:
    """``ChannelReader.read_arrow``: the committed events of ``[start, end)`` as one ``pyarrow.RecordBatch``.

    The same events as ``reader.read(start, end)``, in the columns of
    :func:`read_segment_arrow`: each run of events in one data file is read
    with one ``pread`` per 64 MiB, every record checked, and all of them
    decoded in one pass into one set of buffers. A range holding damage under
    ``on_corruption="skip"``, or a data file retired meanwhile, goes through
    ``read()`` instead, which drops and reports exactly the damaged events (or
    raises as it does).
    """
    from . import arrow

    try:
        return arrow.read_runs(_plan_arrow(reader, start, end), reader._fs)
    except (CorruptLogError, DataLossError, arrow.Fallback) as exc:
        if isinstance(exc, CorruptLogError) and reader.on_corruption != "skip":
            raise
    return arrow.events_to_batch(reader.read(start, end))
