"""Transaction marks: key -> value pairs committed atomically with a transaction's events.

The crash-point harness (tests/test_crash_points.py, ``w_marks`` and the
concurrent workload) proves the atomicity at every persistence point; these
tests cover the API, the record and checkpoint encodings, retirement across
many files and restarts, a checkpoint followed by replay, damage in skip mode,
the order of re-logged copies, and that a batch tag covers a MARK record.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from helpers import NO_ACCELERATOR, data_files, records

import filechannel
from filechannel import checkpoint as ckpt
from filechannel import format as fmt
from filechannel.errors import FormatError, InvalidEventError, TransactionCapacityError, TransactionStateError

OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}


def drop_checkpoints(d: str) -> None:
    shutil.rmtree(os.path.join(d, "checkpoints"), ignore_errors=True)


# -- the API -----------------------------------------------------------------------------


def test_marks_commit_with_the_transaction_and_survive_a_reopen(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert ch.marks() == {}
        assert ch.mark("producer:a") is None
        with ch.transaction() as tx:
            tx.put(b"e1")
            tx.mark("producer:a", b"1")
            tx.mark("producer:a", b"2")  # the last value in a transaction wins
            assert ch.mark("producer:a") is None  # not before the commit
        assert ch.mark("producer:a") == b"2"
        tx = ch.transaction()
        tx.put(b"e2")
        tx.mark("producer:a", b"3")
        tx.rollback()
        assert ch.marks() == {"producer:a": b"2"}
        with ch.transaction() as tx:  # marks alone, a bytearray value, an empty value
            tx.mark("tail:/var/log/x.log", bytearray(b"\x00\x01"))
            tx.mark("empty", b"")
        with pytest.raises(TransactionStateError):
            tx.mark("late", b"x")
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert ch.marks() == {"producer:a": b"2", "tail:/var/log/x.log": b"\x00\x01", "empty": b""}
        assert len(ch) == 1
    drop_checkpoints(chan_dir)
    with filechannel.open(chan_dir, **OPTS) as ch:  # a full replay of the log says the same
        assert ch.recovery_source == "full"
        assert ch.marks() == {"producer:a": b"2", "tail:/var/log/x.log": b"\x00\x01", "empty": b""}


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        (b"k", b"v", TypeError),
        ("k", "v", TypeError),
        ("", b"v", InvalidEventError),
        ("k" * 129, b"v", InvalidEventError),
        ("\u00e9" * 65, b"v", InvalidEventError),  # 130 bytes of UTF-8
        ("a\nb", b"v", InvalidEventError),
        ("\ud800", b"v", InvalidEventError),
        ("k", b"v" * 1025, InvalidEventError),
    ],
)
def test_bad_marks_are_refused_and_the_transaction_stays_usable(
    chan_dir: str, key: Any, value: Any, error: type[Exception]
) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            with pytest.raises(error):
                tx.mark(key, value)
            tx.mark("k" * 128, b"v" * 1024)  # the bounds themselves are fine
        assert ch.marks() == {"k" * 128: b"v" * 1024}


def test_mark_counts_are_bounded(chan_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            for i in range(fmt.MAX_MARKS_PER_RECORD):
                tx.mark(f"k{i}", b"")
            tx.mark("k0", b"again")  # a key already in the transaction is no new one
            with pytest.raises(TransactionCapacityError, match="in one transaction"):
                tx.mark("one-more", b"")
        assert len(ch.marks()) == fmt.MAX_MARKS_PER_RECORD
        monkeypatch.setattr(filechannel.channelstate, "MAX_MARKS", fmt.MAX_MARKS_PER_RECORD + 1)
        with ch.transaction() as tx:
            tx.mark("k1", b"known keys are fine")
            tx.mark("new", b"")
            with pytest.raises(TransactionCapacityError, match="mark keys"):
                tx.mark("newer", b"")
        assert len(ch.marks()) == fmt.MAX_MARKS_PER_RECORD + 1


# -- the record -----------------------------------------------------------------------------


def test_mark_payload_round_trips_and_bad_ones_are_refused() -> None:
    marks = [fmt.Mark("producer:a", b"17"), fmt.Mark("t\u00e9", b"\x00" * 1024, 99)]
    p = fmt.encode_marks(marks)
    assert p[:8] == struct.pack("<II", 2, 0)
    assert p[8:20] == struct.pack("<QHH", 0, 10, 2)
    assert fmt.decode_marks(p) == marks
    assert len(fmt.encode_marks([fmt.Mark("k" * 128, b"v" * 1024)] * 64)) == fmt.MARK_MAX_PAYLOAD
    assert len(fmt.encode_marks([fmt.Mark("k", b"")])) == fmt.MARK_MIN_PAYLOAD
    with pytest.raises(ValueError):
        fmt.encode_marks([])
    with pytest.raises(ValueError):
        fmt.encode_marks([fmt.Mark("k", b"")] * 65)
    bad = {
        "count 0": struct.pack("<II", 0, 0) + p[8:],
        "count too high": struct.pack("<II", 3, 0) + p[8:],
        "reserved": struct.pack("<II", 2, 1) + p[8:],
        "key length 0": p[:8] + struct.pack("<QHH", 0, 0, 2) + p[20:],
        "value past the end": p[:8] + struct.pack("<QHH", 0, 10, 2000) + p[20:],
        "trailing bytes": p + b"\0",
        "truncated": p[:-1],
        "bad UTF-8": p[:20] + b"\xff" + p[21:],
        "too short": p[:20],
    }
    for b in bad.values():
        with pytest.raises(FormatError):
            fmt.decode_marks(b)


@pytest.mark.parametrize("accel", [False, True])
def test_a_mark_frame_of_a_length_out_of_bounds_is_refused_before_its_checksum(accel: bool) -> None:
    """Both paths (the C scan's frame check and format.decode_record) refuse the same lengths."""
    from filechannel import scan

    if accel and fmt.speedups is None:
        pytest.skip(NO_ACCELERATOR)
    seed, kind = 5, fmt.CRC32C
    saved = fmt.speedups
    fmt.speedups = saved if accel else None
    try:
        for n in (fmt.MARK_MIN_PAYLOAD - 1, fmt.MARK_MAX_PAYLOAD + 1):
            frame = fmt.encode_record(fmt.MARK, 1, 1, b"\0" * n, seed, kind)
            with pytest.raises(FormatError, match=f"mark payload length {n} is not between"):
                fmt.decode_record(frame, 0, seed, kind, 1 << 30)
            out = fmt.decode_puts(frame, [0], [len(frame)], seed, kind, 1 << 30, decode=False)
            assert isinstance(out[0], FormatError)
            assert f"mark payload length {n} is not between" in str(out[0])
        good = fmt.encode_record(fmt.MARK, 1, 1, fmt.encode_marks([fmt.Mark("k", b"v")]), seed, kind)
        rec = fmt.decode_record(good, 0, seed, kind, 1 << 30)
        assert isinstance(rec, fmt.Record)
        assert rec.op == fmt.MARK
        assert scan._frame_cost(good, 0, len(good)) == len(good)
    finally:
        fmt.speedups = saved


def test_mark_records_come_first_in_their_transaction(chan_dir: str) -> None:
    """MARK, then PUTs, then TAKE, then COMMIT: salvage still places PUTs by woid back from the COMMIT."""
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"a")
        with ch.transaction() as tx:
            tx.put(b"b")
            tx.take()
            tx.mark("m", b"1")
    ops = [r.op for r in records(data_files(chan_dir)[-1])]
    assert ops[:8] == [
        fmt.PUT,
        fmt.COMMIT,
        fmt.BATCH_END,
        fmt.MARK,
        fmt.PUT,
        fmt.TAKE,
        fmt.COMMIT,
        fmt.BATCH_END,
    ]


