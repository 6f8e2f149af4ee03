"""The channel directory's identity: ``CHANNEL``, ``DATA_DIRS``, each ``DATADIR``, and the locks.

This module owns the small files that say which channel a directory is and
where its data lives, and the locks that keep a second process out: it
creates a channel directory (``CHANNEL`` written last, so its presence marks a
complete creation), reads and checks ``CHANNEL``, loads ``DATA_DIRS`` (refusing a
different list), checks that every data directory is present and this
channel's, and records (under the locks) who owns each data directory. It
decides nothing about data files: that is ``recovery.py``'s job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import struct
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from . import format as fmt
from ._fs import FS, FileTooLarge, OsFS, read_file, replace_durably
from .crypto import MetaMac, header_cipher
from .errors import (
    ChannelCopyError,
    ChannelLockedError,
    ConfigError,
    CorruptLogError,
    DataDirOwnershipError,
    FormatError,
    NotAChannelError,
)
from .logstate import DEFAULT_DATA_DIR, LogState
from .permissions import check_channel_dir
from .scan import SEG_RE, CorruptionReport, oldest_authenticated

logger = logging.getLogger(__name__)

CHANNEL_FILE = "CHANNEL"
DATA_DIRS_FILE = "DATA_DIRS"
DATA_DIR_ID_FILE = "DATADIR"
LOCK_FILE = "LOCK"
ANCHOR_FILE = "ANCHOR"  # an encrypted channel's authenticated files as of the last checkpoint (MACed)
WAL_FILE = "WAL"  # marks a write-ahead log directory (filechannel.WriteAheadLog), written before CHANNEL
_WAL_MARK = b"filechannel write-ahead log\n"
_CHANNEL_MAGIC = b"FCCHANNL"
_CHANNEL_FMT = struct.Struct("<8sHH16sQ")
_U32 = struct.Struct("<I")
DATA_DIR_HINT = (
    "mount or restore it at this path (a backup restores the whole channel directory); "
    "to accept the loss of its events, open with on_corruption='skip' (every lost position is reported)"
)
_SMALL_FILE = 1 << 20  # CHANNEL, DATA_DIRS, DATADIR: never near this; a larger one is not read
_ANCHOR_MAX = 8 << 20  # ANCHOR: 52 bytes per live file (at most 65 536) and a trailer
_MAC_HINT = (
    "the file was edited or forged, or the keys given are not the channel's; restore the channel from a backup, "
    "or see docs/encryption.md"
)
_FOREIGN_HINT = "pass the data_dirs this channel was created with, or restore its own data directory"


# --------------------------------------------------------------------------
# the small files


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


def encode_meta(obj: dict[str, Any], mac: MetaMac | None = None, role: str = "") -> bytes:
    """Encode a small metadata file: one line of JSON, then ``crc32:`` and its zlib CRC-32 in hex.

    With ``mac`` (an encrypted channel) a third line ``mac:<key id>:<hex tag>``
    authenticates the JSON line in ``role`` (see :class:`filechannel.crypto.MetaMac`).
    """
    line = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    out = line + b"\ncrc32:%08x\n" % fmt.crc(fmt.CRC32_ZLIB, line)
    if mac is not None:
        key_id, tag = mac.tag(role, line)
        out += b"mac:%s:%s\n" % (key_id.encode("ascii"), tag.hex().encode("ascii"))
    return out


_META_TAIL = re.compile(rb"crc32:([0-9a-f]{8})(?:\nmac:([A-Za-z0-9._:-]{1,64}):([0-9a-f]{64}))?\n?")


def split_meta(buf: bytes, what: str) -> tuple[dict[str, Any], bytes, str | None, bytes | None]:
    """Decode a metadata file into ``(object, its JSON line, MAC key id, MAC tag)`` (None, None: no MAC).

    Raises:
        FormatError: the checksum does not match or the JSON is not an object.
    """
    line, sep, rest = buf.partition(b"\n")
    m = _META_TAIL.fullmatch(rest)
    if not sep or m is None:
        raise FormatError(len(line), f"{what}: no checksum line")
    if int(m.group(1), 16) != fmt.crc(fmt.CRC32_ZLIB, line):
        raise FormatError(len(line), f"{what}: checksum mismatch")
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json can parse
        raise FormatError(0, f"{what}: not JSON") from exc
    if not isinstance(obj, dict):
        raise FormatError(0, f"{what}: not a JSON object")
    key_id = m.group(2).decode("ascii") if m.group(2) is not None else None
    tag = bytes.fromhex(m.group(3).decode("ascii")) if m.group(3) is not None else None
    return obj, line, key_id, tag


def decode_meta(buf: bytes, what: str) -> dict[str, Any]:
    """Decode a metadata file written by :func:`encode_meta` (a MAC line is not checked here).

    Raises:
        FormatError: the checksum does not match or the JSON is not an object.
    """
    return split_meta(buf, what)[0]


def verify_mac(
    mac: MetaMac | None,
    required: bool,
    path: str,
    role: str,
    body: bytes | memoryview,
    key_id: str | None,
    tag: bytes | None,
) -> str | None:
    """Return why a small file's MAC does not vouch for it, or None when it does (or need not).

    ``required``: the channel is in its authenticated era (an encrypted channel
    with a data file of format version 2): a file without a MAC is then refused
    too. Without ``mac`` (no keys: an inspection) nothing is checked.

    Raises:
        DecryptionError: The MAC names a key that is not given.
    """
    if mac is None:
        return None
    if key_id is None or tag is None:
        return "it has no MAC, though the channel is encrypted and authenticated" if required else None
    return mac.check(path, role, body, key_id, tag)


def _same_dir(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


# --------------------------------------------------------------------------
# the directory


class ChannelDirectory:
    """Opens a channel directory: creates or locks it, reads its identity, checks its data directories.

    Sets ``st.channel_id``, ``st.crc_kind``, ``st.created_ns`` and ``st.data_dirs``.
    :meth:`record_owners` (after recovery) writes what :meth:`check_data_dirs`
    found out of date; :meth:`release` drops the locks.
    """

    def __init__(self, st: LogState) -> None:
        self.st = st
        self.lock_handle: int | None = None
        self.extra_locks: list[int] = []
        self.legacy_dirs = False  # DATA_DIRS is missing or of version 1: rewrite it after recovery
        self._rewrite: list[int] = []
        self._locked: set[str] = set()  # lock files this open holds
        self._mac_rewrite: list[int] = []  # identities to rewrite with a MAC (the channel just got keys)
        self.anchor_key_id: str | None = None  # the key ANCHOR's MAC was made with, as read

    # -- opening ----------------------------------------------------------------

    def open(self) -> None:
        """Create or lock the directory, read ``CHANNEL``, load and check the data directories.

        Raises:
            ChannelLockedError: Another open channel holds the directory or a data directory.
            CorruptLogError: ``CHANNEL`` or ``DATA_DIRS`` is damaged, or a data directory is missing.
            DataDirOwnershipError: A data directory belongs to another channel.
            NotAChannelError: ``directory`` exists but is not a channel directory.
        """
        st = self.st
        fs = st.fs
        top = st.directory
        check_channel_dir(fs, top, st.config.permissions, readonly=st.readonly)
        if fs.exists(top) and not fs.isdir(top):
            raise NotAChannelError(top, "it is a file")
        chan_path = os.path.join(top, CHANNEL_FILE)
        if not fs.exists(top) or not fs.exists(chan_path):
            if st.readonly:
                raise NotAChannelError(top, "no CHANNEL file (create a channel with filechannel.open)")
            self._create(chan_path)
        elif not st.readonly:
            self._lock(top)
        try:
            st.channel_id, st.crc_kind, st.created_ns = decode_channel_file(read_file(fs, chan_path, _SMALL_FILE))
        except FileTooLarge as exc:
            raise CorruptLogError(chan_path, 0, f"CHANNEL file is {exc.size} bytes: not a CHANNEL file") from exc
        except FormatError as exc:
            damaged = exc.reason.startswith("CHANNEL file is ") or exc.reason == "CHANNEL file checksum mismatch"
            hint = (
                "the channel's identity file is damaged (the data files may be intact): rebuild it from them "
                f"with `filechannel repair-channel-file {top}` (it keeps a copy of the damaged file)"
                if damaged
                else None
            )
            raise CorruptLogError(chan_path, exc.offset, exc.reason, hint) from exc
        is_wal = fs.exists(os.path.join(top, WAL_FILE))
        if is_wal and not st.wal:
            raise NotAChannelError(top, "it is a write-ahead log; open it with filechannel.WriteAheadLog")
        if st.wal and not is_wal:
            raise NotAChannelError(top, "it is a channel, not a write-ahead log; open it with filechannel.open")
        self.load_data_dirs()
        self._rewrite = self.check_data_dirs()

    def record_owners(self) -> None:
        """After recovery checked every data file against this channel's id: record who owns each data directory."""
        if self.st.readonly:
            return
        for i in sorted(set(self._rewrite) | set(self._mac_rewrite)):
            self.write_identity(i)
        self._rewrite = []
        self._mac_rewrite = []
        if self.legacy_dirs:
            self.write_data_dirs()

    def internal(self, d: str) -> bool:
        """Whether data directory ``d`` lies inside the channel directory (moves with it)."""
        top = os.path.abspath(self.st.directory)
        a = os.path.abspath(d)
        return a != top and os.path.commonpath([a, top]) == top

    def check_data_dirs(self) -> list[int]:
        """Check that every data directory is there and this channel's; lock each.

        Returns the indexes of directories whose identity file must be (re)written
        once recovery has checked their data files.

        Raises:
            CorruptLogError: A data directory is missing, or empty where data was recorded.
            DataDirOwnershipError: A data directory belongs to another channel.
            ChannelCopyError: This directory is a copy of a live channel whose data
                directory it would share.
        """
        st = self.st
        fs = st.fs
        rewrite: list[int] = []
        for i, d in enumerate(st.data_dirs):
            ident_path = os.path.join(d, DATA_DIR_ID_FILE)
            has_segs = fs.exists(d) and any(SEG_RE.match(n) for n in fs.listdir(d))
            if not fs.exists(d) or (not fs.exists(ident_path) and not has_segs and not self.legacy_dirs):
                what = "missing" if not fs.exists(d) else "empty (no identity file, no data files)"
                reason = f"data directory is {what}: moved, deleted, or its disk is not mounted"
                if st.config.on_corruption != "skip":
                    raise CorruptLogError(d, 0, reason, DATA_DIR_HINT)
                st.report_corruption(CorruptionReport(d, 0, reason, 0))
                st.dir_lost = True
                if st.readonly:
                    continue
                self.make_dir(d)
                rewrite.append(i)
            elif not fs.exists(ident_path):
                rewrite.append(i)  # written by an older version, or its identity file was lost
            else:
                cid, owner = self._read_identity(ident_path, i)
                if cid != st.channel_id:
                    raise DataDirOwnershipError(d, cid.hex(), st.channel_id.hex(), _FOREIGN_HINT)
                if not self.internal(d) and isinstance(owner, str) and not _same_dir(owner, st.directory):
                    if self._owner_is_live(owner):
                        raise ChannelCopyError(st.directory, owner, d)
                    rewrite.append(i)  # the channel directory moved: it owns the data directory now
            if not st.readonly:
                self._lock_extra(os.path.join(d, LOCK_FILE))
        return rewrite

    def _read_identity(self, ident_path: str, index: int | None = None) -> tuple[bytes, object]:
        """Read a data directory's ``DATADIR``: ``(channel id, recorded owner)``.

        With ``index`` (this channel's directory ``index``) its MAC is checked too.
        An identity without a MAC in a channel that does not require one yet is
        rewritten with one after recovery.
        """
        try:
            ident, line, key_id, tag = split_meta(
                read_file(self.st.fs, ident_path, _SMALL_FILE), "data directory identity"
            )
            cid = bytes.fromhex(str(ident["channel_id"]))
        except (FormatError, KeyError, ValueError) as exc:
            raise CorruptLogError(ident_path, 0, f"unreadable data directory identity: {exc}") from exc
        if index is not None and cid == self.st.channel_id:
            st = self.st
            problem = verify_mac(st.meta_mac, st.macs_required, ident_path, f"DATADIR:{index}", line, key_id, tag)
            if problem is not None:
                self._blame_key(st.data_dirs)
                raise CorruptLogError(ident_path, 0, f"data directory identity: {problem}", _MAC_HINT)
            stale = st.meta_mac is not None and key_id != st.meta_mac.key_id  # none yet, or an older key's
            if stale and not st.readonly and index not in self._mac_rewrite:
                self._mac_rewrite.append(index)
        return cid, ident.get("owner")

    def _owner_is_live(self, owner: str) -> bool:
        """Whether ``owner`` is a channel directory with this channel's id (the original of a copy)."""
        fs = self.st.fs
        path = os.path.join(owner, CHANNEL_FILE)
        try:
            return fs.exists(path) and decode_channel_file(read_file(fs, path))[0] == self.st.channel_id
        except (FormatError, OSError):
            return False

    def make_dir(self, d: str) -> None:
        """Create a directory; its entry (and any parent's) is durable before files in it count."""
        fs = self.st.fs
        missing = []
        p = os.path.abspath(d)
        while not fs.exists(p):
            missing.append(p)
            p = os.path.dirname(p)
        fs.makedirs(d)
        for m in missing:
            fs.fsync_dir(os.path.dirname(m))

    def write_identity(self, index: int) -> None:
        """Write data directory ``index``'s ``DATADIR``: this channel's id and, outside it, its path."""
        st = self.st
        d = st.data_dirs[index]
        owner = None if self.internal(d) else os.path.abspath(st.directory)
        data = encode_meta(
            {"channel_id": st.channel_id.hex(), "index": index, "owner": owner, "version": 1},
            st.meta_mac,
            f"DATADIR:{index}",
        )
        self.write_small_file(os.path.join(d, DATA_DIR_ID_FILE), data)

    def write_data_dirs(self) -> None:
        """Record the data directories: relative inside the channel directory, absolute outside it."""
        st = self.st
        top = os.path.abspath(st.directory)
        entries = [
            os.path.relpath(os.path.abspath(d), top) if self.internal(d) else os.path.abspath(d) for d in st.data_dirs
        ]
        self.write_small_file(
            os.path.join(st.directory, DATA_DIRS_FILE),
            encode_meta({"data_dirs": entries, "version": 2}, st.meta_mac, DATA_DIRS_FILE),
        )
        self.legacy_dirs = False

    def _lock_path(self, path: str) -> int | None:
        """Lock ``path`` (None: this open holds it already) and note who holds it in the file."""
        key = os.path.abspath(path)
        if key in self._locked:
            return None
        fs = self.st.fs
        try:
            handle = fs.lock(path)
        except BlockingIOError as exc:
            raise ChannelLockedError(os.path.dirname(path), lock_holder(fs, path)) from exc
        self._locked.add(key)
        _note_holder(fs, handle, _holder_record())
        return handle

    def _lock_extra(self, path: str) -> None:
        handle = self._lock_path(path)
        if handle is not None:
            self.extra_locks.append(handle)

    def _lock(self, top: str) -> None:
        self.lock_handle = self._lock_path(os.path.join(top, LOCK_FILE))

    def write_small_file(self, path: str, data: bytes) -> None:
        """Write a file atomically and durably: a temporary file, fsync, rename over, fsync of the directory."""
        fs = self.st.fs
        tmp = path + ".tmp"
        if fs.exists(tmp):
            fs.unlink(tmp)
        replace_durably(fs, tmp, path, data)

    def load_data_dirs(self) -> None:
        """Use the data directories recorded at creation; refuse a different list.

        ``DATA_DIRS`` (version 2) holds paths relative to the channel directory for
        data directories inside it, so a moved or restored channel finds its data.
        Version 1 (absolute paths, no checksum) is read too: a recorded
        ``<old>/data`` of a channel that was moved or copied here becomes this
        directory's own ``data``.
        """
        st = self.st
        fs = st.fs
        top = st.directory
        path = os.path.join(top, DATA_DIRS_FILE)
        if not fs.exists(path):
            self.legacy_dirs = True  # created before DATA_DIRS existed: the default or the given list
            self._set_mac_policy(st.data_dirs)
            return
        try:
            buf = read_file(fs, path, _SMALL_FILE)
        except FileTooLarge as exc:
            raise CorruptLogError(path, 0, f"list of data directories is {exc.size} bytes: damaged") from exc
        if b"\ncrc32:" in buf:
            try:
                obj, line, key_id, tag = split_meta(buf, "DATA_DIRS")
                recorded = obj["data_dirs"]
                if (
                    not isinstance(recorded, list)
                    or not recorded
                    or not all(isinstance(d, str) and d for d in recorded)
                ):
                    raise FormatError(0, "data_dirs must be a non-empty list of paths")
            except (FormatError, KeyError) as exc:
                raise CorruptLogError(path, 0, f"unreadable list of data directories: {exc}") from exc
            dirs = [d if os.path.isabs(d) else os.path.join(top, d) for d in recorded]
            self._set_mac_policy(dirs)
            problem = verify_mac(st.meta_mac, st.macs_required, path, DATA_DIRS_FILE, line, key_id, tag)
            if problem is not None:
                self._blame_key(dirs)
                raise CorruptLogError(path, 0, f"list of data directories: {problem}", _MAC_HINT)
            if st.meta_mac is not None and key_id != st.meta_mac.key_id:
                self.legacy_dirs = True  # rewritten with a MAC (under the active key) after recovery
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
            self.legacy_dirs = True
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
            self._set_mac_policy(dirs)
            if st.macs_required:
                raise CorruptLogError(
                    path,
                    0,
                    "list of data directories has no MAC, though the channel is encrypted and authenticated",
                    _MAC_HINT,
                )
        if st.config.data_dirs is not None:
            given = [os.path.abspath(d) for d in st.config.data_dirs]
            if given != [os.path.abspath(d) for d in dirs]:
                raise ConfigError(
                    "data_dirs",
                    f"the channel was created with data_dirs={[os.path.abspath(d) for d in dirs]}; "
                    "pass the same list, or omit data_dirs",
                )
        st.data_dirs = dirs

    def _set_mac_policy(self, dirs: list[str]) -> None:
        """Decide whether this channel's small files must carry a MAC (see :func:`verify_mac`).

        They must once the channel is encrypted and authenticated: ``ANCHOR`` exists,
        or a data directory holds a data file of format version 2. Before that (a
        channel that just got keys) files without a MAC are read, and rewritten with one.
        """
        st = self.st
        if st.config.encryption is None:
            return
        st.meta_mac = st.config.encryption.meta_mac(st.channel_id)
        st.macs_required = st.fs.exists(os.path.join(st.directory, ANCHOR_FILE)) or (
            oldest_authenticated(st.fs, dirs) != fmt.NO_AUTH_FILE
        )

    def _blame_key(self, dirs: list[str]) -> None:
        """Before a MAC failure is called an edit: raise if the keys given are not the channel's.

        The newest data file of each directory is checked against the keys (its
        header's key check); a wrong key then gets its own clear error.

        Raises:
            DecryptionError: A data file's key is missing or not the one given.
        """
        st = self.st
        for d in dirs:
            if not st.fs.exists(d):
                continue
            ids = sorted(int(m.group(1), 16) for n in st.fs.listdir(d) if (m := SEG_RE.match(n)))
            for fid in reversed(ids):
                path = os.path.join(d, f"seg-{fid:016x}.wal")
                try:
                    fd = st.fs.open_read(path)
                    try:
                        head = st.fs.pread(fd, fmt.MAX_HEADER_LEN, 0)
                    finally:
                        st.fs.close(fd)
                    h = fmt.decode_file_header(head)
                except (OSError, FormatError):
                    continue
                if isinstance(h, fmt.FileHeader) and h.cipher and h.channel_id == st.channel_id:
                    header_cipher(st.config.encryption, path, h, head, st.channel_id)
                    break

    def read_anchor(self) -> fmt.AuthState | None:
        """Read ``ANCHOR``, the authenticated files as of the last checkpoint (None: there is none, or no keys).

        Raises:
            CorruptLogError: It is damaged, its MAC fails, or it is missing in an
                authenticated channel (``on_corruption="skip"``: reported, None).
            DecryptionError: Its MAC names a key that is not given.
        """
        st = self.st
        if st.meta_mac is None:
            return None
        path = os.path.join(st.directory, ANCHOR_FILE)
        problem: str | None = None
        state = None
        if not st.fs.exists(path):
            if oldest_authenticated(st.fs, st.data_dirs) != fmt.NO_AUTH_FILE:
                problem = "ANCHOR is missing, though the channel has authenticated data files"
        else:
            try:
                body, key_id, tag = fmt.split_sealed(read_file(st.fs, path, _ANCHOR_MAX))
                problem = verify_mac(st.meta_mac, True, path, ANCHOR_FILE, body, key_id, tag)
                if problem is None:
                    state = fmt.decode_auth_state(body)
                    self.anchor_key_id = key_id
            except FormatError as exc:
                problem = exc.reason
            except FileTooLarge as exc:
                problem = f"ANCHOR is {exc.size} bytes: damaged"
        if problem is None:
            return state
        self._blame_key(st.data_dirs)
        reason = f"{problem}: whole batches cut from the end of a data file, or a data file replaced, cannot be checked"
        if st.config.on_corruption != "skip":
            raise CorruptLogError(path, 0, reason, _MAC_HINT)
        st.report_corruption(CorruptionReport(path, 0, reason, 0))
        return None

    def write_anchor(self, state: fmt.AuthState | None) -> None:
        """Replace ``ANCHOR`` (MACed) with ``state`` under the next generation (see :class:`format.AuthState`).

        The generation a checkpoint records moves up only once the new ``ANCHOR``
        is durable, so ``ANCHOR`` on disk is never older than a checkpoint says.
        """
        st = self.st
        if st.meta_mac is None or state is None or st.readonly:
            return
        generation = st.anchor_generation + 1
        body = fmt.encode_auth_state(dataclasses.replace(state, generation=generation))
        key_id, tag = st.meta_mac.tag(ANCHOR_FILE, body)
        self.write_small_file(os.path.join(st.directory, ANCHOR_FILE), fmt.encode_sealed(body, key_id, tag))
        st.anchor_generation = generation

    def _create(self, chan_path: str) -> None:
        st = self.st
        fs = st.fs
        top = st.directory
        existed = fs.exists(top)
        if existed:
            # Refused before the lock too, so a refused open leaves no LOCK behind; under the
            # lock the check is made again (the directory may have changed meanwhile).
            self._refuse_foreign_entries(top)
        fs.makedirs(top)
        self._lock(top)
        if fs.exists(chan_path):  # created concurrently before we took the lock
            return
        self._refuse_foreign_entries(top)
        # Every data directory is locked, and checked to be no other channel's, before
        # anything is written into it: a refused creation leaves other channels as they were.
        self._claim_data_dirs()
        for d in st.data_dirs:
            if fs.exists(d) and any(SEG_RE.match(n) for n in fs.listdir(d)):
                raise NotAChannelError(top, f"no CHANNEL file, but data directory {d} holds data files of some channel")
        # Where the data lives is recorded first, so every later open finds it;
        # CHANNEL is written last: its presence marks a complete creation.
        st.channel_id = uuid.uuid4().bytes
        wal_path = os.path.join(top, WAL_FILE)
        if st.wal:
            self.write_small_file(wal_path, _WAL_MARK)
        elif fs.exists(wal_path):
            fs.unlink(wal_path)  # left by an interrupted creation of a write-ahead log
        self.write_data_dirs()
        for i, d in enumerate(st.data_dirs):
            self.make_dir(d)
            self.write_identity(i)
        data = encode_channel_file(st.channel_id, fmt.default_crc_kind(), time.time_ns())
        self.write_small_file(chan_path, data)
        if not existed:
            parent = os.path.dirname(os.path.abspath(top))
            fs.fsync_dir(parent)
        logger.info("created channel %s", top)

    def _refuse_foreign_entries(self, top: str) -> None:
        """Refuse to create a channel in a directory holding anything but an interrupted creation's files."""
        st = self.st
        fs = st.fs
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
        for d in st.data_dirs:
            if self.internal(d) and fs.exists(d) and not set(fs.listdir(d)) - made:
                leftovers.add(os.path.relpath(os.path.abspath(d), os.path.abspath(top)).split(os.sep)[0])
        others = [n for n in fs.listdir(top) if n not in leftovers]
        if others:
            raise NotAChannelError(
                top, f"it holds {len(others)} other entries but no CHANNEL file; use an empty directory"
            )

    def _claim_data_dirs(self) -> None:
        """At creation: refuse a data directory another channel holds or owns; lock each one that exists.

        An interrupted creation of this very directory leaves identities of a channel
        whose ``CHANNEL`` was never written; such an identity names this directory as
        owner (or the data directory lies inside it) and is taken over.

        Raises:
            ChannelLockedError: Another open channel holds a data directory.
            DataDirOwnershipError: A data directory is another channel's.
        """
        st = self.st
        fs = st.fs
        for d in st.data_dirs:
            if not fs.exists(d):
                continue
            # Once the lock is held, nothing can change the identity under us.
            self._lock_extra(os.path.join(d, LOCK_FILE))
            ident_path = os.path.join(d, DATA_DIR_ID_FILE)
            if not fs.exists(ident_path):
                continue
            try:
                cid, owner = self._read_identity(ident_path)
            except CorruptLogError:
                continue  # an identity torn by an interrupted creation: rewritten below
            if self.internal(d) or (isinstance(owner, str) and _same_dir(owner, st.directory)):
                continue
            raise DataDirOwnershipError(
                d,
                cid.hex(),
                None,
                f"give this channel data directories of its own (data_dirs=...), or, if that channel is "
                f"gone for good, delete {ident_path}",
            )

    def release(self) -> None:
        """Drop the locks (idempotent); the holder noted in each lock file is cleared first."""
        fs = self.st.fs
        for h in self.extra_locks:
            _note_holder(fs, h, b"")
            fs.unlock(h)
        self.extra_locks = []
        self._locked.clear()
        if self.lock_handle is not None:
            _note_holder(fs, self.lock_handle, b"")
            fs.unlock(self.lock_handle)
            self.lock_handle = None


