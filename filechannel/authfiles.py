"""The authenticated small files of an encrypted channel, as pure codecs.

What a checkpoint and the ANCHOR record of each live data file
(:class:`AuthState`: its :class:`AuthEntry` list and its acknowledgement marks,
:class:`AckMark`), and the MAC trailer of a sealed binary file
(:func:`encode_sealed`, :func:`split_sealed`). Bytes in, values out: no I/O,
no state, no keys (the MACs and tags are computed by ``crypto.py`` and passed in).
``filechannel.format`` re-exports these names.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from .codec import BATCH_TAG_LEN, ENC_CHECK_LEN, MAX_LIVE_FILES
from .errors import FormatError

__all__ = [
    "AUTH_MAGIC",
    "AUTH_MAGIC_V1",
    "SEAL_MAGIC",
    "NO_AUTH_FILE",
    "AuthEntry",
    "AckMark",
    "MAX_ACK_MARKS",
    "AuthState",
    "encode_auth_state",
    "decode_auth_state",
    "encode_sealed",
    "split_sealed",
]

_U32: Final = struct.Struct("<I")
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
