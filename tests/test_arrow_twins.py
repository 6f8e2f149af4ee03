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


@needs_c
@TWIN
@given(
    bodies=st.lists(st.binary(max_size=30), max_size=10),
    rows=st.lists(st.one_of(st.none(), st.lists(st.tuples(raw_text, raw_text), max_size=3)), max_size=10),
    start=st.integers(0, 3),
    large=st.booleans(),
)
def test_puts_twin_same_payloads(
    monkeypatch: pytest.MonkeyPatch,
    bodies: list[bytes],
    rows: list[list[tuple[bytes, bytes]] | None],
    start: int,
    large: bool,
) -> None:
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
    marker = object()
    c, py = both(monkeypatch, lambda: arrow.prepare_puts(batch, marker))
    same_outcome(c, py)
    if c[0] == "ok":  # and what put() of each row would store
        payloads, got_bodies, dicts, _ = c[1]
        for i, (b, p, d) in enumerate(zip(got_bodies, payloads, dicts, strict=True)):
            assert b == bodies[min(start, n) + i]
            want = fmt.encode_event(b, d if d is not marker else None)
            assert p == (want if c[1][3] else b)
