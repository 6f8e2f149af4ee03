"""The agent client: discovery, consumers, acknowledgements and verified reads over Arrow Flight.

This module owns the client side of the wire format in ``protocol.py``.
:class:`AgentSettings` is picklable and holds only the URI, file paths and
the deadline (never a secret's contents), so a Spark driver can ship it to
executors, which call :meth:`AgentSettings.connect` there. Every call carries
a deadline (``FlightCallOptions(timeout=...)``); an agent that is stopped or
cannot be reached raises :class:`AgentUnavailableError` at once, one that
stalls :class:`AgentTimeoutError` when the deadline passes.

Reads come back as raw segments (:class:`RawSegment`): the bytes of the data
file as the agent holds them. They are decoded here with
:func:`filechannel.reader.decode_segment`, the same code as a local
``read_segment``, so every record's checksum, and an encrypted record's
authentication tag, is checked at the client, end to end; the checksum seed
is built from the channel id the client asked for, so bytes of another
channel never pass.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from filechannel.arrow import Run, read_received
from filechannel.crypto import Encryption, as_encryption, segment_cipher
from filechannel.errors import ChannelError, ConfigError
from filechannel.events import Event
from filechannel.reader import Segment, decode_segment
from filechannel.scan import segment_name

from . import protocol as proto
from .auth import TOKEN_HEADER, parse_uri, read_public_file, read_secret_file, read_token
from .errors import AgentAuthError, AgentError, AgentProtocolError, AgentTimeoutError, AgentUnavailableError

__all__ = ["AgentClient", "AgentSettings", "ChannelInfo", "ClientCache", "PutResult", "RawSegment", "connect"]

logger = logging.getLogger("filechannel.agent")

DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class AgentSettings:
    """How to reach one agent: picklable, file paths only (the files are read by :meth:`connect`).

    Attributes:
        uri: ``grpc+tls://HOST:PORT``, ``grpc://127.0.0.1:PORT`` or ``grpc+unix:///PATH``.
        tls_ca: PEM file of the CA that signed the agent's certificate (default: the system's roots).
        tls_cert, tls_key: This client's certificate and key (PEM), for an agent with ``--client-ca``.
        token_file: A file holding the agent's bearer token (mode 0600).
        timeout: The deadline of every call, in seconds.
        override_hostname: The name to check the agent's certificate against, if not the URI's host.
    """

    uri: str
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    override_hostname: str | None = None

    def __post_init__(self) -> None:
        listen = parse_uri(self.uri, "uri")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout > 0:
            raise ConfigError("timeout", f"must be a number of seconds > 0, got {self.timeout!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert", "give tls_cert and tls_key together (a client certificate and its key)")
        if not listen.tls:
            for option in ("tls_ca", "tls_cert", "tls_key"):
                if getattr(self, option):
                    raise ConfigError(option, f"applies to grpc+tls:// only, and the URI is {self.uri}")

    def connect(self) -> AgentClient:
        """Return a client (the connection is made by the first call).

        Raises:
            ConfigError: A TLS or token file that is missing or unsafe.
        """
        return AgentClient(self)


def connect(
    uri: str,
    *,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token_file: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    override_hostname: str | None = None,
) -> AgentClient:
    """Return a client of the agent at ``uri`` (see :class:`AgentSettings` for the arguments).

    Raises:
        ConfigError: A bad URI or timeout, or a TLS or token file that is missing or unsafe.
    """
    return AgentSettings(uri, tls_ca, tls_cert, tls_key, token_file, float(timeout), override_hostname).connect()


@dataclass(frozen=True)
class ChannelInfo:
    """A served channel: its id (hex), its directory's name, and ``[start, end)``, what it holds now."""

    channel: str
    name: str
    start: int
    end: int


@dataclass(frozen=True)
class PutResult:
    """What an agent answered to :meth:`AgentClient.put_batch` (after the durable commit).

    ``duplicate``: the sequence number was at or below the producer's committed
    one, so nothing was put (a retry of a put that had committed);
    ``committed``: the producer's committed sequence number now; ``events``: how
    many events this call put (0 for a duplicate).
    """

    duplicate: bool
    sequence: int
    committed: int
    events: int


