"""The on-disk format, as pure functions: bytes in, values out.

This module owns every byte layout of filechannel's data files: the file
header, the record frame, and the payload of each record kind. It performs no
I/O, keeps no state and never logs; it is what ``docs/format.md`` describes and
what the fuzz targets exercise. It promises one thing to callers: decoding
arbitrary bytes either returns a value, returns :data:`INCOMPLETE` (more bytes
are needed) or raises :class:`~filechannel.errors.FormatError`. Nothing else.

Policy (a torn tail versus corruption, skipping damage) lives in ``log.py``.

All integers are little-endian. Records are 8-byte aligned. Every record's
CRC is seeded with a per-file seed derived from the channel id and file id, so
a record copied from another file or another channel does not verify.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

from . import _accel
from .errors import EventFormatError, FormatError

_gcrc: Any
try:  # the C implementation; the pure-Python fallback is far too slow to use
    import google_crc32c as _gcrc
except ImportError:  # pragma: no cover - exercised only without the wheel
    _gcrc = None
HAVE_CRC32C: Final = _gcrc is not None and _gcrc.implementation == "c"

# The optional C accelerator (``_speedups.c``, chosen by ``_accel.py``): batch
# framing and verified-batch scanning. The Python code in this module and in
# scan.py is the reference implementation it is tested against byte for byte;
# FILECHANNEL_PURE_PYTHON=1 forces that path. ``speedups`` is None on the pure path.
speedups: Any = _accel.load()


def accelerator() -> str:
    """Return which per-event path is active: ``"c"`` (the accelerator) or ``"python"``."""
    return "c" if speedups is not None else "python"


MAGIC: Final = b"\x89FCW\r\n\x1a\n"
FORMAT_VERSION: Final = 1
AUTH_VERSION: Final = 2
"""The data file version of an authenticated file: encrypted, and every BATCH_END carries a batch tag.

A version 2 file's BATCH_END payload is 48 bytes: the 32 of version 1, then a
16-byte tag (an AEAD tag over nothing, under the file's batch key) whose
associated data is :func:`batch_auth_data`: the previous batch's tag (the first
batch's: the header's key check), every byte of the batch, and the BATCH_END's
own fields. Removing, reordering, editing or forging a batch breaks the chain.
Version 1 files (plaintext, and encrypted files of earlier releases) are still read.
"""
BATCH_TAG_LEN: Final = 16

# Checksum algorithms, recorded in the low 4 bits of a file header's flags.
# A file is written with one algorithm; polynomials are never mixed in a file.
CRC32C: Final = 1
CRC32_ZLIB: Final = 2
_CRC_MASK: Final = 0x0F
ENCRYPTED: Final = 0x10
"""Header flag: PUT payloads are encrypted; an encryption extension follows the live file ids."""
_KNOWN_FLAGS: Final = _CRC_MASK | ENCRYPTED

# The encryption extension of a file header (flag ENCRYPTED): cipher suite u8,
# key id length u8, 6 reserved zero bytes, a 32-byte salt, the key id (ASCII)
# padded to 8, then a 16-byte key check (an AEAD tag over the header before it).
_ENC_EXT: Final = struct.Struct("<BB6s32s")
ENC_SALT_LEN: Final = 32
ENC_CHECK_LEN: Final = 16
ENC_TAG_LEN: Final = 16
"""Bytes an encrypted PUT (or MARK) payload adds to its plaintext (the AEAD tag)."""
# Record flags (the frame's second byte). A PUT or MARK whose payload is sealed (encrypted)
# says so itself, so a reader that cannot see its file's header (damaged) still never decodes
# the ciphertext as an event or a mark. No other bit, and no flag on another op, is defined.
FLAG_SEALED: Final = 0x01

# Record kinds. 0 is never valid: zero-filled or never-written space must not
# parse as a record (Flume's OP_NOOP == 0 did exactly that).
PUT: Final = 1
TAKE: Final = 2
COMMIT: Final = 3
ROLLBACK: Final = 4
BATCH_END: Final = 5
RETIRE: Final = 6
MARK: Final = 7
SEALABLE_OPS: Final = frozenset((PUT, MARK))
"""The ops whose frames may carry :data:`FLAG_SEALED`: PUT and MARK."""
OP_NAMES: Final = {
    PUT: "put",
    TAKE: "take",
    COMMIT: "commit",
    ROLLBACK: "rollback",
    BATCH_END: "batch_end",
    RETIRE: "retire",
    MARK: "mark",
}

# File header: fixed part, then ``n_live`` u64 file ids, then a u32 CRC, then
# zero padding to a multiple of 8 (``header_len`` counts all of it).
_FILE_HEADER: Final = struct.Struct("<8sHHI16sQQQQQI")
FILE_HEADER_FIXED: Final = _FILE_HEADER.size  # 76
MAX_LIVE_FILES: Final = 1 << 16
MAX_HEADER_LEN: Final = FILE_HEADER_FIXED + 8 * MAX_LIVE_FILES + 8 + 312  # 312: the largest encryption extension

# Record frame: op u8, flags u8, reserved u16, payload_len u32, woid u64,
# txn_id u64 | crc u32, reserved u32 | payload | zero pad to 8.
_REC_HEAD: Final = struct.Struct("<BBHIQQ")
_REC_CRC: Final = struct.Struct("<II")
RECORD_HEADER_LEN: Final = 32
_PAD: Final = (b"", b"\0" * 7, b"\0" * 6, b"\0" * 5, b"\0" * 4, b"\0" * 3, b"\0" * 2, b"\0")

_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_KV_LEN: Final = struct.Struct("<II")
_COMMIT: Final = struct.Struct("<QII")
_RANGE: Final = struct.Struct("<QQ")
_TAKE_ONE: Final = struct.Struct("<IQQ")  # a TAKE payload of one range: its count (1), then the range
_ROLLBACK: Final = struct.Struct("<II")
_BATCH_END: Final = struct.Struct("<QIIQQ")
BATCH_END_SIZES: Final = (_BATCH_END.size, _BATCH_END.size + 16)  # version 1; version 2 (the tag last)
"""The payload lengths a BATCH_END may have (extend here, and ``batch_end_sizes`` in ``_speedups.c``)."""
FIXED_PAYLOAD_SIZES: Final[dict[int, tuple[int, ...]]] = {
    COMMIT: (_COMMIT.size,),
    ROLLBACK: (_ROLLBACK.size,),
    BATCH_END: BATCH_END_SIZES,
    RETIRE: (_U64.size,),
}
"""Every op but PUT and TAKE has a payload of a fixed length, checked before any byte of it is read."""
TAKE_RANGE_LEN: Final = _RANGE.size

# MARK (a transaction's key -> value marks): u32 count, u32 reserved (0), then per mark
# u64 origin woid, u16 key length, u16 value length, the key (UTF-8), the value.
MAX_MARK_KEY: Final = 128
"""Bytes of a mark's key (UTF-8), at most."""
MAX_MARK_VALUE: Final = 1024
"""Bytes of a mark's value, at most."""
MAX_MARKS_PER_RECORD: Final = 64
"""Marks in one MARK record (and in one transaction), at most."""
_MARK_HEAD: Final = struct.Struct("<II")
_MARK_ENTRY: Final = struct.Struct("<QHH")
MARK_MIN_PAYLOAD: Final = _MARK_HEAD.size + _MARK_ENTRY.size + 1
MARK_MAX_PAYLOAD: Final = _MARK_HEAD.size + MAX_MARKS_PER_RECORD * (_MARK_ENTRY.size + MAX_MARK_KEY + MAX_MARK_VALUE)
"""The payload lengths a MARK may have (``mark_min``/``mark_max`` in ``_speedups.c``: change both).

A sealed MARK (flag :data:`FLAG_SEALED`) is :data:`ENC_TAG_LEN` bytes longer: both bounds move up by it."""
EMPTY_HEADERS: Final = b"\0\0\0\0"
"""The PUT payload prefix of an event without headers (its body follows)."""


class _Incomplete:
    """Type of :data:`INCOMPLETE`."""

    _instance: _Incomplete | None = None

    def __repr__(self) -> str:
        return "INCOMPLETE"


INCOMPLETE: Final = _Incomplete()
"""Returned by decoders when the buffer ends before the value does."""


# --------------------------------------------------------------------------
# checksums


