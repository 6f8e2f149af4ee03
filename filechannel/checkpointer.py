"""Checkpointer: when and how an open channel writes its checkpoints (and refreshes ANCHOR).

This module owns the channel's checkpointing job: a checkpoint on demand or at
close, the background thread that writes one every ``checkpoint_interval``
seconds (paced over ``checkpoint_spread`` of it) and refreshes an encrypted
channel's ANCHOR every ``anchor_interval``, and the checkpoint counters of
``stats()``. What a checkpoint holds is taken from the channel (its queue, its
open transactions' takes, its per-file take runs and marks) while the log's
writers are held still, only for as long as it takes to read them (O(runs),
no I/O: the data files are synced to the frozen lengths after the writers are
released); how it is encoded and made durable belongs to
``checkpoint.CheckpointStore``.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

from ._queue import Entry
from ._runs import StoredRun
from .checkpoint import CheckpointStore, Snapshot
from .config import MAX_CHECKPOINT_SPREAD, ChannelConfig
from .log import Log

logger = logging.getLogger(__name__)

Capture = Callable[
    [dict[int, int]],
    tuple[
        tuple[list[StoredRun], list[Entry], list[int]],
        dict[int, list[tuple[int, int]]],
        list[tuple[str, bytes, int, int]],
    ],
]
"""Under the channel's lock, with the writers held still: ``(queue, taken, marks)`` for the frozen files.

