"""The API behaves the same way everywhere (issue 27): bad values and types, limits, errors that name the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import filechannel
from filechannel.errors import AckRangeError, RecordTooLargeError
from filechannel.reader import read_segment
from filechannel.wal import RecordHandle

OPTS = {"minimum_required_space": 0}


def test_take_batch_over_transaction_capacity_is_refused_like_put_many(tmp_path: Path) -> None:
    with filechannel.open(tmp_path / "ch", capacity=100, transaction_capacity=5, **OPTS) as ch:
        with ch.transaction() as tx:
            with pytest.raises(filechannel.TransactionCapacityError):
                tx.put_many([b"x"] * 6)
            tx.put_many([b"x"] * 5)
        with ch.transaction() as tx:
            with pytest.raises(filechannel.TransactionCapacityError, match="take at most 5"):
                tx.take_batch(10)
            assert ch.size == 5  # nothing was taken
            assert len(tx.take_batch(3)) == 3
            with pytest.raises(filechannel.TransactionCapacityError, match="holds 3 takes already"):
                tx.take_batch(3)
            assert len(tx.take_batch(2)) == 2


def test_len_is_the_queue_size(tmp_path: Path) -> None:
    with filechannel.open(tmp_path / "ch", **OPTS) as ch:
        assert len(ch) == 0
        assert ch  # an empty channel is still a channel (no "if ch:" surprise)
        with ch.transaction() as tx:
            tx.put_many([b"a", b"b", b"c"])
        tx = ch.transaction()
        tx.take()
        assert len(ch) == ch.stats()["queue_size"] == ch.size == 2
        tx.rollback()
        assert len(ch) == 3


@pytest.fixture
def reader(tmp_path: Path) -> filechannel.ChannelReader:
    d = tmp_path / "ch"
    with filechannel.open(d, **OPTS) as ch, ch.transaction() as tx:
        tx.put_many([b"a", b"b", b"c"])
    return filechannel.ChannelReader(str(d), consumer="q")


def test_ack_refuses_bad_values_with_specific_errors(reader: filechannel.ChannelReader) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        reader.ack(-1)
    with pytest.raises(TypeError, match="int"):
        reader.ack("3")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        reader.ack(2.0)  # type: ignore[arg-type]
    with pytest.raises(AckRangeError) as info:
        reader.ack(4)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, filechannel.ChannelError)
    assert (info.value.end, info.value.committed) == (4, 3)
    assert reader.acked == 0  # nothing acknowledged by any of them
    assert reader.ack(3) == 3


def test_read_and_read_segment_refuse_wrong_types(reader: filechannel.ChannelReader) -> None:
    with pytest.raises(TypeError, match="start must be an int"):
        reader.read(0.0, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="limit"):
        reader.read(0, 1, limit=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reader.read(0, 1, limit=0)
    with pytest.raises(TypeError, match="Segment"):
        read_segment("x")  # type: ignore[arg-type]
    assert [e.body for e in reader.read(0, 3)] == [b"a", b"b", b"c"]


def test_a_bogus_wal_handle_is_invalid_not_corrupt(tmp_path: Path) -> None:
    with filechannel.WriteAheadLog(str(tmp_path / "wal")) as w:
        h = w.write(b"one")
        h2 = w.write(b"two")
        past_end = RecordHandle(h.log_id, h.file_id, h2.offset + (1 << 20), h.length, h.woid, h.time)
        wrong_woid = RecordHandle(h.log_id, h.file_id, h.offset, h.length, h.woid + 7, h.time)
        for bad in (past_end, wrong_woid):
            with pytest.raises(filechannel.InvalidHandleError) as info:
                w.read(bad)
            assert not isinstance(info.value, filechannel.CorruptLogError)
            assert "salvage" not in str(info.value)
            assert "on_corruption" not in str(info.value)
        assert w.read(h2) == b"two"


def test_wal_errors_speak_of_the_wal(tmp_path: Path) -> None:
    d = str(tmp_path / "wal")
    with filechannel.WriteAheadLog(d, max_file_size=1 << 16) as w:
        with pytest.raises(RecordTooLargeError, match="max_file_size") as info:
            w.write(b"x" * (1 << 17))
        assert isinstance(info.value, filechannel.EventTooLargeError)
        assert "max_event_size" not in str(info.value)
        w.write(b"kept")
        w.write(b"and this")
    seg = sorted((Path(d) / "data").glob("seg-*.wal"))[0]
    b = bytearray(seg.read_bytes())
    b[-40] ^= 0xFF  # inside the last record, acknowledged (a checkpoint vouches for the file)
    seg.write_bytes(bytes(b))
    with pytest.raises(filechannel.CorruptLogError) as err:
        filechannel.WriteAheadLog(d, max_file_size=1 << 16)
    msg = str(err.value)
    assert "filechannel wal verify" in msg
    assert "`filechannel verify" not in msg
    assert "position" not in err.value.hint


def test_a_channel_is_not_a_write_ahead_log(tmp_path: Path) -> None:
    filechannel.open(tmp_path / "ch", **OPTS).close()
    with pytest.raises(filechannel.NotAChannelError, match=r"is not a write-ahead log: it is a channel"):
        filechannel.WriteAheadLog(str(tmp_path / "ch"))


def test_a_mistyped_option_gets_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(filechannel.ConfigError, match="did you mean capacity="):
        filechannel.open(tmp_path / "ch", capacty=5)
    assert not os.path.exists(tmp_path / "ch")


def test_already_open_names_the_holder_and_a_refused_open_leaves_no_lock(tmp_path: Path) -> None:
    d = tmp_path / "ch"
    with filechannel.open(d, **OPTS):
        with pytest.raises(filechannel.ChannelLockedError, match=f"this process, pid {os.getpid()}, since 20") as info:
            filechannel.open(d, **OPTS)
        assert info.value.holder is not None
    assert (d / "LOCK").read_bytes() == b""  # cleared on close: never a stale holder
    junk = tmp_path / "junk"
    junk.mkdir(mode=0o700)
    (junk / "notes.txt").write_text("hi")
    for opener in (lambda: filechannel.open(junk, **OPTS), lambda: filechannel.WriteAheadLog(str(junk))):
        with pytest.raises(filechannel.NotAChannelError):
            opener()
        assert os.listdir(junk) == ["notes.txt"]
