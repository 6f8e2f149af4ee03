"""Deliberate, reproducible damage to a closed channel, so users can test their ``on_corruption`` choice.

:func:`damage` flips bytes inside written records, truncates a file inside a
record, or deletes a file, in a data file or in the newest checkpoint. Records
are found with the project's one parser (:class:`filechannel.scan.Scanner`),
every change goes through the I/O seam (:mod:`filechannel._fs`, so a
simulated file system works too), and all choices come from a RNG seeded with
``seed``: the same seed on identical directories damages identical bytes.
"""

from __future__ import annotations

import errno
import json
import os
import random
from dataclasses import dataclass

from filechannel import format as fmt
from filechannel._fs import FS, OsFS, read_file, truncate_durably
from filechannel.checkpoint import CHECKPOINT_DIR
from filechannel.config import ChannelConfig
from filechannel.directory import CHANNEL_FILE, DATA_DIRS_FILE, LOCK_FILE, decode_channel_file, decode_meta
from filechannel.errors import ChannelError, ChannelLockedError
from filechannel.logstate import DEFAULT_DATA_DIR
from filechannel.scan import SEG_RE, CorruptionReport, LogRecord, Scanner

__all__ = ["KINDS", "TARGETS", "Damage", "DamageError", "damage"]

KINDS = ("flip", "truncate", "delete")
TARGETS = ("data", "checkpoint")


class DamageError(ChannelError, ValueError):
    """:func:`damage` cannot do what it was asked (a bad argument, or nothing of that kind to damage)."""


@dataclass(frozen=True)
class Damage:
    """What :func:`damage` did.

    ``offsets``: the bytes flipped (``flip``) or the new length (``truncate``),
    as offsets in ``path``; empty for ``delete``. ``record``: for data files,
    ``(offset, size)`` of the record the damage fell in.
    """

    kind: str
    target: str
    path: str
    offsets: tuple[int, ...]
    size_before: int
    size_after: int
    record: tuple[int, int] | None = None

    def describe(self) -> str:
        """One line saying what was done."""
        where = f" (record at {self.record[0]}, {self.record[1]} bytes)" if self.record else ""
        if self.kind == "flip":
            return f"flipped byte(s) at {', '.join(map(str, self.offsets))} of {self.path}{where}"
        if self.kind == "truncate":
            return f"truncated {self.path} from {self.size_before} to {self.size_after} bytes{where}"
        return f"deleted {self.path} ({self.size_before} bytes)"


class _Context:
    """What the scanner needs of a directory (a closed channel: damage is only collected, never acted on)."""

    def __init__(self, channel_id: bytes, crc_kind: int) -> None:
        self.channel_id = channel_id
        self.crc_kind = crc_kind
        self.max_payload = 0xFFFF_FFFF
        self.config = ChannelConfig(on_corruption="skip")
        self.reports: list[CorruptionReport] = []

    def report_corruption(self, report: CorruptionReport) -> None:
        self.reports.append(report)

    def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
        pass


def _records(fs: FS, directory: str) -> list[tuple[str, list[LogRecord], int]]:
    """``(path, verified records, size)`` of every data file that holds records, in file order."""
    try:
        channel_id, crc_kind, _ = decode_channel_file(read_file(fs, os.path.join(directory, CHANNEL_FILE)))
    except FileNotFoundError:
        raise DamageError(f"{directory} is not a channel (no {CHANNEL_FILE} file)") from None
    ctx = _Context(channel_id, crc_kind)
    out = []
    names = [
        (data, name)
        for data in _data_dirs(fs, directory)
        if fs.isdir(data)
        for name in sorted(n for n in fs.listdir(data) if SEG_RE.match(n))
    ]
    for data, name in names:
        path = os.path.join(data, name)
        buf = read_file(fs, path)
        header = fmt.decode_file_header(buf)
        if not isinstance(header, fmt.FileHeader):
            continue
        m = SEG_RE.match(name)
        assert m is not None
        scan = Scanner(ctx, path, int(m.group(1), 16), buf, header).scan(newest=True, prev_woid=0)
        if scan.records:
            out.append((path, scan.plain(), len(buf)))
    return out