``queue``: the queue as ``RunQueue.stored`` gives it, ``(runs, entries, holes)``,
the open transactions' takes among the entries; ``taken``: the take runs of
those files; ``marks``: ``(key, value, woid, file)`` sorted by key.
"""


class Checkpointer:
    """Writes an open channel's checkpoints: on demand, at close, and on its own thread.

    Args:
        log: The channel's log.
        store: Where checkpoints go.
        config: The channel's options (``checkpoint_interval``, ``checkpoint_spread``, ``anchor_interval``).
        lock: The channel's lock, held while ``capture`` runs.
        capture: What the checkpoint holds (see :data:`Capture`).
        closed: Whether the channel is closed.
    """

    def __init__(
        self,
        log: Log,
        store: CheckpointStore,
        config: ChannelConfig,
        lock: threading.Lock,
        capture: Capture,
        closed: Callable[[], bool],
    ) -> None:
        self._log = log
        self._store = store
        self._config = config
        self._chan_lock = lock
        self._capture = capture
        self._closed = closed
        self.lock = threading.Lock()  # one checkpoint at a time (and close waits for it)
        self.stop = threading.Event()
        self.hurry = threading.Event()  # set: a waiting checkpoint or close, no pacing
        self._thread: threading.Thread | None = None
        self.stats: dict[str, Any] = {
            "checkpoints_written": 0,
            "checkpoint_failures": 0,
            "last_checkpoint_woid": None,
            "last_checkpoint_seconds": None,
            "last_checkpoint_bytes": None,
            "last_checkpoint_time": None,
        }
        used = log.recovered_from
        if used is not None:
            self.stats["last_checkpoint_woid"] = used.woid

    def start(self) -> None:
        """Start the background thread, if either interval asks for one."""
        if self._config.checkpoint_interval > 0 or self.anchor_interval() > 0:
            self._thread = threading.Thread(target=self._loop, name="filechannel-checkpoint", daemon=True)
            self._thread.start()

    def halt(self) -> None:
        """Stop the background thread (a paced checkpoint being written hurries) and wait for it."""
        self.stop.set()
        self.hurry.set()
        if self._thread is not None:
            self._thread.join()

    def unchanged(self) -> bool:
        """Whether the newest checkpoint already holds every commit."""
        return bool(self.stats["last_checkpoint_woid"] == self._log.last_woid)

    def checkpoint(self, check_open: Callable[[], None]) -> dict[str, Any]:
        """Write a checkpoint now (see ``FileChannel.checkpoint``); ``check_open`` raises if the channel is not."""
        self.hurry.set()  # a background checkpoint being written stops pacing itself
        with self.lock:
            self.hurry.clear()
            check_open()
            return self.write()

    def _pacer(self, t0: float) -> Callable[[float], None] | None:
        """Return what spreads a background checkpoint's writes (``checkpoint_spread``), or None."""
        cfg = self._config
        spread = min(cfg.checkpoint_spread * cfg.checkpoint_interval, MAX_CHECKPOINT_SPREAD)
        if spread <= 0:
            return None
        hurry = self.hurry

        def pace(done: float) -> None:
            # Sleep until the share of the spread this fraction of the write is due at;
            # close() and checkpoint() cut the wait short (and every later one).
            delay = t0 + spread * done - time.monotonic()
            if delay > 0 and not hurry.is_set():
                hurry.wait(delay)

        return pace

    def write(self, paced: bool = False) -> dict[str, Any]:
        """Write a checkpoint (the caller holds :attr:`lock`); returns ``woid``, ``events``, ``bytes``, ``seconds``.

        Raises:
            ChannelClosedError: The log has failed or is closed.
            OSError: Writing the checkpoint failed (the previous ones are untouched).
        """
        t0 = time.monotonic()
        log = self._log
        # Writers and the channel lock are held only while the lengths, counters and
        # the queue's runs are read (O(runs + files), not O(events), and no I/O).
        # What the files hold up to those lengths is made durable after, while
        # commits run, and before anything is written that vouches for it.
        with log.freeze_lengths() as frozen, self._chan_lock:
            files = frozen.files
            woid, next_pos, next_txn, next_file = log.counters()
            (runs, entries, holes), taken, marks = self._capture(files)
            file_dirs = log.file_dirs(files)
            auth = log.frozen_auth_state(files) if log.meta_mac is not None else None
        try:
            log.make_durable(frozen)
        except OSError:
            self.stats["checkpoint_failures"] += 1
            raise
        cols = [array("q", [e[i] for e in entries]) for i in range(4)]
        snap = Snapshot(
            woid,
            next_pos,
            next_txn,
            next_file,
            log.channel_id,
            time.time_ns(),
            files,
            positions=cols[0],
            file_ids=cols[1],
            offsets=cols[2],
            sizes=cols[3],
            taken=taken,
            file_dirs=file_dirs,
            auth=auth,
            marks=marks,
            runs=runs,
            holes=holes,
        )
        try:
            nbytes, _copies = self._store.write(snap, log.crc_kind, self._pacer(t0) if paced else None, log.meta_mac)
            log.write_anchor(snap.auth, woid)
        except OSError:
            self.stats["checkpoint_failures"] += 1
            raise
        took = time.monotonic() - t0
        st = self.stats
        st["checkpoints_written"] += 1
        st["last_checkpoint_woid"] = woid
        st["last_checkpoint_seconds"] = round(took, 6)
        st["last_checkpoint_bytes"] = nbytes
        st["last_checkpoint_time"] = time.time()
        logger.debug("checkpoint at woid %d: %d events, %d bytes, %.3f s", woid, len(snap), nbytes, took)
        return {"woid": woid, "events": len(snap), "bytes": nbytes, "seconds": took}

    def anchor_interval(self) -> float:
        """Seconds between ANCHOR refreshes: ``anchor_interval`` for an encrypted channel, else 0 (never)."""
        log = self._log
        return self._config.anchor_interval if log.meta_mac is not None and not log.readonly else 0.0

    def _loop(self) -> None:
        every = self._config.checkpoint_interval
        anchor = self.anchor_interval()
        tick = min(x for x in (every, anchor) if x > 0)
        due = time.monotonic() + every if every > 0 else float("inf")
        anchored = self._log.last_woid
        while not self.stop.wait(tick):
            log = self._log
            if self._closed() or log.failed is not None:
                return
            if time.monotonic() >= due:
                due = time.monotonic() + every
                if self.unchanged():
                    continue
                try:
                    with self.lock:
                        if not self._closed():
                            self.write(paced=True)
                except Exception:  # the next interval tries again; recovery never needs this one
                    logger.exception("background checkpoint failed")
            elif anchor and log.last_woid != anchored:
                # Not under the checkpoint lock: a paced checkpoint holds it for seconds, and the
                # log keeps ANCHOR's writes in order (an older state is never written over a newer one).
                try:
                    woid = log.last_woid
                    log.refresh_anchor()
                    anchored = woid
                except Exception:  # the next tick tries again; the next checkpoint writes ANCHOR too
                    logger.exception("refreshing ANCHOR failed")
