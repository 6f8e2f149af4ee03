"""Group commit with several committer threads: nobody hears "committed" before the fdatasync covering it.

A writer groups the commits that arrive while its leader writes and syncs
(docs/design.md, "Write path and group commit"). The crash and fault tests
commit from one thread, where every committer leads a group of one; here
several threads commit at once on a :class:`ConcurrentSimFS` whose fdatasync
takes a few milliseconds (spent outside its lock, as a real one releases the
GIL), so groups really form, and the tests count them:

* no commit returns before the bytes of its transaction are durable (the
  simulated file system knows which bytes a power cut would keep);
* a failed fdatasync fails every commit of its group with the ``OSError``, none
  of them returns, the channel refuses further writes, and after a reopen each
  failed commit is in flight as far as recovery is concerned: all of its events
  or none (none after a power cut), while every acknowledged commit is there.
"""

from __future__ import annotations

import errno
import statistics
import threading
import time
from collections import Counter
from typing import Any

import pytest
from helpers import contents, put
from simfs import ConcurrentSimFS, SimFS

import filechannel
from filechannel import format as fmt
from filechannel.writer import Writer

DIR = "/sim/ch"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 16 * 1024}
COMMIT_RECORD = fmt.record_size(16)  # the COMMIT record that follows a put-only transaction's PUTs


def body(thread: int, txn: int, i: int, size: int = 100) -> bytes:
    tag = f"t{thread}-{txn:03d}-{i}:".encode()
    return tag + b"x" * (size - len(tag))


def run_threads(n: int, target: Any) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(t: int) -> None:
        try:
            start.wait()
            target(t)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a committer thread hangs"
    return errors


