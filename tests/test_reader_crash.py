"""SIGKILL of a ChannelReader process: between read and ack, between ack and the owner applying it, in a loop.

The reader runs in a subprocess (``sys.executable -c CODE``) and is killed with
SIGKILL; the owner runs in the test process (or is opened afterwards). What
must hold: delivery resumes at the durable acknowledged mark (at-least-once at
the reader), the owner takes every position below the mark exactly once and
nothing at or above it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from simfs import SimFS

import filechannel
from filechannel import ChannelReader, cli
from filechannel._fs import DEFAULT_FS
from filechannel.consumers import ConsumerStore

OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False, "checkpoint_interval": 0}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def body(i: int, size: int = 60) -> bytes:
    tag = b"ev-%06d|" % i
    return tag + b"x" * max(0, size - len(tag))


def put_range(ch: filechannel.FileChannel, a: int, b: int) -> None:
    with ch.transaction() as tx:
        for i in range(a, b):
            tx.put(body(i), headers={"i": str(i)} if i % 3 == 0 else None)


def queued(ch: filechannel.FileChannel) -> list[int]:
    """The owner's queued positions, read without a take (takes are refused while consumers are registered)."""
    with ch._lock:
        return [e[0] for e in ch._queue]


def durable_mark(d: str) -> int:
    state = ConsumerStore(DEFAULT_FS, d).get("c")
    assert state is not None
    return state.acked


