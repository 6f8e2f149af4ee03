"""The Spark sink's staged files: their format, writing and reading (no Spark, no pyarrow needed).

This module owns the bytes an executor stages before the driver's commit
(``filechannel.spark.sink``) and an agent stages for a remote sink
(``filechannel.agent.staging``): the staging directory's names, the staged-file
format (plain or sealed), and putting the staged rows into a channel
transaction. Both sides import it from here, so neither depends on the other.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import accumulate
from typing import Any, TypeVar

from filechannel import format as fmt
from filechannel._fs import FS, map_file, read_file
from filechannel.crypto import SALT_LEN, TAG_LEN, Encryption, FileCipher
from filechannel.errors import (
    ChannelError,
    CorruptLogError,
    DecryptionError,
    EventTooLargeError,
    FormatError,
    InvalidEventError,
)

SINK_DIR = "spark-sink"


STAGING_DIR = "staging"


HEADER_QUERY = "spark.query"
"""Header put on every event a streaming query's sink writes: the query's id."""


HEADER_BATCH = "spark.batch_id"
"""Header put on every event a streaming query's sink writes: the micro-batch id (decimal)."""


DEFAULT_STALE_STAGING = 86_400.0


_STAGE_MAGIC = b"FCSTAGE1"


_STAGE_MAGIC_ENC = b"FCSTAGE2"  # rows sealed: then u8 cipher, u8 key id length, the key id, a 32-byte salt


_STAGE_ENC_HEAD = struct.Struct("<BB")


_STAGE_MAGIC_COL = b"FCSTAGE3"  # columns: chunks of rows, each an offsets array and one data region


_STAGE_MAGIC_COL_ENC = b"FCSTAGE4"  # columns, each chunk sealed: then the same encryption header as FCSTAGE2


_CHUNK_HEAD = struct.Struct("<BxxxIQQ")  # kind, rows, data length, longest row (plaintext lengths)


CHUNK_BODIES = 0
"""A staged chunk of rows without headers: each row's payload is ``EMPTY_HEADERS`` + its bytes."""


CHUNK_PAYLOADS = 1
"""A staged chunk of whole event payloads (header block, then body)."""


STAGE_SUFFIX = ".stage"
"""The ending of a staged file's name."""


TMP_PREFIX = ".tmp."
"""The beginning of a staged file's name while it is written (renamed away once durable)."""


_TRAILER = struct.Struct("<QI")  # row count, CRC-32 (zlib) of everything before the CRC


_U32 = struct.Struct("<I")


_I64 = struct.Struct("=q")


_FLUSH_BYTES = 1 << 20


_SLUG_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


