"""Rebuilding a damaged ``CHANNEL`` file from the identity its data files and directories carry.

This module owns one repair: ``CHANNEL`` (the channel id, checksum kind and
creation time; see docs/format.md) is 40 bytes with a checksum, and when they
are damaged no open, ``verify`` or skip-mode take can proceed, although the
channel id is also in every data directory's ``DATADIR`` and every data file's
header. :func:`rebuild_channel_file` reads those, refuses unless they all name
one channel id and one checksum kind, keeps a copy of the damaged file beside
it, and writes a new ``CHANNEL``. It never touches a data file, ``DATADIR``,
``DATA_DIRS`` or a checkpoint. The ``filechannel repair-channel-file`` command
runs it. Every write goes through ``_fs`` (``replace_durably``, ``fsync_dir``).
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field

from . import format as fmt
from ._fs import DEFAULT_FS, FS, read_file, replace_durably
from .directory import (
    CHANNEL_FILE,
    DATA_DIR_ID_FILE,
    DATA_DIRS_FILE,
    LOCK_FILE,
    WAL_FILE,
    decode_channel_file,
    decode_meta,
    encode_channel_file,
)
from .errors import ChannelError, ChannelLockedError, FormatError, NotAChannelError
from .logstate import DEFAULT_DATA_DIR
from .scan import SEG_RE

__all__ = [
    "DAMAGED_SUFFIX",
    "ChannelFileRepair",
    "RepairRefusedError",
    "channel_file_damaged",
    "rebuild_channel_file",
]

#: The damaged file is kept as ``CHANNEL.damaged-<ns>`` (nanoseconds since the epoch).
DAMAGED_SUFFIX = ".damaged-"
_HEADER_READ = 0x10000  # a data file header is at most 0xFFFF bytes (its length is a u16)
_CHANNEL_SIZE = len(encode_channel_file(bytes(16), fmt.CRC32_ZLIB, 0))
_U32 = struct.Struct("<I")
_SHOWN = 3  # files named per channel id in a refusal


class RepairRefusedError(ChannelError):
    """The ``CHANNEL`` file was not rebuilt: it is intact, or the evidence does not name one channel."""


@dataclass
class ChannelFileRepair:
    """What :func:`rebuild_channel_file` did (or, with ``rebuilt`` False, found: an intact file)."""

    path: str
    rebuilt: bool
    channel_id: bytes
    crc_kind: int
    created_ns: int
    damaged_copy: str | None = None
    identity_files: list[str] = field(default_factory=list)
    headers: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # data files whose header does not decode (not used)


def channel_file_damaged(buf: bytes) -> bool:
    """Whether ``buf`` (a ``CHANNEL`` file's bytes) is not what was written: wrong length or checksum mismatch.

    An intact file can still be refused (a newer format version, CRC-32C
    without google-crc32c); rebuilding it would be wrong, so only this is repaired.
    """
    if len(buf) != _CHANNEL_SIZE:
        return True
    stored: int = _U32.unpack_from(buf, len(buf) - 4)[0]
    return fmt.crc(fmt.CRC32_ZLIB, buf[:-4]) != stored


def _some(paths: list[str]) -> str:
    """The first few of ``paths``, and how many more."""
    more = f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else ""
    return ", ".join(paths[:_SHOWN]) + more


def _data_dirs(fs: FS, top: str) -> list[str]:
    """The data directories ``DATA_DIRS`` records (``DIR/data`` when it is missing)."""
    path = os.path.join(top, DATA_DIRS_FILE)
    if not fs.exists(path):
        return [os.path.join(top, DEFAULT_DATA_DIR)]
    buf = read_file(fs, path)
    try:
        # version 2 has a checksum line; version 1 is plain JSON with absolute paths
        recorded = decode_meta(buf, "DATA_DIRS")["data_dirs"] if b"\ncrc32:" in buf else json.loads(buf)["data_dirs"]
        if not isinstance(recorded, list) or not recorded or not all(isinstance(d, str) and d for d in recorded):
            raise FormatError(0, "data_dirs must be a non-empty list of paths")
    except (FormatError, KeyError, ValueError, TypeError) as exc:
        raise RepairRefusedError(
            f"refusing to rebuild {os.path.join(top, CHANNEL_FILE)}: {path} is unreadable too ({exc}), so the data "
            "directories to check are unknown; restore the channel directory from a backup"
        ) from exc
    own = os.path.join(top, DEFAULT_DATA_DIR)
    dirs = []
    for d in recorded:
        d = d if os.path.isabs(d) else os.path.join(top, d)
        if not fs.exists(d) and os.path.basename(d) == DEFAULT_DATA_DIR and fs.exists(own):
            d = own  # a version 1 path of a channel that was moved here
        dirs.append(d)
    return dirs


def rebuild_channel_file(directory: str, *, fs: FS | None = None) -> ChannelFileRepair:
    """Rebuild a damaged ``CHANNEL`` file of ``directory`` from its data directories and data files.

    The channel id must be the same in every data directory's ``DATADIR`` and
    every data file header that decodes (at least one of each), and so must the
    headers' checksum kind. The creation time, which only ``CHANNEL`` held, is
    taken from the oldest data file header. The damaged bytes are first
    written, fsynced, to ``CHANNEL.damaged-<ns>``; then the new file replaces
    ``CHANNEL`` (temporary file, fsync, rename, directory fsync). The channel's
    lock is held throughout.

    Returns:
        What was found and done; ``rebuilt`` is False (and nothing is written)
        when ``CHANNEL`` is intact.

    Raises:
        RepairRefusedError: The evidence is missing or disagrees (the message says
            which files name which id), or ``CHANNEL`` is intact but unusable here
            (e.g. a newer format version).
        ChannelLockedError: The channel is open in another process.
        NotAChannelError: No ``CHANNEL`` file, or a write-ahead log's directory.
    """
    fs = fs or DEFAULT_FS
    top = os.fspath(directory)
    chan_path = os.path.join(top, CHANNEL_FILE)
    if not fs.isdir(top) or not fs.exists(chan_path):
        raise NotAChannelError(top, "no CHANNEL file to repair")
    if fs.exists(os.path.join(top, WAL_FILE)):
        raise NotAChannelError(top, "it is a write-ahead log; repair-channel-file rebuilds a channel's CHANNEL file")
    try:
        lock = fs.lock(os.path.join(top, LOCK_FILE))
    except BlockingIOError as exc:
        raise ChannelLockedError(top) from exc
    try:
        return _rebuild(fs, top, chan_path)
    finally:
        fs.unlock(lock)


def _rebuild(fs: FS, top: str, chan_path: str) -> ChannelFileRepair:
    damaged = read_file(fs, chan_path)
    if not channel_file_damaged(damaged):
        try:
            cid, kind, created = decode_channel_file(damaged)
        except FormatError as exc:
            raise RepairRefusedError(
                f"{chan_path} is intact (its checksum matches) but unusable here: {exc.reason}; it was not rewritten"
            ) from exc
        return ChannelFileRepair(chan_path, False, cid, kind, created)
    ids: dict[bytes, list[str]] = {}  # channel id -> the files that name it
    kinds: dict[int, list[str]] = {}
    result = ChannelFileRepair(chan_path, True, b"", 0, 0)
    oldest: int | None = None
    why = ""  # why the first unreadable data file header did not decode
    for d in _data_dirs(fs, top):
        if not fs.isdir(d):
            continue  # missing: the open reports it; it is no evidence either way
        ident = os.path.join(d, DATA_DIR_ID_FILE)
        if fs.exists(ident):
            try:
                cid = bytes.fromhex(str(decode_meta(read_file(fs, ident), "data directory identity")["channel_id"]))
                if len(cid) != 16:
                    raise ValueError(f"a channel id is 16 bytes, not {len(cid)}")
            except (FormatError, KeyError, ValueError) as exc:
                raise RepairRefusedError(
                    f"refusing to rebuild {chan_path}: {ident} is unreadable too ({exc}); restore the channel "
                    "directory from a backup"
                ) from exc
            ids.setdefault(cid, []).append(ident)
            result.identity_files.append(ident)
        for name in sorted(fs.listdir(d)):
            if not SEG_RE.match(name):
                continue
            path = os.path.join(d, name)
            fd = fs.open_read(path)
            try:
                buf = fs.pread(fd, _HEADER_READ, 0)
            finally:
                fs.close(fd)
            try:
                h = fmt.decode_file_header(buf)
            except FormatError as exc:
                h = fmt.INCOMPLETE
                why = why or f"{path}: {exc.reason}"
            if not isinstance(h, fmt.FileHeader):
                result.unreadable.append(path)  # damaged or cut short: no evidence
                why = why or f"{path}: header cut short"
                continue
            ids.setdefault(h.channel_id, []).append(path)
            kinds.setdefault(h.crc_kind, []).append(path)
            result.headers.append(path)
            oldest = h.created_ns if oldest is None else min(oldest, h.created_ns)
    if len(ids) > 1:
        named = "; ".join(f"{cid.hex()} in {_some(paths)}" for cid, paths in ids.items())
        raise RepairRefusedError(
            f"refusing to rebuild {chan_path}: the data directories and data files disagree on the channel id "
            f"({named}); files of another channel are mixed in: move them out (or restore from a backup), then "
            "run it again"
        )
    if not result.identity_files or not result.headers or oldest is None:
        missing = (
            "no data directory identity file (DATADIR)"
            if not result.identity_files
            else f"no data file header that decodes{f' ({why})' if why else ''}"
        )
        raise RepairRefusedError(
            f"refusing to rebuild {chan_path}: {missing} to confirm the channel id and checksum kind with; "
            "restore the channel directory from a backup"
        )
    if len(kinds) > 1:
        named = "; ".join(f"kind {k} in {_some(p)}" for k, p in kinds.items())
        raise RepairRefusedError(
            f"refusing to rebuild {chan_path}: the data files disagree on the checksum kind ({named})"
        )
    ((cid, _),) = ids.items()
    ((kind, _),) = kinds.items()
    result.channel_id, result.crc_kind, result.created_ns = cid, kind, oldest
    data = encode_channel_file(cid, kind, oldest)
    try:
        decode_channel_file(data)  # a kind this installation cannot check (CRC-32C without google-crc32c)
    except FormatError as exc:
        raise RepairRefusedError(f"refusing to rebuild {chan_path}: {exc.reason}") from exc
    aside = f"{chan_path}{DAMAGED_SUFFIX}{time.time_ns()}"
    replace_durably(fs, aside + ".tmp", aside, damaged)
    result.damaged_copy = aside
    tmp = chan_path + ".tmp"
    if fs.exists(tmp):
        fs.unlink(tmp)  # left by an interrupted creation or repair
    replace_durably(fs, tmp, chan_path, data)
    return result