def _data_dirs(fs: FS, directory: str) -> list[str]:
    """The channel's data directories, as recorded at creation (``DATA_DIRS``), else the default one."""
    path = os.path.join(directory, DATA_DIRS_FILE)
    if not fs.exists(path):
        return [os.path.join(directory, DEFAULT_DATA_DIR)]
    buf = read_file(fs, path)
    try:
        # version 2 is checksummed; version 1 is plain JSON with absolute paths
        recorded = decode_meta(buf, DATA_DIRS_FILE) if b"\ncrc32:" in buf else json.loads(buf)
        recorded = recorded["data_dirs"]
    except (ChannelError, ValueError, KeyError, TypeError) as exc:
        raise DamageError(f"{path} cannot be read ({exc}): the channel is damaged already") from None
    return [d if os.path.isabs(d) else os.path.join(directory, d) for d in recorded]


def _newest_checkpoint(fs: FS, directory: str) -> str:
    d = os.path.join(directory, CHECKPOINT_DIR)
    names = sorted(n for n in fs.listdir(d) if n.endswith(".ckpt")) if fs.isdir(d) else []
    if not names:
        raise DamageError(f"{directory} has no checkpoint to damage (close the channel or call checkpoint() first)")
    return os.path.join(d, names[-1])


def damage(
    directory: str | os.PathLike[str],
    kind: str,
    *,
    target: str = "data",
    seed: int = 0,
    nbytes: int = 1,
    fs: FS | None = None,
) -> Damage:
    """Damage a closed channel reproducibly and say what was done.

    Args:
        directory: The channel directory (closed: its lock must be free).
        kind: ``"flip"`` (``nbytes`` bytes inside one written record, or inside
            the checkpoint), ``"truncate"`` (cut inside a record, or the
            checkpoint short) or ``"delete"`` (a data file that holds records,
            or the newest checkpoint).
        target: ``"data"`` (a data file of any of the channel's data directories) or
            ``"checkpoint"`` (the newest checkpoint).
        seed: Chooses the file, the record and the bytes; the same seed on
            identical directories damages identical bytes.
        nbytes: How many bytes ``flip`` changes (all in the same record).
        fs: The file system (default: the real one; tests pass a ``SimFS``).

    Returns:
        A :class:`Damage` naming the file, the offsets and the record.

    Raises:
        DamageError: an unknown ``kind``/``target``, nothing to damage, or
            the channel is open (its lock is held).
    """
    if kind not in KINDS:
        raise DamageError(f"unknown damage kind {kind!r}: use one of {', '.join(KINDS)}")
    if target not in TARGETS:
        raise DamageError(f"unknown damage target {target!r}: use one of {', '.join(TARGETS)}")
    if not isinstance(nbytes, int) or nbytes < 1:
        raise DamageError(f"nbytes must be a positive int, not {nbytes!r}")
    fs = fs or OsFS()
    directory = os.fspath(directory)
    try:
        lock = fs.lock(os.path.join(directory, LOCK_FILE))
    except BlockingIOError:
        raise ChannelLockedError(directory) from None
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise DamageError(f"{directory} is not a channel directory") from None
        raise
    try:
        return _damage(fs, directory, kind, target, random.Random(f"{seed}/{kind}/{target}"), nbytes)
    finally:
        fs.unlock(lock)


def _damage(fs: FS, directory: str, kind: str, target: str, rng: random.Random, nbytes: int) -> Damage:
    record: tuple[int, int] | None = None
    if target == "data":
        files = _records(fs, directory)
        if not files:
            raise DamageError(f"{directory} has no data file holding records to damage")
        path, records, size = rng.choice(files)
        rec = rng.choice(records)
        record = (rec.offset, rec.size)
        lo, hi = rec.offset, rec.offset + rec.size  # the bytes damage may touch
    else:
        path = _newest_checkpoint(fs, directory)
        size = len(read_file(fs, path))
        lo, hi = 0, size
    if kind == "delete":
        fs.unlink(path)
        fs.fsync_dir(os.path.dirname(path))
        return Damage(kind, target, path, (), size, 0, record)
    if kind == "truncate":
        cut = rng.randrange(lo + 1, hi) if hi - lo > 1 else lo
        truncate_durably(fs, path, cut)
        return Damage(kind, target, path, (cut,), size, cut, record)
    offsets = sorted(rng.sample(range(lo, hi), min(nbytes, hi - lo)))
    buf = read_file(fs, path)
    fd = fs.open_rw(path)
    try:
        for off in offsets:
            fs.pwrite_all(fd, bytes([buf[off] ^ rng.randrange(1, 256)]), off)
        fs.fsync(fd)
    finally:
        fs.close(fd)
    return Damage(kind, target, path, tuple(offsets), size, size, record)
