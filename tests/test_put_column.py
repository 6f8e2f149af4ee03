"""put_arrow's column path: a transaction's plain Arrow puts held as one column and framed in one C call.

``Transaction.put_arrow`` of rows without headers keeps them as a
``format.PutColumn`` (the bodies copied into one buffer, int64 offsets); the
writer frames each chunk with ``_speedups.encode_column`` (into a buffer it
reuses), and the take cache makes the events' objects only when a take reaches
them. Checked here:

- the C functions against their pure-Python twins (Hypothesis: same bytes,
  columns and errors, damaged offsets and sealers included), and against
  ``_RecordEncoder.add_puts`` of the same payloads;
- the data files a put_arrow channel writes are byte for byte those put_many
  writes (plaintext and encrypted, several commits, rolls), on both paths;
- the column path is taken: no per-row ``bytes`` is made at put or commit, the
  cache run is lazy until taken, and later changes to the caller's buffers do
  not reach the committed events;
- mixing put_arrow with put / put_many / headers in one transaction.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
import types
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers import NO_ACCELERATOR
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import filechannel
from filechannel import arrow, writer
from filechannel import format as fmt
from filechannel._cache import OVERHEAD, TakeCache

C = fmt.speedups
needs_c = pytest.mark.skipif(C is None, reason=NO_ACCELERATOR)
TWIN = settings(suppress_health_check=[HealthCheck.too_slow], deadline=None, max_examples=200)
KEY = {"k1": bytes(range(32))}
OPTS: dict[str, Any] = {"minimum_required_space": 0, "checkpoint_interval": 0}


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:  # compared below: same class, same message
        return "raised", (type(exc), str(exc))


def offsets_of(rows: list[bytes]) -> bytes:
    o = array("q", [0])
    for r in rows:
        o.append(o[-1] + len(r))
    return o.tobytes()


def fake_seal(tag: int) -> Callable[[bytes, int, bytes], bytes]:
    """A deterministic stand-in for a file cipher's seal: the payload, head and offset mixed, ``tag`` bytes longer."""

    def seal(head: bytes, offset: int, payload: bytes) -> bytes:
        k = (sum(head) + offset) & 0xFF
        return bytes(b ^ k for b in payload) + bytes([k]) * tag

    return seal


def short_seal(head: bytes, offset: int, payload: bytes) -> bytes:
    return payload  # the tag missing: both twins refuse it


# -- the twins --------------------------------------------------------------------------------------

rows_st = st.lists(st.binary(max_size=40), max_size=12)


@needs_c
@TWIN
@given(
    rows=rows_st,
    kind=st.sampled_from([fmt.CRC32C, fmt.CRC32_ZLIB, 9]),
    prefix=st.sampled_from([b"", fmt.EMPTY_HEADERS]),
    seal=st.sampled_from(["none", "seal", "short"]),
    woid=st.integers(0, 1 << 40),
    txn=st.integers(0, 1 << 40),
    start=st.integers(0, 1 << 30),
    into=st.sampled_from(["bytes", "fits", "short"]),
    edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=2),
    cut=st.integers(0, 12),
    tag=st.sampled_from([0, 16, -1]),
)
@example(rows=[b"a"], kind=1, prefix=b"", seal="none", woid=1, txn=1, start=0, into="bytes", edits=[], cut=5, tag=16)
def test_encode_column_twin_same_bytes_and_errors(
    rows: list[bytes],
    kind: int,
    prefix: bytes,
    seal: str,
    woid: int,
    txn: int,
    start: int,
    into: str,
    edits: list[tuple[int, int]],
    cut: int,
    tag: int,
) -> None:
    data = b"".join(rows)
    offs = bytearray(offsets_of(rows))
    for at, v in edits:  # damaged offsets: both refuse them alike
        if at < len(offs):
            offs[at] = v
    if cut % 5 == 0:
        offs = offs[: len(offs) - cut]
    sealer = {"none": None, "seal": fake_seal(max(tag, 0)), "short": short_seal}[seal]
    total = sum(fmt.record_size(len(prefix) + len(r) + (max(tag, 0) if sealer else 0)) for r in rows)
    results = []
    for fn in (C.encode_column, fmt._encode_column_py):
        out = None if into == "bytes" else bytearray(b"\xee" * (3 + total - (1 if into == "short" else 0)))
        oo: Any = array("q")
        ss: list[int] = []
        got = outcome(lambda: fn(7, kind, woid, txn, data, bytes(offs), oo, ss, start, sealer, tag, prefix, out, 3))  # noqa: B023
        # on an error the columns are untouched; ``out`` may hold part of the frames (it is scratch)
        results.append((got, list(oo), ss, out if got[0] == "ok" else None))
    assert results[0] == results[1]
    got, oo, ss, out = results[0]
    if got[0] == "ok" and not edits and cut % 5 and tag >= 0:  # and it is add_puts of the payloads
        enc = fmt._RecordEncoder(7, kind, sealer)
        parts: list[bytes] = []
        o2: list[int] = []
        s2: list[int] = []
        if tag == 16 or sealer is None:
            end = enc.add_puts(parts, woid, txn, rows, o2, s2, start, prefix)
            frames = out[3 : 3 + total] if out is not None else got[1][0]
            assert bytes(frames) == b"".join(parts)
            assert (got[1][1], oo, ss) == (end, o2, s2)