# -- checkpoints -------------------------------------------------------------------------


def test_checkpoint_marks_table_round_trips_and_a_channel_without_marks_writes_version_2() -> None:
    cid = bytes(range(16))
    s = ckpt.Snapshot(9, 3, 4, 5, cid, 0, {1: 88})
    plain = ckpt.encode(s, fmt.CRC32C)
    assert struct.unpack_from("<H", plain, 8)[0] == ckpt.VERSION == 2
    s.marks = [("producer:a", b"7", 8, 1), ("tail:x", b"", 3, 1)]
    data = ckpt.encode(s, fmt.CRC32C)
    assert struct.unpack_from("<H", data, 8)[0] == ckpt.MARKS_VERSION == 3
    got = ckpt.decode(data, fmt.CRC32C, cid)
    assert got.marks == s.marks
    assert got.files == {1: 88}
    # Damage inside the marks table with a good checksum is refused, not misread.
    bad = bytearray(data)
    struct.pack_into("<I", bad, 88 + 24, 5000)  # the mark count
    body = bytes(bad[:-4])
    bad[-4:] = struct.pack("<I", fmt.crc(fmt.CRC32C, body))
    with pytest.raises(FormatError):
        ckpt.decode(bytes(bad), fmt.CRC32C, cid)


def test_marks_written_before_a_checkpoint_come_from_it(chan_dir: str) -> None:
    """Recovery from a checkpoint does not read the records before its resume offsets: the marks must be in it."""
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"x")
            tx.mark("producer:a", b"5")
        ch.checkpoint()
        with ch.transaction() as tx:
            tx.put(b"y")
            tx.mark("producer:b", b"1")
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert ch.recovery_source == "checkpoint"
        assert ch.marks() == {"producer:a": b"5", "producer:b": b"1"}


