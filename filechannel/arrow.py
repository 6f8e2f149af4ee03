"""The Arrow data path: segments read straight into Arrow record batches, and Arrow columns put as events.

This module owns filechannel's public Arrow API and nothing else of the read
or write path:

- :func:`read_segment_arrow` reads a :class:`~filechannel.reader.Segment` (the
  unit the Spark source hands each task) into a ``pyarrow.RecordBatch`` of
  ``position int64, body binary, headers map<string, string>``, doing every
  check :func:`~filechannel.reader.read_segment` does, with the same errors;
- :func:`read_arrow` (``ChannelReader.read_arrow``) does it for a range of
  positions, and :func:`read_received` for segments whose bytes an agent sent;
- :func:`prepare_column` (``Transaction.put_arrow``) copies the rows of a ``body``
  column without headers into a ``format.PutColumn`` (one buffer, int64 offsets),
  which the writer frames without a Python object per row;
- :func:`prepare_puts` turns the rows of a ``body`` column (and an optional
  ``headers`` map column) into PUT payloads, one ``bytes`` each (rows with headers);
- :func:`payload_columns` makes the same payloads as one buffer and its offsets
  per chunk (the Spark sink stages them).

With the C accelerator the per-event loops are C calls
(``_speedups.arrow_verify``, ``arrow_events``, ``put_column``, ``arrow_puts``,
``arrow_payload_column``) that fill plain
bytes buffers; pyarrow wraps them (``pa.py_buffer``, ``Array.from_buffers``),
so no Python object is made per event on the read path. The functions whose
names end in ``_py`` are their pure-Python twins (the reference,
``FILECHANNEL_PURE_PYTHON=1``); ``tests/test_arrow_twins.py`` holds the two
to the same buffers and errors. pyarrow is imported here only, and only when
one of these functions runs: ``import filechannel`` never imports it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, cast

from . import format as fmt
from ._fs import DEFAULT_FS, FS
from .crypto import SEALED_WITHOUT_KEY, TAMPERED, Encryption, FileCipher, segment_cipher
from .errors import ChannelError, CorruptLogError, DataLossError, DecryptionError, FormatError, InvalidEventError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "ArrowTextError",
    "events_to_batch",
    "payload_columns",
    "prepare_column",
    "prepare_puts",
    "read_received",
    "read_runs",
    "read_segment_arrow",
    "schema",
]

_INT32_MAX = 0x7FFF_FFFF
READ_SEGMENT_BYTES = 64 << 20  # read_arrow: one pread (and one batch) per this many bytes of records
_MAX_U32 = 0xFFFF_FFFF

# arrow_events error codes (the C twin's): an event that does not decode, an encoded lone
# surrogate in a header (decode_event takes it; Arrow text cannot hold it), a column over 2 GiB.
_BAD_EVENT = 1
_SURROGATE = 2
_TOO_LARGE = 3


class ArrowTextError(ChannelError, ValueError):
    """An event's header holds an encoded lone surrogate, which Arrow (UTF-8) text cannot hold.

    Only records written before header text became strict UTF-8 can hold one;
    ``read()`` returns such an event (its text decodes with ``surrogatepass``).
    """

    def __init__(self, path: str, offset: int, position: int) -> None:
        self.path = path
        self.offset = offset
        self.position = position
        super().__init__(
            f"{path} at byte {offset}: event at position {position} has a header holding an encoded lone "
            "surrogate (written before header text became strict UTF-8), which Arrow text cannot hold; "
            "read that event with ChannelReader.read()"
        )


def _pa() -> Any:
    try:
        import pyarrow
    except ImportError as exc:  # pragma: no cover - the extra is installed wherever the tests run
        raise ImportError(
            "the Arrow API needs pyarrow: pip install '.[spark]' in filechannel's clone (or pyarrow)"
        ) from exc
    return pyarrow


def schema() -> pa.Schema:
    """The schema of every batch this module returns: ``position int64, body binary, headers map<string, string>``."""
    pa = _pa()
    return pa.schema([("position", pa.int64()), ("body", pa.binary()), ("headers", pa.map_(pa.string(), pa.string()))])


# -- the per-event loops: C, or their pure-Python twins -------------------------------------------


def _verify(
    buf: bytes, offsets: bytes, sizes: bytes, seed: int, kind: int, keyed: bool
) -> tuple[int, bytes, tuple[int, str] | None]:
    """Check a run's records as ``reader._decode_put`` does, up to the first that fails.

    ``offsets`` (into ``buf``) and ``sizes`` are native int64 buffers. Returns
    ``(ok, spans, error)``: ``ok`` records passed; ``spans`` holds each one's
    (payload start, payload length) as native int64 pairs; ``error`` is None or
    ``(code, reason)``: 0 a frame that is not a PUT record of exactly that size,
    1 a sealed record while ``keyed`` is false.
    """
    sp = fmt.speedups
    if sp is not None:
        return sp.arrow_verify(buf, offsets, sizes, seed, kind, keyed)  # type: ignore[no-any-return]
    return _verify_py(buf, offsets, sizes, seed, kind, keyed)


def _q(buf: Any) -> memoryview:
    """A native int64 view of a bytes-like object (its whole 8-byte words)."""
    b = memoryview(buf).cast("B")
    return b[: len(b) // 8 * 8].cast("q")


def _verify_py(
    buf: bytes, offsets: bytes, sizes: bytes, seed: int, kind: int, keyed: bool
) -> tuple[int, bytes, tuple[int, str] | None]:
    """The pure-Python :func:`_verify` (the reference)."""
    if kind not in (fmt.CRC32C, fmt.CRC32_ZLIB):
        raise ValueError(f"unknown checksum algorithm {kind}")
    offs, szs = _q(offsets), _q(sizes)
    if len(offs) != len(szs):
        raise ValueError("offsets and sizes differ in length")
    spans = array("q")
    err: tuple[int, str] | None = None
    i = 0
    for i, (rel, size) in enumerate(zip(offs, szs, strict=True)):  # noqa: B007 - i is the count on a break
        if rel < 0:
            raise ValueError(f"negative record offset {rel}")
        try:
            rec = fmt.decode_record(buf, rel, seed, kind, _MAX_U32)
            if not isinstance(rec, fmt.Record) or rec.size != size or rec.op != fmt.PUT:
                raise FormatError(0, "no PUT record of the expected size there")
        except FormatError as exc:
            err = (0, exc.reason)
            break
        if rec.sealed and not keyed:
            err = (1, "")
            break
        spans.append(rel + fmt.RECORD_HEADER_LEN)
        spans.append(len(rec.payload))
    else:
        i = len(offs)
    return i, spans.tobytes(), err


Buffers = tuple[bytes, bytes, bytes, bytes, bytes, bytes, bytes]
"""Body offsets and data, map offsets, key offsets and data, value offsets and data (int32 offsets)."""
Part = tuple[bytes, bytes, int]
"""Event payloads to decode: ``(data, spans, count)``, ``count`` native int64 (start, length) pairs into ``data``."""
EventsError = tuple[int, int, int, str]
"""The first event that cannot be decoded: ``(part, index, code, reason)``."""


def _events(parts: Sequence[Part]) -> tuple[EventsError | None, Buffers | None]:
    """Decode the event payloads of ``parts``, one after the other, into one set of Arrow buffers.

    Returns ``(None, buffers)``, or ``((part, index, code, reason), None)`` for the
    first event that cannot be (codes :data:`_BAD_EVENT`, :data:`_SURROGATE`, :data:`_TOO_LARGE`).
    """
    sp = fmt.speedups
    if sp is not None:
        return sp.arrow_events(parts)  # type: ignore[no-any-return]
    return _events_py(parts)


def _events_py(parts: Sequence[Part]) -> tuple[EventsError | None, Buffers | None]:
    """The pure-Python :func:`_events` (the reference): ``format.decode_event`` per payload."""
    for data, spans, count in parts:
        sp = _q(spans)
        if count < 0 or len(sp) < 2 * count:
            raise ValueError("arrow_events: spans hold fewer than count payloads")
        for i in range(count):
            if sp[2 * i] < 0 or sp[2 * i + 1] < 0 or sp[2 * i] + sp[2 * i + 1] > len(data):
                raise ValueError("arrow_events: a span lies outside the data")
    events: list[tuple[bytes, dict[str, str]]] = []
    surrogate: EventsError | None = None  # reported only when no event is damaged (read_segment raises that first)
    for q, (data, spans, count) in enumerate(parts):
        sp = _q(spans)
        for i in range(count):
            start = sp[2 * i]
            try:
                body, headers = fmt.decode_event(bytes(data[start : start + sp[2 * i + 1]]))
            except FormatError as exc:
                return (q, i, _BAD_EVENT, exc.reason), None
            try:
                for k, v in headers.items():
                    k.encode("utf-8")
                    v.encode("utf-8")
            except UnicodeEncodeError:
                if surrogate is None:
                    surrogate = (q, i, _SURROGATE, "")
            events.append((body, headers))
    if surrogate is not None:
        return surrogate, None
    boff, moff, koff, voff = array("i", [0]), array("i", [0]), array("i", [0]), array("i", [0])
    bodies: list[bytes] = []
    keys: list[bytes] = []
    vals: list[bytes] = []
    bo = ko = vo = 0
    for body, headers in events:
        bodies.append(body)
        bo += len(body)
        for k, v in headers.items():
            kb, vb = k.encode("utf-8"), v.encode("utf-8")
            keys.append(kb)
            vals.append(vb)
            ko += len(kb)
            vo += len(vb)
            koff.append(min(ko, _INT32_MAX))
            voff.append(min(vo, _INT32_MAX))
        boff.append(min(bo, _INT32_MAX))
        moff.append(len(keys))
    if max(bo, ko, vo) > _INT32_MAX:
        return (0, 0, _TOO_LARGE, "more than 2 GiB in one column"), None
    bufs = (boff.tobytes(), b"".join(bodies), moff.tobytes(), koff.tobytes(), b"".join(keys), voff.tobytes())
    return None, (*bufs, b"".join(vals))


def _build(positions: bytes, n: int, bufs: Buffers) -> pa.RecordBatch:
    """A RecordBatch over the buffers (no copy: pyarrow wraps the bytes objects)."""
    pa = _pa()
    boff, bdata, moff, koff, kdata, voff, vdata = (pa.py_buffer(b) for b in bufs)
    m = len(bufs[3]) // 4 - 1
    pos = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(positions)])
    body = pa.Array.from_buffers(pa.binary(), n, [None, boff, bdata])
    keys = pa.Array.from_buffers(pa.string(), m, [None, koff, kdata])
    vals = pa.Array.from_buffers(pa.string(), m, [None, voff, vdata])
    offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, moff])
    headers = pa.MapArray.from_arrays(offsets, keys, vals, type=schema().field("headers").type)
    return pa.RecordBatch.from_arrays([pos, body, headers], schema=schema())


# -- reading ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Consecutive events of one data file, read with one ``pread``: a Segment with int64 columns."""

    path: str
    file_id: int
    channel_id: bytes
    crc_kind: int
    offset: int
    length: int
    positions: bytes  # native int64s
    offsets: bytes  # native int64s, relative to ``offset``
    sizes: bytes  # native int64s
    cipher: FileCipher | None

    @property
    def count(self) -> int:
        return len(self.positions) // 8

    def position(self, i: int) -> int:
        return int(_q(self.positions)[i])

    def record_offset(self, i: int) -> int:
        return self.offset + int(_q(self.offsets)[i])