@needs_c
@TWIN
@given(rows=rows_st, extra=st.integers(0, 40), edits=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 255))))
def test_column_frames_size_twin(rows: list[bytes], extra: int, edits: list[tuple[int, int]]) -> None:
    offs = bytearray(offsets_of(rows))
    for at, v in edits:
        if at < len(offs):
            offs[at] = v
    c = outcome(lambda: C.column_frames_size(bytes(offs), extra))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fmt, "speedups", None)
        py = outcome(lambda: fmt.column_frames_size(bytes(offs), extra))
    assert c == py
    if not edits:
        assert c == ("ok", fmt.frames_size(rows, extra))


@needs_c
@TWIN
@given(
    rows=rows_st,
    start=st.integers(0, 4),
    large=st.booleans(),
    n_extra=st.integers(-2, 2),
    edits=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 255)), max_size=2),
)
def test_put_column_twin(
    rows: list[bytes], start: int, large: bool, n_extra: int, edits: list[tuple[int, int]]
) -> None:
    col = pa.array(rows, type=pa.large_binary() if large else pa.binary())
    col = col.slice(min(start, len(rows)))
    _, ob, db = col.buffers()
    offs = bytearray(ob.to_pybytes())
    for at, v in edits:
        if at < len(offs):
            offs[at] = v
    data = db.to_pybytes() if db is not None else b""
    n = len(col) + n_extra
    c = outcome(lambda: C.put_column(bytes(offs), data, n, col.offset, large))
    py = outcome(lambda: arrow._column_py(bytes(offs), data, n, col.offset, large))
    assert c == py
    if c[0] == "ok" and not edits and n == len(col):
        got_data, got_offs, longest = c[1]
        want = rows[min(start, len(rows)) :]
        assert got_data == b"".join(want)
        assert got_offs == offsets_of(want)
        assert longest == max(map(len, want), default=0)


@needs_c
@TWIN
@given(rows=st.lists(st.binary(max_size=30), max_size=6), kind=st.sampled_from([fmt.CRC32C, fmt.CRC32_ZLIB]))
def test_close_batch_of_views_is_the_close_batch_of_bytes(rows: list[bytes], kind: int) -> None:
    """The writer hands close_batch views of its frame buffer: C and Python give the frame of the bytes."""
    frames = [fmt.encode_record(fmt.PUT, i + 1, 5, r, 7, kind) for i, r in enumerate(rows)] or [b""]
    buf = bytearray(b"".join(frames))
    views: list[Any] = [memoryview(buf)[: len(frames[0])], memoryview(buf)[len(frames[0]) :]]
    out = []
    for enc in (fmt._CRecordEncoder(7, kind), fmt._RecordEncoder(7, kind)):
        for handed in (frames, views):
            parts = list(handed)
            n = enc.close_batch(parts, 64, 1, len(rows) + 1)
            out.append(b"".join(parts[len(handed) :]))
            assert len(out[-1]) == n
    assert len(set(out)) == 1


@needs_c
def test_frame_buffer_is_a_bytearray_of_that_size() -> None:
    """The writer's frame buffer (twin: ``bytearray(n)``; its content is unspecified, not zero-filled)."""
    for n in (0, 1, 4097, 1 << 20):
        buf = C.frame_buffer(n)
        assert type(buf) is bytearray
        assert len(buf) == n
    with pytest.raises(ValueError, match="negative"):
        C.frame_buffer(-1)


def test_encode_column_refuses_what_it_cannot_frame() -> None:
    """The pure twin (and the C one, when built) name the problem."""
    fns = [fmt._encode_column_py] + ([C.encode_column] if C is not None else [])
    for fn in fns:
        with pytest.raises(ValueError, match="offsets are n \\+ 1 int64s"):
            fn(0, 1, 1, 1, b"ab", b"\0" * 4, [], [], 0)
        with pytest.raises(ValueError, match="an offset lies outside the data buffer"):
            fn(0, 1, 1, 1, b"ab", array("q", [0, 3]).tobytes(), [], [], 0)
        with pytest.raises(TypeError, match="offsets must be a list"):
            fn(0, 1, 1, 1, b"ab", array("q", [0, 2]).tobytes(), (), [], 0)
        with pytest.raises(ValueError, match="sealer returned 2 bytes for a 18-byte"):
            fn(0, 1, 1, 1, b"ab", array("q", [0, 2]).tobytes(), [], [], 0, short_seal, 16)