def crc(kind: int, data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """Return the checksum of ``data`` under algorithm ``kind``, extending ``seed``."""
    if kind == CRC32C:
        if _gcrc is None:  # pragma: no cover
            raise FormatError(0, "file uses CRC-32C but google-crc32c is not installed")
        return int(_gcrc.extend(seed, bytes(data) if isinstance(data, memoryview) else data))
    if kind == CRC32_ZLIB:
        return zlib.crc32(data, seed)
    raise FormatError(0, f"unknown checksum algorithm {kind}")


def default_crc_kind() -> int:
    """Return the checksum algorithm new channels use: CRC-32C when the C version exists."""
    return CRC32C if HAVE_CRC32C else CRC32_ZLIB


def file_seed(kind: int, channel_id: bytes, file_id: int) -> int:
    """Return the CRC seed of one data file: a checksum of the channel id and file id."""
    return crc(kind, channel_id + _U64.pack(file_id))


def pad_len(n: int) -> int:
    """Return how many zero bytes follow ``n`` bytes to reach 8-byte alignment."""
    return -n & 7


def record_size(payload_len: int) -> int:
    """Return the bytes a record with ``payload_len`` bytes of payload occupies."""
    return RECORD_HEADER_LEN + payload_len + (-payload_len & 7)


def frames_size(payloads: Sequence[bytes] | PutColumn, extra: int = 0) -> int:
    """Return the bytes the PUT frames of ``payloads`` occupy, each stored ``extra`` bytes longer.

    ``extra``: what the frame adds to each given payload (a shared prefix, a
    sealing tag). One C call with the accelerator (``_speedups.frames_size``;
    ``column_frames_size`` per chunk of a :class:`PutColumn`).
    """
    if type(payloads) is PutColumn:
        return sum(column_frames_size(offs, extra) for _, offs, _ in payloads.chunks)
    if speedups is not None:
        return int(speedups.frames_size(payloads, extra))
    # record_size(k) == (k + 39) & ~7
    return sum([(k + extra + 39) & ~7 for k in map(len, payloads)])


class PutColumn(Sequence[bytes]):
    """PUT payloads held as columns, not as one ``bytes`` object each (``Transaction.put_arrow``).

    Each chunk is ``(data, offsets, n)``: ``offsets`` holds ``n + 1`` native
    int64s from 0, and payload ``i`` of the chunk is ``data[offsets[i]:offsets[i + 1]]``;
    the payloads of the column are those of its chunks, in order. ``data`` and
    ``offsets`` are ``bytes`` the column owns (immutable), checked when made
    (``_speedups.put_column``). The writer frames a chunk with one call of
    :func:`encode_column`: the same bytes as :meth:`_RecordEncoder.add_puts` of
    :meth:`payloads`, without a Python object per payload.

    ``head``: the header block (``encode_event(b"", headers)``) every event of
    the column shares; the chunks hold the bodies and the PUT payload of a row
    is ``head + body`` (the transaction frames it with ``head`` as the prefix).
    ``put_arrow``'s columns have none (``EMPTY_HEADERS``); the Spark sink's commit
    gives its ``spark.query`` and ``spark.batch_id`` headers.
    """

    __slots__ = ("chunks", "head", "n")

    def __init__(self, head: bytes = EMPTY_HEADERS) -> None:
        self.chunks: list[tuple[bytes, bytes, int]] = []
        self.n = 0
        self.head = head

    def add(self, data: bytes, offsets: bytes, n: int) -> None:
        """Append a chunk of ``n`` payloads (``offsets``: ``n + 1`` native int64s from 0 into ``data``)."""
        if n:
            self.chunks.append((data, offsets, n))
            self.n += n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        """One payload (or a list of them): a copy, for code that wants them one by one (the writer does not)."""
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.n))]
        k = i + self.n if i < 0 else i
        if not 0 <= k < self.n:
            raise IndexError("PutColumn index out of range")
        for data, offs, n in self.chunks:
            if k < n:
                o = memoryview(offs).cast("q")
                return data[o[k] : o[k + 1]]
            k -= n
        raise AssertionError("unreachable")  # pragma: no cover

    @property
    def nbytes(self) -> int:
        """Bytes of all payloads together."""
        return sum(len(data) for data, _, _ in self.chunks)

    def payloads(self) -> list[bytes]:
        """The rows (bodies, without ``head``) as ``bytes`` objects, in order (one C call per chunk in C)."""
        out: list[bytes] = []
        for data, offs, n in self.chunks:
            if speedups is not None:
                out += speedups.arrow_puts(offs, data, n, 0, True, None, None)
            else:
                o = memoryview(offs).cast("q")
                out += [data[o[i] : o[i + 1]] for i in range(n)]
        return out

    def __repr__(self) -> str:
        return f"PutColumn(n={self.n}, chunks={len(self.chunks)}, head={len(self.head)} bytes)"


def _column_offsets(offsets: Any, data_len: int, who: str) -> memoryview:
    """The checked ``n + 1`` native int64 offsets of a column (the C twin's ``column_offsets``)."""
    b = memoryview(offsets).cast("B")
    if len(b) < 8 or len(b) % 8:
        raise ValueError(f"{who}: a column's offsets are n + 1 int64s")
    o = b.cast("q")
    if o[0] < 0 or any(o[i + 1] < o[i] for i in range(len(o) - 1)) or o[-1] > data_len:
        raise ValueError(f"{who}: an offset lies outside the data buffer")
    return o


def column_frames_size(offsets: Any, extra: int) -> int:
    """:func:`frames_size` of a column's payloads (``offsets``: ``n + 1`` native int64s).

    Raises:
        ValueError: ``offsets`` is not ``n + 1`` ascending int64s from 0 or more.
    """
    if speedups is not None:
        return int(speedups.column_frames_size(offsets, extra))
    o = _column_offsets(offsets, 1 << 62, "column_frames_size")
    return sum([(o[i + 1] - o[i] + extra + 39) & ~7 for i in range(len(o) - 1)])


def encode_column(
    seed: int,
    kind: int,
    woid: int,
    txn_id: int,
    data: Any,
    offsets: Any,
    out_offsets: MutableSequence[int],
    out_sizes: MutableSequence[int],
    offset: int,
    seal: Sealer | None = None,
    tag_len: int = 0,
    prefix: bytes = b"",
    out: bytearray | None = None,
    at: int = 0,
) -> tuple[bytes | int, int]:
    """The PUT frames of one column chunk, as one ``bytes`` object, and the offset after them.

    Payload ``i`` is ``prefix + data[offsets[i]:offsets[i + 1]]`` (``offsets``:
    native int64s); the frames are exactly those :meth:`_RecordEncoder.add_puts`
    makes of those payloads (write-order ids ``woid, woid + 1, ...``; each
    sealed by ``seal`` with a ``tag_len``-byte tag when it is given), and each
    frame's offset (from ``offset``) and size are appended to ``out_offsets``
    and ``out_sizes``. One C call with the accelerator (``_speedups.encode_column``:
    no Python object per payload unless it is sealed); :func:`_encode_column_py`
    is its twin. With ``out``, the frames are written into it from ``at`` and
    their length is returned in place of the bytes (the writer's reused buffer;
    after an error it may hold part of them). On an error the columns are unchanged.

    Raises:
        TypeError: ``out_offsets`` or ``out_sizes`` is neither a list nor an ``array("q")``.
        ValueError: An unknown ``kind``, a negative ``tag_len``, offsets that are not a
            column of ``data``, a sealer that returns the wrong length, or ``out`` too short.
        OverflowError: A payload longer than a u32.
    """
    if speedups is not None:
        frames, end = speedups.encode_column(
            seed, kind, woid, txn_id, data, offsets, out_offsets, out_sizes, offset, seal, tag_len, prefix, out, at
        )
        return frames, int(end)
    return _encode_column_py(
        seed, kind, woid, txn_id, data, offsets, out_offsets, out_sizes, offset, seal, tag_len, prefix, out, at
    )


