"""The sink's columnar staged files (issue 26): Arrow batches staged with no Python object per row.

Covers ``filechannel.staged.stage_chunks`` / ``read_staged_chunks`` / ``put_chunks``
and the writers' ``_arrow_chunks``: the channel bytes a commit writes from columnar
staged files are those ``put_many`` writes of the same rows; staged files of the
older row format still commit; damaged or re-keyed chunks are refused.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")

import filechannel  # noqa: E402
from filechannel import format as fmt  # noqa: E402
from filechannel import staged  # noqa: E402
from filechannel._fs import DEFAULT_FS  # noqa: E402
from filechannel.errors import CorruptLogError, DecryptionError  # noqa: E402
from filechannel.spark import sink as S  # noqa: E402

PLAIN = S._Columns("body", False, None)
WITH_HEADERS = S._Columns("body", False, "headers")
MAP = pa.map_(pa.string(), pa.string())


def _segments(path: str) -> dict[str, bytes]:
    """Each data file's bytes after its header (whose ``created_ns`` differs between the twins)."""
    data = os.path.join(path, "data")
    out = {}
    for f in sorted(os.listdir(data)):
        if f.endswith(".wal"):
            raw = Path(data, f).read_bytes()
            h = fmt.decode_file_header(raw)
            assert isinstance(h, fmt.FileHeader)
            out[f] = raw[len(fmt.encode_file_header(h)) :]
    return out


def _twin_channels(tmp_path, n_opts: dict[str, str] | None = None) -> tuple[S.SinkCommitter, str]:
    """A sink's channel and a copy of it made before anything is put (the same channel id, so the same CRC seeds)."""
    a = str(tmp_path / "a")
    c = S.SinkCommitter(S.SinkOptions.from_spark({"path": a, **(n_opts or {})}))
    c.ensure_channel()
    b = str(tmp_path / "b")
    shutil.copytree(a, b)
    return c, b


def _bodies(n: int) -> list[bytes]:
    return [os.urandom(i % 70) for i in range(n)]


@pytest.mark.parametrize("streaming", [True, False])
def test_commit_from_columns_writes_the_bytes_put_many_writes(tmp_path, streaming):
    c, b = _twin_channels(tmp_path)
    bodies = _bodies(500)
    batches = [
        pa.record_batch([pa.array(bodies[:200], pa.binary())], names=["body"]),
        pa.record_batch([pa.array([x.hex() for x in bodies[200:]], pa.string())], names=["body"]),
    ]
    expect = bodies[:200] + [x.hex().encode() for x in bodies[200:]]
    o = c.options
    name, rows, _ = S.stage_chunks(
        DEFAULT_FS, o.staging_dir, "q.q1.b3.p0.a0.1.stage", S._arrow_chunks(batches, PLAIN), 1 << 20
    )
    assert rows == 500
    assert Path(o.staging_dir, name).read_bytes()[:8] == b"FCSTAGE3"
    chunks = staged.read_staged_chunks(DEFAULT_FS, os.path.join(o.staging_dir, name))
    assert {k for k, *_ in chunks} == {staged.CHUNK_BODIES}
    if streaming:
        assert c.commit_batch("q1", 3, [name], rows).committed
        headers = {S.HEADER_QUERY: "q1", S.HEADER_BATCH: "3"}
    else:
        assert c.commit_job("job", [name], rows) == 500
        headers = None
    with filechannel.open(b) as ch, ch.transaction() as tx:
        tx.put_many(expect, headers=headers)
    got, want = _segments(o.path), _segments(b)
    assert got
    assert got == want
    with filechannel.open(o.path) as ch, ch.transaction() as tx:
        evs = tx.take_batch(600)
        assert [e.body for e in evs] == expect
        assert all(dict(e.headers) == (headers or {}) for e in evs)
        tx.rollback()


