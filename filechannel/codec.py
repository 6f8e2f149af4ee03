"""The on-disk format's pure codecs: every byte layout but the record frame, bytes in, values out.

This module owns the constants of filechannel's data files (record kinds,
flags, checksum algorithms, size limits), the checksums themselves, the file
header, the payload of every record kind but PUT (COMMIT, TAKE, ROLLBACK,
MARK, BATCH_END, RETIRE) and the write-ahead log's payloads. It performs no
I/O, keeps no state and never logs; decoding arbitrary bytes either returns a
value, returns :data:`INCOMPLETE` or raises :class:`~filechannel.errors.FormatError`.

The record frame and the PUT payload, with their C-accelerated encoders, are
``format.py``'s; the authenticated small files (ANCHOR, checkpoint lists, MAC
trailers) are ``authfiles.py``'s. ``filechannel.format`` re-exports all three:
it is the one name callers use.

All integers are little-endian. Records are 8-byte aligned. Every record's
CRC is seeded with a per-file seed derived from the channel id and file id, so
a record copied from another file or another channel does not verify.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .errors import FormatError

__all__ = [
    "HAVE_CRC32C",
    "MAGIC",
    "FORMAT_VERSION",
    "AUTH_VERSION",
    "BATCH_TAG_LEN",
    "CRC32C",
    "CRC32_ZLIB",
    "ENCRYPTED",
    "ENC_SALT_LEN",
    "ENC_CHECK_LEN",
    "ENC_TAG_LEN",
    "FLAG_SEALED",
    "PUT",
    "TAKE",
    "COMMIT",
    "ROLLBACK",
    "BATCH_END",
    "RETIRE",
    "MARK",
    "SEALABLE_OPS",
    "OP_NAMES",
    "FILE_HEADER_FIXED",
    "MAX_LIVE_FILES",
    "MAX_HEADER_LEN",
    "BATCH_END_SIZES",
    "FIXED_PAYLOAD_SIZES",
    "TAKE_RANGE_LEN",
    "MAX_MARK_KEY",
    "MAX_MARK_VALUE",
    "MAX_MARKS_PER_RECORD",
    "MARK_MIN_PAYLOAD",
    "MARK_MAX_PAYLOAD",
    "EMPTY_HEADERS",
    "Incomplete",
    "INCOMPLETE",
    "crc",
    "default_crc_kind",
    "file_seed",
    "pad_len",
    "FileHeader",
    "encode_file_header",
    "decode_file_header",
    "crc_extender",
    "payload_len_error",
    "mark_len_bounds",
    "mark_len_error",
    "encode_commit",
    "decode_commit",
    "encode_take",
    "decode_take",
    "encode_rollback",
    "decode_rollback",
    "Mark",
    "check_mark",
    "encode_marks",
    "decode_marks",
    "BatchEnd",
    "encode_batch_end",
    "decode_batch_end",
    "batch_auth_data",
    "encode_retire",
    "decode_retire",
    "WAL_RECORD",
    "WAL_SPAN",
    "WAL_HEAD_LEN",
    "encode_wal_payload",
    "encode_wal_span",
    "decode_wal_payload",
    "decode_wal_span",
]

_gcrc: Any
try:  # the C implementation; the pure-Python fallback is far too slow to use
    import google_crc32c as _gcrc
except ImportError:  # pragma: no cover - exercised only without the wheel
    _gcrc = None
HAVE_CRC32C: Final = _gcrc is not None and _gcrc.implementation == "c"
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

_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
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


class Incomplete:
    """Type of :data:`INCOMPLETE`."""

    def __repr__(self) -> str:
        return "INCOMPLETE"


INCOMPLETE: Final = Incomplete()
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
        body += _ENC_EXT.pack(h.cipher, len(kid), b"", h.salt) + kid + bytes(pad_len(len(kid)))
        check = key_check(body) if key_check is not None else h.key_check
        if len(check) != ENC_CHECK_LEN:
            raise FormatError(0, "key check must be 16 bytes")
        body += check
    c = crc(h.crc_kind, body)
    out = body + _U32.pack(c)
    return out + b"\0" * (total - len(out))


def decode_file_header(buf: bytes | memoryview) -> FileHeader | Incomplete:
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


def _zlib_extend(crc_value: int, data: bytes) -> int:
    return zlib.crc32(data, crc_value)


def crc_extender(kind: int) -> Callable[[int, bytes], int] | None:
    """``extend(crc, data) -> crc`` of checksum algorithm ``kind``, for a hot loop; None for an unknown ``kind``."""
    if kind == CRC32C and _gcrc is not None:
        return _gcrc.extend  # type: ignore[no-any-return]
    if kind == CRC32_ZLIB:
        return _zlib_extend
    return None


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
