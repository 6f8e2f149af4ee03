"""The channel directory: identity, data directories, locks, recovery, retention.

``Log`` owns the channel directory's files and the decisions about them: the
``CHANNEL`` identity file, ``DATA_DIRS`` and each data directory's ``DATADIR``
identity, the locks, the global write-order id (woid) and position counters,
recovery (which checkpoint to trust, which files belong to the channel, what
to truncate or set aside, how damage follows ``on_corruption``), the records
recovery keeps for replay, and the retirement of data files. It knows nothing
of queues or capacity: ``channel.py`` builds those from the records it
replays.

Reading a data file is ``scan.py``'s job (one read-only parser, shared by
recovery, ``verify`` and readers); appending is ``writer.py``'s (group commit,
fsync policy, rolling files). Every durability syscall goes through ``_fs``.

Recovery (see docs/format.md and docs/design.md): the newest checkpoint that
decodes vouches for the length of every live file and for every queued event.
Only records covered by a verified BATCH_END count; in the newest data file
of a directory, damage with nothing verified after it and beyond what a
checkpoint vouched for is a torn tail: it is copied aside and truncated. Any
other damage is corruption of acknowledged data and raises
``CorruptLogError`` (or, with ``on_corruption="skip"``, is skipped and
reported exactly).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import operator
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from . import format as fmt
from ._fs import DEFAULT_FS, FS, read_file, replace_durably, truncate_durably
from .checkpoint import CheckpointStore, Snapshot, StoredCheckpoint
from .config import ChannelConfig
from .crypto import SEALED_WITHOUT_KEY, TAMPERED, FileCipher, header_cipher
from .errors import (
    ChannelClosedError,
    ChannelCopyError,
    ChannelLockedError,
    ConfigError,
    CorruptLogError,
    DecryptionError,
    DiskSpaceError,
    EventFormatError,
    FormatError,
    NotAChannelError,
)
from .scan import (
    INF_WOID,
    SEG_RE,
    CorruptionReport,
    FileScan,
    LogRecord,
    PutRun,
    Scanner,
    ScanRecord,
    all_zero,
    expand_runs,
    find_verified_batch_end,
    format_ranges,
    merge_ranges,
    ranges_of,
    segment_name,
)
from .writer import PREALLOC_STEP, CommitResult, Item, RollbackItem, Writer

__all__ = [
    "INF_WOID",
    "PREALLOC_STEP",
    "CommitResult",
    "CorruptionReport",
    "Log",
    "LogRecord",
    "PutRun",
    "ScanRecord",
    "decode_channel_file",
    "encode_channel_file",
    "format_ranges",
    "merge_ranges",
    "ranges_of",
    "segment_name",
]

logger = logging.getLogger(__name__)

CHANNEL_FILE = "CHANNEL"
DATA_DIRS_FILE = "DATA_DIRS"
DATA_DIR_ID_FILE = "DATADIR"
LOCK_FILE = "LOCK"
WAL_FILE = "WAL"  # marks a write-ahead log directory (filechannel.WriteAheadLog), written before CHANNEL
_WAL_MARK = b"filechannel write-ahead log\n"
DEFAULT_DATA_DIR = "data"
# Log.read_events reads adjacent records with one pread, up to this many bytes at a time.
_RUN_BYTES = 4 << 20
_CHANNEL_MAGIC = b"FCCHANNL"
_CHANNEL_FMT = struct.Struct("<8sHH16sQ")
_U32 = struct.Struct("<I")
_DATA_DIR_HINT = (
    "mount or restore it at this path (a backup restores the whole channel directory); "
    "to accept the loss of its events, open with on_corruption='skip' (every lost position is reported)"
)
_MISSING_HINT = (
    "restore the file or mount its disk; to accept the loss, open with on_corruption='skip' "
    "(every lost position is reported)"
)
_SPACE_REFRESH_S = 1.0
_TXN_ID = operator.attrgetter("txn_id")
_OP = operator.attrgetter("op")
_COMMIT_OR_RETIRE = frozenset((fmt.COMMIT, fmt.RETIRE)).__contains__


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
# the log


_Newest = tuple[int, "frozenset[int] | None"]
"""A data directory's newest file id and its header's live list (None: the header is damaged)."""


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
        progress: Called with a short message as recovery reads each data file.
        wal: Open (or create) a write-ahead log's directory instead of a channel's;
            each refuses the other's.

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
        progress: Callable[[str], None] | None = None,
        keyless_ok: bool = False,
        wal: bool = False,
    ) -> None:
        self.directory = os.fspath(directory)
        self.wal = wal  # a write-ahead log's directory (marked by a WAL file), not a channel's
        self.checkpoints = checkpoints
        self._progress = progress
        self.base_snapshot: Snapshot | None = None
        self.recovered_from: StoredCheckpoint | None = None
        self.checkpoint_fallbacks: list[str] = []
        self._retire_lock = threading.Lock()
        self._woid_floor = 0
        self._closing = False
        self._file_end: dict[int, int] = {}
        self.file_sizes: dict[int, int] = {}  # data file sizes found at open (recovery's view)
        self.config = config or ChannelConfig()
        # A read-only inspection (stat, verify, dump without a key) may meet encrypted files it cannot decrypt.
        self.keyless_ok = keyless_ok
        self.seal_overhead = fmt.ENC_TAG_LEN if self.config.encryption is not None else 0
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
        # Encrypted data files: their cipher, or why their PUT payloads cannot be read.
        self._ciphers: dict[int, FileCipher] = {}
        self._undecryptable: dict[int, str] = {}
        self._headerless: dict[int, str] = {}  # file id -> why its sealed records cannot be opened
        self._key_ids: dict[int, str] = {}  # file id -> key id, for every encrypted live file
        self._read_fds: dict[int, int] = {}
        self._scans: list[FileScan] = []
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
        self._writers: list[Writer] = []
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
        is_wal = fs.exists(os.path.join(top, WAL_FILE))
        if is_wal and not self.wal:
            raise NotAChannelError(top, "it is a write-ahead log; open it with filechannel.WriteAheadLog")
        if self.wal and not is_wal:
            raise NotAChannelError(top, "it is a channel, not a write-ahead log; open it with filechannel.open")
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
            has_segs = fs.exists(d) and any(SEG_RE.match(n) for n in fs.listdir(d))
            if not fs.exists(d) or (not fs.exists(ident_path) and not has_segs and not self._legacy_dirs):
                what = "missing" if not fs.exists(d) else "empty (no identity file, no data files)"
                reason = f"data directory is {what}: moved, deleted, or its disk is not mounted"
                if self.config.on_corruption != "skip":
                    raise CorruptLogError(d, 0, reason, _DATA_DIR_HINT)
                self.report_corruption(CorruptionReport(d, 0, reason, 0))
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
        replace_durably(fs, tmp, path, data)

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
        leftovers = {
            LOCK_FILE,
            CHANNEL_FILE + ".tmp",
            DATA_DIRS_FILE,
            DATA_DIRS_FILE + ".tmp",
            WAL_FILE,
            WAL_FILE + ".tmp",
        }
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
            if fs.exists(d) and any(SEG_RE.match(n) for n in fs.listdir(d)):
                raise NotAChannelError(top, f"no CHANNEL file, but data directory {d} holds data files of some channel")
        # Where the data lives is recorded first, so every later open finds it;
        # CHANNEL is written last: its presence marks a complete creation.
        self.channel_id = uuid.uuid4().bytes
        wal_path = os.path.join(top, WAL_FILE)
        if self.wal:
            self._write_small_file(wal_path, _WAL_MARK)
        elif fs.exists(wal_path):
            fs.unlink(wal_path)  # left by an interrupted creation of a write-ahead log
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
            if store is None:  # pragma: no cover - found is empty without a store
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
        self._ciphers.clear()
        self._undecryptable.clear()
        self._headerless.clear()
        self._key_ids.clear()
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
        scans: list[FileScan] = []
        live_by_dir: list[list[int]] = []
        max_next_pos = 0
        max_txn = 0
        max_woid = 0
        max_file_id = 0
        newest_by_dir: dict[int, _Newest] = {}
        retired: set[int] = set()
        for index, d in enumerate(self.data_dirs):
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
        self._writers = [Writer(self, i, d, live_by_dir[i]) for i, d in enumerate(self.data_dirs)]

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
        voucher = self.voucher
        assert voucher is not None
        gone = set(voucher.files) - set(self._files) - self.discarded
        for fid in sorted(gone):
            index = voucher.file_dirs.get(fid)
            if index is not None and index < len(self.data_dirs):
                judges = [newest_by_dir[index]] if index in newest_by_dir else []
            else:
                index = None
                judges = list(newest_by_dir.values())
            listed = not self._dir_lost and any(fid < n and live is not None and fid not in live for n, live in judges)
            if fid in retired or listed:
                self.retired_files.add(fid)
                continue
            path = os.path.join(self.data_dirs[index or 0], segment_name(fid))
            reason = "data file is missing, but the newest checkpoint lists it as live"
            if self.config.on_corruption != "skip":
                raise CorruptLogError(path, 0, reason, _MISSING_HINT)
            self.missing_files.add(fid)
            span = (voucher.woid, INF_WOID)
            self.report_corruption(CorruptionReport(path, 0, reason, 0, span, file_id=fid))

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
    ) -> tuple[list[FileScan], int, tuple[int, frozenset[int] | None] | None, set[int]]:
        """Recover one data directory.

        Returns its scans, the highest file id seen, ``(newest file id, its live
        list or None when its header is damaged)`` and the file ids its newest
        file's RETIRE records name.
        """
        fs = self.fs
        if not fs.exists(d):
            return [], 0, None, set()
        ids = sorted(int(m.group(1), 16) for n in fs.listdir(d) if (m := SEG_RE.match(n)))
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
        nscan = Scanner(self, npath, newest, nbuf, nh).scan(True, 0, nstart, floor, self._vouched(newest), compact=True)
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
                    Scanner(self, path, fid, buf, h)._truncated(size, vouched, s.last_woid)
            else:
                s = Scanner(self, path, fid, buf, h).scan(False, prev_woid, start, floor, vouched, compact=True)
            s.header_damaged = damaged
            buf = b""  # not two whole files in memory at once while the next one is read
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
        # Only a torn tail (past what the checkpoint vouched for) is cut off. An end below
        # that means skip mode salvaged records from damaged, acknowledged bytes up to the
        # end of the file: they stay (replay points into them; writes go to a new file).
        if nscan.end < nscan.size and not self.readonly and nscan.end >= self._vouched(newest):
            self._truncate_tail(npath, nscan.end, nbuf)
        scans.append(nscan)
        for fid in missing:
            # What the file held lies between the files around it, in write-order ids.
            lo = max((s.last_woid for s in scans if s.file_id < fid), default=0)
            hi = min((s.header.base_woid for s in scans if s.file_id > fid and not s.header_damaged), default=INF_WOID)
            path = os.path.join(d, segment_name(fid))
            reason = "data file is missing, but the newest data file lists it as live"
            self.missing_files.add(fid)
            self.report_corruption(CorruptionReport(path, 0, reason, 0, (lo, hi), file_id=fid))
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
            self.report_corruption(
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
            # The salt went with the header: an encrypted file's events cannot be decrypted.
            # Each record says whether it was sealed, so a plaintext file's (a mixed history)
            # are still read, and a sealed one is never decoded as plaintext.
            self._headerless[fid] = "the data file header is damaged: its encrypted events cannot be decrypted"
            return stand_in, first
        assert isinstance(h, fmt.FileHeader)
        if h.channel_id != self.channel_id:
            raise CorruptLogError(path, 16, "data file belongs to another channel; move it out of this directory")
        if h.file_id != fid:
            raise CorruptLogError(path, 32, f"header says file id {h.file_id}, but the name says {fid}")
        if h.crc_kind != self.crc_kind:
            raise CorruptLogError(path, 12, "checksum algorithm differs from the channel's")
        self._setup_cipher(path, fid, h, buf)
        return h, None

    def _setup_cipher(self, path: str, fid: int, h: fmt.FileHeader, buf: bytes | memoryview) -> None:
        """Check an encrypted file's key (at open) and keep its cipher for reads.

        Raises:
            DecryptionError: The file is encrypted and no key, or the wrong key, is given
                (a read-only inspection without a key only notes it: checksums need no key).
        """
        self._ciphers.pop(fid, None)
        self._undecryptable.pop(fid, None)
        self._key_ids.pop(fid, None)
        if not h.cipher:
            return
        self._key_ids[fid] = h.key_id
        if self.config.encryption is None and self.readonly and self.keyless_ok:
            self._undecryptable[fid] = (
                f"data file is encrypted (key id {h.key_id!r}), but the channel was opened without encryption="
            )
            return
        cipher = header_cipher(self.config.encryption, path, h, buf, self.channel_id)
        assert cipher is not None
        self._ciphers[fid] = cipher

    def key_ids_in_use(self) -> list[str]:
        """The key ids of the live encrypted data files (a key may be dropped once its id is gone)."""
        return sorted(set(self._key_ids.values()))

    def cipher_of(self, file_id: int) -> FileCipher | None:
        """The cipher of an encrypted data file this log can decrypt, else None."""
        return self._ciphers.get(file_id)

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
        return find_verified_batch_end(buf, 0, seed, self.crc_kind, self.max_payload) is None

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
        if not all_zero(buf, end):
            self._set_aside(path, buf, end)
        truncate_durably(fs, path, end)
        fs.fsync_dir(os.path.dirname(path))

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        """Record a torn, unacknowledged tail (one WARNING; it is truncated on a writable open)."""
        self.torn_tails.append((path, start, size - start))
        logger.warning(
            "%s: torn tail of %d bytes from byte %d (%s)%s",
            path,
            size - start,
            start,
            reason,
            "" if self.readonly else "; truncated, a copy is kept beside it",
        )

    def report_corruption(self, report: CorruptionReport) -> None:
        """Record damage that ``on_corruption="skip"`` stepped over (an ERROR, and ``stats()``)."""
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
        return expand_runs(self.replay_runs())

    def release_recovery_state(self) -> None:
        """Drop what only recovery and replay use: the vouching checkpoint and the base snapshot.

        Replay calls this when it is done (``voucher_path`` stays, for messages).
        A queue built from the base snapshot shares its columns, so this frees
        only what nothing else holds.
        """
        self.voucher = None
        self.base_snapshot = None
        self._scans = []

    def replay_runs(self) -> Iterator[ScanRecord]:
        """Like :meth:`replay`, but the PUTs of each verified batch come as :class:`PutRun` s.

        Recovery kept them compactly (two int64 columns per data file, one run
        per stretch of a transaction's PUTs): no object per PUT. A run's ``woid``
        is its first PUT's, and no other record's write-order id falls inside a
        run, so the stream stays ordered. Salvaged PUTs are records, as in :meth:`replay`.
        """
        scans, self._scans = self._scans, []
        by_dir: dict[str, list[FileScan]] = {}
        for s in scans:
            by_dir.setdefault(os.path.dirname(s.path), []).append(s)
        streams = [itertools.chain.from_iterable(s.records for s in ss) for ss in by_dir.values()]
        if len(streams) == 1:
            return streams[0]  # no generator frame of our own per record
        return heapq.merge(*streams, key=lambda r: r.woid)

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
        prefix: bytes = b"",
    ) -> CommitResult:
        """Append a transaction (PUT records, one TAKE record, a COMMIT) and wait for it.

        Each PUT record's payload is ``prefix + payloads[i]`` (a channel passes
        the empty header block once for a transaction whose events have none).

        With ``fsync="commit"`` this returns once the records are durable;
        with ``"interval"``, once they are written to the OS. ``on_written`` is
        called by the writing thread, in commit order, just before the commits
        of one write return: that is where the channel publishes the puts.

        Raises:
            OSError: The write or fsync failed; the transaction did not commit.
            ChannelClosedError: The log is closed or has failed.
        """
        item = Item(fmt.COMMIT, txn_id, payloads, takes, True, on_written, overhead=self.seal_overhead, prefix=prefix)
        self._writers[txn_id % len(self._writers)].submit(item)
        return item.result

    def rollback(self, txn_id: int, n_puts: int, n_takes: int) -> None:
        """Note a rollback in the log; it is written with the next write, never waited for."""
        if self._failed is not None or self._closed or self.readonly:
            return
        self._writers[txn_id % len(self._writers)].submit(RollbackItem(txn_id, n_puts, n_takes))

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
            w.submit(Item(fmt.RETIRE, 0, retire=fids))
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
                self._ciphers.pop(fid, None)
                self._undecryptable.pop(fid, None)
                self._headerless.pop(fid, None)
                self._key_ids.pop(fid, None)
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

    def is_encrypted(self, file_id: int) -> bool:
        """Whether a live data file's events are encrypted."""
        return file_id in self._key_ids or file_id in self._undecryptable

    def _read_fd(self, file_id: int) -> int:
        """The read-only descriptor of a live data file, opened on first use and kept."""
        fd = self._read_fds.get(file_id)
        if fd is None:
            path = self._files[file_id][1]
            fd = self.fs.open_read(path)
            old = self._read_fds.setdefault(file_id, fd)
            if old != fd:
                self.fs.close(fd)
                fd = old
        return fd

    def read_payload(self, file_id: int, offset: int, size: int, *, decrypt: bool = True) -> bytes:
        """Read and verify the record at a pointer; return its payload (decrypted).

        ``decrypt=False`` checks only the record's checksum and returns the
        payload as stored (``verify`` without a key).

        Raises:
            CorruptLogError: The record there no longer verifies.
            DecryptionError: Its checksum is intact but its authentication tag
                fails, or its file cannot be decrypted.
        """
        buf = self.fs.pread(self._read_fd(file_id), size, offset)
        got = fmt.decode_puts(buf, (0,), (size,), self._seeds[file_id], self.crc_kind, self.max_payload, False)[0]
        if isinstance(got, FormatError):
            err = CorruptLogError(self._files[file_id][1], offset + got.offset, got.reason)
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
        cipher = self._ciphers.get(file_id)
        if cipher is not None:
            plain = cipher.open(head, offset, payload)
            if plain is None:
                raise DecryptionError(self._files[file_id][1], offset, TAMPERED, cipher.key_id)
            return plain
        if file_id in self._undecryptable:
            raise DecryptionError(self._files[file_id][1], offset, self._undecryptable[file_id])
        if sealed:
            why = self._headerless.get(file_id, SEALED_WITHOUT_KEY)
            raise DecryptionError(self._files[file_id][1], offset, why)
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
            plain = fid not in self._ciphers and fid not in self._undecryptable
            results = fmt.decode_puts(
                buf,
                [e[2] - start for e in run],
                [e[3] for e in run],
                self._seeds[fid],
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
            err = CorruptLogError(self._files[file_id][1], offset, f"queued event does not decode: {got.reason}")
            err.__cause__ = got
            return err
        if isinstance(got, FormatError):
            err = CorruptLogError(self._files[file_id][1], offset + got.offset, got.reason)
            err.__cause__ = got
            return err
        stored = cast(bytes, got)  # verified, left undecoded: an encrypted file's, or sealed
        try:
            payload = self._opened(file_id, offset, buf[rel : rel + 24], stored, buf[rel + 1] == fmt.FLAG_SEALED)
            return fmt.decode_event(payload)
        except EventFormatError as exc:
            err = CorruptLogError(self._files[file_id][1], offset, f"queued event does not decode: {exc.reason}")
            err.__cause__ = exc
            return err
        except CorruptLogError as exc:  # DecryptionError
            return exc

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

    def file_dirs(self, file_ids: Iterable[int]) -> dict[int, int]:
        """The data directory index of each of these live files (a checkpoint records it)."""
        return {fid: self._files[fid][0] for fid in file_ids if fid in self._files}

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


class _CheckpointUnusable(Exception):
    """A checkpoint does not fit the data files on disk (recovery tries an older one)."""
