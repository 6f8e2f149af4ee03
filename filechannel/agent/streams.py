"""The Arrow side of the agent's Flight streams: events in from DoPut, segments out to DoGet.

This module owns how the server reads a put or stage stream (``body``
binary, optional ``headers`` ``map<string, string>``: :func:`event_columns`)
into events, checked against the channel's limits batch by batch as they
arrive (:func:`read_put_stream`, :func:`put_limit`, :func:`stream_events`),
and how one segment of a channel becomes the one-row record batch a DoGet
sends, its bytes read with one ``pread`` and not copied (:func:`segment_batch`;
the schema is ``protocol.batch_schema``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from filechannel._fs import DEFAULT_FS
from filechannel.config import ChannelConfig
from filechannel.errors import (
    CorruptLogError,
    DataLossError,
    EventTooLargeError,
    InvalidEventError,
    TransactionCapacityError,
)
from filechannel.reader import Segment

from .errors import AgentProtocolError

__all__ = [
    "MAX_PUT_BYTES",
    "checked_bodies",
    "event_columns",
    "put_limit",
    "read_put_stream",
    "segment_batch",
    "stream_events",
]


def checked_bodies(batch: Any, max_event_size: int) -> Any:
    """The ``body`` column of one batch of a put stream, checked before anything is taken from it.

    Raises:
        AgentProtocolError: A null body.
        EventTooLargeError: A body over ``max_event_size``.
    """
    col = batch.column("body")
    if col.null_count:
        raise AgentProtocolError("", "a body is null")
    if len(col):
        biggest = pc.max(pc.binary_length(col)).as_py()
        if biggest > max_event_size:
            raise EventTooLargeError(biggest, max_event_size)
    return col


def stream_events(reader: Any) -> Iterator[tuple[bytes, dict[str, str] | None]]:
    """The rows of a stage stream, one by one (the put schema: ``body`` binary, optional ``headers``).

    The staging area checks each row's size as it takes it (``staging.py``).

    Raises:
        AgentProtocolError: Another schema, or a null body.
        InvalidEventError: A null header value.
    """
    names = event_columns(reader.schema, "stage")
    for chunk in reader:
        batch = chunk.data
        if batch is None:
            continue
        col = batch.column("body")
        if col.null_count:
            raise AgentProtocolError("", "a body is null")
        maps = batch.column("headers").to_pylist() if "headers" in names else None
        for i, body in enumerate(col.to_pylist()):
            headers = None
            if maps is not None and maps[i]:
                headers = dict(maps[i])
                if any(v is None for v in headers.values()):
                    raise InvalidEventError("a header value is null; headers are strings")
            yield body, headers


def event_columns(schema: Any, kind: str) -> set[str]:
    """The columns of a ``kind`` stream's ``schema``, checked: ``body`` (binary) and optional ``headers``.

    Raises:
        AgentProtocolError: Another schema.
    """
    names = set(schema.names)
    if "body" not in names or not names <= {"body", "headers"}:
        raise AgentProtocolError(
            "", f"a {kind} stream has a body column and an optional headers column, not {schema.names}"
        )
    if not (pa.types.is_binary(schema.field("body").type) or pa.types.is_large_binary(schema.field("body").type)):
        raise AgentProtocolError("", f"the body column is binary, not {schema.field('body').type}")
    if "headers" in names and schema.field("headers").type != pa.map_(pa.string(), pa.string()):
        raise AgentProtocolError("", f"the headers column is map<string, string>, not {schema.field('headers').type}")
    return names


MAX_PUT_BYTES = 512 << 20
"""The most body bytes one DoPut stream may carry, whatever the channel's limits allow."""


def put_limit(config: ChannelConfig) -> int:
    """The most body bytes a DoPut stream may carry into a channel of ``config`` (a ``ChannelConfig``).

    ``max_event_size`` times ``transaction_capacity``, at most :data:`MAX_PUT_BYTES`
    (and never below one event of ``max_event_size``).
    """
    return max(config.max_event_size, min(config.max_event_size * config.transaction_capacity, MAX_PUT_BYTES))


def read_put_stream(reader: Any, config: ChannelConfig) -> tuple[list[bytes], list[dict[str, str] | None]]:
    """The events of a DoPut stream: ``body`` (binary, not null) and optional ``headers`` (map<string, string>).

    Checked batch by batch against the channel's limits (``config``, a
    ``ChannelConfig``), so an oversized put is refused at the first batch that
    goes over, not after the whole stream is in memory. (A single gRPC message is
    still received whole: pyarrow does not let a server set gRPC's receive limit.)

    Raises:
        AgentProtocolError: Another schema, or a null body.
        TransactionCapacityError: More events than the channel's ``transaction_capacity``,
            or more body bytes than :func:`put_limit`.
        EventTooLargeError: A body over ``max_event_size``.
    """
    names = event_columns(reader.schema, "put")
    capacity = config.transaction_capacity
    limit = put_limit(config)
    bodies: list[bytes] = []
    headers: list[dict[str, str] | None] = []
    size = 0
    for chunk in reader:
        batch = chunk.data
        if batch is None:
            continue
        if len(bodies) + batch.num_rows > capacity:
            raise TransactionCapacityError(
                f"a put of more than transaction_capacity={capacity} events; send smaller batches"
            )
        col = checked_bodies(batch, config.max_event_size)
        size += col.nbytes
        if size > limit:
            raise TransactionCapacityError(
                f"a put of more than {limit} bytes (max_event_size times transaction_capacity, at most "
                f"{MAX_PUT_BYTES}); send smaller batches"
            )
        bodies += col.to_pylist()
        if "headers" in names:
            headers += [dict(h) if h else None for h in batch.column("headers").to_pylist()]
        else:
            headers += [None] * batch.num_rows
    return bodies, headers


def segment_batch(schema: Any, s: Segment) -> Any:
    """One segment as a one-row record batch: its bytes read with one pread."""
    try:
        fd = DEFAULT_FS.open_read(s.path)
    except FileNotFoundError:
        raise DataLossError(
            s.start, s.end, f"data file {os.path.basename(s.path)} is gone (retired after an acknowledgement)"
        ) from None
    try:
        raw = DEFAULT_FS.pread(fd, s.length, s.offset)
    finally:
        DEFAULT_FS.close(fd)
    if len(raw) != s.length:
        raise CorruptLogError(s.path, s.offset + len(raw), f"the data file ends inside positions [{s.start}, {s.end})")
    return pa.record_batch(
        [
            pa.array([s.file_id], pa.int64()),
            pa.array([s.offset], pa.int64()),
            pa.Array.from_buffers(  # the bytes as read, not copied
                pa.large_binary(), 1, [None, pa.py_buffer(struct.pack("=2q", 0, len(raw))), pa.py_buffer(raw)]
            ),
            pa.array([s.positions], pa.list_(pa.int64())),
            pa.array([s.offsets], pa.list_(pa.int64())),
            pa.array([s.sizes], pa.list_(pa.int64())),
            pa.array([s.cipher], pa.int32()),
            pa.array([s.key_id], pa.string()),
            pa.array([s.salt], pa.binary()),
        ],
        schema=schema,
    )
