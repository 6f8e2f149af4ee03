"""Room as back-pressure (SimFS): ``max_bytes``, the free-space floor and a full disk.

* ``max_bytes``: a put past the bytes of data files the channel may hold is
  refused with ``ChannelFullError(reason="max_bytes")`` after ``keep_alive``,
  or waits and goes through when takes retire a file; nothing is written, the
  channel never fails, and ``stats()`` shows what is held against the limit.
* the floor (``minimum_required_space``): a put (or a commit whose bytes would
  take free space under it) waits up to ``keep_alive``, then raises
  ``DiskSpaceError`` (a ``ChannelFullError``) with the transaction still open:
  it commits once space is back, with no restart. Takes are never refused.
* a write that runs out of space: ``DiskFullError``, both a full channel and
  the ``OSError`` it was; the file is cut back and the channel goes on.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from typing import Any

import pytest
from helpers import WaitingPut, contents, put, run_cli
from simfs import SimFS

import filechannel
import filechannel.space
from filechannel import ChannelFullError, ConfigError, DiskFullError, DiskSpaceError

DIR = "/sim/ch"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 4096, "keep_alive": 0}
BODY = b"x" * 500


def open_ch(fs: SimFS, **kw: Any) -> filechannel.FileChannel:
    return filechannel.open(DIR, fs=fs, **{**OPTS, **kw})


def fill(ch: filechannel.FileChannel, limit: int = 1000) -> int:
    """Put one event per transaction until the channel refuses one; return how many went in."""
    for n in range(limit):
        try:
            put(ch, BODY)
        except ChannelFullError:
            return n
    raise AssertionError("the channel never filled up")


def take_all(ch: filechannel.FileChannel) -> int:
    n = 0
    while True:
        with ch.transaction() as tx:
            got = tx.take_batch(100)
        if not got:
            return n
        n += len(got)


def test_max_bytes_refuses_puts_then_takes_retire_files_and_puts_resume() -> None:
    fs = SimFS()
    ch = open_ch(fs, max_bytes=3 * 4096)
    n = fill(ch)
    st = ch.stats()
    assert n > 0
    assert st["space_refusals"] == 1
    assert not st["failed"]
    assert st["max_bytes"] == 3 * 4096
    assert st["data_bytes"] <= 3 * 4096 < st["data_bytes"] + 600
    with pytest.raises(ChannelFullError) as ei:
        put(ch, BODY)
    assert ei.value.reason == "max_bytes"
    assert "max_bytes=12288" in str(ei.value)
    assert take_all(ch) == n  # takes are never refused for room
    ch.retire_files()  # (take commits retire files on their own too)
    assert ch.stats()["files_retired"] > 0
    assert ch.stats()["data_bytes"] < 4096 + 600
    put(ch, b"after")  # room again: no restart
    assert [b for _, b in contents(ch)] == [b"after"]
    ch.close()


def test_a_put_waiting_for_max_bytes_goes_through_when_a_file_retires() -> None:
    fs = SimFS()
    with open_ch(fs) as ch:
        for _ in range(30):
            put(ch, BODY)
    n = 30
    ch = open_ch(fs, max_bytes=3 * 4096, keep_alive=10)
    assert ch.stats()["data_bytes"] > 3 * 4096
    waiting = WaitingPut(ch, b"waited")
    time.sleep(0.3)
    assert not waiting.done.is_set(), "the put did not wait for room"
    assert take_all(ch) == n
    ch.retire_files()
    waiting.finish(5)
    assert [b for _, b in contents(ch)] == [b"waited"]
    ch.close()


def test_max_bytes_counts_the_files_found_at_open() -> None:
    fs = SimFS()
    with open_ch(fs) as ch:
        for _ in range(30):
            put(ch, BODY)
        held = ch.stats()["data_bytes"]
    assert held > 3 * 4096
    with open_ch(fs, max_bytes=3 * 4096) as ch:
        assert ch.stats()["data_bytes"] == held
        with pytest.raises(ChannelFullError) as ei:
            put(ch, BODY)
        assert ei.value.reason == "max_bytes"


@pytest.mark.parametrize(
    ("value", "needle"),
    [(0, "positive"), (-1, "positive"), (1.5, "positive"), ("10G", "positive"), (4096, "twice max_file_size")],
)
def test_max_bytes_is_validated(value: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as ei:
        filechannel.ChannelConfig(max_bytes=value, max_file_size=4096)  # type: ignore[arg-type]
    assert ei.value.option == "max_bytes"
    with pytest.raises(ConfigError, match="twice"):
        filechannel.ChannelConfig(max_bytes=3 * 4096, max_file_size=4096, data_dirs=("/a", "/b"))


def test_the_floor_keeps_the_transaction_open_and_puts_resume_when_space_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(filechannel.space, "SPACE_REFRESH_S", 0.0)  # no reading is trusted twice
    fs = SimFS(free=1 << 30)
    ch = open_ch(fs, minimum_required_space=1 << 20)
    put(ch, b"first")
    fs.free = 1 << 19  # something else filled the disk
    tx = ch.transaction()
    with pytest.raises(DiskSpaceError) as ei:
        tx.put(b"second")
    assert isinstance(ei.value, ChannelFullError)
    assert ei.value.reason == "min_free"
    assert not ch.stats()["failed"]
    with ch.transaction() as t2:  # takes keep working
        assert t2.take() is not None
    tx.rollback()
    fs.free = 1 << 30  # space returns: at once, no restart and no stale reading
    put(ch, b"third")
    assert [b for _, b in contents(ch)] == [b"third"]
    ch.close()


def test_a_commit_whose_bytes_would_cross_the_floor_waits_then_commits() -> None:
    fs = SimFS(free=(1 << 20) + 4000)
    ch = open_ch(fs, minimum_required_space=1 << 20, keep_alive=10, max_file_size=1 << 16)
    tx = ch.transaction()
    tx.put_many([BODY] * 20)  # ~10 KB: more than the 4000 bytes above the floor
    t0 = time.monotonic()
    threading.Timer(0.5, lambda: setattr(fs, "free", 1 << 30)).start()
    tx.commit()  # waited for space (polling), then wrote
    assert time.monotonic() - t0 >= 0.4
    assert len(contents(ch)) == 20
    ch.close()


def test_a_commit_over_the_floor_is_refused_before_writing_and_stays_open() -> None:
    fs = SimFS(free=(1 << 20) + 4000)
    ch = open_ch(fs, minimum_required_space=1 << 20, max_file_size=1 << 16)
    written = ch.stats()["bytes_written"]
    tx = ch.transaction()
    tx.put_many([BODY] * 20)
    with pytest.raises(DiskSpaceError, match="plus the") as ei:
        tx.commit()
    assert ei.value.reason == "min_free"
    assert ch.stats()["bytes_written"] == written  # nothing was written
    fs.free = 1 << 30
    tx.commit()  # the same transaction, still open
    assert len(contents(ch)) == 20
    ch.close()


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_a_write_that_runs_out_of_space_is_a_full_channel_and_an_oserror(err: int, encrypted: bool) -> None:
    fs = SimFS()
    opts: dict[str, Any] = {"encryption": filechannel.Encryption(keys={"k1": bytes(range(32))})} if encrypted else {}
    ch = open_ch(fs, **opts)
    put(ch, b"first")
    fs.inject("pwrite_all", 1, err, short=100)
    with pytest.raises(DiskFullError) as ei:
        put(ch, BODY, BODY)
    assert isinstance(ei.value, OSError)
    assert isinstance(ei.value, ChannelFullError)
    assert ei.value.errno == err
    assert ei.value.reason == "disk_full"
    assert "nothing was put" in str(ei.value)
    st = ch.stats()
    assert not st["failed"]
    assert st["space_refusals"] == 1
    put(ch, b"second")
    assert [b for _, b in contents(ch)] == [b"first", b"second"]
    ch.close()
    with open_ch(fs, **opts) as ch:  # the undone write left the file (and an encrypted file's chain) as it was
        assert [b for _, b in contents(ch)] == [b"first", b"second"]
        assert ch.stats()["torn_tails_truncated"] == 0


def test_a_failed_fsync_on_a_full_disk_still_fails_the_channel() -> None:
    fs = SimFS()
    ch = open_ch(fs)
    put(ch, b"first")
    fs.inject("fdatasync", 1, errno.ENOSPC)
    with pytest.raises(OSError) as ei:
        put(ch, b"second")
    assert not isinstance(ei.value, ChannelFullError), "a failed fsync is not back-pressure"
    assert ch.stats()["failed"]
    ch.close()


# -- the command line ------------------------------------------------------------------------------


def test_cli_put_and_stat_take_sizes(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "c")
    lines = b"".join(b"%d\n" % i for i in range(50))
    code, _, err = run_cli(capsys, "put", d, "--max-bytes", "1.5G", "--min-free-bytes", "1M", stdin=lines)
    assert code == 0, err
    code, out, _ = run_cli(capsys, "stat", d, "--json", "--max-bytes", "10G", "--min-free-bytes", "64M")
    assert code == 0
    info = json.loads(out)
    assert info["max_bytes"] == 10 << 30
    assert info["minimum_required_space"] == 64 << 20
    assert info["data_bytes"] == info["disk_bytes"] > 0
    assert info["disk_free"] > 0
    code, out, _ = run_cli(capsys, "stat", d, "--json")
    assert "max_bytes" not in json.loads(out)  # not stored in the channel: shown only when given


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-bytes", "10X"], "'10X' is not a size"),
        (["--max-bytes", "1K"], "--max-bytes 1024: 1024 is under twice max_file_size"),
        (["--min-free-bytes", "-1"], "'-1' is not a size"),
    ],
)
def test_cli_bad_sizes_are_one_line_errors(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = run_cli(capsys, "put", str(tmp_path / "c"), *argv, stdin=b"x\n")
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1


def test_cli_put_on_a_full_disk_says_so_in_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "put", str(tmp_path / "c"), "--min-free-bytes", "1000T", stdin=b"x\n")
    assert code == 2
    assert "bytes free on" in err
    assert "minimum_required_space" in err
    assert len(err.strip().splitlines()) == 1
