"""LogView: a channel's log opened read-only, recovered and (by default) replayed into its queue.

This module owns the one way to look at a channel without owning it: no lock,
nothing written, no commit accepted. :func:`open_view` runs the recovery an
open performs (which checkpoint vouches, which files belong, the scans of
their records and what their damage means, all by ``recovery.py`` and
``scan.py``) on a read-only ``Log``, then rebuilds the queue of committed,
untaken events with ``replay.replay_queue``. The CLI's read-only commands,
``verify``, ``ChannelReader`` and the WAL's read-only tools use it instead of
building a ``Log`` and replaying by hand.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import TracebackType

from ._fs import DEFAULT_FS, FS
from ._queue import Entry
from ._runs import RunQueue
from .checkpoint import CHECKPOINT_DIR, CheckpointStore
from .config import ChannelConfig
from .log import Log
from .replay import replay_queue


class LogView:
    """A read-only log and, once replayed, its queue; close it (or use it as a context manager).

    Attributes:
        log: The read-only ``Log`` (its records, files, findings and counters).
        queue: The committed, untaken events (None until :meth:`replay`).
    """

    def __init__(self, log: Log) -> None:
        self.log = log
        self.queue: RunQueue | None = None

    def replay(self) -> RunQueue:
        """Rebuild the queue from the checkpoint recovery used and the records after it (once); return it.

        Raises:
            CorruptLogError: Acknowledged data is damaged (with ``on_corruption="fail"``).
        """
        if self.queue is None:
            self.queue, _, _ = replay_queue(self.log, self.log.base_snapshot)
        return self.queue

    def entries(self) -> list[Entry]:
        """The queue as ``(position, file_id, offset, size)`` entries, oldest first (replayed if not yet)."""
        return list(self.replay())

    def close(self) -> None:
        """Release the log's file descriptors. Idempotent."""
        self.log.close()

    def __enter__(self) -> LogView:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_view(
    directory: str | os.PathLike[str],
    config: ChannelConfig | None = None,
    *,
    fs: FS | None = None,
    checkpoints: bool | CheckpointStore = True,
    replay: bool = True,
    progress: Callable[[str], None] | None = None,
    keyless_ok: bool = False,
    wal: bool = False,
) -> LogView:
    """Open the channel (or WAL) in ``directory`` read-only: recovery, then (``replay``) its queue.

    Args:
        directory: The channel directory.
        config: The options recovery follows (``on_corruption``, ``replay``, ``encryption``, ...).
        fs: The I/O seam.
        checkpoints: Recover from the newest usable checkpoint in ``DIR/checkpoints``
            (and ``config.backup_checkpoint_dir``) when True, from this store, or
            from the records alone when False.
        replay: Rebuild the queue now (else call :meth:`LogView.replay` when wanted).
        progress: Told which file recovery reads.
        keyless_ok: An encrypted channel opens without its key (its events stay sealed).
        wal: The directory holds a ``WriteAheadLog``.

    Raises:
        NotAChannelError: ``directory`` is not a channel directory.
        CorruptLogError: Something that decides what is read is unreadable, or
            acknowledged data is damaged (with ``on_corruption="fail"``).
    """
    config = config or ChannelConfig()
    if checkpoints is True:
        store: CheckpointStore | None = CheckpointStore(
            fs or DEFAULT_FS, os.path.join(os.fspath(directory), CHECKPOINT_DIR), config.backup_checkpoint_dir
        )
    else:
        store = checkpoints if isinstance(checkpoints, CheckpointStore) else None
    log = Log(
        directory, config, fs=fs, readonly=True, checkpoints=store, progress=progress, keyless_ok=keyless_ok, wal=wal
    )
    view = LogView(log)
    if replay:
        try:
            view.replay()
        except BaseException:
            log.close()
            raise
    return view