def read_runs(runs: Sequence[Run], fs: FS) -> pa.RecordBatch:
    """Read, check and decode ``runs`` in order into one RecordBatch; the first error in event order is raised."""
    parts: list[Part] = []
    failed: Exception | None = None
    for run in runs:
        try:
            fd = fs.open_read(run.path)
        except FileNotFoundError as exc:
            failed = DataLossError(
                run.position(0),
                run.position(run.count - 1) + 1,
                f"data file {run.path} is gone (retired after an acknowledgement)",
            )
            failed.__cause__ = exc
            break
        try:
            buf = fs.pread(fd, run.length, run.offset)
        finally:
            fs.close(fd)
        seed = fmt.file_seed(run.crc_kind, run.channel_id, run.file_id)
        cipher = run.cipher
        ok, spans, err = _verify(buf, run.offsets, run.sizes, seed, run.crc_kind, cipher is not None)
        if err is not None:
            where = f"event at position {run.position(ok)}"
            if err[0] == 1:
                failed = DecryptionError(run.path, run.record_offset(ok), f"{where}: {SEALED_WITHOUT_KEY}")
            else:
                failed = CorruptLogError(run.path, run.record_offset(ok), f"{where}: {err[1]}")
        data = buf
        if cipher is not None:  # decrypt what verified, in order, up to the first tag that fails
            sv = _q(spans)
            plains: list[bytes] = []
            opened = array("q")
            at = 0
            for i in range(ok):
                start, n = sv[2 * i], sv[2 * i + 1]
                rel = start - fmt.RECORD_HEADER_LEN
                plain = cipher.open(bytes(buf[rel : rel + 24]), run.offset + rel, bytes(buf[start : start + n]))
                if plain is None:
                    ok = i
                    where = f"event at position {run.position(i)}"
                    failed = DecryptionError(run.path, run.record_offset(i), f"{where}: {TAMPERED}", cipher.key_id)
                    break
                plains.append(plain)
                opened.append(at)
                opened.append(len(plain))
                at += len(plain)
            data = b"".join(plains)
            spans = opened.tobytes()
        parts.append((data, spans, ok))
        if failed is not None:
            break
    bad, bufs = _events(parts)
    if bad is not None and bad[2] == _BAD_EVENT:
        q, i, _, reason = bad
        run = runs[q]
        raise CorruptLogError(run.path, run.record_offset(i), f"event at position {run.position(i)}: {reason}")
    if failed is not None:
        raise failed
    if bad is not None:  # not damage: what Arrow cannot hold, reported once everything verified
        q, i, code, _ = bad
        run = runs[q]
        if code == _SURROGATE:
            raise ArrowTextError(run.path, run.record_offset(i), run.position(i))
        raise ChannelError(
            f"{run.path}: more than 2 GiB of event bodies or headers in one read, more than one Arrow batch "
            "can hold; read fewer events at a time"
        )
    assert bufs is not None
    return _build(b"".join(run.positions for run in runs), sum(run.count for run in runs), bufs)