def _encode_column_py(
    seed: int,
    kind: int,
    woid: int,
    txn_id: int,
    data: Any,
    offsets: Any,
    out_offsets: MutableSequence[int],
    out_sizes: MutableSequence[int],
    offset: int,
    seal: Sealer | None = None,
    tag_len: int = 0,
    prefix: bytes = b"",
    out: bytearray | None = None,
    at: int = 0,
) -> tuple[bytes | int, int]:
    """The pure-Python :func:`encode_column` (the reference): its bytes, columns and errors."""
    for name, col in (("offsets", out_offsets), ("sizes", out_sizes)):
        if not isinstance(col, list) and not hasattr(col, "frombytes"):
            raise TypeError(f"{name} must be a list or an array('q')")
    if seal is None:
        tag_len = 0
    elif tag_len < 0:
        raise ValueError("tag_len must not be negative")
    if kind == CRC32C and _gcrc is not None:
        ext = _gcrc.extend
    elif kind == CRC32_ZLIB:
        ext = _zlib_extend
    else:
        raise ValueError(f"unknown checksum algorithm {kind}")
    db = memoryview(data).cast("B")
    o = _column_offsets(offsets, len(db), "encode_column")
    count = len(o) - 1
    if any(len(prefix) + o[i + 1] - o[i] + tag_len > 0xFFFFFFFF for i in range(count)):
        raise OverflowError("record payload does not fit a u32 length")
    if out is not None:
        total = sum(record_size(len(prefix) + o[i + 1] - o[i] + tag_len) for i in range(count))
        view = memoryview(out).cast("B")
        if view.readonly:
            raise TypeError("encode_column: the output buffer is read-only")
        if at < 0 or len(view) - at < total:
            raise ValueError("encode_column: the output buffer is too short")
    flags = FLAG_SEALED if seal is not None else 0
    parts: list[bytes] = []
    offs: list[int] = []
    sizes: list[int] = []
    for i in range(count):
        payload = prefix + bytes(db[o[i] : o[i + 1]])
        n = len(payload) + tag_len
        head = _REC_HEAD.pack(PUT, flags, 0, n, woid + i, txn_id)
        if seal is not None:
            ct = seal(head, offset, payload)
            if not isinstance(ct, bytes) or len(ct) != n:
                got = len(ct) if isinstance(ct, bytes) else -1
                raise ValueError(f"the sealer returned {got} bytes for a {n}-byte sealed payload")
            payload = ct
        pad = _PAD[n & 7]
        parts += (head, _REC_CRC.pack(ext(ext(seed, head), payload), 0), payload, pad)
        size = 32 + n + len(pad)
        offs.append(offset)
        sizes.append(size)
        offset += size
    frames = b"".join(parts)
    out_offsets.extend(offs)
    out_sizes.extend(sizes)
    if out is not None:
        view[at : at + len(frames)] = frames
        return len(frames), offset
    return frames, offset


# --------------------------------------------------------------------------
# file header


@dataclass(frozen=True, slots=True)
class FileHeader:
    """The header at the start of every data file."""

    crc_kind: int
    channel_id: bytes
    file_id: int
    base_woid: int
    next_position: int
    next_txn_id: int
    created_ns: int
    live_files: tuple[int, ...] = ()
    version: int = FORMAT_VERSION
    cipher: int = 0  # 0: plaintext; else the cipher suite of its PUT payloads
    key_id: str = ""
    salt: bytes = b""
    key_check: bytes = b""

    @property
    def authenticated(self) -> bool:
        """Whether every batch of the file carries a chained tag (version 2)."""
        return self.version >= AUTH_VERSION

    @property
    def ext_len(self) -> int:
        """Bytes of the encryption extension (0 for a plaintext file)."""
        if not self.cipher:
            return 0
        k = len(self.key_id)
        return _ENC_EXT.size + k + pad_len(k) + ENC_CHECK_LEN

    @property
    def check_offset(self) -> int:
        """Where the key check starts: the header bytes before it are its associated data."""
        return FILE_HEADER_FIXED + 8 * len(self.live_files) + self.ext_len - ENC_CHECK_LEN

    @property
    def header_len(self) -> int:
        """Bytes the encoded header occupies, padding included."""
        n = FILE_HEADER_FIXED + 8 * len(self.live_files) + self.ext_len + 4
        return n + pad_len(n)


def encode_file_header(h: FileHeader, key_check: Callable[[bytes], bytes] | None = None) -> bytes:
    """Encode a file header; ``live_files`` lists the other live files of its directory.

    An encrypted header (``h.cipher`` set) needs ``key_check``: called with the
    header bytes before the key check, it returns the 16-byte check (the file
    cipher's); without it, ``h.key_check`` is used as it is.
    """
    if len(h.channel_id) != 16:
        raise FormatError(0, "channel id must be 16 bytes")
    if len(h.live_files) > MAX_LIVE_FILES:
        raise FormatError(0, f"more than {MAX_LIVE_FILES} live files")
    total = h.header_len
    if total > 0xFFFF:  # header_len is a u16: at most 8181 live files fit
        raise FormatError(10, f"{len(h.live_files)} live files do not fit in a file header (header_len is 16 bits)")
    body = _FILE_HEADER.pack(
        MAGIC,
        h.version,
        total,
        (h.crc_kind & _CRC_MASK) | (ENCRYPTED if h.cipher else 0),
        h.channel_id,
        h.file_id,
        h.base_woid,
        h.next_position,
        h.next_txn_id,
        h.created_ns,
        len(h.live_files),
    ) + b"".join(_U64.pack(f) for f in h.live_files)
    if h.cipher:
        kid = h.key_id.encode("ascii")
        if not 1 <= h.cipher <= 255 or not 1 <= len(kid) <= 255 or len(h.salt) != ENC_SALT_LEN:
            raise FormatError(0, "encryption extension needs a cipher suite, a key id and a 32-byte salt")
        body += _ENC_EXT.pack(h.cipher, len(kid), b"", h.salt) + kid + _PAD[len(kid) & 7]
        check = key_check(body) if key_check is not None else h.key_check
        if len(check) != ENC_CHECK_LEN:
            raise FormatError(0, "key check must be 16 bytes")
        body += check
    c = crc(h.crc_kind, body)
    out = body + _U32.pack(c)
    return out + b"\0" * (total - len(out))


