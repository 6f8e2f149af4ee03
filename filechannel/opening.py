"""Opening a channel: recovery into a queue, the consumers' seals, and the record of how the open went.

This module owns the steps a ``FileChannel`` takes before it serves anything:
opening the log from the newest usable checkpoint and rebuilding the queue by
replay (:func:`recover`), resealing the external consumers' acknowledgements
under the log's metadata key (:func:`seal_consumers`) and writing what the
open found beside the checkpoints (:func:`note_open`). It writes nothing of
the log itself; the channel's state is built by the caller from what
:func:`recover` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._fs import FS
from ._runs import RunQueue
from .checkpoint import CheckpointStore
from .config import ChannelConfig
from .consumers import ConsumerStore
from .errors import CorruptLogError
from .log import Log
from .replay import replay_queue, spot_check
from .retention import FileRefs

__all__ = ["Recovered", "note_open", "recover", "seal_consumers"]

logger = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What :func:`recover` rebuilt: the open log, the queue, what each data file holds, and how.

    ``source`` is ``"checkpoint"``, ``"backup"`` (after a fallback) or ``"full"``
    (a replay of every data file); ``fallbacks`` names each checkpoint passed
    over, and why.
    """

    log: Log
    queue: RunQueue
    files: FileRefs
    source: str
    fallbacks: list[str]


def recover(
    directory: str,
    config: ChannelConfig,
    fs: FS,
    store: CheckpointStore,
    marks: dict[str, tuple[bytes, int, int]],
    progress: Callable[[str], None] | None = None,
) -> Recovered:
    """Open the log from the newest usable checkpoint and rebuild the queue (and ``marks``, filled in place).

    A checkpoint that decodes is trusted: data that disagrees with it is
    damaged data, handled by ``on_corruption`` like any other damage, never
    a reason to fall back to an older view that knows less.
    """
    log = Log(directory, config, fs=fs, checkpoints=store, progress=progress)
    base = log.base_snapshot
    unreplayed = set(base.files) if base is not None else set()
    try:
        q, take_targets, taken_from = replay_queue(log, base, marks)
        if log.recovered_from is not None and config.on_corruption != "skip":
            spot_check(log, q)
    except BaseException:
        log.close()
        raise
    fallbacks = list(log.checkpoint_fallbacks)
    if log.recovered_from is None:
        source = "full"
    elif fallbacks:
        source = "backup"
    else:
        source = "checkpoint"
    return Recovered(log, q, FileRefs(q.file_counts(), take_targets, taken_from, unreplayed), source, fallbacks)


def seal_consumers(consumers: ConsumerStore, log: Log) -> None:
    """Hold the consumers' acknowledgements to the log's metadata MAC, resealing those written before it."""
    if log.meta_mac is None:
        return
    consumers.mac = log.meta_mac
    consumers.seen, consumers.owner = log.consumer_acks, True  # older acks refused
    consumers.required = log.macs_required and not log.sealing_started
    try:
        consumers.seal_all()
    except CorruptLogError as exc:  # refused acks pin the queue (see AckPoller.apply); the open goes on
        logger.error("consumer acknowledgements not resealed: %s", exc)
    consumers.required = log.macs_required


def note_open(store: CheckpointStore, rec: Recovered, replay_seconds: float, queued: int) -> None:
    """Record how this open went beside the checkpoints (``CheckpointStore.last_open`` reads it back)."""
    used = rec.log.recovered_from
    store.note_open(
        {
            "time": time.time(),
            "source": rec.source,
            "checkpoint": used.path if used else None,
            "checkpoint_woid": used.woid if used else None,
            "fallbacks": rec.fallbacks,
            "replay_seconds": round(replay_seconds, 6),
            "queued": queued,
        }
    )
