"""Commit once per key: the agent's one exactly-once protocol, and the ring of keys of its push sources.

This module owns :func:`commit_once`, the one way the agent skips a duplicate
request: the request's key commits in the **same transaction** as its events,
as a channel mark, so after any crash both or neither are there, and a retry
whose key the channel already holds puts nothing. The keys: a Flight
producer id (``producer:<id>`` = ``"<sequence>"``), a Spark sink query id
(``spark-sink:<query>`` = ``"<batch id>"``), an HTTP ``Idempotency-Key`` or a
forward chunk id (a slot of a :class:`KeyRing`). A mark's value is the key's
state, then the certificate name that owns the key (:func:`encode_claim`):
the first name that commits under a key binds it, in that same transaction,
and another name's request under it is refused (:class:`KeyOwnerError`), so a
writer who knows another's key can never mark that writer's requests as
committed (they would be skipped). Without a certificate name (no mutual TLS)
nothing is bound.

:class:`KeyRing` holds the keys of a push source (the HTTP source: prefix
``http:``; the forward source: ``forward:``) in a ring of ``size`` slots
(``<prefix><slot>`` = ``"<seq> <fingerprint> <key>[ <owner>]"``; marks cannot
be deleted, so the ring bounds them), rebuilt from the channel's marks when
the agent starts, so keys are remembered across restarts and SIGKILLs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from filechannel.channel import FileChannel
from filechannel.errors import ChannelError

__all__ = [
    "Claim",
    "KeyConflictError",
    "KeyLocks",
    "KeyOwnerError",
    "KeyRing",
    "commit_events",
    "commit_once",
    "decode_claim",
    "encode_claim",
    "put_events",
]

logger = logging.getLogger("filechannel.agent.idempotency")


class KeyConflictError(ChannelError):
    """A key that was committed with another body."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"the key {key!r} was committed with another body; use a new key")


class KeyOwnerError(ChannelError):
    """A key that another client certificate committed under: refused, nothing put."""

    def __init__(self, what: str, owner: str | None) -> None:
        self.what = what
        self.owner = owner
        super().__init__(f"{what} belongs to another client certificate: give each writer keys of its own")


class Claim(NamedTuple):
    """What a key's mark records: the key's state (space-separated fields) and the certificate name owning it."""

    state: str
    owner: str | None


def encode_claim(state: str, owner: str | None) -> bytes:
    """A key's mark value: ``"<state>"``, or ``"<state> <owner>"`` once a certificate name owns the key."""
    s = state.encode("utf-8", "surrogatepass")
    return s if owner is None else s + b" " + owner.encode("utf-8", "surrogatepass")


def decode_claim(raw: bytes, fields: int) -> Claim:
    """The :class:`Claim` of a mark value whose state has ``fields`` space-separated fields.

    Raises:
        ValueError: Fewer fields, or bytes that are not UTF-8.
    """
    parts = bytes(raw).decode("utf-8", "surrogatepass").split(" ", fields)
    if len(parts) < fields or not all(parts[:fields]):
        raise ValueError(f"not a key's mark: {bytes(raw)[:40]!r}")
    return Claim(" ".join(parts[:fields]), parts[fields] if len(parts) > fields else None)


class KeyLocks:
    """Striped locks, one stripe per key's hash: one request per key runs at a time, others in parallel."""

    def __init__(self, stripes: int = 256) -> None:
        self._stripes = [threading.Lock() for _ in range(stripes)]

    def of(self, key: str) -> threading.Lock:
        """The lock of ``key`` (hold it around the key's look-up and :func:`commit_once`)."""
        return self._stripes[hash(key) % len(self._stripes)]


def commit_once(
    channel: FileChannel,
    *,
    what: str,
    owner: str | None,
    claim: Claim | None,
    done: Callable[[Claim], bool],
    put: Callable[[Any], None],
    mark: Callable[[], tuple[str, str]],
    sync: bool = False,
) -> Claim | None:
    """Commit a request's events and its key's mark as one transaction, unless the key says it was committed.

    Call it holding the key's lock (:class:`KeyLocks`, or one of the caller's), so a
    retry racing its original never commits twice.

    Args:
        channel: The owned channel.
        what: The key, for the refusal (``"producer id 'p1'"``).
        owner: The certificate name of the request (None: no mutual TLS; nothing is bound).
        claim: What the channel records of the key (None: nothing yet).
        done: Whether nothing is to commit: ``claim`` already covers this request, or (the Spark
            sink) the request turns out to have no events. May raise (e.g. :class:`KeyConflictError`).
        put: Puts the request's events into the transaction.
        mark: ``(mark key, state)`` to record; called only when the request commits.
        sync: Make the commit durable before returning, whatever the channel's fsync mode.

    Returns:
        None when the request committed now; the recorded :class:`Claim` when it was a duplicate.

    Raises:
        KeyOwnerError: Another certificate name owns the key.
        ChannelError, OSError: From the channel; nothing was put (or, for an ``OSError``, all or
            nothing with its mark: a retry finds out which).
    """
    bound = claim.owner if claim is not None else None
    if owner is not None and bound is not None and bound != owner:
        logger.warning("refused certificate name %r a request under %s (it belongs to another)", owner, what)
        raise KeyOwnerError(what, owner)
    if claim is not None and done(claim):
        return claim
    key, state = mark()
    with channel.transaction() as tx:
        put(tx)
        tx.mark(key, encode_claim(state, bound if bound is not None else owner))
    if sync:
        channel.sync()
    return None