def read_segment_arrow(
    segment: Any, encryption: Encryption | str | None = None, *, fs: FS | None = None
) -> pa.RecordBatch:
    """Read the events a :class:`~filechannel.reader.Segment` describes as one ``pyarrow.RecordBatch``.

    Columns ``position int64, body binary, headers map<string, string>`` (an
    event's headers in their stored order). Every record is checked as
    :func:`~filechannel.reader.read_segment` checks it; a segment of an
    encrypted data file needs ``encryption`` (an :class:`~filechannel.Encryption`
    or a keystore path), and its records are decrypted one by one.

    Raises:
        DataLossError: The data file is gone (retired after the events were acknowledged).
        CorruptLogError: A record there does not verify, or its event does not decode.
        DecryptionError: No key for an encrypted segment, or a record whose tag fails.
        ArrowTextError: A header holds an encoded lone surrogate (old records only).
    """
    cipher = segment_cipher(segment, encryption)
    run = Run(
        segment.path,
        segment.file_id,
        segment.channel_id,
        segment.crc_kind,
        segment.offset,
        segment.length,
        array("q", segment.positions).tobytes(),
        array("q", segment.offsets).tobytes(),
        array("q", segment.sizes).tobytes(),
        cipher,
    )
    return read_runs([run], fs or DEFAULT_FS)


