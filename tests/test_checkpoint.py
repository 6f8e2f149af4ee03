"""Checkpoints and fast restart: Flume's restart matrix, ported to our formats.

Every case asserts the exact queue (positions and bodies) after the restart,
and compares it with a full replay of the same directory.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import struct
import threading
import time
from array import array
from pathlib import Path

import pytest
from helpers import contents, put

import filechannel
from filechannel import _fs
from filechannel import checkpoint as ckpt
from filechannel import format as fmt

OPTS = {
    "max_file_size": 4096,
    "minimum_required_space": 0,
    "checkpoint_interval": 0,
    "background": False,
}


def op(d: str, **kw: object) -> filechannel.FileChannel:
    return filechannel.open(d, **{**OPTS, **kw})


def crash(ch: filechannel.FileChannel) -> None:
    """Stop without the checkpoint a clean close writes (the log's bytes stay as they are)."""
    ch._core.closed = True
    ch._ckpt_stop.set()
    ch._log.close()


def take(ch: filechannel.FileChannel, n: int) -> list[bytes]:
    with ch.transaction() as tx:
        return [e.body for e in tx.take_batch(n)]


def full_replay(d: str) -> list[tuple[int, bytes]]:
    with op(d, replay="full") as ch:
        assert ch.stats()["recovery_source"] == "full"
        return contents(ch)


def ckpt_files(d: str) -> list[str]:
    cd = os.path.join(d, "checkpoints")
    return sorted(os.path.join(cd, n) for n in os.listdir(cd) if n.endswith(".ckpt"))


def bodies(a: int, b: int) -> list[bytes]:
    return [b"event-%d" % i for i in range(a, b)]


def test_restart_from_checkpoint_equals_full_replay(chan_dir: str) -> None:
    ch = op(chan_dir)
    for i in range(0, 60, 5):
        put(ch, *bodies(i, i + 5))
    assert take(ch, 7) == bodies(0, 7)
    ch.checkpoint()
    put(ch, *bodies(60, 70))
    assert take(ch, 3) == bodies(7, 10)
    expected = contents(ch)
    crash(ch)
    with op(chan_dir) as ch2:
        st = ch2.stats()
        assert st["recovery_source"] == "checkpoint"
        assert st["checkpoint_fallbacks"] == 0
        assert contents(ch2) == expected
    assert full_replay(chan_dir) == expected
    assert [p for p, _ in expected] == list(range(10, 70))


def test_clean_close_writes_checkpoint_and_restart_reads_no_history(chan_dir: str) -> None:
    ch = op(chan_dir)
    for i in range(0, 200, 10):
        put(ch, *bodies(i, i + 10))
    take(ch, 150)
    ch.close()
    assert ckpt_files(chan_dir)
    with op(chan_dir) as ch2:
        assert ch2.stats()["recovery_source"] == "checkpoint"
        assert contents(ch2) == list(zip(range(150, 200), bodies(150, 200), strict=True))


@pytest.mark.parametrize("which", ["missing", "empty"])
def test_no_checkpoint_means_full_replay(chan_dir: str, which: str) -> None:
    ch = op(chan_dir)
    put(ch, *bodies(0, 20))
    take(ch, 5)
    ch.close()
    for f in ckpt_files(chan_dir):
        if which == "missing":
            os.unlink(f)
        else:
            open(f, "wb").close()
    with op(chan_dir) as ch2:
        assert ch2.stats()["recovery_source"] == "full"
        assert contents(ch2) == list(zip(range(5, 20), bodies(5, 20), strict=True))


def _two_checkpoints(d: str) -> list[tuple[int, bytes]]:
    ch = op(d)
    put(ch, *bodies(0, 30))
    take(ch, 4)
    ch.checkpoint()  # the backup-to-be
    put(ch, *bodies(30, 40))
    take(ch, 6)
    ch.checkpoint()  # the newest
    put(ch, *bodies(40, 45))
    take(ch, 2)
    expected = contents(ch)
    crash(ch)
    assert len(ckpt_files(d)) == 2
    return expected


def _damage(path: str, how: str) -> None:
    data = bytearray(Path(path).read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "header_bitflip":
        data[20] ^= 0x10
    elif how == "body_bitflip":
        data[len(data) - 20] ^= 0x01
    elif how == "high_byte":  # FLUME-1893: corruption of the most significant bytes
        data[0:2] = b"\x01\x05"
    elif how == "wrong_version":
        data[8] = 99
    elif how == "zeroed":
        data = bytearray(len(data))
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "header_bitflip", "body_bitflip", "high_byte", "wrong_version", "zeroed"])
def test_damaged_newest_checkpoint_falls_back_to_backup(
    chan_dir: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = _two_checkpoints(chan_dir)
    newest = ckpt_files(chan_dir)[-1]
    _damage(newest, how)
    with caplog.at_level(logging.WARNING, logger="filechannel"), op(chan_dir) as ch:
        st = ch.stats()
        assert st["recovery_source"] == "backup"
        assert st["checkpoint_fallbacks"] == 1
        assert contents(ch) == expected
    assert any("not usable" in r.getMessage() for r in caplog.records)


def test_missing_newest_checkpoint_uses_backup(chan_dir: str) -> None:
    expected = _two_checkpoints(chan_dir)
    os.unlink(ckpt_files(chan_dir)[-1])
    with op(chan_dir) as ch:
        assert ch.stats()["recovery_source"] == "checkpoint"  # the only one left is the newest now
        assert contents(ch) == expected


def test_both_checkpoints_damaged_means_full_replay(chan_dir: str) -> None:
    expected = _two_checkpoints(chan_dir)
    for f in ckpt_files(chan_dir):
        _damage(f, "body_bitflip")
    with op(chan_dir) as ch:
        st = ch.stats()
        assert st["recovery_source"] == "full"
        assert st["checkpoint_fallbacks"] == 2
        assert contents(ch) == expected


def test_checkpoint_from_another_channel_is_not_trusted(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with op(a) as ch:
        put(ch, b"a")
    with op(b) as ch:
        put(ch, b"b1", b"b2")
    for f in ckpt_files(b):
        os.unlink(f)
    shutil.copy(ckpt_files(a)[0], os.path.join(b, "checkpoints"))
    with op(b) as ch:
        assert ch.stats()["recovery_source"] == "full"
        assert contents(ch) == [(0, b"b1"), (1, b"b2")]


def test_put_transaction_straddling_checkpoint(chan_dir: str) -> None:
    ch = op(chan_dir)
    put(ch, b"before")
    tx = ch.transaction()
    tx.put(b"s1")
    tx.put(b"s2")
    ch.checkpoint()
    tx.put(b"s3")
    tx.commit()
    crash(ch)
    with op(chan_dir) as ch2:
        assert ch2.stats()["recovery_source"] == "checkpoint"
        assert contents(ch2) == [(0, b"before"), (1, b"s1"), (2, b"s2"), (3, b"s3")]


def test_uncommitted_put_at_checkpoint_is_gone_after_crash(chan_dir: str) -> None:
    ch = op(chan_dir)
    put(ch, b"kept")
    tx = ch.transaction()
    tx.put(b"never committed")
    ch.checkpoint()
    crash(ch)
    with op(chan_dir) as ch2:
        assert contents(ch2) == [(0, b"kept")]


def test_take_in_flight_at_checkpoint_never_committed_comes_back(chan_dir: str) -> None:
    ch = op(chan_dir)
    put(ch, *bodies(0, 5))
    t1 = ch.transaction()
    assert [e.body for e in t1.take_batch(2)] == bodies(0, 2)
    t2 = ch.transaction()
    assert [e.body for e in t2.take_batch(3)] == bodies(2, 5)
    ch.checkpoint()
    crash(ch)
    with op(chan_dir) as ch2:
        assert ch2.stats()["recovery_source"] == "checkpoint"
        assert contents(ch2) == list(zip(range(5), bodies(0, 5), strict=True))


def test_take_crossing_checkpoint_committed_after_is_gone(chan_dir: str) -> None:
    ch = op(chan_dir)
    put(ch, *bodies(0, 3))
    tx = ch.transaction()
    assert tx.take().body == b"event-0"
    ch.checkpoint()
    tx.commit()
    crash(ch)
    with op(chan_dir) as ch2:
        assert contents(ch2) == [(1, b"event-1"), (2, b"event-2")]
    assert full_replay(chan_dir) == [(1, b"event-1"), (2, b"event-2")]


def test_files_still_referenced_after_rollback(chan_dir: str) -> None:
    # Flume's testReferenceCounts: 15 events over several small files, 10 taken
    # without commit, a checkpoint, then a rollback: all 15 must remain.
    ch = op(chan_dir, max_file_size=4096)
    for i in range(15):
        put(ch, b"x" * 600 + b"%d" % i)
    assert ch.stats()["files"] > 2
    tx = ch.transaction()
    tx.take_batch(10)
    ch.checkpoint()
    tx.rollback()
    ch.retire_files()
    crash(ch)
    with op(chan_dir) as ch2:
        got = contents(ch2)
        assert [p for p, _ in got] == list(range(15))
        assert got[14][1].endswith(b"14")


def test_retired_files_never_bring_taken_events_back(chan_dir: str) -> None:
    # Takes recorded in files that are later retired must not be forgotten by a
    # replay from an older checkpoint, nor by a full replay.
    ch = op(chan_dir)
    stuck = ch.transaction()
    put(ch, b"stuck")
    assert stuck.take().body == b"stuck"  # a consumer that hangs on to the oldest event
    for i in range(0, 200, 10):
        put(ch, *bodies(i, i + 10))
    ch.checkpoint()  # will be the backup
    assert take(ch, 120) == bodies(0, 120)
    ch.retire_files()
    ch.checkpoint()  # the newest
    assert take(ch, 30) == bodies(120, 150)
    ch.retire_files()
    files_left = ch.stats()["files"]
    crash(ch)
    expected = [(0, b"stuck"), *zip(range(151, 201), bodies(150, 200), strict=True)]
    assert full_replay(chan_dir) == expected
    with op(chan_dir) as ch2:
        assert contents(ch2) == expected
    os.unlink(ckpt_files(chan_dir)[-1])  # lose the newest: restart from the older one
    with op(chan_dir) as ch3:
        assert contents(ch3) == expected
    # The stuck event pinned its own file, not every newer one.
    assert files_left <= 4


def test_drained_channel_keeps_only_the_active_file(chan_dir: str) -> None:
    ch = op(chan_dir)
    for i in range(0, 300, 10):
        put(ch, *bodies(i, i + 10))
    assert ch.stats()["files"] > 3
    while take(ch, 50):
        pass
    ch.retire_files()
    assert ch.stats()["files"] == 1
    ch.close()
    assert len([n for n in os.listdir(os.path.join(chan_dir, "data")) if n.endswith(".wal")]) == 1


def test_replay_full_ignores_checkpoints(chan_dir: str) -> None:
    with op(chan_dir) as ch:
        put(ch, *bodies(0, 10))
        take(ch, 4)
    with op(chan_dir, replay="full") as ch:
        assert ch.stats()["recovery_source"] == "full"
        assert [p for p, _ in contents(ch)] == list(range(4, 10))


def test_backup_checkpoint_dir_gets_every_checkpoint(tmp_path: Path) -> None:
    d, backup = str(tmp_path / "ch"), str(tmp_path / "disk2")
    ch = op(d, backup_checkpoint_dir=backup)
    put(ch, *bodies(0, 10))
    ch.checkpoint()
    take(ch, 2)
    expected = contents(ch)
    ch.close()
    names = sorted(os.listdir(backup))
    assert any(n.endswith(".ckpt") for n in names)
    shutil.rmtree(os.path.join(d, "checkpoints"))
    with op(d, backup_checkpoint_dir=backup) as ch2:
        assert ch2.stats()["recovery_source"] == "checkpoint"
        assert contents(ch2) == expected


def test_checkpoint_is_compact(chan_dir: str) -> None:
    ch = op(chan_dir, max_file_size=1 << 20)
    for i in range(0, 5000, 500):
        put(ch, *bodies(i, i + 500))
    res = ch.checkpoint()
    assert res["events"] == 5000
    assert res["bytes"] < 5000 * 40  # 32 bytes an event plus a small header
    ch.close()


def test_checkpoint_decoder_rejects_every_truncation(chan_dir: str) -> None:
    with op(chan_dir) as ch:
        put(ch, *bodies(0, 5))
        take(ch, 1)
        log = ch._log
        kind, cid = log.crc_kind, log.channel_id
    data = Path(ckpt_files(chan_dir)[-1]).read_bytes()
    snap = ckpt.decode(data, kind, cid)
    assert list(snap.queued_positions()[0]) == [1, 2, 3, 4]
    for n in range(len(data)):
        with pytest.raises(filechannel.FormatError):
            ckpt.decode(data[:n], kind, cid)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(filechannel.FormatError):
            ckpt.decode(bytes(bad), kind, cid)


class _SlowCheckpointFS(_fs.OsFS):
    """Blocks the checkpoint's data write until released, to show puts keep going."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.release = threading.Event()

    def pwrite_all(self, fd: int, data: bytes, offset: int) -> None:
        if data[:8] == ckpt.MAGIC:
            self.writing.set()
            assert self.release.wait(10)
        super().pwrite_all(fd, data, offset)


def test_transactions_continue_while_a_checkpoint_is_written(chan_dir: str) -> None:
    fs = _SlowCheckpointFS()
    ch = filechannel.open(chan_dir, fs=fs, **OPTS)
    put(ch, *bodies(0, 100))
    t = threading.Thread(target=ch.checkpoint)
    t.start()
    assert fs.writing.wait(10)
    # The checkpoint is stuck writing its file; puts, takes and commits still work.
    put(ch, b"during")
    assert take(ch, 3) == bodies(0, 3)
    fs.release.set()
    t.join(10)
    assert not t.is_alive()
    ch.close()


def test_disk_full_puts_fail_but_takes_and_checkpoints_work(chan_dir: str) -> None:
    with op(chan_dir) as ch:
        put(ch, *bodies(0, 10))
    with op(chan_dir, minimum_required_space=1 << 62, keep_alive=0) as ch:
        with pytest.raises(filechannel.DiskSpaceError), ch.transaction() as tx:
            tx.put(b"no room")
        assert take(ch, 4) == bodies(0, 4)
        res = ch.checkpoint()
        assert res["events"] == 6
    with op(chan_dir) as ch:
        assert [p for p, _ in contents(ch)] == list(range(4, 10))


def test_background_checkpoints(chan_dir: str) -> None:
    ch = filechannel.open(chan_dir, max_file_size=4096, minimum_required_space=0, checkpoint_interval=0.05)
    put(ch, b"a")
    for _ in range(200):
        if ch.stats()["checkpoints_written"]:
            break
        threading.Event().wait(0.02)
    assert ch.stats()["checkpoints_written"] >= 1
    ch.close()


def test_bad_checkpoint_options() -> None:
    with pytest.raises(filechannel.ConfigError, match="checkpoint_interval"):
        filechannel.ChannelConfig(checkpoint_interval=-1)
    with pytest.raises(filechannel.ConfigError, match="replay"):
        filechannel.ChannelConfig(replay="fast")
    with pytest.raises(filechannel.ConfigError, match="backup_checkpoint_dir"):
        filechannel.ChannelConfig(backup_checkpoint_dir="")
    for bad in (-0.1, 1, 1.5, "half", None, True):
        with pytest.raises(filechannel.ConfigError, match="checkpoint_spread"):
            filechannel.ChannelConfig(checkpoint_spread=bad)  # type: ignore[arg-type]


_HELD: list[filechannel.Transaction] = []


def _paced_channel(chan_dir: str, monkeypatch: pytest.MonkeyPatch) -> tuple[filechannel.FileChannel, list[float]]:
    """A channel whose background checkpoints would spread over 60 s, in many small flushes.

    The queue is one run (a few bytes of checkpoint); what makes the checkpoint long
    is an open transaction holding 2000 takes, each written as an entry of its own.
    """
    monkeypatch.setattr(ckpt, "CHUNK", 512)
    monkeypatch.setattr(ckpt, "SYNC_EVERY", 512)
    # The background thread waits an hour before its first checkpoint; the tests start one by hand.
    ch = op(chan_dir, checkpoint_interval=3600.0, checkpoint_spread=0.5)
    put(ch, *bodies(0, 2000))
    held = ch.transaction()
    assert len(held.take_batch(2000)) == 2000
    _HELD[:] = [held]  # left open: recovery returns its takes to the queue
    fractions: list[float] = []
    write = ch._store.write

    def recording_write(snap: ckpt.Snapshot, kind: int, pace: object = None, mac: object = None) -> tuple[int, int]:
        def rec(done: float) -> None:
            fractions.append(done)
            assert callable(pace)
            pace(done)

        return write(snap, kind, rec if pace is not None else None, mac)  # type: ignore[arg-type]

    monkeypatch.setattr(ch._store, "write", recording_write)
    return ch, fractions


def _background_checkpoint(ch: filechannel.FileChannel) -> threading.Thread:
    """Start what the checkpoint thread does at the end of an interval."""

    def run() -> None:
        with ch._ckpt_lock:
            ch._write_checkpoint(paced=True)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_background_checkpoint_spreads_its_writes_until_a_checkpoint_call_hurries_it(
    chan_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ch, fractions = _paced_channel(chan_dir, monkeypatch)
    bg = _background_checkpoint(ch)
    bg.join(1.0)
    # 2000 events are ~64 KB: unpaced, that is a few milliseconds; paced, a minute.
    assert bg.is_alive(), "the background checkpoint was not paced"
    assert fractions
    assert fractions[-1] < 0.5
    put(ch, b"during")  # commits go on meanwhile
    t0 = time.monotonic()
    res = ch.checkpoint()  # not paced, and it stops the pacing of the one in progress
    assert time.monotonic() - t0 < 30, "checkpoint() waited for the paced one's spread (60 s)"
    bg.join(10)
    assert not bg.is_alive()
    assert fractions == sorted(fractions)
    assert fractions[-1] > 0.9
    assert res["events"] == 2001
    crash(ch)
    with op(chan_dir) as ch2:
        assert ch2.stats()["recovery_source"] == "checkpoint"
        assert [e for _, e in contents(ch2)] == [*bodies(0, 2000), b"during"]


def test_close_cuts_a_paced_checkpoint_short(chan_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ch, _fractions = _paced_channel(chan_dir, monkeypatch)
    bg = _background_checkpoint(ch)
    bg.join(0.5)
    assert bg.is_alive()
    closer = threading.Thread(target=ch.close)
    closer.start()
    closer.join(10)
    bg.join(10)
    assert not closer.is_alive()
    assert not bg.is_alive()
    with op(chan_dir) as ch2:
        assert ch2.stats()["recovery_source"] == "checkpoint"
        assert [e for _, e in contents(ch2)] == bodies(0, 2000)


def test_explicit_checkpoints_are_never_paced(chan_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ch, fractions = _paced_channel(chan_dir, monkeypatch)
    res = ch.checkpoint()
    assert res["events"] == 2000
    assert fractions == []
    ch.close()


def test_takes_in_a_retired_file_are_relogged(chan_dir: str) -> None:
    # A file that holds TAKE records of events in an older, still-live file is
    # retired: those takes must be written again, or a replay (full, or from an
    # older checkpoint) would bring the taken events back.
    ch = op(chan_dir)
    stuck = ch.transaction()
    put(ch, b"A" * 1000)
    assert stuck.take() is not None  # pins the first file
    put(ch, b"B" * 1000)
    put(ch, b"B" * 1000)  # the first file is full now
    ch.checkpoint()
    put(ch, b"C" * 1000)  # starts the second file
    assert take(ch, 2) == [b"B" * 1000] * 2  # TAKE records in the second file, of events in the first
    for i in range(30):
        put(ch, b"%04d" % i + b"x" * 996)
        assert take(ch, 1)  # the consumer keeps up: TAKE records follow the puts
    ch.retire_files()
    assert ch.stats()["files_retired"] > 3
    assert contents(ch) == [(33, b"0029" + b"x" * 996)]  # A is held by the stuck transaction
    expected = [(0, b"A" * 1000), (33, b"0029" + b"x" * 996)]  # ... and comes back after a crash
    crash(ch)
    assert full_replay(chan_dir) == expected
    for f in ckpt_files(chan_dir)[1:]:
        os.unlink(f)  # only the old checkpoint is left
    with op(chan_dir) as ch2:
        assert contents(ch2) == expected


def test_checkpoint_entries_in_files_retired_later_are_dropped(chan_dir: str) -> None:
    # A checkpoint lists events of file 1; they are taken afterwards, file 1 is
    # retired, and so is file 2 that held the TAKE records. Restarting from that
    # checkpoint must still work (not fall back) and must not resurrect them.
    ch = op(chan_dir)
    for _ in range(3):
        put(ch, b"e" * 1000)
    ch.checkpoint()
    for i in range(12):
        put(ch, b"%03d" % i + b"f" * 997)
        assert take(ch, 1)
    ch.retire_files()
    assert 1 not in ch._log.file_ids()
    expected = contents(ch)
    crash(ch)
    for f in ckpt_files(chan_dir)[1:]:
        os.unlink(f)  # keep only the old checkpoint
    with op(chan_dir) as ch2:
        st = ch2.stats()
        assert st["recovery_source"] == "checkpoint"
        assert st["checkpoint_fallbacks"] == 0
        assert contents(ch2) == expected
    assert full_replay(chan_dir) == expected


@pytest.mark.parametrize("replay", ["full", "checkpoint"])
def test_replay_of_out_of_order_take_commits(chan_dir: str, replay: str) -> None:
    # Consumers commit in another order than they took: replay must still drop
    # exactly the committed takes, whatever the order of the TAKE records.
    ch = op(chan_dir, max_file_size=1 << 20)
    put(ch, *bodies(0, 40))
    if replay == "checkpoint":
        ch.checkpoint()
    t1, t2, t3 = ch.transaction(), ch.transaction(), ch.transaction()
    assert [e.position for e in t1.take_batch(10)] == list(range(10))
    assert [e.position for e in t2.take_batch(10)] == list(range(10, 20))
    assert [e.position for e in t3.take_batch(5)] == list(range(20, 25))
    t3.commit()
    t2.commit()
    t1.rollback()  # 0..9 go back to the head
    put(ch, *bodies(40, 45))
    t4 = ch.transaction()
    assert [e.position for e in t4.take_batch(3)] == [0, 1, 2]
    t4.commit()
    expected = contents(ch)
    assert [p for p, _ in expected] == [*range(3, 10), *range(25, 45)]
    crash(ch)
    with op(chan_dir, replay=replay) as ch2:
        assert contents(ch2) == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interval_retirement_never_loses_a_take_relogged_in_another_data_directory(seed: int) -> None:
    # With fsync="interval" and two data directories, the takes re-logged before a retirement
    # may go to the other directory: they must be durable before the retired file is unlinked,
    # or a power cut right after brings taken events back.
    import random

    from simfs import SimFS

    rnd = random.Random(seed)
    fs = SimFS()
    opts: dict[str, object] = {
        "fs": fs,
        "background": False,
        "minimum_required_space": 0,
        "max_file_size": 4096,
        "fsync": "interval",
        "fsync_interval": 3600,
        "data_dirs": ["/sim/d0", "/sim/d1"],
        "checkpoint_interval": 0,
    }
    ch = filechannel.open("/sim/ch", **opts)
    taken: set[int] = set()
    n = 0
    for step in range(40):
        tx = ch.transaction()
        for _ in range(rnd.randint(0, 3)):
            tx.put(b"%05d" % n + b"x" * 600)
            n += 1
        k = rnd.randint(0, 4)
        taken |= {e.position for e in (tx.take_batch(k) if k else [])}
        tx.commit()
        ch.sync()  # every take so far is durable
        ch.retire_files()
        crashed = fs.crash(seed * 100 + step, "drop")  # a power cut right after the retirement
        with filechannel.open("/sim/ch", **{**opts, "fs": crashed}) as again:
            back = {p for p, _ in contents(again)}
        assert not back & taken, f"step {step}: taken events came back: {sorted(back & taken)}"
    ch.close()


# -- a checkpoint written in blocks from the queue's lent columns (issue 14, round two) ---------


def _reference_encode(s: ckpt.Snapshot, crc_kind: int, version: int = 2) -> bytes:
    """The one-buffer encoder the block encoder replaced (byte layout of docs/format.md).

    ``version=1``: the layout before file table entries carried their data directory.
    """
    head = ckpt._HEAD.pack(
        ckpt.MAGIC,
        version,
        0,
        crc_kind,
        s.channel_id,
        s.woid,
        s.next_position,
        s.next_txn_id,
        s.next_file_id,
        s.created_ns,
        len(s.files),
        len(s.taken),
        len(s.positions),
    )
    if version == 1:
        parts = [head] + [struct.pack("<QQ", f, o) for f, o in sorted(s.files.items())]
    else:
        dirs = s.file_dirs
        parts = [head] + [struct.pack("<QQII", f, o, dirs.get(f, 0xFFFF_FFFF), 0) for f, o in sorted(s.files.items())]
    for f, ranges in sorted(s.taken.items()):
        parts.append(ckpt._TF.pack(f, len(ranges)))
        parts += [ckpt._RANGE.pack(a, c) for a, c in ranges]
    for col in (s.positions, s.file_ids, s.offsets, s.sizes):
        parts += [struct.pack("<q", v) for v in col]
    body = b"".join(parts)
    return body + struct.pack("<I", fmt.crc(crc_kind, body))


def _snap(n: int, seed: int = 0, **kw: object) -> ckpt.Snapshot:
    rnd = random.Random(seed)
    cols = [array("q", sorted(rnd.sample(range(1, 10 * n + 10), n)))]
    # entries that can exist (decode checks them): a record after the header, inside its file's length
    cols.append(array("q", (rnd.choice((1, 2)) for _ in range(n))))
    cols.append(array("q", (8 * rnd.randrange(10, 1 << 36) for _ in range(n))))
    cols.append(array("q", (8 * rnd.randrange(4, 1 << 20) for _ in range(n))))
    return ckpt.Snapshot(
        woid=n + 7,
        next_position=10 * n + 11,
        next_txn_id=5,
        next_file_id=3,
        channel_id=bytes(range(16)),
        created_ns=123,
        files={2: 1 << 40, 1: 1 << 41},
        positions=cols[0],
        file_ids=cols[1],
        offsets=cols[2],
        sizes=cols[3],
        taken={1: [(1, 2), (9, 1)]},
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("kind", [fmt.CRC32_ZLIB, fmt.CRC32C] if fmt.HAVE_CRC32C else [fmt.CRC32_ZLIB])
@pytest.mark.parametrize("n", [0, 1, 7, 5000])
def test_block_encoder_is_byte_identical_to_the_one_buffer_encoder(kind: int, n: int) -> None:
    s = _snap(n, seed=n, file_dirs={2: 1})  # file 1's directory unknown
    want = _reference_encode(s, kind)
    assert ckpt.encode(s, kind) == want
    for block in (1, 8, 100, 4096, 1 << 20):
        blocks = list(ckpt.encode_blocks(s, kind, block))
        assert b"".join(blocks) == want
        # Between the first (head and tables) and the last (checksum): under a block plus one piece.
        assert all(len(b) < 2 * max(block, 8) for b in blocks[1:-1])
        if block <= 100 and n >= 100:
            assert len(blocks) > 10
    back = ckpt.decode(want, kind, s.channel_id)
    assert (back.positions, back.file_ids, back.offsets, back.sizes) == (s.positions, s.file_ids, s.offsets, s.sizes)


def test_snapshot_windows_encode_as_the_concatenated_columns() -> None:
    s = _snap(300, seed=3)
    cols = (s.positions, s.file_ids, s.offsets, s.sizes)
    # The same queue as a 10-entry front and a window [40, 330) of longer arrays (junk outside it).
    front = tuple(c[:10] for c in cols)
    junk = array("q", [-1] * 40)
    big = tuple(junk + c[10:] + array("q", [-2] * 5) for c in cols)
    lent = _snap(0, seed=3, parts=[(0, 10, front), (40, 330, big)])
    lent.woid, lent.next_position = s.woid, s.next_position
    assert len(lent) == 300
    assert ckpt.encode(lent, fmt.CRC32_ZLIB) == ckpt.encode(s, fmt.CRC32_ZLIB)
    bad = _snap(3)
    bad.sizes = array("q", [1])
    with pytest.raises(filechannel.FormatError, match="differ in length"):
        ckpt.encode(bad, fmt.CRC32_ZLIB)


class _CountingFS(_fs.OsFS):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def pwrite_all(self, fd: int, data: bytes, offset: int) -> None:
        self.calls.append(("pwrite_all", len(data)))
        super().pwrite_all(fd, data, offset)

    def fdatasync(self, fd: int) -> None:
        self.calls.append(("fdatasync", 0))
        super().fdatasync(fd)

    def truncate(self, fd: int, size: int) -> None:
        self.calls.append(("truncate", size))
        super().truncate(fd, size)


def test_store_writes_in_blocks_flushes_as_it_goes_and_shrinks_before_unlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt, "CHUNK", 4096)
    monkeypatch.setattr(ckpt, "SYNC_EVERY", 16384)
    monkeypatch.setattr(ckpt, "SHRINK_STEP", 10000)
    fs = _CountingFS()
    store = ckpt.CheckpointStore(fs, str(tmp_path / "ck"))
    snaps = [_snap(2000, seed=i) for i in range(3)]
    for i, s in enumerate(snaps):
        s.woid = 100 + i
    nbytes, copies = store.write(snaps[0], fmt.CRC32_ZLIB)
    assert copies == 1
    want = ckpt.encode(snaps[0], fmt.CRC32_ZLIB)
    assert nbytes == len(want)
    (only,) = store.list()
    assert Path(only.path).read_bytes() == want
    writes = [n for op, n in fs.calls if op == "pwrite_all"]
    assert len(writes) == len(list(ckpt.encode_blocks(snaps[0], fmt.CRC32_ZLIB))) > 10
    assert sum(writes) == len(want)
    assert [op for op, _ in fs.calls].count("fdatasync") == len(want) // 16384
    assert not any(op == "truncate" for op, _ in fs.calls)
    store.write(snaps[1], fmt.CRC32_ZLIB)
    fs.calls.clear()
    store.write(snaps[2], fmt.CRC32_ZLIB)  # prunes the first, shrinking it step by step
    assert [c.woid for c in store.list()] == [102, 101]
    sizes = [n for op, n in fs.calls if op == "truncate"]
    assert sizes == list(range(len(want) - 10000, 0, -10000))
    assert store.load(store.list()[0], fmt.CRC32_ZLIB, snaps[2].channel_id).positions == snaps[2].positions


def test_checkpoint_holds_the_queue_as_it_was_while_commits_and_takes_continue(
    chan_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt, "CHUNK", 64)
    fs = _SlowCheckpointFS()
    ch = filechannel.open(chan_dir, fs=fs, **OPTS)
    put(ch, *bodies(0, 100))
    assert take(ch, 10) == bodies(0, 10)
    frozen = [p for p, _ in contents(ch)]
    t = threading.Thread(target=ch.checkpoint)
    t.start()
    assert fs.writing.wait(10)
    # While the checkpoint is stuck at its first block: the head moves far enough to compact,
    # and new events are appended after the lent window.
    assert take(ch, 70) == bodies(10, 80)
    put(ch, *bodies(100, 130))
    fs.release.set()
    t.join(10)
    assert not t.is_alive()
    newest = ckpt_files(chan_dir)[-1]
    snap = ckpt.decode(Path(newest).read_bytes(), ch._log.crc_kind, ch._log.channel_id)
    assert list(snap.queued_positions()[0]) == frozen
    assert len(ch._queue) == 50
    crash(ch)
    with op(chan_dir) as ch2:
        assert [b for _, b in contents(ch2)] == bodies(80, 130)


# -- the data directory of each checkpointed file (version 2) --------------------------------------


def test_version_1_checkpoints_are_still_read_and_version_2_records_directories() -> None:
    kind = fmt.CRC32_ZLIB
    s = _snap(50, seed=3, file_dirs={1: 0, 2: 1})
    got = ckpt.decode(ckpt.encode(s, kind), kind, s.channel_id)
    assert got.file_dirs == {1: 0, 2: 1}
    assert got.files == s.files
    old = ckpt.decode(_reference_encode(s, kind, version=1), kind, s.channel_id)
    assert old.file_dirs == {}
    assert old.files == s.files
    assert list(old.positions) == list(s.positions)
    assert old.taken == s.taken
    bad = bytearray(_reference_encode(s, kind, version=5))
    with pytest.raises(filechannel.FormatError, match="version 5"):
        ckpt.decode(bytes(bad), kind, s.channel_id)


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_the_deleted_newest_file_of_one_data_directory_is_never_taken_for_retired(tmp_path: Path, policy: str) -> None:
    """Two data directories; the checkpoint vouches for the newest file of one, which is then
    deleted. The other directory's newest file is newer and does not list it (it never could):
    that must not pass for a retirement. Before checkpoints recorded each file's directory,
    the open succeeded without these events and without a word."""
    d = str(tmp_path / "ch")
    dirs = [str(tmp_path / "disk0"), str(tmp_path / "disk1")]
    opts = {**OPTS, "data_dirs": dirs, "max_file_size": 8192}
    with op(d, **opts) as ch:
        i = 0
        while True:
            with ch.transaction() as tx:
                for _ in range(3):
                    tx.put(b"event-%05d" % i + b"." * 200)
                    i += 1
            newest = {k: w.file_id for k, w in enumerate(ch._log._writers)}
            older = min(newest, key=lambda k: newest[k])
            # Stop once the directory whose newest file is the older one holds events in it.
            if i > 120 and any(e[1] == newest[older] for e in ch._queue):
                break
        victim = newest[older]
        lost = sorted(p for p, f, _o, _s in ch._queue if f == victim)
        before = contents(ch)
        path = ch._log.file_path(victim)
    assert lost
    assert os.path.dirname(path) == dirs[older]
    os.unlink(path)
    if policy == "fail":
        with pytest.raises(filechannel.CorruptLogError, match="missing") as ei:
            op(d, **opts)
        assert ei.value.path == path
        return
    with op(d, **{**opts, "on_corruption": "skip"}) as ch2:
        st = ch2.stats()
        assert [p for p, _ in contents(ch2)] == [p for p, _ in before if p not in set(lost)]
        assert st["lost_positions"] == [[a, b] for a, b in _ranges(lost)]


def _ranges(ps: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in ps:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def test_short_lived_opens_that_only_take_leave_no_take_only_files_behind(tmp_path: Path) -> None:
    """Open, take 10, commit, close, 30 times, on a channel whose head file still holds events.

    Each open writes its takes into a new data file that holds no event (only TAKE
    records), so no take ever frees a file and no background checkpoint runs in such
    a short life: the files piled up (31 of them) until a later ``retire_files()``
    removed 29 at once. They must retire as the channel closes.
    """
    d = str(tmp_path / "ch")
    opts = {"minimum_required_space": 0}
    with filechannel.open(d, **opts) as ch, ch.transaction() as tx:
        tx.put_many([b"e%d" % i for i in range(400)])
    for _ in range(30):
        with filechannel.open(d, **opts) as ch, ch.transaction() as tx:
            assert len(tx.take_batch(10)) == 10
    data = [f for f in os.listdir(os.path.join(d, "data")) if f.startswith("seg-")]
    assert len(data) <= 3, sorted(data)
    with filechannel.open(d, **opts) as ch:
        assert ch.retire_files() == 0
        with ch.transaction() as tx:
            evs = tx.take_batch(100)
            tx.rollback()
    assert [(e.body, e.position) for e in evs] == [(b"e%d" % i, i) for i in range(300, 400)]
    shutil.rmtree(os.path.join(d, "checkpoints"))
    with filechannel.open(d, replay="full", **opts) as ch:
        assert ch.size == 100