def test_rows_with_headers_commit_as_put_many_of_each_row(tmp_path):
    c, b = _twin_channels(tmp_path)
    rows = [(b"a", None), (b"b", [("k", "1")]), (b"c", []), (b"d", [("spark.query", "mine"), ("z", "2")])]
    batch = pa.record_batch(
        [pa.array([r[0] for r in rows], pa.binary()), pa.array([r[1] for r in rows], MAP)], names=["body", "headers"]
    )
    plain = pa.record_batch(
        [pa.array([b"e", b"f"], pa.binary()), pa.array([None, None], MAP)], names=["body", "headers"]
    )
    o = c.options
    name, n, _ = S.stage_chunks(
        DEFAULT_FS, o.staging_dir, "q.q1.b1.p0.a0.1.stage", S._arrow_chunks([batch, plain], WITH_HEADERS), 1 << 20
    )
    assert n == 6
    assert c.commit_batch("q1", 1, [name], n).committed
    extra = {S.HEADER_QUERY: "q1", S.HEADER_BATCH: "1"}
    with filechannel.open(b) as ch, ch.transaction() as tx:
        tx.put(b"a", extra)
        tx.put(b"b", {"k": "1", **extra})
        tx.put(b"c", extra)
        tx.put(b"d", {"spark.query": "q1", "z": "2", S.HEADER_BATCH: "1"})
        tx.put_many([b"e", b"f"], headers=extra)
    assert _segments(o.path) == _segments(b)


def test_a_staged_file_of_rows_from_an_older_executor_still_commits(tmp_path):
    c, b = _twin_channels(tmp_path)
    o = c.options
    bodies = _bodies(50)
    name, n, _ = S.stage_events(
        DEFAULT_FS, o.staging_dir, "q.q1.b1.p0.a0.1.stage", [(x, None) for x in bodies], 1 << 20
    )
    assert Path(o.staging_dir, name).read_bytes()[:8] == b"FCSTAGE1"
    assert c.commit_batch("q1", 1, [name], n).committed
    with filechannel.open(b) as ch, ch.transaction() as tx:
        tx.put_many(bodies, headers={S.HEADER_QUERY: "q1", S.HEADER_BATCH: "1"})
    assert _segments(o.path) == _segments(b)


def test_read_staged_reads_columns_as_payloads(tmp_path):
    d = str(tmp_path)
    chunk = staged.payload_chunk([b"xy", b"", b"zzz"])
    name, n, _ = staged.stage_chunks(DEFAULT_FS, d, "s.stage", [(staged.CHUNK_BODIES, *chunk[1:])], 1 << 20)
    assert n == 3
    assert staged.read_staged(DEFAULT_FS, os.path.join(d, name)) == [b"\0\0\0\0xy", b"\0\0\0\0", b"\0\0\0\0zzz"]


def test_a_row_too_large_fails_the_task_before_staging(tmp_path):
    batch = pa.record_batch([pa.array([b"x" * 100], pa.binary())], names=["body"])
    with pytest.raises(filechannel.EventTooLargeError):
        S.stage_chunks(DEFAULT_FS, str(tmp_path), "s.stage", S._arrow_chunks([batch], PLAIN), 103)
    assert os.listdir(tmp_path) == []
    name, _, _ = S.stage_chunks(DEFAULT_FS, str(tmp_path), "s.stage", S._arrow_chunks([batch], PLAIN), 104)
    assert name == "s.stage"


def test_a_null_body_names_the_tasks_row(tmp_path):
    ok = pa.record_batch([pa.array([b"a", b"b"], pa.binary())], names=["body"])
    bad = pa.record_batch([pa.array([b"c", None], pa.binary())], names=["body"])
    with pytest.raises(filechannel.InvalidEventError, match=r"row 3 .* null body"):
        S.stage_chunks(DEFAULT_FS, str(tmp_path), "s.stage", S._arrow_chunks([ok, bad], PLAIN), 1 << 20)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["crc", "offsets"])