class _Received:
    """A read-only stand-in for the ``fs`` seam holding runs' bytes received from elsewhere (an agent's read).

    :func:`read_runs` opens its runs once each, in order: the n-th open is the n-th run's bytes.
    """

    def __init__(self, runs: Sequence[tuple[Run, bytes | memoryview]]) -> None:
        self._runs = runs
        self._opened = 0

    def open_read(self, path: str) -> int:
        self._opened += 1
        return self._opened - 1

    def pread(self, fd: int, n: int, offset: int) -> bytes | memoryview:
        run, data = self._runs[fd]
        if len(data) != n or offset != run.offset:
            raise CorruptLogError(run.path, offset, f"the segment is {n} bytes, {len(data)} were received")
        return data

    def close(self, fd: int) -> None:
        return None


def read_received(runs: Sequence[tuple[Run, bytes | memoryview]]) -> pa.RecordBatch:
    """Runs whose bytes came from elsewhere (an agent), each with its bytes, as one RecordBatch.

    The bytes go through :func:`read_runs` itself (as a local segment's do in
    :func:`read_segment_arrow`): every record's checksum, size and kind, and an
    encrypted record's tag, checked here, with the same errors; ``Run.path`` is a
    label for messages. ``Run.length`` must be the length of its bytes.

    Raises:
        CorruptLogError: A run's bytes are not ``length`` long, or a record does not verify.
        DecryptionError: A sealed record without a key, or a tag that fails.
        ArrowTextError: A header holds an encoded lone surrogate (old records only).
    """
    fs: Any = _Received(runs)
    return read_runs([r for r, _ in runs], fs)


