"""One channel an agent serves: its read-only view, its consumers' readers, the owned channel and its puts.

This module owns :class:`ServedChannel`, what the agent keeps per channel
directory it serves: the lock-free view every read goes through, one reader
per (consumer, identity), the channel itself when the agent is writable (a
Flight put commits there with the producer's sequence number in the same
transaction, through ``idempotency.commit_once``), the Spark sink's staging
area (``staging.py``), and what ``status`` answers of it. The transports
(``server.py``'s Flight service, ``web.py``'s HTTP) call it; it knows neither.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from filechannel._fs import DEFAULT_FS
from filechannel.channel import FileChannel
from filechannel.consumers import ConsumerStore
from filechannel.crypto import Encryption
from filechannel.errors import ConsumerIdentityError
from filechannel.reader import ChannelReader

from . import protocol as proto
from .errors import AgentError
from .idempotency import Claim, KeyLocks, commit_once, put_events
from .staging import AgentSink

__all__ = ["ServedChannel"]


class ServedChannel:
    """One served channel: its view, its consumers' readers, and the lock that keeps handlers apart."""

    def __init__(self, directory: str, cid: str, crc_kind: int, encryption: Encryption | None, on_corruption: str):
        self.directory = directory
        self.cid = cid
        self.name = os.path.basename(os.path.normpath(directory))
        self.crc_kind = crc_kind
        self.encryption = encryption
        self.on_corruption = on_corruption
        self.lock = threading.Lock()
        self.view = ChannelReader(directory, encryption=encryption, on_corruption=on_corruption)
        self.readers: dict[tuple[str, str | None], ChannelReader] = {}
        self.channel: FileChannel | None = None  # the owned channel, when the agent is writable
        self.sink: AgentSink | None = None  # the Spark sink's staging area (staging.py), made at first use
        self._producer_locks = KeyLocks()

    def put(
        self,
        producer: str,
        sequence: int,
        bodies: list[bytes],
        headers: list[dict[str, str] | None],
        owner: str | None = None,
    ) -> Any:
        """Commit ``bodies`` and the producer's ``sequence`` as one transaction, unless already committed.

        One put per producer at a time (striped locks), so a retry racing its
        original never commits twice; producers commit in parallel (and share
        fsyncs). The mark commits with the events (``idempotency.commit_once``,
        the agent's one exactly-once protocol). A producer id belongs to the certificate name (``owner``) that
        first put under it: the mark records it, in the same transaction as the
        events, so it survives restarts; another name's put under that id is
        refused, so one writer can never mark another's sequence numbers as
        committed. Without a certificate name (no mutual TLS) nothing is bound.
        Returns the answer of the wire format (``protocol.py``).

        Raises:
            KeyOwnerError: ``producer`` belongs to another certificate name (``FlightUnauthorizedError``).
        """
        channel = self.channel
        assert channel is not None
        key = proto.producer_mark(producer)
        with self._producer_locks.of(producer):
            raw = channel.mark(key)
            committed, bound = proto.decode_producer_mark(raw)
            dup = commit_once(
                channel,
                what=f"producer id {producer!r}",
                owner=owner,
                claim=None if raw is None else Claim(str(committed), bound),
                done=lambda _: sequence <= committed,
                put=lambda tx: put_events(tx, bodies, headers),
                mark=lambda: (key, str(sequence)),
            )
            if dup is not None:
                return {"v": 1, "duplicate": True, "sequence": sequence, "committed": committed, "events": 0}
            return {"v": 1, "duplicate": False, "sequence": sequence, "committed": sequence, "events": len(bodies)}

    def sink_store(self) -> AgentSink:
        """The Spark sink's staging area and commits of this channel (a writable agent's only)."""
        if self.channel is None:
            raise AgentError(
                "", f"channel {self.cid} is served read-only: start the agent with --writable for the Spark sink"
            )
        with self.lock:
            if self.sink is None:
                self.sink = AgentSink(self.channel, self.directory)
            return self.sink

    def reader(self, consumer: str, identity: str | None, reset: bool = False) -> ChannelReader:
        """The reader of ``consumer`` under ``identity`` (registered, or its identity checked, now)."""
        key = (consumer, identity)
        r = self.readers.get(key)
        if r is not None and not reset:
            # Another process (or agent) may have taken the name over since this reader registered.
            cur = ConsumerStore(DEFAULT_FS, self.directory).get(consumer)
            if cur is not None and cur.identity != identity:
                self.readers.pop(key, None)
                raise ConsumerIdentityError(consumer, cur.identity, identity)
            return r
        r = ChannelReader(
            self.directory,
            consumer,
            identity=identity,
            reset=reset,
            encryption=self.encryption,
            on_corruption=self.on_corruption,
        )
        r.acked  # noqa: B018  (registers the consumer, or checks its identity, now)
        if reset:
            for k in [k for k in self.readers if k[0] == consumer]:
                self.readers.pop(k).close()
        self.readers[key] = r
        return r

    def describe(self) -> dict[str, Any]:
        """This channel's id, name, range and consumers (what discovery and ``status`` answer)."""
        start, end = self.view.available()
        consumers = {
            c.name: {"identity": c.identity, "acked": c.acked, "lag": max(0, end - c.acked)}
            for c in ConsumerStore(DEFAULT_FS, self.directory).list().values()
        }
        return {"channel": self.cid, "name": self.name, "start": start, "end": end, "consumers": consumers}

    def status(self) -> dict[str, Any]:
        """What ``status`` answers of this channel (``filechannel top`` shows it).

        :meth:`describe`, plus the queued bytes (``bytes``, each consumer's
        ``lag_bytes``), the file system's free bytes (``disk_free``) and, for an
        owned channel, its fsync histogram (``fsync_seconds_buckets``).
        """
        out = self.describe()
        start, end = out["start"], out["end"]
        rows = sorted(out["consumers"].items())
        sizes = self.view.record_bytes([start, *(max(start, c["acked"]) for _, c in rows)], end)
        out["bytes"] = sizes[0]
        for (_, c), b in zip(rows, sizes[1:], strict=True):
            c["lag_bytes"] = b
        try:
            out["disk_free"] = DEFAULT_FS.free_space(self.directory)
        except OSError:
            out["disk_free"] = None
        if self.channel is not None and not self.channel.closed:
            out["fsync_seconds_buckets"] = self.channel.stats()["fsync_seconds_buckets"]
        return out