def decode_file_header(buf: bytes | memoryview) -> FileHeader | _Incomplete:
    """Decode the header at the start of ``buf``.

    Returns :data:`INCOMPLETE` if ``buf`` is shorter than the header says it is.

    Raises:
        FormatError: the bytes are not a filechannel data file header.
    """
    if len(buf) < FILE_HEADER_FIXED:
        if bytes(buf[: len(MAGIC)]) != MAGIC[: len(buf)]:
            raise FormatError(0, "bad magic: not a filechannel data file")
        return INCOMPLETE
    (
        magic,
        version,
        header_len,
        flags,
        channel_id,
        file_id,
        base_woid,
        next_position,
        next_txn_id,
        created_ns,
        n_live,
    ) = _FILE_HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError(0, "bad magic: not a filechannel data file")
    if version not in (FORMAT_VERSION, AUTH_VERSION):
        raise FormatError(8, f"unsupported format version {version} (this reads {FORMAT_VERSION} and {AUTH_VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise FormatError(12, f"unknown header flags {flags:#x}")
    if version == AUTH_VERSION and not flags & ENCRYPTED:
        raise FormatError(12, "an authenticated (version 2) data file header without the encryption flag")
    kind = flags & _CRC_MASK
    if kind not in (CRC32C, CRC32_ZLIB):
        raise FormatError(12, f"unknown checksum algorithm {kind}")
    if n_live > MAX_LIVE_FILES:
        raise FormatError(72, f"live file count {n_live} exceeds {MAX_LIVE_FILES}")
    ext_at = FILE_HEADER_FIXED + 8 * n_live
    ext_len = 0
    if flags & ENCRYPTED:
        if len(buf) < ext_at + _ENC_EXT.size:
            if len(buf) >= header_len:
                raise FormatError(10, f"header length {header_len} leaves no room for the encryption extension")
            return INCOMPLETE
        k = buf[ext_at + 1]
        ext_len = _ENC_EXT.size + k + pad_len(k) + ENC_CHECK_LEN
    expect_len = ext_at + ext_len + 4
    expect_len += pad_len(expect_len)
    if header_len != expect_len:
        raise FormatError(10, f"header length {header_len} does not match {expect_len}")
    if len(buf) < header_len:
        return INCOMPLETE
    crc_at = ext_at + ext_len
    want = _U32.unpack_from(buf, crc_at)[0]
    if crc(kind, buf[:crc_at]) != want:
        raise FormatError(crc_at, "file header checksum mismatch")
    live = struct.unpack_from(f"<{n_live}Q", buf, FILE_HEADER_FIXED)
    cipher, key_id, salt, check = 0, "", b"", b""
    if ext_len:
        cipher, k, reserved, salt = _ENC_EXT.unpack_from(buf, ext_at)
        if cipher == 0:
            raise FormatError(ext_at, "encrypted file header names no cipher suite")
        if k == 0:
            raise FormatError(ext_at + 1, "encrypted file header names no key id")
        if reserved != bytes(6):
            raise FormatError(ext_at + 2, "reserved bytes of the encryption extension are set")
        kid_at = ext_at + _ENC_EXT.size
        try:
            key_id = bytes(buf[kid_at : kid_at + k]).decode("ascii")
        except UnicodeDecodeError:
            raise FormatError(kid_at, "key id is not ASCII") from None
        if any(buf[kid_at + k : kid_at + k + pad_len(k)]):
            raise FormatError(kid_at + k, "key id padding is not zero")
        salt = bytes(salt)
        check = bytes(buf[crc_at - ENC_CHECK_LEN : crc_at])
    return FileHeader(
        crc_kind=kind,
        channel_id=bytes(channel_id),
        file_id=file_id,
        base_woid=base_woid,
        next_position=next_position,
        next_txn_id=next_txn_id,
        created_ns=created_ns,
        live_files=tuple(live),
        version=version,
        cipher=cipher,
        key_id=key_id,
        salt=salt,
        key_check=check,
    )


# --------------------------------------------------------------------------
# records


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record frame. ``offset`` and ``size`` are relative to the buffer."""

    op: int
    woid: int
    txn_id: int
    offset: int
    size: int
    payload: bytes
    sealed: bool = False  # a PUT or MARK whose payload is encrypted (flag FLAG_SEALED)

    @property
    def end(self) -> int:
        """Offset just past this record (and its padding)."""
        return self.offset + self.size


def record_head(op: int, flags: int, payload_len: int, woid: int, txn_id: int) -> bytes:
    """A frame's bytes [0, 24) (op, flags, length, woid, txn id): what a sealed payload's associated data holds."""
    return _REC_HEAD.pack(op, flags, 0, payload_len, woid, txn_id)


def encode_record(op: int, woid: int, txn_id: int, payload: bytes, seed: int, kind: int) -> bytes:
    """Encode one record frame, padded to 8 bytes."""
    n = len(payload)
    head = _REC_HEAD.pack(op, 0, 0, n, woid, txn_id)
    c = crc(kind, payload, crc(kind, head, seed))
    return b"".join((head, _REC_CRC.pack(c, 0), payload, _PAD[n & 7]))


Sealer = Callable[[bytes, int, bytes], bytes]
"""``seal(frame bytes [0, 24), offset, payload) -> ciphertext``: what an encrypted file does to PUT payloads.

The ciphertext is :data:`ENC_TAG_LEN` bytes longer than the payload; the frame's
``payload_len`` (inside the 24 bytes it is given) already counts them.
"""


def record_encoder(seed: int, kind: int, sealer: Sealer | None = None) -> _RecordEncoder:
    """Return a fast encoder bound to one file's seed (the hot path of the writer).

    With ``sealer``, PUT payloads are sealed (encrypted) before they are framed:
    the frame's length and checksum cover the ciphertext. With the C accelerator
    active, :meth:`~_RecordEncoder.add_puts` frames a whole batch in one call
    (:class:`_CRecordEncoder`; sealing stays ``sealer``'s, one call per payload).
    """
    if speedups is not None:
        return _CRecordEncoder(seed, kind, sealer)
    return _RecordEncoder(seed, kind, sealer)


class _RecordEncoder:
    """Appends encoded frames to a list of parts; avoids per-call lookups."""

    __slots__ = ("_extend", "_kind", "_sealer", "_seed")

    def __init__(self, seed: int, kind: int, sealer: Sealer | None = None) -> None:
        self._seed = seed
        self._kind = kind
        self._sealer = sealer
        if kind == CRC32C and _gcrc is not None:
            self._extend = _gcrc.extend
        elif kind == CRC32_ZLIB:
            self._extend = _zlib_extend
        else:  # pragma: no cover
            raise FormatError(0, f"unknown checksum algorithm {kind}")

    def add(self, parts: list[bytes], op: int, woid: int, txn_id: int, payload: bytes) -> int:
        """Append one frame's pieces to ``parts``; return its size in bytes."""
        n = len(payload)
        head = _REC_HEAD.pack(op, 0, 0, n, woid, txn_id)
        ext = self._extend
        c = ext(ext(self._seed, head), payload)
        pad = _PAD[n & 7]
        parts += (head, _REC_CRC.pack(c, 0), payload, pad)
        return 32 + n + len(pad)

    def add_sealed(self, parts: list[bytes], op: int, woid: int, txn_id: int, payload: bytes, offset: int) -> int:
        """:meth:`add` of a frame at ``offset`` whose payload an encrypted file seals (a MARK's).

        With the file's sealer the payload is sealed as a PUT's is (the same
        nonce and associated data) and the frame says :data:`FLAG_SEALED`;
        without one this is :meth:`add`.
        """
        seal = self._sealer
        if seal is None:
            return self.add(parts, op, woid, txn_id, payload)
        n = len(payload) + ENC_TAG_LEN
        head = _REC_HEAD.pack(op, FLAG_SEALED, 0, n, woid, txn_id)
        data = seal(head, offset, payload)
        if len(data) != n:
            raise ValueError(f"the sealer returned {len(data)} bytes for a {len(payload)}-byte sealed payload")
        return self._add_frame(parts, head, data)

    def _add_frame(self, parts: list[bytes], head: bytes, payload: bytes) -> int:
        """Append the frame of a packed 24-byte ``head`` and its ``payload``; return its size."""
        ext = self._extend
        pad = _PAD[len(payload) & 7]
        parts += (head, _REC_CRC.pack(ext(ext(self._seed, head), payload), 0), payload, pad)
        return 32 + len(payload) + len(pad)

    def add_puts(
        self,
        parts: list[bytes],
        woid: int,
        txn_id: int,
        payloads: Iterable[bytes] | PutColumn,
        offsets: MutableSequence[int],
        sizes: MutableSequence[int],
        offset: int,
        prefix: bytes = b"",
    ) -> int:
        """Append a PUT frame per payload (write-order ids ``woid, woid + 1, ...``).

        Each frame's offset (starting at ``offset``) and size go to ``offsets``
        and ``sizes`` (lists, or ``array("q")`` columns). Each frame holds
        ``prefix + payload``: a caller whose payloads all begin alike (events
        without headers) passes that part once. Returns the offset after the
        last frame. This is :meth:`add` in one loop, without a call per event.
        """
        ext = self._extend
        seed = self._seed
        head_pack = _REC_HEAD.pack
        crc_pack = _REC_CRC.pack
        pads = _PAD
        seal = self._sealer
        # A sealed (encrypted) PUT says so in its flags; its stored payload is the ciphertext,
        # ENC_TAG_LEN bytes longer, and the checksum covers that.
        flags, grow = (FLAG_SEALED, ENC_TAG_LEN) if seal is not None else (0, 0)
        if type(payloads) is PutColumn:
            return self._add_column(parts, woid, txn_id, payloads, offsets, sizes, offset, prefix)
        for payload in payloads:
            if prefix:  # the frame's payload is prefix + payload (see the C twin: no join there)
                payload = prefix + payload
            n = len(payload) + grow
            head = head_pack(PUT, flags, 0, n, woid, txn_id)
            data = payload if seal is None else seal(head, offset, payload)
            pad = pads[n & 7]
            parts += (head, crc_pack(ext(ext(seed, head), data), 0), data, pad)
            size = 32 + n + len(pad)
            offsets.append(offset)
            sizes.append(size)
            offset += size
            woid += 1
        return offset

    def _add_column(
        self,
        parts: list[bytes],
        woid: int,
        txn_id: int,
        column: PutColumn,
        offsets: MutableSequence[int],
        sizes: MutableSequence[int],
        offset: int,
        prefix: bytes,
    ) -> int:
        """:meth:`add_puts` of a :class:`PutColumn`: one :func:`encode_column` call (one bytes part) per chunk."""
        for data, offs, n in column.chunks:
            frames, offset = encode_column(
                self._seed,
                self._kind,
                woid,
                txn_id,
                data,
                offs,
                offsets,
                sizes,
                offset,
                self._sealer,
                ENC_TAG_LEN,
                prefix,
            )
            assert isinstance(frames, bytes)
            parts.append(frames)
            woid += n
        return offset

    def adopt_buffer(self, old: _RecordEncoder) -> None:
        """Take over the frame buffer of ``old`` (the previous file's encoder; its batches are written)."""

    def close_batch(self, parts: list[bytes], start: int, first_woid: int, woid: int) -> int:
        """Append the BATCH_END frame that closes the batch in ``parts``; return its size.

        The batch was written at offset ``start`` and holds write-order ids
        ``first_woid .. woid - 1``; the frame takes ``woid``. Its checksum,
        seeded with the file's seed, covers every byte of ``parts``.
        """
        return self.add(parts, BATCH_END, woid, 0, self._batch_fields(parts, start, first_woid, woid))

    def _batch_fields(self, parts: list[bytes], start: int, first_woid: int, woid: int) -> bytes:
        """The fixed 32 bytes of a BATCH_END payload: the batch's start, length, checksum and woids."""
        if woid == 0:
            raise ValueError("close_batch: a batch ends after its first record")
        ext = self._extend
        body_crc = self._seed
        body_len = 0
        for part in parts:
            if type(part) is not bytes:  # a view of the writer's frame buffer (see _CRecordEncoder)
                part = bytes(part)
            body_crc = ext(body_crc, part)
            body_len += len(part)
        return _BATCH_END.pack(start, body_len, body_crc, first_woid, woid - 1)

    def close_batch_auth(
        self,
        parts: list[bytes],
        start: int,
        first_woid: int,
        woid: int,
        tagger: Callable[[int, bytes], bytes],
        prev_tag: bytes,
    ) -> tuple[int, bytes]:
        """:meth:`close_batch` for an authenticated file: the BATCH_END also carries the batch tag.

        ``tagger(woid, data)`` returns the 16-byte tag of :func:`batch_auth_data`
        (``data``) under the file's batch key, the BATCH_END's write-order id as
        nonce. Returns the frame's size and the tag (the next batch's ``prev_tag``).
        """
        fixed = self._batch_fields(parts, start, first_woid, woid)
        head = _REC_HEAD.pack(BATCH_END, 0, 0, len(fixed) + BATCH_TAG_LEN, woid, 0)
        tag = tagger(woid, b"".join((prev_tag, *parts, head, fixed)))
        if len(tag) != BATCH_TAG_LEN:
            raise ValueError("a batch tag is 16 bytes")
        return self.add(parts, BATCH_END, woid, 0, fixed + tag), tag


SCRATCH_MAX: Final = 32 << 20
"""Bytes of PUT column frames a C encoder writes into one reused buffer (more: a new ``bytes`` each time)."""


class _CRecordEncoder(_RecordEncoder):
    """:class:`_RecordEncoder` with :meth:`add_puts` in C: the same bytes, one call per batch.

    A :class:`PutColumn`'s frames are written into a buffer the encoder keeps
    and reuses batch after batch (at most :data:`SCRATCH_MAX` bytes; the writer
    hands it to the next file's encoder at a roll): a fresh ``bytes`` of that
    size is often new pages from the kernel, and their page faults cost more
    than the framing (10 ms against 3 ms for 13 MiB on the 2-core VM).
    ``parts`` then holds views of it, valid until the next batch is framed (the
    writer writes a batch before it frames the next, under its I/O lock).
    """

    __slots__ = ("_scratch", "_used")

    def __init__(self, seed: int, kind: int, sealer: Sealer | None = None) -> None:
        super().__init__(seed, kind, sealer)
        self._scratch = bytearray()
        self._used = 0  # bytes of the scratch the batch being framed holds

    def _batch_fields(self, parts: list[bytes], start: int, first_woid: int, woid: int) -> bytes:
        """:meth:`_RecordEncoder._batch_fields` with the C checksum, which reads views of the frame buffer in place."""
        if woid == 0:
            raise ValueError("close_batch: a batch ends after its first record")
        assert speedups is not None
        crc_of = speedups.crc
        kind = self._kind
        body_crc = self._seed
        body_len = 0
        for part in parts:
            body_crc = crc_of(kind, part, body_crc)
            body_len += len(part)
        return _BATCH_END.pack(start, body_len, body_crc, first_woid, woid - 1)

    def adopt_buffer(self, old: _RecordEncoder) -> None:
        """Take over the frame buffer of ``old``: a file roll does not cost its pages again."""
        if isinstance(old, _CRecordEncoder):
            self._scratch, old._scratch = old._scratch, bytearray()

    def _add_column(
        self,
        parts: list[bytes],
        woid: int,
        txn_id: int,
        column: PutColumn,
        offsets: MutableSequence[int],
        sizes: MutableSequence[int],
        offset: int,
        prefix: bytes,
    ) -> int:
        """:meth:`_RecordEncoder._add_column`, each chunk framed into the reused buffer when it fits."""
        extra = len(prefix) + (ENC_TAG_LEN if self._sealer is not None else 0)
        for data, offs, n in column.chunks:
            size = column_frames_size(offs, extra)
            at = self._used
            if at + size > SCRATCH_MAX:
                frames, offset = encode_column(
                    self._seed, self._kind, woid, txn_id, data, offs, offsets, sizes, offset, self._sealer,
                    ENC_TAG_LEN, prefix,
                )  # fmt: skip
                parts.append(frames)  # type: ignore[arg-type]
            else:
                if at + size > len(self._scratch):  # a new buffer: views of the old one stay valid
                    # not zero-filled (bytearray(n) is): its pages are touched once, by the frames
                    self._scratch = speedups.frame_buffer(min(SCRATCH_MAX, max(at + size, 2 * len(self._scratch))))
                buf = self._scratch
                _, offset = encode_column(
                    self._seed, self._kind, woid, txn_id, data, offs, offsets, sizes, offset, self._sealer,
                    ENC_TAG_LEN, prefix, buf, at,
                )  # fmt: skip
                parts.append(memoryview(buf)[at : at + size])  # type: ignore[arg-type]
                self._used = at + size
            woid += n
        return offset

    def add(self, parts: list[bytes], op: int, woid: int, txn_id: int, payload: bytes) -> int:
        """Append the frame of :meth:`_RecordEncoder.add` to ``parts`` as one bytes object."""
        return self._add_frame(parts, _REC_HEAD.pack(op, 0, 0, len(payload), woid, txn_id), payload)

    def _add_frame(self, parts: list[bytes], head: bytes, payload: bytes) -> int:
        """:meth:`_RecordEncoder._add_frame` in one C call (one bytes object)."""
        assert speedups is not None
        frame: bytes = speedups.frame_record(self._seed, self._kind, head, payload)
        parts.append(frame)
        return len(frame)

    def close_batch(self, parts: list[bytes], start: int, first_woid: int, woid: int) -> int:
        """:meth:`_RecordEncoder.close_batch` in one C call."""
        assert speedups is not None
        frame: bytes = speedups.close_batch(self._seed, self._kind, parts, start, first_woid, woid)
        parts.append(frame)
        self._used = 0  # the next batch reuses the frame buffer (this one is written first)
        return len(frame)

    def close_batch_auth(
        self,
        parts: list[bytes],
        start: int,
        first_woid: int,
        woid: int,
        tagger: Callable[[int, bytes], bytes],
        prev_tag: bytes,
    ) -> tuple[int, bytes]:
        """:meth:`_RecordEncoder.close_batch_auth`; the next batch reuses the frame buffer."""
        got = super().close_batch_auth(parts, start, first_woid, woid, tagger, prev_tag)
        self._used = 0
        return got

    def add_puts(
        self,
        parts: list[bytes],
        woid: int,
        txn_id: int,
        payloads: Iterable[bytes] | PutColumn,
        offsets: MutableSequence[int],
        sizes: MutableSequence[int],
        offset: int,
        prefix: bytes = b"",
    ) -> int:
        """Append the frames of :meth:`_RecordEncoder.add_puts` to ``parts`` as one bytes object."""
        if type(payloads) is PutColumn:
            return self._add_column(parts, woid, txn_id, payloads, offsets, sizes, offset, prefix)
        frames, end = speedups.encode_puts(
            self._seed, self._kind, woid, txn_id, payloads, offsets, sizes, offset, self._sealer, ENC_TAG_LEN, prefix
        )
        parts.append(frames)
        return int(end)


def _zlib_extend(crc_value: int, data: bytes) -> int:
    return zlib.crc32(data, crc_value)


def payload_len_error(op: int, n: int) -> str:
    """The reason a frame of fixed-size op ``op`` with payload length ``n`` is refused (the C twin's too)."""
    sizes = " or ".join(map(str, FIXED_PAYLOAD_SIZES[op]))
    return f"{OP_NAMES[op]} payload length {n} is not {sizes}"


def mark_len_bounds(sealed: bool) -> tuple[int, int]:
    """The payload lengths a MARK frame may have: a sealed one's are :data:`ENC_TAG_LEN` bytes longer."""
    grow = ENC_TAG_LEN if sealed else 0
    return MARK_MIN_PAYLOAD + grow, MARK_MAX_PAYLOAD + grow


def mark_len_error(n: int, sealed: bool = False) -> str:
    """The reason a MARK frame with payload length ``n`` is refused (the C twin's too)."""
    lo, hi = mark_len_bounds(sealed)
    return f"mark payload length {n} is not between {lo} and {hi}"


def decode_record(
    buf: bytes | bytearray | memoryview, offset: int, seed: int, kind: int, max_payload: int
) -> Record | _Incomplete:
    """Decode the record frame starting at ``offset`` in ``buf``.

    Returns :data:`INCOMPLETE` if the frame runs past the end of ``buf``.
    A declared payload length above ``max_payload``, or one its op cannot
    have (:data:`FIXED_PAYLOAD_SIZES`; a TAKE holds whole ranges, as many as
    its count says; a MARK's is bounded), is rejected before the payload is copied or checksummed:
    a damaged length never causes a large allocation, and refusing a frame
    that is not a record costs a constant amount of work (except a PUT's).

    Raises:
        FormatError: the frame is not a valid record (bad op, length or checksum).
    """
    avail = len(buf) - offset
    if avail < RECORD_HEADER_LEN:
        if avail > 0 and buf[offset] not in OP_NAMES:
            raise FormatError(offset, f"invalid record op {buf[offset]}")
        return INCOMPLETE
    op, flags, reserved, n, woid, txn_id = _REC_HEAD.unpack_from(buf, offset)
    if op not in OP_NAMES:
        raise FormatError(offset, f"invalid record op {op}")
    if reserved or (flags and (flags != FLAG_SEALED or op not in SEALABLE_OPS)):
        raise FormatError(offset + 1, "reserved record bits are set")
    if n > max_payload:
        raise FormatError(offset + 4, f"record payload length {n} exceeds the limit {max_payload}")
    fixed = FIXED_PAYLOAD_SIZES.get(op)
    if fixed is not None and n not in fixed:
        raise FormatError(offset + 4, payload_len_error(op, n))
    if op == TAKE and (n < 4 or (n - 4) % TAKE_RANGE_LEN):
        raise FormatError(offset + 4, f"take payload length {n} does not hold whole ranges")
    if op == MARK:
        lo, hi = mark_len_bounds(flags == FLAG_SEALED)
        if not lo <= n <= hi:
            raise FormatError(offset + 4, mark_len_error(n, flags == FLAG_SEALED))
    size = RECORD_HEADER_LEN + n + (-n & 7)
    if avail < size:
        return INCOMPLETE
    start = offset + RECORD_HEADER_LEN
    if op == TAKE and (count := _U32.unpack_from(buf, start)[0]) != (n - 4) // TAKE_RANGE_LEN:
        raise FormatError(offset + 4, f"take payload length {n} does not match its range count {count}")
    want, reserved2 = _REC_CRC.unpack_from(buf, offset + 24)
    payload = bytes(buf[start : start + n])
    got = crc(kind, payload, crc(kind, buf[offset : offset + 24], seed))
    if got != want or reserved2:
        raise FormatError(offset, "record checksum mismatch")
    return Record(op, woid, txn_id, offset, size, payload, flags == FLAG_SEALED)


# --------------------------------------------------------------------------
# payloads


def encode_event(body: bytes, headers: Mapping[str, str] | None) -> bytes:
    """Encode an event (headers, then body) as a PUT payload.

    Callers validate types first; this function assumes ``str`` keys and values.
    Header text is encoded as strict UTF-8, so every stored header is valid
    UTF-8 for any reader (Arrow and Spark refuse anything else).

    Raises:
        UnicodeEncodeError: a header key or value is not valid text, e.g. holds a
            lone surrogate such as U+D800 (the caller names the header).
    """
    if not headers:
        return EMPTY_HEADERS + body
    parts = [_U32.pack(len(headers))]
    for k, v in headers.items():
        kb = k.encode("utf-8")
        vb = v.encode("utf-8")
        parts += (_KV_LEN.pack(len(kb), len(vb)), kb, vb)
    parts.append(body)
    return b"".join(parts)


def encoded_event_size(body: bytes, headers: Mapping[str, str] | None) -> int:
    """``len(encode_event(body, headers))`` without building it (a source's ``max_event_size`` check).

    Raises:
        UnicodeEncodeError: as :func:`encode_event`.
    """
    if not headers:
        return len(EMPTY_HEADERS) + len(body)
    return (
        _U32.size
        + len(body)
        + sum(_KV_LEN.size + len(k.encode("utf-8")) + len(v.encode("utf-8")) for k, v in headers.items())
    )


def decode_event(payload: bytes) -> tuple[bytes, dict[str, str]]:
    """Decode a PUT payload into ``(body, headers)``.

    Raises:
        EventFormatError: the payload is malformed (a :class:`FormatError`).
    """
    n = len(payload)
    if n < 4:
        raise EventFormatError(0, "event payload shorter than its header count")
    count = _U32.unpack_from(payload, 0)[0]
    if count == 0:
        return payload[4:], {}
    if count > (n - 4) // 8:
        raise EventFormatError(0, f"event header count {count} exceeds the payload")
    headers: dict[str, str] = {}
    pos = 4
    for _ in range(count):
        if pos + 8 > n:
            raise EventFormatError(pos, "event header runs past the payload")
        kl, vl = _KV_LEN.unpack_from(payload, pos)
        pos += 8
        if pos + kl + vl > n:
            raise EventFormatError(pos, "event header runs past the payload")
        try:
            # surrogatepass: records written before header text became strict UTF-8
            # may hold encoded lone surrogates; they must still decode (as before).
            k = payload[pos : pos + kl].decode("utf-8", "surrogatepass")
            v = payload[pos + kl : pos + kl + vl].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise EventFormatError(pos, "event header is not valid UTF-8") from exc
        headers[k] = v
        pos += kl + vl
    return payload[pos:], headers


DecodedPut = tuple[bytes, dict[str, str]] | bytes | FormatError
"""One record's result from :func:`decode_puts`: the event, the verified payload left undecoded, or why not."""


def decode_puts(
    buf: bytes | bytearray | memoryview,
    offsets: Sequence[int],
    sizes: Sequence[int],
    seed: int,
    kind: int,
    max_payload: int,
    decode: bool = True,
) -> list[DecodedPut]:
    """Verify the records at ``offsets`` (each ``sizes[i]`` bytes) in ``buf`` and decode their events.

    The batch form of reading one queue entry: for each record, exactly what
    :func:`decode_record` on those ``sizes[i]`` bytes alone, then
    :func:`decode_event` on its payload, would give. Per record, in order:

    - ``(body, headers)``: the record verified and its payload decoded;
    - ``bytes``: the record verified and this is its payload, not decoded
      (``decode`` is false, or the record is sealed: encrypted payloads are the
      caller's to open);
    - a :class:`FormatError` (not raised): the frame is not a valid record of
      exactly that size; ``offset`` is relative to the record's start;
    - an :class:`EventFormatError` (not raised): the frame verified but the
      payload does not decode; ``offset`` is relative to the payload.

    With the C accelerator the loop runs in one C call
    (``_speedups.decode_puts``); :func:`_decode_puts` is the reference it is
    tested against.

    Raises:
        FormatError: ``kind`` is not a checksum algorithm.
        ValueError: ``offsets`` and ``sizes`` differ in length, an offset or
            ``max_payload`` is negative.
    """
    if speedups is not None:
        return speedups.decode_puts(  # type: ignore[no-any-return]
            buf, offsets, sizes, seed, kind, max_payload, decode, FormatError, EventFormatError
        )
    return _decode_puts(buf, offsets, sizes, seed, kind, max_payload, decode)


def _decode_puts(
    buf: bytes | bytearray | memoryview,
    offsets: Sequence[int],
    sizes: Sequence[int],
    seed: int,
    kind: int,
    max_payload: int,
    decode: bool = True,
) -> list[DecodedPut]:
    """The pure-Python :func:`decode_puts` (the reference implementation)."""
    if kind not in (CRC32C, CRC32_ZLIB):
        raise FormatError(0, f"unknown checksum algorithm {kind}")
    if len(offsets) != len(sizes):
        raise ValueError("offsets and sizes differ in length")
    if max_payload < 0:
        raise ValueError("max_payload must not be negative")
    view = memoryview(buf)
    out: list[DecodedPut] = []
    for off, size in zip(offsets, sizes, strict=True):
        if off < 0:
            raise ValueError(f"negative record offset {off}")
        try:
            # the record alone, as one pread of its pointer would return it
            rec = decode_record(view[off : off + max(size, 0)], 0, seed, kind, max_payload)
            if not isinstance(rec, Record) or rec.size != size:
                raise FormatError(0, "record is shorter than expected")
        except FormatError as exc:
            out.append(exc)
            continue
        if not decode or rec.sealed:
            out.append(rec.payload)
            continue
        try:
            out.append(decode_event(rec.payload))
        except EventFormatError as exc:
            out.append(exc)
    return out


def encode_commit(first_position: int, n_puts: int, n_takes: int) -> bytes:
    """Encode a COMMIT payload: the positions its puts receive, and its take count."""
    return _COMMIT.pack(first_position, n_puts, n_takes)


def decode_commit(payload: bytes) -> tuple[int, int, int]:
    """Decode a COMMIT payload into ``(first_position, n_puts, n_takes)``.

    Raises:
        FormatError: the payload has the wrong size.
    """
    if len(payload) != _COMMIT.size:
        raise FormatError(0, f"commit payload is {len(payload)} bytes, expected {_COMMIT.size}")
    return _COMMIT.unpack(payload)  # type: ignore[return-value]


def encode_take(ranges: Iterable[tuple[int, int]]) -> bytes:
    """Encode a TAKE payload: ``(first_position, count)`` ranges of taken positions."""
    rs = list(ranges)
    if len(rs) == 1:  # the usual take
        return _TAKE_ONE.pack(1, *rs[0])
    return _U32.pack(len(rs)) + b"".join([_RANGE.pack(a, c) for a, c in rs])


def decode_take(payload: bytes) -> list[tuple[int, int]]:
    """Decode a TAKE payload into its position ranges.

    Raises:
        FormatError: the payload is malformed.
    """
    if len(payload) < 4:
        raise FormatError(0, "take payload shorter than its range count")
    n = _U32.unpack_from(payload, 0)[0]
    if len(payload) != 4 + 16 * n:
        raise FormatError(0, f"take payload size does not match {n} ranges")
    return [_RANGE.unpack_from(payload, 4 + 16 * i) for i in range(n)]  # type: ignore[misc]


def encode_rollback(n_puts: int, n_takes: int) -> bytes:
    """Encode a ROLLBACK payload (informational counts)."""
    return _ROLLBACK.pack(n_puts, n_takes)


def decode_rollback(payload: bytes) -> tuple[int, int]:
    """Decode a ROLLBACK payload into ``(n_puts, n_takes)``.

    Raises:
        FormatError: the payload has the wrong size.
    """
    if len(payload) != _ROLLBACK.size:
        raise FormatError(0, "rollback payload has the wrong size")
    return _ROLLBACK.unpack(payload)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Mark:
    """One mark of a MARK record: ``key`` -> ``value``, ordered by ``woid``.

    ``woid`` is the write-order id of the COMMIT of the transaction that set
    the mark; 0 in a transaction's own MARK record, meaning "this
    transaction's COMMIT". A re-logged mark keeps the woid of its original.
    """

    key: str
    value: bytes
    woid: int = 0


def check_mark(key: object, value: object) -> tuple[str, bytes]:
    """Validate a mark's key and value; return them as ``(str, bytes)``.

    A key is 1 to :data:`MAX_MARK_KEY` bytes of UTF-8 text without control
    characters; a value is bytes-like of at most :data:`MAX_MARK_VALUE` bytes.

    Raises:
        TypeError: The key is not a str, or the value is not bytes-like.
        ValueError: Either is empty (the key), too long or not valid text.
    """
    if not isinstance(key, str):
        raise TypeError(f"a mark key is a str, not {type(key).__name__}")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"a mark value is bytes, not {type(value).__name__}")
    try:
        kb = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a mark key must be valid UTF-8 text (it holds a lone surrogate)") from None
    if not 0 < len(kb) <= MAX_MARK_KEY or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(
            f"a mark key is 1 to {MAX_MARK_KEY} bytes of text without control characters, not {len(kb)} bytes"
        )
    v = bytes(value)
    if len(v) > MAX_MARK_VALUE:
        raise ValueError(f"a mark value is at most {MAX_MARK_VALUE} bytes, not {len(v)}")
    return key, v


def encode_marks(marks: Sequence[Mark]) -> bytes:
    """Encode a MARK payload (1 to :data:`MAX_MARKS_PER_RECORD` marks, checked by :func:`check_mark`).

    Raises:
        ValueError: No marks, too many, or one out of bounds.
    """
    if not 0 < len(marks) <= MAX_MARKS_PER_RECORD:
        raise ValueError(f"a MARK record holds 1 to {MAX_MARKS_PER_RECORD} marks, not {len(marks)}")
    out = [_MARK_HEAD.pack(len(marks), 0)]
    for m in marks:
        key, value = check_mark(m.key, m.value)
        kb = key.encode("utf-8")
        out += (_MARK_ENTRY.pack(m.woid, len(kb), len(value)), kb, value)
    return b"".join(out)


def decode_marks(payload: bytes | memoryview) -> list[Mark]:
    """Decode a MARK payload into its marks, in record order.

    Raises:
        FormatError: The payload is malformed: a count, a length or a key out of bounds.
    """
    n_bytes = len(payload)
    if not MARK_MIN_PAYLOAD <= n_bytes <= MARK_MAX_PAYLOAD:
        raise FormatError(0, mark_len_error(n_bytes))
    n, reserved = _MARK_HEAD.unpack_from(payload, 0)
    if reserved:
        raise FormatError(4, "reserved mark bytes are set")
    if not 0 < n <= MAX_MARKS_PER_RECORD:
        raise FormatError(0, f"mark count {n} is not between 1 and {MAX_MARKS_PER_RECORD}")
    pos = _MARK_HEAD.size
    out = []
    for _ in range(n):
        if pos + _MARK_ENTRY.size > n_bytes:
            raise FormatError(pos, "mark runs past the end of its record")
        woid, klen, vlen = _MARK_ENTRY.unpack_from(payload, pos)
        pos += _MARK_ENTRY.size
        if not 0 < klen <= MAX_MARK_KEY or vlen > MAX_MARK_VALUE or pos + klen + vlen > n_bytes:
            raise FormatError(pos - 4, f"mark key length {klen} or value length {vlen} is out of bounds")
        try:
            key = bytes(payload[pos : pos + klen]).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(pos, "mark key is not UTF-8") from None
        out.append(Mark(key, bytes(payload[pos + klen : pos + klen + vlen]), woid))
        pos += klen + vlen
    if pos != n_bytes:
        raise FormatError(pos, "mark record has bytes after its last mark")
    return out


@dataclass(frozen=True, slots=True)
class BatchEnd:
    """The commit frame that closes one write: a checksum over the whole batch."""

    batch_start: int
    batch_len: int
    batch_crc: int
    first_woid: int
    last_woid: int
    tag: bytes = b""  # an authenticated file's batch tag (empty in version 1)


def encode_batch_end(b: BatchEnd) -> bytes:
    """Encode a BATCH_END payload (with its tag, when it has one)."""
    return _BATCH_END.pack(b.batch_start, b.batch_len, b.batch_crc, b.first_woid, b.last_woid) + b.tag


def decode_batch_end(payload: bytes) -> BatchEnd:
    """Decode a BATCH_END payload: 32 bytes, or 48 in an authenticated file (the tag last).

    Raises:
        FormatError: the payload has the wrong size.
    """
    n = len(payload)
    if n != _BATCH_END.size and n != _BATCH_END.size + BATCH_TAG_LEN:
        raise FormatError(0, "batch_end payload has the wrong size")
    start, length, batch_crc, first, last = _BATCH_END.unpack_from(payload)
    return BatchEnd(start, length, batch_crc, first, last, bytes(payload[_BATCH_END.size :]))


def batch_auth_data(
    prev_tag: bytes, batch: bytes | bytearray | memoryview, frame: bytes | bytearray | memoryview
) -> bytes:
    """What an authenticated file's batch tag covers (its associated data).

    ``prev_tag`` is the previous batch's tag (the header's key check for a file's
    first batch), ``batch`` every byte of the batch before its BATCH_END, and
    ``frame`` the BATCH_END frame (at least its first 64 bytes): its op, flags,
    length, write-order id and transaction id (bytes 0-24) and the fixed part of
    its payload (bytes 32-64). The frame's checksum (bytes 24-32) is computed
    after the tag and is not covered; the tag itself follows at bytes 64-80.
    """
    return b"".join((prev_tag, batch, frame[:24], frame[32:64]))


def encode_retire(file_id: int) -> bytes:
    """Encode a RETIRE payload: a data file that is no longer part of the channel."""
    return _U64.pack(file_id)


def decode_retire(payload: bytes) -> int:
    """Decode a RETIRE payload into the retired file id.

    Raises:
        FormatError: the payload has the wrong size.
    """
    if len(payload) != 8:
        raise FormatError(0, "retire payload has the wrong size")
    return int(_U64.unpack(payload)[0])


# --------------------------------------------------------------------------
# write-ahead log payloads (filechannel.WriteAheadLog)
#
# In a write-ahead log directory every PUT payload starts with 16 bytes:
# kind u8, 7 reserved zero bytes, time_ns i64 (the record's time, nanoseconds
# since the epoch), then the kind's data. A RECORD's data is the caller's bytes;
# a SPAN's is end_ns i64: the first record of every file, saying that no
# record in the file has a time after end_ns (so files can be dropped by time
# without an index).

WAL_RECORD: Final = 1
WAL_SPAN: Final = 2
_WAL_HEAD: Final = struct.Struct("<B7sq")
WAL_HEAD_LEN: Final = _WAL_HEAD.size  # 16
_WAL_RESERVED: Final = bytes(7)
_I64: Final = struct.Struct("<q")


def encode_wal_payload(kind: int, time_ns: int, data: bytes) -> bytes:
    """Encode a write-ahead log PUT payload: kind, time, then ``data``."""
    return _WAL_HEAD.pack(kind, _WAL_RESERVED, time_ns) + data


def encode_wal_span(start_ns: int, end_ns: int) -> bytes:
    """Encode a SPAN payload: the file starts at ``start_ns``; no record in it is after ``end_ns``."""
    return encode_wal_payload(WAL_SPAN, start_ns, _I64.pack(end_ns))


def decode_wal_payload(payload: bytes | memoryview) -> tuple[int, int, bytes]:
    """Decode a write-ahead log PUT payload into ``(kind, time_ns, data)``.

    Raises:
        FormatError: the payload is too short, of an unknown kind, or has reserved bits set.
    """
    if len(payload) < WAL_HEAD_LEN:
        raise FormatError(
            0, f"write-ahead log payload is {len(payload)} bytes, shorter than its {WAL_HEAD_LEN}-byte head"
        )
    kind, reserved, time_ns = _WAL_HEAD.unpack_from(payload, 0)
    if reserved != _WAL_RESERVED:
        raise FormatError(1, "reserved write-ahead log payload bytes are set")
    if kind == WAL_SPAN and len(payload) != WAL_HEAD_LEN + 8:
        raise FormatError(0, "write-ahead log span payload has the wrong size")
    if kind not in (WAL_RECORD, WAL_SPAN):
        raise FormatError(0, f"unknown write-ahead log payload kind {kind}")
    return kind, time_ns, bytes(payload[WAL_HEAD_LEN:])


def decode_wal_span(data: bytes) -> int:
    """Return the end time (ns) of a SPAN payload's data (``decode_wal_payload``'s third item)."""
    return int(_I64.unpack(data)[0])


# --------------------------------------------------------------------------
# Authenticated small files (encrypted channels): what a checkpoint and ANCHOR
# record of each live data file, and the MAC trailer of a binary file.

AUTH_MAGIC: Final = b"FCAUTH02"
"""Written: the list carries a generation and a next position (``FCAUTH01``, still read, did not: 0 and 0)."""
AUTH_MAGIC_V1: Final = b"FCAUTH01"
_AUTH_HEAD: Final = struct.Struct("<8sQI")
_AUTH_GEN: Final = struct.Struct("<QQ")
_AUTH_ENTRY: Final = struct.Struct("<QQ16s16sI")
SEAL_MAGIC: Final = b"FCMAC\x00\x00\x01"
_SEAL_TAG_LEN: Final = 32
NO_AUTH_FILE: Final = (1 << 64) - 1
"""``AuthState.first_auth`` of a channel that has no authenticated data file yet."""


@dataclass(frozen=True)
class AuthEntry:
    """One live data file as an authenticated record vouches for it.

    ``length`` bytes of the file were written (a batch boundary), ``tag`` is the
    batch tag that ends there (the header's key check when no batch is), and
    ``key_check`` the header's key check: a file with another salt or key (from
    a copy of the channel) is not this one. ``dir_index`` is its data directory.
    """

    file_id: int
    length: int
    key_check: bytes
    tag: bytes
    dir_index: int


@dataclass(frozen=True)
class AckMark:
    """How far the owner has seen a consumer's ``.ack`` go: its registration time and its write count.

    An ``.ack`` file whose ``(registered_ns, seq)`` is below this was put back
    from the past (a newer registration of the name starts from a newer time).
    """

    name: str
    registered_ns: int
    seq: int


_ACK_MARK: Final = struct.Struct("<QQB")
MAX_ACK_MARKS: Final = 1 << 16


@dataclass(frozen=True)
class AuthState:
    """The authenticated files of a channel at one moment: the first one, and each live one.

    ``generation`` orders ``ANCHOR``s: each one written gets the next (from 1),
    and a checkpoint records the generation of the newest ``ANCHOR`` already
    durable when it was frozen. ``ANCHOR`` on disk is therefore never older than
    a checkpoint's generation; one that is was put back from the past (or taken
    from a copy that wrote less). 0: not recorded (written before generations).

    ``next_position`` is the channel's next position when the files were
    frozen: positions below it were given out, and are never given out again
    (batches cut since are reported lost up to it). 0: not recorded.

    ``acks`` holds an :class:`AckMark` for each consumer whose ``.ack`` the
    owner has read: an older ``.ack`` put back is refused.
    """

    first_auth: int
    files: tuple[AuthEntry, ...]
    generation: int = 0
    next_position: int = 0
    acks: tuple[AckMark, ...] = ()

    def by_id(self) -> dict[int, AuthEntry]:
        """The entries by file id."""
        return {e.file_id: e for e in self.files}


def encode_auth_state(s: AuthState) -> bytes:
    """Encode an :class:`AuthState` (it is MACed by whoever stores it)."""
    out = [_AUTH_HEAD.pack(AUTH_MAGIC, s.first_auth, len(s.files)), _AUTH_GEN.pack(s.generation, s.next_position)]
    for e in s.files:
        if len(e.key_check) != ENC_CHECK_LEN or len(e.tag) != BATCH_TAG_LEN:
            raise ValueError("an authenticated file entry holds a 16-byte key check and a 16-byte tag")
        out.append(_AUTH_ENTRY.pack(e.file_id, e.length, e.key_check, e.tag, e.dir_index))
    out.append(_U32.pack(len(s.acks)))
    for a in s.acks:
        name = a.name.encode("ascii")
        out.append(_ACK_MARK.pack(a.registered_ns, a.seq, len(name)) + name)
    return b"".join(out)


def decode_auth_state(buf: bytes | memoryview) -> AuthState:
    """Decode an :class:`AuthState`; its size must be exact.

    Raises:
        FormatError: Wrong magic, a count out of range, or a size that does not match it.
    """
    if len(buf) < _AUTH_HEAD.size:
        raise FormatError(0, "authenticated file list is truncated")
    magic, first, n = _AUTH_HEAD.unpack_from(buf, 0)
    if magic not in (AUTH_MAGIC, AUTH_MAGIC_V1):
        raise FormatError(0, "bad authenticated file list magic")
    pos = _AUTH_HEAD.size + (_AUTH_GEN.size if magic == AUTH_MAGIC else 0)
    end = pos + n * _AUTH_ENTRY.size
    if n > MAX_LIVE_FILES or (len(buf) != end if magic != AUTH_MAGIC else len(buf) < end + 4):
        raise FormatError(8, "authenticated file list size does not match its count")
    generation, next_position = _AUTH_GEN.unpack_from(buf, _AUTH_HEAD.size) if magic == AUTH_MAGIC else (0, 0)
    files = []
    for _ in range(n):
        fid, length, check, tag, d = _AUTH_ENTRY.unpack_from(buf, pos)
        if length & 7 or length >= 1 << 62:
            raise FormatError(pos, f"authenticated length {length} of file {fid} is not a record boundary")
        files.append(AuthEntry(fid, length, bytes(check), bytes(tag), d))
        pos += _AUTH_ENTRY.size
    acks: list[AckMark] = []
    if magic == AUTH_MAGIC:
        (k,) = _U32.unpack_from(buf, pos)
        pos += 4
        if k > MAX_ACK_MARKS:
            raise FormatError(pos - 4, "authenticated list holds too many consumers")
        for _ in range(k):
            if pos + _ACK_MARK.size > len(buf):
                raise FormatError(pos, "authenticated consumer entry is truncated")
            reg, seq, nlen = _ACK_MARK.unpack_from(buf, pos)
            pos += _ACK_MARK.size
            if not nlen or pos + nlen > len(buf):
                raise FormatError(pos, "authenticated consumer name does not fit")
            try:
                name = bytes(buf[pos : pos + nlen]).decode("ascii")
            except UnicodeDecodeError as exc:
                raise FormatError(pos, "authenticated consumer name is not ASCII") from exc
            acks.append(AckMark(name, reg, seq))
            pos += nlen
        if pos != len(buf):
            raise FormatError(pos, "authenticated list has bytes after its end")
    return AuthState(first, tuple(files), generation, next_position, tuple(acks))


def encode_sealed(body: bytes, key_id: str, tag: bytes) -> bytes:
    """Append a MAC trailer to ``body``: key id, its length, the 32-byte tag, :data:`SEAL_MAGIC`."""
    k = key_id.encode("ascii")
    if not 0 < len(k) < 256 or len(tag) != _SEAL_TAG_LEN:
        raise ValueError("a MAC trailer holds a 1-255 byte key id and a 32-byte tag")
    return body + k + bytes([len(k)]) + tag + SEAL_MAGIC


def split_sealed(buf: bytes | memoryview) -> tuple[bytes | memoryview, str | None, bytes | None]:
    """Split a file into ``(body, key id, tag)``; ``(buf, None, None)`` when it has no MAC trailer.

    Raises:
        FormatError: The trailer's magic is there but the trailer does not fit.
    """
    n = len(buf)
    if n < len(SEAL_MAGIC) or bytes(buf[n - len(SEAL_MAGIC) :]) != SEAL_MAGIC:
        return buf, None, None
    end = n - len(SEAL_MAGIC) - _SEAL_TAG_LEN
    if end < 1:
        raise FormatError(0, "MAC trailer is truncated")
    tag = bytes(buf[end : end + _SEAL_TAG_LEN])
    klen = buf[end - 1]
    start = end - 1 - klen
    if klen == 0 or start < 0:
        raise FormatError(max(start, 0), "MAC trailer's key id does not fit")
    try:
        key_id = bytes(buf[start : end - 1]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise FormatError(start, "MAC trailer's key id is not ASCII") from exc
    return buf[:start], key_id, tag