def committed_takes(d: str) -> list[int]:
    """Every position a committed TAKE record removes, once per record (``filechannel dump``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["dump", d]) == 0
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    committed = {r["txn"] for r in recs if r["op"] == "commit"}
    return sorted(
        p for r in recs if r["op"] == "take" and r["txn"] in committed for a, b in r["positions"] for p in range(a, b)
    )


def wait_for(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return bool(cond())


def spawn(code: str, *args: str, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=stdout, env=ENV, text=True
    )


def kill(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert p.returncode == -signal.SIGKILL


# (a) and (b): one reader, killed at a chosen point ------------------------------------------

_READ_THEN_WAIT = r"""
import json, sys
from filechannel import ChannelReader
d, n = sys.argv[1], int(sys.argv[2])
r = ChannelReader(d, consumer="c")
start, end = r.available()
evs = r.read(start, min(end, start + n))
print(json.dumps([start, end, [[e.position, e.body.hex(), dict(e.headers)] for e in evs]]), flush=True)
sys.stdin.readline()  # killed here: read, not acknowledged
r.ack(evs[-1].position + 1)
print("acked", flush=True)
"""

_ACK_THEN_WAIT = r"""
import json, sys
from filechannel import ChannelReader
d, n = sys.argv[1], int(sys.argv[2])
r = ChannelReader(d, consumer="c")
start, end = r.available()
evs = r.read(start, min(end, start + n))
mark = r.ack(evs[-1].position + 1)
print(json.dumps([start, mark, [e.position for e in evs]]), flush=True)
sys.stdin.readline()  # killed here: acknowledged, the owner may not have applied it yet
"""


def _make_channel(d: str, n: int, first_ack: int) -> None:
    with filechannel.open(d, **OPTS) as ch:
        for i in range(0, n, 10):
            put_range(ch, i, i + 10)
    with ChannelReader(d, consumer="c") as r:  # an earlier run of the consumer acknowledged a prefix
        assert r.available() == (0, n)
        r.ack(first_ack)


@pytest.mark.parametrize("owner", ["opened_after", "running"])
def test_kill_between_read_and_ack_rereads_exactly_that_range(tmp_path: Path, owner: str) -> None:
    d = str(tmp_path / "ch")
    _make_channel(d, 50, 10)
    ch = filechannel.open(d, **{**OPTS, "background": True}, ack_interval=0.02) if owner == "running" else None
    try:
        p = spawn(_READ_THEN_WAIT, d, "25")
        assert p.stdout is not None
        start, end, got = json.loads(p.stdout.readline())
        kill(p)
        assert (start, end) == (10, 50)
        assert [g[0] for g in got] == list(range(10, 35))
        assert durable_mark(d) == 10  # the ack never happened
        if ch is not None:
            time.sleep(0.1)  # several ack intervals: the owner takes only below the old mark
            assert queued(ch) == list(range(10, 50))
        # a new reader resumes at the old acknowledged mark and re-reads exactly that range
        with ChannelReader(d, consumer="c") as r:
            assert r.acked == 10
            assert r.available() == (10, 50)
            again = r.read(10, 35)
            assert [[e.position, e.body.hex(), dict(e.headers)] for e in again] == got
            assert all(e.body == body(e.position) for e in again)
    finally:
        if ch is not None:
            ch.close()
    with filechannel.open(d, **OPTS) as ch2:
        assert queued(ch2) == list(range(10, 50))
    assert committed_takes(d) == list(range(10))


@pytest.mark.parametrize("owner", ["opened_after", "running"])
def test_kill_between_ack_and_the_owner_applying_it(tmp_path: Path, owner: str) -> None:
    d = str(tmp_path / "ch")
    _make_channel(d, 50, 10)
    ch = filechannel.open(d, **{**OPTS, "background": True}, ack_interval=0.02) if owner == "running" else None
    try:
        p = spawn(_ACK_THEN_WAIT, d, "25")
        assert p.stdout is not None
        start, mark, read = json.loads(p.stdout.readline())
        kill(p)
        assert (start, mark) == (10, 35)
        assert read == list(range(10, 35))
        assert durable_mark(d) == 35
        if ch is None:
            ch = filechannel.open(d, **OPTS)  # no owner was running: applied at open
        else:
            assert wait_for(lambda: ch is not None and queued(ch) == list(range(35, 50)))
        assert queued(ch) == list(range(35, 50))  # everything above the mark is still there
        assert ch.stats()["head_position"] == 35
        # a new reader's available() starts at the mark
        with ChannelReader(d, consumer="c") as r:
            assert r.available() == (35, 50)
            assert [e.position for e in r.read(35, 50)] == list(range(35, 50))
        ch.apply_acks()  # again: nothing left below the mark
    finally:
        if ch is not None:
            ch.close()
    with filechannel.open(d, **OPTS) as ch2:  # a restart applies nothing twice
        assert ch2.stats()["acked_events_taken"] == 0
        assert queued(ch2) == list(range(35, 50))
    # every position below the mark was taken exactly once, none above it
    assert committed_takes(d) == list(range(35))


def test_a_restarted_reader_deletes_the_temporary_file_a_kill_mid_ack_left(tmp_path: Path) -> None:
    # A leftover ``.<name>.ack.tmp-<pid>-<ns>`` (a kill in the middle of ack()) is deleted by
    # the next registration of that name, also when the consumer is already registered (the
    # usual case: the same reader restarting).
    d = str(tmp_path / "ch")
    _make_channel(d, 20, 5)
    consumers = Path(d, "consumers")
    stale = consumers / ".c.ack.tmp-999999-1"  # what a SIGKILL between create and rename leaves
    stale.write_bytes((consumers / "c.ack").read_bytes()[:40])
    with ChannelReader(d, consumer="c") as r:  # the restarted reader
        assert r.available() == (5, 20)
        r.ack(10)
    assert durable_mark(d) == 10
    assert sorted(os.listdir(consumers)) == ["c.ack"]


# (c): a crash loop ----------------------------------------------------------------------------

_LOOP = r"""
import sys, time
from filechannel import ChannelReader
d, mode, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = ChannelReader(d, consumer="c")
cur = r.available()[0]
print("S", cur, flush=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not (mode == "drain" and cur >= total):
    start, end = r.available()
    cur = max(cur, start)
    if end <= cur:
        time.sleep(0.001)
        continue
    evs = r.read(cur, end, limit=40)
    for e in evs:
        if e.body[:10] != b"ev-%06d|" % e.position:
            print("BAD", e.position, flush=True)
    cur = evs[-1].position + 1
    print("R", " ".join(str(e.position) for e in evs), flush=True)
    if mode == "ack":
        r.ack(cur)
        print("A", cur, flush=True)
"""


def _parse(path: Path) -> tuple[int, list[list[int]], list[int]]:
    """Return the start mark, the position lists of complete read lines, the printed acks."""
    text = path.read_text()
    lines = text.split("\n")[:-1]  # a line cut by the kill has no newline
    assert lines, text[:200]
    assert lines[0].startswith("S "), text[:200]
    start = int(lines[0].split()[1])
    reads: list[list[int]] = []
    acks: list[int] = []
    for line in lines[1:]:
        kind, *rest = line.split()
        assert kind != "BAD", f"the reader returned a wrong body: {line}"
        if kind == "R":
            reads.append([int(x) for x in rest])
        else:
            assert kind == "A", line
            acks.append(int(rest[0]))
    return start, reads, acks


def _wait_started(path: Path, p: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and p.poll() is None:
        if "\n" in path.read_text():
            return
        time.sleep(0.002)
    raise AssertionError(f"reader did not start (rc {p.poll()}): {path.read_text()[:500]}")


@pytest.mark.slow
def test_reader_crash_loop_against_a_live_owner(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d = str(tmp_path / "ch")
    ch = filechannel.open(d, **{**OPTS, "background": True}, max_file_size=32768, ack_interval=0.02)
    stop = threading.Event()
    failure: list[BaseException] = []
    nxt = 0

    def producer() -> None:
        nonlocal nxt
        prng = random.Random(seed + 1)
        try:
            while not stop.is_set():
                k = prng.randint(1, 12)
                put_range(ch, nxt, nxt + k)
                nxt += k
                if prng.random() < 0.1:
                    tx = ch.transaction()
                    tx.put(b"rolled back")
                    tx.rollback()
                time.sleep(0.001)
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)

    put_range(ch, 0, 20)
    nxt = 20
    t = threading.Thread(target=producer, daemon=True)
    t.start()
    delivered: dict[int, list[int]] = {}  # position -> rounds that printed it
    marks = [0]  # the durable mark before round 1, after round 1, ...
    try:
        with ChannelReader(d, consumer="c") as first:  # register before the owner may take anything
            assert first.available()[0] == 0
        for rnd in range(1, 11):
            out = tmp_path / f"round-{rnd}.out"
            with out.open("w") as f:
                p = spawn(_LOOP, d, "ack", "0", stdout=f)
            try:
                _wait_started(out, p)
                time.sleep(rng.uniform(0.0, 0.3))
            finally:
                kill(p)
            assert not failure, failure
            start, reads, acks = _parse(out)
            mark = durable_mark(d)
            ctx = f"seed {seed}, round {rnd}: start {start}, marks {marks}, mark {mark}, acks {acks[-3:]}"
            # a new reader resumes exactly at the durable mark: nothing below it is redelivered
            assert start == marks[-1], ctx
            printed = [x for r in reads for x in r]
            assert printed == list(range(start, start + len(printed))), ctx  # in order, no gap, no repeat
            # the durable mark is the last printed ack, or the ack of the last read whose line was
            # printed (killed after the ack's rename, before printing it)
            assert mark in {start, *(r[-1] + 1 for r in reads)}, ctx
            assert mark >= max(acks, default=start), ctx
            for x in printed:
                delivered.setdefault(x, []).append(rnd)
            marks.append(mark)
            # the owner never takes at or above the durable mark
            committed = nxt  # every position below it is published (read before the queue)
            held = set(queued(ch))
            assert all(x in held for x in range(mark, committed)), ctx
        stop.set()
        t.join(10)
        assert not failure, failure
        total = ch.stats()["next_position"]
        assert total == nxt
        final_mark = marks[-1]
        # a last reader reads everything from the mark to the end and acknowledges nothing
        out = tmp_path / "final.out"
        with out.open("w") as f:
            p = spawn(_LOOP, d, "drain", str(total), stdout=f)
        assert p.wait(timeout=60) == 0
        start, reads, acks = _parse(out)
        assert start == final_mark
        assert acks == []
        printed = [x for r in reads for x in r]
        assert printed == list(range(final_mark, total))
        for x in printed:
            delivered.setdefault(x, []).append(11)
        # no gaps: every committed position reached a reader
        assert sorted(delivered) == list(range(total)), f"seed {seed}"
        # duplicates only in the at-least-once window: a position printed again was not covered
        # by the durable mark left by any earlier round that printed it
        for x, rounds in delivered.items():
            for a in rounds[:-1]:
                assert x >= marks[a], f"seed {seed}: position {x} redelivered after round {a} acked {marks[a]}"
        # the owner holds exactly the positions at or above the final durable mark
        assert wait_for(lambda: queued(ch) == list(range(final_mark, total))), (
            f"seed {seed}: mark {final_mark}, total {total}, queued {queued(ch)[:5]}..."
        )
        assert ch.stats()["consumers"]["c"]["acked"] == final_mark
    finally:
        stop.set()
        t.join(10)
        ch.close()
    with filechannel.open(d, **OPTS) as ch2:
        assert queued(ch2) == list(range(final_mark, total))
    with ChannelReader(d) as view:
        assert view.available() == (final_mark, total)


# power cut after a reader acknowledged what the owner had not synced yet -----------------------

SIM_DIR = "/sim/ch"


@pytest.mark.parametrize("fsync", ["commit", "interval"])
def test_power_cut_after_a_reader_acked_unsynced_events_loses_no_later_event(fsync: str) -> None:
    # A reader may find a batch in the file before the owner's fdatasync (with fsync="commit":
    # between the batch's pwrite and its fdatasync; with fsync="interval": for up to
    # fsync_interval). Were it shown and acked before it is durable, a power cut would take it
    # back, recovery would hand its positions out again, and the stale durable ack would make
    # apply_acks() take new events no consumer read. The reader syncs before it shows.
    fs = SimFS()
    fs.makedirs(SIM_DIR)
    fs.fsync_dir("/sim")
    opts: dict[str, Any] = {**OPTS, "fs": fs, "fsync": fsync, "fsync_interval": 3600}
    ch = filechannel.open(SIM_DIR, **opts)
    reader = ChannelReader(SIM_DIR, consumer="c", fs=fs)
    assert reader.available() == (0, 0)  # registered at 0
    cut: list[SimFS] = []

    def power_cut_after_the_reader_acks(op: str, path: str) -> None:
        # the first write of the batch to a data file: bytes in the file, not yet synced
        if cut or op != "pwrite_all" or not path.endswith(".wal"):
            return
        start, end = reader.available()
        if end > start:
            assert [e.body for e in reader.read(start, end)] == [b"old-%d" % i for i in range(10)]
            reader.ack(end)
            cut.append(fs.crash(0, "drop"))

    fs.on_op = power_cut_after_the_reader_acks
    with ch.transaction() as tx:
        for i in range(10):
            tx.put(b"old-%d" % i)
    fs.on_op = None
    if fsync == "commit":
        assert cut, "the reader never saw the batch between its write and its fdatasync"
    if not cut:  # fsync="interval": the reader looks any time before the background sync
        power_cut_after_the_reader_acks("pwrite_all", ".wal")
    assert cut, "the reader never saw the batch before it was synced"
    ch.close()
    after = cut[0]
    assert ConsumerStore(after, SIM_DIR).get("c") is not None
    with filechannel.open(SIM_DIR, **{**opts, "fs": after}) as ch2:
        with ch2.transaction() as tx:  # committed (and synced) after the restart
            for i in range(5):
                tx.put(b"new-%d" % i)
        new = queued(ch2)
        ch2.apply_acks()
        assert queued(ch2) == new, "the owner took events committed after the power cut that no consumer read"
    with ChannelReader(SIM_DIR, consumer="c", fs=after) as r2:
        start, end = r2.available()
        assert [e.body for e in r2.read(start, end)] == [b"new-%d" % i for i in range(5)]