def events_to_batch(events: Sequence[Any]) -> pa.RecordBatch:
    """The batch of :func:`read_segment_arrow` built from Events (``read()``'s answer), in Python."""
    pa = _pa()
    sch = schema()
    return pa.RecordBatch.from_arrays(
        [
            pa.array([ev.position for ev in events], type=pa.int64()),
            pa.array([ev.body for ev in events], type=pa.binary()),
            pa.array([list(ev.headers.items()) for ev in events], type=sch.field("headers").type),
        ],
        schema=sch,
    )


class Fallback(Exception):
    """read_arrow: a case the per-event ``read()`` decides (a file it does not know the cipher of)."""


def _pc() -> Any:
    import pyarrow.compute

    return pyarrow.compute


# -- putting ----------------------------------------------------------------------------------------


PutRows = tuple[list[bytes], list[bytes], list[Any], bool]
"""What :func:`prepare_puts` hands the transaction: payloads, bodies, headers (per row), whether any has headers."""


def _puts(
    offsets: Any, data: Any, n: int, offset: int, wide: bool, no_headers: Any, headers: tuple[Any, ...] | None
) -> Any:
    sp = fmt.speedups
    if sp is not None:
        return sp.arrow_puts(offsets, data, n, offset, wide, no_headers, headers)
    return _puts_py(offsets, data, n, offset, wide, no_headers, headers)


