"""The Arrow path's C functions against their pure-Python twins, and both against ``read_segment``.

``filechannel.arrow`` reads a segment with ``_speedups.arrow_verify`` and
``arrow_events`` and puts Arrow columns with ``arrow_puts``; its ``_py``
functions are the twins. Hypothesis builds segments of PUT records (event
payloads well formed or not, headers with repeated keys and encoded lone
surrogates, sealed flags), damages them (flipped, overwritten and truncated
bytes) and encrypted channels' segments (tampered ciphertext with a repaired
checksum), and checks: the C and Python paths return the same buffers and
batches and raise the same errors, and those are what ``read_segment`` plus
building the arrays from its Events give (same exception class and message).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from helpers import NO_ACCELERATOR
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import filechannel
from filechannel import arrow
from filechannel import format as fmt
from filechannel.crypto import Encryption
from filechannel.reader import ChannelReader, Segment, read_segment

C = fmt.speedups
needs_c = pytest.mark.skipif(C is None, reason=NO_ACCELERATOR)
TWIN = settings(
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], deadline=None, max_examples=150
)
CID = b"\x05" * 16
FID = 3
KEY = {"k1": bytes(range(32))}


def both(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` with the accelerator, then on the pure path: each a value or the exception raised."""
    out = []
    for sp in (C, None):
        with monkeypatch.context() as m:
            m.setattr(fmt, "speedups", sp)
            try:
                out.append(("ok", fn()))
            except Exception as exc:
                out.append(("raised", exc))
    return out[0], out[1]


def same_outcome(a: tuple[str, Any], b: tuple[str, Any]) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "raised":
        assert type(a[1]) is type(b[1])
        assert str(a[1]) == str(b[1])
    elif isinstance(a[1], pa.RecordBatch):
        assert a[1].equals(b[1]), (a[1].to_pydict(), b[1].to_pydict())
    else:
        assert a[1] == b[1]


# -- event payloads --------------------------------------------------------------------------------

text = st.text(max_size=6)
# header text as stored: UTF-8, sometimes with an encoded lone surrogate (old records), or any bytes
raw_text = st.one_of(
    text.map(lambda s: s.encode("utf-8")),
    st.sampled_from(["a\ud800", "\udfff", "x"]).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=4),
)


def header_block(pairs: list[tuple[bytes, bytes]], count: int | None = None) -> bytes:
    out = [struct.pack("<I", len(pairs) if count is None else count)]
    for k, v in pairs:
        out += [struct.pack("<II", len(k), len(v)), k, v]
    return b"".join(out)


payloads = st.one_of(
    st.builds(lambda b, h: fmt.encode_event(b, h), st.binary(max_size=40), st.dictionaries(text, text, max_size=3)),
    # repeated keys (a dict keeps the first place and the last value), strange text
    st.builds(
        lambda pairs, body: header_block(pairs) + body,
        st.lists(st.tuples(st.sampled_from([b"a", b"b", b""]) | raw_text, raw_text), max_size=4),
        st.binary(max_size=20),
    ),
    # a wrong count, or anything at all
    st.builds(
        lambda pairs, c, body: header_block(pairs, c) + body,
        st.lists(st.tuples(raw_text, raw_text), max_size=2),
        st.integers(0, 6),
        st.binary(max_size=8),
    ),
    st.binary(max_size=24),
)


@needs_c
@TWIN
@given(events=st.lists(payloads, max_size=12))
@example(events=[header_block([(b"a", b"1"), (b"b", b"2"), (b"a", b"3")]) + b"body"])
@example(events=[header_block([(b"k", "\ud800".encode("utf-8", "surrogatepass"))])])
@example(events=[b"\x00\x00"])
def test_events_twin_same_buffers(monkeypatch: pytest.MonkeyPatch, events: list[bytes]) -> None:
    data = b"".join(events)
    spans = []
    at = 0
    for e in events:
        spans += [at, len(e)]
        at += len(e)
    sp = struct.pack(f"={len(spans)}q", *spans)
    # as one part, and split in two parts (a read of two runs)
    half = len(events) // 2
    cut = spans[2 * half] if half < len(events) else len(data)
    two = [
        (data, sp[: 16 * half], half),
        (
            data[cut:],
            struct.pack(
                f"={len(spans) - 2 * half}q", *[v - cut if k % 2 == 0 else v for k, v in enumerate(spans[2 * half :])]
            ),
            len(events) - half,
        ),
    ]
    for parts in ([(data, sp, len(events))], two):
        c = C.arrow_events(parts)
        py = arrow._events_py(parts)
        assert c == py
    assert C.arrow_events(two)[1] == C.arrow_events([(data, sp, len(events))])[1]  # the same buffers


