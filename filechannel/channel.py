"""FileChannel: the durable, transactional FIFO of events in a directory.

This module owns the channel's life and its public face: opening (recovery,
in ``opening``), closing (the last acknowledgements, retirements and
checkpoint, in that order), the channel's own calls (``transaction``,
``marks``, ``stats``, ``sync``, ``checkpoint``, ``retire_files``,
``apply_acks``) and the wiring of the rooms that do the work. It never
performs I/O itself: every byte goes through ``Log``. The state shared with
its transactions and the put and take paths through it are
``channelstate.ChannelState``'s; a transaction's life is ``transaction``'s.
Its background jobs live in rooms of their own: checkpoints
(``checkpointer``), acknowledgement polling (``acks``), the retirement of
data files nothing needs any more (``retention``). ``Event`` lives in
``events`` and ``Transaction`` in ``transaction``; both are re-exported here
(pickles made before naming ``filechannel.channel`` still load).

Lock order: a writer's locks (inside ``Log``) may call back into the channel
lock; code holding the channel lock never calls into ``Log``'s write path.
"""

from __future__ import annotations

import difflib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import fields
from functools import partial
from typing import Any, cast

from . import format as fmt
from ._fs import DEFAULT_FS, FS
from ._queue import Entry
from ._runs import StoredRun
from .acks import AckPoller, keep_acknowledged_positions
from .channelstate import MAX_MARKS, ChannelState
from .checkpoint import CHECKPOINT_DIR, CheckpointStore
from .checkpointer import Checkpointer
from .config import ChannelConfig
from .consumers import ConsumerStore
from .errors import ChannelClosedError, ChannelError, ConfigError, CorruptLogError
from .events import Event
from .events import no_headers as _no_headers  # noqa: F401 - named by pickles of Events made before events.py
from .log import merge_ranges
from .opening import note_open, recover, seal_consumers
from .permissions import fs_for
from .retention import Retirer
from .stats import ChannelStats
from .transaction import Transaction, open_takes, take_acknowledged

__all__ = ["MAX_MARKS", "Event", "FileChannel", "Transaction", "open_channel"]

logger = logging.getLogger(__name__)