# -- the channel: same files, the column path taken --------------------------------------------------


def _bodies(n: int, seed: int) -> list[bytes]:
    r = os.urandom(64)
    return [(r * (1 + (i * seed) % 30))[: (i * 37 + seed) % 700] for i in range(n)]


def _write(d: Path, how: str, batches: list[list[bytes]], opts: dict[str, Any]) -> None:
    with filechannel.open(d, **opts) as ch:
        for k, bl in enumerate(batches):
            with ch.transaction() as tx:
                if how == "arrow":
                    # several chunks in one commit, and two put_arrow calls: one column of three chunks
                    half = len(bl) // 2
                    first = pa.chunked_array([pa.array(bl[:1][:half], pa.binary()), pa.array(bl[1:half], pa.binary())])
                    tx.put_arrow(first)
                    tx.put_arrow(pa.array(bl[half:], pa.large_binary() if k % 2 else pa.binary()))
                else:
                    tx.put_many(bl)
            if k == 1:
                with ch.transaction() as tx:
                    assert len(tx.take_batch(3)) == 3


def _data_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((d / "data").glob("seg-*"))}


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("pure", [False, True], ids=["c", "pure"])
def test_put_arrow_writes_the_bytes_put_many_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypted: bool, pure: bool
) -> None:
    if pure:
        monkeypatch.setattr(fmt, "speedups", None)
    opts = dict(OPTS, max_file_size=64 << 10, fsync="commit")
    if encrypted:
        opts["encryption"] = filechannel.Encryption(keys=KEY, active_key="k1")
        monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)  # the same salt for the same file in both
    monkeypatch.setattr(
        writer, "time", types.SimpleNamespace(time_ns=lambda: 1_700_000_000, sleep=time.sleep, monotonic=time.monotonic)
    )
    base = tmp_path / "base"
    filechannel.open(base, **opts).close()
    batches = [_bodies(n, s) for n, s in ((40, 1), (300, 2), (1, 3), (200, 5))]
    for how in ("arrow", "many"):
        shutil.copytree(base, tmp_path / how)
        _write(tmp_path / how, how, batches, opts)
    a, m = _data_files(tmp_path / "arrow"), _data_files(tmp_path / "many")
    assert len(a) > 2  # rolled: the reused frame buffer crossed files
    assert a == m
    with filechannel.open(tmp_path / "arrow", **opts) as ch, ch.transaction() as tx:
        got = [e.body for e in tx.take_batch(10_000)]
    flat = [b for bl in batches for b in bl]
    assert got == flat[3:]