def slug(query: str) -> str:
    """A file-name-safe token for a query id (a Spark query id, a UUID, is used as it is)."""
    if _SLUG_RE.fullmatch(query):
        return query
    return "h" + hashlib.sha256(query.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def stream_prefix(query: str | None, batch_id: int | None) -> str:
    """The staged file names' prefix of a streaming query's micro-batch (``q.<query>.b<batch>.``)."""
    q = slug(query) if query else "unknown"
    b = str(batch_id) if batch_id is not None else "x"
    return f"q.{q}.b{b}."


def job_prefix(job: str) -> str:
    """The staged file names' prefix of a batch job (``j.<job>.``)."""
    return f"j.{job}."


def created_ns(name: str) -> int | None:
    """The creation time a staged (or temporary) file's name records, or None."""
    if name.startswith(TMP_PREFIX):
        name = name[len(TMP_PREFIX) :]
    if not name.endswith(STAGE_SUFFIX):
        return None
    parts = name[: -len(STAGE_SUFFIX)].split(".")
    return int(parts[-1]) if len(parts) > 2 and parts[-1].isdigit() else None


def ensure_dir(fs: FS, path: str) -> None:
    """Create ``path`` (and missing parents) durably: each new entry's parent directory is fsynced."""
    if fs.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        ensure_dir(fs, parent)
    fs.makedirs(path)
    fs.fsync_dir(parent)


class _StageFile:
    """One staged file being written: ``FCSTAGE1``, then u32-length-prefixed event payloads, then a trailer.

    With encryption: ``FCSTAGE2``, the cipher, key id and salt, then each payload
    sealed (AEAD; nonce: the row's index, associated data: its index and length),
    so no row of an encrypted channel reaches the disk in plaintext.
    """

    def __init__(self, fs: FS, directory: str, name: str, encryption: Encryption | None = None) -> None:
        self.fs = fs
        self.directory = directory
        self.name = name
        self.tmp = os.path.join(directory, TMP_PREFIX + name)
        self.offset = 0
        self.crc = 0
        self.count = 0
        self.parts: list[bytes] = [_STAGE_MAGIC]
        self.cipher: FileCipher | None = None
        if encryption is not None:
            c = self.cipher = encryption.staging_cipher(name)
            kid = c.key_id.encode("ascii")
            self.parts = [_STAGE_MAGIC_ENC, _STAGE_ENC_HEAD.pack(c.suite, len(kid)), kid, c.salt]
        self.pending = sum(map(len, self.parts))
        self.fd: int | None = fs.create(self.tmp)

    def add(self, payload: bytes) -> None:
        if self.cipher is not None:
            payload = self.cipher.seal(_row_head(self.count, len(payload)), self.count, payload)
        self.parts.append(_U32.pack(len(payload)))
        self.parts.append(payload)
        self.pending += 4 + len(payload)
        self.count += 1
        if self.pending >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        parts = self.parts
        nbytes = sum(map(len, parts))
        assert self.fd is not None
        if len(parts) > 16 and nbytes < len(parts) << 16:
            parts = [b"".join(parts)]  # many small rows: one copy costs less than as many iovecs
        self.fs.pwrite_all(self.fd, parts, self.offset)  # gathered: a chunk's columns are not copied again
        crc = self.crc
        for p in parts:
            crc = fmt.crc(fmt.CRC32_ZLIB, p, crc)
        self.crc = crc
        self.offset += nbytes
        self.parts = []
        self.pending = 0

    def finish(self) -> int:
        """Make the file durable under its final name; return its size."""
        count = struct.pack("<Q", self.count)
        self.parts.append(count)
        self._flush()
        assert self.fd is not None
        self.fs.pwrite_all(self.fd, _U32.pack(self.crc), self.offset)
        self.offset += 4
        self.fs.fsync(self.fd)
        self.fs.close(self.fd)
        self.fd = None
        self.fs.replace(self.tmp, os.path.join(self.directory, self.name))
        self.fs.fsync_dir(self.directory)
        return self.offset

    def discard(self) -> None:
        if self.fd is not None:
            try:
                self.fs.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            self.fs.unlink(self.tmp)
        except OSError:
            pass


class _ColumnFile(_StageFile):
    """One columnar staged file being written: ``FCSTAGE3``, then chunks, then the same trailer.

    A chunk: kind (:data:`CHUNK_BODIES` or :data:`CHUNK_PAYLOADS`), rows ``n``,
    data length and longest row (``<BxxxIQQ``), then ``n + 1`` native int64
    offsets from 0 and the data region. With encryption: ``FCSTAGE4``, the
    encryption header of ``FCSTAGE2``, and each chunk's offsets and data sealed
    as one message (nonce: the chunk's index; associated data: its index and
    length), so the commit frames a chunk from two buffers, not row by row.
    """

    def __init__(self, fs: FS, directory: str, name: str, encryption: Encryption | None = None) -> None:
        super().__init__(fs, directory, name, encryption)
        self.parts[0] = _STAGE_MAGIC_COL_ENC if encryption is not None else _STAGE_MAGIC_COL
        self.chunks = 0

    def add_chunk(self, kind: int, data: bytes, offsets: bytes, n: int, longest: int) -> None:
        head = _CHUNK_HEAD.pack(kind, n, len(data), longest)
        if self.cipher is not None:
            blob = offsets + data
            sealed = self.cipher.seal(_chunk_head(self.chunks, len(blob)), self.chunks, blob)
            self.parts += (head, sealed)
            self.pending += len(head) + len(sealed)
        else:
            self.parts += (head, offsets, data)
            self.pending += len(head) + len(offsets) + len(data)
        self.chunks += 1
        self.count += n
        if self.pending >= _FLUSH_BYTES:
            self._flush()


def _chunk_head(index: int, n: int) -> bytes:
    """The 24 bytes a staged chunk's seal binds (first word 1: never a row's, whose is 0)."""
    return struct.pack("<QQQ", 1, index + 1, n)


def _row_head(index: int, n: int) -> bytes:
    """The 24 bytes a staged row's seal binds (and whose bytes 8..16, the index + 1, make its nonce)."""
    return struct.pack("<QQQ", 0, index + 1, n)


def stage_events(
    fs: FS,
    directory: str,
    name: str,
    events: Iterable[tuple[bytes, Mapping[str, str] | None]],
    max_event_size: int,
    header_overhead: int = 0,
    encryption: Encryption | None = None,
) -> tuple[str | None, int, int]:
    """Write events to a staged file ``directory/name``, durably, before returning.

    No file is written when ``events`` is empty. A failure removes the partial file.

    Args:
        fs: The I/O seam.
        directory: The staging directory (created if missing).
        name: The staged file's name.
        events: ``(body, headers)`` pairs.
        max_event_size: The channel's limit; an event above it fails the task early.
        header_overhead: Bytes the commit adds to every event (the sink's own headers).
        encryption: The sink's keystore, loaded: staged rows are sealed under its last key.

    Returns:
        ``(name or None, rows, bytes)``.

    Raises:
        EventTooLargeError: An event exceeds ``max_event_size``.
        InvalidEventError: A header is not valid text.
        OSError: Writing failed.
    """

    def payloads() -> Iterator[bytes]:
        for body, headers in events:
            try:
                payload = fmt.encode_event(body, headers)
            except UnicodeEncodeError as exc:
                raise InvalidEventError(f"a header of a row is not valid UTF-8 text: {exc}") from exc
            size = len(payload) + header_overhead
            if size > max_event_size:
                raise EventTooLargeError(size, max_event_size)
            yield payload

    return _write_staged(
        fs, directory, name, lambda: _StageFile(fs, directory, name, encryption), _StageFile.add, payloads()
    )


_F = TypeVar("_F", bound="_StageFile")
_T = TypeVar("_T")


def _write_staged(
    fs: FS, directory: str, name: str, make: Callable[[], _F], add: Callable[[_F, _T], None], items: Iterable[_T]
) -> tuple[str | None, int, int]:
    """``add`` each of ``items`` to a staged file made (by ``make``) at the first one, then make it durable.

    No file when there are no items; a failure (of the items' checks or of the writes) removes the partial file.
    """
    staged: _F | None = None
    try:
        for item in items:
            if staged is None:
                ensure_dir(fs, directory)
                staged = make()
            add(staged, item)
        if staged is None:
            return None, 0, 0
        rows = staged.count
        return name, rows, staged.finish()
    except BaseException:
        if staged is not None:
            staged.discard()
        raise


StagedChunk = tuple[int, bytes, bytes, int, int]
"""Rows of a staged file: ``(kind, data, offsets, n, longest)`` (``offsets``: ``n + 1`` native int64s from 0)."""


def stage_chunks(
    fs: FS,
    directory: str,
    name: str,
    chunks: Iterable[StagedChunk],
    max_event_size: int,
    header_overhead: int = 0,
    encryption: Encryption | None = None,
) -> tuple[str | None, int, int]:
    """Write column chunks to a columnar staged file ``directory/name``, durably, before returning.

    The columnar twin of :func:`stage_events` (the Spark sink's executors: each
    chunk comes from an Arrow batch with no Python object per row). ``longest``
    of a chunk is its longest row's bytes; a :data:`CHUNK_BODIES` row's event is
    ``len(EMPTY_HEADERS)`` longer. No file is written when there are no rows; a
    failure removes the partial file.

    Raises:
        EventTooLargeError: A row exceeds ``max_event_size``.
        OSError: Writing failed.
    """

    def checked() -> Iterator[StagedChunk]:
        for chunk in chunks:
            kind, _, _, n, longest = chunk
            if not n:
                continue
            size = longest + header_overhead + (len(fmt.EMPTY_HEADERS) if kind == CHUNK_BODIES else 0)
            if size > max_event_size:
                raise EventTooLargeError(size, max_event_size)
            yield chunk

    return _write_staged(
        fs,
        directory,
        name,
        lambda: _ColumnFile(fs, directory, name, encryption),
        lambda f, c: f.add_chunk(*c),
        checked(),
    )


def payload_chunk(payloads: list[bytes]) -> StagedChunk:
    """Whole event payloads as one :data:`CHUNK_PAYLOADS` chunk (one Python step per row)."""
    offsets = array("q", [0])
    offsets.extend(accumulate(map(len, payloads)))
    return CHUNK_PAYLOADS, b"".join(payloads), offsets.tobytes(), len(payloads), max(map(len, payloads), default=0)


def chunk_payloads(chunk: StagedChunk) -> list[bytes]:
    """A chunk's rows as whole event payloads (one ``bytes`` each)."""
    kind, data, offsets, n, _ = chunk
    col = fmt.PutColumn()
    col.add(data, offsets, n)
    rows = col.payloads()
    return [fmt.EMPTY_HEADERS + r for r in rows] if kind == CHUNK_BODIES else rows


def read_staged_chunks(fs: FS, path: str, encryption: Encryption | None = None) -> list[StagedChunk]:
    """Return the rows of a staged file as column chunks, checking its framing, count and checksum.

    Reads both formats: a columnar file (:func:`stage_chunks`) chunk by chunk,
    and a file of rows (:func:`stage_events`, also what executors of earlier
    versions staged) as one :data:`CHUNK_PAYLOADS` chunk.

    Raises:
        As :func:`read_staged`.
    """
    # Mapped, not read: the checksum runs over the mapping and each chunk's columns are copied
    # out of it once (a read, then slices, copied every byte twice: ~80 ms of a 205 MB commit).
    with map_file(fs, path) as buf:
        magic = buf[: len(_STAGE_MAGIC)]
        if magic not in (_STAGE_MAGIC_COL, _STAGE_MAGIC_COL_ENC):
            rows = _read_rows(path, bytes(buf), encryption)
            return [payload_chunk(rows)] if rows else []
        with memoryview(buf) as mv:
            return _read_columns(path, buf, mv, encryption, magic == _STAGE_MAGIC_COL_ENC)


def _read_columns(
    path: str, buf: bytes | mmap.mmap, mv: memoryview, encryption: Encryption | None, encrypted: bool
) -> list[StagedChunk]:
    """The chunks of a columnar staged file (``FCSTAGE3``/``FCSTAGE4``) held in ``buf`` (``mv`` views it)."""
    body_end, pos, cipher = _open_staged(path, buf, encryption, encrypted)
    out: list[StagedChunk] = []
    total = 0
    while pos < body_end:
        if pos + _CHUNK_HEAD.size > body_end:
            raise CorruptLogError(path, pos, "truncated chunk header", _HINT)
        kind, n, dlen, longest = _CHUNK_HEAD.unpack_from(buf, pos)
        pos += _CHUNK_HEAD.size
        olen = (n + 1) * 8
        stored = olen + dlen + (TAG_LEN if cipher is not None else 0)
        if kind not in (CHUNK_BODIES, CHUNK_PAYLOADS) or not n or pos + stored > body_end:
            raise CorruptLogError(path, pos, "bad chunk header", _HINT)
        if cipher is not None:
            i = len(out)
            plain = cipher.open(_chunk_head(i, olen + dlen), i, bytes(mv[pos : pos + stored]))
            if plain is None:
                raise DecryptionError(path, pos, f"staged chunk {i}: authentication tag fails", cipher.key_id, _HINT)
            offsets, data = plain[:olen], plain[olen:]
        else:
            offsets, data = bytes(mv[pos : pos + olen]), bytes(mv[pos + olen : pos + stored])
        pos += stored
        first, last = _I64.unpack_from(offsets, 0)[0], _I64.unpack_from(offsets, olen - 8)[0]
        try:
            fmt.column_frames_size(offsets, 0)  # ascending, checked in one C call
        except ValueError:
            first = -1
        if first != 0 or last != dlen:
            raise CorruptLogError(path, pos, "a chunk's offsets do not fit its data", _HINT)
        out.append((kind, data, offsets, n, longest))
        total += n
    count = _TRAILER.unpack_from(buf, body_end)[0]
    if total != count:
        raise CorruptLogError(path, body_end, f"{total} rows, the trailer says {count}", _HINT)
    return out


def read_staged(fs: FS, path: str, encryption: Encryption | None = None) -> list[bytes]:
    """Return the event payloads of a staged file, checking its framing, count and checksum.

    An encrypted staged file needs ``encryption`` (the sink's keystore); each row is
    decrypted and its tag checked.

    Raises:
        FileNotFoundError: The file does not exist.
        CorruptLogError: The file is damaged.
        DecryptionError: An encrypted staged file and no key for it, or a row whose tag fails.
    """
    buf = read_file(fs, path)
    if buf.startswith(_STAGE_MAGIC_COL) or buf.startswith(_STAGE_MAGIC_COL_ENC):
        return [p for c in read_staged_chunks(fs, path, encryption) for p in chunk_payloads(c)]
    return _read_rows(path, buf, encryption)


_HINT = "a staged file of a Spark task is damaged; restart the query: it runs the batch's tasks again"


def _open_staged(
    path: str, buf: bytes | mmap.mmap, encryption: Encryption | None, encrypted: bool
) -> tuple[int, int, FileCipher | None]:
    """Check a staged file's size and checksum, read its encryption header: ``(body end, position, cipher)``."""
    hint = _HINT
    if len(buf) < len(_STAGE_MAGIC) + _TRAILER.size:
        raise CorruptLogError(path, 0, "not a staged file of the filechannel sink", hint)
    body_end = len(buf) - _TRAILER.size
    _, crc = _TRAILER.unpack_from(buf, body_end)
    if fmt.crc(fmt.CRC32_ZLIB, memoryview(buf)[: body_end + 8]) != crc:
        raise CorruptLogError(path, body_end, "checksum mismatch", hint)
    pos = len(_STAGE_MAGIC)
    cipher: FileCipher | None = None
    if encrypted:
        if pos + _STAGE_ENC_HEAD.size > body_end:
            raise CorruptLogError(path, pos, "truncated encryption header", hint)
        suite, k = _STAGE_ENC_HEAD.unpack_from(buf, pos)
        pos += _STAGE_ENC_HEAD.size
        if pos + k + SALT_LEN > body_end:
            raise CorruptLogError(path, pos, "truncated encryption header", hint)
        key_id = buf[pos : pos + k].decode("ascii", "replace")
        salt = bytes(buf[pos + k : pos + k + SALT_LEN])
        pos += k + SALT_LEN
        if encryption is None:
            raise DecryptionError(
                path,
                0,
                f"staged file is encrypted (key id {key_id!r}): give the sink .option('keystore', PATH)",
                key_id,
            )
        cipher = encryption.staged_file_cipher(path, os.path.basename(path), suite, key_id, salt)
    return body_end, pos, cipher


def _read_rows(path: str, buf: bytes, encryption: Encryption | None) -> list[bytes]:
    """The payloads of a staged file of rows (``FCSTAGE1``/``FCSTAGE2``)."""
    hint = _HINT
    encrypted = buf.startswith(_STAGE_MAGIC_ENC)
    if not (buf.startswith(_STAGE_MAGIC) or encrypted):
        raise CorruptLogError(path, 0, "not a staged file of the filechannel sink", hint)
    body_end, pos, cipher = _open_staged(path, buf, encryption, encrypted)
    count = _TRAILER.unpack_from(buf, body_end)[0]
    out: list[bytes] = []
    while pos < body_end:
        if pos + 4 > body_end:
            raise CorruptLogError(path, pos, "truncated row length", hint)
        (n,) = _U32.unpack_from(buf, pos)
        pos += 4
        if pos + n > body_end:
            raise CorruptLogError(path, pos, "row runs past the end", hint)
        row = buf[pos : pos + n]
        if cipher is not None:
            i = len(out)
            plain = cipher.open(_row_head(i, n - TAG_LEN), i, row)
            if plain is None:
                raise DecryptionError(path, pos, f"staged row {i}: authentication tag fails", cipher.key_id, hint)
            row = plain
        out.append(row)
        pos += n
    if len(out) != count:
        raise CorruptLogError(path, body_end, f"{len(out)} rows, the trailer says {count}", hint)
    return out


def sink_headers(query: str, batch_id: int) -> dict[str, str]:
    """The headers the sink adds to every event of a streaming query's micro-batch."""
    return {HEADER_QUERY: query, HEADER_BATCH: str(batch_id)}


def headers_overhead(headers: Mapping[str, str]) -> int:
    """The bytes ``headers`` add to an event's encoding (what the sink's own headers add to every row)."""
    return sum(8 + len(k.encode()) + len(v.encode()) for k, v in headers.items())


def put_all(tx: Any, payloads: list[bytes], extra: Mapping[str, str]) -> None:
    """Put every payload's event, with ``extra`` headers added, in order (runs sharing headers in one put_many)."""
    run_headers: Mapping[str, str] | None = None
    run: list[bytes] = []
    for payload in payloads:
        try:
            body, headers = fmt.decode_event(payload)
        except FormatError as exc:  # pragma: no cover - read_staged checked the file's checksum
            raise ChannelError(f"a staged event does not decode: {exc}") from exc
        merged: Mapping[str, str] = {**headers, **extra} if headers else extra
        if merged is not run_headers and merged != run_headers:
            if run:
                tx.put_many(run, headers=run_headers or None)
            run_headers, run = merged, []
        run.append(body)
    if run:
        tx.put_many(run, headers=run_headers or None)


def merge_headers(data: bytes, offsets: bytes, extra: bytes, plain: bool) -> tuple[bytes, bytes, int] | None:
    """A column's rows with ``extra`` headers merged: ``(data, offsets, longest)``, or None.

    ``offsets``: ``n + 1`` native int64s into ``data``; ``extra``: the header block of
    the headers to add (``format.encode_event(b"", extra)``). Row ``i`` becomes
    ``format.encode_event(body, {**headers, **extra})`` of its event (``plain``: the
    rows are bodies, without headers), the bytes :func:`put_all` puts. None when a
    row is one that rule does not cover exactly (a payload that does not decode, a
    header that is not strict UTF-8, a key repeated in one row): the caller puts
    those through :func:`put_all`. One C call (``_speedups.merge_headers``), no
    Python object per row.

    Raises:
        ValueError: ``offsets`` do not lie within ``data``, or ``extra`` is not one header block.
    """
    sp = fmt.speedups
    if sp is not None:
        return sp.merge_headers(data, offsets, extra, plain)  # type: ignore[no-any-return]
    return _merge_headers_py(data, offsets, extra, plain)


_U32 = struct.Struct("<I")
_KV = struct.Struct("<II")


def _header_entries(p: bytes | memoryview) -> tuple[list[tuple[bytes, bytes]], int] | None:
    """A header block's entries and its length, or None (does not decode, not strict UTF-8, a repeated key)."""
    if len(p) < 4:
        return None
    count = _U32.unpack_from(p, 0)[0]
    if count > (len(p) - 4) // 8:
        return None
    pos = 4
    out: list[tuple[bytes, bytes]] = []
    for _ in range(count):
        if len(p) - pos < 8:
            return None
        kl, vl = _KV.unpack_from(p, pos)
        pos += 8
        if kl > len(p) - pos or vl > len(p) - pos - kl:
            return None
        k, v = bytes(p[pos : pos + kl]), bytes(p[pos + kl : pos + kl + vl])
        try:
            k.decode("utf-8")
            v.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if any(k == seen for seen, _ in out):
            return None
        out.append((k, v))
        pos += kl + vl
    return out, pos


def _merge_headers_py(data: bytes, offsets: bytes, extra: bytes, plain: bool) -> tuple[bytes, bytes, int] | None:
    """The pure-Python :func:`merge_headers` (the reference)."""
    ob = memoryview(offsets).cast("B")
    if len(ob) < 8 or len(ob) % 8:
        raise ValueError("merge_headers: a column's offsets are n + 1 int64s")
    offs = ob.cast("q")
    if offs[0] < 0 or any(offs[i + 1] < offs[i] for i in range(len(offs) - 1)) or offs[-1] > len(data):
        raise ValueError("merge_headers: an offset lies outside the data buffer")
    got = _header_entries(extra)
    if got is None or got[1] != len(extra):
        raise ValueError("merge_headers: extra is not one header block")
    ex = dict(got[0])
    view = memoryview(data)
    rows: list[bytes] = []
    for i in range(len(offs) - 1):
        row = view[offs[i] : offs[i + 1]]
        own: list[tuple[bytes, bytes]] = []
        at = 0
        if not plain:
            parsed = _header_entries(row)
            if parsed is None:
                return None
            own, at = parsed
        keys = {k for k, _ in own}
        merged = [(k, ex.get(k, v)) for k, v in own] + [(k, v) for k, v in ex.items() if k not in keys]
        parts = [_U32.pack(len(merged))]
        for k, v in merged:
            parts += (_KV.pack(len(k), len(v)), k, v)
        parts.append(bytes(row[at:]))
        rows.append(b"".join(parts))
    ends = array("q", [0])
    ends.extend(accumulate(map(len, rows)))
    return b"".join(rows), ends.tobytes(), max(map(len, rows), default=0)


def put_chunks(tx: Any, chunks: list[StagedChunk], extra: Mapping[str, str]) -> None:
    """Put the staged rows of ``chunks``, with ``extra`` headers added, in order: the same bytes as :func:`put_all`.

    When no row has headers of its own (every chunk :data:`CHUNK_BODIES`), the
    chunks become one column whose events share the header block of ``extra``,
    framed at commit with no Python object per row. Otherwise each chunk's rows
    are re-encoded with ``extra`` merged in one C call (:func:`merge_headers`)
    into one column of whole payloads; only rows that rule does not cover
    exactly go through :func:`put_all`.
    """
    if not chunks:
        return
    try:
        head = fmt.encode_event(b"", extra) if extra else fmt.EMPTY_HEADERS
    except UnicodeEncodeError as exc:
        raise InvalidEventError(f"a header the sink adds is not valid UTF-8 text: {exc}") from exc
    if all(c[0] == CHUNK_BODIES for c in chunks):
        col = fmt.PutColumn(head)
        for _, data, offsets, n, _ in chunks:
            col.add(data, offsets, n)
        tx.put_column(col, max(c[4] for c in chunks))
        return
    col = fmt.PutColumn(b"")  # no head: each row is a whole payload
    longest = 0
    for kind, data, offsets, n, _ in chunks:
        got = merge_headers(data, offsets, head, kind == CHUNK_BODIES)
        if got is None:
            put_all(tx, [p for c in chunks for p in chunk_payloads(c)], extra)
            return
        col.add(got[0], got[1], n)
        longest = max(longest, got[2])
    tx.put_column(col, longest)