# -- segments -----------------------------------------------------------------------------------------


def frame(payload: bytes, woid: int, seed: int, kind: int, flags: int = 0, op: int = fmt.PUT) -> bytes:
    n = len(payload)
    head = struct.pack("<BBHIQQ", op, flags, 0, n, woid, 7)
    c = fmt.crc(kind, payload, fmt.crc(kind, head, seed))
    return head + struct.pack("<II", c, 0) + payload + b"\0" * (-n & 7)


damage = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "cut"]), st.integers(0, 10_000), st.integers(0, 255)), max_size=2
)


def damaged(buf: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    b = bytearray(buf)
    for what, at, v in edits:
        if not b:
            break
        i = at % len(b)
        if what == "flip":
            b[i] ^= 1 << (v & 7)
        elif what == "set":
            b[i] = v
        else:
            del b[i:]
    return bytes(b)


def reference(seg: Segment, encryption: Any = None) -> tuple[str, Any]:
    """What read_segment and building the arrays from its Events give."""
    try:
        events = read_segment(seg, encryption=encryption)
    except Exception as exc:
        return "raised", exc
    try:
        return "ok", arrow.events_to_batch(events)
    except (UnicodeEncodeError, pa.ArrowException):  # an encoded lone surrogate: not Arrow text
        return "surrogate", None


def check_against_reference(ref: tuple[str, Any], got: tuple[str, Any]) -> None:
    if ref[0] == "surrogate":
        assert got[0] == "raised", got
        assert isinstance(got[1], arrow.ArrowTextError), got
    else:
        same_outcome(ref, got)


@needs_c
@TWIN
@given(
    events=st.lists(
        st.tuples(
            payloads | st.binary(min_size=16, max_size=16),
            st.sampled_from([0, 0, 0, fmt.FLAG_SEALED]),
            st.sampled_from([fmt.PUT] * 6 + [fmt.COMMIT, fmt.TAKE, 0, 9]),  # a valid record of another op, or none
        ),
        min_size=1,
        max_size=8,
    ),
    kind=st.sampled_from([fmt.CRC32C, fmt.CRC32_ZLIB]),
    edits=damage,
    size_skew=st.sampled_from([0, 0, 0, 8, -8]),
)
def test_segment_twin_and_read_segment_agree(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    events: list[tuple[bytes, int, int]],
    kind: int,
    edits: list[tuple[str, int, int]],
    size_skew: int,
) -> None:
    seed = fmt.file_seed(kind, CID, FID)
    frames = [frame(p, 100 + i, seed, kind, fl, op) for i, (p, fl, op) in enumerate(events)]
    offsets, at = [], 0
    for f in frames:
        offsets.append(at)
        at += len(f)
    sizes = [len(f) for f in frames]
    sizes[-1] += size_skew  # a segment that expects another size than the record has
    base = 64
    path = str(tmp_path_factory.mktemp("seg") / "log-seg")
    with open(path, "wb") as fh:
        fh.write(b"\0" * base + damaged(b"".join(frames), edits))
    seg = Segment(path, FID, CID, kind, base, at, tuple(range(10, 10 + len(frames))), tuple(offsets), tuple(sizes))
    c, py = both(monkeypatch, lambda: arrow.read_segment_arrow(seg))
    same_outcome(c, py)
    check_against_reference(reference(seg), c)


@pytest.fixture(scope="module")
def encrypted_channel(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Encryption, list[Segment]]:
    d = str(tmp_path_factory.mktemp("enc") / "ch")
    enc = Encryption(keys=KEY, active_key="k1")
    with filechannel.open(d, encryption=enc, checkpoint_interval=0, minimum_required_space=0) as ch:
        for t in range(3):
            with ch.transaction() as tx:
                for i in range(6):
                    tx.put(b"e%d-%d" % (t, i) * i, {"h": str(i), "t": "\u00e9" * t} if i % 2 else None)
    with ChannelReader(d, encryption=enc) as r:
        start, end = r.available()
        segs = r.segments(start, end, 1 << 20)
    return d, enc, segs


@needs_c
@TWIN
@given(
    record=st.integers(0, 17),
    where=st.integers(0, 10_000),
    how=st.sampled_from(["tamper", "flip", "none", "nokey", "wrongkey"]),
)
def test_encrypted_segment_twin_and_read_segment_agree(
    encrypted_channel: tuple[str, Encryption, list[Segment]],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    record: int,
    where: int,
    how: str,
) -> None:
    _, enc, segs = encrypted_channel
    seg = segs[0]
    with open(seg.path, "rb") as fh:
        whole = bytearray(fh.read())
    r = record % len(seg.positions)
    at = seg.offset + seg.offsets[r]
    plen = struct.unpack_from("<I", whole, at + 4)[0]
    if how in ("tamper", "flip") and plen:
        i = at + 32 + where % plen
        whole[i] ^= 0x01
        if how == "tamper":  # the checksum repaired: only the tag can tell
            head = bytes(whole[at : at + 24])
            seed = fmt.file_seed(seg.crc_kind, seg.channel_id, seg.file_id)
            c = fmt.crc(seg.crc_kind, bytes(whole[at + 32 : at + 32 + plen]), fmt.crc(seg.crc_kind, head, seed))
            struct.pack_into("<I", whole, at + 24, c)
    path = str(tmp_path_factory.mktemp("encseg") / "log-copy")
    with open(path, "wb") as fh:
        fh.write(whole)
    copy = dataclasses.replace(seg, path=path)
    key: Any = {"nokey": None, "wrongkey": Encryption(keys={"k1": bytes(32)}, active_key="k1")}.get(how, enc)
    c, py = both(monkeypatch, lambda: arrow.read_segment_arrow(copy, key))
    same_outcome(c, py)
    check_against_reference(reference(copy, key), c)


# -- puts ------------------------------------------------------------------------------------------------


MAP = pa.map_(pa.string(), pa.string())
raw_strings = st.lists(raw_text, max_size=6)


def string_array(values: list[bytes]) -> pa.Array:
    """A string array over these exact bytes (pyarrow does not check them: invalid UTF-8 stays)."""
    offs = [0]
    for v in values:
        offs.append(offs[-1] + len(v))
    return pa.Array.from_buffers(
        pa.string(),
        len(values),
        [None, pa.py_buffer(struct.pack(f"<{len(offs)}i", *offs)), pa.py_buffer(b"".join(values))],
    )


def header_batch(
    bodies: list[bytes], rows: list[list[tuple[bytes, bytes]] | None], start: int, large: bool
) -> tuple[pa.RecordBatch, list[bytes]]:
    """A batch of ``body`` (large_binary if ``large``) and ``headers`` (None: a null map), and its bodies.

    Its rows are the first of ``bodies`` and ``rows`` paired, sliced from ``start`` (an Arrow
    offset, as a slice of a bigger batch has); the header bytes are kept as given, even not UTF-8.
    """
    n = min(len(bodies), len(rows))
    body = pa.array(bodies[:n], type=pa.large_binary() if large else pa.binary()).slice(min(start, n))
    pairs = [p for r in rows[:n] if r is not None for p in r]
    offs, at = [0], 0
    for r in rows[:n]:
        at += len(r or [])
        offs.append(at)
    keys = string_array([k for k, _ in pairs])
    vals = string_array([v for _, v in pairs])
    mask = pa.array([r is None for r in rows[:n]], type=pa.bool_())
    headers = pa.MapArray.from_arrays(pa.array(offs, type=pa.int32()), keys, vals, type=MAP, mask=mask).slice(
        min(start, n)
    )
    batch = pa.RecordBatch.from_arrays([body, headers], names=["body", "headers"])
    return batch, bodies[min(start, n) : n]


header_batches = st.builds(
    header_batch,
    bodies=st.lists(st.binary(max_size=30), max_size=10),
    rows=st.lists(st.one_of(st.none(), st.lists(st.tuples(raw_text, raw_text), max_size=3)), max_size=10),
    start=st.integers(0, 3),
    large=st.booleans(),
)


@needs_c
@TWIN
@given(case=header_batches)
def test_puts_twin_same_payloads(monkeypatch: pytest.MonkeyPatch, case: tuple[pa.RecordBatch, list[bytes]]) -> None:
    batch, bodies = case
    marker = object()
    c, py = both(monkeypatch, lambda: arrow.prepare_puts(batch, marker))
    same_outcome(c, py)
    if c[0] == "ok":  # and what put() of each row would store
        payloads, got_bodies, dicts, _ = c[1]
        for i, (b, p, d) in enumerate(zip(got_bodies, payloads, dicts, strict=True)):
            assert b == bodies[i]
            want = fmt.encode_event(b, d if d is not marker else None)
            assert p == (want if c[1][3] else b)


# -- payload columns (the Spark sink's rows with headers) ------------------------------------------


@needs_c
@TWIN
@given(case=header_batches)
@example(case=header_batch([b"x"], [[(b"a", b"1"), (b"b", b"2"), (b"a", b"3")]], 0, False))
def test_payload_column_twin_is_prepare_puts_joined(
    monkeypatch: pytest.MonkeyPatch, case: tuple[pa.RecordBatch, list[bytes]]
) -> None:
    batch, _ = case
    c, py = both(monkeypatch, lambda: arrow.payload_columns(batch))
    same_outcome(c, py)
    ref = both(monkeypatch, lambda: arrow.prepare_puts(batch, None))[1]
    assert c[0] == ref[0]
    if c[0] == "raised":  # the same error as put_arrow's
        assert type(c[1]) is type(ref[1])
        assert str(c[1]) == str(ref[1])
        return
    payloads, got_bodies, _, any_headers = ref[1]
    for with_headers, data, offsets, k, longest in c[1]:
        ends = memoryview(offsets).cast("q")
        got = [data[ends[i] : ends[i + 1]] for i in range(k)]
        assert with_headers == any_headers
        assert got == (payloads if with_headers else got_bodies)
        assert longest == max(map(len, got), default=0)


extra_headers = st.dictionaries(st.sampled_from(["a", "b", "spark.query", "é", ""]) | text, text, max_size=3)


def _covered(row: bytes) -> bool:
    """Whether put_many would store this row's event as the row itself (decodes, strict UTF-8, no repeated key)."""
    try:
        body, headers = fmt.decode_event(row)
        return fmt.encode_event(body, headers) == row
    except (fmt.FormatError, UnicodeEncodeError):
        return False


@needs_c
@TWIN
@given(rows=st.lists(payloads, max_size=10), extra=extra_headers, plain=st.booleans())
@example(rows=[header_block([(b"a", b"1"), (b"b", b"2")]) + b"body"], extra={"b": "x", "c": "y"}, plain=False)
@example(rows=[header_block([(b"a", b"1"), (b"a", b"2")]) + b"body"], extra={}, plain=False)
@example(rows=[fmt.EMPTY_HEADERS + b"body"], extra={}, plain=False)
def test_merge_headers_twin_is_encode_event_of_the_merged_headers(
    monkeypatch: pytest.MonkeyPatch, rows: list[bytes], extra: dict[str, str], plain: bool
) -> None:
    from itertools import accumulate

    from filechannel import staged

    data = b"".join(rows)
    offsets = struct.pack(f"<{len(rows) + 1}q", 0, *accumulate(map(len, rows)))
    block = fmt.encode_event(b"", extra) if extra else fmt.EMPTY_HEADERS
    c, py = both(monkeypatch, lambda: staged.merge_headers(data, offsets, block, plain))
    same_outcome(c, py)
    assert c[0] == "ok"
    if not plain and not all(map(_covered, rows)):
        assert c[1] is None  # the caller decodes such rows in Python
        return
    assert c[1] is not None
    out, ends, longest = c[1]
    e = memoryview(ends).cast("q")
    got = [out[e[i] : e[i + 1]] for i in range(len(rows))]
    want = []
    for row in rows:
        body, headers = (row, {}) if plain else fmt.decode_event(row)
        want.append(fmt.encode_event(body, {**headers, **extra} or None))
    assert got == want
    assert longest == max(map(len, want), default=0)


@pytest.mark.parametrize("bad", ["offsets", "extra"])
def test_merge_headers_refuses_offsets_outside_the_data_and_a_bad_extra_block(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    from filechannel import staged

    data = fmt.EMPTY_HEADERS + b"ab"
    offsets = struct.pack("<2q", 0, len(data) + (1 if bad == "offsets" else 0))
    block = b"\x01\x00\x00\x00" if bad == "extra" else fmt.EMPTY_HEADERS
    c, py = both(monkeypatch, lambda: staged.merge_headers(data, offsets, block, False))
    same_outcome(c, py)
    assert c[0] == "raised"
    assert isinstance(c[1], ValueError)
