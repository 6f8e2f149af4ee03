"""Damage found after open follows ``on_corruption``; accessors are safe while files retire (issue 13, items 5, 8).

A cleanly closed channel has a checkpoint that covers every event, so open
reads no event body (``"fail"`` spot-checks a sample). One flipped byte in an
event body then surfaces only when a take reads that event from disk:

* ``"fail"``: the take raises ``CorruptLogError(path, offset)``, that take's
  events go back to the head in order, the channel stays usable, and the
  remedy the message names (``on_corruption='skip'``) drains everything else;
* ``"skip"``: the take drops exactly the damaged event, durably (a restart,
  even one killed with SIGKILL, never brings it back), logs it, counts it in
  ``stats()`` and lists it in ``lost_positions``, and returns the rest.

And ``stats()``, ``size`` and ``checkpoint()`` can be polled from another
thread while a consumer drains and the background thread retires files.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import contents, put_records

import filechannel
from filechannel import format as fmt

OPTS: dict[str, Any] = {"minimum_required_space": 0}
N = 200
PER_TXN = 50
# Not in the sample "fail" spot-checks at open (for 200 events: 0, 12, 24, ..., 192, 199),
# nor the first or last event of a transaction.
VICTIM = 101
REMEDY = "on_corruption='skip'"

State = list[tuple[int, bytes]]


def body_of(p: int) -> bytes:
    return b"event-%05d|" % p + b"." * (40 + p % 13)


def expected(positions: range, minus: int | None = VICTIM) -> State:
    return [(p, body_of(p)) for p in positions if p != minus]


def put_events(ch: filechannel.FileChannel) -> None:
    for i in range(0, N, PER_TXN):
        with ch.transaction() as tx:
            tx.put_many([body_of(p) for p in range(i, i + PER_TXN)])


def build(d: str) -> None:
    """A channel of N events in N / PER_TXN transactions, closed cleanly (a checkpoint covers it all)."""
    with filechannel.open(d, **OPTS) as ch:
        put_events(ch)
        assert ch.size == N


def find_put(d: str, body: bytes) -> tuple[str, fmt.Record]:
    """The data file and the PUT record (offsets are file offsets) that hold the event ``body``."""
    for path, _fid, rec, _seed in put_records(d):
        if fmt.decode_event(rec.payload)[0] == body:
            return path, rec
    raise AssertionError(f"no PUT record holds {body!r}")


def damage(d: str, position: int = VICTIM) -> tuple[str, int]:
    """Flip one byte inside the body of the event at ``position``; return (data file, record offset)."""
    body = body_of(position)
    path, rec = find_put(d, body)
    payload_at = rec.offset + fmt.RECORD_HEADER_LEN
    assert rec.payload.endswith(body)
    at = payload_at + len(rec.payload) - len(body) + 3  # a byte of the body itself
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))
    return path, rec.offset


def same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def assert_names_file_and_remedy(exc: filechannel.CorruptLogError, path: str, offset: int) -> None:
    assert same_file(exc.path, path)
    assert exc.offset == offset
    assert exc.path in str(exc)
    assert REMEDY in str(exc)


def open_damaged(tmp_path: Path, how: str, **kw: Any) -> tuple[filechannel.FileChannel, str, int]:
    """An open channel whose event VICTIM is damaged on disk, found by no read so far.

    ``"reopen"``: built, closed cleanly, damaged, opened again (takes read from disk).
    ``"live"``: damaged on disk while open, with ``cache_bytes=0`` so takes read from disk.
    """
    d = str(tmp_path / "ch")
    if how == "reopen":
        build(d)
        path, off = damage(d)
        ch = filechannel.open(d, **OPTS, **kw)
    else:
        ch = filechannel.open(d, **OPTS, cache_bytes=0, **kw)
        put_events(ch)
        path, off = damage(d)
    assert ch.size == N
    return ch, path, off


# -- the sample checked at open -------------------------------------------------------


def test_open_spot_check_names_the_file_and_a_remedy_that_works(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    build(d)
    path, off = damage(d, 0)  # the head is always in the sample
    with pytest.raises(filechannel.CorruptLogError) as ei:
        filechannel.open(d, **OPTS)
    assert_names_file_and_remedy(ei.value, path, off)
    with filechannel.open(d, **OPTS, on_corruption="skip") as ch:
        assert contents(ch) == expected(range(N), minus=0)


# -- on_corruption="fail" ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["reopen", "live"])
def test_fail_take_raises_returns_its_events_and_the_remedy_works(tmp_path: Path, how: str) -> None:
    d = str(tmp_path / "ch")
    if how == "reopen":
        build(d)
        path, off = damage(d)
        try:
            ch = filechannel.open(d, **OPTS)
        except filechannel.CorruptLogError as exc:  # the open's sample found it: also a correct answer
            assert_names_file_and_remedy(exc, path, off)
            return
    else:
        ch, path, off = open_damaged(tmp_path, how)
    with ch:
        tx = ch.transaction()
        assert [e.position for e in tx.take_batch(50)] == list(range(50))
        with pytest.raises(filechannel.CorruptLogError) as ei:
            tx.take_batch(100)  # 50..149 reaches the damaged event
        assert_names_file_and_remedy(ei.value, path, off)
        assert ch.size == N - 50  # the failed take's 100 events are back; the first 50 stay taken
        assert ch.stats()["inflight_takes"] == 50
        tx.commit()  # the transaction is still usable: it commits its first take
        assert ch.size == N - 50

        # A new transaction takes the returned events again, in the same order, up to the damage.
        with ch.transaction() as tx2:
            assert [(e.position, e.body) for e in tx2.take_batch(VICTIM - 50)] == expected(range(50, VICTIM))
            tx2.rollback()
        for _ in range(2):  # every take that reaches it fails the same way, nothing is dropped
            with pytest.raises(filechannel.CorruptLogError) as ei2, ch.transaction() as tx3:
                tx3.take_batch(N)
            assert ei2.value.offset == off
        assert ch.size == N - 50
        st = ch.stats()
        assert st["lost_positions"] == []
        assert st["damaged_events_dropped"] == 0
        assert st["inflight_takes"] == 0

        # The channel stays usable.
        with ch.transaction() as tx4:
            tx4.put(b"after")
        assert ch.size == N - 50 + 1

    # The remedy named in the message: every other event drains, and only the damaged one is lost.
    with filechannel.open(d, **OPTS, on_corruption="skip") as ch:
        got: State = []
        while True:
            with ch.transaction() as tx5:
                evs = tx5.take_batch(30)
            if not ch.size and not evs:
                break
            got += [(e.position, e.body) for e in evs]
        assert got == [*expected(range(50, N)), (N, b"after")]
        assert ch.stats()["lost_positions"] == [[VICTIM, VICTIM + 1]]
    with filechannel.open(d, **OPTS) as ch:
        assert ch.size == 0


# -- on_corruption="skip" ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["reopen", "live"])
@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_skip_take_drops_exactly_the_damaged_event_durably(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, end: str
) -> None:
    d = str(tmp_path / "ch")
    caplog.set_level(logging.WARNING, logger="filechannel")
    ch, path, off = open_damaged(tmp_path, how, on_corruption="skip")
    with ch:
        tx = ch.transaction()
        evs = tx.take_batch(150)
        # Every event but the damaged one, intact and in order; one more takes its place.
        assert [(e.position, e.body) for e in evs] == expected(range(151))
        if end == "commit":
            tx.commit()
            left = expected(range(151, N))
        else:
            tx.rollback()
            left = expected(range(N))  # the good events return; the damaged one does not
        st = ch.stats()
        assert st["lost_positions"] == [[VICTIM, VICTIM + 1]]
        assert st["damaged_events_dropped"] == 1
        assert st["corruptions_skipped"] == 1
        assert st["inflight_takes"] == 0
        assert st["open_transactions"] == 0
        assert len(st["corruption_report"]) == 1
        assert path in st["corruption_report"][0]
        assert str(VICTIM) in st["corruption_report"][0]
        loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(path in m and f"byte {off}" in m and str(VICTIM) in m for m in loud), loud
        assert ch.size == len(left)
        assert contents(ch) == left
        assert ch.stats()["damaged_events_dropped"] == 1  # found once, dropped once
    # The drop is durable: after a restart, in either mode, it never comes back and nothing else is lost.
    for mode in ("skip", "fail", "skip"):
        with filechannel.open(d, **OPTS, on_corruption=mode) as ch:
            assert ch.size == len(left)
            assert contents(ch) == left
            assert ch.stats()["damaged_events_dropped"] == 0


def test_skip_take_of_the_damaged_event_alone(tmp_path: Path) -> None:
    ch, _path, _off = open_damaged(tmp_path, "reopen", on_corruption="skip")
    with ch:
        with ch.transaction() as tx:
            assert [e.position for e in tx.take_batch(VICTIM)] == list(range(VICTIM))
        with ch.transaction() as tx:
            # Only the damaged event is at the head: it is dropped, and the take must not stop there.
            # take() must not return None ("empty") while events are queued behind the dropped one.
            ev = tx.take()
            assert ev is not None, f"take() returned None with {ch.size} events queued"
            assert ev.position == VICTIM + 1


# -- SIGKILL after the drop ----------------------------------------------------------------

_CHILD = r"""
import sys, time
import filechannel

