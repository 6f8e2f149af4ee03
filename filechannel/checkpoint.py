"""Checkpoints: a compact, checksummed snapshot of the channel, written atomically.

This module owns the checkpoint file format (pure ``encode``/``decode``) and
the checkpoint store: where checkpoint files live, how one is written
(temporary file, fsync, rename over, fsync the directory, all through the
``_fs`` seam), which ones are kept (the newest and the one before it, the
backup, optionally in a second directory) and the order in which recovery
tries them. It knows nothing of transactions or queues beyond the arrays it
stores.

A checkpoint at write-order id ``W`` holds everything needed to restart
without reading history: the queue (position and record pointer of every
committed, untaken event, including those held by open transactions, which
recovery returns to the queue), the positions already taken from each live
data file, the counters, and for each data file the offset at which records
with ids above ``W`` begin. Recovery loads it and replays only those records.

In an encrypted channel a checkpoint is followed by an extension, the
authenticated files (``format.AuthState``) and its length, and a MAC trailer
(``format.encode_sealed``) over everything before it: an edited, forged or
swapped checkpoint is refused (recovery then tries an older one, else replays
the log, whose batches are authenticated). Its marks table, if any, is
sealed (version 4): a checkpoint holds no mark key or value in plaintext.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import re
import struct
import sys
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from . import format as fmt
from ._fs import FS, read_file
from ._runs import StoredRun
from .errors import FormatError

if TYPE_CHECKING:
    from .crypto import MetaMac

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
"""Where a channel's checkpoints are, under its directory."""
MAGIC = b"\x89FCK\r\n\x1a\n"
VERSION = 2
"""Written: a file table entry carries its file's data directory (version 1, still read, did not)."""
MARKS_VERSION = 3
"""Written when the channel holds marks: version 2 plus a marks table after the taken table."""
SEALED_MARKS_VERSION = 4
"""Written when an encrypted channel holds marks: version 3 with the marks table sealed."""
RUNS_VERSION = 6
"""Written for a queue of runs (``Snapshot.runs``): a runs table and holes, then the entries outside any run.

Its header's reserved u16 holds flags: :data:`HAS_MARKS` (a marks table follows the
taken table), :data:`SEALED` (that table is sealed, as in version 4).
"""
HAS_MARKS = 1
SEALED = 2
_RUNS_HEAD = struct.Struct("<QQ")  # runs, holes
_RUN = struct.Struct("<QQQQ")  # first position, count, file id, scan offset
MAX_RUNS = 1 << 32
MAX_POSITION = (1 << 63) - 1  # positions are i64
MIN_PUT_SIZE = fmt.record_size(4)  # the smallest PUT record (a payload of a header count only): bounds a run's count
_SEALED_HEAD = struct.Struct("<BBHI32s")  # cipher suite, key id length, reserved (0), ciphertext length, salt
_MARKS_HEAD = struct.Struct("<I")
_MARK = struct.Struct("<QQHH")
MAX_MARKS = 1 << 16
_HEAD = struct.Struct("<8sHHI16sQQQQQIIQ")
_FILE_V1 = struct.Struct("<QQ")
_FILE = struct.Struct("<QQII")
UNKNOWN_DIR = 0xFFFF_FFFF
"""The data directory index of a file table entry that does not know it."""
_U32 = struct.Struct("<I")
_TF = struct.Struct("<QI")
_RANGE = struct.Struct("<QQ")
_NAME_RE = re.compile(r"^ckpt-([0-9a-f]{16})\.ckpt$")
MAX_ENTRIES = 1 << 34
LAST_OPEN = "last-open.json"


def checkpoint_name(woid: int) -> str:
    """Return the file name of the checkpoint taken at write-order id ``woid``."""
    return f"ckpt-{woid:016x}.ckpt"


Columns = tuple["array[int]", "array[int]", "array[int]", "array[int]"]
"""``(positions, file_ids, offsets, sizes)``."""

CHUNK = 256 * 1024
"""Bytes encoded, checksummed and written per step, so other threads get the GIL in between."""

SYNC_EVERY = 1 << 20
"""A checkpoint file being written is flushed (fdatasync) every this many bytes."""

SHRINK_STEP = 1 << 20
"""A doomed checkpoint longer than this is truncated by this much at a time before its unlink."""


