"""Exactly-once retries for the agent's push sources: a ring of committed request keys per channel.

This module owns :class:`KeyRing`, shared by the HTTP source (``Idempotency-Key``,
mark prefix ``http:``) and the forward source (a chunk's ``chunk`` option, mark
prefix ``forward:``). A key commits in the same transaction as its events, as a
mark in a ring of ``size`` slots (``<prefix><slot>`` = ``"<seq> <fingerprint>
<key>"``; marks cannot be deleted, so the ring bounds them). A retry whose key
is among the ring's keys is a duplicate: nothing is put. The ring is rebuilt
from the channel's marks when the agent starts, so keys are remembered across
restarts and SIGKILLs (the mark and the events are one record).
"""

from __future__ import annotations

import logging
import threading
import time

from filechannel.channel import FileChannel
from filechannel.errors import ChannelError

__all__ = ["KeyConflictError", "KeyRing", "commit_events"]

logger = logging.getLogger("filechannel.agent.idempotency")


class KeyConflictError(ChannelError):
    """A key that was committed with another body."""


def commit_events(
    channel: FileChannel,
    bodies: list[bytes],
    headers: list[dict[str, str] | None],
    mark: str | None = None,
    value: bytes = b"",
) -> float:
    """Put the events (and ``mark`` = ``value``) as one transaction; return the seconds it took."""
    t0 = time.monotonic()
    with channel.transaction() as tx:
        for b, h in zip(bodies, headers, strict=True):
            tx.put(b, headers=h)
        if mark is not None:
            tx.mark(mark, value)
    return time.monotonic() - t0


class KeyRing:
    """The idempotency keys of one channel and one source: a ring of mark slots, rebuilt from the channel's marks.

    Slot ``seq % size`` holds ``"<seq> <fingerprint> <key>"`` of the key committed
    with sequence ``seq``; a new key overwrites the slot of the key ``size``
    commits older, which is forgotten then. One request per key runs at a time
    (striped locks), so a retry racing its original never commits twice. Keys
    hold no spaces (the callers check them).
    """

    def __init__(self, channel: FileChannel, size: int, prefix: str) -> None:
        self.size = size
        self.prefix = prefix
        self.lock = threading.Lock()
        self.by_key: dict[str, tuple[int, str]] = {}  # key -> (seq, fingerprint)
        self.by_slot: dict[int, tuple[int, str]] = {}  # slot -> (seq, key)
        self.next_seq = 0
        self.stripes = [threading.Lock() for _ in range(256)]
        for mark, value in channel.marks().items():
            if not mark.startswith(prefix):
                continue
            try:
                seq_s, fp, key = value.decode("ascii").split(" ", 2)
                slot, seq = int(mark[len(prefix) :]), int(seq_s)
            except (UnicodeDecodeError, ValueError):
                logger.warning("ignoring mark %r: not an idempotency slot", mark)
                continue
            self._remember(slot, seq, key, fp)
            self.next_seq = max(self.next_seq, seq + 1)

    def _remember(self, slot: int, seq: int, key: str, fp: str) -> None:
        old = self.by_slot.get(slot)
        if old is not None:
            if old[0] > seq:
                return
            if self.by_key.get(old[1], (None,))[0] == old[0]:
                del self.by_key[old[1]]
        self.by_slot[slot] = (seq, key)
        self.by_key[key] = (seq, fp)

    def put(
        self,
        channel: FileChannel,
        key: str | None,
        fingerprint: str,
        bodies: list[bytes],
        headers: list[dict[str, str] | None],
    ) -> tuple[bool, float]:
        """Commit the events (and the key) as one transaction; return (duplicate, seconds to commit).

        Raises:
            KeyConflictError: ``key`` was committed with another body.
            ChannelError: From the channel (full, too large, failed, ...); nothing was put.
        """
        if key is None:
            return False, commit_events(channel, bodies, headers)
        with self.stripes[hash(key) % len(self.stripes)]:
            with self.lock:
                hit = self.by_key.get(key)
                if hit is None:
                    seq = self.next_seq
                    self.next_seq += 1
            if hit is not None:
                if hit[1] != fingerprint:
                    raise KeyConflictError(f"the key {key!r} was committed with another body; use a new key")
                return True, 0.0
            slot = seq % self.size
            took = commit_events(
                channel,
                bodies,
                headers,
                f"{self.prefix}{slot}",
                b"%d %s %s" % (seq, fingerprint.encode(), key.encode()),
            )
            with self.lock:
                self._remember(slot, seq, key, fingerprint)
            return False, took
