"""Channel options: a frozen dataclass that validates itself.

``filechannel.open(path, **options)`` builds a :class:`ChannelConfig` from its
keyword arguments, so an unknown option or a bad value raises
:class:`~filechannel.errors.ConfigError` naming the option and the rule before
anything touches the disk.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from .errors import ConfigError
from .permissions import PERMISSIONS

if TYPE_CHECKING:
    from .crypto import Encryption

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

FSYNC_MODES = ("commit", "interval")
REPLAY_MODES = ("checkpoint", "full")
CORRUPTION_POLICIES = ("fail", "skip")
MIN_FILE_SIZE = 4 * KiB
DEFAULT_MAX_EVENT_SIZE = 8 * MiB
MAX_CHECKPOINT_SPREAD = 60.0
"""Longest a background checkpoint spreads its writes, in seconds: until it is
written, the queue cannot compact the columns it lent to it."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class ChannelConfig:
    """Every option of a channel, with its default.

    Attributes:
        capacity: Most events the channel holds: queued plus put in open transactions.
        transaction_capacity: Most puts, and most takes, in one transaction.
        max_file_size: Size at which a data file is closed and a new one started.
        max_event_size: Largest event (body plus encoded headers) a put accepts, a
            positive int. ``None`` (the default) means 8 MiB, or ``max_file_size``
            minus 1 KiB when that is smaller; after construction it is always the
            int in force. 0 and negative values are refused.
        fsync: ``"commit"`` (durable when commit returns) or ``"interval"``.
        fsync_interval: Seconds between background fsyncs when ``fsync="interval"``.
        keep_alive: Seconds a put waits for room in a full channel.
        max_bytes: Most bytes of data files the channel may hold (Vector's ``max_size``),
            or ``None`` (the default): no limit but ``capacity`` and the disk. Counted
            as the length of the live data files (not the zero-filled space written
            ahead of the writer, at most 1 MiB per data directory); a put that would
            pass it waits up to ``keep_alive`` for files to retire, then raises
            ``ChannelFullError`` with ``reason="max_bytes"``. At least twice
            ``max_file_size`` per data directory (the file being written never
            retires). A file retires only once every event in it is taken and every
            consumer has passed it.
        minimum_required_space: The free-space floor: bytes that must stay free on each
            data directory's file system. A put below it (or whose commit would take
            free space below it) waits up to ``keep_alive`` for space, then raises
            ``DiskSpaceError`` (a ``ChannelFullError``, ``reason="min_free"``). Takes,
            acknowledgements and retirements are never refused for space.
        on_corruption: ``"fail"`` (refuse to open) or ``"skip"`` (drop and report).
        data_dirs: Data directories (one per disk); default ``<dir>/data``.
        cache_bytes: Bytes of recently put events kept in memory to serve takes.
        checkpoint_interval: Seconds between background checkpoints; 0 disables them
            (a checkpoint is still written on close and on demand).
        checkpoint_spread: Fraction of ``checkpoint_interval`` (at most
            :data:`MAX_CHECKPOINT_SPREAD` seconds) over which a background checkpoint
            spreads its writes, so that commits do not queue behind a burst of
            checkpoint I/O (as PostgreSQL's ``checkpoint_completion_target``).
            0 writes at full speed. ``checkpoint()`` and ``close()`` never wait.
        backup_checkpoint_dir: A second directory (another disk) that receives a copy
            of every checkpoint; default: none (the previous checkpoint is kept beside
            the newest in ``<dir>/checkpoints``).
        replay: ``"checkpoint"`` (default) restarts from the newest valid checkpoint;
            ``"full"`` ignores checkpoints and replays every data file.
        anchor_interval: Seconds between refreshes of an encrypted channel's ``ANCHOR``
            between checkpoints (when something was committed): how long a batch can
            stay cut from the end of the newest data file without recovery noticing
            (docs/encryption.md). 0: only with checkpoints. Ignored without encryption.
        ack_interval: Seconds between polls of the external consumers' acknowledgements
            by a background thread, which turns them into committed takes; 0 disables
            the thread (acknowledgements are still applied at open, on close and by
            ``apply_acks()``).
        encryption: A :class:`filechannel.Encryption` (keys and the active key id):
            new data files encrypt every event under the active key; existing
            files are read with the key their header names. ``None`` (default):
            plaintext, and a channel holding encrypted files refuses to open.
        permissions: ``"owner"`` (default): every file the channel creates is 0600 and
            every directory 0700, whatever the umask; ``"group"``: 0640 and 0750, so
            that the directory's group can read (never write) it. An open refuses a
            directory owned by another user or open beyond that (see ``permissions.py``).
    """

    capacity: int = 1_000_000
    transaction_capacity: int = 10_000
    max_file_size: int = 64 * MiB
    # None is resolved to an int in __post_init__; readers always see the int in force.
    max_event_size: int = None  # type: ignore[assignment]
    fsync: str = "commit"
    fsync_interval: float = 5.0
    keep_alive: float = 3.0
    minimum_required_space: int = 64 * MiB
    max_bytes: int | None = None
    on_corruption: str = "fail"
    data_dirs: tuple[str, ...] | None = None
    cache_bytes: int = 16 * MiB
    checkpoint_interval: float = 30.0
    checkpoint_spread: float = 0.5
    backup_checkpoint_dir: str | None = None
    replay: str = "checkpoint"
    anchor_interval: float = 1.0
    ack_interval: float = 0.5
    encryption: Any = None
    permissions: str = "owner"

    def __post_init__(self) -> None:
        """Check every option; raise ConfigError for the first bad one."""
        if self.max_event_size is None and _is_int(self.max_file_size) and self.max_file_size >= MIN_FILE_SIZE:
            object.__setattr__(self, "max_event_size", min(DEFAULT_MAX_EVENT_SIZE, self.max_file_size - 1024))
        # Before max_event_size, whose default derives from it: blame the option that was set.
        if _is_int(self.max_file_size) and 0 < self.max_file_size < MIN_FILE_SIZE:
            raise ConfigError("max_file_size", f"must be at least {MIN_FILE_SIZE}, got {self.max_file_size}")
        if _is_int(self.max_event_size) and self.max_event_size <= 0:
            # 0 once meant "the default"; now it would be a limit no event meets.
            raise ConfigError(
                "max_event_size",
                f"must be a positive number of bytes, got {self.max_event_size}; leave it out for the default (8 MiB)",
            )
        for name in ("capacity", "transaction_capacity", "max_file_size", "max_event_size"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(name, f"must be a positive int, got {v!r}")
        for name in ("minimum_required_space", "cache_bytes"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ConfigError(name, f"must be an int >= 0, got {v!r}")
        if self.max_bytes is not None:
            if not _is_int(self.max_bytes) or self.max_bytes <= 0:
                raise ConfigError(
                    "max_bytes", f"must be a positive number of bytes, or None for no limit, got {self.max_bytes!r}"
                )
            ndirs = len(self.data_dirs) if isinstance(self.data_dirs, (tuple, list)) and self.data_dirs else 1
            least = 2 * self.max_file_size * ndirs
            if self.max_bytes < least:
                raise ConfigError(
                    "max_bytes",
                    f"{self.max_bytes} is under twice max_file_size={self.max_file_size} per data directory "
                    f"({least}): the file being written never retires, so the channel could fill up for good; "
                    "raise max_bytes or lower max_file_size",
                )
        if self.transaction_capacity > self.capacity:
            raise ConfigError(
                "transaction_capacity",
                f"{self.transaction_capacity} exceeds capacity={self.capacity}",
            )
        if self.max_file_size < MIN_FILE_SIZE:
            raise ConfigError("max_file_size", f"must be at least {MIN_FILE_SIZE}, got {self.max_file_size}")
        if self.max_file_size > 1 << 40:
            raise ConfigError("max_file_size", "must be at most 1 TiB")
        # A record plus a batch trailer must fit in an empty file.
        if self.max_event_size > self.max_file_size - 1024:
            raise ConfigError(
                "max_event_size",
                f"{self.max_event_size} does not fit in max_file_size={self.max_file_size} (leave 1 KiB for framing)",
            )
        if self.max_event_size >= 1 << 32:
            raise ConfigError("max_event_size", "must be below 4 GiB")
        if self.fsync not in FSYNC_MODES:
            raise ConfigError("fsync", f"must be one of {FSYNC_MODES}, got {self.fsync!r}")
        if not _is_number(self.fsync_interval) or self.fsync_interval <= 0:
            raise ConfigError("fsync_interval", f"must be a number of seconds > 0, got {self.fsync_interval!r}")
        if not _is_number(self.keep_alive) or self.keep_alive < 0:
            raise ConfigError("keep_alive", f"must be a number of seconds >= 0, got {self.keep_alive!r}")
        if not _is_number(self.checkpoint_interval) or self.checkpoint_interval < 0:
            raise ConfigError(
                "checkpoint_interval", f"must be a number of seconds >= 0, got {self.checkpoint_interval!r}"
            )
        if not _is_number(self.checkpoint_spread) or not 0 <= self.checkpoint_spread < 1:
            v = self.checkpoint_spread
            raise ConfigError("checkpoint_spread", f"must be a fraction >= 0 and < 1 of checkpoint_interval, got {v!r}")
        if not _is_number(self.anchor_interval) or self.anchor_interval < 0:
            raise ConfigError("anchor_interval", f"must be a number of seconds >= 0, got {self.anchor_interval!r}")
        if not _is_number(self.ack_interval) or self.ack_interval < 0:
            raise ConfigError("ack_interval", f"must be a number of seconds >= 0, got {self.ack_interval!r}")
        if self.backup_checkpoint_dir is not None and (
            not isinstance(self.backup_checkpoint_dir, str) or not self.backup_checkpoint_dir
        ):
            raise ConfigError("backup_checkpoint_dir", f"must be a directory path, got {self.backup_checkpoint_dir!r}")
        if self.replay not in REPLAY_MODES:
            raise ConfigError("replay", f"must be one of {REPLAY_MODES}, got {self.replay!r}")
        if self.encryption is not None:
            from .crypto import Encryption  # no optional import: cryptography loads only when a key is used

            if not isinstance(self.encryption, Encryption):
                raise ConfigError(
                    "encryption", f"must be a filechannel.Encryption or None, got {type(self.encryption).__name__}"
                )
        if self.permissions not in PERMISSIONS:
            raise ConfigError("permissions", f"must be one of {PERMISSIONS}, got {self.permissions!r}")
        if self.on_corruption not in CORRUPTION_POLICIES:
            raise ConfigError("on_corruption", f"must be one of {CORRUPTION_POLICIES}, got {self.on_corruption!r}")
        if self.data_dirs is not None:
            dirs = self.data_dirs
            if isinstance(dirs, (str, bytes)) or not isinstance(dirs, (tuple, list)):
                raise ConfigError("data_dirs", f"must be a list of directory paths, got {dirs!r}")
            if not dirs:
                raise ConfigError("data_dirs", "must name at least one directory")
            norm = []
            for d in dirs:
                p = os.fspath(d) if isinstance(d, os.PathLike) else d
                if not isinstance(p, str) or not p:
                    raise ConfigError("data_dirs", f"each entry must be a non-empty str path, got {d!r}")
                norm.append(p)
            if len(set(norm)) != len(norm):
                raise ConfigError("data_dirs", "lists the same directory twice")
            object.__setattr__(self, "data_dirs", tuple(norm))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ChannelConfig:
        """Build a config from keyword options; unknown names raise ConfigError."""
        known = {f.name for f in fields(cls)}
        for name in options:
            if name not in known:
                raise ConfigError(name, f"unknown option (known: {', '.join(sorted(known))})")
        opts = dict(options)
        if isinstance(opts.get("data_dirs"), list):
            opts["data_dirs"] = tuple(opts["data_dirs"])
        return cls(**opts)


class ChannelOptions(TypedDict, total=False):
    """The keyword options of :func:`filechannel.open`, typed (one per :class:`ChannelConfig` field).

    ``filechannel.open(path, capacity="10")`` is a type error for mypy and
    pyright, and a :class:`ConfigError` at run time; ``tests/test_typing.py``
    keeps the two lists equal.
    """

    capacity: int
    transaction_capacity: int
    max_file_size: int
    max_event_size: int | None
    fsync: Literal["commit", "interval"]
    fsync_interval: float
    keep_alive: float
    minimum_required_space: int
    max_bytes: int | None
    on_corruption: Literal["fail", "skip"]
    data_dirs: Sequence[str | os.PathLike[str]] | None
    cache_bytes: int
    checkpoint_interval: float
    checkpoint_spread: float
    backup_checkpoint_dir: str | os.PathLike[str] | None
    replay: Literal["checkpoint", "full"]
    anchor_interval: float
    ack_interval: float
    encryption: Encryption | None
    permissions: Literal["owner", "group"]