def test_a_damaged_columnar_file_is_refused(tmp_path, damage):
    d = str(tmp_path)
    name, _, _ = staged.stage_chunks(DEFAULT_FS, d, "s.stage", [staged.payload_chunk([b"ab", b"cd"])], 1 << 20)
    path = os.path.join(d, name)
    raw = bytearray(Path(path).read_bytes())
    at = 8 + 24 + 8  # the second offset
    raw[at] ^= 0x7F
    if damage == "offsets":  # a consistent checksum: the offsets check must catch it
        end = len(raw) - 4
        raw[end:] = struct.pack("<I", fmt.crc(fmt.CRC32_ZLIB, bytes(raw[:end])))
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(CorruptLogError, match="checksum" if damage == "crc" else "offsets"):
        staged.read_staged_chunks(DEFAULT_FS, path)


def test_a_sealed_columnar_file_needs_its_key_and_refuses_a_swapped_chunk(tmp_path):
    pytest.importorskip("cryptography", reason="the crypto extra is not installed")
    from test_encryption import K1, write_keystore

    enc = filechannel.Encryption(keys=write_keystore(tmp_path / "keys.json", {"k1": K1}))
    d = str(tmp_path / "st")
    secret = b"very-secret-row"
    chunks = [staged.payload_chunk([secret, b"b"]), staged.payload_chunk([b"c"])]
    name, _, _ = staged.stage_chunks(DEFAULT_FS, d, "s.stage", chunks, 1 << 20, 0, enc)
    path = os.path.join(d, name)
    raw = Path(path).read_bytes()
    assert raw.startswith(b"FCSTAGE4")
    assert secret not in raw
    assert staged.read_staged(DEFAULT_FS, path, enc) == [secret, b"b", b"c"]
    with pytest.raises(DecryptionError):
        staged.read_staged_chunks(DEFAULT_FS, path)


@pytest.mark.parametrize("order", ["column first", "column last", "two heads"])
def test_a_column_with_a_head_mixed_with_other_puts_writes_put_many_bytes(tmp_path, order):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    filechannel.open(a).close()
    shutil.copytree(a, b)
    hdr = {"spark.query": "q", "spark.batch_id": "9"}
    other = {"k": "v"}
    bodies = _bodies(40)

    def column(head_headers: dict[str, str]) -> fmt.PutColumn:
        col = fmt.PutColumn(fmt.encode_event(b"", head_headers))
        _, data, offsets, n, _ = staged.payload_chunk(bodies)
        col.add(data, offsets, n)
        return col

    with filechannel.open(a) as ch, ch.transaction() as tx:
        if order == "column first":
            tx.put_column(column(hdr), 69)
            tx.put_many([b"x", b"y"])
        elif order == "column last":
            tx.put_many([b"x", b"y"])
            tx.put_column(column(hdr), 69)
        else:
            tx.put_column(column(hdr), 69)
            tx.put_column(column(other), 69)
    with filechannel.open(b) as ch, ch.transaction() as tx:
        if order == "column first":
            tx.put_many(bodies, headers=hdr)
            tx.put_many([b"x", b"y"])
        elif order == "column last":
            tx.put_many([b"x", b"y"])
            tx.put_many(bodies, headers=hdr)
        else:
            tx.put_many(bodies, headers=hdr)
            tx.put_many(bodies, headers=other)
    assert _segments(a) == _segments(b)
    with filechannel.open(a) as ch, ch.transaction() as tx:
        evs = tx.take_batch(100)
        tx.rollback()
    assert len(evs) == (80 if order == "two heads" else 42)
    assert dict(evs[0].headers) == (hdr if order != "column last" else {})


def test_a_committed_column_with_a_head_is_taken_from_the_cache_with_its_headers(tmp_path):
    hdr = {"spark.query": "q", "spark.batch_id": "9"}
    col = fmt.PutColumn(fmt.encode_event(b"", hdr))
    _, data, offsets, n, _ = staged.payload_chunk([b"a", b"bc"])
    col.add(data, offsets, n)
    with filechannel.open(str(tmp_path / "c")) as ch:
        with ch.transaction() as tx:
            tx.put_column(col, 2)
        with ch.transaction() as tx:
            evs = tx.take_batch(5)
    assert [(e.body, dict(e.headers)) for e in evs] == [(b"a", hdr), (b"bc", hdr)]