# -- retirement ----------------------------------------------------------------------------


@pytest.mark.parametrize("encrypted", [False, True])
def test_marks_survive_retirement_across_many_files_checkpoints_and_restarts(chan_dir: str, encrypted: bool) -> None:
    """Producers mark in every transaction; consumers take everything; files roll and retire all the time.

    A mark last set long ago (``producer:rare``) lives only in re-logged copies once its
    file retires; every reopen (from a checkpoint, or a full replay) must still find it.
    """
    opts = dict(OPTS, max_file_size=4096)
    if encrypted:
        pytest.importorskip("cryptography")
        opts["encryption"] = filechannel.Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
    rng = random.Random(7)
    model: dict[str, bytes] = {}
    retired = 0
    ch = filechannel.open(chan_dir, **opts)
    with ch.transaction() as tx:
        tx.put(b"r" * 500)
        tx.mark("producer:rare", b"set once")
    model["producer:rare"] = b"set once"
    try:
        for i in range(120):
            with ch.transaction() as tx:
                tx.put(os.urandom(rng.randint(100, 900)))
                key = f"producer:{rng.randint(0, 9)}"
                tx.mark(key, b"%d" % i)
            model[key] = b"%d" % i
            with ch.transaction() as tx:
                tx.take_batch(rng.randint(1, 3))
            assert ch.marks() == model
            if i % 17 == 16:
                if rng.random() < 0.5:
                    ch.checkpoint()
                retired += ch.stats()["files_retired"]
                ch.close()
                if rng.random() < 0.5:
                    drop_checkpoints(chan_dir)
                ch = filechannel.open(chan_dir, **opts)
                assert ch.marks() == model
        retired += ch.stats()["files_retired"]
    finally:
        ch.close()
    assert retired >= 10  # the marks really moved across many retirements
    assert len(data_files(chan_dir)) <= 4
    for replay in ("checkpoint", "full"):
        if replay == "full":
            drop_checkpoints(chan_dir)
        with filechannel.open(chan_dir, **opts) as ch:
            assert ch.marks() == model


def test_a_stale_re_logged_copy_never_overrides_a_newer_mark(chan_dir: str) -> None:
    """A re-log carries the woid of its original: a newer commit of the key wins in memory and at replay."""
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.mark("k", b"old")
        old_woid = ch._marks["k"][1]
        with ch.transaction() as tx:
            tx.mark("k", b"new")
        # A re-log of the old value that reaches the log after the newer commit (a retirement racing it).
        ch._relog_marks([fmt.Mark("k", b"old", old_woid)])
        assert ch.marks() == {"k": b"new"}
    drop_checkpoints(chan_dir)
    with filechannel.open(chan_dir, **OPTS) as ch:
        assert ch.marks() == {"k": b"new"}


# -- damage and authentication ---------------------------------------------------------------


