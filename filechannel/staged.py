"""The Spark sink's staged files: their format, writing and reading (no Spark, no pyarrow needed).

This module owns the bytes an executor stages before the driver's commit
(``filechannel.spark.sink``) and an agent stages for a remote sink
(``filechannel.agent.staging``): the staging directory's names, the staged-file
format (plain or sealed), and putting the staged rows into a channel
transaction. Both sides import it from here, so neither depends on the other.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from filechannel import format as fmt
from filechannel._fs import FS, read_file
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


_STAGE_SUFFIX = ".stage"


_TMP_PREFIX = ".tmp."


_TRAILER = struct.Struct("<QI")  # row count, CRC-32 (zlib) of everything before the CRC


_U32 = struct.Struct("<I")


_FLUSH_BYTES = 1 << 20


_SLUG_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


def _slug(query: str) -> str:
    """A file-name-safe token for a query id (a Spark query id, a UUID, is used as it is)."""
    if _SLUG_RE.fullmatch(query):
        return query
    return "h" + hashlib.sha256(query.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _stream_prefix(query: str | None, batch_id: int | None) -> str:
    q = _slug(query) if query else "unknown"
    b = str(batch_id) if batch_id is not None else "x"
    return f"q.{q}.b{b}."


def _job_prefix(job: str) -> str:
    return f"j.{job}."


def _created_ns(name: str) -> int | None:
    """The creation time a staged (or temporary) file's name records, or None."""
    if name.startswith(_TMP_PREFIX):
        name = name[len(_TMP_PREFIX) :]
    if not name.endswith(_STAGE_SUFFIX):
        return None
    parts = name[: -len(_STAGE_SUFFIX)].split(".")
    return int(parts[-1]) if len(parts) > 2 and parts[-1].isdigit() else None


def _ensure_dir(fs: FS, path: str) -> None:
    """Create ``path`` (and missing parents) durably: each new entry's parent directory is fsynced."""
    if fs.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _ensure_dir(fs, parent)
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
        self.tmp = os.path.join(directory, _TMP_PREFIX + name)
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
        data = b"".join(self.parts)
        assert self.fd is not None
        self.fs.pwrite_all(self.fd, data, self.offset)
        self.crc = fmt.crc(fmt.CRC32_ZLIB, data, self.crc)
        self.offset += len(data)
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
    staged: _StageFile | None = None
    try:
        for body, headers in events:
            try:
                payload = fmt.encode_event(body, headers)
            except UnicodeEncodeError as exc:
                raise InvalidEventError(f"a header of a row is not valid UTF-8 text: {exc}") from exc
            size = len(payload) + header_overhead
            if size > max_event_size:
                raise EventTooLargeError(size, max_event_size)
            if staged is None:
                _ensure_dir(fs, directory)
                staged = _StageFile(fs, directory, name, encryption)
            staged.add(payload)
        if staged is None:
            return None, 0, 0
        rows = staged.count
        size = staged.finish()
        return name, rows, size
    except BaseException:
        if staged is not None:
            staged.discard()
        raise


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
    hint = "a staged file of a Spark task is damaged; restart the query: it runs the batch's tasks again"
    encrypted = buf.startswith(_STAGE_MAGIC_ENC)
    if len(buf) < len(_STAGE_MAGIC) + _TRAILER.size or not (buf.startswith(_STAGE_MAGIC) or encrypted):
        raise CorruptLogError(path, 0, "not a staged file of the filechannel sink", hint)
    body_end = len(buf) - _TRAILER.size
    count, crc = _TRAILER.unpack_from(buf, body_end)
    if fmt.crc(fmt.CRC32_ZLIB, memoryview(buf)[: body_end + 8]) != crc:
        raise CorruptLogError(path, body_end, "checksum mismatch", hint)
    out: list[bytes] = []
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


def _sink_headers(query: str, batch_id: int) -> dict[str, str]:
    return {HEADER_QUERY: query, HEADER_BATCH: str(batch_id)}


def _headers_overhead(headers: Mapping[str, str]) -> int:
    return sum(8 + len(k.encode()) + len(v.encode()) for k, v in headers.items())


def _put_all(tx: Any, payloads: list[bytes], extra: Mapping[str, str]) -> None:
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