@dataclass(frozen=True)
class RawSegment:
    """Events as an agent sent them: a :class:`~filechannel.Segment` and its bytes (not yet checked).

    ``segment.path`` is a label (``URI/CHANNEL/seg-....wal``) for messages,
    not a path of this host. :meth:`events` decodes and checks them.
    """

    segment: Segment
    data: bytes

    def events(self, encryption: Encryption | str | os.PathLike[str] | None = None) -> list[Event]:
        """Decode and check every record (``encryption``: a keystore path, for an encrypted channel).

        Raises:
            CorruptLogError: A record that does not verify (damaged, or not of this channel).
            DecryptionError: No key for an encrypted segment, or an authentication tag that fails.
        """
        return decode_segment(self.segment, self.data, encryption=encryption)


class AgentClient:
    """A connection to one agent.

    Every method raises, besides what it lists:

    - :class:`AgentUnavailableError`: the agent cannot be reached (stopped, or a TLS handshake failed);
      :class:`AgentTimeoutError` (a subclass): no answer within ``settings.timeout``;
    - :class:`AgentAuthError`: the agent refused the token or the certificate name;
    - :class:`UnknownChannelError`: the agent serves no such channel;
    - the channel's own errors as raised at the agent (``DataLossError``, ``ConsumerIdentityError``, ...).

    Picklable (its settings travel, the connection is made again).
    """

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.uri = settings.uri
        self._client: Any = None
        self._headers: list[tuple[bytes, bytes]] = []
        # Read the files now: a bad path is a ConfigError at connect, not at the first call.
        self._kwargs = self._tls_kwargs()
        if settings.token_file:
            self._headers = [(TOKEN_HEADER.encode(), b"Bearer " + read_token(settings.token_file, "token_file"))]

    def _tls_kwargs(self) -> dict[str, Any]:
        s = self.settings
        kw: dict[str, Any] = {}
        if s.tls_ca:
            kw["tls_root_certs"] = read_public_file(s.tls_ca, "tls_ca")
        if s.tls_cert and s.tls_key:
            kw["cert_chain"] = read_public_file(s.tls_cert, "tls_cert")
            kw["private_key"] = read_secret_file(s.tls_key, "tls_key")
        if s.override_hostname:
            kw["override_hostname"] = s.override_hostname
        return kw

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<AgentClient {self.uri}>"

    # -- plumbing --------------------------------------------------------------------------

    def _flight(self) -> Any:
        if self._client is None:
            quiet_grpc()
            try:
                self._client = fl.FlightClient(self.uri, **self._kwargs)
            except (fl.FlightError, ValueError) as exc:
                raise AgentUnavailableError(self.uri, f"cannot connect: {_first_line(exc)}") from None
        return self._client

    def _options(self) -> Any:
        return fl.FlightCallOptions(timeout=self.settings.timeout, headers=self._headers)

    def _error(self, exc: Exception, what: str) -> ChannelError:
        msg = _first_line(exc)
        if isinstance(exc, fl.FlightTimedOutError):
            return AgentTimeoutError(self.uri, f"{what}: no answer within {self.settings.timeout:g} s (the deadline)")
        if isinstance(exc, fl.FlightUnavailableError):
            hint = tls_hint(msg, self.settings) if parse_uri(self.uri, "uri").tls else ""
            return AgentUnavailableError(self.uri, f"{what}: cannot reach the agent ({msg}){hint}")
        if isinstance(exc, (fl.FlightUnauthenticatedError, fl.FlightUnauthorizedError)):
            return AgentAuthError(self.uri, f"{what} refused: {msg}")
        if isinstance(exc, fl.FlightServerError):
            return proto.decode_error(self.uri, getattr(exc, "extra_info", b"") or b"", msg)
        return AgentError(self.uri, f"{what}: {msg}")

    def _action(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        client = self._flight()
        try:
            results = list(client.do_action(fl.Action(kind, json.dumps(body).encode()), self._options()))
        except fl.FlightError as exc:
            raise self._error(exc, kind) from None
        if len(results) != 1:
            raise AgentProtocolError(self.uri, f"{kind}: {len(results)} results, expected one")
        try:
            return proto.decode_json(results[0].body.to_pybytes(), f"the answer to {kind}")
        except AgentProtocolError as exc:
            raise AgentProtocolError(self.uri, exc.reason) from None

    # -- discovery and status --------------------------------------------------------------

    def channels(self) -> dict[str, ChannelInfo]:
        """The channels the agent serves (that this caller may use), by channel id (hex)."""
        client = self._flight()
        out: dict[str, ChannelInfo] = {}
        try:
            infos = list(client.list_flights(b"", self._options()))
        except fl.FlightError as exc:
            raise self._error(exc, "list_flights") from None
        for info in infos:
            try:
                meta = proto.decode_json(bytes(info.app_metadata), "a channel's metadata")
                ch = ChannelInfo(str(meta["channel"]), str(meta["name"]), int(meta["start"]), int(meta["end"]))
            except (AgentProtocolError, KeyError, TypeError, ValueError):
                raise AgentProtocolError(self.uri, "list_flights: a channel's metadata does not decode") from None
            out[ch.channel] = ch
        return out

    def status(self) -> dict[str, Any]:
        """The agent's state: ``{agent, version, channels: [...], connections}``.

        Each channel: ``{channel, name, start, end, bytes, disk_free, consumers}`` and, for
        a channel the agent owns, ``fsync_seconds_buckets``; ``consumers`` maps each
        registered consumer name to ``{identity, acked, lag, lag_bytes}``. ``connections``:
        per protocol, the client connections with a call in the last minute (docs/agents.md).
        """
        return self._action("status", {})

    # -- consumers -------------------------------------------------------------------------

    def register(self, channel: str, consumer: str, identity: str | None = None, *, reset: bool = False) -> int:
        """Register ``consumer`` on ``channel`` under ``identity`` (or check it); return its acknowledged mark.

        Raises:
            ConsumerIdentityError: The name is registered with another identity (and not ``reset``).
            ConfigError: A bad consumer name.
        """
        ans = self._action("register", {"channel": channel, "consumer": consumer, "identity": identity, "reset": reset})
        return _int(self.uri, ans, "acked")

    def available(self, channel: str, consumer: str | None = None, identity: str | None = None) -> tuple[int, int]:
        """Return ``[start, end)``: a consumer's acknowledged mark and the durable visible end.

        Without a consumer: what the channel holds (a view's ``[oldest, end)``).

        Raises:
            ConsumerIdentityError: The consumer is registered with another identity.
        """
        body: dict[str, Any] = {"channel": channel}
        if consumer is not None:
            body |= {"consumer": consumer, "identity": identity}
        ans = self._action("available", body)
        return _int(self.uri, ans, "start"), _int(self.uri, ans, "end")

    def ack(self, channel: str, consumer: str, end: int, identity: str | None = None) -> int:
        """Acknowledge every position below ``end`` (durable, cumulative, idempotent); return the mark.

        Raises:
            ConsumerIdentityError: Another identity took the consumer name over.
            DataLossError: ``end`` is beyond what the channel holds.
        """
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise ValueError(f"end must be an int >= 0, got {end!r}")
        ans = self._action("ack", {"channel": channel, "consumer": consumer, "identity": identity, "end": end})
        return _int(self.uri, ans, "acked")

    # -- reads -----------------------------------------------------------------------------

    def read_raw(
        self, channel: str, start: int, end: int, *, max_bytes: int = proto.DEFAULT_MAX_BYTES
    ) -> list[RawSegment]:
        """The segments holding positions ``[start, end)``, as raw bytes (decode with :meth:`RawSegment.events`).

        Positions the channel never held (a failed commit's) are absent, as in a local read.

        Raises:
            DataLossError: The range is not (or no longer) held by the channel.
            AgentProtocolError: The answer is not well formed (positions outside the range, out of order).
        """
        out: list[RawSegment] = []
        for seg, raw in self._received(channel, start, end, max_bytes):
            out.append(RawSegment(seg.segment(), bytes(raw)))
        return out

    def read_arrow(
        self,
        channel: str,
        start: int,
        end: int,
        *,
        encryption: Encryption | str | os.PathLike[str] | None = None,
        max_bytes: int = proto.DEFAULT_MAX_BYTES,
    ) -> Any:
        """The events at positions ``[start, end)`` as one ``pyarrow.RecordBatch``, every record checked here.

        The columns of :func:`filechannel.arrow.read_segment_arrow` (``position``,
        ``body``, ``headers``): the raw segments the agent sends are checked and
        decoded straight into Arrow buffers by the same code as a local segment
        (:func:`filechannel.arrow.read_received`), with no Python object per event.
        ``encryption``: a keystore path, for an encrypted channel.

        Raises:
            DataLossError: The range is not (or no longer) held by the channel.
            CorruptLogError: A record that does not verify.
            DecryptionError: An encrypted channel without its key, or a tag that fails.
            ArrowTextError: A header holds an encoded lone surrogate (old records only): use :meth:`read`.
        """
        got = self._received(channel, start, end, max_bytes)
        enc = as_encryption(encryption) if any(seg.cipher for seg, _ in got) else None
        return read_received([(seg.run(segment_cipher(seg, enc)), raw) for seg, raw in got])

    def _received(self, channel: str, start: int, end: int, max_bytes: int) -> list[tuple[_Received, memoryview]]:
        """The DoGet of ``[start, end)``: each segment's columns (native int64 bytes) and raw bytes (a view), checked.

        The positions are checked with Arrow's compute functions, not per event in Python.
        """
        import pyarrow.compute as pc

        for name, v in (("start", start), ("end", end)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if end < start:
            raise ValueError(f"end {end} is below start {start}")
        try:
            channel_id = bytes.fromhex(channel)
        except ValueError:
            raise ValueError(f"channel must be a channel id in hex, got {channel!r}") from None
        client = self._flight()
        ticket = fl.Ticket(proto.encode_ticket(channel.lower(), start, end, max_bytes))
        try:
            table = client.do_get(ticket, self._options()).read_all()
        except fl.FlightError as exc:
            raise self._error(exc, f"read of [{start}, {end}) of channel {channel}") from None
        meta = table.schema.metadata or {}
        if meta.get(proto.META_VERSION) != str(proto.WIRE_VERSION).encode():
            raise AgentProtocolError(self.uri, f"the read's stream is not of wire version {proto.WIRE_VERSION}")
        try:
            crc_kind = int(meta[proto.META_CRC_KIND])
        except (KeyError, ValueError):
            raise AgentProtocolError(self.uri, "the read's stream has no checksum kind") from None
        bad = AgentProtocolError(
            self.uri, f"read of [{start}, {end}) of channel {channel}: a segment's positions are out of range"
        )
        out: list[tuple[_Received, memoryview]] = []
        last = start - 1
        for batch in table.to_batches():
            lists = [batch.column(c) for c in ("positions", "offsets", "sizes")]
            raws = batch.column("raw")
            if raws.null_count:
                raise bad
            ends = memoryview(raws.buffers()[1]).cast("q")[raws.offset :]
            data = memoryview(raws.buffers()[2] or b"")  # the segments' bytes, not copied
            for r in range(batch.num_rows):
                cols = [_int64s(col, r) for col in lists]
                positions = cols[0]
                n = len(positions)
                if (
                    cols[0] is None
                    or cols[1] is None
                    or cols[2] is None
                    or not n
                    or len(cols[1]) != n
                    or len(cols[2]) != n
                    or positions[0].as_py() <= last
                    or positions[n - 1].as_py() >= end
                    or (n > 1 and not pc.all(pc.greater(positions.slice(1), positions.slice(0, n - 1))).as_py())
                ):
                    raise bad
                last = positions[n - 1].as_py()
                raw = data[ends[r] : ends[r + 1]]
                file_id = batch.column("file_id")[r].as_py()
                seg = _Received(
                    f"{self.uri}/{channel.lower()}/{segment_name(file_id)}",
                    file_id,
                    channel_id,
                    crc_kind,
                    batch.column("offset")[r].as_py(),
                    len(raw),
                    _native(cols[0]),
                    _native(cols[1]),
                    _native(cols[2]),
                    batch.column("cipher")[r].as_py(),
                    batch.column("key_id")[r].as_py(),
                    batch.column("salt")[r].as_py(),
                )
                out.append((seg, raw))
        return out

    def read(
        self,
        channel: str,
        start: int,
        end: int,
        *,
        encryption: Encryption | str | os.PathLike[str] | None = None,
        max_bytes: int = proto.DEFAULT_MAX_BYTES,
    ) -> list[Event]:
        """The events at positions ``[start, end)``, every record checked here (``encryption``: a keystore path).

        Raises:
            DataLossError: The range is not (or no longer) held by the channel.
            CorruptLogError: A record that does not verify.
            DecryptionError: An encrypted channel without its key, or a tag that fails.
        """
        segments = self.read_raw(channel, start, end, max_bytes=max_bytes)
        enc = as_encryption(encryption) if any(s.segment.cipher for s in segments) else None
        out: list[Event] = []
        for s in segments:
            out.extend(s.events(enc))
        return out

    # -- writes ----------------------------------------------------------------------------

    def put_batch(
        self,
        channel: str,
        bodies: Sequence[bytes | bytearray | memoryview],
        headers: Sequence[Mapping[str, str] | None] | None = None,
        *,
        producer: str,
        sequence: int,
    ) -> PutResult:
        """Put ``bodies`` into ``channel`` as one transaction, exactly once per ``(producer, sequence)``.

        Returns only after the agent committed durably. The agent records
        ``sequence`` as the producer's in the same transaction: calling again
        with the same (or a lower) sequence number, after a timeout, a lost
        answer or an agent restart, puts nothing and answers ``duplicate``. So
        retry a failed call with the same arguments until it answers, and give
        each new batch a higher sequence number (one producer id per process
        that numbers its batches; gaps are allowed).

        Args:
            channel: The channel id (hex).
            bodies: The event bodies (at most the channel's ``transaction_capacity``).
            headers: One mapping (or None) per body, or None.
            producer: 1 to 100 characters of ``A-Z a-z 0-9 . _ : -``.
            sequence: An int in ``[0, 2**63)``.

        Raises:
            ValueError: A bad producer id, sequence number, or ``headers`` of another length.
            ChannelFullError: The channel stayed full (retry later: nothing was put).
            EventTooLargeError: An event is larger than the channel's ``max_event_size``.
            TransactionCapacityError: More events than the channel's ``transaction_capacity``.
            AgentError: The agent serves the channel read-only (started without ``--writable``).
        """
        try:
            proto.check_producer(producer)
            proto.check_sequence(sequence)
        except AgentProtocolError as exc:
            raise ValueError(exc.reason) from None
        if headers is not None and len(headers) != len(bodies):
            raise ValueError(f"{len(headers)} headers for {len(bodies)} bodies: give one mapping (or None) per body")
        schema = proto.put_schema()
        cols = [pa.array([bytes(b) for b in bodies], pa.binary())]
        if headers is not None:
            cols.append(pa.array([list(h.items()) if h else None for h in headers], schema.field("headers").type))
        else:
            schema = schema.remove(1)
        table = pa.Table.from_arrays(cols, schema=schema)
        command = proto.encode_put_command(channel.lower(), producer, sequence)
        what = f"put of sequence {sequence} of producer {producer!r} to channel {channel}"
        ans = self._do_put(command, schema, what, lambda writer: writer.write_table(table))
        dup = ans.get("duplicate")
        if not isinstance(dup, bool):
            raise AgentProtocolError(self.uri, f"the answer to the {what} has no duplicate flag")
        return PutResult(
            dup, _int(self.uri, ans, "sequence"), _int(self.uri, ans, "committed"), _int(self.uri, ans, "events")
        )

    def _do_put(self, command: bytes, schema: Any, what: str, send: Callable[[Any], None]) -> dict[str, Any]:
        """One ``DoPut``: ``send(writer)`` streams the rows; return the agent's JSON answer.

        Raises:
            AgentError: What the agent refused (see :meth:`_error`), or no answer / not JSON.
        """
        client = self._flight()
        try:
            writer, results = client.do_put(fl.FlightDescriptor.for_command(command), schema, self._options())
            try:
                send(writer)
                writer.done_writing()
                buf = results.read()
            finally:
                writer.close()
        except fl.FlightError as exc:
            raise self._error(exc, what) from None
        if buf is None:
            raise AgentProtocolError(self.uri, f"{what}: no answer")
        try:
            return proto.decode_json(buf.to_pybytes(), f"the answer to the {what}")
        except AgentProtocolError as exc:
            raise AgentProtocolError(self.uri, exc.reason) from None

    # -- the Spark sink (a writable agent; filechannel.agent.staging) ------------------------

    def sink_stage(
        self,
        channel: str,
        events: Iterable[tuple[bytes, Mapping[str, str] | None]],
        *,
        partition: int,
        attempt: int,
        query: str | None = None,
        batch_id: int | None = None,
        job: str | None = None,
        chunk: int = 4096,
    ) -> tuple[str | None, int, int]:
        """Stage a Spark task's rows at the agent (streamed in record batches of ``chunk`` rows).

        Returns only once the agent made the staged file durable.

        Returns:
            ``(staged file name or None for no rows, rows, bytes)``: what the task's commit message carries.

        Raises:
            EventTooLargeError: A row is larger than the channel's ``max_event_size``.
            InvalidEventError: A null header value, or a bad query, batch or job id.
            AgentError: The agent serves the channel read-only.
        """
        command = proto.encode_stage_command(
            channel.lower(), partition, attempt, query=query, batch_id=batch_id, job=job
        )
        schema = proto.put_schema()
        what = f"stage of partition {partition} to channel {channel}"

        def send(writer: Any) -> None:
            bodies: list[bytes] = []
            maps: list[Any] = []
            for body, headers in events:
                bodies.append(bytes(body))
                maps.append(list(headers.items()) if headers else None)
                if len(bodies) >= chunk:
                    writer.write_batch(_put_batch(schema, bodies, maps))
                    bodies, maps = [], []
            if bodies:
                writer.write_batch(_put_batch(schema, bodies, maps))

        ans = self._do_put(command, schema, what, send)
        staged = ans.get("staged")
        if staged is not None and not isinstance(staged, str):
            raise AgentProtocolError(self.uri, f"{what}: the answer names no staged file")
        return staged, _int(self.uri, ans, "rows"), _int(self.uri, ans, "bytes")

    def sink_commit(
        self,
        channel: str,
        files: Sequence[str],
        *,
        rows: int | None = None,
        query: str | None = None,
        batch_id: int | None = None,
        job: str | None = None,
        stale_staging: float | None = None,
    ) -> dict[str, Any]:
        """Commit staged files as one transaction: micro-batch ``batch_id`` of ``query`` (or batch job ``job``).

        Exactly once per (query, batch id), and per job id: the agent records it in a
        channel mark in the same transaction, so calling again (a retry after a timeout
        or an agent restart, a batch Spark replays) puts nothing.

        Returns:
            ``{"committed": bool, "reason": "committed" | "already committed" | "empty", "rows": n, ...}``.

        Raises:
            ChannelError: A staged file is missing or damaged, the batch is larger than the channel's
                ``transaction_capacity``, or the channel refused it (``ChannelFullError``): nothing was put.
            AgentError: The agent serves the channel read-only.
        """
        body: dict[str, Any] = {"channel": channel.lower(), "files": list(files), "rows": rows}
        body |= {"job": job} if job is not None else {"query": query, "batch": batch_id}
        if stale_staging is not None:
            body["stale_staging"] = stale_staging
        return self._action("sink_commit", body)

    def sink_abort(
        self,
        channel: str,
        files: Sequence[str],
        *,
        query: str | None = None,
        batch_id: int | None = None,
        job: str | None = None,
        stale_staging: float | None = None,
    ) -> int:
        """Delete staged files: those named and every attempt's of the batch (or job); return how many."""
        body: dict[str, Any] = {"channel": channel.lower(), "files": list(files)}
        body |= {"job": job} if job is not None else {"query": query, "batch": batch_id}
        if stale_staging is not None:
            body["stale_staging"] = stale_staging
        return _int(self.uri, self._action("sink_abort", body), "deleted")

    def close(self) -> None:
        """Close the connection (a later call opens a new one)."""
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Received:
    """A segment as received (``filechannel.arrow.Run``'s fields): int64 columns as native bytes.

    ``cipher`` is the data file's cipher suite (0: plaintext), as in a :class:`~filechannel.Segment`.
    """

    path: str
    file_id: int
    channel_id: bytes
    crc_kind: int
    offset: int
    length: int
    positions: bytes
    offsets: bytes
    sizes: bytes
    cipher: int
    key_id: str
    salt: bytes

    def segment(self) -> Segment:
        """As a :class:`~filechannel.Segment` (its columns as tuples)."""
        return Segment(
            self.path,
            self.file_id,
            self.channel_id,
            self.crc_kind,
            self.offset,
            self.length,
            tuple(array("q", self.positions)),
            tuple(array("q", self.offsets)),
            tuple(array("q", self.sizes)),
            self.cipher,
            self.key_id,
            self.salt,
        )

    def run(self, cipher: Any) -> Run:
        """As a ``filechannel.arrow.Run`` read with ``cipher`` (the data file's ``FileCipher``, or None)."""
        return Run(self.path, self.file_id, self.channel_id, self.crc_kind, self.offset, self.length,
                   self.positions, self.offsets, self.sizes, cipher)  # fmt: skip


def _int64s(lists: Any, row: int) -> Any:
    """Row ``row`` of a ``list<int64>`` column as an Int64Array (no copy), or None when it is null or holds a null."""
    scalar = lists[row]
    values = scalar.values if scalar.is_valid else None
    return None if values is None or values.null_count else values


def _native(values: Any) -> bytes:
    """An Int64Array's values as native int64 bytes (one copy)."""
    return values.buffers()[1].slice(values.offset * 8, len(values) * 8).to_pybytes()  # type: ignore[no-any-return]


def _put_batch(schema: Any, bodies: list[bytes], maps: list[Any]) -> Any:
    return pa.record_batch([pa.array(bodies, pa.binary()), pa.array(maps, schema.field("headers").type)], schema=schema)


def tls_hint(msg: str, settings: AgentSettings) -> str:
    """Which side's certificate or CA a failed TLS connection most likely points at (``""``: no idea).

    From what gRPC tells the client: the client's own check of the agent's
    certificate fails with a reason; an agent that refuses the client's
    certificate just closes the connection during the handshake.
    """
    if "wrong version number" in msg:
        return (
            "; the agent does not speak TLS at this address: is it listening on grpc:// rather than grpc+tls://? "
            "(give the URI it listens on)"
        )
    if "certificate verify failed" in msg:
        ca = (
            f"the CA in tls_ca ({settings.tls_ca})"
            if settings.tls_ca
            else "the system's CAs (no tls_ca was given: give the CA that signed the agent's certificate)"
        )
        return (
            f"; this client does not trust the agent's certificate: it is not signed by {ca}. The agent's side: "
            "its --tls-cert; this side: tls_ca (the Spark option tlsCa)"
        )
    if "not in peer certificate" in msg or "Peer name" in msg:
        return (
            "; the agent's certificate does not name the host in the URI: connect by a name (or IP) its "
            "certificate lists, or give override_hostname"
        )
    if "Socket closed" in msg or "Connection reset" in msg:
        if settings.tls_cert:
            return (
                "; the agent closed the connection during the TLS handshake: most likely it does not accept this "
                f"client's certificate (tls_cert {settings.tls_cert} must be signed by the CA the agent was given "
                "with --client-ca), or the agent is stopping"
            )
        return (
            "; if the agent requires client certificates (--client-ca), give tls_cert and tls_key "
            "(the Spark options tlsCert and tlsKey)"
        )
    return ""


def quiet_grpc() -> None:
    """Silence gRPC's own log lines on stderr (``Handshake failed``, ``absl::InitializeLog``) in a client.

    Called before this process makes its first connection, which is when gRPC
    reads ``GRPC_VERBOSITY``. Left as it is when the user set ``GRPC_VERBOSITY``,
    or when the ``filechannel`` log shows INFO (``filechannel -v``): then gRPC
    logs as it would. What failed is in the error this client raises either way.
    """
    if "GRPC_VERBOSITY" in os.environ or logging.getLogger("filechannel").isEnabledFor(logging.INFO):
        return
    os.environ["GRPC_VERBOSITY"] = "NONE"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    text = text.split(". Detail:", 1)[0]
    return text.splitlines()[0] if text else type(exc).__name__


def _int(uri: str, ans: dict[str, Any], key: str) -> int:
    v = ans.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise AgentProtocolError(uri, f"the answer has no {key}")
    return v


class ClientCache:
    """One connection per agent (by :class:`AgentSettings`), made at first use, in this process.

    A connection that failed is dropped with :meth:`forget`, so the next call
    reconnects instead of waiting out gRPC's reconnect backoff. The Spark source
    and sink keep one cache each: a sink dropping its connection never closes
    one a source in the same task is reading through.
    """

    __slots__ = ("_clients",)

    def __init__(self) -> None:
        self._clients: dict[AgentSettings, AgentClient] = {}

    def get(self, settings: AgentSettings) -> AgentClient:
        """The connection to ``settings``' agent."""
        c = self._clients.get(settings)
        if c is None:
            c = self._clients[settings] = settings.connect()
        return c

    def forget(self, settings: AgentSettings) -> None:
        """Close and drop the connection to ``settings``' agent, if any (a broken one is dropped either way)."""
        c = self._clients.pop(settings, None)
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()