@dataclass
class Snapshot:
    """The channel's committed state at write-order id ``woid``.

    ``positions``, ``file_ids``, ``offsets`` and ``sizes`` are parallel
    ``array('q')`` columns in position order. ``files`` maps each live data
    file to the offset where replay must resume in it, and ``file_dirs`` to
    the index of its data directory (empty: a version 1 checkpoint, which did
    not record it). ``taken`` maps a live data file to the ``(first, count)``
    position ranges already taken from it.

    ``parts``, when set, replaces the four columns: the queue as a list of
    ``(first, end, columns)`` windows into column arrays that their owner
    promises not to change inside the window until the snapshot is written
    (the channel lends its live queue this way instead of copying it while
    every writer is held).

    ``runs``, when not None, makes it a checkpoint of runs (version 6): the
    queue is these runs (see ``_runs.StoredRun``) less the positions in
    ``holes``, plus the entries in the columns (those outside any run: takes of
    open transactions, rolled-back takes).
    """

    woid: int
    next_position: int
    next_txn_id: int
    next_file_id: int
    channel_id: bytes
    created_ns: int = 0
    files: dict[int, int] = field(default_factory=dict)
    positions: array[int] = field(default_factory=lambda: array("q"))
    file_ids: array[int] = field(default_factory=lambda: array("q"))
    offsets: array[int] = field(default_factory=lambda: array("q"))
    sizes: array[int] = field(default_factory=lambda: array("q"))
    taken: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    parts: list[tuple[int, int, Columns]] | None = None
    file_dirs: dict[int, int] = field(default_factory=dict)
    auth: fmt.AuthState | None = None  # an encrypted channel's authenticated files (in the MACed extension)
    # the committed marks: (key, value, woid of the COMMIT that set it, data file of its newest copy)
    marks: list[tuple[str, bytes, int, int]] = field(default_factory=list)
    marks_unread: bool = False  # decoded without the key: its sealed marks table was not opened (marks is empty)
    runs: list[StoredRun] | None = None
    holes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        """The queued events it holds."""
        in_runs = sum(r.length for r in self.runs) - len(self.holes) if self.runs is not None else 0
        return in_runs + self.entry_count()

    def entry_count(self) -> int:
        """The entries held one by one (in the columns or windows): all of them unless it holds runs."""
        if self.parts is not None:
            return sum(end - first for first, end, _ in self.parts)
        return len(self.positions)

    def first_position(self) -> int | None:
        """The smallest queued position, or None when it holds no event."""
        heads = [cols[0][first] for first, end, cols in self.windows() if end > first]
        best = min(heads) if heads else None
        holes = set(self.holes)
        for r in self.runs or ():
            p = next((p for p in range(r.first, r.first + r.length) if p not in holes), None)
            if p is not None:
                best = p if best is None else min(best, p)
                break
        return best

    def queued_positions(self) -> tuple[array[int], array[int]]:
        """Every queued position and its data file, as two sorted columns (O(events): for checks, not restart)."""
        if self.runs is None:
            if self.parts is None:
                return self.positions, self.file_ids
            return _joined(self.parts, 0), _joined(self.parts, 1)
        holes = set(self.holes)
        pairs = [(p, r.file_id) for r in self.runs for p in range(r.first, r.first + r.length) if p not in holes]
        for first, end, cols in self.windows():
            pairs += zip(cols[0][first:end], cols[1][first:end], strict=True)
        pairs.sort()
        return array("q", [p for p, _ in pairs]), array("q", [f for _, f in pairs])

    def windows(self) -> list[tuple[int, int, Columns]]:
        """Return the queue as ``(first, end, columns)`` windows, in position order."""
        if self.parts is not None:
            return self.parts
        cols = (self.positions, self.file_ids, self.offsets, self.sizes)
        if not (len(self.file_ids) == len(self.offsets) == len(self.sizes) == len(self.positions)):
            raise FormatError(0, "snapshot columns differ in length")
        return [(0, len(self.positions), cols)]


def _joined(parts: list[tuple[int, int, Columns]], col: int) -> array[int]:
    out = array("q")
    for first, end, cols in parts:
        out.extend(cols[col][first:end])
    return out


def _crc_step(kind: int, data: bytes, seed: int) -> int:
    sp = fmt.speedups
    if sp is not None:
        return int(sp.crc(kind, data, seed))  # releases the GIL over long buffers
    return fmt.crc(kind, data, seed)


