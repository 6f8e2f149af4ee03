"""Fluent's forward protocol as a source (``filechannel serve --writable --forward tcp://HOST:PORT[=CHANNEL]``).

This module owns the forward source: :class:`ForwardDecoder`, a pure,
incremental decoder (bytes in, messages out, no I/O) of the four modes of the
Forward Protocol v1 (Message, Forward, PackedForward and
CompressedPackedForward), and :class:`ForwardSource`, which serves it on the
agent's TCP/TLS listeners (``sources.py``). Each entry is one event
(``docs/forward.md``): the record as JSON for the body, headers ``tag`` and
``timestamp`` (seconds; nine decimals for an EventTime).

Commits: a message with the ``chunk`` option is one transaction, answered
``{"ack": chunk}`` only after its durable commit; its chunk id commits with
it as a mark of a :class:`~filechannel.agent.idempotency.KeyRing`
(``forward:<slot>``, bound to the client's certificate name), so a retried
chunk (within the last ``chunk_ids`` of the channel, across agent restarts) is
acknowledged again without a second put.
Messages without ``chunk`` arriving in one read are committed together (the
protocol gives them no answer: at most once). An entry over
``max_event_size`` is left out (logged, counted); a message with more entries
than ``transaction_capacity``, a chunk id reused with other entries, or bytes
that are not the protocol close the connection without an answer.
msgpack (``pip install '.[sources]' in filechannel's clone``) is imported by this module
only; ``import filechannel`` does not load it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from filechannel.errors import (
    ChannelError,
    ChannelFullError,
    ConfigError,
    DiskSpaceError,
    InvalidEventError,
    TransactionCapacityError,
)
from filechannel.format import encoded_event_size

from .auth import INSECURE_FLAG, is_loopback
from .idempotency import KeyConflictError, KeyOwnerError, KeyRing
from .sources import (
    Connection,
    ConnectionSlots,
    SourceAddress,
    StreamListener,
    TooLargeError,
    gunzip_bounded,
    parse_source_address,
    server_ssl_context,
    source_metrics,
)

__all__ = [
    "ForwardDecoder",
    "ForwardError",
    "ForwardMessage",
    "ForwardSettings",
    "ForwardSource",
    "check_forward",
    "entry_event",
    "start_forward",
]

logger = logging.getLogger("filechannel.agent.forward")

MARK_PREFIX = "forward:"
MAX_CHUNK_IDS = 1024
CHUNK_RE = re.compile(r"^[A-Za-z0-9+/=._:-]{1,100}$")


class ForwardError(InvalidEventError):
    """Bytes that are not the forward protocol (the connection is closed)."""


@dataclass(frozen=True)
class ForwardSettings:
    """The forward source's options.

    Attributes:
        addresses: ``tcp://HOST:PORT[=CHANNEL]`` or ``tls://...`` (``--forward``, repeatable).
        read_timeout: Seconds a connection may stay silent (or leave an answer unread) before it is closed.
        max_message: The largest message taken (bytes, also once decompressed): a connection's buffer bound.
        max_connections: Connections open at once (over all addresses); more are closed at once.
        chunk_ids: Chunk ids remembered per channel (the newest; 1 to 1024), across restarts.
    """

    addresses: tuple[str, ...]
    read_timeout: float = 60.0
    max_message: int = 16 << 20
    max_connections: int = 256
    chunk_ids: int = 1024

    def check(self) -> None:
        """Raises ConfigError on a bad option (the addresses are checked by :func:`start_forward`)."""
        if not (isinstance(self.read_timeout, (int, float)) and self.read_timeout > 0):
            raise ConfigError(
                "forward_read_timeout", f"must be a positive number of seconds, not {self.read_timeout!r}"
            )
        if not (isinstance(self.max_message, int) and self.max_message >= 1024):
            raise ConfigError("forward_max_message", f"must be at least 1024 bytes, not {self.max_message!r}")
        if not (isinstance(self.max_connections, int) and self.max_connections > 0):
            raise ConfigError("forward_max_connections", f"must be a positive int, not {self.max_connections!r}")
        if not (isinstance(self.chunk_ids, int) and 1 <= self.chunk_ids <= MAX_CHUNK_IDS):
            raise ConfigError("forward_chunk_ids", f"must be 1 to {MAX_CHUNK_IDS}, not {self.chunk_ids!r}")


# -- the protocol, pure ----------------------------------------------------------------------


@dataclass
class ForwardMessage:
    """One decoded message: its tag, entries ``(timestamp text, record)``, and the ``chunk`` option (or None)."""

    tag: str
    entries: list[tuple[str, Any]]
    chunk: str | None = None


def _text(v: Any, what: str) -> str:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ForwardError(f"{what} is not UTF-8 text") from None
        return v
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise ForwardError(f"{what} is not UTF-8 text") from None
    raise ForwardError(f"{what} is a string, not {type(v).__name__}")


def _timestamp(v: Any) -> str:
    if isinstance(v, bool):
        raise ForwardError("an entry's time is a number or an EventTime")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.9f}"
    if isinstance(v, msgpack.ExtType) and v.code == 0 and len(v.data) == 8:
        sec, nsec = int.from_bytes(v.data[:4], "big"), int.from_bytes(v.data[4:], "big")
        return f"{sec}.{nsec:09d}"
    raise ForwardError("an entry's time is an integer or an EventTime (ext type 0, 8 bytes)")


def _entry(e: Any) -> tuple[str, Any]:
    if not isinstance(e, (list, tuple)) or len(e) != 2:
        raise ForwardError("an entry is [time, record]")
    if not isinstance(e[1], dict):
        raise ForwardError("an entry's record is a map")
    return _timestamp(e[0]), e[1]


def _unpacker(limit: int) -> Any:
    # str values as str (invalid UTF-8 kept, as surrogates, for _text and the JSON fallback to see); bin as bytes
    return msgpack.Unpacker(
        raw=False, unicode_errors="surrogateescape", max_buffer_size=limit, strict_map_key=False, use_list=True
    )


def _unpack_entries(data: bytes, limit: int) -> list[tuple[str, Any]]:
    """The entries of a PackedForward stream (concatenated ``[time, record]`` arrays)."""
    u = _unpacker(max(limit, len(data)))
    u.feed(data)
    entries = [_entry(e) for e in u]
    # Nothing may be left half read: a nil fed now must come back alone (a partial object would take it in).
    u.feed(b"\xc0")
    if next(u, False) is not None:
        raise ForwardError("the packed entries end inside an entry")
    return entries


def _options(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ForwardError("a message's option is a map")
    return {k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k): x for k, x in v.items()}


def decode_message(obj: Any, limit: int) -> ForwardMessage:
    """One msgpack object as a forward message (any of the four modes).

    Raises:
        ForwardError: Not a forward message.
    """
    if not isinstance(obj, list) or len(obj) not in (2, 3, 4):
        raise ForwardError("a message is an array [tag, ...] of 2 to 4 items")
    tag = _text(obj[0], "the tag")
    second = obj[1]
    if isinstance(second, list):  # Forward mode: [tag, [[time, record], ...], option?]
        if len(obj) > 3:
            raise ForwardError("a Forward mode message is [tag, entries, option?]")
        entries = [_entry(e) for e in second]
        opts = _options(obj[2] if len(obj) == 3 else None)
    elif isinstance(second, (bytes, str)) and (len(obj) < 4):  # (Compressed)PackedForward: [tag, bin/str, option?]
        opts = _options(obj[2] if len(obj) == 3 else None)
        comp = opts.get("compressed")
        data = second if isinstance(second, bytes) else second.encode("utf-8", "surrogateescape")
        if comp is not None:
            if comp not in (b"gzip", "gzip"):
                raise ForwardError(f"compressed={comp!r}: gzip is the only compression of the protocol")
            try:
                data = gunzip_bounded(data, limit)
            except TooLargeError:
                raise ForwardError(f"a compressed message decompresses to more than {limit} bytes") from None
            except ValueError as exc:
                raise ForwardError(f"CompressedPackedForward: {exc}") from None
        entries = _unpack_entries(data, limit)
    elif len(obj) in (3, 4):  # Message mode: [tag, time, record, option?]
        entries = [_entry([second, obj[2]])]
        opts = _options(obj[3] if len(obj) == 4 else None)
    else:
        raise ForwardError("a message is [tag, time, record], [tag, entries] or [tag, packed entries]")
    chunk = opts.get("chunk")
    if chunk is not None:
        chunk = _text(chunk, "the chunk option")
        if not CHUNK_RE.match(chunk):
            raise ForwardError("a chunk id is 1 to 100 characters of A-Z a-z 0-9 + / = . _ : -")
    return ForwardMessage(tag, entries, chunk)


class ForwardDecoder:
    """An incremental decoder of a forward connection: :meth:`feed` bytes, then take :meth:`messages`.

    Holds at most ``max_message`` bytes of an unfinished message; a partial
    message never consumes input. Any input gives messages, or
    :class:`ForwardError`; no other exception.
    """

    def __init__(self, max_message: int = 16 << 20) -> None:
        self.max_message = max_message
        self._u = _unpacker(max_message)

    def feed(self, data: bytes) -> None:
        """Add bytes read from the connection.

        Raises:
            ForwardError: An unfinished message would pass ``max_message`` bytes.
        """
        try:
            self._u.feed(data)
        except msgpack.BufferFull:
            raise ForwardError(f"a message is over {self.max_message} bytes") from None

    def messages(self) -> list[ForwardMessage]:
        """The messages completed by the bytes fed so far.

        Raises:
            ForwardError: Bytes that are not the protocol (the connection cannot go on).
        """
        out: list[ForwardMessage] = []
        try:
            for obj in self._u:
                out.append(decode_message(obj, self.max_message))
        except ForwardError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
            raise ForwardError(f"not msgpack: {exc}") from None
        return out


def _default(v: Any) -> Any:
    """What ``json.dumps`` cannot write itself: bytes (bin) and ext values."""
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return {"$binary": base64.b64encode(v).decode("ascii")}
    if isinstance(v, msgpack.ExtType):
        if v.code == 0 and len(v.data) == 8:
            return float(_timestamp(v))
        return {"$ext": v.code, "$binary": base64.b64encode(v.data).decode("ascii")}
    raise TypeError(type(v).__name__)


def _json_value(v: Any) -> Any:
    """``v`` made JSON-safe by hand (the slow path): str with invalid UTF-8, bytes keys, NaN, ..."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
            return v
        except UnicodeEncodeError:
            return _default(v.encode("utf-8", "surrogateescape"))
    if isinstance(v, dict):
        return {_key(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return str(v)
    if isinstance(v, (bytes, msgpack.ExtType)):
        return _default(v)
    return v


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(k, bytes):
        return k.decode("utf-8", "backslashreplace")
    return json.dumps(_json_value(k))


def _dumps(record: Any) -> bytes:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_default).encode(
        "utf-8"
    )


def entry_event(tag: str, entry: tuple[str, Any]) -> tuple[bytes, dict[str, str]]:
    """One entry as an event: the record as JSON for the body; headers ``tag`` and ``timestamp``."""
    ts, record = entry
    try:
        body = _dumps(record)
    except (TypeError, ValueError, UnicodeEncodeError):
        body = _dumps(_json_value(record))
    return body, {"tag": tag, "timestamp": ts}


def message_events(msg: ForwardMessage, max_event: int) -> tuple[list[bytes], list[dict[str, str] | None], int]:
    """The events of a message: (bodies, headers, entries left out for being over ``max_event`` bytes)."""
    bodies: list[bytes] = []
    headers: list[dict[str, str] | None] = []
    for entry in msg.entries:
        body, hdrs = entry_event(msg.tag, entry)
        if encoded_event_size(body, hdrs) > max_event:
            continue
        bodies.append(body)
        headers.append(hdrs)
    return bodies, headers, len(msg.entries) - len(bodies)


def fingerprint(bodies: list[bytes], headers: list[dict[str, str] | None]) -> str:
    """A hash of the events of a chunk (the same chunk id with other entries is a conflict)."""
    h = hashlib.sha256()
    for b, hd in zip(bodies, headers, strict=True):
        h.update(b"%d:" % len(b))
        h.update(b)
        h.update(repr(sorted(hd.items()) if hd else ()).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


# -- the source ------------------------------------------------------------------------------


class ForwardSource:
    """The forward listeners of a writable agent; listening when made, stopped by :meth:`stop`.

    Each address is a ``sources.StreamListener`` (the connection limit shared
    by all of them; the certificate check and deadlines are the listener's).

    Attributes:
        ports: The bound port of each address, in the order given.
        counters: ``messages``, ``events``, ``duplicates``, ``refused``, ``too_large``, ``connections``,
            ``transactions``.
    """

    def __init__(self, agent: Any, settings: ForwardSettings) -> None:
        config = agent.config
        by_name = {ch.name: ch for ch in agent.channels.values()}
        addresses = check_forward(config, sorted(by_name), settings)
        ctx = (
            server_ssl_context(config.tls_cert, config.tls_key, config.client_ca)
            if config.tls_cert and config.tls_key
            else None
        )
        self._settings = settings
        self._metrics = source_metrics(agent)
        self.counters = dict.fromkeys(
            ("messages", "events", "duplicates", "refused", "too_large", "connections", "transactions"), 0
        )
        self.error: BaseException | None = None  # as a tail source's: the agent stops if a source failed
        rings: dict[str, KeyRing] = {}
        slots = ConnectionSlots(settings.max_connections)
        self._listeners: list[StreamListener] = []
        try:
            for spec, addr in zip(settings.addresses, addresses, strict=True):
                ch = by_name[addr.channel]
                ring = rings.get(ch.cid)
                if ring is None:
                    ring = rings[ch.cid] = KeyRing(ch.channel, settings.chunk_ids, MARK_PREFIX)
                self._listeners.append(
                    StreamListener(
                        "forward",
                        spec,
                        addr.host,
                        addr.port,
                        self._handler(ch, ring),
                        ssl_ctx=ctx if addr.tls else None,
                        read_timeout=settings.read_timeout,
                        slots=slots,
                        config=config,
                        cid=ch.cid,
                        metrics=self._metrics,
                    )
                )
        except BaseException:
            self.stop()
            raise
        self.ports = [x.port for x in self._listeners]
        for spec, port in zip(settings.addresses, self.ports, strict=True):
            logger.info("forward source on %s (port %d)", spec, port)

    def stop(self) -> None:
        """Stop listening and close the connections; commits in flight finish."""
        for x in self._listeners:
            x.stop()

    def _count(self, key: str, channel: str, n: int = 1, metric: str | None = None, *labels: str) -> None:
        self.counters[key] += n
        if metric is not None:
            getattr(self._metrics, metric).labels("forward", channel, *labels).inc(n)

    def _handler(self, ch: Any, ring: KeyRing) -> Any:
        def serve(conn: Connection) -> None:
            self.counters["connections"] += 1
            self._serve(conn, ch, ring)

        return serve

    def _serve(self, conn: Connection, ch: Any, ring: KeyRing) -> None:
        channel = ch.channel
        decoder = ForwardDecoder(self._settings.max_message)
        while True:
            data = conn.read()
            if not data:
                return
            try:
                decoder.feed(data)
                messages = decoder.messages()
            except ForwardError as exc:
                logger.warning("forward: closing the connection from %s: %s", conn.peer, exc)
                self._count("refused", ch.name, 1, "source_refused", "malformed")
                return
            batch_bodies: list[bytes] = []
            batch_headers: list[dict[str, str] | None] = []
            for msg in messages:
                self.counters["messages"] += 1
                bodies, headers, left_out = message_events(msg, channel.config.max_event_size)
                if left_out:
                    logger.warning(
                        "forward: %d entr%s of tag %r over max_event_size=%d left out",
                        left_out,
                        "y" if left_out == 1 else "ies",
                        msg.tag,
                        channel.config.max_event_size,
                    )
                    self._count("too_large", ch.name, left_out, "source_refused", "too_large")
                if msg.chunk is None:
                    batch_bodies += bodies
                    batch_headers += headers
                    continue
                if batch_bodies:  # what came before the chunk commits first (order kept)
                    if not self._commit(conn, ch, ring, None, batch_bodies, batch_headers):
                        return
                    batch_bodies, batch_headers = [], []
                if not self._commit(conn, ch, ring, msg.chunk, bodies, headers):
                    return
                conn.write(msgpack.packb({"ack": msg.chunk}))
            if batch_bodies and not self._commit(conn, ch, ring, None, batch_bodies, batch_headers):
                return

    def _commit(
        self,
        conn: Connection,
        ch: Any,
        ring: KeyRing,
        chunk: str | None,
        bodies: list[bytes],
        headers: list[dict[str, str] | None],
    ) -> bool:
        """Commit one transaction (and the chunk id); False when the connection must close (logged, counted)."""
        channel = ch.channel
        cap = channel.config.transaction_capacity
        if len(bodies) > cap:
            logger.warning(
                "forward: a message of %d entries from %s is over transaction_capacity=%d: closing the "
                "connection without an answer (raise transaction_capacity, or send smaller chunks)",
                len(bodies),
                conn.peer,
                cap,
            )
            self._count("refused", ch.name, 1, "source_refused", "too_many_entries")
            return False
        fp = fingerprint(bodies, headers) if chunk is not None else ""
        try:
            duplicate, took = ring.put(channel, chunk, fp, bodies, headers, conn.name)
        except KeyOwnerError:
            logger.warning(
                "forward: chunk %r from %s (certificate name %r) was committed by another certificate: closing",
                chunk,
                conn.peer,
                conn.name,
            )
            self._count("refused", ch.name, 1, "source_refused", "not_allowed")
            return False
        except KeyConflictError:
            logger.warning("forward: chunk %r from %s was committed with other entries: closing", chunk, conn.peer)
            self._count("refused", ch.name, 1, "source_refused", "chunk_conflict")
            return False
        except (ChannelFullError, DiskSpaceError, TransactionCapacityError) as exc:
            logger.warning("forward: %s; closing the connection from %s without an answer", exc, conn.peer)
            self._count("refused", ch.name, 1, "source_refused", "full")
            return False
        except (ChannelError, OSError) as exc:
            logger.error("forward: a put to channel %s failed: %s", ch.name, exc)
            self._count("refused", ch.name, 1, "source_refused", "error")
            return False
        if duplicate:
            self._count("duplicates", ch.name, 1, "source_duplicates")
            return True
        self.counters["transactions"] += 1
        self._count("events", ch.name, len(bodies), "source_events")
        if bodies:
            self._metrics.put_committed(ch.name, "forward", took)
        return True


def check_forward(config: Any, names: Sequence[str], settings: ForwardSettings | Sequence[str]) -> list[SourceAddress]:
    """The forward addresses of an agent with ``config`` serving channels ``names``, checked; binds nothing.

    Raises:
        ConfigError: A bad address or option, an agent that is not writable, or a security setting
            the protocol cannot meet (a bearer token without client certificates; plain TCP with a client CA).
    """
    if not isinstance(settings, ForwardSettings):
        settings = ForwardSettings(tuple(settings))
    settings.check()
    if not config.writable:
        raise ConfigError("forward", "the forward source puts into a channel: start the agent with --writable")
    insecure = bool(getattr(config, "insecure_allow_anyone", False))
    if config.token_file and not config.client_ca and not insecure:
        raise ConfigError(
            "forward",
            "the agent requires a bearer token, and the forward protocol carries none: "
            "give --client-ca too (forward clients then need certificates over tls://)",
        )
    has_tls = bool(config.tls_cert and config.tls_key)
    out = []
    for spec in settings.addresses:
        addr = parse_source_address("forward", spec, names, has_tls=has_tls, insecure=insecure)
        if config.client_ca and not addr.tls:
            raise ConfigError("forward", f"{spec}: the agent requires client certificates (--client-ca): use tls://")
        if not config.client_ca and not insecure and not is_loopback(addr.host):
            raise ConfigError(
                "forward",
                f"{spec}: {addr.host} is reachable from other hosts and forward clients are not authenticated "
                "(the protocol carries no token), so anyone who can connect could write: give --client-ca FILE "
                f"(or, to run open on purpose, {INSECURE_FLAG})",
            )
        out.append(addr)
    return out


def start_forward(agent: Any, settings: ForwardSettings | Sequence[str]) -> ForwardSource:
    """Start the forward source of a writable ``agent`` (``--forward``); stop it before the agent.

    Raises:
        ConfigError: A bad address or option, or an agent that is not writable.
        ChannelError: An address cannot be bound.
    """
    if not isinstance(settings, ForwardSettings):
        settings = ForwardSettings(tuple(settings))
    return ForwardSource(agent, settings)
