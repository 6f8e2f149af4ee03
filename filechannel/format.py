"""The record frame, the PUT payload and their accelerated encoders; the public face of the on-disk format.

This module owns how a record is framed (op, flags, length, write-order id,
transaction id, checksum, payload, padding: :func:`encode_record`,
:func:`decode_record`, :func:`record_length_at`), the PUT payload (an event's
headers and body: :func:`encode_event`, :func:`decode_puts`), and the encoders
the writer frames whole batches with: :func:`record_encoder`'s stateful
encoders (a reused frame buffer, a per-file seed), :class:`PutColumn`'s
:func:`encode_column` and :func:`frame_commit1`. Each runs in the optional C
accelerator (``_speedups.c``, chosen once by ``_accel.py`` and kept here as
:data:`speedups`) or in its pure-Python twin, the reference the C code is
tested against byte for byte; FILECHANNEL_PURE_PYTHON=1 forces the twin.

Everything here is bytes in, values out: no I/O and no logging. The only state
is an encoder's, owned by the writer that made it. Decoding arbitrary bytes
either returns a value, returns :data:`INCOMPLETE` (more bytes are needed) or
raises :class:`~filechannel.errors.FormatError`. Nothing else. Policy (a torn
tail versus corruption, skipping damage) is ``scan.py``'s.

The other layouts are pure codecs in rooms of their own, re-exported here so
``filechannel.format`` stays the one name callers use (it is what
``docs/format.md`` describes and what the fuzz targets exercise): the
constants, checksums, file header and the other payloads in ``codec.py``; the
authenticated small files (ANCHOR, checkpoint lists, MAC trailers) in
``authfiles.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Final, overload

from . import _accel
from .authfiles import *  # noqa: F403 - re-exported: filechannel.format is the format's one public name
from .codec import *  # noqa: F403 - re-exported, as above
from .codec import (
    BATCH_END,
    BATCH_TAG_LEN,
    COMMIT,
    CRC32_ZLIB,
    CRC32C,
    EMPTY_HEADERS,
    ENC_TAG_LEN,
    FIXED_PAYLOAD_SIZES,
    FLAG_SEALED,
    INCOMPLETE,
    MARK,
    OP_NAMES,
    PUT,
    SEALABLE_OPS,
    TAKE,
    TAKE_RANGE_LEN,
    BatchEnd,
    Incomplete,
    crc,
    crc_extender,
    encode_batch_end,
    encode_commit,
    mark_len_bounds,
    mark_len_error,
    payload_len_error,
)
from .errors import EventFormatError, FormatError

# The optional C accelerator (``_speedups.c``, chosen by ``_accel.py``): batch
# framing and verified-batch scanning. The Python code in this module and in
# scan.py is the reference implementation it is tested against byte for byte;
# FILECHANNEL_PURE_PYTHON=1 forces that path. ``speedups`` is None on the pure path.
speedups: Any = _accel.load()


def accelerator() -> str:
    """Return which per-event path is active: ``"c"`` (the accelerator) or ``"python"``."""
    return "c" if speedups is not None else "python"


# Record frame: op u8, flags u8, reserved u16, payload_len u32, woid u64,
# txn_id u64 | crc u32, reserved u32 | payload | zero pad to 8.
_REC_HEAD: Final = struct.Struct("<BBHIQQ")
REC_HEAD: Final = _REC_HEAD
"""A record's head: op, flags, reserved, payload length, woid, txn id (public for scan.py's forward walk)."""
_REC_CRC: Final = struct.Struct("<II")
RECORD_HEADER_LEN: Final = 32
_PAD: Final = (b"", b"\0" * 7, b"\0" * 6, b"\0" * 5, b"\0" * 4, b"\0" * 3, b"\0" * 2, b"\0")
_U32: Final = struct.Struct("<I")
_KV_LEN: Final = struct.Struct("<II")


def record_size(payload_len: int) -> int:
    """Return the bytes a record with ``payload_len`` bytes of payload occupies."""
    return RECORD_HEADER_LEN + payload_len + (-payload_len & 7)


def record_length_at(buf: bytes | bytearray | memoryview, offset: int) -> int:
    """The payload length the frame at ``offset`` declares (its u32 length field), unchecked.

    ``record_size`` of it is the frame's size, as far as the frame says; only
    :func:`decode_record` tells whether the frame is a record. The frame's 8
    bytes from ``offset`` must be in ``buf``.
    """
    return int(_U32.unpack_from(buf, offset + 4)[0])


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
    gives its ``spark.query`` and ``spark.batch_id`` headers. An empty ``head``
    (``b""``): each row is a whole PUT payload (the sink's rows with headers of their own).
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
    ext = crc_extender(kind)
    if ext is None:
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
        extend = crc_extender(kind)
        if extend is None:  # pragma: no cover
            raise FormatError(0, f"unknown checksum algorithm {kind}")
        self._extend = extend

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
        return encode_batch_end(BatchEnd(start, body_len, body_crc, first_woid, woid - 1))

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
        return encode_batch_end(BatchEnd(start, body_len, body_crc, first_woid, woid - 1))

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


_COMMIT1_TAIL: Final = record_size(16) + record_size(32)
"""What follows the PUT in :func:`frame_commit1`'s bytes: a COMMIT frame and a (version 1) BATCH_END frame."""


def _frame_commit1(
    seed: int, kind: int, woid: int, txn_id: int, payload: bytes, prefix: bytes, start: int, first_position: int
) -> bytes:
    """A one-event transaction's write: its PUT (``prefix + payload``), COMMIT and BATCH_END frames.

    The pure-Python twin of the C accelerator's ``frame_commit1``: the same
    bytes as the general path (``add_puts``, ``add`` of the COMMIT,
    ``close_batch``) gives for a transaction of one unsealed put.
    """
    enc = _RecordEncoder(seed, kind)
    parts: list[bytes] = []
    enc.add_puts(parts, woid, txn_id, (payload,), [], [], start, prefix)
    enc.add(parts, COMMIT, woid + 1, txn_id, encode_commit(first_position, 1, 0))
    enc.close_batch(parts, start, woid, woid + 2)
    return b"".join(parts)


def frame_commit1(
    seed: int, kind: int, woid: int, txn_id: int, payload: bytes, prefix: bytes, start: int, first_position: int
) -> bytes:
    """:func:`_frame_commit1`, in C when the accelerator is loaded (one call, one buffer).

    The writer's lone-committer path: the frames of a one-event transaction at
    offset ``start`` of a version 1 file, the PUT's taking ``woid``.
    """
    if speedups is not None:
        data: bytes = speedups.frame_commit1(seed, kind, woid, txn_id, payload, prefix, start, first_position)
        return data
    return _frame_commit1(seed, kind, woid, txn_id, payload, prefix, start, first_position)


def decode_record(
    buf: bytes | bytearray | memoryview, offset: int, seed: int, kind: int, max_payload: int
) -> Record | Incomplete:
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