@pytest.mark.parametrize("puts", [2, 1], ids=["two-events", "one-event"])
def test_no_grouped_commit_returns_before_its_bytes_are_durable(puts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also for one-event transactions, which a lone committer writes on its own path (``_write_commit1``)."""
    lone: list[int] = []
    plain_write = Writer._write_commit1

    def spy(self: Writer, it: Any) -> None:
        lone.append(it.txn_id)
        plain_write(self, it)

    monkeypatch.setattr(Writer, "_write_commit1", spy)
    fs = ConcurrentSimFS(sync_delay=0.002)
    ch = filechannel.open(DIR, fs=fs, **OPTS)
    log = ch._log
    plain_commit = log.commit
    # Each fdatasync of a data file: the file's durable bytes right after it.
    syncs: list[tuple[str, bytes]] = []

    def on_op(op: str, path: str) -> None:  # called inside the FS call, under fs.mutex
        if op == "fdatasync" and "/data/" in path:
            syncs.append((path, fs.durable_bytes(path)))

    fs.on_op = on_op
    # Each commit: (path, start of its PUTs, end of its COMMIT record, durable when commit() returned).
    returned: list[tuple[str, int, int, bool]] = []

    def commit(*args: Any, **kwargs: Any) -> Any:
        res = plain_commit(*args, **kwargs)
        # The moment the committer is told "committed": are its bytes what a power cut keeps?
        path = log.file_path(res.file_id)
        start = res.put_offsets[0]
        end = res.put_offsets[-1] + res.put_sizes[-1] + COMMIT_RECORD
        with fs.mutex:
            now, durable = fs.read(path), fs.durable_bytes(path)
        returned.append((path, start, end, len(now) >= end and durable[start:end] == now[start:end]))
        return res

    log.commit = commit  # type: ignore[method-assign]
    threads, txns = 4, 40

    def committer(t: int) -> None:
        for k in range(txns):
            with ch.transaction() as tx:
                for i in range(puts):
                    tx.put(body(t, k, i))

    committer(threads)  # first alone: every commit leads a group of one
    errors = run_threads(threads, committer)
    del log.commit
    fs.on_op = None
    assert errors == []
    assert len(returned) == (threads + 1) * txns
    if puts == 1:
        assert len(lone) >= txns  # the lone one-event path ran (for every commit of the first phase at least)
    early = [r for r in returned if not r[3]]
    assert early == [], f"{len(early)} of {len(returned)} commits returned before their bytes were durable"
    # Which fdatasync made each commit durable: its group. Groups of more than one must have formed,
    # or this test proved nothing about grouped committers.
    group_of = []
    for path, start, end, _ in returned:
        final = fs.read(path)[start:end]
        group_of.append(next(i for i, (p, d) in enumerate(syncs) if p == path and d[start:end] == final))
    sizes = sorted(Counter(group_of).values())
    grouped = [s for s in sizes if s > 1]
    print(
        f"\n{len(returned)} commits from {threads} threads in {len(sizes)} groups: {len(grouped)} of more than one "
        f"commit, median size {statistics.median(sizes)}, largest {sizes[-1]}"
    )
    assert len(grouped) >= 5, sizes
    got = contents(ch)
    assert sorted(b for _, b in got) == sorted(
        body(t, k, i) for t in range(threads + 1) for k in range(txns) for i in range(puts)
    )
    ch.close()
    # Everything acknowledged is durable: a power cut now loses nothing.
    crashed = filechannel.open(DIR, fs=fs.crash(0, "drop"), **OPTS)
    assert contents(crashed) == got
    crashed.close()


class GatedFS(ConcurrentSimFS):
    """Holds the next fdatasync (once ``hold`` is set) until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def _sync(self, op: str, fd: int) -> None:
        if self.hold and op == "fdatasync":
            self.hold = False
            self.entered.set()
            assert self.release.wait(30)
        super()._sync(op, fd)


def reopen(fs: SimFS) -> list[tuple[int, bytes]]:
    ch = filechannel.open(DIR, fs=fs, **OPTS)
    try:
        got = contents(ch)
        put(ch, b"after")  # the channel takes new commits at a fresh position
        after = contents(ch)
        assert after[:-1] == got
        assert after[-1][1] == b"after"
        assert after[-1][0] > max(p for p, _ in got)
        return got
    finally:
        ch.close()


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_failed_fdatasync_fails_every_commit_of_its_group(err: int) -> None:
    fs = GatedFS()
    ch = filechannel.open(DIR, fs=fs, **OPTS)
    put(ch, b"first")  # creates the data file; its fdatasync done
    # The leader's fdatasync (A's commit alone) is held while three committers queue behind it;
    # they form the next group, and that group's fdatasync fails.
    fs.inject("fdatasync", 2, err, path="/data/")
    fs.hold = True
    outcome: dict[str, BaseException | None] = {}

    def commit(name: str, *bodies: bytes) -> None:
        try:
            put(ch, *bodies)
            outcome[name] = None
        except BaseException as exc:  # the outcome under test
            outcome[name] = exc

    leader = threading.Thread(target=commit, args=("A", b"A0"))
    leader.start()
    assert fs.entered.wait(30)
    grouped = {name: [f"{name}{i}".encode() for i in range(2)] for name in ("B", "C", "D")}
    followers = [threading.Thread(target=commit, args=(n, *bs)) for n, bs in grouped.items()]
    for th in followers:
        th.start()
    time.sleep(0.3)  # B, C and D queue behind the held fdatasync
    fs.release.set()
    for th in [leader, *followers]:
        th.join(30)
        assert not th.is_alive()
    assert outcome["A"] is None
    # One failed fdatasync, and its error reached every commit of the group: none was told "committed".
    assert fs.count("fdatasync!failed") == 1
    for name in grouped:
        exc = outcome[name]
        assert isinstance(exc, OSError), f"{name}: {exc!r}"
        assert exc.errno == err
    assert ch.stats()["failed"]
    assert ch.size == 2  # "first" and A0; the failed commits never took effect
    with pytest.raises(filechannel.ChannelClosedError):
        put(ch, b"later")
    ch.close()
    # After a reopen each failed commit is all or nothing (at-least-once: the page cache may still
    # hold its bytes); after a power cut it is gone, for nothing was synced after the failure.
    acked = [(0, b"first"), (1, b"A0")]
    for crashed, power_cut in [
        (fs, False),
        (fs.crash(0, "drop"), True),
        (fs.crash(0, "keep"), False),
        *[(fs.crash(s, "random"), False) for s in range(4)],
    ]:
        got = reopen(crashed)
        assert got[:2] == acked, got
        rest = [b for _, b in got[2:]]
        for name, bodies in grouped.items():
            present = [b for b in bodies if b in rest]
            assert present in ([], bodies), f"{name}: a failed commit came back in part: {present}"
        assert sorted(rest) == sorted(b for bs in grouped.values() if bs[0] in rest for b in bs)
        if power_cut:
            assert rest == []