def test_put_arrow_keeps_a_column_and_makes_no_bytes_per_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither put_arrow nor its commit goes through the per-row paths; a take makes the events."""
    bodies = [b"row%05d" % i for i in range(5000)]
    with filechannel.open(tmp_path / "c", **OPTS) as ch:
        made = []
        if fmt.speedups is not None:

            class Spy:
                def __getattr__(self, name: str) -> Any:
                    made.append(name)
                    return getattr(C, name)

            monkeypatch.setattr(fmt, "speedups", Spy())
        with ch.transaction() as tx:
            tx.put_arrow(pa.array(bodies, pa.binary()))
            assert type(tx._payloads) is fmt.PutColumn
            assert len(tx._payloads) == 5000
        assert "arrow_puts" not in made
        assert "encode_puts" not in made
        cache = ch._core.cache
        assert len(cache._runs) == 1
        assert next(iter(cache._runs.values())).load is not None
        assert cache.nbytes == sum(map(len, bodies)) + OVERHEAD * len(bodies)
        with ch.transaction() as tx:
            evs = tx.take_batch(5000)
        assert [e.body for e in evs] == bodies
        assert [e.position for e in evs] == list(range(5000))
        assert all(e.headers == {} for e in evs)
        assert ch.stats()["cache_hits"] == 5000


def test_put_arrow_copies_the_rows(tmp_path: Path) -> None:
    """A change to the caller's (mutable) Arrow buffers after put_arrow does not reach the commit."""
    raw = bytearray(b"aaaabbbbcccc")
    col = pa.Array.from_buffers(
        pa.binary(), 3, [None, pa.py_buffer(struct.pack("<4i", 0, 4, 8, 12)), pa.py_buffer(raw)]
    )
    with filechannel.open(tmp_path / "c", **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put_arrow(col)
            raw[:] = b"zzzzzzzzzzzz"
        with ch.transaction() as tx:  # from the cache
            assert [e.body for e in tx.take_batch(3)] == [b"aaaa", b"bbbb", b"cccc"]
            tx.rollback()
    with filechannel.open(tmp_path / "c", **OPTS) as ch, ch.transaction() as tx:  # from the file
        assert [e.body for e in tx.take_batch(3)] == [b"aaaa", b"bbbb", b"cccc"]


@pytest.mark.parametrize("then", ["put", "put_many", "headers", "arrow"])
def test_put_arrow_mixes_with_other_puts(tmp_path: Path, then: str) -> None:
    first = [b"a1", b"a2", b""]
    with filechannel.open(tmp_path / "c", **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put_arrow(pa.array(first, pa.binary()))
            if then == "put":
                tx.put(b"p", headers={"k": "v"})
                want = [*first, b"p"]
            elif then == "put_many":
                tx.put_many([b"m1", b"m2"])
                want = [*first, b"m1", b"m2"]
            elif then == "headers":
                batch = pa.RecordBatch.from_arrays(
                    [pa.array([b"h"], pa.binary()), pa.array([[("x", "y")]], pa.map_(pa.string(), pa.string()))],
                    names=["body", "headers"],
                )
                tx.put_arrow(batch)
                want = [*first, b"h"]
            else:
                tx.put_arrow(pa.array([b"b1"], pa.large_binary()))
                assert type(tx._payloads) is fmt.PutColumn
                want = [*first, b"b1"]
            assert len(tx._payloads) == len(want)
        with ch.transaction() as tx:
            from_cache = tx.take_batch(10)
            tx.rollback()
    with filechannel.open(tmp_path / "c", **OPTS) as ch, ch.transaction() as tx:
        from_disk = tx.take_batch(10)
    for evs in (from_cache, from_disk):
        assert [e.body for e in evs] == want
        if then in ("put", "headers"):
            assert evs[-1].headers == ({"k": "v"} if then == "put" else {"x": "y"})
        assert all(e.headers == {} for e in evs[:3])


def test_put_arrow_column_limits_and_rollback(tmp_path: Path) -> None:
    with filechannel.open(tmp_path / "c", transaction_capacity=4, max_event_size=20, **OPTS) as ch:
        tx = ch.transaction()
        with pytest.raises(filechannel.EventTooLargeError):
            tx.put_arrow(pa.array([b"x" * 17], pa.binary()))  # 17 + the 4-byte empty header block
        tx.put_arrow(pa.array([b"x" * 16, b"y"], pa.binary()))
        with pytest.raises(filechannel.TransactionCapacityError):
            tx.put_arrow(pa.array([b"1", b"2", b"3"], pa.binary()))
        assert len(tx._payloads) == 2
        tx.rollback()
        with ch.transaction() as tx2:
            assert tx2.take_batch(4) == []


def test_a_lazy_cache_run_evicted_untaken_never_makes_its_events(tmp_path: Path) -> None:
    """Past ``cache_bytes`` the oldest column run is dropped without being loaded; its takes read the file."""
    a = [b"a%03d" % i for i in range(100)]
    b = [b"b%03d" % i for i in range(100)]
    with filechannel.open(tmp_path / "c", cache_bytes=100 * (4 + 64) + 10, **OPTS) as ch:
        loads = []
        for bodies in (a, b):
            with ch.transaction() as tx:
                tx.put_arrow(pa.array(bodies, pa.binary()))
        runs = ch._core.cache._runs
        assert list(runs) == [100]  # the first run was evicted
        run = runs[100]
        load = run.load
        assert load is not None

        def counting() -> Any:
            loads.append(1)
            return load()

        run.load = counting
        with ch.transaction() as tx:
            got = tx.take_batch(200)
        assert [e.body for e in got] == a + b
        assert loads == [1]  # only the cached run was loaded, once
        stats = ch.stats()
        assert stats["disk_reads"] == 100
        assert stats["cache_hits"] == 100


def test_take_cache_lazy_run_unit() -> None:
    """TakeCache.add_lazy: counted like add, loaded at the first pop that reaches it, partial pops keep the rest."""

    cache = TakeCache(1 << 20)
    calls: list[int] = []

    def load() -> tuple[list[Any], list[Any]]:
        calls.append(1)
        return [b"x", b"yy", b"zzz"], [{}, {}, {}]

    cache.add_lazy(10, 3, 6, load)
    assert (cache.events, cache.nbytes) == (3, 6 + 3 * OVERHEAD)
    assert cache.pop([5]) == [None]
    assert calls == []  # a miss elsewhere does not load it
    assert cache.pop([11]) == [(b"yy", {}, 11)]
    assert cache.pop([10, 12]) == [(b"x", {}, 10), (b"zzz", {}, 12)]
    assert calls == [1]
    assert (cache.events, cache.nbytes) == (0, 0)
    cache.add_lazy(20, 2, 2, load)  # a load that does not match its count is a bug, said so
    with pytest.raises(ValueError, match="different number of events"):
        cache.pop([20])