def commit_events(
    channel: FileChannel,
    bodies: list[bytes],
    headers: list[dict[str, str] | None],
) -> float:
    """Put the events as one transaction (no key); return the seconds it took."""
    t0 = time.monotonic()
    with channel.transaction() as tx:
        put_events(tx, bodies, headers)
    return time.monotonic() - t0


def put_events(tx: Any, bodies: list[bytes], headers: list[dict[str, str] | None]) -> None:
    """Put each body with its headers into transaction ``tx``, in order."""
    for b, h in zip(bodies, headers, strict=True):
        tx.put(b, headers=h)


class KeyRing:
    """The idempotency keys of one channel and one source: a ring of mark slots, rebuilt from the channel's marks.

    Slot ``seq % size`` holds ``"<seq> <fingerprint> <key>[ <owner>]"`` of the key
    committed with sequence ``seq``; a new key overwrites the slot of the key
    ``size`` commits older, which is forgotten then. One request per key runs at a
    time (striped locks). Keys hold no spaces (the callers check them).
    """

    def __init__(self, channel: FileChannel, size: int, prefix: str) -> None:
        self.size = size
        self.prefix = prefix
        self.lock = threading.Lock()
        self.by_key: dict[str, tuple[int, Claim]] = {}  # key -> (seq, its claim: state "<fp>", owner)
        self.by_slot: dict[int, tuple[int, str]] = {}  # slot -> (seq, key)
        self.next_seq = 0
        self.locks = KeyLocks()
        for mark, value in channel.marks().items():
            if not mark.startswith(prefix):
                continue
            try:
                claim = decode_claim(value, 3)
                seq_s, fp, key = claim.state.split(" ")
                slot, seq = int(mark[len(prefix) :]), int(seq_s)
            except ValueError:
                logger.warning("ignoring mark %r: not an idempotency slot", mark)
                continue
            self._remember(slot, seq, key, Claim(fp, claim.owner))
            self.next_seq = max(self.next_seq, seq + 1)

    def _remember(self, slot: int, seq: int, key: str, claim: Claim) -> None:
        old = self.by_slot.get(slot)
        if old is not None:
            if old[0] > seq:
                return
            if self.by_key.get(old[1], (None,))[0] == old[0]:
                del self.by_key[old[1]]
        self.by_slot[slot] = (seq, key)
        self.by_key[key] = (seq, claim)

    def put(
        self,
        channel: FileChannel,
        key: str | None,
        fingerprint: str,
        bodies: list[bytes],
        headers: list[dict[str, str] | None],
        owner: str | None = None,
    ) -> tuple[bool, float]:
        """Commit the events (and the key) as one transaction; return (duplicate, seconds to commit).

        Raises:
            KeyConflictError: ``key`` was committed with another body.
            KeyOwnerError: ``key`` was committed by another certificate name (``owner``).
            ChannelError: From the channel (full, too large, failed, ...); nothing was put.
        """
        if key is None:
            return False, commit_events(channel, bodies, headers)
        with self.locks.of(key):
            with self.lock:
                hit = self.by_key.get(key)
            seq = -1

            def done(claim: Claim) -> bool:
                if claim.state != fingerprint:
                    raise KeyConflictError(key)
                return True

            def mark() -> tuple[str, str]:
                nonlocal seq
                with self.lock:
                    seq = self.next_seq
                    self.next_seq += 1
                return f"{self.prefix}{seq % self.size}", f"{seq} {fingerprint} {key}"

            t0 = time.monotonic()
            dup = commit_once(
                channel,
                what=f"the key {key!r}",
                owner=owner,
                claim=hit[1] if hit is not None else None,
                done=done,
                put=lambda tx: put_events(tx, bodies, headers),
                mark=mark,
            )
            if dup is not None:
                return True, 0.0
            took = time.monotonic() - t0
            with self.lock:
                self._remember(seq % self.size, seq, key, Claim(fingerprint, owner))
            return False, took
