"""AckPoller: the external consumers' acknowledgements turned into the owner's takes.

This module owns acknowledgement polling for an open channel: reading the
consumer registry (``consumers.ConsumerStore``), taking every queued event
below the lowest acknowledged position (at open, every ``ack_interval``
seconds on its own thread, at close and on demand), reporting an unreadable
registry once, and never handing out again a position a consumer already
acknowledged (:func:`keep_acknowledged_positions`). The take itself is the
channel's (a take-only commit), passed in as ``take_below``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .consumers import ConsumerStore
from .errors import CorruptLogError
from .log import Log

logger = logging.getLogger(__name__)


class AckPoller:
    """Applies the consumers' acknowledgements to an open channel.

    Args:
        consumers: The channel's consumer registry.
        interval: Seconds between polls on the background thread (0: none).
        take_below: Takes every queued event below a position in take-only
            commits; returns how many (raises ``OSError`` if a commit fails).
        live: Whether the channel is open and has not failed.
    """

    def __init__(
        self,
        consumers: ConsumerStore,
        interval: float,
        take_below: Callable[[int], int],
        live: Callable[[], bool],
    ) -> None:
        self._consumers = consumers
        self._interval = interval
        self._take_below = take_below
        self._live = live
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._problem: str | None = None

    def apply(self, strict: bool) -> int:
        """Take every queued event below the lowest acknowledgement; see ``FileChannel.apply_acks``.

        ``strict=False`` (open, close, the background thread) logs an unreadable
        registry once as an ERROR and takes nothing, instead of raising.

        Raises:
            CorruptLogError: ``strict`` and a consumer's ``.ack`` file does not decode.
            OSError: The commit failed.
        """
        with self._lock:
            try:
                registry = self._consumers.cached_list()
            except CorruptLogError as exc:
                if strict:
                    raise
                if str(exc) != self._problem:
                    logger.error("consumer acknowledgements not applied: %s", exc)
                self._problem = str(exc)
                return 0
            self._problem = None
            if not registry:
                return 0
            low = min(c.acked for c in registry.values())
            total = self._take_below(low)
            if total:
                logger.debug("applied consumer acknowledgements below position %d: %d events taken", low, total)
            return total

    def start(self) -> None:
        """Start polling every ``interval`` seconds on a thread of its own (if the interval is positive)."""
        if self._interval > 0:
            self._thread = threading.Thread(target=self._loop, name="filechannel-acks", daemon=True)
            self._thread.start()

    def signal_stop(self) -> None:
        """Tell the polling thread to end (it ends at its next wake-up)."""
        self._stop.set()

    def join(self) -> None:
        """Wait for the polling thread to end (after :meth:`signal_stop`)."""
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._live():
                return
            try:
                self.apply(strict=False)
            except Exception:  # the next interval tries again; the acknowledgements stay on disk
                logger.exception("applying consumer acknowledgements failed")


def keep_acknowledged_positions(consumers: ConsumerStore, log: Log) -> None:
    """Never hand out again a position an external consumer acknowledged.

    A reader can see a batch once its bytes verify in the file, before the
    owner's fsync; if a power cut then loses the batch, recovery would assign
    its positions again, and the consumer's durable mark (above them) would
    make the owner take new events nobody read. So the next position starts
    at or above every recorded acknowledgement: the lost positions become a
    gap, like those of a failed commit.
    """
    try:
        registry = consumers.cached_list()
    except CorruptLogError:
        return  # reported by AckPoller.apply; such a consumer pins everything anyway
    if not registry:
        return
    top = max(registry.values(), key=lambda c: c.acked)
    with log.seq_lock:
        lost = log.next_position
        if top.acked <= lost:
            return
        log.next_position = top.acked
    logger.warning(
        "consumer %s acknowledged positions up to %d, but the channel recovered positions below %d only "
        "(a crash lost events the consumer had read before they were durable); positions [%d, %d) are "
        "skipped so that no acknowledged position is assigned to a new event",
        top.name,
        top.acked,
        lost,
        lost,
        top.acked,
    )
