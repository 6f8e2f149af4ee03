"""The channel's semantics (issue 2): transactions, ordering, capacity, errors, restart, files."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import filechannel
from filechannel import Event
from filechannel.log import Log

FAST: dict[str, Any] = {"minimum_required_space": 0, "background": False}


def opn(d: str | Path, **kw: Any) -> filechannel.FileChannel:
    return filechannel.open(d, **{**FAST, **kw})


def put_all(ch: filechannel.FileChannel, bodies: list[bytes], per_txn: int = 10) -> None:
    for i in range(0, len(bodies), per_txn):
        with ch.transaction() as tx:
            for b in bodies[i : i + per_txn]:
                tx.put(b)


def drain(ch: filechannel.FileChannel) -> list[Event]:
    out: list[Event] = []
    while True:
        with ch.transaction() as tx:
            evs = tx.take_batch(ch.config.transaction_capacity)
        if not evs:
            return out
        out += evs


def assert_close_wakes(ch: filechannel.FileChannel, wait: Any, errors: list[BaseException]) -> None:
    """Run ``wait`` (a call that blocks) on a thread, close ``ch``: it must end with ChannelClosedError."""

    def run() -> None:
        try:
            wait()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.1)
    ch.close()
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], filechannel.ChannelClosedError), errors[0]


def data_files(d: str | Path) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(d, "data")) if n.endswith(".wal"))


# -- visibility, rollback, order ----------------------------------------------------------------


def test_put_is_invisible_until_commit(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        tx = ch.transaction()
        tx.put(b"a")
        tx.put(b"b", headers={"h": "1"})
        assert ch.size == 0
        with ch.transaction() as t2:
            assert t2.take() is None
        tx.commit()
        assert ch.size == 2
        with ch.transaction() as t3:
            evs = t3.take_batch(10)
        assert [(e.body, dict(e.headers), e.position) for e in evs] == [(b"a", {}, 0), (b"b", {"h": "1"}, 1)]


def test_rolled_back_put_leaves_no_trace(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        tx = ch.transaction()
        for i in range(5):
            tx.put(b"gone%d" % i)
        tx.rollback()
        assert ch.size == 0
        assert ch.stats()["inflight_puts"] == 0
        with ch.transaction() as t:
            assert t.take() is None
        with ch.transaction() as t:
            t.put(b"kept")
    with opn(chan_dir) as ch:
        evs = drain(ch)
        # Positions are assigned at commit: the rollback consumed none.
        assert [(e.body, e.position) for e in evs] == [(b"kept", 0)]


def test_context_manager_rolls_back_on_exception(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        tx = ch.transaction()

        def fail() -> None:
            with tx:
                tx.put(b"x")
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            fail()
        assert tx.state == "rolled back"
        assert ch.size == 0


def test_takes_come_from_the_head_in_position_order_and_commit_removes_for_good(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"%d" % i for i in range(25)], per_txn=7)
        with ch.transaction() as tx:
            first = [tx.take() for _ in range(3)]
            rest = tx.take_batch(5)
        assert [e.position for e in first + rest] == list(range(8))  # type: ignore[union-attr]
        assert [e.body for e in first + rest] == [b"%d" % i for i in range(8)]  # type: ignore[union-attr]
        assert ch.size == 17
    with opn(chan_dir) as ch:
        evs = drain(ch)
        assert [e.position for e in evs] == list(range(8, 25))
    with opn(chan_dir) as ch:
        assert ch.size == 0


def test_rolled_back_take_returns_events_to_the_head_in_order(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"e%d" % i for i in range(10)], per_txn=3)
        a = ch.transaction()
        got_a = a.take_batch(3)
        b = ch.transaction()
        got_b = b.take_batch(2)
        assert [e.position for e in got_a] == [0, 1, 2]
        assert [e.position for e in got_b] == [3, 4]
        a.rollback()
        assert ch.size == 8
        c = ch.transaction()
        got_c = c.take_batch(4)
        # a's events first, in their original order and positions, then what follows b's.
        assert [(e.body, e.position) for e in got_c] == [(b"e0", 0), (b"e1", 1), (b"e2", 2), (b"e5", 5)]
        b.rollback()
        c.rollback()
        with ch.transaction() as d:
            again = d.take_batch(100)
        assert [(e.body, e.position) for e in again] == [(b"e%d" % i, i) for i in range(10)]
        d_roll = ch.transaction()
        d_roll.take_batch(4)
        d_roll.rollback()
    with opn(chan_dir) as ch:
        assert ch.size == 0  # the committed take of all ten was durable


def test_uncommitted_take_returns_on_reopen(chan_dir: str) -> None:
    ch = opn(chan_dir)
    put_all(ch, [b"a", b"b", b"c"])
    tx = ch.transaction()
    tx.take_batch(2)
    ch.close()  # abandons the open transaction
    with opn(chan_dir) as ch2:
        assert [(e.body, e.position) for e in drain(ch2)] == [(b"a", 0), (b"b", 1), (b"c", 2)]


def test_fifo_across_transactions_by_commit_order(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        t1 = ch.transaction()
        t2 = ch.transaction()
        t1.put(b"t1-a")
        t2.put(b"t2-a")
        t1.put(b"t1-b")
        t2.put(b"t2-b")
        t2.commit()
        t1.commit()
        evs = drain(ch)
        assert [(e.body, e.position) for e in evs] == [(b"t2-a", 0), (b"t2-b", 1), (b"t1-a", 2), (b"t1-b", 3)]


def test_mixed_put_and_take_transactions(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"a", b"b", b"c"])
        with ch.transaction() as tx:
            assert [e.body for e in tx.take_batch(2)] == [b"a", b"b"]
            tx.put(b"d")
            tx.put(b"e")
        tx = ch.transaction()
        tx.take()
        tx.put(b"never")
        tx.rollback()
        assert ch.size == 3
    with opn(chan_dir) as ch:
        assert [(e.body, e.position) for e in drain(ch)] == [(b"c", 2), (b"d", 3), (b"e", 4)]


def test_event_objects_and_bytes_like_bodies(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        with ch.transaction() as tx:
            tx.put(Event(b"ev", {"k": "v"}))
            tx.put(bytearray(b"ba"))
            tx.put(memoryview(b"mv"))
            tx.put(b"")
        evs = drain(ch)
    assert [(e.body, dict(e.headers)) for e in evs] == [(b"ev", {"k": "v"}), (b"ba", {}), (b"mv", {}), (b"", {})]
    assert all(type(e.body) is bytes for e in evs)
    assert Event(b"x").position is None


def test_transaction_state_is_enforced(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        tx = ch.transaction()
        tx.put(b"x")
        tx.commit()
        for call in (lambda: tx.put(b"y"), tx.take, tx.commit, tx.rollback):
            with pytest.raises(filechannel.TransactionStateError):
                call()
        tx = ch.transaction()
        tx.rollback()
        tx.rollback()  # rolling back twice is harmless
        with pytest.raises(filechannel.TransactionStateError):
            tx.commit()


# -- put validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "exc", "words"),
    [
        (("text",), TypeError, "bytes-like"),
        ((123,), TypeError, "bytes-like"),
        ((None,), TypeError, "bytes-like"),
        ((b"x", {1: "v"}), TypeError, "key"),
        ((b"x", {"k": 1}), TypeError, "'k'"),
        ((b"x", {"k": b"v"}), TypeError, "'k'"),
        ((b"x", [("k", "v")]), TypeError, "mapping"),
        ((Event(b"x"), {"k": "v"}), TypeError, "Event"),
        ((b"x" * 5000,), ValueError, "max_event_size"),
        ((b"x", {"k": "v" * 5000}), ValueError, "max_event_size"),
    ],
)
def test_put_validation_writes_nothing(chan_dir: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    with opn(chan_dir, max_file_size=8192, max_event_size=4096) as ch:
        before = ch.stats()["bytes_written"]
        tx = ch.transaction()
        with pytest.raises(exc, match=words):
            tx.put(*args)
        assert ch.stats()["inflight_puts"] == 0
        tx.commit()  # the transaction is still usable, and empty
        assert ch.stats()["bytes_written"] == before
        assert ch.size == 0


def test_transaction_capacity(chan_dir: str) -> None:
    with opn(chan_dir, capacity=100, transaction_capacity=3) as ch:
        tx = ch.transaction()
        for _ in range(3):
            tx.put(b"x")
        with pytest.raises(filechannel.TransactionCapacityError, match="transaction_capacity"):
            tx.put(b"x")
        tx.commit()
        put_all(ch, [b"y"] * 3, per_txn=3)
        tx = ch.transaction()
        with pytest.raises(filechannel.TransactionCapacityError, match="take at most 3"):
            tx.take_batch(10)  # refused whole, as put_many is: never cut short silently (issue 27)
        assert len(tx.take_batch(3)) == 3
        with pytest.raises(filechannel.TransactionCapacityError):
            tx.take()
        tx.commit()
        assert ch.size == 3


# -- capacity and waiting ---------------------------------------------------------------------------


def test_channel_full_after_keep_alive(chan_dir: str) -> None:
    with opn(chan_dir, capacity=3, transaction_capacity=3, keep_alive=0.2) as ch:
        put_all(ch, [b"1", b"2"])
        tx = ch.transaction()
        tx.put(b"3")  # in flight counts against capacity
        t0 = time.monotonic()
        with pytest.raises(filechannel.ChannelFullError, match="keep_alive"):
            ch.transaction().put(b"4")
        assert time.monotonic() - t0 >= 0.18
        tx.commit()
        assert ch.size == 3
        with pytest.raises(filechannel.ChannelFullError):
            ch.transaction().put(b"5")
        assert ch.stats()["channel_full"] == 2


def test_put_waits_until_a_take_frees_room(chan_dir: str) -> None:
    with opn(chan_dir, capacity=2, transaction_capacity=2, keep_alive=10) as ch:
        put_all(ch, [b"a", b"b"])

        def consumer() -> None:
            time.sleep(0.3)
            with ch.transaction() as tx:
                tx.take()

        t = threading.Thread(target=consumer)
        t.start()
        t0 = time.monotonic()
        with ch.transaction() as tx:
            tx.put(b"c")
        waited = time.monotonic() - t0
        t.join()
        assert 0.25 <= waited < 5
        assert [e.body for e in drain(ch)] == [b"b", b"c"]


def test_take_timeout_waits_for_an_event(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        t0 = time.monotonic()
        with ch.transaction() as tx:
            assert tx.take(timeout=0.2) is None
        assert time.monotonic() - t0 >= 0.18

        def producer() -> None:
            time.sleep(0.2)
            with ch.transaction() as tx:
                tx.put(b"late")

        t = threading.Thread(target=producer)
        t.start()
        t0 = time.monotonic()
        with ch.transaction() as tx:
            ev = tx.take(timeout=10)
        t.join()
        assert ev is not None
        assert ev.body == b"late"
        assert 0.15 <= time.monotonic() - t0 < 5


# -- closed, locked, disk space ------------------------------------------------------------------------


def test_closed_channel_refuses_work(chan_dir: str) -> None:
    ch = opn(chan_dir)
    put_all(ch, [b"a"])
    tx = ch.transaction()
    ch.close()
    ch.close()  # idempotent
    assert ch.closed
    with pytest.raises(filechannel.ChannelClosedError):
        ch.transaction()
    with pytest.raises(filechannel.ChannelClosedError):
        tx.put(b"x")
    with pytest.raises(filechannel.ChannelClosedError):
        tx.take()


def test_take_waiting_on_a_closing_channel_raises_closed(chan_dir: str) -> None:
    ch = opn(chan_dir)
    errors: list[BaseException] = []
    assert_close_wakes(ch, lambda: ch.transaction().take(timeout=10), errors)


def test_locked_in_the_same_process(chan_dir: str) -> None:
    ch = opn(chan_dir)
    with pytest.raises(filechannel.ChannelLockedError) as ei:
        opn(chan_dir)
    assert chan_dir in str(ei.value)
    ch.close()
    opn(chan_dir).close()  # released on close


_HOLDER = """
import sys, time, filechannel
ch = filechannel.open(sys.argv[1], minimum_required_space=0)
print("open", flush=True)
sys.stdin.readline()
ch.close()
"""

_OPENER = """
import sys, filechannel
try:
    filechannel.open(sys.argv[1], minimum_required_space=0).close()
