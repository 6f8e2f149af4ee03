"""The agent's wire format: action names, the DoGet ticket, the batch schema and how errors travel.

Both ends import this module, so the format is written down once. It holds no
transport: the server (``server.py``) and the client (``client.py``) speak
Arrow Flight. Everything but :func:`batch_schema` works without pyarrow.

- Discovery: ``ListFlights`` gives one ``FlightInfo`` per served channel; its
  descriptor path is ``[channel id (hex)]`` and its ``app_metadata`` is JSON
  ``{"v", "channel", "name", "start", "end", "agent"}``.
- ``DoAction(type, JSON body)`` answers one ``Result`` holding a JSON object:
  see :data:`ACTIONS`.
- ``DoGet(ticket)``: the ticket is JSON ``{"v": 1, "channel": hex, "start": s,
  "end": e, "max_bytes": m}``; the stream has the schema of
  :func:`batch_schema`, one record batch (one row) per segment.
- ``DoPut(descriptor)``: the descriptor's command is JSON ``{"v": 1, "op":
  "put", "channel": hex, "producer": id, "sequence": n}`` (:func:`encode_put_command`);
  the stream's record batches (``body`` binary, optional ``headers``
  ``map<string, string>``, :func:`put_schema`) become one channel transaction
  that also sets the mark ``producer:<id>`` to ``n`` (and to its owner, the
  certificate name that first put as ``<id>``: :func:`encode_producer_mark`;
  another certificate's put as ``<id>`` is refused). The one ``PutResult``'s
  metadata, sent after the durable commit, is JSON ``{"v", "duplicate",
  "sequence", "committed", "events"}``: ``duplicate`` when ``n`` was at or below
  the producer's committed sequence (nothing was put).
- The Spark sink (``writeStream.format("filechannel").option("agent", URI)``):
  ``DoPut`` with the command ``{"v": 1, "op": "stage", "channel", "partition",
  "attempt", "query", "batch"}`` (or ``"job"`` instead of query and batch;
  :func:`encode_stage_command`) stages a task's rows (the put schema) at the
  agent and answers ``{"v", "staged": name or null, "rows", "bytes"}`` once the
  staged file is durable; the actions in :data:`SINK_ACTIONS` commit (one
  transaction per (query, batch id), exactly once, through the mark
  ``spark-sink:<query>``) or abort staged files.
- Errors: an application error is a ``FlightServerError`` whose
  ``extra_info`` is JSON ``{"v": 1, "error": class name, "fields": {...}}``
  (:func:`encode_error`), rebuilt by the client as the same class
  (:func:`decode_error`); a refused caller gets ``FlightUnauthenticatedError``
  (token) or ``FlightUnauthorizedError`` (certificate name).
"""

from __future__ import annotations

import json
import re
from typing import Any

from filechannel.errors import (
    ChannelError,
    ChannelFullError,
    ConfigError,
    ConsumerIdentityError,
    CorruptLogError,
    DataLossError,
    DecryptionError,
    EventTooLargeError,
    InvalidEventError,
    TransactionCapacityError,
)

from .errors import AgentError, AgentProtocolError, UnknownChannelError

__all__ = [
    "ACTIONS",
    "DEFAULT_MAX_BYTES",
    "WIRE_VERSION",
    "batch_schema",
    "decode_error",
    "decode_json",
    "decode_ticket",
    "encode_error",
    "encode_ticket",
]

WIRE_VERSION = 1
DEFAULT_MAX_BYTES = 8 << 20  # the most bytes of one segment (one record batch)
MAX_TICKET_BYTES = 4096

#: DoAction types: request body -> answer.
ACTIONS = {
    "register": "{channel, consumer, identity?, reset?} -> {acked, start, end}",
    "available": "{channel, consumer?, identity?} -> {start, end} (no consumer: what the channel holds)",
    "ack": "{channel, consumer, identity?, end} -> {acked}",
    "status": "{} -> {agent, version, channels: [{channel, name, start, end, consumers: {name: {...}}}]}",
}

#: DoAction types of the Spark sink (a writable agent): request body -> answer.
SINK_ACTIONS = {
    "sink_commit": "{channel, query, batch | job, files, rows?, stale_staging?} -> {committed, reason, rows}",
    "sink_abort": "{channel, query?, batch?, job?, files, stale_staging?} -> {deleted}",
}

# Schema metadata keys of a DoGet stream.
META_VERSION = b"filechannel.agent"
META_CHANNEL = b"channel"
META_CRC_KIND = b"crc_kind"