def test_a_mark_whose_commit_is_damaged_does_not_count_in_skip_mode(chan_dir: str) -> None:
    with filechannel.open(chan_dir, **OPTS) as ch:
        with ch.transaction() as tx:
            tx.put(b"first")
            tx.mark("producer:a", b"1")
        with ch.transaction() as tx:
            tx.put(b"second")
            tx.mark("producer:a", b"2")
        with ch.transaction() as tx:
            tx.put(b"third")
    drop_checkpoints(chan_dir)
    path = data_files(chan_dir)[-1]
    commits = [r for r in records(path) if r.op == fmt.COMMIT]
    buf = bytearray(Path(path).read_bytes())
    buf[commits[1].offset + 33] ^= 0xFF  # the second transaction's COMMIT payload: its crc fails
    Path(path).write_bytes(bytes(buf))
    with filechannel.open(chan_dir, **OPTS, on_corruption="skip") as ch:
        assert ch.marks() == {"producer:a": b"1"}  # its MARK record is intact, but its COMMIT is not
        tx = ch.transaction()
        assert [e.body for e in tx.take_batch(10)] == [b"first", b"third"]
        tx.rollback()


def _forge_mark_value(path: str, new_value: bytes) -> None:
    """Change a MARK's value (a sealed one's: one bit) and fix every checksum (record, batch): only a tag can tell."""
    buf = bytearray(Path(path).read_bytes())
    h = fmt.decode_file_header(bytes(buf))
    assert isinstance(h, fmt.FileHeader)
    seed, kind = fmt.file_seed(h.crc_kind, h.channel_id, h.file_id), h.crc_kind
    recs = records(path)
    i = next(i for i, r in enumerate(recs) if r.op == fmt.MARK)
    m = recs[i]
    if m.sealed:  # an encrypted file's: without the key its value cannot even be read; a flipped bit
        payload = m.payload[:-1] + bytes([m.payload[-1] ^ 1])
    else:
        (mark,) = fmt.decode_marks(m.payload)
        payload = fmt.encode_marks([fmt.Mark(mark.key, new_value, mark.woid)])
    assert len(payload) == len(m.payload)
    head = fmt.record_head(fmt.MARK, fmt.FLAG_SEALED if m.sealed else 0, len(payload), m.woid, m.txn_id)
    crc = fmt.crc(kind, payload, fmt.crc(kind, head, seed))
    buf[m.offset : m.end] = head + struct.pack("<II", crc, 0) + payload + bytes(-len(payload) & 7)
    be = next(r for r in recs[i:] if r.op == fmt.BATCH_END)
    b = fmt.decode_batch_end(be.payload)
    fixed = struct.pack(
        "<QIIQQ",
        b.batch_start,
        b.batch_len,
        fmt.crc(kind, bytes(buf[b.batch_start : b.batch_start + b.batch_len]), seed),
        b.first_woid,
        b.last_woid,
    )
    buf[be.offset : be.end] = fmt.encode_record(fmt.BATCH_END, be.woid, 0, fixed + b.tag, seed, kind)
    Path(path).write_bytes(bytes(buf))


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_batch_tag_covers_mark_records(chan_dir: str, encrypted: bool) -> None:
    """An edited MARK with every checksum fixed: a plaintext channel cannot tell; an encrypted one refuses it."""
    opts = dict(OPTS)
    if encrypted:
        pytest.importorskip("cryptography")
        opts["encryption"] = filechannel.Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
    with filechannel.open(chan_dir, **opts) as ch, ch.transaction() as tx:
        tx.put(b"event")
        tx.mark("producer:a", b"0007")
    drop_checkpoints(chan_dir)
    _forge_mark_value(data_files(chan_dir)[-1], b"9999")
    if not encrypted:
        with filechannel.open(chan_dir, **opts) as ch:  # the forgery is well formed: only a tag catches it
            assert ch.marks() == {"producer:a": b"9999"}
        return
    with pytest.raises(filechannel.CorruptLogError, match="batch authentication failed"):
        filechannel.open(chan_dir, **opts)
    with filechannel.open(chan_dir, **opts, on_corruption="skip") as ch:
        assert ch.marks() == {}  # the forged batch is dropped and reported, never applied
        assert ch.stats()["corruptions_skipped"] >= 1