except filechannel.ChannelLockedError:
    print("locked")
else:
    print("opened")
"""


def test_locked_from_another_process(chan_dir: str) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, chan_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "open"
        with pytest.raises(filechannel.ChannelLockedError):
            opn(chan_dir)
    finally:
        p.communicate("\n", timeout=30)
    assert p.returncode == 0
    opn(chan_dir).close()
    # And the other way round: we hold it, another process is refused.
    with opn(chan_dir):
        out = subprocess.run([sys.executable, "-c", _OPENER, chan_dir], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "locked", out.stderr


def test_lock_of_a_killed_process_is_not_stale(chan_dir: str) -> None:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, chan_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"open"
    p.kill()
    p.wait()
    opn(chan_dir).close()


def test_disk_space_error_fails_puts_and_takes_keep_working(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"a", b"b", b"c"])
    with opn(chan_dir, minimum_required_space=2**62, keep_alive=0) as ch:
        before = ch.stats()["bytes_written"]
        tx = ch.transaction()
        with pytest.raises(filechannel.DiskSpaceError) as ei:
            tx.put(b"x")
        assert "minimum_required_space" in str(ei.value)
        assert ei.value.required == 2**62
        tx.rollback()
        assert ch.stats()["bytes_written"] == before
        with ch.transaction() as tx:
            assert tx.take() is not None
        assert ch.size == 2
    with opn(chan_dir) as ch:
        assert [e.body for e in drain(ch)] == [b"b", b"c"]


# -- threads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_dirs", "cache_bytes"),
    [
        (1, None),  # the default cache: every take a cache hit
        (2, 2048),  # two data directories (commits publish out of order) and a cache that evicts all the time
        (2, 0),  # no cache: every take reads its runs from disk
    ],
)
def test_many_producers_and_consumers_exactly_once(
    tmp_path: Path, chan_dir: str, n_dirs: int, cache_bytes: int | None
) -> None:
    producers, per_producer, per_txn = 4, 300, 7
    consumers = 3
    opts: dict[str, Any] = {"max_file_size": 16 * 1024, "background": True}
    if n_dirs > 1:
        opts["data_dirs"] = [str(tmp_path / f"disk{i}") for i in range(n_dirs)]
    if cache_bytes is not None:
        opts["cache_bytes"] = cache_bytes
    with opn(chan_dir, **opts) as ch:
        got: list[list[Event]] = [[] for _ in range(consumers)]
        done = threading.Event()
        errors: list[BaseException] = []

        def produce(p: int) -> None:
            try:
                bodies = [b"%d:%d" % (p, i) for i in range(per_producer)]
                for i in range(0, per_producer, per_txn):
                    with ch.transaction() as tx:
                        if i % 2:
                            tx.put_many(bodies[i : i + per_txn])
                        else:
                            for b in bodies[i : i + per_txn]:
                                tx.put(b)
            except BaseException as exc:
                errors.append(exc)

        def consume(c: int) -> None:
            try:
                n = 0
                while True:
                    tx = ch.transaction()
                    evs = tx.take_batch(5, timeout=0.05)
                    if n % 3 == 2:
                        tx.rollback()  # some rollbacks, to shuffle events back
                    else:
                        tx.commit()
                        got[c].extend(evs)
                    n += 1
                    if not evs and done.is_set() and ch.size == 0:
                        return
            except BaseException as exc:
                errors.append(exc)

        ps = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        cs = [threading.Thread(target=consume, args=(c,)) for c in range(consumers)]
        for t in ps + cs:
            t.start()
        for t in ps:
            t.join()
        done.set()
        for t in cs:
            t.join(60)
        assert not errors
        everything = [e for g in got for e in g]
        bodies = [e.body for e in everything]
        assert len(bodies) == len(set(bodies)) == producers * per_producer
        assert set(bodies) == {b"%d:%d" % (p, i) for p in range(producers) for i in range(per_producer)}
        positions = sorted(e.position for e in everything)  # type: ignore[type-var]
        assert positions == list(range(producers * per_producer))
        # Each producer's events got increasing positions (its commits were in order).
        for p in range(producers):
            mine = sorted((e for e in everything if e.body.startswith(b"%d:" % p)), key=lambda e: e.position)
            assert [e.body for e in mine] == [b"%d:%d" % (p, i) for i in range(per_producer)]
        st = ch.stats()
        assert st["takes_committed"] == st["puts_committed"] == producers * per_producer
        assert st["inflight_puts"] == st["inflight_takes"] == 0
        if cache_bytes == 0:
            assert st["cache_hits"] == 0
        if cache_bytes is not None:  # taken again after a rollback: from disk (the cache gave them out)
            assert st["disk_reads"] >= producers * per_producer


# -- restart --------------------------------------------------------------------------------------------------


def test_restart_after_clean_close_keeps_queue_and_positions(chan_dir: str) -> None:
    with opn(chan_dir, max_file_size=8192) as ch:
        put_all(ch, [b"r%d" % i for i in range(200)], per_txn=9)
        with ch.transaction() as tx:
            tx.take_batch(50)
        next_pos = ch.stats()["next_position"]
    for _ in range(2):
        with opn(chan_dir, max_file_size=8192) as ch:
            assert ch.size == 150
            assert ch.stats()["next_position"] == next_pos
    with opn(chan_dir, max_file_size=8192) as ch:
        with ch.transaction() as tx:
            tx.put(b"new")
        evs = drain(ch)
    assert [(e.body, e.position) for e in evs] == [(b"r%d" % i, i) for i in range(50, 200)] + [(b"new", 200)]


def test_full_replay_matches_checkpoint_replay(chan_dir: str) -> None:
    with opn(chan_dir, max_file_size=8192) as ch:
        put_all(ch, [b"f%d" % i for i in range(100)], per_txn=9)
        with ch.transaction() as tx:
            tx.take_batch(30)
    with opn(chan_dir, max_file_size=8192, replay="full") as ch:
        assert [(e.body, e.position) for e in drain(ch)] == [(b"f%d" % i, i) for i in range(30, 100)]


def test_two_data_dirs(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    dirs = [str(tmp_path / "disk1"), str(tmp_path / "disk2")]
    opts = {"data_dirs": dirs, "max_file_size": 8192}
    with opn(d, **opts) as ch:
        for i in range(40):
            with ch.transaction() as tx:
                for j in range(3):
                    tx.put(b"%d.%d" % (i, j))
        with ch.transaction() as tx:
            tx.take_batch(10)
        tx = ch.transaction()
        tx.put(b"rolled")
        tx.rollback()
    assert all(any(n.endswith(".wal") for n in os.listdir(x)) for x in dirs)
    assert not os.path.exists(os.path.join(d, "data")) or not os.listdir(os.path.join(d, "data"))
    # Every record of one transaction is in one directory.
    log = Log(d, filechannel.ChannelConfig(data_dirs=tuple(dirs)), readonly=True)
    try:
        where: dict[int, set[str]] = {}
        woids = []
        for r in log.replay():
            woids.append(r.woid)
            if r.txn_id:
                where.setdefault(r.txn_id, set()).add(os.path.dirname(log.file_path(r.file_id)))
    finally:
        log.close()
    assert woids == sorted(woids)
    assert len(woids) == len(set(woids))
    assert all(len(s) == 1 for s in where.values())
    assert {x for s in where.values() for x in s} == set(dirs)
    # Restart merges the directories back into one queue, in position order.
    with opn(d, **opts) as ch:
        evs = drain(ch)
    expect = [b"%d.%d" % (i, j) for i in range(40) for j in range(3)][10:]
    assert [e.body for e in evs] == expect
    assert [e.position for e in evs] == list(range(10, 120))


# -- file retirement --------------------------------------------------------------------------------------------


def test_drained_files_are_deleted(chan_dir: str) -> None:
    with opn(chan_dir, max_file_size=4096) as ch:
        put_all(ch, [b"z" * 200] * 200, per_txn=5)
        assert len(data_files(chan_dir)) > 10
        drain(ch)
        st = ch.stats()
        assert st["files"] == len(data_files(chan_dir))
        assert st["files"] <= 2, data_files(chan_dir)
        assert st["files_retired"] > 10
    with opn(chan_dir, max_file_size=4096) as ch:
        assert ch.size == 0
        assert len(data_files(chan_dir)) <= 2


def test_drained_files_are_deleted_in_the_background(chan_dir: str) -> None:
    with opn(chan_dir, max_file_size=4096, background=True) as ch:
        put_all(ch, [b"z" * 200] * 100, per_txn=5)
        drain(ch)
        deadline = time.monotonic() + 10
        while len(data_files(chan_dir)) > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(data_files(chan_dir)) <= 2


def test_one_stuck_old_event_does_not_keep_newer_drained_files(chan_dir: str) -> None:
    with opn(chan_dir, max_file_size=4096) as ch:
        put_all(ch, [b"stuck"])
        put_all(ch, [b"z" * 200] * 200, per_txn=5)
        n_before = len(data_files(chan_dir))
        assert n_before > 10
        holder = ch.transaction()
        assert holder.take().body == b"stuck"  # type: ignore[union-attr]
        drain(ch)
        ch.retire_files()
        left = data_files(chan_dir)
        # The stuck event's file and the newest file(s), not the ones in between.
        assert len(left) <= 3, left
        assert "seg-0000000000000001.wal" in left
        holder.rollback()
    with opn(chan_dir, max_file_size=4096) as ch:
        assert [(e.body, e.position) for e in drain(ch)] == [(b"stuck", 0)]
        assert len(data_files(chan_dir)) <= 3
    with opn(chan_dir, max_file_size=4096, replay="full") as ch:
        assert ch.size == 0


# -- fsync modes and stats ----------------------------------------------------------------------------------------


def test_fsync_commit_syncs_every_commit(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"a"])
        before = ch.stats()["fsyncs"]
        for _ in range(5):
            put_all(ch, [b"a"])
        assert ch.stats()["fsyncs"] - before == 5


def test_fsync_interval_syncs_in_the_background(chan_dir: str) -> None:
    with opn(chan_dir, fsync="interval", fsync_interval=60) as ch:
        put_all(ch, [b"a"])
        before = ch.stats()["fsyncs"]
        for _ in range(20):
            put_all(ch, [b"b"])
        assert ch.stats()["fsyncs"] == before  # commits do not fsync
        ch.sync()
        assert ch.stats()["fsyncs"] == before + 1
    with opn(chan_dir, fsync="interval", fsync_interval=0.05) as ch:
        put_all(ch, [b"c"])
        before = ch.stats()["fsyncs"]
        deadline = time.monotonic() + 5
        while ch.stats()["fsyncs"] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ch.stats()["fsyncs"] > before
    with opn(chan_dir) as ch:
        assert [e.body for e in drain(ch)] == [b"a"] + [b"b"] * 20 + [b"c"]


def test_stats_keys(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"a", b"b"])
        tx = ch.transaction()
        tx.take()
        tx.rollback()
        with ch.transaction() as tx:
            tx.take()
        st = ch.stats()
    for key in (
        "puts_attempted",
        "puts_committed",
        "takes_attempted",
        "takes_committed",
        "transactions_committed",
        "rollbacks",
        "commit_failures",
        "channel_full",
        "queue_size",
        "inflight_puts",
        "inflight_takes",
        "capacity",
        "next_position",
        "head_position",
        "fsyncs",
        "bytes_written",
        "files",
        "disk_bytes",
        "last_woid",
        "torn_tails_truncated",
        "corruptions_skipped",
        "lost_positions",
        "corruption_report",
    ):
        assert key in st, key
    assert st["puts_attempted"] == st["puts_committed"] == 2
    assert st["takes_committed"] == 1
    assert st["rollbacks"] == 1
    assert st["queue_size"] == 1
    assert st["head_position"] == 1
    assert st["next_position"] == 2
    assert st["files"] == 1
    assert st["bytes_written"] > 0
    assert st["disk_bytes"] > 0
    assert st["lost_positions"] == []


# -- torn tails and corruption ---------------------------------------------------------------------------


def test_torn_tail_is_truncated_with_a_warning(chan_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"t%d" % i for i in range(10)], per_txn=3)
    (newest,) = data_files(chan_dir)
    path = os.path.join(chan_dir, "data", newest)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\x01\x00\x00\x00garbage of a half-written batch")
    with caplog.at_level(logging.WARNING, logger="filechannel"), opn(chan_dir) as ch:
        assert os.path.getsize(path) == size
        assert [e.body for e in drain(ch)] == [b"t%d" % i for i in range(10)]
        assert ch.stats()["torn_tails_truncated"] == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "torn tail" in r.getMessage()]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert newest in msg
    assert "35 bytes" in msg
    assert any(".torn-" in n for n in os.listdir(os.path.join(chan_dir, "data")))


def test_torn_tail_half_a_record_is_truncated(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"a"])
    (newest,) = data_files(chan_dir)
    path = os.path.join(chan_dir, "data", newest)
    size = os.path.getsize(path)
    with opn(chan_dir) as ch:
        put_all(ch, [b"b" * 100])
    files = data_files(chan_dir)
    last = os.path.join(chan_dir, "data", files[-1])
    # Cut the last write short, as a crash would (no checkpoint vouches for its length):
    # the commit of b"b..." was never acknowledged, in effect.
    shutil.rmtree(os.path.join(chan_dir, "checkpoints"))
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 20)
    with opn(chan_dir) as ch:
        assert os.path.getsize(path) == size
        assert os.path.getsize(last) == 88  # only the header of the cut file is left
        assert [e.body for e in drain(ch)] == [b"a"]


def _fill_two_files(chan_dir: str) -> tuple[str, int]:
    """Return (path of the oldest data file, offset of its first record)."""
    with opn(chan_dir, max_file_size=4096) as ch:
        put_all(ch, [b"c" * 300] * 30, per_txn=2)
    files = data_files(chan_dir)
    assert len(files) > 2
    path = os.path.join(chan_dir, "data", files[0])
    with open(path, "rb") as f:
        head = f.read(4096)
    from filechannel import format as fmt

    h = fmt.decode_file_header(head)
    assert isinstance(h, fmt.FileHeader)
    return path, h.header_len


def test_flipped_byte_in_an_older_file_is_corruption(chan_dir: str) -> None:
    path, first = _fill_two_files(chan_dir)
    with open(path, "r+b") as f:
        f.seek(first + 100)
        b = f.read(1)
        f.seek(first + 100)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(filechannel.CorruptLogError) as ei:
        opn(chan_dir, max_file_size=4096, replay="full")
    assert ei.value.path == path
    assert ei.value.offset == first  # the damaged record starts there
    assert str(first) in str(ei.value)

    # A checkpoint may let the open skip that file; the damage then surfaces on the take.
    def open_and_take() -> None:
        with opn(chan_dir, max_file_size=4096) as ch, ch.transaction() as tx:
            tx.take_batch(5)

    with pytest.raises(filechannel.CorruptLogError) as ei2:
        open_and_take()
    assert ei2.value.path == path
    assert ei2.value.offset == first
    # on_corruption="skip" opens, keeps the rest and reports exactly what was lost.
    with opn(chan_dir, max_file_size=4096, replay="full", on_corruption="skip") as ch:
        st = ch.stats()
        assert st["corruptions_skipped"] >= 1
        assert st["corruption_report"]
        assert 0 < ch.size < 30


def test_missing_live_file_is_corruption(chan_dir: str) -> None:
    path, _ = _fill_two_files(chan_dir)
    os.unlink(path)
    with pytest.raises(filechannel.CorruptLogError) as ei:
        opn(chan_dir, max_file_size=4096, replay="full")
    assert ei.value.path == path


def test_foreign_data_file_is_rejected(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for d in (a, b):
        with opn(d) as ch:
            put_all(ch, [b"x"])
    os.replace(os.path.join(b, "data", data_files(b)[0]), os.path.join(a, "data", "seg-0000000000000009.wal"))
    with pytest.raises(filechannel.CorruptLogError, match="another channel"):
        opn(a)


def test_not_a_channel_directory(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    with pytest.raises(filechannel.NotAChannelError):
        opn(tmp_path / "x")
    (tmp_path / "f").write_text("plain file")
    with pytest.raises(filechannel.NotAChannelError):
        opn(tmp_path / "f")


def test_retirement_racing_with_file_rolls_reopens_cleanly(tmp_path: Path) -> None:
    """Producers roll files while consumers' commits retire old ones; a clean close must reopen.

    A retired file must never be listed as live in the header of a file the writer starts
    (a regression: the newest header named unlinked files, and the next open failed).
    """
    for trial in range(3):
        d = str(tmp_path / f"ch{trial}")
        ch = filechannel.open(
            d, max_file_size=4096, minimum_required_space=0, fsync="interval", fsync_interval=10, checkpoint_interval=0
        )
        stop = time.monotonic() + 0.5

        def produce(ch: filechannel.FileChannel = ch, stop: float = stop) -> None:
            while time.monotonic() < stop:
                with ch.transaction() as tx:
                    for _ in range(3):
                        tx.put(b"p" * 300)

        def consume(ch: filechannel.FileChannel = ch, stop: float = stop) -> None:
            while time.monotonic() < stop + 0.1:
                with ch.transaction() as tx:
                    tx.take_batch(20)

        ts = [threading.Thread(target=produce) for _ in range(3)] + [threading.Thread(target=consume) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        n = ch.size
        assert ch.stats()["files_retired"] > 0
        ch.close()
        with opn(d, replay="full") as ch2:
            assert ch2.size == n


def test_put_waiting_on_a_closing_channel_raises_closed(chan_dir: str) -> None:
    ch = opn(chan_dir, capacity=1, transaction_capacity=1, keep_alive=10)
    put_all(ch, [b"full"])
    errors: list[BaseException] = []
    assert_close_wakes(ch, lambda: ch.transaction().put(b"waits"), errors)


# -- put_many --------------------------------------------------------------------------------------


def test_put_many_is_put_in_a_loop(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        with ch.transaction() as tx:
            tx.put(b"first")
            tx.put_many([b"a", bytearray(b"b"), memoryview(b"c")], headers={"k": "v"})
            tx.put_many([])
            tx.put_many(iter([b"d"]))
        evs = drain(ch)
    assert [(e.position, e.body) for e in evs] == [(0, b"first"), (1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")]
    assert [dict(e.headers) for e in evs] == [{}, {"k": "v"}, {"k": "v"}, {"k": "v"}, {}]
    with opn(chan_dir) as ch:  # and after a restart
        assert ch.size == 0


@pytest.mark.parametrize(
    ("bodies", "headers", "exc"),
    [
        ([b"ok", "text"], None, TypeError),
        ([b"ok", Event(b"e")], None, TypeError),
        ([b"ok"], {"k": 1}, TypeError),
        ([b"ok", b"x" * 5000], None, ValueError),
    ],
)
def test_put_many_is_all_or_nothing(chan_dir: str, bodies: list[Any], headers: Any, exc: type) -> None:
    with opn(chan_dir, max_event_size=4096) as ch:
        tx = ch.transaction()
        with pytest.raises(exc):
            tx.put_many(bodies, headers=headers)
        tx.put(b"after")
        tx.commit()
        assert [e.body for e in drain(ch)] == [b"after"]


def test_put_many_capacity_checks(chan_dir: str) -> None:
    with opn(chan_dir, capacity=10, transaction_capacity=5, keep_alive=0.05) as ch:
        tx = ch.transaction()
        tx.put_many([b"x"] * 4)
        with pytest.raises(filechannel.TransactionCapacityError):
            tx.put_many([b"y"] * 2)  # 6 > transaction_capacity, and nothing of it is added
        tx.put(b"z")
        tx.commit()
        with ch.transaction() as t2:
            t2.put_many([b"w"] * 5)
        with pytest.raises(filechannel.ChannelFullError), ch.transaction() as t3:
            t3.put_many([b"v"] * 2)  # 10 queued + 2 > capacity
        assert ch.size == 10
        assert ch.stats()["inflight_puts"] == 0


def test_data_dirs_are_recorded_at_creation(tmp_path: Path) -> None:
    d = tmp_path / "ch"
    dirs = [str(tmp_path / "disk1"), str(tmp_path / "disk2")]
    with opn(d, data_dirs=dirs) as ch:
        put_all(ch, [b"%d" % i for i in range(20)], per_txn=2)
    # Reopened without data_dirs: the recorded ones are used, nothing goes missing.
    with opn(d) as ch:
        assert [e.body for e in drain(ch)] == [b"%d" % i for i in range(20)]
        put_all(ch, [b"more"])
    with pytest.raises(filechannel.ConfigError, match="data_dirs"):
        opn(d, data_dirs=[str(tmp_path / "elsewhere")])
    with opn(d, data_dirs=dirs) as ch:  # the same list is fine
        assert [e.body for e in drain(ch)] == [b"more"]
    assert not (d / "data").exists()


def test_opens_that_only_roll_back_create_no_data_files(chan_dir: str) -> None:
    with opn(chan_dir) as ch:
        put_all(ch, [b"a"])
    for _ in range(5):
        with opn(chan_dir) as ch:
            tx = ch.transaction()
            assert tx.take() is not None
            tx.rollback()
    assert data_files(chan_dir) == ["seg-0000000000000001.wal"]
    with opn(chan_dir) as ch:
        assert [e.body for e in drain(ch)] == [b"a"]


def test_close_while_other_threads_commit_never_hangs(chan_dir: str) -> None:
    ch = opn(chan_dir)
    acked: list[bytes] = []
    outcomes: list[str] = []

    def producer(k: int) -> None:
        i = 0
        try:
            while True:
                body = b"%d-%d" % (k, i)
                with ch.transaction() as tx:
                    tx.put(body)
                acked.append(body)
                i += 1
        except filechannel.ChannelClosedError:
            outcomes.append("closed")

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    ch.close()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a committer hung after close()"
    assert outcomes == ["closed"] * 4
    with opn(chan_dir) as ch2:
        got = {e.body for e in drain(ch2)}
    assert set(acked) <= got  # every acknowledged commit survived the close


# -- invalid events (issue 13): ChannelError subclasses, strict UTF-8 headers ----------------------


def test_too_large_event_is_an_event_too_large_error(chan_dir: str) -> None:
    with opn(chan_dir, max_file_size=8192, max_event_size=4096) as ch:
        tx = ch.transaction()
        with pytest.raises(filechannel.EventTooLargeError) as ei:
            tx.put(b"x" * 4093)  # 4 bytes of header count + 4093 = 4097
        err = ei.value
        assert (err.size, err.limit) == (4097, 4096)
        assert isinstance(err, filechannel.InvalidEventError)
        assert isinstance(err, filechannel.ChannelError)
        assert isinstance(err, ValueError)
        assert "max_event_size=4096" in str(err)
        assert "larger max_event_size=" in str(err)  # names the fix
        tx.put(b"x" * 4092)  # exactly the limit is fine
        with pytest.raises(filechannel.EventTooLargeError) as ei2:
            tx.put_many([b"ok", b"y" * 5000])
        assert (ei2.value.size, ei2.value.limit) == (5004, 4096)
        tx.commit()
        assert [len(e.body) for e in drain(ch)] == [4092]


@pytest.mark.parametrize(
    ("headers", "named"),
    [({"k\ud800": "v"}, "key"), ({"ok": "fine", "k": "v\udcff"}, "value")],
    ids=["lone-surrogate-key", "surrogate-escape-value"],
)
def test_header_that_is_not_utf8_is_refused_naming_the_header(
    chan_dir: str, headers: dict[str, str], named: str
) -> None:
    bad_key = next(k for k, v in headers.items() if k != "ok")
    with opn(chan_dir) as ch:
        before = ch.stats()["bytes_written"]
        tx = ch.transaction()
        for call in (lambda: tx.put(b"body", headers), lambda: tx.put_many([b"a", b"b"], headers=headers)):
            with pytest.raises(filechannel.InvalidEventError) as ei:
                call()
            assert not isinstance(ei.value, filechannel.EventTooLargeError)
            assert isinstance(ei.value, filechannel.ChannelError)
            assert repr(bad_key) in str(ei.value)
            assert f"its {named} is not valid UTF-8" in str(ei.value)
        assert ch.stats()["inflight_puts"] == 0
        assert ch.stats()["bytes_written"] == before
        tx.put(b"after", {"k": "v"})  # the transaction is still open and usable
        tx.commit()
        assert [(e.body, dict(e.headers)) for e in drain(ch)] == [(b"after", {"k": "v"})]


def test_headers_stored_before_strict_utf8_still_read_back(chan_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records written with the old surrogatepass encoding must still decode."""
    from filechannel import format as fmt

    def old_encode_event(body: bytes, headers: Any) -> bytes:
        if not headers:
            return fmt.EMPTY_HEADERS + body
        parts = [len(headers).to_bytes(4, "little")]
        for k, v in headers.items():
            kb, vb = k.encode("utf-8", "surrogatepass"), v.encode("utf-8", "surrogatepass")
            parts += (len(kb).to_bytes(4, "little"), len(vb).to_bytes(4, "little"), kb, vb)
        return b"".join([*parts, body])

    assert old_encode_event(b"b", {"a": "c"}) == fmt.encode_event(b"b", {"a": "c"})  # same layout
    with monkeypatch.context() as m:
        m.setattr(fmt, "encode_event", old_encode_event)
        with opn(chan_dir) as ch, ch.transaction() as tx:
            tx.put(b"old", {"k\ud800": "v\udcff"})
    with opn(chan_dir) as ch:
        evs = drain(ch)
    assert [(e.body, dict(e.headers)) for e in evs] == [(b"old", {"k\ud800": "v\udcff"})]