d = sys.argv[1]
ch = filechannel.open(d, minimum_required_space=0, on_corruption="skip")
tx = ch.transaction()
first = [e.position for e in tx.take_batch(150)]  # meets the damaged event: dropped
tx.rollback()
with ch.transaction() as tx:
    second = [e.position for e in tx.take_batch(50)]
print("done", len(first), second[0], second[-1], ch.stats()["lost_positions"], flush=True)
time.sleep(60)
"""


def test_skip_drop_survives_sigkill(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    build(d)
    damage(d)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, d], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None
        line = p.stdout.readline().decode()
    finally:
        p.send_signal(signal.SIGKILL)
        _, err = p.communicate(timeout=30)
    assert line == f"done 150 0 49 [[{VICTIM}, {VICTIM + 1}]]\n", err.decode()
    assert p.returncode == -signal.SIGKILL
    for mode in ("fail", "skip"):
        with filechannel.open(d, **OPTS, on_corruption=mode) as ch:
            assert contents(ch) == expected(range(50, N))


# -- accessors from another thread while files retire --------------------------------------


def test_accessors_polled_from_another_thread_while_files_retire(tmp_path: Path) -> None:
    """stats(), size and checkpoint() in a tight loop while a consumer drains (retire on the background thread).

    Before the fix, ``Log.stats`` iterated the file table while the retire thread removed
    entries: ``RuntimeError: dictionary changed size during iteration``.
    """
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **OPTS, max_file_size=4096, background=True)
    errors: list[BaseException] = []
    stop = threading.Event()
    polls = {"stats": 0, "size": 0, "checkpoint": 0}

    def poll() -> None:
        i = 0
        while not stop.is_set():
            try:
                st = ch.stats()
                assert st["queue_size"] >= 0
                assert st["files"] >= 0
                polls["stats"] += 1
                assert ch.size >= 0
                polls["size"] += 1
                if i % 8 == 0:
                    ch.checkpoint()
                    polls["checkpoint"] += 1
            except BaseException as exc:
                errors.append(exc)
                return
            i += 1

    t = threading.Thread(target=poll, name="poller")
    t.start()
    rounds, per_round = 30, 400
    taken: list[int] = []
    try:
        for r in range(rounds):
            for i in range(0, per_round, 100):
                with ch.transaction() as tx:
                    tx.put_many([b"%06d|" % (r * per_round + i + j) + b"x" * 193 for j in range(100)])
            for _ in range(per_round // 100):
                with ch.transaction() as tx:
                    evs = tx.take_batch(100)
                assert len(evs) == 100
                taken += [e.position or 0 for e in evs]
                for e in evs:
                    assert e.body.startswith(b"%06d|" % e.position)
            if errors:
                break
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert not errors, repr(errors[0])
    assert polls["stats"] > rounds
    assert polls["checkpoint"] > 0
    assert taken == list(range(rounds * per_round))
    deadline = time.monotonic() + 10
    while ch.stats()["files"] > 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the retire thread catches up
    st = ch.stats()
    assert st["queue_size"] == 0
    assert ch.size == 0
    assert st["takes_committed"] == st["puts_committed"] == rounds * per_round
    assert st["files_retired"] > rounds
    assert st["files"] <= 2
    ch.close()
    with filechannel.open(d, **OPTS) as ch2:
        assert ch2.size == 0
        assert ch2.stats()["next_position"] == rounds * per_round
