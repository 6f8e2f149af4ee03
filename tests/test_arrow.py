"""The public Arrow API: ChannelReader.read_arrow, read_segment_arrow and Transaction.put_arrow.

Smoke tests of each function against the per-event API it mirrors (``read()``,
``read_segment``, ``put``/``take``), on plaintext and encrypted channels, with
damage under both ``on_corruption`` policies, and the promise that
``import filechannel`` does not import pyarrow. The C and pure paths are held
to each other in ``test_arrow_twins.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import filechannel
from filechannel import arrow
from filechannel.crypto import Encryption
from filechannel.errors import CorruptLogError, EventTooLargeError, InvalidEventError
from filechannel.reader import ChannelReader, read_segment

OPTS: dict[str, Any] = {"checkpoint_interval": 0, "minimum_required_space": 0}
MAP = pa.map_(pa.string(), pa.string())


def fill(d: Path, **kw: Any) -> None:
    with filechannel.open(d, max_file_size=4096, **OPTS, **kw) as ch:  # several data files
        for t in range(6):
            with ch.transaction() as tx:
                tx.put_many([b"plain-%d-%d " % (t, i) * 20 for i in range(5)])
                tx.put(b"with headers %d" % t, {"k": str(t), "u": "\u00e9\u4e2d"})
                tx.put(b"")
        with ch.transaction() as tx:  # some taken: read_arrow starts after them
            tx.take_batch(3)


def test_import_filechannel_does_not_import_pyarrow() -> None:
    code = "import sys, filechannel, filechannel.reader, filechannel.channel; print('pyarrow' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_read_arrow_is_read_as_arrow(tmp_path: Path) -> None:
    fill(tmp_path / "ch")
    with ChannelReader(tmp_path / "ch") as r:
        start, end = r.available()
        got = r.read_arrow(start, end)
        assert got.schema == arrow.schema()
        assert got.num_rows == end - start == 39
        assert got.equals(arrow.events_to_batch(r.read(start, end)))
        assert r.read_arrow(start + 5, start + 9).equals(arrow.events_to_batch(r.read(start + 5, start + 9)))
        assert r.read_arrow(end, end).num_rows == 0
        assert got.column("headers")[2].as_py() == [("k", "0"), ("u", "\u00e9\u4e2d")]


def test_read_segment_arrow_of_an_encrypted_channel(tmp_path: Path) -> None:
    enc = Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
    fill(tmp_path / "ch", encryption=enc)
    with ChannelReader(tmp_path / "ch", encryption=enc) as r:
        start, end = r.available()
        segs = r.segments(start, end, 1 << 20)
        assert r.read_arrow(start, end).equals(arrow.events_to_batch(r.read(start, end)))
    for seg in segs:
        want = arrow.events_to_batch(read_segment(seg, encryption=enc))
        assert arrow.read_segment_arrow(seg, enc).equals(want)
        assert ChannelReader.read_segment_arrow(seg, enc).equals(want)


def test_read_arrow_of_damage_follows_on_corruption(tmp_path: Path) -> None:
    d = tmp_path / "ch"
    fill(d)
    with ChannelReader(d) as r:
        start, end = r.available()
        segs = r.segments(start, end, 1 << 20)
        assert len(segs) > 1  # several data files
        seg = segs[1]
    with open(seg.path, "r+b") as fh:  # one body byte of the segment's second event
        fh.seek(seg.offset + seg.offsets[1] + 40)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x20]))
    with ChannelReader(d) as r:
        with pytest.raises(CorruptLogError) as arrow_err:
            r.read_arrow(start, end)
        with pytest.raises(CorruptLogError) as read_err:
            r.read(start, end)
        assert str(arrow_err.value) == str(read_err.value)
    with ChannelReader(d, on_corruption="skip") as r:
        got = r.read_arrow(start, end)
        assert got.num_rows == end - start - 1
        assert seg.positions[1] not in got.column("position").to_pylist()
        assert [c.lost_positions for c in r.corruption] == [[(seg.positions[1], seg.positions[1] + 1)]]
        assert got.equals(arrow.events_to_batch(r.read(start, end)))


def taken(d: Path) -> list[tuple[bytes, dict[str, str]]]:
    with filechannel.open(d, **OPTS) as ch, ch.transaction() as tx:
        return [(ev.body, dict(ev.headers)) for ev in tx.take_batch(1000)]


def test_put_arrow_puts_each_row(tmp_path: Path) -> None:
    d = tmp_path / "ch"
    batch = pa.record_batch(
        {
            "body": pa.array([b"a", b"", b"ccc", b"d"]),
            "headers": pa.array([[("x", "1"), ("x", "2"), ("y", "\u00e9")], None, [], [("k", "v")]], type=MAP),
        }
    )
    with filechannel.open(d, **OPTS) as ch:
        with ch.transaction() as tx:
            assert tx.put_arrow(batch) == 4
            assert tx.put_arrow(pa.array([b"p1", b"p2"])) == 2
            assert tx.put_arrow(pa.chunked_array([[b"c1"], [b"c2"]], type=pa.large_binary())) == 2
            assert tx.put_arrow(pa.table({"body": pa.array(["text"])})) == 1
        with ch.transaction() as tx:  # and from the cache, the same events
            from_cache = [(ev.body, dict(ev.headers)) for ev in tx.take_batch(100)]
            tx.rollback()
    want = [
        (b"a", {"x": "2", "y": "\u00e9"}),
        (b"", {}),
        (b"ccc", {}),
        (b"d", {"k": "v"}),
        (b"p1", {}),
        (b"p2", {}),
        (b"c1", {}),
        (b"c2", {}),
        (b"text", {}),
    ]
    assert from_cache == want
    assert taken(d) == want


def test_put_arrow_round_trip_between_channels(tmp_path: Path) -> None:
    fill(tmp_path / "a")
    with ChannelReader(tmp_path / "a") as r:
        start, end = r.available()
        batch = r.read_arrow(start, end)
    with filechannel.open(tmp_path / "b", **OPTS) as ch, ch.transaction() as tx:
        tx.put_arrow(batch.slice(2))  # a sliced batch, its position column ignored
    with ChannelReader(tmp_path / "b") as r:
        s, e = r.available()
        again = r.read_arrow(s, e)
    assert again.column("body").equals(batch.column("body").slice(2))
    assert again.column("headers").equals(batch.column("headers").slice(2))


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (pa.record_batch({"body": pa.array([b"a", None])}), InvalidEventError),
        (pa.record_batch({"payload": pa.array([b"a"])}), InvalidEventError),
        (pa.record_batch({"body": pa.array([b"a"]), "other": pa.array([1])}), InvalidEventError),
        (pa.record_batch({"body": pa.array([1, 2])}), TypeError),
        (
            pa.record_batch({"body": pa.array([b"a"]), "headers": pa.array([[("k", None)]], type=MAP)}),
            InvalidEventError,
        ),
        (pa.record_batch({"body": pa.array([b"a"]), "headers": pa.array([1])}), TypeError),
        ([b"not arrow"], TypeError),
        (pa.array([b"x" * 2000]), EventTooLargeError),
    ],
)
def test_put_arrow_refuses_bad_rows_and_puts_nothing(tmp_path: Path, data: object, error: type) -> None:
    d = tmp_path / "ch"
    with filechannel.open(d, max_event_size=1024, **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"kept")
        with pytest.raises(error):
            tx.put_arrow(data)
    assert taken(d) == [(b"kept", {})]


def test_put_arrow_refuses_header_text_that_is_not_utf8(tmp_path: Path) -> None:
    bad = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(b"\0\0\0\0\2\0\0\0"), pa.py_buffer(b"\xff\xfe")])
    good = pa.array(["v"])
    headers = pa.MapArray.from_arrays(pa.array([0, 1], type=pa.int32()), bad, good, type=MAP)
    with (
        filechannel.open(tmp_path / "ch", **OPTS) as ch,
        ch.transaction() as tx,
        pytest.raises(InvalidEventError, match="row 0: a header key is not valid UTF-8"),
    ):
        tx.put_arrow(pa.record_batch({"body": pa.array([b"b"]), "headers": headers}))


def test_quick_arrow_bench_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import arrow as bench_arrow

    assert bench_arrow.main(["--n", "3000", "--puts", "500", "--repeats", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    systems = {r["system"] for r in rows if r.get("metric") == "ratio"}
    assert systems == {
        "read_arrow / read + arrays",
        "read_arrow pure-python / read + arrays",
        "put_arrow / put_many",
        "put_arrow / to_pylist + put_many",
    }
    assert all(r["repeats"] == 2 and r["min"] <= r["median"] <= r["max"] for r in rows if "metric" in r)
    workloads = {r["workload"] for r in rows if "workload" in r}
    assert workloads == {"read", "put, one transaction", "take after put", "put, steady state"}
    assert [r["type"] for r in rows if "type" in r] == ["target", "target", "target", "run"]
