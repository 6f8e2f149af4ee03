"""The shared state of one open log: counters, failure, the live-file table, recovery's findings.

An open channel directory is handled by several rooms: ``directory.py``
(identity, data directories, locks), ``recovery.py`` (what to keep at open),
``retention.py`` (retiring files), ``writer.py`` (appending) and ``log.py``
(the ``Log`` that ties them and serves reads). This module owns what they
share and nothing else: the write-order id, position, file id and transaction
id counters and the lock that guards them; the FAILED state and the check that
refuses writes after it; the table of live data files (path, checksum seed,
cipher, key id, end of verified data); I/O counters; and what recovery found
(damage reported in skip mode, torn tails, the vouching checkpoint). It does
no I/O and imports nothing that can write.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from bisect import bisect_left
from typing import TYPE_CHECKING

from . import format as fmt
from ._fs import DEFAULT_FS, FS
from .config import ChannelConfig
from .errors import ChannelClosedError

if TYPE_CHECKING:
    from .checkpoint import Snapshot, StoredCheckpoint
    from .crypto import FileCipher, MetaMac
    from .scan import CorruptionReport, FileScan

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "data"
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds (seconds) of the commit fdatasync histogram in ``stats()`` (the last bucket is open)."""


class LogState:
    """What the rooms of an open log share; see the module docstring.

    Args:
        directory: The channel directory.
        config: Channel options (``ChannelConfig()`` when omitted).
        fs: The I/O seam.
        readonly: An inspection: nothing is locked, created or repaired.
        keyless_ok: A read-only inspection may meet encrypted files it cannot decrypt.
        wal: A write-ahead log's directory, not a channel's.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: ChannelConfig | None,
        fs: FS | None,
        readonly: bool,
        keyless_ok: bool,
        wal: bool,
    ) -> None:
        self.directory = os.fspath(directory)
        self.wal = wal
        self.config = config or ChannelConfig()
        self.fs: FS = fs or DEFAULT_FS
        self.readonly = readonly
        self.keyless_ok = keyless_ok
        self.seal_overhead = fmt.ENC_TAG_LEN if self.config.encryption is not None else 0
        # A limit of the format (the u32 length field), not of this open's options: a
        # channel written with a larger max_event_size must still replay, and a smaller
        # limit made intact records look corrupt (or cut an acknowledged tail as torn).
        # Declared lengths are still checked against the bytes left before any read.
        self.max_payload = 0xFFFF_FFFF
        d = self.config.data_dirs
        self.data_dirs = list(d) if d else [os.path.join(self.directory, DEFAULT_DATA_DIR)]
        # identity (set when the directory is opened)
        self.channel_id = b""
        self.crc_kind = 0
        self.created_ns = 0
        # counters, guarded by seq_lock
        self.seq_lock = threading.Lock()
        self.next_woid = 1
        self.next_position = 0
        self.next_file_id = 1
        self._txn_ids = itertools.count(1)
        self._txn_peek = 1
        # lifecycle
        self.state_lock = threading.Lock()
        self.failed: BaseException | None = None
        self.failed_msg = ""
        self.closed = False
        self.closing = False
        # live data files
        self.files: dict[int, tuple[int, str]] = {}  # file_id -> (dir index, path)
        self.seeds: dict[int, int] = {}
        # Encrypted data files: their cipher, or why their PUT payloads cannot be read.
        self.ciphers: dict[int, FileCipher] = {}
        self.undecryptable: dict[int, str] = {}
        self.headerless: dict[int, str] = {}  # file id -> why its sealed records cannot be opened
        self.key_ids: dict[int, str] = {}  # file id -> key id, for every encrypted live file
        self.file_end: dict[int, int] = {}
        # Authenticated files (format version 2): each one's header key check, and the batch
        # tag at its file_end (a checkpoint and ANCHOR record both; see format.AuthState).
        self.key_checks: dict[int, bytes] = {}
        self.file_tags: dict[int, bytes] = {}
        self.first_auth = fmt.NO_AUTH_FILE  # the channel's first authenticated data file
        # The generation of the newest ANCHOR durable on disk (see format.AuthState): a
        # checkpoint records it, the next ANCHOR written gets one more.
        self.anchor_generation = 0
        # How far the owner has seen each consumer's .ack go (ANCHOR and checkpoints record
        # it): an older .ack put back is refused (see consumers.ConsumerStore).
        self.consumer_acks: dict[str, fmt.AckMark] = {}
        # The MAC of the small files (checkpoints, acks, DATA_DIRS, DATADIR, ANCHOR) of an
        # encrypted channel; required once the channel has an authenticated data file.
        self.meta_mac: MetaMac | None = None
        self.macs_required = False
        self.read_fds: dict[int, int] = {}
        # I/O counters
        self.fsyncs = 0
        # How long the commits' fdatasyncs took: a histogram (FSYNC_BUCKETS) and the sum.
        self.fsync_seconds = 0.0
        self.fsync_buckets = [0] * (len(FSYNC_BUCKETS) + 1)
        self.bytes_written = 0
        self.files_created = 0
        self.files_retired = 0
        self.space: dict[int, tuple[float, int]] = {}
        self.space_written: dict[int, int] = {}
        # Bytes held in data files no writer appends to (the files of earlier opens, and
        # each file a writer rolled away from), per file and in total; the writers'
        # active files add their lengths (space.py). ``room`` is notified when a file retires.
        self.file_bytes: dict[int, int] = {}
        self.sealed_bytes = 0
        self.room = threading.Condition(threading.Lock())
        # what recovery found
        self.base_snapshot: Snapshot | None = None
        self.recovered_from: StoredCheckpoint | None = None
        self.checkpoint_fallbacks: list[str] = []
        self.file_sizes: dict[int, int] = {}  # data file sizes found at open (recovery's view)
        self.scans: list[FileScan] = []
        self.corruption: list[CorruptionReport] = []
        self.torn_tails: list[tuple[str, int, int]] = []
        self.discarded: set[int] = set()  # files set aside at open (never retired)
        self.voucher: Snapshot | None = None  # the newest checkpoint that decodes
        self.voucher_path: str | None = None
        self.retired_files: set[int] = set()  # files the voucher lists that are known retired
        self.missing_files: set[int] = set()  # files that are gone without a trace of retirement
        self.position_floor = 0  # replay's position accounting starts here
        self.dir_lost = False  # a data directory was missing (skip mode): only RETIRE records prove retirement

    # -- counters -----------------------------------------------------------------

    def new_txn_id(self) -> int:
        """Return a transaction id never used before in this channel."""
        n = next(self._txn_ids)
        self._txn_peek = n + 1
        return n

    def peek_txn_id(self) -> int:
        """The transaction id :meth:`new_txn_id` returns next (a new file's header records it)."""
        return self._txn_peek

    def set_next_txn_id(self, n: int) -> None:
        """Continue transaction ids at ``n`` (recovery, after reading every file)."""
        self._txn_ids = itertools.count(n)
        self._txn_peek = n

    @property
    def last_woid(self) -> int:
        """The highest write-order id assigned so far."""
        return self.next_woid - 1

    def file_sealed(self, file_id: int, size: int) -> None:
        """Count the ``size`` bytes of a data file that is no longer appended to."""
        with self.room:
            self.sealed_bytes += size - self.file_bytes.get(file_id, 0)
            self.file_bytes[file_id] = size

    def space_used(self, index: int, n: int) -> None:
        """Count ``n`` bytes written to data directory ``index`` since its free space was read."""
        self.space_written[index] = self.space_written.get(index, 0) + n

    # -- the FAILED state -------------------------------------------------------------

    def check_writable(self) -> None:
        """Raise ChannelClosedError unless writes are allowed (not failed, closed or read-only)."""
        if self.failed is not None:
            raise ChannelClosedError(
                f"the channel failed and refuses writes: {self.failed_msg}: {self.failed}; "
                "close and reopen it to recover from what is on disk"
            ) from self.failed
        if self.closed or self.closing:
            raise ChannelClosedError("the channel is closed")
        if self.readonly:
            raise ChannelClosedError("the log was opened read-only")

    def fail(self, exc: BaseException, msg: str) -> None:
        """Move the log to FAILED (once): every later write raises; nothing unsafe is retried."""
        with self.state_lock:
            if self.failed is None:
                self.failed = exc
                self.failed_msg = msg
                logger.error("%s: %s; the channel refuses further writes", msg, exc)

    # -- live files -------------------------------------------------------------------

    def register_file(self, file_id: int, index: int, path: str) -> None:
        """Add a data file to the live table (at recovery, or when a writer creates it)."""
        self.files[file_id] = (index, path)
        self.seeds[file_id] = fmt.file_seed(self.crc_kind, self.channel_id, file_id)

    def note_fsync(self, seconds: float) -> None:
        """Count one commit fdatasync that took ``seconds`` (the writer's; called under its lock)."""
        self.fsyncs += 1
        self.fsync_seconds += seconds
        self.fsync_buckets[bisect_left(FSYNC_BUCKETS, seconds)] += 1

    def note_acks(self, marks: tuple[fmt.AckMark, ...]) -> None:
        """Keep the newest of each consumer's recorded :class:`~filechannel.format.AckMark` (ANCHOR, checkpoint)."""
        for a in marks:
            cur = self.consumer_acks.get(a.name)
            if cur is None or (a.registered_ns, a.seq) > (cur.registered_ns, cur.seq):
                self.consumer_acks[a.name] = a

    def auth_state(self, files: dict[int, int], tags: dict[int, bytes]) -> fmt.AuthState | None:
        """What a checkpoint and ANCHOR record of the authenticated live files (None: none is).

        ``files`` maps each live file to the length vouched for, ``tags`` the
        writers' current files to the batch tag at that length (older files use
        :attr:`file_tags`). Call it with the writers held (``Log.freeze``).
        """
        entries = []
        for fid in sorted(files):
            check = self.key_checks.get(fid)
            tag = tags.get(fid, self.file_tags.get(fid))
            if check is None or tag is None:
                continue
            index = self.files[fid][0] if fid in self.files else 0
            entries.append(fmt.AuthEntry(fid, files[fid], check, tag, index))
        if not entries and self.first_auth == fmt.NO_AUTH_FILE:
            return None
        return fmt.AuthState(
            self.first_auth, tuple(entries), self.anchor_generation, self.next_position, self.ack_marks()
        )

    def ack_marks(self) -> tuple[fmt.AckMark, ...]:
        """The consumers' ack marks an authenticated record holds (see :meth:`note_acks`), by name."""
        marks = list(self.consumer_acks.values())
        if len(marks) > fmt.MAX_ACK_MARKS:  # names removed long ago go first
            marks = sorted(marks, key=lambda a: a.registered_ns)[-fmt.MAX_ACK_MARKS :]
        return tuple(sorted(marks, key=lambda a: a.name))

    def forget_file(self, file_id: int) -> str:
        """Drop a retired data file from the live table; return its path (its read descriptor is closed)."""
        _, path = self.files.pop(file_id)
        self.seeds.pop(file_id, None)
        self.ciphers.pop(file_id, None)
        self.undecryptable.pop(file_id, None)
        self.headerless.pop(file_id, None)
        self.key_ids.pop(file_id, None)
        self.file_end.pop(file_id, None)
        self.key_checks.pop(file_id, None)
        self.file_tags.pop(file_id, None)
        rfd = self.read_fds.pop(file_id, None)
        if rfd is not None:
            self.fs.close(rfd)
        with self.room:
            self.sealed_bytes -= self.file_bytes.pop(file_id, 0)
            self.space.clear()  # the next check reads the file system's free space afresh
            self.room.notify_all()  # puts waiting for room look again
        return path

    # -- findings ---------------------------------------------------------------------

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