# --------------------------------------------------------------------------
# who holds a lock (informational: the flock alone keeps a second opener out)


def _holder_record() -> bytes:
    now = time.time()
    since = datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "since_ns": time.time_ns()}
    return json.dumps(info, sort_keys=True).encode() + b"\n"


def _note_holder(fs: FS, handle: int, data: bytes) -> None:
    """Write ``data`` (who holds the lock; empty on release) into a held lock file, best effort.

    Only on the real file system, where the lock handle is the lock file's descriptor.
    It is never fsynced and never trusted: a reader only shows it in an error.
    """
    if not isinstance(fs, OsFS):
        return
    try:
        fs.truncate(handle, 0)
        if data:
            fs.pwrite_all(handle, data, 0)
    except OSError as exc:
        logger.debug("could not note the lock holder: %s", exc)


def lock_holder(fs: FS, path: str) -> str | None:
    """Describe who holds lock file ``path`` as it says (``pid 42 on host h since ...``), or None.

    Read only to make an error message helpful: the content may be missing (an
    older version, a file the caller cannot read), half written or stale, so
    whatever does not parse, or names a process of this host that no longer
    runs, gives None.
    """
    try:
        info = json.loads(read_file(fs, path))
        pid, host, since = int(info["pid"]), str(info["host"]), str(info["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid <= 0:
        return None
    if host == socket.gethostname():
        if pid == os.getpid():
            return f"this process, pid {pid}, since {since}"
        try:
            os.kill(pid, 0)  # signal 0: does it run?
        except ProcessLookupError:
            return None
        except OSError:
            pass  # it runs, as another user
    return f"pid {pid} on host {host} since {since}"