def batch_schema(channel: str, crc_kind: int) -> Any:
    """The schema of a DoGet stream: one row per segment, its raw bytes and where its records lie.

    Columns: ``file_id int64``, ``offset int64`` (of the segment in its data
    file), ``raw large_binary`` (the bytes, exactly as on disk: checksummed,
    and sealed when encrypted), ``positions``, ``offsets`` (relative to
    ``offset``) and ``sizes`` (``list<int64>``, parallel), ``cipher int32``,
    ``key_id string`` and ``salt binary`` (the data file's cipher suite, key
    id and salt; 0, "" and b"" for a plaintext file). Metadata: the wire
    version, the channel id (hex) and the channel's checksum kind.
    """
    import pyarrow as pa

    return pa.schema(
        [
            ("file_id", pa.int64()),
            ("offset", pa.int64()),
            ("raw", pa.large_binary()),
            ("positions", pa.list_(pa.int64())),
            ("offsets", pa.list_(pa.int64())),
            ("sizes", pa.list_(pa.int64())),
            ("cipher", pa.int32()),
            ("key_id", pa.string()),
            ("salt", pa.binary()),
        ],
        metadata={
            META_VERSION: str(WIRE_VERSION).encode(),
            META_CHANNEL: channel.encode(),
            META_CRC_KIND: b"%d" % crc_kind,
        },
    )


def decode_json(body: bytes, what: str) -> dict[str, Any]:
    """A JSON object from the wire, or :class:`AgentProtocolError` (``uri`` left empty for the caller to fill)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if not isinstance(obj, dict):
        raise AgentProtocolError("", f"{what} is not a JSON object")
    return obj


def encode_ticket(channel: str, start: int, end: int, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The DoGet ticket for positions ``[start, end)`` of ``channel``."""
    return json.dumps(
        {"v": WIRE_VERSION, "channel": channel, "start": start, "end": end, "max_bytes": max_bytes},
        separators=(",", ":"),
        sort_keys=True,
    ).encode()


def decode_ticket(ticket: bytes) -> tuple[str, int, int, int]:
    """Return ``(channel, start, end, max_bytes)`` of a ticket, checked.

    Raises:
        AgentProtocolError: Not a ticket of this version, or a field is missing or invalid.
    """
    if len(ticket) > MAX_TICKET_BYTES:
        raise AgentProtocolError("", f"a ticket is at most {MAX_TICKET_BYTES} bytes")
    obj = decode_json(ticket, "the ticket")
    if obj.get("v") != WIRE_VERSION:
        raise AgentProtocolError("", f"ticket version {obj.get('v')!r}; this agent speaks version {WIRE_VERSION}")
    channel = obj.get("channel")
    if not isinstance(channel, str):
        raise AgentProtocolError("", "the ticket names no channel")
    start, end = int_field(obj, "start"), int_field(obj, "end")
    max_bytes = obj.get("max_bytes", DEFAULT_MAX_BYTES)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise AgentProtocolError("", f"max_bytes must be a positive int, got {max_bytes!r}")
    if end < start:
        raise AgentProtocolError("", f"end {end} is below start {start}")
    return channel, start, end, max_bytes


PRODUCER_RE = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")
MAX_SEQUENCE = (1 << 63) - 1
MAX_COMMAND_BYTES = 4096
PRODUCER_MARK_PREFIX = "producer:"


def check_producer(producer: object) -> str:
    """A producer id: 1 to 100 characters of ``A-Z a-z 0-9 . _ : -``.

    Raises:
        AgentProtocolError: Anything else (``uri`` left empty for the caller to fill).
    """
    if not isinstance(producer, str) or not PRODUCER_RE.match(producer):
        raise AgentProtocolError("", f"a producer id is 1 to 100 characters of A-Z a-z 0-9 . _ : -, got {producer!r}")
    return producer


def check_sequence(sequence: object) -> int:
    """A put's sequence number: an int in ``[0, 2**63)``.

    Raises:
        AgentProtocolError: Anything else.
    """
    if not isinstance(sequence, int) or isinstance(sequence, bool) or not 0 <= sequence <= MAX_SEQUENCE:
        raise AgentProtocolError("", f"a sequence number is an int in [0, 2**63), got {sequence!r}")
    return sequence


def producer_mark(producer: str) -> str:
    """The channel mark that holds ``producer``'s last committed sequence number and its owner."""
    return PRODUCER_MARK_PREFIX + producer