def encode_blocks(s: Snapshot, crc_kind: int, block: int | None = None, mac: MetaMac | None = None) -> Iterator[bytes]:
    """Yield a checkpoint's bytes in blocks of about ``block`` bytes, the checksum in the last.

    With ``mac`` (an encrypted channel) a marks table is sealed (version 4).

    Every call that holds the GIL (a column slice, a join) handles at most
    ``block`` bytes, and the checksum is extended block by block (releasing
    the GIL when the accelerator is built), so committing threads keep
    running while a checkpoint of a long queue is encoded and written.
    ``b"".join(encode_blocks(s, k)) == encode(s, k)``; ``block`` defaults to :data:`CHUNK`.
    """
    if block is None:
        block = CHUNK
    windows = s.windows()
    n = sum(end - first for first, end, _ in windows)
    flags = 0
    if s.runs is not None:
        version = RUNS_VERSION
        flags = (HAS_MARKS | (SEALED if mac is not None else 0)) if s.marks else 0
    else:
        version = VERSION if not s.marks else MARKS_VERSION if mac is None else SEALED_MARKS_VERSION
    head = _HEAD.pack(
        MAGIC,
        version,
        flags,
        crc_kind,
        s.channel_id,
        s.woid,
        s.next_position,
        s.next_txn_id,
        s.next_file_id,
        s.created_ns,
        len(s.files),
        len(s.taken),
        n,
    )
    pend: list[bytes] = [head]
    dirs = s.file_dirs
    pend += [_FILE.pack(fid, off, dirs.get(fid, UNKNOWN_DIR), 0) for fid, off in sorted(s.files.items())]
    for fid, ranges in sorted(s.taken.items()):
        pend.append(_TF.pack(fid, len(ranges)))
        pend += [_RANGE.pack(a, c) for a, c in ranges]
    if s.marks:
        table = encode_marks(s.marks)
        pend.append(table if mac is None else seal_marks(table, mac, head))
    if s.runs is not None:
        pend.append(_RUNS_HEAD.pack(len(s.runs), len(s.holes)))
        pend += [_RUN.pack(*r) for r in s.runs]
        pend.append(array("q", s.holes).tobytes() if sys.byteorder == "little" else _le(s.holes))
    size = sum(len(p) for p in pend)
    crc = 0
    step = max(1, block // 8)
    for col in range(4):
        for first, end, cols in windows:
            a = cols[col]
            for i in range(first, end, step):
                piece = a[i : min(i + step, end)]
                if sys.byteorder == "big":  # pragma: no cover - the format is little-endian
                    piece.byteswap()
                pend.append(piece.tobytes())
                size += len(pend[-1])
                if size >= block:
                    out = b"".join(pend)
                    crc = _crc_step(crc_kind, out, crc)
                    yield out
                    pend, size = [], 0
    out = b"".join(pend)
    crc = _crc_step(crc_kind, out, crc)
    yield out + _U32.pack(crc)


def _le(xs: list[int]) -> bytes:  # pragma: no cover - the format is little-endian
    a = array("q", xs)
    a.byteswap()
    return a.tobytes()


def check_runs(files: dict[int, int], runs: list[StoredRun], holes: list[int], at: int = 0) -> None:
    """Check that a checkpoint's runs and holes can name events.

    Runs are non-empty, in position order and disjoint; each scan offset lies after
    the file header, 8-aligned, before the length recorded for its file, which is in the
    file table; holes increase and each is inside a run.

    Raises:
        FormatError: ``at`` (the runs table's offset in the checkpoint) and what is wrong.
    """
    prev = -1
    for i, (first, count, fid, off) in enumerate(runs):
        where = at + _RUNS_HEAD.size + i * _RUN.size
        if count <= 0 or first < prev:
            raise FormatError(where, "checkpoint runs are empty, overlap or are out of order")
        if fid not in files:
            raise FormatError(where, f"checkpoint run points into data file {fid}, not in its file table")
        if off < MIN_RECORD_OFFSET or off & 7 or off + fmt.RECORD_HEADER_LEN > files[fid]:
            raise FormatError(where, "checkpoint run starts inside a file header, off alignment or past its file")
        if first + count > MAX_POSITION or count > (files[fid] - off) // MIN_PUT_SIZE:
            raise FormatError(where, "checkpoint run names more events than its file holds before its resume offset")
        prev = first + count
    if holes:
        where = at + _RUNS_HEAD.size + len(runs) * _RUN.size
        if not all(map(operator.lt, holes, islice(holes, 1, None))):
            raise FormatError(where, "checkpoint holes do not increase")
        firsts = [r.first for r in runs]
        for p in holes:
            i = bisect_right(firsts, p) - 1
            if i < 0 or p >= runs[i].first + runs[i].length:
                raise FormatError(where, f"checkpoint hole at position {p} is outside every run")


def encode_marks(marks: list[tuple[str, bytes, int, int]]) -> bytes:
    """Encode a checkpoint's marks table.

    It is a u32 count, then per mark u64 woid, u64 file id, u16 key length,
    u16 value length, the key (UTF-8), the value.

    Raises:
        ValueError: Too many marks, or one out of the bounds of ``format.check_mark``.
    """
    if len(marks) > MAX_MARKS:
        raise ValueError(f"a checkpoint holds at most {MAX_MARKS} marks")
    out = [_MARKS_HEAD.pack(len(marks))]
    for key, value, woid, file_id in marks:
        key, value = fmt.check_mark(key, value)
        kb = key.encode("utf-8")
        out += (_MARK.pack(woid, file_id, len(kb), len(value)), kb, value)
    return b"".join(out)


def seal_marks(table: bytes, mac: MetaMac, head: bytes) -> bytes:
    """Seal an encoded marks table (version 4): the table's AEAD message, the checkpoint's header as associated data.

    It is ``u8 cipher suite, u8 key id length, u16 reserved (0), u32 ciphertext
    length, 32-byte salt``, the key id (ASCII), then the ciphertext (the table
    and a 16-byte tag); the key is derived from the master key and the salt,
    fresh for each checkpoint (``MetaMac.seal_table``).
    """
    salt = os.urandom(32)
    key_id, suite, ct = mac.seal_table(salt, head, table)
    kid = key_id.encode("ascii")
    return _SEALED_HEAD.pack(suite, len(kid), 0, len(ct), salt) + kid + ct


def _open_marks(
    buf: bytes, pos: int, end: int, mac: MetaMac | None, path: str
) -> tuple[list[tuple[str, bytes, int, int]] | None, int]:
    """Open and decode the sealed marks table at ``pos``: the marks (None without ``mac``) and the offset after it.

    Raises:
        FormatError: It runs past ``end``, does not open (its tag fails), or its table is damaged.
        DecryptionError: No key is given for its key id.
    """
    if pos + _SEALED_HEAD.size > end:
        raise FormatError(pos, "checkpoint sealed marks table runs past the end")
    suite, klen, reserved, n, salt = _SEALED_HEAD.unpack_from(buf, pos)
    at = pos + _SEALED_HEAD.size
    if reserved or klen == 0 or n < fmt.ENC_TAG_LEN or at + klen + n > end:
        raise FormatError(pos, "checkpoint sealed marks table is out of bounds")
    after = at + klen + n
    if mac is None:
        return None, after
    try:
        key_id = buf[at : at + klen].decode("ascii")
    except UnicodeDecodeError:
        raise FormatError(at, "checkpoint sealed marks table names a key id that is not ASCII") from None
    plain = mac.open_table(path, key_id, suite, salt, buf[: _HEAD.size], buf[at + klen : after])
    if plain is None:
        raise FormatError(pos, "checkpoint sealed marks table does not open: its authentication tag fails")
    marks, got = _decode_marks(plain, 0, len(plain))
    if got != len(plain):
        raise FormatError(pos, "checkpoint sealed marks table has bytes after its last mark")
    return marks, after


def _decode_marks(buf: bytes, pos: int, end: int) -> tuple[list[tuple[str, bytes, int, int]], int]:
    """Decode the marks table at ``pos`` (before ``end``); return it and the offset after it.

    Raises:
        FormatError: It runs past ``end``, or a mark is out of bounds.
    """
    if pos + _MARKS_HEAD.size > end:
        raise FormatError(pos, "checkpoint marks table runs past the end")
    (n,) = _MARKS_HEAD.unpack_from(buf, pos)
    if n > MAX_MARKS:
        raise FormatError(pos, "checkpoint mark count is out of range")
    pos += _MARKS_HEAD.size
    out = []
    for _ in range(n):
        if pos + _MARK.size > end:
            raise FormatError(pos, "checkpoint marks table runs past the end")
        woid, fid, klen, vlen = _MARK.unpack_from(buf, pos)
        pos += _MARK.size
        if not 0 < klen <= fmt.MAX_MARK_KEY or vlen > fmt.MAX_MARK_VALUE or pos + klen + vlen > end:
            raise FormatError(pos - 4, "checkpoint mark key or value length is out of bounds")
        try:
            key = buf[pos : pos + klen].decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(pos, "checkpoint mark key is not UTF-8") from None
        out.append((key, bytes(buf[pos + klen : pos + klen + vlen]), woid, fid))
        pos += klen + vlen
    return out, pos


def encode(s: Snapshot, crc_kind: int, mac: MetaMac | None = None) -> bytes:
    """Encode a snapshot; the last 4 bytes are a checksum of everything before (``mac``: see :func:`encode_blocks`)."""
    return b"".join(encode_blocks(s, crc_kind, mac=mac))


MIN_RECORD_OFFSET = fmt.FILE_HEADER_FIXED + 4 + fmt.pad_len(fmt.FILE_HEADER_FIXED + 4)
"""The smallest offset a record can have: after the shortest file header (80 bytes)."""
MAX_RECORD_SIZE = fmt.record_size(0xFFFF_FFFF)
"""The largest frame the format can hold (a payload length is a u32)."""


def check_entries(
    files: dict[int, int],
    positions: array[int],
    file_ids: array[int],
    offsets: array[int],
    sizes: array[int],
    at: int = 0,
) -> None:
    """Check that every queue entry points at a record that can exist.

    Each entry's record lies after the header, 8-aligned, at most the largest frame,
    inside the length the checkpoint records for its file; positions increase
    (no two entries are one event). Each check is a pass over a column at C
    speed; whether two entries point at one record is not checked (a set of a
    long queue costs more than the rest together). Done at decode time, so recovery never
    reads at a negative offset or allocates a record's worth of bytes for a
    damaged entry: it falls back to an older checkpoint or a full replay.

    Raises:
        FormatError: ``at`` (the queue's offset in the checkpoint) and what is wrong.
    """
    n = len(positions)
    if not n:
        return
    if min(positions) < 0 or not all(map(operator.lt, positions, islice(positions, 1, None))):
        raise FormatError(at, "checkpoint queue positions do not increase")
    if min(offsets) < MIN_RECORD_OFFSET or any(map((7).__and__, offsets)):
        raise FormatError(at + 16 * n, "checkpoint queue entry points inside a file header or off alignment")
    if min(sizes) < fmt.RECORD_HEADER_LEN or max(sizes) > MAX_RECORD_SIZE or any(map((7).__and__, sizes)):
        raise FormatError(at + 24 * n, "checkpoint queue entry has a record size no frame can have")
    try:
        ends = map(files.__getitem__, file_ids)
        inside = all(map(operator.le, map(operator.add, offsets, sizes), ends))
    except KeyError as exc:
        reason = f"checkpoint queue entry points into data file {exc.args[0]}, not in its file table"
        raise FormatError(at + 8 * n, reason) from None
    if not inside:
        raise FormatError(at + 16 * n, "checkpoint queue entry points past the length it records for its file")


def decode(buf: bytes, crc_kind: int, channel_id: bytes, mac: MetaMac | None = None, path: str = "") -> Snapshot:
    """Decode and check a checkpoint file.

    A sealed marks table (version 4) is opened with ``mac``; without it the
    snapshot's marks are left unread (``marks_unread``).

    Raises:
        FormatError: The bytes are truncated, damaged, of another version or of another channel.
        DecryptionError: ``mac`` has no key for its sealed marks table.
    """
    if len(buf) < _HEAD.size + 4:
        raise FormatError(len(buf), "checkpoint is truncated")
    (magic, version, _r, kind, cid, woid, next_pos, next_txn, next_file, created, n_files, n_tf, n) = _HEAD.unpack_from(
        buf, 0
    )
    if magic != MAGIC:
        raise FormatError(0, "bad checkpoint magic")
    if version not in (1, VERSION, MARKS_VERSION, SEALED_MARKS_VERSION, RUNS_VERSION):
        raise FormatError(8, f"unsupported checkpoint version {version}")
    if _r and (version != RUNS_VERSION or _r & ~(HAS_MARKS | SEALED) or _r == SEALED):
        raise FormatError(10, f"checkpoint flags {_r:#x} are not valid for version {version}")
    if kind != crc_kind:
        raise FormatError(12, "checkpoint checksum algorithm differs from the channel's")
    body_len = len(buf) - 4
    if fmt.crc(kind, buf[:body_len]) != _U32.unpack_from(buf, body_len)[0]:
        raise FormatError(body_len, "checkpoint checksum mismatch")
    if cid != channel_id:
        raise FormatError(16, "checkpoint belongs to another channel")
    if n > MAX_ENTRIES or n_files > fmt.MAX_LIVE_FILES or n_tf > fmt.MAX_LIVE_FILES:
        raise FormatError(_HEAD.size - 16, "checkpoint counts are out of range")
    pos = _HEAD.size
    entry = _FILE_V1 if version == 1 else _FILE
    if pos + n_files * entry.size > body_len:
        raise FormatError(pos, "checkpoint file table runs past the end")
    files = {}
    file_dirs = {}
    for _ in range(n_files):
        if version != 1:
            fid, off, d, _ = _FILE.unpack_from(buf, pos)
            if d != UNKNOWN_DIR:
                file_dirs[fid] = d
        else:
            fid, off = _FILE_V1.unpack_from(buf, pos)
        files[fid] = off
        pos += entry.size
    taken: dict[int, list[tuple[int, int]]] = {}
    for _ in range(n_tf):
        if pos + _TF.size > body_len:
            raise FormatError(pos, "checkpoint taken table runs past the end")
        fid, nr = _TF.unpack_from(buf, pos)
        pos += _TF.size
        if pos + nr * _RANGE.size > body_len:
            raise FormatError(pos, "checkpoint taken ranges run past the end")
        taken[fid] = [_RANGE.unpack_from(buf, pos + i * _RANGE.size) for i in range(nr)]  # type: ignore[misc]
        pos += nr * _RANGE.size
    marks: list[tuple[str, bytes, int, int]] | None = []
    if version == MARKS_VERSION or _r == HAS_MARKS:
        marks, pos = _decode_marks(buf, pos, body_len)
    elif version == SEALED_MARKS_VERSION or _r == HAS_MARKS | SEALED:
        marks, pos = _open_marks(buf, pos, body_len, mac, path)
    runs: list[StoredRun] | None = None
    holes: list[int] = []
    if version == RUNS_VERSION:
        runs_at = pos
        if pos + _RUNS_HEAD.size > body_len:
            raise FormatError(pos, "checkpoint runs table runs past the end")
        n_runs, n_holes = _RUNS_HEAD.unpack_from(buf, pos)
        pos += _RUNS_HEAD.size
        if n_runs > MAX_RUNS or n_holes > MAX_ENTRIES or pos + n_runs * _RUN.size + 8 * n_holes > body_len:
            raise FormatError(runs_at, "checkpoint runs table runs past the end")
        runs = [StoredRun(*_RUN.unpack_from(buf, pos + i * _RUN.size)) for i in range(n_runs)]
        pos += n_runs * _RUN.size
        h = array("q")
        h.frombytes(buf[pos : pos + 8 * n_holes])
        if sys.byteorder == "big":  # pragma: no cover
            h.byteswap()
        holes = h.tolist()
        pos += 8 * n_holes
        check_runs(files, runs, holes, runs_at)
    if pos + 32 * n != body_len:
        raise FormatError(pos, "checkpoint queue size does not match its count")
    queue_at = pos
    cols = []
    for _ in range(4):
        a = array("q")
        a.frombytes(buf[pos : pos + 8 * n])
        if sys.byteorder == "big":  # pragma: no cover
            a.byteswap()
        cols.append(a)
        pos += 8 * n
    check_entries(files, cols[0], cols[1], cols[2], cols[3], queue_at)
    if runs:
        firsts = [r.first for r in runs]
        for p in cols[0]:
            i = bisect_right(firsts, p) - 1
            if i >= 0 and p < runs[i].first + runs[i].length:
                raise FormatError(queue_at, f"checkpoint queue entry at position {p} lies inside a run")
    return Snapshot(
        woid,
        next_pos,
        next_txn,
        next_file,
        bytes(cid),
        created,
        files,
        positions=cols[0],
        file_ids=cols[1],
        offsets=cols[2],
        sizes=cols[3],
        taken=taken,
        file_dirs=file_dirs,
        marks=marks or [],
        marks_unread=marks is None,
        runs=runs,
        holes=holes,
    )


ROLE = "checkpoint"
_U32_LEN = struct.Struct("<I")


def _with_seal(blocks: Iterator[bytes], snap: Snapshot, hasher: Any) -> Iterator[bytes]:
    """The checkpoint's blocks, then (``hasher`` given) its authenticated-files extension and MAC trailer.

    The trailer's tag is taken from ``hasher`` once every block before it went
    through it (the caller feeds each block to ``hasher`` before writing it).
    """
    yield from blocks
    if hasher is None:
        return
    blob = fmt.encode_auth_state(snap.auth or fmt.AuthState(fmt.NO_AUTH_FILE, ()))
    yield blob + _U32_LEN.pack(len(blob))
    key_id, tag = hasher.finish()
    yield fmt.encode_sealed(b"", key_id, tag)


def decode_sealed(
    buf: bytes, crc_kind: int, channel_id: bytes, path: str, mac: MetaMac | None, required: bool
) -> Snapshot:
    """Decode a checkpoint file that may carry the authenticated extension and a MAC trailer.

    Raises:
        FormatError: Damaged, not this channel's, or its MAC fails (or is missing where ``required``).
        DecryptionError: Its MAC names a key that is not given.
    """
    body, key_id, tag = fmt.split_sealed(buf)
    if mac is not None:
        if key_id is None or tag is None:
            if required:
                raise FormatError(0, "checkpoint has no MAC, though the channel is encrypted and authenticated")
        else:
            problem = mac.check(path, ROLE, body, key_id, tag)
            if problem is not None:
                raise FormatError(0, f"checkpoint: {problem}")
    auth = None
    if key_id is not None:
        if len(body) < 4:
            raise FormatError(0, "checkpoint extension is truncated")
        (n,) = _U32_LEN.unpack_from(body, len(body) - 4)
        if n > len(body) - 4:
            raise FormatError(len(body) - 4, "checkpoint extension length runs past its start")
        auth = fmt.decode_auth_state(body[len(body) - 4 - n : len(body) - 4])
        body = body[: len(body) - 4 - n]
    snap = decode(bytes(body), crc_kind, channel_id, mac, path)
    snap.auth = auth
    return snap


@dataclass
class StoredCheckpoint:
    """A checkpoint file found on disk."""

    path: str
    woid: int
    size: int


class CheckpointStore:
    """The checkpoint files of a channel: the newest, and the previous one as backup.

    Args:
        fs: The I/O seam.
        primary: Directory of the newest checkpoints.
        backup: A second directory (another disk) that also receives every
            checkpoint, or None.
    """

    def __init__(self, fs: FS, primary: str, backup: str | None = None) -> None:
        self.fs = fs
        self.primary = primary
        self.backup = backup

    def dirs(self) -> list[str]:
        """Return the directories checkpoints are written to."""
        return [self.primary] + ([self.backup] if self.backup else [])

    def list(self) -> list[StoredCheckpoint]:
        """Return the checkpoint files found, newest (highest woid) first."""
        out = []
        for d in self.dirs():
            if not self.fs.exists(d):
                continue
            for name in self.fs.listdir(d):
                m = _NAME_RE.match(name)
                if m:
                    path = os.path.join(d, name)
                    try:
                        fd = self.fs.open_read(path)
                        try:
                            size = self.fs.size(fd)
                        finally:
                            self.fs.close(fd)
                    except OSError:
                        size = 0
                    out.append(StoredCheckpoint(path, int(m.group(1), 16), size))
        out.sort(key=lambda c: (-c.woid, c.path))
        return out

    def load(
        self,
        c: StoredCheckpoint,
        crc_kind: int,
        channel_id: bytes,
        mac: MetaMac | None = None,
        required: bool = False,
    ) -> Snapshot:
        """Read and decode one checkpoint file; with ``mac``, check its MAC.

        ``required``: a checkpoint without a MAC is refused too (the channel has
        authenticated data files; see :func:`filechannel.directory.verify_mac`).

        Raises:
            FormatError: It is damaged, not this channel's, or its MAC fails.
            DecryptionError: Its MAC names a key that is not given.
            OSError: It cannot be read.
        """
        return decode_sealed(read_file(self.fs, c.path), crc_kind, channel_id, c.path, mac, required)

    def write(
        self,
        snap: Snapshot,
        crc_kind: int,
        pace: Callable[[float], None] | None = None,
        mac: MetaMac | None = None,
    ) -> tuple[int, int]:
        """Write a snapshot atomically into every checkpoint directory; prune old ones.

        With ``mac`` (an encrypted channel) the snapshot's authenticated files
        follow it, and a MAC trailer ends the file.

        ``pace``, when given, is called after each intermediate flush (every
        :data:`SYNC_EVERY` bytes) with the fraction of the whole write done so
        far (all copies; about 32 bytes per queued event); it may sleep to spread
        the checkpoint's I/O over time (``checkpoint_spread``). It changes neither
        what is written nor when it is durable.

        Returns:
            ``(bytes written per copy, number of copies)``.

        Raises:
            OSError: A write, fsync or rename failed; the previous checkpoints are untouched.
        """
        name = checkpoint_name(snap.woid)
        fs = self.fs
        size = done = 0
        dirs = self.dirs()
        expected = max(1, ((snap.entry_count() + len(snap.runs or ())) * 32 + 4096) * len(dirs))
        for d in dirs:
            self._ensure_dir(d)
            final = os.path.join(d, name)
            tmp = os.path.join(d, f".{name}.tmp-{time.time_ns()}")
            fd = fs.create(tmp)
            try:
                # Block by block (one write for a small queue), so committers run in between.
                size = synced = 0
                hasher = mac.hasher(ROLE) if mac is not None else None
                for block in _with_seal(encode_blocks(snap, crc_kind, mac=mac), snap, hasher):
                    if hasher is not None:
                        hasher.update(block)
                    fs.pwrite_all(fd, block, size)
                    size += len(block)
                    if size - synced >= SYNC_EVERY:
                        # Flush as we go: one fsync of a long queue's checkpoint at the end
                        # would put tens of MB on the disk in front of every commit's fdatasync.
                        fs.fdatasync(fd)
                        synced = size
                        if pace is not None:
                            pace(min(1.0, (done + size) / expected))
                fs.fsync(fd)
            except BaseException:
                fs.close(fd)
                try:
                    fs.unlink(tmp)
                except OSError:
                    pass
                raise
            fs.close(fd)
            fs.replace(tmp, final)
            fs.fsync_dir(d)
            done += size
        self.prune(keep=2)
        return size, len(self.dirs())

    def _ensure_dir(self, d: str) -> None:
        """Create a checkpoint directory and make its entry durable in its parent."""
        if not self.fs.exists(d):
            self.fs.makedirs(d)
            self.fs.fsync_dir(os.path.dirname(os.path.abspath(d)))

    def note_open(self, info: dict[str, object]) -> None:
        """Record how the last open recovered (informational, not fsynced; ``stat`` shows it)."""
        fs = self.fs
        d = self.primary
        try:
            self._ensure_dir(d)
            path = os.path.join(d, LAST_OPEN)
            tmp = f"{path}.tmp-{time.time_ns()}"
            fd = fs.create(tmp)
            try:
                fs.pwrite_all(fd, json.dumps(info, sort_keys=True).encode(), 0)
            finally:
                fs.close(fd)
            fs.replace(tmp, path)
        except OSError as exc:
            logger.debug("could not record the last open: %s", exc)

    def last_open(self) -> dict[str, object] | None:
        """Return what :meth:`note_open` recorded, or None."""
        path = os.path.join(self.primary, LAST_OPEN)
        try:
            data = json.loads(read_file(self.fs, path))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def prune(self, keep: int) -> None:
        """Keep the ``keep`` newest checkpoints in each directory; remove the rest and stray temporaries."""
        fs = self.fs
        for d in self.dirs():
            if not fs.exists(d):
                continue
            names = fs.listdir(d)
            ckpts = sorted((n for n in names if _NAME_RE.match(n)), reverse=True)
            doomed = ckpts[keep:] + [
                n for n in names if ".tmp-" in n and (n.startswith(".ckpt-") or n.startswith(LAST_OPEN))
            ]
            for n in doomed:
                try:
                    self._shrink(os.path.join(d, n))
                    fs.unlink(os.path.join(d, n))
                except FileNotFoundError:
                    pass
            if doomed:
                fs.fsync_dir(d)

    def _shrink(self, path: str) -> None:
        """Truncate a long doomed checkpoint in steps before it is unlinked.

        Freeing tens of MB of blocks in one unlink holds the file system's
        journal long enough to stall every commit's fdatasync behind it; a few
        MB per step lets them through in between. Only ever applied to a file
        about to be removed (older than the two kept, or a stray temporary).
        """
        fs = self.fs
        try:
            fd = fs.open_rw(path)
        except FileNotFoundError:
            raise
        except OSError:
            return  # the unlink decides
        try:
            size = fs.size(fd)
            while size > SHRINK_STEP:
                size -= SHRINK_STEP
                fs.truncate(fd, size)
        finally:
            fs.close(fd)
