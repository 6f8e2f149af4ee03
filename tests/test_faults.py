"""I/O errors injected through SimFS: fsyncgate, failed and short writes, ENOSPC.

Expected behaviour (README, docs/design.md):

* a failed fsync (any errno) or a failed write other than ENOSPC/EDQUOT fails
  the transaction with the ``OSError`` and moves the channel to FAILED: every
  later put or commit raises ``ChannelClosedError``, and nothing is fsynced
  again as if it were safe; reopening recovers from what is on disk;
* ENOSPC on a write cuts the file back to the batch start (no partial record
  stays behind) and the channel keeps working once space returns;
* ENOSPC while creating a data file fails the commit cleanly and leaves no
  half-created file that the channel relies on.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
from helpers import contents, put
from simfs import SimFS

import filechannel
from filechannel.crypto import Encryption

DIR = "/sim/ch"
SEG1 = "/sim/ch/data/seg-0000000000000001.wal"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 4096}

FAULTS_INJECTED = {"n": 0}


def open_ch(fs: SimFS, **kw: Any) -> filechannel.FileChannel:
    return filechannel.open(DIR, fs=fs, **{**OPTS, **kw})


drain = contents


def reopen_state(fs: SimFS, **kw: Any) -> list[tuple[int, bytes]]:
    ch = open_ch(fs, **kw)
    try:
        return drain(ch)
    finally:
        ch.close()


def syncs_after_failure(fs: SimFS, path: str) -> list[str]:
    """The fsync-like calls on ``path`` after its first failed sync."""
    out: list[str] = []
    failed = False
    for op, p in fs.trace:
        if p != path:
            continue
        if op.endswith("!failed"):
            failed = True
        elif failed and op in ("fsync", "fdatasync"):
            out.append(op)
    return out


def inject(fs: SimFS, *args: Any, **kw: Any) -> None:
    FAULTS_INJECTED["n"] += 1
    fs.inject(*args, **kw)


# --------------------------------------------------------------------------
# fsync failures (fsyncgate)


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("op", ["fdatasync", "fsync_dir_roll", "roll_old_sync"])
def test_failed_sync_fails_the_channel(op: str, err: int) -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"a" * 100, b"b" * 100)  # creates and syncs the first file
    if op == "fdatasync":
        inject(fs, "fdatasync", 1, err, path=SEG1)
        bodies = [b"c" * 100]
    elif op == "fsync_dir_roll":
        inject(fs, "fsync_dir", 1, err, path="/data")
        bodies = [b"c" * 3000, b"d" * 900]  # does not fit: a new file is created
    else:
        # interval mode leaves the old file unsynced, so the roll must sync it
        ch.close()
        ch = open_ch(fs, fsync="interval", fsync_interval=3600.0)
        put(ch, b"x" * 100)
        inject(fs, "fdatasync", 1, err)
        bodies = [b"c" * 3000, b"d" * 900]
    with pytest.raises(OSError) as ei:
        put(ch, *bodies)
    assert ei.value.errno == err
    # Any failed fsync fails the channel, ENOSPC included (only a failed *write*
    # that could be cut back cleanly leaves it working).
    assert ch.stats()["failed"]
    with pytest.raises(filechannel.ChannelClosedError):
        put(ch, b"later")
    with pytest.raises(filechannel.ChannelClosedError):
        ch.transaction().put(b"x")
    # a take commit is refused too
    with pytest.raises(filechannel.ChannelClosedError), ch.transaction() as tx:
        tx.take()
    ch.close()
    for path in fs.files(DIR):
        assert syncs_after_failure(fs, path) == [], f"{path} was fsynced again after a failed fsync"
    # The failed transaction was never acknowledged: after a power cut it may be
    # gone; without one, the page cache may still show it (at-least-once).
    # With fsync="interval" the acknowledged but unsynced b"x" may be lost too.
    acked = [b"a" * 100, b"b" * 100]
    maybe = [[], [b"x" * 100], [b"x" * 100, *bodies]] if op == "roll_old_sync" else [[], bodies]
    for crashed in (fs.crash(0, "drop"), fs.crash(1, "random"), fs):
        got = [b for _, b in reopen_state(crashed)]
        assert got[: len(acked)] == acked
        assert got[len(acked) :] in maybe, got


def test_failed_fsync_is_not_retried_by_later_commits() -> None:
    """A retried fdatasync would 'succeed' on Linux although the data is gone."""
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"ok")
    inject(fs, "fdatasync", 1, errno.EIO)
    with pytest.raises(OSError):
        put(ch, b"lost")
    for _ in range(3):
        with pytest.raises(filechannel.ChannelClosedError):
            put(ch, b"again")
    with pytest.raises(filechannel.ChannelClosedError):
        ch.sync()
    ch.close()
    assert fs.count("fdatasync!failed") == 1
    assert syncs_after_failure(fs, SEG1) == []
    # What the disk holds: the durable state never had "lost".
    assert [b for _, b in reopen_state(fs.crash(0, "drop"))] == [b"ok"]


def test_interval_background_sync_failure_fails_the_channel() -> None:
    fs = SimFS()
    ch = open_ch(fs, fsync="interval", fsync_interval=3600.0)
    put(ch, b"one")
    inject(fs, "fdatasync", 1, errno.EIO)
    ch._log._writers[0].sync_now()  # what the background syncer runs
    assert ch.stats()["failed"]
    with pytest.raises(filechannel.ChannelClosedError):
        put(ch, b"two")
    with pytest.raises(filechannel.ChannelClosedError):
        ch.sync()
    ch.close()
    assert syncs_after_failure(fs, SEG1) == []
    assert [b for _, b in reopen_state(fs.crash(0, "drop"))] == []
    assert [b for _, b in reopen_state(fs)] == [b"one"]


# --------------------------------------------------------------------------
# write failures


@pytest.mark.parametrize("short", [None, 1, 37, 512])
def test_eio_on_write_fails_the_channel(short: int | None) -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"first")
    size_before = ch._log._writers[0].offset  # the end of the records (zero-filled space follows)
    inject(fs, "pwrite_all", 1, errno.EIO, short=short)
    with pytest.raises(OSError) as ei:
        put(ch, b"second" * 50)
    assert ei.value.errno == errno.EIO
    assert ch.stats()["failed"]
    assert len(fs.read(SEG1)) == size_before, "the partial write was not cut back"
    with pytest.raises(filechannel.ChannelClosedError):
        put(ch, b"third")
    ch.close()
    assert fs.count("fdatasync", SEG1) == 2  # header, "first": nothing after the failed write
    for crashed in (fs, fs.crash(3, "random"), fs.crash(4, "keep")):
        assert [b for _, b in reopen_state(crashed)] == [b"first"]


@pytest.mark.parametrize("short", [None, 1, 100, 333, 4000])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_enospc_mid_batch_leaves_no_partial_record(short: int | None, err: int) -> None:
    fs = SimFS()
    ch = open_ch(fs, max_file_size=64 * 1024)
    put(ch, b"first")
    size_before = ch._log._writers[0].offset  # the end of the records (zero-filled space follows)
    inject(fs, "pwrite_all", 1, err, short=short)
    with pytest.raises(OSError) as ei:
        put(ch, *(bytes([65 + i]) * 900 for i in range(5)))
    assert ei.value.errno == err
    assert not ch.stats()["failed"]
    assert len(fs.read(SEG1)) == size_before, "a partial record stayed behind"
    # space is back: the channel works, and the failed batch never reappears
    put(ch, b"second")
    assert [b for _, b in drain(ch)] == [b"first", b"second"]
    positions = [p for p, _ in drain(ch)]
    ch.close()
    for crashed in (fs, fs.crash(0, "drop"), fs.crash(5, "random")):
        got = reopen_state(crashed)
        assert [b for _, b in got] == [b"first", b"second"]
        assert [p for p, _ in got] == positions


@pytest.mark.parametrize("short", [None, 333])
def test_encrypted_enospc_mid_batch_then_a_power_cut_reopens_with_every_commit(short: int | None) -> None:
    """An undone batch must not advance the batch-tag chain (issue 32, item 19).

    If the writer kept the failed batch's tag, the next batch would chain to a
    tag that is not in the file: after a power cut (no close, no checkpoint to
    cover it) the reopen would refuse the channel or cut the batch as torn.
    """
    encryption = Encryption(keys={"k1": bytes(range(32))}, active_key="k1")
    fs = SimFS()
    ch = open_ch(fs, max_file_size=64 * 1024, encryption=encryption, checkpoint_interval=0, anchor_interval=0)
    put(ch, b"first")
    inject(fs, "pwrite_all", 1, errno.ENOSPC, short=short)
    with pytest.raises(OSError) as ei:
        put(ch, *(bytes([65 + i]) * 900 for i in range(5)))
    assert ei.value.errno == errno.ENOSPC
    put(ch, b"second")
    put(ch, b"third")
    positions = [p for p, _ in drain(ch)]
    for seed, mode in ((0, "drop"), (1, "keep"), (5, "random")):
        crashed = fs.crash(seed, mode)  # the power cut: no close
        got = reopen_state(crashed, encryption=encryption)
        assert [b for _, b in got] == [b"first", b"second", b"third"]
        assert [p for p, _ in got] == positions
    ch.close()


def test_disk_full_then_space_returns() -> None:
    """Real capacity: writes become short, then fail; after freeing space all is well."""
    fs = SimFS(capacity=12_000)
    ch = open_ch(fs, max_file_size=64 * 1024)
    acked: list[bytes] = []
    failures = 0
    for i in range(40):
        body = f"{i:03d}".encode() * 100
        try:
            put(ch, body)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC  # noqa: PT017
            failures += 1
            assert not ch.stats()["failed"]
            continue
        acked.append(body)
    assert failures > 0
    FAULTS_INJECTED["n"] += failures
    assert [b for _, b in drain(ch)] == acked
    fs.capacity = None
    put(ch, b"after")
    acked.append(b"after")
    assert [b for _, b in drain(ch)] == acked
    ch.close()
    assert [b for _, b in reopen_state(fs.crash(0, "drop"))] == acked


def test_enospc_when_creating_a_data_file() -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"a" * 2000)
    inject(fs, "pwrite_all", 1, errno.ENOSPC, path="seg-0000000000000002")
    with pytest.raises(OSError) as ei:
        put(ch, b"b" * 2500)  # needs a new file
    assert ei.value.errno == errno.ENOSPC
    assert not ch.stats()["failed"]
    assert not fs.exists("/sim/ch/data/seg-0000000000000002.wal"), "a half-created file was left"
    put(ch, b"c" * 2500)  # retry after space returned
    assert [b for _, b in drain(ch)] == [b"a" * 2000, b"c" * 2500]
    ch.close()
    for crashed in (fs, fs.crash(0, "drop"), fs.crash(9, "random")):
        assert [b for _, b in reopen_state(crashed)] == [b"a" * 2000, b"c" * 2500]


def test_enospc_on_create_itself() -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"a" * 2000)
    inject(fs, "create", 1, errno.ENOSPC, path="seg-")
    with pytest.raises(OSError):
        put(ch, b"b" * 2500)
    assert not ch.stats()["failed"]
    put(ch, b"c" * 2500)
    ch.close()
    assert [b for _, b in reopen_state(fs.crash(0, "drop"))] == [b"a" * 2000, b"c" * 2500]


def test_failed_take_commit_returns_events_with_their_positions() -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"a", b"b", b"c")
    before = drain(ch)
    inject(fs, "pwrite_all", 1, errno.ENOSPC)
    tx = ch.transaction()
    assert [e.body for e in tx.take_batch(2)] == [b"a", b"b"]
    with pytest.raises(OSError):
        tx.commit()
    tx.rollback()  # a no-op after a failed commit
    assert drain(ch) == before
    with ch.transaction() as tx:
        assert [(e.position, e.body) for e in tx.take_batch(2)] == before[:2]
    ch.close()
    assert reopen_state(fs.crash(0, "drop")) == before[2:]


# --------------------------------------------------------------------------
# failures around retirement, recovery and checkpoints


@pytest.mark.parametrize("op", ["unlink", "fsync_dir"])
def test_failure_while_retiring_a_file(op: str) -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"a" * 1500, b"b" * 1500)
    put(ch, b"c" * 1500, b"d" * 1500)  # second file
    inject(fs, op, 1, errno.EIO, path="/data")
    with ch.transaction() as tx:  # empties file 1: retirement runs inline and fails
        assert len(tx.take_batch(2)) == 2
    remaining = [b"c" * 1500, b"d" * 1500]
    if not ch.stats()["failed"]:
        put(ch, b"e")
        remaining.append(b"e")
    ch.close()
    for crashed in (fs, fs.crash(0, "drop"), fs.crash(2, "random"), fs.crash(3, "keep")):
        assert [b for _, b in reopen_state(crashed)] == remaining


@pytest.mark.parametrize("op", ["truncate", "fsync", "create", "pwrite_all", "fsync_dir"])
def test_failure_during_recovery_then_retry(op: str) -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"kept")
    ch._log._writers[0].fd  # noqa: B018 - the file is open
    fs.inject("fdatasync", 1, errno.EIO)  # the next commit is written, never durable
    with pytest.raises(OSError):
        put(ch, b"torn" * 100)
    end = ch._log._writers[0].offset  # the end of the unsynced batch (zero-filled space follows)
    ch.close()
    # The page cache still shows the unsynced batch; say it reached the disk
    # but for its last 20 bytes: a torn tail that recovery must cut.
    crashed = fs.crash(0, "drop")
    crashed.write(SEG1, fs.read(SEG1)[: end - 20])
    inject(crashed, op, 1, errno.EIO)
    try:
        got = reopen_state(crashed)
    except OSError as exc:
        assert exc.errno == errno.EIO  # noqa: PT017
        crashed.clear_faults()
        got = reopen_state(crashed)
    assert crashed.stats.faults_fired == 1, "recovery never made that call"
    assert [b for _, b in got] == [b"kept"]
    assert [b for _, b in reopen_state(crashed.crash(1, "drop"))] == [b"kept"]


@pytest.mark.parametrize("op", ["replace", "fsync", "fsync_dir", "pwrite_all"])
def test_failed_checkpoint_keeps_the_previous_one(op: str) -> None:
    fs = SimFS()
    ch = open_ch(fs)
    if not hasattr(ch, "checkpoint"):
        pytest.fail("checkpoints are part of the design")
    put(ch, b"a", b"b")
    ch.checkpoint()
    put(ch, b"c")
    with ch.transaction() as tx:
        tx.take()
    inject(fs, op, 1, errno.EIO, path="checkpoints")
    with pytest.raises(OSError):
        ch.checkpoint()
    assert fs.stats.faults_fired == 1
    put(ch, b"d")
    want = drain(ch)
    ch.close()
    for crashed in (fs.crash(0, "drop"), fs.crash(1, "random"), fs):
        assert reopen_state(crashed) == want


def test_zz_report() -> None:
    print(f"\nfaults injected: {FAULTS_INJECTED['n']}")