class FileChannel:
    """A durable, transactional FIFO of events in a directory.

    Open one with :func:`filechannel.open`. See the README for semantics.

    The state it shares with its transactions is a ``channelstate.ChannelState``;
    its background jobs live in rooms of their own: checkpoints in
    ``checkpointer.Checkpointer``, acknowledgement polling in
    ``acks.AckPoller`` and retirement in ``retention.Retirer``.

    Args:
        directory: The channel directory (created if missing).
        config: The channel's options.
        fs: The I/O seam (tests pass a simulated file system).
        background: Retire data files on a background thread (default); when
            False, retirement runs inline after the take commit that allows it.

    Raises:
        ChannelLockedError: The directory is already open.
        CorruptLogError: Acknowledged data is damaged (see ``on_corruption``).
        NotAChannelError: The directory is not a channel directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: ChannelConfig | None = None,
        *,
        fs: FS | None = None,
        background: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.config = config or ChannelConfig()
        t0 = time.monotonic()
        self._fs = fs_for(fs or DEFAULT_FS, self.config.permissions)
        self._store = CheckpointStore(
            self._fs, os.path.join(self.directory, CHECKPOINT_DIR), self.config.backup_checkpoint_dir
        )
        consumers = ConsumerStore(self._fs, self.directory, self.config.permissions)
        # The committed marks: key -> (value, woid of the COMMIT that set it, file holding its newest copy).
        marks: dict[str, tuple[bytes, int, int]] = {}
        # ``progress`` is told which file recovery reads (the CLI on a terminal).
        rec = recover(self.directory, self.config, self._fs, self._store, marks, progress)
        self.recovery_source = rec.source
        self.checkpoint_fallbacks = rec.fallbacks
        log = self._log = rec.log
        st = self._core = ChannelState(self.directory, self.config, log, rec.queue, rec.files, marks, consumers)
        self._lock, self._queue, self._marks = st.lock, st.queue, st.marks
        self._retirer = Retirer(log, st.lock, rec.files, marks, lambda: st.closed, background)
        st.on_freed = self._retirer.want
        self._checkpointer = Checkpointer(log, self._store, self.config, st.lock, self._capture, lambda: st.closed)
        self._ckpt_lock = self._checkpointer.lock
        self._ckpt_stop = self._checkpointer.stop
        self._acks = AckPoller(consumers, self.config.ack_interval, partial(take_acknowledged, st), st.live)
        seal_consumers(consumers, log)
        self.replay_seconds = time.monotonic() - t0
        note_open(self._store, rec, self.replay_seconds, len(st.queue))
        try:
            keep_acknowledged_positions(consumers, log)
            # Acknowledgements written while no owner ran take effect now.
            self._acks.apply(strict=False)
        except BaseException:
            log.close()
            raise
        if background:
            self._checkpointer.start()
            self._acks.start()
        logger.info(
            "opened %s: %d events queued, replay took %.3f s", self.directory, len(st.queue), self.replay_seconds
        )

    # -- public API -----------------------------------------------------------------------

    def transaction(self) -> Transaction:
        """Begin a transaction.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._core.check_open()
        return Transaction(self._core)

    def marks(self) -> dict[str, bytes]:
        """The committed marks (:meth:`Transaction.mark`): each key's last committed value.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._core.check_open()
        with self._lock:
            return {k: v[0] for k, v in self._marks.items()}

    def mark(self, key: str) -> bytes | None:
        """The last committed value of mark ``key`` (:meth:`Transaction.mark`), or None.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._core.check_open()
        with self._lock:
            m = self._marks.get(key)
        return None if m is None else m[0]

    @property
    def size(self) -> int:
        """Committed events waiting in the queue (not counting those taken by open transactions)."""
        return len(self._queue)

    def __len__(self) -> int:
        """The number of queued events: :attr:`size`, ``stats()["queue_size"]``."""
        return len(self._queue)

    def __bool__(self) -> bool:
        """Always true, like any open or closed channel object: ``len()`` is the queue, not the truth."""
        return True

    @property
    def data_dirs(self) -> list[str]:
        """The channel's data directories, in the order of the ``data_dirs`` option (``DIR/data`` by default)."""
        return list(self._log.data_dirs)

    def stats(self) -> ChannelStats:
        """Return counters: puts, takes, commits, rollbacks, fsyncs, bytes, files, and more.

        Every key is typed in :class:`filechannel.stats.ChannelStats` and described
        in docs/stats.md.

        ``consumers`` maps each registered external consumer to its ``acked``
        position, ``lag_events`` (queued events at or after it), ``identity`` and
        ``oldest_file`` (the data file holding its oldest unacknowledged queued
        event, which it keeps from retiring; None when it has none);
        ``consumers_problem`` says why the registry could not be read, or is None.
        """
        try:
            registry = self._core.consumers.cached_list()
            problem = None
        except CorruptLogError as exc:
            registry, problem = {}, str(exc)
        own = {
            "replay_seconds": round(self.replay_seconds, 6),
            "failed": self._log.failed is not None,
            "recovery_source": self.recovery_source,
            "accelerator": fmt.accelerator(),
            "checkpoint_fallbacks": len(self.checkpoint_fallbacks),
            "key_ids_in_use": self._log.key_ids_in_use(),
        }
        out = self._core.snapshot(registry, own)
        out["consumers_problem"] = problem
        out.update(self._checkpointer.stats)
        out.update(self._log.stats())
        reports = list(self._log.corruption)
        out["lost_positions"] = [list(r) for r in merge_ranges([r for rep in reports for r in rep.lost_positions])]
        out["corruption_report"] = [r.describe() for r in reports]
        return cast("ChannelStats", out)

    def sync(self) -> None:
        """Make every commit so far durable now (useful with ``fsync="interval"``).

        Raises:
            ChannelClosedError: The channel is closed or has failed.
        """
        self._core.check_open()
        self._log.sync()

    def retire_files(self) -> int:
        """Delete data files that no queued or in-flight event needs; return how many.

        Runs on its own after take commits; call it to force the work now.
        Before a file goes, the takes it recorded of events in files that stay
        are written again (durably) into the active file, so neither a replay
        from a checkpoint nor a full replay can bring those events back.
        """
        return self._retirer.retire_files()

    def _relog_marks(self, marks: list[fmt.Mark]) -> None:
        """Commit MARK records repeating ``marks`` with their woids (what a retirement does; see ``Retirer``)."""
        self._retirer.relog_marks(marks)

    def apply_acks(self) -> int:
        """Turn the external consumers' acknowledgements into committed takes now.

        When consumers are registered (``DIR/consumers``, see ``ChannelReader``),
        every queued event below the lowest acknowledged position is taken in a
        take-only commit (not limited by ``transaction_capacity``), durable per
        the ``fsync`` policy, and data files then retire as after any take. The
        channel does this on its own at open, every ``ack_interval`` seconds and
        on close.

        Returns:
            How many events were taken.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
            CorruptLogError: A consumer's ``.ack`` file does not decode (nothing is taken).
            OSError: The commit failed; the events stay queued.
        """
        self._core.check_open()
        return self._acks.apply(strict=True)

    def checkpoint(self) -> dict[str, Any]:
        """Write a checkpoint now, so the next open replays only what follows it.

        Transactions keep running while it is written: while writers are held
        still, the queue's columns are lent to the checkpoint (not copied), and
        they are encoded and written to disk after, in blocks.

        Returns:
            What was written: ``woid``, ``events``, ``bytes``, ``seconds``, ``path``.

        Raises:
            ChannelClosedError: The channel is closed or has failed.
            OSError: Writing the checkpoint failed (the previous ones are untouched).
        """
        return self._checkpointer.checkpoint(self._core.check_open)

    def _write_checkpoint(self, paced: bool = False) -> dict[str, Any]:
        """Write a checkpoint (the caller holds ``_ckpt_lock``); see ``Checkpointer.write``."""
        return self._checkpointer.write(paced)

    def _capture(
        self, files: dict[int, int]
    ) -> tuple[
        tuple[list[StoredRun], list[Entry], list[int]],
        dict[int, list[tuple[int, int]]],
        list[tuple[str, bytes, int, int]],
    ]:
        """What a checkpoint holds (under the lock, writers held): see ``checkpointer.Capture``."""
        return self._core.capture(files, open_takes(self._core))

    def close(self) -> None:
        """Make everything durable and release the directory. Idempotent.

        Open transactions are abandoned: their puts are dropped, their takes
        return to the queue on the next open.
        """
        self._acks.signal_stop()
        self._checkpointer.halt()
        self._acks.join()
        with self._ckpt_lock:
            if self._core.closed:
                return
            if self._log.failed is None:
                try:
                    self._acks.apply(strict=False)
                except (OSError, ChannelError) as exc:
                    logger.warning("applying consumer acknowledgements on close failed (%s); the next open does", exc)
                # An open that only took events wrote its takes into files that hold no event: no take
                # freed a file, so nothing asked for a retirement. They go now (their takes re-logged
                # first, durably), before the checkpoint, which then no longer lists them.
                try:
                    self._retirer.retire_files()
                except (OSError, ChannelError) as exc:
                    logger.warning("retiring data files on close failed (%s); the next close tries again", exc)
            unchanged = self._checkpointer.unchanged() and not self._core.open_txns
            if self._log.failed is None and not unchanged:
                try:
                    self._checkpointer.write()
                except (OSError, ChannelClosedError) as exc:
                    logger.warning("checkpoint on close failed (%s); the next open replays more of the log", exc)
            self._core.shut()
        self._retirer.stop()
        self._log.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._core.closed

    def __enter__(self) -> FileChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FileChannel {self.directory!r} size={len(self._queue)}>"


def open_channel(
    directory: str | os.PathLike[str], *, fs: FS | None = None, background: bool = True, **options: Any
) -> FileChannel:
    """Open (creating if needed) the channel in ``directory``; see :func:`filechannel.open`."""
    return FileChannel(directory, channel_config(options), fs=fs, background=background)


def channel_config(options: Mapping[str, Any]) -> ChannelConfig:
    """The :class:`ChannelConfig` of :func:`filechannel.open`'s ``options``, checked; opens nothing.

    Raises:
        ConfigError: An unknown option (naming a close match) or an invalid value.
    """
    try:
        return ChannelConfig.from_options(dict(options))
    except ConfigError as exc:
        if exc.option in options and exc.reason.startswith("unknown option"):
            close = difflib.get_close_matches(exc.option, [f.name for f in fields(ChannelConfig)], n=1)
            if close:
                raise ConfigError(exc.option, f"unknown option; did you mean {close[0]}=?") from None
        raise