header_rows = st.lists(
    st.tuples(
        st.binary(max_size=20),
        st.one_of(
            st.none(),
            st.lists(
                st.tuples(
                    st.sampled_from(["k", "spark.query", S.HEADER_BATCH, "é"]) | st.text(max_size=4),
                    st.text(max_size=5),
                ),
                max_size=3,
            ),
        ),
    ),
    min_size=1,
    max_size=12,
)


@settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None, max_examples=25
)
@given(rows=header_rows, streaming=st.booleans())
def test_rows_with_any_headers_commit_the_bytes_put_of_each_row_writes(tmp_path_factory, rows, streaming):
    """Headers that repeat a key, collide with the sink's own or are absent: one column, put()'s bytes."""
    tmp_path = tmp_path_factory.mktemp("h")
    c, b = _twin_channels(tmp_path)
    batch = pa.record_batch(
        [pa.array([r[0] for r in rows], pa.binary()), pa.array([r[1] for r in rows], MAP)], names=["body", "headers"]
    )
    o = c.options
    name, n, _ = S.stage_chunks(
        DEFAULT_FS, o.staging_dir, "q.q1.b2.p0.a0.1.stage", S._arrow_chunks([batch], WITH_HEADERS), 1 << 20
    )
    if streaming:
        assert c.commit_batch("q1", 2, [name], n).committed
        extra = {S.HEADER_QUERY: "q1", S.HEADER_BATCH: "2"}
    else:
        assert c.commit_job("job", [name], n) == len(rows)
        extra = {}
    want = []
    with filechannel.open(b) as ch, ch.transaction() as tx:
        for body, pairs in rows:
            merged = {**dict(pairs or []), **extra}
            tx.put(body, merged or None)
            want.append((body, merged))
    assert _segments(o.path) == _segments(b)
    with filechannel.open(o.path) as ch, ch.transaction() as tx:  # the take cache decodes the column's payloads
        got = [(e.body, dict(e.headers)) for e in tx.take_batch(100)]
        tx.rollback()
    assert got == want


@pytest.mark.parametrize("order", ["column first", "column last"])
def test_a_column_of_whole_payloads_mixed_with_other_puts_writes_put_many_bytes(tmp_path, order):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    filechannel.open(a).close()
    shutil.copytree(a, b)
    events = [(b"x%d" % i, {"k": str(i)} if i % 3 else {}) for i in range(30)]
    col = fmt.PutColumn(b"")
    _, data, offsets, n, _ = staged.payload_chunk([fmt.encode_event(body, h) for body, h in events])
    col.add(data, offsets, n)
    with filechannel.open(a) as ch:
        with ch.transaction() as tx:
            if order == "column first":
                tx.put_column(col, max(map(len, col.payloads())))
                tx.put_many([b"p", b"q"], headers={"z": "1"})
            else:
                tx.put_many([b"p", b"q"])
                tx.put_column(col, max(map(len, col.payloads())))
        with ch.transaction() as tx:  # before the twin's comparison: a take and rollback write records
            got = [(e.body, dict(e.headers)) for e in tx.take_batch(100)]
            tx.rollback()
    with filechannel.open(b) as ch:
        with ch.transaction() as tx:
            if order == "column last":
                tx.put_many([b"p", b"q"])
            for body, h in events:
                tx.put(body, h or None)
            if order == "column first":
                tx.put_many([b"p", b"q"], headers={"z": "1"})
        with ch.transaction() as tx:
            tx.take_batch(100)
            tx.rollback()
    assert _segments(a) == _segments(b)
    mine = got[:30] if order == "column first" else got[2:]
    assert mine == events