def test_new_errors_are_exported() -> None:
    for name in ("InvalidEventError", "EventTooLargeError"):
        assert name in filechannel.__all__
        assert issubclass(getattr(filechannel, name), filechannel.ChannelError)


def test_too_many_live_files_is_a_clear_error_and_the_channel_stays_usable(
    chan_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from filechannel import format as fmt_mod

    with filechannel.open(chan_dir, minimum_required_space=0, background=False, max_file_size=4096) as ch:
        for _ in range(4):
            with ch.transaction() as tx:
                tx.put(b"x" * 3000)  # one file each: every file stays live
        real = fmt_mod.FileHeader.header_len
        monkeypatch.setattr(
            fmt_mod.FileHeader, "header_len", property(lambda h: 0x10000 if h.live_files else real.fget(h))
        )  # type: ignore[attr-defined]
        tx = ch.transaction()
        tx.put(b"y" * 3000)
        with pytest.raises(filechannel.ChannelFullError, match="raise max_file_size"):
            tx.commit()
        monkeypatch.undo()
        with ch.transaction() as tx2:
            assert len(tx2.take_batch(10)) == 4


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20])
def test_events_with_and_without_headers_mix_in_one_transaction(chan_dir: str, cache_bytes: int) -> None:
    """A transaction whose puts have no headers frames them behind one shared empty header
    block; a put with headers in the same transaction (before or after) changes nothing seen."""
    hdr = {"k": "v"}
    want: list[tuple[bytes, dict[str, str]]] = []
    with opn(chan_dir, cache_bytes=cache_bytes) as ch:
        with ch.transaction() as tx:  # plain, then headers, then plain again
            tx.put_many([b"a", b"b"])
            tx.put(b"c", hdr)
            tx.put(b"d")
            tx.put_many([b"e"], hdr)
            tx.put_many([b"f", b""])
        want += [(b"a", {}), (b"b", {}), (b"c", hdr), (b"d", {}), (b"e", hdr), (b"f", {}), (b"", {})]
        tx = ch.transaction()  # a rolled-back transaction with headers leaves the next one plain
        tx.put(b"x", hdr)
        tx.rollback()
        with ch.transaction() as tx:
            tx.put_many([b"g"])
            tx.put(b"h")
        want += [(b"g", {}), (b"h", {})]
        with ch.transaction() as tx:
            got = [(e.body, dict(e.headers)) for e in tx.take_batch(100)]
            tx.rollback()
        assert got == want
    with opn(chan_dir) as ch:  # and read back from the data files after a restart
        assert [(e.body, dict(e.headers)) for e in drain(ch)] == want
    with pytest.raises(filechannel.EventTooLargeError), opn(chan_dir, max_event_size=8) as ch:
        ch.transaction().put_many([b"1234", b"12345"])  # 5 bytes + the 4-byte header block > 8