def encode_producer_mark(sequence: int, owner: str | None) -> bytes:
    """A producer mark's value: ``"<sequence>"``, or ``"<sequence> <owner>"`` once a certificate name owns it."""
    return b"%d" % sequence if owner is None else b"%d %s" % (sequence, owner.encode("utf-8", "surrogatepass"))


def decode_producer_mark(raw: bytes | None) -> tuple[int, str | None]:
    """``(committed sequence, owning certificate name)`` of a producer mark (``(-1, None)``: none yet).

    Raises:
        AgentProtocolError: A value that is not a producer mark's.
    """
    if raw is None:
        return -1, None
    seq_s, sep, owner = bytes(raw).partition(b" ")
    try:
        return int(seq_s), owner.decode("utf-8", "surrogatepass") if sep else None
    except (ValueError, UnicodeDecodeError):
        raise AgentProtocolError(
            "", f"the channel's producer mark {bytes(raw)[:40]!r} is not a sequence number"
        ) from None


def encode_put_command(channel: str, producer: str, sequence: int) -> bytes:
    """The DoPut descriptor command of one transaction of ``producer``, numbered ``sequence``."""
    return json.dumps(
        {"v": WIRE_VERSION, "op": "put", "channel": channel, "producer": producer, "sequence": sequence},
        separators=(",", ":"),
        sort_keys=True,
    ).encode()


def decode_put_command(command: bytes) -> tuple[str, str, int]:
    """Return ``(channel, producer, sequence)`` of a DoPut command, checked.

    Raises:
        AgentProtocolError: Not a put command of this version, or a field is missing or invalid.
    """
    if len(command) > MAX_COMMAND_BYTES:
        raise AgentProtocolError("", f"a put command is at most {MAX_COMMAND_BYTES} bytes")
    obj = decode_json(command, "the put command")
    if obj.get("v") != WIRE_VERSION or obj.get("op") != "put":
        raise AgentProtocolError("", f"not a put command of wire version {WIRE_VERSION}")
    channel = obj.get("channel")
    if not isinstance(channel, str):
        raise AgentProtocolError("", "the put command names no channel")
    return channel, check_producer(obj.get("producer")), check_sequence(obj.get("sequence"))


def command_op(command: bytes) -> object:
    """The ``op`` of a DoPut command (``"put"`` or ``"stage"``), or None when it does not decode."""
    try:
        obj = json.loads(command) if len(command) <= MAX_COMMAND_BYTES else None
    except (ValueError, UnicodeDecodeError):
        return None
    return obj.get("op") if isinstance(obj, dict) else None


def encode_stage_command(
    channel: str,
    partition: int,
    attempt: int,
    *,
    query: str | None = None,
    batch_id: int | None = None,
    job: str | None = None,
) -> bytes:
    """The DoPut command staging one Spark task's rows: a streaming task's (query, batch) or a batch job's."""
    obj: dict[str, Any] = {"v": WIRE_VERSION, "op": "stage", "channel": channel, "partition": partition}
    obj["attempt"] = attempt
    if job is not None:
        obj["job"] = job
    else:
        obj |= {"query": query, "batch": batch_id}
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def decode_stage_command(command: bytes) -> dict[str, Any]:
    """The fields of a stage command: ``channel``, ``partition``, ``attempt`` and ``query``/``batch`` or ``job``.

    Raises:
        AgentProtocolError: Not a stage command of this version, or a field is missing or invalid.
    """
    if len(command) > MAX_COMMAND_BYTES:
        raise AgentProtocolError("", f"a stage command is at most {MAX_COMMAND_BYTES} bytes")
    obj = decode_json(command, "the stage command")
    if obj.get("v") != WIRE_VERSION or obj.get("op") != "stage":
        raise AgentProtocolError("", f"not a stage command of wire version {WIRE_VERSION}")
    if not isinstance(obj.get("channel"), str):
        raise AgentProtocolError("", "the stage command names no channel")
    out: dict[str, Any] = {"channel": obj["channel"]}
    out["partition"], out["attempt"] = int_field(obj, "partition"), int_field(obj, "attempt")
    if "job" in obj:
        out["job"] = str_field(obj, "job")
    else:
        out["query"], out["batch_id"] = str_field(obj, "query"), int_field(obj, "batch")
    return out


def put_schema() -> Any:
    """The schema a client sends a put in: ``body binary`` (not null), ``headers map<string, string>``."""
    import pyarrow as pa

    return pa.schema([pa.field("body", pa.binary(), nullable=False), ("headers", pa.map_(pa.string(), pa.string()))])


def int_field(obj: dict[str, Any], name: str) -> int:
    """A position field of a request: an int >= 0."""
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise AgentProtocolError("", f"{name} must be an int >= 0, got {v!r}")
    return v