def _puts_py(
    offsets: Any, data: Any, n: int, offset: int, wide: bool, no_headers: Any, headers: tuple[Any, ...] | None
) -> Any:
    """The pure-Python ``arrow_puts`` (the reference): the same lists, or ``(row, "key" | "value")``."""
    width = 8 if wide else 4
    ob = memoryview(offsets).cast("B")
    if n < 0 or offset < 0 or len(ob) // width < offset + n + 1:
        raise ValueError("arrow_puts: the offsets buffer is shorter than the column")
    offs = ob[: (len(ob) // width) * width].cast("q" if wide else "i")[offset : offset + n + 1]
    db = memoryview(data).cast("B")

    def cut(col: Any, buf: Any, j: int) -> bytes:
        a, b = col[j], col[j + 1]
        if a < 0 or b < a or b > len(buf):
            raise ValueError("arrow_puts: an offset lies outside the data buffer")
        return bytes(buf[a:b])

    if headers is None:
        return [cut(offs, db, i) for i in range(n)]
    mo_b, ko_b, kd, vo_b, vd, valid = headers
    mo = memoryview(mo_b).cast("B")
    if len(mo) // 4 < n + 1:
        raise ValueError("arrow_puts: the map offsets are shorter than the column")
    mo = mo[: (len(mo) // 4) * 4].cast("i")
    ko = memoryview(ko_b).cast("B")
    ko = ko[: (len(ko) // 4) * 4].cast("i")
    vo = memoryview(vo_b).cast("B")
    vo = vo[: (len(vo) // 4) * 4].cast("i")
    kdb, vdb = memoryview(kd).cast("B"), memoryview(vd).cast("B")
    vb = memoryview(valid).cast("B") if valid is not None else None
    if vb is not None and len(vb) * 8 < n:
        raise ValueError("arrow_puts: the validity bitmap is shorter than the column")
    payloads: list[bytes] = []
    bodies: list[bytes] = []
    dicts: list[Any] = []
    for i in range(n):
        body = cut(offs, db, i)
        bodies.append(body)
        x, y = mo[i], mo[i + 1]
        if vb is not None and not (vb[i >> 3] >> (i & 7)) & 1:
            y = x
        if x < 0 or y < x or y > len(ko) - 1 or y > len(vo) - 1:
            raise ValueError("arrow_puts: a map offset lies outside its entries")
        if x == y:
            dicts.append(no_headers)
            payloads.append(fmt.EMPTY_HEADERS + body)
            continue
        d: dict[str, str] = {}
        for j in range(x, y):
            kraw, vraw = cut(ko, kdb, j), cut(vo, vdb, j)
            try:
                k = kraw.decode("utf-8")
            except UnicodeDecodeError:
                return i, "key"
            try:
                d[k] = vraw.decode("utf-8")
            except UnicodeDecodeError:
                return i, "value"
        dicts.append(d)
        payloads.append(fmt.encode_event(body, d))
    return payloads, bodies, dicts


def _columns(data: Any) -> Iterator[tuple[Any, Any]]:
    """``(body chunk, headers chunk or None)`` of a RecordBatch, Table, Array or ChunkedArray."""
    pa = _pa()
    if isinstance(data, (pa.RecordBatch, pa.Table)):
        names = data.schema.names
        if "body" not in names:
            raise InvalidEventError(f"put_arrow: no 'body' column (the columns are {names})")
        extra = sorted(set(names) - {"body", "headers", "position"})
        if extra:
            raise InvalidEventError(
                f"put_arrow: unknown column(s) {extra}: give 'body' (binary) and optionally 'headers' "
                "(map<string, string>); a 'position' column is ignored"
            )
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        has_headers = "headers" in names
        for batch in table.to_batches():
            yield batch.column("body"), batch.column("headers") if has_headers else None
        return
    if isinstance(data, pa.ChunkedArray):
        for chunk in data.chunks:
            yield chunk, None
        return
    if isinstance(data, pa.Array):
        yield data, None
        return
    raise TypeError(
        f"put_arrow takes a pyarrow RecordBatch, Table, Array or ChunkedArray of bodies, not {type(data).__name__}"
    )


Chunk = tuple[Any, Any, int, int, bool, "tuple[Any, ...] | None", int]
"""A checked chunk of put data: body offsets, body data, rows, offset, wide, header buffers, first row."""


class Chunks(list[Chunk]):
    """The checked chunks of put data (:func:`prepare_column` hands them to :func:`prepare_puts`)."""


def _chunks(data: Any) -> Chunks:
    """The chunks of Arrow ``data``, their types and nulls checked (no work per row)."""
    pa = _pa()
    map_type = schema().field("headers").type
    out = Chunks()
    row = 0
    for body, headers in _columns(data):
        t = body.type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            body = body.cast(pa.large_binary() if pa.types.is_large_string(t) else pa.binary())
        elif not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            raise TypeError(f"put_arrow: the body column must be binary (or string), not {t}")
        if body.null_count:
            first = body.is_null().index(True).as_py()
            raise InvalidEventError(f"put_arrow: row {row + first} has a null body")
        n = len(body)
        _, offs, bdata = body.buffers()
        wide = pa.types.is_large_binary(body.type)
        hbufs = None
        if headers is not None:
            if not pa.types.is_map(headers.type):
                raise TypeError(f"put_arrow: the headers column must be a map<string, string>, not {headers.type}")
            if headers.type != map_type:
                try:
                    headers = headers.cast(map_type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise TypeError(f"put_arrow: the headers column must be a map<string, string>: {exc}") from exc
            if headers.offset or headers.values.offset:
                headers = pa.concat_arrays([headers])  # unsliced, so its buffers start at row 0
            if headers.items.null_count:
                raise InvalidEventError("put_arrow: a header value is null (header values must be strings)")
            if headers.null_count or headers.offsets[-1].as_py():
                b = headers.buffers()  # map validity, offsets; struct validity; keys (3); values (3)
                hbufs = (b[1], b[4], b[5] or b"", b[7], b[8] or b"", b[0] if headers.null_count else None)
        out.append((offs, bdata if bdata is not None else b"", n, body.offset, wide, hbufs, row))
        row += n
    return out


def _column(offsets: Any, data: Any, n: int, offset: int, wide: bool) -> tuple[bytes, bytes, int]:
    """Rows ``offset .. offset + n - 1`` of a binary column copied into a PUT column chunk.

    Returns ``(data, offsets, longest)``: the rows' bytes, their ``n + 1`` native
    int64 offsets from 0, and the longest row's length (``_speedups.put_column``).
    """
    sp = fmt.speedups
    if sp is not None:
        return sp.put_column(offsets, data, n, offset, wide)  # type: ignore[no-any-return]
    return _column_py(offsets, data, n, offset, wide)


def _column_py(offsets: Any, data: Any, n: int, offset: int, wide: bool) -> tuple[bytes, bytes, int]:
    """The pure-Python :func:`_column` (the reference): the same bytes and errors."""
    width = 8 if wide else 4
    ob = memoryview(offsets).cast("B")
    if n < 0 or offset < 0 or len(ob) // width < offset + n + 1:
        raise ValueError("put_column: the offsets buffer is shorter than the column")
    offs = ob[: (len(ob) // width) * width].cast("q" if wide else "i")[offset : offset + n + 1]
    db = memoryview(data).cast("B")
    longest = 0
    for i in range(n):
        a, b = offs[i], offs[i + 1]
        if a < 0 or b < a or b > len(db):
            raise ValueError("put_column: an offset lies outside the data buffer")
        longest = max(longest, b - a)
    if not n:
        return b"", array("q", [0]).tobytes(), 0
    first = offs[0]
    return bytes(db[first : offs[n]]), array("q", [x - first for x in offs]).tobytes(), longest


def prepare_column(data: Any) -> tuple[fmt.PutColumn, int] | Chunks:
    """Arrow ``data`` as a :class:`~filechannel.format.PutColumn` and its longest body, when no row has headers.

    The bodies are copied into the column (one C call per chunk, no Python
    object per row), so later changes to the caller's buffers cannot reach the
    transaction. When some row has headers, the checked chunks are returned
    instead, for :func:`prepare_puts`. Raises as :func:`prepare_puts`.
    """
    chunks = _chunks(data)
    if any(c[5] is not None for c in chunks):
        return chunks
    col = fmt.PutColumn()
    longest = 0
    for offs, bdata, n, offset, wide, _, _ in chunks:
        cdata, coffs, big = _column(offs, bdata, n, offset, wide)
        col.add(cdata, coffs, n)
        longest = max(longest, big)
    return col, longest


def _payload_column(
    offsets: Any, data: Any, n: int, offset: int, wide: bool, headers: tuple[Any, ...]
) -> tuple[bytes, bytes, int] | tuple[int, str]:
    """The PUT payloads of rows with ``headers`` as one column: ``(data, offsets, longest)`` or ``(row, part)``.

    The payloads of ``arrow_puts`` joined (``offsets``: ``n + 1`` native int64s from 0),
    in one C call and no Python object per row (``_speedups.arrow_payload_column``);
    ``(row, "key" | "value")`` names the first header that is not strict UTF-8.
    """
    sp = fmt.speedups
    if sp is not None:
        return sp.arrow_payload_column(offsets, data, n, offset, wide, headers)  # type: ignore[no-any-return]
    return _payload_column_py(offsets, data, n, offset, wide, headers)


def _payload_column_py(
    offsets: Any, data: Any, n: int, offset: int, wide: bool, headers: tuple[Any, ...]
) -> tuple[bytes, bytes, int] | tuple[int, str]:
    """The pure-Python :func:`_payload_column` (the reference): ``_puts_py``'s payloads, joined."""
    got = _puts_py(offsets, data, n, offset, wide, None, headers)
    if len(got) == 2:
        return cast("tuple[int, str]", got)
    payloads: list[bytes] = got[0]
    ends = array("q", [0])
    ends.extend(accumulate(map(len, payloads)))
    return b"".join(payloads), ends.tobytes(), max(map(len, payloads), default=0)


PayloadChunk = tuple[bool, bytes, bytes, int, int]
"""A chunk of rows ready to stage: ``(with headers, data, offsets, rows, longest)`` (int64 offsets from 0).

With headers, each row is a whole PUT payload; without, each row is a body.
"""


def payload_columns(data: Any) -> list[PayloadChunk]:
    """The rows of Arrow ``data`` (or :func:`prepare_column`'s chunks) as columns, with no Python object per row.

    A chunk without headers is its bodies (``put_column``); a chunk with headers is its
    rows' whole PUT payloads, the bytes :func:`prepare_puts` makes (``arrow_payload_column``).
    The Spark sink stages these.

    Raises:
        As :func:`prepare_puts`.
    """
    out: list[PayloadChunk] = []
    for offs, bdata, n, offset, wide, hbufs, row in data if isinstance(data, Chunks) else _chunks(data):
        if hbufs is None:
            cdata, coffs, longest = _column(offs, bdata, n, offset, wide)
            out.append((False, cdata, coffs, n, longest))
            continue
        got = _payload_column(offs, bdata, n, offset, wide, hbufs)
        if len(got) == 2:
            i, part = got
            raise InvalidEventError(
                f"put_arrow: row {row + i}: a header {part} is not valid UTF-8 text (Arrow strings must be UTF-8)"
            )
        cdata, coffs, longest = got
        out.append((True, cdata, coffs, n, longest))
    return out


def prepare_puts(data: Any, no_headers: Any) -> PutRows:
    """The PUT payloads of Arrow ``data`` (see ``Transaction.put_arrow``), with each row's body and headers.

    Without any headers the payloads are the bodies themselves (the transaction
    frames them behind the shared empty header block); otherwise each is the
    whole encoded event. One C call per chunk with the accelerator. ``data``
    may also be the chunks :func:`prepare_column` returned.

    Raises:
        TypeError: ``data`` is not Arrow data, or ``body``/``headers`` has the wrong type.
        InvalidEventError: A null body or header value, a header that is not UTF-8, a missing
            ``body`` column or an unknown column (a ``ValueError``).
    """
    chunks: list[tuple[bool, list[bytes], list[bytes], list[Any]]] = []
    for offs, bdata, n, offset, wide, hbufs, row in data if isinstance(data, Chunks) else _chunks(data):
        got = _puts(offs, bdata, n, offset, wide, no_headers, hbufs)
        if hbufs is None:  # the payloads are the bodies (two lists: a transaction extends both)
            chunks.append((True, got, list(got), [no_headers] * n))
        elif len(got) == 2:
            i, part = got
            raise InvalidEventError(
                f"put_arrow: row {row + i}: a header {part} is not valid UTF-8 text (Arrow strings must be UTF-8)"
            )
        else:
            chunks.append((False, *got))
    any_headers = not all(plain for plain, _, _, _ in chunks)
    if len(chunks) == 1:  # the usual call: the lists as made, no copy
        plain, p, bl, dl = chunks[0]
        return (list(map(fmt.EMPTY_HEADERS.__add__, bl)) if plain and any_headers else p), bl, dl, any_headers
    payloads: list[bytes] = []
    bodies: list[bytes] = []
    dicts: list[Any] = []
    for plain, p, bl, dl in chunks:
        payloads += list(map(fmt.EMPTY_HEADERS.__add__, bl)) if plain and any_headers else p
        bodies += bl
        dicts += dl
    return payloads, bodies, dicts, any_headers
