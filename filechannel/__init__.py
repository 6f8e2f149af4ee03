"""filechannel: a durable, transactional file channel in the style of Flume's FileChannel.

Producers put events inside transactions and consumers take them inside
transactions; both commit or roll back. Every commit is appended to a
checksummed write-ahead log and, by default, fsynced before ``commit()``
returns, so after a crash the channel reopens holding exactly the committed,
untaken events, in order, with their positions.

>>> import tempfile, filechannel
>>> with filechannel.open(tempfile.mkdtemp() + "/ch") as ch:
...     with ch.transaction() as tx:
...         tx.put(b"hello", headers={"source": "doc"})
...     with ch.transaction() as tx:
...         ev = tx.take()
>>> (ev.body, dict(ev.headers), ev.position)
(b'hello', {'source': 'doc'}, 0)

This module exports the public names only and imports nothing optional.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Unpack

from ._fs import FS
from ._version import __version__
from .channel import Event, FileChannel, Transaction, open_channel
from .config import ChannelConfig, ChannelOptions
from .crypto import Encryption
from .errors import (
    AckRangeError,
    AgentAuthError,
    AgentError,
    AgentProtocolError,
    AgentTimeoutError,
    AgentUnavailableError,
    ChannelClosedError,
    ChannelCopyError,
    ChannelError,
    ChannelFullError,
    ChannelLockedError,
    ConfigError,
    ConsumerConflictError,
    ConsumerIdentityError,
    CorruptLogError,
    DataDirOwnershipError,
    DataLossError,
    DecryptionError,
    DiskFullError,
    DiskSpaceError,
    EventTooLargeError,
    FormatError,
    InvalidEventError,
    InvalidHandleError,
    NotAChannelError,
    RecordTooLargeError,
    TransactionCapacityError,
    TransactionStateError,
    UnknownChannelError,
    UnsafePermissionsError,
)
from .log import Log
from .reader import ChannelReader, Segment, read_segment
from .wal import RecordHandle, WriteAheadLog

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AckRangeError",
    "AgentAuthError",
    "AgentError",
    "AgentProtocolError",
    "AgentTimeoutError",
    "AgentUnavailableError",
    "ChannelClosedError",
    "ChannelConfig",
    "ChannelOptions",
    "ChannelReader",
    "ChannelCopyError",
    "DataDirOwnershipError",
    "ChannelError",
    "ChannelFullError",
    "ChannelLockedError",
    "ConfigError",
    "ConsumerConflictError",
    "ConsumerIdentityError",
    "CorruptLogError",
    "DataLossError",
    "DecryptionError",
    "DiskSpaceError",
    "DiskFullError",
    "Encryption",
    "Event",
    "EventTooLargeError",
    "FileChannel",
    "FormatError",
    "InvalidEventError",
    "InvalidHandleError",
    "Log",
    "RecordHandle",
    "Segment",
    "NotAChannelError",
    "RecordTooLargeError",
    "Transaction",
    "TransactionCapacityError",
    "TransactionStateError",
    "UnknownChannelError",
    "UnsafePermissionsError",
    "WriteAheadLog",
    "__version__",
    "connect",
    "open",
    "read_segment",
    "serve",
]


def __getattr__(name: str) -> Any:
    """``filechannel.serve`` and ``filechannel.connect``: the agent, imported (with pyarrow) on first use."""
    if name in ("serve", "connect"):
        from . import agent

        return getattr(agent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open(
    directory: str | os.PathLike[str],
    *,
    fs: FS | None = None,
    background: bool = True,
    **options: Unpack[ChannelOptions],
) -> FileChannel:
    """Open the channel in ``directory``, creating it if needed, and recover it.

    Args:
        directory: The channel directory.
        fs: Internal: the I/O seam (tests pass a simulated file system).
        background: Retire data files on a background thread (default True).
        **options: Any field of :class:`ChannelConfig` (``capacity``,
            ``transaction_capacity``, ``max_file_size``, ``fsync``, ...).

    Returns:
        The open :class:`FileChannel`; close it, or use it as a context manager.

    Raises:
        ConfigError: An option is unknown or invalid.
        ChannelLockedError: The directory is already open.
        CorruptLogError: Acknowledged data is damaged (see ``on_corruption``).
        NotAChannelError: The directory is not a channel directory.
    """
    return open_channel(directory, fs=fs, background=background, **options)  # type: ignore[arg-type]