def str_field(obj: dict[str, Any], name: str, *, required: bool = True) -> str | None:
    """A string field of a request (or None when optional and absent)."""
    v = obj.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        raise AgentProtocolError("", f"{name} must be a string, got {v!r}")
    return v


def encode_error(exc: ChannelError) -> bytes:
    """The ``extra_info`` of a Flight error carrying ``exc`` (its class and fields; never key material)."""
    fields: dict[str, Any]
    if isinstance(exc, DataLossError):
        fields = {"start": exc.start, "end": exc.end, "reason": exc.reason}
    elif isinstance(exc, ConsumerIdentityError):
        fields = {"consumer": exc.consumer, "recorded": exc.recorded, "given": exc.given}
    elif isinstance(exc, ConfigError):
        fields = {"option": exc.option, "reason": exc.reason}
    elif isinstance(exc, DecryptionError):
        fields = {"path": exc.path, "offset": exc.offset, "reason": exc.reason, "hint": exc.hint, "key_id": exc.key_id}
    elif isinstance(exc, CorruptLogError):
        fields = {"path": exc.path, "offset": exc.offset, "reason": exc.reason, "hint": exc.hint}
    elif isinstance(exc, EventTooLargeError):
        fields = {"size": exc.size, "limit": exc.limit}
    elif isinstance(exc, UnknownChannelError):
        fields = {"channel": exc.channel, "served": exc.served}
    elif isinstance(exc, AgentError):
        fields = {"reason": exc.reason}
    elif isinstance(exc, ChannelFullError):
        fields = {"message": str(exc), "reason": exc.reason}
    else:
        fields = {"message": str(exc)}
    name = type(exc).__name__ if type(exc).__name__ in _REBUILD else _nearest(exc)
    return json.dumps({"v": WIRE_VERSION, "error": name, "fields": fields}).encode()


def _nearest(exc: ChannelError) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in _REBUILD:
            return cls.__name__
    return "ChannelError"


def decode_error(uri: str, extra_info: bytes, message: str) -> ChannelError:
    """Rebuild the exception an agent sent (``message`` is used when ``extra_info`` is not ours)."""
    try:
        obj = json.loads(extra_info) if extra_info else None
    except (ValueError, UnicodeDecodeError):
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("fields"), dict) or obj.get("error") not in _REBUILD:
        return AgentError(uri, message)
    f: dict[str, Any] = obj["fields"]
    try:
        rebuilt: ChannelError = _REBUILD[obj["error"]](uri, f)
    except (KeyError, TypeError, ValueError):
        return AgentProtocolError(uri, f"an error it sent does not decode: {message}")
    return rebuilt


def _where(uri: str, reason: str) -> str:
    return f"{reason} (at agent {uri})"


_REBUILD: dict[str, Any] = {
    "DataLossError": lambda uri, f: DataLossError(int(f["start"]), int(f["end"]), _where(uri, str(f["reason"]))),
    "ConsumerIdentityError": lambda uri, f: ConsumerIdentityError(f["consumer"], f["recorded"], f["given"]),
    "ConfigError": lambda uri, f: ConfigError(str(f["option"]), _where(uri, str(f["reason"]))),
    "DecryptionError": lambda uri, f: DecryptionError(
        f"{uri}:{f['path']}", int(f["offset"]), str(f["reason"]), f["key_id"], f["hint"]
    ),
    "CorruptLogError": lambda uri, f: CorruptLogError(
        f"{uri}:{f['path']}", int(f["offset"]), str(f["reason"]), f["hint"]
    ),
    "UnknownChannelError": lambda uri, f: UnknownChannelError(uri, str(f["channel"]), list(f["served"])),
    "AgentProtocolError": lambda uri, f: AgentProtocolError(uri, str(f["reason"])),
    "AgentError": lambda uri, f: AgentError(uri, str(f["reason"])),
    "EventTooLargeError": lambda uri, f: EventTooLargeError(int(f["size"]), int(f["limit"])),
    "InvalidEventError": lambda uri, f: InvalidEventError(_where(uri, str(f["message"]))),
    "ChannelFullError": lambda uri, f: ChannelFullError(
        _where(uri, str(f["message"])), str(f.get("reason") or "capacity")
    ),
    "TransactionCapacityError": lambda uri, f: TransactionCapacityError(_where(uri, str(f["message"]))),
    "ChannelError": lambda uri, f: ChannelError(_where(uri, str(f["message"]))),
}
